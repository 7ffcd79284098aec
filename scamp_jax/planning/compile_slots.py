"""At most a few XLA compiles at once in a process: compile work never starves running trials.

A study compiles in several threads: the engine's planner threads (plans, fused groups), and
the trial threads (a run's own step where the planner's is not the run's, as on GPUs where the
run's step is the autotuned compile; initial states; evaluation chunks a plan did not make).
Every one of these compiles takes a slot of `COMPILE_SLOTS` for the length of the XLA compile
itself (`compile_slot`), so however many trials start at once, at most ``limit`` compiles run:
the other cores stay with the trials already training (on a GPU host, their input pipelines
and dispatch; XLA's autotuner also takes the GPU for itself while it runs). The engine sets the
limit to its planner threads while it runs (`CompileSlots.limited`).

A run's own compiles (its thread inside `CompileSlots.for_a_run`) are on its devices' critical
path, where a planner's are for trials that wait anyway: a run's compile takes one slot beyond the
bound when the others are taken (one run at a time; it leaves the bound's slots to the others),
and waiting runs take a freed slot before waiting planners, so a trial about to train never waits
for the plans of trials asked after it (on a GPU, its autotuned step beside their planning
compiles). At most ``limit + 1`` compiles run at once.

A slot is the innermost thing a thread takes (never held while waiting for anything else), so
it cannot deadlock with the caches' own locks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

#: Compiles at once when no engine has set a limit: no bound.
UNBOUNDED = 0


class CompileSlots:
    """A resizable bound on concurrent compiles (``limit`` 0: no bound). Thread-safe."""

    def __init__(self, limit: int = UNBOUNDED) -> None:
        self._cond = threading.Condition()
        self._limit = limit
        self._busy = 0
        #: whether a run's compile holds the slot beyond the bound, and runs waiting for one
        self._over = False
        self._runs_waiting = 0
        self._local = threading.local()
        #: most compiles seen at once (a check for tests and benchmarks)
        self.most = 0

    @property
    def limit(self) -> int:
        """Compiles allowed at once (0: no bound)."""
        return self._limit

    @contextlib.contextmanager
    def for_a_run(self) -> Iterator[None]:
        """The compiles of this thread in the block are a run's (see the module doc)."""
        before, self._local.run = getattr(self._local, "run", False), True
        try:
            yield
        finally:
            self._local.run = before

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot while the block (one compile) runs; waits for a free one (a run's
        compile: or the one beyond the bound)."""
        run = getattr(self._local, "run", False)
        with self._cond:
            self._runs_waiting += run
            try:
                while True:
                    if not self._limit or (self._busy < self._limit
                                           and (run or not self._runs_waiting)):
                        over = False
                        break
                    if run and not self._over:
                        over = self._over = True
                        break
                    self._cond.wait()
            finally:
                self._runs_waiting -= run
            if not over:
                self._busy += 1
            self.most = max(self.most, self._busy + self._over)
        try:
            yield
        finally:
            with self._cond:
                if over:
                    self._over = False
                else:
                    self._busy -= 1
                self._cond.notify_all()  # waiters under any bound see the room

    @contextlib.contextmanager
    def limited(self, limit: int) -> Iterator[None]:
        """Bound compiles to ``limit`` (>= 1) at once while the block runs; the bound before
        comes back after it."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"{limit=} must be an int >= 1 (compiles at once)")
        with self._cond:
            before, self._limit = self._limit, limit
            self.most = 0
            self._cond.notify_all()  # a higher bound lets waiting compiles start now
        try:
            yield
        finally:
            with self._cond:
                self._limit = before
                self._cond.notify_all()


#: The process's compile slots (every compile of the project takes one).
COMPILE_SLOTS = CompileSlots()


def compile_slot() -> contextlib.AbstractContextManager[None]:
    """``with compile_slot(): lowered.compile(...)``: one slot of `COMPILE_SLOTS`."""
    return COMPILE_SLOTS.slot()
