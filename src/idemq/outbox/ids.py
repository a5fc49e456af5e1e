"""The id of an outgoing message: derived inside a guarded handler, generated outside one.

Inside a handler the id is a function of (consumer, incoming message id, index of the add in
this run, and a generation when a committed earlier run of the message holds that id): the run
rolled back and ran again (a redelivery after a crash) adds the *same* ids,
so if the first run's rows had been published somehow, the next consumer's dedup row still
catches the republish. Outside a handler nothing repeats, so ids come from a
:class:`~idemq.MessageIdGenerator` whose node is unique per process (see :func:`process_node`).
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import threading
import uuid
import zlib
from collections.abc import Iterator

from idemq.guard.context import current_message
from idemq.ids.generator import MessageIdGenerator

__all__ = ["OUTBOX_ID_PREFIX", "derived_id", "derived_ids", "next_outbox_id", "process_node"]

OUTBOX_ID_PREFIX = "OUTBOX"

# A fixed namespace: the same three parts give the same id in every process and release.
_NAMESPACE = uuid.UUID("5b0c8e63-6a53-4c47-9d0e-2f3c1f7e4a10")


def process_node() -> str:
    """``H<crc32 of host>-P<pid>-R<random>``: unique per running process.

    Host and pid keep two live processes apart; the random part keeps apart a process and an
    earlier one that had the same pid (pids are reused), even if the clock stepped back between
    them, and two hosts whose names hash alike.
    """
    host_hash = zlib.crc32(socket.gethostname().encode()) & 0xFFFFFFFF
    return f"H{host_hash:08X}-P{os.getpid()}-R{secrets.token_hex(4).upper()}"


class _ProcessIds:
    """One generator per process, made again in a forked child (which must not share the
    parent's node and sequence); ``next_id`` is serialised across threads."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start afresh (also in a forked child, whose copy of the lock may be held)."""
        self._lock = threading.Lock()
        self._pid = -1
        self._generator: MessageIdGenerator | None = None

    def next_id(self) -> str:
        with self._lock:
            if self._generator is None or self._pid != os.getpid():
                self._generator = MessageIdGenerator(prefix=OUTBOX_ID_PREFIX, node=process_node())
                self._pid = os.getpid()
            return self._generator.next_id()


_IDS = _ProcessIds()

if hasattr(os, "register_at_fork"):
    # A thread of the parent may have held the lock at the fork: the child starts afresh.
    os.register_at_fork(after_in_child=_IDS.reset)


def derived_id(consumer: str, message_id: str, index: int | str, generation: int = 0) -> str:
    """``OUTBOX-<uuid5>`` of the parts (43 characters, however long they are). ``index``: the
    add's number in the handler's run, or a name of the caller's for messages made outside it;
    ``generation``: 1, 2 … for a run whose earlier ids are taken (see :func:`derived_ids`).

    Each part goes into the hash prefixed with its length, so different parts never make one
    name: joined with a separator, consumer ``"a\x1fb"`` with message ``"c"`` and consumer
    ``"a"`` with message ``"b\x1fc"`` would share an id, and one message's effect be lost.
    """
    parts = [consumer, message_id, str(index)]
    if generation:
        parts.append(str(generation))
    name = "".join(f"{len(part)}:{part}" for part in parts)
    return f"{OUTBOX_ID_PREFIX}-{uuid.uuid5(_NAMESPACE, name)}"


def derived_ids() -> Iterator[str] | None:
    """The ids the running handler's next add may take, in order; None outside a handler.

    The first is the add's own derived id. The next ones are for a run of a message whose
    earlier run committed its rows, still in the outbox, and was then forgotten (``forget``,
    ``expires_after_s``),
    or, in lease mode, crashed between its commit and ``complete``: that run is a new one,
    whose message must go out again, under an id of its own. A run rolled back and run again
    finds its first id free (its rows were rolled back too), so it still makes the same ids.
    """
    context = current_message()
    if context is None:
        return None
    consumer, message_id, index = context.consumer, context.message_id, context.next_index()
    return (derived_id(consumer, message_id, index, n) for n in itertools.count())


def next_outbox_id() -> str:
    """The id of the next outgoing message of the running code (see the module docstring)."""
    found = derived_ids()
    return _IDS.next_id() if found is None else next(found)
