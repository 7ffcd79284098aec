"""CSP scheduler, baseline schedules and tick programs: pure host-side decisions."""

from __future__ import annotations

import numpy as np
import pytest

from scamp_jax.pipeline.csp import (
    SHARED,
    check_causality,
    csp_schedule,
    ideal_schedule,
    split_layers,
    stage_param_keys,
)
from scamp_jax.pipeline.program import BWD, COL, FWD, NUM_FIELDS, build_program
from scamp_jax.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    Op,
    Schedule,
    gpipe_schedule,
    sequential_schedule,
    validate_schedule,
)


def _subnets(n: int, layers: int, choices: int, seed: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [tuple(int(c) for c in row) for row in rng.integers(0, choices, (n, layers))]


CASES = [(s, c, seed) for s in (1, 2, 4, 8) for c in (1, 2, 4, 24) for seed in (0, 1)]


@pytest.mark.parametrize(("stages", "choices", "seed"), CASES)
def test_csp_is_valid_causal_and_no_longer_than_baselines(stages, choices, seed):
    layers, n = 2 * stages, 24
    subnets = _subnets(n, layers, choices, seed)
    bounds = split_layers(layers, stages)
    for shared in (False, True):
        sched = csp_schedule(subnets, bounds, train_shared=shared)
        validate_schedule(sched)
        check_causality(sched, subnets, bounds, shared)
        assert sched.ticks <= sequential_schedule(n, stages).ticks
        assert sched.ticks <= gpipe_schedule(n, stages, 4).ticks
        assert sched.ticks >= ideal_schedule(subnets, bounds).ticks


def test_csp_is_deterministic():
    subnets = _subnets(30, 8, 3, 5)
    bounds = split_layers(8, 4)
    assert csp_schedule(subnets, bounds) == csp_schedule(subnets, bounds)


def test_every_op_once_forward_before_backward_in_stage_order():
    subnets = _subnets(12, 8, 4, 2)
    sched = csp_schedule(subnets, split_layers(8, 4))
    ticks = sched.op_ticks()
    assert len(ticks) == len(sched.ops) == 12 * 4 * 2
    for b in range(12):
        fwd = [ticks[(b, s, FORWARD, 0)] for s in range(4)]
        bwd = [ticks[(b, s, BACKWARD, 0)] for s in range(4)]
        assert fwd == sorted(fwd) and bwd == sorted(bwd, reverse=True)
        assert fwd[-1] < bwd[-1]


def test_update_order_per_parameter_is_sequence_order():
    subnets = _subnets(40, 8, 2, 3)
    bounds = split_layers(8, 4)
    sched = csp_schedule(subnets, bounds)
    ticks = sched.op_ticks()
    for s in range(4):
        by_param: dict[object, list[int]] = {}
        for b in sorted(range(40), key=lambda b: ticks[(b, s, BACKWARD, 0)]):
            for key in stage_param_keys(subnets[b], bounds, s, False):
                by_param.setdefault(key, []).append(b)
        for order in by_param.values():
            assert order == sorted(order)


def test_identical_subnets_serialise_and_disjoint_ones_overlap():
    bounds = split_layers(4, 2)
    same = [(0, 0, 0, 0)] * 5
    assert csp_schedule(same, bounds).ticks == sequential_schedule(5, 2).ticks
    disjoint = [(i, i, i, i) for i in range(5)]
    sched = csp_schedule(disjoint, bounds)
    assert sched.ticks == ideal_schedule(disjoint, bounds).ticks < sequential_schedule(5, 2).ticks


def test_shared_training_serialises_first_and_last_stage():
    subnets = [(i, i, i, i, i, i) for i in range(6)]
    bounds = split_layers(6, 3)
    frozen = csp_schedule(subnets, bounds)
    trained = csp_schedule(subnets, bounds, train_shared=True)
    assert SHARED in stage_param_keys(subnets[0], bounds, 0, True)
    assert SHARED not in stage_param_keys(subnets[0], bounds, 1, True)
    assert trained.ticks > frozen.ticks
    # With shared stem and head every subnet waits for its predecessor's update on stage 0.
    ticks = trained.op_ticks()
    for b in range(1, 6):
        assert ticks[(b, 0, FORWARD, 0)] > ticks[(b - 1, 0, BACKWARD, 0)]


def test_many_choices_approach_ideal_utilisation():
    bounds = split_layers(8, 2)
    few = _subnets(64, 8, 2, 0)
    many = _subnets(64, 8, 96, 0)
    ideal = ideal_schedule(many, bounds).utilization
    assert csp_schedule(few, bounds).utilization < csp_schedule(many, bounds).utilization
    assert csp_schedule(many, bounds).utilization > 0.9 * ideal


def test_gpipe_and_sequential_shapes():
    g = gpipe_schedule(3, 4, 2)
    validate_schedule(g)
    assert g.ticks == 3 * 2 * (2 + 4 - 1)
    assert sequential_schedule(3, 4).ticks == 3 * 2 * 4
    assert 0 < g.utilization < 1
    assert sum(o.apply for o in g.ops) == 3 * 4


def test_validate_rejects_broken_schedules():
    ops = (Op(0, 0, 0, FORWARD), Op(1, 0, 0, BACKWARD, apply=True))
    validate_schedule(Schedule("x", 1, 1, 1, ops))
    with pytest.raises(ValueError, match="precedes its forward"):
        validate_schedule(Schedule("x", 1, 1, 1, (Op(1, 0, 0, FORWARD), Op(0, 0, 0, BACKWARD))))
    with pytest.raises(ValueError, match="lacks"):
        validate_schedule(Schedule("x", 1, 1, 1, ops[:1]))


def test_causality_check_catches_overlap():
    subnets = [(0, 0), (0, 0)]
    bounds = split_layers(2, 2)
    with pytest.raises(ValueError, match="before subnet 0 updates"):
        check_causality(ideal_schedule(subnets, bounds), subnets, bounds, False)


def test_split_layers_rejects_uneven():
    assert split_layers(8, 4) == ((0, 2), (2, 4), (4, 6), (6, 8))
    with pytest.raises(ValueError, match="multiple of num_stages=3"):
        split_layers(8, 3)


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_program_slots_are_consistent(ahead):
    """Replay the program: every read finds the data of the right (subnet, stage)."""
    subnets = _subnets(20, 8, 3, 7)
    bounds = split_layers(8, 4)
    sched = csp_schedule(subnets, bounds)
    prog = build_program(sched, subnets, bounds, prefetch_ahead=ahead)
    n_layers = prog.layers_per_stage
    window: dict[tuple[int, int], tuple[int, ...]] = {}
    acts: dict[tuple[int, int], int] = {}
    grads: dict[tuple[int, int], int] = {}
    store_version: dict[tuple[int, int, int], int] = {}  # (stage, layer, choice) -> updates
    seen_version: dict[tuple[int, int], list[int]] = {}
    for t in range(prog.ticks):
        for s in range(4):
            row = prog.table[t, s]
            pf = row[COL["prefetch_slot"]]
            if pf >= 0:
                pf_choices = tuple(row[NUM_FIELDS + n_layers :])
                window[(s, pf)] = pf_choices
                seen_version[(s, pf)] = [
                    store_version.get((s, j, c), 0) for j, c in enumerate(pf_choices)
                ]
        for s in range(4):
            row = prog.table[t, s]
            kind, b = row[COL["kind"]], row[COL["subnet"]]
            if kind == 0:
                continue
            choices = tuple(row[NUM_FIELDS : NUM_FIELDS + n_layers])
            assert choices == subnets[b][bounds[s][0] : bounds[s][1]]
            assert window[(s, row[COL["window_slot"]])] == choices
            if s > 0:
                assert acts[(s, row[COL["act_slot"]])] == b
            if kind == BWD and s < 3:
                assert grads[(s, row[COL["grad_slot"]])] == b
            if kind == BWD:
                slot = row[COL["window_slot"]]
                for j, c in enumerate(choices):
                    # The fetched copy must hold every earlier update of the block.
                    assert seen_version[(s, slot)][j] == store_version.get((s, j, c), 0)
                    store_version[(s, j, c)] = store_version.get((s, j, c), 0) + 1
        for s in range(4):
            row = prog.table[t, s]
            if row[COL["recv_act"]] >= 0:
                sender = prog.table[t, s - 1]
                assert sender[COL["kind"]] == FWD
                acts[(s, row[COL["recv_act"]])] = sender[COL["subnet"]]
            if row[COL["recv_grad"]] >= 0:
                sender = prog.table[t, s + 1]
                assert sender[COL["kind"]] == BWD
                grads[(s, row[COL["recv_grad"]])] = sender[COL["subnet"]]
    assert prog.window_slots <= 4 + ahead


def test_prefetch_runs_ahead_when_allowed():
    subnets = [(i, i, i, i) for i in range(6)]
    bounds = split_layers(4, 2)
    sched = csp_schedule(subnets, bounds)
    late = build_program(sched, subnets, bounds, prefetch_ahead=0)
    early = build_program(sched, subnets, bounds, prefetch_ahead=2)
    pf_late = np.argwhere(late.column("prefetch_slot") >= 0)[:, 0].sum()
    pf_early = np.argwhere(early.column("prefetch_slot") >= 0)[:, 0].sum()
    assert pf_early < pf_late


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_csp_max_inflight_bounds_the_subnets_started_on_stage_0(cap):
    from scamp_jax.pipeline.csp import csp_schedule, split_layers
    from scamp_jax.pipeline.schedules import (
        BACKWARD,
        FORWARD,
        sequential_schedule,
        validate_schedule,
    )

    subnets = [(i % 5,) * 8 for i in range(12)]  # mostly disjoint: CSP would overlap S of them
    bounds = split_layers(8, 4)
    sched = csp_schedule(subnets, bounds, max_inflight=cap)
    validate_schedule(sched)
    ticks = sched.op_ticks()
    for t in range(sched.ticks):
        inflight = [b for b in range(12)
                    if ticks[(b, 0, FORWARD, 0)] <= t <= ticks[(b, 0, BACKWARD, 0)]]
        assert len(inflight) <= cap, (t, inflight)
    if cap == 1:  # documented: 1 gives sequential order
        assert sched.ticks == sequential_schedule(12, 4).ticks


def test_a_window_slot_is_free_again_right_after_its_write_back():
    """Sequential without look-ahead: one subnet resident per stage at a time; CSP's window is
    the peak count of subnets between their prefetch and their write-back on a stage."""
    from scamp_jax.pipeline.csp import csp_schedule, split_layers
    from scamp_jax.pipeline.program import build_program
    from scamp_jax.pipeline.schedules import BACKWARD, FORWARD, sequential_schedule

    subnets = [(i % 3,) * 4 for i in range(6)]
    bounds = split_layers(4, 2)
    assert build_program(sequential_schedule(6, 2), subnets, bounds,
                         prefetch_ahead=0).window_slots == 1
    sched = csp_schedule(subnets, bounds)
    prog = build_program(sched, subnets, bounds, prefetch_ahead=0)
    ticks = sched.op_ticks()
    for s in range(2):
        spans = [(ticks[(b, s, FORWARD, 0)], ticks[(b, s, BACKWARD, 0)]) for b in range(6)]
        peak = max(sum(f <= t <= last for f, last in spans) for t in range(sched.ticks))
        used = {int(x) for x in prog.column("window_slot")[:, s][prog.column("kind")[:, s] > 0]}
        assert len(used) == peak


def test_a_subnet_without_a_choice_for_every_layer_is_refused_in_words() -> None:
    bounds = split_layers(4, 2)
    with pytest.raises(ValueError, match=r"subnet 1 has 3 choices for the 4 layers of the "
                       r"stages' bounds; give one candidate index per layer"):
        csp_schedule([[0, 1, 0, 1], [0, 1, 0]], bounds)
    schedule = csp_schedule([[0, 1, 0, 1]], bounds)
    with pytest.raises(ValueError, match=r"subnet 0 has 2 choices for the 4 layers"):
        check_causality(schedule, [[0, 1]], bounds, train_shared=False)
    with pytest.raises(ValueError, match=r"no stages' bounds: pass split_layers"):
        csp_schedule([[0, 1, 0, 1]], ())
