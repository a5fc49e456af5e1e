"""``idemq stats``, ``idemq inspect`` and ``idemq release`` against every store (real services).

The CLI runs in-process (``cli.main``); records are written through the library with a fake
clock, then the CLI's JSON answers and exit codes are checked against the store's contents.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import idemq
from idemq import cli
from idemq._clock import system_clock_ms
from idemq.guard.codec import hash_payload
from idemq.stores.base import ClaimRequest, Key, RecordStatus
from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL
from tests.contract.conftest import dispose, make_store

STORES = ["sqlite", "postgres", "mariadb", "redis", "redis-cluster"]
HOUR_MS = 3_600_000


class Store:
    """A store made by the contract factories, plus the CLI arguments that name it."""

    def __init__(self, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.store: Any = make_store(kind, tmp_path, request)
        if kind == "redis":
            self.args = ["--store", REDIS_URL, "--prefix", self.store.prefix]
        elif kind == "redis-cluster":
            url = request.getfixturevalue("redis_cluster").url
            self.args = ["--store", url, "--prefix", self.store.prefix]
        else:
            url = {"postgres": PG_URL, "mariadb": MYSQL_URL}.get(
                kind, f"sqlite:///{tmp_path / 'idemq.db'}"
            )
            self.args = ["--store", url, "--table", self.store.table.name]


@pytest.fixture(params=STORES)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    made = Store(request.param, tmp_path, request)
    yield made
    dispose(made.store)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in argv and out.strip() else out


def seed(store: Any) -> int:
    """3 processed (one twice), 1 stuck claim (lease long over), 1 live claim."""
    now_ms = system_clock_ms()
    guard = idemq.Idempotency(store, consumer="orders", mode="lease", lease_s=30)
    for i in range(3):
        guard.process(f"ORDER_{i}", lambda _tx, i=i: {"paid": i}, payload=f"body {i}")
    guard.process("ORDER_0", lambda _tx: {"paid": "again?"}, payload="body 0")
    stuck = ClaimRequest(
        Key("orders", "STUCK"), None, None, "dead-worker", now_ms - HOUR_MS, 30_000
    )
    live = ClaimRequest(Key("orders", "LIVE"), None, None, "busy-worker", now_ms, HOUR_MS)
    assert store.claim(stuck).acquired
    assert store.claim(live).acquired
    return now_ms


def test_stats_json_reports_the_store(target: Store, capsys: pytest.CaptureFixture[str]) -> None:
    seed(target.store)
    code, report = run(capsys, "stats", *target.args, "--json")
    assert code == cli.EXIT_OK
    assert report["records"] == {"processing": 2, "processed": 3}
    assert report["total"] == 5
    assert report["stuck_leases"] == 1
    assert [r["message_id"] for r in report["stuck_records"]] == ["STUCK"]
    assert report["stuck_records"][0]["lease_expired"] is True
    assert report["oldest_processing_age_s"] >= HOUR_MS / 1000 - 60
    assert report["size_bytes"] > 0
    assert report["size_method"]


def test_stats_table_names_the_stuck_record(
    target: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    seed(target.store)
    code, out = run(capsys, "stats", *target.args)
    assert code == cli.EXIT_OK
    assert "STUCK" in out
    assert "dead-worker" in out


def test_inspect_shows_status_times_result_and_hash(
    target: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    seed(target.store)
    code, records = run(capsys, "inspect", "ORDER_0", *target.args, "--json")
    assert code == cli.EXIT_OK
    [record] = records
    assert record["status"] == "processed"
    assert record["result"] == {"paid": 0}  # the first run's result; the duplicate did not run
    assert record["payload_hash"] == hash_payload("body 0")
    assert record["processed_time"] is not None
    assert record["created_time"] is not None
    code, _ = run(capsys, "inspect", "NOPE", *target.args, "--json")
    assert code == cli.EXIT_NOT_FOUND


def test_release_frees_a_stuck_lease(target: Store, capsys: pytest.CaptureFixture[str]) -> None:
    seed(target.store)
    code, answer = run(capsys, "release", "STUCK", *target.args, "--yes", "--json")
    assert code == cli.EXIT_OK
    assert answer == {"message_id": "STUCK", "consumer": "orders", "released": True}
    assert target.store.get("STUCK", "orders") is None
    assert target.store.stats().processing == 1  # only LIVE is left


def test_release_refuses_a_processed_record(
    target: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    seed(target.store)
    code, _ = run(capsys, "release", "ORDER_1", *target.args, "--yes")
    assert code == cli.EXIT_REFUSED
    record = target.store.get("ORDER_1", "orders")
    assert record is not None
    assert record.status is RecordStatus.PROCESSED
    code, _ = run(capsys, "release", "NOPE", *target.args, "--yes")
    assert code == cli.EXIT_NOT_FOUND


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("target", ["sqlite"], indirect=True)
def test_release_asks_on_a_terminal_and_aborts_without_one(
    target: Store, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(target.store)
    code, _ = run(capsys, "release", "STUCK", *target.args)  # pytest's stdin is no terminal
    assert code == cli.EXIT_ABORTED
    monkeypatch.setattr("sys.stdin", _Terminal("n\n"))
    code, _ = run(capsys, "release", "STUCK", *target.args)
    assert code == cli.EXIT_ABORTED
    assert target.store.get("STUCK", "orders") is not None
    monkeypatch.setattr("sys.stdin", _Terminal("y\n"))
    code, _ = run(capsys, "release", "STUCK", *target.args)
    assert code == cli.EXIT_OK
    assert target.store.get("STUCK", "orders") is None


@pytest.mark.parametrize("target", ["sqlite"], indirect=True)
def test_release_needs_a_consumer_when_several_hold_the_id(
    target: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    for consumer in ("billing", "mailer"):
        request = ClaimRequest(Key(consumer, "M"), None, None, consumer, 0, 1)
        assert target.store.claim(request).acquired
    code, _ = run(capsys, "release", "M", *target.args, "--yes")
    assert code == cli.EXIT_USAGE
    code, _ = run(capsys, "release", "M", *target.args, "--yes", "--consumer", "mailer")
    assert code == cli.EXIT_OK
    assert target.store.get("M", "mailer") is None
    assert target.store.get("M", "billing") is not None


def test_store_naming_flags_must_match_the_store(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run(capsys, "stats", "--store", "sqlite://", "--prefix", "x")
    assert code == cli.EXIT_USAGE


def test_forget_lets_a_message_run_again_and_refuses_a_live_lease(
    target: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    seed(target.store)
    code, answer = run(capsys, "forget", "ORDER_1", "--consumer", "orders", *target.args, "--json")
    assert (code, answer["result"]) == (cli.EXIT_OK, "forgotten")
    guard = idemq.Idempotency(target.store, consumer="orders", mode="lease")
    runs: list[int] = []
    assert guard.process("ORDER_1", lambda _tx: runs.append(1)).status is idemq.Status.PROCESSED
    assert runs == [1]
    code, _ = run(capsys, "forget", "LIVE", "--consumer", "orders", *target.args)
    assert code == cli.EXIT_REFUSED
    assert target.store.get("LIVE", "orders") is not None
    code, _ = run(capsys, "forget", "LIVE", "--consumer", "orders", "--force", *target.args)
    assert code == cli.EXIT_OK
    code, _ = run(capsys, "forget", "NOPE", "--consumer", "orders", *target.args)
    assert code == cli.EXIT_NOT_FOUND


@pytest.mark.parametrize(
    "table", ["x; DROP TABLE important; --", "a b", "", "t" * 51, "tä", 'q"uote']
)
def test_schema_refuses_a_table_name_that_is_not_an_identifier(
    table: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(capsys, "schema", "--dialect", "postgresql", "--table", table)
    assert code == cli.EXIT_USAGE
    assert out == ""  # no DDL printed for it
    with pytest.raises(idemq.ConfigurationError):
        idemq.SqlStore("sqlite://", table=table)
