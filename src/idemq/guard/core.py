"""What a message is to the guard, and what a claim means for it — with no I/O.

Every rule of the guard lives here once, for the sync and the async shell and for single
messages and batches alike: what a valid message id is, what a claim request holds, and what
an existing record means for the message at hand (:func:`judge`). The steps that carry a
message through the store are in :mod:`idemq.guard.flow` and :mod:`idemq.guard.batch_flow`.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from idemq._clock import Clock, system_clock_ms
from idemq.errors import (
    ConfigurationError,
    InvalidBusinessIdError,
    InvalidMessageIdError,
    PayloadMismatchError,
)
from idemq.guard.codec import NULL_RESULT, Codec, JsonCodec, hash_payload
from idemq.stores.base import Claim, ClaimRequest, Key, Record, RecordStatus

__all__ = [
    "CLAIM_ATTEMPTS",
    "MAX_BUSINESS_ID_CHARS",
    "MAX_MESSAGE_ID_CHARS",
    "Mode",
    "Outcome",
    "Policy",
    "Status",
    "judge",
    "processed_record",
    "validate_business_id",
    "validate_message_id",
]

MAX_MESSAGE_ID_CHARS = 128
MAX_BUSINESS_ID_CHARS = 64
CLAIM_ATTEMPTS = 5
"""How often idemq runs a transaction of its own again after a deadlock or serialization failure
(the server rolled it back whole, so nothing of it was committed and a rerun is clean)."""

T = TypeVar("T")


class Status(enum.StrEnum):
    """What happened to a message."""

    PROCESSED = "processed"  # the handler ran now and its effect committed
    DUPLICATE = "duplicate"  # processed before; the stored result is replayed, handler not run
    IN_PROGRESS = "in_progress"  # another worker holds a live lease: do not ack, retry later
    FAILED = "failed"  # only in process_batch: this message's handler raised (see Outcome.error)


class Mode(enum.StrEnum):
    """How the dedup record relates to the business change."""

    TRANSACTIONAL = "transactional"  # dedup row in the same DB transaction as the effect
    LEASE = "lease"  # claim with an expiring lease, complete after the effect


@dataclass(slots=True)
class Outcome(Generic[T]):
    """The result of guarding one message: what happened, and what the handler returned.

    ``result`` is the handler's return value now, or the one stored by the first delivery for a
    DUPLICATE. ``record`` is the stored record that a lost claim met (DUPLICATE, IN_PROGRESS);
    ``error`` what a batch message's handler raised (FAILED, ``process_batch`` only).
    """

    status: Status
    message_id: str
    result: T | None = None
    record: Record | None = None
    error: BaseException | None = None

    @classmethod
    def processed(cls, message_id: str, result: T) -> Outcome[T]:
        """The handler ran now and its effect committed (or its lease was completed)."""
        return cls(Status.PROCESSED, message_id, result)

    @classmethod
    def failed(cls, message_id: str, error: BaseException) -> Outcome[Any]:
        """A batch message whose handler, payload check or id failed; the others went on."""
        return cls(Status.FAILED, message_id, error=error)

    @property
    def should_ack(self) -> bool:
        """True when the delivery can be acknowledged: the effect is committed (now or before)."""
        return self.status in (Status.PROCESSED, Status.DUPLICATE)


def validate_message_id(message_id: object) -> str:
    """Return ``message_id`` if it can be a dedup key, else raise :class:`InvalidMessageIdError`.

    Keys are exact — no trimming, case folding or normalisation — so ``"a"``/``"A"``/``"a "`` are
    three messages on every backend. NUL and lone surrogates are refused because PostgreSQL and
    UTF-8 cannot store them, and a key that cannot be stored cannot be deduplicated.
    """
    if not isinstance(message_id, str):
        raise InvalidMessageIdError(f"message id must be str, got {type(message_id).__name__}")
    if not message_id:
        raise InvalidMessageIdError("message id is empty")
    if len(message_id) > MAX_MESSAGE_ID_CHARS:
        raise InvalidMessageIdError(
            f"message id has {len(message_id)} characters, the maximum is {MAX_MESSAGE_ID_CHARS}"
        )
    if "\x00" in message_id:
        raise InvalidMessageIdError("message id contains a NUL character")
    if not message_id.isascii():
        try:
            message_id.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidMessageIdError("message id is not valid Unicode (lone surrogate)") from exc
    return message_id


def validate_business_id(business_id: object) -> str | None:
    """``None`` or a non-empty ``str`` of at most 64 characters (the seed's column width)."""
    if business_id is None:
        return None
    if not isinstance(business_id, str):
        raise InvalidBusinessIdError(
            f"business id must be str or None, got {type(business_id).__name__}"
        )
    if not business_id or len(business_id) > MAX_BUSINESS_ID_CHARS or "\x00" in business_id:
        raise InvalidBusinessIdError(
            f"business id must have 1-{MAX_BUSINESS_ID_CHARS} characters and no NUL"
        )
    if not business_id.isascii():
        try:
            business_id.encode("utf-8")
        except UnicodeEncodeError as exc:  # no store can keep it: refused before anything runs
            raise InvalidBusinessIdError(
                "business id is not valid Unicode (lone surrogate)"
            ) from exc
    return business_id


def new_owner_token() -> str:
    """A claim's owner token: 32 random hex digits (the ``owner`` column's width).

    Every claim gets its own, so a worker whose lease was taken over can never complete or
    release the new owner's claim: the store compares tokens, not workers.
    """
    return secrets.token_hex(16)


@dataclass(frozen=True, slots=True)
class Policy:
    """A guard's fixed settings; builds validated claim requests."""

    consumer: str
    mode: Mode
    lease_ms: int
    clock: Clock
    codec: Codec[Any] = field(default_factory=JsonCodec)
    wait_ms: int = 0  # lease mode: how long a duplicate waits for a live claim to finish
    renew: bool = True  # lease mode: renew the claim while its handler runs

    @property
    def renews(self) -> bool:
        """Whether a running handler's claim is renewed (lease mode with ``renew``)."""
        return self.renew and self.mode is Mode.LEASE

    @classmethod
    def build(
        cls,
        *,
        consumer: object,
        mode: str,
        lease_s: float,
        clock: Clock | None,
        codec: Codec[Any] | None = None,
        wait_s: float = 0.0,
        renew: bool = True,
    ) -> Policy:
        """Validated settings (:class:`~idemq.ConfigurationError` for anything off)."""
        if not isinstance(consumer, str) or not 0 < len(consumer) <= MAX_MESSAGE_ID_CHARS:
            raise ConfigurationError("consumer must be a str of 1-128 characters")
        try:
            parsed_mode = Mode(mode)
        except ValueError as exc:
            raise ConfigurationError(
                f"mode must be one of {[m.value for m in Mode]}, got {mode!r}"
            ) from exc
        if not lease_s > 0:
            raise ConfigurationError(f"lease_s must be positive, got {lease_s!r}")
        if not wait_s >= 0:
            raise ConfigurationError(f"wait_s must be >= 0, got {wait_s!r}")
        if codec is not None and not isinstance(codec, Codec):
            raise ConfigurationError(f"codec must have encode() and decode(), got {codec!r}")
        return cls(
            consumer,
            parsed_mode,
            round(lease_s * 1000),
            clock or system_clock_ms,
            codec or JsonCodec(),
            round(wait_s * 1000),
            bool(renew),
        )

    def encode(self, result: object) -> str:
        """``result`` as stored (:data:`~idemq.guard.codec.NULL_RESULT` for ``None``)."""
        return NULL_RESULT if result is None else self.codec.encode(result)

    def decode(self, text: str | None) -> Any:
        """A stored result as a duplicate is answered with it."""
        return None if text is None or text == NULL_RESULT else self.codec.decode(text)

    def request(
        self, message_id: object, business_id: object = None, payload: object = None
    ) -> ClaimRequest:
        """Validate and hash everything up front: an invalid message writes nothing."""
        return ClaimRequest(
            key=Key(self.consumer, validate_message_id(message_id)),
            business_id=validate_business_id(business_id),
            payload_hash=hash_payload(payload),
            owner=new_owner_token(),
            now_ms=self.clock(),
            # A transactional claim holds no lease: its row commits with the effect or not at all.
            lease_ms=self.lease_ms if self.mode is Mode.LEASE else 0,
        )


def judge(policy: Policy, request: ClaimRequest, claim: Claim) -> Outcome[Any] | None:
    """What a claim means: ``None`` — run the handler; otherwise the outcome to return as is.

    A lost claim is a DUPLICATE when the record is PROCESSED (its result replayed) and IN_PROGRESS
    when another owner holds a live lease. Either way a payload that differs from the first one's
    raises :class:`PayloadMismatchError`: the id was reused for another message.
    """
    if claim.acquired:
        return None
    record = claim.record
    assert record is not None, "a lost claim carries the existing record"
    if (
        request.payload_hash is not None
        and record.payload_hash is not None
        and request.payload_hash != record.payload_hash
    ):
        raise PayloadMismatchError(
            request.key.message_id, record.payload_hash, request.payload_hash
        )
    message_id = request.key.message_id
    if record.status is RecordStatus.PROCESSED:
        return Outcome(Status.DUPLICATE, message_id, policy.decode(record.result), record)
    return Outcome(Status.IN_PROGRESS, message_id, None, record)


def processed_record(policy: Policy, request: ClaimRequest, result: object) -> Record:
    """The PROCESSED record that ``request``'s message has once its handler returned ``result``
    and the effect committed (or the lease completed): what a later duplicate would read."""
    key = request.key
    return Record(
        consumer=key.consumer,
        message_id=key.message_id,
        status=RecordStatus.PROCESSED,
        business_id=request.business_id,
        payload_hash=request.payload_hash,
        result=policy.encode(result),
    )
