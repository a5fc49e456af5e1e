"""``idemq demo``: the three causes of duplicates, produced for real, on SQLite — no servers.

A thin preset of :func:`idemq.chaos.run_chaos`: the order service on an embedded at-least-once
queue (a SQLite file with a visibility timeout) and a SQLite ledger that also holds the dedup
table, with worker *processes*. Along the way duplicates are made the way production makes them:

1. **partition → confirm timeout → producer retry**: for some messages the producer never hears
   the confirm and publishes the same message id again;
2. **slow consumer → redelivery**: some handlers outlast the queue's visibility timeout, so the
   queue hands the same message to another worker while the first copy still runs;
3. **crash before the ack**: workers are SIGKILLed, some right after their transaction
   committed and before they acknowledged; the message comes back after the restart.

Each payment also adds a ``ship`` message to the transactional outbox in the same transaction
(the second hop): an outbox relay process publishes it to a second queue, and ship workers
consume it. Relays and ship workers are killed like the payment workers.

At the end the ledger is checked: every order paid exactly once and shipped exactly once
(``--no-guard`` runs the same workload without idemq, so the double payments and double
shipments it prevents are visible).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from idemq.chaos.plan import ChaosConfig
from idemq.chaos.result import ChaosResult, Progress
from idemq.chaos.runner import run_chaos

__all__ = [
    "DemoConfig",
    "DemoReport",
    "default_directory",
    "demo_directory",
    "intro",
    "render_report",
    "run_demo",
]

ACCOUNTS = 4
OPENING_BALANCE_CENTS = 25_000_000  # per account: readable numbers in the balance row


@dataclass(frozen=True)
class DemoConfig:
    """Knobs of the demo (the defaults finish in well under a minute on 2 cores)."""

    directory: Path
    orders: int = 200
    workers: int = 3
    guard: bool = True
    partition_rate: float = 0.08  # cause 1: share of publishes whose confirm is lost
    slow_rate: float = 0.05  # cause 2: share of deliveries that outlast the visibility timeout
    kill_every_s: float = 1.0  # cause 3: a worker is SIGKILLed this often
    seed: int = 7
    ship_workers: int = 1  # second hop: consumers of the ship queue
    relays: int = 1  # second hop: outbox relay processes

    def chaos(self) -> ChaosConfig:
        """The chaos run this demo is."""
        return ChaosConfig(
            broker_url=f"embedded:///{self.directory.resolve() / 'queue.db'}",
            store_url=f"sqlite:///{self.directory.resolve() / 'ledger.db'}",
            messages=self.orders,
            workers=self.workers,
            kill_every_s=self.kill_every_s,
            slow_rate=self.slow_rate,
            partition_rate=self.partition_rate,
            guard=self.guard,
            directory=self.directory,
            timeout_s=55.0,
            seed=self.seed,
            keep=True,  # removing it is demo_directory's call (idemq demo --keep)
            accounts=ACCOUNTS,
            opening_balance_cents=OPENING_BALANCE_CENTS,
            two_hop=True,
            ship_workers=self.ship_workers,
            relays=self.relays,
        )


@dataclass
class DemoReport:
    """What happened, and the verdict on the ledger."""

    produced: int = 0
    published: int = 0
    duplicates_published: int = 0
    crashes: int = 0
    payments: int = 0
    double_paid: int = 0
    lost: int = 0
    balance: int = 0
    expected_balance: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    causes: dict[str, int] = field(default_factory=dict)
    duplicates_delivered: int = 0
    duplicates_suppressed: int = 0
    seconds: float = 0.0
    # The second hop: payment → outbox → relay → ship queue → shipment.
    shipments: int = 0
    shipped: int = 0
    double_shipped: int = 0
    unshipped: int = 0
    shipped_unpaid: int = 0
    outbox_left: int = 0
    relay_kills: int = 0
    # Whether idemq guarded the run: the counts mean different things without it (--no-guard).
    guard: bool = True

    @property
    def ok(self) -> bool:
        """Every order paid exactly once and shipped exactly once, and the money agrees."""
        paid = self.double_paid == 0 and self.lost == 0 and self.balance == self.expected_balance
        shipped = self.double_shipped == self.unshipped == self.shipped_unpaid == 0
        return paid and shipped

    @classmethod
    def from_result(cls, result: ChaosResult, *, guard: bool = True) -> DemoReport:
        """Translate a chaos result into the demo's words (``guard``: was idemq on)."""
        opening = ACCOUNTS * OPENING_BALANCE_CENTS
        retries = result.injected.get("producer_retries", 0)
        return cls(
            produced=result.produced,
            published=result.produced + retries,
            duplicates_published=retries,
            crashes=result.crashes,
            payments=result.applied + result.extra_effects,
            double_paid=result.double_applied,
            lost=result.lost,
            balance=opening - result.debited_cents,
            expected_balance=opening - result.owed_cents,
            outcomes=dict(result.verdicts),
            causes=dict(result.causes),
            duplicates_delivered=result.duplicates_delivered,
            duplicates_suppressed=result.duplicates_suppressed,
            seconds=result.seconds,
            shipments=result.shipped + result.extra_shipments,
            shipped=result.shipped,
            double_shipped=result.double_shipped,
            unshipped=result.unshipped,
            shipped_unpaid=result.shipped_unpaid,
            outbox_left=result.outbox_pending,
            relay_kills=result.injected.get("relay_kills_after_publish_before_delete", 0),
            guard=guard,
        )


def run_demo(config: DemoConfig, progress: Callable[[str], None] = lambda _: None) -> DemoReport:
    """Run the story and return the report (the CLI renders it); ``progress`` gets plain words."""
    told = {"produced": False, "kills": 0}

    def narrate(snapshot: Progress) -> None:
        if not told["produced"] and snapshot.produced >= snapshot.target:
            told["produced"] = True
            progress(f"producer: all {snapshot.target} orders published")
        if snapshot.crashes > told["kills"]:
            told["kills"] = snapshot.crashes
            progress(
                f"supervisor: worker killed ({snapshot.crashes} so far) and restarted; "
                f"{snapshot.applied}/{snapshot.target} orders paid"
            )

    result = run_chaos(config.chaos(), narrate)
    causes = result.causes
    progress(
        f"duplicates delivered: {causes.get('partition', 0)} from producer retries after a lost "
        f"confirm, {causes.get('slow', 0)} redelivered while a slow handler still ran, "
        f"{causes.get('crash', 0)} redelivered after a worker died before its ack"
    )
    if config.guard:
        progress(
            f"idemq answered {result.duplicates_suppressed} of them with DUPLICATE: "
            "the dedup row committed with the first payment, so no second one"
        )
    else:
        progress(f"without idemq, {result.double_applied} orders were paid more than once")
    progress(
        f"second hop: {result.shipped} of {result.produced} orders shipped through the outbox "
        f"and its relay, {result.double_shipped} of them more than once"
    )
    return DemoReport.from_result(result, guard=config.guard)


def intro(config: DemoConfig) -> str:
    """The story told before the run (rich markup)."""
    guard = "[green]idemq[/green]" if config.guard else "[red]none (--no-guard)[/red]"
    return (
        "Three things make brokers deliver a message twice. This demo makes all three happen "
        "for real:\n"
        "  1. [bold]producer retry[/bold]: the publish confirm is lost, the producer publishes "
        "the same message again;\n"
        "  2. [bold]slow consumer[/bold]: a handler outlasts the queue's visibility timeout and "
        "the queue hands the message to another worker;\n"
        "  3. [bold]crash before ack[/bold]: workers are killed, some right after their payment "
        "committed, before they acknowledged.\n"
        "Each payment also writes a [bold]ship[/bold] message to the outbox in its transaction; "
        "a relay publishes it to a second queue, where ship workers consume it (the second "
        "hop; relays and ship workers are killed too).\n"
        f"Queue and ledger (SQLite) in {config.directory}; guard: {guard}"
    )


def render_report(report: DemoReport, console: Console) -> None:
    """The counts, what each one means, and the verdict, wrapped to ``console``'s width."""
    table = Table(title="What happened")
    table.add_column("")
    table.add_column("count", justify="right", no_wrap=True)
    table.add_row("orders produced", str(report.produced))
    table.add_row("messages published (incl. producer retries)", str(report.published))
    table.add_row("workers killed", str(report.crashes))
    table.add_row("duplicates delivered", str(report.duplicates_delivered))
    for cause, count in report.causes.items():
        if count or cause != "other":
            table.add_row(f"  from {cause}", str(count))
    for kind, count in sorted(report.outcomes.items()):
        table.add_row(f"deliveries answered {kind.upper()}", str(count))
    table.add_row("duplicates suppressed", str(report.duplicates_suppressed))
    table.add_row("payments in the ledger", str(report.payments))
    table.add_row("orders paid more than once", str(report.double_paid))
    table.add_row("orders never paid", str(report.lost))
    table.add_row("balance / expected (cents)", f"{report.balance:,} / {report.expected_balance:,}")
    table.add_row("second hop: shipments recorded", str(report.shipments))
    table.add_row("orders shipped more than once", str(report.double_shipped))
    table.add_row("paid orders never shipped", str(report.unshipped))
    table.add_row("relays killed after a publish, before its delete", str(report.relay_kills))
    table.add_row("outbox rows left", str(report.outbox_left))
    console.print(table)
    console.print("[bold]What the counts mean[/bold]")
    for line in _meanings(report):
        console.print(f"• {line}")
    if report.ok:
        console.print(
            "[bold green]✓ every order paid exactly once and shipped exactly once[/bold green]"
            f" ({report.seconds:.1f} s)"
        )
    else:
        console.print(
            f"[bold red]✗ {report.double_paid} orders paid more than once, "
            f"{report.lost} never; {report.double_shipped} shipped more than once, "
            f"{report.unshipped} never[/bold red] ({report.seconds:.1f} s)"
        )


def _meanings(report: DemoReport) -> list[str]:
    """One sentence per count a reader would ask about (rich markup)."""
    causes = report.causes
    lines = [
        f"[bold]messages published[/bold]: {report.produced} orders plus "
        f"{report.duplicates_published} producer retries, each with an id already sent "
        "(its confirm was lost).",
        f"[bold]duplicates delivered[/bold] ({report.duplicates_delivered}): deliveries of a "
        f"message delivered before. {causes.get('partition', 0)} came from those retries, "
        f"{causes.get('slow', 0)} from handlers that outlasted the queue's visibility timeout "
        f"(the queue handed the message on), {causes.get('crash', 0)} from workers killed "
        "before their ack.",
    ]
    if report.guard:
        lines.append(
            f"[bold]duplicates suppressed[/bold] ({report.duplicates_suppressed}) is at most the "
            "duplicates delivered: when the first copy's worker died before its commit, nothing "
            "was recorded, so a later copy is the one that pays (PROCESSED); a copy that came "
            "while its twin still ran was answered IN_PROGRESS (not acked, delivered again)."
        )
    else:
        lines.append(
            f"[bold]duplicates suppressed[/bold] ({report.duplicates_suppressed}): without idemq "
            "(--no-guard) nothing recognises a copy, so every duplicate delivered that reached "
            f"a handler paid again: {report.double_paid} orders paid more than once."
        )
    if report.outcomes.get("duplicate"):
        lines.append(
            "[bold]DUPLICATE[/bold]: the dedup row committed with the first payment was "
            "already there, so the delivery was acked without paying again."
        )
    lines.append(
        "[bold]balance / expected[/bold]: what is left in the accounts, against the opening "
        "balance minus each order's price once. Equal only if no order was paid twice (money "
        "would be missing) and none was skipped (money never taken)."
    )
    hop = (
        f"[bold]second hop[/bold]: each payment added its ship message to the outbox in the "
        f"same transaction, so a payment that rolled back sent nothing and one that committed "
        f"cannot lose it. {report.shipments} shipments for {report.produced} orders: a relay "
        f"killed after publishing and before deleting the row ({report.relay_kills} times) "
        "makes another relay publish it again with the same id, "
    )
    if report.guard:
        hop += "and the ship consumer's dedup row answers that copy DUPLICATE."
    else:
        # Without idemq no dedup row exists: saying one answered would contradict the counts.
        hop += (
            "and without idemq the ship consumer has no dedup row to recognise it, nor the "
            f"producer retries and redeliveries: {report.double_shipped} orders shipped more "
            "than once."
        )
    lines.append(hop)
    return lines


def default_directory() -> Path:
    """A fresh temporary directory for the queue and ledger files."""
    return Path(tempfile.mkdtemp(prefix="idemq-demo-"))


@contextmanager
def demo_directory(given: Path | None, *, keep: bool) -> Iterator[Path]:
    """The directory of a demo run: ``given`` (the user's, never removed), else a fresh temp
    directory, removed afterwards unless ``keep`` (``idemq demo --keep``)."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    directory = default_directory()
    try:
        yield directory
    finally:
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
