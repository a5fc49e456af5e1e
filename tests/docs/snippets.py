"""The Python snippets of a Markdown page, with the marker that says how each one runs.

A snippet is a ```` ```python ```` fence. The line right before it may carry a marker:

* none: the snippet runs on its own (no servers), in a fresh directory;
* ``<!-- run: postgres rabbitmq -->``: it runs against those services (names of
  ``tests.conftest.SERVICES``): skipped locally when one is down, failed under ``CI=true``;
* ``<!-- run: no -->``: it is not run. Such snippets must be the exception: the docs test lists
  every one of them, so a new one fails until it is listed there, with the reason.

The snippets of one page run in order in one namespace, like the reader would type them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(
    r"(?:<!--\s*run:\s*(?P<marker>[^>]*?)\s*-->\n)?```python\n(?P<code>.*?)```", flags=re.S
)


@dataclass(frozen=True)
class Snippet:
    """One Python fence of a page: its code, the services it needs, whether it runs."""

    page: str
    line: int
    code: str
    services: tuple[str, ...]
    runs: bool


def snippets(path: Path, root: Path) -> list[Snippet]:
    """Every Python snippet of the page at ``path`` (named relative to ``root``)."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        marker = (match["marker"] or "").split()
        runs = marker != ["no"]
        found.append(
            Snippet(
                page=str(path.relative_to(root)),
                line=text.count("\n", 0, match.start("code")) + 1,
                code=match["code"],
                services=tuple(marker) if runs else (),
                runs=runs,
            )
        )
    return found
