"""Fused vs unfused training of the same trials: trials per hour, compile included in both.

The same ``K`` trials of one small architecture of a family (different learning rates and
seeds, the study's per-trial seeds) are trained for the same steps at the same batch, with a
final checkpoint and held-out evaluation each, in three ways:

- **fused**: one group (`scamp_jax.hpo.fused_runner.run_fused_group`) on one device, the group sized
  by `scamp_jax.planning.fusion.plan_fusion` (its compiles are counted in the fused time);
- **unfused**: the project's solo runner (`scamp_jax.hpo.runner.run_trial`) one trial after another
  on the same device, sharing one compiled step (`StepCache`), as the engine does for trials of
  one architecture;
- **unfused, concurrent**: the same solo runs at once, each in its own thread on its own CPU
  device (how the engine packs them when devices are free);
- **Ray Tune** (``--ray``, needs ``pip install "ray[tune]"``): each trial a Ray Tune trial in its
  own process with one JAX device (`benchmarks.ray_baseline`), two at a time.

Every timed variant starts from fresh jitted functions, so each pays its own compiles; the
held-out evaluation's model function is compiled once before timing (both variants share it).
Repeats run the variants interleaved, in rotating order, because the machine is shared; the
report gives the min and median over repeats and each member's final loss solo and fused.

Run::

    python -m benchmarks.fusion --family vit --width 4 --json
    python -m benchmarks.fusion --family swinir --width 4 --repeats 3 --ray --markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CPU_DEVICES = 8

#: One small architecture per family (the group's), and the steps and batch the trials train.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "vit": {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0},
    "swinir": {"embed_dim": 24, "num_groups": 1, "group_depth": 2, "num_heads": 2,
               "window_size": 8, "mlp_ratio": 2.0},
}
DEFAULTS = {"vit": {"steps": 40, "batch": 32}, "swinir": {"steps": 40, "batch": 8}}
#: learning rates of the members, log-spaced over this range.
LR_RANGE = {"vit": (3e-4, 3e-3), "swinir": (1e-3, 5e-3)}


def member_configs(family: str, width: int, seed: int = 0) -> list[tuple[dict[str, Any], int,
                                                                          str]]:
    """``(config, seed, checkpoint key)`` of the ``width`` trials: log-spaced learning rates,
    per-trial seeds as the study derives them (`scamp_jax.hpo.runner.trial_seed`)."""
    import numpy as np

    from scamp_jax.hpo.runner import trial_seed

    lo, hi = LR_RANGE[family]
    lrs = np.geomspace(lo, hi, width) if width > 1 else np.array([lo])
    out = []
    for i, lr in enumerate(lrs):
        key = f"trial_{i}"
        out.append(({**ARCHITECTURES[family], "learning_rate": float(lr)},
                    trial_seed(seed, key), key))
    return out


def _experiment(family: str) -> Any:
    from benchmarks.ray_baseline import _experiment as experiment

    return experiment(family)


def run(family: str, width: int, *, steps: int, batch: int, repeats: int, ray: bool,
        concurrent: bool, seed: int = 0) -> dict[str, Any]:
    """Measure the variants; returns the JSON-ready report (see the module docstring)."""
    import dataclasses

    import jax
    from flax import nnx

    from scamp_jax._units import parse_bytes
    from scamp_jax.hpo.fused_runner import GroupSpec, MemberSpec, run_fused_group
    from scamp_jax.hpo.runner import RunSpec, StepCache, make_optimizer, run_trial
    from scamp_jax.planning import planner
    from scamp_jax.planning.fusion import plan_fusion

    experiment = _experiment(family)
    hpo = dataclasses.replace(experiment.get_config("smoke"), seed=seed)
    space, task = experiment.make_space_and_task(hpo)
    budget = parse_bytes(hpo.memory_per_device)
    members = member_configs(family, width, seed)
    arch = members[0][0]
    device = jax.devices()[:1]
    model = nnx.eval_shape(lambda: space.build(arch, nnx.Rngs(0)))
    kw = {"optimizer": make_optimizer({}), "loss_fn": task.loss_fn}
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=device,
                             memory_per_device=budget, max_batch_size=batch, **kw)
    if plan.batch_size != batch:
        raise SystemExit(f"--batch {batch} does not fit one trial in {hpo.memory_per_device}; "
                         f"the planner fits {plan.batch_size}: pass --batch {plan.batch_size}")
    task.evaluate(space.build(arch, nnx.Rngs(0)))  # compile the shared evaluation once

    # Sizing the group compiles the fused step (like planning a trial compiles its step); the
    # plan is made once per architecture and width, so it is timed apart from the runs.
    t0, c0 = time.perf_counter(), time.process_time()
    gplan = plan_fusion(model, task.sample_batch(1), max_width=width, plan=plan,
                        batch_size=batch, **kw)
    fusion_planning = (time.perf_counter() - t0, time.process_time() - c0)
    if gplan.width < width:
        raise SystemExit(f"only {gplan.width} members fit {hpo.memory_per_device} at batch "
                         f"{batch}; lower --width or --batch")

    def fused(root: Path) -> tuple[float, Any]:
        specs = tuple(MemberSpec(i, cfg, s, checkpoint_dir=root / "fused" / key)
                      for i, (cfg, s, key) in enumerate(members))
        t0 = time.perf_counter()
        result = run_fused_group(GroupSpec(0, specs, gplan, steps, budget), space, task)
        return time.perf_counter() - t0, result

    def solo_spec(i: int, root: Path, devices: Sequence[Any]) -> RunSpec:
        cfg, s, key = members[i]
        return RunSpec(number=i, params=cfg, plan=plan.with_devices(devices), steps=steps,
                       memory_per_device=budget, seed=s,
                       checkpoint_dir=root / "unfused" / key)

    def unfused(root: Path) -> tuple[float, list[Any]]:
        cache = StepCache()
        t0 = time.perf_counter()
        results = [run_trial(solo_spec(i, root, device), space, task, cache=cache)
                   for i in range(width)]
        return time.perf_counter() - t0, results

    def packed(root: Path) -> tuple[float, list[Any]]:
        cache = StepCache()
        results: list[Any] = [None] * width
        devices = jax.devices()

        def one(i: int) -> None:
            spec = solo_spec(i, root / "packed", [devices[i % len(devices)]])
            results[i] = run_trial(spec, space, task, cache=cache)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(width)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0, results

    variants = ["fused", "unfused"] + (["concurrent"] if concurrent else [])
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    fused_result = solo_results = None
    for r in range(repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            c0 = time.process_time()
            with tempfile.TemporaryDirectory(prefix="fusion-bench-") as tmp:
                root = Path(tmp)
                if v == "fused":
                    seconds, group = fused(root)
                    bad = [m for m in group.members if m.state != "complete"]
                    fused_result = fused_result or group
                elif v == "unfused":
                    seconds, results = unfused(root)
                    bad = [m for m in results if m.state != "complete"]
                    solo_results = solo_results or results
                else:
                    seconds, results = packed(root)
                    bad = [m for m in results if m.state != "complete"]
            if bad:
                raise SystemExit(f"{v} trial {bad[0].number} ended {bad[0].state}: "
                                 f"{bad[0].reason}")
            times[v].append(seconds)
            cpu[v].append(time.process_time() - c0)
            print(f"repeat {r}: {v:>10} {seconds:7.2f} s wall, {cpu[v][-1]:7.2f} s CPU",
                  flush=True)
    assert fused_result is not None and solo_results is not None
    metric = task.metric
    rows = []
    for i, (cfg, s, _) in enumerate(members):
        f, u = fused_result.members[i], solo_results[i]
        rows.append({"number": i, "learning_rate": cfg["learning_rate"], "seed": s,
                     "solo_final_loss": u.loss, "fused_final_loss": f.loss,
                     "loss_rel_diff": abs(f.loss - u.loss) / max(abs(u.loss), 1e-30),
                     f"solo_{metric}": u.metrics[metric], f"fused_{metric}": f.metrics[metric]})
    out: dict[str, Any] = {
        "family": family, "width": width, "steps": steps, "batch_size": batch,
        "architecture": arch, "device": f"{jax.devices()[0].platform} x1",
        "memory_per_device": budget, "repeats": repeats, "members": rows,
        "fused_seconds": min(times["fused"]), "unfused_seconds": min(times["unfused"]),
        "seconds": {v: {"min": min(t), "median": statistics.median(t), "all": t}
                    for v, t in times.items()},
        "cpu_seconds": {v: {"min": min(t), "median": statistics.median(t), "all": t}
                        for v, t in cpu.items()},
        "fusion_plan": {"width": gplan.width, "peak_bytes_per_device":
                        gplan.peak_bytes_per_device, "compiles": gplan.compiles,
                        "planning_seconds": fusion_planning[0],
                        "planning_cpu_seconds": fusion_planning[1]},
        "fused_compile_seconds": fused_result.compile_seconds,
    }
    out["speedup"] = {
        stat: out["seconds"]["unfused"][stat] / out["seconds"]["fused"][stat]
        for stat in ("min", "median")}
    out["trials_per_hour"] = {v: 3600.0 * width / out["seconds"][v]["median"] for v in variants}
    if ray:
        out["ray"] = _ray(family, members, steps, batch, budget, seed, metric, task.direction)
        if "elapsed_s" in out["ray"]:
            out["trials_per_hour"]["ray"] = 3600.0 * width / out["ray"]["elapsed_s"]
    else:
        out["ray"] = {"skipped": "not requested (pass --ray)"}
    return out


def simulate(family: str, widths: Sequence[int], batch: int, seed: int = 0) -> dict[str, Any]:
    """Modelled throughput gain of a group vs width on the simulator's cluster presets.

    Costs come from compiling the fused step at ``widths`` (`scamp_jax.sim.sim_fusion`); the gain of
    width ``K`` is ``K * step(1) / step(K)`` under the simulator's per-step model.
    """
    import dataclasses

    import jax
    from flax import nnx

    from scamp_jax._units import parse_bytes
    from scamp_jax.hpo.runner import make_optimizer
    from scamp_jax.planning import planner
    from scamp_jax.sim.sim_fusion import measure_fused_costs
    from scamp_jax.sim.simulator import CLUSTER_PRESETS, TrialProfile

    experiment = _experiment(family)
    hpo = dataclasses.replace(experiment.get_config("smoke"), seed=seed)
    space, task = experiment.make_space_and_task(hpo)
    arch = ARCHITECTURES[family]
    model = nnx.eval_shape(lambda: space.build(arch, nnx.Rngs(0)))
    kw = {"optimizer": make_optimizer({}), "loss_fn": task.loss_fn}
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                             memory_per_device=parse_bytes(hpo.memory_per_device),
                             max_batch_size=batch, **kw)
    costs = measure_fused_costs(model, task.sample_batch(1), plan, batch_size=batch,
                                widths=tuple(widths), **kw)
    solo = TrialProfile(0, 1, plan.peak_bytes_per_device, batch, costs.flops[0],
                        costs.bytes_accessed[0], 0.0, 1, kernels_per_step=costs.kernels[0])
    gains = {name: {k: costs.throughput_gain(solo, cluster, k) for k in widths}
             for name, cluster in CLUSTER_PRESETS.items()}
    return {"family": family, "batch_size": batch, "widths": list(widths),
            "flops": list(costs.flops), "bytes_accessed": list(costs.bytes_accessed),
            "kernels": list(costs.kernels), "gain": gains}


def _ray(family: str, members: Sequence[tuple[dict[str, Any], int, str]], steps: int,
         batch: int, budget: int, seed: int, metric: str, direction: str) -> dict[str, Any]:
    from benchmarks.ray_baseline import RayTrialSpec, import_ray, run_ray_baseline

    ray, reason = import_ray()
    if ray is None:
        return {"skipped": reason}
    specs = [RayTrialSpec(i, cfg, batch, steps, key) for i, (cfg, _, key) in enumerate(members)]
    with tempfile.TemporaryDirectory(prefix="fusion-ray-") as tmp:
        res = run_ray_baseline(specs, family=family, pool_devices=2, devices_per_trial=1,
                               memory_per_device=budget, seed=seed, out=Path(tmp),
                               metric=metric, direction=direction)
    return {"elapsed_s": res["elapsed_s"], "ray_init_s": res["ray_init_s"],
            "trials": res["trials_this_run"], "failed": res["failed"], "concurrent": 2}


def _table(report: dict[str, Any], markdown: bool) -> None:
    from benchmarks._tables import print_table

    sec, tph = report["seconds"], report["trials_per_hour"]
    cpu = report["cpu_seconds"]
    rows = []
    for v in sec:
        rows.append([v, f"{sec[v]['min']:.1f}", f"{sec[v]['median']:.1f}",
                     f"{cpu[v]['median']:.1f}", f"{tph[v]:.0f}",
                     f"{sec['unfused']['median'] / sec[v]['median']:.2f}x",
                     f"{cpu['unfused']['median'] / cpu[v]['median']:.2f}x"])
    ray = report["ray"]
    if "elapsed_s" in ray:
        rows.append(["ray tune (2 at once)", f"{ray['elapsed_s']:.1f}", "(1 run)", "-",
                     f"{tph['ray']:.0f}", f"{sec['unfused']['median'] / ray['elapsed_s']:.2f}x",
                     "-"])
    plan = report["fusion_plan"]
    print_table(
        f"{report['family']}: {report['width']} trials x {report['steps']} steps, batch "
        f"{report['batch_size']}, {report['repeats']} repeats (sizing the group: "
        f"{plan['compiles']} compiles, {plan['planning_seconds']:.1f} s wall, "
        f"{plan['planning_cpu_seconds']:.1f} s CPU, not in the fused time)",
        ["variant", "min s", "median s", "median CPU s", "trials/h (median)",
         "wall vs unfused", "CPU vs unfused"], rows, markdown)
    metric = next(k[len("solo_"):] for k in report["members"][0]
                  if k.startswith("solo_") and k != "solo_final_loss")
    print_table(
        "members: final loss and held-out score, solo vs fused",
        ["lr", "solo loss", "fused loss", "rel diff", f"solo {metric}", f"fused {metric}"],
        [[f"{m['learning_rate']:.2e}", f"{m['solo_final_loss']:.6f}",
          f"{m['fused_final_loss']:.6f}", f"{m['loss_rel_diff']:.1e}",
          f"{m['solo_' + metric]:.4f}", f"{m['fused_' + metric]:.4f}"]
         for m in report["members"]], markdown)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse flags, measure, print a table (and the JSON with ``--json``)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.fusion", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(ARCHITECTURES), default="vit")
    p.add_argument("--width", type=int, default=4, help="trials in the group (K)")
    p.add_argument("--steps", type=int, default=None, help="training steps per trial")
    p.add_argument("--batch", type=int, default=None, help="samples per trial per step")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per variant")
    p.add_argument("--no-concurrent", action="store_true",
                   help="skip the concurrent unfused variant")
    p.add_argument("--ray", action="store_true", help="also run the trials under Ray Tune")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--markdown", action="store_true", help="Markdown tables")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--simulate", action="store_true",
                   help="only the modelled gain vs width on the simulator's cluster presets "
                        "(compiles, trains nothing)")
    args = p.parse_args(argv)
    if args.width < 1 or args.repeats < 1:
        p.error(f"--width {args.width} and --repeats {args.repeats} must be at least 1")

    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(CPU_DEVICES)
    d = DEFAULTS[args.family]
    if args.simulate:
        widths = sorted({1, 2, args.width, 2 * args.width})
        report = simulate(args.family, widths, args.batch or d["batch"])
        from benchmarks._tables import print_table

        print_table(
            f"{args.family}: modelled trials/s of a fused group over one trial, batch "
            f"{report['batch_size']} (kernels per step {report['kernels']})",
            ["cluster", *(f"K={k}" for k in widths)],
            [[name, *(f"{g[k]:.2f}x" for k in widths)] for name, g in report["gain"].items()],
            args.markdown)
        if args.json:
            print(json.dumps(report, indent=2))
        return report
    report = run(args.family, args.width, steps=args.steps or d["steps"],
                 batch=args.batch or d["batch"], repeats=args.repeats, ray=args.ray,
                 concurrent=not args.no_concurrent)
    _table(report, args.markdown)
    if args.json:
        print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
