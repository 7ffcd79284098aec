"""Replay a finished study's events through the scheduling core.

A real study's ``results.json`` records, per trial, when its plan was ready (``planned_at``),
the plan the core saw (``plan``), where and when each run started (``placements``), its measured
pace (``pace``) and when it ended (``finished_at``); its ``run`` section records the budget, the
safety margin, the policy parts that were active and when the last wave began. `replay` feeds
the arrivals, the paces and the measured durations (not the recorded starts) to a fresh
`SchedulingCore` in time order, deciding after each event time as the engine does, and returns
the placements it makes. On a study whose trials each ran once (no out-of-memory re-plan, no
restart on more devices, no last-wave growth) they equal the real run's placements: the engine
ran exactly these decisions.

    python -m benchmarks.simulate_cluster --replay STUDY_DIR --json

No file is read here: `scamp_jax.sim.measured.replay_study` reads a study's ``results.json``.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from scamp_jax.scheduling.core import PlanOption, SchedulingCore, Start, TrialPlan
from scamp_jax.scheduling.placement import FixedPolicy, ScampPolicy

# Events at one time are applied in this order before the core decides: the engine feeds a
# plan, then (if it was the last one) the start of the last wave, at the same time stamp.
_PLANNED, _LAST_WAVE, _PACE, _FINISHED = 0, 1, 2, 3


def policy_of(parts: Mapping[str, Any]) -> ScampPolicy | FixedPolicy:
    """The placement policy described by a ``results.json`` ``run.policy_parts`` entry."""
    if parts.get("policy") == "fixed":
        return FixedPolicy(int(parts["devices_per_trial"]))
    names = {f.name for f in fields(ScampPolicy) if f.init}
    return ScampPolicy(**{k: v for k, v in parts.items() if k in names})


def run_section(results: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``run`` section of ``results`` (the last run where it lists several)."""
    run = results.get("run") or {}
    if isinstance(run, list):
        run = run[-1] if run else {}
    if "policy_parts" not in run:
        raise ValueError(
            "results.json has no scheduling record (run.policy_parts): it was written by an "
            "older version; re-run the study to replay it")
    return run


def replay(results: Mapping[str, Any]) -> list[tuple[int, tuple[int, ...]]]:
    """Placements ``[(trial number, device ids), ...]`` in start order of a replay of
    ``results`` (a parsed ``results.json``) through `SchedulingCore`."""
    run = run_section(results)
    core = SchedulingCore(policy_of(run["policy_parts"]), int(run["pool_devices"]),
                          int(run["memory_per_device"]), float(run["safety_margin"]),
                          run.get("restart_seconds"), peak_flops=run.get("peak_flops"),
                          max_running=run.get("max_running"))
    trials = {int(t["number"]): t for t in results["trials"]
              if t.get("plan") and t.get("planned_at") is not None
              and t.get("started_at") is not None and t.get("finished_at") is not None}
    events: list[tuple[float, int, int, tuple[Any, ...]]] = []
    for number, t in trials.items():
        events.append((float(t["planned_at"]), _PLANNED, number, ()))
    if run.get("last_wave_at") is not None:
        events.append((float(run["last_wave_at"]), _LAST_WAVE, -1, ()))
    heapq.heapify(events)
    placements: list[tuple[int, tuple[int, ...]]] = []
    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, number, data = heapq.heappop(events)
            if kind == _PLANNED:
                core.planned(now, TrialPlan.from_dict(number, trials[number]["plan"]))
            elif kind == _LAST_WAVE:
                core.set_arrivals_pending(False)
            elif kind == _PACE:
                core.step_measured(now, number, *data)
            else:
                core.finished(now, number)
        for action in core.decide(now):
            if isinstance(action, PlanOption):
                core.option_planned(action.key, action.devices, None)  # not recorded
                continue
            placements.append((action.key, action.device_ids))
            _schedule(events, action, trials[action.key], now)
    return placements


def _schedule(events: list[tuple[float, int, int, tuple[Any, ...]]], action: Start,
              trial: Mapping[str, Any], now: float) -> None:
    """The started trial's paces and end, at the offsets from its start measured for real."""
    started = float(trial["started_at"])
    for t, step, spu, since in trial.get("pace") or ():
        heapq.heappush(events, (now + (float(t) - started), _PACE, action.key,
                                (int(step), float(spu), now + (float(since) - started))))
    heapq.heappush(events, (now + (float(trial["finished_at"]) - started), _FINISHED,
                            action.key, ()))


def recorded_placements(results: Mapping[str, Any]) -> list[tuple[int, tuple[int, ...]]]:
    """The real run's first placements ``[(trial number, device ids), ...]`` in start order."""
    started = [(float(t["started_at"]), int(t["number"]), tuple(t["placements"][0][1]))
               for t in results["trials"]
               if t.get("started_at") is not None and t.get("placements")]
    return [(number, ids) for _, number, ids in sorted(started)]


def as_json(placements: Sequence[tuple[int, tuple[int, ...]]]) -> str:
    """``{"placements": [[trial number, [device ids]], ...]}``."""
    return json.dumps({"placements": [[n, list(ids)] for n, ids in placements]})
