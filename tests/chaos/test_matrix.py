"""Every broker once (PostgreSQL store), every store once (Redis Streams), all causes at once;
plus the no-guard runs that prove a broker's mechanism really duplicates."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import MYSQL_URL, REDIS_URL, require_service
from tests.integration.brokers import test_kafka

from .conftest import PG_URL, chaos, sqlite

pytestmark = pytest.mark.slow

tansu = test_kafka.tansu  # the adapter suite's fixture: a Tansu of this module's own, free port

ALL = {"kill_every_s": 1.0, "slow_rate": 0.05, "partition_rate": 0.05}
BROKERS = {
    "redis_streams": ("redis", REDIS_URL),
    "rabbitmq": ("rabbitmq", "amqp://guest:guest@127.0.0.1:5672/"),
    "nats": ("nats", "nats://127.0.0.1:4222"),
}


@pytest.mark.parametrize("name", list(BROKERS))
def test_every_broker_with_postgres(tmp_path: Path, name: str) -> None:
    service, url = BROKERS[name]
    require_service(service)
    require_service("postgres")
    result = chaos(url, PG_URL, tmp_path, **ALL)
    assert result.crashes > 0
    assert result.duplicates_delivered > 0


@pytest.mark.kafka
def test_kafka_with_postgres(tmp_path: Path, tansu: str) -> None:
    require_service("postgres")
    # One partition, so one consuming member: kill that one. Steady traffic (10/s) so that
    # kills land while messages flow; the supervisor spares a worker until its group join is done.
    knobs = {**ALL, "messages": 150, "workers": 1, "rate_per_s": 10.0}
    result = chaos(f"kafka://{tansu}", PG_URL, tmp_path, **knobs)
    assert result.crashes > 0
    assert any("Kafka" in note for note in result.notes)  # partition/slow: said, not faked


@pytest.mark.parametrize("store", ["sqlite", "mysql", "redis"])
def test_every_store_with_redis_streams(tmp_path: Path, store: str) -> None:
    require_service("redis")
    if store == "mysql":
        require_service("mysql")
    url = {"sqlite": sqlite(tmp_path), "mysql": MYSQL_URL, "redis": REDIS_URL}[store]
    result = chaos(REDIS_URL, url, tmp_path, **ALL)
    assert result.duplicates_delivered > 0
    assert result.duplicates_suppressed + result.verdicts.get("in_progress", 0) > 0


@pytest.mark.parametrize(
    ("name", "cause", "knobs"),
    [
        ("redis_streams", "partition", {"partition_rate": 0.15}),
        ("rabbitmq", "partition", {"partition_rate": 0.15}),
        ("nats", "slow", {"slow_rate": 0.15}),
    ],
)
def test_broker_mechanism_duplicates_without_guard(
    tmp_path: Path, name: str, cause: str, knobs: dict[str, float]
) -> None:
    service, url = BROKERS[name]
    require_service(service)
    require_service("postgres")
    # Each partition stalls the producer for a window plus a reconnect: keep N small.
    result = chaos(url, PG_URL, tmp_path, guard=False, messages=60, **knobs)
    assert result.causes[cause] > 0, result.to_json()
    assert result.double_applied > 0, result.to_json()


def test_nats_absorbs_producer_retries_by_msg_id(tmp_path: Path) -> None:
    require_service("nats")
    require_service("postgres")
    knobs = {"messages": 50, "partition_rate": 0.1}
    result = chaos(BROKERS["nats"][1], PG_URL, tmp_path, guard=False, **knobs)
    assert result.injected["producer_retries"] > 0  # the retries happened...
    assert result.causes["partition"] == 0  # ...and JetStream's duplicate window dropped them
    assert result.double_applied == 0
