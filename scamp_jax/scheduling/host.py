"""How many trials at once pay off on CPU devices, which split one host's cores.

CPU devices made with ``--xla_force_host_platform_device_count`` (`scamp_jax.devices`) are
slices of one host: they share its cores and its memory. Trials on different CPU devices do not
add compute; they take turns on the same cores, and each XLA program already uses several of
them. Measured on a 2-core host (`examples/digits.py`'s study, 6 trials on 4 CPU devices, whole
processes, two interleaved repeats): one trial at a time took 11.9-12.0 CPU s and 21-31 s,
two at a time 13.4-14.1 CPU s and 29-35 s, up to four at a time 15.6-16.7 CPU s and 37-38 s.
So the default is one running trial per `CPU_CORES_PER_TRIAL` cores (at least one), the rest
queued; on accelerators trials are not capped.

A running trial's share of the cores is used only if its program spreads over them. XLA runs
much of a step on one thread per CPU device: one trial on one CPU device used about one core
(CPU time 0.96x its wall time). Data-parallel over more CPU devices at the same global batch a
heavy step trains faster, although the devices add no cores, and a light one slower: the
devices exchange gradients every step (`benchmarks.cpu_data_parallel`, 2-core host shared with
other work, interleaved rounds, medians per step, 2 devices against 1):

======================================  ============  ==========================
model, global batch                     GFLOP/step    2 devices (4 devices)
======================================  ============  ==========================
digits MLP 256x2, 128                   0.062         0.61x (0.37x)
smoke SwinIR smallest, 4                0.077         0.71x
smoke SwinIR embed 24, depth 2, 4       0.355         1.12x
smoke SwinIR embed 24, depth 2, 8       0.71          1.67x
smoke SwinIR largest, 4                 2.39          1.61x
smoke SwinIR largest, 16                9.54          1.26x (1.39x)
smoke ViT largest, 64                   33.3          1.05x (1.19x)
======================================  ============  ==========================

The heavy steps also took less CPU time per step on more devices (SwinIR largest at batch 4:
105 against 75 ms). So `cpu_trial_devices` plans a trial whose step has at least
`CPU_SPLIT_FLOPS` on at least as many CPU devices as the host cores its share of the running
cap gives it, and a lighter trial on one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

#: host cores per concurrently running trial on CPU devices (from the measurement above).
CPU_CORES_PER_TRIAL = 2
#: FLOPs per training step below which a trial on CPU devices stays on one device (measured
#: above: steps of at most 0.08 GFLOP lost on 2 devices, steps of 0.36 GFLOP and more gained).
CPU_SPLIT_FLOPS = 3e8


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


def cpu_trial_devices(devices: Sequence[jax.Device], max_running: int | None,
                      max_batch: int | None = None, cores: int | None = None,
                      flops_per_step: float | None = None) -> int:
    """Fewest devices to plan one trial on: on CPU devices the host ``cores`` (default:
    `host_cores`) each of ``max_running`` running trials gets (None: as many as there are
    devices), within its share of the pool, at most ``max_batch`` (one sample per device at
    least), rounded down to a power of two; 1 for a step of fewer than `CPU_SPLIT_FLOPS`
    (``flops_per_step``, None: unknown, counted as heavy), and 1 when any device is an
    accelerator, where the fewest devices that hold a trial leave the most room for others."""
    if not devices or any(d.platform != "cpu" for d in devices):
        return 1
    if flops_per_step is not None and flops_per_step < CPU_SPLIT_FLOPS:
        return 1
    if max_running is not None and max_running < 1:
        raise ValueError(f"max_running={max_running} must be a positive int or None")
    cores = host_cores() if cores is None else cores
    running = len(devices) if max_running is None else max_running
    share = min(cores // running, len(devices) // running, max_batch or len(devices))
    return 1 << (max(1, share).bit_length() - 1)
