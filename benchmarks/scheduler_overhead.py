"""Placement decisions per second with a long queue on a large pool.

    python -m benchmarks.scheduler_overhead                 # 10,000 queued trials, 1,024 devices
    python -m benchmarks.scheduler_overhead --markdown      # the table as Markdown

Steady state of a busy cluster: the pool is first filled from the queue; then, repeatedly, one
running trial finishes, the policy decides on the pool snapshot and the whole queue, the decided
trials are allocated, and the queue is topped up to its length again. A *decision* is one
``snapshot() + decide()`` call; the table gives decisions per second (wall clock and per second
of process CPU time, which does not depend on other load on the machine), mean and
99th-percentile latency, and trials started per decision. The mix of requests: 70% one device,
15% two, 10% four, 5% eight; predicted peaks 5-95% of a device (multi-device trials 40-95%).
Pure Python, one core.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from scamp_jax.scheduling.placement import FixedPolicy, ScampPolicy, TrialRequest
from scamp_jax.scheduling.pool import DevicePool
from scamp_jax.scheduling.request_queue import RequestQueue

GIB = 2**30


def _request(
    rng: random.Random, key: int, capacity: int, fixed_devices: int | None
) -> TrialRequest:
    devices = rng.choices((1, 2, 4, 8), weights=(70, 15, 10, 5))[0]
    low = 0.05 if devices == 1 else 0.4
    nbytes = int(capacity * rng.uniform(low, 0.95))
    if fixed_devices is not None:
        devices = min(devices, fixed_devices)
    return TrialRequest(key, devices, nbytes, arrival=key)


def measure(
    policy: ScampPolicy | FixedPolicy,
    *,
    devices: int = 1024,
    queued: int = 10_000,
    decisions: int = 200,
    seed: int = 0,
) -> dict[str, float]:
    """Time ``decisions`` steady-state decisions of ``policy``; returns rate and latency figures.

    Returns a dict with ``decisions_per_s`` (wall clock), ``decisions_per_cpu_s`` (process CPU
    time, insensitive to other load on the machine), ``mean_ms``, ``p99_ms`` (per decision,
    milliseconds, wall clock), ``started_per_decision`` and ``running`` (trials running at the end).
    """
    rng = random.Random(seed)
    capacity = 16 * GIB
    pool = DevicePool([capacity] * devices)
    fixed = policy.devices_per_trial if isinstance(policy, FixedPolicy) else None
    # The queue is kept indexed as trials arrive and start (`RequestQueue`), as a long-lived
    # scheduler keeps it, so that a decision does not re-sort 100,000 waiting trials.
    queue = RequestQueue(_request(rng, k, capacity, fixed) for k in range(queued))
    next_key = queued

    def place(placements: Sequence) -> None:
        for p in placements:
            pool.allocate(p, queue.remove(p.key))

    place(policy.decide(pool.snapshot(), queue))  # fill the pool (not timed)
    latencies = []
    cpu = 0.0  # process CPU seconds: what the decisions cost without other load on the machine
    started = 0
    for _ in range(decisions):
        running = list(pool.running)
        pool.release(running[rng.randrange(len(running))])
        while len(queue) < queued:
            queue.add(_request(rng, next_key, capacity, fixed))
            next_key += 1
        t0, c0 = time.perf_counter(), time.process_time()
        placements = policy.decide(pool.snapshot(), queue)
        latencies.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
        started += len(placements)
        place(placements)
    latencies.sort()
    total = sum(latencies)
    return {
        "decisions_per_s": len(latencies) / total,
        "decisions_per_cpu_s": len(latencies) / cpu if cpu > 0 else float("inf"),
        "mean_ms": 1e3 * statistics.fmean(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "started_per_decision": started / len(latencies),
        "running": float(len(pool.running)),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags, measure both policies, print the table."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scheduler_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1024,
                        help="devices in the pool (default 1024)")
    parser.add_argument("--queued", type=int, default=10_000,
                        help="trials kept in the queue (default 10,000)")
    parser.add_argument("--decisions", type=int, default=200,
                        help="timed decisions per policy (default 200)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the request stream (default 0)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    if args.devices < 8 or args.queued < 1 or args.decisions < 1:
        parser.error("need --devices >= 8, --queued >= 1 and --decisions >= 1")

    rows = []
    for label, policy in (
        ("scamp", ScampPolicy()),
        ("scamp (pack, spread=False)", ScampPolicy(spread=False)),
        ("fixed (8 per trial)", FixedPolicy(8)),
    ):
        figures = measure(
            policy, devices=args.devices, queued=args.queued, decisions=args.decisions,
            seed=args.seed,
        )
        rows.append((label, figures))

    header = ("policy", "decisions/s", "decisions/CPU-s", "mean ms", "p99 ms",
              "started/decision", "running")
    lines = [
        (label, f"{f['decisions_per_s']:.1f}", f"{f['decisions_per_cpu_s']:.1f}",
         f"{f['mean_ms']:.2f}", f"{f['p99_ms']:.2f}",
         f"{f['started_per_decision']:.2f}", f"{f['running']:.0f}")
        for label, f in rows
    ]
    print(f"{args.queued} queued trials, {args.devices} devices, {args.decisions} decisions")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for line in lines:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
    for label, f in rows:
        key = label.split()[0]
        if label == key:
            print(f"decisions_per_s_{key}={f['decisions_per_s']:.1f}")
            print(f"decisions_per_cpu_s_{key}={f['decisions_per_cpu_s']:.1f}")


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
