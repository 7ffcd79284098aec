"""Tail elasticity: restart running trials on more devices when the pool would otherwise idle.

At the end of a study the queue is empty and devices go idle one by one while the last, often
longest, trials still run on the few devices they started with. `resizes` decides which of them
to stop at a step boundary (after a checkpoint) and restart, with the **same global batch**, on
their devices plus some idle ones: more data-parallel replicas, each on a smaller share of the
batch. Keeping the batch keeps the trial's training trajectory (same samples, same updates, up to
float reassociation of the batch mean), so a resized trial reports what it would have reported
unresized, only sooner.

With few trials left, `tail_plan` plans the study's end as a whole instead (the last wave's
device counts and one restart per long trial, now or at a predicted free); the scheduling core
follows it where it applies and these rules elsewhere.

Like `scamp_jax.scheduling.placement`, this is a pure decision on plain numbers; the engine and the
cluster simulator both call it:

    for r in resizes(policy, pool.snapshot(), running, queue_empty=not queue,
                     arrivals_pending=more_to_come):
        pool.release(r.key); pool.allocate(Placement(r.key, r.device_ids), request_for(r.option))
        ...stop trial r.key (it checkpoints), restart it on r.device_ids...
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations_with_replacement, product
from typing import Any

from scamp_jax.scheduling.costs import resized_seconds
from scamp_jax.scheduling.placement import DeviceOption, PoolSnapshot, ScampPolicy


@dataclass(frozen=True)
class RunningTrial:
    """A running trial as `resizes` sees it.

    Attributes:
      key: trial number.
      device_ids: the devices it runs on now.
      bytes_per_device: memory it reserves on each of them now, bytes.
      remaining_seconds: predicted seconds until it finishes where it is.
      options: restarts on more devices with the same global batch (`DeviceOption.devices` larger
        than ``len(device_ids)``), each with ``seconds`` = predicted seconds until it would finish
        if restarted now, the restart itself (checkpoint, compile, restore) included, and
        ``bytes_per_device`` = that plan's predicted peak per device.
      restart_seconds: the restart's own part of each option's ``seconds`` (the rest scales
        with the work left), for weighing a restart now against one on more devices later.
    """

    key: int
    device_ids: tuple[int, ...]
    bytes_per_device: int
    remaining_seconds: float
    options: tuple[DeviceOption, ...] = ()
    restart_seconds: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.device_ids)
        if n < 1 or len(set(self.device_ids)) != n:
            raise ValueError(f"trial {self.key}: device ids {self.device_ids} must be distinct "
                             "and non-empty")
        if self.remaining_seconds < 0 or self.bytes_per_device < 0:
            raise ValueError(
                f"trial {self.key}: remaining_seconds={self.remaining_seconds} and "
                f"bytes_per_device={self.bytes_per_device} must be >= 0"
            )
        if any(o.devices <= n for o in self.options):
            raise ValueError(
                f"trial {self.key}: restart options {[o.devices for o in self.options]} must each "
                f"have more than its {n} current devices"
            )


@dataclass(frozen=True)
class Resize:
    """Decision to restart trial ``key`` on ``device_ids`` (its current devices first, then the
    added ones) as planned in ``option``."""

    key: int
    device_ids: tuple[int, ...]
    option: DeviceOption


def resizes(
    policy: object,
    snapshot: PoolSnapshot,
    running: Sequence[RunningTrial],
    *,
    queue_empty: bool,
    arrivals_pending: bool,
    options_of: Callable[[RunningTrial], tuple[DeviceOption, ...]] | None = None,
) -> tuple[Resize, ...]:
    """Running trials to restart on more devices now (empty when ``policy`` does not resize).

    Only a `ScampPolicy` with ``elastic`` and ``resize_running`` resizes, and only in the tail of a
    study: nothing queued and nothing more to come, so the devices it takes would otherwise idle
    (no trial waits for them). Rule:

    1. The devices on which nothing runs are the surplus.
    2. A trial's options count only if they finish at least ``policy.min_resize_gain`` of its
       remaining time sooner (a restart costs a checkpoint and a compile; predictions are
       rough) and the new plan's bytes fit on its current devices (what it frees there plus
       their free memory) and on enough idle devices.
    3. Repeatedly, the trial with the longest predicted remaining time (as resized so far; ties
       to the earlier in ``running``) moves to its next option that finishes sooner and needs
       no more added devices than the surplus holds; stop when no trial can move. Taking one
       step at a time for the trial that would end last shortens the study's end, not just one
       trial.
    4. A trial waits instead when running trials about to end free enough devices for a larger
       option that, restarted then, finishes sooner than restarting now (a restart paid twice
       gains nothing): at each such end ``w`` the option is predicted to finish at ``w +
       (seconds - restart) * (remaining - w) / remaining + restart``, and the devices freed by
       then are shared evenly among the trials moving now. Step 3 then runs again without the
       waiting trials, so the devices they leave go to the others.

    Step 3 looks at the trials longest first and at a trial's options only when its turn comes
    (a trial that cannot move now never can: the surplus only shrinks), so with many trials
    running and few devices idle it weighs only the few longest.

    Args:
      policy: the engine's or simulator's placement policy.
      snapshot: the pool now.
      running: the running trials with their restart options.
      queue_empty: no trial is waiting for devices.
      arrivals_pending: more trials may still arrive.
      options_of: a running trial's restart options, asked for only when step 3 reaches it
        (None: each trial's ``options``). For a caller whose options cost time to build.
    Returns:
      Resizes, longest remaining trial first; applying them in order never over-commits.
    """
    if (not isinstance(policy, ScampPolicy) or not policy.elastic or not policy.resize_running
            or arrivals_pending or not queue_empty or not running):
        return ()
    n = len(snapshot.capacity)
    idle = sorted((d for d in range(n) if snapshot.is_empty(d) and not snapshot.exclusive[d]),
                  key=lambda d: (snapshot.capacity[d], d))
    if not idle:
        return ()
    free = list(snapshot.free)
    by_key = {r.key: r for r in running}
    idle_capacity = [snapshot.capacity[d] for d in idle]  # sorted, as ``idle`` is

    def worth_it(r: RunningTrial, o: DeviceOption) -> bool:
        # Saves enough, fits the trial's own devices (what it frees there plus their free
        # memory) and enough idle devices hold it.
        seconds = o.seconds
        assert seconds is not None  # restart options are costed (`RunningTrial.options`)
        return (seconds <= (1.0 - policy.min_resize_gain) * r.remaining_seconds
                and all(free[d] + r.bytes_per_device >= o.bytes_per_device
                        for d in r.device_ids)
                and len(idle) - bisect.bisect_left(idle_capacity, o.bytes_per_device)
                >= o.devices - len(r.device_ids))

    options: dict[int, list[DeviceOption]] = {}
    offered: dict[int, tuple[DeviceOption, ...]] = {}  # every option, for rule 4

    # Every trial where it stands now, longest first: each pass of rule 3 walks this list (less
    # the waiting trials) merged with a heap of the moves it made, in the order one heap of both
    # would pop them.
    standing = sorted((-r.remaining_seconds, i, len(r.device_ids)) for i, r in enumerate(running))

    def greedy(waiting: set[int]) -> tuple[dict[int, list[DeviceOption]], int]:
        # Per trial in play: (-seconds, position in ``running``, devices) of where it stands in
        # the greedy, longest first; its worthwhile options, sorted, once its turn came.
        moved: list[tuple[float, int, int]] = []
        at = 0
        taken: dict[int, list[DeviceOption]] = {}
        surplus = len(idle)
        while surplus > 0:
            while at < len(standing) and running[standing[at][1]].key in waiting:
                at += 1
            if moved and (at == len(standing) or moved[0] < standing[at]):
                neg, i, devices = heapq.heappop(moved)
            elif at < len(standing):
                neg, i, devices = standing[at]
                at += 1
            else:
                break
            r = running[i]
            if r.key not in options:
                own = r.options if options_of is None else options_of(r)
                offered[r.key] = own
                options[r.key] = sorted((o for o in own if worth_it(r, o)),
                                        key=lambda o: o.devices)
            move = None
            for o in options[r.key]:
                if o.devices <= devices:
                    continue
                if o.devices - devices > surplus:
                    break
                assert o.seconds is not None  # costed: `worth_it` kept it
                if o.seconds < -neg:
                    move, seconds = o, o.seconds
                    break
            if move is None:
                continue  # it cannot move now, nor later with less surplus
            surplus -= move.devices - devices
            taken.setdefault(r.key, []).append(move)
            heapq.heappush(moved, (-seconds, i, move.devices))
        return taken, surplus

    def wait_is_sooner(r: RunningTrial, o: DeviceOption, freeing: list[float],
                       surplus: int, sharing: int) -> bool:
        # Is there an end ``w`` in ``freeing`` (sorted) before ``rest``, the ``count``-th, and a
        # larger option ``p`` that fits the devices free by then, restarting on which at ``w``
        # ends sooner? ``p`` fits from a fixed count on, and its end is linear in ``w``, so it
        # is soonest at the first or the last end it may use; only within rounding of a tie
        # are the ends between weighed one by one.
        rest = r.remaining_seconds
        if rest <= 0:
            return False
        last = bisect.bisect_left(freeing, rest)  # counts 1..last end before ``rest``
        if last == 0:
            return False
        own = len(r.device_ids)
        extra = o.devices - own + surplus
        restart = r.restart_seconds
        assert o.seconds is not None  # restart options are costed (`RunningTrial.options`)

        def end(seconds: float, w: float) -> float:
            return w + (seconds - restart) * (rest - w) / rest + restart

        for p in offered[r.key]:
            if p.devices <= o.devices:
                continue
            need = p.devices - own - extra  # fits once count // sharing >= need
            first = 1 if need <= 0 else need * sharing
            if first > last:
                continue
            assert p.seconds is not None  # as every restart option
            ends = (end(p.seconds, freeing[first - 1]), end(p.seconds, freeing[last - 1]))
            if min(ends) < o.seconds:
                return True
            slack = 1e-9 * (abs(o.seconds) + abs(p.seconds) + abs(restart) + rest
                            + abs(freeing[last - 1]))
            if min(ends) - o.seconds <= slack and any(
                    end(p.seconds, freeing[count - 1]) < o.seconds
                    for count in range(first + 1, last)):
                return True
        return False

    # Rule 4, then rule 3 again without the trials that wait, so the devices they leave go to
    # others (each pass adds a waiting trial, so this ends).
    # When each device comes free: the latest end among the measured trials on it (devices
    # holding anything else never count), soonest first.
    ends: dict[int, float] = {}
    held: dict[int, int] = {}
    for r in running:
        for d in r.device_ids:
            ends[d] = max(ends.get(d, 0.0), r.remaining_seconds)
            held[d] = held.get(d, 0) + r.bytes_per_device
    frees_at = sorted((t, d) for d, t in ends.items()
                      if not snapshot.is_empty(d) and held[d] == snapshot.capacity[d] - free[d])
    waiting: set[int] = set()
    while True:
        taken, surplus = greedy(waiting)
        # The devices of the trials staying where they are.
        moving = {d for key in taken for d in by_key[key].device_ids}
        freeing = [t for t, d in frees_at if d not in moving]
        wait = {key for key in taken
                if wait_is_sooner(by_key[key], taken[key][-1], freeing, surplus, len(taken))}
        if not wait:
            break
        waiting |= wait

    order = sorted(taken, key=lambda k: (-by_key[k].remaining_seconds, k))
    return place_steps(snapshot.capacity, idle, free, [(by_key[k], taken[k]) for k in order])


def place_steps(capacity: Sequence[int], idle: Sequence[int], free: Sequence[int],
                steps: Sequence[tuple[RunningTrial, Sequence[DeviceOption]]]
                ) -> tuple[Resize, ...]:
    """Devices for the steps `resizes` chose, in ``steps``' order: each trial restarts as the
    largest of its steps that its own devices (what it frees there plus their ``free`` bytes;
    trials sharing a device share its free memory) and the ``idle`` devices left still hold
    (capacities may differ, so an earlier trial's picks can leave too few large ones); a trial
    none of whose steps fits stays. ``idle`` in the order devices are taken."""
    idle, free = list(idle), list(free)
    out: list[Resize] = []
    for r, taken in steps:
        for o in reversed(taken):
            extra = [d for d in idle if capacity[d] >= o.bytes_per_device]
            extra = extra[: o.devices - len(r.device_ids)]
            if len(extra) == o.devices - len(r.device_ids) and all(
                    free[d] + r.bytes_per_device >= o.bytes_per_device for d in r.device_ids):
                break
        else:
            continue
        for d in r.device_ids:
            free[d] += r.bytes_per_device - o.bytes_per_device
        for d in extra:
            free[d] -= o.bytes_per_device
            idle.remove(d)
        out.append(Resize(r.key, (*r.device_ids, *extra), o))
    return tuple(out)


@dataclass(frozen=True)
class TailTrial:
    """A running trial as `tail_plan` sees it: it may restart once, on one of ``counts``
    devices, at any time its devices allow.

    Attributes:
      key: trial number.
      devices: devices it holds now.
      remaining: predicted seconds until it ends where it is.
      restart: a restart's own seconds (checkpoint, compile, restore).
      busy: its measured busy fraction (`scamp_jax.scheduling.costs.resized_seconds`).
      plan_devices: the data x model parallel degree of its plan (the ``devices`` of
        `resized_seconds`).
      counts: device counts it may restart on, each larger than ``devices``.
    """

    key: int
    devices: int
    remaining: float
    restart: float
    busy: float | None
    plan_devices: int
    counts: tuple[int, ...]

    def end(self, at: float, devices: int) -> float:
        """Predicted end (seconds from now) if restarted ``at`` seconds from now on
        ``devices`` devices (its own count: not restarted)."""
        if devices == self.devices:
            return self.remaining
        return at + self.restart + resized_seconds(self.remaining - at, self.busy,
                                                   self.plan_devices, devices)


@dataclass(frozen=True)
class TailPlan:
    """`tail_plan`'s answer: predicted end of the study (seconds from now), the device count
    each queued trial starts on now, per restarted trial (seconds from now, devices), and the
    predicted end (seconds from now) of each queued and restarted trial."""

    makespan: float
    degrees: dict[int, int]
    restarts: dict[int, tuple[float, int]]
    ends: dict[int, float]


def tail_plan(idle: int, queued: Sequence[tuple[int, tuple[tuple[int, float], ...]]],
              movers: Sequence[TailTrial], frees: Sequence[tuple[float, int]], *,
              min_gain: float = 0.0, max_combinations: int = 512,
              max_nodes: int = 20_000) -> TailPlan | None:
    """The study's end, planned as a whole once nothing more arrives (a pool of one device
    kind): each queued trial starts now on one of its (devices, seconds) choices, and each of
    ``movers`` restarts at most once, now or when the devices it needs have come free, so that
    the predicted last end is earliest.

    Rules 3-4 of `resizes` and the last-wave growth of `ScampPolicy` take one trial at a time,
    longest first, and so spend idle devices on a step that frees none of them soon. Here the
    choices are weighed together: giving a queued trial more devices can end it early enough
    that its devices, with ones kept idle meanwhile, restart a long running trial on many more.

    ``idle``: devices nothing runs on now; ``frees``: (seconds from now, devices) at which the
    other running trials are predicted to free devices. A restart may start now or at any
    such time, a queued trial's end, or a mover's end, if it then saves at least ``min_gain``
    of its remaining time (`ScampPolicy.min_resize_gain`, as in rule 2). Exhaustive over the
    queued trials' choices (trials of equal choices are interchangeable) and a
    branch-and-bound over the movers' (longest first; interchangeable movers in order), with
    a relaxation that releases an undecided mover's devices at its earliest possible end.

    Returns None when the queued choices exceed ``max_combinations`` or the search exceeds
    ``max_nodes`` (the caller then keeps the one-step rules).
    """
    groups: dict[tuple[tuple[int, float], ...], list[int]] = {}
    for key, choices in queued:
        groups.setdefault(tuple(choices), []).append(key)
    total = 1
    for choices, keys in groups.items():
        total *= math.comb(len(choices) + len(keys) - 1, len(keys))
        if total > max_combinations:
            return None
    search = _TailSearch(sorted(movers, key=lambda m: (-m.remaining, m.key)), list(frees),
                         min_gain, max_nodes)
    for picks in product(*(combinations_with_replacement(range(len(c)), len(keys))
                           for c, keys in groups.items())):
        degrees: dict[int, int] = {}
        ends: dict[int, float] = {}
        for (choices, keys), pick in zip(groups.items(), picks, strict=True):
            for key, i in zip(keys, pick, strict=True):
                degrees[key], ends[key] = choices[i]
        if not search.run(idle, degrees, ends):
            return None
    return search.plan


class _TailSearch:
    """`tail_plan`'s branch-and-bound over the movers' restarts, for one choice of the queued
    trials' device counts at a time; the best plan over all of them in ``plan``."""

    def __init__(self, movers: list[TailTrial], frees: list[tuple[float, int]],
                 min_gain: float, max_nodes: int) -> None:
        self.movers, self.frees, self.max_nodes = movers, frees, max_nodes
        self.keep = 1.0 - min_gain
        self.earliest = [min([m.remaining] + [m.end(0.0, n) for n in m.counts])
                         for m in movers]
        self.alike = [i > 0 and _alike(movers[i - 1], m) for i, m in enumerate(movers)]
        self.best = math.inf
        self.plan: TailPlan | None = None
        self.nodes = 0

    def run(self, idle: int, degrees: dict[int, int], ends: dict[int, float]) -> bool:
        """Search with the queued trials on ``degrees`` devices, ending at ``ends``; False when
        the node budget ran out."""
        self.left = idle - sum(degrees.values())
        last = max(ends.values(), default=0.0)
        if self.left < 0 or last >= self.best:
            return True
        self.degrees, self.ends = degrees, ends
        self.base = self.frees + [(ends[k], n) for k, n in degrees.items()]
        times = sorted({0.0, *(t for t, _ in self.base), *(m.remaining for m in self.movers)})
        self.options = []
        for m in self.movers:
            own = [(t, n, m.end(t, n)) for t in times if t < m.remaining for n in m.counts]
            self.options.append(sorted([(None, m.devices, m.remaining)]
                                       + [(t, n, e) for t, n, e in own
                                          if e <= t + self.keep * (m.remaining - t)],
                                       key=lambda o: o[2]))
        self.chosen: list[tuple[float | None, int, float]] = []
        return self._step(0, last, 0)

    def _feasible(self, i: int) -> bool:
        # Devices in use never exceed those free: the movers decided so far as chosen, the
        # others releasing theirs at their earliest possible end (a relaxation).
        events = list(self.base)
        for m, (t, n, e) in zip(self.movers, self.chosen, strict=False):
            if t is not None:
                events.append((t, m.devices - n))
            events.append((e, n))
        events += [(self.earliest[j], self.movers[j].devices)
                   for j in range(i, len(self.movers))]
        have = self.left
        for _, delta in sorted(events, key=lambda e: (e[0], -e[1])):
            have += delta
            if have < 0:
                return False
        return True

    def _step(self, i: int, worst: float, floor: int) -> bool:
        self.nodes += 1
        if self.nodes > self.max_nodes:
            return False
        if not self._feasible(i):
            return True
        if i == len(self.movers):
            if worst < self.best:
                moved = [(m, t, n, e) for m, (t, n, e) in zip(self.movers, self.chosen, strict=True)
                         if t is not None]
                self.best = worst
                self.plan = TailPlan(worst, dict(self.degrees),
                                     {m.key: (t, n) for m, t, n, _ in moved},
                                     {**self.ends, **{m.key: e for m, _, _, e in moved}})
            return True
        for j, o in enumerate(self.options[i]):
            if max(worst, o[2]) >= self.best:
                break  # sorted by end: the rest end later still
            if self.alike[i] and j < floor:
                continue  # interchangeable with the previous mover: one order only
            self.chosen.append(o)
            ok = self._step(i + 1, max(worst, o[2]), j)
            self.chosen.pop()
            if not ok:
                return False
        return True


def _alike(a: TailTrial, b: TailTrial) -> bool:
    return (a.devices, a.remaining, a.restart, a.busy, a.plan_devices, a.counts) == (
        b.devices, b.remaining, b.restart, b.busy, b.plan_devices, b.counts)


def running_tail(runs: Mapping[int, Any], occupants: Sequence[int], devices: int, now: float,
                 reshapes: Mapping[int, Sequence[int]] | None, *,
                 refused: Callable[[int, int], bool], busy: Callable[[int], float | None],
                 restart_seconds: float | None, room: int,
                 ) -> tuple[list[TailTrial], list[tuple[float, int]]]:
    """The running side of a `tail_plan`: the trials it may restart and when the others free
    their devices.

    ``runs``: the running trials (`scamp_jax.scheduling.pace.Run`) by key, on a pool of
    ``devices`` devices with ``occupants`` trials on each, at ``now`` seconds. The movers are
    the longest measured trials alone on their devices (`longest_movers`, at most ``room``),
    each on the counts ``reshapes`` gives (None: the data-parallel degrees that divide its
    global batch) less those ``refused(key, n)``; ``busy(key)`` is a trial's busy fraction.
    Every other trial frees its devices at its predicted end: from its measured pace, else the
    end predicted when it started, else never (`freed_devices`)."""
    measured = sorted(((run.remaining(now), key) for key, run in runs.items()
                       if run.seconds_per_step is not None), reverse=True)

    def mover(remaining: float, key: int) -> TailTrial | None:
        run = runs[key]
        if any(occupants[d] != 1 for d in run.device_ids):
            return None
        dp, mp = run.plan.data_parallel, run.plan.model_parallel
        counts = (reshapes.get(key, ()) if reshapes is not None else
                  [p * mp for p in range(dp + 1, devices // mp + 1)
                   if run.plan.batch_size % p == 0])
        counts = tuple(n for n in counts if n > len(run.device_ids) and not refused(key, n))
        return TailTrial(key, len(run.device_ids), remaining, run.restart(restart_seconds),
                         busy(key), dp * mp, counts) if counts else None

    movers = longest_movers(measured, mover, room)
    moving = {m.key for m in movers}
    ends = [(run.device_ids, run.remaining(now) if run.seconds_per_step is not None
             else max(0.0, run.predicted_end - now))
            for key, run in runs.items() if key not in moving]
    return movers, freed_devices(ends)


def longest_movers(measured: Sequence[tuple[float, int]],
                   mover: Callable[[float, int], TailTrial | None],
                   room: int) -> list[TailTrial]:
    """The running trials a `tail_plan` may restart: from ``measured`` ``(remaining seconds,
    key)``, longest first, those ``mover`` makes a `TailTrial` of (None: it cannot move),
    trials of equal remaining time taken together or not at all, at most ``room`` of them."""
    movers: list[TailTrial] = []
    i = 0
    while i < len(measured):
        j = i
        while j < len(measured) and measured[j][0] == measured[i][0]:
            j += 1
        group = [t for t in (mover(remaining, key) for remaining, key in measured[i:j])
                 if t is not None]
        if len(movers) + len(group) > room:
            break
        movers += group
        i = j
    return movers


def freed_devices(ends: Sequence[tuple[Sequence[int], float]]) -> list[tuple[float, int]]:
    """``[(seconds from now, devices freed then), ...]``, earliest first, from running trials'
    ``(device ids, predicted end)``: a device is free once the last trial on it ends; one
    that never ends (``inf``) frees nothing."""
    last: dict[int, float] = {}
    for ids, end in ends:
        for d in ids:
            last[d] = max(last.get(d, 0.0), end)
    frees: dict[float, int] = {}
    for end in last.values():
        if end < math.inf:
            frees[end] = frees.get(end, 0) + 1
    return sorted(frees.items())
