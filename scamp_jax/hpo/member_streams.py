"""A fused group's data: each member's own stream, drawn into one stacked ``(K, B, ...)`` batch.

A fused step takes every member's next batch at once. Drawn one member after another on the
thread that dispatches the steps, the host's data work grows with the group: eight SwinIR
members at a batch of 4,096 draw 141 MB each per step, and on a GPU the step can be done
before the host is. When the task says its streams share nothing (`parallel_streams`) and one
member's batch takes long enough to draw that handing it to another thread pays
(`PARALLEL_MIN_SECONDS`, judged on the second draw: the first starts the streams), each
member's batch is drawn and copied into its slot of the stacked batch on a thread of a shared
pool, so a group's draws take about one member's time where the host has a core per member;
NumPy's copies and random draws release the interpreter lock. A member's stream is advanced by
one thread at a time, in step order, so every member sees exactly the batches of its solo run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import jax
import numpy as np

from scamp_jax.scheduling.host import host_cores

PyTree = Any

#: Seconds one member's batch must take to draw, in turn, for the members to be drawn at once:
#: below it, handing each draw to a thread costs more than it saves (on 2 cores: 4 SwinIR
#: members at batch 8, 0.3 ms a draw, took 2.7 ms at once against 1.5 ms in turn; 4 ViT
#: members at batch 32, 1.2 ms a draw, 3.9 ms against 5.0 ms; `benchmarks.member_data`).
PARALLEL_MIN_SECONDS = 1e-3

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


class StackedStreams:
    """The members' streams of a fused group, in slot order; `draw` gives their next batches
    stacked on a leading member axis (numpy, host memory).

    Args:
      streams: one endless iterator of batches (pytrees of numpy arrays with equal shapes
        across members) per member.
      parallel: the streams may be drawn at once on the shared data threads (see the module
        doc: from the third draw, where a member's draw takes `PARALLEL_MIN_SECONDS` or more);
        False: one after another on the calling thread.
    """

    def __init__(self, streams: Sequence[Iterator[PyTree]], parallel: bool) -> None:
        if not streams:
            raise ValueError("a fused group needs at least one member's stream")
        self.streams = list(streams)
        self.parallel = parallel
        #: draws so far; from the third, ``at_once`` says how they are made
        self.draws = 0
        self.at_once = False
        self._treedef: Any = None
        self._leaves: list[tuple[tuple[int, ...], np.dtype]] = []

    def draw(self) -> PyTree:
        """Every member's next batch, stacked: leaves ``(K, B, ...)``."""
        self.draws += 1
        if not self.at_once or len(self.streams) < 2:
            start = time.perf_counter()
            batches = [next(s) for s in self.streams]
            if self.draws == 2:
                each = (time.perf_counter() - start) / len(self.streams)
                self.at_once = self.parallel and each >= PARALLEL_MIN_SECONDS
            stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches)
            leaves, self._treedef = jax.tree.flatten(stacked)
            self._leaves = [(x.shape[1:], x.dtype) for x in leaves]
            return stacked
        width = len(self.streams)
        out = [np.empty((width, *shape), dtype) for shape, dtype in self._leaves]
        jobs = [_pool().submit(self._fill, slot, out) for slot in range(width)]
        wait(jobs)  # every stream at rest before an error leaves here: none is advanced later
        for job in jobs:
            job.result()
        return jax.tree.unflatten(self._treedef, out)

    def _fill(self, slot: int, out: list[np.ndarray]) -> None:
        """Draw member ``slot``'s next batch into its slot of ``out`` (a data thread)."""
        leaves, treedef = jax.tree.flatten(next(self.streams[slot]))
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
        self.streams = [self.streams[int(i)] for i in index]
