"""How long the cluster simulator takes at scale, on a synthetic study that exercises every part.

    python -m benchmarks.simulate_scale --devices 10000 --trials 40000 --policy both

`benchmarks.simulate_cluster` costs real candidates, whose trials at 10,000 devices mostly end
together; this study instead mixes six kinds of one-device trials (10-90% of a V100's usable
memory, 500-5,000 steps of different FLOPs, drawn with ``--seed``), each with 2, 4 and 8
device alternatives (last-wave growth) and restart shapes (the tail's restarts), so the last
wave and the tail, where the scheduling core decides with busy fractions and growth options,
take many decisions over a long queue. Trials arrive as the engine asks them (lookahead: one
per device), with one planner thread per device: the engine's 2 would pace such a study by its
planning (30 s a plan) and leave the queue short. Prints the simulation's wall time per
policy, the makespan and a hash of every trial's start, end and devices (equal hashes: the same
decisions).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from scamp_jax.scheduling.placement import FixedPolicy, Policy, ScampPolicy
from scamp_jax.sim.simulator import SimResult, TrialProfile, cluster_preset, simulate

SAFETY_MARGIN = 0.1


def synthetic_profiles(devices: int, trials: int, seed: int) -> list[TrialProfile]:
    """``trials`` one-device trials of six kinds, with 2-, 4- and 8-device alternatives."""
    rng = random.Random(seed)
    cluster = cluster_preset("v100-16gb", devices=devices)
    usable = int(cluster.memory_per_device * (1 - SAFETY_MARGIN))
    kinds = [(rng.choice([0.1, 0.2, 0.3, 0.45, 0.6, 0.9]), rng.uniform(0.2, 2.0) * 1e12,
              rng.randrange(500, 5000)) for _ in range(6)]
    out = []
    for key in range(trials):
        share, flops, steps = kinds[rng.randrange(len(kinds))]
        alternatives = tuple(
            TrialProfile(key, d, int(usable * share * 0.7), 32, flops / d * 1.02, flops / 20 / d,
                         1e6, steps) for d in (2, 4, 8))
        out.append(TrialProfile(key, 1, int(usable * share), 32, flops, flops / 20, 0.0, steps,
                                alternatives=alternatives))
    return out


def _restarts(profile: TrialProfile) -> tuple[TrialProfile, ...]:
    # The same batch of 32 on 2, 4 or 8 data-parallel replicas.
    return tuple(TrialProfile(profile.key, d, profile.bytes_per_device, profile.batch_size,
                              profile.flops_per_step * profile.devices / d,
                              profile.bytes_accessed_per_step, 1e6, profile.steps)
                 for d in (2, 4, 8) if d > profile.devices)


def placement_hash(result: SimResult) -> str:
    """A short hash of every trial's start, end and devices."""
    rows = [(t.key, t.start_s, t.end_s, t.device_ids) for t in result.trials]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.simulate_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2000,
                        help="simulated V100-16GB devices in the cluster (default 2000)")
    parser.add_argument("--trials", type=int, default=8000,
                        help="synthetic trials to place (default 8000)")
    parser.add_argument("--policy", choices=("scamp", "fixed", "both"), default="both",
                        help="placement policy to simulate (default both, side by side)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the synthetic trials' sizes and lengths (default 0)")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.trials < 1:
        parser.error("--devices and --trials must be positive")
    # plans never wait for a thread, so the queue stays long (module docstring)
    cluster = replace(cluster_preset("v100-16gb", devices=args.devices),
                      planner_threads=args.devices)
    profiles = synthetic_profiles(args.devices, args.trials, args.seed)
    runs: list[tuple[Policy, list[TrialProfile],
                     Callable[[TrialProfile], Sequence[TrialProfile]] | None]] = []
    if args.policy in ("scamp", "both"):
        runs.append((ScampPolicy(), profiles, _restarts))
    if args.policy in ("fixed", "both"):
        runs.append((FixedPolicy(1), [replace(p, alternatives=()) for p in profiles], None))
    total = 0.0
    for policy, trials, reshape in runs:
        start = time.perf_counter()
        result = simulate(trials, cluster, policy, lookahead=args.devices, reshape=reshape,
                          safety_margin=SAFETY_MARGIN)
        seconds = time.perf_counter() - start
        total += seconds
        print(f"{policy.name}: simulated in {seconds:.1f} s; makespan {result.makespan_s!r} s, "
              f"{result.resizes} restarts, placements {placement_hash(result)}")
    print(f"{args.devices} devices x {args.trials} trials: simulation {total:.1f} s")


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
