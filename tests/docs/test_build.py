"""The docs site builds with ``mkdocs build --strict``: a broken link, a missing page in the nav or
a reference mkdocstrings cannot resolve fails the build, and so this test."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import idemq.errors
from idemq.cli import commands, outbox_commands, schema_commands
from tests.conftest import CI
from tests.unit.test_readme import README, code_blocks, section

ROOT = Path(__file__).resolve().parents[2]
IDEMQ = str(Path(sys.executable).with_name("idemq"))


def require_mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") is None:
        message = "mkdocs is not installed (pip install -e '.[docs]')"
        if CI:
            pytest.fail(message)
        pytest.skip(message)


def build(site: Path) -> subprocess.CompletedProcess[str]:
    require_mkdocs()
    # mkdocstrings reads the sources under src/ (mkdocs.yml `paths`), not the installed package.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )


def test_mkdocs_build_strict(tmp_path: Path):
    site = tmp_path / "site"
    done = build(site)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    assert (site / "index.html").is_file()
    reference = (site / "reference" / "idemq" / "index.html").read_text(encoding="utf-8")
    assert "Idempotency" in reference  # mkdocstrings rendered the docstrings
    assert "IdemqError" in reference
    assert (site / "ops" / "alerts.yml").is_file()
    assert (site / "ops" / "grafana-idemq.json").is_file()


def test_troubleshooting_names_every_exception_and_exit_code():
    page = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    for name in idemq.errors.__all__:
        assert f"### {name}\n" in page, name
    codes = {getattr(commands, n) for n in commands.__all__ if n.startswith("EXIT_")}
    for code in codes:
        assert re.search(rf"^\| {code} \|", page, flags=re.M), code
    cli_page = (ROOT / "docs" / "ops" / "cli.md").read_text(encoding="utf-8")
    for name in (n for n in commands.__all__ if n.startswith("EXIT_")):
        assert f"`{name}`" in cli_page, name


def test_cli_page_lists_every_command():
    # cmd_demo -> `idemq demo`, cmd_id_new -> `idemq id new`: one function per command.
    functions = [*commands.__all__, *outbox_commands.__all__, *schema_commands.__all__]
    names = [n.removeprefix("cmd_").replace("_", " ") for n in functions if n[:4] == "cmd_"]
    assert "id new" in names
    page = (ROOT / "docs" / "ops" / "cli.md").read_text(encoding="utf-8")
    for name in names:
        assert f"`idemq {name}" in page, name


def cli_examples() -> list[str]:
    page = (ROOT / "docs" / "ops" / "cli.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```bash\n(.*?)```", page, flags=re.S)
    return [line for line in block.splitlines() if line]


@pytest.mark.parametrize("line", cli_examples())
def test_cli_page_examples_run(line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (quickstart,) = code_blocks(section("Quickstart"), "python")
    exec(compile(quickstart, "README quickstart", "exec"), {"__name__": "quickstart"})
    argv = shlex.split(line)
    assert argv[0] == "idemq"
    assert README  # the examples run on the database the README's quickstart creates
    done = subprocess.run(
        [IDEMQ, *argv[1:]], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_readme_links_into_the_docs_resolve():
    links = re.findall(r"\]\(((?:docs|bench|examples)/[^)#]+)(?:#[^)]*)?\)", README)
    assert len(links) >= 15, links
    for link in links:
        assert (ROOT / link).is_file(), link
