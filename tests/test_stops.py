"""A stop (Ctrl-C, SIGTERM) never splits a study's bookkeeping: `scamp_jax._signals.stops_held`,
with real signals sent to this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optuna
import pytest
from test_runner import SPACE, Regression

import scamp_jax
from scamp_jax._signals import interruptible, left_behind, stops_held
from scamp_jax.hpo.runner import load_model
from scamp_jax.hpo.session import stop_kept
from scamp_jax.hpo.study import storage_url
from scamp_jax.space import SearchSpace


def test_a_stop_inside_the_block_comes_after_it():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with stops_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_stop_is_delivered_at_once_after_the_first():
    calls = []

    def handler(signum, frame):
        calls.append(signum)
        if len(calls) == 2:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(KeyboardInterrupt), stops_held():
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls == []  # held
            os.kill(os.getpid(), signal.SIGINT)  # the first is delivered, then this one
            calls.append("not reached")
        assert calls == [signal.SIGTERM]  # the SIGINT went to Python's handler, which raised
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_repeated_sigterm_is_held_as_one():
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with stops_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's second: not a second stop
            done = "the block ran to its end"
        assert done and calls == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_off_the_main_thread_nothing_is_held():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_in_block()))
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def _layers(weights, x):
    for i, w in enumerate(weights):
        x = jnp.tanh(x @ w) * (i + 1.0) + jnp.sort(x @ w, axis=-1)
    return jnp.sum(x)


def test_a_ctrl_c_while_interruptible_work_compiles_stops_the_wait_at_once():
    """`interruptible` (how ``--plan-only`` plans): a Ctrl-C comes while XLA still compiles, not
    when the compile returns, as it would on the main thread; the compile is left running."""
    weights = [jax.ShapeDtypeStruct((16 + i % 7, 16 + (i + 1) % 7), jnp.float32)
               for i in range(20)]  # a compile of a few seconds on 2 cores
    lowered = jax.jit(jax.grad(_layers)).lower(weights, jax.ShapeDtypeStruct((8, 16),
                                                                             jnp.float32))
    compiled_at: list[float] = []

    def ctrl_c() -> None:
        if not compiled_at:  # never after the compile: it would land outside this test
            os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(0.3, ctrl_c)

    def plan() -> None:
        timer.start()
        lowered.compile()
        compiled_at.append(time.monotonic())

    try:
        with pytest.raises(KeyboardInterrupt):
            interruptible(plan)
    finally:
        timer.cancel()
    stopped_at = time.monotonic()
    assert left_behind()  # the compile runs on
    while left_behind():
        time.sleep(0.05)
    assert compiled_at and stopped_at < compiled_at[0]


def test_work_that_ends_gives_its_result_or_raises_its_error():
    assert interruptible(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        interruptible(lambda: 1 / 0)
    assert not left_behind()


_LEFT_COMPILING = """
import os, signal, sys, threading
import jax, jax.numpy as jnp
sys.path.insert(0, {tests!r})
from test_stops import _layers
from experiments._cli import user_errors
from scamp_jax._signals import interruptible

weights = [jax.ShapeDtypeStruct((16 + i % 7, 16 + (i + 1) % 7), jnp.float32) for i in range(20)]
lowered = jax.jit(jax.grad(_layers)).lower(weights, jax.ShapeDtypeStruct((8, 16), jnp.float32))

def plan():
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    lowered.compile()
    print("compiled", flush=True)

with user_errors(resumable=False):  # as --plan-only runs its planning
    interruptible(plan)
"""


def test_a_command_stopped_while_work_it_left_compiles_exits_130_not_a_crash():
    """A command whose Ctrl-C left a compile running (``--plan-only``) ends with its one line
    and exit status 130 at once: the interpreter's shutdown under the running compile crashed
    it (exit status 134 or 139 in three of four runs), so it ends without one. Twice, as the
    crash does not come every time."""
    root = Path(__file__).resolve().parents[1]
    script = _LEFT_COMPILING.format(tests=str(root / "tests"))
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert proc.returncode == 130, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith("interrupted: nothing was stored")
        assert "compiled" not in proc.stdout


_TWO_CTRL_C = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from experiments._cli import user_errors

with user_errors({kw}):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:  # the command's stop under way: Ctrl-C again
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
"""


@pytest.mark.parametrize("kw, says", [
    ("", "stopped at once: finished trials are in the study"),
    ("resumable=False", "stopped at once: nothing was stored (planning stores no study)"),
    ("stopped='the benchmark stopped'", "stopped at once: the benchmark stopped"),
])
def test_a_second_ctrl_c_says_what_this_command_leaves(kw, says):
    """Ctrl-C twice: the process ends at once (130), saying what the command it ran leaves: a
    study's trials, a plan (nothing), or a command's own words (a benchmark's)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", _TWO_CTRL_C.format(root=str(root), kw=kw)],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(says), proc.stderr


def _in_block():
    with stops_held():
        return signal.getsignal(signal.SIGINT)


def test_a_ctrl_c_while_a_trial_is_asked_gives_it_back(tmp_path):
    """Ctrl-C while the sampler draws the second trial (here the space's ``suggest`` sends the
    SIGINT to this process): the trial is asked whole and given back with the first (where
    that one has not ended yet), so the study holds no trial left running, and the next run
    completes the rest at once."""
    sent = []

    def suggest(trial):
        params = SPACE.suggest(trial)
        if trial.number == 1 and not sent:
            os.kill(os.getpid(), signal.SIGINT)
            sent.append(trial.number)
        return params

    space = SearchSpace(SPACE.name, suggest, SPACE.build, largest=SPACE.largest)
    reference = Regression()
    task = scamp_jax.FunctionTask(metric="mse", direction="minimize", loss_fn=reference.loss_fn,
                                  batches=reference.batches, evaluate=reference.evaluate)
    kw = dict(trials=3, steps=2, study_dir=tmp_path, live=False, memory_per_device="64MiB",
              max_batch_size=8, sampler="random")
    with pytest.raises(KeyboardInterrupt):
        scamp_jax.run_study(space, task, **kw)
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    states = [t.state for t in study.trials]
    assert sent and optuna.trial.TrialState.RUNNING not in states, states
    finished = states.count(optuna.trial.TrialState.COMPLETE)  # the first, if it ended before
    done = scamp_jax.run_study(space, task, **kw)  # no trial to wait for: a heartbeat's minute
    assert finished <= 1 and done["trials_this_run"] == 3 - finished


def _space_that(raises_at: int, action) -> SearchSpace:
    def suggest(trial):
        params = SPACE.suggest(trial)
        if trial.number == raises_at:
            action(params)
        return params

    return SearchSpace(SPACE.name, suggest, SPACE.build, largest=SPACE.largest)


def _regression_task():
    reference = Regression()
    return scamp_jax.FunctionTask(metric="mse", direction="minimize", loss_fn=reference.loss_fn,
                                  batches=reference.batches, evaluate=reference.evaluate)


def _task_stopped_at_its_first_evaluation() -> tuple[Any, list[bool], Regression]:
    """The regression task whose first evaluation sends this process a Ctrl-C (then returns):
    ``(task, sent, reference)``, ``sent`` holding ``True`` once it has."""
    sent: list[bool] = []
    reference = Regression()

    def evaluate(model):
        if not sent:
            os.kill(os.getpid(), signal.SIGINT)
            sent.append(True)
        return reference.evaluate(model)

    task = scamp_jax.FunctionTask(metric="mse", direction="minimize", loss_fn=reference.loss_fn,
                                  batches=reference.batches, evaluate=evaluate)
    return task, sent, reference


def test_a_trial_that_completes_while_the_study_stops_is_told_complete(tmp_path):
    """A Ctrl-C while a trial evaluates (here its ``evaluate`` sends the SIGINT, then returns):
    the stop finds a run that ended complete, and the study keeps its score; it is not given
    back to be trained again."""
    task, sent, reference = _task_stopped_at_its_first_evaluation()
    kw = dict(trials=2, steps=2, study_dir=tmp_path, live=False, memory_per_device="64MiB",
              max_batch_size=8, sampler="random", max_running_trials=1)
    with pytest.raises(KeyboardInterrupt) as stopped:
        scamp_jax.run_study(SPACE, task, **kw)
    # the stop carries what it kept, which a command line's last line says
    assert stop_kept(stopped.value) == (
        f"the study's 1 finished trial is in its database and {tmp_path / 'results.json'}")
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    first = study.trials[0]
    assert sent and first.state == optuna.trial.TrialState.COMPLETE, first.state
    # its score is its trained model's (not a placeholder): the saved model scores it again
    assert first.value is not None and first.value == first.user_attrs["metrics"]["mse"]
    model = load_model(tmp_path / first.user_attrs["checkpoint"], SPACE, first.params)
    assert reference.evaluate(model)["mse"] == pytest.approx(first.value, rel=1e-5)
    assert optuna.trial.TrialState.RUNNING not in [t.state for t in study.trials]


def test_a_sigterm_stops_a_library_study_as_ctrl_c_does(tmp_path):
    """A scheduler's SIGTERM to a script calling run_study: its trials go back to the study
    (none left running for a heartbeat to find), and SIGTERM's default action is back after."""
    sent = []

    def terminate(params):
        if not sent:
            os.kill(os.getpid(), signal.SIGTERM)
            sent.append(True)

    kw = dict(trials=3, steps=2, study_dir=tmp_path, live=False, memory_per_device="64MiB",
              max_batch_size=8, sampler="random")
    from scamp_jax._signals import Terminated

    with pytest.raises(Terminated):
        scamp_jax.run_study(_space_that(1, terminate), _regression_task(), **kw)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    assert sent and optuna.trial.TrialState.RUNNING not in [t.state for t in study.trials]


def test_a_space_that_prunes_in_suggest_rejects_those_configurations(tmp_path):
    def prune(params):
        raise optuna.TrialPruned(f"width {params['width']} is not wanted")

    done = scamp_jax.run_study(_space_that(1, prune), _regression_task(), trials=3, steps=2,
                               study_dir=tmp_path, live=False, memory_per_device="64MiB",
                               max_batch_size=8, sampler="random")
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    states = [t.state.name for t in study.trials]
    assert states == ["COMPLETE", "PRUNED", "COMPLETE"], states
    assert done["trials_this_run"] == 2  # trained; the pruned one counts in the study's total
    assert "pruned by the search space's suggest: width" in study.trials[1].user_attrs[
        "fail_reason"]


def test_a_bug_in_suggest_stops_the_study_and_leaves_no_trial_running(tmp_path):
    def bug(params):
        raise KeyError("depth")

    kw = dict(trials=3, steps=2, study_dir=tmp_path, live=False, memory_per_device="64MiB",
              max_batch_size=8, sampler="random")
    with pytest.raises(KeyError, match="depth"):
        scamp_jax.run_study(_space_that(1, bug), _regression_task(), **kw)
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    assert optuna.trial.TrialState.RUNNING not in [t.state for t in study.trials]
    first = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    closed = study.trials[1]  # its suggest raised
    assert closed.state == optuna.trial.TrialState.FAIL
    done = scamp_jax.run_study(SPACE, _regression_task(), **kw)  # fixed: the whole total runs
    assert first + done["trials_this_run"] == 3  # the closed trial is not counted
    completed = [t.params for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert closed.params in completed  # its configuration was queued again, not lost


def test_a_stop_under_mpirun_says_what_a_ctrl_c_does_there(monkeypatch):
    """A rank's stop notice told to press Ctrl-C again to stop at once; under mpirun the
    terminal's Ctrl-C goes to mpirun, which ends the ranks itself a second later."""
    from scamp_jax.hpo.endings import second_ctrl_c

    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert "Ctrl-C again" in second_ctrl_c()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.delenv("OMPI_MCA_odls_base_sigkill_timeout", raising=False)
    said = ("under mpirun a Ctrl-C goes to mpirun, which ends the ranks itself (Open MPI: "
            "SIGTERM {0} s after it, SIGKILL {0} s later); a stop with every running trial's "
            "checkpoint is SIGTERM sent to the ranks themselves, as Slurm's scancel sends it")
    assert second_ctrl_c() == said.format(1)
    # the launch's setting, which Open MPI hands its ranks as a variable
    monkeypatch.setenv("OMPI_MCA_odls_base_sigkill_timeout", "30")
    assert second_ctrl_c() == said.format(30)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")  # one rank: its own Ctrl-C
    assert "Ctrl-C again" in second_ctrl_c()


def test_a_stop_before_any_trial_finished_says_so_where_a_command_says_what_it_kept(
        tmp_path, capsys):
    """A Ctrl-C while the first trial is asked: its record notes that no trial has finished,
    and the command line's last line says that rather than that finished trials are kept."""
    from experiments._cli import user_errors

    kw = dict(trials=2, steps=2, study_dir=tmp_path, live=False, memory_per_device="64MiB",
              max_batch_size=8, sampler="random")
    with pytest.raises(SystemExit) as ended, user_errors():
        scamp_jax.run_study(_space_that(0, lambda _: os.kill(os.getpid(), signal.SIGINT)),
                            _regression_task(), **kw)
    assert ended.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted: no trial of the study has finished yet (its plans and the checkpoints of "
        "trials under way are kept); run the same command to resume")


def _one_tested_trial(study_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The regression task with a ``test`` (its held-out data again) and `run_study`'s
    arguments for one short trial of it in ``study_dir``."""
    reference = Regression()
    task = scamp_jax.FunctionTask(metric="mse", direction="minimize", loss_fn=reference.loss_fn,
                                  batches=reference.batches, evaluate=reference.evaluate,
                                  test=reference.evaluate)
    return task, dict(trials=1, steps=2, study_dir=study_dir, live=False,
                      memory_per_device="64MiB", max_batch_size=8, sampler="random")


def test_a_ctrl_c_while_the_best_model_loads_for_its_test_waits_for_the_restore(
        tmp_path, monkeypatch):
    """The run's last step restores the best model for the task's test: a Ctrl-C there stops
    after the restore, not inside it (orbax's reads, cut short, each failed later on its
    closed event loop with a traceback)."""
    from scamp_jax.hpo import runner

    task, kw = _one_tested_trial(tmp_path)
    scamp_jax.run_study(SPACE, task, **kw)
    real, restored = runner.load_model, []

    def load_model(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode, if not held
        restored.append(real(*args, **kwargs))
        return restored[-1]

    monkeypatch.setattr(runner, "load_model", load_model)
    with pytest.raises(KeyboardInterrupt):
        scamp_jax.run_study(SPACE, task, **kw)  # nothing to train: it tests the best again
    assert len(restored) == 1


def test_a_run_stopped_while_its_best_model_is_tested_is_recorded_interrupted(
        tmp_path, monkeypatch):
    """A Ctrl-C once every trial has finished, as the best model is restored for its test:
    the run's entry in results.json says it was interrupted (as README's record of runs
    promises), and the rerun takes the test and adds no run of its own."""
    import json

    from scamp_jax.hpo import runner

    task, kw = _one_tested_trial(tmp_path)
    real = runner.load_model

    def load_model(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "load_model", load_model)
    with pytest.raises(KeyboardInterrupt):
        scamp_jax.run_study(SPACE, task, **kw)
    [run] = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["interrupted"] is True and run["trials_this_run"] == 1
    monkeypatch.setattr(runner, "load_model", real)
    result = scamp_jax.run_study(SPACE, task, **kw)
    assert result["test"] is not None
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 1


@pytest.mark.parametrize("fuse", [1, 2])
def test_a_retry_resumes_its_checkpoints_at_their_batch_where_the_cap_would_restart_it(
        tmp_path, fuse):
    """Trials stopped mid-training (here by a Ctrl-C the first evaluation sends) are retried by
    a run whose batch cap is larger: planned at most at the batch their checkpoints hold, alone
    or fused, they resume them, rather than training from the start at the larger batch (as a
    trial planned again smaller after running out of memory would run out again)."""
    task, _, _ = _task_stopped_at_its_first_evaluation()
    kw = dict(trials=2, steps=20, eval_every=10, checkpoint_every=5, checkpoint_min_seconds=0,
              study_dir=tmp_path, live=False, memory_per_device="64MiB", sampler="random",
              fuse=fuse, seed=3)
    with pytest.raises(KeyboardInterrupt):
        scamp_jax.run_study(SPACE, task, max_batch_size=8, **kw)
    scamp_jax.run_study(SPACE, task, max_batch_size=16, **kw)
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    resumed = [t.user_attrs for t in done if t.user_attrs["resumed_from"] >= 10]
    # alone, one trial trained at a time (the CPU's cap): the one stopped mid-training
    assert len(resumed) == fuse, [t.user_attrs for t in done]
    assert all(r["batch_size"] == 8 for r in resumed), resumed


def test_a_retry_is_capped_at_its_checkpoints_batch_only_where_it_would_resume_them(tmp_path):
    from types import SimpleNamespace

    from scamp_jax.hpo.study.trials import AskedTrial
    from scamp_jax.hpo.units import resume_cap

    folder = tmp_path / "trial_0"
    (folder / "10").mkdir(parents=True)
    (folder / "batch.json").write_text('{"batch_size": 8}')

    def config(**kw):
        return SimpleNamespace(**{"policy": "scamp", "max_batch_size": 16, "min_batch_size": None,
                                  "steps_for": lambda batch: 20, **kw})

    retry = AskedTrial(1, {}, "trial_0", retry_of=0)
    assert resume_cap(retry, tmp_path, config()) == 8
    assert resume_cap(AskedTrial(1, {}, "trial_0"), tmp_path, config()) is None  # no retry
    assert resume_cap(retry, tmp_path, config(max_batch_size=8)) is None  # the cap holds it
    assert resume_cap(retry, tmp_path, config(max_batch_size=None)) == 8
    assert resume_cap(retry, tmp_path, config(min_batch_size=16)) is None  # below the floor
    assert resume_cap(retry, tmp_path, config(policy="fixed")) is None
    assert resume_cap(retry, tmp_path, config(steps_for=lambda batch: 5)) is None  # too long
    assert resume_cap(retry, None, config()) is None
    # a stop before the first step saved the initial state only: nothing to resume
    (folder / "10").rmdir()
    (folder / "0").mkdir()
    assert resume_cap(retry, tmp_path, config()) is None
