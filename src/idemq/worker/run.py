"""``idemq worker``'s wiring: load the handler, open the guard and broker, observers, signals."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import idemq
from idemq._outage import STARTUP_GIVE_UP_AFTER_S, Outage
from idemq.brokers import open_broker
from idemq.brokers.base import Broker, mask_url
from idemq.brokers.settlement import RetryPolicy
from idemq.drivers.extras import missing_extra
from idemq.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    StoreUnavailableError,
)
from idemq.guard.probes import CompositeObserver, Observer
from idemq.observe.logs import LoggingObserver
from idemq.stores import is_redis_url, store_label
from idemq.stores.admin import open_store_for
from idemq.worker.batch import BatchSettings
from idemq.worker.loop import Handler, Worker
from idemq.worker.settle import WorkerStats

__all__ = ["check_handler", "load_handler", "open_guard", "run_worker", "worker_observer"]

log = logging.getLogger("idemq.worker")

DEFAULT_LEASE_S = 30.0  # the guard's own default


def worker_observer(
    store: object,
    metrics_port: int | None = None,
    *,
    relay: idemq.OutboxRelay | None = None,
    log_error_text: bool = False,
) -> tuple[Observer, Any]:
    """What ``idemq worker`` watches its guard with: structured logs, plus Prometheus metrics
    (guard counters and store gauges, on a registry of its own) served on ``metrics_port``;
    with a ``relay``, its outbox's gauges and the relay's counters too.

    Returns the observer and a zero-argument callable that stops the metrics server.
    """
    logs = LoggingObserver(include_error_text=log_error_text)
    if metrics_port is None:
        return logs, lambda: None
    # Imported on use: prometheus-client is the optional extra "metrics".
    try:
        from prometheus_client import CollectorRegistry  # noqa: PLC0415
    except ImportError as exc:
        raise missing_extra("--metrics-port", "metrics", exc) from exc

    from idemq.observe.prometheus import (  # noqa: PLC0415
        OutboxCollector,
        PrometheusObserver,
        StoreCollector,
        serve_metrics,
    )

    registry = CollectorRegistry()
    label = store_label(store)
    registry.register(StoreCollector(store, store_label=label))
    if relay is not None:
        registry.register(OutboxCollector(relay.outbox, relays=[relay]))
    server = serve_metrics(metrics_port, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return CompositeObserver(logs, PrometheusObserver(registry, store_label=label)), stop


def open_guard(
    store_url: str,
    consumer: str,
    *,
    table: str | None = None,
    prefix: str | None = None,
    mode: str | None = None,
    lease_s: float | None = None,
    expires_after_s: float | None = None,
) -> idemq.Idempotency:
    """An :class:`idemq.Idempotency` over the store at ``store_url`` (SQLAlchemy or redis URL),
    on a non-default SQL ``table`` or Redis key ``prefix`` if given.

    ``mode``: ``"transactional"`` (the default on SQL stores: the handler's writes share the
    dedup row's transaction) or ``"lease"`` (the default and only mode on Redis: the handler
    gets ``tx=None`` and its claim is a lease of ``lease_s`` seconds, renewed while it runs, for
    an effect outside the store's database). A Redis store in transactional mode, or
    ``lease_s`` outside lease mode, is a :class:`~idemq.ConfigurationError`.
    ``expires_after_s``: a record completed longer ago counts as absent, so its message runs
    again (the SQL store's ``expires_after_s``, the Redis store's ``ttl_s``).
    SQL stores get their schema created if missing.
    """
    redis = is_redis_url(store_url)
    if mode == "transactional" and redis:
        # Refused before connecting: the store's own message would come after a connection
        # attempt, and a typo'd flag should not wait on a network timeout to be reported.
        raise ConfigurationError(
            "--mode transactional needs a SQL store: a Redis store cannot share a transaction"
            " with the handler's writes; use --mode lease"
        )
    leased = mode == "lease" or (mode is None and redis)
    if lease_s is not None and not leased:
        raise ConfigurationError(
            "--lease-s is for lease mode: a transactional claim holds no lease (add --mode lease)"
        )
    options: dict[str, Any] = {}
    if expires_after_s is not None:
        options["ttl_s" if redis else "expires_after_s"] = expires_after_s
    store = open_store_for(store_url, table=table, prefix=prefix, **options)
    try:
        if redis:
            _refused_setup_stops(store, consumer)
        else:
            store.create_schema()
        return idemq.Idempotency(
            store,
            consumer=consumer,
            mode="lease" if leased else "transactional",
            lease_s=DEFAULT_LEASE_S if lease_s is None else lease_s,
        )
    except BaseException:
        store.close()
        raise


def _refused_setup_stops(store: idemq.RedisStore, consumer: str) -> None:
    """One read at start-up, so a setup Redis refuses (an untrusted TLS certificate) stops the
    worker with :class:`~idemq.StoreConfigurationError`, as ``create_schema`` does for SQL;
    once running, the loop would only hold each message back, for ever. An outage is left to
    the loop, which waits it out."""
    with contextlib.suppress(StoreUnavailableError):
        store.get("idemq-start-up-check", consumer)


def load_handler(spec: str) -> Handler:
    """Import ``"package.module:function"`` (attribute paths like ``mod:obj.method`` work too)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigurationError(f"handler must look like MODULE:HANDLER, got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot load handler {spec!r}: {exc}") from exc
    except Exception as exc:
        # The module was found but raised while importing (a SyntaxError, a NameError, a failed
        # connection at import time): a mistake in the handler's code like any other, so one
        # line naming the module and the error (exit 2), not an unexpected traceback.
        raise ConfigurationError(
            f"cannot import handler module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        for attr in attr_path.split("."):
            target = getattr(target, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load handler {spec!r}: {exc}") from exc
    if not callable(target):
        raise ConfigurationError(f"handler {spec!r} is not callable")
    check_handler(target, spec)
    handler: Handler = target
    return handler


def check_handler(handler: Callable[..., Any], name: str) -> None:
    """Refuse, before any message is taken, a handler the worker cannot call as
    ``handler(msg, tx)`` (every message would fail and be dead-lettered), or a coroutine
    function (the worker would store an un-awaited coroutine as the result)."""
    expected = "the worker calls handle(msg, tx): msg an idemq.Message, tx the dedup transaction"
    if inspect.iscoroutinefunction(handler):
        raise ConfigurationError(f"handler {name!r} is async; {expected}, in a thread")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # a builtin or extension without one: nothing to check
        return
    try:
        signature.bind(None, None)
    except TypeError as exc:
        raise ConfigurationError(
            f"handler {name!r} has the signature {signature}; {expected} ({exc})"
        ) from exc


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
    declare: str | None = None,
    dead_letter: str | None = None,
    table: str | None = None,
    prefix: str | None = None,
    give_up_after_s: float | None = None,
    log_error_text: bool = False,
    mode: str | None = None,
    lease_s: float | None = None,
    expires_after_s: float | None = None,
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
    ``declare``/``dead_letter``: see :func:`idemq.brokers.open_broker` (what exists is used as it
    is either way).
    ``table`` / ``prefix``: the dedup table (SQL) or key prefix (Redis), if not the default.
    The handler is checked before anything is opened: :func:`check_handler`.
    ``give_up_after_s``: how long a broker outage is retried before
    :class:`~idemq.BrokerUnavailableError` is raised (``None``: 30 s while connecting at
    start-up, never once running); the relay thread waits out its broker and store outages by
    the same rule, and when it gives up the worker stops and its error is raised. A refused
    login or vhost raises :class:`~idemq.ConfigurationError` at once.
    ``log_error_text``: log a failing handler's exception text and traceback (by default its
    class and where it was raised only: the text may quote the payload).
    ``mode``, ``lease_s``, ``expires_after_s``: see :func:`open_guard`.
    """
    batch = None if batch_size is None else BatchSettings(batch_size, batch_wait_ms)
    if isinstance(handler, str):
        fn = load_handler(handler)
    else:
        check_handler(handler, getattr(handler, "__qualname__", repr(handler)))
        fn = handler
    guard = open_guard(
        store_url,
        consumer or queue,
        table=table,
        prefix=prefix,
        mode=mode,
        lease_s=lease_s,
        expires_after_s=expires_after_s,
    )
    stop_metrics: Callable[[], None] = lambda: None  # noqa: E731
    outbox_relay: idemq.OutboxRelay | None = None
    try:
        outbox_relay = _open_relay(guard.store, outbox_table, broker_url) if relay else None
        guard.observer, stop_metrics = worker_observer(
            guard.store, metrics_port, relay=outbox_relay, log_error_text=log_error_text
        )
        broker = _open_broker(broker_url, give_up_after_s, declare=declare, dead_letter=dead_letter)
    except BaseException:
        stop_metrics()
        if outbox_relay is not None:
            outbox_relay.close()
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
            f" concurrency={concurrency} mode={guard.mode.value}"
            + ("" if batch is None else f" batch_size={batch.size} batch_wait_ms={batch.wait_ms}")
        ),
        batch=batch,
        give_up_after_s=give_up_after_s,
        startup_give_up_after_s=_startup_budget_s(give_up_after_s),
        log_error_text=log_error_text,
    )
    relay_thread = None if outbox_relay is None else _RelayThread(outbox_relay, worker)
    try:
        if on_start is not None:
            on_start(worker)
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            stats = _run_with_signals(worker)
        else:
            stats = worker.run()
    finally:
        if relay_thread is not None:
            relay_thread.stop()
        stop_metrics()
        guard.store.close()
    if relay_thread is not None and relay_thread.error is not None:
        raise relay_thread.error
    return stats


def _startup_budget_s(give_up_after_s: float | None) -> float:
    return STARTUP_GIVE_UP_AFTER_S if give_up_after_s is None else give_up_after_s


def _open_broker(url: str, give_up_after_s: float | None, **options: str | None) -> Broker:
    """``open_broker(url, **options)``, retried through an outage for ``give_up_after_s``
    (default 30 s)."""
    outage = Outage(_startup_budget_s(give_up_after_s), threading.Event())
    while True:
        left_s = outage.attempting()
        try:
            return open_broker(url, connect_timeout_s=_attempt_bound_s(left_s), **options)
        except BrokerUnavailableError as exc:
            outage.failed(exc, f"connecting to {mask_url(url)}")


def _attempt_bound_s(left_s: float | None) -> float | None:
    """How long one connect attempt may wait: what is left of the outage budget, at least a
    moment (an attempt with no time at all could never succeed), None without a budget."""
    return None if left_s is None else max(left_s, 0.5)


def _open_relay(store: object, table: str, broker_url: str) -> idemq.OutboxRelay:
    """The relay of ``store``'s outbox ``table`` (with its own broker connection)."""
    if not isinstance(store, idemq.SqlStore):
        raise ConfigurationError("--relay needs a SQL store: the outbox lives in its database")
    return idemq.OutboxRelay(idemq.Outbox(store, table=table), broker_url)


class _RelayThread:
    """``relay`` running beside ``worker`` under the worker's outage policy: one process, one
    behaviour. When the relay gives up on an outage it stops the worker (gracefully: in-flight
    messages still settle) and keeps the error for :func:`run_worker` to raise; when the worker
    stops, for whatever reason, so does the relay."""

    def __init__(self, relay: idemq.OutboxRelay, worker: Worker) -> None:
        self.relay = relay
        self.worker = worker
        self.stopping = threading.Event()
        self.outage = Outage(worker.give_up_after_s, self.stopping)
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="idemq-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.relay.run(self.stopping, self.outage)
        except Exception as exc:  # raised again by run_worker, in the main thread
            self.error = exc
            self.worker.stop()
        finally:
            self.relay.close()

    def stop(self) -> None:
        """Stop the relay and wait until it has closed."""
        self.stopping.set()
        self._thread.join()


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
