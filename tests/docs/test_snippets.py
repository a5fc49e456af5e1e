"""Every Python snippet of the docs runs as written (see ``tests/docs/snippets.py``)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from idemq.brokers import open_broker
from tests.conftest import SERVICES, require_service, unique
from tests.docs.snippets import Snippet, snippets

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md"))

# Snippets marked ``<!-- run: no -->``, by page: each needs a reason here.
NOT_RUN: dict[str, str] = {
    "docs/howto/integrations/django.md": (
        "files of a Django project (settings, tasks, views): Django is set up once per process, "
        "and tests/integration/django runs this very project on PostgreSQL, MariaDB and SQLite"
    ),
}

# Broker queues a page names, made unique per run (tests share the brokers) and deleted after;
# the page's code is otherwise run exactly as written.
QUEUES: dict[str, tuple[str, str]] = {
    "getting-started.md": ("tutorial-payments", "amqp://guest:guest@127.0.0.1:5672/"),
}


def page_snippets(page: Path) -> list[Snippet]:
    return snippets(page, ROOT)


RUNNABLE = [p for p in PAGES if any(s.runs for s in page_snippets(p))]


def test_the_docs_have_python_snippets():
    assert len(RUNNABLE) >= 15, [str(p) for p in RUNNABLE]


def test_only_the_listed_snippets_are_not_run():
    not_run = {s.page for p in PAGES for s in page_snippets(p) if not s.runs}
    assert not_run == set(NOT_RUN)


def test_markers_name_known_services():
    for page in PAGES:
        for snippet in page_snippets(page):
            unknown = set(snippet.services) - set(SERVICES)
            assert not unknown, f"{snippet.page}:{snippet.line}: unknown services {unknown}"


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(DOCS)) for p in RUNNABLE])
def test_page_snippets_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    runnable = [s for s in page_snippets(page) if s.runs]
    for service in sorted({name for s in runnable for name in s.services}):
        require_service(service)
    monkeypatch.chdir(tmp_path)
    name, broker_url = QUEUES.get(str(page.relative_to(DOCS)), ("", ""))
    queue = unique("docs_queue")
    # A real module, so a snippet may define what needs one (a dataclass looks its module up).
    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    try:
        for snippet in runnable:
            source = snippet.code.replace(f'"{name}"', f'"{queue}"') if name else snippet.code
            exec(compile(source, f"{snippet.page}:{snippet.line}", "exec"), namespace)
    finally:
        if name:
            broker = open_broker(broker_url)
            try:
                broker.delete_queue(queue)
            finally:
                broker.close()


def test_the_renamed_queues_are_on_their_pages():
    for page, (name, _) in QUEUES.items():
        assert f'"{name}"' in (DOCS / page).read_text(encoding="utf-8"), page
