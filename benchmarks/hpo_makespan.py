"""End-to-end HPO time under ScaMP placement vs the fixed-resources baseline, side by side.

Runs the same search (same space, seed, sampler, trials and training length) twice in one
process, once with ``--policy scamp`` and once with ``--policy fixed``, each in a fresh study, and
prints end-to-end seconds, mean aggregate memory utilisation, idle device-seconds, trials per hour,
the planning time (summed over planner calls, with its share of the end-to-end time and the
training-step compiles it made) and the fixed/scamp ratios::

    python -m benchmarks.hpo_makespan                       # small SwinIR search on 8 CPU devices
    python -m benchmarks.hpo_makespan --family vit --trials 8 --steps 40 --markdown
    python -m benchmarks.hpo_makespan --trials 4 --steps 40 --ray --markdown   # + Ray Tune row

Both runs use the random sampler, so they train exactly the same configurations. With ``--ray``
a third row reruns the fixed run's trials (same configurations, batch, steps and seeds) through
Ray Tune (`benchmarks.ray_baseline`: ``tune.with_resources``, ``devices_per_trial`` JAX devices
per trial); without Ray installed that row is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from experiments._cli import CPU_DEVICES, HPOConfig, output_dir, positive_int


class TimedPlanner:
    """``plan_mesh`` with a `PlanCache` in the study directory, timing every call.

    Sums over calls (several planner threads may plan at once, so the sum can exceed the time
    planning was under way): ``wall_s`` wall-clock seconds, ``cpu_s`` CPU seconds of the calling
    threads (XLA's own compile worker threads are not in it), ``compiles`` training-step
    compiles, ``cached`` plans answered by the cache.
    """

    def __init__(self, cache_path: Path) -> None:
        from scamp_jax.planning.plan_cache import PlanCache

        self.cache = PlanCache(cache_path)
        self._lock = threading.Lock()
        self.calls = self.compiles = self.cached = 0
        self.wall_s = self.cpu_s = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from scamp_jax.planning.planner import plan_mesh

        start, cpu = time.perf_counter(), time.thread_time()
        plan = None
        try:
            plan = plan_mesh(*args, cache=self.cache, **kwargs)
            return plan
        finally:
            with self._lock:
                self.calls += 1
                self.wall_s += time.perf_counter() - start
                self.cpu_s += time.thread_time() - cpu
                if plan is not None:
                    self.compiles += plan.compiles
                    self.cached += plan.cached

    def summary(self) -> dict[str, Any]:
        """The planning figures for a results row."""
        return {"planning_s": self.wall_s, "planning_cpu_s": self.cpu_s,
                "plan_calls": self.calls, "plan_compiles": self.compiles,
                "plans_cached": self.cached}


def _row(name: str, info: dict[str, Any], metric: str,
         planning: dict[str, Any] | None = None) -> dict[str, Any]:
    usage = info["usage"]
    elapsed = float(info["elapsed_s"])
    trials = int(info["trials_this_run"])
    best = info.get("best") or {}
    return {
        "policy": name,
        "end_to_end_s": elapsed,
        "mean_memory_utilization": float(usage["mean_memory_utilization"]),
        "idle_device_seconds": float(usage["idle_device_seconds"]),
        "trials_per_hour": 3600.0 * trials / elapsed if elapsed > 0 else 0.0,
        "trials": trials,
        "metric": metric,
        "best": best.get(metric) if best else None,
        **(planning or {}),
    }


def ratio_line(rows: Sequence[dict[str, Any]]) -> str:
    """Each baseline against ScaMP: end-to-end time baseline/scamp (> 1: ScaMP is faster),
    memory utilisation scamp/baseline and idle device-seconds scamp - baseline."""
    by = {r["policy"]: r for r in rows}
    if "scamp" not in by:
        raise ValueError(f"rows {sorted(by)} have no 'scamp' row to compare against")
    s = by["scamp"]
    parts = []
    for name, b in by.items():
        if name == "scamp":
            continue
        parts.append(
            f"end-to-end time {name}/scamp = {b['end_to_end_s'] / s['end_to_end_s']:.2f}x; "
            f"memory utilisation scamp/{name} = "
            f"{s['mean_memory_utilization'] / max(b['mean_memory_utilization'], 1e-9):.2f}x; "
            f"idle device-seconds scamp - {name} = "
            f"{s['idle_device_seconds'] - b['idle_device_seconds']:+.1f}")
    return "\n".join(parts)


def format_table(rows: Sequence[dict[str, Any]], markdown: bool) -> str:
    """The side-by-side table, plus one ratio line per baseline (`ratio_line`)."""
    head = ["policy", "end-to-end (s)", "mean memory util.", "idle device-s", "trials/hour",
            f"best {rows[0]['metric']}"]
    body = [[r["policy"], f"{r['end_to_end_s']:.1f}", f"{100 * r['mean_memory_utilization']:.1f}%",
             f"{r['idle_device_seconds']:.1f}", f"{r['trials_per_hour']:.1f}",
             "" if r["best"] is None else f"{r['best']:.4g}"] for r in rows]
    if any("planning_s" in r for r in rows):
        head += ["planning s (sum)", "planning share", "planner thread cpu s", "plan compiles",
                 "plans cached"]
        for r, row in zip(rows, body, strict=True):
            row += ([f"{r['planning_s']:.1f}", f"{100 * r['planning_s'] / r['end_to_end_s']:.0f}%",
                     f"{r['planning_cpu_s']:.1f}", str(r["plan_compiles"]),
                     f"{r['plans_cached']}/{r['plan_calls']}"]
                    if "planning_s" in r else ["-"] * 5)
    ratio = ratio_line(rows) if len(rows) > 1 and any(r["policy"] == "scamp" for r in rows) \
        else ""
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines) + "\n\n" + ratio
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(lines) + "\n" + ratio


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run both policies and print the comparison; returns the two rows."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.hpo_makespan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("swinir", "vit"), default="swinir",
                   help="model family: SwinIR super-resolution or ViT synthetic classification")
    p.add_argument("--trials", type=positive_int, default=6, help="trials per policy (default 6)")
    p.add_argument("--steps", type=positive_int, default=40,
                   help="training steps per trial at the reference batch (default 40)")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="devices in the pool (default: the family's smoke preset)")
    p.add_argument("--memory-per-device", default=None,
                   help="budget per device (default: the family's smoke preset)")
    p.add_argument("--max-batch-size", type=positive_int, default=None,
                   help="cap on any trial's batch (default: the family's smoke preset); with "
                   "a larger cap ScaMP's planner raises each trial's batch to fill its memory")
    p.add_argument("--devices-per-trial", type=positive_int, default=2,
                   help="devices per trial of the fixed baseline")
    p.add_argument("--seed", type=int, default=0, help="seed shared by both runs")
    p.add_argument("--out", type=output_dir, default=None, metavar="DIR",
                   help="keep the studies here, each in DIR/<policy> (DIR/ray for --ray), "
                   "which each run empties first: a resumed study would skew its time "
                   "(default: a temporary folder)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--policies", default="scamp,fixed",
                   help="comma-separated policies to run, in order (default: scamp,fixed)")
    p.add_argument("--max-running-trials", default="auto",
                   help="trials training at once under both policies: auto (the engine's "
                   "default: on CPU one per two host cores), a number, or none (no cap)")
    p.add_argument("--ray", action="store_true",
                   help="also run the fixed run's trials through Ray Tune (needs ray[tune])")
    args = p.parse_args(argv)
    policies = args.policies.split(",")
    if not policies or any(x not in ("scamp", "fixed") for x in policies):
        p.error(f"--policies {args.policies!r}: choose from scamp,fixed (comma-separated)")
    if len(set(policies)) < len(policies):
        p.error(f"--policies {args.policies!r} names a policy twice; each runs once")
    running: int | str | None = {"auto": "auto", "none": None}.get(args.max_running_trials)
    if running is None and args.max_running_trials != "none":
        if not args.max_running_trials.isdigit() or int(args.max_running_trials) < 1:
            p.error(f"--max-running-trials {args.max_running_trials!r}: use auto, none or a "
                    "positive number")
        running = int(args.max_running_trials)
    if args.ray and "fixed" not in policies:
        p.error("--ray reruns the fixed run's trials; include fixed in --policies")
    if args.ray and importlib.util.find_spec("ray") is None:  # said before the runs, not after
        from benchmarks.ray_baseline import RAY_INSTALL_HINT

        print(f"note: --ray: {RAY_INSTALL_HINT}; the Ray Tune row will be skipped (Ctrl-C now "
              "to install it first)", flush=True)

    from scamp_jax.devices import configure_cpu_devices, peak_bytes_in_use

    configure_cpu_devices(max(CPU_DEVICES, args.devices or 0))
    get_config: Callable[[str], HPOConfig]  # swinir_hpo's takes a platform too
    if args.family == "swinir":
        from experiments.swinir_hpo import get_config, make_space_and_task
        baseline = "bicubic_psnr"
    else:
        from experiments.vit_synthetic import get_config, make_space_and_task
        baseline = None
    from scamp_jax.hpo.session import run_search
    from scamp_jax.planning import planner
    from scamp_jax.planning.budget import Budget

    devices = planner.resolve_devices(args.devices)
    memory = args.memory_per_device or get_config("smoke").memory_per_device
    budget = Budget.of_devices(devices, memory).memory_per_device
    if "fixed" in policies and args.devices_per_trial > len(devices):  # before any run
        p.error(f"--devices-per-trial {args.devices_per_trial} exceeds the pool of "
                f"{len(devices)} devices; lower it, or pass --devices "
                f"{args.devices_per_trial}")
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hpo_makespan_"))
    rows: list[dict[str, Any]] = []
    try:
        for policy in policies:
            study_dir = root / policy
            if study_dir.exists():
                shutil.rmtree(study_dir)  # a fresh study each time: resumed runs would skew time
            config = dataclasses.replace(
                get_config("smoke"), trials=args.trials, steps=args.steps, seed=args.seed,
                policy=policy, devices_per_trial=args.devices_per_trial, study_dir=str(study_dir),
                sampler="random", memory_per_device=memory,
                max_batch_size=args.max_batch_size or get_config("smoke").max_batch_size,
                max_running_trials=running,
            )
            space, task = make_space_and_task(config)
            timed = TimedPlanner(study_dir / "plans.sqlite")
            info = run_search(space, task, config, devices=devices, memory_per_device=budget,
                              live=False, baseline=baseline, title=f"policy {policy}",
                              plan_fn=timed)
            rows.append(_row(policy, info, task.metric, timed.summary()))
            rows[-1]["family"] = args.family  # what `simulate_cluster --validate` re-costs in
            # The allocator's high-water mark so far (None on CPU): run one policy per process
            # (--policies) for a figure of that policy alone.
            rows[-1]["peak_bytes_in_use"] = peak_bytes_in_use(devices)
        if args.ray:
            rows += _ray_rows(args, root, budget, len(devices), task)
    except BaseException:
        if not args.out:  # a temporary folder: kept once a run has finished, else removed
            if rows:
                print(f"(the finished studies are kept in {root})", file=sys.stderr)
            else:
                shutil.rmtree(root, ignore_errors=True)
        raise
    print(format_table(rows, args.markdown))
    (root / "hpo_makespan.json").write_text(json.dumps(rows, indent=2))
    if not args.out:
        print(f"(studies kept in {root})")
    return rows


def _ray_rows(args: argparse.Namespace, root: Path, budget: int, pool: int,
              task: Any) -> list[dict[str, Any]]:
    """The Ray Tune row (or none, with the reason printed, when Ray is missing)."""
    from benchmarks import ray_baseline

    ray, reason = ray_baseline.import_ray()
    if ray is None:
        print(f"Ray Tune row skipped: {reason}")
        return []
    results = json.loads((root / "fixed" / "results.json").read_text())
    specs = ray_baseline.trial_specs_from_results(results)
    study_dir = root / "ray"
    if study_dir.exists():
        shutil.rmtree(study_dir)
    config = _family_config(args.family)
    info = ray_baseline.run_ray_baseline(
        specs, family=args.family, pool_devices=pool, devices_per_trial=args.devices_per_trial,
        memory_per_device=budget, seed=args.seed, out=study_dir, metric=task.metric,
        direction=task.direction, checkpoint_every=config.checkpoint_every,
        checkpoint_min_seconds=config.checkpoint_min_seconds,
        eval_every=config.eval_every, reference_batch=config.reference_batch,
    )
    print(f"Ray Tune: started in {info['ray_init_s']:.1f} s (not in its end-to-end time); "
          f"trials not completed: {info['failed'] or 'none'}")
    return [_row("ray-tune", info, task.metric)]


def _family_config(family: str) -> Any:
    get_config: Callable[[str], HPOConfig]  # swinir_hpo's takes a platform too
    if family == "swinir":
        from experiments.swinir_hpo import get_config
    else:
        from experiments.vit_synthetic import get_config
    return get_config("smoke")


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
