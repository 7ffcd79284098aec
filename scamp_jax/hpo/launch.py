"""Starting runs for the search loop: a unit's run spec in a worker thread.

`Launcher` holds what every run of a study shares: the study's `EngineConfig`, the device pool
that placements index, the checkpoints' root, the pruner's report and the compiled-step cache.
A scheduled unit (`scamp_jax.hpo.units`: a solo trial or a fused group) builds its run spec from
it (`member`, `schedule`: the one reading of the configuration for a run) and starts the one
trial lifecycle in a worker thread (`scamp_jax.hpo.runner.run_trial` for a solo trial,
`scamp_jax.hpo.fused_runner.run_fused_group` for a group). JAX dispatch is asynchronous and each
run owns disjoint devices, so several runs train at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scamp_jax.hpo.lifecycle import MemberSpec, Schedule
from scamp_jax.hpo.runner import StepCache
from scamp_jax.hpo.trial import PlannedTrial
from scamp_jax.planning.compile_slots import COMPILE_SLOTS


def _a_run(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)``, a run: its compiles go before planning ones
    (`scamp_jax.planning.compile_slots`)."""
    with COMPILE_SLOTS.for_a_run():
        return fn(*args, **kw)


@dataclass(frozen=True)
class Run:
    """A unit running in a worker thread: its key (trial number, or a group's smallest member
    number), its members, its stop event (Ctrl-C or a restart) and its future."""

    key: int
    members: tuple[PlannedTrial, ...]
    stop: threading.Event
    future: cf.Future


#: Threads a launcher may make, one per run at once: far above what memory lets a pool run
#: (the thread pool makes them only as runs start).
RUN_THREADS = 4096


class Launcher:
    """Starts runs on the engine's devices (see the module doc).

    Args:
      space, task: the search space and the task.
      config: the engine's `EngineConfig` (steps, intervals, budget, seed).
      devices: the engine's device pool (placements name its indices).
      checkpoint_root: the per-trial checkpoint directories' root (None: no checkpoints).
      report: ``report(number, step, value) -> prune?`` (the study's pruner).
      cache: the compiled-step cache runs share.
      on_checkpoint: ``on_checkpoint(number, step, seconds)`` after a run's checkpoint
        before its last (seconds: what the run has taken so far).
      workers: the most runs at once (a thread each, made as runs start); the default
        `RUN_THREADS` leaves the scheduling core's placements the only cap: a run started
        beyond the threads would wait for one while its devices stay booked and idle.
    """

    def __init__(self, space: Any, task: Any, config: Any, devices: Sequence[Any],
                 checkpoint_root: Path | None, report: Callable[[int, int, float], bool],
                 cache: StepCache, workers: int | None = None,
                 on_checkpoint: Callable[[int, int, float], None] | None = None) -> None:
        self.space, self.task, self.config, self.devices = space, task, config, devices
        self.checkpoint_root, self.report, self.cache = checkpoint_root, report, cache
        self.on_checkpoint = on_checkpoint
        self.executor = cf.ThreadPoolExecutor(max_workers=workers or RUN_THREADS,
                                              thread_name_prefix="trial")

    @property
    def memory_per_device(self) -> int:
        """The study's budget per device, bytes."""
        return int(self.config.need_budget().memory_per_device)

    def devices_at(self, device_ids: Sequence[int]) -> list[Any]:
        """The pool's devices at the indices ``device_ids``."""
        return [self.devices[i] for i in device_ids]

    def member(self, planned: PlannedTrial) -> MemberSpec:
        """``planned`` as a run's member (its seed and checkpoint directory)."""
        return MemberSpec.of(planned.asked, self.config.seed, self.checkpoint_root)

    def schedule(self, batch_size: int, share_bytes: int) -> Schedule:
        """A run's schedule at a global batch of ``batch_size``, holding ``share_bytes``."""
        return Schedule.of(self.config, batch_size, share_bytes)

    def start(self, fn: Callable[..., Any], spec: Any, key: int,
              members: tuple[PlannedTrial, ...], **kw: Any) -> Run:
        """Run ``fn(spec, space, task, report=..., stop=..., cache=..., on_checkpoint=...,
        **kw)`` (`run_trial` or `run_fused_group`) in a worker thread, as unit ``key`` of
        ``members``."""
        stop = threading.Event()
        future = self.executor.submit(_a_run, fn, spec, self.space, self.task,
                                      report=self.report, stop=stop, cache=self.cache,
                                      on_checkpoint=self.on_checkpoint, **kw)
        return Run(key, members, stop, future)

    def close(self) -> None:
        """Wait for every run and release the worker threads."""
        self.executor.shutdown(wait=True)
