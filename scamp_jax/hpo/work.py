"""The search loop's work in flight: each future with what its end brings.

A `Work` is made where its future is submitted (a plan, a re-plan, a run, ...), and carries the
handler of its end: the loop waits on the futures and calls each finished one's ``done`` with
it, in a fixed order among those done at once (`Work.order`), whatever finished first. The
constructors below are the kinds of work there are; the loop asks no work what kind it is.

`PlannerPool` runs the loop's planning work on its planner threads, the work of trials the
engine has planned before (a group's sizing, a re-plan, a verification, a plan on more devices)
ahead of new trials' plans.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import itertools
import threading
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


class PlannerPool:
    """The engine's planner threads: a ``concurrent.futures`` executor whose threads take the
    first-submitted of the `submit_first` calls waiting, then of the `submit` ones.

    A study asks trials ahead of the devices (its lookahead), so new trials' plans are usually
    waiting; work for trials it planned before (a fused group of retries sized at a narrower
    width, a re-plan after an out-of-memory run) would otherwise wait behind all of them while
    those trials, ready to train, leave the devices idle.

    Args:
      max_workers: planner threads.
      thread_name_prefix: their names' prefix.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "") -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self._waiting: list[tuple[int, int, cf.Future, Callable[[], Any]]] = []
        self._order = itertools.count()

    def submit(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> cf.Future:
        """Run ``fn(*args, **kw)`` after the work submitted before it (and any `submit_first`
        work); its future."""
        return self._add(1, lambda: fn(*args, **kw))

    def submit_first(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> cf.Future:
        """As `submit`, ahead of all `submit` work not begun."""
        return self._add(0, lambda: fn(*args, **kw))

    def _add(self, rank: int, call: Callable[[], Any]) -> cf.Future:
        future: cf.Future = cf.Future()
        item = (rank, next(self._order), future, call)
        with self._lock:
            heapq.heappush(self._waiting, item)
        try:  # one thread's turn per call: the turn runs whichever call comes first by then
            self._pool.submit(self._turn)
        except BaseException:  # shut down: the call is not taken (an executor's error)
            with self._lock:
                if item in self._waiting:
                    self._waiting.remove(item)
                    heapq.heapify(self._waiting)
            raise
        return future

    def _turn(self) -> None:
        with self._lock:
            if not self._waiting:  # cancelled by a shutdown
                return
            _, _, future, call = heapq.heappop(self._waiting)
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = call()
        except BaseException as err:  # noqa: BLE001 - the future carries it, as an executor's
            future.set_exception(err)
        else:
            future.set_result(result)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """As `concurrent.futures.Executor.shutdown`: ``cancel_futures`` cancels the work not
        begun."""
        if cancel_futures:
            with self._lock:
                waiting, self._waiting = self._waiting, []
            for _, _, future, _ in waiting:
                future.cancel()
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)
