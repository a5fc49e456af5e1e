"""A short RabbitMQ ``consumer_timeout`` for one chaos run, restored afterwards — cause 2 on 3.10.

RabbitMQ redelivers a slow consumer's message only by closing its channel once a delivery stayed
unacked longer than ``consumer_timeout``. Before 3.12 that is a server-wide setting (no
``x-consumer-timeout``), 30 minutes by default, and each channel checks it on its tick
(``channel_tick_interval``, 60 s). Both are application environment keys, so ``rabbitmqctl
eval`` can change them on a running node:

* a channel reads ``consumer_timeout`` once, when it opens (``rabbit_channel:init/1``): only
  channels opened while the short value is in force get it — the chaos workers, and whatever
  else opens a channel meanwhile (hence opt-in, and said in the run's notes);
* ``channel_tick_interval`` is read each time a channel re-arms its tick timer.

Safety: the short values are held by a process on the RabbitMQ node registered as
:data:`HOLDER`. It restores the saved values when :func:`consumer_timeout` exits, or by itself
after ``hold_s`` if the run dies without exiting (SIGKILL), so the server never keeps them. A
second run while one holds them is refused, not stacked (it would save the short values as the
"originals"). ``rabbitmqctl`` talks to the local node, so only a loopback broker is accepted.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from idemq.chaos.proxy import loopback_only
from idemq.errors import ConfigurationError

__all__ = ["HOLDER", "consumer_timeout", "rabbitmqctl", "read_settings"]

HOLDER = "idemq_chaos_consumer_timeout"
_KEYS = ("consumer_timeout", "channel_tick_interval")

# Erlang, run by `rabbitmqctl eval` on the broker's node. ~T~ = token, ~M~ = timeout ms,
# ~K~ = tick ms, ~H~ = hold ms. Returns `armed` or `busy` (another run holds the settings).
# The holder registers *before* reading the originals, so two racing runs cannot both save.
_ACQUIRE = """
Token = <<"~T~">>,
Keys = [consumer_timeout, channel_tick_interval],
Holder = spawn(fun() ->
    receive {arm, Saved} ->
        Restore = fun() ->
            [case V of
                 {ok, X} -> application:set_env(rabbit, K, X);
                 undefined -> application:unset_env(rabbit, K)
             end || {K, V} <- Saved]
        end,
        receive {restore, Token, From} -> Restore(), From ! {restored, Token}
        after ~H~ -> Restore()
        end
    end
end),
try register(~N~, Holder) of
    true ->
        Holder ! {arm, [{K, application:get_env(rabbit, K)} || K <- Keys]},
        application:set_env(rabbit, consumer_timeout, ~M~),
        application:set_env(rabbit, channel_tick_interval, ~K~),
        armed
catch error:badarg -> exit(Holder, kill), busy
end.
"""

_RELEASE = """
case whereis(~N~) of
    undefined -> gone;
    Pid -> Pid ! {restore, <<"~T~">>, self()},
           receive {restored, <<"~T~">>} -> restored after 5000 -> timeout end
end.
"""


def rabbitmqctl() -> str | None:
    """Path of ``rabbitmqctl`` if installed (it must run as root or the rabbitmq user)."""
    return shutil.which("rabbitmqctl")


def _eval(expression: str, timeout_s: float = 60.0) -> str:
    ctl = rabbitmqctl()
    if ctl is None:
        raise ConfigurationError("rabbitmqctl is not installed: cannot tune consumer_timeout")
    proc = subprocess.run(
        [ctl, "eval", expression], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        raise ConfigurationError(f"rabbitmqctl eval failed: {(proc.stderr or proc.stdout)[-500:]}")
    return proc.stdout.strip()


def _fill(template: str, **values: object) -> str:
    for key, value in values.items():
        template = template.replace(f"~{key}~", str(value))
    return template


def read_settings() -> dict[str, str]:
    """The node's current ``consumer_timeout`` and ``channel_tick_interval`` (as Erlang text)."""
    return {key: _eval(f"application:get_env(rabbit, {key}).") for key in _KEYS}


@contextmanager
def consumer_timeout(
    broker_url: str, *, timeout_ms: int, tick_ms: int, hold_s: float
) -> Iterator[None]:
    """Hold ``consumer_timeout = timeout_ms`` (checked every ``tick_ms``) on the local node.

    Channels opened inside the block time out slow consumers after ``timeout_ms`` to
    ``timeout_ms + tick_ms``. Restored on exit, or by the node itself after ``hold_s``.
    """
    try:
        loopback_only(urlsplit(broker_url).hostname or "127.0.0.1")
    except ConfigurationError as exc:
        raise ConfigurationError(
            "rabbitmqctl changes the node on this machine: tuning needs a broker on 127.0.0.1"
        ) from exc
    token = uuid.uuid4().hex
    names = {"N": HOLDER, "T": token}
    answer = _eval(
        _fill(_ACQUIRE, **names, M=int(timeout_ms), K=int(tick_ms), H=int(hold_s * 1000))
    )
    if answer != "armed":
        raise ConfigurationError(
            f"RabbitMQ consumer_timeout is held by another chaos run ({HOLDER}): {answer}"
        )
    try:
        yield
    finally:
        _eval(_fill(_RELEASE, **names))
