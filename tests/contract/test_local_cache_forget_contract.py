"""How long a forgotten message may still be answered from another guard's local cache.

``local_cache=`` keeps completed records in memory; a ``forget`` elsewhere (``idemq forget``,
another process) is not pushed to it. The bound is the cache's TTL, 30 s by default: the docs
say so, ``idemq forget`` prints it, and these tests hold the code to both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import idemq
from idemq import cli
from idemq.guard.cache import DEFAULT_LOCAL_CACHE_TTL_S
from idemq.stores.base import ForgetResult
from tests.conftest import unique
from tests.contract.conftest import FakeClock, dispose, make_store


@pytest.fixture(params=["sqlite", "redis"])
def lease_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    made = make_store(request.param, tmp_path, request)
    yield made
    dispose(made)


def test_a_forget_elsewhere_is_seen_by_a_cached_guard_within_the_default_ttl(lease_store):
    clock = FakeClock()
    consumer = unique("c")
    worker = idemq.Idempotency(
        lease_store, consumer=consumer, mode="lease", clock=clock, local_cache=100
    )
    runs: list[int] = []
    assert worker.process("M1", lambda _tx: runs.append(1)).status is idemq.Status.PROCESSED
    assert worker.process("M1", lambda _tx: runs.append(1)).status is idemq.Status.DUPLICATE

    # The operator forgets M1 from another process: the worker's cache is not told.
    assert lease_store.forget("M1", consumer, now_ms=clock()) is ForgetResult.FORGOTTEN
    clock.advance(round(DEFAULT_LOCAL_CACHE_TTL_S * 1000) - 1)
    assert worker.process("M1", lambda _tx: runs.append(1)).status is idemq.Status.DUPLICATE
    assert runs == [1]  # still answered from memory: the documented bound, not longer
    clock.advance(1)
    assert worker.process("M1", lambda _tx: runs.append(1)).status is idemq.Status.PROCESSED
    assert runs == [1, 1]


def test_the_default_ttl_is_the_documented_30_s():
    assert DEFAULT_LOCAL_CACHE_TTL_S == 30.0
    options = Path(__file__).parents[2] / "docs" / "howto" / "guard-options.md"
    assert "off, 30 s" in options.read_text()


def test_idemq_forget_prints_how_long_other_guards_may_answer_from_their_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    store = make_store("sqlite", tmp_path)
    try:
        idemq.Idempotency(store, consumer="orders", mode="lease").process("M1", lambda _tx: 1)
        args = ["--store", f"sqlite:///{tmp_path / 'idemq.db'}", "--table", store.table.name]
        capsys.readouterr()
        assert cli.main(["forget", "M1", "--consumer", "orders", *args]) == cli.EXIT_OK
        out = " ".join(capsys.readouterr().out.split())
        assert "local_cache=" in out
        assert "up to local_cache_ttl_s (default 30 s)" in out
        idemq.Idempotency(store, consumer="orders", mode="lease").process("M1", lambda _tx: 1)
        assert cli.main(["forget", "M1", "--consumer", "orders", *args, "--json"]) == cli.EXIT_OK
        answer = json.loads(capsys.readouterr().out)
        assert answer["local_cache_bound_s"] == DEFAULT_LOCAL_CACHE_TTL_S
    finally:
        dispose(store)
