"""``idemq worker``: a handler behind the guard on any broker, every delivery settled once."""

from __future__ import annotations

from idemq.worker.loop import Guard, Handler, Worker
from idemq.worker.run import load_handler, open_guard, run_worker
from idemq.worker.settle import WorkerStats

__all__ = ["Guard", "Handler", "Worker", "WorkerStats", "load_handler", "open_guard", "run_worker"]
