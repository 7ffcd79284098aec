"""Where a study's time goes (``run.overhead`` in results.json): compiles attributed by the
thread that made them, checkpoint writes, the report, and devices idle while trials wait for
their plans."""

from __future__ import annotations

import io
import json

import jax
import numpy as np
import pytest
from test_engine import BUDGET, Regression, build, settings, suggest

from scamp_jax.hpo.overhead import OverheadRecorder, idle_waiting_for_plans, timed_section
from scamp_jax.planning.reuse import load_on_devices
from scamp_jax.space import SearchSpace


def test_idle_waiting_counts_idle_devices_only_while_a_plan_is_awaited_and_none_queued():
    # two devices; trial 0 planned at 2 s, runs on device 0 from 2 to 10; trial 1 asked at 0,
    # planned at 6, queued until it starts at 7 on device 1.
    intervals = [[(0, 2.0, 10.0, 1)], [(1, 7.0, 10.0, 1)]]
    trials = [{"asked_at": 0.0, "planned_at": 2.0, "started_at": 2.0},
              {"asked_at": 0.0, "planned_at": 6.0, "started_at": 7.0}]
    # 0-2: both idle, both planning -> 4; 2-6: device 1 idle while trial 1 plans -> 4;
    # 6-7: trial 1 queued (waits for devices, not for a plan) -> 0.
    assert idle_waiting_for_plans(intervals, trials) == pytest.approx(8.0)
    assert idle_waiting_for_plans(intervals, []) == 0.0
    # a cap of one running trial: from 2 s trial 0 runs, so a ready plan could not have
    # started before 10 s; only 0-2 counts.
    assert idle_waiting_for_plans(intervals, trials, max_running=1) == pytest.approx(4.0)
    assert idle_waiting_for_plans(intervals, trials, max_running=2) == pytest.approx(8.0)


def test_idle_waiting_counts_no_more_devices_than_the_awaited_plans_take():
    """Eight devices idle while one trial's plan for two of them compiles (0-2 s): a ready
    plan would have started on two, so 4 device-seconds, not 16; two trials of two and three
    devices awaited under a cap of one running trial: the larger, three."""
    intervals = [[(0, 2.0, 10.0, 1)], [(0, 2.0, 10.0, 1)], *[[] for _ in range(6)]]
    one = [{"asked_at": 0.0, "planned_at": 2.0, "started_at": 2.0, "devices": 2}]
    assert idle_waiting_for_plans(intervals, one) == pytest.approx(4.0)
    assert idle_waiting_for_plans(intervals, [{**one[0], "devices": None}]) == pytest.approx(16.0)
    two = [*one, {"asked_at": 0.0, "planned_at": 1.0, "started_at": 10.0, "devices": 3}]
    # 0-1: both awaited, room for one (cap 1, nothing runs): 3 devices; 1-2: trial 1 queued
    assert idle_waiting_for_plans(intervals, two, max_running=1) == pytest.approx(3.0)
    assert idle_waiting_for_plans(intervals, two) == pytest.approx(5.0)


def test_compiles_and_sections_are_attributed_by_thread_and_name():
    import threading

    @jax.jit
    def step(x):
        return x * 3.0 + 1.0

    @jax.jit
    def fused(x):  # a fused group's step: a training step too
        return x * 2.0

    with OverheadRecorder() as recorder:
        worker = threading.Thread(target=lambda: step(jax.numpy.ones(7)), name="trial_0")
        worker.start()
        worker.join()
        group = threading.Thread(target=lambda: fused(jax.numpy.ones(5)), name="trial_1")
        group.start()
        group.join()
        with timed_section("/scamp_jax/checkpoint/save"):
            pass
        compiled = step.lower(jax.numpy.ones(3)).compile()
        load_on_devices(compiled, [compiled.runtime_executable().local_devices()[0].id],
                        jax.devices()[1:2])  # loaded, not compiled
    summary = recorder.summary()
    assert summary["runner_step_compiles"] == 2 and summary["runner_step_compile_s"] > 0
    assert summary["planning_compiles"] == 0 and summary["checkpoint_writes"] == 1
    assert summary["executable_loads"] == 1 and summary["executable_load_s"] > 0
    step(jax.numpy.ones(9))  # outside the block: not counted
    assert recorder.summary()["runner_step_compiles"] == 2


def test_a_checkpoints_compiles_and_cache_loads_are_counted_apart(tmp_path):
    """What compiles while a trial writes a checkpoint (orbax's slices) is the checkpoint's,
    not the runner's, where it was counted in both; a program read from the persistent cache
    is a load, not a compile, and its seconds are the load's."""
    import threading

    from scamp_jax.hpo.overhead import CHECKPOINT_SAVE
    from scamp_jax.planning.compile_cache import study_compile_cache

    @jax.jit
    def piece(x):
        return x[1:3] * 2.0

    def save():
        leaf = np.ones(11, np.float32)
        with timed_section(CHECKPOINT_SAVE):
            piece(leaf)

    step = jax.jit(lambda x: jax.numpy.tanh(x) * 3.0 + 1.0)
    x = jax.ShapeDtypeStruct((13, 3), jax.numpy.float32)
    with study_compile_cache(tmp_path):
        step.lower(x).compile()  # written to the study's cache
    jax.clear_caches()
    with OverheadRecorder() as recorder:
        saver = threading.Thread(target=save, name="trial_0")
        saver.start()
        saver.join()
        with study_compile_cache(tmp_path, writer=False):
            loader = threading.Thread(target=lambda: step.lower(x).compile(), name="planner_0")
            loader.start()
            loader.join()
    summary = recorder.summary()
    assert summary["checkpoint_compiles"] == 1 and summary["checkpoint_compile_s"] > 0
    assert summary["runner_other_compiles"] == 0 and summary["checkpoint_writes"] == 1
    assert (summary["planning_compiles"], summary["planning_compile_s"]) == (0, 0.0)
    assert summary["planning_cache_loads"] == 1 and summary["planning_cache_load_s"] > 0


def test_a_study_records_where_its_time_went(tmp_path):
    from rich.console import Console

    from scamp_jax.hpo.session import run_search

    config = settings(str(tmp_path))
    space = SearchSpace("mlp-ok", lambda t: {**suggest(t), "kind": "ok"}, build)
    info = run_search(space, Regression(), config, devices=jax.devices()[:4],
                      memory_per_device=BUDGET, live=False,
                      console=Console(file=io.StringIO(), width=200))
    results = json.loads((tmp_path / "results.json").read_text())
    overhead = results["runs"][-1]["overhead"]
    assert overhead == results["run"]["overhead"]
    assert overhead["report_s"] > 0 and overhead["report_s"] == info["overhead"]["report_s"]
    assert overhead["planning_compiles"] >= 1  # the planner threads compiled the steps
    assert overhead["elapsed_s"] == pytest.approx(results["run"]["elapsed_s"], abs=1e-3)
    assert 0 <= overhead["idle_waiting_for_plans_device_s"] <= 4 * overhead["elapsed_s"]
    # every checkpoint write: each multiple of the trial's checkpoint interval
    # (checkpoint_every at the reference batch, scaled for its batch), and the end if not one
    def writes_of(r):
        every = config.interval_for(config.checkpoint_every, r["batch_size"])
        return r["steps"] // every + (1 if r["steps"] % every else 0)

    writes = sum(writes_of(r) for r in results["trials"] if r["state"] == "complete")
    assert overhead["checkpoint_writes"] == writes > 0
    # every trial's initial state computed with NumPy, none compiled
    complete = sum(r["state"] == "complete" for r in results["trials"])
    assert overhead["host_initial_states"] >= complete > 0
    assert overhead["runner_init_compiles"] == 0 and overhead["host_initial_state_s"] > 0


def test_a_study_process_exits_without_the_collectors_last_passes(tmp_path):
    """A process that ran a study leaves the garbage collector's objects frozen at exit (its
    last passes over JAX's and Optuna's objects took most of a second), while a study running
    in a longer process gives them back when it ends (`test_engine`)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = f"""
import atexit, gc, io
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count()))  # runs last
import jax
from rich.console import Console
from test_engine import BUDGET, Regression, build, settings, suggest
from scamp_jax.hpo.session import run_search
from scamp_jax.space import SearchSpace
space = SearchSpace("mlp-ok", lambda t: {{**suggest(t), "kind": "ok"}}, build)
run_search(space, Regression(), settings({str(tmp_path)!r}), devices=jax.devices()[:2],
           memory_per_device=BUDGET, live=False, console=Console(file=io.StringIO()))
print("after the study:", gc.get_freeze_count())
"""
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ") for line in proc.stdout.splitlines() if ": " in line)
    assert int(lines["after the study"]) == 0
    assert int(lines["frozen at exit"]) > 10_000
