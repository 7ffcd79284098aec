"""The search's memory: an Optuna study in an RDB storage, driven through ask-and-tell.

The engine never calls Optuna directly; it talks to a `TrialSource` ("give me the next
configuration", "this trial reached step s with value v", "this trial ended like this"). The
Optuna-backed `OptunaTrialSource` is the local implementation; a remote proxy that forwards the
same three calls to the rank that owns the study can stand in for it unchanged.

Resuming: the study lives in ``sqlite:///<study_dir>/study.db`` unless another SQLAlchemy URL is
given, so running the same command again loads it. ``n_trials`` is the study's total: trials
already finished (complete, pruned or failed for a reason of their own) count towards it. A trial
left ``RUNNING`` by a killed process is marked failed with reason ``"interrupted"`` and its
parameters are enqueued again under the same checkpoint key, so the re-run resumes it from its
last checkpoint instead of starting over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import TrialState

from scamp_jax.space import SearchSpace

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "halving", "none")

#: user attribute naming the checkpoint directory a trial writes to (shared by its re-runs).
CHECKPOINT_KEY = "checkpoint_key"
#: user attribute holding why a trial failed.
FAIL_REASON = "fail_reason"
#: fail reason of a trial whose process was stopped before it finished (it is re-enqueued).
INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class AskedTrial:
    """One configuration to evaluate.

    Attributes:
      number: the study's trial number.
      params: the configuration (model and training hyperparameters), as ``space.suggest`` made it.
      checkpoint_key: name of the trial's checkpoint directory; a re-run of an interrupted trial
        keeps its predecessor's key so it resumes from the same checkpoints.
    """

    number: int
    params: Mapping[str, Any]
    checkpoint_key: str


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended, as the study is told.

    Attributes:
      number: the study's trial number.
      state: ``"complete"``, ``"pruned"`` or ``"failed"``.
      value: the objective (the task's metric) for a complete trial, else ``None``.
      reason: why a trial failed or was pruned (empty for a complete one).
      attrs: extra JSON-serialisable facts to store with the trial (devices, batch size, ...).
    """

    number: int
    state: str
    value: float | None = None
    reason: str = ""
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in ("complete", "pruned", "failed"):
            raise ValueError(
                f"state={self.state!r} is not a trial outcome; use 'complete', 'pruned' or 'failed'"
            )
        if self.state == "complete" and self.value is None:
            raise ValueError(f"trial {self.number} is complete but has no value; pass value=")


class TrialSource(Protocol):
    """Where configurations come from and where results go (local study or a remote proxy)."""

    def remaining(self) -> int:
        """Trials still to be asked before the study reaches its total."""
        ...

    def ask(self) -> AskedTrial | None:
        """Next configuration, or ``None`` when the study has all the trials it needs."""
        ...

    def report(self, number: int, step: int, value: float) -> bool:
        """Record an intermediate objective value; return True if the trial should be pruned."""
        ...

    def tell(self, outcome: TrialOutcome) -> None:
        """Record how a trial ended."""
        ...

    def interrupt(self, number: int) -> None:
        """Mark a started trial as interrupted and queue its configuration to run again."""
        ...


def storage_url(study_dir: str | Path, storage: str | None = None) -> str:
    """SQLAlchemy URL of the study: ``storage`` if given, else an SQLite file in ``study_dir``."""
    if storage:
        return storage
    path = Path(study_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / 'study.db'}"


def make_sampler(
    name: str, seed: int, grid: Mapping[str, Sequence[Any]] | None = None
) -> optuna.samplers.BaseSampler:
    """Seeded Optuna sampler by name: ``"tpe"`` (default), ``"random"`` or ``"grid"``."""
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        if not grid:
            raise ValueError(
                "sampler='grid' needs the search space's grid of values; this space defines none, "
                "use sampler='tpe' or 'random'"
            )
        return optuna.samplers.GridSampler({k: list(v) for k, v in grid.items()}, seed=seed)
    raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")


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


def _rdb_storage(url: str, attempts: int = 5) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage at ``url``, tolerating another process creating the same schema.

    Two processes opening a new SQLite file at once (MPI ranks, a resumed run and a monitoring
    script) race to create its tables; the loser sees "table ... already exists". The schema is
    complete once the winner commits, so opening again succeeds.
    """
    from sqlalchemy.exc import OperationalError

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url)
        except OperationalError as err:
            if "already exists" not in str(err) or attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def open_study(
    study_name: str,
    *,
    study_dir: str | Path,
    storage: str | None = None,
    direction: str = "maximize",
    sampler: str = "tpe",
    pruner: str = "median",
    seed: int = 0,
    grid: Mapping[str, Sequence[Any]] | None = None,
    warmup_steps: int = 0,
) -> optuna.Study:
    """Create the study, or load it if ``study_name`` already exists in the storage.

    Raises ``ValueError`` if an existing study was created with another direction.
    """
    if direction not in ("maximize", "minimize"):
        raise ValueError(f"direction={direction!r} must be 'maximize' or 'minimize'")
    study = optuna.create_study(
        storage=_rdb_storage(storage_url(study_dir, storage)),
        study_name=study_name,
        direction="maximize" if direction == "maximize" else "minimize",
        sampler=make_sampler(sampler, seed, grid),
        pruner=make_pruner(pruner, warmup_steps=warmup_steps),
        load_if_exists=True,
    )
    if study.direction.name.lower() != direction:
        raise ValueError(
            f"study {study_name!r} in the storage was created to {study.direction.name.lower()} "
            f"its objective, not to {direction}; use another --study-dir or --storage"
        )
    return study


def _counts_towards_total(trial: optuna.trial.FrozenTrial) -> bool:
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and trial.user_attrs.get(FAIL_REASON) != INTERRUPTED


class OptunaTrialSource:
    """`TrialSource` over a local Optuna study; safe to call from several threads.

    Args:
      study: the study (see `open_study`).
      space: the search space whose ``suggest`` draws configurations.
      n_trials: the study's total number of trials (finished ones from earlier runs count).
    """

    def __init__(self, study: optuna.Study, space: SearchSpace, n_trials: int) -> None:
        if n_trials < 1:
            raise ValueError(f"{n_trials=} must be at least 1")
        self.study = study
        self.space = space
        self.n_trials = n_trials
        # Optuna's RDB storage is thread-safe, but the sampler's state (TPE's RNG) is not.
        self._lock = threading.Lock()
        self._live: dict[int, optuna.Trial] = {}
        self.recovered = self._recover_interrupted()

    def _recover_interrupted(self) -> list[int]:
        """Fail trials left RUNNING by a killed process and enqueue their parameters again."""
        recovered = []
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            key = trial.user_attrs.get(CHECKPOINT_KEY, f"trial_{trial.number}")
            self.study._storage.set_trial_user_attr(trial._trial_id, FAIL_REASON, INTERRUPTED)
            self.study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
            if trial.params:
                self.study.enqueue_trial(dict(trial.params), user_attrs={CHECKPOINT_KEY: key})
            recovered.append(trial.number)
        return recovered

    def finished(self) -> int:
        """Trials that count towards the total (complete, pruned, failed but not interrupted)."""
        return sum(_counts_towards_total(t) for t in self.study.get_trials(deepcopy=False))

    def remaining(self) -> int:
        """Trials still to ask: the total minus finished and currently running ones."""
        with self._lock:
            return max(0, self.n_trials - self.finished() - len(self._live))

    def ask(self) -> AskedTrial | None:
        """Next configuration (an enqueued re-run first), or ``None`` once the total is reached."""
        with self._lock:
            if self.n_trials - self.finished() - len(self._live) <= 0:
                return None
            trial = self.study.ask()
            params = self.space.suggest(trial)
            key = trial.user_attrs.get(CHECKPOINT_KEY)
            if key is None:
                key = f"trial_{trial.number}"
                trial.set_user_attr(CHECKPOINT_KEY, key)
            self._live[trial.number] = trial
            return AskedTrial(trial.number, dict(params), key)

    def report(self, number: int, step: int, value: float) -> bool:
        """Record ``value`` at ``step`` for trial ``number``; True if the pruner stops it."""
        with self._lock:
            trial = self._live[number]
            trial.report(float(value), step)
            return trial.should_prune()

    def tell(self, outcome: TrialOutcome) -> None:
        """Store the outcome (state, value, reason, attributes) of a live trial."""
        with self._lock:
            trial = self._live.pop(outcome.number)
            for key, value in outcome.attrs.items():
                trial.set_user_attr(key, value)
            if outcome.reason:
                trial.set_user_attr(FAIL_REASON, outcome.reason)
            state = {
                "complete": TrialState.COMPLETE,
                "pruned": TrialState.PRUNED,
                "failed": TrialState.FAIL,
            }[outcome.state]
            value = outcome.value if outcome.state == "complete" else None
            self.study.tell(trial, value, state=state)

    def interrupt(self, number: int) -> None:
        """Fail a live trial as interrupted and enqueue its parameters under its checkpoint key."""
        with self._lock:
            trial = self._live.pop(number, None)
            if trial is None:
                return
            key = trial.user_attrs.get(CHECKPOINT_KEY, f"trial_{number}")
            trial.set_user_attr(FAIL_REASON, INTERRUPTED)
            self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            self.study.enqueue_trial(dict(trial.params), user_attrs={CHECKPOINT_KEY: key})
