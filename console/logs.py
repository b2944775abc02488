"""Log records as this console wants them."""

from __future__ import annotations

import logging


class ClientErrorsWithoutTraceback(logging.Filter):
    """Django logs a request it refused (a 403 for a missing permission, a 400) with the
    exception's traceback, which reads like a crash to whoever watches the logs: a refusal
    is the console working. Its line stays; the traceback goes. Server errors keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "status_code", 500) < 500:
            record.exc_info = None
            record.exc_text = None
        return True
