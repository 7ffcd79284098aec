"""Every accelerator measurement of the project in one command, rehearsed on CPU.

Run::

    python -m benchmarks.gpu_suite --out runs/gpu_suite              # one GPU: about 25 min (H100)
    python -m benchmarks.gpu_suite --out /tmp/suite --cpu-smoke      # CPU devices: ~5 CPU-min

Writes ``OUT/gpu_suite.json`` (one key per section: ``memory``, ``packing``, ``fusion``,
``supernet``, ``determinism``, and ``meta``) and ``OUT/gpu_suite.md`` (the tables, ready for
BENCHMARKS.md), both rewritten after every section so that a run cut short keeps what it measured.
A section that fails records its error in its own entry and the suite goes on.

Sections (each prints its expected duration before it starts):

- **memory**: for an MLP, a ViT, the small space's largest SwinIR, the paper's classical SwinIR
  and a fused group of ViTs, the planner's figure, XLA's compiled figure and the measured
  ``peak_bytes_in_use`` (`benchmarks.memory_accuracy.measure_in_child`: a fresh process per run,
  its allocator capped at the case's limit) at the planned batch (10% margin) and at the largest
  batch (no margin), the error in %, then larger batches until one really runs out of memory (the
  plan's headroom); from these runs, the allowance for memory XLA does not see on this device
  kind (`record_allowance`), stored in the plan cache (``--plan-cache``) so that every later plan
  on it adds it. CPU devices have no allocator statistics or limit: there the planned and
  compiled figures are measured, the rest is recorded as not measurable, and the allowance is 0.
- **packing**: the smoke SwinIR study on one device, ScaMP (trials packed by planned memory,
  threads on one device queue) against the fixed baseline (on one device: one trial at a time),
  each in its own process (`benchmarks.hpo_makespan --policies`): trials/h, memory use
  (the pool's mean utilisation and the allocator's peak).
- **fusion**: the same trials fused, one after another and packed as threads
  (`benchmarks.fusion.run`): trials/h and the fused-vs-solo loss difference.
- **supernet**: CSP vs GPipe vs sequential samples/s on the stage devices there are (one GPU: one
  stage), offload on and off, and the host <-> device bytes of the weights
  (`benchmarks.supernet_pipeline.measure_schedules`).
- **determinism**: the CSP pipeline twice and one SwinIR trial twice give the same bytes.

GPU runs use deterministic XLA kernels (`use_deterministic_gpu_ops`) so that the equality checks
mean something, and preallocation off (`scamp_jax.configure_device_memory`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SECTIONS = ("memory", "packing", "fusion", "supernet", "determinism")
NOT_ON_CPU = "not measurable on CPU: CPU devices report no allocator statistics or limit"


@dataclass(frozen=True)
class MemoryCase:
    """A `benchmarks.memory_accuracy` case to measure.

    Attributes:
      name: the case's name (``memory_accuracy.BY_NAME``).
      fuse: measure a fused group of up to this many members (0: a single model).
      gpu_limit: the allocator's limit on a GPU (``XLA_CLIENT_MEM_FRACTION`` of the device) and
        so the planner's budget; None: the whole device.
      cpu_budget: the planner's budget on CPU devices (None: the case's own).
      child: on CPU, measure in a child process too (on GPUs every run is in a child).
      cpu_skip: on CPU, do not run; the reason is recorded.
    """

    name: str
    fuse: int = 0
    gpu_limit: str | None = None
    cpu_budget: str | None = None
    child: bool = False
    cpu_skip: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} fused x{self.fuse}" if self.fuse else self.name


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes of one suite run; `GPU` for an accelerator, `CPU_SMOKE` for the rehearsal."""

    name: str
    memory_cases: tuple[MemoryCase, ...]
    oom_probes: int  # larger batches tried after the largest planned one (0: no OOM search)
    oom_growth: float  # each probe's batch over the previous one's
    packing_trials: int
    packing_steps: int
    fusion_width: int
    fusion_steps: int
    fusion_batch: int
    supernet_choices: int
    supernet_subnets: int
    supernet_max_stages: int
    trial_steps: int  # the determinism section's SwinIR trial
    expected_seconds: dict[str, int] = field(default_factory=dict)


GPU = SuiteConfig(
    name="gpu",
    memory_cases=(
        MemoryCase("mlp", gpu_limit="512MiB"),
        MemoryCase("vit", gpu_limit="1GiB"),
        MemoryCase("swinir_small", gpu_limit="2GiB"),
        MemoryCase("vit", fuse=4, gpu_limit="1GiB"),
        MemoryCase("swinir_paper"),  # last: its compiles are the longest
    ),
    oom_probes=3, oom_growth=1.5,
    packing_trials=12, packing_steps=200,
    fusion_width=4, fusion_steps=200, fusion_batch=8,
    supernet_choices=4, supernet_subnets=48, supernet_max_stages=4,
    trial_steps=50,
    # Planned, not yet measured on a GPU: 24 minutes in all, inside the 25-minute lease.
    expected_seconds={"memory": 600, "packing": 360, "fusion": 240, "supernet": 120,
                      "determinism": 120},
)

_SHORT = ("not in the CPU rehearsal, to keep it short: the MLP (in a child process) and the "
          "fused ViT group rehearse the same code; every case runs on GPUs")

CPU_SMOKE = SuiteConfig(
    name="cpu-smoke",
    memory_cases=(
        MemoryCase("mlp", child=True),
        MemoryCase("vit", cpu_skip=_SHORT),
        MemoryCase("swinir_small", cpu_skip=_SHORT),
        MemoryCase("swinir_paper", cpu_skip="the paper SwinIR (36 blocks) compiles for minutes "
                                            "on CPU; it runs on GPUs"),
        MemoryCase("vit", fuse=2, cpu_budget="64MiB"),
    ),
    oom_probes=0, oom_growth=1.5,
    packing_trials=2, packing_steps=1,
    fusion_width=2, fusion_steps=1, fusion_batch=4,
    supernet_choices=2, supernet_subnets=4, supernet_max_stages=2,
    trial_steps=1,
    # CPU seconds each section used in one run (this process and its children, 291 in all):
    # about the wall time with a core to spare; on a loaded machine far longer (14 min of wall
    # time at a load of 13 on 2 cores). tests/test_gpu_suite.py runs this configuration.
    expected_seconds={"memory": 80, "packing": 80, "fusion": 90, "supernet": 15,
                      "determinism": 35},
)


@dataclass(frozen=True)
class Context:
    """What the suite runs on."""

    platform: str
    device_kind: str
    devices: int
    bytes_limit: int | None  # the allocator's limit of device 0 in this process
    device_bytes: int | None  # the device's memory: bytes_limit / the allocator's fraction
    out: Path
    plan_cache: Path  # where the measured allowance is stored

    @property
    def on_cpu(self) -> bool:
        return self.platform == "cpu"


def _pct(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else 100.0 * (a - b) / b


def _allocator_fraction() -> float:
    """The fraction of device memory this process's allocator may use (XLA's default 0.75)."""
    from scamp_jax.devices import MEM_FRACTION_VAR, OLD_MEM_FRACTION_VAR

    for name in (MEM_FRACTION_VAR, OLD_MEM_FRACTION_VAR):
        if os.environ.get(name):
            return float(os.environ[name])
    return 0.75


# --------------------------------------------------------------------------- memory

def memory_section(cfg: SuiteConfig, ctx: Context) -> dict[str, Any]:
    """Predicted vs compiled vs measured peaks; the first batch that really runs out of memory."""
    from benchmarks.memory_accuracy import BY_NAME, measure_in_child, measure_real_step
    from scamp_jax._units import parse_bytes

    cache = str(ctx.out / "memory_plans.sqlite")
    rows: list[dict[str, Any]] = []
    cases: dict[str, Any] = {}
    for case in cfg.memory_cases:
        if ctx.on_cpu and case.cpu_skip:
            cases[case.label] = {"skipped": case.cpu_skip}
            continue
        started = time.perf_counter()
        fraction = None
        if not ctx.on_cpu and case.gpu_limit is not None and ctx.device_bytes:
            fraction = min(1.0, parse_bytes(case.gpu_limit) / ctx.device_bytes)

        def run(batch: int | None, margin: float, case: MemoryCase = case,
                fraction: float | None = fraction) -> dict[str, Any]:
            budget = case.cpu_budget if ctx.on_cpu else None
            if ctx.on_cpu and not case.child:
                return measure_real_step(BY_NAME[case.name], ctx.devices, budget, batch=batch,
                                         safety_margin=margin, fuse=case.fuse, cache=cache)
            return measure_in_child(case.name, ctx.devices, budget, batch=batch,
                                    safety_margin=margin, fuse=case.fuse, cache=cache,
                                    memory_fraction=fraction)

        summary: dict[str, Any] = {"gpu_limit": case.gpu_limit, "memory_fraction": fraction}
        points = [("planned (10% margin)", None, 0.1), ("largest (no margin)", None, 0.0)]
        last = None
        for point, batch, margin in points:
            r = run(batch, margin)
            rows.append(_memory_row(case, point, r))
            last = r
        if ctx.on_cpu:
            summary["first_oom_batch"] = NOT_ON_CPU
        elif last is not None and not last["oom"]:
            summary.update(_oom_search(cfg, case, last, lambda b: run(b, 0.0), rows))
        planned = next(r for r in rows if r["case"] == case.label)
        if isinstance(summary.get("first_oom_batch"), int):
            summary["headroom"] = summary["first_oom_batch"] / planned["batch"]
        summary["seconds"] = time.perf_counter() - started
        cases[case.label] = summary
        print(f"[gpu_suite] memory {case.label}: {summary['seconds']:.0f} s", flush=True)
    note = NOT_ON_CPU if ctx.on_cpu else (
        "measured = max peak_bytes_in_use over the plan's devices after two steps, a fresh "
        "process per row; error = (compiled - measured) / measured")
    return {"rows": rows, "cases": cases, "allowance": record_allowance(rows, ctx), "note": note}


def record_allowance(rows: list[dict[str, Any]], ctx: Context) -> dict[str, Any]:
    """The allowance for memory XLA does not see on this device kind, stored in the plan cache.

    ``unseen_bytes``: the largest ``peak_bytes_in_use - compiled`` over the runs that did not run
    out of memory (workspaces and buffers outside XLA's buffer assignment; 0 when XLA
    over-estimates everywhere); ``context_bytes``: the largest part of the process's device memory
    outside the allocator's pool (CUDA context, library handles) as the driver reports it (0 when
    not measurable). ``bytes`` = their sum, what every later plan on this device kind adds
    (`scamp_jax.planning.plan_cache.resolve_allowance`); the safety margin stays for the rest.
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
    record = {"bytes": unseen + context, "unseen_bytes": unseen, "context_bytes": context,
              "context_measured": bool(outside), "runs": len(ran),
              "jax": jax.__version__, "measured": time.strftime("%Y-%m-%d", time.gmtime())}
    PlanCache(ctx.plan_cache).put_allowance(ctx.platform, ctx.device_kind, record)
    return {**record, "stored": str(ctx.plan_cache)}


def _memory_row(case: MemoryCase, point: str, r: dict[str, Any]) -> dict[str, Any]:
    measured = r.get("peak_in_use")
    return {
        "case": case.label, "point": point, "width": r["width"], "batch": r["batch"],
        "plan_batch": r["plan_batch"], "planned": r["planned"], "compiled": r["compiled"],
        "measured": measured if measured is not None else None, "oom": r["oom"],
        "bytes_limit": r.get("bytes_limit"),
        "outside_allocator_bytes": r.get("outside_allocator_bytes"),
        "planned_vs_compiled_pct": _pct(r["planned"], r["compiled"])
        if r["batch"] == r["plan_batch"] else None,
        "error_pct": _pct(r["compiled"], measured),
    }


def _oom_search(cfg: SuiteConfig, case: MemoryCase, largest: dict[str, Any],
                run: Callable[[int], dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Run ever larger batches (x ``oom_growth``) until one runs out of memory."""
    batch, dp = largest["batch"], largest["data_parallel"]
    for probe in range(cfg.oom_probes):
        batch = max(batch + dp, -(-int(batch * cfg.oom_growth) // dp) * dp)
        r = run(batch)
        rows.append(_memory_row(case, f"probe {probe + 1}", r))
        if r["oom"]:
            return {"first_oom_batch": batch}
    return {"first_oom_batch": None,
            "oom_search": f"no out-of-memory up to batch {batch} ({cfg.oom_probes} probes)"}


# --------------------------------------------------------------------------- packing

def packing_section(cfg: SuiteConfig, ctx: Context) -> dict[str, Any]:
    """The smoke SwinIR study on one device: ScaMP packing vs the fixed baseline."""
    import subprocess

    rows = []
    for policy in ("scamp", "fixed"):
        out = ctx.out / "packing" / policy
        cmd = [sys.executable, "-m", "benchmarks.hpo_makespan", "--family", "swinir",
               "--policies", policy, "--devices", "1", "--devices-per-trial", "1",
               "--trials", str(cfg.packing_trials), "--steps", str(cfg.packing_steps),
               "--out", str(out)]
        if ctx.bytes_limit:  # the whole device is the pool (the CLI's default is a CPU budget)
            cmd += ["--memory-per-device", str(ctx.bytes_limit)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{policy} study failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-1500:]}")
        row = json.loads((out / "hpo_makespan.json").read_text())[0]
        row["way"] = ("packed (threads on one device)" if policy == "scamp"
                      else "fixed (one trial at a time)")
        rows.append(row)
    by = {r["policy"]: r for r in rows}
    return {
        "rows": rows,
        "speedup_trials_per_hour": by["scamp"]["trials_per_hour"]
        / max(by["fixed"]["trials_per_hour"], 1e-9),
        "note": "each policy in its own process (peak_bytes_in_use is per process); on one "
                "device the fixed baseline runs one trial at a time at the preset's batch"
                + ("" if not ctx.on_cpu else f"; peak: {NOT_ON_CPU}"),
    }


# --------------------------------------------------------------------------- fusion

def fusion_section(cfg: SuiteConfig, ctx: Context) -> dict[str, Any]:
    """Fused vs one after another vs packed threads, the same trials."""
    from benchmarks import fusion

    report = fusion.run("swinir", cfg.fusion_width, steps=cfg.fusion_steps,
                        batch=cfg.fusion_batch, repeats=1, ray=False, concurrent=True)
    rows = [{"way": name, "seconds": report["seconds"][key]["min"],
             "trials_per_hour": report["trials_per_hour"][key]}
            for name, key in (("fused", "fused"), ("one after another", "unfused"),
                              ("packed threads", "concurrent"))]
    diff = max(m["loss_rel_diff"] for m in report["members"])
    return {
        "rows": rows, "members": report["members"], "fused_vs_solo_max_rel_loss_diff": diff,
        "width": cfg.fusion_width, "steps": cfg.fusion_steps, "batch": cfg.fusion_batch,
        "note": ("packed threads share one device" if ctx.devices == 1
                 else f"packed threads run on {min(ctx.devices, cfg.fusion_width)} devices"),
    }


# --------------------------------------------------------------------------- supernet

def _stages(cfg: SuiteConfig, ctx: Context) -> int:
    return max(1, min(cfg.supernet_max_stages, ctx.devices))


def supernet_section(cfg: SuiteConfig, ctx: Context) -> dict[str, Any]:
    """CSP vs GPipe vs sequential samples/s, offload on and off, weight traffic."""
    from benchmarks.supernet_pipeline import measure_schedules

    stages = _stages(cfg, ctx)
    rows = []
    hashes = {}
    for offload in (True, False):
        names = ("csp", "sequential", "gpipe") if offload else ("csp",)
        got = measure_schedules(cfg.supernet_choices, stages, cfg.supernet_subnets,
                                offload=offload, schedules=names)
        for name, res in got["results"].items():
            hashes[(name, offload)] = res.params_sha256
            rows.append({
                "schedule": name, "offload": offload, "stages": stages,
                "samples_per_second": res.samples_per_second,
                "device_param_bytes": res.device_param_bytes,
                "host_param_bytes": res.host_param_bytes,
                "host_to_device_bytes": got["transfer_bytes"][name]["host_to_device"],
                "device_to_host_bytes": got["transfer_bytes"][name]["device_to_host"],
            })
    sps = {(r["schedule"], r["offload"]): r["samples_per_second"] for r in rows}
    return {
        "rows": rows,
        "csp_over_sequential": sps[("csp", True)] / sps[("sequential", True)],
        "csp_over_gpipe": sps[("csp", True)] / sps[("gpipe", True)],
        "csp_equals_sequential": hashes[("csp", True)] == hashes[("sequential", True)],
        "offload_equals_resident": hashes[("csp", True)] == hashes[("csp", False)],
        "note": f"{stages} stage(s), one per device; transfer bytes counted from the schedule's "
                "prefetch and write-back instructions x the bytes of a block (weights + Adam)",
    }


# --------------------------------------------------------------------------- determinism

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


def determinism_section(cfg: SuiteConfig, ctx: Context) -> dict[str, Any]:
    """The CSP pipeline twice and one SwinIR trial twice: the same bytes each time."""
    import dataclasses

    import jax
    from flax import nnx

    from benchmarks import fusion
    from benchmarks.supernet_pipeline import measure_schedules
    from scamp_jax._units import parse_bytes
    from scamp_jax.hpo.runner import RunSpec, make_optimizer, run_trial
    from scamp_jax.pipeline.determinism import DETERMINISTIC_FLAG
    from scamp_jax.planning import planner

    stages = _stages(cfg, ctx)
    csp = [measure_schedules(cfg.supernet_choices, stages, cfg.supernet_subnets,
                             schedules=("csp",))["results"]["csp"].params_sha256
           for _ in range(2)]
    experiment = fusion._experiment("swinir")
    hpo = dataclasses.replace(experiment.get_config("smoke"), seed=0)
    space, task = experiment.make_space_and_task(hpo)
    config, seed, _ = fusion.member_configs("swinir", 1)[0]
    budget = parse_bytes(hpo.memory_per_device)
    model = nnx.eval_shape(lambda: space.build(config, nnx.Rngs(0)))
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                             memory_per_device=budget, max_batch_size=cfg.fusion_batch,
                             optimizer=make_optimizer({}), loss_fn=task.loss_fn)
    trial = []
    with tempfile.TemporaryDirectory(prefix="gpu-suite-det-") as tmp:
        for i in range(2):
            spec = RunSpec(number=0, params=config, plan=plan, steps=cfg.trial_steps,
                           memory_per_device=budget, seed=seed,
                           checkpoint_dir=Path(tmp) / f"run{i}")
            result = run_trial(spec, space, task)
            if result.state != "complete":
                raise RuntimeError(f"trial run {i} ended {result.state}: {result.reason}")
            trial.append({"loss": result.loss, "metrics": dict(result.metrics),
                          "checkpoint_sha256": _checkpoint_sha256(Path(tmp) / f"run{i}")})
    flags = os.environ.get("XLA_FLAGS", "")
    return {
        "rows": [
            {"what": f"CSP pipeline ({stages} stage(s), {cfg.supernet_subnets} subnets)",
             "same_bytes": csp[0] == csp[1], "sha256": csp},
            {"what": f"SwinIR trial ({cfg.trial_steps} steps)",
             "same_bytes": trial[0]["checkpoint_sha256"] == trial[1]["checkpoint_sha256"]
             and trial[0]["loss"] == trial[1]["loss"], "runs": trial},
        ],
        "deterministic_gpu_ops": f"--{DETERMINISTIC_FLAG}=true" in flags,
    }


# --------------------------------------------------------------------------- driver

RUNNERS: dict[str, Callable[[SuiteConfig, Context], dict[str, Any]]] = {
    "memory": memory_section, "packing": packing_section, "fusion": fusion_section,
    "supernet": supernet_section, "determinism": determinism_section,
}


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process and its finished children (all threads)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _context(out: Path, plan_cache: Path | None = None) -> Context:
    import jax

    from scamp_jax import devices as _devices

    device = jax.devices()[0]
    stats = _devices.allocator_stats(device)
    limit = stats["bytes_limit"] if stats and "bytes_limit" in stats else None
    return Context(platform=device.platform, device_kind=str(device.device_kind),
                   devices=len(jax.devices()), bytes_limit=limit,
                   device_bytes=int(limit / _allocator_fraction()) if limit else None, out=out,
                   plan_cache=plan_cache or out / "plans.sqlite")


def run_suite(cfg: SuiteConfig, out: Path, only: tuple[str, ...] = SECTIONS,
              plan_cache: Path | None = None) -> dict[str, Any]:
    """Run the sections of ``only`` in order; write the JSON and Markdown after each.

    ``plan_cache``: the plan-cache file that receives the measured allowance (default
    ``out/plans.sqlite``).
    """
    out.mkdir(parents=True, exist_ok=True)
    ctx = _context(out, plan_cache)
    total = sum(cfg.expected_seconds.get(s, 0) for s in only)
    print(f"[gpu_suite] {cfg.name} on {ctx.devices} x {ctx.device_kind} ({ctx.platform}): "
          f"{len(only)} sections, expected about {total / 60:.0f} min", flush=True)
    report: dict[str, Any] = {"meta": {
        "config": cfg.name, "platform": ctx.platform, "device_kind": ctx.device_kind,
        "devices": ctx.devices, "bytes_limit": ctx.bytes_limit, "device_bytes": ctx.device_bytes,
        "sizes": {k: v for k, v in asdict(cfg).items() if k not in ("memory_cases", "name")},
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }}
    for name in SECTIONS:
        if name not in only:
            report[name] = {"status": "not run", "reason": "not selected (--only)"}
            continue
        expected = cfg.expected_seconds.get(name, 0)
        print(f"[gpu_suite] {name}: expected about {expected} s", flush=True)
        start, cpu = time.perf_counter(), _cpu_seconds()
        try:
            body = RUNNERS[name](cfg, ctx)
            body["status"] = "ok"
        except Exception as err:  # recorded, and the next section runs
            body = {"status": "failed", "error": f"{type(err).__name__}: {err}"[-2000:],
                    "traceback": traceback.format_exc()[-4000:]}
        except SystemExit as err:  # the reused benchmarks exit with a message on bad sizes
            body = {"status": "failed", "error": f"SystemExit: {err}"[-2000:]}
        body["seconds"] = time.perf_counter() - start
        body["cpu_seconds"] = _cpu_seconds() - cpu  # this process and its children
        body["expected_seconds"] = expected
        report[name] = body
        print(f"[gpu_suite] {name}: {body['status']} in {body['seconds']:.0f} s", flush=True)
        write(report, out)
    report["meta"]["seconds"] = sum(report[s].get("seconds", 0.0) for s in SECTIONS)
    write(report, out)
    return report


def write(report: dict[str, Any], out: Path) -> None:
    """``out/gpu_suite.json`` and ``out/gpu_suite.md``."""
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_suite.md").write_text(markdown(report))


def _b(x: Any) -> str:
    from scamp_jax._units import format_bytes

    return "-" if x is None else format_bytes(int(x))


def _p(x: Any) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def markdown(report: dict[str, Any]) -> str:
    """The report's tables as Markdown (a failed or skipped section says so)."""
    meta = report["meta"]
    lines = [f"# GPU suite ({meta['config']}): {meta['devices']} x {meta['device_kind']} "
             f"({meta['platform']}), started {meta['started']}", ""]
    for name in SECTIONS:
        sec = report.get(name)
        if sec is None:
            continue
        lines.append(f"## {name} ({sec.get('seconds', 0):.0f} s, expected "
                     f"{sec.get('expected_seconds', 0)} s)")
        lines.append("")
        if sec.get("status") != "ok":
            lines += [f"{sec.get('status')}: {sec.get('error') or sec.get('reason')}", ""]
            continue
        lines += _SECTION_TABLES[name](sec)
        if sec.get("note"):
            lines += [f"Note: {sec['note']}.", ""]
    return "\n".join(lines)


def _memory_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["case"], r["point"], str(r["width"]), str(r["batch"]), _b(r["planned"]),
             _b(r["compiled"]), "OOM" if r["oom"] else _b(r["measured"]),
             _p(r["error_pct"])] for r in sec["rows"]]
    out = _table(["case", "point", "width", "batch", "planned (at plan batch)", "compiled",
                  "measured peak", "error"], rows)
    cases = [[k, str(v.get("skipped") or v.get("first_oom_batch")),
              f"{v['headroom']:.2f}x" if v.get("headroom") else "-"]
             for k, v in sec["cases"].items()]
    allowance = sec.get("allowance") or {}
    return out + _table(["case", "first batch out of memory", "vs planned batch"], cases) + [
        f"Allowance for memory XLA does not see: {_b(allowance.get('bytes'))}"
        + (f" = {_b(allowance['unseen_bytes'])} unseen + {_b(allowance['context_bytes'])} "
           "outside the allocator" if "unseen_bytes" in allowance else
           f" ({allowance.get('reason', '')})"), ""]


def _packing_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["way"], f"{r['end_to_end_s']:.1f}", f"{r['trials_per_hour']:.1f}",
             f"{100 * r['mean_memory_utilization']:.1f}%", _b(r.get("peak_bytes_in_use"))]
            for r in sec["rows"]]
    return _table(["way", "end-to-end s", "trials/h", "mean memory util.", "peak in use"],
                  rows) + [f"Packed / fixed trials per hour: "
                           f"{sec['speedup_trials_per_hour']:.2f}x", ""]


def _fusion_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["way"], f"{r['seconds']:.1f}", f"{r['trials_per_hour']:.1f}"]
            for r in sec["rows"]]
    return _table(["way", "seconds", "trials/h"], rows) + [
        f"Fused vs solo final loss, largest relative difference: "
        f"{sec['fused_vs_solo_max_rel_loss_diff']:.2e}", ""]


def _supernet_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["schedule"], "on" if r["offload"] else "off", str(r["stages"]),
             f"{r['samples_per_second']:.1f}", _b(r["device_param_bytes"]),
             _b(r["host_param_bytes"]), _b(r["host_to_device_bytes"]),
             _b(r["device_to_host_bytes"])] for r in sec["rows"]]
    return _table(["schedule", "offload", "stages", "samples/s", "device weights",
                   "host weights", "host->device", "device->host"], rows) + [
        f"CSP / sequential {sec['csp_over_sequential']:.2f}x, CSP / GPipe "
        f"{sec['csp_over_gpipe']:.2f}x; CSP == sequential bitwise: "
        f"{sec['csp_equals_sequential']}; offload on == off: {sec['offload_equals_resident']}",
        ""]


def _determinism_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["what"], "yes" if r["same_bytes"] else "NO"] for r in sec["rows"]]
    return _table(["run twice", "same bytes"], rows) + [
        f"Deterministic GPU kernels: {sec['deterministic_gpu_ops']}", ""]


_SECTION_TABLES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "memory": _memory_md, "packing": _packing_md, "fusion": _fusion_md,
    "supernet": _supernet_md, "determinism": _determinism_md,
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse flags, set up devices before JAX starts, run the suite."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path,
                        help="directory of gpu_suite.json and gpu_suite.md")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same code on 8 CPU devices with tiny sizes (a few minutes)")
    parser.add_argument("--plan-cache", type=Path, default=None,
                        help="plan cache (e.g. a study's plans.sqlite) that stores the allowance "
                             "the memory section measures (default: OUT/plans.sqlite)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections (default: all of {','.join(SECTIONS)})")
    args = parser.parse_args(argv)
    only = tuple(s for s in args.only.split(",") if s)
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown or not only:
        parser.error(f"--only {args.only!r}: unknown section(s) {unknown}; choose from "
                     f"{','.join(SECTIONS)}")
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts; the child processes inherit it
    from scamp_jax.devices import configure_cpu_devices
    from scamp_jax.pipeline.determinism import use_deterministic_gpu_ops

    use_deterministic_gpu_ops()  # the determinism section's equalities need it on GPUs
    configure_cpu_devices(8)  # preallocation off too (configure_device_memory)
    import jax

    on_cpu = jax.devices()[0].platform == "cpu"
    if on_cpu and not args.cpu_smoke:
        parser.error("JAX sees only CPU devices; pass --cpu-smoke for the CPU rehearsal, or "
                     "install a GPU backend (BUILD.md, 'CUDA GPUs')")
    return run_suite(CPU_SMOKE if args.cpu_smoke else GPU, args.out, only, args.plan_cache)


if __name__ == "__main__":
    main()
