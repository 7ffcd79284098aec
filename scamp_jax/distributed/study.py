"""One Optuna study shared by MPI ranks: rank 0 owns it and serves work, every rank runs trials.

Rank 0 holds the study and its storage (nothing else needs a database). A `StudyServer` runs
in a background thread of rank 0 and answers the other ranks' messages (mpi4py, host side):

========================================  ============================================
request (worker -> rank 0)                 answer (rank 0 -> worker)
========================================  ============================================
``("ask", None)``                          ``("trial", number, params)`` or ``("done",)``
``("report", (number, step, value))``      ``("pruned", should_prune)``
``("tell", (number, value, state))``       ``("told",)``
========================================  ============================================

Every rank, rank 0 included, uses the same client interface (`StudyClient`): rank 0's client
calls the server directly under its lock, the others' send messages. ``ask`` runs the search
space's ``suggest(trial)`` on rank 0 and records the asking rank in the trial's user attribute
``rank``. The study stops handing out trials once ``n_trials`` are finished or running, counting
trials finished in an earlier run of the same storage, so restarting the same command resumes
the study and loses no finished trial.

A rank that dies makes ``mpirun`` end the whole job (Open MPI's default), so no rank waits
forever for a server that is gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scamp_jax.distributed.mpi import import_mpi4py

# Tags of the study's messages: requests to rank 0 and answers from it. Distinct from any tag
# the pipeline or data-parallel code uses, and the server works on its own duplicate of the
# communicator anyway.
REQUEST_TAG, REPLY_TAG = 301, 302
_FINISHED = ("COMPLETE", "PRUNED")


@dataclass(frozen=True)
class WorkItem:
    """A trial handed to a rank: its Optuna ``number`` and the suggested ``params``."""

    number: int
    params: dict[str, Any]


class StudyServer:
    """Rank 0's side: owns the Optuna ``study`` and answers the other ranks (see module doc).

    Args:
      study: the Optuna study (any storage; only rank 0 touches it).
      suggest: ``suggest(trial) -> params``: the search space's define-by-run sampling.
      n_trials: total trials of the study, counting those finished in earlier runs.
      comm: mpi4py communicator of the ranks that run trials (default ``MPI.COMM_WORLD``);
        the server works on a duplicate of it.
      poll_seconds: sleep between checks for a request, so the serving thread leaves the
        CPU to rank 0's own trial (a blocking MPI receive would spin on a core).
      fail_stale: mark trials that a previous run left ``RUNNING`` (its job died) as ``FAIL``
        when the server starts, so they are neither counted nor left dangling; turn off when
        other jobs run trials of the same study at the same time.
    """

    def __init__(
        self,
        study: Any,
        suggest: Callable[[Any], dict[str, Any]],
        n_trials: int,
        *,
        comm: Any = None,
        poll_seconds: float = 0.005,
        fail_stale: bool = True,
    ):
        mpi = import_mpi4py()
        base = mpi.COMM_WORLD if comm is None else comm
        if base.Get_rank() != 0:
            raise ValueError(
                f"StudyServer runs on rank 0, not rank {base.Get_rank()}; other ranks use "
                "StudyClient.remote()"
            )
        if base.Get_size() > 1 and mpi.Query_thread() < mpi.THREAD_MULTIPLE:
            raise RuntimeError(
                "the study server answers from a background thread and needs MPI initialised "
                "with MPI_THREAD_MULTIPLE; do not set mpi4py.rc.threads = False or "
                "mpi4py.rc.thread_level below 'multiple'"
            )
        self.study, self.suggest, self.n_trials = study, suggest, n_trials
        self.comm = base.Dup()
        self.poll_seconds = poll_seconds
        self._lock = threading.Lock()
        self._handed = 0
        self._running: dict[int, Any] = {}  # trial number -> optuna.Trial handed out
        self._open_workers = base.Get_size() - 1
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        import optuna

        self._optuna = optuna
        trials = study.get_trials(deepcopy=False)
        self.stale_failed = [t.number for t in trials if t.state.name == "RUNNING"]
        if fail_stale:
            for number in self.stale_failed:
                study.tell(number, state=optuna.trial.TrialState.FAIL)
        else:
            self.stale_failed = []
        self._already = sum(t.state.name in _FINISHED for t in trials)

    # -- the operations (thread-safe) --------------------------------------------------------
    def _trial(self, number: int) -> Any:
        if number not in self._running:
            raise ValueError(
                f"trial {number} was not handed out by this server or is already told; "
                f"running: {sorted(self._running)}"
            )
        return self._running[number]

    def ask(self, rank: int) -> WorkItem | None:
        """Next trial for ``rank``, or None once ``n_trials`` are finished or handed out."""
        with self._lock:
            if self._already + self._handed >= self.n_trials:
                return None
            trial = self.study.ask()
            params = self.suggest(trial)
            trial.set_user_attr("rank", rank)
            self._running[trial.number] = trial
            self._handed += 1
            return WorkItem(trial.number, dict(params))

    def report(self, number: int, step: int, value: float) -> bool:
        """Record an intermediate ``value`` at ``step``; returns the pruner's verdict."""
        with self._lock:
            trial = self._trial(number)
            trial.report(value, step)
            return bool(trial.should_prune())

    def tell(self, number: int, value: float | None, state: str = "COMPLETE") -> None:
        """Finish trial ``number``: ``state`` is ``COMPLETE`` (with ``value``), ``PRUNED`` or
        ``FAIL``."""
        with self._lock:
            st = self._optuna.trial.TrialState[state]
            trial = self._trial(number)
            del self._running[number]
            self.study.tell(trial, value if st.name == "COMPLETE" else None, state=st)

    # -- serving ------------------------------------------------------------------------------
    def start(self) -> StudyServer:
        """Answer the other ranks from a background thread until each has been told done."""
        if self._open_workers == 0:
            return self
        self._thread = threading.Thread(target=self._serve, name="study-server", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        """Wait until every other rank has been told done; re-raise a failure of the server."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"study server still serving after {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"the study server failed: {self._error!r}") from self._error

    def _serve(self) -> None:
        mpi = import_mpi4py()
        try:
            while self._open_workers > 0:
                status = mpi.Status()
                req = self.comm.irecv(source=mpi.ANY_SOURCE, tag=REQUEST_TAG)
                while True:
                    done, msg = req.test(status)
                    if done:
                        break
                    time.sleep(self.poll_seconds)
                self.comm.send(self._answer(status.Get_source(), msg), status.Get_source(),
                               tag=REPLY_TAG)
        except BaseException as err:  # surfaced by join(); the thread must not die silently
            self._error = err
            self.comm.Abort(1)

    def _answer(self, rank: int, msg: tuple[str, Any]) -> tuple[Any, ...]:
        kind, body = msg
        if kind == "ask":
            item = self.ask(rank)
            if item is None:
                self._open_workers -= 1
                return ("done",)
            return ("trial", item.number, item.params)
        if kind == "report":
            return ("pruned", self.report(*body))
        if kind == "tell":
            self.tell(*body)
            return ("told",)
        raise ValueError(f"unknown study request {kind!r} from rank {rank}")


class StudyClient:
    """A rank's handle on the shared study: ``ask`` / ``report`` / ``tell``.

    Build it with `StudyClient.local` on rank 0 (calls the server directly) or
    `StudyClient.remote` on the other ranks (messages to rank 0).
    """

    def __init__(self, rank: int, server: StudyServer | None, comm: Any):
        self.rank, self._server, self._comm = rank, server, comm

    @classmethod
    def local(cls, server: StudyServer) -> StudyClient:
        """Rank 0's client."""
        return cls(0, server, None)

    @classmethod
    def remote(cls, comm: Any = None) -> StudyClient:
        """Client of a rank other than 0 (collective with the server's communicator
        duplication: rank 0 must build its `StudyServer` at the same point)."""
        mpi = import_mpi4py()
        base = mpi.COMM_WORLD if comm is None else comm
        return cls(base.Get_rank(), None, base.Dup())

    def _call(self, kind: str, body: Any) -> tuple[Any, ...]:
        self._comm.send((kind, body), 0, tag=REQUEST_TAG)
        return self._comm.recv(source=0, tag=REPLY_TAG)

    def ask(self) -> WorkItem | None:
        """The next trial to run, or None when the study needs no more."""
        if self._server is not None:
            return self._server.ask(self.rank)
        answer = self._call("ask", None)
        return None if answer[0] == "done" else WorkItem(answer[1], answer[2])

    def report(self, number: int, step: int, value: float) -> bool:
        """Report an intermediate value; True when the trial should be pruned."""
        if self._server is not None:
            return self._server.report(number, step, value)
        return bool(self._call("report", (number, step, float(value)))[1])

    def tell(self, number: int, value: float | None, state: str = "COMPLETE") -> None:
        """Finish a trial (``COMPLETE`` with its value, ``PRUNED`` or ``FAIL``)."""
        if self._server is not None:
            self._server.tell(number, value, state)
            return
        self._call("tell", (number, None if value is None else float(value), state))


def shared_study(
    make_study: Callable[[], Any],
    suggest: Callable[[Any], dict[str, Any]],
    n_trials: int,
    comm: Any = None,
) -> tuple[StudyClient, StudyServer | None]:
    """Set up the shared study on every rank (collective).

    Rank 0 calls ``make_study()`` (create or load the study from its storage), starts the
    `StudyServer` and returns ``(local client, server)``; the others return
    ``(remote client, None)``. When its own trials are done, rank 0 calls ``server.join()``.
    """
    mpi = import_mpi4py()
    comm = mpi.COMM_WORLD if comm is None else comm
    if comm.Get_rank() == 0:
        server = StudyServer(make_study(), suggest, n_trials, comm=comm).start()
        return StudyClient.local(server), server
    return StudyClient.remote(comm), None
