"""Plan your own model with `plan_mesh`, then train it with the plan in a loop of your own.

    python examples/plan_and_train.py         # about 10 s on 2 CPU cores; --help for flags

The plan picks the model-parallel degree and the largest batch that fits the budget, and holds
the shardings of every argument of the training step (`plan.step_shardings`). The same step
the planner compiled (`jit_train_step`) trains here on state placed with those shardings
(`place_train_state`) and batches placed with `plan.batch_sharding`.
"""

import argparse

import scamp_jax

scamp_jax.configure_cpu_devices(4)  # on CPU: split the host into 4 devices before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from scamp_jax.planning import jit_train_step, place_train_state  # noqa: E402

SIDE = 16  # images of SIDE x SIDE pixels, one channel


class Classifier(nnx.Module):
    """A small CNN with batch norm and dropout (its batch statistics train with it)."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(1, width, (3, 3), strides=2, rngs=rngs)
        self.norm = nnx.BatchNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(width * (SIDE // 2) ** 2, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.norm(self.conv(x)))
        return self.out(self.drop(x.reshape(x.shape[0], -1)))


def loss_fn(model: Classifier, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    images, labels = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def main() -> None:
    flags = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_argument("--width", type=positive, default=64,
                       help="convolution channels (default 64)")
    flags.add_argument("--memory-per-device", default="4MiB",
                       help="memory budget per device (default 4MiB)")
    flags.add_argument("--steps", type=positive, default=30, help="training steps (default 30)")
    args = flags.parse_args()

    model = Classifier(args.width, nnx.Rngs(0))
    optimizer = optax.adam(1e-2)
    sample = (jax.ShapeDtypeStruct((1, SIDE, SIDE, 1), np.float32),  # one sample's shapes
              jax.ShapeDtypeStruct((1,), np.int32))
    try:
        plan = scamp_jax.plan_mesh(model, sample, devices=4,
                                   memory_per_device=args.memory_per_device,
                                   optimizer=optimizer, loss_fn=loss_fn, max_batch_size=512)
    except scamp_jax.DoesNotFitError as err:  # a budget that holds no batch: the flag to raise
        raise SystemExit(f"error: {err}; here: raise --memory-per-device or lower --width "
                         "(the example plans for 4 devices)") from None
    except ValueError as err:  # an unreadable size
        raise SystemExit(f"error: {err}") from None
    print(plan.describe())

    # The step the planner compiled, and the model's state on the plan's devices.
    graphdef, params, opt_state, rest = place_train_state(model, optimizer, plan.step_shardings)
    step = jit_train_step(graphdef, optimizer, loss_fn, plan.step_shardings)
    rng = np.random.default_rng(0)
    prototypes = rng.normal(size=(10, SIDE, SIDE, 1)).astype(np.float32)  # one image per class
    losses = []
    for _ in range(args.steps):
        labels = rng.integers(0, 10, plan.batch_size).astype(np.int32)
        noise = rng.normal(scale=3.0, size=(plan.batch_size, SIDE, SIDE, 1)).astype(np.float32)
        batch = jax.device_put((prototypes[labels] + noise, labels), plan.batch_sharding)
        params, opt_state, rest, loss = step(params, opt_state, rest, batch)
        losses.append(float(loss))
    nnx.update(model, params, rest)  # the trained weights and batch statistics, back in the model
    print(f"batch {plan.batch_size} on a {plan.data_parallel} x {plan.model_parallel} mesh: "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps")


if __name__ == "__main__":
    main()
