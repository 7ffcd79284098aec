"""How close a fused member stays to its solo run, against how far a solo run moves by itself.

    python -m benchmarks.fusion_precision --ops                                # one step, op by op
    python -m benchmarks.fusion_precision --trial --family swinir --width 5 --steps 200 --json
    python -m benchmarks.fusion_precision --trial --family vit --width 5 --steps 40 --json

``--ops``: each op of a SwinIR block (3x3 convolutions, linear, LayerNorm, window attention with
softmax), ``K`` members with their own parameters, against ``f`` member by member: the largest
relative difference of the forward and of the parameter gradients of an L1 loss, for the fused
step's form (`scamp_jax.planning.member_ops.member_program` under ``jax.vmap``) and for plain
``jax.vmap`` (a grouped convolution for a convolution).

``--trial``: the members of `benchmarks.fusion` (log-spaced learning rates, the study's seeds;
at least 5 of them) trained for a whole trial four ways with the project's runners: solo
(`scamp_jax.hpo.runner.run_trial`), solo again (is the solo run deterministic?), solo with one
weight one float32 ulp away at initialisation (`nudged`: a rounding-sized change made once),
and fused
(`scamp_jax.hpo.fused_runner.run_fused_group`). Per member it reports the final loss and the
held-out metric of each; the **fused gap** is ``|fused - solo|`` and the **noise floor** is
``|ulp - solo|``, the spread a last-bit perturbation of the solo run alone produces. A fused
program equal to its members' solo programs to rounding cannot be told from the noise floor
over a trial long enough to amplify rounding; one that computes something else stands out.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.fusion import CPU_DEVICES, DEFAULTS, _experiment, member_configs


def _rel(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def op_check(width: int = 4) -> dict[str, dict[str, tuple[float, float]]]:
    """``{form: {op: (forward rel diff, gradient rel diff)}}`` of the fused forms
    (``"member_program"``, ``"plain vmap"``) against ``f`` member by member."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from scamp_jax.planning.member_ops import member_program

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
    out: dict[str, dict[str, tuple[float, float]]] = {"member_program": {}, "plain vmap": {}}
    for name, (make, inputs) in ops.items():
        models = [make(nnx.Rngs(i)) for i in range(width)]
        graphdef = nnx.split(models[0])[0]
        states = [nnx.split(m)[1] for m in models]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        xs = jnp.stack([inputs * (i + 1) for i in range(width)])

        def f(state: Any, x: jax.Array, graphdef: Any = graphdef) -> jax.Array:
            return nnx.merge(graphdef, state)(x)

        def grad(state: Any, x: jax.Array, f: Any = f) -> Any:
            return jax.grad(lambda s: jnp.abs(f(s, x)).mean())(state)

        alone = jnp.stack([jax.jit(f)(states[i], xs[i]) for i in range(width)])
        g_alone = jax.tree.map(lambda *a: jnp.stack(a),
                               *[jax.jit(grad)(states[i], xs[i]) for i in range(width)])
        for form, wrap in (("member_program", member_program), ("plain vmap", lambda g: g)):
            fused = jax.jit(jax.vmap(wrap(f)))(stacked, xs)
            g_fused = jax.jit(jax.vmap(wrap(grad)))(stacked, xs)
            diff = max(_rel(a, b) for a, b in zip(jax.tree.leaves(g_fused),
                                                  jax.tree.leaves(g_alone), strict=True))
            out[form][name] = (_rel(fused, alone), diff)
    return out


def nudged(space: Any) -> Any:
    """``space`` whose models start with one weight one float32 ulp larger: a rounding-sized
    perturbation. The weight is the largest in magnitude of the model's first ``kernel`` (in
    the order of ``nnx.state``'s paths), so never a 0 whose next float32, a denormal, a CPU
    flushes back to 0."""
    import jax.numpy as jnp
    from flax import nnx

    def build(config: Any, rngs: nnx.Rngs) -> nnx.Module:
        model = space.build(config, rngs)
        var = next(v for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                   if path[-1] == "kernel")
        value = var.get_value()
        flat = value.reshape(-1)
        at = jnp.argmax(jnp.abs(flat))
        up = jnp.nextafter(flat[at], jnp.asarray(jnp.inf, value.dtype))
        var.set_value(flat.at[at].set(up).reshape(value.shape))
        return model

    return dataclasses.replace(space, build=build)


def trial_check(family: str, width: int, steps: int, batch: int) -> dict[str, Any]:
    """The ``--trial`` comparison (module docstring) as a JSON-ready report."""
    import jax
    from flax import nnx

    from scamp_jax._units import parse_bytes
    from scamp_jax.hpo.fused_runner import GroupSpec, MemberSpec, run_fused_group
    from scamp_jax.hpo.runner import RunSpec, StepCache, make_optimizer, run_trial
    from scamp_jax.planning import planner
    from scamp_jax.planning.fusion import plan_fusion

    if width < 5:
        raise SystemExit(f"--width {width}: the noise floor needs at least 5 members")
    experiment = _experiment(family)
    hpo = dataclasses.replace(experiment.get_config("smoke"), seed=0)
    space, task = experiment.make_space_and_task(hpo)
    budget = parse_bytes(hpo.memory_per_device)
    members = member_configs(family, width, 0)
    model = nnx.eval_shape(lambda: space.build(members[0][0], nnx.Rngs(0)))
    kw = {"optimizer": make_optimizer({}), "loss_fn": task.loss_fn}
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                             memory_per_device=budget, max_batch_size=batch, **kw)
    gplan = plan_fusion(model, task.sample_batch(1), max_width=width, plan=plan,
                        batch_size=batch, **kw)
    if plan.batch_size != batch or gplan.width != width:
        raise SystemExit(f"batch {batch} x {width} members do not fit "
                         f"{hpo.memory_per_device}; lower --width")
    ulp_space = nudged(space)

    def solo(i: int, space: Any, cache: StepCache) -> Any:
        cfg, seed, _ = members[i]
        result = run_trial(RunSpec(i, cfg, plan, steps, budget, seed=seed, log_every=steps),
                           space, task, cache=cache)
        if result.state != "complete":
            raise SystemExit(f"solo member {i} ended {result.state}: {result.reason}")
        return result

    # A perturbed build is the same architecture: its initialisation must not come from the
    # unperturbed runs' compiled one, so it has its own cache.
    plain_cache, ulp_cache = StepCache(), StepCache()
    base = [solo(i, space, plain_cache) for i in range(width)]
    again = solo(0, space, plain_cache)
    ulp = [solo(i, ulp_space, ulp_cache) for i in range(width)]
    specs = tuple(MemberSpec(i, cfg, s) for i, (cfg, s, _) in enumerate(members))
    group = run_fused_group(GroupSpec(0, specs, gplan, steps, budget, log_every=steps), space,
                            task)
    metric = task.metric
    rows = []
    for i, (cfg, seed, _) in enumerate(members):
        b, u, f = base[i], ulp[i], group.members[i]
        if f.state != "complete":
            raise SystemExit(f"fused member {i} ended {f.state}: {f.reason}")
        rows.append({
            "number": i, "learning_rate": cfg["learning_rate"], "seed": seed,
            "solo_loss": b.loss, "ulp_loss": u.loss, "fused_loss": f.loss,
            f"solo_{metric}": b.metrics[metric], f"ulp_{metric}": u.metrics[metric],
            f"fused_{metric}": f.metrics[metric],
            "fused_gap_loss_rel": _rel(f.loss, b.loss), "ulp_gap_loss_rel": _rel(u.loss, b.loss),
            f"fused_gap_{metric}": abs(f.metrics[metric] - b.metrics[metric]),
            f"ulp_gap_{metric}": abs(u.metrics[metric] - b.metrics[metric]),
        })

    def summary(key: str) -> dict[str, float]:
        values = [r[key] for r in rows]
        return {"median": statistics.median(values), "max": max(values)}

    return {
        "family": family, "width": width, "steps": steps, "batch_size": batch,
        "metric": metric, "device": f"{jax.devices()[0].platform} x1",
        "solo_rerun_loss_rel": _rel(again.loss, base[0].loss),
        "solo_rerun_metric_diff": abs(again.metrics[metric] - base[0].metrics[metric]),
        "fused_gap": {"loss_rel": summary("fused_gap_loss_rel"),
                      metric: summary(f"fused_gap_{metric}")},
        "noise_floor": {"loss_rel": summary("ulp_gap_loss_rel"),
                        metric: summary(f"ulp_gap_{metric}")},
        "members": rows,
    }


def _print_trial(report: dict[str, Any]) -> None:
    from benchmarks._tables import print_table

    metric = report["metric"]
    print_table(
        f"{report['family']}: {report['width']} members x {report['steps']} steps, batch "
        f"{report['batch_size']}: fused and one-ulp solo runs against the solo run "
        f"(solo run again: loss {report['solo_rerun_loss_rel']:.1e} relative, {metric} "
        f"{report['solo_rerun_metric_diff']:.2e} apart)",
        ["lr", "solo loss", "fused loss", "ulp loss", f"solo {metric}", f"fused gap {metric}",
         f"ulp gap {metric}", "fused gap loss", "ulp gap loss"],
        [[f"{r['learning_rate']:.2e}", f"{r['solo_loss']:.5f}", f"{r['fused_loss']:.5f}",
          f"{r['ulp_loss']:.5f}", f"{r['solo_' + metric]:.4f}",
          f"{r['fused_gap_' + metric]:.4f}", f"{r['ulp_gap_' + metric]:.4f}",
          f"{r['fused_gap_loss_rel']:.1e}", f"{r['ulp_gap_loss_rel']:.1e}"]
         for r in report["members"]], False)
    for name in ("fused_gap", "noise_floor"):
        s = report[name]
        print(f"{name:12s}: {metric} median {s[metric]['median']:.4f} max {s[metric]['max']:.4f}"
              f"; final loss relative median {s['loss_rel']['median']:.2e} "
              f"max {s['loss_rel']['max']:.2e}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Parse flags and print the checks."""
    from experiments._cli import output_file, positive_int

    p = argparse.ArgumentParser(prog="python -m benchmarks.fusion_precision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(DEFAULTS), default="swinir",
                   help="model family of the members (default swinir)")
    p.add_argument("--width", type=positive_int, default=None,
                   help="members (--ops: 4; --trial: 5, at least 5)")
    p.add_argument("--steps", type=positive_int, default=None, help="--trial: steps per trial")
    p.add_argument("--ops", action="store_true", help="the one-step per-op check")
    p.add_argument("--trial", action="store_true",
                   help="fused gap against the one-ulp noise floor over a whole trial")
    p.add_argument("--json", action="store_true", help="print the --trial report as JSON")
    p.add_argument("--out", type=output_file, default=None,
                   help="also write the --trial JSON here")
    args = p.parse_args(argv)
    from benchmarks._tables import emit_report
    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(CPU_DEVICES)
    if args.ops or not args.trial:
        for form, ops in op_check(args.width or 4).items():
            for name, (fwd, grad) in ops.items():
                print(f"{form:15s} {name:20s} forward rel {fwd:.2e}  gradient rel {grad:.2e}")
    if not args.trial:
        return None
    d = DEFAULTS[args.family]
    report = trial_check(args.family, args.width or 5, args.steps or d["steps"], d["batch"])
    _print_trial(report)
    emit_report(report, print_json=args.json, out=args.out)
    return report


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
