"""Resume after ``kill -9``: no finished trial lost or repeated, the interrupted one resumed.

A subprocess runs a study (the MLP stand-in of ``test_runner`` through the same `run_search`
the entry points use), is killed with SIGKILL once one trial has finished and the next has
written a checkpoint, and is run again on the same study directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy.exc
from optuna.trial import TrialState

from scamp_jax.hpo.study import FAIL_REASON, INTERRUPTED, retried_from, storage_url

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TRIALS = 2

DRIVER = """
import sys
from scamp_jax.devices import configure_cpu_devices
configure_cpu_devices(8)
sys.path.insert(0, {tests!r})
import jax
from test_runner import Regression, SPACE
from scamp_jax.hpo.session import run_search
from scamp_jax.hpo.settings import SearchSettings

settings = SearchSettings(
    trials={trials}, steps={steps}, max_batch_size=16, sampler="random", pruner="none",
    policy="fixed", devices_per_trial=2,  # two devices, two per trial: one trial at a time
    study_dir={study_dir!r}, storage={storage!r}, checkpoint_every=30,
    checkpoint_min_seconds=0,  # a checkpoint every 30 steps, however short they are
    heartbeat_interval=1, grace_period=3,  # a killed process's trial is retried 3 s later
)
run_search(SPACE, Regression(), settings, devices=jax.devices()[:2],
           memory_per_device=64 * 2**20, live=False)
"""


def _start(study_dir: Path, cli: bool = False, trials: int = TRIALS,
           steps: int = 1200, storage: str | None = None) -> subprocess.Popen:
    """The driver over the MLP stand-in, or (``cli``) the SwinIR entry point's smoke preset.

    ``steps``: enough that the kill lands well inside the second trial. Seeing its first
    checkpoint takes the test a moment: the trial reaches step 60-180 before the kill on an
    idle 2-core machine, and at 300 steps it sometimes finished first.
    """
    if cli:
        # Eight devices per trial under the fixed policy: trials run one after another.
        command = ["-m", "experiments.swinir_hpo", "--preset", "smoke", "--trials", str(TRIALS),
                   "--steps", "200", "--checkpoint-every", "25", "--checkpoint-min-seconds", "0",
                   "--policy", "fixed",
                   "--devices-per-trial", "8",
                   "--sampler", "random", "--study-dir", str(study_dir), "--no-live"]
    else:
        command = ["-c", DRIVER.format(tests=str(TESTS), trials=trials, steps=steps,
                                       study_dir=str(study_dir), storage=storage)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # each process sets up its own devices
    return subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _study(study_dir: Path) -> optuna.Study:
    [summary] = optuna.get_all_study_summaries(storage_url(study_dir))
    return optuna.load_study(study_name=summary.study_name, storage=storage_url(study_dir))


def _wait_for_kill_point(proc: subprocess.Popen, study_dir: Path, timeout: float) -> int:
    """Block until one trial is complete and the running one has a checkpoint, and has
    stored its seconds up to it; its number."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the study finished before it could be killed:\n{proc.stdout.read()}")
        if (study_dir / "study.db").exists():
            try:
                trials = _study(study_dir).get_trials()
            except (KeyError, ValueError, optuna.exceptions.StorageInternalError,
                    sqlalchemy.exc.DBAPIError):
                # the study row (or the schema) is not written yet: a locked file, or (written
                # ahead, so readable meanwhile) tables without their version row, which this
                # reader's Optuna then stamps too and loses the race to the study's process
                trials = []
            done = [t for t in trials if t.state == TrialState.COMPLETE]
            running = [t for t in trials if t.state == TrialState.RUNNING]
            for t in running:
                ckpt = study_dir / "checkpoints" / t.user_attrs.get("checkpoint_key", "-")
                if (done and ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())
                        and t.user_attrs.get("wall_seconds")):
                    return t.number
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no kill point within {timeout} s:\n{proc.stdout.read()}")


@pytest.mark.parametrize("cli", [
    pytest.param(False, id="library"),
    pytest.param(True, id="swinir-cli", marks=pytest.mark.slow),
])
def test_kill_9_then_rerun_loses_and_repeats_nothing(tmp_path, cli):
    study_dir = tmp_path / "study"
    proc = _start(study_dir, cli)
    victim = _wait_for_kill_point(proc, study_dir, timeout=1200 if cli else 240)
    before = {t.number: (t.params, t.value) for t in _study(study_dir).get_trials()
              if t.state == TrialState.COMPLETE}
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    rerun = _start(study_dir, cli)
    out, _ = rerun.communicate(timeout=1500 if cli else 300)
    assert rerun.returncode == 0, out
    assert f"trials [{victim}] of stopped processes were run again" in out
    # at once: the killed process ran on this machine, so the rerun did not wait for the
    # heartbeat's grace period (a minute for the CLI, 3 s for the driver) with idle devices
    assert "waiting for trial(s)" not in out
    run = json.loads((study_dir / "results.json").read_text())["runs"][-1]
    assert run["overhead"]["idle_waiting_for_held_trials_device_s"] == 0

    trials = _study(study_dir).get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == TRIALS, out
    # Trials finished before the kill are still there, unchanged, and were not run again.
    for number, (params, value) in before.items():
        assert trials[number].state == TrialState.COMPLETE and trials[number].value == value
        assert trials[number].params == params
    configs = [tuple(sorted(t.params.items())) for t in complete]
    assert len(set(configs)) == TRIALS
    # The killed trial was failed (its process gone); a retry of it re-ran from its checkpoint.
    assert trials[victim].state == TrialState.FAIL
    assert trials[victim].user_attrs.get(FAIL_REASON) in (None, INTERRUPTED)
    [resumed] = [t for t in complete if t.params == trials[victim].params]
    assert retried_from(resumed) == victim
    assert resumed.user_attrs["resumed_from"] > 0
    assert resumed.user_attrs["checkpoint_key"] == trials[victim].user_attrs["checkpoint_key"]
    results = (study_dir / "results.csv").read_text().splitlines()
    assert len(results) == 1 + TRIALS  # header + one row per trial number, interrupted left out
    # The killed attempt's seconds up to its last checkpoint count in its retry's row.
    killed_s = trials[victim].user_attrs["wall_seconds"]
    assert killed_s > 0
    [row] = [r for r in json.loads((study_dir / "results.json").read_text())["trials"]
             if r["number"] == resumed.number]
    assert row["wall_seconds"] == round(resumed.user_attrs["wall_seconds"] + killed_s, 3)


def test_a_checkpoint_of_more_steps_is_not_reported_as_fewer(tmp_path):
    """Resuming with fewer steps than the checkpointed run reached restores a step within them."""
    import threading

    import jax
    from test_runner import SPACE, Regression, make_plan, spec

    from scamp_jax.hpo.runner import load_model, run_trial

    config = {"width": 32, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:2])
    clean = run_trial(spec(config, plan, steps=25, checkpoint_dir=tmp_path / "clean",
                           checkpoint_every=10), SPACE, Regression())
    assert clean.state == "complete", clean.reason

    stop = threading.Event()

    def report(number: int, step: int, value: float) -> bool:
        if step == 27:
            stop.set()  # interrupted at step 27 of a 40-step run: it keeps checkpoints 20 and 27
        return False

    longer = run_trial(spec(config, plan, steps=40, checkpoint_dir=tmp_path / "b",
                            checkpoint_every=10, eval_every=9), SPACE, Regression(),
                       report=report, stop=stop)
    assert (longer.state, longer.steps) == ("interrupted", 27), longer.reason
    shorter = run_trial(spec(config, plan, steps=25, checkpoint_dir=tmp_path / "b",
                             checkpoint_every=10), SPACE, Regression())
    assert shorter.state == "complete", shorter.reason
    # It restores step 20, the latest within its 25 steps: 27 would train past them, and 0
    # would be a rerun from scratch that never tried the checkpoints.
    assert shorter.resumed_from == 20
    assert shorter.metrics["mse"] == clean.metrics["mse"], (shorter.metrics, clean.metrics)
    model = load_model(shorter.checkpoint, SPACE, config)
    assert Regression().evaluate(model)["mse"] == pytest.approx(clean.metrics["mse"], rel=1e-5)


def _damage(step_dir: Path) -> None:
    """Delete a checkpoint's array data (what a disk that lost the file's blocks leaves)."""
    import shutil

    data = [p for p in (step_dir / "default").iterdir()
            if p.name == "d" or p.name.startswith("ocdbt.process_")]
    assert data, sorted(p.name for p in (step_dir / "default").iterdir())
    for p in data:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as below
@pytest.mark.parametrize("damage", ["cut short", "overwritten"])
def test_a_checkpoint_whose_data_is_cut_short_or_overwritten_is_unreadable(tmp_path, damage):
    """Data cut short (a disk that filled up, a copy that stopped) or overwritten: orbax wraps
    TensorStore's error in a bare ``Exception``, which the restore names `CheckpointUnreadable`
    (so the trial sets it aside and resumes from the one before) with TensorStore's words."""
    import jax
    import jax.numpy as jnp

    from scamp_jax.hpo.checkpoint import CheckpointUnreadable, TrialCheckpointer

    state = {"w": jnp.arange(200_000, dtype=jnp.float32).reshape(400, 500), "b": jnp.ones(7)}
    saved = TrialCheckpointer(tmp_path)
    saved.save(5, state)
    saved.close()
    files = [p for p in (tmp_path / "5" / "default").rglob("*") if p.is_file()
             and "d" in p.relative_to(tmp_path / "5" / "default").parts]
    largest = max(files, key=lambda p: p.stat().st_size)
    size = largest.stat().st_size
    if damage == "cut short":
        os.truncate(largest, size // 2)
    else:
        largest.write_bytes(os.urandom(size))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
    with pytest.raises(CheckpointUnreadable, match=r"cannot be read .* orbax: ValueError: "
                       r"[A-Z_]+: Error reading") as caught:
        TrialCheckpointer(tmp_path).restore(like)
    assert caught.value.step == 5 and "TensorStore details" not in str(caught.value)


_DAMAGED_RESTORE = """
import os, sys, time, gc
import jax.numpy as jnp
from scamp_jax.hpo.checkpoint import CheckpointUnreadable, TrialCheckpointer
directory = sys.argv[1]
state = {f"w{i}": jnp.arange(4096.0) + i for i in range(20)}
saved = TrialCheckpointer(directory)
saved.save(1, state)
saved.close()
for root, _, names in os.walk(os.path.join(directory, "1")):
    if os.path.basename(root) == "d":
        for name in names:
            os.truncate(os.path.join(root, name), os.path.getsize(os.path.join(root, name)) // 2)
readers = []  # kept, as a trial keeps its checkpointer
for attempt in range(4):  # how many reads a restore abandons varies: several restores
    readers.append(TrialCheckpointer(directory))
    try:
        readers[-1].restore(state)
    except CheckpointUnreadable:
        print("unreadable", file=sys.stderr)
    time.sleep(0.5)  # the abandoned reads finish in TensorStore's threads meanwhile
    gc.collect()
print("done", file=sys.stderr)
"""


def test_a_damaged_checkpoint_says_so_once_with_no_tracebacks(tmp_path):
    """A restore that fails on damaged data raises `CheckpointUnreadable`, and that message is
    all the user sees: orbax abandons its other reads of the checkpoint on a closed event loop,
    and each would print a traceback (about 100 lines for 20 arrays) when it ends or is
    collected. A real process, so that Python's own unraisable-error hook is the one in use."""
    result = subprocess.run([sys.executable, "-c", _DAMAGED_RESTORE, str(tmp_path / "c")],
                            cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["unreadable"] * 4 + ["done"], result.stderr[-3000:]


def test_a_replicated_state_is_checkpointed_with_no_compile_and_reads_either_way(tmp_path):
    """A data-parallel trial's state (each array on every device of its mesh) is written whole
    from one replica: its save compiles nothing, where orbax's default (replica-parallel) cut
    each array into slices on the devices, a program compiled per shape. Each checkpoint, and
    one orbax's standard handler wrote (the handler of earlier versions), restores onto other
    devices as it was saved."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from scamp_jax.hpo.checkpoint import TrialCheckpointer
    from scamp_jax.hpo.overhead import OverheadRecorder

    def replicated(devices):
        return NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec())

    here, there = replicated(jax.devices()[:4]), replicated(jax.devices()[4:8])
    state = {f"w{n}": jax.device_put(np.arange(n * 640, dtype=np.float32).reshape(n * 8, 80),
                                     here) for n in range(1, 6)}
    like = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=there) for k, x in state.items()}
    with OverheadRecorder() as recorder:
        saved = TrialCheckpointer(tmp_path / "trial_0")
        saved.save(3, state)
        saved.close()
    summary = recorder.summary()
    assert summary["checkpoint_writes"] == 1 and summary["checkpoint_compiles"] == 0
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(tmp_path / "earlier", options=options) as standard:
        standard.save(4, args=ocp.args.StandardSave(state))
    for directory, step in ((tmp_path / "trial_0", 3), (tmp_path / "earlier", 4)):
        read = TrialCheckpointer(directory)
        assert read.restore(like)[0] == step
        restored = read.restore(like)[1]
        read.close()
        for k, x in state.items():
            assert restored[k].sharding == there
            np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(x))


def test_only_the_checkpoints_own_errors_make_it_unreadable():
    """What sets a checkpoint aside: orbax's words for it (`ValueError`, `FileNotFoundError`)
    and TensorStore's damaged-data codes under orbax's bare ``Exception``. A permission, a disk
    that fails to answer, or an error raised while another was handled is not the
    checkpoint's own: it fails the trial as it is, where setting each checkpoint aside in turn
    would restart the trial from step 0. (The errors are made here: TensorStore's cannot be
    caused for real as root, which reads any file.)"""
    from scamp_jax.hpo.checkpoint import _checkpoints_own

    def wrapped(cause: BaseException) -> Exception:
        try:
            try:
                raise cause
            except BaseException as err:
                raise Exception("Encountered error while reading array index") from err
        except Exception as wrapper:  # noqa: BLE001 - orbax's type
            return wrapper

    damaged = ValueError('OUT_OF_RANGE: Error reading "w/0.0" in OCDBT database')
    assert _checkpoints_own(wrapped(damaged)) is damaged
    assert _checkpoints_own(wrapped(ValueError("DATA_LOSS: checksum mismatch"))) is not None
    assert _checkpoints_own(wrapped(ValueError("PERMISSION_DENIED: open failed"))) is None
    assert _checkpoints_own(wrapped(ValueError("UNAVAILABLE: I/O error"))) is None
    try:
        try:
            raise ValueError("FAILED_PRECONDITION: handled elsewhere")
        except ValueError:
            raise OSError(5, "Input/output error") from None
    except OSError as disk:
        assert _checkpoints_own(disk) is None
    shapes = ValueError("Requested shape (4, 6) does not match the stored (4, 8)")
    assert _checkpoints_own(shapes) is shapes


# A failed read leaves tensorstore's other reads of the checkpoint to finish on orbax's closed
# event loop, which Python reports as unraisable "Event loop is closed" errors.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_checkpoint_is_set_aside_and_the_trial_resumes_from_the_one_before(
        tmp_path, caplog):
    """The newest checkpoint lost its data: the run sets it aside (nothing deleted) and
    resumes from the one before, ending where an uninterrupted run ends; with every
    checkpoint damaged it trains from the start. The trial never fails for a damaged file."""
    import logging
    import threading

    import jax
    from test_runner import SPACE, Regression, make_plan, spec

    from scamp_jax.hpo.runner import run_trial

    config = {"width": 32, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:2])
    clean = run_trial(spec(config, plan, steps=40, checkpoint_dir=tmp_path / "clean",
                           checkpoint_every=10), SPACE, Regression())
    assert clean.state == "complete", clean.reason

    def interrupted(directory: Path) -> None:
        stop = threading.Event()

        def report(number: int, step: int, value: float) -> bool:
            if step == 35:
                stop.set()  # stopped after the step-30 checkpoint: it saves step 35 too
            return False

        run = run_trial(spec(config, plan, steps=40, checkpoint_dir=directory,
                             checkpoint_every=10, eval_every=5), SPACE, Regression(),
                        report=report, stop=stop)
        assert run.state == "interrupted", run.reason
        assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["30", "35"]

    trial = tmp_path / "trial_0"
    interrupted(trial)
    _damage(trial / "35")
    with caplog.at_level(logging.WARNING, logger="scamp_jax.hpo.lifecycle"):
        resumed = run_trial(spec(config, plan, steps=40, checkpoint_dir=trial,
                                 checkpoint_every=10), SPACE, Regression())
    assert resumed.state == "complete", resumed.reason
    assert resumed.resumed_from == 30
    assert resumed.metrics["mse"] == pytest.approx(clean.metrics["mse"], rel=1e-5)
    assert (tmp_path / "trial_0.unreadable" / "35" / "default").is_dir()  # kept, aside
    assert "trial 0: the checkpoint" in caplog.text and "cannot be read" in caplog.text
    assert "set aside in" in caplog.text

    again = tmp_path / "trial_1"
    interrupted(again)
    _damage(again / "30")
    _damage(again / "35")
    fresh = run_trial(spec(config, plan, steps=40, checkpoint_dir=again, checkpoint_every=10),
                      SPACE, Regression())
    assert fresh.state == "complete", fresh.reason
    assert fresh.resumed_from == 0
    assert fresh.metrics["mse"] == pytest.approx(clean.metrics["mse"], rel=1e-5)
    assert sorted(p.name for p in (tmp_path / "trial_1.unreadable").iterdir()) == ["30", "35"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
def test_a_damaged_checkpoint_a_spanning_trials_parts_share_fails_the_part_and_stays(tmp_path):
    """A part of a trial spanning MPI ranks (``batch_share``) reads a checkpoint the other
    parts read too: a damaged one fails the part, saying it cannot be read, and stays where it
    is (no part moves it from under the others); nothing trains on from an older one."""
    import jax
    from test_runner import SPACE, Regression, make_plan, spec

    from scamp_jax.hpo.runner import run_trial

    config = {"width": 16, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:1], max_batch=8)
    trial = tmp_path / "trial_0"
    first = run_trial(spec(config, plan, steps=10, checkpoint_dir=trial, checkpoint_every=5,
                           batch_share=(0, 2)), SPACE, Regression())
    assert first.state == "complete", first.reason
    _damage(trial / "10")
    part = run_trial(spec(config, plan, steps=20, checkpoint_dir=trial, checkpoint_every=5,
                          batch_share=(0, 2)), SPACE, Regression())
    assert part.state == "failed" and "cannot be read" in part.reason, part.reason
    assert not (tmp_path / "trial_0.unreadable").exists()
    assert sorted(p.name for p in trial.iterdir() if p.name.isdigit()) == ["10", "5"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
def test_a_fused_groups_damaged_member_checkpoint_fails_no_member(tmp_path):
    """A group of two stopped at step 8; member 0's checkpoint is damaged. The group resumes
    from the newest step both members keep (here none but the start) and both complete."""
    import threading

    import jax
    from test_fusion import MEMBERS, group_plan
    from test_runner import BUDGET, SPACE, Regression, make_plan

    from scamp_jax.hpo.fused_runner import GroupSpec, MemberSpec, run_fused_group

    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = tuple(MemberSpec(i, cfg, seed, checkpoint_dir=tmp_path / f"m{i}")
                    for i, (cfg, seed) in enumerate(MEMBERS[:2]))
    group = GroupSpec(2, members, group_plan(plan, 4), 20, BUDGET, log_every=1)
    stop = threading.Event()
    first = run_fused_group(group, SPACE, Regression(), stop=stop,
                            on_loss=lambda number, step, loss: step == 8 and stop.set())
    assert [r.state for r in first.members] == ["interrupted"] * 2
    _damage(tmp_path / "m0" / "8")
    again = run_fused_group(group, SPACE, Regression())
    assert [(r.state, r.resumed_from) for r in again.members] == [("complete", 0)] * 2, [
        r.reason for r in again.members]
    assert (tmp_path / "m0.unreadable" / "8").is_dir()
    assert again.widths == (2,)  # the retry after setting the checkpoint aside is no re-form


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
def test_a_fused_group_with_a_damaged_member_checkpoint_resumes_from_the_newest_common_step(
        tmp_path):
    """A group of two checkpointing every 4 steps is stopped at step 8; member 0's step-8
    checkpoint is damaged. Both keep step 4: the group resumes from there (not from the
    start), and both complete as a group never stopped does."""
    import threading

    import jax
    from test_fusion import MEMBERS, group_plan
    from test_runner import BUDGET, SPACE, Regression, make_plan

    from scamp_jax.hpo.fused_runner import GroupSpec, MemberSpec, run_fused_group

    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = tuple(MemberSpec(i, cfg, seed, checkpoint_dir=tmp_path / f"m{i}")
                    for i, (cfg, seed) in enumerate(MEMBERS[:2]))
    group = GroupSpec(2, members, group_plan(plan, 4), 12, BUDGET, checkpoint_every=4,
                      log_every=1)
    stop = threading.Event()
    first = run_fused_group(group, SPACE, Regression(), stop=stop,
                            on_loss=lambda number, step, loss: step == 8 and stop.set())
    assert [(r.state, r.steps) for r in first.members] == [("interrupted", 8)] * 2
    _damage(tmp_path / "m0" / "8")
    again = run_fused_group(group, SPACE, Regression())
    assert [(r.state, r.resumed_from) for r in again.members] == [("complete", 4)] * 2, [
        r.reason for r in again.members]
    assert (tmp_path / "m0.unreadable" / "8").is_dir()
    whole = run_fused_group(dataclasses.replace(group, members=tuple(
        dataclasses.replace(m, checkpoint_dir=None) for m in members)), SPACE, Regression())
    assert [r.metrics for r in again.members] == [r.metrics for r in whole.members]


def test_two_processes_finish_one_study_together(tmp_path):
    """Two processes started on one SQLite study run exactly its trials, each number once."""
    study_dir = tmp_path / "study"
    procs = [_start(study_dir, trials=4, steps=60) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out
        assert "Traceback" not in out, out
    trials = _study(study_dir).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3], [(t.number, t.state) for t in trials]
    assert all(t.state == TrialState.COMPLETE for t in trials), [t.state for t in trials]
    keys = [t.user_attrs["checkpoint_key"] for t in trials]
    assert len(set(keys)) == 4  # no checkpoint folder shared
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 4  # no repeated config
    payload = json.loads((study_dir / "results.json").read_text())
    for row in payload["trials"]:  # relative to the study, so a copied folder finds them
        assert not Path(row["checkpoint"]).is_absolute()
        assert (study_dir / row["checkpoint"]).is_dir()
    runs = payload["runs"]
    assert len(runs) == 2  # each process appended its own run
    assert sum(r["trials_this_run"] for r in runs) == 4
    assert all(r["trials_this_run"] >= 1 for r in runs), runs  # both did work
    # each process's report time went to its own run, whichever wrote the file last
    assert len({r["run_id"] for r in runs}) == 2
    assert all(r["overhead"]["report_s"] > 0 for r in runs), [r["overhead"] for r in runs]



SAVER = """
import json, sys, time
from pathlib import Path
from scamp_jax.hpo.report import save_best_model

records = json.loads(Path({records!r}).read_text())
print("ready", flush=True)
while not Path({go!r}).exists():
    time.sleep(0.01)
until = time.monotonic() + 2
while time.monotonic() < until:
    save_best_model({study_dir!r}, records, "mse", "minimize")
"""


def test_processes_saving_the_best_model_at_once_leave_the_best_whole(tmp_path):
    """Two processes of one study write ``best_model`` at once, over and over: one from the
    study's trials, one from an older view without the best trial (its records read before
    that trial finished). Neither fails, and ``best_model`` is left holding the best trial's
    checkpoint with its own ``trial.json``, not the older view's worse one, nor parts of
    both."""
    from test_runner import SPACE, Regression

    from scamp_jax.hpo.report import best_record, trial_records
    from scamp_jax.hpo.runner import load_model

    study_dir = tmp_path / "study"
    proc = _start(study_dir, trials=2, steps=60)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    records = trial_records(_study(study_dir), ["mse"])
    best = best_record(records, "mse", "minimize")
    assert best is not None and len({r["mse"] for r in records}) == 2, records
    views = {"fresh": records, "stale": [r for r in records if r["number"] != best["number"]]}
    go = tmp_path / "go"
    savers = []
    for name, view in views.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(view))
        code = SAVER.format(records=str(tmp_path / f"{name}.json"), go=str(go),
                            study_dir=str(study_dir))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        savers.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
    for saver in savers:
        assert saver.stdout.readline().strip() == "ready"
    shutil.rmtree(study_dir / "best_model")  # the study's own save: either may write first
    go.touch()  # both save from here on, at once
    for saver in savers:
        out, _ = saver.communicate(timeout=120)
        assert saver.returncode == 0, out
    saved = json.loads((study_dir / "best_model" / "trial.json").read_text())
    assert (saved["number"], saved["mse"]) == (best["number"], best["mse"])
    assert [p.name for p in study_dir.iterdir() if "best_model" in p.name] == ["best_model"]
    model = load_model(study_dir / "best_model", SPACE, saved["params"])
    assert Regression().evaluate(model)["mse"] == pytest.approx(best["mse"], rel=1e-5)


def test_a_saved_best_model_is_kept_while_better_and_its_checkpoint_is_in_the_study(tmp_path):
    """The rules of one save, with step folders of marked files (the save copies folders; the
    test above copies real checkpoints, and `test_entry` reruns a study whose best trial's
    checkpoint was damaged)."""
    from scamp_jax.hpo.report import save_best_model

    def trial(number: int, mse: float) -> dict:
        step = tmp_path / "checkpoints" / f"trial_{number}" / "10"
        step.mkdir(parents=True)
        (step / "weights").write_text(f"trial {number}")
        (step / "_CHECKPOINT_METADATA").write_text(f"saved at {time.time_ns()}")  # orbax's
        return {"number": number, "state": "complete", "mse": mse, "params": {"n": number},
                "checkpoint": f"checkpoints/trial_{number}/10"}

    worse, better = trial(0, 0.5), trial(1, 0.1)
    saved = tmp_path / "best_model"

    def holds() -> tuple[str, int]:
        return ((saved / "weights").read_text(),
                json.loads((saved / "trial.json").read_text())["number"])

    save_best_model(tmp_path, [worse, better], "mse", "minimize")
    assert holds() == ("trial 1", 1)
    # records read before trial 1 finished leave its model in place
    save_best_model(tmp_path, [worse], "mse", "minimize")
    assert holds() == ("trial 1", 1)
    running = {**better, "state": "running", "mse": None}  # read while it ran
    save_best_model(tmp_path, [worse, running], "mse", "minimize")
    assert holds() == ("trial 1", 1)
    # best_model/ of another study, whose trial 1 wrote the same checkpoint folder: this
    # study's trial 1 (other parameters, or another score) is copied over it, never kept
    for other in ({**better, "params": {"n": 7}, "mse": 0.3}, {**better, "mse": 0.3}):
        (saved / "weights").write_text("trial 1 of another study")
        save_best_model(tmp_path, [worse, other], "mse", "minimize")
        assert holds() == ("trial 1", 1)
        assert json.loads((saved / "trial.json").read_text())["params"] == other["params"]
        save_best_model(tmp_path, [worse, better], "mse", "minimize")
    # trial 1's checkpoint damaged since its model was saved: the copy it has is kept
    (tmp_path / "checkpoints" / "trial_1" / "10" / "weights").write_text("damaged")
    save_best_model(tmp_path, [worse, better], "mse", "minimize")
    assert holds() == ("trial 1", 1)
    # ... but a trial 1 of the same parameters and score saved anew (a study made again of
    # that name, its outputs moved away but for best_model/) is copied
    (tmp_path / "checkpoints" / "trial_1" / "10" / "weights").write_text("trial 1 again")
    (tmp_path / "checkpoints" / "trial_1" / "10" / "_CHECKPOINT_METADATA").write_text("later")
    save_best_model(tmp_path, [worse, better], "mse", "minimize")
    assert holds() == ("trial 1 again", 1)
    # a save stopped between its two renames: the next puts the model it replaced back first
    saved.rename(tmp_path / ".best_model.old")
    save_best_model(tmp_path, [worse], "mse", "minimize")
    assert holds() == ("trial 1 again", 1)
    # trial 1's checkpoint moved out of the study (to start afresh): its copy is replaced
    shutil.move(tmp_path / "checkpoints" / "trial_1", tmp_path / "elsewhere")
    save_best_model(tmp_path, [worse], "mse", "minimize")
    assert holds() == ("trial 0", 0)
    assert [p.name for p in tmp_path.iterdir() if "best_model" in p.name] == ["best_model"]


def _slow_regression() -> Any:
    """`test_runner.Regression` whose every batch takes at least 10 ms to draw, so a run's
    training takes a known least time whatever the machine."""
    from test_runner import Regression

    class Slow(Regression):
        def batches(self, batch_size: int, seed: int) -> Any:
            for batch in super().batches(batch_size, seed):
                time.sleep(0.01)
                yield batch

    return Slow()


def _recorded_saves(monkeypatch) -> list[tuple[int, float]]:
    """Each checkpoint a run writes, as (step, when its save began)."""
    from scamp_jax.hpo.checkpoint import TrialCheckpointer

    saves: list[tuple[int, float]] = []
    save = TrialCheckpointer.save

    def recorded(self: Any, step: int, state: Any) -> None:
        saves.append((step, time.monotonic()))
        save(self, step, state)

    monkeypatch.setattr(TrialCheckpointer, "save", recorded)
    return saves


@pytest.mark.parametrize("fused", [False, True], ids=["solo", "fused"])
def test_checkpoints_are_at_least_checkpoint_min_seconds_of_training_apart(
        tmp_path, monkeypatch, fused):
    """A checkpoint every step, 0.15 s of training apart at least: the run writes some (not
    every step's, not the last one's alone), each the floor after the previous one or the
    start of training, and the last step's. A solo run and a fused group's members alike;
    ``on_checkpoint`` hears each member's checkpoints before the last, with the run's seconds
    so far (what the study stores for the trial)."""
    import jax
    from test_fusion import MEMBERS, group_plan
    from test_runner import BUDGET, SPACE, make_plan, spec

    from scamp_jax.hpo.fused_runner import GroupSpec, MemberSpec, run_fused_group
    from scamp_jax.hpo.runner import run_trial

    saves = _recorded_saves(monkeypatch)
    heard: list[tuple[int, int, float]] = []
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    steps, floor = 60, 0.15  # at least 0.6 s of training: 10 ms a batch
    began = time.monotonic()
    if fused:
        members = tuple(MemberSpec(i, cfg, seed, checkpoint_dir=tmp_path / f"m{i}")
                        for i, (cfg, seed) in enumerate(MEMBERS[:2]))
        group = GroupSpec(2, members, group_plan(plan, 4), steps, BUDGET, checkpoint_every=1,
                          checkpoint_min_seconds=floor, log_every=1)
        result = run_fused_group(group, SPACE, _slow_regression(),
                                 on_checkpoint=lambda *a: heard.append(a))
        assert [r.state for r in result.members] == ["complete"] * 2
        numbers, run_seconds = [0, 1], result.members[0].wall_seconds
        by_step: dict[int, float] = {}
        for step, when in saves:  # both members save each checkpoint, at once
            by_step.setdefault(step, when)
        saves = sorted(by_step.items())
    else:
        config = {"width": 16, "learning_rate": 1e-2}
        result = run_trial(spec(config, plan, steps=steps, checkpoint_dir=tmp_path / "t",
                                checkpoint_every=1, checkpoint_min_seconds=floor, log_every=1),
                           SPACE, _slow_regression(), on_checkpoint=lambda *a: heard.append(a))
        assert result.state == "complete", result.reason
        numbers, run_seconds = [result.number], result.wall_seconds
    steps_saved = [step for step, _ in saves]
    assert steps_saved[-1] == steps
    middle = saves[:-1]
    assert 2 <= len(middle) < steps // 2, steps_saved  # some, far from every step's
    times = [began] + [when for _, when in middle]
    assert all(b - a >= floor for a, b in zip(times[:-1], times[1:], strict=True)), steps_saved
    assert sorted((n, step) for n, step, _ in heard) == [
        (n, step) for n in numbers for step, _ in middle]
    for n in numbers:
        seconds = [s for m, _, s in heard if m == n]
        assert seconds == sorted(seconds) and 0 < seconds[0] and seconds[-1] < run_seconds
        assert seconds[-1] - seconds[0] >= floor * (len(seconds) - 1)


def test_a_stopped_run_writes_its_checkpoint_however_soon(tmp_path):
    """A run whose floor (an hour) keeps every checkpoint before its last unwritten is stopped
    at step 30: it writes that step's (the one it resumes from), and only that one; a run to
    the end writes the last step's alone."""
    import threading

    import jax
    from test_runner import SPACE, Regression, make_plan, spec

    from scamp_jax.hpo.checkpoint import saved_steps
    from scamp_jax.hpo.runner import run_trial

    config = {"width": 16, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:1], max_batch=16)
    kw = dict(checkpoint_every=5, checkpoint_min_seconds=3600, log_every=1, eval_every=10)
    stop = threading.Event()

    def report(number: int, step: int, value: float) -> bool:
        if step == 30:
            stop.set()
        return False

    stopped = run_trial(spec(config, plan, steps=100, checkpoint_dir=tmp_path / "a", **kw),
                        SPACE, Regression(), report=report, stop=stop)
    assert (stopped.state, stopped.steps) == ("interrupted", 30), stopped.reason
    assert saved_steps(tmp_path / "a") == {30}
    resumed = run_trial(spec(config, plan, steps=100, checkpoint_dir=tmp_path / "a", **kw),
                        SPACE, Regression())
    assert (resumed.state, resumed.resumed_from) == ("complete", 30), resumed.reason
    assert saved_steps(tmp_path / "a") == {30, 100}
    whole = run_trial(spec(config, plan, steps=100, checkpoint_dir=tmp_path / "b", **kw),
                      SPACE, Regression())
    assert whole.state == "complete" and saved_steps(tmp_path / "b") == {100}


def test_a_save_a_killed_process_left_unfinished_is_replaced_without_orbaxs_warning(
        tmp_path, caplog):
    """A process killed while it wrote step 10 left ``10.orbax-checkpoint-tmp``; the retry,
    saving step 10 again, replaces it, and no line of orbax's own (absl's ``WARNING``) reaches
    the study's output."""
    import logging

    import jax.numpy as jnp

    from scamp_jax.hpo.checkpoint import TrialCheckpointer, saved_steps

    state = {"w": jnp.arange(12.0), "b": jnp.ones(3)}
    saver = TrialCheckpointer(tmp_path)
    saver.save(5, state)
    unfinished = tmp_path / "10.orbax-checkpoint-tmp"
    (unfinished / "default").mkdir(parents=True)
    (unfinished / "default" / "partial").write_bytes(b"\0" * 64)
    with caplog.at_level(logging.INFO):
        saver.save(10, state)
    saver.close()
    assert saved_steps(tmp_path) == {5, 10} and not unfinished.exists()
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING]
    assert "left unfinished by a process that ended while writing it" in caplog.text
    # one of a step the retry never saves again (it resumed from an earlier one, or trains
    # from the start) goes at its first save too: nothing else would remove it
    orphan = tmp_path / "52.orbax-checkpoint-tmp-1701"
    (orphan / "default").mkdir(parents=True)
    saver = TrialCheckpointer(tmp_path)
    saver.save(15, state)
    saver.close()
    assert saved_steps(tmp_path) == {10, 15} and not orphan.exists()
