"""Evaluation memory: the held-out set in one batch versus the planned chunk, small SwinIR.

Run: ``python -m benchmarks.eval_memory`` (CPU; about a minute on two cores). Plans the small
space's largest SwinIR on one device with the experiment's budget and batch cap
(``--memory-per-device 1GiB --max-batch-size 8``), with evaluation planned, and prints per-device
bytes: the training step, the prefetched batch, the evaluation forward on the whole held-out set
in one batch (what evaluation held before it was planned, beside the optimizer state and the
prefetched batch) and at the planned chunk, and the usable bytes. ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jax
from flax import nnx

from scamp_jax._units import format_bytes, parse_bytes
from scamp_jax.hpo.runner import make_optimizer
from scamp_jax.planning import planner
from scamp_jax.planning.evaluation import EvalCompiler, abstract_eval_inputs
from scamp_jax.planning.train_step import abstract_state
from search_spaces import swinir
from search_spaces.sr_task import SRTask


def measure(memory_per_device: int, max_batch_size: int, eval_size: int) -> dict[str, Any]:
    """Per-device bytes of training and evaluation for the small space's largest SwinIR."""
    space = swinir.space("small")
    task = SRTask(scale=2, eval_size=eval_size)
    model = nnx.eval_shape(lambda: space.build(space.largest, nnx.Rngs(0)))
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                             memory_per_device=memory_per_device, optimizer=make_optimizer({}),
                             loss_fn=task.loss_fn, max_batch_size=max_batch_size, eval_task=task)
    optimizer = make_optimizer({})
    params, _, rest = abstract_state(model, optimizer)
    graphdef = nnx.split(model)[0]
    groups = abstract_eval_inputs(task)
    assert groups is not None  # SRTask has chunked evaluation
    evaluator = EvalCompiler(graphdef, task.eval_forward, params, rest,
                             plan.step_shardings.params, plan.step_shardings.rest, plan.mesh)
    whole = max(g.shape[0] for g in groups)
    return {
        "eval_images": sum(g.shape[0] for g in groups),
        "eval_lr_shape": list(groups[0].shape[1:]),
        "batch_size": plan.batch_size,
        "train_step_bytes": plan.peak_bytes_per_device,
        "prefetch_bytes": plan.prefetch_bytes,
        "optimizer_state_bytes": plan.estimate.opt_state,
        "eval_whole_set_peak_bytes": evaluator.peak(whole, groups),
        "eval_chunk": plan.eval_chunk,
        "eval_chunk_peak_bytes": plan.eval_peak_bytes,
        "eval_bytes": plan.eval_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "usable_bytes": plan.usable_bytes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.eval_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--memory-per-device", default="1GiB",
                        help="budget per device of the plans (default 1GiB)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="cap of each plan's training batch (default 8)")
    parser.add_argument("--eval-size", type=int, default=128,
                        help="HR side of the held-out centre crops (SRTask's default)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    from scamp_jax.devices import configure_device_memory

    configure_device_memory()  # before JAX starts: the allocator policy (one preallocated pool)
    row = measure(parse_bytes(args.memory_per_device), args.max_batch_size, args.eval_size)
    if args.json:
        print(json.dumps(row))
        return
    for key, value in row.items():
        shown = format_bytes(value) if key.endswith("bytes") else value
        print(f"{key:<28} {shown}")


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
