"""Placement: which queued trials start now, and on which devices (the ScaMP load balancer).

Everything here is a pure decision on plain numbers: byte counts per device and trial requests.
No JAX, no arrays, no executors. The HPO engine and the cluster simulator drive the same code
(`scamp_jax.scheduling.pool.DevicePool` keeps the books):

    pool = DevicePool(capacity)                      # bytes per device id 0..n-1
    for placement in policy.decide(pool.snapshot(), queue, arrivals_pending=more_to_come):
        pool.allocate(placement, request_of[placement.key])  # books the chosen option
        ...start the trial on placement.device_ids...
    pool.release(key)                                # when it ends

Two policies share the ``decide(snapshot, queue) -> tuple[Placement, ...]`` contract:

- `ScampPolicy`: memory packing on the least loaded devices, longest predicted trials first, a
  data-parallel degree per trial (`TrialRequest.options`: more devices where that costs little,
  idle devices in the last wave), sharing only into spare compute in the last wave, and
  EASY-backfilling anti-starvation: when the oldest waiting trial (the *head*) cannot start, k
  devices are reserved for it and later trials may only *backfill* around its memory and compute,
  so the head starts as soon as the trials already on its reserved devices finish.
- `FixedPolicy`: the fixed-resources baseline (Ray Tune's ``resources_per_trial``): every trial
  gets ``devices_per_trial`` whole devices for itself, strictly first-in first-out, no sharing.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Protocol

from scamp_jax._units import format_bytes
from scamp_jax.scheduling.request_queue import RequestQueue


@dataclass(frozen=True)
class DeviceOption:
    """Another device count a queued trial can start with (more data-parallel replicas).

    Attributes:
      devices: number of devices of this alternative plan.
      bytes_per_device: predicted peak memory per device of that plan, bytes.
      seconds: predicted seconds the trial runs alone on those devices (same unit as
        `TrialRequest.seconds`); None: not costed (a policy may assume a linear speed-up, and
        `ScampPolicy` then grows a trial into it only onto devices that would idle).
      busy_fraction: as `TrialRequest.busy_fraction`, for this plan.
    """

    devices: int
    bytes_per_device: int
    seconds: float | None = None
    busy_fraction: float = 0.0

    def __post_init__(self) -> None:
        if (self.devices < 1 or self.bytes_per_device < 0
                or (self.seconds is not None and self.seconds < 0)
                or not 0 <= self.busy_fraction <= 1):
            raise ValueError(
                f"DeviceOption(devices={self.devices}, bytes_per_device={self.bytes_per_device}, "
                f"seconds={self.seconds}, busy_fraction={self.busy_fraction}) needs devices >= 1,"
                " non-negative bytes and seconds (or None) and a busy fraction in [0, 1]"
            )


@dataclass(frozen=True)
class TrialRequest:
    """A planned trial waiting for devices.

    Attributes:
      key: trial number (unique among queued and running trials).
      devices: number of devices the trial's plan needs (data-parallel x model-parallel degree).
      bytes_per_device: predicted peak memory of the trial on each of its devices, in bytes.
      arrival: queue order; smaller arrives first (ties broken by ``key``).
      exclusive: the trial must not share its devices with any other trial.
      seconds: predicted seconds the trial runs alone on ``devices`` devices (None: unknown). Only
        comparisons between trials of one queue matter, so any unit proportional to seconds works.
      options: alternative plans on more devices (`DeviceOption`, distinct device counts, each
        larger than ``devices``) a policy may start the trial with instead; the placement's
        device count says which one it chose (`placed_as`).
      busy_fraction: predicted fraction of its run time the trial keeps its devices' compute
        units busy, in [0, 1] (0: unknown). The rest is communication and launch gaps that a
        trial sharing the device can fill.
    """

    key: int
    devices: int
    bytes_per_device: int
    arrival: int
    exclusive: bool = False
    seconds: float | None = None
    options: tuple[DeviceOption, ...] = ()
    busy_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"trial {self.key}: devices={self.devices} must be at least 1")
        if self.bytes_per_device < 0:
            raise ValueError(
                f"trial {self.key}: bytes_per_device={self.bytes_per_device} must be >= 0"
            )
        if self.seconds is not None and self.seconds < 0:
            raise ValueError(f"trial {self.key}: seconds={self.seconds} must be >= 0 or None")
        if not 0 <= self.busy_fraction <= 1:
            raise ValueError(
                f"trial {self.key}: busy_fraction={self.busy_fraction} must be in [0, 1]"
            )
        counts = [o.devices for o in self.options]
        if len(set(counts)) != len(counts) or any(c <= self.devices for c in counts):
            raise ValueError(
                f"trial {self.key}: option device counts {counts} must be distinct and larger "
                f"than the plan's {self.devices} devices; drop the duplicates or smaller ones"
            )

    def choices(self) -> tuple[DeviceOption, ...]:
        """The plan itself and its alternatives, fewest devices first."""
        base = DeviceOption(self.devices, self.bytes_per_device, self.seconds, self.busy_fraction)
        return (base, *sorted(self.options, key=attrgetter("devices")))

    def placed_as(self, devices: int) -> TrialRequest:
        """The request as started on ``devices`` devices: the option with that device count
        (without further options), or this request if none has it (e.g. the fixed policy's
        ``devices_per_trial`` devices for a smaller plan)."""
        for option in self.options:
            if option.devices == devices:
                return replace(self, devices=devices, bytes_per_device=option.bytes_per_device,
                               seconds=option.seconds, busy_fraction=option.busy_fraction,
                               options=())
        return self


@dataclass(frozen=True)
class Placement:
    """Decision to start trial ``key`` on the devices ``device_ids`` (distinct pool indices)."""

    key: int
    device_ids: tuple[int, ...]


@dataclass(frozen=True)
class PoolSnapshot:
    """Immutable view of the device pool that a policy decides on.

    Attributes:
      capacity: bytes each device id ``0..n-1`` can hold.
      used: bytes reserved on each device by running trials.
      exclusive: whether each device is held by an exclusive trial (nothing else may join it).
      occupants: number of running trials on each device (empty tuple: derived from ``used``,
        a device with ``used > 0`` counting as occupied).
      busy: summed `TrialRequest.busy_fraction` of the trials running on each device (empty
        tuple: all 0).
      levels: ``(occupants, ((free bytes, id), ...) sorted)`` of the devices not held by an
        exclusive trial, by occupancy (None: derived here). `DevicePool` keeps them sorted as
        trials come and go, so a policy on a large pool does not sort every device per call;
        they must agree with the fields above.
    """

    capacity: tuple[int, ...]
    used: tuple[int, ...]
    exclusive: tuple[bool, ...]
    occupants: tuple[int, ...] = ()
    busy: tuple[float, ...] = ()
    levels: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] | None = field(
        default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.capacity)
        if len(self.used) != n or len(self.exclusive) != n:
            raise ValueError(
                f"snapshot fields disagree on the device count: capacity has {n}, used "
                f"{len(self.used)}, exclusive {len(self.exclusive)}; give one entry per device"
            )
        if self.occupants and len(self.occupants) != n:
            raise ValueError(f"occupants has {len(self.occupants)} entries for {n} devices")
        if self.busy and len(self.busy) != n:
            raise ValueError(f"busy has {len(self.busy)} entries for {n} devices")

    @property
    def free(self) -> tuple[int, ...]:
        """Unreserved bytes per device."""
        return tuple(map(operator.sub, self.capacity, self.used))

    def is_empty(self, device: int) -> bool:
        """Whether nothing runs on ``device``."""
        if self.occupants:
            return self.occupants[device] == 0
        return self.used[device] == 0 and not self.exclusive[device]


def check_feasible(request: TrialRequest, capacity: Sequence[int]) -> None:
    """Raise ``ValueError`` if ``request`` can never run on a pool with per-device ``capacity``.

    A request is feasible when at least ``request.devices`` devices each hold
    ``request.bytes_per_device`` bytes. Call it before queueing, so a policy never waits forever
    on a trial that cannot start even on an idle pool.
    """
    n = len(capacity)
    if request.devices > n:
        raise ValueError(
            f"trial {request.key} needs {request.devices} devices but the pool has {n}; "
            "plan it for at most that many devices (a larger model-parallel degree per device "
            "does not help: it needs more devices) or add devices"
        )
    if _smallest(capacity) >= request.bytes_per_device:
        fitting = n  # all of them (the usual pool: one capacity); no per-device count
    else:
        fitting = sum(1 for c in capacity if c >= request.bytes_per_device)
    if fitting < request.devices:
        largest = max(capacity, default=0)
        raise ValueError(
            f"trial {request.key} needs {format_bytes(request.bytes_per_device)} on each of "
            f"{request.devices} devices but only {fitting} device(s) hold that much (largest "
            f"{format_bytes(largest)}); re-plan it with a smaller batch or more model parallelism"
        )


_smallest_held: tuple[object, int] = ((), 0)  # the capacity last asked about, its minimum


def _smallest(capacity: Sequence[int]) -> int:
    """``min(capacity, default=0)``, kept for the last capacity tuple asked about: a pool's
    capacity is one tuple for its lifetime, and a large pool's minimum costs a pass per check."""
    global _smallest_held
    held = _smallest_held  # one read: another thread may replace it meanwhile
    if held[0] is capacity and isinstance(capacity, tuple):
        return held[1]
    smallest = min(capacity, default=0)
    _smallest_held = (capacity, smallest)
    return smallest


class Policy(Protocol):
    """What the engine and the simulator need from a placement policy."""

    @property
    def name(self) -> str:
        """Its name, as `make_policy` takes it (``"scamp"``, ``"fixed"``)."""
        ...

    def decide(
        self,
        snapshot: PoolSnapshot,
        queue: Sequence[TrialRequest] | RequestQueue,
        *,
        arrivals_pending: bool = True,
    ) -> tuple[Placement, ...]:
        """Trials of ``queue`` to start now and their devices; never over-commits ``snapshot``.

        ``arrivals_pending``: whether more trials may still join the queue later.
        """
        ...

    def request_devices(self, planned_devices: int) -> int:
        """Devices a trial planned for ``planned_devices`` devices will be given by this policy."""
        ...


def _ordered(queue: Iterable[TrialRequest]) -> list[TrialRequest]:
    """Queue in arrival order, ties by key. (A key queued twice is caught by `DevicePool`.)"""
    return sorted(queue, key=_ARRIVAL_ORDER)


_ARRIVAL_ORDER = attrgetter("arrival", "key")
_FEW = 256  # trials of a shape within the byte limit that the indexed walk compares directly
_NEVER = float("inf")


class _FreeIndex:
    """Eligible devices sorted by free bytes, for best-fit choices in O(log n) per lookup.

    ``levels[o]`` holds ``(budget, id)`` of the devices a sharing trial may join that run ``o``
    trials (all in level 0 when occupancy is ignored); ``empty`` holds ``(budget, id)`` of devices
    with nothing on them (what an exclusive trial may take). The budget is the free memory, less
    what a reservation keeps back.
    """

    def __init__(self, snapshot: PoolSnapshot, allow_sharing: bool, by_occupancy: bool) -> None:
        n = len(snapshot.capacity)
        self.allow_sharing = allow_sharing
        self.by_occupancy = by_occupancy
        if snapshot.levels is not None and snapshot.occupants:
            self._from_levels(snapshot)
            return
        self.budget = list(snapshot.free)
        self.empty_flag = [snapshot.is_empty(d) for d in range(n)]
        if snapshot.occupants:
            self.occupants = list(snapshot.occupants)
        else:
            self.occupants = [0 if e else 1 for e in self.empty_flag]
        self.blocked = [False] * n
        self.busy = list(snapshot.busy) if snapshot.busy else [0.0] * n
        self.levels: dict[int, list[tuple[int, int]]] = {}
        self.empty: list[tuple[int, int]] = []
        for d, free in enumerate(self.budget):
            if snapshot.exclusive[d]:
                self.blocked[d] = True
                continue
            if self.empty_flag[d]:
                self.empty.append((free, d))
            if allow_sharing or self.empty_flag[d]:
                self.levels.setdefault(self._level(d), []).append((free, d))
            else:
                self.blocked[d] = True
        for lst in self.levels.values():
            lst.sort()
        self.empty.sort()
        self.blocked_ids = set(itertools.compress(range(n), self.blocked))

    def _from_levels(self, snapshot: PoolSnapshot) -> None:
        """The same index from the pool's sorted levels (`PoolSnapshot.levels`): no per-device
        sort, so building it costs a copy of the pool's lists."""
        n = len(snapshot.capacity)
        self.budget = list(map(operator.sub, snapshot.capacity, snapshot.used))
        self.occupants = list(snapshot.occupants)
        self.empty_flag = [o == 0 for o in self.occupants]
        self.busy = list(snapshot.busy) if snapshot.busy else [0.0] * n
        pool = {o: lst for o, lst in snapshot.levels if lst}  # type: ignore[union-attr]
        self.empty = list(pool.get(0, ()))
        if self.allow_sharing:
            self.blocked = list(snapshot.exclusive)
            if self.by_occupancy:
                self.levels = {o: list(lst) for o, lst in pool.items()}
            else:
                merged = sorted(itertools.chain.from_iterable(pool.values()))
                self.levels = {0: merged} if merged else {}
        else:
            self.blocked = [not e for e in self.empty_flag]
            self.levels = {0: list(self.empty)} if self.empty else {}
        self.blocked_ids = set(itertools.compress(range(n), self.blocked))

    def kth_budget(self, devices: int, needs_empty: bool) -> float:
        """The most bytes a trial of ``devices`` devices can book now (the ``devices``-th
        largest eligible budget; -inf: too few eligible devices): `pick` succeeds, without a
        busy constraint, exactly for ``nbytes`` up to this."""
        if needs_empty:
            return self.empty[-devices][0] if len(self.empty) >= devices else -math.inf
        tops = sorted(itertools.chain.from_iterable(lst[-devices:]
                                                    for lst in self.levels.values()))
        return tops[-devices][0] if len(tops) >= devices else -math.inf

    def _level(self, d: int) -> int:
        return self.occupants[d] if self.by_occupancy else 0

    @property
    def exhausted(self) -> bool:
        """No device can take any further trial."""
        return not self.empty and not any(self.levels.values())

    def _remove(self, d: int) -> None:
        entry = (self.budget[d], d)
        for lst in (self.levels.get(self._level(d), []), self.empty):
            i = bisect.bisect_left(lst, entry)
            if i < len(lst) and lst[i] == entry:
                del lst[i]

    def _insert(self, d: int) -> None:
        bisect.insort(self.levels.setdefault(self._level(d), []), (self.budget[d], d))

    def pick(self, devices: int, nbytes: int, needs_empty: bool,
             busy: float | None = None) -> tuple[int, ...] | None:
        """``devices`` eligible devices with budget >= ``nbytes``, or None if there are fewer.

        Needing empty devices: the smallest such budgets (best fit). Otherwise the least occupied
        devices first (when indexed by occupancy), best fit within each occupancy level; with
        ``busy`` given, only devices that are empty or whose busy fractions plus ``busy`` stay
        within 1 (compute-aware sharing).
        """
        if needs_empty:
            i = bisect.bisect_left(self.empty, (nbytes, -1))
            if len(self.empty) - i < devices:
                return None
            return tuple(d for _, d in self.empty[i : i + devices])
        chosen: list[int] = []
        for level in sorted(self.levels):
            lst = self.levels[level]
            i = bisect.bisect_left(lst, (nbytes, -1))
            if busy is None or level == 0 and self.by_occupancy:
                chosen.extend(d for _, d in lst[i : i + devices - len(chosen)])
            else:
                for _, d in lst[i:]:
                    if self.empty_flag[d] or self.busy[d] + busy <= 1.0 + 1e-9:
                        chosen.append(d)
                        if len(chosen) == devices:
                            break
            if len(chosen) == devices:
                return tuple(chosen)
        return None

    def take(self, device_ids: Iterable[int], nbytes: int, exclusive: bool,
             busy: float = 0.0) -> None:
        """Record that a trial of ``nbytes`` per device now runs on ``device_ids``."""
        for d in device_ids:
            self._remove(d)
            self.budget[d] -= nbytes
            self.busy[d] += busy
            self.empty_flag[d] = False
            self.occupants[d] += 1
            if not exclusive and self.allow_sharing:
                self._insert(d)
            else:
                self.blocked[d] = True
                self.blocked_ids.add(d)

    def fence(self, device_ids: Iterable[int], keep_bytes: int | None,
              keep_busy: float = 0.0) -> None:
        """Reserve ``device_ids``: keep ``keep_bytes`` free on each, or all of it if None, and
        ``keep_busy`` of the compute (for compute-aware sharing)."""
        for d in device_ids:
            if self.blocked[d]:
                continue
            self._remove(d)
            self.busy[d] += keep_busy
            if keep_bytes is None or not self.allow_sharing:
                self.blocked[d] = True
                self.blocked_ids.add(d)
                continue
            self.budget[d] -= keep_bytes
            self.empty_flag[d] = False  # an exclusive trial would delay the head
            if self.budget[d] >= 0:
                self._insert(d)
            else:
                self.blocked[d] = True
                self.blocked_ids.add(d)

    def reservation_candidates(self, snapshot: PoolSnapshot, head: TrialRequest,
                               needs_empty: bool) -> Iterable[int]:
        """Devices among which a reservation for ``head``'s ``head.devices`` best lie: all of
        them, or, on a pool of one capacity, a superset of the best that is small on a large
        pool.

        The head did not fit, so fewer than ``k = head.devices`` eligible devices hold its
        bytes (sharing) or are empty (needing empty devices): those are kept. Among the others
        the shortfall falls as the free budget rises, so within each occupancy level a device
        with ``k`` devices of strictly larger budget ahead of it never makes the cut; the
        devices held by exclusive trials are kept (their shortfall is their used memory)."""
        capacity = snapshot.capacity
        n = len(capacity)
        if n <= 64 or min(capacity) != max(capacity):
            return range(n)
        k = head.devices
        ids = set(self.blocked_ids)
        ids.update(d for _, d in self.empty)
        for lst in self.levels.values():
            if len(lst) <= k:
                ids.update(d for _, d in lst)
                continue
            threshold = lst[-k][0]
            if not needs_empty:
                threshold = min(threshold, head.bytes_per_device)
            ids.update(d for _, d in lst[bisect.bisect_left(lst, (threshold, -1)):])
        return sorted(ids)


@dataclass(frozen=True)
class ScampPolicy:
    """ScaMP placement: memory packing, longest-first starts, elastic degrees, EASY backfilling.

    Rule, applied on each call:

    0. Order. With ``longest_first``, the trials that arrived within ``overtake_window`` of the
       oldest waiting trial go longest predicted run time (`TrialRequest.seconds`) first, as in
       longest-processing-time list scheduling, so the long trials that decide the makespan
       do not start last; later arrivals follow in arrival order. Without predictions (all
       ``seconds`` 0) the order is the arrival order.
    1. Degree. A trial with `TrialRequest.options` asks for the largest device count whose
       device-seconds stay within ``growth_tolerance`` of its plan's (more data parallelism at
       almost no cost shortens it, and shorter trials balance the load better); from here on it
       is treated as if planned that way. With ``elastic`` and no further arrivals pending (the
       study's last wave), empty devices that the queue would leave idle go to its trials, one
       step up at a time to the trial with the longest predicted run time; such a trial falls
       back to its asked degree when the empty devices are gone.
    2. Start each trial on k eligible devices whose free memory holds its predicted peak: the
       least occupied devices first (``spread``), and among equally occupied ones the least free
       memory (best fit; ties to the lower device id); in the last wave with ``compute_aware``
       only devices with spare compute for it. A trial grown for the last wave takes empty
       devices only. Exclusive trials (and every trial when ``share_devices=False``) need empty
       devices.
    3. If the oldest trial not started yet (the *head*) cannot start, reserve for it the k
       devices that could hold it with the least memory still to drain (for a sharing head:
       ``bytes - free``; for one needing empty devices: the bytes in use), ties to fewer
       occupants, then lower id. Trials after it in the order only *backfill*: they start on
       unreserved devices, or on reserved devices whose free memory stays >= the head's bytes
       after they join (never when the head needs the devices empty). One reservation per call.

    The summed shortfall of the head's best k devices never grows while it waits (backfill does not
    consume it, finishes only shrink it), and only the finitely many trials that arrived within
    ``overtake_window`` after it can start ahead of it, so the head starts once those and the
    trials on its reserved devices have finished: no endless stream of trials can starve it.
    ``reserve_for_head=False`` turns step 3 into plain greedy first fit, which can starve large
    trials.

    Attributes:
      share_devices: let trials share a device when their predicted peaks fit together.
      reserve_for_head: apply the anti-starvation reservation.
      spread: balance load (fewest trials per device first). ``False`` packs purely by memory
        (best fit over all devices), which keeps whole devices free for large trials but piles
        small trials onto one device while others idle: trials on one device share its compute,
        so in the cluster simulator pure packing of a study with fewer trials than devices runs
        many times longer.
      longest_first: order the trials near the head by predicted run time (step 0).
      overtake_window: arrivals after the head that may start before it (None: the number of
        devices in the pool).
      elastic: give idle devices of the last wave to queued trials' larger options (step 1).
      growth_tolerance: extra device-seconds, as a fraction of the plan's, that a larger option
        may cost and still be preferred while devices are contended (0: only free growth).
      compute_aware: in the last wave (no arrivals pending), share a device only while the
        busy fractions of the trials on it (`TrialRequest.busy_fraction`) sum to at most 1, so
        sharing fills communication and launch gaps instead of slowing the long trials that
        decide the makespan. While trials keep arriving, memory alone decides (throughput).
      resize_running: with ``elastic``, once nothing is queued or to come, restart running
        trials on their devices plus idle ones with the same global batch
        (`scamp_jax.scheduling.elastic.resizes`; the engine and the simulator apply it).
      min_resize_gain: fraction of a running trial's remaining time a restart on more devices
        must save to be worth its checkpoint and compile.
      batch_multiple: a trial's planned batch is a multiple of this (where one fits), so that it
        can grow or restart onto 2 or 4 devices with the same batch: a batch of 41 cannot be
        split, one of 40 can (`scamp_jax.planning.planner.plan_mesh`'s ``batch_multiple``; the
        engine's planning service and the simulator's profiles both apply it).
    """

    share_devices: bool = True
    reserve_for_head: bool = True
    spread: bool = True
    longest_first: bool = True
    overtake_window: int | None = None
    elastic: bool = True
    growth_tolerance: float = 0.05
    compute_aware: bool = True
    resize_running: bool = True
    min_resize_gain: float = 0.1
    batch_multiple: int = 4
    name: str = field(default="scamp", init=False)

    def __post_init__(self) -> None:
        if self.overtake_window is not None and self.overtake_window < 1:
            raise ValueError(f"overtake_window={self.overtake_window} must be >= 1 or None")
        if self.growth_tolerance < 0:
            raise ValueError(f"growth_tolerance={self.growth_tolerance} must be >= 0")
        if not 0 <= self.min_resize_gain < 1:
            raise ValueError(f"min_resize_gain={self.min_resize_gain} must be in [0, 1)")
        if self.batch_multiple < 1:
            raise ValueError(f"batch_multiple={self.batch_multiple} must be >= 1")

    def request_devices(self, planned_devices: int) -> int:
        """ScaMP gives a trial exactly the devices its plan needs (or one of its options)."""
        return planned_devices

    def _needs_empty(self, request: TrialRequest) -> bool:
        return request.exclusive or not self.share_devices

    def _reservation(
        self, snapshot: PoolSnapshot, index: _FreeIndex, head: TrialRequest
    ) -> tuple[int, ...]:
        needs_empty = self._needs_empty(head)
        candidates = []
        for d in index.reservation_candidates(snapshot, head, needs_empty):
            cap = snapshot.capacity[d]
            if cap < head.bytes_per_device:
                continue
            if needs_empty:
                shortfall = cap - index.budget[d] if not index.empty_flag[d] else 0
            else:
                shortfall = max(0, head.bytes_per_device - index.budget[d])
                if index.blocked[d]:  # held by an exclusive trial: all of it must drain
                    shortfall = cap - index.budget[d]
            candidates.append((shortfall, index.occupants[d], d))
        candidates.sort()
        return tuple(d for _, _, d in candidates[: head.devices])

    def _order(self, snapshot: PoolSnapshot, by_arrival: list[TrialRequest]
               ) -> list[TrialRequest]:
        if not self.longest_first or not by_arrival:
            return list(by_arrival)
        window = self.overtake_window or len(snapshot.capacity)
        horizon = by_arrival[0].arrival + window
        # The trials within the window are a prefix, ``by_arrival`` being in arrival order.
        end = bisect.bisect_left(by_arrival, horizon, key=attrgetter("arrival"))
        # Stable: ties (and unknown costs, last) keep arrival order.
        near = sorted(by_arrival[:end], key=lambda r: -(r.seconds or 0.0))
        return near + by_arrival[end:]

    def _degrees(
        self,
        snapshot: PoolSnapshot,
        index: _FreeIndex,
        ordered: list[TrialRequest],
        arrivals_pending: bool,
    ) -> dict[int, tuple[DeviceOption, ...]]:
        """Choose elastic trials' degrees (step 1). Rewrites ``ordered`` in place so each trial
        asks for its preferred degree (then reserved and backfilled around like a plan); returns,
        per trial grown further for the last wave, the larger options to try first.

        A trial none of whose options is costed keeps its plan's degree, so its choices are
        built only when the last wave has empty devices to grow it into (on a long queue most
        trials are such, and most calls have none)."""
        capacities = sorted(snapshot.capacity)
        n = len(capacities)
        picked: dict[int, tuple[tuple[DeviceOption, ...], int]] = {}
        later: list[int] = []  # positions of trials whose options are all uncosted
        for pos, r in enumerate(ordered):
            if not r.options or r.exclusive:
                continue
            if r.seconds is None or all(o.seconds is None for o in r.options):
                later.append(pos)
                continue
            c = self._choices(r, capacities, n)
            if c is None:
                continue  # the plan itself never fits: check_feasible says so below
            costed = {o.devices for o in r.options if o.seconds is not None}
            budget = (1.0 + self.growth_tolerance) * c[0].devices * (c[0].seconds or 0.0)
            pick = 0
            for i, o in enumerate(c):
                seconds, fastest = o.seconds, c[pick].seconds
                assert seconds is not None and fastest is not None  # costed by `_choices`
                if o.devices in costed and seconds < fastest and o.devices * seconds <= budget:
                    pick = i
            if pick:
                o = c[pick]
                ordered[pos] = replace(
                    r, devices=o.devices, bytes_per_device=o.bytes_per_device,
                    seconds=o.seconds, busy_fraction=o.busy_fraction,
                    options=tuple(x for x in r.options if x.devices > o.devices),
                )
            picked[pos] = (c, pick)
        if not (self.elastic and not arrivals_pending and (picked or later)):
            return {}
        surplus = len(index.empty) - sum(r.devices for r in ordered)
        if surplus <= 0:
            return {}
        for pos in later:
            c = self._choices(ordered[pos], capacities, n)
            if c is not None:
                picked[pos] = (c, 0)
        chosen: dict[int, int] = {}
        choices: dict[int, tuple[DeviceOption, ...]] = {}
        for pos in sorted(picked):
            key = ordered[pos].key
            choices[key], chosen[key] = picked[pos]
        return _grow_into_surplus(chosen, choices, surplus)

    @staticmethod
    def _choices(r: TrialRequest, capacities: list[int], n: int
                 ) -> tuple[DeviceOption, ...] | None:
        """``r``'s plan and options that some ``devices`` devices of the pool hold, fewest
        devices first, each costed (None: the plan itself never fits). A trial of unknown cost
        counts as one unit of time, its options then being uncosted too; uncosted options are
        a linear speed-up, trusted only for growth onto idle devices."""
        own = r.seconds if r.seconds is not None else 1.0
        c = tuple(o if o.seconds is not None and r.seconds is not None
                  else replace(o, seconds=own * r.devices / o.devices)
                  for o in r.choices()
                  if n - bisect.bisect_left(capacities, o.bytes_per_device) >= o.devices)
        return c if c and c[0].devices == r.devices else None

    def decide(
        self,
        snapshot: PoolSnapshot,
        queue: Sequence[TrialRequest] | RequestQueue,
        *,
        arrivals_pending: bool = True,
    ) -> tuple[Placement, ...]:
        """Trials of ``queue`` to start now, each with its device ids (see the class docstring).

        Args:
          snapshot: current pool state (bytes per device).
          queue: waiting trials, any order; ``arrival`` decides priority among equals.
          arrivals_pending: whether more trials may still join the queue later (False in a
            study's last wave, which lets idle devices go to queued trials' larger options).
        Returns:
          Placements in start order. A placement's device count says which of the request's
          options it starts (`TrialRequest.placed_as`); allocating them in order never
          over-commits the pool.
        """
        # While trials keep arriving, throughput counts: share by memory, letting co-located
        # trials fill each other's gaps even if each slows down. In the last wave the longest
        # trials set the makespan: share only into spare compute.
        compute_aware = self.compute_aware and not arrivals_pending
        if not compute_aware:
            # No busy limits and no other degrees to weigh: whether a trial fits is a byte
            # threshold per shape, so the indexed walk skips the trials that cannot start.
            if not isinstance(queue, RequestQueue) and not any(r.options for r in queue):
                queue = RequestQueue(queue)
            if isinstance(queue, RequestQueue) and not queue.with_options:
                return self._decide_indexed(snapshot, queue)
        index = _FreeIndex(snapshot, allow_sharing=self.share_devices, by_occupancy=self.spread)
        placements: list[Placement] = []
        head_blocked = False
        share = self.share_devices
        by_arrival = _ordered(queue)
        ordered = self._order(snapshot, by_arrival)
        grow = self._degrees(snapshot, index, ordered, arrivals_pending)
        # The head is the oldest trial not started yet: ``by_arrival[oldest]``, skipping started
        # ones as we go (keys identify trials: ``ordered`` may hold rewritten requests).
        oldest = 0
        started: set[int] = set()
        # Within one call budgets only shrink: once k devices of b bytes were not found, no later
        # request for k devices of >= b bytes can be placed. Skipping those keeps a decision on a
        # long queue to one comparison per hopeless request.
        smallest_failed: dict[tuple[int, bool, float | None], int] = {}
        for request in ordered:
            device_ids = None
            for option in grow.get(request.key, ()):
                device_ids = index.pick(option.devices, option.bytes_per_device, True)
                if device_ids is not None:
                    index.take(device_ids, option.bytes_per_device, exclusive=False,
                               busy=option.busy_fraction)
                    break
            if device_ids is None:
                needs_empty = request.exclusive or not share
                busy = request.busy_fraction if compute_aware else None
                # Budgets only shrink, but a lower busy fraction may fit where a higher did not.
                signature = (request.devices, needs_empty, busy)
                nbytes = request.bytes_per_device
                hopeless = nbytes >= smallest_failed.get(signature, _NEVER)
                if hopeless and head_blocked:
                    continue
                if not hopeless:
                    device_ids = index.pick(request.devices, nbytes, needs_empty, busy)
                if device_ids is None:
                    if not hopeless:
                        smallest_failed[signature] = nbytes
                    while by_arrival[oldest].key in started:  # ``request`` is not started
                        oldest += 1
                    if not head_blocked and by_arrival[oldest].key == request.key:
                        head_blocked = True
                        # A head that never fits would block the queue forever: say so instead.
                        check_feasible(request, snapshot.capacity)
                        if self.reserve_for_head:
                            reserved = self._reservation(snapshot, index, request)
                            keep = None if needs_empty else request.bytes_per_device
                            index.fence(reserved, keep, request.busy_fraction)
                    if not hopeless and index.exhausted:
                        break
                    continue
                index.take(device_ids, nbytes, exclusive=needs_empty,
                           busy=request.busy_fraction)
            started.add(request.key)
            placements.append(Placement(request.key, device_ids))
        return tuple(placements)


    def _decide_indexed(self, snapshot: PoolSnapshot, queue: RequestQueue
                        ) -> tuple[Placement, ...]:
        """`decide` while memory alone decides and no trial has other degrees.

        The same walk as `decide` (step 0's order, steps 2 and 3), taken in jumps: a trial of
        ``k`` devices fits exactly when its bytes are at most the ``k``-th largest eligible
        budget (`_FreeIndex.kth_budget`), budgets only shrink within a call, so per shape
        (devices, exclusive) the walk goes on from where it stopped to the next trial that fits,
        and a shape whose smallest trial does not fit is not walked at all. The head's turn comes
        at its place in the order, as in the full walk.
        """
        if not queue.requests:
            return ()
        index = _FreeIndex(snapshot, allow_sharing=self.share_devices, by_occupancy=self.spread)
        share = self.share_devices
        oldest = queue.arrival[0][0]
        window = (self.overtake_window or len(snapshot.capacity)) if self.longest_first else 0
        horizon = oldest + window
        requests = queue.requests
        started: set[int] = set()
        placements: list[Placement] = []

        def order_key(r: TrialRequest) -> tuple[int, float, int, int]:
            if window and r.arrival < horizon:
                return (0, -(r.seconds or 0.0), r.arrival, r.key)
            return (1, 0.0, r.arrival, r.key)

        # [shape, devices, needs_empty, window order, position in it, position in the tail,
        #  first trial by bytes not started this call]
        walks = []
        for (devices, exclusive), shape in queue.shapes.items():
            near = queue.window(shape, window, horizon) if window else []
            tail = bisect.bisect_left(shape.arrival, (horizon, -1))
            walks.append([shape, devices, exclusive or not share, near, 0, tail, 0])

        def next_fit(walk: list) -> tuple[int, float, int, int] | None:
            shape, devices, needs_empty, near, _, _, first = walk
            limit = index.kth_budget(devices, needs_empty)
            by_bytes = shape.by_bytes
            while first < len(by_bytes) and by_bytes[first][2] in started:
                first += 1  # started trials only accumulate within a call
            walk[6] = first
            if first == len(by_bytes) or by_bytes[first][0] > limit:
                return None
            # Every waiting trial of the shape within the limit lies ahead of the walk (budgets
            # only shrink); when they are few, the first of them in the order is the answer.
            within = bisect.bisect_right(shape.by_bytes, (limit, math.inf, math.inf))
            if within <= _FEW:
                return min(order_key(requests[key]) for _, _, key in shape.by_bytes[:within]
                           if key not in started)
            while walk[4] < len(near):
                neg, arrival, key = near[walk[4]]
                if key not in started and requests[key].bytes_per_device <= limit:
                    return (0, neg, arrival, key)
                walk[4] += 1
            arrivals = shape.arrival
            while walk[5] < len(arrivals):
                arrival, key = arrivals[walk[5]]
                if key not in started and requests[key].bytes_per_device <= limit:
                    return (1, 0.0, arrival, key)
                walk[5] += 1
            return None

        def head_after(position: int) -> int:
            while position < len(queue.arrival) and queue.arrival[position][1] in started:
                position += 1
            return position

        head_at = 0
        head_turn = order_key(requests[queue.arrival[0][1]])
        head_waits = True  # the walk has not passed the head yet
        while True:
            fits = [f for f in map(next_fit, walks) if f is not None]
            best = min(fits) if fits else None
            if head_waits and (best is None or head_turn < best):
                # The walk reaches the head, and it cannot start: reserve for it (step 3).
                head_waits = False
                head = requests[queue.arrival[head_at][1]]
                check_feasible(head, snapshot.capacity)
                if self.reserve_for_head:
                    reserved = self._reservation(snapshot, index, head)
                    keep = None if self._needs_empty(head) else head.bytes_per_device
                    index.fence(reserved, keep, head.busy_fraction)
                continue
            if best is None:
                break
            request = requests[best[3]]
            needs_empty = request.exclusive or not share
            device_ids = index.pick(request.devices, request.bytes_per_device, needs_empty)
            assert device_ids is not None  # within the threshold: it fits
            index.take(device_ids, request.bytes_per_device, exclusive=needs_empty,
                       busy=request.busy_fraction)
            started.add(request.key)
            placements.append(Placement(request.key, device_ids))
            if head_waits and request.key == queue.arrival[head_at][1]:
                head_at = head_after(head_at)
                if head_at == len(queue.arrival):
                    head_waits = False
                else:
                    # A new head the walk has passed already gets no reservation this call.
                    head_turn = order_key(requests[queue.arrival[head_at][1]])
                    head_waits = head_turn > best
        return tuple(placements)


@dataclass(frozen=True)
class FixedPolicy:
    """Fixed-resources baseline: ``devices_per_trial`` whole devices per trial, strict FIFO.

    Every trial is exclusive on its devices (no sharing, whatever its memory) and gets exactly
    ``devices_per_trial`` devices, as with Ray Tune's fixed ``resources_per_trial``. Trials start in
    arrival order; the first that cannot start stops the queue (nothing overtakes it).
    """

    devices_per_trial: int = 1
    name: str = field(default="fixed", init=False)

    def __post_init__(self) -> None:
        if self.devices_per_trial < 1:
            raise ValueError(f"devices_per_trial={self.devices_per_trial} must be at least 1")

    def request_devices(self, planned_devices: int) -> int:
        """The baseline gives every trial ``devices_per_trial`` devices."""
        if planned_devices > self.devices_per_trial:
            raise ValueError(
                f"a trial planned for {planned_devices} devices cannot run with the fixed "
                f"policy's devices_per_trial={self.devices_per_trial}; raise devices_per_trial"
            )
        return self.devices_per_trial

    def decide(
        self,
        snapshot: PoolSnapshot,
        queue: Sequence[TrialRequest] | RequestQueue,
        *,
        arrivals_pending: bool = True,
    ) -> tuple[Placement, ...]:
        """Start trials in arrival order on empty devices until the first one that does not fit.

        Args:
          snapshot: current pool state (bytes per device).
          queue: waiting trials; each must need at most ``devices_per_trial`` devices. Their
            options and predicted seconds are ignored: the baseline's resources are fixed.
          arrivals_pending: ignored (part of the policy contract).
        Returns:
          Placements of exactly ``devices_per_trial`` empty devices each (lowest ids first).
        """
        index = _FreeIndex(snapshot, allow_sharing=False, by_occupancy=False)
        placements: list[Placement] = []
        ordered: Iterable[TrialRequest] = (
            (queue.requests[key] for _, key in queue.arrival)
            if isinstance(queue, RequestQueue) else _ordered(queue))
        for request in ordered:
            self.request_devices(request.devices)
            device_ids = index.pick(self.devices_per_trial, request.bytes_per_device, True)
            if device_ids is None:
                check_feasible(
                    TrialRequest(request.key, self.devices_per_trial, request.bytes_per_device,
                                 request.arrival),
                    snapshot.capacity,
                )
                break
            # Lowest ids first keeps a trial's devices contiguous (same host) when capacities match.
            device_ids = tuple(sorted(device_ids))
            index.take(device_ids, request.bytes_per_device, exclusive=True)
            placements.append(Placement(request.key, device_ids))
        return tuple(placements)


POLICIES = ("scamp", "fixed")


def make_policy(name: str, **kwargs: object) -> ScampPolicy | FixedPolicy:
    """Build a policy by name: ``"scamp"`` (`ScampPolicy`) or ``"fixed"`` (`FixedPolicy`).

    Keyword arguments go to the policy's constructor, e.g. ``make_policy("fixed",
    devices_per_trial=4)``.
    """
    if name == "scamp":
        return ScampPolicy(**kwargs)  # type: ignore[arg-type]
    if name == "fixed":
        return FixedPolicy(**kwargs)  # type: ignore[arg-type]
    raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")


def _grow_into_surplus(chosen: dict[int, int], choices: dict[int, tuple[DeviceOption, ...]],
                       surplus: int) -> dict[int, tuple[DeviceOption, ...]]:
    """`ScampPolicy`'s last-wave growth: while the queue leaves ``surplus`` devices idle, move
    the trial that would run longest one option up (``choices[key]``, from its ``chosen``
    index). Returns, per grown trial, the larger options to try first (largest first)."""
    base = dict(chosen)
    chosen = dict(chosen)
    while surplus > 0:
        best: tuple[float, int, int] | None = None
        for key, i in chosen.items():
            c = choices[key]
            for j in range(i + 1, len(c)):
                if c[j].devices - c[i].devices > surplus:
                    break
                shorter, seconds = c[j].seconds, c[i].seconds
                assert shorter is not None and seconds is not None  # costed by `_choices`
                if shorter < seconds:
                    if best is None or seconds > best[0]:
                        best = (seconds, key, j)
                    break
        if best is None:
            break
        _, key, j = best
        surplus -= choices[key][j].devices - choices[key][chosen[key]].devices
        chosen[key] = j
    return {key: tuple(reversed(choices[key][base[key] + 1 : i + 1]))
            for key, i in chosen.items() if i > base[key]}
