"""Racing duplicates in several processes: each message's effect lands once."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from tests.conftest import unique
from tests.integration.django.conftest import ROOT, payments, subprocess_env

RACERS = 4
MESSAGES = 25


def test_racing_processes_apply_each_message_once(alias: str, django_project: Any, tmp_path: Path):
    consumer, prefix = unique("race"), unique("o")
    gate = tmp_path / "go"
    env = subprocess_env(django_project, alias)
    racers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.django.racer",
                consumer,
                prefix,
                str(MESSAGES),
                str(gate),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(RACERS)
    ]
    gate.touch()
    totals: Counter[str] = Counter()
    for racer in racers:
        out, err = racer.communicate(timeout=180)
        assert racer.returncode == 0, err
        totals.update(json.loads(out.strip().splitlines()[-1]))
    assert totals["PROCESSED"] == MESSAGES
    assert totals["PROCESSED"] + totals["DUPLICATE"] == RACERS * MESSAGES
    assert [payments(alias, f"{prefix}-{i}") for i in range(MESSAGES)] == [1] * MESSAGES
