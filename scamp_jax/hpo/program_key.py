"""What a trial's compiled programs are keyed by: computed in one place.

Trials of one architecture differ only in data (the seed; the optimizer's hyperparameters, which
live in its state), so they share what is compiled for it. `ProgramKey` names that once, from
the model's graph definition and the configuration, and every cache of a study keys by it:

- `ProgramKey.step`: the training step's program (the graph, its state's shapes, and which
  optimizer hyperparameters are data; a graph definition holds no array shapes): plans
  (`scamp_jax.hpo.plan_service.PlanningService`, with the devices, batch cap and budget),
  the step's FLOPs (with the batch), the runs' jitted steps (`scamp_jax.hpo.runner.StepCache`,
  with the plan's mesh, devices and batch, the loss and any gradient reduction:
  `ProgramKey.run_step`);
- `ProgramKey.architecture`: the initial state's program (the step's key plus the rest of the
  configuration, which ``build`` may read), `scamp_jax.planning.initial_state.InitialStates`;
- `evaluation_key`: the evaluation forward on a plan's devices, with the task and the
  state's shapes.

Beyond these, compiled executables are keyed by their lowered program's fingerprint and devices
(`scamp_jax.planning.reuse.ExecutableCache`), and across processes by JAX's own key of the
program and its XLA options (`scamp_jax.planning.compile_cache`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from scamp_jax.hpo.trial import OPTIMIZER_KEYS, model_config
from scamp_jax.planning.train_step import split_model


def injected_keys(params: Mapping[str, Any]) -> tuple[str, ...]:
    """The optimizer hyperparameters a configuration makes data: the learning rate always,
    and each of ``b1``, ``b2``, ``weight_decay`` the configuration sets."""
    return tuple(k for k in OPTIMIZER_KEYS if k == "learning_rate" or k in params)


def state_shapes(model: nnx.Module) -> tuple[tuple[tuple[int, ...], str], ...]:
    """Shape and dtype of every array of ``model``'s state (real or abstract), in order."""
    return tuple((tuple(leaf.shape), str(leaf.dtype))
                 for leaf in jax.tree.leaves(nnx.state(model)))


def _callable_key(fn: Callable[..., Any] | None) -> tuple[Any, int]:
    # A bound method is a new object on every access: key it by its function and owner.
    return getattr(fn, "__func__", fn), id(getattr(fn, "__self__", None))


@dataclass(frozen=True)
class ProgramKey:
    """The compiled programs' identity of one configuration (see the module doc).

    Attributes:
      graphdef: the model's graph definition (`scamp_jax.planning.train_step.split_model`).
      shapes: its state's shapes and dtypes (`state_shapes`) where the key was made from the
        model (`of_model`: plans and FLOPs); empty where the model's configuration fixes them
        (a run's step and initial state, keyed with a plan or the configuration).
      model_config: the configuration less the optimizer's hyperparameters, as sorted
        ``(key, repr(value))`` pairs.
      injected: the optimizer hyperparameters that are data (`injected_keys`).
    """

    graphdef: nnx.GraphDef
    model_config: tuple[tuple[str, str], ...]
    injected: tuple[str, ...]
    shapes: tuple[tuple[tuple[int, ...], str], ...] = ()

    @classmethod
    def of(cls, graphdef: nnx.GraphDef, params: Mapping[str, Any],
           shapes: tuple[tuple[tuple[int, ...], str], ...] = ()) -> ProgramKey:
        """The key of configuration ``params`` whose model has ``graphdef`` (and its state
        ``shapes``, `state_shapes`: where a key is made from the model itself, `of_model`)."""
        return cls(graphdef, model_config(params), injected_keys(params), shapes)

    @classmethod
    def of_model(cls, model: nnx.Module, params: Mapping[str, Any]) -> ProgramKey:
        """The key of configuration ``params`` whose (abstract) model is ``model``, with its
        state's shapes: a graph definition holds a module's static attributes, not its
        arrays' shapes, so two sizes of a module that does not keep its size as an attribute
        have one graph definition and must not share a plan."""
        return cls.of(split_model(model)[0], params, state_shapes(model))

    @property
    def step(self) -> tuple[Any, ...]:
        """The training step's program (graph, state shapes where known, and optimizer state
        structure)."""
        return (self.graphdef, self.shapes, self.injected)

    @property
    def architecture(self) -> tuple[Any, ...]:
        """What trials of one architecture share beyond the step: their initial state's
        program (``build`` may read any of the configuration)."""
        return (self.graphdef, self.model_config, self.injected)

    def plan(self, devices: int | None, cap: int | None, provisional: bool,
             allowance: int | None) -> tuple[Any, ...]:
        """A plan of the step on ``devices`` (None: the fewest that hold it) at most ``cap``."""
        return (*self.step, devices, cap, provisional, allowance)

    def flops(self, batch_size: int) -> tuple[Any, ...]:
        """The step's FLOPs at a global batch of ``batch_size``."""
        return (*self.step, int(batch_size))

    def run_step(self, plan: Any, loss_fn: Callable[..., Any],
                 grad_reduce: Callable[[Any], Any] | None = None) -> tuple[Any, ...]:
        """A run's jitted step on ``plan``'s mesh and devices at its batch."""
        devices = tuple(d.id for d in plan.mesh.devices.flat)
        return (*self.step, plan.mesh.devices.shape, devices, int(plan.batch_size),
                *_callable_key(loss_fn), grad_reduce)



def evaluation_key(graphdef: nnx.GraphDef, plan: Any, task: Any, state: Any = ()
                   ) -> tuple[Any, ...]:
    """The evaluation forward of ``task`` for the graph ``graphdef`` and the arrays of
    ``state`` (their shapes and dtypes) on ``plan``'s mesh and devices (the optimizer plays no
    part in it)."""
    devices = tuple(d.id for d in plan.mesh.devices.flat)
    shapes = tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in jax.tree.leaves(state))
    return (graphdef, shapes, plan.mesh.devices.shape, devices, id(task))
