"""The search's memory: an Optuna study in an RDB storage, driven through ask-and-tell.

The engine never calls Optuna directly; it talks to a `TrialSource` ("give me the next
configuration", "this trial reached step s with value v", "this trial ended like this"). The
Optuna-backed `OptunaTrialSource` is the local implementation; a remote proxy that forwards the
same three calls to the rank that owns the study can stand in for it unchanged.

Resuming: the study lives in ``sqlite:///<study_dir>/study.db`` unless another SQLAlchemy URL is
given, so running the same command again loads it. ``n_trials`` is the study's total: trials
already finished (complete, pruned or failed for a reason of their own) and trials running in any
process count towards it, so any number of processes (and hosts sharing a database URL) work on
one study together and finish exactly ``n_trials``; a cross-process ask lock (`AskLock`) keeps two
processes from taking the same last slot.

Liveness is Optuna's own: the storage has a heartbeat (`open_storage`), every live trial beats,
and a trial whose process died stops beating. After the grace period any process of the study
fails it and Optuna's `RetryHeartbeatStaleTrialCallback` queues a copy with the same parameters;
the copy is mapped to its original's checkpoint directory (``retried_trial_number``), so it resumes
from the last checkpoint. Trials of live processes are never touched. While trials of other
processes run, ``ask`` answers `AskLater` rather than ``None`` once the total is reached: they may
still go stale and need a retry, so a process finishes only when no other process's trial is
running. A trial stopped on purpose (Ctrl-C, SIGTERM) is failed as ``"interrupted"`` by its own
process and queued the same way.

Sampling does not replay: TPE and random search draw each trial with a sampler seeded from the
study's seed and the trial's number (`TrialSeededSampler`), so extending a finished study draws new
configurations. A grid keeps one seed (its order of points) and covers every point before any
repeat: once each point is running or finished the source asks nothing new, and the study ends
short of ``n_trials`` (`OptunaTrialSource.grid_done`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from scamp_jax.hpo.settings import GRACE_PERIOD, HEARTBEAT_INTERVAL, PRUNERS, SAMPLERS
from scamp_jax.space import SearchSpace

#: user attribute naming the checkpoint directory a trial writes to (shared by its re-runs).
CHECKPOINT_KEY = "checkpoint_key"
#: user attribute holding why a trial failed.
FAIL_REASON = "fail_reason"
#: fail reason of a trial whose process was stopped before it finished (it is re-enqueued).
INTERRUPTED = "interrupted"
#: user attribute of a trial enqueued to share another trial's architecture: that trial's number.
SIBLING_OF = "fusion_sibling_of"
#: study user attribute holding the settings the study was created with (see `open_study`).
SETTINGS_KEY = "settings"


class StudySettingsError(ValueError):
    """An existing study was created with other settings than this run asks for."""


@dataclass(frozen=True)
class AskedTrial:
    """One configuration to evaluate.

    Attributes:
      number: the study's trial number.
      params: the configuration (model and training hyperparameters), as ``space.suggest`` made it.
      checkpoint_key: name of the trial's checkpoint directory; a re-run of an interrupted trial
        keeps its predecessor's key so it resumes from the same checkpoints.
      siblings: trials enqueued right after this one with its architecture fixed (fusion; see
        `OptunaTrialSource`'s ``siblings``); 0 for any other trial.
      sibling_of: number of the trial whose architecture this one was enqueued to share
        (None: the sampler or a user chose it).
    """

    number: int
    params: Mapping[str, Any]
    checkpoint_key: str
    siblings: int = 0
    sibling_of: int | None = None


@dataclass(frozen=True)
class AskLater:
    """`TrialSource.ask`'s answer "nothing to hand out now, ask again in ``seconds``".

    The study has reached its total, but trials of other processes are still running: one whose
    process died goes stale after the grace period and its retry must be asked then. ``None``,
    by contrast, means the study needs nothing more from the asker.
    """

    seconds: float
    #: numbers of the other processes' running trials it waits for (to tell the user).
    trials: tuple[int, ...] = ()


def when_full(foreign_running: Sequence[int], has_liveness: bool,
              poll_seconds: float) -> AskLater | None:
    """The answer of an ask that found nothing to hand out.

    ``foreign_running``: numbers of the trials ``RUNNING`` in the storage that the asking source
    did not hand out (other processes', or a dead job's whose heartbeat is not stale yet). With a
    heartbeat each of them either finishes or goes stale and is retried, so the asker is told to
    ask again in ``poll_seconds``; without one (or with none running) the study is done for it.
    The source's own running trials do not matter: it tells them itself.
    """
    if foreign_running and has_liveness:
        return AskLater(poll_seconds, tuple(sorted(foreign_running)))
    return None


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

    def ask(self) -> AskedTrial | AskLater | None:
        """Next configuration; `AskLater` when there is none now but the study may still need
        one (ask again after its ``seconds``); ``None`` when the study needs nothing more."""
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


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Silence Optuna's notes about its heartbeat API (experimental; meant for ``optimize``).

    Ask-and-tell with a heartbeat is supported by the storage; the warnings only say that
    ``Study.optimize`` would beat the heart itself, which `OptunaTrialSource` does instead.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed",
                                category=UserWarning)
        yield


def _retry_callback() -> optuna.storages.RetryHeartbeatStaleTrialCallback:
    with _quiet_optuna():
        return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None)


def retried_from(trial: FrozenTrial) -> int | None:
    """Number of the original trial that ``trial`` retries (None: not a retry)."""
    with _quiet_optuna():
        return optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)


def open_storage(
    study_dir: str | Path,
    storage: str | None = None,
    *,
    heartbeat_interval: int = HEARTBEAT_INTERVAL,
    grace_period: int = GRACE_PERIOD,
    attempts: int = 5,
) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage of the study, with a heartbeat that retries dead processes' trials.

    ``heartbeat_interval`` and ``grace_period`` are seconds (Optuna takes whole seconds). Two
    processes opening a new database at once race to create its tables; the loser sees "already
    exists" (or a duplicate key) and opens it again once the winner has committed.
    """
    from sqlalchemy.exc import DBAPIError

    if heartbeat_interval < 1 or grace_period <= heartbeat_interval:
        raise ValueError(
            f"{heartbeat_interval=} s must be at least 1 and {grace_period=} s longer than it"
        )
    url = storage_url(study_dir, storage)
    for attempt in range(attempts):
        try:
            with _quiet_optuna():
                return optuna.storages.RDBStorage(
                    url, heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                    heartbeat_stale_trial_callback=_retry_callback(),
                )
        except DBAPIError as err:  # SQLite: "already exists" or the schema version stamped
            # twice ("UNIQUE constraint failed"); PostgreSQL: a duplicate type or key
            racing = any(mark in str(err) for mark in (
                "already exists", "duplicate key", "UNIQUE constraint failed"))
            if not racing or attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def make_sampler(
    name: str, seed: int, grid: Mapping[str, Sequence[Any]] | None = None
) -> optuna.samplers.BaseSampler:
    """Seeded Optuna sampler by name: ``"tpe"`` (default), ``"random"`` or ``"grid"``.

    TPE and random search draw each trial with a sampler seeded from ``seed`` and the trial's
    number (`TrialSeededSampler`), so a resumed or extended study draws new configurations
    instead of replaying the first ones. The grid keeps one seed: its shuffled order must stay
    the same for every trial, or two trials could map to one point (`GridSearch`).
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
    """A sampler made afresh for every trial, seeded from the study's seed and trial number.

    Trial ``n``'s draws depend only on the seed, ``n`` and the study's history, not on how many
    trials this process asked before: a rerun that extends a finished study, or a second process
    on it, draws new configurations rather than the ones a fresh sampler with the same seed drew
    first. Thread-safe: each live trial has its own sampler.

    Args:
      make: ``make(seed) -> sampler`` (e.g. ``lambda s: optuna.samplers.TPESampler(seed=s)``).
      seed: the study's seed.
    """

    def __init__(self, make: Callable[[int], optuna.samplers.BaseSampler], seed: int) -> None:
        self._make, self._seed = make, int(seed)
        self._samplers: dict[int, optuna.samplers.BaseSampler] = {}
        self._lock = threading.Lock()

    def _of(self, trial: FrozenTrial) -> optuna.samplers.BaseSampler:
        with self._lock:
            sampler = self._samplers.get(trial.number)
            if sampler is None:
                sampler = self._samplers[trial.number] = self._make(
                    sampler_seed(self._seed, trial.number))
            return sampler

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, Any]:
        return self._of(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, Any]) -> dict[str, Any]:
        return self._of(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: Any) -> Any:
        return self._of(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._of(trial).before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        sampler = self._of(trial)
        with self._lock:
            self._samplers.pop(trial.number, None)
        sampler.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        """Nothing to do: every trial's sampler is seeded from its number."""


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


@dataclass(frozen=True)
class _Opened:
    """What `open_study` knows about a study that `OptunaTrialSource` needs."""

    storage: optuna.storages.RDBStorage
    ask_lock: AskLock


#: studies opened by `open_study` -> their storage, per-trial sampler and ask lock.
_OPENED: weakref.WeakKeyDictionary[optuna.Study, _Opened] = weakref.WeakKeyDictionary()


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
    settings: Mapping[str, Any] | None = None,
    heartbeat_interval: int = HEARTBEAT_INTERVAL,
    grace_period: int = GRACE_PERIOD,
) -> optuna.Study:
    """Create the study, or load it if ``study_name`` already exists in the storage.

    ``settings`` (JSON-serialisable, e.g. space, preset, steps, seed, budget) are stored with a
    new study; loading a study created with other values raises `StudySettingsError` naming
    each difference. ``heartbeat_interval`` and ``grace_period`` (seconds) set its liveness
    (see the module doc). Raises ``ValueError`` if the study was created with another direction.
    """
    if direction not in ("maximize", "minimize"):
        raise ValueError(f"direction={direction!r} must be 'maximize' or 'minimize'")
    url = storage_url(study_dir, storage)
    rdb = open_storage(study_dir, url, heartbeat_interval=heartbeat_interval,
                       grace_period=grace_period)
    study = optuna.create_study(
        storage=rdb,
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
    if settings is not None:
        _check_settings(study, settings)
    _OPENED[study] = _Opened(rdb, AskLock(url, study_name))
    return study


def _check_settings(study: optuna.Study, settings: Mapping[str, Any]) -> None:
    """Store ``settings`` with a new study; refuse other values for an existing one."""
    wanted = json.loads(json.dumps(dict(settings)))
    stored = study.user_attrs.get(SETTINGS_KEY)
    if stored is None:
        study.set_user_attr(SETTINGS_KEY, wanted)
        return
    differ = [k for k in sorted(set(stored) | set(wanted)) if stored.get(k) != wanted.get(k)]
    if differ:
        was = ", ".join(f"{_flag(k)} {stored.get(k)}" for k in differ)
        now = ", ".join(f"{_flag(k)} {wanted.get(k)}" for k in differ)
        raise StudySettingsError(
            f"study {study.study_name!r} was created with {was}, this run asks for {now}; "
            f"rerun with {was}, or pass --study-name {study.study_name}-2 to start a new study"
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class AskLock:
    """A lock shared by every process that asks trials of one study in one database.

    Counting the study's trials and asking the next one must be one step across processes, or
    two processes could both take the last slot. SQLite (one host): an exclusive ``flock`` on
    ``<database>.lock``. PostgreSQL: a session advisory lock; MySQL: ``GET_LOCK``. Other
    databases: no lock (two processes may then ask one trial more than the total).

    Args:
      url: the study's SQLAlchemy URL.
      study_name: the study (the lock is per study).
    """

    def __init__(self, url: str, study_name: str) -> None:
        from sqlalchemy.engine import make_url

        self.url, self.study_name = url, study_name
        parsed = make_url(url)
        self.backend = parsed.get_backend_name()
        self._path: Path | None = None
        self._engine: Any = None
        if self.backend == "sqlite" and parsed.database not in (None, "", ":memory:"):
            self._path = Path(f"{parsed.database}.lock")
        elif self.backend in ("postgresql", "mysql"):
            import sqlalchemy

            self._engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        self._key = zlib.crc32(study_name.encode()) & 0x7FFFFFFF

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """Hold the lock for the ``with`` block."""
        if self._path is not None:
            import fcntl

            with open(self._path, "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)
            return
        if self._engine is None:
            yield
            return
        from sqlalchemy import text

        lock, unlock = {
            "postgresql": ("SELECT pg_advisory_lock(:k)", "SELECT pg_advisory_unlock(:k)"),
            "mysql": ("SELECT GET_LOCK(:k, -1)", "SELECT RELEASE_LOCK(:k)"),
        }[self.backend]
        key: Any = self._key if self.backend == "postgresql" else f"scamp-{self._key}"
        with self._engine.connect() as conn:
            conn.execute(text(lock), {"k": key})
            try:
                yield
            finally:
                conn.execute(text(unlock), {"k": key})
                conn.commit()


def _counts_towards_total(trial: FrozenTrial) -> bool:
    """Finished for good: complete, pruned, or failed for a reason of its own.

    A trial failed as interrupted (its process was stopped) or by the heartbeat (its process
    died; no reason recorded) does not count: a retry with its parameters takes its place.
    """
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    reason = trial.user_attrs.get(FAIL_REASON)
    return trial.state == TrialState.FAIL and bool(reason) and reason != INTERRUPTED


def _relative(path: str, root: Path) -> str:
    """``path`` relative to ``root`` if it lies inside it, else unchanged."""
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return path


class OptunaTrialSource:
    """`TrialSource` over an Optuna study; safe to call from several threads and processes.

    Any number of sources (in one process or many, on hosts sharing the database) may work on
    one study: a source asks a trial only while finished plus running trials of all processes
    are fewer than ``n_trials``. While other processes' trials run (whether or not this source
    has trials of its own running), a study with a heartbeat answers `AskLater` (ask again in
    ``poll_seconds``) until they finish or their heartbeat goes stale, then hands out the
    retries of the dead ones; ``ask`` itself never waits. Studies opened by `open_study` get
    liveness, per-trial sampler seeds and the cross-process ask lock; any other study is used as
    it is.

    Args:
      study: the study (see `open_study`).
      space: the search space whose ``suggest`` draws configurations.
      n_trials: the study's total number of trials (finished ones from earlier runs count).
      poll_seconds: seconds an `AskLater` answer asks the caller to wait before asking again.
      root: the study's directory; a told ``checkpoint`` attribute under it is stored relative
        to it, so a copied study folder still finds its checkpoints.
      recover_running: fail every trial left ``RUNNING`` now and queue it again, without
        waiting for its heartbeat to go stale: only for a process that owns the study alone
        (e.g. one MPI job whose ranks die together), or a study without a heartbeat.
      siblings: after the sampler proposes a trial, enqueue up to this many *siblings*: trials
        with its architecture fixed (every parameter but ``training_keys``) and the training
        hyperparameters left to the sampler (``study.enqueue_trial`` with partial parameters),
        so that an engine can fuse them (`scamp_jax.planning.fusion`). Siblings never take the study
        past ``n_trials``: only as many are enqueued as there are free slots (not counting
        trials already waiting). 0: none.
      training_keys: parameters siblings leave to the sampler (e.g. the learning rate).

    Raises:
      ValueError: ``n_trials`` below 1, ``siblings`` below 0, or siblings on a study not opened
        by `open_study` (they are claimed through its storage).
    """

    def __init__(self, study: optuna.Study, space: SearchSpace, n_trials: int, *,
                 poll_seconds: float = 1.0, root: str | Path | None = None,
                 recover_running: bool = False, siblings: int = 0,
                 training_keys: Sequence[str] = ()) -> None:
        if n_trials < 1:
            raise ValueError(f"{n_trials=} must be at least 1")
        if siblings < 0:
            raise ValueError(f"{siblings=} must be >= 0 (trials enqueued per proposal)")
        self.siblings = int(siblings)
        self.training_keys = frozenset(training_keys)
        self.study = study
        self.space = space
        self.n_trials = n_trials
        self.poll_seconds = poll_seconds
        self.root = None if root is None else Path(root).resolve()
        opened = _OPENED.get(study)
        self._storage = opened.storage if opened else None
        self._ask_lock: Callable[[], contextlib.AbstractContextManager[Any]] = (
            opened.ask_lock if opened else contextlib.nullcontext)
        if self.siblings and self._storage is None:
            raise ValueError(
                f"siblings={self.siblings} (fused groups) need a study opened by "
                "scamp_jax.hpo.study.open_study, whose storage claims each rank's siblings; "
                "open the study with open_study(...) or use siblings=0")
        self._study_id = (self._storage.get_study_id_from_name(study.study_name)
                          if self._storage else None)
        # Optuna's RDB storage is thread-safe, but the sampler's state (TPE's RNG) is not.
        self._lock = threading.Lock()
        self._live: dict[int, optuna.Trial] = {}
        self._ids: dict[int, int] = {}  # live trial number -> storage trial id (heartbeats)
        #: trials of dead processes this source failed and queued again (numbers).
        self.recovered: list[int] = []
        #: live trials another process failed as stale (their results were dropped).
        self.lost: list[int] = []
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        with self._lock:
            if recover_running:
                self._recover_running()
            self._fail_stale()

    @property
    def has_liveness(self) -> bool:
        """Whether the study's storage has a heartbeat (opened by `open_study`)."""
        return self._storage is not None

    # -- liveness -------------------------------------------------------------------------------
    def _fail_stale(self) -> None:
        """Fail trials whose heartbeat went stale; Optuna's callback queues their retries."""
        if self._storage is None:
            return
        before = {t.number for t in self.study.get_trials(deepcopy=False,
                                                          states=(TrialState.RUNNING,))}
        with _quiet_optuna():
            optuna.storages.fail_stale_trials(self.study)
        after = {t.number for t in self.study.get_trials(deepcopy=False,
                                                         states=(TrialState.RUNNING,))}
        self.recovered.extend(sorted(before - after - set(self._live)))

    def _recover_running(self) -> None:
        """Fail every ``RUNNING`` trial (public ``tell``) and queue a retry of each."""
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            try:
                frozen = self.study.tell(trial.number, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # finished meanwhile by its own process
            with _quiet_optuna():
                _retry_callback()(self.study, frozen)
            self.recovered.append(trial.number)

    def _beat_hearts(self) -> None:
        assert self._storage is not None
        interval = self._storage.get_heartbeat_interval() or HEARTBEAT_INTERVAL
        while not self._stop.wait(interval):
            for trial_id in list(self._ids.values()):
                with contextlib.suppress(Exception):  # a missed beat is retried next interval
                    self._storage.record_heartbeat(trial_id)

    def _start_heartbeat(self, number: int) -> None:
        if self._storage is None or self._study_id is None:
            return
        trial_id = self._storage.get_trial_id_from_study_id_trial_number(self._study_id, number)
        self._storage.record_heartbeat(trial_id)  # at once: a trial with no beat never goes stale
        self._ids[number] = trial_id
        if self._beat is None:
            self._beat = threading.Thread(target=self._beat_hearts, name="study-heartbeat",
                                          daemon=True)
            self._beat.start()

    def close(self) -> None:
        """Stop the heartbeat thread (live trials then go stale after the grace period)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()

    def is_live(self, number: int) -> bool:
        """Whether trial ``number`` was asked here and not yet told."""
        return number in self._live

    def live_numbers(self) -> list[int]:
        """Numbers of the trials asked here and not yet told."""
        return sorted(self._live)

    # -- counting -------------------------------------------------------------------------------
    def _counts(self) -> tuple[int, int]:
        trials = self.study.get_trials(deepcopy=False)
        finished = sum(_counts_towards_total(t) for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        return finished, running

    def finished(self) -> int:
        """Trials that count towards the total (complete, pruned, failed for their own reason)."""
        return self._counts()[0]

    def remaining(self) -> int:
        """Trials still to ask: the total minus finished and running ones (of every process)."""
        with self._lock:
            finished, running = self._counts()
            return max(0, self.n_trials - finished - running)

    @property
    def grid_points(self) -> int | None:
        """Points of the study's grid (None: the sampler is not a grid)."""
        if not isinstance(self.study.sampler, optuna.samplers.GridSampler) or not self.space.grid:
            return None
        return math.prod(len(values) for values in self.space.grid.values())

    def grid_done(self) -> bool:
        """Whether the study's grid has no point left for a new trial: every point is running
        or finished and no trial waits (a queued retry still runs). False for other samplers."""
        if self.grid_points is None:
            return False
        trials = self.study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials):
            return False
        keys = sorted(self.space.grid)
        taken = {tuple(t.params.get(k) for k in keys) for t in trials}
        return all(point in taken
                   for point in itertools.product(*(self.space.grid[k] for k in keys)))

    # -- ask-and-tell ---------------------------------------------------------------------------
    def ask(self, attrs: Mapping[str, Any] | None = None, *,
            choose: Callable[[list[FrozenTrial]], list[FrozenTrial]] | None = None,
            ) -> AskedTrial | AskLater | None:
        """Next configuration (a queued retry first); `AskLater` or ``None`` once the total is
        reached (`when_full`).

        ``attrs`` (JSON-serialisable) are stored with the trial. While trials this source did not
        hand out are running, a study with a heartbeat answers `AskLater`: they may finish, or go
        stale (their retries are then asked). ``None``: every other trial is finished.

        ``choose`` (None: Optuna's queue order) gets the study's waiting trials and returns those
        this ask may take, the preferred first; the others are held for later asks (e.g. another
        rank's siblings) and count as taken, so a new proposal never takes the study past
        ``n_trials``.
        """
        with self._lock:
            trial = None
            with self._ask_lock():
                self._fail_stale()
                finished, running = self._counts()
                # A grid whose every point is running or finished has nothing new to give.
                if self.grid_done():
                    trial = None
                elif choose is not None:
                    trial = self._ask_chosen(choose, finished + running)
                elif finished + running < self.n_trials:
                    with _quiet_optuna():
                        trial = self.study.ask()
                if trial is None:
                    foreign = [t.number for t in self.study.get_trials(
                        deepcopy=False, states=(TrialState.RUNNING,)) if t.number not in self._live]
                    return when_full(foreign, self.has_liveness, self.poll_seconds)
                self._start_heartbeat(trial.number)
                # Free slots for siblings: not this trial, nor trials already waiting.
                room = self.n_trials - finished - running - 1 - self._waiting()
                # Suggest under the lock: another process counting the grid's points taken
                # sees this trial's parameters.
                asked = self._suggest(trial, attrs or {})
            if self.siblings and room > 0 and self._proposed(trial):
                asked = self._enqueue_siblings(asked, min(self.siblings, room))
            return asked

    def _ask_chosen(self, choose: Callable[[list[FrozenTrial]], list[FrozenTrial]],
                    taken: int) -> optuna.Trial | None:
        """`ask` with ``choose``: the first waiting trial it allows, else a new trial, while
        ``taken`` (finished and running) plus the waiting trials it holds back leave a slot."""
        storage, study_id = self._storage, self._study_id
        if storage is None or study_id is None:
            raise ValueError("ask(choose=...) claims waiting trials through the storage of a "
                             "study opened by scamp_jax.hpo.study.open_study; open the study "
                             "with open_study(...) or ask without choose")
        while True:
            waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            allowed = choose(list(waiting))
            if taken + len(waiting) - len(allowed) >= self.n_trials:
                return None
            if not allowed:
                return self._open_trial(storage.create_new_trial(study_id))
            for frozen in allowed:
                try:  # the claim of Optuna's own queue pop (another process may win it)
                    trial_id = storage.get_trial_id_from_study_id_trial_number(
                        study_id, frozen.number)
                    if storage.set_trial_state_values(trial_id, state=TrialState.RUNNING):
                        return self._open_trial(trial_id)
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue
            taken = sum(self._counts())  # all claimed elsewhere meanwhile: look again

    def _open_trial(self, trial_id: int) -> optuna.Trial:
        """The running trial ``trial_id`` as `optuna.Study.ask` returns it."""
        with contextlib.suppress(AttributeError):  # as Study.ask: read the storage afresh
            self.study._thread_local.cached_all_trials = None
        with _quiet_optuna():
            return optuna.Trial(self.study, trial_id)

    def _suggest(self, trial: optuna.Trial, attrs: Mapping[str, Any]) -> AskedTrial:
        params = self.space.suggest(trial)  # first: a trial killed before it has no params
        for name, value in attrs.items():
            trial.set_user_attr(name, value)
        key = trial.user_attrs.get(CHECKPOINT_KEY)
        if key is None:
            origin = None
            if self._storage is not None and trial.number in self._ids:
                origin = retried_from(self._storage.get_trial(self._ids[trial.number]))
            key = f"trial_{trial.number if origin is None else origin}"
            trial.set_user_attr(CHECKPOINT_KEY, key)
        self._live[trial.number] = trial
        sibling_of = trial.user_attrs.get(SIBLING_OF)
        return AskedTrial(trial.number, dict(params), key,
                          sibling_of=None if sibling_of is None else int(sibling_of))

    def _waiting(self) -> int:
        return len(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _proposed(self, trial: optuna.Trial) -> bool:
        """Whether the sampler proposed ``trial`` (not enqueued, not a retry)."""
        storage, study_id = self._storage, self._study_id
        assert storage is not None and study_id is not None  # siblings need open_study
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        system = storage.get_trial(trial_id).system_attrs
        return not system.get("fixed_params") and "failed_trial" not in system

    def _enqueue_siblings(self, asked: AskedTrial, count: int) -> AskedTrial:
        """Enqueue ``count`` trials with ``asked``'s architecture; the training
        hyperparameters are left to the sampler."""
        fixed = {k: v for k, v in asked.params.items() if k not in self.training_keys}
        for _ in range(count):
            # skip_if_exists=False: siblings share their (partial) parameters on purpose.
            self.study.enqueue_trial(fixed, user_attrs={SIBLING_OF: asked.number},
                                     skip_if_exists=False)
        return AskedTrial(asked.number, asked.params, asked.checkpoint_key, siblings=count)

    def report(self, number: int, step: int, value: float) -> bool:
        """Record ``value`` at ``step`` for trial ``number``; True if the pruner stops it.

        Also True when another process failed the trial as stale (its retry runs elsewhere).
        """
        with self._lock:
            trial = self._live[number]
            try:
                trial.report(float(value), step)
            except optuna.exceptions.UpdateFinishedTrialError:
                return True
            return trial.should_prune()

    def tell(self, outcome: TrialOutcome) -> None:
        """Store the outcome (state, value, reason, attributes) of a live trial."""
        with self._lock:
            trial = self._live.pop(outcome.number)
            self._ids.pop(outcome.number, None)
            try:
                for key, value in outcome.attrs.items():
                    if key == "checkpoint" and value and self.root is not None:
                        value = _relative(value, self.root)
                    trial.set_user_attr(key, value)
                reason = outcome.reason or ("failed" if outcome.state == "failed" else "")
                if reason or trial.user_attrs.get(FAIL_REASON):
                    trial.set_user_attr(FAIL_REASON, reason)
                state = {
                    "complete": TrialState.COMPLETE,
                    "pruned": TrialState.PRUNED,
                    "failed": TrialState.FAIL,
                }[outcome.state]
                value = outcome.value if outcome.state == "complete" else None
                self.study.tell(trial, value, state=state)
            except optuna.exceptions.UpdateFinishedTrialError:
                self.lost.append(outcome.number)  # failed as stale; its retry owns the slot

    def interrupt(self, number: int) -> None:
        """Fail a live trial as interrupted and queue its parameters under its checkpoint key."""
        with self._lock:
            trial = self._live.pop(number, None)
            self._ids.pop(number, None)
            if trial is None:
                return
            try:
                trial.set_user_attr(FAIL_REASON, INTERRUPTED)
                frozen = self.study.tell(trial, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                return  # failed as stale by another process, which queued it again
            with _quiet_optuna():
                _retry_callback()(self.study, frozen)
