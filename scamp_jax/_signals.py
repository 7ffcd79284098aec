"""Stops held off while a study's bookkeeping runs, so a Ctrl-C never splits it.

A trial is asked in several writes (Optuna creates it, its heartbeat starts, the sampler draws
its parameters, the engine lists it): a ``KeyboardInterrupt`` raised between two of them leaves
a trial running in the study that no one gives back, and a re-run waits for its heartbeat to
lapse. `stops_held` holds SIGINT and SIGTERM while such a step runs on the main thread and
delivers them, to the handlers that were installed, once it is done: the step completes, then
the stop goes on as before. A Ctrl-C while a signal is held is delivered at once, with the
held one first, so pressing Ctrl-C twice still stops a command at once; a repeated SIGTERM is
held as one.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_HELD = (signal.SIGINT, signal.SIGTERM)
_T = TypeVar("_T")


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop), stopping a study as Ctrl-C does (`sigterm_stops`)."""


@contextlib.contextmanager
def sigterm_stops() -> Iterator[None]:
    """While the block runs on the main thread, SIGTERM raises `Terminated`, so a study stops
    as on Ctrl-C (its running trials checkpoint and go back to the study) instead of dying
    with them running; a repeated SIGTERM is ignored while it stops. Only where SIGTERM has
    its default action: a handler the program installed is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL):
        yield
        return
    sent: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if not sent:  # once: the stop then runs its course
            sent.append(signum)
            raise Terminated

    try:
        signal.signal(signal.SIGTERM, stop)
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is stop:  # not one installed meanwhile
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


_RUNNING: list[threading.Event] = []  # set when the work `interruptible` left is done


def left_behind() -> bool:
    """Whether work that `interruptible` was stopped waiting for still runs. The process must
    then end with ``os._exit``: the interpreter's shutdown runs XLA's destructors under a
    compile still running in it (a crash, exit status 139)."""
    _RUNNING[:] = [done for done in _RUNNING if not done.is_set()]
    return bool(_RUNNING)


def interruptible(work: Callable[[], _T], name: str = "work",
                  tick: Callable[[], None] | None = None) -> _T:
    """``work()`` on a daemon thread while the calling (main) thread waits for it: a signal
    handler's exception (Ctrl-C's ``KeyboardInterrupt``) is raised in the main thread at once,
    where it would wait until a compile running there returned (XLA holds the thread; a paper
    SwinIR's compile for a GPU target takes minutes). ``work``'s own exception is raised here;
    off the main thread ``work`` runs in place.

    A stop leaves ``work`` running: it must store nothing a stop could leave half written
    that is not mended later (planning without a study keeps plans in SQLite, whose writes are
    whole or none, and compiled programs in the study's cache, whose next writer removes an
    entry left half written), and the process then ends with ``os._exit`` (`left_behind`).
    ``tick``: called in the waiting thread between waits (every 0.1 s), e.g.
    to pass on a stop `stops_held` holds."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    result: list[_T] = []
    failed: list[BaseException] = []
    done = threading.Event()

    def body() -> None:
        try:
            result.append(work())
        except BaseException as err:  # noqa: BLE001 - raised in the waiting thread
            failed.append(err)
        finally:
            done.set()

    worker = threading.Thread(target=body, name=name, daemon=True)
    _RUNNING.append(done)
    try:
        worker.start()
    except BaseException:
        if worker.ident is None:  # never started: nothing is left running
            _RUNNING.remove(done)
        raise
    # An event's wait with a timeout lets signal handlers run between waits (a thread's join
    # interrupted by one marks the thread stopped while it runs).
    while not done.wait(0.1):
        if tick is not None:
            tick()
    _RUNNING.remove(done)
    if failed:
        raise failed[0]
    return result[0]


@contextlib.contextmanager
def stops_held() -> Iterator[_Holder | None]:
    """Hold SIGINT and SIGTERM while the block runs (see the module doc); a no-op off the main
    thread, where no signal handler runs, and inside another `stops_held`. The block gets the
    holder (`_Holder.held`: the stop it holds), the outer block's inside another, None off the
    main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous: dict[int, Any] = {s: signal.getsignal(s) for s in _HELD}
    outer = next((h for h in previous.values() if isinstance(h, _Holder)), None)
    if outer is not None:  # an outer block holds them
        yield outer
        return
    holder = _Holder(previous)
    try:
        for s, handler in previous.items():
            if handler is not None:  # None: not set from Python, left alone
                signal.signal(s, holder)
        yield holder
    finally:
        holder.restore()
        holder.deliver()


class _Holder:
    """The handler while stops are held: it keeps the signals (a repeated SIGTERM as one)
    and delivers them at once on a Ctrl-C that follows another signal."""

    def __init__(self, previous: dict[int, Any]) -> None:
        self.previous = previous
        self.pending: list[tuple[int, Any]] = []

    def __call__(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and any(s == signum for s, _ in self.pending):
            return  # a scheduler's repeated SIGTERM: one is held already
        self.pending.append((signum, frame))
        if signum == signal.SIGINT and len(self.pending) > 1:  # Ctrl-C again: at once
            self.restore()
            self.deliver()

    def held(self) -> int | None:
        """The stop held: ``signal.SIGTERM`` where one is pending, else ``signal.SIGINT``
        where one is, else None."""
        pending = {s for s, _ in self.pending}
        return next((s for s in (signal.SIGTERM, signal.SIGINT) if s in pending), None)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            if handler is not None and signal.getsignal(s) is self:
                signal.signal(s, handler)

    def deliver(self) -> None:
        """Each pending signal to its previous handler, in order; the first exception one of
        them raises (``KeyboardInterrupt``) is raised once all are delivered."""
        pending, self.pending = self.pending, []
        raised: BaseException | None = None
        for signum, frame in pending:
            handler = self.previous[signum]
            try:
                if callable(handler):
                    handler(signum, frame)
                elif handler == signal.SIG_DFL:
                    signal.raise_signal(signum)  # the default action: it ends the process
            except BaseException as err:  # noqa: BLE001 - raised below, after the others
                raised = raised or err
        if raised is not None:
            raise raised
