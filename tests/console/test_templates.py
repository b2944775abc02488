from __future__ import annotations

from pathlib import Path

BASE_DIR = Path(__file__).resolve().parents[2]


def test_it_keeps_every_short_comment_on_one_line():
    """Django's {# #} ends at the line's end: one spread over lines is shown on the page."""
    templates = [p for p in BASE_DIR.rglob("*.html") if ".venv" not in p.parts]
    assert len(templates) > 5
    broken = [
        f"{path.relative_to(BASE_DIR)}:{number}"
        for path in templates
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "{#" in line and "#}" not in line.split("{#", 1)[1]
    ]
    assert broken == []
