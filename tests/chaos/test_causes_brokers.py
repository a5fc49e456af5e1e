"""Causes that need the broker set up first, each alone: duplicates without idemq, none with it.

* RabbitMQ 3.10, slow consumer: the run shortens the server-wide ``consumer_timeout`` (opt-in,
  through ``rabbitmqctl``) and restores it — the broker closes the slow channel and redelivers.
* Kafka, producer retry: a Tansu of its own advertises the run's proxy, so the producer's
  connections go through it and lose their delivery reports.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from idemq.chaos import ChaosResult
from idemq.chaos.rabbitmq_timeout import rabbitmqctl, read_settings
from tests.conftest import CI, require_service, server_wide

from .conftest import PG_URL, chaos

pytestmark = pytest.mark.slow

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672/"


def assert_cause_alone(result: ChaosResult, cause: str, guard: bool) -> None:
    assert result.causes[cause] > 0, result.to_json()  # the cause really happened...
    others = {k: v for k, v in result.causes.items() if k not in (cause, "other")}
    assert sum(others.values()) == 0, result.to_json()  # ...and no other one
    if guard:
        assert result.duplicates_suppressed > 0, result.to_json()
    else:
        assert result.double_applied > 0, result.to_json()  # what idemq prevents
        assert result.invariant_violations.get("double_debit") == result.double_applied


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no_guard"])
def test_rabbitmq_slow_consumer_alone(tmp_path: Path, guard: bool) -> None:
    # The run shortens consumer_timeout for every channel opened on the node meanwhile: no other
    # test may be on RabbitMQ then, or its slow handler would lose its channel.
    server_wide("rabbitmq")
    require_service("postgres")
    if rabbitmqctl() is None:
        message = "rabbitmqctl is not installed"
        if CI:
            pytest.fail(message)
        pytest.skip(message)
    before = read_settings()
    knobs = {"messages": 40, "slow_rate": 0.15, "tune_broker": True}
    result = chaos(RABBITMQ, PG_URL, tmp_path, guard=guard, **knobs)
    assert_cause_alone(result, "slow", guard)
    assert any("consumer_timeout" in note for note in result.notes)  # said, not hidden
    assert read_settings() == before  # the server-wide setting is back


@pytest.mark.kafka
@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no_guard"])
def test_kafka_producer_retry_alone(tmp_path: Path, kafka_behind_proxy: str, guard: bool) -> None:
    require_service("postgres")
    # One partition: one consuming member. Steady traffic, so partitions hit live publishes.
    knobs = {"messages": 40, "workers": 1, "partition_rate": 0.15, "rate_per_s": 10.0}
    result = chaos(kafka_behind_proxy, PG_URL, tmp_path, guard=guard, **knobs)
    assert_cause_alone(result, "partition", guard)
    assert result.injected["producer_retries"] > 0
