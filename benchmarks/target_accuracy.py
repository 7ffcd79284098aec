"""GPU targets against a real GPU: memory cases planned here for a described GPU vs one's own.

Run (needs ``pip install 'scamp-jax[gpu-plan]'``; no GPU)::

    python -m benchmarks.target_accuracy --targets h100,h200        # ~15 CPU-minutes
    python -m benchmarks.target_accuracy --targets v100 --only swinir_paper \\
        --memory-per-device 32GiB                                   # the paper SwinIR

For each case of `benchmarks.memory_accuracy` (``mlp`` at 512 MiB, ``vit`` at 1 GiB,
``swinir_small`` at 2 GiB by default, margin 0.1, one device) and each target it plans with
``plan_mesh(..., target=...)`` and prints the planned batch, its compiled peak, the compiled
peak at the reference GPU's batch (like for like), their errors against the reference, the
compiles and the CPU seconds of planning (this process and its ptxas runs). The reference is
what one H200 planned with autotuning (``--reference``, default
``../shared/gpu/2026-11-27-h200``, files ``mem_<case>_0.json``). ``--compile-options JSON``
compiles the like-for-like point with other XLA options (a kernel choice autotuning might make,
e.g. split-K). ``--markdown`` prints the table for ``benchmarks/notes/targets.md``.

After a GPU suite (`benchmarks.gpu_suite`, results in ``OUT``), the GPU's own description and
kernel choices::

    python -m benchmarks.target_accuracy --targets OUT/environment/target_config.txtpb \
        --reference OUT --autotune-cache OUT/autotune

compares plans made here with that GPU's autotuning results against its runs' autotuned
compiles; without ``--autotune-cache``, against its plans (autotuning off there too).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks._tables import pct_text, print_table
from benchmarks.gpu_suite import GPU
from experiments._cli import output_file

#: Budgets of the cases as the GPU suite plans them alone (`benchmarks.gpu_suite.GPU`'s memory
#: cases; the H200 run of 2026-11-27 had all but ``swinir_small_so``, the search space's
#: program of ``swinir_small``).
BUDGETS = {c.name: c.gpu_budget for c in GPU.memory_cases if not c.fuse}
#: ``--memory-per-device`` for the target's default pool (`Budget.for_device`: what a training
#: process alone on that GPU holds), e.g. 23.81 GiB of a 32 GB V100.
POOL = "pool"
#: The H200 run's files: ``shared/gpu/2026-11-27-h200`` beside the repository (or a worktree's
#: parents).
REFERENCE_NAME = Path("shared/gpu/2026-11-27-h200")


def default_reference() -> Path | None:
    """The first ``shared/gpu/2026-11-27-h200`` among this checkout's parent directories
    (None: none)."""
    for parent in Path(__file__).resolve().parents:
        if (parent / REFERENCE_NAME).is_dir():
            return parent / REFERENCE_NAME
    return None


#: The memory section's row of a case's plan in a GPU suite's results (`benchmarks.gpu_suite`).
SUITE_PLAN_POINT = "planned, capped"


def reference_point(directory: Path | None, case: str, autotuned: bool = False
                    ) -> tuple[int, int] | None:
    """``(batch, compiled peak bytes)`` the reference GPU planned for ``case`` (None: none, or
    no ``directory``).

    ``directory`` holds either the first H200 run's ``mem_<case>_0.json`` (its planner
    autotuned: the plan's peak) or a GPU suite's results (``sections/memory.json``): there the
    plan's peak comes from a compile with autotuning off, the run's (``compiled``, the same
    batch) from the autotuned compile; ``autotuned`` takes the run's, the figure a plan with
    that GPU's autotuning results (``--autotune-cache``) compiles."""
    if directory is None:
        return None
    path = directory / f"mem_{case}_0.json"
    if path.is_file():
        for row in json.loads(path.read_text())["rows"]:
            if row.get("planned") is not None:
                return int(row["plan_batch"]), int(row["planned"])
        return None
    suite = directory / "sections" / "memory.json"
    if not suite.is_file():
        return None
    for row in json.loads(suite.read_text()).get("rows", []):
        if row.get("case") == case and row.get("point") == SUITE_PLAN_POINT:
            peak = row.get("compiled") if autotuned else row.get("planned")
            if peak is not None:
                return int(row["plan_batch"]), int(peak)
    return None


def measure(case: str, target: str, budget: str, reference: tuple[int, int] | None,
            options: dict[str, Any] | None = None, plan: bool = True,
            autotune_cache: Path | None = None) -> dict[str, Any]:
    """Plan ``case`` for one ``target`` device within ``budget`` (unless ``plan`` is False);
    compile at the reference's batch too, with the target's options and ``options`` on top.
    ``autotune_cache``: XLA's autotuning results recorded on the GPU of the target's
    description (`scamp_jax.planning.targets.resolve_target`)."""
    from flax import nnx

    from benchmarks.memory_accuracy import BY_NAME
    from scamp_jax.hpo.preview import cpu_seconds
    from scamp_jax.planning.memory import StepCompiler
    from scamp_jax.planning.planner import plan_mesh
    from scamp_jax.planning.sharding import make_mesh
    from scamp_jax.planning.targets import resolve_target

    spec = BY_NAME[case]
    model = nnx.eval_shape(lambda: spec.build(nnx.Rngs(0)))
    row: dict[str, Any] = {"case": case, "target": target, "budget": budget,
                           "options": options or {},
                           "autotune_cache": None if autotune_cache is None
                           else str(autotune_cache)}
    described = resolve_target(target, autotune_cache=autotune_cache)
    compiler = StepCompiler(model, spec.sample(), make_mesh(list(described.devices(1)), 1, 1))
    if plan:
        cpu, wall = cpu_seconds(), time.perf_counter()
        made = plan_mesh(model, spec.sample(), devices=1,
                         memory_per_device=None if budget == POOL else budget,
                         target=described)
        row.update(batch=made.batch_size, peak=made.peak_bytes_per_device,
                   compiles=made.compiles, cpu_seconds=cpu_seconds() - cpu,
                   seconds=time.perf_counter() - wall, compiled=made.compiled_peaks)
    if reference is not None:
        batch, peak = reference
        same = compiler.compile(batch, {**(compiler.compiler_options or {}),
                                         **(options or {})})[0]
        row.update(reference_batch=batch, reference_peak=peak, peak_at_reference_batch=same.peak)
    return row


def main(argv: list[str] | None = None) -> None:
    """Parse flags, plan every case for every target, print the table."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.target_accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="h100",
                        help="comma-separated target names or description files (e.g. a GPU "
                        "suite's environment/target_config.txtpb; default h100)")
    parser.add_argument("--only", default="mlp,vit,swinir_small",
                        help="comma-separated cases of benchmarks.memory_accuracy "
                        f"(default mlp,vit,swinir_small: the three the H200 ran); with a "
                        f"budget of their own: {', '.join(BUDGETS)}; others need "
                        "--memory-per-device")
    parser.add_argument("--memory-per-device", default=None,
                        help="budget per device, e.g. 2GiB, or 'pool': what a training "
                        "process alone on the target GPU holds (default: each case's, as the "
                        "H200 run had)")
    parser.add_argument("--reference", type=Path, default=None,
                        help="the reference GPU's results: a directory of mem_<case>_0.json "
                        "files or a GPU suite's output (sections/memory.json); default: the "
                        "first shared/gpu/2026-11-27-h200 above this checkout, if any")
    parser.add_argument("--autotune-cache", type=Path, default=None,
                        help="XLA's autotuning results recorded on the reference GPU (a GPU "
                        "suite's autotune/ folder): compile with its kernels, and compare "
                        "with its runs' autotuned peaks")
    parser.add_argument("--compile-options", type=json.loads, default=None, metavar="JSON",
                        help="XLA options added to the compile at the reference's batch, e.g. "
                        "'{\"xla_gpu_experimental_force_split_k\": 2}' (the plan keeps the "
                        "target's own; needs a reference)")
    parser.add_argument("--no-plan", action="store_true",
                        help="only the compile at the reference's batch (e.g. with "
                        "--compile-options; needs a reference)")
    parser.add_argument("--json", type=output_file, default=None,
                        help="also write the rows here (JSON)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    if args.reference is not None and not args.reference.is_dir():
        parser.error(f"--reference {args.reference}: no such directory; pass a directory of "
                     "mem_<case>_0.json files or a GPU suite's output")
    if args.autotune_cache is not None and not args.autotune_cache.is_dir():
        parser.error(f"--autotune-cache {args.autotune_cache}: no such directory; pass the "
                     "autotune/ folder of a GPU suite's output")

    from benchmarks.memory_accuracy import BY_NAME

    cases, targets = _listed(parser, args.only, "--only"), _listed(parser, args.targets,
                                                                    "--targets")
    unknown = [c for c in cases if c not in BY_NAME]
    if unknown:
        parser.error(f"--only: unknown case(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(BY_NAME)}")
    if args.memory_per_device is None and any(c not in BUDGETS for c in cases):
        parser.error(f"--only: {', '.join(c for c in cases if c not in BUDGETS)} has no budget "
                     f"of its own (those with one: {', '.join(BUDGETS)}); pass "
                     "--memory-per-device, e.g. --memory-per-device pool")

    if args.compile_options is not None and not isinstance(args.compile_options, dict):
        parser.error(f"--compile-options: {json.dumps(args.compile_options)} is no JSON object; "
                     "pass options by name, e.g. '{\"xla_gpu_experimental_force_split_k\": 2}'")

    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the target compiles need no CUDA libraries
    directory = args.reference or default_reference()
    references = {case: reference_point(directory, case,
                                        autotuned=args.autotune_cache is not None)
                  for case in cases}
    acting = [flag for flag, given in (("--no-plan", args.no_plan),
                                       ("--compile-options", args.compile_options is not None))
              if given]
    act = f"{' and '.join(acting)} {'act' if len(acting) > 1 else 'acts'} on"
    if acting and directory is None:
        parser.error(f"{act} the compile at the reference's batch, and "
                     f"there is no reference: no {REFERENCE_NAME} above this checkout; pass "
                     "--reference DIR (a directory of mem_<case>_0.json files or a GPU suite's "
                     "output)")
    missing = [case for case in cases if references[case] is None]
    if acting and (len(missing) == len(cases) or (args.no_plan and missing)):
        parser.error(f"{act} the compile at the reference's batch, and {directory} has no "
                     f"reference figures for {', '.join(missing)}; pass --only with cases it "
                     "has, or another --reference")
    if args.compile_options:
        _check_compile_options(parser, args.compile_options)
    from scamp_jax.planning.targets import resolve_target

    for target in targets:  # every one before the first compile
        try:
            resolve_target(target, autotune_cache=args.autotune_cache)
        except ValueError as problem:
            parser.error(f"--targets: {problem}")
    if directory is None:
        print(f"# no reference GPU's figures: no {REFERENCE_NAME} above this checkout, and no "
              "--reference; planned here only", flush=True)
    rows = []
    for case in cases:
        reference = references[case]
        if reference is None and directory is not None:
            print(f"# no reference figures for {case} in {directory}: planned here only",
                  flush=True)
        for target in targets:
            row = measure(case, target, args.memory_per_device or BUDGETS[case], reference,
                          args.compile_options, plan=not args.no_plan,
                          autotune_cache=args.autotune_cache)
            rows.append(row)
            print(f"# {json.dumps(row)}", flush=True)
    header = ["case", "target", "budget", "batch", "ref batch", "err", "peak", "ref peak",
              "err", "peak at ref batch", "err", "compiles", "CPU s"]
    table = []
    for r in rows:
        planned = "batch" in r

        def cell(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:,}" if key in r else "-"

        def err(key: str, of: str, r: dict[str, Any] = r) -> str:
            return pct_text(r[key], r[of]) if key in r and of in r else "-"

        table.append([
            r["case"], r["target"], r["budget"], cell("batch"), cell("reference_batch"),
            err("batch", "reference_batch"), cell("peak"), cell("reference_peak"),
            err("peak", "reference_peak"), cell("peak_at_reference_batch"),
            err("peak_at_reference_batch", "reference_peak"),
            str(r["compiles"]) if planned else "-",
            f"{r['cpu_seconds']:.1f}" if planned else "-",
        ])
    print_table("planned for a described GPU vs the reference GPU's own plan", header, table,
                args.markdown)
    if args.json is not None:  # after the table: what is measured is shown whatever happens
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


def _check_compile_options(parser: argparse.ArgumentParser, options: dict[str, Any]) -> None:
    """Refuse ``--compile-options`` XLA does not take (a name it has no option of, a value of
    the wrong type): one compile of a trivial program, before any case's compiles."""
    import jax

    lowered = jax.jit(lambda x: x + 1).lower(1.0)
    try:
        lowered.compile(options)
    except jax.errors.JaxRuntimeError as err:
        problem = str(err).removeprefix("INVALID_ARGUMENT: ").strip()
        if problem.startswith("No such compile option: "):
            name = problem.removeprefix("No such compile option: ")
            parser.error(f"--compile-options: XLA has no option {name}; check its spelling "
                         "(XLA's options are named xla_..., e.g. "
                         "xla_gpu_experimental_force_split_k)")
        parser.error(f"--compile-options: XLA refuses them: {problem.rstrip('.')}")


def _listed(parser: argparse.ArgumentParser, text: str, flag: str) -> list[str]:
    """The comma-separated names of ``flag``, none of them empty."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        parser.error(f"{flag} {text!r}: an empty name; separate names with single commas, "
                     "e.g. mlp,vit")
    return names


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
