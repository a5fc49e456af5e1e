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
    UnknownEventError,
)
from idemq.idempotency import Idempotency
from idemq.idempotency_async import AsyncIdempotency
from idemq.ids import MessageIdGenerator, MessageIdParts, parse_message_id
from idemq.lock import AsyncRedisLock, RedisLock
from idemq.message import Message
from idemq.node_lease import NodeLease, lease_node
from idemq.observe import CompositeObserver, LoggingObserver, Observer
from idemq.state_machine import StateMachine, Transition, TransitionResult
from idemq.stores import open_store
from idemq.stores.base import Record, RecordStatus, StoreStats
from idemq.stores.memory import MemoryStore
from idemq.stores.redis import AsyncRedisStore, RedisStore
from idemq.stores.sql import SqlStore
from idemq.stores.sql_async import AsyncSqlStore
from idemq.versioned import versioned_update, versioned_update_async

__version__ = "0.1.0"

__all__ = [
    "AsyncIdempotency",
    "AsyncRedisLock",
    "AsyncRedisStore",
    "AsyncSqlStore",
    "ClockMovedBackwardsError",
    "CompositeObserver",
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
    "LoggingObserver",
    "MemoryStore",
    "Message",
    "MessageIdGenerator",
    "MessageIdParts",
    "Mode",
    "NodeLease",
    "Observer",
    "Outcome",
    "PayloadMismatchError",
    "Record",
    "RecordStatus",
    "RedisLock",
    "RedisStore",
    "ResultNotSerializableError",
    "SqlStore",
    "StateMachine",
    "Status",
    "StoreConflictError",
    "StoreError",
    "StoreStats",
    "StoreUnavailableError",
    "Transition",
    "TransitionResult",
    "UnknownEventError",
    "__version__",
    "lease_node",
    "open_store",
    "parse_message_id",
    "versioned_update",
    "versioned_update_async",
]
