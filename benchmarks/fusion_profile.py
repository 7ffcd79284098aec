"""Where a fused step spends its time against ``K`` solo steps, by kind of operation.

    python -m benchmarks.fusion_profile --family swinir --width 4
    python -m benchmarks.fusion_profile --family swinir --width 4 --conv-form grouped

The members of `benchmarks.fusion` (architecture, batch, learning rates, seeds) are built, and
one solo training step and the fused step of all of them are compiled on one device
(`benchmarks.fusion.compiled_steps`). Each runs
under ``jax.profiler`` ``--reps`` times; every XLA operation's time is the smallest it took over
those runs (the machine is shared: the minimum is the least disturbed), and the operations are
grouped by what their fusion computes: ``convolution``, ``grouped convolution``
(``feature_group_count > 1``), ``dot``, ``transpose/copy``, ``reduce``, ``elementwise``. The
table gives the solo step times ``K`` against the fused step, per kind, and the slowest fused
operations. Op times are summed per thread, so on a device that runs several at once they can
exceed the step's wall-clock time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks.fusion import CPU_DEVICES, DEFAULTS, compiled_steps

KINDS = ("grouped convolution", "convolution", "dot", "transpose/copy", "reduce", "elementwise")


def _computations(hlo: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The optimized HLO text's computations (name -> instruction lines) and every
    instruction's line by name."""
    comps: dict[str, list[str]] = {}
    lines: dict[str, str] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            current = head.group(1)
            comps[current] = []
        elif current is not None and line.startswith("  "):
            comps[current].append(line.strip())
            name = re.match(r"(?:ROOT )?%([\w.\-]+) = ", line.strip())
            if name:
                lines[name.group(1)] = line.strip()
    return comps, lines


def kind_of(line: str, comps: dict[str, list[str]]) -> str:
    """What an instruction (a fusion: what its called computation) computes, one of `KINDS`."""
    called = re.search(r"calls=%([\w.\-]+)", line)
    body = "\n".join(comps.get(called.group(1), [])) if called else line
    if " convolution(" in body:
        groups = re.findall(r"feature_group_count=(\d+)|batch_group_count=(\d+)", body)
        grouped = any(int(a or b) > 1 for a, b in groups)
        return "grouped convolution" if grouped else "convolution"
    if " dot(" in body:
        return "dot"
    if re.search(r" (transpose|copy)\(", body):
        return "transpose/copy"
    if " reduce(" in body or " reduce-window(" in body:
        return "reduce"
    return "elementwise"


def op_times(compiled: Any, args: Sequence[Any], reps: int) -> dict[str, float]:
    """Seconds of every operation of ``compiled(*args)``: the least over ``reps`` profiled
    calls of the summed time of its events in one call."""
    import jax

    jax.block_until_ready(compiled(*args))
    runs = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory(prefix="fusion-profile-") as out:
            jax.profiler.start_trace(out)
            jax.block_until_ready(compiled(*args))
            jax.profiler.stop_trace()
            path = glob.glob(f"{out}/**/*.xplane.pb", recursive=True)[0]
            data = jax.profiler.ProfileData.from_file(path)
        seconds: collections.Counter[str] = collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                for event in line.events:
                    seconds[event.name] += event.duration_ns * 1e-9
        runs.append(seconds)
    names = set().union(*runs)
    return {name: min(run.get(name, 0.0) for run in runs) for name in names}


def by_kind(compiled: Any, args: Sequence[Any], reps: int) -> tuple[dict[str, float],
                                                                      list[tuple[float, str]]]:
    """``({kind: seconds}, [(seconds, operation description)] slowest first)``."""
    comps, lines = _computations(compiled.as_text())
    kinds = dict.fromkeys(KINDS, 0.0)
    ops = []
    for name, seconds in op_times(compiled, args, reps).items():
        if name not in lines:
            continue  # runtime events, not operations
        kind = kind_of(lines[name], comps)
        kinds[kind] += seconds
        shape = lines[name].split(" = ", 1)[1].split(" ", 1)[0]
        ops.append((seconds, f"{kind}: {name} {shape}"))
    return kinds, sorted(ops, reverse=True)


def profile(family: str, width: int, batch: int, reps: int) -> dict[str, Any]:
    """The report of the module docstring, JSON-ready."""
    import jax

    solo, solo_argsets, fused, fused_args = compiled_steps(family, width, batch)
    solo_args = solo_argsets[0]
    solo_kinds, _ = by_kind(solo, solo_args, reps)
    fused_kinds, fused_ops = by_kind(fused, fused_args, reps)
    return {"family": family, "width": width, "batch_size": batch, "reps": reps,
            "device": f"{jax.devices()[0].platform} x1",
            "convolutions": os.environ.get("SCAMP_FUSED_CONVOLUTIONS", "auto"),
            "solo_seconds_by_kind": solo_kinds, "fused_seconds_by_kind": fused_kinds,
            "slowest_fused_ops": [[s, d] for s, d in fused_ops[:15]]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse flags, profile, print the tables."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.fusion_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(DEFAULTS), default="swinir",
                   help="model family of the members (default swinir)")
    p.add_argument("--width", type=int, default=4, help="members of the fused step (default 4)")
    p.add_argument("--batch", type=int, default=None,
                   help="samples per member (default: the family's in benchmarks.fusion: "
                   + ", ".join(f"{k} {v['batch']}" for k, v in sorted(DEFAULTS.items())) + ")")
    p.add_argument("--reps", type=int, default=7, help="profiled calls of each step (default 7)")
    p.add_argument("--conv-form", choices=("auto", "per_member", "grouped"), default=None,
                   help="sets SCAMP_FUSED_CONVOLUTIONS (scamp_jax.planning.member_ops)")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = p.parse_args(argv)
    if args.conv_form is not None:
        os.environ["SCAMP_FUSED_CONVOLUTIONS"] = args.conv_form
    from benchmarks._tables import print_table
    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(CPU_DEVICES)
    report = profile(args.family, args.width, args.batch or DEFAULTS[args.family]["batch"],
                     args.reps)
    solo, fused, k = report["solo_seconds_by_kind"], report["fused_seconds_by_kind"], args.width
    rows = [[kind, f"{1e3 * k * solo[kind]:.1f}", f"{1e3 * fused[kind]:.1f}",
             f"{fused[kind] / (k * solo[kind]):.2f}" if solo[kind] else "-"] for kind in KINDS]
    rows.append(["all operations", f"{1e3 * k * sum(solo.values()):.1f}",
                 f"{1e3 * sum(fused.values()):.1f}",
                 f"{sum(fused.values()) / (k * sum(solo.values())):.2f}"])
    print_table(f"{args.family}: op time of {k} solo steps against one fused step of {k} "
                f"members, batch {report['batch_size']} ({report['device']}, convolutions: "
                f"{report['convolutions']}; least of {args.reps} profiled calls per op)",
                ["kind", f"solo x {k} ms", "fused ms", "fused / solo x K"], rows, args.markdown)
    print_table("slowest operations of the fused step", ["ms", "operation"],
                [[f"{1e3 * s:.2f}", d[:110]] for s, d in report["slowest_fused_ops"]],
                args.markdown)
    return report


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
