"""Out of memory: one mapping detects it (run time, ledger check, compile time), one module
decides what follows (`scamp_jax.hpo.out_of_memory`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from optuna.trial import TrialState
from test_engine import SPACE, Regression, config, make_source, ok

from scamp_jax.hpo.engine import SearchEngine
from scamp_jax.hpo.study import FAIL_REASON
from scamp_jax.hpo.trial import ending
from scamp_jax.planning import planner
from scamp_jax.planning.budget import Budget

#: What compiling a step reported on a GPU when the autotuner could not allocate its buffers.
AUTOTUNE_OOM = ("INTERNAL: Failed to get configs for 31 of 120 instructions; the first: "
                "Failed to allocate 3.40GiB for autotuning")


def test_an_allocation_the_autotuner_is_refused_while_compiling_is_out_of_memory() -> None:
    """XLA's GPU autotuner takes its buffers from the trials' pool while a step compiles; when
    it cannot, compiling fails with "Failed to get configs". A CPU backend has no autotuner, so
    the error is built here with the text a GPU run reported (the one fault made up here)."""
    state, reason, _ = ending(RuntimeError(AUTOTUNE_OOM))
    assert state == "oom" and reason.startswith("out of memory:")
    # The same words for another cause of an autotuning failure are a failed trial.
    assert ending(RuntimeError("Failed to get configs: unsupported instruction"))[0] == "failed"


def test_a_step_that_cannot_be_autotuned_ends_the_run_out_of_memory(monkeypatch) -> None:
    """The run compiles its step first; when compiling fails for want of memory (XLA's GPU
    autotuner: injected here, a CPU backend has none) the run ends ``oom`` for the ledger to
    plan again, before it placed anything, not ``failed``."""
    from flax import nnx

    from scamp_jax.hpo.runner import RunSpec, SoloProgram, make_optimizer, run_trial

    def refused(self: Any) -> None:
        raise RuntimeError(AUTOTUNE_OOM)

    monkeypatch.setattr(SoloProgram, "compile", refused)
    task = Regression()
    model = nnx.eval_shape(lambda: SPACE.build(ok(), nnx.Rngs(0)))
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=1, memory_per_device=2**24,
                             optimizer=make_optimizer(ok()), loss_fn=task.loss_fn,
                             max_batch_size=8, compile_for_run=False)
    result = run_trial(RunSpec(0, ok(), plan, steps=2, memory_per_device=2**24), SPACE, task)
    assert result.state == "oom" and result.steps == 0
    assert "Failed to get configs" in result.reason


def test_out_of_memory_replans_stop_at_max_replans(tmp_path) -> None:
    """Every plan claims half the budget for a step that needs more: each run's ledger check
    finds the real compiled peak over its share (out of memory), the loop plans again, and after
    ``max_replans`` re-plans the trial fails, saying why. No error is injected."""
    def optimistic(model: Any, sample: Any, **kw: Any) -> Any:
        budget = kw["memory_per_device"]
        plan = planner.plan_mesh(model, sample, **{**kw, "memory_per_device": 8 * budget})
        return dataclasses.replace(plan, peak_bytes_per_device=budget // 4, prefetch_bytes=0)

    study, source = make_source(tmp_path, [ok(32)])
    cfg = config(budget=Budget(2 * 2**20), max_batch_size=1 << 16, steps=3, max_replans=1)
    SearchEngine(SPACE, Regression(), source, cfg, devices=jax.devices()[:1],
                 plan_fn=optimistic).run()
    (trial,) = study.get_trials()
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["replans"] == 1
    assert "no smaller plan fits" in trial.user_attrs[FAIL_REASON]
    assert trial.user_attrs[FAIL_REASON].startswith("out of memory")


def test_a_replan_refused_by_the_batch_floor_names_it(tmp_path) -> None:
    """The run is out of memory (its plan claims a quarter of the budget for a step that needs
    far more); what would fit is below ``min_batch_size`` and the pool has no second device to
    grow onto, so the trial fails, and its reason names the floor."""
    def optimistic(model: Any, sample: Any, **kw: Any) -> Any:
        budget = kw["memory_per_device"]
        plan = planner.plan_mesh(model, sample, **{**kw, "memory_per_device": 8 * budget})
        return dataclasses.replace(plan, peak_bytes_per_device=budget // 4, prefetch_bytes=0)

    study, source = make_source(tmp_path, [ok(32)])
    cfg = config(budget=Budget(2 * 2**20), min_batch_size=1 << 15, max_batch_size=1 << 16,
                 steps=3, max_replans=3)
    SearchEngine(SPACE, Regression(), source, cfg, devices=jax.devices()[:1],
                 plan_fn=optimistic).run()
    (trial,) = study.get_trials()
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["replans"] == 0
    reason = trial.user_attrs[FAIL_REASON]
    assert reason.startswith("out of memory"), reason
    assert reason.endswith("; no smaller plan fits at a batch of at least min_batch_size=32768"), \
        reason


def test_a_replan_that_raises_fails_its_trial_and_the_study_goes_on(tmp_path) -> None:
    """The first plan's run is out of memory; planning the trial again raises (a compile error,
    here raised by the planner stand-in after the first plan): that trial fails saying so, and
    the study's other trial completes, none left running."""
    calls: list[int] = []

    def failing_again(model: Any, sample: Any, **kw: Any) -> Any:
        budget = kw["memory_per_device"]
        if model.hidden.kernel.shape[1] == 16:
            return planner.plan_mesh(model, sample, **kw)
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("INTERNAL: the compile of the re-plan failed")
        plan = planner.plan_mesh(model, sample, **{**kw, "memory_per_device": 8 * budget})
        return dataclasses.replace(plan, peak_bytes_per_device=budget // 4, prefetch_bytes=0)

    study, source = make_source(tmp_path, [ok(32), ok(16)])
    cfg = config(budget=Budget(2 * 2**20), max_batch_size=1 << 16, steps=3)
    SearchEngine(SPACE, Regression(), source, cfg, devices=jax.devices()[:1],
                 plan_fn=failing_again).run()
    first, second = study.get_trials()
    assert first.state == TrialState.FAIL and len(calls) == 2
    assert first.user_attrs[FAIL_REASON].startswith("out of memory")
    assert ("; planning it again failed: RuntimeError: INTERNAL: the compile of the re-plan "
            "failed") in first.user_attrs[FAIL_REASON]
    assert second.state == TrialState.COMPLETE


def test_a_replan_never_goes_below_the_batch_floor_and_grows_instead() -> None:
    """A queued trial is planned again at most at its batch once the allowance learned while
    the study ran is booked (`OutOfMemory.no_longer_fits`). Where what fits on its devices is
    below ``min_batch_size``, the plan moves to twice the devices (ScaMP, within the pool), or
    there is none; it never trains below the floor."""
    from test_runner import SPACE as MLP_SPACE
    from test_runner import Regression as MLPRegression

    from scamp_jax.hpo.out_of_memory import Replan, plan_again
    from scamp_jax.hpo.plan_service import PlanningService
    from scamp_jax.hpo.study.trials import AskedTrial
    from scamp_jax.hpo.trial import PlannedTrial

    params = {"width": 64, "learning_rate": 1e-2}
    got = {}
    for pool in (1, 2):
        cfg = config(budget=Budget(2 * 2**20), min_batch_size=64, max_batch_size=1 << 14)
        planning = PlanningService(MLP_SPACE, MLPRegression(), cfg, jax.devices()[:pool],
                                   planner.plan_mesh)
        first = planning.plan(params, devices=1)
        planned = PlannedTrial(AskedTrial(0, params, "trial_0"), first, 1, 0)
        # what the allowance leaves of a device: 86 samples fit on one, then 53 and 36
        for left in (60_000, 40_000, 30_000):
            planning.allowance = lambda held=first.usable_bytes - left: held
            again = plan_again(planning, planned,
                               Replan(0, 1, int(first.batch_size), counted=False))
            got[pool, left] = (None if again is None
                               else (int(again.plan.batch_size), again.devices))
    assert got[1, 60_000] == got[2, 60_000] == (86, 1)
    assert got[1, 40_000] is None and got[1, 30_000] is None  # below 64 on its only device
    assert got[2, 40_000] == (106, 2) and got[2, 30_000] == (72, 2)


class _Handled:
    """An `OutOfMemory` over a real scheduling core of 4 devices and real trial records, for
    one trial planned at a batch of 64 on one device and running; what it asks of the loop
    (a re-plan, a queue, a report) is written down here."""

    def __init__(self, **kw: Any) -> None:
        from flax import nnx

        from scamp_jax.hpo.out_of_memory import OutOfMemory
        from scamp_jax.hpo.record import TrialRecord
        from scamp_jax.hpo.study.trials import AskedTrial
        from scamp_jax.hpo.trial import PlannedTrial, TrialStatus
        from scamp_jax.scheduling.core import SchedulingCore, TrialPlan
        from scamp_jax.scheduling.placement import make_policy

        self.config = config(budget=Budget(2**24), max_batch_size=64, **kw)
        self.core = SchedulingCore(make_policy(self.config.policy), 4, self.config.budget)
        model = nnx.eval_shape(lambda: SPACE.build(ok(), nnx.Rngs(0)))
        plan = planner.plan_mesh(model, Regression().sample_batch(1), devices=1,
                                 memory_per_device=2**24, max_batch_size=64,
                                 compile_for_run=False)
        assert int(plan.batch_size) == 64
        self.planned = PlannedTrial(AskedTrial(0, ok(), "trial_0"), plan, 1, 0)
        self.record = TrialRecord(TrialStatus(0, ok()), self.planned.asked)
        self.core.planned(0.0, TrialPlan(0, 0, 1, 2**20, 10, batch_size=64))
        assert [a.key for a in self.core.decide(0.0)] == [0]
        self.replans: list[Any] = []
        self.queued: list[Any] = []
        self.reports: list[Any] = []
        self.oom = OutOfMemory(self.config, self.core, {0: self.record},
                               lambda planned, request: self.replans.append(request),
                               self.queued.append,
                               lambda planned, result: self.reports.append(result))

    def ran_out(self, bytes_needed: int | None) -> None:
        from scamp_jax.hpo.trial import RunResult

        self.oom.run_ended(1.0, self.planned, RunResult(
            0, "oom", 2, 1.0, reason="out of memory: the test's", bytes_needed=bytes_needed))


def test_out_of_memory_under_the_fixed_policy_never_moves_a_trial_to_more_devices() -> None:
    """Half of what the run needed is below ``min_batch_size``: ScaMP plans the same batch on
    twice the devices; the fixed policy gives every trial its devices, so the trial fails
    there, saying why."""
    scamp = _Handled(min_batch_size=32)
    scamp.ran_out(4 * scamp.core.capacity)
    assert [(r.devices, r.max_batch) for r in scamp.replans] == [(2, 64)]
    fixed = _Handled(min_batch_size=32, policy="fixed")
    fixed.ran_out(4 * fixed.core.capacity)
    assert fixed.replans == [] and [r.state for r in fixed.reports] == ["failed"]
    assert fixed.reports[0].reason == ("out of memory: the test's; no smaller plan fits at a "
                                       "batch of at least min_batch_size=32")


def test_a_trial_out_of_memory_is_planning_again_and_queued_with_its_count() -> None:
    from dataclasses import replace

    handled = _Handled()
    handled.record.status.step, handled.record.status.loss = 39, 0.07  # where it ran out
    handled.ran_out(None)
    assert [(r.devices, r.max_batch, r.counted) for r in handled.replans] == [(1, 32, True)]
    assert handled.record.status.state == "planning" and 0 not in handled.core.running
    retry = replace(handled.planned, replans=1)
    handled.oom.replanned(handled.planned, retry)
    assert handled.queued == [retry] and handled.record.status.replans == 1
    # its next run starts over (or says the checkpoint it resumes): not at step 39
    assert handled.record.status.step == 0 and math.isnan(handled.record.status.loss)
    assert handled.record.status.reason == ""  # a later planning line (more devices) is not
    # No re-plan left: it fails, and the reason names no floor where there is none.
    spent = _Handled(max_replans=0)
    spent.ran_out(None)
    assert spent.replans == []
    assert spent.reports[0].reason == "out of memory: the test's; no smaller plan fits"


def test_a_plan_that_no_longer_fits_the_learnt_allowance_is_planned_again_at_its_batch() -> None:
    """Not an out-of-memory re-plan: its batch may stay (what fits is at most the batch it
    had), and it does not count against ``max_replans``."""
    handled = _Handled()
    handled.oom.no_longer_fits(handled.planned)
    assert [(r.devices, r.max_batch, r.counted) for r in handled.replans] == [(1, 64, False)]
    assert handled.record.status.state == "planning"
    handled.oom.replanned(handled.planned, None)
    assert handled.reports[0].reason.startswith("its plan no longer fits once the allowance")


def test_a_member_whose_group_ran_out_of_memory_is_never_grouped_again() -> None:
    """Its group's run ran out of memory: the member is queued to be admitted again, and the
    fusion service then makes it a solo unit instead of grouping it once more."""
    from scamp_jax.hpo.fused_engine import FusionService
    from scamp_jax.hpo.units import SoloUnit

    handled = _Handled()
    handled.record.group, handled.record.width = 0, 2
    handled.oom.member_ended(handled.planned)
    assert handled.queued == [handled.planned]
    assert (handled.record.group, handled.record.width) == (None, 1)
    service = FusionService(SPACE, Regression(), 3, planning=None,
                            held_siblings=lambda proposal: 0)
    assert isinstance(service.admit(handled.planned, handled.record), SoloUnit)


def test_a_replan_for_the_learnt_allowance_is_costed_uncounted_and_grows_only_under_scamp():
    """`plan_again` of a request that is no out-of-memory re-plan (the learnt allowance) leaves
    the trial's count of re-plans as it was, and costs the new plan (the core orders trials
    by it). Below ``min_batch_size`` on its device, the fixed policy does not move the plan to
    more devices as ScaMP does (tests above): there is no plan."""
    from test_runner import SPACE as MLP_SPACE
    from test_runner import Regression as MLPRegression

    from scamp_jax.hpo.out_of_memory import Replan, plan_again
    from scamp_jax.hpo.plan_service import PlanningService
    from scamp_jax.hpo.study.trials import AskedTrial
    from scamp_jax.hpo.trial import PlannedTrial

    params = {"width": 64, "learning_rate": 1e-2}
    services = {}
    for policy in ("scamp", "fixed"):
        cfg = config(budget=Budget(2 * 2**20), min_batch_size=64, max_batch_size=1 << 14,
                     policy=policy)
        services[policy] = PlanningService(MLP_SPACE, MLPRegression(), cfg,
                                           jax.devices()[:2], planner.plan_mesh)
    first = services["scamp"].plan(params, devices=1)
    planned = PlannedTrial(AskedTrial(0, params, "trial_0"), first, 1, 0, replans=1)
    request = Replan(0, 1, int(first.batch_size), counted=False)
    scamp = services["scamp"]
    scamp.allowance = lambda: first.usable_bytes - 60_000  # 86 samples fit on one device
    again = plan_again(scamp, planned, request)
    assert (int(again.plan.batch_size), again.devices, again.replans) == (86, 1, 1)
    assert scamp.flops_of(0, again.plan)
    fixed = services["fixed"]
    fixed.allowance = lambda: first.usable_bytes - 40_000  # 53 on one device: below 64
    assert plan_again(fixed, planned, request) is None
