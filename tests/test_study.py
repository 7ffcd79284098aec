"""The study: RDB storage, seeded samplers, pruners, totals across runs, interrupted trials."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from scamp_jax.hpo.study import (
    CHECKPOINT_KEY,
    FAIL_REASON,
    INTERRUPTED,
    AskedTrial,
    AskLater,
    OptunaTrialSource,
    StudySettingsError,
    TrialOutcome,
    make_pruner,
    make_sampler,
    open_study,
    retried_from,
    storage_url,
    when_full,
)
from scamp_jax.space import SearchSpace


def suggest(trial: Any) -> dict[str, Any]:
    return {"width": trial.suggest_categorical("width", [8, 16, 32]),
            "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)}


SPACE = SearchSpace("toy", suggest, build=lambda c, r: None,
                    grid={"width": [8, 16, 32], "learning_rate": [1e-3, 1e-2]})


def source(tmp_path, n_trials: int, sampler: str = "tpe", seed: int = 0, heartbeat: int = 10):
    """A trial source on the study in ``tmp_path`` (grace period: three times ``heartbeat`` s)."""
    study = open_study("toy", study_dir=tmp_path, sampler=sampler, seed=seed, grid=SPACE.grid,
                       heartbeat_interval=heartbeat, grace_period=3 * heartbeat)
    return OptunaTrialSource(study, SPACE, n_trials, poll_seconds=0.2)


def test_default_storage_is_sqlite_in_the_study_dir(tmp_path):
    assert storage_url(tmp_path) == f"sqlite:///{tmp_path.resolve() / 'study.db'}"
    assert storage_url(tmp_path, "postgresql://db/x") == "postgresql://db/x"
    source(tmp_path, 1)
    assert (tmp_path / "study.db").is_file()


def test_an_existing_database_is_checked_against_optunas_schema_and_a_new_one_opens(tmp_path):
    import sqlite3

    source(tmp_path, 1)  # a new file: made and stamped by this process, then used
    with sqlite3.connect(tmp_path / "study.db") as conn:  # as if a newer Optuna had stamped it
        conn.execute("UPDATE alembic_version SET version_num = 'v99.0.0'")
    with pytest.raises(RuntimeError, match="no longer compatible"):
        source(tmp_path, 1)


def test_a_sqlite_study_writes_ahead_and_another_process_reads_every_trial(tmp_path):
    import sqlite3
    import subprocess
    import sys

    from sqlalchemy import text

    handle = open_study("toy", study_dir=tmp_path, grid=SPACE.grid)
    src = OptunaTrialSource(handle, SPACE, 2, poll_seconds=0.2)
    with handle.storage.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA synchronous")).scalar() == 1  # NORMAL
    asked = src.ask()
    src.tell(TrialOutcome(asked.number, "complete", 0.5, attrs={"batch_size": 8}))
    # A second process reads the committed trial while this one still holds the file open.
    out = subprocess.run(
        [sys.executable, "-c",
         "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
         "print(c.execute('select count(*) from trials where state = \"COMPLETE\"')"
         ".fetchone()[0], c.execute('select count(*) from trial_user_attributes "
         "where key = \"batch_size\"').fetchone()[0])", str(tmp_path / "study.db")],
        capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]
    assert sqlite3.connect(tmp_path / "study.db").execute("PRAGMA journal_mode").fetchone()[0] \
        == "wal"  # the mode stays with the file


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid"])
def test_samplers_are_reproducible_with_a_seed(tmp_path, sampler):
    runs = []
    for i in range(2):
        src = source(tmp_path / str(i), 4, sampler=sampler, seed=3)
        asked = [src.ask() for _ in range(4)]
        runs.append([dict(a.params) for a in asked])
    assert runs[0] == runs[1]
    assert len({tuple(sorted(p.items())) for p in runs[0]}) > 1


def test_a_rows_seconds_add_each_stopped_attempts_once(tmp_path):
    """A trial stopped after 5 s, its retry given back before it ran, the next retry done in
    2 s: its row took 7 s. A retry does not take its attempt's seconds, which the row would
    count twice."""
    from scamp_jax.hpo.report import trial_records
    from scamp_jax.hpo.study import OptunaTrialSource, TrialOutcome, open_study

    source = OptunaTrialSource(open_study("s", study_dir=tmp_path), SearchSpace(
        "s", lambda t: {"x": t.suggest_float("x", 0.0, 1.0)}, build=lambda c, r: None), 1)
    first = source.ask()
    source.interrupt(first.number, wall_seconds=5.0)
    unrun = source.ask()
    assert unrun.retry_of == first.number
    source.interrupt(unrun.number)  # given back before it ran: no seconds of its own
    last = source.ask()
    source.tell(TrialOutcome(last.number, "complete", value=0.5, attrs={"wall_seconds": 2.0}))
    [row] = trial_records(source.study)
    assert (row["number"], row["retry_of"], row["wall_seconds"]) == (last.number, unrun.number,
                                                                     7.0)
    source.close()


def test_unknown_names_are_rejected_with_the_choices():
    with pytest.raises(ValueError, match="unknown sampler 'x'; choose one of tpe, random, grid"):
        make_sampler("x", 0)
    with pytest.raises(ValueError, match="unknown pruner 'y'; choose one of median"):
        make_pruner("y")
    with pytest.raises(ValueError, match="needs the search space's grid"):
        make_sampler("grid", 0, {})


def test_total_counts_trials_of_earlier_runs(tmp_path):
    src = source(tmp_path, 5)
    for _ in range(3):
        asked = src.ask()
        src.tell(TrialOutcome(asked.number, "complete", value=1.0))
    assert src.remaining() == 2
    # A new process on the same directory: the study is loaded and only two trials remain.
    again = source(tmp_path, 5)
    assert again.finished() == 3 and again.remaining() == 2
    numbers = [again.ask().number for _ in range(2)]
    assert numbers == [3, 4]
    assert again.ask() is None


def test_failed_and_pruned_trials_count_but_interrupted_ones_do_not(tmp_path):
    src = source(tmp_path, 4)
    a, b, c = src.ask(), src.ask(), src.ask()
    src.tell(TrialOutcome(a.number, "failed", reason="ValueError: bug"))
    src.tell(TrialOutcome(b.number, "pruned", reason="pruned at step 10"))
    src.interrupt(c.number)
    assert src.finished() == 2
    trials = src.study.get_trials()
    assert trials[a.number].user_attrs[FAIL_REASON] == "ValueError: bug"
    assert trials[c.number].user_attrs[FAIL_REASON] == INTERRUPTED
    # The interrupted configuration comes back first, with its checkpoint key.
    again = src.ask()
    assert dict(again.params) == dict(c.params)
    assert again.checkpoint_key == c.checkpoint_key == f"trial_{c.number}"


def test_a_retry_names_the_attempt_that_was_stopped_and_is_announced_once(tmp_path):
    """Trial 0 is interrupted (its retry 1 is queued); a second process asks 1 and dies
    with it running; a third, owning the study (``recover_running``), fails 1 and queues its
    retry 2. Retry 2 runs trial 1 again (the attempt stopped, not the chain's first) from trial
    0's checkpoints, and the third process counts trial 1 once: as recovered, not requeued."""
    src = source(tmp_path, 2)
    first = src.ask()
    src.interrupt(first.number)
    assert source(tmp_path, 2).requeued() == [first.number]  # what a rerun announces
    second = source(tmp_path, 2)
    retry = second.ask()
    assert retry.retry_of == first.number and retry.checkpoint_key == first.checkpoint_key
    second.close()  # dies with the retry running
    third = OptunaTrialSource(open_study("toy", study_dir=tmp_path, grid=SPACE.grid), SPACE, 2,
                              poll_seconds=0.2, recover_running=True)
    assert third.recovered == [retry.number] and third.requeued() == []
    again = third.ask()
    assert again.retry_of == retry.number and again.checkpoint_key == first.checkpoint_key
    assert dict(again.params) == dict(first.params)


def test_trials_of_a_dead_process_are_retried_after_the_grace_period(tmp_path):
    src = source(tmp_path, 3, heartbeat=1)
    done = src.ask()
    src.tell(TrialOutcome(done.number, "complete", value=2.0))
    lost = src.ask()
    src.close()  # the process dies here: its trial stays RUNNING and its heartbeat stops
    time.sleep(5)  # past the 3 s grace period (SQLite times are whole seconds)
    again = source(tmp_path, 3, heartbeat=1)
    assert again.recovered == [lost.number]
    old = again.study.get_trials()[lost.number]
    assert old.state == TrialState.FAIL
    assert again.remaining() == 2
    rerun = again.ask()
    assert dict(rerun.params) == dict(lost.params)
    assert rerun.checkpoint_key == lost.checkpoint_key == f"trial_{lost.number}"
    frozen = again.study.get_trials()[rerun.number]
    assert retried_from(frozen) == lost.number
    assert frozen.user_attrs[CHECKPOINT_KEY] == lost.checkpoint_key


def test_a_live_process_keeps_its_trials(tmp_path):
    """A second process neither fails nor re-runs the first one's running trials."""
    first = source(tmp_path, 2, heartbeat=1)
    mine = first.ask()
    time.sleep(3.5)  # longer than the grace period: only the heartbeat keeps the trial alive
    second = source(tmp_path, 2, heartbeat=1)
    theirs = second.ask()
    assert second.recovered == [] and theirs.number != mine.number
    # The study is full, but the first process's trial still runs: it may yet need a retry.
    assert second.ask() == AskLater(0.2, (mine.number,))
    first.tell(TrialOutcome(mine.number, "complete", value=1.0))
    second.tell(TrialOutcome(theirs.number, "complete", value=2.0))
    states = [t.state for t in first.study.get_trials()]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE]
    first.close()
    second.close()


def test_a_waiting_process_finishes_when_the_others_do(tmp_path):
    first = source(tmp_path, 1, heartbeat=1)
    mine = first.ask()
    second = source(tmp_path, 1, heartbeat=1)
    timer = threading.Timer(1.5, first.tell, [TrialOutcome(mine.number, "complete", value=1.0)])
    timer.start()
    answers = []
    while (answer := second.ask()) is not None:  # ask again later, until the trial completed
        answers.append(answer)
        time.sleep(answer.seconds)
    assert answers and set(answers) == {AskLater(0.2, (mine.number,))}
    assert [t.state for t in second.study.get_trials()] == [TrialState.COMPLETE]
    first.close()


def test_a_busy_process_still_retries_a_dead_process_trial(tmp_path):
    """A process with trials of its own running is not done while a dead process's trial is
    still RUNNING: it is told to ask again later, and once the heartbeat is stale it gets the
    retry, so the study ends with every trial it asked for."""
    dead = source(tmp_path, 2, heartbeat=1)
    lost = dead.ask()
    dead.close()  # its process died: the trial stops beating and stays RUNNING
    alive = source(tmp_path, 2, heartbeat=1)
    mine = alive.ask()
    assert mine.number != lost.number
    answer = alive.ask()
    # Not None, although this source has a trial running: the dead process's trial may need it.
    assert answer == AskLater(0.2, (lost.number,))
    deadline = time.monotonic() + 20
    while isinstance(answer, AskLater) and time.monotonic() < deadline:
        time.sleep(answer.seconds)
        answer = alive.ask()
    assert isinstance(answer, AskedTrial) and retried_from(
        alive.study.get_trials()[answer.number]) == lost.number
    alive.tell(TrialOutcome(mine.number, "complete", value=1.0))
    alive.tell(TrialOutcome(answer.number, "complete", value=2.0))
    assert alive.ask() is None
    assert sum(t.state == TrialState.COMPLETE for t in alive.study.get_trials()) == 2
    alive.close()


def test_when_full_asks_again_only_for_other_processes_trials_under_a_heartbeat():
    assert when_full([], True, 1.0) is None
    assert when_full([7, 3], True, 1.5) == AskLater(1.5, (3, 7))
    assert when_full([7, 3], False, 1.5) is None  # without liveness nothing would retry them


def test_extending_a_study_draws_new_configurations(tmp_path):
    """``--trials 4`` after ``--trials 2``: trials 2 and 3 are not trials 0 and 1 again."""
    for sampler in ("tpe", "random"):
        src = source(tmp_path / sampler, 2, sampler=sampler)
        first = [src.ask() for _ in range(2)]
        for t in first:
            src.tell(TrialOutcome(t.number, "complete", value=1.0))
        more = source(tmp_path / sampler, 4, sampler=sampler)
        later = [more.ask() for _ in range(2)]
        assert [t.number for t in later] == [2, 3]
        old = {tuple(sorted(t.params.items())) for t in first}
        assert not old & {tuple(sorted(t.params.items())) for t in later}, sampler


def test_a_study_refuses_other_settings(tmp_path):
    from scamp_jax.hpo.study.storage import free_study_name

    settings = {"space": "small", "preset": "smoke", "steps": 150, "seed": 0,
                "memory_per_device": 2**30}
    open_study("toy", study_dir=tmp_path, settings=settings)
    open_study("toy", study_dir=tmp_path, settings=settings)  # the same settings resume it
    with pytest.raises(StudySettingsError, match=r"created with steps=150, this run asks for "
                       r"steps=100; repeat the study's settings to resume it, or pass "
                       r"study_name='toy-2'") as err:
        open_study("toy", study_dir=tmp_path, settings={**settings, "steps": 100})
    # the experiments' command lines say it in their flags; the error survives a pickle
    assert err.value.as_command_line() == (
        "study 'toy' was created with --steps 150, this run asks for --steps 100; rerun with "
        "--steps 150, or pass --study-name toy-2 to start a new study")
    again = pickle.loads(pickle.dumps(err.value))
    assert str(again) == str(err.value) and again.stored == {"steps": 150}
    # a setting the study has none of, and a budget in the units the flag takes
    other = StudySettingsError("toy", {"eval_dir": None, "memory_per_device": 2**30},
                               {"eval_dir": "/data/eval", "memory_per_device": 3 * 2**29})
    assert other.as_command_line() == (
        "study 'toy' was created with no --eval-dir, --memory-per-device 1GiB, this run asks "
        "for --eval-dir /data/eval, --memory-per-device 1536MiB; rerun with "
        "--memory-per-device 1GiB and without --eval-dir, or pass --study-name toy-2 to start a "
        "new study")
    # the library's words: the budget in bytes, as the study keeps it, and in the units given
    assert str(other).startswith(
        "study 'toy' was created with eval_dir=None, memory_per_device=1073741824 ('1GiB'), "
        "this run asks for eval_dir='/data/eval', memory_per_device=1610612736 ('1536MiB');")
    # the space has no flag: the preset that picks it is what a rerun repeats
    preset = StudySettingsError("toy", {"space": "swinir-small/small", "preset": "smoke"},
                                {"space": "swinir-paper/paper", "preset": "paper"})
    assert preset.as_command_line() == (
        "study 'toy' was created with the search space swinir-small/small, --preset smoke, this "
        "run asks for the search space swinir-paper/paper, --preset paper; rerun with --preset "
        "smoke, or pass --study-name toy-2 to start a new study")
    open_study("toy-2", study_dir=tmp_path, settings={**settings, "steps": 100})
    # the name suggested is one that no study in the storage has
    for name in ("toy", "toy-2"):
        with pytest.raises(StudySettingsError, match=r"pass study_name='toy-3' to start") as err:
            open_study(name, study_dir=tmp_path, settings={**settings, "steps": 50})
        assert err.value.as_command_line().endswith("--study-name toy-3 to start a new study")
        assert pickle.loads(pickle.dumps(err.value)).new_name == "toy-3"
    # a number that is the name's own is no count: resnet-50's next is resnet-50-2
    assert free_study_name("resnet-50", {"resnet-50"}.__contains__) == "resnet-50-2"
    assert free_study_name("toy-2", {"toy", "toy-2", "toy-3"}.__contains__) == "toy-4"


def test_median_pruner_stops_a_trial_behind_the_others(tmp_path):
    study = open_study("toy", study_dir=tmp_path, direction="maximize", pruner="median")
    src = OptunaTrialSource(study, SPACE, 4)
    for value in (10.0, 12.0):
        t = src.ask()
        assert not src.report(t.number, 5, value)
        src.tell(TrialOutcome(t.number, "complete", value=value))
    slow = src.ask()
    assert src.report(slow.number, 5, 1.0)


def test_direction_mismatch_is_reported(tmp_path):
    open_study("toy", study_dir=tmp_path, direction="maximize")
    with pytest.raises(StudySettingsError, match=r"created to maximize its objective, not to "
                       r"minimize; a study keeps its direction: open it with "
                       r"direction='maximize'") as err:
        open_study("toy", study_dir=tmp_path, direction="minimize")
    # one kind of error for every setting a study keeps; the command lines say it as it is
    assert (err.value.stored, err.value.wanted) == ({"direction": "maximize"},
                                                    {"direction": "minimize"})
    assert err.value.as_command_line() == str(err.value)
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)


def test_a_study_keeps_the_metric_its_values_are(tmp_path):
    # A rerun scoring another metric stored its values beside the first metric's: Optuna's
    # best trial and the sampler then compared accuracies with errors.
    open_study("toy", study_dir=tmp_path, direction="maximize")  # made before it was kept
    open_study("toy", study_dir=tmp_path, direction="maximize", metric="accuracy")
    open_study("toy", study_dir=tmp_path, direction="maximize", metric="accuracy")
    open_study("toy", study_dir=tmp_path, direction="maximize")  # a caller that does not say
    with pytest.raises(StudySettingsError, match=r"study 'toy' in the storage scores its "
                       r"trials by 'accuracy', not 'error'; a study keeps its metric"):
        open_study("toy", study_dir=tmp_path, direction="maximize", metric="error")
    # a rerun refused for its settings stores no metric in a study that had none
    open_study("old", study_dir=tmp_path, settings={"steps": 10})
    with pytest.raises(StudySettingsError):
        open_study("old", study_dir=tmp_path, settings={"steps": 20}, metric="error")
    open_study("old", study_dir=tmp_path, settings={"steps": 10}, metric="accuracy")


def test_a_warm_start_outside_a_drawn_range_is_kept_and_said(caplog):
    import logging

    from scamp_jax.hpo.study.source import check_initial_params

    with caplog.at_level(logging.WARNING, logger="scamp_jax.hpo.study.source"):
        check_initial_params(SPACE, [{"width": 8, "learning_rate": 0.5}])
        check_initial_params(SPACE, [{"width": 8}])  # the rest is the sampler's
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith("initial_params[0] = {'width': 8, 'learning_rate': 0.5}: Fixed "
                           "parameter learning_rate with value 0.5 is out of range"), said


def test_outcome_validation():
    with pytest.raises(ValueError, match="state='done' is not a trial outcome"):
        TrialOutcome(0, "done")
    with pytest.raises(ValueError, match="complete but has no value"):
        TrialOutcome(0, "complete")


def test_siblings_need_a_study_opened_by_open_study(tmp_path):
    import optuna

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'plain.db'}")
    with pytest.raises(ValueError, match="siblings=1 .* need a study opened by"):
        OptunaTrialSource(study, SPACE, 4, siblings=1, training_keys=("learning_rate",))
    plain = OptunaTrialSource(study, SPACE, 4)  # no siblings: any study will do
    assert plain.ask() is not None and not plain.has_liveness


GRID4 = SearchSpace("toy", suggest, build=lambda c, r: None,
                    grid={"width": [8, 16], "learning_rate": [1e-3, 1e-2]})


def grid_source(tmp_path, n_trials: int, seed: int = 0) -> OptunaTrialSource:
    study = open_study("toy", study_dir=tmp_path, sampler="grid", seed=seed, grid=GRID4.grid)
    return OptunaTrialSource(study, GRID4, n_trials)


def point(asked: AskedTrial) -> tuple[Any, ...]:
    return (asked.params["width"], asked.params["learning_rate"])


def test_a_grid_covers_every_point_before_the_study_ends(tmp_path):
    """Four points, six trials, asked while the earlier ones still run: four distinct points,
    then nothing, and telling the last one raises nothing (Optuna's grid would call
    ``study.stop()``)."""
    src = grid_source(tmp_path, 6, seed=5)
    assert src.grid_points == 4
    asked = [src.ask() for _ in range(4)]
    assert sorted(map(point, asked)) == [(8, 1e-3), (8, 1e-2), (16, 1e-3), (16, 1e-2)]
    assert src.grid_done() and src.ask() is None
    for t in asked:
        src.tell(TrialOutcome(t.number, "complete", value=1.0))
    assert src.ask() is None and src.finished() == 4
    # A rerun of the finished grid, even asking for more, has nothing to do.
    assert grid_source(tmp_path, 8, seed=5).ask() is None


def test_a_grid_point_the_space_rejects_in_suggest_is_done(tmp_path):
    """A point whose ``suggest`` raises ``optuna.TrialPruned`` before drawing every value is
    stored pruned with part of its parameters; it is a visited point of the grid all the same,
    so the study ends after the four points, not by asking duplicates up to its total."""
    def suggest_refusing(trial: Any) -> dict[str, Any]:
        width = trial.suggest_categorical("width", [8, 16])
        if width == 16:
            raise optuna.TrialPruned("width 16 is refused")
        return {"width": width,
                "learning_rate": trial.suggest_categorical("learning_rate", [1e-3, 1e-2])}

    space = SearchSpace("toy", suggest_refusing, build=lambda c, r: None, grid=GRID4.grid)
    study = open_study("toy", study_dir=tmp_path, sampler="grid", seed=0, grid=space.grid)
    src = OptunaTrialSource(study, space, 8)
    asked = []
    while (a := src.ask()) is not None:
        asked.append(a)
        src.tell(TrialOutcome(a.number, "complete", value=1.0))
    assert sorted(map(point, asked)) == [(8, 1e-3), (8, 1e-2)]
    trials = study.study.get_trials()
    assert len(trials) == 4 and src.grid_done()
    assert sorted(t.state.name for t in trials) == ["COMPLETE", "COMPLETE", "PRUNED", "PRUNED"]
    assert {t.user_attrs[FAIL_REASON] for t in trials if t.state.name == "PRUNED"} == {
        "pruned by the search space's suggest: width 16 is refused"}


def test_a_rejection_without_words_says_how_it_came(tmp_path):
    """``raise optuna.TrialPruned()`` with no message: the stored reason says what raised it,
    where it ended in ": " and nothing."""
    def refusing(trial: Any) -> dict[str, Any]:
        trial.suggest_categorical("width", [8])
        raise optuna.TrialPruned()

    study = open_study("toy", study_dir=tmp_path, seed=0)
    src = OptunaTrialSource(study, SearchSpace("toy", refusing, build=lambda c, r: None), 1)
    assert src.ask() is None
    (trial,) = study.study.get_trials()
    assert trial.user_attrs[FAIL_REASON] == (
        "pruned by the search space's suggest (it raised optuna.TrialPruned)")


def test_a_grid_reruns_an_interrupted_point_and_only_it(tmp_path):
    src = grid_source(tmp_path, 6)
    first = [src.ask() for _ in range(3)]
    src.interrupt(first[0].number)
    for t in first[1:]:
        src.tell(TrialOutcome(t.number, "complete", value=1.0))
    again = grid_source(tmp_path, 6)
    rest = [again.ask(), again.ask()]
    assert point(rest[0]) == point(first[0])  # the queued retry first
    assert {point(t) for t in first + rest} == {(8, 1e-3), (8, 1e-2), (16, 1e-3), (16, 1e-2)}
    assert again.ask() is None


def test_per_trial_seeds_keep_each_trials_draw_independent_of_the_asker(tmp_path):
    """Trial n's configuration depends on the seed, n and the history, not on which process
    (or which sampler object) asked the trials before it."""
    one = source(tmp_path / "one", 4, sampler="random", seed=2)
    together = [one.ask() for _ in range(4)]
    two = source(tmp_path / "two", 4, sampler="random", seed=2)
    split = [two.ask() for _ in range(2)]
    split += [source(tmp_path / "two", 4, sampler="random", seed=2).ask() for _ in range(2)]
    assert [dict(t.params) for t in together] == [dict(t.params) for t in split]


def test_siblings_one_process_holds_count_in_another(tmp_path):
    """Two processes on one fused study: the siblings the first holds for its proposal are
    taken slots for the second, so together they ask exactly the study's trials."""
    def fused(n_trials: int) -> OptunaTrialSource:
        handle = open_study("toy", study_dir=tmp_path, sampler="random", seed=0)
        return OptunaTrialSource(handle, SPACE, n_trials, poll_seconds=0.2, siblings=1,
                                 training_keys=("learning_rate",))

    first, second = fused(3), fused(3)
    proposal = first.ask()
    assert proposal.siblings == 1 and second.remaining() == 1
    assert first.held_siblings(proposal.number) == 1 and second.held_siblings(proposal.number) == 0
    other = second.ask()  # the last free slot: no room for a sibling of its own
    assert other.siblings == 0 and other.sibling_of is None
    assert isinstance(second.ask(), AskLater) and second.remaining() == 0
    sibling = first.ask()
    assert sibling.sibling_of == proposal.number and first.held_siblings(proposal.number) == 0
    assert sibling.params["width"] == proposal.params["width"]
    assert isinstance(first.ask(), AskLater)  # the other process's trial may still need a retry
    for src, t in ((first, proposal), (first, sibling), (second, other)):
        src.tell(TrialOutcome(t.number, "complete", value=1.0))
    assert first.ask() is None and second.ask() is None and first.finished() == 3
    # A proposal told finished gives up its unasked siblings: their slots are free again.
    third = fused(5)
    lead = third.ask()
    assert lead.siblings == 1 and third.remaining() == 0 and third.held_siblings(lead.number) == 1
    third.tell(TrialOutcome(lead.number, "complete", value=1.0))
    assert third.held_siblings(lead.number) == 0
    assert third.remaining() == 1 and third.ask().sibling_of is None


def test_siblings_of_a_configuration_with_derived_values_share_its_architecture(tmp_path):
    # The siblings were queued with suggest's whole configuration: Optuna stores a queued
    # trial's parameters as JSON, and a derived function or NumPy value ended the study.
    import numpy as np

    def derived(trial: optuna.Trial) -> dict[str, Any]:
        width = trial.suggest_categorical("width", [8, 16, 32])
        # a training key derived from a parameter of another name: the sampler's for each
        return {"width": width, "learning_rate": 10 ** trial.suggest_float("log10_lr", -3, -1),
                "activation": np.tanh, "hidden": np.int64(width) * 2}

    space = SearchSpace("derived", derived, build=lambda c, r: None)
    handle = open_study("derived", study_dir=tmp_path, sampler="random", seed=0)
    src = OptunaTrialSource(handle, space, 3, poll_seconds=0.2, siblings=2,
                            training_keys=("learning_rate",))
    proposal = src.ask()
    siblings = [src.ask(), src.ask()]
    assert proposal.siblings == 2 and {s.sibling_of for s in siblings} == {proposal.number}
    for s in siblings:
        assert (s.params["width"], s.params["hidden"]) == (proposal.params["width"],
                                                         proposal.params["hidden"])
        assert s.params["activation"] is np.tanh
    assert len({t.params["learning_rate"] for t in (proposal, *siblings)}) == 3


@pytest.mark.parametrize("stopped_at", ["queueing the retry", "failing the trial"])
def test_a_stop_inside_an_interruption_loses_no_trial(tmp_path, monkeypatch, stopped_at):
    """A second Ctrl-C while a trial is being failed as interrupted (its retry queued and the
    trial failed: two writes) leaves exactly one retry of it after a restart, whichever write
    it cut short. The stop is raised where it would land, as the KeyboardInterrupt a second
    Ctrl-C raises (a test cannot time a real one between two database writes)."""
    src = source(tmp_path, 3, heartbeat=1)
    done = src.ask()
    src.tell(TrialOutcome(done.number, "complete", value=2.0))
    cut = src.ask()

    def stop(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(src.study, "add_trial" if stopped_at == "queueing the retry" else "tell",
                        stop)
    with pytest.raises(KeyboardInterrupt):
        src.interrupt(cut.number)
    monkeypatch.undo()
    src.close()  # the process ends here: its heartbeat stops
    time.sleep(5)  # past the 3 s grace period
    again = source(tmp_path, 3, heartbeat=1)
    trials = again.study.get_trials()
    assert trials[cut.number].state == TrialState.FAIL
    assert [t.number for t in trials if retried_from(t) == cut.number] == [len(trials) - 1]
    rerun = again.ask()
    assert dict(rerun.params) == dict(cut.params) and rerun.checkpoint_key == cut.checkpoint_key
    again.tell(TrialOutcome(rerun.number, "complete", value=1.0))
    last = again.ask()
    assert retried_from(again.study.get_trials()[last.number]) is None  # a new proposal
    again.tell(TrialOutcome(last.number, "complete", value=3.0))
    assert again.ask() is None and again.finished() == 3


def test_a_retry_holds_no_siblings_of_its_trial(tmp_path):
    """A proposal interrupted while siblings were held for it: its retry is no proposal, so it
    does not carry the held count that other processes would book as taken slots once it
    runs (the siblings stay held here, for the proposal's asker)."""
    from scamp_jax.hpo.study import HELD_SIBLINGS, OptunaTrialSource

    study = open_study("toy", study_dir=tmp_path, sampler="tpe", seed=0, grid=SPACE.grid)
    src = OptunaTrialSource(study, SPACE, 6, poll_seconds=0.2, siblings=2,
                            training_keys=("learning_rate",))
    proposal = src.ask()
    assert proposal.siblings == 2
    assert src.study.get_trials()[proposal.number].user_attrs[HELD_SIBLINGS] == 2
    src.interrupt(proposal.number)
    retry = next(t for t in src.study.get_trials() if retried_from(t) == proposal.number)
    assert HELD_SIBLINGS not in retry.user_attrs
    assert src.remaining() == 6 - 2  # nothing runs; the two siblings are still held here


def test_opening_a_study_leaves_optunas_creation_note_to_our_opening_lines(tmp_path, capfd):
    """Optuna's "A new study created" / "Using an existing study" note is dropped while a study
    opens (the session's opening lines say more), on that thread only: Optuna's verbosity is
    not changed, and a study created elsewhere is still announced."""
    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.INFO)  # Optuna's default
    try:
        open_study("toy", study_dir=tmp_path)
        open_study("toy", study_dir=tmp_path)  # the existing one
        assert optuna.logging.get_verbosity() == optuna.logging.INFO
        err = capfd.readouterr().err
        assert "A new study created" not in err and "Using an existing study" not in err, err
        optuna.create_study()
        assert "A new study created in memory" in capfd.readouterr().err
        # while one thread opens a study quietly, another thread's new study is announced
        from scamp_jax.hpo.study.storage import quiet_study_creation

        inside, done = threading.Event(), threading.Event()

        def quiet() -> None:
            with quiet_study_creation():
                assert optuna.logging.get_verbosity() == optuna.logging.INFO
                optuna.create_study(study_name="quiet")
                inside.set()
                done.wait(timeout=60)

        thread = threading.Thread(target=quiet)
        thread.start()
        assert inside.wait(timeout=60)
        optuna.create_study(study_name="loud")  # while the other thread is inside its block
        done.set()
        thread.join(timeout=60)
        err = capfd.readouterr().err
        assert "with name: loud" in err and "with name: quiet" not in err, err
    finally:
        optuna.logging.set_verbosity(before)


def test_a_study_database_another_process_is_writing_is_not_called_damaged(tmp_path):
    import sqlite3

    from scamp_jax.hpo.study.storage import check_storage

    writer = sqlite3.connect(tmp_path / "study.db", isolation_level=None)
    writer.execute("CREATE TABLE t (x)")
    writer.execute("BEGIN EXCLUSIVE")  # a writer in the middle of a commit
    writer.execute("INSERT INTO t VALUES (1)")
    check_storage(None, tmp_path)  # no error: busy is no damage
    writer.execute("COMMIT")
    writer.close()
    (tmp_path / "study.db").write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    with pytest.raises(ValueError, match="is damaged"):
        check_storage(None, tmp_path)


def test_a_study_refuses_a_setting_it_was_created_without(tmp_path):
    """A rerun that adds a setting the study has none of (an image folder to score on, here)
    changes what its trials' values mean as much as one that changes a setting: it is
    refused, naming the setting as one the study was created without."""
    open_study("toy", study_dir=tmp_path, settings={"steps": 150})
    with pytest.raises(StudySettingsError) as err:
        open_study("toy", study_dir=tmp_path, settings={"steps": 150, "eval_dir": "/data/eval"})
    assert (err.value.stored, err.value.wanted) == ({"eval_dir": None},
                                                     {"eval_dir": "/data/eval"})


def test_settings_are_forgotten_with_the_metric_only_where_no_trial_ran(tmp_path):
    """A study in which no trial ran forgets its settings and its metric, so the rerun the
    error advises starts it with its own (another budget, another task's score); one with a
    trial running (in this process or another) keeps them: that trial's result is the
    study's under them."""
    from scamp_jax.hpo.study.storage import forget_settings_if_unused

    handle = open_study("toy", study_dir=tmp_path, settings={"steps": 10}, metric="mse")
    assert forget_settings_if_unused(handle.study)
    again = open_study("toy", study_dir=tmp_path, settings={"steps": 20}, metric="accuracy")
    src = OptunaTrialSource(again, SPACE, 2)
    assert isinstance(src.ask(), AskedTrial)  # running, nothing finished yet
    assert not forget_settings_if_unused(again.study)
    with pytest.raises(StudySettingsError, match="steps=20"):
        open_study("toy", study_dir=tmp_path, settings={"steps": 30}, metric="accuracy")
    src.close()


def test_an_ask_waits_while_another_process_holds_the_ask_lock(tmp_path):
    """Counting the study's trials and asking the next is one step across processes: while
    the study's ask lock is held elsewhere (here through a lock of its own, as another
    process on the study takes it), an ask waits, and goes on once it is let go; else two
    processes could both take the study's last slot."""
    from scamp_jax.hpo.study import AskLock

    src = source(tmp_path, 1)
    asked: list[Any] = []
    with AskLock(storage_url(tmp_path), "toy")():
        thread = threading.Thread(target=lambda: asked.append(src.ask()))
        thread.start()
        thread.join(timeout=1.5)
        assert thread.is_alive() and not asked  # waiting for the lock
    thread.join(timeout=60)
    assert len(asked) == 1 and isinstance(asked[0], AskedTrial)
    src.close()


def test_a_rerun_with_a_lower_total_runs_only_the_retries_it_has_room_for(tmp_path):
    """Three trials stopped by an earlier run, a rerun with a total of 1: one retry runs, the
    other two stay queued in the study (for a run with a larger total), not run past it."""
    earlier = source(tmp_path, 3)
    stopped = [earlier.ask() for _ in range(3)]
    for t in stopped:
        earlier.interrupt(t.number)
    earlier.close()
    again = source(tmp_path, 1)
    retry = again.ask()
    assert retry.retry_of == stopped[0].number
    assert again.ask() is None  # at the total: this source's own trial runs, nothing more
    again.tell(TrialOutcome(retry.number, "complete", value=1.0))
    assert again.ask() is None and again.finished() == 1
    waiting = again.study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 2 and again.requeued() == [t.number for t in stopped[1:]]
    again.close()


def test_a_retry_that_finishes_no_longer_reads_interrupted(tmp_path):
    """A retry takes its stopped attempt's attributes, its fail reason "interrupted" too; once
    it completes (or is pruned without a reason) its row has no reason: results.csv says
    why a trial failed, and this one did not."""
    from scamp_jax.hpo.report import trial_records

    src = source(tmp_path, 2)
    first, second = src.ask(), src.ask()
    src.interrupt(first.number)
    src.interrupt(second.number)
    retries = [src.ask(), src.ask()]
    assert all(src.study.get_trials()[t.number].user_attrs[FAIL_REASON] == INTERRUPTED
               for t in retries)  # carried over from the attempts
    src.tell(TrialOutcome(retries[0].number, "complete", value=1.0))
    src.tell(TrialOutcome(retries[1].number, "pruned"))
    rows = trial_records(src.study)
    assert [(r["number"], r["state"], r["reason"]) for r in rows] == [
        (retries[0].number, "complete", ""), (retries[1].number, "pruned", "")]
    src.close()


def test_a_trial_another_process_failed_as_stale_is_told_to_stop(tmp_path):
    """A process whose heartbeat lapsed (paused past the grace period) finds its trial failed
    as stale by another process, which queued its retry: its next report says stop, so it
    does not train on for a result the study no longer takes, and its tell is counted lost."""
    first = source(tmp_path, 2, heartbeat=1)
    mine = first.ask()
    first.close()  # its heartbeat stops: the process is paused, not dead
    time.sleep(5)  # past the 3 s grace period
    second = source(tmp_path, 2, heartbeat=1)
    assert second.recovered == [mine.number]
    assert first.report(mine.number, 5, 1.0) is True
    first.tell(TrialOutcome(mine.number, "complete", value=1.0))
    assert first.lost == [mine.number]
    assert first.study.get_trials()[mine.number].state == TrialState.FAIL
    second.close()


def test_a_grid_whose_every_point_was_asked_still_reruns_an_interrupted_one(tmp_path):
    """All four points asked, one of them interrupted: the grid is not done while that
    point's retry waits; a rerun runs it and then ends, with four finished trials."""
    src = grid_source(tmp_path, 4)
    asked = [src.ask() for _ in range(4)]
    src.interrupt(asked[0].number)
    for t in asked[1:]:
        src.tell(TrialOutcome(t.number, "complete", value=1.0))
    src.close()
    again = grid_source(tmp_path, 4)
    assert not again.grid_done()
    retry = again.ask()
    assert isinstance(retry, AskedTrial) and retry.retry_of == asked[0].number
    assert point(retry) == point(asked[0])
    again.tell(TrialOutcome(retry.number, "complete", value=1.0))
    assert again.ask() is None and again.finished() == 4
    again.close()


def test_a_proposals_held_siblings_count_once_in_its_own_process(tmp_path):
    """The siblings a process holds for its running proposal take their slots once: the
    proposal's ``HELD_SIBLINGS`` attribute, which other processes count, is not counted again
    by its own, which would leave slots of the study untaken."""
    handle = open_study("toy", study_dir=tmp_path, sampler="random", seed=0)
    src = OptunaTrialSource(handle, SPACE, 4, poll_seconds=0.2, siblings=2,
                            training_keys=("learning_rate",))
    proposal = src.ask()
    assert proposal.siblings == 2 and src.remaining() == 1  # 4 - the proposal - 2 held
    siblings = [src.ask(), src.ask()]
    assert {s.sibling_of for s in siblings} == {proposal.number} and src.remaining() == 1
    last = src.ask()
    assert isinstance(last, AskedTrial) and last.sibling_of is None
    src.close()


def test_a_trials_seconds_are_stored_while_another_trial_is_being_asked(tmp_path):
    """A checkpoint stores its trial's seconds from the trial's thread: it does not wait for
    an ask of another trial that is under way (here one whose suggest takes its time)."""
    entered, gate = threading.Event(), threading.Event()

    def slow_suggest(trial: Any) -> dict[str, Any]:
        if trial.number == 1:
            entered.set()
            gate.wait(10)
        return suggest(trial)

    space = SearchSpace("toy", slow_suggest, build=lambda c, r: None, grid=SPACE.grid)
    study = open_study("toy", study_dir=tmp_path, sampler="tpe", seed=0, grid=SPACE.grid,
                       heartbeat_interval=10, grace_period=30)
    src = OptunaTrialSource(study, space, 3, poll_seconds=0.2)
    first = src.ask()
    asking = threading.Thread(target=src.ask)
    asking.start()
    assert entered.wait(30)
    began = time.monotonic()
    src.progress(first.number, 12.5)
    took = time.monotonic() - began
    gate.set()
    asking.join(30)
    assert took < 5, f"the write waited {took:.1f} s for the other trial's ask"
    assert src.study.get_trials()[first.number].user_attrs["wall_seconds"] == 12.5
    src.close()


def test_checking_a_study_folder_leaves_nothing_beside_its_databases(tmp_path):
    """The check of a study's SQLite files before a run (`check_study_place`) reads them and
    leaves no ``-wal``/``-shm`` files beside them: a run it refuses leaves the folder as it
    was."""
    import sqlite3

    from scamp_jax.hpo.session import check_study_place
    from scamp_jax.planning.plan_cache import PlanCache

    PlanCache(tmp_path / "plans.sqlite").put_plan("k", {"x": 1})  # a file in WAL mode
    with sqlite3.connect(tmp_path / "study.db") as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE t (x)")
    db.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans.sqlite", "study.db"]
    check_study_place(tmp_path, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans.sqlite", "study.db"]


def test_a_grid_value_that_is_none_of_the_choices_is_blamed_on_its_own_parameter():
    """Each grid value is tried with the others at their first values: where one of those
    first values is itself none of its choices, that parameter is named, not the one being
    tried."""
    from scamp_jax.hpo.study.source import check_grid

    def suggest(trial):
        return {"layers": trial.suggest_categorical("layers", [1, 2]),
                "heads": trial.suggest_categorical("heads", [3, 5])}

    space = SearchSpace("two", suggest, lambda config, rngs: None,
                        grid={"layers": [1, 2], "heads": [1, 3]})
    with pytest.raises(ValueError, match=r"the search space's grid gives heads=1, which is none "
                       r"of the choices suggest draws heads from \('1' not in \(3, 5\)\.\)"):
        check_grid(space, "grid", 0)
    fine = SearchSpace("two", suggest, lambda config, rngs: None,
                       grid={"layers": [1, 2], "heads": [3, 5]})
    check_grid(fine, "grid", 0)


def test_a_grid_parameter_suggest_never_draws_is_refused(caplog):
    """A grid key that ``suggest`` draws at none of the grid's points (a misspelling, a
    parameter it does not search) would have Optuna's grid sampler train every configuration
    once per value of it: refused, naming it. A key drawn on one branch only is kept, and a
    grid too large to try point by point gets a warning instead."""
    from scamp_jax.hpo.study import source
    from scamp_jax.hpo.study.source import check_grid

    def suggest(trial):
        config = {"layers": trial.suggest_categorical("layers", [1, 2])}
        if config["layers"] == 2:  # drawn on one branch only
            config["width"] = trial.suggest_categorical("width", [8, 16])
        return config

    build = lambda config, rngs: None  # noqa: E731
    extra = SearchSpace("branch", suggest, build,
                        grid={"layers": [1, 2], "width": [8, 16], "dropout": [0.0, 0.5]})
    with pytest.raises(ValueError, match=r"grid names 'dropout', which suggest draws at none "
                       r"of its 8 points \(it draws \['layers', 'width'\]\).*check the spelling"):
        check_grid(extra, "grid", 0)
    check_grid(SearchSpace("branch", suggest, build,
                           grid={"layers": [1, 2], "width": [8, 16]}), "grid", 0)
    # one value of it repeats nothing: kept
    check_grid(SearchSpace("branch", suggest, build,
                           grid={"layers": [1, 2], "width": [8, 16], "dropout": [0.0]}),
               "grid", 0)
    with caplog.at_level("WARNING"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(source, "_GRID_POINTS_TRIED", 4)
        check_grid(extra, "grid", 0)
    assert "grid names 'dropout', which suggest drew at none of the 6 points tried" in caplog.text


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_stop_before_the_sampler_drew_every_trial_changes_none_of_its_draws(tmp_path,
                                                                               sampler):
    """Trial 0 stopped (its retry takes trial number 1) and the study resumed: the trials
    after the retry draw what an unstopped study of the same seed drew (a retry draws nothing,
    so it takes no place in the seeds); before, the unstopped study's second configuration
    was never drawn. Within TPE's startup trials the draws depend on the seed alone."""
    def drawn(asked):
        return [tuple(sorted(t.params.items())) for t in asked]

    whole = source(tmp_path / "whole", 3, sampler=sampler, seed=5)
    unstopped = [whole.ask() for _ in range(3)]
    stopped = source(tmp_path / "stopped", 3, sampler=sampler, seed=5)
    first = stopped.ask()
    stopped.interrupt(first.number)
    resumed = source(tmp_path / "stopped", 3, sampler=sampler, seed=5)
    retry, *fresh = [resumed.ask() for _ in range(3)]
    assert retry.retry_of == first.number and retry.number == 1
    assert [t.number for t in fresh] == [2, 3]
    assert drawn([first, *fresh]) == drawn(unstopped)


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_retry_of_a_trial_whose_suggest_raised_draws_what_it_would_have(tmp_path, sampler):
    """A ``suggest`` with a bug raises before it draws: the trial fails and its retry (trial 1)
    is queued with nothing drawn. After the fix, the retry draws at its original's place, what
    an unstopped study of the same seed drew first, and the next trials the rest: before, the
    retry and trial 2 took one place and trained one configuration twice, and the first was
    never drawn."""
    def drawn(asked):
        return [tuple(sorted(t.params.items())) for t in asked]

    def buggy(trial: Any) -> dict[str, Any]:
        raise KeyError("lr_schedule")

    whole = source(tmp_path / "whole", 3, sampler=sampler, seed=5)
    unstopped = [whole.ask() for _ in range(3)]
    study = open_study("toy", study_dir=tmp_path / "bug", sampler=sampler, seed=5)
    with pytest.raises(KeyError):
        OptunaTrialSource(study, SearchSpace("toy", buggy, build=lambda c, r: None), 3).ask()
    fixed = source(tmp_path / "bug", 3, sampler=sampler, seed=5)
    retry, *fresh = [fixed.ask() for _ in range(3)]
    assert retry.retry_of == 0 and [t.number for t in fresh] == [2, 3]
    assert drawn([retry, *fresh]) == drawn(unstopped)


def test_a_configuration_is_stored_only_where_a_value_differs_from_the_draw():
    """A drawn NumPy or float number returned as the equal int is the draw (nothing stored
    beside it); a scaled draw, a flag for a number, or an added key is the configuration."""
    import numpy as np

    from scamp_jax.hpo.study.source import _stored_configuration

    assert _stored_configuration({"w": 4, "lr": 0.1}, {"w": np.int64(4), "lr": 0.1}) is None
    assert _stored_configuration({"w": 4}, {"w": 4.0}) is None
    assert _stored_configuration({"w": 32}, {"w": 4}) == {"w": 32}
    assert _stored_configuration({"w": True}, {"w": 1}) == {"w": True}
    assert _stored_configuration({"w": 4, "depth": 2}, {"w": 4}) == {"w": 4, "depth": 2}
