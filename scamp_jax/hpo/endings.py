"""How the search loop handles the end of a run: tell the study, re-plan, or start again.

`Endings` is the loop's handler of the events a run's end brings (`scamp_jax.hpo.engine`):

- a run that ran out of memory, solo or fused: `scamp_jax.hpo.out_of_memory` decides what
  follows (a new plan, solo members, or the trial fails);
- a solo run stopped for a restart on more devices: it starts again on them; a restarted run
  that failed before training a step goes back to the devices and plan it trained on;
- a fused group: every member is told on its own;
- otherwise the trial is told to the study with its record (``results.json``); an interrupted
  one is given back (a re-run resumes it), as are all unfinished trials when the engine stops
  (`Endings.give_back`); while a run's first trials fail with one error, their failures are held
  back, and given back with the others when the engine stops (`scamp_jax.hpo.failures`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from scamp_jax._signals import stops_held
from scamp_jax.hpo.failures import RepeatedFailures
from scamp_jax.hpo.out_of_memory import OutOfMemory
from scamp_jax.hpo.study.trials import TrialOutcome, TrialSource
from scamp_jax.hpo.trial import PlannedTrial, RunResult
from scamp_jax.hpo.units import SoloUnit
from scamp_jax.scheduling.core import SchedulingCore

log = logging.getLogger(__name__)


def second_ctrl_c(pressed: bool = True) -> str:
    """What a (second) Ctrl-C does, by the SIGINT handler installed: a command line's
    (``ends_process``, the experiments' ``_CtrlC``) ends the process at once; Python's own
    raises ``KeyboardInterrupt`` at once, but a script's interpreter then waits for the
    threads still running (the trials', which end at their next step, and compiles).
    ``pressed``: the stop was a Ctrl-C's ("Ctrl-C again"), not the run's own ("a Ctrl-C").
    Under an MPI launcher a Ctrl-C reaches the launcher, which ends the ranks its own way
    (BUILD.md), and that is what is said."""
    from scamp_jax.distributed.mpi import launched_under_mpi

    if launched_under_mpi():  # the launcher has the terminal's Ctrl-C, not the ranks
        # Open MPI hands its ranks the launch's MCA settings as variables; it sends SIGTERM
        # that long after the Ctrl-C, and SIGKILL as long after that
        wait = os.environ.get("OMPI_MCA_odls_base_sigkill_timeout", "").strip() or "1"
        return ("under mpirun a Ctrl-C goes to mpirun, which ends the ranks itself (Open MPI: "
                f"SIGTERM {wait} s after it, SIGKILL {wait} s later); a stop with every "
                "running trial's checkpoint is SIGTERM sent to the ranks themselves, as "
                "Slurm's scancel sends it")
    ctrl_c = "Ctrl-C again" if pressed else "a Ctrl-C"
    if getattr(signal.getsignal(signal.SIGINT), "ends_process", False):
        return f"{ctrl_c} stops at once"
    return (f"{ctrl_c} stops waiting for them (a script's process still ends only once "
            "their steps and any compile under way have)")


class Endings:
    """The handlers of a run's end for one engine run (see the module doc).

    Args:
      source, metric, config: the study's trial source, the task's metric and the engine's
        `EngineConfig`.
      core: this run's scheduling core.
      records: this run's `scamp_jax.hpo.engine.TrialRecord` per trial number.
      now: seconds since this run began.
      decide: ``decide(now)``: let the core place what it can.
      start: ``start(unit, device_ids, now)``: start a unit's run on the pool's devices.
      queue: ``queue(planned)``: a planned trial waits for devices again.
      replan: ``replan(planned, request)``: plan ``planned`` again in a planner thread
        (`scamp_jax.hpo.out_of_memory.plan_again`).
      notify: something changed (the live view).
      checkpoint_root: where the trials' checkpoints are (None: none are written).

    Attributes:
      oom: the run's `scamp_jax.hpo.out_of_memory.OutOfMemory` handling.
    """

    def __init__(self, source: TrialSource, metric: str, config: Any, core: SchedulingCore,
                 records: Mapping[int, Any], now: Callable[[], float],
                 decide: Callable[[float], None],
                 start: Callable[[SoloUnit, Sequence[int], float], None],
                 queue: Callable[[PlannedTrial], None],
                 replan: Callable[[PlannedTrial, Any], None],
                 notify: Callable[[], None], checkpoint_root: Path | None = None) -> None:
        self.source, self.metric, self.config, self.core = source, metric, config, core
        self.records, self.now, self.decide, self.start = records, now, decide, start
        self.notify, self.checkpoint_root = notify, checkpoint_root
        self.oom = OutOfMemory(config, core, records, replan, queue, self.report)
        #: the guard against a run's first trials all failing alike
        self.failures = RepeatedFailures(config.failure_limit, self._told, self._interrupt)
        #: how each trial of this run ended, in finishing order.
        self.outcomes: list[TrialOutcome] = []
        #: trials whose ending the study refused to store (the error ended the run): they go
        #: back to it with the others (`give_back`)
        self.untold: list[int] = []

    @stops_held()  # the held failures and this outcome are told whole (`scamp_jax._signals`)
    def tell(self, outcome: TrialOutcome) -> None:
        """Tell the study how a trial ended (a failure may be held back first:
        `scamp_jax.hpo.failures`)."""
        if not self.failures.hold(outcome):
            self._told(outcome)
        self.notify()

    def _told(self, outcome: TrialOutcome) -> None:
        try:
            self.source.tell(outcome)
        except BaseException:
            self.untold.append(outcome.number)
            raise
        record = self.records.get(outcome.number)
        if record is not None:  # its seconds are the study's now; until then they go back
            record.earlier_wall = 0.0  # with it where it is given back (`_interrupt`)
        self.outcomes.append(outcome)

    def check_failures(self, ended: bool = False) -> None:
        """Raise `RepeatedFailureError` once the run's first trials all failed alike (the
        engine then stops, `give_back`); ``ended``: the run has nothing more to train, and
        two runs of first tries that failed alike are enough
        (`RepeatedFailures.tripped_at_end`)."""
        if (self.failures.tripped_at_end(self._first_try) if ended
                else self.failures.tripped):
            raise self.failures.error()

    def _first_try(self, outcome: TrialOutcome) -> bool:
        """Whether ``outcome``'s trial is no retry of a trial an earlier run gave back."""
        record = self.records.get(outcome.number)
        return record is None or getattr(record.status, "retry_of", None) is None

    @stops_held()
    def finish(self) -> None:
        """The run ended: failures still held back are told as they are."""
        self.failures.release()
        self.notify()

    def tell_failed(self, number: int) -> None:
        """Tell the study that trial ``number`` failed before it ran, or was rejected by the
        space (pruned), as its status says, with its reason."""
        record = self.records[number]
        state = "pruned" if record.status.state == "pruned" else "failed"
        self.tell(TrialOutcome(number, state, reason=record.status.reason,
                               attrs=record.attrs(self.config.rank, 0.0)))

    def run_ended(self, number: int, result: RunResult) -> None:
        """Event: trial ``number``'s solo run returned ``result``."""
        record = self.records[number]
        run, record.run = record.run, None
        assert run is not None
        planned = run.members[0]
        record.earlier_wall += result.wall_seconds
        restart, record.resizing = record.resizing, None
        if restart is not None and result.state == "interrupted":
            record.status.resizes += 1
            record.restarted = replace(restart, since=time.monotonic())
            self.start(SoloUnit(restart.grown), restart.placement.device_ids, self.now())
            return
        restart, record.restarted = record.restarted, None
        if (restart is not None and result.state in ("oom", "failed")
                and not record.status.training_since > restart.since):
            # The restarted run never trained: go back to the plan that did.
            log.info("trial %d: restart on %d devices failed (%s); back on %d", number,
                     planned.devices, result.reason, restart.before.devices)
            now = self.now()
            record.log("moved_back", now, list(restart.old_placement.device_ids),
                       restart.old_plan.as_dict())
            self.core.move_back(now, number, restart.old_placement.device_ids,
                                restart.old_plan)
            record.show_plan(restart.before.plan)
            self.start(SoloUnit(restart.before), restart.old_placement.device_ids, now)
            return
        now = self.now()
        record.times["finished_at"] = now
        if result.state == "oom":
            self.oom.run_ended(now, planned, result)
            self.decide(now)
            return
        record.log("finished", now)
        self.core.finished(now, number)
        self.report(planned, result)
        self.decide(now)

    def group_ended(self, key: int, results: Sequence[RunResult]) -> None:
        """Event: group ``key``'s run returned; each member is told (or queued again)."""
        leader = self.records[key]
        run = leader.run
        assert run is not None
        now = self.now()
        leader.log("finished", now)
        self.core.finished(now, key)
        for planned, r in zip(run.members, results, strict=True):
            record = self._run_over(planned.number, r, now)
            if planned.number != key:  # the group's scheduling record is the leader's
                record.times["plan"] = leader.times.get("plan")
                # a copy: a member that runs alone later records its own paces there
                record.times["pace"] = list(leader.times.get("pace", []))
            if r.state == "oom":  # the group did not fit: its members run alone
                self.oom.member_ended(planned)
                continue
            self.report(planned, r)
        self.decide(now)

    def _ended(self, number: int) -> bool:
        """Whether trial ``number``'s own run is over (complete, pruned or failed; a fused
        member may end before its group)."""
        record = self.records.get(number)
        return record is not None and record.status.state in ("complete", "pruned", "failed")

    def _trained(self, number: int) -> bool:
        """Whether trial ``number``'s run trained its last step (its final evaluation comes
        whatever stops it)."""
        status = getattr(self.records.get(number), "status", None)
        steps = getattr(status, "steps", 0)
        return bool(steps) and getattr(status, "step", 0) >= steps

    def give_back(self, runs: Sequence[Any], waiting: Sequence[int],
                  notice: Callable[[str], None] | None = None, discard: bool = False,
                  pressed: bool | None = None) -> None:
        """Stop ``runs`` (`scamp_jax.hpo.launch.Run`: they checkpoint at their next step) and
        give their members, the failures held back (`scamp_jax.hpo.failures`) and the trials
        ``waiting`` (planned, queued or held, not running) back to the study, each once; a
        member whose run ended complete or pruned before the stop reached it is told as such
        (`_tell_finished`), any other ending of a stopped run is unfinished. ``notice``: told
        what happens to the running trials (a Ctrl-C's user). ``discard`` (the run's trials
        failed alike: a bug in the task): the checkpoints of the held and the running trials
        are deleted first, so that the next run trains them from the start. ``pressed``: the
        stop was a Ctrl-C's (the notice says "Ctrl-C again"; None: unless ``discard``)."""
        for run in runs:
            run.stop.set()
        if notice is not None and runs:
            # a fused group's members each, but not one that ended already (failed alone);
            # those past their last step finish their evaluation and are told as they end
            live = [member.number for run in runs for member in run.members
                    if not self._ended(member.number)]
            finishing = sum(map(self._trained, live))
            after = ("a re-run trains them from the start (what they trained under the error "
                     "is deleted)" if discard else
                     "a re-run resumes them (with a checkpoint where checkpoints are on)")
            said = [f"{len(live) - finishing} running trial(s) end at their next step and go "
                    f"back to the study, where {after}"] if len(live) > finishing else []
            if finishing:
                said.append(f"{finishing} trial(s) past their last step finish their "
                            "evaluation first (a result is kept; one whose evaluation raises "
                            "goes back with the others)")
            pressed = not discard if pressed is None else pressed
            notice(f"stopping: {'; '.join(said)}; {second_ctrl_c(pressed=pressed)}")
        stopped: KeyboardInterrupt | None = None
        try:
            cf.wait([run.future for run in runs])
        except KeyboardInterrupt as err:  # stopped while waiting: the trials still go back
            stopped = err
        with stops_held():  # every trial goes back, then a stop goes on
            # held failures may be a bug's (a Ctrl-C may be the user who saw it): retried,
            # also when a run told complete below would have told them failed
            held = self.failures.take_held()
            running = self._tell_finished(runs)
            if discard and stopped is None:
                # A bug in the task: what these trials trained under it is not resumed. The
                # runs have ended; it goes before the trials go back, where another process
                # could ask their retries; trials that waited keep their earlier checkpoints.
                for number in dict.fromkeys([*(o.number for o in held), *running]):
                    self._discard_checkpoints(number)
            self.failures.give_back_held(held)
            untold, self.untold = self.untold, []
            for number in dict.fromkeys([*running, *waiting, *untold]):  # once each
                self._interrupt(number)
        if stopped is not None:
            raise stopped

    def _run_over(self, number: int, result: RunResult, now: float) -> Any:
        """Trial ``number``'s run ended with ``result`` at ``now``: its record (returned) holds
        no run and counts the run's wall time."""
        record = self.records[number]
        record.run = None
        record.times["finished_at"] = now
        record.earlier_wall += result.wall_seconds
        return record

    def _interrupt(self, number: int) -> None:
        """Give trial ``number`` back to the study; where the study refuses (its storage
        failing), say so and go on with the others: the heartbeat gives that one back. The
        seconds its runs took in this run go with it (its retry's record adds them)."""
        record = self.records.get(number)
        wall = 0.0 if record is None else record.earlier_wall
        try:
            self.source.interrupt(number, wall_seconds=wall)
        except Exception as err:  # noqa: BLE001 - the others still go back
            log.warning("could not give trial %d back to the study (%s: %s); a rerun retries "
                        "it all the same (on this machine at once, which sees this process "
                        "gone; elsewhere once its heartbeat lapses)", number,
                        type(err).__name__, err)

    def _tell_finished(self, runs: Sequence[Any]) -> list[int]:
        """Tell the study the members of ``runs`` that ended before the stop reached them: a
        run that had just finished, or finished its evaluation meanwhile, and a fused member
        whose loss or score turned non-finite while its group trained on (the configuration's
        own ending, which a rerun would only repeat): their results stand. Return the numbers
        of the others, which go back (a failure that raised may be a bug the user stopped to
        fix, so it is tried again)."""
        now, unfinished = self.now(), []
        for run in runs:
            future = run.future
            result = future.result() if future.done() and future.exception() is None else None
            results = getattr(result, "members", None) or (result,)
            if len(results) != len(run.members):  # a run that ended without a result
                results = (None,) * len(run.members)
            told = 0
            for planned, r in zip(run.members, results, strict=True):
                ended = r is not None and (r.state in ("complete", "pruned")
                                           or (r.state == "failed" and not r.traceback))
                if not ended:
                    if r is not None:  # stopped: its seconds go back with it
                        self.records[planned.number].earlier_wall += r.wall_seconds
                    unfinished.append(planned.number)
                    continue
                self._run_over(planned.number, r, now)
                try:
                    self.report(planned, r)
                except Exception as err:  # noqa: BLE001 - the study refused it: it goes back
                    log.warning("the study did not record trial %d's ending (%s: %s); it goes "
                                "back", planned.number, type(err).__name__, err)
                    unfinished.append(planned.number)
                    continue
                told += 1
            if told == len(run.members):
                self.records[run.key].log("finished", now)
                self.core.finished(now, run.key)
        return unfinished

    def _discard_checkpoints(self, number: int) -> None:
        """Delete trial ``number``'s checkpoints, while it is still this process's trial."""
        record = self.records.get(number)
        live = getattr(self.source, "is_live", None)  # another process may have retried it
        if (self.checkpoint_root is None or record is None
                or (live is not None and not live(number))):
            return
        root = self.checkpoint_root.resolve()
        directory = (root / record.asked.checkpoint_key).resolve()
        if root not in directory.parents or not directory.is_dir():
            return
        try:
            shutil.rmtree(directory)
        except OSError as err:
            log.warning("trial %d: its checkpoints in %s could not be deleted (%s); delete "
                        "them before the next run, which would resume them", number,
                        directory, err)

    def report(self, planned: PlannedTrial, result: RunResult) -> None:
        """Tell the study how ``planned`` ended (an interrupted one is given back)."""
        record = self.records[planned.number]
        wall = record.earlier_wall  # cleared once the study holds the outcome (`_told`)
        if result.state == "interrupted":
            record.earlier_wall = 0.0
            self.source.interrupt(planned.number, wall_seconds=wall)
            return
        record.status.state = result.state
        record.status.reason = result.reason
        record.status.traceback = result.traceback
        attrs = record.attrs(self.config.rank, wall)
        attrs["metrics"] = dict(result.metrics)
        attrs["checkpoint"] = str(result.checkpoint) if result.checkpoint else None
        attrs["resumed_from"] = result.resumed_from
        metric = result.metrics.get(self.metric)
        self.tell(TrialOutcome(planned.number, result.state,
                                value=metric if result.state == "complete" else None,
                                reason=result.reason, attrs=attrs))
