"""``idemq schema upgrade``: bring tables of an older idemq to the current version in place
(parsed in :mod:`idemq.cli.parser`; the work is :mod:`idemq.migrations`')."""

from __future__ import annotations

import argparse
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from idemq.cli.commands import EXIT_OK
from idemq.cli.terminal import tell
from idemq.errors import ConfigurationError
from idemq.stores.sql.versions import VERSION_TABLE, TableUpgrade

__all__ = ["cmd_schema_upgrade"]


def _refuse_missing_sqlite_file(url: str) -> None:
    # Opening a SQLite file that is not there would create an empty database.
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigurationError(f"not a store URL: {url!r}") from exc
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or database in (None, "", ":memory:"):
        return
    if not database.startswith("file:") and not Path(database).exists():
        raise ConfigurationError(f"no SQLite database at {database!r}")


def _describe(plan: TableUpgrade) -> str:
    recorded = "none" if plan.recorded is None else str(plan.recorded)
    state = f"table {plan.table} ({plan.kind}): version {plan.found} (recorded: {recorded})"
    if not plan.needed:
        return f"{state}, current"
    built = len([s for s in plan.statements if not s.startswith("SET ")])
    return f"{state} -> {plan.current}, {built} statement(s) to run"


def cmd_schema_upgrade(args: argparse.Namespace) -> int:
    """Plan, print (``--dry-run``) or run the upgrade of the dedup and outbox tables."""
    from idemq.migrations import upgrade_schema  # noqa: PLC0415
    from idemq.stores.sql import SqlStore  # noqa: PLC0415

    _refuse_missing_sqlite_file(args.store)
    store = SqlStore(args.store, table=args.table)
    try:
        outbox = None if args.no_outbox else args.outbox_table
        plans = upgrade_schema(store, outbox_table=outbox, dry_run=args.dry_run)
    finally:
        store.close()
    for plan in plans:
        tell(_describe(plan))
        if args.dry_run and plan.needed:
            print(f"-- {plan.table}: version {plan.found} -> {plan.current}")
            for statement in plan.statements:
                print(f"{statement};")
            print(f"-- then {plan.table} is recorded at version {plan.current} in {VERSION_TABLE}")
    if not args.dry_run:
        done = [plan.table for plan in plans if plan.needed]
        message = f"upgraded {', '.join(done)}" if done else "nothing to upgrade"
        tell(f"{message} in {store.where}")
    return EXIT_OK
