"""The search loop's work in flight: each future with what its end brings.

A `Work` is made where its future is submitted (a plan, a re-plan, a run, ...), and carries the
handler of its end: the loop waits on the futures and calls each finished one's ``done`` with
it, in a fixed order among those done at once (`Work.order`), whatever finished first. The
constructors below are the kinds of work there are; the loop asks no work what kind it is.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Handling stages of futures done at once: plans (by trial number), then plans of queued trials
#: on more devices, then re-plans and verifications, then ended runs and groups sized.
PLAN, OPTION, REPLAN, RUN = 0, 1, 2, 3


@dataclass(frozen=True)
class Work:
    """A future in flight (see the module doc).

    Attributes:
      stage: its handling stage among futures done at once (`PLAN`, `OPTION`, `REPLAN`, `RUN`).
      key: its order within the stage (a trial number or a unit's key; -1: none).
      done: ``done(future)``, called on the loop's thread once the future is done.
      trials: the trials it carries, given back to the study if the engine stops meanwhile.
      arriving: a trial on its way to the queue (a plan or a re-plan): it counts against the
        engine's lookahead.
      pending: the study's last wave has not begun while it is in flight (it may queue a unit).
      params: the configuration being planned (a member on its way to a fused group), or None.
    """

    stage: int
    key: int
    done: Callable[[cf.Future], None]
    trials: tuple[int, ...] = ()
    arriving: bool = False
    pending: bool = True
    params: Mapping[str, Any] | None = None

    def order(self) -> tuple[int, int]:
        """Sort key among futures done at once."""
        return self.stage, self.key


def planning(number: int, params: Mapping[str, Any], done: Callable[[cf.Future], None]) -> Work:
    """Trial ``number`` (configuration ``params``) being planned."""
    return Work(PLAN, number, done, (number,), arriving=True, params=params)


def option(key: int, done: Callable[[cf.Future], None]) -> Work:
    """A queued trial's plan on more devices, which the scheduling core asked for."""
    return Work(OPTION, key, done, pending=False)


def replanning(number: int, done: Callable[[cf.Future], None]) -> Work:
    """Trial ``number`` planned again (after an out-of-memory run, or a grown allowance)."""
    return Work(REPLAN, number, done, (number,), arriving=True)


def verifying(number: int, done: Callable[[cf.Future], None]) -> Work:
    """Trial ``number``'s provisional plan planned again by compiling, to train alone."""
    return Work(REPLAN, number, done, (number,))


def sizing(numbers: tuple[int, ...], done: Callable[[cf.Future], None]) -> Work:
    """A fused group of the trials ``numbers`` sized at its own width."""
    return Work(RUN, -1, done, numbers)


def running(key: int, done: Callable[[cf.Future], None]) -> Work:
    """Unit ``key`` (a solo trial or a fused group) training; its members are given back
    through its run, not through this work."""
    return Work(RUN, key, done, pending=False)
