"""Run a whole study from an experiment's settings: open it, drive the engine, write the report.

`run_search` is what ``python -m experiments.swinir_hpo`` and the other entry points call: it
opens (or resumes) the Optuna study in the study directory, runs a `SearchEngine` with a live
view, and writes ``results.json``, ``results.csv``, ``best_model/`` and the plots.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import jax

from scamp_jax.engine import EngineConfig, PlanFn, SearchEngine, SearchResult
from scamp_jax.space import SearchSpace, Task


class SearchSettings(Protocol):
    """What `run_search` reads from an experiment's config (e.g. ``experiments._cli.HPOConfig``).

    Fields as in `EngineConfig`, plus the study's: ``trials`` (total), ``sampler``, ``pruner``,
    ``study_dir``, ``storage``; optionally ``initial_params`` (configurations a new study
    evaluates first, a warm start), ``min_batch_size`` and ``elastic`` (``"auto"``, ``"on"``,
    ``"off"``: `EngineConfig.grow_last_wave` None, True, False).
    """

    @property
    def trials(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def reference_batch(self) -> int | None: ...
    @property
    def max_batch_size(self) -> int | None: ...
    @property
    def policy(self) -> str: ...
    @property
    def devices_per_trial(self) -> int: ...
    @property
    def sampler(self) -> str: ...
    @property
    def pruner(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def study_dir(self) -> str: ...
    @property
    def storage(self) -> str | None: ...
    @property
    def checkpoint_every(self) -> int: ...
    @property
    def eval_every(self) -> int: ...


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
    plan_fn: PlanFn | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Open (or resume) the study in ``settings.study_dir``, run it, and write its report.

    A new study first evaluates ``settings.initial_params`` (if any), then what the sampler asks.
    Writes ``study.db`` (unless ``settings.storage`` names another database), ``results.json``,
    ``results.csv``, ``best_model/`` (the best trial's final checkpoint), the three PNG plots, and
    prints the best trials with the best metric against ``baseline`` (e.g. ``"bicubic_psnr"``).
    Returns the ``results.json`` payload's ``run`` section plus ``best`` (a results row or None).
    """
    from rich.console import Console

    from scamp_jax.live import LiveView
    from scamp_jax.study import OptunaTrialSource, open_study

    study_dir = Path(settings.study_dir)
    study = open_study(
        space.name, study_dir=study_dir, storage=settings.storage, direction=task.direction,
        sampler=settings.sampler, pruner=settings.pruner, seed=settings.seed, grid=space.grid,
        warmup_steps=settings.eval_every,
    )
    if not study.get_trials(deepcopy=False):
        for params in getattr(settings, "initial_params", ()):
            study.enqueue_trial(dict(params), skip_if_exists=True)
    source = OptunaTrialSource(study, space, settings.trials)
    if console is None:
        # Logs (no terminal) get wide lines instead of a table squeezed into 80 columns.
        console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    if source.recovered:
        console.print(f"resuming: trials {source.recovered} were interrupted and are queued "
                      "again", markup=False)
    console.print(f"study {space.name!r} in {study_dir}: {source.finished()} of "
                  f"{settings.trials} trials finished before this run", markup=False)
    config = engine_config(settings, memory_per_device)
    stream: Any = None if live else _PlainStream()
    view = LiveView([memory_per_device] * len(devices), task.metric, title=title, stream=stream)
    engine = SearchEngine(space, task, source, config, devices=devices,
                          checkpoint_root=study_dir / "checkpoints", plan_fn=plan_fn,
                          on_update=view.update)
    with view:
        result = engine.run()
    run_info = run_summary(result, len(devices), memory_per_device)
    return write_study_report(study, task, study_dir, result, run_info, baseline=baseline,
                              memory_per_device=memory_per_device, console=console)


def engine_config(settings: SearchSettings, memory_per_device: int, *,
                  rank: int = 0) -> EngineConfig:
    """The `EngineConfig` of an experiment's ``settings`` with a budget of ``memory_per_device``
    bytes per device; ``rank`` is the MPI rank recorded with each trial."""
    return EngineConfig(
        steps=settings.steps,
        memory_per_device=memory_per_device,
        policy=settings.policy,
        devices_per_trial=settings.devices_per_trial,
        max_batch_size=settings.max_batch_size,
        min_batch_size=getattr(settings, "min_batch_size", None),
        reference_batch=settings.reference_batch,
        checkpoint_every=settings.checkpoint_every,
        eval_every=settings.eval_every,
        seed=settings.seed,
        rank=rank,
        grow_last_wave=_grow_last_wave(getattr(settings, "elastic", "auto")),
    )


def _grow_last_wave(elastic: str) -> bool | None:
    """``settings.elastic`` (auto, on, off) as `EngineConfig.grow_last_wave` (None, True, False)."""
    if elastic not in _ELASTIC:
        raise ValueError(f"elastic={elastic!r} must be 'auto', 'on' or 'off'")
    return _ELASTIC[elastic]


#: ``settings.elastic`` -> `EngineConfig.grow_last_wave`.
_ELASTIC = {"auto": None, "on": True, "off": False}


def run_summary(result: SearchResult, devices: int, memory_per_device: int) -> dict[str, Any]:
    """The ``run`` section of ``results.json`` for one engine run on ``devices`` devices."""
    return {
        # memory_per_device, safety_margin, the booked share, the active policy parts, ...
        **dict(result.scheduling),
        "policy": result.policy,
        "devices": devices,
        "memory_per_device": memory_per_device,
        "elapsed_s": result.elapsed_s,
        "usage": dict(result.usage),
        "compile_cache": dict(result.compile_cache),
        "trials_this_run": len(result.outcomes),
    }


def write_study_report(
    study: Any,
    task: Task,
    study_dir: Path,
    result: SearchResult,
    run_info: dict[str, Any],
    *,
    baseline: str | None,
    memory_per_device: int,
    console: Any,
) -> dict[str, Any]:
    """Write ``results.json``/``.csv``, ``best_model/`` and the plots of every finished trial
    of ``study`` (``run_info`` as the ``run`` section, ``result`` for the usage plots) and print
    the best trials; returns ``run_info`` plus ``best`` (a results row or None)."""
    from scamp_jax import report

    metrics = [task.metric] + ([baseline] if baseline else [])
    records = report.trial_records(study, metrics)
    report.write_results(study_dir, records, metric=task.metric, direction=task.direction,
                         run=run_info)
    report.save_best_model(study_dir, records, task.metric, task.direction)
    report.plot_results(study_dir, records, metric=task.metric, baseline=baseline,
                        intervals=result.intervals, memory_series=result.memory_series,
                        elapsed_s=result.elapsed_s, capacity_bytes=memory_per_device)
    console.print(report.summary_table(records, task.metric, task.direction, baseline=baseline))
    console.print(report.verdict(records, task.metric, task.direction, baseline), markup=False)
    console.print(
        f"this run: {run_info['elapsed_s']:.1f} s, mean memory utilisation "
        f"{100 * run_info['usage']['mean_memory_utilization']:.1f}%, idle device-seconds "
        f"{run_info['usage']['idle_device_seconds']:.1f}; results in {study_dir}", markup=False
    )
    return {**run_info, "best": report.best_record(records, task.metric, task.direction)}


class _PlainStream:
    """stdout without a terminal, so `LiveView` prints log lines (``--no-live``)."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()

    def isatty(self) -> bool:
        return False
