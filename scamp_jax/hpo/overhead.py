"""Where a study's time goes besides training: ``run.overhead`` in ``results.json``.

`OverheadRecorder` listens to `jax.monitoring` while a study runs: JAX reports every trace,
lowering and backend compile with the jitted function's name, on the thread that does it, and
the project reports its own timed sections the same way (`record_section`: checkpoint writes;
executables loaded onto other devices instead of compiled, `scamp_jax.planning.reuse`; initial
states computed with NumPy, `scamp_jax.planning.initial_state`;
the report and its plots, written after ``results.json``, are added to it afterwards by the
study session). Compiles are attributed by thread: the engine's planner threads
(``planner*``) plan, its trial threads (``trial*``) run trials, and within a trial the training
step (``jit(step)``; a fused group's ``jit(fused)``), the initial state (``jit(init)``) and the
evaluation forward (``jit(run)``) are told apart by name, and what compiles while a
checkpoint is written is the checkpoint's (none since trial checkpoints write each array whole:
orbax's default compiled a slicing program per array shape of a data-parallel trial,
`scamp_jax.hpo.checkpoint.array_handler`). A planner thread
compiles a new architecture's step and evaluation at the plan's batch, and the trials run
those executables: in a fresh study ``planning`` holds them, and ``runner_step`` and
``evaluation`` only what a trial compiled itself. Per part: ``compiles`` and ``compile_s``
(XLA's compiles), ``cache_loads`` and ``cache_load_s`` (executables read from the persistent
compilation cache instead), ``trace_s`` (tracing and lowering to MLIR). Seconds are summed
over threads, so with threads compiling at once they can exceed the wall-clock time; so are
the checkpoint seconds (a fused group's members save at once, each save counted whole), which
include the checkpoint's compiles.

The summary also has the time from the process's start to the study's (the interpreter, the
imports and the script's own set-up) and the device-seconds during which whole devices stood
idle while a trial was being planned, none waited for devices and the engine's running cap
left room (`idle_waiting_for_plans`, from the engine's per-trial timeline), and apart from
those, the device-seconds of the whole pool while the engine had nothing to run but trials
another process holds, or held until it was stopped hard and their heartbeat goes stale
(``idle_waiting_for_held_trials_device_s``, `scamp_jax.hpo.intake.Intake.wait`; under MPI the
sum over every rank's pool).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import jax

from scamp_jax.planning.compile_events import BACKEND_COMPILE_EVENT, CACHE_HIT_EVENT
from scamp_jax.planning.initial_state import HOST_INIT_EVENT
from scamp_jax.planning.reuse import EXECUTABLE_LOAD_EVENT

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
#: prefix of the project's own timed sections (`record_section`).
SECTION_PREFIX = "/scamp_jax/"
CHECKPOINT_SAVE = "/scamp_jax/checkpoint/save"
CHECKPOINT_WAIT = "/scamp_jax/checkpoint/wait"
_RUNNER_PARTS = {"jit(step)": "runner_step", "jit(fused)": "runner_step",
                 "jit(init)": "runner_init", "jit(run)": "evaluation"}
PARTS = ("planning", "runner_step", "runner_init", "evaluation", "checkpoint", "runner_other",
         "other")
#: the timed section each thread is in (`timed_section`), for the compiles inside it
_SECTION = threading.local()


def record_section(event: str, seconds: float) -> None:
    """Report ``seconds`` spent in a section named ``event`` (``/scamp_jax/...``) to any
    `OverheadRecorder` listening (a `jax.monitoring` duration event; nothing when none is)."""
    jax.monitoring.record_event_duration_secs(event, seconds)


class timed_section:  # noqa: N801 - used like a function: ``with timed_section(event): ...``
    """Context manager that reports its block's wall seconds as ``event`` (`record_section`)."""

    def __init__(self, event: str) -> None:
        self.event = event
        self.start = 0.0
        self.outer: str | None = None

    def __enter__(self) -> timed_section:
        self.outer = getattr(_SECTION, "event", None)
        _SECTION.event = self.event
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _SECTION.event = self.outer
        record_section(self.event, time.perf_counter() - self.start)


def process_age_seconds() -> float | None:
    """Wall seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _part(thread: str, fun_name: str) -> str:
    if getattr(_SECTION, "event", None) in (CHECKPOINT_SAVE, CHECKPOINT_WAIT):
        return "checkpoint"
    if thread.startswith("planner"):
        return "planning"
    if thread.startswith("trial"):
        return _RUNNER_PARTS.get(fun_name, "runner_other")
    return "other"


class OverheadRecorder:
    """Collects compile events and the project's timed sections while it is entered.

    ``with OverheadRecorder() as rec: engine.run()``, then ``rec.summary(result)``. Listeners
    are global to the process: compiles of other threads of the same process are counted too
    (attributed by thread name, see the module docstring).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hit = threading.local()
        self.compiles: dict[str, int] = defaultdict(int)
        self.compile_s: dict[str, float] = defaultdict(float)
        self.cache_loads: dict[str, int] = defaultdict(int)
        self.cache_load_s: dict[str, float] = defaultdict(float)
        self.trace_s: dict[str, float] = defaultdict(float)
        self.sections_s: dict[str, float] = defaultdict(float)
        self.sections_n: dict[str, int] = defaultdict(int)
        self.startup_s: float | None = None
        self._active = False
        self._entered = 0.0

    def _on_event(self, event: str, **kwargs: Any) -> None:
        if self._active and event == CACHE_HIT_EVENT:
            self._hit.value = True

    def _on_duration(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        if not self._active:
            return
        if event.startswith(SECTION_PREFIX):
            with self._lock:
                self.sections_s[event] += duration_secs
                self.sections_n[event] += 1
            return
        if event not in (BACKEND_COMPILE_EVENT, TRACE_EVENT, LOWER_EVENT):
            return
        part = _part(threading.current_thread().name, str(kwargs.get("fun_name", "")))
        with self._lock:
            if event == BACKEND_COMPILE_EVENT:
                hit = getattr(self._hit, "value", False)
                self._hit.value = False
                if hit:  # read from the persistent compilation cache, not compiled
                    self.cache_loads[part] += 1
                    self.cache_load_s[part] += duration_secs
                else:
                    self.compiles[part] += 1
                    self.compile_s[part] += duration_secs
            else:
                self.trace_s[part] += duration_secs

    def __enter__(self) -> OverheadRecorder:
        self.startup_s = process_age_seconds()
        self._entered = time.perf_counter()
        self._active = True
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._active = False
        jax.monitoring.unregister_event_listener(self._on_event)
        jax.monitoring.unregister_event_duration_listener(self._on_duration)

    def summary(self, result: Any = None) -> dict[str, Any]:
        """The breakdown as plain data (seconds, counts); ``result`` (a ``SearchResult``)
        adds the idle device-seconds while trials waited for plans."""
        with self._lock:
            out: dict[str, Any] = {
                "startup_s": None if self.startup_s is None else round(self.startup_s, 3),
            }
            for part in PARTS:
                out[f"{part}_compiles"] = int(self.compiles.get(part, 0))
                out[f"{part}_compile_s"] = round(self.compile_s.get(part, 0.0), 3)
                out[f"{part}_cache_loads"] = int(self.cache_loads.get(part, 0))
                out[f"{part}_cache_load_s"] = round(self.cache_load_s.get(part, 0.0), 3)
                out[f"{part}_trace_s"] = round(self.trace_s.get(part, 0.0), 3)
            # executables loaded onto other devices instead of compiled (any thread)
            out["executable_loads"] = int(self.sections_n.get(EXECUTABLE_LOAD_EVENT, 0))
            out["executable_load_s"] = round(self.sections_s.get(EXECUTABLE_LOAD_EVENT, 0.0), 3)
            # initial states computed with NumPy, not compiled (any thread)
            out["host_initial_states"] = int(self.sections_n.get(HOST_INIT_EVENT, 0))
            out["host_initial_state_s"] = round(self.sections_s.get(HOST_INIT_EVENT, 0.0), 3)
            out["checkpoint_writes"] = int(self.sections_n.get(CHECKPOINT_SAVE, 0))
            out["checkpoint_s"] = round(self.sections_s.get(CHECKPOINT_SAVE, 0.0)
                                        + self.sections_s.get(CHECKPOINT_WAIT, 0.0), 3)
            out["report_s"] = 0.0  # measured after results.json is written
        if result is not None:
            out["elapsed_s"] = round(float(result.elapsed_s), 3)
            out["idle_waiting_for_plans_device_s"] = round(idle_waiting_for_plans(
                result.intervals, result.trial_times,
                max_running=(getattr(result, "scheduling", None) or {}).get("max_running")),
                3)
            out["idle_waiting_for_held_trials_device_s"] = held_wait_device_seconds(
                [getattr(result, "scheduling", None) or {}])
        return out


def combined_overhead(parts: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """One breakdown (`OverheadRecorder.summary`) of processes that ran at once (every MPI
    rank's): counts and seconds summed over them, the run's ``elapsed_s`` and ``startup_s``
    their longest; None where no process has one."""
    given = [p for p in parts if p]
    if not given:
        return None
    out: dict[str, Any] = {}
    for part in given:
        for key, value in part.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                out.setdefault(key, value)
            elif key in ("elapsed_s", "startup_s"):
                out[key] = max(out.get(key) or 0, value)
            else:
                out[key] = round(out.get(key, 0) + value, 3)
    return out


def held_wait_device_seconds(runs: Sequence[Mapping[str, Any]]) -> float:
    """Device-seconds the pools of ``runs`` (engines' scheduling records: one, or every MPI
    rank's) idled while only trials another process holds were left (`Intake.wait`: the whole
    pool waits)."""
    return round(sum(float(r.get("waited_for_held_trials_s") or 0.0)
                     * int(r.get("pool_devices") or 0) for r in runs), 3)


def idle_waiting_for_plans(intervals: Sequence[Sequence[Sequence[float]]],
                           trials: Sequence[Mapping[str, Any]],
                           max_running: int | None = None) -> float:
    """Device-seconds during which a device held no trial while some trial was being planned
    (asked, plan not ready), no planned trial waited for devices and fewer than
    ``max_running`` trials (or fused groups) ran: a ready plan could have started then. With
    the engine's running cap reached, idle devices wait for the cap, not for a plan; of the
    idle devices, only as many count as the trials being planned would have taken (the most
    devices of as many of them as the cap leaves room for).

    ``intervals``: per device, ``(trial, start_s, end_s, bytes)`` of every trial it held (a
    fused group under its key); ``trials``: per trial, ``asked_at``, ``planned_at`` and
    ``started_at`` (seconds on the same clock; a trial without ``asked_at`` counts as asked at
    0) and the ``devices`` of its plan (None or missing: any number); ``max_running``: the
    engine's cap on running trials (None: no cap).
    """
    planning: list[tuple[float, float, int | None]] = []
    queued: list[tuple[float, float]] = []
    for t in trials:
        planned, started = t.get("planned_at"), t.get("started_at")
        if planned is None:
            continue
        devices = t.get("devices")
        planning.append((float(t.get("asked_at") or 0.0), float(planned),
                         None if devices is None else int(devices)))
        if started is not None:
            queued.append((float(planned), float(started)))
    if not planning:
        return 0.0
    times = sorted({x for s, e, _ in planning for x in (s, e)}
                   | {x for span in queued for x in span}
                   | {float(iv[i]) for device in intervals for iv in device for i in (1, 2)})
    total = 0.0
    for a, b in zip(times, times[1:], strict=False):
        if b <= a:
            continue
        mid = (a + b) / 2
        awaited = [n for s, e, n in planning if s <= mid < e]
        if not awaited or any(s <= mid < e for s, e in queued):
            continue
        room = len(awaited)
        if max_running is not None:
            running = {iv[0] for device in intervals for iv in device
                       if float(iv[1]) <= mid < float(iv[2])}
            room = min(room, max_running - len(running))
            if room <= 0:
                continue
        idle = sum(1 for device in intervals
                   if not any(float(iv[1]) <= mid < float(iv[2]) for iv in device))
        known = [n for n in awaited if n is not None]
        if len(known) == len(awaited):
            idle = min(idle, sum(sorted(known, reverse=True)[:room]))
        total += idle * (b - a)
    return total
