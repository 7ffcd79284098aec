"""The GPU suite's report as Markdown: one table per section, header rows that stay the same
from run to run so that they drop into BENCHMARKS.md. A section cut short at its time cap says
so in its heading and shows what it measured; a failed one shows its error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The header row of each section's main table (BENCHMARKS.md's GPU section uses the same).
HEADERS: dict[str, list[str]] = {
    "memory": ["case", "budget", "planned batch", "compiled peak", "measured peak", "error",
               "capped run", "first batch out of memory"],
    "memory details": ["case", "run", "batch", "allocator", "booked", "compiled", "measured peak",
                       "booked vs measured", "pool after init / compile / step 1 / step 2"],
    "fusion": ["family", "width", "steady step solo s", "steady step fused s", "steady_speedup",
               "end-to-end speedup", "compile+planning s", "max first-step rel. diff",
               "noise floor"],
    "packing": ["way", "end-to-end s", "trials/h", "planning compile s", "runner compile s",
                "steady s/step", "mean memory util.", "peak in use"],
    "determinism": ["run twice", "same bytes", "max rel. diff"],
    "supernet": ["schedule", "offload", "stages", "end-to-end s", "steady samples/s",
                 "device weights", "host weights", "host->device", "device->host"],
    "tests": ["test", "outcome", "seconds"],
}


def _b(x: Any) -> str:
    from scamp_jax._units import format_bytes

    return "-" if x is None else format_bytes(int(x))


def _p(x: Any) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def table(name: str, rows: list[list[str]]) -> list[str]:
    """A Markdown table under ``HEADERS[name]``."""
    head = HEADERS[name]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def markdown(report: dict[str, Any], sections: tuple[str, ...]) -> str:
    """The report's tables as Markdown (sections in ``sections`` order)."""
    meta = report["meta"]
    lines = [f"# GPU suite ({meta['config']}, {meta.get('minutes', '?')} min): "
             f"{meta.get('devices', '?')} x {meta.get('device_kind', '?')} "
             f"({meta.get('platform', '?')}), started {meta['started']}", ""]
    env = meta.get("environment") or {}
    if env.get("packages"):
        pk = env["packages"]
        lines += [f"jax {pk.get('jax', '?')}, flax {pk.get('flax', '?')}, Python "
                  f"{env.get('python', '?')}; target description: "
                  f"{env.get('target_config') or env.get('target_config_reason', '-')}", ""]
    for name in sections:
        sec = report.get(name)
        if sec is None:
            continue
        state = "; cut short" if sec.get("cut_short") else ""
        lines += [f"## {name} ({sec.get('seconds', 0):.0f} s of its "
                  f"{sec.get('cap_seconds', 0):.0f} s cap{state})", ""]
        if sec.get("cut_reasons"):
            lines += ["Cut short: " + "; ".join(sec["cut_reasons"]), ""]
        if sec.get("status") not in ("ok", "cut short"):
            lines += [f"{sec.get('status')}: {sec.get('error') or sec.get('reason')}", ""]
        if sec.get("rows") or name == "memory" and sec.get("cases"):
            try:
                lines += SECTION_TABLES[name](sec)
            except (KeyError, TypeError, ZeroDivisionError) as err:  # a partial record
                lines += [f"(table incomplete: {type(err).__name__}: {err})", ""]
        if sec.get("note"):
            lines += [f"Note: {sec['note']}.", ""]
    return "\n".join(lines)


def _pools(phases: dict[str, Any] | None) -> str:
    if not phases:
        return "-"
    return " / ".join(_b((phases.get(p) or {}).get("pool_bytes"))
                      for p in ("init", "compile", "step 1", "step 2"))


def _allocator(env: dict[str, Any] | None) -> str:
    if not env:
        return "-"
    fraction = env.get("XLA_CLIENT_MEM_FRACTION") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    pre = env.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    return f"fraction {float(fraction):.4g}, prealloc {pre}" if fraction else \
        f"default, prealloc {pre}"


def _memory_md(sec: dict[str, Any]) -> list[str]:
    rows = []
    by_case: dict[str, list[dict[str, Any]]] = {}
    for r in sec.get("rows", []):
        by_case.setdefault(r["case"], []).append(r)
    for label, case in sec.get("cases", {}).items():
        if case.get("skipped"):
            rows.append([label, "-", "-", "-", "-", "-", f"skipped: {case['skipped']}", "-"])
            continue
        planned = next((r for r in by_case.get(label, []) if r["point"] == "planned, capped"),
                       None)
        oom = case.get("first_oom_batch")
        if isinstance(oom, int):
            oom_text = f"{oom} (largest run {case['largest_ok_batch']}; planned/first " \
                       f"{case['planned_over_first_oom']:.2f})"
        elif "largest_ok_batch" in case:
            oom_text = f"none up to {case['largest_ok_batch']} ({case['probes']} probes)"
        else:
            oom_text = str(oom) if oom else ("cut short" if case.get("cut_short") else "-")
        run = case.get("capped_run") or ("cut short" if case.get("cut_short")
                                         else case.get("error", "-"))
        rows.append([label, _b(case.get("budget")), str(planned["batch"]) if planned else "-",
                     _b(planned and planned["compiled"]), _b(planned and planned["measured"]),
                     _p(planned and planned["error_pct"]), run, oom_text])
    details = [[r["case"], r["point"], str(r["batch"]), _allocator(r.get("allocator_env")),
                _b(r.get("booked")), _b(r["compiled"]),
                f"OOM in {r.get('oom_phase')}" if r["oom"] else _b(r["measured"]),
                _p(r.get("booked_vs_measured_pct")), _pools(r.get("phases"))]
               for r in sec.get("rows", [])]
    allowance = sec.get("allowance") or {}
    return table("memory", rows) + table("memory details", details) + [
        f"Allowance for memory XLA does not see: {_b(allowance.get('bytes'))}"
        + (f" = {_b(allowance['unseen_bytes'])} unseen + {_b(allowance['context_bytes'])} "
           "outside the allocator" if "unseen_bytes" in allowance else
           f" ({allowance.get('reason', 'not computed')})"), ""]


def _fusion_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["family"], str(r["width"]), _f(r["steady_step_solo_s"], ".4f"),
             _f(r["steady_step_fused_s"], ".4f"), _f(r["steady_speedup"]),
             _f(r["end_to_end_speedup"]), _f(r["compile_planning_s"], ".1f"),
             _f(r["max_first_step_rel_diff"], ".1e"), _f(r["noise_floor_first_step"], ".1e")]
            for r in sec["rows"]]
    out = table("fusion", rows)
    for r in sec["rows"]:
        out += [f"Fused vs solo final loss, largest relative difference "
                f"{r['max_final_loss_rel_diff']:.1e} (noise floor, the same trial twice: "
                f"{r['noise_floor_final_loss']:.1e}); end to end {r['fused_seconds']:.1f} s "
                f"fused vs {r['unfused_seconds']:.1f} s one after another, {r['steps']} steps "
                f"at batch {r['batch']}; solo steady step from the {r['steady_step_solo_source']}"
                ".", ""]
    return out


def _packing_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["way"], f"{r['end_to_end_s']:.1f}", f"{r['trials_per_hour']:.1f}",
             _f(r.get("planning_compile_s"), ".1f"), _f(r.get("runner_compile_s"), ".1f"),
             _f(r.get("steady_step_s"), ".4f"), f"{100 * r['mean_memory_utilization']:.1f}%",
             _b(r.get("peak_bytes_in_use"))] for r in sec["rows"]]
    tail = ([f"Packed / fixed trials per hour: {sec['speedup_trials_per_hour']:.2f}x", ""]
            if "speedup_trials_per_hour" in sec else [])
    return table("packing", rows) + tail


def _supernet_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["schedule"], "on" if r["offload"] else "off", str(r["stages"]),
             f"{r['wall_seconds']:.2f}", f"{r['samples_per_second']:.1f}",
             _b(r["device_param_bytes"]), _b(r["host_param_bytes"]),
             _b(r["host_to_device_bytes"]), _b(r["device_to_host_bytes"])] for r in sec["rows"]]
    tail = []
    if "csp_over_sequential" in sec:
        tail = [f"CSP / sequential {sec['csp_over_sequential']:.2f}x, CSP / GPipe "
                f"{sec['csp_over_gpipe']:.2f}x (steady); CSP == sequential bitwise: "
                f"{sec['csp_equals_sequential']}; offload on == off: "
                f"{sec.get('offload_equals_resident', '-')}", ""]
    return table("supernet", rows) + tail


def _determinism_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["what"], "yes" if r["same_bytes"] else "NO", _f(r.get("max_rel_diff"), ".1e")]
            for r in sec["rows"]]
    return table("determinism", rows) + [
        f"Deterministic GPU kernels: {sec.get('deterministic_gpu_ops')}", ""]


def _tests_md(sec: dict[str, Any]) -> list[str]:
    rows = [[r["test"], r["outcome"], f"{r['seconds']:.1f}"] for r in sec["rows"]]
    return table("tests", rows)


SECTION_TABLES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "memory": _memory_md, "fusion": _fusion_md, "packing": _packing_md,
    "determinism": _determinism_md, "supernet": _supernet_md, "tests": _tests_md,
}
