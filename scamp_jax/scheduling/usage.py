"""Usage accounting: how much device memory was reserved over time, and how long devices sat idle.

`UsageRecorder` is fed start/finish events with a time stamp in seconds. The HPO engine passes
wall-clock seconds, the cluster simulator virtual seconds; both get the same figures from the same
code. Nothing here knows about JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scamp_jax.scheduling.placement import Placement


@dataclass(frozen=True)
class BusyInterval:
    """One trial's stay on one device: ``[start, end)`` seconds (``end`` None while running)."""

    key: int
    start: float
    end: float | None
    bytes: int


class UsageRecorder:
    """Time-weighted memory reservation and device occupancy of a device pool.

    Args:
      capacity: bytes per device id ``0..n-1`` (the same list the `DevicePool` has).
      t0: time the accounting starts at, in seconds (means and idle time cover ``[t0, t_end]``).
    """

    def __init__(self, capacity: Sequence[int], t0: float = 0.0) -> None:
        if len(capacity) == 0 or any(c <= 0 for c in capacity):
            raise ValueError(f"capacity {list(capacity)[:8]} must list a positive size per device")
        self.capacity = tuple(int(c) for c in capacity)
        self.t0 = float(t0)
        self._total = sum(self.capacity)
        self._reserved = 0
        self._last_t = self.t0
        # (time, fraction reserved from this time on); starts at t0 with nothing reserved.
        self._series: list[tuple[float, float]] = [(self.t0, 0.0)]
        self._running: dict[int, tuple[Placement, int, int]] = {}  # bytes, trials
        self._occupants = [0] * len(self.capacity)
        self._idle_since: list[float | None] = [self.t0] * len(self.capacity)
        self._idle_closed = 0.0
        self._intervals: list[list[BusyInterval]] = [[] for _ in self.capacity]
        self._started = 0
        self._finished = 0

    def _advance(self, t: float) -> float:
        t = float(t)
        if t < self._last_t:
            raise ValueError(
                f"event time {t} s is earlier than the previous event at {self._last_t} s; "
                "feed events in time order"
            )
        self._last_t = t
        return t

    def _record(self, t: float) -> None:
        fraction = self._reserved / self._total
        if self._series[-1][0] == t:
            self._series[-1] = (t, fraction)
        else:
            self._series.append((t, fraction))

    def start(self, t: float, placement: Placement, bytes_per_device: int,
              trials: int = 1) -> None:
        """Trial ``placement.key`` reserves ``bytes_per_device`` on each of its devices at ``t``
        seconds; ``trials``: the trials it trains (a fused group's members, counted in
        ``trials_started`` and ``trials_finished``)."""
        t = self._advance(t)
        key = placement.key
        if key in self._running:
            raise ValueError(f"trial {key} started twice without finishing; call finish() first")
        for d in placement.device_ids:
            if not 0 <= d < len(self.capacity):
                raise ValueError(f"device id {d} is outside the pool 0..{len(self.capacity) - 1}")
            if self._occupants[d] == 0:
                since = self._idle_since[d]
                assert since is not None  # an unoccupied device always has an idle start
                self._idle_closed += t - since
                self._idle_since[d] = None
            self._occupants[d] += 1
            self._intervals[d].append(BusyInterval(key, t, None, int(bytes_per_device)))
        self._running[key] = (placement, int(bytes_per_device), int(trials))
        self._reserved += int(bytes_per_device) * len(placement.device_ids)
        self._started += int(trials)
        self._record(t)

    def finish(self, t: float, key: int) -> None:
        """Trial ``key`` releases its devices at ``t`` seconds."""
        t = self._advance(t)
        if key not in self._running:
            raise ValueError(f"trial {key} finished but was never started (or finished twice)")
        placement, nbytes, trials = self._running.pop(key)
        for d in placement.device_ids:
            self._occupants[d] -= 1
            if self._occupants[d] == 0:
                self._idle_since[d] = t
            intervals = self._intervals[d]
            for i in range(len(intervals) - 1, -1, -1):
                if intervals[i].key == key and intervals[i].end is None:
                    iv = intervals[i]
                    intervals[i] = BusyInterval(key, iv.start, t, iv.bytes)
                    break
        self._reserved -= nbytes * len(placement.device_ids)
        self._finished += trials
        self._record(t)

    def move(self, t: float, placement: Placement, bytes_per_device: int) -> None:
        """Running trial ``placement.key`` continues on ``placement`` with ``bytes_per_device``
        from ``t`` seconds (a restart on other devices): its busy intervals and reservation
        move; the trials started and finished stay as they are."""
        started, finished = self._started, self._finished
        trials = self._running[placement.key][2] if placement.key in self._running else 1
        self.finish(t, placement.key)
        self.start(t, placement, bytes_per_device, trials)
        self._started, self._finished = started, finished

    def memory_utilization_series(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Step function of reserved memory: ``(times_s, fractions)``, fraction holding from each
        time until the next; fraction = reserved bytes / aggregate capacity of the pool."""
        times, fractions = zip(*self._series, strict=True)
        return tuple(times), tuple(fractions)

    def _check_end(self, t_end: float) -> float:
        if t_end < self._last_t:
            raise ValueError(
                f"t_end={t_end} s is before the last event at {self._last_t} s; pass a later time"
            )
        return float(t_end)

    def mean_memory_utilization(self, t_end: float) -> float:
        """Time-weighted mean of the reserved fraction of aggregate memory over ``[t0, t_end]``."""
        t_end = self._check_end(t_end)
        if t_end <= self.t0:
            return 0.0
        area = 0.0
        for (t, fraction), (t_next, _) in zip(
            self._series, [*self._series[1:], (t_end, 0.0)], strict=True
        ):
            area += fraction * (t_next - t)
        return area / (t_end - self.t0)

    def idle_device_seconds(self, t_end: float) -> float:
        """Device-seconds in ``[t0, t_end]`` during which a device had no trial placed on it."""
        t_end = self._check_end(t_end)
        open_idle = sum(t_end - since for since in self._idle_since if since is not None)
        return self._idle_closed + open_idle

    def busy_intervals(self, t_end: float | None = None) -> tuple[tuple[BusyInterval, ...], ...]:
        """Per device id, the trials it held in start order; running ones end at ``t_end`` if given
        (else ``end`` is None). For occupancy timeline plots."""
        if t_end is not None:
            t_end = self._check_end(t_end)
        return tuple(
            tuple(
                iv if iv.end is not None or t_end is None
                else BusyInterval(iv.key, iv.start, t_end, iv.bytes)
                for iv in intervals
            )
            for intervals in self._intervals
        )

    def summary(self, t_end: float) -> dict[str, float]:
        """Headline figures over ``[t0, t_end]``.

        Keys: ``elapsed_s``, ``devices``, ``mean_memory_utilization`` (fraction),
        ``peak_memory_utilization`` (fraction), ``idle_device_seconds``, ``idle_fraction`` (of all
        device-seconds), ``trials_started``, ``trials_finished``.
        """
        t_end = self._check_end(t_end)
        elapsed = t_end - self.t0
        idle = self.idle_device_seconds(t_end)
        device_seconds = elapsed * len(self.capacity)
        return {
            "elapsed_s": elapsed,
            "devices": float(len(self.capacity)),
            "mean_memory_utilization": self.mean_memory_utilization(t_end),
            "peak_memory_utilization": max(f for _, f in self._series),
            "idle_device_seconds": idle,
            "idle_fraction": idle / device_seconds if device_seconds > 0 else 0.0,
            "trials_started": float(self._started),
            "trials_finished": float(self._finished),
        }
