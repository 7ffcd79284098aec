"""Calibration: the allocator's measured peak against the ledger's booking, learnt as an
allowance that every later plan books (`scamp_jax.hpo.calibration`).

CPU devices report no allocator statistics, so the study-level tests replace the one reader,
``scamp_jax.devices.allocator_stats`` (a module attribute every caller looks up when it calls
it), with one that reports a fixed peak: the one fault these tests cannot cause for real.
Everything else (planning, booking, the runs, the plan cache, ``results.json``) is real.
"""

from __future__ import annotations

import io
import json
from typing import Any

import jax
import pytest
from rich.console import Console
from test_engine import BUDGET, build, settings, suggest
from test_runner import Regression

from scamp_jax import devices
from scamp_jax.hpo.calibration import Calibration, measure_peak, with_allowance
from scamp_jax.hpo.session import run_search
from scamp_jax.planning.budget import Budget
from scamp_jax.planning.plan_cache import PlanCache
from scamp_jax.planning.planner import plan_mesh
from scamp_jax.space import SearchSpace

MIB = 2**20


def _fixed_reader(peak: int) -> Any:
    """A stand-in for ``allocator_stats`` on CPU devices: every device reports ``peak``."""
    return lambda device: {"peak_bytes_in_use": peak, "bytes_in_use": peak // 2}


def test_the_peak_is_read_through_the_module_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = jax.devices()[:2]
    assert measure_peak(cpu) is None  # CPU devices report nothing
    reports = {cpu[0].id: {"peak_bytes_in_use": 5 * MIB}, cpu[1].id: {"peak_bytes_in_use": MIB}}
    monkeypatch.setattr(devices, "allocator_stats", lambda d: reports[d.id])
    assert measure_peak(cpu) == 5 * MIB


def test_an_excess_over_the_booking_grows_the_allowance_and_is_stored(tmp_path) -> None:
    cache = PlanCache(tmp_path / "plans.sqlite")
    calibration = Calibration(Budget(64 * MIB, 0.1), cache)
    assert calibration.allowance_bytes == 0
    assert not calibration.observe(10 * MIB, 10 * MIB, 0)  # as booked: nothing to learn
    assert calibration.observe(13 * MIB, 10 * MIB, 0)  # 3 MiB beyond the booking
    assert calibration.allowance_bytes == 3 * MIB
    # A booking that carried 3 MiB and was 1 MiB short: the allowance becomes 4 MiB.
    assert calibration.observe(15 * MIB, 14 * MIB, 3 * MIB)
    assert calibration.allowance_bytes == 4 * MIB
    assert not calibration.observe(11 * MIB, 10 * MIB, 0)  # never shrinks
    assert cache.get_allowance("cpu", "cpu")["bytes"] == 4 * MIB
    # The next study on this plan cache starts from it.
    assert Calibration(Budget(64 * MIB, 0.1), cache).allowance_bytes == 4 * MIB


def test_a_pool_of_two_kinds_learns_an_allowance_each_kinds_plans_read(tmp_path) -> None:
    """A pool of two GPU kinds (named together by its budget) stores what it learns under each
    kind, which is where a plan on any of its devices looks (`resolve_allowance`). The two
    devices are stand-ins with a platform and a kind: no such pool is here."""
    from types import SimpleNamespace

    from scamp_jax.planning.plan_cache import resolve_allowance

    kinds = ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB")
    cache = PlanCache(tmp_path / "plans.sqlite")
    budget = Budget(40 * 2**30, 0.1, platform="gpu", device_kind=",".join(kinds))
    assert Calibration(budget, cache).observe(30 * 2**30, 29 * 2**30, 0)
    pool = [SimpleNamespace(platform="gpu", device_kind=kind) for kind in kinds]
    assert resolve_allowance(None, pool, cache) == 2**30
    assert resolve_allowance(None, pool[1:], cache) == 2**30
    assert Calibration(budget, cache).allowance_bytes == 2**30


def test_a_plan_is_booked_with_the_allowance_or_planned_again() -> None:
    from flax import nnx

    model = nnx.eval_shape(lambda: build({"width": 16}, nnx.Rngs(0)))
    plan = plan_mesh(model, Regression().sample_batch(1), devices=1, memory_per_device=BUDGET,
                     max_batch_size=16, compile_for_run=False)
    calibration = Calibration(Budget(BUDGET, 0.1))
    calibration.allowance_bytes = 2 * MIB
    booked = calibration.refresh(plan)
    assert booked.allowance_bytes == 2 * MIB
    assert booked.predicted_peak_bytes == plan.predicted_peak_bytes + 2 * MIB
    assert with_allowance(booked, 2 * MIB) is booked
    calibration.allowance_bytes = plan.usable_bytes  # no room left beside it
    assert calibration.refresh(plan) is None


def test_a_study_learns_the_allowance_books_it_later_and_finishes(tmp_path, monkeypatch) -> None:
    """The reader reports more than any trial books: the first measured trial records it, the
    device kind's allowance becomes the excess, every trial started after that books it, and
    every trial completes."""
    peak = 6 * MIB
    monkeypatch.setattr(devices, "allocator_stats", _fixed_reader(peak))
    space = SearchSpace("mlp-calibrated", lambda t: {**suggest(t), "kind": "ok"}, build)
    run_search(space, Regression(), settings(str(tmp_path), trials=4, max_running_trials=1),
               devices=jax.devices()[:2], memory_per_device=BUDGET, live=False,
               console=Console(file=io.StringIO(), width=200))
    results = json.loads((tmp_path / "results.json").read_text())
    trials = sorted(results["trials"], key=lambda t: t["started_at"])
    assert [t["state"] for t in trials] == ["complete"] * 4
    assert all(t["measured_peak_bytes"] == peak for t in trials)
    allowance = results["run"]["allowance_bytes"]["cpu"]
    first = trials[0]
    assert first["booked_bytes"] < peak
    assert allowance >= peak - first["booked_bytes"] > 0
    for later in trials[1:]:  # started after the first had measured: booked with it
        assert later["booked_bytes"] >= allowance
        assert later["booked_bytes"] <= results["run"]["usable_bytes_per_device"]
    stored = PlanCache(tmp_path / "plans.sqlite").get_allowance("cpu", "cpu")
    assert stored is not None and stored["bytes"] == allowance
    # what each measurement that grew it saw is in the run's record, the last its value
    grew = results["run"]["allowance_grew"]
    assert grew and grew[-1]["bytes"] == allowance
    assert all(g["measured_peak_bytes"] == peak for g in grew)


def test_a_fused_study_learns_from_its_groups_and_finishes(tmp_path, monkeypatch) -> None:
    """A fused group measures and is calibrated by the same code as a solo trial: its members
    record the group's booking and the measured peak, and every member completes."""
    peak = 6 * MIB
    monkeypatch.setattr(devices, "allocator_stats", _fixed_reader(peak))
    space = SearchSpace("mlp-fused", lambda t: {**suggest(t), "kind": "ok"}, build)
    run_search(space, Regression(), settings(str(tmp_path), trials=4, fuse=2,
                                             max_running_trials=1),
               devices=jax.devices()[:2], memory_per_device=BUDGET, live=False,
               console=Console(file=io.StringIO(), width=200))
    results = json.loads((tmp_path / "results.json").read_text())
    trials = results["trials"]
    assert [t["state"] for t in trials] == ["complete"] * 4
    assert any(t["fused_group"] is not None for t in trials)
    assert all(t["measured_peak_bytes"] == peak for t in trials)
    allowance = results["run"]["allowance_bytes"]["cpu"]
    assert allowance > 0
    first = min(t["started_at"] for t in trials)
    later = [t for t in trials if t["started_at"] > first]
    assert later and all(t["booked_bytes"] >= allowance for t in later)


SPACE_OK = SearchSpace("mlp-grown", lambda t: {**suggest(t), "kind": "ok"}, build)


def test_a_plan_on_more_devices_answered_after_the_allowance_grew_books_it(tmp_path) -> None:
    """A lone last-wave trial's plan on more devices is asked with the allowance of its time,
    and the allowance grows while it compiles (here a measurement is observed from inside the
    planner call, to make that order certain; CPU devices measure nothing themselves): the
    trial starts on that plan booking the allowance learnt meanwhile, as a plan queued after
    the measurement does."""
    from test_engine import config, make_source, ok

    from scamp_jax.hpo.engine import SearchEngine
    from scamp_jax.planning import planner

    engines: list[SearchEngine] = []
    learnt = 3 * MIB

    def a_measurement_meanwhile(model: Any, batch: Any, *, devices: Any, **kw: Any) -> Any:
        if len(devices) > 1:
            assert kw["allowance_bytes"] == 0  # asked before anything was learnt
            assert engines[0].calibration.observe(learnt, 0, 0)
        return planner.plan_mesh(model, batch, devices=devices, **kw)

    study, source = make_source(tmp_path, [ok(16)])
    engine = SearchEngine(SPACE_OK, Regression(), source,
                          config(reference_batch=8, elastic="on"), devices=jax.devices()[:4],
                          plan_fn=a_measurement_meanwhile)
    engines.append(engine)
    engine.run()
    assert engine.calibration.allowance_bytes == learnt
    (trial,) = study.get_trials()
    assert trial.state.name == "COMPLETE"
    assert len(trial.user_attrs["devices"]) == 4  # it started on the plan asked for
    assert trial.user_attrs["booked_bytes"] >= learnt


def test_learning_compares_the_peak_with_the_most_booked_on_any_of_the_units_devices() -> None:
    """A unit on two devices whose ledger booked 10 and 12 MiB there: a measured peak of 12 MiB
    (the allocator's largest over the devices) is what was booked, not 2 MiB beyond it."""
    from types import SimpleNamespace

    calibration = Calibration(Budget(64 * MIB, 0.1))
    record = SimpleNamespace(status=SimpleNamespace(measured_peak_bytes=12 * MIB),
                             calibrated=None, booked_allowance=0)
    core = SimpleNamespace(running={7: (0, 1)},
                           pool=SimpleNamespace(high_water=[10 * MIB, 12 * MIB]))
    assert not calibration.learn({7: record}, core)
    assert calibration.allowance_bytes == 0 and record.calibrated == 12 * MIB
    record.status.measured_peak_bytes = 13 * MIB  # 1 MiB beyond the most booked
    assert calibration.learn({7: record}, core)
    assert calibration.allowance_bytes == MIB


def test_a_plan_whose_booking_fills_the_usable_bytes_exactly_is_kept() -> None:
    from flax import nnx

    from scamp_jax.scheduling.booking import booked_bytes

    model = nnx.eval_shape(lambda: build({"width": 16}, nnx.Rngs(0)))
    plan = plan_mesh(model, Regression().sample_batch(1), devices=1, memory_per_device=BUDGET,
                     max_batch_size=16, compile_for_run=False)
    calibration = Calibration(Budget(BUDGET, 0.1))
    # the allowance that makes the plan's booking the usable bytes to the byte
    calibration.allowance_bytes = calibration.budget.usable_bytes - booked_bytes(plan)
    assert calibration.allowance_bytes > 0
    booked = calibration.refresh(plan)
    assert booked is not None and booked_bytes(booked) == calibration.budget.usable_bytes
    calibration.allowance_bytes += 1  # one byte more does not fit
    assert calibration.refresh(plan) is None


def test_a_plan_keeps_an_allowance_larger_than_the_one_learnt() -> None:
    """A plan made with a larger allowance than the study has learnt (given by the user, or
    read from the plan cache by a plan on other devices) is not booked with less."""
    from flax import nnx

    model = nnx.eval_shape(lambda: build({"width": 16}, nnx.Rngs(0)))
    plan = plan_mesh(model, Regression().sample_batch(1), devices=1, memory_per_device=BUDGET,
                     max_batch_size=16, compile_for_run=False, allowance_bytes=MIB)
    assert plan.allowance_bytes == MIB
    calibration = Calibration(Budget(BUDGET, 0.1))
    assert calibration.allowance_bytes == 0
    assert calibration.refresh(plan).allowance_bytes == MIB


def test_a_runs_measured_peak_is_read_again_after_its_final_evaluation(monkeypatch) -> None:
    """A run reads the allocator's peak after its first two steps and again after its final
    evaluation (whose forward may hold more than training did): it records the larger. The
    reader reports a peak that grows at each reading."""
    from test_runner import SPACE, make_plan, spec

    from scamp_jax.hpo.runner import TrialStatus, run_trial

    config = {"width": 16, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:1])
    readings: list[int] = []

    def growing(device: Any) -> dict[str, int]:
        readings.append((len(readings) + 1) * MIB)
        return {"peak_bytes_in_use": readings[-1]}

    monkeypatch.setattr(devices, "allocator_stats", growing)
    status = TrialStatus(0, config)
    result = run_trial(spec(config, plan, steps=5), SPACE, Regression(), status=status)
    assert result.state == "complete", result.reason
    assert len(readings) == 2  # after step 2 and after the final evaluation
    assert result.measured_peak_bytes == status.measured_peak_bytes == 2 * MIB


def test_a_device_that_reports_no_peak_is_skipped_not_an_error(monkeypatch) -> None:
    """An allocator may report statistics without ``peak_bytes_in_use`` (a backend that keeps
    none): such a device adds nothing to the measurement, and a unit on it alone measures
    nothing; the run does not fail for it."""
    cpu = jax.devices()[:2]
    reports = {cpu[0].id: {"bytes_in_use": 9 * MIB}, cpu[1].id: {"peak_bytes_in_use": 3 * MIB}}
    monkeypatch.setattr(devices, "allocator_stats", lambda d: reports[d.id])
    assert measure_peak(cpu) == 3 * MIB
    assert measure_peak(cpu[:1]) is None


def test_an_allowance_given_with_the_budget_is_where_learning_starts(tmp_path) -> None:
    """A budget that books an allowance (the user's) starts the study there, as a stored one
    does: plans are asked with it, and a smaller excess does not lower or replace it."""
    budget = Budget(64 * MIB, 0.1, allowance_bytes=2 * MIB)
    calibration = Calibration(budget, PlanCache(tmp_path / "plans.sqlite"))
    assert calibration.allowance_bytes == 2 * MIB
    assert calibration.by_kind == {"cpu": 2 * MIB}
    assert not calibration.observe(11 * MIB, 10 * MIB, 0)  # 1 MiB short: the 2 MiB cover it
    assert calibration.allowance_bytes == 2 * MIB


def test_the_allowance_is_reported_under_the_device_kind_not_the_platform() -> None:
    """``results.json`` keys the allowance by what it was learnt on (a GPU's kind, as the plan
    cache stores it), not by the platform that all kinds share."""
    budget = Budget(40 * 2**30, 0.1, platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    calibration = Calibration(budget)
    assert calibration.observe(30 * 2**30, 29 * 2**30, 0)
    assert calibration.by_kind == {"NVIDIA H100 80GB HBM3": 2**30}


def test_a_measurement_within_its_booking_teaches_nothing_whatever_allowance_it_carried() -> None:
    """Only an excess over the booking is learnt. A unit that carried a larger allowance than
    the study's (given by the user, or read for another kind) and measured its booking or less
    has shown no memory XLA does not see: the study's allowance stays, and nothing is
    recorded. An excess that asks for the allowance the study already has is no growth
    either (the engine books every queued unit again on a growth)."""
    calibration = Calibration(Budget(64 * MIB, 0.1))
    assert not calibration.observe(10 * MIB, 10 * MIB, 5 * MIB)  # exactly as booked
    assert not calibration.observe(9 * MIB, 10 * MIB, 5 * MIB)  # 1 MiB under it
    assert calibration.allowance_bytes == 0 and calibration.observations == []
    assert calibration.observe(13 * MIB, 10 * MIB, 0)
    assert calibration.observations == [{"bytes": 3 * MIB, "measured_peak_bytes": 13 * MIB,
                                         "booked_bytes": 10 * MIB, "booked_allowance": 0}]
    assert not calibration.observe(14 * MIB, 12 * MIB, MIB)  # needs 3 MiB: what it has
    assert calibration.allowance_bytes == 3 * MIB and len(calibration.observations) == 1


def test_one_units_growth_is_not_undone_by_a_later_units_measurement() -> None:
    """Two running units measure at once: the first one's excess grows the allowance, the
    second was booked enough. ``learn`` says it grew, so the engine books its queued units
    again (the order the units are visited in must not matter)."""
    from types import SimpleNamespace

    for order in ((7, 8), (8, 7)):
        calibration = Calibration(Budget(64 * MIB, 0.1))
        records = {7: SimpleNamespace(status=SimpleNamespace(measured_peak_bytes=13 * MIB),
                                      calibrated=None, booked_allowance=0),
                   8: SimpleNamespace(status=SimpleNamespace(measured_peak_bytes=5 * MIB),
                                      calibrated=None, booked_allowance=0)}
        core = SimpleNamespace(running={7: (0,), 8: (1,)},
                               pool=SimpleNamespace(high_water=[10 * MIB, 10 * MIB]))
        assert calibration.learn({k: records[k] for k in order}, core)
        assert calibration.allowance_bytes == 3 * MIB


def test_a_plan_is_booked_with_exactly_the_allowance_it_is_given() -> None:
    """`with_allowance` replaces a plan's allowance, a smaller one too (`Calibration.refresh`
    is what keeps the larger of the two)."""
    from flax import nnx

    model = nnx.eval_shape(lambda: build({"width": 16}, nnx.Rngs(0)))
    plan = plan_mesh(model, Regression().sample_batch(1), devices=1, memory_per_device=BUDGET,
                     max_batch_size=16, compile_for_run=False, allowance_bytes=2 * MIB)
    smaller = with_allowance(plan, MIB)
    assert smaller.allowance_bytes == MIB
    assert smaller.predicted_peak_bytes == plan.predicted_peak_bytes - MIB
