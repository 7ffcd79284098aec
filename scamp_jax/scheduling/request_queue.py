"""Waiting trials indexed for fast placement decisions on long queues (no JAX, no I/O).

A placement policy walks the waiting trials in a fixed order (`scamp_jax.scheduling.placement`:
longest predicted first among the arrivals near the oldest, then arrival order) and starts
each trial for which enough devices have room. With 100,000 trials waiting, walking all of them
per decision costs more than the decision is worth. `RequestQueue` keeps them grouped by
*shape* (devices, exclusive), each shape in arrival order and by bytes, and the arrivals near
the oldest in the longest-first order, all up to date as trials arrive and start, so a policy
can jump to the next trial of a shape that fits (`ScampPolicy.decide`): the same decisions as
walking the whole queue.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

#: a `scamp_jax.scheduling.placement.TrialRequest` (this module sits below placement, which
#: imports it, so it names the type without importing it).
TrialRequest = Any

Shape = tuple[int, bool]  # (devices, exclusive)


class _ShapeIndex:
    """The waiting trials of one shape."""

    def __init__(self) -> None:
        self.arrival: list[tuple[int, int]] = []  # (arrival, key), sorted
        self.by_bytes: list[tuple[int, int, int]] = []  # (bytes, arrival, key), sorted
        # Longest-first order of the trials that arrived before ``horizon[window]``:
        # (-seconds, arrival, key), sorted, per window length asked for.
        self.windows: dict[int, tuple[int, list[tuple[float, int, int]]]] = {}


def _window_entry(r: TrialRequest) -> tuple[float, int, int]:
    return (-(r.seconds or 0.0), r.arrival, r.key)


class RequestQueue:
    """The waiting `TrialRequest`s, indexed by shape; `add` and `remove` as trials come and go.

    Iterating yields the requests (any order); ``len`` counts them. Keys are unique.
    """

    def __init__(self, requests: Iterable[TrialRequest] = ()) -> None:
        self.requests: dict[int, TrialRequest] = {}
        self.arrival: list[tuple[int, int]] = []  # every waiting trial: (arrival, key), sorted
        self.shapes: dict[Shape, _ShapeIndex] = {}
        self.with_options: set[int] = set()
        for r in requests:
            self.add(r)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TrialRequest]:
        return iter(self.requests.values())

    def add(self, request: TrialRequest) -> None:
        """A trial joins the queue (raises if its key is queued already)."""
        key = request.key
        if key in self.requests:
            raise ValueError(f"trial {key} is queued twice; remove it before adding it again")
        self.requests[key] = request
        bisect.insort(self.arrival, (request.arrival, key))
        shape = self.shapes.setdefault((request.devices, request.exclusive), _ShapeIndex())
        bisect.insort(shape.arrival, (request.arrival, key))
        bisect.insort(shape.by_bytes, (request.bytes_per_device, request.arrival, key))
        for horizon, order in shape.windows.values():
            if request.arrival < horizon:
                bisect.insort(order, _window_entry(request))
        if request.options:
            self.with_options.add(key)

    def remove(self, key: int) -> TrialRequest:
        """Trial ``key`` leaves the queue (started or withdrawn); returns its request."""
        request = self.requests.pop(key)
        _discard(self.arrival, (request.arrival, key))
        shape_key = (request.devices, request.exclusive)
        shape = self.shapes[shape_key]
        _discard(shape.arrival, (request.arrival, key))
        _discard(shape.by_bytes, (request.bytes_per_device, request.arrival, key))
        for horizon, order in shape.windows.values():
            if request.arrival < horizon:
                _discard(order, _window_entry(request))
        if not shape.arrival:
            del self.shapes[shape_key]
        self.with_options.discard(key)
        return request

    def window(self, shape: _ShapeIndex, window: int, horizon: int
               ) -> list[tuple[float, int, int]]:
        """The trials of ``shape`` that arrived before ``horizon``, longest first (ties by
        arrival), kept for the next call with the same ``window``."""
        held = shape.windows.get(window)
        if held is None:
            end = bisect.bisect_left(shape.arrival, (horizon, -1))
            order = sorted(_window_entry(self.requests[k]) for _, k in shape.arrival[:end])
        else:
            old, order = held
            lo, hi = sorted((old, horizon))
            moved = shape.arrival[bisect.bisect_left(shape.arrival, (lo, -1)):
                                  bisect.bisect_left(shape.arrival, (hi, -1))]
            for _, k in moved:
                entry = _window_entry(self.requests[k])
                if horizon > old:
                    bisect.insort(order, entry)
                else:
                    _discard(order, entry)
        shape.windows[window] = (horizon, order)
        return order


def _discard(lst: list, entry: tuple) -> None:
    i = bisect.bisect_left(lst, entry)
    if i < len(lst) and lst[i] == entry:
        del lst[i]
