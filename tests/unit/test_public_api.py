"""The public API is exactly what DESIGN.md promises (plus deliberate extensions)."""

from __future__ import annotations

import inspect

import idemq
import idemq.errors

EXPECTED = {
    "CompositeObserver",
    "LoggingObserver",
    "Observer",
    "StoreStats",
    "AsyncIdempotency",
    "AsyncOutbox",
    "AsyncRedisLock",
    "AsyncRedisStore",
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
    "MessageIdGenerator",
    "MessageIdParts",
    "Mode",
    "NodeLease",
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
}


def test_all_is_pinned():
    assert set(idemq.__all__) == EXPECTED
    assert len(idemq.__all__) == len(set(idemq.__all__))
    for name in idemq.__all__:
        assert hasattr(idemq, name), name


def test_every_error_is_in_the_tree_and_importable_from_idemq():
    errors = [
        obj
        for _, obj in inspect.getmembers(idemq.errors, inspect.isclass)
        if issubclass(obj, Exception) and obj.__module__ == "idemq.errors"
    ]
    for error in errors:
        assert issubclass(error, idemq.IdemqError), error
        assert error.__name__ in (idemq.errors.__doc__ or ""), f"{error} missing from the drawing"
    for name in (
        "InvalidMessageIdError",
        "PayloadMismatchError",
        "StoreUnavailableError",
        "LeaseLostError",
        "LockNotOwnedError",
        "ClockMovedBackwardsError",
        "ConfigurationError",
    ):
        assert getattr(idemq, name) is getattr(idemq.errors, name)


def test_every_public_name_has_a_docstring():
    for name in idemq.__all__:
        obj = getattr(idemq, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"
