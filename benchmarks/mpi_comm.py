"""Share of step time in cross-rank gradient all-reduce for a trial that spans MPI ranks.

    python -m benchmarks.mpi_comm                    # re-launches itself: mpirun -n 2, then -n 4
    python -m benchmarks.mpi_comm --ranks 2 --markdown
    mpirun -n 2 python -m benchmarks.mpi_comm        # one measurement at the launched size

A small SwinIR (the HPO study's model family: embed 24, 2 groups x 2 blocks, 2 heads, window 4,
8x8 LR patches, x2) trains data parallel across R ranks, one CPU device per rank, with a fixed
per-rank batch (the planner fixes the per-device batch by memory, so a spanning trial adds
ranks, not samples per rank). Side by side on the same ranks and state shapes:

- ``with all-reduce``: `scamp_jax.distributed.data_parallel.jit_data_parallel_step` (the gradients
  and the loss averaged inside the jitted step by one fused ``mpi4jax.allreduce``);
- ``per-tensor all-reduce``: the same with one ``allreduce`` per parameter tensor;
- ``local only``: the same step without the reduction
(`scamp_jax.planning.train_step.jit_train_step`);
- ``all-reduce alone``: the reduction of a gradient-shaped tree, jitted by itself;
- ``global mesh``: the alternative, one JAX program over all ranks' devices
  (``jax.distributed.initialize(cluster_detection_method='mpi4py')``, gloo collectives on CPU,
  a ``('data',)`` mesh over every process's device, parameters replicated, batch sharded), with
  its own local-only baseline measured in the same job.

Times are medians over repeats of the slowest rank's seconds per step (a synchronous step ends
when its slowest rank does). Comm share = (with - local) / with. A last table asks the planner
for the fewest devices this trial needs at a given memory per device: a trial that fits on the
devices of one host never needs cross-host communication.

On a CPU-only machine the ranks share the host's cores and talk through shared memory, so the
figures show the method and the overhead of the MPI path, not a network's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._tables import print_table

MODEL = {"embed_dim": 24, "num_groups": 2, "group_depth": 2, "num_heads": 2, "window_size": 4,
         "mlp_ratio": 2.0}
LR_SIDE = 8


def _model() -> Any:
    from flax import nnx

    from search_spaces.swinir import build_from_config

    return build_from_config(MODEL, nnx.Rngs(0), img_size=LR_SIDE)


def _batch(rng: Any, n: int) -> tuple[Any, Any]:
    import numpy as np

    lr = rng.random((n, LR_SIDE, LR_SIDE, 3), dtype=np.float32)
    hr = rng.random((n, 2 * LR_SIDE, 2 * LR_SIDE, 3), dtype=np.float32)
    return lr, hr


def measure(per_rank_batch: int, steps: int, repeats: int) -> dict[str, Any] | None:
    """Under MPI: time the three variants; returns the figures on rank 0 (None elsewhere)."""
    import jax
    import numpy as np
    import optax

    from scamp_jax.distributed.data_parallel import (
        jit_data_parallel_step,
        mpi_mean,
        one_device_shardings,
    )
    from scamp_jax.distributed.mpi import import_mpi4py
    from scamp_jax.planning.train_step import jit_train_step, place_train_state
    from search_spaces.sr_task import l1_loss

    mpi = import_mpi4py()
    comm = mpi.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    model = _model()
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=2e-4)
    shardings = one_device_shardings(model, optimizer)
    graphdef, p1, o1, r1 = place_train_state(model, optimizer, shardings)
    _, p2, o2, r2 = place_train_state(model, optimizer, shardings)
    _, p3, o3, r3 = place_train_state(model, optimizer, shardings)
    per_tensor = jit_train_step(graphdef, optimizer, l1_loss, shardings,
                                grad_reduce=mpi_mean(comm, fuse=False))
    with_reduce = jit_data_parallel_step(graphdef, optimizer, l1_loss, shardings, comm)
    local_only = jit_train_step(graphdef, optimizer, l1_loss, shardings)
    reduce_only = jax.jit(mpi_mean(comm))
    grads_like = jax.tree.map(lambda x: x + 0.0, p1)
    grad_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(grads_like))
    batch = _batch(np.random.default_rng(rank), per_rank_batch)

    def run_with(k: int) -> None:
        nonlocal p1, o1, r1
        for _ in range(k):
            p1, o1, r1, loss = with_reduce(p1, o1, r1, batch)
        jax.block_until_ready(loss)

    def run_local(k: int) -> None:
        nonlocal p2, o2, r2
        for _ in range(k):
            p2, o2, r2, loss = local_only(p2, o2, r2, batch)
        jax.block_until_ready(loss)

    def run_per_tensor(k: int) -> None:
        nonlocal p3, o3, r3
        for _ in range(k):
            p3, o3, r3, loss = per_tensor(p3, o3, r3, batch)
        jax.block_until_ready(loss)

    def run_reduce(k: int) -> None:
        for _ in range(k):
            out = reduce_only(grads_like)
        jax.block_until_ready(out)

    variants = {"with": run_with, "local": run_local, "per_tensor": run_per_tensor,
                "reduce": run_reduce}
    med = _timed(variants, steps, repeats, comm, mpi)
    if rank != 0:
        return None
    return {
        "ranks": size,
        "per_rank_batch": per_rank_batch,
        "global_batch": per_rank_batch * size,
        "grad_bytes": grad_bytes,
        "param_tensors": len(jax.tree.leaves(grads_like)),
        "step_with_allreduce_s": med["with"],
        "step_local_only_s": med["local"],
        "step_per_tensor_allreduce_s": med["per_tensor"],
        "allreduce_alone_s": med["reduce"],
        "comm_share": (med["with"] - med["local"]) / med["with"],
        "per_tensor_comm_share": (med["per_tensor"] - med["local"]) / med["per_tensor"],
        "allreduce_alone_share": med["reduce"] / med["with"],
        "cpu_cores": os.cpu_count(),
    }


def measure_global(per_rank_batch: int, steps: int, repeats: int) -> dict[str, Any] | None:
    """Under MPI, after ``jax.distributed.initialize``: the same step on a global mesh (XLA's
    own cross-process all-reduce) against the local-only step; figures on rank 0."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from scamp_jax.distributed.data_parallel import one_device_shardings
    from scamp_jax.distributed.mpi import import_mpi4py
    from scamp_jax.planning.train_step import (
        StepShardings,
        abstract_state,
        jit_train_step,
        place_train_state,
    )
    from search_spaces.sr_task import l1_loss

    mpi = import_mpi4py()
    comm = mpi.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    model = _model()
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=2e-4)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params, opt_state, rest = abstract_state(model, optimizer)
    global_sh = StepShardings(
        params=jax.tree.map(lambda _: rep, params),
        opt_state=jax.tree.map(lambda _: rep, opt_state),
        rest=jax.tree.map(lambda _: rep, rest),
        batch=data,
    )
    local_sh = one_device_shardings(model, optimizer)
    graphdef, pg, og, rg = place_train_state(model, optimizer, global_sh)
    _, pl, ol, rl = place_train_state(model, optimizer, local_sh)
    global_step = jit_train_step(graphdef, optimizer, l1_loss, global_sh)
    local_step = jit_train_step(graphdef, optimizer, l1_loss, local_sh)
    local_batch = _batch(np.random.default_rng(rank), per_rank_batch)
    global_batch = tuple(jax.make_array_from_process_local_data(data, a) for a in local_batch)

    def run_global(k: int) -> None:
        nonlocal pg, og, rg
        for _ in range(k):
            pg, og, rg, loss = global_step(pg, og, rg, global_batch)
        jax.block_until_ready(loss)

    def run_local(k: int) -> None:
        nonlocal pl, ol, rl
        for _ in range(k):
            pl, ol, rl, loss = local_step(pl, ol, rl, local_batch)
        jax.block_until_ready(loss)

    med = _timed({"global": run_global, "local": run_local}, steps, repeats, comm, mpi)
    if rank != 0:
        return None
    return {
        "ranks": size,
        "step_global_mesh_s": med["global"],
        "step_local_only_global_job_s": med["local"],
        "global_mesh_comm_share": (med["global"] - med["local"]) / med["global"],
    }


def measure_sizes(sizes: Sequence[int], repeats: int) -> list[dict[str, Any]] | None:
    """Under MPI: seconds of one jitted ``mpi4jax.allreduce`` (sum) of a float32 buffer of each
    of ``sizes`` bytes; the figures on rank 0 (None elsewhere)."""
    import jax
    import jax.numpy as jnp

    from scamp_jax.distributed.mpi import import_mpi4jax, import_mpi4py

    mpi, m4j = import_mpi4py(), import_mpi4jax()
    comm = mpi.COMM_WORLD
    reduce = jax.jit(lambda x: m4j.allreduce(x, op=mpi.SUM, comm=comm))
    variants, calls, nbytes_of = {}, {}, {}
    for nbytes in sizes:
        buffer = jnp.ones((max(1, nbytes // 4),), jnp.float32)
        # Enough calls per repeat that the timer's resolution and the barrier do not count.
        n = max(3, min(200, (8 << 20) // max(nbytes, 1)))

        def run(k: int, buffer: Any = buffer, n: int = n) -> None:
            for _ in range(k * n):
                out = reduce(buffer)
            jax.block_until_ready(out)

        variants[str(nbytes)], calls[str(nbytes)] = run, n
        nbytes_of[str(nbytes)] = int(buffer.nbytes)
    # Repeats interleave the sizes, so a change of the host's load hits them all alike.
    med = _timed(variants, 1, repeats, comm, mpi)
    rows = [{"ranks": comm.Get_size(), "bytes": nbytes_of[k], "seconds": med[k] / calls[k]}
            for k in variants]
    return rows if comm.Get_rank() == 0 else None


def ring_rows(rows: Sequence[dict[str, Any]], link_bandwidth: float,
              min_bytes: int) -> tuple[list[list[str]], float, float]:
    """Measured all-reduce seconds against the simulator's ring model
    (`scamp_jax.sim.simulator.comm_seconds` of `allreduce_bytes`) at ``link_bandwidth``
    bytes/s; returns the table rows, the largest relative error over messages of at least
    ``min_bytes`` and the link bandwidth fitted to those (median of bytes sent / seconds)."""
    import statistics

    from scamp_jax._units import format_bytes
    from scamp_jax.sim.simulator import ClusterModel, allreduce_bytes, comm_seconds

    cluster = ClusterModel("cpu-mpi", max(r["ranks"] for r in rows), 1, 1.0, 1.0,
                           link_bandwidth, comm_efficiency=1.0, node_devices=1 << 30)
    table, errors, fitted = [], [], []
    for r in rows:
        sent = allreduce_bytes(r["bytes"], r["ranks"])
        predicted = comm_seconds(sent, r["ranks"], cluster)
        error = predicted / r["seconds"] - 1.0
        if r["bytes"] >= min_bytes:
            errors.append(abs(error))
            fitted.append(sent / r["seconds"])
        table.append([str(r["ranks"]), format_bytes(r["bytes"]), f"{r['seconds'] * 1e3:.3f}",
                      f"{predicted * 1e3:.3f}", f"{error:+.0%}",
                      f"{sent / r['seconds'] / 1e9:.2f}"])
    return (table, max(errors, default=float("nan")),
            statistics.median(fitted) if fitted else float("nan"))


RING_HEADER = ["ranks", "message", "measured ms", "ring model ms", "model error",
               "attained GB/s"]


def _timed(variants: dict[str, Any], steps: int, repeats: int, comm: Any, mpi: Any
           ) -> dict[str, float]:
    """Median over ``repeats`` of the slowest rank's seconds per step of each variant."""
    import numpy as np

    for fn in variants.values():  # compile and warm up
        fn(2)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            comm.Barrier()
            start = mpi.Wtime()
            fn(steps)
            mine = (mpi.Wtime() - start) / steps
            times[name].append(comm.allreduce(mine, op=mpi.MAX))
    return {k: float(np.median(v)) for k, v in times.items()}


def planner_rows(budgets: Sequence[str], per_device_batch: int) -> list[list[str]]:
    """Fewest devices the planner gives the benchmark model at each memory per device."""
    import jax
    from flax import nnx

    from scamp_jax.planning.planner import DoesNotFitError, min_devices_plan
    from search_spaces.sr_task import l1_loss
    from search_spaces.swinir import build_from_config

    abstract = nnx.eval_shape(lambda: build_from_config(MODEL, nnx.Rngs(0), img_size=LR_SIDE))
    sample = (
        jax.ShapeDtypeStruct((1, LR_SIDE, LR_SIDE, 3), "float32"),
        jax.ShapeDtypeStruct((1, 2 * LR_SIDE, 2 * LR_SIDE, 3), "float32"),
    )
    rows = []
    for budget in budgets:
        try:
            count, plan = min_devices_plan(
                abstract, sample, devices=8, memory_per_device=budget, loss_fn=l1_loss,
                max_batch_size=per_device_batch * 8,
            )
            rows.append([budget, str(count), f"{plan.data_parallel}x{plan.model_parallel}",
                         str(plan.batch_size)])
        except DoesNotFitError:
            rows.append([budget, "> 8 (spans hosts)", "-", "-"])
    return rows


def _comm_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    from scamp_jax._units import format_bytes

    return [[
        str(r["ranks"]), str(r["global_batch"]),
        f"{format_bytes(r['grad_bytes'])} / {r['param_tensors']}",
        f"{r['step_local_only_s'] * 1e3:.1f}", f"{r['step_with_allreduce_s'] * 1e3:.1f}",
        f"{r['allreduce_alone_s'] * 1e3:.2f}", f"{r['comm_share']:.1%}",
        f"{r['step_per_tensor_allreduce_s'] * 1e3:.1f}", f"{r['per_tensor_comm_share']:.1%}",
        *([f"{r['step_local_only_global_job_s'] * 1e3:.1f}",
           f"{r['step_global_mesh_s'] * 1e3:.1f}", f"{r['global_mesh_comm_share']:.1%}"]
          if "step_global_mesh_s" in r else ["-", "-", "-"]),
    ] for r in results]


COMM_HEADER = ["ranks", "global batch", "gradients / tensors", "local-only ms",
               "fused all-reduce ms", "all-reduce alone ms", "comm share",
               "per-tensor all-reduce ms", "per-tensor comm share",
               "local-only ms (global-mesh job)", "global mesh ms", "global mesh comm share"]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags; measure under MPI, or re-launch under ``mpirun`` for each ``--ranks``."""
    from experiments._cli import output_file

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mpi_comm", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="rank counts to launch (ignored when already under mpirun)")
    parser.add_argument("--per-rank-batch", type=int, default=4, help="samples per rank")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--budgets", nargs="*", default=["64MiB", "16MiB", "4MiB"],
                        help="memory per device for the planner table (none: skip it)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json-out", type=output_file,
                        help="write the measured figures (JSON) here")
    parser.add_argument("--no-global-mesh", action="store_true",
                        help="skip the jax.distributed global-mesh comparison")
    parser.add_argument("--global-mesh", action="store_true",
                        help="(under mpirun) measure the global-mesh step instead")
    parser.add_argument("--sizes", nargs="*", default=None,
                        help="instead: time a bare all-reduce of buffers of these sizes (e.g. "
                             "64KiB 1MiB 16MiB) and compare the simulator's ring model")
    parser.add_argument("--tolerance", type=float, default=0.5,
                        help="with --sizes: largest relative error of the ring model accepted "
                             "for messages of at least --check-from (exit 1 beyond it)")
    parser.add_argument("--check-from", default="16MiB",
                        help="with --sizes: smallest message the tolerance applies to (below, a "
                             "per-message latency the model leaves out dominates)")
    args = parser.parse_args(argv)
    from scamp_jax._units import parse_bytes

    sizes = None if args.sizes is None else [parse_bytes(s) for s in args.sizes]

    from scamp_jax.distributed.mpi import launched_under_mpi, mpirun_command

    if launched_under_mpi():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from scamp_jax.devices import configure_cpu_devices

        configure_cpu_devices(1)
        if sizes is not None:
            rows = measure_sizes(sizes, args.repeats)
            if rows is not None:
                Path(args.json_out or "/dev/stdout").write_text(json.dumps(rows))
            return
        if args.global_mesh:
            import jax

            # CPU processes exchange through gloo; jax.distributed finds its peers via mpi4py.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(cluster_detection_method="mpi4py")
            result = measure_global(args.per_rank_batch, args.steps, args.repeats)
        else:
            result = measure(args.per_rank_batch, args.steps, args.repeats)
        if result is not None:
            if args.json_out:
                Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json_out).write_text(json.dumps(result))
            elif args.global_mesh:
                print(json.dumps(result, indent=2))
            else:
                print_table("Cross-rank all-reduce, SwinIR data parallel", COMM_HEADER,
                       _comm_rows([result]), args.markdown)
        return

    results = []
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    if sizes is not None:
        _ring_check(args, sizes, env, root)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            out = Path(tmp) / f"r{ranks}.json"
            cmd = [*mpirun_command(ranks), sys.executable, "-m", "benchmarks.mpi_comm",
                   "--per-rank-batch", str(args.per_rank_batch), "--steps", str(args.steps),
                   "--repeats", str(args.repeats), "--json-out", str(out)]
            subprocess.run(cmd, env=env, cwd=root, check=True)
            result = json.loads(out.read_text())
            if not args.no_global_mesh:
                subprocess.run([*cmd, "--global-mesh"], env=env, cwd=root, check=True)
                result.update(json.loads(out.read_text()))
            results.append(result)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    print_table(f"Cross-rank all-reduce, SwinIR data parallel, {args.per_rank_batch} samples per "
           f"rank, one CPU device per rank ({os.cpu_count()} cores)", COMM_HEADER,
           _comm_rows(results), args.markdown)
    if args.budgets:
        from scamp_jax.devices import configure_cpu_devices

        configure_cpu_devices(8)
        print_table("Planner: fewest devices (of one 8-device host) for the same trial",
               ["memory per device", "devices", "data x model", "batch"],
               planner_rows(args.budgets, args.per_rank_batch), args.markdown)


def _ring_check(args: argparse.Namespace, sizes: Sequence[int], env: dict[str, str],
                root: Path) -> None:
    """Launch the all-reduce timings for each ``--ranks`` and print them against the ring
    model at `scamp_jax.sim.simulator.CPU_MPI_LINK_BANDWIDTH`."""
    from scamp_jax.distributed.mpi import mpirun_command
    from scamp_jax.sim.simulator import CPU_MPI_LINK_BANDWIDTH

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            out = Path(tmp) / f"r{ranks}.json"
            subprocess.run([*mpirun_command(ranks), sys.executable, "-m", "benchmarks.mpi_comm",
                            "--repeats", str(args.repeats), "--json-out", str(out),
                            "--sizes", *map(str, sizes)], env=env, cwd=root, check=True)
            rows += json.loads(out.read_text())
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    from scamp_jax._units import format_bytes, parse_bytes

    check_from = parse_bytes(args.check_from)
    table, worst, fitted = ring_rows(rows, CPU_MPI_LINK_BANDWIDTH, check_from)
    print_table(f"Ring all-reduce model at {CPU_MPI_LINK_BANDWIDTH / 1e9:g} GB/s per link vs "
                f"mpi4jax all-reduce, one CPU device per rank ({os.cpu_count()} cores)",
                RING_HEADER, table, args.markdown)
    print(f"ring_model_worst_error={worst:.3f} (messages of {format_bytes(check_from)} and up; "
          f"tolerance {args.tolerance:g})")
    _, own, _ = ring_rows(rows, fitted, check_from)
    print(f"fitted_link_bandwidth_GBps={fitted / 1e9:.4f} (the ring model at this run's own "
          f"fitted link: worst error {own:.3f})")
    if not worst <= args.tolerance:
        print(f"the ring model is off by {worst:.0%} (> {args.tolerance:.0%}) for messages of "
              f"{format_bytes(check_from)} and up", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
