"""Live view of a running search: the device pool and every trial's progress.

On a terminal it is a rich ``Live`` display refreshed a few times a second: one row per device
(memory reserved, trials on it) and one per trial (config, devices, model-parallel degree, batch,
step, loss, metric, state, and the fused group it trains in: ``g<id>x<width>``). When stdout is
not a terminal (CI, a log file, a rank under ``mpirun``: `is_terminal`) it prints one plain
line per state change instead, so logs stay readable, and while a trial trains a progress line
(step, loss, pace, time left) after 30 s, then after twice as long each time up to every 5
minutes: a cluster's log of long trials shows they advance without growing by the second.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from scamp_jax._units import format_bytes, format_duration, shortened
from scamp_jax.hpo.trial import TrialStatus

_ACTIVE = ("compiling", "training", "evaluating", "starting", "resizing")


#: Columns of what a study or experiment prints to a log (no terminal): wide plain lines and
#: tables instead of rich's 80 columns.
LOG_WIDTH = 160
#: Seconds from a training trial's last plain line to its first progress line, and the most
#: between two (each wait twice the last, `LiveView`)
PROGRESS_FIRST_S, PROGRESS_MOST_S = 30.0, 300.0


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal a table can be drawn on: it says it is a tty, and one
    that reports a size. Open MPI gives each rank's stdout a pseudo-terminal of 0 columns,
    whether ``mpirun`` writes to a terminal or to a file, so a rank logs plain lines; a stream
    without a file descriptor is taken at its word."""
    if not getattr(stream, "isatty", lambda: False)():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no descriptor (io.UnsupportedOperation)
        return True


def log_console(file: Any = None, *, quiet: bool = False) -> Any:
    """A rich ``Console`` on ``file`` (None: stdout when printing) that draws on a terminal
    (`is_terminal`: its own width, colours) and writes a log, a pipe or a rank's size-less
    pseudo-terminal as wide plain lines (`LOG_WIDTH`, no colour codes)."""
    from rich.console import Console

    terminal = is_terminal(sys.stdout if file is None else file)
    return Console(file=file, quiet=quiet, soft_wrap=True, force_terminal=terminal,
                   width=None if terminal else LOG_WIDTH)


def _fmt_params(params: Mapping[str, Any], width: int = 48) -> str:
    parts = []
    for key, value in params.items():
        if isinstance(value, float):
            value = f"{value:.2e}" if abs(value) < 1e-2 else f"{value:.3g}"
        parts.append(f"{key}={value}")
    text = " ".join(parts)
    return text if len(text) <= width else text[: width - 1] + "…"


def _fmt_float(value: float, digits: int = 4) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}g}"


def _fmt_group(group: tuple[int, int] | None) -> str:
    return "" if group is None else f"g{group[0]}x{group[1]}"


class LiveView:
    """Shows the pool and the trials; call `update` from the engine, use as a context manager.

    Args:
      capacity: bytes per device.
      metric: name of the study metric shown per trial (e.g. ``"psnr"``).
      title: heading of the display.
      stream: where to write (default stdout); a stream that is not a terminal
        (`is_terminal`) gets plain log lines.
      refresh_per_second: redraw rate of the rich display.
    """

    def __init__(self, capacity: Sequence[int], metric: str, *, title: str = "search",
                 stream: TextIO | None = None, refresh_per_second: float = 2.0) -> None:
        self.capacity = list(capacity)
        self.metric = metric
        self.title = title
        self.stream = stream or sys.stdout
        self.interactive = is_terminal(self.stream)
        self.refresh_per_second = refresh_per_second
        self._lock = threading.Lock()
        self._statuses: list[TrialStatus] = []
        self._used: list[int] = [0] * len(self.capacity)
        self._occupants: list[list[int | str]] = [[] for _ in self.capacity]
        self._last_state: dict[int, str] = {}
        #: per trial (per fused group: ``("g", id)``): when its last plain line was printed,
        #: and the wait for its next progress line
        self._last_line: dict[Any, tuple[float, float]] = {}
        self._groups: dict[int, tuple[int, int]] = {}
        self._live: Any = None
        self._t0 = time.monotonic()
        self._notice = ""

    def __enter__(self) -> LiveView:
        if self.interactive:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream)
            # get_renderable: each refresh re-reads the trials' progress, which runners update.
            self._live = Live(console=console, get_renderable=self.render,
                              refresh_per_second=self.refresh_per_second, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.refresh()
            self._live.__exit__(*exc)
            self._live = None

    def update(self, statuses: Sequence[TrialStatus], pool: Any = None,
               groups: Mapping[int, tuple[int, int]] | None = None) -> None:
        """New state of the trials (and of the `DevicePool`, for per-device memory; and
        ``groups``: ``{trial number: (fused group id, width)}`` of the fused trials)."""
        with self._lock:
            self._statuses = list(statuses)
            if groups is not None:
                self._groups = dict(groups)
            if pool is not None:
                snapshot = pool.snapshot()
                self._used = list(snapshot.used)
                occupants: list[list[int | str]] = [[] for _ in self.capacity]
                fused = {g for g, _ in self._groups.values()}
                for key, placement in pool.running.items():
                    for d in placement.device_ids:
                        occupants[d].append(f"g{key}" if key in fused else key)
                self._occupants = occupants
        if self._live is None:
            self._log_changes()

    def notice(self, text: str) -> None:
        """A line for the user about the search as a whole (e.g. what it waits for): logged
        with the elapsed time without a terminal, shown under the trials on one; ``""``
        clears it."""
        elapsed = time.monotonic() - self._t0
        with self._lock:
            self._notice = f"[{elapsed:.0f}s] {text}" if text else ""
        if self._live is None and text:
            print(f"[{elapsed:7.1f}s] {text}", file=self.stream, flush=True)

    def _log_changes(self) -> None:
        now = time.monotonic()
        for s in self._statuses:
            if self._last_state.get(s.number) == s.state:
                self._log_progress(s, now)
                continue
            first = s.number not in self._last_state
            self._last_state[s.number] = s.state
            self._last_line[self._progress_key(s)] = (now, PROGRESS_FIRST_S)
            elapsed = now - self._t0
            line = f"[{elapsed:7.1f}s] trial {s.number:>3} {s.state:<11}"
            if first and s.retry_of is not None:
                line += f" (trial {s.retry_of} again: its earlier run did not finish)"
            if s.devices or s.batch_size:  # planned: before it, nothing to show but its state
                line += (f" devices={list(s.devices)} mp={s.model_parallel} "
                         f"batch={s.batch_size} step={s.step}/{s.steps}")
                if s.state == "training" and s.first_step:
                    line += f" (resumed from its checkpoint at step {s.first_step})"
            if s.number in self._groups:
                group, width = self._groups[s.number]
                line += f" group={group} members={width}"
            if not math.isnan(s.loss):
                line += f" loss={s.loss:.4g}"
            if not math.isnan(s.metric):
                line += f" {self.metric}={s.metric:.4g}" + _measured_at(s)
            if s.reason and s.state in ("failed", "pruned", "oom", "deferred"):
                line += f" ({shortened(s.reason, 120)})"
            elif s.reason and s.state == "planning" and not first:
                # planned again after its run: why (out of memory), and that it starts over
                line += f" (planned again: {shortened(s.reason, 120)})"
            print(line, file=self.stream, flush=True)

    def _progress_key(self, s: TrialStatus) -> Any:
        """Whose progress line ``s``'s is: its own, or its fused group's (one for all)."""
        group = self._groups.get(s.number)
        return s.number if group is None else ("g", group[0])

    def _log_progress(self, s: TrialStatus, now: float) -> None:
        """A training trial's (or its fused group's) progress line, when its wait since its
        last line is over."""
        key = self._progress_key(s)
        last, wait = self._last_line.get(key, (now, PROGRESS_FIRST_S))
        if s.state != "training" or now - last < wait:
            return
        self._last_line[key] = (now, min(2 * wait, PROGRESS_MOST_S))
        who = f"trial {s.number:>3}"
        if isinstance(key, tuple):  # the group steps as one: its members in one line
            members = sorted(n for n, (g, _) in self._groups.items() if g == key[1])
            who = f"trials {', '.join(map(str, members))} (group {key[1]})"
        line = f"[{now - self._t0:7.1f}s] {who} {s.state:<11} step={s.step}/{s.steps}"
        if s.steps:
            line += f" ({100 * s.step / s.steps:.0f}%)"
        if not math.isnan(s.loss) and not isinstance(key, tuple):  # a member's own: its lines
            line += f" loss={s.loss:.4g}"
        done, seconds = s.step - s.first_step, now - s.training_since
        if done > 0 and seconds > 0:
            pace = done / seconds
            line += f", {pace:.3g} steps/s"
            if s.steps > s.step:
                line += f", about {format_duration((s.steps - s.step) / pace)} left"
        print(line, file=self.stream, flush=True)

    def render(self) -> Any:
        """The rich renderable: a device table above a trial table."""
        from rich.console import Group
        from rich.table import Table

        with self._lock:
            statuses = list(self._statuses)
            used, occupants = list(self._used), [list(o) for o in self._occupants]
            notice = self._notice
        devices = Table(title=f"{self.title}: device pool", expand=False)
        for name in ("device", "memory reserved", "use", "trials"):
            devices.add_column(name)
        for d, cap in enumerate(self.capacity):
            frac = used[d] / cap if cap else 0.0
            bar = "█" * int(round(10 * frac)) + "·" * (10 - int(round(10 * frac)))
            devices.add_row(str(d), f"{format_bytes(used[d])} / {format_bytes(cap)}",
                            f"{bar} {100 * frac:3.0f}%", " ".join(map(str, occupants[d])))
        trials = Table(title="trials", expand=False, caption=notice or None)
        for name in ("#", "config", "devices", "mp", "batch", "group", "step", "loss",
                     self.metric, "state"):
            trials.add_column(name)
        active = [s for s in statuses if s.state in _ACTIVE]
        rest = [s for s in statuses if s.state not in _ACTIVE]
        for s in (active + rest[::-1])[:24]:
            trials.add_row(str(s.number), _fmt_params(s.params),
                           ",".join(map(str, s.devices)), str(s.model_parallel),
                           str(s.batch_size), _fmt_group(self._groups.get(s.number)),
                           f"{s.step}/{s.steps}", _fmt_float(s.loss),
                           _fmt_float(s.metric) + _measured_at(s), s.state)
        return Group(devices, trials)


class PlainStream:
    """stdout without a terminal, so `LiveView` prints log lines (``--no-live``)."""

    def write(self, text: str) -> int:
        """Write ``text`` to stdout."""
        return sys.stdout.write(text)

    def flush(self) -> None:
        """Flush stdout."""
        sys.stdout.flush()

    def isatty(self) -> bool:
        """Never a terminal: log lines, never a live table."""
        return False


class RankStream:
    """A text stream that prefixes every line with ``[rank R]`` (plain logs of ranks > 0).

    Args:
      rank: the MPI rank named in the prefix.
      stream: where the lines go (default ``sys.stdout``).
    """

    def __init__(self, rank: int, stream: Any = None) -> None:
        self.prefix = f"[rank {rank}] "
        self.stream = stream if stream is not None else sys.stdout
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        """Buffer ``text`` and write every completed line with the prefix."""
        with self._lock:
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
            for line in lines:
                self.stream.write(f"{self.prefix}{line}\n")
        return len(text)

    def flush(self) -> None:
        """Flush the underlying stream (a partial line stays buffered until its newline)."""
        self.stream.flush()

    def isatty(self) -> bool:
        """Never a terminal: ranks other than 0 log plain lines, never a live table."""
        return False


def _measured_at(s: TrialStatus) -> str:
    """Where a trial's metric is of an earlier step than the one it shows (an intermediate
    evaluation's, while it trains on or evaluates at its end): `` (at step 30)``; else ""."""
    return f" (at step {s.metric_step})" if 0 < s.metric_step != s.step else ""
