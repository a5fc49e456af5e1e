"""idemq in a Django project.

* ``"idemq.integrations.django"`` in ``INSTALLED_APPS``: ``manage.py migrate`` creates the dedup
  and outbox tables exactly as idemq's own ``create_schema`` makes them;
* :class:`DjangoStore`: the dedup table on Django's own connection; the handler's ORM writes
  join the dedup transaction (``transaction.atomic``);
* :func:`idempotent`: a decorator for Celery tasks and plain functions;
* :class:`IdempotencyKeyMiddleware`: the ``Idempotency-Key`` header for Django views
  (settings ``IDEMQ_HTTP``);
* ``python manage.py idemq …``: the idemq CLI on the project's database.
"""

from __future__ import annotations

from idemq.integrations.django.decorators import idempotent
from idemq.integrations.django.middleware import IdempotencyKeyMiddleware
from idemq.integrations.django.store import DjangoStore

__all__ = ["DjangoStore", "IdempotencyKeyMiddleware", "idempotent"]
