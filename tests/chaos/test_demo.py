"""``idemq demo`` is a preset of the chaos engine: fast, self-contained, and right."""

from __future__ import annotations

from pathlib import Path

import pytest

from idemq.chaos.demo import DemoConfig, run_demo

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no_guard"])
def test_demo_tells_the_story_and_the_verdict(tmp_path: Path, guard: bool) -> None:
    lines: list[str] = []
    report = run_demo(DemoConfig(tmp_path, orders=120, guard=guard), progress=lines.append)
    assert report.produced == 120
    assert report.lost == 0
    assert report.seconds < 60
    assert report.crashes > 0
    assert report.duplicates_published > 0
    assert any("duplicates delivered" in line for line in lines)
    if guard:
        assert report.ok
        assert report.double_paid == 0
        assert report.balance == report.expected_balance
    else:
        assert not report.ok
        assert report.double_paid > 0
        assert report.balance < report.expected_balance  # paid twice: money really left
