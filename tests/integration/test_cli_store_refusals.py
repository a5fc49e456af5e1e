"""A store that refuses the setup is a configuration error (exit 2, one line); only a store that
cannot be reached is an outage (exit 4). Real PostgreSQL and MariaDB, real subprocesses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.conftest import MYSQL_URL, PG_URL, require_service, unique
from tests.integration.test_cli_logs import closed_port

IDEMQ = str(Path(sys.executable).with_name("idemq"))

SERVERS = {"postgres": PG_URL, "mysql": MYSQL_URL}


def _url(server: str, **parts: object) -> str:
    require_service(server)
    return make_url(SERVERS[server]).set(**parts).render_as_string(hide_password=False)


def _idemq(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [IDEMQ, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd
    )


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no traceback
    return lines[0]


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_refused_login_is_exit_2(server: str) -> None:
    url = _url(server, username=unique("nobody"))
    done = _idemq("stats", "--store", url)
    assert done.returncode == 2, done.stderr
    line = _one_line(done)
    assert "does not exist" in line or "Access denied" in line, line


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_an_unknown_database_is_exit_2(server: str) -> None:
    done = _idemq("stats", "--store", _url(server, database=unique("nodb")))
    assert done.returncode == 2, done.stderr
    _one_line(done)


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_mistyped_table_is_exit_2(server: str) -> None:
    table = unique("typo")
    done = _idemq("inspect", "SOME_ID", "--store", _url(server), "--table", table)
    assert done.returncode == 2, done.stderr
    assert table in _one_line(done)


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_only_an_unreachable_server_is_exit_4(server: str) -> None:
    done = _idemq("stats", "--store", _url(server, port=closed_port()))
    assert done.returncode == 4, done.stderr
    _one_line(done)


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_worker_whose_store_refuses_the_login_stops_with_exit_2(
    tmp_path: Path, server: str
) -> None:
    (tmp_path / "fine.py").write_text("def handle(msg, tx):\n    return 1\n")
    url = _url(server, username=unique("nobody"))
    broker = f"embedded:///{tmp_path / 'q.db'}"
    done = _idemq(
        "worker", "fine:handle", "--broker", broker, "--queue", "q", "--store", url, cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    _one_line(done)
