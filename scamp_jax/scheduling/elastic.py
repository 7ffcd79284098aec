"""Tail elasticity: restart running trials on more devices when the pool would otherwise idle.

At the end of a study the queue is empty and devices go idle one by one while the last, often
longest, trials still run on the few devices they started with. `resizes` decides which of them
to stop at a step boundary (after a checkpoint) and restart, with the **same global batch**, on
their devices plus some idle ones: more data-parallel replicas, each on a smaller share of the
batch. Keeping the batch keeps the trial's training trajectory (same samples, same updates, up to
float reassociation of the batch mean), so a resized trial reports what it would have reported
unresized, only sooner.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
        return (o.seconds <= (1.0 - policy.min_resize_gain) * r.remaining_seconds
                and all(free[d] + r.bytes_per_device >= o.bytes_per_device
                        for d in r.device_ids)
                and len(idle) - bisect.bisect_left(idle_capacity, o.bytes_per_device)
                >= o.devices - len(r.device_ids))

    options: dict[int, list[DeviceOption]] = {}
    offered: dict[int, tuple[DeviceOption, ...]] = {}  # every option, for rule 4

    def greedy(waiting: set[int]) -> tuple[dict[int, list[DeviceOption]], int]:
        # Per trial in play: (-seconds, position in ``running``, devices) of where it stands in
        # the greedy, longest first; its worthwhile options, sorted, once its turn came.
        turn = [(-r.remaining_seconds, i, len(r.device_ids)) for i, r in enumerate(running)
                if r.key not in waiting]
        heapq.heapify(turn)
        taken: dict[int, list[DeviceOption]] = {}
        surplus = len(idle)
        while surplus > 0 and turn:
            neg, i, devices = heapq.heappop(turn)
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
                if o.seconds < -neg:
                    move = o
                    break
            if move is None:
                continue  # it cannot move now, nor later with less surplus
            surplus -= move.devices - devices
            taken.setdefault(r.key, []).append(move)
            heapq.heappush(turn, (-move.seconds, i, move.devices))
        return taken, surplus

    def wait_is_sooner(r: RunningTrial, o: DeviceOption, freeing: list[float],
                       surplus: int, sharing: int) -> bool:
        rest = r.remaining_seconds
        if rest <= 0:
            return False
        extra = o.devices - len(r.device_ids) + surplus
        for count, w in enumerate(freeing, start=1):
            if w >= rest:
                break
            later = [p for p in offered[r.key]
                     if o.devices < p.devices <= len(r.device_ids) + extra + count // sharing]
            if any(w + (p.seconds - r.restart_seconds) * (rest - w) / rest + r.restart_seconds
                   < o.seconds for p in later):
                return True
        return False

    # Rule 4, then rule 3 again without the trials that wait, so the devices they leave go to
    # others (each pass adds a waiting trial, so this ends).
    waiting: set[int] = set()
    while True:
        taken, surplus = greedy(waiting)
        # When the devices of trials staying where they are come free: the latest end among
        # the measured trials on each (devices holding anything else never count).
        moving = {d for key in taken for d in by_key[key].device_ids}
        ends: dict[int, float] = {}
        held: dict[int, int] = {}
        for r in running:
            for d in r.device_ids:
                ends[d] = max(ends.get(d, 0.0), r.remaining_seconds)
                held[d] = held.get(d, 0) + r.bytes_per_device
        freeing = sorted(t for d, t in ends.items()
                         if d not in moving and not snapshot.is_empty(d)
                         and held[d] == snapshot.capacity[d] - snapshot.free[d])
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
