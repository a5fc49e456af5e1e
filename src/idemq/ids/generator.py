"""Message ids ``PREFIX_yyyyMMddHHmmssSSS_NODE_SEQ``: generate them, parse them.

Dedup is only as good as the id: two messages sharing one id means one effect silently dropped.
:class:`MessageIdGenerator` therefore guarantees, per generator, ids that are unique and strictly
increasing in *string* order (every field has a fixed width, so string order is time order), and
it survives the failures that break the well-known generators:

* **Clock stepped back a little** (NTP slew, VM pause; ``<= rollback_wait_ms``, default 10 ms):
  wait it out with the injected ``sleep``.
* **Clock stepped back a lot**: by ``on_rollback`` policy either keep issuing from the last
  timestamp (``"logical"``, the default: ids stay unique, their timestamp runs ahead of the wall
  clock until it catches up) or raise :class:`~idemq.ClockMovedBackwardsError` (``"raise"``).
  Never ``None``, never a silent duplicate.
* **Restart after a rollback**: with a :class:`~idemq.timestamp_store.LastTimestampStore` the
  generator persists a reservation ahead of what it issues (``reserve_ms``, one write per
  second by default, not one per id), and on start refuses to go below it.
* **Sequence exhausted within one millisecond** (``10 ** sequence_digits`` ids): wait for the next
  millisecond, polling the injected clock.
* **Node ids**: a fixed string, or a :class:`~idemq.node_lease.NodeLease` so two live processes
  never share one; a generator built on a lease raises :class:`~idemq.LeaseLostError` as soon as
  the lease may have been lost.

The sequence of each millisecond starts at ``0000`` (so ``sequence_digits=4`` gives 10,000 ids
per millisecond). Times are UTC. ``clock`` returns integer epoch **milliseconds**.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

from idemq._clock import system_clock_ms
from idemq.errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
)
from idemq.ids.format import MAX_MESSAGE_ID_LENGTH, MAX_TIMESTAMP_MS, _second_text, validate_id_part

if TYPE_CHECKING:
    from idemq.ids.timestamp_store import LastTimestampStore

__all__ = [
    "MAX_MESSAGE_ID_LENGTH",
    "MAX_TIMESTAMP_MS",
    "MessageIdGenerator",
    "NodeLeaseLike",
    "RollbackPolicy",
    "generate_ids",
    "system_clock_ms",
    "validate_id_part",
]

# Sequence strings are looked up, not formatted, on the hot path; beyond 4 digits the table
# would cost megabytes per width, so wider sequences are formatted on demand instead.
_MAX_TABLE_DIGITS = 4

RollbackPolicy = Literal["logical", "raise"]


class _SeqText(Protocol):
    def __getitem__(self, seq: int, /) -> str: ...


class _FormattedSeq:
    """Formats sequence numbers on demand (widths too large for a lookup table)."""

    __slots__ = ("_format",)

    def __init__(self, digits: int) -> None:
        self._format = f"{{:0{digits}d}}".format

    def __getitem__(self, seq: int, /) -> str:
        return self._format(seq)


_SEQ_TABLES: dict[int, tuple[str, ...]] = {}


def _seq_text(digits: int) -> _SeqText:
    if digits > _MAX_TABLE_DIGITS:
        return _FormattedSeq(digits)
    table = _SEQ_TABLES.get(digits)
    if table is None:
        table = _SEQ_TABLES.setdefault(digits, tuple(f"{i:0{digits}d}" for i in range(10**digits)))
    return table


class NodeLeaseLike(Protocol):
    """What the generator needs from a node lease (see :class:`idemq.node_lease.NodeLease`)."""

    @property
    def node(self) -> str:
        """The leased node id."""

    def ensure_valid(self) -> None:
        """Raise :class:`~idemq.LeaseLostError` if the lease is, or may be, lost."""


# Generators alive in this process, so a fork can disable the child's copies (see below).
_LIVE_GENERATORS: weakref.WeakSet[MessageIdGenerator] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A generator copied into a forked child has the parent's node, sequence and timestamp: both
    # processes would issue the *same* ids. Disable the copies; the child must build its own.
    for generator in list(_LIVE_GENERATORS):
        generator._forked_copy()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class MessageIdGenerator:
    """Issues ids ``PREFIX_yyyyMMddHHmmssSSS_NODE_SEQ``; thread-safe; see the module docstring.

    ``node`` is a string or a :class:`~idemq.node_lease.NodeLease` (then :meth:`next_id` raises
    :class:`~idemq.LeaseLostError` once the lease may be lost). ``clock`` returns epoch ms;
    ``sleep`` takes seconds like :func:`time.sleep` — inject both to test time logic.
    ``timestamp_store`` persists a reservation ``reserve_ms`` ahead so a restart, even after the
    clock went back, cannot reissue an id. Store failures raise
    :class:`~idemq.StoreUnavailableError` and issue nothing.
    """

    def __init__(
        self,
        prefix: str,
        node: str | NodeLeaseLike,
        clock: Callable[[], int] | None = None,
        sequence_digits: int = 4,
        *,
        rollback_wait_ms: int = 10,
        on_rollback: RollbackPolicy = "logical",
        sleep: Callable[[float], None] | None = None,
        timestamp_store: LastTimestampStore | None = None,
        reserve_ms: int = 1000,
    ) -> None:
        self.prefix = validate_id_part("prefix", prefix)
        self._lease: NodeLeaseLike | None = None
        if not isinstance(node, str) and hasattr(node, "ensure_valid"):
            self._lease = node
            node = node.node
        self.node = validate_id_part("node", node)
        if not isinstance(sequence_digits, int) or not 1 <= sequence_digits <= 9:
            raise ConfigurationError(f"sequence_digits must be 1..9, got {sequence_digits!r}")
        length = len(self.prefix) + len(self.node) + 17 + sequence_digits + 3
        if length > MAX_MESSAGE_ID_LENGTH:
            raise ConfigurationError(
                f"ids would be {length} chars, more than the {MAX_MESSAGE_ID_LENGTH} "
                "a dedup key holds"
            )
        if on_rollback not in ("logical", "raise"):
            raise ConfigurationError(
                f"on_rollback must be 'logical' or 'raise', got {on_rollback!r}"
            )
        if rollback_wait_ms < 0 or reserve_ms < 1:
            raise ConfigurationError("rollback_wait_ms must be >= 0 and reserve_ms >= 1")
        self.sequence_digits = sequence_digits
        self.on_rollback: RollbackPolicy = on_rollback
        self.rollback_wait_ms = rollback_wait_ms
        self.reserve_ms = reserve_ms
        self._clock = clock if clock is not None else system_clock_ms
        self._sleep = sleep if sleep is not None else time.sleep
        self._store = timestamp_store
        self._capacity = 10**sequence_digits
        self._seq_text = _seq_text(sequence_digits)
        self._prefix_head = f"{self.prefix}_"
        self._node_tail = f"_{self.node}_"
        self._lock = threading.Lock()
        self._forked = False
        # State of the last issued id: (_last_ms, _seq). The next one must be greater.
        self._last_ms = -1
        self._seq = self._capacity - 1
        # The ms the hot path may issue in: equals _last_ms only while that is the wall clock
        # (never while issuing logically ahead of it), -1 forces the slow path.
        self._fast_ms = -1
        self._head = ""
        self._cached_second = -1
        self._cached_second_text = ""
        self._reserved_until_ms = -1
        # After a restart the persisted floor is a reservation, not proof the clock went back.
        self._restart_grace = False
        if timestamp_store is not None:
            floor_ms = timestamp_store.load()
            if floor_ms is not None:
                # Every id issued before has a timestamp < floor_ms: resume as if floor_ms - 1
                # were exhausted, so the next id is at floor_ms or later.
                self._last_ms = floor_ms - 1
                self._reserved_until_ms = floor_ms
                self._restart_grace = True
        _LIVE_GENERATORS.add(self)

    def __repr__(self) -> str:
        return f"MessageIdGenerator(prefix={self.prefix!r}, node={self.node!r})"

    def next_id(self) -> str:
        """Return the next id: unique and greater (as a string) than every earlier one."""
        with self._lock:
            now = self._clock()
            # Hot path: same millisecond as the previous id, sequence not exhausted. The
            # formatted head (prefix, timestamp, node) is cached per ms; only SEQ changes.
            if now == self._fast_ms:
                seq = self._seq + 1
                if seq < self._capacity:
                    self._seq = seq
                    return self._head + self._seq_text[seq]
            return self._next_slow(now)

    def _next_slow(self, now: int) -> str:
        if self._forked:
            raise ConfigurationError(
                f"{self!r} was inherited across os.fork(); parent and child would issue the same "
                "ids — create the generator (and its node lease) in the child process"
            )
        if self._lease is not None:
            self._lease.ensure_valid()
        while True:
            if not 0 <= now <= MAX_TIMESTAMP_MS:
                raise ConfigurationError(f"clock returned {now!r}; expected epoch ms in 1970..9999")
            last = self._last_ms
            if now > last:
                ts, seq = now, 0
                break
            if now == last:
                if self._seq + 1 < self._capacity:
                    ts, seq = now, self._seq + 1
                    break
                now = self._wait_for_next_ms(last)
                continue
            behind_ms = last - now
            # Just after a restart, ``last`` is the previous run's reservation floor, up to
            # reserve_ms - 1 ahead of the last id it really issued (renewed just before it
            # stopped): only what lies behind that id is the clock stepping back.
            ahead_ms = self.reserve_ms - 1 if self._restart_grace else 0
            if behind_ms <= self.rollback_wait_ms or (
                self.on_rollback == "raise" and behind_ms <= ahead_ms + self.rollback_wait_ms
            ):
                # A small step back (and the previous run's reservation): waiting it out keeps
                # the timestamps truthful at the cost of a short pause.
                # (+1 ms when the last ms is exhausted: then only a later ms will do.)
                exhausted = self._seq + 1 >= self._capacity
                self._sleep((behind_ms + exhausted) / 1000)
                now = self._clock()
                continue
            if self.on_rollback == "raise":
                # Reported from the earliest the last issued id can be: the step provably taken.
                raise ClockMovedBackwardsError(last - ahead_ms, now)
            # Logical clock: continue after the last id; move to last + 1 only when that ms is
            # exhausted. Unique and increasing, timestamps ahead until the wall clock catches up.
            if self._seq + 1 < self._capacity:
                ts, seq = last, self._seq + 1
            else:
                ts, seq = last + 1, 0
            break
        if ts > MAX_TIMESTAMP_MS:
            raise ConfigurationError("logical clock ran past 9999-12-31")
        if self._store is not None and ts >= self._reserved_until_ms:
            # Persist *before* issuing: if the write fails nothing was issued beyond the old
            # reservation, so a restart can never go below an id that was handed out.
            until_ms = ts + self.reserve_ms
            self._store.advance(until_ms)
            self._reserved_until_ms = until_ms
        if ts != self._last_ms:
            self._head = self._prefix_head + self._timestamp_text(ts) + self._node_tail
        self._last_ms = ts
        self._seq = seq
        self._fast_ms = ts if ts == now else -1
        self._restart_grace = False
        return self._head + self._seq_text[seq]

    def _wait_for_next_ms(self, last_ms: int) -> int:
        # Sequence exhausted: poll the (injected) clock until it passes last_ms, sleeping a
        # fraction of a millisecond between polls instead of spinning a core.
        while True:
            now = self._clock()
            if now != last_ms:
                return now
            self._sleep(0.0002)

    def _timestamp_text(self, ts: int) -> str:
        seconds, millis = divmod(ts, 1000)
        if seconds != self._cached_second:
            self._cached_second_text = _second_text(seconds)
            self._cached_second = seconds
        return f"{self._cached_second_text}{millis:03d}"

    def _forked_copy(self) -> None:
        # Runs in a fresh child: the parent's lock may have been held by another thread at fork.
        self._lock = threading.Lock()
        self._forked = True
        self._fast_ms = -1


def generate_ids(prefix: str, node: str, count: int, *, sequence_digits: int = 4) -> list[str]:
    """``count`` fresh ids from a new generator on the system clock (``idemq id new``)."""
    if count < 0:
        raise ConfigurationError(f"count must be >= 0, got {count}")
    generator = MessageIdGenerator(prefix, node, sequence_digits=sequence_digits)
    return [generator.next_id() for _ in range(count)]
