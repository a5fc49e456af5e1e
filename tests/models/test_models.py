"""The Promela models under ``models/``, checked with SPIN: the designs hold, the mutants fail.

Each check runs ``spin -a`` (with the check's ``-D`` switches) in a temporary directory, builds
``pan`` with the C compiler and lets it search the whole state space: for assertion violations
and invalid end states (safety, ``-DSAFETY``), or for acceptance cycles of the model's LTL
claim under weak fairness (liveness, ``pan -a -f``). A design check fails on any error and on
any search that did not finish (depth or memory limit). A mutant, or a configuration of the
current code that the design fixes, fails unless SPIN finds its violation: a model that cannot
tell the broken protocol from the right one proves nothing.

Needs ``spin`` (Debian package ``spin``) and a C compiler: skipped without them locally, a
failure under ``CI=true``. What each run explored is printed in the terminal summary.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import CI
from tests.models.citations import ROOT, citations, missing, model_header

pytestmark = pytest.mark.models

MODELS = Path(__file__).resolve().parents[2] / "models"
PAN_DEPTH = 200_000  # steps; the deepest model needs under 1,500
PAN_MEMORY_MB = 1024  # pan stops (and the check fails as incomplete) rather than swap
TIMEOUT_S = 300

# What pan prints when it did not search everything it was asked to.
INCOMPLETE = (
    "max search depth too small",
    "out of memory",
    "reached -DMEMLIM bound",
    "Search not completed",
)


@dataclass(frozen=True)
class Check:
    """One pan run: a model, its switches, and what SPIN must say."""

    model: str
    label: str
    defines: tuple[str, ...] = ()
    liveness: bool = False
    violation: str | None = None  # text pan must report; None: the model must hold
    ignore_assertions: bool = False  # liveness of a mutant whose assertions fail first

    @property
    def id(self) -> str:
        return f"{self.model}: {self.label}"


# lease.pml's promise: no worker but w believes it holds a live lease.
ALONE = (
    "assertion violated ((((w==0)||(prom[0]==0))&&((w==1)||(prom[1]==0)))&&((w==2)||(prom[2]==0)))"
)
CHECKS = [
    Check("lease", "store clock, safety"),
    Check("lease", "store clock, liveness", liveness=True),
    Check(
        "lease",
        "current code: each worker's clock judges",
        ("WORKER_CLOCK",),
        violation=ALONE,
    ),
    Check(
        "lease",
        "current code: release deletes the fence",
        ("RELEASE_DELETES",),
        violation="assertion violated (fence>max_fence)",
    ),
    Check(
        "lease",
        "mutant: complete without the owner check",
        ("MUTANT_COMPLETE_WITHOUT_OWNER",),
        violation="assertion violated ((owner==w)&&(fence==attempts))",
    ),
    Check(
        "lease",
        "mutant: takeover under another payload",
        ("MUTANT_TAKEOVER_ANY_PAYLOAD",),
        violation="assertion violated (payload==mine)",
    ),
    Check(
        "lease",
        "mutant: renew without the owner check",
        ("MUTANT_RENEW_WITHOUT_OWNER",),
        violation=ALONE,
    ),
    Check(
        "lease",
        "mutant: release without the owner check",
        ("MUTANT_RELEASE_WITHOUT_OWNER",),
        violation=ALONE,
    ),
    Check(
        "lease",
        "mutant: take over a completed record",
        ("MUTANT_TAKEOVER_COMPLETED",),
        violation="assertion violated (completions==1)",
    ),
    Check("batch", "MariaDB, safety"),
    Check("batch", "PostgreSQL, safety", ("POSTGRES",)),
    Check("batch", "MariaDB, liveness", liveness=True),
    Check("batch", "PostgreSQL, liveness", ("POSTGRES",), liveness=True),
    Check(
        "batch",
        "before ConfirmIn: a swallowed deadlock, MariaDB",
        ("NO_CONFIRM",),
        violation="assertion violated (row[i]&&(eff[i]==1))",
    ),
    Check(
        "batch",
        "before ConfirmIn: a swallowed error, PostgreSQL",
        ("NO_CONFIRM", "POSTGRES"),
        violation="assertion violated (row[i]&&(eff[i]==1))",
    ),
    Check(
        "batch",
        "mutant: carry on after the rollback, MariaDB",
        ("MUTANT_CARRY_ON",),
        violation="assertion violated (eff[i]<=1)",
    ),
    # Issue 24 saw the carry-on bug on MariaDB only; the model agrees: PostgreSQL keeps the
    # transaction, so ROLLBACK TO SAVEPOINT recovers it.
    Check("batch", "mutant: carry on, PostgreSQL (holds)", ("MUTANT_CARRY_ON", "POSTGRES")),
    Check("lease_batch", "safety"),
    Check("lease_batch", "2 overruns, safety", ("MAX_OVERRUN=2",)),
    Check("lease_batch", "liveness", liveness=True),
    Check(
        "lease_batch",
        "before issue 30: only the running handler's claim renewed",
        ("RENEW_RUNNING_ONLY",),
        violation="assertion violated (eff[m]<=(1+excuse[m]))",
    ),
    Check(
        "lease_batch",
        "mutant: no re-check before the handler starts",
        ("MUTANT_NO_RECHECK",),
        violation="assertion violated (eff[m]<=(1+excuse[m]))",
    ),
    Check("outbox", "PostgreSQL, 2 relays, safety"),
    Check("outbox", "PostgreSQL, 2 relays, liveness", liveness=True),
    Check(
        "outbox",
        "mutant: Outbox.add without the key's advisory lock",
        ("MUTANT_NO_KEY_LOCK",),
        violation="assertion violated in_order",
    ),
    Check(
        "outbox",
        "mutant: skip locked rows before picking a key's oldest",
        ("MUTANT_SKIP_LOCKED_FIRST",),
        violation="assertion violated in_order",
    ),
    Check(
        "outbox",
        "mutant: mark before publish, safety",
        ("MUTANT_MARK_BEFORE_PUBLISH",),
        violation="assertion violated in_order",
    ),
    Check(
        "outbox",
        "mutant: mark before publish, liveness",
        ("MUTANT_MARK_BEFORE_PUBLISH",),
        liveness=True,
        violation="acceptance cycle",
        ignore_assertions=True,
    ),
    Check("outbox_lease", "SQLite, 2 relays, safety"),
    Check("outbox_lease", "SQLite, 3 relays, safety", ("K=3",)),
    Check("outbox_lease", "SQLite, 2 relays, liveness", liveness=True),
    Check(
        "outbox_lease",
        "before issue 30: a relay stalled past its row lease",
        ("NO_ROW_FENCE",),
        violation="assertion violated first_or_excused",
    ),
    Check(
        "outbox_lease",
        "mutant: leases renewed, no check before the publish",
        ("MUTANT_NO_FENCE",),
        violation="assertion violated first_or_excused",
    ),
]


@dataclass(frozen=True)
class Tools:
    spin: str
    cc: str


@pytest.fixture(scope="module")
def tools() -> Tools:
    spin = shutil.which("spin")
    cc = shutil.which("cc") or shutil.which("gcc")
    if spin is not None and cc is not None:
        return Tools(spin, cc)
    missing = " and ".join(
        name for name, path in (("spin", spin), ("a C compiler (cc)", cc)) if path is None
    )
    message = f"{missing} not found (Debian: apt-get install -y spin gcc)"
    if CI:
        pytest.fail(f"{message} (CI=true: the model checks must run, not skip)")
    pytest.skip(message)


@dataclass(frozen=True)
class Search:
    """What pan printed about one search."""

    output: str
    seconds: float

    def _number(self, pattern: str) -> float:
        found = re.search(pattern, self.output)
        return float(found.group(1)) if found else float("nan")

    @property
    def errors(self) -> int:
        found = re.search(r"errors: (\d+)", self.output)
        assert found, f"pan printed no error count:\n{self.output}"
        return int(found.group(1))

    @property
    def incomplete(self) -> list[str]:
        return [marker for marker in INCOMPLETE if marker in self.output]

    @property
    def verdict(self) -> str:
        """What pan found — not what the check expects: a failed check must read as failed."""
        if self.errors:
            found = re.search(r"pan:\d+: (.*?)(?: \(at depth \d+\))?$", self.output, flags=re.M)
            what = found.group(1) if found else "an error"
            return "violated: " + what.removeprefix("assertion violated ")
        if self.incomplete or "Full statespace search" not in self.output:
            return "incomplete"
        return "held"

    @property
    def summary(self) -> str:
        states = self._number(r"([\d.e+]+) states, stored")
        transitions = self._number(r"([\d.e+]+) transitions")
        depth = self._number(r"depth reached (\d+)")
        return (
            f"{states:>11,.0f} states {transitions:>11,.0f} transitions "
            f"depth {depth:>4,.0f} {self.seconds:5.1f} s"
        )


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    if done.returncode != 0 and args[0] != "./pan":
        pytest.fail(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def search(check: Check, tools: Tools, workdir: Path) -> tuple[Search, list[str]]:
    """Generate, build and run pan for ``check`` in ``workdir``; the search and the -D flags."""
    model = f"{check.model}.pml"
    shutil.copyfile(MODELS / model, workdir / model)  # pan writes its trail beside the model
    defines = [f"-D{name}" for name in check.defines]
    if check.liveness:
        defines.append("-DLIVENESS")
    _run([tools.spin, *defines, "-a", model], workdir)
    # A liveness search visits each state several times over: -O2 halves it, for a build a few
    # seconds longer; a safety search is over sooner than that build.
    cflags = ["-O2" if check.liveness else "-O0", "-w", f"-DMEMLIM={PAN_MEMORY_MB}"]
    if not check.liveness:
        cflags.append("-DSAFETY")
    _run([tools.cc, *cflags, "-o", "pan", "pan.c"], workdir)
    pan = ["./pan", f"-m{PAN_DEPTH}"]
    if check.liveness:
        pan += ["-a", "-f"]
    if check.ignore_assertions:
        pan.append("-A")
    started = time.monotonic()
    output = _run(pan, workdir)
    return Search(output, time.monotonic() - started), defines


def counterexample(check: Check, tools: Tools, workdir: Path, defines: list[str]) -> str:
    """The trail pan wrote, replayed: the model's own printf lines and the failed claim."""
    replay = _run([tools.spin, "-t", *defines, f"{check.model}.pml"], workdir)
    keep = [
        line.strip()
        for line in replay.splitlines()
        if line.startswith(" ") or "Error:" in line or "CYCLE" in line
    ]
    return "\n".join(line for line in keep if line)


@pytest.mark.parametrize("check", CHECKS, ids=[c.id for c in CHECKS])
def test_model(
    check: Check,
    tools: Tools,
    tmp_path: Path,
    report_run: Callable[[str], None],
    record_property: Callable[[str, object], None],
) -> None:
    found, defines = search(check, tools, tmp_path)
    record_property("pan", found.output)
    report_run(f"{check.model:<12} {check.label:<58} {found.summary}  {found.verdict}")

    assert "Full statespace search" in found.output, found.output
    if check.violation is None:
        assert found.errors == 0, f"SPIN found a violation:\n{found.output}"
        assert not found.incomplete, (
            f"the search did not finish ({found.incomplete}):\n{found.output}"
        )
        return
    assert found.errors >= 1, f"SPIN did not catch {check.label!r}: a vacuous model?"
    assert check.violation in found.output, found.output
    trail = counterexample(check, tools, tmp_path, defines)
    record_property("counterexample", trail)
    assert "Error:" in trail or "CYCLE" in trail, trail


# A preprocessor condition, and the names it tests for being defined.
CONDITION = re.compile(r"^[ \t]*#[ \t]*(ifdef|ifndef|if|elif)\b(.*)$", flags=re.M)
DEFINED = re.compile(r"\bdefined\s*(?:\(\s*(\w+)\s*\)|(\w+))")


def switches(text: str) -> set[str]:
    """Every name a model tests with ``#ifdef``/``#ifndef``, or with ``defined`` in an ``#if`` or
    ``#elif`` (``defined(X)``, ``defined X``, combined with ``!``, ``&&``, ``||``), less the bounds
    it defines itself (with a default) and LIVENESS (how every liveness check runs)."""
    offered: set[str] = set()
    for kind, rest in CONDITION.findall(text):
        if kind in {"ifdef", "ifndef"}:
            offered.update(re.findall(r"^\s*(\w+)", rest))
        else:
            offered.update(a or b for a, b in DEFINED.findall(rest))
    defined = set(re.findall(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", text, flags=re.M))
    return offered - defined - {"LIVENESS"}


def test_switches_are_found_however_they_are_written() -> None:
    text = """
#ifdef A
#ifndef B
#if defined(C) || !defined D
# elif defined( E ) && !defined(F)
#if N > 2
#ifndef BOUND
#define BOUND 3
#endif
#ifdef LIVENESS
"""
    assert switches(text) == {"A", "B", "C", "D", "E", "F"}


def test_every_switch_a_model_offers_is_checked() -> None:
    """A mutant or current-code switch added to a model is run, so it cannot rot unchecked.

    A switch is a name the model tests for being defined but never defines itself (the bounds
    it does define, with a default); LIVENESS is how every liveness check runs."""
    checked = {(c.model, name.split("=")[0]) for c in CHECKS for name in c.defines}
    for path in sorted(MODELS.glob("*.pml")):
        text = path.read_text()
        unchecked = {name for name in switches(text) if (path.stem, name) not in checked}
        assert not unchecked, f"{path.name}: {sorted(unchecked)} never checked"
        labels = {c.label for c in CHECKS if c.model == path.stem and c.violation is None}
        assert any("safety" in label for label in labels), f"{path.name}: no safety check"
        assert any("liveness" in label for label in labels), f"{path.name}: no liveness check"


def test_every_cited_name_exists_in_src() -> None:
    """Each model header, and docs/how-we-know.md, cites the code it mirrors as ``path  Name``
    lines; a name renamed or removed in src/ fails here, so a model cannot drift from the code
    unnoticed."""
    found = []
    for path in sorted(MODELS.glob("*.pml")):
        cited = citations(model_header(path.read_text()), path.name)
        assert cited, f"{path.name}: its header cites no code (src/idemq/...py  Name lines)"
        found += cited
    page = ROOT / "docs" / "how-we-know.md"
    cited = citations(page.read_text(), page.name)
    assert cited, f"{page.name} cites no code"
    found += cited
    problems = missing(found)
    assert not problems, "\n".join(problems)


def test_a_citation_of_a_name_that_is_gone_is_reported(tmp_path: Path) -> None:
    module = tmp_path / "src" / "idemq" / "m.py"
    module.parent.mkdir(parents=True)
    module.write_text("class A:\n    x: int\n    def f(self) -> None: ...\nG = 1\n")
    text = " *   src/idemq/m.py  A.f, A.x, G, A.gone\n *   src/idemq/none.py  H\n"
    assert missing(citations(text, "t.pml"), tmp_path) == [
        "t.pml: src/idemq/m.py has no A.gone",
        "t.pml: src/idemq/none.py does not exist",
    ]


def test_the_summary_says_what_pan_found() -> None:
    """The verdict printed is pan's, not the check's expectation: a design check that failed
    must not read as one that held."""
    full = "Full statespace search for:\n"
    violated = "pan:1: assertion violated (x==1) (at depth 7)\n" + full + "errors: 1\n"
    assert Search(violated, 0.0).verdict == "violated: (x==1)"
    cycle = "pan:1: acceptance cycle (at depth 9)\n" + full + "errors: 1\n"
    assert Search(cycle, 0.0).verdict == "violated: acceptance cycle"
    assert Search(full + "errors: 0\n", 0.0).verdict == "held"
    cut = "error: max search depth too small\n" + full + "errors: 0\n"
    assert Search(cut, 0.0).verdict == "incomplete"
