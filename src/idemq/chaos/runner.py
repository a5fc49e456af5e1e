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

The run's sections, each a module readable alone: configuration (:mod:`~idemq.chaos.plan`),
what it sets up and cleans up (:mod:`~idemq.chaos.stage`), production
(:mod:`~idemq.chaos.production`), supervision (:mod:`~idemq.chaos.supervision`) and the verdict
(:mod:`~idemq.chaos.verdict`), which comes from the business ledger, not from what the workers
said.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from idemq.chaos import stage
from idemq.chaos.faults import open_producer
from idemq.chaos.orders import make_engine
from idemq.chaos.plan import ChaosConfig, RunPlan
from idemq.chaos.production import Production
from idemq.chaos.result import ChaosResult, Progress
from idemq.chaos.supervision import supervise
from idemq.chaos.verdict import count_deliveries, judge_ledger

__all__ = ["ChaosConfig", "run_chaos"]

_QUIET_LOGGERS = ("idemq.publish", "idemq.brokers", "nats", "aio_pika", "aiormq")


def run_chaos(
    config: ChaosConfig, on_progress: Callable[[Progress], None] | None = None
) -> ChaosResult:
    """Run the scenario and return the counts and verdict (see module doc)."""
    plan = RunPlan.build(config)
    with _quiet_loggers():
        return _run(plan, on_progress or (lambda _: None))


def _run(plan: RunPlan, on_progress: Callable[[Progress], None]) -> ChaosResult:
    c = plan.config
    upstreams = plan.check()
    result = plan.new_result()
    engine = make_engine(plan.ledger_url)
    try:
        stage.set_up(plan, engine)
        producer, proxy = open_producer(
            c.broker_url, confirm_timeout_s=c.confirm_timeout_s, partitions=c.partition_rate > 0
        )
        try:
            stage.declare_queues(plan, producer)
            production = Production(plan, producer, proxy)
            with plan.tuned_broker(), plan.spread(upstreams) as host_cut:
                observed = supervise(plan, production, host_cut, on_progress)
                count_deliveries(result, plan, observed, production, host_cut)
            judge_ledger(result, plan, engine, production)
        finally:
            if not c.keep:
                stage.delete_queues(plan, producer)
            producer.close()
            if proxy is not None:
                proxy.close()
    finally:
        if not c.keep:
            stage.tear_down(plan, engine)
        engine.dispose()
    return result


@contextlib.contextmanager
def _quiet_loggers() -> Iterator[None]:
    """ "Unconfirmed, retrying" and "connection reset" are the point of cause 1, not news."""
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
