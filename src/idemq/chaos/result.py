"""The outcome of a chaos run: counts, causes, verdict, and the JSON of ``idemq chaos --json``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ChaosResult", "Progress"]


@dataclass(frozen=True)
class Progress:
    """A snapshot while the run goes (what the progress bar shows)."""

    produced: int
    target: int
    applied: int
    delivered: int
    crashes: int
    elapsed_s: float


@dataclass
class ChaosResult:
    """Everything ``idemq chaos`` reports; ``ok`` is the invariant verdict.

    ``produced`` counts distinct messages, ``delivered`` every delivery (duplicates included),
    ``applied`` distinct messages with their effect in the ledger, ``lost`` = produced - applied
    on a run that finished, ``unfinished`` the same on a run its time limit cut short (those may
    still be queued: not lost, not proven either), ``double_applied`` messages whose effect
    landed more than once, ``crashes`` workers killed.
    """

    broker: str
    store: str
    guard: bool
    messages: int
    workers: int
    produced: int = 0
    delivered: int = 0
    duplicates_delivered: int = 0
    duplicates_suppressed: int = 0
    retries: int = 0
    applied: int = 0
    lost: int = 0
    unfinished: int = 0  # not applied when the run hit its time limit: still queued, not lost
    double_applied: int = 0
    extra_effects: int = 0  # ledger rows beyond one per message
    debited_cents: int = 0  # what the ledger took from the accounts
    owed_cents: int = 0  # what the produced orders cost: equal when nothing is double-applied
    crashes: int = 0
    causes: dict[str, int] = field(default_factory=dict)
    suppressed_causes: dict[str, int] = field(default_factory=dict)  # answered DUPLICATE, by cause
    injected: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    invariant_violations: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    throughput_per_s: float = 0.0
    timed_out: bool = False
    # Two-hop runs (pay → outbox → relay → ship): orders shipped, shipped more than once,
    # paid but never shipped (on a run that finished), shipped though never paid, rows left.
    two_hop: bool = False
    shipped: int = 0
    double_shipped: int = 0
    unshipped: int = 0
    shipped_unpaid: int = 0
    extra_shipments: int = 0
    outbox_pending: int = 0
    # Several-hosts runs (--hosts N): messages the cut host held when it went off the network,
    # and how many of those another host then ran.
    hosts: int = 0
    cut_held: int = 0
    cut_retaken: int = 0
    notes: list[str] = field(default_factory=list)
    timeline: list[dict[str, int]] = field(default_factory=list)
    bucket_s: float = 1.0

    @property
    def ok(self) -> bool:
        """The invariant: no message lost, none applied twice — on a run that finished (one cut
        short by its time limit proves neither, and is never ok); two hops: each paid order
        shipped once."""
        one_hop = self.lost == 0 and self.double_applied == 0 and self.unfinished == 0
        second = self.double_shipped == 0 and self.unshipped == 0 and self.shipped_unpaid == 0
        # Cut short before the producer got far, a run can have nothing unfinished and still
        # have proved nothing about the messages it never sent.
        return one_hop and second and not self.timed_out

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object (shared/DESIGN.md), the timeline left out."""
        data = asdict(self)
        data.pop("timeline")
        data.pop("bucket_s")
        data["ok"] = self.ok
        return data
