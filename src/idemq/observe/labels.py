"""Safe metric and log labels: a small fixed vocabulary, never an error's text or a URL."""

from __future__ import annotations

from typing import Any

from idemq.errors import (
    InvalidInputError,
    LeaseLostError,
    PayloadMismatchError,
    StoreError,
    StoreUnavailableError,
)
from idemq.guard.core import Outcome


def outcome_label(outcome: Outcome[Any] | None, error: BaseException | None) -> str:
    """``processed``, ``duplicate``, ``in_progress``, ``payload_mismatch`` or ``error``."""
    if outcome is not None:
        if outcome.error is not None:  # a FAILED message of process_batch
            error = outcome.error
        else:
            return outcome.status.value
    return "payload_mismatch" if isinstance(error, PayloadMismatchError) else "error"


def error_kind(error: BaseException) -> str:
    """A small, fixed vocabulary for an error (a safe metric label, unlike the error's text)."""
    if isinstance(error, PayloadMismatchError):
        return "payload_mismatch"
    if isinstance(error, InvalidInputError):
        return "invalid_message"
    if isinstance(error, LeaseLostError):
        return "lease_lost"
    if isinstance(error, StoreUnavailableError):
        return "store_unavailable"
    if isinstance(error, StoreError):
        return "store"
    return "handler"
