"""The memory of one device as plans and the ledger see it: one value, made once.

A `Budget` holds what decides how many bytes a trial may book on a device:

- ``memory_per_device``: the bytes of the allocator's pool on each device that this process's
  trials share (a GPU's pool is what XLA's allocator may hold, `bytes_limit`; CPU devices have
  no pool and take a share of the host's memory);
- ``device_bytes`` and ``outside_pool_bytes``: the device's whole memory and what a process
  holds on it outside the pool (CUDA context, loaded modules: about 650 MB per process on an
  H200 with jax 0.11.2), which size the pool when it is not given (`default_pool_bytes`:
  XLA's 75% for a process alone on the device, else the device split between the processes
  that share it, less each one's part outside its pool, `pool_bytes`);
- ``safety_margin``: the fraction of the pool held back for what is still unknown;
- ``allowance_bytes``: what a trial holds beyond XLA's compiled figures on this kind of device
  (learned from the allocator's statistics, `scamp_jax.hpo.calibration`, and kept in the plan
  cache per device kind).

From them: `Budget.usable_bytes`, the bytes the ledger books per device (every plan's booking,
compiled figures plus allowance, fits in it), and `Budget.plan_bytes`, the bytes one plan's
compiled figures may fill (usable less the allowance). The planner
(`scamp_jax.planning.planner.plan_mesh`), the scheduling core, the runners and the cluster
simulator all take these two figures from here.

A `Budget` is made from live devices (`Budget.of_devices`: an explicit budget, else the
smallest ``bytes_limit`` the devices report) or from a described device that is not present
(`Budget.for_device`: a kind and its total memory). This module imports no JAX.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from scamp_jax import devices as _devices
from scamp_jax._units import format_bytes, parse_bytes

log = logging.getLogger(__name__)

#: Fraction of each device's pool held back when none is given (allocator rounding,
#: runtime buffers, what the allowance has not learnt yet).
DEFAULT_SAFETY_MARGIN = 0.1
#: Bytes a process holds on a GPU outside its allocator's pool (CUDA context, loaded modules):
#: 650-669 MB measured per process on one H200 (jax 0.11.2, CUDA 13, 2026-11-27), rounded up.
GPU_OUTSIDE_POOL_BYTES = 700 * 10**6


def pool_bytes(device_bytes: int, outside_pool_bytes: int, processes: int = 1) -> int:
    """The pool each of ``processes`` processes sharing one device may hold, bytes: an equal
    share of the device's ``device_bytes`` less what each holds outside its pool."""
    if processes < 1:
        raise ValueError(f"{processes=} must be at least 1 (the processes sharing the device)")
    share = int(device_bytes) // processes - int(outside_pool_bytes)
    if share <= 0:
        raise ValueError(
            f"{processes} process(es) on a device of {format_bytes(device_bytes)} leave no pool "
            f"once each holds {format_bytes(outside_pool_bytes)} outside it; run fewer "
            "processes per device")
    return share


def default_pool_bytes(device_bytes: int, processes: int = 1,
                       outside_pool_bytes: int = GPU_OUTSIDE_POOL_BYTES) -> int:
    """The pool a training process holds on a device of ``device_bytes`` when no budget is
    given, bytes: XLA's own fraction for a process alone on it (none is set,
    `scamp_jax.devices.pool_fraction`), an equal share less what each holds outside its pool
    for ``processes`` sharing it (`pool_bytes`). The one rule of a real run's pool and of a
    described device's (`Budget.for_device`)."""
    if processes <= 1:
        return int(int(device_bytes) * _devices.XLA_DEFAULT_FRACTION)
    return pool_bytes(device_bytes, outside_pool_bytes, processes)


@dataclass(frozen=True)
class Budget:
    """What a trial may book per device (see the module doc). Frozen; sizes in bytes.

    Attributes:
      memory_per_device: the allocator's pool per device that trials share, bytes.
      safety_margin: fraction of ``memory_per_device`` held back, in [0, 1).
      allowance_bytes: bytes per device a trial holds beyond XLA's compiled figures on this
        kind of device (booked with every plan; 0 where none has been measured).
      platform: the devices' platform (``"cpu"``, ``"gpu"``, ...).
      device_kind: the devices' kind (e.g. ``"NVIDIA H200"``), the key of learned allowances.
      device_bytes: the device's whole memory, bytes; None where unknown (CPU devices).
      outside_pool_bytes: bytes a process holds on the device outside its pool (0 on CPU).
    """

    memory_per_device: int
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    allowance_bytes: int = 0
    platform: str = "cpu"
    device_kind: str = "cpu"
    device_bytes: int | None = None
    outside_pool_bytes: int = 0

    def __post_init__(self) -> None:
        m = self.memory_per_device
        if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
            raise ValueError(f"memory_per_device={m!r} must be a positive int (bytes per "
                             "device); parse a text like '2GiB' with Budget.of_devices")
        if not 0.0 <= self.safety_margin < 1.0:
            raise ValueError(
                f"safety_margin={self.safety_margin} must be in [0, 1): it is the fraction of "
                "memory_per_device held back, e.g. 0.1")
        if self.usable_bytes < 1:
            raise ValueError(
                f"memory_per_device={m} ({format_bytes(m)}) leaves nothing to book once the "
                f"safety margin of {self.safety_margin:.0%} is held back; pass a size with its "
                "unit, e.g. '2GiB'")
        a = self.allowance_bytes
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise ValueError(f"allowance_bytes={a!r} must be a non-negative int (bytes per "
                             "device)")
        if self.device_bytes is not None and self.outside_pool_bytes >= self.device_bytes:
            raise ValueError(
                f"the device's {format_bytes(self.device_bytes)} are no more than the "
                f"{format_bytes(self.outside_pool_bytes)} a process holds outside its pool "
                "(the CUDA context, libraries' workspaces), so no pool fits on it; check the "
                "device's memory size (a target description's device_memory_size)")
        if self.device_bytes is not None and m + self.outside_pool_bytes > self.device_bytes:
            raise ValueError(
                f"a pool of {format_bytes(m)} per device and "
                f"{format_bytes(self.outside_pool_bytes)} outside it exceed the device's "
                f"{format_bytes(self.device_bytes)}; pass "
                f"memory_per_device of at most "
                f"{format_bytes(self.device_bytes - self.outside_pool_bytes)}")

    # -- the figures ----------------------------------------------------------------------------
    @property
    def usable_bytes(self) -> int:
        """Bytes per device the ledger books: ``floor(memory_per_device * (1 - margin))``."""
        return int(self.memory_per_device * (1.0 - self.safety_margin))

    @property
    def plan_bytes(self) -> int:
        """Bytes per device one plan's compiled figures may fill: `usable_bytes` less the
        allowance its booking adds (may be <= 0: then nothing fits)."""
        return self.usable_bytes - self.allowance_bytes

    @property
    def memory_fraction(self) -> float | None:
        """The pool as a share of the device's memory (what ``XLA_CLIENT_MEM_FRACTION`` must
        be for XLA's allocator to hold exactly the pool); None where the device's memory is
        unknown."""
        if not self.device_bytes:
            return None
        return self.memory_per_device / self.device_bytes

    # -- variants -------------------------------------------------------------------------------
    def with_allowance(self, allowance_bytes: int) -> Budget:
        """The same budget booking ``allowance_bytes`` per trial beyond compiled figures."""
        return replace(self, allowance_bytes=int(allowance_bytes))

    def with_memory(self, memory_per_device: int) -> Budget:
        """The same devices with another pool per device (bytes)."""
        return replace(self, memory_per_device=int(memory_per_device))

    def describe(self) -> str:
        """One line for logs, e.g. ``pool 1.00 GiB, usable 921.60 MiB (margin 10%), ...``."""
        parts = [f"pool {format_bytes(self.memory_per_device)}",
                 f"usable {format_bytes(self.usable_bytes)} (margin {self.safety_margin:.0%})"]
        if self.allowance_bytes:
            parts.append(f"allowance {format_bytes(self.allowance_bytes)} per trial")
        if self.device_bytes:
            parts.append(f"of {format_bytes(self.device_bytes)} {self.device_kind}")
        return ", ".join(parts)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def of_devices(cls, devices: Sequence[Any], memory_per_device: int | float | str | None = None,
                   *, safety_margin: float = DEFAULT_SAFETY_MARGIN,
                   allowance_bytes: int = 0) -> Budget:
        """The budget of live ``devices`` (``jax.Device``s of one platform).

        ``memory_per_device``: bytes or a text like ``"2GiB"`` (parsed here, once); None: the
        smallest ``bytes_limit`` the devices' allocators report
        (`scamp_jax.devices.allocator_stats`: the pool on GPUs; CPU devices report none and
        need it given). A GPU target's compile-only devices (`scamp_jax.planning.targets`)
        have the budget of their described device (`for_device`).
        """
        if not devices:
            raise ValueError("devices is empty; pass the devices the budget is for")
        from scamp_jax.planning.targets import target_of

        target = target_of(devices)
        if target is not None:  # a GPU described, not present: it reports no limit
            return cls.for_device(target.device_kind, target.memory_bytes,
                                  memory_per_device=memory_per_device,
                                  safety_margin=safety_margin, allowance_bytes=allowance_bytes)
        platform = str(devices[0].platform)
        kinds = sorted({str(getattr(d, "device_kind", platform)) for d in devices})
        if memory_per_device is None:
            memory = _smallest_limit(devices)
        else:
            memory = parse_bytes(memory_per_device)
        if platform == "cpu":
            _above_host(len(devices), memory)
        return cls(memory, safety_margin=safety_margin, allowance_bytes=allowance_bytes,
                   platform=platform, device_kind=",".join(kinds),
                   outside_pool_bytes=0 if platform == "cpu" else GPU_OUTSIDE_POOL_BYTES)

    @classmethod
    def for_device(cls, device_kind: str, device_bytes: int, *, platform: str = "gpu",
                   memory_per_device: int | float | str | None = None, processes: int = 1,
                   outside_pool_bytes: int = GPU_OUTSIDE_POOL_BYTES,
                   safety_margin: float = DEFAULT_SAFETY_MARGIN,
                   allowance_bytes: int = 0) -> Budget:
        """The budget of a described device (no device needs to be present): its kind and
        whole memory ``device_bytes``. The pool is ``memory_per_device`` when given, else what
        a training process would hold there, one of ``processes`` on the device
        (`default_pool_bytes`: the same rule as a run's)."""
        total = parse_bytes(device_bytes)
        memory = (default_pool_bytes(total, processes, outside_pool_bytes)
                  if memory_per_device is None else parse_bytes(memory_per_device))
        return cls(memory, safety_margin=safety_margin, allowance_bytes=allowance_bytes,
                   platform=platform, device_kind=device_kind, device_bytes=total,
                   outside_pool_bytes=outside_pool_bytes)


def _smallest_limit(devices: Sequence[Any]) -> int:
    limits = []
    for d in devices:
        stats = _devices.allocator_stats(d)  # the one reader, looked up at each call
        if not stats or "bytes_limit" not in stats:
            raise ValueError(
                f"memory_per_device is required on {d.platform} devices, which report no memory "
                "limit; pass it, e.g. plan_mesh(model, batch, memory_per_device='2GiB')")
        limits.append(int(stats["bytes_limit"]))
    return min(limits)


_WARNED_ABOVE_HOST: set[int] = set()
_STANDING_IN = [0]  # `standing_in_for_another_device` contexts entered


@contextlib.contextmanager
def standing_in_for_another_device() -> Iterator[None]:
    """Within it, CPU devices only stand in for another device's memory (the cluster simulator
    plans on them to cost a GPU's plans; nothing trains there): the warning that they hold more
    than the host's memory is not given."""
    _STANDING_IN[0] += 1
    try:
        yield
    finally:
        _STANDING_IN[0] -= 1


def _above_host(count: int, memory_per_device: int) -> None:
    """Warn (once per process and memory per device: the pool's devices come first, then
    subsets of them) where ``count`` CPU devices of ``memory_per_device``
    bytes hold more than the host's memory (`scamp_jax.devices.host_memory_bytes`: physical,
    or a container's limit): plans that fill them would run the host out of memory."""
    if _STANDING_IN[0]:
        return  # planning for another device's memory: nothing runs on this host
    host = _devices.host_memory_bytes()
    if host is None:
        return  # no such figure on this system
    if count * memory_per_device <= host or memory_per_device in _WARNED_ABOVE_HOST:
        return
    _WARNED_ABOVE_HOST.add(memory_per_device)
    log.warning("%d CPU device(s) of %s hold %s, more than this host's memory (%s): trials "
                "planned to fill them would run the host out of memory; pass a memory per "
                "device of at most %s", count, format_bytes(memory_per_device),
                format_bytes(count * memory_per_device), format_bytes(host),
                format_bytes(host // count))
