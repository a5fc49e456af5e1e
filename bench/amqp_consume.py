"""The RabbitMQ adapter alone: client CPU per message to consume and ack, against bare aiormq.

No handler, no store: a queue is filled with ``--n`` persistent messages (quorum, as idemq
creates it), then emptied at prefetch 200 by one contender, acking each message, and the
process's CPU (every thread: ``time.process_time``) between the first delivery and the last
settled ack is divided by ``--n``. Contenders, interleaved, each in a process of its own:

* ``aiormq``  a bare aiormq consumer: ``basic_consume``, one ``basic_ack`` per message — the
              floor of the protocol on this client;
* ``idemq``   ``RabbitMQBroker.consume`` and ``Delivery.ack`` of this checkout;
* ``before``  the same on the checkout given with ``--before`` (its ``src`` first on the path).

    python bench/amqp_consume.py [--n 5000] [--repeat 3] [--before CHECKOUT]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiormq

URL = "amqp://guest:guest@127.0.0.1:5672/"
PREFETCH = 200


async def fill(queue: str, n: int) -> None:
    """Create ``queue`` as idemq would (quorum, its DLQ) and publish ``n`` messages to it."""
    connection = await aiormq.connect(URL)
    channel = await connection.channel()
    dead = f"{queue}.dlq"
    await channel.queue_declare(dead, durable=True)
    arguments = {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dead,
    }
    await channel.queue_declare(queue, durable=True, arguments=arguments)
    for i in range(n):
        properties = aiormq.spec.Basic.Properties(message_id=f"m{i}", delivery_mode=2)
        await channel.basic_publish(b'{"order_id": "o"}', routing_key=queue, properties=properties)
    await connection.close()


async def drop(queue: str) -> None:
    connection = await aiormq.connect(URL)
    channel = await connection.channel()
    for name in (queue, f"{queue}.dlq"):
        await channel.queue_delete(name)
    await connection.close()


async def bare_aiormq(queue: str, n: int) -> float:
    """CPU seconds of a bare aiormq consumer emptying ``queue``."""
    connection = await aiormq.connect(URL)
    channel = await connection.channel()
    await channel.basic_qos(prefetch_count=PREFETCH)
    done = asyncio.Event()
    seen = 0
    started = 0.0

    async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
        nonlocal seen, started
        if seen == 0:
            started = time.process_time()
        await channel.basic_ack(message.delivery.delivery_tag)
        seen += 1
        if seen == n:
            done.set()

    await channel.basic_consume(queue, on_message)
    await done.wait()
    cpu_s = time.process_time() - started
    await connection.close()
    return cpu_s


def adapter(queue: str, n: int) -> float:
    """CPU seconds of idemq's adapter emptying ``queue``: its acks waited for at the end."""
    from idemq.brokers.rabbitmq import RabbitMQBroker  # noqa: PLC0415 (the checkout's, per run)

    broker = RabbitMQBroker(URL)
    seen = 0
    started = 0.0
    last = None
    try:
        for delivery in broker.consume(queue, prefetch=PREFETCH):
            if delivery is None:
                continue
            if seen == 0:
                started = time.process_time()
            last = delivery.ack()
            seen += 1
            if seen == n:
                break
        if last is not None:
            last.result(30)  # the settler runs in order: every ack before it went too
        return time.process_time() - started
    finally:
        broker.close()


def one(kind: str, n: int) -> None:
    """In the contender's process: fill a queue of its own, empty it, print the CPU."""
    queue = f"bench_amqp_consume_{uuid.uuid4().hex[:12]}"
    asyncio.run(fill(queue, n))
    try:
        cpu_s = asyncio.run(bare_aiormq(queue, n)) if kind == "aiormq" else adapter(queue, n)
    finally:
        asyncio.run(drop(queue))
    print(f"{cpu_s / n * 1e6:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", type=Path, help="a checkout of the code before a change")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one, args.n)
        return
    here = Path(__file__).resolve().parents[1] / "src"
    paths = {"aiormq": here, "idemq": here}
    if args.before:
        paths["before"] = args.before.resolve() / "src"
    print(f"{args.n} messages per run, prefetch {PREFETCH}; client CPU µs per message consumed")
    runs: dict[str, list[float]] = {kind: [] for kind in paths}
    for rep in range(args.repeat):
        for kind, src in paths.items() if rep % 2 == 0 else reversed(paths.items()):
            env = {**os.environ, "PYTHONPATH": str(src)}
            out = subprocess.run(
                [sys.executable, __file__, "--one", kind, "--n", str(args.n)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            runs[kind].append(float(out.stdout.strip().splitlines()[-1]))
            print(f"  run {rep + 1} {kind:7} {runs[kind][-1]:6.1f} µs/msg", flush=True)
    floor = min(runs["aiormq"])
    for kind, cpu in runs.items():
        print(
            f"{kind:7}: best {min(cpu):6.1f} µs/msg, runs {' / '.join(f'{c:.0f}' for c in cpu)}"
            f" ({min(cpu) / floor:.2f}x bare aiormq's best)"
        )


if __name__ == "__main__":
    main()
