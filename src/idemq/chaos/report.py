"""``idemq chaos --report chaos.html``: one self-contained page (inline SVG, no CDN, no script).

Read top to bottom, as an operator would: the verdict, the invariants that decided it, then one
panel per series — deliveries, duplicates suppressed, workers killed, duplicate deliveries by
cause — each on its own scale, so a handful of kills is as readable as thousands of deliveries.
The counts and the run's notes come last.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from idemq.chaos.result import ChaosResult

__all__ = ["render_html", "write_report"]

# Panel geometry (SVG user units); every panel has the same frame so they line up in the grid.
_W, _H = 400, 160
_LEFT, _RIGHT, _TOP, _BOTTOM = 44, 12, 30, 28

# The rules of idemq.chaos.invariants, in the words of the report.
_INVARIANT_RULES = (
    ("double_debit", "no order debited twice"),
    ("missing_debit", "every paid order has its debit"),
    ("debit_unpaid", "no debit for an unpaid order"),
    ("debit_amount", "every debit has the order's amount and account"),
    ("shipped_unpaid", "nothing shipped without being paid"),
    ("balance_mismatch", "each balance = opening - its debits"),
    ("negative_balance", "no account below zero"),
)

_CAUSE_LABELS = {
    "partition": "partition → producer retry",
    "slow": "slow consumer → redelivery",
    "crash": "crash before ack",
    "cut": "host cut off",
    "other": "other redeliveries",
}


@dataclass(frozen=True)
class _Series:
    """One timeline series and how its panel draws it."""

    key: str
    title: str
    unit: str
    color: str
    area: bool  # a filled line for dense series; bars for sparse, discrete events


_TIMELINE = (
    _Series("deliveries", "Deliveries", "deliveries", "#4e79a7", area=True),
    _Series("suppressed", "Duplicates suppressed", "duplicates", "#59a14f", area=False),
    _Series("kills", "Workers killed", "kills", "#e15759", area=False),
)


def _nice_top(value: int) -> int:
    """The smallest 1, 2 or 5 times 10^k at or above ``value`` (an axis top a reader can read)."""
    top = 1
    while True:
        for step in (1, 2, 5):
            if step * top >= value:
                return step * top
        top *= 10


def _frame(title: str, top: int, span_s: float, bucket_s: float) -> list[str]:
    """Panel title, axes, the top and middle gridlines, and the time axis labels."""
    bottom_y, right_x = _H - _BOTTOM, _W - _RIGHT
    mid_y = (_TOP + bottom_y) / 2
    return [
        f'<text x="{_LEFT}" y="18" class="ptitle">{html.escape(title)}</text>',
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{right_x}" y2="{_TOP}" class="grid"/>',
        f'<line x1="{_LEFT}" y1="{mid_y:.1f}" x2="{right_x}" y2="{mid_y:.1f}" class="grid"/>',
        f'<line x1="{_LEFT}" y1="{bottom_y}" x2="{right_x}" y2="{bottom_y}" class="axis"/>',
        f'<text x="{_LEFT - 6}" y="{_TOP + 4}" class="tick" text-anchor="end">{top}</text>',
        # A half-way label only where it is a whole count (kills: 0, 1, 2 — never 0.5).
        f'<text x="{_LEFT - 6}" y="{mid_y + 4:.1f}" class="tick" text-anchor="end">'
        f"{top // 2 if top % 2 == 0 else ''}</text>",
        f'<text x="{_LEFT - 6}" y="{bottom_y + 4}" class="tick" text-anchor="end">0</text>',
        f'<text x="{_LEFT}" y="{_H - 8}" class="tick">0 s</text>',
        f'<text x="{(_LEFT + right_x) / 2}" y="{_H - 8}" class="tick" text-anchor="middle">'
        f"per {bucket_s:g} s</text>",
        f'<text x="{right_x}" y="{_H - 8}" class="tick" text-anchor="end">{span_s:.0f} s</text>',
    ]


def _svg(label: str, body: Sequence[str], name: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="{html.escape(label)}" data-panel="{name}">' + "".join(body) + "</svg>"
    )


def _timeline_panel(series: _Series, values: Sequence[int], bucket_s: float) -> str:
    """One series over time on its own y scale: bars per bucket, or a filled line."""
    total = sum(values)
    top = _nice_top(max(values, default=0))
    span_s = len(values) * bucket_s
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    slot = plot_w / max(len(values), 1)
    bottom_y = _H - _BOTTOM

    def y(value: int) -> float:
        return bottom_y - plot_h * value / top

    title = f"{series.title}: {total}"
    body = _frame(title, top, span_s, bucket_s)
    if total == 0:
        body.append(
            f'<text x="{_W / 2}" y="{_TOP + plot_h / 2}" class="none" text-anchor="middle">'
            f"none in this run</text>"
        )
        return _svg(title, body, series.key)
    marks = [f'<g data-series="{series.key}" fill="{series.color}" stroke="{series.color}">']
    if series.area:
        points = [f"{_LEFT + (i + 0.5) * slot:.1f},{y(v):.1f}" for i, v in enumerate(values)]
        first_x, last_x = _LEFT + 0.5 * slot, _LEFT + (len(values) - 0.5) * slot
        marks.append(
            f'<polygon fill-opacity="0.25" stroke="none" points="{first_x:.1f},{bottom_y} '
            f'{" ".join(points)} {last_x:.1f},{bottom_y}"/>'
            f'<polyline fill="none" stroke-width="2" points="{" ".join(points)}"/>'
        )
    else:
        width = max(slot * 0.7, 1.5)
        for i, value in enumerate(values):
            if value:
                marks.append(
                    f'<rect x="{_LEFT + i * slot + (slot - width) / 2:.1f}" y="{y(value):.1f}" '
                    f'width="{width:.1f}" height="{bottom_y - y(value):.1f}" stroke="none">'
                    f"<title>{i * bucket_s:g} to {(i + 1) * bucket_s:g} s: {value} "
                    f"{series.unit}</title></rect>"
                )
    marks.append("</g>")
    return _svg(title, body + marks, series.key)


def _causes_panel(result: ChaosResult) -> str:
    """Per cause, the duplicate deliveries and (below each) those the guard answered DUPLICATE,
    one horizontal bar each, on the panel's own scale."""
    causes = [
        (k, result.causes.get(k, 0), result.suppressed_causes.get(k, 0)) for k in _CAUSE_LABELS
    ]
    top = _nice_top(max((n for _, n, _ in causes), default=0))
    label_w, bar_left = 170, 178
    bar_w = _W - bar_left - 40
    row_h = (_H - _TOP - 10) / len(causes)
    title = (
        f"Duplicate deliveries by cause: {result.duplicates_delivered} "
        f"(the lighter bar: answered DUPLICATE)"
    )
    body = [f'<text x="{_LEFT}" y="18" class="ptitle">{html.escape(title)}</text>']
    delivered_bars: list[str] = []
    suppressed_bars: list[str] = []
    for i, (key, count, suppressed) in enumerate(causes):
        mid = _TOP + (i + 0.5) * row_h
        body.append(
            f'<text x="{label_w}" y="{mid + 4:.1f}" class="tick" text-anchor="end">'
            f"{html.escape(_CAUSE_LABELS[key])}</text>"
        )
        for bars, value, y0, what in (
            (delivered_bars, count, mid - row_h * 0.32, "delivered"),
            (suppressed_bars, suppressed, mid + row_h * 0.02, "answered DUPLICATE"),
        ):
            if value:
                bars.append(
                    f'<rect x="{bar_left}" y="{y0:.1f}" width="{bar_w * value / top:.1f}" '
                    f'height="{row_h * 0.3:.1f}"><title>{value} {what}, from {key}</title></rect>'
                )
        body.append(
            f'<text x="{bar_left + bar_w * count / top + 4:.1f}" y="{mid + 4:.1f}" '
            f'class="tick">{count} / {suppressed}</text>'
        )
    body.append('<g data-series="causes" fill="#f28e2b">')
    body += delivered_bars
    body.append("</g>")
    if suppressed_bars:  # an empty series has nothing to show in the browser
        body.append('<g data-series="suppressed-causes" fill="#59a14f">')
        body += suppressed_bars
        body.append("</g>")
    return _svg(title, body, "causes")


def _invariants(result: ChaosResult) -> list[tuple[str, str, bool]]:
    """(rule, what was measured, held?) for every invariant the run checked."""
    rows = [
        (
            "no message lost",
            f"{result.applied} of {result.produced} produced applied",
            result.lost == 0,
        ),
        (
            "the run finished",
            "within its time limit"
            if not result.timed_out
            else f"stopped by its time limit with {result.unfinished} not applied yet",
            not result.timed_out,
        ),
        (
            "no message applied twice",
            f"{result.double_applied} applied more than once",
            result.double_applied == 0,
        ),
        (
            "money agrees",
            f"debited {result.debited_cents:,} ¢, owed {result.owed_cents:,} ¢",
            result.debited_cents == result.owed_cents,
        ),
    ]
    violations = result.invariant_violations
    for kind, rule in _INVARIANT_RULES:
        broken = violations.get(kind, 0)
        rows.append((rule, f"{broken} violation{'s' * (broken != 1)}", broken == 0))
    rows.extend(
        (kind, f"{count} violations", False)
        for kind, count in violations.items()
        if kind not in dict(_INVARIANT_RULES)
    )
    return rows


def _rows(pairs: Sequence[tuple[str, object]]) -> str:
    return "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in pairs
    )


def _verdict(result: ChaosResult) -> str:
    if result.ok:
        headline = "✓ every message applied exactly once"
    else:
        headline = f"✗ {result.lost} lost, {result.double_applied} applied more than once" + (
            f", {result.unfinished} unfinished (time limit)" if result.unfinished else ""
        )
    guard = "idemq" if result.guard else "none (--no-guard)"
    summary = (
        f"{result.produced} messages, {result.delivered} deliveries "
        f"({result.duplicates_delivered} duplicates, {result.duplicates_suppressed} answered "
        f"DUPLICATE), {result.crashes} workers killed, in {result.seconds:g} s · "
        f"broker {result.broker} · store {result.store} · guard {guard}"
    )
    css = "ok" if result.ok else "fail"
    return (
        f'<section class="verdict {css}" id="verdict"><h1>{html.escape(headline)}</h1>'
        f"<p>{html.escape(summary)}</p></section>"
    )


_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1240px;padding:0 1em;color:#222}
.verdict{padding:.6em 1em;border-radius:6px;color:#fff}
.verdict h1{margin:.1em 0;font-size:1.6em}.verdict p{margin:.2em 0 .3em}
.ok{background:#2e7d32}.fail{background:#c62828}
.grid2{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:1em 2em;margin-top:1em}
.panels{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:.5em 2em;margin-top:1em}
.panels svg{width:100%;height:auto;border:1px solid #e3e3e3;border-radius:4px}
h2{font-size:1.1em;margin:.2em 0}
table{border-collapse:collapse;width:100%}th,td{padding:2px 8px;border-bottom:1px solid #e6e6e6}
th{text-align:left;font-weight:normal;color:#444}td{text-align:right}
td.held{color:#2e7d32}td.broken{color:#c62828;font-weight:bold}
.ptitle{font-size:13px;font-weight:600;fill:#333}.tick{font-size:11px;fill:#555}
.none{font-size:13px;fill:#888}.grid{stroke:#eee}.axis{stroke:#999}
"""


def render_html(result: ChaosResult) -> str:
    """The report page as a string."""
    invariants = "".join(
        f"<tr><th>{html.escape(rule)}</th><td>{html.escape(measured)}</td>"
        f'<td class="{"held" if held else "broken"}">{"held" if held else "BROKEN"}</td></tr>'
        for rule, measured, held in _invariants(result)
    )
    counts: list[tuple[str, object]] = [
        ("produced", result.produced),
        ("delivered", result.delivered),
        ("duplicate deliveries", result.duplicates_delivered),
        ("duplicates suppressed by the guard", result.duplicates_suppressed),
        ("applied", result.applied),
        ("workers killed", result.crashes),
        ("throughput (applied/s)", result.throughput_per_s),
        *((f"injected: {k}", v) for k, v in result.injected.items()),
    ]
    points = result.timeline or [{s.key: 0 for s in _TIMELINE}]
    panels = [
        _timeline_panel(s, [p.get(s.key, 0) for p in points], result.bucket_s) for s in _TIMELINE
    ]
    panels.append(_causes_panel(result))
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in result.notes)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>idemq chaos report</title><style>{_STYLE}</style></head><body>
{_verdict(result)}
<div class="grid2">
<section><h2>Invariants checked (from the business ledger)</h2><table>{invariants}</table></section>
<section><h2>Counts</h2><table>{_rows(counts)}</table></section>
</div>
<div class="panels">{"".join(panels)}</div>
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
</body></html>
"""


def write_report(result: ChaosResult, path: str | Path) -> Path:
    """Write :func:`render_html` to ``path`` and return it."""
    target = Path(path)
    target.write_text(render_html(result), encoding="utf-8")
    return target
