"""The README's examples run as written, and CI runs the README's test command."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
IDEMQ = str(Path(sys.executable).with_name("idemq"))


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_opens_with_the_two_setup_commands():
    commands = code_blocks(README.split("---")[0], "bash")
    assert len(commands) == 2
    assert "idemq demo" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in README
    assert "sed -n '/<!-- test-command -->/" in ci
    assert '"$rc" -eq 5' in ci, "pytest's exit 5 (no tests) must fail CI"
    assert "exit 1" in ci


def test_quickstart_runs_as_written(tmp_path, monkeypatch, capsys):
    (code,) = code_blocks(section("Quickstart"), "python")
    assert len(code.strip().splitlines()) <= 18
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README quickstart", "exec"), {"__name__": "quickstart"})
    assert capsys.readouterr().out.splitlines() == [
        "processed {'paid': 42}",
        "duplicate {'paid': 42}",
        "duplicate {'paid': 42}",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "line", [c for c in code_blocks(section("Command line"), "bash")[0].splitlines() if c]
)
def test_cli_examples_run(line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (code,) = code_blocks(section("Quickstart"), "python")
    exec(compile(code, "README quickstart", "exec"), {"__name__": "quickstart"})
    argv = shlex.split(line)
    assert argv[0] == "idemq"
    done = subprocess.run(
        [IDEMQ, *argv[1:]], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_every_python_snippet_of_the_readme_is_run():
    # The quickstart is the README's only Python; the docs pages' snippets run in tests/docs.
    assert code_blocks(README, "python") == code_blocks(section("Quickstart"), "python")
