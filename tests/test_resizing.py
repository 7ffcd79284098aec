"""Tail resizing in the search loop (`scamp_jax.hpo.resizing`): a restart keeps the trial's
global batch."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import jax

from scamp_jax.scheduling.elastic import Resize
from scamp_jax.scheduling.placement import DeviceOption


def test_a_restart_planned_at_another_global_batch_is_withdrawn():
    from concurrent.futures import Future

    from scamp_jax.hpo.resizing import TailResizer

    withdrawn = []
    core = SimpleNamespace(withdraw=lambda key, n: withdrawn.append((key, n)),
                           still_worth=lambda *a: True, restart_fits=lambda *a: True,
                           plan_of=lambda key: None, running={0: (0,)},
                           restarted=lambda *a: True)
    resizer = TailResizer(core, None, 4, submit=None, trial_plan=lambda p: None,
                          now=lambda: 1.0)
    logs = []
    planned = SimpleNamespace(plan=SimpleNamespace(batch_size=16), devices=1)
    record = SimpleNamespace(run=SimpleNamespace(members=[planned], stop=threading.Event()),
                             resizing=None, log=lambda *a: logs.append(a),
                             status=SimpleNamespace(state="running"), show_plan=lambda p: None)
    future = Future()
    future.set_result(SimpleNamespace(data_parallel=4, model_parallel=1, batch_size=12))
    resizer._book(Resize(0, (0, 1, 2, 3), DeviceOption(4, 1, 1.0)), future, record)
    assert withdrawn == [(0, 4)] and logs[0][0] == "withdrawn"
    assert record.resizing is None and not record.run.stop.is_set()


class _Tail:
    """A real `TailResizer` on a real scheduling core of ``pool`` devices (4 unless given) in
    the study's tail, with one solo trial running on device 0 at a batch of 16, its pace
    measured (a restart, of 1 s, on 4 devices pays). The planner threads are replaced by
    ``submit``, which writes down what it is asked and hands out a future the test answers;
    ``plans`` are the MLP's real plans at that batch on 1, 2 and 4 devices."""

    MIB = 2**20

    def __init__(self, refresh: Any = None, bytes_per_device: int | None = None,
                 pool: int = 4) -> None:
        from concurrent.futures import Future

        from test_runner import make_plan

        from scamp_jax.hpo.record import TrialRecord
        from scamp_jax.hpo.resizing import TailResizer
        from scamp_jax.hpo.study.trials import AskedTrial
        from scamp_jax.hpo.trial import PlannedTrial, TrialStatus
        from scamp_jax.planning.budget import Budget
        from scamp_jax.scheduling.core import SchedulingCore, TrialPlan
        from scamp_jax.scheduling.placement import ScampPolicy

        config = {"width": 16, "learning_rate": 1e-2}
        self.plans = {n: make_plan(config, jax.devices()[:n], max_batch=16) for n in (1, 2, 4)}
        assert all(int(p.batch_size) == 16 for p in self.plans.values())
        self.core = SchedulingCore(ScampPolicy(elastic=True), pool, Budget(64 * self.MIB), 1.0)
        self.core.set_arrivals_pending(False)
        self.core.planned(0.0, TrialPlan(0, 0, 1, self.MIB, 10_000, batch_size=16))
        assert [a.key for a in self.core.decide(0.0)] == [0]
        self.core.step_measured(1.0, 0, 100, 0.01)
        self.planned = PlannedTrial(AskedTrial(0, config, "trial_0"), self.plans[1], 1, 0)
        self.record = TrialRecord(TrialStatus(0, config), self.planned.asked)
        self.record.show_plan(self.plans[1])
        self.record.run = SimpleNamespace(members=[self.planned], stop=threading.Event())
        self.asked: list[tuple[int, int]] = []
        self.futures: list[Future] = []

        def submit(fn: Any, params: Any, *, devices: int, max_batch: int) -> Future:
            self.asked.append((devices, max_batch))
            self.futures.append(Future())
            return self.futures[-1]

        def trial_plan(planned: Any) -> TrialPlan:
            return TrialPlan(0, 0, planned.devices, bytes_per_device or self.MIB, 10_000,
                             data_parallel=planned.devices, batch_size=16)

        self.resizer = TailResizer(self.core, SimpleNamespace(plan=None), pool, submit, trial_plan,
                                   now=lambda: 2.0, **({"refresh": refresh} if refresh else {}))

    def tick(self) -> None:
        self.resizer.tick({0: self.record})


def test_a_restart_is_planned_once_at_its_batch_then_booked_and_the_trial_stopped():
    from scamp_jax.hpo.trial import booked_bytes

    tail = _Tail()
    tail.tick()
    assert tail.asked == [(4, 16)]  # all four devices, the trial's global batch
    tail.tick()  # its plan still compiles: not decided again
    assert tail.asked == [(4, 16)] and tail.resizer.futures() == tail.futures
    tail.futures[0].set_result(tail.plans[4])
    tail.tick()
    restart = tail.record.resizing
    assert restart is not None and tail.record.run.stop.is_set()
    assert (restart.grown.devices, restart.grown.plan) == (4, tail.plans[4])
    assert restart.placement.device_ids == (0, 1, 2, 3) == tail.core.running[0]
    assert restart.old_placement.device_ids == (0,)
    assert (restart.before, restart.old_plan.devices) == (tail.planned, 1)
    assert tail.record.status.state == "resizing"
    assert tail.record.status.predicted_peak_bytes == booked_bytes(tail.plans[4])
    assert tail.resizer.futures() == []


def test_a_restart_plan_on_another_device_count_or_over_the_learnt_allowance_is_withdrawn():
    """The planner answered a plan for other devices than decided, or the allowance learnt
    while it compiled leaves no room for it: the trial runs on where it is, and that device
    count is not decided for it again."""
    for answer, refresh in ((2, None), (4, lambda plan: None)):
        tail = _Tail(refresh=refresh)
        tail.tick()
        tail.futures[0].set_result(tail.plans[answer])
        tail.tick()
        assert tail.record.resizing is None and not tail.record.run.stop.is_set()
        assert tail.core.running[0] == (0,)
        assert [e[:3] for e in tail.record.times["core"]] == [["withdrawn", 2.0, 4]]
        assert 4 not in [devices for devices, _ in tail.asked[1:]]  # decided afresh, not on 4


def test_a_restart_no_longer_worth_it_or_not_booked_leaves_the_trial_running():
    """Its plan is in, but the trial is almost done by now (its latest pace), or the core
    cannot book the compiled plan on the devices (it needs more than the prediction left):
    the trial is neither stopped nor marked as restarting."""
    done = _Tail()
    done.tick()
    done.core.step_measured(2.0, 0, 9_990, 0.01)  # ten steps left
    done.futures[0].set_result(done.plans[4])
    done.tick()
    assert done.record.resizing is None and not done.record.run.stop.is_set()
    assert done.core.running[0] == (0,)
    heavy = _Tail(bytes_per_device=63 * _Tail.MIB)  # more than a device's usable bytes
    heavy.tick()
    heavy.futures[0].set_result(heavy.plans[4])
    heavy.tick()
    assert heavy.record.resizing is None and not heavy.record.run.stop.is_set()
    assert heavy.core.running[0] == (0,) and heavy.record.status.state != "resizing"


def test_a_restart_is_decided_only_on_device_counts_that_divide_its_batch():
    """On a pool of 3 the trial's batch of 16 goes on 2 devices, not 3 (a plan for 3 keeps no
    batch of 16: its compile would be spent for a withdrawal)."""
    tail = _Tail(pool=3)
    tail.tick()
    assert tail.asked == [(2, 16)]


def test_a_restart_whose_devices_another_trial_took_meanwhile_is_decided_afresh():
    """While the plan on devices 0-3 compiled, another trial started on device 1 (there was
    memory beside it). The trial must not restart onto a device it would share: it runs on,
    and the restart is decided again on the devices still idle."""
    from scamp_jax.scheduling.core import TrialPlan

    tail = _Tail(pool=5)
    tail.tick()
    tail.core.planned(2.0, TrialPlan(1, 1, 1, 40 * _Tail.MIB, 100_000, batch_size=16))
    assert [(a.key, a.device_ids) for a in tail.core.decide(2.0)] == [(1, (1,))]
    tail.futures[0].set_result(tail.plans[4])
    tail.tick()
    assert tail.record.resizing is None and not tail.record.run.stop.is_set()
    assert tail.core.running == {0: (0,), 1: (1,)}
    assert tail.asked == [(4, 16), (4, 16)]  # decided afresh


def test_a_restart_that_fails_before_training_goes_back_to_the_devices_it_trained_on():
    """The restart on 4 devices is booked and the trial stopped; its run on the 4 ends out of
    memory before a step trained. The trial goes back to device 0 with the plan it trained on
    (booked there again, shown, logged ``moved_back``), and 4 devices are not offered to it
    again; a restart that trained and then failed is the trial's own ending instead."""
    from scamp_jax.hpo.endings import Endings
    from scamp_jax.hpo.settings import EngineConfig
    from scamp_jax.hpo.trial import RunResult
    from scamp_jax.planning.budget import Budget

    def ended(tail: _Tail, *, trained: bool) -> tuple[Any, list[Any]]:
        started: list[Any] = []
        endings = Endings(SimpleNamespace(), "mse", EngineConfig(steps=10, budget=Budget(2**26)),
                          tail.core, {0: tail.record}, now=lambda: 3.0, decide=lambda now: None,
                          start=lambda unit, ids, now: started.append((unit, tuple(ids))),
                          queue=lambda planned: None, replan=lambda planned, request: None,
                          notify=lambda: None)
        tail.tick()
        tail.futures[0].set_result(tail.plans[4])
        tail.tick()
        assert tail.record.resizing is not None
        endings.run_ended(0, RunResult(0, "interrupted", 40, 1.0))
        assert [ids for _, ids in started] == [(0, 1, 2, 3)]  # the restart's run
        [grown] = started[0][0].members
        assert grown.plan is tail.plans[4]
        tail.record.run = SimpleNamespace(members=[grown], stop=threading.Event())
        if trained:
            tail.record.status.training_since = float("inf")  # it trained on the 4
        endings.run_ended(0, RunResult(0, "oom", 40, 1.0, reason="out of memory: the test's"))
        return endings, started

    back = _Tail()
    shown: list[Any] = []
    back.record.show_plan = shown.append  # type: ignore[method-assign]
    _, started = ended(back, trained=False)
    assert [ids for _, ids in started] == [(0, 1, 2, 3), (0,)]
    [before] = started[1][0].members
    assert before is back.planned and before.plan is back.plans[1]
    assert back.core.running[0] == (0,) and shown[-1] is back.plans[1]
    assert [e[0] for e in back.record.times["core"]][-1] == "moved_back"
    assert back.core.growth.refused(0, 4)
    assert back.record.restarted is None and back.record.status.resizes == 1
    trained = _Tail()
    endings, started = ended(trained, trained=True)
    assert [ids for _, ids in started] == [(0, 1, 2, 3)]  # not moved back
    assert "moved_back" not in [e[0] for e in trained.record.times["core"]]
