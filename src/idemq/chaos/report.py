"""``idemq chaos --report chaos.html``: one self-contained page (inline SVG, no CDN, no script).

The chart plots, per time bucket, deliveries, duplicates the guard suppressed, and workers
killed; the tables repeat the counts, causes and the verdict.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from idemq.chaos.result import ChaosResult

__all__ = ["render_html", "write_report"]

_SERIES = (("deliveries", "#4e79a7"), ("suppressed", "#59a14f"), ("kills", "#e15759"))
_W, _H, _PAD = 760, 260, 40


def _chart(result: ChaosResult) -> str:
    points = result.timeline or [{"deliveries": 0, "suppressed": 0, "kills": 0}]
    top = max(1, *(p[name] for p in points for name, _ in _SERIES))
    step = (_W - 2 * _PAD) / max(len(points) - 1, 1)

    def xy(i: int, value: int) -> str:
        x = _PAD + i * step
        y = _H - _PAD - (_H - 2 * _PAD) * value / top
        return f"{x:.1f},{y:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" role="img" aria-label="deliveries, suppressed, kills over time">',
        f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#999"/>',
        f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_H - _PAD}" stroke="#999"/>',
        f'<text x="{_PAD - 6}" y="{_PAD + 4}" text-anchor="end" font-size="11">{top}</text>',
        f'<text x="{_PAD - 6}" y="{_H - _PAD + 4}" text-anchor="end" font-size="11">0</text>',
        f'<text x="{_W - _PAD}" y="{_H - _PAD + 16}" text-anchor="end" font-size="11">'
        f"{len(points) * result.bucket_s:.0f} s</text>",
    ]
    for n, (name, color) in enumerate(_SERIES):
        line = " ".join(xy(i, p[name]) for i, p in enumerate(points))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{line}"/>')
        parts.append(
            f'<rect x="{_PAD + 10 + n * 130}" y="8" width="12" height="12" fill="{color}"/>'
            f'<text x="{_PAD + 26 + n * 130}" y="18" font-size="12">{name}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _rows(pairs: Sequence[tuple[str, object]]) -> str:
    return "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in pairs
    )


def render_html(result: ChaosResult) -> str:
    """The report page as a string."""
    verdict = (
        "every message applied exactly once"
        if result.ok
        else f"{result.lost} lost, {result.double_applied} applied more than once"
    )
    counts: list[tuple[str, object]] = [
        ("broker", result.broker),
        ("store", result.store),
        ("guard", "idemq" if result.guard else "none (--no-guard)"),
        ("produced", result.produced),
        ("delivered", result.delivered),
        ("duplicate deliveries", result.duplicates_delivered),
        ("duplicates suppressed by the guard", result.duplicates_suppressed),
        ("applied", result.applied),
        ("lost", result.lost),
        ("double-applied", result.double_applied),
        ("workers killed", result.crashes),
        ("seconds", result.seconds),
        ("throughput (applied/s)", result.throughput_per_s),
        ("debited / owed (cents)", f"{result.debited_cents} / {result.owed_cents}"),
    ]
    causes: list[tuple[str, object]] = [(f"from {k}", v) for k, v in result.causes.items()]
    injected: list[tuple[str, object]] = [(f"injected: {k}", v) for k, v in result.injected.items()]
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in result.notes)
    color = "#2e7d32" if result.ok else "#c62828"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>idemq chaos report</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:820px;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}th,td{{padding:2px 12px;border-bottom:1px solid #ddd}}
th{{text-align:left;font-weight:normal;color:#555}}td{{text-align:right}}
.verdict{{font-size:1.3em;color:{color}}}
</style></head><body>
<h1>idemq chaos</h1>
<p class="verdict">{"✓" if result.ok else "✗"} {html.escape(verdict)}</p>
{_chart(result)}
<table>{_rows(counts)}</table>
<h2>Why messages came twice</h2>
<table>{_rows(causes + injected)}</table>
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
</body></html>
"""


def write_report(result: ChaosResult, path: str | Path) -> Path:
    """Write :func:`render_html` to ``path`` and return it."""
    target = Path(path)
    target.write_text(render_html(result), encoding="utf-8")
    return target
