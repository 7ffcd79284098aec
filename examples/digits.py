"""Your own model family in one file: a memory-aware study of MLPs on scikit-learn's digits.

    pip install -e ".[examples]"              # scikit-learn: the digits ship inside its wheel
    python examples/digits.py                 # about 8 s on 2 quiet CPU cores; --help for flags
    optuna-dashboard sqlite:///runs/digits/study.db    # needs the `dashboard` extra
"""

import argparse

import scamp_jax

scamp_jax.configure_for_search(4)  # on CPU: split the host into 4 devices before JAX starts

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

try:
    from sklearn.datasets import load_digits
except ModuleNotFoundError:  # the one package this example adds to scamp-jax's
    raise SystemExit("this example reads scikit-learn's bundled digits: pip install -e "
                     "'.[examples]' (or pip install scikit-learn), then run it again") from None

x, y = load_digits(return_X_y=True)  # 1797 images of 8x8 pixels, labels 0-9
x, y = (x / 16).astype(np.float32), y.astype(np.int32)
# trained on, held out (trials are scored and chosen by it), test (only the best model sees it)
x_train, y_train = x[:1500], y[:1500]
x_val, y_val, x_test, y_test = x[1500:1650], y[1500:1650], x[1650:], y[1650:]


class MLP(nnx.Module):
    def __init__(self, width: int, depth: int, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.List([nnx.Linear(64 if i == 0 else width, width, rngs=rngs)
                                for i in range(depth)])
        self.out = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x):
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.out(x)


def suggest(trial):  # model and training hyperparameters (learning_rate goes to AdamW)
    return {"width": trial.suggest_categorical("width", [64, 256]),
            "depth": trial.suggest_int("depth", 1, 2),
            "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)}


def batches(batch_size, seed):  # endless, seeded stream of (inputs, labels)
    rng = np.random.default_rng(seed)
    while True:
        i = rng.integers(0, len(x_train), batch_size)
        yield x_train[i], y_train[i]


space = scamp_jax.SearchSpace("digits-mlp", suggest,
                              lambda c, rngs: MLP(c["width"], c["depth"], rngs))
task = scamp_jax.FunctionTask(
    metric="accuracy", direction="maximize", batches=batches,
    loss_fn=lambda model, b: optax.softmax_cross_entropy_with_integer_labels(
        model(b[0]), b[1]).mean(),
    evaluate=lambda model: {"accuracy": float((model(x_val).argmax(-1) == y_val).mean())},
    test=lambda model: {"accuracy": float((model(x_test).argmax(-1) == y_test).mean())})

if __name__ == "__main__":
    flags = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_argument("--trials", type=int, default=6,
                       help="trials the study runs in all (default 6; a rerun resumes it)")
    flags.add_argument("--steps", type=int, default=200,
                       help="training steps per trial at the reference batch of 32 (a trial "
                            "planned a larger batch takes fewer; default 200)")
    flags.add_argument("--study-dir", default="runs/digits",
                       help="where the study, checkpoints, results and plots go "
                            "(default runs/digits)")
    flags.add_argument("--study-name",
                       help="a new study beside the first (its outputs in --study-dir/NAME): "
                            "a study keeps its --steps, so other steps need a name of their own")
    args = flags.parse_args()
    for flag, value in (("--trials", args.trials), ("--steps", args.steps)):
        if value < 1:
            flags.error(f"{flag} {value}: pass 1 or more")
    try:
        result = scamp_jax.run_study(space, task, trials=args.trials, steps=args.steps,
                                     study_dir=args.study_dir, study_name=args.study_name,
                                     memory_per_device="32MiB", reference_batch=32,
                                     max_batch_size=128)
    except ValueError as err:  # a bad setting, or a study that was created with other steps
        # the study's refusal in this script's flags (--steps, --study-name)
        as_command_line = getattr(err, "as_command_line", None)
        raise SystemExit(f"error: {as_command_line() if as_command_line else err}") from None
    best, tested = result["best"], result["test"]  # None while no trial has completed
    if best is not None:
        # the test: the best model's accuracy on digits no trial was chosen by
        test = f", test accuracy {tested['accuracy']:.3f}" if tested is not None else ""
        print(f"best: trial {best['number']} {best['params']} accuracy {best['accuracy']:.3f}"
              + test)
