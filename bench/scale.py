"""Throughput across processes: 1, 2 and 4 consumers on one queue/topic, idemq vs hand-written.

The work is ``bench/e2e.py``'s (the order example's ``pay`` as the seed's SQL: the dedup row and
the business change in one PostgreSQL transaction, ack or offset commit after it). For each
consumer count, on RabbitMQ and on Kafka (a Tansu broker this script starts on a free port, the
topic made with four partitions so four consumers share it), interleaved:

* ``raw``    N hand-written consumers (aiormq / confluent-kafka + psycopg 3);
* ``idemq``  N ``idemq worker bench.e2e:handle`` processes.

msg/s is measured inside PostgreSQL (first to last ledger row's ``clock_timestamp()``), so
start-up, group joins before the first commit and polling are not counted; cpu is the consumer
processes' CPU per message, together (see ``bench/e2e.py``). Beside it: commits
per message from ``pg_stat_database`` of a database only this script uses (``bench_scale``,
made if missing): the database's work per message, which must not grow with the count. The
machine has two cores: the curve, not an absolute figure, is the point.

    python bench/scale.py [--n 4000] [--counts 1,2,4] [--only amqp,kafka] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import signal
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
    KAFKA_URL_VAR,
    PG_DSN,
    PG_URL,
    PREFETCH,
    ROOT,
    P,
    Rate,
    Tansu,
    cleanup,
    ledger_rate,
    make_topic,
    process_cpu_s,
    publish,
    reset,
)
from bench.e2e import (
    raw_amqp as e2e_raw_amqp,
)
from bench.e2e import (
    raw_kafka as e2e_raw_kafka,
)

# -- the hand-written consumers (their own processes: --raw BROKER --queue Q --url URL) ------


def raw_amqp(queue: str, _url: str) -> None:
    import asyncio  # noqa: PLC0415

    asyncio.run(e2e_raw_amqp(queue))  # bench/e2e.py's hand-written AMQP consumer


def raw_kafka(queue: str, _url: str) -> None:
    e2e_raw_kafka(queue)  # bench/e2e.py's, on the broker its KAFKA_URL_VAR names


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

    def cpu_s(self) -> float:
        """The processes' CPU seconds so far, together."""
        return sum(process_cpu_s(proc.pid) for proc in self.procs)

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


def run_one(kind: str, broker: str, url: str, count: int, n: int) -> tuple[Rate, float]:
    """msg/s and CPU per message, and commits per message, of ``count`` consumers of one
    contender."""
    reset(n)
    queue = f"{P}scale_{broker}_{kind}_{count}_{time.monotonic_ns() % 10**9}"
    if broker == "kafka":
        make_topic(url, queue)
    publish(url, queue, n)
    before = commits()
    consumers = Consumers(count, kind, broker, queue, url)
    try:
        rate = ledger_rate(n, timeout_s=max(120.0, n / 50), worker=consumers)
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
    os.environ[KAFKA_URL_VAR] = urls["kafka"]  # what the hand-written Kafka consumers read
    best: dict[tuple[str, str, int], tuple[Rate, float]] = {}
    try:
        for rep in range(args.repeat):
            for broker in brokers:
                for count in counts:
                    kinds = ["raw", "idemq"] if (rep + count) % 2 == 0 else ["idemq", "raw"]
                    for kind in kinds:
                        rate, per = run_one(kind, broker, urls[broker], count, args.n)
                        key = (broker, kind, count)
                        if key not in best or rate.msg_s > best[key][0].msg_s:
                            best[key] = (rate, per)
                        print(
                            f"  run {rep + 1} {broker:5} {kind:5} x{count}: {rate.msg_s:7.0f} "
                            f"msg/s, cpu {rate.cpu_us:4.0f} µs/msg, {per:.2f} commits/msg",
                            flush=True,
                        )
    finally:
        if tansu is not None:
            tansu.stop()
    for broker in brokers:
        for kind in ("raw", "idemq"):
            rates = {c: best[broker, kind, c][0] for c in counts}
            one = rates[counts[0]].msg_s
            curve = " | ".join(
                f"x{c} {r.msg_s:6.0f} msg/s ({r.msg_s / one:.2f}x) cpu {r.cpu_us:4.0f} µs"
                for c, r in rates.items()
            )
            print(f"{broker:5} {kind:5}: {curve}")
        ratios = " | ".join(
            f"x{c} {best[broker, 'idemq', c][0].msg_s / best[broker, 'raw', c][0].msg_s:.2f}x"
            for c in counts
        )
        per = " / ".join(f"{best[broker, 'idemq', c][1]:.2f}" for c in counts)
        print(f"{broker:5} idemq/raw: {ratios}; idemq commits per message at each count: {per}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
