"""Run a whole study from an experiment's settings: open it, drive the engine, write the report.

`run_search` is what ``python -m experiments.swinir_hpo`` and the other entry points call: it
opens (or resumes) the Optuna study in the study directory, runs a `SearchEngine` with a live
view, and writes ``results.json``, ``results.csv``, ``best_model/`` and the plots.
"""

from __future__ import annotations

import sys
import time
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
    from scamp_jax.study import GRACE_PERIOD, HEARTBEAT_INTERVAL, OptunaTrialSource, open_study

    study_name = getattr(settings, "study_name", None) or space.name
    # A study other than the space's default one keeps its outputs in a folder of its own.
    study_dir = Path(settings.study_dir)
    out_dir = study_dir if study_name == space.name else study_dir / study_name
    study = open_study(
        study_name, study_dir=study_dir, storage=settings.storage, direction=task.direction,
        sampler=settings.sampler, pruner=settings.pruner, seed=settings.seed, grid=space.grid,
        warmup_steps=settings.eval_every,
        settings=study_settings(space, settings, memory_per_device),
        heartbeat_interval=getattr(settings, "heartbeat_interval", HEARTBEAT_INTERVAL),
        grace_period=getattr(settings, "grace_period", GRACE_PERIOD),
    )
    if not study.get_trials(deepcopy=False):
        for params in getattr(settings, "initial_params", ()):
            study.enqueue_trial(dict(params), skip_if_exists=True)
    source = OptunaTrialSource(study, space, settings.trials, root=out_dir)
    if console is None:
        # Logs (no terminal) get wide lines instead of a table squeezed into 80 columns.
        console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    if source.recovered:
        console.print(f"resuming: trials {source.recovered} of a stopped process are queued "
                      "again", markup=False)
    console.print(f"study {study_name!r} in {out_dir}: {source.finished()} of "
                  f"{settings.trials} trials finished before this run", markup=False)
    config = engine_config(settings, memory_per_device)
    stream: Any = None if live else _PlainStream()
    view = LiveView([memory_per_device] * len(devices), task.metric, title=title, stream=stream)
    engine = SearchEngine(space, task, source, config, devices=devices,
                          checkpoint_root=out_dir / "checkpoints", plan_fn=plan_fn,
                          on_update=view.update)
    started = time.monotonic()
    try:
        with view:
            result = engine.run()
    except KeyboardInterrupt:
        # The record grows on an interrupt too: finished trials and this run's wall time.
        interrupted = {"policy": settings.policy, "devices": len(devices),
                       "memory_per_device": memory_per_device, "interrupted": True,
                       "elapsed_s": time.monotonic() - started}
        write_interrupted_report(study, task, out_dir, interrupted, baseline=baseline)
        raise
    finally:
        source.close()
    if source.recovered:
        console.print(f"trials {sorted(set(source.recovered))} of stopped processes were run "
                      "again", markup=False)
    run_info = run_summary(result, len(devices), memory_per_device)
    return write_study_report(study, task, out_dir, result, run_info, baseline=baseline,
                              memory_per_device=memory_per_device, console=console)


def study_settings(space: SearchSpace, settings: SearchSettings,
                   memory_per_device: int) -> dict[str, Any]:
    """What a study remembers and a rerun must repeat: space, preset, steps, seed and budget
    (bytes per device). ``--trials`` may grow; anything else may change between runs."""
    return {
        "space": f"{space.name}/{getattr(settings, 'space_variant', None) or 'default'}",
        "preset": getattr(settings, "preset", None),
        "steps": settings.steps,
        "seed": settings.seed,
        "memory_per_device": memory_per_device,
    }


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
        "policy": result.policy,
        "devices": devices,
        "memory_per_device": memory_per_device,
        "elapsed_s": result.elapsed_s,
        "usage": dict(result.usage),
        "compile_cache": dict(result.compile_cache),
        "trials_this_run": len(result.outcomes),
        "timeline": {
            "intervals": [[list(span) for span in spans] for spans in result.intervals],
            "memory_series": [list(result.memory_series[0]), list(result.memory_series[1])]
            if result.memory_series is not None else None,
        },
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
    intervals, memory_series, elapsed = report.combined_timeline(report.read_runs(study_dir))
    report.plot_results(study_dir, records, metric=task.metric, baseline=baseline,
                        intervals=intervals, memory_series=memory_series,
                        elapsed_s=elapsed, capacity_bytes=memory_per_device)
    console.print(report.summary_table(records, task.metric, task.direction, baseline=baseline))
    console.print(report.verdict(records, task.metric, task.direction, baseline), markup=False)
    console.print(
        f"this run: {run_info['elapsed_s']:.1f} s, mean memory utilisation "
        f"{100 * run_info['usage']['mean_memory_utilization']:.1f}%, idle device-seconds "
        f"{run_info['usage']['idle_device_seconds']:.1f}; results in {study_dir}", markup=False
    )
    return {**run_info, "best": report.best_record(records, task.metric, task.direction)}


def write_interrupted_report(study: Any, task: Task, study_dir: Path, run_info: dict[str, Any],
                             *, baseline: str | None) -> None:
    """``results.json``/``.csv`` of an interrupted run: every finished trial, and ``run_info``
    appended to the runs (no plots; the next run draws them)."""
    from scamp_jax import report

    metrics = [task.metric] + ([baseline] if baseline else [])
    report.write_results(study_dir, report.trial_records(study, metrics), metric=task.metric,
                         direction=task.direction, run=run_info)


class _PlainStream:
    """stdout without a terminal, so `LiveView` prints log lines (``--no-live``)."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()

    def isatty(self) -> bool:
        return False
