"""Discrete-event simulation of a search on a model cluster, driving the engine's decisions.

The simulator replays a list of planned trials (`TrialProfile`: devices, predicted peak bytes per
device, per-step cost) on a `ClusterModel`. Which trial starts where, which grows onto idle
devices and which restarts on more of them is decided by the very
`scamp_jax.scheduling.SchedulingCore` the HPO engine drives, fed the same kinds of events (a
trial planned, its measured pace, a run ended, the last wave begun); usage figures come from the
core's `UsageRecorder`. Only time is virtual: one policy, two drivers.

Cost model of one training step on one device (all quantities per device):

    busy    = max(flops / (peak_flops * compute_efficiency),
                  bytes_accessed / (mem_bandwidth * bandwidth_efficiency))     # roofline
    comm    = comm_bytes / (interconnect_bandwidth * comm_efficiency)          # collectives
    launch  = kernels * launch_seconds                                         # dispatch latency
    step    = busy + comm + launch

Efficiency factors are the fraction of the data-sheet peak a real XLA step attains (see
`ClusterModel`). A trial keeps a device busy a fraction ``u = busy / step`` of its step.

Device sharing (`ClusterModel.overlap`, printed with every result). On one GPU, the programs of
several threads go to the same device queue and mostly take turns: packing fills memory, not
compute. ``overlap`` says how much of a co-located trial's idle part (communication, launch
gaps) others can fill: each trial puts a load ``overlap * u + (1 - overlap)`` on its devices,
and while the loads on a device sum to ``U > 1`` each of its trials runs ``U`` times slower
(processor sharing). ``overlap = 0`` (the default): strict turns, ``n`` trials on one device each
run ``n`` times slower whatever their busy fractions; ``overlap = 1``: free overlap, trials slow
each other only once their busy fractions sum past 1. A multi-device trial is synchronous, so
it advances at the pace of its most loaded device. Where several devices share one compute
engine (CPU devices of one host: ``compute_group``), the sum runs over all trials on the
group's devices.

Time the engine spends outside training. Planning: the engine asks as many trials ahead as the
lookahead allows, and its ``ClusterModel.planner_threads`` planner threads plan them, each plan
taking ``ClusterModel.planning_seconds`` (the planner's compiles); a trial waits for a free
thread in the order asked and is ready to place once its plan is done. The engine plans each
architecture once (`scamp_jax.hpo.plan_service.PlanningService`): a trial whose
`TrialProfile.architecture` was planned before is ready as soon as a thread takes it, and one
whose architecture is being planned holds its thread until that plan is done. A plan on more devices
the core asks for in the last wave (`scamp_jax.scheduling.core.PlanOption`) is a plan like any
other, made ahead of new trials' plans (the engine's `scamp_jax.hpo.work.PlannerPool`), and
its trial waits meanwhile; with ``planning_seconds`` 0 every plan is made at once. A restart of a
running trial on more devices the core decides is planned the same way first (the engine's
`scamp_jax.hpo.resizing.TailResizer`: no other is decided meanwhile), then booked if it is still
worth it and its devices are still free, and the trial trains nothing for
``ClusterModel.restart_seconds`` (checkpoint, compile, restore). These come from a real study's
``results.json`` where one is given (`scamp_jax.sim.measured.engine_figures`), else from the
documented defaults.

The core sees what the engine sees: each trial's FLOPs per step (``cost_analysis()``), bytes and
steps, the paces measured so far (busy fractions against the device's attainable FLOP/s; a
run's pace is measured the moment it has trained 2 steps, as the engine's half-second poll
does, and again at later events where its rate changed) and
whether more trials will arrive (``lookahead`` bounds the queue, as the engine's asked-but-unplaced
trials); a profile's `TrialProfile.alternatives` answer the core's requests for plans on more
devices in the last wave (each answered once a planner thread has made it). A trial started on
an alternative's device count runs as that alternative.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace

from scamp_jax._units import format_bytes
from scamp_jax.planning.budget import Budget
from scamp_jax.scheduling.booking import solo_bytes
from scamp_jax.scheduling.core import PlanOption, SchedulingCore, Start, TrialPlan
from scamp_jax.scheduling.costs import COMPUTE_EFFICIENCY, shared_load
from scamp_jax.scheduling.elastic import Resize
from scamp_jax.scheduling.placement import (
    FixedPolicy,
    Policy,
    ScampPolicy,
    TrialRequest,
    check_feasible,
)

GB = 10**9
GIB = 2**30
TFLOPS = 10**12


def _check_count(where: str, name: str, value: object, *, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{where}.{name}={value!r} must be an integer >= {minimum}; pass "
                         f"e.g. {name}={max(minimum, 1)}")


def _check_amount(where: str, name: str, value: object, *, positive: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number, >= 0 (> 0: ``positive``)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0 or (positive and value == 0)):
        raise ValueError(f"{where}.{name}={value!r} must be a finite number "
                         f"{'> 0' if positive else '>= 0'}")


@dataclass(frozen=True)
class ClusterModel:
    """A homogeneous cluster as the simulator sees it.

    Attributes:
      name: label, e.g. ``"v100-16gb"``.
      devices: number of accelerators.
      memory_per_device: bytes of device memory the planner may use per accelerator.
      peak_flops: data-sheet float32 matmul FLOP/s per device (TF32 tensor cores where XLA uses
        them for float32 by default, i.e. A100 and H100).
      mem_bandwidth: device memory bandwidth, bytes/s.
      interconnect_bandwidth: per-device collective bandwidth in one direction, bytes/s.
      compute_efficiency: attained fraction of ``peak_flops`` (0.5: typical for mid-sized
        transformer layers under XLA; small matmuls attain less, which the kernel launch term
        and the memory roofline partly capture).
      bandwidth_efficiency: attained fraction of ``mem_bandwidth`` (0.7, a STREAM-like figure).
      comm_efficiency: attained fraction of ``interconnect_bandwidth`` by ring all-reduce (0.7).
      launch_seconds: dispatch latency per kernel, seconds (about 5 us on current GPUs).
      compute_group: consecutive device ids that share one compute engine (1 for GPUs; all of
        them for CPU "devices" carved out of one host, whose ``peak_flops`` is then the host's).
      restart_seconds: seconds a running trial restarted on more devices
        (`scamp_jax.scheduling.elastic`) spends before its next step: writing its checkpoint,
        compiling the new plan, restoring. 60 is an assumption (a mid-sized model's compile on a
        GPU plus checkpoint I/O), not a measurement; a study's measured figure replaces it
        (`scamp_jax.sim.measured.engine_figures`).
      node_devices: devices per node: a trial on more of them communicates across nodes.
      network_bandwidth: bandwidth of one link between nodes in one direction, bytes/s (a ring
        all-reduce that spans nodes runs at its slowest link: ``min(interconnect_bandwidth,
        network_bandwidth)``). The presets' figures are the InfiniBand generation sold with
        each part (EDR 100 Gb/s for V100, HDR 200 Gb/s for A100, NDR 400 Gb/s for H100), one
        link per node: an assumption about the cluster, not a measurement.
      planning_seconds: seconds one plan takes on a planner thread (the planner's probe,
        verify and evaluation compiles). 30 is an assumption (three compiles of a mid-sized
        step), not a measurement; a study's measured figure replaces it.
      planner_threads: plans made at once (the engine's ``EngineConfig.planner_threads``, 2 by
        default); the others wait for a thread (module docstring).
      overlap: how much co-located trials overlap on one device, in [0, 1] (module docstring):
        0 = strict turns (the default, what JAX threads on one GPU mostly do until a GPU
        measurement calibrates it), 1 = free overlap of each other's idle time.
      allowance_bytes: bytes per device every trial books beyond its compiled figures (the
        allowance a study learns on this kind of device, `scamp_jax.hpo.calibration`); plans fit
        the usable bytes less it, as the engine's do.
    """

    name: str
    devices: int
    memory_per_device: int
    peak_flops: float
    mem_bandwidth: float
    interconnect_bandwidth: float
    compute_efficiency: float = COMPUTE_EFFICIENCY
    bandwidth_efficiency: float = 0.7
    comm_efficiency: float = 0.7
    launch_seconds: float = 5e-6
    compute_group: int = 1
    restart_seconds: float = 60.0
    planning_seconds: float = 30.0
    overlap: float = 0.0
    node_devices: int = 8
    network_bandwidth: float = 12.5 * 10**9
    allowance_bytes: int = 0
    planner_threads: int = 2

    def __post_init__(self) -> None:
        where = "ClusterModel"
        for name in ("devices", "memory_per_device", "compute_group", "node_devices"):
            _check_count(where, name, getattr(self, name), minimum=1)
        _check_count(where, "allowance_bytes", self.allowance_bytes, minimum=0)
        for name in ("peak_flops", "mem_bandwidth", "interconnect_bandwidth",
                     "network_bandwidth"):
            _check_amount(where, name, getattr(self, name), positive=True)
        for name in ("launch_seconds", "restart_seconds", "planning_seconds"):
            _check_amount(where, name, getattr(self, name))
        for name in ("compute_efficiency", "bandwidth_efficiency", "comm_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"ClusterModel.{name}={getattr(self, name)} must be in (0, 1]")
        if not 0 <= self.overlap <= 1:
            raise ValueError(
                f"overlap={self.overlap} must be in [0, 1] (0: co-located trials take strict "
                "turns on a device, 1: they overlap freely)")
        if (isinstance(self.planner_threads, bool) or not isinstance(self.planner_threads, int)
                or self.planner_threads < 1):
            raise ValueError(f"planner_threads={self.planner_threads!r} must be an integer >= 1 "
                             "(plans made at once; the engine's default is 2)")

    def link_bandwidth(self, devices: int) -> float:
        """Bytes/s of the slowest ring link of a trial on ``devices`` devices (one direction):
        the interconnect within a node, the network once the trial spans nodes."""
        if devices <= self.node_devices:
            return self.interconnect_bandwidth
        return min(self.interconnect_bandwidth, self.network_bandwidth)

    def load(self, busy: float, solo: float) -> float:
        """Load one trial puts on each of its devices: ``overlap * busy / solo + (1 -
        overlap)`` (`scamp_jax.scheduling.costs.shared_load`, the rule the scheduling core
        books by); 0 for a trial of no time."""
        if solo <= 0:
            return 0.0
        return shared_load(busy / solo, self.overlap)

    def describe(self) -> str:
        """The sharing model and the engine's overheads, for printing with every result."""
        return (f"overlap={self.overlap:g} (0: strict turns, 1: free overlap), "
                f"planning {self.planning_seconds:g} s per plan on "
                f"{self.planner_threads} thread(s), restart "
                f"{self.restart_seconds:g} s")

    def budget(self, safety_margin: float) -> Budget:
        """Each device's memory as the engine books it, with ``safety_margin`` held back."""
        return Budget(self.memory_per_device, safety_margin, self.allowance_bytes)

    def with_devices(self, devices: int) -> ClusterModel:
        """The same cluster with ``devices`` accelerators."""
        return replace(self, devices=devices)

    @property
    def capacity(self) -> tuple[int, ...]:
        """Bytes per device id, as a `DevicePool` takes it."""
        return (self.memory_per_device,) * self.devices


#: Data-sheet figures (SXM parts): V100 15.7 TFLOP/s FP32, 900 GB/s HBM2, NVLink2 300 GB/s total;
#: A100 156 TFLOP/s TF32, 1,555 GB/s (40 GB) / 2,039 GB/s (80 GB), NVLink3 600 GB/s total;
#: H100 495 TFLOP/s TF32 dense, 3,350 GB/s HBM3, NVLink4 900 GB/s total; H200 the H100's compute
#: and NVLink, 4,800 GB/s HBM3e. Interconnect is half
#: the total (one direction). Memory is the nominal size.
CLUSTER_PRESETS: dict[str, ClusterModel] = {
    "v100-16gb": ClusterModel("v100-16gb", 32, 16 * GIB, 15.7 * TFLOPS, 900 * GB, 150 * GB,
                              network_bandwidth=12.5 * GB),
    "v100-32gb": ClusterModel("v100-32gb", 32, 32 * GIB, 15.7 * TFLOPS, 900 * GB, 150 * GB,
                              network_bandwidth=12.5 * GB),
    "a100-40gb": ClusterModel("a100-40gb", 32, 40 * GIB, 156 * TFLOPS, 1555 * GB, 300 * GB,
                              network_bandwidth=25 * GB),
    "a100-80gb": ClusterModel("a100-80gb", 32, 80 * GIB, 156 * TFLOPS, 2039 * GB, 300 * GB,
                              network_bandwidth=25 * GB),
    "h100-80gb": ClusterModel("h100-80gb", 32, 80 * GIB, 495 * TFLOPS, 3350 * GB, 450 * GB,
                              network_bandwidth=50 * GB),
    "h200-141gb": ClusterModel("h200-141gb", 32, 141 * GIB, 495 * TFLOPS, 4800 * GB, 450 * GB,
                               network_bandwidth=50 * GB),
}

#: The planner's GPU targets by name (`scamp_jax.planning.targets.TARGETS`: ``--target h100``)
#: as presets here, so that a cluster is simulated by the name it is planned for.
PRESET_OF_TARGET: dict[str, str] = {"v100": "v100-32gb", "a100-40gb": "a100-40gb",
                                    "a100-80gb": "a100-80gb", "h100": "h100-80gb",
                                    "h200": "h200-141gb"}


#: Attained bytes/s, one direction, of the link between MPI ranks on one CPU host (Open MPI over
#: shared memory; mpi4jax all-reduce of float32 buffers of 16 MiB and more, 2 and 4 ranks),
#: fitted by ``python -m benchmarks.mpi_comm --sizes ...`` on this project's 2-core host at a
#: load average of about 14 (benchmarks/notes/mpi.md): the figure the ring model (`comm_seconds`) is
#: checked with on CPU, not a GPU interconnect's.
CPU_MPI_LINK_BANDWIDTH: float = 0.098 * GB


def cluster_preset(name: str, devices: int | None = None) -> ClusterModel:
    """A preset from `CLUSTER_PRESETS` (or by a planner target's name, `PRESET_OF_TARGET`),
    optionally with another device count (an integer >= 1)."""
    name = PRESET_OF_TARGET.get(name, name)
    if name not in CLUSTER_PRESETS:
        raise ValueError(
            f"unknown device {name!r}; choose one of: {', '.join(sorted(CLUSTER_PRESETS))} "
            f"(or a planner target's name: {', '.join(PRESET_OF_TARGET)})"
        )
    cluster = CLUSTER_PRESETS[name]
    return cluster if devices is None else cluster.with_devices(devices)


@dataclass(frozen=True)
class TrialProfile:
    """One planned trial as the simulator sees it. Costs are per device, per training step.

    Attributes:
      key: trial number.
      devices: devices the trial runs on (its plan's data x model parallel degree).
      bytes_per_device: predicted peak memory per device, bytes (the planner's figure).
      batch_size: global batch, samples per step.
      flops_per_step: floating-point operations one device executes per step.
      bytes_accessed_per_step: device-memory traffic of one device per step, bytes.
      comm_bytes_per_step: bytes one device sends over the interconnect per step.
      steps: training steps of the trial.
      kernels_per_step: kernels launched per step (0: ignore launch latency).
      setup_seconds: work before the first step that keeps the host busy (e.g. compiling the
        step on a CPU host), seconds, once per trial (its busy share is spread over the trial's
        devices); 0 on accelerators, whose host compiles in the background.
      alternatives: the same trial planned on more devices (more data-parallel replicas, same
        key), which a policy may start instead
        (`scamp_jax.scheduling.placement.TrialRequest.options`).
      architecture: what the engine plans by (any hashable, e.g. the index of its
        architecture): trials of one architecture share its plan, made once (None: a plan of
        its own).
      trials: the study's trials it trains (a fused group's width; the usage counts them).
    """

    key: int
    devices: int
    bytes_per_device: int
    batch_size: int
    flops_per_step: float
    bytes_accessed_per_step: float
    comm_bytes_per_step: float
    steps: int
    kernels_per_step: int = 0
    setup_seconds: float = 0.0
    alternatives: tuple[TrialProfile, ...] = ()
    architecture: Hashable | None = None
    trials: int = 1

    def __post_init__(self) -> None:
        for alt in self.alternatives:
            if alt.key != self.key or alt.devices <= self.devices or alt.alternatives:
                raise ValueError(
                    f"trial {self.key}: an alternative must have the same key, more than "
                    f"{self.devices} devices and no alternatives of its own; got key {alt.key} "
                    f"on {alt.devices} devices"
                )
        where = f"trial {self.key}: TrialProfile"
        for name in ("devices", "steps", "batch_size", "trials"):
            _check_count(where, name, getattr(self, name), minimum=1)
        for name in ("bytes_per_device", "kernels_per_step"):
            _check_count(where, name, getattr(self, name), minimum=0)
        for name in ("flops_per_step", "bytes_accessed_per_step", "comm_bytes_per_step",
                     "setup_seconds"):
            _check_amount(where, name, getattr(self, name))


def step_busy_seconds(profile: TrialProfile, cluster: ClusterModel) -> float:
    """Seconds per step a device's compute units and memory are busy (the roofline term)."""
    compute = profile.flops_per_step / (cluster.peak_flops * cluster.compute_efficiency)
    memory = profile.bytes_accessed_per_step / (
        cluster.mem_bandwidth * cluster.bandwidth_efficiency
    )
    return max(compute, memory)


def comm_seconds(bytes_sent: float, devices: int, cluster: ClusterModel) -> float:
    """Seconds to send ``bytes_sent`` from each of ``devices`` devices over their ring's slowest
    link (`ClusterModel.link_bandwidth`) at the attained fraction ``comm_efficiency``: the
    communication model (no per-message latency; checked against real MPI all-reduces by
    ``python -m benchmarks.mpi_comm --sizes``)."""
    return bytes_sent / (cluster.link_bandwidth(devices) * cluster.comm_efficiency)


def step_comm_seconds(profile: TrialProfile, cluster: ClusterModel) -> float:
    """Seconds of one step's collectives (`comm_seconds` of the bytes each device sends)."""
    return comm_seconds(profile.comm_bytes_per_step, profile.devices, cluster)


def step_seconds(profile: TrialProfile, cluster: ClusterModel) -> float:
    """Seconds of one training step of ``profile`` alone on its devices (module docstring)."""
    launch = profile.kernels_per_step * cluster.launch_seconds
    return step_busy_seconds(profile, cluster) + step_comm_seconds(profile, cluster) + launch


def comm_share(profiles: Sequence[TrialProfile], cluster: ClusterModel) -> float:
    """Share of the device-seconds of ``profiles`` (each run alone on its devices) spent in
    communication: ``sum(steps * comm * devices) / sum(steps * step * devices)``."""
    comm = sum(p.steps * step_comm_seconds(p, cluster) * p.devices for p in profiles)
    total = sum(p.steps * step_seconds(p, cluster) * p.devices for p in profiles)
    return comm / total if total > 0 else 0.0


@dataclass(frozen=True)
class SimTrial:
    """When and where one trial ran in the simulation (seconds of virtual time)."""

    key: int
    start_s: float
    end_s: float
    device_ids: tuple[int, ...]
    solo_seconds: float
    resizes: int = 0


@dataclass(frozen=True)
class SimResult:
    """Outcome of `simulate`.

    Attributes:
      policy: placement policy name.
      cluster: the cluster model simulated.
      makespan_s: virtual seconds from the study's start (time 0, when the first trials are
        asked: planning included) to the last finish.
      summary: `UsageRecorder.summary` at the makespan (memory utilisation, idle time, ...).
      trials: per-trial start, end and devices, in key order.
      busy_fraction: device-seconds of busy time (roofline) / all device-seconds.
      resizes: running trials restarted on more devices (`scamp_jax.scheduling.elastic`).
      comm_fraction: device-seconds of the trials' collectives / device-seconds of their runs
        (each run's solo time on its devices; restarts counted as the devices they moved to).
    """

    policy: str
    cluster: ClusterModel
    makespan_s: float
    summary: dict[str, float]
    trials: tuple[SimTrial, ...]
    busy_fraction: float
    resizes: int = 0
    comm_fraction: float = 0.0


# Event kinds, the last entry of an event ``(time, key, version, kind)``.
_END = 0  # a run ends (its ``version``: the run's rate version it was computed with)
_PLANNED = 1  # a trial's plan is ready
_OPTION = 2  # a queued trial's plan on more devices is ready (its ``version``: the devices)
_MEASURE = 3  # a run has trained 2 steps: its pace is measured (``version`` as for _END)
_RESIZE = 4  # a running trial's plan on more devices, for its restart, is ready (``version``:
#   the devices)


class _Planners:
    """The engine's planner threads (`scamp_jax.hpo.work.PlannerPool`) in virtual time: at most
    ``threads`` plans at once, each ``seconds`` long, pushed to ``events`` as it will end. Plans
    wait for a thread first come, first served, those for trials planned before (``first``)
    ahead of new trials' plans."""

    def __init__(self, threads: int, seconds: float,
                 events: list[tuple[float, int, int, int]]) -> None:
        self.threads, self.seconds, self.events = threads, seconds, events
        self.busy = 0
        self.waiting: tuple[deque[tuple[int, int, int, Hashable | None]], ...] = (
            deque(), deque())
        #: when each architecture's plan is (or was) done
        self.ends: dict[Hashable, float] = {}

    def submit(self, now: float, key: int, kind: int, detail: int = 0,
               first: bool = False, architecture: Hashable | None = None) -> None:
        """Plan for trial ``key``: the event ``(end, key, detail, kind)`` once planned.
        ``architecture``: the plan is that architecture's, made once: a later trial of it is
        planned as soon as a thread takes it, or with the plan under way (holding its
        thread meanwhile, as the engine's thread waits on the architecture's lock)."""
        self.waiting[0 if first else 1].append((key, detail, kind, architecture))
        self._begin(now)

    def done(self, now: float) -> None:
        """A plan ended at ``now``: its thread takes the next one waiting."""
        self.busy -= 1
        self._begin(now)

    def _begin(self, now: float) -> None:
        while self.busy < self.threads and (self.waiting[0] or self.waiting[1]):
            key, detail, kind, architecture = (self.waiting[0] or self.waiting[1]).popleft()
            self.busy += 1
            end = self.ends.get(architecture) if architecture is not None else None
            if end is None:
                end = now + self.seconds
                if architecture is not None:
                    self.ends[architecture] = end
            heapq.heappush(self.events, (max(now, end), key, detail, kind))


@dataclass
class _Running:
    profile: TrialProfile
    device_ids: tuple[int, ...]
    start: float
    solo: float
    load: float  # the busy fraction u it puts on each of its devices
    remaining: float  # solo-seconds of work left at `updated`
    rate: float
    updated: float
    version: int = 0
    resizes: int = 0
    first_solo: float = 0.0  # solo seconds on the devices it started on
    # A restart on more devices trains nothing until then (checkpoint, compile, restore); its
    # devices' compute load is kept meanwhile, a slight overestimate for trials sharing them.
    paused_until: float = 0.0
    # Solo-seconds of work done when this run's steps began (its setup; at a restart, the work
    # done before it): the engine measures a run's pace once it has trained 2 steps.
    counted_from: float = 0.0

    def work_left(self, now: float) -> float:
        """Solo-seconds of work left at ``now`` (the rate is constant since ``updated``)."""
        trained = max(0.0, now - max(self.updated, self.paused_until))
        return max(0.0, self.remaining - trained * self.rate)


def solo_seconds(profile: TrialProfile, cluster: ClusterModel) -> float:
    """Seconds ``profile`` runs alone on its devices: setup plus its steps."""
    return profile.setup_seconds + profile.steps * step_seconds(profile, cluster)


def busy_seconds(profile: TrialProfile, cluster: ClusterModel) -> float:
    """Seconds ``profile`` keeps each of its devices busy (roofline) over its run; its setup
    (a compile) counts once per trial, spread over its devices."""
    return (profile.setup_seconds / profile.devices
            + profile.steps * step_busy_seconds(profile, cluster))


def _trial_plan(profile: TrialProfile, arrival: int, grow_bytes: int) -> TrialPlan:
    """``profile`` as the scheduling core sees a planned trial (what the engine tells it)."""
    mp = profile.devices  # the simulator's profiles do not say; only the device count matters
    return TrialPlan(profile.key, arrival, profile.devices, profile.bytes_per_device,
                     profile.steps, flops_per_step=profile.flops_per_step or None,
                     data_parallel=1, model_parallel=mp, batch_size=profile.batch_size,
                     grow_bytes=grow_bytes, trials=profile.trials)


def simulate(
    profiles: Iterable[TrialProfile],
    cluster: ClusterModel,
    policy: Policy,
    *,
    lookahead: int | None = None,
    reshape: Callable[[TrialProfile], Sequence[TrialProfile]] | None = None,
    safety_margin: float = 0.0,
    max_running: int | None = None,
) -> SimResult:
    """Run ``profiles`` (arriving in list order) on ``cluster`` under ``policy``.

    The decisions are the engine's: a `scamp_jax.scheduling.SchedulingCore` is fed the same
    events the engine feeds it (a trial planned, its measured seconds per step, a run ended,
    the last wave begun) and its actions are carried out in virtual time. The core sees what
    the engine sees: each trial's FLOPs per step (the engine's ``cost_analysis()``), its bytes
    and steps, and the paces measured so far. The engine polls paces every half second and
    measures a run once it has trained 2 steps; here each run (a start, or a restart once it
    trains again) has an event at the moment it will have trained 2 steps, where its pace is
    measured and the tail's restarts are decided, and a running trial's pace is measured again
    at every later event its rate changed by (in the tail, at every event). A trial the core
    starts on a larger device count (last-wave growth: the core asks for that count's plan and
    gets one of the profile's ``alternatives``, or none, once a planner thread has made that
    plan) runs as that alternative.

    Args:
      profiles: the study's trials, in arrival order (any iterable: it is read once).
      cluster: the cluster model.
      policy: placement policy.
      lookahead: most trials waiting in the queue at once (None: all of them from time 0). The
        engine keeps about as many trials asked and planned as there are devices; the next
        trial arrives as soon as one starts.
      reshape: ``reshape(profile)`` -> the same trial on more devices with the same global
        batch (what a running trial may restart as, `scamp_jax.scheduling.elastic.resizes`); None:
        running trials are never resized. A restarted trial keeps the fraction of its work already
        done and trains nothing for ``cluster.restart_seconds``.
      safety_margin: fraction of each device's memory the pool does not book (the engine's
        `EngineConfig.safety_margin`; the profiles' plans must fit the rest).
      max_running: most trials running at once (the engine's cap, ``run.max_running`` of a
        study's ``results.json``: on CPU devices, the host's cores over two); None: as many as
        the pool holds.

    Raises ``ValueError`` if a profile can never fit the cluster, or if the policy would give a
    trial another device count than its profile was costed for (build the fixed baseline's
    profiles for ``devices_per_trial`` devices).
    """
    profiles = list(profiles)  # a one-shot iterable is read once, here
    if not profiles:
        raise ValueError("simulate needs at least one trial profile")
    if lookahead is not None and lookahead < 1:
        raise ValueError(f"{lookahead=} must be at least 1 or None (all trials queued at once)")
    core = SchedulingCore(policy, cluster.devices, cluster.budget(safety_margin),
                          cluster.restart_seconds,
                          peak_flops=cluster.peak_flops * cluster.compute_efficiency,
                          max_running=max_running, overlap=cluster.overlap)
    usable = core.capacity
    by_key: dict[int, TrialProfile] = {}
    for profile in profiles:
        if profile.key in by_key:
            raise ValueError(f"trial key {profile.key} appears twice; keys must be unique")
        given = policy.request_devices(profile.devices)
        if given != profile.devices:
            raise ValueError(
                f"trial {profile.key} was costed for {profile.devices} devices but policy "
                f"{policy.name!r} gives it {given}; build its profile for {given} devices"
            )
        check_feasible(TrialRequest(profile.key, profile.devices, profile.bytes_per_device, 0),
                       core.pool.capacity)
        by_key[profile.key] = profile
    # Compute contention is tracked per compute group (one device each on GPUs).
    group = cluster.compute_group
    groups = -(-cluster.devices // group)
    group_load = [0.0] * groups
    group_trials: list[dict[int, int]] = [{} for _ in range(groups)]  # key -> devices in group
    running: dict[int, _Running] = {}
    events: list[tuple[float, int, int, int]] = []  # (time, key, version, kind)
    planners = _Planners(cluster.planner_threads, cluster.planning_seconds, events)
    pending = list(enumerate(profiles))
    pending.reverse()  # pop() from the end is the next arrival
    done: list[SimTrial] = []
    busy_device_seconds = 0.0
    comm_device_seconds, run_device_seconds = [0.0], [0.0]
    now = 0.0
    affected: set[int] = set()  # running trials whose rate must be recomputed
    resized = 0
    shapes: dict[tuple[int, int], tuple[TrialProfile, ...]] = {}
    asked: dict[int, int] = {}  # asked, plan not ready yet: key -> arrival
    restarts: dict[int, Resize] = {}  # restarts decided, their plans being made

    def move(key: int, trial: _Running, sign: float) -> None:
        # Add (sign 1) or remove (-1) ``trial``'s compute load on its devices' groups.
        nonlocal affected
        for d in trial.device_ids:
            g = d // group
            if sign > 0:
                group_load[g] += trial.load
                group_trials[g][key] = group_trials[g].get(key, 0) + 1
            else:
                group_trials[g].pop(key, None)
                group_load[g] = max(0.0, group_load[g] - trial.load) if group_trials[g] else 0.0
            affected |= group_trials[g].keys()

    def arrive() -> None:
        # Ask trials while the lookahead has room; each waits for a planner thread.
        while pending and (lookahead is None or len(core.queued) + len(asked) < lookahead):
            arrival, profile = pending.pop()
            if cluster.planning_seconds > 0:
                asked[profile.key] = arrival
                planners.submit(now, profile.key, _PLANNED,
                                architecture=profile.architecture)
            else:
                plan_ready(profile.key, arrival)
        core.set_arrivals_pending(bool(pending or asked))

    def plan_ready(key: int, arrival: int) -> None:
        profile = by_key[key]
        grow = usable if profile.alternatives else 0
        core.planned(now, _trial_plan(profile, arrival, grow))

    def start(action: Start) -> None:
        nonlocal busy_device_seconds
        profile = by_key[action.key]
        for alt in profile.alternatives:
            if alt.devices == action.plan.devices:
                profile = alt
        solo = solo_seconds(profile, cluster)
        # Setup (a compile) happens once per trial, not once per device: spread it over the
        # devices so a shared host counts it once.
        busy = busy_seconds(profile, cluster)
        busy_device_seconds += busy * len(action.device_ids)
        comm_device_seconds[0] += profile.steps * step_comm_seconds(profile, cluster) * len(
            action.device_ids)
        run_device_seconds[0] += solo * len(action.device_ids)
        load = cluster.load(busy, solo)
        running[action.key] = _Running(profile, action.device_ids, now, solo, load, solo, 1.0,
                                       now, first_solo=solo,
                                       counted_from=profile.setup_seconds)
        move(action.key, running[action.key], 1.0)

    def option_planned(key: int, devices: int) -> None:
        # The engine's answer to a PlanOption: the profile's alternative on that count, or none.
        alt = next((a for a in by_key[key].alternatives if a.devices == devices), None)
        plan = None if alt is None else _trial_plan(alt, 0, 0)
        if plan is not None:
            plan = replace(plan, arrival=core.plan_of(key).arrival)
        core.option_planned(key, devices, plan)

    def decide() -> bool:
        started = False
        for _ in range(64):  # with plans made at once, growth plans are answered: decide again
            answered = False
            for action in core.decide(now):
                if isinstance(action, PlanOption):
                    if cluster.planning_seconds > 0:
                        # a plan like any other, ahead of new trials' plans (the engine's
                        # PlannerPool runs work of planned trials first)
                        planners.submit(now, action.key, _OPTION, action.devices, first=True)
                    else:
                        option_planned(action.key, action.devices)
                        answered = True
                else:
                    start(action)
                    started = True
            if not answered:
                break
        return started

    measured: dict[int, int] = {}  # key -> the run version last measured
    paces: dict[int, tuple[TrialProfile, float]] = {}  # key -> its profile, seconds per step

    def step_of(key: int, trial: _Running) -> float:
        held = paces.get(key)
        if held is None or held[0] is not trial.profile:
            held = paces[key] = (trial.profile, step_seconds(trial.profile, cluster))
        return held[1]

    def measure() -> None:
        # The engine's pace measurement: seconds per step of a run that trained 2 steps (an
        # event is due then, `rerate`). A pace changes only with the trial's rate (a new
        # version), so only those are measured again, except in the tail, where restarts weigh
        # every trial's steps left.
        tail = not core.queued and not pending and not asked
        for key, trial in running.items():
            if now < trial.paused_until or trial.solo <= 0:
                continue
            if not tail and measured.get(key) == trial.version:
                continue
            step = step_of(key, trial)
            done = trial.solo - trial.work_left(now)
            if step <= 0 or done - trial.counted_from < 2 * step - 1e-9 * max(1.0, trial.solo):
                continue
            trained = done - trial.profile.setup_seconds
            core.step_measured(now, key, int(trained / step), step / trial.rate,
                               trial.start + trial.profile.setup_seconds)
            measured[key] = trial.version

    def resize_running() -> None:
        # The engine's `TailResizer`: a restart the core decides is planned for its device
        # count on a planner thread first (ahead of other plans), and no other is decided
        # while one is planned; once its plan is ready it is booked if still worth it.
        if restarts:
            return
        reshapes = {}
        for key, trial in running.items():
            if trial.paused_until > now:
                continue  # being restarted already
            shape_key = (key, trial.profile.devices)
            if shape_key not in shapes:
                shapes[shape_key] = tuple(reshape(trial.profile))  # type: ignore[misc]
            reshapes[key] = [p.devices for p in shapes[shape_key]]
        for r in core.resizes(now, reshapes):
            if cluster.planning_seconds > 0:
                restarts[r.key] = r
                arch = running[r.key].profile.architecture
                planners.submit(now, r.key, _RESIZE, r.option.devices, first=True,
                                architecture=None if arch is None else (arch,
                                                                        r.option.devices))
            else:
                restart(r, planned_later=False)

    def restart(r: Resize, planned_later: bool) -> None:
        # Book restart ``r`` (its plan is ready): one planned later only where it is still
        # worth it and its devices are still free, as the engine's `TailResizer` checks.
        nonlocal busy_device_seconds, resized
        old = running.get(r.key)
        if old is None or old.paused_until > now or old.profile.devices >= r.option.devices:
            return  # it ended, or restarted meanwhile
        if planned_later and not (core.still_worth(r.key, r.option.devices)
                                  and core.restart_fits(r.key, r.device_ids)):
            return
        new = next(p for p in shapes[(r.key, old.profile.devices)]
                   if p.devices == r.option.devices)
        if not core.restarted(now, r.key, r.device_ids, _trial_plan(new, 0, 0)):
            return
        left = old.work_left(now) / old.solo if old.solo > 0 else 0.0
        busy_device_seconds += left * (busy_seconds(new, cluster) * new.devices
                                       - busy_seconds(old.profile, cluster)
                                       * old.profile.devices)
        for acc, of in ((comm_device_seconds,
                         lambda p: p.steps * step_comm_seconds(p, cluster)),
                        (run_device_seconds, lambda p: solo_seconds(p, cluster))):
            acc[0] += left * (of(new) * new.devices - of(old.profile) * old.profile.devices)
        move(r.key, old, -1.0)
        solo = solo_seconds(new, cluster)
        running[r.key] = _Running(
            new, r.device_ids, old.start, solo,
            cluster.load(busy_seconds(new, cluster), solo),
            left * solo, 1.0, now, old.version + 1, old.resizes + 1, old.first_solo,
            paused_until=now + cluster.restart_seconds, counted_from=solo - left * solo)
        move(r.key, running[r.key], 1.0)
        resized += 1

    def rerate(keys: set[int]) -> None:
        for key in keys:
            trial = running[key]
            trial.remaining = trial.work_left(now)
            trial.updated = now
            worst = max(group_load[d // group] for d in trial.device_ids)
            trial.rate = 1.0 / max(1.0, worst)
            trial.version += 1
            resume = max(now, trial.paused_until)
            finish = resume + trial.remaining / trial.rate
            heapq.heappush(events, (finish, key, trial.version, _END))
            # The moment the run will have trained 2 steps: the engine measures its pace then
            # (it polls every half second), and the core may restart it on idle devices.
            to_go = trial.counted_from + 2 * step_of(key, trial) - (trial.solo - trial.remaining)
            if to_go > 0 and resume + to_go / trial.rate < finish:
                heapq.heappush(events, (resume + to_go / trial.rate, key, trial.version,
                                        _MEASURE))

    arrive()
    while core.queued or running or pending or asked:
        if decide():
            arrive()
            if core.queued and decide():
                continue  # the next trials arrive at once and may start now too
        if reshape is not None and not core.queued and not pending and not asked and running:
            resize_running()
        if not running and not asked and not planners.busy:
            raise RuntimeError(
                f"policy {policy.name!r} started nothing on an idle pool with "
                f"{len(core.queued)} trials waiting; every request passed check_feasible, so "
                "this is a policy bug"
            )
        rerate(affected)
        affected = set()
        # Advance to the next finish; finishes at the same instant are handled together so the
        # policy sees all the memory they free at once.
        finished: list[int] = []
        ready: list[int] = []
        options: list[tuple[int, int]] = []  # (key, devices)
        grown: list[int] = []  # restarts whose plans are ready
        measuring = False
        while events:
            t, key, version, kind = heapq.heappop(events)
            if (kind in (_END, _MEASURE)
                    and (key not in running or running[key].version != version)):
                continue  # superseded by a later rate change
            if (finished or ready or options or grown or measuring) and t > now:
                heapq.heappush(events, (t, key, version, kind))
                break
            now = max(now, t)
            if kind == _MEASURE:
                measuring = True  # measured below, with every run due by now
            elif kind == _OPTION:
                options.append((key, version))
            elif kind == _RESIZE:
                grown.append(key)
            else:
                (ready if kind == _PLANNED else finished).append(key)
        if not (finished or ready or options or grown or measuring):
            raise RuntimeError(f"the simulation has {len(running)} running and "
                               f"{len(core.queued)} queued trial(s) but no event to come; "
                               "this is a simulator bug")
        for key in ready:
            planners.done(now)
            plan_ready(key, asked.pop(key))
        for key, devices in options:  # after the plans, as the engine handles them
            planners.done(now)
            if key in core.queued:  # else it started meanwhile: the engine drops the answer
                option_planned(key, devices)
        affected = set()
        for key in finished:
            trial = running.pop(key)
            core.finished(now, key)
            done.append(SimTrial(key, trial.start, now, trial.device_ids, trial.first_solo,
                                 trial.resizes))
            move(key, trial, -1.0)
        affected &= running.keys()  # some finished in this batch
        for key in grown:  # restarts whose plans are ready (their trials' rates change)
            planners.done(now)
            restart(restarts.pop(key), planned_later=True)
        rerate(affected)  # paces as of now, for the measurements
        affected = set()
        measure()
        arrive()

    makespan = now
    total = makespan * cluster.devices
    return SimResult(
        policy=policy.name,
        cluster=cluster,
        makespan_s=makespan,
        summary=core.usage.summary(makespan),
        trials=tuple(sorted(done, key=lambda t: t.key)),
        busy_fraction=busy_device_seconds / total if total > 0 else 0.0,
        resizes=resized,
        comm_fraction=(comm_device_seconds[0] / run_device_seconds[0]
                       if run_device_seconds[0] > 0 else 0.0),
    )


def allreduce_bytes(gradient_bytes: float, data_parallel: int) -> float:
    """Bytes each device sends in a ring all-reduce of ``gradient_bytes`` over ``data_parallel``
    devices: ``2 (p - 1) / p`` times the buffer (0 for one device)."""
    if data_parallel <= 1:
        return 0.0
    return 2.0 * (data_parallel - 1) / data_parallel * gradient_bytes


@dataclass(frozen=True)
class StepCostModel:
    """Per-device cost of one architecture's training step as an affine function of local batch.

    Measured once per architecture and model-parallel degree (XLA ``cost_analysis()`` of compiles
    at two per-device batch sizes; memory from the planner's `scamp_jax.planning.memory.MemoryModel`
    fitted on the same compiles), then extrapolated to any data-parallel degree: with
    ``p`` data-parallel replicas and global batch ``B`` each device runs the same program at local
    batch ``B / p``, plus a ring all-reduce of its gradient shard. This is what lets a CPU with 8
    devices cost a plan for 1,024 GPUs.

    Attributes:
      model_parallel: model-parallel degree the costs were measured at.
      flops_fixed, flops_per_sample: ``flops(b) = flops_fixed + flops_per_sample * b`` per device.
      bytes_fixed, bytes_per_sample: same for device-memory traffic, bytes.
      gradient_bytes: gradient bytes per device (parameters / model_parallel, float32).
      mp_comm_fixed, mp_comm_per_sample: model-parallel collective bytes sent per device per
        step, affine in local batch (0 for ``model_parallel == 1``).
      kernels_per_step: kernels in the compiled step.
      memory_fixed, memory_per_sample, memory_floor: the planner's peak-memory model of the
        training step per device (`scamp_jax.planning.memory.MemoryModel`: ``fixed_bytes``,
        ``bytes_per_sample``, ``floor_bytes``), bytes: ``step(b) = max(memory_floor,
        memory_fixed + memory_per_sample * b)``.
      prefetch_per_sample: bytes per device of one sample of a training batch (the next batch is
        prefetched while a step runs; ``round(prefetch_per_sample * b)`` as the planner counts it).
      eval_peak: compiled peak per device of the evaluation forward at its smallest chunk (one
        sample per data-parallel group), bytes; 0: evaluation not planned. The planner picks the
        largest chunk whose evaluation needs no more than training, so the booking
        (`scamp_jax.scheduling.booking.solo_bytes`) is the same with this chunk's figure.
      opt_state_bytes: optimizer state per device, bytes (resident while evaluating).

      plans: the planner's own answers for this architecture on its ``model_parallel``
        devices, ``(usable budget, batch cap (0: none), batch multiple, batch, booked bytes)``
        each (`scamp_jax.sim.step_costs.plan_point`: `scamp_jax.planning.planner.plan_mesh`
        and `scamp_jax.scheduling.booking.booked_bytes`, as the engine's planning service).
        `planned_profile` takes a trial's batch and bytes from the matching one, so the
        simulator books exactly what the engine books; without one, from the fits.

    What a trial books is `peak_bytes`: the engine's byte rule on these figures.
    """

    model_parallel: int
    flops_fixed: float
    flops_per_sample: float
    bytes_fixed: float
    bytes_per_sample: float
    gradient_bytes: float
    mp_comm_fixed: float
    mp_comm_per_sample: float
    kernels_per_step: int
    memory_fixed: float
    memory_per_sample: float
    memory_floor: float = 0.0
    prefetch_per_sample: float = 0.0
    eval_peak: float = 0.0
    opt_state_bytes: float = 0.0
    plans: tuple[tuple[int, int, int, int, int], ...] = ()

    def planned(self, budget_bytes: int, max_batch_size: int | None,
                batch_multiple: int) -> tuple[int, int] | None:
        """``(batch, booked bytes)`` of the planner's answer for this budget, cap and multiple
        on ``model_parallel`` devices (`plans`), or None if it was not planned."""
        for usable, cap, multiple, batch, booked in self.plans:
            if (usable, cap, multiple) == (budget_bytes, max_batch_size or 0, batch_multiple):
                return batch, booked
        return None

    def step_peak_bytes(self, local_batch: int) -> int:
        """Predicted compiled peak of the training step per device at per-device batch
        ``local_batch``, bytes."""
        affine = self.memory_fixed + self.memory_per_sample * local_batch
        return math.ceil(max(self.memory_floor, affine))

    def peak_bytes(self, local_batch: int) -> int:
        """Bytes per device a trial at per-device batch ``local_batch`` books: step, prefetched
        batch and evaluation by the engine's rule (`scamp_jax.scheduling.booking.solo_bytes`)."""
        return solo_bytes(self.step_peak_bytes(local_batch),
                          round(self.prefetch_per_sample * local_batch),
                          eval_peak=math.ceil(self.eval_peak),
                          opt_state=math.ceil(self.opt_state_bytes))

    def profile(self, key: int, devices: int, batch_size: int, samples: int) -> TrialProfile:
        """Profile of a trial training ``samples`` samples at global ``batch_size`` on
        ``devices`` devices (``devices / model_parallel`` data-parallel replicas)."""
        if devices % self.model_parallel:
            raise ValueError(
                f"{devices=} is not a multiple of model_parallel={self.model_parallel}; use "
                f"{self.model_parallel * max(1, devices // self.model_parallel)}"
            )
        dp = devices // self.model_parallel
        if batch_size % dp:
            raise ValueError(f"{batch_size=} is not a multiple of data-parallel degree {dp}")
        local = batch_size // dp
        return TrialProfile(
            key=key,
            devices=devices,
            bytes_per_device=self.peak_bytes(local),
            batch_size=batch_size,
            flops_per_step=self.flops_fixed + self.flops_per_sample * local,
            bytes_accessed_per_step=self.bytes_fixed + self.bytes_per_sample * local,
            comm_bytes_per_step=allreduce_bytes(self.gradient_bytes, dp)
            + self.mp_comm_fixed + self.mp_comm_per_sample * local,
            steps=max(1, math.ceil(samples / batch_size)),
            kernels_per_step=self.kernels_per_step,
        )

    def planned_profile(
        self,
        key: int,
        *,
        budget_bytes: int,
        samples: int,
        max_batch_size: int | None = None,
        max_devices: int | None = None,
        batch_multiple: int = 1,
    ) -> TrialProfile:
        """ScaMP's plan of one trial: ``model_parallel`` devices and the largest global batch
        whose per-device peak fits ``budget_bytes`` (capped by ``max_batch_size``), plus, as
        ``alternatives``, the same rule with 2, 4, ... data-parallel replicas up to
        ``max_devices`` devices (None: no alternatives). The global batch of an alternative is a
        multiple of its data-parallel degree; one that leaves no such batch is left out. Every
        batch is also a multiple of ``batch_multiple`` where one fits, as the planner makes it
        (`scamp_jax.planning.planner.plan_mesh`). Where the planner's own answer is known
        (`plans`), the trial's batch and booked bytes are that answer's.
        """
        planned = self.planned(budget_bytes, max_batch_size, batch_multiple)
        if planned is not None:
            local, booked = planned
        else:
            local = self.max_local_batch(budget_bytes)
            if max_batch_size is not None:
                local = min(local, max_batch_size)
            local = _round_batch(local, 1, batch_multiple)
        if local < 1:
            raise ValueError(
                f"candidate {key} does not fit {format_bytes(budget_bytes)} per device even at "
                f"batch 1 (needs {format_bytes(self.peak_bytes(1))})"
            )
        base = self.profile(key, self.model_parallel, local, samples)
        if planned is not None:
            base = replace(base, bytes_per_device=booked)
        alternatives = []
        dp = 2
        while max_devices is not None and dp * self.model_parallel <= max_devices:
            batch = self.max_local_batch(budget_bytes) * dp
            if max_batch_size is not None:
                batch = min(batch, max_batch_size)
            batch = _round_batch(batch, dp, batch_multiple)
            if batch >= dp:
                alternatives.append(self.profile(key, dp * self.model_parallel, batch, samples))
            dp *= 2
        return replace(base, alternatives=tuple(alternatives))

    def restart_profiles(
        self, profile: TrialProfile, *, budget_bytes: int, max_devices: int
    ) -> tuple[TrialProfile, ...]:
        """``profile`` (a trial of this architecture) on more devices with the same global batch:
        every data-parallel degree above its own that divides the batch, on at most
        ``max_devices`` devices, whose predicted peak fits ``budget_bytes``. These are what a
        running trial may restart as (`scamp_jax.scheduling.elastic`); the sample count is kept."""
        dp = profile.devices // self.model_parallel
        samples = profile.steps * profile.batch_size
        out = []
        for p in range(dp + 1, max_devices // self.model_parallel + 1):
            if profile.batch_size % p == 0:
                shape = self.profile(profile.key, p * self.model_parallel, profile.batch_size,
                                     samples)
                if shape.bytes_per_device <= budget_bytes:
                    out.append(shape)  # same batch and samples: same steps
        return tuple(out)

    def max_local_batch(self, budget_bytes: int) -> int:
        """Largest per-device batch whose booking (`peak_bytes`) fits ``budget_bytes`` (0: none)."""
        if self.memory_per_sample <= 0:
            raise ValueError("memory_per_sample must be positive to size a batch")
        pps = self.prefetch_per_sample
        bounds = [(budget_bytes - self.memory_fixed) / (self.memory_per_sample + pps)]
        # Each of the other terms is constant plus the prefetched batch.
        for constant in (self.memory_floor,
                         self.eval_peak + self.opt_state_bytes if self.eval_peak else 0.0):
            if constant > budget_bytes:
                return 0
            if pps > 0:
                bounds.append((budget_bytes - constant) / pps)
        b = max(0, math.floor(min(bounds)) + 1)
        # The closed form can be off by one through rounding (ceil, round): settle exactly.
        while b > 0 and self.peak_bytes(b) > budget_bytes:
            b -= 1
        return b


def _round_batch(batch: int, dp: int, multiple: int) -> int:
    """``batch`` rounded down to a multiple of ``lcm(dp, multiple)`` when one is at least that
    unit, else to a multiple of ``dp`` (the planner's rule)."""
    unit = math.lcm(dp, multiple)
    return batch - batch % unit if batch >= unit else batch - batch % dp


def plan_profiles(
    costs: Sequence[StepCostModel],
    cluster: ClusterModel,
    policy: ScampPolicy | FixedPolicy,
    *,
    samples: int,
    max_batch_size: int | None = None,
    fixed_batch_size: int | None = None,
    safety_margin: float = 0.1,
    max_devices: int | None = None,
) -> list[TrialProfile]:
    """Profiles of one trial per entry of ``costs`` (trial key = index) under ``policy``.

    ScaMP: the fewest devices that fit (``model_parallel`` devices, i.e. one data-parallel
    replica) and the largest global batch that fits within ``(1 - safety_margin)`` of device
    memory, capped by ``max_batch_size``, a multiple of the policy's ``batch_multiple`` where
    one fits; with ``max_devices``, alternatives on more devices
    (`StepCostModel.planned_profile`). Fixed: ``devices_per_trial`` devices and one global batch
    ``fixed_batch_size`` for every trial (the engine picks the largest batch the largest candidate
    fits). Every trial trains ``samples`` samples. Trials of one cost model (the same object)
    are of one architecture (`TrialProfile.architecture`: the key of its first trial), planned
    once.
    """
    budget = cluster.budget(safety_margin)
    out = []
    first: dict[int, int] = {}  # id of a cost model -> the key of its first trial
    for key, cost in enumerate(costs):
        if isinstance(policy, FixedPolicy):
            if fixed_batch_size is None:
                raise ValueError("the fixed policy needs fixed_batch_size (one batch for all)")
            profile = cost.profile(key, policy.devices_per_trial, fixed_batch_size, samples)
        else:  # the compiled figures fit the usable bytes less the allowance
            profile = cost.planned_profile(key, budget_bytes=budget.plan_bytes, samples=samples,
                                           max_batch_size=max_batch_size,
                                           max_devices=max_devices,
                                           batch_multiple=policy.batch_multiple)
        profile = replace(profile, architecture=first.setdefault(id(cost), key))
        out.append(booking_allowance(profile, budget.allowance_bytes))
    return out


def booking_allowance(profile: TrialProfile, allowance_bytes: int) -> TrialProfile:
    """``profile`` (and its alternatives) booking ``allowance_bytes`` more per device, as the
    engine books a plan with its allowance (`scamp_jax.scheduling.booking.solo_bytes`)."""
    if not allowance_bytes:
        return profile
    return replace(profile, bytes_per_device=profile.bytes_per_device + allowance_bytes,
                   alternatives=tuple(booking_allowance(a, allowance_bytes)
                                      for a in profile.alternatives))
