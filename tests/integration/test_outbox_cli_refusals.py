"""``idemq relay`` whose database refuses the login exits 2 at once with one line, like the
worker; it does not wait for a store that will never let it in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.conftest import MYSQL_URL, PG_URL, require_service, unique

IDEMQ = str(Path(sys.executable).with_name("idemq"))
SERVERS = {"postgres": PG_URL, "mysql": MYSQL_URL}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_relay_whose_store_refuses_the_login_exits_2(tmp_path: Path, server: str) -> None:
    require_service(server)
    url = make_url(SERVERS[server]).set(username=unique("nobody"))
    broker = f"embedded:///{tmp_path / 'q.db'}"
    args = [IDEMQ, "relay", "--store", url.render_as_string(hide_password=False)]
    proc = subprocess.Popen(
        [*args, "--broker", broker], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the relay kept retrying a refused login")
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]  # after the relay's own start line: the reason
    assert "does not exist" in last or "Access denied" in last, last
