"""Throwaway TLS servers for the tests: a CA made with ``openssl``, and a PostgreSQL cluster and a
redis-server started on free ports with a certificate that CA signed (SAN 127.0.0.1, localhost).
Both also listen on 127.0.0.2, an address the certificate does not name.

Each server is stopped by its own PID at the end, whatever the test did. A machine without the
binaries skips (locally) or fails (under CI=true), like a missing service.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import CI, free_port, port_open

START_TIMEOUT_S = 60.0


def _missing(what: str) -> None:
    if CI:
        pytest.fail(f"{what} (CI=true: a missing server is a failure, not a skip)")
    pytest.skip(what)


@dataclass(frozen=True)
class Certificates:
    """A CA and a server certificate it signed, for 127.0.0.1 and localhost."""

    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path, name: str = "idemq test CA") -> Certificates:
    """A fresh CA (``ca.pem``) and ``server.pem``/``server.key`` signed by it, in ``directory``."""
    if shutil.which("openssl") is None:
        _missing("openssl is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr = directory / "server.pem", directory / "server.key", directory / "server.csr"
    ext = directory / "server.ext"
    _openssl(
        *("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
        *("-keyout", str(ca_key), "-out", str(ca), "-subj", f"/CN={name}"),
    )
    _openssl(
        *("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr)),
        *("-subj", "/CN=localhost"),
    )
    ext.write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "basicConstraints=CA:FALSE\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl(
        *("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key)),
        *("-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)),
    )
    return Certificates(ca=ca, cert=cert, key=key)


def _wait_port(port: int, process: subprocess.Popen[bytes] | None, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not port_open("127.0.0.1", port):
        if process is not None and process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"server did not listen on {port} in time: {log.read_text()[-2000:]}")
        time.sleep(0.05)


def _postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        _missing("PostgreSQL server binaries are not installed (/usr/lib/postgresql/*/bin)")
    return Path(found[-1]).parent


def _as_postgres(*command: str) -> list[str]:
    """``command`` run as the ``postgres`` OS user: initdb and postgres refuse to run as root."""
    if os.geteuid() != 0:
        return list(command)
    return ["runuser", "-u", "postgres", "--", *command]


@contextmanager
def postgres_tls(certs: Certificates) -> Iterator[int]:
    """A throwaway PostgreSQL cluster with ``ssl=on`` on a free port; yields the port.

    The data directory lives in a fresh directory of the system temp dir owned by ``postgres``
    (pytest's tmp_path is root's, 0700: the server could not read its own files there).
    """
    bin_dir = _postgres_bin()
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            _missing("no postgres OS user to run a throwaway PostgreSQL as")
    root = Path(tempfile.mkdtemp(prefix="idemq-pg-tls-"))
    data, tls = root / "data", root / "tls"
    tls.mkdir()
    for source in (certs.cert, certs.key):
        shutil.copy(source, tls / source.name)
    (tls / certs.key.name).chmod(0o600)  # the server refuses a key others can read
    if os.geteuid() == 0:
        for path in (root, tls, *tls.iterdir()):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    log = root / "server.log"
    pg_ctl = str(bin_dir / "pg_ctl")
    try:
        subprocess.run(
            _as_postgres(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"),
            check=True,
            capture_output=True,
            timeout=120,
        )
        port = free_port()
        options = " ".join(
            [
                f"-p {port}",
                "-c listen_addresses=127.0.0.1,127.0.0.2",
                f"-c unix_socket_directories={root}",
                "-c ssl=on",
                f"-c ssl_cert_file={tls / certs.cert.name}",
                f"-c ssl_key_file={tls / certs.key.name}",
                "-c fsync=off",
            ]
        )
        subprocess.run(
            _as_postgres(pg_ctl, "start", "-w", "-D", str(data), "-l", str(log), "-o", options),
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT_S,
        )
        pid = int((data / "postmaster.pid").read_text().splitlines()[0])
        try:
            _wait_port(port, None, log)
            yield port
        finally:
            _stop(pid)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def redis_tls(certs: Certificates) -> Iterator[int]:
    """A redis-server speaking only TLS on a free port (no client certificates); yields the port."""
    server = shutil.which("redis-server")
    if server is None:
        _missing("redis-server is not installed")
    port = free_port()
    directory = certs.ca.parent
    log = directory / f"redis-{port}.log"
    command = [
        str(server),
        *("--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "127.0.0.2"),
        *("--tls-cert-file", str(certs.cert), "--tls-key-file", str(certs.key)),
        *("--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "no"),
        *("--save", "", "--appendonly", "no", "--dir", str(directory), "--logfile", str(log)),
    ]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as process:
        try:
            _wait_port(port, process, log)
            yield port
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


def _stop(pid: int) -> None:
    """SIGINT (PostgreSQL's fast shutdown) to the postmaster, which pg_ctl detached from us, and
    wait until ``pid`` is gone; SIGKILL if it lingers."""
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
