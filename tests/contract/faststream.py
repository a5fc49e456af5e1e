"""One live contract for ``IdempotencyMiddleware``, subclassed once per FastStream broker.

A subclass says how to build its broker, subscribe a handler and publish with a message id;
everything else — duplicates, retries, poison messages, the shared transaction — is checked here,
against the real broker and a real database, on rows of a business table that has **no** unique
constraint (so a double apply would show as two rows).
"""

from __future__ import annotations

import abc
import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from faststream import BaseMiddleware, Context

from idemq import AsyncIdempotency, AsyncSqlStore
from idemq.brokers.base import DEAD_LETTER_REASON_HEADER
from idemq.brokers.settlement import RetryPolicy
from idemq.integrations.faststream import TX_CONTEXT_KEY, IdempotencyMiddleware, current_tx
from idemq.message import MESSAGE_ID_HEADER
from tests.conftest import require_service, unique

PG_URL = os.environ.get("IDEMQ_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
FAST = RetryPolicy(backoff_base_s=0.05, backoff_max_s=0.2, in_progress_delay_s=0.3)
WAIT_S = 30.0

Apply = Callable[[Any, Any], Awaitable[Any]]
TX = Context(TX_CONTEXT_KEY)  # FastStream's injection marker, shared (ruff B008)


def as_handler(apply: Apply) -> Callable[..., Awaitable[Any]]:
    """A FastStream handler that gets the dedup transaction the documented way."""

    async def handler(body: Any, tx: Any = TX) -> Any:
        assert tx is current_tx(), "Context key and contextvar name the same transaction"
        return await apply(body, tx)

    return handler


class Deliveries:
    """Counts deliveries the subscriber finished (settled or not), as the outermost middleware."""

    def __init__(self) -> None:
        self.done = 0

    def __call__(self, msg: Any, /, *, context: Any) -> BaseMiddleware:
        outer = self

        class _Count(BaseMiddleware):
            async def consume_scope(self, call_next: Any, msg: Any) -> Any:
                try:
                    return await call_next(msg)
                finally:
                    outer.done += 1

        return _Count(msg, context=context)


@dataclass
class Db:
    """The dedup store and the business table, in one database."""

    store: AsyncSqlStore
    table: str
    failures_left: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)

    async def apply(self, body: Any, tx: Any) -> Any:
        """The business effect: one row per call, written through the dedup transaction."""
        order_id = body["order_id"]
        self.calls[order_id] += 1
        await tx.execute(
            sa.text(f"INSERT INTO {self.table} (order_id) VALUES (:o)"), {"o": order_id}
        )
        if self.failures_left[order_id] > 0:
            # Raised after the write: the row must roll back with the dedup row.
            self.failures_left[order_id] -= 1
            raise RuntimeError(f"transient failure for {order_id}")
        return {"paid": order_id}

    async def rows(self) -> Counter[str]:
        async with self.store.engine.connect() as conn:
            result = await conn.execute(sa.text(f"SELECT order_id FROM {self.table}"))
            return Counter(r[0] for r in result)


async def wait_until(
    cond: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_S
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await cond():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


class FastStreamContract(abc.ABC):
    """The behaviour every broker must show behind ``IdempotencyMiddleware``."""

    N = 5
    db_backend = "sqlite"  # or "postgres"
    can_publish_without_id = True
    retries_in_place = False  # True where nack cannot redeliver (MQTT): retries loop in place

    # -- what a broker subclass provides ---------------------------------------------------

    @abc.abstractmethod
    def make_broker(self, middlewares: list[Any]) -> Any: ...

    @abc.abstractmethod
    def subscribe(self, broker: Any, name: str, apply: Apply) -> None: ...

    @abc.abstractmethod
    async def publish(self, broker: Any, name: str, body: Any, message_id: str | None) -> None:
        """Publish ``body``; ``message_id`` goes where this broker carries ids (None: nowhere)."""

    async def cleanup(self, name: str) -> None:  # noqa: B027 - optional hook
        """Delete what the test created on the broker."""

    # -- fixtures ---------------------------------------------------------------------------

    @pytest.fixture
    async def db(self, tmp_path: Path) -> AsyncIterator[Db]:
        if self.db_backend == "postgres":
            require_service("postgres")
            url = PG_URL
        else:
            url = f"sqlite:///{tmp_path / 'idemq.db'}"
        store = AsyncSqlStore(url, table=unique("mi"))
        await store.create_schema()
        db = Db(store, unique("orders"))
        async with store.engine.begin() as conn:
            await conn.execute(sa.text(f"CREATE TABLE {db.table} (order_id VARCHAR(64))"))
        yield db
        async with store.engine.begin() as conn:
            await conn.execute(sa.text(f"DROP TABLE {db.table}"))
        await store.drop_schema()
        await store.close()

    @pytest.fixture
    def name(self) -> str:
        return unique("idemq")

    async def run(
        self,
        db: Db,
        name: str,
        body: Callable[[Any, Deliveries], Awaitable[None]],
        *,
        guard: AsyncIdempotency | None = None,
        apply: Apply | None = None,
        **middleware: Any,
    ) -> None:
        """Start a broker with the middleware, run ``body(broker, deliveries)``, clean up."""
        guard = guard or AsyncIdempotency(db.store, consumer=name)
        middleware.setdefault("retry_policy", FAST)
        deliveries = Deliveries()
        broker = self.make_broker([deliveries, IdempotencyMiddleware(guard, **middleware)])
        self.subscribe(broker, name, apply or db.apply)
        try:
            await broker.start()
            await body(broker, deliveries)
        finally:
            await broker.stop()
            await self.cleanup(name)

    # -- the contract -----------------------------------------------------------------------

    async def test_duplicates_apply_once(self, db: Db, name: str) -> None:
        orders = [unique("order") for _ in range(self.N)]

        async def body(broker: Any, deliveries: Deliveries) -> None:
            for order in orders * 2:  # every message published twice with the same id
                await self.publish(broker, name, {"order_id": order}, f"msg-{order}")
            await wait_until(
                lambda: _true(deliveries.done >= 2 * self.N), "all deliveries to finish"
            )
            await asyncio.sleep(0.3)  # let a wrongly requeued copy show up

        await self.run(db, name, body)
        assert await db.rows() == Counter(dict.fromkeys(orders, 1))
        assert sum(db.calls.values()) == self.N, "a duplicate ran the handler"
        for order in orders:
            record = await db.store.get(f"msg-{order}", consumer=name)
            assert record is not None
            assert record.result == '{"paid":"' + order + '"}'

    async def test_failing_handler_is_retried_and_applied_once(self, db: Db, name: str) -> None:
        flaky, steady = unique("flaky"), unique("steady")
        db.failures_left[flaky] = 2

        async def body(broker: Any, deliveries: Deliveries) -> None:
            await self.publish(broker, name, {"order_id": flaky}, f"msg-{flaky}")
            await self.publish(broker, name, {"order_id": steady}, f"msg-{steady}")
            await wait_until(
                lambda: _has(db, {flaky: 1, steady: 1}), "the flaky message to succeed"
            )
            await asyncio.sleep(0.3)

        await self.run(db, name, body)
        assert db.calls[flaky] == 3, "failed twice, then succeeded once"
        assert await db.rows() == Counter({flaky: 1, steady: 1}), "failed attempts rolled back"

    async def test_handler_failing_every_time_is_dead_lettered(self, db: Db, name: str) -> None:
        doomed, after = unique("doomed"), unique("after")
        db.failures_left[doomed] = 1000
        dead: list[tuple[str, dict[str, str]]] = []

        async def on_dead_letter(msg: Any, reason: str, headers: dict[str, str]) -> None:
            dead.append((reason, headers))

        async def body(broker: Any, deliveries: Deliveries) -> None:
            await self.publish(broker, name, {"order_id": doomed}, f"msg-{doomed}")
            await self.publish(broker, name, {"order_id": after}, f"msg-{after}")
            await wait_until(lambda: _true(len(dead) == 1 and db.calls[after] == 1), "dead letter")
            await asyncio.sleep(0.5)  # a dead message must not come back

        await self.run(db, name, body, max_attempts=3, on_dead_letter=on_dead_letter)
        assert db.calls[doomed] == 3
        assert await db.rows() == Counter({after: 1})
        reason, headers = dead[0]
        assert reason.startswith("handler_error: gave up after 3 attempts")
        assert headers[DEAD_LETTER_REASON_HEADER] == reason

    async def test_poison_messages_are_dead_lettered_and_consumption_goes_on(
        self, db: Db, name: str
    ) -> None:
        good = unique("good")
        dead: list[str] = []

        async def on_dead_letter(msg: Any, reason: str, headers: dict[str, str]) -> None:
            dead.append(reason)

        async def body(broker: Any, deliveries: Deliveries) -> None:
            await self.publish(broker, name, b"\xffnot json", "poison-1")  # key() needs JSON
            await self.publish(broker, name, {"no_order_id": 1}, "poison-2")  # key() finds none
            await self.publish(broker, name, {"order_id": good}, "ignored")
            await wait_until(lambda: _true(len(dead) == 2 and db.calls[good] == 1), "poison")
            await asyncio.sleep(0.5)

        await self.run(db, name, body, key=lambda b: b["order_id"], on_dead_letter=on_dead_letter)
        assert all(r.startswith("invalid_message:") for r in dead), dead
        assert await db.rows() == Counter({good: 1})
        assert await db.store.get(good, consumer=name) is not None, "keyed by key(body)"

    async def test_an_id_reused_with_another_body_is_dead_lettered_not_replayed(
        self, db: Db, name: str
    ) -> None:
        # The second message shares the first one's id but not its body: answering it with the
        # first one's result would drop its effect silently. It is a producer bug: dead letter.
        first, second, after = unique("first"), unique("second"), unique("after")
        dead: list[str] = []

        async def on_dead_letter(msg: Any, reason: str, headers: dict[str, str]) -> None:
            dead.append(reason)

        async def body(broker: Any, deliveries: Deliveries) -> None:
            await self.publish(broker, name, {"order_id": first}, f"msg-{first}")
            await wait_until(lambda: _true(db.calls[first] == 1), "the first message")
            await self.publish(broker, name, {"order_id": second}, f"msg-{first}")
            await self.publish(broker, name, {"order_id": after}, f"msg-{after}")
            await wait_until(lambda: _true(len(dead) == 1 and db.calls[after] == 1), "dead letter")
            await asyncio.sleep(0.3)

        await self.run(db, name, body, on_dead_letter=on_dead_letter)
        assert dead[0].startswith("payload_mismatch"), dead
        assert await db.rows() == Counter({first: 1, after: 1})
        assert db.calls[second] == 0

    async def test_message_without_id_is_dead_lettered(self, db: Db, name: str) -> None:
        if not self.can_publish_without_id:
            pytest.skip("this broker's client gives every message an id")
        good = unique("good")
        dead: list[str] = []

        async def on_dead_letter(msg: Any, reason: str, headers: dict[str, str]) -> None:
            dead.append(reason)

        async def body(broker: Any, deliveries: Deliveries) -> None:
            await self.publish(broker, name, {"order_id": unique("anon")}, None)
            await self.publish(broker, name, {"order_id": good}, f"msg-{good}")
            await wait_until(lambda: _true(len(dead) == 1 and db.calls[good] == 1), "no-id")

        await self.run(db, name, body, on_dead_letter=on_dead_letter)
        assert "no message id" in dead[0]
        assert await db.rows() == Counter({good: 1})

    async def test_lease_mode_in_progress_waits_for_the_holder(self, db: Db, name: str) -> None:
        """Lease mode: the handler runs without a transaction; a message whose id another
        worker holds is not acked but retried, and reads as DUPLICATE once the holder is done."""
        guard = AsyncIdempotency(db.store, consumer=name, mode="lease", lease_s=30)
        holder = AsyncIdempotency(db.store, consumer=name, mode="lease", lease_s=30)
        order = unique("held")
        entered, release = asyncio.Event(), asyncio.Event()

        async def hold(_tx: Any) -> dict[str, str]:
            entered.set()
            await release.wait()
            async with db.store.engine.begin() as conn:
                await conn.execute(
                    sa.text(f"INSERT INTO {db.table} (order_id) VALUES (:o)"), {"o": order}
                )
            return {"paid": "by the holder"}

        async def apply(body: Any, tx: Any) -> Any:
            assert tx is None, "lease mode has no dedup transaction"
            db.calls[body["order_id"]] += 1
            return {"paid": "by the subscriber"}

        async def body(broker: Any, deliveries: Deliveries) -> None:
            holding = asyncio.create_task(holder.process(f"msg-{order}", hold))
            try:
                await entered.wait()
                await self.publish(broker, name, {"order_id": order}, f"msg-{order}")
                # Several retry delays (FAST: 0.3 s) while the holder keeps its lease.
                await asyncio.sleep(1.2)
                if not self.retries_in_place:
                    assert deliveries.done >= 2, "IN_PROGRESS was handed back to the broker"
            finally:
                release.set()
                await holding
            # A retry already decided before the release may still arrive once more; after it
            # the message must be acked: no delivery for several retry delays.
            await wait_until(lambda: _quiet(deliveries, 1.0), "the message to be acked")
            assert deliveries.done >= 1

        await self.run(db, name, body, guard=guard, apply=apply)
        assert db.calls[order] == 0, "the subscriber never ran the held message"
        assert await db.rows() == Counter({order: 1})


async def _quiet(deliveries: Deliveries, for_s: float) -> bool:
    """True once no delivery finished for ``for_s`` (more than three retry delays)."""
    before = deliveries.done
    await asyncio.sleep(for_s)
    return deliveries.done == before


async def _true(value: bool) -> bool:
    return value


async def _has(db: Db, expected: dict[str, int]) -> bool:
    return await db.rows() == Counter(expected)


def id_headers(message_id: str | None) -> dict[str, str]:
    """The ``idemq-message-id`` header, for brokers without a message id of their own."""
    return {} if message_id is None else {MESSAGE_ID_HEADER: message_id}
