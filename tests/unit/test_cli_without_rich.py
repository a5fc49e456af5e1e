"""The CLI of a core install (no ``chaos`` extra, so no rich): plain aligned tables and lines,
and the lab's commands refusing with the extra to install. Each case runs in a fresh
interpreter in which ``import rich`` fails, as it does without the extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap

WITHOUT_RICH = "import sys\nsys.modules['rich'] = None\n"


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_RICH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_table_is_plain_text_aligned_on_its_widest_cell():
    done = run(
        """
        from idemq.cli.terminal import show_table
        show_table("idemq store sqlite/t", [("processing", "0"), ("stuck leases", "12")])
        show_table("stuck", [["orders", "M1"]], columns=("consumer", "message_id"))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "idemq store sqlite/t",
        "processing    0",
        "stuck leases  12",
        "stuck",
        "consumer  message_id",
        "orders    M1",
    ]


def test_an_operator_line_goes_to_stderr_with_its_label_and_brackets_kept():
    done = run(
        """
        from idemq.cli.terminal import say, tell
        say("released 'M[1]'")
        tell("idemq demo needs rich: pip install 'idemq[chaos]'", label="error")
        """
    )
    assert done.stdout == "released 'M[1]'\n"
    assert done.stderr == "error: idemq demo needs rich: pip install 'idemq[chaos]'\n"


def test_the_lab_commands_exit_2_naming_the_extra():
    for argv in (["demo"], ["chaos", "--broker", "embedded:///q.db", "--store", "sqlite://"]):
        done = run(f"from idemq.cli import main\nsys.exit(main({argv!r}))")
        assert done.returncode == 2, done.stderr
        assert "pip install 'idemq[chaos]'" in done.stderr
        assert "Traceback" not in done.stderr
