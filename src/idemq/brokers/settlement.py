"""How every delivery is settled: a pure function of what happened, the attempt and the policy.

* PROCESSED / DUPLICATE            → ack (only after the dedup transaction committed)
* IN_PROGRESS                      → retry later, never ack (acking would hide a crashed twin)
* handler error                    → retry with exponential backoff, dead-letter at max_attempts
                                     (the one retry that counts as an attempt, see :class:`Retry`)
* invalid id / body, payload clash → dead-letter at once (retrying cannot help; it would block)
* store unavailable, or refusing   → retry later, never dead-letter (the message is fine)
  the setup (login, dedup table)

The worker, the batched worker and the FastStream middleware all call :func:`decide`, so a
delivery is settled the same way whichever of them consumed it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from idemq._backoff import Backoff
from idemq.drivers.sql import connection_lost
from idemq.errors import (
    InvalidInputError,
    LeaseLostError,
    PayloadMismatchError,
    StoreConfigurationError,
    StoreUnavailableError,
)


class Verdict(enum.Enum):
    """What happened to one delivery; the input of :func:`decide`."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    IN_PROGRESS = "in_progress"
    HANDLER_ERROR = "handler_error"
    INVALID_MESSAGE = "invalid_message"
    PAYLOAD_MISMATCH = "payload_mismatch"
    STORE_UNAVAILABLE = "store_unavailable"


@dataclass(frozen=True, slots=True)
class Ack:
    """Acknowledge: the effect is committed (or was, by an earlier delivery)."""


@dataclass(frozen=True, slots=True)
class Retry:
    """Do not ack; have the broker deliver the message again after ``delay_s``.

    ``counted`` is true only when the handler ran and failed: the next delivery is then idemq's
    next attempt. The broker's own delivery counters also count the redeliveries an outage, a
    twin holding the lease or a crashed worker caused, so adapters carry idemq's attempt number
    themselves (the ``idemq-delivery-attempt`` header, bumped only by a counted retry).
    """

    delay_s: float
    counted: bool = False


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Move the message to the dead-letter destination with ``reason`` in its headers."""

    reason: str


Settlement = Ack | Retry | DeadLetter


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long to wait before redelivery, and when a failing message is given up on."""

    max_attempts: int = 5
    backoff_base_s: float = 0.5
    backoff_max_s: float = 60.0
    # A twin holds the claim: come back after roughly a lease, not instantly (a hot loop).
    in_progress_delay_s: float = 5.0
    store_unavailable_delay_s: float = 2.0

    @property
    def backoff(self) -> Backoff:
        """The backoff of a failing handler's retries (no jitter: each message has its own
        attempt count, so their retries do not line up)."""
        return Backoff(self.backoff_base_s, self.backoff_max_s)

    def backoff_s(self, delivery_attempt: int) -> float:
        """The wait before the retry after failed attempt ``delivery_attempt`` (1-based)."""
        return self.backoff.delay_s(delivery_attempt)


def decide(
    verdict: Verdict, delivery_attempt: int, policy: RetryPolicy, detail: str = ""
) -> Settlement:
    """Map what happened to one delivery to how it must be settled (pure; see module doc)."""
    if verdict in (Verdict.PROCESSED, Verdict.DUPLICATE):
        return Ack()
    if verdict is Verdict.IN_PROGRESS:
        return Retry(policy.in_progress_delay_s)
    if verdict is Verdict.STORE_UNAVAILABLE:
        # Never counted against max_attempts: an outage must not dead-letter good messages.
        return Retry(policy.store_unavailable_delay_s)
    if verdict is Verdict.HANDLER_ERROR:
        if delivery_attempt >= policy.max_attempts:
            return DeadLetter(
                f"{verdict.value}: gave up after {delivery_attempt} attempts: {detail}".rstrip()
            )
        return Retry(policy.backoff_s(delivery_attempt), counted=True)
    # INVALID_MESSAGE, PAYLOAD_MISMATCH: the same bytes fail the same way every time.
    return DeadLetter(f"{verdict.value}: {detail}".rstrip())


def classify(exc: BaseException) -> Verdict:
    """Which :class:`Verdict` an exception raised by ``guard.process`` stands for.

    A handler's own statement that failed because its database connection dropped (lease mode:
    the handler's engine is its own, so the guard passes the driver's error on) is the store
    being unavailable too: the effect did not commit, and the same message will work once the
    database is back, so it is retried and never counted toward dead-lettering.
    """
    if isinstance(exc, StoreUnavailableError | StoreConfigurationError) or connection_lost(exc):
        # A refused login or a dropped dedup table is no fault of the message: it waits, its
        # attempts uncounted, until the setup is fixed (never dead-lettered for it).
        return Verdict.STORE_UNAVAILABLE
    if isinstance(exc, PayloadMismatchError):
        return Verdict.PAYLOAD_MISMATCH
    if isinstance(exc, InvalidInputError):
        return Verdict.INVALID_MESSAGE
    if isinstance(exc, LeaseLostError):
        # Another worker took the message over; redeliver later and it reads as DUPLICATE.
        return Verdict.IN_PROGRESS
    return Verdict.HANDLER_ERROR
