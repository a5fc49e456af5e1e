"""The Starlette app the HTTP tests serve with uvicorn (``--factory``), configured by the JSON
in ``IDEMQ_HTTP_TEST``: which store, where the effect lands, the middleware's options.

``POST /orders`` with ``{"ref": …}`` makes one effect: a row in the business table written
through ``request.state.idemq_tx`` (transactional mode: the dedup transaction) or an entry in
a Redis list (lease mode: an effect elsewhere). ``gate`` makes it wait for the test (a file),
``fail_times`` answers 500 for the first attempts, ``size`` pads the response, ``status``
picks it, ``raise_times`` raises after the write, ``lock_ref`` first updates that business row
(SQL stores). ``POST /stream`` answers in chunks.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio
from sqlalchemy import text
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idemq import AsyncRedisStore, AsyncSqlStore
from idemq.integrations.asgi import IdempotencyKeyMiddleware

GATE_DEADLINE_S = 30.0


def _webhook_key(scope: Any, body: bytes) -> str | None:
    """A payment provider's event id is in the JSON body, a Git host's delivery id in a
    header; other paths carry no key."""
    if scope["path"] == "/webhooks/pay":
        event_id: str = json.loads(body)["id"]
        return event_id
    if scope["path"] == "/webhooks/git":
        headers = dict(scope["headers"])
        delivery = headers.get(b"x-github-delivery")
        return None if delivery is None else delivery.decode("latin-1")
    return None


def create_app() -> Any:
    config = json.loads(os.environ["IDEMQ_HTTP_TEST"])
    gates = Path(config["gate_dir"])
    table = config["business_table"]
    store: Any
    if config["store"] == "redis":
        store = AsyncRedisStore(config["store_url"], prefix=config["redis_prefix"])
        effects: Any = redis.asyncio.Redis.from_url(config["redis_url"])
    else:
        # A pool that does not reset what it gets back (as idemq's own sync engines): the
        # middleware must end every transaction it began, not count on the pool to.
        store = AsyncSqlStore(config["store_url"], table=config["table"], pool_reset_on_return=None)
        effects = None

    async def wait_for_gate(gate: str) -> None:
        (gates / f"{gate}.started").touch()
        deadline = time.monotonic() + GATE_DEADLINE_S
        while not (gates / f"{gate}.go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {gate} never opened")
            await asyncio.sleep(0.01)

    async def effect(request: Request, ref: str, run: str) -> None:
        if effects is not None:
            await effects.rpush(table, f"{ref} {run}")
            return
        insert = text(f"INSERT INTO {table} (ref, run) VALUES (:ref, :run)")
        tx = getattr(request.state, "idemq_tx", None)
        if tx is not None:
            await tx.execute(insert, {"ref": ref, "run": run})
        else:  # an unguarded request: the app's own transaction
            async with store.engine.begin() as conn:
                await conn.execute(insert, {"ref": ref, "run": run})

    async def create_order(request: Request) -> Response:
        order = await request.json()
        ref = order["ref"]
        if "gate" in order:
            await wait_for_gate(order["gate"])
        with (gates / f"{ref}.attempts").open("a") as attempts:
            attempts.write("x\n")
        attempt = len((gates / f"{ref}.attempts").read_text().splitlines())
        run = uuid.uuid4().hex
        if "lock_ref" in order:  # a write that waits for another transaction's row lock
            update = text(f"UPDATE {table} SET run = :run WHERE ref = :lock")
            await request.state.idemq_tx.execute(update, {"run": run, "lock": order["lock_ref"]})
        await effect(request, ref, run)
        if attempt <= order.get("raise_times", 0):
            raise RuntimeError("the handler failed after its write")
        status = order.get("status", 201)
        if attempt <= order.get("fail_times", 0):
            status = 500
        return JSONResponse(
            {"ref": ref, "run": run, "attempt": attempt, "pad": "x" * order.get("size", 0)},
            status_code=status,
            headers={
                "Location": f"/orders/{ref}",
                "X-Order-Id": ref,
                "Keep-Alive": "timeout=99",
                "Set-Cookie": "session=secret",
            },
        )

    async def stream(request: Request) -> Response:
        order = await request.json()
        ref = order["ref"]
        await effect(request, ref, uuid.uuid4().hex)

        async def chunks() -> Any:
            for part in ("first;", "second;", ref):
                yield part.encode()

        return StreamingResponse(chunks(), status_code=201, media_type="text/plain")

    async def webhook(request: Request) -> Response:
        event = await request.json()
        ref = (
            event["id"]
            if request.url.path.endswith("pay")
            else request.headers["x-github-delivery"]
        )
        await effect(request, ref, uuid.uuid4().hex)
        return JSONResponse({"received": ref})

    async def put_order(request: Request) -> Response:
        ref = request.path_params["ref"]
        await effect(request, ref, uuid.uuid4().hex)
        return JSONResponse({"ref": ref})

    app = Starlette(
        routes=[
            Route("/orders", create_order, methods=["POST"]),
            Route("/orders/{ref}", put_order, methods=["PUT"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/webhooks/pay", webhook, methods=["POST"]),
            Route("/webhooks/git", webhook, methods=["POST"]),
        ]
    )
    options: dict[str, Any] = dict(config.get("options", {}))
    if options.pop("webhook", False):
        options["key"] = _webhook_key
    return IdempotencyKeyMiddleware(app, store=store, **options)
