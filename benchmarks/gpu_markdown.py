"""The GPU suite's report as Markdown, in the form BENCHMARKS.md's GPU section takes.

One subsection per section, in the suite's order: a heading ``### GPU <section>``, one line
``Run: DATE, DEVICE, COMMAND, OUT DIR`` (a section cut short at its time cap says so there), one
table whose header row is `HEADERS`' (the same from run to run), and one paragraph of notes.
A cell that was not measured reads "not yet measured".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

NOT_YET = "not yet measured"

#: The header row of each section's table (BENCHMARKS.md's GPU section uses the same).
HEADERS: dict[str, list[str]] = {
    "memory": ["case", "budget", "planned batch", "compiled peak", "measured peak", "error",
               "capped run result", "first batch that runs out"],
    "fusion": ["family", "width", "steady step solo s", "steady step fused s", "steady_speedup",
               "step alone", "one step at K x batch", "end-to-end speedup", "compile+planning s",
               "max first-step relative difference", "noise floor"],
    "mainjob": ["trials finished", "steps", "study s", "compile s (share)",
                "pool booked peak / mean", "batches", "fused trials",
                "fused step s / host data s", "solo step s (x its least)",
                "best PSNR vs bicubic"],
    "packing": ["family", "trials", "steps", "packed trials/h", "one-at-a-time trials/h",
                "ratio", "planning s"],
    "determinism": ["program", "runs", "steps", "same bytes", "deterministic GPU ops",
                    "seconds"],
    "supernet": ["schedule", "choices", "stages", "offload", "samples/s", "vs sequential",
                 "same bytes as sequential", "device weights"],
    "tests": ["marker", "passed", "failed", "skipped", "seconds"],
    "compiles": ["case", "budget", "plan", "wall s", "CPU s", "compiles", "batch",
                 "compiled peak"],
}


def _b(x: Any) -> str:
    from scamp_jax._units import format_bytes

    return NOT_YET if x is None else format_bytes(int(x))


def _p(x: Any) -> str:
    return NOT_YET if x is None else f"{x:+.1f}%"


def _f(x: Any, fmt: str = ".2f", unit: str = "") -> str:
    return NOT_YET if x is None else format(x, fmt) + unit


def table(name: str, rows: list[list[str]]) -> list[str]:
    """A Markdown table under ``HEADERS[name]`` (a row of "not yet measured" when empty)."""
    head = HEADERS[name]
    rows = rows or [[NOT_YET] + [""] * (len(head) - 1)]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _run_line(meta: dict[str, Any], sec: dict[str, Any]) -> str:
    command = meta.get("command", "python -m benchmarks.gpu_suite")
    line = (f"Run: {meta['started'][:10]}, {meta.get('devices', '?')} x "
            f"{meta.get('device_kind', '?')}, `{command}`, {meta.get('out', '?')}; ")
    if sec.get("status") == "not run" and not sec.get("cut_short"):
        return line + f"**not run**: {sec.get('reason') or 'not selected'}."
    line += f"{sec.get('seconds', 0):.0f} s of a {sec.get('cap_seconds', 0):.0f} s cap"
    if sec.get("cut_short"):
        reasons = sec.get("cut_reasons") or [sec.get("reason", "")]
        line += "; **cut short**: " + "; ".join(r for r in reasons if r)
    if sec.get("status") == "failed":
        line += f"; **failed**: {sec.get('error')}"
    return line + "."


def markdown(report: dict[str, Any], sections: tuple[str, ...]) -> str:
    """The report as Markdown: a heading with the device, then one subsection per section."""
    meta = report["meta"]
    lines = [f"## GPU suite: {meta.get('devices', '?')} x {meta.get('device_kind', '?')} "
             f"({meta.get('platform', '?')}), {meta.get('minutes', '?')} min, "
             f"started {meta['started']}", ""]
    env = meta.get("environment") or {}
    if env.get("packages"):
        pk = env["packages"]
        lines += [f"jax {pk.get('jax', '?')}, flax {pk.get('flax', '?')}, Python "
                  f"{env.get('python', '?')}; XLA target description: "
                  f"{env.get('target_config') or env.get('target_config_reason', '-')} "
                  "(in the archive's environment/).", ""]
    if meta.get("error"):  # nothing was measured: say why once, above the empty tables
        lines += [f"**No section ran**: {meta['error']}.", ""]
    for name in sections:
        sec = report.get(name)
        if sec is None:
            continue
        lines += [f"### GPU {name}", "", _run_line(meta, sec), ""]
        try:
            body, notes = SECTION_TABLES[name](sec)
        except Exception as err:  # noqa: BLE001 - a partial record; the others still print
            body, notes = table(name, []), [f"(table incomplete: {type(err).__name__}: {err})"]
        lines += body
        notes = [n for n in notes + [sec.get("note", "")] if n]
        if notes:
            lines += [" ".join(n[0].upper() + n[1:].rstrip(".") + "." for n in notes), ""]
    return "\n".join(lines)


def _oom_text(case: dict[str, Any]) -> str:
    oom = case.get("first_oom_batch")
    if isinstance(oom, int):
        return (f"{oom:,} (planned / first {case['planned_over_first_oom']:.2f}; largest that "
                f"ran {case['largest_ok_batch']:,})")
    if "largest_ok_batch" in case:
        return f"none up to {case['largest_ok_batch']:,} ({case['probes']} runs)"
    if isinstance(oom, str):
        return oom
    return f"{NOT_YET} (cut short)" if case.get("cut_short") else NOT_YET


def _run_text(r: dict[str, Any]) -> str:
    if r["oom"]:
        return f"out of memory in {r.get('oom_phase')} ({(r.get('error') or '')[:80]})"
    return "ran" if r["point"].endswith("capped") and "uncapped" not in r["point"] else \
        "ran uncapped"


def _memory_md(sec: dict[str, Any]) -> tuple[list[str], list[str]]:
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in sec.get("rows", []):
        by_case.setdefault(r["case"], {})[r["point"]] = r
    rows, booked, pools = [], [], []
    for label, case in sec.get("cases", {}).items():
        if case.get("skipped"):
            rows.append([label, _b(case.get("budget")) if case.get("budget") else "-",
                         f"{NOT_YET}: {case['skipped']}", "", "", "", "", ""])
            continue
        points = by_case.get(label, {})
        capped, free = points.get("planned, capped"), points.get("planned, uncapped")
        if capped is None:
            why = case.get("cut_reason") or case.get("error") or ""
            rows.append([label, _b(case.get("budget")), f"{NOT_YET} ({why})", "", "", "", "",
                         ""])
            continue
        rows.append([label, _b(case.get("budget")), f"{capped['batch']:,}",
                     _b(capped["compiled"]), _b(capped["measured"]), _p(capped["error_pct"]),
                     _run_text(capped), _oom_text(case)])
        if free is not None:
            rows.append([f"{label}, uncapped", "XLA's default", f"{free['batch']:,}",
                         _b(free["compiled"]), _b(free["measured"]), _p(free["error_pct"]),
                         _run_text(free), ""])
        if capped.get("booked_vs_measured_pct") is not None:
            booked.append(f"{label} {_b(capped['booked'])} "
                          f"({capped['booked_vs_measured_pct']:+.1f}%)")
        if capped.get("phases"):
            pools.append(f"{label} " + " / ".join(
                _b((capped["phases"].get(p) or {}).get("pool_bytes"))
                for p in ("init", "compile", "step 1", "step 2")))
    notes = ["Error = (compiled - measured) / measured; planned batch and peaks at the planned, "
             f"capped run; allocator policy {sec.get('allocator_policy', '?')}"]
    if booked:
        notes.append("Booked, vs measured: " + "; ".join(booked))
    if pools:
        notes.append("Allocator pool after init / compile / step 1 / step 2: " + "; ".join(pools))
    probes = sum(1 for r in sec.get("rows", []) if r["point"].startswith("probe"))
    if probes:
        notes.append(f"{probes} bisection runs in gpu_suite.json")
    allowance = sec.get("allowance") or {}
    if "unseen_bytes" in allowance:
        notes.append(f"Allowance for memory XLA does not see: {_b(allowance['bytes'])} = "
                     f"{_b(allowance['unseen_bytes'])} unseen + {_b(allowance['context_bytes'])} "
                     "outside the allocator")
    return table("memory", rows), notes


def _fusion_md(sec: dict[str, Any]) -> tuple[list[str], list[str]]:
    rows = [[r["family"], str(r["width"]), _f(r["steady_step_solo_s"], ".4f"),
             _f(r["steady_step_fused_s"], ".4f"), _f(r["steady_speedup"], ".2f", "x"),
             _f(r.get("step_speedup"), ".2f", "x"), _f(r.get("wide_speedup"), ".2f", "x"),
             _f(r["end_to_end_speedup"], ".2f", "x") + f" ({r['unfused_seconds']:.1f} vs "
             f"{r['fused_seconds']:.1f} s)", _f(r["compile_planning_s"], ".1f"),
             _f(r["max_first_step_rel_diff"], ".1e"), _f(r.get("noise_floor_first_step"), ".1e")]
            for r in sec.get("rows", [])]
    notes = [f"{r['steps']} steps at batch {r['batch']}; fused vs solo final loss, largest "
             f"relative difference {r['max_final_loss_rel_diff']:.1e} (noise floor, the same "
             f"trial twice: {_f(r.get('noise_floor_final_loss'), '.1e')})"
             for r in sec.get("rows", [])]
    notes += [f"The fused step alone with {r['other_form'].replace('_', ' ')} convolutions: "
              f"{_f(r['other_form_step_speedup'], '.2f', 'x')} of the solo steps (this "
              f"platform's own form: {_f(r.get('step_speedup'), '.2f', 'x')})"
              for r in sec.get("rows", []) if r.get("other_form")]
    so_far = sec.get("fusion_so_far")
    if so_far and not sec.get("rows"):  # cut short inside benchmarks.fusion
        done = ", ".join(f"{v} {t[0]:.1f} s" for v, t in so_far["seconds"].items() if t)
        notes.append(f"Measured before the cut ({so_far['width']} members): largest first-step "
                     f"difference {so_far['max_first_step_rel_diff']:.1e}; timed runs: "
                     f"{done or 'none'}; end to end "
                     f"{_f(so_far.get('end_to_end_speedup'), '.2f', 'x')}, steady "
                     f"{_f(so_far.get('steady_speedup'), '.2f', 'x')}")
    return table("fusion", rows), notes


def _packing_md(sec: dict[str, Any]) -> tuple[list[str], list[str]]:
    by = {r["policy"]: r for r in sec.get("rows", [])}
    packed, fixed = by.get("scamp"), by.get("fixed")
    rows = []
    if by:
        first = next(iter(by.values()))
        ratio = (packed["trials_per_hour"] / fixed["trials_per_hour"]
                 if packed and fixed and fixed["trials_per_hour"] else None)
        rows.append(["swinir (smoke)", str(first["trials"]), str(sec.get("steps", NOT_YET)),
                     _f(packed and packed["trials_per_hour"], ".1f"),
                     _f(fixed and fixed["trials_per_hour"], ".1f"), _f(ratio, ".2f", "x"),
                     ", ".join(f"{r['planning_s']:.1f} {w}" for w, r in
                               (("packed", packed), ("one at a time", fixed))
                               if r and r.get("planning_s") is not None) or NOT_YET])
    notes = [f"{r['policy']}: {r['end_to_end_s']:.1f} s end to end, runner compiles "
             f"{_f(r.get('runner_compile_s'), '.1f', ' s')}, initial states on the host "
             f"{_f(r.get('host_initial_state_s'), '.1f', ' s')}, steady "
             f"{_f(r.get('steady_step_s'), '.4f', ' s/step')}, mean memory use "
             f"{100 * r['mean_memory_utilization']:.1f}%, peak in use "
             f"{_b(r.get('peak_bytes_in_use'))}" for r in sec.get("rows", [])]
    return table("packing", rows), notes


def _mainjob_md(sec: dict[str, Any]) -> tuple[list[str], list[str]]:
    def pct(x: Any) -> str:
        return NOT_YET if x is None else f"{100 * x:.1f}%"

    rows = []
    for r in sec.get("rows", []):
        share = (NOT_YET if r.get("compile_s") is None
                 else f"{r['compile_s']:.1f} ({pct(r.get('compile_share'))})")
        best = (NOT_YET if r.get("best") is None
                else f"{r['best']:.3f} vs {_f(r.get('bicubic'), '.3f')} dB")
        if r.get("test") is not None:  # the best model on images no trial was chosen by
            best += f"; test {r['test']:.3f} vs {_f(r.get('test_bicubic'), '.3f')}"
        rows.append([f"{r['trials_finished']} of {r['trials']}", str(sec.get("steps", NOT_YET)),
                     _f(r.get("study_s"), ".1f"), share,
                     f"{pct(r.get('peak_memory_utilization'))} / "
                     f"{pct(r.get('mean_memory_utilization'))}",
                     ", ".join(map(str, r.get("batch_sizes") or [])) or NOT_YET,
                     str(r.get("fused_trials", NOT_YET)),
                     f"{_f(r.get('fused_step_s'), '.3f')} / {_f(r.get('host_data_s'), '.3f')}",
                     f"{_f(r.get('solo_step_s'), '.3f')} "
                     f"({_f(r.get('solo_step_over_least'), '.1f', 'x')})",
                     best])
    notes = [f"`{sec['command']}`; compile s: every compile's and cache load's seconds in "
             "`run.overhead` (summed over threads), its share of the study's seconds; fused "
             "step: the fused "
             "trials' seconds a step over their runs (`step_seconds`, median); host data: one "
             "step's batches of a fused group of "
             f"{(sec.get('rows') or [{}])[0].get('host_data', NOT_YET)} "
             "(members x batch) as the runner draws them, after the study "
             "(`benchmarks.member_data`); solo step: the solo trials' (median), times the "
             "least a step takes by its FLOPs at the FLOP/s the engine paces trials by (what "
             "`--plan-only` says for a GPU target)"] if sec.get("command") else []
    if any(r.get("interrupted") for r in sec.get("rows", [])):
        notes.append("stopped at the section's time: finished trials, usage and compiles up "
                     "to the stop")
    return table("mainjob", rows), notes


def _compiles_md(sec: dict[str, Any]) -> tuple[list[str], list[str]]:
    rows = []
    for r in sec.get("rows", []):
        if r.get("unfinished_s") is not None or r.get("error"):
            what = (f"did not finish in {r['unfinished_s']:.0f} s" if r.get("error") is None
                    else f"failed: {r['error'][:120]}")
            rows.append([r["case"], r["budget"], r["form"], what, "", "", "", ""])
            continue
        rows.append([r["case"], r["budget"], r["form"], _f(r.get("wall_s"), ".1f"),
                     _f(r.get("cpu_s"), ".1f"), str(r.get("plan_compiles", NOT_YET)),
                     f"{r.get('batch', NOT_YET)}", _b(r.get("peak_bytes"))])
    return table("compiles", rows), (["`python -m benchmarks.compiles --case CASE --devices 1 "
                                      "--memory-per-device BUDGET [--planning-only]`, a fresh "
                                      "process each"] if rows else [])


def _supernet_md(sec: dict[str, Any]) -> tuple[list[str], list[str]]:
    seq = next((r for r in sec.get("rows", []) if r["schedule"] == "sequential"), None)
    rows = [[r["schedule"], str(r.get("choices", NOT_YET)), str(r["stages"]),
             "on" if r["offload"] else "off", f"{r['samples_per_second']:.1f}",
             _f(seq and r["samples_per_second"] / seq["samples_per_second"], ".2f", "x"),
             NOT_YET if seq is None else ("yes" if r["params_sha256"] == seq["params_sha256"]
                                          else "no"),
             _b(r["device_param_bytes"])] for r in sec.get("rows", [])]
    notes = ["samples/s in steady state (ticks after the first); end to end: " + ", ".join(
        f"{r['schedule']} offload {'on' if r['offload'] else 'off'} {r['wall_seconds']:.2f} s"
        for r in sec.get("rows", []))] if sec.get("rows") else []
    return table("supernet", rows), notes


def _determinism_md(sec: dict[str, Any]) -> tuple[list[str], list[str]]:
    rows = [[r["what"], "2", str(r["steps"]), "yes" if r["same_bytes"] else "NO",
             str(sec.get("deterministic_gpu_ops")), f"{r['seconds']:.1f}"]
            for r in sec.get("rows", [])]
    notes = [f"{r['what']}: largest relative difference of the final loss "
             f"{r['max_rel_diff']:.1e}" for r in sec.get("rows", [])]
    return table("determinism", rows), notes


def _tests_md(sec: dict[str, Any]) -> tuple[list[str], list[str]]:
    got = sec.get("rows", [])
    if not got:
        return table("tests", []), []
    count = {k: sum(1 for r in got if r["outcome"] in ks)
             for k, ks in (("passed", ("passed", "xpass")), ("failed", ("failed", "error")),
                           ("skipped", ("skipped", "xfail")))}
    keyword = f" -k '{sec['keyword']}'" if sec.get("keyword") else ""
    rows = [[f"gpu (`pytest -m gpu {' '.join(sec.get('files', []))}{keyword}`)",
             str(count["passed"]),
             str(count["failed"]), str(count["skipped"]),
             f"{sum(r['seconds'] for r in got):.1f}"]]
    failed = [r["test"].split("::")[-1] for r in got if r["outcome"] in ("failed", "error")]
    return table("tests", rows), ([f"Failed: {', '.join(failed)}"] if failed else [])


SECTION_TABLES: dict[str, Callable[[dict[str, Any]], tuple[list[str], list[str]]]] = {
    "memory": _memory_md, "fusion": _fusion_md, "mainjob": _mainjob_md, "packing": _packing_md,
    "determinism": _determinism_md, "supernet": _supernet_md, "tests": _tests_md,
    "compiles": _compiles_md,
}


def read_report(path: Path) -> dict[str, Any]:
    """The GPU suite report in ``path`` (its ``gpu_suite.json``).

    Raises:
      ValueError: it cannot be read, or is no such report (the message says which).
    """
    import json

    try:
        report = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err}; pass a gpu_suite.json the suite "
                         "wrote") from None
    except ValueError as err:
        raise ValueError(f"{path} is no JSON ({err}); pass a gpu_suite.json the suite "
                         "wrote") from None
    if not isinstance(report, dict) or not isinstance(report.get("meta"), dict):
        raise ValueError(f"{path} is no GPU suite report (no 'meta' section); pass a "
                         "gpu_suite.json the suite wrote")
    return report


def main(argv: list[str] | None = None) -> str:
    """Make a suite's ``gpu_suite.md`` again from its ``gpu_suite.json`` (say, with a fix of
    this module's tables, where the run's Markdown failed or left a figure out), on any
    machine; the text is written beside the JSON (or to ``--out``) and returned."""
    import argparse

    from benchmarks.gpu_suite import SECTIONS
    from experiments._cli import output_file
    from scamp_jax.hpo.session import check_file

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_markdown",
        description="Write a GPU suite's Markdown report again from its gpu_suite.json "
                    "(the figures are the run's; only the tables are made anew).")
    p.add_argument("report", type=Path, metavar="GPU_SUITE_JSON",
                   help="the suite's gpu_suite.json (or the folder holding it)")
    p.add_argument("--out", type=lambda t: t if t == "-" else output_file(t), default=None,
                   metavar="FILE",
                   help="where to write the Markdown (default: gpu_suite.md beside the JSON); "
                   "- prints it instead")
    args = p.parse_args(argv)
    path = args.report / "gpu_suite.json" if args.report.is_dir() else args.report
    try:
        report = read_report(path)
    except ValueError as err:
        p.error(str(err))
    out = args.out or path.with_name("gpu_suite.md")
    if args.out is None:  # the default, beside the JSON (a given --out is checked as parsed)
        try:
            check_file(out, "")
        except ValueError:
            p.error(f"{str(out)!r} (the default, beside the JSON) cannot be written there; "
                    "pass --out FILE to write the Markdown elsewhere")
    text = markdown(report, SECTIONS)
    if out == "-":
        print(text, end="")
    else:
        try:
            Path(out).write_text(text)
        except OSError as err:
            p.error(f"{out} could not be written ({err.strerror or err}); pass --out FILE")
        print(f"wrote {out}")
    return text


if __name__ == "__main__":
    main()
