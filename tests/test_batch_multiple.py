"""A planned batch that can be split later: ScaMP plans batches that are multiples of its
``batch_multiple`` (where one fits), so a trial can restart on 2 or 4 devices with the same batch.
The planner, the engine's planning service and the simulator's profiles apply the same rule."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from test_engine import SPACE, make_source, ok
from test_engine import config as engine_config
from test_runner import Regression

from scamp_jax.hpo.engine import SearchEngine
from scamp_jax.planning import planner
from scamp_jax.scheduling.placement import FixedPolicy, ScampPolicy
from scamp_jax.sim.simulator import ClusterModel, StepCostModel, plan_profiles


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(128, 1024, rngs=rngs)
        self.down = nnx.Linear(1024, 128, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.gelu(self.up(x)))


def _peak(model: Any, batch: int) -> int:
    """Peak bytes of a training step written here (plain jax.jit + optax.adam, one device)."""
    import optax

    graphdef, params = nnx.split(model, nnx.Param)
    adam = optax.adam(1e-3)

    def step(params: Any, opt_state: Any, x: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2))(params)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x = jax.ShapeDtypeStruct((batch, 128), jnp.float32)
    stats = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, jax.eval_shape(adam.init, params), x).compile().memory_analysis()
    return (stats.temp_size_in_bytes + stats.argument_size_in_bytes
            + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def test_planner_takes_the_largest_multiple_that_fits() -> None:
    model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 128), jnp.float32)
    plain = planner.plan_mesh(model, sample, devices=2, memory_per_device="4MiB")
    four = planner.plan_mesh(model, sample, devices=2, memory_per_device="4MiB",
                             batch_multiple=4)
    assert plain.batch_size % 4  # the budget's own largest batch does not split four ways
    assert four.batch_size % 4 == 0 and plain.batch_size - 4 < four.batch_size < plain.batch_size
    assert four.predicted_peak_bytes <= four.usable_bytes
    # The next multiple of 4 is beyond the plain plan's largest batch, so it does not fit.
    assert four.batch_size + 4 > plain.batch_size
    # Its memory grows with the batch as a step compiled independently of the planner does.
    assert four.peak_bytes_per_device < plain.peak_bytes_per_device
    assert _peak(model, four.batch_size) < _peak(model, plain.batch_size)


def test_planner_falls_back_to_any_batch_when_no_multiple_fits() -> None:
    model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 128), jnp.float32)
    plain = planner.plan_mesh(model, sample, devices=1, memory_per_device="4MiB")
    assert plain.batch_size < 8
    eight = planner.plan_mesh(model, sample, devices=1, memory_per_device="4MiB",
                              batch_multiple=8)
    assert eight.batch_size == plain.batch_size
    with pytest.raises(ValueError, match="batch_multiple"):
        planner.plan_mesh(model, sample, devices=1, memory_per_device="4MiB", batch_multiple=0)


def test_the_batch_steps_by_the_least_common_multiple_with_the_data_parallel_degree() -> None:
    """Two data-parallel groups and a batch multiple of 4: the batch steps by 4, their least
    common multiple (not their product, 8), so a cap of 12 is reached."""
    model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 128), jnp.float32)
    plan = planner.plan_mesh(model, sample, devices=2, memory_per_device="1GiB",
                             batch_multiple=4, max_batch_size=12, compile_for_run=False)
    assert (plan.data_parallel, plan.batch_size) == (2, 12)


@pytest.mark.parametrize(("first", "budget"), [pytest.param(1, 562_000, marks=pytest.mark.slow),
                                               (4, 500_000)])
def test_a_plan_cache_of_points_under_another_batch_multiple_plans_as_a_fresh_search(
        tmp_path, first: int, budget: int) -> None:
    """A plan cache holds the compiled points of one mesh whatever the batch multiple: a
    smallest point over the budget that is no multiple of the next search's unit (or below
    it) still gives that search's own answer, the plan a search without the cache makes."""
    from scamp_jax.planning.plan_cache import PlanCache

    class Mlp(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1, self.l2 = nnx.Linear(64, 256, rngs=rngs), nnx.Linear(256, 64, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l2(nnx.relu(self.l1(x)))

    model = nnx.eval_shape(lambda: Mlp(nnx.Rngs(0)))
    sample = (jax.ShapeDtypeStruct((1, 64), jnp.float32),)
    kw = {"devices": 1, "memory_per_device": budget, "safety_margin": 0.0}
    cache = PlanCache(tmp_path / "plans.sqlite")
    planner.plan_mesh(model, sample, batch_multiple=first, cache=cache, **kw)
    for multiple in (4, 16):
        cached = planner.plan_mesh(model, sample, batch_multiple=multiple, cache=cache, **kw)
        fresh = planner.plan_mesh(model, sample, batch_multiple=multiple, **kw)
        assert cached.batch_size == fresh.batch_size, (multiple, cached.compiled_peaks)


def test_the_engine_plans_with_the_policy_batch_multiple(tmp_path) -> None:
    seen: list[tuple[int, int]] = []

    def recording(model: Any, sample: Any, **kw: Any) -> Any:
        plan = planner.plan_mesh(model, sample, **kw)
        seen.append((kw.get("batch_multiple", 1), plan.batch_size))
        return plan

    _, source = make_source(tmp_path / "scamp", [ok()])
    SearchEngine(SPACE, Regression(), source, engine_config(max_batch_size=30),
                 devices=jax.devices()[:2], plan_fn=recording).run()
    assert seen == [(ScampPolicy().batch_multiple, 28)]  # the cap 30 splits neither 4 ways
    seen.clear()
    _, source = make_source(tmp_path / "fixed", [ok()])
    SearchEngine(SPACE, Regression(), source,
                 engine_config(max_batch_size=30, policy="fixed", devices_per_trial=1),
                 devices=jax.devices()[:2], plan_fn=recording).run()
    assert {b for _, b in seen} == {30} and {m for m, _ in seen} == {1}


def test_simulated_profiles_follow_the_policy_and_can_restart() -> None:
    cost = StepCostModel(
        model_parallel=1, flops_fixed=1e9, flops_per_sample=1e8, bytes_fixed=4e8,
        bytes_per_sample=1e6, gradient_bytes=4e8, mp_comm_fixed=0.0, mp_comm_per_sample=0.0,
        kernels_per_step=100, memory_fixed=2e9, memory_per_sample=1e8,
    )
    # 41 samples fit a device (a batch no restart on 2 or 4 devices can split).
    cluster = ClusterModel(name="test", devices=4, memory_per_device=int(6.15e9 / 0.9),
                           peak_flops=1e13, mem_bandwidth=1e12, interconnect_bandwidth=1e11)
    assert cost.max_local_batch(int(cluster.memory_per_device * 0.9)) == 41
    (plain,) = plan_profiles([cost], cluster, ScampPolicy(batch_multiple=1), samples=4100)
    (four,) = plan_profiles([cost], cluster, ScampPolicy(batch_multiple=4), samples=4100)
    (fixed,) = plan_profiles([cost], cluster, FixedPolicy(1), samples=4100,
                             fixed_batch_size=41)
    assert (plain.batch_size, four.batch_size, fixed.batch_size) == (41, 40, 41)
    # trials of one cost model are one architecture, which the engine plans once
    other = dataclasses.replace(cost, flops_fixed=2e9)
    assert [p.architecture for p in plan_profiles([cost, other, cost], cluster, ScampPolicy(),
                                                  samples=4100)] == [0, 1, 0]
    budget = int(cluster.memory_per_device * 0.9)
    assert cost.restart_profiles(plain, budget_bytes=budget, max_devices=4) == ()
    assert [p.devices for p in cost.restart_profiles(four, budget_bytes=budget,
                                                     max_devices=4)] == [2, 4]
