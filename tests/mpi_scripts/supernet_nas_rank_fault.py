"""`python -m experiments.supernet_nas --mpi` with a fault of the last rank's own copy of the
training photographs, given as the first argument:

- ``fails``: that rank cannot read them (it fails before training);
- ``differs``: that rank's copy differs from the others' in one pixel of one target patch.

Stand-ins: every rank reads the same bundled photographs, so a fault of one host's copy is made
here by replacing `training_batches` on that rank.

    mpirun -n 2 python tests/mpi_scripts/supernet_nas_rank_fault.py fails --preset smoke ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import search_spaces.supernet_nas as nas
    from experiments import supernet_nas
    from scamp_jax.distributed.mpi import world

    fault, flags = sys.argv[1], sys.argv[2:]
    if fault not in ("fails", "differs"):
        raise SystemExit(f"unknown fault {fault!r}: pass fails or differs first")
    read = nas.training_batches
    w = world()

    def training_batches(config):  # type: ignore[no-untyped-def]
        if w.rank != w.size - 1:
            return read(config)
        if fault == "fails":
            raise FileNotFoundError(f"rank {w.rank} cannot read its training photographs")
        lr, hr = read(config)
        hr[0, 0, 0, 0, 0] += 1 / 255
        return lr, hr

    nas.training_batches = training_batches
    supernet_nas.main(["--mpi", *flags])


if __name__ == "__main__":
    main()
