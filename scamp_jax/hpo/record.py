"""What the search loop knows of one trial while it runs: its `TrialRecord`.

The record holds the trial's live status, its timeline (asked, planned, started, finished, its
placements and measured paces), the events the scheduling core was fed for it (so a finished
study can be replayed, `scamp_jax.scheduling.replay`) and the trial's fused group, and gives
the study its attributes (``results.json``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scamp_jax.hpo.failures import TRACEBACK
from scamp_jax.hpo.launch import Run
from scamp_jax.hpo.resizing import Restart
from scamp_jax.hpo.study.trials import AskedTrial
from scamp_jax.hpo.trial import RunResult, TrialStatus, booked_bytes
from scamp_jax.scheduling.core import TrialPlan


@dataclass
class TrialRecord:
    """Everything the search loop knows of one trial while it runs (one record per trial).

    ``grown``: its plans on more devices the core asked for while it is queued (by device
    count); ``run``: the unit it runs in; ``times``: its
    timeline (planned/started/finished, placements, measured paces, the core's plan);
    ``next_pace``: steps at which its pace is next fed; ``earlier_wall``: seconds of its earlier
    runs (restarts); ``oom``: its out-of-memory result while it is re-planned; ``resizing`` /
    ``restarted``: a restart on more devices decided / started; ``group``, ``width``: its fused
    group (None: alone); ``solo_only``: its group ran out of memory, it runs alone;
    ``booked_allowance``: the allowance its run's booking carries; ``calibrated``: the last
    measured peak the loop learnt from (`scamp_jax.hpo.calibration`).
    """

    status: TrialStatus
    asked: AskedTrial
    steps_for: Callable[[int], int] = lambda batch: 0
    grown: dict[int, Any] = field(default_factory=dict)
    run: Run | None = None
    times: dict[str, Any] = field(default_factory=lambda: {"placements": [], "pace": []})
    next_pace: int = 2
    earlier_wall: float = 0.0
    oom: RunResult | None = None
    resizing: Restart | None = None
    restarted: Restart | None = None
    group: int | None = None
    width: int = 1
    solo_only: bool = False
    booked_allowance: int = 0
    calibrated: int | None = None

    def show_plan(self, plan: Any) -> None:
        """Record ``plan``'s degrees, batch, booking and steps in the status."""
        status = self.status
        status.model_parallel = int(plan.model_parallel)
        status.batch_size = int(plan.batch_size)
        status.predicted_peak_bytes = booked_bytes(plan)
        status.steps = self.steps_for(status.batch_size)

    def queued(self, now: float, plan: TrialPlan, kind: str = "planned") -> None:
        """Event: the scheduling core holds this trial (or its group, keyed by it) as ``plan``
        (``kind``: ``"planned"``, or ``"requeued"`` after an out-of-memory re-plan)."""
        self.times.setdefault("planned_at", now)
        self.times["plan"] = plan.as_dict()
        self.log(kind, now, plan.as_dict())

    def log(self, kind: str, now: float, *data: Any) -> None:
        """Record an event the scheduling core was fed for this trial (or its group):
        ``[kind, seconds since the run's start, *data]`` (`scamp_jax.scheduling.replay`)."""
        self.times.setdefault("core", []).append([kind, now, *data])

    def placed(self, now: float, device_ids: Sequence[int], jax_ids: Sequence[int]) -> None:
        """Event: a run of this trial starts at ``now`` on the pool's devices ``device_ids``
        (positions in the pool, as the scheduling core and its replay count them), whose
        JAX ids (``jax.Device.id``, what the trial's record and the live view show) are
        ``jax_ids``."""
        self.status.devices = tuple(jax_ids)
        self.status.state = "starting"
        self.times.setdefault("started_at", now)
        self.times["placements"].append([now, list(device_ids)])
        self.next_pace = 2

    def pace(self, t0: float) -> tuple[float, int, float, float] | None:
        """``(now, step, seconds per step, since)`` of this trial's run, seconds since ``t0``,
        at 2, 4, 8, ... steps into the run (so a long study records a few dozen measurements
        per trial); None when no measurement is due."""
        status = self.status
        done = status.step - status.first_step
        if status.state != "training" or done < max(2, self.next_pace):
            return None
        if math.isnan(status.training_since):
            return None
        self.next_pace = 2 * done
        mono = time.monotonic()
        pace = (mono - t0, status.step, (mono - status.training_since) / done,
                status.training_since - t0)
        self.times["pace"].append(list(pace))
        return pace

    def attrs(self, rank: int, wall: float) -> dict[str, Any]:
        """The trial's attributes in the study (its ``results.json`` record)."""
        status, times = self.status, self.times
        return {
            "devices": list(status.devices),
            "model_parallel": status.model_parallel,
            "batch_size": status.batch_size,
            "predicted_peak_bytes": status.predicted_peak_bytes,
            "steps": status.step,
            "wall_seconds": round(wall, 3),
            "step_seconds": status.step_seconds,
            "replans": status.replans,
            "resizes": status.resizes,
            "booked_bytes": status.booked_bytes,
            "measured_peak_bytes": status.measured_peak_bytes,
            "rank": rank,
            "final_loss": None if math.isnan(status.loss) else status.loss,
            # Seconds since this run's start (full precision: they order the replay's events).
            "asked_at": times.get("asked_at"),
            "planned_at": times.get("planned_at"),
            "started_at": times.get("started_at"),
            "finished_at": times.get("finished_at"),
            "placements": times.get("placements", []),
            "pace": times.get("pace", []),
            "plan": times.get("plan"),
            "fused_group": self.group,
            "fusion_width": self.width,
            "core_events": times.get("core", []),
            "run_started": times.get("run_started"),
            # the exception's traceback of a trial that raised (`scamp_jax.hpo.failures`)
            **({TRACEBACK: status.traceback} if status.traceback else {}),
        }
