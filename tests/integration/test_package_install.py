"""The package installs: ``python -m build`` makes an sdist and a wheel (built from that sdist),
the wheel holds every file of the ``idemq`` package; in a fresh venv without any extra the worker
and store commands work and ``idemq chaos`` names the extra it needs; once ``idemq[extras]`` is
installed from the wheel each extra's modules import and ``idemq demo`` runs.

Slow (a build and a venv): about a minute with pip's cache warm.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "idemq"

# What each extra enables, imported in a process of its own so that one extra's import can
# not be satisfied by a module that another check happened to load first.
EXTRA_MODULES: dict[str, list[str]] = {
    "postgres": ["psycopg", "psycopg_binary"],
    "mysql": ["pymysql", "asyncmy"],
    "sqlite": ["aiosqlite"],
    "redis": ["redis", "idemq.stores.redis", "idemq.lock"],
    "rabbitmq": ["aio_pika", "pamqp", "faststream.rabbit", "idemq.brokers.rabbitmq"],
    "kafka": ["confluent_kafka", "aiokafka", "faststream.kafka", "idemq.brokers.kafka"],
    "nats": ["nats", "faststream.nats", "idemq.brokers.nats"],
    "mqtt": ["paho.mqtt.client", "aiomqtt", "faststream.mqtt", "idemq.brokers.mqtt"],
    "faststream": ["faststream", "idemq.integrations.faststream"],
    "celery": ["celery", "idemq.integrations.celery"],
    "dramatiq": [
        "dramatiq",
        "dramatiq.brokers.rabbitmq",
        "dramatiq.brokers.redis",
        "idemq.integrations.dramatiq",
    ],
    "asgi": ["idemq.integrations.asgi"],
    "metrics": [
        "prometheus_client",
        "opentelemetry.trace",
        "idemq.observe.prometheus",
        "idemq.observe.otel",
    ],
    # Django's app needs a settings module to import; the driver itself is what the extra adds.
    "django": ["django"],
    "chaos": ["rich", "idemq.chaos.console", "idemq.chaos.demo"],
}
# Extras that only group others or serve the project's own work, not a user's import.
NOT_A_FEATURE = {"all", "dev", "docs", "bench"}

IMPORT_ALL = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)"


def _extras() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return sorted(set(project["optional-dependencies"]) - NOT_A_FEATURE)


def _env() -> dict[str, str]:
    """The environment without anything pointing at the checkout or the dev venv."""
    drop = {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(argv: list[str], cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _package_files() -> set[str]:
    """Every file of the source package as a wheel names it (no bytecode caches)."""
    return {
        path.relative_to(PACKAGE.parent).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_wheel_installs_without_dev_extras_and_each_extra_imports(tmp_path: Path):
    dist = tmp_path / "dist"
    built = _run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], ROOT)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = list(dist.glob("idemq-*.whl"))
    sdists = list(dist.glob("idemq-*.tar.gz"))
    assert len(wheels) == 1, list(dist.iterdir())
    assert len(sdists) == 1, list(dist.iterdir())
    wheel = wheels[0]

    # Package data included generically: whatever file the package has (py.typed, migrations,
    # scripts) is in the wheel, not only the modules setuptools finds by itself.
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_package_files() - in_wheel)
    assert not missing, f"files of src/idemq not in the wheel: {missing}"
    assert "idemq/py.typed" in in_wheel

    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    assert made.returncode == 0, made.stderr
    python, pip, idemq = (str(venv / "bin" / name) for name in ("python", "pip", "idemq"))
    core = _run([pip, "install", "-q", str(wheel)], tmp_path)
    assert core.returncode == 0, core.stderr[-3000:]

    # The venv's idemq, not the checkout's: cwd is outside the checkout and no PYTHONPATH.
    where = _run([python, "-c", "import idemq; print(idemq.__file__)"], tmp_path)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv)), where.stdout

    # The core install: a worker and the store commands, in plain text (rich is the lab's).
    absent = _run([python, "-c", IMPORT_ALL, "rich"], tmp_path)
    assert absent.returncode != 0, "rich is installed without the chaos extra"
    for command in ("worker", "stats", "relay", "inspect", "purge", "schema", "publish"):
        helped = _run([idemq, command, "--help"], tmp_path)
        assert helped.returncode == 0, (command, helped.stderr[-3000:])
        assert f"usage: idemq {command}" in helped.stdout, helped.stdout
    store = f"sqlite:///{tmp_path / 'core.db'}"
    created = _run([idemq, "schema", "--store", store], tmp_path)
    assert created.returncode == 0, created.stderr[-3000:]
    stats = _run([idemq, "stats", "--store", store], tmp_path)
    assert stats.returncode == 0, stats.stderr[-3000:]
    assert "processed" in stats.stdout, stats.stdout
    # The lab's commands say which extra they need, before touching anything.
    for argv in (["chaos", "--broker", "embedded:///q.db", "--store", store], ["demo"]):
        refused = _run([idemq, *argv], tmp_path)
        assert refused.returncode == 2, (argv, refused.stdout, refused.stderr)
        assert "pip install 'idemq[chaos]'" in refused.stderr, refused.stderr

    # Without its extra a driver is absent: the checks below can fail.
    absent = _run([python, "-c", IMPORT_ALL, *EXTRA_MODULES["postgres"]], tmp_path)
    assert absent.returncode != 0, "psycopg is installed without the postgres extra"

    extras = _extras()
    unmapped = [extra for extra in extras if extra not in EXTRA_MODULES]
    assert not unmapped, f"extras with no import check here: {unmapped}"
    requirement = f"idemq[{','.join(extras)}] @ {wheel.as_uri()}"
    installed = _run([pip, "install", "-q", requirement], tmp_path, timeout_s=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    failed = {}
    for extra in extras:
        done = _run([python, "-c", IMPORT_ALL, *EXTRA_MODULES[extra]], tmp_path)
        if done.returncode != 0:
            failed[extra] = done.stderr.strip().splitlines()[-1:]
    assert not failed, failed

    # The demo needs no server: the first command a newcomer runs (README: `.[chaos]`).
    demo = _run([idemq, "demo", "--orders", "30", "--workers", "2", "--json"], tmp_path)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert '"ok": true' in demo.stdout, demo.stdout[-3000:]
    assert '"double_paid": 0' in demo.stdout, demo.stdout[-3000:]
