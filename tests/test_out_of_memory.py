"""Out of memory: one mapping detects it (run time, ledger check, compile time), one module
decides what follows (`scamp_jax.hpo.out_of_memory`)."""

from __future__ import annotations

import dataclasses
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
