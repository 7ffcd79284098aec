"""Flags, checks and the run loop shared by the HPO entry points (``swinir_hpo``,
``vit_synthetic``), and the one handler of user mistakes every entry point uses.

JAX initialises a backend only after the flags are read, so ``--devices`` can split the CPU
into enough devices first. Every mistake a user can make ends in one line,
``error: <what is wrong>; <what to pass instead>`` with flag names, and exit status 2
(`user_errors`); checks that need no study run before the study database is created
(`check_study_dir`, `check_storage`), so a rejected command leaves nothing behind. Ctrl-C exits
130 and SIGTERM 143 (128 + the signal), both after the running trials are checkpointed and
``results.json`` is written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from experiments import _interrupted_while_starting
from scamp_jax._signals import Terminated as Terminated  # SIGTERM's stop, as Ctrl-C's
from scamp_jax._signals import interruptible, left_behind
from scamp_jax._sqlite import DISK_REFUSED
from scamp_jax.hpo.settings import (
    CHECKPOINT_MIN_SECONDS,
    ELASTIC,
    GRACE_PERIOD,
    PRUNERS,
    SAMPLERS,
    STEP_INTERVALS,
    SearchSettings,
    idle_pruner,
)
from scamp_jax.scheduling.placement import POLICIES

#: CPU devices the entry points split the host into (the default device pool on CPU).
CPU_DEVICES = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class HPOConfig(SearchSettings):
    """One HPO experiment: the study's `scamp_jax.hpo.settings.SearchSettings` (the session reads
    only those fields) plus the entry points' own flags.

    Attributes:
      devices: devices of the pool (None: every device of the backend).
      memory_per_device: budget per device, e.g. ``"1GiB"`` (None: the device limit on GPUs).
      study_dir: as in `SearchSettings` (default ``runs/hpo``).
      space_variant: the model family's search-space variant (``"small"``, ``"paper"``, ...).
      train_dir: directory of training images (None: the task's built-in images).
      eval_dir: directory of held-out images (None: the task's built-in held-out set).
      test_dir: directory of test images the best model is tested on (None: the task's
        built-in test set); not kept by the study, as no trial's score depends on it.
    """

    preset: str
    devices: int | None
    memory_per_device: str | None
    study_dir: str | Path = "runs/hpo"
    space_variant: str = "small"
    train_dir: str | None = None
    eval_dir: str | None = None
    test_dir: str | None = None

    def study_record(self, space: Any, memory_per_device: int) -> dict[str, Any]:
        """`SearchSettings.study_record` plus the image folders where they are given (their
        absolute paths): a study scored on one held-out set is not resumed on another."""
        record = super().study_record(space, memory_per_device)
        for key in ("train_dir", "eval_dir"):
            folder = getattr(self, key)
            if folder is not None:
                record[key] = str(Path(folder).resolve())
        return record


#: A flag's value that starts as a negative number and goes on as no number does (a size with
#: its unit, ``-1GiB``): argparse reads a plain negative number as a value already.
_NEGATIVE_VALUE = re.compile(r"-\.?\d[\d.]*[^\d.]")


class Parser(argparse.ArgumentParser):
    """argparse's parser that reads ``--flag -1GiB`` as ``--flag=-1GiB``: a long flag's next
    word that starts as a negative number is its value, so that a negative size gets the
    flag's own error ("must be positive") where argparse, which takes only plain numbers so,
    says "expected one argument"."""

    def parse_known_args(  # type: ignore[override]  # argparse's overloads, one body
            self, args: Sequence[str] | None = None,
            namespace: argparse.Namespace | None = None) -> Any:
        words = list(sys.argv[1:] if args is None else args)
        joined: list[str] = []
        for word in words:
            if (joined and joined[-1].startswith("--") and "--" not in joined[:-1]
                    and joined[-1] != "--" and "=" not in joined[-1]
                    and _NEGATIVE_VALUE.match(word)):
                joined[-1] = f"{joined[-1]}={word}"
            else:
                joined.append(word)
        return super().parse_known_args(joined, namespace)


def _int_at_least(text: str, minimum: int, what: str, words: str = "") -> int:
    """``text`` as an int of at least ``minimum`` (``what`` says the bound, ``words`` the other
    values the flag takes, for the error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer{words}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be {what}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "at least 1")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "0 (off) or more")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 (off) or more")
    return value


def study_name(text: str) -> str:
    """argparse type of ``--study-name``: a name (left out: the search space's)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "an empty name names no study; pass a name, or leave --study-name out for the "
            "search space's name")
    return text


def output_file(text: str) -> Path:
    """argparse type of a file a command writes when its work is done (``--json FILE``,
    ``--out FILE``): one that can be written, its folder made where missing, checked before
    the work (`scamp_jax.hpo.session.check_file`), so that the work is not lost to a bad path."""
    from scamp_jax.hpo.session import check_file

    try:
        check_file(text, "")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return Path(text)


def output_dir(text: str) -> Path:
    """argparse type of a folder a command writes into (``--out DIR``): one that is, or can
    become, a folder this process writes (`scamp_jax.hpo.session.check_directory`)."""
    from scamp_jax.hpo.session import check_directory

    try:
        check_directory(text, "")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return Path(text)


def fusion_width(text: str) -> int | str:
    """argparse type of ``--fuse``: ``auto`` (any case) or an integer from 1 to
    `scamp_jax.hpo.trial.MAX_FUSION_CAP`."""
    from scamp_jax.hpo.trial import fusion_cap

    if text.strip().lower() == "auto":
        return "auto"
    value = _int_at_least(text, 1, "at least 1 (1: no fusion), or auto", " or auto")
    try:
        fusion_cap(value)  # the library's bounds, said as flags
    except ValueError as err:
        raise argparse.ArgumentTypeError(as_flags(str(err))) from None
    return value


def memory_size(text: str) -> str:
    """argparse type of ``--memory-per-device``: a size `scamp_jax._units.parse_bytes` reads
    (kept as written: the study records it so); a number under 1 KiB without its unit is a
    size whose unit was left out, as `parse_bytes` says of a fraction of a byte."""
    from scamp_jax._units import names_a_unit, parse_bytes

    try:
        count = parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if count < 2**10 and not names_a_unit(text):
        raise argparse.ArgumentTypeError(
            f"memory size {text!r} is {count} bytes; did you leave out its unit? e.g. "
            f"'{text.strip()}GiB' or '{text.strip()}GB'")
    return text


def running_cap(text: str) -> int | str:
    """argparse type of ``--max-running-trials``: ``auto``, ``none`` (no cap) or an integer
    >= 1."""
    if text.strip().lower() in ("auto", "none"):
        return text.strip().lower()
    return _int_at_least(text, 1, "at least 1, or auto, or none", ", auto or none")


def add_flags(parser: argparse.ArgumentParser, presets: Sequence[str], study_dir: str,
              image_folders: bool = False) -> None:
    """The flags every HPO entry point takes; unset flags keep the preset's value.
    ``image_folders``: the experiment takes ``--train-dir`` and ``--eval-dir`` (which a study
    keeps too)."""
    parser.add_argument("--preset", default="default", choices=list(presets),
                        help="size of the search: 'smoke' finishes in a few minutes on 2 CPU "
                        "cores, 'default' in about five, 'paper' is cluster-sized")
    parser.add_argument("--trials", type=positive_int,
                        help="total trials of the study; a resumed study runs only the "
                        "missing ones")
    parser.add_argument("--steps", type=positive_int,
                        help="training steps per trial at the preset's reference batch size: "
                        "a trial whose plan gives it batch b trains steps x reference / b "
                        "steps, so every trial sees as many samples (--plan-only shows each "
                        "trial's steps)")
    parser.add_argument("--devices", type=positive_int,
                        help="how many of the backend's devices form the pool (default: the "
                        "preset's on CPU, all on GPUs; on CPU the host is split into "
                        f"max({CPU_DEVICES}, this) devices)")
    parser.add_argument("--memory-per-device", type=memory_size,
                        help="memory budget per device, e.g. '1GiB', '512MiB' (default: the "
                        "preset's on CPU; on GPUs, and with --target, the pool JAX's allocator "
                        "takes on the card: 75%% of its memory for a process alone on it, "
                        "XLA's default)")
    parser.add_argument("--max-batch-size", type=positive_int,
                        help="cap on every trial's global batch (default: the preset's)")
    parser.add_argument("--min-batch-size", type=positive_int,
                        help="smallest global batch a trial may train with (default: any); a "
                        "trial whose largest fitting batch is smaller needs more devices, and "
                        "under mpirun one that one rank cannot hold spans ranks data-parallel")
    parser.add_argument("--policy", choices=POLICIES,
                        help="placement: 'scamp' packs trials by planned memory (default), "
                        "'fixed' gives each trial --devices-per-trial devices and one batch size")
    parser.add_argument("--devices-per-trial", type=positive_int,
                        help="devices per trial under --policy fixed, which it needs (default: "
                        "2; --preset paper 4)")
    parser.add_argument("--elastic", choices=tuple(ELASTIC),
                        help="at the end of the study, let ScaMP put devices that would idle to "
                        "work: queued trials start on more devices, running ones restart from a "
                        "checkpoint on more devices with the same batch (default auto: on for "
                        "GPUs, off for CPU devices, which share one host's cores)")
    parser.add_argument("--fuse", type=fusion_width, metavar="K|auto",
                        help="horizontal fusion: after the sampler proposes an architecture, "
                        "enqueue up to K-1 sibling trials with it (their learning rates left to "
                        "the sampler) and train queued trials of one architecture as one fused, "
                        "vmapped step of up to K members, as wide as the planner fits in memory; "
                        "each member stays its own trial; K is at most 64, and at most "
                        "--trials. 'auto': the planner's widest fitting group, at most 8 "
                        "(default: auto on GPUs, off on CPU devices)")
    parser.add_argument("--max-running-trials", type=running_cap, metavar="N|auto|none",
                        help="most trials (or fused groups) training at once, the rest queued: "
                        "'auto' is one per two host cores on CPU devices, which share the "
                        "host's cores, and no cap on accelerators; 'none': as many as the "
                        "pool's memory holds (default: the preset's, 'auto' unless said below)")
    parser.add_argument("--sampler", choices=SAMPLERS,
                        help="Optuna sampler, seeded: tpe, random, or grid (the search "
                        "space's grid; the study ends once every point ran) (default: the "
                        "preset's, tpe)")
    parser.add_argument("--pruner", choices=PRUNERS,
                        help="Optuna pruner fed by intermediate evaluations (--eval-every): "
                        "median, halving (successive halving: keeps the best share of "
                        "trials at each rung) or none (default: the preset's)")
    parser.add_argument("--eval-every", type=non_negative_int, metavar="N",
                        help="steps between intermediate evaluations reported to the pruner, "
                        "counted as --steps are, at the preset's reference batch (a trial at "
                        "another batch is evaluated after as many samples; 0: off; default: "
                        "the preset's, scaled with --steps)")
    parser.add_argument("--checkpoint-every", type=non_negative_int, metavar="N",
                        help="steps between a trial's checkpoints, which a stopped study resumes "
                        "from, counted as --steps are (a trial at another batch checkpoints after "
                        "as many samples; 0: only at the end; default: the preset's, scaled with "
                        "--steps; --checkpoint-min-seconds may skip some)")
    parser.add_argument("--checkpoint-min-seconds", type=non_negative_float, metavar="S",
                        help="least seconds of training between two of a trial's checkpoints "
                        "before its last: one --checkpoint-every makes due sooner is not "
                        "written, so a study killed outright loses at most about S seconds plus "
                        "--checkpoint-every steps of each running trial (Ctrl-C and SIGTERM "
                        "still write one; 0: every --checkpoint-every steps; default "
                        f"{CHECKPOINT_MIN_SECONDS:g})")
    parser.add_argument("--seed", type=int, help="seed of the sampler, initialisation and data")
    parser.add_argument("--failure-limit", type=non_negative_int, metavar="N",
                        help="stop the study when trials of N runs (a fused group is one) "
                        "raise the same error, the same exception at the same place, one after "
                        "another and before any trial of the run completed: a bug in the task, "
                        "not the configurations; they go back to the study and the next run "
                        "trains them from the start (default 3; 2 of first tries when the run "
                        "has nothing more to train; 0: never stop, for a space "
                        "that fails some configurations on purpose)")
    parser.add_argument("--study-dir", default=None,
                        help=f"directory of the study database, checkpoints, results and plots "
                        f"(default {study_dir}); running again on it resumes the study")
    parser.add_argument("--storage",
                        help="SQLAlchemy URL of the study (default: sqlite file in --study-dir); "
                        "e.g. postgresql+psycopg://user@host/db (the postgres extra: "
                        "pip install 'scamp-jax[postgres]')")
    parser.add_argument("--study-name", type=study_name,
                        help="name of the study in the storage (default: the search space's); "
                        "another name starts a new study, its outputs in --study-dir/NAME. "
                        "A study keeps its preset, steps, seed and memory budget"
                        + (" (and its image folders, --train-dir and --eval-dir)"
                           if image_folders else "")
                        + ": a rerun with other values is refused")
    parser.add_argument("--no-live", action="store_true",
                        help="plain log lines instead of the live table")
    parser.add_argument("--plan-only", action="store_true",
                        help="plan the first --trials candidates a new study would draw (devices, "
                        "model-parallel degree, batch, bytes per device, CPU seconds of "
                        "planning; with --fuse, each architecture's fused group and its bytes "
                        "per device) and stop: nothing trains and no study is stored; the "
                        "plans are kept in --study-dir's plans.sqlite (without --target, their "
                        "programs in its jax_cache too), so planning again compiles none of "
                        "them, nor does a study on these devices (on CPU devices, not its steps "
                        "either)")
    from scamp_jax.planning.targets import TARGETS

    parser.add_argument("--target", metavar="GPU|FILE",
                        help="with --plan-only: plan for --devices GPUs of this kind, compiled "
                        f"here without one ({', '.join(TARGETS)}, or a GpuTargetConfigProto "
                        "text file; needs pip install 'scamp-jax[gpu-plan]')")


STOPPING_TEXT = (
    "Stopping and resuming: Ctrl-C (or SIGTERM) stops the running trials at their next step "
    "with a checkpoint and exits with status 130 (143 for SIGTERM); a second Ctrl-C stops at "
    "once. The same command run again keeps every finished trial and resumes the stopped ones "
    "from their checkpoints (after a stop at once: on the same machine at once, on another once "
    "their heartbeat lapses, about a minute).")


def preset_text(name: str, c: HPOConfig) -> str:
    """What preset ``c`` sets, for ``--help``'s epilog: ``name: 6 trials of 1,000 steps, ...``
    (read from the config itself, so help and preset cannot disagree)."""
    devices = f"{c.devices} devices" if c.devices else "every device"
    memory = (f"{c.memory_per_device} each on CPU devices, a GPU's own pool on GPUs"
              if c.memory_per_device else "each with its own memory")
    cap = c.max_running_trials
    running = ("no cap on running trials" if cap is None else
               f"--max-running-trials {cap}" if isinstance(cap, str) else f"at most {cap} running")
    pruning = ("no pruning" if c.pruner == "none" else
               f"pruner {c.pruner} (evaluations every {c.eval_every:,} steps)"
               if idle_pruner(c) is None else
               f"no pruning (pruner {c.pruner} without an evaluation before the last step: "
               "pass --eval-every below --steps)")
    steps = f"{c.steps:,} steps" + (f" at batch {c.reference_batch:,}" if c.reference_batch
                                     else "")
    checkpoints = (f"a checkpoint every {c.checkpoint_every:,} steps" if c.checkpoint_every
                   else "a checkpoint at the end only")
    if c.checkpoint_every and c.checkpoint_min_seconds:
        checkpoints += f" ({c.checkpoint_min_seconds:g} s of training apart at least)"
    return (f"{name}: {c.trials} trials of {steps}, {devices} ({memory}), batches up "
            f"to {c.max_batch_size:,}, sampler {c.sampler}, {pruning}, {checkpoints}, "
            f"{running}, seed {c.seed}")


def config_from_args(args: argparse.Namespace, base: HPOConfig, study_dir: str) -> HPOConfig:
    """``base`` with every flag the user set applied on top."""
    overrides = {}
    for name in _FLAGGED:
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if overrides.get("max_running_trials") == "none":  # --max-running-trials none: no cap
        overrides["max_running_trials"] = None
    for every in STEP_INTERVALS:
        if "steps" in overrides and every not in overrides and getattr(base, every):
            # as many checkpoints and evaluations per trial as the preset makes (25 of 100
            # steps: every 250 of 1000)
            overrides[every] = max(1, round(getattr(base, every) * overrides["steps"]
                                            / base.steps))
    overrides["study_dir"] = study_dir if args.study_dir is None else args.study_dir
    if "devices_per_trial" in overrides and overrides.get("policy", base.policy) != "fixed":
        fail(f"--devices-per-trial {overrides['devices_per_trial']} applies to --policy fixed "
             "only (the default policy, scamp, chooses each trial's devices from its memory); "
             "add --policy fixed, or leave --devices-per-trial out")
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as err:  # SearchSettings names the field: in_flags names its flag
        fail(in_flags(err))
        raise


#: The settings the HPO command lines take as flags (``--max-batch-size`` for
#: ``max_batch_size``), applied over the preset by `config_from_args`.
_FLAGGED = ("trials", "steps", "devices", "memory_per_device", "policy", "devices_per_trial",
            "max_batch_size", "min_batch_size", "elastic", "sampler", "pruner", "eval_every",
            "seed", "storage", "train_dir", "eval_dir", "test_dir", "study_name", "fuse",
            "max_running_trials", "failure_limit", "checkpoint_every", "checkpoint_min_seconds")
_FLAG_OF = {name: "--" + name.replace("_", "-") for name in (*_FLAGGED, "study_dir")}


def as_flags(message: str) -> str:
    """``message`` with the library's keywords as the command line's flags: "pass
    memory_per_device ..." or "raise memory_per_device or devices" become "pass
    --memory-per-device ...", "raise --memory-per-device or --devices", and a setting's value
    "min_batch_size=64" becomes "--min-batch-size 64" (not inside a call such as
    "plan_mesh(model, memory_per_device='2GiB')")."""
    names = "|".join(_FLAG_OF)
    message = re.sub(rf"(?<!, )(?<![(\w.\-&?/])\b({names})=('[^']*'|[^\s,;)]+)",
                     lambda m: f"{_FLAG_OF[m[1]]} {m[2]}", message)
    message = re.sub(rf"\b(raise|lower)\s+({names}) or ({names})\b",
                     lambda m: f"{m[1]} {_FLAG_OF[m[2]]} or {_FLAG_OF[m[3]]}", message)
    alone = "|".join(k for k in _FLAG_OF if k not in ("devices", "trials", "steps", "seed"))
    message = re.sub(rf"\b(pass|raise|lower|more)\s+(another\s+)?({alone})\b",  # not "pass devices"
                     lambda m: f"{m[1]} {m[2] or ''}{_FLAG_OF[m[3]]}", message)
    # a keyword of two words or more where a sentence names it ("a folder in study_dir"),
    # unambiguous as a flag, not inside a call nor as a keyword argument
    joined = "|".join(k for k in _FLAG_OF if "_" in k)
    return re.sub(rf"(?<!, )(?<![(\w.\-&?/<])\b({joined})\b(?![=(\w>])",
                  lambda m: _FLAG_OF[m[1]], message)


class _WarningsInFlags(logging.Handler):
    """Words the library's warnings with the command line's flags (`as_flags`), in the record
    itself, so that the handlers after it (the root logger's, where a package configured
    one) print them so worded; where no other handler would print it, it prints the message
    on stderr, as Python does with a warning nothing handles."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = as_flags(record.getMessage()), None
            if not self._printed_by_others(record):
                print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's own rule: a failed message never raises
            self.handleError(record)

    def _printed_by_others(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self and record.levelno >= h.level for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


class _CommandFormat(logging.Formatter):
    """How a command prints what is logged: the library's warnings as their words alone (as
    `_WarningsInFlags` worded them), any other package's in logging's default format."""

    def __init__(self) -> None:
        super().__init__(logging.BASIC_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if record.name.split(".", 1)[0] in _OURS:
            return record.getMessage()
        return super().format(record)


#: The packages whose warnings a command says in its flags: the library and its search spaces.
_OURS = ("scamp_jax", "search_spaces")


@contextlib.contextmanager
def warnings_in_flags() -> Iterator[None]:
    """Word the library's warnings (``scamp_jax``'s loggers) in the command line's flags while
    the command runs. Where nothing configured logging, the command prints what is logged
    (`_CommandFormat`): else the first package to log configures it in logging's default
    format (absl does, as orbax loads), and the library's warnings would print as
    ``WARNING:scamp_jax.hpo.lifecycle:...``; the search spaces' (``search_spaces``) alike."""
    loggers = [logging.getLogger(name) for name in _OURS]
    if any(isinstance(h, _WarningsInFlags) for h in loggers[0].handlers):
        yield  # an outer command's
        return
    handler = _WarningsInFlags()
    for logger in loggers:
        logger.addHandler(handler)
    printer = None
    if not logging.root.handlers:
        printer = logging.StreamHandler()
        printer.setFormatter(_CommandFormat())
        logging.root.addHandler(printer)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        if printer is not None:
            logging.root.removeHandler(printer)


def in_flags(err: BaseException) -> str:
    """A library error as the command line says it: its `as_command_line` where it has one
    (`scamp_jax.hpo.study.StudySettingsError`), else its message with the library's keywords
    as flags (`as_flags`)."""
    as_command_line = getattr(err, "as_command_line", None)
    return as_command_line() if as_command_line else as_flags(str(err))


#: Set to ``1`` to print the traceback of every error the command lines end in one line (the GPU
#: suite sets it for its sections, whose logs are all a GPU slot brings back).
TRACEBACK_VARIABLE = "SCAMP_TRACEBACK"

_OWN_CODE = tuple(os.path.realpath(Path(__file__).resolve().parents[1] / name) + os.sep
                  for name in ("scamp_jax", "experiments", "benchmarks", "search_spaces",
                               "examples"))
#: JAX's note on an error whose traceback it cut at its own frames (``jax._src.traceback_util``,
#: the default filtering): the error was raised inside JAX, wherever the cut traceback ends.
_JAX_CUT_FRAMES = "JAX has removed its internal frames"


def raised_by_a_check(err: BaseException) -> bool:
    """Whether ``err`` was raised in this project's own code, where a ``ValueError`` or
    ``TypeError`` is one of its worded checks, and not inside JAX, NumPy, Optuna or the
    standard library, where it most likely marks a bug that only its traceback locates."""
    if any(_JAX_CUT_FRAMES in note for note in getattr(err, "__notes__", ())) or \
            type(err.__cause__).__name__ == "UnfilteredStackTrace":
        return False
    frame = err.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    if frame is None:
        return True
    return os.path.realpath(frame.tb_frame.f_code.co_filename).startswith(_OWN_CODE)


def fail(message: str) -> NoReturn:
    """Print ``error: message`` to stderr and exit with status 2 (as argparse does)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class _CtrlC:
    """SIGINT and SIGTERM for the command line: the first Ctrl-C raises ``KeyboardInterrupt``
    (the study stops its trials at their next step and gives them back), the first SIGTERM
    `Terminated`, which does the same (a repeated SIGTERM, as schedulers send, is ignored); a
    Ctrl-C after either stops the process at once, without the interpreter's shutdown (which
    would wait for the trials' threads and meet their checkpoint writes half done). The
    study's database is left consistent (each of its writes is a transaction); trials that
    were running stay running until a re-run on the same machine sees the process gone, or
    their heartbeat lapses, and it resumes them from their last checkpoints."""

    #: a second Ctrl-C ends the process (`scamp_jax.hpo.endings.Endings.give_back` says so)
    ends_process = True

    def __init__(self, at_once: str | Callable[[], str] | None = None) -> None:
        self.count = 0
        #: what a stop at once leaves, for a command that runs no study (None: a study's words)
        self.at_once = at_once

    def __call__(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            if self.count:  # a scheduler's repeated SIGTERM: the study is stopping already
                return
            self.count = 1
            raise Terminated
        self.count += 1
        if self.count == 1:
            raise KeyboardInterrupt
        # Straight to the file descriptor, no flush: the handler may have cut into a write of
        # the live view or a print (their streams hold locks); a terminal gets its cursor back
        # from the live view.
        shown = "\x1b[?25h" if sys.__stderr__ is not None and sys.__stderr__.isatty() else ""
        left = (self.at_once() if callable(self.at_once) else self.at_once) or (
            "finished trials are in the study; run the same command to resume the others from "
            "their last checkpoints (on this machine at once; on another once their heartbeat "
            f"lapses, about {GRACE_PERIOD} s)")
        message = f"{shown}\nstopped at once: {left}\n"
        with contextlib.suppress(OSError):
            os.write(2, message.encode())
        os._exit(128 + signum)


def check_study_dir(path: str | Path, flag: str = "--study-dir") -> None:
    """Exit 2 unless ``path`` (given as ``flag``) is (or can become) a writable directory;
    creates nothing (`scamp_jax.hpo.session.check_directory`)."""
    from scamp_jax.hpo.session import check_directory

    try:
        check_directory(path, flag)
    except ValueError as err:
        fail(str(err))


def check_storage(url: str | None, study_dir: str | Path, *, here: bool = True) -> None:
    """Exit 2 if ``--storage`` is not a usable database URL, its driver is missing, it keeps
    the study in memory (a rerun could not resume it), or the study's SQLite database is
    damaged (`scamp_jax.hpo.study.storage.check_storage`); connects to nothing else and creates
    nothing. ``here=False`` (a command that only plans, perhaps for a machine with its own
    driver and folders): the URL's form only."""
    from scamp_jax.hpo.study.storage import check_storage as check

    try:
        check(url, study_dir, said="--storage", here=here, in_memory=False)
    except ValueError as err:
        fail(str(err))


def root_cause(err: BaseException) -> BaseException:
    """The innermost exception that ``err`` was raised from (or during)."""
    seen = {id(err)}
    while True:
        inner = err.__cause__ or err.__context__
        if inner is None or id(inner) in seen:
            return err
        seen.add(id(inner))
        err = inner


#: A database's words for a write the disk refused (SQLite's, then PostgreSQL's).
_DISK_REFUSED = (*DISK_REFUSED, "No space left on device", "could not extend file")


def _ignore_repeated_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM's handler once a command stopped: a scheduler's repeated SIGTERM changes
    nothing while the process ends."""


def _kept_elsewhere() -> str | None:
    """What a stopped MPI rank other than 0 says it kept: rank 0 records the run and says
    what the study kept (None on rank 0, and without a launcher)."""
    from scamp_jax.distributed.mpi import launcher_rank, launcher_ranks

    rank = launcher_rank()
    if (launcher_ranks() or 1) == 1 or rank == 0:
        return None
    return (f"rank {rank} stopped: rank 0 records the study (its line says what the study "
            "kept)")


@contextlib.contextmanager
def user_errors(resumable: bool = True,
                stopped: str | Callable[[], str] | None = None) -> Iterator[None]:
    """Turn user mistakes into one line and exit status 2; Ctrl-C exits 130, SIGTERM 143, a
    study stopped by its trials' repeated error (`scamp_jax.RepeatedFailureError`) 1.
    ``resumable``: the command runs a study, which a rerun resumes (else it stores nothing,
    as ``--plan-only``, and its Ctrl-C says so); ``stopped``: what a stop leaves, said after
    "interrupted: " instead (another command's).

    Catches the library's error types for bad input (``ValueError``, ``TypeError``, an
    ``OSError`` but a closed pipe's or a lost peer's, `scamp_jax.hpo.engine.BudgetTooSmallError`,
    a missing MPI or GPU compiler, a damaged or unreachable database) and prints ``error:
    <message>`` without a traceback; one raised outside the project's code (in JAX, say: not a
    check of ours, likely a bug) keeps its traceback above that line (but a file missing, in
    the way or not allowed), as does any error with ``SCAMP_TRACEBACK=1`` in the environment
    (`TRACEBACK_VARIABLE`). Installs the SIGINT and SIGTERM handler (`_CtrlC`); after a
    stop, SIGTERM stays ignored (the process is ending: a caller that catches the
    ``SystemExit`` sets its own). Any entry point (an argparse-based ``main``) can wrap its
    body in it.
    """
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import SQLAlchemyError

    from scamp_jax._errors import worded_by
    from scamp_jax.hpo.failures import RepeatedFailureError
    from scamp_jax.planning.targets import GpuCompilerMissingError

    if stopped is None and not resumable:
        stopped = ("nothing was stored (planning stores no study); the plans made are kept in "
                   "the study folder's plans.sqlite: run the same command to plan again, "
                   "without compiling those")
    stop = _CtrlC(stopped)  # one count: a Ctrl-C after a SIGTERM stops at once too
    previous = signal.signal(signal.SIGTERM, stop)
    ending = False
    previous_int = signal.signal(signal.SIGINT, stop)
    try:
        with worded_by(in_flags):  # also how a failing MPI rank says it before the job ends
            yield
    except (Terminated, KeyboardInterrupt) as err:
        from scamp_jax.hpo.session import stop_kept

        ending = True  # the process ends: a scheduler's repeated SIGTERM changes nothing
        word = "terminated" if isinstance(err, Terminated) else "interrupted"
        kept = stop_kept(err) or _kept_elsewhere()
        left = (stopped() if callable(stopped) else stopped) or (
            f"{kept or 'finished trials are in the study and results.json'}; run the same "
            "command to resume")
        print(f"{word}: {left}", file=sys.stderr)
        code = 128 + signal.SIGTERM if isinstance(err, Terminated) else 130
        if left_behind():  # a compile still runs: end without the interpreter's shutdown
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed file
                    stream.flush()
            os._exit(code)
        raise SystemExit(code) from None
    except RepeatedFailureError as err:  # the task's error, not the command line's
        print(f"error: {err.as_command_line()}", file=sys.stderr)  # its traceback verbatim
        raise SystemExit(1) from None
    except (SQLAlchemyError, StorageInternalError) as err:
        cause = getattr(err, "orig", None) or root_cause(err)
        if any(word in str(cause) for word in _DISK_REFUSED):
            fail(f"the study database could not be written ({cause}): free space where it is "
                 "(or check that disk), then run the same command; the finished trials are "
                 "kept")
        if isinstance(err, StorageInternalError) or "locked" in str(cause):
            # Optuna's wrapping of any error of a session: a busy or lost database, most often
            fail(f"the study database did not answer ({cause}): it may be busy (another "
                 "process's long write) or unreachable; run the same command again, which "
                 "resumes the study, or check --storage")
        fail(f"the study database cannot be used ({cause}); check --storage and --study-dir, "
             "or restore the database from a copy")
    except (ValueError, TypeError, OSError, GpuCompilerMissingError) as err:
        if isinstance(err, (ConnectionError, TimeoutError)):  # a closed pipe, a lost peer
            raise
        # a file that is missing, in the way or not allowed is the command line's; another
        # OSError (a read-only or full disk) is said in one line where this project's code
        # raised or met it, and located by its traceback where a library's did
        plain = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                 PermissionError)
        if os.environ.get(TRACEBACK_VARIABLE) == "1" or (
                not isinstance(err, plain) and not raised_by_a_check(err)):
            traceback.print_exception(err, file=sys.stderr)  # where it was raised
        fail(in_flags(err))
    except Exception as err:
        if type(err).__name__ == "MPIUnavailableError":
            fail(in_flags(err))
        raise
    finally:
        # Once stopped, the process is on its way out (the interpreter waits for threads): a
        # repeated SIGTERM then would kill it by the signal, not exit 143.
        signal.signal(signal.SIGTERM, _ignore_repeated_sigterm if ending else previous)
        # the start-up handler says nothing was stored: not so once a study ran
        signal.signal(signal.SIGINT, signal.default_int_handler
                      if previous_int is _interrupted_while_starting else previous_int)


def run(
    args: argparse.Namespace,
    config: HPOConfig,
    make: Callable[[HPOConfig], tuple[Any, Any]],
    *,
    baseline: str | None,
    title: str,
    preset_for: Callable[[str], HPOConfig] | None = None,
) -> dict[str, Any]:
    """Check the flags, set up devices, build ``(space, task) = make(config)``, run the study.

    ``preset_for(platform)``: the settings for a pool of that platform's devices, once the
    pool is known (an experiment's preset for accelerators; None: ``config`` everywhere).
    User errors exit with status 2 and a one-line message (`user_errors`); every check that
    needs no study runs before the study database is created.
    """
    with warnings_in_flags(), user_errors(resumable=not getattr(args, "plan_only", False)):
        if getattr(args, "plan_only", False):
            return plan_only(args, config, make, preset_for=preset_for)
        if getattr(args, "target", None) is not None:
            fail("--target plans for GPUs this machine does not have, which cannot train; add "
                 "--plan-only, or leave --target out to train on this machine's devices")
        check_study_dir(config.study_dir)
        check_storage(config.storage, config.study_dir)
        return _run(args, config, make, baseline=baseline, title=title, preset_for=preset_for)


def pruner_note(config: HPOConfig) -> None:
    """Say where the pruner can prune nothing (`idle_pruner`), as the study itself says it
    when it opens: for a plan-only preview, which opens none."""
    idle = idle_pruner(config)
    if idle is not None:
        print(as_flags(idle), flush=True)


def plan_only(
    args: argparse.Namespace,
    config: HPOConfig,
    make: Callable[[HPOConfig], tuple[Any, Any]],
    *,
    preset_for: Callable[[str], HPOConfig] | None = None,
) -> dict[str, Any]:
    """``--plan-only``: plan the first ``--trials`` candidates of a new study on the pool (or on
    ``--devices`` GPUs of ``--target``), print a table, train nothing
    (`scamp_jax.hpo.preview.plan_candidates`); ``preset_for`` as in `run`, for the planned
    devices' platform."""
    from scamp_jax.distributed.mpi import launched_under_mpi, launcher_ranks

    if launched_under_mpi():  # every rank would plan (and compile) every candidate
        fail(f"--plan-only under an MPI launcher of {launcher_ranks()} ranks: it plans in one "
             "process and trains nothing, and every rank would plan every candidate; run it "
             "without mpirun (with --devices N for the devices one rank has)")
    if not str(config.study_dir).strip():  # as a study refuses it: not the working directory
        check_study_dir(config.study_dir)
    if config.storage is not None:  # unused here; a study it plans for may take it elsewhere
        check_storage(config.storage, config.study_dir, here=False)
    target_name = getattr(args, "target", None)
    if target_name is not None:
        from scamp_jax.planning import targets

        try:  # a name or file that is no target first: before asking how many
            targets.resolve_target(target_name)
        except ValueError as err:
            fail(f"--target: {err}")
        if args.devices is None:
            fail(f"--target {target_name} needs --devices N: how many {target_name} GPUs to "
                 "plan for, e.g. --devices 32")
        # The target compiles on the CUDA plugin's compile-only devices; JAX itself stays on
        # the CPU, so the plugin needs no CUDA libraries and a local GPU is left alone.
        if "jax" in sys.modules:  # imported already: the variable is read, set the option
            sys.modules["jax"].config.update("jax_platforms",
                                             os.environ.get("JAX_PLATFORMS") or "cpu")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        targets.quiet_compiler_log()  # before JAX starts its backends and loads the plugin
    from scamp_jax.devices import configure_cpu_devices

    # With a target the planned devices are its compile-only ones, not CPU devices.
    configure_cpu_devices(CPU_DEVICES if target_name is not None
                          else max(CPU_DEVICES, config.devices or 0))
    import jax

    from scamp_jax._units import counted, format_bytes, parse_bytes
    from scamp_jax.hpo.preview import ESTIMATE_NOTE, format_rows, plan_candidates, progress_note
    from scamp_jax.hpo.trial import fusion_cap
    from scamp_jax.planning import planner, targets

    if target_name is not None:
        target = targets.resolve_target(target_name)
        devices = target.devices(args.devices)
        where = f"{args.devices} x {target.device_kind} (described, compiled here)"
    else:
        devices = planner.resolve_devices(pool_size(args, config, jax.devices()[0].platform))
        where = f"{len(devices)} x {devices[0].device_kind}"
    if preset_for is not None:
        config = preset_for(devices[0].platform)
    budget = pool_budget(args, config, devices, None if config.memory_per_device is None
                         else parse_bytes(config.memory_per_device))
    from scamp_jax.hpo.engine import check_pool

    check_pool(config, len(devices))  # as a study would refuse it, before anything is said
    space, task = make(config)
    print(f"planning {counted(config.trials, 'candidate')} of {space.name} on {where}, "
          f"{format_bytes(budget.memory_per_device)} per device "
          f"({budget.memory_per_device} bytes)")
    if config.max_batch_size:
        print(f"  batches of at most {config.max_batch_size} samples (--max-batch-size); a "
              "smaller one is what memory holds")
    pruner_note(config)  # the study these plans preview would prune nothing either
    cap = fusion_cap(getattr(args, "fuse", None))  # as asked: the settings hold it at --trials
    if config.fuse is None and config.on_platform(devices[0].platform).fuse is not None:
        print("  a study on these devices trains trials of one architecture as fused groups "
              "(--fuse auto); below, each trial alone: add --fuse auto (or a width) to size "
              "the groups too (more compiles)")
    elif cap is not None and config.trials < cap:  # as a study's: `family_width`
        print(f"  a fused group holds trials of the study, at most --trials ({config.trials}): "
              + ("no group is sized below; pass --trials 2 or more to size them"
                 if config.trials < 2 else f"groups of at most {config.trials} below, not "
                 f"{'up to ' if getattr(args, 'fuse', None) == 'auto' else ''}{cap}; pass "
                 f"--trials {cap} to size the widest"))
    # Planned on a thread of its own, so that a Ctrl-C stops the command at once, not when a
    # compile (minutes for a large model and a GPU target) returns; once stopped, a plan the
    # thread finishes is not printed after the command's last words.
    printing, stopped = threading.Lock(), threading.Event()
    plan_cache = preview_cache(config.study_dir)
    shown, started = [], time.perf_counter()

    def show(row: Any) -> None:
        with printing:
            shown.append(row)
            if not stopped.is_set():
                note = progress_note(len(shown), config.trials, time.perf_counter() - started)
                print(f"  {as_flags(row.describe())}{note}", flush=True)

    # The programs it compiles are kept with the study's (on these devices: a target's are
    # compiled for other ones), so that the study they preview loads them.
    from scamp_jax.planning.compile_cache import cache_problem, study_compile_cache

    problem = None if plan_cache is None else cache_problem(config.study_dir)
    if problem is not None:
        print(f"  note: {problem}; planning without keeping its compiled programs")
    kept = (study_compile_cache(config.study_dir) if target_name is None and plan_cache
            is not None and problem is None else contextlib.nullcontext())
    try:
        with kept:
            rows = interruptible(lambda: plan_candidates(
                space, task, config, devices=devices, memory_per_device=budget,
                count=config.trials, on_plan=show, plan_cache=plan_cache), name="plan-only")
    except BaseException:
        with printing:
            stopped.set()
        raise
    print(format_rows(rows, params=sorted(space.grid)))
    if any(r.step_seconds is not None for r in rows):
        print(f"  ({ESTIMATE_NOTE})")
    if not any(r.devices for r in rows):
        fail(f"none of the {counted(len(rows), 'candidate')} fits this pool (each one's "
             "reason above); a study of them would train nothing")
    return {"plan_only": True, "devices": len(devices), "device_kind": devices[0].device_kind,
            "memory_per_device": budget.memory_per_device,
            "candidates": [{**dataclasses.asdict(r), "device_hours": r.device_hours}
                           for r in rows]}


def preview_cache(study_dir: str | Path) -> Any:
    """The plan cache of ``--plan-only`` (the study folder's ``plans.sqlite``): what a preview
    or a study on these devices planned before is not compiled again, and a preview stopped
    keeps the plans it made. None, with a note, where it cannot be used (a folder that
    cannot be written, a damaged file): a preview then plans without it, as it can."""
    from scamp_jax.planning.plan_cache import PlanCache

    cache = PlanCache(Path(study_dir) / "plans.sqlite", elsewhere="pass another study_dir")
    try:
        len(cache)  # its first use: made where missing, and checked
    except ValueError as err:
        print(f"  note: {as_flags(str(err))}; planning without it, so nothing is kept")
        return None
    return cache


def pool_budget(args: argparse.Namespace, config: HPOConfig, devices: Sequence[Any],
                memory: int | None) -> Any:
    """The pool's `scamp_jax.planning.budget.Budget`: ``memory`` bytes per device (the
    preset's or ``--memory-per-device``); on GPUs, real or a ``--target``'s, a preset's CPU
    budget gives way to the device's own pool."""
    from scamp_jax.planning.budget import Budget

    if getattr(args, "memory_per_device", None) is None and devices[0].platform != "cpu":
        memory = None
    if memory is None and devices[0].platform == "cpu":
        fail(f"--preset {config.preset} takes each device's memory limit from the accelerator, "
             "and CPU devices have none; pass --memory-per-device, e.g. --memory-per-device 1GiB")
    return Budget.of_devices(devices, memory)


def pool_size(args: argparse.Namespace, config: HPOConfig, platform: str) -> int | None:
    """Devices of the pool on a backend of ``platform`` (None: every device): ``--devices`` if
    given, else the preset's count on CPU; on accelerators a preset's count (sized for CPU
    devices that share one host) gives way to every device, as its memory budget does."""
    if getattr(args, "devices", None) is None and platform != "cpu":
        return None
    return config.devices


def _run(
    args: argparse.Namespace,
    config: HPOConfig,
    make: Callable[[HPOConfig], tuple[Any, Any]],
    *,
    baseline: str | None,
    title: str,
    preset_for: Callable[[str], HPOConfig] | None = None,
) -> dict[str, Any]:
    from scamp_jax._units import parse_bytes
    from scamp_jax.devices import configure_cpu_devices, configure_device_memory

    # The one reading of the budget. An explicit one is also each GPU's preallocated pool (the
    # allocator policy, set before JAX starts); a preset's is for CPU devices only.
    explicit = getattr(args, "memory_per_device", None) is not None
    memory = (None if config.memory_per_device is None
              else parse_bytes(config.memory_per_device))
    configure_device_memory(pool_bytes=memory if explicit else None)
    configure_cpu_devices(max(CPU_DEVICES, config.devices or 0))
    import jax

    from scamp_jax.hpo.session import run_search
    from scamp_jax.planning import planner

    devices = planner.resolve_devices(pool_size(args, config, jax.devices()[0].platform))
    if preset_for is not None:
        config = preset_for(devices[0].platform)  # the preset for these devices, flags on top
    budget = pool_budget(args, config, devices, memory)
    space, task = make(config)  # reads the image folders: before any study exists
    # Under mpirun with several ranks the same session spans them: rank 0 serves the study.
    return run_search(space, task, config, devices=devices,
                      memory_per_device=budget.memory_per_device,
                      live=not args.no_live, baseline=baseline, title=title)
