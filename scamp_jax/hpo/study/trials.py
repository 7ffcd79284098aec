"""What the engine and the study say to each other: an asked trial, "ask again later", an outcome,
and the `TrialSource` protocol (a local study or a remote proxy of one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

#: user attribute naming the checkpoint directory a trial writes to (shared by its re-runs).
CHECKPOINT_KEY = "checkpoint_key"
#: user attribute holding why a trial failed.
FAIL_REASON = "fail_reason"
#: fail reason of a trial whose process was stopped before it finished (it is re-enqueued).
INTERRUPTED = "interrupted"
#: user attribute of a trial enqueued to share another trial's architecture: that trial's number.
SIBLING_OF = "fusion_sibling_of"
#: user attribute of a running proposal: how many of its siblings its source still holds.
HELD_SIBLINGS = "fusion_siblings_held"
#: user attribute holding a trial's whole configuration where ``space.suggest`` returned more
#: than Optuna drew (constants, derived values) or changed a drawn value, so the results can
#: rebuild its model.
CONFIGURATION = "configuration"


def configuration(params: Mapping[str, Any], attrs: Mapping[str, Any]) -> dict[str, Any]:
    """A stored trial's configuration as ``space.suggest`` made it: the values `CONFIGURATION`
    stores, in the order ``suggest`` returned them (a drawn value ``suggest`` changed is shown
    as it trained), then its Optuna ``params`` that are not among them."""
    whole = attrs.get(CONFIGURATION)
    if not whole:
        return dict(params)
    out = dict(whole)
    out.update((k, v) for k, v in params.items() if k not in out)
    return out


@dataclass(frozen=True)
class AskedTrial:
    """One configuration to evaluate.

    Attributes:
      number: the study's trial number.
      params: the configuration (model and training hyperparameters), as ``space.suggest`` made it.
      checkpoint_key: name of the trial's checkpoint directory; a re-run of an interrupted trial
        keeps its predecessor's key so it resumes from the same checkpoints.
      siblings: trials with this one's architecture that the source hands to the same asker
        next (fusion; see `OptunaTrialSource`'s ``siblings``); 0 for any other trial.
      sibling_of: number of the trial whose architecture this one shares as a sibling
        (None: the sampler or a user chose it).
      retry_of: number of the trial this one runs again, where a run stopped it (Ctrl-C, a
        dead process) and it resumes from that trial's checkpoints (None: a first attempt).
    """

    number: int
    params: Mapping[str, Any]
    checkpoint_key: str
    siblings: int = 0
    sibling_of: int | None = None
    retry_of: int | None = None


@dataclass(frozen=True)
class AskLater:
    """`TrialSource.ask`'s answer "nothing to hand out now, ask again in ``seconds``".

    The study has reached its total, but trials of other processes are still running: one whose
    process died goes stale after the grace period and its retry must be asked then. ``None``,
    by contrast, means the study needs nothing more from the asker.
    """

    seconds: float
    #: numbers of the other processes' running trials it waits for (to tell the user).
    trials: tuple[int, ...] = ()


def when_full(foreign_running: Sequence[int], has_liveness: bool,
              poll_seconds: float) -> AskLater | None:
    """The answer of an ask that found nothing to hand out.

    ``foreign_running``: numbers of the trials ``RUNNING`` in the storage that the asking source
    did not hand out (other processes', or a dead job's whose heartbeat is not stale yet). With a
    heartbeat each of them either finishes or goes stale and is retried, so the asker is told to
    ask again in ``poll_seconds``; without one (or with none running) the study is done for it.
    The source's own running trials do not matter: it tells them itself.
    """
    if foreign_running and has_liveness:
        return AskLater(poll_seconds, tuple(sorted(foreign_running)))
    return None


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended, as the study is told.

    Attributes:
      number: the study's trial number.
      state: ``"complete"``, ``"pruned"`` or ``"failed"``.
      value: the objective (the task's metric) for a complete trial, else ``None``.
      reason: why a trial failed or was pruned (empty for a complete one).
      attrs: extra JSON-serialisable facts to store with the trial (devices, batch size, ...).
    """

    number: int
    state: str
    value: float | None = None
    reason: str = ""
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in ("complete", "pruned", "failed"):
            raise ValueError(
                f"state={self.state!r} is not a trial outcome; use 'complete', 'pruned' or 'failed'"
            )
        if self.state == "complete" and self.value is None:
            raise ValueError(f"trial {self.number} is complete but has no value; pass value=")


class TrialSource(Protocol):
    """Where configurations come from and where results go (local study or a remote proxy)."""

    def remaining(self) -> int:
        """Trials still to be asked before the study reaches its total."""
        ...

    def ask(self) -> AskedTrial | AskLater | None:
        """Next configuration; `AskLater` when there is none now but the study may still need
        one (ask again after its ``seconds``); ``None`` when the study needs nothing more."""
        ...

    def report(self, number: int, step: int, value: float) -> bool:
        """Record an intermediate objective value; return True if the trial should be pruned."""
        ...

    def tell(self, outcome: TrialOutcome) -> None:
        """Record how a trial ended."""
        ...

    def progress(self, number: int, wall_seconds: float) -> None:
        """Store ``wall_seconds``, what a running trial's runs took up to its newest
        checkpoint (an attempt whose process dies keeps them, for its retry's record)."""
        ...

    def interrupt(self, number: int, wall_seconds: float = 0.0) -> None:
        """Mark a started trial as interrupted and queue its configuration to run again;
        ``wall_seconds``: what its runs took so far (its retry's record adds them)."""
        ...

    def trained_any(self, devices: int) -> bool:
        """Whether a trial of the study trained on at most ``devices`` devices in any run (so
        such a pool of its budget holds candidates, and a misfit is the configuration's
        own)."""
        ...

    def held_siblings(self, proposal: int) -> int:
        """Siblings of trial ``proposal`` the source holds and has not handed out yet (0 once
        every one was asked, rejected by the space's ``suggest`` or given up). The engine asks
        them past its lookahead and a fused group waits for them; a source without siblings
        answers 0."""
        ...




def python_value(value: Any) -> Any:
    """``value`` as Python's own number or flag where it is NumPy's (a scalar or a 0-d array):
    what a study stores and how trials' configurations compare."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item()
    return value
