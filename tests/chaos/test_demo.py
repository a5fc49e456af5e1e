"""``idemq demo`` is a preset of the chaos engine: fast, self-contained, and right."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from rich.console import Console

from idemq.chaos.demo import DemoConfig, DemoReport, demo_directory, render_report, run_demo

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


def sample_report() -> DemoReport:
    return DemoReport(
        produced=120,
        published=131,
        duplicates_published=11,
        crashes=6,
        payments=120,
        balance=99_995_000,
        expected_balance=99_995_000,
        outcomes={"processed": 120, "duplicate": 17, "in_progress": 2},
        causes={"partition": 11, "slow": 3, "crash": 5, "other": 0},
        duplicates_delivered=19,
        duplicates_suppressed=17,
        seconds=9.5,
    )


@pytest.mark.parametrize("width", [60, 100, 160])
def test_report_explains_each_count_and_wraps_to_the_terminal(width: int) -> None:
    console = Console(width=width, record=True, color_system=None)
    render_report(sample_report(), console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    words = " ".join(re.sub(r"[│┃]", " ", text).split())
    for phrase in ("duplicates suppressed", "duplicates delivered", "balance / expected"):
        assert phrase in words
    assert "(17) is at most the duplicates delivered" in words  # why 17 of 19
    assert "no order was paid twice" in words  # what the balance proves
    assert "✓ every order paid exactly once" in words


def test_demo_directory_is_removed_unless_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # re-read TMPDIR
    try:
        with demo_directory(None, keep=False) as removed:
            (removed / "queue.db").write_text("x")
        assert not removed.exists()
        with demo_directory(None, keep=True) as kept:
            (kept / "queue.db").write_text("x")
        assert kept.exists()
        given = tmp_path / "mine"
        with demo_directory(given, keep=False) as used:
            (used / "queue.db").write_text("x")
        assert (given / "queue.db").exists()  # the user's directory is never removed
    finally:
        tempfile.tempdir = None


@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept"])
def test_cli_demo_cleans_up_unless_keep(tmp_path: Path, keep: bool) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path), "COLUMNS": "72"}
    argv = [sys.executable, "-m", "idemq.cli", "demo", "--orders", "40", "--workers", "2"]
    done = subprocess.run(
        [*argv, *(["--keep"] if keep else [])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    left = list(tmp_path.glob("idemq-demo-*"))
    assert len(left) == (1 if keep else 0), left
    assert max(len(line) for line in done.stdout.splitlines()) <= 72
    assert "every order paid exactly once" in done.stdout


def _rendered(report: DemoReport) -> str:
    console = Console(width=120, record=True, color_system=None)
    render_report(report, console)
    return " ".join(re.sub(r"[│┃]", " ", console.export_text()).split())


def test_each_mode_explains_its_own_counts() -> None:
    guarded = sample_report()
    unguarded = DemoReport(
        **{
            **guarded.__dict__,
            "guard": False,
            "outcomes": {"processed": 160},
            "duplicates_suppressed": 0,
            "double_paid": 19,
            "payments": 139,
            "shipments": 141,
            "double_shipped": 21,
        }
    )
    with_idemq, without = _rendered(guarded), _rendered(unguarded)
    assert "dedup row answers that copy DUPLICATE" in with_idemq
    assert "(17) is at most the duplicates delivered" in with_idemq
    # --no-guard ran no dedup row: its page must not claim one answered, and says what happened.
    assert "DUPLICATE" not in without
    assert "dedup row answers" not in without
    assert "is at most the duplicates delivered" not in without
    assert "without idemq the ship consumer has no dedup row" in without
    assert "21 orders shipped more than once" in without
    assert "19 orders paid more than once" in without
