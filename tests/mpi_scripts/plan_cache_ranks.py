"""The MLP study of ``hpo_mlp.py`` with each rank's planner compiles counted and printed.

    mpirun -n 2 python tests/mpi_scripts/plan_cache_ranks.py --trials 4 --study-dir runs/mlp

Every rank prints ``rank R: P plan(s), C planner compile(s)`` at the end: ``P`` calls of
``plan_mesh`` and the ``C`` training-step compiles they made (a cached plan makes none).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import hpo_mlp

    from scamp_jax.planning import batch_search, planner
    lock = threading.Lock()
    counts = {"plans": 0, "compiles": 0}
    real_plan, real_compile = planner.plan_mesh, batch_search.compile_step

    def counted_plan(*args: Any, **kwargs: Any) -> Any:
        with lock:
            counts["plans"] += 1
        return real_plan(*args, **kwargs)

    def counted_compile(*args: Any, **kwargs: Any) -> Any:
        with lock:
            counts["compiles"] += 1
        return real_compile(*args, **kwargs)

    # The MPI engine binds planner.plan_mesh when it runs; compile_step is looked up per call.
    planner.plan_mesh = counted_plan  # type: ignore[assignment]
    batch_search.compile_step = counted_compile  # type: ignore[assignment]
    hpo_mlp.main()
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    print(f"rank {rank}: {counts['plans']} plan(s), {counts['compiles']} planner compile(s)",
          flush=True)


if __name__ == "__main__":
    main()
