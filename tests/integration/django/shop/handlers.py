"""The handler ``python manage.py idemq worker`` runs in the tests: the docs page's example.

:func:`pay` is the page's example, verbatim (``test_worker.py`` checks it). ``pay_or_fail``
adds the failures the tests need: the body's ``fail_until`` (raise after the ORM write until that
file exists) and ``hang_until`` (say so in ``started``, then wait for that file: a worker killed
there dies after its write, before its commit). ``pay_and_announce`` also adds an outgoing
message to the outbox, in the same transaction, for the worker's ``--relay`` to publish.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import idemq
from idemq.integrations.django import DjangoStore
from tests.integration.django.shop.models import Payment


def pay(msg: idemq.Message, tx: Any) -> dict[str, str]:
    """One payment row per order; ``tx`` is Django's connection, inside the dedup transaction."""
    order = msg.json()
    Payment.objects.create(order_id=order["order_id"], amount=order["amount"])
    return {"paid": order["order_id"]}


class Boom(Exception):
    """The failure after the ORM write."""


def pay_or_fail(msg: idemq.Message, tx: Any) -> dict[str, str]:
    """:func:`pay`, then a failure or a wait as the body asks."""
    result = pay(msg, tx)
    order = msg.json()
    if "fail_until" in order and not Path(order["fail_until"]).exists():
        raise Boom(order["order_id"])
    if "hang_until" in order:
        Path(order["started"]).touch()
        while not Path(order["hang_until"]).exists():
            time.sleep(0.05)
    return result


outbox = idemq.Outbox(DjangoStore())


def pay_and_announce(msg: idemq.Message, tx: Any) -> dict[str, str]:
    """:func:`pay`, and its result sent to the body's ``announce_to`` through the outbox."""
    result = pay(msg, tx)
    outbox.add(tx, msg.json()["announce_to"], json.dumps(result).encode())
    return result
