"""One Optuna study shared by MPI ranks: rank 0 owns it and serves work, every rank runs trials.

Rank 0 holds the study and its storage (nothing else needs a database). A `StudyServer` runs
in a background thread of rank 0 and answers the other ranks' messages (mpi4py, host side):

==================================================  =============================================
request (worker -> rank 0)                           answer (rank 0 -> worker)
==================================================  =============================================
``("ask", None)``                                    ``("trial", number, params, checkpoint_key,
                                                     siblings, sibling_of, retry_of, lines)``,
                                                     ``("later", seconds, trials, lines)`` (ask
                                                     again then) or ``("done", lines)`` (the
                                                     worker is finished); ``lines``: those of
                                                     the trials ``suggest`` pruned for it
``("ask", "more")``                                  the same, but ``"done"`` does not finish the
                                                     worker: it still reports and tells
``("report", (number, step, value))``                ``("pruned", should_prune)``
``("tell", (number, value, state[, attrs, reason]))``  ``("told",)``
``("interrupt", (number, wall_seconds))``            ``("interrupted",)``
``("progress", (number, wall_seconds))``             ``("stored",)``
``("remaining", None)``                              ``("remaining", count)``
``("held", proposal)``                               ``("held", count)``: siblings of trial
                                                     ``proposal`` not handed out yet
``("trained", devices)``                             ``("trained", bool)``: whether a trial of
                                                     the study trained on at most ``devices``
                                                     devices, in any run
``("bye", None)``                                    ``("bye",)`` (the worker is finished)
==================================================  =============================================

Every rank, rank 0 included, uses the same client interface (`StudyClient`): rank 0's client
calls the server directly under its lock, the others' send messages. The server is a thin
message layer over rank 0's `scamp_jax.hpo.study.OptunaTrialSource`, which does all the study's
work: ``ask`` runs the search space's ``suggest(trial)`` on rank 0 and records the asking rank in
the trial's user attribute ``rank``; trials stop being handed out once ``n_trials`` are finished or
running (in any process sharing the storage), counting trials finished in an earlier run, so
restarting the same command resumes the study and loses no finished trial. Trials of a dead job
are recovered as the trial source recovers them: by the heartbeat of a study opened with
`scamp_jax.hpo.study.open_study`, or at once (``recover_running``) for a study without one; a
retry keeps its original's parameters and checkpoint key, so the restart resumes it from its last
checkpoint. While a dead job's trials are still running in the storage (their heartbeat not stale
yet), a rank that finds nothing else to run is answered ``"later"``, not ``"done"``: the restart
runs their retries too and ends with exactly ``n_trials``.

Fused groups (``siblings``, see `OptunaTrialSource`): the source holds the siblings of a trial
the sampler proposed for the rank that got the proposal (each rank is an asker of its own), so
that its engine can fuse them. Other ranks never get them, and a new proposal for another rank
counts them as taken, so the study still runs exactly ``n_trials``. A rank that is told done
gives its held siblings up.

A rank that dies (its process ends without ``MPI_Finalize``) makes ``mpirun`` end the whole
job (Open MPI's default), so no rank waits forever for a server that is gone. A rank whose
Python code raises is another matter: it still finalizes MPI as it exits, and the others (rank
0's server among them) wait for it forever. Run every rank's part of the study (`shared_study`
and the trials) inside ``with failures_end_every_rank(comm):``
(`scamp_jax.distributed.failures_end_every_rank`), which prints ``rank R failed: ...`` and
aborts the job instead; `run_search_mpi` guards its ranks so.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scamp_jax._signals import stops_held
from scamp_jax.distributed.mpi import import_mpi4py
from scamp_jax.hpo.study import AskLater, OptunaTrialSource, TrialOutcome

# Tags of the study's messages: requests to rank 0 and answers from it. Distinct from any tag
# the pipeline or data-parallel code uses, and the server works on its own duplicate of the
# communicator anyway.
REQUEST_TAG, REPLY_TAG = 301, 302
#: Optuna state names the messages carry -> `TrialOutcome` states.
_OUTCOME = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}


@dataclass(frozen=True)
class WorkItem:
    """A trial handed to a rank: its Optuna ``number``, the suggested ``params`` and the
    ``checkpoint_key`` (directory name of its checkpoints; a re-run keeps its predecessor's), and
    as in `scamp_jax.hpo.study.AskedTrial` the ``siblings`` enqueued for it (fusion), the
    trial it is a ``sibling_of`` and the trial it is a ``retry_of``."""

    number: int
    params: dict[str, Any]
    checkpoint_key: str = ""
    siblings: int = 0
    sibling_of: int | None = None
    retry_of: int | None = None


class StudyServer:
    """Rank 0's side: serves its trial source's study to the other ranks (see module doc).

    Args:
      source: the `scamp_jax.hpo.study.OptunaTrialSource` over the study (only rank 0 touches
        the study): its ``n_trials``, heartbeat, ``root`` and fusion ``siblings`` hold for every
        rank. Trials a dead job left ``RUNNING`` are recovered as the source recovers them: by
        the heartbeat of a study opened by `scamp_jax.hpo.study.open_study` (never touching
        the trials of other live jobs), or at once for a source built with
        ``recover_running=True``.
      comm: mpi4py communicator of the ranks that run trials (default ``MPI.COMM_WORLD``);
        the server works on a duplicate of it.
      poll_seconds: sleep between checks for a request, so the serving thread leaves the
        CPU to rank 0's own trial (a blocking MPI receive would spin on a core).
    """

    def __init__(self, source: OptunaTrialSource, *, comm: Any = None,
                 poll_seconds: float = 0.005):
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
        self.source = source
        self.study, self.n_trials = source.study, source.n_trials
        self.comm = base.Dup()
        self.poll_seconds = poll_seconds
        self.stale_failed = list(self.source.recovered)
        self._already = self.source.finished()
        self._open_workers = base.Get_size() - 1
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def finished_before(self) -> int:
        """Trials of the storage that counted towards ``n_trials`` when the server started."""
        return self._already

    # -- the operations (thread-safe: the trial source locks) ------------------------------------
    def remaining(self) -> int:
        """Trials still to hand out before the study reaches ``n_trials``."""
        return self.source.remaining()

    def held_siblings(self, proposal: int) -> int:
        """Siblings of trial ``proposal`` still held for its rank, not handed out yet."""
        return self.source.held_siblings(proposal)

    def trained_any(self, devices: int) -> bool:
        """Whether a trial of the study trained on at most ``devices`` devices, in any run."""
        return self.source.trained_any(devices)

    def ask(self, rank: int) -> WorkItem | AskLater | None:
        """Next trial for ``rank`` (a queued re-run first, then its held siblings), or None once
        ``n_trials`` are finished, handed out or held for other ranks. `AskLater`: nothing now,
        but a dead job's trials still run in the storage and may need a retry."""
        asked = self.source.ask(attrs={"rank": rank}, asker=rank)
        if isinstance(asked, AskLater):
            return asked
        if asked is None:  # the rank is done: the siblings held for it (if any) are free
            self.source.release(rank)
            return None
        return WorkItem(asked.number, dict(asked.params), asked.checkpoint_key,
                        asked.siblings, asked.sibling_of, asked.retry_of)

    def take_rejected(self, rank: int) -> list[str]:
        """The lines of the trials the space's ``suggest`` pruned while ``rank`` asked (see
        `OptunaTrialSource.take_rejected`), for that rank's engine to say."""
        return self.source.take_rejected(rank)

    def report(self, number: int, step: int, value: float) -> bool:
        """Record an intermediate ``value`` at ``step``; returns the pruner's verdict."""
        self._check(number)
        return bool(self.source.report(number, step, value))

    def tell(
        self,
        number: int,
        value: float | None,
        state: str = "COMPLETE",
        attrs: dict[str, Any] | None = None,
        reason: str = "",
    ) -> None:
        """Finish trial ``number``: ``state`` is ``COMPLETE`` (with ``value``), ``PRUNED`` or
        ``FAIL``; ``attrs`` (JSON-serialisable) are stored as user attributes and ``reason`` as
        the trial's fail reason."""
        self._check(number)
        if state not in _OUTCOME:
            raise ValueError(f"{state=} is not a trial outcome; use one of {', '.join(_OUTCOME)}")
        self.source.tell(TrialOutcome(number, _OUTCOME[state],
                                      value if state == "COMPLETE" else None, reason,
                                      dict(attrs or {})))

    def progress(self, number: int, wall_seconds: float) -> None:
        """Store a running trial's seconds up to its newest checkpoint
        (`OptunaTrialSource.progress`)."""
        self.source.progress(number, wall_seconds)

    def interrupt(self, number: int, wall_seconds: float = 0.0) -> None:
        """Fail a handed-out trial as interrupted (it does not count towards ``n_trials``) and
        queue its parameters under its checkpoint key, so a later ask re-runs it
        (``wall_seconds``: `OptunaTrialSource.interrupt`)."""
        self.source.interrupt(number, wall_seconds)

    def _check(self, number: int) -> None:
        if not self.source.is_live(number):
            raise ValueError(
                f"trial {number} was not handed out by this server or is already told; "
                f"running: {self.source.live_numbers()}"
            )

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

    def close(self) -> None:
        """Stop the trials' heartbeat (after the last tell)."""
        self.source.close()

    def _serve(self) -> None:
        mpi = import_mpi4py()
        try:
            while self._open_workers > 0:
                status = mpi.Status()
                # A matched probe, then a receive of that message at its own size: mpi4py's
                # irecv without a buffer receives into 32 KiB, and a longer request (a failed
                # trial's tell with its traceback) would overrun it.
                while (matched := self.comm.improbe(source=mpi.ANY_SOURCE, tag=REQUEST_TAG,
                                                    status=status)) is None:
                    time.sleep(self.poll_seconds)
                msg, asker = matched.recv(), status.Get_source()
                try:
                    answer = self._answer(asker, msg)
                except Exception as err:  # noqa: BLE001 - e.g. the space's suggest raised
                    # The asking rank raises it and ends the job saying it (rank 0 would
                    # abort silently from this thread).
                    answer = ("error", _sendable(err, asker, msg[0]))
                self.comm.send(answer, asker, tag=REPLY_TAG)
        except BaseException as err:  # surfaced by join(); the thread must not die silently
            self._error = err
            print(f"rank 0's study server failed: {type(err).__name__}: {err}",
                  file=sys.stderr, flush=True)
            self.comm.Abort(1)

    def _answer(self, rank: int, msg: tuple[str, Any]) -> tuple[Any, ...]:
        kind, body = msg
        if kind == "ask":  # each answer ends with the lines of trials suggest pruned
            item = self.ask(rank)
            rejected = self.take_rejected(rank)
            if isinstance(item, AskLater):
                return ("later", item.seconds, item.trials, rejected)
            if item is None:
                if body != "more":  # a plain asker is finished once the study is full
                    self._open_workers -= 1
                return ("done", rejected)
            return ("trial", item.number, item.params, item.checkpoint_key, item.siblings,
                    item.sibling_of, item.retry_of, rejected)
        if kind == "report":
            return ("pruned", self.report(*body))
        if kind == "tell":
            self.tell(*body)
            return ("told",)
        if kind == "interrupt":
            self.interrupt(*body)
            return ("interrupted",)
        if kind == "progress":
            self.progress(*body)
            return ("stored",)
        if kind == "remaining":
            return ("remaining", self.remaining())
        if kind == "held":
            return ("held", self.held_siblings(int(body)))
        if kind == "trained":
            return ("trained", self.trained_any(int(body)))
        if kind == "bye":
            self._open_workers -= 1
            return ("bye",)
        raise ValueError(f"unknown study request {kind!r} from rank {rank}")


def _sendable(err: Exception, rank: int, kind: str) -> Exception:
    """``err``, raised on rank 0 while it answered ``rank``'s ``kind`` request, as that rank
    raises it: itself where it pickles (its type and words kept: a `ValueError` is still a
    usage error), else a `RuntimeError` with its words; a note says where it came from."""
    from scamp_jax.hpo.trial import ending

    where = ending(err)[1]
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - an exception of the user's that does not pickle
        err = RuntimeError(where)
    err.add_note(f"raised on rank 0 while it answered rank {rank}'s {kind!r} request: "
                 f"{where}")
    return err


class StudyClient:
    """A rank's handle on the shared study: ``ask`` / ``report`` / ``tell``.

    Build it with `StudyClient.local` on rank 0 (calls the server directly) or
    `StudyClient.remote` on the other ranks (messages to rank 0).
    """

    def __init__(self, rank: int, server: StudyServer | None, comm: Any):
        self.rank, self._server, self._comm = rank, server, comm
        self._rejected: list[str] = []  # `take_rejected`
        # Trial threads report concurrently; one request-answer pair at a time keeps each
        # answer with its request (answers carry no request id).
        self._call_lock = threading.Lock()
        self._closed = False

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

    @stops_held()  # a Ctrl-C between the request and its reply would leave the reply unread
    def _call(self, kind: str, body: Any) -> tuple[Any, ...]:
        with self._call_lock:
            if self._closed:
                raise RuntimeError(
                    f"rank {self.rank}'s study client is closed (rank 0 no longer serves it); "
                    f"a {kind!r} request must come before close()"
                )
            self._comm.send((kind, body), 0, tag=REQUEST_TAG)
            answer = self._comm.recv(source=0, tag=REPLY_TAG)
        if answer[0] == "error":  # rank 0 raised it while it answered (`_sendable`)
            raise answer[1]
        return answer

    def ask(self, *, keep_open: bool = False) -> WorkItem | AskLater | None:
        """The next trial to run, or None when the study needs no more.

        By default a None also tells rank 0 that this rank is finished, and an answer "ask again
        later" (a dead job's trials may still need retries) is waited out here. With
        ``keep_open`` that answer is returned as `AskLater`, the rank may still report and tell
        trials it holds, and calls `close` when it is done.
        """
        while True:
            if self._server is not None:
                item = self._server.ask(self.rank)
                self._rejected += self._server.take_rejected(self.rank)
            else:
                answer = self._call("ask", "more" if keep_open else None)
                self._rejected += answer[-1]
                if answer[0] == "done":
                    if not keep_open:
                        self._closed = True
                    return None
                item = (AskLater(float(answer[1]), tuple(answer[2])) if answer[0] == "later"
                        else WorkItem(*answer[1:-1]))
            if not isinstance(item, AskLater) or keep_open:
                return item
            time.sleep(item.seconds)

    def take_rejected(self) -> list[str]:
        """The lines of the trials the space's ``suggest`` pruned while this rank asked, not
        taken before (rank 0 ran ``suggest``; its answers carry them)."""
        lines, self._rejected = self._rejected, []
        return lines

    def report(self, number: int, step: int, value: float) -> bool:
        """Report an intermediate value; True when the trial should be pruned."""
        if self._server is not None:
            return self._server.report(number, step, value)
        return bool(self._call("report", (number, step, float(value)))[1])

    def tell(
        self,
        number: int,
        value: float | None,
        state: str = "COMPLETE",
        attrs: dict[str, Any] | None = None,
        reason: str = "",
    ) -> None:
        """Finish a trial (``COMPLETE`` with its value, ``PRUNED`` or ``FAIL``), storing
        ``attrs`` as user attributes and ``reason`` as its fail reason."""
        if self._server is not None:
            self._server.tell(number, value, state, attrs, reason)
            return
        self._call("tell", (number, None if value is None else float(value), state,
                            dict(attrs or {}), reason))

    def progress(self, number: int, wall_seconds: float) -> None:
        """Store a running trial's seconds up to its newest checkpoint in rank 0's study."""
        if self._server is not None:
            self._server.progress(number, wall_seconds)
            return
        self._call("progress", (number, float(wall_seconds)))

    def interrupt(self, number: int, wall_seconds: float = 0.0) -> None:
        """Give a started trial back unfinished: failed as interrupted and enqueued again
        (``wall_seconds``: what its runs took so far)."""
        if self._server is not None:
            self._server.interrupt(number, wall_seconds)
            return
        self._call("interrupt", (number, float(wall_seconds)))

    def remaining(self) -> int:
        """Trials the study has still to hand out (to any rank)."""
        if self._server is not None:
            return self._server.remaining()
        return int(self._call("remaining", None)[1])

    def held_siblings(self, proposal: int) -> int:
        """Siblings of trial ``proposal`` rank 0 still holds for this rank (not handed out)."""
        if self._server is not None:
            return self._server.held_siblings(proposal)
        return int(self._call("held", int(proposal))[1])

    def trained_any(self, devices: int) -> bool:
        """Whether a trial of the study trained on at most ``devices`` devices, in any run
        (`OptunaTrialSource.trained_any`)."""
        if self._server is not None:
            return self._server.trained_any(devices)
        return bool(self._call("trained", int(devices))[1])

    def close(self) -> None:
        """Tell rank 0 this rank needs nothing more (after ``ask(keep_open=True)``)."""
        if self._server is not None or self._closed:
            return
        self._call("bye", None)
        self._closed = True


def release_study(client: StudyClient, server: StudyServer | None) -> None:
    """Free the communicator the shared study duplicated, on every rank (collective, like
    `shared_study`): call it on each rank once rank 0's ``server.join()`` has returned and every
    other rank's client is closed, so that no study message is in flight. Afterwards the server
    still records trials (``tell``) but serves no rank, and a remote client refuses requests."""
    mpi = import_mpi4py()
    if server is not None:
        if server._thread is not None and server._thread.is_alive():
            raise RuntimeError("release_study before the study server finished serving: "
                               "call server.join() first")
        comm, server.comm = server.comm, mpi.COMM_NULL
    else:
        if not client._closed:
            raise RuntimeError(f"release_study before rank {client.rank}'s study client was "
                               "closed: call client.close() (or ask until None) first")
        comm, client._comm = client._comm, mpi.COMM_NULL
    if comm is not None and comm != mpi.COMM_NULL:
        comm.Free()


def shared_study(
    make_source: Callable[[], OptunaTrialSource],
    comm: Any = None,
) -> tuple[StudyClient, StudyServer | None]:
    """Set up the shared study on every rank (collective).

    Rank 0 calls ``make_source()`` (the trial source over the created or loaded study), starts
    the `StudyServer` and returns ``(local client, server)``; the others return
    ``(remote client, None)``. When its own trials are done, rank 0 calls ``server.join()``.
    Run it and the trials inside ``with failures_end_every_rank(comm):`` on every rank: an
    exception on one rank (in the objective, say) otherwise leaves the others, and rank 0's
    ``server.join()``, waiting forever (see the module docstring).
    """
    mpi = import_mpi4py()
    comm = mpi.COMM_WORLD if comm is None else comm
    if comm.Get_rank() == 0:
        server = StudyServer(make_source(), comm=comm).start()
        return StudyClient.local(server), server
    return StudyClient.remote(comm), None
