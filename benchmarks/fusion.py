"""Fused vs unfused training of the same trials: step time in steady state, compile and
planning apart, trials per hour end to end, and whether a fused member trains as its solo run.

The same ``K`` trials of one small architecture of a family (different learning rates and
seeds, the study's per-trial seeds) are trained for the same steps at the same batch, with a
final checkpoint and held-out evaluation each, in these ways:

- **fused**: one group (`scamp_jax.hpo.fused_runner.run_fused_group`) on one device, the group sized
  by `scamp_jax.planning.fusion.plan_fusion` (timed apart and said beside the table, like a
  trial's plan, which the unfused variant does not count either);
- **unfused**: the project's solo runner (`scamp_jax.hpo.runner.run_trial`) one trial after another
  on the same device, sharing one compiled step (`StepCache`), as the engine does for trials of
  one architecture;
- **unfused, concurrent**: the same solo runs at once, each in its own thread on its own CPU
  device (how the engine packs them when devices are free);
- **Ray Tune** (``--ray``, needs ``pip install "ray[tune]"``): each trial a Ray Tune trial in its
  own process with one JAX device (`benchmarks.ray_baseline`), two at a time.

Every timed variant starts from fresh jitted functions, so each pays its own compiles; the
held-out evaluation's model function is compiled once before timing (both variants share it).
Repeats run the variants interleaved, in rotating order, because the machine is shared.

What the report (``--json``) holds:

- ``steady_speedup``: ``K x`` the solo step time over the fused step time, both in steady state:
  the wall-clock time between loss read-backs (every ``log_every`` steps, the first interval
  of a run left out: it holds the first executions) divided by the steps between them, median
  over every interval of every repeat (``steady``). Compiling, planning, initialising and
  evaluating are not in it. ``steady_cpu_speedup`` is the same ratio of process CPU seconds
  per step (every thread): the work, which other processes on a shared machine change less
  than the wall-clock time;
- ``step_speedup``: the compiled steps alone, without the runner's host work around them
  (drawing and stacking batches, dispatch, read-backs): ``K`` solo steps one after another
  against one fused step, interleaved, ratio of the medians (``step_only``, `step_times`);
- ``wide_speedup``: the same ``K`` solo steps against one solo step at ``K`` times the batch
  (member 0's model), timed in the same rounds: what this device gains from running the
  members' work as operations ``K`` times wider, with one set of weights. A reference for
  ``step_speedup``, not a bound: a fused step also updates ``K`` sets of weights, and runs
  some operations member by member (convolutions on CPU), which can be faster or slower than
  one wide operation;
- ``compile_and_planning_seconds``: what each way spends before its first step: planning (the
  member plan; the fused plan's compiles) and each run's start until its first training step
  (compile or load of the step, initial state, memory check);
- ``speedup``: end to end, compile included (``seconds``: min and median over repeats);
- per member: ``first_step_rel_diff``, the relative difference between fused and solo of the
  losses the first two steps report (step 1: the loss of the initial parameters; step 2: after
  the first update, so the first step's gradients and update are in it), the larger of the two;
  the final loss and held-out score of each way.

Run::

    python -m benchmarks.fusion --family vit --width 4 --json
    python -m benchmarks.fusion --family swinir --width 4 --repeats 3 --ray --markdown
    python -m benchmarks.fusion --family swinir --width 8 --kernels --target h100   # no GPU

``--kernels`` only compiles: the kernels one solo step and the fused step launch
(`kernel_counts`), on this machine's device or a described GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks._tables import rel_diff

CPU_DEVICES = 8

#: One small architecture per family (the group's), and the steps and batch the trials train.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "vit": {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0},
    "swinir": {"embed_dim": 24, "num_groups": 1, "group_depth": 2, "num_heads": 2,
               "window_size": 8, "mlp_ratio": 2.0},
}
#: Fewest steps of a trial: the steady state is timed between the second and later read-backs.
MIN_STEPS = 3
STEPS_TOO_FEW = ("--steps {steps}: the steady state is timed between the second and later loss "
                 f"read-backs, so a trial needs at least {MIN_STEPS} steps; pass --steps "
                 f"{MIN_STEPS} or more")
#: The report's ``ray`` entry without ``--ray``.
RAY_NOT_REQUESTED = "not requested (pass --ray)"
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


#: Steps between loss read-backs in the timed runs: the steady-state clock ticks at them.
LOG_EVERY = 5


class ReadBacks:
    """Every loss read-back of a run by member: ``(step, wall-clock seconds, process CPU
    seconds, loss)`` (``time.perf_counter()``, ``time.process_time()``: every thread of the
    process); an ``on_loss`` callback of the runners."""

    def __init__(self) -> None:
        self.marks: dict[int, list[tuple[int, float, float, float]]] = {}

    def __call__(self, number: int, step: int, loss: float) -> None:
        self.marks.setdefault(number, []).append(
            (step, time.perf_counter(), time.process_time(), loss))

    def losses(self, number: int) -> dict[int, float]:
        """Member ``number``'s loss at every read-back step."""
        return {step: loss for step, _, _, loss in self.marks.get(number, [])}

    def step_seconds(self, numbers: Sequence[int], clock: int = 1) -> list[float]:
        """Seconds per step (``clock`` 1: wall-clock, 2: process CPU) of every interval between
        read-backs of members ``numbers``, the first interval of each left out (it holds the
        run's first executions)."""
        out = []
        for number in numbers:
            marks = self.marks.get(number, [])
            for a, b in zip(marks[1:], marks[2:], strict=False):
                out.append((b[clock] - a[clock]) / (b[0] - a[0]))
        return out


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {"min": min(values), "median": statistics.median(values), "all": list(values)}


def run(family: str, width: int, *, steps: int, batch: int, repeats: int, ray: bool,
        concurrent: bool, seed: int = 0, wide: bool = True,
        progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure the variants; returns the JSON-ready report (see the module docstring).
    ``wide=False``: no ``wide_speedup`` (one compile less). ``progress``: called with what is
    measured so far (`partial`'s figures) after the first steps and after each timed run, so
    a caller stopped part way keeps them."""
    import dataclasses

    if steps < MIN_STEPS:
        raise ValueError(STEPS_TOO_FEW.format(steps=steps))

    import jax
    from flax import nnx

    from scamp_jax._units import parse_bytes
    from scamp_jax.hpo.fused_runner import GroupSpec, MemberSpec, run_fused_group
    from scamp_jax.hpo.runner import RunSpec, StepCache, make_optimizer, run_trial
    from scamp_jax.hpo.trial import TrialStatus
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
    t0 = time.perf_counter()
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=device,
                             memory_per_device=budget, max_batch_size=batch, **kw)
    solo_planning = time.perf_counter() - t0
    if plan.batch_size != batch:
        raise ValueError(f"--batch {batch} does not fit one trial in {hpo.memory_per_device}; "
                         f"the planner fits {plan.batch_size}: pass --batch {plan.batch_size}")
    task.evaluate(space.build(arch, nnx.Rngs(0)))  # compile the shared evaluation once

    # Sizing the group compiles the fused step (like planning a trial compiles its step); the
    # plan is made once per architecture and width, so it is timed apart from the runs.
    t0, c0 = time.perf_counter(), time.process_time()
    gplan = plan_fusion(model, task.sample_batch(1), max_width=width, plan=plan,
                        batch_size=batch, **kw)
    fusion_planning = (time.perf_counter() - t0, time.process_time() - c0)
    if gplan.width < width:
        raise ValueError(f"only {gplan.width} members fit {hpo.memory_per_device} at batch "
                         f"{batch}; lower --width or --batch")
    log_every = LOG_EVERY if steps >= 3 * LOG_EVERY else 1

    def fused(root: Path | None, n_steps: int = steps, every: int = log_every,
              ) -> tuple[float, Any, ReadBacks, list[float]]:
        """Seconds, the `GroupResult`, its read-backs and [seconds to its first step]."""
        specs = tuple(MemberSpec(i, cfg, s, checkpoint_dir=None if root is None
                                 else root / "fused" / key)
                      for i, (cfg, s, key) in enumerate(members))
        statuses = [TrialStatus(i, cfg) for i, (cfg, _, _) in enumerate(members)]
        reads = ReadBacks()
        t0, start = time.perf_counter(), time.monotonic()
        result = run_fused_group(GroupSpec(0, specs, gplan, n_steps, budget, log_every=every),
                                 space, task, on_loss=reads, statuses=statuses)
        return (time.perf_counter() - t0, result, reads,
                [statuses[0].training_since - start])

    def solo_spec(i: int, root: Path | None, devices: Sequence[Any], n_steps: int = steps,
                  every: int = log_every) -> RunSpec:
        cfg, s, key = members[i]
        return RunSpec(number=i, params=cfg, plan=plan.with_devices(devices), steps=n_steps,
                       memory_per_device=budget, seed=s, log_every=every,
                       checkpoint_dir=None if root is None else root / "unfused" / key)

    def unfused(root: Path | None, n_steps: int = steps, every: int = log_every,
                ) -> tuple[float, list[Any], ReadBacks, list[float]]:
        """Seconds, the `RunResult`s, their read-backs and each trial's seconds to its first
        step (the first trial compiles the step the others share)."""
        cache = StepCache()
        reads = ReadBacks()
        results, starts = [], []
        t0 = time.perf_counter()
        for i in range(width):
            status, start = TrialStatus(i, members[i][0]), time.monotonic()
            results.append(run_trial(solo_spec(i, root, device, n_steps, every), space, task,
                                     cache=cache, on_loss=reads, status=status))
            starts.append(status.training_since - start)
        return time.perf_counter() - t0, results, reads, starts

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

    first = _first_steps(fused, unfused, width)
    if progress is not None:
        progress(partial(width, first, {}, {}, fusion_planning[0], solo_planning))
    variants = ["fused", "unfused"] + (["concurrent"] if concurrent else [])
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    per_step: dict[str, list[float]] = {"fused": [], "unfused": []}
    per_step_cpu: dict[str, list[float]] = {"fused": [], "unfused": []}
    starts: dict[str, list[float]] = {"fused": [], "unfused": []}
    fused_result = solo_results = None
    for r in range(repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            c0 = time.process_time()
            with tempfile.TemporaryDirectory(prefix="fusion-bench-") as tmp:
                root = Path(tmp)
                if v == "fused":
                    seconds, group, reads, start = fused(root)
                    results = list(group.members)
                    fused_result = fused_result or group
                    per_step[v] += reads.step_seconds([0])  # one clock: member 0's read-backs
                    per_step_cpu[v] += reads.step_seconds([0], clock=2)
                elif v == "unfused":
                    seconds, results, reads, start = unfused(root)
                    solo_results = solo_results or results
                    per_step[v] += reads.step_seconds(range(width))
                    per_step_cpu[v] += reads.step_seconds(range(width), clock=2)
                else:
                    seconds, results = packed(root)
            bad = [m for m in results if m.state != "complete"]
            if bad:
                raise SystemExit(f"{v} trial {bad[0].number} ended {bad[0].state}: "
                                 f"{bad[0].reason}")
            if v in starts:
                starts[v].append(sum(start))
            times[v].append(seconds)
            cpu[v].append(time.process_time() - c0)
            print(f"repeat {r}: {v:>10} {seconds:7.2f} s wall, {cpu[v][-1]:7.2f} s CPU",
                  flush=True)
            if progress is not None:
                progress(partial(width, first, times, per_step, fusion_planning[0],
                                 solo_planning))
    assert fused_result is not None and solo_results is not None
    step_only = step_times(family, width, batch,
                           ways=tuple(STEP_WAYS) if wide else ("fused",))
    metric = task.metric
    rows = []
    for i, (cfg, s, _) in enumerate(members):
        f, u = fused_result.members[i], solo_results[i]
        rows.append({"number": i, "learning_rate": cfg["learning_rate"], "seed": s,
                     **first[i],
                     "solo_final_loss": u.loss, "fused_final_loss": f.loss,
                     "loss_rel_diff": rel_diff(f.loss, u.loss),
                     f"solo_{metric}": u.metrics[metric], f"fused_{metric}": f.metrics[metric]})
    solo_step = statistics.median(per_step["unfused"])
    fused_step = statistics.median(per_step["fused"])
    out: dict[str, Any] = {
        "family": family, "width": width, "steps": steps, "batch_size": batch,
        "architecture": arch, "device": f"{jax.devices()[0].platform} x1",
        "memory_per_device": budget, "repeats": repeats, "members": rows,
        "max_first_step_rel_diff": max(m["first_step_rel_diff"] for m in rows),
        "steady_speedup": width * solo_step / fused_step,
        "steady_cpu_speedup": width * statistics.median(per_step_cpu["unfused"])
        / statistics.median(per_step_cpu["fused"]),
        "step_speedup": step_only["step_speedup"],
        "wide_speedup": step_only.get("wide_speedup"), "step_only": step_only,
        "steady": {"log_every": log_every, "solo_step_seconds": _stats(per_step["unfused"]),
                   "fused_step_seconds": _stats(per_step["fused"]),
                   "solo_step_cpu_seconds": _stats(per_step_cpu["unfused"]),
                   "fused_step_cpu_seconds": _stats(per_step_cpu["fused"])},
        "compile_and_planning_seconds": {
            "solo": {"planning": solo_planning, "trials_to_first_step": _stats(starts["unfused"]),
                     "total_median": solo_planning + statistics.median(starts["unfused"])},
            "fused": {"planning": fusion_planning[0], "group_to_first_step": _stats(
                starts["fused"]), "total_median": fusion_planning[0]
                + statistics.median(starts["fused"])},
        },
        "fused_seconds": min(times["fused"]), "unfused_seconds": min(times["unfused"]),
        "seconds": {v: _stats(t) for v, t in times.items()},
        "cpu_seconds": {v: _stats(t) for v, t in cpu.items()},
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
        out["ray"] = {"skipped": RAY_NOT_REQUESTED}
    return out


def partial(width: int, first: Sequence[Mapping[str, float]],
            times: Mapping[str, Sequence[float]], per_step: Mapping[str, Sequence[float]],
            fusion_planning_s: float, solo_planning_s: float) -> dict[str, Any]:
    """What `run` has measured so far: the members' first-step differences, each timed
    variant's seconds, and, once both ways have run, the end-to-end and steady speed-ups
    (``None`` until then)."""
    fused, unfused = times.get("fused") or [], times.get("unfused") or []
    solo_steps, fused_steps = per_step.get("unfused") or [], per_step.get("fused") or []
    return {
        "width": width,
        "max_first_step_rel_diff": max(m["first_step_rel_diff"] for m in first),
        "seconds": {v: list(t) for v, t in times.items()},
        "fusion_planning_s": fusion_planning_s, "solo_planning_s": solo_planning_s,
        "end_to_end_speedup": min(unfused) / min(fused) if fused and unfused else None,
        "steady_speedup": width * statistics.median(solo_steps) / statistics.median(fused_steps)
        if solo_steps and fused_steps else None,
    }


def _first_steps(fused: Any, unfused: Any, width: int) -> list[dict[str, float]]:
    """Per member, fused against solo: the relative difference of the loss step 1 reports
    (``initial_loss_rel_diff``: the initial parameters), of the loss step 2 reports
    (``second_loss_rel_diff``: after the first update) and the larger of the two
    (``first_step_rel_diff``). Two-step runs of both ways, every loss read back, no
    checkpoints; not timed."""
    _, group, fused_reads, _ = fused(None, 2, 1)
    _, results, solo_reads, _ = unfused(None, 2, 1)
    bad = [m for m in (*group.members, *results) if m.state != "complete"]
    if bad:
        raise SystemExit(f"trial {bad[0].number} of the two-step check ended {bad[0].state}: "
                         f"{bad[0].reason}")
    out = []
    for i in range(width):
        f, u = fused_reads.losses(i), solo_reads.losses(i)
        initial, second = rel_diff(f[1], u[1]), rel_diff(f[2], u[2])
        out.append({"initial_loss_rel_diff": initial, "second_loss_rel_diff": second,
                    "first_step_rel_diff": max(initial, second)})
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


def compiled_steps(family: str, width: int, batch: int, seed: int = 0, fused: bool = True,
                   ) -> tuple[Any, list[tuple[Any, ...]], Any, tuple[Any, ...]]:
    """``(solo step, [its arguments per member], fused step, its arguments)``: the members of
    `member_configs` built from their seeds with their learning rates and one batch each from
    their own streams, the solo step (`scamp_jax.planning.train_step.make_train_step`) and the
    fused step of all of them (`scamp_jax.planning.fusion.make_fused_step`; ``fused=False``:
    None and no arguments, nothing stacked or compiled) compiled on the default device. Nothing
    is donated, so the arguments can be used again."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from scamp_jax.hpo.runner import make_optimizer
    from scamp_jax.planning.fusion import make_fused_step, stack_batches
    from scamp_jax.planning.initial_state import set_hyperparams
    from scamp_jax.planning.train_step import make_train_step, split_model

    experiment = _experiment(family)
    space, task = experiment.make_space_and_task(
        dataclasses.replace(experiment.get_config("smoke"), seed=seed))
    members = member_configs(family, width, seed)
    optimizer = make_optimizer(members[0][0])
    states = []
    for cfg, s, _ in members:
        graphdef, params, rest = split_model(space.build(cfg, nnx.Rngs(s)))
        hyper = {"learning_rate": cfg["learning_rate"]}
        states.append((params, set_hyperparams(optimizer.init(params), hyper), rest))
    batches = [next(task.batches(batch, s)) for _, s, _ in members]
    solo_args = [(*state, b) for state, b in zip(states, batches, strict=True)]
    solo = jax.jit(make_train_step(graphdef, optimizer, task.loss_fn)).lower(
        *solo_args[0]).compile()
    if not fused:
        return solo, solo_args, None, ()
    fused_args = (*jax.tree.map(lambda *xs: jnp.stack(xs), *states), stack_batches(batches),
                  jnp.ones(width, bool))
    step = jax.jit(make_fused_step(graphdef, optimizer, task.loss_fn)).lower(
        *fused_args).compile()
    return solo, solo_args, step, fused_args


def kernel_counts(family: str, width: int, batch: int, target: str | None = None,
                  ) -> dict[str, Any]:
    """Kernels one training step launches: a member's solo step against the fused step of
    ``width`` members, each member at ``batch`` samples, compiled (nothing runs) on this
    machine's first device or, with ``target``, for a described GPU
    (`scamp_jax.planning.targets`, autotuning off as every target compile). Counted as the
    simulator counts them (`scamp_jax.sim.sim_fusion.entry_kernels`: the compiled entry
    computation's instructions other than parameters, constants, tuple accesses and
    bitcasts), with their kinds (`scamp_jax.sim.sim_fusion.entry_kernel_kinds`). A
    launch-bound step (small members, a GPU) gains up to the ratio of ``width`` x solo
    kernels to fused ones."""
    import jax
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from scamp_jax.hpo.runner import make_optimizer
    from scamp_jax.planning.compile_options import Purpose, device_options
    from scamp_jax.planning.fusion import make_fused_step
    from scamp_jax.planning.train_step import make_train_step, split_model
    from scamp_jax.sim.sim_fusion import entry_kernel_kinds, entry_kernels

    experiment = _experiment(family)
    space, task = experiment.make_space_and_task(experiment.get_config("smoke"))
    config = member_configs(family, width)[0][0]
    graphdef, params, rest = split_model(nnx.eval_shape(lambda: space.build(config,
                                                                            nnx.Rngs(0))))
    optimizer = make_optimizer(config)
    opt_state = jax.eval_shape(optimizer.init, params)
    sample = jax.tree.map(lambda x: jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype),
                          task.sample_batch(1))
    if target is None:
        device = jax.devices()[0]
        options = device_options([device], Purpose.RUN)
    else:
        from scamp_jax.planning.targets import resolve_target

        device = resolve_target(target).devices(1)[0]
        options = device_options([device], Purpose.GUIDE)
    sharding = SingleDeviceSharding(device)

    def placed(tree: Any, members: int = 0) -> Any:
        lead = (members,) if members else ()
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype,
                                                           sharding=sharding), tree)

    state = (params, opt_state, rest, sample)
    solo = jax.jit(make_train_step(graphdef, optimizer, task.loss_fn)).lower(
        *placed(state)).compile(options)
    fused = jax.jit(make_fused_step(graphdef, optimizer, task.loss_fn)).lower(
        *placed(state, width), placed(jax.ShapeDtypeStruct((width,), bool))).compile(options)

    solo_text, fused_text = solo.as_text(), fused.as_text()
    # XLA gives the HLO text on CPU, GPU and TPU (`sim_fusion.measure_fused_costs` checks it)
    assert solo_text is not None and fused_text is not None
    report: dict[str, Any] = {"family": family, "width": width, "batch": batch,
                              "device": target or device.platform,
                              "solo_kernels": entry_kernels(solo_text),
                              "fused_kernels": entry_kernels(fused_text),
                              "solo_kinds": entry_kernel_kinds(solo_text),
                              "fused_kinds": entry_kernel_kinds(fused_text)}
    report["launch_bound_gain"] = width * report["solo_kernels"] / report["fused_kernels"]
    return report


def _timed_rounds(ways: dict[str, Any], rounds: int,
                  calls: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and process CPU seconds of each of ``ways`` (name -> a call returning JAX
    arrays), after one untimed call each, in ``rounds`` interleaved rounds of ``calls`` timed
    calls per way; each call waits for its arrays."""
    import jax

    wall: dict[str, list[float]] = {k: [] for k in ways}
    cpu: dict[str, list[float]] = {k: [] for k in ways}
    for f in ways.values():
        jax.block_until_ready(f())
    for _ in range(rounds):
        for name, f in ways.items():
            for _ in range(calls):
                t0, c0 = time.perf_counter(), time.process_time()
                jax.block_until_ready(f())
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return wall, cpu


#: What `step_times` can time against the ``K`` solo steps: the fused step, one solo step at
#: ``K`` times the batch, and the names of their ratios in the report.
STEP_WAYS = {"fused": "step_speedup", "wide": "wide_speedup"}


def step_times(family: str, width: int, batch: int, rounds: int = 5, calls: int = 5,
               ways: Sequence[str] = tuple(STEP_WAYS)) -> dict[str, Any]:
    """The compiled steps alone (`compiled_steps`), no runner around them: seconds of the
    ``width`` solo steps one after another against each of ``ways``: ``fused``, one fused
    step; ``wide``, one solo step at ``width`` times the batch; in interleaved rounds of
    ``calls`` timed calls each (wall-clock and process CPU, min and median); the ratios of
    the medians, solo steps over each way (`STEP_WAYS`: ``step_speedup``,
    ``wide_speedup``; ``*_cpu_speedup`` of CPU seconds; see the module doc)."""

    if isinstance(ways, str) or not set(ways) <= set(STEP_WAYS):
        raise ValueError(f"ways={ways!r}: pass a sequence of {sorted(STEP_WAYS)}")
    solo, solo_args, fused, fused_args = compiled_steps(family, width, batch,
                                                        fused="fused" in ways)
    timed: dict[str, Any] = {"solo": lambda: [solo(*a) for a in solo_args]}
    if "fused" in ways:
        timed["fused"] = lambda: fused(*fused_args)
    if "wide" in ways:
        wide, wide_args, _, _ = compiled_steps(family, 1, width * batch, fused=False)
        timed["wide"] = lambda: wide(*wide_args[0])
    wall, cpu = _timed_rounds(timed, rounds, calls)
    out: dict[str, Any] = {f"{name}_seconds": _stats(wall[name]) for name in timed}
    out.update({f"{name}_cpu_seconds": _stats(cpu[name]) for name in timed})
    for way in ways:
        key = STEP_WAYS[way].removesuffix("_speedup")
        out[f"{key}_speedup"] = out["solo_seconds"]["median"] / out[f"{way}_seconds"]["median"]
        out[f"{key}_cpu_speedup"] = (out["solo_cpu_seconds"]["median"]
                                     / out[f"{way}_cpu_seconds"]["median"])
    return out


def conv_forms(width: int = 4, batch: int = 8, side: int = 24,
               channels: tuple[int, int] = (24, 24),
               rounds: int = 5, calls: int = 7) -> dict[str, dict[str, float]]:
    """Seconds of one 3x3 convolution's forward and backward (input and weight gradients) for
    ``width`` members with their own weights, three ways: each member's alone one after another
    (``solo x K``), ``jax.vmap`` (JAX's rule: one grouped convolution) and the fused step's form
    (`scamp_jax.planning.member_ops.member_program` under ``jax.vmap``). Interleaved rounds of
    ``calls`` timed calls each; min and median wall-clock and process CPU seconds per call."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from scamp_jax.planning.member_ops import member_program

    rng = np.random.default_rng(0)
    cin, cout = channels
    x = jnp.asarray(rng.normal(size=(width, batch, side, side, cin)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(width, 3, 3, cin, cout)) / np.sqrt(9 * cin), jnp.float32)

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.abs(y).mean()

    step = jax.value_and_grad(loss, argnums=(0, 1))
    one, plain, member = (jax.jit(step), jax.jit(jax.vmap(step)),
                          jax.jit(jax.vmap(member_program(step))))
    ways = {"solo x K": lambda: [one(x[i], w[i]) for i in range(width)],
            "vmap (grouped)": lambda: plain(x, w), "fused step's form": lambda: member(x, w)}
    wall, cpu = _timed_rounds(ways, rounds, calls)
    return {name: {"wall_min": min(wall[name]), "wall_median": statistics.median(wall[name]),
                   "cpu_min": min(cpu[name]), "cpu_median": statistics.median(cpu[name])}
            for name in ways}


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
    steady, prep = report["steady"], report["compile_and_planning_seconds"]
    k = report["width"]
    solo_step = steady["solo_step_seconds"]["median"]
    fused_step = steady["fused_step_seconds"]["median"]
    print_table(
        f"{report['family']}: steady state, seconds per step (median of the intervals between "
        f"read-backs every {steady['log_every']} steps) and what comes before the first step",
        ["way", "step s", "per member s", "steady speedup", "CPU s per step",
         "CPU speedup", "planning + to first step s"],
        [["unfused (one at a time)", f"{solo_step:.4f}", f"{solo_step:.4f}", "1.00x",
          f"{steady['solo_step_cpu_seconds']['median']:.4f}", "1.00x",
          f"{prep['solo']['total_median']:.1f}"],
         [f"fused ({k} members)", f"{fused_step:.4f}", f"{fused_step / k:.4f}",
          f"{report['steady_speedup']:.2f}x",
          f"{steady['fused_step_cpu_seconds']['median']:.4f}",
          f"{report['steady_cpu_speedup']:.2f}x", f"{prep['fused']['total_median']:.1f}"]],
        markdown)
    only = report["step_only"]
    print(f"compiled steps alone ({k} solo steps one after another against one fused step, "
          f"medians): {only['solo_seconds']['median']:.4f} s against "
          f"{only['fused_seconds']['median']:.4f} s wall, step_speedup "
          f"{report['step_speedup']:.2f}x; CPU {only['solo_cpu_seconds']['median']:.4f} s "
          f"against {only['fused_cpu_seconds']['median']:.4f} s, "
          f"{only['step_cpu_speedup']:.2f}x")
    if report["wide_speedup"] is not None:
        print(f"as one wide step (the {k} solo steps against one solo step at {k} times the "
              f"batch, {only['wide_seconds']['median']:.4f} s): wide_speedup "
              f"{report['wide_speedup']:.2f}x (CPU {only['wide_cpu_speedup']:.2f}x)")
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
        f"{report['batch_size']}, {report['repeats']} repeats, end to end (sizing the group: "
        f"{plan['compiles']} compiles, {plan['planning_seconds']:.1f} s wall, "
        f"{plan['planning_cpu_seconds']:.1f} s CPU, not in the fused time)",
        ["variant", "min s", "median s", "median CPU s", "trials/h (median)",
         "wall vs unfused", "CPU vs unfused"], rows, markdown)
    metric = next(k[len("solo_"):] for k in report["members"][0]
                  if k.startswith("solo_") and k != "solo_final_loss")
    print_table(
        "members: first two steps' losses, final loss and held-out score, solo vs fused",
        ["lr", "first step rel diff", "solo loss", "fused loss", "rel diff", f"solo {metric}",
         f"fused {metric}"],
        [[f"{m['learning_rate']:.2e}", f"{m['first_step_rel_diff']:.1e}",
          f"{m['solo_final_loss']:.6f}", f"{m['fused_final_loss']:.6f}",
          f"{m['loss_rel_diff']:.1e}", f"{m['solo_' + metric]:.4f}",
          f"{m['fused_' + metric]:.4f}"]
         for m in report["members"]], markdown)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse flags, measure, print a table (and the JSON with ``--json``)."""
    from experiments._cli import output_file, positive_int

    p = argparse.ArgumentParser(prog="python -m benchmarks.fusion", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(ARCHITECTURES), default=None,
                   help="model family of the trials (default vit; not with --conv, which "
                        "times a SwinIR convolution)")
    p.add_argument("--width", type=positive_int, default=4,
                   help="trials in the group, K (default 4)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="training steps per trial (default: the family's, "
                        + ", ".join(f"{f} {d['steps']}" for f, d in sorted(DEFAULTS.items()))
                        + ")")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="samples per trial per step (default: the family's, "
                        + ", ".join(f"{f} {d['batch']}" for f, d in sorted(DEFAULTS.items()))
                        + ")")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="interleaved repeats per variant (default 3)")
    p.add_argument("--no-concurrent", action="store_true",
                   help="skip the concurrent unfused variant")
    p.add_argument("--ray", action="store_true",
                   help="also run the trials under Ray Tune (needs ray[tune]; not with --conv, "
                        "--kernels or --simulate)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--markdown", action="store_true", help="Markdown tables")
    p.add_argument("--out", type=output_file, default=None,
                   help="also write the JSON report here")
    p.add_argument("--conv-form", choices=("auto", "per_member", "grouped"), default=None,
                   help="how the fused step runs per-member convolutions (sets "
                        "SCAMP_FUSED_CONVOLUTIONS; auto: member by member on CPU, one grouped "
                        "convolution elsewhere)")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--conv", action="store_true",
                   help="only time one 3x3 convolution's forms: solo x K, vmap (grouped), the "
                        "fused step's (trains nothing)")
    modes.add_argument("--kernels", action="store_true",
                   help="only count the kernels a solo step and the fused step launch, "
                        "compiled here (trains nothing); with --target, the launch-bound "
                        "gain: K x solo kernels / fused kernels, the most a group gains where "
                        "a step's time is its kernel launches (small members on a GPU)")
    from scamp_jax.planning.targets import TARGETS, resolve_target

    p.add_argument("--target", default=None, metavar="GPU|FILE",
                   help=f"with --kernels: compile for this described GPU ({', '.join(TARGETS)} "
                        "or a GpuTargetConfigProto file; needs pip install "
                        "'scamp-jax[gpu-plan]')")
    modes.add_argument("--simulate", action="store_true",
                   help="only the modelled gain on the simulator's cluster presets at widths "
                        "1, 2, --width and twice --width (compiles, trains nothing)")
    args = p.parse_args(argv)
    if args.target is not None and not args.kernels:
        p.error("--target needs --kernels")
    mode = next((f"--{m}" for m in ("conv", "kernels", "simulate") if getattr(args, m)), None)
    if args.ray and mode is not None:
        p.error(f"--ray runs the trials under Ray Tune, and {mode} trains nothing; leave out "
                f"one of them")
    if args.conv and args.family is not None:
        p.error("--conv times one 3x3 SwinIR convolution whatever the family; leave out "
                "--family")
    args.family = args.family or "vit"
    if mode is None and args.steps is not None and args.steps < MIN_STEPS:
        p.error(STEPS_TOO_FEW.format(steps=args.steps))
    if args.target is not None:
        try:
            resolve_target(args.target)
        except ValueError as err:
            p.error(f"--target: {err}")
    if args.ray and importlib.util.find_spec("ray") is None:  # said before the runs, not after
        from benchmarks.ray_baseline import RAY_INSTALL_HINT

        print(f"note: --ray: {RAY_INSTALL_HINT}; the Ray Tune row will be skipped (Ctrl-C now "
              "to install it first)", flush=True)

    if args.conv_form is not None:
        import os

        from scamp_jax.planning.member_ops import FORM_VARIABLE

        os.environ[FORM_VARIABLE] = args.conv_form
    from benchmarks._tables import emit_report
    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(CPU_DEVICES)
    d = DEFAULTS[args.family]
    if args.conv:
        from benchmarks._tables import print_table

        forms = conv_forms(args.width, args.batch or DEFAULTS["swinir"]["batch"])
        base = forms["solo x K"]
        print_table(
            f"one 3x3 convolution 24 -> 24 on {args.batch or DEFAULTS['swinir']['batch']} "
            f"images of 24x24 per member, forward and backward, {args.width} members: "
            "seconds per call (all members)",
            ["form", "wall min", "wall median", "CPU min", "CPU median", "median vs solo x K"],
            [[name, f"{f['wall_min']:.4f}", f"{f['wall_median']:.4f}", f"{f['cpu_min']:.4f}",
              f"{f['cpu_median']:.4f}", f"{f['wall_median'] / base['wall_median']:.2f}x"]
             for name, f in forms.items()], args.markdown)
        emit_report(forms, print_json=args.json, out=args.out)
        return forms
    if args.kernels:
        from benchmarks._tables import print_table

        report = kernel_counts(args.family, args.width, args.batch or d["batch"], args.target)
        names = sorted(set(report["solo_kinds"]) | set(report["fused_kinds"]),
                       key=lambda k: -report["fused_kinds"].get(k, 0))
        gain = ("" if args.target is None else
                f" (launch-bound gain {report['launch_bound_gain']:.2f}x: {args.width} x solo "
                "kernels / fused kernels)")
        print_table(
            f"{args.family}, batch {report['batch']} per member, compiled for "
            f"{report['device']}: kernels per step, one member solo against {args.width} "
            f"fused{gain}",
            ["kernel", "solo", f"fused x{args.width}"],
            [["all", str(report["solo_kernels"]), str(report["fused_kernels"])]]
            + [[k, str(report["solo_kinds"].get(k, 0)), str(report["fused_kinds"].get(k, 0))]
               for k in names], args.markdown)
        emit_report(report, print_json=args.json, out=args.out)
        return report
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
        emit_report(report, print_json=args.json, out=args.out)
        return report
    report = run(args.family, args.width, steps=args.steps or d["steps"],
                 batch=args.batch or d["batch"], repeats=args.repeats, ray=args.ray,
                 concurrent=not args.no_concurrent)
    _table(report, args.markdown)
    if report["ray"].get("skipped", RAY_NOT_REQUESTED) != RAY_NOT_REQUESTED:
        print(f"Ray Tune row skipped: {report['ray']['skipped']}", flush=True)
    emit_report(report, print_json=args.json, out=args.out)
    return report


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
