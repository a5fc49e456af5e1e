"""A chaos run's verdict: what the deliveries were (which cause made each duplicate) and what
the business ledger says: every order applied once, shipped once on two hops, nothing lost.

The verdict comes from the ledger, not from what the workers said: ``applied`` counts distinct
message ids with a debit, ``double_applied`` those with more than one.
"""

from __future__ import annotations

import time
from collections import Counter

import sqlalchemy as sa

from idemq.chaos.events import CAUSES
from idemq.chaos.host_cut import CUT_HOST, HostCut
from idemq.chaos.invariants import check_invariants, check_shipments
from idemq.chaos.plan import RunPlan
from idemq.chaos.production import Production
from idemq.chaos.result import ChaosResult
from idemq.chaos.supervision import Observed
from idemq.outbox.admin import outbox_stats

__all__ = ["count_deliveries", "judge_ledger"]


def count_deliveries(
    result: ChaosResult,
    plan: RunPlan,
    observed: Observed,
    production: Production,
    host_cut: HostCut | None,
) -> None:
    """The delivery counts, each duplicate's cause and what was injected, into ``result``."""
    r, tally = result, observed.tally
    if observed.timed_out:
        r.timed_out = True
        r.notes.append(f"stopped after the {plan.config.timeout_s:.0f}s time limit")
    if host_cut is not None:
        _attribute_host_cut(r, plan, observed, host_cut)  # first: the cut is a cause counted below
    causes = tally.attribute()
    r.delivered = len(tally.deliveries)
    r.causes = {cause: causes[cause] for cause in CAUSES}
    r.duplicates_delivered = sum(r.causes.values())
    r.retries = causes["retry"]
    r.verdicts = dict(tally.verdicts())
    r.duplicates_suppressed = r.verdicts.get("duplicate", 0)
    suppressed = tally.suppressed_by_cause()
    r.suppressed_causes = {cause: suppressed[cause] for cause in CAUSES}
    r.crashes = observed.killed
    r.injected.update(
        {
            "partitions": production.partitions,
            "producer_retries": production.publish_attempts - production.produced,
            "kills": observed.kills,
            "kills_after_commit_before_ack": tally.self_kills,
            "relay_kills_after_publish_before_delete": tally.relay_self_kills,
            "slow_handlers": sum(1 for d in tally.deliveries if d.slow),
        }
    )
    r.produced = production.produced
    r.seconds = round(observed.seconds, 2)
    r.bucket_s = max(1.0, round(observed.seconds / 60))
    r.timeline = tally.timeline(observed.started_wall, r.bucket_s)


def _attribute_host_cut(
    r: ChaosResult, plan: RunPlan, observed: Observed, host_cut: HostCut
) -> None:
    """What the cut did: which messages the cut host held, which another host then ran."""
    if host_cut.cut_from_s is None:
        r.notes.append("no host was cut off: the run ended before the cut was due")
        return
    tally = observed.tally
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
        f"host {CUT_HOST} of {plan.config.hosts} was cut off the network for"
        f" {to_s - from_s:.1f}s; messages it held then: {len(held)}, of which another host"
        f" ran {len(retaken)}"
    )


def judge_ledger(
    result: ChaosResult, plan: RunPlan, engine: sa.Engine, production: Production
) -> None:
    """What the ledger holds: applied, lost or unfinished, applied twice, balances, shipments."""
    r, ledger = result, plan.tables.ledger
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
    report = check_invariants(engine, plan.tables)
    r.invariant_violations = dict(Counter(violation.kind for violation in report.violations))
    r.debited_cents = report.debited_cents
    orders = plan.tables.orders
    with engine.connect() as conn:
        owed = conn.execute(
            sa.select(sa.func.coalesce(sa.func.sum(orders.c.amount), 0)).where(
                orders.c.order_id.in_(production.produced_orders)
            )
        ).scalar_one()
    r.owed_cents = int(owed)
    if plan.ship_queue:
        _judge_second_hop(r, plan, engine)
    r.throughput_per_s = round(r.applied / r.seconds, 1) if r.seconds else 0.0


def _judge_second_hop(r: ChaosResult, plan: RunPlan, engine: sa.Engine) -> None:
    shipments = check_shipments(engine, plan.tables)
    r.shipped = shipments.shipped
    r.double_shipped = shipments.double_shipped
    r.shipped_unpaid = shipments.shipped_unpaid
    # Like `lost`: a run cut short may still have the missing shipments on their way.
    r.unshipped = 0 if r.timed_out else shipments.unshipped
    if r.timed_out:
        r.unfinished += shipments.unshipped
    r.extra_shipments = shipments.shipments - shipments.shipped
    with plan.outbox() as outbox:
        r.outbox_pending = outbox_stats(outbox).pending
