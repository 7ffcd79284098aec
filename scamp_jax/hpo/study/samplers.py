"""Seeded Optuna samplers and pruners by name, as a study opens them."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from scamp_jax.hpo.settings import PRUNERS, SAMPLERS


def make_sampler(
    name: str, seed: int, grid: Mapping[str, Sequence[Any]] | None = None
) -> optuna.samplers.BaseSampler:
    """Seeded Optuna sampler by name: ``"tpe"`` (default), ``"random"`` or ``"grid"``.

    TPE and random search draw each trial with a sampler seeded from ``seed`` and the trial's
    place among those that are no retries (`TrialSeededSampler`), so a resumed or extended
    study draws new configurations instead of replaying the first ones. The grid keeps one
    seed: its shuffled order must stay the same for every trial, or two trials could map to
    one point (`GridSearch`).
    """
    if name == "tpe":
        return TrialSeededSampler(lambda s: optuna.samplers.TPESampler(seed=s), seed)
    if name == "random":
        return TrialSeededSampler(lambda s: optuna.samplers.RandomSampler(seed=s), seed)
    if name == "grid":
        if not grid:
            raise ValueError(
                "sampler='grid' needs the search space's grid of values; this space defines none, "
                "use sampler='tpe' or 'random'"
            )
        return GridSearch({k: list(v) for k, v in grid.items()}, seed=seed)
    raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")


class TrialSeededSampler(optuna.samplers.BaseSampler):
    """A sampler made afresh for every trial, seeded from the study's seed and the trial's
    place among the study's trials that are no retries.

    A trial's draws depend only on the seed, that place and the study's history, not on how
    many trials this process asked before: a rerun that extends a finished study, or a second
    process on it, draws new configurations rather than the ones a fresh sampler with the same
    seed drew first. Retries (of trials a stop or a dead process cut short) take trial numbers
    but count for no place (a retry draws as its original, where it draws at all): a study
    stopped and resumed draws what it would have drawn unstopped (where the draws depend on
    the seed alone: a random sampler, TPE's first trials). Thread-safe: each live trial has its
    own sampler.

    Args:
      make: ``make(seed) -> sampler`` (e.g. ``lambda s: optuna.samplers.TPESampler(seed=s)``).
      seed: the study's seed.
    """

    def __init__(self, make: Callable[[int], optuna.samplers.BaseSampler], seed: int) -> None:
        self._make, self._seed = make, int(seed)
        self._samplers: dict[int, optuna.samplers.BaseSampler] = {}
        self._lock = threading.Lock()

    def _of(self, study: optuna.Study, trial: FrozenTrial) -> optuna.samplers.BaseSampler:
        with self._lock:
            sampler = self._samplers.get(trial.number)
            if sampler is None:
                sampler = self._samplers[trial.number] = self._make(
                    sampler_seed(self._seed, _place(study, trial)))
            return sampler

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, Any]:
        return self._of(study, trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, Any]) -> dict[str, Any]:
        return self._of(study, trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: Any) -> Any:
        return self._of(study, trial).sample_independent(study, trial, param_name,
                                                         param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._of(study, trial).before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        sampler = self._of(study, trial)
        with self._lock:
            self._samplers.pop(trial.number, None)
        sampler.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        """Nothing to do: every trial's sampler is seeded from its place (`_place`)."""


def _place(study: optuna.Study, trial: FrozenTrial) -> int:
    """How many of ``study``'s trials before ``trial`` are no retries (`retried_from`): the
    place whose seed its sampler takes (its number where nothing was retried before it). A
    retry takes its original's place: one that draws (its original stopped before it drew,
    e.g. in a ``suggest`` that raised) draws what its original would have, and no later trial
    draws it again."""
    from scamp_jax.hpo.study.storage import retried_from

    original = retried_from(trial)
    before = trial.number if original is None else original
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.number < before and retried_from(t) is None)


class GridSearch(optuna.samplers.GridSampler):
    """Optuna's grid sampler, driven by ask-and-tell.

    Optuna's grid stops ``Study.optimize`` when its last point finishes (``study.stop()``, which
    raises outside ``optimize``); here the trial source ends the study instead: it asks no new
    trial once every point is running or finished (`OptunaTrialSource.grid_points`).
    """

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        """Nothing: the trial source, not ``study.stop()``, ends a finished grid."""


def make_pruner(name: str, *, warmup_steps: int = 0) -> optuna.pruners.BasePruner:
    """Optuna pruner by name: ``"median"``, ``"halving"`` (successive halving) or ``"none"``.

    ``warmup_steps`` (steps) keeps the median pruner from judging a trial before it has trained.
    """
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=warmup_steps)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource="auto", reduction_factor=3)
    if name == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"unknown pruner {name!r}; choose one of {', '.join(PRUNERS)}")


def sampler_seed(seed: int, number: int) -> int:
    """Seed of the sampler that draws trial ``number`` of a study seeded with ``seed``."""
    return (seed * 1_000_003 + zlib.crc32(f"trial-{number}".encode())) % (2**31 - 1)


