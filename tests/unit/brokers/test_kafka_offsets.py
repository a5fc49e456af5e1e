"""The Kafka adapter's commit points when handlers settle out of order (``--concurrency``)."""

from __future__ import annotations

import confluent_kafka
import pytest

pytest.importorskip("confluent_kafka")

from idemq.brokers.kafka import _Offsets


def _points(offsets: list[confluent_kafka.TopicPartition]) -> dict[int, int]:
    return {tp.partition: tp.offset for tp in offsets}


def test_the_point_is_past_every_settled_offset_when_the_last_to_finish_is_not_the_highest():
    offsets = _Offsets()
    for offset in (10, 11, 12):
        offsets.received("t", 0, offset)
    offsets.settled("t", 0, 12)
    offsets.settled("t", 0, 11)
    assert _points(offsets.take()) == {0: 10}  # 10 still runs: nothing past it
    offsets.settled("t", 0, 10)
    # All three settled: the point is 13, not 11 (one past the offset that finished last).
    assert _points(offsets.take()) == {0: 13}


def test_leaving_the_group_names_every_assigned_partitions_point_again():
    offsets = _Offsets()
    for partition in (0, 1, 2):
        offsets.received("t", partition, 5)
        offsets.settled("t", partition, 5)
    assert _points(offsets.take()) == {0: 6, 1: 6, 2: 6}  # sent while consuming (may be lost)
    assert offsets.take() == []  # nothing moved since
    assigned = [confluent_kafka.TopicPartition("t", p) for p in (0, 1, 2)]
    assert _points(offsets.every_point(assigned)) == {0: 6, 1: 6, 2: 6}
