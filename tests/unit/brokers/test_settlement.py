"""The settlement policy, exhaustively: every verdict at attempts around max_attempts."""

from __future__ import annotations

import pytest

from idemq.brokers.base import decode
from idemq.brokers.settlement import Ack, DeadLetter, Retry, RetryPolicy, Verdict, classify, decide
from idemq.errors import (
    InvalidBusinessIdError,
    InvalidMessageError,
    InvalidMessageIdError,
    LeaseLostError,
    PayloadMismatchError,
    StoreError,
    StoreUnavailableError,
)

POLICY = RetryPolicy(
    max_attempts=3,
    backoff_base_s=1.0,
    backoff_max_s=3.0,
    in_progress_delay_s=7.0,
    store_unavailable_delay_s=2.0,
)
ATTEMPTS = [1, 2, 3, 4, 100]


@pytest.mark.parametrize("attempt", ATTEMPTS)
@pytest.mark.parametrize("verdict", [Verdict.PROCESSED, Verdict.DUPLICATE])
def test_done_is_acked_at_any_attempt(verdict: Verdict, attempt: int) -> None:
    assert decide(verdict, attempt, POLICY) == Ack()


@pytest.mark.parametrize("attempt", ATTEMPTS)
def test_in_progress_is_never_acked_nor_dead_lettered(attempt: int) -> None:
    # Acking would hide a crashed twin; dead-lettering would drop a message being processed.
    assert decide(Verdict.IN_PROGRESS, attempt, POLICY) == Retry(7.0)


@pytest.mark.parametrize("attempt", ATTEMPTS)
def test_store_outage_retries_forever(attempt: int) -> None:
    assert decide(Verdict.STORE_UNAVAILABLE, attempt, POLICY) == Retry(2.0)


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(1, Retry(1.0)), (2, Retry(2.0))],
)
def test_handler_error_backs_off_below_max(attempt: int, expected: Retry) -> None:
    assert decide(Verdict.HANDLER_ERROR, attempt, POLICY, "boom") == expected


@pytest.mark.parametrize("attempt", [3, 4, 100])
def test_handler_error_dead_letters_at_max_attempts(attempt: int) -> None:
    settlement = decide(Verdict.HANDLER_ERROR, attempt, POLICY, "ValueError: boom")
    assert isinstance(settlement, DeadLetter)
    assert settlement.reason.startswith("handler_error:")
    assert f"after {attempt} attempts" in settlement.reason
    assert "ValueError: boom" in settlement.reason


def test_backoff_is_exponential_and_capped() -> None:
    policy = RetryPolicy(max_attempts=100, backoff_base_s=0.5, backoff_max_s=10.0)
    delays = [policy.backoff_s(n) for n in range(1, 8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert policy.backoff_s(0) == 0.5  # a broker that counts from 0 never gets a shorter delay


@pytest.mark.parametrize("attempt", ATTEMPTS)
@pytest.mark.parametrize("verdict", [Verdict.INVALID_MESSAGE, Verdict.PAYLOAD_MISMATCH])
def test_poison_is_dead_lettered_at_once(verdict: Verdict, attempt: int) -> None:
    settlement = decide(verdict, attempt, POLICY, "why")
    assert settlement == DeadLetter(f"{verdict.value}: why")


def test_every_verdict_has_a_decision() -> None:
    for verdict in Verdict:
        for attempt in ATTEMPTS:
            assert isinstance(decide(verdict, attempt, POLICY), Ack | Retry | DeadLetter)


@pytest.mark.parametrize(
    ("exc", "verdict"),
    [
        (StoreUnavailableError("down"), Verdict.STORE_UNAVAILABLE),
        (PayloadMismatchError("m", "a" * 64, "b" * 64), Verdict.PAYLOAD_MISMATCH),
        (InvalidMessageIdError("too long"), Verdict.INVALID_MESSAGE),
        (InvalidMessageError("not json"), Verdict.INVALID_MESSAGE),
        (InvalidBusinessIdError("bad"), Verdict.INVALID_MESSAGE),
        (LeaseLostError("taken"), Verdict.IN_PROGRESS),
        (StoreError("odd"), Verdict.HANDLER_ERROR),
        (ValueError("boom"), Verdict.HANDLER_ERROR),
        (KeyError("k"), Verdict.HANDLER_ERROR),
    ],
)
def test_classify(exc: Exception, verdict: Verdict) -> None:
    assert classify(exc) is verdict


def test_decode_takes_the_explicit_header_first_then_the_broker_id() -> None:
    msg, err = decode(b"{}", {"idemq-message-id": "H1"}, broker_message_id="B1")
    assert err is None
    assert msg is not None
    assert msg.id == "H1", "a producer's explicit id beats a broker id that may be random"
    msg, err = decode(b"{}", {}, broker_message_id="B1")
    assert msg is not None
    assert msg.id == "B1"
    msg, err = decode(
        b"{}", {"idemq-message-id": "H1", "idemq-business-id": "order_1"}, delivery_attempt=3
    )
    assert msg is not None
    assert (msg.id, msg.business_id, msg.delivery_attempt) == ("H1", "order_1", 3)


def test_decode_without_id_keeps_the_reason() -> None:
    msg, err = decode(b"{}", {})
    assert msg is None
    assert err is not None
    assert "no message id" in err
