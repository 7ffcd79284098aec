"""Compiled programs that outlive a process: a study's persistent compilation cache.

`study_compile_cache` points JAX's persistent compilation cache at a study's ``jax_cache``
folder while a study runs, so every compile of the study (planning, the initial states, the
evaluation forwards, the runs' steps, on every thread) is looked up there first and written
there after: a resumed study, a second process or another MPI rank of it compiles nothing
that one of them compiled before. JAX keys an entry by the lowered program, the XLA options
of its compile (planning and run grades are separate entries), the devices' platform, the
JAX and XLA versions and, on CPU (not on GPUs), the devices' assignment and the layout of the
process's CPU devices (a process with another number of CPU devices, e.g. a study resumed with
another ``--devices``, compiles its own; the worker pool's size, ``PJRT_NPROC`` or the host's
cores, is not in the key, and XLA's CPU convolutions split their work by the running process's
pool whichever process compiled them, `scamp_jax.pipeline.determinism`); it stores the
executable with its buffer assignment: an executable read back answers ``memory_analysis()``
as the compiled one did, so a planning compile found there is as good as one made. On CPU a
trial that ran a program compiled for other devices and moved onto its own
(`scamp_jax.planning.reuse.load_on_devices`) compiled nothing, so nothing was written for its
devices: a later process's trial there compiles it (an executable read back cannot be moved).

On GPUs JAX keeps XLA's autotuning results in the same folder
(``xla_gpu_per_fusion_autotune_cache_dir``, `jax_persistent_cache_enable_xla_caches`): a run's
step autotunes each fusion once per study, not once per process. JAX makes only its process 0
of a ``jax.distributed`` job write those; MPI ranks of a study are each a process 0, so each
reads and writes them (per fusion, XLA's own files).

One writer of compiled programs: only the process that owns the study (MPI rank 0) writes
entries; the others read them and compile what is not there themselves (JAX writes an entry in
place, so a second writer could hand a reader half a file; with ``filelock`` installed, JAX also
takes a lock around every read and write, `FILE_LOCK_BYTES`). Every compile is written, however
short: a resumed study should compile nothing it compiled before. An entry a process was killed
while writing stays half a file, which JAX neither reads nor writes again: the writer removes
such entries when it opens the cache (`drop_unreadable`, each entry checked once), so that
their programs are compiled and kept anew. The folder may be deleted whenever no process of
the study runs: it holds compiled programs only, which are compiled again.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The folder of a study directory that holds the cache (beside ``plans.sqlite``).
CACHE_DIRNAME = "jax_cache"
#: Size bound (bytes) that turns on JAX's file lock around cache reads and writes (JAX locks
#: only when it may evict, which needs a bound); far above any study's cache.
FILE_LOCK_BYTES = 1 << 40
#: `jax_persistent_cache_min_compile_time_secs` of a reader: it never writes.
_NEVER = 1e12
#: In the cache folder: its time says up to when its entries were checked (`drop_unreadable`).
CHECKED_FILE = ".checked"
#: Seconds an entry is left unchecked after it was written: another process of the study may
#: still be writing it (JAX writes in place); it is checked at a later opening.
WRITE_GRACE_S = 120.0
#: JAX's suffix of an entry's file (``<name>-<key>-cache``).
_ENTRY_SUFFIX = "-cache"

log = logging.getLogger(__name__)


def cache_dir(study_dir: str | Path) -> Path:
    """The persistent compilation cache folder of the study directory ``study_dir``."""
    return Path(study_dir) / CACHE_DIRNAME


def cache_problem(study_dir: str | Path) -> str | None:
    """Why ``study_dir``'s cache folder cannot be one (a file is at its path), or None."""
    directory = cache_dir(study_dir)
    if directory.exists() and not directory.is_dir():
        return (f"{str(directory)!r} is a file, where the study keeps its compiled programs "
                "(a folder): move or delete it (the study makes the folder)")
    return None


def _settings(directory: Path, writer: bool) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "jax_compilation_cache_dir": str(directory),
        "jax_persistent_cache_min_compile_time_secs": 0.0 if writer else _NEVER,
        "jax_persistent_cache_min_entry_size_bytes": -1,  # no size bound
        # XLA's GPU autotune results beside the executables, for readers too: jax 0.10 hashes
        # this folder into every entry's key, so a reader without it would find nothing
        "jax_persistent_cache_enable_xla_caches": "xla_gpu_per_fusion_autotune_cache_dir",
    }
    if importlib.util.find_spec("filelock") is not None:
        settings["jax_compilation_cache_max_size"] = FILE_LOCK_BYTES
    return settings


@contextlib.contextmanager
def study_compile_cache(study_dir: str | Path, *, writer: bool = True) -> Iterator[Path]:
    """Use the persistent compilation cache of ``study_dir`` (its ``jax_cache`` folder) in this
    process while the block runs; ``writer``: write new entries (the study's owner, MPI rank
    0), else only read them. The previous settings come back afterwards. Yields the folder.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    directory = cache_dir(study_dir)
    problem = cache_problem(study_dir)
    if problem is not None:
        raise ValueError(problem)
    directory.mkdir(parents=True, exist_ok=True)
    if writer and not os.access(directory, os.W_OK):
        log.warning("the study's compiled programs cannot be kept in %r (it cannot be written "
                    "here): this process compiles what is not there already; make it "
                    "writable to keep them", str(directory))
        writer = False
    if writer:
        dropped = drop_unreadable(directory)
        if dropped:
            log.warning("removed %d half-written compiled program(s) from %r (unreadable: "
                        "a process stopped while writing them?): they are compiled and kept "
                        "again", dropped, str(directory))
    settings = _settings(directory, writer)
    before = {name: getattr(jax.config, name) for name in settings}
    # JAX opens its cache once per process, at the first compile that uses it: start afresh so
    # that this folder is the one opened (and again after, for the settings restored).
    compilation_cache.reset_cache()
    for name, value in settings.items():
        jax.config.update(name, value)
    try:
        yield directory
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def drop_unreadable(directory: str | Path) -> int:
    """Remove the entries of the cache folder ``directory`` that do not decompress whole (a
    process killed while JAX wrote one in place leaves half a file, which JAX warns of at
    every read and never replaces), and return how many. Each entry is checked once, at the
    first opening at least `WRITE_GRACE_S` after it was written (before, another process may
    still be writing it): ``CHECKED_FILE``'s time says up to when entries were checked. Checks
    nothing where this JAX's decompression cannot be found or does not read back what its
    compression wrote."""
    decompress = _jax_decompression()
    if decompress is None:
        return 0
    directory = Path(directory)
    marker = directory / CHECKED_FILE
    since = marker.stat().st_mtime if marker.exists() else float("-inf")
    until = time.time() - WRITE_GRACE_S  # entries written later: checked at a later opening
    dropped = 0
    for entry in directory.iterdir():
        if not entry.name.endswith(_ENTRY_SUFFIX):
            continue
        try:
            if not since <= entry.stat().st_mtime < until:
                continue
            data = entry.read_bytes()
        except FileNotFoundError:
            continue
        try:
            decompress(data)
        except Exception:  # noqa: BLE001 - the codec's error (zlib's, zstandard's): unreadable
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
            dropped += 1
    marker.touch()
    os.utime(marker, (max(until, since), max(until, since)))
    return dropped


def _jax_decompression() -> Any:
    """JAX's own reading of a cache entry (zstandard or zlib, as it wrote it: no public API
    has it), where it reads back what JAX's compression writes; else None."""
    try:
        from jax._src.compilation_cache import compress_executable, decompress_executable
        if decompress_executable(compress_executable(b"scamp-jax")) == b"scamp-jax":
            return decompress_executable
    except Exception:  # noqa: BLE001 - another JAX's internals: check nothing
        pass
    return None
