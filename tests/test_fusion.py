"""Horizontal fusion: a fused member trains as its solo run (to `RTOL`); groups sized by compiling.

The solo reference is the project's own trial runner (`scamp_jax.hpo.runner.run_trial`) on the same
member plan; the candidates are `test_runner`'s MLP regression (and a small ViT).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

import jax
import pytest
from flax import nnx
from test_runner import BUDGET, SPACE, Regression, make_plan

from scamp_jax.hpo.checkpoint import TrialCheckpointer
from scamp_jax.hpo.fused_engine import latest_checkpoint_step
from scamp_jax.hpo.fused_runner import GroupSpec, MemberSpec, run_fused_group
from scamp_jax.hpo.lifecycle import resumable_step
from scamp_jax.hpo.overhead import TRACE_EVENT
from scamp_jax.hpo.runner import RunSpec, StepCache, TrialStatus, make_optimizer, run_trial
from scamp_jax.planning import planner
from scamp_jax.planning.fusion import (
    FusedStepCompiler,
    FusionPlan,
    group_held_bytes,
    plan_fusion,
)
from scamp_jax.planning.plan_cache import PlanCache

#: relative tolerance of fused against solo (loss curve and held-out score): the fused step
#: reassociates float32 sums, so the bits differ (measured worst: about 1e-6).
RTOL = 1e-5


@dataclass
class RecordingStatus(TrialStatus):
    """A `TrialStatus` that keeps every loss the runner writes (the solo loss curve)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "curve", [])

    def __setattr__(self, name: str, value: Any) -> None:
        # The runner writes the step's loss, then the step: record the pair at the step.
        if name == "step" and value > 0 and getattr(self, "state", "") == "training":
            self.curve.append((int(value), float(self.loss)))
        object.__setattr__(self, name, value)


def group_plan(plan: Any, width: int) -> FusionPlan:
    """A fused plan of ``width`` members at ``plan``'s batch, sized by the real planner."""
    key = (len(plan.devices), plan.batch_size, width)
    if key not in _PLANS:
        _PLANS[key] = _group_plan(plan, width)
    return _PLANS[key].with_devices(plan.devices)


_PLANS: dict[tuple[int, int, int], FusionPlan] = {}


def _group_plan(plan: Any, width: int) -> FusionPlan:
    model = nnx.eval_shape(lambda: SPACE.build({"width": 16}, nnx.Rngs(0)))
    return plan_fusion(model, Regression().sample_batch(1), max_width=width, plan=plan,
                       batch_size=plan.batch_size, optimizer=make_optimizer({}),
                       loss_fn=Regression().loss_fn)


def solo(config: dict[str, Any], seed: int, plan: Any, steps: int, cache: StepCache,
         **kw: Any) -> tuple[Any, list[tuple[int, float]]]:
    status = RecordingStatus(0, config)
    spec = RunSpec(number=0, params=config, plan=plan, steps=steps, memory_per_device=BUDGET,
                   seed=seed, log_every=1, **kw)
    result = run_trial(spec, SPACE, Regression(), status=status, cache=cache)
    assert result.state == "complete", result.reason
    return result, status.curve


def _raw(x: Any) -> Any:
    """An array's values as NumPy; a typed PRNG key's key data."""
    import numpy as np

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


MEMBERS = [({"width": 16, "learning_rate": lr}, seed)
           for lr, seed in ((1e-3, 11), (3e-3, 22), (1e-2, 33), (3e-2, 44))]


@pytest.mark.parametrize("at_once", [False, True], ids=["data in turn", "data at once"])
def test_fused_members_match_their_solo_runs(at_once: bool, monkeypatch: pytest.MonkeyPatch):
    """Four members (different learning rates and seeds) follow their solo runs step by step,
    their batches drawn in turn or at once on the data threads (`member_streams`)."""
    from scamp_jax.hpo import member_streams

    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0 if at_once else 60.0)
    handed: list[int] = []  # members' draws made on the data threads
    fill = member_streams.StackedStreams._fill
    monkeypatch.setattr(member_streams.StackedStreams, "_fill",
                        lambda self, slot, out: (handed.append(slot), fill(self, slot, out)))
    steps = 40
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    gplan = group_plan(plan, 4)
    assert gplan.width == 4 and gplan.batch_size == plan.batch_size
    members = tuple(MemberSpec(i, cfg, seed) for i, (cfg, seed) in enumerate(MEMBERS))
    group = run_fused_group(GroupSpec(7, members, gplan, steps, BUDGET, log_every=1),
                            SPACE, Regression())
    assert bool(handed) == at_once
    cache = StepCache()
    worst = 0.0
    for i, (cfg, seed) in enumerate(MEMBERS):
        ref, curve = solo(cfg, seed, plan, steps, cache)
        fused = group.members[i]
        assert fused.state == "complete", fused.reason
        assert [s for s, _ in group.losses[i]] == [s for s, _ in curve] == list(range(1, steps + 1))
        for (_, a), (_, b) in zip(group.losses[i], curve, strict=True):
            worst = max(worst, rel(a, b))
            assert rel(a, b) <= RTOL, (i, a, b)
        assert rel(fused.metrics["mse"], ref.metrics["mse"]) <= RTOL
        worst = max(worst, rel(fused.metrics["mse"], ref.metrics["mse"]))
    print(f"max relative difference fused vs solo: {worst:.3g}")
    # Different learning rates and seeds really train differently.
    finals = [r.metrics["mse"] for r in group.members]
    assert len({round(v, 6) for v in finals}) == 4
    assert group.widths == (4,)
    records = group.records()
    assert {r["fused_group"] for r in records} == {7} and records[0]["fusion_width"] == 4


def test_a_pruned_member_stops_and_the_others_match_their_solo_runs(tmp_path):
    """Pruning one member at an evaluation freezes it; the group re-forms without it."""
    steps, every = 30, 10
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = tuple(MemberSpec(10 + i, cfg, seed, checkpoint_dir=tmp_path / f"m{i}")
                    for i, (cfg, seed) in enumerate(MEMBERS[:3]))
    reports: list[tuple[int, int]] = []

    def report(number: int, step: int, value: float) -> bool:
        reports.append((number, step))
        return number == 11 and step == every

    group = run_fused_group(
        GroupSpec(1, members, group_plan(plan, 4), steps, BUDGET, eval_every=every,
                  checkpoint_every=every, log_every=5),
        SPACE, Regression(), report=report, results_path=tmp_path / "group.json")
    states = [r.state for r in group.members]
    assert states == ["complete", "pruned", "complete"], [r.reason for r in group.members]
    assert group.members[1].steps == every
    assert group.widths == (3, 2)  # re-formed without the pruned member
    assert (11, 2 * every) not in reports and (10, 2 * every) in reports
    cache = StepCache()
    for i in (0, 2):
        ref, _ = solo(dict(MEMBERS[i][0]), MEMBERS[i][1], plan, steps, cache)
        assert rel(group.members[i].metrics["mse"], ref.metrics["mse"]) <= RTOL
    # As in a solo run, a member pruned at an evaluation does not save that step.
    saved = {i: sorted(int(p.name) for p in (tmp_path / f"m{i}").iterdir() if p.name.isdigit())
             for i in range(3)}
    assert saved == {0: [20, 30], 1: [], 2: [20, 30]}
    assert (tmp_path / "group.json").is_file()


def test_without_reform_a_pruned_member_stays_masked_and_the_group_keeps_its_width():
    """``reform=False``: a member pruned at an evaluation is only masked (its losses stop
    there); the group keeps its width, compiling no narrower step, and the others train on
    as their solo runs."""
    steps, every = 20, 10
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = tuple(MemberSpec(10 + i, cfg, seed) for i, (cfg, seed) in enumerate(MEMBERS[:3]))
    group = run_fused_group(
        GroupSpec(1, members, group_plan(plan, 4), steps, BUDGET, eval_every=every,
                  log_every=5, reform=False),
        SPACE, Regression(), report=lambda number, step, value: number == 11 and step == every)
    assert [r.state for r in group.members] == ["complete", "pruned", "complete"], [
        r.reason for r in group.members]
    assert group.widths == (3,)  # masked, never re-formed
    assert [s for s, _ in group.losses[1]] == [5, 10]
    assert [s for s, _ in group.losses[0]] == [5, 10, 15, 20]
    cache = StepCache()
    for i in (0, 2):
        ref, _ = solo(dict(MEMBERS[i][0]), MEMBERS[i][1], plan, steps, cache)
        assert rel(group.members[i].metrics["mse"], ref.metrics["mse"]) <= RTOL


def test_a_checkpoint_at_the_step_a_group_re_forms_holds_each_members_own_state(tmp_path):
    """A member pruned at an evaluation that is also a checkpoint step: the group re-forms
    without it, then saves; each member's checkpoint of that step holds its own state (its
    solo run's checkpoint of that step), not the slot's it had before the re-form."""
    from scamp_jax.hpo.runner import load_model

    steps, every = 10, 5
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = tuple(MemberSpec(10 + i, cfg, seed, checkpoint_dir=tmp_path / f"m{i}")
                    for i, (cfg, seed) in enumerate(MEMBERS[:3]))
    group = run_fused_group(
        GroupSpec(1, members, group_plan(plan, 4), steps, BUDGET, eval_every=every,
                  checkpoint_every=every, log_every=5),
        SPACE, Regression(), report=lambda number, step, value: number == 11 and step == every)
    assert [r.state for r in group.members] == ["complete", "pruned", "complete"]
    assert group.widths == (3, 2)
    cache = StepCache()
    for i in (0, 2):
        config, seed = dict(MEMBERS[i][0]), MEMBERS[i][1]
        solo(config, seed, plan, steps, cache, checkpoint_dir=tmp_path / f"solo{i}",
             checkpoint_every=every)
        fused = Regression().evaluate(load_model(tmp_path / f"m{i}" / str(every), SPACE, config))
        alone = Regression().evaluate(load_model(tmp_path / f"solo{i}" / str(every), SPACE,
                                                 config))
        assert rel(fused["mse"], alone["mse"]) <= RTOL, (i, fused, alone)


class DataFailsFor(Regression):
    """`Regression` whose stream of seed ``seed`` raises when it is asked for batch ``at``
    (counted from 0: the batch of step ``at + 1``)."""

    def __init__(self, seed: int, at: int) -> None:
        super().__init__()
        self.bad_seed, self.at = seed, at

    def batches(self, batch_size: int, seed: int):
        for drawn, batch in enumerate(super().batches(batch_size, seed)):
            if seed == self.bad_seed and drawn == self.at:
                raise OSError(f"the data of seed {seed} cannot be read")
            yield batch


@pytest.mark.parametrize("at_once", [False, True], ids=["data in turn", "data at once"])
def test_a_member_whose_data_fails_fails_alone_and_the_others_match_their_solo_runs(
        at_once: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One member's stream raising mid-run ends that member ``failed`` with its error, as its
    solo run would end; its siblings train on with their own batches, re-form without it at
    the next evaluation, and end as their solo runs do."""
    from scamp_jax.hpo import member_streams

    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0 if at_once else 60.0)
    steps, every, at = 20, 10, 7
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = tuple(MemberSpec(20 + i, cfg, seed) for i, (cfg, seed) in enumerate(MEMBERS[:3]))
    task = DataFailsFor(MEMBERS[1][1], at)
    statuses = [TrialStatus(m.number, m.params) for m in members]
    group = run_fused_group(
        GroupSpec(2, members, group_plan(plan, 4), steps, BUDGET, eval_every=every,
                  log_every=1), SPACE, task, statuses=statuses)
    states = [r.state for r in group.members]
    assert states == ["complete", "failed", "complete"], [r.reason for r in group.members]
    broken = group.members[1]
    assert "cannot be read" in broken.reason and "OSError" in broken.traceback
    # as its solo run ends: the draw for step ``at + 1`` fails, with the same steps told
    alone = run_trial(RunSpec(number=0, params=MEMBERS[1][0], plan=plan, steps=steps,
                              memory_per_device=BUDGET, seed=MEMBERS[1][1], log_every=1),
                      SPACE, task, cache=StepCache())
    assert alone.state == "failed" and alone.reason == broken.reason
    assert broken.steps == alone.steps > 0
    assert group.widths == (3, 2)  # re-formed without it at the evaluation
    cache = StepCache()
    for i in (0, 2):
        ref, curve = solo(dict(MEMBERS[i][0]), MEMBERS[i][1], plan, steps, cache)
        assert [s for s, _ in group.losses[i]] == [s for s, _ in curve]
        for (_, a), (_, b) in zip(group.losses[i], curve, strict=True):
            assert rel(a, b) <= RTOL
        assert rel(group.members[i].metrics["mse"], ref.metrics["mse"]) <= RTOL


def test_a_resumed_member_whose_data_fails_as_it_is_advanced_fails_alone(tmp_path):
    """A group stopped at step 8 resumes: each member's stream is advanced to step 8 first,
    and member 1's fails on the way (its data gone meanwhile). That member fails alone, as its
    solo run would; its siblings resume and finish."""
    steps = 20
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = tuple(MemberSpec(i, cfg, seed, checkpoint_dir=tmp_path / f"m{i}")
                    for i, (cfg, seed) in enumerate(MEMBERS[:3]))
    spec = GroupSpec(2, members, group_plan(plan, 4), steps, BUDGET, log_every=1)
    stop = threading.Event()

    def stop_at_step_8(number: int, step: int, loss: float) -> None:
        if step == 8:
            stop.set()

    first = run_fused_group(spec, SPACE, Regression(), stop=stop, on_loss=stop_at_step_8)
    assert [r.state for r in first.members] == ["interrupted"] * 3
    again = run_fused_group(spec, SPACE, DataFailsFor(MEMBERS[1][1], 5))
    assert [r.state for r in again.members] == ["complete", "failed", "complete"], [
        r.reason for r in again.members]
    assert "cannot be read" in again.members[1].reason


def test_member_checkpoint_resumes_solo_and_in_a_group(tmp_path):
    """A member's checkpoint is its solo run's: an interrupted group resumes to the same end."""
    steps = 20
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = tuple(MemberSpec(i, cfg, seed, checkpoint_dir=tmp_path / f"m{i}")
                    for i, (cfg, seed) in enumerate(MEMBERS[:2]))
    stop = threading.Event()
    gspec = GroupSpec(2, members, group_plan(plan, 4), steps, BUDGET, log_every=1)
    seen: list[int] = []

    def on_loss(number: int, step: int, loss: float) -> None:
        seen.append(step)
        if step == 8:
            stop.set()

    first = run_fused_group(gspec, SPACE, Regression(), stop=stop, on_loss=on_loss)
    assert [r.state for r in first.members] == ["interrupted"] * 2
    again = run_fused_group(gspec, SPACE, Regression())
    assert [r.resumed_from for r in again.members] == [8, 8]
    cache = StepCache()
    for i, (cfg, seed) in enumerate(MEMBERS[:2]):
        ref, _ = solo(cfg, seed, plan, steps, cache)
        assert rel(again.members[i].metrics["mse"], ref.metrics["mse"]) <= RTOL
    # Solo resume from a member's checkpoint (the same leaves the solo runner saves).
    resumed = run_trial(RunSpec(0, MEMBERS[0][0], plan, steps + 5, BUDGET, seed=MEMBERS[0][1],
                                checkpoint_dir=tmp_path / "m0"), SPACE, Regression(),
                        cache=cache)
    assert resumed.state == "complete" and resumed.resumed_from == steps


def test_a_member_stopped_before_its_first_step_groups_with_one_never_run(tmp_path):
    """A run stopped before its first step (a Ctrl-C while it compiled) checkpoints step 0,
    the initial state: it resumes in a group with a member that has no checkpoint, both from
    step 0, as the engine groups them (`latest_checkpoint_step` says 0 for both)."""
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    (cfg0, seed0), (cfg1, seed1) = MEMBERS[:2]
    stop = threading.Event()
    stop.set()
    first = run_trial(RunSpec(0, cfg0, plan, 10, BUDGET, seed=seed0,
                              checkpoint_dir=tmp_path / "m0"), SPACE, Regression(), stop=stop)
    assert first.state == "interrupted" and (tmp_path / "m0" / "0").is_dir()
    assert latest_checkpoint_step(tmp_path / "m0") == latest_checkpoint_step(tmp_path / "m1")
    members = (MemberSpec(0, cfg0, seed0, checkpoint_dir=tmp_path / "m0"),
               MemberSpec(1, cfg1, seed1, checkpoint_dir=tmp_path / "m1"))
    group = run_fused_group(GroupSpec(0, members, group_plan(plan, 4), 10, BUDGET), SPACE,
                            Regression())
    assert [(r.state, r.resumed_from) for r in group.members] == [("complete", 0)] * 2, [
        r.reason for r in group.members]


def test_a_member_is_grouped_by_the_step_its_run_resumes_at_not_its_newest(tmp_path):
    """A rerun with fewer steps than its trials' checkpoints (a smaller --steps): each resumes
    at its newest checkpoint of at most the run's steps, and the engine groups it by that step
    (two members whose newest is step 8 but who resume at 4 and 5 are not one group)."""
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    for number, every in ((0, 4), (1, 5)):
        cfg, seed = MEMBERS[number]
        stop = threading.Event()

        def halt(_: int, step: int, __: float, stop: threading.Event = stop) -> None:
            if step == 8:
                stop.set()

        run = run_trial(RunSpec(number, cfg, plan, 20, BUDGET, seed=seed, log_every=1,
                                checkpoint_every=every, checkpoint_dir=tmp_path / f"m{number}"),
                        SPACE, Regression(), stop=stop, on_loss=halt)
        assert run.state == "interrupted" and run.steps == 8, run.reason
    for number, resumes in ((0, 4), (1, 5)):
        directory = tmp_path / f"m{number}"
        assert latest_checkpoint_step(directory, 16) == 8  # any run's steps
        assert resumable_step(TrialCheckpointer(directory), 6) == resumes
        assert latest_checkpoint_step(directory, 16, steps=6) == resumes


def test_a_member_whose_checkpoints_are_of_another_batch_groups_as_one_never_run(tmp_path):
    """Checkpoints trained at another batch are set aside (the trial trains from the start):
    the engine keys such a member by step 0 (`latest_checkpoint_step` at the group's batch),
    so it groups with members that start there, not with those resuming at its old step."""
    wide = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    narrow = make_plan({"width": 16}, jax.devices()[:1], max_batch=8)
    assert (wide.batch_size, narrow.batch_size) == (16, 8)
    (cfg0, seed0), (cfg1, seed1), (cfg2, seed2) = MEMBERS[:3]
    for number, cfg, seed, plan in ((0, cfg0, seed0, wide), (1, cfg1, seed1, narrow)):
        stop = threading.Event()

        def halt(_: int, step: int, __: float, stop: threading.Event = stop) -> None:
            if step == 4:
                stop.set()

        run = run_trial(RunSpec(number, cfg, plan, 10, BUDGET, seed=seed, log_every=1,
                                checkpoint_dir=tmp_path / f"m{number}"), SPACE, Regression(),
                        stop=stop, on_loss=halt)
        assert run.state == "interrupted" and run.steps == 4, run.reason
    resume = {n: latest_checkpoint_step(tmp_path / f"m{n}", 16) for n in range(3)}
    assert resume == {0: 4, 1: 0, 2: 0}
    members = (MemberSpec(1, cfg1, seed1, checkpoint_dir=tmp_path / "m1"),
               MemberSpec(2, cfg2, seed2, checkpoint_dir=tmp_path / "m2"))
    group = run_fused_group(GroupSpec(0, members, group_plan(wide, 4), 10, BUDGET), SPACE,
                            Regression())
    assert [(r.state, r.resumed_from) for r in group.members] == [("complete", 0)] * 2, [
        r.reason for r in group.members]


@pytest.mark.parametrize("other", [{"width": 32}, {"width": 16, "init_scale": 3.0}])
def test_members_of_another_configuration_are_refused(other):
    """A group builds its members with one configuration: members that differ but for their
    optimizer hyperparameters (another architecture, or a value only ``build`` reads) fail,
    naming the key, rather than train as the first member's model."""
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = (MemberSpec(0, {"width": 16, "learning_rate": 1e-2}),
               MemberSpec(1, {**other, "learning_rate": 2e-2}))
    group = run_fused_group(GroupSpec(0, members, group_plan(plan, 4), 5, BUDGET), SPACE,
                            Regression())
    assert [r.state for r in group.members] == ["failed"] * 2
    key = "width" if other["width"] != 16 else "init_scale"
    assert f"differs from trial 0 ({{'width': 16, 'learning_rate': 0.01}}) in {key}; a fused " \
        "group holds trials of one configuration" in group.members[0].reason


def test_a_diverging_member_fails_alone():
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = (MemberSpec(0, {"width": 16, "learning_rate": 1e-2}, 1),
               MemberSpec(1, {"width": 16, "learning_rate": 1e30}, 2))
    group = run_fused_group(GroupSpec(0, members, group_plan(plan, 4), 30, BUDGET, log_every=1),
                            SPACE, Regression())
    assert group.members[0].state == "complete", group.members[0].reason
    assert group.members[1].state == "failed" and "loss is" in group.members[1].reason


def _member_of_width_64() -> tuple[Any, Regression, dict[str, Any], Any, int, int]:
    """A width-64 member on one device at batch 256: ``(model, task, kw, member plan, fused
    peak of 1 member, of 2)``, the peaks compiled."""
    model = nnx.eval_shape(lambda: SPACE.build({"width": 64}, nnx.Rngs(0)))
    task = Regression()
    kw = {"optimizer": make_optimizer({}), "loss_fn": task.loss_fn}
    member = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                               memory_per_device=BUDGET, max_batch_size=256, **kw)
    compiler = FusedStepCompiler(model, task.sample_batch(1), member, **kw)
    one, two = compiler.estimate(1, 256).peak, compiler.estimate(2, 256).peak
    return model, task, kw, member, one, two


def test_a_budget_with_its_own_margin_plans_a_group_as_it_plans_a_member():
    # plan_fusion passed a margin of 0.1 on, and refused every Budget of another one
    from scamp_jax.planning.budget import Budget, parse_bytes

    model, task, kw, _, _, _ = _member_of_width_64()
    budget = Budget(parse_bytes(BUDGET), safety_margin=0.2)
    group = plan_fusion(model, task.sample_batch(1), max_width=2, devices=jax.devices()[:1],
                        memory_per_device=budget, max_batch_size=64, **kw)
    assert group.plan.usable_bytes == budget.usable_bytes
    with pytest.raises(ValueError, match="differs from the budget's 0.2"):
        plan_fusion(model, task.sample_batch(1), max_width=2, devices=jax.devices()[:1],
                    memory_per_device=budget, safety_margin=0.1, max_batch_size=64, **kw)


@pytest.mark.parametrize("members, width", [(2.5, 2), (5.5, 5), (11.5, None)])
def test_width_is_the_widest_that_fits_by_compiled_memory(members: float, width: int | None):
    """The planner's width: the fused step fits at it (compiled) and not at one more member;
    the first width tried is the line through the solo plan and the cap, so the search costs
    the cap, that width and one more member."""
    model, task, kw, member, one, two = _member_of_width_64()
    per_member = two - one
    assert per_member > 0
    # A budget for about ``members`` members: the planner must find ``width`` of at most 16
    # (wide groups hold a little more than the line through one and two members says).
    budget = int((one + (members - 1) * per_member) / 0.9)
    member = dataclasses.replace(member, memory_per_device=budget)
    fp = plan_fusion(model, task.sample_batch(1), max_width=16, plan=member, batch_size=256, **kw)
    peaks = {(k, b): p for k, b, p in fp.compiled_peaks}
    assert fp.predicted_peak_bytes <= fp.usable_bytes
    # one more member is over: what the group would hold (the step, prefetched batches, an
    # evaluation beside the stacked state), compiled again here
    wider = FusedStepCompiler(model, task.sample_batch(1), member, **kw).estimate(fp.width + 1, 256)
    assert wider.peak == peaks[(fp.width + 1, 256)]
    assert group_held_bytes(wider, member, fp.width + 1, 256) > fp.usable_bytes
    if width is not None:
        assert fp.width == width
    # the cap first, then never one member alone: the line's width and one more, where it
    # lands (3 compiles here), one more where the line misses by one
    assert next(iter(peaks)) == (16, 256) and (1, 256) not in peaks
    assert fp.compiles <= 4


def test_a_narrower_group_kept_for_its_run_costs_no_compile_more():
    """As a study plans it (``compile_for_run``, the trial's batch): the width the line
    predicts is compiled as the run compiles it, so the group's executable is that compile."""
    model, task, kw, member, one, two = _member_of_width_64()
    budget = int((one + 4.5 * (two - one)) / 0.9)
    member = dataclasses.replace(member, memory_per_device=budget)
    fp = plan_fusion(model, task.sample_batch(1), max_width=16, plan=member, batch_size=256,
                     compile_for_run=True, **kw)
    assert fp.width == 5 and fp.compiled_step is not None
    assert fp.compiles <= 4  # the cap, the width, one more member (before: 6 with the run's)


def test_a_group_of_one_member_that_does_not_fit_says_so():
    """A budget below one fused member: a clear error with what one member needs."""
    model, task, kw, member, one, _ = _member_of_width_64()
    member = dataclasses.replace(member, memory_per_device=int(0.8 * one / 0.9))
    with pytest.raises(planner.DoesNotFitError, match="one fused member needs") as err:
        plan_fusion(model, task.sample_batch(1), max_width=4, plan=member, batch_size=256, **kw)
    assert err.value.bytes_needed >= one > err.value.bytes_available


def test_a_batch_above_the_member_plan_says_whether_memory_or_its_cap_stops_it():
    """A fixed batch the member plan did not reach: where memory stops it, the error says
    what that batch needs (above what is usable); where the plan's own max_batch_size did,
    it says to plan the member for that batch instead (passing no plan does: with a batch,
    the member is planned at that batch)."""
    model, task, kw, member, _, _ = _member_of_width_64()
    with pytest.raises(ValueError, match=r"batch_size=512 is above the member plan's batch "
                       r"256, which stopped below what memory allows \(at its max_batch_size "
                       r"or batch_multiple.*pass no plan to plan the member at 512") as e:
        plan_fusion(model, task.sample_batch(1), max_width=2, plan=member, batch_size=512, **kw)
    assert not isinstance(e.value, planner.DoesNotFitError)
    tight = dataclasses.replace(
        member, memory_per_device=int(member.memory_model.predict(384) / 0.9))
    with pytest.raises(planner.DoesNotFitError, match="a single member needs more") as err:
        plan_fusion(model, task.sample_batch(1), max_width=2, plan=tight, batch_size=512, **kw)
    assert err.value.bytes_needed == (member.memory_model.predict(512)
                                      + 2 * member.prefetch_bytes + member.allowance_bytes)
    assert err.value.bytes_needed > err.value.bytes_available == tight.usable_bytes


def test_a_study_asks_for_two_members_at_least_and_never_compiles_one():
    """``min_width=2`` (a study's: one member trains alone): a budget for one and a half
    members is a clear error after the cap and two members, one member never compiled."""
    model, task, kw, member, one, two = _member_of_width_64()
    member = dataclasses.replace(member, memory_per_device=int((one + 0.5 * (two - one)) / 0.9))
    compiled = []
    original = FusedStepCompiler.estimate

    def estimate(self: FusedStepCompiler, width: int, batch: int, run_grade: bool = False):
        compiled.append(width)
        return original(self, width, batch, run_grade)

    with pytest.MonkeyPatch.context() as patch, \
            pytest.raises(planner.DoesNotFitError, match="a fused group of 2 members needs"):
        patch.setattr(FusedStepCompiler, "estimate", estimate)
        plan_fusion(model, task.sample_batch(1), max_width=8, plan=member, batch_size=256,
                    min_width=2, **kw)
    assert sorted(set(compiled)) == [2, 8]
    with pytest.raises(ValueError, match="min_width"):
        plan_fusion(model, task.sample_batch(1), max_width=2, plan=member, batch_size=256,
                    min_width=3, **kw)


def test_batch_is_sized_after_the_width():
    model = nnx.eval_shape(lambda: SPACE.build({"width": 64}, nnx.Rngs(0)))
    task = Regression()
    kw = {"optimizer": make_optimizer({}), "loss_fn": task.loss_fn}
    fp = plan_fusion(model, task.sample_batch(1), max_width=4, devices=jax.devices()[:1],
                     memory_per_device=BUDGET, max_batch_size=512, **kw)
    assert fp.width == 4 and fp.batch_size == 512  # the generous budget fits the caps
    assert fp.compiles == 2  # the width cap, then the batch cap: both fit at once


def test_bad_width_is_refused():
    model = nnx.eval_shape(lambda: SPACE.build({"width": 16}, nnx.Rngs(0)))
    with pytest.raises(ValueError, match="max_width=0 must be a positive int"):
        plan_fusion(model, Regression().sample_batch(1), max_width=0, devices=1,
                    memory_per_device=BUDGET)


@pytest.mark.slow  # ViT compiles: about a minute on 2 free cores, several on a busy machine
def test_vit_members_match_their_solo_runs():
    """A small ViT group of two (different learning rates and seeds) against its solo runs."""
    from search_spaces import vit

    space, task = vit.space("small"), vit.SyntheticClassification(eval_size=64)
    arch = {"patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2, "mlp_ratio": 2.0}
    configs = [({**arch, "learning_rate": 1e-3}, 5), ({**arch, "learning_rate": 3e-3}, 6)]
    model = nnx.eval_shape(lambda: space.build(arch, nnx.Rngs(0)))
    kw = {"optimizer": make_optimizer({}), "loss_fn": task.loss_fn}
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                             memory_per_device=BUDGET, max_batch_size=8, **kw)
    gplan = plan_fusion(model, task.sample_batch(1), max_width=2, plan=plan, batch_size=8, **kw)
    steps = 6
    group = run_fused_group(
        GroupSpec(0, tuple(MemberSpec(i, c, s) for i, (c, s) in enumerate(configs)), gplan,
                  steps, BUDGET, log_every=1), space, task)
    cache = StepCache()
    for i, (cfg, seed) in enumerate(configs):
        status = RecordingStatus(i, cfg)
        ref = run_trial(RunSpec(i, cfg, plan, steps, BUDGET, seed=seed, log_every=1), space,
                        task, status=status, cache=cache)
        member = group.members[i]
        assert ref.state == member.state == "complete", (ref.reason, member.reason)
        for (_, a), (_, b) in zip(group.losses[i], status.curve, strict=True):
            assert rel(a, b) <= RTOL, (i, a, b)
        assert rel(member.metrics["loss"], ref.metrics["loss"]) <= RTOL
        assert member.metrics["accuracy"] == ref.metrics["accuracy"]


def test_simulated_group_costs_grow_in_work_not_in_kernels():
    """From the compiled fused step: FLOPs grow with the width, launched kernels do not, so a
    small candidate's group trains more trials per second on a modelled V100 than one trial."""
    from scamp_jax.sim.sim_fusion import measure_fused_costs
    from scamp_jax.sim.simulator import TrialProfile, cluster_preset

    model = nnx.eval_shape(lambda: SPACE.build({"width": 64}, nnx.Rngs(0)))
    task = Regression()
    plan = make_plan({"width": 64}, jax.devices()[:1], max_batch=16)
    costs = measure_fused_costs(model, task.sample_batch(1), plan, batch_size=16,
                                widths=(1, 4), optimizer=make_optimizer({}),
                                loss_fn=task.loss_fn)
    f1, f4 = costs.flops
    assert 3.5 * f1 <= f4 <= 4.5 * f1
    assert costs.kernels[1] <= 1.5 * costs.kernels[0]
    solo = TrialProfile(0, 1, plan.peak_bytes_per_device, 16, f1, costs.bytes_accessed[0], 0.0,
                        100, kernels_per_step=costs.kernels[0])
    v100 = cluster_preset("v100-16gb")
    gains = [costs.throughput_gain(solo, v100, k) for k in (1, 2, 4, 8)]
    assert gains[0] == pytest.approx(1.0)
    assert all(1.0 < g <= k for g, k in zip(gains[1:], (2, 4, 8), strict=True))
    assert gains[1] < gains[2] < gains[3]


def test_architecture_signature_ignores_training_hyperparameters():
    from scamp_jax.hpo.fused_runner import architecture_signature

    a = architecture_signature(SPACE, {"width": 16, "learning_rate": 1e-3})
    assert a == architecture_signature(SPACE, {"width": 16, "learning_rate": 3e-2})
    assert a != architecture_signature(SPACE, {"width": 32, "learning_rate": 1e-3})


def test_a_fused_plan_compiles_nothing_the_second_time_from_the_plan_cache(tmp_path):
    """The study's ``plans.sqlite`` holds every compiled fused point: the same group planned
    again (a fresh cache object, as another process or a resumed study) compiles nothing and
    decides the same; a plan on another mesh is not answered from those points."""
    model, task, kw, member, one, two = _member_of_width_64()
    member = dataclasses.replace(member, memory_per_device=int((one + 2.5 * (two - one)) / 0.9))
    path = tmp_path / "plans.sqlite"

    def fused(plan: Any, cache: PlanCache) -> FusionPlan:
        return plan_fusion(model, task.sample_batch(1), max_width=8, plan=plan, batch_size=256,
                           cache=cache, **kw)

    cold = fused(member, PlanCache(path))
    assert cold.width == 3 and cold.compiles >= 2 and not cold.cached
    warm = fused(member, PlanCache(path))
    assert warm.compiles == 0 and warm.cached
    assert (warm.width, warm.batch_size, warm.compiled_peaks, warm.predicted_peak_bytes) == (
        cold.width, cold.batch_size, cold.compiled_peaks, cold.predicted_peak_bytes)
    assert warm.estimate == cold.estimate
    # Two devices (data-parallel 2): another mesh, another program; compiled, not looked up.
    pair = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:2],
                             memory_per_device=BUDGET, max_batch_size=256, **kw)
    other = plan_fusion(model, task.sample_batch(1), max_width=2, plan=pair, batch_size=256,
                        cache=PlanCache(path), **kw)
    assert other.compiles >= 1 and not other.cached


def test_a_group_runs_the_planners_fused_step_without_compiling_it_again():
    """``compile_for_run``: a group that fits at the cap is sized by one run-grade compile,
    which its run on the planned devices takes as is (no fused step compiled there, nor traced:
    its lowering is the planner's, from JAX's cache) and trains exactly as a group that compiles
    its own; on another CPU device it is loaded there."""
    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    model = nnx.eval_shape(lambda: SPACE.build({"width": 16}, nnx.Rngs(0)))
    task = Regression()  # the study's one task: the planner's loss is the run's
    ready = plan_fusion(model, task.sample_batch(1), max_width=2, plan=plan,
                        batch_size=plan.batch_size, optimizer=make_optimizer({}),
                        loss_fn=task.loss_fn, compile_for_run=True)
    assert ready.width == 2 and ready.compiles == 1 and ready.compiled_step is not None
    moved = ready.with_devices(jax.devices()[1:2])
    assert moved.compiled_step is ready.compiled_step  # still for the planned device
    members = tuple(MemberSpec(i, cfg, seed) for i, (cfg, seed) in enumerate(MEMBERS[:2]))
    runs = []
    traced: list[str] = []

    def on_duration(event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == TRACE_EVENT and kwargs.get("fun_name") == "fused":
            traced.append(event)

    for gplan, counts, traces in ((ready, (1, 0, 0), 0), (moved, (1, 1, 0), 1),
                                  (dataclasses.replace(ready, compiled_step=None), (0, 0, 1), 0)):
        cache = StepCache()
        traced.clear()
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        try:
            runs.append(run_fused_group(GroupSpec(1, members, gplan, 5, BUDGET, log_every=1),
                                        SPACE, task, cache=cache))
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)
        assert all(m.state == "complete" for m in runs[-1].members)
        executables = cache.executables
        assert (executables.hits, executables.moves, executables.misses) == counts
        assert len(traced) == traces  # on other devices the run traces its own step
    for run in runs[1:]:
        assert run.losses == runs[0].losses
        assert [m.metrics for m in run.members] == [m.metrics for m in runs[0].members]


# --------------------------------------------------------------------------- every family


def _family(name: str) -> tuple[Any, Any, list[tuple[Any, ...]]]:
    """``(build(rngs), loss_fn, [batch of step 1, batch of step 2] per member)`` of a small
    model of each family, with three members' own data."""
    import numpy as np

    if name == "mlp":
        task = Regression()
        streams = [task.batches(16, seed) for seed in range(3)]
        return (lambda rngs: SPACE.build({"width": 16}, rngs), task.loss_fn,
                [[next(s) for _ in range(2)] for s in streams])
    if name == "vit":
        from search_spaces import vit

        task = vit.SyntheticClassificationTask(image_size=16, num_classes=5, eval_size=8)
        streams = [task.batches(8, seed) for seed in range(3)]
        return (lambda rngs: vit.ViT(image_size=16, patch_size=4, num_classes=5, embed_dim=16,
                                     depth=1, num_heads=2, mlp_ratio=2.0, rngs=rngs),
                task.loss_fn, [[next(s) for _ in range(2)] for s in streams])
    from search_spaces import swinir
    from search_spaces.sr_task import l1_loss

    rng = np.random.default_rng(0)  # a shifted window (8 > 4) and every convolution kind
    batches = [[(rng.uniform(size=(2, 8, 8, 3)).astype(np.float32),
                 rng.uniform(size=(2, 16, 16, 3)).astype(np.float32)) for _ in range(2)]
               for _ in range(3)]
    # No stochastic depth (the small space's SwinIRs have none): with it, the first loss is the
    # same to float rounding too, but within the 1e-6 only as the float32 sum of the L1 loss
    # happens to round (the outputs agree; see the next test, which checks the draws).
    return (lambda rngs: swinir.SwinIR(img_size=8, embed_dim=12, depths=(2,), num_heads=(3,),
                                       window_size=4, mlp_ratio=1.0, upscale=2,
                                       upsampler="pixelshuffledirect", drop_path_rate=0.0,
                                       rngs=rngs),
            l1_loss, batches)


@pytest.mark.parametrize("family", ["mlp", "vit", "swinir"])
def test_first_fused_steps_equal_the_solo_steps(family: str) -> None:
    """Members with their own seeds, learning rates and data: the first fused step's losses
    equal each solo step's within 1e-6 relative, and the second fused step is each member's solo
    step from the state the first one left (its own learning rate applied), within 1e-6.

    The second step is compared from the fused state, not along two separate runs: Adam's first
    update is g / (|g| + eps) per weight, so a weight whose gradient is within a few eps of 0
    (an output bias under an L1 loss whose signs nearly cancel) moves by up to the whole
    learning rate on the rounding left in a sum that should cancel, and two runs part by more
    than float rounding after one step (the SwinIR here: first losses within 3.4e-7 relative,
    second 4.6e-5; its upsampler's bias gradient is 2.3e-10 for one member).
    """
    import jax.numpy as jnp

    from scamp_jax.planning.fusion import make_fused_step, stack_batches
    from scamp_jax.planning.initial_state import set_hyperparams
    from scamp_jax.planning.train_step import make_train_step, split_model

    build, loss_fn, batches = _family(family)
    lrs = (1e-3, 3e-3, 1e-2)
    optimizer = make_optimizer({"learning_rate": lrs[0]})
    states = []
    for seed, lr in enumerate(lrs):
        graphdef, params, rest = split_model(build(nnx.Rngs(seed)))
        opt_state = set_hyperparams(optimizer.init(params), {"learning_rate": lr})
        states.append((params, opt_state, rest))
    solo = jax.jit(make_train_step(graphdef, optimizer, loss_fn))
    fused = jax.jit(make_fused_step(graphdef, optimizer, loss_fn))
    solo_losses = []
    for i, state in enumerate(states):
        p, o, r = jax.tree.map(jnp.copy, state)
        losses = []
        for batch in batches[i]:
            p, o, r, loss = solo(p, o, r, batch)
            losses.append(float(loss))
        solo_losses.append(losses)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    active = jnp.ones(len(lrs), bool)
    *after_one, first = fused(*stacked, stack_batches([b[0] for b in batches]), active)
    *_, second = fused(*after_one, stack_batches([b[1] for b in batches]), active)
    worst_first = max(rel(float(first[i]), solo_losses[i][0]) for i in range(len(lrs)))
    assert worst_first <= 1e-6, (family, worst_first, first, solo_losses)
    from_fused = []
    for i in range(len(lrs)):
        member = jax.tree.map(lambda x, i=i: jnp.copy(x[i]), tuple(after_one))
        from_fused.append(float(solo(*member, batches[i][1])[3]))
    worst_second = max(rel(float(second[i]), from_fused[i]) for i in range(len(lrs)))
    assert worst_second <= 1e-6, (family, worst_second, second, from_fused)
    assert len({round(v, 7) for v in from_fused}) == len(lrs)  # the members differ


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_fused_swinir_members_draw_their_own_stochastic_depth_as_solo():
    """In training mode each member of a fused forward pass drops the branches its solo run
    drops (its own random stream), before and after a fused training step: the outputs agree to
    float rounding, with branches dropped. (Compared on the outputs: the first loss of this
    model agrees too, but within 1e-6 only as the float32 sum of its L1 loss rounds.)"""
    import jax.numpy as jnp
    import numpy as np

    from scamp_jax.planning.fusion import make_fused_step, stack_batches
    from scamp_jax.planning.member_ops import member_program
    from scamp_jax.planning.train_step import make_train_step, split_model
    from search_spaces import swinir
    from search_spaces.sr_task import l1_loss

    def build(seed: int) -> Any:
        return swinir.SwinIR(img_size=8, embed_dim=12, depths=(2, 2), num_heads=(3, 3),
                             window_size=4, mlp_ratio=1.0, upscale=2, drop_path_rate=0.5,
                             upsampler="pixelshuffledirect", rngs=nnx.Rngs(seed))

    states = [split_model(build(seed)) for seed in range(3)]
    graphdef = states[0][0]
    lr = np.random.default_rng(0).uniform(size=(3, 4, 8, 8, 3)).astype(np.float32)

    def forward(params: Any, rest: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, params, rest, copy=True)
        return model(x), model.stochastic_depth(x.shape[0])

    def agree(members: list[tuple[Any, Any]]) -> None:
        solo = [jax.jit(forward)(p, r, lr[i]) for i, (p, r) in enumerate(members)]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
        fused_out, fused_keep = jax.jit(jax.vmap(member_program(forward)))(*stacked, lr)
        for i, (out, keep) in enumerate(solo):
            # the draws after the forward pass: the same stream position in both
            np.testing.assert_array_equal(np.asarray(fused_keep[i]), np.asarray(keep))
            scale = float(np.abs(np.asarray(out)).max())
            assert float(np.abs(np.asarray(fused_out[i]) - np.asarray(out)).max()) <= 1e-6 * scale

    agree([(p, r) for _, p, r in states])
    # one fused training step (gradients through the dropped branches, the streams carried)
    optimizer = make_optimizer({"learning_rate": 1e-3})
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                           *[(p, optimizer.init(p), r) for _, p, r in states])
    hr = np.random.default_rng(1).uniform(size=(3, 4, 16, 16, 3)).astype(np.float32)
    batch = stack_batches([(lr[i], hr[i]) for i in range(3)])
    params, _, rest, losses = jax.jit(make_fused_step(graphdef, optimizer, l1_loss))(
        *stacked, batch, jnp.ones(3, bool))
    assert np.all(np.isfinite(np.asarray(losses)))
    solo_step = jax.jit(make_train_step(graphdef, optimizer, l1_loss))
    for i, (_, p, r) in enumerate(states):  # each member's stream moved on as its solo run's
        solo_rest = solo_step(p, optimizer.init(p), r, (lr[i], hr[i]))[2]
        for a, b in zip(jax.tree.leaves(solo_rest), jax.tree.leaves(rest), strict=True):
            np.testing.assert_array_equal(_raw(a), _raw(b[i]))
    agree([jax.tree.map(lambda x, i=i: x[i], (params, rest)) for i in range(3)])
    drawn = [np.asarray(jax.jit(lambda p, r: nnx.merge(graphdef, p, r).stochastic_depth(4))(p, r))
             for _, p, r in states]
    assert all((d == 0).any() for d in drawn) and not np.array_equal(drawn[0], drawn[1])


def test_a_fused_swinir_step_has_no_grouped_convolution_on_cpu_and_one_per_conv_elsewhere():
    """On CPU every convolution of the fused step (forward, input and weight gradients) runs
    once per member, as its solo run's; lowered for a GPU each is one grouped convolution."""
    import re

    from scamp_jax.planning.fusion import make_fused_step, stack_abstract
    from scamp_jax.planning.train_step import abstract_state, split_model

    build, loss_fn, batches = _family("swinir")
    model = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    optimizer = make_optimizer({"learning_rate": 1e-3})
    width = 3
    args = [stack_abstract(t, width) for t in abstract_state(model, optimizer)]
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((width, *x.shape), x.dtype),
                         batches[0][0])
    active = jax.ShapeDtypeStruct((width,), bool)
    graphdef = split_model(model)[0]
    traced = jax.jit(make_fused_step(graphdef, optimizer, loss_fn)).trace(*args, batch, active)

    def groups(platform: str) -> list[int]:
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        return [int(n) for n in re.findall(r"feature_group_count = (\d+)", text)]

    cpu, gpu = groups("cpu"), groups("cuda")
    assert cpu and set(cpu) == {1}, cpu
    assert set(gpu) == {width} and len(cpu) == width * len(gpu), (cpu, gpu)


def test_an_inactive_member_leaves_the_fused_step_with_its_state_unchanged() -> None:
    """The ``active`` mask: a stopped member's parameters, optimizer state and other state
    (its dropout stream's counter) come out of the fused step exactly as they went in, while
    an active member's change, both in one step."""
    import jax.numpy as jnp
    import numpy as np

    from scamp_jax.planning.fusion import make_fused_step, stack_batches
    from scamp_jax.planning.train_step import split_model

    class Dropped(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(3, 1, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.linear(self.drop(x))

    optimizer = make_optimizer({"learning_rate": 1e-2})
    states = []
    for seed in (0, 1):
        graphdef, params, rest = split_model(Dropped(nnx.Rngs(seed)))
        states.append((params, optimizer.init(params), rest))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    rng = np.random.default_rng(0)
    batch = stack_batches([(rng.normal(size=(4, 3)).astype(np.float32),) for _ in range(2)])
    fused = jax.jit(make_fused_step(graphdef, optimizer))
    *after, losses = fused(*stacked, batch, jnp.asarray([True, False]))
    assert np.all(np.isfinite(np.asarray(losses)))
    changed = {"params": False, "opt_state": False, "rest": False}
    for name, old_tree, new_tree in zip(changed, stacked, after, strict=True):
        for old, new in zip(jax.tree.leaves(old_tree), jax.tree.leaves(new_tree), strict=True):
            np.testing.assert_array_equal(_raw(new)[1], _raw(old)[1], err_msg=name)
            changed[name] |= not np.array_equal(_raw(new)[0], _raw(old)[0])
    assert changed == {"params": True, "opt_state": True, "rest": True}


def test_a_group_spec_made_from_a_schedule_holds_its_booked_share_and_ends_oom_above_it():
    """`GroupSpec.of` takes the run's schedule as the engine hands it: its steps, intervals
    and booked share come back from ``schedule()``, and a group whose fused step needs more
    than that share ends every member ``oom`` (not checked against the device's whole
    budget)."""
    from scamp_jax.hpo.lifecycle import Schedule

    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = tuple(MemberSpec(i, cfg, seed) for i, (cfg, seed) in enumerate(MEMBERS[:2]))
    schedule = Schedule(5, 2**10, checkpoint_every=3, eval_every=2, log_every=1)
    spec = GroupSpec.of(4, members, group_plan(plan, 4), schedule, BUDGET)
    assert spec.schedule() == schedule and spec.share_bytes() == 2**10
    group = run_fused_group(spec, SPACE, Regression())
    assert [r.state for r in group.members] == ["oom"] * 2, [r.reason for r in group.members]


def test_a_re_formed_groups_records_give_its_first_width_and_no_non_finite_loss(tmp_path):
    """A member that diverges fails alone and the group re-forms without it: each member's
    record (and the results file, strict JSON) gives the width the group started with, and
    the failed member's non-finite loss as null."""
    import json

    plan = make_plan({"width": 16}, jax.devices()[:1], max_batch=16)
    members = (MemberSpec(0, {"width": 16, "learning_rate": 1e-2}, 1),
               MemberSpec(1, {"width": 16, "learning_rate": 1e30}, 2),
               MemberSpec(2, {"width": 16, "learning_rate": 3e-3}, 3))
    group = run_fused_group(GroupSpec(5, members, group_plan(plan, 4), 10, BUDGET, eval_every=5,
                                      log_every=1), SPACE, Regression(),
                            results_path=tmp_path / "group.json")
    assert [r.state for r in group.members] == ["complete", "failed", "complete"]
    assert group.widths == (3, 2)
    records = group.records()
    assert [r["fusion_width"] for r in records] == [3, 3, 3]
    assert records[1]["loss"] is None and records[0]["loss"] is not None

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    written = json.loads((tmp_path / "group.json").read_text(), parse_constant=refuse)
    assert [m["fusion_width"] for m in written["members"]] == [3, 3, 3]
    assert written["widths"] == [3, 2]


def test_a_signature_tells_apart_programs_whose_variables_differ_only_in_shape():
    """Two builds whose graph definitions print alike (a variable's shape is no attribute of
    the graph) but whose variables' shapes differ are two programs: their signature keys
    differ, so the engine never shares one fused plan between them."""
    import jax.numpy as jnp

    from scamp_jax.hpo.fused_runner import architecture_signature, signature_key
    from scamp_jax.space import SearchSpace

    class Scale(nnx.Module):
        def __init__(self, size: int) -> None:
            self.w = nnx.Param(jnp.ones((size,)))

        def __call__(self, x: jax.Array) -> jax.Array:
            return x * self.w

    space = SearchSpace("scale", lambda trial: {}, lambda config, rngs: Scale(config["size"]))
    three, four = (architecture_signature(space, {"size": n}) for n in (3, 4))
    assert repr(three[0]) == repr(four[0])  # the graph alone does not tell them apart
    assert signature_key(three) != signature_key(four)
    assert signature_key(three) == signature_key(architecture_signature(space, {"size": 3}))


class DroppedMLP(nnx.Module):
    """`test_runner`'s MLP with dropout on its hidden layer: a random stream (a typed key and a
    counter) in each member's state."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(8, width, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(jax.numpy.tanh(self.hidden(x))))


def test_a_group_of_a_model_with_dropout_re_forms_with_each_members_own_stream():
    """Members whose state holds a random stream (dropout): the group re-forms without a pruned
    member, each survivor keeping its own stream, and ends as its solo run ends."""
    from scamp_jax.space import SearchSpace

    space = SearchSpace("dropped", lambda trial: {},
                        lambda config, rngs: DroppedMLP(int(config["width"]), rngs))
    task = Regression()
    kw = {"optimizer": make_optimizer({}), "loss_fn": task.loss_fn}
    model = nnx.eval_shape(lambda: space.build({"width": 16}, nnx.Rngs(0)))
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                             memory_per_device=BUDGET, max_batch_size=16, **kw)
    gplan = plan_fusion(model, task.sample_batch(1), max_width=3, plan=plan,
                        batch_size=plan.batch_size, **kw)
    members = tuple(MemberSpec(10 + i, cfg, seed) for i, (cfg, seed) in enumerate(MEMBERS[:3]))
    steps, every = 10, 5
    group = run_fused_group(
        GroupSpec(1, members, gplan, steps, BUDGET, eval_every=every, log_every=5), space, task,
        report=lambda number, step, value: number == 10 and step == every)
    assert [r.state for r in group.members] == ["pruned", "complete", "complete"], [
        r.reason for r in group.members]
    assert group.widths == (3, 2)
    config, seed = MEMBERS[2]  # moved from slot 2 to slot 1 by the re-form
    alone = run_trial(RunSpec(0, config, plan, steps, BUDGET, seed=seed), space, task)
    assert alone.state == "complete", alone.reason
    assert rel(group.members[2].metrics["mse"], alone.metrics["mse"]) <= RTOL


def test_a_hyperparameter_set_by_only_some_members_is_refused_naming_them():
    """A group's members share one optimizer: a hyperparameter that some members set and
    others do not is refused with the members that lack it, not defaulted nor a KeyError;
    one that every member sets is a ``(K,)`` float32 array in member order."""
    import numpy as np

    from scamp_jax.planning.fusion import hyperparam_arrays

    configs = [{"learning_rate": 1e-2, "b1": 0.8}, {"learning_rate": 3e-3}, {"b1": 0.9}]
    with pytest.raises(ValueError, match=r"'learning_rate' is set by some group members but "
                                         r"not by members \[2\]"):
        hyperparam_arrays(("learning_rate",), configs)
    with pytest.raises(ValueError, match=r"'b1' is set by some group members but not by "
                                         r"members \[1\]"):
        hyperparam_arrays(("b1",), configs)
    got = hyperparam_arrays(("learning_rate", "weight_decay"), configs[:2])
    assert list(got) == ["learning_rate"] and got["learning_rate"].dtype == np.float32
    np.testing.assert_array_equal(got["learning_rate"], np.float32([1e-2, 3e-3]))


def test_a_group_as_narrow_as_the_fewest_wanted_that_does_not_fit_says_so():
    """``max_width == min_width`` (a family of two in a study; one member asked alone): when
    that group does not fit, a clear `DoesNotFitError`, compiling no narrower group."""
    model, task, kw, member, one, two = _member_of_width_64()
    member = dataclasses.replace(member, memory_per_device=int((one + 0.5 * (two - one)) / 0.9))
    compiled: list[int] = []
    original = FusedStepCompiler.estimate

    def estimate(self: FusedStepCompiler, width: int, batch: int, run_grade: bool = False):
        compiled.append(width)
        return original(self, width, batch, run_grade)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedStepCompiler, "estimate", estimate)
        with pytest.raises(planner.DoesNotFitError, match="a fused group of 2 members needs"):
            plan_fusion(model, task.sample_batch(1), max_width=2, plan=member, batch_size=256,
                        min_width=2, **kw)
        assert set(compiled) == {2}
        tight = dataclasses.replace(member, memory_per_device=int(0.8 * one / 0.9))
        with pytest.raises(planner.DoesNotFitError, match="one fused member needs"):
            plan_fusion(model, task.sample_batch(1), max_width=1, plan=tight, batch_size=256,
                        **kw)
