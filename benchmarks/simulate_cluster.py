"""Simulated search on a model GPU cluster: ScaMP placement against the fixed-resources baseline.

    python -m benchmarks.simulate_cluster                                   # 32 x V100-16GB
    python -m benchmarks.simulate_cluster --devices 1024 --trials 4096      # scale out
    python -m benchmarks.simulate_cluster --device h100-80gb --search vit --policy both
    python -m benchmarks.hpo_makespan --out runs/hpo_makespan      # measure on this CPU, then
    python -m benchmarks.simulate_cluster --validate runs/hpo_makespan   # simulate the same run
    python -m benchmarks.simulate_cluster --replay STUDY_DIR --json  # a real study's decisions

Trials come from the real search space (Optuna's random sampler draws the configurations); each
distinct architecture is costed from XLA on this machine's CPU devices, then the discrete-event
simulator (`scamp_jax.sim.simulator`) replays the study with the same `DevicePool` and policy
``decide`` the HPO engine uses. Output: per-policy makespan, mean memory utilisation, busy
(roofline) fraction and idle fraction, and ``makespan_ratio_fixed_over_scamp=<x>``.

How a candidate is costed (`measure_cost`): memory comes from the planner's own code.
`scamp_jax.planning.memory.StepCompiler` compiles the training step
(`scamp_jax.planning.train_step`, the one the
engine runs) on a ``1 x model_parallel`` mesh of CPU devices with the planner's shardings at two
probe batches and checks them with a third, and ``StepCompiler.fit`` returns the planner's
`MemoryModel` (affine in the batch, with a floor). The same compiled executables give the
per-device FLOPs and bytes accessed (``cost_analysis``), the kernels in the entry computation,
and the bytes of their model-parallel collectives. Affine fits in the batch size extrapolate to
any batch, and the data-parallel degree enters analytically: ``p`` replicas run the same
per-device program at ``1/p`` of the global batch, plus a ring all-reduce of the gradients
(`StepCostModel.profile`). The model-parallel degree is the smallest power of two whose
batch-1 peak fits the cluster's memory less the safety margin, as the planner chooses. Costs
are cached per architecture in ``--cache`` (JSON), so scaling runs do not compile again.

What ScaMP does here beyond packing (`scamp_jax.scheduling.placement.ScampPolicy`): it starts the
longest predicted trials first, runs a trial data-parallel on 2-8 devices where that costs at most
``--growth-tolerance`` more device-seconds, gives devices that the last wave would leave idle to
the longest queued trials, and in the last wave shares a device only into spare compute. Once
nothing is queued or left to arrive, running trials restart on devices that fell idle with the
same global batch (`scamp_jax.scheduling.elastic`, up to ``--max-trial-devices`` devices, each
restart costing ``--restart-seconds``; ``--no-resize`` turns it off). Trials arrive as the engine
asks them: at most ``--lookahead`` (default: one per device) are queued.
The fixed baseline keeps its fixed devices, one batch and strict arrival order.

Caveats: CPU fusion decisions differ from GPU ones (bytes accessed and kernel counts are those of
the CPU compile); the efficiency factors in `ClusterModel` are assumptions, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scamp_jax.devices import configure_cpu_devices
from scamp_jax.scheduling.placement import FixedPolicy, ScampPolicy
from scamp_jax.sim.simulator import (
    CLUSTER_PRESETS,
    PRESET_OF_TARGET,
    ClusterModel,
    SimResult,
    StepCostModel,
    TrialProfile,
    cluster_preset,
    comm_share,
    plan_profiles,
    simulate,
    step_busy_seconds,
    step_comm_seconds,
)
from scamp_jax.sim.step_costs import (
    fixed_baseline,
    hlo_kernels_and_collectives,
    measure_cost,
    plan_point,
)

__all__ = ["hlo_kernels_and_collectives", "measure_cost"]  # re-exported from the library

@functools.cache
def _search_task(search: str, variant: str) -> tuple[Any, Any]:
    """(space, task) of a named search."""
    if search == "swinir":
        from search_spaces import swinir
        from search_spaces.sr_task import SRTask

        return swinir.space(variant), SRTask(scale=2, hr_patch=48)
    if search == "vit":
        from search_spaces import vit

        return vit.space(variant), vit.SyntheticClassificationTask()
    raise ValueError(f"unknown search {search!r}; choose one of: swinir, vit")


def _task(search: str, variant: str) -> tuple[Any, Any, Callable[..., Any]]:
    """(space, sample_batch of one sample, loss_fn) of a named search."""
    space, task = _search_task(search, variant)
    return space, task.sample_batch(1), task.loss_fn


def _arch_key(search: str, variant: str, graphdef: Any, mp: int) -> str:
    """Stable name of an architecture: its graph definition without object addresses."""
    text = re.sub(r" at 0x[0-9a-f]+", "", repr(graphdef))
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    return f"{search}-{variant}-mp{mp}-{digest}"


class CostTable:
    """Cost models per architecture, cached on disk as JSON.

    Entries written before a trial's booking counted its prefetched batch and evaluation (no
    ``opt_state_bytes`` field) are measured again on first use. `put` stores a cost model with
    planner answers added (`scamp_jax.sim.step_costs.plan_point`).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}  # a cost model's fields, as JSON
        if path is not None and path.exists():
            try:
                self.entries = json.loads(path.read_text())
                if not isinstance(self.entries, dict):
                    raise ValueError("not an object of costs")
            except (ValueError, UnicodeDecodeError) as err:
                raise ValueError(f"the cost cache {str(path)!r} cannot be read ({err}); it "
                                 "holds measured costs only: delete it (they are measured "
                                 "again), or pass another --cache") from None
        self.compile_seconds = 0.0
        self.compiled = 0  # architectures measured (`measure_cost`)
        self.planned = 0  # planner answers added (`put`)

    def get(self, key: str, make: Callable[[], tuple[StepCostModel, float]]) -> StepCostModel:
        """The cost model stored under ``key``, measured with ``make()`` the first time."""
        if "opt_state_bytes" not in self.entries.get(key, {}):
            cost, seconds = make()
            self.entries[key] = {**asdict(cost), "compile_seconds": seconds / 3}
            self.compile_seconds += seconds
            self.compiled += 1
            self._write()
        try:
            fields = {k: v for k, v in self.entries[key].items() if k != "compile_seconds"}
            fields["plans"] = tuple(tuple(int(x) for x in p) for p in fields.get("plans", ()))
            cost = StepCostModel(**fields)
            wrong = [f"{k}={v!r}" for k, v in fields.items() if k != "plans" and (
                isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v))]
            if wrong:
                raise ValueError(f"{', '.join(wrong)} is not a number")
        except (TypeError, ValueError) as err:
            raise ValueError(f"the cost cache {str(self.path)!r} has a damaged entry {key!r} "
                             f"({err}); it holds measured costs only: delete it (they are "
                             "measured again), or pass another --cache") from None
        return cost

    def put(self, key: str, cost: StepCostModel, seconds: float = 0.0) -> None:
        """Store ``cost`` under ``key`` (an entry `get` made), adding ``seconds`` of compiles."""
        self.entries[key] = {**asdict(cost),
                             "compile_seconds": self.entries[key].get("compile_seconds", 0.0)}
        self.compile_seconds += seconds
        self.planned += 1
        self._write()

    def _write(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.entries, indent=1, sort_keys=True))

    def compile_seconds_of(self, key: str) -> float:
        """Seconds one compile of the step stored under ``key`` took when it was measured."""
        return float(self.entries[key].get("compile_seconds", 0.0))


def cost_candidates(
    configs: Sequence[dict[str, Any]],
    *,
    search: str,
    variant: str,
    cluster: ClusterModel,
    safety_margin: float,
    table: CostTable,
    log: Callable[[str], None] = print,
    max_batch_size: int | None = None,
    batch_multiple: int = 1,
) -> list[StepCostModel]:
    """A `StepCostModel` per configuration at the smallest model-parallel degree that fits,
    with the planner's answer for the cluster's budget, ``max_batch_size`` and
    ``batch_multiple`` (`plan_point`: what the engine's planning service plans and books)."""
    import jax
    from flax import nnx

    from scamp_jax.planning.train_step import default_optimizer, split_model

    space, sample_batch, loss_fn = _task(search, variant)
    _, task = _search_task(search, variant)
    optimizer = default_optimizer()
    usable = cluster.memory_per_device * (1.0 - safety_margin)
    out: list[StepCostModel] = []
    by_graph: dict[str, StepCostModel] = {}
    by_config: dict[str, StepCostModel] = {}  # trials re-visit configurations: build each once
    for config in configs:
        seen = repr(sorted(config.items()))
        if seen in by_config:
            out.append(by_config[seen])
            continue
        model = nnx.eval_shape(lambda config=config: space.build(config, nnx.Rngs(0)))
        graphdef = split_model(model)[0]
        arch = _arch_key(search, variant, graphdef, 0)
        if arch in by_graph:
            by_config[seen] = by_graph[arch]
            out.append(by_graph[arch])
            continue
        chosen = None
        mp = 1
        while mp <= len(jax.devices()):
            key = _arch_key(search, variant, graphdef, mp)

            def make(mp: int = mp, model: Any = model) -> tuple[StepCostModel, float]:
                return measure_cost(
                    model, sample_batch, optimizer=optimizer, loss_fn=loss_fn, model_parallel=mp,
                    eval_task=task)

            cost = table.get(key, make)
            if cost.peak_bytes(1) <= usable:
                start = time.perf_counter()
                planned = plan_point(model, sample_batch, cost, optimizer=optimizer,
                                     loss_fn=loss_fn, memory_per_device=cluster.memory_per_device,
                                     safety_margin=safety_margin, max_batch_size=max_batch_size,
                                     batch_multiple=batch_multiple, eval_task=task)
                if planned is not cost:
                    table.put(key, planned, time.perf_counter() - start)
                chosen = planned
                break
            mp *= 2
        if chosen is None:
            raise ValueError(
                f"candidate {config} does not fit {cluster.memory_per_device} bytes per device "
                f"even with {mp // 2}-way model parallelism on this host's CPU devices"
            )
        log(f"  costed {dict(config)} -> mp={chosen.model_parallel}, "
            f"{chosen.memory_per_sample / 2**20:.1f} MiB/sample, "
            f"{chosen.flops_per_sample / 1e9:.2f} GFLOP/sample")
        by_graph[arch] = by_config[seen] = chosen
        out.append(chosen)
    return out


def sample_configs(search: str, variant: str, architectures: int, trials: int, seed: int
                   ) -> list[dict[str, Any]]:
    """``trials`` configurations: ``architectures`` drawn from the space by Optuna's random
    sampler, then each trial one of them (seeded), as a study that re-visits architectures with
    other training hyperparameters would."""
    import optuna

    space, _, _ = _task(search, variant)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    drawn = [space.suggest(study.ask()) for _ in range(architectures)]
    rng = random.Random(seed)
    return [dict(drawn[rng.randrange(len(drawn))]) for _ in range(trials)]


def sample_families(search: str, variant: str, architectures: int, trials: int, width: int,
                    seed: int) -> tuple[list[dict[str, Any]], list[int]]:
    """A fused study's ``trials`` configurations and their families: each proposal (one of
    ``architectures`` drawn as in `sample_configs`) followed by ``width - 1`` siblings with its
    architecture, as `scamp_jax.hpo.study.OptunaTrialSource` enqueues them (the last family is cut
    at ``trials``). Returns ``(configs, family of each trial: its proposal's index)``."""
    proposals = sample_configs(search, variant, architectures, -(-trials // width), seed)
    configs, families = [], []
    for i in range(trials):
        configs.append(dict(proposals[i // width]))
        families.append(i - i % width)
    return configs, families


def fused_cost_models(
    configs: Sequence[dict[str, Any]],
    profiles: Sequence[TrialProfile],
    costs: Sequence[StepCostModel],
    *,
    search: str,
    variant: str,
    width: int,
    table: CostTable,
    log: Callable[[str], None] = print,
) -> tuple[list[str], dict[str, Any]]:
    """Each trial's architecture key and a `scamp_jax.sim.sim_fusion.FusedCostModel` per
    architecture, compiled on this host's CPU devices at the trial's per-member batch and
    widths 1, 2 and ``width`` (cached in ``table`` under ``fused-...`` keys)."""
    import jax
    from flax import nnx

    from scamp_jax.planning import planner
    from scamp_jax.planning.budget import standing_in_for_another_device
    from scamp_jax.planning.train_step import default_optimizer, split_model
    from scamp_jax.sim.sim_fusion import FusedCostModel, measure_fused_costs

    space, sample_batch, loss_fn = _task(search, variant)
    _, task = _search_task(search, variant)
    widths = tuple(sorted({1, 2, width}))
    signatures: list[str] = []
    models: dict[str, FusedCostModel] = {}
    built: dict[tuple[str, int], tuple[Any, str]] = {}  # trials re-visit configurations
    for config, profile, cost in zip(configs, profiles, costs, strict=True):
        mp = cost.model_parallel
        seen = (repr(sorted(config.items())), mp)
        if seen not in built:
            abstract = nnx.eval_shape(lambda config=config: space.build(config, nnx.Rngs(0)))
            built[seen] = (abstract, _arch_key(search, variant, split_model(abstract)[0], mp))
        model, arch = built[seen]
        local = profile.batch_size // (profile.devices // mp)
        sig = f"fused-{arch}-b{local}-w{'.'.join(map(str, widths))}"
        signatures.append(sig)
        if sig in models:
            continue
        if "state_bytes" not in table.entries.get(sig, {}):  # older entries: measure again
            start = time.perf_counter()
            with standing_in_for_another_device():  # a roomy budget, not this host's
                plan = planner.plan_mesh(model, sample_batch, devices=jax.devices()[:mp],
                                         memory_per_device=64 * 2**30, max_batch_size=local,
                                         optimizer=default_optimizer(), loss_fn=loss_fn,
                                         eval_task=task)
            fused = measure_fused_costs(model, sample_batch, plan, batch_size=local,
                                        widths=widths, optimizer=default_optimizer(),
                                        loss_fn=loss_fn)
            seconds = time.perf_counter() - start
            table.entries[sig] = {**asdict(fused), "compile_seconds": seconds}
            table.compile_seconds += seconds
            table.compiled += 1
            if table.path is not None:
                table.path.parent.mkdir(parents=True, exist_ok=True)
                table.path.write_text(json.dumps(table.entries, indent=1, sort_keys=True))
            log(f"  fused costs of {dict(config)} at batch {local}, widths {widths}: "
                f"{seconds:.1f} s")
        entry = {k: v for k, v in table.entries[sig].items() if k != "compile_seconds"}
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in entry.items()}
        models[sig] = FusedCostModel(**fields)
    return signatures, models


def build_profiles(
    costs: Sequence[StepCostModel],
    largest: StepCostModel,
    cluster: ClusterModel,
    *,
    samples: int,
    max_batch_size: int | None,
    fixed_devices: int | None,
    safety_margin: float,
    max_trial_devices: int | None = None,
    scamp_policy: ScampPolicy | None = None,
) -> tuple[list[TrialProfile], list[TrialProfile], int, int]:
    """ScaMP (``scamp_policy``, default `ScampPolicy()`) and fixed profiles of the same trials
    from the library's profile builder (`scamp_jax.sim.simulator.plan_profiles`); returns (scamp,
    fixed, k, fixed batch)."""
    k, batch = fixed_baseline(largest, cluster, fixed_devices=fixed_devices,
                              max_batch_size=max_batch_size, safety_margin=safety_margin)
    scamp = plan_profiles(costs, cluster, scamp_policy or ScampPolicy(), samples=samples,
                          max_batch_size=max_batch_size, safety_margin=safety_margin,
                          max_devices=max_trial_devices)
    fixed = plan_profiles(costs, cluster, FixedPolicy(k), samples=samples,
                          fixed_batch_size=batch, safety_margin=safety_margin)
    return scamp, fixed, k, batch


def calibrate_cpu_host(devices: int, memory_per_device: int) -> ClusterModel:
    """A `ClusterModel` of this host's CPU devices from micro-benchmarks (efficiencies 1).

    Peak FLOP/s from a 1024^3 matmul, memory bandwidth from an elementwise pass over 64 MiB,
    interconnect from a copy between two CPU devices, kernel latency from a chain of 256
    dependent tiny matmuls. All devices share the host's cores: ``compute_group = devices``.
    Figures vary with other load on the machine.
    """
    import jax
    import jax.numpy as jnp

    def best_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
        jax.block_until_ready(fn())
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return min(times)

    dev = jax.devices()
    a = jax.device_put(jnp.ones((1024, 1024), jnp.float32), dev[0])
    matmul = jax.jit(lambda x: x @ x)
    flops = 2 * 1024**3 / best_seconds(lambda: matmul(a))
    big = jax.device_put(jnp.ones((16 * 2**20,), jnp.float32), dev[0])
    scale = jax.jit(lambda x: x * 1.5)
    bandwidth = 2 * big.nbytes / best_seconds(lambda: scale(big))
    other = dev[1] if len(dev) > 1 else dev[0]
    link = big.nbytes / best_seconds(lambda: jax.device_put(big, other))
    small = jax.device_put(jnp.ones((4, 4), jnp.float32), dev[0])

    def chain(x: Any) -> Any:
        for _ in range(256):
            x = jnp.tanh(x @ x)
        return x

    chained = jax.jit(chain)
    launch = best_seconds(lambda: chained(small)) / 256  # one dot (tanh fused in) per link
    return ClusterModel(
        name="cpu-host", devices=devices, memory_per_device=memory_per_device,
        peak_flops=flops, mem_bandwidth=bandwidth, interconnect_bandwidth=link,
        compute_efficiency=1.0, bandwidth_efficiency=1.0, comm_efficiency=1.0,
        launch_seconds=launch, compute_group=devices,
        # The host's devices share one compute engine (compute_group), which already makes
        # co-located work take turns; the step's compile is the trial's setup, not a plan.
        overlap=1.0, planning_seconds=0.0,
    )


def validate(run_dir: Path, table: CostTable, log: Callable[[str], None]) -> dict[str, float]:
    """Simulate the trials of a measured ``benchmarks.hpo_makespan --out run_dir`` run.

    Each finished trial is re-costed from its recorded configuration (in the run's family's
    space: ``hpo_makespan.json`` records it; a run that does not is told by its metric),
    devices, model-parallel degree, batch size, steps and predicted peak, and the two studies
    are replayed on the calibrated CPU host model (`calibrate_cpu_host`) of the run's pool and
    budget per device (its ``results.json``); each trial first compiles its step (as long
    as that compile took when costed here). Returns measured and simulated seconds per policy and
    both fixed/scamp ratios. Planning, evaluation and checkpointing are part of the measured time
    but not of the simulated one.
    """
    import jax
    from flax import nnx

    from scamp_jax.planning.train_step import default_optimizer, split_model
    from scamp_jax.scheduling.replay import run_section

    rows = json.loads((run_dir / "hpo_makespan.json").read_text())
    measured = {row["policy"]: float(row["end_to_end_s"]) for row in rows}
    family = rows[0].get("family") or ("vit" if rows[0].get("metric") == "accuracy"
                                        else "swinir")
    if family == "vit":
        from experiments.vit_synthetic import get_config, make_space_and_task
    else:
        from experiments.swinir_hpo import get_config, make_space_and_task
    space, task = make_space_and_task(get_config("smoke"))
    run = run_section(json.loads((run_dir / "scamp" / "results.json").read_text()))
    pool = int(run.get("pool_devices") or len(jax.devices()))
    cluster = calibrate_cpu_host(pool, int(run["memory_per_device"]))
    log(f"  cpu host: {cluster.peak_flops / 1e9:.1f} GFLOP/s, "
        f"{cluster.mem_bandwidth / 1e9:.1f} GB/s memory, {cluster.interconnect_bandwidth / 1e9:.1f}"
        f" GB/s device copy, {cluster.launch_seconds * 1e6:.1f} us per kernel")
    optimizer = default_optimizer()
    out: dict[str, float] = {}
    for policy_name in ("scamp", "fixed"):
        results = json.loads((run_dir / policy_name / "results.json").read_text())
        records = results["trials"]
        # the engine's cap on trials running at once (on CPU devices: the host's cores / 2)
        max_running = run_section(results).get("max_running")
        profiles = []
        for rec in sorted(records, key=lambda r: r["number"]):
            if rec["state"] != "complete" or not rec["devices"]:
                continue
            model = nnx.eval_shape(lambda rec=rec: space.build(rec["params"], nnx.Rngs(0)))
            mp = int(rec["model_parallel"] or 1)
            key = _arch_key(family, "validate", split_model(model)[0], mp)

            def make(model: Any = model, mp: int = mp) -> tuple[StepCostModel, float]:
                return measure_cost(
                    model, task.sample_batch(1), optimizer=optimizer, loss_fn=task.loss_fn,
                    model_parallel=mp)

            cost = table.get(key, make)
            batch, steps = int(rec["batch_size"]), int(rec["steps"])
            profile = cost.profile(rec["number"], len(rec["devices"]), batch, batch * steps)
            # The engine compiles each trial's step on the host before training: busy work.
            profiles.append(dataclasses.replace(
                profile, bytes_per_device=int(rec["predicted_peak_bytes"] or 0),
                setup_seconds=table.compile_seconds_of(key)))
        if not profiles:
            raise ValueError(f"{run_dir / policy_name} has no completed trials to replay")
        policy = (FixedPolicy(profiles[0].devices) if policy_name == "fixed" else ScampPolicy())
        result = simulate(profiles, cluster, policy,
                          safety_margin=float(run_section(results).get("safety_margin", 0.1)),
                          max_running=max_running)
        out[f"measured_s_{policy_name}"] = measured[policy_name]
        out[f"simulated_s_{policy_name}"] = result.makespan_s
    out["measured_ratio"] = out["measured_s_fixed"] / out["measured_s_scamp"]
    out["simulated_ratio"] = out["simulated_s_fixed"] / out["simulated_s_scamp"]
    out["ratio_error"] = out["simulated_ratio"] / out["measured_ratio"] - 1.0
    return out


def _row(result: SimResult) -> dict[str, float]:
    s = result.summary
    return {
        "makespan_h": result.makespan_s / 3600,
        "mean_memory_utilization": s["mean_memory_utilization"],
        "busy_fraction": result.busy_fraction,
        "idle_fraction": s["idle_fraction"],
    }


def _seed(text: str) -> int:
    """argparse type of ``--seed``: an integer >= 0 (what Optuna's and NumPy's seeds take)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def _cost_cache(text: str) -> Path:
    """argparse type of ``--cache``: a cost file to read (written only where a cost is
    missing, so a complete one may be read-only), or one that can be made."""
    from experiments._cli import output_file

    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; pass the path of a JSON file")
    return path if path.is_file() else output_file(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, cost the candidates, simulate, print the comparison."""
    from experiments._cli import positive_int

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.simulate_cluster",
        description="Simulate a search on a GPU cluster with the real placement code."
    )
    parser.add_argument("--devices", type=int, default=32, help="accelerators in the cluster")
    parser.add_argument("--device", default="v100-16gb",
                        choices=list(dict.fromkeys([*sorted(CLUSTER_PRESETS), *PRESET_OF_TARGET])),
                        help="accelerator model (public data-sheet figures; default "
                        "v100-16gb), or a planner target's name (--target of the "
                        "experiments: h100 is h100-80gb, v100 v100-32gb)")
    parser.add_argument("--search", default="swinir", choices=("swinir", "vit"),
                        help="search space to draw trials from")
    parser.add_argument("--variant", default="small", choices=("small", "paper"),
                        help="size of the search space")
    parser.add_argument("--trials", type=int, default=128, help="trials in the study")
    parser.add_argument("--architectures", type=int, default=8,
                        help="architectures drawn from the space; each trial is one of them, "
                        "drawn with replacement (those some trial draws are compiled)")
    parser.add_argument("--samples", type=int, default=200_000,
                        help="training samples per trial (epochs x data set size)")
    parser.add_argument("--max-batch-size", type=int, default=64,
                        help="cap on a trial's global batch (0: memory is the only limit)")
    parser.add_argument("--fixed-devices", type=positive_int, default=None,
                        help="devices per trial for the fixed policy (default: what the "
                        "largest candidate needs)")
    parser.add_argument("--policy", default="both", choices=("scamp", "fixed", "both"),
                        help="placement policy to simulate")
    parser.add_argument("--max-trial-devices", type=int, default=8,
                        help="ScaMP may run a trial data-parallel on up to this many devices "
                        "(one 8-GPU node; 0: only the planned devices)")
    parser.add_argument("--lookahead", type=int, default=None,
                        help="trials queued at once, as the engine's lookahead (default: the "
                        "number of devices, as the engine; 0: the whole study from the start)")
    parser.add_argument("--growth-tolerance", type=float, default=0.05,
                        help="extra device-seconds ScaMP accepts to run a trial on more devices")
    parser.add_argument("--no-longest-first", action="store_true",
                        help="ScaMP starts queued trials in arrival order")
    parser.add_argument("--no-elastic", action="store_true",
                        help="no last-wave growth of trials onto idle devices")
    parser.add_argument("--no-compute-aware", action="store_true",
                        help="ScaMP shares devices by memory alone, also in the last wave")
    parser.add_argument("--no-resize", action="store_true",
                        help="never restart running trials on idle devices at the study's end")
    parser.add_argument("--restart-seconds", type=float, default=None,
                        help="cost of restarting a running trial on more devices (checkpoint, "
                        "compile, restore); default: the cluster model's (60 s)")
    parser.add_argument("--overlap", type=float, default=None,
                        help="how much trials sharing a device overlap: 0 = strict turns (the "
                        "default on GPUs), 1 = free overlap of each other's idle time")
    parser.add_argument("--planning-seconds", type=float, default=None,
                        help="seconds one plan takes on a planner thread; default: the "
                        "cluster model's (30 s), or --measured's")
    parser.add_argument("--planner-threads", type=int, default=None,
                        help="plans made at once (the engine's planner_threads); default: the "
                        "cluster model's (2), or --measured's")
    parser.add_argument("--measured", type=Path, default=None, metavar="STUDY_DIR",
                        help="take planning and restart seconds and planner threads from a real "
                        "study's results.json (scamp_jax.sim.measured.engine_figures)")
    parser.add_argument("--min-resize-gain", type=float, default=0.1,
                        help="fraction of its remaining time a restart must save")
    parser.add_argument("--batch-multiple", type=int, default=ScampPolicy().batch_multiple,
                        help="ScaMP plans batches that are multiples of this where one fits, so "
                        "a trial can restart on 2 or 4 devices with the same batch (1: any)")
    parser.add_argument("--safety-margin", type=float, default=0.1,
                        help="fraction of device memory plans keep free")
    parser.add_argument("--seed", type=_seed, default=0, help="seed of the sampled study")
    parser.add_argument("--cache", type=_cost_cache,
                        default=Path("runs/simulate_cluster_costs.json"),
                        help="JSON cache of per-architecture costs")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--validate", type=Path, default=None, metavar="RUN_DIR",
                        help="replay a measured 'benchmarks.hpo_makespan --out RUN_DIR' run on a "
                        "calibrated model of this CPU and compare the fixed/scamp ratios")
    parser.add_argument("--replay", type=Path, default=None, metavar="STUDY_DIR",
                        help="re-run a finished real study's arrivals and measured durations "
                        "through the scheduling core and print its placements in start order "
                        "(of its last run, where it was resumed)")
    parser.add_argument("--fuse", type=int, default=None, metavar="K",
                        help="also simulate ScaMP with horizontal fusion: the study proposes "
                        "architectures with K-1 siblings each, grouped by the engine's rule "
                        "(scamp_jax.scheduling.grouping); groups costed by FusedCostModel from "
                        "fused compiles at widths 1, 2, K; the same trials without fusion too")
    parser.add_argument("--json", action="store_true",
                        help="with --replay: print {\"placements\": [[trial, [device ids]], ...]}")
    args = parser.parse_args(argv)
    # flag checks before any costing, which compiles for minutes
    if not 0 <= args.min_resize_gain < 1:
        parser.error("--min-resize-gain must be in [0, 1)")
    if args.batch_multiple < 1:
        parser.error("--batch-multiple must be >= 1")
    if not 0 <= args.safety_margin < 1:
        parser.error(f"--safety-margin {args.safety_margin} must be in [0, 1): the fraction of "
                     "device memory plans keep free, e.g. 0.1")
    if args.json and args.replay is None:
        parser.error("--json prints a --replay's placements; pass --replay STUDY_DIR too")
    if args.fuse is not None and args.fuse < 2:
        parser.error("--fuse must be at least 2 (members per fused group)")
    if args.planner_threads is not None and args.planner_threads < 1:
        parser.error(f"--planner-threads {args.planner_threads} must be at least 1")
    if args.replay is not None:
        from scamp_jax.scheduling.replay import as_json, run_section
        from scamp_jax.sim.measured import read_results, replay_study

        placements = replay_study(args.replay)
        study = read_results(args.replay)
        ranks = int(run_section(study).get("ranks") or 1)
        if len(study.get("runs") or ()) > 1:
            print(f"note: the study ran {len(study['runs'])} times (it was resumed); this "
                  "replays its last run only", file=sys.stderr)
        if ranks > 1:  # each rank's engine schedules its own devices with its own core
            print(f"note: a study of {ranks} MPI ranks; this replays rank 0's scheduling (its "
                  "devices and trials) only", file=sys.stderr)
        if args.json:
            print(as_json(placements))
        else:
            for number, ids in placements:
                print(f"trial {number}: devices {list(ids)}")
        return 0
    if args.devices < 1 or args.trials < 1 or args.architectures < 1 or args.samples < 1:
        parser.error("--devices, --trials, --architectures and --samples must be positive")
    if args.max_trial_devices < 0 or (args.lookahead is not None and args.lookahead < 0):
        parser.error("--max-trial-devices and --lookahead must be >= 0")
    if args.max_batch_size < 0:
        parser.error(f"--max-batch-size {args.max_batch_size} must be a positive integer, or 0 "
                     "for no cap (memory is the only limit)")
    if args.fixed_devices is not None and args.fixed_devices > args.devices:
        parser.error(f"--fixed-devices {args.fixed_devices} exceeds the pool of --devices "
                     f"{args.devices}; pass at most {args.devices}, or more --devices")
    if args.restart_seconds is not None and not 0 <= args.restart_seconds < math.inf:
        parser.error(f"--restart-seconds {args.restart_seconds} must be a number of seconds "
                     ">= 0, e.g. 60")
    if args.planning_seconds is not None and not 0 <= args.planning_seconds < math.inf:
        parser.error(f"--planning-seconds {args.planning_seconds} must be a number of seconds "
                     ">= 0, e.g. 30")
    if args.overlap is not None and not 0 <= args.overlap <= 1:
        parser.error(f"--overlap {args.overlap} must be in [0, 1] (0: strict turns, 1: free "
                     "overlap)")
    if not 0 <= args.growth_tolerance < math.inf:
        parser.error(f"--growth-tolerance {args.growth_tolerance} must be >= 0 (extra "
                     "device-seconds as a fraction of a plan's, e.g. 0.05)")
    scamp = ScampPolicy(longest_first=not args.no_longest_first, elastic=not args.no_elastic,
                        growth_tolerance=args.growth_tolerance,
                        compute_aware=not args.no_compute_aware,
                        resize_running=not args.no_resize,
                        min_resize_gain=args.min_resize_gain,
                        batch_multiple=args.batch_multiple)
    figures = None
    if args.measured is not None:  # read before the costing, which compiles for minutes
        from scamp_jax.sim.measured import engine_figures, read_results

        try:
            figures = engine_figures(read_results(args.measured))
        except (OSError, ValueError) as err:
            parser.error(f"--measured {args.measured}: {err}")

    configure_cpu_devices(8)
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.validate is not None:
        if not (args.validate / "hpo_makespan.json").is_file():
            parser.error(f"--validate {args.validate}: no hpo_makespan.json there; pass the "
                         "--out DIR of a 'python -m benchmarks.hpo_makespan --out DIR' run")
        for policy in ("scamp", "fixed"):  # before calibrating the host
            if not (args.validate / policy / "results.json").is_file():
                parser.error(f"--validate {args.validate}: no {policy}/results.json there; it "
                             "compares the fixed and scamp runs, so the run needs both: "
                             "'python -m benchmarks.hpo_makespan --policies scamp,fixed "
                             "--out DIR'")
        summary = validate(args.validate, CostTable(args.cache), log)
        for name, value in summary.items():
            print(f"{name}={value:.3f}")
        return 0
    cluster = cluster_preset(args.device, devices=args.devices)
    cap = args.max_batch_size or None
    table = CostTable(args.cache)
    families: list[int] = []
    if args.fuse:
        configs, families = sample_families(args.search, args.variant, args.architectures,
                                            args.trials, args.fuse, args.seed)
    else:
        configs = sample_configs(args.search, args.variant, args.architectures, args.trials,
                                 args.seed)
    print(f"costing {len(set(map(repr, configs)))} architectures on CPU, and the space's "
          f"largest for the fixed policy's devices (cache: {args.cache})", file=sys.stderr)
    costs = cost_candidates(configs, search=args.search, variant=args.variant, cluster=cluster,
                            safety_margin=args.safety_margin, table=table, log=log,
                            max_batch_size=cap, batch_multiple=args.batch_multiple)
    space, _, _ = _task(args.search, args.variant)
    (largest,) = cost_candidates([dict(space.largest)], search=args.search,
                                 variant=args.variant, cluster=cluster,
                                 safety_margin=args.safety_margin, table=table, log=log,
                                 max_batch_size=cap, batch_multiple=args.batch_multiple)
    scamp_profiles, fixed_profiles, k, fixed_batch = build_profiles(
        costs, largest, cluster, samples=args.samples, max_batch_size=cap,
        fixed_devices=args.fixed_devices, safety_margin=args.safety_margin,
        max_trial_devices=args.max_trial_devices or None, scamp_policy=scamp,
    )
    lookahead = args.devices if args.lookahead is None else args.lookahead or None
    if figures is not None:
        log(f"measured by {args.measured}: {figures or 'nothing (defaults kept)'}")
        cluster = dataclasses.replace(cluster, **figures)
    for name in ("restart_seconds", "planning_seconds", "planner_threads", "overlap"):
        if getattr(args, name) is not None:
            cluster = dataclasses.replace(cluster, **{name: getattr(args, name)})
    usable = int(cluster.memory_per_device * (1.0 - args.safety_margin))
    max_devices = args.max_trial_devices  # 0: no restart on more devices either

    def reshape(profile: TrialProfile) -> tuple[TrialProfile, ...]:
        return costs[profile.key].restart_profiles(profile, budget_bytes=usable,
                                                   max_devices=max_devices)
    results: dict[str, SimResult] = {}
    start = time.perf_counter()
    if args.policy in ("scamp", "both"):
        results["scamp"] = simulate(scamp_profiles, cluster, scamp, lookahead=lookahead,
                                    reshape=reshape, safety_margin=args.safety_margin)
    if args.policy in ("fixed", "both"):
        results["fixed"] = simulate(fixed_profiles, cluster, FixedPolicy(k), lookahead=lookahead,
                                    safety_margin=args.safety_margin)
    if args.fuse:
        from scamp_jax.sim.sim_fusion import fused_profiles

        costing = time.perf_counter()
        signatures, models = fused_cost_models(
            configs, scamp_profiles, costs, search=args.search, variant=args.variant,
            width=args.fuse, table=table, log=log)
        start += time.perf_counter() - costing  # report simulation time only
        grouped, members = fused_profiles(scamp_profiles, signatures, families, models,
                                          cap=args.fuse, usable_bytes=usable)
        widths = [len(m) for m in members.values()]
        print(f"fusion: {len(configs)} trials in {len(grouped)} scheduled units, "
              f"{sum(w > 1 for w in widths)} fused groups of widths "
              f"{sorted(set(w for w in widths if w > 1))}", file=sys.stderr)
        # Groups are not restarted on more devices (nor are they by the engine).
        lone = {k for k, m in members.items() if len(m) == 1}

        def reshape_lone(profile: TrialProfile) -> tuple[TrialProfile, ...]:
            return reshape(profile) if profile.key in lone else ()
        results["scamp+fusion"] = simulate(grouped, cluster, scamp, lookahead=lookahead,
                                           reshape=reshape_lone,
                                           safety_margin=args.safety_margin)
    sim_seconds = time.perf_counter() - start

    batches = sorted({p.batch_size for p in scamp_profiles})
    print(f"{args.trials} {args.search}-{args.variant} trials on {args.devices} x {args.device}; "
          f"{args.samples} samples per trial; scamp batches {batches[0]}-{batches[-1]} on "
          f"{sorted({p.devices for p in scamp_profiles})} device(s); fixed: {k} device(s), "
          f"batch {fixed_batch}; lookahead {lookahead or 'all'}")
    print(f"device sharing and overheads: {cluster.describe()}")
    if "scamp" in results:
        used = sorted({len(t.device_ids) for t in results["scamp"].trials})
        print(f"scamp {scamp}: trials ran on {used} device(s); "
              f"{results['scamp'].resizes} running trial(s) restarted on more devices "
              f"({cluster.restart_seconds:g} s per restart)")
    print(f"costing: {table.compiled} new architecture(s) measured and "
          f"{table.planned} planner answer(s) compiled, {table.compile_seconds:.1f} s of "
          f"compiles; simulation {sim_seconds:.2f} s")
    header = ("policy", "makespan h", "mean memory util", "busy fraction", "idle fraction")
    rows = [
        (name, f"{r['makespan_h']:.3f}", f"{r['mean_memory_utilization']:.3f}",
         f"{r['busy_fraction']:.3f}", f"{r['idle_fraction']:.3f}")
        for name, r in ((n, _row(res)) for n, res in results.items())
    ]
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        for row in (header, *rows):
            print("  ".join(f"{c:<17}" for c in row))
    for name, result in results.items():
        print(f"mean_memory_utilization_{name}={result.summary['mean_memory_utilization']:.3f}")
    if "fixed" in results and "scamp" in results:
        ratio = results["fixed"].makespan_s / results["scamp"].makespan_s
        print(f"makespan_ratio_fixed_over_scamp={ratio:.3f}")
    if "scamp" in results:
        # ScaMP's second claim: the share of the search's device time spent communicating,
        # against the paper's baseline of every trial data-parallel over all devices (each
        # device at the trial's planned per-device batch; ring all-reduce of its gradients).
        dp_all = []
        for profile in scamp_profiles:
            cost = costs[profile.key]
            mp = cost.model_parallel
            devices = cluster.devices - cluster.devices % mp
            local = profile.batch_size // (profile.devices // mp)
            dp_all.append(cost.profile(profile.key, devices, local * (devices // mp),
                                       args.samples))
        ours, theirs = results["scamp"].comm_fraction, comm_share(dp_all, cluster)
        print(f"communication share of device time: scamp placement {ours:.1%}, every trial "
              f"data-parallel on all {cluster.devices} devices {theirs:.1%} (ring all-reduce, "
              f"{cluster.interconnect_bandwidth / 1e9:g} GB/s within a node of "
              f"{cluster.node_devices}, {cluster.network_bandwidth / 1e9:g} GB/s between nodes)")
        # Why the share is what it is: per architecture, gradients against one step's work.
        seen: dict[int, tuple[StepCostModel, TrialProfile]] = {}
        for profile in dp_all:
            seen.setdefault(id(costs[profile.key]), (costs[profile.key], profile))
        for cost, profile in seen.values():
            busy = step_busy_seconds(profile, cluster)
            comm = step_comm_seconds(profile, cluster)
            print(f"  all-devices DP: gradients {cost.gradient_bytes / 2**20:.1f} MiB per device, "
                  f"{profile.flops_per_step / 1e9:.1f} GFLOP per device-step at batch "
                  f"{profile.batch_size // (profile.devices // cost.model_parallel)} per device: "
                  f"compute {busy * 1e3:.1f} ms, ring all-reduce {comm * 1e3:.1f} ms per step "
                  f"({comm / (busy + comm):.1%} of compute + all-reduce)")
        print(f"comm_share_scamp={ours:.4f}")
        print(f"comm_share_all_devices_dp={theirs:.4f}")
    if "scamp+fusion" in results and "scamp" in results:
        ratio = results["scamp"].makespan_s / results["scamp+fusion"].makespan_s
        print(f"makespan_ratio_scamp_over_fused={ratio:.3f}")
    return 0


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        raise SystemExit(main())
