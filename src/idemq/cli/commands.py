"""What each ``idemq`` command does once :mod:`idemq.cli` has parsed its arguments: call the
library, render the answer (:mod:`.terminal`'s tables, or ``--json``), return an exit code named
below.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from idemq.cli.terminal import confirm, lab_console, say, show_table, tell
from idemq.errors import ConfigurationError, IdemqError
from idemq.guard.cache import DEFAULT_LOCAL_CACHE_TTL_S
from idemq.stores import admin
from idemq.stores.admin import record_dict
from idemq.stores.base import ForgetResult

__all__ = [
    "EXIT_ABORTED",
    "EXIT_FAILED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_STORE",
    "EXIT_USAGE",
    "cmd_chaos",
    "cmd_demo",
    "cmd_id_new",
    "cmd_id_parse",
    "cmd_inspect",
    "cmd_publish",
    "cmd_forget",
    "cmd_purge",
    "cmd_release",
    "cmd_schema",
    "cmd_stats",
    "cmd_worker",
]

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and the answer is "no" (demo invariant violated, …)
EXIT_USAGE = 2  # bad arguments or configuration (argparse uses 2 as well)
EXIT_NOT_FOUND = 3  # inspect: no such message id
EXIT_STORE = 4  # the store (or the broker) could not be reached or failed
EXIT_ABORTED = 5  # release: the operator said no (or no TTY to ask on and no --yes)
EXIT_REFUSED = 6  # release: the record is PROCESSED (deleting it would let it run twice)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str, ensure_ascii=False))


def _open_existing_store(args: argparse.Namespace) -> Any:
    """The store of ``--store`` (on ``--table`` / ``--prefix``); a SQLite file must exist."""
    return admin.open_store_for(args.store, table=args.table, prefix=args.prefix, must_exist=True)


def _show_record(data: dict[str, Any]) -> None:
    show_table(
        f"{data['message_id']} ({data['consumer']})",
        [
            (key, json.dumps(value, ensure_ascii=False) if key == "result" else str(value))
            for key, value in data.items()
        ],
    )


def cmd_demo(args: argparse.Namespace) -> int:
    console = lab_console("idemq demo")
    from idemq.chaos.demo import (  # noqa: PLC0415
        DemoConfig,
        demo_directory,
        intro,
        render_report,
        run_demo,
    )

    given = Path(args.dir) if args.dir else None
    with demo_directory(given, keep=args.keep) as directory:
        config = DemoConfig(
            directory, orders=args.orders, workers=args.workers, guard=not args.no_guard
        )
        if not args.json:
            console.rule("[bold]idemq demo[/bold]: exactly-once payments on an at-least-once queue")
            console.print(intro(config))
        report = run_demo(config, progress=(lambda _: None) if args.json else console.print)
    if args.json:
        _print_json({**report.__dict__, "ok": report.ok})
    else:
        render_report(report, console)
        if given is None and not args.keep:
            console.print("(queue and ledger removed; --keep keeps them to look at)")
        else:
            console.print(f"queue and ledger kept in {directory}")
    return EXIT_OK if report.ok else EXIT_FAILED


@contextmanager
def _store_errors_translated(doing: str, store_url: str) -> Iterator[None]:
    """A database or Redis failure escaping ``doing`` as the idemq error it is (exit 4, one
    line), not a driver traceback."""
    from redis import RedisError  # noqa: PLC0415
    from sqlalchemy.exc import SQLAlchemyError  # noqa: PLC0415

    from idemq.drivers.redis import translate_error  # noqa: PLC0415
    from idemq.drivers.sql import translate_db_error  # noqa: PLC0415
    from idemq.drivers.urls import mask_url  # noqa: PLC0415

    try:
        yield
    except SQLAlchemyError as exc:
        raise translate_db_error(exc, doing) from exc
    except RedisError as exc:
        raise translate_error(exc, doing, mask_url(store_url)) from exc


def cmd_chaos(args: argparse.Namespace) -> int:
    console = lab_console("idemq chaos")
    from idemq.chaos import ChaosConfig, run_chaos, write_report  # noqa: PLC0415
    from idemq.chaos.console import render_result, run_with_progress  # noqa: PLC0415

    config = ChaosConfig(
        broker_url=args.broker,
        store_url=args.store,
        messages=args.messages,
        workers=args.workers,
        kill_every_s=args.kill_every,
        slow_rate=args.slow_rate,
        partition_rate=args.partition_rate,
        guard=not args.no_guard,
        directory=Path(args.dir) if args.dir else None,
        ledger_url=args.ledger,
        timeout_s=args.timeout,
        seed=args.seed,
        keep=args.keep,
        rate_per_s=args.rate,
        tune_broker=args.tune_broker,
        two_hop=args.two_hop,
        hosts=args.hosts,
        cut_s=args.cut_s,
    )
    if args.json:
        try:
            with _store_errors_translated("idemq chaos", args.store):
                result = run_chaos(config)
        except IdemqError as error:
            # --json promises one JSON object on the last line, a refused run included.
            print(json.dumps({"ok": False, "error": f"{type(error).__name__}: {error}"}))
            raise
    else:
        with _store_errors_translated("idemq chaos", args.store):
            result = run_with_progress(config, console)
        render_result(result, console)
    if args.report:
        path = write_report(result, args.report)
        if not args.json:
            console.print(f"report: {path}")
    if args.json:
        print(json.dumps(result.to_json(), default=str))  # one line, the last one
    return EXIT_OK if result.ok else EXIT_FAILED


def cmd_worker(args: argparse.Namespace) -> int:
    from idemq.worker.run import run_worker  # noqa: PLC0415

    # MODULE:HANDLER is usually the user's own code in the current directory; a console script's
    # sys.path does not include it (uvicorn and celery add it the same way).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    run_worker(  # it logs its final counts itself ("idemq worker stopped: …")
        args.handler,
        broker_url=args.broker,
        queue=args.queue,
        store_url=args.store,
        consumer=args.consumer,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        max_attempts=args.max_attempts,
        metrics_port=args.metrics_port,
        batch_size=args.batch_size,
        batch_wait_ms=args.batch_wait_ms,
        relay=args.relay,
        outbox_table=args.outbox_table,
        declare=args.declare,
        dead_letter=args.dead_letter,
        table=args.table,
        prefix=args.prefix,
        give_up_after_s=args.give_up_after,
        log_error_text=args.log_error_text,
        mode=args.mode,
        lease_s=args.lease_s,
        expires_after_s=args.expires_after,
    )
    return EXIT_OK


def cmd_id_new(args: argparse.Namespace) -> int:
    from idemq.ids.generator import generate_ids  # noqa: PLC0415

    for message_id in generate_ids(
        args.prefix, args.node, args.n, sequence_digits=args.sequence_digits
    ):
        print(message_id)
    return EXIT_OK


def cmd_id_parse(args: argparse.Namespace) -> int:
    from idemq.ids.format import parse_message_id  # noqa: PLC0415

    _print_json(parse_message_id(args.id).to_dict())
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    store = _open_existing_store(args)
    try:
        records = admin.find_records(store, args.id, args.consumer)
    finally:
        store.close()
    if args.json:
        _print_json(records)
    elif records:
        for record in records:
            _show_record(record)
    else:
        tell(f"no record of message id {args.id!r}")
    return EXIT_OK if records else EXIT_NOT_FOUND


def cmd_stats(args: argparse.Namespace) -> int:
    from idemq.outbox import outbox_report  # noqa: PLC0415

    store = _open_existing_store(args)
    try:
        report = admin.stats_report(store)
        outbox = outbox_report(store, args.outbox_table)
        if outbox is not None:
            report["outbox"] = outbox
    finally:
        store.close()
    if args.json:
        _print_json(report)
        return EXIT_OK
    size = report["size_bytes"]
    rows = [
        ("processing", str(report["records"]["processing"])),
        ("processed", str(report["records"]["processed"])),
        ("stuck leases (expired, not completed)", str(report["stuck_leases"])),
        (
            "oldest processing",
            f"{report['oldest_processing']} ({report['oldest_processing_age_s']} s ago)"
            if report["oldest_processing"]
            else "-",
        ),
        ("oldest processed", str(report["oldest_processed"] or "-")),
        ("size", f"{size:,} bytes ({report['size_method']})" if size is not None else "?"),
    ]
    if outbox is not None:
        rows += [
            (f"outbox {outbox['table']}: pending", str(outbox["pending"])),
            ("outbox: oldest pending", f"{outbox['oldest_pending_age_s']} s ago"),
            ("outbox: dead (retry with `idemq outbox retry ID`)", str(outbox["dead"])),
        ]
    show_table(f"idemq store {report['store']}", rows)
    if report["stuck_records"]:
        columns = ("consumer", "message_id", "created_time", "attempts", "owner")
        show_table(
            "oldest stuck leases (free one with `idemq release ID`)",
            [[str(record[c]) for c in columns] for record in report["stuck_records"]],
            columns=columns,
        )
    return EXIT_OK


def cmd_release(args: argparse.Namespace) -> int:
    store = _open_existing_store(args)
    try:
        plan = admin.plan_release(store, args.id, args.consumer)
        if plan.verdict is admin.ReleaseVerdict.NOT_FOUND:
            tell(f"no record of message id {args.id!r}")
            return EXIT_NOT_FOUND
        if plan.verdict is admin.ReleaseVerdict.AMBIGUOUS:
            names = ", ".join(r.consumer for r in plan.records)
            tell(
                f"several consumers hold {args.id!r} in progress ({names}): "
                "name one with --consumer"
            )
            return EXIT_USAGE
        if plan.verdict is admin.ReleaseVerdict.PROCESSED:
            tell(f"refusing: {args.id!r} is PROCESSED; deleting it would let it run twice")
            return EXIT_REFUSED
        if not args.json:
            _show_record(record_dict(plan.record))
        if plan.lease_live:
            tell(
                "the lease has not expired: its worker may still be running, "
                "and another may now run it concurrently",
                label="warning",
                colour="yellow",
            )
        if not args.yes:
            if not sys.stdin.isatty():
                tell("not a terminal: pass --yes to release without asking")
                return EXIT_ABORTED
            if not confirm(f"release {args.id!r} ({plan.record.consumer})?"):
                return EXIT_ABORTED
        released = admin.release(store, plan.record)
    finally:
        store.close()
    if args.json:
        _print_json({"message_id": args.id, "consumer": plan.record.consumer, "released": released})
    elif released:
        say(f"released {args.id!r} ({plan.record.consumer}): it can be retried now")
    else:
        tell(f"{args.id!r} was completed or released meanwhile: nothing done")
    return EXIT_OK if released else EXIT_REFUSED


def cmd_forget(args: argparse.Namespace) -> int:
    store = _open_existing_store(args)
    try:
        result = store.forget(args.id, args.consumer, force=args.force)
    finally:
        store.close()
    if args.json:
        _print_json(
            {
                "message_id": args.id,
                "consumer": args.consumer,
                "result": result.value,
                "local_cache_bound_s": DEFAULT_LOCAL_CACHE_TTL_S,
            }
        )
    elif result is ForgetResult.FORGOTTEN:
        say(f"forgot {args.id!r} ({args.consumer}): its next delivery runs again")
        # Running guards with local_cache= do not hear of it: each entry expires on its own.
        say(
            f"  workers whose guard has local_cache= may still answer it DUPLICATE for up to "
            f"local_cache_ttl_s (default {DEFAULT_LOCAL_CACHE_TTL_S:g} s)"
        )
    elif result is ForgetResult.NOT_FOUND:
        tell(f"no record of message id {args.id!r} for consumer {args.consumer!r}")
    else:
        tell(
            f"refusing: a worker holds a live lease on {args.id!r} and may be mid-effect; "
            "wait for it to expire, or pass --force"
        )
    return {
        ForgetResult.FORGOTTEN: EXIT_OK,
        ForgetResult.NOT_FOUND: EXIT_NOT_FOUND,
        ForgetResult.LIVE_LEASE: EXIT_REFUSED,
    }[result]


def cmd_purge(args: argparse.Namespace) -> int:
    store = _open_existing_store(args)
    try:
        deleted = store.purge(args.older_than, batch_size=args.batch_size)
    finally:
        store.close()
    if args.json:
        _print_json({"deleted": deleted})
    else:
        say(f"deleted {deleted} processed records older than {args.older_than}")
    return EXIT_OK


def cmd_publish(args: argparse.Namespace) -> int:
    from idemq.brokers.publish import publish  # noqa: PLC0415

    body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()
    message_id = publish(
        args.broker,
        args.queue,
        body,
        message_id=args.id,
        business_id=args.business_id,
        headers=dict(args.header),
        prefix=args.prefix,
        attempts=args.attempts,
    )
    print(message_id)
    return EXIT_OK


def _family(dialect: str) -> str:
    return "mysql" if dialect == "mariadb" else dialect  # one DDL family, one SQLAlchemy dialect


def cmd_schema(args: argparse.Namespace) -> int:
    from idemq.outbox import Outbox, outbox_sql  # noqa: PLC0415
    from idemq.stores.sql.store import SqlStore, schema_sql  # noqa: PLC0415

    if args.store:
        store = SqlStore(args.store, table=args.table)
        if args.dialect is not None and _family(args.dialect) != _family(store.engine.dialect.name):
            store.close()
            raise ConfigurationError(
                f"--dialect {args.dialect} does not match the --store database"
                f" ({store.engine.dialect.name}); drop --dialect to create the table there"
            )
        try:
            store.create_schema()
            if not args.no_outbox:
                Outbox(store, table=args.outbox_table).create_schema()
        finally:
            store.close()
        tell(f"created (if missing) table {args.table} in {store.where}")
        return EXIT_OK
    dialect = args.dialect or "postgresql"
    print(schema_sql(dialect, table=args.table), end="")
    if not args.no_outbox:
        print("\n" + outbox_sql(dialect, table=args.outbox_table), end="")
    return EXIT_OK
