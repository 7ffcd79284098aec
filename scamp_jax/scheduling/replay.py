"""Replay a finished study's run through the scheduling core.

A real study's ``results.json`` records, per trial (a fused group under its leader's number),
what the engine fed its `SchedulingCore` (``core_events``: ``[kind, seconds since the run's
start, *data]``), where each run started (``placements``: ``[start, device ids]``) and its
measured paces (``pace``: ``[time, step, seconds per step, training since]``); its ``run``
section records the budget, the safety margin, the policy parts that were active and when the
last wave began. The kinds of events:

- ``planned`` (plan): the trial, or a fused group keyed by its first member, waits for devices;
- ``option_asked`` (devices) / ``option`` (devices, plan or None): the core asked for the plan on
  more devices (last-wave growth) and got it (None: it does not fit there);
- ``oom`` (measured bytes, batch floor, may grow) and ``requeued`` (plan): a run ran out of memory
  and its re-plan waits again;
- ``restarted`` (device ids, plan): a running trial is booked on more devices (a restart at the
  end of a study); ``withdrawn`` (devices): no plan there; ``moved_back`` (device ids, plan): the
  restarted run failed before training and went back;
- ``finished``: a run ended and its devices are free.

`replay` feeds a fresh core what the world answered (plans, paces, out-of-memory bytes, how long
each run, plan and re-plan took) and lets the core make the decisions again: which trials start
where, which plans on more devices it asks for (answered after the time they took for real),
and whether each recorded restart is still worth it and fits (`SchedulingCore.still_worth`,
`restart_fits`, `restarted`, the very checks the engine books a restart with). Times after a
start are offsets from the replayed start, so a decision that came earlier or later moves the
run with it. A restart's choice of trial is the recorded one (the engine decides it on its
loop's ticks, then compiles the plan); its booking is decided again here. The engine ran exactly
these decisions, so the replay's placements equal the recorded ones
(`recorded_placements`) unless a recorded input is missing.

    python -m benchmarks.simulate_cluster --replay STUDY_DIR --json

No file is read here: `scamp_jax.sim.measured.replay_study` reads a study's ``results.json``. A
resumed study's file holds several runs; the last one is replayed (its trials carry its
``run_started``).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from scamp_jax.planning.budget import Budget
from scamp_jax.scheduling.core import PlanOption, SchedulingCore, TrialPlan
from scamp_jax.scheduling.placement import FixedPolicy, ScampPolicy

# Events at one time are applied in this order before the core decides: the engine feeds a
# plan, then (if it was the last one) the start of the last wave, at the same time stamp.
_ORDER = {"unqueued": 0, "planned": 0, "requeued": 0, "option": 0, "last_wave": 1, "pace": 2,
          "restarted": 3, "withdrawn": 3, "moved_back": 3, "placed": 3, "oom": 4, "finished": 4}
#: Events that end a run as the core sees it (its devices are free).
_ENDS = ("oom", "finished")


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


def units(results: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """The records of the last run's scheduled units by key: solo trials and fused groups'
    first members (a group's scheduling record is its leader's)."""
    run = run_section(results)
    started = run.get("run_started")
    out = {}
    for t in results["trials"]:
        if not t.get("core_events"):
            if t.get("plan") and t.get("started_at") is not None and "core_events" not in t:
                raise ValueError(
                    f"trial {t['number']} has no core_events: results.json was written by an "
                    "older version; re-run the study to replay it")
            continue
        if started is not None and t.get("run_started") != started:
            continue  # finished in an earlier run of a resumed study
        group = t.get("fused_group")
        if group is not None and int(group) != int(t["number"]):
            continue
        out[int(t["number"])] = t
    return out


@dataclass
class _Trial:
    """One unit's recorded inputs: its timeline without the option answers (those answer the
    replay's own asks), a cursor into it, and its option answers by device count."""

    timeline: list[tuple[float, str, tuple[Any, ...]]]
    options: dict[int, list[tuple[float, Any]]] = field(default_factory=dict)
    at: int = 0  # index of the next timeline entry
    #: the current run's recorded start and its replayed start (paces' "training since").
    anchor: tuple[float, float] = (0.0, 0.0)

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> _Trial:
        timeline: list[tuple[float, str, tuple[Any, ...]]] = []
        asked: dict[int, list[float]] = {}
        options: dict[int, list[tuple[float, Any]]] = {}
        for kind, t, *data in record["core_events"]:
            if kind == "option_asked":
                asked.setdefault(int(data[0]), []).append(float(t))
            elif kind == "option":
                n = int(data[0])
                since = asked.get(n, [float(t)]).pop(0) if asked.get(n) else float(t)
                options.setdefault(n, []).append((float(t) - since, data[1]))
            else:
                timeline.append((float(t), kind, tuple(data)))
        for start, ids in record.get("placements") or ():
            timeline.append((float(start), "placed", (tuple(int(i) for i in ids),)))
        for t, step, spu, since in record.get("pace") or ():
            timeline.append((float(t), "pace", (int(step), float(spu), float(since))))
        timeline.sort(key=lambda e: (e[0], _ORDER[e[1]]))
        # A member of a fused group that ran out of memory is a unit of its own from its own
        # plan on: the group's start before it is the leader's.
        first = next((i for i, e in enumerate(timeline) if e[1] == "planned"), len(timeline))
        return cls(timeline[first:], options)


def replay(results: Mapping[str, Any]) -> list[tuple[int, tuple[int, ...]]]:
    """Placements ``[(trial number, device ids), ...]`` in decision order of a replay of the last
    run of ``results`` (a parsed ``results.json``) through `SchedulingCore`: each start and each
    restart or move back on other devices."""
    run = run_section(results)
    budget = Budget(int(run["memory_per_device"]), float(run["safety_margin"]))
    core = SchedulingCore(policy_of(run["policy_parts"]), int(run["pool_devices"]), budget,
                          run.get("restart_seconds"), peak_flops=run.get("peak_flops"),
                          max_running=run.get("max_running"),
                          overlap=float(run.get("overlap", 1.0)))
    trials = {key: _Trial.of(record) for key, record in units(results).items()}
    # (time, order, sequence, key, kind, data): the sequence keeps pushes in order on ties.
    events: list[tuple[float, int, int, int, str, tuple[Any, ...]]] = []
    count = iter(range(1 << 62))

    def push(t: float, kind: str, key: int, data: tuple[Any, ...]) -> None:
        heapq.heappush(events, (t, -1 if kind == "answer" else _ORDER[kind], next(count), key,
                                kind, data))

    for key, trial in trials.items():
        if trial.timeline:
            t, kind, data = trial.timeline[0]
            push(t, kind, key, data)
    if run.get("last_wave_at") is not None:
        push(float(run["last_wave_at"]), "last_wave", -1, ())
    placements: list[tuple[int, tuple[int, ...]]] = []

    def follow(key: int, now: float) -> None:
        """Schedule ``key``'s next recorded entry at its recorded offset from the one just
        applied at ``now``, unless it waits for the core's decision (a start)."""
        trial = trials[key]
        if trial.at >= len(trial.timeline) or (
                key in core.queued and trial.timeline[trial.at][1] != "unqueued"):
            return
        before = trial.timeline[trial.at - 1][0]
        t, kind, data = trial.timeline[trial.at]
        push(now + (t - before), kind, key, data)

    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, _, key, kind, data = heapq.heappop(events)
            if kind == "last_wave":
                core.set_arrivals_pending(False)
                continue
            if kind == "answer":
                devices, plan = data
                core.option_planned(key, devices,
                                    None if plan is None else TrialPlan.from_dict(key, plan))
                continue
            trial = trials[key]
            trial.at += 1
            if kind == "placed":
                trial.anchor = (trial.timeline[trial.at - 1][0], now)
            elif kind == "pace":
                recorded, replayed = trial.anchor
                data = (*data[:2], replayed + (data[2] - recorded))
            _apply(core, key, kind, data, now, placements)
            follow(key, now)
        for action in core.decide(now):
            trial = trials[action.key]
            if isinstance(action, PlanOption):
                answers = trial.options.get(action.devices) or []
                delay, plan = answers.pop(0) if answers else (0.0, None)  # never asked for real
                push(now + delay, "answer", action.key, (action.devices, plan))
                continue
            placements.append((action.key, action.device_ids))
            if trial.at < len(trial.timeline) and trial.timeline[trial.at][1] == "placed":
                trial.at += 1  # the recorded start this decision replays
                trial.anchor = (trial.timeline[trial.at - 1][0], now)
                follow(action.key, now)
    return placements


def _apply(core: SchedulingCore, key: int, kind: str, data: tuple[Any, ...], now: float,
           placements: list[tuple[int, tuple[int, ...]]]) -> None:
    """Feed ``core`` one recorded event of unit ``key`` at replayed time ``now``."""
    if kind == "planned":
        core.planned(now, TrialPlan.from_dict(key, data[0]))
    elif kind == "requeued":
        core.requeue(now, TrialPlan.from_dict(key, data[0]))
    elif kind == "unqueued":
        if key in core.queued:
            core.unqueue(now, key)
    elif kind == "pace":
        step, spu, since = data
        core.step_measured(now, key, step, spu, since)
    elif kind == "finished":
        core.finished(now, key)
    elif kind == "oom":
        core.finished(now, key)  # what follows (a re-plan) comes as its own events
    elif kind == "withdrawn":
        core.withdraw(key, int(data[0]))
    elif kind == "restarted":
        ids, plan = tuple(int(i) for i in data[0]), TrialPlan.from_dict(key, data[1])
        if (key in core.running and core.still_worth(key, plan.devices)
                and core.restart_fits(key, ids) and core.restarted(now, key, ids, plan)):
            placements.append((key, ids))
    elif kind == "moved_back":
        ids = tuple(int(i) for i in data[0])
        if key in core.running:
            core.move_back(now, key, ids, TrialPlan.from_dict(key, data[1]))
            placements.append((key, ids))
    # "placed" after a restart or move back: the run starting on its booked devices, nothing
    # new for the core.


def recorded_placements(results: Mapping[str, Any]) -> list[tuple[int, tuple[int, ...]]]:
    """The real run's placements ``[(trial number, device ids), ...]`` in decision order: each
    start the core decided, and each restart or move back (at its booking)."""
    out = []
    for key, record in units(results).items():
        moved = False
        for t, kind, data in _Trial.of(record).timeline:
            if kind in ("restarted", "moved_back"):
                out.append((t, _ORDER[kind], key, tuple(int(i) for i in data[0])))
                moved = True
            elif kind == "placed":
                if not moved:
                    out.append((t, _ORDER[kind], key, data[0]))
                moved = False
    return [(key, ids) for _, _, key, ids in sorted(out)]


def as_json(placements: Sequence[tuple[int, tuple[int, ...]]]) -> str:
    """``{"placements": [[trial number, [device ids]], ...]}``."""
    return json.dumps({"placements": [[n, list(ids)] for n, ids in placements]})
