"""The scheduling core: real CPU studies, replayed through the core, and its books.

The studies are real (MLP trials of ``test_engine`` in Optuna SQLite storage, real compiles and
training on CPU devices): one packed, one fused and stopped by a real SIGINT, then resumed. The
replay feeds their recorded arrivals, paces and durations to a fresh `SchedulingCore` and must
make the very same placements.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import pytest
from test_engine import build, settings, suggest
from test_runner import Regression
from test_study_lifecycle import ROOT, TESTS, child_env

from scamp_jax.hpo.fused_engine import latest_checkpoint_step
from scamp_jax.hpo.out_of_memory import next_request
from scamp_jax.hpo.session import run_search
from scamp_jax.planning.budget import Budget
from scamp_jax.scheduling import SchedulingCore, TrialPlan
from scamp_jax.scheduling.costs import resized_seconds
from scamp_jax.scheduling.placement import ScampPolicy
from scamp_jax.scheduling.replay import recorded_placements, replay, units
from scamp_jax.space import SearchSpace

MIB = 2**20
BUDGET = 32_000


@pytest.fixture(scope="module")
def packed_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Eight MLP trials on two CPU devices. Each trial's plan books about 10 KB per device:
    the 32,000-byte budget would hold three of them, its usable 90% only two."""
    study_dir = tmp_path_factory.mktemp("packed")
    space = SearchSpace("mlp-ok", lambda t: {**suggest(t), "kind": "ok"}, build)
    run_search(space, Regression(), settings(str(study_dir), trials=8, steps=40,
                                             reference_batch=None, checkpoint_every=0),
               devices=jax.devices()[:2], memory_per_device=BUDGET, live=False)
    return study_dir, json.loads((study_dir / "results.json").read_text())


#: The fused study's trials: long enough that a Ctrl-C sent once a checkpoint at most halfway is
#: saved lands well before their ends on a fast machine too.
FUSED_STEPS = 160

#: A child process that runs the fused study in the directory given as its argument, inside the
#: entry points' error handler (Ctrl-C exits 130). It takes Ctrl-C as a study started from a
#: terminal does: a process started as a background job of a non-interactive shell (``pytest
#: ... &`` in a script) ignores SIGINT, and its children inherit that.
FUSED_DRIVER = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
import sys
from scamp_jax.devices import configure_cpu_devices
configure_cpu_devices(8)
sys.path.insert(0, {tests!r})
from test_scheduling import run_fused_study
from experiments._cli import user_errors
with user_errors():
    run_fused_study(sys.argv[1])
"""


def run_fused_study(study_dir: str) -> None:
    """Four MLP trials in fused groups of two on two CPU devices (run or resumed)."""
    # One architecture (compiled once) in groups of two, with their own learning rates.
    space = SearchSpace("mlp-16", lambda t: {
        "width": t.suggest_categorical("width", [16]), "kind": "ok",
        "learning_rate": t.suggest_float("learning_rate", 1e-4, 3e-2, log=True)}, build)
    study = settings(study_dir, trials=4, steps=FUSED_STEPS, reference_batch=None,
                     checkpoint_every=10, fuse=2)
    run_search(space, Regression(), study, devices=jax.devices()[:2],
               memory_per_device=40_000, live=False)


@pytest.fixture(scope="module")
def resumed_fused_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The fused study (`run_fused_study`) run by a process that a real SIGINT (Ctrl-C) stops
    once a running trial has saved a checkpoint, then run again here: the second run resumes
    the stopped trials from their checkpoints and runs the rest.

    The first run is a process of its own, as a user's study is: the SIGINT goes to that
    process from outside, and nothing this test process did before can stand in its way.
    """
    study_dir = tmp_path_factory.mktemp("fused")
    command = [sys.executable, "-c", FUSED_DRIVER.format(tests=str(TESTS)), str(study_dir)]
    proc = subprocess.Popen(command, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    root = study_dir / "checkpoints"
    deadline = time.monotonic() + 240
    try:
        while not (root.is_dir() and any(0 < latest_checkpoint_step(p) <= FUSED_STEPS // 2
                                         for p in root.iterdir())):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the first run saved no checkpoint at most halfway before it ended "
                            f"or in 240 s:\n{proc.communicate()[0]}")
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)  # as Ctrl-C
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out  # stopped by the Ctrl-C, not run to its end
    assert "Traceback" not in out, out
    assert "stopping: " in out, out  # the user is told what happens to the running trials
    first = json.loads((study_dir / "results.json").read_text())
    assert [run["interrupted"] for run in first["runs"]] == [True], first["runs"]
    assert len(first["trials"]) < 4, first["trials"]  # trials were left to resume
    assert first["runs"][0]["trials_this_run"] == len(first["trials"])
    # Its figures up to the Ctrl-C: the pool's memory booked and where the time went.
    interrupted = first["runs"][0]
    assert interrupted["usage"]["peak_memory_utilization"] > 0, interrupted
    assert interrupted["overhead"]["planning_compiles"] >= 1, interrupted
    assert interrupted["timeline"]["intervals"], interrupted
    run_fused_study(str(study_dir))
    return study_dir, json.loads((study_dir / "results.json").read_text())


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_replay_of_a_resumed_fused_study_makes_the_same_placements(resumed_fused_study) -> None:
    study_dir, results = resumed_fused_study
    assert len(results["runs"]) == 2  # stopped, then resumed
    last = units(results)  # the scheduled units of the second run
    # It restarted trials the SIGINT stopped (from their checkpoints) and trained fused groups.
    trials = [t for t in results["trials"] if t["run_started"] == results["run"]["run_started"]]
    assert any(t["resumed_from"] > 0 for t in trials)
    assert any(t["fusion_width"] >= 2 for t in last.values())
    recorded = recorded_placements(results)
    assert len(recorded) >= len(last)
    assert replay(results) == recorded
    # The command line says that it replays the last of the study's two runs.
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.simulate_cluster", "--replay",
         str(study_dir), "--json"], cwd=ROOT, capture_output=True, text=True,
        check=True)
    assert json.loads(proc.stdout) == {"placements": [[n, list(ids)] for n, ids in recorded]}
    assert "the study ran 2 times (it was resumed); this replays its last run only" in proc.stderr


def _run(results: dict[str, Any]) -> dict[str, Any]:
    run = results["run"]
    return run[-1] if isinstance(run, list) else run


def test_replay_of_a_real_packed_study_makes_the_same_placements(packed_study) -> None:
    study_dir, results = packed_study
    recorded = recorded_placements(results)
    assert len(recorded) == 8
    assert replay(results) == recorded
    # The command line prints the same.
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.simulate_cluster", "--replay", str(study_dir),
         "--json"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"placements": [[n, list(ids)] for n, ids in recorded]}


def test_a_packed_study_never_books_a_device_above_its_usable_bytes(packed_study) -> None:
    _, results = packed_study
    run = _run(results)
    usable = run["usable_bytes_per_device"]
    assert usable == Budget(run["memory_per_device"], run["safety_margin"]).usable_bytes
    assert usable < run["memory_per_device"]
    assert run["policy_parts"]["policy"] == "scamp"
    # on CPU devices the last wave does not grow (--elastic auto), and the record says so
    assert run["policy_parts"]["elastic"] is False
    assert run["policy_parts"]["grow_last_wave"] is False
    assert all(t["state"] == "complete" and t["replans"] == 0 for t in results["trials"])
    # Sweep each device's bookings over time: distinct trials only, at their booked bytes.
    peak_trials = 0
    for device in range(run["pool_devices"]):
        events = []
        for t in results["trials"]:
            if device in t["devices"]:
                events += [(t["started_at"], 1, t["plan"]["bytes_per_device"], t["number"]),
                           (t["finished_at"], -1, t["plan"]["bytes_per_device"], t["number"])]
        booked, holders = 0, set()
        for _, sign, nbytes, number in sorted(events, key=lambda e: (e[0], e[1])):
            booked += sign * nbytes
            holders = holders | {number} if sign > 0 else holders - {number}
            assert booked <= usable, f"device {device} booked {booked} > usable {usable}"
            peak_trials = max(peak_trials, len(holders))
    # The study did pack (trials shared a device). How many overlap depends on which trials'
    # runs meet in time (their plans differ in size); the bound above holds whatever they are,
    # and three of the largest would fit the whole budget, so it is the usable share that binds.
    assert peak_trials >= 2
    assert 3 * max(t["plan"]["bytes_per_device"] for t in results["trials"]) <= BUDGET


def test_a_group_that_ran_out_of_memory_leaves_each_member_its_own_paces() -> None:
    """A fused group's paces are copied to its members when it ends; members that then run
    alone (the group ran out of memory) each record their own paces, which the replay reads
    as that trial's timeline: one member's must not land in another's. The group's end is
    fed to `Endings.group_ended` with the records the engine keeps; the core, the study and
    the out-of-memory queue are stand-ins that only record what they are told."""
    from types import SimpleNamespace

    from scamp_jax.hpo.endings import Endings
    from scamp_jax.hpo.record import TrialRecord
    from scamp_jax.hpo.study.trials import AskedTrial
    from scamp_jax.hpo.trial import RunResult, TrialStatus

    records = {n: TrialRecord(TrialStatus(n, {}), AskedTrial(n, {}, f"trial_{n}"))
               for n in (0, 1)}
    records[0].times["pace"].append([2.0, 2, 0.5, 1.0])  # the group's, on its leader's record
    members = [SimpleNamespace(number=0), SimpleNamespace(number=1)]
    records[0].run = records[1].run = SimpleNamespace(members=members)
    alone: list[int] = []
    endings = object.__new__(Endings)
    endings.records, endings.now, endings.decide = records, lambda: 5.0, lambda now: None
    endings.core = SimpleNamespace(finished=lambda now, key: None)
    endings.oom = SimpleNamespace(member_ended=lambda planned: alone.append(planned.number))
    endings.report = lambda planned, result: None
    endings.group_ended(0, [RunResult(0, "oom", 3, 1.0), RunResult(1, "oom", 3, 1.0)])
    assert alone == [0, 1] and records[1].times["pace"] == [[2.0, 2, 0.5, 1.0]]
    records[1].times["pace"].append([7.0, 2, 0.9, 5.5])  # member 1 alone
    assert records[0].times["pace"] == [[2.0, 2, 0.5, 1.0]]


def test_the_pool_books_usable_bytes_not_the_whole_budget() -> None:
    core = SchedulingCore(ScampPolicy(), 1, Budget(100 * MIB, 0.1))
    assert core.pool.capacity == (90 * MIB,)
    core.planned(0.0, TrialPlan(0, 0, 1, 50 * MIB, 10))
    core.planned(0.0, TrialPlan(1, 1, 1, 45 * MIB, 10))
    # 95 MiB fit the budget but not its usable 90 MiB: only the first starts.
    assert [a.key for a in core.decide(0.0)] == [0]
    core.finished(1.0, 0)
    assert [a.key for a in core.decide(1.0)] == [1]


def test_an_out_of_memory_replan_scales_the_batch_by_the_measured_bytes() -> None:
    plan = TrialPlan(3, 0, 1, 40 * MIB, 10, batch_size=64)
    # Measured 4x the usable share: a quarter of the batch (not just half).
    assert next_request(plan, 360 * MIB, 90 * MIB, devices=4).max_batch == 16
    # Unknown bytes: half.
    assert next_request(plan, None, 90 * MIB, devices=4).max_batch == 32
    # Below the floor: the same batch on twice the devices; nowhere to grow: none.
    assert next_request(plan, 360 * MIB, 90 * MIB, devices=4, min_batch=32).devices == 2
    assert next_request(plan, 360 * MIB, 90 * MIB, devices=1, min_batch=32) is None


def test_an_out_of_memory_replan_is_at_most_half_the_batch_a_multiple_of_its_groups() -> None:
    """A run that needed a little more than was usable is still planned again at half its
    batch at most (the bytes it needed are a lower bound: a step's peak is not linear in the
    batch); the cap is a multiple of the data-parallel degree; a cap at the floor is taken on
    the same devices; a policy that does not grow trials fails the trial instead of moving it
    to more devices."""
    plan = TrialPlan(3, 0, 1, 40 * MIB, 10, batch_size=64)
    assert next_request(plan, 100 * MIB, 90 * MIB, devices=4).max_batch == 32
    # 90/360 of 64 is 16: a multiple of 4; 90/400 of 64 is 14.4, rounded down to 12 for 4
    wide = TrialPlan(3, 0, 4, 40 * MIB, 10, data_parallel=4, batch_size=64)
    assert next_request(wide, 400 * MIB, 90 * MIB, devices=8).max_batch == 12
    # half the batch is the floor: the same devices at that batch, not twice the devices
    at_floor = next_request(plan, None, 90 * MIB, devices=4, min_batch=32)
    assert (at_floor.devices, at_floor.max_batch) == (1, 32)
    assert next_request(plan, 360 * MIB, 90 * MIB, devices=4, min_batch=32,
                        may_grow=False) is None


def test_busy_fractions_and_costs_come_from_measured_steps() -> None:
    core = SchedulingCore(ScampPolicy(), 2, Budget(100 * MIB, 0.1))
    core.planned(0.0, TrialPlan(0, 0, 1, MIB, 100, flops_per_step=1e9))
    core.planned(0.0, TrialPlan(1, 1, 1, MIB, 100, flops_per_step=4e9))
    assert core.busy_fraction(0) is None
    core.decide(0.0)
    core.step_measured(1.0, 0, 10, 0.01)  # 1e11 FLOP/s
    core.step_measured(2.0, 1, 10, 0.08)  # 5e10 FLOP/s: half the best rate
    assert core.busy_fraction(0) == pytest.approx(1.0)
    assert core.busy_fraction(1) == pytest.approx(0.5)
    assert core.snapshot().busy[1] + core.snapshot().busy[0] == pytest.approx(1.5)
    assert core.seconds(TrialPlan(2, 2, 1, MIB, 50, flops_per_step=2e9)) == pytest.approx(1.0)
    assert core.seconds(TrialPlan(3, 3, 1, MIB, 50)) is None


@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_the_core_books_the_load_of_its_device_overlap(overlap: float) -> None:
    # The booked busy fraction is the load the simulator charges: overlap * busy + (1 - overlap).
    core = SchedulingCore(ScampPolicy(), 2, Budget(100 * MIB, 0.1), peak_flops=1e11,
                          overlap=overlap)
    core.planned(0.0, TrialPlan(0, 0, 1, MIB, 100, flops_per_step=1e9))
    core.decide(0.0)
    core.step_measured(1.0, 0, 10, 0.04)  # a quarter of the attainable rate
    assert core.busy_fraction(0) == pytest.approx(0.25)
    assert core.snapshot().busy[0] == pytest.approx(overlap * 0.25 + 1 - overlap)
    with pytest.raises(ValueError, match="overlap=1.5 must be in"):
        SchedulingCore(ScampPolicy(), 2, Budget(100 * MIB, 0.1), overlap=1.5)


def test_a_restart_is_predicted_from_the_busy_part_and_the_time_since_the_last_measurement(
) -> None:
    # One trial on one of four devices, measured at a quarter of the attainable rate: on p
    # devices its compute takes 1/p as long, the rest of its step (launch gaps, host work) as
    # long as now; and it kept training since its last measurement.
    core = SchedulingCore(ScampPolicy(), 4, Budget(100 * MIB, 0.1), restart_seconds=1.0,
                          peak_flops=1e11, overlap=1.0)
    core.planned(0.0, TrialPlan(0, 0, 1, MIB, 1000, flops_per_step=1e9))
    core.set_arrivals_pending(False)
    core.decide(0.0)
    core.step_measured(20.0, 0, 100, 0.04)  # 900 steps left: 36 s at 20 s
    (resize,) = core.resizes(30.0, {0: (2, 4)})  # 26 s left at 30 s
    assert resize.option.devices == 4
    assert resize.option.seconds == pytest.approx(26 * (0.25 / 4 + 0.75) + 1.0)
    # On two devices it would save under the minimum gain (10% of 26 s): not an option taken.
    assert resized_seconds(26.0, 0.25, 1, 2) + 1.0 > 0.9 * 26
    assert resized_seconds(26.0, None, 1, 4) == pytest.approx(6.5)  # unknown: linear


def test_a_trial_taken_out_of_the_queue_loses_its_plans_on_more_devices():
    """Taken out to be booked again (a larger allowance learned), a queued trial's plans on
    more devices were booked the old way: the core forgets them, as on a re-plan."""
    core = SchedulingCore(ScampPolicy(), 4, Budget(100 * MIB, 0.1))
    plan = TrialPlan(0, 0, 1, 40 * MIB, 10, grow_bytes=80 * MIB)
    core.planned(0.0, plan)
    core.option_planned(0, 2, TrialPlan(0, 0, 2, 30 * MIB, 10))
    assert core.growth.plan(0, 2) is not None
    assert core.unqueue(1.0, 0) == plan
    assert core.growth.plan(0, 2) is None
    core.planned(1.0, plan)  # queued again: the option is asked for afresh
    assert core.growth.ask(0, 2)


def test_a_second_ctrl_c_stops_at_once_and_cleanly(tmp_path: Path) -> None:
    """Ctrl-C, then Ctrl-C again while the study gives its trials back: the process ends at
    once with exit status 130 and one line saying how to resume, no traceback (the
    interpreter's shutdown, which would meet the trials' threads half done, is skipped)."""
    study_dir = tmp_path / "twice"
    command = [sys.executable, "-c", FUSED_DRIVER.format(tests=str(TESTS)), str(study_dir)]
    proc = subprocess.Popen(command, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    root = study_dir / "checkpoints"
    deadline = time.monotonic() + 240
    lines: list[str] = []
    try:
        while not (root.is_dir() and any(latest_checkpoint_step(p) > 0 for p in root.iterdir())):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"no checkpoint before the run ended or in 240 s:\n"
                            f"{proc.communicate()[0]}")
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)  # as Ctrl-C
        assert proc.stdout is not None
        for line in proc.stdout:  # until the study says it is stopping its trials
            lines.append(line)
            if "stopping: " in line:
                proc.send_signal(signal.SIGINT)  # Ctrl-C again
                break
        out = "".join(lines) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert "stopped at once: " in out and "Traceback" not in out, out


def test_an_option_planned_on_another_device_count_is_refused():
    from scamp_jax.planning.budget import Budget
    from scamp_jax.scheduling import SchedulingCore, TrialPlan
    from scamp_jax.scheduling.placement import ScampPolicy

    mib = 2**20
    core = SchedulingCore(ScampPolicy(), 4, Budget(100 * mib, 0.1))
    core.planned(0.0, TrialPlan(0, 0, 1, 40 * mib, 10, grow_bytes=80 * mib))
    core.option_planned(0, 4, TrialPlan(0, 0, 2, 30 * mib, 10))  # the planner fell back to 2
    assert core.growth.plan(0, 4) is None and core.growth.refused(0, 4)


def test_one_step_resizes_skip_a_refused_count_and_restart_only_onto_idle_devices():
    """Trials 0 and 2 share device 0 (so the study's end is not planned as a whole: the one-step
    rules decide); once trial 1 ends, device 1 idles and the longer of them, ties to the first,
    restarts on both. A device count refused for trial 0 (its restart there failed) is not
    offered again: trial 2 takes the idle device instead. A restart fits only on the trial's
    own devices followed by idle ones."""
    core = SchedulingCore(ScampPolicy(), 2, Budget(100 * MIB, 0.1), restart_seconds=1.0,
                          peak_flops=1e11)
    for key in range(3):
        core.planned(0.0, TrialPlan(key, key, 1, MIB, 1000, flops_per_step=1e9))
    core.decide(0.0)
    core.set_arrivals_pending(False)
    assert core.running == {0: (0,), 1: (1,), 2: (0,)}
    for key in (0, 2):
        core.step_measured(10.0, key, 100, 0.01)  # fully busy, 9 s left
    assert not core.restart_fits(0, (0, 1))  # trial 1 still runs on device 1
    core.finished(10.0, 1)
    assert core.restart_fits(0, (0, 1)) and not core.restart_fits(0, (1, 0))
    reshapes = {0: (2,), 2: (2,)}
    assert [(r.key, r.device_ids) for r in core.resizes(10.0, reshapes)] == [(0, (0, 1))]
    core.withdraw(0, 2)
    assert [(r.key, r.device_ids) for r in core.resizes(10.0, reshapes)] == [(2, (0, 1))]


def test_no_running_trial_restarts_onto_devices_a_queued_trial_waits_for():
    """Trial 1 needs all four devices and waits for trial 0's: the three idle devices are kept
    for it, not given to trial 0 (a restart there would only delay trial 1)."""
    core = SchedulingCore(ScampPolicy(), 4, Budget(100 * MIB, 0.1), restart_seconds=1.0,
                          peak_flops=1e11)
    core.planned(0.0, TrialPlan(0, 0, 1, MIB, 1000, flops_per_step=1e9))
    core.decide(0.0)
    core.planned(1.0, TrialPlan(1, 1, 4, MIB, 1000, flops_per_step=1e9, data_parallel=4))
    core.set_arrivals_pending(False)
    assert core.decide(1.0) == () and core.queued == (1,)
    core.step_measured(10.0, 0, 100, 0.01)  # fully busy, 9 s left: 4 devices would save 6 s
    assert core.resizes(10.0, {0: (2, 4)}) == ()
    core.finished(12.0, 0)
    assert [a.key for a in core.decide(12.0)] == [1]


def test_a_last_wave_that_fills_the_idle_devices_exactly_is_planned_with_the_tail():
    """One idle device, one queued trial on one device: the study's end is planned as a whole
    (nothing can start later), so the trial starts with its predicted end (5 s of work at the
    measured rate), which the tail plan counts on until its pace is measured."""
    core = SchedulingCore(ScampPolicy(), 2, Budget(100 * MIB, 0.1), restart_seconds=1.0,
                          peak_flops=1e11)
    core.planned(0.0, TrialPlan(0, 0, 1, MIB, 1000, flops_per_step=1e9))
    core.decide(0.0)
    core.step_measured(10.0, 0, 100, 0.01)
    core.planned(10.0, TrialPlan(1, 1, 1, MIB, 500, flops_per_step=1e9))
    core.set_arrivals_pending(False)
    assert [(a.key, a.device_ids) for a in core.decide(10.0)] == [(1, (1,))]
    assert core.paces.runs[1].predicted_end == pytest.approx(15.0)
