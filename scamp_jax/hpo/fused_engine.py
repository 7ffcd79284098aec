"""Fused groups in the search loop: trials of one architecture trained as one scheduled unit.

`FusionService` is mixed into `scamp_jax.hpo.engine.SearchEngine` (as `PlanningService` is) when
``EngineConfig.fuse`` is set. With it the engine:

1. plans each asked trial as usual and, in the planner threads (never on the loop's thread),
   also its architecture signature (`scamp_jax.hpo.fused_runner.architecture_signature`), the step
   its checkpoint resumes from, and the widest fused group of its architecture that fits
   (`scamp_jax.planning.fusion.plan_fusion` on the trial's own plan and batch, cached per
   architecture in memory and, with the engine's ``plan_cache``, in the study's
   ``plans.sqlite``: a resumed study plans its groups without compiling);
2. holds planned trials in a *forming* buffer and asks the pure rule
   `scamp_jax.scheduling.grouping.form_groups` which ones go together; a trial the sampler
   proposed has its siblings (same architecture, training hyperparameters from the sampler)
   enqueued by the study (`scamp_jax.hpo.study.OptunaTrialSource`'s ``siblings``), and its group
   waits for them while they are being asked and planned;
3. hands a group of two or more to the scheduling core as one trial: its key is the group id
   (the smallest member number), its bytes per device the fused plan's predicted peak
   (`scamp_jax.planning.fusion.FusionPlan.predicted_peak_bytes`, never more than the usable bytes)
   at the group's own width: a group narrower than the widest that fits (the last of a family,
   a resumed group) is sized again at its width in a planner thread first (compiled, or from the
   plan cache), so it books what it holds; its FLOPs per step are ``width`` times a member's; a
   group of one is queued as a plain trial;
4. runs a started group with `scamp_jax.hpo.fused_runner.run_fused_group`: each member reports,
   is pruned (masked, then the group re-forms without it) and is told on its own, and
   checkpoints in its own directory (a restarted study resumes it, alone or in a group of
   members at the same step). A group that runs out of memory sends its members back to the
   queue as plain trials.

Each member's record gets ``fused_group`` (the group id, or None) and ``fusion_width``.
Under MPI (`scamp_jax.distributed.engine`) each rank's engine groups only the trials it was
handed; rank 0's study server hands a proposal's siblings to the proposal's rank.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scamp_jax.hpo.fused_runner import (
    GroupResult,
    GroupSpec,
    MemberSpec,
    architecture_signature,
    signature_key,
)
from scamp_jax.hpo.fused_runner import run_fused_group as _run_fused_group
from scamp_jax.hpo.runner import make_optimizer
from scamp_jax.hpo.trial import (
    OPTIMIZER_KEYS,
    PlannedTrial,
    booked_bytes,
    fusion_cap,
    trial_seed,
)
from scamp_jax.planning import planner
from scamp_jax.planning.fusion import FusionPlan, plan_fusion
from scamp_jax.scheduling.core import Start, TrialPlan
from scamp_jax.scheduling.grouping import FusionCandidate, form_groups


def latest_checkpoint_step(directory: Path | None) -> int:
    """Newest checkpointed step in a trial's checkpoint directory (0: none)."""
    if directory is None or not directory.is_dir():
        return 0
    return max((int(p.name) for p in directory.iterdir() if p.name.isdigit()), default=0)


def _arch_text(params: Mapping[str, Any]) -> str:
    """The architecture part of a configuration (every key but the optimizer's), as text."""
    return repr(sorted((k, repr(v)) for k, v in params.items() if k not in OPTIMIZER_KEYS))


@dataclass(frozen=True)
class _MemberInfo:
    """What grouping needs of a planned trial (found in a planner thread)."""

    signature: Any
    resume_step: int
    fusion: FusionPlan | None  # None: it cannot be fused (runs alone)


@dataclass(frozen=True)
class _Unit:
    """A group queued in the scheduling core as one trial."""

    key: int
    members: tuple[PlannedTrial, ...]
    fusion: FusionPlan


@dataclass(frozen=True)
class _GroupRun:
    unit: _Unit
    stop: threading.Event
    future: cf.Future


class FusionService:
    """Fused groups for `scamp_jax.hpo.engine.SearchEngine` (a mixin; see the module doc)."""

    def _init_fusion(self) -> None:
        self._fuse_cap = fusion_cap(getattr(self.config, "fuse", None))
        self._fusion_lock = threading.Lock()
        self._signatures: dict[str, Any] = {}
        self._fusion_plans: dict[Any, FusionPlan | None] = {}
        self._fusion_of: dict[int, tuple[int | None, int]] = {}

    def _init_fusion_run(self) -> None:
        self._member_info: dict[int, _MemberInfo] = {}
        self._forming: dict[int, PlannedTrial] = {}
        self._awaiting: dict[int, int] = {}  # proposed trial -> siblings not planned yet
        self._family: dict[int, int] = {}  # trial -> the proposed trial it shares an arch with
        self._units: dict[int, _Unit] = {}
        # Groups narrower than their architecture's fused plan, being sized at their own width
        # in a planner thread (so they book what they hold, not the wider plan's bytes).
        self._sizing: dict[cf.Future, tuple[PlannedTrial, ...]] = {}
        self._group_runs: dict[int, _GroupRun] = {}
        self._solo_only: set[int] = set()

    @property
    def fusing(self) -> bool:
        """Whether this engine forms fused groups."""
        return self._fuse_cap is not None

    # ------------------------------------------------------------------ planner threads
    def _planned_for_fusion(self, params: Mapping[str, Any], number: int,
                            checkpoint_dir: Path | None) -> Any:
        """Plan and cost one trial, then its signature, resume step and fused plan."""
        plan = self._planned_with_cost(params, number)
        arch = _arch_text(params)
        with self._fusion_lock:
            signature = self._signatures.get(arch)
        if signature is None:
            signature = signature_key(architecture_signature(self.space, params))
            with self._fusion_lock:
                self._signatures[arch] = signature
        fusion = self._fusion_plan(params, plan, signature)
        self._member_info[number] = _MemberInfo(signature, latest_checkpoint_step(checkpoint_dir),
                                                fusion)
        return plan

    def _fusion_plan(self, params: Mapping[str, Any], plan: Any, signature: Any,
                     width: int | None = None) -> FusionPlan | None:
        """The widest group of ``params``'s architecture on ``plan`` (at its batch) of at most
        ``width`` members (None: the engine's cap), cached in memory and in the plan cache;
        None when fewer than two fit."""
        width = self._fuse_cap if width is None else width
        key = (signature, tuple(d.id for d in plan.devices), int(plan.batch_size), width)
        with self._fusion_lock:
            if key in self._fusion_plans:
                return self._fusion_plans[key]
        try:
            fusion: FusionPlan | None = plan_fusion(
                self._abstract(params), self.task.sample_batch(1), max_width=width,
                plan=plan, batch_size=int(plan.batch_size), optimizer=make_optimizer({}),
                loss_fn=self.task.loss_fn, cache=self.plan_cache)
        except (planner.DoesNotFitError, TypeError, ValueError):
            fusion = None  # e.g. a fake plan in tests, or one member does not fit fused
        if fusion is not None and fusion.width < 2:
            fusion = None
        with self._fusion_lock:
            self._fusion_plans[key] = fusion
        return fusion

    # ------------------------------------------------------------------ loop thread
    def _admit(self, planned: PlannedTrial) -> None:
        """Event: ``planned`` is planned; it waits in the forming buffer (or the queue)."""
        asked = planned.asked
        if not self.fusing or planned.number in self._solo_only:
            self._queue_planned(planned)
            return
        if asked.siblings:
            self._awaiting[asked.number] = self._awaiting.get(asked.number, 0) + asked.siblings
        if asked.siblings or asked.sibling_of is None:
            self._family[asked.number] = asked.number
        else:
            self._family[asked.number] = asked.sibling_of
            if self._awaiting.get(asked.sibling_of, 0) > 0:
                self._awaiting[asked.sibling_of] -= 1
        self.statuses[planned.number].state = "grouping"
        self._show_plan(planned.number, planned.plan)
        # Grouped by the loop's next `_form_groups`, after it has asked for more trials (the
        # members this one may wait for).
        self._forming[planned.number] = planned

    def _form_groups(self) -> None:
        """Hand the groups `form_groups` decides to the scheduling core."""
        if not self.fusing or not self._forming:
            return
        candidates, keys = [], {}
        for number, planned in self._forming.items():
            info = self._member_info.get(number)
            width = info.fusion.width if info is not None and info.fusion is not None else 1
            keys[number] = (None, number) if info is None else (info.signature, info.resume_step)
            candidates.append(FusionCandidate(number, keys[number], planned.arrival, width))
        # Members on their way: siblings not planned yet, or trials of the same architecture
        # being planned (e.g. a resumed group's members). Hold the last group for them, unless
        # nothing could bring them any more (nothing being planned, nothing left to ask or run).
        stalled = not self._planning and (self._exhausted or not (self._runs or self._group_runs))
        planning = {_arch_text(a.params) for a in self._planning.values()}
        expecting = set() if stalled else {
            keys[n] for n, p in self._forming.items()
            if self._awaiting.get(self._family.get(n, n), 0) > 0
            or _arch_text(p.asked.params) in planning}
        for group in form_groups(candidates, expecting=expecting):
            members = tuple(self._forming.pop(n) for n in group)
            info = self._member_info[group[0]] if group[0] in self._member_info else None
            if len(members) == 1 or info is None or info.fusion is None:
                for m in members:
                    self._fusion_of[m.number] = (None, 1)
                    self._queue_planned(m)
                continue
            if len(members) < info.fusion.width:
                future = self._planner.submit(self._narrower_plan, members[0].asked.params,
                                              info, len(members))
                self._sizing[future] = members
                continue
            self._queue_unit(members, info.fusion)

    def _queue_unit(self, members: tuple[PlannedTrial, ...], fusion: FusionPlan) -> None:
        """Event: a group and its plan are decided; the scheduling core gets it as one trial."""
        unit = _Unit(members[0].number, members, fusion)
        self._units[unit.key] = unit
        for m in members:
            self._fusion_of[m.number] = (unit.key, len(members))
            self.statuses[m.number].state = "queued"
        tp = self._unit_plan(unit)
        now = self._now()  # per group: queueing a trial above fed the core a later time
        self._timeline(unit.key).setdefault("planned_at", now)
        self._timeline(unit.key)["plan"] = tp.as_dict()
        self.core.planned(now, tp)
        self._decide(now)

    def _narrower_plan(self, params: Mapping[str, Any], info: _MemberInfo,
                       width: int) -> FusionPlan:
        """(Planner thread.) The group of ``info``'s fused plan at ``width`` members, on the
        same member plan and batch (`_fusion_plan`); the wider plan when that is not exactly
        ``width`` wide (it fits: a narrower group holds less)."""
        assert info.fusion is not None
        narrow = self._fusion_plan(params, info.fusion.plan, info.signature, width)
        return narrow if narrow is not None and narrow.width == width else info.fusion

    def _fusion_waiting(self) -> list[cf.Future]:
        """Planner futures of the fusion service the loop waits on (groups being sized)."""
        return list(self._sizing)

    def _fusion_event(self, future: cf.Future) -> bool:
        """Handle ``future`` if it is the fusion service's; False when it is not."""
        if future not in self._sizing:
            return False
        self._queue_unit(self._sizing.pop(future), future.result())
        return True

    def _unit_plan(self, unit: _Unit) -> TrialPlan:
        """A group as the scheduling core sees it: one trial booking the group's bytes."""
        first = unit.members[0]
        plan = first.plan
        flops = self._flops_of.get((first.number, first.devices, int(plan.batch_size)))
        return TrialPlan(
            key=unit.key, arrival=min(m.arrival for m in unit.members), devices=first.devices,
            bytes_per_device=int(unit.fusion.predicted_peak_bytes or 0),
            steps=self.config.steps_for(int(plan.batch_size)),
            flops_per_step=None if flops is None else flops * len(unit.members),
            data_parallel=int(plan.data_parallel), model_parallel=int(plan.model_parallel),
            batch_size=int(plan.batch_size), grow_bytes=0)

    def _start_group(self, action: Start, now: float) -> None:
        """Start the group ``action.key`` on its placement's devices."""
        unit = self._units.pop(action.key)
        ids = action.device_ids[: unit.members[0].devices]
        fusion = unit.fusion.with_devices([self.devices[i] for i in ids])
        members = []
        for planned in unit.members:
            times = self._timeline(planned.number)
            times.setdefault("started_at", now)
            times["placements"].append([now, list(action.device_ids)])
            self.statuses[planned.number].devices = tuple(action.device_ids)
            self.statuses[planned.number].state = "starting"
            key = planned.asked.checkpoint_key
            members.append(MemberSpec(
                planned.number, planned.asked.params, trial_seed(self.config.seed, key),
                self.checkpoint_root / key if self.checkpoint_root else None))
        self._next_pace.pop(unit.key, None)
        spec = GroupSpec(
            group=unit.key, members=tuple(members), plan=fusion,
            steps=self.config.steps_for(int(fusion.batch_size)),
            memory_per_device=self.config.memory_per_device, booked_bytes=booked_bytes(fusion),
            checkpoint_every=self.config.checkpoint_every, eval_every=self.config.eval_every,
            log_every=self.config.log_every)
        stop = threading.Event()
        statuses = [self.statuses[m.number] for m in unit.members]
        future = self._executor.submit(_run_fused_group, spec, self.space, self.task,
                                       report=self.source.report, statuses=statuses, stop=stop,
                                       cache=self.cache)
        self._group_runs[unit.key] = _GroupRun(unit, stop, future)

    def _group_ended(self, key: int, result: GroupResult) -> None:
        """Event: group ``key``'s run returned; each member is told (or queued again)."""
        run = self._group_runs.pop(key)
        now = self._now()
        self.core.finished(now, key)
        leader = self._timeline(key)
        for planned, r in zip(run.unit.members, result.members, strict=True):
            times = self._timeline(planned.number)
            times["finished_at"] = now
            if planned.number != key:  # the group's scheduling record is the leader's
                times["plan"] = leader.get("plan")
                times["pace"] = leader.get("pace", [])
            self._earlier_wall[planned.number] = (self._earlier_wall.get(planned.number, 0.0)
                                                  + r.wall_seconds)
            if r.state == "oom":  # the group did not fit: its members run alone
                self._solo_only.add(planned.number)
                self._fusion_of[planned.number] = (None, 1)
                self._queue_planned(planned)
                continue
            self._report(planned, r)
        self._decide(now)

    def _fusion_attrs(self, number: int) -> dict[str, Any]:
        """``fused_group`` (group id or None) and ``fusion_width`` of trial ``number``."""
        group, width = self._fusion_of.get(number, (None, 1))
        return {"fused_group": group, "fusion_width": width}

    def fusion_groups(self) -> dict[int, tuple[int, int]]:
        """Trials in fused groups now: ``{number: (group id, width)}`` (for the live view)."""
        return {n: (g, w) for n, (g, w) in self._fusion_of.items() if g is not None}

    def _fusion_pending(self, forming_only: bool = False) -> bool:
        """Whether groups are forming (not yet in the scheduling core) or running."""
        return bool(self._forming or self._sizing or (self._group_runs and not forming_only))

    def _group_futures(self) -> dict[cf.Future, int]:
        return {run.future: key for key, run in self._group_runs.items()}

    def _interrupt_fusion(self) -> None:
        """On an interrupt: stop running groups (they checkpoint) and give every member of a
        running, queued or forming group back to the study."""
        for run in self._group_runs.values():
            run.stop.set()
        for run in self._group_runs.values():
            cf.wait([run.future])
            for planned in run.unit.members:
                self.source.interrupt(planned.number)
        for unit in self._units.values():
            for planned in unit.members:
                self.source.interrupt(planned.number)
        for number in self._forming:
            self.source.interrupt(number)
        for members in self._sizing.values():
            for planned in members:
                self.source.interrupt(planned.number)
