"""Multi-host runs through MPI: host-side messages with mpi4py, arrays with mpi4jax.

mpi4py and mpi4jax are optional (``pip install 'scamp-jax[mpi]'``): importing this package does
not import them; the functions that need them raise `MPIUnavailableError` with an install hint.

- `world`, `launched_under_mpi`, `mpirun_command`: who we are, how to launch;
  `failures_end_every_rank`: code every rank runs together, where one rank's exception ends the
  job instead of leaving the others waiting.
- `MPIPipelineExecutor`, `train_supernet_mpi`: the supernet pipeline with one stage per rank.
- `mpi_mean`, `local_batch`, `jit_data_parallel_step`, `train_data_parallel`: a trial that is
  data parallel across ranks.
- `shared_study`, `StudyServer`, `StudyClient`: one Optuna study served by rank 0 to all ranks.
- `run_search_mpi`, `RemoteTrialSource`, `MPISearchEngine`: the HPO engine on every rank, fed by
  rank 0's study; `SpanPlan`, `run_spanning_trials` (its `SpanningRun` each): trials that
  span ranks, data parallel.
"""

from scamp_jax._lazy import exports as _exports

_NAMES = {
    **dict.fromkeys(("check_one_device", "jit_data_parallel_step", "local_batch", "mpi_mean",
                     "one_device_shardings", "train_data_parallel",),
                    "scamp_jax.distributed.data_parallel"),
    **dict.fromkeys(("MPISearchEngine", "RemoteTrialSource", "run_search_mpi",),
                    "scamp_jax.distributed.engine"),
    **dict.fromkeys(("MPIUnavailableError", "World", "failures_end_every_rank", "import_mpi4jax",
                     "import_mpi4py", "launched_under_mpi", "mpirun_command", "world",),
                    "scamp_jax.distributed.mpi"),
    **dict.fromkeys(("MPIPipelineExecutor", "check_ranks_pass_the_same", "train_supernet_mpi",),
                    "scamp_jax.distributed.pipeline"),
    **dict.fromkeys(("SpanPlan", "SpanningRun", "run_spanning_trials"),
                    "scamp_jax.distributed.spanning"),
    **dict.fromkeys(("StudyClient", "StudyServer", "WorkItem", "shared_study",),
                    "scamp_jax.distributed.study"),
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = _exports(__name__, _NAMES)
