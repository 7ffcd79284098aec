"""Fast tests of the benchmark helpers: tables and ratios, Ray baseline bookkeeping, costing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import hpo_makespan, ray_baseline
from scamp_jax.sim.simulator import StepCostModel


def _info(elapsed: float, util: float, idle: float, trials: int, psnr: float) -> dict[str, Any]:
    return {"elapsed_s": elapsed, "trials_this_run": trials, "best": {"psnr": psnr},
            "usage": {"mean_memory_utilization": util, "idle_device_seconds": idle}}


def _rows() -> list[dict[str, Any]]:
    return [hpo_makespan._row("scamp", _info(100.0, 0.5, 200.0, 4, 30.0), "psnr"),
            hpo_makespan._row("fixed", _info(150.0, 0.25, 500.0, 4, 30.0), "psnr"),
            hpo_makespan._row("ray-tune", _info(300.0, 0.2, 900.0, 4, 29.5), "psnr")]


def test_row_computes_trials_per_hour_from_elapsed_time() -> None:
    row = hpo_makespan._row("scamp", _info(1800.0, 0.5, 10.0, 6, 31.0), "psnr")
    assert row["trials_per_hour"] == pytest.approx(12.0)
    assert row["best"] == 31.0 and row["end_to_end_s"] == 1800.0


def test_ratio_line_compares_every_baseline_with_scamp() -> None:
    lines = hpo_makespan.ratio_line(_rows()).splitlines()
    assert len(lines) == 2
    assert "end-to-end time fixed/scamp = 1.50x" in lines[0]
    assert "memory utilisation scamp/fixed = 2.00x" in lines[0]
    assert "idle device-seconds scamp - fixed = -300.0" in lines[0]
    assert "end-to-end time ray-tune/scamp = 3.00x" in lines[1]
    assert "memory utilisation scamp/ray-tune = 2.50x" in lines[1]


def test_ratio_line_needs_a_scamp_row() -> None:
    with pytest.raises(ValueError, match="no 'scamp' row"):
        hpo_makespan.ratio_line(_rows()[1:])


def test_format_table_markdown_has_one_line_per_row() -> None:
    text = hpo_makespan.format_table(_rows(), markdown=True)
    lines = text.splitlines()
    assert lines[0].startswith("| policy | end-to-end (s) |") and "best psnr" in lines[0]
    assert lines[1] == "|---|---|---|---|---|---|"
    assert lines[2] == "| scamp | 100.0 | 50.0% | 200.0 | 144.0 | 30 |"
    assert lines[4].startswith("| ray-tune | 300.0 | 20.0% | 900.0 | 48.0 | 29.5 |")
    plain = hpo_makespan.format_table(_rows(), markdown=False).splitlines()
    assert plain[0].split()[:2] == ["policy", "end-to-end"] and plain[3].startswith("ray-tune")


def test_ray_usage_matches_hand_computed_figures() -> None:
    # Two 2-device trials at 100 of 1000 bytes per device: [0, 10] and [5, 15]; pool of 4.
    usage = ray_baseline.ray_usage([(0, 0.0, 10.0, 100), (1, 5.0, 15.0, 100)],
                                   devices_per_trial=2, pool_devices=4, memory_per_device=1000,
                                   t_end=20.0)
    busy = 2 * 10.0 + 2 * 10.0  # device-seconds held
    assert usage["idle_device_seconds"] == pytest.approx(4 * 20.0 - busy)
    assert usage["mean_memory_utilization"] == pytest.approx(busy * 100 / (4 * 1000 * 20.0))
    assert usage["trials_finished"] == 2


def test_ray_usage_reuses_devices_a_trial_released_at_the_same_instant() -> None:
    usage = ray_baseline.ray_usage([(0, 0.0, 5.0, 10), (1, 5.0, 9.0, 10)], devices_per_trial=2,
                                   pool_devices=2, memory_per_device=100, t_end=9.0)
    assert usage["idle_device_seconds"] == pytest.approx(0.0)


def test_ray_usage_rejects_more_overlap_than_the_pool_holds() -> None:
    with pytest.raises(ValueError, match="only 0 free device"):
        ray_baseline.ray_usage([(0, 0.0, 10.0, 1), (1, 1.0, 2.0, 1)], devices_per_trial=2,
                               pool_devices=2, memory_per_device=10, t_end=10.0)


def test_trial_specs_come_from_completed_trials_with_their_checkpoint_keys() -> None:
    results = {"trials": [
        {"number": 2, "state": "complete", "params": {"a": 1}, "batch_size": 8, "steps": 40,
         "checkpoint": "/x/checkpoints/trial_2/40"},
        {"number": 0, "state": "complete", "params": {"a": 2}, "batch_size": 8, "steps": 40,
         "checkpoint": None},
        {"number": 1, "state": "failed", "params": {"a": 3}, "batch_size": 0, "steps": 0},
    ]}
    specs = ray_baseline.trial_specs_from_results(results)
    assert [s.number for s in specs] == [0, 2]
    assert [s.checkpoint_key for s in specs] == ["trial_0", "trial_2"]
    assert specs[1].params == {"a": 1} and specs[1].batch_size == 8 and specs[1].steps == 40
    with pytest.raises(ValueError, match="no completed trial"):
        ray_baseline.trial_specs_from_results({"trials": results["trials"][2:]})


def test_missing_ray_skips_the_row_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    ray, reason = ray_baseline.import_ray()
    assert ray is None and 'pip install "ray[tune]"' in reason
    args = argparse.Namespace(family="swinir", devices_per_trial=2, seed=0)
    assert hpo_makespan._ray_rows(args, tmp_path, 2**30, 8, task=None) == []
    assert "Ray Tune row skipped" in capsys.readouterr().out


def test_step_cost_model_honours_the_planner_memory_floor() -> None:
    cost = StepCostModel(model_parallel=1, flops_fixed=0.0, flops_per_sample=1.0,
                         bytes_fixed=0.0, bytes_per_sample=1.0, gradient_bytes=0.0,
                         mp_comm_fixed=0.0, mp_comm_per_sample=0.0, kernels_per_step=1,
                         memory_fixed=100.0, memory_per_sample=10.0, memory_floor=500.0)
    assert cost.peak_bytes(1) == 500  # flat part: XLA reuses buffers it needs anyway
    assert cost.peak_bytes(100) == 1100
    assert cost.profile(0, devices=1, batch_size=2, samples=4).bytes_per_device == 500
    assert cost.max_local_batch(499) == 0
    assert cost.max_local_batch(1000) == 90


def _tiny_mlp() -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(16, 64, rngs=rngs)
            self.down = nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.down(jax.nn.relu(self.up(x)))

    model = nnx.eval_shape(lambda: Mlp(nnx.Rngs(0)))
    return model, jax.ShapeDtypeStruct((1, 16), jnp.float32)


def test_measure_cost_memory_is_the_planner_memory_model() -> None:
    from benchmarks.simulate_cluster import measure_cost
    from scamp_jax.planning.memory import fit_memory_model
    from scamp_jax.planning.train_step import default_loss, default_optimizer

    model, batch = _tiny_mlp()
    cost, seconds = measure_cost(model, batch, optimizer=default_optimizer(),
                                 loss_fn=default_loss, model_parallel=1, batches=(4, 16))
    memory = fit_memory_model(model, batch, optimizer=default_optimizer(), loss_fn=default_loss,
                              probe_batches=(4, 16), verify_batch=64)
    assert (cost.memory_fixed, cost.memory_per_sample, cost.memory_floor) == (
        memory.fixed_bytes, memory.bytes_per_sample, memory.floor_bytes)
    for b in (1, 4, 64, 1000):
        assert cost.step_peak_bytes(b) == memory.predict(b)
        # What a trial books adds its prefetched batch (16 float32 a sample): the engine's rule.
        assert cost.peak_bytes(b) == memory.predict(b) + 64 * b
    assert cost.flops_per_sample > 0 and cost.kernels_per_step > 0 and seconds > 0


def test_measured_cost_predicts_an_independently_compiled_step_at_unseen_batches() -> None:
    """The cost model, fitted from probes at batches 4 and 16, against a training step written
    here with plain ``jax.jit`` + ``optax.adam`` (no project code) and compiled at batches it
    never saw. The two steps differ only in bookkeeping (injected hyperparameters, the loss's
    reduction), so memory agrees within 10% up to 32 times the largest probe, FLOPs per sample
    within 1% and total FLOPs within 3% (the bookkeeping's fixed FLOPs are 2% at batch 8); a
    wrong per-sample slope or a missing optimizer state is far outside that."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from benchmarks.simulate_cluster import measure_cost
    from scamp_jax.planning.train_step import default_loss, default_optimizer

    model, batch = _tiny_mlp()
    cost, _ = measure_cost(model, batch, optimizer=default_optimizer(), loss_fn=default_loss,
                           model_parallel=1, batches=(4, 16))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: type(model)(nnx.Rngs(0))), nnx.Param)
    adam = optax.adam(1e-3)

    def step(params: Any, opt_state: Any, x: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = jax.eval_shape(adam.init, params)
    measured = {}
    for b in (8, 32, 128, 512):
        x = jax.ShapeDtypeStruct((b, 16), jnp.float32)
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, x).compile()
        stats = compiled.memory_analysis()
        peak = (stats.temp_size_in_bytes + stats.argument_size_in_bytes
                + stats.output_size_in_bytes - stats.alias_size_in_bytes)
        flops = compiled.cost_analysis()
        flops = (flops[0] if isinstance(flops, list) else flops)["flops"]
        measured[b] = flops
        assert cost.step_peak_bytes(b) == pytest.approx(peak, rel=0.10), b
        assert cost.flops_fixed + cost.flops_per_sample * b == pytest.approx(flops, rel=0.03), b
    slope = (measured[512] - measured[8]) / (512 - 8)
    assert cost.flops_per_sample == pytest.approx(slope, rel=0.01)


def test_cost_table_caches_and_remeasures_entries_without_the_full_booking(
    tmp_path: Path,
) -> None:
    from benchmarks.simulate_cluster import CostTable

    cost = StepCostModel(model_parallel=1, flops_fixed=1.0, flops_per_sample=2.0,
                         bytes_fixed=3.0, bytes_per_sample=4.0, gradient_bytes=5.0,
                         mp_comm_fixed=0.0, mp_comm_per_sample=0.0, kernels_per_step=7,
                         memory_fixed=8.0, memory_per_sample=9.0, memory_floor=10.0)
    path = tmp_path / "costs.json"
    # Written before a trial's booking counted its prefetched batch and evaluation.
    old = {k: v for k, v in cost.__dict__.items()
           if k not in ("prefetch_per_sample", "eval_peak", "opt_state_bytes", "plans")}
    path.write_text(json.dumps({"stale": {**old, "compile_seconds": 1.0}}))
    calls = []

    def make() -> tuple[StepCostModel, float]:
        calls.append(1)
        return cost, 3.0

    table = CostTable(path)
    assert table.get("stale", make) == cost and len(calls) == 1
    assert table.compile_seconds_of("stale") == pytest.approx(1.0)  # 3 compiles in 3 s
    again = CostTable(path)
    assert again.get("stale", make) == cost and len(calls) == 1  # served from the file
    planned = dataclasses.replace(cost, plans=((900, 64, 4, 40, 880),))
    again.put("stale", planned)
    assert CostTable(path).get("stale", make) == planned and len(calls) == 1


def test_supernet_benchmark_raises_the_cpu_collective_deadline_unless_set(monkeypatch) -> None:
    from benchmarks import supernet_pipeline

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    supernet_pipeline.raise_cpu_collective_timeout(120)
    assert supernet_pipeline.TERMINATE_FLAG + "=120" in os.environ["XLA_FLAGS"]
    assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]
    monkeypatch.setenv("XLA_FLAGS", f"--{supernet_pipeline.TERMINATE_FLAG}=7")
    supernet_pipeline.raise_cpu_collective_timeout(120)  # the user's value is kept
    assert os.environ["XLA_FLAGS"] == f"--{supernet_pipeline.TERMINATE_FLAG}=7"
    with pytest.raises(ValueError, match="must be at least 1 second"):
        supernet_pipeline.raise_cpu_collective_timeout(0)


def test_the_ring_check_predicts_with_the_simulators_communication_model():
    """``mpi_comm --sizes`` compares measured all-reduces with the simulator's own ring model:
    each of p ranks sends 2 (p - 1) / p of the buffer over one link."""
    from benchmarks.mpi_comm import ring_rows

    rows = [{"ranks": 4, "bytes": 16 << 20, "seconds": 0.3},
            {"ranks": 2, "bytes": 1 << 20, "seconds": 0.05}]
    table, worst, fitted = ring_rows(rows, 1e8, 16 << 20)
    sent = 2 * 3 / 4 * (16 << 20)
    assert float(table[0][3]) == pytest.approx(sent / 1e8 * 1e3, abs=1e-3)
    assert float(table[1][3]) == pytest.approx((1 << 20) / 1e8 * 1e3, abs=1e-3)
    # The tolerance and the fit cover messages of check_from and up only.
    assert worst == pytest.approx(abs(sent / 1e8 / 0.3 - 1))
    assert fitted == pytest.approx(sent / 0.3)


def test_the_search_spaces_swinir_case_builds_the_program_the_space_trains() -> None:
    """``swinir_small_so`` is ``swinir_small`` with the search space's attention softmax (it
    keeps its output only), unless told otherwise; the reference cases keep JAX's default."""
    from flax import nnx

    from benchmarks.memory_accuracy import BY_NAME
    from search_spaces.swin_blocks import WindowAttention

    def rules(model: Any) -> set[bool]:
        return {m.save_softmax_output for _, m in nnx.iter_graph(model)
                if isinstance(m, WindowAttention)}

    case, reference = BY_NAME["swinir_small_so"], BY_NAME["swinir_small"]
    assert case.make is reference.make and case.sample().shape == reference.sample().shape
    assert rules(nnx.eval_shape(lambda: case.build(nnx.Rngs(0)))) == {True}
    assert rules(nnx.eval_shape(lambda: case.build(nnx.Rngs(0), False))) == {False}
    assert rules(nnx.eval_shape(lambda: reference.build(nnx.Rngs(0)))) == {False}


def _refused(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``main(argv)`` says as it exits 2 (argparse's usage error), before any work."""
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())


#: simulate_cluster's smallest study, costed in a fresh cache (where a check came late)
_ONE_TRIAL = ["--architectures", "1", "--trials", "1", "--cache", "{dir}/costs.json"]


@pytest.mark.parametrize("module, argv, message", [
    ("target_accuracy", ["--only", "nope"], "--only: unknown case(s) nope; choose from mlp"),
    ("target_accuracy", ["--only", "transformer"],
     "transformer has no budget of its own (those with one: mlp"),
    ("target_accuracy", ["--only", "mlp,"], "an empty name"),
    ("target_accuracy", ["--only", "mlp", "--targets", "h100,nope"],
     "--targets: target='nope' is neither a known GPU"),
    ("target_accuracy", ["--json", "{dir}"], "is a folder; pass the path of a file"),
    ("target_accuracy", ["--json", "{file}/x.json"], "which is a file; pass a file path"),
    ("target_accuracy", ["--only", "mlp", "--no-plan", "--reference", "{dir}"],
     "--no-plan acts on the compile at the reference's batch, and {dir} has no reference "
     "figures for mlp; pass --only with cases it has"),
    ("target_accuracy", ["--only", "mlp", "--compile-options", "[1]"],
     "--compile-options: [1] is no JSON object"),
    ("compiles", ["--case", "nope"], "argument --case: invalid choice: 'nope'"),
    ("compiles", ["--devices", "0"], "argument --devices: 0 must be at least 1"),
    ("memory_accuracy", ["--devices", "0"], "argument --devices: 0 must be at least 1"),
    ("memory_accuracy", ["--only", "mlp", "--batch", "4"],
     "--batch applies with --child CASE only (two training steps of one case"),
    ("memory_accuracy", ["--only", "mlp", "--safety-margin", "0.5", "--plan-cache", "{file}"],
     "--safety-margin, --plan-cache apply with --child CASE only"),
    ("memory_accuracy", ["--only", ""], "--only '': an empty name; pass names separated by "
     "single commas, e.g. --only mlp,vit (or leave --only out: mlp,transformer,swinir,vit)"),
    ("memory_accuracy", ["--only", "mlp,,vit"], "--only 'mlp,,vit': an empty name"),
    ("fusion", ["--steps", "0"], "argument --steps: 0 must be at least 1"),
    ("fusion", ["--batch", "0"], "argument --batch: 0 must be at least 1"),
    ("fusion", ["--out", "{file}/x.json"], "argument --out:"),
    ("fusion", ["--conv", "--kernels"], "argument --kernels: not allowed with argument --conv"),
    ("fusion", ["--conv", "--simulate"], "argument --simulate: not allowed with argument --conv"),
    ("fusion", ["--simulate", "--ray"],
     "--ray runs the trials under Ray Tune, and --simulate trains nothing; leave out one"),
    ("fusion", ["--conv", "--family", "vit"],
     "--conv times one 3x3 SwinIR convolution whatever the family; leave out --family"),
    ("fusion", ["--steps", "2"], "error: --steps 2: the steady state is timed between the "
     "second and later loss read-backs, so a trial needs at least 3 steps"),
    ("fusion_precision", ["--out", "{dir}"], "argument --out:"),
    ("overhead", ["--json", "{file}/x.json"], "argument --json:"),
    ("overhead", ["--seed", "-1"], "argument --seed: -1 must be an integer >= 0"),
    ("overhead", ["--seed", "x"], "argument --seed: 'x' is not an integer"),
    ("simulate_cluster", ["--fixed-devices", "0"], "argument --fixed-devices: 0 must be"),
    ("simulate_cluster", ["--safety-margin", "1.0"], "--safety-margin 1.0 must be in [0, 1)"),
    ("simulate_cluster", ["--json"], "--json prints a --replay's placements"),
    ("simulate_cluster", ["--cache", "{dir}"], "argument --cache:"),
    ("simulate_cluster", ["--cache", "{file}/costs.json"], "argument --cache:"),
    ("simulate_cluster", [*_ONE_TRIAL, "--max-batch-size", "-4"],
     "--max-batch-size -4 must be a positive integer, or 0 for no cap"),
    ("simulate_cluster", [*_ONE_TRIAL, "--devices", "8", "--fixed-devices", "16"],
     "--fixed-devices 16 exceeds the pool of --devices 8; pass at most 8"),
    ("simulate_cluster", [*_ONE_TRIAL, "--measured", "{dir}"],
     "--measured {dir}: {dir}/results.json does not exist; pass the directory of a finished"),
    ("simulate_cluster", [*_ONE_TRIAL, "--restart-seconds", "-1"],
     "--restart-seconds -1.0 must be a number of seconds >= 0"),
    ("simulate_cluster", [*_ONE_TRIAL, "--planning-seconds", "inf"],
     "--planning-seconds inf must be a number of seconds >= 0"),
    ("simulate_cluster", [*_ONE_TRIAL, "--overlap", "2"], "--overlap 2.0 must be in [0, 1]"),
    ("simulate_cluster", [*_ONE_TRIAL, "--growth-tolerance", "-5"],
     "--growth-tolerance -5.0 must be >= 0"),
    ("simulate_cluster", [*_ONE_TRIAL, "--planner-threads", "0"],
     "--planner-threads 0 must be at least 1"),
    ("hpo_makespan", ["--policies", "scamp,scamp"], "names a policy twice"),
    ("hpo_makespan", ["--out", "{file}"], "argument --out: '{file}' is a file; pass a directory"),
])
def test_a_benchmarks_bad_flag_is_refused_before_its_work(
        module: str, argv: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flag a benchmark can check is checked before it compiles or trains: a bad case,
    target, count or output path found after minutes of compiles loses them."""
    import importlib

    # target_accuracy sets the variable where unset, for its compiles: kept to this test
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    argv = [a.format(dir=tmp_path / "dir", file=tmp_path / "file") for a in argv]
    main = importlib.import_module(f"benchmarks.{module}").main
    assert message.format(dir=tmp_path / "dir", file=tmp_path / "file") in _refused(main, argv,
                                                                                    capsys)


def test_target_accuracys_reference_compile_flags_need_a_reference_and_known_options(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-plan and --compile-options act on the compile at the reference's batch only:
    without a reference they are refused, not an empty row or an option never used; an option
    XLA has not is named in one line before any case compiles, not a JAX traceback."""
    from benchmarks import target_accuracy

    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    monkeypatch.setattr(target_accuracy, "default_reference", lambda: None)
    for flags in (["--no-plan"], ["--compile-options", '{"xla_gpu_autotune_level": 0}']):
        said = _refused(target_accuracy.main, ["--only", "mlp", *flags], capsys)
        assert (f"{flags[0]} acts on the compile at the reference's batch, and there is no "
                "reference: no shared/gpu/2026-11-27-h200 above this checkout; pass "
                "--reference DIR") in said, said
    (tmp_path / "mem_mlp_0.json").write_text(json.dumps(
        {"rows": [{"plan_batch": 8, "planned": 2**20}]}))
    said = _refused(target_accuracy.main, [
        "--only", "mlp", "--no-plan", "--reference", str(tmp_path),
        "--compile-options", '{"xla_bogus_flag": 1}'], capsys)
    assert "--compile-options: XLA has no option 'xla_bogus_flag'; check its spelling" in said


def test_fusion_says_ray_is_missing_before_its_runs_and_why_its_row_is_skipped(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--ray without Ray Tune installed: a note before the minutes of runs, and the reason
    beside the tables, not only in the JSON (as benchmarks.hpo_makespan --ray)."""
    from benchmarks import fusion, ray_baseline

    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    said_first = []

    def run(*args: Any, ray: bool, **kwargs: Any) -> dict[str, Any]:
        said_first.append(capsys.readouterr().out)
        assert ray
        return {"ray": {"skipped": ray_baseline.import_ray()[1]}}

    monkeypatch.setattr(fusion, "run", run)
    monkeypatch.setattr(fusion, "_table", lambda report, markdown: None)
    monkeypatch.setattr("scamp_jax.devices.configure_cpu_devices", lambda n: None)
    fusion.main(["--ray", "--steps", "3"])
    assert said_first == ['note: --ray: the Ray Tune baseline needs Ray Tune; install it with: '
                          'pip install "ray[tune]"; the Ray Tune row will be skipped (Ctrl-C '
                          'now to install it first)\n']
    assert capsys.readouterr().out.startswith(
        'Ray Tune row skipped: the Ray Tune baseline needs Ray Tune; install it with: '
        'pip install "ray[tune]" (')


def test_memory_accuracys_only_help_names_the_default_cases(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The default set is CASES, not every model --only can name."""
    from benchmarks import memory_accuracy

    with pytest.raises(SystemExit):
        memory_accuracy.main(["--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "(default: mlp,transformer,swinir,vit; the others, slower, only when named)" in usage
    assert "default: all" not in usage


def _command(*args: str) -> Any:
    """``python ARGS`` in its own process, as a shell starts it (its own CPU devices)."""
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, *args], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=300)


_WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # makes `import ray` raise ImportError, as where it is not installed
from benchmarks import hpo_makespan
hpo_makespan.main(sys.argv[1:])
"""


def test_hpo_makespan_checks_its_pool_and_says_ray_is_missing_before_its_runs(
        tmp_path: Path) -> None:
    """A fixed policy's devices per trial beyond the pool is refused before the ScaMP run it
    follows (minutes at the documented sizes), and a missing Ray Tune is said before any run
    (it skips its row at the end)."""
    result = _command("-c", _WITHOUT_RAY, "--ray", "--devices-per-trial", "99", "--out",
                      str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--devices-per-trial 99 exceeds the pool of 8 devices" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no study ran
    assert result.stdout.startswith('note: --ray: the Ray Tune baseline needs Ray Tune; '
                                    'install it with: pip install "ray[tune]"'), result.stdout


def test_simulate_cluster_says_what_to_validate_where_a_folder_is_no_measured_run(
        tmp_path: Path) -> None:
    result = _command("-m", "benchmarks.simulate_cluster", "--validate", str(tmp_path),
                      "--cache", str(tmp_path / "costs.json"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert (f"--validate {tmp_path}: no hpo_makespan.json there; pass the --out DIR of a "
            "'python -m benchmarks.hpo_makespan --out DIR' run") in result.stderr


def test_simulate_cluster_says_validate_needs_both_policies_before_calibrating(
        tmp_path: Path) -> None:
    """A run of one policy (hpo_makespan --policies scamp) cannot be validated: said before
    the host is calibrated, with the command that makes both, not a raw missing file."""
    (tmp_path / "hpo_makespan.json").write_text("[]")
    (tmp_path / "scamp").mkdir()
    (tmp_path / "scamp" / "results.json").write_text("{}")
    result = _command("-m", "benchmarks.simulate_cluster", "--validate", str(tmp_path),
                      "--cache", str(tmp_path / "costs.json"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert (f"--validate {tmp_path}: no fixed/results.json there; it compares the fixed and "
            "scamp runs, so the run needs both: 'python -m benchmarks.hpo_makespan --policies "
            "scamp,fixed --out DIR'") in result.stderr
    assert "cpu host" not in result.stderr  # not calibrated


@pytest.mark.slow
def test_simulate_cluster_validates_a_vit_run_in_the_vit_space(tmp_path: Path) -> None:
    """A ViT ``hpo_makespan`` run is re-costed in the ViT space it ran in (its family is in
    hpo_makespan.json), on the budget its results.json records."""
    run = _command("-m", "benchmarks.hpo_makespan", "--family", "vit", "--trials", "2",
                   "--steps", "5", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((tmp_path / "run" / "hpo_makespan.json").read_text())
    assert {row["family"] for row in rows} == {"vit"}
    result = _command("-m", "benchmarks.simulate_cluster", "--validate", str(tmp_path / "run"),
                      "--cache", str(tmp_path / "costs.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "simulated_ratio=" in result.stdout
    assert all(key.startswith("vit-validate-") for key in
               json.loads((tmp_path / "costs.json").read_text()))


def test_a_cost_cache_that_is_no_json_is_named(tmp_path: Path) -> None:
    from benchmarks.simulate_cluster import CostTable

    (tmp_path / "costs.json").write_text("not json")
    with pytest.raises(ValueError, match=r"the cost cache '.*costs.json' cannot be read .*"
                                         "delete it"):
        CostTable(tmp_path / "costs.json")


@pytest.mark.parametrize("damage", ["drop", "text"])
def test_a_damaged_cost_cache_entry_is_named_with_the_cache_as_its_cause(
        tmp_path: Path, damage: str) -> None:
    from benchmarks.simulate_cluster import CostTable

    cost = StepCostModel(model_parallel=1, flops_fixed=1.0, flops_per_sample=2.0,
                         bytes_fixed=3.0, bytes_per_sample=4.0, gradient_bytes=5.0,
                         mp_comm_fixed=0.0, mp_comm_per_sample=0.0, kernels_per_step=7,
                         memory_fixed=8.0, memory_per_sample=9.0)
    entry = {**dataclasses.asdict(cost), "compile_seconds": 1.0}
    if damage == "drop":
        del entry["flops_fixed"]
    else:
        entry["flops_per_sample"] = "2.0"
    (tmp_path / "costs.json").write_text(json.dumps({"arch": entry}))
    with pytest.raises(ValueError, match=r"the cost cache '.*costs.json' has a damaged entry "
                                         r"'arch' \(.*\); .*delete it"):
        CostTable(tmp_path / "costs.json").get("arch", lambda: (cost, 0.0))


def test_the_overhead_table_shows_each_ways_best_and_its_test_score(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Both ways test their best model on the task's test data (scamp-jax's ``run_study``:
    ``{"trial": n, metric: v}``, the plain loop's: the task's scores): the table shows it
    beside the best, as BENCHMARKS.md quotes it."""
    from benchmarks import overhead

    def run(best: float, test: dict | None) -> dict:
        return {"wall_s": 10.0, "cpu_s": 12.0, "peak_rss_bytes": 2**30, "best": best,
                "metric": "accuracy", "values": {}, "test": test}

    overhead.report(overhead.FAMILIES["digits"], {
        "plain": [run(0.92, {"accuracy": 0.912})],
        "scamp": [run(0.92, {"trial": 3, "accuracy": 0.912})],
        "scamp:none": [run(0.90, None)]}, markdown=True)
    table = capsys.readouterr().out
    assert "best accuracy (test)" in table
    assert table.count("| 0.9200/0.9200/0.9200 (0.9120/0.9120/0.9120) |") == 2, table
    assert "| 0.9000/0.9000/0.9000 |" in table  # no test: the best alone


def test_hpo_makespan_removes_its_temporary_folder_when_no_run_finished(tmp_path: Path) -> None:
    """A study refused on the way (here no candidate fits the budget) leaves no temporary
    folder of empty studies behind; a folder given with --out is the user's and stays."""
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp_path / "tmp")}
    env.pop("XLA_FLAGS", None)
    (tmp_path / "tmp").mkdir()
    refused = subprocess.run(
        [sys.executable, "-m", "benchmarks.hpo_makespan", "--memory-per-device", "1KiB",
         "--policies", "scamp", "--trials", "1"], cwd=Path(__file__).resolve().parents[1],
        env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "none of the first 1 candidates fits" in refused.stderr
    assert list((tmp_path / "tmp").iterdir()) == []
    kept = subprocess.run(
        [sys.executable, "-m", "benchmarks.hpo_makespan", "--memory-per-device", "1KiB",
         "--policies", "scamp", "--trials", "1", "--out", str(tmp_path / "out")],
        cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
        timeout=300)
    assert kept.returncode == 2 and (tmp_path / "out" / "scamp").is_dir()
