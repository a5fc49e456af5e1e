"""Per-broker fault settings: what each URL lets a run inject, and the timers workers get."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from idemq.chaos import faults
from idemq.chaos.faults import capabilities, redelivery_s, slow_s, worker_url
from idemq.chaos.rabbitmq_timeout import consumer_timeout
from idemq.errors import ConfigurationError


def query(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}


def test_kafka_needs_the_proxy_as_advertised_listener_for_partitions() -> None:
    assert not capabilities("kafka://127.0.0.1:19092").partition
    assert "advertised" in capabilities("kafka://127.0.0.1:19092").partition_note
    assert capabilities("kafka://127.0.0.1:19092?chaos_proxy=19093").partition
    with pytest.raises(ConfigurationError):
        capabilities("kafka://127.0.0.1:19092?chaos_proxy=x").partition  # noqa: B018


def test_kafka_workers_never_see_the_proxy_parameter_and_keep_poll_above_session() -> None:
    url = worker_url("kafka://127.0.0.1:19092?chaos_proxy=19093")
    assert query(url) == {"session_timeout_ms": "3000", "max_poll_interval_ms": "3000"}
    # The user's values win, and librdkafka's rule (poll >= session) still holds.
    assert query(worker_url("kafka://h:1?session_timeout_ms=10000")) == {
        "session_timeout_ms": "10000",
        "max_poll_interval_ms": "10000",
    }
    assert query(worker_url("kafka://h:1?max_poll_interval_ms=2000")) == {
        "session_timeout_ms": "2000",
        "max_poll_interval_ms": "2000",
    }


def test_kafka_slow_handlers_are_opt_in_and_outlast_the_handover() -> None:
    assert not capabilities("kafka://h:1").slow
    url = "kafka://h:1?max_poll_interval_ms=2000"
    caps = capabilities(url)
    assert caps.slow
    assert redelivery_s(worker_url(url)) == 2.0
    assert slow_s(url, caps) == 1.5 * 2.0 + caps.handover_s


def test_rabbitmq_slow_handlers_need_the_opt_in() -> None:
    url = "amqp://guest:guest@127.0.0.1:5672/"
    assert not capabilities(url).slow
    assert "--tune-broker" in capabilities(url).slow_note
    assert worker_url(url) == url  # no timer of its own in the URL
    tuned = capabilities(url, tune_broker=True)
    if faults.rabbitmq_timeout.rabbitmqctl() is None:
        assert not tuned.slow
        assert "rabbitmqctl" in tuned.slow_note
    else:
        assert tuned.slow
        assert tuned.tuned
        assert (
            tuned.redelivery_s
            == (faults.RABBITMQ_CONSUMER_TIMEOUT_MS + faults.RABBITMQ_TICK_MS) / 1000
        )


def test_tuning_refuses_a_broker_that_is_not_this_machine() -> None:
    with (
        pytest.raises(ConfigurationError, match="broker on 127"),
        consumer_timeout("amqp://g:g@10.0.0.5:5672/", timeout_ms=2000, tick_ms=250, hold_s=5),
    ):
        pass  # never reached: nothing is changed on any node


def test_the_kafka_producer_accepts_a_url_with_only_a_poll_interval() -> None:
    # The user's max_poll_interval_ms=2000 is below Kafka's default session (10 s): the
    # producer must get the workers' consistent timers, not a ConfigurationError.
    producer, proxy = faults.open_producer(
        "kafka://127.0.0.1:1?max_poll_interval_ms=2000", confirm_timeout_s=0.5, partitions=False
    )
    try:
        assert proxy is None
        assert producer.inner.timeout_s == 0.5  # type: ignore[attr-defined]
    finally:
        producer.close()
