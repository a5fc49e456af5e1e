"""The CI-sized run: all three causes at once, 2,000 messages, at least 20 kills — through the
command line, as a user would run it, with --json and --report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL, require_service

from .conftest import PG_URL

pytestmark = pytest.mark.slow


def idemq(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "idemq.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def last_json(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr
    data: dict[str, object] = json.loads(lines[-1])
    return data


def test_all_causes_2000_messages_20_kills(tmp_path: Path) -> None:
    require_service("redis")
    require_service("postgres")
    report = tmp_path / "chaos.html"
    proc = idemq(
        "chaos",
        "--broker", REDIS_URL,
        "--store", PG_URL,
        "--messages", "2000",
        "--workers", "4",
        "--kill-every", "0.5",
        "--slow-rate", "0.01",
        "--partition-rate", "0.01",
        "--dir", str(tmp_path),
        "--json",
        "--report", str(report),
    )  # fmt: skip
    result = last_json(proc)
    assert proc.returncode == 0, (result, proc.stderr[-2000:])
    assert result["produced"] == 2000
    assert result["applied"] == 2000
    assert result["lost"] == 0
    assert result["double_applied"] == 0
    assert isinstance(result["crashes"], int)
    assert result["crashes"] >= 20
    causes = result["causes"]
    assert isinstance(causes, dict)
    assert causes["partition"] > 0
    assert causes["slow"] > 0
    assert causes["crash"] > 0
    page = report.read_text()
    assert "<svg" in page
    assert "<polyline" in page
    assert "<script" not in page
    assert "http://" not in page.replace("http://www.w3.org", "")


def test_no_guard_exits_1_with_double_effects(tmp_path: Path) -> None:
    proc = idemq(
        "chaos",
        "--broker", f"embedded:///{tmp_path / 'queue.db'}",
        "--store", f"sqlite:///{tmp_path / 'ledger.db'}",
        "--messages", "150",
        "--kill-every", "0",
        "--slow-rate", "0",
        "--partition-rate", "0.15",
        "--no-guard",
        "--json",
    )  # fmt: skip
    result = last_json(proc)
    assert proc.returncode == 1
    assert isinstance(result["double_applied"], int)
    assert result["double_applied"] > 0
    assert result["lost"] == 0


def test_a_run_cut_short_by_its_time_limit_is_unfinished_not_lost(tmp_path: Path) -> None:
    proc = idemq(
        "chaos",
        "--broker", f"embedded:///{tmp_path / 'queue.db'}",
        "--store", f"sqlite:///{tmp_path / 'ledger.db'}",
        "--messages", "5000",
        "--workers", "1",
        "--kill-every", "0",
        "--slow-rate", "0",
        "--partition-rate", "0",
        "--timeout", "3",
        "--json",
    )  # fmt: skip
    result = last_json(proc)
    assert proc.returncode == 1, result  # not a pass: the run proved nothing about the rest
    assert result["lost"] == 0  # `lost` means lost, and nothing was
    assert isinstance(result["unfinished"], int)
    assert result["unfinished"] > 0
    assert result["unfinished"] == result["produced"] - result["applied"]  # type: ignore[operator]
    assert result["ok"] is False


def test_a_refused_run_still_ends_with_one_json_line(tmp_path: Path) -> None:
    proc = idemq(
        "chaos",
        "--broker", "mqtt://127.0.0.1:1883",
        "--store", f"sqlite:///{tmp_path / 'ledger.db'}",
        "--json",
    )  # fmt: skip
    result = last_json(proc)
    assert proc.returncode == 2, (result, proc.stderr)
    assert result["ok"] is False
    assert "error" in result
