"""The memory report's page, without measuring anything: its sections are numbered once each, in the order
the page shows them, and every "section N" its text names is the number that section has on the page.

(``tests/test_report.py`` builds a real report and loads the page in Chromium; this is the fast half.)
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from harness.report import page
from harness.report.page import SECTIONS, numbered, render, section


def test_numbered_counts_from_one_in_order() -> None:
    assert numbered([("a", "A"), ("b", "B"), ("c", "C")]) == (("a", "1. A"), ("b", "2. B"), ("c", "3. C"))


def test_the_pages_headings_are_numbered_once_in_order() -> None:
    headings = [html.unescape(h) for h in re.findall(r"<h2>(.*?)</h2>", render({}))]
    assert headings == [title for _key, title in SECTIONS]
    numbers = [int(h.split(".", 1)[0]) for h in headings]
    assert numbers == list(range(1, len(SECTIONS) + 1)), headings
    nav = [html.unescape(t) for t in re.findall(r"<nav>(.*?)</nav>", render({}))[0].split("</a>") if t]
    assert [re.sub(r"<a [^>]*>", "", t) for t in nav] == headings


def test_a_reference_names_the_sections_number() -> None:
    keys = [key for key, _title in SECTIONS]
    assert section("breakdown") == f"section {keys.index('breakdown') + 1}"
    # no number written by hand: a section added or moved renumbers every heading and every reference
    source = Path(page.__file__).read_text()
    assert not re.findall(r"section \d", source), "write section(KEY), not a section number"
    assert not re.findall(r'"\d+\. [A-Z]', source), "titles carry no number: numbered() gives them theirs"
