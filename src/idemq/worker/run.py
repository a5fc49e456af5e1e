"""``idemq worker``'s wiring: load the handler, open the guard and broker, observers, signals."""

from __future__ import annotations

import importlib
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import idemq
from idemq.brokers import open_broker
from idemq.brokers.base import mask_url
from idemq.brokers.settlement import RetryPolicy
from idemq.errors import ConfigurationError
from idemq.guard.probes import CompositeObserver, Observer
from idemq.observe.logs import LoggingObserver
from idemq.stores import store_label
from idemq.worker.batch import BatchSettings
from idemq.worker.loop import Handler, Worker
from idemq.worker.settle import WorkerStats

__all__ = ["load_handler", "open_guard", "run_worker", "worker_observer"]

log = logging.getLogger("idemq.worker")


def worker_observer(store: object, metrics_port: int | None = None) -> tuple[Observer, Any]:
    """What ``idemq worker`` watches its guard with: structured logs, plus Prometheus metrics
    (guard counters and store gauges, on a registry of its own) served on ``metrics_port``.

    Returns the observer and a zero-argument callable that stops the metrics server.
    """
    logs = LoggingObserver()
    if metrics_port is None:
        return logs, lambda: None
    # Imported on use: prometheus-client is the optional extra "metrics".
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from idemq.observe.prometheus import PrometheusObserver, StoreCollector, serve_metrics  # noqa: PLC0415

    registry = CollectorRegistry()
    label = store_label(store)
    registry.register(StoreCollector(store, store_label=label))
    server = serve_metrics(metrics_port, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return CompositeObserver(logs, PrometheusObserver(registry, store_label=label)), stop


def open_guard(store_url: str, consumer: str) -> idemq.Idempotency:
    """An :class:`idemq.Idempotency` over the store at ``store_url`` (SQLAlchemy or redis URL).

    SQL stores run in transactional mode (schema created if missing); Redis in lease mode.
    """
    if store_url.startswith(("redis://", "rediss://", "unix://")):
        redis_store = idemq.RedisStore(store_url)
        return idemq.Idempotency(redis_store, consumer=consumer, mode="lease")
    sql_store = idemq.SqlStore(store_url)
    sql_store.create_schema()
    return idemq.Idempotency(sql_store, consumer=consumer)


def load_handler(spec: str) -> Handler:
    """Import ``"package.module:function"`` (attribute paths like ``mod:obj.method`` work too)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigurationError(f"handler must look like MODULE:HANDLER, got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            target = getattr(target, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load handler {spec!r}: {exc}") from exc
    if not callable(target):
        raise ConfigurationError(f"handler {spec!r} is not callable")
    handler: Handler = target
    return handler


def run_worker(
    handler: str | Handler,
    *,
    broker_url: str,
    queue: str,
    store_url: str,
    consumer: str | None = None,
    concurrency: int = 1,
    prefetch: int | None = None,
    max_attempts: int = 5,
    install_signal_handlers: bool = True,
    on_start: Callable[[Worker], None] | None = None,
    metrics_port: int | None = None,
    batch_size: int | None = None,
    batch_wait_ms: int = 50,
    relay: bool = False,
    outbox_table: str = "idemq_outbox",
) -> WorkerStats:
    """What ``idemq worker MODULE:HANDLER --broker URL --queue NAME --store URL`` runs.

    ``consumer`` scopes the dedup keys (default: the queue name). Returns when SIGTERM/SIGINT
    arrives (or ``worker.stop()`` is called from ``on_start``'s thread), after in-flight messages
    are settled. ``metrics_port``: serve Prometheus metrics there
    (``idemq.observe.prometheus``); outcomes are logged on ``idemq.guard`` with structured
    fields either way. ``batch_size``: guard up
    to that many deliveries per transaction (``idemq.worker.batch``), waiting ``batch_wait_ms`` at
    most for a batch to fill. ``relay``: also run an :class:`~idemq.OutboxRelay` thread for
    the outbox ``outbox_table`` in the store's database, publishing to the same broker.
    """
    batch = None if batch_size is None else BatchSettings(batch_size, batch_wait_ms)
    fn = load_handler(handler) if isinstance(handler, str) else handler
    guard = open_guard(store_url, consumer or queue)
    stop_metrics: Callable[[], None] = lambda: None  # noqa: E731
    try:
        guard.observer, stop_metrics = worker_observer(guard.store, metrics_port)
        broker = open_broker(broker_url)
    except BaseException:
        stop_metrics()
        guard.store.close()
        raise
    worker = Worker(
        fn,
        broker,
        guard,
        queue,
        concurrency=concurrency,
        prefetch=prefetch,
        policy=RetryPolicy(max_attempts=max_attempts),
        observer=guard.observer,
        description=(
            f"broker={mask_url(broker_url)} queue={queue} store={mask_url(store_url)}"
            f" concurrency={concurrency}"
            + ("" if batch is None else f" batch_size={batch.size} batch_wait_ms={batch.wait_ms}")
        ),
        batch=batch,
    )
    stop_relay = threading.Event()
    relay_thread = (
        _start_relay(guard.store, outbox_table, broker_url, stop_relay) if relay else None
    )
    try:
        if on_start is not None:
            on_start(worker)
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            return _run_with_signals(worker)
        return worker.run()
    finally:
        stop_relay.set()
        if relay_thread is not None:
            relay_thread.join()
        stop_metrics()
        guard.store.close()


def _start_relay(
    store: object, table: str, broker_url: str, stop: threading.Event
) -> threading.Thread:
    """The relay of ``store``'s outbox on its own thread (and its own broker connection)."""
    if not isinstance(store, idemq.SqlStore):
        raise ConfigurationError("--relay needs a SQL store: the outbox lives in its database")
    relay = idemq.OutboxRelay(idemq.Outbox(store, table=table), broker_url)

    def run() -> None:
        try:
            relay.run(stop)
        finally:
            relay.close()

    thread = threading.Thread(target=run, name="idemq-relay", daemon=True)
    thread.start()
    return thread


def _run_with_signals(worker: Worker) -> WorkerStats:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: finishing in-flight messages, then exiting", signum)
        worker.stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return worker.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
