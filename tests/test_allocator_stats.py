"""`scamp_jax.devices.allocator_stats` is the one reader of the allocator's statistics.

CPU devices report none; GPU figures come from a stand-in device object here (this machine has
no GPU; ``tests/test_gpu.py`` reads a real allocator), shaped as XLA's GPU client reports them.
"""

from __future__ import annotations

import jax
import pytest

from scamp_jax import devices
from scamp_jax.planning.budget import Budget


class _ReportingDevice:
    """A device whose ``memory_stats()`` is what a GPU client returns (-1: not kept)."""

    platform = "gpu"

    def __init__(self, **stats: int) -> None:
        self._stats = stats

    def memory_stats(self) -> dict[str, int]:
        return dict(self._stats)


def test_cpu_devices_report_no_allocator_statistics() -> None:
    assert devices.allocator_stats(jax.devices()[0]) is None
    assert devices.peak_bytes_in_use(jax.devices()[:2]) is None


def test_keeps_what_the_backend_reports_and_drops_what_it_does_not_keep() -> None:
    gpu = _ReportingDevice(bytes_in_use=3 << 20, peak_bytes_in_use=5 << 20, pool_bytes=8 << 20,
                           largest_free_block_bytes=2 << 20, bytes_limit=1 << 30,
                           bytes_reserved=-1, num_allocs=7)
    stats = devices.allocator_stats(gpu)
    assert stats == {"bytes_in_use": 3 << 20, "peak_bytes_in_use": 5 << 20,
                     "pool_bytes": 8 << 20, "largest_free_block_bytes": 2 << 20,
                     "bytes_limit": 1 << 30, "num_allocs": 7}
    assert set(devices.ALLOCATOR_KEYS) <= set(stats)
    assert devices.allocator_stats(_ReportingDevice()) is None  # reports nothing
    assert devices.allocator_stats(object()) is None  # no memory_stats at all


def test_every_reader_goes_through_the_module_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replacing ``scamp_jax.devices.allocator_stats`` reaches the planner and the peak reader."""
    cpu = jax.devices()[:2]
    with pytest.raises(ValueError, match="memory_per_device is required"):
        Budget.of_devices(cpu)
    fake = {cpu[0].id: {"bytes_limit": 6 << 30, "peak_bytes_in_use": 1 << 30},
            cpu[1].id: {"bytes_limit": 4 << 30, "peak_bytes_in_use": 3 << 30}}
    monkeypatch.setattr(devices, "allocator_stats", lambda d: fake[d.id])
    assert Budget.of_devices(cpu).memory_per_device == 4 << 30
    assert devices.peak_bytes_in_use(cpu) == 3 << 30
