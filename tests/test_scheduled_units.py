"""The scheduled units of the search loop: a solo trial and a fused group behind one interface.

Contract tests run over both implementations (`SoloUnit`, `GroupUnit`) with the real planner,
real compiles and real runs of `test_runner`'s MLP regression; the work items' order and the
settings a study's devices decide (fusion by default on accelerators) are checked as data.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import threading
from pathlib import Path
from typing import Any

import jax
import pytest
from flax import nnx
from test_runner import SPACE, Regression

from scamp_jax.hpo import work
from scamp_jax.hpo.calibration import Calibration
from scamp_jax.hpo.fused_runner import GroupSpec
from scamp_jax.hpo.launch import Launcher
from scamp_jax.hpo.lifecycle import MemberSpec, Schedule
from scamp_jax.hpo.plan_service import PlanningService
from scamp_jax.hpo.runner import RunSpec, StepCache, make_optimizer
from scamp_jax.hpo.session import fusion_line
from scamp_jax.hpo.settings import EngineConfig, SearchSettings
from scamp_jax.hpo.study.trials import AskedTrial
from scamp_jax.hpo.trial import PlannedTrial, TrialStatus, booked_bytes, trial_seed
from scamp_jax.hpo.units import GroupUnit, SoloUnit
from scamp_jax.planning import planner
from scamp_jax.planning.budget import Budget
from scamp_jax.planning.fusion import plan_fusion

BUDGET = 64 * 2**20
CONFIG = EngineConfig(steps=12, budget=Budget(BUDGET), max_batch_size=16, reference_batch=8,
                      checkpoint_every=6, log_every=3, seed=7)


def _planned(number: int, lr: float, plan: Any, arrival: int | None = None) -> PlannedTrial:
    asked = AskedTrial(number, {"width": 16, "learning_rate": lr}, f"trial_{number}")
    return PlannedTrial(asked, plan, 1, number if arrival is None else arrival)


@functools.cache
def _units() -> tuple[PlanningService, SoloUnit, GroupUnit]:
    """A planning service (may grow: a solo unit offers room), a solo unit and a group of two
    of one architecture, planned and costed for real."""
    task = Regression()
    planning = PlanningService(SPACE, task, CONFIG, jax.devices()[:1], planner.plan_mesh,
                               may_grow=True)
    params = {"width": 16, "learning_rate": 1e-2}
    plan = planning.plan(params)
    for number in (3, 4, 5):
        planning.keep_cost(number, params, plan)
    model = nnx.eval_shape(lambda: SPACE.build(params, nnx.Rngs(0)))
    fusion = plan_fusion(model, task.sample_batch(1), max_width=2, plan=plan,
                         batch_size=int(plan.batch_size), optimizer=make_optimizer(params),
                         loss_fn=task.loss_fn)
    assert fusion.width == 2
    group = GroupUnit((_planned(4, 1e-2, plan, arrival=9), _planned(5, 3e-3, plan, arrival=2)),
                      fusion)
    return planning, SoloUnit(_planned(3, 1e-2, plan)), group


def test_the_core_sees_a_solo_trial_and_a_group_through_one_builder():
    planning, solo, group = _units()
    plan = solo.planned.plan
    mine, theirs = solo.trial_plan(planning), group.trial_plan(planning)
    flops = planning.flops_of(3, plan)
    assert flops
    assert (mine.key, mine.arrival, mine.bytes_per_device) == (3, 3, booked_bytes(plan))
    assert mine.flops_per_step == flops and mine.grow_bytes == int(plan.usable_bytes)
    # A group is one unit keyed by its first member, arriving with its earliest: it books the
    # fused plan, runs its members' FLOPs together and books no room to grow into.
    assert (theirs.key, theirs.arrival) == (4, 2)
    assert theirs.bytes_per_device == booked_bytes(group.fusion) > booked_bytes(plan)
    assert theirs.flops_per_step == 2 * flops and theirs.grow_bytes == 0
    for tp in (mine, theirs):
        assert tp.steps == CONFIG.steps_for(int(plan.batch_size))
        assert (tp.devices, tp.batch_size) == (1, int(plan.batch_size))
    with pytest.raises(AssertionError, match="books no room to grow into"):
        group.grown(plan, 2)


@pytest.mark.parametrize("which", ["solo", "group"])
def test_a_unit_books_the_learned_allowance_or_no_longer_fits(which):
    planning, solo, group = _units()
    unit = solo if which == "solo" else group
    budget = CONFIG.budget_of(jax.devices()[:1])
    before = unit.trial_plan(planning).bytes_per_device
    calibration = Calibration(budget)
    # The allocator measured 4 KiB more than the unit booked: every later booking carries it.
    assert calibration.observe(before + 4096, before, unit.allowance)
    booked = unit.booked_with(calibration)
    assert booked is not None and booked.allowance == unit.allowance + 4096
    assert booked.trial_plan(planning).bytes_per_device == before + 4096
    assert [m.asked for m in booked.members] == [m.asked for m in unit.members]
    assert booked.key == unit.key
    # An excess as large as the usable bytes leaves no room for the unit's own.
    assert calibration.observe(before + budget.usable_bytes, before, unit.allowance)
    assert unit.booked_with(calibration) is None


def test_a_group_keeps_a_member_allowance_larger_than_the_one_learnt():
    """A group whose member plan was made with a larger allowance than the study has learnt
    (given by the user, or read from the plan cache for another kind) is not booked with less,
    as a solo plan is not (tests/test_calibration.py)."""
    _, _, group = _units()
    member = dataclasses.replace(group.fusion.plan, allowance_bytes=4096)
    fusion = dataclasses.replace(group.fusion, plan=member)
    calibration = Calibration(CONFIG.budget_of(jax.devices()[:1]))
    assert calibration.allowance_bytes == 0
    booked = calibration.refresh(fusion)
    assert booked is not None and booked.plan.allowance_bytes == 4096
    assert booked_bytes(booked) == booked_bytes(fusion) == booked_bytes(group.fusion) + 4096


@pytest.mark.parametrize("which", ["solo", "group"])
def test_a_unit_runs_the_schedule_the_study_config_gives(tmp_path, which):
    """Started through the launcher, each unit trains its members for the study's steps at
    their batch, with each member's seed and checkpoint directory from the configuration."""
    planning, solo, group = _units()
    unit = solo if which == "solo" else group
    launcher = Launcher(SPACE, Regression(), CONFIG, jax.devices()[:1], Path(tmp_path),
                        lambda *a: False, StepCache(), workers=1)
    started = []  # the spec the unit's run was started with (what its members train by)
    start = launcher.start

    def recording(fn: Any, spec: Any, *args: Any, **kw: Any) -> Any:
        started.append(spec)
        return start(fn, spec, *args, **kw)

    launcher.start = recording
    statuses = [TrialStatus(m.number, m.asked.params) for m in unit.members]
    run = unit.start(launcher, [0], statuses)
    result = run.future.result()
    launcher.close()
    results = [result] if which == "solo" else list(result.members)
    batch = int(unit.members[0].plan.batch_size)
    steps = CONFIG.steps_for(batch)
    assert (batch, steps) == (16, 6)  # 12 steps of the reference batch of 8
    assert (run.key, run.members) == (unit.key, unit.members)
    [spec] = started
    assert spec.steps == steps
    # Each member as the run got it (a group member with its leader's seed or learning rate
    # would train as another trial).
    ran = list(spec.members) if which == "group" else [
        MemberSpec(spec.number, spec.params, spec.seed, spec.checkpoint_dir)]
    for member, r, got in zip(unit.members, results, ran, strict=True):
        assert (r.number, r.state, r.steps) == (member.number, "complete", steps)
        key = member.asked.checkpoint_key
        assert r.checkpoint is not None and r.checkpoint.parent == Path(tmp_path) / key
        assert got == MemberSpec(member.number, member.asked.params, trial_seed(7, key),
                                 Path(tmp_path) / key)
    assert len({got.seed for got in ran}) == len(ran)  # no two members share a seed


class _AllAtOnce(Regression):
    """Each run's data stream starts only once ``n`` runs are training at once."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.together = threading.Barrier(n, timeout=60)

    def batches(self, batch_size: int, seed: int) -> Any:
        self.together.wait()
        yield from super().batches(batch_size, seed)


def test_a_launcher_runs_every_unit_it_starts_at_once_however_many():
    """Twelve solo trials started on one device all train together (a thread each): a run
    left waiting for a thread would hold its booked devices idle (the scheduling core's
    placements are the only cap)."""
    _, solo, _ = _units()
    n = 12
    launcher = Launcher(SPACE, _AllAtOnce(n), CONFIG, jax.devices()[:1], None,
                        lambda *a: False, StepCache())
    units = [SoloUnit(dataclasses.replace(solo.planned, asked=dataclasses.replace(
        solo.planned.asked, number=i, checkpoint_key=f"trial_{i}"))) for i in range(n)]
    runs = [u.start(launcher, [0], [TrialStatus(i, u.planned.asked.params)])
            for i, u in enumerate(units)]
    results = [run.future.result() for run in runs]
    launcher.close()
    assert [r.state for r in results] == ["complete"] * n, [r.reason for r in results]


def test_a_trial_of_another_batch_checkpoints_and_is_evaluated_after_as_many_samples():
    """``checkpoint_every`` and ``eval_every`` count steps at the reference batch, as
    ``steps`` does: a trial at twice that batch trains half the steps, writes as many
    checkpoints, is evaluated as often, and the pruner hears each evaluation at the reference
    step (trials of any batch compared after as many samples)."""
    config = dataclasses.replace(CONFIG, steps=40, reference_batch=32, checkpoint_every=20,
                                 eval_every=10)
    at_reference = Schedule.of(config, 32, 1)
    assert (at_reference.steps, at_reference.checkpoint_every, at_reference.eval_every) == (
        40, 20, 10)
    double = Schedule.of(config, 64, 1)
    assert (double.steps, double.checkpoint_every, double.eval_every) == (20, 10, 5)
    assert [double.reported_step(d) for d in (5, 10, 15)] == [10, 20, 30]
    assert [at_reference.reported_step(d) for d in (10, 20, 30)] == [10, 20, 30]
    half = Schedule.of(config, 16, 1)
    assert (half.steps, half.checkpoint_every, half.eval_every) == (80, 40, 20)
    assert [d for d in range(1, 81) if half.evaluates_at(d)] == [20, 40, 60]  # not the last
    # where a trial's batch does not divide the interval's samples, each evaluation comes at
    # the first step that has trained them, and the pruner hears the reference step
    odd = Schedule.of(dataclasses.replace(config, eval_every=5), 128, 1)  # 4 reference steps
    assert [d for d in range(1, odd.steps) if odd.evaluates_at(d)] == [2, 3, 4, 5, 7, 8, 9]
    assert [odd.reported_step(d) for d in (2, 3, 4, 5, 7)] == [5, 10, 15, 20, 25]
    assert all(odd.reported_step(d) <= d * 128 // 32 for d in range(1, odd.steps))
    # carried through the specs a run is made from
    _, solo, group = _units()
    member = MemberSpec.of(solo.planned.asked, 7, None)
    assert RunSpec.of(member, solo.planned.plan, double, BUDGET).schedule() == double
    members = tuple(MemberSpec.of(m.asked, 7, None) for m in group.members)
    assert GroupSpec.of(4, members, group.fusion, double, BUDGET).schedule() == double
    # without a reference batch every trial trains the steps and intervals as given
    fixed = Schedule.of(dataclasses.replace(config, reference_batch=None), 64, 1)
    assert (fixed.steps, fixed.checkpoint_every, fixed.eval_every) == (40, 20, 10)
    assert fixed.reported_step(10) == 10


def test_run_specs_carry_the_one_schedule_and_member_they_are_built_from():
    _, solo, group = _units()
    plan = solo.planned.plan
    schedule = Schedule.of(CONFIG, int(plan.batch_size), 12345)
    assert schedule == Schedule(CONFIG.steps_for(int(plan.batch_size)), 12345,
                                CONFIG.interval_for(6, int(plan.batch_size)), 0, 3)
    member = MemberSpec.of(solo.planned.asked, 7, None)
    spec = RunSpec.of(member, plan, schedule, BUDGET)
    assert (spec.member(), spec.schedule(), spec.share_bytes()) == (member, schedule, 12345)
    members = tuple(MemberSpec.of(m.asked, 7, None) for m in group.members)
    gspec = GroupSpec.of(4, members, group.fusion, schedule, BUDGET)
    assert (gspec.members, gspec.schedule()) == (members, schedule)


def test_work_done_at_once_is_handled_plans_first_then_runs():
    def done(future: cf.Future) -> None:
        pass

    items = [work.running(2, done), work.sizing((5, 6), done), work.verifying(4, done),
             work.option(1, done), work.planning(8, {}, done), work.planning(3, {}, done),
             work.replanning(0, done)]
    ordered = sorted(items, key=work.Work.order)
    assert [(w.stage, w.key) for w in ordered] == [
        (work.PLAN, 3), (work.PLAN, 8), (work.OPTION, 1), (work.REPLAN, 0), (work.REPLAN, 4),
        (work.RUN, -1), (work.RUN, 2)]
    # What counts against the lookahead, what holds the last wave, what goes back to the study.
    assert [w.arriving for w in items] == [False, False, False, False, True, True, True]
    assert [w.pending for w in items] == [False, True, True, False, True, True, True]
    assert [w.trials for w in items] == [(), (5, 6), (4,), (), (8,), (3,), (0,)]


# ---------------------------------------------------------- settings the devices decide


def _settings(**kw: Any) -> SearchSettings:
    return SearchSettings(trials=16, steps=10, sampler="random", **kw)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_trials_fuse_by_default_on_accelerators_and_say_why(platform):
    requested = _settings()
    settings = requested.on_platform(platform)
    assert settings.fuse == "auto"
    assert settings.source_kwargs()["siblings"] == 7  # a proposal's family fills a group
    line = fusion_line(requested, settings, platform)
    assert line is not None and "by default on " + platform in line
    assert "one compute stream" in line and "--fuse 1" in line


def test_cpu_devices_and_the_users_choice_keep_their_fusion_setting():
    requested = _settings()
    assert requested.on_platform("cpu") is requested and requested.fuse is None
    assert fusion_line(requested, requested, "cpu") is None  # the CPU default says nothing
    off = _settings(fuse=1)
    assert off.on_platform("gpu").fuse == 1 and off.on_platform("gpu").source_kwargs() == {}
    assert fusion_line(off, off, "gpu") == ("fusion: off (fuse=1): a gpu device runs one "
                                            "compute stream, so trials packed side by side on "
                                            "one take turns")
    four = _settings(fuse=4)
    assert four.on_platform("gpu").fuse == 4
    assert fusion_line(four, four, "cpu").endswith(
        "group of up to 4 on their plan's devices (fuse=4)")
    grid = dataclasses.replace(_settings(), sampler="grid")
    assert grid.on_platform("gpu").fuse is None  # siblings leave parameters the grid sets
    assert "the grid sampler" in fusion_line(grid, grid.on_platform("gpu"), "gpu")
