"""What a trial holds per device is what it planned: step + prefetched batch, chunked evaluation
on its own mesh, and a restore that lands on the plan's shardings; a fused group likewise."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from scamp_jax.hpo.checkpoint import TrialCheckpointer
from scamp_jax.hpo.fused_runner import GroupSpec, MemberSpec, run_fused_group
from scamp_jax.hpo.runner import (
    RunSpec,
    StepCache,
    _initial_state,
    make_optimizer,
    peak_bytes,
    run_trial,
)
from scamp_jax.planning import planner
from scamp_jax.planning import sharding as sh
from scamp_jax.planning.evaluation import EvalCompiler, abstract_eval_inputs
from scamp_jax.planning.fusion import plan_fusion
from scamp_jax.planning.train_step import split_model
from scamp_jax.space import SearchSpace
from search_spaces import vit

CONFIG = {"embed_dim": 16, "num_heads": 2, "learning_rate": 3e-3}
BUDGET = 64 * 2**20


def _build(config, rngs: nnx.Rngs) -> vit.ViT:
    return vit.ViT(image_size=8, patch_size=4, num_classes=4, embed_dim=config["embed_dim"],
                   depth=1, num_heads=config["num_heads"], rngs=rngs)


SPACE = SearchSpace("tiny-vit", lambda t: dict(CONFIG), _build)


@functools.cache
def _task() -> vit.SyntheticClassificationTask:
    return vit.SyntheticClassification(image_size=8, num_classes=4, eval_size=240, seed=3)


@functools.cache
def _plan() -> planner.Plan:
    """4 devices as 2 (data) x 2 (model), every parameter split, evaluation planned."""
    model = nnx.eval_shape(lambda: _build(CONFIG, nnx.Rngs(0)))
    return planner.plan_mesh(model, _task().sample_batch(1), devices=jax.devices()[:4],
                             memory_per_device=BUDGET, optimizer=make_optimizer({}),
                             loss_fn=_task().loss_fn, max_batch_size=8, model_parallel=2,
                             min_shard_elements=0, eval_task=_task())


def _state(plan: planner.Plan, seed: int = 0):
    spec = RunSpec(0, CONFIG, plan, steps=1, memory_per_device=BUDGET)
    return _initial_state(SPACE, spec, make_optimizer(CONFIG), seed)


def test_predicted_peak_covers_the_compiled_step_and_the_prefetched_batch():
    plan = _plan()
    # The runner's own compile of the step (its cache builds it from the plan's shardings),
    # and the real per-device bytes of a batch placed on the trial's devices.
    graphdef = split_model(nnx.eval_shape(lambda: _build(CONFIG, nnx.Rngs(0))))[0]
    step, _ = StepCache().get(graphdef, plan, _task().loss_fn, CONFIG)
    params, opt_state, rest = _state(plan)
    batch = jax.device_put(next(_task().batches(plan.batch_size, 0)), plan.batch_sharding)
    compiled_peak = peak_bytes(step.lower(params, opt_state, rest, batch).compile())
    on_device = max(
        sum(s.data.nbytes for leaf in batch for s in leaf.addressable_shards if s.device == d)
        for d in plan.devices
    )
    assert on_device == plan.prefetch_bytes > 0
    assert plan.predicted_peak_bytes >= compiled_peak + on_device
    assert plan.predicted_peak_bytes <= plan.usable_bytes


def test_eval_is_chunked_to_fit_and_equals_the_unchunked_evaluation():
    plan, task = _plan(), _task()
    groups = abstract_eval_inputs(task)
    assert plan.eval_chunk % plan.data_parallel == 0
    assert 0 < plan.eval_chunk < groups[0].shape[0], "the cap on the batch forces chunks"
    params, opt_state, rest = _state(plan)
    graphdef = split_model(nnx.eval_shape(lambda: _build(CONFIG, nnx.Rngs(0))))[0]
    evaluator = EvalCompiler(graphdef, task.eval_forward, params, rest,
                             plan.step_shardings.params, plan.step_shardings.rest, plan.mesh)
    # The eval step's compiled peak at the chosen chunk, with what stays resident, fits the
    # share and stays within the plan's prediction; the whole set in one batch would not.
    chunk_peak = evaluator.peak(plan.eval_chunk, groups)
    resident = sh.bytes_per_device(opt_state, plan.step_shardings.opt_state) + plan.prefetch_bytes
    assert chunk_peak == plan.eval_peak_bytes
    assert chunk_peak + resident <= plan.predicted_peak_bytes <= plan.usable_bytes
    whole = groups[0].shape[0] + (-groups[0].shape[0]) % plan.data_parallel
    assert evaluator.peak(whole, groups) > chunk_peak

    chunked = evaluator.run(plan.eval_chunk, params, rest, task.eval_inputs())
    unchunked = evaluator.run(whole, params, rest, task.eval_inputs())
    np.testing.assert_allclose(chunked[0], unchunked[0], rtol=1e-6, atol=1e-6)
    assert task.score(chunked) == pytest.approx(task.score(unchunked), rel=1e-6)
    # ... and equals the task's own evaluation of the merged model on one device.
    single = jax.device_put(jax.tree.map(np.asarray, (params, rest)), jax.devices()[0])
    reference = task.evaluate(nnx.merge(graphdef, *single))
    assert task.score(chunked) == pytest.approx(reference, rel=1e-5)


def test_an_evaluation_chunk_the_run_chooses_holds_the_prefetched_batch_beside_it():
    """Where the plan chose no evaluation chunk, the run chooses one (`plan_eval`) with the
    optimizer state and the prefetched batch resident beside the forward, as beside the plan's
    chunk: a share that holds the smallest chunk's forward and the optimizer state but not
    that batch too is out of memory (a step whose peak is unknown checks evaluation alone)."""
    from scamp_jax.hpo.lifecycle import check_share
    from scamp_jax.hpo.trial import TrialOutOfMemory

    plan, task = dataclasses.replace(_plan(), eval_chunk=0, evaluator=None), _task()
    params, opt_state, rest = _state(plan)
    graphdef = split_model(nnx.eval_shape(lambda: _build(CONFIG, nnx.Rngs(0))))[0]
    evaluator = EvalCompiler(graphdef, task.eval_forward, params, rest,
                             plan.step_shardings.params, plan.step_shardings.rest, plan.mesh)
    resident = sh.bytes_per_device(opt_state, plan.step_shardings.opt_state)
    prefetch = plan.prefetch_bytes
    assert resident > 0 and prefetch > 0
    smallest = evaluator.peak(plan.data_parallel, abstract_eval_inputs(task))
    fits = smallest + resident + prefetch
    with pytest.raises(TrialOutOfMemory) as short:
        check_share(fits - 1, None, prefetch, task, lambda: evaluator, resident, plan)
    assert short.value.bytes_needed == fits
    chosen, held = check_share(fits, None, prefetch, task, lambda: evaluator, resident, plan)
    assert chosen is not None and chosen.resident_bytes == resident + prefetch
    assert held == chosen.total_bytes <= fits


def test_eval_inputs_are_placed_on_the_trials_devices():
    plan, task = _plan(), _task()
    params, _, rest = _state(plan)
    graphdef = split_model(nnx.eval_shape(lambda: _build(CONFIG, nnx.Rngs(0))))[0]
    evaluator = EvalCompiler(graphdef, task.eval_forward, params, rest,
                             plan.step_shardings.params, plan.step_shardings.rest, plan.mesh)
    compiled = evaluator.compiled(plan.eval_chunk, abstract_eval_inputs(task)[0])
    x = jax.device_put(task.eval_inputs()[0][: plan.eval_chunk], evaluator.input_sharding)
    out = compiled(params, rest, x)
    assert {d.id for d in out.devices()} == {d.id for d in plan.devices}
    assert {d.id for d in x.devices()} == {d.id for d in plan.devices}


def test_runner_reports_oom_with_measured_bytes_when_the_share_is_smaller():
    plan = _plan().with_devices(jax.devices()[4:8])
    base = dict(number=0, params=CONFIG, plan=plan, steps=3, memory_per_device=BUDGET)
    # The compiled step alone (the figure booked before the prefetched batch was counted).
    cache = StepCache()  # both runs share the compiled step and evaluation forward
    short = run_trial(RunSpec(**base, booked_bytes=plan.peak_bytes_per_device), SPACE, _task(),
                      cache=cache)
    assert short.state == "oom", short.reason
    assert short.bytes_needed == plan.predicted_peak_bytes
    assert short.steps == 0 and "prefetched batch" in short.reason
    ok = run_trial(RunSpec(**base, booked_bytes=plan.predicted_peak_bytes), SPACE, _task(),
                   cache=cache)
    assert ok.state == "complete", ok.reason
    assert 0.0 <= ok.metrics["accuracy"] <= 1.0 and math.isfinite(ok.metrics["loss"])


def test_a_run_compiles_before_its_arrays_exist(monkeypatch):
    """The step is compiled from the state's shapes, before the state is made (on a GPU XLA's
    autotuner takes its buffers from the pool then, at its emptiest), and a run whose programs
    exceed its share ends out of memory without placing anything. The program's methods are
    wrapped only to watch the order; they run unchanged."""
    from scamp_jax.hpo.runner import SoloProgram

    seen: list[tuple[str, bool]] = []
    for name in ("compile", "start"):
        real = getattr(SoloProgram, name)

        def watched(self, *args, _real=real, _name=name):
            placed = any(isinstance(x, jax.Array) for x in jax.tree.leaves(self.state))
            seen.append((_name, placed))
            return _real(self, *args)

        monkeypatch.setattr(SoloProgram, name, watched)
    plan = _plan().with_devices(jax.devices()[4:8])
    base = dict(number=0, params=CONFIG, plan=plan, steps=2, memory_per_device=BUDGET)
    short = run_trial(RunSpec(**base, booked_bytes=plan.peak_bytes_per_device), SPACE, _task())
    assert short.state == "oom" and seen == [("compile", False)]  # nothing was placed
    seen.clear()
    ok = run_trial(RunSpec(**base, booked_bytes=plan.predicted_peak_bytes), SPACE, _task())
    assert ok.state == "complete", ok.reason
    assert seen == [("compile", False), ("start", False)]


def test_restore_lands_on_the_plans_shardings_with_the_saved_values(tmp_path):
    saved_plan = _plan()
    params, opt_state, rest = _state(saved_plan, seed=5)
    ckpt = TrialCheckpointer(tmp_path / "t")
    ckpt.save(7, jax.tree.leaves((params, opt_state, rest)))
    ckpt.close()

    moved = saved_plan.with_devices(jax.devices()[4:8])
    spec = RunSpec(0, CONFIG, moved, steps=10, memory_per_device=BUDGET)
    live_before = len(jax.live_arrays())
    target = _initial_state(SPACE, spec, make_optimizer(CONFIG), 0, abstract=True)
    assert len(jax.live_arrays()) == live_before, "the restore target allocates nothing"
    ckpt = TrialCheckpointer(tmp_path / "t")
    step, leaves = ckpt.restore(jax.tree.leaves(target))
    ckpt.close()
    assert step == 7
    want = jax.tree.leaves((moved.step_shardings.params, moved.step_shardings.opt_state,
                            moved.step_shardings.rest),
                           is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    saved = jax.tree.leaves((params, opt_state, rest))
    assert len(leaves) == len(want) == len(saved)
    split = 0
    for got, sharding, ref in zip(leaves, want, saved, strict=True):
        assert got.sharding.is_equivalent_to(sharding, got.ndim), (got.sharding, sharding)
        assert {d.id for d in got.devices()} == {d.id for d in moved.devices}
        split += any(a is not None for a in getattr(got.sharding, "spec", ()))
        if jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):
            got, ref = jax.random.key_data(got), jax.random.key_data(ref)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert split > 0, "some restored arrays are split over the model axis"


def test_a_fused_group_evaluates_in_chunks_and_holds_what_it_books():
    """A group's share is its fused plan's booking; the whole held-out set in one forward would
    not fit it beside the stacked state, so each member is evaluated in the plan's chunks, and
    what the run measures from its compiled programs is what it booked."""
    plan, task = _plan(), _task()
    model = nnx.eval_shape(lambda: _build(CONFIG, nnx.Rngs(0)))
    fusion = plan_fusion(model, task.sample_batch(1), max_width=2, plan=plan,
                         batch_size=plan.batch_size, optimizer=make_optimizer({}),
                         loss_fn=task.loss_fn)
    assert fusion.width == 2
    configs = [({**CONFIG, "learning_rate": 3e-3}, 1), ({**CONFIG, "learning_rate": 1e-2}, 2)]
    members = tuple(MemberSpec(i, c, s) for i, (c, s) in enumerate(configs))
    cache = StepCache()
    group = run_fused_group(GroupSpec(0, members, fusion, 3, BUDGET,
                                      booked_bytes=fusion.predicted_peak_bytes),
                            SPACE, task, cache=cache)
    assert [r.state for r in group.members] == ["complete"] * 2, group.members[0].reason

    # The compiled sizes: a member's evaluation forward (at the plan's chunk and at the whole
    # set), the stacked state of both members and their prefetched batches, per device.
    graphdef = split_model(model)[0]
    params, _, rest = _state(plan)
    evaluator = cache.evaluator(graphdef, plan, task, params, rest)
    groups = abstract_eval_inputs(task)
    stacked = fusion.estimate.params + fusion.estimate.opt_state + fusion.estimate.rest
    resident = stacked + fusion.width * plan.prefetch_bytes
    chunked = evaluator.peak(plan.eval_chunk, groups) + resident
    whole = groups[0].shape[0] + (-groups[0].shape[0]) % plan.data_parallel
    assert chunked <= fusion.predicted_peak_bytes < evaluator.peak(whole, groups) + resident
    # Books what it holds: the run's own measure (fused step + batches, or evaluation + state)
    # is the plan's booking.
    assert {r.held_bytes for r in group.members} == {fusion.predicted_peak_bytes}
    # Each member's chunked evaluation is its solo run's.
    for i, (config, seed) in enumerate(configs):
        ref = run_trial(RunSpec(i, config, plan, 3, BUDGET, seed=seed), SPACE, task, cache=cache)
        assert ref.state == "complete", ref.reason
        assert group.members[i].metrics["loss"] == pytest.approx(ref.metrics["loss"], rel=1e-5)
