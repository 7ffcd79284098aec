"""Scheduled units of the search loop: a solo trial or a fused group, behind one interface.

The scheduling core places *units*: one trial alone (`SoloUnit`) or trials of one architecture
trained as one vmapped step (`GroupUnit`, `scamp_jax.hpo.fused_runner`). Both implement `Unit`,
and the search loop (`scamp_jax.hpo.engine.SearchEngine`) asks each what differs:

- queueing: what the core is fed (`Unit.trial_plan`, built for both by `trial_plan`), the
  unit booked with the allowance learned so far (`Unit.booked_with`, `scamp_jax.hpo.calibration`)
  and what follows when it no longer fits (`Unit.misfit`, `scamp_jax.hpo.out_of_memory`);
- its start: its run spec (`scamp_jax.hpo.runner.RunSpec` or
  `scamp_jax.hpo.fused_runner.GroupSpec`, built from the `scamp_jax.hpo.launch.Launcher`'s
  one reading of the configuration) and the run in a worker thread (`Unit.start`);
- its end, through `scamp_jax.hpo.endings.Endings` (`Unit.ended`).

How asked trials become units is a `UnitKind`, which the engine chooses once: `SoloTrials`
(every trial its own unit) or `scamp_jax.hpo.fused_engine.FusionService` (``fuse``: trials of
one architecture grouped). A kind owns admission (how an asked trial is planned, what happens
when its plan is in), grouping (`Formed`) and the trials it holds before they are queued.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from scamp_jax.hpo.checkpoint import newest_step, recorded_batch
from scamp_jax.hpo.fused_runner import GroupSpec, run_fused_group
from scamp_jax.hpo.launch import Launcher, Run
from scamp_jax.hpo.runner import RunSpec, run_trial
from scamp_jax.hpo.study.trials import AskedTrial
from scamp_jax.hpo.trial import PlannedTrial, RunResult, TrialStatus, booked_bytes
from scamp_jax.scheduling.core import TrialPlan


def trial_plan(planning: Any, key: int, arrival: int, member: PlannedTrial, booked: int,
               width: int = 1, grows: bool = False) -> TrialPlan:
    """A unit as the scheduling core sees it: ``width`` trials like ``member`` (its devices,
    degrees, batch and steps; FLOPs per step ``width`` times its own, from ``planning``, the
    engine's `scamp_jax.hpo.plan_service.PlanningService`) booking ``booked`` bytes per device;
    ``grows``: it may start on more devices in the study's last wave (the usable bytes per
    device to grow into)."""
    plan = member.plan
    flops = planning.flops_of(member.number, plan)
    return TrialPlan(
        key=key, arrival=arrival, devices=member.devices, bytes_per_device=int(booked),
        steps=planning.config.steps_for(int(plan.batch_size)),
        flops_per_step=None if flops is None else flops * width,
        data_parallel=int(plan.data_parallel), model_parallel=int(plan.model_parallel),
        batch_size=int(plan.batch_size), grow_bytes=int(plan.usable_bytes) if grows else 0,
        trials=width)


class Unit(Protocol):
    """What the search loop needs of a scheduled unit (see the module doc).

    ``key``: the unit's key in the scheduling core (a trial number, a group's smallest member
    number); ``members``: its trials; ``devices``: the devices it is planned on;
    ``provisional``: its plan was made from shapes and must be compiled before it is queued;
    ``allowance``: the allowance its booking carries, bytes per device.
    """

    @property
    def key(self) -> int: ...

    @property
    def members(self) -> tuple[PlannedTrial, ...]: ...

    @property
    def devices(self) -> int: ...

    @property
    def provisional(self) -> bool: ...

    @property
    def allowance(self) -> int: ...

    def booked_with(self, calibration: Any) -> Unit | None:
        """This unit booking the allowance ``calibration`` learned so far; None when it no
        longer fits the usable bytes."""

    def misfit(self, oom: Any) -> None:
        """It no longer fits once the learned allowance is booked: ``oom`` (the loop's
        `scamp_jax.hpo.out_of_memory.OutOfMemory`) decides what follows."""

    def queued(self, records: Mapping[int, Any]) -> str:
        """Mark its members' records queued; the core's event: ``planned`` or ``requeued``."""

    def trial_plan(self, planning: Any) -> TrialPlan:
        """What the scheduling core is fed for it (`trial_plan`)."""

    def grown(self, plan: Any, devices: int) -> Unit:
        """This unit on ``plan``, made for ``devices`` devices (the core chose a larger
        option)."""

    def start(self, launcher: Launcher, device_ids: Sequence[int],
              statuses: Sequence[TrialStatus]) -> Run:
        """Build its run spec on the pool's devices ``device_ids`` and start its run."""

    def ended(self, endings: Any, result: Any) -> None:
        """Event: its run returned ``result``; ``endings`` (`scamp_jax.hpo.endings.Endings`)
        tells the study, re-plans or starts again."""


@dataclass(frozen=True)
class SoloUnit:
    """One trial trained alone (a `Unit`)."""

    planned: PlannedTrial

    @property
    def key(self) -> int:
        """The trial's number."""
        return self.planned.number

    @property
    def members(self) -> tuple[PlannedTrial, ...]:
        """The one trial."""
        return (self.planned,)

    @property
    def devices(self) -> int:
        """Devices its plan runs on."""
        return self.planned.devices

    @property
    def provisional(self) -> bool:
        """Its plan is provisional (made for a fused group from shapes)."""
        return bool(getattr(self.planned.plan, "provisional", False))

    @property
    def allowance(self) -> int:
        """The allowance its plan books, bytes per device."""
        return int(getattr(self.planned.plan, "allowance_bytes", 0))

    def booked_with(self, calibration: Any) -> SoloUnit | None:
        plan = calibration.refresh(self.planned.plan)
        return None if plan is None else SoloUnit(replace(self.planned, plan=plan))

    def misfit(self, oom: Any) -> None:
        oom.no_longer_fits(self.planned)  # planned again at most at its batch

    def queued(self, records: Mapping[int, Any]) -> str:
        record = records[self.key]
        record.group, record.width = None, 1
        record.status.state = "queued"
        record.show_plan(self.planned.plan)
        return "requeued" if self.planned.replans else "planned"

    def trial_plan(self, planning: Any) -> TrialPlan:
        planned = self.planned
        return trial_plan(planning, planned.number, planned.arrival, planned,
                          booked_bytes(planned.plan), grows=planning.may_grow)

    def grown(self, plan: Any, devices: int) -> SoloUnit:
        return SoloUnit(replace(self.planned, plan=plan, devices=devices))

    def start(self, launcher: Launcher, device_ids: Sequence[int],
              statuses: Sequence[TrialStatus]) -> Run:
        planned = self.planned
        plan = planned.plan.with_devices(launcher.devices_at(device_ids[: planned.devices]))
        spec = RunSpec.of(launcher.member(planned), plan,
                          launcher.schedule(plan.batch_size, booked_bytes(plan)),
                          launcher.memory_per_device)
        return launcher.start(run_trial, spec, self.key, self.members, status=statuses[0])

    def ended(self, endings: Any, result: RunResult) -> None:
        endings.run_ended(self.key, result)


@dataclass(frozen=True)
class GroupUnit:
    """Trials of one architecture trained as one fused group on ``fusion`` (a `Unit`; a
    `scamp_jax.planning.fusion.FusionPlan` at least as wide as the members); its key is its
    smallest member number."""

    members: tuple[PlannedTrial, ...]
    fusion: Any

    @property
    def key(self) -> int:
        """The group's id: its first member's number."""
        return self.members[0].number

    @property
    def devices(self) -> int:
        """Devices its member plan runs on."""
        return self.members[0].devices

    @property
    def provisional(self) -> bool:
        """Never: the fused plan's step is compiled."""
        return False

    @property
    def allowance(self) -> int:
        """The allowance its member plan books, bytes per device."""
        return int(getattr(self.fusion.plan, "allowance_bytes", 0))

    def booked_with(self, calibration: Any) -> GroupUnit | None:
        fusion = calibration.refresh(self.fusion)
        return None if fusion is None else GroupUnit(self.members, fusion)

    def misfit(self, oom: Any) -> None:
        for member in self.members:  # the group does not fit: its members run alone
            oom.member_ended(member)

    def queued(self, records: Mapping[int, Any]) -> str:
        for member in self.members:
            record = records[member.number]
            record.group, record.width = self.key, len(self.members)
            record.status.state = "queued"
        return "planned"

    def trial_plan(self, planning: Any) -> TrialPlan:
        return trial_plan(planning, self.key, min(m.arrival for m in self.members),
                          self.members[0], booked_bytes(self.fusion), width=len(self.members))

    def grown(self, plan: Any, devices: int) -> GroupUnit:
        raise AssertionError(f"group {self.key} was offered {devices} devices; a fused group "
                             "books no room to grow into")

    def start(self, launcher: Launcher, device_ids: Sequence[int],
              statuses: Sequence[TrialStatus]) -> Run:
        fusion = self.fusion.with_devices(launcher.devices_at(device_ids[: self.devices]))
        spec = GroupSpec.of(self.key, tuple(launcher.member(m) for m in self.members), fusion,
                            launcher.schedule(fusion.batch_size, booked_bytes(fusion)),
                            launcher.memory_per_device)
        return launcher.start(run_fused_group, spec, self.key, self.members,
                              statuses=statuses)

    def ended(self, endings: Any, result: Any) -> None:
        endings.group_ended(self.key, result.members)


@dataclass
class Formed:
    """What a `UnitKind` decided in one turn: ``units`` to queue now (in order), and groups to
    size at their own width first: ``(member numbers, job)`` where ``job()`` (run in a planner
    thread) returns the sized unit."""

    units: list[Unit] = field(default_factory=list)
    sizing: list[tuple[tuple[int, ...], Callable[[], Unit]]] = field(default_factory=list)


class UnitKind(Protocol):
    """How asked trials become units (see the module doc); the engine holds one.

    ``forming``: trials are held for groups still forming (the study's last wave waits).
    """

    @property
    def forming(self) -> bool: ...

    def reset(self) -> None:
        """Forget what a previous engine run held."""

    def plan_job(self, asked: AskedTrial) -> Callable[[], Any]:
        """(Loop thread.) The job a planner thread runs to plan ``asked``: its plan (raises
        as `scamp_jax.hpo.plan_service.PlanningService.plan` does)."""

    def admit(self, planned: PlannedTrial, record: Any) -> Unit | None:
        """Event: ``planned`` is planned (``record``: its `scamp_jax.hpo.record.TrialRecord`);
        the unit to queue now, or None when it waits for a group."""

    def form(self, planning: Iterable[Mapping[str, Any]], stalled: bool) -> Formed:
        """The units held trials make now (``planning``: configurations being planned;
        ``stalled``: nothing could bring more members)."""

    def waiting(self) -> list[int]:
        """Trials held and not queued (given back to the study on an interrupt)."""

    def view(self, records: Mapping[int, Any]) -> dict[str, Any]:
        """What the live view is told besides statuses and the pool."""


def resume_cap(asked: AskedTrial, checkpoint_root: Path | None, config: Any) -> int | None:
    """The batch cap of a retry (``asked``) whose checkpoints hold a step past the first
    (`scamp_jax.hpo.plan_service.PlanningService.cap_batch`, for every plan of it, fused or
    alone): the batch they were trained at, where it is below the study's cap, so that it
    resumes them rather than training from the start at a larger batch (which, where its
    earlier run had run out of memory and was planned again smaller, runs out again). None:
    the study's cap (no retry, no checkpoint of a step, its batch not recorded or below the
    study's ``min_batch_size``, or the fixed policy's one batch)."""
    if asked.retry_of is None or checkpoint_root is None or config.policy == "fixed":
        return None
    directory = checkpoint_root / asked.checkpoint_key
    kept = recorded_batch(directory)
    if kept is None or not newest_step(directory, config.steps_for(kept)):
        return None  # nothing it would resume (step 0 is the initial state: no progress)
    cap = config.max_batch_size
    if kept < (config.min_batch_size or 1):  # below the study's floor now: planned anew
        return None
    return kept if cap is None or kept < cap else None


class SoloTrials:
    """The `UnitKind` without fusion: every trial is its own unit, planned by ``planning``
    (the engine's `scamp_jax.hpo.plan_service.PlanningService`) and queued as soon as its plan
    is in."""

    forming = False

    def __init__(self, planning: Any) -> None:
        self.planning = planning

    def reset(self) -> None:
        """Nothing is held between runs."""

    def plan_job(self, asked: AskedTrial) -> Callable[[], Any]:
        return functools.partial(self.planning.planned_with_cost, asked.params, asked.number)

    def admit(self, planned: PlannedTrial, record: Any) -> Unit | None:
        return SoloUnit(planned)

    def form(self, planning: Iterable[Mapping[str, Any]], stalled: bool) -> Formed:
        return Formed()

    def waiting(self) -> list[int]:
        return []

    def view(self, records: Mapping[int, Any]) -> dict[str, Any]:
        return {}
