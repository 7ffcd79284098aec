"""What planning a new architecture costs: CPU seconds and XLA compiles of one ``plan_mesh``.

Plans one model of `benchmarks.memory_accuracy` in this (fresh) process, as the engine plans a
trial's architecture, then makes a run's initial state on the plan (`InitialStates`, as a
trial's first run of the architecture does), and prints one JSON line: the plan (mesh, batch,
compiled peak), the CPU seconds of all threads (``time.process_time``: what it would take with
a core to itself, the figure to compare on a shared machine), the wall seconds, and the
compiles by function name (JAX's compile events,
`scamp_jax.planning.compile_events.CompileCounter`), each for the plan and for the initial
state (``init_*``). Only public
``plan_mesh`` arguments are used, so the same file measures another checkout::

    python -m benchmarks.compiles --case swinir                     # 8 CPU devices, 64 MiB
    python -m benchmarks.compiles --case swinir --planning-only     # no run-grade answer
    python -m benchmarks.compiles --case swinir --save-softmax-output   # the search space's
    python -m benchmarks.compiles --case swinir_paper --devices 1 --memory-per-device 32GiB
    PYTHONPATH=../other python ../this/benchmarks/compiles.py --case swinir   # another tree

On a GPU the same command shows what planning costs with XLA's autotuner off.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def measure(case_name: str, devices: int | None, budget: str | None,
            planning_only: bool, save_softmax_output: bool = False) -> dict[str, Any]:
    """Plan ``case_name`` once (``planning_only``: ``compile_for_run=False``;
    ``save_softmax_output``: the search spaces' attention softmax, not the case's reference
    program, `benchmarks.memory_accuracy.Case`); see the module doc for the figures."""
    import jax
    from flax import nnx

    from benchmarks.memory_accuracy import BY_NAME
    from scamp_jax.planning.compile_events import CompileCounter
    from scamp_jax.planning.initial_state import InitialStates
    from scamp_jax.planning.planner import plan_mesh
    from scamp_jax.planning.train_step import default_optimizer

    case = BY_NAME[case_name]
    # one argument unless asked: a checkout before `Case.build` took the rule measures too
    model = nnx.eval_shape(lambda: case.build(nnx.Rngs(0), True) if save_softmax_output
                           else case.build(nnx.Rngs(0)))
    sample = case.sample()
    n = devices or len(jax.devices())
    wall, cpu = time.perf_counter(), time.process_time()
    with CompileCounter() as count:
        plan = plan_mesh(model, sample, devices=n, memory_per_device=budget or case.budget,
                         compile_for_run=not planning_only)
    plan_cpu, plan_wall = time.process_time() - cpu, time.perf_counter() - wall
    wall, cpu = time.perf_counter(), time.process_time()
    with CompileCounter() as init_count:
        state = InitialStates().make(case_name, case.build, default_optimizer(),
                                     plan.step_shardings, 0, {})
        jax.block_until_ready(state)
    return {
        "case": case_name, "platform": jax.devices()[0].platform, "devices": n,
        "planning_only": planning_only, "save_softmax_output": save_softmax_output,
        "mesh": f"{plan.data_parallel}x{plan.model_parallel}",
        "batch": plan.batch_size, "peak_bytes": plan.peak_bytes_per_device,
        "cpu_s": round(plan_cpu, 3), "wall_s": round(plan_wall, 3),
        "compiles": dict(count.compiles), "plan_compiles": plan.compiles,
        "run_grade_step": plan.compiled_step is not None,
        "init_cpu_s": round(time.process_time() - cpu, 3),
        "init_wall_s": round(time.perf_counter() - wall, 3),
        "init_compiles": dict(init_count.compiles),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compiles", description=__doc__.splitlines()[0])
    from benchmarks.memory_accuracy import BY_NAME
    from experiments._cli import positive_int

    parser.add_argument("--case", default="swinir", choices=list(BY_NAME),
                        help="a model of benchmarks.memory_accuracy (default swinir)")
    parser.add_argument("--devices", type=positive_int, default=None,
                        help="devices to plan on (default: all; on CPU the host is split into 8)")
    parser.add_argument("--memory-per-device", default=None,
                        help="budget per device (default: the case's)")
    parser.add_argument("--planning-only", action="store_true",
                        help="compile_for_run=False: no run-grade answer")
    parser.add_argument("--save-softmax-output", action="store_true",
                        help="the attention softmax of the search spaces' models (keeps its "
                        "output only), not the case's reference program (JAX's default)")
    args = parser.parse_args(argv)
    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(8)
    print(json.dumps(measure(args.case, args.devices, args.memory_per_device,
                             args.planning_only, args.save_softmax_output)))


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
