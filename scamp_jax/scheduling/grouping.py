"""Which waiting trials train together as one fused group (a pure rule, no JAX here).

Horizontal fusion (`scamp_jax.planning.fusion`) trains trials of one architecture as one program.
The HPO engine (`scamp_jax.hpo.fused_engine`) and the cluster simulator (`scamp_jax.sim.simulator`)
both decide groups with `form_groups`, so the simulator credits exactly the groups the engine forms.

A trial can join a group when its *signature* matches: the engine's signature is the compiled
program's (graph definition, shapes and dtypes of every variable: see
`scamp_jax.hpo.fused_runner.architecture_signature`) together with the step the trial resumes
from (a group resumes only members at the same step). Trials of one signature are taken in
arrival order, in chunks of the widest group their signature's fused plan fits
(`scamp_jax.planning.fusion.plan_fusion`). The last, narrower chunk waits while more trials of its
signature are on their way (siblings enqueued for it and not planned yet), so that a group is
not started one member short.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FusionCandidate:
    """A planned trial waiting to be grouped.

    Attributes:
      key: the trial's number.
      signature: what must be equal for trials to share a fused step (hashable).
      arrival: queue order (ask order); smaller first.
      width: the most members a group of this signature may hold (>= 1; the fused plan's
        width; 1: the trial runs alone).
    """

    key: int
    signature: Hashable
    arrival: int
    width: int = 1

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"trial {self.key}: width={self.width} must be at least 1")


def form_groups(
    waiting: Sequence[FusionCandidate],
    *,
    expecting: Collection[Hashable] = (),
) -> tuple[tuple[int, ...], ...]:
    """Groups to hand to the scheduler now, each a tuple of trial keys in arrival order.

    Trials of one signature are chunked in arrival order into groups of at most the
    signature's width (the smallest width among them, should they differ). A full chunk goes
    at once; the last chunk, narrower than the width, is held back while its signature is in
    ``expecting`` (more trials of it will arrive). A group of one is a trial that runs alone.
    Groups come in the order of their first member's arrival; every candidate not held back is
    in exactly one group.
    """
    by_signature: dict[Hashable, list[FusionCandidate]] = {}
    for c in sorted(waiting, key=lambda c: (c.arrival, c.key)):
        by_signature.setdefault(c.signature, []).append(c)
    groups: list[tuple[FusionCandidate, ...]] = []
    for signature, members in by_signature.items():
        width = min(c.width for c in members)
        for i in range(0, len(members), width):
            chunk = tuple(members[i : i + width])
            if len(chunk) < width and signature in expecting:
                break  # its missing members are on their way
            groups.append(chunk)
    groups.sort(key=lambda g: (g[0].arrival, g[0].key))
    return tuple(tuple(c.key for c in g) for g in groups)
