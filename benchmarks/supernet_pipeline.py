"""CSP vs GPipe vs sequential supernet pipelines: ticks, utilisation, samples/s, offload bytes.

    python -m benchmarks.supernet_pipeline               # schedules for C in {2,4,12,24}, S in
                                                         # {2,4,8}; measured run C=12, S=4
    python -m benchmarks.supernet_pipeline --measure all # measured runs on every (C, S) (slow)
    python -m benchmarks.supernet_pipeline --markdown    # tables as Markdown

Three tables:

1. Schedules (pure, no devices): a supernet of 16 choice layers, 64 subnets drawn uniformly,
   split into S stages. Ticks and stage utilisation (busy stage-ticks / (S x ticks)) of
   ``sequential``, ``gpipe`` (4 microbatches, flush per subnet), ``csp`` with the stem and head
   frozen, ``csp`` with them trained, and the no-dependency ideal (same pipeline, no CSP stall).
   A GPipe tick processes a quarter batch, so compare its samples/s, not its ticks.
2. Offload: weights + optimizer state (Adam) on the devices with the supernet in host memory,
   against the whole supernet, for width 16.
3. Measured (CPU devices): a tiny supernet (8 layers, width 8, 8x8 LR patches, batch 8, 48
   subnets) trained with each schedule on the same executor code; steady-state samples/s
   (compilation excluded) and whether CSP's weights hash equals sequential's. On a CPU the stage
   "devices" share the host's cores, so these speedups are far below the tick ratios; they show
   the executor's overhead, not accelerator throughput.

Two more tables on their own flags:

* ``--fair``: every schedule at its own largest batch under one per-device ``--budget``
  (`scamp_jax.pipeline.plan_schedule` on the compiled stage tick) and CSP's speed-up split into
  a scheduling and a memory part (`fair_rows`). Compiling the tick is most of its cost (seconds
  at C=2 to minutes at C=24 with few stages, on a CPU): each (C, S) compiles every distinct
  stage step once through one `scamp_jax.pipeline.ExecutorCache`, and its log line on stderr
  says how many were compiled and how long that took.
* ``--idle-guard``: the idle-tick guard off vs on (`idle_guard_rows`).

The measured runs put all S stage devices in one collective-permute per tick. Two guards keep
S=8 on a few shared CPU cores from aborting:

* ``--max-in-flight`` (default 4 ticks, the executor's default): with hundreds of 8-device ticks
  queued the CPU backend (jaxlib 0.10.2) sometimes deadlocks: some devices wait in a tick's
  collective-permute for a device whose execution never starts, with the process idle, until
  XLA aborts it ("Termination timeout for collective permute ... only 7 of them arrived"). The
  executor waits for the tick ``max_in_flight`` back (`StageExecutor`'s ``max_in_flight``), the
  same for every schedule; 0 measures the unbounded queue.
* ``--collective-timeout`` (default 120 s): XLA aborts the process when a collective rendezvous
  waits ``--xla_cpu_collective_call_warn_stuck_timeout_seconds`` (20 s) plus
  ``--xla_cpu_collective_call_terminate_timeout_seconds`` (40 s by default) for a device
  thread. Device threads descheduled on a loaded host are slow, not hung, so the benchmark sets
  the second flag before JAX starts; a real deadlock still ends within about 2.5 minutes. The
  flag only affects XLA's CPU backend; an ``XLA_FLAGS`` value the user already set is kept.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._tables import print_table

CHOICES = (2, 4, 12, 24)
STAGES = (2, 4, 8)
# XLA CPU flag (jaxlib 0.10.2) that ends the process when a collective rendezvous waits this many
# seconds beyond the stuck-warning delay; default 40.
TERMINATE_FLAG = "xla_cpu_collective_call_terminate_timeout_seconds"


def raise_cpu_collective_timeout(seconds: int) -> None:
    """Let a CPU collective wait up to ``seconds`` (s) for late device threads before XLA aborts.

    Appends ``--xla_cpu_collective_call_terminate_timeout_seconds=seconds`` to ``XLA_FLAGS``
    unless the user already set that flag. XLA reads the flags when JAX initialises a backend, so
    call this before the first array or ``jax.devices()``. GPU and TPU backends ignore the flag.
    """
    if seconds < 1:
        raise ValueError(
            f"collective timeout {seconds=} must be at least 1 second; pass e.g. 120"
        )
    flags = os.environ.get("XLA_FLAGS", "")
    if TERMINATE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{TERMINATE_FLAG}={seconds}".strip()


def _subnets(n: int, layers: int, choices: int, seed: int) -> list[tuple[int, ...]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [tuple(int(c) for c in row) for row in rng.integers(0, choices, (n, layers))]


def schedule_rows(num_subnets: int = 64, layers: int = 16, seed: int = 0) -> list[list[str]]:
    """Table 1 rows: C, S, then ticks / utilisation per schedule and CSP's speedups."""
    from scamp_jax.pipeline import (
        csp_schedule,
        gpipe_schedule,
        ideal_schedule,
        sequential_schedule,
        split_layers,
    )

    rows = []
    for c in CHOICES:
        for s in STAGES:
            subnets = _subnets(num_subnets, layers, c, seed)
            bounds = split_layers(layers, s)
            seq = sequential_schedule(num_subnets, s)
            gp = gpipe_schedule(num_subnets, s, 4)
            csp = csp_schedule(subnets, bounds)
            csp_shared = csp_schedule(subnets, bounds, train_shared=True)
            ideal = ideal_schedule(subnets, bounds)
            rows.append([
                str(c), str(s),
                *(f"{x.ticks} ({x.utilization:.2f})" for x in (seq, gp, csp, csp_shared, ideal)),
                f"{seq.ticks / csp.ticks:.2f}x",
            ])
    return rows


def offload_rows(layers: int = 16, width: int = 16) -> list[list[str]]:
    """Table 2 rows: C, S, device bytes with and without offload, supernet bytes."""
    from scamp_jax._units import format_bytes
    from scamp_jax.pipeline import (
        OptimizerSpec,
        PipelineExecutor,
        build_program,
        csp_schedule,
        split_layers,
        supernet_state_bytes,
    )
    from search_spaces.supernet import SupernetConfig, SupernetLayout

    rows = []
    for c in CHOICES:
        layout = SupernetLayout(SupernetConfig(layers, c, width, scale=2, window_size=4))
        for s in STAGES:
            subnets = _subnets(64, layers, c, 0)
            bounds = split_layers(layers, s)
            prog = build_program(csp_schedule(subnets, bounds), subnets, bounds)
            planned = {}
            for offload in (True, False):
                ex = PipelineExecutor(
                    layout, num_stages=s, microbatch_size=8, lr_side=8,
                    window_slots=prog.window_slots, act_slots=prog.act_slots,
                    grad_slots=prog.grad_slots, offload=offload,
                )
                planned[offload] = ex.planned_bytes()
            total = supernet_state_bytes(layout, OptimizerSpec())
            on = planned[True]["device_param_bytes"]
            rows.append([
                str(c), str(s), str(prog.window_slots), format_bytes(on),
                format_bytes(planned[False]["device_param_bytes"]), format_bytes(total),
                f"{on / total:.2f}",
            ])
    return rows


# The measured runs' tiny supernet: 8 choice layers of width 8 on 8x8 LR patches (x2 SR).
LAYERS, WIDTH, SIDE = 8, 8, 8


def _case(choices: int, stages: int, subnets: int) -> tuple[Any, list[tuple[int, ...]], Any]:
    """The tiny supernet with ``choices`` candidates, its first ``subnets`` subnets (seed 0)
    and the split of its layers over ``stages`` stages."""
    from scamp_jax.pipeline import split_layers
    from search_spaces.supernet import SupernetConfig, SupernetLayout, sample_subnets

    config = SupernetConfig(LAYERS, choices, WIDTH, scale=2, window_size=4)
    chosen = [x.choices for x in sample_subnets(subnets, config, 0)]
    return SupernetLayout(config), chosen, split_layers(LAYERS, stages)


def _data(subnets: int, batch: int, seed: int = 0) -> tuple[Any, Any]:
    """Random (N, B, SIDE, SIDE, 3) LR inputs and (N, B, 2 SIDE, 2 SIDE, 3) HR targets."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lr = rng.random((subnets, batch, SIDE, SIDE, 3), dtype=np.float32)
    hr = rng.random((subnets, batch, 2 * SIDE, 2 * SIDE, 3), dtype=np.float32)
    return lr, hr


def _shapes(mb: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Input and target shapes of one stage's microbatch of ``mb`` samples."""
    return (mb, SIDE, SIDE, 3), (mb, 2 * SIDE, 2 * SIDE, 3)


def measure_schedules(
    choices: int, stages: int, subnets: int = 48, max_in_flight: int = 4, offload: bool = True,
    batch: int = 8, schedules: Sequence[str] = ("csp", "sequential", "gpipe"),
) -> dict[str, Any]:
    """Train the tiny supernet with each of ``schedules`` on the same executor code.

    Returns ``{name: TrainResult}`` under ``"results"`` and the host <-> device traffic of the
    weights under ``"transfer_bytes"`` per schedule: ``{"host_to_device", "device_to_host"}``,
    counted from the schedule's program (each prefetch fills one stage's window with its
    ``layers_per_stage`` blocks; each applied update writes them back) times the bytes of one
    block (weights + optimizer state); 0 without ``offload`` (the supernet stays on the devices).
    ``max_in_flight`` bounds the ticks queued ahead of the host (`StageExecutor`; 0: unbounded).
    """
    from scamp_jax.pipeline import (
        PipelineExecutor,
        build_executor,
        build_program,
        make_schedule,
        train_supernet,
    )

    lr, hr = _data(subnets, batch)
    layout, chosen, bounds = _case(choices, stages, subnets)
    programs = {
        name: build_program(make_schedule(name, chosen, bounds, num_microbatches=4), chosen,
                            bounds)
        for name in schedules
    }
    executor_class = functools.partial(PipelineExecutor, max_in_flight=max_in_flight)
    unsplit = [programs[n] for n in schedules if n != "gpipe"]
    shared_ex = (build_executor(layout, unsplit, num_stages=stages, batch_size=batch,
                                lr_side=SIDE, offload=offload, executor_class=executor_class)
                 if unsplit else None)
    results, transfer = {}, {}
    for name in schedules:
        results[name] = train_supernet(
            layout, chosen, lr, hr, schedule=name, num_stages=stages, offload=offload,
            num_microbatches=4, executor=executor_class if name == "gpipe" else shared_ex,
        )
        prog = programs[name]
        block = (results[name].host_param_bytes // (LAYERS * choices)) if offload else 0
        blocks = prog.layers_per_stage * block
        transfer[name] = {
            "host_to_device": int((prog.column("prefetch_slot") >= 0).sum()) * blocks,
            "device_to_host": int((prog.column("apply") == 1).sum()) * blocks,
        }
    return {"results": results, "transfer_bytes": transfer}


def measured_rows(
    pairs: Sequence[tuple[int, int]], subnets: int = 48, max_in_flight: int = 4
) -> list[list[str]]:
    """Table 3 rows: C, S, samples/s per schedule, CSP speedups, hash equality.

    ``max_in_flight`` bounds the ticks queued ahead of the host (`StageExecutor`'s argument;
    0: unbounded).
    """
    rows = []
    for c, s in pairs:
        res = measure_schedules(c, s, subnets, max_in_flight)["results"]
        sps = {k: v.samples_per_second for k, v in res.items()}
        rows.append([
            str(c), str(s), *(f"{sps[k]:.0f}" for k in ("sequential", "gpipe", "csp")),
            f"{sps['csp'] / sps['sequential']:.2f}x", f"{sps['csp'] / sps['gpipe']:.2f}x",
            "yes" if res["csp"].params_sha256 == res["sequential"].params_sha256 else "NO",
        ])
        print(f"measured C={c} S={s}: " + " | ".join(rows[-1][2:]), file=sys.stderr, flush=True)
    return rows


def idle_guard_rows(
    choices: int = 4, stages: int = 4, subnets: int = 24, max_in_flight: int = 4
) -> list[list[str]]:
    """Idle-tick guard off vs on (offload on, CSP), side by side in one process.

    For each setting: the compiled tick's device bytes per stage device (XLA
    ``memory_analysis``: arguments + outputs - aliased + temporaries) and its temporaries,
    steady-state samples/s of a CSP run, and whether the two runs' weights hashes agree.
    """
    import numpy as np

    from scamp_jax._units import format_bytes
    from scamp_jax.pipeline import PipelineExecutor, build_program, make_schedule, train_supernet

    batch = 8
    layout, chosen, bounds = _case(choices, stages, subnets)
    lr, hr = _data(subnets, batch)
    prog = build_program(make_schedule("csp", chosen, bounds), chosen, bounds)
    idle = {
        "fetch": float(np.mean(prog.column("prefetch_slot") < 0)),
        "write": float(np.mean(prog.column("apply") == 0)),
    }
    rows, hashes = [], []
    for guard in (False, True):
        ex = PipelineExecutor(
            layout, num_stages=stages, microbatch_size=batch, lr_side=SIDE,
            window_slots=prog.window_slots, act_slots=prog.act_slots,
            grad_slots=prog.grad_slots, offload=True, guard_idle=guard,
            max_in_flight=max_in_flight,
        )
        mem = ex.compiled_memory(*_shapes(batch))
        res = train_supernet(layout, chosen, lr, hr, schedule="csp", num_stages=stages,
                             offload=True, executor=ex)
        hashes.append(res.params_sha256)
        rows.append([
            "on" if guard else "off", str(choices), str(stages),
            f"{idle['fetch']:.2f} / {idle['write']:.2f}", format_bytes(mem["device_bytes"]),
            format_bytes(mem["temp"]), f"{res.samples_per_second:.1f}",
        ])
        print("idle guard " + " | ".join(rows[-1]), file=sys.stderr, flush=True)
    for row in rows:
        row.append("yes" if hashes[0] == hashes[1] else "NO")
    return rows


FAIR_SCHEDULES = ("sequential", "gpipe", "csp")


def fair_rows(
    pairs: Sequence[tuple[int, int]], budget_bytes: int, subnets: int = 16,
    max_in_flight: int = 4, repeats: int = 3,
) -> list[list[str]]:
    """Each schedule at its own largest batch under one per-device budget; speed-up split.

    For every (C, S): `scamp_jax.pipeline.budget.plan_schedule` picks each schedule's batch
    (a multiple of 4, GPipe's microbatch count, for all three) and prefetch look-ahead from its
    compiled tick; each runs at its plan (offload on, steady-state samples/s). CSP's speed-up over
    a baseline X, ``csp(B_csp) / X(B_X)``, splits into a scheduling part ``csp(B_csp) /
    X(B_csp)`` (same batch) and a memory part ``X(B_csp) / X(B_X)`` (X at CSP's batch, with its
    own plan's look-ahead, instead of its own batch), so total = scheduling x memory. Every
    configuration runs ``repeats`` times, the configurations interleaved round by round on
    already compiled ticks, and the best samples/s counts (the least disturbed run on a shared
    machine). One `ExecutorCache` per (C, S) serves the probes, the plans and the runs, so each
    distinct stage step compiles once. A (C, S) whose smallest batch does not fit the budget
    for some schedule gets a row that says so, with the bytes that batch needs.
    """
    from scamp_jax._units import format_bytes
    from scamp_jax.pipeline import (
        BatchDoesNotFitError,
        ExecutorCache,
        PipelineExecutor,
        build_executor,
        build_program,
        make_schedule,
        plan_schedule,
        train_supernet,
    )

    m = 4
    rows = []
    budget = format_bytes(budget_bytes)
    for c, s in pairs:
        layout, chosen, bounds = _case(c, s, subnets)
        cache = ExecutorCache(functools.partial(PipelineExecutor, max_in_flight=max_in_flight))
        plans, runs = {}, {}  # runs: (schedule, batch) -> (executor, prefetch_ahead)
        start = time.perf_counter()
        try:
            for name in FAIR_SCHEDULES:
                plan, ex, _ = plan_schedule(
                    layout, chosen, _shapes, schedule=name, num_stages=s,
                    budget_bytes=budget_bytes, lr_side=SIDE, num_microbatches=m,
                    batch_multiple=m, executor_class=cache,
                )
                plans[name] = plan
                runs[(name, plan.batch_size)] = (ex, plan.prefetch_ahead)
                print(f"fair C={c} S={s} {name}: batch {plan.batch_size}, ahead "
                      f"{plan.prefetch_ahead}, {plan.device_bytes} B, {plan.compiles} compiles, "
                      f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        except BatchDoesNotFitError as err:
            rows.append([str(c), str(s), budget, f"does not fit: {err}", *[""] * 6])
            print(f"fair C={c} S={s}: {err} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)
            continue
        b_csp = plans["csp"].batch_size
        for name in ("sequential", "gpipe"):
            if (name, b_csp) not in runs:
                mx, ahead = plans[name].num_microbatches, plans[name].prefetch_ahead
                prog = build_program(make_schedule(name, chosen, bounds, num_microbatches=mx),
                                     chosen, bounds, prefetch_ahead=ahead)
                ex = build_executor(layout, [prog], num_stages=s, batch_size=b_csp,
                                    lr_side=SIDE, num_microbatches=mx, offload=True,
                                    executor_class=cache)
                ex.compiled_memory(*_shapes(b_csp // mx))
                runs[(name, b_csp)] = (ex, ahead)
        compile_s = time.perf_counter() - start
        sps: dict[tuple[str, int], float] = {}
        for _ in range(repeats):
            for (name, batch), (ex, ahead) in runs.items():
                res = train_supernet(layout, chosen, *_data(subnets, batch, seed=batch),
                                     schedule=name, num_stages=s, num_microbatches=m,
                                     executor=ex, prefetch_ahead=ahead)
                sps[(name, batch)] = max(sps.get((name, batch), 0.0), res.samples_per_second)
        split = []
        for name in ("sequential", "gpipe"):
            total = sps[("csp", b_csp)] / sps[(name, plans[name].batch_size)]
            sched = sps[("csp", b_csp)] / sps[(name, b_csp)]
            split.append(f"{total:.2f}x = {sched:.2f}x sched x {total / sched:.2f}x mem")
        rows.append([
            str(c), str(s), budget,
            *(f"{plans[k].batch_size} (+{plans[k].prefetch_ahead}) "
              f"{sps[(k, plans[k].batch_size)]:.0f}" for k in FAIR_SCHEDULES),
            *(f"{sps[(k, b_csp)]:.0f}" for k in ("sequential", "gpipe")),
            *split,
        ])
        print(f"fair C={c} S={s}: {cache.built} ticks compiled ({cache.hits} reused) in "
              f"{compile_s:.0f} s, runs {time.perf_counter() - start - compile_s:.0f} s: "
              + " | ".join(rows[-1][3:]), file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags, print the three tables."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.supernet_pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--measure", choices=("default", "all", "none"), default="default",
                        help="measured runs: C=12, S=4 (default, about 2 minutes), every "
                             "(C, S) (slow), or none")
    parser.add_argument("--choices", type=int, nargs="+", default=list(CHOICES),
                        help="choices per layer of the measured runs with --measure all")
    parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES),
                        help="stage counts of the measured runs with --measure all (S=8 puts a "
                        "collective on 8 CPU devices at once; see --max-in-flight)")
    parser.add_argument("--collective-timeout", type=int, default=120, metavar="SECONDS",
                        help="seconds a CPU collective waits (after XLA's 20 s stuck warning) for "
                             "late device threads before XLA aborts (XLA's default: 40)")
    parser.add_argument("--max-in-flight", type=int, default=4, metavar="TICKS",
                        help="ticks the measured runs may queue ahead of the host (0: no bound; "
                             "an unbounded queue can deadlock the CPU backend at S=8)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--fair", action="store_true",
                        help="only the fair-baseline table: every schedule at its largest "
                             "batch under --budget, on the (C, S) pairs of --choices x --stages")
    parser.add_argument("--budget", default="4MiB",
                        help="per-device memory budget of --fair (e.g. 4MiB)")
    parser.add_argument("--idle-guard", action="store_true",
                        help="only measure the idle-tick guard (off vs on, C=4, S=4)")
    args = parser.parse_args(argv)
    if args.max_in_flight < 0:
        parser.error(f"--max-in-flight {args.max_in_flight} must be >= 0 (0: no bound)")
    from scamp_jax.devices import configure_cpu_devices

    # Before configure_cpu_devices: both must be in XLA_FLAGS when JAX creates the CPU backend.
    raise_cpu_collective_timeout(args.collective_timeout)
    from scamp_jax.pipeline.determinism import use_deterministic_gpu_ops

    use_deterministic_gpu_ops()  # the hash comparison of CSP and sequential needs it on GPUs
    configure_cpu_devices(max(STAGES))
    if args.fair:
        from scamp_jax._units import format_bytes, parse_bytes

        budget = parse_bytes(args.budget)
        print_table(
            f"Fair baselines: each schedule at its largest batch under {format_bytes(budget)} "
            "per device: batch (+prefetch look-ahead) samples/s; CSP speed-up = scheduling x "
            "memory part",
            ["C", "S", "budget", "sequential", "gpipe M=4", "csp", "seq at csp batch",
             "gpipe at csp batch", "csp vs sequential", "csp vs gpipe"],
            fair_rows([(c, s) for c in args.choices for s in args.stages], budget,
                      max_in_flight=args.max_in_flight),
            args.markdown,
        )
        return
    if args.idle_guard:
        print_table(
            "Idle-tick guard (offload on, CSP, 8 layers, width 8, batch 8, 24 subnets)",
            ["guard", "C", "S", "idle ticks fetch / write", "device bytes", "temp bytes",
             "samples/s", "same hash"],
            idle_guard_rows(max_in_flight=args.max_in_flight), args.markdown,
        )
        return
    print_table(
        "Schedules: ticks (utilisation), 16 layers, 64 subnets",
        ["C", "S", "sequential", "gpipe M=4", "csp", "csp+shared", "ideal", "csp vs seq"],
        schedule_rows(), args.markdown,
    )
    print_table(
        "Offload: weights + Adam state on devices (csp window) vs whole supernet, width 16",
        ["C", "S", "window", "device (offload)", "device (no offload)", "supernet", "ratio"],
        offload_rows(), args.markdown,
    )
    if args.measure == "none":
        return
    pairs = [(12, 4)] if args.measure == "default" else [
        (c, s) for c in args.choices for s in args.stages
    ]
    print_table(
        "Measured on CPU devices: samples/s (tiny supernet, offload on)",
        ["C", "S", "sequential", "gpipe", "csp", "csp/seq", "csp/gpipe", "csp == seq"],
        measured_rows(pairs, max_in_flight=args.max_in_flight), args.markdown,
    )


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
