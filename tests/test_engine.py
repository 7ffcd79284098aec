"""The search loop: concurrent trials on a device pool, fault isolation, OOM re-plans, policies.

Uses the MLP regression stand-in of ``test_runner`` with a real Optuna study in SQLite storage.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import threading
import time
from typing import Any

import jax
import pytest
from flax import nnx
from optuna.trial import TrialState
from test_runner import MLP, Regression

from scamp_jax._signals import Terminated
from scamp_jax.hpo.checkpoint import newest_step
from scamp_jax.hpo.engine import BudgetTooSmallError, EngineConfig, SearchEngine
from scamp_jax.hpo.failures import RepeatedFailureError
from scamp_jax.hpo.overhead import OverheadRecorder
from scamp_jax.hpo.settings import SearchSettings
from scamp_jax.hpo.study import CHECKPOINT_KEY, FAIL_REASON, OptunaTrialSource, open_study
from scamp_jax.planning import planner
from scamp_jax.planning.budget import Budget
from scamp_jax.scheduling.replay import recorded_placements, replay
from scamp_jax.space import SearchSpace

BUDGET = 64 * 2**20


def build(config: Any, rngs: nnx.Rngs) -> MLP:
    if config.get("kind") == "broken":
        raise ValueError("candidate has a bug: kind='broken'")
    return MLP(int(config["width"]), rngs, poison=config.get("kind") == "poison")


def suggest(trial: Any) -> dict[str, Any]:
    return {"width": trial.suggest_categorical("width", [16, 32]),
            "kind": trial.suggest_categorical("kind", ["ok", "broken", "poison"]),
            "learning_rate": trial.suggest_float("learning_rate", 1e-6, 3e-2, log=True)}


SPACE = SearchSpace("mlp-faults", suggest, build,
                    largest={"width": 32, "kind": "ok", "learning_rate": 1e-2})


def make_source(tmp_path, configs: list[dict[str, Any]], n_trials: int | None = None,
                pruner: str = "none", warmup_steps: int = 0):
    handle = open_study("mlp", study_dir=tmp_path, direction="minimize", sampler="random",
                        pruner=pruner, seed=0, warmup_steps=warmup_steps)
    for config in configs:
        handle.study.enqueue_trial(config)
    return handle.study, OptunaTrialSource(handle, SPACE, n_trials or len(configs))


def config(**kw: Any) -> EngineConfig:
    # Trials at once as the pool's memory allows (not the CPU default of one per two cores):
    # these tests are about concurrent trials.
    return EngineConfig(**{"steps": 30, "budget": Budget(BUDGET), "max_batch_size": 16,
                           "log_every": 5, "max_running_trials": None, **kw})


def ok(width: int = 16, lr: float = 1e-2) -> dict[str, Any]:
    return {"width": width, "kind": "ok", "learning_rate": lr}


def assert_replays(result: Any, study: Any) -> None:
    """A replay of the engine's run through a fresh scheduling core makes its placements."""
    results = {"run": dict(result.scheduling),
               "trials": [{"number": t.number, **t.user_attrs} for t in study.get_trials()]}
    recorded = recorded_placements(results)
    assert recorded and replay(results) == recorded


def test_trials_run_concurrently_and_are_told(tmp_path):
    study, source = make_source(tmp_path, [ok(16, 1e-2), ok(16, 2e-2), ok(32), ok(32, 3e-3)])
    engine = SearchEngine(SPACE, Regression(), source, config(), devices=jax.devices(),
                          checkpoint_root=tmp_path / "ckpt")
    result = engine.run()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    for t in trials:
        assert t.user_attrs["batch_size"] == 16
        assert t.user_attrs["steps"] == 30
        assert t.user_attrs["rank"] == 0
        assert 0 < t.user_attrs["predicted_peak_bytes"] <= BUDGET
        assert t.value == t.user_attrs["metrics"]["mse"]
        assert 0 < t.user_attrs["step_seconds"] < t.user_attrs["wall_seconds"] / 30
    # Two different trials overlapped in time (a multi-device trial's intervals on its several
    # devices are one span, not concurrency).
    spans = {key: (s, e) for device in result.intervals for key, s, e, _ in device}
    assert len(spans) == 4
    assert any(a != b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
               for a in spans for b in spans)
    assert result.usage["trials_finished"] == 4
    assert 0 < result.usage["mean_memory_utilization"] <= 1
    # One compile per architecture and device set: trials of one width on the same devices
    # reuse the first one's step.
    compiled = {(t.params["width"], tuple(t.user_attrs["devices"])) for t in trials}
    assert result.step_cache["misses"] == len(compiled)
    assert result.step_cache["hits"] == 4 - len(compiled)


def test_failing_trials_are_isolated(tmp_path):
    configs = [ok(), {"width": 16, "kind": "broken", "learning_rate": 1e-2},
               {"width": 16, "kind": "poison", "learning_rate": 1e-2}, ok(16, 3e-3)]
    study, source = make_source(tmp_path, configs)
    SearchEngine(SPACE, Regression(), source, config(), devices=jax.devices()[:4]).run()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL,
                                         TrialState.COMPLETE]
    assert "candidate has a bug" in trials[1].user_attrs[FAIL_REASON]
    assert "loss is nan" in trials[2].user_attrs[FAIL_REASON]


def test_out_of_memory_plan_is_replanned_and_completes(tmp_path):
    """The first plan underestimates memory; the real compiled peak is caught and re-planned.

    The first plan is made for 8x the real budget and claims to fit it, as an estimator that
    underestimates activations would. No error is injected: the runner compiles that plan on its
    devices, reads the peak from XLA's memory analysis, finds it above the budget, and the engine
    plans again with a smaller batch.
    """
    calls = []

    def optimistic_first_plan(model: Any, sample: Any, **kw: Any) -> Any:
        calls.append(kw["max_batch_size"])
        if len(calls) > 1:
            return planner.plan_mesh(model, sample, **kw)
        budget = kw["memory_per_device"]
        plan = planner.plan_mesh(model, sample, **{**kw, "memory_per_device": 8 * budget})
        # claims half the budget for everything the trial holds (step and prefetched batch)
        return dataclasses.replace(plan, peak_bytes_per_device=budget // 2, prefetch_bytes=0)

    study, source = make_source(tmp_path, [ok(32)])
    cfg = config(budget=Budget(2 * 2**20), max_batch_size=1 << 16, steps=3)
    engine = SearchEngine(SPACE, Regression(), source, cfg, devices=jax.devices()[:2],
                          plan_fn=optimistic_first_plan)
    result = engine.run()
    [trial] = study.get_trials()
    assert trial.state == TrialState.COMPLETE, trial.user_attrs.get(FAIL_REASON)
    assert trial.user_attrs["replans"] >= 1
    assert len(calls) >= 2 and calls[1] < calls[0]  # re-planned with a smaller batch cap
    assert trial.user_attrs["predicted_peak_bytes"] <= 2 * 2**20
    # The record replays: the out-of-memory end frees the devices, the re-plan queues again.
    kinds = [e[0] for e in trial.user_attrs["core_events"]]
    assert kinds[:3] == ["planned", "oom", "requeued"] and kinds[-1] == "finished"
    assert_replays(result, study)


def test_budget_too_small_for_any_candidate_stops_without_spending_trials(tmp_path):
    study, source = make_source(tmp_path, [ok(16), ok(32), ok(16, 3e-3)], n_trials=3)
    cfg = config(budget=Budget(512))
    engine = SearchEngine(SPACE, Regression(), source, cfg, devices=jax.devices()[:2])
    with pytest.raises(BudgetTooSmallError, match="raise memory_per_device or devices"):
        engine.run()
    assert source.finished() == 0  # the asked trials were put back for a run with more memory
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 3


def test_fixed_policy_gives_every_trial_the_same_devices_and_batch(tmp_path):
    study, source = make_source(tmp_path, [ok(16), ok(32), ok(16, 3e-3)])
    cfg = config(policy="fixed", devices_per_trial=2, max_batch_size=32, steps=10)
    engine = SearchEngine(SPACE, Regression(), source, cfg, devices=jax.devices()[:4])
    engine.run()
    trials = study.get_trials()
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert {len(t.user_attrs["devices"]) for t in trials} == {2}
    assert {t.user_attrs["batch_size"] for t in trials} == {engine.fixed_batch_size()}
    # No two trials shared a device at the same time.
    for device in engine.usage.busy_intervals():
        for a, b in zip(device, device[1:], strict=False):
            assert b.start >= a.end


def settings(study_dir: str, **overrides: Any) -> SearchSettings:
    """The settings of the small studies here (three trials of ten steps at batch 8, a
    checkpoint every 5 steps however short they are)."""
    return SearchSettings(**{"trials": 3, "steps": 10, "reference_batch": 8,
                             "max_batch_size": 16, "sampler": "random", "pruner": "none",
                             "study_dir": study_dir, "checkpoint_every": 5,
                             "checkpoint_min_seconds": 0, "max_running_trials": None,
                             **overrides})


def test_run_search_writes_results_plots_and_best_model(tmp_path):
    import io
    import json

    from rich.console import Console

    from scamp_jax.hpo.session import run_search

    out = io.StringIO()
    space = SearchSpace("mlp-ok", lambda t: {**suggest(t), "kind": "ok"}, build)
    frozen: list[int] = []

    class Watched(Regression):  # the objects that last the study are out of gc's full passes
        def evaluate(self, model):
            frozen.append(gc.get_freeze_count())
            return super().evaluate(model)

    before = gc.get_freeze_count()
    info = run_search(space, Watched(), settings(str(tmp_path)), devices=jax.devices()[:4],
                      memory_per_device=BUDGET, live=False, baseline="zero_mse",
                      console=Console(file=out, width=200))
    assert frozen and min(frozen) > before
    # given back to the collector at the end (Python 3.12.1 starts with objects already in
    # the permanent generation: `before` need not be 0, and gc.unfreeze releases those too)
    assert gc.get_freeze_count() == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["trials"]) == 3
    row = results["trials"][0]
    for key in ("number", "params", "devices", "model_parallel", "batch_size",
                "predicted_peak_bytes", "state", "steps", "wall_seconds", "mse", "zero_mse",
                "rank"):
        assert key in row
    assert row["steps"] == 10 * 8 // row["batch_size"]  # same samples at any planned batch
    header = (tmp_path / "results.csv").read_text().splitlines()[0]
    assert header.startswith("number,params,devices,model_parallel,batch_size")
    for name in ("mse_per_trial.png", "device_timeline.png", "memory_utilization.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "best_model" / "trial.json").is_file()
    assert info["best"]["number"] == results["best"]
    assert "best trial" in out.getvalue() and "zero_mse" in out.getvalue()


def test_live_view_draws_devices_and_trials_on_a_terminal():
    import io

    from scamp_jax.hpo.live import LiveView
    from scamp_jax.hpo.runner import TrialStatus
    from scamp_jax.scheduling.placement import Placement, TrialRequest
    from scamp_jax.scheduling.pool import DevicePool

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    pool = DevicePool([BUDGET] * 2)
    pool.allocate(Placement(7, (1,)), TrialRequest(7, 1, BUDGET // 2, 0))
    status = TrialStatus(7, {"width": 16, "learning_rate": 1e-3}, state="training",
                         devices=(1,), batch_size=8, step=3, steps=10, loss=0.25)
    with LiveView([BUDGET] * 2, "mse", stream=stream) as view:
        view.update([status], pool)
        view.notice("waiting for trial(s) [4] of another process")
    text = stream.getvalue()
    for expected in ("device pool", "32.00 MiB / 64.00 MiB", "width=16", "3/10", "0.25",
                     "training", "waiting for trial(s) [4]"):
        assert expected in text


def test_a_trial_planned_again_after_its_run_says_why():
    """A run out of memory: its ``planning`` line says why it is planned again."""
    import io

    from scamp_jax.hpo.live import LiveView
    from scamp_jax.hpo.runner import TrialStatus

    stream = io.StringIO()
    status = TrialStatus(3, {}, state="training", devices=(0,), batch_size=8, steps=100)
    status.step, status.loss = 39, 0.07
    with LiveView([BUDGET], "mse", stream=stream) as view:
        view.update([status])
        status.state, status.reason = "planning", "out of memory: needs 70.00 MiB"
        view.update([status])
    lines = stream.getvalue().splitlines()
    assert "trial   3 planning" in lines[1] and lines[1].endswith(
        "(planned again: out of memory: needs 70.00 MiB)"), lines


def test_a_fused_trials_line_names_its_group_and_members_not_a_width():
    """A fused trial's line says its group and how many trials it fuses as ``members=``, which
    a model's own ``width=`` (the commonest hyperparameter name) is not read as."""
    import io

    from scamp_jax.hpo.live import LiveView
    from scamp_jax.hpo.runner import TrialStatus

    stream = io.StringIO()
    status = TrialStatus(5, {"width": 16}, state="training", devices=(0,), batch_size=8,
                         steps=10)
    with LiveView([BUDGET], "mse", stream=stream) as view:
        view.update([status], groups={5: (2, 3)})
    line = stream.getvalue().splitlines()[0]
    assert " group=2 members=3" in line and " width=" not in line, line


def test_a_trials_line_says_the_step_an_earlier_metric_was_measured_at():
    """An intermediate evaluation's metric shown beside a later step (training on, or
    evaluating at the end) says its step, so two values at "step 40/40" do not read as one
    step's; the final metric, of the step shown, says none."""
    import io

    from scamp_jax.hpo.live import LiveView
    from scamp_jax.hpo.runner import TrialStatus

    stream = io.StringIO()
    status = TrialStatus(3, {"width": 16}, state="evaluating", devices=(0,), batch_size=8,
                         step=40, steps=40, metric=23.37, metric_step=30)
    with LiveView([BUDGET], "psnr", stream=stream) as view:
        view.update([status])
        status.state, status.metric, status.metric_step = "complete", 22.23, 40
        view.update([status])
    evaluating, complete = stream.getvalue().splitlines()[:2]
    assert evaluating.endswith("step=40/40 psnr=23.37 (at step 30)"), evaluating
    assert complete.endswith("step=40/40 psnr=22.23"), complete


def test_live_view_logs_state_changes_without_a_terminal():
    import io

    from scamp_jax.hpo.live import LiveView
    from scamp_jax.hpo.runner import TrialStatus

    stream = io.StringIO()
    status = TrialStatus(3, {"width": 16}, state="queued", batch_size=8, steps=10)
    view = LiveView([BUDGET], "mse", stream=stream)
    with view:
        view.update([status])
        view.update([status])  # unchanged: no new line
        status.state, status.reason = "failed", "ValueError: bug"
        view.update([status])
        view.notice("waiting for trial(s) [4] of another process")
        view.notice("")  # cleared: nothing to log
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert "trial   3 queued" in lines[0] and "(ValueError: bug)" in lines[1]
    assert lines[2].endswith("s] waiting for trial(s) [4] of another process")
    # a long reason is cut at a word, its line breaks put on the line (all of it: results.csv)
    stream.truncate(0)
    status.number, status.reason = 4, "TypeError: gradient only defined for\n" + "scalar " * 40
    view.update([status])
    [line] = stream.getvalue().strip("\0").splitlines()
    assert line.endswith("(TypeError: gradient only defined for scalar" + " scalar" * 10
                         + " ...)")


def test_a_log_shows_a_training_trial_advance_at_growing_intervals(monkeypatch):
    """Without a terminal a training trial gets a progress line 30 s after its last line, then
    60, 120, 240 and every 300 s (the clock is faked: the waits are minutes)."""
    import io

    from scamp_jax.hpo import live
    from scamp_jax.hpo.runner import TrialStatus

    clock = [1000.0]
    monkeypatch.setattr(live.time, "monotonic", lambda: clock[0])
    stream = io.StringIO()
    status = TrialStatus(3, {"width": 16}, state="training", batch_size=8, steps=10_000,
                         training_since=1000.0, first_step=100, step=100)
    view = live.LiveView([BUDGET], "mse", stream=stream)
    printed = []
    for t in range(0, 1200, 5):  # the engine updates the view twice a second; here every 5 s
        clock[0] = 1000.0 + t
        status.step, status.loss = 100 + 2 * t, 1.0 / (1 + t)
        view.update([status])
        if len(stream.getvalue().splitlines()) > len(printed):
            printed.append(t)
    assert printed == [0, 30, 90, 210, 450, 750, 1050]  # waits 30, 60, 120, 240, 300, 300
    line = stream.getvalue().splitlines()[1]
    assert "trial   3 training    step=160/10000 (2%) loss=0.03226, 2 steps/s" in line, line
    assert line.endswith("about 82 min left"), line
    status.state = "complete"
    view.update([status])
    assert "complete" in stream.getvalue().splitlines()[-1]
    # a fused group steps as one: one progress line names its members
    members = [TrialStatus(n, {"width": 16}, state="training", batch_size=8, steps=100,
                           training_since=clock[0], step=0) for n in (5, 6)]
    groups = {5: (2, 2), 6: (2, 2)}
    view.update(members, groups=groups)
    before = len(stream.getvalue().splitlines())
    clock[0] += 31
    for m in members:
        m.step = 31
    view.update(members, groups=groups)
    new_lines = stream.getvalue().splitlines()[before:]
    assert len(new_lines) == 1 and "trials 5, 6 (group 2) training    step=31/100" in \
        new_lines[0], new_lines


class BothTrain(Regression):
    """Each trial's data waits before its second batch, drawn during its first step, until the
    other trial has drawn its own: from then on both train at once, however long one of them
    took to compile on a loaded machine. Each later batch comes ``pace`` seconds after the one
    before (a step about as slow as a larger model's)."""

    def __init__(self, pace: float = 0.0) -> None:
        super().__init__()
        self.both = threading.Barrier(2)
        self.pace = pace

    def batches(self, batch_size: int, seed: int) -> Any:
        stream = super().batches(batch_size, seed)
        yield next(stream)
        try:
            self.both.wait(timeout=120)
        except threading.BrokenBarrierError:
            pass  # a stream drawn again (a restart) trains on alone
        for batch in stream:
            yield batch
            time.sleep(self.pace)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_checkpoints_running_trials_and_a_new_run_resumes_them(tmp_path, stop):
    """A Ctrl-C (or SIGTERM's `Terminated`) stops the running trials at their checkpoints; the
    notice offers a Ctrl-C "again" only after one."""
    study, source = make_source(tmp_path, [ok(16), ok(32)])
    # No periodic checkpoint before the end (step 100): only the Ctrl-C's save can resume them.
    # The steps are paced (20 a second) so that the engine, which looks every 0.5 s, sees one
    # at step 30 well before they end.
    cfg = config(steps=100, checkpoint_every=0, log_every=10)

    def ctrl_c_at_step_30(statuses: Any, pool: Any) -> None:
        if any(s.step >= 30 for s in statuses):
            raise stop

    notices: list[str] = []
    engine = SearchEngine(SPACE, BothTrain(pace=0.05), source, cfg, devices=jax.devices()[:2],
                          checkpoint_root=tmp_path / "ckpt", on_update=ctrl_c_at_step_30,
                          on_notice=notices.append)
    with pytest.raises(stop):
        engine.run()
    # Python's own Ctrl-C handler: a second one raises at once, the process still waits for
    # the trials' threads (the command line's handler ends it at once, and says so)
    ctrl_c = "Ctrl-C again" if stop is KeyboardInterrupt else "a Ctrl-C"
    assert any(n.startswith("stopping: 2 running trial(s)") and n.endswith(
        f"{ctrl_c} stops waiting for them (a script's process still ends only once their "
        "steps and any compile under way have)") for n in notices), notices
    trials = study.get_trials()
    assert [t.user_attrs.get(FAIL_REASON) for t in trials[:2]] == ["interrupted"] * 2
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 2
    assert source.finished() == 0
    # The step each trial's Ctrl-C checkpoint holds (None: it saved nothing).
    saved = {t.user_attrs[CHECKPOINT_KEY]: newest_step(tmp_path / "ckpt" /
                                                      t.user_attrs[CHECKPOINT_KEY])
             for t in trials[:2]}
    assert max(step or 0 for step in saved.values()) >= 30, saved

    again = OptunaTrialSource(study, SPACE, 2)
    SearchEngine(SPACE, Regression(), again, cfg, devices=jax.devices()[:2],
                 checkpoint_root=tmp_path / "ckpt").run()
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert sorted(t.params["width"] for t in complete) == [16, 32]
    # Each trial restarts from its Ctrl-C checkpoint, not from scratch.
    assert {t.user_attrs[CHECKPOINT_KEY]: t.user_attrs["resumed_from"]
            for t in complete} == {key: step or 0 for key, step in saved.items()}


def test_a_ctrl_c_while_a_plan_compiles_says_what_it_waits_for(tmp_path):
    """Nothing trains yet and a plan is compiling (slow here: it waits 3 s first, as a large
    model's compile would): the stop says it waits for that compile, instead of a silence
    that reads as a hang, and the trial goes back to the study."""
    study, source = make_source(tmp_path, [ok(16)])
    compiling = threading.Event()

    def slow_plan(*args: Any, **kwargs: Any) -> Any:
        compiling.set()
        time.sleep(3)
        return planner.plan_mesh(*args, **kwargs)

    def ctrl_c_while_compiling(statuses: Any, pool: Any) -> None:
        if compiling.is_set():
            raise KeyboardInterrupt

    notices: list[str] = []
    engine = SearchEngine(SPACE, Regression(), source, config(steps=10),
                          devices=jax.devices()[:1], plan_fn=slow_plan,
                          on_update=ctrl_c_while_compiling, on_notice=notices.append)
    with pytest.raises(KeyboardInterrupt):
        engine.run()
    assert any(n.startswith("stopping: waiting for 1 plan under way to finish compiling (the "
                            "trials are back in the study); Ctrl-C again") for n in notices), \
        notices
    trials = study.get_trials()
    assert trials and {t.user_attrs.get(FAIL_REASON) for t in trials} == {"interrupted"}


def test_a_stop_for_repeated_failures_while_a_plan_compiles_speaks_of_a_first_ctrl_c(tmp_path):
    """The study stops on its own (three trials failed alike) while the wide trial's plan is
    still compiling (held here until the stop has said so): no one pressed Ctrl-C, so the
    notice speaks of a first one."""
    study, source = make_source(tmp_path, [ok(32), ok(16), ok(16, 3e-3), ok(16, 1e-3)])
    said = threading.Event()

    class NarrowFails(Regression):
        def evaluate(self, model: Any) -> dict[str, float]:
            if model.hidden.out_features == 16:
                raise ValueError("a bug in evaluate")
            return super().evaluate(model)

    def held_plan(model: Any, *args: Any, **kwargs: Any) -> Any:
        if model.hidden.kernel.shape[1] == 32:
            said.wait(timeout=120)
        return planner.plan_mesh(model, *args, **kwargs)

    notices: list[str] = []

    def notice(line: str) -> None:
        notices.append(line)
        if "finish compiling" in line:
            said.set()

    engine = SearchEngine(SPACE, NarrowFails(), source,
                          config(steps=100_000, eval_every=10, failure_limit=3),
                          devices=jax.devices()[:4], checkpoint_root=tmp_path / "ckpt",
                          plan_fn=held_plan, on_notice=notice)
    with pytest.raises(RepeatedFailureError):
        engine.run()
    compiling = [n for n in notices if "finish compiling" in n]
    assert len(compiling) == 1 and "a Ctrl-C stops waiting for them" in compiling[0], notices


def test_a_stop_for_repeated_failures_tells_what_a_ctrl_c_would_do_not_a_second_one(tmp_path):
    """Three trials fail alike while a fourth trains: the run stops on its own, and its notice
    about the running trial speaks of a first Ctrl-C (no one pressed one)."""
    study, source = make_source(tmp_path, [ok(32), ok(16), ok(16, 3e-3), ok(16, 1e-3)])
    training = threading.Event()  # trial 0 trains: the others' failures may come

    class NarrowFails(Regression):
        """A task's bug: its evaluation raises for the narrow models, once trial 0 trains."""

        def evaluate(self, model: Any) -> dict[str, float]:
            if model.hidden.out_features == 16:
                training.wait(timeout=120)
                raise ValueError("a bug in evaluate")
            return super().evaluate(model)

    def watch(statuses: Any, pool: Any) -> None:
        if any(s.number == 0 and s.state == "training" for s in statuses):
            training.set()

    notices: list[str] = []
    engine = SearchEngine(SPACE, NarrowFails(), source,
                          config(steps=100_000, eval_every=10, failure_limit=3),
                          devices=jax.devices()[:4], checkpoint_root=tmp_path / "ckpt",
                          on_update=watch, on_notice=notices.append)
    with pytest.raises(RepeatedFailureError):
        engine.run()
    stopping = [n for n in notices if n.startswith("stopping: 1 running trial(s)")]
    assert len(stopping) == 1, notices
    assert "a re-run trains them from the start" in stopping[0]
    assert stopping[0].endswith("a Ctrl-C stops waiting for them (a script's process still "
                                "ends only once their steps and any compile under way have)")
    assert study.get_trials()[0].user_attrs.get(FAIL_REASON) == "interrupted"


def test_ctrl_c_gives_back_a_misfit_held_until_a_candidate_fits(tmp_path):
    """Until one candidate fits, a misfit is held back (the budget may be wrong, not it): a
    Ctrl-C then gives it back to the study with the rest, not left running."""
    study, source = make_source(tmp_path, [ok(32), ok(16)])

    def plan_fn(model: Any, sample: Any, **kw: Any) -> Any:
        if model.hidden.kernel.shape[1] == 32:
            raise planner.DoesNotFitError("does not fit here", 10**9, 10)
        time.sleep(2)  # the misfit is held back before this one is planned
        return planner.plan_mesh(model, sample, **kw)

    def ctrl_c(statuses: Any, pool: Any, **kw: Any) -> None:
        if any(s.number == 0 and s.state == "failed" for s in statuses):
            raise KeyboardInterrupt

    engine = SearchEngine(SPACE, Regression(), source, config(steps=5, nofit_limit=3),
                          devices=jax.devices()[:1], checkpoint_root=tmp_path / "ckpt",
                          plan_fn=plan_fn, on_update=ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        engine.run()
    source.close()
    trials = study.get_trials()
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    assert trials[0].user_attrs.get(FAIL_REASON) == "interrupted"


@pytest.mark.parametrize("recorded", [True, False], ids=["batch recorded", "batch.json lost"])
def test_a_trial_resumed_at_another_batch_trains_from_the_start(tmp_path, recorded):
    """Stopped at step 20 of 40 at batch 16, then run again where its batch is 4 (a smaller cap;
    an out-of-memory re-plan does the same): its checkpoints' steps are of batch 16, so it
    trains its 160 steps at batch 4 from the start, the samples it promises, not 20 x 16 +
    140 x 4; the checkpoints it leaves are of batch 4. Checkpoints whose batch is not recorded
    (``batch.json`` removed, or never written) may be of any batch: they are set aside alike."""
    study, source = make_source(tmp_path, [ok(16)])
    cfg = config(steps=40, reference_batch=16, max_batch_size=16, checkpoint_every=10,
                 log_every=10)

    class StopAt20(Regression):
        """A Ctrl-C as the trial draws its batch of step 20, then a pause in which the stop
        reaches the run (its steps take a millisecond: it would end first)."""

        def batches(self, batch_size: int, seed: int) -> Any:
            for i, batch in enumerate(super().batches(batch_size, seed)):
                if i == 20:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(2)
                yield batch

    with pytest.raises(KeyboardInterrupt):
        SearchEngine(SPACE, StopAt20(), source, cfg, devices=jax.devices()[:1],
                     checkpoint_root=tmp_path / "ckpt").run()
    source.close()
    (stopped,) = (tmp_path / "ckpt").iterdir()
    kept = sorted(int(p.name) for p in stopped.iterdir() if p.name.isdigit())
    assert kept and 0 < kept[-1] < 40, kept
    assert json.loads((stopped / "batch.json").read_text()) == {"batch_size": 16}
    if not recorded:
        (stopped / "batch.json").unlink()
    again = OptunaTrialSource(study, SPACE, 1)
    SearchEngine(SPACE, Regression(), again, dataclasses.replace(cfg, max_batch_size=4),
                 devices=jax.devices()[:1], checkpoint_root=tmp_path / "ckpt").run()
    (done,) = study.get_trials(states=(TrialState.COMPLETE,))
    attrs = done.user_attrs
    assert (attrs["batch_size"], attrs["steps"], attrs["resumed_from"]) == (4, 160, 0)
    (directory,) = (tmp_path / "ckpt").iterdir()
    assert json.loads((directory / "batch.json").read_text()) == {"batch_size": 4}


def test_a_run_with_trials_of_its_own_also_reruns_a_dead_process_trial(tmp_path):
    """A dead process left trial 0 RUNNING (its heartbeat not stale yet when this run starts).
    The engine runs the study's other trial, is told to ask again later rather than that the
    study is done, and runs trial 0's retry once it goes stale: two trials finish, not one."""
    # The grace period outlasts planning and training the other trial on a loaded 2-core host
    # (it took over 3 s there), so this run has run out of its own work before trial 0 is stale.
    def storage():
        return open_study("mlp", study_dir=tmp_path, direction="minimize", sampler="random",
                          seed=0, heartbeat_interval=1, grace_period=10)

    handle = storage()
    study = handle.study
    for width in (16, 32):
        study.enqueue_trial(ok(width))
    dead = OptunaTrialSource(handle, SPACE, 2)
    lost = dead.ask()
    dead.close()  # the process is gone: trial 0 stays RUNNING and stops beating
    source = OptunaTrialSource(storage(), SPACE, 2, poll_seconds=0.2)
    notices: list[str] = []
    result = SearchEngine(SPACE, Regression(), source, config(), devices=jax.devices()[:2],
                          checkpoint_root=tmp_path / "ckpt", on_notice=notices.append).run()
    source.close()
    # While it waited with nothing of its own to run, the user was told for what; then not.
    assert notices[0].startswith(f"waiting for trial(s) [{lost.number}], marked running by "
                                 "another process")
    assert notices[-1] == "" and len(notices) == 2
    # ... and its idle devices are said as such: both, for as long as it waited
    waited = result.scheduling["waited_for_held_trials_s"]
    assert 0.5 < waited < result.elapsed_s
    held = OverheadRecorder().summary(result)["idle_waiting_for_held_trials_device_s"]
    assert held == pytest.approx(2 * waited, abs=0.002)
    assert held <= result.usage["idle_device_seconds"] + 0.01
    trials = study.get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(t.params["width"] for t in complete) == [16, 32]
    assert trials[lost.number].state == TrialState.FAIL  # failed stale, then retried
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))


def test_a_trial_behind_the_others_is_pruned_from_its_intermediate_evaluations(tmp_path):
    configs = [ok(16, 1e-2), ok(16, 2e-2), ok(16, 1e-6)]
    study, source = make_source(tmp_path, configs, pruner="median", warmup_steps=5)
    # One device, one trial at a time: the first two finish before the third is judged.
    cfg = config(policy="fixed", devices_per_trial=1, steps=40, eval_every=10)
    result = SearchEngine(SPACE, Regression(), source, cfg, devices=jax.devices()[:1]).run()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE,
                                         TrialState.PRUNED]
    # The run's outcomes carry a value for a complete trial only: the score a pruned one was
    # stopped at is no result (the study stores none either).
    assert [(o.state, o.value is None) for o in result.outcomes] == [
        ("complete", False), ("complete", False), ("pruned", True)]
    assert trials[2].user_attrs["steps"] < 40
    assert "pruned at step" in trials[2].user_attrs[FAIL_REASON]
    assert source.finished() == 3


def test_a_batch_floor_moves_a_plan_to_more_devices_and_bounds_replans():
    """The MLP fits a batch of about 15 in 6 KiB on one device: a floor of 24 needs two."""
    space = SearchSpace("mlp", suggest, build)

    def engine(**kw: Any) -> SearchEngine:
        return SearchEngine(space, Regression(), source=None,
                            config=config(budget=Budget(6144), max_batch_size=64, **kw),
                            devices=jax.devices()[:4])

    one = engine().plan(ok())
    assert one.data_parallel * one.model_parallel == 1 and 8 <= one.batch_size < 24
    plan = engine(min_batch_size=24).plan(ok())
    assert plan.batch_size >= 24 and plan.data_parallel * plan.model_parallel == 2
    # Out of memory at run time: halving would go below the floor, so the re-plan doubles the
    # devices at the same batch instead.
    from scamp_jax.hpo.engine import PlannedTrial
    from scamp_jax.hpo.out_of_memory import next_request, plan_again
    from scamp_jax.hpo.study import AskedTrial
    from scamp_jax.hpo.units import SoloUnit

    floored = engine(min_batch_size=24)
    planned = PlannedTrial(AskedTrial(0, ok(), "trial_0"), plan, 2, 0)
    request = next_request(SoloUnit(planned).trial_plan(floored.planning), None,
                           floored.core.capacity, devices=4, min_batch=24)
    assert request is not None and (request.devices, request.max_batch) == (4, plan.batch_size)
    retry = plan_again(floored.planning, planned, request)
    assert retry is not None and retry.devices == 4 and retry.plan.batch_size >= 24
    assert retry.replans == 1
    # Nowhere enough: the floor is named in the reason.
    with pytest.raises(planner.DoesNotFitError, match="below min_batch_size=64") as refused:
        engine(min_batch_size=64).plan(ok())
    assert refused.value.bytes_needed > refused.value.bytes_available > 0
    with pytest.raises(ValueError, match="min_batch_size=32 is larger than max_batch_size=16"):
        config(max_batch_size=16, min_batch_size=32)


@pytest.mark.parametrize("grow", ["on", "auto"])
def test_last_wave_trial_grows_onto_idle_devices_only_where_that_can_help(tmp_path, grow):
    """A lone trial in the last wave: with growth on it runs data-parallel on all 4 devices;
    by default on CPU devices (one host's cores split up) it keeps its planned single device."""
    study, source = make_source(tmp_path, [ok()])
    result = SearchEngine(SPACE, Regression(), source,
                          config(reference_batch=8, elastic=grow),
                          devices=jax.devices()[:4]).run()
    (trial,) = study.get_trials()
    assert trial.state == TrialState.COMPLETE
    assert len(trial.user_attrs["devices"]) == (4 if grow == "on" else 1)
    assert trial.user_attrs["steps"] == 15  # 30 steps at batch 8 is 15 at the planned 16
    if grow == "on":  # the plan on 4 devices was asked for and answered; the replay asks it
        assert [e[:3] for e in trial.user_attrs["core_events"]
                if e[0].startswith("option")][0][::2] == ["option_asked", 4]
        assert_replays(result, study)


def test_a_running_trial_restarts_on_idle_devices_with_the_same_result(tmp_path):
    """In the tail a lone trial on 1 of 4 devices is stopped at a checkpoint and restarted on
    more devices with the same global batch; it ends as the same trial would unresized."""
    outcomes = {}
    for grow in (True, False):
        study, source = make_source(tmp_path / str(grow), [ok(16, 3e-3)])
        # Long enough to outlast the restart decision, which lands near step 3,700 on an idle
        # 2-core machine (pace measured, the 4-device plan compiled): at 3,000 steps the trial
        # finished first in about half the runs.
        cfg = config(steps=12000, log_every=100, elastic="on" if grow else "off",
                     restart_seconds=0.0)
        result = SearchEngine(SPACE, Regression(), source, cfg, devices=jax.devices()[:4],
                              checkpoint_root=tmp_path / str(grow) / "ckpt").run()
        (trial,) = study.get_trials()
        assert trial.state == TrialState.COMPLETE
        outcomes[grow] = trial
        if grow:  # the restart is booked again by the core in the replay
            assert "restarted" in [e[0] for e in trial.user_attrs["core_events"]]
            assert_replays(result, study)
    resized, plain = outcomes[True], outcomes[False]
    assert plain.user_attrs["resizes"] == 0 and len(plain.user_attrs["devices"]) == 1
    # Restart cost 0 and, the lone trial setting the best rate on CPU (fully busy), a linear
    # speed-up predicted: the idle devices all go to it at once.
    assert resized.user_attrs["resizes"] >= 1 and len(resized.user_attrs["devices"]) == 4
    assert 0 < resized.user_attrs["resumed_from"] < 12000
    assert resized.user_attrs["batch_size"] == plain.user_attrs["batch_size"] == 16
    assert resized.user_attrs["steps"] == 12000
    # Its seconds are both runs' (the one the restart stopped, and the one after it), not the
    # last run's alone: more than the seconds since the restart by half the first run's.
    times = resized.user_attrs
    restart = times["placements"][-1][0]
    assert times["wall_seconds"] > (times["finished_at"] - restart
                                    + 0.5 * (restart - times["started_at"])), times
    # Same samples, same updates: only the batch mean's summation order differs.
    assert resized.value == pytest.approx(plain.value, rel=1e-5)
    with pytest.raises(ValueError, match="restart_seconds=-1.0 must be >= 0"):
        config(restart_seconds=-1.0)


def test_a_refused_growth_plan_leaves_the_trial_on_its_own_devices(tmp_path):
    """Fault injection (a planner that refuses 4 devices; hard to provoke with a real model):
    the lone last-wave trial the policy grew onto 4 devices starts on fewer instead of
    stalling the idle pool."""

    def refuse_four(model: Any, batch: Any, *, devices: Any, **kw: Any) -> Any:
        if len(devices) == 4:
            raise planner.DoesNotFitError("refused for the test", 1, 0)
        return planner.plan_mesh(model, batch, devices=devices, **kw)

    study, source = make_source(tmp_path, [ok()])
    SearchEngine(SPACE, Regression(), source, config(reference_batch=8, elastic="on"),
                 devices=jax.devices()[:4], plan_fn=refuse_four).run()
    (trial,) = study.get_trials()
    assert trial.state == TrialState.COMPLETE
    # 4 devices withdrawn, the next option (2) is planned and taken.
    assert len(trial.user_attrs["devices"]) == 2


def test_a_trial_whose_seconds_could_not_be_stored_at_a_checkpoint_still_completes(
        tmp_path, caplog):
    """The seconds a run stores with each checkpoint are a record, not its training: a storage
    that refuses them (a stand-in that raises: a database locked beyond its retries cannot be
    caused on demand) is said, and the trial completes with its whole seconds stored."""
    import sqlalchemy.exc

    study, source = make_source(tmp_path, [ok(16)])
    refused: list[int] = []

    def progress(number: int, wall_seconds: float) -> None:
        refused.append(number)
        raise sqlalchemy.exc.OperationalError("UPDATE", {}, Exception("database is locked"))

    source.progress = progress  # type: ignore[method-assign]
    engine = SearchEngine(SPACE, Regression(), source,
                          config(checkpoint_every=10, checkpoint_min_seconds=0),
                          devices=jax.devices()[:1], checkpoint_root=tmp_path / "ckpt")
    with caplog.at_level("WARNING", logger="scamp_jax.hpo.engine"):
        engine.run()
    [trial] = study.get_trials()
    assert trial.state == TrialState.COMPLETE and trial.user_attrs["wall_seconds"] > 0
    assert refused == [trial.number, trial.number]  # steps 10 and 20 (30: the last)
    assert "trial 0: its seconds so far were not stored (OperationalError" in caplog.text


def test_a_run_that_trains_one_trial_at_a_time_asks_one_ahead_not_one_per_device(tmp_path):
    """Eight devices, one trial at a time (the cap of a small CPU host): the run holds the
    trial it trains and one planned ahead, and leaves the study's other trials to any other
    process of the study, which would otherwise find them all taken and train nothing."""
    study, source = make_source(tmp_path, [ok(16, 1e-2), ok(16, 2e-2), ok(32), ok(32, 3e-3),
                                           ok(16, 5e-3)])
    held: list[int] = []
    ask = source.ask

    def counted_ask(*args: Any, **kwargs: Any) -> Any:
        answer = ask(*args, **kwargs)
        held.append(len(source.live_numbers()))
        return answer

    source.ask = counted_ask
    SearchEngine(SPACE, Regression(), source, config(max_running_trials=1),
                 devices=jax.devices()[:8]).run()
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE] * 5
    assert held and max(held) <= 2, held


def test_a_queued_trial_planned_for_more_devices_says_so_while_its_plan_compiles(tmp_path):
    """The last wave's lone trial is planned again for the idle devices before it starts: its
    status says ``planning`` while that plan compiles (a line in the log, not a silent
    queue), and it then starts on them."""
    study, source = make_source(tmp_path, [ok()])
    engine = SearchEngine(SPACE, Regression(), source, config(reference_batch=8, elastic="on"),
                          devices=jax.devices()[:4])
    plan = engine.planning.planned_with_cost
    while_planned: list[tuple[int, str]] = []

    def planned_with_cost(*args: Any, devices: int | None = None, **kw: Any) -> Any:
        if devices == 4:  # the option, asked with the trial queued on its own plan
            while_planned.append((devices, engine.records[0].status.state))
        return plan(*args, devices=devices, **kw)

    engine.planning.planned_with_cost = planned_with_cost
    engine.run()
    assert len(study.get_trials()[0].user_attrs["devices"]) == 4
    assert while_planned == [(4, "planning")]


def test_the_planner_threads_take_work_for_planned_trials_before_new_plans():
    """A group of retries to size (or a trial to re-plan) is work for trials ready to train:
    the planner threads take it before new trials' plans that were submitted earlier and have
    not begun, which left the devices idle behind them. A shutdown that cancels cancels the
    work not begun, and an error reaches its future."""
    import concurrent.futures as cf
    import threading

    from scamp_jax.hpo.work import PlannerPool

    pool = PlannerPool(1)
    began, release, ran = threading.Event(), threading.Event(), []

    def first():  # the thread is busy with an earlier plan
        began.set()
        release.wait(10)
        ran.append("busy")

    pool.submit(first)
    assert began.wait(10)
    futures = [pool.submit(ran.append, "plan 5"), pool.submit(ran.append, "plan 6"),
               pool.submit_first(ran.append, "size group 2")]
    release.set()
    cf.wait(futures, timeout=10)
    assert ran == ["busy", "size group 2", "plan 5", "plan 6"]
    failing = pool.submit_first(lambda: 1 / 0)
    assert isinstance(failing.exception(timeout=10), ZeroDivisionError)
    began.clear(), release.clear()
    pool.submit(first)
    assert began.wait(10)
    waiting = pool.submit(ran.append, "never")
    pool.shutdown(wait=False, cancel_futures=True)
    release.set()
    pool.shutdown(wait=True)
    assert waiting.cancelled() and ran[-1] == "busy"
    # after a shutdown a call is refused, as an executor refuses it, and nothing is left
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit_first(ran.append, "late")
    assert not pool._waiting
