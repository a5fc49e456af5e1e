"""Prometheus metrics after a scripted run are exact; store gauges; nothing leaks a password."""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import idemq
from idemq.guard.probes import CompositeObserver
from idemq.observe.logs import LoggingObserver
from idemq.observe.prometheus import PrometheusObserver, StoreCollector, serve_metrics
from idemq.stores import store_label
from idemq.stores.base import ClaimRequest, Key
from tests.conftest import free_port, unique
from tests.contract.conftest import FakeClock, dispose, make_store

N_PROCESSED = 7
M_DUPLICATES = 4


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


@pytest.fixture(params=["memory", "sqlite", "postgres", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    made = make_store(request.param, tmp_path)
    yield made
    dispose(made)


def test_scripted_run_gives_exact_counts(store: Any) -> None:
    registry = CollectorRegistry()
    label = store_label(store)
    guard = idemq.Idempotency(
        store,
        consumer="orders",
        mode="lease",
        observer=PrometheusObserver(registry, store_label=label),
    )
    for i in range(N_PROCESSED):
        guard.process(f"M{i}", lambda _tx: "ok", payload=f"body {i}")
    for i in range(M_DUPLICATES):
        assert guard.process(f"M{i}", lambda _tx: "again", payload=f"body {i}").status.value == (
            "duplicate"
        )
    with pytest.raises(idemq.PayloadMismatchError):
        guard.process("M0", lambda _tx: "x", payload="another body")
    with pytest.raises(ZeroDivisionError):
        guard.process("BOOM", lambda _tx: 1 / 0)
    live = ClaimRequest(Key("orders", "BUSY"), None, None, "other", guard.policy.clock(), 60_000)
    assert store.claim(live).acquired
    assert guard.process("BUSY", lambda _tx: "x").status is idemq.Status.IN_PROGRESS

    labels = {"consumer": "orders", "store": label}

    def messages(outcome: str) -> float:
        return value(registry, "idemq_messages_total", **labels, outcome=outcome)

    assert messages("processed") == N_PROCESSED
    assert messages("duplicate") == M_DUPLICATES
    assert messages("payload_mismatch") == 1
    assert messages("error") == 1
    assert messages("in_progress") == 1
    assert value(registry, "idemq_errors_total", **labels, kind="handler") == 1
    assert value(registry, "idemq_errors_total", **labels, kind="payload_mismatch") == 1
    claims = N_PROCESSED + M_DUPLICATES + 1 + 1 + 1  # every claim, mismatch included
    assert value(registry, "idemq_claim_duration_seconds_count", **labels) == claims
    assert value(registry, "idemq_handler_duration_seconds_count", **labels) == N_PROCESSED + 1
    # The business effect behind the counters: N records processed, BOOM released, BUSY held.
    stats = store.stats()
    assert (stats.processed, stats.processing) == (N_PROCESSED, 1)


def test_transactional_and_batch_runs_are_counted(tmp_path: Path) -> None:
    store = make_store("sqlite", tmp_path)
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry, store_label="s")
    guard = idemq.Idempotency(store, consumer="c", observer=observer)
    try:
        for i in range(3):
            guard.process(f"T{i}", lambda _tx: None)
        guard.process("T0", lambda _tx: None)
        batch = [idemq.Message(id=f"T{i}", body=b"") for i in range(2, 5)]
        guard.process_batch(batch, lambda _msg, _tx: None)
    finally:
        dispose(store)
    labels = {"consumer": "c", "store": "s"}
    assert value(registry, "idemq_messages_total", **labels, outcome="processed") == 5
    assert value(registry, "idemq_messages_total", **labels, outcome="duplicate") == 2


async def test_async_guard_reports_the_same(tmp_path: Path) -> None:
    store = idemq.AsyncSqlStore(f"sqlite:///{tmp_path / 'a.db'}", table=unique("mi"))
    await store.create_schema()
    registry = CollectorRegistry()
    guard = idemq.AsyncIdempotency(
        store, consumer="c", observer=PrometheusObserver(registry, store_label="s")
    )

    async def handler(_tx: Any) -> int:
        return 1

    try:
        for _ in range(3):
            await guard.process("A", handler)
    finally:
        await store.close()
    labels = {"consumer": "c", "store": "s"}
    assert value(registry, "idemq_messages_total", **labels, outcome="processed") == 1
    assert value(registry, "idemq_messages_total", **labels, outcome="duplicate") == 2
    assert value(registry, "idemq_handler_duration_seconds_count", **labels) == 1


def test_store_gauges_are_read_on_scrape_and_rate_limited(store: Any) -> None:
    clock = FakeClock()
    guard = idemq.Idempotency(store, consumer="o", mode="lease", clock=clock)
    for i in range(3):
        guard.process(f"P{i}", lambda _tx: None)
    stale = ClaimRequest(Key("o", "STUCK"), None, None, "dead", clock() - 600_000, 30_000)
    assert store.claim(stale).acquired
    seconds = [1000.0]
    collector = StoreCollector(
        store, store_label="s", min_interval_s=15, clock_s=lambda: seconds[0], now_ms=clock
    )
    registry = CollectorRegistry()
    registry.register(collector)
    assert value(registry, "idemq_store_up", store="s") == 1
    assert value(registry, "idemq_records", store="s", status="processed") == 3
    assert value(registry, "idemq_records", store="s", status="processing") == 1
    assert value(registry, "idemq_stuck_leases", store="s") == 1
    assert value(registry, "idemq_oldest_processing_age_seconds", store="s") == 600
    reads = collector.reads
    assert store.force_release("STUCK", "o")
    generate_latest(registry)
    assert collector.reads == reads  # within min_interval_s: the cached stats are served
    assert value(registry, "idemq_stuck_leases", store="s") == 1
    seconds[0] += 15
    assert value(registry, "idemq_stuck_leases", store="s") == 0
    assert collector.reads == reads + 1


def test_store_down_is_a_gauge_not_a_failed_scrape() -> None:
    store = idemq.SqlStore(
        "postgresql+psycopg://postgres@127.0.0.1:1/test", connect_args={"connect_timeout": 2}
    )
    registry = CollectorRegistry()
    registry.register(StoreCollector(store, store_label="down"))
    try:
        assert value(registry, "idemq_store_up", store="down") == 0
        assert (
            registry.get_sample_value("idemq_records", {"store": "down", "status": "processed"})
            is None
        )
    finally:
        store.close()


def test_metrics_are_served_over_http(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry, store_label="memory")
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="web", observer=observer)
    guard.process("X", lambda _tx: None)
    server = serve_metrics(0, registry=registry, addr="127.0.0.1")
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            body = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'idemq_messages_total{consumer="web",outcome="processed",store="memory"} 1.0' in body


PASSWORD_URL = "postgresql+psycopg://postgres:s3cret@127.0.0.1/test"


def test_no_password_from_the_store_url_in_logs_errors_metrics_or_cli(
    pg_url: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from idemq import cli  # noqa: PLC0415

    caplog.set_level(logging.DEBUG)  # every logger: idemq's, SQLAlchemy's, psycopg's
    table = unique("mi")
    store = idemq.SqlStore(PASSWORD_URL, table=table)  # trust auth ignores the password
    registry = CollectorRegistry()
    observer = CompositeObserver(
        PrometheusObserver(registry, store_label=store_label(store)),
        LoggingObserver(logging.getLogger("idemq.guard")),
    )
    seen: list[str] = [repr(store), store.where, store_label(store)]
    try:
        guard = idemq.Idempotency(store, consumer="pw", observer=observer)
        with pytest.raises(idemq.StoreError) as missing_table:  # before create_schema
            guard.process("M", lambda _tx: None)
        seen += [str(missing_table.value), repr(missing_table.value)]
        store.create_schema()
        guard.process("M", lambda _tx: {"secret-result": 1}, payload="secret-payload")
        guard.process("M", lambda _tx: None, payload="secret-payload")
        registry.register(StoreCollector(store))
        seen.append(generate_latest(registry).decode())
        cli.main(["stats", "--store", PASSWORD_URL, "--table", table])
        cli.main(["inspect", "M", "--store", PASSWORD_URL, "--table", table, "--json"])
        out = capsys.readouterr()
        cli_output = [out.out, out.err]  # inspect shows the stored result: that is its job
    finally:
        store.drop_schema()
        store.close()
    unreachable = idemq.SqlStore("postgresql+psycopg://postgres:s3cret@127.0.0.1:1/test")
    with pytest.raises(idemq.StoreUnavailableError) as down:
        unreachable.stats()
    unreachable.close()
    seen += [str(down.value), repr(unreachable)]
    seen.append(caplog.text)
    seen += [repr(r.__dict__) for r in caplog.records]
    assert any("idemq_message_id" in text for text in seen)  # the structured record was there
    for text in seen:  # logs, errors, reprs, metrics
        assert "s3cret" not in text
        assert "secret-payload" not in text
        assert "secret-result" not in text
    for text in cli_output:
        assert "s3cret" not in text
    assert '"secret-result": 1' in cli_output[0]
    assert "***" in repr(store)


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            outcome = sample.labels.get("outcome") or sample.labels.get("status") or ""
            samples[f"{sample.name}:{outcome}"] = sample.value
    return samples


def test_worker_serves_metrics_on_metrics_port(tmp_path: Path) -> None:
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    from idemq.brokers.embedded import EmbeddedBroker  # noqa: PLC0415
    from idemq.worker.loop import Worker  # noqa: PLC0415
    from idemq.worker.run import run_worker  # noqa: PLC0415

    queue_path = tmp_path / "queue.db"
    producer = EmbeddedBroker(queue_path)
    for i in range(N_PROCESSED):
        producer.publish("q", b"{}", message_id=f"M{i}")
    for i in range(M_DUPLICATES):  # a producer retry: the same message again
        producer.publish("q", b"{}", message_id=f"M{i}")
    producer.publish("q", b"{}", message_id="BAD")
    producer.close()

    def handle(msg: idemq.Message, _tx: Any) -> None:
        if msg.id == "BAD":
            raise ValueError("poison")

    port = free_port()
    started: list[Worker] = []
    thread = threading.Thread(
        target=run_worker,
        args=(handle,),
        kwargs={
            "broker_url": f"embedded://{queue_path}",
            "queue": "q",
            "store_url": f"sqlite:///{tmp_path / 'dedup.db'}",
            "max_attempts": 1,
            "install_signal_handlers": False,
            "on_start": started.append,
            "metrics_port": port,
        },
    )
    thread.start()
    try:
        deadline = time.monotonic() + 30
        samples: dict[str, float] = {}
        while time.monotonic() < deadline:
            try:
                samples = _scrape(port)
            except OSError:
                samples = {}
            if (
                samples.get("idemq_dead_lettered_total:") == 1
                and samples.get("idemq_messages_total:processed") == N_PROCESSED
                and samples.get("idemq_messages_total:duplicate") == M_DUPLICATES
                # The store's gauges are read at most every 15 s: a scrape made before the
                # worker finished keeps the older count until then.
                and samples.get("idemq_records:processed") == N_PROCESSED
            ):
                break
            time.sleep(0.1)
    finally:
        if started:
            started[0].stop()
        thread.join(30)
    assert samples.get("idemq_messages_total:processed") == N_PROCESSED, samples
    assert samples["idemq_messages_total:duplicate"] == M_DUPLICATES
    assert samples["idemq_messages_total:error"] == 1
    assert samples["idemq_dead_lettered_total:"] == 1
    assert samples["idemq_records:processed"] == N_PROCESSED
    assert samples["idemq_store_up:"] == 1
    assert not thread.is_alive()
    with pytest.raises(OSError):  # the metrics server stopped with the worker
        _scrape(port)
