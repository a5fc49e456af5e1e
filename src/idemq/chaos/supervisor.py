"""Keeps the run's processes alive while killing one every ``kill_every_s`` (cause 3).

One process per slot, each with its :class:`~idemq.chaos.worker.WorkerSpec`: the W workers of
the first hop and, in a two-hop run, the second hop's workers and the outbox relays. Each kill
tick picks a random live process and, alternately (armed first: a run with one kill still makes
a duplicate),

* SIGKILLs it at once — a random point: mid-handler, mid-commit, between commit and ack, idle;
* or *arms* it (SIGUSR1): it SIGKILLs itself at its next ack, i.e. right after the business
  commit and before the broker hears of it — the case that makes a duplicate for sure (an armed
  relay: right after a confirmed publish, before the row is deleted). An armed process that
  does not get there within ``arm_timeout_s`` is SIGKILLed anyway.

Dead workers are restarted at once (a fork server with idemq preloaded makes that cheap).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from idemq.chaos import worker as chaos_worker

__all__ = ["ProcessHandle", "Supervisor"]

_PRELOAD = ["idemq.chaos.worker", "sqlalchemy"]


class ProcessHandle(Protocol):
    """What the supervisor needs of a process it started (a ``multiprocessing`` process, or a
    :class:`~idemq.chaos.hosts.HostProcess` on another host)."""

    @property
    def pid(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Supervisor:
    """Starts, watches, kills and restarts the worker processes (call :meth:`tick` often)."""

    specs: list[chaos_worker.WorkerSpec]  # one per slot: pay / ship workers and relays
    kill_every_s: float  # 0 = never
    on_death: Callable[[int, float, bool], None]  # (pid, when, killed by us)
    clock_s: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    arm_timeout_s: float = 3.0
    # A worker younger than this is spared: on Kafka, a consumer killed before its group
    # join completes never consumes at all, and the run would make no progress.
    min_uptime_s: float = 0.0
    killing: bool = True
    # Starts slot's process from its spec (default: a fork of the supervisor's fork server).
    spawn: Callable[[int, chaos_worker.WorkerSpec], ProcessHandle] | None = None
    kills: int = 0
    armed_kills: int = 0
    restarts: int = 0
    _procs: dict[int, ProcessHandle] = field(default_factory=dict)
    _born_s: dict[int, float] = field(default_factory=dict)  # slot → start time
    _doomed: dict[int, float] = field(default_factory=dict)  # pid → SIGKILL deadline
    _sigkilled_s: dict[int, float] = field(default_factory=dict)  # pid → wall time of our SIGKILL
    _next_kill_s: float = 0.0
    _turns: int = 0

    def __post_init__(self) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(_PRELOAD)

    def start(self) -> None:
        """Start every worker; the first kill comes ``kill_every_s`` later."""
        for slot in range(len(self.specs)):
            self._spawn(slot)
        self._next_kill_s = self.clock_s() + self.kill_every_s

    def _spawn(self, slot: int) -> None:
        proc: ProcessHandle
        if self.spawn is not None:
            proc = self.spawn(slot, self.specs[slot])
        else:
            forked = self._ctx.Process(
                target=chaos_worker.run, args=(self.specs[slot],), daemon=True
            )
            forked.start()
            proc = forked
        self._procs[slot] = proc
        self._born_s[slot] = self.clock_s()

    def tick(self) -> None:
        """Restart the dead, enforce armed deadlines, and kill when a tick is due."""
        now = self.clock_s()
        for slot, proc in list(self._procs.items()):
            pid = proc.pid or 0
            if proc.is_alive():
                deadline = self._doomed.get(pid)
                if deadline is not None and now >= deadline:
                    self._sigkill(pid)
                continue
            proc.join()
            killed = self._doomed.pop(pid, None) is not None
            # When the signal left, not when we noticed: the broker may hand the dead worker's
            # message to another one before this tick (an armed worker's own crash marker
            # dates its death in the events).
            self.on_death(pid, self._sigkilled_s.pop(pid, time.time()), killed)
            self.restarts += 1
            self._spawn(slot)
        if self.killing and self.kill_every_s > 0 and now >= self._next_kill_s:
            self._next_kill_s = now + self.kill_every_s
            self._kill_one(now)

    def _kill_one(self, now: float) -> None:
        # Roles in turn (pay workers, ship workers, relays), so each one is killed in a short
        # run too; with three roles and two kinds of kill, six kills cover every pair.
        roles = sorted({spec.role for spec in self.specs})
        role = roles[self._turns % len(roles)]
        self._turns += 1  # a turn whose role has nobody to kill still passes
        alive = [
            p.pid
            for slot, p in self._procs.items()
            if p.is_alive()
            and p.pid is not None
            and p.pid not in self._doomed
            and now - self._born_s[slot] >= self.min_uptime_s
            and self.specs[slot].role == role
        ]
        if not alive:
            return
        pid = self.rng.choice(alive)
        self.kills += 1
        # Alternate, so even a short run has both kinds (a coin could give only one), armed
        # first: it is the kill that makes a duplicate for sure, so a run with one kill has one.
        if self.kills % 2 == 1:
            self.armed_kills += 1
            self._doomed[pid] = now + self.arm_timeout_s
            self._signal(pid, signal.SIGUSR1)
        else:
            self._doomed[pid] = now
            self._sigkill(pid)

    def _sigkill(self, pid: int) -> None:
        self._sigkilled_s.setdefault(pid, time.time())
        self._signal(pid, signal.SIGKILL)

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):  # died meanwhile; tick() will notice
            os.kill(pid, sig)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM everyone (in-flight deliveries settle), SIGKILL whoever outlives ``grace_s``."""
        self.killing = False
        for proc in self._procs.values():
            if proc.is_alive() and proc.pid is not None:
                self._signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self._procs.values():
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs.clear()
