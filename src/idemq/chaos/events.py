"""What the workers saw, written as they saw it — and why each duplicate delivery happened.

Every worker process appends JSON lines to its own file (``events-<pid>.jsonl``): one
``start`` when a delivery reaches the guard, one ``done`` when it was settled, and ``kill`` —
the crash marker, naming the message it holds, written and fsynced before the worker shoots
itself between commit and ack (the supervisor reports its own kills with the time its SIGKILL
left, see :meth:`Tally.kill`). Files, not a multiprocessing queue: a
process SIGKILLed while holding a queue's shared write lock would deadlock every other writer,
and a half-written last line is simply skipped by the reader.

:class:`Tally` replays the events and attributes every delivery after a message's first one:

* ``partition`` — a copy the broker got from a producer retry (a new ``copy`` number);
* ``crash``     — in a two-hop run, also a copy an outbox relay published again because the relay
  that had published it died before deleting the row (a new ``relay`` pid, the earlier one dead);
* ``slow``      — the same copy again while its previous delivery was still running;
* ``crash``     — the same copy again after the worker holding it died: its crash marker names
  that message, or the supervisor's SIGKILL left before the copy came back;
* ``cut``       — the same copy again while the worker holding it was on a host cut off the
  network (``idemq chaos --hosts``): the broker gave up on that worker;
* ``other``     — the same copy again for any other reason (e.g. a consumer-group rebalance);
* ``retry``     — not a duplicate: redelivery the worker asked for (IN_PROGRESS, handler error).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CAUSES", "COPY_HEADER", "RELAY_HEADER", "Delivery", "EventLog", "Tally"]

COPY_HEADER = "idemq-chaos-copy"
"""Publish attempt that produced this broker copy (1 = first); set by the chaos producer."""

RELAY_HEADER = "idemq-chaos-relay"
"""Pid of the outbox relay that published this copy (second hop of a two-hop run)."""

CAUSES = ("partition", "slow", "crash", "cut", "other")
_RETRY_VERDICTS = frozenset({"in_progress", "handler_error", "store_unavailable"})


class EventLog:
    """Append-only JSON-lines file of one worker process (thread-safe)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"events-{os.getpid()}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, kind: str, *, durable: bool = False, **fields: Any) -> None:
        """One event; ``os.write`` of one line, so a kill leaves at most one partial line.

        ``durable``: fsync before returning (the crash marker: the process dies right after).
        """
        line = json.dumps({"k": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())
            if durable:
                os.fsync(self._fd)

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


@dataclass
class Delivery:
    """One delivery of one copy of a message to one worker."""

    message_id: str
    copy: int
    pid: int
    start_s: float
    end_s: float | None = None
    verdict: str | None = None
    slow: bool = False  # the worker stalled this delivery on purpose (cause 2)
    relay: int = 0  # pid of the outbox relay that published this copy (0: the producer)
    cause: str | None = None  # None for a message's first delivery


@dataclass
class Tally:
    """Incremental reader of every worker's events, plus the supervisor's kills."""

    directory: Path
    killed_at_s: dict[int, float] = field(default_factory=dict)  # pid → when it died (earliest)
    kill_times_s: list[float] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    self_kills: int = 0  # workers: after the commit, before the ack
    relay_self_kills: int = 0  # relays: after a confirmed publish, before the row's delete
    crash_marked: set[tuple[int, str]] = field(default_factory=set)  # (pid, message id)
    cut_pids: set[int] = field(default_factory=set)  # processes of a host cut off the network
    cut_window_s: tuple[float, float] | None = None  # when it was off (wall clock)
    _open: dict[tuple[int, int], Delivery] = field(default_factory=dict)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def kill(self, pid: int, at_s: float) -> None:
        """Worker ``pid`` was killed at ``at_s`` (the supervisor's signal, or its own marker)."""
        self._died(pid, at_s)
        self.kill_times_s.append(at_s)

    def cut(self, pids: set[int], from_s: float, to_s: float) -> None:
        """The processes ``pids`` were off the network from ``from_s`` to ``to_s``."""
        self.cut_pids = set(pids)
        self.cut_window_s = (from_s, to_s)

    def cut_off(self, delivery: Delivery) -> bool:
        """Whether ``delivery`` was under way on a host while it was cut off."""
        if self.cut_window_s is None or delivery.pid not in self.cut_pids:
            return False
        from_s, to_s = self.cut_window_s
        return delivery.start_s < to_s and (delivery.end_s is None or delivery.end_s > from_s)

    def _died(self, pid: int, at_s: float) -> None:
        self.killed_at_s[pid] = min(at_s, self.killed_at_s.get(pid, at_s))

    def poll(self) -> None:
        """Read what the workers appended since the last poll."""
        for path in sorted(self.directory.glob("events-*.jsonl")):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            complete = data.rfind(b"\n") + 1  # a line still being written waits for next poll
            self._offsets[path] = offset + complete
            for line in data[:complete].splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # torn by a SIGKILL mid-write
                self._apply(event)

    def _apply(self, event: dict[str, Any]) -> None:
        key = (int(event["pid"]), int(event.get("seq", -1)))
        if event["k"] == "start":
            delivery = Delivery(
                str(event["id"]),
                int(event["copy"]),
                int(event["pid"]),
                float(event["t"]),
                slow=bool(event.get("slow")),
                relay=int(event.get("relay", 0)),
            )
            self._open[key] = delivery
            self.deliveries.append(delivery)
        elif event["k"] == "done" and key in self._open:
            delivery = self._open.pop(key)
            delivery.end_s = float(event["t"])
            delivery.verdict = str(event["v"])
        elif event["k"] == "kill":
            # The crash marker: this worker held this message, committed, and died unacked.
            if event.get("where") == "after_publish_before_delete":
                self.relay_self_kills += 1
            else:
                self.self_kills += 1
            if event.get("id") is not None:
                self.crash_marked.add((int(event["pid"]), str(event["id"])))
            self._died(int(event["pid"]), float(event["t"]))

    # -- derived -----------------------------------------------------------------------------

    def attribute(self) -> Counter[str]:
        """Give every delivery after a message's first its cause; return counts per cause."""
        by_id: dict[str, list[Delivery]] = {}
        for delivery in sorted(self.deliveries, key=lambda d: d.start_s):
            by_id.setdefault(delivery.message_id, []).append(delivery)
        counts: Counter[str] = Counter({cause: 0 for cause in CAUSES})
        for copies in by_id.values():
            for n, delivery in enumerate(copies):
                if n == 0:
                    delivery.cause = None
                    continue
                delivery.cause = self._cause(delivery, copies[:n])
                counts[delivery.cause] += 1
        return counts

    def _cause(self, delivery: Delivery, earlier: list[Delivery]) -> str:
        same_copy = [d for d in earlier if (d.copy, d.relay) == (delivery.copy, delivery.relay)]
        if not same_copy:
            if delivery.relay and any(self._died_before(d.relay, delivery) for d in earlier):
                return "crash"  # republished: the relay that published it first was killed
            return "partition"
        previous = same_copy[-1]
        if self.cut_off(previous) and delivery.pid not in self.cut_pids:
            # Handed to another host while its holder was off the network, whatever the holder
            # made of it once it was back (a handler error, a refused complete).
            return "cut"
        if previous.verdict in _RETRY_VERDICTS:
            return "retry"
        if (previous.pid, previous.message_id) in self.crash_marked:
            return "crash"  # its worker said so before dying with the message unacked
        killed_s = self.killed_at_s.get(previous.pid)
        died_first = killed_s is not None and killed_s <= delivery.start_s
        if previous.end_s is None and died_first:
            return "crash"
        if previous.end_s is None or previous.end_s > delivery.start_s:
            return "slow"  # the broker gave up on a copy that was still running
        if died_first:
            return "crash"  # settled, but the ack/offset commit died with the worker
        if previous.slow:
            # Our log sees a delivery only once it reaches the guard: the broker may have
            # handed the copy out while the slow one ran, logged after the slow one finished.
            return "slow"
        return "other"

    def _died_before(self, pid: int, delivery: Delivery) -> bool:
        killed_s = self.killed_at_s.get(pid)
        return pid != 0 and killed_s is not None and killed_s <= delivery.start_s

    def suppressed_by_cause(self) -> Counter[str]:
        """Duplicate deliveries the guard answered DUPLICATE, by cause (after :meth:`attribute`):
        a duplicate delivered need not be one suppressed — a copy that met a live claim is
        answered IN_PROGRESS and comes back, and the first copy of a killed worker leaves no
        record, so a later copy does the work."""
        counts: Counter[str] = Counter({cause: 0 for cause in CAUSES})
        for d in self.deliveries:
            if d.verdict == "duplicate" and d.cause in CAUSES:
                counts[d.cause] += 1
        return counts

    def verdicts(self) -> Counter[str]:
        """Settled deliveries by the guard's verdict (``duplicate`` = suppressed)."""
        return Counter(d.verdict for d in self.deliveries if d.verdict is not None)

    def timeline(self, start_s: float, bucket_s: float) -> list[dict[str, int]]:
        """Per ``bucket_s`` since ``start_s``: deliveries, duplicates suppressed, kills."""
        points: dict[int, Counter[str]] = {}

        def add(at_s: float, what: str) -> None:
            points.setdefault(max(int((at_s - start_s) / bucket_s), 0), Counter())[what] += 1

        for d in self.deliveries:
            add(d.start_s, "deliveries")
            if d.verdict == "duplicate":
                add(d.end_s or d.start_s, "suppressed")
        for at_s in self.kill_times_s:
            add(at_s, "kills")
        last = max(points, default=0)
        return [
            {k: points.get(i, Counter())[k] for k in ("deliveries", "suppressed", "kills")}
            for i in range(last + 1)
        ]
