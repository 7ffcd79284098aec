"""Ask-and-tell over an opened study: `OptunaTrialSource`, the engine's local `TrialSource`."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import math
import numbers
import threading
import warnings
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from scamp_jax._signals import stops_held
from scamp_jax.hpo.settings import HEARTBEAT_INTERVAL
from scamp_jax.hpo.study import owner
from scamp_jax.hpo.study.storage import (
    StudyHandle,
    quiet_optuna,
    quiet_study_creation,
    retried_from,
    retry_callback,
    stopped_attempt,
)
from scamp_jax.hpo.study.trials import (
    CHECKPOINT_KEY,
    CONFIGURATION,
    FAIL_REASON,
    HELD_SIBLINGS,
    INTERRUPTED,
    SIBLING_OF,
    AskedTrial,
    AskLater,
    TrialOutcome,
    python_value,
    when_full,
)
from scamp_jax.space import SearchSpace

log = logging.getLogger(__name__)


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


#: `OptunaTrialSource._ask_once`'s answer when the space's ``suggest`` pruned the trial
_REJECTED = object()


class OptunaTrialSource:
    """`TrialSource` over an Optuna study; safe to call from several threads and processes.

    Any number of sources (in one process or many, on hosts sharing the database) may work on
    one study: a source asks a trial only while finished plus running trials of all processes
    are fewer than ``n_trials``. While other processes' trials run (whether or not this source
    has trials of its own running), a study with a heartbeat answers `AskLater` (ask again in
    ``poll_seconds``) until they finish or their heartbeat goes stale, then hands out the
    retries of the dead ones; ``ask`` itself never waits. A `StudyHandle` (from `open_study`)
    brings liveness and the cross-process ask lock; a plain Optuna study is used as it is.

    Args:
      study: the study: a `StudyHandle` from `open_study`, or a plain ``optuna.Study``.
      space: the search space whose ``suggest`` draws configurations.
      n_trials: the study's total number of trials (finished ones from earlier runs count).
      poll_seconds: seconds an `AskLater` answer asks the caller to wait before asking again.
      root: the study's directory; a told ``checkpoint`` attribute under it is stored relative
        to it, so a copied study folder still finds its checkpoints.
      recover_running: fail every trial left ``RUNNING`` now and queue it again, without
        waiting for its heartbeat to go stale: only for a process that owns the study alone
        (e.g. one MPI job whose ranks die together), or a study without a heartbeat.
      siblings: after the sampler proposes a trial, hold up to this many *siblings* for the same
        asker: trials with its architecture fixed (every parameter but ``training_keys``) and
        the training hyperparameters left to the sampler, so that an engine can fuse them
        (`scamp_jax.planning.fusion`). The asker gets them before any new proposal, each
        ``study.enqueue_trial``-ed with its partial parameters and asked at once under the ask
        lock; queued retries still go first. Held siblings count as taken, here and, through
        their proposal's ``HELD_SIBLINGS`` user attribute, in every other process, so the study
        never passes ``n_trials``. A proposal told finished gives up its unasked siblings
        (nothing left to fuse with), as does a process that dies; later asks propose afresh.
        0: none.
      training_keys: parameters siblings leave to the sampler (e.g. the learning rate).

    Raises:
      ValueError: ``n_trials`` below 1, ``siblings`` below 0, or siblings on a plain study
        (they are asked under the ask lock of a `StudyHandle`).
    """

    def __init__(self, study: StudyHandle | optuna.Study, space: SearchSpace, n_trials: int, *,
                 poll_seconds: float = 1.0, root: str | Path | None = None,
                 recover_running: bool = False, siblings: int = 0,
                 training_keys: Sequence[str] = ()) -> None:
        if n_trials < 1:
            raise ValueError(f"{n_trials=} must be at least 1")
        if siblings < 0:
            raise ValueError(f"{siblings=} must be >= 0 (trials held per proposal)")
        handle = study if isinstance(study, StudyHandle) else None
        if siblings and handle is None:
            raise ValueError(
                f"siblings={siblings} (fused groups) need a study opened by "
                "scamp_jax.hpo.study.open_study, whose ask lock keeps a sibling's enqueue and "
                "ask together; open the study with open_study(...) or use siblings=0")
        self.siblings = int(siblings)
        self.training_keys = frozenset(training_keys)
        #: per asker, a line per trial ``suggest`` pruned (it counts, but nothing trains it)
        #: for that asker's engine to say (`take_rejected`; the last 64 are kept)
        self._rejected: dict[Hashable, collections.deque[str]] = {}
        self.study: optuna.Study = handle.study if handle else study  # type: ignore[assignment]
        self.space = space
        self.n_trials = n_trials
        self.poll_seconds = poll_seconds
        self.root = None if root is None else Path(root).resolve()
        self._storage = handle.storage if handle else None
        self._ask_lock: Any = handle.ask_lock if handle else contextlib.nullcontext
        self._study_id = (self._storage.get_study_id_from_name(self.study.study_name)
                          if self._storage else None)
        # Optuna's RDB storage is thread-safe, but the sampler's state (TPE's RNG) is not.
        self._lock = threading.Lock()
        self._live: dict[int, optuna.Trial] = {}
        self._ids: dict[int, int] = {}  # live trial number -> storage trial id (heartbeats)
        #: asker -> siblings held for it: (the proposed trial's number, its fixed parameters).
        self._held: dict[Hashable, list[tuple[int, dict[str, Any]]]] = {}
        #: trials of dead processes this source failed and queued again (numbers).
        self.recovered: list[int] = []
        #: live trials another process failed as stale (their results were dropped).
        self.lost: list[int] = []
        #: trials this source has told (finished here: complete, pruned or failed)
        self.told = 0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        with self._lock, self._ask_lock():  # retries are queued under the ask lock
            if recover_running:
                self._recover_running()
            self._fail_stale()

    @property
    def has_liveness(self) -> bool:
        """Whether the study's storage has a heartbeat (opened by `open_study`)."""
        return self._storage is not None

    # -- liveness -------------------------------------------------------------------------------
    def _fail_stale(self) -> None:
        """Fail trials whose heartbeat went stale, and at once those of a process that has
        certainly ended on this machine (`scamp_jax.hpo.study.owner`); Optuna's callback queues
        their retries."""
        if self._storage is None:
            return
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        before = {t.number for t in running}
        failed = {trial.number for trial in running if trial.number not in self._live
                  and owner.ended(trial.user_attrs.get(owner.OWNER))
                  and self._fail_and_retry(trial.number)}
        with quiet_optuna():
            optuna.storages.fail_stale_trials(self.study)
        after = {t.number for t in self.study.get_trials(deepcopy=False,
                                                         states=(TrialState.RUNNING,))}
        ended = before - after - set(self._live) - failed
        if ended:  # failed as stale (and queued again), or finished by their own processes
            ended &= {stopped_attempt(t) for t in self.study.get_trials(deepcopy=False)}
        self.recovered.extend(sorted(failed | ended))

    def _fail_and_retry(self, number: int) -> bool:
        """Fail trial ``number``, left running by a process that is gone, and queue its retry
        (public ``tell``, then Optuna's retry callback); False where its own process finished
        it meanwhile (a trial it failed itself is not retried)."""
        try:
            frozen = self.study.tell(number, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            return False  # finished between tell's look and its write
        except ValueError:  # "Cannot tell a COMPLETE trial", as Optuna words it
            if self.study.get_trials(deepcopy=False)[number].state.is_finished():
                return False
            raise
        with quiet_optuna():
            retry_callback()(self.study, frozen)
        return True

    def requeued(self) -> list[int]:
        """Trials an earlier run stopped (Ctrl-C, or a process found dead other than by this
        source: see ``recovered``) whose retries wait in the study: their numbers. Each retry
        runs under a new number from its original's checkpoints."""
        with self._lock:
            waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        stopped = {stopped_attempt(t) for t in waiting} - {None} - set(self.recovered)
        return sorted(n for n in stopped if n is not None)

    def _recover_running(self) -> None:
        """Fail every ``RUNNING`` trial (public ``tell``) and queue a retry of each."""
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if self._fail_and_retry(trial.number):
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
        me = owner.identity()
        if me is not None:  # so that a process on this machine sees this one end (`owner`)
            try:
                self._storage.set_trial_user_attr(trial_id, owner.OWNER, me)
            except Exception as err:  # noqa: BLE001 - the heartbeat finds it ended all the same
                log.warning("trial %d: its process was not stored (%s: %s); if this process "
                            "dies, the trial is run again once its heartbeat is stale", number,
                            type(err).__name__, err)
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
    def _counts(self, trials: Sequence[FrozenTrial] | None = None) -> tuple[int, int, int]:
        """Finished (towards the total), running and waiting trials of every process."""
        if trials is None:
            trials = self.study.get_trials(deepcopy=False)
        finished = sum(_counts_towards_total(t) for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        waiting = sum(t.state == TrialState.WAITING for t in trials)
        return finished, running, waiting

    def _held_count(self, trials: Sequence[FrozenTrial] | None = None) -> int:
        """Siblings held here, plus those other processes hold for their running proposals."""
        if trials is None:
            trials = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        elsewhere = sum(int(t.user_attrs.get(HELD_SIBLINGS, 0)) for t in trials
                        if t.state == TrialState.RUNNING and t.number not in self._live)
        return sum(len(held) for held in self._held.values()) + elsewhere

    def _record_held(self, proposal: int) -> None:
        """Store how many siblings of ``proposal`` are still held (for other processes)."""
        trial = self._live.get(proposal)
        if trial is None:
            return
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            trial.set_user_attr(HELD_SIBLINGS, self._held_for(proposal))

    def _held_for(self, proposal: int) -> int:
        """(Under ``_lock``.) Siblings of ``proposal`` held here, for any asker."""
        return sum(of == proposal for held in self._held.values() for of, _ in held)

    def held_siblings(self, proposal: int) -> int:
        """Siblings of ``proposal`` still held (for any asker) and not handed out: a sibling
        asked, rejected by the space's ``suggest``, or given up (the proposal ended, its asker
        was released or found the study full) is no longer held."""
        with self._lock:
            return self._held_for(proposal)

    def _drop_held(self, proposal: int) -> None:
        """Give up the siblings still held for ``proposal`` (it ended: nothing to fuse with)."""
        for asker, held in list(self._held.items()):
            self._held[asker] = [(of, fixed) for of, fixed in held if of != proposal]

    def trained_any(self, devices: int) -> bool:
        """Whether a trial of the study trained (complete, or pruned after steps) on at most
        ``devices`` devices, in any run: a pool of that many devices of the study's budget
        (which it stores) holds a candidate."""
        trials = self.study.get_trials(deepcopy=False,
                                       states=(TrialState.COMPLETE, TrialState.PRUNED))
        return any((t.state == TrialState.COMPLETE or t.user_attrs.get("steps"))
                   and 0 < len(t.user_attrs.get("devices") or ()) <= devices
                   for t in trials)

    def finished(self) -> int:
        """Trials that count towards the total (complete, pruned, failed for their own reason)."""
        return self._counts()[0]

    def failed_for_good(self) -> int:
        """Of `finished`, the trials that failed for a reason of their own (not retried)."""
        return sum(t.state == TrialState.FAIL and _counts_towards_total(t)
                   for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))

    def remaining(self) -> int:
        """Trials still to ask: the total minus finished and running ones (of every process)
        and the siblings held here."""
        with self._lock:
            trials = self.study.get_trials(deepcopy=False)
            finished, running, _ = self._counts(trials)
            return max(0, self.n_trials - finished - running - self._held_count(trials))

    def release(self, asker: Hashable = None) -> None:
        """Drop the siblings held for ``asker`` (it asks no more): their slots are free."""
        with self._lock:
            for proposal in {of for of, _ in self._held.pop(asker, [])}:
                self._record_held(proposal)

    @property
    def grid_points(self) -> int | None:
        """Points of the study's grid (None: the sampler is not a grid)."""
        if not isinstance(self.study.sampler, optuna.samplers.GridSampler) or not self.space.grid:
            return None
        return math.prod(len(values) for values in self.space.grid.values())

    def grid_done(self, trials: Sequence[FrozenTrial] | None = None) -> bool:
        """Whether the study's grid has no point left for a new trial: every point is running
        or finished and no trial waits (a queued retry still runs). False for other samplers.

        Done when trials hold the values of every point, or when the grid sampler drew every
        point (Optuna's ``grid_id`` system attribute of trials with this grid as their
        ``search_space``): a trial whose ``suggest`` raised ``optuna.TrialPruned`` before
        drawing every value holds part of its point, visited all the same. (A grid with both,
        a rejected point and one taken by an enqueued trial the sampler did not draw, ends
        one duplicate trial late.)
        """
        points = self.grid_points
        if points is None:
            return False
        if trials is None:
            trials = self.study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials):
            return False
        keys = sorted(self.space.grid)
        taken = {tuple(t.params.get(k) for k in keys) for t in trials}
        if all(point in taken
               for point in itertools.product(*(self.space.grid[k] for k in keys))):
            return True
        grid = {k: list(self.space.grid[k]) for k in keys}
        drawn = {t.system_attrs.get("grid_id") for t in trials
                 if t.system_attrs.get("search_space") == grid}
        return len(drawn - {None}) >= points

    # -- ask-and-tell ---------------------------------------------------------------------------
    def take_rejected(self, asker: Hashable = None) -> list[str]:
        """The lines, oldest first, of the trials ``suggest`` pruned while ``asker`` asked,
        not taken before: for its engine to say (`scamp_jax.hpo.intake.Intake.ask`)."""
        with self._lock:
            lines = self._rejected.pop(asker, ())
        return list(lines)

    def ask(self, attrs: Mapping[str, Any] | None = None, *,
            asker: Hashable = None) -> AskedTrial | AskLater | None:
        """Next configuration; `AskLater` or ``None`` once the total is reached (`when_full`).

        Order: a queued trial (a retry, a warm start) first, then a sibling held for ``asker``
        (e.g. an MPI rank; None in one process), then a new proposal of the sampler. ``attrs``
        (JSON-serialisable) are stored with the trial. While trials this source did not hand
        out are running, a study with a heartbeat answers `AskLater`: they may finish, or go
        stale (their retries are then asked). ``None``: every other trial is finished.

        A space's ``suggest`` that raises ``optuna.TrialPruned`` rejects the configuration: the
        trial is stored pruned (it counts, as Optuna counts it) and the next one is asked. Any
        other exception from ``suggest`` (a bug in the space) is raised, its trial given back
        first as an interrupted one (not counted; its parameters so far queued again), so
        nothing is left running in the study.
        """
        while True:
            asked = self._ask_once(attrs, asker)
            if asked is not _REJECTED:
                return asked  # type: ignore[return-value]

    def _ask_once(self, attrs: Mapping[str, Any] | None,
                  asker: Hashable) -> AskedTrial | AskLater | None | object:
        with self._lock:
            with self._ask_lock():
                self._fail_stale()
                trials = self.study.get_trials(deepcopy=False)
                finished, running, waiting = self._counts(trials)
                held = self._held_count(trials)
                mine = self._held.get(asker, [])
                trial, proposed = None, False
                if self.grid_done(trials):
                    trial = None  # every point of the grid is running or finished
                elif waiting:
                    if mine and finished + running + held >= self.n_trials:
                        # At the total: a held sibling gives its slot to the retry.
                        self._record_held(mine.pop()[0])
                        held -= 1
                    if finished + running + held < self.n_trials:
                        trial = self._ask()
                elif mine:  # its slot is counted in ``held`` already
                    sibling_of, fixed = mine.pop(0)
                    self._record_held(sibling_of)
                    # skip_if_exists=False: siblings share their (partial) parameters on purpose.
                    self.study.enqueue_trial(fixed, user_attrs={SIBLING_OF: sibling_of},
                                             skip_if_exists=False)
                    trial = self._ask()  # under the ask lock the queue holds only this one
                elif finished + running + held < self.n_trials:
                    trial, proposed = self._ask(), True
                if trial is None:
                    foreign = [t.number for t in trials
                               if t.state == TrialState.RUNNING and t.number not in self._live]
                    answer = when_full(foreign, self.has_liveness, self.poll_seconds)
                    if answer is None and mine:  # the asker is done: its siblings are free
                        for proposal in {of for of, _ in self._held.pop(asker)}:
                            self._record_held(proposal)
                    return answer
                self._start_heartbeat(trial.number)
                # Suggest under the lock: another process counting the grid's points taken
                # sees this trial's parameters.
                try:
                    asked = self._suggest(trial, attrs or {})
                except optuna.TrialPruned as err:
                    why = f": {err}" if str(err) else " (it raised optuna.TrialPruned)"
                    self._close_unsuggested(trial, TrialState.PRUNED,
                                            f"pruned by the search space's suggest{why}")
                    self._rejected.setdefault(asker, collections.deque(maxlen=64)).append(
                        f"trial {trial.number} pruned by the search space's suggest{why}")
                    return _REJECTED
                except BaseException:
                    self._close_unsuggested(trial, TrialState.FAIL, INTERRUPTED)
                    raise
                if proposed and self.siblings:
                    room = self.n_trials - finished - running - 1 - held
                    count = max(0, min(self.siblings, room))
                    # the sampler's parameters that are keys of the configuration (what
                    # suggest derives, a function or a NumPy value, it derives again, and a
                    # parameter a training key is derived from, e.g. a log10_lr, stays the
                    # sampler's), not suggest's whole configuration, which Optuna stores
                    fixed = {k: v for k, v in trial.params.items()
                             if k in asked.params and k not in self.training_keys}
                    self._held.setdefault(asker, []).extend(
                        (asked.number, dict(fixed)) for _ in range(count))
                    self._record_held(asked.number)
                    asked = replace(asked, siblings=count)
            return asked

    def _close_unsuggested(self, trial: optuna.Trial, state: TrialState, reason: str) -> None:
        """End a trial whose ``suggest`` raised (``reason``: its `FAIL_REASON`). A failed one
        is queued again first, as an interrupted trial is: a retry, a warm start or a grid
        point it came from is asked again on the next run, not lost."""
        trial_id = self._ids.pop(trial.number, None)  # no more heartbeats
        self._live.pop(trial.number, None)
        trial.set_user_attr(FAIL_REASON, reason)
        if state == TrialState.FAIL:
            self._fail_with_retry(trial, trial_id)
        else:
            self.study.tell(trial, state=state, skip_if_finished=True)

    def _fail_with_retry(self, trial: optuna.Trial, trial_id: int | None) -> None:
        """Queue ``trial``'s parameters again under its checkpoint key, then fail it (see
        `interrupt` for the order); nothing where another process failed it as stale already
        (that one queued its retry)."""
        frozen = (self._storage.get_trial(trial_id)
                  if self._storage is not None and trial_id is not None else
                  next(t for t in self.study.get_trials(deepcopy=False)
                       if t.number == trial.number))
        if frozen.state != TrialState.RUNNING:
            return
        with quiet_optuna():
            retry_callback()(self.study, frozen)
        self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)

    def _ask(self) -> optuna.Trial:
        with quiet_optuna():
            return self.study.ask()

    def _suggest(self, trial: optuna.Trial, attrs: Mapping[str, Any]) -> AskedTrial:
        params = self.space.suggest(trial)  # first: a trial killed before it has no params
        if not isinstance(params, Mapping):
            raise TypeError(f"space.suggest returned {type(params).__name__} {params!r}; it must "
                            "return a dict of the trial's configuration, e.g. {'width': "
                            "trial.suggest_int('width', 16, 64)}")
        for name, value in attrs.items():
            trial.set_user_attr(name, value)
        _say_optimizer_aliases(params)
        whole = _stored_configuration(params, trial.params)
        if whole is not None:
            trial.set_user_attr(CONFIGURATION, whole)
        # its record of the trials it retries (Optuna keeps it with the stored trial)
        frozen = (self._storage.get_trial(self._ids[trial.number])
                  if self._storage is not None and trial.number in self._ids
                  else self.study.get_trials(deepcopy=False)[trial.number])
        key = trial.user_attrs.get(CHECKPOINT_KEY)
        if key is None:
            origin = retried_from(frozen)
            key = f"trial_{trial.number if origin is None else origin}"
            trial.set_user_attr(CHECKPOINT_KEY, key)
        self._live[trial.number] = trial
        sibling_of = trial.user_attrs.get(SIBLING_OF)
        return AskedTrial(trial.number, dict(params), key,
                          sibling_of=None if sibling_of is None else int(sibling_of),
                          retry_of=stopped_attempt(frozen))

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

    def progress(self, number: int, wall_seconds: float) -> None:
        """Store ``wall_seconds`` (what live trial ``number``'s runs took up to its newest
        checkpoint) with it: an attempt whose process dies keeps them, and its retry's record
        adds them (`scamp_jax.hpo.report.trial_records`); its outcome (`tell`, `interrupt`)
        writes its whole seconds over them. Nothing where the trial is no longer this
        process's (failed as stale by another one). Called from the trial's own thread, it
        does not wait for an ask of another trial (the sampler's lock)."""
        trial = self._live.get(number)
        if trial is None:
            return
        try:
            trial.set_user_attr("wall_seconds", round(float(wall_seconds), 3))
        except optuna.exceptions.UpdateFinishedTrialError:
            pass

    @stops_held()  # a Ctrl-C never splits its writes (`scamp_jax._signals`)
    def tell(self, outcome: TrialOutcome) -> None:
        """Store the outcome (state, value, reason, attributes) of a live trial. Where the
        storage refuses it, the trial stays live (its error goes on), so that the run's end
        gives it back (`interrupt`) instead of leaving it running until its heartbeat lapses."""
        with self._lock:
            self._drop_held(outcome.number)
            trial = self._live.pop(outcome.number)
            trial_id = self._ids.pop(outcome.number, None)
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
                told = self.study.tell(trial, value, state=state, skip_if_finished=True)
                if told.state != state:  # failed as stale meanwhile: its retry owns the slot
                    self.lost.append(outcome.number)
            except optuna.exceptions.UpdateFinishedTrialError:
                self.lost.append(outcome.number)  # failed as stale; its retry owns the slot
            except BaseException:
                self._live[outcome.number] = trial
                if trial_id is not None:
                    self._ids[outcome.number] = trial_id
                raise
            self.told += 1

    @stops_held()  # a Ctrl-C never splits its writes (`scamp_jax._signals`)
    def interrupt(self, number: int, wall_seconds: float = 0.0) -> None:
        """Fail a live trial as interrupted and queue its parameters under its checkpoint key;
        ``wall_seconds`` (what its runs took, if it ran) are stored with it, for its retry's
        record (`scamp_jax.hpo.report.trial_records`).

        The retry is queued first: a process stopped before the trial is failed (a second
        Ctrl-C) leaves the trial ``RUNNING`` with its retry queued, and the heartbeat fails it
        later without queueing it again (`retry_callback`); the other order would leave a
        failed trial that nothing retries.
        """
        with self._lock, self._ask_lock():  # as `ask`: no other process queues it meanwhile
            trial = self._live.pop(number, None)
            trial_id = self._ids.pop(number, None)
            if trial is None:
                return
            try:
                if wall_seconds > 0:
                    trial.set_user_attr("wall_seconds", round(float(wall_seconds), 3))
                trial.set_user_attr(FAIL_REASON, INTERRUPTED)
                self._fail_with_retry(trial, trial_id)
            except optuna.exceptions.UpdateFinishedTrialError:
                return  # failed as stale by another process, which queued it again


def _stored_configuration(params: Mapping[str, Any],
                          drawn: Mapping[str, Any]) -> dict[str, Any] | None:
    """What `CONFIGURATION` stores for a trial: the whole configuration where ``suggest``
    returned keys Optuna did not draw, or changed a drawn value under its key (``8 *
    trial.suggest_int("width", 1, 4)``, a value set over the draw), so the results show what
    the trial trained (None: Optuna's ``params`` are all of it). A value JSON cannot hold (the
    storage's format; NumPy scalars are stored as Python numbers) is left out, said once per
    key: `load_model` derives it again through ``suggest`` from the parameters Optuna drew."""
    if all(k in drawn and _same_value(python_value(v), drawn[k]) for k, v in params.items()):
        return None
    whole = {}
    for key, value in params.items():
        value = python_value(value)  # a NumPy number or flag: stored as Python's
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            if key not in _UNSTORED:
                _UNSTORED.add(key)
                log.warning(
                    "the configuration's %r (%s) is not stored with its trials (the study "
                    "stores JSON): results leave it out (or show Optuna's draw under its "
                    "name), and scamp_jax.load_model makes %r again through the space's suggest "
                    "from the draws (results' drawn)",
                    key, type(value).__name__, key)
            continue
        whole[key] = value
    return whole


def _same_value(value: Any, drawn: Any) -> bool:
    """Whether a configuration's ``value`` is Optuna's ``drawn`` one: equal numbers are (a
    grid's NumPy ``4`` or ``4.0`` returned by ``suggest_int`` as ``4``), a flag only as a flag
    (a drawn ``1`` returned as ``True`` is changed), anything else of its type and equal (an
    array never is a drawn value)."""
    drawn = python_value(drawn)
    if isinstance(value, bool) or isinstance(drawn, bool):
        return type(value) is type(drawn) and value == drawn
    if isinstance(value, numbers.Number) and isinstance(drawn, numbers.Number):
        return bool(value == drawn)
    try:
        return type(value) is type(drawn) and bool(value == drawn)
    except (TypeError, ValueError):
        return False


#: Spellings of the optimizer's keys (lower case, without ``_`` and ``-``) that are not them.
_OPTIMIZER_ALIASES = {"lr": "learning_rate", "learningrate": "learning_rate",
                      "wd": "weight_decay", "weightdecay": "weight_decay", "beta1": "b1",
                      "beta2": "b2"}
#: Configuration keys `_say_optimizer_aliases` warned of (once each per process).
_ALIASES_SAID: set[str] = set()


def _say_optimizer_aliases(params: Mapping[str, Any]) -> None:
    """Warn, once per key, of a configuration key that reads as one of the optimizer's
    (``lr``, ``weightDecay``) but is not its name: AdamW would train at its default for it,
    and the key would count as architecture (trials differing in it share no compile)."""
    from scamp_jax.hpo.trial import OPTIMIZER_KEYS

    for key in params:
        meant = _OPTIMIZER_ALIASES.get(str(key).lower().replace("_", "").replace("-", ""))
        if meant is None or key == meant or meant in params or key in _ALIASES_SAID:
            continue
        _ALIASES_SAID.add(key)
        log.warning(
            "the configuration's %r reads as the optimizer's %r, which it is not: the trials' "
            "AdamW takes %s and trains at its default %s; every other key goes to build, as "
            "architecture. Return it as %r", key, meant, ", ".join(OPTIMIZER_KEYS), meant, meant)


#: Configuration keys `_stored_configuration` said it leaves out (once each per process).
_UNSTORED: set[str] = set()


def check_initial_params(space: SearchSpace, initial: Sequence[Mapping[str, Any]]) -> None:
    """Raise `ValueError`, naming the configuration, unless each of a warm start's
    ``initial`` configurations is one ``space.suggest`` takes: a value it cannot draw (not one
    of a categorical's choices) and a key it neither draws nor returns (a misspelling) are
    refused before the study stores them (a queued configuration that ``suggest`` refuses
    would be queued again on every run). A value outside a range ``suggest`` draws from is
    kept, as Optuna keeps it, and said. Keys left out are drawn by the sampler. ``suggest``
    runs once per configuration, on a scratch study in memory (a ``suggest`` that keeps state
    of its own between calls sees that call)."""
    for i, params in enumerate(initial):
        where = f"initial_params[{i}] = {dict(params)!r}"
        trial = _scratch_trial(params=params)  # what the study's first ask would give
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                returned = space.suggest(trial)
            except optuna.TrialPruned:  # suggest rejects it: the study records it pruned
                continue
            except (ValueError, TypeError) as err:
                raise ValueError(f"{where}: the space's suggest cannot take it ({err}); pass "
                                 "values it can draw") from None
        taken = set(trial.params) | set(returned if isinstance(returned, Mapping) else ())
        unknown = sorted(set(params) - taken)
        if unknown:
            raise ValueError(
                f"{where} names {', '.join(map(repr, unknown))}, which the space's suggest "
                f"neither draws nor returns (it draws {sorted(trial.params)}); check the "
                "spelling")
        for warning in caught:
            log.warning("%s: %s", where, warning.message)


def check_grid(space: SearchSpace, sampler: str, seed: int) -> None:
    """Under ``sampler="grid"``, raise `ValueError` where the space's grid lacks a parameter
    its ``suggest`` draws (found on the grid's first point: a parameter drawn only on other
    branches of ``suggest`` is found when a trial draws it), before the study stores a trial
    (each run's first trial failed on it, and was queued again)."""
    if sampler != "grid":
        return
    from scamp_jax.hpo.study.samplers import make_sampler

    _check_grid_choices(space)
    trial = _scratch_trial(make_sampler("grid", seed, space.grid))
    try:
        space.suggest(trial)
    except optuna.TrialPruned:
        return
    except ValueError as err:
        if "not found in the given grid" not in str(err):
            raise
        grid = sorted(space.grid or {})
        raise ValueError(
            f"the search space's grid gives values for {grid}, but suggest also draws a "
            f"parameter it lacks ({err}); give SearchSpace(grid=...) the values of every "
            "parameter suggest draws") from None


def _check_grid_choices(space: SearchSpace) -> None:
    """Raise `ValueError` where the space's grid gives a parameter a value that is none of
    the choices ``suggest`` draws it from (Optuna's own words, "'128' not in (64, 256).",
    name no parameter; the trial of that point would fail), or gives more than one value to
    a parameter ``suggest`` draws at none of its points (a misspelling, one it does not
    search: Optuna's grid sampler would train every configuration once per value of it).
    Every point of a grid of at most `_GRID_POINTS_TRIED` is tried
    (`optuna.trial.FixedTrial`); of a larger one, each value once, the other parameters at
    their first values, and a parameter not drawn is only warned of. The parameter blamed
    for a value is the one whose draw raised."""
    grid = dict(space.grid or {})
    base = {name: values[0] for name, values in grid.items() if len(values)}
    points = math.prod(len(values) for values in grid.values())
    if points <= _GRID_POINTS_TRIED:  # every point: which parameters suggest draws is exact
        names = list(grid)
        tried = [dict(zip(names, values, strict=True))
                 for values in itertools.product(*grid.values())]
    else:
        tried = [{**base, name: value} for name, values in grid.items() for value in values]
    drawn_names: set[str] = set()
    answered = False
    for given in tried:
        trial = _ChoiceProbe(given)
        try:
            with warnings.catch_warnings():  # a number outside a range: Optuna warns
                warnings.simplefilter("ignore")
                space.suggest(trial)
        except ValueError as err:
            drawn = trial.drawing
            if drawn is None or drawn not in grid or " not in (" not in str(err):
                continue  # not a choice's: a point suggest cannot take is a trial's
            raise ValueError(
                f"the search space's grid gives {drawn}={given[drawn]!r}, which is "
                f"none of the choices suggest draws {drawn} from ({err}); give "
                "SearchSpace(grid=...) only values among them") from None
        except Exception:  # noqa: BLE001 - a point suggest prunes or cannot take: a trial's
            continue
        answered = True
        drawn_names |= set(trial.params)
    # one value of a parameter never drawn repeats nothing: a grid may pin a constant so
    never = [name for name in grid if name not in drawn_names and len(grid[name]) > 1]
    if not answered or not never:
        return
    said = ", ".join(map(repr, never))
    if points <= _GRID_POINTS_TRIED:
        raise ValueError(
            f"the search space's grid names {said}, which suggest draws at none of its "
            f"{points} points (it draws {sorted(drawn_names)}): every configuration would be "
            "trained once per value of it; check the spelling, or give it one value (or "
            "none) in SearchSpace(grid=...)")
    log.warning("the search space's grid names %s, which suggest drew at none of the %d points "
                "tried: where it never draws it, every configuration is trained once per value "
                "of it (check the spelling)", said, len(tried))


#: Grids of at most this many points have every point tried by `_check_grid_choices`.
_GRID_POINTS_TRIED = 512  # suggest may take milliseconds (a model built to prune)


class _ChoiceProbe(optuna.trial.FixedTrial):
    """A `optuna.trial.FixedTrial` that knows which categorical parameter it was drawing
    (``drawing``) when a value it was given turned out to be none of the choices."""

    drawing: str | None = None

    def suggest_categorical(self, name: str, choices: Any) -> Any:  # type: ignore[override]
        self.drawing = name
        value = super().suggest_categorical(name, choices)
        self.drawing = None
        return value


def _scratch_trial(sampler: optuna.samplers.BaseSampler | None = None,
                   params: Mapping[str, Any] | None = None) -> optuna.Trial:
    """A trial of a study in memory (with ``params`` queued first), on which a space's
    ``suggest`` is tried before the real study stores anything."""
    with quiet_study_creation(), quiet_optuna():
        study = optuna.create_study(sampler=sampler)
    if params is not None:
        study.enqueue_trial(dict(params))
    return study.ask()
