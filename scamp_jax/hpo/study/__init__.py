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
processes from taking the same last slot. `open_study` returns a `StudyHandle` (the study, its
storage and that lock); `OptunaTrialSource` asks and tells through it.

Liveness is Optuna's own: the storage has a heartbeat (`open_storage`), every live trial beats,
and a trial whose process died stops beating. After the grace period any process of the study
fails it and Optuna's `RetryHeartbeatStaleTrialCallback` queues a copy with the same parameters
(a process on the machine of one that has certainly ended does so at once: `owner`);
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

from scamp_jax.hpo.study.samplers import GridSearch as GridSearch
from scamp_jax.hpo.study.samplers import TrialSeededSampler as TrialSeededSampler
from scamp_jax.hpo.study.samplers import make_pruner as make_pruner
from scamp_jax.hpo.study.samplers import make_sampler as make_sampler
from scamp_jax.hpo.study.samplers import sampler_seed as sampler_seed
from scamp_jax.hpo.study.source import OptunaTrialSource as OptunaTrialSource
from scamp_jax.hpo.study.storage import SETTINGS_KEY as SETTINGS_KEY
from scamp_jax.hpo.study.storage import AskLock as AskLock
from scamp_jax.hpo.study.storage import StudyHandle as StudyHandle
from scamp_jax.hpo.study.storage import StudySettingsError as StudySettingsError
from scamp_jax.hpo.study.storage import open_storage as open_storage
from scamp_jax.hpo.study.storage import open_study as open_study
from scamp_jax.hpo.study.storage import retried_from as retried_from
from scamp_jax.hpo.study.storage import stopped_attempt as stopped_attempt
from scamp_jax.hpo.study.storage import storage_url as storage_url
from scamp_jax.hpo.study.trials import CHECKPOINT_KEY as CHECKPOINT_KEY
from scamp_jax.hpo.study.trials import FAIL_REASON as FAIL_REASON
from scamp_jax.hpo.study.trials import HELD_SIBLINGS as HELD_SIBLINGS
from scamp_jax.hpo.study.trials import INTERRUPTED as INTERRUPTED
from scamp_jax.hpo.study.trials import SIBLING_OF as SIBLING_OF
from scamp_jax.hpo.study.trials import AskedTrial as AskedTrial
from scamp_jax.hpo.study.trials import AskLater as AskLater
from scamp_jax.hpo.study.trials import TrialOutcome as TrialOutcome
from scamp_jax.hpo.study.trials import TrialSource as TrialSource
from scamp_jax.hpo.study.trials import when_full as when_full

__all__ = [
    "CHECKPOINT_KEY",
    "FAIL_REASON",
    "HELD_SIBLINGS",
    "INTERRUPTED",
    "SETTINGS_KEY",
    "SIBLING_OF",
    "AskLater",
    "AskLock",
    "AskedTrial",
    "GridSearch",
    "OptunaTrialSource",
    "StudyHandle",
    "StudySettingsError",
    "TrialOutcome",
    "TrialSeededSampler",
    "TrialSource",
    "make_pruner",
    "make_sampler",
    "open_storage",
    "open_study",
    "retried_from",
    "stopped_attempt",
    "sampler_seed",
    "storage_url",
    "when_full",
]
