"""Collects what each SPIN run explored and prints it once, at the end of the session.

A CI log then shows, for every model, how many states and transitions were checked and how
deep the search went, without ``-s`` and without interleaving it with the test progress.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

RUNS = pytest.StashKey[list[str]]()


@pytest.fixture
def report_run(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Call with one line describing a finished pan run; printed in the terminal summary."""
    lines = request.config.stash.setdefault(RUNS, [])
    return lines.append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = terminalreporter.config.stash.get(RUNS, [])
    if lines:
        terminalreporter.section("SPIN model checks")
        for line in lines:
            terminalreporter.write_line(line)
