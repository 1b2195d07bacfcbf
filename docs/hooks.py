"""mkdocs hooks (mkdocs.yml `hooks:`): what the site generates rather than repeats.

- `index.md` is the README, its links made relative to the site (`docs/x.md` -> `x.md`; a path
  outside the site becomes code).
- `<!-- settings: module:Class -->` on a line of its own becomes that settings class's table
  (`flywheel.options.reference`: the descriptions `--help` prints, one source for both).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- settings: ([\w.]+):(\w+) -->$", re.MULTILINE)  # on a line of its own
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri == "index.md":
        markdown = readme()
    return MARKER.sub(settings_table, markdown)


def readme() -> str:
    def relink(m: re.Match[str]) -> str:
        text, url = m.group(1), m.group(2)
        if url.startswith(("http://", "https://", "#")):
            return m.group(0)
        if url.startswith("docs/"):
            return f"[{text}]({url.removeprefix('docs/')})"
        return text if text.startswith("`") else f"{text} (`{url}`)"

    return LINK.sub(relink, (ROOT / "README.md").read_text())


def settings_table(m: re.Match[str]) -> str:
    from flywheel.options import reference

    kind = getattr(importlib.import_module(m.group(1)), m.group(2))
    return "\n".join(reference(kind))
