"""The library's study entry: `run_study`, `SearchSettings` and `FunctionTask`.

A real study (the MLP of ``test_runner`` on a task built from plain functions) in SQLite storage.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optuna
import pytest
from flax import nnx
from optuna.trial import TrialState
from test_runner import SPACE, Regression

import scamp_jax
from scamp_jax.hpo.checkpoint import CheckpointUnreadable
from scamp_jax.hpo.settings import SearchSettings
from scamp_jax.hpo.study import storage_url


def function_task() -> scamp_jax.FunctionTask:
    """The regression task of ``test_runner`` rebuilt from its plain functions (no subclass)."""
    reference = Regression()
    return scamp_jax.FunctionTask(metric="mse", direction="minimize",
                                  loss_fn=reference.loss_fn, batches=reference.batches,
                                  evaluate=reference.evaluate)


def test_function_task_reads_the_planning_shapes_off_its_data():
    task = function_task()
    x, y = task.sample_batch(48)
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((48, 8), jnp.float32, (48, 1), jnp.float32)
    assert isinstance(x, jax.ShapeDtypeStruct)
    assert task.sample_batch(3)[0].shape == (3, 8)


def test_function_task_checks_its_functions():
    def unbatched(batch_size, seed):
        while True:
            yield np.zeros((8,), np.float32), np.zeros((batch_size, 1), np.float32)

    reference = Regression()
    kw = dict(metric="mse", loss_fn=reference.loss_fn, evaluate=reference.evaluate)
    with pytest.raises(ValueError, match="direction='lower' must be 'maximize' or 'minimize'"):
        scamp_jax.FunctionTask(direction="lower", batches=reference.batches, **kw)
    with pytest.raises(TypeError, match="batches=.* is not callable"):
        scamp_jax.FunctionTask(direction="minimize", batches=[1, 2], **kw)
    task = scamp_jax.FunctionTask(direction="minimize", batches=unbatched, **kw)
    with pytest.raises(ValueError, match=r"shape \(8,\).*leading axis"):
        task.sample_batch(4)


@pytest.mark.parametrize(("kw", "message"), [
    ({"trials": 0}, "trials=0 must be an integer >= 1"),
    ({"eval_every": -1}, "eval_every=-1 must be an integer >= 0; pass e.g. eval_every=0"),
    ({"seed": "1"}, "seed='1' must be an integer >= 0"),
    ({"sampler": "cmaes"}, "sampler='cmaes' is not one of 'tpe', 'random', 'grid'"),
    ({"policy": "greedy"}, "policy='greedy' is not one of 'scamp', 'fixed'"),
    ({"elastic": "yes"}, "elastic='yes' is not one of 'auto', 'on', 'off'"),
    ({"min_batch_size": 64, "max_batch_size": 16}, "raise max_batch_size to at least 64"),
    ({"fuse": 4, "sampler": "grid"}, "sampler='grid' takes every parameter from its grid"),
    ({"fuse": "auto", "sampler": "grid"}, "sampler=random with fuse, or fuse=1 .no fused"),
    ({"device_overlap": 1.5}, r"device_overlap=1.5 must be in \[0, 1\]"),
    ({"checkpoint_min_seconds": -1}, "checkpoint_min_seconds=-1 must be a number of seconds"),
    ({"checkpoint_min_seconds": float("inf")}, "checkpoint_min_seconds=inf must be a number"),
    ({"checkpoint_min_seconds": True}, "checkpoint_min_seconds=True must be a number"),
])
def test_settings_name_the_bad_value_and_the_fix(kw, message):
    with pytest.raises(ValueError, match=message):
        SearchSettings(**{"trials": 2, "steps": 10, **kw})


def test_experiment_configs_are_search_settings():
    from experiments import swinir_hpo, vit_synthetic

    for module in (swinir_hpo, vit_synthetic):
        config = module.get_config("smoke")
        assert isinstance(config, SearchSettings)
        assert config.engine_config(2**30).steps == config.steps


def test_the_device_overlap_setting_reaches_the_engine():
    assert SearchSettings(trials=1, steps=1).engine_config(2**20).device_overlap is None
    settings = SearchSettings(trials=1, steps=1, device_overlap=0.25)
    assert settings.engine_config(2**20).device_overlap == 0.25


def test_run_study_runs_then_resumes_only_the_missing_trials(tmp_path):
    kw = dict(steps=10, study_dir=tmp_path, devices=2, memory_per_device="64MiB",
              max_batch_size=16, sampler="random", live=False)
    first = scamp_jax.run_study(SPACE, function_task(), trials=2, **kw)
    assert first["trials_this_run"] == 2
    assert first["devices"] == 2 and first["memory_per_device"] == 64 * 2**20
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["best"] == first["best"]["number"]
    assert math.isfinite(first["best"]["mse"])
    # Same study directory, one more trial: the two finished ones are kept, one new one runs.
    second = scamp_jax.run_study(SPACE, function_task(), trials=3, **kw)
    assert second["trials_this_run"] == 1
    [summary] = optuna.get_all_study_summaries(storage_url(tmp_path))
    study = optuna.load_study(study_name=summary.study_name, storage=storage_url(tmp_path))
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    for trial in trials:
        assert len(trial.user_attrs["devices"]) == 1
        assert trial.user_attrs["batch_size"] == 16
        assert 0 < trial.user_attrs["predicted_peak_bytes"] <= 64 * 2**20
    # The finished study's best model, as the README loads it, scores what the study recorded.
    best = json.loads((tmp_path / "best_model" / "trial.json").read_text())
    model = scamp_jax.load_model(tmp_path / "best_model", SPACE, best["params"])
    assert best["number"] == second["best"]["number"]
    assert function_task().evaluate(model)["mse"] == pytest.approx(best["mse"], rel=1e-6)
    # another trial's params build another model: said so, with where the right ones are
    other = {**best["params"], "width": 48 if best["params"]["width"] != 48 else 16}
    with pytest.raises(ValueError, match=r"does not hold the model that space 'mlp' builds "
                       r"from params=.*best_model/trial.json holds them"):
        scamp_jax.load_model(tmp_path / "best_model", SPACE, other)
    # the whole trial.json, or nothing, for its params: said, with what to pass
    with pytest.raises(ValueError, match=r"params is a whole trial record \(it holds 'number' "
                       r"and 'params'\); pass its 'params'"):
        scamp_jax.load_model(tmp_path / "best_model", SPACE, best)
    with pytest.raises(TypeError, match=r"params=None is not a trial's configuration; pass the "
                       r"dict best_model/trial.json holds under 'params'"):
        scamp_jax.load_model(tmp_path / "best_model", SPACE, None)  # type: ignore[arg-type]
    # the best trial's checkpoint damaged since: a rerun keeps the model best_model/ holds
    _cut_short(tmp_path / best["checkpoint"])
    scamp_jax.run_study(SPACE, function_task(), trials=3, **kw)
    model = scamp_jax.load_model(tmp_path / "best_model", SPACE, best["params"])
    assert function_task().evaluate(model)["mse"] == pytest.approx(best["mse"], rel=1e-6)
    # best_model/ damaged itself: one message that names it, not TensorStore's reader's spec
    _cut_short(tmp_path / "best_model")
    with pytest.raises(CheckpointUnreadable, match=r"best_model cannot be read as the model "
                       r"that space 'mlp' builds \(is it damaged.*orbax: ValueError: "
                       r"OUT_OF_RANGE") as caught:
        scamp_jax.load_model(tmp_path / "best_model", SPACE, best["params"])
    assert "tensorstore_spec" not in str(caught.value), str(caught.value)


def _cut_short(step_dir: Path) -> None:
    """Damage the checkpoint in ``step_dir``: each of its data files cut to half its size."""
    data = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data, sorted(p.name for p in step_dir.rglob("*"))
    for path in data:
        os.truncate(path, path.stat().st_size // 2)


def test_a_study_with_no_batch_cap_says_how_its_batches_are_chosen(tmp_path, capsys):
    """Without ``max_batch_size`` a trial's batch is the largest its devices hold, up to
    65,536 samples, whatever the task's data: the study says so where it opens, and how to
    bound it; with a cap it says nothing of it."""
    kw = dict(trials=1, steps=1, devices=1, memory_per_device="64MiB", live=False)
    scamp_jax.run_study(SPACE, function_task(), study_dir=tmp_path / "a", **kw)
    assert ("batches: each trial takes the largest batch its devices hold, up to 65,536 "
            "samples (no max_batch_size), and trains its steps at it; pass max_batch_size to "
            "bound it (e.g. the training set's size), and reference_batch to train every "
            "trial on as many samples") in capsys.readouterr().out.splitlines()
    scamp_jax.run_study(SPACE, function_task(), study_dir=tmp_path / "b", max_batch_size=16,
                        **kw)
    assert "batches:" not in capsys.readouterr().out
    # the fixed policy trains one batch for every trial: not each one's largest
    scamp_jax.run_study(SPACE, function_task(), study_dir=tmp_path / "c", policy="fixed",
                        devices_per_trial=1, **kw)
    assert "batches:" not in capsys.readouterr().out


def test_a_study_whose_pruner_can_prune_nothing_says_so(tmp_path, caplog):
    """The pruner judges a trial on its evaluations before its last step: where there are
    none (``eval_every`` 0, or not below ``steps``) the study says so where it opens, with
    what to pass, in the library's words (the command lines word it in their flags)."""
    kw = dict(trials=1, steps=2, devices=1, memory_per_device="64MiB", max_batch_size=8,
              live=False)
    said = ("the median pruner prunes nothing in this study: no trial is evaluated before its "
            "last step; pass eval_every below steps=2")
    with caplog.at_level(logging.WARNING, logger="scamp_jax"):
        scamp_jax.run_study(SPACE, function_task(), study_dir=tmp_path / "a", **kw)
    assert said in caplog.messages
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scamp_jax"):
        scamp_jax.run_study(SPACE, function_task(), study_dir=tmp_path / "b", eval_every=1,
                            **kw)
        scamp_jax.run_study(SPACE, function_task(), study_dir=tmp_path / "c", pruner="none",
                            **kw)
    assert not any("pruner" in m for m in caplog.messages), caplog.messages


def test_a_run_that_changes_the_sampler_or_batch_bounds_says_so_and_each_run_records_its(
        tmp_path, capsys):
    """The sampler, pruner, policy and batch bounds may change from one run of a
    study to the next (its steps, seed and budget may not): each run's entry in
    ``results.json`` records what it had, and a run that changes one says so where it
    opens."""
    kw = dict(steps=1, devices=1, memory_per_device="64MiB", study_dir=tmp_path, live=False)
    scamp_jax.run_study(SPACE, function_task(), trials=1, sampler="random", max_batch_size=16,
                        **kw)
    assert "note: this run" not in capsys.readouterr().out
    scamp_jax.run_study(SPACE, function_task(), trials=2, sampler="tpe", max_batch_size=8,
                        **kw)
    assert ("note: this run has sampler='tpe', max_batch_size=8, the study's last run had "
            "sampler='random', max_batch_size=16; the trials run before keep theirs "
            "(results.json: each run's search)") in capsys.readouterr().out.splitlines()
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["search"] for r in runs] == [
        {"sampler": "random", "pruner": "median", "policy": "scamp",
         "min_batch_size": None, "max_batch_size": 16,
         "reference_batch": None},
        {"sampler": "tpe", "pruner": "median", "policy": "scamp",
         "min_batch_size": None, "max_batch_size": 8,
         "reference_batch": None}]
    # Not the fusion a study narrows to its trials: raising trials changes no setting given.
    assert SearchSettings(trials=1, steps=1, fuse=4).run_record() == \
        SearchSettings(trials=3, steps=1, fuse=4).run_record()
    # The policy too: another placement of the trials (and, fixed, one batch for them all).
    scamp_jax.run_study(SPACE, function_task(), trials=3, sampler="tpe", max_batch_size=8,
                        policy="fixed", devices_per_trial=1, **kw)
    assert ("note: this run has policy='fixed', the study's last run had policy='scamp'; the "
            "trials run before keep theirs (results.json: each run's search)"
            ) in capsys.readouterr().out.splitlines()


def test_a_task_whose_batches_yield_nothing_says_so():
    """A ``batches`` that yields no batch at all (an epoch loop over an empty data set) is
    said as the stream that ended, not as a bare ``StopIteration``."""
    reference = Regression()

    def batches(batch_size, seed):
        yield from ()

    task = scamp_jax.FunctionTask(metric="mse", direction="minimize",
                                  loss_fn=reference.loss_fn, batches=batches,
                                  evaluate=reference.evaluate)
    with pytest.raises(ValueError, match=r"batches\(1, 0\) yielded no batch.*while True"):
        task.sample_batch(4)


def test_the_results_keep_the_configuration_suggest_made_not_only_what_optuna_drew(tmp_path):
    """A ``suggest`` that adds constants (a learning rate it does not search, a depth): the
    results, the best model's record and the README's ``load_model`` take the whole
    configuration, which its ``build`` needs."""
    from test_runner import MLP

    def suggest(trial):
        return {"width": trial.suggest_categorical("width", [16, 32]), "depth": 1,
                "learning_rate": 1e-2, "note": {"kind": "constant"}}

    def build(config, rngs):
        assert config["depth"] == 1 and config["note"] == {"kind": "constant"}
        return MLP(int(config["width"]), rngs)

    space = scamp_jax.SearchSpace("mlp-constants", suggest, build)
    result = scamp_jax.run_study(space, function_task(), trials=2, steps=3, study_dir=tmp_path,
                                 devices=2, memory_per_device="64MiB", max_batch_size=16,
                                 sampler="random", live=False)
    trials = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert [list(t["params"]) for t in trials] == [["width", "depth", "learning_rate",
                                                     "note"]] * 2
    assert result["best"]["params"]["depth"] == 1
    assert "depth" in (tmp_path / "results.csv").read_text().splitlines()[1]
    best = json.loads((tmp_path / "best_model" / "trial.json").read_text())
    model = scamp_jax.load_model(tmp_path / "best_model", space, best["params"])
    assert function_task().evaluate(model)["mse"] == pytest.approx(best["mse"], rel=1e-6)


def test_the_results_show_a_drawn_value_as_suggest_changed_it(tmp_path):
    """A ``suggest`` that scales what it draws (``16 * suggest_int``) and sets a drawn learning
    rate over: the results, the best model's record and ``load_model`` take the values the
    trial trained with, not Optuna's draws."""
    from test_runner import MLP

    def suggest(trial):
        config = {"width": 16 * trial.suggest_int("width", 1, 2),
                  "learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)}
        config["learning_rate"] = 1e-2  # drawn, then fixed: it trains at 1e-2
        return config

    space = scamp_jax.SearchSpace("mlp-scaled", suggest,
                                  lambda config, rngs: MLP(int(config["width"]), rngs))
    scamp_jax.run_study(space, function_task(), trials=2, steps=3, study_dir=tmp_path,
                        devices=2, memory_per_device="64MiB", max_batch_size=16,
                        sampler="random", live=False)
    trials = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert {t["params"]["width"] for t in trials} <= {16, 32}
    assert [t["params"]["learning_rate"] for t in trials] == [1e-2, 1e-2]
    best = json.loads((tmp_path / "best_model" / "trial.json").read_text())
    model = scamp_jax.load_model(tmp_path / "best_model", space, best["params"])
    assert model.hidden.out_features == best["params"]["width"]
    assert function_task().evaluate(model)["mse"] == pytest.approx(best["mse"], rel=1e-6)


def test_a_key_that_reads_as_the_optimizers_but_is_not_is_warned_of(tmp_path, caplog):
    """``lr`` for ``learning_rate``: the trials' AdamW would train at its default while the
    table shows the drawn ``lr``, so the study says it, once, and how to name it."""
    from test_runner import MLP

    from scamp_jax.hpo.study import source

    def suggest(trial):
        return {"width": 16, "lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True)}

    space = scamp_jax.SearchSpace("mlp-lr", suggest,
                                  lambda config, rngs: MLP(int(config["width"]), rngs))
    source._ALIASES_SAID.discard("lr")
    with caplog.at_level("WARNING", logger="scamp_jax"):
        scamp_jax.run_study(space, function_task(), trials=2, steps=2, study_dir=tmp_path,
                            devices=2, memory_per_device="64MiB", max_batch_size=16,
                            sampler="random", live=False)
    said = [r.getMessage() for r in caplog.records if "reads as the optimizer's" in
            r.getMessage()]
    assert said == ["the configuration's 'lr' reads as the optimizer's 'learning_rate', which "
                    "it is not: the trials' AdamW takes learning_rate, weight_decay, b1, b2 and "
                    "trains at its default learning_rate; every other key goes to build, as "
                    "architecture. Return it as 'learning_rate'"], said


def test_a_configuration_with_values_json_cannot_hold_is_said_and_loads_again(
        tmp_path, caplog, monkeypatch):
    """``suggest`` derives a function and a NumPy number from what it draws: the study cannot
    store them (it stores JSON) and says so once; the README's ``load_model`` derives them
    again through ``suggest`` (it raised ``KeyError`` in ``build``)."""
    import logging

    import numpy as np
    from test_runner import MLP

    def suggest(trial):
        width = trial.suggest_categorical("width", [16, 32])
        return {"width": width, "learning_rate": 1e-2, "activation": np.tanh,
                "hidden": np.int64(width) * 2}

    def build(config, rngs):
        assert config["activation"] is np.tanh and config["hidden"] == 2 * config["width"]
        return MLP(int(config["width"]), rngs)

    from scamp_jax.hpo.study import source

    monkeypatch.setattr(source, "_UNSTORED", set())  # said once per process: not said yet
    space = scamp_jax.SearchSpace("mlp-derived", suggest, build)
    with caplog.at_level(logging.WARNING, logger="scamp_jax.hpo.study.source"):
        scamp_jax.run_study(space, function_task(), trials=2, steps=3, study_dir=tmp_path,
                            devices=2, memory_per_device="64MiB", max_batch_size=16,
                            sampler="random", live=False)
    said = [r.getMessage() for r in caplog.records if "is not stored" in r.getMessage()]
    assert len(said) == 1 and "'activation' (ufunc)" in said[0], said
    best = json.loads((tmp_path / "best_model" / "trial.json").read_text())
    assert "activation" not in best["params"]
    assert best["params"]["hidden"] == 2 * best["params"]["width"]  # NumPy's, as a number
    model = scamp_jax.load_model(tmp_path / "best_model", space, best["params"])
    assert function_task().evaluate(model)["mse"] == pytest.approx(best["mse"], rel=1e-6)


def test_a_model_is_made_again_from_optunas_draws_where_suggest_changed_them(tmp_path):
    """``suggest`` scales a draw and picks a function by it, which the study cannot store:
    results and ``trial.json`` keep the draws (``drawn``) beside the configuration, and
    ``load_model``, the study's own test of the best model included, makes the configuration
    again from them (from the scaled width it picked the other function)."""
    from test_runner import IN, OUT

    class Act(nnx.Module):
        def __init__(self, width, act, rngs):
            self.hidden = nnx.Linear(IN, width, rngs=rngs)
            self.out = nnx.Linear(width, OUT, rngs=rngs)
            self.act = act

        def __call__(self, x):
            return self.out(self.act(self.hidden(x)))

    def suggest(trial):
        m = trial.suggest_int("width", 1, 2)
        return {"width": 16 * m, "act": jnp.tanh if m == 1 else jnp.sin}

    space = scamp_jax.SearchSpace("mlp-act", suggest,
                                  lambda c, rngs: Act(int(c["width"]), c["act"], rngs),
                                  grid={"width": [1, 2]})
    reference = Regression()
    task = scamp_jax.FunctionTask(metric="mse", direction="minimize", loss_fn=reference.loss_fn,
                                  batches=reference.batches, evaluate=reference.evaluate,
                                  test=reference.evaluate)
    result = scamp_jax.run_study(space, task, trials=2, steps=3, study_dir=tmp_path, devices=2,
                                 memory_per_device="64MiB", max_batch_size=16, sampler="grid",
                                 live=False)
    rows = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert sorted((r["params"]["width"], r["drawn"]["width"]) for r in rows) == [(16, 1),
                                                                                (32, 2)]
    for row in rows:
        model = scamp_jax.load_model(tmp_path / row["checkpoint"], space, row["params"],
                                     drawn=row["drawn"])
        assert model.act is (jnp.tanh if row["drawn"]["width"] == 1 else jnp.sin)
        assert task.evaluate(model)["mse"] == pytest.approx(row["mse"], rel=1e-6)
    best = json.loads((tmp_path / "best_model" / "trial.json").read_text())
    model = scamp_jax.load_model(tmp_path / "best_model", space, best["params"])
    assert task.evaluate(model)["mse"] == pytest.approx(best["mse"], rel=1e-6)
    assert result["test"]["mse"] == pytest.approx(best["mse"], rel=1e-6)  # same data here


def test_a_rerun_scoring_another_metric_is_refused_and_keeps_the_study(tmp_path):
    reference = Regression()
    kw = dict(trials=1, steps=2, study_dir=tmp_path, devices=2, memory_per_device="64MiB",
              max_batch_size=16, sampler="random", live=False)
    scamp_jax.run_study(SPACE, function_task(), **kw)
    other = scamp_jax.FunctionTask(
        metric="mae", direction="minimize", loss_fn=reference.loss_fn,
        batches=reference.batches,
        evaluate=lambda model: {"mae": 1.0, **reference.evaluate(model)})
    with pytest.raises(ValueError, match="scores its trials by 'mse', not 'mae'"):
        scamp_jax.run_study(SPACE, other, **{**kw, "trials": 2})
    again = scamp_jax.run_study(SPACE, function_task(), **{**kw, "trials": 2})
    assert again["trials_this_run"] == 1


def test_results_with_scores_that_are_not_finite_are_strict_json(tmp_path):
    # A finite metric beside an auxiliary score that diverged wrote a bare NaN and Infinity,
    # which strict readers (jq, JSON.parse) refuse for the whole file.
    reference = Regression()
    task = scamp_jax.FunctionTask(
        metric="mse", direction="minimize", loss_fn=reference.loss_fn,
        batches=reference.batches,
        evaluate=lambda model: {**reference.evaluate(model), "r2": float("nan"),
                                "worst": float("inf")})
    scamp_jax.run_study(SPACE, task, trials=1, steps=2, study_dir=tmp_path, devices=2,
                        memory_per_device="64MiB", max_batch_size=16, sampler="random",
                        live=False)

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    [trial] = json.loads((tmp_path / "results.json").read_text(),
                         parse_constant=refuse)["trials"]
    assert trial["r2"] is None and trial["worst"] is None and math.isfinite(trial["mse"])
    json.loads((tmp_path / "best_model" / "trial.json").read_text(), parse_constant=refuse)


def test_a_configuration_suggest_prunes_is_said(tmp_path, capsys):
    # it counts as Optuna counts it, but nothing trains it: it had no line of its own
    def suggest(trial):
        width = trial.suggest_categorical("width", [16, 32])
        if width == 16:
            raise optuna.TrialPruned("width 16 is refused")
        return {"width": width, "learning_rate": 1e-2}

    space = scamp_jax.SearchSpace("mlp-refusing", suggest, SPACE.build,
                                  grid={"width": [16, 32], "learning_rate": [1e-2]})
    scamp_jax.run_study(space, function_task(), trials=2, steps=2, study_dir=tmp_path,
                        devices=2, memory_per_device="64MiB", max_batch_size=16,
                        sampler="grid", live=False)
    out = capsys.readouterr().out
    assert "pruned by the search space's suggest: width 16 is refused" in out, out


def test_a_batch_that_scales_a_trial_down_to_a_few_steps_is_said(tmp_path, caplog,
                                                                 monkeypatch):
    # reference_batch with the planner's default cap: a trial at batch 65,536 trained one
    # step, with nothing said
    import logging

    from scamp_jax.hpo import settings
    from scamp_jax.hpo.settings import EngineConfig

    monkeypatch.setattr(settings, "_SAID_FEW", set())  # said once per process: not said yet

    config = EngineConfig(steps=20, reference_batch=32)
    with caplog.at_level(logging.WARNING, logger="scamp_jax.hpo.settings"):
        assert config.steps_for(64) == 10 and not caplog.records
        assert config.steps_for(65536) == config.steps_for(65536) == 1
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith("a trial at batch 65536 trains 1 step(s), as steps=20 at a batch of "
                           "32 (the reference batch) scaled to its batch; pass max_batch_size")


def test_an_evaluate_that_returns_a_number_is_told_what_to_return(tmp_path):
    reference = Regression()
    task = scamp_jax.FunctionTask(metric="mse", direction="minimize",
                                  loss_fn=reference.loss_fn, batches=reference.batches,
                                  evaluate=lambda model: 0.5)
    scamp_jax.run_study(SPACE, task, trials=1, steps=2, study_dir=tmp_path, devices=2,
                        memory_per_device="64MiB", max_batch_size=16, sampler="random",
                        live=False)
    [trial] = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert trial["state"] == "failed"
    assert ("task.evaluate returned float 0.5; it must return a dict of scores that holds the "
            "study metric, e.g. {'mse': value}") in trial["reason"], trial["reason"]


def test_run_study_fuses_trials_of_one_architecture(tmp_path):
    result = scamp_jax.run_study(SPACE, function_task(), trials=2, steps=5, study_dir=tmp_path,
                                 devices=2, memory_per_device="64MiB", max_batch_size=16,
                                 sampler="random", fuse=2, live=False)
    assert result["trials_this_run"] == 2
    trials = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert [t["state"] for t in trials] == ["complete", "complete"]
    # The proposal and its sibling: one architecture, their own learning rates, one fused step.
    assert trials[0]["params"]["width"] == trials[1]["params"]["width"]
    assert trials[0]["params"]["learning_rate"] != trials[1]["params"]["learning_rate"]
    assert trials[0]["fused_group"] is not None
    assert trials[0]["fused_group"] == trials[1]["fused_group"]
    assert [t["fusion_width"] for t in trials] == [2, 2]
    # every member's timeline has its group's plan and start (the group's events: its key's)
    assert all(t["planned_at"] is not None and t["started_at"] >= t["planned_at"]
               for t in trials)


def test_a_finished_grid_ends_the_study_with_one_line(tmp_path, capsys):
    """A 4-point grid asked for 6 trials runs each point once, says so in one line, and returns
    its report like any finished study (no traceback from Optuna's ``study.stop()``)."""
    space = dataclasses.replace(SPACE, grid={"width": [16, 32], "learning_rate": [1e-3, 1e-2]})
    result = scamp_jax.run_study(space, function_task(), trials=6, steps=5, study_dir=tmp_path,
                                 devices=2, memory_per_device="64MiB", max_batch_size=16,
                                 sampler="grid", live=False)
    assert result["trials_this_run"] == 4
    out = capsys.readouterr().out
    assert "grid sampler: 4 points; the study ends with the grid, after 4 of its 6 trials" in out
    assert out.count("the grid's 4 points are done; 4 of 6 trials ran") == 1
    study = optuna.load_study(study_name=space.name, storage=storage_url(tmp_path))
    points = {(t.params["width"], t.params["learning_rate"]) for t in study.get_trials()}
    assert len(study.get_trials()) == 4 and len(points) == 4
    assert {t.state for t in study.get_trials()} == {TrialState.COMPLETE}
    # a rerun of the finished grid says why it runs nothing and adds no run to the record
    again = scamp_jax.run_study(space, function_task(), trials=6, steps=5, study_dir=tmp_path,
                                devices=2, memory_per_device="64MiB", max_batch_size=16,
                                sampler="grid", live=False)
    out = capsys.readouterr().out
    assert again["trials_this_run"] == 0
    assert "nothing left to run: the study has visited every point of its grid" in out, out
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 1


def test_a_search_space_names_what_is_wrong_with_it(tmp_path):
    with pytest.raises(TypeError, match=r"SearchSpace suggest=None is not callable; pass a "
                       r"function suggest\(trial\) -> dict"):
        scamp_jax.SearchSpace("mlp", None, SPACE.build)
    with pytest.raises(TypeError, match=r"SearchSpace build=None is not callable"):
        scamp_jax.SearchSpace("mlp", SPACE.suggest, None)
    with pytest.raises(TypeError, match=r"SearchSpace name=3 must be a non-empty string"):
        scamp_jax.SearchSpace(3, SPACE.suggest, SPACE.build)
    listing = scamp_jax.SearchSpace("mlp", lambda trial: [trial.suggest_int("width", 8, 16)],
                                    SPACE.build)
    with pytest.raises(TypeError, match=r"space.suggest returned list \[\d+\]; it must return "
                       r"a dict of the trial's configuration"):
        scamp_jax.run_study(listing, function_task(), trials=1, steps=2, study_dir=tmp_path,
                            devices=1, memory_per_device="64MiB", live=False)


def test_run_study_rejects_a_bad_setting_before_opening_a_study(tmp_path):
    with pytest.raises(ValueError, match="steps=0 must be an integer >= 1"):
        scamp_jax.run_study(SPACE, function_task(), trials=1, steps=0, study_dir=tmp_path)
    with pytest.raises(ValueError, match=r"max_batch_size=np.int64\(32\) must be a Python int; "
                       r"pass max_batch_size=int\(...\)"):
        scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=tmp_path,
                            max_batch_size=np.int64(32))
    assert not (tmp_path / "study.db").exists()


@pytest.mark.parametrize("bad, error, message", [
    ({"space": "a-name"}, TypeError, "space='a-name' is not a SearchSpace; build one with "
     r"scamp_jax.SearchSpace\(name, suggest, build\)"),
    ({"task": "a-name"}, TypeError, "task='a-name' has no metric, direction, sample_batch, "
     "batches, loss_fn, evaluate: pass a Task"),
    ({"storage": "not a url"}, ValueError, "storage='not a url' is not a database URL; pass "
     "one like sqlite:///runs/study.db"),
    ({"storage": "postgresql+pg8000://u@h/db"}, ValueError, "storage='postgresql.pg8000://u@h/db' "
     "needs the database driver 'pg8000', which is not installed; pip install pg8000"),
    ({"storage": "sqlite:///no-such-folder/x/study.db"}, ValueError, "the folder "
     "'no-such-folder/x' of its database file does not exist"),
    ({"study_dir": "a-file"}, ValueError, "study_dir='.*a-file' is a file; pass a directory"),
    ({"study_dir": ""}, ValueError, "study_dir='' is empty; pass a directory"),
    # a warm start suggest refuses was queued again on every later run, even without it
    ({"initial_params": [{"width": 12}]}, ValueError, r"initial_params\[0\] = \{'width': 12\}: "
     r"the space's suggest cannot take it \(.*12.*\); pass values it can draw"),
    ({"initial_params": [{"width": 16}, {"widht": 16}]}, ValueError,
     r"initial_params\[1\] = \{'widht': 16\} names 'widht', which the space's suggest neither "
     r"draws nor returns \(it draws \['learning_rate', 'width'\]\); check the spelling"),
    ({"space": scamp_jax.SearchSpace("mlp", SPACE.suggest, SPACE.build,
                                     grid={"width": [16, 32]}), "sampler": "grid"}, ValueError,
     r"the search space's grid gives values for \['width'\], but suggest also draws a "
     r"parameter it lacks \(.*learning_rate.*\); give SearchSpace\(grid=...\) the values"),
    # a value that is none of suggest's choices: Optuna's words name no parameter
    ({"space": scamp_jax.SearchSpace("mlp", SPACE.suggest, SPACE.build, grid={
        "width": [16, 24], "learning_rate": [0.01]}), "sampler": "grid"}, ValueError,
     r"the search space's grid gives width=24, which is none of the choices suggest draws "
     r"width from \('24' not in \(16, 32, 64\).\); give SearchSpace\(grid=...\) only values "
     r"among them"),
])
def test_run_study_names_a_bad_argument_and_writes_nothing(tmp_path, bad, error, message):
    (tmp_path / "a-file").write_text("")
    kw = {"space": SPACE, "task": function_task(), "trials": 1, "steps": 2,
          "study_dir": tmp_path / "study", "devices": 1, "memory_per_device": "64MiB",
          "live": False, **bad}
    if bad.get("study_dir"):  # a folder of tmp_path; "" stays as it is
        kw["study_dir"] = tmp_path / bad["study_dir"]
    with pytest.raises(error, match=message):
        scamp_jax.run_study(kw.pop("space"), kw.pop("task"), **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_build_that_returns_no_nnx_module_fails_its_trial_saying_so(tmp_path):
    """Where JAX said a function "is not a valid JAX type" at a line of the planner."""
    space = scamp_jax.SearchSpace("not-a-model", SPACE.suggest, lambda c, rngs: (lambda x: x))
    scamp_jax.run_study(space, function_task(), trials=1, steps=2, study_dir=tmp_path,
                        devices=1, memory_per_device="64MiB", live=False)
    [trial] = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert trial["state"] == "failed"
    assert trial["reason"].startswith(
        "TypeError: search space 'not-a-model': build(config, rngs) returned a function, not "
        "an nnx.Module; it must construct the model"), trial["reason"]


def test_a_database_file_given_in_a_new_study_dir_needs_no_folder_made_first(tmp_path):
    """``--study-dir $SCRATCH/s --storage sqlite:///$SCRATCH/s/study.db`` on a fresh scratch
    folder: the run makes the study directory, so the database file's folder is no reason to
    refuse it (a folder nothing makes still is: `test_run_study_names_a_bad_argument...`)."""
    import optuna

    study_dir = tmp_path / "scratch" / "study"
    url = f"sqlite:///{study_dir / 'study.db'}"
    scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=study_dir,
                        storage=url, devices=1, memory_per_device="64MiB", live=False)
    summaries = optuna.get_all_study_summaries(url)
    assert [s.n_trials for s in summaries] == [1]


def test_run_study_refuses_a_damaged_study_database_and_changes_nothing(tmp_path):
    # the library checks the study's place as the experiments' flags do (one check)
    damaged = b"SQLite format 3\x00" + b"\xff" * 4000
    (tmp_path / "study.db").write_bytes(damaged)
    with pytest.raises(ValueError, match=r"the study database '.*study.db' is damaged \(.*\); "
                       "restore it from a copy, or pass another study_dir or storage"):
        scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=tmp_path,
                            devices=1, memory_per_device="64MiB", live=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.db"]
    assert (tmp_path / "study.db").read_bytes() == damaged


def test_run_study_refuses_a_file_where_its_compiled_programs_go_before_the_study(tmp_path):
    (tmp_path / "jax_cache").write_text("")
    with pytest.raises(ValueError, match=r"'.*jax_cache' is a file, where the study keeps its "
                       r"compiled programs \(a folder\): move or delete it"):
        scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=tmp_path,
                            devices=1, memory_per_device="64MiB", live=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jax_cache"]  # no study made


def test_run_study_refuses_a_damaged_plan_cache_naming_it(tmp_path):
    (tmp_path / "plans.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(ValueError, match=r"the plan cache '.*plans.sqlite' is damaged \(file is "
                       r"not a database\); it holds plans and measured allowances only: delete it"):
        scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=tmp_path,
                            devices=1, memory_per_device="64MiB", live=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans.sqlite"]
    from scamp_jax.planning.plan_cache import PlanCache

    with pytest.raises(ValueError, match=r"the plan cache '.*plans.sqlite' cannot be used \(file "
                       r"is not a database\); a plan cache holds plans and measured "
                       "allowances only: if this file is one, delete it"):
        PlanCache(tmp_path / "plans.sqlite").get_allowance("cpu", "cpu")
    with pytest.raises(ValueError, match=r"the plan cache '.*' is a folder; pass a file path, "
                       r"e.g. '.*plans.sqlite'"):
        PlanCache(tmp_path).get_allowance("cpu", "cpu")  # a folder, not a file


def test_a_rerun_with_a_lower_total_says_which_retries_wait(tmp_path, capsys):
    """Three trials stopped by an earlier run; a rerun with a total of 1 runs one retry and
    says that the other two stay queued."""
    from scamp_jax.hpo.study import OptunaTrialSource, open_study

    earlier = OptunaTrialSource(open_study("mlp", study_dir=tmp_path, direction="minimize"),
                                SPACE, 3)
    for trial in [earlier.ask() for _ in range(3)]:
        earlier.interrupt(trial.number)
    earlier.close()
    scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=tmp_path,
                        devices=1, memory_per_device="64MiB", live=False)
    out = capsys.readouterr().out
    assert "resuming: trials [0, 1, 2], stopped by an earlier run, run again" in out, out
    assert ("only 1 more trial runs before the study reaches its 1, so at most 1 of these 3 "
            "retries run now; the others stay queued in the study for a run with a larger "
            "total") in out, out


def test_a_trials_devices_are_recorded_by_their_jax_ids(tmp_path):
    done = scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=tmp_path,
                               devices=[jax.devices()[3]], memory_per_device="64MiB",
                               live=False)
    assert done["best"]["devices"] == [3]
    [row] = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert row["devices"] == [3]
    assert [ids for _, ids in row["placements"]] == [[0]]  # the pool's own positions


def test_a_baseline_that_is_no_score_is_named(tmp_path, capsys):
    scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=tmp_path,
                        devices=1, memory_per_device="64MiB", live=False, baseline="nope")
    out = capsys.readouterr().out
    assert "note: baseline 'nope' is none of the scores the trials returned (mse" in out, out


def test_cpu_devices_default_to_a_share_of_host_memory():
    from scamp_jax.devices import host_memory_bytes
    from scamp_jax.hpo.session import CPU_MEMORY_SHARE, default_budget

    host = host_memory_bytes()
    devices = jax.devices()[:4]
    assert default_budget(None, devices) == int(CPU_MEMORY_SHARE * host) // 4
    assert default_budget("1GiB", devices) == 2**30


def test_entry_point_names_the_flag_of_a_bad_setting(capsys):
    from experiments import vit_synthetic

    with pytest.raises(SystemExit) as exit_info:
        # argparse checks each flag alone; SearchSettings checks how they combine
        vit_synthetic.main(["--preset", "smoke", "--min-batch-size", "64",
                            "--max-batch-size", "8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert ("--min-batch-size 64 is larger than --max-batch-size 8; raise --max-batch-size to "
            "at least 64 or lower --min-batch-size") in err


def test_a_budget_too_small_for_any_candidate_leaves_the_study_free_to_start_again(tmp_path):
    """The error advises a larger budget; a study in which nothing ran takes it (its settings
    were those of the run that fitted nothing), while one with a finished trial keeps its own."""
    from scamp_jax.hpo.engine import BudgetTooSmallError

    kw = dict(steps=5, study_dir=tmp_path, live=False, max_batch_size=8)
    with pytest.raises(BudgetTooSmallError, match="raise memory_per_device or devices"):
        scamp_jax.run_study(SPACE, function_task(), trials=2, memory_per_device="1KiB", **kw)
    assert not (tmp_path / "outputs.json").exists()  # the folder is any study's again
    done = scamp_jax.run_study(SPACE, function_task(), trials=2, memory_per_device="64MiB", **kw)
    assert done["trials_this_run"] == 2
    from scamp_jax.hpo.study import StudySettingsError

    with pytest.raises(StudySettingsError, match="memory_per_device=67108864"):
        scamp_jax.run_study(SPACE, function_task(), trials=3, memory_per_device="1KiB", **kw)


def test_a_rerun_whose_first_candidates_do_not_fit_fails_them_and_finishes_the_study(
        tmp_path):
    """Once a study trained trials at its budget (which it stores, so a rerun cannot raise
    it), a misfit in a later run is the configuration's own: it fails for good and the run
    goes on, where it was given back and asked first by every rerun, each stopping with
    `BudgetTooSmallError`."""
    def suggest(trial: optuna.Trial) -> dict:
        return {"width": trial.suggest_categorical("width", [16, 300_000]),
                "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)}

    space = scamp_jax.SearchSpace("mlp", suggest, SPACE.build)
    kw = dict(steps=2, study_dir=tmp_path, live=False, max_batch_size=8, devices=1,
              memory_per_device="2MiB", sampler="random")
    first = [{"width": 16, "learning_rate": 1e-2}, {"width": 16, "learning_rate": 2e-2},
             *({"width": 300_000, "learning_rate": lr} for lr in (1e-2, 2e-2, 3e-3))]
    assert scamp_jax.run_study(space, function_task(), trials=2, initial_params=first,
                               **kw)["trials_this_run"] == 2
    done = scamp_jax.run_study(space, function_task(), trials=6, **kw)
    rows = json.loads((tmp_path / "results.json").read_text())["trials"]
    misfits = [r for r in rows if r["params"]["width"] == 300_000]
    assert len(misfits) == 3 and all(r["state"] == "failed" for r in misfits), misfits
    assert all(r["reason"].startswith("does not fit") for r in misfits), misfits
    assert len(rows) == 6 and done["trials_this_run"] == 4


def test_a_rerun_on_fewer_devices_than_its_trials_trained_on_may_still_be_too_small(tmp_path):
    """The study trained its candidates model-parallel on 4 devices; a rerun on 1 device, where
    none fits, stops as a budget too small for any candidate (its misfits go back to the
    study) rather than fail the study's remaining trials for good."""
    from scamp_jax.hpo.engine import BudgetTooSmallError

    def suggest(trial: optuna.Trial) -> dict:
        return {"width": trial.suggest_categorical("width", [20_000]),
                "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)}

    space = scamp_jax.SearchSpace("mlp", suggest, SPACE.build)
    kw = dict(steps=2, study_dir=tmp_path, live=False, max_batch_size=8,
              memory_per_device="2MiB", sampler="random")
    assert scamp_jax.run_study(space, function_task(), trials=2, devices=4,
                               **kw)["trials_this_run"] == 2
    rows = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert all(r["model_parallel"] >= 2 for r in rows), rows
    with pytest.raises(BudgetTooSmallError, match="none of the first 3 candidates fits the "
                       "pool of 1 devices"):
        scamp_jax.run_study(space, function_task(), trials=6, devices=1, **kw)
    rows = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert [r["state"] for r in rows] == ["complete"] * 2  # none failed for good


def test_a_run_that_fails_before_any_trial_ran_leaves_the_study_free_to_start_again(
        tmp_path, monkeypatch):
    """Whatever stops a run before any trial ran (here a full disk as the engine starts: a
    fault made up here, none can be caused for real) leaves no settings behind, so the rerun,
    with other settings, is not refused as a change of the study."""
    from scamp_jax.hpo.session import StudySession

    kw = dict(steps=5, study_dir=tmp_path, live=False, max_batch_size=8)
    run_engine = StudySession.run_engine

    def full_disk(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StudySession, "run_engine", full_disk)
    with pytest.raises(OSError, match="No space left"):
        scamp_jax.run_study(SPACE, function_task(), trials=2, memory_per_device="32MiB", **kw)
    monkeypatch.setattr(StudySession, "run_engine", run_engine)
    done = scamp_jax.run_study(SPACE, function_task(), trials=2, memory_per_device="64MiB", **kw)
    assert done["trials_this_run"] == 2


def test_a_study_whose_database_was_deleted_is_not_made_again_over_its_outputs(tmp_path):
    """A new study of the same name would resume trial N from the deleted study's
    ``checkpoints/trial_N`` (another configuration): the run is refused and nothing changes."""
    kw = dict(steps=5, study_dir=tmp_path, live=False, max_batch_size=8,
              memory_per_device="64MiB", checkpoint_every=5)
    scamp_jax.run_study(SPACE, function_task(), trials=2, **kw)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept
    for db in tmp_path.glob("study.db*"):
        db.unlink()
    with pytest.raises(ValueError, match=r"holds the checkpoints, results.json and best_model of "
                       r"an earlier study 'mlp', which its storage does not have \(was its "
                       r"study.db deleted, or another storage given\?\)"):
        scamp_jax.run_study(SPACE, function_task(), trials=2, seed=1, **kw)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == kept
    assert not list(tmp_path.glob("study.db*"))  # the refusal made no new database


def _ctrl_c_at_step(monkeypatch, step: int, run) -> None:
    """``run()`` stopped by a Ctrl-C once a trial reaches ``step`` (raised where the view
    updates, as a user's lands); the view as it was afterwards."""
    from scamp_jax.hpo import live

    update = live.LiveView.update

    def ctrl_c(self, statuses, *args, **kwargs):
        if any(s.step >= step for s in statuses):
            raise KeyboardInterrupt
        return update(self, statuses, *args, **kwargs)

    monkeypatch.setattr(live.LiveView, "update", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(live.LiveView, "update", update)


def test_a_stopped_runs_record_counts_the_devices_idle_while_its_trials_were_planned(
        tmp_path, monkeypatch):
    """The wait for plans of a run a Ctrl-C ended: its trials went back to the study untold,
    and the figure, taken from the told trials alone, read 0.0."""
    _ctrl_c_at_step(monkeypatch, 30, lambda: scamp_jax.run_study(
        SPACE, function_task(), steps=400, study_dir=tmp_path, live=False, max_batch_size=8,
        memory_per_device="64MiB", devices=2, trials=2, checkpoint_every=10,
        checkpoint_min_seconds=0))
    [run] = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["interrupted"] and run["trials_this_run"] == 0
    overhead = run["overhead"]
    # both devices idle at least while the first plan compiled (a planning compile, at least)
    assert 0 < overhead["idle_waiting_for_plans_device_s"] <= 2 * overhead["elapsed_s"]
    # one clock for the run, its usage and its overhead (the run's was the caller's)
    assert run["elapsed_s"] == pytest.approx(overhead["elapsed_s"], abs=1e-3)
    assert run["elapsed_s"] == pytest.approx(run["usage"]["elapsed_s"], abs=1e-3)


def test_a_resumed_trials_row_counts_the_seconds_of_the_attempt_a_stop_ended(
        tmp_path, monkeypatch):
    """A trial stopped at step 30 and resumed by the next run: its row reached step 400 in
    the seconds of both attempts, where it showed the resumed attempt's alone."""
    kw = dict(study_dir=tmp_path, live=False, max_batch_size=8, memory_per_device="64MiB",
              devices=1, trials=1, checkpoint_every=10, checkpoint_min_seconds=0, steps=400)
    _ctrl_c_at_step(monkeypatch, 30, lambda: scamp_jax.run_study(SPACE, function_task(), **kw))
    scamp_jax.run_study(SPACE, function_task(), **kw)
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    stopped, resumed = study.trials
    assert stopped.state == optuna.trial.TrialState.FAIL and resumed.state.is_finished()
    first, second = stopped.user_attrs["wall_seconds"], resumed.user_attrs["wall_seconds"]
    assert first > 0 and second > 0
    [row] = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert (row["number"], row["retry_of"], row["steps"]) == (1, 0, 400)
    assert row["resumed_from"] >= 30
    assert row["wall_seconds"] == pytest.approx(first + second, abs=2e-3)
    assert 0 <= row["asked_at"] <= row["planned_at"] <= row["started_at"]


def test_a_trials_step_seconds_leave_its_checkpoints_out(tmp_path, monkeypatch):
    """Four checkpoints in ten steps, each held 0.5 s longer (a slow disk, made up here): the
    step time, which counted them (0.2 s a step at least), is the steps' own."""
    import time

    from scamp_jax.hpo.checkpoint import TrialCheckpointer

    save = TrialCheckpointer.save

    def slow_save(self, *args, **kwargs):
        time.sleep(0.5)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(TrialCheckpointer, "save", slow_save)
    scamp_jax.run_study(SPACE, function_task(), trials=1, steps=10, study_dir=tmp_path,
                        live=False, max_batch_size=8, memory_per_device="64MiB", devices=1,
                        checkpoint_every=2, checkpoint_min_seconds=0)
    [row] = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert row["steps"] == 10 and row["wall_seconds"] > 2.5  # 5 saves, the last one's too
    assert 0 < row["step_seconds"] < 0.1


def test_a_trials_step_seconds_leave_its_seconds_stored_at_checkpoints_out(tmp_path,
                                                                         monkeypatch):
    """Each of four checkpoints before the last stores the trial's seconds so far in the
    study, held 0.5 s here (a slow database server, made up): the step time, which counted
    those writes (0.2 s a step at least), is the steps' own."""
    import time

    from scamp_jax.hpo.study import OptunaTrialSource

    progress = OptunaTrialSource.progress
    stored: list[int] = []

    def slow_progress(self, number: int, wall_seconds: float) -> None:
        time.sleep(0.5)
        stored.append(number)
        progress(self, number, wall_seconds)

    monkeypatch.setattr(OptunaTrialSource, "progress", slow_progress)
    scamp_jax.run_study(SPACE, function_task(), trials=1, steps=10, study_dir=tmp_path,
                        live=False, max_batch_size=8, memory_per_device="64MiB", devices=1,
                        checkpoint_every=2, checkpoint_min_seconds=0)
    [row] = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert row["steps"] == 10 and stored == [0] * 4 and row["wall_seconds"] > 2.0
    assert 0 < row["step_seconds"] < 0.1


def test_a_run_that_fails_after_trials_trained_keeps_the_studys_settings(tmp_path, monkeypatch):
    """Trials that trained and went back to the study (a Ctrl-C, here raised where the view
    updates, as a user's lands) keep their checkpoints: a later run that fails before asking
    (a full disk, made up here) must not free the study for other settings, under which those
    checkpoints would be resumed."""
    from scamp_jax.hpo.session import StudySession
    from scamp_jax.hpo.study import StudySettingsError

    kw = dict(study_dir=tmp_path, live=False, max_batch_size=8, memory_per_device="64MiB",
              trials=2, checkpoint_every=10, checkpoint_min_seconds=0)
    _ctrl_c_at_step(monkeypatch, 30,
                    lambda: scamp_jax.run_study(SPACE, function_task(), steps=400, **kw))

    def full_disk(self, *a, **k):
        raise OSError(28, "No space left on device")

    run_engine = StudySession.run_engine
    monkeypatch.setattr(StudySession, "run_engine", full_disk)
    with pytest.raises(OSError, match="No space left"):
        scamp_jax.run_study(SPACE, function_task(), steps=400, **kw)
    monkeypatch.setattr(StudySession, "run_engine", run_engine)
    with pytest.raises(StudySettingsError, match="steps=400"):
        scamp_jax.run_study(SPACE, function_task(), steps=40, **kw)


def test_a_too_small_rerun_keeps_the_settings_of_trials_that_trained_and_went_back(
        tmp_path, monkeypatch):
    """Trials that trained model-parallel on 4 devices and went back at a Ctrl-C keep their
    checkpoints; a rerun on 1 device, where no candidate fits, stops as too small but must not
    forget the study's settings, or the next run could resume those checkpoints under others."""
    from scamp_jax.hpo.engine import BudgetTooSmallError
    from scamp_jax.hpo.study import StudySettingsError

    def suggest(trial: optuna.Trial) -> dict:
        return {"width": trial.suggest_categorical("width", [20_000]),
                "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)}

    space = scamp_jax.SearchSpace("mlp", suggest, SPACE.build)
    kw = dict(study_dir=tmp_path, live=False, max_batch_size=8, memory_per_device="2MiB",
              sampler="random", trials=2, checkpoint_every=5, checkpoint_min_seconds=0)
    _ctrl_c_at_step(monkeypatch, 10, lambda: scamp_jax.run_study(
        space, function_task(), steps=400, devices=4, **kw))
    study = optuna.load_study(study_name="mlp", storage=storage_url(tmp_path))
    assert {t.state for t in study.trials} <= {optuna.trial.TrialState.FAIL,
                                               optuna.trial.TrialState.WAITING}
    assert any((tmp_path / "checkpoints").iterdir())
    with pytest.raises(BudgetTooSmallError):
        scamp_jax.run_study(space, function_task(), steps=400, devices=1, **kw)
    with pytest.raises(StudySettingsError, match="steps=400"):
        scamp_jax.run_study(space, function_task(), steps=40, devices=4, **kw)


class _DropoutMLP(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, width, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(jax.nn.relu(self.hidden(x))))


@pytest.mark.parametrize("fuse", [None, 2])
def test_a_task_evaluates_its_model_in_evaluation_mode(tmp_path, fuse):
    """Dropout is off (batch norm would use its running averages) when a task's ``evaluate``
    scores a model, solo and in a fused group, as in the planned forward; training keeps it on."""
    reference = Regression()
    modes = []

    def evaluate(model):
        modes.append(model.dropout.deterministic)
        return reference.evaluate(model)

    task = scamp_jax.FunctionTask(metric="mse", direction="minimize",
                                  loss_fn=reference.loss_fn, batches=reference.batches,
                                  evaluate=evaluate)
    space = scamp_jax.SearchSpace("dropout-mlp", lambda t: {"width": 16},
                                  lambda config, rngs: _DropoutMLP(config["width"], rngs))
    done = scamp_jax.run_study(space, task, trials=2, steps=3, study_dir=tmp_path, live=False,
                               memory_per_device="64MiB", max_batch_size=8, fuse=fuse,
                               sampler="random")
    assert done["trials_this_run"] == 2 and modes and all(modes), modes


def test_a_study_at_its_total_says_why_a_rerun_runs_nothing(tmp_path, capsys):
    """Trials that failed for their own reason (here: no study metric; ``failure_limit=0``,
    as a space that fails configurations on purpose passes, or both would go back to the
    study) count towards the total: a rerun after the fix runs nothing and says so, and how
    to run more."""
    reference = Regression()
    broken = scamp_jax.FunctionTask(metric="mse", direction="minimize",
                                    loss_fn=reference.loss_fn, batches=reference.batches,
                                    evaluate=lambda model: {"error": 1.0})
    kw = dict(trials=2, steps=2, study_dir=tmp_path, live=False, memory_per_device="64MiB",
              max_batch_size=8)
    scamp_jax.run_study(SPACE, broken, failure_limit=0, **kw)
    capsys.readouterr()
    again = scamp_jax.run_study(SPACE, function_task(), **kw)
    out = capsys.readouterr().out
    assert again["trials_this_run"] == 0
    assert "2 of 2 trials finished before this run (2 of them failed" in out, out
    assert "nothing left to run: the study has its 2 trials; raise the number of trials" in out
    # nothing ran: the opening lines end with why, and the record of runs keeps the first run
    lines = out.splitlines()
    assert lines.index(next(x for x in lines if x.startswith("pool:"))) + 1 == lines.index(
        next(x for x in lines if x.startswith("nothing left to run"))), out
    assert "this run trained nothing" in out, out
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 1
    # asked for fewer trials than it has: said as it is, not "2 of 1"
    scamp_jax.run_study(SPACE, function_task(), **{**kw, "trials": 1})
    out = capsys.readouterr().out
    assert "2 trials finished before this run, more than the 1 asked for now" in out, out
    assert ("nothing left to run: the study has 2 finished trials, at least the 1 trial asked "
            "for; raise the number of trials") in out, out
    # A Ctrl-C while such a rerun sets its engine up adds no run either. (Faked: a rerun with
    # nothing to train is over before a real signal could be timed to land in it.)
    from scamp_jax.hpo.session import StudySession

    def interrupted(self, source):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StudySession, "run_engine", interrupted)
        with pytest.raises(KeyboardInterrupt):
            scamp_jax.run_study(SPACE, function_task(), **kw)
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 1
    more = scamp_jax.run_study(SPACE, function_task(), **{**kw, "trials": 3})
    assert more["trials_this_run"] == 1
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 2


def test_a_tasks_test_scores_the_best_model_on_data_no_trial_was_chosen_by(tmp_path, capsys):
    """A task with ``test`` has the study's best model tested at the end of a run: on other
    data than the held-out scores that chose it. The scores are the model's (recomputed here
    from ``best_model/``), printed under the best trial's line and kept in ``results.json`` and
    ``best_model/trial.json``; a rerun that trains nothing tests the same model again."""
    reference = Regression()
    rng = np.random.default_rng(7)
    x_test = rng.normal(size=(64, reference.w.shape[0])).astype(np.float32)
    y_test = np.sin(x_test @ reference.w)
    tested = []

    def test(model):
        tested.append(model)
        pred = np.asarray(model(jnp.asarray(x_test)))
        return {"mse": float(np.mean((pred - y_test) ** 2)),
                "zero_mse": float(np.mean(y_test**2))}

    task = dataclasses.replace(function_task(), test=test)
    kw = dict(trials=2, steps=10, study_dir=tmp_path, memory_per_device="64MiB",
              max_batch_size=16, sampler="random", live=False, baseline="zero_mse")
    done = scamp_jax.run_study(SPACE, task, **kw)
    best = json.loads((tmp_path / "best_model" / "trial.json").read_text())
    model = scamp_jax.load_model(tmp_path / "best_model", SPACE, best["params"])
    again = test(model)
    assert len(tested) == 2 and again["mse"] != best["mse"]  # other data than the held-out
    assert done["test"] == {"trial": best["number"], **again}
    assert best["test"] == again
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["test"] == done["test"] and results["best"] == best["number"]
    said = capsys.readouterr().out
    lines = said.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("best trial ")))
    assert lines[first].startswith(f"best trial {best['number']}: mse {best['mse']:.5g} vs ")
    assert lines[first + 1].startswith(
        f"  tested on data no trial was chosen by (the task's test): mse {again['mse']:.5g} "
        f"vs zero_mse {again['zero_mse']:.5g} (")
    rerun = scamp_jax.run_study(SPACE, task, **kw)
    assert rerun["trials_this_run"] == 0 and len(tested) == 3
    assert rerun["test"] == done["test"]


def test_a_test_that_fails_is_said_and_the_study_keeps_its_results(tmp_path, capsys):
    """A ``test`` that raises at the end of the study is said; every trial's results and the
    best model are written, and no test scores are claimed."""
    def test(model):
        raise KeyError("x_test")

    task = dataclasses.replace(function_task(), test=test)
    done = scamp_jax.run_study(SPACE, task, trials=2, steps=5, study_dir=tmp_path,
                               memory_per_device="64MiB", max_batch_size=16, live=False,
                               sampler="random")
    assert done["trials_this_run"] == 2 and done["test"] is None
    said = capsys.readouterr().out
    assert (f"note: the task's test of the best model (trial {done['best']['number']}, in "
            f"{tmp_path / 'best_model'}) raised KeyError: 'x_test'; the study's results are "
            "written") in said
    results = json.loads((tmp_path / "results.json").read_text())
    assert "test" not in results and len(results["trials"]) == 2
    assert "test" not in json.loads((tmp_path / "best_model" / "trial.json").read_text())
    with pytest.raises(TypeError, match=r"test=3 is not callable"):
        dataclasses.replace(function_task(), test=3)


class _HeldBack:
    """The regression task with its test split as an attribute named ``test``."""

    def __init__(self) -> None:
        self._task = Regression()
        self.test = (self._task.x_eval, self._task.y_eval)

    def __getattr__(self, name):
        return getattr(self._task, name)


def test_a_task_whose_test_is_no_function_is_refused_before_the_study(tmp_path):
    with pytest.raises(TypeError, match=r"the task's test is a tuple, not callable; it must "
                       r"be a method test\(model\) -> \{name: float\}"):
        scamp_jax.run_study(SPACE, _HeldBack(), trials=1, steps=2, study_dir=tmp_path,
                            live=False)
    assert not (tmp_path / "study.db").exists()


@pytest.mark.parametrize("returned, said", [
    ({"zero_mse": 1.0}, "task.test returned ['zero_mse'] without the study metric 'mse'"),
    ({"mse": "low"}, "task.test returned 'mse': 'low'; every score must be one number"),
    ({"mse": 0.5, "trial": 99}, "task.test returned a score named 'trial'; name it otherwise"),
    (0.5, "task.test returned float 0.5; it must return a dict of scores that holds the study "
          "metric"),
])
def test_a_test_that_returns_no_scores_is_not_kept(tmp_path, capsys, returned, said):
    """A ``test`` must return what ``evaluate`` returns: a dict of numbers with the metric
    (and no score named ``trial``, the key that says whose scores they are). Anything else is
    said, with what it must return, and no test scores are claimed."""
    task = dataclasses.replace(function_task(), test=lambda model: returned)
    done = scamp_jax.run_study(SPACE, task, trials=1, steps=2, study_dir=tmp_path,
                               memory_per_device="64MiB", max_batch_size=16, live=False)
    assert done["trials_this_run"] == 1 and done["test"] is None
    out = " ".join(capsys.readouterr().out.split())
    assert f"note: the test of the best model (trial 0, in {tmp_path / 'best_model'}) is not " \
           f"kept: {said}" in out
    assert "test" not in json.loads((tmp_path / "results.json").read_text())


def test_a_test_that_gives_no_finite_number_is_said_and_kept_as_null(tmp_path, capsys):
    """A test whose metric is NaN (a model that diverges on the test data) is said, in the
    note and in the best trial's lines, and returned as ``results.json`` keeps it (null),
    not as a number that was never written."""
    task = dataclasses.replace(function_task(), test=lambda model: {
        "mse": float("nan"), "mae": 0.5, "max": float("inf")})
    done = scamp_jax.run_study(SPACE, task, trials=1, steps=2, study_dir=tmp_path,
                               memory_per_device="64MiB", max_batch_size=16, live=False)
    assert done["test"] == {"trial": 0, "mse": None, "mae": 0.5, "max": None}
    assert json.loads((tmp_path / "results.json").read_text())["test"] == done["test"]
    out = " ".join(capsys.readouterr().out.split())
    assert (f"note: the test of the best model (trial 0, in {tmp_path / 'best_model'}) gave "
            "mse nan, max inf, no finite number (kept as null)") in out
    assert "tested on data no trial was chosen by (the task's test): mse no finite number" in out


def test_the_test_in_the_results_is_the_best_trials_and_a_failed_copy_keeps_the_run(
        tmp_path):
    """``results.json`` holds a test only of its best trial's model: once a later trial is
    better, the earlier model's test is not claimed for it, even where the later model cannot
    be saved (here a file stands where its copy goes: a full disk's stand-in); and the run's
    record is written before the copy, so that failure loses no run."""
    scores = iter([{"mse": 0.5}, {"mse": 0.25}])
    first = dataclasses.replace(function_task(), test=lambda model: next(scores))
    kw = dict(steps=3, study_dir=tmp_path, memory_per_device="64MiB", max_batch_size=16,
              live=False, sampler="random")
    done = scamp_jax.run_study(SPACE, first, trials=1, **kw)
    assert done["test"] == {"trial": 0, "mse": 0.5}
    better = dataclasses.replace(function_task(), evaluate=lambda model: {"mse": -1.0},
                                 test=lambda model: next(scores))
    (tmp_path / ".best_model.part").write_text("in the way")
    with pytest.raises(NotADirectoryError):
        scamp_jax.run_study(SPACE, better, trials=2, **kw)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["best"] == 1 and len(results["runs"]) == 2 and "test" not in results
    assert json.loads((tmp_path / "best_model" / "trial.json").read_text())["number"] == 0
    (tmp_path / ".best_model.part").unlink()
    rerun = scamp_jax.run_study(SPACE, better, trials=2, **kw)
    assert rerun["trials_this_run"] == 0 and rerun["test"] == {"trial": 1, "mse": 0.25}


def test_a_best_model_whose_checkpoints_were_removed_is_still_tested(tmp_path):
    """``best_model/`` is a copy: with the study's ``checkpoints/`` removed, a rerun still
    tests the model there when it is the best trial's."""
    import shutil

    tested = []
    task = dataclasses.replace(function_task(),
                               test=lambda model: tested.append(1) or {"mse": 0.5})
    kw = dict(trials=1, steps=3, study_dir=tmp_path, memory_per_device="64MiB",
              max_batch_size=16, live=False)
    scamp_jax.run_study(SPACE, task, **kw)
    shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
    again = scamp_jax.run_study(SPACE, task, **kw)
    assert len(tested) == 2 and again["test"] == {"trial": 0, "mse": 0.5}


def test_a_best_model_left_by_an_earlier_study_is_replaced_and_never_tested_as_the_new_ones(
        tmp_path):
    """A folder whose earlier study was moved away but for ``best_model/``: the new study's
    trial 0 writes ``checkpoints/trial_0`` again, under the same number. The earlier model
    (other parameters, another score) is replaced by the new best's, and the test scores the
    new one; a rerun whose test then fails claims no test at all, not the earlier run's."""
    import shutil

    kw = dict(trials=1, steps=3, study_dir=tmp_path, memory_per_device="64MiB",
              max_batch_size=16, live=False, sampler="random")
    tested = []
    earlier = dataclasses.replace(function_task(), evaluate=lambda model: {"mse": 0.5},
                                  test=lambda model: tested.append(model) or {"mse": 0.5})
    scamp_jax.run_study(SPACE, earlier, seed=1, **kw)
    for name in ("checkpoints", "results.json", "results.csv", "study.db", "outputs.json"):
        path = tmp_path / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    now = dataclasses.replace(function_task(), evaluate=lambda model: {"mse": 1.0},
                              test=lambda model: tested.append(model) or {"mse": 0.75})
    done = scamp_jax.run_study(SPACE, now, seed=2, **kw)
    saved = json.loads((tmp_path / "best_model" / "trial.json").read_text())
    assert saved["params"] == done["best"]["params"] and saved["mse"] == 1.0
    assert done["test"] == {"trial": 0, "mse": 0.75} and saved["test"] == {"mse": 0.75}
    assert tested[-1].hidden.kernel.shape[1] == done["best"]["params"]["width"]

    def broken(model):
        raise RuntimeError("test data moved")

    again = scamp_jax.run_study(SPACE, dataclasses.replace(now, test=broken), seed=2, **kw)
    assert again["trials_this_run"] == 0 and again["test"] is None
    assert "test" not in json.loads((tmp_path / "results.json").read_text())
    assert "test" not in json.loads((tmp_path / "best_model" / "trial.json").read_text())


def test_a_best_model_record_that_is_no_object_is_said_and_not_tested(tmp_path, capsys):
    """A ``best_model/trial.json`` that holds JSON but no record (here ``null``, with the
    study's checkpoints removed so that nothing copies it anew) is said, not tested; the run
    ends as it would without a test."""
    import shutil

    kw = dict(trials=1, steps=3, study_dir=tmp_path, memory_per_device="64MiB",
              max_batch_size=16, live=False)
    task = dataclasses.replace(function_task(), test=lambda model: {"mse": 0.5})
    scamp_jax.run_study(SPACE, task, **kw)
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "best_model" / "trial.json").write_text("null")
    again = scamp_jax.run_study(SPACE, task, **kw)
    assert again["test"] is None
    assert (f"note: {tmp_path / 'best_model'} holds no model of the best trial 0"
            in " ".join(capsys.readouterr().out.split()))


def test_the_pool_line_says_the_cores_this_process_may_use(tmp_path, monkeypatch, capsys):
    """Under mpirun a rank may use one core: the cap on running trials came out as "one per
    2 of the host's 1 CPU cores"; it says the cores the process may use, and the floor."""
    from scamp_jax.scheduling import host

    monkeypatch.setattr(host, "host_cores", lambda: 1)
    scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=tmp_path,
                        live=False, max_batch_size=8, memory_per_device="64MiB", devices=2)
    [line] = [s for s in capsys.readouterr().out.splitlines() if s.startswith("pool:")]
    assert line.endswith("; at most 1 trial trains at once (auto: one per 2 of the 1 CPU "
                         "core(s) this process may use, at least one)"), line


def test_the_pool_line_says_where_memory_alone_decides_how_many_train(tmp_path, capsys):
    """With no cap (``--max-running-trials none``, the CPU default preset's), the pool line
    says so: several trials may train on one device, as many as its memory holds."""
    scamp_jax.run_study(SPACE, function_task(), trials=1, steps=2, study_dir=tmp_path,
                        live=False, max_batch_size=8, memory_per_device="64MiB", devices=2,
                        max_running_trials=None)
    [line] = [s for s in capsys.readouterr().out.splitlines() if s.startswith("pool:")]
    assert line.endswith("; no cap on trials training at once: the pool's memory decides"), line
