"""Where a study lives: its RDB storage with Optuna's heartbeat, opening a study (a
`StudyHandle`), the settings a study keeps, and the lock that makes asking one step across
processes."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from scamp_jax.hpo.settings import GRACE_PERIOD, HEARTBEAT_INTERVAL
from scamp_jax.hpo.study.owner import OWNER
from scamp_jax.hpo.study.samplers import make_pruner, make_sampler
from scamp_jax.hpo.study.trials import HELD_SIBLINGS

#: study user attribute holding the settings the study was created with (see `open_study`).
SETTINGS_KEY = "settings"
#: study user attribute holding the name of the score its trials' values are (`open_study`).
METRIC_KEY = "metric"


class StudySettingsError(ValueError):
    """An existing study was created with other settings than this run asks for.

    ``study_name``; ``stored`` and ``wanted``: the differing settings, as the study has them
    and as this run asks. The message names them as keywords (``steps=150``);
    `as_command_line` as the experiments' flags (``--steps 150``). ``message``: the whole
    message instead, for a setting the task decides rather than a keyword or flag (the
    study's direction, its metric).
    """

    def __init__(self, study_name: str, stored: Mapping[str, Any], wanted: Mapping[str, Any],
                 message: str | None = None, new_name: str | None = None):
        self.study_name, self.stored, self.wanted = study_name, dict(stored), dict(wanted)
        self.message = message
        self.new_name = new_name or free_study_name(study_name, lambda name: False)
        was = ", ".join(_as_keyword(k, v) for k, v in self.stored.items())
        now = ", ".join(_as_keyword(k, v) for k, v in self.wanted.items())
        super().__init__(message or (
            f"study {study_name!r} was created with {was}, this run asks for {now}; repeat the "
            f"study's settings to resume it, or pass study_name={self.new_name!r} to start "
            "a new study"))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole (MPI ranks, processes)
        return type(self), (self.study_name, self.stored, self.wanted, self.message,
                            self.new_name)

    def as_command_line(self) -> str:
        """The message in the experiments' flags (a setting the study has none of, e.g. no
        image folder: "no --eval-dir", and the rerun is "without --eval-dir"; a memory budget
        in the units the flag takes); ``message`` as it is."""
        if self.message is not None:
            return self.message
        was = ", ".join(_as_flag(k, v) for k, v in self.stored.items())
        now = ", ".join(_as_flag(k, v) for k, v in self.wanted.items())
        again = [_as_flag(k, v) for k, v in self.stored.items()
                 if v is not None and not (k == "space" and "preset" in self.stored)]
        left = [_flag(k) for k, v in self.stored.items() if v is None]
        rerun = " and ".join([f"with {', '.join(again)}"] * bool(again)
                             + [f"without {', '.join(left)}"] * bool(left))
        return (f"study {self.study_name!r} was created with {was}, this run asks for {now}; "
                f"rerun {rerun}, or pass --study-name {self.new_name} to start a new study")


def free_study_name(study_name: str, taken: Callable[[str], bool]) -> str:
    """The name to suggest for a new study beside ``study_name``: the first of
    ``<study_name>-2``, ``-3``, ... that ``taken`` (a study of that name in the storage, a
    folder of its outputs) does not have; after ``name-N`` where ``name`` is taken too (a
    name suggested before), ``name-N+1``, ... (``resnet-50`` alone is no count)."""
    numbered = re.fullmatch(r"(.+)-(\d+)", study_name)
    base, n = ((numbered[1], int(numbered[2]) + 1) if numbered and taken(numbered[1])
               else (study_name, 2))
    while taken(f"{base}-{n}"):
        n += 1
    return f"{base}-{n}"


def storage_url(study_dir: str | Path, storage: str | None = None) -> str:
    """SQLAlchemy URL of the study: ``storage`` if given, else an SQLite file in ``study_dir``."""
    if storage:
        return storage
    path = Path(study_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / 'study.db'}"


STORAGE_EXAMPLE = "sqlite:///runs/study.db or postgresql+psycopg://user@host/db"


def stored_study_names(url: str) -> list[str]:
    """The names of the studies in the storage at ``url``; an SQLite file that does not exist
    holds none and is not made (Optuna's storage would create it)."""
    import optuna
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if (parsed.get_backend_name() == "sqlite" and parsed.database
            and parsed.database != ":memory:" and not Path(parsed.database).exists()):
        return []
    return optuna.get_all_study_names(url)


def check_storage(url: str | None, study_dir: str | Path, *, said: str = "storage",
                  here: bool = True, in_memory: bool = True) -> None:
    """Raise ``ValueError`` if ``url`` (None: ``study_dir``'s ``study.db``) is no usable
    database URL, its driver is not installed, the folder of its SQLite file does not exist
    and is not ``study_dir`` (which the run makes), or the study's SQLite database is damaged;
    connects to no server and creates nothing.

    ``said``: how the message names the URL (``storage``: "storage='...'"; a flag such as
    ``--storage``: "--storage '...'"). ``here=False`` (a command that only plans, perhaps for a
    machine with its own driver and folders): the URL's form only. ``in_memory=False``: also
    refuse an SQLite database in the process's memory, which a rerun cannot resume.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    database = Path(study_dir) / "study.db"
    if url is not None:
        import sqlalchemy

        who = f"{said} {url!r}" if said.startswith("-") else f"{said}={url!r}"
        try:
            parsed = make_url(url)
        except ArgumentError:
            raise ValueError(f"{who} is not a database URL; pass one like {STORAGE_EXAMPLE}"
                             + ("" if said.startswith("-") else ", or none for a study.db in "
                                "study_dir")) from None
        if not here:
            return
        try:
            sqlalchemy.create_engine(parsed)  # loads dialect and driver; connects to nothing
        except NoSuchModuleError:
            raise ValueError(f"{who}: {parsed.drivername!r} is not a supported database; "
                             f"pass a URL like {STORAGE_EXAMPLE}") from None
        except ModuleNotFoundError as err:
            # module -> the package that provides it, where the names differ
            package = {"MySQLdb": "mysqlclient"}.get(err.name or "", err.name)
            extra = ("pip install 'scamp-jax[postgres]'"
                     if (err.name or "").startswith("psycopg") else f"pip install {package}")
            raise ValueError(f"{who} needs the database driver {err.name!r}, which is not "
                             f"installed; {extra}") from None
        except (ArgumentError, TypeError, ValueError) as err:
            raise ValueError(f"{who} is not a usable database URL ({err}); pass one like "
                             f"{STORAGE_EXAMPLE}") from None
        if parsed.get_backend_name() != "sqlite":
            return
        if parsed.database in (None, "", ":memory:"):
            if in_memory:
                return
            raise ValueError(
                f"{who} keeps the study in this process's memory: it is gone when the command "
                "ends, so running it again cannot resume the study; pass a file, "
                f"{STORAGE_EXAMPLE.split(' or ')[0]}, or leave {said} out "
                f"({'--study-dir' if said.startswith('-') else 'study_dir'}/study.db)")
        database = Path(parsed.database)
        # The run makes ``study_dir``: a database file in it needs no folder made beforehand.
        if not database.parent.is_dir() and database.parent.resolve() != Path(study_dir).resolve():
            raise ValueError(f"{who}: the folder {str(database.parent)!r} of its database file "
                             "does not exist; create it, or pass a path in an existing folder")
    problem = sqlite_problem(database) if database.is_file() else None
    if problem:
        place = "--study-dir" if said.startswith("-") else "study_dir"
        raise ValueError(f"the study database {str(database)!r} is damaged ({problem}); restore "
                         f"it from a copy, or pass another {place} or {said} to start afresh")


def sqlite_problem(path: Path) -> str | None:
    """What SQLite says is wrong with the database file at ``path`` (None: nothing, or the
    file is busy: another process writing it, as processes sharing a study do, is no damage).
    Opened to write where it can be (``mode=rw`` never creates it, and reads a file it cannot
    write): the last connection of a WAL file removes its ``-wal`` and ``-shm`` as it closes,
    which a read-only one leaves beside it."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=rw", uri=True,
                                                timeout=1.0)) as conn:
            rows = conn.execute("PRAGMA quick_check").fetchall()
    except sqlite3.DatabaseError as err:
        if "locked" in str(err) or "busy" in str(err):
            return None
        return str(err)
    if rows and rows[0][0] != "ok":
        return f"database disk image is malformed: {rows[0][0]}"
    return None


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Silence Optuna's notes about its heartbeat API (experimental; meant for ``optimize``).

    Ask-and-tell with a heartbeat is supported by the storage; the warnings only say that
    ``Study.optimize`` would beat the heart itself, which `OptunaTrialSource` does instead.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed",
                                category=UserWarning)
        yield


class _RetryOnce(optuna.storages.RetryHeartbeatStaleTrialCallback):
    """Optuna's retry of a failed trial, left out where the study already holds a retry of it.

    An interrupted trial's retry is queued before the trial is failed (`OptunaTrialSource.
    interrupt`), so that a process stopped between the two writes loses nothing; the trial
    then stays ``RUNNING`` until its heartbeat goes stale, and is not queued a second time.
    Callers hold the study's ask lock (`StudyHandle.ask_lock`), so that two processes do not
    both find no retry and both queue one. The retry does not carry the count of siblings
    held for the trial (`HELD_SIBLINGS`): it is no proposal, and holds none; nor the trial's
    ``wall_seconds``, which are that attempt's (a row adds every attempt's,
    `scamp_jax.hpo.report.trial_records`), nor the process that ran it
    (`scamp_jax.hpo.study.owner.OWNER`).
    """

    #: attributes of a trial its retry does not take
    NOT_CARRIED = (HELD_SIBLINGS, "wall_seconds", OWNER)

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        for other in study.get_trials(deepcopy=False):
            if trial.number in self.retry_history(other):
                return
        if any(name in trial.user_attrs for name in self.NOT_CARRIED):
            trial = copy.copy(trial)
            trial.user_attrs = {k: v for k, v in trial.user_attrs.items()
                                if k not in self.NOT_CARRIED}
        super().__call__(study, trial)


def retry_callback() -> optuna.storages.RetryHeartbeatStaleTrialCallback:
    """Optuna's callback that queues a failed trial again (its parameters, attributes and a
    record of the trials it retries), once per trial."""
    with quiet_optuna():
        return _RetryOnce(max_retry=None)


def retried_from(trial: FrozenTrial) -> int | None:
    """Number of the original trial that ``trial`` retries (None: not a retry): the first of a
    chain of retries, whose checkpoint directory every retry of the chain keeps."""
    with quiet_optuna():
        return optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)


def stopped_attempt(trial: FrozenTrial) -> int | None:
    """Number of the trial that ``trial`` runs again (None: not a retry): the attempt a run
    stopped, the last of its chain of retries (`retried_from` is the first)."""
    history = earlier_attempts(trial)
    return history[-1] if history else None


def earlier_attempts(trial: FrozenTrial) -> list[int]:
    """Numbers of the trials that ``trial`` runs again, first to last (empty: none)."""
    with quiet_optuna():
        return list(optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(trial))


def open_storage(
    study_dir: str | Path,
    storage: str | None = None,
    *,
    heartbeat_interval: int = HEARTBEAT_INTERVAL,
    grace_period: int = GRACE_PERIOD,
    attempts: int = 5,
) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage of the study, with a heartbeat that retries dead processes' trials.

    An SQLite file is opened in write-ahead-log mode (`scamp_jax._sqlite`: a trial's record is
    a few dozen commits). ``heartbeat_interval`` and ``grace_period`` are seconds (Optuna takes
    whole seconds). Two processes opening a new database at once race to create its tables; the
    loser sees "already exists" (or a duplicate key) and opens it again once the winner has
    committed.
    """
    from sqlalchemy.exc import DBAPIError

    if heartbeat_interval < 1 or grace_period <= heartbeat_interval:
        raise ValueError(
            f"{heartbeat_interval=} s must be at least 1 and {grace_period=} s longer than it"
        )
    url = storage_url(study_dir, storage)
    _make_study_dir_of(url, study_dir)
    created = _create_sqlite_file(url, storage is not None)
    for attempt in range(attempts):
        try:
            with quiet_optuna():
                rdb = optuna.storages.RDBStorage(
                    url, heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                    heartbeat_stale_trial_callback=retry_callback(),
                    # A file this process has just created gets its tables and schema version
                    # from this Optuna, so the compatibility check (which loads Optuna's
                    # migration scripts once more) is skipped; a file that existed is checked,
                    # and so is a new one on a retry (another process stamped it first).
                    skip_compatibility_check=created and attempt == 0,
                )
            if rdb.engine.dialect.name == "sqlite" and rdb.engine.url.database not in (
                    None, "", ":memory:"):
                from sqlalchemy import event

                from scamp_jax._sqlite import write_ahead

                event.listen(rdb.engine, "connect", lambda conn, _record: write_ahead(conn))
                rdb.engine.dispose()  # the connections that made the tables reopen with it
            return rdb
        except DBAPIError as err:  # SQLite: "already exists" or the schema version stamped
            # twice ("UNIQUE constraint failed"); PostgreSQL: a duplicate type or key
            racing = any(mark in str(err) for mark in (
                "already exists", "duplicate key", "UNIQUE constraint failed"))
            if not racing or attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _make_study_dir_of(url: str, study_dir: str | Path) -> None:
    """Make ``study_dir`` if the SQLite file of ``url`` is in it (`check_storage` lets such a
    database's folder be missing: the run makes it); nothing for any other database."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if (parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:")
            and Path(parsed.database).parent.resolve() == Path(study_dir).resolve()):
        Path(study_dir).mkdir(parents=True, exist_ok=True)


def _create_sqlite_file(url: str, storage_given: bool = True) -> bool:
    """Create the SQLite database file of ``url`` if there is none; True if this call made it
    (exclusive creation: of processes opening a new study at once, one gets True).
    ``storage_given``: the URL is the caller's ``storage`` (else the study directory's file),
    which the error for a file that cannot be made names."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return False
    try:
        with open(parsed.database, "x"):
            return True
    except FileExistsError:
        return False
    except OSError as err:  # a folder that is not there or not writable, a full disk, ...
        fix = ("pass storage as a database file in a folder this process can write to"
               if storage_given else "pass a study_dir this process can write to")
        raise type(err)(f"the study database {parsed.database!r} cannot be created "
                        f"({err.strerror or err}); {fix}") from err


@dataclass(frozen=True)
class StudyHandle:
    """An opened study: what `open_study` returns and `OptunaTrialSource` works on.

    Attributes:
      study: the Optuna study (ask, tell, trials, user attributes).
      storage: its RDB storage, with a heartbeat (a dead process's trials are retried).
      ask_lock: the lock that makes counting and asking one step across processes.
    """

    study: optuna.Study
    storage: optuna.storages.RDBStorage
    ask_lock: AskLock

    @property
    def name(self) -> str:
        """The study's name in the storage."""
        return self.study.study_name


class _StudyCreationNote(logging.Filter):
    """Drops Optuna's "A new study created" / "Using an existing study" note on the threads
    inside `quiet_study_creation` (the caller's opening lines say more: how many trials the
    study holds); Optuna's other messages, and every other thread's, pass."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(self.quiet, "on", False) or record.levelno > logging.INFO:
            return True
        message = record.getMessage()
        return not message.startswith(("A new study created", "Using an existing study"))


_CREATION_NOTE = _StudyCreationNote()
for _name in ("optuna.study.study", "optuna.storages._rdb.storage",
              "optuna.storages._in_memory", "optuna.storages.journal._storage"):
    logging.getLogger(_name).addFilter(_CREATION_NOTE)  # the loggers that say it (Optuna 4-5)


@contextlib.contextmanager
def quiet_study_creation() -> Iterator[None]:
    """Within the block, on this thread, Optuna's study-creation note is not logged (at
    Optuna's debug verbosity it is: a user who asked for Optuna's details gets them)."""
    before = getattr(_CREATION_NOTE.quiet, "on", False)
    _CREATION_NOTE.quiet.on = optuna.logging.get_verbosity() > optuna.logging.DEBUG
    try:
        yield
    finally:
        _CREATION_NOTE.quiet.on = before


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
    metric: str | None = None,
) -> StudyHandle:
    """Create the study, or load it if ``study_name`` already exists in the storage.

    A name the storage does not hold makes a new, empty study beside the ones it holds
    (Optuna's ``load_if_exists``): a misspelt name resumes nothing
    (``optuna.get_all_study_names(storage)`` lists them). ``study_dir``: the study's folder,
    which holds its SQLite file ``study.db`` unless ``storage`` (an Optuna storage URL, e.g.
    ``postgresql://...``) names another. ``direction``: whether the trials' values are
    maximised or minimised. ``sampler``: ``"tpe"``, ``"random"`` or ``"grid"`` (over ``grid``:
    parameter name -> values), seeded by ``seed``. ``pruner``: ``"median"`` (which judges no
    trial before ``warmup_steps`` steps), ``"halving"`` or ``"none"``.

    ``settings`` (JSON-serialisable, e.g. space, preset, steps, seed, budget) are stored with a
    new study; loading a study created with other values raises `StudySettingsError` naming
    each difference. ``heartbeat_interval`` and ``grace_period`` (seconds) set its liveness
    (see the package doc). ``metric``: the name of the score the trials' values are, stored
    with the study (a study opened before it was stored takes it). Raises ``ValueError`` if
    the study was created with another direction or scores another metric (a
    `StudySettingsError`, as other settings): its stored values,
    its best trial and its sampler's model would mix two scores. Returns the `StudyHandle`
    (study, storage, ask lock).
    """
    if direction not in ("maximize", "minimize"):
        raise ValueError(f"direction={direction!r} must be 'maximize' or 'minimize'")
    url = storage_url(study_dir, storage)
    rdb = open_storage(study_dir, url, heartbeat_interval=heartbeat_interval,
                       grace_period=grace_period)
    with quiet_study_creation():
        study = optuna.create_study(
            storage=rdb,
            study_name=study_name,
            direction="maximize" if direction == "maximize" else "minimize",
            sampler=make_sampler(sampler, seed, grid),
            pruner=make_pruner(pruner, warmup_steps=warmup_steps),
            load_if_exists=True,
        )
    stored_direction = study.direction.name.lower()
    if stored_direction != direction:
        raise StudySettingsError(
            study_name, {"direction": stored_direction}, {"direction": direction},
            f"study {study_name!r} in the storage was created to {stored_direction} "
            f"its objective, not to {direction}; a study keeps its direction: open it with "
            f"direction={stored_direction!r} (in run_study, the task's direction), or start "
            "another study (another study name, study directory or storage)")
    scored = study.user_attrs.get(METRIC_KEY)
    if metric is not None and scored is not None and scored != metric:
        raise StudySettingsError(
            study_name, {"metric": scored}, {"metric": metric},
            f"study {study_name!r} in the storage scores its trials by {scored!r}, not "
            f"{metric!r}; a study keeps its metric (its values and its best trial are "
            f"{scored!r}'s): score the task by {scored!r}, or start another study "
            "(another study name, study directory or storage)")
    if settings is not None:
        _check_settings(study, settings, lambda: optuna.get_all_study_names(rdb))
    if metric is not None and scored is None:  # stored once nothing refused the run
        study.set_user_attr(METRIC_KEY, metric)
    return StudyHandle(study, rdb, AskLock(url, study_name))


def _check_settings(study: optuna.Study, settings: Mapping[str, Any],
                    names: Callable[[], Sequence[str]]) -> None:
    """Store ``settings`` with a new study; refuse other values for an existing one (with a
    new name to pass none of the storage's studies, ``names()``, has)."""
    wanted = json.loads(json.dumps(dict(settings)))
    stored = study.user_attrs.get(SETTINGS_KEY)
    if stored is None:
        study.set_user_attr(SETTINGS_KEY, wanted)
        return
    differ = [k for k in sorted(set(stored) | set(wanted)) if stored.get(k) != wanted.get(k)]
    if differ:
        taken = set(names())
        raise StudySettingsError(study.study_name, {k: stored.get(k) for k in differ},
                                 {k: wanted.get(k) for k in differ},
                                 new_name=free_study_name(study.study_name, taken.__contains__))


def ever_ran(study: optuna.Study) -> bool:
    """Whether a trial of ``study`` ever ran: one complete, pruned or running (others are
    only given back, such as the misfits of a budget too small for any candidate, or a
    trial whose ``suggest`` raised)."""
    return bool(study.get_trials(deepcopy=False, states=(
        optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
        optuna.trial.TrialState.RUNNING)))


def forget_settings_if_unused(study: optuna.Study) -> bool:
    """Forget the settings ``study`` was created with where no trial of it ever ran
    (`ever_ran`), so that a rerun with a larger budget, as that error advises, starts it with
    its own settings (and metric). True where they were forgotten."""
    if ever_ran(study) or study.user_attrs.get(SETTINGS_KEY) is None:
        return False
    study.set_user_attr(SETTINGS_KEY, None)
    study.set_user_attr(METRIC_KEY, None)
    return True


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _as_keyword(name: str, value: Any) -> str:
    """``name=value`` of a study's record as a keyword argument gives it; a memory budget in
    bytes also in the units it may be given in (``memory_per_device=16777216 ('16MiB')``)."""
    if name == "memory_per_device" and isinstance(value, int) and value > 0:
        return f"{name}={value!r} ({_memory_units(value)!r})"
    return f"{name}={value!r}"


def _memory_units(value: int) -> str:
    """``value`` bytes in the largest binary unit that holds it whole (``16MiB``), else
    bytes."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value % size == 0:
            return f"{value // size}{unit}"
    return str(value)


def _as_flag(name: str, value: Any) -> str:
    """``name=value`` of a study's record as the command line gives it (the search space has
    no flag of its own: an experiment's ``--preset`` picks it)."""
    if name == "space":
        return f"the search space {value}"
    if value is None:
        return f"no {_flag(name)}"
    if name == "memory_per_device" and isinstance(value, int) and value > 0:
        return f"{_flag(name)} {_memory_units(value)}"
    return f"{_flag(name)} {value}"


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


