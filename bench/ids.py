"""MessageIdGenerator throughput next to a bare f-string formatting loop, in the same run.

Usage: ``python bench/ids.py [-n 2000000] [--threads 4]``. Prints ids/s for each and the ratio;
the target is >= 1,000,000 ids/s per process on the default system clock.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

from idemq.ids.generator import MessageIdGenerator, system_clock_ms

TARGET_IDS_PER_S = 1_000_000


def bare_formatting(n: int) -> float:
    """The floor: the same string built by one f-string per id, no lock, no clock, no checks."""
    start = time.perf_counter()
    for i in range(n):
        _ = f"ORDER_{20240115143000123}_NODE01_{i % 10000:04d}"
    return n / (time.perf_counter() - start)


def bare_formatting_with_clock(n: int) -> float:
    """The f-string plus one clock read per id: what any correct generator must at least do."""
    start = time.perf_counter()
    for i in range(n):
        _ = f"ORDER_{system_clock_ms()}_NODE01_{i % 10000:04d}"
    return n / (time.perf_counter() - start)


def generator(n: int) -> float:
    """MessageIdGenerator.next_id on the system clock, one thread."""
    next_id = MessageIdGenerator("ORDER", "NODE01").next_id
    start = time.perf_counter()
    for _ in range(n):
        next_id()
    return n / (time.perf_counter() - start)


def generator_threads(n: int, threads: int) -> float:
    """One generator shared by ``threads`` threads (lock contention under the GIL)."""
    next_id = MessageIdGenerator("ORDER", "NODE01").next_id
    per_thread = n // threads
    barrier = threading.Barrier(threads + 1)

    def work() -> None:
        barrier.wait()
        for _ in range(per_thread):
            next_id()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    for w in workers:
        w.join()
    return per_thread * threads / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=2_000_000, help="ids per measurement")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs")
    args = parser.parse_args()

    def best(fn: Callable[..., float], *fn_args: int) -> float:
        return max(fn(*fn_args) for _ in range(args.repeat))

    bare = best(bare_formatting, args.n)
    bare_clock = best(bare_formatting_with_clock, args.n)
    gen = best(generator, args.n)
    gen_mt = best(generator_threads, args.n, args.threads)
    print(f"bare f-string formatting       : {bare:>12,.0f} ids/s")
    print(f"bare f-string + clock read     : {bare_clock:>12,.0f} ids/s")
    print(f"MessageIdGenerator.next_id     : {gen:>12,.0f} ids/s")
    print(f"  ... shared by {args.threads} threads     : {gen_mt:>12,.0f} ids/s")
    print(f"ratio generator / bare f-string: {gen / bare:.2f}")
    print(f"ratio generator / f-string+clk : {gen / bare_clock:.2f}")
    verdict = "meets" if gen >= TARGET_IDS_PER_S else "MISSES"
    print(f"target {TARGET_IDS_PER_S:,} ids/s per process: {verdict}")


if __name__ == "__main__":
    main()
