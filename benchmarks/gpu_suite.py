"""Every accelerator measurement of the project in one short GPU slot, rehearsed on CPU.

Run::

    python -m benchmarks.gpu_suite --out runs/suite                    # one GPU, 9 minutes
    python -m benchmarks.gpu_suite --out runs/suite --minutes 20       # longer: every section
    python -m benchmarks.gpu_suite --out /tmp/suite --cpu-smoke --minutes 4   # CPU rehearsal

On a bare GPU machine with the bundle of ``scripts/gpu_bundle.sh``: ``bash BUNDLE/run.sh OUT``.

The suite ends inside ``--minutes`` (default 9). First it records what a later plan without the
GPU needs (`benchmarks.gpu_env`: versions, ``nvidia-smi``, XLA's target description, in the
archive at once); then it runs the sections in order of value, each in its own process with
its own time cap, a share of the time that is left (`SuiteConfig.shares`), so time a section
does not use goes to the next:

- **mainjob**: the main job as a user runs it (``python -m experiments.swinir_hpo``, the
  platform's default preset: on GPUs batches from memory, families fused), shortened to a few
  trials and steps: its compile seconds against the study's, the pool's memory booked, the
  best PSNR against bicubic (stopped at its time, the record keeps its figures so far);
- **fusion**: a fused group vs its members one after another (`benchmarks.fusion`): end to
  end and steady state, saved as it is measured; then the noise floor (one trial run twice,
  the same program), one member's step at K times the batch and, as time allows, the fused
  step with its convolutions in the other form (member by member on a GPU), which says which
  form a fused group should run there;
- **memory**: each case planned with the allocator capped at the planner's budget (the planner
  reads its budget from the allocator, ``bytes_limit``), one row uncapped, the allocator's
  statistics after init, compile, step 1 and step 2, and the first batch that really runs out
  of memory, by bisection; cases run as parallel processes (memory is per process); their
  runs' autotuned kernel choices are kept in ``OUT/autotune`` for plans of this GPU made
  without it (`benchmarks.target_accuracy`);
- **tests**: ``pytest -m gpu`` of ``tests/test_gpu.py`` and ``tests/test_targets.py``
  (those the other sections measure left out, `SuiteConfig.test_keyword`);
- **compiles**: what planning a new architecture costs (`benchmarks.compiles`: the paper's
  SwinIR for a 32 GiB device), a fresh process per plan;
- in suites of 20 minutes or more, or named with ``--only``: **packing** (ScaMP packing vs the
  fixed baseline on one device, `benchmarks.hpo_makespan`), **determinism** (the CSP pipeline
  twice and one trial twice give the same bytes) and **supernet** (CSP vs GPipe vs
  sequential samples/s, offload on and off).

A section that reaches its cap is stopped (its process group killed) and recorded with
``cut_short: true`` and what it had measured; one that fails records its error and the suite
goes on. Nothing runs beside a timed section. ``OUT/gpu_suite.json`` and ``OUT/gpu_suite.md``
(tables with fixed header rows, `benchmarks.gpu_markdown`) are rewritten after every section;
``--archive FILE.tar.gz`` packs the results (JSON, Markdown, logs, plots; at most 16 MiB) after
every section too, with copies of the JSON and Markdown beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: In order of what the open questions need from a short GPU slot: the main job's booking and
#: compile share, fused SwinIR against one trial at a time, the allocator and the kernels a
#: plan without the GPU needs, the GPU's own tests, what planning costs; then, in suites of
#: `SuiteConfig.section_min_minutes`, the measurements of questions already answered.
SECTIONS = ("mainjob", "fusion", "memory", "tests", "compiles", "packing", "determinism",
            "supernet")
#: Sections whose process only launches others that train on the device.
LAUNCHING_SECTIONS = frozenset({"memory", "mainjob", "packing", "tests", "compiles"})
#: Seconds kept at the end of the suite for the last report and archive.
RESERVE_SECONDS = 15.0
#: Seconds a section's process gets after its deadline to stop before it is killed.
GRACE_SECONDS = 3.0
ARCHIVE_LIMIT = 16 << 20  # bytes


@dataclass(frozen=True)
class MemoryCase:
    """A `benchmarks.memory_accuracy` case to measure.

    Attributes:
      name: the case's name (``memory_accuracy.BY_NAME``).
      fuse: measure a fused group of up to this many members (0: a single model).
      gpu_budget: on a GPU, the planner's budget and the allocator's cap, e.g. ``"1GiB"``.
      cpu_budget: the planner's budget on CPU devices (None: the case's own).
      cpu_skip: on CPU, do not run; the reason is recorded.
      gpu_min_minutes: on a GPU, run only in a suite of at least this many minutes.
      gpu_skip: on a GPU, do not run; the reason is recorded.
    """

    name: str
    fuse: int = 0
    gpu_budget: str = "1GiB"
    cpu_budget: str | None = None
    cpu_skip: str = ""
    gpu_min_minutes: float = 0.0
    gpu_skip: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} fused x{self.fuse}" if self.fuse else self.name


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes of one suite run; `GPU` for an accelerator, `CPU_SMOKE` for the rehearsal.

    ``shares``: each section's weight in the split of the time left (a section's cap is the
    time left x its share / the shares of the sections not yet run); ``*_least_seconds``: a step
    that has less time than this left is not started (the section is cut short instead).
    """

    name: str
    shares: dict[str, float]
    memory_cases: tuple[MemoryCase, ...]
    memory_parallel: int  # memory cases measured at once
    memory_child_seconds: float
    oom_probes: int  # runs of the first-OOM bisection per case (0: none)
    oom_growth: float  # each probe's batch over the previous one's until one runs out
    oom_resolution: float  # bisection stops at a bracket this fraction of its lower end
    packing_trials: int
    packing_steps: int
    packing_least_seconds: float
    fusion_family: str
    fusion_width: int
    fusion_steps: int
    fusion_batch: int
    fusion_least_seconds: float
    mainjob_trials: int  # the main job's trials (the warm start, then fused families on GPUs)
    mainjob_steps: int  # its steps per trial at the preset's reference batch
    mainjob_least_seconds: float
    #: (members, batch) of the host's data per fused step timed after the main job
    #: (`benchmarks.member_data`): the preset's widest group at its batch cap
    mainjob_data: tuple[int, int]
    #: seconds that timing takes at most (left out where the study left less)
    mainjob_data_seconds: float
    supernet_choices: int
    supernet_subnets: int
    supernet_max_stages: int
    supernet_least_seconds: float
    trial_steps: int  # the determinism section's trial
    #: (case of `benchmarks.memory_accuracy`, budget, planning only) planned by the compiles
    #: section, each in a fresh process
    compiles_cases: tuple[tuple[str, str | None, bool], ...] = ()
    compiles_least_seconds: float = 20.0
    #: the GPU's own checks of plans made without it first, then the other GPU tests
    test_files: tuple[str, ...] = ("tests/test_targets.py", "tests/test_gpu.py")
    test_keyword: str = ""  # pytest -k of the tests section ("": every gpu test of the files)
    #: sections that run only in a suite of at least this many minutes, or named in --only
    section_min_minutes: dict[str, float] = field(default_factory=dict)
    #: sections whose process asks for deterministic XLA kernels (their equalities need them);
    #: the others run as the study runs trials.
    deterministic_sections: tuple[str, ...] = ("determinism", "supernet")
    allocator: str = "preallocate"  # `benchmarks.gpu_sections.ALLOCATOR_POLICIES`
    environment_seconds: float = 90.0  # cap of the environment record
    min_section_seconds: float = 15.0  # a section with a smaller cap is not started
    notes: dict[str, str] = field(default_factory=dict)


GPU = SuiteConfig(
    name="gpu",
    # Planned from the first GPU run (2026-11-27, H200): a compile there took 5-7 s (autotuning
    # included), a packed smoke study's planning 90-160 s, a fused group of 4 small SwinIRs
    # x 200 steps about 100 s with its planning; not yet timed in this form. In 9 minutes:
    # about 160 s for the main job, 140 fusion, 80 memory, 55 tests, 65 compiles.
    shares={"mainjob": 0.32, "fusion": 0.28, "memory": 0.16, "tests": 0.11, "compiles": 0.13,
            "packing": 0.14, "determinism": 0.07, "supernet": 0.08},
    section_min_minutes={"packing": 20, "determinism": 20, "supernet": 20},
    memory_cases=(
        MemoryCase("mlp", gpu_budget="512MiB"),
        MemoryCase("vit", gpu_budget="1GiB"),
        MemoryCase("swinir_small", gpu_budget="2GiB"),
        MemoryCase("vit", fuse=4, gpu_budget="1GiB"),
        # the search space's program of the same SwinIR (its softmax keeps the output only)
        MemoryCase("swinir_small_so", gpu_budget="2GiB"),
        # Planning did not finish in 487 s on an H200 (2026-11-27): only in a long suite.
        MemoryCase("swinir_paper", gpu_budget="32GiB", gpu_min_minutes=20),
    ),
    memory_parallel=4, memory_child_seconds=20,
    oom_probes=2, oom_growth=1.25, oom_resolution=0.02,
    packing_trials=4, packing_steps=50, packing_least_seconds=30,
    # a group of 8 small SwinIRs against the 8 one after another: the fusion target's form
    fusion_family="swinir", fusion_width=8, fusion_steps=100, fusion_batch=8,
    fusion_least_seconds=20,
    # the warm start and one family of 8 siblings; 100 steps at the reference batch of 1,024
    # (25 at 4,096): the compiles and the memory booked, a tenth of the preset's training
    mainjob_trials=9, mainjob_steps=100, mainjob_least_seconds=60, mainjob_data=(8, 4096),
    mainjob_data_seconds=30,
    supernet_choices=4, supernet_subnets=32, supernet_max_stages=4, supernet_least_seconds=10,
    trial_steps=50,
    # the paper's SwinIR for a 32 GiB device (the issue: planned in under a minute); on GPUs a
    # plan keeps no step (the run compiles its own, autotuned), so planning only is the plan
    compiles_cases=(("swinir_paper", "32GiB", True),),
    compiles_least_seconds=30,
    # what the memory (allocator-capped plans) and fusion (first steps) sections measure;
    # the packed study last, as time allows
    test_keyword="not allocator_capped and not fused_members",
)

_SHORT = ("not in the CPU rehearsal, to keep it short: the MLP and the fused ViT group rehearse "
          "the same code; every case runs on GPUs")

CPU_SMOKE = SuiteConfig(
    name="cpu-smoke",
    shares=GPU.shares,
    memory_cases=(
        MemoryCase("mlp"),
        MemoryCase("vit", fuse=2, cpu_budget="64MiB"),
        MemoryCase("vit", cpu_skip=_SHORT),
        MemoryCase("swinir_small", cpu_skip=_SHORT),
        MemoryCase("swinir_small_so", cpu_skip=_SHORT),
        # Its compiles take minutes on CPU: it rehearses a case cut short at the section's cap.
        MemoryCase("swinir_paper", cpu_budget="8GiB"),
    ),
    memory_parallel=2, memory_child_seconds=10,
    oom_probes=0, oom_growth=1.25, oom_resolution=0.02,
    packing_trials=2, packing_steps=1, packing_least_seconds=10,
    fusion_family="vit", fusion_width=2, fusion_steps=3, fusion_batch=4,
    fusion_least_seconds=5,
    mainjob_trials=2, mainjob_steps=20, mainjob_least_seconds=20, mainjob_data=(2, 256),
    mainjob_data_seconds=5,
    supernet_choices=2, supernet_subnets=4, supernet_max_stages=2, supernet_least_seconds=5,
    trial_steps=2,
    compiles_cases=(("swinir", "64MiB", True),), compiles_least_seconds=10,
    environment_seconds=60.0, min_section_seconds=10.0,
)
CONFIGS = {c.name: c for c in (GPU, CPU_SMOKE)}


def section_cap(cfg: SuiteConfig, name: str, pending: tuple[str, ...], left: float) -> float:
    """Seconds for section ``name`` out of ``left``: its share of the sections ``pending``
    (``name`` and those after it)."""
    total = sum(cfg.shares[s] for s in pending)
    return left * cfg.shares[name] / total if total > 0 else 0.0


# --------------------------------------------------------------------------- one section

def run_section(name: str, cfg: SuiteConfig, out: Path, deadline: float,
                plan_cache: Path | None, minutes: float) -> int:
    """The body of a section's process: run it, write its record; exit status 0 unless it
    failed (the failure is in the record)."""
    from benchmarks import gpu_sections

    rec = gpu_sections.Record(out / "sections" / f"{name}.json")
    if name in cfg.deterministic_sections:
        from scamp_jax.pipeline.determinism import use_deterministic_gpu_ops

        use_deterministic_gpu_ops()  # before JAX starts
    from scamp_jax import devices as _devices

    # A section that only launches processes which train (memory cases, the packing study, the
    # tests) holds no pool of its own on the GPU: its children set theirs by the library's
    # policy, from the environment as it was before this process started its backend.
    launcher = name in LAUNCHING_SECTIONS
    allocator_vars = (_devices.PREALLOCATE_VAR, _devices.MEM_FRACTION_VAR,
                      _devices.OLD_MEM_FRACTION_VAR)
    before = {k: os.environ.get(k) for k in allocator_vars}
    if launcher:
        _devices.configure_device_memory(preallocate=False)
    _devices.configure_cpu_devices(8)  # 8 CPU devices for the rehearsal
    try:
        if name == "environment":
            from benchmarks.gpu_env import record_environment

            rec.body.update(record_environment(out / "environment"))
            rec.body["status"] = "ok"
            rec.save()
            return 0
        ctx = gpu_sections.make_context(out, deadline, plan_cache)  # starts JAX's backend
        if launcher:  # XLA has read the variables: the children see the environment as it was
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if not ctx.on_cpu:
            cfg = dataclasses.replace(cfg, memory_cases=tuple(
                dataclasses.replace(c, gpu_skip=f"needs a suite of {c.gpu_min_minutes:g} min")
                if minutes < c.gpu_min_minutes else c for c in cfg.memory_cases))
        rec.body["xla_flags"] = os.environ.get("XLA_FLAGS", "")
        gpu_sections.RUNNERS[name](cfg, ctx, rec)
        rec.body["status"] = "cut short" if rec.body.get("cut_short") else "ok"
    except gpu_sections.OutOfTime as err:
        rec.cut(str(err))
        rec.body["status"] = "cut short"
    except (Exception, SystemExit) as err:  # recorded; the driver goes on with the next
        rec.body.update(status="failed", error=f"{type(err).__name__}: {err}"[-2000:],
                        traceback=traceback.format_exc()[-4000:])
        rec.save()
        return 1
    rec.save()
    return 0


# --------------------------------------------------------------------------- driver

def _spawn(name: str, cfg: SuiteConfig, out: Path, cap: float, plan_cache: Path | None,
           minutes: float) -> dict[str, Any]:
    """Run section ``name`` in its own process group for at most ``cap`` seconds; returns its
    record with ``seconds``, ``cap_seconds`` and, when it was stopped, ``cut_short``."""
    import resource

    record = out / "sections" / f"{name}.json"
    record.unlink(missing_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    deadline = time.time() + max(1.0, cap - GRACE_SECONDS)
    cmd = [sys.executable, "-m", "benchmarks.gpu_suite", "--out", str(out), "--section", name,
           "--config", cfg.name, "--allocator", cfg.allocator, "--deadline", repr(deadline),
           "--minutes", repr(minutes)]
    if plan_cache is not None:
        cmd += ["--plan-cache", str(plan_cache)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    killed = False
    with (out / "logs" / f"{name}.log").open("w") as log:
        # Its own process group (not session): stopping it stops its children too, and a
        # runner that ends the driver's session still ends them.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, process_group=0,
                                cwd=Path(__file__).resolve().parents[1])
        try:
            code = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            killed = True
            _stop(proc)
            code = proc.returncode
        except BaseException:  # the driver itself is stopped: the section goes with it
            _stop(proc)
            raise
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        body = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        body = {"rows": []}
    if killed:
        body["cut_short"] = True
        body.setdefault("cut_reasons", []).append(
            f"stopped at its cap of {cap:.0f} s (process group killed)")
        body["status"] = "cut short"
    elif code and body.get("status") != "failed":
        body.update(status="failed", error=f"section process exited {code}; see logs/{name}.log")
    body.setdefault("status", "failed")
    body["seconds"] = time.perf_counter() - start
    body["cpu_seconds"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    body["cap_seconds"] = cap
    return body


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to ``proc``'s process group, then SIGKILL if it is still there after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def gated(cfg: SuiteConfig, minutes: float, only: tuple[str, ...] = SECTIONS,
          explicit: bool = False) -> dict[str, str]:
    """The sections of ``only`` this suite leaves out, with why: those of
    `SuiteConfig.section_min_minutes` in a shorter suite, unless named (``explicit``)."""
    return {name: f"runs in a suite of {cfg.section_min_minutes[name]:g} min or more, or "
                  f"with --only {name}"
            for name in only if not explicit and cfg.section_min_minutes.get(name, 0) > minutes}


def run_suite(cfg: SuiteConfig, out: Path, minutes: float, only: tuple[str, ...] = SECTIONS,
              plan_cache: Path | None = None, archive: Path | None = None,
              explicit: bool = False) -> dict[str, Any]:
    """Record the environment, then run the sections of ``only`` in order (less those `gated`
    leaves out; ``explicit``: ``only`` was named by the user), each in its own process with a
    cap from the time left; write the JSON and Markdown (and ``archive``) after each. Ends
    within ``minutes``."""
    start = time.time()
    end = start + 60.0 * minutes - RESERVE_SECONDS
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"meta": {
        "config": cfg.name, "minutes": minutes, "allocator_policy": cfg.allocator,
        "sizes": {k: v for k, v in dataclasses.asdict(cfg).items()
                  if k not in ("memory_cases", "name", "notes")},
        "memory_cases": [c.label for c in cfg.memory_cases],
        "command": " ".join(["python -m benchmarks.gpu_suite", *sys.argv[1:]])
        if Path(sys.argv[0]).name == "gpu_suite.py" else "python -m benchmarks.gpu_suite",
        "out": str(out),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start)),
    }}
    env = _spawn("environment", cfg, out, min(cfg.environment_seconds, end - time.time()),
                 plan_cache, minutes)
    report["meta"]["environment"] = env
    left_out = gated(cfg, minutes, only, explicit)
    devices = env.get("devices") or [{"platform": "?", "device_kind": "? (no environment record)"}]
    report["meta"].update(platform=devices[0]["platform"], device_kind=devices[0]["device_kind"],
                          devices=len(devices))
    print(f"[gpu_suite] {cfg.name} on {len(devices)} x {devices[0].get('device_kind')}: "
          f"{len(only)} sections in {minutes:g} min", flush=True)
    if devices[0].get("platform") == "cpu" and cfg.name != CPU_SMOKE.name:
        report["meta"]["error"] = ("JAX sees only CPU devices: pass --cpu-smoke for the CPU "
                                   "rehearsal, or install a GPU backend (BUILD.md)")
    pending = tuple(s for s in SECTIONS if s in only and s not in left_out)
    write(report, out, archive)  # the environment (the GPU's description) comes back first
    for name in SECTIONS:
        if name not in only or name in left_out:
            report[name] = {"status": "not run",
                            "reason": left_out.get(name, "not selected (--only)")}
            continue
        cap = section_cap(cfg, name, pending, end - time.time())
        pending = pending[1:]
        if "error" in report["meta"] or cap < cfg.min_section_seconds:
            report[name] = {"status": "not run", "cut_short": "error" not in report["meta"],
                            "rows": [], "cap_seconds": cap,
                            "reason": report["meta"].get("error")
                            or f"{cap:.0f} s left for it, less than "
                               f"{cfg.min_section_seconds:.0f} s"}
        else:
            print(f"[gpu_suite] {name}: cap {cap:.0f} s", flush=True)
            report[name] = _spawn(name, cfg, out, cap, plan_cache, minutes)
            print(f"[gpu_suite] {name}: {report[name]['status']} in "
                  f"{report[name]['seconds']:.0f} s", flush=True)
        write(report, out, archive)
    report["meta"]["seconds"] = time.time() - start
    write(report, out, archive)
    return report


def write(report: dict[str, Any], out: Path, archive: Path | None = None) -> None:
    """``out/gpu_suite.json`` and ``out/gpu_suite.md``; with ``archive``, `pack` them too."""
    from benchmarks.gpu_markdown import markdown

    (out / "gpu_suite.json").write_text(json.dumps(report, indent=1, default=str))
    try:
        text = markdown(report, SECTIONS)
    except Exception as err:  # noqa: BLE001 - the JSON above holds every figure
        text = f"(no Markdown: {type(err).__name__}: {err}; the figures are in gpu_suite.json)\n"
    (out / "gpu_suite.md").write_text(text)
    if archive is not None:
        pack(out, archive)
        for name in ("gpu_suite.json", "gpu_suite.md"):
            shutil.copyfile(out / name, archive.parent / name)


#: What goes into the archive (by suffix), the most useful first.
ARCHIVE_SUFFIXES = (".json", ".md", ".txt", ".txtpb", ".pb", ".log", ".png", ".csv", ".sqlite")
#: Folders whose files stay out of the archive (model states: large, and not results).
SKIPPED_FOLDERS = {"checkpoints", "best_model"}
#: Top-level folders packed whatever their files' suffixes: XLA's autotuning results of the
#: memory section (`benchmarks.gpu_sections.AUTOTUNE_DIRNAME`; small text files whose naming
#: is XLA's).
WHOLE_FOLDERS = {"autotune"}


def pack(out: Path, archive: Path, limit: int = ARCHIVE_LIMIT) -> dict[str, Any]:
    """Pack the results under ``out`` (files with `ARCHIVE_SUFFIXES` and every file of
    `WHOLE_FOLDERS`, none in `SKIPPED_FOLDERS`) into the gzipped tar ``archive`` of at most
    ``limit`` bytes: files are added smallest first within each priority (top-level and
    section records, environment, autotuning results, logs, the rest); those that would
    pass the limit are left out and listed in ``MANIFEST.txt``."""
    def rank(p: Path) -> tuple[int, int]:
        rel = p.relative_to(out)
        first = rel.parts[0]
        order = (0 if len(rel.parts) == 1 else 1 if first in ("sections", "environment")
                 else 2 if first in WHOLE_FOLDERS else 3 if first == "logs" else 4)
        return order, p.stat().st_size

    def wanted(p: Path) -> bool:
        parts = p.relative_to(out).parts
        return (p.is_file() and not set(parts) & SKIPPED_FOLDERS
                and (p.suffix in ARCHIVE_SUFFIXES or parts[0] in WHOLE_FOLDERS))

    files = sorted((p for p in out.rglob("*") if wanted(p)), key=rank)
    archive.parent.mkdir(parents=True, exist_ok=True)
    kept, dropped = [], []
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for p in files:
            # gzip output lags the input: leave room for the file itself, uncompressed.
            if buffer.tell() + p.stat().st_size + (64 << 10) > limit:
                dropped.append(str(p.relative_to(out)))
                continue
            tar.add(p, arcname=str(Path(out.name) / p.relative_to(out)))
            kept.append(str(p.relative_to(out)))
        manifest = ("\n".join(["kept:", *kept, "", "left out (archive limit "
                               f"{limit} bytes):", *dropped]) + "\n").encode()
        info = tarfile.TarInfo(str(Path(out.name) / "MANIFEST.txt"))
        info.size, info.mtime = len(manifest), int(time.time())
        tar.addfile(info, io.BytesIO(manifest))
    tmp = archive.with_suffix(".partial")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(archive)
    return {"archive": str(archive), "bytes": archive.stat().st_size, "files": len(kept),
            "left_out": dropped}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Parse flags; run the suite (or, with the internal ``--section``, one section)."""
    from benchmarks.gpu_sections import ALLOCATOR_POLICIES
    from experiments._cli import output_dir, output_file

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=output_dir,
                        help="directory of gpu_suite.json, gpu_suite.md, logs and records")
    parser.add_argument("--minutes", type=float, default=9.0,
                        help="the suite ends within this many minutes (default 9: a 10-minute "
                             "slot on a lent GPU, less a minute to install the wheels; the "
                             "packing, determinism and supernet sections run from 20 minutes, "
                             "or when named in --only)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same code on 8 CPU devices with tiny sizes")
    parser.add_argument("--archive", type=output_file, default=None,
                        help="also pack the results into this .tar.gz (at most 16 MiB) after "
                             "every section, with gpu_suite.json and .md beside it")
    parser.add_argument("--allocator", default="preallocate", choices=sorted(ALLOCATOR_POLICIES),
                        help="allocator policy of the memory section's capped runs "
                             "(default preallocate: the library's policy, `scamp_jax.devices`, the "
                             "budget taken up front as one region; grow: preallocation off, "
                             "capped at the budget)")
    parser.add_argument("--plan-cache", type=output_file, default=None,
                        help="plan cache (e.g. a study's plans.sqlite) that stores the allowance "
                             "the memory section measures (default: OUT/plans.sqlite)")
    parser.add_argument("--only", default=None,
                        help="comma-separated sections, run whatever the suite's minutes "
                             f"(default: {', '.join(SECTIONS)}; those of 20 minutes only in "
                             "suites that long)")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error(f"--minutes {args.minutes}: must be positive, e.g. --minutes 9")
    if args.section is not None:
        cfg = dataclasses.replace(CONFIGS[args.config], allocator=args.allocator)
        sys.exit(run_section(args.section, cfg, args.out, args.deadline, args.plan_cache,
                             args.minutes))
    explicit = args.only is not None
    only = tuple(s.strip() for s in (",".join(SECTIONS) if args.only is None
                                     else args.only).split(",") if s.strip())
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown or not only:
        parser.error(f"--only {args.only!r}: "
                     + (f"unknown section(s) {', '.join(unknown)}" if unknown else "no section")
                     + f"; choose from {','.join(SECTIONS)}")
    cfg = dataclasses.replace(CPU_SMOKE if args.cpu_smoke else GPU, allocator=args.allocator)
    least = cfg.environment_seconds + RESERVE_SECONDS + cfg.min_section_seconds
    if 60.0 * args.minutes < least:
        parser.error(f"--minutes {args.minutes:g} leaves no time for a section after the "
                     f"environment record ({cfg.environment_seconds:.0f} s at most); pass at "
                     f"least --minutes {math.ceil(least / 6) / 10:g}")
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # the section processes inherit it
    # A section's error keeps its traceback in the section's log: the logs are all that a GPU
    # slot brings back to debug it with.
    from experiments._cli import TRACEBACK_VARIABLE

    os.environ.setdefault(TRACEBACK_VARIABLE, "1")
    # SIGTERM ends the driver through SystemExit, so the running section is stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    report = run_suite(cfg, args.out, args.minutes, only, args.plan_cache, args.archive,
                       explicit)
    if "error" in report["meta"]:
        sys.exit(report["meta"]["error"])
    if all(report[name].get("status") == "not run" for name in SECTIONS):
        sys.exit(f"no section ran in {args.minutes:g} minutes (each one's reason is in "
                 f"{args.out / 'gpu_suite.md'}); pass more --minutes")
    return report


if __name__ == "__main__":
    main()
