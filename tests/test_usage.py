"""Usage accounting on a hand-computed example."""

from __future__ import annotations

import pytest

from scamp_jax.scheduling.placement import Placement
from scamp_jax.scheduling.usage import BusyInterval, UsageRecorder


def _example() -> UsageRecorder:
    # Two devices of 100 bytes (200 in all).
    #   t=0..4  trial 1 holds 50 B on device 0
    #   t=2..6  trial 2 holds 30 B on each of devices 0 and 1
    #   t=6..10 nothing
    recorder = UsageRecorder([100, 100])
    recorder.start(0.0, Placement(1, (0,)), 50)
    recorder.start(2.0, Placement(2, (0, 1)), 30)
    recorder.finish(4.0, 1)
    recorder.finish(6.0, 2)
    return recorder


def test_memory_utilization_by_hand() -> None:
    recorder = _example()
    times, fractions = recorder.memory_utilization_series()
    assert times == (0.0, 2.0, 4.0, 6.0)
    assert fractions == pytest.approx((0.25, 0.55, 0.30, 0.0))
    # Area: 0.25*2 + 0.55*2 + 0.30*2 + 0*4 = 2.2 over 10 s.
    assert recorder.mean_memory_utilization(10.0) == pytest.approx(0.22)
    assert recorder.mean_memory_utilization(6.0) == pytest.approx(2.2 / 6.0)


def test_idle_device_seconds_by_hand() -> None:
    recorder = _example()
    # Device 0 busy 0..6 (idle 4 s of 10), device 1 busy 2..6 (idle 2 + 4 s).
    assert recorder.idle_device_seconds(10.0) == pytest.approx(10.0)
    assert recorder.idle_device_seconds(6.0) == pytest.approx(2.0)
    summary = recorder.summary(10.0)
    assert summary["idle_fraction"] == pytest.approx(0.5)
    assert summary["peak_memory_utilization"] == pytest.approx(0.55)
    assert summary["trials_started"] == summary["trials_finished"] == 2.0
    assert summary["elapsed_s"] == 10.0


def test_busy_intervals_per_device() -> None:
    recorder = UsageRecorder([100, 100], t0=1.0)
    recorder.start(1.0, Placement(1, (0,)), 50)
    recorder.start(3.0, Placement(2, (0, 1)), 30)
    recorder.finish(5.0, 1)
    device0, device1 = recorder.busy_intervals(t_end=8.0)
    assert device0 == (BusyInterval(1, 1.0, 5.0, 50), BusyInterval(2, 3.0, 8.0, 30))
    assert device1 == (BusyInterval(2, 3.0, 8.0, 30),)
    assert recorder.busy_intervals()[1] == (BusyInterval(2, 3.0, None, 30),)
    # Accounting starts at t0 = 1: device 1 idle 1..3, device 0 never.
    assert recorder.idle_device_seconds(8.0) == pytest.approx(2.0)


def test_events_out_of_order_are_rejected() -> None:
    recorder = UsageRecorder([100])
    recorder.start(5.0, Placement(1, (0,)), 10)
    with pytest.raises(ValueError, match="earlier than the previous event"):
        recorder.finish(4.0, 1)
    with pytest.raises(ValueError, match="never started"):
        recorder.finish(6.0, 2)
    with pytest.raises(ValueError, match="started twice"):
        recorder.start(6.0, Placement(1, (0,)), 10)
    with pytest.raises(ValueError, match="before the last event"):
        recorder.summary(1.0)
