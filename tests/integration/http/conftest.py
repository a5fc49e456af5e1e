"""A real server for the HTTP middleware tests: uvicorn in a subprocess on a free port, serving
tests/integration/http/app.py on a real store, stopped by its PID."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa

from idemq import RedisStore, SqlStore
from tests.conftest import PG_URL, REDIS_URL, free_port, redis_cleanup, require_service, unique

ROOT = Path(__file__).resolve().parents[3]
START_DEADLINE_S = 30.0


@dataclass
class Server:
    """One running app: its URL, where its effects land, and the gate directory."""

    url: str
    kind: str
    business_table: str
    gate_dir: Path
    engine: sa.Engine | None

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0, **kwargs)

    def effects(self, ref: str) -> int:
        """How many times the effect of ``ref`` landed (rows, or Redis list entries)."""
        if self.engine is None:
            entries = redis.Redis.from_url(REDIS_URL).lrange(self.business_table, 0, -1)
            return sum(1 for e in entries if e.split(b" ")[0] == ref.encode())
        with self.engine.connect() as conn:
            query = sa.text(f"SELECT COUNT(*) FROM {self.business_table} WHERE ref = :ref")
            return int(conn.execute(query, {"ref": ref}).scalar_one())

    def open_gate(self, gate: str) -> None:
        (self.gate_dir / f"{gate}.go").touch()

    def wait_started(self, gate: str, deadline_s: float = 20.0) -> None:
        deadline = time.monotonic() + deadline_s
        while not (self.gate_dir / f"{gate}.started").exists():
            assert time.monotonic() < deadline, f"the handler behind gate {gate} never started"
            time.sleep(0.01)


def _wait_listening(proc: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        assert proc.poll() is None, f"uvicorn exited with {proc.returncode}"
        try:
            httpx.get(url + "/ping", timeout=1.0)
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, "uvicorn did not start listening"
            time.sleep(0.05)


@contextmanager
def serve(kind: str, tmp: Path, **options: Any) -> Iterator[Server]:
    """Start the app on ``kind`` ("sqlite", "postgres" or "redis") with the middleware's
    ``options``; the store's schema and the business table are made first."""
    gate_dir = tmp / unique("gates")
    gate_dir.mkdir()
    business_table = unique("orders")
    config: dict[str, Any] = {
        "store": "redis" if kind == "redis" else "sql",
        "gate_dir": str(gate_dir),
        "business_table": business_table,
        "options": options,
    }
    engine: sa.Engine | None = None
    prefix = unique("idemq_http")
    if kind == "redis":
        require_service("redis")
        config |= {"store_url": REDIS_URL, "redis_url": REDIS_URL, "redis_prefix": prefix}
        RedisStore(REDIS_URL, prefix=prefix).close()
    else:
        if kind == "postgres":
            require_service("postgres")
            url = PG_URL
        else:
            url = f"sqlite:///{tmp / unique('http')}.db"
        table = unique("dedup")
        admin = SqlStore(url, table=table)
        admin.create_schema()
        admin.close()
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"CREATE TABLE {business_table} (ref VARCHAR(100), run VARCHAR(40))")
            )
        config |= {"store_url": url, "table": table}
    port = free_port()
    env = {**os.environ, "IDEMQ_HTTP_TEST": json.dumps(config)}
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "tests.integration.http.app:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(command, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_listening(proc, url)
        yield Server(url, kind, business_table, gate_dir, engine)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if engine is not None:
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE {business_table}"))
            engine.dispose()
            admin = SqlStore(config["store_url"], table=config["table"])
            admin.drop_schema()
            admin.close()
        else:
            redis_cleanup(prefix)
            redis.Redis.from_url(REDIS_URL).delete(business_table)


@pytest.fixture(scope="module", params=["sqlite", "postgres", "redis"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The app on each store in turn, default options but small body limits."""
    limits = {"max_response_bytes": 4096, "max_request_bytes": 65536}
    with serve(request.param, tmp_path_factory.mktemp("http"), **limits) as running:
        yield running
