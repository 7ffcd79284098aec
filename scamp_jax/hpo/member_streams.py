"""A fused group's data: each member's own stream, drawn into one stacked ``(K, B, ...)`` batch.

A fused step takes every member's next batch at once. Drawn one member after another on the
thread that dispatches the steps, the host's data work grows with the group: eight SwinIR
members at a batch of 4,096 draw 141 MB each per step, and on a GPU the step can be done
before the host is. When the task says its streams share nothing (`parallel_streams`) and one
member's batch takes long enough to draw that handing it to another thread pays
(`PARALLEL_MIN_SECONDS`, the median of `TIMED_DRAWS` draws after the first, which starts the
streams), each member's batch is drawn and copied into its slot of the stacked batch on a
thread of a shared pool, so a group's draws take about one member's time where the host has a
core per member; NumPy's copies and random draws release the interpreter lock. A member's
stream is advanced by one thread at a time, in step order, so every member sees exactly the
batches of its solo run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import jax
import numpy as np

from scamp_jax.scheduling.host import host_cores

PyTree = Any

#: Seconds one member's batch must take to draw, in turn, for the members to be drawn at once:
#: below it, the hand-off to threads and the draws' own Python work (which holds the interpreter
#: lock) leave nothing to gain. On 2 cores (`benchmarks.member_data --width 4`, medians, load 3-4):
#: ViT at batch 32 (1.3 ms a draw) 5.4-5.6 ms at once against 5.0-5.2 ms in turn; SwinIR
#: patches at 32 (1.3 ms) 5.7 against 5.3 ms, at 128 (3.3 ms) 14.4 against 14.0 ms, at 512
#: (11 ms) 55 against 65 ms, at 1,024 (21 ms) 97 against 131 ms.
PARALLEL_MIN_SECONDS = 5e-3

#: Draws timed, in turn, after the first, whose median decides whether the members are drawn at
#: once (one draw alone may meet the first steps on the same cores).
TIMED_DRAWS = 3

#: The attribute by which a task says that its streams of different seeds share no mutable
#: state, so that a run may draw several of them at once on different threads.
PARALLEL_ATTRIBUTE = "parallel_streams"


def parallel_streams(task: Any) -> bool:
    """Whether ``task``'s streams may be drawn at once on several threads (its
    ``parallel_streams`` attribute; absent: no)."""
    return bool(getattr(task, PARALLEL_ATTRIBUTE, False))


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's pool of data threads (one per core it may run on), shared by every fused
    group."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=host_cores(),
                                       thread_name_prefix="member-data")
        return _POOL


class _Handoff:
    """The jobs of one draw made at once. `close` keeps any job from starting after it and
    waits for those running, also through an interruption (e.g. Ctrl-C, raised once they have
    ended), so no stream is advanced once `StackedStreams.draw` has left."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._open = True

    def run(self, fill: Any, slot: int, out: list[np.ndarray]) -> None:
        with self._cond:
            if not self._open:
                return  # the draw was given up before this member's turn: its stream rests
            self._running += 1
        try:
            fill(slot, out)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def close(self) -> None:
        interrupted: BaseException | None = None
        while True:
            try:
                with self._cond:
                    self._open = False
                    while self._running:
                        self._cond.wait()
                break
            except BaseException as err:  # noqa: BLE001 (raised once the jobs have ended)
                interrupted = interrupted or err
        if interrupted is not None:
            raise interrupted


class StackedStreams:
    """The members' streams of a fused group, in slot order; `draw` gives their next batches
    stacked on a leading member axis (numpy, host memory).

    A member whose stream raises (or gives a batch of another structure, shape or dtype) is
    out of the group's data from then on, as a solo run of it would end: its slot holds zeros
    in this and every later draw, `take_failed` gives its error once, and the other members
    draw on, each its solo run's batches.

    Args:
      streams: one endless iterator of batches (pytrees of numpy arrays with equal shapes
        across members) per member.
      parallel: the streams may be drawn at once on the shared data threads (see the module
        doc: after the first `TIMED_DRAWS` + 1 draws, where a member's draw takes
        `PARALLEL_MIN_SECONDS` or more); False: one after another on the calling thread.
    """

    def __init__(self, streams: Sequence[Iterator[PyTree]], parallel: bool) -> None:
        if not streams:
            raise ValueError("a fused group needs at least one member's stream")
        self.streams = list(streams)
        self.parallel = parallel
        #: draws so far; after the first `TIMED_DRAWS` + 1, ``at_once`` says how they are made
        self.draws = 0
        self.at_once = False
        self._times: list[float] = []  # seconds per member of the timed draws
        self._treedef: Any = None
        self._leaves: list[tuple[tuple[int, ...], np.dtype]] = []
        self._dead: set[int] = set()  # slots whose stream failed: zeros from then on
        self._failed: dict[int, BaseException] = {}  # failures `take_failed` has not given

    def draw(self) -> PyTree:
        """Every member's next batch, stacked: leaves ``(K, B, ...)``. Raises only where no
        member's batch was ever drawn (the first draw, every stream failing: the first
        member's error) or for an interruption."""
        self.draws += 1
        width = len(self.streams)
        live = [slot for slot in range(width) if slot not in self._dead]
        if self._treedef is None:
            return self._first_draw(live)
        out = [np.empty((width, *shape), dtype) for shape, dtype in self._leaves]
        for slot in self._dead:
            for target in out:
                target[slot] = 0
        if not self.at_once or len(live) < 2:
            start = time.perf_counter()
            for slot in live:
                try:
                    self._place(slot, next(self.streams[slot]), out)
                except Exception as err:  # noqa: BLE001 - that member's own ending
                    self._fail(slot, err, out)
            if live and 2 <= self.draws <= 1 + TIMED_DRAWS:
                self._times.append((time.perf_counter() - start) / len(live))
                if self.draws == 1 + TIMED_DRAWS:
                    self.at_once = (self.parallel
                                    and float(np.median(self._times)) >= PARALLEL_MIN_SECONDS)
            return jax.tree.unflatten(self._treedef, out)
        handoff = _Handoff()
        jobs: list[tuple[int, Future[None]]] = []
        try:
            for slot in live:
                jobs.append((slot, _pool().submit(handoff.run, self._fill, slot, out)))
            wait([job for _, job in jobs])  # every member's draw ends before this returns
        finally:
            handoff.close()  # interrupted: the draws running end first, the others never start
        for slot, job in jobs:
            failure = job.exception()
            if failure is not None and not isinstance(failure, Exception):
                raise failure  # an interruption in a data thread stops the run, as on this one
            if failure is not None:
                self._fail(slot, failure, out)
        return jax.tree.unflatten(self._treedef, out)

    def _first_draw(self, live: list[int]) -> PyTree:
        """The first draw, in turn: the structure, shapes and dtypes most members' batches
        have (the first member's among equals) are the group's; a member whose batch has
        others is out."""
        batches: dict[int, PyTree] = {}
        errors: dict[int, BaseException] = {}
        for slot in live:
            try:
                batches[slot] = next(self.streams[slot])
            except Exception as err:  # noqa: BLE001 - that member's own ending
                errors[slot] = err
        if not batches:
            first = next(iter(errors.values()))
            for slot, other in list(errors.items())[1:]:
                first.add_note(f"member {slot}'s first draw failed too: {other!r}")
            raise first  # no member has a batch: the group cannot start
        kinds = [_kind(batch) for batch in batches.values()]
        self._treedef, self._leaves = max(kinds, key=kinds.count)  # first among the most
        width = len(self.streams)
        out = [np.zeros((width, *shape), dtype) for shape, dtype in self._leaves]
        for slot, error in errors.items():
            self._fail(slot, error, out)
        for slot, batch in batches.items():
            try:
                self._place(slot, batch, out)
            except Exception as err:  # noqa: BLE001 - that member's own ending
                self._fail(slot, err, out)
        return jax.tree.unflatten(self._treedef, out)

    def _fail(self, slot: int, err: BaseException, out: list[np.ndarray]) -> None:
        """Member ``slot``'s stream failed with ``err``: zeros in its slot from now on."""
        self._dead.add(slot)
        self._failed[slot] = err
        for target in out:
            target[slot] = 0

    def take_failed(self) -> dict[int, BaseException]:
        """The slots whose stream failed since the last call, with their errors (each once)."""
        failed, self._failed = self._failed, {}
        return failed

    def _fill(self, slot: int, out: list[np.ndarray]) -> None:
        """Draw member ``slot``'s next batch into its slot of ``out`` (on a data thread)."""
        self._place(slot, next(self.streams[slot]), out)

    def _place(self, slot: int, batch: PyTree, out: list[np.ndarray]) -> None:
        """Member ``slot``'s ``batch`` into its slot of ``out``, checked against the group's
        structure, shapes and dtypes."""
        leaves, treedef = jax.tree.flatten(batch)
        if treedef != self._treedef or any(
                np.shape(x) != shape or np.asarray(x).dtype != dtype
                for x, (shape, dtype) in zip(leaves, self._leaves, strict=True)):
            got = [(np.shape(x), str(np.asarray(x).dtype)) for x in leaves]
            want = [(shape, str(dtype)) for shape, dtype in self._leaves]
            raise ValueError(
                f"member {slot}'s stream gave a batch of {got} ({treedef}); the group's batches "
                f"are {want} ({self._treedef}): a task's batches must keep their structure, "
                "shapes and dtypes")
        for target, x in zip(out, leaves, strict=True):
            target[slot] = x

    def keep(self, index: Sequence[int] | np.ndarray) -> None:
        """Keep only the streams of slots ``index`` (in that order)."""
        index = [int(i) for i in index]
        self.streams = [self.streams[i] for i in index]
        self._dead = {new for new, old in enumerate(index) if old in self._dead}
        self._failed = {new: self._failed[old] for new, old in enumerate(index)
                        if old in self._failed}


def _kind(batch: PyTree) -> tuple[Any, list[tuple[tuple[int, ...], np.dtype]]]:
    """A batch's structure and its leaves' shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, [(np.shape(x), np.asarray(x).dtype) for x in leaves]
