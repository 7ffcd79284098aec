"""The study's record: results.json / results.csv, its best trial and its runs, as the study
holds them (real Optuna studies in SQLite storage)."""

from __future__ import annotations

import json
import threading
from typing import Any

from scamp_jax.hpo import report
from scamp_jax.hpo.study import OptunaTrialSource, TrialOutcome, open_study
from scamp_jax.space import SearchSpace


def suggest(trial: Any) -> dict[str, Any]:
    return {"width": trial.suggest_categorical("width", [8, 16, 32]),
            "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)}


SPACE = SearchSpace("toy", suggest, build=lambda c, r: None)


def _source(study_dir, n_trials: int, **kw: Any) -> OptunaTrialSource:
    handle = open_study("toy", study_dir=study_dir, direction="minimize", sampler="random")
    return OptunaTrialSource(handle, SPACE, n_trials, poll_seconds=0.2, **kw)


def test_a_pruned_trial_with_a_better_score_is_not_the_best(tmp_path):
    """A trial pruned part-way keeps the score of its last evaluation, which may beat every
    complete trial's; the best (results.json's ``best``, the verdict, ``best_model``) is a
    complete trial's: a pruned one never trained its steps."""
    src = _source(tmp_path, 2)
    pruned, complete = src.ask(), src.ask()
    src.tell(TrialOutcome(pruned.number, "pruned", reason="pruned at step 10",
                          attrs={"metrics": {"mse": 0.01}}))
    src.tell(TrialOutcome(complete.number, "complete", value=0.5,
                          attrs={"metrics": {"mse": 0.5}}))
    rows = report.trial_records(src.study, ["mse"])
    assert report.best_record(rows, "mse", "minimize")["number"] == complete.number
    report.write_results(tmp_path, rows, metric="mse", direction="minimize")
    assert json.loads((tmp_path / "results.json").read_text())["best"] == complete.number
    assert report.verdict(rows, "mse", "minimize", None).startswith(
        f"best trial {complete.number}: mse 0.5")
    src.close()


def test_a_record_of_one_run_from_before_runs_were_kept_grows(tmp_path):
    """A results.json written before the record kept every run (one ``run``, no ``runs``)
    is an earlier run of the study: the next run is appended after it, not in its place."""
    row = {"number": 0, "params": {}, "state": "complete", "mse": 1.0}
    (tmp_path / "results.json").write_text(json.dumps(
        {"metric": "mse", "direction": "minimize", "best": 0, "trials": [row],
         "run": {"elapsed_s": 3.0}}))
    assert [r["elapsed_s"] for r in report.read_runs(tmp_path)] == [3.0]
    report.write_results(tmp_path, [row], metric="mse", direction="minimize",
                         run={"elapsed_s": 5.0})
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["elapsed_s"] for r in payload["runs"]] == [3.0, 5.0]
    assert not list(tmp_path.glob("results.damaged-*.json"))


def test_a_runs_overhead_goes_to_that_run_though_another_run_was_recorded_since(tmp_path):
    """Two processes on one study: run ``a`` is recorded, then run ``b``; ``a``'s report time,
    measured after its record was written, goes to ``a`` (by its id), not to the last run."""
    row = {"number": 0, "params": {}, "state": "complete", "mse": 1.0}
    for run_id in ("a", "b"):
        report.write_results(tmp_path, [row], metric="mse", direction="minimize",
                             run={"run_id": run_id, "elapsed_s": 1.0})
    report.add_run_overhead(tmp_path, "a", {"report_s": 0.5})
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [(r["run_id"], r.get("overhead")) for r in payload["runs"]] == [
        ("a", {"report_s": 0.5}), ("b", None)]
    assert payload["run"]["run_id"] == "b"


def test_runs_recorded_at_once_are_all_kept(tmp_path):
    """Processes sharing a study record their runs at once (here threads, which take the
    record's lock as processes do): each appends its run to the record in turn, and none is
    lost to another's write of what it read before."""
    row = {"number": 0, "params": {}, "state": "complete", "mse": 1.0}
    writers, per_writer = 6, 8
    start = threading.Barrier(writers)
    errors: list[BaseException] = []

    def record(writer: int) -> None:
        try:
            start.wait()
            for i in range(per_writer):
                report.write_results(tmp_path, [row], metric="mse", direction="minimize",
                                     run={"run_id": f"{writer}-{i}", "elapsed_s": 1.0})
        except BaseException as err:  # noqa: BLE001 - said below
            errors.append(err)

    threads = [threading.Thread(target=record, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    ids = [r["run_id"] for r in report.read_runs(tmp_path)]
    assert sorted(ids) == sorted(f"{w}-{i}" for w in range(writers) for i in range(per_writer))


def test_a_best_trial_level_with_its_baseline_does_not_beat_it():
    """The verdict says the best trial beats its baseline only where it is better: a score
    equal to the baseline's (a model that learned nothing over bicubic) does not beat it, in
    either direction."""
    row = {"number": 1, "state": "complete", "psnr": 31.5, "bicubic_psnr": 31.5}
    assert report.verdict([row], "psnr", "maximize", "bicubic_psnr").endswith(
        "(+0, does not beat the baseline)")
    row = {"number": 1, "state": "complete", "mse": 0.25, "zero_mse": 0.25}
    assert report.verdict([row], "mse", "minimize", "zero_mse").endswith(
        "(+0, does not beat the baseline)")


def test_a_test_of_a_model_that_best_model_no_longer_holds_is_not_written(tmp_path):
    """Another process may save a better trial's model in ``best_model/`` while this one tests
    its own: the test of trial 0 is then not written, neither beside trial 1's model nor in
    ``results.json`` (whose best is trial 1), and its test of trial 1 stays as it was."""
    (tmp_path / "best_model").mkdir()
    saved = {"number": 1, "params": {"width": 8}, "mse": 0.25, "test": {"mse": 0.3}}
    (tmp_path / "best_model" / "trial.json").write_text(json.dumps(saved))
    results = {"metric": "mse", "direction": "minimize", "best": 1, "trials": [],
               "test": {"trial": 1, "mse": 0.3}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert not report.record_test(tmp_path, 0, {"mse": 0.5})
    assert not report.record_test(tmp_path, 0, None)
    assert json.loads((tmp_path / "best_model" / "trial.json").read_text()) == saved
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert report.saved_test(tmp_path) == {"trial": 1, "mse": 0.3}
    assert report.record_test(tmp_path, 1, {"mse": 0.35})  # its own trial's: written
    assert json.loads((tmp_path / "results.json").read_text())["test"] == {"trial": 1, "mse": 0.35}


def test_a_study_where_no_trial_completed_says_the_first_reason():
    """Every trial failed: the last line says why the first of them did (one line, cut at a
    word where long) and how many other reasons there were, not only where to look."""
    long = "KeyError: " + "word " * 100
    rows = [{"number": 0, "state": "failed", "reason": "ValueError: bad width\n (at a.py:3)"},
            {"number": 1, "state": "failed", "reason": "ValueError: bad width\n (at a.py:3)"},
            {"number": 2, "state": "failed", "reason": long},
            {"number": 3, "state": "pruned", "reason": "pruned at step 10"}]
    assert report.verdict(rows, "mse", "minimize", None) == (
        "no trial completed (3 failed; trial 0: ValueError: bad width (at a.py:3); 1 other "
        "reason(s)); see the 'reason' column of results.csv (and the traceback of a trial "
        "that raised in results.json)")
    line = report.verdict(rows[2:], "mse", "minimize", None)
    assert "trial 2: KeyError: word word" in line and "word ...);" in line
    assert len(line) < len(long)
    assert report.verdict(rows[3:], "mse", "minimize", None).startswith(
        "no trial completed (0 failed); see")


def test_a_study_where_some_trials_failed_says_so_under_its_best():
    """Some trials completed and others failed (members of a fused group whose loss turned
    non-finite, say): the verdict says how many failed and why the first did, under the best
    trial's line, not only in results.csv (the table lists complete trials only)."""
    rows = [{"number": 0, "state": "failed", "reason": "loss is not finite at step 3"},
            {"number": 1, "state": "complete", "mse": 0.5},
            {"number": 2, "state": "failed", "reason": "loss is not finite at step 3"},
            {"number": 3, "state": "pruned", "reason": "pruned at step 10"}]
    assert report.verdict(rows, "mse", "minimize", None) == (
        "best trial 1: mse 0.5\n  2 of 4 trials failed; trial 0: loss is not finite at step 3; "
        "see the 'reason' column of results.csv (and the traceback of a trial that raised in "
        "results.json)")
    assert report.verdict(rows[1:2], "mse", "minimize", None) == "best trial 1: mse 0.5"


def test_plots_of_a_resumed_run_that_trained_past_every_bar_lay_out_without_a_warning(tmp_path):
    """A rerun that trained only on other ranks (a trial spanning MPI ranks) starts past every
    bar of this rank's timeline: its ``run 2`` label fits in the axes, and the figure lays out
    (matplotlib's "Tight layout not applied" is a warning, an error in this suite). The
    figures of such a study: one device of two used, 77 s in all, the second run at 60 s."""
    records = [{"number": 1, "state": "complete", "psnr": 30.1, "bicubic_psnr": 29.0,
                "params": {}}]
    paths = report.plot_results(
        tmp_path, records, metric="psnr", baseline="bicubic_psnr",
        intervals=[[(1, 7.99, 25.85, 43_965_456)], []], memory_series=([0.0, 7.99], [0.0, 0.87]),
        elapsed_s=77.25, capacity_bytes=48 * 2**20, run_marks=[0.0, 60.45])
    assert [p.name for p in paths] == ["psnr_per_trial.png", "device_timeline.png",
                                       "memory_utilization.png"]


def test_the_memory_plot_shows_a_small_booking_and_a_groups_bar_its_width():
    """A smoke study books 0.5% of the pool: its memory plot's axis reaches a little above that
    (a whole pool's axis drew a flat line); one that books much of the pool keeps the whole
    pool. A fused group's bar in the device timeline is named with its width (``4 x2``), so
    its other members are seen to run."""
    assert report._memory_axis_top(([0.0, 1.0], [0.005, 0.0])) == 5.0
    assert abs(report._memory_axis_top(([0.0, 1.0], [0.3, 0.1])) - 39.0) < 1e-9
    assert report._memory_axis_top(([0.0], [0.9])) == 105.0
    assert report._memory_axis_top(None) == 5.0
    records = [{"number": 4, "fused_group": 4, "fusion_width": 2},
               {"number": 5, "fused_group": 4, "fusion_width": 2}, {"number": 6}]
    assert report._group_widths(records) == {4: " x2"}
