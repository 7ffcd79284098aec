"""An HPO study across MPI ranks: every rank runs the ordinary `SearchEngine` on its own devices.

    mpirun -n 2 python -m experiments.swinir_hpo --preset smoke

Rank 0 owns the Optuna study and its storage and serves it to the other ranks
(`scamp_jax.distributed.study`); each rank, rank 0 included, plans, places and runs trials on
its local devices with the same planner and placement policy, asking rank 0 for work through a
`RemoteTrialSource` (the `TrialSource` the engine already talks to). ``settings.trials`` stays
the study's total across all ranks. When every rank is done, rank 0 writes ``results.json`` /
``results.csv`` / plots from the storage; each trial's ``rank`` is a user attribute of the trial.

A trial runs on the devices of one rank: the planner is given only the local devices, and a
configuration that fits on none of them fails with a message saying so (trials do not span
ranks in this engine). Checkpoints go to ``<study_dir>/checkpoints``, which every rank must see
(one host, or a shared file system) for a re-run on another rank to resume from them.

Faults: an exception on any rank prints ``rank R failed: ...`` and aborts the whole job
(``MPI_Abort``); a rank that dies makes ``mpirun`` end the job and name the rank. Trials that
were running stay ``RUNNING`` in the storage; running the same command again fails them as
interrupted, enqueues their parameters under their checkpoint keys and completes the study
without losing any finished trial.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scamp_jax.distributed.mpi import import_mpi4py
from scamp_jax.distributed.study import StudyClient, shared_study
from scamp_jax.study import AskedTrial, TrialOutcome

_OPTUNA_STATE = {"complete": "COMPLETE", "pruned": "PRUNED", "failed": "FAIL"}


class RemoteTrialSource:
    """`scamp_jax.study.TrialSource` over a `StudyClient`: the study lives on rank 0.

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

    def ask(self) -> AskedTrial | None:
        """Next configuration for this rank, or ``None`` once the study has all its trials."""
        item = self.client.ask(keep_open=True)
        if item is None:
            return None
        return AskedTrial(item.number, dict(item.params),
                          item.checkpoint_key or f"trial_{item.number}")

    def report(self, number: int, step: int, value: float) -> bool:
        """Record ``value`` at ``step`` in rank 0's study; True if the pruner stops the trial."""
        return self.client.report(number, step, float(value))

    def tell(self, outcome: TrialOutcome) -> None:
        """Store the outcome (state, value, reason, attributes) in rank 0's study."""
        self.client.tell(outcome.number, outcome.value, _OPTUNA_STATE[outcome.state],
                         dict(outcome.attrs), outcome.reason)

    def interrupt(self, number: int) -> None:
        """Give a started trial back: failed as interrupted and enqueued again on rank 0."""
        self.client.interrupt(number)

    def close(self) -> None:
        """Tell rank 0 that this rank asks, reports and tells nothing more."""
        self.client.close()


class RankStream:
    """A text stream that prefixes every line with ``[rank R]`` (plain logs of ranks > 0).

    Args:
      rank: the MPI rank named in the prefix.
      stream: where the lines go (default ``sys.stdout``).
    """

    def __init__(self, rank: int, stream: Any = None) -> None:
        self.prefix = f"[rank {rank}] "
        self.stream = stream if stream is not None else sys.stdout
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        """Buffer ``text`` and write every completed line with the prefix."""
        with self._lock:
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
            for line in lines:
                self.stream.write(f"{self.prefix}{line}\n")
        return len(text)

    def flush(self) -> None:
        """Flush the underlying stream (a partial line stays buffered until its newline)."""
        self.stream.flush()

    def isatty(self) -> bool:
        """Never a terminal: ranks other than 0 log plain lines, never a live table."""
        return False


def local_plans_only(plan_fn: Callable[..., Any], local_devices: int) -> Callable[..., Any]:
    """Wrap a planner so that a configuration too big for all ``local_devices`` devices of this
    rank fails with a message saying trials do not span ranks (and what to change)."""
    from scamp_jax import planner

    def plan(model: Any, batch: Any, *, devices: Sequence[Any], **kwargs: Any) -> Any:
        try:
            return plan_fn(model, batch, devices=devices, **kwargs)
        except planner.DoesNotFitError as err:
            if len(devices) < local_devices:
                raise  # the engine goes on to larger device counts
            raise planner.DoesNotFitError(
                f"{err}; under MPI a trial runs on the {local_devices} devices of one rank "
                "(trials spanning ranks are not supported): give each rank more devices "
                "(--devices) or more memory per device (--memory-per-device)",
                err.bytes_needed, err.bytes_available,
            ) from err

    return plan


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
) -> dict[str, Any]:
    """`scamp_jax.engine.run_search` across the ranks of ``comm`` (collective: call on every rank).

    Args:
      space, task, settings: as for `run_search` (``settings.trials`` is the study's total over
        all ranks).
      devices: this rank's device pool.
      memory_per_device: budget per device in bytes (the same on every rank).
      live: rank 0 shows the live table (else plain lines); other ranks always log plain lines
        prefixed with ``[rank R]``.
      comm: mpi4py communicator of the ranks (default ``MPI.COMM_WORLD``).

    Returns:
      on rank 0, the ``run`` section of ``results.json`` plus ``best``; on other ranks this
      rank's run summary. The ``run`` section has ``ranks``, ``devices`` (all ranks together),
      ``elapsed_s`` (the slowest rank), ``trials_this_run`` (all ranks) and ``per_rank``
      (each rank's summary with its ``usage``); ``usage`` and the plots are rank 0's.

    Raises:
      MPIUnavailableError: mpi4py is not installed (with an install hint).
    """
    mpi = import_mpi4py()
    comm = mpi.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        return _run(space, task, settings, devices, memory_per_device, live, baseline, title,
                    plan_fn, console, comm, rank, size)
    except KeyboardInterrupt:
        raise  # the engine already gave its running trials back; a re-run resumes them
    except BaseException as err:  # noqa: BLE001 - any failure must end every rank, not hang them
        print(f"rank {rank} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        comm.Abort(2 if isinstance(err, ValueError) else 1)
        raise


def _run(space: Any, task: Any, settings: Any, devices: Sequence[Any], memory_per_device: int,
         live: bool, baseline: str | None, title: str, plan_fn: Callable[..., Any] | None,
         console: Any, comm: Any, rank: int, size: int) -> dict[str, Any]:
    from rich.console import Console

    from scamp_jax import planner
    from scamp_jax.engine import (
        SearchEngine,
        engine_config,
        run_summary,
        write_study_report,
    )
    from scamp_jax.live import LiveView
    from scamp_jax.study import open_study

    study_dir = Path(settings.study_dir)

    def make_study() -> Any:
        study = open_study(
            space.name, study_dir=study_dir, storage=settings.storage,
            direction=task.direction, sampler=settings.sampler, pruner=settings.pruner,
            seed=settings.seed, grid=space.grid, warmup_steps=settings.eval_every,
        )
        if not study.get_trials(deepcopy=False):
            for params in getattr(settings, "initial_params", ()):
                study.enqueue_trial(dict(params), skip_if_exists=True)
        return study

    client, server = shared_study(make_study, space.suggest, settings.trials, comm)
    if console is None:
        out: Any = sys.stdout if rank == 0 else RankStream(rank)
        console = Console(file=out, soft_wrap=True,
                          width=None if rank == 0 and sys.stdout.isatty() else 160)
    if server is not None:
        if server.stale_failed:
            console.print(f"resuming: trials {server.stale_failed} were interrupted and are "
                          "queued again", markup=False)
        console.print(f"study {space.name!r} in {study_dir}: {server.finished_before} of "
                      f"{settings.trials} trials finished before this run; {size} ranks",
                      markup=False)
    source = RemoteTrialSource(client)
    config = engine_config(settings, memory_per_device, rank=rank)
    stream: Any = None if rank == 0 and live else RankStream(rank)
    view = LiveView([memory_per_device] * len(devices), task.metric,
                    title=f"{title} (rank {rank} of {size})", stream=stream)
    engine = SearchEngine(space, task, source, config, devices=devices,
                          checkpoint_root=study_dir / "checkpoints",
                          plan_fn=local_plans_only(plan_fn or planner.plan_mesh, len(devices)),
                          on_update=view.update)
    comm.Barrier()  # every rank asks from the start, so work spreads over all of them
    with view:
        result = engine.run()
    source.close()
    summary = {"rank": rank, **run_summary(result, len(devices), memory_per_device)}
    if server is not None:
        server.join()
    summaries = comm.gather(summary, root=0)
    if server is None:
        return summary
    run_info = {
        **run_summary(result, sum(s["devices"] for s in summaries), memory_per_device),
        "ranks": size,
        "elapsed_s": max(s["elapsed_s"] for s in summaries),
        "trials_this_run": sum(s["trials_this_run"] for s in summaries),
        "per_rank": summaries,
    }
    return write_study_report(server.study, task, study_dir, result, run_info,
                              baseline=baseline, memory_per_device=memory_per_device,
                              console=console)
