"""Fused groups in the search loop: the grouping rule, a fused study, members equal solo runs.

The study tests use a real Optuna study in SQLite, the real planner and real compiles, with
`test_runner`'s MLP regression (small enough to train in seconds on CPU).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal

import jax
import optuna
import pytest
from flax import nnx
from optuna.trial import TrialState
from test_runner import SPACE, Regression, make_plan

from scamp_jax.hpo.engine import EngineConfig, SearchEngine
from scamp_jax.hpo.fused_engine import latest_checkpoint_step
from scamp_jax.hpo.runner import RunSpec, StepCache, make_optimizer, run_trial, trial_seed
from scamp_jax.hpo.settings import SearchSettings
from scamp_jax.hpo.study import SIBLING_OF, OptunaTrialSource, open_study
from scamp_jax.planning.budget import Budget
from scamp_jax.planning.compile_events import CompileCounter
from scamp_jax.planning.fusion import plan_fusion
from scamp_jax.planning.planner import plan_mesh
from scamp_jax.scheduling.grouping import FusionCandidate, form_groups
from scamp_jax.space import SearchSpace

BUDGET = 64 * 2**20


# ------------------------------------------------------------------------ the grouping rule


def test_groups_are_chunks_of_one_signature_in_arrival_order():
    waiting = [FusionCandidate(k, sig, arrival=k, width=3)
               for k, sig in enumerate("aabaaab")]
    assert form_groups(waiting) == ((0, 1, 3), (2, 6), (4, 5))


def test_the_last_chunk_waits_for_expected_members():
    waiting = [FusionCandidate(k, "a", arrival=k, width=4) for k in range(6)]
    assert form_groups(waiting, expecting={"a"}) == ((0, 1, 2, 3),)
    assert form_groups(waiting) == ((0, 1, 2, 3), (4, 5))
    # A full chunk never waits; another signature is not held back.
    waiting.append(FusionCandidate(9, "b", arrival=9, width=4))
    assert form_groups(waiting, expecting={"a"}) == ((0, 1, 2, 3), (9,))


def test_width_one_runs_alone_and_bad_widths_are_refused():
    waiting = [FusionCandidate(k, "a", arrival=k, width=1) for k in range(3)]
    assert form_groups(waiting) == ((0,), (1,), (2,))
    with pytest.raises(ValueError, match="width=0"):
        FusionCandidate(0, "a", 0, width=0)


def test_every_candidate_is_in_exactly_one_group_of_one_signature():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 12)
        widths = {s: rng.randint(1, 4) for s in "abc"}
        sigs = [rng.choice("abc") for _ in range(n)]
        waiting = [FusionCandidate(k, s, rng.randint(0, 20), widths[s])
                   for k, s in enumerate(sigs)]
        expecting = {s for s in "abc" if rng.random() < 0.5}
        groups = form_groups(waiting, expecting=expecting)
        keys = [k for g in groups for k in g]
        assert len(keys) == len(set(keys))
        held = set(range(n)) - set(keys)
        for g in groups:
            assert len({sigs[k] for k in g}) == 1 and len(g) <= widths[sigs[g[0]]]
        # Only a narrower-than-width remainder of an expected signature is held back.
        for s in "abc":
            mine = [k for k in held if sigs[k] == s]
            assert not mine or (s in expecting and len(mine) < widths[s])


# ------------------------------------------------------------------------ a fused study


def _fusion(fuse: int, trials: int = 64) -> dict:
    """The trial source's sibling arguments for ``fuse``, as a study session of ``trials``
    passes them."""
    return SearchSettings(trials=trials, steps=1, fuse=fuse, sampler="random").source_kwargs()


def _study(tmp_path, trials: int, fuse: int, steps: int = 30, budget: int = BUDGET):
    handle = open_study("mlp-fused", study_dir=tmp_path, direction="minimize",
                        sampler="random", pruner="none", seed=3)
    study = handle.study
    source = OptunaTrialSource(handle, SPACE, trials, root=tmp_path, **_fusion(fuse, trials))
    config = EngineConfig(steps=steps, budget=Budget(budget), max_batch_size=16, log_every=5,
                          fuse=fuse, seed=5)
    engine = SearchEngine(SPACE, Regression(), source, config, devices=jax.devices()[:4],
                          checkpoint_root=tmp_path / "ckpt")
    return study, source, engine


def test_a_fused_study_finishes_exactly_its_trials_with_members_equal_to_solo_runs(tmp_path):
    """Siblings of a proposed architecture train fused; each member is its own trial, scored,
    and ends where the same trial run alone ends; the run's usage counts the trials its groups
    trained, not the groups."""
    study, source, engine = _study(tmp_path, trials=4, fuse=2, steps=10)
    result = engine.run()
    source.close()
    assert result.usage["trials_started"] == result.usage["trials_finished"] == 4
    trials = study.get_trials()
    assert len(trials) == 4
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    groups: dict[int, list] = {}
    for t in trials:
        assert t.value == t.user_attrs["metrics"]["mse"]
        if t.user_attrs["fused_group"] is not None:
            groups.setdefault(t.user_attrs["fused_group"], []).append(t)
    assert groups, "no fused group formed"
    for gid, members in groups.items():
        assert {t.user_attrs["fusion_width"] for t in members} == {len(members)} and \
            len(members) >= 2
        assert len({t.params["width"] for t in members}) == 1  # one architecture
        assert gid == min(t.number for t in members)
        # Siblings share the architecture; the sampler gave them their own learning rates.
        assert all(t.user_attrs.get(SIBLING_OF) == gid for t in members if t.number != gid)
        assert len({t.params["learning_rate"] for t in members}) == len(members)
        assert len({t.user_attrs["devices"][0] for t in members}) == 1
        assert max(t.user_attrs["predicted_peak_bytes"] for t in members) <= BUDGET * 0.9
        # the group's seconds a step, each member's
        assert len({t.user_attrs["step_seconds"] for t in members}) == 1
        assert members[0].user_attrs["step_seconds"] > 0
    # Every member's result is its solo run's: same seed, params, plan, batch and steps. The
    # leader alone would not see a member trained with the leader's seed or learning rate.
    cache = StepCache()
    for member in (t for ms in groups.values() for t in ms):
        plan = make_plan(member.params, jax.devices()[:1], max_batch=16)
        solo = run_trial(RunSpec(member.number, member.params, plan, 10, BUDGET,
                                 seed=trial_seed(5, member.user_attrs["checkpoint_key"])),
                         SPACE, Regression(), cache=cache)
        assert solo.state == "complete"
        rel = abs(solo.metrics["mse"] - member.value) / abs(solo.metrics["mse"])
        print(f"fused member {member.number} vs solo: relative difference {rel:.3g}")
        assert rel <= 1e-5, (member.number, rel)


def test_a_narrower_group_books_its_own_width_not_the_widest(tmp_path):
    """Five trials with --fuse 3: a group of 3 and the family's last group of 2. The group of 2
    is sized at its own width (compiled, checked here by compiling it again) and books that
    plan's bytes, less than the group of 3 would."""
    study, source, engine = _study(tmp_path, trials=5, fuse=3)
    result = engine.run()
    source.close()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5
    groups: dict[int, list] = {}
    for t in trials:
        if t.user_attrs["fused_group"] is not None:
            groups.setdefault(t.user_attrs["fused_group"], []).append(t)
    assert sorted(len(m) for m in groups.values()) == [2, 3], groups
    booked = {key: nbytes for device in result.intervals for key, _, _, nbytes in device}
    task = Regression()
    for gid, members in groups.items():
        first = members[0]
        plan = make_plan(first.params, jax.devices()[:len(first.user_attrs["devices"])],
                         max_batch=16)
        model = nnx.eval_shape(lambda p=first.params: SPACE.build(p, nnx.Rngs(0)))
        own = plan_fusion(model, task.sample_batch(1), max_width=len(members), plan=plan,
                          batch_size=16, optimizer=make_optimizer({}), loss_fn=task.loss_fn)
        assert own.width == len(members)
        assert booked[gid] == own.predicted_peak_bytes
        assert {t.user_attrs["predicted_peak_bytes"] for t in members} == {
            own.peak_bytes_per_device}
        if len(members) == 2:
            wide = plan_fusion(model, task.sample_batch(1), max_width=3, plan=plan,
                               batch_size=16, optimizer=make_optimizer({}),
                               loss_fn=task.loss_fn)
            assert wide.width == 3 and booked[gid] < wide.predicted_peak_bytes


def test_a_family_is_planned_once_at_its_own_width(tmp_path):
    """Three trials with --fuse 4: a proposal and its two siblings, whose planner threads plan
    the group together, once, three wide (not at the cap of 4 and then again at 3): one fused
    compile to plan the group and at most one to run it, and no solo step (the members' own
    plans are from shapes; the group's compiled step checks them)."""
    study, source, engine = _study(tmp_path, trials=3, fuse=4, steps=5)
    with CompileCounter() as counter:
        engine.run()
    source.close()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert {t.user_attrs["fusion_width"] for t in trials} == {3}
    fused = sum(n for name, n in counter.compiles.items() if "fused" in name)
    assert 1 <= fused <= 2, counter.compiles
    assert counter.compiles["jit(step)"] == 0, counter.compiles


def test_a_family_whose_group_does_not_fit_trains_alone_on_compiled_plans(tmp_path):
    """A budget where one member fits at the batch cap but two fused do not: the members'
    plans from shapes are not what they train on; each is planned by compiling and trains
    alone, at the batch its compiled plan gives, and ends as a solo run of it ends."""
    budget = 12 * 2**10
    study, source, engine = _study(tmp_path, trials=2, fuse=2, steps=5, budget=budget)
    with CompileCounter() as counter:
        engine.run()
    source.close()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert all(t.user_attrs["fused_group"] is None and t.user_attrs["fusion_width"] == 1
               for t in trials)
    assert trials[1].user_attrs.get(SIBLING_OF) == 0  # a family, split for memory
    assert counter.compiles["jit(step)"] >= 1 and counter.compiles["jit(fused)"] >= 1
    task = Regression()
    for t in trials:
        model = nnx.eval_shape(lambda p=t.params: SPACE.build(p, nnx.Rngs(0)))
        solo = plan_mesh(model, task.sample_batch(1), devices=1, memory_per_device=budget,
                         max_batch_size=16, optimizer=make_optimizer(t.params),
                         loss_fn=task.loss_fn)
        assert t.user_attrs["batch_size"] == solo.batch_size
        pair = plan_fusion(model, task.sample_batch(1), max_width=2, plan=solo,
                           batch_size=solo.batch_size, optimizer=make_optimizer(t.params),
                           loss_fn=task.loss_fn)
        assert pair.width == 1  # two fused need more than the budget


def test_a_trial_left_alone_in_a_fused_study_trains_on_a_compiled_plan(tmp_path):
    """Three trials with --fuse 2: a group of two and a last proposal with no sibling left.
    The last one's plan from shapes sized a group that never formed; it is planned again by
    compiling before it is queued, and trains alone as a solo run of that plan does."""
    study, source, engine = _study(tmp_path, trials=3, fuse=2, steps=10)
    with CompileCounter() as counter:
        engine.run()
    source.close()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    alone = [t for t in trials if t.user_attrs["fused_group"] is None]
    assert len(alone) == 1 and alone[0].user_attrs["fusion_width"] == 1
    assert counter.compiles["jit(step)"] >= 1  # the solo step: planned and run on it
    trial = alone[0]
    plan = make_plan(trial.params, jax.devices()[:len(trial.user_attrs["devices"])],
                     max_batch=16)
    assert trial.user_attrs["batch_size"] == plan.batch_size
    assert trial.user_attrs["predicted_peak_bytes"] == plan.predicted_peak_bytes
    solo = run_trial(RunSpec(trial.number, trial.params, plan, 10, BUDGET,
                             seed=trial_seed(5, trial.user_attrs["checkpoint_key"])),
                     SPACE, Regression(), cache=StepCache())
    assert solo.metrics["mse"] == trial.value


def test_a_sibling_the_space_rejects_is_not_waited_for(tmp_path):
    """--fuse 3: a proposal, a sibling whose ``suggest`` raises ``optuna.TrialPruned``
    (the study stores it pruned; the engine never sees it), the other sibling, and a last
    proposal of another width. The proposal and its remaining sibling train as a group of
    two and the study ends with its four trials; the source holds no sibling at the end. (That
    the group goes as soon as its members are planned, not when nothing else is being
    planned, is the forming rule's test below.)"""
    rejected: list[int] = []

    def suggest(trial):
        sibling_of = trial.user_attrs.get(SIBLING_OF)
        if sibling_of is not None and not rejected:
            rejected.append(trial.number)
            raise optuna.TrialPruned("the space refuses this learning rate")
        return SPACE.suggest(trial)

    space = SearchSpace("mlp", suggest, SPACE.build)
    # seed 1: the proposals' widths differ (checked below), so the last one is not a member
    handle = open_study("mlp-fused", study_dir=tmp_path, direction="minimize",
                        sampler="random", pruner="none", seed=1)
    source = OptunaTrialSource(handle, space, 4, root=tmp_path, **_fusion(3, 4))
    config = EngineConfig(steps=100, budget=Budget(BUDGET), max_batch_size=16, log_every=5,
                          fuse=3, seed=5)
    engine = SearchEngine(space, Regression(), source, config, devices=jax.devices()[:4],
                          checkpoint_root=tmp_path / "ckpt")
    engine.run()
    source.close()
    trials = handle.study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED,
                                         TrialState.COMPLETE, TrialState.COMPLETE]
    assert [t.params["width"] for t in trials if t.params] == [64, 64, 32]
    assert [t.user_attrs.get("fused_group") for t in trials] == [0, None, 0, None]
    assert source.held_siblings(0) == 0


def test_a_group_waits_only_for_siblings_the_study_still_holds():
    """The forming rule of a fused study: a proposal's group (widest plan: 3) is held while
    the trial source still holds one of its siblings, and goes at its own width once the
    source holds none (that sibling was rejected, given up or is planned), though fewer
    members were planned than the proposal had siblings."""
    from types import SimpleNamespace

    from scamp_jax.hpo.fused_engine import FusionService, MemberInfo
    from scamp_jax.hpo.study import AskedTrial
    from scamp_jax.hpo.trial import PlannedTrial

    held = {0: 1}
    service = FusionService(SPACE, Regression(), 3, planning=None,
                            held_siblings=lambda proposal: held.get(proposal, 0))
    record = SimpleNamespace(solo_only=False, status=SimpleNamespace(state=None),
                             show_plan=lambda plan: None)
    asked = [AskedTrial(0, {"width": 16, "learning_rate": 1e-3}, "trial_0", siblings=2),
             AskedTrial(2, {"width": 16, "learning_rate": 2e-3}, "trial_2", sibling_of=0)]
    for a in asked:
        service.family_width(a)  # as the engine's ask does (`plan_job`)
        service._info[a.number] = MemberInfo("mlp-16", 0, SimpleNamespace(width=3))
        assert service.admit(PlannedTrial(a, None, 1, a.number), record) is None
    formed = service.form([], stalled=False)
    assert not formed.units and not formed.sizing and service.forming  # one sibling is held
    held[0] = 0
    formed = service.form([], stalled=False)
    assert [numbers for numbers, _ in formed.sizing] == [(0, 2)] and not service.forming


def test_a_proposals_siblings_are_planned_for_its_familys_width_not_the_cap():
    """A proposal with 2 siblings under a cap of 8 is a family of 3: it and its siblings are
    each planned for a group of at most 3 (one group plan, one compile, shared by all three),
    not 8; a trial of no known family (a retry, a sibling of a proposal asked in an earlier
    run) is planned for the cap."""
    from scamp_jax.hpo.fused_engine import FusionService
    from scamp_jax.hpo.study import AskedTrial

    service = FusionService(SPACE, Regression(), 8, planning=None, held_siblings=lambda p: 0)
    params = {"width": 16, "learning_rate": 1e-3}
    asked = [AskedTrial(0, params, "trial_0", siblings=2),
             AskedTrial(1, params, "trial_1", sibling_of=0),
             AskedTrial(2, params, "trial_2", sibling_of=0),
             AskedTrial(3, params, "trial_3"),
             AskedTrial(4, params, "trial_4", sibling_of=7)]
    # the width each planner job is given (`prepare`'s last argument; None: the cap)
    assert [service.plan_job(a).args[-1] for a in asked] == [3, 3, 3, None, None]


def test_a_trial_whose_provisional_plan_fits_no_group_is_planned_to_train_alone():
    """A wide MLP fits alone at the cap (its plan from shapes: provisional, nothing compiled)
    but two of it do not fit fused: the trial trains alone, so it is planned again by
    compiling (run-grade), and its group sized on that plan (none fits there either)."""
    from scamp_jax.hpo.fused_engine import FusionService
    from scamp_jax.hpo.plan_service import PlanningService
    from scamp_jax.planning import planner

    config = EngineConfig(steps=10, budget=Budget(8 * 2**20), max_batch_size=16, fuse=2)
    planning = PlanningService(SPACE, Regression(), config, jax.devices()[:1], planner.plan_mesh)
    service = FusionService(SPACE, Regression(), 2, planning, held_siblings=lambda p: 0)
    params = {"width": 20_000, "learning_rate": 1e-2}
    assert planning.plan(params, provisional=True).provisional  # what the first try gets
    plan = service.prepare(params, 0, None, 2)
    assert service.info(0).fusion is None
    assert not plan.provisional and int(plan.batch_size) == 16


def test_trials_that_set_other_optimizer_hyperparameters_are_not_fused_together(tmp_path):
    """A group's members hold the optimizer hyperparameters they set as data, so a trial with
    ``weight_decay`` and one without cannot share a program although their architecture is
    one: they train apart, and the trials that set the same keys are fused."""
    def suggest(trial: optuna.Trial) -> dict:
        params = {"width": trial.suggest_categorical("width", [16]),
                  "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)}
        if trial.suggest_categorical("decay", [True, False]):
            params["weight_decay"] = trial.suggest_float("weight_decay", 1e-5, 1e-3, log=True)
        return params

    space = SearchSpace("mlp-decay", suggest, SPACE.build)
    handle = open_study("decay", study_dir=tmp_path, direction="minimize", sampler="random",
                        pruner="none", seed=0)
    for decay, lr in ((False, 1e-2), (True, 1e-2), (True, 2e-2)):
        handle.study.enqueue_trial({"width": 16, "learning_rate": lr, "decay": decay,
                                    **({"weight_decay": 1e-4} if decay else {})})
    source = OptunaTrialSource(handle, space, 3, root=tmp_path)
    config = EngineConfig(steps=5, budget=Budget(BUDGET), max_batch_size=16, log_every=5,
                          fuse=2)
    SearchEngine(space, Regression(), source, config, devices=jax.devices()[:2],
                 checkpoint_root=tmp_path / "ckpt").run()
    source.close()
    trials = handle.study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3, [
        t.user_attrs.get("fail_reason") for t in trials]
    assert [t.user_attrs["fused_group"] for t in trials] == [None, 1, 1]


def test_trials_whose_build_reads_another_value_are_not_fused_together(tmp_path):
    """A value ``build`` reads that no graph holds (an initialisation scale) makes trials of
    one program differ: a group builds its members with one configuration, so they train
    apart, each as its solo run, and the trials that share every value but the optimizer's
    are fused."""
    def suggest(trial: optuna.Trial) -> dict:
        return {"width": 16,
                "init_scale": trial.suggest_categorical("init_scale", [0.1, 3.0]),
                "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)}

    def build(config: dict, rngs: nnx.Rngs) -> nnx.Module:
        model = SPACE.build({"width": config["width"]}, rngs)
        model.hidden.kernel.set_value(model.hidden.kernel.get_value() * config["init_scale"])
        return model

    space = SearchSpace("mlp-scaled", suggest, build)
    handle = open_study("scaled", study_dir=tmp_path, direction="minimize", sampler="random",
                        pruner="none", seed=0)
    for scale, lr in ((0.1, 1e-2), (3.0, 1e-2), (0.1, 2e-2), (3.0, 2e-2), (0.1, 3e-3)):
        handle.study.enqueue_trial({"init_scale": scale, "learning_rate": lr})
    source = OptunaTrialSource(handle, space, 5, root=tmp_path)
    config = EngineConfig(steps=5, budget=Budget(BUDGET), max_batch_size=16, log_every=5,
                          fuse=2, seed=5)
    SearchEngine(space, Regression(), source, config, devices=jax.devices()[:2],
                 checkpoint_root=tmp_path / "ckpt").run()
    source.close()
    trials = handle.study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5, [
        t.user_attrs.get("fail_reason") for t in trials]
    groups: dict[int, set] = {}
    for t in trials:
        if t.user_attrs["fused_group"] is not None:
            groups.setdefault(t.user_attrs["fused_group"], set()).add(t.params["init_scale"])
    assert len(groups) >= 1 and all(len(scales) == 1 for scales in groups.values()), groups
    cache = StepCache()
    for t in trials:
        params = {"width": 16, **t.params}
        plan = make_plan(params, jax.devices()[:1], max_batch=16)
        solo = run_trial(RunSpec(t.number, params, plan, 5, BUDGET,
                                 seed=trial_seed(5, t.user_attrs["checkpoint_key"])),
                         space, Regression(), cache=cache)
        rel = abs(solo.metrics["mse"] - t.value) / abs(solo.metrics["mse"])
        assert rel <= 1e-5, (t.number, t.params, rel)


def test_a_configuration_reads_numpy_values_as_their_python_values():
    """What groups trials (`model_config`): a NumPy scalar or 0-d array is its Python value;
    the optimizer's keys are left out, other values are not."""
    import numpy as np

    from scamp_jax.hpo.trial import model_config

    python = model_config({"width": 2.0, "flag": True, "learning_rate": 1e-3})
    assert model_config({"width": np.float64(2.0), "flag": np.bool_(True),
                         "learning_rate": 3e-3}) == python
    assert model_config({"width": np.array(2.0), "flag": np.array(True)}) == python
    assert model_config({"width": 3.0, "flag": True}) != python
    assert model_config({"width": np.array([2.0]), "flag": True}) != python


def test_a_family_whose_choices_are_numpy_numbers_trains_as_one_group(tmp_path):
    """A categorical of NumPy numbers: the sampler hands the proposal its choice
    (``np.float64(2.0)``), the study's storage hands its siblings the JSON value (``2.0``);
    they are one configuration, and the family trains as one group."""
    import numpy as np

    import scamp_jax
    from scamp_jax.hpo.study import storage_url

    ratios = list(np.array([2.0, 4.0]))

    def suggest(trial: optuna.Trial) -> dict:
        return {"width": 16, "ratio": trial.suggest_categorical("ratio", ratios),
                "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)}

    space = SearchSpace("np", suggest, lambda c, rngs: SPACE.build({"width": 16}, rngs))
    scamp_jax.run_study(space, Regression(), trials=4, steps=2, study_dir=tmp_path,
                        live=False, devices=1, memory_per_device="64MiB", max_batch_size=8,
                        sampler="random", fuse=4)
    study = optuna.load_study(study_name="np", storage=storage_url(tmp_path))
    assert [(t.user_attrs["fused_group"], t.user_attrs["fusion_width"])
            for t in study.trials] == [(0, 4)] * 4


def test_without_fuse_nothing_is_grouped(tmp_path):
    study, source, engine = _study(tmp_path, trials=2, fuse=1)
    engine.run()
    source.close()
    trials = study.get_trials()
    assert len(trials) == 2
    assert all(t.user_attrs["fused_group"] is None and t.user_attrs["fusion_width"] == 1
               for t in trials)
    assert not any(SIBLING_OF in t.user_attrs for t in trials)


def test_bad_fuse_values_are_refused():
    with pytest.raises(ValueError, match="fuse=0"):
        EngineConfig(steps=1, budget=Budget(BUDGET), fuse=0)
    with pytest.raises(ValueError, match="'wide'") as refused:
        EngineConfig(steps=1, budget=Budget(BUDGET), fuse="wide")
    # in the library's words (the command lines word it with their flags, `as_flags`)
    assert "e.g. fuse=4 or fuse='auto'" in str(refused.value) and "--" not in str(refused.value)
    with pytest.raises(ValueError, match="fuse=1000 asks for groups of more than 64 trials"):
        EngineConfig(steps=1, budget=Budget(BUDGET), fuse=1000)


def test_a_group_is_never_wider_than_the_study():
    """A width above the study's trials is the study's trials: no wider group is asked for,
    planned or compiled (the width search starts at its cap)."""
    settings = SearchSettings(steps=1, trials=3, fuse=6)
    assert settings.fuse == 3 and settings.source_kwargs()["siblings"] == 2
    assert SearchSettings(steps=1, trials=1, fuse=6).fuse == 1  # one trial: nothing to fuse
    assert SearchSettings(steps=1, trials=3, fuse="auto").fuse == 3  # "auto" is at most 8
    assert SearchSettings(steps=1, trials=1, fuse="auto").fuse == 1
    assert SearchSettings(steps=1, trials=20, fuse="auto").fuse == "auto"
    # lowered first: one trial under the grid sampler fuses nothing, which the grid allows
    assert SearchSettings(steps=1, trials=1, fuse=4, sampler="grid").fuse == 1


class _CtrlC:
    """``on_update`` that presses Ctrl-C (raises KeyboardInterrupt on the loop's thread, where
    a real one lands) once a fused member has trained ``step`` steps and ``complete`` trials
    have finished."""

    def __init__(self, step: int, complete: int = 0) -> None:
        self.step, self.complete, self.fired = step, complete, False

    def __call__(self, statuses, pool, groups=None) -> None:
        if self.fired or not groups:
            return
        if sum(s.state == "complete" for s in statuses) >= self.complete and any(
                s.number in groups and s.state == "training" and s.step >= self.step
                for s in statuses):
            self.fired = True
            raise KeyboardInterrupt


def test_an_interrupted_fused_study_resumes_its_members_and_keeps_finished_ones(tmp_path):
    """Ctrl-C during a group: members checkpoint and go back to the study; the same command
    again resumes them from their checkpoints (as a group again) and ends with exactly the
    study's trials; trials finished before stay as they were."""
    # Long enough that the loop (which looks at least every 0.5 s) sees a group training: on
    # a quiet machine 1,000 steps of the second group ended between two looks. The two groups
    # train one after the other, and the Ctrl-C comes once the first has finished.
    steps, trials = 6000, 4

    def engine(on_update=None):
        handle = open_study("mlp-fused", study_dir=tmp_path, direction="minimize",
                            sampler="random", pruner="none", seed=3)
        study = handle.study
        source = OptunaTrialSource(handle, SPACE, trials, root=tmp_path, **_fusion(2, trials))
        config = EngineConfig(steps=steps, budget=Budget(BUDGET), max_batch_size=16,
                              log_every=50, checkpoint_every=1500, fuse=2, seed=5,
                              max_running_trials=1)
        return study, source, SearchEngine(SPACE, Regression(), source, config,
                                           devices=jax.devices()[:1],
                                           checkpoint_root=tmp_path / "ckpt",
                                           on_update=on_update)

    study, source, first = engine(_CtrlC(10, complete=2))
    with pytest.raises(KeyboardInterrupt):
        first.run()
    source.close()
    before = {t.number: t.value for t in study.get_trials() if t.state == TrialState.COMPLETE}
    interrupted = [t for t in study.get_trials() if t.state == TrialState.FAIL]
    assert interrupted, "nothing was running at the interrupt"
    assert len(before) == 2, before  # the first group's, which the rerun must leave alone
    saved = {t.user_attrs["checkpoint_key"] for t in interrupted
             if latest_checkpoint_step(tmp_path / "ckpt" / t.user_attrs["checkpoint_key"])}
    study, source, second = engine()
    second.run()
    source.close()
    done = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    assert len(done) == trials
    for number, value in before.items():
        assert study.trials[number].value == value  # finished members stay finished
    resumed = [t for t in done if t.user_attrs["resumed_from"] > 0]
    assert resumed, "no member resumed from its checkpoint"
    assert any(t.user_attrs["fused_group"] is not None for t in resumed)
    # Every member interrupted after a checkpoint resumed from it.
    assert saved and saved <= {t.user_attrs["checkpoint_key"] for t in resumed}


def test_a_member_that_diverged_before_a_ctrl_c_stays_failed_and_the_rest_go_back(tmp_path):
    """Two members of one architecture train fused; one's learning rate makes its loss NaN at
    its first read-back while the other trains on. A Ctrl-C after that gives the training
    member back, and records the diverged one failed: a rerun would only diverge again."""
    space = SearchSpace("mlp-lr", lambda t: {
        "width": 16, "learning_rate": t.suggest_float("learning_rate", 1e-3, 1e21, log=True)},
        SPACE.build)
    handle = open_study("diverged", study_dir=tmp_path, direction="minimize",
                        sampler="random", pruner="none", seed=0)
    for lr in (1e-2, 1e20):
        handle.study.enqueue_trial({"learning_rate": lr})
    source = OptunaTrialSource(handle, space, 2, root=tmp_path)
    # steps to spare: on a fast machine 1,000 steps ended before an update saw step 50
    config = EngineConfig(steps=20_000, budget=Budget(BUDGET), max_batch_size=16, log_every=5,
                          checkpoint_every=200, fuse=2)
    engine = SearchEngine(space, Regression(), source, config, devices=jax.devices()[:1],
                          checkpoint_root=tmp_path / "ckpt", on_update=_CtrlC(50))
    with pytest.raises(KeyboardInterrupt):
        engine.run()
    source.close()
    trained, diverged = handle.study.get_trials()[:2]
    assert trained.user_attrs["fail_reason"] == "interrupted"
    assert diverged.state == TrialState.FAIL and diverged.user_attrs["fused_group"] == 0
    assert diverged.user_attrs["fail_reason"].startswith("FloatingPointError: loss is nan")
    waiting = handle.study.get_trials(states=(TrialState.WAITING,))
    assert [t.params["learning_rate"] for t in waiting] == [1e-2]  # only it runs again


def test_a_ctrl_c_while_groups_are_queued_gives_every_member_back(tmp_path):
    """A Ctrl-C that lands while the engine queues the groups it formed (the trials have left
    the forming buffer, not all are queued yet) reaches the loop once every group is queued:
    every trial goes back to the study, none is left running for a heartbeat to find."""
    study, source, engine = _study(tmp_path, trials=4, fuse=2, steps=10)
    form, queue, forming = engine._form, engine._queue, []

    def form_and_watch() -> None:
        forming.append(True)
        try:
            form()
        finally:
            forming.pop()

    def queue_with_a_ctrl_c(unit) -> None:
        if forming and not getattr(engine, "pressed", False):
            engine.pressed = True
            os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, at this moment
        queue(unit)

    engine._form, engine._queue = form_and_watch, queue_with_a_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        engine.run()
    source.close()
    assert getattr(engine, "pressed", False), "no group was formed"
    trials = study.get_trials()
    assert [t.number for t in trials if t.state == TrialState.RUNNING] == []


def test_the_fuse_flag_takes_a_width_or_auto(capsys):
    from experiments import swinir_hpo
    from experiments._cli import config_from_args

    args = swinir_hpo.parser().parse_args(["--preset", "smoke", "--fuse", "auto"])
    assert config_from_args(args, swinir_hpo.get_config("smoke"), "runs/x").fuse == 3  # trials
    args = swinir_hpo.parser().parse_args(["--fuse", "auto"])  # the default preset: 6 trials
    assert config_from_args(args, swinir_hpo.get_config(args.preset), "runs/x").fuse == 6
    args = swinir_hpo.parser().parse_args(["--fuse", "2"])
    assert config_from_args(args, swinir_hpo.get_config("smoke"), "runs/x").fuse == 2
    args = swinir_hpo.parser().parse_args(["--fuse", "4"])  # the smoke study has 3 trials
    assert config_from_args(args, swinir_hpo.get_config("smoke"), "runs/x").fuse == 3
    assert swinir_hpo.get_config("smoke").fuse is None  # off unless asked for
    with pytest.raises(SystemExit) as exit_info:
        swinir_hpo.parser().parse_args(["--fuse", "0"])
    assert exit_info.value.code == 2
    assert "--fuse: 0 must be at least 1 (1: no fusion), or auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        swinir_hpo.parser().parse_args(["--fuse", "1000"])
    assert "--fuse: --fuse 1000 asks for groups of more than 64 trials" in \
        capsys.readouterr().err
    args = swinir_hpo.parser().parse_args(["--fuse", "AUTO", "--trials", "20"])  # any case
    assert config_from_args(args, swinir_hpo.get_config("smoke"), "runs/x").fuse == "auto"


def test_plans_without_a_study_size_each_architectures_fused_group_as_the_engine_does():
    """`plan_candidates` (``--plan-only``) with ``fuse``: each candidate's row holds its
    architecture's widest fused group on its plan, the same group the engine's rule sizes
    (`plan_fusion` on that plan and batch), and what the group books per device."""
    from scamp_jax.hpo.preview import format_rows, plan_candidates

    settings = SearchSettings(trials=3, steps=1, fuse=3, sampler="random", max_batch_size=16,
                              seed=3)
    rows = plan_candidates(SPACE, Regression(), settings, devices=jax.devices()[:1],
                           memory_per_device=BUDGET, count=2)
    task = Regression()
    for row in rows:
        plan = make_plan(row.params, jax.devices()[:1], max_batch=16)
        assert (row.batch_size, row.bytes_per_device) == (plan.batch_size,
                                                          plan.predicted_peak_bytes)
        model = nnx.eval_shape(lambda p=row.params: SPACE.build(p, nnx.Rngs(0)))
        group = plan_fusion(model, task.sample_batch(1), max_width=3, plan=plan,
                            batch_size=plan.batch_size, optimizer=make_optimizer(row.params),
                            loss_fn=task.loss_fn)
        assert (row.fusion_width, row.group_bytes_per_device) == (group.width,
                                                                  group.predicted_peak_bytes)
        assert row.fusion_width == 3
    # as a study asks them: the proposal, then a sibling of its architecture whose learning
    # rate the sampler draws, planned with the proposal's plan (nothing compiled for it)
    assert rows[0].compiles >= 1 and rows[0].planned_with is None
    assert rows[1].params["width"] == rows[0].params["width"]
    assert rows[1].params["learning_rate"] != rows[0].params["learning_rate"]
    assert (rows[1].planned_with, rows[1].compiles) == (0, 0)
    assert "x3" in format_rows(rows).splitlines()[1].split()
    # a warm start is asked first and alone, as a study asks it: the first proposal after it
    # has the siblings
    warm = {"width": 64, "learning_rate": 0.01}
    started = plan_candidates(SPACE, Regression(), dataclasses.replace(
        settings, initial_params=(warm,)), devices=jax.devices()[:1],
        memory_per_device=BUDGET, count=3)
    assert started[0].params == warm
    assert started[2].params["width"] == started[1].params["width"]
    assert started[2].params["learning_rate"] != started[1].params["learning_rate"]
    # a study of 2 trials fuses 2 at most, "auto" or not
    two = plan_candidates(SPACE, Regression(), dataclasses.replace(settings, trials=2,
                                                                   fuse="auto"),
                          devices=jax.devices()[:1], memory_per_device=BUDGET, count=1)
    assert two[0].fusion_width == 2
    # without fuse on CPU devices nothing is grouped
    solo = plan_candidates(SPACE, Regression(), dataclasses.replace(settings, fuse=None),
                           devices=jax.devices()[:1], memory_per_device=BUDGET, count=1)
    assert solo[0].fusion_width == 1 and solo[0].group_bytes_per_device == 0


def test_a_preview_keeps_its_plans_in_the_plan_cache_and_compiles_none_of_them_again(tmp_path):
    """`plan_candidates` with the study's plan cache (``--plan-only``'s): the plans and fused
    groups it made are kept, so the same preview again, stopped or not, and the study
    compile none of them again, and plan the same."""
    from scamp_jax.hpo.preview import plan_candidates
    from scamp_jax.planning.compile_events import CompileCounter
    from scamp_jax.planning.plan_cache import PlanCache

    settings = SearchSettings(trials=3, steps=1, fuse=3, sampler="random", max_batch_size=16,
                              seed=3)

    def preview() -> list:
        return plan_candidates(SPACE, Regression(), settings, devices=jax.devices()[:1],
                               memory_per_device=BUDGET, count=3,
                               plan_cache=PlanCache(tmp_path / "plans.sqlite"))

    first = preview()
    assert first[0].compiles >= 2  # the plan and the fused group
    with CompileCounter() as compiled:
        again = preview()
    assert compiled.total == 0 and [r.compiles for r in again] == [0, 0, 0]

    def planned(rows: list) -> list:
        return [(r.params, r.batch_size, r.bytes_per_device, r.fusion_width,
                 r.group_bytes_per_device) for r in rows]

    assert planned(again) == planned(first)


def test_groups_of_mixed_widths_take_the_smallest_width():
    waiting = [FusionCandidate(k, "a", arrival=k, width=w) for k, w in enumerate((3, 2, 3, 3))]
    assert form_groups(waiting) == ((0, 1), (2, 3))


def test_a_stop_counts_the_members_still_running_not_one_that_failed_alone() -> None:
    """A fused group whose member already ended (failed alone) trains on: a stop's notice
    counts the members it stops at their next step, not that one (which goes back, or is
    told, by how it failed: here the group's run ends without a result, so all go back)."""
    import concurrent.futures as cf
    import threading
    from types import SimpleNamespace

    from scamp_jax.hpo.endings import Endings
    from scamp_jax.hpo.settings import EngineConfig
    from scamp_jax.planning.budget import Budget

    given: list[int] = []

    def record(state: str) -> SimpleNamespace:
        return SimpleNamespace(status=SimpleNamespace(state=state), earlier_wall=0.0)

    records = {0: record("failed"), 1: record("training"), 2: record("training")}
    endings = Endings(SimpleNamespace(interrupt=lambda n, wall_seconds: given.append(n)), "mse",
                      EngineConfig(steps=10, budget=Budget(2**26)), SimpleNamespace(), records,
                      now=lambda: 3.0, decide=lambda now: None, start=lambda *a: None,
                      queue=lambda planned: None, replan=lambda *a: None, notify=lambda: None)
    future: cf.Future = cf.Future()
    future.set_exception(RuntimeError("stopped"))  # ended without a result: all go back
    run = SimpleNamespace(key=0, members=[SimpleNamespace(number=n) for n in (0, 1, 2)],
                          stop=threading.Event(), future=future)
    notices: list[str] = []
    endings.give_back([run], [], notices.append)
    assert [n.split(" end at")[0] for n in notices] == ["stopping: 2 running trial(s)"]
    assert run.stop.is_set() and given == [0, 1, 2]


def test_a_stop_says_that_members_past_their_last_step_finish_and_are_kept() -> None:
    """A stop that comes while a group's members evaluate after their last step does not stop
    them (their results are told as they end; one whose evaluation raises goes back): its
    notice says so, and counts only the others as going back to the study."""
    import concurrent.futures as cf
    import threading
    from types import SimpleNamespace

    from scamp_jax.hpo.endings import Endings
    from scamp_jax.hpo.settings import EngineConfig
    from scamp_jax.planning.budget import Budget

    def record(step: int) -> SimpleNamespace:
        return SimpleNamespace(status=SimpleNamespace(state="training", step=step, steps=10),
                               earlier_wall=0.0)

    records = {0: record(10), 1: record(10), 2: record(3)}
    endings = Endings(SimpleNamespace(interrupt=lambda n, wall_seconds: None), "mse",
                      EngineConfig(steps=10, budget=Budget(2**26)), SimpleNamespace(), records,
                      now=lambda: 3.0, decide=lambda now: None, start=lambda *a: None,
                      queue=lambda planned: None, replan=lambda *a: None, notify=lambda: None)
    notices: list[str] = []

    def stop(numbers: tuple[int, ...]) -> str:
        future: cf.Future = cf.Future()
        future.set_exception(RuntimeError("stopped"))
        run = SimpleNamespace(key=numbers[0], members=[SimpleNamespace(number=n)
                                                       for n in numbers],
                              stop=threading.Event(), future=future)
        endings.give_back([run], [], notices.append)
        return notices.pop()

    said = stop((0, 1, 2))
    assert said.startswith("stopping: 1 running trial(s) end at their next step and go back "
                           "to the study, where a re-run resumes them"), said
    kept = ("finish their evaluation first (a result is kept; one whose evaluation raises goes "
            "back with the others); ")
    assert f"; 2 trial(s) past their last step {kept}" in said, said
    assert stop((0, 1)).startswith(f"stopping: 2 trial(s) past their last step {kept}")
