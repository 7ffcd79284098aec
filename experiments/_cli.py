"""Flags and the run loop shared by the HPO entry points (``swinir_hpo``, ``vit_synthetic``).

JAX initialises a backend only after the flags are read, so ``--devices`` can split the CPU
into enough devices first.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scamp_jax.search import SearchSettings

POLICIES = ("scamp", "fixed")
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "halving", "none")
#: CPU devices the entry points split the host into (the default device pool on CPU).
CPU_DEVICES = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class HPOConfig(SearchSettings):
    """One HPO experiment: the study's `scamp_jax.search.SearchSettings` plus the entry points'
    own flags.

    Attributes:
      preset: name of the preset the values came from.
      devices: devices of the pool (None: every device of the backend).
      memory_per_device: budget per device, e.g. ``"1GiB"`` (None: the device limit on GPUs).
      study_dir: as in `SearchSettings` (default ``runs/hpo``).
      space_variant: the model family's search-space variant (``"small"``, ``"paper"``, ...).
      train_dir: directory of training images (None: the task's built-in images).
      eval_dir: directory of held-out images (None: the task's built-in held-out set).
    """

    preset: str
    devices: int | None
    memory_per_device: str | None
    study_dir: str | Path = "runs/hpo"
    space_variant: str = "small"
    train_dir: str | None = None
    eval_dir: str | None = None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def add_flags(parser: argparse.ArgumentParser, presets: Sequence[str], study_dir: str) -> None:
    """The flags every HPO entry point takes; unset flags keep the preset's value."""
    parser.add_argument("--preset", default="default", choices=list(presets),
                        help="size of the search: 'smoke' finishes in a few minutes on 2 CPU "
                        "cores, 'default' in about ten, 'paper' is cluster-sized")
    parser.add_argument("--trials", type=positive_int,
                        help="total trials of the study; a resumed study runs only the "
                        "missing ones")
    parser.add_argument("--steps", type=positive_int,
                        help="training steps per trial at the preset's reference batch size")
    parser.add_argument("--devices", type=positive_int,
                        help="how many of the backend's devices form the pool (default: all; "
                        f"on CPU the host is split into max({CPU_DEVICES}, this) devices)")
    parser.add_argument("--memory-per-device",
                        help="memory budget per device, e.g. '1GiB', '512MiB' (default: the "
                        "preset's on CPU, the device limit on GPUs)")
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
                        help="devices per trial under --policy fixed")
    parser.add_argument("--elastic", choices=("auto", "on", "off"),
                        help="at the end of the study, let ScaMP put devices that would idle to "
                        "work: queued trials start on more devices, running ones restart from a "
                        "checkpoint on more devices with the same batch (default auto: on for "
                        "GPUs, off for CPU devices, which share one host's cores)")
    parser.add_argument("--sampler", choices=SAMPLERS, help="Optuna sampler (seeded)")
    parser.add_argument("--pruner", choices=PRUNERS,
                        help="Optuna pruner fed by intermediate evaluations (--eval-every)")
    parser.add_argument("--eval-every", type=int,
                        help="steps between intermediate evaluations reported to the pruner "
                        "(0: off)")
    parser.add_argument("--seed", type=int, help="seed of the sampler, initialisation and data")
    parser.add_argument("--study-dir", default=None,
                        help=f"directory of the study database, checkpoints, results and plots "
                        f"(default {study_dir}); running again on it resumes the study")
    parser.add_argument("--storage",
                        help="SQLAlchemy URL of the study (default: sqlite file in --study-dir)")
    parser.add_argument("--no-live", action="store_true",
                        help="plain log lines instead of the live table")


def config_from_args(args: argparse.Namespace, base: HPOConfig, study_dir: str) -> HPOConfig:
    """``base`` with every flag the user set applied on top."""
    overrides = {}
    for name in ("trials", "steps", "devices", "memory_per_device", "policy", "devices_per_trial",
                 "max_batch_size", "min_batch_size", "elastic",
                 "sampler", "pruner", "eval_every", "seed", "storage", "train_dir", "eval_dir"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    overrides["study_dir"] = args.study_dir or study_dir
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as err:  # SearchSettings names the field: name its flag too
        field = str(err).split("=", 1)[0]
        flag = f" (--{field.replace('_', '-')})" if field in overrides else ""
        fail(f"{err}{flag}")
        raise


def fail(message: str) -> None:
    """Print ``error: message`` to stderr and exit with status 2 (as argparse does)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run(
    args: argparse.Namespace,
    config: HPOConfig,
    make: Callable[[HPOConfig], tuple[Any, Any]],
    *,
    baseline: str | None,
    title: str,
) -> dict[str, Any]:
    """Set up devices, build ``(space, task) = make(config)`` and run the study.

    User errors (bad sizes, a budget too small for any candidate) exit with status 2 and a
    one-line message; Ctrl-C exits with 130 after the running trials are checkpointed.
    """
    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(max(CPU_DEVICES, config.devices or 0))
    import jax

    # Compiles dominate short trials on CPU; a resumed study finds them on disk.
    jax.config.update("jax_compilation_cache_dir", str(Path(config.study_dir) / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from scamp_jax import planner
    from scamp_jax._units import parse_bytes
    from scamp_jax.distributed.mpi import MPIUnavailableError, launched_under_mpi
    from scamp_jax.engine import BudgetTooSmallError
    from scamp_jax.search import run_search

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM (a scheduler's kill) stops like Ctrl-C: checkpointed

    signal.signal(signal.SIGTERM, terminate)
    try:
        devices = planner.resolve_devices(config.devices)
        memory = config.memory_per_device
        if getattr(args, "memory_per_device", None) is None and devices[0].platform != "cpu":
            memory = None  # accelerators: the preset's CPU budget gives way to the device limit
        if memory is not None:
            parse_bytes(memory)
        budget = planner.resolve_budget(memory, devices)
        space, task = make(config)
        if launched_under_mpi():
            # Several ranks: rank 0 serves the study, every rank runs trials on its devices.
            from scamp_jax.distributed.engine import run_search_mpi

            return run_search_mpi(space, task, config, devices=devices,
                                  memory_per_device=budget, live=not args.no_live,
                                  baseline=baseline, title=title)
        return run_search(space, task, config, devices=devices, memory_per_device=budget,
                          live=not args.no_live, baseline=baseline, title=title)
    except MPIUnavailableError as err:
        fail(str(err))
    except (BudgetTooSmallError, ValueError, TypeError, FileNotFoundError) as err:
        fail(str(err))
    except KeyboardInterrupt:
        print("interrupted: finished trials are in the study; run the same command to resume",
              file=sys.stderr)
        raise SystemExit(130) from None
    raise AssertionError("unreachable")
