"""The store protocol is split: the guard's primitives apart from the operator's tools."""

from __future__ import annotations

import idemq
from idemq.stores import base


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_the_guard_and_the_operator_see_disjoint_methods() -> None:
    guard = _members(base.GuardStore) | _members(base.TransactionalGuardStore)
    admin = _members(base.StoreAdmin)
    assert guard.isdisjoint(admin)
    assert {"claim", "claim_many", "complete", "release", "renew", "forget"} <= guard
    assert {"get", "find", "in_progress", "purge", "stats", "force_release"} == admin


def test_each_async_protocol_has_the_same_methods_as_its_sync_twin() -> None:
    for sync, asynchronous in (
        (base.GuardStore, base.AsyncGuardStore),
        (base.StoreAdmin, base.AsyncStoreAdmin),
        (base.TransactionalGuardStore, base.AsyncTransactionalGuardStore),
    ):
        assert _members(sync) == _members(asynchronous)


def test_every_idemq_store_is_a_whole_store(tmp_path: object) -> None:
    sql = idemq.SqlStore(f"sqlite:///{tmp_path}/protocols.db")
    try:
        assert isinstance(sql, base.TransactionalStore)
        assert isinstance(idemq.MemoryStore(), base.Store)
        assert not isinstance(idemq.MemoryStore(), base.TransactionalGuardStore)
    finally:
        sql.close()
