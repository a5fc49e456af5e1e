"""Chaos runs: helpers shared by the matrix, the CI-sized run and the CLI tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemq.chaos import ChaosConfig, ChaosResult, run_chaos
from tests.conftest import free_port
from tests.integration.brokers.test_kafka import run_tansu

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
# Causes off unless a test turns them on: "each cause alone" means exactly that.
QUIET: dict[str, Any] = {"kill_every_s": 0.0, "slow_rate": 0.0, "partition_rate": 0.0}


def chaos(broker: str, store: str, tmp_path: Path, **knobs: Any) -> ChaosResult:
    """Run one scenario with CI-sized defaults and check what must hold in *every* run."""
    config = ChaosConfig(
        broker_url=broker,
        store_url=store,
        directory=tmp_path,
        timeout_s=150.0,
        **{"messages": 120, "workers": 3, **QUIET, **knobs},
    )
    result = run_chaos(config)
    assert not result.timed_out, result.to_json()
    assert result.produced == config.messages
    assert result.lost == 0, result.to_json()  # guard or not, nothing may be lost
    if config.guard:
        assert result.ok, result.to_json()
        assert result.double_applied == 0
        assert result.debited_cents == result.owed_cents  # the money agrees with the orders
        assert result.invariant_violations == {}
    return result


def embedded(tmp_path: Path) -> str:
    return f"embedded:///{tmp_path / 'queue.db'}"


def sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture(scope="module")
def kafka_behind_proxy() -> Iterator[str]:
    """A Tansu of its own that advertises a port nobody listens on yet: the chaos run's proxy.

    Returns ``kafka://127.0.0.1:<listener>?chaos_proxy=<advertised>``: the run serves the
    advertised port with its :class:`~idemq.chaos.proxy.FaultProxy`, so every client reaches
    the broker through it, and it can cut the producer's connections (cause 1 on Kafka).
    """
    advertised = free_port()
    with run_tansu(advertised_port=advertised) as bootstrap:
        yield f"kafka://{bootstrap}?chaos_proxy={advertised}"
