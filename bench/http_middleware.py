"""What IdempotencyKeyMiddleware costs and saves over HTTP, against the same app without it.

Run:  python bench/http_middleware.py [-n 300] [--rounds 3] [--only postgres,redis]

A Starlette app served by uvicorn (one process each, started here on free ports), an httpx client
with keep-alive sending one request at a time. The handler is a small payment: it inserts the
payment, updates the account's balance and appends a ledger line — three statements on
PostgreSQL, in the dedup transaction when guarded (``request.state.idemq_tx``) and in its own
transaction when not. On Redis (lease mode) the handler's writes go to PostgreSQL in its own
transaction, as an effect outside the store.

Contenders, per store:

* ``plain first``   — the app without the middleware (no key);
* ``guarded first`` — the app with the middleware, a fresh key per request: the handler runs;
* ``guarded replay`` — the same app, keys whose first request was sent just before (untimed):
  the stored response is replayed without running the handler;
* PostgreSQL: ``wait=None first`` — the middleware with ``wait_s=None`` (a retry waits on the
  first's row lock instead of being told 409: no statement of the middleware's own);
* PostgreSQL: ``bare first`` and ``bare replay`` — the bound: the same handler in the plain
  app with the dedup done by hand on psycopg (``INSERT … ON CONFLICT DO NOTHING RETURNING``,
  the handler's three statements, the response's UPDATE, COMMIT; a replay: the insert finds
  the row, one SELECT reads the response, ROLLBACK). It answers no in-flight retry with a 409
  and keeps no fingerprint or headers: what idemq adds to it is the price of those.

They take turns in chunks of 50 requests, order rotating, for ``--rounds`` x N requests each.
Prints requests/s, the ratios against the targets of issue 32 (replay >= 2x running the
handler; a first request >= 0.85x the app without the middleware) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
CHUNK = 50
HERE = Path(__file__).resolve().parent


# -- the app (imported by uvicorn from this file: --app-dir bench) --------------------------


def create_app() -> Any:
    from sqlalchemy import text  # noqa: PLC0415
    from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import JSONResponse  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    from idemq import AsyncRedisStore, AsyncSqlStore  # noqa: PLC0415
    from idemq.integrations.asgi import IdempotencyKeyMiddleware  # noqa: PLC0415

    config = json.loads(os.environ["IDEMQ_BENCH_HTTP"])
    prefix = config["prefix"]
    engine = create_async_engine(PG_URL.replace("psycopg", "psycopg_async"), pool_size=2)
    statements = [
        text(f"INSERT INTO {prefix}_payments (ref, amount) VALUES (:ref, :amount)"),
        text(f"UPDATE {prefix}_accounts SET balance = balance + :amount WHERE id = 1"),
        text(f"INSERT INTO {prefix}_ledger (ref, amount) VALUES (:ref, :amount)"),
    ]

    async def pay(request: Request) -> JSONResponse:
        payment = await request.json()
        tx = getattr(request.state, "idemq_tx", None)
        if tx is not None:
            for statement in statements:
                await tx.execute(statement, payment)
        else:
            async with engine.begin() as conn:
                for statement in statements:
                    await conn.execute(statement, payment)
        return JSONResponse(
            {"paid": payment["ref"]}, status_code=201, headers={"Location": "/p/" + payment["ref"]}
        )

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    if config["store"] is None:
        app.add_route("/bare", _bare_endpoint(prefix), methods=["POST"])
        return app
    store: Any
    if config["store"] == "redis":
        store = AsyncRedisStore(REDIS_URL, prefix=prefix)
    else:
        store = AsyncSqlStore(PG_URL, table=f"{prefix}_dedup")
    wait_s = None if config.get("wait_none") else 0
    return IdempotencyKeyMiddleware(app, store=store, wait_s=wait_s)


def _bare_endpoint(prefix: str) -> Any:
    """The bound: the dedup by hand, on one psycopg connection (requests come one at a time)."""
    import psycopg  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import Response  # noqa: PLC0415

    statements = [
        f"INSERT INTO {prefix}_payments (ref, amount) VALUES (%(ref)s, %(amount)s)",
        f"UPDATE {prefix}_accounts SET balance = balance + %(amount)s WHERE id = 1",
        f"INSERT INTO {prefix}_ledger (ref, amount) VALUES (%(ref)s, %(amount)s)",
    ]
    claim = f"INSERT INTO {prefix}_bare (key) VALUES (%s) ON CONFLICT DO NOTHING RETURNING 1"
    read = f"SELECT body FROM {prefix}_bare WHERE key = %s"
    store = f"UPDATE {prefix}_bare SET body = %s WHERE key = %s"
    dsn = PG_URL.replace("+psycopg", "")
    connections: list[psycopg.AsyncConnection[Any]] = []

    async def bare(request: Request) -> Response:
        payment = await request.json()
        key = request.headers["idempotency-key"]
        if not connections:
            connections.append(await psycopg.AsyncConnection.connect(dsn))
        conn = connections[0]
        headers = {"Location": "/p/" + payment["ref"]}
        async with conn.cursor() as cursor:
            await cursor.execute(claim, (key,))
            if await cursor.fetchone() is None:
                await cursor.execute(read, (key,))
                row = await cursor.fetchone()
                await conn.rollback()
                assert row is not None
                headers["Idempotent-Replayed"] = "true"
                return Response(row[0], 201, headers, media_type="application/json")
            for statement in statements:
                await cursor.execute(statement, payment)
            body = json.dumps({"paid": payment["ref"]})
            await cursor.execute(store, (body, key))
        await conn.commit()
        return Response(body, 201, headers, media_type="application/json")

    return bare


# -- the bench ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serve(store: str | None, prefix: str, *, wait_none: bool = False) -> Iterator[str]:
    port = _free_port()
    config = {"store": store, "prefix": prefix, "wait_none": wait_none}
    env = {**os.environ, "IDEMQ_BENCH_HTTP": json.dumps(config)}
    command = [
        sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), "--factory",
        "http_middleware:create_app", "--port", str(port), "--log-level", "warning",
        "--no-access-log",
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/ping", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


Loop = Callable[[list[str]], None]


def sender(client: httpx.Client, *, keyed: bool, expect_replay: bool, path: str = "/pay") -> Loop:
    def loop(refs: list[str]) -> None:
        for ref in refs:
            headers = {"Idempotency-Key": f'"{ref}"'} if keyed else {}
            answer = client.post(path, json={"ref": ref, "amount": 5}, headers=headers)
            replayed = answer.headers.get("idempotent-replayed") == "true"
            if answer.status_code != 201 or replayed is not expect_replay:
                raise AssertionError(f"{ref}: {answer.status_code} replayed={replayed}")

    return loop


def run(store: str, n: int, rounds: int) -> dict[str, float]:
    prefix = f"bench_http_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {prefix}_payments (ref TEXT, amount INT)")
        conn.exec_driver_sql(f"CREATE TABLE {prefix}_ledger (ref TEXT, amount INT)")
        conn.exec_driver_sql(f"CREATE TABLE {prefix}_accounts (id INT PRIMARY KEY, balance INT)")
        conn.exec_driver_sql(f"INSERT INTO {prefix}_accounts VALUES (1, 0)")
        conn.exec_driver_sql(f"CREATE TABLE {prefix}_bare (key TEXT PRIMARY KEY, body TEXT)")
    if store == "postgres":
        import idemq  # noqa: PLC0415

        admin = idemq.SqlStore(PG_URL, table=f"{prefix}_dedup")
        admin.create_schema()
        admin.close()
    rates: dict[str, float] = {}
    try:
        with (
            serve(None, prefix) as plain_url,
            serve(store, prefix) as guarded_url,
            serve(store, prefix, wait_none=True) as waiting_url,
            httpx.Client(base_url=plain_url, timeout=30) as plain,
            httpx.Client(base_url=guarded_url, timeout=30) as guarded,
            httpx.Client(base_url=waiting_url, timeout=30) as waiting,
        ):
            contenders: dict[str, tuple[Loop, Loop | None]] = {
                "plain first": (sender(plain, keyed=False, expect_replay=False), None),
                "guarded first": (sender(guarded, keyed=True, expect_replay=False), None),
                "wait=None first": (sender(waiting, keyed=True, expect_replay=False), None),
                "guarded replay": (
                    sender(guarded, keyed=True, expect_replay=True),
                    sender(guarded, keyed=True, expect_replay=False),
                ),
            }
            if store == "postgres":
                contenders["bare first"] = (
                    sender(plain, keyed=True, expect_replay=False, path="/bare"),
                    None,
                )
                contenders["bare replay"] = (
                    sender(plain, keyed=True, expect_replay=True, path="/bare"),
                    sender(plain, keyed=True, expect_replay=False, path="/bare"),
                )
            else:  # the same round trips as "guarded first" in lease mode
                del contenders["wait=None first"]
            for name in contenders:  # warm the servers' pools
                contenders[name][0 if contenders[name][1] is None else 1](
                    [uuid.uuid4().hex for _ in range(20)]
                )
            spent = dict.fromkeys(contenders, 0.0)
            count = dict.fromkeys(contenders, 0)
            names = list(contenders)
            for turn in range(rounds * max(1, n // CHUNK)):
                order = names[turn % len(names) :] + names[: turn % len(names)]
                for name in order:
                    loop, prefill = contenders[name]
                    refs = [uuid.uuid4().hex for _ in range(CHUNK)]
                    if prefill is not None:
                        prefill(refs)
                    started = time.perf_counter()
                    loop(refs)
                    spent[name] += time.perf_counter() - started
                    count[name] += CHUNK
            rates = {name: count[name] / spent[name] for name in names}
    finally:
        with engine.begin() as conn:
            for table in ("payments", "ledger", "accounts", "bare"):
                conn.exec_driver_sql(f"DROP TABLE {prefix}_{table}")
        engine.dispose()
        if store == "postgres":
            import idemq  # noqa: PLC0415

            admin = idemq.SqlStore(PG_URL, table=f"{prefix}_dedup")
            admin.drop_schema()
            admin.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=300, help="requests per contender per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="postgres,redis")
    args = parser.parse_args()
    print(f"load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for store in args.only.split(","):
        rates = run(store, args.n, args.rounds)
        for name, rate in rates.items():
            print(f"{store:9} {name:16} {rate:8.0f} req/s")
        replay = rates["guarded replay"]
        print(
            f"{store:9} replay / guarded first (handler runs) = "
            f"{replay / rates['guarded first']:.2f}x  (target >= 2)"
        )
        print(
            f"{store:9} replay / plain first (handler, no middleware) = "
            f"{replay / rates['plain first']:.2f}x"
        )
        print(
            f"{store:9} guarded first / plain first = "
            f"{rates['guarded first'] / rates['plain first']:.2f}x  (target >= 0.85)"
        )
        if "wait=None first" in rates:
            print(
                f"{store:9} wait=None first / plain first = "
                f"{rates['wait=None first'] / rates['plain first']:.2f}x  (target >= 0.85)"
            )
        if "bare first" in rates:
            print(
                f"{store:9} bare first / plain first (the bound) = "
                f"{rates['bare first'] / rates['plain first']:.2f}x"
            )
            print(
                f"{store:9} guarded first / bare first = "
                f"{rates['guarded first'] / rates['bare first']:.2f}x"
            )
            print(f"{store:9} guarded replay / bare replay = {replay / rates['bare replay']:.2f}x")
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
