"""What the models and docs/how-we-know.md say they mirror: ``path  Name.attr`` citations.

A citation is a line (inside a model's header comment, or in the page) that names a file under
``src/`` and, after at least two spaces, the names it mirrors there, comma-separated::

    src/idemq/guard/flow.py  message_flow, SaveResultIn
    src/idemq/outbox/relay.py  OutboxRelay._leased_batch: what the text says after the colon

Each name is a top-level name of that file (function, class, assignment) or ``Class.attr`` (a
method, or a class-level field or assignment). A model that cites a name the code no longer has
describes code that is gone, so the check reads the files with :mod:`ast`, not by text search.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CITATION = re.compile(r"(src/idemq/[\w/]+\.py) {2,}([A-Za-z_][\w.]*(?:, *[A-Za-z_][\w.]*)*)")


@dataclass(frozen=True)
class Citation:
    source: str  # the model or page that cites
    path: str
    name: str


def citations(text: str, source: str) -> list[Citation]:
    """Every ``path  Name`` citation in ``text``."""
    found: list[Citation] = []
    for match in CITATION.finditer(text):
        for name in match.group(2).split(","):
            found.append(Citation(source, match.group(1), name.strip()))
    return found


def model_header(text: str) -> str:
    """The leading ``/* ... */`` comment of a Promela model."""
    end = text.find("*/")
    return text[: end + 2] if text.lstrip().startswith("/*") and end >= 0 else ""


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def defined_names(source: str) -> set[str]:
    """The top-level names of a module and ``Class.attr`` for each class-level name."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        names.update(_targets(node))
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                names.update(f"{node.name}.{name}" for name in _targets(member))
    return names


def missing(found: list[Citation], root: Path = ROOT) -> list[str]:
    """The citations that name a file or a name ``root`` does not have (pending ones allowed)."""
    problems: list[str] = []
    cache: dict[str, set[str] | None] = {}
    for citation in found:
        if citation.path not in cache:
            path = root / citation.path
            cache[citation.path] = defined_names(path.read_text()) if path.is_file() else None
        names = cache[citation.path]
        if names is None:
            problems.append(f"{citation.source}: {citation.path} does not exist")
        elif citation.name not in names:
            problems.append(f"{citation.source}: {citation.path} has no {citation.name}")
    return problems
