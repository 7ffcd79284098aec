"""The HPO study across MPI ranks: rank 0 serves the Optuna study, every rank runs the search
engine on its own devices.

Tests marked ``mpi`` launch real processes under ``mpirun`` (``tests/mpi_scripts/hpo_mlp.py``: a
tiny MLP space through the same CLI path as ``experiments.swinir_hpo``). The others check, in this
process, the pieces that need no second rank: the trial-source adapter over the study server,
the per-rank log prefix, the planner message for a trial too big for one rank, and the install
hint when mpi4py is missing.
"""

from __future__ import annotations

import io
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from _requirements import require_module

from scamp_jax.distributed.engine import RankStream, RemoteTrialSource, local_plans_only
from scamp_jax.distributed.mpi import MPIUnavailableError
from scamp_jax.study import FAIL_REASON, INTERRUPTED, TrialOutcome

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "mpi_scripts" / "hpo_mlp.py"


# ----------------------------------------------------------------------------- one process
def test_rank_stream_prefixes_every_line_and_holds_partial_lines():
    out = io.StringIO()
    stream = RankStream(3, out)
    stream.write("trial 1 planning\ntrial 2 ")
    assert out.getvalue() == "[rank 3] trial 1 planning\n"
    stream.write("queued\n")
    assert out.getvalue().splitlines() == ["[rank 3] trial 1 planning", "[rank 3] trial 2 queued"]
    assert not stream.isatty()


def test_run_search_mpi_without_mpi4py_raises_an_install_hint(monkeypatch):
    from scamp_jax.distributed.engine import run_search_mpi

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    with pytest.raises(MPIUnavailableError, match="pip install"):
        run_search_mpi(None, None, None, devices=[], memory_per_device=1)


def test_a_plan_too_big_for_one_rank_says_trials_do_not_span_ranks():
    from scamp_jax import planner

    def too_big(model, batch, *, devices, **kw):
        raise planner.DoesNotFitError("needs 2 GiB per device", 2 << 30, 1 << 30)

    plan = local_plans_only(too_big, local_devices=4)
    with pytest.raises(planner.DoesNotFitError, match="needs 2 GiB") as small:
        plan(None, None, devices=[0, 1])  # fewer than the rank has: the engine tries more
    assert "span" not in str(small.value)
    with pytest.raises(planner.DoesNotFitError, match="spanning ranks are not supported"):
        plan(None, None, devices=[0, 1, 2, 3])


def _local_source(tmp_path: Path, n_trials: int):
    require_module("mpi4py", "the mpi extra is not installed: pip install .[mpi]")
    import optuna

    from scamp_jax.distributed.study import StudyClient, StudyServer

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="s",
                                sampler=optuna.samplers.RandomSampler(seed=0),
                                load_if_exists=True)

    def suggest(trial):
        return {"x": trial.suggest_float("x", 0.0, 1.0)}

    # One process is a world of one rank: rank 0's server, used through the local client.
    server = StudyServer(study, suggest, n_trials)
    return study, server, RemoteTrialSource(StudyClient.local(server))


def test_remote_source_tells_attributes_and_requeues_an_interrupted_trial(tmp_path):
    study, server, source = _local_source(tmp_path, n_trials=2)
    first, second = source.ask(), source.ask()
    assert first is not None and second is not None and source.ask() is None
    assert first.checkpoint_key == f"trial_{first.number}"
    source.tell(TrialOutcome(first.number, "complete", value=0.5, attrs={"rank": 0, "steps": 7}))
    source.interrupt(second.number)
    assert source.remaining() == 1  # an interrupted trial does not count towards the total
    again = source.ask()
    assert again is not None and again.params == second.params
    assert again.checkpoint_key == second.checkpoint_key  # resumes from the same checkpoints
    source.tell(TrialOutcome(again.number, "failed", reason="diverged"))
    trials = {t.number: t for t in study.get_trials()}
    assert trials[first.number].value == 0.5 and trials[first.number].user_attrs["steps"] == 7
    assert trials[second.number].user_attrs[FAIL_REASON] == INTERRUPTED
    assert trials[again.number].user_attrs[FAIL_REASON] == "diverged"
    assert source.remaining() == 0 and source.ask() is None


def test_study_server_requeues_trials_a_dead_job_left_running(tmp_path):
    study, server, source = _local_source(tmp_path, n_trials=2)
    done, held = source.ask(), source.ask()
    source.tell(TrialOutcome(done.number, "complete", value=1.0))
    # `held` stays RUNNING, as when the rank running it is killed. The same command again:
    study2, server2, source2 = _local_source(tmp_path, n_trials=2)
    assert server2.stale_failed == [held.number] and server2.finished_before == 1
    rerun = source2.ask()
    assert rerun.params == held.params and rerun.checkpoint_key == held.checkpoint_key
    assert source2.ask() is None


# ----------------------------------------------------------------------------- under mpirun
def _launch(tmp_path: Path, ranks: int, *flags: str, timeout: float = 240):
    from test_mpi_runs import launcher, mpi_env

    cmd = [*launcher(ranks), sys.executable, str(SCRIPT), "--no-live", "--study-dir",
           str(tmp_path / "study"), *flags]
    return subprocess.run(cmd, env=mpi_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _stored_trials(tmp_path: Path) -> list[tuple[int, str, str | None]]:
    """(number, state, fail reason) of every trial in the study's SQLite storage."""
    con = sqlite3.connect(tmp_path / "study" / "study.db")
    rows = con.execute(
        "SELECT t.number, t.state, (SELECT value_json FROM trial_user_attributes a "
        "WHERE a.trial_id = t.trial_id AND a.key = ?) FROM trials t ORDER BY t.number",
        (FAIL_REASON,),
    ).fetchall()
    con.close()
    return [(n, s, None if r is None else json.loads(r)) for n, s, r in rows]


def _results(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "study" / "results.json").read_text())


@pytest.fixture
def _needs_mpi() -> None:
    require_module("mpi4py", "the mpi extra is not installed: pip install .[mpi]")


@pytest.mark.mpi
def test_study_split_across_two_ranks_records_every_trial_once_with_its_rank(
    tmp_path, _needs_mpi
):
    proc = _launch(tmp_path, 2, "--trials", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(tmp_path)
    numbers = [t["number"] for t in results["trials"]]
    assert sorted(numbers) == [0, 1, 2, 3]  # each trial exactly once
    assert all(t["state"] == "complete" and t["mse"] is not None for t in results["trials"])
    assert {t["rank"] for t in results["trials"]} == {0, 1}  # both ranks ran work
    assert results["run"]["ranks"] == 2 and results["run"]["trials_this_run"] == 4
    assert sorted(r["rank"] for r in results["run"]["per_rank"]) == [0, 1]
    assert [s for _, s, _ in _stored_trials(tmp_path)] == ["COMPLETE"] * 4
    assert "[rank 1]" in proc.stdout  # rank 1 logs plain lines under its rank


@pytest.mark.mpi
def test_study_split_across_four_ranks_records_every_trial_once(tmp_path, _needs_mpi):
    proc = _launch(tmp_path, 4, "--trials", "6", "--steps", "10", timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(tmp_path)
    assert results["run"]["ranks"] == 4 and results["run"]["devices"] == 8
    trials = results["trials"]
    assert sorted(t["number"] for t in trials) == list(range(6))
    assert {t["rank"] for t in trials} <= {0, 1, 2, 3} and len({t["rank"] for t in trials}) >= 2


@pytest.mark.mpi
@pytest.mark.slow
def test_a_killed_rank_stops_the_job_and_the_same_command_resumes_the_study(
    tmp_path, _needs_mpi
):
    died = _launch(tmp_path, 2, "--trials", "4", "--die-rank", "1")
    output = died.stdout + died.stderr
    assert died.returncode != 0, output
    assert "rank 1 is killed after telling trial" in output
    # The launcher names the dead rank (Open MPI: "mpirun noticed that process rank 1 with PID
    # ... exited on signal 9 (Killed)").
    assert "process rank 1 " in output
    assert not (tmp_path / "study" / "results.json").exists()
    before = {n for n, s, _ in _stored_trials(tmp_path) if s == "COMPLETE"}
    assert before, "rank 1 told one trial before it died"

    proc = _launch(tmp_path, 2, "--trials", "4")  # the same command again
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stored = _stored_trials(tmp_path)
    complete = {n for n, s, _ in stored if s == "COMPLETE"}
    assert before <= complete and len(complete) == 4  # nothing finished was lost
    # Everything else was a trial the dead job held: failed as interrupted and run again.
    assert all(r == INTERRUPTED for n, s, r in stored if s != "COMPLETE")
    results = _results(tmp_path)
    assert sorted(t["number"] for t in results["trials"]) == sorted(complete)


@pytest.mark.mpi
@pytest.mark.slow
def test_swinir_smoke_study_under_mpirun_records_every_trial_once(tmp_path, _needs_mpi):
    # The real entry point (about 3 minutes on 2 shared CPU cores: SwinIR compiles dominate).
    from test_mpi_runs import launcher, mpi_env

    cmd = [*launcher(2), sys.executable, "-m", "experiments.swinir_hpo", "--preset", "smoke",
           "--trials", "3", "--steps", "4", "--devices", "2", "--no-live", "--study-dir",
           str(tmp_path / "study")]
    proc = subprocess.run(cmd, env=mpi_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(tmp_path)
    assert sorted(t["number"] for t in results["trials"]) == [0, 1, 2]
    assert all(t["state"] == "complete" and t["psnr"] > 0 for t in results["trials"])
    assert {t["rank"] for t in results["trials"]} == {0, 1}
    assert results["run"]["ranks"] == 2
