"""Supernet NAS for super-resolution: train a supernet through the pipeline, rank subnets by PSNR.

The logic behind ``python -m experiments.supernet_nas``: draw training patches from the SwinIR
search's photographs (one batch per subnet, in sequence-id order), train with the chosen schedule
(`train_for_nas`), evaluate a set of subnets on held-out photographs (PSNR on Y, the bicubic
baseline beside it), and write a JSON summary and a PNG plot (`evaluate_and_save`). `run_nas` does
both in one process; `run_nas_mpi` does both with one stage per MPI rank.

Training goes in segments of ``checkpoint_every`` subnets, each continuing from the previous
one's weights and optimizer state (`scamp_jax.pipeline.SupernetState`), which changes no bit of
the result. After every segment but the last, the state, the losses so far and the settings
that must match are saved with orbax under ``<out_dir>/checkpoint`` (`NASCheckpoint`); the same
run started again resumes from there and ends with the losses and weights of a run that never
stopped. A finished run deletes its checkpoint once its results are written.

The pipeline itself (`scamp_jax.pipeline`) knows nothing of super-resolution: the supernet
(`search_spaces.supernet.SupernetLayout`) is the `scamp_jax.pipeline.StageModel` it trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from scamp_jax._files import write_whole
from scamp_jax._signals import stops_held
from scamp_jax.pipeline.executor import PipelineExecutor
from scamp_jax.pipeline.executor_base import StageExecutor
from scamp_jax.pipeline.stage import OptimizerSpec
from scamp_jax.pipeline.trainer import (
    ExecutorFactory,
    SupernetState,
    TrainOptions,
    TrainResult,
    train_supernet,
)
from search_spaces.supernet import (
    SupernetConfig,
    SupernetLayout,
    distinct_subnets,
    sample_subnets,
    subnet_labels,
)

if TYPE_CHECKING:
    from rich.console import Console

log = logging.getLogger(__name__)


def _console(quiet: bool) -> Console:
    """The run's console (`scamp_jax.hpo.live.log_console`): a terminal's own width and
    colours, a log's (or an MPI rank's) plain lines of `scamp_jax.hpo.live.LOG_WIDTH`."""
    from scamp_jax.hpo.live import log_console

    return log_console(quiet=quiet)


@dataclasses.dataclass(frozen=True)
class NASConfig:
    """One supernet NAS run.

    Attributes:
      preset: name of the preset the values came from.
      schedule: ``csp``, ``gpipe`` or ``sequential``.
      stages: pipeline stages (devices).
      layers, choices, width: supernet size (L choice layers, C candidates, feature channels).
      subnets: subnets trained, one batch each.
      batch_size: patches per subnet batch.
      hr_patch: HR training patch side (pixels); the LR side must be a multiple of the window.
      microbatches: microbatches per batch for ``gpipe``.
      learning_rate: Adam step size (per-block Adam state).
      train_shared: also train the stem and head in the pipeline (else frozen there, as in the
        NASPipe artifact). Trained shared weights make every pair of subnets dependent on the
        first and last stage, so CSP then runs in sequential's ticks.
      shared_warmup: Adam steps that train the stem and head alone before the pipeline
        (`warm_up_shared`; 0: none). Every block starts as the identity, so this trains the
        network every subnet computes at initialisation, cheaply on one device; the pipeline
        then trains the blocks on top of the frozen stem and head and CSP keeps its overlap.
        Default run: CSP 1454 ticks vs sequential 3200, best subnet 33.61 dB vs bicubic 33.06
        (trained in the pipeline instead: 3200 vs 3200 ticks, 33.38 dB).
      offload: keep the supernet in host memory, only the chosen blocks on the devices.
      eval_subnets: subnets ranked on held-out patches.
      eval_crop: largest side (HR pixels) of the held-out photographs' centre crops.
      zero_init_residual: every candidate block starts as the identity
        (`search_spaces.supernet.SupernetConfig.zero_init_residual`).
      seed: seed of weights, subnets and patches.
      out_dir: where ``results.json`` and ``results.png`` go, and the checkpoint
        (``checkpoint/``) while the run is unfinished.
      checkpoint_every: subnets per training segment; a checkpoint is saved after each but the
        last (0: one segment, no checkpoint). Segments drain the pipeline at their ends (a few
        ticks each) and change no bit of the result.
      checkpoint_dir: where the checkpoint goes (None: ``<out_dir>/checkpoint``; the
        experiment's ``--json PATH`` puts it beside that file, ``PATH.checkpoint``, so runs
        with their own JSON files never share one).
    """

    preset: str = "default"
    schedule: str = "csp"
    stages: int = 4
    layers: int = 8
    choices: int = 12
    width: int = 16
    subnets: int = 400
    batch_size: int = 8
    hr_patch: int = 24
    microbatches: int = 4
    learning_rate: float = 2e-3
    train_shared: bool = False
    shared_warmup: int = 1000
    offload: bool = True
    eval_subnets: int = 12
    eval_crop: int = 192
    zero_init_residual: bool = True
    seed: int = 0
    out_dir: str = "runs/supernet_nas"
    checkpoint_every: int = 100
    checkpoint_dir: str | None = None

    @property
    def checkpoint_path(self) -> Path:
        """Where an unfinished run's checkpoint is (``checkpoint_dir``, default
        ``<out_dir>/checkpoint``)."""
        return Path(self.checkpoint_dir or Path(self.out_dir) / "checkpoint")

    @property
    def supernet(self) -> SupernetConfig:
        """The supernet's sizes (x2 super-resolution, attention windows of 4)."""
        return SupernetConfig(self.layers, self.choices, self.width, scale=2, window_size=4,
                              zero_init_residual=self.zero_init_residual)


#: `NASConfig` fields a checkpoint must share with the run resuming it (the others, such as
#: ``out_dir``, ``checkpoint_every`` and the evaluation's, do not change what is trained;
#: ``offload`` moves the supernet between host and devices and changes no bit of it,
#: ``microbatches`` counts under gpipe only: `resume_settings`).
RESUME_FIELDS = ("preset", "schedule", "stages", "layers", "choices", "width", "subnets",
                 "batch_size", "hr_patch", "microbatches", "learning_rate", "train_shared",
                 "shared_warmup", "zero_init_residual", "seed")
#: How the command line sets each of `RESUME_FIELDS` (the preset alone sets the rest).
_FLAGS = {"batch_size": "--batch-size", "train_shared": "--train-shared",
          "shared_warmup": "--shared-warmup"}
#: Of `RESUME_FIELDS`, those no flag sets.
_PRESET_ONLY = ("hr_patch", "learning_rate", "zero_init_residual")


def _differs(name: str, there: Any, here: Any) -> str:
    """How a setting of a checkpoint differs from this run's, in the command's words: a switch
    as ``--train-shared there, --no-train-shared here``, a value as ``--seed 0 there, 1
    here``, a setting only the preset sets as ``the preset's hr_patch 48 there, 64 here``."""
    if there is None or here is None:  # recorded only under some settings (microbatches)
        there, here = ("unset" if v is None else repr(v) for v in (there, here))
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        return (f"the preset's {name}" if name in _PRESET_ONLY else flag) + \
            f" {there} there, {here} here"
    if name in _PRESET_ONLY:
        return f"the preset's {name} {there!r} there, {here!r} here"
    flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
    if isinstance(there, bool) and isinstance(here, bool):
        def switch(on: bool) -> str:
            return flag if on else "--no-" + flag[2:]

        return f"{switch(there)} there, {switch(here)} here"
    return f"{flag} {there!r} there, {here!r} here"


def resume_settings(config: NASConfig) -> dict[str, Any]:
    """The settings a checkpoint of ``config`` records and a resuming run must match (the
    microbatches only where the schedule splits batches into them: gpipe)."""
    return {name: getattr(config, name) for name in RESUME_FIELDS
            if name != "microbatches" or config.schedule == "gpipe"}


@dataclasses.dataclass(frozen=True)
class Resume:
    """A run's saved progress: ``state`` after ``done`` subnets, their ``losses``, the
    warm-up's record and the figures of the segments trained so far."""

    done: int
    state: SupernetState
    losses: np.ndarray
    warmup: dict[str, Any]
    segments: list[dict[str, Any]]
    resumed_at: list[int]


class NASCheckpoint:
    """The orbax checkpoint of an unfinished supernet NAS run, ``<out_dir>/checkpoint``.

    One step is kept, named by the subnets trained; it holds the weights, their optimizer
    state and the losses so far (arrays), and beside them (JSON) the `resume_settings`, the
    warm-up's record and each segment's figures. Saves are synchronous: a save that a stop
    interrupts leaves orbax's temporary folder, which no later run reads, and the previous step.
    """

    def __init__(self, config: NASConfig) -> None:
        self.config = config
        self.directory = config.checkpoint_path.resolve()
        self._manager: Any = None
        self._holding = False  # within `held`
        self._drop_parent = False  # `discard` asked for its folder to go when it was held

    def _open(self, create: bool) -> Any:
        if self._manager is None:
            import orbax.checkpoint as ocp  # only for runs that checkpoint
            from orbax.checkpoint import checkpoint_managers

            options = ocp.CheckpointManagerOptions(
                preservation_policy=checkpoint_managers.LatestN(1),
                enable_async_checkpointing=False, create=create,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def latest(self) -> int | None:
        """Subnets trained by the saved step, or None when there is none."""
        if not self.directory.is_dir():
            return None
        return self._open(create=False).latest_step()

    def check(self) -> int | None:
        """Subnets trained by the saved step (None: nothing saved), reading only its settings;
        raises `ValueError` as `load` when the checkpoint is another run's."""
        import orbax.checkpoint as ocp

        step = self.latest()
        if step is not None:
            meta = self._restore(step, "the run's settings and progress",
                                 meta=ocp.args.JsonRestore()).meta
            self._check_settings(meta.get("settings", {}))
        return step

    def _restore(self, step: int, what: str, **items: Any) -> Any:
        """``items`` of the checkpoint of ``step``; a step that cannot be read (damaged) raises
        `ValueError` in one message: what could not be read, where, and how to start afresh
        (`scamp_jax.hpo.checkpoint.read_or_say`)."""
        import orbax.checkpoint as ocp

        from scamp_jax.hpo.checkpoint import CheckpointUnreadable, read_or_say

        manager = self._open(create=False)
        try:
            return read_or_say(lambda: manager.restore(step, args=ocp.args.Composite(**items)),
                               self.directory / str(step), what, why="is it damaged?")
        except CheckpointUnreadable as err:
            raise ValueError(f"{err}; pass --fresh to discard it and train from the start, or "
                             "another --out-dir") from err

    def load(self) -> Resume | None:
        """The saved progress (None: nothing saved). Raises `ValueError` in one line, naming
        what differs and how to start afresh, when the checkpoint is another run's."""
        import orbax.checkpoint as ocp

        step = self.latest()
        if step is None:
            return None
        meta = self._restore(step, "the run's settings and progress",
                             meta=ocp.args.JsonRestore()).meta
        self._check_settings(meta.get("settings", {}))
        stored = self._restore(step, "the supernet's weights and optimizer state",
                               state=ocp.args.StandardRestore()).state
        state = SupernetState(np.asarray(stored["blocks"]), np.asarray(stored["shared"]),
                              {k: np.asarray(v) for k, v in stored["optimizer"].items()})
        return Resume(done=int(meta["done"]), state=state,
                      losses=np.asarray(stored["losses"], np.float32), warmup=meta["warmup"],
                      segments=list(meta["segments"]), resumed_at=list(meta["resumed_at"]))

    def _check_settings(self, saved: dict[str, Any]) -> None:
        wanted = resume_settings(self.config)
        differ = [_differs(name, saved.get(name), value)
                  for name, value in wanted.items() if saved.get(name) != value]
        if differ:
            raise ValueError(
                f"{self.directory} holds an unfinished run with other settings "
                f"({'; '.join(differ)}); run that command again to resume it, or pass another "
                "--out-dir, or --fresh to discard it and train from the start")

    def save(self, state: SupernetState, losses: np.ndarray, *, warmup: dict[str, Any],
             segments: list[dict[str, Any]], resumed_at: list[int]) -> None:
        """Save the progress after ``len(losses)`` subnets (on disk when this returns)."""
        import orbax.checkpoint as ocp

        done = len(losses)
        tree = {"blocks": state.blocks, "shared": state.shared,
                "optimizer": dict(state.optimizer), "losses": np.asarray(losses, np.float32)}
        meta = {"settings": resume_settings(self.config), "done": done, "warmup": warmup,
                "segments": segments, "resumed_at": resumed_at}
        manager = self._open(create=True)
        with stops_held():  # a Ctrl-C or SIGTERM waits for the save to be whole
            manager.save(done, args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)), force=True)
            manager.wait_until_finished()

    def close(self) -> None:
        """Release orbax's checkpoint manager (opened again when needed)."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    def discard(self, *, folder: bool = True) -> None:
        """Delete the checkpoint and, with ``folder`` (a run's end), the folder that holds it
        if that leaves it empty (an ``out_dir`` made for it while the results went elsewhere,
        ``--json``), never the working directory; a ``--fresh`` start removes no folder (it
        is still empty, where the results will go). Under `held`, that folder goes when the
        hold ends."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        if folder:
            self._drop_parent = True
            if not self._holding:
                self._remove_empty_parent()

    def _remove_empty_parent(self) -> None:
        if self.directory.parent == Path.cwd().resolve():
            return
        try:
            self.directory.parent.rmdir()  # only if empty: results may be elsewhere (--json)
        except OSError:
            pass

    @property
    def lock_path(self) -> Path:
        """The file a run holds locked while it trains into this checkpoint (`held`)."""
        return self.directory.with_name(self.directory.name + ".lock")

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """This run's hold on the checkpoint (an exclusive lock on `lock_path`, which names
        its process), so that a second run in the same folder is refused at once with a
        `ValueError` rather than training into the same checkpoint; the file goes with it,
        and so does a folder made for it that is left empty (a run stopped before it wrote)."""
        import fcntl
        import os

        made = not self.lock_path.parent.exists()
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle: Any
        while True:
            handle = open(self.lock_path, "a+")  # noqa: SIM115 - held open for the whole run
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                handle.close()
                raise ValueError(
                    f"{self.directory.parent} is in use by another run (process {holder}, "
                    f"which holds {self.lock_path.name}); wait for it to end, or pass another "
                    "--out-dir (or --json)") from None
            except OSError as err:  # a file system without locks (some NFS mounts)
                handle.close()
                log.warning("%s cannot be locked (%s): nothing keeps a second run out of %s",
                            self.lock_path, err.strerror or err, self.directory.parent)
                handle = None
                break
            try:  # the file locked is still the one at the path: its holder unlinks it
                if os.fstat(handle.fileno()).st_ino == os.stat(self.lock_path).st_ino:
                    break
            except FileNotFoundError:
                pass
            handle.close()  # unlinked as its holder let go: lock the new one
        if handle is not None:
            handle.truncate(0)
            handle.write(str(os.getpid()))
            handle.flush()
        self._holding = True
        try:
            yield
        finally:
            if handle is not None:
                self.lock_path.unlink(missing_ok=True)  # under the lock: see the loop above
                handle.close()
            self._holding = False
            if self._drop_parent or made:  # a folder made for it and left empty goes
                self._remove_empty_parent()


class _GrowingExecutor:
    """An `ExecutorFactory` that hands every training segment the same compiled executor while
    the segment's program fits its buffers, and builds a larger one (closing the old one) only
    when a program needs more slots; `close` closes the last."""

    keeps_executors = True  # `train_supernet` leaves it open
    _SLOTS = ("window_slots", "act_slots", "grad_slots")

    def __init__(self, factory: ExecutorFactory) -> None:
        self.factory = factory
        self.executor: StageExecutor | None = None
        self._sizes: dict[str, Any] = {}
        self.built = 0

    def __call__(self, model: Any, **sizes: Any) -> StageExecutor:
        same = {k: v for k, v in sizes.items() if k not in self._SLOTS}
        old = self._sizes
        if self.executor is not None and same == {k: v for k, v in old.items()
                                                  if k not in self._SLOTS}:
            if all(sizes[k] <= old[k] for k in self._SLOTS):
                return self.executor
            sizes = {**sizes, **{k: max(sizes[k], old[k]) for k in self._SLOTS}}
        self.close()
        self.executor, self._sizes = self.factory(model, **sizes), sizes
        self.built += 1
        return self.executor

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None


def combine_results(parts: list[dict[str, Any]], last: TrainResult, losses: np.ndarray
                    ) -> TrainResult:
    """One `TrainResult` of a run trained in segments: the last segment's weights and state,
    every segment's losses, and ticks, times and rates summed over the segments' figures
    (`segment_figures`)."""
    ticks = sum(p["ticks"] for p in parts)
    ideal = sum(p["ideal_ticks"] for p in parts)
    seconds = sum(p["samples"] / p["samples_per_second"] for p in parts
                  if p["samples_per_second"] > 0)
    return dataclasses.replace(
        last, losses=np.asarray(losses, np.float32), ticks=ticks,
        stage_utilization=sum(p["stage_utilization"] * p["ticks"] for p in parts) / ticks,
        ideal_ticks=ideal,
        ideal_utilization=sum(p["ideal_utilization"] * p["ideal_ticks"] for p in parts) / ideal,
        device_param_bytes=max(p["device_param_bytes"] for p in parts),
        host_param_bytes=max(p["host_param_bytes"] for p in parts),
        activation_bytes=max(p["activation_bytes"] for p in parts),
        wall_seconds=sum(p["wall_seconds"] for p in parts),
        steady_seconds=sum(p["steady_seconds"] for p in parts),
        samples_per_second=sum(p["samples"] for p in parts) / seconds if seconds else 0.0,
    )


def segment_figures(result: TrainResult, start: int, samples: int) -> dict[str, Any]:
    """What `combine_results` needs of one segment's result (JSON-ready)."""
    return {
        "first": start, "subnets": len(result.losses), "samples": samples,
        **{k: getattr(result, k) for k in (
            "ticks", "stage_utilization", "ideal_ticks", "ideal_utilization",
            "device_param_bytes", "host_param_bytes", "activation_bytes", "wall_seconds",
            "steady_seconds", "samples_per_second")},
    }


def warm_up_shared(
    layout: SupernetLayout,
    shared: np.ndarray,
    lr_batches: np.ndarray,
    hr_batches: np.ndarray,
    *,
    steps: int,
    optimizer: OptimizerSpec,
) -> tuple[np.ndarray, np.ndarray]:
    """Train the stem and head alone for ``steps`` optimizer steps, the choice layers skipped.

    With ``zero_init_residual`` every candidate block starts as the exact identity, so the
    stem-head network trained here is what every subnet computes before the pipeline trains its
    blocks. Step ``i`` uses batch ``i mod N`` of ``lr_batches`` (N, B, h, w, 3) and
    ``hr_batches`` (N, B, r h, r w, 3); one ``lax.scan`` on the default device, compiled once.

    Returns:
      ``(shared (P_shared,), losses (steps,))``: the warmed-up stem and head weights and the
      training loss of every step.
    Raises:
      ValueError: if the blocks do not start as the identity (the warm-up would then train a
        network no subnet computes) or ``steps`` is negative.
    """
    if steps < 0:
        raise ValueError(f"{steps=} must be >= 0 (0: no warm-up); pass e.g. 1000")
    if steps == 0:
        return np.asarray(shared, np.float32), np.zeros(0, np.float32)
    if not layout.config.zero_init_residual:
        raise ValueError(
            "warming up the stem and head skips the choice layers, which is what the subnets "
            "compute only when every block starts as the identity; build the supernet with "
            "SupernetConfig(zero_init_residual=True) or pass shared_warmup=0"
        )
    tx = optimizer.transformation()
    lr_all, hr_all = jnp.asarray(lr_batches), jnp.asarray(hr_batches)

    def loss_fn(sh: jax.Array, lr: jax.Array, hr: jax.Array) -> jax.Array:
        return layout.loss(layout.apply_head(sh, layout.apply_stem(sh, lr), lr), hr)

    def step(carry, i):
        sh, opt = carry
        loss, grad = jax.value_and_grad(loss_fn)(sh, lr_all[i], hr_all[i])
        updates, opt = tx.update(grad, opt, sh)
        return (optax.apply_updates(sh, updates), opt), loss

    @jax.jit
    def run(sh: jax.Array) -> tuple[jax.Array, jax.Array]:
        order = jnp.arange(steps, dtype=jnp.int32) % lr_all.shape[0]
        (sh, _), losses = lax.scan(step, (sh, tx.init(sh)), order)
        return sh, losses

    out, losses = run(jnp.asarray(shared, jnp.float32))
    return np.asarray(out), np.asarray(losses)


def training_patch_bytes(config: NASConfig) -> int:
    """Host bytes of `training_batches`' patches (float32 LR and x2 HR, 3 channels): every
    subnet's batch is drawn before training."""
    lr_side = config.hr_patch // 2
    per_patch = 3 * 4 * (lr_side ** 2 + config.hr_patch ** 2)
    return config.subnets * config.batch_size * per_patch


def training_batches(config: NASConfig) -> tuple[np.ndarray, np.ndarray]:
    """(N, B, h, w, 3) LR and (N, B, 2h, 2w, 3) HR patches from the training photographs."""
    from search_spaces.sr_data import PatchSampler, default_split

    train, _ = default_split()
    sampler = PatchSampler(train, 2, config.hr_patch, seed=config.seed)
    # Each batch is written into its row as drawn: the patches are held once, not as a list of
    # batches and a stacked copy of it too.
    lr_0, hr_0 = sampler.batch(config.batch_size)
    lr = np.empty((config.subnets, *lr_0.shape), lr_0.dtype)
    hr = np.empty((config.subnets, *hr_0.shape), hr_0.dtype)
    lr[0], hr[0] = lr_0, hr_0
    for i in range(1, config.subnets):
        lr[i], hr[i] = sampler.batch(config.batch_size)
    return lr, hr


def held_out_images(config: NASConfig, images: list[np.ndarray] | None = None
                    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Held-out photographs (or ``images``) as (LR, HR) pairs: HR centre crops of at most
    ``eval_crop`` pixels a side, cut to a multiple of window x scale, and their bicubic x2
    downscaling."""
    from search_spaces.sr_data import bicubic_downscale, default_split

    images = default_split()[1] if images is None else images
    unit = 2 * config.supernet.window_size
    lrs, hrs = [], []
    for img in images:
        h = min(img.shape[0], config.eval_crop) // unit * unit
        w = min(img.shape[1], config.eval_crop) // unit * unit
        top, left = (img.shape[0] - h) // 2, (img.shape[1] - w) // 2
        hr = np.ascontiguousarray(img[top : top + h, left : left + w], np.float32)
        hrs.append(hr)
        lrs.append(bicubic_downscale(hr, 2).astype(np.float32))
    return lrs, hrs


def evaluate_subnets(
    layout: SupernetLayout,
    blocks: np.ndarray,
    shared: np.ndarray,
    subnets: list[tuple[int, ...]],
    lr_images: list[np.ndarray],
    hr_images: list[np.ndarray],
) -> list[float]:
    """Mean PSNR (dB, Y channel, border = scale) of each subnet over held-out image pairs.

    ``lr_images[i]`` is (h, w, 3) and ``hr_images[i]`` (scale h, scale w, 3), floats in [0, 1].
    """
    from search_spaces.metrics import psnr_y

    forward = jax.jit(layout.forward)
    scale = layout.config.scale
    scores = []
    for choices in subnets:
        per_image = []
        for lr, hr in zip(lr_images, hr_images, strict=True):
            sr = forward(blocks, shared, jnp.asarray(choices, jnp.int32), lr[None])
            per_image.append(psnr_y(np.clip(np.asarray(sr[0]), 0.0, 1.0), hr, border=scale))
        scores.append(float(np.mean(per_image)))
    return scores


def stem_head_psnr(
    layout: SupernetLayout, shared: np.ndarray, lr_images: list[np.ndarray],
    hr_images: list[np.ndarray],
) -> float:
    """Mean PSNR (dB, Y, border = scale) of the stem and head alone, every choice layer
    skipped: what a subnet computes while its blocks are the identity."""
    from search_spaces.metrics import psnr_y

    def net(sh: jax.Array, lr: jax.Array) -> jax.Array:
        return layout.apply_head(sh, layout.apply_stem(sh, lr), lr)

    forward, scale = jax.jit(net), layout.config.scale
    return float(np.mean([
        psnr_y(np.clip(np.asarray(forward(shared, lr[None])[0]), 0.0, 1.0), hr, border=scale)
        for lr, hr in zip(lr_images, hr_images, strict=True)
    ]))


#: Trains the supernet: called like `train_supernet` (layout, subnets, LR and HR batches, then
#: keywords ``schedule``, ``num_stages``, ``seed``, ``offload``, ``train_shared``,
#: ``num_microbatches``, ``optimizer``, ``initial_weights`` or ``initial_state``, ``executor``,
#: ``on_tick``).
TrainFn = Callable[..., TrainResult]


def run_nas(config: NASConfig, *, json_path: str | None = None, show: bool = True,
            fresh: bool = False) -> dict:
    """Train the supernet, rank ``config.eval_subnets`` subnets by held-out PSNR, save results.

    Held-out images are the SwinIR search's evaluation photographs (`held_out_images`).
    Training resumes from ``<out_dir>/checkpoint`` when an unfinished run of the same settings
    left one (``fresh``: discard it and train from the start), and deletes it once the results
    are written. A second run into the same checkpoint while this one runs is refused at once
    (`NASCheckpoint.held`).

    Returns the summary written to JSON: ``losses`` (per subnet, sequence-id order),
    ``params_sha256``, ``ticks``, ``stage_utilization``, ``ideal_ticks``, ``ideal_utilization``,
    ``device_param_bytes``, ``host_param_bytes``, ``supernet_param_bytes``, ``wall_seconds``,
    ``samples_per_second``, ``evaluation`` (subnet, ops, PSNR per evaluated subnet),
    ``bicubic_psnr``, ``stem_head_psnr`` (`stem_head_psnr`), ``best``, ``test`` (the best
    subnet on photographs no subnet is chosen by: `test_best`), ``eval_seconds``, the
    warm-up's ``warmup_steps``, ``warmup_seconds`` and ``warmup_losses``, and the training
    segments' ``segments`` (figures of each) and ``resumed_at`` (subnets done at each resume).
    Ticks, times and rates sum over the segments, of every process that trained them.
    """

    console = _console(quiet=not show)
    hold = NASCheckpoint(config)
    with hold.held():
        layout, result, extra = train_for_nas(config, console=console, fresh=fresh)
        return evaluate_and_save(config, layout, result, json_path=json_path,
                                 console=console, extra=extra, written=hold.discard)


def train_for_nas(
    config: NASConfig, *, train_fn: TrainFn = train_supernet,
    executor_class: ExecutorFactory = PipelineExecutor, console: Console | None = None,
    fresh: bool = False, comm: Any = None,
) -> tuple[SupernetLayout, TrainResult, dict[str, Any]]:
    """Warm up the stem and head (`warm_up_shared`, ``config.shared_warmup`` steps), then train
    the supernet of ``config`` on its subnets and training patches through the pipeline (the
    first half of `run_nas`), with a progress bar on ``console`` (default: none shown).

    Training goes in segments of ``config.checkpoint_every`` subnets (all at once for 0), each
    from the previous one's `SupernetState` on one compiled executor, and a `NASCheckpoint`
    is saved after each segment but the last. A checkpoint of the same settings found at the
    start is resumed (its warm-up is not redone: the saved weights hold its result); one of
    other settings is refused (`ValueError`); ``fresh`` discards it first.

    ``train_fn`` trains (default `train_supernet`) on executors of ``executor_class``
    (default `PipelineExecutor`; the MPI pipeline passes its own and its ``comm``, whose rank 0
    alone writes the checkpoint, while every rank reads it). Returns ``(layout, result,
    extra)`` with ``extra`` = ``{"warmup_steps", "warmup_seconds", "warmup_losses",
    "checkpoint_every", "segments", "resumed_at"}`` (the warm-up's steps, its wall time in
    seconds and per-step losses; the figures of each training segment and the subnets done
    where a run resumed).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = console or Console(quiet=True)
    root = comm is None or comm.Get_rank() == 0
    cfg = config.supernet
    layout = SupernetLayout(cfg)
    n = config.subnets
    subnets = [s.choices for s in sample_subnets(n, cfg, config.seed)]
    optimizer = OptimizerSpec("adam", config.learning_rate)
    console.print(
        f"supernet: {cfg.num_layers} layers x {cfg.num_choices} candidates "
        f"({', '.join(o.label for o in cfg.ops)}), width {cfg.width}, "
        f"{layout.param_count():,} weights; {n} subnets x batch "
        f"{config.batch_size}; schedule {config.schedule} on {config.stages} stages, "
        f"offload {'on' if config.offload else 'off'}; stem and head: "
        f"{config.shared_warmup} warm-up steps, "
        f"{'trained' if config.train_shared else 'frozen'} in the pipeline"
    )
    lr, hr = training_batches(config)  # after the line above: for a long run it takes a while
    checkpoint = NASCheckpoint(config)
    if fresh and root:
        checkpoint.discard(folder=False)
    if comm is not None:
        comm.barrier()  # the checkpoint is gone for every rank before any reads it
    resume = checkpoint.load()  # also with checkpoint_every 0: it continues, saving no more
    if comm is not None:
        seen = comm.allgather(None if resume is None else resume.done)
        if len(set(seen)) > 1:
            raise ValueError(
                f"the MPI ranks see different checkpoints in {checkpoint.directory} (subnets "
                f"done per rank: {seen}); give every rank the same --out-dir on a shared file "
                "system, or pass --fresh to train from the start")
    state: SupernetState | None = None
    losses: list[np.ndarray] = []
    segments: list[dict[str, Any]] = []
    resumed_at: list[int] = []
    if resume is not None:
        console.print(f"resuming from subnet {resume.done} of {n} ({checkpoint.directory})")
        state, losses, warmup = resume.state, [resume.losses], resume.warmup
        segments, resumed_at = resume.segments, [*resume.resumed_at, resume.done]
        blocks0 = shared0 = None
    else:
        blocks0, shared0 = layout.init(config.seed)
        started = time.perf_counter()
        shared0, warm_losses = warm_up_shared(
            layout, shared0, lr, hr, steps=config.shared_warmup, optimizer=optimizer
        )
        if comm is not None:  # rank 0's warm-up for every rank: one truth, whatever kernels
            shared0 = comm.bcast(np.asarray(shared0) if root else None, root=0)
        warmup = {
            "warmup_steps": config.shared_warmup,
            "warmup_seconds": time.perf_counter() - started,
            "warmup_losses": [float(x) for x in warm_losses],
        }
    done = resume.done if resume is not None else 0
    settings: dict[str, Any] = {
        "schedule": config.schedule, "num_stages": config.stages, "seed": config.seed,
        "offload": config.offload, "train_shared": config.train_shared,
        "num_microbatches": config.microbatches, "optimizer": optimizer}
    if comm is not None:
        # Each rank drew its own patches and subnets: ranks that differ there (another copy
        # of the photographs on another host) would train apart or wait forever.
        from scamp_jax.distributed.pipeline import check_ranks_pass_the_same

        start: dict[str, Any] = ({"initial_state": state} if state is not None else
                                 {"initial_weights": (blocks0, shared0)})
        check_ranks_pass_the_same(comm, layout, subnets[done:], lr[done:], hr[done:],
                                  cast(TrainOptions, {**settings, **start}))
    every = config.checkpoint_every or n
    if config.checkpoint_every and done == 0 and n > every:
        console.print(f"checkpoints every {every} subnets in {checkpoint.directory}")
    executor = _GrowingExecutor(executor_class)
    with Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, transient=False,
    ) as progress:
        task = progress.add_task(f"training ({config.schedule}, ticks)", total=None)

        def on_tick(t: int, total: int) -> None:
            progress.update(task, completed=t + 1, total=total)

        result = None
        for first in range(done, n, every):
            last = min(first + every, n)
            if last - first < n:
                progress.update(task, description=f"training ({config.schedule}, subnets "
                                f"{first}-{last - 1} of {n}, ticks)", completed=0, total=None)
            start = {"initial_state": state} if state is not None else {
                "initial_weights": (blocks0, shared0)}
            result = train_fn(
                layout, subnets[first:last], lr[first:last], hr[first:last],
                **settings, executor=executor, on_tick=on_tick, **start,
            )
            # A stop once the segment is trained waits for its checkpoint (a second Ctrl-C
            # does not): the segment is not trained again by the run that resumes
            with stops_held():
                state = result.state
                losses.append(result.losses)
                segments.append(segment_figures(result, first,
                                                (last - first) * config.batch_size))
                if last < n and config.checkpoint_every and root:
                    checkpoint.save(state, np.concatenate(losses), warmup=warmup,
                                    segments=segments, resumed_at=resumed_at)
    executor.close()
    checkpoint.close()
    if result is None:  # the checkpoint held every subnet (a run stopped while finishing)
        raise ValueError(f"{checkpoint.directory} holds a finished run; pass --fresh to train "
                         "again")
    combined = combine_results(segments, result, np.concatenate(losses))
    extra = {**warmup, "checkpoint_every": config.checkpoint_every, "segments": segments,
             "resumed_at": resumed_at}
    return layout, combined, extra


def evaluate_and_save(
    config: NASConfig,
    layout: SupernetLayout,
    result: TrainResult,
    *,
    json_path: str | None = None,
    console: Console | None = None,
    extra: dict[str, Any] | None = None,
    written: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Rank subnets of the trained supernet by held-out PSNR, test the best on the test
    photographs (`test_best`) and save the results (the second half of `run_nas`;
    ``eval_seconds`` counts the ranking and the test).

    Evaluates ``config.eval_subnets`` subnets on `held_out_images`, prints the tables on
    ``console`` (default: none shown) and writes the summary, with the keys of ``extra`` added,
    to ``json_path`` (default ``<out_dir>/results.json``) and a plot beside it (``.png``), then
    calls ``written`` (the run's discard of its checkpoint), all with stops held: a Ctrl-C
    there leaves the whole outputs and no checkpoint, or none of them and the checkpoint.
    Returns the summary (see `run_nas`).
    """
    from rich.console import Console

    console = console or Console(quiet=True)
    eval_lr, eval_hr = held_out_images(config)
    candidates = [  # each subnet once: a repeat would rank the same weights twice
        s.choices for s in distinct_subnets(config.eval_subnets, config.supernet, config.seed + 1)
    ]
    started = time.perf_counter()
    scores = evaluate_subnets(layout, result.blocks, result.shared, candidates, eval_lr, eval_hr)
    bicubic = bicubic_psnr(eval_lr, eval_hr)
    stem_head = stem_head_psnr(layout, result.shared, eval_lr, eval_hr)
    summary = _summary(config, result, candidates, scores, bicubic)
    summary["stem_head_psnr"] = stem_head
    summary["test"] = test_best(config, layout, result, summary["best"])
    summary["eval_seconds"] = time.perf_counter() - started
    summary.update(extra or {})
    _print_tables(console, config, result, summary)
    # Only the folder the results go to is made (``json_path``'s, else ``config.out_dir``).
    path = Path(json_path) if json_path else Path(config.out_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    plot = path.with_suffix(".png")
    with stops_held():  # the results whole, then the checkpoint gone: a stop waits for both
        write_whole(path, json.dumps(summary, indent=2))
        save_plot(summary, plot)
        if written is not None:
            written()
    same = ("a run of these settings under --schedule csp or sequential, resumed or not, "
            "trains the same bits" if config.schedule != "gpipe" else
            "gpipe adds its microbatches' gradients, so its last bits differ from those of "
            "csp and sequential, which train the same bits")
    console.print(f"weights sha256 {summary['params_sha256'][:16]}... (params_sha256 in the "
                  f"JSON): {same}")
    console.print(f"wrote {path} and {plot}")
    return summary


def test_best(config: NASConfig, layout: SupernetLayout, result: TrainResult,
              best: dict[str, Any]) -> dict[str, Any]:
    """The best subnet (chosen by its held-out PSNR, which so flatters it) on the test
    photographs, which no subnet is chosen by (`sr_data.bundled_test_images`): its PSNR, the
    stem and head's alone and bicubic's, cropped as the held-out ones."""
    from search_spaces.sr_data import bundled_test_images

    test_lr, test_hr = held_out_images(config, bundled_test_images())
    [psnr] = evaluate_subnets(layout, result.blocks, result.shared, [tuple(best["choices"])],
                              test_lr, test_hr)
    return {
        "index": best["index"], "psnr": psnr,
        "stem_head_psnr": stem_head_psnr(layout, result.shared, test_lr, test_hr),
        "bicubic_psnr": bicubic_psnr(test_lr, test_hr),
    }


def bicubic_psnr(lrs: list[np.ndarray], hrs: list[np.ndarray]) -> float:
    """Mean Y-channel PSNR of bicubic x2 upscaling of ``lrs`` against ``hrs`` (border 2), the
    baseline every subnet is held to."""
    from search_spaces.metrics import psnr_y
    from search_spaces.sr_data import bicubic_upscale

    return float(np.mean([psnr_y(np.clip(bicubic_upscale(x, 2), 0, 1), y, border=2)
                          for x, y in zip(lrs, hrs, strict=True)]))


def _summary(
    config: NASConfig, result: TrainResult, candidates: list[tuple[int, ...]],
    scores: list[float], bicubic: float,
) -> dict[str, Any]:
    evaluation: list[dict[str, Any]] = [
        {"index": i, "choices": list(c), "ops": subnet_labels(config.supernet, c),
         "psnr": float(p)}
        for i, (c, p) in enumerate(zip(candidates, scores, strict=True))
    ]
    best = max(evaluation, key=lambda e: e["psnr"])
    return {
        "config": dataclasses.asdict(config),
        "losses": [float(x) for x in result.losses],
        "params_sha256": result.params_sha256,
        "ticks": result.ticks,
        "stage_utilization": result.stage_utilization,
        "ideal_ticks": result.ideal_ticks,
        "ideal_utilization": result.ideal_utilization,
        "device_param_bytes": result.device_param_bytes,
        "host_param_bytes": result.host_param_bytes,
        "supernet_param_bytes": result.supernet_param_bytes,
        "activation_bytes": result.activation_bytes,
        "wall_seconds": result.wall_seconds,
        "steady_seconds": result.steady_seconds,
        "samples_per_second": result.samples_per_second,
        "evaluation": evaluation,
        "bicubic_psnr": bicubic,
        "best": best,
    }


def _print_tables(console: Any, config: NASConfig, result: TrainResult, summary: dict) -> None:
    from rich.table import Table

    from scamp_jax._units import format_bytes

    train = Table(
        title=f"training: {config.schedule}, {config.stages} stages",
        caption="params with their optimizer state: on the devices, the blocks of the subnets "
                "in flight on every stage (window slots) and the stem and head; in the whole "
                "supernet, each block once (a small supernet can hold less than the windows); "
                "every block at the length of the largest (one array shape for all), so more "
                "than the weights count. ideal util.: the same pipeline with no waits for "
                "causal order (one subnet per batch), for comparison. wall s: the whole "
                "training, compiles included; steady s: the ticks after the first (its "
                "compiles left out); samples/s: the samples at the steady ticks' pace")
    for col in ("ticks", "utilisation", "ideal util.", "params on devices",
                "params of supernet", "wall s", "steady s", "samples/s"):
        train.add_column(col, justify="right")
    train.add_row(
        str(result.ticks), f"{result.stage_utilization:.3f}", f"{result.ideal_utilization:.3f}",
        format_bytes(result.device_param_bytes), format_bytes(result.supernet_param_bytes),
        f"{result.wall_seconds:.1f}", f"{result.steady_seconds:.2f}",
        f"{result.samples_per_second:.1f}",
    )
    console.print(train)
    table = Table(
        title=f"held-out PSNR (Y, dB); bicubic {summary['bicubic_psnr']:.2f}, stem and head "
              f"alone {summary['stem_head_psnr']:.2f}"
    )
    table.add_column("candidate", justify="right")  # of this evaluation, not of training
    table.add_column("ops")
    table.add_column("PSNR", justify="right")
    ranked = sorted(summary["evaluation"], key=lambda e: -e["psnr"])
    for i, e in enumerate(ranked):
        style = "bold green" if i == 0 else None
        table.add_row(str(e["index"]), e["ops"], f"{e['psnr']:.2f}", style=style)
    console.print(table)
    best = summary["best"]
    console.print(
        f"best subnet: {best['ops']} at {best['psnr']:.2f} dB "
        f"({_against_bicubic(best['psnr'] - summary['bicubic_psnr'])})"
    )
    test = summary.get("test")
    if test is not None:
        console.print(
            f"  tested on photographs no subnet was chosen by: {test['psnr']:.2f} dB "
            f"({_against_bicubic(test['psnr'] - test['bicubic_psnr'])}; the stem and head "
            f"alone {test['stem_head_psnr']:.2f})"
        )


def _against_bicubic(gain: float) -> str:
    """A PSNR difference to bicubic's in words: ``0.42 dB above bicubic``."""
    return f"{abs(gain):.2f} dB {'above' if gain >= 0 else 'below'} bicubic"


def save_plot(summary: dict, path: Path) -> None:
    """PNG: training loss per subnet (sequence order) and held-out PSNR per evaluated subnet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    losses = np.asarray(summary["losses"])
    ax1.plot(losses, lw=0.8, label="loss")
    if len(losses) >= 10:
        k = max(5, len(losses) // 20)
        ax1.plot(np.arange(k - 1, len(losses)), np.convolve(losses, np.ones(k) / k, "valid"),
                 label=f"mean of {k}")
    ax1.set_xlabel("subnet (sequence id)")
    ax1.set_ylabel("training L1 loss")
    ax1.legend()
    scores = [e["psnr"] for e in summary["evaluation"]]
    ax2.bar(range(len(scores)), scores, color="tab:blue")
    ax2.axhline(summary["bicubic_psnr"], color="tab:red", ls="--", label="bicubic")
    ax2.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]
    ax2.set_xlabel("evaluated subnet")
    ax2.set_ylabel("PSNR Y (dB)")
    lo = min(min(scores), summary["bicubic_psnr"])
    hi = max(max(scores), summary["bicubic_psnr"])
    ax2.set_ylim(lo - 0.5, hi + 0.5)
    ax2.legend()
    fig.suptitle(
        f"{summary['config']['schedule']}: {summary['ticks']} ticks, "
        f"utilisation {summary['stage_utilization']:.2f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_nas_mpi(
    config: NASConfig, *, json_path: str | None = None, show: bool = True,
    mpi_world: Any = None, fresh: bool = False,
) -> dict[str, Any] | None:
    """`run_nas` with pipeline stage ``s`` on MPI rank ``s`` (collective).

    Every rank draws the same subnets and patches (same seed), takes rank 0's warm-up of the
    stem and head, and trains its stage on a `scamp_jax.distributed.MPIPipelineExecutor`;
    ranks whose patches, subnets or starting weights differ (another copy of the photographs
    on one host) are refused before training, with one `ValueError` naming what differs
    (`scamp_jax.distributed.check_ranks_pass_the_same`). Rank 0 then evaluates the subnets,
    prints the tables and writes ``results.json`` / ``results.png`` as `run_nas` does, plus
    ``mpi_ranks`` and the ``stage_ranks``. ``losses`` and ``params_sha256`` equal those of the
    single-process run with the same number of stages. ``config.stages`` must equal the number
    of ranks (``mpi_world``: a `scamp_jax.distributed.World`, default the MPI world). Returns
    the summary on rank 0 and None on the other ranks (which only train). Checkpoints as
    `run_nas`: rank 0 writes them from the gathered state, every rank reads one to resume;
    rank 0 holds the folder (`NASCheckpoint.held`), so a run already in it ends the job.
    """
    from scamp_jax.distributed.mpi import failures_end_every_rank, world
    from scamp_jax.distributed.pipeline import MPIPipelineExecutor

    w = mpi_world or world()
    if config.stages != w.size:
        raise ValueError(
            f"--stages {config.stages} but {w.size} MPI ranks; the MPI pipeline runs one stage per "
            f"rank: launch with mpirun -n {config.stages} or pass --stages {w.size}"
        )
    console = _console(quiet=not show or not w.is_root)
    console.print(f"one pipeline stage per MPI rank: {w.size} ranks")
    hold = NASCheckpoint(config)
    with contextlib.ExitStack() as holding:
        # The hold, the data and the warm-up come before training's collectives: a rank that
        # fails there (another run holds the folder, its photographs missing, out of memory)
        # ends the job rather than leaving the others waiting for it. Rank 0, which writes
        # the checkpoint and the results, holds the folder as `run_nas` does.
        with failures_end_every_rank(w.comm):
            if w.is_root:
                holding.enter_context(hold.held())
            layout, result, warmup = train_for_nas(
                config, executor_class=functools.partial(MPIPipelineExecutor, comm=w.comm),
                console=console, fresh=fresh, comm=w.comm,
            )
        if not w.is_root:
            return None
        extra = {**warmup, "mpi_ranks": w.size, "stage_ranks": list(range(w.size))}
        return evaluate_and_save(config, layout, result, json_path=json_path, console=console,
                                 extra=extra, written=hold.discard)
