"""``idemq worker MODULE:HANDLER``: a handler the worker could not call is refused before any
message is taken (otherwise every message would fail and be dead-lettered), each mistake in one
line that names it; and the inline executor behaves as a one-thread pool would."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from idemq.errors import ConfigurationError
from idemq.worker.executors import InlineExecutor, executor
from idemq.worker.run import check_handler, load_handler

HANDLERS = """
import functools

def handle(msg, tx):
    return "ok"

def handle_msg_only(msg):
    return "ok"

async def handle_async(msg, tx):
    return "ok"

def handle_kw(msg, tx=None, *, retries=3):
    return "ok"

class Orders:
    @staticmethod
    def pay(msg, tx):
        return "paid"

not_callable = 42
handle_partial = functools.partial(lambda prefix, msg, tx: prefix, "p")
"""


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"lab_handlers_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(HANDLERS)
    (tmp_path / f"{name}_broken.py").write_text("ORDERS = undefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for loaded in (name, f"{name}_broken"):
        sys.modules.pop(loaded, None)


@pytest.mark.parametrize("attr", ["handle", "handle_kw", "Orders.pay", "handle_partial"])
def test_a_handler_callable_as_msg_tx_loads(module: str, attr: str):
    handler = load_handler(f"{module}:{attr}")
    assert handler(None, None) in ("ok", "paid", "p")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_colon_here", "must look like MODULE:HANDLER"),
        (":handle", "must look like MODULE:HANDLER"),
        ("{module}:", "must look like MODULE:HANDLER"),
        ("lab_module_that_does_not_exist:handle", "cannot load handler"),
        ("{module}:missing", "cannot load handler"),
        ("{module}:not_callable", "is not callable"),
        ("{module}:handle_msg_only", "has the signature (msg); the worker calls handle(msg, tx)"),
        ("{module}:handle_async", "is async; the worker calls handle(msg, tx)"),
        # The module is there but its import fails: the handler's own mistake, one line.
        ("{module}_broken:handle", "_broken': NameError: name 'undefined_name' is not defined"),
    ],
)
def test_a_handler_the_worker_cannot_call_is_refused_in_one_line(module: str, spec: str, says: str):
    with pytest.raises(ConfigurationError) as refused:
        load_handler(spec.format(module=module))
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_callable_without_a_signature_is_given_the_benefit_of_the_doubt():
    check_handler(print, "print")  # a builtin: nothing to inspect, nothing refused


def test_one_thread_runs_inline_and_keeps_the_error_in_the_future():
    inline = executor(1, "unused")
    assert isinstance(inline, InlineExecutor)
    ran_on: list[threading.Thread] = []
    done = inline.submit(lambda: ran_on.append(threading.current_thread()) or "done")
    assert done.result() == "done"
    assert ran_on == [threading.current_thread()]
    failed = inline.submit(lambda: 1 / 0)
    assert isinstance(failed.exception(), ZeroDivisionError)


def test_several_threads_make_a_named_pool():
    pool = executor(2, "idemq-unit")
    try:
        name = pool.submit(lambda: threading.current_thread().name).result()
        assert name.startswith("idemq-unit")
    finally:
        pool.shutdown()
