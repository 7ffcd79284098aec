"""Multi-host runs through MPI: host-side messages with mpi4py, arrays with mpi4jax.

mpi4py and mpi4jax are optional (``pip install 'scamp-jax[mpi]'``): importing this package does
not import them; the functions that need them raise `MPIUnavailableError` with an install hint.

- `world`, `launched_under_mpi`, `mpirun_command`: who we are, how to launch.
- `MPIPipelineExecutor`, `train_supernet_mpi`: the supernet pipeline with one stage per rank.
- `mpi_mean`, `local_batch`, `jit_data_parallel_step`, `train_data_parallel`: a trial that is
  data parallel across ranks.
- `shared_study`, `StudyServer`, `StudyClient`: one Optuna study served by rank 0 to all ranks.
- `run_search_mpi`, `RemoteTrialSource`, `MPISearchEngine`: the HPO engine on every rank, fed by
  rank 0's study; `SpanPlan`, `run_spanning_trials`: trials that span ranks, data parallel.
"""

from scamp_jax.distributed.data_parallel import check_one_device as check_one_device
from scamp_jax.distributed.data_parallel import jit_data_parallel_step as jit_data_parallel_step
from scamp_jax.distributed.data_parallel import local_batch as local_batch
from scamp_jax.distributed.data_parallel import mpi_mean as mpi_mean
from scamp_jax.distributed.data_parallel import one_device_shardings as one_device_shardings
from scamp_jax.distributed.data_parallel import train_data_parallel as train_data_parallel
from scamp_jax.distributed.engine import MPISearchEngine as MPISearchEngine
from scamp_jax.distributed.engine import RemoteTrialSource as RemoteTrialSource
from scamp_jax.distributed.engine import run_search_mpi as run_search_mpi
from scamp_jax.distributed.mpi import MPIUnavailableError as MPIUnavailableError
from scamp_jax.distributed.mpi import World as World
from scamp_jax.distributed.mpi import import_mpi4jax as import_mpi4jax
from scamp_jax.distributed.mpi import import_mpi4py as import_mpi4py
from scamp_jax.distributed.mpi import launched_under_mpi as launched_under_mpi
from scamp_jax.distributed.mpi import mpirun_command as mpirun_command
from scamp_jax.distributed.mpi import world as world
from scamp_jax.distributed.pipeline import MPIPipelineExecutor as MPIPipelineExecutor
from scamp_jax.distributed.pipeline import train_supernet_mpi as train_supernet_mpi
from scamp_jax.distributed.spanning import SpanPlan as SpanPlan
from scamp_jax.distributed.spanning import run_spanning_trials as run_spanning_trials
from scamp_jax.distributed.study import StudyClient as StudyClient
from scamp_jax.distributed.study import StudyServer as StudyServer
from scamp_jax.distributed.study import WorkItem as WorkItem
from scamp_jax.distributed.study import shared_study as shared_study

__all__ = [
    "MPIPipelineExecutor",
    "MPISearchEngine",
    "MPIUnavailableError",
    "RemoteTrialSource",
    "SpanPlan",
    "StudyClient",
    "StudyServer",
    "WorkItem",
    "World",
    "check_one_device",
    "import_mpi4jax",
    "import_mpi4py",
    "jit_data_parallel_step",
    "launched_under_mpi",
    "local_batch",
    "mpi_mean",
    "mpirun_command",
    "one_device_shardings",
    "run_search_mpi",
    "run_spanning_trials",
    "shared_study",
    "train_data_parallel",
    "train_supernet_mpi",
    "world",
]
