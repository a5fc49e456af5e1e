"""The settlement policy, exhaustively: every verdict at attempts around max_attempts."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from idemq.brokers.base import (
    ATTEMPT_HEADER,
    BROKER_MESSAGE_ID,
    NOT_BEFORE_HEADER,
    Received,
    decode,
    header_text,
    take_attempt,
)
from idemq.brokers.settlement import Ack, DeadLetter, Retry, RetryPolicy, Verdict, classify, decide
from idemq.errors import (
    InvalidBusinessIdError,
    InvalidMessageError,
    InvalidMessageIdError,
    LeaseLostError,
    PayloadMismatchError,
    StoreConfigurationError,
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
    # Retry(7.0) is an uncounted retry: the redelivery keeps its attempt number.
    # Acking would hide a crashed twin; dead-lettering would drop a message being processed.
    assert decide(Verdict.IN_PROGRESS, attempt, POLICY) == Retry(7.0)


@pytest.mark.parametrize("attempt", ATTEMPTS)
def test_store_outage_retries_forever(attempt: int) -> None:
    assert decide(Verdict.STORE_UNAVAILABLE, attempt, POLICY) == Retry(2.0)


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(1, Retry(1.0, counted=True)), (2, Retry(2.0, counted=True))],
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


class _DriverError(Exception):
    """Stands for a DB-API driver's exception under SQLAlchemy's wrapper."""


@pytest.mark.parametrize(
    ("exc", "verdict"),
    [
        # the server closed the handler's connection mid-statement (SQLAlchemy saw a disconnect)
        (
            sa.exc.OperationalError(
                "UPDATE t", {}, _DriverError("closed"), connection_invalidated=True
            ),
            Verdict.STORE_UNAVAILABLE,
        ),
        # the handler's engine could not connect at all (no statement ran)
        (sa.exc.OperationalError(None, None, _DriverError("refused")), Verdict.STORE_UNAVAILABLE),
        (sa.exc.DisconnectionError("pool"), Verdict.STORE_UNAVAILABLE),
        (sa.exc.TimeoutError("pool exhausted"), Verdict.STORE_UNAVAILABLE),
        # a statement the server cancelled or refused fails the same way every time: counted
        (sa.exc.OperationalError("UPDATE t", {}, _DriverError("timeout")), Verdict.HANDLER_ERROR),
        (sa.exc.IntegrityError("INSERT", {}, _DriverError("dup")), Verdict.HANDLER_ERROR),
        (ConnectionRefusedError("some API"), Verdict.HANDLER_ERROR),
    ],
)
def test_a_handlers_lost_database_connection_is_an_outage(exc: Exception, verdict: Verdict) -> None:
    assert classify(exc) is verdict


@pytest.mark.parametrize("verdict", [Verdict.IN_PROGRESS, Verdict.STORE_UNAVAILABLE])
@pytest.mark.parametrize("attempt", ATTEMPTS)
def test_only_a_failed_handler_run_is_a_counted_retry(verdict: Verdict, attempt: int) -> None:
    settlement = decide(verdict, attempt, POLICY)
    assert isinstance(settlement, Retry)
    assert not settlement.counted
    failed = decide(Verdict.HANDLER_ERROR, 1, POLICY)
    assert isinstance(failed, Retry)
    assert failed.counted


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, (1, 0)),
        ({ATTEMPT_HEADER: "4", NOT_BEFORE_HEADER: "1700000000000"}, (4, 1700000000000)),
        ({ATTEMPT_HEADER: "0"}, (1, 0)),
        ({ATTEMPT_HEADER: "-3", NOT_BEFORE_HEADER: "soon"}, (1, 0)),
        ({ATTEMPT_HEADER: "\u0663"}, (1, 0)),  # a non-ASCII digit is not ours
        ({ATTEMPT_HEADER: "9" * 5000}, (1, 0)),  # int() would refuse it: a raw ValueError
    ],
)
def test_the_attempt_header_is_read_strictly(
    headers: dict[str, str], expected: tuple[int, int]
) -> None:
    own = {"x": "y", **headers}
    assert take_attempt(own) == expected
    assert own == {"x": "y"}, "idemq's bookkeeping headers are taken out"


def test_received_takes_the_attempt_from_idemqs_header_not_the_broker() -> None:
    received = Received.build(
        "q", b"{}", {"idemq-message-id": "M1", ATTEMPT_HEADER: "3", "x-delivery-count": "17"}
    )
    assert received.delivery_attempt == 3
    assert received.message is not None
    assert received.message.delivery_attempt == 3
    assert ATTEMPT_HEADER not in received.headers
    assert received.headers["x-delivery-count"] == "17", "broker headers are passed on as they are"


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


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("plain", ("plain", True)),
        (b"caf\xc3\xa9", ("caf\u00e9", True)),
        (bytearray(b"caf\xc3\xa9"), ("caf\u00e9", True)),  # was "bytearray(b'caf\\xc3\\xa9')"
        (memoryview(b"id-1"), ("id-1", True)),
        (b"\xffid", ("\ufffdid", False)),
        (7, ("7", True)),
        (True, ("True", True)),
    ],
)
def test_header_values_are_decoded_strictly(value: object, expected: tuple[str, bool]) -> None:
    assert header_text(value) == expected


def test_an_id_header_that_is_not_utf8_is_an_invalid_message_id() -> None:
    headers = {"idemq-message-id": "\ufffdid"}
    msg, err = decode(b"{}", headers, broker_message_id="B1", undecodable=["idemq-message-id"])
    assert msg is None
    assert err == "InvalidMessageIdError: idemq-message-id is not valid UTF-8"
    # The broker's id is only the fallback: undecodable, it is refused too ...
    msg, err = decode(b"{}", {}, broker_message_id="\ufffd", undecodable=[BROKER_MESSAGE_ID])
    assert msg is None
    assert err is not None
    assert err.startswith("InvalidMessageIdError: the broker message id")
    # ... but not when the producer's header, which wins, is fine.
    msg, err = decode(b"{}", {"idemq-message-id": "H1"}, undecodable=[BROKER_MESSAGE_ID])
    assert msg is not None
    assert msg.id == "H1"
    # A business id that is not UTF-8 would key the business guards on replacement characters.
    msg, err = decode(
        b"{}",
        {"idemq-message-id": "H1", "idemq-business-id": "\ufffd"},
        undecodable=["idemq-business-id"],
    )
    assert msg is None
    assert err == "InvalidBusinessIdError: idemq-business-id is not valid UTF-8"
    # Any other binary header is the producer's business: passed on.
    msg, err = decode(b"{}", {"idemq-message-id": "H1", "x-sig": "\ufffd"}, undecodable=["x-sig"])
    assert msg is not None


def test_a_store_refusing_the_setup_is_never_counted_against_the_message() -> None:
    # A dropped dedup table or a rotated password: no fault of the message, so it must wait,
    # uncounted, rather than be dead-lettered with every other message of the queue.
    assert classify(StoreConfigurationError("login refused")) is Verdict.STORE_UNAVAILABLE
