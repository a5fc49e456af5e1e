"""The handlers the several-hosts test runs in its worker processes (source text, written to the
run's directory), and the launcher of a lease-mode worker.

Each handler appends ``<epoch s> <event> <message id>`` to its host's trace file (the namespaces
share the file system, not the network), so the test can tell which messages a host held when
it was cut off.
"""

from __future__ import annotations

HANDLERS = """
import os
import time

import sqlalchemy as sa

import idemq
from idemq.guard.context import current_message

HOST = int(os.environ["IDQ_HOST"])
SLOW_S = float(os.environ["IDQ_SLOW_S"])
LEDGER = os.environ["IDQ_LEDGER"]
TRACE = os.environ["IDQ_TRACE"]


def trace(event, message_id):
    with open(TRACE, "a") as sink:
        sink.write(f"{time.time():.3f} {event} {message_id}\\n")


def transactional(msg, tx):
    # The effect rides in the dedup transaction: it commits with the dedup row or not at all.
    trace("start", msg.id)
    time.sleep(SLOW_S)
    tx.execute(
        sa.text(f"INSERT INTO {LEDGER} (message_id, host) VALUES (:m, :h)"),
        {"m": msg.id, "h": HOST},
    )
    trace("effect", msg.id)


# Made at import (nothing connects yet): the lease handler's business database, and the
# state machine that lets a message be paid once, whoever pays it and however late.
BUSINESS = sa.create_engine(os.environ["IDQ_BUSINESS_URL"])
MACHINE = idemq.StateMachine(
    os.environ["IDQ_ORDERS"], "id", "state",
    states=["NEW", "PAID"], transitions={"pay": ("NEW", "PAID")},
)


def lease(msg, tx):
    # Lease mode: the effect is made outside the dedup store's transaction (tx is None), so a
    # holder whose lease ran out may still make it late; the state machine absorbs that.
    trace("start", msg.id)
    if current_message().wait_lease_lost(SLOW_S):
        raise RuntimeError("lease lost before the effect: leave it to the new holder")
    with BUSINESS.begin() as conn:
        result = MACHINE.apply(conn, msg.id, "pay")
        table = LEDGER if result is idemq.TransitionResult.APPLIED else LEDGER + "_absorbed"
        conn.execute(
            sa.text(f"INSERT INTO {table} (message_id, host) VALUES (:m, :h)"),
            {"m": msg.id, "h": HOST},
        )
    trace("effect" if result is idemq.TransitionResult.APPLIED else "absorbed", msg.id)
"""

# `idemq worker` runs SQL stores in transactional mode; lease mode on PostgreSQL is the same
# Worker with a lease-mode guard, wired here the way idemq.worker.run wires the CLI's.
LEASE_WORKER = """
import logging
import signal
import sys

import idemq
from idemq.brokers import open_broker
from idemq.worker.loop import Worker
from idemq.worker.run import load_handler, worker_observer

handler, broker_url, queue, store_url, lease_s, concurrency = sys.argv[1:]
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
store = idemq.SqlStore(store_url)
store.create_schema()
guard = idemq.Idempotency(store, consumer=queue, mode="lease", lease_s=float(lease_s))
guard.observer, _ = worker_observer(store)
worker = Worker(
    load_handler(handler), open_broker(broker_url), guard, queue,
    concurrency=int(concurrency), observer=guard.observer,
)
signal.signal(signal.SIGTERM, lambda signum, frame: worker.stop())
try:
    print(worker.run(), flush=True)
finally:
    store.close()
"""
