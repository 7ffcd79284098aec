"""A study's first trials all failing with one error: a bug in the task, and the study stops.

A deterministic bug in a task (its ``evaluate``, its loss, its data, a model's code) fails every
trial the same way, each after its whole training: left alone, a study spends all its trials on
it. `RepeatedFailures` watches how a run's trials end. Until one of them completes (or is pruned
after training), the failures that come with an exception (a traceback) are held back from the
study while they repeat one error: the same exception raised at the same place (the message may
differ, e.g. by a trial's batch size). Once the held trials come from ``failure_limit`` runs
(`scamp_jax.hpo.settings.EngineConfig.failure_limit`; a fused group's members are one run), or
when the run has nothing more to train, from two runs of trials tried for the first time (its
study had fewer trials left; a rerun's retries of them do not stop it again), the engine stops
its other trials and raises `RepeatedFailureError`, and the held trials go back to
the study as interrupted ones do, with those that were running: the run after the fix trains
them again from the start (what they trained under the bug is deleted, not resumed) instead of
counting them as failed; a Ctrl-C gives held trials back too (with their checkpoints). A trial
that completes, a failure raised elsewhere and the end of the run tell the held trials to the
study as the failures they are. A failure without an exception (a loss that turned non-finite, a
configuration that fits nowhere) and a configuration the space rejects (``optuna.TrialPruned``
from its build) are the configuration's own: told at once, they leave the held ones as they are.
A space that fails some configurations on purpose, by raising, sets ``failure_limit=0``. Under
MPI every rank's engine keeps its own guard, which counts the runs of its rank, and only to the
limit (a rank's run ends while others may still complete trials of the study).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a leaf: the session imports it before Optuna
    from scamp_jax.hpo.study.trials import TrialOutcome

#: the attribute of a failed trial that holds its traceback (`scamp_jax.hpo.record.TrialRecord`).
TRACEBACK = "traceback"


class RepeatedFailureError(RuntimeError):
    """A study's run stopped because its trials all failed with the same error, none having
    completed, e.g. a bug in the task; they went back to the study, and the next run trains
    them again from the start.

    Attributes:
      trials: the numbers of the trials that failed alike.
      reason: the reason of the last of them (``Type: message (at file.py:LINE)``).
      traceback: the traceback of the last of them.
    """

    def __init__(self, trials: Sequence[int], reason: str, traceback: str) -> None:
        self.trials, self.reason, self.traceback = tuple(trials), reason, traceback
        super().__init__(self._message("failure_limit=0"))

    def _message(self, no_limit: str) -> str:
        *first, last = self.trials
        named = f"{', '.join(map(str, first))} and {last}" if first else str(last)
        return (f"trials {named} all failed with the same error, and no trial of this run "
                f"completed: {self.reason}. That looks like a bug in the task, not in these "
                "configurations, so the study stopped; these trials and those that were "
                "running went back to it, and a rerun trains them again from the start. Fix the "
                f"error and run again; if some configurations fail on purpose, pass {no_limit} "
                "(or a larger limit). The last trial's traceback:\n"
                f"{self.traceback.rstrip()}")

    def as_command_line(self) -> str:
        """The message with its advice in the command lines' flags (the reason and the
        traceback as they are)."""
        return self._message("--failure-limit 0")

    def __reduce__(self) -> tuple:  # picklable whole, as the library's other errors
        return type(self), (self.trials, self.reason, self.traceback)


def failure_key(outcome: TrialOutcome) -> str:
    """What makes two raised failures "the same error": the exception's type and where it was
    raised: the user's line its reason names (``ValueError (at task.py:42)``), else the
    innermost frame of its traceback (the package's check of what the user's code returned,
    whose reason names no line and whose message may name a trial's value or batch), else
    the whole reason."""
    reason = outcome.reason
    kind = reason.split(":", 1)[0]
    place = re.search(r" \(at [^()]*\)$", reason)
    if place:
        return f"{kind}{place[0]}"
    frames = re.findall(r'File "([^"]+)", line (\d+)', str(outcome.attrs.get(TRACEBACK) or ""))
    if frames:
        return f"{kind} (raised at {frames[-1][0]}:{frames[-1][1]})"
    return reason


class RepeatedFailures:
    """The guard of one engine run (see the module doc).

    Args:
      limit: runs whose trials failed alike, none completed before, that stop the study
        (0: never).
      tell: tells the study how a trial ended.
      give_back: gives a live trial back to the study (it runs again on the next run).
    """

    def __init__(self, limit: int, tell: Callable[[TrialOutcome], None],
                 give_back: Callable[[int], None]) -> None:
        self.limit, self._tell, self._give_back = limit, tell, give_back
        self.held: list[TrialOutcome] = []
        #: off once a trial of the run completed or was pruned (or with ``limit`` 0)
        self.off = limit == 0

    @staticmethod
    def runs(outcomes: Sequence[TrialOutcome]) -> int:
        """The runs ``outcomes`` come from, a fused group's members counting as one (they
        share their architecture, and a failure may be that architecture's)."""
        return len({(o.attrs.get("fused_group"), None if o.attrs.get("fused_group") is not None
                     else o.number) for o in outcomes})

    @property
    def tripped(self) -> bool:
        """Whether the held failures reached the limit (the engine stops): trials of ``limit``
        `runs`."""
        return not self.off and self.runs(self.held) >= self.limit

    def tripped_at_end(self, first_tries: Callable[[TrialOutcome], bool]) -> bool:
        """Whether the held failures stop the study when its run has nothing more to train:
        those of first tries (``first_tries(outcome)``: not a trial run again) of two runs at
        least (one failure is no repetition), or of ``limit`` where it is one. A run makes
        fewer runs than ``limit`` where its study has fewer trials left (a small study, the
        last trials of a resumed one, a fused group holding several), and they all failed
        alike. Retries do not count: configurations that fail on purpose stop the study once,
        not at every rerun."""
        fresh = [o for o in self.held if first_tries(o)]
        return not self.off and self.runs(fresh) >= min(self.limit, 2)

    def hold(self, outcome: TrialOutcome) -> bool:
        """Whether ``outcome`` is held back from the study (else the caller tells it); a
        completed trial, or a failure raised elsewhere, first tells the held ones."""
        if self.off:
            return False
        trained = outcome.state == "pruned" and outcome.attrs.get("steps")  # by the pruner
        if outcome.state == "complete" or trained:
            self.off = True  # it trained and was scored: the task works
            self.release()
            return False
        if outcome.state != "failed" or not outcome.attrs.get(TRACEBACK):
            return False  # the configuration's own ending (rejected, misfit, non-finite): told
        if self.held and failure_key(self.held[0]) != failure_key(outcome):
            self.release()
        self.held.append(outcome)
        return True

    def error(self) -> RepeatedFailureError:
        """The error the engine raises once `tripped`."""
        last = self.held[-1]
        return RepeatedFailureError([o.number for o in self.held], last.reason,
                                    str(last.attrs.get(TRACEBACK, "")))

    def release(self) -> None:
        """Tell the held failures to the study as they are (the end of a run, a streak
        broken), one at a time: a stop between two leaves the rest held."""
        while self.held:
            self._tell(self.held.pop(0))

    def take_held(self) -> list[TrialOutcome]:
        """The held failures, no longer held (a stop takes them first, so that a trial told
        complete while it stops cannot tell them failed: `give_back_held`)."""
        held, self.held = self.held, []
        return held

    def give_back_held(self, held: list[TrialOutcome] | None = None) -> None:
        """Give the held trials (or ``held``, `take_held`'s) back to the study (a stop): the
        next run retries them."""
        if held is None:
            held = self.held
        while held:
            self._give_back(held.pop(0).number)
