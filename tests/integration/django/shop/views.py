"""Views whose ORM writes are the effect the tests count."""

from __future__ import annotations

import json
import time

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from tests.integration.django.shop.models import Payment


def _pay(request: HttpRequest) -> HttpResponse:
    body = json.loads(request.body)
    payment = Payment.objects.create(order_id=body["order_id"], amount=body["amount"])
    # Held open after the write, so a concurrent retry meets the first request in flight.
    time.sleep(float(request.GET.get("hold_ms", "0")) / 1000)
    return JsonResponse({"payment": payment.pk, "order_id": payment.order_id}, status=201)


def pay(request: HttpRequest) -> HttpResponse:
    return _pay(request)


async def pay_async(request: HttpRequest) -> HttpResponse:
    return await sync_to_async(_pay)(request)


def fail(request: HttpRequest) -> HttpResponse:
    """Writes, then answers 500: what is not stored must not have happened."""
    body = json.loads(request.body)
    Payment.objects.create(order_id=body["order_id"], amount=body["amount"])
    return JsonResponse({"error": "boom"}, status=500)


def count(request: HttpRequest) -> HttpResponse:
    n = Payment.objects.filter(order_id=request.GET["order_id"]).count()
    return JsonResponse({"count": n})
