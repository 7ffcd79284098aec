"""The HPO study across MPI ranks: rank 0 serves the Optuna study, every rank runs the search
engine on its own devices.

Tests marked ``mpi`` launch real processes under ``mpirun`` (``tests/mpi_scripts/hpo_mlp.py``: a
tiny MLP space through the same CLI path as ``experiments.swinir_hpo``). The others check, in this
process, the pieces that need no second rank: the trial-source adapter over the study server,
the per-rank log prefix, the span plan of a trial too big for one rank and how spanning trials
are grouped, and the install hint when mpi4py is missing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from _requirements import require_module

from scamp_jax._units import format_share
from scamp_jax.distributed.engine import RemoteTrialSource
from scamp_jax.distributed.mpi import MPIUnavailableError
from scamp_jax.distributed.spanning import SpanningTrial, SpanPlan, assign_rounds, span_plan
from scamp_jax.hpo.live import RankStream
from scamp_jax.hpo.study import (
    FAIL_REASON,
    INTERRUPTED,
    OptunaTrialSource,
    TrialOutcome,
    open_study,
)
from scamp_jax.hpo.study.owner import OWNER
from scamp_jax.space import SearchSpace

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "mpi_scripts" / "hpo_mlp.py"


# ----------------------------------------------------------------------------- one process
def test_rank_stream_prefixes_every_line_and_holds_partial_lines():
    out = io.StringIO()
    stream = RankStream(3, out)
    stream.write("trial 1 planning\ntrial 2 ")
    assert out.getvalue() == "[rank 3] trial 1 planning\n"
    stream.write("queued\n")
    assert out.getvalue().splitlines() == ["[rank 3] trial 1 planning", "[rank 3] trial 2 queued"]
    assert not stream.isatty()


def test_a_pseudo_terminal_without_a_size_is_not_a_terminal_to_draw_on():
    # What Open MPI gives each rank's stdout: a pty of 0 columns, whatever mpirun writes to.
    import fcntl
    import os
    import struct
    import termios

    from scamp_jax.hpo.live import is_terminal

    leader, follower = os.openpty()
    with os.fdopen(leader, "wb") as _, os.fdopen(follower, "w") as tty:
        assert tty.isatty() and os.get_terminal_size(tty.fileno()).columns == 0
        assert not is_terminal(tty)
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        assert is_terminal(tty)  # a terminal window reports its size
    assert not is_terminal(io.StringIO())


def test_the_supernet_experiment_logs_plain_lines_to_a_ranks_pseudo_terminal(monkeypatch):
    """The supernet experiment's console is the study's (`log_console`): on a rank's size-less
    pseudo-terminal it writes no colour or cursor codes, on a terminal window it draws."""
    import os
    import struct
    import termios

    from search_spaces.supernet_nas import _console

    leader, follower = os.openpty()
    with os.fdopen(leader, "rb", buffering=0) as screen, os.fdopen(follower, "w") as tty:
        monkeypatch.setattr(sys, "stdout", tty)
        _console(quiet=False).print("[bold]supernet[/bold]: 4 layers")
        tty.flush()
        written = screen.read(4096)
        assert b"supernet: 4 layers" in written and b"\x1b[" not in written, written
        import fcntl

        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        _console(quiet=False).print("[bold]supernet[/bold]")
        tty.flush()
        assert b"\x1b[1m" in screen.read(4096)


def test_ranks_timeline_puts_every_ranks_devices_in_one_pool():
    from scamp_jax.distributed.engine import combined_usage
    from scamp_jax.hpo.report import device_labels, ranks_timeline

    # Rank 0: 2 devices, half its memory from 0 to 10 s; rank 1: 1 device (its only interval
    # list given), full from 5 to 20 s.
    timeline = ranks_timeline(
        [{"intervals": [[[0, 0.0, 10.0, 64]], []], "memory_series": [[0.0, 10.0], [0.5, 0.0]]},
         {"intervals": [[[1, 5.0, 20.0, 64]]], "memory_series": [[0.0, 5.0, 20.0],
                                                                 [0.0, 1.0, 0.0]]}],
        [2, 1])
    assert timeline["intervals"] == [[[0, 0.0, 10.0, 64]], [], [[1, 5.0, 20.0, 64]]]
    # The plots name each row by its rank and that rank's device, where every run had the
    # same ranks (a resumed run on other ranks leaves rows numbered: no row is one device).
    assert timeline["devices_per_rank"] == [2, 1]
    assert device_labels([{"timeline": timeline}] * 2) == ["rank 0:0", "rank 0:1", "rank 1:0"]
    other = ranks_timeline([{"intervals": []}] * 2, [1, 2])
    assert device_labels([{"timeline": timeline}, {"timeline": other}]) is None
    assert device_labels([{"timeline": {"intervals": [[], []]}}]) is None  # one process
    # a stopped run of 2 ranks recorded rank 0's 2 devices alone: they are rank 0's rows
    stopped = {"ranks": 2, "timeline": {"intervals": [[], []]}}
    assert device_labels([stopped, {"timeline": timeline}]) == [
        "rank 0:0", "rank 0:1", "rank 1:0"]
    assert device_labels([{**stopped, "timeline": {"intervals": [[]] * 3}},
                          {"timeline": timeline}]) is None  # more rows than rank 0 has
    times, fractions = timeline["memory_series"]
    assert times == [0.0, 5.0, 10.0, 20.0]
    assert fractions == pytest.approx([1 / 3, 2 / 3, 1 / 3, 0.0])  # of 3 devices' memory
    usage = {"elapsed_s": 20.0, "devices": 1, "mean_memory_utilization": 0.0,
             "peak_memory_utilization": 1.0, "idle_device_seconds": 0.0, "trials_started": 1,
             "trials_finished": 1}
    # Each rank peaked at a different time: the pool's peak is what they booked at once.
    assert combined_usage([usage, usage], timeline["memory_series"])[
        "peak_memory_utilization"] == pytest.approx(2 / 3)
    # A rank done sooner idles its devices until the last one ends: 8 devices for 10 s (40
    # idle, half booked) beside 8 for 20 s (60 idle, a quarter booked) are 16 devices for 20 s,
    # 40 + 60 + 80 idle (0.5625 of 320) and 0.5 x 80 + 0.25 x 160 booked (a quarter of 320).
    soon = dict(usage, elapsed_s=10.0, devices=8, idle_device_seconds=40.0,
                mean_memory_utilization=0.5)
    late = dict(usage, elapsed_s=20.0, devices=8, idle_device_seconds=60.0,
                mean_memory_utilization=0.25)
    pool = combined_usage([soon, late], None)
    assert (pool["elapsed_s"], pool["devices"], pool["idle_device_seconds"]) == (20.0, 16, 180.0)
    assert pool["idle_fraction"] == pytest.approx(0.5625)
    assert pool["mean_memory_utilization"] == pytest.approx(0.25)


def test_spanning_trials_join_the_pools_timeline_on_the_first_device_of_each_rank():
    """The plots and the peak see the trials that spanned ranks: each holds the first device of
    each of its ranks from its round's start for its wall time, and books its share there."""
    from scamp_jax.distributed.engine import combined_usage, spanning_timeline
    from scamp_jax.distributed.spanning import SpanningRun
    from scamp_jax.hpo.trial import RunResult

    # Ranks of 2, 1 and 1 devices of 100 bytes; rank 0's local trial booked half its memory up
    # to 10 s. Then, from 12 s: trial 5 on ranks 0 and 1 (80 bytes each) for 4 s beside trial
    # 6 on rank 2 (50 bytes) for 2 s; in a second round from 4 s later, trial 7 on ranks 1, 2.
    local = {"intervals": [[[0, 0.0, 10.0, 50]], [], [], []],
             "memory_series": [[0.0, 10.0], [0.25, 0.0]], "devices_per_rank": [2, 1, 1]}

    def run(number, ranks, booked, start, wall):
        trial = SpanningTrial(number, {}, f"k{number}", SpanPlan(len(ranks), 4, booked, booked), 0)
        return SpanningRun(trial, ranks, RunResult(number, "complete", 3, wall), start)

    runs = [run(5, (0, 1), 80, 0.0, 4.0), run(6, (2,), 50, 0.0, 2.0), run(7, (1, 2), 20, 4.0, 1.0)]
    timeline = spanning_timeline(local, runs, 12.0, [2, 1, 1], 100)
    assert timeline["intervals"] == [[[0, 0.0, 10.0, 50], [5, 12.0, 16.0, 80]], [],
                                     [[5, 12.0, 16.0, 80], [7, 16.0, 17.0, 20]],
                                     [[6, 12.0, 14.0, 50], [7, 16.0, 17.0, 20]]]
    assert local["intervals"][0] == [[0, 0.0, 10.0, 50]]  # the ranks' timeline is left as it was
    assert timeline["devices_per_rank"] == [2, 1, 1]  # the plots' row names
    times, fractions = timeline["memory_series"]
    assert times == [0.0, 10.0, 12.0, 14.0, 16.0, 17.0]
    assert fractions == pytest.approx([0.25, 0.0, 210 / 400, 160 / 400, 40 / 400, 0.0])
    usage = {"elapsed_s": 10.0, "devices": 2, "mean_memory_utilization": 0.25,
             "peak_memory_utilization": 0.25, "idle_device_seconds": 10.0, "trials_started": 1,
             "trials_finished": 1}
    one = dict(usage, devices=1, mean_memory_utilization=0.0, idle_device_seconds=10.0,
               trials_started=0, trials_finished=0)
    combined = combined_usage([usage, one, one], timeline["memory_series"], runs, 7.0, 100)
    assert combined["peak_memory_utilization"] == pytest.approx(210 / 400)
    assert combined["trials_finished"] == 4 and combined["elapsed_s"] == 17.0


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stopped_rank_other_than_0_leaves_what_the_study_kept_to_rank_0(
        rank, monkeypatch, capsys):
    """A stop under ``mpirun`` reaches every rank; rank 0 records the run and says what the
    study kept. Another rank records nothing: it says that, not that finished trials are in
    ``results.json`` (which a stop before any trial finished has not written)."""
    from experiments._cli import user_errors
    from scamp_jax._signals import Terminated

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
    with pytest.raises(SystemExit) as stop, user_errors():
        raise Terminated
    assert stop.value.code == 143
    said = "rank 1 stopped: rank 0 records the study (its line says what the study kept)"
    line = capsys.readouterr().err.strip()
    assert line == (f"terminated: {said}; run the same command to resume" if rank else
                    "terminated: finished trials are in the study and results.json; run the "
                    "same command to resume"), line


def test_run_search_mpi_without_mpi4py_raises_an_install_hint(monkeypatch):
    from scamp_jax.distributed.engine import run_search_mpi

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    with pytest.raises(MPIUnavailableError, match="pip install"):
        run_search_mpi(None, None, None, devices=[], memory_per_device=1)


class _OneDevicePlan:
    """What `span_plan` reads of a one-device `Plan`: the largest batch and its peak."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size, self.peak_bytes_per_device = batch_size, 900


def _planner_fitting(batch: int | None):
    from scamp_jax.planning import planner
    calls = []

    def call_planner(model, devices, max_batch, memory):
        calls.append((devices, max_batch, memory))
        if batch is None:
            raise planner.DoesNotFitError("needs 2 GiB per device", 2 << 30, 1 << 30)
        return _OneDevicePlan(batch if max_batch is None else min(batch, max_batch))

    return call_planner, calls


# A budget of 2000 bytes, 1800 usable at the 10% margin; the reduction holds 100 of them.
_BUDGET = {"memory_per_device": 2000, "safety_margin": 0.1, "reduction_bytes": 100}


def test_span_plan_takes_the_fewest_ranks_whose_devices_reach_the_batch_floor():
    call_planner, calls = _planner_fitting(5)
    span = span_plan(call_planner, None, ranks=8, min_batch_size=16, max_batch_size=64,
                     local_error=ValueError("too big for rank"), **_BUDGET)
    # One device per rank, planned for the budget whose usable part leaves the reduction room:
    # floor((1800 - 100) / 0.9) = 1888.
    assert calls == [(1, 64, 1888)]
    assert span == SpanPlan(ranks=4, batch_per_rank=5, peak_bytes_per_device=1000,
                            booked_bytes=1000)
    assert span.global_batch == 20 >= 16
    # The cap on the global batch bounds each rank's share; the booking is the plan of that
    # share.
    call_planner, calls = _planner_fitting(5)
    capped = span_plan(call_planner, None, ranks=8, min_batch_size=16,
                       max_batch_size=16, local_error=ValueError("too big"), **_BUDGET)
    assert calls == [(1, 16, 1888), (1, 4, 1888)]
    assert capped == SpanPlan(ranks=4, batch_per_rank=4, peak_bytes_per_device=1000,
                              booked_bytes=1000)


def test_span_plan_books_the_reduction_through_the_byte_rule_within_the_margin():
    """A real one-device plan: the booking is `booked_bytes` of that plan with the reduction's
    buffers added to its step, and stays within the budget less the safety margin."""
    import jax
    from flax import nnx
    from test_runner import MLP, Regression

    from scamp_jax.distributed.data_parallel import mpi_mean_bytes
    from scamp_jax.hpo.runner import make_optimizer
    from scamp_jax.planning import planner
    from scamp_jax.scheduling.booking import booked_bytes

    task = Regression()
    model = nnx.eval_shape(lambda: MLP(16, nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    # Fused per dtype: the send buffer and the reduced buffer, each the parameters and the loss.
    reduction = mpi_mean_bytes((params, jax.ShapeDtypeStruct((), "float32")))
    assert reduction == 2 * 4 * (8 * 16 + 16 + 16 + 1 + 1)
    plans = []

    def call_planner(model, devices, max_batch, memory):
        plans.append(planner.plan_mesh(
            model, task.sample_batch(1), devices=devices, memory_per_device=memory,
            optimizer=make_optimizer({}), loss_fn=task.loss_fn, safety_margin=0.1,
            max_batch_size=max_batch, eval_task=task))
        return plans[-1]

    span = span_plan(call_planner, model, ranks=2, min_batch_size=64, max_batch_size=64,
                     memory_per_device=14000, safety_margin=0.1, reduction_bytes=reduction,
                     local_error=ValueError("too big for one rank"))
    assert span.ranks == 2 and span.batch_per_rank == 32 == plans[-1].batch_size
    assert span.booked_bytes == booked_bytes(plans[-1], step_extra=reduction)
    assert span.booked_bytes == booked_bytes(plans[-1]) + reduction
    assert span.booked_bytes <= int(14000 * 0.9)
    # A budget whose usable part the reduction alone fills cannot span.
    with pytest.raises(planner.DoesNotFitError, match="reduction alone"):
        span_plan(call_planner, model, ranks=2, min_batch_size=64, max_batch_size=64,
                  memory_per_device=1000, safety_margin=0.1, reduction_bytes=reduction,
                  local_error=ValueError("too big for one rank"))


def test_span_plan_keeps_the_global_batch_within_its_cap():
    """Four samples fit a device and the study wants 10 or 11: three ranks would train 12 and
    four 12 or 8, so the group grows until an equal share each lands in the range (5 ranks of
    2 samples); where none does within the job, the error says so."""
    from scamp_jax.planning import planner

    span = span_plan(_planner_fitting(4)[0], None, ranks=16, min_batch_size=10,
                     max_batch_size=11, local_error=ValueError("too big"), **_BUDGET)
    assert (span.ranks, span.batch_per_rank, span.global_batch) == (5, 2, 10)
    with pytest.raises(planner.DoesNotFitError,
                       match="no group of 3 to 4 ranks trains a global batch between "
                             "min_batch_size=10 and max_batch_size=11: widen that range"):
        span_plan(_planner_fitting(4)[0], None, ranks=4, min_batch_size=10,
                  max_batch_size=11, local_error=ValueError("too big"), **_BUDGET)


def test_span_plan_says_what_to_change_when_a_trial_cannot_span():
    from scamp_jax.planning import planner
    with pytest.raises(planner.DoesNotFitError, match="needs 4 ranks but the job has 2"):
        span_plan(_planner_fitting(5)[0], None, ranks=2, min_batch_size=16, max_batch_size=None,
                  local_error=ValueError("too big for rank"), **_BUDGET)
    with pytest.raises(planner.DoesNotFitError, match="does not fit one device") as err:
        span_plan(_planner_fitting(None)[0], None, ranks=4, min_batch_size=16,
                  max_batch_size=None, local_error=ValueError("too big for rank"), **_BUDGET)
    assert "too big for rank" in str(err.value) and "--memory-per-device" in str(err.value)


def test_spanning_trials_run_in_rounds_of_disjoint_rank_groups():
    def trial(number, ranks):
        return SpanningTrial(number, {}, f"trial_{number}", SpanPlan(ranks, 4, 0, 0), asked_by=0)

    rounds = assign_rounds([trial(3, 2), trial(1, 3), trial(2, 2), trial(4, 1)], ranks=4)
    as_numbers = [[(t.number, ranks) for t, ranks in groups] for groups in rounds]
    # In number order, each trial takes the next free ranks of the round if enough are left.
    assert as_numbers == [[(1, (0, 1, 2)), (4, (3,))], [(2, (0, 1)), (3, (2, 3))]]
    with pytest.raises(ValueError, match="needs 8 ranks, the job has 4"):
        assign_rounds([trial(0, 8)], ranks=4)


def test_mpi_engine_defers_a_trial_whose_batch_floor_one_rank_cannot_hold():
    """A real plan: in 14,000 bytes (12,600 usable at the 10% margin) the MLP fits a batch of
    44 alone, the floor is 64, so it spans 2 ranks of 32, each booking its step, the gradient
    reduction and the prefetched batch within the margin."""
    from test_runner import MLP, Regression

    from scamp_jax.distributed.engine import MPISearchEngine
    from scamp_jax.hpo.engine import EngineConfig, TrialDeferred
    from scamp_jax.planning.budget import Budget
    from scamp_jax.space import SearchSpace

    space = SearchSpace("mlp", lambda t: {}, lambda p, rngs: MLP(int(p["width"]), rngs))
    config = EngineConfig(steps=4, budget=Budget(14000), max_batch_size=64,
                          min_batch_size=64)
    import jax

    engine = MPISearchEngine(2, space, Regression(), source=None, config=config,
                             devices=jax.devices()[:1])
    with pytest.raises(TrialDeferred, match="spans 2 ranks") as deferred:
        engine.plan({"width": 16})
    span = deferred.value.payload
    assert span.ranks == 2 and span.batch_per_rank == 32
    assert span.peak_bytes_per_device < span.booked_bytes <= int(14000 * (1 - 0.1))
    # Without the floor the same configuration simply fits one device.
    local = MPISearchEngine(2, space, Regression(), source=None,
                            config=EngineConfig(steps=4, budget=Budget(14000),
                                                max_batch_size=64),
                            devices=jax.devices()[:1])
    assert 32 < local.plan({"width": 16}).batch_size < 64


def _local_source(tmp_path: Path, n_trials: int, root: Path | None = None,
                  prune: tuple[int, ...] = (), **fusion):
    require_module("mpi4py", "the mpi extra is not installed: pip install .[mpi]")
    from scamp_jax.distributed.study import StudyClient, StudyServer

    handle = open_study("s", study_dir=tmp_path, sampler="random", seed=0)

    def suggest(trial):
        if trial.number in prune:
            raise optuna.TrialPruned(f"trial {trial.number} is refused")
        if fusion:  # an architecture (width) and a training hyperparameter (x) for siblings
            return {"width": trial.suggest_categorical("width", [8, 16, 32]),
                    "x": trial.suggest_float("x", 0.0, 1.0)}
        return {"x": trial.suggest_float("x", 0.0, 1.0)}

    # One process is a world of one rank: rank 0's server, used through the local client.
    # A second server on the storage stands for the same command run again after the job
    # died: it fails what the first left RUNNING at once (``fail_stale``), not after a heartbeat.
    space = SearchSpace("s", suggest, build=lambda params, rngs: None)
    source = OptunaTrialSource(handle, space, n_trials, root=root, recover_running=True,
                               **fusion)
    server = StudyServer(source)
    return handle.study, server, RemoteTrialSource(StudyClient.local(server))


def test_remote_source_tells_attributes_and_requeues_an_interrupted_trial(tmp_path):
    study, server, source = _local_source(tmp_path, n_trials=2)
    first, second = source.ask(), source.ask()
    assert first is not None and second is not None and source.ask() is None
    assert first.checkpoint_key == f"trial_{first.number}"
    source.tell(TrialOutcome(first.number, "complete", value=0.5, attrs={"rank": 0, "steps": 7}))
    source.interrupt(second.number)
    assert source.remaining() == 1  # an interrupted trial does not count towards the total
    again = source.ask()
    assert again is not None and again.params == second.params
    assert again.checkpoint_key == second.checkpoint_key  # resumes from the same checkpoints
    source.tell(TrialOutcome(again.number, "failed", reason="diverged"))
    trials = {t.number: t for t in study.get_trials()}
    assert trials[first.number].value == 0.5 and trials[first.number].user_attrs["steps"] == 7
    assert trials[second.number].user_attrs[FAIL_REASON] == INTERRUPTED
    assert trials[again.number].user_attrs[FAIL_REASON] == "diverged"
    assert source.remaining() == 0 and source.ask() is None


def test_a_configuration_suggest_prunes_is_said_by_the_rank_that_asked(tmp_path):
    """Rank 0 runs every rank's ``suggest``: the line of a trial it pruned goes back with the
    answer to the rank that asked, whose engine says it as one process's does
    (`tests/test_entry.py::test_a_configuration_suggest_prunes_is_said`)."""
    study, server, source = _local_source(tmp_path, n_trials=4, prune=(0, 2))
    answer = server._answer(1, ("ask", "more"))  # rank 1's request, as its message arrives
    assert answer[0] == "trial" and answer[1] == 1
    assert answer[-1] == ["trial 0 pruned by the search space's suggest: trial 0 is refused"]
    asked = source.ask()  # rank 0's own, through its local client
    assert asked is not None and asked.number == 3
    assert source.take_rejected() == [
        "trial 2 pruned by the search space's suggest: trial 2 is refused"]
    assert source.take_rejected() == [] and server._answer(1, ("ask", "more")) == ("done", [])
    assert [t.state for t in study.get_trials()] == [
        optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.RUNNING,
        optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.RUNNING]


def test_an_interrupt_from_another_rank_stores_its_seconds_and_queues_the_retry(tmp_path):
    """Rank 1's ``("interrupt", (number, wall_seconds))`` as its message arrives: the trial
    fails as interrupted with its seconds (for its retry's row), and its retry is queued
    without them."""
    study, server, source = _local_source(tmp_path, n_trials=1)
    answer = server._answer(1, ("ask", "more"))
    assert server._answer(1, ("interrupt", (answer[1], 4.25))) == ("interrupted",)
    stopped = study.trials[answer[1]]
    assert stopped.state == optuna.trial.TrialState.FAIL
    assert (stopped.user_attrs[FAIL_REASON], stopped.user_attrs["wall_seconds"]) == (
        INTERRUPTED, 4.25)
    retry = source.ask()
    assert retry.retry_of == answer[1]
    assert "wall_seconds" not in study.trials[retry.number].user_attrs


def test_a_checkpoints_seconds_from_any_rank_stay_with_a_trial_whose_job_died(tmp_path):
    """Rank 1's ``("progress", (number, wall_seconds))`` after a checkpoint, and rank 0's own
    through its local client: each running trial stores its seconds so far. A trial the job
    left running keeps them when the same command fails it; its retry does not carry them,
    and its row adds them to its own (`scamp_jax.hpo.report.trial_records`)."""
    from scamp_jax.hpo.report import trial_records

    study, server, source = _local_source(tmp_path, n_trials=2)
    remote = server._answer(1, ("ask", "more"))
    local = source.ask()
    assert server._answer(1, ("progress", (remote[1], 3.5))) == ("stored",)
    source.progress(local.number, 1.25)
    source.progress(local.number, 2.5)  # the newest checkpoint's seconds replace the last
    assert {t.number: t.user_attrs["wall_seconds"] for t in study.get_trials()} == {
        remote[1]: 3.5, local.number: 2.5}
    # Both stay RUNNING, as when the job is killed. The same command again:
    study2, server2, source2 = _local_source(tmp_path, n_trials=2)
    assert sorted(server2.stale_failed) == sorted([remote[1], local.number])
    for _ in range(2):
        retry = source2.ask()
        assert "wall_seconds" not in study2.trials[retry.number].user_attrs
        source2.tell(TrialOutcome(retry.number, "complete", value=0.5,
                                  attrs={"wall_seconds": 10.0}))
    rows = {r["retry_of"]: r["wall_seconds"] for r in trial_records(study2)}
    assert rows == {remote[1]: 13.5, local.number: 12.5}


def test_study_server_stores_checkpoint_paths_relative_to_the_study(tmp_path):
    study, server, source = _local_source(tmp_path, n_trials=2, root=tmp_path)
    inside, outside = source.ask(), source.ask()
    elsewhere = tmp_path.parent / "elsewhere" / "7"
    source.tell(TrialOutcome(inside.number, "complete", value=0.1, attrs={
        "checkpoint": str(tmp_path / "checkpoints" / inside.checkpoint_key / "7")}))
    source.tell(TrialOutcome(outside.number, "complete", value=0.2,
                             attrs={"checkpoint": str(elsewhere)}))
    stored = {t.number: t.user_attrs["checkpoint"] for t in study.get_trials()}
    # A copied study folder still finds its checkpoints; a path outside the study stays whole.
    assert stored[inside.number] == f"checkpoints/{inside.checkpoint_key}/7"
    assert stored[outside.number] == str(elsewhere)


def test_study_server_requeues_trials_a_dead_job_left_running(tmp_path):
    study, server, source = _local_source(tmp_path, n_trials=2)
    done, held = source.ask(), source.ask()
    assert server._answer(1, ("trained", 1)) == ("trained", False)
    source.tell(TrialOutcome(done.number, "complete", value=1.0, attrs={"devices": [0, 1]}))
    # the study's budget held a candidate on 2 devices: on a pool of 2 (not 1) a later misfit
    # is its own (`Intake`), on any rank
    assert server._answer(1, ("trained", 2)) == ("trained", True) and source.trained_any(2)
    assert server._answer(1, ("trained", 1)) == ("trained", False)
    # `held` stays RUNNING, as when the rank running it is killed. The same command again:
    study2, server2, source2 = _local_source(tmp_path, n_trials=2)
    assert server2.stale_failed == [held.number] and server2.finished_before == 1
    rerun = source2.ask()
    assert rerun.params == held.params and rerun.checkpoint_key == held.checkpoint_key
    assert source2.ask() is None


def test_study_server_hands_a_proposals_siblings_only_to_its_rank(tmp_path):
    study, server, _ = _local_source(tmp_path, n_trials=5, siblings=1, training_keys=("x",))
    a = server.ask(0)  # the sampler proposes; one sibling is held for rank 0
    assert a.siblings == 1 and a.sibling_of is None
    b = server.ask(1)  # rank 1 gets a proposal of its own, not a's sibling
    assert b.sibling_of is None and b.siblings == 1
    b_sib = server.ask(1)
    assert b_sib.sibling_of == b.number and b_sib.params["width"] == b.params["width"]
    # An interrupted trial, queued, goes to the next asker (rank 1); a's sibling does not.
    server.interrupt(a.number)
    retry = server.ask(1)
    assert retry.params == a.params and retry.sibling_of is None
    extra = server.ask(1)  # one slot left besides a's sibling: a proposal without siblings
    assert extra.sibling_of is None and extra.siblings == 0
    assert server.ask(1) is None  # the last slot is a's sibling, held for rank 0
    assert server.held_siblings(a.number) == 1 and server.held_siblings(b.number) == 0
    assert a.number not in [t.number for t in (b, b_sib, retry, extra)]
    a_sib = server.ask(0)
    assert a_sib.sibling_of == a.number and a_sib.params["width"] == a.params["width"]
    assert server.held_siblings(a.number) == 0
    assert server.ask(0) is None
    for item in (b, b_sib, retry, extra, a_sib):
        server.tell(item.number, 1.0)
    assert server.remaining() == 0 and server.source.finished() == 5  # exactly n_trials
    ranks = {t.number: t.user_attrs["rank"] for t in study.get_trials()}
    assert ranks[a_sib.number] == ranks[a.number] == 0 and ranks[b_sib.number] == 1


def test_siblings_a_dead_job_held_die_with_it_and_the_next_run_completes_the_study(tmp_path):
    study, server, _ = _local_source(tmp_path, n_trials=4, siblings=2, training_keys=("x",))
    a = server.ask(0)
    assert a.siblings == 2
    first_sibling = server.ask(0)
    assert first_sibling.sibling_of == a.number
    # The job dies: a and one sibling RUNNING, the other sibling held only in its memory.
    study2, server2, _ = _local_source(tmp_path, n_trials=4, siblings=2, training_keys=("x",))
    assert sorted(server2.stale_failed) == sorted([a.number, first_sibling.number])
    items = [item for rank in (1, 0, 1, 0, 1, 0) if (item := server2.ask(rank)) is not None]
    # The two retries first (their parameters and checkpoints), then a proposal and its
    # sibling, held for the proposal's rank: exactly the study's four trials.
    assert [(i.params, i.checkpoint_key) for i in items[:2]] == [
        (a.params, a.checkpoint_key), (first_sibling.params, first_sibling.checkpoint_key)]
    assert len(items) == 4 and items[3].sibling_of == items[2].number
    assert items[3].params["width"] == items[2].params["width"]
    ranks = {t.number: t.user_attrs["rank"] for t in study2.get_trials()}
    assert ranks[items[2].number] == ranks[items[3].number]
    for item in items:
        server2.tell(item.number, 0.5)
    complete = [t for t in study2.get_trials() if t.state.name == "COMPLETE"]
    assert len(complete) == 4 and server2.remaining() == 0


# ----------------------------------------------------------------------------- under mpirun
def _launch(tmp_path: Path, ranks: int, *flags: str, timeout: float = 240):
    from test_mpi_runs import launcher, mpi_env

    cmd = [*launcher(ranks), sys.executable, str(SCRIPT), "--no-live", "--study-dir",
           str(tmp_path / "study"), *flags]
    return subprocess.run(cmd, env=mpi_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _ctrl_c_when(cmd: list[str], said: str) -> str:
    """Run ``cmd`` (an ``mpirun``) until a line of its output matches ``said``, then send it a
    Ctrl-C; its whole output, once it ended with a non-zero status."""
    from test_mpi_runs import mpi_env

    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if re.search(said, line):
                proc.send_signal(signal.SIGINT)
                break
        output = "".join(lines) + proc.stdout.read()
        assert proc.wait(timeout=120) != 0, output
    finally:
        proc.kill()
    return output


def _stored_trials(tmp_path: Path) -> list[tuple[int, str, str | None]]:
    """(number, state, fail reason) of every trial in the study's SQLite storage."""
    con = sqlite3.connect(tmp_path / "study" / "study.db")
    rows = con.execute(
        "SELECT t.number, t.state, (SELECT value_json FROM trial_user_attributes a "
        "WHERE a.trial_id = t.trial_id AND a.key = ?) FROM trials t ORDER BY t.number",
        (FAIL_REASON,),
    ).fetchall()
    con.close()
    return [(n, s, None if r is None else json.loads(r)) for n, s, r in rows]


def _results(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "study" / "results.json").read_text())


@pytest.fixture
def _needs_mpi() -> None:
    require_module("mpi4py", "the mpi extra is not installed: pip install .[mpi]")


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_study_split_across_two_ranks_records_every_trial_once_with_its_rank(
    tmp_path, _needs_mpi
):
    proc = _launch(tmp_path, 2, "--trials", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(tmp_path)
    numbers = [t["number"] for t in results["trials"]]
    assert sorted(numbers) == [0, 1, 2, 3]  # each trial exactly once
    assert all(t["state"] == "complete" and t["mse"] is not None for t in results["trials"])
    assert {t["rank"] for t in results["trials"]} == {0, 1}  # both ranks ran work
    # every rank's call returns the study's record, best trial included
    assert f"rank 1 returned best trial {results['best']}" in proc.stdout, proc.stdout[-2000:]
    assert f"rank 0 returned best trial {results['best']}" in proc.stdout
    # Checkpoint paths are stored relative to the study, so a copied folder still finds them.
    stored = [t["checkpoint"] for t in results["trials"]]
    assert all(c and not Path(c).is_absolute() for c in stored), stored
    assert all((tmp_path / "study" / c).is_dir() for c in stored), stored
    assert results["run"]["ranks"] == 2 and results["run"]["trials_this_run"] == 4
    assert sorted(r["rank"] for r in results["run"]["per_rank"]) == [0, 1]
    # the run's compiles, checkpoints and step cache are every rank's, each rank's its own
    run, ranks = results["run"], results["run"]["per_rank"]
    assert all(r["overhead"]["checkpoint_writes"] >= 1 for r in ranks), ranks
    for key in ("planning_compiles", "checkpoint_writes", "host_initial_states"):
        assert run["overhead"][key] == sum(r["overhead"][key] for r in ranks), key
    assert run["step_cache"] == {k: sum(r["step_cache"][k] for r in ranks)
                                 for k in ("hits", "misses")}
    # The report's timeline (the plots) holds both ranks' devices, rank 0's first, and every
    # trial of the run on the devices of its rank.
    timeline = results["run"]["timeline"]
    assert len(timeline["intervals"]) == 4 and timeline["devices_per_rank"] == [2, 2]
    held = {t: 2 * r for r in (0, 1) for d in (0, 1)
            for t, *_ in timeline["intervals"][2 * r + d]}
    assert held == {t["number"]: 2 * t["rank"] for t in results["trials"]}
    assert results["run"]["usage"]["peak_memory_utilization"] == max(timeline["memory_series"][1])
    assert [s for _, s, _ in _stored_trials(tmp_path)] == ["COMPLETE"] * 4
    assert "[rank 1]" in proc.stdout  # rank 1 logs plain lines under its rank
    # Each rank schedules its own devices: a replay of the study says it covers rank 0's.
    replayed = subprocess.run(
        [sys.executable, "-m", "benchmarks.simulate_cluster", "--replay",
         str(tmp_path / "study")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 0, replayed.stderr
    assert ("note: a study of 2 MPI ranks; this replays rank 0's scheduling (its devices and "
            "trials) only") in replayed.stderr
    rank_0 = {t["number"] for t in results["trials"] if t["rank"] == 0}
    assert {int(line.split()[1].rstrip(":")) for line in replayed.stdout.splitlines()} == rank_0
    # Rank 0's stdout is Open MPI's size-less pseudo-terminal: plain lines and a wide table,
    # no colour codes; every rank names its own pool.
    assert "\x1b[" not in proc.stdout, proc.stdout
    assert "pool of rank 0: 2 cpu devices of 64.00 MiB (of 8 in this process)" in proc.stdout
    assert "[rank 1] pool: 2 cpu devices of 64.00 MiB" in proc.stdout
    # The study remembers its settings under MPI too: a rerun with other steps is refused and
    # leaves the finished trials as they were.
    again = _launch(tmp_path, 2, "--trials", "4", "--steps", "30")
    assert again.returncode != 0
    # in the command line's words, as in one process (not the library's steps=20)
    assert "--steps 20" in again.stderr and "--study-name" in again.stderr, again.stderr
    assert [s for _, s, _ in _stored_trials(tmp_path)] == ["COMPLETE"] * 4
    # --study-name means what it means in one process: a new study of that name in the same
    # storage, its outputs in --study-dir/NAME; the first study is left as it was.
    named = _launch(tmp_path, 2, "--trials", "2", "--steps", "30", "--study-name", "b")
    assert named.returncode == 0, named.stdout + named.stderr

    storage = f"sqlite:///{tmp_path / 'study' / 'study.db'}"
    studies = {s.study_name: s.n_trials for s in optuna.get_all_study_summaries(storage)}
    assert studies == {"mlp-mpi": 4, "b": 2}
    assert json.loads((tmp_path / "study" / "b" / "results.json").read_text())["run"]["ranks"] == 2
    assert {t["number"] for t in _results(tmp_path)["trials"]} == {0, 1, 2, 3}


@pytest.mark.mpi
def test_a_trial_too_big_for_one_rank_spans_two_and_equals_the_single_process_run(
    tmp_path, _needs_mpi
):
    # One device of 14,000 bytes per rank (12,600 usable at the 10% margin) holds a batch of 44
    # of this MLP alone (its prefetched batch counted); the study asks for 64.
    proc = _launch(tmp_path, 2, "--trials", "2", "--devices", "1", "--memory-per-device",
                   "14000", "--min-batch-size", "64", "--max-batch-size", "64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "spans ranks [0, 1]: global batch 64 (32 per rank)" in proc.stdout
    results = _results(tmp_path)
    trials = results["trials"]
    assert sorted(t["number"] for t in trials) == [0, 1]
    assert all(t["state"] == "complete" for t in trials)
    assert all(t["rank"] == [0, 1] and t["batch_size"] == 64 for t in trials)
    assert results["run"]["spanning_trials"] == 2 and results["run"]["trials_this_run"] == 2
    assert [s for _, s, _ in _stored_trials(tmp_path)] == ["COMPLETE"] * 2
    # the run's usage figures count the trials that spanned ranks: each booked its share on
    # one device of each rank for its wall time (here the pool's only devices)
    run = results["run"]
    usage = run["usage"]
    assert usage["trials_started"] == usage["trials_finished"] == 2
    booked = [t["booked_bytes"] for t in trials]
    walls = [t["wall_seconds"] for t in trials]
    assert usage["peak_memory_utilization"] == pytest.approx(max(booked) / 14000)
    assert 0 < usage["mean_memory_utilization"] <= usage["peak_memory_utilization"]
    assert usage["elapsed_s"] >= run["spanning_s"] >= max(walls)
    # The plots draw them: each on the one device of each rank, for its wall time.
    intervals = run["timeline"]["intervals"]
    assert [sorted(n for n, *_ in device) for device in intervals] == [[0, 1], [0, 1]]
    for number, begin, end, held in intervals[1]:
        trial = next(t for t in trials if t["number"] == number)
        assert end - begin == pytest.approx(trial["wall_seconds"], abs=1e-3)  # as rounded
        assert held == trial["booked_bytes"]
        assert begin >= max(r["elapsed_s"] for r in run["per_rank"])
    assert (f"mean memory booked {format_share(usage['mean_memory_utilization'])} of the pool"
            in proc.stdout)
    # The communicator the shared study duplicated is freed on every rank before the spanning
    # trials run, and rank 0 still records them.
    for rank in (0, 1):
        assert f"rank {rank} study communicator freed: True" in proc.stdout, proc.stdout[-2000:]
    # Each rank booked its share with the margin, and what the run measured (the compiled
    # step with the reduction and the prefetched batch, the evaluation) stayed within it.
    held = _stored_user_attr(tmp_path, "held_bytes")
    for t in trials:
        assert 0 < held[t["number"]] <= t["predicted_peak_bytes"] <= int(14000 * 0.9), t
        # Recorded as a trial on one rank is (CPU devices report no allocator peak).
        assert t["booked_bytes"] == t["predicted_peak_bytes"] and t["measured_peak_bytes"] is None

    # The same trials in this process on one device with the whole batch of 64: the held-out
    # MSE agrees to float32 reassociation (the global mean becomes a mean of two rank means).
    import jax
    from test_runner import MLP, Regression

    from scamp_jax.distributed.spanning import one_device_plan
    from scamp_jax.hpo.runner import RunSpec, run_trial, trial_seed
    from scamp_jax.space import SearchSpace

    space = SearchSpace("mlp", lambda t: {}, lambda p, rngs: MLP(int(p["width"]), rngs))
    for t in trials:
        plan = one_device_plan(space, t["params"], 64, jax.devices()[0])
        spec = RunSpec(t["number"], t["params"], plan, steps=t["steps"], memory_per_device=1 << 30,
                       seed=trial_seed(0, f"trial_{t['number']}"))
        alone = run_trial(spec, space, Regression())
        assert alone.state == "complete", alone.reason
        assert alone.metrics["mse"] == pytest.approx(t["mse"], rel=1e-5)


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_a_spanning_trial_that_fails_on_one_rank_ends_the_job_instead_of_hanging(
    tmp_path, _needs_mpi
):
    """Rank 1's data fails at its fourth batch of a trial that spans ranks 0 and 1: rank 0 waits
    in the next step's gradient reduction for rank 1, which nothing but the job's end stops.
    Rank 1 waits a while for its group, then aborts the job, saying why."""
    proc = _launch(tmp_path, 2, "--trials", "1", "--devices", "1", "--memory-per-device",
                   "14000", "--min-batch-size", "64", "--max-batch-size", "64",
                   "--steps", "80", "--fail-rank", "1", "--fail-after", "3",
                   "--end-together-seconds", "5",
                   timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "spans ranks [0, 1]" in proc.stdout
    assert re.search(r"rank 1 failed: trial 0, which spans ranks, ended failed on this rank "
                     r"\(.*rank 1's data fails at batch 3.*\) while the other ranks of its group "
                     r"train on", output), output


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_a_spanning_trial_whose_evaluation_fails_on_another_rank_is_recorded_failed(
    tmp_path, _needs_mpi
):
    """Rank 1's final evaluation of a trial that spans ranks 0 and 1 fails after the last
    gradient reduction, so no rank waits for it: the study records the trial failed with
    rank 1's reason, not complete from rank 0's part alone."""
    proc = _launch(tmp_path, 2, "--trials", "1", "--devices", "1", "--memory-per-device",
                   "14000", "--min-batch-size", "64", "--max-batch-size", "64",
                   "--fail-eval-rank", "1", "--failure-limit", "0", timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "spans ranks [0, 1]" in proc.stdout
    (trial,) = _results(tmp_path)["trials"]
    assert trial["state"] == "failed", trial
    assert "rank 1 of its group" in trial["reason"], trial
    assert "rank 1's evaluation fails" in trial["reason"], trial
    assert [s for _, s, _ in _stored_trials(tmp_path)] == ["FAIL"]


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_a_rank_whose_guard_stops_the_job_records_the_run_as_one_process_does(
    tmp_path, _needs_mpi
):
    """Rank 0's evaluation raises on every trial: its repeated-failure guard stops the job,
    and ``results.json`` records the run, its error and the finished trials (rank 0 ended
    with the error, where an interrupt alone had been recorded)."""
    proc = _launch(tmp_path, 2, "--trials", "10", "--steps", "10", "--fail-eval-rank", "0",
                   timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "all failed with the same error" in output, output
    results = _results(tmp_path)
    run = results["run"]
    assert run["stopped"] == "repeated failures" and run["ranks"] == 2, run
    assert len(run["failures"]["trials"]) >= 3
    assert "rank 0's evaluation fails" in run["failures"]["reason"]
    complete = sorted(n for n, s, _ in _stored_trials(tmp_path) if s == "COMPLETE")
    assert sorted(t["number"] for t in results["trials"] if t["state"] == "complete") == complete


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_ranks_started_with_other_settings_are_refused_before_the_study_stores_them(
    tmp_path, _needs_mpi
):
    """One job whose second rank was given other flags (a wrapper script per host, a typo):
    every rank refuses it, naming what differs, before a trial is asked, where each rank
    trained the study's trials with its own steps and batch."""
    from test_mpi_runs import launcher, mpi_env

    base = launcher(1)  # [mpirun, -n, 1, its options...]: one program per rank (MPMD)
    script = [sys.executable, str(SCRIPT), "--no-live", "--study-dir", str(tmp_path / "study"),
              "--trials", "4"]
    cmd = [base[0], *base[3:], "-n", "1", *script, "--steps", "10", ":",
           "-n", "1", *script, "--steps", "30", "--max-batch-size", "4"]
    proc = subprocess.run(cmd, env=mpi_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    # (the command line's words: ``--steps 30`` for ``steps=30``)
    # Said once, by rank 0; not the checkpoint interval the command line scaled with the steps
    said = re.findall(r"rank 1 was started with --steps 30; --max-batch-size 4 where rank 0 "
                      r"has --steps 10; --max-batch-size 8: start every rank with the same "
                      r"command", output)
    assert len(said) == 1, output
    assert "--checkpoint-every" not in output and "checkpoint_every" not in output, output
    assert ("rank 1 failed: the ranks were started with other settings (rank 0's line names "
            "them); start every rank with the same command") in output
    assert not (tmp_path / "study" / "results.json").exists()
    assert not (tmp_path / "study" / "study.db").exists() or _stored_trials(tmp_path) == []


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_a_configuration_suggest_prunes_is_said_under_mpirun(tmp_path, _needs_mpi):
    """The line one process says for a trial the space's ``suggest`` pruned, said once by
    the rank that asked for it, whichever it is."""
    proc = _launch(tmp_path, 2, "--trials", "4", "--steps", "10", "--prune-trial", "1")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    said = re.findall(r"trial 1 pruned by the search space's suggest: trial 1 is refused",
                      output)
    assert len(said) == 1, output
    # it counts, as Optuna counts it
    assert [s for _, s, _ in _stored_trials(tmp_path)] == [
        "COMPLETE", "PRUNED", "COMPLETE", "COMPLETE"]


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_an_error_rank_0_meets_answering_another_rank_ends_the_job_saying_it(
    tmp_path, _needs_mpi
):
    """The search space's ``suggest`` raises while rank 0 asks a trial for rank 1 (in its
    study server's thread): rank 1 raises it and ends the job saying it and where it came
    from, where rank 0 aborted the job without a word."""
    proc = _launch(tmp_path, 2, "--trials", "4", "--steps", "10", "--fail-suggest-served",
                   timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "rank 1 failed: suggest fails for trial" in output, output
    assert re.search(r"rank 1: raised on rank 0 while it answered rank 1's 'ask' request: "
                     r"RuntimeError: suggest fails for trial \d+ \(at hpo_mlp\.py:\d+\)",
                     output), output


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_a_stop_signal_to_one_rank_ends_the_job_instead_of_hanging_it(tmp_path, _needs_mpi):
    """SIGTERM to rank 1's process alone (not to mpirun): rank 1 gives its trials back and
    stops, rank 0 trains on and waits for it for ever, rank 1 for rank 0 in MPI's exit. The
    stopped rank ends the job once it is still up after its wait, and the same command then
    finishes the study."""
    from test_mpi_runs import launcher, mpi_env

    cmd = [*launcher(2), sys.executable, str(SCRIPT), "--no-live", "--study-dir",
           str(tmp_path / "study"), "--trials", "4", "--steps", "20000",
           "--stopped-job-seconds", "5"]
    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, pid = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("rank 1 pid "):
                pid = int(line.split()[-1])
            if pid is not None and re.search(r"\[rank 1\].* training .*step=\d+/", line):
                os.kill(pid, signal.SIGTERM)
                break
        lines.extend(proc.stdout)  # to the job's end
        proc.wait(timeout=180)
    finally:  # mpirun and its ranks (a job that hangs never closes its output)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    assert pid is not None and proc.returncode != 0, output
    assert "rank 1: the job did not end within 5 s of this rank's stop" in output, output
    done = _launch(tmp_path, 2, "--trials", "4", "--steps", "20000", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(t["number"] for t in _results(tmp_path)["trials"]
                  if t["state"] == "complete") == sorted(
        n for n, s, _ in _stored_trials(tmp_path) if s == "COMPLETE")
    assert len([1 for _, s, _ in _stored_trials(tmp_path) if s == "COMPLETE"]) == 4


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_study_split_across_four_ranks_records_every_trial_once(tmp_path, _needs_mpi):
    proc = _launch(tmp_path, 4, "--trials", "6", "--steps", "10", timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(tmp_path)
    assert results["run"]["ranks"] == 4 and results["run"]["devices"] == 8
    trials = results["trials"]
    assert sorted(t["number"] for t in trials) == list(range(6))
    assert {t["rank"] for t in trials} <= {0, 1, 2, 3} and len({t["rank"] for t in trials}) >= 2


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_a_killed_rank_stops_the_job_and_the_same_command_resumes_the_study(
    tmp_path, _needs_mpi
):
    died = _launch(tmp_path, 2, "--trials", "4", "--steps", "10", "--die-rank", "1")
    output = died.stdout + died.stderr
    assert died.returncode != 0, output
    assert "rank 1 is killed after telling trial" in output
    # The launcher names the dead rank (Open MPI: "mpirun noticed that process rank 1 with PID
    # ... exited on signal 9 (Killed)").
    assert "process rank 1 " in output
    # mpirun ends rank 0 with SIGTERM, which records the run as interrupted unless it is
    # killed first; nothing is recorded as a finished run
    record = tmp_path / "study" / "results.json"
    if record.exists():
        assert all(run["interrupted"] for run in json.loads(record.read_text())["runs"])
    before = {n for n, s, _ in _stored_trials(tmp_path) if s == "COMPLETE"}
    assert before, "rank 1 told one trial before it died"

    proc = _launch(tmp_path, 2, "--trials", "4", "--steps", "10")  # the same command again
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stored = _stored_trials(tmp_path)
    complete = {n for n, s, _ in stored if s == "COMPLETE"}
    assert before <= complete and len(complete) == 4  # nothing finished was lost
    # Everything else was a trial the dead job held: failed (as interrupted, or by its stale
    # heartbeat, with no reason of its own) and run again.
    assert all(r in (INTERRUPTED, None) for n, s, r in stored if s != "COMPLETE")
    results = _results(tmp_path)
    assert sorted(t["number"] for t in results["trials"]) == sorted(complete)


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_an_interrupted_mpi_run_is_recorded_with_the_trials_it_finished(tmp_path, _needs_mpi):
    """Ctrl-C on ``mpirun`` (Open MPI ends the ranks with SIGTERM, which the command line
    takes as an interruption): rank 0 appends the run to ``results.json``, interrupted, with
    the trials every rank told, as a single process does."""
    from test_mpi_runs import launcher

    cmd = [*launcher(2), sys.executable, str(SCRIPT), "--no-live", "--study-dir",
           str(tmp_path / "study"), "--trials", "6", "--steps", "1500"]
    output = _ctrl_c_when(cmd, " complete ")  # the first trial told
    complete = {n for n, s, _ in _stored_trials(tmp_path) if s == "COMPLETE"}
    assert complete, output
    run = _results(tmp_path)["runs"][-1]
    assert run["interrupted"] and run["ranks"] == 2, run
    # what rank 0 had been told when it wrote the record (rank 1 may tell one more as it stops)
    assert 1 <= run["trials_this_run"] <= len(complete), (run, complete)


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_a_stop_while_trials_span_ranks_keeps_the_finished_ones_and_gives_back_the_rest(
    tmp_path, _needs_mpi
):
    """Two trials too big for one rank span ranks 0 and 1 in two rounds; Ctrl-C on
    ``mpirun`` once the first has ended. The study holds it complete (recorded as its round
    ended, not once every round had run) and the second given back (failed as interrupted,
    queued again), not running until its heartbeat lapses; the same command finishes the
    study with the second alone."""
    from test_mpi_runs import launcher

    flags = ["--trials", "2", "--devices", "1", "--memory-per-device", "14000",
             "--min-batch-size", "64", "--max-batch-size", "64", "--steps", "4000",
             "--checkpoint-every", "500"]
    cmd = [*launcher(2), sys.executable, str(SCRIPT), "--no-live", "--study-dir",
           str(tmp_path / "study"), *flags]
    output = _ctrl_c_when(cmd, r"trial \d+ complete on ranks \[0, 1\]")  # the first spanning
    first = int(re.search(r"trial (\d+) complete on ranks", output).group(1))
    stored = {n: (s, r) for n, s, r in _stored_trials(tmp_path)}
    assert stored[first][0] == "COMPLETE", (stored, output)
    others = {n: v for n, v in stored.items() if n != first}
    assert "RUNNING" not in {s for s, _ in others.values()}, (stored, output)
    assert ("FAIL", "interrupted") in others.values(), (stored, output)
    assert "WAITING" in {s for s, _ in others.values()}, (stored, output)

    again = _launch(tmp_path, 2, *flags, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"trial {first} " not in again.stdout  # not run again
    results = _results(tmp_path)
    assert len(results["trials"]) == 2 and all(t["state"] == "complete"
                                               for t in results["trials"]), results["trials"]
    assert results["run"]["spanning_trials"] == 1


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.mpi
def test_a_stop_while_a_trial_spans_ranks_checkpoints_it_at_its_next_step(tmp_path, _needs_mpi):
    """SIGTERM to the ranks (as Slurm's scancel sends every task) while a trial spans ranks 0
    and 1 and trains past its first periodic checkpoint: its ranks agree on the step to stop
    at, rank 0 writes a checkpoint there and says so, the trial goes back to the study, and the
    same command resumes it from that checkpoint (not from the periodic one, nor from the
    start), as a single process's stop does."""
    from test_mpi_runs import launcher, mpi_env

    # 5,000 steps at the global batch of 64, a checkpoint every 1,000 (the flags' figures are
    # of batch 8, scaled to the batch's samples)
    flags = ["--trials", "1", "--devices", "1", "--memory-per-device", "14000",
             "--min-batch-size", "64", "--max-batch-size", "64", "--steps", "40000",
             "--checkpoint-every", "8000", "--checkpoint-min-seconds", "0"]
    cmd = [*launcher(2), sys.executable, str(SCRIPT), "--no-live", "--study-dir",
           str(tmp_path / "study"), *flags]
    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    folder = tmp_path / "study" / "checkpoints" / "trial_0"

    def saved() -> list[int]:
        return sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit())

    lines: list[str] = []
    try:
        pids = []
        for line in proc.stdout:  # the script's first lines: each rank's process
            lines.append(line)
            pids += [int(m) for m in re.findall(r"rank \d pid (\d+)", line)]  # may share a line
            if len(pids) == 2:
                break
        deadline = time.monotonic() + 400
        while not saved() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        periodic = saved()
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        lines.extend(proc.stdout)
        assert proc.wait(timeout=200) != 0, "".join(lines)
    finally:
        proc.kill()
    output = "".join(lines)
    assert periodic == [1000], (periodic, output)
    assert ("stopping: trial(s) [0], which span ranks, end at their next step with a "
            "checkpoint and go back to the study, where a re-run resumes them") in output, output
    # every rank says the stop as SIGTERM's, as a single process does
    assert output.count("terminated: ") == 2 and "interrupted: " not in output, output
    stopped_at = saved()[-1]
    assert 1000 < stopped_at < 2000, (saved(), output)  # written at the stop
    stored = _stored_trials(tmp_path)  # given back: failed as interrupted, queued again
    assert [s for _, s, _ in stored] == ["FAIL", "WAITING"] and stored[0][2] == INTERRUPTED, \
        (stored, output)

    again = _launch(tmp_path, 2, *flags, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    [trial] = _results(tmp_path)["trials"]
    assert trial["state"] == "complete" and trial["resumed_from"] == stopped_at, trial


@pytest.mark.mpi
@pytest.mark.slow
def test_swinir_smoke_study_under_mpirun_records_every_trial_once(tmp_path, _needs_mpi):
    # The real entry point (about 3 minutes on 2 shared CPU cores: SwinIR compiles dominate).
    from test_mpi_runs import launcher, mpi_env

    cmd = [*launcher(2), sys.executable, "-m", "experiments.swinir_hpo", "--preset", "smoke",
           "--trials", "3", "--steps", "4", "--devices", "2", "--no-live", "--study-dir",
           str(tmp_path / "study")]
    proc = subprocess.run(cmd, env=mpi_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(tmp_path)
    assert sorted(t["number"] for t in results["trials"]) == [0, 1, 2]
    assert all(t["state"] == "complete" and t["psnr"] > 0 for t in results["trials"])
    assert {t["rank"] for t in results["trials"]} == {0, 1}
    assert results["run"]["ranks"] == 2


def _stored_user_attr(tmp_path: Path, key: str) -> dict[int, object]:
    """``{trial number: value}`` of user attribute ``key`` in the study's SQLite storage."""
    con = sqlite3.connect(tmp_path / "study" / "study.db")
    rows = con.execute(
        "SELECT t.number, a.value_json FROM trials t JOIN trial_user_attributes a "
        "ON a.trial_id = t.trial_id WHERE a.key = ?", (key,)).fetchall()
    con.close()
    return {n: json.loads(v) for n, v in rows}


@pytest.mark.mpi
@pytest.mark.slow
def test_fused_study_under_mpirun_keeps_each_proposals_siblings_on_its_rank(
    tmp_path, _needs_mpi
):
    from scamp_jax.hpo.study import SIBLING_OF

    proc = _launch(tmp_path, 2, "--trials", "8", "--fuse", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(tmp_path)
    trials = results["trials"]
    assert sorted(t["number"] for t in trials) == list(range(8))  # exactly --trials
    assert all(t["state"] == "complete" and t["mse"] is not None for t in trials)
    assert [s for _, s, _ in _stored_trials(tmp_path)] == ["COMPLETE"] * 8
    rank = {t["number"]: t["rank"] for t in trials}
    # Every sibling ran on the rank its proposal went to (the server reserved it there).
    siblings = _stored_user_attr(tmp_path, SIBLING_OF)
    assert siblings, "the sampler's proposals got siblings"
    assert all(rank[s] == rank[p] for s, p in siblings.items()), (siblings, rank)
    groups: dict[int, list[dict]] = {}
    for t in trials:
        assert "fused_group" in t and "fusion_width" in t
        if t["fused_group"] is not None:
            groups.setdefault(t["fused_group"], []).append(t)
    assert groups and any(len(m) >= 2 for m in groups.values()), trials
    for members in groups.values():
        assert len({m["rank"] for m in members}) == 1  # a group runs on one rank
        assert all(m["fusion_width"] == len(members) for m in members)
        assert len({m["params"]["width"] for m in members}) == 1


@pytest.mark.mpi
@pytest.mark.slow
def test_a_fused_study_killed_under_mpirun_resumes_to_exactly_its_trials(tmp_path, _needs_mpi):
    died = _launch(tmp_path, 2, "--trials", "8", "--fuse", "2", "--die-rank", "1")
    assert died.returncode != 0 and "rank 1 is killed after telling trial" in died.stdout
    before = {n for n, s, _ in _stored_trials(tmp_path) if s == "COMPLETE"}
    assert before and len(before) < 8
    # Siblings are held by rank 0's trial source: what a dead job leaves waiting in the storage
    # are retries of its interrupted trials, never siblings.
    import optuna

    from scamp_jax.hpo.study import retried_from

    study = optuna.load_study(study_name="mlp-mpi",
                              storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert all(retried_from(t) is not None for t in waiting), waiting
    # As if the dead job's rank 0 had run on another machine: the re-run cannot see that its
    # process ended, and waits for the heartbeats to go stale (the script's 10 s grace).
    with sqlite3.connect(tmp_path / "study" / "study.db") as db:
        moved = db.execute(
            "UPDATE trial_user_attributes SET value_json = json_set(value_json, '$.host', "
            "'another-host') WHERE key = ? AND trial_id IN (SELECT trial_id FROM trials "
            "WHERE state = 'RUNNING')", (OWNER,)).rowcount
    assert moved
    proc = _launch(tmp_path, 2, "--trials", "8", "--fuse", "2")  # the same command again
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stored = _stored_trials(tmp_path)
    complete = {n for n, s, _ in stored if s == "COMPLETE"}
    assert before <= complete  # nothing finished was lost
    # Trials the dead job left RUNNING were waited for until their heartbeat went stale, then
    # retried: one re-run ends with exactly --trials, nothing left running or waiting.
    assert {s for _, s, _ in stored} <= {"COMPLETE", "FAIL"}, stored
    assert len(complete) == 8
    assert all(r in (INTERRUPTED, None) for n, s, r in stored if s != "COMPLETE")
    assert sorted(t["number"] for t in _results(tmp_path)["trials"]) == sorted(complete)
    # The ranks' pools idled while they waited for the dead job's trials: the run's figure is
    # the sum of every rank's wait, and the last line says it. (A rank that had trials to train
    # for the whole grace period waited none: on a loaded machine, one may.)
    run = _results(tmp_path)["runs"][-1]
    waits = [r["waited_for_held_trials_s"] * r["pool_devices"] for r in run["per_rank"]]
    assert len(waits) == 2 and any(w > 0 for w in waits)
    held = run["overhead"]["idle_waiting_for_held_trials_device_s"]
    assert held == pytest.approx(sum(waits), abs=0.01)
    assert f"({held:.1f} of them waiting for trials another process held)" in proc.stdout


def test_a_trial_that_spans_ranks_shows_the_budget_holds_candidates():
    """A candidate deferred to span ranks fits the pool (on several ranks), so a candidate
    that fits nowhere fails alone, as in one process, instead of stopping the study as a
    budget too small for any candidate (which aborted the MPI job with the spanning trials
    unrun)."""
    import concurrent.futures as cf
    from types import SimpleNamespace

    from scamp_jax.hpo.intake import Intake
    from scamp_jax.hpo.trial import TrialDeferred, TrialStatus
    from scamp_jax.planning.planner import DoesNotFitError

    def done(error: Exception) -> cf.Future:
        future: cf.Future = cf.Future()
        future.set_exception(error)
        return future

    for order in ((0, 2), (2, 0)):  # the deferral before the misfit, and after it
        told: list[int] = []
        intake = Intake(SimpleNamespace(interrupt=told.append), nofit_limit=2,
                        pool=(1, 40 << 20), tell_failed=told.append)
        for number in order:
            error = (TrialDeferred("spans 2 ranks", None) if number == 0
                     else DoesNotFitError("one sample needs 41 MiB", 1, 40 << 20))
            assert intake.sort(SimpleNamespace(number=number), done(error),
                               TrialStatus(number, {})) is None
        intake.finish()  # no BudgetTooSmallError
        assert told == [2] and [a.number for a, _ in intake.deferred] == [0]
