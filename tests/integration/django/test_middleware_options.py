"""The Django middleware's options, in-process on each database (the protocol itself is
tested behind real servers in test_middleware.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import idemq
from idemq.integrations.django import DjangoStore, IdempotencyKeyMiddleware
from tests.conftest import unique
from tests.integration.django.conftest import pay, payments, sa_url


def _view(alias: str, status: int = 201) -> Any:
    from django.http import JsonResponse  # noqa: PLC0415

    def view(request: Any) -> Any:
        body = json.loads(request.body)
        pay(alias, body["order_id"])
        return JsonResponse({"order_id": body["order_id"]}, status=status)

    return view


def _post(body: dict[str, Any], **headers: str) -> Any:
    from django.test import RequestFactory  # noqa: PLC0415

    return RequestFactory().post(
        "/pay", data=json.dumps(body), content_type="application/json", headers=headers
    )


def test_required_key_is_400_problem(alias: str, stores: list[Any]):
    store = DjangoStore(using=alias)
    stores.append(store)
    middleware = IdempotencyKeyMiddleware(
        _view(alias), store=store, required=True, consumer=unique("h")
    )
    order = unique("o")
    response = middleware(_post({"order_id": order}))
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["code"] == "idempotency-key-missing"
    assert payments(alias, order) == 0


def test_webhook_keyed_by_its_event_id_runs_once(alias: str, stores: list[Any]):
    store = DjangoStore(using=alias)
    stores.append(store)

    def event_id(request: Any) -> str:
        return str(json.loads(request.body)["event"])

    middleware = IdempotencyKeyMiddleware(
        _view(alias, 200), store=store, key=event_id, consumer=unique("hook")
    )
    order, event = unique("o"), unique("evt")
    first = middleware(_post({"order_id": order, "event": event}))
    again = middleware(_post({"order_id": order, "event": event}))
    assert first.status_code == again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert payments(alias, order) == 1


def test_lease_mode_releases_a_5xx_and_stores_a_success(alias: str, stores: list[Any]):
    store = DjangoStore(using=alias)
    stores.append(store)
    consumer, order, key = unique("h"), unique("o"), unique("k")
    failing = IdempotencyKeyMiddleware(
        _view(alias, 503), store=store, mode="lease", consumer=consumer
    )
    assert failing(_post({"order_id": order}, idempotency_key=f'"{key}"')).status_code == 503
    # Lease mode: the effect is elsewhere; the claim is released so the retry runs again.
    succeeding = IdempotencyKeyMiddleware(
        _view(alias), store=store, mode="lease", consumer=consumer
    )
    assert succeeding(_post({"order_id": order}, idempotency_key=f'"{key}"')).status_code == 201
    replay = succeeding(_post({"order_id": order}, idempotency_key=f'"{key}"'))
    assert replay["Idempotent-Replayed"] == "true"
    assert payments(alias, order) == 2  # the 503's own write is its view's, not rolled back


def test_async_get_response_runs_the_same_rules(alias: str, stores: list[Any]):
    from asgiref.sync import sync_to_async  # noqa: PLC0415

    store = DjangoStore(using=alias)
    stores.append(store)
    view = _view(alias)

    async def async_view(request: Any) -> Any:
        return await sync_to_async(view)(request)

    middleware = IdempotencyKeyMiddleware(async_view, store=store, consumer=unique("h"))
    order, key = unique("o"), unique("k")

    async def twice() -> list[Any]:
        return [
            await middleware(_post({"order_id": order}, idempotency_key=f'"{key}"'))
            for _ in range(2)
        ]

    first, again = asyncio.run(twice())
    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert payments(alias, order) == 1


def test_a_sql_store_named_in_the_settings_works_too(
    alias: str, django_project: Any, stores: list[Any]
):
    if alias == "sqlite":
        pytest.skip(
            "a SqlStore's transaction holds the SQLite file's one write lock the view needs"
        )
    store = idemq.SqlStore(sa_url(django_project, alias))
    stores.append(store)
    middleware = IdempotencyKeyMiddleware(_view(alias), store=store, consumer=unique("h"))
    order, key = unique("o"), unique("k")
    first = middleware(_post({"order_id": order}, idempotency_key=f'"{key}"'))
    again = middleware(_post({"order_id": order}, idempotency_key=f'"{key}"'))
    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert payments(alias, order) == 1


def test_unknown_options_are_refused(django_project: Any):
    with pytest.raises(idemq.ConfigurationError, match="unknown options"):
        IdempotencyKeyMiddleware(lambda request: None, wait=1)
