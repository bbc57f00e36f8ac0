"""The README is the front page, the pages in docs/ hold the rest (`make docs` builds them with
``mkdocs build --strict``, which fails on a broken link or a page missing from mkdocs.yml's nav).
What the build cannot see: the README growing back, and its table of pages falling behind the nav."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def nav_pages(entries: list[Any]) -> Iterator[str]:
    for entry in entries:
        for value in entry.values():
            if isinstance(value, list):
                yield from nav_pages(value)
            else:
                yield value


def test_the_readme_stays_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move sections into docs/ pages"


def test_the_readme_links_every_page_of_the_site() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = {page for page in nav_pages(nav) if page != "index.md"}  # index.md is the README itself
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README.read_text()))
    assert pages - linked == set(), f"mkdocs.yml's nav has pages the README does not link: {pages - linked}"
    assert linked - pages == set(), f"the README links pages mkdocs.yml's nav lacks: {linked - pages}"
