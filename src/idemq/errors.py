"""The whole idemq exception tree.

Every error idemq raises on purpose derives from :class:`IdemqError`, so one ``except`` clause
catches them all. Driver errors (psycopg, PyMySQL, redis-py, broker clients) never escape the
public API: they are translated at the boundary and kept as ``__cause__``.

::

    IdemqError
    ├── InvalidInputError (ValueError)          bad input from a caller or a message
    │   ├── InvalidMessageIdError               id missing, not str, empty, > 128 chars, NUL …
    │   ├── InvalidBusinessIdError              business id not str, empty or > 64 chars
    │   ├── InvalidMessageError                 undecodable or malformed message body
    │   ├── UnknownEventError                   StateMachine.apply with an event it does not know
    │   └── ResultNotSerializableError (TypeError)  handler result is not JSON-serializable
    ├── PayloadMismatchError                    same id seen before with another payload
    ├── ConfigurationError                      a mistake in how idemq was set up
    ├── StoreError                              the dedup store failed
    │   ├── StoreUnavailableError               … because it could not be reached or timed out
    │   ├── StoreConfigurationError             … it refused this setup: login, database, table
    │   │                                           (also a ConfigurationError)
    │   ├── StoreIntegrityError                 … a write broke a constraint of the table
    │   │   └── DuplicateKeyError               … its key was taken (another writer came first)
    │   └── StoreConflictError                  … a transient conflict (deadlock); safe to retry
    │       └── TransactionLostError            the dedup row is not in what would commit
    ├── LeaseLostError                          a lease expired and another worker took over
    ├── LockError
    │   └── LockNotOwnedError                   release/extend of a lock this owner no longer holds
    ├── BrokerError                             a message broker failed or was misused
    │   ├── BrokerUnavailableError              … it could not be reached or dropped the connection
    │   ├── BrokerRefusedError                  … it answered a publish with no (full, too big …)
    │   └── AlreadySettledError                 a delivery was acked/retried/dead-lettered twice
    └── ClockMovedBackwardsError                the wall clock stepped back past the tolerated drift
"""

from __future__ import annotations

__all__ = [
    "AlreadySettledError",
    "BrokerError",
    "BrokerRefusedError",
    "BrokerUnavailableError",
    "ClockMovedBackwardsError",
    "ConfigurationError",
    "DuplicateKeyError",
    "IdemqError",
    "InvalidBusinessIdError",
    "InvalidInputError",
    "InvalidMessageError",
    "InvalidMessageIdError",
    "LeaseLostError",
    "LockError",
    "LockNotOwnedError",
    "PayloadMismatchError",
    "ResultNotSerializableError",
    "StoreConfigurationError",
    "StoreConflictError",
    "StoreError",
    "StoreIntegrityError",
    "StoreUnavailableError",
    "TransactionLostError",
    "UnknownEventError",
]


class IdemqError(Exception):
    """Root of every error idemq raises on purpose."""


class InvalidInputError(IdemqError, ValueError):
    """A value handed to idemq (by a caller or inside a message) cannot be used."""


class InvalidMessageIdError(InvalidInputError):
    """The message id is missing, not a ``str``, empty, longer than 128 characters or unstorable.

    Raised before anything is written, so the message can be dead-lettered with this reason.
    """


class InvalidBusinessIdError(InvalidInputError):
    """The business id is not a ``str``, is empty or is longer than 64 characters."""


class InvalidMessageError(InvalidInputError):
    """A message body cannot be decoded or lacks what the handler needs."""


class UnknownEventError(InvalidInputError):
    """``StateMachine.apply`` was called with an event that has no transition.

    A ``ValueError`` (via :class:`InvalidInputError`): the event usually comes from a message
    body, and a message naming an unknown event should be dead-lettered, not retried.
    """


class ResultNotSerializableError(InvalidInputError, TypeError):
    """The handler returned a value that cannot be stored as JSON for replay."""


class PayloadMismatchError(IdemqError):
    """The same message id was seen before with a different payload.

    Usually a producer bug (an id reused for another message); processing it would silently drop
    the second message's effect, so idemq refuses instead.
    """

    def __init__(self, message_id: str, stored_hash: str, given_hash: str) -> None:
        # The constructor's arguments are the exception's args, so it is rebuilt as itself
        # wherever it travels: pickled (a process pool), or as type + args (Celery's results).
        super().__init__(message_id, stored_hash, given_hash)
        self.message_id = message_id
        self.stored_hash = stored_hash
        self.given_hash = given_hash

    def __str__(self) -> str:
        return (
            f"message id {self.message_id!r} was first seen with payload sha256 "
            f"{self.stored_hash[:12]}…, now with {self.given_hash[:12]}…"
        )


class ConfigurationError(IdemqError):
    """idemq was set up in a way that cannot work (unknown mode, bad URL, bad identifier …)."""


class StoreError(IdemqError):
    """The dedup store failed to answer as expected."""


class StoreUnavailableError(StoreError):
    """The dedup store could not be reached, or the operation timed out.

    Nothing was acknowledged: the message must be retried (nack/requeue) once the store is back.
    """


class StoreConfigurationError(StoreError, ConfigurationError):
    """The store answered, and refused this setup: a refused login, an unknown database, a
    missing table (a mistyped ``--table``, a schema never created).

    Not an outage: the same settings fail the same way however often they are retried, so the
    CLI exits 2 with one line instead of 4. Not the message's fault either: a running worker
    retries the message without counting the attempt, until the setup is fixed.
    """


class StoreIntegrityError(StoreError):
    """The database refused a write that breaks a constraint of its table (a unique key, a
    NOT NULL column).

    Not an outage and not a conflict: the same statement fails the same way when run again.
    """


class DuplicateKeyError(StoreIntegrityError):
    """An INSERT found its key taken: another writer inserted the same key first.

    idemq's own inserts that can race (a node lease, an id reservation, a derived outbox id)
    catch it and read the winner's row instead.
    """


class StoreConflictError(StoreError):
    """A transient conflict (deadlock, serialization failure, busy database) while claiming.

    Nothing was written; the guard retries a claim that fails this way when it owns the
    transaction, and raises it when it runs inside the caller's transaction.
    """


class TransactionLostError(StoreConflictError):
    """Transactional mode: just before COMMIT, the transaction no longer holds the message's
    dedup row, so committing would not record the message as processed.

    A handler caught a database error without a savepoint of its own: PostgreSQL aborted the
    transaction (its COMMIT would silently roll back), or InnoDB rolled it back on a deadlock
    and the handler's later statements ran in a new transaction without the row. Everything is
    rolled back and the message is not acknowledged: idemq runs a transaction of its own again,
    and a message that keeps losing it is retried as a failed attempt, then dead-lettered. A
    handler that must survive a failing statement wraps it in ``tx.begin_nested()``.
    """


class LeaseLostError(IdemqError):
    """The lease on a message ran out and another worker claimed it; this worker's
    ``complete`` was refused so its late result cannot overwrite the new owner's."""


class LockError(IdemqError):
    """Base class of distributed-lock errors."""


class LockNotOwnedError(LockError):
    """Release or extend of a lock that this owner no longer holds (expired or taken over)."""


class BrokerError(IdemqError):
    """A message broker failed, or a delivery was used in a way the broker cannot honour."""


class BrokerUnavailableError(BrokerError):
    """The broker could not be reached or dropped the connection; the worker reconnects."""


class BrokerRefusedError(BrokerError):
    """The broker was reached and refused the message: a full queue that rejects publishes, no
    queue or stream to take it, a body or headers over the broker's limits.

    Not an outage: publishing the same message again meets the same answer until someone
    changes the broker or the message, so the outbox relay counts it as an attempt (and
    dead-letters the row after ``max_attempts``) where an outage only makes it wait.
    """


class AlreadySettledError(BrokerError):
    """A delivery was settled (ack, retry or dead-letter) a second time.

    Settling twice is always a bug: a second ack could acknowledge a later redelivery of the
    same message, hiding a crash; so it is refused loudly instead of ignored.
    """


class ClockMovedBackwardsError(IdemqError):
    """The wall clock moved backwards further than the generator's tolerance."""

    def __init__(self, last_ms: int, now_ms: int) -> None:
        super().__init__(last_ms, now_ms)  # rebuilt as itself (see PayloadMismatchError)
        self.last_ms = last_ms
        self.now_ms = now_ms

    def __str__(self) -> str:
        return (
            f"clock moved backwards by {self.last_ms - self.now_ms} ms (last id at {self.last_ms})"
        )
