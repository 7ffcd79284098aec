"""An HPO study across MPI ranks: every rank runs the ordinary `SearchEngine` on its own devices.

    mpirun -n 2 python -m experiments.swinir_hpo --preset smoke

Rank 0 owns the Optuna study and its storage and serves it to the other ranks
(`scamp_jax.distributed.study`); each rank, rank 0 included, plans, places and runs trials on
its local devices with the same planner and placement policy, asking rank 0 for work through a
`RemoteTrialSource` (the `TrialSource` the engine already talks to). ``settings.trials`` stays
the study's total across all ranks. When every rank is done, rank 0 writes ``results.json`` /
``results.csv`` / plots from the storage (the plots over every rank's devices, rank 0's first);
each trial's ``rank`` is a user attribute of the trial.
Plans persist in ``<study_dir>/plans.sqlite`` (`scamp_jax.PlanCache`), shared by the ranks
(SQLite transactions, safe for concurrent writers): a rank that finds an architecture already
planned for its device count and budget, by another rank or an earlier run, compiles nothing to
plan it. The ranks must see one study directory (one host, or a shared file system).

A trial runs on the devices of one rank whenever its plan fits there. A configuration whose
ScaMP plan cannot reach ``settings.min_batch_size`` on all of one rank's devices spans ranks:
the rank defers it, and once every rank has finished its local trials the deferred ones train
data-parallel across the fewest ranks that hold the batch, one device per rank, gradients
averaged by mpi4jax inside the jitted step (`scamp_jax.distributed.spanning`). Its ``rank`` in
``results.json`` lists every rank it ran on. Checkpoints go to ``<study_dir>/checkpoints``,
which every rank must see (one host, or a shared file system) for a re-run on another rank to
resume from them.

A job that dies (a rank killed, ``mpirun`` ended) is resumed by the same command. Trials the dead
job left running are failed and queued again once their heartbeat is older than the grace period
(``settings.grace_period``, default `scamp_jax.hpo.settings.GRACE_PERIOD` s, as on one host); until
then a rank with nothing else to run is told to ask again later, not that the study is done, so
the re-run ends with exactly ``settings.trials`` finished trials.

Fused groups (``settings.fuse``, as `scamp_jax.hpo.session.StudySession` wires it): rank 0's
trial source holds the siblings of each trial the sampler proposes for the rank that got the
proposal (`scamp_jax.distributed.study`), and each rank's engine fuses only its own trials;
``fused_group`` and ``fusion_width`` are user attributes of each trial, so ``results.json`` has
them as on one host. Trials that span ranks are never fused.

Faults: an exception on any rank prints ``rank R failed: ...`` and aborts the whole job
(``MPI_Abort``), as does a rank whose own trials all failed alike (its
`scamp_jax.hpo.failures` guard: each rank's engine keeps one); a rank that dies makes
``mpirun`` end the job and name the rank. Trials that were running stay ``RUNNING`` in the
storage; running the same command again fails them as interrupted, enqueues their parameters
under their checkpoint keys and completes the study without losing any finished trial.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from scamp_jax._signals import Terminated, stops_held
from scamp_jax.distributed.data_parallel import mpi_mean_bytes
from scamp_jax.distributed.mpi import end_every_rank, import_mpi4py
from scamp_jax.distributed.spanning import (
    SpanningRun,
    SpanningTrial,
    run_spanning_trials,
    span_plan,
    spanning_outcome,
)
from scamp_jax.distributed.study import StudyClient, release_study, shared_study
from scamp_jax.hpo.engine import SearchEngine, TrialDeferred
from scamp_jax.hpo.failures import RepeatedFailureError
from scamp_jax.hpo.overhead import combined_overhead, held_wait_device_seconds
from scamp_jax.hpo.plan_service import PlanningService
from scamp_jax.hpo.runner import make_optimizer
from scamp_jax.hpo.study.trials import AskedTrial, AskLater, TrialOutcome
from scamp_jax.planning import planner
from scamp_jax.planning.train_step import abstract_state

_OPTUNA_STATE = {"complete": "COMPLETE", "pruned": "PRUNED", "failed": "FAIL"}


class RemoteTrialSource:
    """`scamp_jax.hpo.study.TrialSource` over a `StudyClient`: the study lives on rank 0.

    On rank 0 the client calls the `StudyServer` directly; on other ranks every call is one
    mpi4py message to rank 0 and its answer. Call `close` once the engine has finished, so that
    rank 0 stops serving this rank.
    """

    def __init__(self, client: StudyClient) -> None:
        self.client = client

    @property
    def rank(self) -> int:
        """The MPI rank this source asks for."""
        return self.client.rank

    def remaining(self) -> int:
        """Trials the study has still to hand out, to any rank."""
        return self.client.remaining()

    def ask(self) -> AskedTrial | AskLater | None:
        """Next configuration for this rank; `AskLater` while a dead job's trials may still need
        retries; ``None`` once the study has all its trials."""
        item = self.client.ask(keep_open=True)
        if item is None or isinstance(item, AskLater):
            return item
        return AskedTrial(item.number, dict(item.params),
                          item.checkpoint_key or f"trial_{item.number}",
                          siblings=item.siblings, sibling_of=item.sibling_of,
                          retry_of=item.retry_of)

    def take_rejected(self) -> list[str]:
        """The lines of the trials the space's ``suggest`` pruned for this rank (rank 0 ran
        it), for this rank's engine to say, as one process's engine says them."""
        return self.client.take_rejected()

    def report(self, number: int, step: int, value: float) -> bool:
        """Record ``value`` at ``step`` in rank 0's study; True if the pruner stops the trial."""
        return self.client.report(number, step, float(value))

    def tell(self, outcome: TrialOutcome) -> None:
        """Store the outcome (state, value, reason, attributes) in rank 0's study."""
        self.client.tell(outcome.number, outcome.value, _OPTUNA_STATE[outcome.state],
                         dict(outcome.attrs), outcome.reason)

    def progress(self, number: int, wall_seconds: float) -> None:
        """Store a running trial's seconds up to its newest checkpoint in rank 0's study."""
        self.client.progress(number, float(wall_seconds))

    def interrupt(self, number: int, wall_seconds: float = 0.0) -> None:
        """Give a started trial back: failed as interrupted and enqueued again on rank 0
        (``wall_seconds``: what its runs took so far)."""
        self.client.interrupt(number, wall_seconds)

    def held_siblings(self, proposal: int) -> int:
        """Siblings of trial ``proposal`` rank 0 still holds for this rank."""
        return self.client.held_siblings(proposal)

    def trained_any(self, devices: int) -> bool:
        """Whether a trial of the study trained on at most ``devices`` devices, in any run
        (rank 0's study)."""
        return self.client.trained_any(devices)

    def close(self) -> None:
        """Tell rank 0 that this rank asks, reports and tells nothing more."""
        self.client.close()


class SpanningPlanningService(PlanningService):
    """The planning service of one of ``ranks`` MPI ranks: a configuration that fits none of
    this rank's device counts at ``config.min_batch_size`` but does on several ranks with one
    device each raises `TrialDeferred` with its `SpanPlan` (cached per architecture by
    `PlanningService.plan`)."""

    def __init__(self, ranks: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranks = ranks

    def smallest_fitting_plan(self, model: Any, max_batch: int | None,
                              run_ready: bool = True,
                              params: Mapping[str, Any] | None = None,
                              provisional: bool = False) -> Any:
        try:
            return super().smallest_fitting_plan(model, max_batch, run_ready, params,
                                                 provisional)
        except planner.DoesNotFitError as err:
            if self.ranks < 2:
                raise
            weights, _, _ = abstract_state(model, make_optimizer(params or {}))
            loss = jax.ShapeDtypeStruct((), jnp.float32)
            budget = self.config.need_budget()
            span = span_plan(functools.partial(self.call_planner, params=params), model,
                             ranks=self.ranks,
                             min_batch_size=self.config.min_batch_size or 1,
                             max_batch_size=max_batch,
                             memory_per_device=budget.memory_per_device,
                             safety_margin=budget.safety_margin,
                             reduction_bytes=mpi_mean_bytes((weights, loss)), local_error=err)
        raise TrialDeferred(f"spans {span.ranks} ranks (global batch {span.global_batch})", span)


class MPISearchEngine(SearchEngine):
    """The `scamp_jax.hpo.engine.SearchEngine` of one of ``ranks`` MPI ranks.

    Arguments after ``ranks`` as for `SearchEngine`. It plans with a `SpanningPlanningService`:
    a ScaMP configuration that reaches ``config.min_batch_size`` on none of this rank's device
    counts but does on several ranks with one device each is deferred instead of failed, and
    lands in ``deferred`` with its `SpanPlan`. A configuration that cannot span either fails
    with the planner's reason and what to change.
    """

    #: a rank's run ends while other ranks may still complete trials of the study
    guard_at_end = False

    def __init__(self, ranks: int, *args: Any, **kwargs: Any) -> None:
        self.ranks = ranks
        super().__init__(*args, **kwargs)

    def make_planning(self) -> PlanningService:
        return SpanningPlanningService(
            self.ranks, self.space, self.task, self.config, self.devices, self.plan_fn,
            getattr(self.policy, "batch_multiple", 1), self._may_grow())


def combined_usage(per_rank: Sequence[Mapping[str, float]],
                   memory_series: Sequence[Sequence[float]] | None,
                   spanning: Sequence[SpanningRun] = (),
                   spanning_s: float = 0.0, memory_per_device: int = 0) -> dict[str, float]:
    """The usage figures of several ranks' trials as one pool (`UsageRecorder.summary` keys):
    devices and trial counts add up, ``elapsed_s`` is the longest, and the figures over time are
    the pool's over it: a rank that ended sooner idles its devices until then (its idle
    device-seconds and that wait add up; the idle fraction and the mean memory utilisation
    are of the pool's devices over ``elapsed_s``), the peak is that of the
    pool's ``memory_series`` (`scamp_jax.hpo.report.ranks_timeline`: what all ranks booked at
    once; with the spanning trials, `spanning_timeline`).

    Then the trials that spanned ranks (``spanning``: `run_spanning_trials`' runs, in
    ``spanning_s`` seconds after the local trials, on a pool of ``memory_per_device`` per
    device): each books its `SpanPlan.booked_bytes` on one device of each of its ranks for its
    ``wall_seconds``, the pool's other devices idle meanwhile."""
    device_seconds = [u["devices"] * u["elapsed_s"] for u in per_rank]
    longest = max(u["elapsed_s"] for u in per_rank)
    devices = sum(u["devices"] for u in per_rank)
    total = devices * longest
    idle = sum(u["idle_device_seconds"] + u["devices"] * (longest - u["elapsed_s"])
               for u in per_rank)  # a rank done sooner waits for the last one
    booked = sum(u["mean_memory_utilization"] * w
                 for u, w in zip(per_rank, device_seconds, strict=True))
    peak = max(memory_series[1], default=0.0) if memory_series else 0.0
    if spanning and memory_per_device > 0:
        busy = sum(len(run.ranks) * run.result.wall_seconds for run in spanning)
        booked += sum(run.trial.plan.booked_bytes * len(run.ranks) * run.result.wall_seconds
                      for run in spanning) / memory_per_device
        total += devices * spanning_s
        idle += max(devices * spanning_s - busy, 0.0)
    return {
        "elapsed_s": longest + spanning_s,
        "devices": devices,
        "mean_memory_utilization": booked / total if total > 0 else 0.0,
        "peak_memory_utilization": peak,
        "idle_device_seconds": idle,
        "idle_fraction": idle / total if total > 0 else 0.0,
        "trials_started": sum(u["trials_started"] for u in per_rank) + len(spanning),
        "trials_finished": sum(u["trials_finished"] for u in per_rank) + len(spanning),
    }


def spanning_timeline(timeline: Mapping[str, Any], spanning: Sequence[SpanningRun],
                      start_s: float, devices: Sequence[int],
                      memory_per_device: int) -> dict[str, Any]:
    """The pool's ``timeline`` (`scamp_jax.hpo.report.ranks_timeline` of ranks holding
    ``devices[r]`` devices each) with the trials that spanned ranks, which began ``start_s``
    seconds into it: each holds the first device of each of its ranks from its round's start
    for its wall time (an interval of its number, seconds and booked bytes, as a local
    trial's), and books its `SpanPlan.booked_bytes` there in the memory series, a fraction of
    the pool's ``memory_per_device`` per device."""
    import bisect

    intervals = [list(spans) for spans in timeline.get("intervals") or []]
    firsts = [sum(devices[:r]) for r in range(len(devices))]
    events: dict[float, float] = {}
    pool = float(memory_per_device) * sum(devices)
    for run in spanning:
        begin = start_s + run.start_s
        end = begin + run.result.wall_seconds
        for r in run.ranks:
            intervals[firsts[r]].append(
                [run.trial.number, begin, end, run.trial.plan.booked_bytes])
        if pool > 0:
            share = run.trial.plan.booked_bytes * len(run.ranks) / pool
            events[begin] = events.get(begin, 0.0) + share
            events[end] = events.get(end, 0.0) - share
    series = timeline.get("memory_series")
    local_times, local = (list(series[0]), list(series[1])) if series else ([], [])
    changes = sorted(events)
    times = sorted(set(local_times) | set(changes))
    fractions = []
    for t in times:  # each part holds its last value up to t
        i = bisect.bisect_right(local_times, t) - 1
        j = bisect.bisect_right(changes, t)
        fractions.append(max((local[i] if i >= 0 else 0.0)
                             + sum(events[c] for c in changes[:j]), 0.0))
    return {**timeline, "intervals": intervals,
            "memory_series": [times, fractions] if times else None}


def run_search_mpi(
    space: Any,
    task: Any,
    settings: Any,
    *,
    devices: Sequence[Any],
    memory_per_device: int,
    live: bool = True,
    baseline: str | None = None,
    title: str = "search",
    plan_fn: Callable[..., Any] | None = None,
    console: Any = None,
    comm: Any = None,
    session: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """`scamp_jax.hpo.session.run_search` across the ranks of ``comm`` (collective: call on every
    rank).

    Args:
      space, task, settings: as for `run_search` (``settings.trials`` is the study's total over
        all ranks).
      devices: this rank's device pool.
      memory_per_device: budget per device in bytes (this rank's: a device limit the ranks of
        a host share may come to other bytes on other ranks).
      plan_fn: the planner (default ``plan_mesh`` with the study's shared ``plans.sqlite``).
      live: rank 0 shows the live table when its stdout is a terminal that reports a size
        (`scamp_jax.hpo.live.is_terminal`; Open MPI's ranks get one of 0 columns, so they log);
        otherwise, and on other ranks always, plain lines prefixed with ``[rank R]``.
      comm: mpi4py communicator of the ranks (default ``MPI.COMM_WORLD``).
      session: the study session class every rank runs
        (`scamp_jax.hpo.session.StudySession`, which ``run_search`` passes; this module does
        not import it, so the session and the MPI layer do not import each other).

    Returns:
      on every rank, the ``run`` section of ``results.json`` plus ``best``, as rank 0 wrote
      it (each rank's own summary is under ``per_rank``). The ``run`` section has ``ranks``,
      ``devices`` (all ranks together), ``elapsed_s`` (the slowest rank plus the spanning
      trials), ``trials_this_run`` (all ranks), ``spanning_trials``/``spanning_s`` (trials
      that spanned ranks, and their time), ``timeline`` (every rank's devices, rank 0's first:
      `scamp_jax.hpo.report.ranks_timeline`, which the plots draw), ``usage`` (every rank's
      local trials, then the trials that spanned ranks: `combined_usage`) and
      ``per_rank`` (each rank's summary with its ``usage``).

    Raises:
      MPIUnavailableError: mpi4py is not installed (with an install hint).
    """
    mpi = import_mpi4py()
    comm = mpi.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        if session is None:
            raise TypeError("run_search_mpi needs session=scamp_jax.hpo.session.StudySession "
                            "(scamp_jax.run_study and run_search pass it)")
        return _run(session, space, task, settings, devices, memory_per_device, live, baseline,
                    title, plan_fn, console, comm, rank, size)
    except KeyboardInterrupt as stop:
        # The engine already gave its running trials back; a re-run resumes them. A stop that
        # reached this rank alone (a signal to its process, not to mpirun) would leave it and
        # the others waiting for each other for ever: the job ends if it is still up later.
        end_job_later(comm, STOPPED_JOB_SECONDS, 143 if isinstance(stop, Terminated) else 130)
        raise
    except BaseException as err:  # noqa: BLE001 - any failure must end every rank, not hang them
        # worded as the entry point words errors (a command line: its flags)
        end_every_rank(comm, err, note=(
            "stopped the job: the trials the other ranks were running are run again when the "
            "same command runs again (at once on rank 0's host; elsewhere once their heartbeat "
            "lapses, about a minute)"
            if isinstance(err, RepeatedFailureError) else ""))  # this rank's guard stopped it
        raise


#: Seconds a rank that was stopped (Ctrl-C, SIGTERM) gives the job to end after its own trials
#: went back (the other ranks stop at their next step) before it ends the job itself.
STOPPED_JOB_SECONDS = 120.0


def end_job_later(comm: Any, seconds: float, code: int = 130) -> None:
    """As this process exits (after a stop), wait up to ``seconds`` for every rank of
    ``comm`` to exit too (a barrier each stopped rank enters at its exit), then abort the job
    (exit status ``code``: 130 for Ctrl-C, 143 for SIGTERM): ranks that were never stopped
    (a signal to one rank's process, not to mpirun) would wait for this one for ever, and it
    for them in ``MPI_Finalize``."""
    import atexit
    import sys

    def wait_or_end() -> None:  # before MPI's own exit (atexit runs the last one first)
        request, deadline = comm.Ibarrier(), time.monotonic() + seconds
        while not request.Test():
            if time.monotonic() > deadline:
                print(f"rank {comm.Get_rank()}: the job did not end within {seconds:g} s of "
                      "this rank's stop (were the other ranks stopped? signal mpirun, not one "
                      "rank): ending it; the same command resumes the study",
                      file=sys.stderr, flush=True)
                comm.Abort(code)
            time.sleep(0.05)

    atexit.register(wait_or_end)


#: Settings each rank may set for itself: its own pool (devices, how its trials share them) and
#: its own output; every other field of the settings shapes the study's trials.
PER_RANK_SETTINGS = frozenset({
    "rank", "devices", "devices_per_trial", "budget", "max_running_trials", "device_overlap",
    "lookahead", "planner_threads", "log_every", "elastic", "restart_seconds",
})


def check_ranks_share_settings(comm: Any, settings: Any) -> None:
    """Collective: raise the same `ValueError` on every rank unless every rank of ``comm`` was
    started with the same settings: every field of ``settings`` (a `SearchSettings`, or an
    experiment's extension of it with its flags as given, ``--memory-per-device`` among them)
    but `PER_RANK_SETTINGS`. Ranks of other steps, seeds, batch bounds or presets would each
    train the study's trials their own way while it records rank 0's. (The bytes each rank's
    budget comes to may differ: a device limit shared by the ranks of one host, a pool the
    allocator gave smaller.)"""
    import dataclasses

    from scamp_jax.hpo.settings import DERIVED_SETTINGS

    mine = {f.name: repr(getattr(settings, f.name)) for f in dataclasses.fields(settings)
            if f.name not in PER_RANK_SETTINGS}
    every = comm.allgather(mine)
    for rank, theirs in enumerate(every[1:], start=1):
        differ = [k for k in every[0] if theirs.get(k) != every[0][k]]
        # what follows a setting that differs (steps' intervals, trials' fusion) is not named
        derived = {k for source, follow in DERIVED_SETTINGS.items() if source in differ
                   for k in follow}
        differ = [k for k in differ if k not in derived]
        if not differ:
            continue
        if comm.Get_rank() != 0:  # one rank says what differs; the others, that they stop
            time.sleep(1.0)  # after rank 0 has said it: the first rank to end aborts the job
            raise ValueError("the ranks were started with other settings (rank 0's line names "
                             "them); start every rank with the same command")
        # "; ": a command line says each as its flag (``--steps 30``)
        theirs_text = "; ".join(f"{k}={theirs.get(k)}" for k in differ)
        ours = "; ".join(f"{k}={every[0][k]}" for k in differ)
        raise ValueError(
            f"rank {rank} was started with {theirs_text} where rank 0 has {ours}: start "
            "every rank with the same command (each may differ in its own devices only)")


def _give_back_spanning(server: Any, numbers: Sequence[int]) -> None:
    """Give the spanning trials a stop left unfinished back to the study at once (failed as
    interrupted, queued again under their checkpoint keys), as a single process gives back
    its running trials, rather than leaving them running until their heartbeat lapses."""
    with stops_held():  # every one goes back, then the stop goes on
        for number in numbers:
            try:
                server.interrupt(number)
            except Exception as failure:  # noqa: BLE001 - the stop, not this, ends the run
                print(f"could not give trial {number} back to the study: "
                      f"{type(failure).__name__}: {failure}", file=sys.stderr, flush=True)


def _record_stopped(session: Any, server: Any, result: Any, elapsed_s: float,
                    ranks: int, err: BaseException) -> None:
    """Rank 0's record of a run ``err`` stopped (`StudySession.record_ending`): its engine's
    figures, up to the stop or, when it came while rank 0 waited for the other ranks, the
    whole of its own run."""
    if session.interrupted_result is None and result is not None:
        session.interrupted_result = result
    session.record_ending(server.source.study, elapsed_s, server.source.told, err,
                          beyond_engine=True, ranks=ranks)


def _run(session_class: Callable[..., Any], space: Any, task: Any, settings: Any,
         devices: Sequence[Any], memory_per_device: int, live: bool, baseline: str | None,
         title: str, plan_fn: Callable[..., Any] | None, console: Any, comm: Any, rank: int,
         size: int) -> dict[str, Any]:
    from scamp_jax.hpo.report import ranks_timeline, run_summary

    check_ranks_share_settings(comm, settings)
    session = session_class(space, task, settings, devices=devices,
                           memory_per_device=memory_per_device, live=live, baseline=baseline,
                           title=title, plan_fn=plan_fn, console=console, rank=rank, ranks=size)
    # Rank 0 owns the study; every rank asks it for work through the same kind of source.
    client, server = shared_study(lambda: session.trial_source(session.open()), comm)
    if server is not None:
        session.greet(server.source)  # with rank 0's pool line
    else:
        session.say_pool()
    source = RemoteTrialSource(client)
    started = time.monotonic()
    result = engine = None
    spanning: list[SpanningTrial] = []
    told: set[int] = set()

    def tell_spanning(trial: SpanningTrial, ranks: tuple[int, ...], outcome_of: Any) -> None:
        """Rank 0 records a spanning trial as its round ends (a stop later keeps it)."""
        assert server is not None
        outcome = spanning_outcome(trial, ranks, outcome_of, task.metric)
        server.tell(outcome.number, outcome.value, _OPTUNA_STATE[outcome.state],
                    dict(outcome.attrs), outcome.reason)
        told.add(trial.number)

    def give_back_spanning(numbers: list[int]) -> None:
        """Rank 0 gives a round's spanning trials back at a stop, before their ranks end."""
        assert server is not None
        _give_back_spanning(server, [n for n in numbers if n not in told])
        told.update(numbers)

    try:
        # The barrier: every rank asks from the start, so work spreads over all of them.
        engine, result = session.run_engine(
            source, engine=functools.partial(MPISearchEngine, size), before=comm.Barrier)
        source.close()
        summary = {"rank": rank, **run_summary(result, len(devices), memory_per_device),
                   "deferred": len(engine.deferred), "overhead": session.overhead}
        if server is not None:
            server.join()  # the other ranks' last trials
        # Trials that span ranks run now, when every rank's devices are free.
        deferred = [SpanningTrial(asked.number, dict(asked.params), asked.checkpoint_key,
                                  err.payload, rank) for asked, err in engine.deferred]
        spanning = [t for part in comm.allgather(deferred) for t in part]
        # Past the gather no rank sends the study a message: its communicator goes.
        release_study(client, server)
        start = time.monotonic()
        finished = run_spanning_trials(
            spanning, space, task, engine.config, comm,
            checkpoint_root=session.out_dir / "checkpoints", log=session.say,
            on_finished=tell_spanning if server is not None else None,
            on_stop=give_back_spanning if server is not None else None) if spanning else []
        spanning_s = time.monotonic() - start
    except (KeyboardInterrupt, Exception) as err:
        if server is not None:  # rank 0 records the run, as a single process does
            # the trials that wait to span ranks: every rank's once gathered, before that
            # rank 0's own (the others' wait for their heartbeat to lapse)
            waiting = ([t.number for t in spanning] if spanning else
                       [asked.number for asked, _ in getattr(engine, "deferred", ())])
            _give_back_spanning(server, [n for n in waiting if n not in told])
            _record_stopped(session, server, result, time.monotonic() - started, size, err)
        raise
    summaries = comm.gather(summary, root=0)
    if server is None:
        return comm.bcast(None, root=0)  # rank 0's record, once written
    # The report's plots and usage figures cover every rank's devices, rank 0's first.
    devices_per_rank = [s["devices"] for s in summaries]
    timeline = spanning_timeline(
        ranks_timeline([s.pop("timeline") for s in summaries], devices_per_rank), finished,
        max(s["elapsed_s"] for s in summaries), devices_per_rank, memory_per_device)
    run_info = {
        **run_summary(result, sum(s["devices"] for s in summaries), memory_per_device),
        "timeline": timeline,
        "usage": combined_usage([s["usage"] for s in summaries], timeline["memory_series"],
                                finished, spanning_s, memory_per_device),
        "ranks": size,
        "elapsed_s": max(s["elapsed_s"] for s in summaries) + spanning_s,
        "trials_this_run": sum(s["trials_this_run"] for s in summaries) + len(finished),
        "spanning_trials": len(finished),
        "spanning_s": spanning_s,
        "per_rank": summaries,
        # the longest any rank waited for held trials (each rank's own: ``per_rank``)
        "waited_for_held_trials_s": max(float(s.get("waited_for_held_trials_s") or 0.0)
                                        for s in summaries),
    }
    # compiles, checkpoints and cache use of every rank's own trials (each rank's:
    # ``per_rank``); not of the trials that spanned ranks, which run after the engines
    run_info["step_cache"] = {key: sum(int(s["step_cache"].get(key, 0)) for s in summaries)
                              for key in summaries[0]["step_cache"]}
    session.overhead = combined_overhead([s["overhead"] for s in summaries])
    if session.overhead is not None:  # every rank's pool idled while it waited: their sum
        session.overhead["idle_waiting_for_held_trials_device_s"] = (
            held_wait_device_seconds(summaries))
    return comm.bcast(session.report(server.source, run_info), root=0)
