"""Which currencies money may be in, and their minor units: ISO 4217 list one, as bundled by
the `iso4217` package (pinned, so a currency's exponent changes only with a reviewed bump)."""

from __future__ import annotations

from iso4217 import Currency

# Active codes with minor units. A code whose minor units ISO 4217 marks "N.A." (gold XAU,
# SDR XDR, the test code XTS, "no currency" XXX) is no money an intent can move: there is no
# integer minor unit to hold, and no provider pays in it. Built once: enum lookups by value
# raise on a miss, and the masking of typed text asks for every three capitals it meets.
_EXPONENTS: dict[str, int] = {
    currency.code: currency.exponent for currency in Currency if currency.exponent is not None
}


def currency_known(code: str) -> bool:
    """An active ISO 4217 currency money can be held in, as the code is written (upper case)."""
    return code in _EXPONENTS


def currency_exponent(code: str) -> int | None:
    """Its minor units as a power of ten (JPY 0, EUR 2, KWD 3), or None for no currency."""
    return _EXPONENTS.get(code)
