"""The chaos report reads at a glance: verdict, invariants, then one panel per series."""

from __future__ import annotations

import re

from idemq.chaos.report import render_html
from idemq.chaos.result import ChaosResult


def result(**overrides: object) -> ChaosResult:
    values: dict[str, object] = {
        "broker": "embedded:///q.db",
        "store": "sqlite:///l.db",
        "guard": True,
        "messages": 500,
        "workers": 3,
        "produced": 500,
        "delivered": 540,
        "duplicates_delivered": 40,
        "duplicates_suppressed": 35,
        "applied": 500,
        "crashes": 3,
        "debited_cents": 1234,
        "owed_cents": 1234,
        "causes": {"partition": 25, "slow": 9, "crash": 6, "other": 0},
        "timeline": [
            {"deliveries": 200, "suppressed": 10, "kills": 1},
            {"deliveries": 300, "suppressed": 20, "kills": 0},
            {"deliveries": 40, "suppressed": 5, "kills": 2},
        ],
        "seconds": 3.0,
    }
    values.update(overrides)
    return ChaosResult(**values)  # type: ignore[arg-type]


def panel(page: str, name: str) -> str:
    match = re.search(rf'<svg[^>]*data-panel="{name}".*?</svg>', page, flags=re.S)
    assert match, name
    return match.group(0)


def test_reading_order_verdict_invariants_panels():
    page = render_html(result())
    verdict = page.index('id="verdict"')
    invariants = page.index("Invariants checked")
    panels = page.index('data-panel="deliveries"')
    assert verdict < invariants < panels
    assert "✓ every message applied exactly once" in page
    # lost, finished in time, applied twice, money, and the seven rules of chaos.invariants
    assert page.count(">held<") == 11
    assert "<th>the run finished</th><td>within its time limit</td>" in page
    assert "BROKEN" not in page


def test_each_series_has_its_own_panel_and_scale():
    page = render_html(result())
    for name in ("deliveries", "suppressed", "kills", "causes"):
        assert f'data-series="{name}"' in panel(page, name)
    # The busiest bucket of a series reaches the top gridline of its own panel, however small
    # its numbers are next to the deliveries: 2 kills draw as tall as 300 deliveries.
    kills = panel(page, "kills")
    tallest = max(float(h) for h in re.findall(r'<rect [^>]*height="([\d.]+)"', kills))
    plot_height = 160 - 30 - 28
    assert tallest == plot_height
    assert ">2<" in kills  # the axis top is 2 kills, not 300 deliveries
    assert ">500<" in panel(page, "deliveries")


def test_a_failed_run_says_so_first_and_marks_the_broken_invariants():
    page = render_html(
        result(
            guard=False,
            double_applied=7,
            debited_cents=2000,
            invariant_violations={"double_debit": 7, "balance_mismatch": 2},
        )
    )
    assert page.index("✗ 0 lost, 7 applied more than once") < page.index("Invariants checked")
    assert page.count(">BROKEN<") == 4  # applied twice, money, double debit, balance
    assert "none (--no-guard)" in page


def test_an_empty_series_says_none_instead_of_a_flat_line():
    page = render_html(result(crashes=0, timeline=[{"deliveries": 5, "suppressed": 0, "kills": 0}]))
    assert "none in this run" in panel(page, "kills")
    assert 'data-series="kills"' not in page


def test_self_contained():
    page = render_html(result(notes=["<b>escaped</b>"]))
    assert "<script" not in page
    assert "http://" not in page.replace("http://www.w3.org", "")
    assert "https://" not in page
    assert "&lt;b&gt;escaped&lt;/b&gt;" in page


def test_a_run_cut_short_before_it_produced_anything_is_not_ok() -> None:
    """Seen on a loaded machine: `--timeout 3` hit before the first publish, so nothing was
    unfinished and nothing lost — and the run had proved nothing."""
    result = ChaosResult("embedded://", "sqlite://", True, 5000, 1, timed_out=True)
    assert (result.produced, result.unfinished, result.lost) == (0, 0, 0)
    assert not result.ok
    assert result.to_json()["ok"] is False
