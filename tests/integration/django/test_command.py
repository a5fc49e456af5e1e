"""``python manage.py idemq …`` runs the idemq CLI on the project's database."""

from __future__ import annotations

import json
from typing import Any

import idemq
from idemq.cli import EXIT_NOT_FOUND
from idemq.integrations.django import DjangoStore
from tests.conftest import unique
from tests.integration.django.conftest import manage, pay


def test_stats_inspect_forget_purge_on_the_projects_database(
    alias: str, django_project: Any, stores: list[Any]
):
    store = DjangoStore(using=alias)
    stores.append(store)
    consumer, order = unique("c"), unique("o")
    guard = idemq.Idempotency(store, consumer=consumer)
    message = unique("m")
    guard.process(message, lambda tx: pay(alias, order))

    stats = manage(django_project, alias, "idemq", "stats", "--json")
    assert json.loads(stats.stdout)["records"]["processed"] >= 1
    shown = manage(django_project, alias, "idemq", "inspect", message, "--json")
    assert consumer in shown.stdout
    assert "password" not in shown.stdout.lower()
    forgot = manage(
        django_project, alias, "idemq", "forget", message, "--consumer", consumer, "--json"
    )
    assert forgot.returncode == 0
    assert store.get(message, consumer) is None
    purged = manage(django_project, alias, "idemq", "purge", "--older-than", "1d")
    assert purged.returncode == 0, purged.stderr
    missing = manage(django_project, alias, "idemq", "inspect", unique("nope"), check=False)
    assert missing.returncode == EXIT_NOT_FOUND
