"""Kafka chaos topics get one partition per worker, so every worker consumes and the kills land
on workers holding messages (with the adapter's one-partition topic, one member of the group
held all the records: kills and slow handlers of the other workers never touched a message).

Not here: slow handlers with 3 members. A run with ``max_poll_interval_ms=3000`` and 3 workers
timed out on Tansu 0.6 (the group stalls after an eviction mid-rebalance, see
:mod:`idemq.chaos.faults`); the slow cause on Kafka stays proven at the adapter level."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import confluent_kafka.admin
import pytest

from idemq.chaos.faults import declare_queue, open_producer
from tests.conftest import require_service, unique
from tests.integration.brokers import test_kafka

from .conftest import PG_URL, chaos

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

tansu = test_kafka.tansu  # a Tansu of this module's own, on a free port


def partitions_of(bootstrap: str, topic: str) -> int:
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap})
    metadata = admin.list_topics(topic, timeout=10)
    return len(metadata.topics[topic].partitions)


@pytest.fixture
def topic(tansu: str) -> Iterator[str]:
    name = unique("chaos_parts")
    yield name
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": tansu})
    for future in admin.delete_topics([name, f"{name}.dlq"]).values():
        future.result(10)


def test_the_run_topic_has_a_partition_per_worker(tansu: str, topic: str) -> None:
    url = f"kafka://{tansu}"
    producer, proxy = open_producer(url, confirm_timeout_s=1.0, partitions=False)
    try:
        declare_queue(producer, url, topic, consumers=4)
        declare_queue(producer, url, topic, consumers=4)  # safe twice, like declare
    finally:
        producer.close()
    assert proxy is None
    assert partitions_of(tansu, topic) == 4
    assert partitions_of(tansu, f"{topic}.dlq") == 1  # the adapter's own dead-letter topic


def consuming_processes(tmp_path: Path) -> int:
    """Worker processes whose event file records at least one delivery."""
    return sum(
        1
        for path in tmp_path.glob("events-*/events-*.jsonl")
        if any(json.loads(line).get("k") == "start" for line in path.read_text().splitlines())
    )


def test_every_worker_consumes_and_crashes_fire_on_kafka(tmp_path: Path, tansu: str) -> None:
    require_service("postgres")
    # A kill every 5 s: each kill rebalances the whole group (Tansu takes seconds to settle).
    knobs = {"messages": 60, "workers": 3, "kill_every_s": 5.0, "rate_per_s": 6.0}
    result = chaos(f"kafka://{tansu}", PG_URL, tmp_path, **knobs)
    assert result.crashes > 0
    assert result.causes["crash"] > 0, result.to_json()
    # More than the one member a one-partition topic would feed.
    assert consuming_processes(tmp_path) > 1
