"""The trial types of the search loop: a leaf module (it imports no other part of `scamp_jax.hpo`
but the study's `AskedTrial`), so the engine, its planning service, its grouping service and the
trial lifecycle all depend on it and never on each other's modules.

- `PlannedTrial`: an asked configuration with its plan, waiting for devices;
- `TrialStatus`: the live, mutable progress of one trial (the live view reads it);
- `RunResult`: how one run of a trial ended, and `ending`, the one mapping from an exception to
  that ending (``oom``, ``failed`` or ``interrupted``) and its reason;
- `TrialDeferred`: a trial the engine hands to someone else (a trial spanning MPI ranks);
- `fusion_cap`: the most members of a fused group for a ``fuse`` setting;
- `trial_seed`, `booked_bytes`: a trial's seed and what its placement books per device.
"""

from __future__ import annotations

import math
import os
import sysconfig
import traceback
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scamp_jax.hpo.study.trials import AskedTrial, python_value

# the one byte rule, re-exported for the engine's modules
from scamp_jax.scheduling.booking import booked_bytes as booked_bytes

#: keys of a configuration that are optimizer hyperparameters, not architecture.
OPTIMIZER_KEYS = ("learning_rate", "weight_decay", "b1", "b2")


def model_config(params: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """Every key of configuration ``params`` but the optimizer's (`OPTIMIZER_KEYS`) with its
    value as text, sorted: what trials that share a model's program and initial state share
    (``build`` may read any of it). A NumPy scalar (or 0-d array) reads as its Python value: a
    sampler hands out a categorical's own choice (``np.float64(2.0)``), the study's storage
    the JSON value (``2.0``) to the siblings enqueued with it."""
    return tuple(sorted((k, repr(python_value(v)))
                        for k, v in params.items() if k not in OPTIMIZER_KEYS))

#: widest group ``fuse="auto"`` plans (the planner may choose fewer).
AUTO_FUSION_CAP = 8
#: widest group any ``fuse`` asks for: the group's compile grows with its width (on CPU a fused
#: step runs each member's convolutions apart; 1,000 small SwinIRs took 10 minutes and 7 GB of
#: host memory to compile), and a device that holds more members trains them no faster
MAX_FUSION_CAP = 64
_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OOM when allocating")
#: XLA's GPU autotuner, when it cannot allocate its buffers while a step compiles: "Failed to
#: get configs for 31 of 120 instructions ... allocate 3.40GiB" (it takes them from the same
#: pool as the trials, under the same limit).
_AUTOTUNE_FAILURE = "Failed to get configs"
_ALLOCATION_WORDS = ("alloc", "memory", "RESOURCE_EXHAUSTED")
#: Longest reason kept with a trial (the first line of an error, cut).
_REASON_CHARS = 300
#: Longest traceback kept with a failed trial (its last characters: the innermost frames).
TRACEBACK_CHARS = 20_000
#: Where installed packages and Python's own modules live: frames there are not the user's.
_LIBRARY_DIRS = tuple(sorted({str(Path(p)) for key in ("stdlib", "platstdlib", "purelib",
                                                        "platlib")
                              if (p := sysconfig.get_paths().get(key))}))


class TrialOutOfMemory(RuntimeError):
    """A trial's programs do not fit its share; carries the bytes per device it needs."""

    def __init__(self, message: str, bytes_needed: int | None = None) -> None:
        super().__init__(message)
        self.bytes_needed = bytes_needed


class TrialInterrupted(RuntimeError):
    """The engine asked the trial to stop (its state was checkpointed)."""


class TrialDeferred(Exception):  # noqa: N818 - a hand-over, not an error
    """Raised by the planning service for a trial this engine hands to someone else to run.

    The engine neither fails nor places it: it is listed in `SearchEngine.deferred` with this
    exception, whose ``payload`` says what the caller needs to run it (e.g. the MPI engine's
    trials that span ranks). Deferred trials stay open in the study until the caller tells them.
    """

    def __init__(self, message: str, payload: Any = None) -> None:
        super().__init__(message)
        self.payload = payload


@dataclass(frozen=True)
class PlannedTrial:
    """An asked configuration with its plan, waiting for devices."""

    asked: AskedTrial
    plan: Any
    devices: int
    arrival: int
    replans: int = 0

    @property
    def number(self) -> int:
        """The study's trial number."""
        return self.asked.number


@dataclass
class TrialStatus:
    """Live, mutable progress of one trial (read by the live view; written by its run)."""

    number: int
    params: Mapping[str, Any]
    state: str = "queued"
    devices: tuple[int, ...] = ()
    model_parallel: int = 1
    batch_size: int = 0
    predicted_peak_bytes: int = 0
    step: int = 0
    steps: int = 0
    loss: float = math.nan
    metric: float = math.nan
    #: the step ``metric`` was measured at (an intermediate evaluation's, or the last).
    metric_step: int = 0
    replans: int = 0
    reason: str = ""
    #: the traceback of the exception that failed the trial ("" for any other ending).
    traceback: str = ""
    #: ``time.monotonic()`` when this run's first training step began (after compile, restore),
    #: and the step it began at: the engine's measure of the trial's pace.
    training_since: float = math.nan
    first_step: int = 0
    #: times the engine restarted the trial on more devices (`scamp_jax.scheduling.elastic`).
    resizes: int = 0
    #: bytes per device the ledger booked for the trial's (last) run, its group's for a member.
    booked_bytes: int = 0
    #: the allocator's peak per device where the trial ran, measured after its first steps and
    #: at its end (`scamp_jax.hpo.calibration.measure_peak`), bytes; None: nothing reported.
    measured_peak_bytes: int | None = None
    #: the trial this one runs again after a run stopped it (`AskedTrial.retry_of`; None: none).
    retry_of: int | None = None
    #: seconds a training step took over this run's last training (from ``training_since`` to
    #: the last step's loss read back, less the checkpoints and intermediate evaluations
    #: between), for a run that trained all its steps; a fused member's is its group's. None:
    #: not measured.
    step_seconds: float | None = None


@dataclass(frozen=True)
class RunResult:
    """How one run of a trial ended.

    ``state``: ``complete`` (trained all its steps and evaluated), ``pruned`` (the study's
    pruner stopped it after an intermediate evaluation), ``failed`` (it raised, or its loss or
    metric turned non-finite; the reason is kept), ``oom`` (what it holds exceeds its booked
    share, or XLA ran out of memory: the engine re-plans it) or ``interrupted`` (the engine
    asked it to stop; it checkpointed first).

    ``metrics`` holds the task's evaluation for a complete run; ``bytes_needed`` the measured
    peak per device of an ``oom`` run when known; ``held_bytes`` what the run holds per device at
    most, from its compiled programs (training step + prefetched batch, or evaluation + what
    stays resident), when measured; ``checkpoint`` the directory of the final checkpoint of a
    complete run; ``resumed_from`` the checkpointed step training restarted from (0: none);
    ``measured_peak_bytes`` the allocator's peak on the run's devices, bytes (None: nothing
    reported, as on CPU devices); ``traceback`` the traceback of the exception that failed it
    (`failure_traceback`; "" for any other ending, a non-finite loss included).
    """

    number: int
    state: str
    steps: int
    wall_seconds: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""
    traceback: str = ""
    bytes_needed: int | None = None
    loss: float = math.nan
    checkpoint: Path | None = None
    resumed_from: int = 0
    held_bytes: int | None = None
    measured_peak_bytes: int | None = None


def is_oom_error(err: BaseException) -> bool:
    """True for XLA out-of-memory errors: allocation failures at run time, and at compile time
    (the autotuner's "Failed to get configs" when it could not allocate)."""
    if isinstance(err, TrialOutOfMemory | MemoryError):
        return True
    text = f"{type(err).__name__}: {err}"
    if _AUTOTUNE_FAILURE in text and any(w in text for w in _ALLOCATION_WORDS):
        return True
    return any(marker in text for marker in _OOM_MARKERS)


def ending(err: BaseException) -> tuple[str, str, int | None]:
    """How a trial (or every member of a group) that raised ``err`` ends: ``(state, reason,
    bytes_needed)`` with ``state`` one of ``interrupted``, ``oom`` or ``failed``.

    The one mapping from an exception to an ending, used by the solo and the fused lifecycle
    and by the engine (a configuration that cannot even be planned).
    """
    first_line = f"{type(err).__name__}: {err}".splitlines()[0][:_REASON_CHARS]
    if isinstance(err, TrialInterrupted):
        return "interrupted", str(err), None
    if is_oom_error(err):
        return ("oom", f"out of memory: {err}".splitlines()[0][:_REASON_CHARS],
                getattr(err, "bytes_needed", None))
    return "failed", first_line + _where(err), None


def _where(err: BaseException) -> str:
    """`` (at file.py:LINE)``: where ``err`` was raised in the user's code, the innermost frame
    outside this package, installed packages and Python's own modules (a task's ``evaluate``,
    not the NumPy or JAX function it called); "" where none is the user's: an error this
    package raised of what the user's code returned (``evaluate``'s scores, ``loss_fn``'s
    value), which its message names (the trial's traceback has every frame)."""
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ else []
    own = [f for f in frames if not _in_library(f.filename)]
    if not own:
        return ""
    return f" (at {Path(own[-1].filename).name}:{own[-1].lineno})"


#: This package's own directory: its frames are not the user's either (an editable install
#: is outside ``site-packages``).
_PACKAGE_DIR = tuple({str(Path(__file__).parents[1]) + os.sep,
                      str(Path(__file__).resolve().parents[1]) + os.sep})


def _in_library(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>
        return True
    parts = Path(filename).parts
    return ("site-packages" in parts or "dist-packages" in parts
            or filename.startswith(_LIBRARY_DIRS) or filename.startswith(_PACKAGE_DIR))


def failure_traceback(err: BaseException) -> str:
    """The traceback of ``err`` as Python prints it (its causes included), kept with a trial
    that it failed: at most `TRACEBACK_CHARS`, the innermost end where it is longer."""
    text = "".join(traceback.format_exception(err))
    return text if len(text) <= TRACEBACK_CHARS else "...\n" + text[-TRACEBACK_CHARS:]


def fusion_cap(fuse: int | str | None) -> int | None:
    """The most members per group for ``EngineConfig.fuse`` (None: fusion off).

    ``fuse`` is an int ``1 <= K <=`` `MAX_FUSION_CAP` (at most ``K``; 1 is off), ``"auto"``
    (the widest that fits, at most `AUTO_FUSION_CAP`) or None (off here; in a study the
    devices decide first, `scamp_jax.hpo.settings.SearchSettings.on_platform`).
    """
    if fuse is None:
        return None
    if fuse == "auto":
        return AUTO_FUSION_CAP
    if isinstance(fuse, bool) or not isinstance(fuse, int) or fuse < 1:
        raise ValueError(f"fuse={fuse!r} must be a positive int (the most trials per fused "
                         "group), 'auto' or None; e.g. fuse=4 or fuse='auto'")
    if fuse > MAX_FUSION_CAP:
        raise ValueError(f"fuse={fuse} asks for groups of more than {MAX_FUSION_CAP} trials, the "
                         "most one fused program holds (its compile grows with the group); pass "
                         f"at most {MAX_FUSION_CAP}: fuse={AUTO_FUSION_CAP} or fuse='auto', say")
    return fuse if fuse > 1 else None


def trial_seed(seed: int, checkpoint_key: str) -> int:
    """A per-trial seed that a re-run of an interrupted trial shares (keyed by checkpoint key)."""
    return (seed * 1_000_003 + zlib.crc32(checkpoint_key.encode())) % (2**31 - 1)
