"""The chaos report and the docs' start page, opened in a real (headless) Chromium.

Each page is served by a local http.server; the test checks there are no console errors, that
every series of the report's charts is drawn (non-zero size, inside the viewport), and saves a
screenshot under ``test-artifacts/browser/`` (printed; ignored by git). Skips locally when
Chromium is missing (``scripts/install-test-tools.sh`` installs it), fails under CI=true.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from idemq.chaos.demo import DemoConfig
from idemq.chaos.report import write_report
from idemq.chaos.runner import run_chaos
from tests.browser.cdp import CHROMIUM, Browser
from tests.conftest import CI
from tests.docs.test_build import build

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("IDEMQ_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "browser"
WIDTH, HEIGHT = 1280, 1000

pytestmark = pytest.mark.slow


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[functools.partial[str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(directory: Path, path: str) -> str:
        handler = functools.partial(QuietHandler, directory=str(directory))
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/{path}"

    yield functools.partial(start)
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} is missing (bash scripts/install-test-tools.sh installs it)"
        if CI:
            pytest.fail(message)
        pytest.skip(message)
    with Browser(WIDTH, HEIGHT) as opened:
        yield opened


def save(browser: Browser, name: str) -> None:
    path = browser.screenshot(ARTIFACTS / name)
    print(f"screenshot: {path}")


_SERIES_BOXES = """
JSON.stringify([...document.querySelectorAll('[data-series]')].map(g => {
  const r = g.getBoundingClientRect();
  return {series: g.dataset.series, top: r.top, bottom: r.bottom, left: r.left,
          right: r.right, width: r.width, height: r.height};
}))
"""


def test_chaos_report_in_chromium(browser: Browser, serve, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = run_chaos(DemoConfig(run_dir, orders=150).chaos())
    # A real run where every series has something to draw, the small ones included.
    assert result.ok
    assert result.crashes > 0
    assert result.duplicates_suppressed > 0
    site = tmp_path / "report"
    site.mkdir()
    write_report(result, site / "chaos.html")

    browser.open(serve(site, "chaos.html"))

    boxes = {b["series"]: b for b in json.loads(browser.evaluate(_SERIES_BOXES))}
    save(browser, "chaos-report.png")
    # A run with suppressed duplicates has them per cause as well.
    assert set(boxes) == {"deliveries", "suppressed", "kills", "causes", "suppressed-causes"}
    for name, box in boxes.items():
        assert box["height"] > 0, name
        assert box["width"] > 0, name
        assert box["top"] >= 0, (name, box)
        assert box["left"] >= 0, (name, box)
        assert box["bottom"] <= HEIGHT, (name, box)
        assert box["right"] <= WIDTH, (name, box)
    # Each panel has its own scale: the busiest bucket of kills is as tall as the busiest
    # bucket of deliveries, however few kills there were.
    tallest = browser.evaluate(
        "JSON.stringify(Object.fromEntries([...document.querySelectorAll('[data-panel]')].map("
        "s => [s.dataset.panel, s.getBoundingClientRect().height])))"
    )
    heights = json.loads(tallest)
    assert heights["kills"] == pytest.approx(heights["deliveries"])
    verdict = browser.evaluate("document.querySelector('#verdict').getBoundingClientRect().top")
    assert verdict < 100  # the verdict is the first thing on the page
    assert browser.errors() == []


def test_docs_start_page_in_chromium(browser: Browser, serve, tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = build(site)
    assert done.returncode == 0, done.stdout + done.stderr

    browser.open(serve(site, "index.html"))
    title = browser.evaluate("document.title")
    heading = browser.evaluate(
        "JSON.stringify((() => { const h = document.querySelector('article h1');"
        " const r = h.getBoundingClientRect();"
        " return {text: h.textContent, top: r.top, height: r.height}; })())"
    )
    save(browser, "docs-start-page.png")

    h1 = json.loads(heading)
    assert "idemq" in title
    assert h1["text"].startswith("idemq")
    assert 0 <= h1["top"] < HEIGHT
    assert h1["height"] > 0
    links = browser.evaluate("document.querySelectorAll('nav a').length")
    assert links > 20  # the navigation rendered
    assert browser.errors() == []
