"""The study: RDB storage, seeded samplers, pruners, totals across runs, interrupted trials."""

from __future__ import annotations

from typing import Any

import pytest
from optuna.trial import TrialState

from scamp_jax.space import SearchSpace
from scamp_jax.study import (
    CHECKPOINT_KEY,
    FAIL_REASON,
    INTERRUPTED,
    OptunaTrialSource,
    TrialOutcome,
    make_pruner,
    make_sampler,
    open_study,
    storage_url,
)


def suggest(trial: Any) -> dict[str, Any]:
    return {"width": trial.suggest_categorical("width", [8, 16, 32]),
            "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)}


SPACE = SearchSpace("toy", suggest, build=lambda c, r: None,
                    grid={"width": [8, 16, 32], "learning_rate": [1e-3, 1e-2]})


def source(tmp_path, n_trials: int, sampler: str = "tpe", seed: int = 0):
    study = open_study("toy", study_dir=tmp_path, sampler=sampler, seed=seed, grid=SPACE.grid)
    return OptunaTrialSource(study, SPACE, n_trials)


def test_default_storage_is_sqlite_in_the_study_dir(tmp_path):
    assert storage_url(tmp_path) == f"sqlite:///{tmp_path.resolve() / 'study.db'}"
    assert storage_url(tmp_path, "postgresql://db/x") == "postgresql://db/x"
    source(tmp_path, 1)
    assert (tmp_path / "study.db").is_file()


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid"])
def test_samplers_are_reproducible_with_a_seed(tmp_path, sampler):
    runs = []
    for i in range(2):
        src = source(tmp_path / str(i), 4, sampler=sampler, seed=3)
        asked = [src.ask() for _ in range(4)]
        runs.append([dict(a.params) for a in asked])
    assert runs[0] == runs[1]
    assert len({tuple(sorted(p.items())) for p in runs[0]}) > 1


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


def test_trials_left_running_by_a_killed_process_are_recovered(tmp_path):
    src = source(tmp_path, 3)
    done = src.ask()
    src.tell(TrialOutcome(done.number, "complete", value=2.0))
    lost = src.ask()  # the process dies here: the trial stays RUNNING in the database
    again = source(tmp_path, 3)
    assert again.recovered == [lost.number]
    old = again.study.get_trials()[lost.number]
    assert old.state == TrialState.FAIL and old.user_attrs[FAIL_REASON] == INTERRUPTED
    assert again.remaining() == 2
    rerun = again.ask()
    assert dict(rerun.params) == dict(lost.params)
    assert rerun.checkpoint_key == lost.checkpoint_key
    assert again.study.get_trials()[rerun.number].user_attrs[CHECKPOINT_KEY] == lost.checkpoint_key


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
    with pytest.raises(ValueError, match="created to maximize"):
        open_study("toy", study_dir=tmp_path, direction="minimize")


def test_outcome_validation():
    with pytest.raises(ValueError, match="state='done' is not a trial outcome"):
        TrialOutcome(0, "done")
    with pytest.raises(ValueError, match="complete but has no value"):
        TrialOutcome(0, "complete")
