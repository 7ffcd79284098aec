"""One study session: open or resume the study, run the engine, write the report once.

Every way in goes through here: `run_study` (the library call), the experiments' command lines
(``experiments._cli``) and ``mpirun`` (`scamp_jax.distributed.engine.run_search_mpi`, which
brings only its trial source and rank). `StudySession` holds what a run sets up once (where the
study lives, its console, plan cache, live view and engine); `run_search` drives it in one
process, and hands over to the MPI session when launched by ``mpirun`` with several ranks.

A run writes ``study.db`` (unless ``settings.storage`` names another database),
``plans.sqlite`` (the plan cache, shared by every study in ``study_dir``), ``jax_cache/`` (the
persistent compilation cache, `scamp_jax.planning.compile_cache`, shared likewise), and in the
study's
folder (``study_dir``, or ``study_dir/<study_name>`` for a study other than the space's default)
``checkpoints/``, ``results.json``, ``results.csv``, ``best_model/`` and the plots. The
study whose folder is ``study_dir`` itself names itself in ``outputs.json`` there, and another
space's default study is refused that folder (`claim_outputs`): its results and checkpoints
would land on the first one's.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import gc
import json
import logging
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from scamp_jax._lazy import warm
from scamp_jax._signals import sigterm_stops, stops_held
from scamp_jax._units import counted, format_share
from scamp_jax.hpo.failures import RepeatedFailureError
from scamp_jax.hpo.settings import SearchSettings, idle_pruner
from scamp_jax.space import SearchSpace, Task

if TYPE_CHECKING:
    import jax
    import optuna

    from scamp_jax.hpo.engine import SearchEngine, SearchResult
    from scamp_jax.hpo.study import OptunaTrialSource, StudyHandle, TrialSource

log = logging.getLogger(__name__)

#: Share of the host's memory (physical, or a container's limit) that CPU devices (which
#: report no limit) split between them when no ``memory_per_device`` is given.
CPU_MEMORY_SHARE = 0.5


_lasting = 0  # how many `lasting_frozen` blocks are open
_exit_registered = False


@contextlib.contextmanager
def lasting_frozen() -> Iterator[None]:
    """Keep what exists now, and what `freeze_lasting` adds, out of the garbage collector's full
    passes until the block ends (``gc.freeze``; ``gc.unfreeze`` after it, so a later collection
    frees whatever the study left behind).

    A study's process holds JAX's, Optuna's and SQLAlchemy's objects for its whole life; each
    full pass walks all of them again. On the guide's study that was 7 passes and 0.8 s of a
    7 s run, 0.24 s with them frozen. The process that ran a study also exits without the
    collector's last passes (`_exit_without_collecting`).
    """
    global _lasting, _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_exit_without_collecting)
    _lasting += 1
    gc.freeze()
    try:
        yield
    finally:
        _lasting -= 1
        if not _lasting:
            gc.unfreeze()


def _exit_without_collecting() -> None:
    """(At exit.) Skip the collector's last passes over all a study's process holds: the
    operating system frees it anyway, and the study, its checkpoints and its results are
    closed by then. In the guide's study those passes were 0.6 s of the process's end."""
    gc.freeze()



def freeze_lasting() -> None:
    """Inside `lasting_frozen`: freeze what was made since (the opened study, the engine)."""
    if _lasting:
        gc.freeze()


#: What a task has (`scamp_jax.space.Task`), checked before a study opens.
TASK_PARTS = ("metric", "direction", "sample_batch", "batches", "loss_fn", "evaluate")


def check_space_and_task(space: Any, task: Any) -> None:
    """Raise ``TypeError`` naming what is wrong where ``space`` is no `SearchSpace` or
    ``task`` lacks a part of a `scamp_jax.space.Task`, before a study is opened."""
    if not isinstance(space, SearchSpace):
        raise TypeError(f"space={space!r} is not a SearchSpace; build one with "
                        "scamp_jax.SearchSpace(name, suggest, build)")
    missing = [name for name in TASK_PARTS if not hasattr(task, name)]
    if missing:
        raise TypeError(f"task={task!r} has no {', '.join(missing)}: pass a Task (its metric, "
                        "direction, sample_batch, batches, loss_fn and evaluate); "
                        "scamp_jax.FunctionTask(...) builds one from plain functions")
    test = getattr(task, "test", None)
    if test is not None and not callable(test):
        raise TypeError(f"the task's test is a {type(test).__name__}, not callable; it must "
                        "be a method test(model) -> {name: float} (scores on data no trial is "
                        "chosen by), or absent")


def check_directory(path: str | Path, name: str = "study_dir") -> None:
    """Raise ``ValueError`` unless ``path`` (the setting ``name``, or a flag such as
    ``--out-dir``) is, or can become, a directory this process can write to; creates nothing."""
    said = _said(path, name)
    if not str(path).strip():  # Path("") is the working directory
        raise ValueError(f"{said} is empty; pass a directory (\".\" for this one)")
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{said} is a file; pass a directory (it is created if missing)")
    _check_writable_place(Path(path), said, "directory")


def check_file(path: str | Path, name: str = "path") -> None:
    """Raise ``ValueError`` unless ``path`` (the setting ``name``, or a flag such as
    ``--json``) is, or can become, a file this process can write (its folder made where
    missing); creates nothing. For an output a command writes when it is done: checked
    before its work, so that the work is not lost."""
    said = _said(path, name)
    if not str(path).strip():
        raise ValueError(f"{said} is empty; pass a file path")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{said} is a folder; pass the path of a file (in it, or elsewhere)")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ValueError(f"{said} cannot be written; pass a file you can write to")
        if not path.is_file():  # a device such as /dev/stdout, written in place
            return
    # a file is written beside itself and moved into place, or made: its folder is written
    _check_writable_place(path.parent, said, "file path")


def _said(path: str | Path, name: str) -> str:
    """The path as a message names it: with its flag or setting (``name``), or alone."""
    if not name:
        return repr(str(path))
    return f"{name} {str(path)!r}" if name.startswith("-") else f"{name}={str(path)!r}"


def _check_writable_place(folder: Path, said: str, kind: str) -> None:
    """``folder`` (of or for ``said``) can be made where missing, and written."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{said} is inside {str(existing)!r}, which is a file; pass a "
                         f"{kind}")
    try:  # a real write: permissions, read-only mounts and root's exceptions all count
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        # the folder that is there, where it is not the path itself (one to be made in it)
        where = "" if existing == folder and str(existing) in said else \
            f" ({str(existing)!r}, where it would be made, is not)"
        why = {errno.EROFS: ": a read-only file system", errno.EACCES: ": permission denied",
               errno.EPERM: ": permission denied",
               errno.ENOSPC: ": no space left there"}.get(err.errno or 0, "")
        raise ValueError(f"{said} is not writable{where}{why}; pass a {kind} you can write "
                         "to") from None


def check_study_place(study_dir: str | Path, storage: str | None) -> None:
    """Raise ``ValueError`` where ``study_dir`` cannot be written (`check_directory`) or
    ``storage`` is no usable database URL, or the study's SQLite file is damaged
    (`scamp_jax.hpo.study.storage.check_storage`), or its plan cache is, or a file stands
    where its compiled programs go (`scamp_jax.planning.compile_cache.cache_problem`), before
    anything is written there."""
    from scamp_jax.hpo.study.storage import check_storage, sqlite_problem
    from scamp_jax.planning.compile_cache import cache_problem

    check_directory(study_dir)
    check_storage(storage or None, study_dir)
    problem = cache_problem(study_dir)
    if problem is not None:
        raise ValueError(problem)
    plans = Path(study_dir) / "plans.sqlite"
    problem = sqlite_problem(plans) if plans.is_file() else None
    if problem:
        raise ValueError(f"the plan cache {str(plans)!r} is damaged ({problem}); it holds plans "
                         "and measured allowances only: delete it (they are compiled and "
                         "measured again), or pass another study_dir")


#: In a study directory: the study whose outputs are at its top level (`claim_outputs`).
OUTPUTS_FILE = "outputs.json"


def _outputs_owner(path: Path) -> str | None:
    """The study ``path`` (an `OUTPUTS_FILE`) names; None: no such file."""
    try:
        return str(json.loads(path.read_text())["study"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} does not say whose outputs {path.parent} holds ({err}); "
                         "write {\"study\": \"NAME\"} into it, or pass another study_dir"
                         ) from None


def claim_outputs(study_dir: Path, study_name: str,
                  stored: Callable[[], Collection[str]] = tuple, write: bool = True) -> None:
    """Make ``study_dir``'s top level the outputs of study ``study_name`` (its results,
    checkpoints, best model and plots; named in `OUTPUTS_FILE`), or raise ``ValueError`` when
    they are another study's: a space's default study keeps its outputs at the top of
    ``study_dir``, so a second space's default study in the same folder would overwrite the
    first one's results and resume its trials from the other model's checkpoints
    (``checkpoints/trial_N``). Outputs written before studies named themselves (results or
    checkpoints, no `OUTPUTS_FILE`) are this study's only where ``stored()`` (the names of
    the studies in its storage) has it. Safe for processes that claim at once: the first
    name written stays. ``write=False``: only refuse (before the study is opened; nothing is
    written)."""
    def refuse(owner: str) -> NoReturn:
        from scamp_jax.hpo.study.storage import free_study_name

        names = set(stored())
        new = free_study_name(study_name, lambda name: name in names
                              or (study_dir / name).exists())
        raise ValueError(
            f"{study_dir} holds the outputs of {owner} (results, checkpoints, best model); "
            f"study {study_name!r} would write over them: pass another study_dir, or "
            f"study_name={new!r} to keep its outputs in {study_dir / new}")

    path = study_dir / OUTPUTS_FILE
    owner = _outputs_owner(path)
    if owner is None:
        earlier = (study_dir / "results.json").exists() or (study_dir / "checkpoints").is_dir()
        if earlier and study_name not in stored():
            refuse("another study (written before studies named themselves in "
                   f"{OUTPUTS_FILE})")
        if not write:
            return
        study_dir.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=study_dir, prefix=".outputs-", suffix=".partial")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"study": study_name}) + "\n")
            os.link(partial, path)  # whole or not at all; the first claim stays
            return
        except FileExistsError:  # another process claimed it meanwhile
            owner = _outputs_owner(path)
        finally:
            os.unlink(partial)
    if owner != study_name:
        refuse(f"study {owner!r}")


def check_outputs_have_their_study(out_dir: Path, study_name: str,
                                   stored: Callable[[], Collection[str]]) -> None:
    """Raise ``ValueError`` where ``out_dir`` holds a study's checkpoints or results while the
    storage (``stored()``: the names of its studies) has no study ``study_name``: its database
    was deleted or another ``storage`` was given, and a new study of that name would resume its
    trial numbers from the earlier study's checkpoints (``checkpoints/trial_N``, other
    configurations) and write its results over theirs."""
    checkpoints = out_dir / "checkpoints"
    held = [name for name, there in (
        ("checkpoints", checkpoints.is_dir() and any(checkpoints.iterdir())),
        ("results.json", (out_dir / "results.json").exists())) if there]
    if not held or study_name in stored():
        return
    if (out_dir / "best_model").exists():
        held.append("best_model")
    raise ValueError(
        f"{out_dir} holds the {', '.join(held[:-1])}{' and ' if held[1:] else ''}{held[-1]} "
        f"of an earlier study {study_name!r}, which its "
        "storage does not have (was its study.db deleted, or another storage given?); a new "
        "study would resume its trials from the earlier study's checkpoints: restore that "
        "database, pass another study_dir, or move those outputs away to start afresh")


def release_outputs(study_dir: Path, study_name: str) -> bool:
    """Undo `claim_outputs` of study ``study_name`` where it wrote no outputs yet (no results,
    no checkpoints): a run that stored nothing leaves the folder to any study. True where the
    claim was removed."""
    path = study_dir / OUTPUTS_FILE
    if ((study_dir / "results.json").exists() or (study_dir / "checkpoints").is_dir()
            or _outputs_owner(path) != study_name):
        return False
    path.unlink(missing_ok=True)
    return True


class StudySession:
    """One run of a study in this process: where it lives, its console, plans, view and engine.

    Args:
      space, task: the model family and what its candidates train on.
      settings: the run's `SearchSettings` (validated when built).
      devices: this process's device pool.
      memory_per_device: budget per device, bytes.
      live: a live table when stdout is a terminal (else plain log lines); with several
        ranks only rank 0 may draw one, on a terminal that reports a size, which Open MPI's
        ranks do not (`scamp_jax.hpo.live.is_terminal`), and every rank's plain lines are
        prefixed with ``[rank R]``.
      baseline: a second score of ``task.evaluate`` printed beside the metric, or None.
      title: heading of the live view.
      plan_fn: the planner (default `plan_mesh` with the study's ``plans.sqlite``).
      console: a ``rich`` console for the session's lines (default: stdout).
      rank, ranks: this process's MPI rank and the number of ranks (0 and 1 in one process).
    """

    def __init__(self, space: SearchSpace, task: Task, settings: SearchSettings, *,
                 devices: Sequence[jax.Device], memory_per_device: int, live: bool = True,
                 baseline: str | None = None, title: str = "search",
                 plan_fn: Callable[..., Any] | None = None, console: Any = None,
                 rank: int = 0, ranks: int = 1) -> None:
        if not isinstance(settings, SearchSettings):
            raise TypeError(f"settings={settings!r} is not a SearchSettings; build one with "
                            "scamp_jax.SearchSettings(trials=..., steps=..., ...)")
        check_space_and_task(space, task)
        check_study_place(settings.study_dir, settings.storage)

        from scamp_jax.planning.plan_cache import PlanCache
        from scamp_jax.planning.planner import plan_mesh

        self.space, self.task = space, task
        self.devices, self.memory_per_device = list(devices), int(memory_per_device)
        #: the settings as given, and as the study runs them on these devices
        #: (`SearchSettings.on_platform`: fusion by default on accelerators)
        self.requested = settings
        self.settings = settings.on_platform(self.platform)
        from scamp_jax.hpo.engine import check_pool

        check_pool(self.settings, len(self.devices))  # before the study stores its settings
        self.live, self.baseline, self.title = live, baseline, title
        self.rank, self.ranks = rank, ranks
        self.study_name = settings.study_name or space.name
        self.study_dir = Path(settings.study_dir)
        # A study other than the space's default one keeps its outputs in a folder of its own.
        self.out_dir = (self.study_dir if self.study_name == space.name
                        else self.study_dir / self.study_name)
        # Plans, fused plans and compiled peaks persist next to the studies (one SQLite file,
        # safe for concurrent writers): a resumed study, another process or another rank plans
        # an architecture planned before without compiling.
        self.plan_cache = PlanCache(self.study_dir / "plans.sqlite",
                                    elsewhere="pass another study_dir")
        self.plan_fn = plan_fn or functools.partial(plan_mesh, cache=self.plan_cache)
        #: ``run.overhead`` of the last `run_engine` (`scamp_jax.hpo.overhead`), None before
        self.overhead: dict[str, Any] | None = None
        #: the engine's figures when its run was interrupted (`run_engine`), else None
        self.interrupted_result: Any = None
        if console is None:
            from scamp_jax.hpo.live import RankStream, log_console

            # Logs (no terminal, or a rank's size-less one) get wide plain lines instead of a
            # table squeezed into 80 columns with colour codes.
            console = log_console(None if rank == 0 else RankStream(rank))
        self.console = console
        #: the study had all its trials when this run opened it (`greet`)
        self.nothing_to_run = False

    def say(self, line: str) -> None:
        """Print one plain line on the session's console."""
        self.console.print(line, markup=False, highlight=False)

    # -- the study --------------------------------------------------------------------------------
    def open(self) -> StudyHandle:
        """Create or resume the study (only the process that owns it calls this); a new study
        first gets ``settings.initial_params`` queued (a warm start)."""
        from scamp_jax.hpo.study import open_study
        from scamp_jax.hpo.study.source import check_grid, check_initial_params

        s = self.settings
        check_grid(self.space, s.sampler, s.seed)
        check_initial_params(self.space, s.initial_params)
        top = self.out_dir == self.study_dir
        if top:  # refused before the study is stored; claimed once it opened
            claim_outputs(self.study_dir, self.study_name, self._stored_names, write=False)
        check_outputs_have_their_study(self.out_dir, self.study_name, self._stored_names)
        handle = open_study(
            self.study_name, study_dir=self.study_dir, storage=s.storage,
            direction=self.task.direction, metric=self.task.metric, sampler=s.sampler,
            pruner=s.pruner, seed=s.seed,
            grid=self.space.grid, warmup_steps=s.eval_every,
            settings=s.study_record(self.space, self.memory_per_device),
            heartbeat_interval=s.heartbeat_interval, grace_period=s.grace_period,
        )
        if top:
            claim_outputs(self.study_dir, self.study_name, self._stored_names)
        if not handle.study.get_trials(deepcopy=False):
            for params in s.initial_params:
                handle.study.enqueue_trial(dict(params), skip_if_exists=True)
        return handle

    def _stored_names(self) -> list[str]:
        """The names of the studies in this study's storage (none, and nothing made, where its
        SQLite file does not exist)."""
        from scamp_jax.hpo.study import storage_url
        from scamp_jax.hpo.study.storage import stored_study_names

        return stored_study_names(storage_url(self.study_dir, self.settings.storage))

    def forget_if_unused(self, study: optuna.Study) -> None:
        """Where no trial of ``study`` ever ran (a budget too small for any candidate), forget
        its settings and its claim on ``study_dir``'s outputs, so that the rerun the error
        advises (or another study) starts afresh. A study whose trials trained and went back
        (a stop) keeps them while their checkpoints are kept: a rerun resumes those under
        the study's settings."""
        from scamp_jax.hpo.study.storage import forget_settings_if_unused

        if self._checkpoints_kept(study):
            return
        if forget_settings_if_unused(study) and self.out_dir == self.study_dir:
            release_outputs(self.study_dir, self.study_name)

    def _checkpoints_kept(self, study: optuna.Study) -> bool:
        """Whether a trial of ``study`` has a checkpoint in this study's outputs."""
        from scamp_jax.hpo.checkpoint import saved_steps
        from scamp_jax.hpo.study import CHECKPOINT_KEY

        root = self.out_dir / "checkpoints"
        return root.is_dir() and any(
            saved_steps(root / str(t.user_attrs[CHECKPOINT_KEY]))
            for t in study.get_trials(deepcopy=False) if t.user_attrs.get(CHECKPOINT_KEY))

    def trial_source(self, handle: StudyHandle, **kwargs: Any) -> OptunaTrialSource:
        """The ask-and-tell source over the opened study (``kwargs``: more `OptunaTrialSource`
        arguments)."""
        from scamp_jax.hpo.study import OptunaTrialSource

        return OptunaTrialSource(handle, self.space, self.settings.trials, root=self.out_dir,
                                 **self.settings.source_kwargs(), **kwargs)

    def greet(self, source: Any) -> None:
        """The opening lines: trials of stopped processes queued again, how far the study got
        (``source``: its `OptunaTrialSource`), the pool, and why a study at its total (or at
        the end of its grid) runs nothing."""
        recovered, finished, total = source.recovered, source.finished(), self.settings.trials
        grid_done = source.grid_done()
        self.nothing_to_run = finished >= total or grid_done
        stopped = [] if self.nothing_to_run else source.requeued()
        if recovered and not self.nothing_to_run:
            self.say(f"resuming: trials {sorted(recovered)} of a stopped process are queued "
                     "again")
        if len(stopped) == 1:
            self.say(f"resuming: trial {stopped[0]}, stopped by an earlier run, runs again "
                     "under a new number, from its checkpoints if it has any (results.csv: "
                     "retry_of)")
        elif stopped:
            self.say(f"resuming: trials {stopped}, stopped by an earlier run, run again under "
                     "new numbers, from their checkpoints where they have any (results.csv: "
                     "retry_of)")
        queued = len(stopped) + (len(recovered) if not self.nothing_to_run else 0)
        room = max(0, total - finished)
        if queued > room:
            self.say(f"only {room} more {'trial runs' if room == 1 else 'trials run'} before "
                     f"the study reaches its {total}, so at most {room} of these "
                     f"{queued} retries run now; the others stay queued in the study for a "
                     "run with a larger total")
        ranks = f"; {self.ranks} ranks" if self.ranks > 1 else ""
        failed = source.failed_for_good() if finished else 0
        failures = (f" ({failed} of them failed, each for its reason in results.csv, and "
                    "count towards the total)" if failed else "")
        past = (f"{finished} of {total} trials finished before this run" if finished <= total
                else f"{finished} trials finished before this run, more than the {total} asked "
                     "for now")
        self.say(f"study {self.study_name!r} in {self.out_dir}: {past}{failures}{ranks}")
        points = getattr(source, "grid_points", None)
        if points is not None:
            more = (f"; the study ends with the grid, after {points} of its {total} trials"
                    if points < total else "")
            self.say(f"grid sampler: {counted(points, 'point')}{more}")
        self.say_pool()
        if self.nothing_to_run:
            more = (f"has {counted(finished, 'finished trial')}, at least the "
                    f"{counted(total, 'trial')} asked for; raise the number of trials to run "
                    "more of it, or" if finished > total else
                    f"has its {counted(total, 'trial')}; raise the number of trials to run "
                    "more of it, or" if finished >= total else
                    "has visited every point of its grid;")
            self.say(f"nothing left to run: the study {more} give another study name to start "
                     "anew")
            return
        self._say_changed_settings()
        idle = idle_pruner(self.settings)
        if idle is not None and self.rank == 0:
            logging.getLogger(__name__).warning(idle)
        if self.settings.max_batch_size is None and self.settings.policy != "fixed":
            from scamp_jax.planning.planner import DEFAULT_BATCH_CAP

            if self.settings.reference_batch is None:
                trains = ("and trains its steps at it; pass max_batch_size to bound it (e.g. "
                          "the training set's size), and reference_batch to train every trial "
                          "on as many samples")
            else:
                trains = ("and trains as many samples as its steps at reference_batch; pass "
                          "max_batch_size to bound it (e.g. the training set's size)")
            self.say(f"batches: each trial takes the largest batch its devices hold, up to "
                     f"{DEFAULT_BATCH_CAP:,} samples (no max_batch_size), {trains}")
        line = fusion_line(self.requested, self.settings, self.platform)
        if line is not None:
            self.say(line)

    def _say_changed_settings(self) -> None:
        """A note where this run's `SearchSettings.run_record` (which a study may change
        between runs) differs from the one its last recorded run had."""
        from scamp_jax.hpo.report import read_runs

        earlier = next((run["search"] for run in reversed(read_runs(self.out_dir))
                        if isinstance(run, dict) and isinstance(run.get("search"), dict)), None)
        if earlier is None:
            return
        now = self.settings.run_record()
        changed = [name for name in now if name in earlier and earlier[name] != now[name]]
        if changed:
            self.say(f"note: this run has {', '.join(f'{n}={now[n]!r}' for n in changed)}, "
                     "the study's last run had "
                     f"{', '.join(f'{n}={earlier[n]!r}' for n in changed)}"
                     "; the trials run before keep theirs (results.json: each run's search)")

    @property
    def platform(self) -> str:
        """The platform of the pool's devices (``"cpu"``, ``"gpu"``, ...)."""
        return self.devices[0].platform if self.devices else "cpu"

    def say_pool(self) -> None:
        """The pool line: ``pool: ...`` in one process; with several ranks every rank says its
        own (each rank trains on its own devices): ``pool of rank 0: ...``, and on other ranks,
        whose lines begin ``[rank R]`` already, ``pool: ...``."""
        from scamp_jax.hpo.engine import max_running
        from scamp_jax.scheduling.host import CPU_CORES_PER_TRIAL, host_cores

        who = " of rank 0" if self.ranks > 1 and self.rank == 0 else ""
        line = f"pool{who}: {self.pool_description()}"
        cap = max_running(self.settings.engine_config(self.memory_per_device), self.devices)
        if cap is not None and cap < len(self.devices):  # trials wait with devices free
            why = (f" (auto: one per {CPU_CORES_PER_TRIAL} of the {host_cores()} CPU core(s) "
                   "this process may use, at least one)"
                   if self.settings.max_running_trials == "auto" else "")
            units = ("trial or fused group" if cap == 1 else "trials or fused groups") \
                if self.settings.fuse else ("trial" if cap == 1 else "trials")
            line += f"; at most {cap} {units} {'trains' if cap == 1 else 'train'} at once{why}"
        elif cap is None:  # memory alone decides: say so (several trials may share a device)
            line += "; no cap on trials training at once: the pool's memory decides"
        self.say(line)

    def pool_description(self) -> str:
        """The devices trials run on, e.g. ``2 cpu devices of 32.0 MiB (of 8 on this host)``;
        with several ranks ``(of 8 in this process)``, as each rank splits its host itself."""
        import jax

        from scamp_jax._units import format_bytes

        n, kind = len(self.devices), self.devices[0].platform if self.devices else "no"
        local = len(jax.local_devices(backend=kind)) if self.devices else 0
        where = "in this process" if self.ranks > 1 else "on this host"
        host = f" (of {local} {where})" if local > n else ""
        return (f"{n} {kind} device{'s' * (n != 1)} of {format_bytes(self.memory_per_device)}"
                f"{host}")

    # -- the engine -------------------------------------------------------------------------------
    def run_engine(self, source: TrialSource, *,
                   engine: Callable[..., SearchEngine] | None = None,
                   before: Callable[[], Any] | None = None) -> tuple[SearchEngine, SearchResult]:
        """Build the engine over ``source`` and run it under the live view.

        ``engine``: the engine class (default `SearchEngine`; MPI passes its own);
        ``before``: called once the engine is built, before it runs (MPI: a barrier).
        """
        from scamp_jax.hpo.live import LiveView, PlainStream, RankStream, is_terminal
        from scamp_jax.hpo.overhead import OverheadRecorder
        from scamp_jax.planning.compile_cache import study_compile_cache

        if engine is None:
            from scamp_jax.hpo.engine import SearchEngine

            engine = SearchEngine
        title = self.title
        stream: Any = None if self.live else PlainStream()  # None: stdout
        if self.ranks > 1:  # every rank's log lines say whose they are; rank 0 may be live
            title = f"{self.title} (rank {self.rank} of {self.ranks})"
            live = self.live and self.rank == 0 and is_terminal(sys.stdout)
            stream = None if live else RankStream(self.rank)
        view = LiveView([self.memory_per_device] * len(self.devices), self.task.metric,
                        title=title, stream=stream)
        built = engine(self.space, self.task, source,
                       self.settings.engine_config(self.memory_per_device, rank=self.rank),
                       devices=self.devices, checkpoint_root=self.out_dir / "checkpoints",
                       plan_fn=self.plan_fn, on_update=view.update, plan_cache=self.plan_cache,
                       on_notice=view.notice)
        if before is not None:
            before()
        # orbax (the first checkpoint) and matplotlib (the report), imported while the first
        # plans compile rather than on a trial's or the report's path
        warm(("orbax.checkpoint", "matplotlib", "matplotlib.figure",
              "matplotlib.backends.backend_agg"))
        freeze_lasting()  # the study, its storage and their modules last the whole run
        # Every compile of the run is looked up in (and, by the study's owner, written to) the
        # study's persistent compilation cache; where the time goes besides training:
        # run.overhead in results.json.
        recorder = OverheadRecorder()
        try:
            with study_compile_cache(self.study_dir, writer=self.rank == 0), view, recorder:
                result = built.run()
        except (KeyboardInterrupt, Exception):
            # the stopped run's record keeps its figures so far (`record_ending`); a stop
            # before the engine set itself up has none
            try:
                self.interrupted_result = built.result_so_far()
                self.overhead = recorder.summary(self.interrupted_result)
            except Exception:  # noqa: BLE001 - the interrupt goes on either way
                self.interrupted_result = None
            raise
        self.overhead = recorder.summary(result)
        return built, result

    # -- the report -------------------------------------------------------------------------------
    def report(self, source: OptunaTrialSource, run_info: dict[str, Any]) -> dict[str, Any]:
        """Write ``results.json``/``.csv``, ``best_model/`` and the plots of every finished trial
        (``run_info`` as the ``run`` section; the usage plots from every run's timeline), print
        the best trials; returns ``run_info`` plus ``best`` (a results row or None)."""
        from scamp_jax.hpo import report

        report_start = time.perf_counter()
        if self.overhead is not None:
            run_info = {**run_info, "overhead": self.overhead}
        if source.recovered:
            self.say(f"trials {sorted(set(source.recovered))} of stopped processes were run "
                     "again")
        note = grid_note(source, self.settings.trials)
        if note:
            self.say(note)
        metric, direction = self.task.metric, self.task.direction
        records = report.trial_records(source.study, self._metrics())
        # a run that told no trial (a rerun of a full study, or a second process on a study
        # whose trials another process took) leaves the record of runs as it was
        idle = not source.told
        run_info = {**run_info, "run_id": uuid.uuid4().hex}  # its entry, for what comes later
        report.write_results(self.out_dir, records, metric=metric, direction=direction,
                             run=None if idle else run_info)
        try:
            return self._report_written(source, run_info, records, idle, report_start)
        except KeyboardInterrupt:  # its best model, test and plots cut short: the rerun's
            if not idle:
                with stops_held():
                    report.update_run(self.out_dir, run_info["run_id"],
                                      lambda run: run.update(interrupted=True))
            raise

    def _report_written(self, source: OptunaTrialSource, run_info: dict[str, Any],
                        records: list[dict[str, Any]], idle: bool, report_start: float
                        ) -> dict[str, Any]:
        """`report` once ``results.json`` holds the run (its entry ``run_info["run_id"]``):
        the best model, its test, the plots and the lines that close the run."""
        from scamp_jax.hpo import report

        metric, direction = self.task.metric, self.task.direction
        report.save_best_model(self.out_dir, records, metric, direction)
        tested = self._test_best(report.best_record(records, metric, direction))
        runs = report.read_runs(self.out_dir)
        intervals, memory_series, elapsed = report.combined_timeline(runs)
        report.plot_results(self.out_dir, records, metric=metric, baseline=self.baseline,
                            intervals=intervals, memory_series=memory_series,
                            elapsed_s=elapsed, capacity_bytes=self.memory_per_device,
                            run_marks=report.run_starts(runs),
                            device_labels=report.device_labels(runs))
        self.console.print(report.summary_table(records, metric, direction,
                                                baseline=self.baseline,
                                                width=self.console.width))
        self.say(report.verdict(records, metric, direction, self.baseline, tested))
        scored = [t.user_attrs["metrics"] for t in source.study.get_trials(deepcopy=False)
                  if t.user_attrs.get("metrics")]
        if self.baseline and scored and not any(self.baseline in m for m in scored):
            names = sorted({name for m in scored for name in m})
            self.say(f"note: baseline {self.baseline!r} is none of the scores the trials "
                     f"returned ({', '.join(names)}), so it shows nothing; pass one of them")
        usage = run_info["usage"]
        if idle:
            self.say(f"this run trained nothing; results in {self.out_dir}")
        else:
            # booked: what the plans reserve on the pool's devices, not a measured use
            held = (run_info.get("overhead") or {}).get(
                "idle_waiting_for_held_trials_device_s") or 0.0
            self.say(f"this run: {run_info['elapsed_s']:.1f} s, mean memory booked "
                     f"{format_share(usage['mean_memory_utilization'])} of the pool, idle "
                     f"device-seconds {usage['idle_device_seconds']:.1f}"
                     + (f" ({held:.1f} of them waiting for trials another process held)"
                        if held >= 0.05 else "") + f"; results in {self.out_dir}")
        # the report and plots, added once they are written
        if self.overhead is not None and not idle:
            overhead = run_info["overhead"]
            overhead["report_s"] = round(overhead.get("report_s", 0.0)
                                         + time.perf_counter() - report_start, 3)
            report.add_run_overhead(self.out_dir, run_info["run_id"],
                                    {"report_s": overhead["report_s"]})
        return {**run_info, "best": report.best_record(records, metric, direction),
                "test": tested}

    def _test_best(self, best: Any) -> dict[str, Any] | None:
        """`_take_test`, and where it took none, no earlier run's test of the best trial's model
        kept (`report.record_test` with None): a test that failed now claims nothing."""
        from scamp_jax.hpo import report

        tested = self._take_test(best)
        if tested is None and best is not None:
            report.record_test(self.out_dir, best["number"], None)
        return tested

    def _take_test(self, best: Any) -> dict[str, Any] | None:
        """The task's ``test`` scores of the best trial's model (``best``: its results row),
        saved in ``best_model/``: scores on data no trial was chosen by, written to its
        ``trial.json`` and ``results.json`` (`report.record_test`) and returned as
        `report.saved_test` reads them back (a score that is no finite number as None, and
        said). None where the task has no ``test``, or
        ``best_model/`` holds no model of that trial; a test that fails is said, and the
        study's results stand as written."""
        from scamp_jax.hpo import report
        from scamp_jax.hpo.lifecycle import checked_scores
        from scamp_jax.hpo.runner import load_model

        test = getattr(self.task, "test", None)
        saved = self.out_dir / "best_model"
        if test is None or best is None:
            return None
        try:
            record = json.loads((saved / "trial.json").read_text())
        except (OSError, ValueError):
            return None
        number = best["number"]
        if not isinstance(record, dict) or record.get("number") != number:
            self.say(f"note: {saved} holds no model of the best trial {number} (another "
                     "process's better one, or none), so it is not tested here")
            return None
        self.say(f"testing the best model (trial {number}) on the task's test data")
        where = f"the best model (trial {number}, in {saved})"
        try:
            # A stop waits for the restore (a second Ctrl-C does not): one cut short leaves
            # orbax's reads to fail on its closed event loop, each with a traceback.
            with stops_held():
                model = load_model(saved, self.space, record["params"])
        except Exception as err:  # noqa: BLE001 - the study is done: said, and kept
            self.say(f"note: {where} could not be loaded for its test: {type(err).__name__}: "
                     f"{err}; the study's results are written")
            return None
        try:
            returned = test(model)
        except Exception as err:  # noqa: BLE001 - the study is done: said, and kept
            self.say(f"note: the task's test of {where} raised {type(err).__name__}: {err}; "
                     "the study's results are written")
            return None
        try:
            scores = checked_scores(returned, "task.test", self.task.metric)
            if "trial" in scores:  # the key that says whose scores they are
                raise KeyError("task.test returned a score named 'trial'; name it otherwise")
        except (TypeError, KeyError) as err:
            self.say(f"note: the test of {where} is not kept: {err.args[0]}; the "
                     "study's results are written")
            return None
        written = report.record_test(self.out_dir, number, scores)
        if written is None:
            return None  # another process saved a better model meanwhile: its test is its own
        unfinished = [f"{k} {v}" for k, v in scores.items() if not math.isfinite(v)]
        if unfinished:  # kept as JSON keeps them: null
            self.say(f"note: the test of {where} gave {', '.join(unfinished)}, no finite "
                     "number (kept as null)")
        return written

    def report_interrupted(self, study: optuna.Study, elapsed_s: float,
                           trials_this_run: int | None = None, *, beyond_engine: bool = False,
                           **run: Any) -> int:
        """``results.json``/``.csv`` of an interrupted run: every finished trial, and this run
        appended to the runs (no plots; the next run draws them; none where the study had all
        its trials when the run opened it and the run finished none) with the trials it finished,
        its figures up to the interrupt where the engine had started (usage, timeline,
        overhead: `run_engine`) and ``run``'s entries (``ranks`` under MPI, where ``devices``
        and the usage are rank 0's); ``elapsed_s``: see `record_ending`. Returns how many
        finished trials the study has (what ``results.json`` lists)."""
        from scamp_jax.hpo import report

        run_info: dict[str, Any] = {"policy": self.settings.policy,
                                    "devices": len(self.devices),
                                    "memory_per_device": self.memory_per_device,
                                    "search": self.settings.run_record()}
        if self.interrupted_result is not None:
            run_info.update(report.run_summary(self.interrupted_result, len(self.devices),
                                               self.memory_per_device))
        if self.overhead is not None:
            run_info["overhead"] = self.overhead
        # the engine's clock where it had started, the clock of the run's usage and timeline
        if beyond_engine or "elapsed_s" not in run_info:
            run_info["elapsed_s"] = elapsed_s
        run_info.update(interrupted=True, trials_this_run=trials_this_run, **run)
        # an interrupted rerun of a full study trained nothing either: no run is added
        idle = self.nothing_to_run and not trials_this_run
        records = report.trial_records(study, self._metrics())
        report.write_results(self.out_dir, records, metric=self.task.metric,
                             direction=self.task.direction, run=None if idle else run_info)
        return len(records)

    def record_ending(self, study: optuna.Study, elapsed_s: float,
                      trials_this_run: int | None, err: BaseException, *,
                      beyond_engine: bool = False, **run: Any) -> None:
        """The record of a run that ``err`` ended: every finished trial in ``results.json`` /
        ``.csv`` and this run, with why it stopped (`report_interrupted`), for an interrupt,
        the repeated-failure guard (its trials and error) or any other error (a bug in the
        search space's ``suggest``, the storage's). A run that a budget too small for any
        candidate stopped, or any error while no trial of the study ran
        (`scamp_jax.hpo.study.storage.ever_ran`) nor one of this run ended, writes nothing; a
        study of no trials, or of a budget too small, forgets its settings where no trial ran
        (`forget_if_unused`), so the rerun the error advises starts anew (trials that trained
        and went back keep them: their checkpoints resume under them). A
        failure to write the record is said; ``err`` goes on either way (``run``: more
        entries of the run, e.g. ``ranks``). ``elapsed_s`` is the run's where the engine had
        not started, or with ``beyond_engine`` (an MPI run: the other ranks' and the spanning
        trials' time too); else the engine's own clock, that of its usage and overhead."""
        from scamp_jax.hpo.intake import BudgetTooSmallError
        from scamp_jax.hpo.study.storage import ever_ran
        from scamp_jax.hpo.trial import ending

        if isinstance(err, RepeatedFailureError):
            run.update(stopped="repeated failures", failures={
                "trials": list(err.trials), "reason": err.reason, "traceback": err.traceback})
        elif not isinstance(err, KeyboardInterrupt):
            if isinstance(err, BudgetTooSmallError) or not study.get_trials(deepcopy=False):
                self.forget_if_unused(study)
                return
            if not ever_ran(study) and not trials_this_run:
                return  # nothing ran (its first suggest raised): nothing to record
            run.update(stopped="error", error=ending(err)[1])
        try:
            finished = self.report_interrupted(study, elapsed_s, trials_this_run,
                                               beyond_engine=beyond_engine, **run)
            if isinstance(err, KeyboardInterrupt):  # what the stop kept, for its last line
                err.add_note(kept_note(finished, self.out_dir))
        except Exception as failure:  # noqa: BLE001 - the run's own error, not this, ends it
            print(f"could not record the stopped run in {self.out_dir}: "
                  f"{type(failure).__name__}: {failure}", file=sys.stderr, flush=True)

    def _metrics(self) -> list[str]:
        return [self.task.metric] + ([self.baseline] if self.baseline else [])


#: How a stopped run's record (`StudySession.record_ending`) notes on the stop's exception
#: what it kept (`kept_note`): a command line's last line says it (`stop_kept`).
KEPT_NOTE = "kept: "


def kept_note(finished: int, out_dir: Path) -> str:
    """The note a stop's ``KeyboardInterrupt`` carries once its run is recorded."""
    if not finished:
        return (f"{KEPT_NOTE}no trial of the study has finished yet (its plans and the "
                "checkpoints of trials under way are kept)")
    trials = "trial is" if finished == 1 else "trials are"
    return (f"{KEPT_NOTE}the study's {finished} finished {trials} in its database and "
            f"{out_dir / 'results.json'}")


def stop_kept(err: BaseException) -> str | None:
    """What a stopped run kept (`kept_note`, without its prefix), or None: not recorded."""
    notes = [n for n in getattr(err, "__notes__", ()) if n.startswith(KEPT_NOTE)]
    return notes[-1][len(KEPT_NOTE):] if notes else None


def run_search(
    space: SearchSpace,
    task: Task,
    settings: SearchSettings,
    *,
    devices: Sequence[jax.Device],
    memory_per_device: int,
    live: bool = True,
    baseline: str | None = None,
    title: str = "search",
    plan_fn: Callable[..., Any] | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Open (or resume) the study of ``settings``, run it, and write its report: what
    `run_study` does with its arguments gathered (`run_study` is the call to start with).

    Under ``mpirun`` with several ranks (`scamp_jax.distributed.launched_under_mpi`) this is
    `scamp_jax.distributed.engine.run_search_mpi` (collective: every rank calls it), with the
    same settings meaning the same.

    Args:
      space, task: the `SearchSpace` searched and the `Task` its trials train and score.
      settings: the study's `SearchSettings`.
      devices: the JAX devices of the pool, in order.
      memory_per_device: each device's pool, in bytes (an int; `run_study` takes sizes such
        as ``"2GiB"`` and works out a default).
      live: show the trials' progress while it runs (a table on a terminal, lines otherwise).
      baseline: a second score printed beside the metric (e.g. ``"bicubic_psnr"``).
      title: the study's name in the opening lines and the report.
      plan_fn: plans a trial in place of the planner (``plan_mesh``'s arguments; for tests and
        simulations); None: the planner.
      console: a ``rich.console.Console`` to write to; None: standard output.

    Returns:
      The ``results.json`` payload's ``run`` section plus ``best`` (a results row or None) and
      ``test`` (the best model's scores on the task's ``test``; None where it has none, or
      took none).
    """
    with lasting_frozen(), sigterm_stops():  # a scheduler's SIGTERM stops it as Ctrl-C does
        return _run_search(space, task, settings, devices=devices,
                           memory_per_device=memory_per_device, live=live, baseline=baseline,
                           title=title, plan_fn=plan_fn, console=console)


def _run_search(space: SearchSpace, task: Task, settings: SearchSettings, **kwargs: Any
                ) -> dict[str, Any]:
    from scamp_jax.distributed.mpi import launched_under_mpi
    kwargs["memory_per_device"] = held_budget(kwargs["devices"], kwargs["memory_per_device"])
    if launched_under_mpi():
        from scamp_jax.distributed.engine import run_search_mpi

        return run_search_mpi(space, task, settings, session=StudySession, **kwargs)
    session = StudySession(space, task, settings, **kwargs)
    source = session.trial_source(session.open())
    session.greet(source)
    started = time.monotonic()
    try:
        _, result = session.run_engine(source)
    except (KeyboardInterrupt, Exception) as err:
        # The record grows on a stop too: finished trials and this run's wall time.
        session.record_ending(source.study, time.monotonic() - started, source.told, err)
        raise
    finally:
        source.close()
    from scamp_jax.hpo.report import run_summary

    return session.report(source, run_summary(result, len(kwargs["devices"]),
                                              kwargs["memory_per_device"]))


def run_study(
    space: SearchSpace,
    task: Task,
    *,
    trials: int,
    steps: int,
    study_dir: str | Path = "runs/study",
    devices: Sequence[jax.Device] | int | None = None,
    memory_per_device: int | str | None = None,
    live: bool | None = None,
    baseline: str | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Run (or resume) a memory-aware search of ``space`` on ``task`` and write its report.

    Each trial's configuration comes from Optuna (``space.suggest``); the planner sizes it
    (model-parallel degree, the largest global batch that fits ``memory_per_device``); the
    ScaMP policy packs trials onto ``devices`` so that their memory is used; every trial
    trains ``steps`` steps and is scored by ``task.evaluate``. Calling again with the same
    ``study_dir`` resumes: finished trials are kept, interrupted ones restart from their last
    checkpoint, and only the missing trials run. Under ``mpirun`` every rank calls it and the
    ranks share the study.

    On CPU, split the host into several devices first (before JAX creates an array), e.g.
    ``scamp_jax.configure_for_search(8)`` at the top of the script.

    Args:
      space: the model family (`SearchSpace`).
      task: what candidates train on and how they are scored (`Task`; `FunctionTask` builds one
        from plain functions).
      trials: total trials of the study.
      steps: training steps per trial (at ``reference_batch`` when that is set).
      study_dir: directory of ``study.db`` (the Optuna study, SQLite), ``checkpoints/``,
        ``results.json``, ``results.csv``, ``best_model/`` and the plots, and of
        ``outputs.json``, which names the study whose outputs those are (`claim_outputs`);
        another ``study_name`` keeps its outputs in ``study_dir/NAME``.
      devices: the device pool: a list of JAX devices, a count (the first ``n``), or None (all).
      memory_per_device: budget per device in bytes or as text (``"2GiB"``). None: the device
        limit on accelerators; on CPU devices, which report none, an equal share of
        `CPU_MEMORY_SHARE` of the host's memory (physical, or a container's limit).
      live: a live table of devices and trials (None: when stdout is a terminal,
        `scamp_jax.hpo.live.is_terminal`; False: log lines).
      baseline: a second score of ``task.evaluate`` to print beside the metric (e.g. a trivial
        predictor's), or None.
      **settings: any other field of `SearchSettings` (``policy``, ``sampler``, ``pruner``,
        ``seed``, ``storage``, ``fuse``, ``study_name``, ``max_batch_size``, ...).

    Returns:
      The ``run`` section of ``results.json`` (``elapsed_s`` in seconds, ``devices``,
      ``memory_per_device`` in bytes, ``usage``, ``trials_this_run``, ...) plus ``best``: the
      best trial's results row (``number``, ``params``, ``batch_size``, ``devices``, the
      metric, ...) or None when no trial completed, and ``test``: where the task has a
      ``test``, ``{"trial": number, **scores}`` of the best trial's model on the task's test
      data (None: no test, or it failed; the note says why).

    Raises:
      ValueError: a setting out of range, a ``study_dir`` that cannot be written or holds
        another study's outputs, a ``storage`` that is no database URL, a fixed policy wider
        than the pool (the message names it and what to pass).
      TypeError: a keyword that is not a `SearchSettings` field, a ``space`` that is no
        `SearchSpace`, a ``task`` without a `Task`'s parts.
      scamp_jax.BudgetTooSmallError: no candidate fits the devices' memory.
      scamp_jax.RepeatedFailureError: trials raised the same error before any completed (a
        bug in the task; those of ``failure_limit`` runs, 3 by default, or of two runs of
        first tries when the run had nothing more to train): they went back to the study,
        and the message ends with the last one's traceback.
      KeyboardInterrupt: Ctrl-C, or SIGTERM where the program has no handler of its own (as
        ``scamp_jax._signals.Terminated``): the running trials checkpointed and went back to
        the study; calling it again resumes them. A second Ctrl-C while they stop raises at
        once; their threads still end at their next step, and compiles under way run to
        their end (a script's interpreter waits for both before it exits).
    """
    if "initial_params" in settings:
        settings["initial_params"] = tuple(settings["initial_params"])
    check_space_and_task(space, task)
    try:
        config = SearchSettings(trials=trials, steps=steps, study_dir=study_dir, **settings)
    except TypeError as err:
        raise TypeError(f"run_study: {err}; see scamp_jax.SearchSettings for the settings it "
                        "takes") from None
    from scamp_jax._units import parse_bytes
    from scamp_jax.devices import configure_device_memory
    from scamp_jax.hpo.live import is_terminal
    from scamp_jax.planning import planner

    # The allocator's pool set before the first device query (it starts JAX's backend); when
    # the caller already started JAX, configure_for_search at the top of the script counts.
    memory = None if memory_per_device is None else parse_bytes(memory_per_device)
    configure_device_memory(pool_bytes=memory)
    pool = planner.resolve_devices(devices)
    budget = default_budget(memory, pool)
    return run_search(space, task, config, devices=pool, memory_per_device=budget,
                      live=is_terminal(sys.stdout) if live is None else live,
                      baseline=baseline,
                      title=space.name)


def fusion_line(requested: SearchSettings, settings: SearchSettings, platform: str
                ) -> str | None:
    """The opening line on fusion of a study ``requested`` with these settings and run with
    ``settings`` (`SearchSettings.on_platform`) on ``platform`` devices; None on CPU devices
    without fusion (nothing to say)."""
    from scamp_jax.hpo.trial import fusion_cap

    cap = fusion_cap(settings.fuse)
    stream = (f"a {platform} device runs one compute stream, so trials packed side by side on "
              "one take turns")
    if cap is not None and requested.fuse is None:
        return (f"fusion: trials of one architecture train as one vmapped group of up to {cap} "
                f"on their plan's devices, by default on {platform} devices: {stream}, and a "
                "group is one program that fills it (fuse=1 or --fuse 1 turns it off)")
    if cap is not None:
        return (f"fusion: trials of one architecture train as one vmapped group of up to {cap} "
                f"on their plan's devices (fuse={settings.fuse!r})")
    if platform == "cpu":
        return None
    why = "the grid sampler sets every parameter" if settings.sampler == "grid" else (
        f"fuse={settings.fuse!r}")
    return f"fusion: off ({why}): {stream}"


def held_budget(devices: Sequence[jax.Device], memory_per_device: int) -> int:
    """``memory_per_device``, or less where the GPU allocators preallocated smaller pools (the
    device had less free memory than their limit, `scamp_jax.devices.held_pool_bytes`): plans
    and the ledger must fit what the allocator really holds. Bytes."""
    from scamp_jax import devices as device_setup

    preallocated = os.environ.get(device_setup.PREALLOCATE_VAR, "").lower() in ("true", "1")
    if not preallocated or any(d.platform != "gpu" for d in devices):
        return memory_per_device  # XLA's GPU client preallocates; nothing else does
    held = device_setup.held_pool_bytes(devices)
    # The one region is the limit rounded down to the allocator's 256-byte unit.
    if held is None or held >= memory_per_device - (1 << 20):
        return memory_per_device
    log.warning("the GPU allocator holds a pool of %d bytes, less than the budget of %d: the "
                "study plans for the pool (another process holds the rest of the GPU)", held,
                memory_per_device)
    return held


def default_budget(memory_per_device: int | str | None, devices: Sequence[jax.Device]) -> int:
    """Per-device budget in bytes: the argument, the accelerators' limit, or a share of the host.

    CPU devices report no memory limit; they split `CPU_MEMORY_SHARE` of the host's memory
    (`scamp_jax.devices.host_memory_bytes`: physical, or a container's limit) equally.
    """
    from scamp_jax.devices import host_memory_bytes
    from scamp_jax.planning.budget import Budget

    if memory_per_device is not None or any(d.platform != "cpu" for d in devices):
        return Budget.of_devices(devices, memory_per_device).memory_per_device
    host = host_memory_bytes()
    if host is None:
        raise ValueError("this system reports no memory size for its CPU devices; pass "
                         "memory_per_device, e.g. '1GiB'")
    return int(CPU_MEMORY_SHARE * host) // len(devices)


def grid_note(source: Any, trials: int) -> str | None:
    """The line that says a grid study ended before ``trials`` because its grid is done
    (None: not a grid, the grid still has points, or every trial ran)."""
    points = source.grid_points
    if points is None:
        return None
    finished = source.finished()
    if finished >= trials or not source.grid_done():
        return None
    return f"the grid's {points} points are done; {finished} of {trials} trials ran"
