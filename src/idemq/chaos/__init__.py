"""``idemq chaos``: produce the three causes of duplicates for real and check the ledger.

* :mod:`~idemq.chaos.proxy`      — :class:`FaultProxy`, the half-partitioning TCP proxy (cause 1)
* :mod:`~idemq.chaos.faults`     — per-broker timers and the partitionable producer
* :mod:`~idemq.chaos.worker`     — one worker process: real guard, slow handlers, armed kills
* :mod:`~idemq.chaos.supervisor` — restarts workers, kills one every ``kill_every_s`` (cause 3)
* :mod:`~idemq.chaos.events`     — what workers saw, and which cause made each duplicate
* :mod:`~idemq.chaos.runner`     — :func:`run_chaos`: the whole scenario, section by section:
  :mod:`~idemq.chaos.plan` (configuration), :mod:`~idemq.chaos.stage` (set-up and cleanup),
  :mod:`~idemq.chaos.production`, :mod:`~idemq.chaos.supervision`, :mod:`~idemq.chaos.verdict`
* :mod:`~idemq.chaos.orders`, :mod:`~idemq.chaos.invariants` — the order service it drives
* :mod:`~idemq.chaos.report`, :mod:`~idemq.chaos.console` — HTML report, rich output
"""

from idemq.chaos.plan import ChaosConfig
from idemq.chaos.proxy import FaultProxy
from idemq.chaos.report import render_html, write_report
from idemq.chaos.result import ChaosResult, Progress
from idemq.chaos.runner import run_chaos

__all__ = [
    "ChaosConfig",
    "ChaosResult",
    "FaultProxy",
    "Progress",
    "render_html",
    "run_chaos",
    "write_report",
]
