"""Calibration: what the allocator really holds, learned from running trials and booked after.

XLA's compiled figures leave out what the allocator holds beyond them (its rounding of chunks,
library workspaces). Every run, solo or fused, first or restarted, measures the devices it
runs on through the one reader `scamp_jax.devices.allocator_stats` (looked up at call time, so
a test on CPU devices can replace it): after its first steps and at its end
(`measure_peak`, called by `scamp_jax.hpo.lifecycle.Lifecycle`). The figure is the devices'
``peak_bytes_in_use``, None where nothing is reported (CPU devices).

The search loop compares each measurement with what the ledger has booked on those devices
(`Calibration.observe`): the most it ever booked there in this run, since the allocator's peak
is a high-water mark that cannot be reset. An excess means that the trials' bookings were short
by that much: the allowance of the devices' kind becomes what the measured booking carried plus
the excess, never less than before. The allowance is stored in the plan cache
(``plans.sqlite``, table ``allowances``), where every later plan of that kind reads it
(`scamp_jax.planning.plan_cache.resolve_allowance`), and from then on:

- every plan books it (`scamp_jax.planning.budget.Budget.plan_bytes` leaves room for it);
- a queued trial or group planned with a smaller allowance is booked again with this one
  (`with_allowance`), or, where its figures and the allowance no longer fit the usable bytes,
  planned again (solo) or split into solo trials (a group): no unit starts that the usable
  bytes less the allowance cannot hold.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from scamp_jax import devices as _devices
from scamp_jax.planning.budget import Budget
from scamp_jax.scheduling.booking import booked_bytes


def measure_peak(devices: Sequence[Any]) -> int | None:
    """The largest ``peak_bytes_in_use`` the allocator reports over ``devices``, bytes; None
    where none reports one. Reads `scamp_jax.devices.allocator_stats` as the module's attribute
    at each call."""
    peaks = []
    for device in devices:
        stats = _devices.allocator_stats(device)
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def with_allowance(plan: Any, allowance_bytes: int) -> Any:
    """``plan`` (a `scamp_jax.planning.planner.Plan` or a fused group's
    `scamp_jax.planning.fusion.FusionPlan`) booking ``allowance_bytes`` per device instead of
    its own allowance; the same object when they are equal."""
    member = getattr(plan, "plan", None)
    if member is not None and hasattr(plan, "width"):  # a fused group: its member plan's
        if int(getattr(member, "allowance_bytes", 0)) == allowance_bytes:
            return plan
        return dataclasses.replace(plan, plan=with_allowance(member, allowance_bytes))
    if int(getattr(plan, "allowance_bytes", 0)) == allowance_bytes:
        return plan
    return dataclasses.replace(plan, allowance_bytes=int(allowance_bytes))


class Calibration:
    """The allowance of one device pool, learned while a study runs (see the module doc).

    Args:
      budget: the pool's budget (its device kind names the allowance).
      cache: the study's plan cache, where the allowance is read at the start and stored when
        it grows (None: kept in this object only).

    Attributes:
      allowance_bytes: bytes per device every plan and booking on this pool adds now.
      observations: what each measurement that changed the allowance saw, in order (the
        ``run.allowance_grew`` of ``results.json``).
    """

    def __init__(self, budget: Budget, cache: Any = None) -> None:
        self.budget, self.cache = budget, cache
        self._lock = threading.Lock()
        #: a pool of several kinds names them all (`Budget.for_devices`); the allowance is
        #: read and stored per kind, as a plan on some of the devices reads it
        #: (`scamp_jax.planning.plan_cache.resolve_allowance`)
        self.kinds = budget.device_kind.split(",")
        stored = ([cache.get_allowance(budget.platform, kind) for kind in self.kinds]
                  if cache is not None else [])
        self.allowance_bytes = max([budget.allowance_bytes,
                                    *(int(r["bytes"]) for r in stored if r is not None)])
        self.observations: list[dict[str, int]] = []

    @property
    def by_kind(self) -> dict[str, int]:
        """``{device kind: allowance bytes}``, the ``run.allowance_bytes`` of ``results.json``."""
        return {self.budget.device_kind: self.allowance_bytes}

    def observe(self, measured_bytes: int, booked_bytes: int, booked_allowance: int) -> bool:
        """A unit's devices measured ``measured_bytes`` at most, where the ledger booked at most
        ``booked_bytes`` per device, its own booking carrying ``booked_allowance``; True when the
        allowance grew (it is then stored)."""
        excess = int(measured_bytes) - int(booked_bytes)
        needed = int(booked_allowance) + excess
        with self._lock:
            if excess <= 0 or needed <= self.allowance_bytes:
                return False
            self.allowance_bytes = needed
            seen = {"bytes": needed, "measured_peak_bytes": int(measured_bytes),
                    "booked_bytes": int(booked_bytes), "booked_allowance": int(booked_allowance)}
            self.observations.append(seen)
        if self.cache is not None:
            for kind in self.kinds:
                self.cache.put_allowance(self.budget.platform, kind, {**seen, "source": "study"})
        return True

    def learn(self, units: Mapping[int, Any], core: Any) -> bool:
        """`observe` each running unit's new measurement (``units``: the engine's trial records
        by unit key, whose status holds it) against the most ``core`` (the
        `scamp_jax.scheduling.core.SchedulingCore`) booked on its devices; True when the
        allowance grew."""
        grew = False
        for key, record in units.items():
            peak = record.status.measured_peak_bytes
            if peak is None or peak == record.calibrated or key not in core.running:
                continue
            record.calibrated = peak
            booked = max(core.pool.high_water[d] for d in core.running[key])
            grew |= self.observe(peak, booked, record.booked_allowance)
        return grew

    def refresh(self, plan: Any) -> Any | None:
        """``plan`` booking the current allowance, or None when its figures and the allowance
        exceed the pool's usable bytes (it must be planned again)."""
        fresh = with_allowance(plan, max(self.allowance_bytes,
                                         _allowance_of(plan)))
        return fresh if booked_bytes(fresh) <= self.budget.usable_bytes else None


def _allowance_of(plan: Any) -> int:
    member = getattr(plan, "plan", None) if hasattr(plan, "width") else None
    return int(getattr(member if member is not None else plan, "allowance_bytes", 0))
