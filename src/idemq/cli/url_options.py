"""The CLI's URL options (``--store``, ``--broker``, ``--ledger``) and their environment variables.

One naming rule: option ``--NAME`` reads ``IDEMQ_NAME_URL`` when it is not on the command line
(``--store`` → ``IDEMQ_STORE_URL``, ``--broker`` → ``IDEMQ_BROKER_URL``, ``--ledger`` →
``IDEMQ_LEDGER_URL``); the command line wins when both are given. A URL on the command line is
in every process listing (``ps`` shows argv to every local user, ``/proc/PID/cmdline`` is world
readable), so one that holds a password is still accepted, with one warning line naming the
variable to use; the warning never shows the password.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from idemq.drivers.urls import mask_url

__all__ = ["ENV_RULE", "add_url_option", "argv_secrets_warning", "env_var_for"]

ENV_RULE = (
    "URL options read the environment when absent from the command line: --store from"
    " IDEMQ_STORE_URL, --broker from IDEMQ_BROKER_URL, --ledger from IDEMQ_LEDGER_URL. Prefer"
    " them for a URL with a password: every local user can read a command line (ps)."
)

# Where given URLs are noted, on the parsed namespace: (option, variable, value) per URL option
# that came from argv.
_FROM_ARGV = "url_options_from_argv"

# Query arguments that carry a secret in URLs the drivers accept (libpq's password, a token).
_SECRET_QUERY_KEYS = frozenset({"password", "passwd", "token", "auth_token"})


def env_var_for(option: str) -> str:
    """``--store`` → ``IDEMQ_STORE_URL``: the variable an URL option reads."""
    return f"IDEMQ_{option.lstrip('-').upper().replace('-', '_')}_URL"


class _UrlAction(argparse.Action):
    """Stores the URL and notes that it came from argv, for :func:`argv_secrets_warning`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        from_env = values is None  # a bare "--store" (nargs="?"): the variable, which must be set
        if from_env:
            values = self.const
            if values is None:
                parser.error(f"{self.option_strings[0]} without a URL reads {self.metavar}: unset")
        setattr(namespace, self.dest, values)
        if not from_env:
            noted = [*getattr(namespace, _FROM_ARGV, [])]
            noted.append((self.option_strings[0], env_var_for(self.option_strings[0]), values))
            setattr(namespace, _FROM_ARGV, noted)


def add_url_option(
    command: argparse.ArgumentParser,
    option: str,
    help_: str,
    *,
    required: bool = True,
    env_default: bool = True,
) -> None:
    """``option`` on ``command``, read from :func:`env_var_for` (``option``) when absent.

    ``required``: argparse's error when neither the option nor the variable gives a URL.
    ``env_default=False`` is for an option whose mere presence changes what a command does
    (``schema --store`` creates tables instead of printing them): a variable set for other
    commands must not switch it silently, so there the bare option (``--store`` alone) reads
    the variable.
    """
    variable = env_var_for(option)
    value = os.environ.get(variable) or None  # an empty variable is no URL
    if env_default:
        command.add_argument(
            option,
            action=_UrlAction,
            default=value,
            required=required and value is None,
            metavar="URL",
            help=f"{help_} (default: ${variable})",
        )
        return
    command.add_argument(
        option,
        action=_UrlAction,
        nargs="?",
        const=value,
        metavar=variable,
        help=f"{help_}; {option} alone reads ${variable}",
    )


def argv_secrets_warning(
    args: argparse.Namespace, process_argv: Sequence[str] | None = None
) -> str | None:
    """One line naming the variables to use, when URLs given as options hold a secret that is in
    ``process_argv`` (default ``sys.argv``, what ``ps`` shows); else None.

    A program calling :func:`idemq.cli.main` with a list it built (a ``manage.py`` command from
    its settings) has no such URL in its own command line: nothing to warn about. The line
    names the options and variables only, never a URL, masked or not.
    """
    visible = sys.argv if process_argv is None else process_argv
    given: list[tuple[str, str, str]] = getattr(args, _FROM_ARGV, [])
    leaking = [
        (option, variable)
        for option, variable, url in given
        if holds_secret(url) and any(url in arg for arg in visible)
    ]
    if not leaking:
        return None
    options = ", ".join(option for option, _ in leaking)
    variables = ", ".join(variable for _, variable in leaking)
    return (
        f"{options}: a password on the command line is visible to every local user (ps);"
        f" set {variables} instead"
    )


def holds_secret(url: str) -> bool:
    """Whether ``url`` carries a secret: a password (or a NATS token) in its user part, which
    :func:`~idemq.drivers.urls.mask_url` would hide, or a password query argument."""
    if mask_url(url) != url:
        return True
    try:
        query = urlsplit(url).query
    except ValueError:
        return False
    return any(key.lower() in _SECRET_QUERY_KEYS for key, _ in parse_qsl(query))
