"""Run a whole study from an experiment's settings: open it, drive the engine, write the report.

`run_search` is what ``python -m experiments.swinir_hpo``, the other entry points and
`scamp_jax.run_study` call: it opens (or resumes) the Optuna study in the study directory, runs a
`SearchEngine` with a live view, and writes ``results.json``, ``results.csv``, ``best_model/`` and
the plots. `SearchSettings` holds what it reads: the study's size, training length, placement and
Optuna set-up.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from scamp_jax.hpo.engine import EngineConfig, PlanFn, SearchEngine, SearchResult
from scamp_jax.hpo.overhead import OverheadRecorder, record_report_seconds
from scamp_jax.hpo.study import PRUNERS, SAMPLERS
from scamp_jax.planning.plan_cache import PlanCache
from scamp_jax.planning.planner import plan_mesh
from scamp_jax.scheduling.placement import POLICIES
from scamp_jax.space import SearchSpace, Task


@dataclass(frozen=True, kw_only=True)
class SearchSettings:
    """How one study runs: its size, training length, placement and Optuna set-up.

    `run_search` and `scamp_jax.run_study` take it; the experiments' config
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
      sampler: Optuna sampler, seeded: ``"tpe"``, ``"random"`` or ``"grid"``.
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
        the end of the study to work (`scamp_jax.hpo.engine.EngineConfig.grow_last_wave`; auto: on
        accelerators, not on CPU devices).
      study_name: name of the study in the storage (None: the search space's name); another
        name starts a new study next to the others, its outputs in ``<study_dir>/<name>/``.
      fuse: horizontal fusion (`scamp_jax.hpo.fused_engine`): None (off), ``K`` (after the sampler
        proposes a trial, up to ``K - 1`` siblings with its architecture are enqueued, and
        queued trials of one architecture train in fused groups of at most ``K``, as wide as
        the planner fits) or ``"auto"`` (the planner's widest fitting group, capped).
      max_running_trials: most trials training at once, the rest queued
        (`scamp_jax.hpo.engine.EngineConfig.max_running_trials`; auto: one per two host cores
        on CPU devices, no cap on accelerators; None: as many as memory holds).
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

    def __post_init__(self) -> None:
        from scamp_jax.hpo.fused_engine import fusion_cap

        fusion_cap(self.fuse)  # raises ValueError naming the value
        for name in ("trials", "steps", "devices_per_trial"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("checkpoint_every", "eval_every"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("reference_batch", "max_batch_size", "min_batch_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for name, choices in (("policy", POLICIES), ("sampler", SAMPLERS),
                              ("pruner", PRUNERS), ("elastic", tuple(_ELASTIC))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(map(repr, choices))}; pass one of them")
        low, high = self.min_batch_size, self.max_batch_size
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_batch_size={low} is larger than max_batch_size={high}; "
                             f"raise max_batch_size to at least {low} or lower min_batch_size")
        object.__setattr__(self, "initial_params",
                           tuple(dict(p) for p in self.initial_params))


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}; pass e.g. "
                         f"{name}={max(minimum, 1)}")


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
    Writes ``study.db`` (unless ``settings.storage`` names another database), ``plans.sqlite``
    (the plan cache, used when ``plan_fn`` is not given), ``results.json``,
    ``results.csv``, ``best_model/`` (the best trial's final checkpoint), the three PNG plots, and
    prints the best trials with the best metric against ``baseline`` (e.g. ``"bicubic_psnr"``).
    Returns the ``results.json`` payload's ``run`` section plus ``best`` (a results row or None).
    """
    from rich.console import Console

    from scamp_jax.hpo.live import LiveView
    from scamp_jax.hpo.study import GRACE_PERIOD, HEARTBEAT_INTERVAL, OptunaTrialSource, open_study

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
    source = OptunaTrialSource(study, space, settings.trials, root=out_dir,
                               **fusion_source_kwargs(getattr(settings, "fuse", None)))
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
    # Plans, fused plans and compiled peaks persist next to the study: a resumed study, or
    # another process on it, plans an architecture it has planned before without compiling.
    plan_cache = PlanCache(study_dir / "plans.sqlite")
    if plan_fn is None:
        plan_fn = functools.partial(plan_mesh, cache=plan_cache)
    engine = SearchEngine(space, task, source, config, devices=devices,
                          checkpoint_root=out_dir / "checkpoints", plan_fn=plan_fn,
                          on_update=view.update, plan_cache=plan_cache, on_notice=view.notice)
    started = time.monotonic()
    recorder = OverheadRecorder()  # where the time goes: run.overhead in results.json
    try:
        with view, recorder:
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
    run_info["overhead"] = recorder.summary(result)
    report_start = time.perf_counter()
    out = write_study_report(study, task, out_dir, result, run_info, baseline=baseline,
                             memory_per_device=memory_per_device, console=console)
    record_report_seconds(out_dir, run_info["overhead"], time.perf_counter() - report_start)
    return out


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
        fuse=getattr(settings, "fuse", None),
        max_running_trials=getattr(settings, "max_running_trials", "auto"),
    )


def fusion_source_kwargs(fuse: int | str | None) -> dict[str, Any]:
    """`OptunaTrialSource` arguments for ``fuse``: siblings per proposed trial (one group's
    worth: the cap less the proposed trial) and the keys siblings leave to the sampler."""
    from scamp_jax.hpo.fused_engine import fusion_cap
    from scamp_jax.hpo.runner import OPTIMIZER_KEYS

    cap = fusion_cap(fuse)
    if cap is None:
        return {}
    return {"siblings": cap - 1, "training_keys": OPTIMIZER_KEYS}


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
    from scamp_jax.hpo import report
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
    from scamp_jax.hpo import report
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
