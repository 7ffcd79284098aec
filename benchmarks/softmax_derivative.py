"""The attention softmax's two derivatives side by side: memory per sample, step time, training.

JAX differentiates ``jax.nn.softmax`` by autodiff of its expression (keeping the exponentials
and the output) unless its ``jax_softmax_custom_jvp`` setting picks the rule that keeps the
output only; the search spaces' attention takes the second (`search_spaces.softmax`). For one
model of `benchmarks.memory_accuracy` this prints, for each rule:

- the training step's compiled bytes per sample, one device, from the step compiled at two
  batches (``--batches``), and the backward residuals traced from shapes (what the planner's
  first guess reads), for this CPU or a described GPU (``--target``);
- on this CPU, the compiled step's seconds at ``--step-batch`` (medians of interleaved rounds of
  five calls; ``--rounds 0`` skips it);
- with ``--train-seeds``, a SwinIR of the small space (the main job's, ``--config``) trained for
  ``--train-steps`` steps at batch 4 with each rule from each seed, and its held-out PSNR.

    python -m benchmarks.softmax_derivative --case swinir_small
    python -m benchmarks.softmax_derivative --case vit --batches 64,128 --step-batch 32
    python -m benchmarks.softmax_derivative --case swinir_small --target h100 --rounds 0
    python -m benchmarks.softmax_derivative --case swinir_small --rounds 0 --train-seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

RULES = {"expression": False, "output": True}  # name -> save_softmax_output
#: The main job's fourth trial of 2026-11-29 (a small-space SwinIR and its learning rate).
MAIN_JOB_TRIAL = {"embed_dim": 36, "num_groups": 1, "group_depth": 1, "num_heads": 1,
                  "window_size": 4, "mlp_ratio": 1.0, "learning_rate": 0.001797752629856584}


def memory(case_name: str, batches: tuple[int, int], target: str | None) -> dict[str, Any]:
    """Per rule: compiled peaks at ``batches``, the compiled and the traced bytes per sample."""
    import jax
    from flax import nnx

    from benchmarks.memory_accuracy import BY_NAME
    from scamp_jax.planning.memory import StepCompiler
    from scamp_jax.planning.sharding import make_mesh

    case = BY_NAME[case_name]
    if target is None:
        devices = jax.devices()[:1]
    else:
        from scamp_jax.planning.targets import resolve_target

        devices = list(resolve_target(target).devices(1))
    mesh = make_mesh(devices, 1, 1)
    out: dict[str, Any] = {}
    for rule, save in RULES.items():
        model = nnx.eval_shape(lambda save=save: case.build(nnx.Rngs(0), save))
        compiler = StepCompiler(model, case.sample(), mesh)
        peaks = {b: compiler.compile(b)[0].peak for b in batches}
        lo, hi = batches
        out[rule] = {"peaks": peaks,
                     "compiled_per_sample": (peaks[hi] - peaks[lo]) / (hi - lo),
                     "traced_per_sample": compiler.traced_bytes_per_sample()}
    return out


def step_seconds(case_name: str, batch: int, rounds: int) -> dict[str, float]:
    """Per rule: the median seconds of the jitted training step at ``batch`` on this CPU."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.memory_accuracy import BY_NAME
    from scamp_jax.planning.train_step import default_optimizer, make_train_step, split_model

    case = BY_NAME[case_name]
    shape = case.sample().shape
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, *shape[1:])), jnp.float32)
    runs = {}
    for rule, save in RULES.items():
        graphdef, params, rest = split_model(case.build(nnx.Rngs(0), save))
        optimizer = default_optimizer()
        step = jax.jit(make_train_step(graphdef, optimizer))
        args = (params, optimizer.init(params), rest, x)
        jax.block_until_ready(step(*args))
        runs[rule] = (step, args)
    times: dict[str, list[float]] = {rule: [] for rule in RULES}
    for _ in range(rounds):
        for rule, (step, args) in runs.items():
            start = time.perf_counter()
            for _ in range(5):
                out = step(*args)
            jax.block_until_ready(out)
            times[rule].append((time.perf_counter() - start) / 5)
    return {rule: float(np.median(t)) for rule, t in times.items()}


def trained_psnr(seeds: list[int], steps: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Per seed and rule: the held-out PSNR of ``config`` trained for ``steps`` at batch 4."""
    from flax import nnx

    from search_spaces import swinir
    from search_spaces.sr_task import SRTask, train

    space = swinir.space("small", scale=2, hr_patch=48)
    task = SRTask(scale=2, hr_patch=48)
    arch = {k: v for k, v in config.items() if k != "learning_rate"}
    rows = []
    for seed in seeds:
        row: dict[str, Any] = {"seed": seed}
        for rule, save in RULES.items():
            model = space.build(arch, nnx.Rngs(seed))
            model.set_attributes(save_softmax_output=save, raise_if_not_found=False)
            history = train(model, task, steps=steps, batch_size=4,
                            learning_rate=config["learning_rate"], seed=seed, log_every=steps)
            row[rule] = history[-1]["psnr"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.softmax_derivative", description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="swinir_small",
                        help="a model of benchmarks.memory_accuracy (default swinir_small)")
    parser.add_argument("--target", default=None,
                        help="a described GPU to compile for (e.g. h100; needs the gpu-plan "
                        "extra); default: this CPU")
    parser.add_argument("--batches", default="32,64",
                        help="the two batches the step is compiled at (default 32,64)")
    parser.add_argument("--step-batch", type=int, default=8,
                        help="batch of the timed step on this CPU (default 8)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved timing rounds of 5 steps per rule; 0: no timing")
    parser.add_argument("--train-seeds", default="",
                        help="comma-separated seeds: train the main job's SwinIR with each rule")
    parser.add_argument("--train-steps", type=int, default=1000,
                        help="training steps per seed (default 1000, the main job's)")
    args = parser.parse_args(argv)
    lo, hi = (int(b) for b in args.batches.split(","))
    report: dict[str, Any] = {"case": args.case, "target": args.target or "cpu",
                              "memory": memory(args.case, (lo, hi), args.target)}
    if args.rounds > 0 and args.target is None:
        report["step_seconds"] = step_seconds(args.case, args.step_batch, args.rounds)
        report["step_batch"] = args.step_batch
    if args.train_seeds:
        seeds = [int(s) for s in args.train_seeds.split(",")]
        report["trained_psnr"] = trained_psnr(seeds, args.train_steps, MAIN_JOB_TRIAL)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
