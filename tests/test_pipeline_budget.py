"""Each schedule's largest batch under a per-device budget, from its compiled tick."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scamp_jax.pipeline import (
    ExecutorCache,
    build_executor,
    build_program,
    make_schedule,
    split_layers,
)
from scamp_jax.pipeline.budget import BatchDoesNotFitError, plan_schedule
from scamp_jax.pipeline.trainer import train_supernet
from search_spaces.supernet import SupernetConfig, SupernetLayout, sample_subnets

CONFIG = SupernetConfig(num_layers=2, num_choices=2, width=4, scale=2, window_size=4)
SIDE = 4


def _shapes(mb: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (mb, SIDE, SIDE, 3), (mb, 2 * SIDE, 2 * SIDE, 3)


@pytest.mark.slow
def test_plan_takes_the_largest_batch_that_fits_and_runs_on_its_compiled_tick() -> None:
    layout = SupernetLayout(CONFIG)
    subnets = [s.choices for s in sample_subnets(6, CONFIG, 0)]
    bounds = split_layers(2, 2)
    prog = build_program(make_schedule("csp", subnets, bounds), subnets, bounds,
                         prefetch_ahead=0)
    # The budget is what the tick needs at a batch of 6, measured on its compiled program.
    probe = build_executor(layout, [prog], num_stages=2, batch_size=6, lr_side=SIDE,
                           offload=True)
    budget = probe.compiled_memory(*_shapes(6))["device_bytes"]
    plan, ex, program = plan_schedule(
        layout, subnets, _shapes, schedule="csp", num_stages=2, budget_bytes=budget,
        lr_side=SIDE, batch_multiple=2, max_prefetch_ahead=1,
    )
    assert plan.batch_size == 6 and plan.device_bytes <= budget
    assert plan.fit[1] > 0 and plan.compiles == 3
    assert program.prefetch_ahead == plan.prefetch_ahead
    rng = np.random.default_rng(0)
    lr = rng.random((6, 6, SIDE, SIDE, 3), dtype=np.float32)
    hr = rng.random((6, 6, 2 * SIDE, 2 * SIDE, 3), dtype=np.float32)
    res = train_supernet(layout, subnets, lr, hr, schedule="csp", num_stages=2, executor=ex,
                         prefetch_ahead=plan.prefetch_ahead)
    assert np.all(np.isfinite(res.losses))
    with pytest.raises(BatchDoesNotFitError, match="more than the budget of 1000 bytes"):
        plan_schedule(layout, subnets, _shapes, schedule="sequential", num_stages=2,
                      budget_bytes=1000, lr_side=SIDE)


def test_a_cache_compiles_each_distinct_stage_step_once_across_plans() -> None:
    layout = SupernetLayout(CONFIG)
    subnets = [s.choices for s in sample_subnets(6, CONFIG, 0)]
    cache = ExecutorCache()

    def plan() -> tuple:
        # max_batch=4 makes the chosen batch the large probe's: the final check is that tick.
        return plan_schedule(layout, subnets, _shapes, schedule="sequential", num_stages=2,
                             budget_bytes=1 << 30, lr_side=SIDE, max_prefetch_ahead=0,
                             max_batch=4, executor_class=cache)

    first, ex, _ = plan()
    assert first.batch_size == 4 and first.compiles == 2
    again, ex_again, _ = plan()
    assert again == dataclasses.replace(first, compiles=0)
    assert ex_again is ex and cache.built == 2
    assert ex.is_compiled(*_shapes(4)) and not ex.is_compiled(*_shapes(2))


def test_plan_steps_down_where_the_linear_fit_overestimates_the_batch():
    """The compiled tick's bytes jump at a batch of 6 (e.g. XLA picks another algorithm): the fit
    from batches 1 and 4 predicts 10, and the check against the compiled figure steps down. (The
    executor is a stand-in whose bytes are a formula: nothing compiles.)"""
    from types import SimpleNamespace

    class Fake:
        def __init__(self, model, **sizes):
            self.sizes = sizes

        def is_compiled(self, *shapes):
            return False

        def compiled_memory(self, input_shape, target_shape):
            mb = input_shape[0]
            return {"device_bytes": 1000 + 100 * mb + (10_000 if mb >= 6 else 0)
                    + 4 * self.sizes["window_slots"]}

        _stage_prefix = (2,)

        def state_shapes(self):
            import jax
            w = self.sizes["window_slots"]
            return {"window": {"p": jax.ShapeDtypeStruct((2, w, 1, 1), np.float32)}}

    subnets = [(0, 1), (1, 0), (0, 0), (1, 1)]
    plan, ex, _ = plan_schedule(
        SimpleNamespace(num_layers=2, num_choices=2), subnets,
        lambda mb: ((mb, 4, 4, 3), (mb, 8, 8, 3)),
        schedule="csp", num_stages=2, budget_bytes=2100, lr_side=4, executor_class=Fake,
        max_prefetch_ahead=0)
    assert plan.device_bytes <= plan.budget_bytes
    assert plan.batch_size == 5 and ex.sizes["microbatch_size"] == 5


def test_subnets_that_do_not_fit_the_supernet_are_refused_before_a_compile() -> None:
    """A choice out of range (the stage step clamps its read and wraps its write) or a subnet
    of another length would plan, and then train, another supernet: refused up front, in the
    trainer's words, as `train_supernet` refuses them."""
    layout = SupernetLayout(CONFIG)
    for subnets, said in (([[0, 2]], r"subnet 0 .*choice"), ([[0]], r"subnet 0 has 1 choices")):
        with pytest.raises(ValueError, match=said):
            plan_schedule(layout, subnets, _shapes, schedule="csp", num_stages=2,
                          budget_bytes=1 << 30, lr_side=SIDE)
