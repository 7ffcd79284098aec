"""How one study runs: `SearchSettings`, validated once, and the views the engine and the study
read of it.

`run_study`, the experiments' command lines (whose config extends `SearchSettings` with their own
flags) and ``mpirun`` all hand the same dataclass to the study session
(`scamp_jax.hpo.session`); nothing downstream reads a field by name with a default. The engine
gets `SearchSettings.engine_config`, the study `SearchSettings.study_record` (what a rerun must
repeat) and the trial source `SearchSettings.source_kwargs`.

This module is a leaf: it imports neither JAX nor Optuna, so ``import scamp_jax`` stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scamp_jax.scheduling.placement import POLICIES

if TYPE_CHECKING:
    from scamp_jax.hpo.engine import EngineConfig
    from scamp_jax.space import SearchSpace

#: Optuna samplers by name (`scamp_jax.hpo.study.make_sampler`).
SAMPLERS = ("tpe", "random", "grid")
#: Optuna pruners by name (`scamp_jax.hpo.study.make_pruner`).
PRUNERS = ("median", "halving", "none")
#: ``elastic`` -> `EngineConfig.grow_last_wave` (auto: on for accelerators, off for CPU devices).
ELASTIC = {"auto": None, "on": True, "off": False}
#: seconds between a live trial's heartbeats (Optuna's ``heartbeat_interval``).
HEARTBEAT_INTERVAL = 10
#: seconds without a heartbeat after which a trial's process counts as dead.
GRACE_PERIOD = 60


@dataclass(frozen=True, kw_only=True)
class SearchSettings:
    """How one study runs: its size, training length, placement and Optuna set-up.

    `scamp_jax.run_study` builds it from its arguments; the experiments' config
    (``experiments._cli.HPOConfig``) extends it with their own flags. Invalid values raise
    ``ValueError`` naming the field and what to pass instead.

    Attributes:
      trials: the study's total number of trials (a resumed study runs only the missing ones).
      steps: training steps per trial (at ``reference_batch`` when that is set).
      study_dir: directory of the study database (``study.db``), checkpoints, results and plots;
        running again on it resumes the study.
      storage: SQLAlchemy URL of the study (None: the SQLite file ``study_dir/study.db``).
      policy: ``"scamp"`` (pack trials by planned memory, each with the largest batch that fits)
        or ``"fixed"`` (the baseline: ``devices_per_trial`` devices and one batch for all).
      devices_per_trial: devices every trial gets under the fixed policy.
      sampler: Optuna sampler, seeded: ``"tpe"``, ``"random"`` or ``"grid"`` (the search space's
        grid; the study ends once every point ran, even short of ``trials``).
      pruner: Optuna pruner fed by intermediate evaluations (``eval_every``): ``"median"``,
        ``"halving"`` or ``"none"``.
      seed: seed of the sampler, initialisation and data streams.
      reference_batch: global batch that ``steps`` refers to; a trial whose plan allows batch
        ``b`` trains ``ceil(steps * reference_batch / b)`` steps, so every trial sees the same
        number of samples (None: every trial trains ``steps`` steps).
      max_batch_size: cap on any trial's global batch (None: as large as memory allows).
      min_batch_size: smallest global batch a trial may train with (None: any).
      checkpoint_every: steps between checkpoints (0: only at the end).
      eval_every: steps between intermediate evaluations reported to the pruner (0: none).
      initial_params: configurations a new study evaluates first (a warm start; the sampler
        takes over after them).
      elastic: ``"auto"``, ``"on"`` or ``"off"``: whether ScaMP puts devices that would idle at
        the end of the study to work (`scamp_jax.hpo.engine.EngineConfig.grow_last_wave`; auto:
        on accelerators, not on CPU devices).
      study_name: name of the study in the storage (None: the search space's name); another
        name starts a new study next to the others, its outputs in ``<study_dir>/<name>/``.
      fuse: horizontal fusion (`scamp_jax.hpo.fused_engine`): None (off), ``K`` (after the sampler
        proposes a trial, up to ``K - 1`` siblings with its architecture are enqueued, and
        queued trials of one architecture train in fused groups of at most ``K``, as wide as
        the planner fits) or ``"auto"`` (the planner's widest fitting group, capped). Siblings
        change the search: a proposal's family takes ``K`` of the study's trials, so a study of
        at most ``K`` trials tries one architecture (its first proposal's) with ``K`` draws of
        the training hyperparameters (``"auto"``: ``K`` is `scamp_jax.hpo.trial.AUTO_FUSION_CAP`).
      max_running_trials: most trials (or fused groups) training at once, the rest queued:
        ``"auto"`` (on CPU devices, which share the host's cores, one per two cores, as
        measured in `scamp_jax.scheduling.host`; no cap on accelerators), a positive int, or
        None (as many as the pool's memory holds).
      device_overlap: how much trials sharing one device overlap in the scheduling core's
        busy fractions, in [0, 1] (`scamp_jax.hpo.engine.EngineConfig.device_overlap`; None:
        0 on accelerators, 1 on CPU devices).
      heartbeat_interval, grace_period: seconds between a running trial's heartbeats, and
        without one after which its process counts as dead and the trial is retried.
      preset, space_variant: where the settings came from (an experiment's preset, the search
        space's variant); recorded with the study, so a rerun with others is refused.
    """

    trials: int
    steps: int
    study_dir: str | Path = "runs/study"
    storage: str | None = None
    policy: str = "scamp"
    devices_per_trial: int = 2
    sampler: str = "tpe"
    pruner: str = "median"
    seed: int = 0
    reference_batch: int | None = None
    max_batch_size: int | None = None
    min_batch_size: int | None = None
    checkpoint_every: int = 50
    eval_every: int = 0
    initial_params: tuple[Mapping[str, Any], ...] = ()
    elastic: str = "auto"
    study_name: str | None = None
    fuse: int | str | None = None
    max_running_trials: int | str | None = "auto"
    device_overlap: float | None = None
    heartbeat_interval: int = HEARTBEAT_INTERVAL
    grace_period: int = GRACE_PERIOD
    preset: str | None = None
    space_variant: str | None = None

    def __post_init__(self) -> None:
        from scamp_jax.hpo.trial import fusion_cap

        if fusion_cap(self.fuse) is not None and self.sampler == "grid":  # raises on a bad fuse
            raise ValueError(
                f"fuse={self.fuse!r} leaves each sibling's training hyperparameters to the "
                "sampler, and sampler='grid' takes every parameter from its grid; use "
                "sampler='tpe' or 'random' with fuse, or fuse=None with the grid")
        for name in ("trials", "steps", "devices_per_trial", "heartbeat_interval"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("grace_period", self.grace_period, minimum=self.heartbeat_interval + 1)
        for name in ("checkpoint_every", "eval_every"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("reference_batch", "max_batch_size", "min_batch_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for name, choices in (("policy", POLICIES), ("sampler", SAMPLERS),
                              ("pruner", PRUNERS), ("elastic", tuple(ELASTIC))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(map(repr, choices))}; pass one of them")
        low, high = self.min_batch_size, self.max_batch_size
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_batch_size={low} is larger than max_batch_size={high}; "
                             f"raise max_batch_size to at least {low} or lower min_batch_size")
        if self.device_overlap is not None and not 0 <= self.device_overlap <= 1:
            raise ValueError(f"device_overlap={self.device_overlap} must be in [0, 1] (0: trials "
                             "on one device take turns, 1: they overlap freely) or None")
        if self.study_name is not None and not self.study_name.strip():
            raise ValueError("study_name='' names no study; pass a name or None (the search "
                             "space's name)")
        object.__setattr__(self, "initial_params",
                           tuple(dict(p) for p in self.initial_params))

    # -- views ----------------------------------------------------------------------------------
    def engine_config(self, memory_per_device: int, *, rank: int = 0) -> EngineConfig:
        """The engine's view: budget ``memory_per_device`` bytes per device; ``rank`` is the
        MPI rank recorded with each trial."""
        from scamp_jax.hpo.engine import EngineConfig

        return EngineConfig(
            steps=self.steps, memory_per_device=memory_per_device, policy=self.policy,
            devices_per_trial=self.devices_per_trial, max_batch_size=self.max_batch_size,
            min_batch_size=self.min_batch_size, reference_batch=self.reference_batch,
            checkpoint_every=self.checkpoint_every, eval_every=self.eval_every, seed=self.seed,
            rank=rank, grow_last_wave=ELASTIC[self.elastic], fuse=self.fuse,
            max_running_trials=self.max_running_trials, device_overlap=self.device_overlap,
        )

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
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}; pass e.g. "
                         f"{name}={max(minimum, 1)}")
