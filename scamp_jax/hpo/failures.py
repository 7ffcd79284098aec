"""A study's first trials all failing with one error: a bug in the task, and the study stops.

A deterministic bug in a task (its ``evaluate``, its loss, its data, a model's code) fails every
trial the same way, each after its whole training: left alone, a study spends all its trials
on it. `RepeatedFailures` watches how a run's trials end. Until one of them completes (or is
pruned), the failures that come with an exception (a traceback) are held back from the study
while they repeat one error (the same reason: exception, message and place). Once the held
trials come from ``failure_limit`` runs (`scamp_jax.hpo.settings.EngineConfig.failure_limit`; a
fused group's members are one run), the engine stops its other trials and raises
`RepeatedFailureError`, and the held trials go back to the study as interrupted ones do: the
run after the fix trains them again (from their checkpoints) instead of counting them as
failed. A trial that completes, a failure for another reason and the end of the run tell the
held trials to the study as the failures they are; a failure without an exception (a loss that
turned non-finite, a configuration that fits nowhere) is the configuration's own and is never
held. A space that fails some configurations on purpose, by raising, sets ``failure_limit=0``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a leaf: the session imports it before Optuna
    from scamp_jax.hpo.study.trials import TrialOutcome

#: the attribute of a failed trial that holds its traceback (`scamp_jax.hpo.record.TrialRecord`).
TRACEBACK = "traceback"


class RepeatedFailureError(RuntimeError):
    """The first trials of a study's run all failed with the same error, e.g. a bug in the
    task; they went back to the study, and the next run trains them again.

    Attributes:
      trials: the numbers of the trials that failed alike.
      reason: their one reason (``Type: message (at file.py:LINE)``).
      traceback: the traceback of the last of them.
    """

    def __init__(self, trials: Sequence[int], reason: str, traceback: str) -> None:
        self.trials, self.reason, self.traceback = tuple(trials), reason, traceback
        super().__init__(self._message())

    def _message(self) -> str:
        *first, last = self.trials
        named = f"{', '.join(map(str, first))} and {last}" if first else str(last)
        return (f"trials {named}, the first of this run to end, all failed with the same error: "
                f"{self.reason}. That looks like a bug in the task, not in these "
                "configurations, so the study stopped; its trials that were running and these "
                f"{len(self.trials)} went back to it, and a rerun trains them again. Fix the "
                "error and run again; if some configurations fail on purpose, pass "
                "failure_limit=0 (or a larger one). The last trial's traceback:\n"
                f"{self.traceback.rstrip()}")

    def __reduce__(self) -> tuple:  # picklable: an MPI rank's error goes to rank 0
        return type(self), (self.trials, self.reason, self.traceback)


class RepeatedFailures:
    """The guard of one engine run (see the module doc).

    Args:
      limit: failures with one reason, none completed before, that stop the study (0: never).
      tell: tells the study how a trial ended.
      give_back: gives a live trial back to the study (it runs again on the next run).
    """

    def __init__(self, limit: int, tell: Callable[[TrialOutcome], None],
                 give_back: Callable[[int], None]) -> None:
        self.limit, self._tell, self._give_back = limit, tell, give_back
        self.held: list[TrialOutcome] = []
        #: off once a trial of the run completed or was pruned (or with ``limit`` 0)
        self.off = limit == 0

    @property
    def tripped(self) -> bool:
        """Whether the held failures reached the limit (the engine stops): trials of ``limit``
        runs, a fused group's members counting as one (they share their architecture, and a
        failure may be that architecture's)."""
        runs = {(o.attrs.get("fused_group"), None if o.attrs.get("fused_group") is not None
                 else o.number) for o in self.held}
        return not self.off and len(runs) >= self.limit

    def hold(self, outcome: TrialOutcome) -> bool:
        """Whether ``outcome`` is held back from the study (else the caller tells it); a
        completed trial, or a failure of another kind, first tells the held ones."""
        if self.off:
            return False
        if outcome.state != "failed" or not outcome.attrs.get(TRACEBACK):
            self.off = outcome.state in ("complete", "pruned")
            self.release()
            return False
        if self.held and self.held[0].reason != outcome.reason:
            self.release()
        self.held.append(outcome)
        return True

    def error(self) -> RepeatedFailureError:
        """The error the engine raises once `tripped`."""
        last = self.held[-1]
        return RepeatedFailureError([o.number for o in self.held], last.reason,
                                    str(last.attrs.get(TRACEBACK, "")))

    def release(self) -> None:
        """Tell the held failures to the study as they are (the end of a run that did not
        trip, or a streak broken)."""
        held, self.held = self.held, []
        for outcome in held:
            self._tell(outcome)

    def give_back_held(self) -> None:
        """Give the held trials back to the study (the run tripped): the next run retries them."""
        held, self.held = self.held, []
        for outcome in held:
            self._give_back(outcome.number)
