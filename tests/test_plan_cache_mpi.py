"""The plan cache under MPI: the ranks of a study share ``plans.sqlite``.

Real ``mpirun`` processes (``tests/mpi_scripts/plan_cache_ranks.py``: the MLP study of
``hpo_mlp.py`` with each rank's planner compiles counted). A first job writes the cache from
both ranks at once; a second job on the same study, with more trials, plans every trial on every
rank without a compile.
"""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from _requirements import require_module

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "mpi_scripts" / "plan_cache_ranks.py"


def _launch(study: Path, ranks: int, trials: int) -> tuple[subprocess.CompletedProcess, dict]:
    from test_mpi_runs import launcher, mpi_env

    cmd = [*launcher(ranks), sys.executable, str(SCRIPT), "--no-live", "--study-dir",
           str(study), "--trials", str(trials), "--steps", "4"]
    proc = subprocess.run(cmd, env=mpi_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    counts = {
        int(rank): (int(plans), int(compiles))
        for rank, plans, compiles in re.findall(
            r"rank (\d+): (\d+) plan\(s\), (\d+) planner compile\(s\)", proc.stdout)
    }
    return proc, counts


@pytest.mark.mpi
@pytest.mark.slow
def test_ranks_share_the_plan_cache_and_a_second_job_plans_without_compiling(tmp_path):
    require_module("mpi4py", "the mpi extra is not installed: pip install .[mpi]")
    study = tmp_path / "study"
    first, counts = _launch(study, 2, trials=4)
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(counts) == [0, 1]
    assert sum(c for _, c in counts.values()) >= 1  # someone compiled to plan the architecture
    with sqlite3.connect(study / "plans.sqlite") as db:  # both ranks wrote one file
        (stored,) = db.execute("SELECT COUNT(*) FROM plans").fetchone()
    assert stored == 1  # one architecture, one device count, one budget: one plan

    second, counts = _launch(study, 2, trials=8)
    assert second.returncode == 0, second.stdout + second.stderr
    assert sorted(counts) == [0, 1]
    assert sum(p for p, _ in counts.values()) >= 1  # the new trials were planned ...
    assert all(c == 0 for _, c in counts.values()), counts  # ... from the shared cache
