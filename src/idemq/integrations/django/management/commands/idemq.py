"""``python manage.py idemq …``: the idemq CLI with the project's database as the store.

``python manage.py idemq stats`` is ``idemq stats --store URL`` with URL made from
``DATABASES["default"]`` (``--database ALIAS`` before the subcommand picks another). The URL,
password included, never reaches a command line: ``ps`` would show it to every local user.
A ``--store`` given explicitly wins. Exit codes are the CLI's.
"""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from idemq.integrations.django._urls import database_url

__all__ = ["Command"]

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
    given = any(arg == "--store" or arg.startswith("--store=") for arg in idemq_args)
    if not takes_store or given:
        return list(idemq_args)
    return [*idemq_args, "--store", url]


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
        from idemq.cli import main  # noqa: PLC0415 -- the CLI pulls in every command's module

        alias = options["database"]
        if alias not in connections.settings:
            raise CommandError(f"no database {alias!r} in DATABASES")
        wrapper = connections[alias]
        url = database_url(wrapper.settings_dict, wrapper.Database.__name__)
        argv = with_store(list(options["idemq_args"]), url.render_as_string(hide_password=False))
        code = main(argv)
        if code:
            raise SystemExit(code)
