"""`python -m experiments.supernet_nas --mpi` with the last rank failing before training: its
training photographs cannot be read (a stand-in: every rank reads the same bundled photographs,
so the failure of one host's copy is made here by replacing `training_batches` on that rank).

    mpirun -n 2 python tests/mpi_scripts/supernet_nas_rank_fails.py --preset smoke ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import search_spaces.supernet_nas as nas
    from experiments import supernet_nas
    from scamp_jax.distributed.mpi import world

    read = nas.training_batches
    w = world()

    def training_batches(config):  # type: ignore[no-untyped-def]
        if w.rank == w.size - 1:
            raise FileNotFoundError(f"rank {w.rank} cannot read its training photographs")
        return read(config)

    nas.training_batches = training_batches
    supernet_nas.main(["--mpi", *sys.argv[1:]])


if __name__ == "__main__":
    main()
