"""The scheduling core: every placement decision of a search, as a pure function of events.

`SchedulingCore` is fed events and answers with actions. It holds no threads, reads no clock
(every event carries its time, in seconds since the study's first start) and does no I/O, so
the HPO engine (`scamp_jax.hpo.engine`, wall-clock events from real runs), the cluster simulator
(`scamp_jax.sim.simulator`, virtual events) and the replay of a finished study
(``python -m benchmarks.simulate_cluster --replay``) run the very same decisions.

Events (methods), each at a time ``now``:

- `planned`: a trial's plan is ready (`TrialPlan`); it joins the queue.
- `set_arrivals_pending`: whether more trials may still be planned (False: the last wave).
- `step_measured`: a running trial's measured seconds per step (its pace).
- `option_planned`: the plan of a larger device count the core asked for (`PlanOption`).
- `finished`: a run ended (out of memory too: `scamp_jax.hpo.out_of_memory` decides what
  follows); its devices are free again.
- `restarted` / `move_back`: a running trial moved to more devices, or back (its restart
  failed before training); `requeue`: a trial planned again waits with its new plan;
  `unqueue`: a queued trial leaves the queue to be booked again (the allowance grew).

Actions (from `decide`): `Start` a trial on device ids, `PlanOption` (plan a queued trial on
more devices before it can start there); from `resizes`: `scamp_jax.scheduling.elastic.Resize`
decisions.

The pool books each device's **usable** bytes (`scamp_jax.planning.budget.Budget.usable_bytes`,
the budget less its safety margin): the same share every plan is fitted into, so packed trials
never book the safety margin.

Costs. A trial's predicted seconds are ``steps * flops_per_step / rate``: ``flops_per_step`` from
the compiled step's ``cost_analysis()`` (per device), ``rate`` the highest FLOP/s any trial was
measured to attain (`step_measured`); until the first measurement ``rate`` is 1 (costs are then
right relative to each other, which is all a policy's choices depend on). Without FLOPs a
trial's cost is None (unknown).
A running trial's busy fraction is the share of that best rate it attains,
``flops_per_step / rate / measured_seconds_per_step`` (``rate``: the device's attainable peak
where known, else the best measured): the rest of its step is communication,
launch gaps and host work that another trial on the same device can fill. Not measured yet, a
trial counts as fully busy (in the last wave, compute-aware sharing then keeps away from it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from scamp_jax.planning.budget import Budget
from scamp_jax.scheduling.costs import resized_seconds, shared_load
from scamp_jax.scheduling.elastic import (
    Resize,
    RunningTrial,
    TailPlan,
    place_steps,
    resizes,
    running_tail,
    tail_plan,
)
from scamp_jax.scheduling.growth import GrowthOptions
from scamp_jax.scheduling.pace import Paces, Run
from scamp_jax.scheduling.placement import (
    DeviceOption,
    Placement,
    Policy,
    PoolSnapshot,
    ScampPolicy,
    TrialRequest,
    check_feasible,
)
from scamp_jax.scheduling.pool import DevicePool
from scamp_jax.scheduling.request_queue import RequestQueue
from scamp_jax.scheduling.usage import UsageRecorder

#: Most queued plus running trials the core plans the study's end for as a whole; above it
#: the one-step rules decide (a large pool's tail stays fast).
MAX_TAIL_TRIALS = 64

#: Most queued trials that plan chooses device counts for.
MAX_TAIL_QUEUED = 16

#: Most running trials that plan may restart.
MAX_TAIL_MOVERS = 8


@dataclass(frozen=True)
class TrialPlan:
    """A planned trial as the core sees it (the `planned` event).

    Attributes:
      key: trial number.
      arrival: queue order (the ask order); smaller first.
      devices: devices of the plan (data x model parallel degree).
      bytes_per_device: the plan's predicted peak per device, bytes.
      steps: training steps of the plan.
      flops_per_step: FLOPs one device runs per step (``cost_analysis()``), None: unknown.
      data_parallel, model_parallel, batch_size: the plan's degrees and global batch.
      grow_bytes: bytes per device a larger device count's plan may need at most (the usable
        share); > 0 lets the last wave offer 2x, 4x, ... the devices as options (uncosted until
        planned); 0: no such options.
      trials: the study's trials it trains (a fused group's width; the usage counts them).
    """

    key: int
    arrival: int
    devices: int
    bytes_per_device: int
    steps: int
    flops_per_step: float | None = None
    data_parallel: int = 1
    model_parallel: int = 1
    batch_size: int = 1
    grow_bytes: int = 0
    trials: int = 1

    def as_dict(self) -> dict[str, float | int | None]:
        """JSON-able fields (for ``results.json`` and the replay)."""
        return {
            "arrival": self.arrival, "devices": self.devices,
            "bytes_per_device": self.bytes_per_device, "steps": self.steps,
            "flops_per_step": self.flops_per_step, "data_parallel": self.data_parallel,
            "model_parallel": self.model_parallel, "batch_size": self.batch_size,
            "grow_bytes": self.grow_bytes, "trials": self.trials,
        }

    @classmethod
    def from_dict(cls, key: int, d: Mapping[str, float | int | None]) -> TrialPlan:
        """Inverse of `as_dict`."""
        flops = d.get("flops_per_step")
        return cls(key, int(d["arrival"]), int(d["devices"]),  # type: ignore[arg-type]
                   int(d["bytes_per_device"]), int(d["steps"]),  # type: ignore[arg-type]
                   None if flops is None else float(flops),
                   int(d.get("data_parallel") or 1), int(d.get("model_parallel") or 1),
                   int(d.get("batch_size") or 1), int(d.get("grow_bytes") or 0),
                   int(d.get("trials") or 1))


@dataclass(frozen=True)
class Start:
    """Start trial ``key`` on ``device_ids`` with ``plan`` (the plan for that device count)."""

    key: int
    device_ids: tuple[int, ...]
    plan: TrialPlan


@dataclass(frozen=True)
class PlanOption:
    """Plan queued trial ``key`` on ``devices`` devices (same global batch rule); answer with
    `SchedulingCore.option_planned`. The trial stays queued meanwhile."""

    key: int
    devices: int


@dataclass
class SchedulingCore:
    """Queue, device pool and pace of a study's trials; decisions through ``policy``.

    Args:
      policy: `ScampPolicy` or `FixedPolicy` (`scamp_jax.scheduling.placement`).
      devices: devices in the pool.
      budget: the memory of each device (`scamp_jax.planning.budget.Budget`); the pool books
        its ``usable_bytes`` per device.
      restart_seconds: predicted cost of a restart on more devices, seconds; None: the start-up
        time of the trial's current run.
      peak_flops: FLOP/s one device can attain (data sheet times an attained fraction), or None
        (unknown: the best rate measured so far stands in, which makes the fastest trial look
        fully busy).
      max_running: most trials (or fused groups) running at once, the rest stay queued; None:
        as many as the pool holds. For devices that share compute, such as CPU devices that
        split one host's cores (`scamp_jax.hpo.engine.cpu_max_running`).
      overlap: how much trials sharing a device overlap, in [0, 1]: each booked busy fraction
        is the load `scamp_jax.scheduling.costs.shared_load` (0: strict turns, every measured
        trial books its devices' compute fully, so the last wave packs none beside it; 1: free
        overlap, the measured busy fraction). The cluster simulator's `ClusterModel.overlap`.
    """

    policy: Policy
    devices: int
    budget: Budget
    restart_seconds: float | None = None
    peak_flops: float | None = None
    max_running: int | None = None
    overlap: float = 1.0
    pool: DevicePool = field(init=False)
    usage: UsageRecorder = field(init=False)

    def __post_init__(self) -> None:
        if self.max_running is not None and (
                isinstance(self.max_running, bool) or not isinstance(self.max_running, int)
                or self.max_running < 1):
            raise ValueError(f"max_running={self.max_running!r} must be a positive int or None")
        shared_load(1.0, self.overlap)  # raises on an overlap outside [0, 1]
        self.capacity = self.budget.usable_bytes
        self.pool = DevicePool([self.capacity] * self.devices)
        # Utilisation is reported against the whole memory, as a device monitor shows it.
        self.usage = UsageRecorder([self.budget.memory_per_device] * self.devices, t0=0.0)
        self._queue: dict[int, TrialPlan] = {}
        self._waiting = RequestQueue()  # the queue's requests, indexed for the policy
        # The running trials, the best rate and the trials measured alike.
        self.paces = Paces(self.peak_flops)
        self._running = self.paces.runs
        self.growth = GrowthOptions(self.devices, self.seconds)  # plans on more devices
        # The last-wave request built per queued trial, with its plan: kept while its cost,
        # busy fraction and options stay the same, so a long queue is not rebuilt per decision.
        self._last_wave: dict[int, tuple[TrialPlan, TrialRequest]] = {}
        # Predicted end of a trial the tail plan starts or restarts, until it is measured.
        self._expected: dict[int, float] = {}
        self._arrivals_pending = True
        self.now = 0.0

    # ------------------------------------------------------------------------------- events
    def _at(self, now: float) -> None:
        if now < self.now:
            raise ValueError(f"event at {now} s is before the previous one at {self.now} s")
        self.now = float(now)

    def planned(self, now: float, plan: TrialPlan) -> None:
        """Trial ``plan.key`` is planned and waits for devices (raises if it can never fit)."""
        self._at(now)
        if plan.key in self._queue or plan.key in self._running:
            raise ValueError(f"trial {plan.key} is already queued or running")
        check_feasible(TrialRequest(plan.key, self.policy.request_devices(plan.devices),
                                    plan.bytes_per_device, plan.arrival), self.pool.capacity)
        self._queue[plan.key] = plan
        # Busy fractions matter only in the last wave, whose requests are built afresh.
        self._waiting.add(self._request(plan, alike={}))

    def set_arrivals_pending(self, pending: bool) -> None:
        """Whether more trials may still be planned (False: the study's last wave)."""
        self._arrivals_pending = bool(pending)

    def step_measured(self, now: float, key: int, step: int, seconds_per_step: float,
                      training_since: float | None = None) -> None:
        """Running trial ``key`` has done ``step`` of its steps at ``seconds_per_step`` (measured
        over this run's training so far); ``training_since``: when its first step began."""
        self._at(now)
        changed = self.paces.step_measured(now, key, step, seconds_per_step, training_since)
        if changed is not None:  # other busy fractions change only with the best rate
            self._rebook_busy(None if changed else (key,))

    def option_planned(self, key: int, devices: int, plan: TrialPlan | None) -> None:
        """The plan of queued trial ``key`` on ``devices`` devices (None: it does not fit, the
        option is withdrawn)."""
        self.growth.answered(key, devices, plan)

    def finished(self, now: float, key: int) -> None:
        """Trial ``key``'s run ended (any state but a restart); its devices are free."""
        self._at(now)
        if self._running.pop(key, None) is not None:
            self.paces.unfile(key)
        self._expected.pop(key, None)
        self.pool.release(key)
        self.usage.finish(now, key)

    def requeue(self, now: float, plan: TrialPlan) -> None:
        """A re-planned trial waits again (its arrival kept)."""
        self.growth.forget(plan.key)
        self.planned(now, plan)

    def unqueue(self, now: float, key: int) -> TrialPlan:
        """Queued trial ``key`` leaves the queue (to be booked again, e.g. with a larger learned
        allowance); its plan. Its plans on more devices go with it: they were booked the old
        way, and it is asked for them again once it is queued again (as `requeue` does)."""
        self._at(now)
        plan = self._queue.pop(key)
        self._waiting.remove(key)
        self._last_wave.pop(key, None)
        self.growth.forget(key)
        return plan

    def restarted(self, now: float, key: int, device_ids: Sequence[int], plan: TrialPlan) -> bool:
        """Book running trial ``key`` on ``device_ids`` with ``plan`` (a restart on more
        devices); False, with nothing changed, if the pool cannot hold it there now."""
        self._at(now)
        old = self.pool.request_of(key)
        old_placement = self.pool.release(key)
        placement = Placement(key, tuple(device_ids))
        try:
            self.pool.allocate(placement, self._request(plan))
        except ValueError:
            self.pool.allocate(old_placement, old)
            self.withdraw(key, plan.devices)
            return False
        self.usage.move(now, placement, plan.bytes_per_device)
        self._running[key] = Run(plan, placement.device_ids, now,
                                      predicted_end=self._expected.pop(key, math.inf))
        self.paces.unfile(key)
        return True

    def withdraw(self, key: int, devices: int) -> None:
        """Never offer trial ``key`` on ``devices`` devices again (its plan failed there)."""
        self.growth.refuse(key, devices)

    # ------------------------------------------------------------------------------ queries
    @property
    def queued(self) -> tuple[int, ...]:
        """Keys of the waiting trials."""
        return tuple(self._queue)

    @property
    def running(self) -> Mapping[int, tuple[int, ...]]:
        """Device ids of the running trials, by key."""
        return {k: r.device_ids for k, r in self._running.items()}

    def plan_of(self, key: int) -> TrialPlan:
        """The plan trial ``key`` runs or waits with."""
        if key in self._running:
            return self._running[key].plan
        return self._queue[key]

    def snapshot(self) -> PoolSnapshot:
        """The pool as the policy sees it."""
        return self.pool.snapshot()

    def seconds(self, plan: TrialPlan) -> float | None:
        """Predicted solo seconds of ``plan`` (None without FLOPs; `Paces.seconds`)."""
        return self.paces.seconds(plan)

    def busy_fraction(self, key: int) -> float | None:
        """Measured busy fraction of running trial ``key`` (None: not measured yet)."""
        return self.paces.busy_fraction(key)

    def _request(self, plan: TrialPlan, options: tuple[DeviceOption, ...] = (),
                 alike: Mapping[tuple[float | None, int], int] | None = None) -> TrialRequest:
        # Unknown (not measured yet): fully busy, so that compute-aware sharing in the last
        # wave joins only trials measured to leave compute spare.
        return TrialRequest(plan.key, plan.devices, plan.bytes_per_device, plan.arrival,
                            seconds=self.seconds(plan), options=options,
                            busy_fraction=self._load(self.paces.predicted_busy(plan, alike)))

    def _load(self, busy: float | None) -> float:
        """The busy fraction booked for a measured ``busy`` (None: unknown, fully busy)."""
        return 1.0 if busy is None else shared_load(busy, self.overlap)

    def _last_wave_request(self, plan: TrialPlan,
                           alike: Mapping[tuple[float | None, int], int]) -> TrialRequest:
        """`_request` of queued ``plan`` with its growth options; the one built last time
        when it would be equal."""
        grows = (plan.grow_bytes and not self._arrivals_pending
                 and isinstance(self.policy, ScampPolicy) and self.policy.elastic)
        options = self.growth.options(plan) if grows else ()
        busy = self.paces.predicted_busy(plan, alike)
        held = self._last_wave.get(plan.key)
        if held is not None and held[0] is plan:
            request = held[1]
            if (request.busy_fraction == self._load(busy)
                    and request.seconds == self.seconds(plan) and request.options == options):
                return request
        request = self._request(plan, options, alike)
        self._last_wave[plan.key] = (plan, request)
        return request

    def _rebook_busy(self, keys: Sequence[int] | None = None) -> None:
        """Refresh the busy fractions booked in the pool from the latest measurements, of
        ``keys`` (None: every running trial)."""
        for key in self._running if keys is None else keys:
            busy = self.busy_fraction(key)
            if busy is None:
                continue
            busy = self._load(busy)
            old = self.pool.request_of(key)
            if abs(old.busy_fraction - busy) > 1e-12:
                self.pool.rebook_busy(key, busy)

    # ------------------------------------------------------------------------------ actions
    def decide(self, now: float) -> tuple[Start | PlanOption, ...]:
        """Trials to start now (booked in the pool) and larger plans to ask for.

        A placement on a device count whose plan is not known yet books nothing: it becomes a
        `PlanOption` and the trial waits (the placement is decided again once the plan is in).
        """
        self._at(now)
        if not self._queue:
            return ()
        queue: RequestQueue | list[TrialRequest]
        if self._arrivals_pending:
            # No growth options yet, and memory alone decides: the indexed queue, whose
            # requests' busy fractions and costs are those of their arrival (costs all scale
            # with the one measured rate, so their order holds). A start books a fresh request.
            queue = self._waiting
        else:
            alike = self.paces.alike()
            queue = [self._last_wave_request(p, alike) for p in self._queue.values()]
            tail = self._tail_plan(queue, None)
            if tail is not None:  # each on its planned count, without further growth
                # The study's end planned as a whole: each trial starts on its planned count,
                # and the devices kept idle wait for the running trials' restarts.
                queue = [r if tail.degrees[r.key] == r.devices
                         else r.placed_as(tail.degrees[r.key]) for r in queue]
                self._expected.update((key, now + tail.ends[key]) for key in tail.degrees)
                queue = [replace(r, options=()) for r in queue]
        placements = self.policy.decide(self.pool.snapshot(), queue,
                                        arrivals_pending=self._arrivals_pending)
        by_key = ({} if isinstance(queue, RequestQueue) else {r.key: r for r in queue})
        actions: list[Start | PlanOption] = []
        for placement in placements:
            if self.max_running is not None and len(self._running) >= self.max_running:
                break  # the rest wait for a running trial to end
            plan = self._queue[placement.key]
            n = len(placement.device_ids)
            if n != plan.devices and isinstance(self.policy, ScampPolicy):
                grown = self.growth.plan(plan.key, n)
                if grown is None:
                    if self.growth.ask(plan.key, n):
                        actions.append(PlanOption(plan.key, n))
                    continue
                plan = grown
            request = by_key.get(placement.key) or self._request(plan)
            if plan is not self._queue[placement.key]:
                request = self._request(plan)
            self.pool.allocate(placement, request)
            booked = self.pool.request_of(placement.key).bytes_per_device
            self.usage.start(now, placement, booked, plan.trials)
            del self._queue[placement.key]
            self._last_wave.pop(placement.key, None)
            self._waiting.remove(placement.key)
            self._running[plan.key] = Run(plan, placement.device_ids, now,
                                               predicted_end=self._expected.pop(plan.key,
                                                                                math.inf))
            self.paces.started(plan.key)
            actions.append(Start(plan.key, placement.device_ids, plan))
        return tuple(actions)

    def resizes(self, now: float, reshapes: Mapping[int, Sequence[int]]) -> tuple[Resize, ...]:
        """Running trials to restart on more devices now (`scamp_jax.scheduling.elastic.resizes`).

        Only with nothing queued and no arrivals pending. ``reshapes`` gives, per running trial,
        the device counts it may restart on with its global batch (the caller knows which ones
        keep the batch divisible). A trial's remaining time is its measured seconds per step
        times its steps left; on ``p`` devices instead of ``d`` the busy part of it (its
        measured `busy_fraction`) is predicted to take ``d / p`` of that and the rest of each
        step (launch gaps, host work, collectives) as long as now
        (`scamp_jax.scheduling.costs.resized_seconds`), plus the restart (``restart_seconds``,
        else this run's start-up). Trials not measured yet are left where they are.

        With few trials left (`MAX_TAIL_TRIALS`) the restarts come from the study's end planned
        as a whole (`_tail_plan`, which `decide` also follows for the last wave's device
        counts): those it makes now, none while it keeps idle devices for a later restart.
        """
        self._at(now)
        if self._queue or self._arrivals_pending:
            return ()
        if not self.pool.idle_devices:
            return ()  # no surplus: nothing to resize into
        views = []
        for key, run in self._running.items():
            if run.seconds_per_step is None or key not in reshapes:
                continue
            views.append(RunningTrial(key, run.device_ids,
                                      self.pool.request_of(key).bytes_per_device,
                                      run.remaining(self.now),
                                      restart_seconds=run.restart(self.restart_seconds)))
        plan = self._tail_plan([], reshapes)
        if plan is not None:
            # The restarts the plan makes now; the others wait for the devices it counts on.
            snap = self.pool.snapshot()
            idle = sorted((d for d in range(self.devices)
                           if snap.is_empty(d) and not snap.exclusive[d]),
                          key=lambda d: (snap.capacity[d], d))
            steps = []
            for view in sorted(views, key=lambda v: (-v.remaining_seconds, v.key)):
                at, n = plan.restarts.get(view.key, (None, 0))
                if at is None or at > 0:
                    continue
                self._expected[view.key] = now + plan.ends[view.key]
                steps.append((view, [self._restart_option(view, n)]))
            return place_steps(snap.capacity, idle, snap.free, steps)

        def options_of(view: RunningTrial) -> tuple[DeviceOption, ...]:
            return tuple(self._restart_option(view, n) for n in reshapes[view.key]
                         if n > len(view.device_ids) and not self.growth.refused(view.key, n))

        # Options are built only for the trials the rule weighs (the longest running ones).
        return resizes(self.policy, self.pool.snapshot(), views, queue_empty=True,
                       arrivals_pending=False, options_of=options_of)

    def _restart_option(self, view: RunningTrial, devices: int) -> DeviceOption:
        """Running trial ``view`` restarted on ``devices`` devices: its plan's bytes, and its
        remaining seconds resized (`scamp_jax.scheduling.costs.resized_seconds`) plus the
        restart."""
        plan = self._running[view.key].plan
        seconds = resized_seconds(view.remaining_seconds, self.busy_fraction(view.key),
                                  plan.data_parallel * plan.model_parallel, devices)
        return DeviceOption(devices, plan.bytes_per_device, seconds + view.restart_seconds)

    def _tail_plan(self, queue: Sequence[TrialRequest],
                   reshapes: Mapping[int, Sequence[int]] | None) -> TailPlan | None:
        """The study's end planned as a whole (`scamp_jax.scheduling.elastic.tail_plan`), or
        None where the one-step rules decide: arrivals pending, a policy that does not resize,
        a pool of mixed capacities, more trials than `MAX_TAIL_TRIALS` or `MAX_TAIL_QUEUED`
        allow, or more choices than `scamp_jax.scheduling.elastic.tail_plan` weighs.

        ``queue``: the last wave's requests (with growth options); the running trials it may
        restart, on the counts ``reshapes`` gives, and when the others free their devices:
        `scamp_jax.scheduling.elastic.running_tail` (at most `MAX_TAIL_MOVERS` restarts)."""
        policy = self.policy
        if (not isinstance(policy, ScampPolicy) or not policy.elastic
                or not policy.resize_running or self._arrivals_pending
                or len(queue) > MAX_TAIL_QUEUED
                or len(queue) + len(self._running) > MAX_TAIL_TRIALS
                or len(set(self.pool.capacity)) != 1):
            return None
        snap = self.pool.snapshot()
        idle = sum(1 for d in range(self.devices) if snap.is_empty(d) and not snap.exclusive[d])
        capacities = list(snap.capacity)
        queued = []
        alike = self.paces.alike() if queue else {}
        for r in queue:
            c = ScampPolicy._choices(r, capacities, self.devices)
            if c is None or r.exclusive:
                return None
            # The costs are compute at the best rate; a trial measured alike spends only its
            # busy fraction of a step computing, and on more devices only that part shrinks.
            busy = self.paces.predicted_busy(self._queue[r.key], alike)
            fits = []
            for o in c:
                if o.devices <= idle:
                    assert o.seconds is not None  # `ScampPolicy._choices` costs every option
                    fits.append((o.devices, o.seconds / (busy or 1.0)))
            queued.append((r.key, tuple(fits)))
        if sum(c[0][0] if c else idle + 1 for _, c in queued) > idle:
            return None  # not all can start now: the wave is not the last one to place
        movers, frees = running_tail(
            self._running, snap.occupants, self.devices, self.now, reshapes,
            refused=self.growth.refused, busy=self.busy_fraction,
            restart_seconds=self.restart_seconds, room=MAX_TAIL_MOVERS)
        if not movers and not queued:
            return None
        return tail_plan(idle, queued, movers, frees, min_gain=policy.min_resize_gain)

    def still_worth(self, key: int, devices: int) -> bool:
        """Whether restarting running trial ``key`` on ``devices`` devices still saves enough of
        its remaining time, with its latest measured pace (its plan compiled meanwhile)."""
        if not isinstance(self.policy, ScampPolicy):
            return False
        run = self._running.get(key)
        if run is None or run.seconds_per_step is None:
            return False
        views = self.resizes(self.now, {key: (devices,)})
        return any(r.key == key for r in views)

    def restart_fits(self, key: int, device_ids: Sequence[int]) -> bool:
        """Whether ``device_ids`` are still trial ``key``'s devices followed by idle ones."""
        current = self._running[key].device_ids
        snap = self.pool.snapshot()
        return (tuple(device_ids[: len(current)]) == tuple(current)
                and all(snap.is_empty(d) for d in device_ids[len(current):]))

    def move_back(self, now: float, key: int, device_ids: Sequence[int], plan: TrialPlan) -> None:
        """A restarted run failed before training: trial ``key`` goes back to ``device_ids``
        with its earlier ``plan``; the failed device count is not offered again."""
        self._at(now)
        failed = self._running[key].plan.devices
        self.withdraw(key, failed)
        self.pool.release(key)
        placement = Placement(key, tuple(device_ids))
        self.pool.allocate(placement, self._request(plan))
        self.usage.move(now, placement, plan.bytes_per_device)
        self._running[key] = Run(plan, placement.device_ids, now)
        self.paces.unfile(key)

