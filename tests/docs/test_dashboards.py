"""docs/ops/alerts.yml and docs/ops/grafana-idemq.json name only metrics idemq exports.

The exported names are read from a real registry holding a ``PrometheusObserver``, a
``StoreCollector`` and an ``OutboxCollector`` on a real store, so a metric renamed in code fails
here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import prometheus_client
import pytest
import yaml

import idemq
from idemq.observe.prometheus import OutboxCollector, PrometheusObserver, StoreCollector
from tests.conftest import CI

OPS = Path(__file__).resolve().parents[2] / "docs" / "ops"
_METRIC = re.compile(r"\bidemq_[a-z_]+\b")
_SERIES_OF = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("", "_bucket", "_count", "_sum"),
}


def exported_names(tmp_path: Path) -> set[str]:
    store = idemq.SqlStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    store.create_schema()
    registry = prometheus_client.CollectorRegistry()
    observer = PrometheusObserver(registry, store_label="sqlite/message_idempotent")
    registry.register(StoreCollector(store))
    outbox = idemq.Outbox(store)
    outbox.create_schema()
    registry.register(OutboxCollector(outbox))
    guard = idemq.Idempotency(store, consumer="dash", observer=observer)
    guard.process("MSG-1", lambda tx: None)
    guard.process("MSG-1", lambda tx: None)
    # A labelled counter nobody incremented yet has no samples: name series from the families.
    names: set[str] = set()
    for family in registry.collect():
        if family.name.startswith("idemq_"):
            names |= {family.name + s for s in _SERIES_OF[family.type]}
    store.close()
    return names


def named_metrics(text: str) -> set[str]:
    return set(_METRIC.findall(text))


def expressions(value: object) -> list[str]:
    if isinstance(value, dict):
        found = [v for k, v in value.items() if k in {"expr", "query", "definition"}]
        return [e for e in found if isinstance(e, str)] + [
            e for v in value.values() for e in expressions(v)
        ]
    if isinstance(value, list):
        return [e for v in value for e in expressions(v)]
    return []


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    names = exported_names(tmp_path_factory.mktemp("metrics"))
    assert "idemq_messages_total" in names
    assert "idemq_store_up" in names
    return names


def test_alert_rules_name_exported_metrics(exported: set[str]):
    rules = yaml.safe_load((OPS / "alerts.yml").read_text(encoding="utf-8"))
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert {"IdemqStoreDown", "IdemqStuckLeases", "IdemqDeadLettersRising"} <= set(alerts)
    for name, rule in alerts.items():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert rule["annotations"]["summary"], name
        used = named_metrics(rule["expr"])
        assert used, f"{name}: names no idemq metric"
        assert used <= exported, f"{name}: {used - exported} are not exported"


def test_promtool_accepts_the_rules():
    promtool = shutil.which("promtool")
    if promtool is None:
        message = "promtool is not installed (Debian package prometheus)"
        if CI:
            pytest.fail(message)
        pytest.skip(message)
    done = subprocess.run(
        [promtool, "check", "rules", str(OPS / "alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_dashboard_names_exported_metrics(exported: set[str]):
    dashboard = json.loads((OPS / "grafana-idemq.json").read_text(encoding="utf-8"))
    assert dashboard["title"] == "idemq"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    used: set[str] = set()
    for panel in panels:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            assert named_metrics(expr), f"{panel['title']}: {expr}"
            used |= named_metrics(expr)
    for expr in expressions(dashboard["templating"]):
        used |= named_metrics(expr)
    assert used <= exported, used - exported
    # Every metric idemq exports has a panel (a histogram through its buckets).
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in exported}
    shown = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert families == shown, families ^ shown
