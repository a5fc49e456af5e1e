"""The second line of defence, on the business row: state machine and optimistic version CAS."""

from __future__ import annotations

from idemq.business.state_machine import StateMachine, Transition, TransitionResult
from idemq.business.versioned import versioned_update, versioned_update_async

__all__ = [
    "StateMachine",
    "Transition",
    "TransitionResult",
    "versioned_update",
    "versioned_update_async",
]
