"""``idemq chaos --two-hop``: pay → outbox → relay → ship, with pay workers, ship workers and
relays SIGKILLed, and the verdict from the ledger of both hops.

With the guard, every paid order is shipped exactly once, no order is shipped without its
payment and the outbox is empty; without it, the same run ships orders twice (a payment applied
twice adds two ship messages; a ship message delivered twice ships twice).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from idemq.chaos import ChaosResult
from idemq.errors import ConfigurationError
from tests.conftest import REDIS_URL, require_service

from .conftest import PG_URL, chaos, embedded, sqlite
from .test_ci_run import idemq, last_json

pytestmark = pytest.mark.slow

# A kill every 1.5 s among 6 processes: each lives long enough (start-up on a loaded 2-core box)
# to consume between kills.
ALL = {"kill_every_s": 1.5, "slow_rate": 0.05, "partition_rate": 0.05}
# Paced (~12 s of production): enough kills land during the run on a quiet machine as on a
# loaded one.
TWO_HOPS = {"two_hop": True, "workers": 2, "relays": 2, "messages": 60, "rate_per_s": 5.0}


def assert_both_hops_exactly_once(result: ChaosResult) -> None:
    assert result.ok, result.to_json()
    assert result.applied == result.produced
    assert result.shipped == result.produced, result.to_json()  # nothing lost on hop two
    assert result.double_shipped == result.extra_shipments == 0, result.to_json()
    assert result.shipped_unpaid == 0
    assert result.outbox_pending == 0  # the relays published every row and deleted it


def test_two_hops_on_embedded_and_sqlite(tmp_path: Path) -> None:
    result = chaos(embedded(tmp_path), sqlite(tmp_path), tmp_path, **TWO_HOPS, **ALL)
    assert_both_hops_exactly_once(result)
    assert result.crashes >= 6  # pay, ship and relay, each killed at once and armed
    assert result.causes["crash"] > 0, result.to_json()
    assert result.duplicates_suppressed > 0


def test_two_hops_without_guard_ship_twice(tmp_path: Path) -> None:
    knobs = {**TWO_HOPS, **ALL, "guard": False}
    result = chaos(embedded(tmp_path), sqlite(tmp_path), tmp_path, **knobs)
    assert result.double_shipped > 0, result.to_json()  # what the guard prevents on hop two
    assert result.extra_shipments >= result.double_shipped
    assert not result.ok


def test_two_hops_on_embedded_and_postgres(tmp_path: Path) -> None:
    require_service("postgres")
    result = chaos(embedded(tmp_path), PG_URL, tmp_path, **TWO_HOPS, **ALL)
    assert_both_hops_exactly_once(result)
    assert result.injected["relay_kills_after_publish_before_delete"] > 0, result.to_json()


def test_two_hops_on_rabbitmq_and_postgres(tmp_path: Path) -> None:
    require_service("rabbitmq")
    require_service("postgres")
    knobs = {**TWO_HOPS, "messages": 40, "kill_every_s": 2.0, "partition_rate": 0.05}
    result = chaos("amqp://guest:guest@127.0.0.1:5672/", PG_URL, tmp_path, **knobs)
    assert_both_hops_exactly_once(result)
    assert result.causes["crash"] > 0, result.to_json()


def test_two_hops_need_a_sql_store(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="SQL store"):
        chaos(embedded(tmp_path), REDIS_URL, tmp_path, two_hop=True)


def test_the_cli_runs_two_hops_and_exits_0(tmp_path: Path) -> None:
    proc = idemq(
        "chaos",
        "--two-hop",
        "--broker",
        embedded(tmp_path),
        "--store",
        sqlite(tmp_path),
        "--messages",
        "30",
        "--workers",
        "2",
        "--kill-every",
        "1.5",
        "--timeout",
        "150",
        "--json",
    )
    result = last_json(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["two_hop"] is True
    assert result["shipped"] == result["produced"] == 30
    assert result["double_shipped"] == result["unshipped"] == 0
