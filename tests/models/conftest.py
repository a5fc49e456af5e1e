"""Collects what each SPIN run explored and prints it once, at the end of the session.

A CI log then shows, for every model, how many states and transitions were checked and how
deep the search went, without ``-s`` and without interleaving it with the test progress.

The lines travel as the test's user properties: under pytest-xdist the test runs in a worker,
and its report (with them) is what reaches the process that prints the summary.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

PROPERTY = "spin_run"


@pytest.fixture
def report_run(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Call with one line describing a finished pan run; printed in the terminal summary."""
    return lambda line: request.node.user_properties.append((PROPERTY, line))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reports = [*terminalreporter.stats.get("passed", []), *terminalreporter.stats.get("failed", [])]
    lines = [
        value
        for report in reports
        if report.when == "call"
        for name, value in report.user_properties
        if name == PROPERTY
    ]
    if lines:
        terminalreporter.section("SPIN model checks")
        for line in lines:
            terminalreporter.write_line(line)
