"""A chaos run's supervision: start the worker processes and the producer, kill and restart
workers (cause 3) until every order is applied, then drain (no kills) until no delivery has come
for a quiet period, and stop everything.

It only watches: what the deliveries and the ledger mean is :mod:`~idemq.chaos.verdict`'s.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import sqlalchemy as sa

from idemq.chaos.events import Tally
from idemq.chaos.faults import redelivery_s, slow_s, worker_url
from idemq.chaos.host_cut import HostCut
from idemq.chaos.plan import RunPlan
from idemq.chaos.production import Production
from idemq.chaos.result import Progress
from idemq.chaos.supervisor import Supervisor
from idemq.chaos.worker import WorkerSpec

__all__ = ["Observed", "supervise"]

_READ_EVERY_S = 0.5  # the ledger, for the progress and the end of the run
_TICK_S = 0.1


@dataclass(frozen=True)
class Observed:
    """What the supervision saw, for the verdict."""

    tally: Tally  # every delivery the workers reported, polled one last time
    killed: int  # workers the run killed (a worker's own armed kill included)
    kills: int  # kills the supervisor made on its timer
    started_wall: float  # epoch seconds, for the timeline
    seconds: float
    timed_out: bool


def supervise(
    plan: RunPlan,
    production: Production,
    host_cut: HostCut | None,
    on_progress: Callable[[Progress], None],
) -> Observed:
    """Run the workers and the producer until every order is in the ledger and quiet."""
    c = plan.config
    tally = Tally(plan.events_dir)
    killed = 0

    def on_death(pid: int, at_s: float, by_us: bool) -> None:
        nonlocal killed
        if by_us:
            killed += 1
            tally.kill(pid, at_s)

    supervisor = Supervisor(
        _specs(plan),
        c.kill_every_s,
        on_death,
        rng=random.Random(c.seed + 1),
        min_uptime_s=plan.caps.min_uptime_s,
        arm_timeout_s=plan.caps.arm_timeout_s,
        spawn=None if host_cut is None else host_cut.spawn,
    )
    started_s, started_wall = time.monotonic(), time.time()
    supervisor.start()
    production.start()
    reader = sa.create_engine(plan.ledger_url)  # plain reads: no BEGIN IMMEDIATE needed
    applied, shipped, last_count, quiet_since, next_read = 0, 0, -1, time.monotonic(), 0.0
    quiet_s = min(2 * redelivery_s(worker_url(c.broker_url)) + plan.caps.handover_s + 1, 15.0)
    timed_out = False
    try:
        while True:
            now = time.monotonic()
            if now - started_s > c.timeout_s:
                timed_out = True
                break
            supervisor.tick()
            tally.poll()
            if now >= next_read:
                applied = _distinct(reader, plan.tables.ledger.c.message_id)
                shipped = (
                    _distinct(reader, plan.tables.shipments.c.order_id)
                    if plan.ship_queue
                    else production.produced
                )
                next_read = now + _READ_EVERY_S
            cut_over = host_cut is None or host_cut.tick(tally, applied, c.messages)
            done = (
                cut_over
                and not production.is_alive()
                and min(applied, shipped) >= production.produced
            )
            if done:
                supervisor.killing = False  # drain: let late duplicates arrive, no new kills
            if len(tally.deliveries) != last_count:
                last_count, quiet_since = len(tally.deliveries), now
            elif done and now - quiet_since >= quiet_s:
                break
            on_progress(
                Progress(
                    production.produced, c.messages, applied, last_count, killed, now - started_s
                )
            )
            time.sleep(_TICK_S)
    finally:
        production.stop()
        supervisor.stop()
        production.join(timeout_s=30)
        reader.dispose()
    tally.poll()
    return Observed(
        tally=tally,
        killed=killed,
        kills=supervisor.kills,
        started_wall=started_wall,
        seconds=time.monotonic() - started_s,
        timed_out=timed_out,
    )


def _specs(plan: RunPlan) -> list[WorkerSpec]:
    """One spec per process: the pay workers, then (two hops) ship workers and relays."""
    c = plan.config
    pay = WorkerSpec(
        broker_url=worker_url(c.broker_url),
        queue=plan.queue,
        store_url=c.store_url,
        ledger_url=plan.ledger_url,
        prefix=plan.prefix,
        consumer=f"{plan.prefix}orders",
        events_dir=str(plan.events_dir),
        guard=c.guard,
        slow_rate=c.slow_rate if plan.caps.slow else 0.0,
        slow_s=slow_s(c.broker_url, plan.caps),
        slow_before_claim=plan.ledger_url.startswith("sqlite"),
        lease_s=c.lease_s,
        seed=c.seed,
    )
    if not plan.ship_queue:
        return [pay] * c.workers
    pay = replace(pay, ship_queue=plan.ship_queue, outbox_table=plan.outbox_table)
    ship = replace(pay, role="ship", queue=plan.ship_queue, consumer=f"{plan.prefix}shipments")
    relay = replace(pay, role="relay", slow_rate=0.0)
    return [pay] * c.workers + [ship] * plan.ship_workers + [relay] * c.relays


def _distinct(reader: sa.Engine, column: sa.Column[str]) -> int:
    """How many distinct values ``column`` holds (orders applied, orders shipped)."""
    with reader.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count(sa.distinct(column)))).scalar_one())
