"""The host's data work per step of a fused group: the members' batches drawn and stacked.

A fused group's step takes every member's next batch, drawn from the member's own stream and
stacked on a member axis in host memory before it goes to the device. At the accelerator
preset's batches that is no small work (eight SwinIR members at 4,096 patches of 48 pixels:
1.1 GB a step), and a GPU can finish the step before the host has the next batch. This times,
for ``--width`` members of a family's task at ``--batch``, in interleaved rounds:

- ``one member``: one member's next batch (``next`` of its stream);
- ``in turn``: every member's next batch one after another, stacked with ``np.stack``;
- ``runner``: `scamp_jax.hpo.member_streams.StackedStreams`, what a fused group runs: each
  member's batch drawn into its slot of the stacked batch on the data threads where the task
  allows it (``parallel_streams``) and a member's draw takes long enough to pay for the
  hand-off (``at_once`` in the report), else the same as ``in turn``.

Only a task's public ``batches`` is used for the first two, so the same file measures another
checkout (``runner`` is left out where it has no `StackedStreams`)::

    python -m benchmarks.member_data --family swinir --width 8 --batch 4096
    PYTHONPATH=../other python benchmarks/member_data.py --family swinir --width 8 --batch 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def _task(family: str) -> Any:
    if family == "swinir":
        from search_spaces.sr_task import SRTask

        return SRTask(scale=2, hr_patch=48)
    from search_spaces.vit import SyntheticClassificationTask

    return SyntheticClassificationTask()


def _cores() -> int | None:
    """The cores this process may run on (what the data threads are sized by)."""
    try:
        from scamp_jax.scheduling.host import host_cores
    except ImportError:  # a checkout without it
        return os.cpu_count()
    return host_cores()


def measure(family: str, width: int, batch: int, repeats: int) -> dict[str, Any]:
    """Seconds per draw of each way (min and median over ``repeats`` interleaved rounds)."""
    import jax
    import numpy as np

    task = _task(family)
    one = task.batches(batch, 0)
    turn = [task.batches(batch, seed) for seed in range(width)]
    ways: dict[str, Callable[[], Any]] = {
        "one member": lambda: next(one),
        "in turn": lambda: jax.tree.map(lambda *xs: np.stack(xs), *[next(s) for s in turn]),
    }
    warm = 2
    try:
        from scamp_jax.hpo import member_streams
        from scamp_jax.hpo.member_streams import StackedStreams, parallel_streams
    except ImportError:
        parallel, stacked = None, None
    else:
        parallel = parallel_streams(task)
        stacked = StackedStreams([task.batches(batch, seed) for seed in range(width)], parallel)
        ways["runner"] = stacked.draw
        warm = 1 + getattr(member_streams, "TIMED_DRAWS", 1)
    for _ in range(warm):  # first draws: streams started, pages touched, the runner's choice made
        for draw in ways.values():
            draw()
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, draw in ways.items():
            t0 = time.perf_counter()
            draw()
            seconds[name].append(time.perf_counter() - t0)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(next(one)))
    return {"family": family, "width": width, "batch": batch, "repeats": repeats,
            "cores": _cores(), "bytes_per_member": nbytes, "parallel_streams": parallel,
            "at_once": None if stacked is None else stacked.at_once,
            "seconds": {name: {"min": min(v), "median": statistics.median(v)}
                        for name, v in seconds.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse flags, measure, print a table (and the JSON with ``--json``)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.member_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("swinir", "vit"), default="swinir",
                   help="whose task draws the batches (default swinir)")
    p.add_argument("--width", type=int, default=8, help="members in the group (default 8)")
    p.add_argument("--batch", type=int, default=4096,
                   help="samples per member per step (default 4096)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    for name in ("width", "batch", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: pass a positive count")
    report = measure(args.family, args.width, args.batch, args.repeats)
    if args.json:
        print(json.dumps(report, indent=1))
        return report
    mb = report["bytes_per_member"] / 1e6
    print(f"{args.family}: {args.width} members x batch {args.batch} ({mb:.1f} MB a member), "
          f"{report['cores']} cores, parallel_streams={report['parallel_streams']}, "
          f"the runner draws at once: {report['at_once']}")
    for name, s in report["seconds"].items():
        print(f"  {name:>10}: {1e3 * s['min']:8.1f} ms min, {1e3 * s['median']:8.1f} ms median")
    return report


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
