"""Cluster simulator: step cost model, hand-computed makespans, ScaMP against the fixed baseline."""

from __future__ import annotations

import dataclasses

import pytest

from scamp_jax.scheduling.placement import FixedPolicy, ScampPolicy
from scamp_jax.sim.simulator import (
    CLUSTER_PRESETS,
    PRESET_OF_TARGET,
    ClusterModel,
    StepCostModel,
    TrialProfile,
    allreduce_bytes,
    cluster_preset,
    plan_profiles,
    simulate,
    step_seconds,
)

GIB = 2**30

# Unit efficiencies so every figure below can be checked by hand; launch latency 1 ms; plans
# ready at once and free overlap of co-located trials (the tests of those two parts say so).
TOY = ClusterModel("toy", 2, 10 * GIB, 1e12, 1e12, 1e9, 1.0, 1.0, 1.0, 1e-3,
                   planning_seconds=0.0, overlap=1.0)


def test_step_seconds_is_roofline_plus_comm_plus_launch() -> None:
    compute_bound = TrialProfile(0, 1, GIB, 8, 3e12, 1e12, 0, 1)
    memory_bound = TrialProfile(1, 1, GIB, 8, 1e12, 2e12, 0, 1)
    with_comm = TrialProfile(2, 2, GIB, 8, 1e12, 0, 5e8, 1, kernels_per_step=250)
    assert step_seconds(compute_bound, TOY) == pytest.approx(3.0)
    assert step_seconds(memory_bound, TOY) == pytest.approx(2.0)
    assert step_seconds(with_comm, TOY) == pytest.approx(1.0 + 0.5 + 0.25)


def test_setup_seconds_come_before_the_steps() -> None:
    trial = TrialProfile(0, 1, GIB, 1, 1e12, 0, 0, 4, setup_seconds=5.0)
    result = simulate([trial], TOY, ScampPolicy())
    assert result.makespan_s == pytest.approx(5.0 + 4 * 1.0)
    assert result.trials[0].solo_seconds == pytest.approx(9.0)


def test_the_engines_cap_on_running_trials_holds_in_the_simulation() -> None:
    """On CPU devices the engine runs at most the host's cores over two trials at once
    (``run.max_running``); the simulation of such a study keeps the same cap, so four one-device
    trials on a two-device pool run one after another under a cap of 1 and two at a time
    under a cap of 2."""
    trials = [TrialProfile(k, 1, GIB, 1, 1e12, 0, 0, 4) for k in range(4)]  # 4 s alone
    spans = {cap: sorted(x for t in simulate(trials, TOY, ScampPolicy(), max_running=cap).trials
                         for x in (t.start_s, t.end_s)) for cap in (None, 1, 2)}
    assert spans[1] == pytest.approx([0, 4, 4, 8, 8, 12, 12, 16])
    assert spans[2] == spans[None] == pytest.approx([0, 0, 4, 4, 4, 4, 8, 8])


def _hand_example() -> list[TrialProfile]:
    return [
        # A: 2 s steps, busy half of each (1 s compute, 1 s launch gaps), 10 steps -> 20 s alone.
        TrialProfile(0, 1, 4 * GIB, 1, 1e12, 0, 0, 10, kernels_per_step=1000),
        # B: 2 s steps all busy, 5 steps -> 10 s alone.
        TrialProfile(1, 1, 4 * GIB, 1, 2e12, 0, 0, 5),
        # C: 2 devices, 1 s compute + 1 s all-reduce per step, 5 steps -> 10 s alone.
        TrialProfile(2, 2, 8 * GIB, 2, 1e12, 0, 1e9, 5),
    ]


def test_makespan_by_hand_with_device_sharing() -> None:
    # Pure packing (best fit) puts A and B on device 0 (load 0.5 + 1.0 = 1.5: both run at 2/3
    # speed). C waits for device 0 to drain. B ends at 10 / (2/3) = 15 s; A has
    # 20 - 15 * 2/3 = 10 s left, now alone at full speed -> 25 s. C runs 25..35 s.
    result = simulate(_hand_example(), TOY, ScampPolicy(spread=False, compute_aware=False))
    spans = {t.key: (t.start_s, t.end_s) for t in result.trials}
    devices = {t.key: t.device_ids for t in result.trials}
    assert devices == {0: (0,), 1: (0,), 2: (0, 1)}
    assert spans[1] == pytest.approx((0.0, 15.0))
    assert spans[0] == pytest.approx((0.0, 25.0))
    assert spans[2] == pytest.approx((25.0, 35.0))
    assert result.makespan_s == pytest.approx(35.0)
    # Memory: 8 of 20 GiB for 15 s, 4 for 10 s, 16 for 10 s.
    mean = (0.4 * 15 + 0.2 * 10 + 0.8 * 10) / 35
    assert result.summary["mean_memory_utilization"] == pytest.approx(mean)
    assert result.summary["idle_device_seconds"] == pytest.approx(25.0)  # device 1, 0..25 s


def test_strict_turns_slow_co_located_trials_whatever_their_busy_fractions() -> None:
    # The same packing at overlap 0: A (busy half its time) and B on device 0 take strict
    # turns, load 1 each: both at half speed. B ends at 10 / (1/2) = 20 s; A has 20 - 10 = 10 s
    # left, alone -> 30 s. C runs 30..40 s. Between the two, overlap 0.5: A's load is 0.75, B's
    # 1.0, both at 1 / 1.75 speed: B ends at 17.5 s, A has 20 - 10 = 10 s left -> 27.5 s.
    policy = ScampPolicy(spread=False, compute_aware=False)
    strict = simulate(_hand_example(), dataclasses.replace(TOY, overlap=0.0), policy)
    assert {t.key: t.end_s for t in strict.trials} == pytest.approx({0: 30.0, 1: 20.0, 2: 40.0})
    half = simulate(_hand_example(), dataclasses.replace(TOY, overlap=0.5), policy)
    assert {t.key: t.end_s for t in half.trials} == pytest.approx({0: 27.5, 1: 17.5, 2: 37.5})
    assert "overlap=0.5" in half.cluster.describe()
    with pytest.raises(ValueError, match="overlap=1.5 must be in"):
        dataclasses.replace(TOY, overlap=1.5)


def test_a_trial_is_placed_once_its_plan_is_ready() -> None:
    # Planning takes 4 s a trial; the lookahead of 2 asks A and B at 0 (ready at 4 s), C once
    # one of them started (asked at 4 s, ready at 8 s). Spread: A on 0 (4..24 s), B on 1
    # (4..14 s); C needs both devices and starts when A ends.
    planning = dataclasses.replace(TOY, planning_seconds=4.0)
    result = simulate(_hand_example(), planning, ScampPolicy(), lookahead=2)
    spans = [(t.key, t.start_s, t.end_s) for t in result.trials]
    assert spans == [(0, 4.0, 24.0), (1, 4.0, 14.0), (2, 24.0, 34.0)]


def test_plans_are_made_as_many_at_once_as_the_engine_has_planner_threads() -> None:
    # Six one-device trials asked at 0 on 8 devices, 4 s a plan: the engine's 2 planner threads
    # (its default) make them in pairs, ready at 4, 8 and 12 s, in the order asked; 3 threads
    # make them in threes.
    trials = [TrialProfile(k, 1, GIB, 8, 1e12, 0, 0, 10) for k in range(6)]
    cluster = dataclasses.replace(TOY, devices=8, planning_seconds=4.0)
    result = simulate(trials, cluster, ScampPolicy())
    assert [t.start_s for t in result.trials] == [4.0, 4.0, 8.0, 8.0, 12.0, 12.0]
    assert cluster.planner_threads == 2
    three = simulate(trials, dataclasses.replace(cluster, planner_threads=3), ScampPolicy())
    assert [t.start_s for t in three.trials] == [4.0, 4.0, 4.0, 8.0, 8.0, 8.0]
    assert "2 thread(s)" in result.cluster.describe()
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="planner_threads"):
            dataclasses.replace(TOY, planner_threads=bad)


def test_an_architecture_is_planned_once_and_its_later_trials_wait_for_that_plan() -> None:
    # The engine plans each architecture once: on 2 threads, 4 s a plan, trials of
    # architectures A, A, B, A asked at 0: trial 0 plans A (ready at 4); trial 1's thread waits
    # for A's plan (ready at 4, as the engine's thread waits on the architecture's lock); then
    # B is planned 4-8 and trial 3 takes the free thread and is ready at once (4).
    trials = [TrialProfile(k, 1, GIB, 8, 1e12, 0, 0, 10, architecture=arch)
              for k, arch in enumerate("AABA")]
    cluster = dataclasses.replace(TOY, devices=8, planning_seconds=4.0)
    result = simulate(trials, cluster, ScampPolicy())
    assert [t.start_s for t in result.trials] == [4.0, 4.0, 8.0, 4.0]
    # without architectures every trial is a plan of its own
    own = simulate([dataclasses.replace(t, architecture=None) for t in trials], cluster,
                   ScampPolicy())
    assert [t.start_s for t in own.trials] == [4.0, 4.0, 8.0, 8.0]


def test_a_plan_on_more_devices_costs_a_plan_as_the_engine_compiles_it() -> None:
    # One trial, 1 s a step on 1 device, 0.5 s on 2, planned in 4 s: in the last wave the core
    # asks for its 2-device plan, which a planner thread makes in 4 s more (the engine compiles
    # it); it starts on 2 devices at 8 s. With plans made at once, it starts on 2 at 0 s.
    wide = TrialProfile(0, 2, GIB, 8, 0.5e12, 0, 0, 10)
    trial = TrialProfile(0, 1, GIB, 8, 1e12, 0, 0, 10, alternatives=(wide,))
    planned = simulate([trial], dataclasses.replace(TOY, planning_seconds=4.0), ScampPolicy())
    assert [(t.start_s, t.end_s, t.device_ids) for t in planned.trials] == [(8.0, 13.0, (0, 1))]
    at_once = simulate([trial], TOY, ScampPolicy())
    assert [(t.start_s, t.end_s, t.device_ids) for t in at_once.trials] == [(0.0, 5.0, (0, 1))]


def test_a_lone_trial_is_restarted_on_idle_devices_once_it_has_trained_two_steps() -> None:
    # One trial of 1,000 steps of 1 s on 1 of 4 devices, which may restart on 2 or 4 with its
    # batch: the engine measures its pace after 2 steps (2 s) and the tail restarts it on all 4
    # at once; 10 s of restart, then 998 steps of 0.25 s: it ends at 261.5 s, not at 1,000 s.
    cluster = dataclasses.replace(TOY, devices=4, restart_seconds=10.0)

    def reshape(p: TrialProfile) -> tuple[TrialProfile, ...]:
        return tuple(TrialProfile(p.key, d, GIB, p.batch_size, p.flops_per_step * p.devices / d,
                                  0, 0, p.steps) for d in (2, 4) if d > p.devices)

    lone = TrialProfile(0, 1, GIB, 8, 1e12, 0, 0, 1000)
    result = simulate([lone], cluster, ScampPolicy(), reshape=reshape)
    assert result.resizes == 1
    (trial,) = result.trials
    assert trial.device_ids == (0, 1, 2, 3)
    assert trial.end_s == pytest.approx(261.5)
    # Plans take 4 s: the trial starts at 4, is measured at 6, and its restart is planned on a
    # planner thread before it is booked (the engine's TailResizer), at 10 with 6 steps done;
    # 10 s of restart, then 994 steps of 0.25 s: it ends at 268.5 s.
    planned = simulate([lone], dataclasses.replace(cluster, planning_seconds=4.0),
                       ScampPolicy(), reshape=reshape)
    assert planned.resizes == 1
    assert planned.trials[0].end_s == pytest.approx(268.5)


@pytest.mark.parametrize("policy", [ScampPolicy(), ScampPolicy(share_devices=False)])
def test_makespan_by_hand_balanced(policy: ScampPolicy) -> None:
    # A on device 0 (20 s), B on device 1 (10 s), C on both from 20 s to 30 s.
    result = simulate(_hand_example(), TOY, policy)
    assert result.makespan_s == pytest.approx(30.0)
    assert result.summary["idle_device_seconds"] == pytest.approx(10.0)
    # Busy (roofline) device-seconds: A 10, B 10, C 2 x 5 = 10 -> 30 of 60.
    assert result.busy_fraction == pytest.approx(0.5)


def test_devices_sharing_one_compute_engine_slow_each_other() -> None:
    # Both devices are carved out of one host (compute_group=2): A on device 0 and B on device 1
    # compete exactly as if they shared a device, so the packed timeline comes back.
    host = dataclasses.replace(TOY, compute_group=2)
    result = simulate(_hand_example(), host, ScampPolicy())
    assert {t.key: t.device_ids for t in result.trials} == {0: (0,), 1: (1,), 2: (0, 1)}
    assert {t.key: t.end_s for t in result.trials} == pytest.approx({0: 25.0, 1: 15.0, 2: 35.0})


def test_fixed_policy_needs_profiles_for_its_device_count() -> None:
    with pytest.raises(ValueError, match="build its profile for 2 devices"):
        simulate(_hand_example(), TOY, FixedPolicy(2))
    with pytest.raises(ValueError, match="needs 3 devices but the pool has 2"):
        simulate([TrialProfile(0, 3, GIB, 3, 1, 1, 0, 1)], TOY, ScampPolicy())


def test_cost_model_extrapolates_by_data_parallel_degree() -> None:
    cost = StepCostModel(
        model_parallel=1, flops_fixed=1e9, flops_per_sample=1e8, bytes_fixed=4e8,
        bytes_per_sample=1e6, gradient_bytes=4e8, mp_comm_fixed=0.0, mp_comm_per_sample=0.0,
        kernels_per_step=100, memory_fixed=2e9, memory_per_sample=1e8,
    )
    profile = cost.profile(key=3, devices=4, batch_size=64, samples=1000)
    assert profile.flops_per_step == pytest.approx(1e9 + 1e8 * 16)
    assert profile.bytes_per_device == 2 * 10**9 + 16 * 10**8
    assert profile.comm_bytes_per_step == pytest.approx(2 * 3 / 4 * 4e8)
    assert profile.steps == 16  # ceil(1000 / 64)
    assert allreduce_bytes(4e8, 1) == 0.0
    assert cost.max_local_batch(10 * 10**9) == 80
    with pytest.raises(ValueError, match="not a multiple of data-parallel degree 4"):
        cost.profile(key=0, devices=4, batch_size=10, samples=100)


def _mixed_costs(trials: int) -> list[StepCostModel]:
    """Small latency-bound candidates of relative sizes 1-8; size 8 needs 2-way model parallelism.

    Size 1: 10 M parameters (40 MB of gradients), 0.2 GFLOP per sample, 1.6 GB of fixed memory
    (parameters, gradients, Adam state and workspace) and 0.4 GB of activations per sample.
    """
    costs = []
    sizes = (1, 1, 2, 1, 4, 1, 2, 8, 1, 1, 2, 4)
    for i in range(trials):
        size = sizes[i % len(sizes)]
        mp = 2 if size == 8 else 1
        share = size / mp
        costs.append(
            StepCostModel(
                model_parallel=mp,
                flops_fixed=8e8 * share,
                flops_per_sample=2e8 * share,
                bytes_fixed=1.6e8 * share,
                bytes_per_sample=2e7 * share,
                gradient_bytes=4e7 * share,
                mp_comm_fixed=0.0,
                mp_comm_per_sample=2e6 * size if mp > 1 else 0.0,
                kernels_per_step=400,
                memory_fixed=1.28e9 * share,
                memory_per_sample=4e8 * share,
            )
        )
    return costs


def test_scamp_beats_fixed_on_a_mixed_workload() -> None:
    # Free overlap: packed trials fill each other's idle compute, so the core packs them (at
    # overlap 0 it books measured trials fully busy and packs none beside them in the last wave).
    # Plans ready at once: 24 plans of 30 s on 2 planner threads would pace both policies alike.
    cluster = dataclasses.replace(cluster_preset("v100-16gb", devices=8), overlap=1.0,
                                  planning_seconds=0.0)
    costs = _mixed_costs(24)
    samples = 20_000
    scamp = ScampPolicy()
    scamp_result = simulate(
        plan_profiles(costs, cluster, scamp, samples=samples, max_batch_size=16), cluster, scamp
    )
    # The fixed baseline: 2 devices each, one batch that the largest candidate fits on 2 devices
    # (there it runs 2-way model parallel, one replica: the local batch is the global batch).
    fixed_batch = costs[7].max_local_batch(int(cluster.memory_per_device * 0.9))
    fixed_batch -= fixed_batch % 2  # the other candidates run 2-way data parallel
    fixed = FixedPolicy(2)
    fixed_result = simulate(
        plan_profiles(costs, cluster, fixed, samples=samples, fixed_batch_size=fixed_batch),
        cluster, fixed,
    )
    assert len(scamp_result.trials) == len(fixed_result.trials) == len(costs)
    assert scamp_result.makespan_s < fixed_result.makespan_s
    memory = "mean_memory_utilization"
    assert scamp_result.summary[memory] > fixed_result.summary[memory]
    # Some ScaMP trials share a device (the point of packing).
    overlapping = [
        (a, b) for a in scamp_result.trials for b in scamp_result.trials
        if a.key < b.key and set(a.device_ids) & set(b.device_ids)
        and a.start_s < b.end_s and b.start_s < a.end_s
    ]
    assert overlapping


def test_presets_and_unknown_device() -> None:
    assert set(CLUSTER_PRESETS) >= {"v100-16gb", "a100-40gb", "h100-80gb"}
    assert cluster_preset("a100-40gb", devices=1024).devices == 1024
    with pytest.raises(ValueError, match="unknown device 'tpu'; choose one of"):
        cluster_preset("tpu")
    with pytest.raises(ValueError, match="compute_efficiency=1.5 must be in"):
        ClusterModel("x", 1, 1, 1, 1, 1, compute_efficiency=1.5)


def test_a_cluster_is_simulated_by_the_name_it_is_planned_for() -> None:
    """Every GPU the planner compiles for by name (``--target h100``) is a cluster here by
    that name, of the same GPU: its memory within 2% of the target's (presets hold the
    nominal size) and the FLOP/s the scheduler paces its device kind by."""
    from scamp_jax.planning.targets import GPUS, TARGETS
    from scamp_jax.scheduling.costs import COMPUTE_EFFICIENCY, attainable_flops

    assert set(PRESET_OF_TARGET) == set(TARGETS)
    for name, spec in GPUS.items():
        cluster = cluster_preset(name, devices=8)
        assert cluster.devices == 8
        assert abs(cluster.memory_per_device / spec.memory_bytes - 1) < 0.02, name
        assert cluster.peak_flops * COMPUTE_EFFICIENCY == attainable_flops(spec.device_kind)


def test_hlo_parsing_counts_kernels_and_ring_collective_bytes() -> None:
    from scamp_jax.sim.step_costs import hlo_kernels_and_collectives

    hlo = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main (a: f32[8,16], b: f32[16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16]{0} parameter(1)
  %c = f32[] constant(0)
  %f = f32[8,16]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused
  %ar = f32[8,16]{1,0} all-reduce(%f), replica_groups={{0,1}}, to_apply=%add
  %ag = (f32[4,16]{1,0}, f32[2]{0}) all-gather(%f, %b), dimensions={0}
  ROOT %t = f32[8,16]{1,0} bitcast(%ar)
}
"""
    kernels, sent = hlo_kernels_and_collectives(hlo, group=2)
    assert kernels == 3  # fusion, all-reduce, all-gather (parameters, constants, bitcasts free)
    # all-reduce of 512 B sends 2 * 1/2 * 512; all-gather of 256 + 8 B results sends 1/2 of it.
    assert sent == pytest.approx(512 + 132)
    assert hlo_kernels_and_collectives(hlo, group=1) == (3, 0.0)


def test_measure_cost_of_a_real_step_is_affine_and_sees_model_parallel_collectives() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from scamp_jax.planning.train_step import default_loss, default_optimizer
    from scamp_jax.sim.step_costs import measure_cost

    class Mlp(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(64, 256, rngs=rngs)
            self.down = nnx.Linear(256, 64, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.down(jax.nn.relu(self.up(x)))

    model = nnx.eval_shape(lambda: Mlp(nnx.Rngs(0)))
    batch = jax.ShapeDtypeStruct((1, 64), jnp.float32)
    cost, _ = measure_cost(model, batch, optimizer=default_optimizer(), loss_fn=default_loss,
                           model_parallel=2, batches=(4, 16))
    # Forward + backward matmuls: about 6 FLOPs per weight per sample (2 * 2 * 64 * 256 each
    # way), half of them on each of the 2 model-parallel devices.
    weights = 2 * 64 * 256
    assert 2.5 * weights <= cost.flops_per_sample <= 4 * weights
    # Both kernels are split in two; the biases (256 + 64 floats) stay whole or split.
    assert 4 * weights / 2 <= cost.gradient_bytes <= 4 * (weights / 2 + 256 + 64)
    assert cost.mp_comm_fixed + 16 * cost.mp_comm_per_sample > 0  # activations all-reduced
    assert cost.memory_fixed > 0 and cost.memory_per_sample > 0 and cost.kernels_per_step > 0
    profile = cost.profile(0, devices=4, batch_size=32, samples=320)  # 2 replicas of 2 devices
    assert profile.flops_per_step == pytest.approx(cost.flops_fixed + 16 * cost.flops_per_sample)
    assert profile.comm_bytes_per_step > cost.mp_comm_fixed + 16 * cost.mp_comm_per_sample


def test_plan_profiles_give_the_baseline_one_batch_safe_for_the_largest() -> None:
    from scamp_jax.sim.step_costs import fixed_baseline

    cluster = cluster_preset("v100-16gb", devices=8)
    costs = _mixed_costs(12)
    largest = costs[7]  # size 8: needs 2-way model parallelism
    k, batch = fixed_baseline(largest, cluster, fixed_devices=None, max_batch_size=None)
    scamp = plan_profiles(costs, cluster, ScampPolicy(), samples=1000)
    fixed = plan_profiles(costs, cluster, FixedPolicy(k), samples=1000, fixed_batch_size=batch)
    usable = cluster.memory_per_device * 0.9
    assert k == 2 and batch % 2 == 0 and batch > 0
    assert {p.batch_size for p in fixed} == {batch} and {p.devices for p in fixed} == {2}
    assert all(p.bytes_per_device <= usable for p in scamp + fixed)
    # The baseline's batch is the largest the largest candidate fits on its 2 devices.
    assert largest.peak_bytes(batch) <= usable < largest.peak_bytes(batch + 2)
    # ScaMP: the fewest devices and the largest batch that fits (smaller models, larger batch).
    assert [p.devices for p in scamp] == [c.model_parallel for c in costs]
    assert scamp[0].batch_size > scamp[4].batch_size >= batch // 2
    with pytest.raises(ValueError, match="multiple of the largest candidate's model-parallel"):
        fixed_baseline(largest, cluster, fixed_devices=3, max_batch_size=None)


def _compute_bound(key: int, steps: int, devices: int = 1, comm: float = 0.0,
                   flops: float = 1e12) -> TrialProfile:
    """A trial of ``steps`` steps of ``flops / 1e12`` s of compute (+ ``comm / 1e9`` s) on TOY."""
    return TrialProfile(key, devices, 4 * GIB, devices, flops, 0, comm, steps)


def test_longest_first_shortens_the_makespan_by_hand() -> None:
    # Two 1 s trials and one 2 s trial, all compute-bound (busy fraction 1): in the last wave no
    # device is shared. Arrival order: both short ones first, the long one at 1 s -> 3 s.
    # Longest first: the long one and a short one at 0 s, the other short one at 1 s -> 2 s.
    trials = [_compute_bound(0, 1), _compute_bound(1, 1), _compute_bound(2, 2)]
    fifo = simulate(trials, TOY, ScampPolicy(longest_first=False))
    lpt = simulate(trials, TOY, ScampPolicy(overtake_window=3))
    assert fifo.makespan_s == pytest.approx(3.0)
    assert lpt.makespan_s == pytest.approx(2.0)
    assert {t.key: t.start_s for t in lpt.trials} == pytest.approx({0: 0.0, 1: 1.0, 2: 0.0})
    # The default window (one pool's worth of devices: 2) keeps trial 2 behind trial 0.
    assert simulate(trials, TOY, ScampPolicy()).makespan_s == pytest.approx(3.0)
    # With one trial queued at a time (the engine's lookahead) there is nothing to reorder.
    policy = ScampPolicy(overtake_window=3)
    assert simulate(trials, TOY, policy, lookahead=1).makespan_s == pytest.approx(3.0)
    with pytest.raises(ValueError, match="lookahead=0 must be at least 1"):
        simulate(trials, TOY, policy, lookahead=0)


def test_last_wave_trial_runs_data_parallel_on_idle_devices() -> None:
    # Alone: 4 steps of 1 s. On both devices: 4 steps of 0.5 s compute + 0.1 s all-reduce.
    wide = _compute_bound(0, 4, devices=2, comm=1e8, flops=0.5e12)
    trial = dataclasses.replace(_compute_bound(0, 4), alternatives=(wide,))
    grown = simulate([trial], TOY, ScampPolicy())
    assert grown.trials[0].device_ids == (0, 1)
    assert grown.makespan_s == pytest.approx(4 * 0.6)
    assert simulate([trial], TOY, ScampPolicy(elastic=False)).makespan_s == pytest.approx(4.0)
    # A second trial takes the other device: nothing idles, so nothing grows.
    pair = simulate([trial, _compute_bound(1, 4)], TOY, ScampPolicy())
    assert [len(t.device_ids) for t in pair.trials] == [1, 1]
    assert pair.makespan_s == pytest.approx(4.0)
    with pytest.raises(ValueError, match="an alternative must have the same key"):
        dataclasses.replace(_compute_bound(0, 4), alternatives=(_compute_bound(1, 4, 2),))


def test_running_trial_restarts_on_the_idle_device_in_the_tail_by_hand() -> None:
    # Trial 0: 2 steps of 1 s on device 0; trial 1: 8 steps of 1 s on device 1. At 2 s device 0
    # idles and trial 1 has 6 s left (3/4 of its work); on both devices a step takes 0.5 s, so
    # the rest takes 0.75 * 4 s + 0.5 s restart = 3.5 s: it ends at 5.5 s instead of 8 s.
    cluster = dataclasses.replace(TOY, restart_seconds=0.5)
    wide = _compute_bound(1, 8, devices=2, flops=0.5e12)

    def reshape(profile: TrialProfile) -> tuple[TrialProfile, ...]:
        return (wide,) if profile.key == 1 and profile.devices == 1 else ()

    trials = [_compute_bound(0, 2), _compute_bound(1, 8)]
    result = simulate(trials, cluster, ScampPolicy(), reshape=reshape)
    assert result.makespan_s == pytest.approx(5.5)
    assert result.resizes == 1
    assert result.summary["trials_started"] == result.summary["trials_finished"] == 2
    assert (result.trials[1].device_ids, result.trials[1].resizes) == ((0, 1), 1)
    assert result.trials[1].solo_seconds == pytest.approx(8.0)  # as first placed
    # Busy device-seconds: 2 + 2 (until the restart) + 0.75 * 8 * 0.5 * 2 = 10 of 2 * 5.5.
    assert result.busy_fraction == pytest.approx(10.0 / 11.0)
    for policy, restart in ((ScampPolicy(resize_running=False), 0.5),
                            (ScampPolicy(), 2.5)):  # 3 + 2.5 s saves less than 10% of 6 s
        cluster = dataclasses.replace(TOY, restart_seconds=restart)
        plain = simulate(trials, cluster, policy, reshape=reshape)
        assert (plain.makespan_s, plain.resizes) == (pytest.approx(8.0), 0)
    assert simulate(trials, TOY, ScampPolicy()).makespan_s == pytest.approx(8.0)


def test_a_restart_trains_nothing_while_it_restarts() -> None:
    # 3 devices, restarts cost 1 s. Trial 2 (20 steps of 1 s) starts on device 0 next to two
    # trials of 2 s and 7 s. At 2 s (0.9 of it left) it restarts on 2 devices (0.5 s a step),
    # ending at 2 + 1 + 9 = 12 s (waiting for device 2 at 7 s would end it at 7 + 1 + 13/3 s,
    # later): training resumes at 3 s, 9 s left. At 7 s it has 5 s (0.5) left and restarts on 3
    # devices (1/3 s a step): 0.5 * 20/3 s from 8 s, so it ends at 8 + 10/3 = 34/3 s.
    cluster = dataclasses.replace(TOY, devices=3, restart_seconds=1.0)
    shapes = {n: _compute_bound(2, 20, devices=n, flops=1e12 / n) for n in (2, 3)}

    def reshape(profile: TrialProfile) -> tuple[TrialProfile, ...]:
        if profile.key != 2:
            return ()
        return tuple(shapes[n] for n in (2, 3) if n > profile.devices)

    trials = [_compute_bound(0, 2), _compute_bound(1, 7), _compute_bound(2, 20)]
    result = simulate(trials, cluster, ScampPolicy(), reshape=reshape)
    assert result.resizes == 2 and result.trials[2].resizes == 2
    assert result.makespan_s == pytest.approx(34 / 3)
    assert sorted(result.trials[2].device_ids) == [0, 1, 2]


def test_restart_profiles_keep_the_global_batch() -> None:
    cost = StepCostModel(
        model_parallel=1, flops_fixed=1e9, flops_per_sample=1e8, bytes_fixed=4e8,
        bytes_per_sample=1e6, gradient_bytes=4e8, mp_comm_fixed=0.0, mp_comm_per_sample=0.0,
        kernels_per_step=100, memory_fixed=2e9, memory_per_sample=1e8,
    )
    trial = cost.profile(3, 2, 24, 2400)
    shapes = cost.restart_profiles(trial, budget_bytes=10**10, max_devices=8)
    assert [(s.devices, s.batch_size, s.steps, s.key) for s in shapes] == \
        [(3, 24, 100, 3), (4, 24, 100, 3), (6, 24, 100, 3), (8, 24, 100, 3)]
    assert shapes[0].bytes_per_device == cost.peak_bytes(8)
    assert cost.restart_profiles(trial, budget_bytes=cost.peak_bytes(5), max_devices=8) == \
        shapes[2:]


def test_planned_profile_offers_more_data_parallel_replicas_at_the_largest_batch() -> None:
    cost = StepCostModel(
        model_parallel=1, flops_fixed=1e9, flops_per_sample=1e8, bytes_fixed=4e8,
        bytes_per_sample=1e6, gradient_bytes=4e8, mp_comm_fixed=0.0, mp_comm_per_sample=0.0,
        kernels_per_step=100, memory_fixed=2e9, memory_per_sample=1e8,
    )
    # 80 samples fit per device; the cap is 48 and 3 replicas never split it evenly.
    profile = cost.planned_profile(0, budget_bytes=10 * 10**9, samples=960, max_batch_size=48,
                                   max_devices=4)
    assert (profile.devices, profile.batch_size, profile.steps) == (1, 48, 20)
    assert [(a.devices, a.batch_size, a.steps) for a in profile.alternatives] == \
        [(2, 48, 20), (4, 48, 20)]
    assert profile.alternatives[1].bytes_per_device == cost.peak_bytes(12)
    assert profile.alternatives[1].comm_bytes_per_step == pytest.approx(allreduce_bytes(4e8, 4))
    assert cost.planned_profile(0, budget_bytes=10 * 10**9, samples=960).alternatives == ()


def test_the_simulated_pool_books_the_usable_share_as_the_engine() -> None:
    # Two 1 s trials of 4.75 GiB each on one 10 GiB device: both fit the whole memory (9.5 GiB)
    # but not its usable 90% (9 GiB), so with the engine's margin they run one after the other.
    one = dataclasses.replace(TOY, devices=1)
    trials = [TrialProfile(k, 1, int(4.75 * GIB), 1, 1e11, 0, 0, 10) for k in (0, 1)]
    memory_only = ScampPolicy(compute_aware=False)
    shared = simulate(trials, one, memory_only, safety_margin=0.0)
    assert {t.start_s for t in shared.trials} == {0.0}
    apart = simulate(trials, one, memory_only, safety_margin=0.1)
    assert sorted(t.start_s for t in apart.trials) == pytest.approx([0.0, 1.0])


def test_last_wave_sharing_waits_for_a_measured_pace() -> None:
    # Two compute-bound trials (busy fraction 1 once measured) arriving together in the last
    # wave on one device: not measured yet, a trial counts as fully busy, so the second does
    # not join the first; the core never credits spare compute it has not measured.
    one = dataclasses.replace(TOY, devices=1)
    trials = [_compute_bound(0, 4), _compute_bound(1, 4)]
    result = simulate(trials, one, ScampPolicy())
    assert sorted(t.start_s for t in result.trials) == pytest.approx([0.0, 4.0])
    # Compute-aware sharing off: memory alone decides, both share the device from 0 s.
    both = simulate(trials, one, ScampPolicy(compute_aware=False))
    assert {t.start_s for t in both.trials} == {0.0}


def test_planning_and_restart_seconds_come_from_what_a_study_measured(tmp_path) -> None:
    import json

    from scamp_jax.sim.measured import engine_figures, read_results

    results = {"trials": [
        # Planned 7.5 s after the study's start; restarted at 40 s, trained again from 52 s.
        {"number": 0, "planned_at": 7.5, "placements": [[8.0, [0]], [40.0, [0, 1]]],
         "pace": [[20.0, 5, 1.0, 9.0], [60.0, 30, 0.5, 52.0]]},
        # Restarted at 30 s, trained again from 46 s.
        {"number": 1, "planned_at": 9.0, "placements": [[9.5, [1]], [30.0, [1, 2]]],
         "pace": [[50.0, 10, 0.5, 46.0]]},
        {"number": 2, "planned_at": 8.0, "placements": [[10.0, [2]]], "pace": []},
        # The engine's own record: run again at 20 s after running out of memory (not a
        # restart), then booked on 2 devices at 35 s and training there from 47 s.
        {"number": 3, "planned_at": 8.5, "placements": [[9.0, [3]], [20.0, [3]], [38.0, [3, 4]]],
         "pace": [[30.0, 4, 1.0, 21.0], [55.0, 10, 0.5, 47.0]],
         "core_events": [["planned", 8.5, {}], ["oom", 12.0, None, 1, True],
                         ["requeued", 19.0, {}], ["restarted", 35.0, [3, 4], {}]]},
    ]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert engine_figures(read_results(tmp_path)) == {"planning_seconds": 7.5,
                                                      "restart_seconds": 12.0}
    # The planner threads the run records (`scamp_jax.hpo.engine.scheduling_info`).
    assert engine_figures({**results, "run": {"planner_threads": 3}}) == {
        "planning_seconds": 7.5, "restart_seconds": 12.0, "planner_threads": 3}
    with pytest.raises(ValueError, match="planner_threads=0"):
        engine_figures({"trials": [], "run": {"planner_threads": 0}})
    assert engine_figures({"trials": [{"planned_at": None}]}) == {}  # defaults stay
    with pytest.raises(FileNotFoundError, match="directory of a finished study"):
        read_results(tmp_path / "nowhere")
    (tmp_path / "results.json").write_text("[]")
    with pytest.raises(ValueError, match="holds a JSON list, not the object of a study"):
        read_results(tmp_path)
    with pytest.raises(ValueError, match="trial 0: planned_at holds 'soon', not a number"):
        engine_figures({"trials": [{"number": 0, "planned_at": "soon"}]})


@pytest.mark.parametrize("field, value", [
    ("network_bandwidth", -1e9), ("network_bandwidth", 0.0), ("peak_flops", float("nan")),
    ("planning_seconds", float("inf")), ("restart_seconds", float("nan")),
    ("devices", 2.5), ("devices", "8"), ("node_devices", 0), ("launch_seconds", -1.0),
])
def test_a_cluster_model_refuses_what_would_simulate_nonsense(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"ClusterModel.{field}="):
        dataclasses.replace(TOY, **{field: value})


@pytest.mark.parametrize("field, value", [
    ("kernels_per_step", -10**6), ("steps", 10.5), ("flops_per_step", float("inf")),
    ("bytes_accessed_per_step", float("nan")), ("bytes_per_device", -1),
])
def test_a_trial_profile_refuses_what_would_simulate_nonsense(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"trial 0: TrialProfile.{field}="):
        dataclasses.replace(TrialProfile(0, 1, GIB, 8, 1e12, 0, 0, 10), **{field: value})


def test_a_preset_takes_an_integer_device_count() -> None:
    for devices in (2.5, "8", 0):
        with pytest.raises(ValueError, match="ClusterModel.devices="):
            cluster_preset("h100", devices=devices)  # type: ignore[arg-type]


def test_a_generator_of_profiles_is_simulated_as_its_list() -> None:
    trials = [TrialProfile(k, 1, GIB, 8, 1e12, 0, 0, 10) for k in range(3)]
    listed = simulate(trials, TOY, ScampPolicy())
    generated = simulate((t for t in trials), TOY, ScampPolicy())
    assert generated.makespan_s == listed.makespan_s > 0
    assert generated.trials == listed.trials


def test_a_ring_spanning_nodes_runs_at_the_network_link_and_counts_in_the_comm_share() -> None:
    from scamp_jax.sim.simulator import comm_share, step_comm_seconds

    # Nodes of 2 devices, 1 GB/s within a node, 0.25 GB/s between nodes; 1 GB sent per step.
    cluster = dataclasses.replace(TOY, devices=4, node_devices=2, network_bandwidth=0.25e9)
    within = TrialProfile(0, 2, GIB, 2, 1e12, 0, 1e9, 10)
    across = TrialProfile(1, 4, GIB, 4, 1e12, 0, 1e9, 10)
    assert step_comm_seconds(within, cluster) == pytest.approx(1.0)
    assert step_comm_seconds(across, cluster) == pytest.approx(4.0)
    # 1 s compute + 1 s comm on 2 devices; 1 s + 4 s on 4: (10*1*2 + 10*4*4) / (10*2*2 + 10*5*4)
    assert comm_share([within, across], cluster) == pytest.approx(180 / 240)
    result = simulate([within], cluster, ScampPolicy(elastic=False))
    assert result.comm_fraction == pytest.approx(0.5)


def test_a_fused_groups_trials_count_as_its_members_in_the_usage() -> None:
    # A profile of a fused group of 3 (sim_fusion's group_profile) and a solo trial: the
    # usage counts 4 trials started and finished, as the engine counts a group's members.
    group = TrialProfile(0, 1, GIB, 8, 1e12, 0, 0, 10, trials=3)
    solo = TrialProfile(1, 1, GIB, 8, 1e12, 0, 0, 10)
    result = simulate([group, solo], TOY, ScampPolicy())
    assert result.summary["trials_started"] == result.summary["trials_finished"] == 4
    with pytest.raises(ValueError, match="trials"):
        TrialProfile(2, 1, GIB, 8, 1e12, 0, 0, 10, trials=0)
