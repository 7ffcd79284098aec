"""How many trials at once pay off on CPU devices, which split one host's cores.

CPU devices made with ``--xla_force_host_platform_device_count`` (`scamp_jax.devices`) are
slices of one host: they share its cores and its memory. Trials on different CPU devices do not
add compute; they take turns on the same cores, and each XLA program already uses several of
them. Measured on a 2-core host (`examples/digits.py`'s study, 6 trials on 4 CPU devices, whole
processes, two interleaved repeats): one trial at a time took 11.9-12.0 CPU s and 21-31 s,
two at a time 13.4-14.1 CPU s and 29-35 s, up to four at a time 15.6-16.7 CPU s and 37-38 s.
So the default is one running trial per `CPU_CORES_PER_TRIAL` cores (at least one), the rest
queued; on accelerators trials are not capped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

#: host cores per concurrently running trial on CPU devices (from the measurement above).
CPU_CORES_PER_TRIAL = 2


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_max_running(devices: Sequence[jax.Device], cores: int | None = None) -> int | None:
    """Most trials to run at once on ``devices`` by default: on CPU devices one per
    `CPU_CORES_PER_TRIAL` of the host's ``cores`` (default: `host_cores`), at least one; None
    (no cap) when any device is an accelerator."""
    if not devices or any(d.platform != "cpu" for d in devices):
        return None
    cores = host_cores() if cores is None else cores
    return max(1, cores // CPU_CORES_PER_TRIAL)
