"""What a real study measured, read back for the simulator: its ``results.json``.

The HPO engine writes, per trial, when its plan was ready (``planned_at``, seconds since the
study's start), each run's placement (``placements``: ``[start, device ids]``) and its paces
(``pace``: ``[time, step, seconds per step, training since]``). `engine_figures` turns these into
the overheads the simulator charges (`scamp_jax.sim.simulator.ClusterModel`):

- ``planning_seconds``: the earliest ``planned_at``: the first plan of the study was asked at its
  start, with no other plan ahead of it, so this is one plan's own time (its compiles).
- ``restart_seconds``: the median, over restarts on more devices, of the time from the restart's
  booking (``core_events``: ``restarted``) to the new run's first training step (stopping at a
  checkpoint, compile, restore); for a record without ``core_events``, from each later
  placement. A run again after an out-of-memory re-plan is not a restart.
- ``planner_threads``: the plans the engine made at once, as its last run records it
  (``run.planner_threads``).

A figure the study did not measure (no trial planned, no restart) is left out, and the
simulator keeps its documented default. This module reads files; the scheduling core does not.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict


def read_results(study_dir: str | Path) -> dict[str, Any]:
    """The parsed ``results.json`` of the study in ``study_dir``."""
    path = Path(study_dir) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass the directory of a finished study")
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not a readable results.json ({err}); pass the directory "
                         "of a study whose run finished writing it") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path} holds a JSON {type(results).__name__}, not the object of a "
                         "study's results; pass the directory of a study this package wrote")
    return results


def _seconds(trial: Mapping[str, Any], field: str, value: Any) -> float:
    """``value`` of ``trial``'s ``field`` as seconds, or a `ValueError` naming both."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"results.json: trial {trial.get('number')}: {field} holds {value!r}, "
                         "not a number of seconds; pass the directory of a study this package "
                         "wrote") from None


def replay_study(study_dir: str | Path) -> list[tuple[int, tuple[int, ...]]]:
    """The placements of a replay of ``study_dir``'s ``results.json`` through the scheduling
    core (`scamp_jax.scheduling.replay.replay`): ``[(trial number, device ids), ...]`` in the
    order the core decides them, each start and each restart or move on other devices, of the
    study's last run (a resumed study's earlier runs are not replayed)."""
    from scamp_jax.scheduling.replay import replay

    return replay(read_results(study_dir))


def restart_delays(trial: Mapping[str, Any]) -> list[float]:
    """Seconds from each restart of ``trial`` on more devices (its booking; without
    ``core_events``, each later placement) to the new run's first training step."""
    events = trial.get("core_events")
    if events is not None:
        starts = [_seconds(trial, "core_events", e[1]) for e in events if e[0] == "restarted"]
    else:
        starts = [_seconds(trial, "placements", start)
                  for start, _ in (trial.get("placements") or [])[1:]]
    paces = sorted(([_seconds(trial, "pace", p[0]), _seconds(trial, "pace", p[3])]
                    for p in trial.get("pace") or ()), key=lambda p: p[0])
    out = []
    for start in starts:
        since = next((p[1] for p in paces if p[1] >= start), None)
        if since is not None:
            out.append(since - start)
    return out


class EngineFigures(TypedDict, total=False):
    """`engine_figures`' answer: `scamp_jax.sim.simulator.ClusterModel` fields, in seconds."""

    planning_seconds: float
    restart_seconds: float
    planner_threads: int


def engine_figures(results: Mapping[str, Any]) -> EngineFigures:
    """``{"planning_seconds": s, "restart_seconds": s, "planner_threads": n}`` measured or
    recorded by a study (module docstring); a figure it did not record is absent."""
    trials = results.get("trials") or []
    out: EngineFigures = {}
    run = results.get("run") or {}
    if isinstance(run, list):
        run = run[-1] if run else {}
    threads = run.get("planner_threads") if isinstance(run, Mapping) else None
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"results.json: run.planner_threads={threads!r} is not an integer "
                             ">= 1; pass the directory of a study this package wrote")
        out["planner_threads"] = threads
    planned = [_seconds(t, "planned_at", t["planned_at"]) for t in trials
               if t.get("planned_at") is not None]
    if planned:
        out["planning_seconds"] = max(0.0, min(planned))
    delays = [d for t in trials for d in restart_delays(t)]
    if delays:
        out["restart_seconds"] = max(0.0, statistics.median(delays))
    return out
