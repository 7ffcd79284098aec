"""The GPU suite's sections: each one runs in its own process and fills a `Record`.

A section writes its record (``OUT/sections/NAME.json``) after every measurement, so when the
suite's driver (`benchmarks.gpu_suite`) kills it at its time cap, what it measured is kept.
Before each long step a section checks the clock (`Context.left`) and, when the step cannot
finish in time, records ``cut_short`` and stops. Sizes come from `benchmarks.gpu_suite`'s
`SuiteConfig`; the tables are `benchmarks.gpu_markdown`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._tables import rel_diff

NOT_ON_CPU = "not measurable on CPU: CPU devices report no allocator statistics or limit"
#: The folder of the suite's output where the memory cases' runs keep XLA's autotuning results
#: (``xla_gpu_per_fusion_autotune_cache_dir``): with the GPU's description
#: (``environment/target_config.txtpb``) it makes a plan on a machine without the GPU take the
#: kernels the GPU chose (``python -m benchmarks.target_accuracy --targets FILE
#: --autotune-cache DIR``, `scamp_jax.planning.targets.resolve_target`).
AUTOTUNE_DIRNAME = "autotune"
AUTOTUNE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"


def with_xla_flag(flags: str, flag: str, value: str) -> str:
    """``XLA_FLAGS`` text ``flags`` with ``flag=value`` set (an earlier setting replaced)."""
    kept = [f for f in flags.split() if f != flag and not f.startswith(flag + "=")]
    return " ".join([*kept, f"{flag}={value}"])


@dataclass(frozen=True)
class Context:
    """What a section runs on, and until when (``deadline``: ``time.time()`` seconds)."""

    platform: str
    device_kind: str
    devices: int
    bytes_limit: int | None  # the allocator's limit of device 0 in this process, bytes
    device_bytes: int | None  # the device's memory: bytes_limit / the allocator's fraction
    out: Path
    plan_cache: Path  # where the measured allowance is stored
    deadline: float

    @property
    def on_cpu(self) -> bool:
        return self.platform == "cpu"

    def left(self) -> float:
        """Seconds until the section's deadline."""
        return self.deadline - time.time()


class OutOfTime(Exception):
    """A step of a section would not finish before the section's deadline."""


class Record:
    """A section's result as it grows; `save` rewrites its JSON file (atomically)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.body: dict[str, Any] = {"rows": []}
        self.lock = threading.RLock()

    def save(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.body, indent=1, default=str))
            tmp.replace(self.path)

    def add_row(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.body["rows"].append(row)
            self.save()

    def cut(self, reason: str) -> None:
        """Mark the section cut short (it stopped before its planned work was done)."""
        with self.lock:
            self.body["cut_short"] = True
            self.body.setdefault("cut_reasons", []).append(reason)
            self.save()


def allocator_fraction() -> float:
    """The fraction of device memory this process's allocator may use (XLA's default 0.75)."""
    from scamp_jax.devices import MEM_FRACTION_VAR, OLD_MEM_FRACTION_VAR, XLA_DEFAULT_FRACTION

    for name in (MEM_FRACTION_VAR, OLD_MEM_FRACTION_VAR):
        if os.environ.get(name):
            return float(os.environ[name])
    return XLA_DEFAULT_FRACTION


def make_context(out: Path, deadline: float, plan_cache: Path | None = None) -> Context:
    """The context of this process's devices (starts JAX's backend)."""
    import jax

    from scamp_jax import devices as _devices

    device = jax.devices()[0]
    stats = _devices.allocator_stats(device)
    limit = stats["bytes_limit"] if stats and "bytes_limit" in stats else None
    return Context(platform=device.platform, device_kind=str(device.device_kind),
                   devices=len(jax.devices()), bytes_limit=limit,
                   device_bytes=int(limit / allocator_fraction()) if limit else None, out=out,
                   plan_cache=plan_cache or out / "plans.sqlite", deadline=deadline)


def _pct(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else 100.0 * (a - b) / b


def _timeout(ctx: Context, least: float) -> float:
    """Seconds a child may run: up to the deadline less 2 s; `OutOfTime` below ``least``."""
    left = ctx.left() - 2.0
    if left < least:
        raise OutOfTime(f"{left:.0f} s left, a step needs at least {least:.0f} s")
    return left


# --------------------------------------------------------------------------- allocator policy

def grow_policy(budget: int | None, device_bytes: int | None) -> dict[str, str]:
    """Allocator variables for a child: preallocation off (the pool grows in regions on demand),
    capped at ``budget`` bytes (``XLA_CLIENT_MEM_FRACTION`` = budget / device bytes); None:
    XLA's default cap (0.75 of the device)."""
    from scamp_jax.devices import MEM_FRACTION_VAR, PREALLOCATE_VAR

    env = {PREALLOCATE_VAR: "false"}
    if budget is not None and device_bytes:
        env[MEM_FRACTION_VAR] = f"{min(1.0, budget / device_bytes):.17g}"
    return env


def preallocate_policy(budget: int | None, device_bytes: int | None) -> dict[str, str]:
    """As `grow_policy`, but a capped child takes its whole ``budget`` up front (one pool
    region, no growth); the uncapped row (``budget`` None) still grows on demand."""
    from scamp_jax.devices import PREALLOCATE_VAR

    env = grow_policy(budget, device_bytes)
    if budget is not None:
        env[PREALLOCATE_VAR] = "true"
    return env


#: ``name -> policy(budget bytes | None, device bytes) -> allocator variables`` (``--allocator``).
ALLOCATOR_POLICIES: dict[str, Callable[[int | None, int | None], dict[str, str]]] = {
    "grow": grow_policy, "preallocate": preallocate_policy,
}


# --------------------------------------------------------------------------- memory

def memory_section(cfg: Any, ctx: Context, rec: Record) -> None:
    """Booked vs compiled vs measured peaks with the allocator capped at the planner's budget;
    one row uncapped; the first batch that really runs out of memory, by bisection.

    Cases run as parallel processes (memory is per process; nothing here is timed)."""
    rec.body.update(cases={}, allocator_policy=cfg.allocator, note=NOT_ON_CPU if ctx.on_cpu else (
        "the planner's budget is the allocator's limit (bytes_limit); measured = "
        "peak_bytes_in_use after two steps, a fresh process per row; "
        "error = (compiled - measured) / measured"))
    if not ctx.on_cpu:
        # The runs' steps are autotuned (the planner's compiles are not): their choices per
        # fusion go to OUT/autotune for plans of this GPU made elsewhere. The cases' processes
        # inherit the flag; this process has compiled nothing.
        autotune = ctx.out / AUTOTUNE_DIRNAME
        autotune.mkdir(parents=True, exist_ok=True)
        os.environ["XLA_FLAGS"] = with_xla_flag(os.environ.get("XLA_FLAGS", ""),
                                                AUTOTUNE_FLAG, str(autotune))
        rec.body["autotune_cache"] = AUTOTUNE_DIRNAME
    # The allowance from the rows so far, after each case: a section stopped at its cap keeps
    # (and has stored) what its finished cases measured.
    rec.body["allowance"] = record_allowance([], ctx)
    rec.save()

    def case_then_allowance(case: Any) -> None:
        _memory_case(cfg, ctx, rec, case)
        with rec.lock:
            rec.body["allowance"] = record_allowance(rec.body["rows"], ctx)
            rec.save()

    with ThreadPoolExecutor(max_workers=cfg.memory_parallel) as pool:
        for future in [pool.submit(case_then_allowance, c) for c in cfg.memory_cases]:
            future.result()
    if any(c.get("cut_short") for c in rec.body["cases"].values()):
        rec.cut("memory cases cut short: " + ", ".join(
            k for k, c in rec.body["cases"].items() if c.get("cut_short")))
    rec.save()


def _memory_case(cfg: Any, ctx: Context, rec: Record, case: Any) -> None:
    from benchmarks.memory_accuracy import BY_NAME, measure_in_child
    from scamp_jax._units import parse_bytes

    if ctx.on_cpu and case.cpu_skip:
        with rec.lock:
            rec.body["cases"][case.label] = {"skipped": case.cpu_skip}
            rec.save()
        return
    if not ctx.on_cpu and case.gpu_skip:
        with rec.lock:
            rec.body["cases"][case.label] = {"skipped": case.gpu_skip}
            rec.save()
        return
    policy = ALLOCATOR_POLICIES[cfg.allocator]
    budget = parse_bytes(case.cpu_budget or BY_NAME[case.name].budget) if ctx.on_cpu \
        else parse_bytes(case.gpu_budget)
    capped = None if ctx.on_cpu else policy(budget, ctx.device_bytes)
    summary: dict[str, Any] = {"budget": budget, "allocator_env": capped, "rows": 0}
    cache = str(ctx.out / "memory" / f"{case.label.replace(' ', '_')}.sqlite")
    Path(cache).parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def run(point: str, batch: int | None, env: dict[str, str] | None,
            plan_budget: str | None) -> dict[str, Any]:
        timeout = _timeout(ctx, cfg.memory_child_seconds)
        try:
            r = measure_in_child(case.name, 1 if not ctx.on_cpu else ctx.devices, plan_budget,
                                 batch=batch, fuse=case.fuse, cache=cache, allocator_env=env,
                                 timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise OutOfTime(f"{point}: the child ran past the section's deadline") from err
        row = _memory_row(case.label, point, r)
        rec.add_row(row)
        summary["rows"] += 1
        return r

    with rec.lock:
        rec.body["cases"][case.label] = summary
    try:
        # On a GPU the planner reads its budget from the capped allocator (bytes_limit).
        planned = run("planned, capped", None, capped,
                      str(budget) if ctx.on_cpu else None)
        summary["planned_batch"] = planned["plan_batch"]
        summary["capped_run"] = (f"OOM in {planned.get('oom_phase')}" if planned["oom"]
                                 else "ok")
        if ctx.on_cpu:
            summary["first_oom_batch"] = NOT_ON_CPU
        else:
            run("planned, uncapped", planned["batch"], policy(None, ctx.device_bytes),
                str(planned["budget"]))
            if not planned["oom"]:
                summary.update(_bisect_oom(cfg, planned, lambda b: run(
                    f"probe batch {b}", b, capped, None)))
    except OutOfTime as err:
        summary["cut_short"] = True
        summary["cut_reason"] = str(err)
    except Exception as err:  # recorded; the other cases go on
        summary["error"] = f"{type(err).__name__}: {err}"[-1500:]
    summary["seconds"] = time.perf_counter() - started
    rec.save()
    print(f"[gpu_suite] memory {case.label}: {summary['seconds']:.0f} s", flush=True)


def _bisect_oom(cfg: Any, planned: dict[str, Any],
                run: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """The first batch that runs out of memory under the cap: grow by ``cfg.oom_growth`` from
    the planned batch until a run fails, then bisect until the bracket is within
    ``cfg.oom_resolution`` of the largest batch that ran (or ``cfg.oom_probes`` runs)."""
    dp = planned["data_parallel"]
    lo, hi, probes = planned["batch"], None, 0

    def tolerance(b: int) -> int:
        return max(dp, -(-int(b * cfg.oom_resolution) // dp) * dp)

    while probes < cfg.oom_probes:
        if hi is None:
            batch = max(lo + dp, -(-int(lo * cfg.oom_growth) // dp) * dp)
        elif hi - lo <= tolerance(lo):
            break
        else:
            batch = max(lo + dp, (lo + hi) // 2 // dp * dp)
        probes += 1
        if run(batch)["oom"]:
            hi = batch
        else:
            lo = batch
    out: dict[str, Any] = {"largest_ok_batch": lo, "first_oom_batch": hi, "probes": probes,
                           "resolved": hi is not None and hi - lo <= tolerance(lo)}
    if hi is not None:
        out["planned_over_first_oom"] = planned["batch"] / hi
    return out


def record_allowance(rows: list[dict[str, Any]], ctx: Context) -> dict[str, Any]:
    """The allowance for memory XLA does not see on this device kind, stored in the plan cache.

    ``unseen_bytes``: the largest ``peak_bytes_in_use - compiled`` over the runs that did not run
    out of memory (workspaces, buffers outside XLA's buffer assignment and the allocator's chunk
    rounding, all inside the pool; 0 when XLA over-estimates everywhere): ``bytes``, what every
    later plan on this device kind adds (`scamp_jax.planning.plan_cache.resolve_allowance`); the
    safety margin stays for the rest. ``context_bytes``: the largest part of the process's device
    memory outside the allocator's pool (CUDA context, library handles) as the driver reports it
    (0 when not measurable), recorded beside it but not booked: under the allocator policy
    (`scamp_jax.devices`) the pool is sized with it already left out
    (`scamp_jax.planning.budget.pool_bytes`), so booking it per trial would count it twice.
    """
    import jax

    from scamp_jax.planning.plan_cache import PlanCache

    if ctx.on_cpu:
        return {"bytes": 0, "stored": False,
                "reason": "CPU devices: 0, XLA's figures are all the memory they use"}
    ran = [r for r in rows if not r["oom"] and r["measured"] is not None and r["compiled"]]
    if not ran:
        return {"bytes": None, "stored": False, "reason": "no run measured peak_bytes_in_use"}
    unseen = max(0, max(r["measured"] - r["compiled"] for r in ran))
    outside = [r["outside_allocator_bytes"] for r in rows
               if r.get("outside_allocator_bytes") is not None]
    context = max(outside) if outside else 0
    record = {"bytes": unseen, "unseen_bytes": unseen, "context_bytes": context,
              "context_measured": bool(outside), "runs": len(ran),
              "jax": jax.__version__, "measured": time.strftime("%Y-%m-%d", time.gmtime())}
    PlanCache(ctx.plan_cache).put_allowance(ctx.platform, ctx.device_kind, record)
    return {**record, "stored": str(ctx.plan_cache)}


def _memory_row(label: str, point: str, r: dict[str, Any]) -> dict[str, Any]:
    measured = r.get("peak_in_use")
    return {
        "case": label, "point": point, "width": r["width"], "batch": r["batch"],
        "plan_batch": r["plan_batch"], "budget": r["budget"], "planned": r["planned"],
        "booked": r.get("booked"), "allowance": r.get("allowance"), "compiled": r["compiled"],
        "measured": measured,
        "oom": r["oom"], "oom_phase": r.get("oom_phase"), "error": r.get("error"),
        "bytes_limit": r.get("bytes_limit"), "allocator_env": r.get("allocator_env"),
        "phases": r.get("phases"), "outside_allocator_bytes": r.get("outside_allocator_bytes"),
        "error_pct": _pct(r["compiled"], measured),
        "booked_vs_measured_pct": _pct(r.get("booked"), measured)
        if r["batch"] == r["plan_batch"] else None,
    }


# --------------------------------------------------------------------------- one trial twice

def _tree_sha256(tree: Any) -> str:
    import jax
    import numpy as np

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()


def _checkpoint_sha256(directory: Path) -> str:
    """SHA-256 of the arrays of the newest checkpoint under ``directory`` (read with orbax)."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(directory.resolve()) as manager:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        return _tree_sha256(manager.restore(step, args=ocp.args.StandardRestore()))


def trial_twice(family: str, steps: int, batch: int, root: Path) -> dict[str, Any]:
    """One trial of `benchmarks.fusion`'s group (member 0, its plan) run twice, the same
    compiled program both times: the run-to-run noise beside the fused-vs-solo differences.

    Returns per run ``wall_s`` (seconds; the first includes the compile), ``steady_step_s``
    (seconds per step between the first and the last loss read-back, every step read back),
    ``first_loss`` (the loss of step 1), ``loss`` (final) and ``checkpoint_sha256``; and
    ``planning_s``, ``first_loss_rel_diff``, ``final_loss_rel_diff``, ``same_bytes``.
    """
    import dataclasses

    import jax
    from flax import nnx

    from benchmarks import fusion
    from scamp_jax._units import parse_bytes
    from scamp_jax.hpo.runner import RunSpec, StepCache, make_optimizer, run_trial
    from scamp_jax.planning import planner

    experiment = fusion._experiment(family)
    hpo = dataclasses.replace(experiment.get_config("smoke"), seed=0)
    space, task = experiment.make_space_and_task(hpo)
    config, seed, _ = fusion.member_configs(family, 1)[0]
    budget = parse_bytes(hpo.memory_per_device)
    model = nnx.eval_shape(lambda: space.build(config, nnx.Rngs(0)))
    t0 = time.perf_counter()
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                             memory_per_device=budget, max_batch_size=batch,
                             optimizer=make_optimizer({}), loss_fn=task.loss_fn)
    planning_s = time.perf_counter() - t0
    cache = StepCache()
    runs: list[dict[str, Any]] = []
    for i in range(2):
        losses: list[tuple[int, float, float]] = []
        spec = RunSpec(number=0, params=config, plan=plan, steps=steps, memory_per_device=budget,
                       seed=seed, checkpoint_dir=root / f"run{i}", log_every=1)
        t0 = time.perf_counter()

        def on_loss(n: int, s: int, v: float,
                    into: list[tuple[int, float, float]] = losses) -> None:
            into.append((s, v, time.perf_counter()))

        result = run_trial(spec, space, task, cache=cache, on_loss=on_loss)
        wall = time.perf_counter() - t0
        if result.state != "complete":
            raise RuntimeError(f"{family} trial run {i} ended {result.state}: {result.reason}")
        first, last = losses[0], losses[-1]
        runs.append({"wall_s": wall, "loss": result.loss, "first_loss": first[1],
                     "steady_step_s": (last[2] - first[2]) / (last[0] - first[0])
                     if last[0] > first[0] else None,
                     "checkpoint_sha256": _checkpoint_sha256(root / f"run{i}")})
    a, b = runs
    return {"family": family, "steps": steps, "batch": plan.batch_size, "planning_s": planning_s,
            "runs": runs, "first_loss_rel_diff": rel_diff(b["first_loss"], a["first_loss"]),
            "final_loss_rel_diff": rel_diff(b["loss"], a["loss"]),
            "same_bytes": a["checkpoint_sha256"] == b["checkpoint_sha256"]
            and a["loss"] == b["loss"]}


# --------------------------------------------------------------------------- fusion

def fusion_section(cfg: Any, ctx: Context, rec: Record) -> None:
    """Fused vs one after another, the same trials (`benchmarks.fusion`): end to end and in
    steady state, compile and planning apart, what it measured saved as it goes; then the
    noise floor (one trial twice) and one member's step at K times the batch, as time
    allows."""
    import tempfile

    from benchmarks import fusion

    def keep(partial: dict[str, Any]) -> None:
        rec.body["fusion_so_far"] = partial
        rec.save()

    _timeout(ctx, cfg.fusion_least_seconds)
    report = fusion.run(cfg.fusion_family, cfg.fusion_width, steps=cfg.fusion_steps,
                        batch=cfg.fusion_batch, repeats=1, ray=False, concurrent=False,
                        wide=False, progress=keep)
    rec.body["fusion"] = report
    row = _fusion_row(cfg, report)
    rec.add_row(row)
    # The noise floor: the fused-vs-solo gap above against one trial run twice.
    _timeout(ctx, cfg.fusion_least_seconds)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-suite-noise-") as tmp:
            noise = trial_twice(cfg.fusion_family, cfg.fusion_steps, cfg.fusion_batch,
                                Path(tmp))
    except Exception as err:  # noqa: BLE001 - the fused row above is the section's point
        rec.body["noise_floor_error"] = f"{type(err).__name__}: {err}"
    else:
        rec.body["noise_floor"] = noise
        row.update(noise_floor_first_step=noise["first_loss_rel_diff"],
                   noise_floor_final_loss=noise["final_loss_rel_diff"])
    rec.save()
    # One member's step at K times the batch last: two more compiles (the solo step again and
    # the wide one), which the section's time may not hold; the row above is kept either way.
    _timeout(ctx, cfg.fusion_least_seconds)
    try:
        wide = fusion.step_times(cfg.fusion_family, cfg.fusion_width, cfg.fusion_batch,
                                 ways=("wide",))
    except Exception as err:  # noqa: BLE001 - the fused row above is the section's point
        rec.body["wide_error"] = f"{type(err).__name__}: {err}"
    else:
        rec.body["wide"] = wide
        row["wide_speedup"] = wide["wide_speedup"]
    rec.save()
    # The fused step with its convolutions in the form the rows above did not run
    # (`scamp_jax.planning.member_ops`: by default grouped on a GPU, member by member on CPU),
    # against the same solo steps: which form a fused group should run here.
    from scamp_jax.planning.member_ops import forced_form, form_on

    _timeout(ctx, cfg.fusion_least_seconds)
    other = "grouped" if form_on(ctx.platform) == "per_member" else "per_member"
    try:
        with forced_form(other):
            alt = fusion.step_times(cfg.fusion_family, cfg.fusion_width, cfg.fusion_batch,
                                    ways=("fused",))
    except Exception as err:  # noqa: BLE001 - the fused row above is the section's point
        rec.body["other_form_error"] = f"{type(err).__name__}: {err}"
    else:
        rec.body["other_form"] = {"form": other, **alt}
        row["other_form"] = other
        row["other_form_step_speedup"] = alt["step_speedup"]
    rec.save()


def _fusion_row(cfg: Any, report: dict[str, Any]) -> dict[str, Any]:
    """One row of the fusion table: the steady steps (medians), ``steady_speedup``,
    ``step_speedup``, ``wide_speedup`` (later) and the members' ``first_step_rel_diff``, as
    `benchmarks.fusion` reports them; the noise floor's and the other convolution form's
    figures are added once measured."""
    members = report["members"]
    firsts = [m["first_step_rel_diff"] for m in members if "first_step_rel_diff" in m]
    steady = report.get("steady") or {}
    return {
        "family": cfg.fusion_family, "width": cfg.fusion_width, "steps": cfg.fusion_steps,
        "batch": cfg.fusion_batch,
        "steady_step_solo_s": (steady.get("solo_step_seconds") or {}).get("median"),
        "steady_step_fused_s": (steady.get("fused_step_seconds") or {}).get("median"),
        "steady_speedup": report.get("steady_speedup"),
        "step_speedup": report.get("step_speedup"),
        "wide_speedup": report.get("wide_speedup"),
        "end_to_end_speedup": report["speedup"]["min"],
        "trials_per_hour": report.get("trials_per_hour"),
        "fused_seconds": report["seconds"]["fused"]["min"],
        "unfused_seconds": report["seconds"]["unfused"]["min"],
        "compile_planning_s": report["fused_compile_seconds"]
        + report["fusion_plan"]["planning_seconds"],
        "max_first_step_rel_diff": max(firsts) if firsts else None,
        "max_final_loss_rel_diff": max(m["loss_rel_diff"] for m in members),
        "noise_floor_first_step": None, "noise_floor_final_loss": None,
        "other_form": None, "other_form_step_speedup": None,
    }


# --------------------------------------------------------------------------- packing

def packing_section(cfg: Any, ctx: Context, rec: Record) -> None:
    """The smoke SwinIR study on one device: ScaMP packing vs the fixed baseline, each policy
    in its own process (`benchmarks.hpo_makespan`)."""
    rec.body.update(trials=cfg.packing_trials, steps=cfg.packing_steps)
    for policy in ("scamp", "fixed"):
        out = ctx.out / "packing" / policy
        cmd = [sys.executable, "-m", "benchmarks.hpo_makespan", "--family", "swinir",
               "--policies", policy, "--devices", "1", "--devices-per-trial", "1",
               "--trials", str(cfg.packing_trials), "--steps", str(cfg.packing_steps),
               "--out", str(out)]
        if ctx.bytes_limit:  # the whole device is the pool (the CLI's default is a CPU budget)
            cmd += ["--memory-per-device", str(ctx.bytes_limit)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=_timeout(ctx, cfg.packing_least_seconds))
        except (subprocess.TimeoutExpired, OutOfTime) as err:
            rec.cut(f"{policy} study: {err}")
            return
        (out / "study.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
        if proc.returncode:
            raise RuntimeError(f"{policy} study failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-1500:]}")
        row = json.loads((out / "hpo_makespan.json").read_text())[0]
        row.update(_study_pace(out / policy / "results.json"))
        row["way"] = ("packed (threads on one device)" if policy == "scamp"
                      else "fixed (one trial at a time)")
        rec.add_row(row)
    by = {r["policy"]: r for r in rec.body["rows"]}
    rec.body["speedup_trials_per_hour"] = (by["scamp"]["trials_per_hour"]
                                           / max(by["fixed"]["trials_per_hour"], 1e-9))
    rec.body["note"] = ("each policy in its own process (peak_bytes_in_use is per process); on "
                        "one device the fixed baseline runs one trial at a time at the preset's "
                        "batch; steady s/step: the median over trials of each one's last pace "
                        "(seconds per step since its first step, compile excluded)"
                        + ("" if not ctx.on_cpu else f"; peak: {NOT_ON_CPU}"))
    rec.save()


def _study_pace(results: Path) -> dict[str, Any]:
    """Steady seconds per step (median over trials), compile seconds and the seconds of the
    initial states made on the host (no compile) of a finished study."""
    import statistics

    data = json.loads(results.read_text())
    paces = [t["pace"][-1][2] for t in data.get("trials", []) if t.get("pace")]
    overhead = (data.get("run") or {}).get("overhead") or {}
    compile_s = sum(v for k, v in overhead.items()  # compiled, or read from the cache
                    if k.endswith(("_compile_s", "_cache_load_s"))
                    and not k.startswith("planning"))
    return {"steady_step_s": statistics.median(paces) if paces else None,
            "runner_compile_s": compile_s,
            "planning_compile_s": overhead.get("planning_compile_s"),
            "host_initial_state_s": overhead.get("host_initial_state_s")}


# --------------------------------------------------------------------------- main job

def mainjob_section(cfg: Any, ctx: Context, rec: Record) -> None:
    """The main job as a user runs it (``python -m experiments.swinir_hpo``: the default
    preset of the platform, on GPUs each trial's batch from memory and families fused),
    shortened to ``cfg.mainjob_trials`` trials of ``cfg.mainjob_steps`` steps (at the preset's
    reference batch) so that it ends inside the section: the study's seconds, its compiles
    and their share of it, the pool's memory booked (peak and mean), the batches and fused
    trials, their seconds a step (`step_seconds`), and the best PSNR against bicubic. Past the
    section's time the study is stopped as a user stops it (SIGTERM: running trials
    checkpointed; the record keeps finished trials and the figures up to the stop). After it,
    as time allows, what the
    host's data takes per step of the preset's widest fused group (`benchmarks.member_data`),
    to hold against the fused step."""
    from benchmarks import member_data

    out = ctx.out / "mainjob"
    cmd = [sys.executable, "-m", "experiments.swinir_hpo", "--study-dir", str(out),
           "--no-live", "--trials", str(cfg.mainjob_trials), "--steps", str(cfg.mainjob_steps),
           # a checkpoint at each trial's end only, as the preset's every 100 steps gave these
           # trials before --steps scaled it (which would write one every 10 here)
           "--checkpoint-every", "0"]
    rec.body.update(command=" ".join(["python", *cmd[1:]]), trials=cfg.mainjob_trials,
                    steps=cfg.mainjob_steps)
    rec.save()
    timeout = _timeout(ctx, cfg.mainjob_least_seconds)
    reserve = min(45.0, timeout / 4)  # to checkpoint and report when stopped
    out.mkdir(parents=True, exist_ok=True)
    with (out.parent / "mainjob.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout - reserve)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the CLI's SIGTERM: checkpoint, report what finished
            try:
                code = proc.wait(timeout=reserve - 2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            rec.cut(f"the study was stopped at the section's time ({timeout - reserve:.0f} s)")
    results = out / "results.json"
    if not results.is_file():
        if rec.body.get("cut_short"):
            return  # stopped before it reported anything: the cut says so
        raise RuntimeError(f"the main job wrote no results.json (exit {code}); see "
                           "mainjob.log")
    width, batch = cfg.mainjob_data
    row = {**mainjob_row(json.loads(results.read_text())), "host_data_s": None,
           "host_data": f"{width} x {batch}"}
    rec.add_row(row)
    if code and not rec.body.get("cut_short"):
        raise RuntimeError(f"the main job exited {code}; see mainjob.log")
    left = ctx.left()
    if left < cfg.mainjob_data_seconds:
        rec.body["member_data_error"] = (f"not measured: {left:.0f} s left after the study, "
                                         f"less than {cfg.mainjob_data_seconds:.0f} s")
    else:
        try:
            data = member_data.measure("swinir", width, batch, repeats=2)
        except Exception as err:  # noqa: BLE001 - the study above is the section's point
            rec.body["member_data_error"] = f"{type(err).__name__}: {err}"
        else:
            rec.body["member_data"] = data
            row["host_data_s"] = data["seconds"]["runner"]["median"]
    rec.save()


def mainjob_row(data: dict[str, Any]) -> dict[str, Any]:
    """What the section reports of a main job's ``results.json``."""
    run = data.get("run") or {}
    usage, overhead = run.get("usage") or {}, run.get("overhead") or {}
    trials = data.get("trials", [])
    done = [t for t in trials if t.get("state") == "complete"]
    compile_s = sum(v for k, v in overhead.items()  # compiled, or read from the cache
                    if k.endswith(("_compile_s", "_cache_load_s")))
    elapsed = run.get("elapsed_s")
    best = next((t for t in trials if t.get("number") == data.get("best")), None)
    metric = data.get("metric", "psnr")
    tested = data.get("test") or {}
    if best is None or tested.get("trial") != best.get("number"):
        tested = {}

    def step_s(fused: bool) -> float | None:
        """Median over the finished trials of their seconds a training step (``step_seconds``:
        every trial that trained all its steps has one, however short)."""
        steps = [t["step_seconds"] for t in done if t.get("step_seconds")
                 and (t.get("fused_group") is not None) == fused]
        return statistics.median(steps) if steps else None

    # The least a solo step takes, as `--plan-only` says it for a GPU target
    # (`scamp_jax.hpo.preview.compute_seconds`): the plan's FLOPs per device at the FLOP/s the
    # engine paced trials by (``run.peak_flops``; None on CPU devices), beside the measured step.
    peak = run.get("peak_flops")
    pairs = []
    for t in done:
        flops = (t.get("plan") or {}).get("flops_per_step")
        if peak and flops and t.get("step_seconds") and t.get("fused_group") is None:
            pairs.append((flops / peak, t["step_seconds"]))

    return {
        "trials_finished": len(done), "trials": len(trials), "study_s": elapsed,
        "interrupted": bool(run.get("interrupted")),
        "compile_s": compile_s if overhead else None,
        "compile_share": compile_s / elapsed if overhead and elapsed else None,
        "planning_compiles": overhead.get("planning_compiles"),
        "peak_memory_utilization": usage.get("peak_memory_utilization"),
        "mean_memory_utilization": usage.get("mean_memory_utilization"),
        "batch_sizes": sorted({int(t["batch_size"]) for t in done if t.get("batch_size")}),
        "fused_trials": sum(1 for t in done if t.get("fused_group") is not None),
        "fused_step_s": step_s(True), "solo_step_s": step_s(False),
        "solo_least_step_s": statistics.median(f for f, _ in pairs) if pairs else None,
        "solo_step_over_least": statistics.median(m / f for f, m in pairs) if pairs else None,
        "best": None if best is None else best.get(metric),
        "bicubic": None if best is None else best.get("bicubic_" + metric),
        # the best model tested on images no trial was chosen by (where the run tested it)
        "test": tested.get(metric), "test_bicubic": tested.get("bicubic_" + metric),
    }


# --------------------------------------------------------------------------- supernet

def stages_for(cfg: Any, ctx: Context) -> int:
    """Pipeline stages: one per device, at most ``cfg.supernet_max_stages``."""
    return max(1, min(cfg.supernet_max_stages, ctx.devices))


def supernet_section(cfg: Any, ctx: Context, rec: Record) -> None:
    """CSP vs GPipe vs sequential, end to end and steady samples/s, offload on and off."""
    from benchmarks.supernet_pipeline import measure_schedules

    stages = stages_for(cfg, ctx)
    hashes = {}
    for offload in (True, False):
        _timeout(ctx, cfg.supernet_least_seconds)
        names = ("csp", "sequential", "gpipe") if offload else ("csp",)
        got = measure_schedules(cfg.supernet_choices, stages, cfg.supernet_subnets,
                                offload=offload, schedules=names)
        for name, res in got["results"].items():
            hashes[(name, offload)] = res.params_sha256
            rec.add_row({
                "schedule": name, "offload": offload, "stages": stages,
                "choices": cfg.supernet_choices, "params_sha256": res.params_sha256,
                "wall_seconds": res.wall_seconds, "steady_seconds": res.steady_seconds,
                "samples_per_second": res.samples_per_second,
                "end_to_end_samples_per_second":
                    cfg.supernet_subnets * 8 / res.wall_seconds if res.wall_seconds else None,
                "device_param_bytes": res.device_param_bytes,
                "host_param_bytes": res.host_param_bytes,
                "host_to_device_bytes": got["transfer_bytes"][name]["host_to_device"],
                "device_to_host_bytes": got["transfer_bytes"][name]["device_to_host"],
            })
        if offload:
            sps = {r["schedule"]: r["samples_per_second"] for r in rec.body["rows"]}
            rec.body["csp_over_sequential"] = sps["csp"] / sps["sequential"]
            rec.body["csp_over_gpipe"] = sps["csp"] / sps["gpipe"]
            rec.body["csp_equals_sequential"] = hashes[("csp", True)] == hashes[
                ("sequential", True)]
            rec.save()
    rec.body["offload_equals_resident"] = hashes[("csp", True)] == hashes[("csp", False)]
    rec.body["note"] = (f"{stages} stage(s), one per device, batch 8; steady: ticks after the "
                        "first (compile excluded); transfer bytes counted from the schedule's "
                        "prefetch and write-back instructions x the bytes of a block (weights + "
                        "Adam); noise floor of the equalities: the determinism section")
    rec.save()


# --------------------------------------------------------------------------- determinism

def determinism_section(cfg: Any, ctx: Context, rec: Record) -> None:
    """The CSP pipeline twice and one trial twice (deterministic XLA kernels): the same bytes."""
    import tempfile

    from benchmarks.supernet_pipeline import measure_schedules
    from scamp_jax.pipeline.determinism import DETERMINISTIC_FLAG

    rec.body["deterministic_gpu_ops"] = (
        f"--{DETERMINISTIC_FLAG}=true" in os.environ.get("XLA_FLAGS", ""))
    stages = stages_for(cfg, ctx)
    csp = []
    start = time.perf_counter()
    for _ in range(2):
        _timeout(ctx, cfg.supernet_least_seconds)
        got = measure_schedules(cfg.supernet_choices, stages, cfg.supernet_subnets,
                                schedules=("csp",))["results"]["csp"]
        csp.append((got.params_sha256, float(got.losses[-1])))
    rec.add_row({"what": f"CSP pipeline ({stages} stage(s), {cfg.supernet_choices} choices)",
                 "steps": cfg.supernet_subnets, "same_bytes": csp[0][0] == csp[1][0],
                 "sha256": [c[0] for c in csp], "max_rel_diff": rel_diff(csp[1][1], csp[0][1]),
                 "seconds": time.perf_counter() - start})
    _timeout(ctx, cfg.fusion_least_seconds)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-suite-det-") as tmp:
        twice = trial_twice(cfg.fusion_family, cfg.trial_steps, cfg.fusion_batch, Path(tmp))
    rec.add_row({"what": f"{cfg.fusion_family} trial (batch {twice['batch']})",
                 "steps": cfg.trial_steps, "same_bytes": twice["same_bytes"],
                 "max_rel_diff": twice["final_loss_rel_diff"], "runs": twice["runs"],
                 "seconds": time.perf_counter() - start})


# --------------------------------------------------------------------------- gpu-marked tests

def tests_section(cfg: Any, ctx: Context, rec: Record) -> None:
    """``pytest -m gpu`` of ``cfg.test_files`` (``-k cfg.test_keyword``); each test's outcome
    recorded as it finishes."""
    import re

    root = Path(__file__).resolve().parents[1]
    rec.body["files"] = list(cfg.test_files)
    log = ctx.out / "logs" / "pytest_gpu.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if not ctx.on_cpu:
        env["JAX_PLATFORMS"] = "cuda"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider",
           "--durations=0", *cfg.test_files]
    if cfg.test_keyword:
        cmd += ["-k", cfg.test_keyword]
        rec.body["keyword"] = cfg.test_keyword
    result = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
    start = time.perf_counter()
    timeout = _timeout(ctx, 10.0)
    with log.open("w") as sink, subprocess.Popen(cmd, cwd=root, env=env, text=True,
                                                 stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        last = start
        try:
            for line in proc.stdout:
                sink.write(line)
                sink.flush()
                m = result.match(line)
                if m:
                    now = time.perf_counter()
                    rec.add_row({"test": m.group(1), "outcome": m.group(2).lower(),
                                 "seconds": now - last})
                    last = now
        finally:
            timer.cancel()
        code = proc.wait()
    rec.body["exit_code"] = code
    if code in (-9, 137) or time.perf_counter() - start >= timeout:
        rec.cut(f"pytest stopped at the section's deadline after {len(rec.body['rows'])} tests")
    elif code not in (0, 1, 5):  # 1: some failed (recorded per test); 5: none collected
        raise RuntimeError(f"pytest exited {code}; see logs/pytest_gpu.log")
    rec.save()


# --------------------------------------------------------------------------- compiles

def compiles_section(cfg: Any, ctx: Context, rec: Record) -> None:
    """What planning a new architecture costs here (`benchmarks.compiles`, a fresh process per
    plan: JAX's in-process caches empty, no persistent cache): for each of
    ``cfg.compiles_cases`` (case, budget, planning only) the wall and CPU seconds, compiles,
    batch and compiled peak, or how long it ran without finishing."""
    root = Path(__file__).resolve().parents[1]
    for case, budget, planning_only in cfg.compiles_cases:
        form = "planning only" if planning_only else "run-ready"
        cmd = [sys.executable, "-m", "benchmarks.compiles", "--case", case, "--devices", "1"]
        if budget is not None:
            cmd += ["--memory-per-device", budget]
        if planning_only:
            cmd.append("--planning-only")
        row: dict[str, Any] = {"case": case, "budget": budget or "the case's", "form": form}
        try:
            timeout = _timeout(ctx, cfg.compiles_least_seconds)
        except OutOfTime as err:
            rec.cut(f"{case} {form}: {err}")
            return
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            row["unfinished_s"] = time.perf_counter() - start
            rec.add_row(row)
            rec.cut(f"{case} {form} did not finish in {row['unfinished_s']:.0f} s")
            return
        row["process_s"] = time.perf_counter() - start
        if proc.returncode:  # said in its row; the next plan is still measured
            row["error"] = (f"exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
        else:
            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        rec.add_row(row)


RUNNERS: dict[str, Callable[[Any, Context, Record], None]] = {
    "compiles": compiles_section,
    "memory": memory_section, "fusion": fusion_section, "mainjob": mainjob_section,
    "packing": packing_section, "determinism": determinism_section,
    "supernet": supernet_section, "tests": tests_section,
}


if __name__ == "__main__":
    raise SystemExit("benchmarks.gpu_sections is a part of the GPU suite, not a command: run "
                     "python -m benchmarks.gpu_suite --help")
