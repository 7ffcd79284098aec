"""What one training step costs: XLA's own figures, fitted per architecture for the simulator.

`measure_cost` compiles a candidate's training step (the engine's `scamp_jax.planning.train_step`,
with the planner's shardings, through `scamp_jax.planning.memory.StepCompiler`) at two per-device
batches and fits a `scamp_jax.sim.simulator.StepCostModel`: FLOPs and bytes accessed from
``cost_analysis()``, kernels and model-parallel collective bytes from the HLO
(`hlo_kernels_and_collectives`), memory from the
planner's `MemoryModel`. `fixed_baseline` gives the fixed-resources baseline's devices and batch.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

from scamp_jax.planning.budget import Budget
from scamp_jax.sim.simulator import ClusterModel, StepCostModel

_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\(?[^=]*?\)?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|"
    r"collective-permute|all-to-all)(?:-start)?\("
)
_ARRAY = re.compile(r"(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}
_NOT_KERNELS = ("parameter", "constant", "bitcast", "tuple", "get-tuple-element", "partition-id",
                "replica-id", "after-all")


def _array_bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        bits = _BITS.get(dtype, int(dtype[1:]) if dtype[1:].isdigit() else 32)
        count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += count * bits // 8
    return total


def hlo_kernels_and_collectives(hlo_text: str, group: int) -> tuple[int, float]:
    """Kernels in the entry computation and bytes each device sends in its collectives.

    ``group`` is the number of devices in each collective (the model-parallel degree). Ring
    algorithms send ``2 (g - 1) / g`` of an all-reduce buffer, ``(g - 1) / g`` of an all-gather
    result or all-to-all buffer, ``g - 1`` times a reduce-scatter result, and a permuted buffer
    once.
    """
    start = hlo_text.find("ENTRY")
    entry = hlo_text[start:]
    end = entry.find("\n}")
    body = entry[: end if end >= 0 else len(entry)].splitlines()[1:]
    kernels = 0
    sent = 0.0
    g = max(1, group)
    for line in body:
        if "=" not in line:
            continue
        op_match = re.search(r"\s([a-z][a-z0-9\-]*)\(", line.split("=", 1)[1])
        op = op_match.group(1) if op_match else ""
        if op in _NOT_KERNELS:
            continue
        kernels += 1
        collective = _COLLECTIVE.search(line)
        if collective is None or g == 1:
            continue
        nbytes = _array_bytes(collective.group("shape"))
        kind = collective.group("op")
        factor = {
            "all-reduce": 2.0 * (g - 1) / g,
            "all-gather": (g - 1) / g,
            "all-to-all": (g - 1) / g,
            "reduce-scatter": float(g - 1),
            "collective-permute": 1.0,
        }[kind]
        sent += factor * nbytes
    return kernels, sent


def measure_cost(
    model: Any,
    sample_batch: Any,
    *,
    optimizer: Any,
    loss_fn: Callable[..., Any],
    model_parallel: int,
    batches: tuple[int, int] = (2, 8),
    eval_task: Any = None,
) -> tuple[StepCostModel, float]:
    """Cost one architecture: the planner's memory model plus compiled XLA costs of its step.

    Memory is the planner's own: `scamp_jax.planning.memory.StepCompiler` compiles the step (the
    same `scamp_jax.planning.train_step` the engine runs, with the planner's shardings and compile
    options) at the two probe batches and a check at four times the larger one, and
    ``StepCompiler.fit`` returns the `MemoryModel` (affine part and floor) that `plan_mesh` reasons
    with. The FLOPs, bytes accessed, kernels and model-parallel collectives come from
    ``cost_analysis()`` and the HLO of the same compiled executables (JAX caches a compile of an
    identical lowering, so these cost no further compile).

    Args:
      model: abstract Flax NNX module (``nnx.eval_shape(lambda: build(...))``).
      sample_batch: ``(inputs, targets)`` ``ShapeDtypeStruct``s with a leading batch axis.
      optimizer, loss_fn: what the engine trains with.
      model_parallel: devices of the ``1 x model_parallel`` mesh.
      batches: the two per-device probe batch sizes (global = per-device on this mesh).
      eval_task: the task whose chunked evaluation the engine plans
        (`scamp_jax.planning.evaluation.ChunkedEvalTask`); its forward is compiled at one sample
        on the same mesh (`StepCostModel.eval_peak`). None, or a task without it: not planned.
    Returns:
      The fitted `StepCostModel` and the wall-clock seconds the compiles took.
    """
    import jax

    from scamp_jax.planning import sharding as sh
    from scamp_jax.planning.evaluation import EvalCompiler, abstract_eval_inputs
    from scamp_jax.planning.memory import StepCompiler, with_batch_size

    mesh = sh.make_mesh(jax.devices()[:model_parallel], 1, model_parallel)
    compiler = StepCompiler(model, sample_batch, mesh, optimizer=optimizer, loss_fn=loss_fn)
    b1, b2 = sorted(batches)
    start = time.perf_counter()
    memory, _ = compiler.fit((b1, b2), verify_batch=4 * b2)
    rows = []
    for b in (b1, b2):
        # The very executable ``fit`` compiled (same jitted step, lowering and options).
        lowered = compiler._step.lower(compiler.params, compiler.opt_state, compiler.rest,
                                       with_batch_size(sample_batch, b))
        compiled = lowered.compile(compiler.compiler_options)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        text = compiled.as_text()
        # XLA gives both on CPU, GPU and TPU (`sim_fusion.measure_fused_costs` checks it)
        assert cost is not None and text is not None
        kernels, comm = hlo_kernels_and_collectives(text, model_parallel)
        rows.append((float(cost["flops"]), float(cost["bytes accessed"]), comm, kernels))
    prefetch_per_sample = sh.bytes_per_device(with_batch_size(sample_batch, 1),
                                              compiler.shardings.batch)
    eval_peak = 0
    groups = abstract_eval_inputs(eval_task) if eval_task is not None else None
    if groups:
        evaluator = EvalCompiler(compiler.graphdef, eval_task.eval_forward, compiler.params,
                                 compiler.rest, compiler.shardings.params,
                                 compiler.shardings.rest, mesh)
        eval_peak = evaluator.peak(1, groups)
    seconds = time.perf_counter() - start
    (f1, m1, c1, k1), (f2, m2, c2, _) = rows

    def fit(y1: float, y2: float) -> tuple[float, float]:
        slope = max(0.0, (y2 - y1) / (b2 - b1))
        return max(0.0, y1 - slope * b1), slope

    flops = fit(f1, f2)
    traffic = fit(m1, m2)
    mp_comm = fit(c1, c2)
    cost_model = StepCostModel(
        model_parallel=model_parallel,
        flops_fixed=flops[0], flops_per_sample=flops[1],
        bytes_fixed=traffic[0], bytes_per_sample=traffic[1],
        gradient_bytes=float(compiler.params_bytes),
        mp_comm_fixed=mp_comm[0], mp_comm_per_sample=mp_comm[1],
        kernels_per_step=k1,
        memory_fixed=memory.fixed_bytes, memory_per_sample=memory.bytes_per_sample,
        memory_floor=memory.floor_bytes,
        prefetch_per_sample=float(prefetch_per_sample), eval_peak=float(eval_peak),
        opt_state_bytes=float(compiler.opt_state_bytes),
    )
    return cost_model, seconds


def plan_point(
    model: Any,
    sample_batch: Any,
    cost: StepCostModel,
    *,
    optimizer: Any,
    loss_fn: Callable[..., Any],
    memory_per_device: int,
    safety_margin: float,
    max_batch_size: int | None,
    batch_multiple: int = 1,
    eval_task: Any = None,
) -> StepCostModel:
    """``cost`` with the planner's answer for one budget added to `StepCostModel.plans`.

    `scamp_jax.planning.planner.plan_mesh` plans the architecture on ``cost.model_parallel``
    CPU devices with the cluster's ``memory_per_device``, ``safety_margin``, batch cap, batch
    multiple and evaluation, as the engine's planning service does; the trial books
    `scamp_jax.scheduling.booking.booked_bytes` of that plan, the engine's figure.
    """
    import jax

    from scamp_jax.planning.budget import standing_in_for_another_device
    from scamp_jax.planning.planner import plan_mesh
    from scamp_jax.scheduling.booking import booked_bytes

    usable = Budget(memory_per_device, safety_margin).usable_bytes
    if cost.planned(usable, max_batch_size, batch_multiple) is not None:
        return cost
    with standing_in_for_another_device():  # the cluster's memory, not this host's
        plan = plan_mesh(model, sample_batch, devices=jax.devices()[:cost.model_parallel],
                         memory_per_device=memory_per_device, optimizer=optimizer,
                         loss_fn=loss_fn, safety_margin=safety_margin,
                         max_batch_size=max_batch_size, model_parallel=cost.model_parallel,
                         eval_task=eval_task, batch_multiple=batch_multiple)
    point = (usable, max_batch_size or 0, batch_multiple, int(plan.batch_size),
             booked_bytes(plan))
    return dataclasses.replace(cost, plans=(*cost.plans, point))


def fixed_baseline(
    largest: StepCostModel,
    cluster: ClusterModel,
    *,
    fixed_devices: int | None,
    max_batch_size: int | None,
    safety_margin: float = 0.1,
) -> tuple[int, int]:
    """The fixed baseline's ``(devices per trial, global batch)``: the largest candidate's
    model-parallel degree (or ``fixed_devices``, a multiple of it) and the largest batch that
    candidate fits there within ``(1 - safety_margin)`` of device memory, capped by
    ``max_batch_size`` and a multiple of the device count (every candidate splits it over its
    data-parallel replicas)."""
    usable = cluster.budget(safety_margin).plan_bytes  # less the allowance, as the engine's plans
    k = fixed_devices if fixed_devices is not None else largest.model_parallel
    if k % largest.model_parallel:
        raise ValueError(f"--fixed-devices {k} must be a multiple of the largest candidate's "
                         f"model-parallel degree {largest.model_parallel}")
    batch = largest.max_local_batch(usable) * (k // largest.model_parallel)
    if max_batch_size is not None:
        batch = min(batch, max_batch_size)
    batch -= batch % k
    if batch < k:
        raise ValueError(f"the largest candidate leaves no batch that is a multiple of {k}")
    return k, batch
