"""Fused groups in the search loop: trials of one architecture trained as one scheduled unit.

`FusionService` is the `scamp_jax.hpo.units.UnitKind` that `scamp_jax.hpo.engine.SearchEngine`
holds when ``EngineConfig.fuse`` is set (it plans through the engine's `PlanningService`). With
it the engine:

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
   waits for them while the study still holds them (``held_siblings``) or they are being
   planned: a sibling that the space rejects, or whose plan fails, is not waited for;
3. hands a group of two or more to the scheduling core as one unit
   (`scamp_jax.hpo.units.GroupUnit`): its key is the group id
   (the smallest member number), its bytes per device the fused plan's predicted peak
   (`scamp_jax.planning.fusion.FusionPlan.predicted_peak_bytes`, never more than the usable bytes)
   at the group's own width: a group narrower than the widest that fits (the last of a family,
   a resumed group) is sized again at its width in a planner thread first (compiled, or from the
   plan cache), so it books what it holds; its FLOPs per step are ``width`` times a member's; a
   group of one is queued as a plain trial (`scamp_jax.hpo.units.SoloUnit`);
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

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scamp_jax._once import OncePerKey
from scamp_jax.hpo.checkpoint import newest_step, recorded_batch, trains_from_start
from scamp_jax.hpo.fused_runner import architecture_signature, signature_key
from scamp_jax.hpo.plan_service import PlanningService
from scamp_jax.hpo.program_key import injected_keys
from scamp_jax.hpo.runner import make_optimizer
from scamp_jax.hpo.study.trials import AskedTrial
from scamp_jax.hpo.trial import PlannedTrial, ending, model_config
from scamp_jax.hpo.trial import fusion_cap as fusion_cap
from scamp_jax.hpo.units import Formed, GroupUnit, SoloUnit, Unit
from scamp_jax.planning import planner
from scamp_jax.planning.fusion import FusionPlan, plan_fusion
from scamp_jax.planning.plan_cache import PlanCacheUnusable
from scamp_jax.scheduling.grouping import FusionCandidate, form_groups

log = logging.getLogger(__name__)


def latest_checkpoint_step(directory: Path | None, batch_size: int | None = None,
                           steps: int | None = None) -> int:
    """The step a trial's checkpoints resume it at, by which the engine groups it: the newest
    checkpointed step of at most ``steps`` (the run's; None: any), as the run resumes it
    (`scamp_jax.hpo.checkpoint.newest_step`); 0: none, or, given the ``batch_size`` it would
    train at, checkpoints of another batch (it trains from the start,
    `scamp_jax.hpo.checkpoint.trains_from_start`)."""
    if directory is None or not directory.is_dir():
        return 0
    if batch_size is not None and trains_from_start(recorded_batch(directory), batch_size):
        return 0
    return newest_step(directory, steps) or 0


@dataclass(frozen=True)
class MemberInfo:
    """What grouping needs of a planned trial (found in a planner thread)."""

    signature: Any
    resume_step: int
    fusion: FusionPlan | None  # None: it cannot be fused (runs alone)


class FusionService:
    """Fused groups for the search loop, the `scamp_jax.hpo.units.UnitKind` with ``fuse`` (see
    the module doc).

    Args:
      space, task: the search space and the task.
      cap: the most members of a group (`scamp_jax.hpo.trial.fusion_cap`).
      planning: the engine's planning service (member plans and their costs).
      checkpoint_root: the per-trial checkpoint directories' root, where a trial's resume step
        is found (None: no checkpoints).
      plan_cache: where fused plans are stored and looked up (None: planned every run).
      held_siblings: ``held_siblings(proposal)``, the siblings of trial ``proposal`` the
        study holds and has not handed out yet (the trial source's
        `scamp_jax.hpo.study.TrialSource.held_siblings`; None: none are ever held); asked
        only for proposals that had siblings, once per family each time groups are formed.
    """

    def __init__(self, space: Any, task: Any, cap: int, planning: PlanningService,
                 checkpoint_root: Path | None = None, plan_cache: Any = None,
                 held_siblings: Callable[[int], int] | None = None) -> None:
        self.space, self.task, self.cap, self.planning = space, task, cap, planning
        self.checkpoint_root, self.plan_cache = checkpoint_root, plan_cache
        self.held_siblings = held_siblings or (lambda proposal: 0)
        self._lock = threading.Lock()
        self._signatures: dict[tuple[tuple[str, str], ...], Any] = {}
        # planner threads with one family's members plan it once
        self._plans: OncePerKey[FusionPlan | None] = OncePerKey()
        self._info: dict[int, MemberInfo] = {}
        self._family_widths: dict[int, int] = {}  # proposed trial -> 1 + its siblings
        self.reset()

    def reset(self) -> None:
        """Forget the grouping state of a previous run (plans stay cached)."""
        self._forming: dict[int, PlannedTrial] = {}  # planned trials waiting for a group
        self._family: dict[int, int] = {}  # trial -> the proposed trial it shares an arch with

    @property
    def forming(self) -> bool:
        """Planned trials wait for their group."""
        return bool(self._forming)

    def family_width(self, asked: Any) -> int | None:
        """(Loop thread, when ``asked`` is asked.) How many trials share its architecture by
        construction: a proposal and the siblings held for it (None: not known, e.g. a retry
        or a sibling of a proposal asked in an earlier run)."""
        with self._lock:
            if asked.siblings:
                self._family_widths[asked.number] = asked.siblings + 1
                return asked.siblings + 1
            if asked.sibling_of is not None:
                return self._family_widths.get(asked.sibling_of)
        return None

    # ------------------------------------------------------------------ planner threads
    def prepare(self, params: Mapping[str, Any], number: int,
                checkpoint_dir: Path | None, width: int | None = None) -> Any:
        """Plan and cost one trial, then find its signature, resume step and fused plan (of at
        most ``width`` members, e.g. its `family_width`; None: the cap).

        The trial's own plan is provisional (the batch cap from shapes, no step compiled,
        `planner.plan_mesh`'s ``provisional``): the fused plan's compiled step checks the fit.
        When two do not fit fused that way, the trial is planned by compiling (run-grade: it
        trains alone) and its group sized again on that plan. A provisional plan that ends up
        training alone (a group of one) is planned again first
        (`scamp_jax.hpo.engine.SearchEngine`); a resumed member that finds its group's plan in
        the plan cache compiles nothing.
        """
        # A family's members train fused: a run-grade solo step would be compiled for nothing
        # when the shapes leave the cap out of reach and the batch is searched.
        plan = self.planning.planned_with_cost(params, number, run_ready=width is None,
                                               provisional=True)
        signature = self.signature(params)
        fusion = self.fusion_plan(params, plan, signature, width)
        if fusion is None and getattr(plan, "provisional", False):
            plan = self.planning.planned_with_cost(params, number)
            fusion = self.fusion_plan(params, plan, signature, width)
        batch = int(plan.batch_size) if fusion is None else fusion.batch_size
        resume = latest_checkpoint_step(checkpoint_dir, batch,
                                        self.planning.config.steps_for(batch))
        info = MemberInfo(signature, resume, fusion)
        with self._lock:
            self._info[number] = info
        return plan

    def signature(self, params: Mapping[str, Any]) -> str:
        """(Any thread.) The key of the fused program ``params`` can join: its architecture's
        signature (`signature_key`, computed once per architecture) and the optimizer
        hyperparameters it sets (`injected_keys`), which a group's members hold as data, so
        every member must set the same ones."""
        arch = model_config(params)
        with self._lock:
            signature = self._signatures.get(arch)
        if signature is None:
            signature = signature_key(architecture_signature(self.space, params))
            with self._lock:
                self._signatures[arch] = signature
        return f"{signature} {','.join(injected_keys(params))}"

    def fusion_plan(self, params: Mapping[str, Any], plan: Any, signature: Any,
                    width: int | None = None) -> FusionPlan | None:
        """The widest group of ``params``'s architecture on ``plan`` (at its batch) of at most
        ``width`` members (None: the cap), cached in memory and in the plan cache; None when
        fewer than two fit."""
        width = self.cap if width is None else min(width, self.cap)
        key = (signature, tuple(d.id for d in plan.devices), int(plan.batch_size), width,
               bool(getattr(plan, "provisional", False)))
        return self._plans.get(key, lambda: self._plan_fusion(params, plan, width))[0]

    def _plan_fusion(self, params: Mapping[str, Any], plan: Any,
                     width: int) -> FusionPlan | None:
        try:
            fusion: FusionPlan | None = plan_fusion(
                self.planning.abstract(params), self.task.sample_batch(1), max_width=width,
                plan=plan, batch_size=int(plan.batch_size), optimizer=make_optimizer(params),
                loss_fn=self.task.loss_fn, cache=self.plan_cache, compile_for_run=True,
                min_width=min(2, width))
        except PlanCacheUnusable:
            raise  # the study's cache, not this group: as a trial's plan would meet it
        except (planner.DoesNotFitError, TypeError, ValueError):
            fusion = None  # e.g. a fake plan in tests, or two members do not fit fused
        except Exception as err:  # noqa: BLE001 - e.g. a compile error: the members train alone
            log.warning("sizing a fused group of %s failed (%s); its trials train alone",
                        dict(params), ending(err)[1])
            fusion = None
        if fusion is not None and fusion.width < 2:
            fusion = None
        return fusion

    def narrower(self, members: tuple[PlannedTrial, ...]) -> FusionPlan:
        """(Planner thread.) The group of ``members`` at its own width, on the same member plan
        and batch as its architecture's widest plan; that wider plan when no plan is exactly
        this wide (it fits: a narrower group holds less)."""
        info = self.info(members[0].number)
        assert info is not None and info.fusion is not None
        narrow = self.fusion_plan(members[0].asked.params, info.fusion.plan, info.signature,
                                  len(members))
        return narrow if narrow is not None and narrow.width == len(members) else info.fusion

    def info(self, number: int) -> MemberInfo | None:
        """What grouping found of trial ``number`` (None: not prepared)."""
        with self._lock:
            return self._info.get(number)

    # ------------------------------------------------------------------ loop thread
    def plan_job(self, asked: AskedTrial) -> Callable[[], Any]:
        """(Loop thread.) The planner thread's job for ``asked``: `prepare` it for a group of
        at most its `family_width`."""
        root = self.checkpoint_root
        return functools.partial(self.prepare, asked.params, asked.number,
                                 root / asked.checkpoint_key if root is not None else None,
                                 self.family_width(asked))

    def admit(self, planned: PlannedTrial, record: Any) -> Unit | None:
        """Event: ``planned`` is planned; it waits in the forming buffer (``record``: its
        `scamp_jax.hpo.record.TrialRecord`), unless its group ran out of memory before."""
        if record.solo_only:
            return SoloUnit(planned)
        record.status.state = "grouping"
        record.show_plan(planned.plan)
        asked = planned.asked
        self._family[asked.number] = asked.number if asked.sibling_of is None \
            else asked.sibling_of
        self._forming[planned.number] = planned
        return None  # grouped by a later `form`, after the loop has asked for more trials

    def form(self, planning: Iterable[Mapping[str, Any]], stalled: bool) -> Formed:
        """Decide the groups of the forming buffer (`form_groups`): trials alone and full
        groups to queue, narrower groups to size at their own width first (`narrower`).

        ``planning``: configurations being planned now (members on their way); ``stalled``:
        nothing could bring more members (nothing being planned, asked or run): the last
        group of each architecture goes as it is.
        """
        formed = Formed()
        if not self._forming:
            return formed
        candidates, keys = [], {}
        for number, planned in self._forming.items():
            info = self.info(number)
            width = info.fusion.width if info is not None and info.fusion is not None else 1
            # Members share the program (its signature sizes the group) and the rest of the
            # configuration (`model_config`): the group builds every member's initial state
            # with one ``build`` of it, which may read any value (an initialisation scale).
            keys[number] = ((None, number) if info is None else
                           (info.signature, model_config(planned.asked.params),
                            info.resume_step))
            candidates.append(FusionCandidate(number, keys[number], planned.arrival, width))
        # Members on their way: trials of the same architecture being planned (siblings
        # asked, a resumed group's members), or siblings the study still holds (not asked
        # yet). Hold the last group for them, unless nothing could bring them any more. A
        # sibling the space rejected, or whose plan failed, is neither.
        archs = {model_config(p) for p in planning}
        held: dict[int, bool] = {}  # proposal with siblings -> whether the study holds any

        def holds(family: int) -> bool:
            if family not in self._family_widths:  # no sibling was ever held for it
                return False
            if family not in held:
                held[family] = self.held_siblings(family) > 0
            return held[family]

        expecting = set() if stalled else {
            keys[n] for n, p in self._forming.items()
            if model_config(p.asked.params) in archs or holds(self._family.get(n, n))}
        groups: list[Unit] = []
        for group in form_groups(candidates, expecting=expecting):
            members = tuple(self._forming.pop(n) for n in group)
            info = self.info(group[0])
            if len(members) == 1 or info is None or info.fusion is None:
                formed.units.extend(SoloUnit(m) for m in members)
            elif len(members) < info.fusion.width:
                # A group narrower than its architecture's plan books what it holds.
                formed.sizing.append((tuple(m.number for m in members),
                                      functools.partial(self._sized, members)))
            else:
                groups.append(GroupUnit(members, info.fusion))
        formed.units.extend(groups)  # after the trials alone, as they were decided
        return formed

    def _sized(self, members: tuple[PlannedTrial, ...]) -> Unit:
        """(Planner thread.) The group of ``members`` on its plan at its own width."""
        return GroupUnit(members, self.narrower(members))

    def waiting(self) -> list[int]:
        """Trials in the forming buffer (given back to the study on an interrupt)."""
        return list(self._forming)

    def view(self, records: Mapping[int, Any]) -> dict[str, Any]:
        """The live view's ``groups``: ``{trial number: (group id, width)}`` of fused trials."""
        return {"groups": {n: (r.group, r.width) for n, r in records.items()
                           if r.group is not None}}
