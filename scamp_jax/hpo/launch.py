"""Starting runs for the search loop: a solo trial or a fused group, in a worker thread.

`Launcher` turns a placement decided by the scheduling core into a run: the plan moved onto the
placed devices, the run's spec (steps, intervals, the booked share, checkpoint directory, seed)
and a worker thread running the one trial lifecycle (`scamp_jax.hpo.runner.run_trial` for a solo
trial, `scamp_jax.hpo.fused_runner.run_fused_group` for a group). JAX dispatch is asynchronous
and each run owns disjoint devices, so several runs train at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scamp_jax.hpo.fused_runner import run_fused_group
from scamp_jax.hpo.runner import RunSpec, StepCache, run_trial
from scamp_jax.hpo.trial import PlannedTrial, TrialStatus, booked_bytes, trial_seed


@dataclass(frozen=True)
class Run:
    """A unit running in a worker thread: its key (trial number, or a group's smallest member
    number), its members, its stop event (Ctrl-C or a restart) and its future."""

    key: int
    members: tuple[PlannedTrial, ...]
    stop: threading.Event
    future: cf.Future


class Launcher:
    """Starts runs on the engine's devices (see the module doc).

    Args:
      space, task: the search space and the task.
      config: the engine's `EngineConfig` (steps, intervals, budget, seed).
      devices: the engine's device pool (placements name its indices).
      checkpoint_root: the per-trial checkpoint directories' root (None: no checkpoints).
      report: ``report(number, step, value) -> prune?`` (the study's pruner).
      cache: the compiled-step cache runs share.
      workers: worker threads.
    """

    def __init__(self, space: Any, task: Any, config: Any, devices: Sequence[Any],
                 checkpoint_root: Path | None, report: Callable[[int, int, float], bool],
                 cache: StepCache, workers: int) -> None:
        self.space, self.task, self.config, self.devices = space, task, config, devices
        self.checkpoint_root, self.report, self.cache = checkpoint_root, report, cache
        self.executor = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trial")

    def _checkpoint_dir(self, planned: PlannedTrial) -> Path | None:
        root = self.checkpoint_root
        return root / planned.asked.checkpoint_key if root is not None else None

    def solo(self, planned: PlannedTrial, device_ids: Sequence[int], status: TrialStatus) -> Run:
        """Start ``planned`` on the pool's devices ``device_ids`` (its first ``devices``)."""
        ids = device_ids[: planned.devices]
        plan = planned.plan.with_devices([self.devices[i] for i in ids])
        config = self.config
        spec = RunSpec(
            number=planned.number, params=planned.asked.params, plan=plan,
            steps=config.steps_for(int(plan.batch_size)),
            memory_per_device=config.need_budget().memory_per_device,
            booked_bytes=booked_bytes(plan),
            checkpoint_dir=self._checkpoint_dir(planned),
            checkpoint_every=config.checkpoint_every, eval_every=config.eval_every,
            log_every=config.log_every,
            seed=trial_seed(config.seed, planned.asked.checkpoint_key),
        )
        stop = threading.Event()
        future = self.executor.submit(run_trial, spec, self.space, self.task, report=self.report,
                                      status=status, stop=stop, cache=self.cache)
        return Run(planned.number, (planned,), stop, future)

    def group(self, unit: Any, spec: Any, statuses: Sequence[TrialStatus]) -> Run:
        """Start the fused group ``unit`` (a `scamp_jax.hpo.fused_engine.Unit`) as ``spec``."""
        stop = threading.Event()
        future = self.executor.submit(run_fused_group, spec, self.space, self.task,
                                      report=self.report, statuses=statuses, stop=stop,
                                      cache=self.cache)
        return Run(unit.key, unit.members, stop, future)

    def close(self) -> None:
        """Wait for every run and release the worker threads."""
        self.executor.shutdown(wait=True)
