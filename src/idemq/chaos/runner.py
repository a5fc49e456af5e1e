"""``idemq chaos``: the order service under the three causes of duplicates, then the verdict.

Timeline of one run::

    seed N orders ─► producer thread ──(FaultProxy: half-partitions → confirm timeouts → retries)──►
    broker ──► W worker processes (slow handlers; SIGKILLs, some between commit and ack) ─► ledger
    supervisor: restarts the dead, kills one every kill_every_s, until every order is applied;
    drain: no kills, wait until no delivery for a quiet period; stop; read the ledger.

``two_hop`` adds a second hop, the chain idemq's outbox makes exactly once end to end::

    pay worker: debit + outbox.add(ship) in one transaction ─► outbox table ─► relay processes
    (OutboxRelay, publish with confirms, delete after) ─► ship queue ─► ship workers ─► shipments

The supervisor kills relays as it kills workers (an armed relay dies after a confirmed publish,
before the delete: the row is published again). The verdict adds: every paid order shipped
exactly once, no shipment for an order never paid, nothing left in the outbox.

``hosts`` spreads the processes over network namespaces and cuts one of them off the network
while it holds messages (:mod:`idemq.chaos.host_cut`).

The verdict comes from the business ledger, not from what the workers said: ``applied`` counts
distinct message ids with a debit, ``double_applied`` those with more than one.
"""

from __future__ import annotations

import contextlib
import logging
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import sqlalchemy as sa

from idemq.brokers.base import mask_url
from idemq.brokers.publish import Publisher
from idemq.chaos import faults, rabbitmq_timeout
from idemq.chaos.events import CAUSES, Tally
from idemq.chaos.faults import (
    ProducerBroker,
    capabilities,
    open_producer,
    redelivery_s,
    slow_s,
    worker_url,
)
from idemq.chaos.host_cut import CUT_HOST, HostCut, check_urls
from idemq.chaos.hosts import MAX_HOSTS
from idemq.chaos.invariants import check_invariants, check_shipments
from idemq.chaos.orders import OrderTables, create_schema, drop_schema, make_engine, seed
from idemq.chaos.proxy import FaultProxy
from idemq.chaos.result import ChaosResult, Progress
from idemq.chaos.supervisor import Supervisor
from idemq.chaos.worker import WorkerSpec
from idemq.errors import BrokerUnavailableError, ConfigurationError
from idemq.outbox.admin import outbox_stats
from idemq.outbox.outbox import Outbox

__all__ = ["ChaosConfig", "run_chaos"]

_QUIET_LOGGERS = ("idemq.publish", "idemq.brokers", "nats", "aio_pika", "aiormq")
# No order fails for lack of funds (the seed debit does not check): only duplicates move money.
OPENING_BALANCE = 10**12


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run. Rates are per message (partition) or per first delivery (slow)."""

    broker_url: str
    store_url: str
    messages: int = 500
    workers: int = 3
    kill_every_s: float = 2.0  # 0 = no kills
    slow_rate: float = 0.02
    partition_rate: float = 0.01
    guard: bool = True
    directory: Path | None = None  # event files (default: a temporary directory)
    ledger_url: str | None = None  # order tables for a Redis store (default: SQLite in directory)
    timeout_s: float = 300.0  # the run stops by itself after this, whatever happened
    confirm_timeout_s: float = 0.5
    lease_s: float = 5.0
    seed: int = 7
    keep: bool = False  # keep tables, keys and queue afterwards (for inspection)
    accounts: int = 10
    rate_per_s: float = 0.0  # producer pace (0 = as fast as confirms come): steady traffic
    opening_balance_cents: int = OPENING_BALANCE  # per account; never short, so only duplicates
    # May the run change a server-wide broker setting for its duration (RabbitMQ before 3.12:
    # consumer_timeout, the only way to get cause 2 there)? Restored afterwards.
    tune_broker: bool = False
    # Second hop: pay adds a ship message to the outbox in its transaction, relays publish it,
    # ship workers consume it (a SQL store: the outbox lives in its database).
    two_hop: bool = False
    ship_workers: int | None = None  # second hop's workers (default: ``workers``)
    relays: int = 2
    # Several hosts (network namespaces, root only): the processes spread over ``hosts`` of
    # them, host 1 cut off the network for ``cut_s`` while it holds messages (0: one host).
    hosts: int = 0
    cut_s: float = 12.0


def run_chaos(
    config: ChaosConfig, on_progress: Callable[[Progress], None] | None = None
) -> ChaosResult:
    """Run the scenario and return the counts and verdict (see module doc)."""
    return _Run(config, on_progress or (lambda _: None)).run()


class _Run:
    def __init__(self, config: ChaosConfig, on_progress: Callable[[Progress], None]) -> None:
        self.config = config
        self.on_progress = on_progress
        self.rng = random.Random(config.seed)
        run_id = uuid.uuid4().hex[:8]
        self.prefix = f"chaos_{run_id}_"
        self.queue = f"chaos_{run_id}"
        self.ship_queue = f"chaos_{run_id}_ship" if config.two_hop else ""
        self.outbox_table = f"{self.prefix}outbox"
        self.directory = config.directory or Path(tempfile.mkdtemp(prefix="idemq-chaos-"))
        self.events_dir = self.directory / f"events-{run_id}"
        self.events_dir.mkdir(parents=True, exist_ok=True)
        self.redis_store = config.store_url.startswith(("redis://", "rediss://"))
        self.ledger_url = (
            (config.ledger_url or f"sqlite:///{self.directory / f'ledger-{run_id}.db'}")
            if self.redis_store
            else config.store_url
        )
        self.caps = capabilities(config.broker_url, tune_broker=config.tune_broker)
        self.tables = OrderTables.build(self.prefix)
        self.result = ChaosResult(
            broker=mask_url(config.broker_url),
            store=mask_url(config.store_url),
            guard=config.guard,
            messages=config.messages,
            workers=config.workers,
            two_hop=config.two_hop,
            hosts=config.hosts,
        )
        self.produced = 0
        self.partitions = 0
        self.publish_attempts = 0
        self.produced_orders: list[str] = []
        self.stop_producing = threading.Event()

    # -- phases ------------------------------------------------------------------------------

    def run(self) -> ChaosResult:
        # "Unconfirmed, retrying" and "connection reset" are the point of cause 1, not news.
        loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
        try:
            return self._run()
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)

    def _run(self) -> ChaosResult:
        if self.config.two_hop and self.redis_store:
            raise ConfigurationError(
                "idemq chaos --two-hop needs a SQL store: the outbox is a table in its database"
            )
        upstreams = self._check_hosts()
        self._notes()
        engine = make_engine(self.ledger_url)
        try:
            self._prepare(engine)
            producer, proxy = open_producer(
                self.config.broker_url,
                confirm_timeout_s=self.config.confirm_timeout_s,
                partitions=self.config.partition_rate > 0,
            )
            try:
                faults.declare_queue(
                    producer, self.config.broker_url, self.queue, consumers=self.config.workers
                )
                if self.ship_queue:
                    faults.declare_queue(
                        producer, self.config.broker_url, self.ship_queue, consumers=self._ships
                    )
                with self._tuned_broker(), self._spread(upstreams) as host_cut:
                    self._supervise(producer, proxy, host_cut)
                self._verdict(engine)
            finally:
                if not self.config.keep:
                    producer.delete_queue(self.queue)
                    if self.ship_queue:
                        producer.delete_queue(self.ship_queue)
                producer.close()
                if proxy is not None:
                    proxy.close()
        finally:
            if not self.config.keep:
                self._cleanup(engine)
            engine.dispose()
        return self.result

    def _tuned_broker(self) -> contextlib.AbstractContextManager[None]:
        """RabbitMQ's short consumer_timeout for the run, when slow handlers need it."""
        if not (self.caps.tuned and self.config.slow_rate > 0):
            return contextlib.nullcontext()
        self.result.notes.append(
            "changed RabbitMQ's server-wide consumer_timeout to"
            f" {faults.RABBITMQ_CONSUMER_TIMEOUT_MS} ms (channel tick {faults.RABBITMQ_TICK_MS}"
            " ms) for this run's channels; restored afterwards"
        )
        return rabbitmq_timeout.consumer_timeout(
            self.config.broker_url,
            timeout_ms=faults.RABBITMQ_CONSUMER_TIMEOUT_MS,
            tick_ms=faults.RABBITMQ_TICK_MS,
            hold_s=self.config.timeout_s + 60,  # the node restores by itself if we die
        )

    def _check_hosts(self) -> list[tuple[str, int]]:
        """A ``--hosts`` run's servers (refused where it cannot run); [] on one host."""
        c = self.config
        if not c.hosts:
            return []
        if not 2 <= c.hosts <= MAX_HOSTS:
            raise ConfigurationError(f"--hosts must be 2 to {MAX_HOSTS}, got {c.hosts}")
        if c.workers < c.hosts:
            raise ConfigurationError(
                f"--hosts {c.hosts} needs at least as many --workers, got {c.workers}"
            )
        if c.cut_s <= 0:
            raise ConfigurationError(f"--cut-s must be positive, got {c.cut_s}")
        return check_urls(c.broker_url, c.store_url, self.ledger_url)

    def _spread(
        self, upstreams: list[tuple[str, int]]
    ) -> contextlib.AbstractContextManager[HostCut | None]:
        """The hosts of a ``--hosts`` run (removed afterwards); None on one host."""
        if not self.config.hosts:
            return contextlib.nullcontext()
        return HostCut.open(self.config.hosts, upstreams, self.config.cut_s, self.directory)

    def _notes(self) -> None:
        c, caps = self.config, self.caps
        if c.partition_rate > 0 and not caps.partition:
            self.result.notes.append(f"partition not injected: {caps.partition_note}")
        if c.slow_rate > 0 and not caps.slow:
            self.result.notes.append(f"slow consumers not injected: {caps.slow_note}")
        kafka = faults.scheme_of(c.broker_url) == "kafka"
        if c.slow_rate > 0 and caps.slow and kafka and c.workers < 2:
            self.result.notes.append(
                "Kafka slow handlers need 2+ workers: nobody else can take the partition"
            )
        if self.redis_store and c.guard:
            self.result.notes.append(
                "Redis store: lease mode; the order state machine guards the ledger effect"
            )

    def _prepare(self, engine: sa.Engine) -> None:
        create_schema(engine, self.tables)
        c = self.config
        accounts = {f"acct-{n}": c.opening_balance_cents for n in range(c.accounts)}
        orders = [
            (f"order-{n:07d}", f"acct-{n % c.accounts}", self.rng.randint(100, 50_000))
            for n in range(self.config.messages)
        ]
        with engine.begin() as conn:
            seed(conn, self.tables, accounts, orders)
        if self.config.guard and not self.redis_store:
            from idemq.stores.sql.store import SqlStore  # noqa: PLC0415

            store = SqlStore(self.config.store_url, table=f"{self.prefix}dedup")
            store.create_schema()
            store.close()
        if self.ship_queue:
            with self._outbox() as outbox:
                outbox.create_schema()

    @contextlib.contextmanager
    def _outbox(self) -> Iterator[Outbox]:
        from idemq.stores.sql.store import SqlStore  # noqa: PLC0415

        store = SqlStore(self.config.store_url)
        try:
            yield Outbox(store, table=self.outbox_table)
        finally:
            store.close()

    @property
    def _ships(self) -> int:
        return self.config.ship_workers or self.config.workers

    def _specs(self) -> list[WorkerSpec]:
        """One spec per process: the pay workers, then (two hops) ship workers and relays."""
        pay = self._spec()
        if not self.ship_queue:
            return [pay] * self.config.workers
        pay = replace(pay, ship_queue=self.ship_queue, outbox_table=self.outbox_table)
        ship = replace(pay, role="ship", queue=self.ship_queue, consumer=f"{self.prefix}shipments")
        relay = replace(pay, role="relay", slow_rate=0.0)
        return [pay] * self.config.workers + [ship] * self._ships + [relay] * self.config.relays

    def _spec(self) -> WorkerSpec:
        c = self.config
        return WorkerSpec(
            broker_url=worker_url(c.broker_url),
            queue=self.queue,
            store_url=c.store_url,
            ledger_url=self.ledger_url,
            prefix=self.prefix,
            consumer=f"{self.prefix}orders",
            events_dir=str(self.events_dir),
            guard=c.guard,
            slow_rate=c.slow_rate if self.caps.slow else 0.0,
            slow_s=slow_s(c.broker_url, self.caps),
            slow_before_claim=self.ledger_url.startswith("sqlite"),
            lease_s=c.lease_s,
            seed=c.seed,
        )

    def _supervise(
        self, producer: ProducerBroker, proxy: FaultProxy | None, host_cut: HostCut | None
    ) -> None:
        c = self.config
        tally = Tally(self.events_dir)
        killed = 0

        def on_death(pid: int, at_s: float, by_us: bool) -> None:
            nonlocal killed
            if by_us:
                killed += 1
                tally.kill(pid, at_s)

        supervisor = Supervisor(
            self._specs(),
            c.kill_every_s,
            on_death,
            rng=random.Random(c.seed + 1),
            min_uptime_s=self.caps.min_uptime_s,
            arm_timeout_s=self.caps.arm_timeout_s,
            spawn=None if host_cut is None else host_cut.spawn,
        )
        started_s, started_wall = time.monotonic(), time.time()
        thread = threading.Thread(target=self._produce, args=(producer, proxy), daemon=True)
        supervisor.start()
        thread.start()
        reader = sa.create_engine(self.ledger_url)  # plain reads: no BEGIN IMMEDIATE needed
        applied, shipped, last_count, quiet_since, next_read = 0, 0, -1, time.monotonic(), 0.0
        quiet_s = min(2 * redelivery_s(worker_url(c.broker_url)) + self.caps.handover_s + 1, 15.0)
        try:
            while True:
                now = time.monotonic()
                if now - started_s > c.timeout_s:
                    self.result.timed_out = True
                    self.result.notes.append(f"stopped after the {c.timeout_s:.0f}s time limit")
                    break
                supervisor.tick()
                tally.poll()
                if now >= next_read:
                    applied = self._applied(reader)
                    shipped = self._shipped(reader) if self.ship_queue else self.produced
                    next_read = now + 0.5
                cut_over = host_cut is None or host_cut.tick(tally, applied, c.messages)
                done = cut_over and not thread.is_alive() and min(applied, shipped) >= self.produced
                if done:
                    supervisor.killing = False  # drain: let late duplicates arrive, no new kills
                if len(tally.deliveries) != last_count:
                    last_count, quiet_since = len(tally.deliveries), now
                elif done and now - quiet_since >= quiet_s:
                    break
                self.on_progress(
                    Progress(
                        self.produced, c.messages, applied, last_count, killed, now - started_s
                    )
                )
                time.sleep(0.1)
        finally:
            self.stop_producing.set()
            supervisor.stop()
            thread.join(30)
            reader.dispose()
        tally.poll()
        if host_cut is not None:
            self._host_cut(tally, host_cut)  # first: the cut is a cause the count attributes
        self._count(tally, supervisor, killed, started_wall, time.monotonic() - started_s)

    def _host_cut(self, tally: Tally, host_cut: HostCut) -> None:
        """What the cut did: which messages the cut host held, which another host then ran."""
        r = self.result
        if host_cut.cut_from_s is None:
            r.notes.append("no host was cut off: the run ended before the cut was due")
            return
        from_s, to_s = host_cut.cut_from_s, host_cut.cut_to_s or time.time()
        tally.cut(host_cut.cut_pids(), from_s, to_s)
        held = {d.message_id for d in tally.deliveries if tally.cut_off(d) and d.start_s < from_s}
        retaken = {
            d.message_id
            for d in tally.deliveries
            if d.message_id in held and d.pid not in tally.cut_pids and d.start_s > from_s
        }
        r.cut_held, r.cut_retaken = len(held), len(retaken)
        r.injected["host_cuts"] = 1
        r.notes.append(
            f"host {CUT_HOST} of {self.config.hosts} was cut off the network for"
            f" {to_s - from_s:.1f}s; messages it held then: {len(held)}, of which another host"
            f" ran {len(retaken)}"
        )

    def _produce(self, producer: ProducerBroker, proxy: FaultProxy | None) -> None:
        c = self.config
        publisher = Publisher(producer, prefix="ORDER", attempts=4, retry_delay_s=0.2)
        rng = random.Random(c.seed + 2)
        started_s = time.monotonic()
        for n in range(c.messages):
            if c.rate_per_s > 0:
                self.stop_producing.wait(max(started_s + n / c.rate_per_s - time.monotonic(), 0))
            order_id = f"order-{n:07d}"
            body = f'{{"event": "pay", "order_id": "{order_id}"}}'.encode()
            message_id = publisher.ids.next_id()
            if self.caps.partition and rng.random() < c.partition_rate:
                self.partitions += 1
                if proxy is not None:
                    proxy.partition(2 * c.confirm_timeout_s)
                else:
                    producer.lose_next_confirm()
            while not self.stop_producing.is_set():
                try:
                    publisher.publish(self.queue, body, message_id=message_id, business_id=order_id)
                    break
                except BrokerUnavailableError:
                    continue  # keep the same id: the message must get through, once or more
            else:
                return
            self.produced += 1
            self.produced_orders.append(order_id)
        self.publish_attempts = sum(producer.attempts.values())

    # -- verdict -----------------------------------------------------------------------------

    def _applied(self, reader: sa.Engine) -> int:
        ledger = self.tables.ledger
        with reader.connect() as conn:
            count = conn.execute(sa.select(sa.func.count(sa.distinct(ledger.c.message_id))))
            return int(count.scalar_one())

    def _shipped(self, reader: sa.Engine) -> int:
        shipments = self.tables.shipments
        with reader.connect() as conn:
            count = conn.execute(sa.select(sa.func.count(sa.distinct(shipments.c.order_id))))
            return int(count.scalar_one())

    def _count(
        self, tally: Tally, supervisor: Supervisor, killed: int, started: float, seconds: float
    ) -> None:
        r = self.result
        causes = tally.attribute()
        r.delivered = len(tally.deliveries)
        r.causes = {cause: causes[cause] for cause in CAUSES}
        r.duplicates_delivered = sum(r.causes.values())
        r.retries = causes["retry"]
        r.verdicts = dict(tally.verdicts())
        r.duplicates_suppressed = r.verdicts.get("duplicate", 0)
        suppressed = tally.suppressed_by_cause()
        r.suppressed_causes = {cause: suppressed[cause] for cause in CAUSES}
        r.crashes = killed
        r.injected.update(
            {
                "partitions": self.partitions,
                "producer_retries": self.publish_attempts - self.produced,
                "kills": supervisor.kills,
                "kills_after_commit_before_ack": tally.self_kills,
                "relay_kills_after_publish_before_delete": tally.relay_self_kills,
                "slow_handlers": sum(1 for d in tally.deliveries if d.slow),
            }
        )
        r.produced = self.produced
        r.seconds = round(seconds, 2)
        r.bucket_s = max(1.0, round(seconds / 60))
        r.timeline = tally.timeline(started, r.bucket_s)

    def _verdict(self, engine: sa.Engine) -> None:
        r, ledger = self.result, self.tables.ledger
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(ledger.c.message_id, sa.func.count()).group_by(ledger.c.message_id)
            ).all()
        effects = {str(message_id): int(n) for message_id, n in rows}
        r.applied = len(effects)
        missing = max(r.produced - r.applied, 0)
        # A run cut short by its time limit may still have every missing message queued: those
        # are unfinished, and `lost` stays what it says (gone from a run that finished).
        r.unfinished, r.lost = (missing, 0) if r.timed_out else (0, missing)
        r.double_applied = sum(1 for n in effects.values() if n > 1)
        r.extra_effects = sum(n - 1 for n in effects.values())
        report = check_invariants(engine, self.tables)
        kinds: dict[str, int] = {}
        for violation in report.violations:
            kinds[violation.kind] = kinds.get(violation.kind, 0) + 1
        r.invariant_violations = kinds
        r.debited_cents = report.debited_cents
        with engine.connect() as conn:
            owed = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(self.tables.orders.c.amount), 0)).where(
                    self.tables.orders.c.order_id.in_(self.produced_orders)
                )
            ).scalar_one()
        r.owed_cents = int(owed)
        if self.ship_queue:
            self._hop_two_verdict(engine)
        r.throughput_per_s = round(r.applied / r.seconds, 1) if r.seconds else 0.0

    def _hop_two_verdict(self, engine: sa.Engine) -> None:
        r = self.result
        shipments = check_shipments(engine, self.tables)
        r.shipped = shipments.shipped
        r.double_shipped = shipments.double_shipped
        r.shipped_unpaid = shipments.shipped_unpaid
        # Like `lost`: a run cut short may still have the missing shipments on their way.
        r.unshipped = 0 if r.timed_out else shipments.unshipped
        if r.timed_out:
            r.unfinished += shipments.unshipped
        r.extra_shipments = shipments.shipments - shipments.shipped
        with self._outbox() as outbox:
            r.outbox_pending = outbox_stats(outbox).pending

    def _cleanup(self, engine: sa.Engine) -> None:
        if self.ship_queue:
            with self._outbox() as outbox:
                outbox.drop_schema()
        drop_schema(engine, self.tables)
        if self.config.guard and not self.redis_store:
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.prefix}dedup"))
        if self.redis_store:
            import redis  # noqa: PLC0415

            client = redis.Redis.from_url(self.config.store_url)
            try:
                keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
                if keys:
                    client.delete(*keys)
            finally:
                client.close()
