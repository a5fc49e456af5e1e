"""``idemq``'s checks at start-up, as an operator meets them: real subprocesses, exit codes,
one line on stderr, and nothing consumed, created or written when the command refuses."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

import idemq
from idemq.brokers.embedded import EmbeddedBroker
from tests.conftest import PG_URL, REDIS_URL, require_service, unique
from tests.integration.test_cli_logs import closed_port

IDEMQ = str(Path(sys.executable).with_name("idemq"))


def idemq_cli(
    *argv: str, cwd: Path, blocked: tuple[str, ...] = (), timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``idemq argv`` in a fresh interpreter; ``blocked`` modules fail to import there, as
    on an install without the extra that brings them."""
    if blocked:
        script = (
            "import sys\n"
            f"for name in {list(blocked)!r}: sys.modules[name] = None\n"
            "from idemq.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n"
        )
        command = [sys.executable, "-c", script, *argv]
    else:
        command = [IDEMQ, *argv]
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def assert_one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    return done.stderr


def embedded_queue(tmp_path: Path, *ids: str) -> str:
    broker = EmbeddedBroker(tmp_path / "q.db")
    for message_id in ids:
        broker.publish("orders", b"{}", message_id=message_id)
    broker.close()
    return f"embedded:///{tmp_path / 'q.db'}"


def queue_depth(tmp_path: Path) -> int:
    broker = EmbeddedBroker(tmp_path / "q.db")
    try:
        return broker.depth("orders")
    finally:
        broker.close()


# -- the handler -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("def handle(msg):\n    return 1\n", "has the signature (msg)"),
        ("def handle(msg, tx, extra):\n    return 1\n", "has the signature (msg, tx, extra)"),
        ("async def handle(msg, tx):\n    return 1\n", "is async"),
    ],
)
def test_a_handler_of_the_wrong_shape_is_refused_before_any_message(tmp_path, source, says):
    (tmp_path / "shaped.py").write_text(source)
    broker = embedded_queue(tmp_path, "ORDER_1")
    store = f"sqlite:///{tmp_path / 'store.db'}"
    worker = ["worker", "shaped:handle", "--broker", broker, "--queue", "orders", "--store", store]
    stderr = assert_one_line(idemq_cli(*worker, cwd=tmp_path), 2)
    assert says in stderr
    assert "handle(msg, tx)" in stderr
    assert queue_depth(tmp_path) == 1  # nothing taken, nothing dead-lettered
    assert not (tmp_path / "store.db").exists()  # checked before the store was opened


# -- missing extras --------------------------------------------------------------------------


def test_a_missing_broker_client_names_the_extra_with_its_brackets(tmp_path):
    done = idemq_cli(
        "publish", "--broker", "amqp://127.0.0.1:5672/", "--queue", "q", "x",
        cwd=tmp_path, blocked=("aio_pika",),
    )  # fmt: skip
    stderr = assert_one_line(done, 2)
    assert "pip install 'idemq[rabbitmq]'" in stderr
    assert "aio_pika" in stderr


def test_a_missing_sql_driver_names_the_extra(tmp_path):
    done = idemq_cli("stats", "--store", PG_URL, cwd=tmp_path, blocked=("psycopg",))
    assert "pip install 'idemq[postgres]'" in assert_one_line(done, 2)


def test_metrics_port_without_prometheus_client_is_a_clean_exit_2(tmp_path):
    (tmp_path / "fine.py").write_text("def handle(msg, tx):\n    return 1\n")
    broker = embedded_queue(tmp_path, "ORDER_1")
    store = f"sqlite:///{tmp_path / 'store.db'}"
    done = idemq_cli(
        "worker", "fine:handle", "--broker", broker, "--queue", "orders", "--store", store,
        "--metrics-port", "0", cwd=tmp_path, blocked=("prometheus_client",),
    )  # fmt: skip
    stderr = assert_one_line(done, 2)
    assert "--metrics-port needs prometheus_client" in stderr
    assert "pip install 'idemq[metrics]'" in stderr
    assert queue_depth(tmp_path) == 1


# -- documented exit codes, no tracebacks ----------------------------------------------------


def test_chaos_with_an_unreachable_store_exits_4_on_one_line(tmp_path):
    store = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/test"
    done = idemq_cli(
        "chaos", "--broker", f"embedded:///{tmp_path / 'q.db'}", "--store", store,
        "--messages", "5", "--dir", str(tmp_path / "run"), cwd=tmp_path,
    )  # fmt: skip
    stderr = assert_one_line(done, 4)
    assert stderr.startswith("store error: ")
    assert "Connection refused" in stderr


# -- --table / --prefix on every command that opens a store ----------------------------------


def test_worker_and_purge_honour_table(tmp_path):
    (tmp_path / "fine.py").write_text("def handle(msg, tx):\n    return 1\n")
    broker = embedded_queue(tmp_path, "ORDER_1", "ORDER_2")
    store = f"sqlite:///{tmp_path / 'store.db'}"
    table = unique("dedup")
    log = tmp_path / "worker.log"
    command = [IDEMQ, "worker", "fine:handle", "--broker", broker, "--queue", "orders"]
    command += ["--store", store, "--table", table]
    with log.open("w") as sink:
        worker = subprocess.Popen(command, cwd=tmp_path, stderr=sink)
        try:
            deadline = time.monotonic() + 30
            while queue_depth(tmp_path) and time.monotonic() < deadline:
                assert worker.poll() is None, log.read_text()
                time.sleep(0.1)
        finally:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(30) == 0, log.read_text()
    engine = sa.create_engine(store)
    try:
        names = sa.inspect(engine).get_table_names()
        assert table in names
        assert "message_idempotent" not in names
        with engine.connect() as conn:
            count = f"SELECT COUNT(*) FROM {table} WHERE status = 1"  # PROCESSED
            assert conn.exec_driver_sql(count).scalar() == 2
        time.sleep(1.1)
        purge = idemq_cli(
            "purge", "--older-than", "1s", "--store", store, "--table", table, "--json",
            cwd=tmp_path,
        )  # fmt: skip
        assert purge.returncode == 0, purge.stderr
        assert '"deleted": 2' in purge.stdout
        with engine.connect() as conn:
            assert conn.exec_driver_sql(f"SELECT COUNT(*) FROM {table}").scalar() == 0
    finally:
        engine.dispose()


def test_worker_honours_prefix_on_a_redis_store(tmp_path):
    require_service("redis")
    (tmp_path / "fine.py").write_text("def handle(msg, tx):\n    return 1\n")
    broker = embedded_queue(tmp_path, "ORDER_1")
    prefix = unique("pfx")
    command = [IDEMQ, "worker", "fine:handle", "--broker", broker, "--queue", "orders"]
    command += ["--store", REDIS_URL, "--prefix", prefix]
    worker = subprocess.Popen(command, cwd=tmp_path, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while queue_depth(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    store = idemq.RedisStore(REDIS_URL, prefix=prefix)
    default = idemq.RedisStore(REDIS_URL)
    try:
        [record] = store.find("ORDER_1")
        assert record.status.name == "PROCESSED"
        assert record.consumer == "orders"
        assert all(r.consumer != "orders" for r in default.find("ORDER_1"))
    finally:
        store.forget("ORDER_1", "orders", force=True)
        store.close()
        default.close()


def test_table_is_refused_on_a_redis_store_by_the_worker(tmp_path):
    (tmp_path / "fine.py").write_text("def handle(msg, tx):\n    return 1\n")
    broker = embedded_queue(tmp_path, "ORDER_1")
    done = idemq_cli(
        "worker", "fine:handle", "--broker", broker, "--queue", "orders",
        "--store", REDIS_URL, "--table", "t", cwd=tmp_path,
    )  # fmt: skip
    assert "--table is for SQL stores" in assert_one_line(done, 2)


# -- schema --dialect with --store -----------------------------------------------------------


def test_schema_dialect_that_contradicts_the_store_is_an_error(tmp_path):
    require_service("postgres")
    table = unique("schema")
    done = idemq_cli(
        "schema", "--dialect", "sqlite", "--store", PG_URL, "--table", table, "--no-outbox",
        cwd=tmp_path,
    )  # fmt: skip
    assert "--dialect sqlite does not match" in assert_one_line(done, 2)
    engine = sa.create_engine(PG_URL)
    try:
        assert table not in sa.inspect(engine).get_table_names()  # nothing was created
    finally:
        engine.dispose()
    store = f"sqlite:///{tmp_path / 'ok.db'}"
    agreeing = idemq_cli("schema", "--dialect", "sqlite", "--store", store, cwd=tmp_path)
    assert agreeing.returncode == 0, agreeing.stderr


# -- a mistyped SQLite path ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "ORDER_1"],
        ["stats"],
        ["release", "ORDER_1", "--yes"],
        ["purge", "--older-than", "7d"],
        ["forget", "ORDER_1"],
    ],
)
def test_a_sqlite_file_that_does_not_exist_is_an_error_not_a_new_file(tmp_path, argv):
    missing = tmp_path / "typo.db"
    done = idemq_cli(*argv, "--store", f"sqlite:///{missing}", cwd=tmp_path)
    assert "no SQLite database at" in assert_one_line(done, 2)
    assert not missing.exists()
