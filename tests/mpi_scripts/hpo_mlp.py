"""An HPO entry point over a tiny MLP regression space, through the same CLI path as
``experiments.swinir_hpo`` (``experiments._cli.run``: under ``mpirun`` it takes the MPI engine).

    mpirun -n 2 python tests/mpi_scripts/hpo_mlp.py --trials 4 --study-dir runs/mlp

``--die-rank R``: rank R kills itself (SIGKILL, as the out-of-memory killer or a lost node would)
right after telling its first trial, to test that the job stops and a re-run resumes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments._cli import HPOConfig, add_flags, config_from_args, run  # noqa: E402


def make_space_and_task(config: HPOConfig) -> tuple[Any, Any]:
    """The MLP regression of ``tests/test_runner.py``; one width, so one plan and step per rank."""
    from flax import nnx

    from scamp_jax.space import SearchSpace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_runner import MLP, Regression

    def suggest(trial: Any) -> dict[str, Any]:
        return {"width": trial.suggest_categorical("width", [16]),
                "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)}

    def build(params: Any, rngs: nnx.Rngs) -> MLP:
        return MLP(int(params["width"]), rngs)

    space = SearchSpace("mlp-mpi", suggest, build,
                        largest={"width": 16, "learning_rate": 1e-2})
    return space, Regression()


def main() -> None:
    p = argparse.ArgumentParser()
    add_flags(p, ("tiny",), "runs/mlp_hpo")
    p.add_argument("--die-rank", type=int, help="this rank kills itself after its first tell")
    p.add_argument("--fail-rank", type=int,
                   help="this rank's training batches raise after --fail-after of a trial's")
    p.add_argument("--fail-after", type=int, default=3)
    p.add_argument("--fail-eval-rank", type=int,
                   help="this rank's evaluation of a trial raises (after its last step)")
    p.add_argument("--fail-suggest-served", action="store_true",
                   help="the space's suggest raises when rank 0 runs it for another rank's ask")
    p.add_argument("--prune-trial", type=int,
                   help="the space's suggest prunes this trial (optuna.TrialPruned)")
    p.add_argument("--stopped-job-seconds", type=float,
                   help="how long a stopped rank waits for the job to end before it ends it")
    p.add_argument("--end-together-seconds", type=float,
                   help="how long a rank whose part of a spanning trial failed waits")
    args = p.parse_args()
    # A dead job's trials are retried 10 s after their last heartbeat (every 2 s), not 60 s.
    base = HPOConfig(preset="tiny", trials=4, steps=20, reference_batch=8, max_batch_size=8,
                     devices=2, memory_per_device="64MiB", checkpoint_every=10,
                     checkpoint_min_seconds=0, pruner="none",
                     sampler="random", heartbeat_interval=2, grace_period=10)
    config = config_from_args(args, base, "runs/mlp_hpo")
    if args.die_rank is not None:
        from scamp_jax.distributed import engine

        tell = engine.RemoteTrialSource.tell

        def tell_then_die(self: Any, outcome: Any) -> None:
            tell(self, outcome)
            if self.rank == args.die_rank:
                print(f"rank {self.rank} is killed after telling trial {outcome.number}",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        engine.RemoteTrialSource.tell = tell_then_die  # type: ignore[method-assign]
    from mpi4py import MPI

    print(f"rank {MPI.COMM_WORLD.Get_rank()} pid {os.getpid()}", flush=True)
    if args.stopped_job_seconds is not None:
        from scamp_jax.distributed import engine as stopped

        stopped.STOPPED_JOB_SECONDS = args.stopped_job_seconds
    if args.end_together_seconds is not None:
        from scamp_jax.distributed import spanning

        spanning.END_TOGETHER_SECONDS = args.end_together_seconds
    make = make_space_and_task
    if args.fail_rank is not None:
        from mpi4py import MPI

        def make(config: HPOConfig) -> tuple[Any, Any]:
            space, task = make_space_and_task(config)
            if MPI.COMM_WORLD.Get_rank() == args.fail_rank:
                batches = task.batches

                def failing(batch_size: int, seed: int) -> Any:
                    for i, batch in enumerate(batches(batch_size, seed)):
                        if i == args.fail_after:
                            raise RuntimeError(f"rank {args.fail_rank}'s data fails at batch {i}")
                        yield batch

                task.batches = failing
            return space, task

    if args.fail_eval_rank is not None:
        from mpi4py import MPI

        made = make

        def make(config: HPOConfig) -> tuple[Any, Any]:
            space, task = made(config)
            if MPI.COMM_WORLD.Get_rank() == args.fail_eval_rank:
                def evaluate(model: Any) -> dict[str, float]:
                    raise RuntimeError(f"rank {args.fail_eval_rank}'s evaluation fails")

                task.evaluate = evaluate
            return space, task

    if args.fail_suggest_served:
        import dataclasses
        import threading

        served = make

        def make(config: HPOConfig) -> tuple[Any, Any]:
            space, task = served(config)
            suggest = space.suggest

            def failing(trial: Any) -> Any:
                if threading.current_thread().name == "study-server":
                    raise RuntimeError(f"suggest fails for trial {trial.number}")
                return suggest(trial)

            return dataclasses.replace(space, suggest=failing), task

    if args.prune_trial is not None:
        import dataclasses

        import optuna

        unpruned = make

        def make(config: HPOConfig) -> tuple[Any, Any]:
            space, task = unpruned(config)
            suggest = space.suggest

            def pruning(trial: Any) -> Any:
                if trial.number == args.prune_trial:
                    raise optuna.TrialPruned(f"trial {trial.number} is refused")
                return suggest(trial)

            return dataclasses.replace(space, suggest=pruning), task

    # The study's client and server of this rank, kept to look at once the run returned.
    from scamp_jax.distributed import engine as mpi_engine

    shared, made_study = mpi_engine.shared_study, []

    def keep_shared_study(*a: Any, **kw: Any) -> Any:
        made_study.append(shared(*a, **kw))
        return made_study[-1]

    mpi_engine.shared_study = keep_shared_study
    result = run(args, config, make, baseline=None, title="MLP HPO")
    best = (result or {}).get("best") or {}
    from mpi4py import MPI

    print(f"rank {MPI.COMM_WORLD.Get_rank()} returned best trial {best.get('number')}",
          flush=True)
    for client, server in made_study:
        held = client._comm if server is None else server.comm
        print(f"rank {MPI.COMM_WORLD.Get_rank()} study communicator freed: "
              f"{held is None or held == MPI.COMM_NULL}", flush=True)


if __name__ == "__main__":
    main()
