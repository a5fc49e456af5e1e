"""What the workers saw, written as they saw it — and why each duplicate delivery happened.

Every worker process appends JSON lines to its own file (``events-<pid>.jsonl``): one
``start`` when a delivery reaches the guard, one ``done`` when it was settled, and ``kill``
when the worker shoots itself between commit and ack. Files, not a multiprocessing queue: a
process SIGKILLed while holding a queue's shared write lock would deadlock every other writer,
and a half-written last line is simply skipped by the reader.

:class:`Tally` replays the events and attributes every delivery after a message's first one:

* ``partition`` — a copy the broker got from a producer retry (a new ``copy`` number);
* ``slow``      — the same copy again while its previous delivery was still running;
* ``crash``     — the same copy again after the worker holding it was killed before settling;
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

__all__ = ["CAUSES", "COPY_HEADER", "Delivery", "EventLog", "Tally"]

COPY_HEADER = "idemq-chaos-copy"
"""Publish attempt that produced this broker copy (1 = first); set by the chaos producer."""

CAUSES = ("partition", "slow", "crash", "other")
_RETRY_VERDICTS = frozenset({"in_progress", "handler_error", "store_unavailable"})


class EventLog:
    """Append-only JSON-lines file of one worker process (thread-safe)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"events-{os.getpid()}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        """One event; ``os.write`` of one line, so a kill leaves at most one partial line."""
        line = json.dumps({"k": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())

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
    cause: str | None = None  # None for a message's first delivery


@dataclass
class Tally:
    """Incremental reader of every worker's events, plus the supervisor's kills."""

    directory: Path
    killed_at_s: dict[int, float] = field(default_factory=dict)  # pid → when it was seen dead
    kill_times_s: list[float] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    self_kills: int = 0
    _open: dict[tuple[int, int], Delivery] = field(default_factory=dict)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def kill(self, pid: int, at_s: float) -> None:
        """The supervisor saw worker ``pid`` die from a kill at ``at_s``."""
        self.killed_at_s[pid] = at_s
        self.kill_times_s.append(at_s)

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
            )
            self._open[key] = delivery
            self.deliveries.append(delivery)
        elif event["k"] == "done" and key in self._open:
            delivery = self._open.pop(key)
            delivery.end_s = float(event["t"])
            delivery.verdict = str(event["v"])
        elif event["k"] == "kill":
            self.self_kills += 1

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
        same_copy = [d for d in earlier if d.copy == delivery.copy]
        if not same_copy:
            return "partition"
        previous = same_copy[-1]
        if previous.verdict in _RETRY_VERDICTS:
            return "retry"
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
