"""mkdocs hooks (mkdocs.yml): the site's home page is the repository's README.md.

The README is written for the repository's front page, so its links point into ``docs/``; on the
site the pages sit next to the home page, so ``docs/`` is dropped from them. One text, two
renderings: there is no copy of the README to fall out of date.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parents[1] / "README.md"


def home_page_markdown(readme: str) -> str:
    """The README with its ``](docs/...)`` links made relative to the site's root."""
    return re.sub(r"\]\(docs/", "](", readme)


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    files.append(File.generated(config, "index.md", content=home_page_markdown(README.read_text())))
    return files
