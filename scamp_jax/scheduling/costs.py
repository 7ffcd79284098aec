"""What a device can attain, for the scheduling core's busy fractions (no JAX here).

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
