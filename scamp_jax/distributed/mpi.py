"""MPI for multi-host runs: lazy imports with an install hint, and who we are in the world.

mpi4py and mpi4jax are optional (the ``mpi`` extra): single-host use never imports them.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_INSTALL_HINT = (
    "multi-host runs need MPI, mpi4py and mpi4jax: install an MPI (Debian: apt-get install "
    "libopenmpi-dev openmpi-bin), then `pip install 'scamp-jax[mpi]'` (if the mpi4jax build fails "
    "looking for CUDA headers, see BUILD.md: CUDA_PATH=<empty dir> pip install mpi4jax)"
)

#: Newest JAX release series, (major, minor), that this project's MPI tests pass on with the
#: newest mpi4jax. mpi4jax warns on import whenever JAX is newer than the release it was tested
#: against; up to this series the combination is tested here, so that warning is not shown
#: (it would be printed once per rank). On a newer JAX it is shown, and the test suite, which
#: treats warnings as errors, fails until the MPI tests have been run there and this is raised.
MPI_TESTED_JAX = (0, 12)
# mpi4jax's variable that leaves out that warning (mpi4jax/_src/jax_compat.py, 0.9.x).
_MPI4JAX_NO_WARN = "MPI4JAX_NO_WARN_JAX_VERSION"

class MPIUnavailableError(ImportError):
    """mpi4py or mpi4jax is not installed; the message says how to install them."""


def launcher_ranks() -> int | None:
    """The ranks an MPI launcher started this process among (Open MPI's, MPICH/Hydra's, or
    PMIx's under Slurm, where a PMIx rank without ``SLURM_NTASKS`` counts as several), or None
    when no launcher started it. Reads only environment variables, so it is safe to call
    before importing mpi4py (importing mpi4py initialises MPI, which a plain single-process run
    should not do)."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    if os.environ.get("OMPI_MCA_ess") == "singleton":
        # What an MPI initialised without a launcher (Open MPI's singleton) leaves in the
        # environment its process's children inherit: PMIx variables, and no launcher.
        return None
    if "PMIX_RANK" in os.environ:
        return int(os.environ.get("SLURM_NTASKS", "2"))
    return None


def launcher_rank() -> int:
    """This process's rank as its MPI launcher numbered it (Open MPI's, MPICH/Hydra's or
    PMIx's variable), 0 where no launcher started it; from the environment, before mpi4py."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def launched_under_mpi() -> bool:
    """True when this process was started by an MPI launcher with more than one rank
    (`launcher_ranks`)."""
    return (launcher_ranks() or 1) > 1


def import_mpi4py() -> Any:
    """Return ``mpi4py.MPI`` or raise `MPIUnavailableError` with an install hint."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise MPIUnavailableError(f"mpi4py is not importable ({err}); {_INSTALL_HINT}") from err
    return MPI


def import_mpi4jax() -> ModuleType:
    """Return the ``mpi4jax`` module or raise `MPIUnavailableError` with an install hint.

    mpi4jax's warning about a JAX newer than its own tests is left out on JAX releases up to
    `MPI_TESTED_JAX`, which this project's MPI tests cover.
    """
    import jax

    # mpi4jax's own switch, read when it is imported; a warnings filter would be process-wide
    # state that another thread's `catch_warnings` can restore while the import runs
    quiet = (tuple(jax.__version_info__[:2]) <= MPI_TESTED_JAX
             and "mpi4jax" not in sys.modules)  # imported once: warned then, or not
    before = os.environ.get(_MPI4JAX_NO_WARN)
    try:
        if quiet:
            os.environ[_MPI4JAX_NO_WARN] = "1"
        import mpi4jax
    except ImportError as err:
        raise MPIUnavailableError(f"mpi4jax is not importable ({err}); {_INSTALL_HINT}") from err
    finally:
        if quiet and before is None:
            os.environ.pop(_MPI4JAX_NO_WARN, None)
        elif quiet and before is not None:
            os.environ[_MPI4JAX_NO_WARN] = before
    return mpi4jax


@dataclass(frozen=True)
class World:
    """This process's place among the MPI ranks (``rank`` in ``0 .. size-1``)."""

    rank: int
    size: int
    comm: Any = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def world() -> World:
    """The MPI world when launched under MPI, else a single-rank world without importing MPI."""
    if not launched_under_mpi():
        return World(rank=0, size=1, comm=None)
    comm = import_mpi4py().COMM_WORLD
    return World(rank=comm.Get_rank(), size=comm.Get_size(), comm=comm)


def mpirun_command(ranks: int, launcher: str = "mpirun") -> list[str]:
    """``[mpirun, -n, ranks, ...]`` ready to prepend to a Python command line.

    With Open MPI it adds ``--oversubscribe`` so that more ranks than cores can run (small
    machines, CI) and, when this process is root, ``--allow-run-as-root`` (Open MPI refuses to
    start otherwise); other MPIs get the plain ``-n``.

    Raises:
      MPIUnavailableError: ``launcher`` is not on PATH.
    """
    import shutil
    import subprocess

    if ranks < 1:
        raise ValueError(f"{ranks=} must be at least 1")
    path = shutil.which(launcher)
    if path is None:
        raise MPIUnavailableError(f"{launcher!r} is not on PATH; {_INSTALL_HINT}")
    cmd = [path, "-n", str(ranks)]
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" in version.stdout + version.stderr:
        cmd.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd


#: What `end_every_rank` says of a stop where the job keeps what it saved (a study, an
#: experiment with its checkpoint).
RESUMABLE = "what the job saved stays; run the same command to resume"


def end_every_rank(comm: Any, err: BaseException, note: str = "",
                   stopped: str = RESUMABLE) -> None:
    """Say on stderr that this rank failed with ``err`` (worded as the entry points word
    errors, with its notes), and ``note``, then abort the job through ``comm``, so that the
    other ranks do not wait forever in a collective this rank will never reach (exit status 2
    for a `ValueError`, a usage error; else 1). A stop (Ctrl-C, or SIGTERM as
    `scamp_jax._signals.Terminated`) is said as one, with ``stopped`` (what of the job is
    kept), and ends it with 130 or 143."""
    from scamp_jax._errors import worded
    from scamp_jax._signals import Terminated

    if isinstance(err, KeyboardInterrupt):  # a stop, not a failure: mpirun's status says which
        code, what = (143, "SIGTERM") if isinstance(err, Terminated) else (130, "Ctrl-C")
        print(f"rank {comm.Get_rank()} stopped ({what}): {stopped}", file=sys.stderr, flush=True)
        comm.Abort(code)
        return
    print(f"rank {comm.Get_rank()} failed: {worded(err)}", file=sys.stderr, flush=True)
    for said in getattr(err, "__notes__", ()):  # e.g. where rank 0 raised it for this rank
        print(f"rank {comm.Get_rank()}: {said}", file=sys.stderr, flush=True)
    if note:
        print(f"rank {comm.Get_rank()} {note}", file=sys.stderr, flush=True)
    comm.Abort(2 if isinstance(err, ValueError) else 1)


@contextlib.contextmanager
def failures_end_every_rank(comm: Any, stopped: str = RESUMABLE) -> Iterator[None]:
    """Code that every rank runs together: an exception on one rank (Ctrl-C included) ends the
    whole job through `end_every_rank` (``stopped``: what it says a stop keeps) instead of
    leaving the others blocked."""
    try:
        yield
    except BaseException as err:  # noqa: BLE001 - one rank's failure must end every rank
        end_every_rank(comm, err, stopped=stopped)
        raise
