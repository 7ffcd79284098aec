"""ScaMP's synthetic training benchmark on the ViT family: memory-aware HPO on generated images.

Run (8 CPU devices on a CPU-only machine, the GPUs on a GPU machine)::

    python -m experiments.vit_synthetic                   # a few minutes on 2 CPU cores
    python -m experiments.vit_synthetic --preset smoke
    python -m experiments.vit_synthetic --policy fixed    # the fixed-resources baseline
    python -m experiments.vit_synthetic --preset smoke --fuse auto   # fused groups of siblings

Expected: held-out accuracy of every trial in ``runs/vit_synthetic/results.csv`` (chance is 10%;
good candidates pass 90%), the device-occupancy and memory-utilisation plots, and the run's mean
memory utilisation and idle device-seconds printed at the end. With ``--fuse K|auto``, trials of
one architecture train as fused groups (``fused_group``, ``fusion_width`` in the results).
"""

from __future__ import annotations

import argparse
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

STUDY_DIR = "runs/vit_synthetic"
PRESETS = ("smoke", "default", "paper")


def get_config(preset: str = "default") -> HPOConfig:
    """The benchmark's settings for ``preset`` (``"smoke"``, ``"default"`` or ``"paper"``)."""
    if preset == "smoke":
        return HPOConfig(preset="smoke", trials=4, steps=40, reference_batch=32,
                         max_batch_size=64, devices=None, memory_per_device="512MiB",
                         checkpoint_every=20, study_dir=STUDY_DIR, pruner="none")
    if preset == "default":
        return HPOConfig(preset="default", trials=8, steps=150, reference_batch=32,
                         max_batch_size=64, devices=None, memory_per_device="512MiB",
                         checkpoint_every=50, study_dir=STUDY_DIR, pruner="none")
    if preset == "paper":
        return HPOConfig(preset="paper", trials=64, steps=10_000, reference_batch=256,
                         max_batch_size=1024, devices=None, memory_per_device=None,
                         checkpoint_every=1000, eval_every=1000, pruner="median",
                         study_dir=STUDY_DIR, space_variant="paper", devices_per_trial=4)
    raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def make_space_and_task(config: HPOConfig) -> tuple[Any, Any]:
    """The ViT search space and the synthetic classification task of ``config``."""
    from search_spaces import vit

    space = vit.space(config.space_variant)
    task = vit.SyntheticClassification(image_size=32 if config.space_variant == "small" else 224)
    return space, task


def _presets_text() -> str:
    """What each preset sets (``--help``'s epilog), from `get_config` itself."""
    return ("Presets (--preset; flags override them): "
            + "; ".join(preset_text(name, get_config(name)) for name in PRESETS)
            + ". --policy fixed gives each trial "
            + ", ".join(str(get_config(name).devices_per_trial) for name in PRESETS)
            + " devices. " + STOPPING_TEXT)


def parser() -> argparse.ArgumentParser:
    """The command-line flags (``--help`` lists them)."""
    p = Parser(
        prog="python -m experiments.vit_synthetic",
        description="ScaMP's synthetic training benchmark: memory-aware HPO over ViTs.",
        epilog=_presets_text(),
    )
    add_flags(p, PRESETS, STUDY_DIR)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse flags, run the study, write the report; returns the run summary."""
    args = parser().parse_args(argv)
    config = config_from_args(args, get_config(args.preset), STUDY_DIR)
    return run(args, config, make_space_and_task, baseline=None, title="ViT synthetic")


if __name__ == "__main__":
    main()
