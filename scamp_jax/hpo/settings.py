"""How one study runs: one configuration object, validated once, from the command line down.

`EngineConfig` holds how the study's runs train and are placed (steps, batch bounds, policy,
checkpoints, fusion, the device `Budget`, ...); `SearchSettings` is an `EngineConfig` plus the
study's own settings (trials, storage, sampler, pruner, ...), and the experiments' config
(``experiments._cli.HPOConfig``) a `SearchSettings` plus their flags. `run_study`, the command
lines and ``mpirun`` all hand that one object to the study session (`scamp_jax.hpo.session`),
which gives the engine the same object with the budget and the rank filled in
(`SearchSettings.engine_config`): nothing is copied field by field on the way, and nothing
downstream reads a field by name with a default. The study gets `SearchSettings.study_record`
(what a rerun must repeat) and the trial source `SearchSettings.source_kwargs`.

This module is a leaf: it imports neither JAX nor Optuna, so ``import scamp_jax`` stays light.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scamp_jax.planning.budget import Budget
from scamp_jax.scheduling.placement import POLICIES

if TYPE_CHECKING:
    from scamp_jax.space import SearchSpace

#: Optuna samplers by name (`scamp_jax.hpo.study.make_sampler`).
SAMPLERS = ("tpe", "random", "grid")
#: Optuna pruners by name (`scamp_jax.hpo.study.make_pruner`).
PRUNERS = ("median", "halving", "none")
#: The folders a study keeps in its study_dir (`scamp_jax.hpo.report.save_best_model`, the
#: trials' checkpoints, `scamp_jax.planning.compile_cache.CACHE_DIRNAME`): no study_name.
STUDY_DIR_FOLDERS = ("best_model", "checkpoints", "jax_cache")
#: ``elastic`` -> `EngineConfig.grow_last_wave` (auto: on for accelerators, off for CPU devices).
ELASTIC = {"auto": None, "on": True, "off": False}
#: Intervals in steps that a command line scales with ``steps`` where they are not given
#: themselves (a preset's 25 of 100 steps: every 250 of 1,000), so that a trial is due as many
#: checkpoints and evaluations whatever its steps.
STEP_INTERVALS = ("checkpoint_every", "eval_every")
#: Settings that follow others where they are not given themselves: the intervals a command
#: line scales with ``steps``, and ``fuse``, which a study narrows to its ``trials``.
DERIVED_SETTINGS = {"steps": STEP_INTERVALS, "trials": ("fuse",)}
#: seconds between a live trial's heartbeats (Optuna's ``heartbeat_interval``).
HEARTBEAT_INTERVAL = 10
#: seconds without a heartbeat after which a trial's process counts as dead.
GRACE_PERIOD = 60


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How a study's runs train and are placed: what the engine, the planner's calls, the
    launcher and the runs read (the base of `SearchSettings`). Invalid values raise
    ``ValueError`` naming the field and what to pass instead.

    Attributes:
      steps: training steps per trial (at ``reference_batch`` when that is set).
      budget: the memory of each device of the pool (`scamp_jax.planning.budget.Budget`: the
        pool, the safety margin, the allowance); the engine needs one (`SearchSettings`
        get theirs from the session, `engine_config`).
      policy: ``"scamp"`` (pack trials by planned memory, each with the largest batch that fits)
        or ``"fixed"`` (the baseline: ``devices_per_trial`` devices and one batch for all).
      devices_per_trial: devices every trial gets under the fixed policy.
      max_batch_size: cap on any trial's global batch (None: as large as memory allows).
      min_batch_size: smallest global batch a ScaMP plan may train with (None: any). A
        configuration whose largest fitting batch on the whole pool is smaller does not fit
        (under MPI it spans ranks instead, see `scamp_jax.distributed.engine`); out-of-memory
        re-plans never halve a batch below it.
      reference_batch: global batch that ``steps`` refers to; a trial whose plan allows batch
        ``b`` trains ``ceil(steps * reference_batch / b)`` steps, so every trial sees the same
        number of samples (None: every trial trains ``steps`` steps).
      fixed_batch_size: the fixed policy's one batch size; None: the largest batch the space's
        ``largest`` candidate fits on ``devices_per_trial`` devices.
      checkpoint_every: steps between checkpoints (0: only at the end), at
        ``reference_batch`` (scaled for a trial's batch as its steps are: `interval_for`).
      checkpoint_min_seconds: least seconds of training between two of a run's checkpoints
        before its last: a checkpoint ``checkpoint_every`` makes due sooner after the run began
        training, or after its previous checkpoint, is not written (0: every one is). A study
        killed outright loses at most about this much plus ``checkpoint_every`` steps of each
        running trial's training, and a trial re-planned after running out of memory part-way
        resumes from its last checkpoint as well; a stopped run (Ctrl-C, SIGTERM) and a
        finished trial always write theirs.
      eval_every: steps between intermediate evaluations reported to the pruner (0: none), at
        ``reference_batch`` (scaled alike; the pruner hears the reference step).
      log_every: steps between loss read-backs.
      max_replans: out-of-memory re-plans of one trial before it is failed.
      lookahead: asked-but-unplaced trials to keep queued (None: one per device, at most as
        many as may run at once, ``max_running_trials`` runs of up to ``fuse`` trials each, so
        that other processes of the study find trials to train); a fused proposal's siblings
        are asked with it even past this.
      nofit_limit: consecutive candidates that fit nowhere, with none fitting before (in this
        run, nor a trial of the study trained on at most this pool's devices in an earlier
        one), after which the study stops with `BudgetTooSmallError`.
      failure_limit: runs (a fused group is one) whose trials raise the same error (the same
        exception at the same place) one after another, none of the run's trials having
        completed, after which the study stops with
        `scamp_jax.hpo.failures.RepeatedFailureError` and they go back to the study: a bug in
        the task fails every trial alike (0: never stop; a space that fails some
        configurations on purpose by raising). A run with fewer trials left to train stops
        when it has nothing more to train, if first tries failed alike in two runs at least
        (`scamp_jax.hpo.failures.RepeatedFailures.tripped_at_end`; not under MPI, where
        each rank keeps to the limit).
      seed: seed of the sampler, initialisation and data streams.
      rank: the MPI rank recorded with each trial (0 on a single host).
      planner_threads: configurations planned at once (each plan is a few compiles), and the
        most XLA compiles the study runs at once, trials' own included, but for one of a
        starting run's, which never waits for planning (`scamp_jax.planning.compile_slots`).
      elastic: ``"auto"``, ``"on"`` or ``"off"``: whether ScaMP puts devices that would idle at
        the end of the study to work (`grow_last_wave`).
      restart_seconds: predicted cost of an elastic restart (checkpoint, compile, restore),
        seconds; None: the trial's own start-up time in its current run.
      fuse: horizontal fusion (`scamp_jax.hpo.fused_engine`): ``K`` (after the sampler proposes
        a trial, up to ``K - 1`` siblings with its architecture are enqueued, and queued trials
        of one architecture (configurations equal but for their optimizer hyperparameters)
        train in fused groups of at most ``K``, as wide as the planner
        fits), ``"auto"`` (the planner's widest fitting group, capped), 1 (off) or None (the
        devices decide, `SearchSettings.on_platform`: ``"auto"`` on accelerators, off on CPU
        devices; the engine itself reads None as off). ``K`` is at most
        `scamp_jax.hpo.trial.MAX_FUSION_CAP` (64), and a study's `SearchSettings` lowers it to
        its ``trials`` (a group holds trials of the study). Siblings change the search: a
        proposal's family takes ``K`` of the study's trials, so a study of at most ``K``
        trials tries one architecture (its first proposal's) with ``K`` draws of the training
        hyperparameters (``"auto"``: ``K`` is `scamp_jax.hpo.trial.AUTO_FUSION_CAP`).
      max_running_trials: most trials (or fused groups) training at once, the rest queued:
        ``"auto"`` (on CPU devices, which share the host's cores, one per two cores, as
        measured in `scamp_jax.scheduling.host`; no cap on accelerators), a positive int, or
        None (as many as the pool's memory holds).
      device_overlap: how much trials sharing one device overlap, in [0, 1], for the
        scheduling core's busy fractions (`scamp_jax.scheduling.costs.shared_load`; the cluster
        simulator's ``ClusterModel.overlap``): 0, strict turns (JAX programs of several threads
        on one GPU mostly take turns on its queue, so the last wave packs no trial beside a
        measured one); 1, free overlap. None: 0 on accelerators, 1 on CPU devices, where
        ``max_running_trials`` already bounds how many trials share the host's cores.
    """

    steps: int
    budget: Budget | None = None
    policy: str = "scamp"
    devices_per_trial: int = 2
    max_batch_size: int | None = None
    min_batch_size: int | None = None
    reference_batch: int | None = None
    fixed_batch_size: int | None = None
    checkpoint_every: int = 0
    checkpoint_min_seconds: float = 0.0
    eval_every: int = 0
    log_every: int = 10
    max_replans: int = 3
    lookahead: int | None = None
    nofit_limit: int = 3
    failure_limit: int = 3
    seed: int = 0
    rank: int = 0
    planner_threads: int = 2
    elastic: str = "auto"
    restart_seconds: float | None = None
    fuse: int | str | None = None
    max_running_trials: int | str | None = "auto"
    device_overlap: float | None = None

    def __post_init__(self) -> None:
        from scamp_jax.hpo.trial import fusion_cap

        fusion_cap(self.fuse)  # raises on a bad value
        for name in ("steps", "devices_per_trial", "log_every", "planner_threads"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("checkpoint_every", "eval_every", "max_replans", "nofit_limit",
                     "failure_limit", "rank", "seed"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("reference_batch", "max_batch_size", "min_batch_size", "fixed_batch_size",
                     "lookahead"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for name, choices in (("policy", POLICIES), ("elastic", tuple(ELASTIC))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(map(repr, choices))}; pass one of them")
        if self.elastic == "on" and self.policy == "fixed":  # fixed gives each trial its share
            raise ValueError("elastic='on' applies to policy='scamp' only (the fixed policy "
                             "gives every trial devices_per_trial devices); pass elastic='off' or "
                             "policy='scamp'")
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise TypeError(f"budget={self.budget!r} is not a Budget; pass "
                            "scamp_jax.planning.Budget(bytes) or Budget.of_devices(devices, "
                            "'2GiB')")
        low, high = self.min_batch_size, self.max_batch_size
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_batch_size={low} is larger than max_batch_size={high}; "
                             f"raise max_batch_size to at least {low} or lower min_batch_size")
        cap = self.max_running_trials
        if cap != "auto" and cap is not None and (
                isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_running_trials={cap!r} must be 'auto', a positive int or "
                             "None (no cap)")
        if self.device_overlap is not None and not 0 <= self.device_overlap <= 1:
            raise ValueError(f"device_overlap={self.device_overlap} must be in [0, 1] (0: trials "
                             "on one device take turns, 1: they overlap freely) or None")
        seconds = self.checkpoint_min_seconds
        if (isinstance(seconds, bool) or not isinstance(seconds, int | float)
                or not math.isfinite(seconds) or seconds < 0):
            raise ValueError(f"checkpoint_min_seconds={seconds!r} must be a number of seconds "
                             ">= 0 (0: a checkpoint every checkpoint_every steps)")
        if self.restart_seconds is not None and self.restart_seconds < 0:
            raise ValueError(f"restart_seconds={self.restart_seconds} must be >= 0 or None")

    # -- derived --------------------------------------------------------------------------------
    @property
    def grow_last_wave(self) -> bool | None:
        """``elastic`` as the engine reads it: True (``"on"``), False (``"off"``) or None
        (``"auto"``: on for accelerators, off for CPU devices, where ScaMP plans each trial from
        the start on the devices its share of the host's cores gives it, `cpu_trial_devices`
        in `scamp_jax.scheduling.host`; twice those devices gained about 1.1x more, not worth a
        trial's extra compiles). On, in a study's last wave a queued trial may start
        data-parallel on 2x, 4x, ... its planned devices when they would otherwise idle (needs
        ``reference_batch``), and once nothing is queued or left to ask a running trial may
        restart from a checkpoint with the same global batch on its devices plus idle ones
        (`scamp_jax.scheduling.elastic`; needs a checkpoint root)."""
        return ELASTIC[self.elastic]

    def need_budget(self) -> Budget:
        """`budget`, or ``ValueError`` when none is set."""
        if self.budget is None:
            raise ValueError("the engine needs a device budget; pass budget=Budget(bytes) (or "
                             "use SearchSettings.engine_config(memory_per_device))")
        return self.budget

    def budget_of(self, devices: Sequence[Any]) -> Budget:
        """The budget of the live ``devices``: `budget`'s pool, margin and allowance with the
        devices' platform and kind (`Budget.of_devices`)."""
        budget = self.need_budget()
        return Budget.of_devices(devices, budget.memory_per_device,
                                 safety_margin=budget.safety_margin,
                                 allowance_bytes=budget.allowance_bytes)

    def steps_for(self, batch_size: int) -> int:
        """Training steps of a trial at global ``batch_size`` (see ``reference_batch``)."""
        if self.reference_batch is None:
            return self.steps
        steps = max(1, math.ceil(self.steps * self.reference_batch / batch_size))
        if steps < min(self.steps, FEW_STEPS):
            _say_few_steps(steps, batch_size, self.steps, self.reference_batch,
                           self.max_batch_size)
        return steps

    def interval_for(self, every: int, batch_size: int) -> int:
        """``every`` steps at ``reference_batch`` (``checkpoint_every``, ``eval_every``) as
        steps of a trial at global ``batch_size``, scaled as `steps_for` scales its steps: a
        trial of any batch is due as many checkpoints (`checkpoint_min_seconds` may skip
        some) and is evaluated as often, after as many samples. 0 (none) stays 0."""
        if not every or self.reference_batch is None:
            return every
        return max(1, round(every * self.reference_batch / batch_size))

    def run_record(self) -> dict[str, Any]:
        """What shapes a run's trials and may change from one run of a study to the next
        (unlike `SearchSettings.study_record`'s): its policy and batch bounds. Each run's
        entry in ``results.json`` keeps it (``search``), and a run that changes it says so.
        (Not ``fuse``: a study's settings narrow it to its trials, which a run may raise.)"""
        return {"policy": self.policy,
                "min_batch_size": self.min_batch_size, "max_batch_size": self.max_batch_size,
                "reference_batch": self.reference_batch}


#: Fewer training steps than this, where ``reference_batch`` scaled a trial's steps down to
#: them, are said (once per batch): a batch as large as memory allows may be far larger than
#: the data (the planner's default cap is 65,536 samples).
FEW_STEPS = 10
_SAID_FEW: set[tuple[int, int, int]] = set()


def idle_pruner(settings: SearchSettings) -> str | None:
    """Why ``settings``' pruner prunes nothing, where it does (no trial is evaluated before
    its last step, so it never has an intermediate value to judge); None where it can prune."""
    if settings.pruner != "none" and not 0 < settings.eval_every < settings.steps:
        return (f"the {settings.pruner} pruner prunes nothing in this study: no trial is "
                f"evaluated before its last step; pass eval_every below steps={settings.steps}")
    return None


def _say_few_steps(steps: int, batch: int, reference_steps: int, reference_batch: int,
                   max_batch_size: int | None = None) -> None:
    if (batch, reference_steps, reference_batch) in _SAID_FEW:
        return
    _SAID_FEW.add((batch, reference_steps, reference_batch))
    fix = ("pass max_batch_size to keep its batch" if max_batch_size is None else
           f"lower max_batch_size (now {max_batch_size}) to keep its batch")
    logging.getLogger(__name__).warning(
        "a trial at batch %d trains %d step(s), as steps=%d at a batch of %d (the reference "
        "batch) scaled to its batch; %s, and its steps, nearer the reference",
        batch, steps, reference_steps, reference_batch, fix)


#: A study's least seconds of training between two of a trial's checkpoints
#: (``SearchSettings.checkpoint_min_seconds``): a save every ``checkpoint_every`` steps of a
#: small model is a large share of its training (30 saves, 2.07 of 5.73 s, in the guide's
#: study of `benchmarks/notes/plain-loop.md`); a study killed outright loses at most about a
#: minute, plus ``checkpoint_every`` steps, of each running trial.
CHECKPOINT_MIN_SECONDS = 60.0


@dataclass(frozen=True, kw_only=True)
class SearchSettings(EngineConfig):
    """How one study runs: an `EngineConfig` (its runs' training and placement; here
    ``checkpoint_every`` defaults to 50 and ``checkpoint_min_seconds`` to
    `CHECKPOINT_MIN_SECONDS`) plus the study's size, storage and Optuna set-up.

    `scamp_jax.run_study` builds it from its arguments; the experiments' config
    (``experiments._cli.HPOConfig``) extends it with their own flags. Invalid values raise
    ``ValueError`` naming the field and what to pass instead.

    Attributes:
      trials: the study's total number of trials (a resumed study runs only the missing ones).
      study_dir: directory of the study database (``study.db``), checkpoints, results and plots;
        running again on it resumes the study.
      storage: SQLAlchemy URL of the study (None: the SQLite file ``study_dir/study.db``).
      sampler: Optuna sampler, seeded (with ``seed``): ``"tpe"``, ``"random"`` or ``"grid"``
        (the search space's grid; the study ends once every point ran, even short of
        ``trials``).
      pruner: Optuna pruner fed by intermediate evaluations (``eval_every``): ``"median"``,
        ``"halving"`` or ``"none"``.
      initial_params: configurations a new study evaluates first (a warm start; the sampler
        takes over after them), as Optuna's draws: a results row's ``drawn`` where it has one
        (``suggest`` changed what it drew), else its ``params``.
      study_name: name of the study in the storage (None: the search space's name); another
        name starts a new study next to the others, its outputs in ``<study_dir>/<name>/``.
      heartbeat_interval, grace_period: seconds between a running trial's heartbeats, and
        without one after which its process counts as dead and the trial is retried.
      preset, space_variant: where the settings came from (an experiment's preset, the search
        space's variant); recorded with the study, so a rerun with others is refused.
    """

    trials: int
    checkpoint_every: int = 50
    checkpoint_min_seconds: float = CHECKPOINT_MIN_SECONDS
    study_dir: str | Path = "runs/study"
    storage: str | None = None
    sampler: str = "tpe"
    pruner: str = "median"
    initial_params: tuple[Mapping[str, Any], ...] = ()
    study_name: str | None = None
    heartbeat_interval: int = HEARTBEAT_INTERVAL
    grace_period: int = GRACE_PERIOD
    preset: str | None = None
    space_variant: str | None = None

    def __post_init__(self) -> None:
        from scamp_jax.hpo.trial import fusion_cap

        fuse, trials = self.fuse, self.trials
        if ((fuse == "auto" or (isinstance(fuse, int) and not isinstance(fuse, bool)))
                and isinstance(trials, int) and not isinstance(trials, bool)
                and 1 <= trials < (fusion_cap(fuse) or 1)):
            # a group holds trials of this study: no wider group is asked, planned or compiled
            # ("auto" too: the widest that fits, at most its cap, is at most the trials)
            object.__setattr__(self, "fuse", trials)
        if fusion_cap(self.fuse) is not None and self.sampler == "grid":  # raises on a bad fuse
            raise ValueError(
                f"fuse={self.fuse!r} leaves each sibling's training hyperparameters to the "
                "sampler, and sampler='grid' takes every parameter from its grid; use "
                "sampler=tpe or sampler=random with fuse, or fuse=1 (no fused groups) with the "
                "grid")
        for name in ("trials", "heartbeat_interval"):
            _check_int(name, getattr(self, name), minimum=1)
        super().__post_init__()
        _check_int("grace_period", self.grace_period, minimum=self.heartbeat_interval + 1)
        for name, choices in (("sampler", SAMPLERS), ("pruner", PRUNERS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(map(repr, choices))}; pass one of them")
        if self.study_name is not None and not self.study_name.strip():
            raise ValueError("study_name='' names no study; pass a name or None (the search "
                             "space's name)")
        if self.study_name is not None and (
                "/" in self.study_name or "\\" in self.study_name
                or self.study_name in (".", "..")):
            raise ValueError(f"study_name={self.study_name!r}: a study's results go to a "
                             "folder of that name in study_dir, so it may hold no '/' or "
                             "'\\' and be no '.' or '..'; pass e.g. 'study-2'")
        if self.study_name in STUDY_DIR_FOLDERS or (self.study_name or "x")[0] == ".":
            raise ValueError(f"study_name={self.study_name!r}: a study's results go to a "
                             "folder of that name in study_dir, and this name is one of the "
                             "folders a study keeps there ("
                             f"{', '.join(STUDY_DIR_FOLDERS)}, or hidden ones), whose files "
                             "would mix with its results (a new best model replaces its "
                             "folder whole); pass e.g. 'study-2'")
        object.__setattr__(self, "initial_params",
                           tuple(dict(p) for p in self.initial_params))

    # -- views ----------------------------------------------------------------------------------
    def on_platform(self, platform: str) -> SearchSettings:
        """These settings for a pool of ``platform`` devices (``jax.Device.platform``:
        ``"cpu"``, ``"gpu"``, ``"tpu"``): the one place a setting is decided by the devices.

        ``fuse`` left unset (None) becomes ``"auto"`` on accelerators: a device runs every
        executable on its one compute stream (XLA's ``local_device_state.h``), so trials packed
        side by side on one take turns, while a fused group of them is one program that fills
        it. It stays off on CPU devices, and under the grid sampler (which sets every parameter
        a sibling would leave to the sampler). A ``fuse`` the user set (1: off) is kept."""
        if self.fuse is None and platform != "cpu" and self.sampler != "grid":
            return replace(self, fuse="auto")
        return self

    def engine_config(self, memory_per_device: int | Budget, *, rank: int = 0) -> SearchSettings:
        """These settings as the engine reads them: with the budget (bytes per device, or a
        `Budget`) and ``rank``, the MPI rank recorded with each trial. The same object
        otherwise: nothing is copied field by field."""
        budget = (memory_per_device if isinstance(memory_per_device, Budget)
                  else Budget(int(memory_per_device)))
        return replace(self, budget=budget, rank=rank)

    def study_record(self, space: SearchSpace, memory_per_device: int) -> dict[str, Any]:
        """What the study remembers and a rerun must repeat: space, preset, steps, seed and
        budget (bytes per device). ``trials`` may grow; anything else may change between runs."""
        return {
            "space": f"{space.name}/{self.space_variant or 'default'}",
            "preset": self.preset,
            "steps": self.steps,
            "seed": self.seed,
            "memory_per_device": memory_per_device,
        }

    def run_record(self) -> dict[str, Any]:
        """`EngineConfig.run_record` with the study's sampler and pruner."""
        return {"sampler": self.sampler, "pruner": self.pruner, **super().run_record()}

    def source_kwargs(self) -> dict[str, Any]:
        """`scamp_jax.hpo.study.OptunaTrialSource` arguments for ``fuse``: siblings per proposed
        trial (one group's worth: the cap less the proposed trial) and the keys siblings leave
        to the sampler."""
        from scamp_jax.hpo.trial import OPTIMIZER_KEYS, fusion_cap

        cap = fusion_cap(self.fuse)
        if cap is None:
            return {}
        return {"siblings": cap - 1, "training_keys": OPTIMIZER_KEYS}


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if (isinstance(value, numbers.Integral) and not isinstance(value, (bool, int))
            and int(value) >= minimum):
        raise ValueError(f"{name}={value!r} must be a Python int; pass {name}=int(...)")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}; pass e.g. "
                         f"{name}={minimum}")
