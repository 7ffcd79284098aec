"""Hyperparameter search over SwinIR super-resolution models with ScaMP planning and packing.

Run (on a CPU-only machine the host split into 8 CPU devices, of which the default preset pools
2; the GPUs on a GPU machine)::

    python -m experiments.swinir_hpo                  # 4-6 min on 2 CPU cores
    python -m experiments.swinir_hpo --preset smoke   # a few minutes
    python -m experiments.swinir_hpo --policy fixed   # the fixed-resources baseline
    mpirun -n 2 python -m experiments.swinir_hpo --preset smoke   # one study across 2 ranks
    python -m experiments.swinir_hpo --preset smoke --study-name b  # a second study, in .../b
    python -m experiments.swinir_hpo --preset smoke --fuse 4 --trials 8   # fused groups

Expected: every trial's PSNR on held-out photographs in ``runs/swinir_hpo/results.csv``, and the
best trial's PSNR above bicubic upscaling. Running the same command again resumes the study.
Under ``mpirun`` rank 0 serves the study and every rank runs trials on its own devices
(`scamp_jax.distributed.engine`); ``--trials`` is the total over all ranks and each trial's
``rank`` is in the results. With ``--fuse K`` each architecture the sampler proposes gets up to
``K - 1`` sibling trials (same architecture, their own learning rates), and trials of one
architecture train as one fused step (`scamp_jax.hpo.fused_engine`); each trial's ``fused_group``
and ``fusion_width`` are in the results (under ``mpirun`` each rank fuses its own trials).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from typing import Any

from experiments._cli import (
    STOPPING_TEXT,
    HPOConfig,
    Parser,
    add_flags,
    config_from_args,
    preset_text,
    run,
)

STUDY_DIR = "runs/swinir_hpo"
PRESETS = ("smoke", "default", "paper")
#: CPU devices the default preset's pool has on a CPU-only machine (on GPUs: every GPU).
CPU_POOL_DEVICES = 2


#: The default preset on accelerators (`accelerator_default`): trials (a warm start and two
#: fused families of 8 proposals' siblings, minus one), each trial's batch cap, the batch its
#: steps refer to and its training samples. The cap is sized so that fused groups fill a GPU:
#: planned for a described H200 here (`--plan-only --target h200 --devices 1`), the space's
#: first six candidates book 3.3-14.7 GiB each at batch 4,096 (0.8-3.7 GiB at 1,024), so a
#: group of 8 of one architecture books 26-118 GiB; a process alone on an H200 holds XLA's pool
#: of 105.3 GiB (75%), so the planner gives the largest candidates smaller batches or groups.
ACCEL_TRIALS = 16
ACCEL_BATCH_CAP = 4096
ACCEL_REFERENCE_BATCH = 1024
ACCEL_SAMPLES = 1_024_000


#: A small model and learning rate that beat bicubic within the default preset's 4,000 training
#: samples on CPU; a new default study evaluates it first (a warm start), then TPE explores.
WARM_START = {"embed_dim": 24, "num_groups": 1, "group_depth": 2, "num_heads": 2,
              "window_size": 8, "mlp_ratio": 2.0, "learning_rate": 3e-3}


def get_config(preset: str = "default", platform: str = "cpu") -> HPOConfig:
    """The experiment's settings for ``preset`` (``"smoke"``, ``"default"`` or ``"paper"``) on a
    pool of ``platform`` devices (``jax.Device.platform``; the command line passes its pool's).

    On CPU every trial's batch is capped (compute per trial stays small on 2 cores); the
    planner still decides each trial's devices, model-parallel degree, batch up to the cap and
    predicted memory. On accelerators the default preset is `accelerator_default`.
    """
    if preset == "default" and platform != "cpu":
        return accelerator_default()
    if preset == "smoke":
        return HPOConfig(preset="smoke", trials=3, steps=100, reference_batch=8,
                         max_batch_size=8, devices=None, memory_per_device="1GiB",
                         checkpoint_every=25, study_dir=STUDY_DIR, pruner="none")
    if preset == "default":
        # On CPU: a pool of 2 devices of 32 MiB, sized to the small space: its candidates book
        # 5-23 MiB at batch 4, the largest ones more, so the planner lowers their batch (to 1
        # for the space's largest). No cap on running trials: the pool's memory decides how
        # many train at once, packed by planned memory (up to 5 measured, three on a device), so
        # the memory plot shows what the trials hold together. 4,000 samples per trial, as 1,000
        # steps of 4: more updates than 500 of 8 at the same cost per sample. On GPUs the
        # pool is every GPU with its own memory limit (`experiments._cli.run`).
        return HPOConfig(preset="default", trials=6, steps=1000, reference_batch=4,
                         max_batch_size=4, devices=CPU_POOL_DEVICES, memory_per_device="32MiB",
                         max_running_trials=None, checkpoint_every=250, study_dir=STUDY_DIR,
                         pruner="none", initial_params=(WARM_START,))
    if preset == "paper":
        # The paper's SwinIR runs on 32 V100s: memory from the devices, classical-sized models.
        return HPOConfig(preset="paper", trials=64, steps=50_000, reference_batch=32,
                         max_batch_size=64, devices=None, memory_per_device=None,
                         checkpoint_every=1000, eval_every=5000, pruner="median",
                         study_dir=STUDY_DIR, space_variant="paper", devices_per_trial=4)
    raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def accelerator_default() -> HPOConfig:
    """The default preset on accelerators: every device of the backend, each with the pool the
    allocator policy gives it (`scamp_jax.devices`: the device's own memory), and each trial's
    batch the largest its device holds up to ACCEL_BATCH_CAP, where the CPU preset caps it at 4.

    A study on accelerators fuses by default (`SearchSettings.on_platform`): the sampler's
    proposals come with siblings of their architecture, up to 8 trained as one vmapped step
    on one device, so a device's memory fills with groups rather than with trials that take
    turns on its one compute stream. ``reference_batch`` keeps the samples per trial at
    ACCEL_SAMPLES whatever batch a trial's memory allows (fewer, larger steps).
    """
    return HPOConfig(preset="default", trials=ACCEL_TRIALS,
                     steps=ACCEL_SAMPLES // ACCEL_REFERENCE_BATCH,
                     reference_batch=ACCEL_REFERENCE_BATCH, max_batch_size=ACCEL_BATCH_CAP,
                     devices=None, memory_per_device=None, checkpoint_every=100,
                     study_dir=STUDY_DIR, pruner="none", initial_params=(WARM_START,))


def config_for(args: argparse.Namespace, platform: str = "cpu") -> HPOConfig:
    """The command line's settings: its flags on top of ``--preset`` for a pool of
    ``platform`` devices."""
    return config_from_args(args, get_config(args.preset, platform), STUDY_DIR)


def make_space_and_task(config: HPOConfig) -> tuple[Any, Any]:
    """The SwinIR search space and the x2 super-resolution task of ``config``."""
    from search_spaces import swinir
    from search_spaces.sr_task import SRTask

    hr_patch = 48
    space = swinir.space(config.space_variant, scale=2, hr_patch=hr_patch)
    task = SRTask(scale=2, hr_patch=hr_patch, train_dir=config.train_dir, eval_dir=config.eval_dir,
                  test_dir=config.test_dir)
    return space, task


def _presets_text() -> str:
    """What each preset sets (``--help``'s epilog), from `get_config` itself."""
    parts = [preset_text("smoke", get_config("smoke")),
             preset_text("default on CPU devices", get_config("default")),
             preset_text("default on GPUs", get_config("default", platform="gpu"))
             + ", each architecture's trials fused (--fuse auto)",
             preset_text("paper", get_config("paper"))]
    return ("Presets (--preset; flags override them): " + "; ".join(parts) + ". A trial's "
            "batch is the largest its memory holds up to the cap, and its steps scale so that "
            "every trial sees as many samples (--steps); on CPU the default pool's memory "
            "decides how many trials train at once, packed several to a device. " + STOPPING_TEXT)


def parser() -> argparse.ArgumentParser:
    """The command-line flags (``--help`` lists them)."""
    p = Parser(
        prog="python -m experiments.swinir_hpo",
        description="Memory-aware parallel hyperparameter search over SwinIR "
        "(x2 super-resolution).",
        epilog=_presets_text(),
    )
    add_flags(p, PRESETS, STUDY_DIR, image_folders=True)
    p.add_argument("--train-dir",
                   help="directory of training images (default: scikit-image's photographs)")
    p.add_argument("--eval-dir",
                   help="directory of held-out HR images for PSNR, which trials are scored and "
                   "chosen by (default: the task's held-out set)")
    p.add_argument("--test-dir",
                   help="directory of HR images the best model is tested on at the end, which "
                   "no trial is chosen by (default: the task's test set, scikit-image's camera "
                   "and coins)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse flags, run the study, write the report; returns the run summary."""
    args = parser().parse_args(argv)
    return run(args, config_for(args), make_space_and_task, baseline="bicubic_psnr",
               title="SwinIR HPO", preset_for=functools.partial(config_for, args))


if __name__ == "__main__":
    main()
