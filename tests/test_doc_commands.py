"""The commands, tests and shell lines the documents show are the ones that work.

`tests._doc_commands` finds every ``python -m MODULE ARGS`` command of the Markdown pages and of
the experiments' and benchmarks' docstrings and runs each module's ``main`` up to the job
itself, in a process of its own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests._doc_commands import ROOT, commands_in, doc_pages, documented_commands


def test_the_documents_show_commands():
    commands = documented_commands()
    assert len(commands) > 100
    modules = {c.module for c in commands}
    assert {"experiments.swinir_hpo", "benchmarks.fusion", "benchmarks.simulate_cluster"} <= modules


def test_every_documented_command_gets_past_its_flag_checks():
    proc = subprocess.run([sys.executable, "-m", "tests._doc_commands"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["failures"] == [] and proc.returncode == 0, "\n".join(report["failures"])


def test_a_command_with_a_flag_its_module_lacks_is_found_and_fails():
    """The check can fail: a made-up flag of a real command, in a page's code block."""
    page = "Run it:\n\n    python -m benchmarks.fusion --family swinir --no-such-flag\n"
    [command] = commands_in(page, "page.md")
    assert (command.module, command.argv) == ("benchmarks.fusion",
                                              ["--family", "swinir", "--no-such-flag"])
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from tests._doc_commands import check, commands_in; "
         f"o = check(commands_in({page!r}, 'page.md')[0]); print(o.ok, o.stage, o.message)"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.stdout.startswith("False parser exit 2:"), proc.stdout + proc.stderr[-2000:]
    assert "--no-such-flag" in proc.stdout


def _referenced_tests() -> list[tuple[str, str]]:
    found = []
    for page in doc_pages():
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for m in re.finditer(r"(tests/[\w/]+\.py)(?:::([\w:]+))?", line):
                found.append((f"{page.relative_to(ROOT)}:{n}", m.group(0)))
    return found


@pytest.mark.parametrize("where,ref", _referenced_tests(), ids=lambda x: str(x))
def test_referenced_test_exists(where, ref):
    path, _, names = ref.partition("::")
    assert (ROOT / path).is_file(), f"{where}: {path} does not exist"
    text = (ROOT / path).read_text()
    for name in filter(None, names.split("::")):
        assert re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", text, re.M), \
            f"{where}: {path} defines no {name}"


def test_no_assignment_after_nice():
    """``nice -n 5 VAR=value cmd`` makes nice run ``VAR=value`` as a program: the assignment
    goes first (``VAR=value nice -n 5 cmd``)."""
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in doc_pages()
           for n, line in enumerate(p.read_text().split("\n"), 1)
           if re.search(r"\bnice\b(?:\s+-n\s*\d+)?\s+[A-Z_]+=", line)]
    assert not bad, f"nice before a variable assignment: {bad}"
