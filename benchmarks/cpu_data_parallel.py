"""Step time of one trial on 1, 2, 4 CPU devices at the same global batch, side by side.

CPU devices made with ``--xla_force_host_platform_device_count`` share one host's cores. This
benchmark asks whether a trial trains faster data-parallel over several of them than on one:
the same configuration, the same global batch, the planner's plan on the first ``n`` devices
(`scamp_jax.planning.planner.plan_mesh`), the project's jitted training step, interleaved
repeats (one timing of each device count per round)::

    python -m benchmarks.cpu_data_parallel                       # smoke SwinIR, batch 16
    python -m benchmarks.cpu_data_parallel --family vit --batch 64
    python -m benchmarks.cpu_data_parallel --family digits --batch 128 --steps 50 \\
        --params '{"width": 256, "depth": 2, "learning_rate": 0.01}'
    python -m benchmarks.cpu_data_parallel --counts 1,2,1x2      # also 2 trials at once
    python -m benchmarks.cpu_data_parallel --counts 2 --batch 8,16,32,64  # cost per sample

A layout ``nxk`` runs ``k`` copies of the trial at once in threads, each on its own ``n``
devices, which is how an engine running ``k`` trials at once shares the host. Prints
milliseconds per trial-step (wall time over all steps the ``k`` trials made; median over
rounds) and per sample, CPU milliseconds of the process per trial-step, and the throughput
over the first layout. Several batches answer the other question a planner's batch choice
raises on CPU: whether a larger batch trains more samples per second there (ScaMP's largest
batch that fits is chosen for accelerators, whose throughput grows with the batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from experiments._cli import CPU_DEVICES, HPOConfig, positive_int


def _trial(space: Any, task: Any, params: dict[str, Any], devices: Sequence[Any],
           batch: int) -> Any:
    """A ``run() -> seconds`` closure that times steps of ``params`` on ``devices``."""
    import jax
    import numpy as np
    from flax import nnx

    from scamp_jax.hpo.runner import make_optimizer
    from scamp_jax.planning import planner
    from scamp_jax.planning.train_step import jit_train_step, place_train_state

    model = space.build(params, nnx.Rngs(0))
    optimizer = make_optimizer(params)
    plan = planner.plan_mesh(nnx.eval_shape(lambda: space.build(params, nnx.Rngs(0))),
                             task.sample_batch(batch), devices=list(devices),
                             memory_per_device="4GiB", optimizer=optimizer,
                             loss_fn=task.loss_fn, max_batch_size=batch,
                             batch_multiple=len(devices), model_parallel=1)
    if plan.batch_size != batch:
        raise SystemExit(f"the plan on {len(devices)} device(s) has batch {plan.batch_size}, "
                         f"not {batch}; pick a batch that is a multiple of every device count")
    graphdef, p, o, r = place_train_state(model, optimizer, plan.step_shardings)
    step = jit_train_step(graphdef, optimizer, task.loss_fn, plan.step_shardings)
    data = [jax.device_put(tuple(np.asarray(x) for x in b), plan.step_shardings.batch)
            for b, _ in zip(task.batches(batch, 0), range(2), strict=False)]
    state = [p, o, r]

    def run(steps: int) -> float:
        start = time.perf_counter()
        loss = None
        for i in range(steps):
            state[0], state[1], state[2], loss = step(*state, data[i % 2])
        jax.block_until_ready(loss)
        return time.perf_counter() - start

    run(2)  # compile and warm up
    return run


def main(argv: Sequence[str] | None = None) -> dict[tuple[int, int, int], list[float]]:
    """Time each layout at each batch; returns seconds per trial-step of every round, by
    (devices per trial, trials at once, global batch)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_data_parallel",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("swinir", "vit", "digits"), default="swinir",
                   help="smoke SwinIR, smoke ViT or the MLP of examples/digits.py (default swinir)")
    p.add_argument("--config", choices=("largest", "smallest"), default="largest",
                   help="the space's largest configuration or its smallest (first grid values; "
                   "default largest)")
    p.add_argument("--params", type=json.loads, default=None,
                   help='a configuration as JSON, e.g. \'{"width": 256, "depth": 2, '
                   '"learning_rate": 0.01}\' (the digits space names no largest)')
    p.add_argument("--batch", default="16",
                   help="global batch of every run, or several (``8,16,32``): each layout at each "
                   "batch, interleaved, with milliseconds per sample to compare them (default 16)")
    p.add_argument("--counts", default="1,2,4",
                   help="layouts to compare: ``n`` (one trial on n devices) or ``nxk`` (k trials "
                   "at once, each on its own n devices; default 1,2,4)")
    p.add_argument("--steps", type=positive_int, default=10, help="steps per timing (default 10)")
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (default 3)")
    args = p.parse_args(argv)
    layouts = [tuple(int(x) for x in (c + "x1").split("x")[:2]) for c in args.counts.split(",")]
    batches = [positive_int(b) for b in args.batch.split(",")]

    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(max(CPU_DEVICES, *(n * k for n, k in layouts)))
    if args.family == "digits":
        from benchmarks.overhead import _space_and_task

        space, task = _space_and_task("digits")
    else:
        get_config: Callable[[str], HPOConfig]  # swinir_hpo's takes a platform too
        if args.family == "swinir":
            from experiments.swinir_hpo import get_config, make_space_and_task
        else:
            from experiments.vit_synthetic import get_config, make_space_and_task
        space, task = make_space_and_task(get_config("smoke"))
    import jax
    from flax import nnx

    from scamp_jax.hpo.runner import make_optimizer
    from scamp_jax.planning.memory import with_batch_size
    from scamp_jax.planning.train_step import step_flops

    params = args.params or dict(space.largest) if args.config == "largest" else {
        k: v[0] for k, v in space.grid.items()}
    devices = jax.devices()
    runs = {(n, k, b): [_trial(space, task, params, devices[i * n:(i + 1) * n], b)
                        for i in range(k)] for b in batches for n, k in layouts}
    times: dict[tuple[int, int, int], list[float]] = {key: [] for key in runs}
    cpu: dict[tuple[int, int, int], list[float]] = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key in runs:
            threads = [threading.Thread(target=run, args=(args.steps,)) for run in runs[key]]
            start, cpu0 = time.perf_counter(), time.process_time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # seconds per trial-step: k trials made k * steps steps in this time
            k = key[1]
            times[key].append((time.perf_counter() - start) / (k * args.steps))
            cpu[key].append((time.process_time() - cpu0) / (k * args.steps))
    print(f"{args.family} {args.config} {params}, "
          f"{args.rounds} interleaved rounds of {args.steps} steps per trial")
    n0, k0 = layouts[0]
    for b in batches:
        flops = step_flops(nnx.eval_shape(lambda: space.build(params, nnx.Rngs(0))),
                           make_optimizer(params), task.loss_fn,
                           with_batch_size(task.sample_batch(1), b))
        base = statistics.median(times[n0, k0, b])
        print(f" global batch {b} ({(flops or 0) / 1e9:.3g} GFLOP per step)")
        for n, k in layouts:
            med = statistics.median(times[n, k, b])
            print(f"  {k} trial(s) at once on {n} device(s) each: {1000 * med:7.1f} ms per "
                  f"trial-step, {1000 * med / b:6.2f} ms per sample (rounds: "
                  f"{', '.join(f'{1000 * t:.0f}' for t in times[n, k, b])}; CPU "
                  f"{1000 * statistics.median(cpu[n, k, b]):.0f} ms); throughput over "
                  f"{k0}x{n0}: {base / med:.2f}x")
    return times


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
