"""MessageIdGenerator and parse_message_id, driven by an injected fake clock (no real sleeping)."""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idemq.errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
    InvalidMessageIdError,
    LeaseLostError,
    StoreUnavailableError,
)
from idemq.ids.format import MAX_TIMESTAMP_MS, format_timestamp_ms, parse_message_id
from idemq.ids.generator import MessageIdGenerator, generate_ids
from idemq.ids.timestamp_store import FileTimestampStore

T0 = 1_705_329_000_123  # 2024-01-15T14:30:00.123Z


class FakeClock:
    """Epoch-ms clock that only moves when told to, or when the generator sleeps."""

    def __init__(self, now_ms: int = T0) -> None:
        self.now_ms = now_ms
        self.sleeps_s: list[float] = []

    def __call__(self) -> int:
        return self.now_ms

    def sleep(self, seconds: float) -> None:
        self.sleeps_s.append(seconds)
        self.now_ms += max(1, math.ceil(seconds * 1000))


class CountingStore:
    """An in-process LastTimestampStore that counts writes (the protocol, not a service fake)."""

    def __init__(self) -> None:
        self.value: int | None = None
        self.writes = 0

    def load(self) -> int | None:
        return self.value

    def advance(self, until_ms: int) -> None:
        self.writes += 1
        self.value = max(self.value or 0, until_ms)


def make(clock: FakeClock, **kwargs: object) -> MessageIdGenerator:
    return MessageIdGenerator("ORDER", "NODE01", clock=clock, sleep=clock.sleep, **kwargs)  # type: ignore[arg-type]


def test_format_is_utc_milliseconds_and_sequence_starts_at_zero() -> None:
    clock = FakeClock()
    gen = make(clock)
    assert gen.next_id() == "ORDER_20240115143000123_NODE01_0000"
    assert gen.next_id() == "ORDER_20240115143000123_NODE01_0001"
    clock.now_ms += 1
    assert gen.next_id() == "ORDER_20240115143000124_NODE01_0000"  # sequence resets each ms
    clock.now_ms += 1000 * 3600 * 24 * 366
    assert gen.next_id() == "ORDER_20250115143000124_NODE01_0000"


def test_ids_are_unique_and_strictly_increasing_as_strings() -> None:
    clock = FakeClock()
    gen = make(clock, sequence_digits=2)
    ids = []
    for step in range(5000):
        if step % 7 == 0:
            clock.now_ms += step % 3  # sometimes the same ms, sometimes 1-2 ms later
        ids.append(gen.next_id())
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert all(a < b for a, b in itertools.pairwise(ids))


@pytest.mark.parametrize(
    ("prefix", "node"),
    [
        ("ORD_ER", "NODE01"),
        ("ORDER", "NODE_01"),
        ("", "NODE01"),
        ("ORDER", ""),
        ("ORDER", "NÖDE"),
        ("ORD ER", "N1"),
        ("ORDER", "N\u0661"),  # Arabic-Indic digit: \d would accept it, we must not
        (None, "N1"),
        ("ORDER", 7),
    ],
)
def test_bad_prefix_or_node_is_a_configuration_error(prefix: object, node: object) -> None:
    with pytest.raises(ConfigurationError, match="letters, digits and '-'"):
        MessageIdGenerator(prefix, node)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sequence_digits": 0},
        {"sequence_digits": 10},
        {"on_rollback": "ignore"},
        {"rollback_wait_ms": -1},
        {"reserve_ms": 0},
    ],
)
def test_bad_options_are_configuration_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        MessageIdGenerator("ORDER", "N1", **kwargs)  # type: ignore[arg-type]


def test_ids_longer_than_a_dedup_key_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="128"):
        MessageIdGenerator("P" * 60, "N" * 50)


def test_clock_outside_four_digit_years_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="clock returned"):
        MessageIdGenerator("A", "B", clock=lambda: MAX_TIMESTAMP_MS + 1).next_id()
    with pytest.raises(ConfigurationError, match="clock returned"):
        MessageIdGenerator("A", "B", clock=lambda: -1).next_id()


def test_small_rollback_of_5_ms_is_waited_out() -> None:
    clock = FakeClock()
    gen = make(clock)
    before = gen.next_id()
    clock.now_ms -= 5
    after = gen.next_id()
    assert clock.sleeps_s == [0.005]  # waited through the injected sleep, once
    assert after > before
    assert parse_message_id(after).timestamp_ms >= parse_message_id(before).timestamp_ms


def test_rollback_of_10_s_goes_logical_by_default() -> None:
    clock = FakeClock()
    gen = make(clock, sequence_digits=2)
    last = gen.next_id()
    clock.now_ms -= 10_000
    logical = [gen.next_id() for _ in range(250)]  # spills over 3 logical ms (100 per ms)
    assert clock.sleeps_s == []  # no waiting 10 s
    assert all(a < b for a, b in itertools.pairwise([last, *logical]))
    stamps = [parse_message_id(i).timestamp_ms for i in logical]
    assert stamps[0] == T0
    assert max(stamps) == T0 + 2
    clock.now_ms = T0 + 5  # wall clock caught up: back to real timestamps
    caught_up = gen.next_id()
    assert caught_up > logical[-1]
    assert parse_message_id(caught_up).timestamp_ms == T0 + 5


def test_rollback_of_10_s_raises_under_raise_policy_and_recovers() -> None:
    clock = FakeClock()
    gen = make(clock, on_rollback="raise")
    last = gen.next_id()
    clock.now_ms -= 10_000
    with pytest.raises(ClockMovedBackwardsError) as info:
        gen.next_id()
    assert (info.value.last_ms, info.value.now_ms) == (T0, T0 - 10_000)
    clock.now_ms = T0
    assert gen.next_id() == last[:-4] + "0001"  # nothing was consumed by the failed call


def test_rollback_wait_limit_is_configurable() -> None:
    clock = FakeClock()
    gen = make(clock, on_rollback="raise", rollback_wait_ms=50)
    gen.next_id()
    clock.now_ms -= 40
    gen.next_id()
    assert clock.sleeps_s == [0.04]
    clock.now_ms -= 51
    with pytest.raises(ClockMovedBackwardsError):
        gen.next_id()


def test_more_than_10000_ids_in_one_ms_wait_for_the_next_ms() -> None:
    clock = FakeClock()
    gen = make(clock)
    ids = [gen.next_id() for _ in range(10_000)]
    assert ids[0].endswith("_0000")
    assert ids[-1].endswith("_9999")
    assert clock.sleeps_s == []
    assert clock.now_ms == T0
    overflow = [gen.next_id() for _ in range(2_500)]
    assert clock.sleeps_s  # the wait went through the injected sleep and clock
    assert clock.now_ms == T0 + 1
    assert overflow[0] == "ORDER_20240115143000124_NODE01_0000"
    everything = ids + overflow
    assert len(set(everything)) == 12_500
    assert everything == sorted(everything)


def test_restart_after_rollback_with_persisted_state_cannot_reissue(tmp_path: Path) -> None:
    store = FileTimestampStore(tmp_path / "order-node01.ts")
    clock = FakeClock()
    first_run = make(clock, timestamp_store=store)
    issued = [first_run.next_id() for _ in range(100)]
    assert store.load() == T0 + 1000  # reserved one second ahead, in one write

    # Restart after the clock went back 10 s: the new process must not reissue `issued`.
    clock.now_ms -= 10_000
    second_run = make(clock, timestamp_store=store)
    more = [second_run.next_id() for _ in range(100)]
    assert not set(issued) & set(more)
    assert min(more) > max(issued)
    assert parse_message_id(more[0]).timestamp_ms == T0 + 1000  # logical, from the reservation

    with pytest.raises(ClockMovedBackwardsError):
        make(clock, timestamp_store=store, on_rollback="raise").next_id()


def test_without_persisted_state_a_restart_after_rollback_does_reissue() -> None:
    """The failure the timestamp store exists for (Leaf's restart-after-rollback duplicate)."""
    clock = FakeClock()
    issued = {make(clock).next_id() for _ in range(1)}
    clock.now_ms -= 10_000
    restarted = make(clock)
    clock.now_ms += 10_000
    assert restarted.next_id() in issued


def test_quick_restart_under_raise_policy_waits_out_its_own_reservation(tmp_path: Path) -> None:
    store = FileTimestampStore(tmp_path / "ts")
    clock = FakeClock()
    issued = make(clock, timestamp_store=store, on_rollback="raise").next_id()
    clock.now_ms += 200  # restarted 200 ms later, reservation runs to T0 + 1000
    again = make(clock, timestamp_store=store, on_rollback="raise").next_id()
    assert clock.sleeps_s == [0.8]
    assert again > issued
    assert parse_message_id(again).timestamp_ms == T0 + 1000


def test_restart_just_after_a_renewal_with_the_clock_10ms_back_waits_it_out() -> None:
    # The previous run renewed its reservation (to T0 + 2000) with its last id at T0 + 1000,
    # then stopped; the restarted one finds the clock 10 ms back (<= rollback_wait_ms). The
    # floor is 1000 ms ahead of that last id by design, so the step back is only 10 ms: wait,
    # do not raise "clock moved backwards by 1009 ms".
    store = CountingStore()
    clock = FakeClock()
    first_run = make(clock, timestamp_store=store, on_rollback="raise")
    first_run.next_id()
    clock.now_ms = T0 + 1000
    last = first_run.next_id()  # the renewal
    assert store.value == T0 + 2000
    clock.now_ms = T0 + 990
    again = make(clock, timestamp_store=store, on_rollback="raise").next_id()
    assert again > last
    assert parse_message_id(again).timestamp_ms == T0 + 2000
    assert sum(clock.sleeps_s) <= 1.011, clock.sleeps_s  # the reservation, nothing more


def test_restart_with_the_clock_back_beyond_the_tolerance_raises_the_true_step() -> None:
    store = CountingStore()
    clock = FakeClock()
    first_run = make(clock, timestamp_store=store, on_rollback="raise")
    first_run.next_id()
    clock.now_ms = T0 + 1000
    first_run.next_id()  # last id at T0 + 1000, reservation to T0 + 2000
    clock.now_ms = T0 + 950  # 50 ms back: more than rollback_wait_ms (10)
    with pytest.raises(ClockMovedBackwardsError) as info:
        make(clock, timestamp_store=store, on_rollback="raise").next_id()
    assert str(info.value).startswith("clock moved backwards by 50 ms"), str(info.value)
    assert clock.sleeps_s == []


def test_store_is_written_once_per_reservation_not_per_id() -> None:
    store = CountingStore()
    clock = FakeClock()
    gen = make(clock, timestamp_store=store, reserve_ms=1000)
    for _ in range(3000):
        gen.next_id()
        clock.now_ms += 1  # 3 seconds of ids
    assert store.writes == 3
    assert store.value == T0 + 3000


def test_store_failure_issues_nothing_and_recovers(tmp_path: Path) -> None:
    store = FileTimestampStore(tmp_path / "missing-dir" / "ts")
    clock = FakeClock()
    gen = make(clock, timestamp_store=store)
    with pytest.raises(StoreUnavailableError) as info:
        gen.next_id()
    assert isinstance(info.value.__cause__, OSError)
    (tmp_path / "missing-dir").mkdir()
    assert gen.next_id().endswith("_0000")
    assert store.load() == T0 + 1000


class _LostLease:
    node = "N007"

    def __init__(self) -> None:
        self.valid = True

    def ensure_valid(self) -> None:
        if not self.valid:
            raise LeaseLostError("taken over")


def test_generator_on_a_lost_lease_stops_issuing() -> None:
    clock = FakeClock()
    lease = _LostLease()
    gen = MessageIdGenerator("ORDER", lease, clock=clock)
    assert "_N007_" in gen.next_id()
    lease.valid = False
    clock.now_ms += 1
    with pytest.raises(LeaseLostError):
        gen.next_id()


def test_four_threads_times_100k_ids_are_unique() -> None:
    gen = MessageIdGenerator("ORDER", "NODE01")
    per_thread: list[list[str]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def work(out: list[str]) -> None:
        start.wait()
        next_id = gen.next_id
        out.extend(next_id() for _ in range(100_000))

    threads = [threading.Thread(target=work, args=(out,)) for out in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [i for out in per_thread for i in out]
    assert len(everything) == 400_000
    assert len(set(everything)) == 400_000
    for out in per_thread:  # each thread sees a strictly increasing stream
        assert all(a < b for a, b in itertools.pairwise(out))


@pytest.mark.skipif(sys.platform == "win32", reason="os.fork")
def test_generator_inherited_across_fork_refuses_to_issue() -> None:
    gen = MessageIdGenerator("ORDER", "NODE01")
    gen.next_id()
    pid = os.fork()
    if pid == 0:  # child: must not issue the parent's ids
        try:
            gen.next_id()
        except ConfigurationError:
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    gen.next_id()  # the parent's copy is unaffected


def test_parse_millisecond_form() -> None:
    parts = parse_message_id("ORDER_20240115143000123_NODE01_0042")
    assert parts.prefix == "ORDER"
    assert parts.node == "NODE01"
    assert parts.sequence == 42
    assert parts.timestamp == datetime(2024, 1, 15, 14, 30, 0, 123_000, tzinfo=UTC)
    assert parts.timestamp.tzinfo is UTC
    assert parts.timestamp_ms == T0
    assert parts.to_dict()["timestamp"] == "2024-01-15T14:30:00.123+00:00"


def test_parse_seed_second_precision_form() -> None:
    parts = parse_message_id("ORDER_20240115143000_NODE01_0001")
    assert parts.timestamp == datetime(2024, 1, 15, 14, 30, tzinfo=UTC)
    assert (parts.prefix, parts.node, parts.sequence) == ("ORDER", "NODE01", 1)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "ORDER",
        "ORDER_2024011514300_NODE01_0001",  # 13 digits
        "ORDER_202401151430001_NODE01_0001",  # 15 digits
        "ORDER_20241315143000_NODE01_0001",  # month 13
        "ORDER_20240230143000_NODE01_0001",  # Feb 30
        "ORDER_20240115143000_NODE_01_0001",
        "ORDER_20240115143000_NODE01_",
        "ORDER_20240115143000_NODE01_0123456789",
        "ORDER_2024011514300\u0660_NODE01_0001",
        " ORDER_20240115143000_NODE01_0001",
        "ORDER_20240115143000_NODE01_0001\n",
        "X" * 120 + "_20240115143000_N_1",
        None,
        20240115143000,
    ],
)
def test_parse_rejects_anything_else(bad: object) -> None:
    with pytest.raises(InvalidMessageIdError):
        parse_message_id(bad)


_part = st.from_regex(r"\A[A-Za-z0-9-]{1,20}\Z")


@settings(max_examples=300, deadline=None)
@given(
    prefix=_part,
    node=_part,
    now_ms=st.integers(0, MAX_TIMESTAMP_MS),
    digits=st.integers(1, 9),
    count=st.integers(1, 5),
)
def test_parse_round_trips_next_id(
    prefix: str, node: str, now_ms: int, digits: int, count: int
) -> None:
    gen = MessageIdGenerator(prefix, node, clock=lambda: now_ms, sequence_digits=digits)
    for expected_seq in range(min(count, 10**digits)):
        message_id = gen.next_id()
        parts = parse_message_id(message_id)
        assert parts.prefix == prefix
        assert parts.node == node
        assert parts.sequence == expected_seq
        assert parts.timestamp == datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=now_ms)
        assert parts.timestamp_ms == now_ms
        assert message_id.split("_")[1] == format_timestamp_ms(now_ms)


def test_generate_ids_for_the_cli() -> None:
    ids = generate_ids("ORDER", "NODE01", 5)
    assert len(set(ids)) == 5
    assert ids == sorted(ids)
    assert all(parse_message_id(i).node == "NODE01" for i in ids)
    assert generate_ids("ORDER", "NODE01", 0) == []
    with pytest.raises(ConfigurationError):
        generate_ids("ORDER", "NODE01", -1)
