"""A study's life: SIGTERM, a refused rerun, a resumed rerun.

A process runs a study (the MLP stand-in of ``test_runner`` through `run_search`, inside the
entry points' error handler `experiments._cli.user_errors`), is stopped with SIGTERM once a trial
has finished and the other has trained a while, is rerun with other steps (refused, the record
untouched; in this process, through the same handler), then rerun with the same settings to the
end, where the stopped trial resumes from the checkpoint SIGTERM saved. The record only grows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import optuna
import pytest
import sqlalchemy.exc
from optuna.trial import TrialState
from test_runner import SPACE, Regression

from experiments._cli import user_errors
from scamp_jax.hpo.checkpoint import newest_step
from scamp_jax.hpo.session import run_search
from scamp_jax.hpo.settings import SearchSettings
from scamp_jax.hpo.study import CHECKPOINT_KEY, storage_url

ROOT = Path(__file__).resolve().parent.parent


DRIVER = """
import sys
from scamp_jax.devices import configure_cpu_devices
configure_cpu_devices(8)
sys.path.insert(0, {tests!r})
import jax
from test_runner import Regression, SPACE
from experiments._cli import user_errors
from scamp_jax.hpo.session import run_search
from scamp_jax.hpo.settings import SearchSettings

settings = SearchSettings(**{settings!r}, study_dir={study_dir!r}, steps=int(sys.argv[1]))
with user_errors():
    run_search(SPACE, Regression(), settings, devices=jax.devices()[:2],
               memory_per_device=64 * 2**20, live=False)
"""
TESTS = ROOT / "tests"


#: The study: two trials, one at a time (fixed policy, two devices each). A trial of a planned
#: architecture compiles nothing, so the second trial is all training: long enough that SIGTERM,
#: sent once the first has finished and the second has reported its first evaluation (step
#: 1000), lands inside it. No checkpoint before a trial's end: a stopped trial's only one is
#: the one SIGTERM saved.
STEPS = 6000
SETTINGS = {"trials": 2, "max_batch_size": 16, "policy": "fixed", "devices_per_trial": 2,
            "sampler": "random", "pruner": "none", "checkpoint_every": 0, "eval_every": 1000}


def _settings(study_dir: str | Path, steps: int) -> SearchSettings:
    return SearchSettings(**SETTINGS, study_dir=str(study_dir), steps=steps)


def _command(study_dir: Path, steps: int = STEPS) -> list[str]:
    return [sys.executable, "-c", DRIVER.format(tests=str(TESTS), study_dir=str(study_dir),
                                               settings=SETTINGS),
            str(steps)]


def child_env() -> dict[str, str]:
    """The environment of a child Python process that runs a study (it sets up its own CPU
    devices)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return env


def _trials(study_dir: Path) -> list[optuna.trial.FrozenTrial]:
    try:
        [summary] = optuna.get_all_study_summaries(storage_url(study_dir))
        return optuna.load_study(study_name=summary.study_name,
                                 storage=storage_url(study_dir)).get_trials()
    except (ValueError, KeyError, sqlalchemy.exc.DBAPIError):
        return []  # the schema is still being written (see test_resume._wait_for_kill_point)


# Three processes start JAX: about 40 s on 2 busy cores.
def test_sigterm_checkpoints_writes_results_and_a_rerun_appends(tmp_path, capsys):
    study_dir = tmp_path / "study"
    proc = subprocess.Popen(_command(study_dir), cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        trials = _trials(study_dir) if (study_dir / "study.db").exists() else []
        if any(t.state == TrialState.COMPLETE for t in trials) and any(
                t.state == TrialState.RUNNING and t.intermediate_values for t in trials):
            break  # one finished and the other trains
        time.sleep(0.5)
    assert proc.poll() is None, "the study ended before SIGTERM"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "Traceback" not in err, err
    payload = json.loads((study_dir / "results.json").read_text())
    assert len(payload["runs"]) == 1 and payload["runs"][0]["interrupted"]
    assert payload["runs"][0]["elapsed_s"] > 0
    finished = [r["number"] for r in payload["trials"]]
    assert finished, payload
    # the trial SIGTERM stopped (the one training), and the step of the checkpoint it saved
    stopped = sorted(t.number for t in _trials(study_dir) if t.state == TrialState.FAIL)
    assert len(stopped) == 1, _trials(study_dir)
    [key] = [t.user_attrs[CHECKPOINT_KEY] for t in _trials(study_dir) if t.number in stopped]
    saved = newest_step(study_dir / "checkpoints" / key)
    assert saved is not None and saved >= 1000, saved  # past its first evaluation

    with pytest.raises(SystemExit) as refused, user_errors():
        run_search(SPACE, Regression(), _settings(study_dir, steps=30),
                   devices=jax.devices()[:2], memory_per_device=64 * 2**20, live=False)
    assert refused.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: ") and f"--steps {STEPS}" in line and "--steps 30" in line, line
    assert "--study-name" in line
    assert len(json.loads((study_dir / "results.json").read_text())["runs"]) == 1

    again = subprocess.run(_command(study_dir), cwd=ROOT, env=child_env(), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    payload = json.loads((study_dir / "results.json").read_text())
    assert len(payload["runs"]) == 2 and not payload["runs"][1].get("interrupted")
    assert len(payload["trials"]) == 2
    # the rerun says which stopped trials it runs again, and the results say which row is whose
    said = [line for line in again.stdout.splitlines() if "stopped by an earlier run" in line]
    assert len(said) == 1, again.stdout
    assert f"trial {stopped[0]}," in said[0], said
    # its retry trained on from the SIGTERM's checkpoint, not from the start
    assert [(r["retry_of"], r["resumed_from"]) for r in payload["trials"]
            if r["retry_of"] is not None] == [(stopped[0], saved)]
    assert set(finished) <= {r["number"] for r in payload["trials"]}
    for row in payload["trials"]:  # relative to the study, so a copied folder finds them
        assert row["checkpoint"] and not Path(row["checkpoint"]).is_absolute()
        assert (study_dir / row["checkpoint"]).is_dir()


def test_a_second_spaces_default_study_is_refused_the_first_ones_outputs(tmp_path):
    """Two spaces' default studies in one study_dir would both keep their outputs at its top
    level (results, ``checkpoints/trial_N``): the second is refused before it stores anything,
    the first's results stay whole, and with a name of its own it runs in a folder of its own."""
    import scamp_jax
    from scamp_jax.space import SearchSpace

    kw = dict(trials=1, steps=2, study_dir=tmp_path, devices=1, memory_per_device="64MiB",
              max_batch_size=8, sampler="random", live=False)
    scamp_jax.run_study(SPACE, Regression(), **kw)
    before = (tmp_path / "results.json").read_text()
    other = SearchSpace("mlp-other", SPACE.suggest, SPACE.build)
    with pytest.raises(ValueError, match=(
            f"{tmp_path} holds the outputs of study 'mlp' .*study 'mlp-other' "
            "would write over them: pass another study_dir, or study_name='mlp-other-2'")):
        scamp_jax.run_study(other, Regression(), **kw)
    assert (tmp_path / "results.json").read_text() == before
    storage = storage_url(tmp_path)
    assert "mlp-other" not in optuna.get_all_study_names(storage)
    done = scamp_jax.run_study(other, Regression(), study_name="mlp-other-2", **kw)
    assert done["trials_this_run"] == 1
    assert (tmp_path / "mlp-other-2" / "results.json").is_file()
    assert (tmp_path / "results.json").read_text() == before
    with pytest.raises(ValueError, match="study_name='mlp-other-3' to keep its outputs in"):
        scamp_jax.run_study(other, Regression(), **kw)  # a name no study there has
    scamp_jax.run_study(SPACE, Regression(), **{**kw, "trials": 2})  # the first resumes there
    assert len(json.loads((tmp_path / "results.json").read_text())["trials"]) == 2


def test_a_fixed_policy_wider_than_the_pool_is_refused_before_the_study_is_stored(tmp_path):
    """``devices_per_trial`` larger than the pool: refused with the way out, and nothing is
    stored, so the corrected run starts the study with its own settings."""
    import scamp_jax

    kw = dict(trials=1, steps=2, study_dir=tmp_path, devices=2, memory_per_device="64MiB",
              max_batch_size=8, sampler="random", live=False, policy="fixed")
    with pytest.raises(ValueError, match=r"devices_per_trial=4 exceeds the pool of 2 devices; "
                       r"lower devices_per_trial to 2 or less, or pass devices=4"):
        scamp_jax.run_study(SPACE, Regression(), devices_per_trial=4, **kw)
    assert not (tmp_path / "study.db").exists()
    done = scamp_jax.run_study(SPACE, Regression(), devices_per_trial=2,
                               **{**kw, "steps": 3})
    assert done["trials_this_run"] == 1


def _claim(args: tuple[str, str, object]) -> str:
    from scamp_jax.hpo.session import claim_outputs

    study_dir, name, barrier = args
    barrier.wait()
    try:
        claim_outputs(Path(study_dir), name)
    except ValueError:
        return "refused"
    return "claimed"


@pytest.mark.parametrize("names", [("a", "a"), ("a", "b")])
def test_processes_claiming_a_folder_at_once_agree_on_its_owner(tmp_path, names):
    """Two processes claim one study folder at the same moment (released by a barrier), many
    times: of one study both go on, of two studies exactly one does, and the file names it."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process running JAX
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        for i in range(20):
            barrier = manager.Barrier(2)
            folder = tmp_path / str(i)
            got = pool.map(_claim, [(str(folder), name, barrier) for name in names])
            owner = json.loads((folder / "outputs.json").read_text())["study"]
            if names[0] == names[1]:
                assert got == ["claimed", "claimed"]
            else:
                assert sorted(got) == ["claimed", "refused"], got
                assert owner == names[got.index("claimed")]
            assert [p.name for p in folder.iterdir()] == ["outputs.json"]  # no partial left


def test_outputs_from_before_studies_named_themselves_are_kept_for_their_study(tmp_path):
    """A folder with results and checkpoints but no outputs.json (an older release's): the
    study the storage holds claims it; a study it does not hold is refused."""
    from scamp_jax.hpo.session import claim_outputs

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="holds the outputs of another study .*study 'b' "
                       "would write over them"):
        claim_outputs(tmp_path, "b", lambda: ["a"])
    assert not (tmp_path / "outputs.json").exists()
    claim_outputs(tmp_path, "a", lambda: ["a"])
    assert json.loads((tmp_path / "outputs.json").read_text()) == {"study": "a"}


def test_a_run_stopped_before_its_engine_started_records_its_search_settings(tmp_path):
    """A run's entry in ``results.json`` holds its sampler, pruner and batch bounds
    (``search``) also where it stopped before the engine that records the rest began."""
    from scamp_jax.hpo.session import StudySession
    from scamp_jax.hpo.settings import SearchSettings

    settings = SearchSettings(trials=1, steps=1, study_dir=str(tmp_path), sampler="random",
                              max_batch_size=8)
    session = StudySession(SPACE, Regression(), settings, devices=jax.devices()[:1],
                           memory_per_device=64 * 2**20, live=False)
    session.report_interrupted(optuna.create_study(), 0.5, 0)
    [run] = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["interrupted"] and run["search"] == {
        "sampler": "random", "pruner": "median", "policy": "scamp",
        "min_batch_size": None, "max_batch_size": 8,
        "reference_batch": None}
