"""The order service's invariant checker — lives in :mod:`idemq.chaos.invariants` (the chaos
runner's verdict uses it); re-exported here."""

from idemq.chaos.invariants import InvariantReport, Violation, check_invariants

__all__ = ["InvariantReport", "Violation", "check_invariants"]
