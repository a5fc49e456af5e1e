"""The pure parts every broker adapter shares: the URL (scheme, idemq's own options, secrets
masked), what a dead letter and a retried copy carry in their headers, and the one settlement
each delivery allows. Deliveries come from the embedded queue (one SQLite file, no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from idemq.brokers import open_broker, with_query
from idemq.brokers.base import (
    ATTEMPT_HEADER,
    DEAD_LETTER_ATTEMPTS_HEADER,
    DEAD_LETTER_QUEUE_HEADER,
    DEAD_LETTER_REASON_HEADER,
    NOT_BEFORE_HEADER,
    check_declare_mode,
    dead_letter_headers,
    split_query,
)
from idemq.brokers.embedded import EmbeddedBroker
from idemq.errors import AlreadySettledError, ConfigurationError
from idemq.message import MESSAGE_ID_HEADER


def test_an_unknown_scheme_is_refused_naming_the_known_ones_without_the_password():
    with pytest.raises(ConfigurationError) as refused:
        open_broker("amqpx://app:s3cret@host/vhost")
    text = str(refused.value)
    assert "'amqpx'" in text
    assert "amqp, amqps, embedded" in text
    assert "s3cret" not in text


def test_declare_and_dead_letter_are_refused_where_there_is_nothing_to_declare(tmp_path: Path):
    with pytest.raises(ConfigurationError, match="not of 'embedded'"):
        open_broker(f"embedded://{tmp_path}/q.db", declare="never")


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_the_two_declare_modes_pass(mode: str):
    assert check_declare_mode(mode) == mode


@pytest.mark.parametrize("mode", ["AUTO", "", None, "passive"])
def test_any_other_declare_mode_is_refused(mode: object):
    with pytest.raises(ConfigurationError, match="'auto' or 'never'"):
        check_declare_mode(mode)


def test_idemqs_options_are_taken_out_of_the_url_and_the_clients_kept_in_order():
    url, ours = split_query(
        "amqp://h/v?heartbeat=5&declare=never&connection_name=x&dead_letter=",
        ["declare", "dead_letter"],
    )
    assert url == "amqp://h/v?heartbeat=5&connection_name=x"
    assert ours == {"declare": "never", "dead_letter": ""}


def test_with_query_replaces_a_parameter_of_the_same_name():
    assert (
        with_query("nats://h:4222?connect_timeout_ms=1&a=b", {"connect_timeout_ms": "250"})
        == "nats://h:4222?a=b&connect_timeout_ms=250"
    )


def test_a_dead_letter_keeps_the_headers_and_says_why_from_where_and_when():
    headers = dead_letter_headers(
        {"trace": "t1"}, reason="x" * 5000, queue="orders", delivery_attempt=5
    )
    assert headers["trace"] == "t1"
    assert headers[DEAD_LETTER_QUEUE_HEADER] == "orders"
    assert headers[DEAD_LETTER_ATTEMPTS_HEADER] == "5"
    # Brokers cap header sizes (RabbitMQ's frame, Kafka's record): the reason is bounded.
    assert len(headers[DEAD_LETTER_REASON_HEADER]) == 1000


@pytest.fixture
def broker(tmp_path: Path):
    broker = EmbeddedBroker(tmp_path / "q.db")
    yield broker
    broker.close()


def test_a_retried_copy_carries_the_id_and_bumps_the_attempt_only_when_counted(
    broker: EmbeddedBroker,
):
    broker.publish("parts", b"{}", message_id="M1", headers={"trace": "t1"})
    delivery = next(broker.consume("parts"))
    assert delivery is not None
    assert delivery.delivery_attempt == 1
    counted = delivery.retry_headers(counted=True, not_before_ms=123)
    assert counted == {
        "trace": "t1",
        MESSAGE_ID_HEADER: "M1",
        ATTEMPT_HEADER: "2",
        NOT_BEFORE_HEADER: "123",
    }
    assert delivery.retry_headers(counted=False)[ATTEMPT_HEADER] == "1"  # an outage's retry


def test_a_delivery_is_settled_once_and_a_second_settlement_says_how_it_was(
    broker: EmbeddedBroker,
):
    broker.publish("parts", b"{}", message_id="M2")
    delivery = next(broker.consume("parts"))
    assert delivery is not None
    assert not delivery.settled
    delivery.retry(0.0)
    assert delivery.settled
    for settle in (delivery.ack, lambda: delivery.dead_letter("late"), lambda: delivery.retry(1)):
        with pytest.raises(AlreadySettledError, match="'M2' already settled by retry"):
            settle()
