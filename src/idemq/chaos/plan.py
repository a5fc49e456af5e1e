"""A chaos run's configuration: what the caller asked for (:class:`ChaosConfig`) and what follows
from it before anything runs (:class:`RunPlan`: names, paths, the broker's capabilities, the
refusals and the notes).

Every name a run creates carries one random run id, so runs on shared servers never meet and
the cleanup removes exactly what this run made.
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from idemq.brokers.base import mask_url
from idemq.chaos import faults, rabbitmq_timeout
from idemq.chaos.faults import Capabilities, capabilities
from idemq.chaos.host_cut import HostCut, check_urls
from idemq.chaos.hosts import MAX_HOSTS
from idemq.chaos.orders import OrderTables
from idemq.chaos.result import ChaosResult
from idemq.errors import ConfigurationError
from idemq.outbox.outbox import Outbox

__all__ = ["OPENING_BALANCE", "ChaosConfig", "RunPlan"]

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


@dataclass(frozen=True)
class RunPlan:
    """What one run of ``config`` uses: its names, its files, the broker's capabilities."""

    config: ChaosConfig
    prefix: str  # of every table and key the run creates
    queue: str
    ship_queue: str  # "" on one hop
    outbox_table: str
    directory: Path
    events_dir: Path  # where the worker processes write what they saw
    redis_store: bool
    ledger_url: str  # the order tables: the store's database, or SQLite beside a Redis store
    caps: Capabilities
    tables: OrderTables

    @classmethod
    def build(cls, config: ChaosConfig) -> RunPlan:
        """The plan of one run, its event directory made (a temporary one by default)."""
        run_id = uuid.uuid4().hex[:8]
        prefix = f"chaos_{run_id}_"
        directory = config.directory or Path(tempfile.mkdtemp(prefix="idemq-chaos-"))
        events_dir = directory / f"events-{run_id}"
        events_dir.mkdir(parents=True, exist_ok=True)
        redis_store = config.store_url.startswith(("redis://", "rediss://"))
        ledger_url = (
            (config.ledger_url or f"sqlite:///{directory / f'ledger-{run_id}.db'}")
            if redis_store
            else config.store_url
        )
        return cls(
            config=config,
            prefix=prefix,
            queue=f"chaos_{run_id}",
            ship_queue=f"chaos_{run_id}_ship" if config.two_hop else "",
            outbox_table=f"{prefix}outbox",
            directory=directory,
            events_dir=events_dir,
            redis_store=redis_store,
            ledger_url=ledger_url,
            caps=capabilities(config.broker_url, tune_broker=config.tune_broker),
            tables=OrderTables.build(prefix),
        )

    @property
    def ship_workers(self) -> int:
        return self.config.ship_workers or self.config.workers

    def check(self) -> list[tuple[str, int]]:
        """Refuse a run that cannot happen; a ``--hosts`` run's servers ([] on one host)."""
        c = self.config
        if c.two_hop and self.redis_store:
            raise ConfigurationError(
                "idemq chaos --two-hop needs a SQL store: the outbox is a table in its database"
            )
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

    def new_result(self) -> ChaosResult:
        """The result the run fills in, with what the reader must know before its counts."""
        c = self.config
        result = ChaosResult(
            broker=mask_url(c.broker_url),
            store=mask_url(c.store_url),
            guard=c.guard,
            messages=c.messages,
            workers=c.workers,
            two_hop=c.two_hop,
            hosts=c.hosts,
        )
        result.notes.extend(self._notes())
        return result

    def _notes(self) -> Iterator[str]:
        c, caps = self.config, self.caps
        if c.partition_rate > 0 and not caps.partition:
            yield f"partition not injected: {caps.partition_note}"
        if c.slow_rate > 0 and not caps.slow:
            yield f"slow consumers not injected: {caps.slow_note}"
        kafka = faults.scheme_of(c.broker_url) == "kafka"
        if c.slow_rate > 0 and caps.slow and kafka and c.workers < 2:
            yield "Kafka slow handlers need 2+ workers: nobody else can take the partition"
        if self.redis_store and c.guard:
            yield "Redis store: lease mode; the order state machine guards the ledger effect"
        if self._tunes_broker:
            yield (
                "changed RabbitMQ's server-wide consumer_timeout to"
                f" {faults.RABBITMQ_CONSUMER_TIMEOUT_MS} ms (channel tick"
                f" {faults.RABBITMQ_TICK_MS} ms) for this run's channels; restored afterwards"
            )

    @property
    def _tunes_broker(self) -> bool:
        return self.caps.tuned and self.config.slow_rate > 0

    def tuned_broker(self) -> contextlib.AbstractContextManager[None]:
        """RabbitMQ's short consumer_timeout for the run, when slow handlers need it."""
        if not self._tunes_broker:
            return contextlib.nullcontext()
        return rabbitmq_timeout.consumer_timeout(
            self.config.broker_url,
            timeout_ms=faults.RABBITMQ_CONSUMER_TIMEOUT_MS,
            tick_ms=faults.RABBITMQ_TICK_MS,
            hold_s=self.config.timeout_s + 60,  # the node restores by itself if we die
        )

    def spread(
        self, upstreams: list[tuple[str, int]]
    ) -> contextlib.AbstractContextManager[HostCut | None]:
        """The hosts of a ``--hosts`` run (removed afterwards); None on one host."""
        if not self.config.hosts:
            return contextlib.nullcontext()
        return HostCut.open(self.config.hosts, upstreams, self.config.cut_s, self.directory)

    @contextlib.contextmanager
    def outbox(self) -> Iterator[Outbox]:
        """The second hop's outbox, on a store of its own closed afterwards."""
        from idemq.stores.sql.store import SqlStore  # noqa: PLC0415

        store = SqlStore(self.config.store_url)
        try:
            yield Outbox(store, table=self.outbox_table)
        finally:
            store.close()
