"""Trials that raise: where the reason points, the traceback they keep, and the study that stops
when its first trials all raise the same error (`scamp_jax.hpo.failures`).

Real studies of the MLP of ``test_runner`` in SQLite storage; the error is a real bug in a
task's ``evaluate``.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import optuna
import pytest
from test_runner import SPACE, Regression

import scamp_jax
from scamp_jax.hpo.failures import RepeatedFailures
from scamp_jax.hpo.study import FAIL_REASON, INTERRUPTED, storage_url
from scamp_jax.hpo.study.trials import TrialOutcome
from scamp_jax.hpo.trial import ending, failure_traceback


def _task(evaluate=None) -> scamp_jax.FunctionTask:
    reference = Regression()
    return scamp_jax.FunctionTask(metric="mse", direction="minimize",
                                  loss_fn=reference.loss_fn, batches=reference.batches,
                                  evaluate=evaluate or reference.evaluate)


def _mislabelled(model) -> dict[str, float]:
    """A task's bug: held-out labels of the wrong length (NumPy raises in its own code)."""
    reference = Regression()
    prediction = np.asarray(model(reference.x_eval))
    labels = np.broadcast_to(reference.y_eval[:5], prediction.shape)
    return {"mse": float(((prediction - labels) ** 2).mean())}


KW = dict(steps=2, live=False, memory_per_device="64MiB", max_batch_size=8, sampler="random")


def test_a_failures_reason_points_at_the_users_line_and_keeps_its_traceback():
    try:
        _mislabelled(lambda x: np.zeros((len(x), 1), np.float32))
    except ValueError as err:
        state, reason, _ = ending(err)
        text = failure_traceback(err)
    assert state == "failed"
    assert reason.startswith("ValueError: operands could not be broadcast together")
    # the line of this file, not NumPy's, where the exception was raised
    assert reason.endswith("(at test_failures.py:36)"), reason
    assert "numpy" in text.split("in _mislabelled")[1], text  # NumPy's frames follow
    assert text.startswith("Traceback (most recent call last):") and "in _mislabelled" in text


@pytest.mark.parametrize("fuse", [None, 2])
def test_a_study_whose_first_trials_raise_alike_stops_and_loses_none_of_them(tmp_path, fuse):
    """A bug in ``evaluate`` fails every trial alike: the study stops after three (solo or in
    fused groups), gives them back with the running ones, and the run after the fix trains
    every trial of the study's total, their configurations first."""
    with pytest.raises(scamp_jax.RepeatedFailureError) as caught:
        scamp_jax.run_study(SPACE, _task(_mislabelled), trials=5, study_dir=tmp_path,
                            fuse=fuse, **KW)
    err = caught.value
    # three runs: solo, three or four trials (two may end in one turn); fused, 2 x 2 + 1
    assert 3 <= len(err.trials) <= (4 if fuse is None else 6), err.trials
    assert "(at test_failures.py:36)" in err.reason
    message = str(err)
    assert ("all failed with the same error, and no trial of this run completed: ValueError: "
            "operands could not be broadcast") in message
    assert "pass failure_limit=0" in message and "in _mislabelled" in message  # its traceback
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states, states  # nothing left to a heartbeat
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert failed and all(t.user_attrs[FAIL_REASON] == INTERRUPTED for t in failed)
    given_back = {tuple(sorted(t.params.items())) for t in failed}
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["trials"] == [] and record["run"]["stopped"] == "repeated failures"
    stored = record["run"]["failures"]  # the error is kept with the run, as the trials' are
    assert stored["trials"] == list(err.trials) and "in _mislabelled" in stored["traceback"]

    done = scamp_jax.run_study(SPACE, _task(), trials=5, study_dir=tmp_path, fuse=fuse, **KW)
    assert done["trials_this_run"] == 5
    # what they trained under the bug is not resumed: every trial trained from step 0
    rows = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert [r["resumed_from"] for r in rows] == [0] * 5
    completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(completed) == 5
    assert given_back <= {tuple(sorted(t.params.items())) for t in completed}


def test_with_no_limit_every_trial_fails_with_its_traceback_in_results_json(tmp_path):
    done = scamp_jax.run_study(SPACE, _task(_mislabelled), trials=4, study_dir=tmp_path,
                               failure_limit=0, **KW)
    assert done["trials_this_run"] == 4 and done["best"] is None
    rows = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert [r["state"] for r in rows] == ["failed"] * 4
    assert all("in _mislabelled" in r["traceback"] for r in rows)
    with open(tmp_path / "results.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert "traceback" not in table[0] and "(at test_failures.py:36)" in table[0]["reason"]


def test_an_error_of_the_users_suggest_keeps_the_finished_trials_in_results_json(tmp_path):
    """A bug in ``suggest`` that ends the run after trials finished: the error goes on, and
    ``results.json`` / ``results.csv`` hold those trials and the run, with why it stopped.
    The engine asks the 4th trial while the 3rd trains (one queued ahead); the bug is raised
    once the 3rd has been evaluated, so that it has finished when the run stops, however
    slowly the machine runs it."""
    import threading  # here: the lines above are the ones other tests name

    calls = []
    reference = Regression()
    evaluated = threading.Semaphore(0)

    def evaluate(model) -> dict[str, float]:
        scores = reference.evaluate(model)
        evaluated.release()
        return scores

    def suggest(trial: optuna.Trial) -> dict:
        calls.append(trial.number)
        if len(calls) == 4:
            for _ in range(3):  # the trials before it: finished (their runs are done)
                assert evaluated.acquire(timeout=120)
            raise ZeroDivisionError("a bug in suggest")
        return SPACE.suggest(trial)

    space = scamp_jax.SearchSpace("mlp", suggest, SPACE.build)
    with pytest.raises(ZeroDivisionError, match="a bug in suggest"):
        scamp_jax.run_study(space, _task(evaluate), trials=6, study_dir=tmp_path, devices=1,
                            max_running_trials=1, **KW)
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    complete = [t.number for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 3, [t.state for t in study.trials]
    record = json.loads((tmp_path / "results.json").read_text())
    assert [r["number"] for r in record["trials"] if r["state"] == "complete"] == complete
    run = record["run"]
    assert run["stopped"] == "error" and run["interrupted"] is True
    assert run["error"].startswith("ZeroDivisionError: a bug in suggest (at test_failures.py:")
    with open(tmp_path / "results.csv", newline="") as handle:
        assert len([r for r in csv.DictReader(handle) if r["state"] == "complete"]) == 3


class _StorageRefuses:
    """Optuna's ``Study.tell`` that raises the database's error once, for the first tell of
    ``state`` (and trial ``number``, where given): a storage failing as a run tells. Made up:
    as root a database file cannot be made read-only. ``refused``: the trials refused."""

    def __init__(self, monkeypatch, state, number: int | None = None) -> None:
        self.monkeypatch, self.state, self.number = monkeypatch, state, number
        self.tell = optuna.Study.tell
        self.refused: list[int] = []

    def __enter__(self) -> _StorageRefuses:
        def tell(study, trial, *args, **kwargs):  # a function: Optuna's Study binds it
            return self._tell(study, trial, *args, **kwargs)

        self.monkeypatch.setattr(optuna.Study, "tell", tell)
        return self

    def __exit__(self, *exc) -> None:
        self.monkeypatch.setattr(optuna.Study, "tell", self.tell)

    def _tell(self, study, trial, *args, **kwargs):
        import sqlalchemy.exc

        number = trial if isinstance(trial, int) else trial.number
        if (kwargs.get("state") == self.state and not self.refused
                and self.number in (None, number)):
            self.refused.append(number)
            raise sqlalchemy.exc.OperationalError("UPDATE trials", {}, Exception("disk I/O error"))
        return self.tell(study, trial, *args, **kwargs)


def _states(tmp_path) -> dict[int, tuple[optuna.trial.TrialState, str | None]]:
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    return {t.number: (t.state, t.user_attrs.get(FAIL_REASON)) for t in study.trials}


_REFUSED = "disk I/O error"
_GIVEN_BACK = (optuna.trial.TrialState.FAIL, INTERRUPTED)


def test_a_tell_the_storage_refuses_leaves_the_trial_given_back_not_running(tmp_path,
                                                                         monkeypatch):
    """The storage refuses to record a finished trial (`_StorageRefuses`). The error ends the
    run, and the trial goes back to the study with the others (failed as interrupted, its
    retry queued), not left running until its heartbeat lapses; the rerun finishes it."""
    with _StorageRefuses(monkeypatch, optuna.trial.TrialState.COMPLETE, 1) as storage, \
            pytest.raises(Exception, match=_REFUSED):
        scamp_jax.run_study(SPACE, _task(), trials=3, study_dir=tmp_path, devices=1,
                            max_running_trials=1, **KW)
    assert storage.refused == [1]
    states = _states(tmp_path)
    assert states[0] == (optuna.trial.TrialState.COMPLETE, None), states
    assert states[1] == _GIVEN_BACK, states
    assert optuna.trial.TrialState.RUNNING not in {s for s, _ in states.values()}, states
    done = scamp_jax.run_study(SPACE, _task(), trials=3, study_dir=tmp_path, devices=1, **KW)
    assert done["trials_this_run"] == 2


def test_a_held_failure_the_storage_refuses_at_the_runs_end_goes_back(tmp_path, monkeypatch):
    """A failure held back from the study (`RepeatedFailures`) is told as the run ends; the
    storage refuses that tell. The error ends the run and the trial goes back to the study,
    not left running until its heartbeat lapses."""
    def broken(model):
        raise ValueError("a bug in evaluate")

    with _StorageRefuses(monkeypatch, optuna.trial.TrialState.FAIL), \
            pytest.raises(Exception, match=_REFUSED):
        scamp_jax.run_study(SPACE, _task(broken), trials=1, study_dir=tmp_path, devices=1,
                            max_running_trials=1, **KW)
    states = _states(tmp_path)
    assert states[0] == _GIVEN_BACK, states
    assert optuna.trial.TrialState.RUNNING not in {s for s, _ in states.values()}, states


def test_a_refused_tell_at_the_runs_end_gives_back_the_misfits_held_too(tmp_path, monkeypatch):
    """At the run's end one failure is held back (its ``build`` raised) and one candidate that
    fits nowhere is held by the intake; the storage refuses the held failure's tell. Every
    trial of the run goes back: none is left running."""
    def suggest(trial: optuna.Trial) -> dict:
        if trial.number == 0:
            return {"width": 16, "learning_rate": 1e-2, "broken": True}
        return {"width": 4_000_000, "learning_rate": 1e-2}  # fits on no device

    space = scamp_jax.SearchSpace("mlp", suggest, SPACE.build)
    with _StorageRefuses(monkeypatch, optuna.trial.TrialState.FAIL) as storage, \
            pytest.raises(Exception, match=_REFUSED):
        scamp_jax.run_study(space, _task(), trials=2, study_dir=tmp_path, devices=1,
                            max_running_trials=1, **KW)
    assert storage.refused == [0]
    states = _states(tmp_path)
    assert optuna.trial.TrialState.RUNNING not in {s for s, _ in states.values()}, states
    assert states[1] == _GIVEN_BACK, states


def test_a_stop_gives_every_trial_back_though_the_study_refuses_one(tmp_path, monkeypatch):
    """Ctrl-C while two trials train; the storage refuses to fail the first one given back.
    It is said, and the other still goes back, not left running."""
    from scamp_jax.hpo import live

    update = live.LiveView.update
    storage = _StorageRefuses(monkeypatch, optuna.trial.TrialState.FAIL)

    def ctrl_c_when_both_train(self, statuses, *args, **kwargs):
        if sum(s.step >= 5 for s in statuses) >= 2:
            storage.__enter__()  # from the stop on
            raise KeyboardInterrupt
        return update(self, statuses, *args, **kwargs)

    monkeypatch.setattr(live.LiveView, "update", ctrl_c_when_both_train)
    with pytest.raises(KeyboardInterrupt):
        scamp_jax.run_study(SPACE, _task(), trials=2, study_dir=tmp_path, devices=2,
                            max_running_trials=2, **{**KW, "steps": 5000})
    storage.__exit__()
    monkeypatch.setattr(live.LiveView, "update", update)
    assert len(storage.refused) == 1
    states = _states(tmp_path)
    assert states[1 - storage.refused[0]] == _GIVEN_BACK, states


def test_an_error_of_suggest_before_any_trial_ran_writes_nothing(tmp_path):
    """``suggest`` raises on the study's first trial: nothing ran, so no results are written,
    and the rerun after the fix trains the study's trials."""
    def suggest(trial: optuna.Trial) -> dict:
        raise ZeroDivisionError("a bug in suggest")

    space = scamp_jax.SearchSpace("mlp", suggest, SPACE.build)
    with pytest.raises(ZeroDivisionError, match="a bug in suggest"):
        scamp_jax.run_study(space, _task(), trials=2, study_dir=tmp_path, devices=1, **KW)
    assert not (tmp_path / "results.json").exists()
    done = scamp_jax.run_study(SPACE, _task(), trials=2, study_dir=tmp_path, devices=1, **KW)
    assert done["trials_this_run"] == 2


def _outcome(number: int, state: str = "failed", reason: str = "E: x (at t.py:1)",
             raised: bool = True) -> TrialOutcome:
    return TrialOutcome(number, state, value=1.0 if state == "complete" else None,
                        reason=reason if state == "failed" else "",
                        attrs={"traceback": "Traceback ..."} if raised else {})


def test_only_alike_raised_failures_before_any_success_are_held():
    told, given = [], []
    guard = RepeatedFailures(3, lambda o: told.append(o.number), given.append)
    assert guard.hold(_outcome(0)) and guard.hold(_outcome(1))
    # an error raised elsewhere breaks the streak: the two are told as the failures they are
    assert guard.hold(_outcome(2, reason="E: y (at t.py:2)")) and told == [0, 1]
    # a failure without an exception (a non-finite loss) is the configuration's own: told,
    # and the streak goes on
    assert not guard.hold(_outcome(3, reason="loss is nan", raised=False)) and told == [0, 1]
    # the same exception at the same place with another message (a trial's batch size in it)
    assert guard.hold(_outcome(4, reason="E: batch 8 (at t.py:2)")) and not guard.tripped
    assert guard.hold(_outcome(5, reason="E: batch 16 (at t.py:2)")) and guard.tripped
    assert guard.error().trials == (2, 4, 5)
    guard.give_back_held()
    assert given == [2, 4, 5] and told == [0, 1]


def test_a_stop_while_held_failures_are_told_leaves_the_rest_held():
    told = []

    def tell(outcome):
        told.append(outcome.number)
        raise KeyboardInterrupt  # the stop lands after the first write

    given = []
    guard = RepeatedFailures(3, tell, given.append)
    assert guard.hold(_outcome(0)) and guard.hold(_outcome(1))
    with pytest.raises(KeyboardInterrupt):
        guard.release()
    guard.give_back_held()  # what the engine's stop does next
    assert told == [0] and given == [1]


def test_a_fused_groups_members_count_as_one_run():
    guard = RepeatedFailures(2, lambda o: None, lambda n: None)
    group = [TrialOutcome(n, "failed", reason="E: x", attrs={"traceback": "T", "fused_group": 7})
             for n in (7, 8, 9)]
    assert all(guard.hold(o) for o in group) and not guard.tripped
    assert guard.hold(_outcome(10, reason="E: x")) and guard.tripped


def test_a_completed_trial_turns_the_guard_off_for_the_run():
    told = []
    guard = RepeatedFailures(2, lambda o: told.append(o.number), lambda n: None)
    assert guard.hold(_outcome(0))
    assert not guard.hold(_outcome(1, "complete")) and told == [0]
    assert not any(guard.hold(_outcome(n)) for n in (2, 3, 4)) and not guard.tripped
    off = RepeatedFailures(0, lambda o: None, lambda n: None)
    assert not off.hold(_outcome(0)) and not off.tripped


def test_the_command_line_says_the_error_with_its_flag_and_exits_1(capsys):
    from experiments._cli import user_errors

    with pytest.raises(SystemExit) as stop, user_errors():
        raise scamp_jax.RepeatedFailureError([0, 1, 2], "E: x (at t.py:1)", "Traceback ...")
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: trials 0, 1 and 2 all failed with the same error")
    assert "pass --failure-limit 0 (or a larger limit)" in err
    assert err.rstrip().endswith("Traceback ...")


def test_a_traceback_in_the_error_is_not_reworded_as_flags(capsys):
    from experiments._cli import user_errors

    with pytest.raises(SystemExit), user_errors():
        raise scamp_jax.RepeatedFailureError([0, 1], "E: seed=3 (at t.py:1)",
                                             "  train(steps=200, seed=1)\nE: seed=3")
    err = capsys.readouterr().err
    assert "train(steps=200, seed=1)" in err and "E: seed=3 (at t.py:1)" in err


def test_a_bug_keeps_its_traceback_and_a_check_ends_in_one_line(capsys, monkeypatch):
    """A ``ValueError`` raised inside NumPy (not a check of ours: most likely a bug) keeps the
    traceback that locates it above the one line; the project's own check is one line, unless
    ``SCAMP_TRACEBACK=1`` asks for every traceback (as the GPU suite's sections do)."""
    import numpy as np

    from experiments._cli import TRACEBACK_VARIABLE, user_errors
    from scamp_jax._units import parse_bytes

    monkeypatch.delenv(TRACEBACK_VARIABLE, raising=False)
    with pytest.raises(SystemExit) as stop, user_errors():
        np.zeros(3).reshape(2, 2)
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith("Traceback (most recent call last):")
    assert "np.zeros(3).reshape(2, 2)" in err
    assert err.rstrip().splitlines()[-1].startswith("error: cannot reshape array of size 3")

    with pytest.raises(SystemExit) as stop, user_errors():
        parse_bytes("lots")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1

    monkeypatch.setenv(TRACEBACK_VARIABLE, "1")
    with pytest.raises(SystemExit), user_errors():
        parse_bytes("lots")
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "parse_bytes" in err
    assert err.rstrip().splitlines()[-1].startswith("error: ")


def test_an_error_jax_raised_counts_as_a_bug_where_its_cut_traceback_ends_in_our_code():
    """JAX cuts its own frames off an error's traceback: a shape error from a model of
    ``search_spaces/`` traced by ``jit`` then seems to end in the project's code. JAX's note
    on the error says where it was raised, so it keeps its traceback."""
    from pathlib import Path

    import jax
    import jax.numpy as jnp

    from experiments._cli import raised_by_a_check

    source = "def step(x):\n    return jax.jit(lambda a: a @ a)(x)\n"
    ours = Path(__file__).resolve().parents[1] / "search_spaces" / "model_under_test.py"
    scope = {"jax": jax}
    exec(compile(source, str(ours), "exec"), scope)  # a function as if defined in the project
    with pytest.raises(TypeError) as raised:
        scope["step"](jnp.zeros((2, 3)))
    assert not raised_by_a_check(raised.value)
    try:  # the project's own check, raised in its code, is one
        from scamp_jax._units import parse_bytes

        parse_bytes("lots")
    except ValueError as err:
        assert raised_by_a_check(err)


def test_a_ctrl_c_says_whether_a_rerun_resumes(capsys):
    """A study's Ctrl-C points at the rerun that resumes it; planning alone (--plan-only)
    stored nothing, and says so."""
    from experiments._cli import user_errors

    for resumable, said in ((True, "run the same command to resume"),
                            (False, "nothing was stored (planning stores no study)")):
        with pytest.raises(SystemExit) as stop, user_errors(resumable=resumable):
            raise KeyboardInterrupt
        assert stop.value.code == 130
        assert said in capsys.readouterr().err


def _three_fail_while_one_evaluates(meanwhile):
    """An ``evaluate`` under which three trials (width 16) fail alike while the fourth (width
    64, past its last step: a stop no longer reaches it) is evaluating, and calls
    ``meanwhile()`` once they have; and the four trials' configurations, that one first."""
    import threading

    reference = Regression()
    failed = []
    slow_evaluating, three_failed = threading.Event(), threading.Event()

    def evaluate(model) -> dict[str, float]:
        if model.hidden.kernel.shape[1] == 64:  # the slow trial: evaluating while it trips
            slow_evaluating.set()
            three_failed.wait(timeout=120)
            meanwhile()
            return reference.evaluate(model)
        slow_evaluating.wait(timeout=120)  # the others fail once it evaluates
        failed.append(1)
        if len(failed) >= 3:
            three_failed.set()
        raise ValueError("a bug in evaluate")

    first = [{"width": 64, "learning_rate": 1e-2},
             *({"width": 16, "learning_rate": lr} for lr in (1e-3, 2e-3, 3e-3))]
    return evaluate, first


def test_a_trial_that_completes_while_the_guard_stops_the_run_leaves_the_failures_retried(
        tmp_path):
    """The guard trips while another trial is in its final evaluation, which completes while
    the run stops: that trial is kept complete, and the failures go back to the study as the
    error says (a completion told during the stop would have told them failed for good)."""
    import time

    # the guard trips and the run stops meanwhile (milliseconds)
    evaluate, first = _three_fail_while_one_evaluates(lambda: time.sleep(3))
    with pytest.raises(scamp_jax.RepeatedFailureError) as caught:
        scamp_jax.run_study(SPACE, _task(evaluate), trials=4, study_dir=tmp_path, devices=4,
                            initial_params=first, max_running_trials=4, **KW)
    assert sorted(caught.value.trials) == [1, 2, 3]
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    states = {t.number: (t.state, t.user_attrs.get(FAIL_REASON)) for t in study.trials}
    assert states[0][0] == optuna.trial.TrialState.COMPLETE, states
    for number in (1, 2, 3):
        assert states[number] == (optuna.trial.TrialState.FAIL, INTERRUPTED), states
    done = scamp_jax.run_study(SPACE, _task(), trials=4, study_dir=tmp_path, devices=4,
                               initial_params=first, max_running_trials=4, **KW)
    assert done["trials_this_run"] == 3  # the three given back, trained again


def test_a_ctrl_c_while_the_guard_waits_for_the_runs_keeps_every_checkpoint(tmp_path):
    """The guard trips (three trials failed alike) and waits for a trial still evaluating; a
    Ctrl-C meanwhile stops the wait. The runs may not have ended, so nothing of theirs is
    deleted: every trial keeps its checkpoint (the trials go back to the study)."""
    import os
    import signal
    import time

    def ctrl_c_while_the_guard_waits() -> None:
        time.sleep(1)  # the guard trips and waits for this run meanwhile
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C during that wait
        time.sleep(2)

    evaluate, first = _three_fail_while_one_evaluates(ctrl_c_while_the_guard_waits)
    with pytest.raises(KeyboardInterrupt):
        scamp_jax.run_study(SPACE, _task(evaluate), trials=4, study_dir=tmp_path, devices=4,
                            initial_params=first, max_running_trials=4, **KW)
    kept = [p for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()]
    assert len(kept) == 4, sorted(p.name for p in kept)
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in study.trials)


def test_a_ctrl_c_gives_held_failures_back(tmp_path):
    """A Ctrl-C while the first trials fail alike (perhaps the user saw the bug): the held
    failures go back to the study with the running trials, none is counted as failed."""
    import os
    import signal

    calls = []

    def evaluate(model):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return _mislabelled(model)

    with pytest.raises(KeyboardInterrupt):
        scamp_jax.run_study(SPACE, _task(evaluate), trials=4, study_dir=tmp_path, **KW)
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    assert calls and all(t.state != optuna.trial.TrialState.RUNNING for t in study.trials)
    assert all(t.user_attrs.get(FAIL_REASON) == INTERRUPTED for t in study.trials
               if t.state == optuna.trial.TrialState.FAIL)
    # each trial that trained (and evaluated) goes back with its seconds, for its retry's row
    trained = [t for t in study.trials if t.user_attrs.get("wall_seconds", 0) > 0]
    assert len(trained) >= len(calls), [t.user_attrs for t in study.trials]


def test_the_error_survives_pickling():
    import pickle

    err = scamp_jax.RepeatedFailureError([3, 4], "E: x", "tb")
    back = pickle.loads(pickle.dumps(err))
    assert (back.trials, back.reason, back.traceback, str(back)) == (
        err.trials, err.reason, err.traceback, str(err))


def test_a_finite_batch_stream_fails_its_trial_saying_so(tmp_path):
    reference = Regression()

    def three_batches(batch_size, seed):  # the guide says endless; this one is not
        stream = reference.batches(batch_size, seed)
        for _ in range(3):
            yield next(stream)

    task = scamp_jax.FunctionTask(metric="mse", direction="minimize", loss_fn=reference.loss_fn,
                                  batches=three_batches, evaluate=reference.evaluate)
    scamp_jax.run_study(SPACE, task, trials=1, study_dir=tmp_path, **{**KW, "steps": 5})
    [row] = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert row["state"] == "failed" and "ended after 3 batch(es); it must yield batches for as " \
        "long as it is asked" in row["reason"], row["reason"]


def test_a_stream_of_other_batch_sizes_fails_its_trial_saying_so(tmp_path):
    reference = Regression()

    def capped(batch_size, seed):  # at most 3 samples, whatever the plan asked for
        for x, y in reference.batches(batch_size, seed):
            yield x[:3], y[:3]

    task = scamp_jax.FunctionTask(metric="mse", direction="minimize", loss_fn=reference.loss_fn,
                                  batches=capped, evaluate=reference.evaluate)
    scamp_jax.run_study(SPACE, task, trials=1, study_dir=tmp_path, **{**KW, "steps": 5})
    [row] = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert row["state"] == "failed" and row["batch_size"] > 3, row
    assert (f"task.batches({row['batch_size']}, " in row["reason"]
            and "yielded a batch whose array 0 has shape (3, " in row["reason"]
            and f"must hold the {row['batch_size']} samples asked for on its leading axis"
            in row["reason"]), row["reason"]


def test_a_batch_of_other_samples_fails_its_trial_naming_the_shapes(tmp_path):
    # A later batch of 7 features where the step was compiled for 8 met JAX's "argument types
    # differ ... enable_x64 mode" error, whose first line (the reason) cut the shapes off.
    reference = Regression()

    def narrower_third(batch_size, seed):
        for i, (x, y) in enumerate(reference.batches(batch_size, seed)):
            yield (x[:, :7], y) if i == 2 else (x, y)

    task = scamp_jax.FunctionTask(metric="mse", direction="minimize", loss_fn=reference.loss_fn,
                                  batches=narrower_third, evaluate=reference.evaluate)
    scamp_jax.run_study(SPACE, task, trials=1, study_dir=tmp_path, **{**KW, "steps": 5})
    [row] = json.loads((tmp_path / "results.json").read_text())["trials"]
    b = row["batch_size"]
    assert row["state"] == "failed" and (
        f"task.batches({b}, " in row["reason"]
        and f"yielded a batch whose array 0 has shape ({b}, 7), samples of shape (7,); its "
        "first batch's had the shape (8,), which the step was compiled for: every batch of a "
        "stream must hold samples of one shape" in row["reason"]), row["reason"]


def test_a_score_that_is_no_number_fails_its_trial_naming_it(tmp_path):
    reference = Regression()
    task = scamp_jax.FunctionTask(metric="mse", direction="minimize", loss_fn=reference.loss_fn,
                                  batches=reference.batches,
                                  evaluate=lambda model: {"mse": "low"})
    scamp_jax.run_study(SPACE, task, trials=1, study_dir=tmp_path, **{**KW, "steps": 3})
    [row] = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert row["state"] == "failed", row
    assert row["reason"].startswith("TypeError: task.evaluate returned 'mse': 'low'; every "
                                    "score must be one number"), row["reason"]


def test_a_score_may_be_any_array_of_one_number():
    """A score is one number however it comes (a float, a 0-d or one-element array of NumPy
    or JAX, as `jnp.mean(...)[None]` gives); an array of more numbers is refused, naming it.
    One rule for a trial's scores and the best model's test (`checked_scores`)."""
    import jax.numpy as jnp
    import numpy as np

    from scamp_jax.hpo.lifecycle import checked_scores

    for value in (0.5, np.float32(0.5), np.array(0.5), np.array([0.5]), jnp.array([[0.5]])):
        assert checked_scores({"mse": value}, "task.evaluate", "mse") == {"mse": 0.5}
    with pytest.raises(TypeError, match=r"task.test returned 'mse': array\(\[0.75, 0.25\]\); "
                       r"every score must be one number"):
        checked_scores({"mse": np.array([0.75, 0.25])}, "task.test", "mse")


def test_non_finite_losses_are_the_configurations_own_and_never_stop_the_study(tmp_path):
    reference = Regression()
    task = scamp_jax.FunctionTask(
        metric="mse", direction="minimize", batches=reference.batches,
        evaluate=reference.evaluate,
        loss_fn=lambda model, batch: reference.loss_fn(model, batch) * np.float32("nan"))
    done = scamp_jax.run_study(SPACE, task, trials=4, study_dir=tmp_path, **KW)
    rows = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert done["trials_this_run"] == 4 and [r["state"] for r in rows] == ["failed"] * 4
    assert all(r["reason"].startswith("FloatingPointError: loss is nan") and "traceback" not in r
               for r in rows)


def test_a_resume_from_another_models_checkpoint_says_what_to_do(tmp_path):
    import jax.numpy as jnp

    from scamp_jax.hpo.checkpoint import CheckpointUnreadable, TrialCheckpointer

    saved = TrialCheckpointer(tmp_path / "trial_0")
    saved.save(3, {"w": jnp.zeros((4, 2))})
    saved.close()
    again = TrialCheckpointer(tmp_path / "trial_0")
    with pytest.raises(CheckpointUnreadable, match=r"(?s)the checkpoint .*trial_0/3 cannot be "
                       r"read as the state this trial builds \(is it damaged, or did the search "
                       r"space's model or optimizer change since it was saved\?\); orbax: "
                       ) as refused:
        again.restore({"w": jnp.zeros((4, 2)), "b": jnp.zeros((2,))})
    assert (refused.value.directory, refused.value.step) == ((tmp_path / "trial_0").resolve(), 3)
    again.close()


def test_a_space_whose_build_prunes_rejects_those_configurations(tmp_path):
    """``optuna.TrialPruned`` from ``build`` rejects the configuration, as from ``suggest``:
    stored pruned with the space's reason, and it neither stops nor blinds the failure guard."""
    from scamp_jax.space import SearchSpace

    def build(config, rngs):
        if config["width"] == 16:
            raise optuna.TrialPruned("width 16 is not built here")
        return SPACE.build(config, rngs)

    space = SearchSpace(SPACE.name, SPACE.suggest, build, largest=SPACE.largest)
    scamp_jax.run_study(space, _task(), trials=6, study_dir=tmp_path, **KW)
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    ended = {t.number: (t.params["width"], t.state.name) for t in study.trials}
    assert any(state == "PRUNED" for _, state in ended.values()), ended
    assert all((state == "PRUNED") == (width == 16) for width, state in ended.values()), ended
    pruned = [t for t in study.trials if t.state.name == "PRUNED"]
    assert all("pruned by the search space's build: width 16" in t.user_attrs[FAIL_REASON]
               for t in pruned)
    guard = RepeatedFailures(2, lambda o: None, lambda n: None)
    assert not guard.hold(TrialOutcome(0, "pruned", attrs={"steps": 0}))  # rejected: not run
    assert not guard.off


def test_a_study_smaller_than_the_limit_whose_every_trial_raises_alike_stops_too(tmp_path):
    """A first small try (two trials, fewer than ``failure_limit``) of a task with a bug: both
    raise the same error, so the study stops and gives them back, rather than keeping them
    failed for good; the rerun after the fix trains them. (One trial's failure is no
    repetition: a study of one keeps it, as `test_a_finite_batch_stream_fails_its_trial_saying_so`
    does.)"""
    trials = 2
    with pytest.raises(scamp_jax.RepeatedFailureError) as caught:
        scamp_jax.run_study(SPACE, _task(_mislabelled), trials=trials, study_dir=tmp_path, **KW)
    assert caught.value.trials == (0, 1)
    assert str(caught.value).startswith("trials 0 and 1 all failed with the same error")
    fixed = scamp_jax.run_study(SPACE, _task(), trials=trials, study_dir=tmp_path, **KW)
    assert fixed["trials_this_run"] == trials
    record = json.loads((tmp_path / "results.json").read_text())
    assert [r["state"] for r in record["trials"]] == ["complete"] * trials
    # failure_limit=0 keeps a failing configuration's failure, whatever the study's size
    other = tmp_path / "limit-0"
    scamp_jax.run_study(SPACE, _task(_mislabelled), trials=trials, study_dir=other,
                        failure_limit=0, **KW)
    states = [r["state"] for r in json.loads((other / "results.json").read_text())["trials"]]
    assert states == ["failed"] * trials


def test_a_check_of_what_the_users_code_returned_names_no_line_of_the_library(tmp_path):
    """An error the package raises of a value the user's code returned (``evaluate``'s scores
    here, checked after it returned: none of its frames is on the stack) names what returned
    it and points at no line: not one of the package's, where the bug is not (its traceback,
    kept with the trial, has every frame)."""
    with pytest.raises(scamp_jax.RepeatedFailureError) as caught:
        scamp_jax.run_study(SPACE, _task(lambda model: {"mse": "high"}), trials=3,
                            study_dir=tmp_path, **KW)
    reason = caught.value.reason
    assert reason.startswith("TypeError: task.evaluate returned 'mse': 'high'"), reason
    assert "(at " not in reason, reason
    assert "lifecycle.py" in caught.value.traceback


def test_a_check_whose_message_names_each_trials_value_still_stops_a_study_of_that_bug(
        tmp_path):
    """The package's check of what ``evaluate`` returned names the value (here another each
    trial) and no line of the user's: such failures are the same error by where the check
    raised (the innermost frame of their traceback), so the study stops after three."""
    import itertools

    values = itertools.count()
    with pytest.raises(scamp_jax.RepeatedFailureError) as caught:
        scamp_jax.run_study(SPACE, _task(lambda model: float(next(values))), trials=6,
                            study_dir=tmp_path, **KW)
    assert len(caught.value.trials) == 3, caught.value.trials
    assert "(at " not in caught.value.reason


_STUDY_ON_A_FULL_DISK = """
import os, resource, signal, sys
import optuna
from experiments._cli import user_errors
optuna.logging.set_verbosity(optuna.logging.WARNING)
path = sys.argv[1]
study = optuna.create_study(storage=f"sqlite:///{path}", study_name="s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
held = sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))
resource.setrlimit(resource.RLIMIT_FSIZE, (held + 4096, resource.RLIM_INFINITY))
with user_errors():
    for _ in range(50):
        study.ask().set_user_attr("blob", "x" * 100_000)
"""


def test_a_study_database_the_disk_refuses_is_said_in_one_line(tmp_path):
    """The disk refuses the study database's writes (here a file size limit, as a full disk
    would): Optuna raises its StorageInternalError, whose words blame the data; the command
    line says in one line that the disk refused it and how to go on, with no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _STUDY_ON_A_FULL_DISK, str(tmp_path / "s.db")],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the study database could not be written (disk I/O error): free space where it "
        "is (or check that disk), then run the same command; the finished trials are kept")


_STUDY_DATABASE_LOCKED = """
import sqlite3, sys
import optuna
from experiments._cli import user_errors
optuna.logging.set_verbosity(optuna.logging.WARNING)
path = sys.argv[1]
storage = optuna.storages.RDBStorage(f"sqlite:///{path}",
                                     engine_kwargs={"connect_args": {"timeout": 0.2}})
study = optuna.create_study(storage=storage, study_name="s")
holder = sqlite3.connect(path)
holder.execute("BEGIN EXCLUSIVE")  # another process's write, held
with user_errors():
    study.ask()
"""


def test_a_busy_study_database_is_said_busy_not_damaged(tmp_path):
    """Optuna wraps any error of a database session in its StorageInternalError, a database
    another process holds locked too: that is said as busy, with the way on (run again), not
    as a database to restore from a copy."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _STUDY_DATABASE_LOCKED, str(tmp_path / "s.db")],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the study database did not answer (database is locked): it may be busy (another "
        "process's long write) or unreachable; run the same command again, which resumes the "
        "study, or check --storage")


def test_a_fused_study_whose_every_group_raises_alike_stops_and_gives_its_trials_back(
        tmp_path):
    """The guard counts a fused group as one run (its members share their architecture).
    Four trials in groups of two are two runs, fewer than the limit of 3; both raise alike,
    so when the run has nothing more to train the study stops and gives them back, where it
    kept all four failed for good (a limit that two groups never reach)."""
    with pytest.raises(scamp_jax.RepeatedFailureError) as caught:
        scamp_jax.run_study(SPACE, _task(_mislabelled), trials=4, study_dir=tmp_path, fuse=2,
                            **KW)
    assert sorted(caught.value.trials) == [0, 1, 2, 3]
    fixed = scamp_jax.run_study(SPACE, _task(), trials=4, study_dir=tmp_path, fuse=2, **KW)
    assert fixed["trials_this_run"] == 4
    record = json.loads((tmp_path / "results.json").read_text())
    assert [r["state"] for r in record["trials"]] == ["complete"] * 4


def test_the_last_trials_of_a_resumed_study_that_raise_alike_stop_it_and_go_back(tmp_path):
    """A study's guard counts the runs of this run, not the study's trials: a study of 4 whose
    first run completed 2, resumed with a bug in the task, makes 2 runs, fewer than the limit
    of 3. Both raise alike and the run has nothing more to train, so the study stops and gives
    them back (it kept both failed for good, and the fixed rerun trained nothing)."""
    scamp_jax.run_study(SPACE, _task(), trials=2, study_dir=tmp_path, **KW)
    with pytest.raises(scamp_jax.RepeatedFailureError) as caught:
        scamp_jax.run_study(SPACE, _task(_mislabelled), trials=4, study_dir=tmp_path, **KW)
    assert caught.value.trials == (2, 3)
    fixed = scamp_jax.run_study(SPACE, _task(), trials=4, study_dir=tmp_path, **KW)
    assert fixed["trials_this_run"] == 2
    record = json.loads((tmp_path / "results.json").read_text())
    assert [r["state"] for r in record["trials"]] == ["complete"] * 4


def test_configurations_that_fail_on_purpose_stop_a_resumed_study_once_not_at_every_rerun(
        tmp_path):
    """The last two trials of a resumed study fail alike, on purpose (their configurations):
    the run stops once and gives them back; the rerun's retries of them fail alike again, and
    are told failed (a retry does not count for the end of a run), so the study ends instead
    of stopping at every rerun."""
    scamp_jax.run_study(SPACE, _task(), trials=2, study_dir=tmp_path, **KW)
    with pytest.raises(scamp_jax.RepeatedFailureError):
        scamp_jax.run_study(SPACE, _task(_mislabelled), trials=4, study_dir=tmp_path, **KW)
    again = scamp_jax.run_study(SPACE, _task(_mislabelled), trials=4, study_dir=tmp_path, **KW)
    assert again["trials_this_run"] == 2
    states = [r["state"] for r in json.loads((tmp_path / "results.json").read_text())["trials"]]
    assert sorted(states) == ["complete", "complete", "failed", "failed"]
