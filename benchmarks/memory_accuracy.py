"""Memory prediction accuracy and planning time, per model.

Run: ``python -m benchmarks.memory_accuracy`` (CPU: 8 virtual devices; about four minutes on two
cores). For each registered model it plans training with ``plan_mesh`` and prints:

- ``planned``: the planner's figure (compiled by the planner at the plan's batch);
- ``compiled``: an independent compile of the same step with default XLA options;
- errors of both against ``compiled``, the planning time of a new plan (wall-clock and CPU
  seconds, all threads) and its compiles (counted from JAX's compile events), and the same for
  the cached plan (a fresh ``PlanCache`` on the file the first plan wrote, as a resumed study),
  and of the same new plan keeping the runner's step (``compile_for_run=True``, the default
  since the runner takes it: it then compiles nothing); the first plan is planning only
  (``compile_for_run=False``);
- on a GPU, ``measured``: ``peak_bytes_in_use`` after two real training steps, each model in a
  fresh process (the allocator's peak counter cannot be reset), its state built directly on the
  plan's shardings (`measure_real_step`).

With ``--fuse K`` it also sizes a fused group of up to ``K`` members on the plan, each member at
``1/K`` of the plan's batch (so the group holds about the samples the solo plan fits), as the
engine's ``--fuse`` does at the study's batch (``plan_fusion``): CPU seconds and fused compiles
new, and again from a fresh ``PlanCache`` on the same file.

Flags: ``--memory-per-device 64MiB`` (default: each model's own budget), ``--devices 8``,
``--only mlp,transformer``, ``--fuse 4``, ``--markdown`` (a table for BENCHMARKS.md).
Adding a model is one ``CASES`` entry.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._tables import pct_text


@dataclass(frozen=True)
class Case:
    """A model to measure: ``build(rngs) -> nnx.Module``, a per-sample batch, a default budget.

    The cases are fixed programs, compared with GPU runs recorded earlier: their attention
    softmax takes JAX's default derivative (``save_softmax_output=False``, the program the H200
    of 2026-11-27 compiled), while the search spaces' models keep only the softmax's output
    (`search_spaces.softmax`); ``build(rngs, save_softmax_output=True)`` builds the search
    spaces' program, and a case with ``softmax_output`` (``swinir_small_so``: the small
    space's largest SwinIR as the space trains it) builds it unless told otherwise.
    """

    name: str
    make: Callable[[Any], Any]
    sample: Callable[[], Any]  # -> ShapeDtypeStruct tree with leading axis 1
    budget: str
    #: the rule ``build`` takes when not told: False (JAX's default) but for the cases that
    #: measure the search spaces' program
    softmax_output: bool = False

    def build(self, rngs: Any, save_softmax_output: bool | None = None) -> Any:
        if save_softmax_output is None:
            save_softmax_output = self.softmax_output
        model = self.make(rngs)
        # the MLP and the transformer (flax's attention, JAX's default rule) have no such
        # attribute: one program each
        model.set_attributes(save_softmax_output=save_softmax_output, raise_if_not_found=False)
        return model


def _mlp(rngs: Any) -> Any:
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, d: int, h: int, depth: int, rngs: nnx.Rngs) -> None:
            self.inp = nnx.Linear(d, h, rngs=rngs)
            self.hidden = nnx.List([nnx.Linear(h, h, rngs=rngs) for _ in range(depth)])
            self.out = nnx.Linear(h, d, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            x = nnx.gelu(self.inp(x))
            for layer in self.hidden:
                x = nnx.gelu(layer(x))
            return self.out(x)

    return MLP(256, 1024, 2, rngs)


def _transformer(rngs: Any) -> Any:
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, dim: int, heads: int, rngs: nnx.Rngs) -> None:
            self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
            self.fc1 = nnx.Linear(dim, 4 * dim, rngs=rngs)
            self.fc2 = nnx.Linear(4 * dim, dim, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            x = x + self.attn(self.norm1(x))
            return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))

    class Transformer(nnx.Module):
        def __init__(self, dim: int, heads: int, depth: int, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Linear(32, dim, rngs=rngs)
            self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(depth)])
            self.head = nnx.Linear(dim, 32, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Transformer(128, 4, 2, rngs)


def _swinir(rngs: Any) -> Any:
    from search_spaces.swinir import SwinIR

    return SwinIR(img_size=32, embed_dim=24, depths=(2, 2), num_heads=(2, 2), window_size=8,
                  upsampler="pixelshuffledirect", rngs=rngs)


def _vit(rngs: Any) -> Any:
    from search_spaces.vit import ViT

    return ViT(image_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=4, rngs=rngs)


def _shape(*shape: int) -> Callable[[], Any]:
    def make() -> Any:
        import jax
        import jax.numpy as jnp

        return jax.ShapeDtypeStruct(shape, jnp.float32)

    return make


#: The largest model of the small SwinIR space (the smoke study's), LR patches of 24 pixels.
SWINIR_SMALL = {"embed_dim": 48, "num_groups": 2, "group_depth": 2, "num_heads": 4,
                "window_size": 8, "mlp_ratio": 2.0}
#: Classical SwinIR x2 of the paper (180 wide, 6 groups of 6 blocks), LR patches of 64 pixels.
SWINIR_PAPER = {"embed_dim": 180, "num_groups": 6, "group_depth": 6, "num_heads": 6,
                "window_size": 8, "mlp_ratio": 2.0}


def _swinir_small(rngs: Any) -> Any:
    from search_spaces import swinir

    return swinir.space("small").build(SWINIR_SMALL, rngs)


def _swinir_paper(rngs: Any) -> Any:
    from search_spaces import swinir

    return swinir.space("paper", hr_patch=128).build(SWINIR_PAPER, rngs)


CASES: tuple[Case, ...] = (
    Case("mlp", _mlp, _shape(1, 256), "8MiB"),
    Case("transformer", _transformer, _shape(1, 64, 32), "32MiB"),
    Case("swinir", _swinir, _shape(1, 32, 32, 3), "64MiB"),
    Case("vit", _vit, _shape(1, 32, 32, 3), "32MiB"),
)
#: Measured only when named (``--only``, `benchmarks.gpu_suite`): too slow for the default table.
EXTRA_CASES: tuple[Case, ...] = (
    Case("swinir_small", _swinir_small, _shape(1, 24, 24, 3), "256MiB"),
    Case("swinir_paper", _swinir_paper, _shape(1, 64, 64, 3), "8GiB"),
    # the same model as the search space trains it: its attention softmax keeps its output only
    Case("swinir_small_so", _swinir_small, _shape(1, 24, 24, 3), "256MiB", softmax_output=True),
)
BY_NAME = {c.name: c for c in CASES + EXTRA_CASES}
#: The planner's safety margin of ``--child`` (and of the table's plans).
CHILD_SAFETY_MARGIN = 0.1


def _peak(stats: Any) -> int:
    return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes
               + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def measure(case: Case, devices: int, budget: str | None, fuse: int | None = None,
            ) -> dict[str, Any]:
    """Plan ``case`` and compare the predictions with compiled (and on GPU measured) memory;
    with ``fuse``, also size a fused group of up to ``fuse`` members, new and cached."""
    import jax
    from flax import nnx

    from scamp_jax.planning.compile_events import CompileCounter
    from scamp_jax.planning.plan_cache import PlanCache
    from scamp_jax.planning.planner import plan_mesh
    from scamp_jax.planning.train_step import (
        abstract_state,
        default_loss,
        default_optimizer,
        jit_train_step,
        split_model,
    )

    model = nnx.eval_shape(lambda: case.build(nnx.Rngs(0)))
    sample = case.sample()
    n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    cache_dir = tempfile.mkdtemp(prefix="plan_cache_")
    start, cpu_start = time.perf_counter(), time.process_time()
    with CompileCounter() as cold_count:
        plan = plan_mesh(model, sample, devices=devices, memory_per_device=budget or case.budget,
                         cache=PlanCache(Path(cache_dir) / "plans.sqlite"),
                         compile_for_run=False)
    plan_seconds = time.perf_counter() - start
    # CPU seconds used by this process (all threads): the wall time it would take with a core
    # to itself (XLA compiles one program on one thread), useful when the machine is shared.
    plan_cpu_seconds = time.process_time() - cpu_start
    start, cpu_start = time.perf_counter(), time.process_time()
    with CompileCounter() as cached_count:
        cached = plan_mesh(model, sample, devices=devices,
                           memory_per_device=budget or case.budget,
                           cache=PlanCache(Path(cache_dir) / "plans.sqlite"))
    cached_seconds = time.perf_counter() - start
    cached_cpu_seconds = time.process_time() - cpu_start
    fused = _measure_fused(model, sample, plan, fuse, Path(cache_dir)) if fuse else {}
    shutil.rmtree(cache_dir)
    if not cached.cached or cached != plan:
        raise RuntimeError(f"{case.name}: the cached plan differs from the one just stored")
    # The same new plan keeping the runner's step (compile_for_run): what planning costs when
    # the runner then compiles nothing.
    cpu_start = time.process_time()
    with CompileCounter() as ready_count:
        ready = plan_mesh(model, sample, devices=devices, memory_per_device=budget or case.budget,
                          compile_for_run=True)
    ready_cpu_seconds = time.process_time() - cpu_start
    if ready.compiled_step is None or ready.batch_size != plan.batch_size:
        raise RuntimeError(f"{case.name}: the plan for the runner differs from the plan")

    tx = default_optimizer()
    graphdef, _, _ = split_model(model)
    params, opt_state, rest = abstract_state(model, tx)
    step = jit_train_step(graphdef, tx, default_loss, plan.step_shardings)
    batch = jax.ShapeDtypeStruct((plan.batch_size, *sample.shape[1:]), sample.dtype)
    compiled = _peak(step.lower(params, opt_state, rest, batch).compile().memory_analysis())
    return {
        "model": case.name,
        "params": n_params,
        "mesh": f"{plan.data_parallel}x{plan.model_parallel}",
        "batch": plan.batch_size,
        "budget": plan.memory_per_device,
        "planned": plan.peak_bytes_per_device,
        "compiled": compiled,
        "plan_seconds": plan_seconds,
        "plan_cpu_seconds": plan_cpu_seconds,
        "compiles": cold_count.compiles["jit(step)"],
        "cached_seconds": cached_seconds,
        "cached_cpu_seconds": cached_cpu_seconds,
        "cached_compiles": cached_count.compiles["jit(step)"],
        "ready_cpu_seconds": ready_cpu_seconds,
        "ready_compiles": ready_count.compiles["jit(step)"],
        "seconds_per_compile": plan_seconds / max(plan.compiles, 1),
        **fused,
    }


def _measure_fused(model: Any, sample: Any, plan: Any, fuse: int,
                   cache_dir: Path) -> dict[str, Any]:
    """A fused group of up to ``fuse`` members on ``plan`` at ``1/fuse`` of its batch: new,
    then cached."""
    from scamp_jax.planning.fusion import plan_fusion
    from scamp_jax.planning.plan_cache import PlanCache
    from scamp_jax.planning.train_step import default_optimizer

    dp = plan.data_parallel
    batch = max(dp, plan.batch_size // fuse // dp * dp)
    row: dict[str, Any] = {"fused_batch": batch}
    for kind in ("fused", "fused_cached"):
        cpu_start = time.process_time()
        group = plan_fusion(model, sample, max_width=fuse, plan=plan,
                            batch_size=batch, optimizer=default_optimizer(),
                            cache=PlanCache(cache_dir / "plans.sqlite"))
        row[f"{kind}_cpu_seconds"] = time.process_time() - cpu_start
        row[f"{kind}_compiles"] = group.compiles
        row[f"{kind}_width"] = group.width
    if row["fused_cached_compiles"] or row["fused_cached_width"] != row["fused_width"]:
        raise RuntimeError("the cached fused plan compiled or differs from the one just stored")
    return row


#: JAX's GPU client reads the allocator's kind from it (``bfc`` by default; ``platform``,
#: ``cuda_async``, ...): part of an allocator policy.
ALLOCATOR_VAR = "XLA_PYTHON_CLIENT_ALLOCATOR"
#: The phases of a measured run after which the allocator's statistics are read.
PHASES = ("init", "compile", "step 1", "step 2")


def measure_real_step(case: Case, devices: int, budget: str | None, *,
                      batch: int | None = None, safety_margin: float = 0.1, fuse: int = 0,
                      cache: str | None = None) -> dict[str, Any]:
    """Two real training steps of ``case`` on its plan's devices, in this process.

    Plans ``case`` (with ``safety_margin``; ``budget`` None: the case's own budget on CPU, the
    allocator's limit ``bytes_limit`` on a GPU; ``cache``: a plan-cache file, so repeated runs
    plan without compiling), builds the state directly on the plan's shardings
    (`scamp_jax.planning.initial_state.init_train_state`: no device holds an unsharded copy),
    compiles the step once, and runs two steps at ``batch`` (default: the plan's), placing the
    next batch on the devices before the second as a trial prefetches it. With ``fuse=K`` the
    same for a fused group sized by `plan_fusion` (the widest group up to ``K`` members, then the
    largest per-member batch; ``batch``: per member).

    Returns a JSON-ready dict: ``batch`` (per member when fused), ``width``, ``plan_batch``,
    ``budget`` (bytes the plan was made for), ``planned`` (the planner's compiled peak per
    device at its batch, bytes), ``booked`` (what the scheduler books per device for the plan,
    bytes: `Plan.predicted_peak_bytes`, with ``allowance`` bytes for memory XLA does not see),
    ``compiled`` (the peak of the step that ran, from
    ``memory_analysis``, bytes), ``peak_in_use`` (the largest ``peak_bytes_in_use`` over the
    devices after the steps, bytes, or None where devices report none, as on CPU),
    ``bytes_limit`` (None likewise), ``phases`` (`scamp_jax.devices.allocator_stats` of the first
    device after each of `PHASES`, None on CPU), ``allocator_env`` (the allocator's variables as
    this process saw them) and ``oom`` (the run ran out of memory, in ``oom_phase``; the
    measured fields are then None).
    """
    import os

    import jax
    import numpy as np
    from flax import nnx

    from scamp_jax import devices as _devices
    from scamp_jax.planning.initial_state import InitialStates, init_train_state
    from scamp_jax.planning.plan_cache import PlanCache
    from scamp_jax.planning.planner import plan_mesh
    from scamp_jax.planning.train_step import default_loss, default_optimizer, split_model

    sample = case.sample()
    abstract = nnx.eval_shape(lambda: case.build(nnx.Rngs(0)))
    stats_device = jax.devices()[0]
    on_cpu = stats_device.platform == "cpu"
    plan = plan_mesh(abstract, sample, devices=devices,
                     memory_per_device=budget or (case.budget if on_cpu else None),
                     safety_margin=safety_margin, cache=PlanCache(cache) if cache else None)
    tx = default_optimizer()
    names = (_devices.PREALLOCATE_VAR, _devices.MEM_FRACTION_VAR, _devices.OLD_MEM_FRACTION_VAR,
             ALLOCATOR_VAR)
    row: dict[str, Any] = {"model": case.name, "plan_batch": plan.batch_size, "width": 1,
                           "data_parallel": plan.data_parallel,
                           "planned": plan.peak_bytes_per_device,
                           "booked": plan.predicted_peak_bytes,
                           "allowance": plan.allowance_bytes,
                           "budget": plan.memory_per_device, "safety_margin": safety_margin,
                           "allocator_env": {n: os.environ.get(n) for n in names}}
    phases: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    if fuse:
        from scamp_jax.planning.fusion import jit_fused_step, plan_fusion, stack_shardings

        group = plan_fusion(abstract, sample, max_width=fuse, plan=plan, optimizer=tx,
                            cache=PlanCache(cache) if cache else None)
        width, size = group.width, batch or group.batch_size
        row.update(width=width, plan_batch=group.batch_size, planned=group.peak_bytes_per_device,
                   booked=group.predicted_peak_bytes)
        step = jit_fused_step(split_model(abstract)[0], tx, default_loss, plan.step_shardings)
        x = rng.normal(size=(width, size, *sample.shape[1:])).astype(sample.dtype)
        batch_sharding = stack_shardings(plan.step_shardings).batch
        active: tuple[np.ndarray, ...] = (np.ones((width,), bool),)

        def init() -> tuple[Any, ...]:
            return InitialStates(home_on_cpu=False).make_group(
                case.name, case.build, tx, plan.step_shardings, list(range(width)), {})
    else:
        from scamp_jax.planning.train_step import jit_train_step

        size = batch or plan.batch_size
        step = jit_train_step(split_model(abstract)[0], tx, default_loss, plan.step_shardings)
        x = rng.normal(size=(size, *sample.shape[1:])).astype(sample.dtype)
        batch_sharding = plan.batch_sharding
        active = ()

        def init() -> tuple[Any, ...]:
            return init_train_state(lambda: case.build(nnx.Rngs(0)), tx,
                                    plan.step_shardings)[1:]

    dp = plan.data_parallel
    if size % dp:
        raise ValueError(f"batch {size} is not a multiple of the plan's data-parallel degree "
                         f"{dp}; use {-(-size // dp) * dp}")
    row["batch"] = size
    phase = PHASES[0]
    try:
        state = init()
        data = jax.device_put(x, batch_sharding)
        jax.block_until_ready((state, data))
        phases[phase] = _devices.allocator_stats(stats_device)
        phase = PHASES[1]
        compiled = step.lower(*state, data, *active).compile()
        phases[phase] = _devices.allocator_stats(stats_device)
        phase = PHASES[2]
        *state, loss = compiled(*state, data, *active)
        jax.block_until_ready(loss)
        phases[phase] = _devices.allocator_stats(stats_device)
        phase = PHASES[3]
        following = jax.device_put(x[::-1].copy(), batch_sharding)  # the prefetched batch
        *state, loss = compiled(*state, data, *active)
        jax.block_until_ready((loss, following))
        phases[phase] = _devices.allocator_stats(stats_device)
    except Exception as err:  # XlaRuntimeError; RESOURCE_EXHAUSTED is the one expected
        from scamp_jax.hpo.trial import is_oom_error  # the engine's reading of an error

        if not is_oom_error(err):
            raise
        return {**row, "oom": True, "oom_phase": phase, "phases": phases, "compiled": None,
                "peak_in_use": None, "bytes_limit": None,
                "error": str(err).splitlines()[0][:300]}
    stats = [_devices.allocator_stats(d) for d in plan.devices]
    measured = all(st and "peak_bytes_in_use" in st for st in stats)
    read = [st for st in stats if st]  # stats itself where measured (no None in it)
    # What the driver sees this process hold on its first device (context, pool, workspaces),
    # beside what the allocator holds: their difference is what no allocator statistic reports.
    first = stats[0] or {}
    driver = _devices.process_device_bytes(plan.devices[0].id) if measured else None
    pool = first.get("pool_bytes", first.get("bytes_reserved", first.get("bytes_in_use")))
    return {
        **row, "oom": False, "phases": phases if measured else None,
        "driver_bytes": driver,
        "outside_allocator_bytes": driver - int(pool) if driver is not None and pool else None,
        "compiled": _peak(compiled.memory_analysis()),
        "peak_in_use": max(st["peak_bytes_in_use"] for st in read) if measured else None,
        "bytes_limit": min(st["bytes_limit"] for st in read)
        if measured and all("bytes_limit" in st for st in read) else None,
    }


def measure_in_child(name: str, devices: int, budget: str | None, *, batch: int | None = None,
                     safety_margin: float = 0.1, fuse: int = 0, cache: str | None = None,
                     allocator_env: dict[str, str] | None = None,
                     timeout: float = 600) -> dict[str, Any]:
    """`measure_real_step` in a fresh process (the allocator's peak counter cannot be reset,
    and a run out of memory leaves its process in doubt).

    ``allocator_env``: the allocator's variables for that process
    (``XLA_PYTHON_CLIENT_PREALLOCATE``, ``XLA_CLIENT_MEM_FRACTION``, `ALLOCATOR_VAR`): with a
    mapping, the allocator variables of this process are dropped and exactly these set, so that
    any policy can be measured; None: inherited. The row's ``allocator_env`` says what the
    child saw. ``timeout``: seconds before the child is killed (`subprocess.TimeoutExpired`).
    """
    import os

    from scamp_jax.devices import MEM_FRACTION_VAR, OLD_MEM_FRACTION_VAR, PREALLOCATE_VAR

    cmd = [sys.executable, "-m", "benchmarks.memory_accuracy", "--child", name,
           "--devices", str(devices), "--safety-margin", str(safety_margin)]
    cmd += ["--memory-per-device", budget] if budget else []
    cmd += ["--batch", str(batch)] if batch else []
    cmd += ["--fuse", str(fuse)] if fuse else []
    cmd += ["--plan-cache", cache] if cache else []
    env = dict(os.environ)
    if allocator_env is not None:
        for var in (PREALLOCATE_VAR, MEM_FRACTION_VAR, OLD_MEM_FRACTION_VAR, ALLOCATOR_VAR):
            env.pop(var, None)
        env.update(allocator_env)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise RuntimeError(f"{name} child failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-1500:]}")
    return json.loads(lines[-1])


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    """The results as an aligned text table or a markdown table."""
    from scamp_jax._units import format_bytes

    head = ["model", "params", "mesh", "batch", "planned", "compiled", "planned err", "plan s",
            "plan cpu s", "compiles", "cached cpu s", "cached compiles", "run-ready cpu s",
            "run-ready compiles"]
    fused = all("fused_cpu_seconds" in r for r in rows)
    if fused:
        head += ["fused width x batch", "fused cpu s", "fused compiles", "fused cached cpu s",
                 "fused cached compiles"]
    gpu = any(r.get("measured") is not None for r in rows)
    if gpu:
        head += ["measured", "planned vs measured"]
    table = []
    for r in rows:
        line = [r["model"], f"{r['params']:,}", r["mesh"], str(r["batch"]),
                format_bytes(r["planned"]), format_bytes(r["compiled"]),
                pct_text(r["planned"], r["compiled"]), f"{r['plan_seconds']:.1f}",
                f"{r['plan_cpu_seconds']:.1f}", str(r["compiles"]),
                f"{r['cached_cpu_seconds']:.2f}", str(r["cached_compiles"]),
                f"{r['ready_cpu_seconds']:.1f}", str(r["ready_compiles"])]
        if fused:
            line += [f"{r['fused_width']} x {r['fused_batch']}", f"{r['fused_cpu_seconds']:.1f}",
                     str(r["fused_compiles"]), f"{r['fused_cached_cpu_seconds']:.2f}",
                     str(r["fused_cached_compiles"])]
        if gpu:
            m = r.get("measured")
            line += [format_bytes(m) if m else "-", pct_text(r["planned"], m) if m else "-"]
        table.append(line)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in table]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *table, strict=True)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True))
                     for row in [head, *table])


def main(argv: list[str] | None = None) -> None:
    """Parse flags, measure every selected model, print the table."""
    from experiments._cli import positive_int

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory_accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--memory-per-device", default=None,
                        help="budget per device, e.g. 64MiB (default: each model's own)")
    parser.add_argument("--devices", type=positive_int, default=None,
                        help="devices to plan on (default: 8 virtual CPU devices, or all GPUs)")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated model names of {', '.join(BY_NAME)} (default: "
                        f"{','.join(c.name for c in CASES)}; the others, slower, only when "
                        "named)")
    parser.add_argument("--fuse", type=int, default=None, metavar="K",
                        help="also size a fused group of up to K members on each plan, new and "
                             "from the plan cache (default: off)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--child", default=None, choices=list(BY_NAME), metavar="CASE",
                        help="run two real training steps of CASE on its plan in this process "
                        "and print one JSON row (planned, booked, compiled and, on GPUs, the "
                        "allocator's measured peak): the GPU suite's memory measurement")
    parser.add_argument("--batch", type=positive_int, default=None,
                        help="with --child: the batch to run (default: the plan's)")
    parser.add_argument("--safety-margin", type=float, default=None,
                        help=f"with --child: the planner's safety margin (default "
                        f"{CHILD_SAFETY_MARGIN})")
    parser.add_argument("--plan-cache", default=None,
                        help="with --child: a plan cache file, so that a repeated run plans "
                        "without compiling")
    args = parser.parse_args(argv)
    if args.fuse is not None and args.fuse < 1:
        parser.error(f"--fuse {args.fuse}: a group needs at least 1 member; use e.g. --fuse 4")
    child_only = [flag for flag, value in (("--batch", args.batch),
                                           ("--safety-margin", args.safety_margin),
                                           ("--plan-cache", args.plan_cache))
                  if value is not None]
    if child_only and args.child is None:
        parser.error(f"{', '.join(child_only)} {'apply' if len(child_only) > 1 else 'applies'} "
                     "with --child CASE only (two training steps of one case, as the GPU suite "
                     "runs them); the table plans each case with the planner's defaults: leave "
                     f"{'them' if len(child_only) > 1 else 'it'} out, or add --child CASE")
    names = [c.name for c in CASES]
    if args.only is not None:
        names = [name.strip() for name in args.only.split(",")]
        if not all(names):
            parser.error(f"--only {args.only!r}: an empty name; pass names separated by "
                         "single commas, e.g. --only mlp,vit (or leave --only out: "
                         f"{','.join(c.name for c in CASES)})")
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            parser.error(f"unknown model(s) {unknown}; choose from {sorted(BY_NAME)}")

    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(args.devices or 8)  # only affects the CPU platform
    import jax

    on_gpu = jax.devices()[0].platform == "gpu"
    args.devices = args.devices or (len(jax.devices()) if on_gpu else 8)
    by_name = BY_NAME
    if args.child:
        row = measure_real_step(by_name[args.child], args.devices, args.memory_per_device,
                                batch=args.batch, safety_margin=CHILD_SAFETY_MARGIN
                                if args.safety_margin is None else args.safety_margin,
                                fuse=args.fuse or 0, cache=args.plan_cache)
        print(json.dumps(row))
        return

    rows = []
    for name in names:
        row = measure(by_name[name], args.devices, args.memory_per_device, args.fuse)
        if on_gpu:
            row["measured"] = measure_in_child(
                name, args.devices, args.memory_per_device or by_name[name].budget)["peak_in_use"]
        rows.append(row)
        print(f"# {name}: {row['plan_cpu_seconds']:.1f} CPU s to plan, {row['compiles']} "
              f"compiles; cached {row['cached_cpu_seconds']:.2f} CPU s, "
              f"{row['cached_compiles']} compiles", file=sys.stderr, flush=True)
    print(f"devices: {args.devices} x {jax.devices()[0].device_kind}")
    print(render(rows, args.markdown))


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
