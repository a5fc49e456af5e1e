"""``current_message()``: the running handler's message, seen from code deep inside it."""

from __future__ import annotations

import asyncio
import threading
import time

import idemq
from idemq.guard.context import HandlerContext, current_message


def test_a_handler_sees_its_message_and_nothing_leaks_out():
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="orders")
    seen = []

    def handler(_tx):
        context = current_message()
        assert context is not None
        seen.append(
            (context.consumer, context.message_id, context.next_index(), context.next_index())
        )

    assert guard.process("M1", handler).status is idemq.Status.PROCESSED
    assert seen == [("orders", "M1", 0, 1)]
    assert current_message() is None


def test_each_run_of_a_batch_counts_from_zero():
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="c")
    indexes: dict[str, list[int]] = {}

    def handler(msg, _tx):
        context = current_message()
        assert context is not None
        assert context.message_id == msg.id
        indexes.setdefault(msg.id, []).append(context.next_index())

    messages = [idemq.Message(id=f"B{i}", body=b"{}") for i in range(3)]
    guard.process_batch(messages, handler)
    assert indexes == {"B0": [0], "B1": [0], "B2": [0]}


def test_concurrent_async_handlers_each_see_their_own(tmp_path):
    store = idemq.AsyncSqlStore(f"sqlite:///{tmp_path / 'idemq.db'}")
    guard = idemq.AsyncIdempotency(store, consumer="c", mode="lease")

    async def handler(_tx):
        context = current_message()
        await asyncio.sleep(0.01)  # interleave with the other tasks
        assert current_message() is context
        return context.message_id if context else None

    async def main() -> list[object]:
        await store.create_schema()
        try:
            outcomes = await asyncio.gather(*(guard.process(f"A{i}", handler) for i in range(5)))
        finally:
            await store.close()
        return [o.result for o in outcomes]

    assert asyncio.run(main()) == [f"A{i}" for i in range(5)]


def test_a_lease_loss_reaches_a_handler_whether_it_waits_before_or_after():
    marked_first = HandlerContext("c", "M1", "owner")
    assert not marked_first.lease_lost
    marked_first.mark_lease_lost()
    assert marked_first.lease_lost
    assert marked_first.wait_lease_lost(0)

    waiting = HandlerContext("c", "M2", "owner")
    told: list[bool] = []
    thread = threading.Thread(target=lambda: told.append(waiting.wait_lease_lost(10)))
    thread.start()
    time.sleep(0.05)  # the waiter is (most likely) waiting already
    waiting.mark_lease_lost()
    thread.join(5)
    assert told == [True]
    assert waiting.lease_lost
    assert not HandlerContext("c", "M3", "owner").wait_lease_lost(0)
