"""What a device can attain, and what a trial gains on more devices, for the scheduling core
(no JAX here).

`attainable_flops` maps a device kind (``jax.Device.device_kind``) to its data-sheet float32
matmul FLOP/s (TF32 tensor cores where XLA uses them for float32 by default) times the fraction a
real XLA step attains. The cluster simulator's presets (`scamp_jax.sim.simulator.CLUSTER_PRESETS`)
use the same figures, so the engine and the simulator give the core the same peak.
"""

from __future__ import annotations

TFLOPS = 10**12

#: Attained fraction of the data-sheet peak (0.5: typical for mid-sized transformer layers).
COMPUTE_EFFICIENCY = 0.5

#: Substring of ``device_kind`` -> data-sheet float32 FLOP/s (first match wins).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100", 495 * TFLOPS),
    ("H200", 495 * TFLOPS),
    ("A100", 156 * TFLOPS),
    ("V100", 15.7 * TFLOPS),
)


def attainable_flops(device_kind: str) -> float | None:
    """FLOP/s one device of ``device_kind`` attains in a training step, or None if unknown
    (e.g. CPU devices, whose share of the host's cores is not fixed)."""
    for name, peak in PEAK_FLOPS:
        if name in device_kind:
            return peak * COMPUTE_EFFICIENCY
    return None


def shared_load(busy_fraction: float, overlap: float) -> float:
    """Load a trial of ``busy_fraction`` puts on each of its devices when trials share them:
    ``overlap * busy_fraction + (1 - overlap)``. ``overlap`` in [0, 1] says how much of a
    co-located trial's idle part others can fill: 0, strict turns (every trial loads its devices
    fully, so packed trials run one after another's step); 1, free overlap (the load is the
    busy fraction). The scheduling core books this load and the cluster simulator charges it,
    so both use this one rule."""
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap={overlap} must be in [0, 1] (0: strict turns on a device, "
                         "1: free overlap)")
    return overlap * busy_fraction + (1.0 - overlap)


def resized_seconds(seconds: float, busy_fraction: float | None, devices: int,
                    new_devices: int) -> float:
    """Predicted seconds of the work that takes ``seconds`` on ``devices`` data-parallel
    devices once the same global batch is spread over ``new_devices``: the busy part of each
    step (compute at the attainable rate) shrinks with each device's share of the batch, the
    rest (launch gaps, host work, collectives) does not, ``seconds * (busy * devices /
    new_devices + 1 - busy)``. ``busy_fraction`` is the trial's measured one
    (`SchedulingCore.busy_fraction`); None (not known) counts as fully busy, a linear speed-up.
    The collectives the new replicas add are not counted (small within a node; a restart's
    new plan is checked again with its measured pace before it is carried out)."""
    if devices < 1 or new_devices < 1:
        raise ValueError(f"devices={devices} and new_devices={new_devices} must be >= 1")
    busy = 1.0 if busy_fraction is None else min(1.0, max(0.0, busy_fraction))
    return seconds * (busy * devices / new_devices + 1.0 - busy)
