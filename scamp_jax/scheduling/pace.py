"""How fast trials run: the best FLOP rate measured and which running trials were measured.

The scheduling core (`scamp_jax.scheduling.core`) costs trials as ``steps * flops_per_step /
rate`` and books each running trial's busy fraction, ``flops_per_step / rate /
seconds_per_step``. `Paces` keeps what those figures need: the attainable rate (the device's
data-sheet peak where known, else the best rate measured so far), and per (FLOPs per step,
device count) the running trials measured with them, in start order, whose busy fraction a
queued trial of the same shape is predicted to have. Pure bookkeeping: no clock, threads or I/O.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Signature = tuple[float | None, int]


@dataclass
class Run:
    """One running trial: its plan (a `scamp_jax.scheduling.core.TrialPlan`), devices and
    measured pace (seconds since the study's start)."""

    plan: Any
    device_ids: tuple[int, ...]
    started: float  # this run's start, seconds
    seconds_per_step: float | None = None
    step: int = 0  # steps done (of plan.steps) at the last measurement
    measured_at: float = math.nan
    training_since: float = math.nan  # when this run's first step began (its start-up ends)
    predicted_end: float = math.inf  # until measured: when the plan that started it said

    def remaining(self, now: float) -> float:
        """Predicted seconds until this measured run ends where it is, at ``now``: the steps
        left at its last measurement, less those trained since at its pace."""
        assert self.seconds_per_step is not None
        remaining = self.seconds_per_step * max(0, self.plan.steps - self.step)
        if not math.isnan(self.measured_at):
            remaining = max(0.0, remaining - (now - self.measured_at))
        return remaining

    def restart(self, restart_seconds: float | None) -> float:
        """Predicted seconds of a restart: ``restart_seconds``, else this run's start-up."""
        if restart_seconds is not None:
            return restart_seconds
        since = self.training_since if not math.isnan(self.training_since) else self.started
        return max(0.0, since - self.started)


class Paces:
    """The running trials of a study and their measured paces (see the module doc).

    Args:
      peak_flops: FLOP/s one device can attain, or None (the best measured rate stands in).

    Attributes:
      rate: the attainable FLOP/s per device now (None: nothing known yet).
      runs: the running trials by key (`Run`); the scheduling core adds and removes them.
    """

    def __init__(self, peak_flops: float | None) -> None:
        self.rate = peak_flops
        self.runs: dict[int, Run] = {}
        # The measured running trials per signature, as (start position, key) sorted; where
        # each is filed; start positions.
        self._measured: dict[Signature, list[tuple[int, int]]] = {}
        self._filed: dict[int, tuple[Signature, tuple[int, int]]] = {}
        self._position: dict[int, int] = {}
        self._starts = 0
        self._alike: dict[Signature, int] | None = None

    def started(self, key: int) -> None:
        """Trial ``key`` started (its place in the start order)."""
        self._position[key] = self._starts
        self._starts += 1

    def first_measured(self, key: int, plan: Any) -> None:
        """Running trial ``key`` (on ``plan``) has its first measurement: it is measured alike
        for queued trials of its signature."""
        signature = (plan.flops_per_step, plan.devices)
        entry = (self._position[key], key)
        bisect.insort(self._measured.setdefault(signature, []), entry)
        self._filed[key] = (signature, entry)
        self._alike = None

    def unfile(self, key: int) -> None:
        """Running trial ``key`` ended or restarted: it is no longer measured as it was."""
        self._alike = None
        held = self._filed.pop(key, None)
        if held is not None:
            signature, entry = held
            entries = self._measured[signature]
            del entries[bisect.bisect_left(entries, entry)]
            if not entries:
                del self._measured[signature]

    def alike(self) -> dict[Signature, int]:
        """Per (FLOPs per step, devices): the first running trial (in start order) measured
        with them (kept until a run starts its measurements, restarts or ends)."""
        if self._alike is None:
            self._alike = {signature: entries[0][1]
                           for signature, entries in self._measured.items()}
        return self._alike

    def measured(self, flops_per_step: float | None, seconds_per_step: float) -> bool:
        """A trial of ``flops_per_step`` ran at ``seconds_per_step``; True when that raised the
        best rate (every busy fraction then changes)."""
        if not flops_per_step:
            return False
        rate = flops_per_step / seconds_per_step
        if self.rate is not None and rate <= self.rate:
            return False
        self.rate = rate
        return True

    def step_measured(self, now: float, key: int, step: int, seconds_per_step: float,
                      training_since: float | None) -> bool | None:
        """Running trial ``key`` did ``step`` steps at ``seconds_per_step`` (``training_since``:
        when its first step began). None: nothing changed that a booking depends on; else
        whether the best rate rose (every busy fraction changes) or only this trial's did."""
        run = self.runs.get(key)
        if run is None or seconds_per_step <= 0:
            return None
        if run.seconds_per_step == seconds_per_step and (
                training_since is None or run.training_since == training_since):
            run.step, run.measured_at = step, now  # the same pace further on
            return None
        if run.seconds_per_step is None:  # the trials measured alike change
            self.first_measured(key, run.plan)
        run.seconds_per_step, run.step, run.measured_at = float(seconds_per_step), step, now
        if training_since is not None:
            run.training_since = float(training_since)
        return self.measured(run.plan.flops_per_step, seconds_per_step)

    def busy_fraction(self, key: int) -> float | None:
        """Measured busy fraction of running trial ``key`` (None: not measured yet)."""
        run = self.runs.get(key)
        return None if run is None else self.busy(run.plan.flops_per_step,
                                                  run.seconds_per_step)

    def predicted_busy(self, plan: Any, alike: Mapping[Signature, int] | None = None
                       ) -> float | None:
        """A trial's busy fraction: its own measurement while it runs; queued, that of the
        running trial measured alike (``alike``, default `alike`); else unknown (None)."""
        if plan.key in self.runs:
            return self.busy_fraction(plan.key)
        key = (self.alike() if alike is None else alike).get(
            (plan.flops_per_step, plan.devices))
        return None if key is None else self.busy_fraction(key)

    def seconds(self, plan: Any) -> float | None:
        """Predicted solo seconds of ``plan`` (None without FLOPs). Before the first
        measurement the same rate stands for all, so the order of trials (all a policy
        compares) is already right; the unit is not."""
        if not plan.flops_per_step:
            return None
        return plan.steps * plan.flops_per_step / (self.rate or 1.0)

    def busy(self, flops_per_step: float | None, seconds_per_step: float | None) -> float | None:
        """The busy fraction of a trial measured at ``seconds_per_step`` (None: unknown)."""
        if seconds_per_step is None or not flops_per_step or self.rate is None:
            return None
        return min(1.0, flops_per_step / self.rate / seconds_per_step)
