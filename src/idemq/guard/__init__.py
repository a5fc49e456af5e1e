"""The guard: :class:`Idempotency` and :class:`AsyncIdempotency`, and the outcome they return.

One message goes through one sans-I/O flow (:mod:`.flow`), a batch through another
(:mod:`.batch_flow`); what a claim means is decided in :mod:`.core`. The two shells only carry
out the steps, one with and one without ``await``.
"""

from __future__ import annotations

from idemq.guard.core import Mode, Outcome, Status
from idemq.guard.idempotency import Idempotency
from idemq.guard.idempotency_async import AsyncIdempotency

__all__ = ["AsyncIdempotency", "Idempotency", "Mode", "Outcome", "Status"]
