"""A tiny Optuna study shared by MPI ranks: rank 0 serves trials, every rank evaluates
``(x - 2)^2`` (no JAX), and rank 0 writes every trial of the storage as JSON.

    mpirun -n 3 python tests/mpi_scripts/study_ranks.py --storage sqlite:///s.db --trials 9 \
        --out trials.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def objective(x: float) -> float:
    return (x - 2.0) ** 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True)
    p.add_argument("--trials", type=int, required=True)
    p.add_argument("--seconds", type=float, default=0.2, help="time one evaluation takes")
    p.add_argument("--out", required=True)
    p.add_argument("--die-rank", type=int, help="this rank exits (status 3) in its 2nd trial")
    p.add_argument("--note-bytes", type=int, default=0,
                   help="each tell carries a user attribute 'note' of this many characters")
    args = p.parse_args()

    import optuna

    from scamp_jax.distributed.mpi import import_mpi4py
    from scamp_jax.distributed.study import shared_study
    from scamp_jax.hpo.study import OptunaTrialSource
    from scamp_jax.space import SearchSpace

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    comm = import_mpi4py().COMM_WORLD

    def make_study():
        return optuna.create_study(
            study_name="ranks", storage=args.storage, load_if_exists=True,
            sampler=optuna.samplers.RandomSampler(seed=0),
        )

    def suggest(trial):
        return {"x": trial.suggest_float("x", -5.0, 5.0)}

    def make_source():
        # A plain Optuna study has no heartbeat: what a dead job left running is retried at once.
        space = SearchSpace("ranks", suggest, build=lambda params, rngs: None)
        return OptunaTrialSource(make_study(), space, args.trials, recover_running=True)

    client, server = shared_study(make_source, comm)
    comm.Barrier()  # every rank is ready before the first trial is handed out
    started = 0
    while (item := client.ask()) is not None:
        started += 1
        if comm.Get_rank() == args.die_rank and started == 2:
            print(f"rank {args.die_rank} exits in trial {item.number}", flush=True)
            os._exit(3)
        for step in range(2):
            time.sleep(args.seconds / 2)
            client.report(item.number, step, objective(item.params["x"]) + 1.0 - step)
        attrs = {"note": "n" * args.note_bytes} if args.note_bytes else None
        client.tell(item.number, objective(item.params["x"]), attrs=attrs)
    if server is not None:
        server.join(timeout=120)
        trials = [
            {"number": t.number, "state": t.state.name, "value": t.value,
             # x is None for a trial the dead job asked but had not suggested yet
             "x": t.params.get("x"), "rank": t.user_attrs.get("rank"),
             "steps": sorted(t.intermediate_values),
             "note_bytes": len(t.user_attrs.get("note", ""))}
            for t in server.study.get_trials(deepcopy=False)
        ]
        Path(args.out).write_text(json.dumps({
            "ranks": comm.Get_size(), "trials": trials, "stale_failed": server.stale_failed,
        }))


if __name__ == "__main__":
    main()
