"""The simulator's fused groups: the engine's grouping rule within each family, group profiles
from a `FusedCostModel`, and a simulated study that schedules each group as one trial."""

from __future__ import annotations

import pytest

from scamp_jax.scheduling.placement import ScampPolicy
from scamp_jax.sim.sim_fusion import FusedCostModel, fused_profiles, group_width
from scamp_jax.sim.simulator import ClusterModel, TrialProfile, simulate

GIB = 2**30
# Unit efficiencies, launch latency 1 ms (as test_simulator's toy cluster).
TOY = ClusterModel("toy", 2, 10 * GIB, 1e12, 1e12, 1e9, 1.0, 1.0, 1.0, 1e-3)
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
