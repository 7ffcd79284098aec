"""How close a fused member stays to its solo run, and why: per-op and per-training checks.

    python -m benchmarks.fusion_precision --ops                      # one step, op by op
    python -m benchmarks.fusion_precision --family swinir --fused    # 40 steps
    python -m benchmarks.fusion_precision --family swinir --ulp      # the solo run's sensitivity

``--ops``: each op of a SwinIR block (3x3 convolutions, linear, LayerNorm, window attention with
softmax), ``K`` members with their own parameters, ``jax.vmap(f)`` against ``f`` member by member:
largest relative difference of the forward and of the parameter gradients of an L1 loss.

``--fused``: the members of `benchmarks.fusion` (same architecture, steps, batch, seeds) trained
fused (`scamp_jax.hpo.fused_runner.run_fused_group`) and alone (`scamp_jax.hpo.runner.run_trial`):
relative difference of the final loss and of the held-out metric per member.

``--ulp``: each member alone, again alone (the run is deterministic), and alone with its
learning rate one float32 ulp higher: how much 40 steps amplify a rounding-sized change.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from benchmarks.fusion import CPU_DEVICES, DEFAULTS, _experiment, member_configs


def _rel(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def op_check(width: int = 4) -> dict[str, tuple[float, float]]:
    """``{op: (forward rel diff, gradient rel diff)}`` of vmapped against per-member ops."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 24, 24, 24)), jnp.float32)

    class Attention(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.qkv = nnx.Linear(24, 72, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            b, h, w, c = x.shape  # 8x8 windows, 2 heads of 12
            t = self.qkv(x.reshape(b * 9, 64, c)).reshape(b * 9, 64, 3, 2, 12)
            q, k, v = t[:, :, 0], t[:, :, 1], t[:, :, 2]
            a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(12), axis=-1)
            return jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, h, w, c)

    ops = {
        "conv 3x3, 24 -> 24": (lambda r: nnx.Conv(24, 24, (3, 3), rngs=r), x),
        "conv 3x3, 3 -> 24": (lambda r: nnx.Conv(3, 24, (3, 3), rngs=r), x[..., :3]),
        "linear 24 -> 48": (lambda r: nnx.Linear(24, 48, rngs=r), x),
        "LayerNorm(24)": (lambda r: nnx.LayerNorm(24, epsilon=1e-5, rngs=r), x),
        "window attention": (Attention, x),
    }
    out = {}
    for name, (make, inputs) in ops.items():
        models = [make(nnx.Rngs(i)) for i in range(width)]
        graphdef = nnx.split(models[0])[0]
        states = [nnx.split(m)[1] for m in models]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        xs = jnp.stack([inputs * (i + 1) for i in range(width)])

        def f(state: Any, x: jax.Array, graphdef: Any = graphdef) -> jax.Array:
            return nnx.merge(graphdef, state)(x)

        def loss(state: Any, x: jax.Array, f: Any = f) -> jax.Array:
            return jnp.abs(f(state, x)).mean()

        fused = jax.jit(jax.vmap(f))(stacked, xs)
        alone = jnp.stack([jax.jit(f)(states[i], xs[i]) for i in range(width)])
        g_fused = jax.jit(jax.vmap(jax.grad(loss)))(stacked, xs)
        g_alone = jax.tree.map(lambda *a: jnp.stack(a),
                               *[jax.jit(jax.grad(loss))(states[i], xs[i]) for i in range(width)])
        grad = max(_rel(a, b) for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_alone),
                                              strict=True))
        out[name] = (_rel(fused, alone), grad)
    return out


def _setup(family: str, width: int, batch: int) -> tuple[Any, ...]:
    import jax
    from flax import nnx

    from scamp_jax._units import parse_bytes
    from scamp_jax.hpo.runner import make_optimizer
    from scamp_jax.planning import planner

    experiment = _experiment(family)
    hpo = dataclasses.replace(experiment.get_config("smoke"), seed=0)
    space, task = experiment.make_space_and_task(hpo)
    budget = parse_bytes(hpo.memory_per_device)
    members = member_configs(family, width, 0)
    model = nnx.eval_shape(lambda: space.build(members[0][0], nnx.Rngs(0)))
    kw = {"optimizer": make_optimizer({}), "loss_fn": task.loss_fn}
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                             memory_per_device=budget, max_batch_size=batch, **kw)
    return space, task, budget, members, model, plan, kw


def fused_check(family: str, width: int, steps: int,
                batch: int) -> list[tuple[float, float]]:
    """``[(final loss rel diff, metric rel diff) per member]``, fused against solo."""
    from scamp_jax.hpo.fused_runner import GroupSpec, MemberSpec, run_fused_group
    from scamp_jax.hpo.runner import RunSpec, StepCache, run_trial
    from scamp_jax.planning.fusion import plan_fusion

    space, task, budget, members, model, plan, kw = _setup(family, width, batch)
    gplan = plan_fusion(model, task.sample_batch(1), max_width=width, plan=plan,
                        batch_size=batch, **kw)
    cache = StepCache()
    solo = [run_trial(RunSpec(i, cfg, plan, steps, budget, seed=s, log_every=steps), space,
                      task, cache=cache) for i, (cfg, s, _) in enumerate(members)]
    specs = tuple(MemberSpec(i, cfg, s) for i, (cfg, s, _) in enumerate(members))
    group = run_fused_group(GroupSpec(0, specs, gplan, steps, budget, log_every=steps), space,
                            task)
    return [(_rel(r.loss, a.loss), _rel(r.metrics[task.metric], a.metrics[task.metric]))
            for r, a in zip(group.members, solo, strict=True)]


def ulp_check(family: str, width: int, steps: int, batch: int) -> list[tuple[float, float, float]]:
    """Per member: (rerun loss rel diff, lr + 1 ulp loss rel diff, lr + 1 ulp metric rel diff)."""
    import numpy as np

    from scamp_jax.hpo.runner import RunSpec, StepCache, run_trial

    space, task, budget, members, _, plan, _ = _setup(family, width, batch)
    cache = StepCache()
    out = []
    for i, (cfg, s, _) in enumerate(members):
        def solo(config: dict[str, Any], i: int = i, s: int = s) -> Any:
            return run_trial(RunSpec(i, config, plan, steps, budget, seed=s, log_every=steps),
                             space, task, cache=cache)

        a, again = solo(cfg), solo(cfg)
        lr = float(np.nextafter(np.float32(cfg["learning_rate"]), np.float32(1)))
        b = solo({**cfg, "learning_rate": lr})
        out.append((_rel(again.loss, a.loss), _rel(b.loss, a.loss),
                    _rel(b.metrics[task.metric], a.metrics[task.metric])))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags and print the checks."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.fusion_precision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(DEFAULTS), default="swinir")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--ops", action="store_true", help="the one-step per-op check only")
    p.add_argument("--fused", action="store_true", help="fused members against solo runs")
    p.add_argument("--ulp", action="store_true", help="the solo runs' sensitivity")
    args = p.parse_args(argv)
    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(CPU_DEVICES)
    d = DEFAULTS[args.family]
    steps, batch = args.steps or d["steps"], d["batch"]
    if args.ops:
        for name, (fwd, grad) in op_check(args.width).items():
            print(f"{name:20s} forward rel {fwd:.2e}  gradient rel {grad:.2e}")
    if args.fused:
        for i, (loss, metric) in enumerate(fused_check(args.family, args.width, steps, batch)):
            print(f"fused member {i}: final loss rel {loss:.2e}, metric rel {metric:.2e}")
    if args.ulp:
        for i, (again, loss, metric) in enumerate(ulp_check(args.family, args.width, steps,
                                                            batch)):
            print(f"member {i}: rerun rel {again:.2e}; lr + 1 ulp: final loss rel {loss:.2e}, "
                  f"metric rel {metric:.2e}")


if __name__ == "__main__":
    main()
