"""idemq: exactly-once business effects for at-least-once message consumers.

Brokers deliver at least once; idemq records each message id in a dedup store — in the same
database transaction as the business change when it can — so every message's effect happens once.
See the README for the guarantees of each store and mode.

Every public name is importable from here; the subpackages (``idemq.guard``, ``idemq.stores``,
``idemq.brokers`` …) hold the code, one job per package.
"""

from importlib import metadata as _metadata

from idemq.business import (
    StateMachine,
    Transition,
    TransitionResult,
    versioned_update,
    versioned_update_async,
)
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
    TransactionLostError,
    UnknownEventError,
)
from idemq.guard import AsyncIdempotency, Idempotency, Mode, Outcome, Status
from idemq.ids import MessageIdGenerator, MessageIdParts, NodeLease, lease_node, parse_message_id
from idemq.lock import AsyncRedisLock, RedisLock
from idemq.message import Message
from idemq.migrations import schema_metadata
from idemq.observe import CompositeObserver, LoggingObserver, Observer
from idemq.outbox import AsyncOutbox, Outbox, OutboxRelay
from idemq.stores import open_store
from idemq.stores.base import Record, RecordStatus, StoreStats
from idemq.stores.memory import MemoryStore
from idemq.stores.redis import AsyncRedisStore, RedisStore
from idemq.stores.sql import AsyncSqlStore, SqlStore

# The version is written once, in pyproject.toml; the installed distribution's metadata carries it.
__version__ = _metadata.version("idemq")

__all__ = [
    "AsyncIdempotency",
    "AsyncOutbox",
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
    "Outbox",
    "OutboxRelay",
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
    "TransactionLostError",
    "Transition",
    "TransitionResult",
    "UnknownEventError",
    "__version__",
    "lease_node",
    "open_store",
    "parse_message_id",
    "schema_metadata",
    "versioned_update",
    "versioned_update_async",
]

# Public names report ``idemq`` as their module (reprs, pickles, docs), not the private path of
# the file that defines them, so moving code between files never changes what users see.
# Exceptions keep ``idemq.errors``, their documented home.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("idemq.") and _obj.__module__ != "idemq.errors":
        _obj.__module__ = __name__
del _name, _obj
