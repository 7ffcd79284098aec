"""Orbax checkpoints of one trial: parameters, optimizer state and the step they belong to.

Each trial writes to its own directory (``<study_dir>/checkpoints/<checkpoint_key>/<step>``).
Saves are synchronous: a trial's checkpoint is on disk when `TrialCheckpointer.save` returns, so
a ``kill -9`` right after loses at most the steps since the last save. (orbax's asynchronous
saves were tried: with several trials saving at once in one process, their background writes
raced on the temporary directories, ``Directory not empty`` and ``File exists`` errors in about
one study in two, so trials save synchronously.) orbax is imported when the first checkpointer
is made, not with ``scamp_jax``. Restores take the target
shardings from abstract arrays (``jax.ShapeDtypeStruct`` with a sharding): orbax reads each shard
straight onto its device, so a resumed trial may land on other devices than before and holds its
state once (no freshly initialised copy beside the restored one). Each array is written whole from
one of its replicas (`array_handler`): orbax's default splits a replicated array among its
replicas, which compiles a slicing program per array shape on the devices it runs on.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import jax

from scamp_jax.hpo.overhead import CHECKPOINT_SAVE, CHECKPOINT_WAIT, timed_section

log = logging.getLogger(__name__)

#: what orbax adds to a step's folder while it writes it (``5.orbax-checkpoint-tmp``)
UNFINISHED_SUFFIX = ".orbax-checkpoint-tmp"


def _is_key_array(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def to_storable(tree: Any) -> Any:
    """Replace typed PRNG key arrays by their raw ``uint32`` data (orbax stores plain arrays)."""
    def convert(x: Any) -> Any:
        if not _is_key_array(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            raw = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
            # the raw data's trailing axis is never split: the key's sharding applies as is
            return jax.ShapeDtypeStruct(raw.shape, raw.dtype, sharding=x.sharding)
        return jax.random.key_data(x)

    return jax.tree.map(convert, tree)


def from_storable(stored: Any, like: Any) -> Any:
    """Inverse of `to_storable`: wrap raw key data back into typed keys where ``like`` has keys."""
    def convert(x: Any, ref: Any) -> Any:
        if _is_key_array(ref):
            return jax.random.wrap_key_data(x)
        return x

    return jax.tree.map(convert, stored, like)


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) describing the arrays of ``tree``."""
    def describe(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(describe, tree)


def recorded_batch(directory: str | Path) -> int | None:
    """The global batch the checkpoints in ``directory`` were trained at (None: not recorded,
    e.g. checkpoints written before it was, or no directory)."""
    try:
        path = Path(directory) / TrialCheckpointer.BATCH_FILE
        return int(json.loads(path.read_text())["batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def newest_step(directory: str | Path, steps: int | None = None) -> int | None:
    """The newest step checkpointed in ``directory`` of at most ``steps`` (None: any), read
    from its step folders (None: none). One rule for the step a trial resumes at
    (`scamp_jax.hpo.lifecycle.resumable_step`) and the step the engine groups it by: a
    checkpoint of a longer run (more steps than this one asks for) holds weights trained past
    ``steps``, and resuming from it would report a longer training as this one."""
    return max(saved_steps(directory, steps), default=None)


def saved_steps(directory: str | Path, steps: int | None = None) -> set[int]:
    """The steps of at most ``steps`` (None: any) checkpointed in ``directory``, read from its
    step folders (empty: none)."""
    try:
        saved = {int(p.name) for p in Path(directory).iterdir() if p.name.isdigit()}
    except OSError:  # no directory: nothing saved
        return set()
    return {s for s in saved if steps is None or s <= steps}


def trains_from_start(kept_batch: int | None, batch_size: int) -> bool:
    """Whether checkpoints trained at ``kept_batch`` (None: not recorded) are discarded in a run
    at ``batch_size``: their steps are of another batch (a re-plan after an out-of-memory, a
    rerun with another cap), so a trial resumed from them would train other samples than it
    promises; it trains from the start instead. Checkpoints whose batch is not recorded
    (``batch.json`` removed, or written before it was) may be of any batch, and are discarded
    alike. One rule for a trial alone and for grouping members by the step they resume at."""
    return kept_batch != batch_size


class CheckpointUnreadable(ValueError):
    """The checkpoint of ``step`` in ``directory`` cannot be read as the state the trial
    builds: damaged (a file missing or cut short), or saved by another model or optimizer."""

    def __init__(self, message: str, directory: Path, step: int) -> None:
        super().__init__(message)
        self.directory, self.step = Path(directory), int(step)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole (MPI ranks, processes)
        return type(self), (str(self), self.directory, self.step)


#: Where `set_aside` moves a trial's unreadable checkpoints: beside its directory, with this
#: suffix (``checkpoints/trial_3.unreadable/28``).
UNREADABLE_SUFFIX = ".unreadable"


def set_aside(directory: str | Path, step: int) -> Path:
    """Move the checkpoint of ``step`` out of the trial's ``directory`` (into
    ``<directory>.unreadable/<step>``, replacing an earlier one there): the trial then resumes
    from an older checkpoint, or from the start, and nothing is deleted. Returns where it is."""
    directory = Path(directory)
    aside = directory.with_name(directory.name + UNREADABLE_SUFFIX) / str(int(step))
    aside.parent.mkdir(parents=True, exist_ok=True)
    if aside.exists():
        shutil.rmtree(aside)
    (directory / str(int(step))).rename(aside)
    return aside


def array_handler(ocp: Any) -> Any:
    """The orbax handler of a trial's state: its arrays written and read as orbax's standard
    handler writes them, but each array whole from its first replica. Orbax's default for
    arrays on several devices ("replica-parallel") has each replica write a slice, cut on the
    device by a program compiled for every array shape and sharding: a data-parallel trial of
    ~200 arrays compiled ~50 of them at its first save (1.3-2.8 s on CPU, a GPU compile each
    on a GPU). Orbax itself leaves it off where ``JAX_PLATFORMS`` names a GPU, so a GPU run
    that does not set it paid them. One host writes a trial's checkpoint either way. The
    files differ in their chunks (one per array here, one per replica's slice there) and in
    orbax's per-array metadata (not written here: keys are stored as raw data, `to_storable`),
    and either handler restores checkpoints of either kind."""
    import numpy as np

    handlers = ocp.type_handlers
    scalar = handlers.ScalarHandler()
    registry = handlers.create_type_handler_registry(  # orbax's defaults, but for jax.Array
        (jax.Array, handlers.ArrayHandler(use_replica_parallel=False)),
        (np.ndarray, handlers.NumpyHandler()),
        (int, scalar), (float, scalar), (bytes, scalar), (np.number, scalar),
        (str, handlers.StringHandler()),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class TrialCheckpointer:
    """Save and restore one trial's training state with orbax.

    Args:
      directory: the trial's checkpoint directory (created if missing).
      keep: how many most recent checkpoints to keep on disk.
    """

    def __init__(self, directory: str | Path, *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"{keep=} must be at least 1 checkpoint to keep")
        import orbax.checkpoint as ocp  # a second or so of imports, only when checkpointing
        from orbax.checkpoint import checkpoint_managers

        self._ocp = ocp
        self.directory = Path(directory).resolve()
        options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=False,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_handlers=array_handler(ocp))
        self._saved: set[int] = set()  # steps saved by this checkpointer (written or in flight)

    #: The global batch the checkpoints were trained at, beside them (``{"batch_size": B}``).
    BATCH_FILE = "batch.json"

    def batch_size(self) -> int | None:
        """The global batch this directory's checkpoints were trained at (None: not recorded,
        e.g. checkpoints written before it was)."""
        return recorded_batch(self.directory)

    def record_batch(self, batch_size: int) -> None:
        """Record the global batch the checkpoints of this directory are trained at."""
        path = self.directory / self.BATCH_FILE
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"batch_size": int(batch_size)}))
        partial.replace(path)  # a reader sees the old record or the new one

    def discard(self) -> None:
        """Delete every checkpoint of this directory (the trial trains from the start)."""
        self.wait()
        for step in self._manager.all_steps():
            self._manager.delete(step)
        self._saved.clear()

    def latest_step(self) -> int | None:
        """Step of the newest complete checkpoint, or ``None`` if there is none (a save still
        being written counts once it is complete)."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any) -> None:
        """Save ``state`` (a pytree of arrays, e.g. params + optimizer state) as ``step``.

        A step already saved is kept as it is (the same step always holds the same state).
        """
        if step in self._saved or step in self._manager.all_steps():
            return
        self._saved.add(step)
        # Saves a process stopped or killed while writing left unfinished (of this step, which
        # orbax would remove too, warning in its own words, or of any other, which nothing
        # would): this trial's writer is this process now, and its own saves are done.
        for unfinished in self.directory.glob(f"*{UNFINISHED_SUFFIX}*"):
            log.info("removing %s, a checkpoint left unfinished by a process that ended while "
                     "writing it", unfinished)
            shutil.rmtree(unfinished, ignore_errors=True)
        with timed_section(CHECKPOINT_SAVE):
            self._manager.save(step, args=self._ocp.args.PyTreeSave(to_storable(state)),
                               force=True)
            self._manager.wait_until_finished()

    def wait(self) -> None:
        """Wait until every save is on disk."""
        with timed_section(CHECKPOINT_WAIT):
            self._manager.wait_until_finished()

    def restore(self, like: Any, step: int | None = None) -> tuple[int, Any]:
        """Read the checkpoint at ``step`` (default: newest) shaped and sharded like ``like``.

        ``like`` is a pytree of arrays or ``jax.ShapeDtypeStruct`` with shardings. Returns
        ``(step, state)``. Raises ``FileNotFoundError`` if the directory holds no checkpoint,
        `CheckpointUnreadable` if that step's cannot be read as ``like``.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(
                f"no checkpoint in {self.directory}; check the path or start the trial from scratch"
            )
        self.wait()
        target = to_storable(_abstract(like))
        restore_args = self._ocp.checkpoint_utils.construct_restore_args(target)
        stored = read_or_say(lambda: self._manager.restore(step, args=self._ocp.args.PyTreeRestore(
            target, restore_args=restore_args)), self.directory / str(step),
            "the state this trial builds")
        return step, from_storable(stored, like)

    def step_directory(self, step: int) -> Path:
        """Directory holding the checkpoint of ``step``."""
        return self.directory / str(step)

    def close(self) -> None:
        """Wait for the saves to be on disk, then release the manager's resources."""
        self.wait()
        self._manager.close()


#: TensorStore's status codes for data that is not what its metadata says: cut short
#: (``OUT_OF_RANGE``), overwritten (``FAILED_PRECONDITION``: a codec that cannot decode it),
#: or failing its checksum (``DATA_LOSS``); not a permission, an unavailable disk or an I/O
#: error, which are not the checkpoint's own.
_DAMAGED_DATA = ("OUT_OF_RANGE", "FAILED_PRECONDITION", "DATA_LOSS")


def _checkpoints_own(err: BaseException) -> BaseException | None:
    """``err`` where it says the checkpoint itself cannot be read as asked, else None. Orbax's
    words for that are `ValueError` (tree structures, shapes), `FileNotFoundError` (files
    missing) and a `KeyError` that an item "was not found in the checkpoint"; data cut
    short or overwritten is a `ValueError` of TensorStore with a damaged data code
    (`_DAMAGED_DATA`: "OUT_OF_RANGE: Error reading ... in OCDBT database") that orbax raises
    from a bare `Exception` ("Encountered error while reading array index")."""
    if isinstance(err, ValueError | FileNotFoundError):
        return err
    if isinstance(err, KeyError) and "was not found in the checkpoint" in str(err):
        return err  # an item's folder gone: orbax's composite restore
    cause = err.__cause__ if type(err) is Exception else None  # orbax's wrapper alone
    if isinstance(cause, ValueError) and str(cause).split(":", 1)[0] in _DAMAGED_DATA:
        return cause
    return None


def orbax_says(err: BaseException) -> str:
    """``err`` (`_checkpoints_own`'s) in a line or a few: its type and message without orbax's
    advice on its own arguments or the whole JSON spec of TensorStore's reader (~50 lines)."""
    found = "\n".join(line for line in str(err).rstrip().splitlines()
                      if "partial_restore" not in line)  # orbax's own argument
    return f"{type(err).__name__}: {found.split(' [tensorstore_spec')[0]}"


#: Why a checkpoint of a trial cannot be read, as `read_or_say` asks by default.
_WHY = "is it damaged, or did the search space's model or optimizer change since it was saved?"


def read_or_say(read: Any, where: Path, builds: str, why: str = _WHY) -> Any:
    """``read()`` (an orbax restore of the checkpoint in ``where``); where it fails on the
    checkpoint's own data (`_checkpoints_own`), `CheckpointUnreadable` in one message that
    names ``where``, what ``builds`` it and asks ``why``, with no traceback of the reads orbax
    abandons (`_quiet_abandoned_reads`). ``where`` is a step directory (its name the step's
    number, or e.g. ``best_model``)."""
    _quiet_abandoned_reads()  # before: the first read may fail while orbax raises
    try:
        return read()
    except Exception as raised:  # noqa: BLE001 - re-raised unless the checkpoint's own
        err = _checkpoints_own(raised)
        if err is None:
            raise
        raise CheckpointUnreadable(
            f"the checkpoint {where} cannot be read as {builds} ({why}); orbax: "
            f"{orbax_says(err)}",
            where.parent, int(where.name) if where.name.isdigit() else -1,
        ) from err


_quieted = threading.Lock()
_quiet = False


def _abandoned_read(unraisable: Any) -> bool:
    """Whether an unraisable error is one of a failed restore's abandoned reads: orbax (0.12.8)
    runs a restore on an event loop it closes as soon as the first read fails, without cancelling
    the others, so each read TensorStore finishes later fails to hand its result to the closed
    loop (``RuntimeError: Event loop is closed`` in ``call_soon_threadsafe``, from a TensorStore
    thread), and the reads' coroutines, never finished, fail when they are collected."""
    exc, obj = unraisable.exc_value, unraisable.object
    if getattr(obj, "__qualname__", None) == "_read_array_index_and_device_put":
        return True  # the coroutine of one array's read, collected unfinished
    if obj is not None or not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
        return False
    frame = unraisable.exc_traceback
    while frame is not None:
        if frame.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        frame = frame.tb_next
    return False


class _AbandonedReadFilter(logging.Filter):
    """Drops asyncio's "... exception was never retrieved" for orbax's reads of an array that
    failed after the restore already had (the restore's error names the checkpoint): a task
    of orbax's ``async_deserialize``, or a future that holds TensorStore's error for damaged
    data (`_DAMAGED_DATA`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "exception was never retrieved" not in message:
            return True
        if "coro=<async_deserialize()" in message:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, ValueError)
                    and str(exc).split(":", 1)[0] in _DAMAGED_DATA)


def _quiet_abandoned_reads() -> None:
    """Where a restore fails on the checkpoint's own data (`CheckpointUnreadable` says so in
    one message), keep its abandoned reads (`_abandoned_read`) off stderr: each would print a
    traceback, about 280 lines for a trial's state. Installed once per process, at its first
    restore (a read may end between orbax closing its loop and the error reaching the
    restore); every other unraisable error and asyncio record goes where it went before."""
    global _quiet
    with _quieted:
        if _quiet:
            return
        _quiet = True
        earlier = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if not _abandoned_read(unraisable):
                earlier(unraisable)

        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_AbandonedReadFilter())


def copy_checkpoint(source: str | Path, destination: str | Path) -> Path:
    """Copy a checkpoint step directory to ``destination`` (replaced if it exists)."""
    source, destination = Path(source), Path(destination)
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint {source} does not exist; nothing to copy")
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(source, destination)
    return destination
