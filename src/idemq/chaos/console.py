"""Rich rendering for ``idemq chaos``: a live progress bar, then the table and the verdict."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from idemq.chaos.plan import ChaosConfig
from idemq.chaos.result import ChaosResult
from idemq.chaos.result import Progress as Snapshot
from idemq.chaos.runner import run_chaos

__all__ = ["render_result", "run_with_progress"]

_CAUSE_WORDS = {
    "partition": "partition → confirm timeout → producer retry",
    "slow": "slow consumer → broker redelivery",
    "crash": "worker killed before ack / offset commit",
    "cut": "host cut off the network → redelivery",
    "other": "other redeliveries (e.g. rebalance)",
}


def run_with_progress(config: ChaosConfig, console: Console) -> ChaosResult:
    """Run the scenario with a progress bar (applied / messages) on ``console``."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("applied", total=config.messages, detail="")

        def update(snapshot: Snapshot) -> None:
            bar.update(
                task,
                completed=snapshot.applied,
                detail=(
                    f"produced {snapshot.produced}  delivered {snapshot.delivered}"
                    f"  killed {snapshot.crashes}"
                ),
            )

        return run_chaos(config, update)


def render_result(result: ChaosResult, console: Console) -> None:
    """The summary table, the duplicate causes and the one-line verdict."""
    table = Table(title="idemq chaos" + ("" if result.guard else " (--no-guard)"))
    table.add_column("")
    table.add_column("count", justify="right")
    rows: list[tuple[str, object]] = [
        ("produced (distinct messages)", result.produced),
        ("delivered (incl. duplicates)", result.delivered),
        ("duplicate deliveries", result.duplicates_delivered),
        *((f"  from {_CAUSE_WORDS[k]}", v) for k, v in result.causes.items()),
        ("duplicates suppressed by idemq", result.duplicates_suppressed),
        ("applied", result.applied),
        ("lost", result.lost),
        ("unfinished (time limit reached)", result.unfinished),
        ("double-applied", result.double_applied),
        ("workers killed", result.crashes),
        ("throughput (applied/s)", result.throughput_per_s),
    ]
    if result.two_hop:
        rows += [
            ("second hop: orders shipped", result.shipped),
            ("  shipped more than once", result.double_shipped),
            ("  paid, never shipped", result.unshipped),
            ("  shipped, never paid", result.shipped_unpaid),
            ("  outbox rows left", result.outbox_pending),
            (
                "  relays killed after publish, before delete",
                result.injected.get("relay_kills_after_publish_before_delete", 0),
            ),
        ]
    for label, value in rows:
        table.add_row(label, str(value))
    console.print(table)
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if result.ok:
        both = " and shipped exactly once" if result.two_hop else ""
        console.print(
            f"[bold green]✓ every message applied exactly once{both}[/bold green] "
            f"({result.seconds:.1f} s)"
        )
    else:
        second = (
            f", {result.double_shipped} shipped more than once, {result.unshipped} never"
            if result.two_hop
            else ""
        )
        console.print(
            f"[bold red]✗ {result.lost} lost, {result.double_applied} applied more than "
            f"once, {result.unfinished} unfinished{second}[/bold red] ({result.seconds:.1f} s)"
        )
