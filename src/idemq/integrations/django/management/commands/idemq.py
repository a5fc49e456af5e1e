"""``python manage.py idemq …``: the idemq CLI with the project's database as the store.

``python manage.py idemq stats`` is ``idemq stats --store URL`` with URL made from
``DATABASES["default"]`` (``--database ALIAS`` before the subcommand picks another). The URL,
password included, never reaches a command line: ``ps`` would show it to every local user.
A ``--store`` given explicitly wins. Exit codes are the CLI's.

``worker`` runs on a :class:`~idemq.integrations.django.DjangoStore` instead (unless
``--store`` is given): its handlers' ORM writes are then on the connection of the dedup
transaction, so they commit or roll back with the dedup row, as ``Idempotency(DjangoStore())``
does in a project's own code. Stale connections are closed before each message, as Django does
around each request.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections, connections

from idemq.errors import ConfigurationError
from idemq.integrations.django._urls import database_url

__all__ = ["Command", "gives_store", "with_store", "worker_on_django"]

# The subcommands that take --store, by their words: each gets the project's database.
STORE_COMMANDS = frozenset(
    {
        ("worker",),
        ("relay",),
        ("stats",),
        ("inspect",),
        ("purge",),
        ("release",),
        ("forget",),
        ("outbox", "retry"),
        ("schema", "upgrade"),
    }
)


def with_store(idemq_args: list[str], url: str) -> list[str]:
    """``idemq_args`` with ``--store url`` added where the subcommand takes one and none is
    given."""
    words = tuple(idemq_args[:2])
    takes_store = words[:1] in STORE_COMMANDS or words in STORE_COMMANDS
    if not takes_store or gives_store(idemq_args):
        return list(idemq_args)
    return [*idemq_args, "--store", url]


def gives_store(idemq_args: list[str]) -> bool:
    """Whether ``idemq_args`` name a ``--store`` of their own."""
    return any(arg == "--store" or arg.startswith("--store=") for arg in idemq_args)


class Command(BaseCommand):
    """Run the idemq CLI on the project's database."""

    help = (
        "Run the idemq CLI (worker, relay, stats, inspect, purge, forget, schema upgrade …) with "
        "the project's database as --store. Usage: manage.py idemq [--database ALIAS] "
        "SUBCOMMAND [ARGS]"
    )
    requires_system_checks: list[str] = []  # noqa: RUF012 -- Django's own attribute

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database", default="default", help="the DATABASES alias used as the store"
        )
        parser.add_argument("idemq_args", nargs=argparse.REMAINDER, help="the idemq CLI's own")

    def handle(self, *args: Any, **options: Any) -> None:
        # Imported here: the CLI pulls in every command's module.
        from idemq.cli.parser import build_parser, run_command  # noqa: PLC0415

        alias = options["database"]
        if alias not in connections.settings:
            raise CommandError(f"no database {alias!r} in DATABASES")
        wrapper = connections[alias]
        url = database_url(wrapper.settings_dict, wrapper.Database.__name__)
        idemq_args = list(options["idemq_args"])
        parsed = build_parser().parse_args(
            with_store(idemq_args, url.render_as_string(hide_password=False))
        )
        on_django = idemq_args[:1] == ["worker"] and not gives_store(idemq_args)
        code = run_command(parsed, partial(worker_on_django, alias) if on_django else parsed.func)
        if code:
            raise SystemExit(code)


def worker_on_django(alias: str, args: argparse.Namespace) -> int:
    """``idemq worker`` (its parsed ``args``) on ``DjangoStore(using=alias)``, closing Django's
    stale connections before each message.

    ``close_old_connections`` is what Django runs around each request: it drops a connection
    past ``CONN_MAX_AGE`` or one that failed (a restarted database, a terminated backend), so
    the next message connects afresh instead of failing on it.
    """
    from idemq.cli.commands import cmd_worker  # noqa: PLC0415
    from idemq.integrations.django.store import DjangoStore  # noqa: PLC0415

    if args.prefix is not None:
        raise ConfigurationError("--prefix is for Redis stores; an SQL store takes --table")
    store = DjangoStore(using=alias, table=args.table, expires_after_s=args.expires_after)
    try:
        return cmd_worker(args, store=store, before_each=close_old_connections)
    finally:
        store.close()
