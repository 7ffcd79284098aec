"""The fixed-resources baseline run through Ray Tune, the tool most searches use today.

Each trial of a finished ``--policy fixed`` study is run again as a Ray Tune trial with
``tune.with_resources(train_config, {"cpu": 1, "jax_device": k})``: Ray is started with
``jax_device`` resources equal to the pool's JAX devices, so it runs at most ``pool / k`` trials
at once, as the fixed policy does. Each Ray trial is its own process that sees exactly ``k`` CPU
JAX devices (``XLA_FLAGS``) and trains the configuration with the project's real trainer
(`scamp_jax.hpo.runner.run_trial` on the planner's ``k``-device plan at the fixed policy's batch,
for the same steps, with the same per-trial seed, checkpoints and evaluation). Only who schedules
the trials changes. Needs ``pip install "ray[tune]"``; `import_ray` says why the row is skipped when
Ray is missing.

Usage figures come from the trials' start and end times: each trial holds ``k`` devices with its
planned peak per device from its process start to its end (`ray_usage`, computed with the same
`scamp_jax.scheduling.usage.UsageRecorder` the engine uses).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RAY_INSTALL_HINT = 'the Ray Tune baseline needs Ray Tune; install it with: pip install "ray[tune]"'


def import_ray() -> tuple[Any, str]:
    """``(ray module, "")`` if Ray Tune imports, else ``(None, reason with the install hint)``."""
    try:
        import ray
        from ray import tune  # noqa: F401 - the Tune extra is what the baseline needs
    except ImportError as err:
        return None, f"{RAY_INSTALL_HINT} ({err})"
    return ray, ""


@dataclass(frozen=True)
class RayTrialSpec:
    """One trial to rerun under Ray: what the fixed policy trained.

    Attributes:
      number: the study's trial number.
      params: the configuration (architecture + optimizer hyperparameters).
      batch_size: global batch the fixed policy trained it at (samples).
      steps: training steps the fixed policy ran.
      checkpoint_key: the study's checkpoint key (the per-trial seed derives from it).
    """

    number: int
    params: Mapping[str, Any]
    batch_size: int
    steps: int
    checkpoint_key: str


def trial_specs_from_results(results: Mapping[str, Any]) -> list[RayTrialSpec]:
    """The completed trials of a ``results.json`` payload (`scamp_jax.hpo.report`), by number.

    Raises ``ValueError`` if none completed (there is nothing to rerun).
    """
    specs = []
    for rec in sorted(results["trials"], key=lambda r: r["number"]):
        if rec["state"] != "complete" or not rec.get("batch_size"):
            continue
        checkpoint = rec.get("checkpoint")
        # A fresh study keys checkpoints "trial_<number>"; the recorded path names the key.
        key = Path(checkpoint).parent.name if checkpoint else f"trial_{rec['number']}"
        specs.append(RayTrialSpec(int(rec["number"]), dict(rec["params"]),
                                  int(rec["batch_size"]), int(rec["steps"]), key))
    if not specs:
        raise ValueError("the fixed-policy results have no completed trial to rerun under Ray; "
                         "check the fixed run's results.json")
    return specs


def ray_usage(
    intervals: Sequence[tuple[int, float, float, int]],
    devices_per_trial: int,
    pool_devices: int,
    memory_per_device: int,
    t_end: float,
) -> dict[str, float]:
    """Usage summary of Ray trials from ``(number, start_s, end_s, peak bytes per device)``.

    Times are seconds from the start of ``Tuner.fit``. Ray does not say which JAX devices a trial
    used (each process has its own), so each trial is given the lowest ``devices_per_trial``
    device ids free at its start; the figures (mean memory utilisation, idle device-seconds)
    do not depend on which ids. Raises ``ValueError`` if more trials overlap than the pool holds.
    """
    from scamp_jax.scheduling.placement import Placement
    from scamp_jax.scheduling.usage import UsageRecorder

    recorder = UsageRecorder([memory_per_device] * pool_devices, t0=0.0)
    events = sorted([(end, 0, key, 0) for key, _, end, _ in intervals]
                    + [(start, 1, key, peak) for key, start, _, peak in intervals])
    free = list(range(pool_devices))
    held: dict[int, list[int]] = {}
    for t, kind, key, peak in events:  # ends sort before starts at the same instant
        if kind == 0:
            recorder.finish(t, key)
            free = sorted(free + held.pop(key))
            continue
        if len(free) < devices_per_trial:
            raise ValueError(
                f"trial {key} starts at {t:.2f} s with only {len(free)} free device(s) of "
                f"{pool_devices}; Ray's jax_device resources should prevent that overlap"
            )
        held[key], free = free[:devices_per_trial], free[devices_per_trial:]
        recorder.start(t, Placement(key, tuple(held[key])), int(peak))
    return recorder.summary(t_end)


def _experiment(family: str) -> Any:
    if family == "swinir":
        from experiments import swinir_hpo
        return swinir_hpo
    if family == "vit":
        from experiments import vit_synthetic
        return vit_synthetic
    raise ValueError(f"unknown family {family!r}; choose swinir or vit")


def train_config(config: dict[str, Any]) -> None:
    """Ray Tune function trainable: train one fixed-policy trial on this process's devices.

    ``config`` holds ``spec`` (a `RayTrialSpec` as a dict) and ``settings`` (family, budget in
    bytes, devices per trial, seed, safety margin, checkpoint and evaluation intervals (and the
    least seconds between checkpoints, as the study's), output
    directory). Reports the task's metrics, the trial's state, its start and end wall-clock times
    (``time.time()`` seconds) and its planned peak bytes per device.
    """
    t_start = time.time()
    from flax import nnx
    from ray import tune

    from scamp_jax.hpo.runner import RunSpec, make_optimizer, run_trial, trial_seed
    from scamp_jax.hpo.settings import EngineConfig
    from scamp_jax.planning import planner

    spec = RayTrialSpec(**config["spec"])
    s = config["settings"]
    experiment = _experiment(s["family"])
    hpo = dataclasses.replace(experiment.get_config("smoke"), seed=s["seed"])
    space, task = experiment.make_space_and_task(hpo)
    model = nnx.eval_shape(lambda: space.build(spec.params, nnx.Rngs(0)))
    # The fixed policy's plan: k devices, the policy's one batch as the cap (the engine's call).
    plan = planner.plan_mesh(
        model, task.sample_batch(1), devices=s["devices_per_trial"],
        memory_per_device=s["memory_per_device"], optimizer=make_optimizer({}),
        loss_fn=task.loss_fn, safety_margin=s["safety_margin"], max_batch_size=spec.batch_size,
    )
    if plan.batch_size != spec.batch_size:
        raise RuntimeError(f"trial {spec.number}: the planner gives batch {plan.batch_size} on "
                           f"{s['devices_per_trial']} devices, the fixed run trained "
                           f"{spec.batch_size}; rerun with the same budget and devices per trial")
    engine = EngineConfig(steps=spec.steps, reference_batch=s.get("reference_batch"))
    run = RunSpec(
        number=spec.number, params=spec.params, plan=plan, steps=spec.steps,
        memory_per_device=s["memory_per_device"],
        checkpoint_dir=Path(s["out"]) / "checkpoints" / spec.checkpoint_key,
        # the intervals a study's run of this batch takes (`EngineConfig.interval_for`)
        checkpoint_every=engine.interval_for(s["checkpoint_every"], spec.batch_size),
        checkpoint_min_seconds=s.get("checkpoint_min_seconds", 0.0),
        eval_every=engine.interval_for(s["eval_every"], spec.batch_size),
        seed=trial_seed(s["seed"], spec.checkpoint_key),
    )
    result = run_trial(run, space, task)
    tune.report({
        "number": spec.number, "state": result.state, "reason": result.reason,
        "steps_done": result.steps, **{k: float(v) for k, v in result.metrics.items()},
        "t_start": t_start, "t_end": time.time(),
        "peak_bytes_per_device": int(plan.peak_bytes_per_device),
    })


def run_ray_baseline(
    specs: Sequence[RayTrialSpec],
    *,
    family: str,
    pool_devices: int,
    devices_per_trial: int,
    memory_per_device: int,
    seed: int,
    out: Path,
    metric: str,
    direction: str = "maximize",
    checkpoint_every: int = 0,
    checkpoint_min_seconds: float = 0.0,
    eval_every: int = 0,
    reference_batch: int | None = None,
    safety_margin: float = 0.1,
) -> dict[str, Any]:
    """Run ``specs`` through ``ray.tune.Tuner`` with ``devices_per_trial`` JAX devices each.

    Returns a dict shaped like `scamp_jax.hpo.session.run_search`'s (``elapsed_s``: seconds of
    ``Tuner.fit``; ``usage``: `ray_usage`; ``trials_this_run``; ``best``: the best completed
    trial's metrics or None) plus ``ray_init_s`` (seconds to start Ray, not in ``elapsed_s``) and
    ``failed`` (numbers of trials that did not complete). ``direction`` (``"maximize"`` or
    ``"minimize"``) picks the best trial by ``metric``. Raises ``ImportError`` with the
    install hint if Ray Tune is missing.
    """
    ray, reason = import_ray()
    if ray is None:
        raise ImportError(reason)
    from ray import tune

    if pool_devices % devices_per_trial:
        raise ValueError(f"{devices_per_trial=} must divide the pool of {pool_devices} devices")
    out.mkdir(parents=True, exist_ok=True)
    repo = str(Path(__file__).resolve().parents[1])
    env = {
        # Each Ray trial process must see exactly its own k JAX devices.
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_trial}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    t0 = time.perf_counter()
    ray.init(num_cpus=pool_devices, resources={"jax_device": pool_devices},
             runtime_env={"env_vars": env}, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    ray_init_s = time.perf_counter() - t0
    settings = {
        "family": family, "memory_per_device": int(memory_per_device),
        "devices_per_trial": devices_per_trial, "seed": seed, "safety_margin": safety_margin,
        "checkpoint_every": checkpoint_every, "checkpoint_min_seconds": checkpoint_min_seconds,
        "eval_every": eval_every, "out": str(out),
        "reference_batch": reference_batch,
    }
    trainable = tune.with_resources(train_config, {"cpu": 1, "jax_device": devices_per_trial})
    tuner = tune.Tuner(
        trainable,
        param_space={"spec": tune.grid_search([dataclasses.asdict(s) for s in specs]),
                     "settings": settings},
        tune_config=tune.TuneConfig(num_samples=1, reuse_actors=False),
        run_config=tune.RunConfig(name="fixed_ray", storage_path=str(out.resolve() / "tune"),
                                  verbose=0),
    )
    try:
        wall0 = time.time()
        start = time.perf_counter()
        grid = tuner.fit()
        elapsed = time.perf_counter() - start
    finally:
        ray.shutdown()
    rows = [r.metrics for r in grid if r.metrics and "t_start" in r.metrics]
    intervals = [(int(m["number"]), m["t_start"] - wall0, m["t_end"] - wall0,
                  int(m["peak_bytes_per_device"])) for m in rows]
    usage = ray_usage(intervals, devices_per_trial, pool_devices, memory_per_device,
                      max([elapsed, *(end for _, _, end, _ in intervals)]))
    complete = [m for m in rows if m["state"] == "complete" and metric in m]
    best = None
    if complete:
        pick = max if direction == "maximize" else min
        best = pick(complete, key=lambda m: m[metric])
    done = {int(m["number"]) for m in complete}
    return {"elapsed_s": elapsed, "usage": usage, "trials_this_run": len(complete),
            "best": best, "ray_init_s": ray_init_s,
            "failed": sorted(s.number for s in specs if s.number not in done)}


if __name__ == "__main__":  # pragma: no cover - run through benchmarks.hpo_makespan --ray
    sys.exit("run the Ray baseline with: python -m benchmarks.hpo_makespan --ray")
