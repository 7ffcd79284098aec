"""Where the search loop's trials come from: asking the study, and sorting the plans that come
back.

`Intake` keeps the source's pacing (an `AskLater` answer is asked again after its seconds, with
one line for the user while the engine waits for another process's trials; ``None`` means the
study has all its trials) and decides what becomes of a trial whose plan does not come back as
a plan: a `TrialDeferred` trial is listed for the caller, a candidate that cannot be built fails,
and one that fits nowhere fails too, except that until one candidate has fitted the misfits are
held back, so that a budget too small for any candidate stops the study
(`BudgetTooSmallError`) without spending its trials; one whose build raises
``optuna.TrialPruned`` is rejected by the space: told pruned.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from typing import Any

import optuna

from scamp_jax._units import format_bytes
from scamp_jax.hpo.study.trials import AskedTrial, AskLater, TrialSource
from scamp_jax.hpo.trial import TrialDeferred, TrialStatus, ending, failure_traceback
from scamp_jax.planning import planner


class BudgetTooSmallError(ValueError):
    """No candidate fits the device pool: the memory budget or the device count is too small."""


class Intake:
    """Asking ``source`` for trials and sorting their plans (see the module doc).

    Args:
      source: the study's trial source.
      nofit_limit: consecutive candidates that fit nowhere, with none fitting before (in this
        run, nor a trial of the study trained in an earlier one), after which the study stops
        with `BudgetTooSmallError`.
      pool: ``(devices, bytes per device)`` of the pool, for that error's message.
      tell_failed: ``tell_failed(number)`` tells the study that trial ``number`` failed (its
        status holds the reason).
      on_notice: a line for the user while the engine waits for other processes' trials, and
        ``""`` when the wait is over (None: silent).
    """

    def __init__(self, source: TrialSource, nofit_limit: int, pool: tuple[int, int],
                 tell_failed: Callable[[int], None],
                 on_notice: Callable[[str], None] | None = None) -> None:
        self.source, self.nofit_limit, self.pool = source, nofit_limit, pool
        self.tell_failed, self.on_notice = tell_failed, on_notice
        #: trials whose plan raised `TrialDeferred`: ``(asked, exception)``, in planning order.
        self.deferred: list[tuple[AskedTrial, TrialDeferred]] = []
        self.ever_fit = False
        self._trained: bool | None = None  # `_trained_before`, once asked
        self.nofit: list[tuple[int, str]] = []
        self.reset()

    def reset(self) -> None:
        """A fresh run: the study may have trials again."""
        self.exhausted = False
        self.ask_at = 0.0  # monotonic time before which the source said not to ask again
        self.later: AskLater | None = None  # the source's last "ask again later"
        self.noticed: tuple[int, ...] | None = None  # the trials the last notice named
        #: seconds `wait` slept: the engine had nothing to run but trials another process
        #: holds (or held, until their heartbeat is stale), so every device of it idled
        self.waited_s = 0.0

    def may_ask(self) -> bool:
        """Whether asking now may give a trial (the study is not full, no wait pending)."""
        return not self.exhausted and time.monotonic() >= self.ask_at

    def ask(self) -> AskedTrial | None:
        """The next trial; None when there is none now (the study is full: ``exhausted``, or
        the source said to ask again later: ``ask_at``)."""
        asked = self.source.ask()
        take_rejected = getattr(self.source, "take_rejected", None)  # a stand-in may lack it
        for line in take_rejected() if take_rejected is not None else ():
            if self.on_notice is not None:
                self.on_notice(line)
        if isinstance(asked, AskLater):
            self.ask_at = time.monotonic() + asked.seconds
            self.later = asked
            return None
        if asked is None:
            self.exhausted = True
            return None
        self.later = None
        if self.noticed is not None and self.on_notice is not None:
            self.noticed = None
            self.on_notice("")  # the wait is over
        return asked

    def wait(self) -> None:
        """Nothing of the engine's own to do, but the study may still need work (another
        process's trial may go stale): tell the user for what, then sleep until the source
        said to ask again."""
        later = self.later
        if self.on_notice is not None and later is not None and later.trials != self.noticed:
            self.noticed = later.trials
            self.on_notice(
                f"waiting for trial(s) {list(later.trials)}, marked running by another "
                "process, live or on another machine (where one stopped hard, by a second "
                "Ctrl-C or a kill): they finish there, or are run again here once their "
                "heartbeat is stale")
        start = time.monotonic()
        time.sleep(max(0.0, self.ask_at - start))
        self.waited_s += time.monotonic() - start

    def sort(self, asked: AskedTrial, future: cf.Future, status: TrialStatus) -> Any | None:
        """The plan of ``asked`` from its planning ``future``; None when it is deferred,
        failed (told) or held back as a misfit. Raises `BudgetTooSmallError` once
        ``nofit_limit`` misfits came before any fit."""
        try:
            plan = future.result()
        except TrialDeferred as deferred:
            status.state, status.reason = "deferred", str(deferred)
            self.deferred.append((asked, deferred))
            self._fits()  # on several ranks it fits: the budget holds candidates
            return None
        except planner.DoesNotFitError as err:
            status.state, status.reason = "failed", f"does not fit: {err}"
            if not self.ever_fit and self._trained_before():
                self._fits()  # an earlier run trained trials at the study's budget
            if self.ever_fit:
                self.tell_failed(asked.number)
                return None
            # Until one candidate fits, a misfit may mean the budget is wrong, not the candidate.
            self.nofit.append((asked.number, status.reason))
            if len(self.nofit) >= self.nofit_limit:
                self.budget_too_small(err)
            return None
        except optuna.TrialPruned as err:  # the space's build rejects this configuration
            status.state, status.reason = "pruned", f"pruned by the search space's build: {err}"
            self.tell_failed(asked.number)
            return None
        except Exception as err:  # noqa: BLE001 - a candidate that cannot even be built
            status.state, status.reason = "failed", ending(err)[1]
            status.traceback = failure_traceback(err)
            self.tell_failed(asked.number)
            return None
        self._fits()
        return plan

    def _trained_before(self) -> bool:
        """Whether the study trained a trial on at most this pool's devices in an earlier run
        (asked once, at the first misfit): this pool of its budget (a stored setting) holds
        candidates, so a misfit is the configuration's own and not given back to be asked
        first on every rerun. A smaller pool than the study trained on is not known to hold
        any: its misfits may still mean the pool is wrong."""
        if self._trained is None:
            trained_any = getattr(self.source, "trained_any", None)  # a source of one's own
            self._trained = (bool(trained_any(self.pool[0])) if trained_any is not None
                             else False)
        return self._trained

    def _fits(self) -> None:
        """A candidate fits (here, or spanning ranks): misfits held back until then fail."""
        if not self.ever_fit:
            self.ever_fit = True
            for number, _ in self.nofit:
                self.tell_failed(number)
            self.nofit.clear()

    def held_back(self) -> list[int]:
        """The misfits held back until a candidate fits, no longer held (a stop gives them
        back to the study with the rest: not their fault)."""
        numbers = [number for number, _ in self.nofit]
        self.nofit.clear()
        return numbers

    def finish(self) -> None:
        """At the end of a run: raise `BudgetTooSmallError` if only misfits came."""
        if self.nofit:
            self.budget_too_small(planner.DoesNotFitError(self.nofit[-1][1], 0, self.pool[1]))

    def budget_too_small(self, err: Exception) -> None:
        """Give the held-back misfits back to the study and stop with `BudgetTooSmallError`."""
        for number, _ in self.nofit:  # not their fault: a run with a bigger budget retries them
            self.source.interrupt(number)
        count = len(self.nofit)
        self.nofit.clear()
        raise BudgetTooSmallError(
            f"none of the first {count} candidates fits the pool of {self.pool[0]} devices with "
            f"{format_bytes(self.pool[1])} each (last: {err}); raise memory_per_device or "
            "devices, or shrink the search space"
        ) from err
