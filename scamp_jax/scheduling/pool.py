"""The device pool's books: which trial holds how many bytes (and compute) on which device.

Decisions come from a placement policy (`scamp_jax.scheduling.placement`); `DevicePool` only
records them, checks that none over-commits a device, and gives policies an immutable
`PoolSnapshot`.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import replace

from scamp_jax._units import format_bytes
from scamp_jax.scheduling.placement import Placement, PoolSnapshot, TrialRequest


class DevicePool:
    """Mutable bookkeeping of what runs where; decisions come from a policy, not from here.

    Args:
      capacity: bytes each device can hold, one entry per device id ``0..n-1``.
    """

    def __init__(self, capacity: Sequence[int]) -> None:
        if len(capacity) == 0:
            raise ValueError("the device pool needs at least one device; got an empty capacity")
        for d, c in enumerate(capacity):
            if c <= 0:
                raise ValueError(f"device {d} has capacity {c} bytes; capacities must be positive")
        self.capacity: tuple[int, ...] = tuple(int(c) for c in capacity)
        self._used = [0] * len(self.capacity)
        self._occupants = [0] * len(self.capacity)
        self._exclusive = [False] * len(self.capacity)
        self._busy = [0.0] * len(self.capacity)
        self._running: dict[int, tuple[Placement, TrialRequest]] = {}
        #: the most bytes ever booked on each device (the allocator's peak is a high-water
        #: mark too: `scamp_jax.hpo.calibration` compares the two)
        self.high_water = [0] * len(self.capacity)
        # (free bytes, id) of the devices no exclusive trial holds, sorted, by occupancy: what a
        # policy's index starts from (`PoolSnapshot.levels`), kept up to date per device.
        self._levels: dict[int, list[tuple[int, int]]] = {
            0: [(c, d) for d, c in enumerate(self.capacity)]}
        self._levels[0].sort()

    def _unlist(self, d: int) -> None:
        if self._exclusive[d]:
            return
        lst = self._levels[self._occupants[d]]
        entry = (self.capacity[d] - self._used[d], d)
        i = bisect.bisect_left(lst, entry)
        if i < len(lst) and lst[i] == entry:
            del lst[i]
        if not lst and self._occupants[d]:
            del self._levels[self._occupants[d]]

    def _list(self, d: int) -> None:
        if not self._exclusive[d]:
            bisect.insort(self._levels.setdefault(self._occupants[d], []),
                          (self.capacity[d] - self._used[d], d))

    @property
    def running(self) -> Mapping[int, Placement]:
        """Placements of the running trials, by trial key."""
        return {key: placement for key, (placement, _) in self._running.items()}

    @property
    def idle_devices(self) -> int:
        """Number of devices nothing runs on."""
        return len(self._levels.get(0, ()))

    def request_of(self, key: int) -> TrialRequest:
        """The request trial ``key`` was allocated with."""
        return self._running[key][1]

    def snapshot(self) -> PoolSnapshot:
        """Immutable view for a policy's ``decide``."""
        return PoolSnapshot(
            capacity=self.capacity,
            used=tuple(self._used),
            exclusive=tuple(self._exclusive),
            occupants=tuple(self._occupants),
            busy=tuple(self._busy),
            levels=tuple((o, tuple(lst)) for o, lst in sorted(self._levels.items())),
        )

    def allocate(self, placement: Placement, request: TrialRequest) -> None:
        """Reserve ``request.bytes_per_device`` on each device of ``placement``.

        ``placement`` may hold more devices than ``request.devices`` (the fixed policy gives
        every trial the same count); a placement on as many devices as one of the request's
        options allocates that option (`TrialRequest.placed_as`, then kept as `request_of`).
        Raises ``ValueError`` on double allocation, unknown or repeated device ids, or when the
        reservation would over-commit a device or join an exclusive trial.
        """
        request = request.placed_as(len(placement.device_ids))
        key = placement.key
        if key != request.key:
            raise ValueError(f"placement is for trial {key} but the request is for {request.key}")
        if key in self._running:
            where = self._running[key][0].device_ids
            raise ValueError(f"trial {key} is already running on devices {where}")
        ids = placement.device_ids
        if len(set(ids)) != len(ids) or not ids:
            raise ValueError(f"trial {key}: device ids {ids} must be distinct and non-empty")
        exclusive = request.exclusive
        for d in ids:
            if not 0 <= d < len(self.capacity):
                raise ValueError(
                    f"trial {key}: device id {d} is outside the pool 0..{len(self.capacity) - 1}"
                )
            if self._exclusive[d]:
                raise ValueError(f"trial {key}: device {d} is held by an exclusive trial")
            if exclusive and self._occupants[d]:
                raise ValueError(f"trial {key} is exclusive but device {d} already runs a trial")
            if self._used[d] + request.bytes_per_device > self.capacity[d]:
                raise ValueError(
                    f"trial {key} would over-commit device {d}: "
                    f"{format_bytes(self._used[d])} used + "
                    f"{format_bytes(request.bytes_per_device)} > capacity "
                    f"{format_bytes(self.capacity[d])}; place it elsewhere or wait"
                )
        for d in ids:
            self._unlist(d)
            self._used[d] += request.bytes_per_device
            self.high_water[d] = max(self.high_water[d], self._used[d])
            self._busy[d] += request.busy_fraction
            self._occupants[d] += 1
            self._exclusive[d] = exclusive
            self._list(d)
        self._running[key] = (placement, request)

    def rebook_busy(self, key: int, busy_fraction: float) -> None:
        """Record running trial ``key``'s busy fraction as ``busy_fraction`` (a measurement
        replaced a prediction); its bytes stay booked as they are."""
        placement, request = self._running[key]
        if not 0 <= busy_fraction <= 1:
            raise ValueError(f"trial {key}: busy_fraction={busy_fraction} must be in [0, 1]")
        for d in placement.device_ids:
            self._busy[d] += busy_fraction - request.busy_fraction
        self._running[key] = (placement, replace(request, busy_fraction=busy_fraction))

    def release(self, key: int) -> Placement:
        """Free the devices of trial ``key``; returns its placement. Raises if it is not running."""
        if key not in self._running:
            raise ValueError(
                f"trial {key} is not running (running: {sorted(self._running)[:10]}); "
                "release each trial once, after it was allocated"
            )
        placement, request = self._running.pop(key)
        for d in placement.device_ids:
            self._unlist(d)
            self._used[d] -= request.bytes_per_device
            self._busy[d] -= request.busy_fraction
            self._occupants[d] -= 1
            if self._occupants[d] == 0:
                self._exclusive[d] = False
                self._used[d] = 0
                self._busy[d] = 0.0
            self._list(d)
        return placement
