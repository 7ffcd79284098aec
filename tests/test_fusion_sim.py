"""The simulator's fused groups: the engine's grouping rule within each family, group profiles
from a `FusedCostModel`, and a simulated study that schedules each group as one trial."""

from __future__ import annotations

import pytest

from scamp_jax.scheduling.placement import ScampPolicy
from scamp_jax.sim.sim_fusion import FusedCostModel, fused_profiles, group_width
from scamp_jax.sim.simulator import ClusterModel, TrialProfile, simulate

GIB = 2**30
# Unit efficiencies, launch latency 1 ms, instant plans, free overlap (test_simulator's toy).
TOY = ClusterModel("toy", 2, 10 * GIB, 1e12, 1e12, 1e9, 1.0, 1.0, 1.0, 1e-3,
                   planning_seconds=0.0, overlap=1.0)
# Launch-bound steps: FLOPs grow with the width, kernels stay (as measured for small models).
MODEL = FusedCostModel(batch_size=8, widths=(1, 2), flops=(1e9, 2e9),
                       bytes_accessed=(1e8, 2e8), kernels=(400, 402))


def solo(key: int, gib: float = 1.0) -> TrialProfile:
    return TrialProfile(key, 1, int(gib * GIB), 8, 1e9, 1e8, 0, 100, kernels_per_step=400)


def test_families_are_grouped_by_the_engines_rule_up_to_the_width_that_fits():
    profiles = [solo(k) for k in range(7)]
    signatures = ["a", "a", "a", "b", "b", "a", "a"]
    families = [0, 0, 0, 3, 3, 5, 5]
    grouped, members = fused_profiles(profiles, signatures, families, {"a": MODEL, "b": MODEL},
                                      cap=2, usable_bytes=9 * GIB)
    # Within family 0 (width 2): (0, 1) and 2 alone; family 3: (3, 4); family 5: (5, 6).
    assert members == {0: (0, 1), 2: (2,), 3: (3, 4), 5: (5, 6)}
    assert [p.key for p in grouped] == [0, 2, 3, 5]
    assert grouped[1] is profiles[2]  # a group of one is the trial's own profile
    fused = grouped[0]
    assert fused.flops_per_step == pytest.approx(2e9) and fused.kernels_per_step == 402
    assert fused.bytes_per_device == 2 * GIB  # width x the solo peak (no compiled group peak)


def test_the_width_is_what_memory_allows():
    assert group_width(solo(0, 4.0), cap=8, usable_bytes=9 * GIB) == 2
    assert group_width(solo(0, 12.0), cap=8, usable_bytes=9 * GIB) == 1
    # Measured fused peaks: members share the step's fixed buffers (3 GiB + 1 GiB a member).
    measured = FusedCostModel(8, (1, 2), (1e9, 2e9), (1e8, 2e8), (400, 402),
                              peak_bytes=(4 * GIB, 5 * GIB))
    assert measured.group_bytes(solo(0, 4.0), 3) == 6 * GIB
    assert group_width(solo(0, 4.0), cap=8, usable_bytes=9 * GIB, model=measured) == 6
    with pytest.raises(ValueError, match="cap=0"):
        group_width(solo(0), cap=0, usable_bytes=GIB)


def test_a_group_is_one_scheduled_trial_and_memory_decides_the_gain():
    """Eight launch-bound trials of 5 GiB on two 10 GiB devices (9 usable): alone one fits a
    device; a fused pair books 6 GiB (measured peaks) and trains two trials in one run. Packing
    two small trials on a device already overlaps launch-bound steps in this model, so the
    gain comes from memory: the pair fits where two trials alone do not."""
    measured = FusedCostModel(8, (1, 2), (1e9, 2e9), (1e8, 2e8), (400, 402),
                              peak_bytes=(5 * GIB, 6 * GIB))
    profiles = [solo(k, 5.0) for k in range(8)]
    signatures, families = ["a"] * 8, [k - k % 2 for k in range(8)]
    grouped, members = fused_profiles(profiles, signatures, families, {"a": measured}, cap=2,
                                      usable_bytes=int(9 * GIB))
    assert sorted(len(m) for m in members.values()) == [2, 2, 2, 2]
    assert {p.bytes_per_device for p in grouped} == {6 * GIB}
    policy = ScampPolicy(compute_aware=False)
    alone = simulate(profiles, TOY, policy, safety_margin=0.1)
    fused = simulate(grouped, TOY, policy, safety_margin=0.1)
    assert len(fused.trials) == 4 and len(alone.trials) == 8
    assert fused.makespan_s < 0.55 * alone.makespan_s


def test_the_simulator_books_what_the_engine_books_for_a_trial_and_a_fused_group():
    """One byte rule: a simulated trial and a simulated fused group book exactly the bytes the
    engine books for the same plan (step + prefetched batch + evaluation; the fused group
    through `plan_fusion`), and more than the training step's peak alone."""
    from flax import nnx

    from scamp_jax.planning.fusion import plan_fusion
    from scamp_jax.planning.planner import plan_mesh
    from scamp_jax.planning.train_step import default_optimizer
    from scamp_jax.scheduling.booking import booked_bytes
    from scamp_jax.sim.sim_fusion import measure_fused_costs
    from scamp_jax.sim.step_costs import measure_cost, plan_point
    from search_spaces import vit

    task = vit.SyntheticClassificationTask(eval_size=16)
    config = {"patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2, "mlp_ratio": 2.0}
    model = nnx.eval_shape(lambda: vit.space("small").build(config, nnx.Rngs(0)))
    sample, memory, margin, cap = task.sample_batch(1), 24 * 2**20, 0.1, 16
    # The engine's planning service: plan_mesh with the task's evaluation; it books the plan.
    plan = plan_mesh(model, sample, devices=1, memory_per_device=memory, safety_margin=margin,
                     loss_fn=task.loss_fn, eval_task=task, max_batch_size=cap)
    assert plan.eval_chunk > 0 and plan.prefetch_bytes > 0
    engine_solo = booked_bytes(plan)
    assert engine_solo > plan.peak_bytes_per_device
    # The simulator's costing of the same architecture.
    cost, _ = measure_cost(model, sample, optimizer=default_optimizer(), loss_fn=task.loss_fn,
                           model_parallel=1, batches=(2, 8), eval_task=task)
    cost = plan_point(model, sample, cost, optimizer=default_optimizer(), loss_fn=task.loss_fn,
                      memory_per_device=memory, safety_margin=margin, max_batch_size=cap,
                      eval_task=task)
    profile = cost.planned_profile(0, budget_bytes=plan.usable_bytes, samples=160,
                                   max_batch_size=cap)
    assert (profile.batch_size, profile.bytes_per_device) == (plan.batch_size, engine_solo)
    # A fused group of 3 at the trial's batch: the engine books plan_fusion's figure.
    fusion = plan_fusion(model, sample, max_width=3, plan=plan, batch_size=plan.batch_size,
                         optimizer=default_optimizer(), loss_fn=task.loss_fn)
    assert fusion.width == 3
    fused = measure_fused_costs(model, sample, plan, batch_size=plan.batch_size,
                                widths=(1, 3), optimizer=default_optimizer(),
                                loss_fn=task.loss_fn)
    assert fused.group_bytes(profile, 3) == booked_bytes(fusion) == fusion.predicted_peak_bytes
    assert booked_bytes(fusion) > fusion.peak_bytes_per_device
