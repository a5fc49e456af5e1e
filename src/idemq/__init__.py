"""idemq: exactly-once business effects for at-least-once message consumers.

Brokers deliver at least once; idemq records each message id in a dedup store — in the same
database transaction as the business change when it can — so every message's effect happens once.
See the README for the guarantees of each store and mode.
"""

from idemq.core import Mode, Outcome, Status
from idemq.errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
    IdemqError,
    InvalidBusinessIdError,
    InvalidInputError,
    InvalidMessageError,
    InvalidMessageIdError,
    LeaseLostError,
    LockError,
    LockNotOwnedError,
    PayloadMismatchError,
    ResultNotSerializableError,
    StoreConflictError,
    StoreError,
    StoreUnavailableError,
)
from idemq.idempotency import AsyncIdempotency, Idempotency
from idemq.message import Message
from idemq.stores.base import Record, RecordStatus
from idemq.stores.memory import MemoryStore
from idemq.stores.sql import AsyncSqlStore, SqlStore

__version__ = "0.1.0"

__all__ = [
    "AsyncIdempotency",
    "AsyncSqlStore",
    "ClockMovedBackwardsError",
    "ConfigurationError",
    "IdemqError",
    "Idempotency",
    "InvalidBusinessIdError",
    "InvalidInputError",
    "InvalidMessageError",
    "InvalidMessageIdError",
    "LeaseLostError",
    "LockError",
    "LockNotOwnedError",
    "MemoryStore",
    "Message",
    "Mode",
    "Outcome",
    "PayloadMismatchError",
    "Record",
    "RecordStatus",
    "ResultNotSerializableError",
    "SqlStore",
    "Status",
    "StoreConflictError",
    "StoreError",
    "StoreUnavailableError",
    "__version__",
]
