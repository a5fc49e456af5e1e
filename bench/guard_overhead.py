"""The guard's own CPU per message: ``Idempotency.process`` over stores that answer at once.

A store that does no I/O leaves only what the guard adds to every message — its policy, its flow
steps, the handler's context, the lease keeper's register/unregister, the observer — and that is
what this prints, against the same store primitives called by hand in a loop (the floor: a
consumer that claims and completes itself). Both stores keep nothing between messages, so the
figure does not drift with the run's length:

* ``transactional``: ``transaction()`` yields a token, ``claim_in`` wins, ``confirm_in`` returns;
* ``lease``: ``claim`` wins, ``complete`` returns (and ``renew``, never due here, says held).

``+ worker`` adds what ``idemq worker`` does around the guard for each delivery: the adapter's
decoding of it (``Received.build``), the verdict, the settlement (an ack that is done at once)
and its bookkeeping.

Each contender runs in turns, interleaved, best of ``--repeat``; CPU is ``time.process_time``.
The per-message I/O this leaves out (a claim and a commit on PostgreSQL, 100 to 300 µs of
client CPU; ``bench/sql_guard.py``, ``bench/redis_store.py``) is the stores' own.

    python bench/guard_overhead.py [--n 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

from idemq import Idempotency, Message
from idemq.brokers.base import MESSAGE_ID_HEADER, Broker, Delivery, Received
from idemq.errors import StoreError
from idemq.guard.core import Policy
from idemq.observe.logs import LoggingObserver
from idemq.stores.base import Claim, ClaimRequest, Key
from idemq.stores.memory import MemoryStore
from idemq.worker.loop import Worker


class InstantStore(MemoryStore):
    """Every primitive answered at once, nothing kept: each claim wins. The admin methods are
    the memory store's (the guard never calls them per message)."""

    def transaction(self, connection: Any = None) -> AbstractContextManager[Any]:
        return nullcontext(self)

    def claim_in(self, tx: Any, request: ClaimRequest) -> Claim:
        return Claim.won()

    def claim_many_in(self, tx: Any, requests: Sequence[ClaimRequest]) -> list[Claim]:
        return [Claim.won() for _ in requests]

    def confirm_in(
        self, tx: Any, key: Key, owner: str, result: str, *, deferred: bool = False
    ) -> None:
        return None

    def confirm_many_in(self, tx: Any, requests: Sequence[ClaimRequest]) -> None:
        return None

    def release_in(self, tx: Any, key: Key, owner: str) -> None:
        return None

    def translate_handler_error(self, tx: Any, error: BaseException) -> StoreError | None:
        return None

    def begin_savepoint(self, tx: Any) -> Any:
        return None

    def end_savepoint(self, savepoint: Any, *, commit: bool) -> None:
        return None

    def claim(self, request: ClaimRequest) -> Claim:
        return Claim.won()

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        return None

    def release(self, key: Key, owner: str) -> None:
        return None

    def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> bool:
        return True


class InstantDelivery(Delivery):
    """A delivery whose settlement is done at once (the broker's own I/O left out)."""

    def _ack(self) -> None:
        return None

    def _retry(self, delay_s: float, counted: bool) -> None:
        return None

    def _dead_letter(self, reason: str) -> None:
        return None


def handler(tx: Any) -> None:
    return None


def worker_handler(message: Message, tx: Any) -> None:
    return None


def by_hand(store: InstantStore, policy: Policy, transactional: bool) -> Callable[..., None]:
    """The floor: the same request and primitives, called in a plain loop."""

    def one(message_id: str, payload: bytes) -> None:
        request = policy.request(message_id, None, payload)
        if transactional:
            with store.transaction() as tx:
                if store.claim_in(tx, request).acquired:
                    handler(tx)
                    store.confirm_in(tx, request.key, request.owner, "null")
        elif store.claim(request).acquired:
            handler(None)
            store.complete(request.key, request.owner, "null", policy.clock())

    return one


def through_guard(guard: Idempotency) -> Callable[..., None]:
    def one(message_id: str, payload: bytes) -> None:
        guard.process(message_id, handler, payload=payload)

    return one


def through_worker(guard: Idempotency) -> Callable[..., None]:
    """What ``idemq worker`` adds around the guard: the adapter's decoding of a delivery, the
    verdict, the settlement and its bookkeeping (the worker's own observer, as it runs)."""
    worker = Worker(worker_handler, cast(Broker, None), guard, "overhead")

    def one(message_id: str, payload: bytes) -> None:
        headers = {MESSAGE_ID_HEADER: message_id}
        worker.handle(InstantDelivery(Received.build("overhead", payload, headers)))

    return one


def cpu_us(one: Callable[[str, bytes], None], n: int, tag: str) -> float:
    payload = b'{"order_id": "o-1"}'
    ids = [f"{tag}-{i}" for i in range(n)]
    started = time.process_time()
    for message_id in ids:
        one(message_id, payload)
    return (time.process_time() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("idemq.guard").setLevel(logging.INFO)  # processed (DEBUG) not written
    contenders: dict[str, Callable[[str, bytes], None]] = {}
    for mode in ("transactional", "lease"):
        store = InstantStore()
        guard = Idempotency(store, mode=mode, consumer="overhead")
        watched = Idempotency(store, mode=mode, consumer="overhead", observer=LoggingObserver())
        contenders[f"{mode:13} by hand"] = by_hand(store, guard.policy, mode == "transactional")
        contenders[f"{mode:13} guard"] = through_guard(guard)
        contenders[f"{mode:13} guard + LoggingObserver"] = through_guard(watched)
        contenders[f"{mode:13} guard + LoggingObserver + worker"] = through_worker(watched)
    best: dict[str, float] = {}
    for rep in range(args.repeat):
        names = list(contenders) if rep % 2 == 0 else list(contenders)[::-1]
        for name in names:
            us = cpu_us(contenders[name], args.n, f"r{rep}-{name}")
            best[name] = min(best.get(name, us), us)
    print(f"{args.n} messages per turn, best of {args.repeat}, CPU µs per message")
    for name, us in best.items():
        floor = best[name.split(" guard")[0] + " by hand"] if " guard" in name else us
        extra = f" (+{us - floor:.1f} µs over by hand)" if " guard" in name else ""
        print(f"  {name:48} {us:6.1f} µs{extra}")


if __name__ == "__main__":
    main()
