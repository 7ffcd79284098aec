"""Larger device counts of queued trials: what the scheduling core asked for and was answered.

In a study's last wave the core may start a queued trial on 2x, 4x, ... its planned devices
(`scamp_jax.scheduling.core.SchedulingCore.decide`); each such count needs its own plan, which
the core asks for (`scamp_jax.scheduling.core.PlanOption`) before it books it. `GrowthOptions`
keeps those plans, the questions still open and the counts that did not fit, and makes the
`scamp_jax.scheduling.placement.DeviceOption` tuple a queued trial offers the policy. Pure
bookkeeping: no clock, threads or I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scamp_jax.scheduling.placement import DeviceOption


class GrowthOptions:
    """Plans of queued trials on more devices (see the module doc).

    Args:
      devices: devices in the pool (the largest count a trial may grow to).
      seconds: ``seconds(plan) -> predicted seconds or None`` (the core's costs).
    """

    def __init__(self, devices: int, seconds: Callable[[Any], float | None]) -> None:
        self.devices, self.seconds = devices, seconds
        self._plans: dict[tuple[int, int], Any] = {}  # planned larger device counts
        self._asked: set[tuple[int, int]] = set()  # asked for, no answer yet
        self._refused: set[tuple[int, int]] = set()  # counts whose plan did not fit
        # Trials with a plan or a refusal; the others share their options per (devices, grow
        # bytes) in ``_plain``.
        self._touched: set[int] = set()
        self._plain: dict[tuple[int, int], tuple[DeviceOption, ...]] = {}

    def answered(self, key: int, devices: int, plan: Any | None) -> None:
        """The plan of trial ``key`` on ``devices`` devices (None: it does not fit there)."""
        self._asked.discard((key, devices))
        self._touched.add(key)
        if plan is None or plan.devices != devices:
            self._refused.add((key, devices))
        else:
            self._plans[(key, devices)] = plan

    def refuse(self, key: int, devices: int) -> None:
        """Never offer trial ``key`` on ``devices`` devices again (its plan failed there)."""
        self._refused.add((key, devices))
        self._touched.add(key)

    def refused(self, key: int, devices: int) -> bool:
        """Whether trial ``key`` is not to be offered ``devices`` devices."""
        return (key, devices) in self._refused

    def forget(self, key: int) -> None:
        """Trial ``key`` was planned again: its plans on more devices no longer hold."""
        self._plans = {k: v for k, v in self._plans.items() if k[0] != key}

    def plan(self, key: int, devices: int) -> Any | None:
        """Trial ``key``'s plan on ``devices`` devices, or None (not planned yet)."""
        return self._plans.get((key, devices))

    def ask(self, key: int, devices: int) -> bool:
        """True (and noted) when that plan has not been asked for yet."""
        if (key, devices) in self._asked:
            return False
        self._asked.add((key, devices))
        return True

    def options(self, plan: Any) -> tuple[DeviceOption, ...]:
        """The options of queued ``plan`` on 2x, 4x, ... its devices: a planned count with its
        bytes and cost, one not planned yet with the usable share (``plan.grow_bytes``) and
        no cost."""
        if plan.key not in self._touched:
            shape = (plan.devices, plan.grow_bytes)
            shared = self._plain.get(shape)
            if shared is None:
                shared = self._plain[shape] = self._options_of(plan)
            return shared
        return self._options_of(plan)

    def _options_of(self, plan: Any) -> tuple[DeviceOption, ...]:
        options = []
        n = plan.devices * 2
        while n <= self.devices:
            if (plan.key, n) not in self._refused:
                known = self._plans.get((plan.key, n))
                if known is not None:
                    options.append(DeviceOption(n, known.bytes_per_device, self.seconds(known)))
                else:
                    options.append(DeviceOption(n, plan.grow_bytes, None))
            n *= 2
        return tuple(options)
