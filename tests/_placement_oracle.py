"""A brute-force statement of the placement rule, for tests to compare the indexed policies to.

No index, no bisection, no early exits: every choice looks at every device and sorts the
eligible ones by the rule's key. It follows `ScampPolicy`'s and `FixedPolicy`'s docstrings
(steps 0-3) and spells out the details they leave to the code, marked *detail* below.
"""

from __future__ import annotations

from dataclasses import replace

from scamp_jax.scheduling.placement import (
    FixedPolicy,
    Placement,
    PoolSnapshot,
    ScampPolicy,
    TrialRequest,
    check_feasible,
)


class _Pool:
    """Per device: free budget, occupants, summed busy fraction, whether nothing runs on it
    (``empty``), whether it may still be taken as an empty device (``spare``: neither taken nor
    reserved this call) and whether no trial may join it (``closed``)."""

    def __init__(self, snap: PoolSnapshot, share: bool) -> None:
        n = len(snap.capacity)
        self.cap, self.share = snap.capacity, share
        self.budget = list(snap.free)
        self.empty = [snap.is_empty(d) for d in range(n)]
        self.occ = list(snap.occupants) or [0 if e else 1 for e in self.empty]
        self.busy = list(snap.busy) or [0.0] * n
        held = snap.exclusive
        self.spare = [e and not x for e, x in zip(self.empty, held, strict=True)]
        self.closed = [x or not (share or e) for e, x in zip(self.empty, held, strict=True)]

    def pick(self, k: int, nbytes: int, needs_empty: bool, busy: float | None, spread: bool):
        if needs_empty:  # best fit among the spare devices
            fit = sorted((self.budget[d], d) for d in range(len(self.cap))
                         if self.spare[d] and self.budget[d] >= nbytes)
        else:  # least occupied first (with spread), then best fit
            fit = sorted((self.occ[d] if spread else 0, self.budget[d], d)
                         for d in range(len(self.cap))
                         if not self.closed[d] and self.budget[d] >= nbytes and (
                             busy is None or self.empty[d] or self.busy[d] + busy <= 1 + 1e-9
                             # *detail*: with spread, a device nothing runs on is not checked
                             # for compute, even when reserved for the head
                             or spread and self.occ[d] == 0))
        return tuple(f[-1] for f in fit[:k]) if len(fit) >= k else None

    def take(self, ids, nbytes: int, exclusive: bool, busy: float) -> None:
        for d in ids:
            self.budget[d] -= nbytes
            self.busy[d] += busy
            self.occ[d] += 1
            self.empty[d] = self.spare[d] = False
            self.closed[d] = self.closed[d] or exclusive or not self.share

    def reserve(self, head: TrialRequest, needs_empty: bool, fence: bool) -> None:
        """Step 3: the head's devices with the least memory to drain, ties to fewer occupants
        and lower ids; later trials keep the head's bytes and busy fraction free there."""
        def shortfall(d: int) -> int:
            if needs_empty:
                return 0 if self.empty[d] else self.cap[d] - self.budget[d]
            if self.closed[d]:
                return self.cap[d] - self.budget[d]
            return max(0, head.bytes_per_device - self.budget[d])
        held = sorted((shortfall(d), self.occ[d], d) for d in range(len(self.cap))
                      if self.cap[d] >= head.bytes_per_device)[: head.devices]
        for _, _, d in held if fence else ():
            if self.closed[d]:
                continue
            self.busy[d] += head.busy_fraction
            self.spare[d] = False  # *detail*: exclusive trials keep off reserved devices
            if needs_empty or not self.share:
                self.closed[d] = True
            else:
                self.budget[d] -= head.bytes_per_device
                self.empty[d] = False
                self.closed[d] = self.budget[d] < 0


def _choices(r: TrialRequest, cap) -> tuple:
    """Step 1's candidates: the plan and its options some devices hold, fewest devices first,
    an uncosted one (or any of a trial of unknown cost, which counts 1) costed linearly."""
    own = r.seconds if r.seconds is not None else 1.0
    return tuple(o if o.seconds is not None and r.seconds is not None
                 else replace(o, seconds=own * r.devices / o.devices)
                 for o in r.choices() if sum(c >= o.bytes_per_device for c in cap) >= o.devices)


def scamp_decide(policy: ScampPolicy, snap: PoolSnapshot, queue, pending: bool):
    pool = _Pool(snap, policy.share_devices)
    by_arrival = sorted(queue, key=lambda r: (r.arrival, r.key))
    ordered = list(by_arrival)
    if policy.longest_first and ordered:  # step 0
        horizon = ordered[0].arrival + (policy.overtake_window or len(snap.capacity))
        near = [r for r in ordered if r.arrival < horizon]
        ordered = sorted(near, key=lambda r: -(r.seconds or 0.0)) + ordered[len(near):]
    steps: dict[int, list] = {}  # step 1: the degree asked for, then growth
    for pos, r in enumerate(ordered):
        c = _choices(r, snap.capacity) if r.options and not r.exclusive else ()
        if not c or c[0].devices != r.devices:
            continue
        # The fastest costed option within the growth tolerance of the plan's device-seconds.
        costed = {o.devices for o in r.options if o.seconds is not None and r.seconds is not None}
        budget = (1 + policy.growth_tolerance) * c[0].devices * (c[0].seconds or 0.0)
        pick = 0
        for i, o in enumerate(c):
            if (o.devices in costed and o.seconds < c[pick].seconds
                    and o.devices * o.seconds <= budget):
                pick = i
        if pick:
            o = c[pick]
            ordered[pos] = replace(r, devices=o.devices, bytes_per_device=o.bytes_per_device,
                                   seconds=o.seconds, busy_fraction=o.busy_fraction,
                                   options=tuple(x for x in r.options if x.devices > o.devices))
        steps[r.key] = [c, pick, pick]  # choices, the degree asked for, the degree grown to
    grow: dict[int, tuple] = {}
    if policy.elastic and not pending:
        surplus = sum(pool.spare) - sum(r.devices for r in ordered)
        while surplus > 0:  # one step up for the trial that would run longest, first in order
            moves = [(-c[i].seconds, n, key, j) for n, (key, (c, _, i)) in enumerate(steps.items())
                     for j in range(i + 1, len(c)) if c[j].devices - c[i].devices <= surplus
                     and c[j].seconds < c[i].seconds
                     and all(c[m].seconds >= c[i].seconds for m in range(i + 1, j))]
            if not moves:
                break
            _, _, key, j = min(moves)
            surplus -= steps[key][0][j].devices - steps[key][0][steps[key][2]].devices
            steps[key][2] = j
        grow = {key: c[base + 1: i + 1][::-1] for key, (c, base, i) in steps.items() if i > base}
    aware = policy.compute_aware and not pending
    placements, started, head_seen = [], set(), False
    for r in ordered:  # steps 2 and 3
        ids = None
        for o in grow.get(r.key, ()):  # grown: empty devices only
            ids = pool.pick(o.devices, o.bytes_per_device, True, None, policy.spread)
            if ids is not None:
                pool.take(ids, o.bytes_per_device, False, o.busy_fraction)
                break
        if ids is None:
            needs_empty = r.exclusive or not policy.share_devices
            ids = pool.pick(r.devices, r.bytes_per_device, needs_empty,
                            r.busy_fraction if aware else None, policy.spread)
            if ids is None:
                head = next(h for h in by_arrival if h.key not in started)
                if not head_seen and head.key == r.key:  # one reservation per call
                    head_seen = True
                    check_feasible(r, snap.capacity)
                    pool.reserve(r, needs_empty, policy.reserve_for_head)
                continue
            pool.take(ids, r.bytes_per_device, needs_empty, r.busy_fraction)
        started.add(r.key)
        placements.append(Placement(r.key, ids))
    return tuple(placements)


def fixed_decide(policy: FixedPolicy, snap: PoolSnapshot, queue):
    pool = _Pool(snap, share=False)
    placements = []
    for r in sorted(queue, key=lambda r: (r.arrival, r.key)):  # strict FIFO, empty devices
        ids = pool.pick(policy.devices_per_trial, r.bytes_per_device, True, None, False)
        if ids is None:
            check_feasible(replace(r, devices=policy.devices_per_trial, options=()),
                           snap.capacity)
            break
        pool.take(ids, r.bytes_per_device, True, 0.0)
        placements.append(Placement(r.key, tuple(sorted(ids))))
    return tuple(placements)
