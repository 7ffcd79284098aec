"""What a study compiles: one training step and one evaluation forward per new architecture,
one initialisation per architecture, and nothing again in a later process of the study (the
persistent compilation cache in its directory). Compiles are JAX's own compile events
(`run.overhead` of ``results.json``, `CompileCounter`)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scamp_jax.hpo.runner import make_optimizer
from scamp_jax.hpo.settings import SearchSettings
from scamp_jax.planning.compile_cache import (
    CHECKED_FILE,
    WRITE_GRACE_S,
    cache_dir,
    study_compile_cache,
)
from scamp_jax.planning.compile_events import CompileCounter
from scamp_jax.planning.compile_options import (
    GPU_PLANNING_COMPILE,
    Purpose,
    answer_is_runnable,
    compile_options,
)
from scamp_jax.planning.compile_slots import COMPILE_SLOTS, CompileSlots
from scamp_jax.planning.evaluation import EvalCompiler, abstract_eval_inputs, plan_eval
from scamp_jax.planning.liveness import live_bytes
from scamp_jax.planning.planner import plan_mesh
from scamp_jax.planning.train_step import abstract_state, split_model
from scamp_jax.space import SearchSpace
from tests._models import CHANNELS, ConvNet

SIDE = 12
F32 = 4


class Denoise:
    """Recover an image from a noisy copy; the held-out set is evaluated in planned chunks."""

    metric = "mse"
    direction = "minimize"

    def sample_batch(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((batch_size, SIDE, SIDE, CHANNELS), jnp.float32),) * 2

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[np.ndarray, ...]]:
        rng = np.random.default_rng(seed)
        while True:
            y = rng.normal(size=(batch_size, SIDE, SIDE, CHANNELS)).astype(np.float32)
            yield (y + 0.1 * rng.normal(size=y.shape).astype(np.float32), y)

    def loss_fn(self, model: nnx.Module, batch: tuple[jax.Array, ...]) -> jax.Array:
        x, y = batch
        return jnp.mean(jnp.square(model(x) - y))

    def _held_out(self) -> tuple[np.ndarray, np.ndarray]:
        return next(self.batches(6, 123))

    def eval_inputs(self) -> list[np.ndarray]:
        return [self._held_out()[0]]

    def eval_forward(self, model: nnx.Module, x: jax.Array) -> jax.Array:
        return model(x)

    def score(self, outputs: list[np.ndarray]) -> dict[str, float]:
        return {"mse": float(np.mean(np.square(outputs[0] - self._held_out()[1])))}

    def evaluate(self, model: nnx.Module) -> dict[str, float]:
        x, y = self._held_out()
        return {"mse": float(jnp.mean(jnp.square(model(jnp.asarray(x)) - y)))}


WIDTHS = (4, 8, 12)
SPACE = SearchSpace(
    "conv-widths",
    lambda t: {"width": t.suggest_categorical("width", list(WIDTHS)), "learning_rate": 1e-2},
    lambda config, rngs: ConvNet(int(config["width"]), rngs),
    grid={"width": list(WIDTHS), "learning_rate": [1e-2]})


def _study(study_dir: Path, name: str) -> dict[str, Any]:
    from rich.console import Console

    from scamp_jax.hpo.session import run_search

    settings = SearchSettings(trials=len(WIDTHS), steps=2, study_dir=study_dir,
                              study_name=name, sampler="grid", pruner="none",
                              checkpoint_every=0, max_batch_size=8, max_running_trials=1)
    run_search(SPACE, Denoise(), settings, devices=jax.devices()[:2],
               memory_per_device=16 * 2**20, live=False, console=Console(file=io.StringIO()))
    out = study_dir if name == SPACE.name else study_dir / name
    return json.loads((out / "results.json").read_text())["run"]["overhead"]


def test_a_study_compiles_one_step_and_one_evaluation_per_architecture_and_a_second_none(
        tmp_path):
    first = _study(tmp_path, SPACE.name)
    archs = len(WIDTHS)
    # the planner's answer is each trial's step (none compiled by the runs); one forward each
    assert first["planning_compiles"] <= 2 * archs, first
    assert first["runner_step_compiles"] == 0 and first["evaluation_compiles"] == 0, first
    assert first["runner_init_compiles"] == 0, first  # initial states computed with NumPy
    # the engine's bound on compiles at once (its planner threads, 2) held, trials' included
    assert 1 <= COMPILE_SLOTS.most <= 2
    assert _entries(tmp_path)
    # A second process of the study (another study in the same folder, the same
    # architectures): plans from plans.sqlite, every program from the persistent cache.
    jax.clear_caches()
    second = _study(tmp_path, "again")
    assert second["planning_compiles"] == 0, second
    assert (second["runner_step_compiles"], second["runner_init_compiles"],
            second["evaluation_compiles"]) == (0, 0, 0), second


def _entries(study_dir: Path) -> list[Path]:
    """The compiled programs in a study's cache (not JAX's lock and access-time files)."""
    return sorted(cache_dir(study_dir).glob("*-cache"))


def test_a_reader_reads_the_cache_and_writes_nothing(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)
    x = jax.ShapeDtypeStruct((7, 5), jnp.float32)
    with study_compile_cache(tmp_path, writer=False), CompileCounter() as reader:
        f.lower(x).compile()
    assert reader.total == 1 and not _entries(tmp_path)
    jax.clear_caches()
    with study_compile_cache(tmp_path), CompileCounter() as writer:
        f.lower(x).compile()
    assert writer.total == 1 and len(_entries(tmp_path)) == 1
    jax.clear_caches()
    with study_compile_cache(tmp_path, writer=False), CompileCounter() as again:
        f.lower(x).compile()
    assert again.total == 0 and sum(again.cache_hits.values()) == 1
    # and the settings of before come back: nothing is cached outside the block
    assert jax.config.jax_compilation_cache_dir is None


def test_compile_slots_bound_the_compiles_running_at_once():
    import threading

    def compile_all(slots: CompileSlots, barrier: threading.Barrier | None) -> None:
        def one(k: int) -> None:
            lowered = jax.jit(lambda x: jnp.sin(x) * k).lower(
                jax.ShapeDtypeStruct((k + 2, 3), jnp.float32))
            with slots.slot():
                if barrier is not None:
                    barrier.wait(timeout=60)  # every thread inside at once
                lowered.compile()

        threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    free = CompileSlots()
    compile_all(free, threading.Barrier(6))
    assert free.most == 6  # no bound: all six at once
    bounded = CompileSlots()
    with bounded.limited(2):
        compile_all(bounded, None)
    assert 1 <= bounded.most <= 2 and bounded.limit == 0  # the bound is lifted after
    with pytest.raises(ValueError, match="limit=0 must be an int >= 1"):
        with bounded.limited(0):
            pass


def test_a_higher_bound_lets_waiting_compiles_start_at_once():
    import threading

    slots = CompileSlots()
    started, release = threading.Semaphore(0), threading.Event()

    def hold() -> None:
        with slots.slot():
            started.release()
            release.wait(timeout=60)

    with slots.limited(1):
        threads = [threading.Thread(target=hold) for _ in range(4)]
        for t in threads:
            t.start()
        assert started.acquire(timeout=30)  # one runs, three wait
        assert not started.acquire(timeout=0.3)
        with slots.limited(4):  # room for all: the three start without a release
            for _ in range(3):
                assert started.acquire(timeout=30)
            release.set()
            for t in threads:
                t.join(timeout=30)
    assert slots.most == 4 and slots.limit == 0


def test_planning_options_per_backend():
    assert compile_options("cpu", Purpose.GUIDE) == {"xla_backend_optimization_level": "0"}
    assert compile_options("cpu", Purpose.ANSWER) is None is compile_options("cpu", Purpose.RUN)
    assert answer_is_runnable("cpu") and not answer_is_runnable("gpu")
    for purpose in (Purpose.GUIDE, Purpose.ANSWER, Purpose.EVAL):
        assert compile_options("gpu", purpose) == GPU_PLANNING_COMPILE
    assert compile_options("gpu", Purpose.RUN) is None
    # this XLA knows the GPU option by that name (an unknown one fails the compile)
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((3,), jnp.float32))
    lowered.compile(dict(GPU_PLANNING_COMPILE))
    with pytest.raises(Exception, match="No such compile option"):
        lowered.compile({"xla_gpu_no_such_option_here": 0})


def test_live_bytes_follows_the_values_an_interpreter_holds():
    def f(x: jax.Array) -> jax.Array:
        a = x * 2.0          # 4 KiB, read by the last line
        b = jnp.tanh(a)      # 4 KiB, read by c only
        c = b + 1.0          # b is freed once c exists
        return c + a

    jaxpr = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((32, 32), jnp.float32))
    size = 32 * 32 * F32
    # at c: a and b held, c made (3 arrays); at the output: a, c held and the output made
    assert live_bytes(jaxpr) == 3 * size


def test_live_bytes_walks_a_custom_derivatives_body_inline():
    """A function with a custom derivative runs its body inline: its input is freed at its
    last use inside, as the same expression written out is."""

    @jax.custom_vjp
    def scaled(x: jax.Array) -> jax.Array:
        return jnp.tanh(x * 2.0) + 1.0

    scaled.defvjp(lambda x: (scaled(x), x), lambda x, g: (g,))
    x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    plain = live_bytes(jax.make_jaxpr(lambda v: jnp.tanh((v + 1.0) * 2.0) + 1.0)(x))
    assert live_bytes(jax.make_jaxpr(lambda v: scaled(v + 1.0))(x)) == plain == 2 * 32 * 32 * F32
    figures = set()
    for save_output in (True, False):
        with jax.softmax_custom_jvp(save_output):  # a custom_jvp_call, or the expression
            jaxpr = jax.make_jaxpr(lambda v: jax.nn.softmax(v * 2.0))(x)
        assert any(e.primitive.name == "custom_jvp_call" for e in jaxpr.eqns) == save_output
        figures.add(live_bytes(jaxpr))
    assert max(figures) - min(figures) <= 8  # the same arrays (a scalar's bytes apart)


def test_the_evaluation_is_planned_from_shapes_with_one_compile_that_the_run_uses():
    task = Denoise()
    model = nnx.eval_shape(lambda: ConvNet(8, nnx.Rngs(0)))
    with CompileCounter() as count:
        plan = plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                         memory_per_device="16MiB", optimizer=make_optimizer({}),
                         loss_fn=task.loss_fn, max_batch_size=8, eval_task=task)
    assert count.compiles["jit(run)"] == 1 and count.compiles["jit(step)"] == 1
    assert plan.compiles == 2 and plan.eval_chunk == 6  # the whole held-out set fits
    groups = abstract_eval_inputs(task)
    graphdef = split_model(model)[0]
    params, _, rest = abstract_state(model, make_optimizer({}))
    fresh = EvalCompiler(graphdef, task.eval_forward, params, rest,
                         plan.step_shardings.params, plan.step_shardings.rest, plan.mesh)
    assert fresh.peak(plan.eval_chunk, groups) == plan.eval_peak_bytes  # the compiled figure


def test_trials_evaluating_at_once_on_a_shared_evaluator_compile_its_chunk_once():
    """Trials of one architecture share an evaluator (`StepCache.evaluator`); two that reach
    their evaluation together get one compile of the chunk, the second waiting for the first."""
    import threading

    task = Denoise()
    model = nnx.eval_shape(lambda: ConvNet(8, nnx.Rngs(0)))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    from scamp_jax.planning.memory import default_step_shardings

    params, opt_state, rest = abstract_state(model, make_optimizer({}))
    shardings = default_step_shardings(mesh, params, opt_state, rest, make_optimizer({}))
    evaluator = EvalCompiler(split_model(model)[0], task.eval_forward, params, rest,
                             shardings.params, shardings.rest, mesh)
    sample = abstract_eval_inputs(task)[0]
    together = threading.Barrier(2, timeout=60)
    got: list[Any] = []

    def evaluate() -> None:
        together.wait()
        got.append(evaluator.compiled(6, sample))

    with CompileCounter() as count:
        threads = [threading.Thread(target=evaluate) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert len(got) == 2 and got[0] is got[1]
    assert count.compiles["jit(run)"] == 1


def test_a_shape_guess_too_high_costs_one_more_evaluation_compile():
    # A budget between the forward's compiled peak at 2 and at 6 samples, and a shape
    # estimate that believes 6 fit (a stand-in: the real estimate errs this far only for
    # programs XLA compiles very differently from their jaxpr): the compile says no, the line
    # through it picks the next chunk, compiled once more.
    task = Denoise()
    model = nnx.eval_shape(lambda: ConvNet(8, nnx.Rngs(0)))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    from scamp_jax.planning.memory import default_step_shardings

    params, opt_state, rest = abstract_state(model, make_optimizer({}))
    shardings = default_step_shardings(mesh, params, opt_state, rest, make_optimizer({}))
    groups = abstract_eval_inputs(task)
    probe = EvalCompiler(split_model(model)[0], task.eval_forward, params, rest,
                         shardings.params, shardings.rest, mesh)
    two, six = probe.peak(2, groups), probe.peak(6, groups)
    evaluator = EvalCompiler(split_model(model)[0], task.eval_forward, params, rest,
                             shardings.params, shardings.rest, mesh)
    evaluator.estimate = lambda chunk, groups: 0  # type: ignore[method-assign]
    budget = (two + six) // 2
    chosen = plan_eval(evaluator, groups, 0, budget)
    assert chosen.compiles == 2 and chosen.peak_bytes <= budget
    assert 1 <= chosen.chunk < 6 and math.isclose(chosen.peak_bytes, probe.peak(
        chosen.chunk, groups))


def test_a_plans_flops_come_from_its_own_executable_and_a_cached_plan_keeps_them(tmp_path):
    from scamp_jax.planning.plan_cache import PlanCache
    from scamp_jax.planning.train_step import (
        compiled_flops,
        default_loss,
        default_optimizer,
        step_flops,
    )

    model = nnx.eval_shape(lambda: ConvNet(16, nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, SIDE, SIDE, CHANNELS), jnp.float32)
    for devices, mp in ((1, 1), (4, 2)):
        cache = PlanCache(tmp_path / f"plans{devices}.sqlite")
        kw = dict(devices=devices, memory_per_device="16MiB", max_batch_size=8,
                  model_parallel=mp, min_shard_elements=0, cache=cache)
        plan = plan_mesh(model, sample, **kw)
        assert plan.step_flops == compiled_flops(plan.compiled_step.executable, devices)
        # the optimised, partitioned program against the whole lowered one: a different
        # count of the same step (4,994,003 against 4,914,506 at one device, 5,060,196 at
        # 2x2), not a copy of it
        batch = jax.ShapeDtypeStruct((plan.batch_size, *sample.shape[1:]), sample.dtype)
        lowered = step_flops(model, default_optimizer(), default_loss, batch)
        assert lowered < plan.step_flops < 1.05 * lowered
        again = plan_mesh(model, sample, **kw)
        assert again.cached and again.compiles == 0
        assert again.step_flops == plan.step_flops
        # another budget: the batch's peaks come from the cache, the run's step is compiled
        other = plan_mesh(model, sample, **{**kw, "memory_per_device": "17MiB"})
        assert not other.cached and other.compiled_step is not None
        assert other.step_flops == compiled_flops(other.compiled_step.executable, devices)


def _trial_on(device: int, plan: Any, task: Any, study_dir: Path) -> tuple[Any, tuple]:
    """A fresh 'process' (JAX's in-memory caches cleared) running one trial of width 8 on CPU
    device ``device`` under the study's persistent cache: its result and compiles."""
    from scamp_jax.hpo.runner import RunSpec, StepCache, run_trial

    space = SearchSpace("conv", lambda t: {"width": 8},
                        lambda config, rngs: ConvNet(int(config["width"]), rngs))
    jax.clear_caches()
    spec = RunSpec(number=device, params={"width": 8, "learning_rate": 1e-2},
                   plan=plan.with_devices(jax.devices()[device:device + 1]), steps=2,
                   memory_per_device=16 * 2**20, seed=3)
    with study_compile_cache(study_dir), CompileCounter() as count:
        result = run_trial(spec, space, task, cache=StepCache())
    assert result.state == "complete", result.reason
    return result, (count.compiles["jit(step)"], count.compiles["jit(run)"],
                    count.compiles["jit(init)"])


def _conv_plan(task: Any, study_dir: Path | None = None) -> Any:
    model = nnx.eval_shape(lambda: ConvNet(8, nnx.Rngs(0)))
    kw: dict[str, Any] = dict(devices=jax.devices()[:1], memory_per_device="16MiB",
                              optimizer=make_optimizer({}), loss_fn=task.loss_fn,
                              max_batch_size=8, eval_task=task)
    if study_dir is None:
        return plan_mesh(model, task.sample_batch(1), **kw)
    with study_compile_cache(study_dir):
        return plan_mesh(model, task.sample_batch(1), **kw)


def test_a_later_process_compiles_nothing_for_a_trial_on_the_devices_it_had(tmp_path):
    """A plan from the plan cache has no compiled programs: the trial compiles its step and its
    evaluation chunk (its initialisation is computed with NumPy); a later process's trial on
    the same device reads both from the persistent cache and ends as the first did."""
    import dataclasses

    task = Denoise()
    cached = dataclasses.replace(_conv_plan(task), compiled_step=None, evaluator=None,
                                 step_source=None)
    first, compiled = _trial_on(1, cached, task, tmp_path)
    again, none = _trial_on(1, cached, task, tmp_path)
    assert compiled == (1, 1, 0) and none == (0, 0, 0)
    assert first.metrics == again.metrics


def test_an_executable_read_back_from_the_cache_is_compiled_again_rather_than_moved(tmp_path):
    """XLA's CPU executables lose functions when one read back is serialized again, so the
    planner's step found in the persistent cache is not moved onto a trial's other device: the
    trial compiles its own there and trains as one given the planner's fresh executable."""
    from scamp_jax.planning.reuse import read_back

    task = Denoise()
    fresh = _conv_plan(task, tmp_path)  # compiled, and written to the study's cache
    assert not read_back(fresh.compiled_step.executable)
    reference, moved = _trial_on(2, fresh, task, tmp_path / "elsewhere")
    assert moved == (0, 0, 0)  # the planner's step and chunk loaded onto device 2
    jax.clear_caches()
    again = _conv_plan(task, tmp_path)  # a later process: read back, not compiled
    assert read_back(again.compiled_step.executable) and again.evaluator is not None
    result, own = _trial_on(2, again, task, tmp_path / "elsewhere")
    assert own[:2] == (1, 1)  # its own step and chunk for device 2
    assert result.metrics == reference.metrics


@pytest.mark.parametrize(("version", "level_one"), [((0, 10, 2), True), ((0, 11, 2), True),
                                                    ((0, 12, 0), False)])
def test_the_initial_states_compile_is_at_level_one_through_jax_0_11(monkeypatch, version,
                                                                       level_one) -> None:
    """``CPU_INIT_SAME_VALUES_THROUGH`` is the newest series at level 1, itself included."""
    from scamp_jax.planning.compile_options import CPU_INIT_COMPILE

    monkeypatch.setattr(jax, "__version_info__", version)
    options = compile_options("cpu", Purpose.INIT)
    assert options == (CPU_INIT_COMPILE if level_one else None)


def test_an_entry_left_half_written_is_removed_when_the_writer_opens_and_kept_anew(
        tmp_path, caplog):
    """A process killed while JAX wrote an entry in place leaves half a file, which JAX warns
    of at every read and never writes again: the study's writer removes it when it opens the
    cache (said once), so its program is compiled and kept anew; entries that read whole are
    left, each is checked once, and none written in the last `WRITE_GRACE_S` (another process
    of the study may still be writing it)."""
    import logging

    f = jax.jit(lambda x: jnp.sin(x) * 5.0 - 2.0)
    g = jax.jit(lambda x: jnp.cos(x) * 7.0 + 3.0)
    x = jax.ShapeDtypeStruct((6, 4), jnp.float32)
    with study_compile_cache(tmp_path):
        f.lower(x).compile()
        g.lower(x).compile()
    assert len(_entries(tmp_path)) == 2
    half = _entries(tmp_path)[0]
    sound = _entries(tmp_path)[1].read_bytes()
    half.write_bytes(half.read_bytes()[: half.stat().st_size // 2])
    # Written just now, it may be another process's entry still being written: left alone.
    jax.clear_caches()
    with study_compile_cache(tmp_path):
        pass
    assert half in _entries(tmp_path) and half.stat().st_size < len(sound) + 1000
    old = time.time() - WRITE_GRACE_S - 60  # as written long enough before this opening
    for entry in _entries(tmp_path):
        os.utime(entry, (old, old))
    marker = cache_dir(tmp_path) / CHECKED_FILE  # and after the entries checked before
    os.utime(marker, (old - 60, old - 60))
    jax.clear_caches()
    with caplog.at_level(logging.WARNING, logger="scamp_jax"), \
            study_compile_cache(tmp_path), CompileCounter() as count:
        f.lower(x).compile()
        g.lower(x).compile()
    assert count.total == 1 and sum(count.cache_hits.values()) == 1  # the half one compiled
    assert [m for m in caplog.messages if "unreadable" in m] == [
        f"removed 1 half-written compiled program(s) from {str(cache_dir(tmp_path))!r} "
        "(unreadable: a process stopped while writing them?): they are compiled and kept again"]
    assert len(_entries(tmp_path)) == 2 and _entries(tmp_path)[1].read_bytes() == sound
    jax.clear_caches()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scamp_jax"), \
            study_compile_cache(tmp_path), CompileCounter() as again:
        f.lower(x).compile()
        g.lower(x).compile()
    assert again.total == 0 and sum(again.cache_hits.values()) == 2 and not caplog.messages


def test_a_cache_folder_that_is_a_file_is_refused_with_what_to_do(tmp_path):
    (tmp_path / "jax_cache").write_text("")
    with pytest.raises(ValueError, match=r"'.*jax_cache' is a file, where the study keeps its "
                       r"compiled programs \(a folder\): move or delete it"):
        with study_compile_cache(tmp_path):
            pass


_READ_ONLY_CACHE = """
import logging, sys, warnings
import jax, jax.numpy as jnp
from scamp_jax.planning.compile_cache import study_compile_cache
logging.basicConfig(format="%(message)s")
warnings.simplefilter("error")  # JAX's own warning, one per compile, would end it here
with study_compile_cache(sys.argv[1]):
    jax.jit(lambda x: x * 2.0 + 1.0).lower(jax.ShapeDtypeStruct((3,), jnp.float32)).compile()
print("compiled")
"""


def test_a_cache_folder_that_cannot_be_written_is_said_once_and_only_read(tmp_path):
    """A study folder whose ``jax_cache`` is mounted read-only (root's permission bits do not
    stop its writes): the writer says once that compiled programs cannot be kept, and reads
    only, instead of JAX's warning at every compile."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("no unshare or mount (util-linux)")
    folder = cache_dir(tmp_path)
    folder.mkdir()
    program = tmp_path / "compile.py"
    program.write_text(_READ_ONLY_CACHE)
    script = (f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && "
              f"exec {sys.executable} {program} {tmp_path}")
    result = subprocess.run(["unshare", "--mount", "--kill-child", "sh", "-c", script],
                            cwd=Path(__file__).resolve().parents[1], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if result.returncode != 0 and ("mount" in result.stderr or "unshare" in result.stderr):
        pytest.skip(f"a read-only mount is not allowed here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "compiled"
    assert result.stderr.strip() == (
        f"the study's compiled programs cannot be kept in {str(folder)!r} (it cannot be "
        "written here): this process compiles what is not there already; make it writable "
        "to keep them")


def test_a_runs_compile_takes_the_slot_beyond_the_bound_and_a_planners_waits():
    """Planning compiles hold every slot: a run's compile (its devices wait for it) starts at
    once in the one slot beyond the bound, which leaves the bound's slots to the others; a
    second run's waits, and takes a freed slot before a planner that waited longer."""
    import threading

    slots = CompileSlots()
    started: list[str] = []
    release = {name: threading.Event() for name in ("plan a", "plan b", "run 1", "run 2",
                                                    "plan c", "plan d")}
    cond = threading.Condition()

    def hold(name: str) -> None:
        with contextlib.ExitStack() as stack:
            if name.startswith("run"):
                stack.enter_context(slots.for_a_run())
            with slots.slot():
                with cond:
                    started.append(name)
                    cond.notify_all()
                release[name].wait(timeout=60)

    def begin(name: str) -> threading.Thread:
        thread = threading.Thread(target=hold, args=(name,))
        thread.start()
        return thread

    def wait_for(count: int) -> bool:
        with cond:
            return cond.wait_for(lambda: len(started) >= count, timeout=30)

    with slots.limited(2):
        threads = [begin("plan a"), begin("plan b")]
        assert wait_for(2)
        threads.append(begin("run 1"))
        assert wait_for(3) and started[2] == "run 1"  # beside both plans
        threads.append(begin("plan c"))
        time.sleep(0.3)
        threads.append(begin("run 2"))
        time.sleep(0.3)
        assert len(started) == 3  # one slot beyond the bound, one run at a time
        release["plan a"].set()  # a bound slot frees: the waiting run first
        assert wait_for(4) and started[3] == "run 2"
        release["run 1"].set()  # the slot beyond: a planner may not take it
        time.sleep(0.3)
        assert len(started) == 4
        release["plan b"].set()  # a bound slot: the waiting planner
        assert wait_for(5) and started[4] == "plan c"
        threads.append(begin("plan d"))  # the run's slot beyond is not the planners'
        time.sleep(0.3)
        assert len(started) == 5
        for event in release.values():
            event.set()
        for t in threads:
            t.join(timeout=30)
    assert started[5] == "plan d" and slots.most == 3
