"""One call from a model family and a task to a packed, resumable study: `run_study`.

It is named ``run_study`` (not ``search``) because `scamp_jax.hpo.search` is the module that holds
`run_search` and `SearchSettings`: a function of the same name on the package would hide it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from scamp_jax.hpo.search import SearchSettings, run_search
from scamp_jax.space import SearchSpace, Task

#: Share of the host's physical memory that CPU devices (which report no limit) split between
#: them when no ``memory_per_device`` is given.
CPU_MEMORY_SHARE = 0.5


def run_study(
    space: SearchSpace,
    task: Task,
    *,
    trials: int,
    steps: int,
    study_dir: str | Path = "runs/study",
    devices: Sequence[jax.Device] | int | None = None,
    memory_per_device: int | str | None = None,
    policy: str = "scamp",
    sampler: str = "tpe",
    pruner: str = "median",
    seed: int = 0,
    storage: str | None = None,
    reference_batch: int | None = None,
    max_batch_size: int | None = None,
    min_batch_size: int | None = None,
    devices_per_trial: int = 2,
    checkpoint_every: int = 50,
    eval_every: int = 0,
    initial_params: Sequence[Mapping[str, Any]] = (),
    elastic: str = "auto",
    live: bool | None = None,
    baseline: str | None = None,
) -> dict[str, Any]:
    """Run (or resume) a memory-aware search of ``space`` on ``task`` and write its report.

    Each trial's configuration comes from Optuna (``space.suggest``); the planner sizes it
    (model-parallel degree, the largest global batch that fits ``memory_per_device``); the
    ScaMP policy packs trials onto ``devices`` so that their memory is used; every trial
    trains ``steps`` steps and is scored by ``task.evaluate``. Calling again with the same
    ``study_dir`` resumes: finished trials are kept, interrupted ones restart from their last
    checkpoint, and only the missing trials run.

    On CPU, split the host into several devices first (before JAX creates an array), e.g.
    ``scamp_jax.configure_for_search(8)`` at the top of the script.

    Args:
      space: the model family (`SearchSpace`).
      task: what candidates train on and how they are scored (`Task`; `FunctionTask` builds one
        from plain functions).
      trials: total trials of the study.
      steps: training steps per trial (at ``reference_batch`` when that is set).
      study_dir: directory of ``study.db`` (the Optuna study, SQLite), ``checkpoints/``,
        ``results.json``, ``results.csv``, ``best_model/`` and the plots.
      devices: the device pool: a list of JAX devices, a count (the first ``n``), or None (all).
      memory_per_device: budget per device in bytes or as text (``"2GiB"``). None: the device
        limit on accelerators; on CPU devices, which report none, an equal share of
        `CPU_MEMORY_SHARE` of the host's physical memory.
      policy, sampler, pruner, seed, storage, reference_batch, max_batch_size, min_batch_size,
        devices_per_trial, checkpoint_every, eval_every, initial_params, elastic: as in
        `SearchSettings`.
      live: a live table of devices and trials (None: when stdout is a terminal; False: log
        lines).
      baseline: a second score of ``task.evaluate`` to print beside the metric (e.g. a trivial
        predictor's), or None.

    Returns:
      The ``run`` section of ``results.json`` (``elapsed_s`` in seconds, ``devices``,
      ``memory_per_device`` in bytes, ``usage``, ``trials_this_run``, ...) plus ``best``: the
      best trial's results row (``number``, ``params``, ``batch_size``, ``devices``, the
      metric, ...) or None when no trial completed.

    Raises:
      ValueError: a setting out of range (the message names it and what to pass).
      scamp_jax.BudgetTooSmallError: no candidate fits the devices' memory.
    """
    settings = SearchSettings(
        trials=trials, steps=steps, study_dir=study_dir, storage=storage, policy=policy,
        devices_per_trial=devices_per_trial, sampler=sampler, pruner=pruner, seed=seed,
        reference_batch=reference_batch, max_batch_size=max_batch_size,
        min_batch_size=min_batch_size, checkpoint_every=checkpoint_every,
        eval_every=eval_every, initial_params=tuple(initial_params), elastic=elastic,
    )
    from scamp_jax.devices import configure_device_memory
    from scamp_jax.planning import planner
    # Preallocation off before the first device query (it starts JAX's backend); when the caller
    # already started JAX, configure_for_search at the top of the script is what counts.
    configure_device_memory()
    pool = planner.resolve_devices(devices)
    budget = default_budget(memory_per_device, pool)
    if live is None:
        live = sys.stdout.isatty()
    return run_search(space, task, settings, devices=pool, memory_per_device=budget, live=live,
                      baseline=baseline, title=space.name)


def default_budget(memory_per_device: int | str | None, devices: Sequence[jax.Device]) -> int:
    """Per-device budget in bytes: the argument, the accelerators' limit, or a share of the host.

    CPU devices report no memory limit; they split `CPU_MEMORY_SHARE` of the host's physical
    memory equally.
    """
    from scamp_jax.planning import planner
    if memory_per_device is not None or any(d.platform != "cpu" for d in devices):
        return planner.resolve_budget(memory_per_device, devices)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(CPU_MEMORY_SHARE * host) // len(devices)
