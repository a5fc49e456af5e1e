"""Each cause alone on the embedded queue + SQLite: duplicates without idemq, none with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import chaos, embedded, sqlite

pytestmark = pytest.mark.slow

CAUSES: dict[str, dict[str, Any]] = {
    "partition": {"partition_rate": 0.15},
    "slow": {"slow_rate": 0.1},
    "crash": {"kill_every_s": 0.2, "messages": 500},
}


@pytest.mark.parametrize("cause", list(CAUSES))
@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no_guard"])
def test_each_cause_alone(tmp_path: Path, cause: str, guard: bool) -> None:
    result = chaos(embedded(tmp_path), sqlite(tmp_path), tmp_path, guard=guard, **CAUSES[cause])
    assert result.causes[cause] > 0, result.to_json()  # the cause really happened...
    others = {k: v for k, v in result.causes.items() if k not in (cause, "other")}
    if cause != "crash":  # ...and alone (a kill can also look slow: a late ack of a dead copy)
        assert sum(others.values()) == 0, result.to_json()
    if cause == "crash":  # some kills landed right after the commit, before the ack
        assert result.injected["kills_after_commit_before_ack"] > 0, result.to_json()
    if guard:
        assert result.duplicates_suppressed > 0
    else:
        assert result.double_applied > 0, result.to_json()  # what idemq prevents
        assert result.invariant_violations.get("double_debit") == result.double_applied
