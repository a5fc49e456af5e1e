"""One racing worker: ``python -m tests.integration.django.racer CONSUMER PREFIX COUNT GATE``.

Waits for the file GATE (so every racer starts together), then runs messages ``m-0`` …
``m-COUNT-1`` through ``Idempotency(DjangoStore())``, each writing one payment row through the
ORM; prints its outcomes' statuses as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import django


def main() -> None:
    consumer, prefix, count, gate = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.integration.django.djproject.settings")
    django.setup()
    import idemq  # noqa: PLC0415
    from idemq.integrations.django import DjangoStore  # noqa: PLC0415
    from tests.integration.django.shop.models import Payment  # noqa: PLC0415

    guard = idemq.Idempotency(DjangoStore(), consumer=consumer)
    deadline = time.monotonic() + 60
    while not gate.exists():
        if time.monotonic() > deadline:
            raise SystemExit("the gate never opened")
        time.sleep(0.005)
    statuses: Counter[str] = Counter()
    for i in range(count):

        def handler(tx: object, i: int = i) -> int:
            return int(Payment.objects.create(order_id=f"{prefix}-{i}", amount=i).pk)

        statuses[guard.process(f"m-{i}", handler).status.name] += 1
    print(json.dumps(statuses))


if __name__ == "__main__":
    main()
