"""scamp-jax against the loop a user would write instead: a plain Optuna + Flax NNX + optax study.

The same study is run two ways, each as a whole process (imports, compiles, report included):

- **scamp-jax**: `scamp_jax.run_study` with the family's settings (planning, packing,
  checkpoints, report and plots), on the CPU devices the family's entry point uses;
- **plain loop**: ``optuna.create_study(...).optimize(objective)`` where ``objective`` builds the
  model from the same `SearchSpace`, trains it with ``nnx.jit`` and the same AdamW for the same
  samples (same batch, same steps) on the same `Task`'s batches, and returns the task's
  held-out metric. One JAX device, one trial after another: what a first script looks like.

The same trials, both ways: both studies sample with scamp-jax's seeded TPE
(`scamp_jax.hpo.study.make_sampler`: Optuna's ``TPESampler`` made for each trial, seeded from
the study's seed and the trial's number, which a plain loop passes as ``sampler=`` like any
Optuna sampler), so trial ``n`` gets the same parameters both ways whatever order the trials
finish in; and trial ``n`` of the plain loop initialises its model with
``nnx.Rngs(s)`` and draws its batches with ``task.batches(batch, s)`` for the seed ``s`` that
scamp-jax gives trial ``n`` (`scamp_jax.hpo.trial.trial_seed` of the study seed and the trial's
checkpoint key ``trial_<n>``). Both train the same number of samples per trial and evaluate
alike, so each trial's metric can be compared one to one: the table says, of the trials with
the plain loop's parameters, how many reach its metric (to 1e-6), and the largest difference.
They need not all agree bit for bit: scamp-jax injects the optimizer's hyperparameters as arrays
(`optax.inject_hyperparams`, one compiled step per architecture), while the plain loop's
learning rate is a Python float compiled into its step, and XLA rounds the two programs
differently; 50 AdamW steps can carry such a difference into a different prediction on a
validation example or two.

``--fuse VALUE`` (repeatable) runs scamp-jax once per value (``none``, ``auto`` or ``K``) instead
of once with `run_study`'s default. A fused study searches differently (siblings: trials that
share a proposed architecture, their training hyperparameters left to the sampler), so its
trials are not the plain loop's and only its best metric compares: with one seed that is one
draw of each search, so compare it over several (``--seed N``, the study's seed both ways).

Repeats run the ways interleaved, in rotating order, because the machine is shared; each run
gets a fresh study directory. The table gives wall seconds, CPU seconds (user + system of the
child process) and peak resident memory (min / median / max over repeats), the best metric each
found, and scamp-jax's own breakdown of its time when its ``results.json`` has one
(``run.overhead``).

Families:
- ``digits``: the README's guide (`examples/digits.py`): 6 MLP trials, 200 steps at reference
  batch 32 (50 steps at the planned batch 128), 4 CPU devices.
- ``swinir``: the main job's smoke preset (3 small SwinIR trials, 100 steps at batch 8), 8 CPU
  devices.

Run::

    python -m benchmarks.overhead --family digits --repeats 3 --markdown
    python -m benchmarks.overhead --family swinir --repeats 3 --markdown
    python -m benchmarks.overhead --family digits --fuse none --fuse auto --markdown
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DIGITS_EXAMPLE = REPO / "examples" / "digits.py"


@dataclass(frozen=True)
class Family:
    """One study, described once for both runs.

    ``steps`` are at ``reference_batch``; a trial trains ``steps * reference_batch`` samples.
    ``batch`` is the batch the plain loop trains at (scamp-jax's planner picks its own, up to
    ``max_batch_size``; with these budgets it picks ``max_batch_size``).
    """

    name: str
    trials: int
    steps: int
    reference_batch: int
    max_batch_size: int
    memory_per_device: str
    cpu_devices: int
    checkpoint_every: int
    pruner: str

    @property
    def batch(self) -> int:
        return self.max_batch_size

    @property
    def plain_steps(self) -> int:
        return max(1, self.steps * self.reference_batch // self.max_batch_size)


FAMILIES = {
    "digits": Family("digits", trials=6, steps=200, reference_batch=32, max_batch_size=128,
                     memory_per_device="32MiB", cpu_devices=4, checkpoint_every=50,
                     pruner="median"),
    "swinir": Family("swinir", trials=3, steps=100, reference_batch=8, max_batch_size=8,
                     memory_per_device="1GiB", cpu_devices=8, checkpoint_every=25,
                     pruner="none"),
}
SEED = 0


def _space_and_task(family: str) -> tuple[Any, Any]:
    if family == "digits":
        module = runpy.run_path(str(DIGITS_EXAMPLE), run_name="digits_family")
        return module["space"], module["task"]
    from experiments.swinir_hpo import get_config, make_space_and_task

    return make_space_and_task(get_config("smoke"))


def run_scamp(family: Family, study_dir: Path, fuse: str | None = None,
              seed: int = SEED) -> dict[str, Any]:
    """The study through `scamp_jax.run_study` (devices set up as the family's entry does);
    ``fuse``: ``"none"``, ``"auto"`` or a width as text (None: `run_study`'s default)."""
    import scamp_jax

    scamp_jax.configure_for_search(family.cpu_devices)
    space, task = _space_and_task(family.name)
    extra: dict[str, Any] = {}
    if fuse is not None:
        extra["fuse"] = None if fuse == "none" else fuse if fuse == "auto" else int(fuse)
    result = scamp_jax.run_study(
        space, task, trials=family.trials, steps=family.steps, study_dir=study_dir,
        memory_per_device=family.memory_per_device, reference_batch=family.reference_batch,
        max_batch_size=family.max_batch_size, checkpoint_every=family.checkpoint_every,
        pruner=family.pruner, sampler="tpe", seed=seed, live=False, **extra)
    best = result.get("best") or {}
    results = json.loads((study_dir / "results.json").read_text())
    runs = results.get("runs", [])
    overhead = runs[-1].get("overhead") if runs else None
    values = {str(t["number"]): [t.get("params"), t.get(task.metric)]
              for t in results.get("trials", []) if t.get("state") == "complete"}
    widths = [t.get("fusion_width", 1) for t in results.get("trials", [])]
    return {"best": best.get(task.metric), "metric": task.metric,
            "batch": best.get("batch_size"), "overhead": overhead, "values": values,
            "fusion_widths": widths, "test": result.get("test")}


def run_plain(family: Family, study_dir: Path, seed: int = SEED) -> dict[str, Any]:
    """The study as a plain Optuna loop: one device, one trial after another, each trial with
    the initialisation and data seed scamp-jax gives it; the best model kept in memory and,
    where the task has a ``test``, tested at the end, as scamp-jax tests its best model."""
    import jax
    import optax
    import optuna
    from flax import nnx

    from scamp_jax.hpo.study import make_sampler
    from scamp_jax.hpo.trial import trial_seed

    space, task = _space_and_task(family.name)
    study_dir.mkdir(parents=True, exist_ok=True)
    kept: dict[str, Any] = {}  # the best model so far and its score

    def objective(trial: optuna.Trial) -> float:
        config = space.suggest(trial)
        own = trial_seed(seed, f"trial_{trial.number}")  # scamp-jax's seed of this trial
        model = space.build(config, nnx.Rngs(own))
        tx = optax.adamw(config["learning_rate"], b1=config.get("b1", 0.9),
                         b2=config.get("b2", 0.999), weight_decay=config.get("weight_decay", 0.0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
            loss, grads = nnx.value_and_grad(task.loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss

        batches = task.batches(family.batch, own)
        for _ in range(family.plain_steps):
            loss = train_step(model, optimizer, next(batches))
        loss.block_until_ready()
        if hasattr(model, "eval"):
            model.eval()
        value = float(task.evaluate(model)[task.metric])
        if math.isfinite(value) and (not kept or (
                value > kept["value"] if task.direction == "maximize" else value < kept["value"])):
            kept.update(value=value, model=model)  # a diverged trial's is never the best
        return value

    study = optuna.create_study(
        study_name=family.name, storage=f"sqlite:///{study_dir / 'study.db'}",
        direction=task.direction, sampler=make_sampler("tpe", seed))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=family.trials)
    values = {str(t.number): [t.params, t.value] for t in study.trials
              if t.state == optuna.trial.TrialState.COMPLETE}
    test = getattr(task, "test", None)
    tested = test(kept["model"]) if test is not None and kept else None
    return {"best": study.best_value, "metric": task.metric, "batch": family.batch,
            "overhead": None, "values": values, "test": tested}


def _way(text: str) -> tuple[str, str | None]:
    """``"scamp"``, ``"scamp:FUSE"`` or ``"plain"`` -> (runner, fuse)."""
    runner, _, fuse = text.partition(":")
    if runner not in ("scamp", "plain") or (runner == "plain" and fuse):
        raise ValueError(f"way {text!r} is not 'plain', 'scamp' or 'scamp:FUSE'")
    return runner, fuse or None


def _run_child(way: str, family: Family, study_dir: Path, seed: int) -> dict[str, Any]:
    runner, fuse = _way(way)
    if runner == "plain":
        return run_plain(family, study_dir, seed)
    return run_scamp(family, study_dir, fuse, seed)


def _label(way: str) -> str:
    runner, fuse = _way(way)
    if runner == "plain":
        return "plain Optuna loop"
    return "scamp-jax run_study" + (f" (fuse={fuse})" if fuse else "")


def measure(way: str, family: Family, seed: int = SEED) -> dict[str, Any]:
    """Run one way of ``family`` as a child process; wall s, CPU s, peak RSS bytes, its result.
    ``way``: ``"plain"``, ``"scamp"`` (`run_study`'s defaults) or ``"scamp:FUSE"``."""
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        out = Path(tmp) / "child.json"
        env = dict(os.environ)
        if way == "plain":  # a plain JAX process: one CPU device (keeps the example's split off)
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                                + " --xla_force_host_platform_device_count=1").strip()
        cmd = [sys.executable, "-m", "benchmarks.overhead", "--child", way, "--family",
               family.name, "--study-dir", str(Path(tmp) / "study"), "--child-out", str(out),
               "--seed", str(seed)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        stderr = proc.stderr.read() if proc.stderr else ""
        if proc.returncode != 0:
            raise RuntimeError(f"{way} run of {family.name} failed (exit {proc.returncode}):\n"
                               + stderr[-3000:])
        result = json.loads(out.read_text())
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": usage.ru_maxrss * 1024, **result}


def _spread(values: Sequence[float], fmt: str) -> str:
    return "/".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def agreement(values: dict[str, list[Any]], plain: dict[str, list[Any]]) -> str:
    """Of the trials with the plain loop's parameters (same number), how many reach its metric
    (to 1e-6), and the largest difference."""
    common = [n for n in values if n in plain and values[n][0] == plain[n][0]
              and values[n][1] is not None and plain[n][1] is not None]
    if not common:
        return f"0 of {len(values)} trials have the plain loop's parameters"
    diffs = [abs(float(values[n][1]) - float(plain[n][1])) for n in common]
    same = sum(d <= 1e-6 for d in diffs)
    return f"{same}/{len(common)} (max diff {max(diffs):.4f})"


def report(family: Family, runs: dict[str, list[dict[str, Any]]], markdown: bool) -> None:
    from benchmarks._tables import print_table

    plain_wall = statistics.median(r["wall_s"] for r in runs["plain"])
    plain_cpu = statistics.median(r["cpu_s"] for r in runs["plain"])
    rows = []
    for way, rs in runs.items():
        wall = [r["wall_s"] for r in rs]
        cpu = [r["cpu_s"] for r in rs]
        rss = [r["peak_rss_bytes"] / 2**20 for r in rs]
        best = [r["best"] for r in rs if r["best"] is not None]
        metric = rs[0]["metric"]
        # the best model's scores on the task's test data, where it has one
        tests = [float(r["test"][metric]) for r in rs
                 if isinstance(r.get("test"), dict) and r["test"].get(metric) is not None]
        same = "-" if way == "plain" else "; ".join(
            agreement(r.get("values") or {}, p.get("values") or {})
            for r, p in zip(rs, runs["plain"], strict=False))
        rows.append([_label(way), _spread(wall, ".1f"), _spread(cpu, ".1f"), _spread(rss, ".0f"),
                     f"{statistics.median(wall) / plain_wall:.2f}x",
                     f"{statistics.median(cpu) / plain_cpu:.2f}x",
                     (_spread(best, ".4f") if best else "-")
                     + (f" ({_spread(tests, '.4f')})" if tests else ""), same])
    metric = runs["plain"][0]["metric"]
    print_table(
        f"{family.name}: {family.trials} trials x {family.steps * family.reference_batch} samples, "
        f"{len(runs['plain'])} interleaved repeats (min/median/max)",
        ["run", "wall s", "CPU s", "peak RSS MiB", "wall vs plain", "CPU vs plain",
         f"best {metric} (test)", "same params: equal metric (per repeat)"], rows, markdown)
    for way, rs in runs.items():
        breakdowns = [r["overhead"] for r in rs if r.get("overhead")]
        if not breakdowns:
            continue
        keys = sorted({k for b in breakdowns for k in b if isinstance(b[k], int | float)})
        print_table(f"{_label(way)}: own breakdown (run.overhead in results.json; median over "
                    "repeats)", ["part", "value"],
                    [[k, f"{statistics.median(b.get(k, 0) for b in breakdowns):.2f}"]
                     for k in keys], markdown)


def _seed(text: str) -> int:
    """argparse type of ``--seed``: an integer >= 0 (what Optuna's and NumPy's seeds take),
    checked here rather than in each run's process."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be an integer >= 0")
    return value


def _fuse_value(text: str) -> str:
    if text in ("none", "auto") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not none, auto or a width >= 1")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from experiments._cli import output_file, positive_int

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="digits",
                        help="which study to run both ways (default: digits, the README's guide)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="interleaved repeats of each way (default 3)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", metavar="FILE", type=output_file,
                        help="also write every run's figures to FILE")
    parser.add_argument("--fuse", action="append", type=_fuse_value, metavar="none|auto|K",
                        help="run scamp-jax with this fuse setting (repeat for several ways; "
                        "default: once, with run_study's default)")
    parser.add_argument("--seed", type=_seed, default=SEED,
                        help=f"the study's seed, both ways (default {SEED})")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--study-dir", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from scamp_jax.devices import configure_device_memory

    configure_device_memory()  # before JAX starts, here and in the child processes (inherited)
    if args.child:
        result = _run_child(args.child, FAMILIES[args.family], Path(args.study_dir), args.seed)
        Path(args.child_out).write_text(json.dumps(result))
        return result

    families = list(FAMILIES) if args.family == "all" else [args.family]
    everything: dict[str, Any] = {}
    for name in families:
        family = FAMILIES[name]
        ways = [f"scamp:{f}" for f in args.fuse] if args.fuse else ["scamp"]
        ways.append("plain")
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
        for repeat in range(args.repeats):
            shift = repeat % len(ways)
            order = ways[shift:] + ways[:shift]  # rotated: each way runs first in some repeat
            for way in order:
                print(f"[overhead] {name} repeat {repeat + 1}/{args.repeats}: {way} ...",
                      flush=True)
                runs[way].append(measure(way, family, args.seed))
                r = runs[way][-1]
                print(f"[overhead]   {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, "
                      f"best {r['metric']} {r['best']}", flush=True)
        report(family, runs, args.markdown)
        everything[name] = runs
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return everything


if __name__ == "__main__":
    from experiments._cli import user_errors

    with user_errors(stopped="the benchmark stopped; what it printed is what it measured"):
        main()
