"""GPU targets: planning for a GPU this machine does not have (`scamp_jax.planning.targets`).

The tests that compile for a target need the ``gpu-plan`` extra (JAX's CUDA plugin and the
CUDA 12.9 compiler wheel); without it they skip and say so (CI installs it, and fails them
instead). The descriptions, names and errors are checked everywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from scamp_jax.planning import targets
from scamp_jax.planning.budget import Budget
from scamp_jax.planning.compile_options import Purpose, device_options
from scamp_jax.planning.memory import StepCompiler
from scamp_jax.planning.plan_cache import device_identity
from scamp_jax.planning.planner import plan_mesh
from tests._requirements import fresh_python, unavailable, without_gpu_driver

ROOT = Path(__file__).resolve().parents[1]
#: What one H200 compiled for the memory cases (`../shared/gpu/2026-11-27-h200/mem_*.json`,
#: jax 0.11.2 with autotuning): the planned batch and its compiled peak per device, bytes.
H200 = {
    "mlp": ("512MiB", 9124, 470_623_032),
    "vit": ("1GiB", 575, 959_179_488),
    "swinir_small": ("2GiB", 172, 1_926_054_968),
}


def needs_gpu_compiler() -> None:
    """Skip (fail in CI) unless the gpu-plan extra is installed."""
    missing = targets.missing_gpu_compiler()
    if missing is not None:
        unavailable(f"the gpu-plan extra is not installed: {missing}")


class MLP(nnx.Module):
    def __init__(self, d: int, h: int, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(d, h, rngs=rngs)
        self.down = nnx.Linear(h, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.relu(self.up(x)))


def small_model() -> tuple[nnx.Module, jax.ShapeDtypeStruct]:
    model = nnx.eval_shape(lambda: MLP(64, 256, nnx.Rngs(0)))
    return model, jax.ShapeDtypeStruct((1, 64), jnp.float32)


# ------------------------------------------------------------------ descriptions (no plugin)
@pytest.mark.parametrize("name", targets.TARGETS)
def test_named_target_reads_back_from_its_description(name: str) -> None:
    target = targets.resolve_target(name)
    spec = targets.GPUS[name]
    again = targets.parse_target_config(target.config)
    assert (again.device_kind, again.memory_bytes, again.compute_capability) == (
        spec.device_kind, spec.memory_bytes, spec.compute_capability)
    assert f"core_count: {spec.sm_count}\n" in target.config


def test_required_targets_are_named_with_the_device_kind_jax_reports() -> None:
    kinds = {name: targets.resolve_target(name).device_kind
             for name in ("h100", "a100-80gb", "a100-40gb", "v100")}
    assert kinds == {"h100": "NVIDIA H100 80GB HBM3", "a100-80gb": "NVIDIA A100-SXM4-80GB",
                     "a100-40gb": "NVIDIA A100-SXM4-40GB", "v100": "Tesla V100-SXM2-32GB"}
    assert targets.resolve_target("H100") == targets.resolve_target("h100")


def test_description_file_is_a_target(tmp_path: Path) -> None:
    text = targets.GPUS["a100-40gb"].target_config().replace(
        "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB")
    path = tmp_path / "a100_pcie.txtpb"
    path.write_text(text)
    target = targets.resolve_target(str(path))
    assert (target.device_kind, target.compute_capability) == ("NVIDIA A100-PCIE-40GB", (8, 0))
    assert target.memory_bytes == targets.GPUS["a100-40gb"].memory_bytes


def test_unknown_target_and_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"target='h300' is neither a known GPU \(a100-40gb, "):
        targets.resolve_target("h300")
    with pytest.raises(ValueError, match="file; did you mean a100-40gb or a100-80gb[?] pass"):
        targets.resolve_target("A100")
    bad = tmp_path / "rocm.txtpb"
    bad.write_text('gpu_device_info { rocm_compute_capability { gcn_arch_name: "gfx90a" } }')
    with pytest.raises(ValueError, match="no cuda_compute_capability"):
        targets.resolve_target(bad)
    # a file that is no description at all says so, not that its GPU is not a CUDA one
    # text format's "field: {" is the same as "field {"
    colon = re.sub(r"(gpu_device_info|cuda_compute_capability) \{", r"\1: {",
                   targets.GPUS["h100"].target_config())
    assert targets.parse_target_config(colon).compute_capability == (9, 0)
    (tmp_path / "empty.txtpb").write_text("\n")
    with pytest.raises(ValueError, match=r"empty.txtpb: the file is empty; a description "
                       r"file is a GpuTargetConfigProto in text form"):
        targets.resolve_target(tmp_path / "empty.txtpb")
    (tmp_path / "notes.txtpb").write_text("garbage {{{ not proto")
    with pytest.raises(ValueError, match=r"notes.txtpb: no gpu_device_info \{...\}, so this "
                       r"is no GpuTargetConfigProto in text form"):
        targets.resolve_target(tmp_path / "notes.txtpb")
    # Counts XLA's GPU compiler sizes kernels by: 0 (or none) planned 10x the real peak
    for count in ("device_memory_size", "core_count", "memory_bandwidth"):
        zero = tmp_path / f"zero_{count}.txtpb"
        zero.write_text(re.sub(rf"{count}: \d+", f"{count}: 0",
                               targets.GPUS["h100"].target_config()))
        with pytest.raises(ValueError, match=rf"zero_{count}\.txtpb: the description's "
                           rf"gpu_device_info gives no positive {count}; describe the GPU's own"):
            targets.resolve_target(zero)
    with pytest.raises(ValueError, match=r"target='' is neither a known GPU \(.*\) nor a "
                       r"description file; pass one of those names"):
        targets.resolve_target("")  # no "did you mean" every name
    with pytest.raises(ValueError, match="autotune_cache=.* is not a directory"):
        targets.resolve_target("h100", autotune_cache=tmp_path / "missing")
    with pytest.raises(ValueError, match=r"missing\.txtpb' does not exist; pass the path"):
        targets.resolve_target(str(tmp_path / "missing.txtpb"))
    # Older than the CUDA 12 compiler compiles for: XLA would fall back to the driver, and
    # with none the process would crash.
    kepler = tmp_path / "k80.txtpb"
    kepler.write_text(targets.GPUS["h100"].target_config().replace("major: 9 minor: 0",
                                                                  "major: 3 minor: 7"))
    with pytest.raises(ValueError, match=r"compute capability 3\.7 is older than"):
        targets.resolve_target(kepler)


def test_a_description_the_plugin_cannot_read_is_named(tmp_path: Path) -> None:
    needs_gpu_compiler()
    broken = tmp_path / "broken.txtpb"
    broken.write_text(targets.GPUS["h100"].target_config().replace(
        "l2_cache_size:", "l2_cache_size_of_another_proto: 1\n  l2_cache_size:"))
    with pytest.raises(ValueError, match=r"broken\.txtpb: the CUDA plugin cannot use this "
                                         r"target description: .*TF_CPP_MIN_LOG_LEVEL=0"):
        targets.resolve_target(broken).devices(1)


def test_missing_compiler_names_the_install_command(monkeypatch) -> None:
    # A mock for a fault CI cannot have (the extra is installed there): the plugin not found.
    real = importlib.util.find_spec
    monkeypatch.setattr(targets.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("jax_plugins") else real(name, *a))
    assert "pip install 'scamp-jax[gpu-plan]'" in targets.missing_gpu_compiler()
    fresh = targets.parse_target_config(targets.GPUS["h100"].target_config() + "# unused\n")
    with pytest.raises(targets.GpuCompilerMissingError, match=r"scamp-jax\[gpu-plan\]"):
        fresh.devices(1)


_NO_PLUGIN = """
import importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.startswith("jax_plugins") \\
    else real(name, *a)
from experiments import swinir_hpo
swinir_hpo.main(sys.argv[1:])
"""


def test_cli_says_a_missing_compiler_in_one_line(tmp_path) -> None:
    # The same mock as above, in a process of its own (the command line sets up JAX's devices):
    # the command line's error, not a traceback.
    description = tmp_path / "gpu.txtpb"
    description.write_text(targets.GPUS["h100"].target_config())
    proc = subprocess.run(
        [sys.executable, "-c", _NO_PLUGIN, "--plan-only", "--target", str(description),
         "--devices", "1", "--trials", "1", "--no-live", "--study-dir", str(tmp_path / "s")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: compiling for a GPU target needs JAX's CUDA plugin"), \
        proc.stderr
    assert "pip install 'scamp-jax[gpu-plan]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_target_needs_a_device_count() -> None:
    """A count of GPUs, not devices of this machine; a NumPy integer is the count it holds
    (as without a target: it was refused, naming the count it was)."""
    model, sample = small_model()
    with pytest.raises(ValueError, match="devices must be a count, the number of GPUs to plan "
                       "for, not None"):
        plan_mesh(model, sample, devices=None, target="h100")
    needs_gpu_compiler()
    import numpy as np

    plan = plan_mesh(model, sample, devices=np.int64(2), memory_per_device="64MiB",
                     max_batch_size=64, target="h100")
    assert len(plan.devices) == 2


def test_more_described_gpus_than_a_plan_holds_are_refused_before_any_is_made() -> None:
    """XLA's compiler holds up to 50 KB of host memory per described GPU: a pool of a million
    (a stray ``000``) filled a 24 GiB machine, which killed the process with no word. Such a
    pool is refused at once, saying why and how many it takes; the library's call too."""
    model, sample = small_model()
    too_many = targets.MAX_DEVICES + 1
    with pytest.raises(ValueError, match=rf"devices={too_many:,} described GPUs are more than "
                       rf"a plan describes at once \(at most {targets.MAX_DEVICES:,}\)"):
        plan_mesh(model, sample, devices=too_many, target="h100")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.swinir_hpo", "--plan-only", "--target", "h100",
         "--devices", "1000000000"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "error: --devices 1,000,000,000 described GPUs are more than a plan describes at once "
        "(at most 65,536): XLA's compiler holds up to about 50 KB of this machine's memory for "
        "each (46,566 GiB for 1,000,000,000)"), result.stderr


def test_cli_refuses_target_without_plan_only() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "experiments.swinir_hpo", "--target", "v100", "--devices", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "error: --target plans for GPUs this machine does not have" in result.stderr


# ------------------------------------------------------------- compiles (the gpu-plan extra)
def test_target_devices_leave_the_cpu_backend_alone() -> None:
    needs_gpu_compiler()
    before = jax.devices()
    devices = targets.resolve_target("h100").devices(2)
    assert [d.device_kind for d in devices] == ["NVIDIA H100 80GB HBM3"] * 2
    assert targets.resolve_target("h100").devices(2) is devices  # made once per process
    assert jax.devices() == before and jax.default_backend() == "cpu"
    assert targets.target_of(devices).name == "h100"
    assert targets.target_of(before) is None
    with pytest.raises(ValueError, match="mixes real and described GPUs"):
        targets.target_of([before[0], devices[0]])


def test_the_plugins_own_dump_of_a_description_reads_back(tmp_path: Path) -> None:
    """The form a GPU dumps its description in (``get_topology_for_devices(...)
    .target_config``: zeros left out) is a description file."""
    needs_gpu_compiler()
    from jax._src.lib import xla_client

    target = targets.resolve_target("v100")
    dump = xla_client.get_topology_for_devices(list(target.devices(1))).target_config
    assert "minor" not in dump  # compute capability 7.0
    path = tmp_path / "dump.txtpb"
    path.write_text(dump)
    again = targets.resolve_target(path)
    assert (again.device_kind, again.memory_bytes, again.compute_capability) == (
        target.device_kind, target.memory_bytes, target.compute_capability)


def test_plan_for_a_target_is_a_plan_and_cpu_plans_do_not_change() -> None:
    needs_gpu_compiler()
    model, sample = small_model()
    kw = {"devices": 2, "memory_per_device": "64MiB", "max_batch_size": 256}
    cpu_before = plan_mesh(model, sample, compile_for_run=False, **kw)
    plan = plan_mesh(model, sample, target="h100", **kw)
    cpu_after = plan_mesh(model, sample, compile_for_run=False, **kw)
    assert (cpu_after.batch_size, cpu_after.peak_bytes_per_device) == (
        cpu_before.batch_size, cpu_before.peak_bytes_per_device)
    assert {d.device_kind for d in plan.devices} == {"NVIDIA H100 80GB HBM3"}
    assert plan.data_parallel * plan.model_parallel == 2
    assert "devices              2 (gpu: NVIDIA H100 80GB HBM3)" in plan.describe()
    assert "devices              2 (cpu)" in cpu_before.describe()
    # the budget it was made for keeps the target's platform, kind and memory
    budget = plan.budget
    assert (budget.platform, budget.device_kind) == ("gpu", "NVIDIA H100 80GB HBM3")
    assert budget.device_bytes == targets.resolve_target("h100").memory_bytes
    assert (budget.memory_per_device, budget.usable_bytes) == (64 << 20, plan.usable_bytes)
    assert plan.compiled_step is None and plan.compiles >= 1
    assert 0 < plan.predicted_peak_bytes <= plan.usable_bytes
    # the figure is the target's: the same step compiled for it at the plan's batch
    compiler = StepCompiler(model, sample, plan.mesh, plan.step_shardings)
    assert compiler.compiler_options == device_options(plan.devices, Purpose.GUIDE)
    assert compiler.compiler_options["xla_gpu_autotune_level"] == 0
    assert compiler.compiler_options["xla_gpu_cuda_data_dir"] == str(targets.cuda_toolkit_dir())
    assert compiler.estimate(plan.batch_size).peak == plan.peak_bytes_per_device
    # as on a GPU, the planner keeps no step for a runner: nothing runs on described devices
    assert plan_mesh(model, sample, target="h100", compile_for_run=True,
                     **kw).compiled_step is None
    # the least time a step takes there: its FLOPs per device at what an H100 attains (the
    # scheduler's figure); none for CPU devices, whose share of the host is not fixed
    from scamp_jax.hpo.preview import compute_seconds
    from scamp_jax.scheduling.costs import attainable_flops

    h100 = plan.devices[0].device_kind
    assert compute_seconds(2e12, h100) == pytest.approx(2e12 / attainable_flops(h100))
    assert compute_seconds(2e12, cpu_after.devices[0].device_kind) is None
    assert compute_seconds(None, h100) is None


def test_the_fewest_described_gpus_are_planned_for_the_target() -> None:
    # min_devices_plan took this machine's CPU devices first, and refused them for the target
    needs_gpu_compiler()
    from scamp_jax.planning.planner import min_devices, min_devices_plan

    model, sample = small_model()
    count, plan = min_devices_plan(model, sample, devices=2, target="h100",
                                   memory_per_device="64MiB", max_batch_size=256)
    assert count == 1 and {d.device_kind for d in plan.devices} == {"NVIDIA H100 80GB HBM3"}
    assert min_devices(model, sample, devices=2, target="h100", max_batch_size=256) == 1
    with pytest.raises(ValueError, match="devices must be a count, the number of GPUs"):
        min_devices_plan(model, sample, devices=jax.devices()[:2], target="h100")


def test_a_fused_group_for_a_gpu_is_planned_with_the_autotuner_off_and_keeps_no_step(
        ) -> None:
    """As a study sizes a group (``compile_for_run``, the trial's batch): on a GPU the
    planner's compiles keep XLA's autotuner off, which holds the GPU while it runs, and keep
    no executable; the group's run compiles its step, autotuned once, as a solo run does."""
    from scamp_jax.planning.fusion import FusedStepCompiler, plan_fusion

    needs_gpu_compiler()
    model, sample = small_model()
    member = plan_mesh(model, sample, target="h100", devices=1, memory_per_device="64MiB",
                       max_batch_size=64)
    seen: list[dict | None] = []
    original = FusedStepCompiler.estimate

    def estimate(self, width, batch, run_grade=False):
        before = self.compiled
        out = original(self, width, batch, run_grade)
        if self.compiled > before:
            seen.append(self.run_options if run_grade else self.compiler_options)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedStepCompiler, "estimate", estimate)
        fused = plan_fusion(model, sample, max_width=4, plan=member, batch_size=64,
                            compile_for_run=True)
    assert fused.width == 4 and fused.compiled_step is None
    assert seen and all(options and options["xla_gpu_autotune_level"] == 0 for options in seen)


def test_a_script_that_plans_for_a_target_prints_no_plugin_start_up_error() -> None:
    """A plain script (no entry point's set-up) that plans for a target on a machine without
    a GPU driver: no traceback of the CUDA plugin's failed start-up on stderr."""
    needs_gpu_compiler()
    without_gpu_driver()
    script = ("import jax, jax.numpy as jnp\n"
              "from flax import nnx\n"
              "from scamp_jax import plan_mesh\n"
              "model = nnx.eval_shape(lambda: nnx.Linear(64, 64, rngs=nnx.Rngs(0)))\n"
              "plan = plan_mesh(model, jax.ShapeDtypeStruct((1, 64), jnp.float32), devices=2,\n"
              "                 memory_per_device='1GiB', target='h100', max_batch_size=64)\n"
              "print(plan.batch_size, plan.devices[0].device_kind)\n")
    proc = fresh_python(script, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "64" and "H100" in proc.stdout
    assert "plugin configuration error" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_described_h200s_default_pool_is_the_pool_xla_held_on_a_real_one() -> None:
    # XLA multiplies its pool fraction by CUDA's total, which leaves out what the driver
    # reserves: planning from nvidia-smi's total booked 460 MiB above the real H200's pool.
    spec = targets.GPUS["h200"]
    budget = Budget.for_device(spec.device_kind, spec.memory_bytes)
    # `bytes_limit` at XLA's defaults (`../shared/gpu/2026-11-27-h200/nocap_mem_*.json`)
    assert abs(budget.memory_per_device - 112_583_507_968) <= 4 << 20


def test_target_budget_is_its_described_gpus_and_keys_apart_from_gpus() -> None:
    needs_gpu_compiler()
    target = targets.resolve_target("a100-40gb")
    devices = target.devices(1)
    budget = Budget.of_devices(devices)
    assert budget == Budget.for_device("NVIDIA A100-SXM4-40GB", target.memory_bytes)
    assert Budget.of_devices(devices, "20GiB").memory_per_device == 20 << 30
    identity = device_identity(devices)
    assert identity["device_kind"] == ["NVIDIA A100-SXM4-40GB"]
    assert "described" in identity  # a described GPU's plans are not a real GPU's


@pytest.mark.parametrize("name", ["v100", "a100-80gb", "h100"])
def test_every_named_generation_compiles(name: str) -> None:
    """ptxas of the extra compiles for compute capability 7.0 to 9.0 (CUDA 13's stops at
    7.5: a V100 target needs CUDA 12's)."""
    needs_gpu_compiler()
    model, sample = small_model()
    plan = plan_mesh(model, sample, devices=1, memory_per_device="64MiB", target=name,
                     max_batch_size=64)
    assert plan.batch_size == 64 and plan.compiles == 1


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    pytest.param("mlp", marks=pytest.mark.xfail(
        strict=True, reason="XLA's default GEMM kernels without a GPU, autotuned ones on it")),
    "swinir_small", "vit"])
def test_h100_plan_against_what_an_h200_compiled(case: str) -> None:
    """The memory cases planned for an H100 here against the H200's own compiles: within 5%
    for the ViT and the small SwinIR; the MLP, all matrix products, is not (XLA's default
    Triton tiles and split-K without a GPU, autotuned ones there: see
    benchmarks/notes/targets.md)."""
    needs_gpu_compiler()
    from benchmarks.memory_accuracy import BY_NAME

    budget, batch, peak = H200[case]
    model = nnx.eval_shape(lambda: BY_NAME[case].build(nnx.Rngs(0)))
    plan = plan_mesh(model, BY_NAME[case].sample(), devices=1, memory_per_device=budget,
                     target="h100")
    assert abs(plan.batch_size - batch) <= 0.05 * batch
    assert abs(plan.peak_bytes_per_device - peak) <= 0.05 * peak


def test_plan_only_prints_each_candidates_plan() -> None:
    needs_gpu_compiler()
    # An explicit environment: once mpi4py has initialised MPI in this process (another test
    # may have), MPI's own variables sit in the C-level environment a child would inherit,
    # and --plan-only refuses to run as an MPI rank.
    result = subprocess.run(
        [sys.executable, "-m", "experiments.swinir_hpo", "--preset", "smoke", "--plan-only",
         "--target", "v100", "--devices", "4", "--trials", "2", "--max-batch-size", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("planning 2 candidates of swinir-small on 4 x Tesla V100-SXM2")
    header = next(line for line in lines if line.split()[:4] == ["trial", "devices", "mp",
                                                                 "batch"])
    rows = lines[lines.index(header) + 1:lines.index(header) + 3]
    assert [row.split()[0] for row in rows] == ["0", "1"]
    assert all(int(row.split()[3]) >= 1 for row in rows)  # a batch for each
    # a GPU target's study fuses (auto): the plan says so and how to size the groups here
    assert "add --fuse auto (or a width) to size the groups too" in result.stdout
    assert "batches of at most 2 samples (--max-batch-size)" in result.stdout
    assert "fused" not in header.split()
    # how long a step and a trial take there at least, and what that figure is
    assert header.split()[7:11] == ["CPU-s", "s/step", "at", "least"], header
    assert "device-h" in header.split()
    columns = header.index("device-h")
    assert all(float(row[columns - 6:columns + 8].split()[-1]) > 0 for row in rows), rows
    assert "(s/step at least: each step's FLOPs at the FLOP/s a device of this kind attains" \
        in result.stdout


def test_a_targets_unoptimised_code_books_what_optimised_code_books() -> None:
    """Nothing compiled for a target runs, so its code is generated without optimisation; the
    buffers are assigned before code generation, so every figure is the optimised compile's."""
    needs_gpu_compiler()
    from scamp_jax.planning.sharding import make_mesh

    target = targets.resolve_target("h100")
    model, sample = small_model()
    compiler = StepCompiler(model, sample, make_mesh(list(target.devices(1)), 1, 1))
    options = compiler.compiler_options
    assert all(options[k] == v for k, v in targets.UNOPTIMISED_CODE.items())
    optimised = {k: v for k, v in options.items() if k not in targets.UNOPTIMISED_CODE}
    figures = [compiler.compile(batch, opts)[0] for batch in (64, 4096)
               for opts in (options, optimised)]
    assert [(f.temp, f.peak) for f in figures[:2]] == [(figures[0].temp, figures[0].peak)] * 2
    assert [(f.temp, f.peak) for f in figures[2:]] == [(figures[2].temp, figures[2].peak)] * 2


@pytest.mark.gpu
def test_gpus_own_description_reproduces_its_compile(tmp_path: Path) -> None:
    """On a GPU: the GPU's description, compiled here as a target, gives the GPU's own figure
    when both compile without autotuning."""
    if jax.devices()[0].platform != "gpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    needs_gpu_compiler()
    from jax._src.lib import xla_client

    from scamp_jax.planning.sharding import make_mesh

    path = tmp_path / "gpu.txtpb"
    path.write_text(xla_client.get_topology_for_devices(jax.devices()[:1]).target_config)
    target = targets.resolve_target(path)
    assert target.device_kind == jax.devices()[0].device_kind
    model, sample = small_model()
    peaks = []
    for devices, options in ((jax.devices()[:1], {"xla_gpu_autotune_level": 0}),
                             (target.devices(1), None)):
        compiler = StepCompiler(model, sample, make_mesh(list(devices), 1, 1))
        peaks.append(compiler.compile(4096, options or compiler.compiler_options)[0].peak)
    assert peaks[0] == peaks[1]


@pytest.mark.gpu
def test_gpus_autotuning_cache_gives_a_target_its_kernels(tmp_path: Path) -> None:
    """On a GPU: the MLP case compiled there with autotuning (its per-fusion results written to
    a directory), then for the GPU's description in a process without a GPU reading that
    directory: the same compiled peak."""
    if jax.devices()[0].platform != "gpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    needs_gpu_compiler()
    from jax._src.lib import xla_client

    from benchmarks.memory_accuracy import BY_NAME
    from scamp_jax.planning.sharding import make_mesh

    cache, description = tmp_path / "autotune", tmp_path / "gpu.txtpb"
    cache.mkdir()
    description.write_text(
        xla_client.get_topology_for_devices(jax.devices()[:1]).target_config)
    model = nnx.eval_shape(lambda: BY_NAME["mlp"].build(nnx.Rngs(0)))
    compiler = StepCompiler(model, BY_NAME["mlp"].sample(), make_mesh(jax.devices()[:1], 1, 1))
    on_gpu = compiler.compile(9124, {"xla_gpu_per_fusion_autotune_cache_dir": str(cache)})[0]
    code = (
        "from flax import nnx\n"
        "from benchmarks.memory_accuracy import BY_NAME\n"
        "from scamp_jax.planning.memory import StepCompiler\n"
        "from scamp_jax.planning.sharding import make_mesh\n"
        "from scamp_jax.planning.targets import resolve_target\n"
        f"t = resolve_target({str(description)!r}, autotune_cache={str(cache)!r})\n"
        "m = nnx.eval_shape(lambda: BY_NAME['mlp'].build(nnx.Rngs(0)))\n"
        "c = StepCompiler(m, BY_NAME['mlp'].sample(), make_mesh(list(t.devices(1)), 1, 1))\n"
        "print(c.estimate(9124).peak)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=600,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) == on_gpu.peak


def test_candidate_plan_rows_are_plain_data() -> None:
    from scamp_jax.hpo.preview import CandidatePlan, format_rows

    row = CandidatePlan(0, {"embed_dim": 60}, 1, 1, 1, 64, 3 << 30, 28 << 30, 2, 41.5, 44.0,
                        steps=500)
    again = dataclasses.replace(row, number=1, compiles=0, planned_with=0)
    assert dataclasses.asdict(row)["batch_size"] == 64
    table = format_rows([row, again], params=["embed_dim"]).splitlines()
    assert table[0].split() == ["trial", "devices", "mp", "batch", "steps", "bytes/device",
                                "compiles", "CPU-s", "embed_dim"]
    assert table[1].split()[:5] == ["0", "1", "1", "64", "500"]
    assert "0 (trial 0)" in table[2]  # a plan reused from trial 0: nothing compiled for it
    assert "batch 64 x 500 steps" in row.describe()
    assert "the plan of trial 0 (the same architecture)" in again.describe()
    timed = dataclasses.replace(row, devices=4, step_seconds=0.018)
    assert timed.device_hours == pytest.approx(0.018 * 500 * 4 / 3600)
    header = format_rows([timed, row]).splitlines()[0]
    assert header.split()[-4:] == ["s/step", "at", "least", "device-h"]
    assert format_rows([timed]).splitlines()[1].split()[-2:] == ["0.018", "0.01"]


def test_a_product_without_a_default_kernel_compiles_with_cublas_kernels(caplog):
    """A SwinIR's window attention at batch 1024 for an H200 has a product of a transposed
    operand for which XLA has no default Triton tiling without autotuning ("Failed to get
    configs"); every compile of the project then takes cuBLAS kernels for it and says so."""
    needs_gpu_compiler()
    from jax.sharding import SingleDeviceSharding

    from scamp_jax.planning.reuse import compile_lowered

    device = targets.resolve_target("h200").devices(1)[0]
    sharding = SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((1024, 6, 4, 6, 4, 48), jnp.float32, sharding=sharding)
    w = jax.ShapeDtypeStruct((48, 48), jnp.float32, sharding=sharding)
    lowered = jax.jit(lambda x, w: x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, 48) @ w).lower(x, w)
    options = device_options([device], Purpose.GUIDE)
    with pytest.raises(jax.errors.JaxRuntimeError, match="does not support a default config"):
        lowered.compile(options)  # XLA alone
    # (at debug level: a compile retried earlier in this process said it at warning level)
    with caplog.at_level("DEBUG", logger="scamp_jax.planning.reuse"):
        compiled = compile_lowered(lowered, options)
    assert compiled.memory_analysis().output_size_in_bytes == 589824 * 48 * 4
    assert "no default kernel for a matrix-product kernel" in caplog.text


_NO_DEFAULT_KERNEL_SCRIPT = """
import os, sys
from scamp_jax.planning import targets
if sys.argv[1] == "quiet":
    targets.quiet_compiler_log()  # what --plan-only --target does before JAX starts
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from scamp_jax.planning.compile_options import Purpose, device_options
from scamp_jax.planning import reuse
retries = []  # compiles retried without Triton matrix products
reuse.without_default_kernels = (lambda options, err, plain=reuse.without_default_kernels:
                                 retries.append(1) or plain(options, err))
device = targets.resolve_target("h200").devices(1)[0]
sharding = SingleDeviceSharding(device)
x = jax.ShapeDtypeStruct((1024, 6, 4, 6, 4, 48), jnp.float32, sharding=sharding)
w = jax.ShapeDtypeStruct((48, 48), jnp.float32, sharding=sharding)
lowered = jax.jit(lambda x, w: x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, 48) @ w).lower(x, w)
for _ in range(2):  # a second compile that needs the same retry
    reuse.compile_lowered(lowered, device_options([device], Purpose.GUIDE))
print(len(retries))
"""


def test_a_target_compile_says_a_missing_default_kernel_in_one_line() -> None:
    """Without a GPU, XLA's compiler logs an ERROR with the fusion's whole HLO for each product
    without a default kernel, about 150 lines for six SwinIRs at batch 4,096 of an H200; after
    `targets.quiet_compiler_log` (``--plan-only --target``) only the planner's one line is
    left, said once however many compiles retry."""
    needs_gpu_compiler()
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    stderr = {}
    for mode in ("loud", "quiet"):
        result = subprocess.run([sys.executable, "-c", _NO_DEFAULT_KERNEL_SCRIPT, mode],
                                cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.split() == ["2"]  # both compiles retried
        stderr[mode] = result.stderr
    assert "Could not get config for HLO" in stderr["loud"]  # XLA's log, JAX's default level
    assert "Could not get config" not in stderr["quiet"]
    assert stderr["quiet"].strip().splitlines() == [
        "XLA found no default kernel for a matrix-product kernel of this GPU compile; "
        "compiling it again with cuBLAS matrix products instead of Triton's (later compiles "
        "that do the same say so at debug level)"]


def test_only_a_missing_default_kernel_is_compiled_again():
    from scamp_jax.planning.compile_options import without_default_kernels

    missing = RuntimeError("INTERNAL: Failed to get configs for: 2 out of 25 instructions. "
                           "UNIMPLEMENTED: TritonBackend does not support a default config.")
    assert without_default_kernels({"a": 1}, missing) == {"a": 1,
                                                          "xla_gpu_enable_triton_gemm": False}
    assert without_default_kernels({"xla_gpu_enable_triton_gemm": False}, missing) is None
    oom = RuntimeError("Failed to get configs for: 31 out of 120 instructions ... could not "
                       "allocate 3.40GiB; TritonBackend does not support a default config")
    assert without_default_kernels(None, oom) is None  # an out-of-memory for the ledger
    assert without_default_kernels(None, RuntimeError("INTERNAL: something else")) is None
    one = RuntimeError("INTERNAL: No supported config found for HLO: %gemm_fusion_dot.17 ... "
                       "UNIMPLEMENTED: TritonBackend does not support a default config.")
    assert without_default_kernels(None, one) == {"xla_gpu_enable_triton_gemm": False}


def _suite_memory(out: Path, rows: list[dict]) -> Path:
    (out / "sections").mkdir(parents=True)
    (out / "sections" / "memory.json").write_text(json.dumps({"rows": rows}))
    return out


def test_a_gpu_suites_plans_and_runs_are_references(tmp_path: Path) -> None:
    from benchmarks.target_accuracy import reference_point

    out = _suite_memory(tmp_path / "suite", [
        {"case": "vit fused x4", "point": "planned, capped", "plan_batch": 9,
         "planned": 1, "compiled": 2},
        {"case": "mlp", "point": "probe batch 12000", "plan_batch": 9124,
         "planned": 3, "compiled": 4},
        {"case": "mlp", "point": "planned, capped", "plan_batch": 9124,
         "planned": 423_905_592, "compiled": 470_623_032},
    ])
    # the plan's compile had autotuning off; the run's at the same batch had it on
    assert reference_point(out, "mlp") == (9124, 423_905_592)
    assert reference_point(out, "mlp", autotuned=True) == (9124, 470_623_032)
    assert reference_point(out, "vit") is None
    assert reference_point(tmp_path / "nothing", "mlp") is None


def test_an_empty_autotuning_cache_leaves_a_targets_default_kernels(tmp_path: Path) -> None:
    """A cache without the program's fusions: XLA takes its default kernels, as without one
    (with one recorded on the GPU: `test_gpus_autotuning_cache_gives_a_target_its_kernels`)."""
    needs_gpu_compiler()
    from benchmarks.target_accuracy import measure

    (tmp_path / "autotune").mkdir()
    reference = (512, 1)
    plain = measure("mlp", "h200", "512MiB", reference, plan=False)
    cached = measure("mlp", "h200", "512MiB", reference, plan=False,
                     autotune_cache=tmp_path / "autotune")
    assert cached["autotune_cache"] == str(tmp_path / "autotune")
    assert cached["peak_at_reference_batch"] == plain["peak_at_reference_batch"] > 0


def test_target_accuracy_names_a_missing_reference_or_cache(tmp_path: Path, capsys) -> None:
    from benchmarks import target_accuracy

    for flag in ("--reference", "--autotune-cache"):
        with pytest.raises(SystemExit) as exit_:
            target_accuracy.main([flag, str(tmp_path / "missing")])
        assert exit_.value.code == 2
        assert f"{flag} {tmp_path / 'missing'}: no such directory" in capsys.readouterr().err


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_the_fused_step_for_a_gpu_launches_no_more_kernels_than_a_solo_step() -> None:
    """Compiled for a described H100, the fused step of 4 ViT members launches no more
    kernels than one member's solo step (vmap widens kernels, it does not add them), so a
    step bound by kernel launches, as small members on a GPU are, can gain 4x or more
    (`benchmarks.fusion.kernel_counts`); its convolutions are cuDNN's."""
    needs_gpu_compiler()
    from benchmarks.fusion import kernel_counts

    gpu = kernel_counts("vit", 4, 8, target="h100")
    assert 0 < gpu["fused_kernels"] <= gpu["solo_kernels"], gpu
    assert sum(gpu["fused_kinds"].values()) == gpu["fused_kernels"]
    assert any(k.startswith("custom-call:__cudnn") for k in gpu["fused_kinds"])


@pytest.mark.parametrize("argv, message", [
    (["benchmarks.target_accuracy", "--targets", "nosuch"],
     "python -m benchmarks.target_accuracy: error: --targets: target='nosuch' is neither a "
     "known GPU"),
    (["benchmarks.hpo_makespan", "--trials", "1", "--memory-per-device", "lots"],
     "error: cannot read memory size 'lots'"),
])
def test_a_benchmarks_bad_input_ends_in_one_line(argv, message):
    """The benchmarks' command lines end bad input as the experiments' do: one line, exit 2."""
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_targets_autotuning_cache_gives_it_devices_options_and_plans_of_its_own(
        tmp_path: Path) -> None:
    """The same description with and without an autotuning cache: two sets of compile-only
    devices, each naming its own Target, so that compiles on the cached one read the cache
    (XLA's level 4 with the cache's directory, not the planning level 0) and its plans and
    peaks are keyed apart from the defaults'. A100 80GB: no other test makes its devices with
    a cache."""
    needs_gpu_compiler()
    (tmp_path / "autotune").mkdir()
    plain = targets.resolve_target("a100-80gb")
    cached = targets.resolve_target("a100-80gb", autotune_cache=tmp_path / "autotune")
    first, second = plain.devices(1), cached.devices(1)  # the plain ones first
    assert targets.target_of(first) == plain and targets.target_of(second) == cached
    options = device_options(second, Purpose.GUIDE)
    assert options["xla_gpu_autotune_level"] == 4
    assert options["xla_gpu_per_fusion_autotune_cache_dir"] == str(tmp_path / "autotune")
    assert device_options(first, Purpose.GUIDE)["xla_gpu_autotune_level"] == 0
    assert device_identity(first) != device_identity(second)
    assert (device_identity(second)["described"]["autotune_cache"]
            == str(tmp_path / "autotune"))


def test_the_oldest_compute_capability_ptxas_compiles_for_is_a_target() -> None:
    maxwell = targets.GPUS["h100"].target_config().replace("major: 9 minor: 0",
                                                            "major: 5 minor: 0")
    target = targets.parse_target_config(maxwell, name="sm_50")
    assert target.compute_capability == targets.OLDEST_COMPUTE_CAPABILITY == (5, 0)
    with pytest.raises(ValueError, match=r"compute capability 3\.7 is older than"):
        targets.parse_target_config(maxwell.replace("major: 5 minor: 0", "major: 3 minor: 7"))


def test_a_target_given_with_an_autotuning_cache_takes_it() -> None:
    """`resolve_target` of a `Target` returns it as is, or, given ``autotune_cache``, the same
    GPU with that cache (whose compiles then take the cache's kernels: the options say so)."""
    h100 = targets.resolve_target("h100")
    assert targets.resolve_target(h100) is h100
    cache = Path(__file__).resolve().parent  # any existing folder
    tuned = targets.resolve_target(h100, autotune_cache=cache)
    assert tuned.autotune_cache == str(cache)
    assert (tuned.name, tuned.device_kind, tuned.memory_bytes, tuned.config) == (
        h100.name, h100.device_kind, h100.memory_bytes, h100.config)
    needs_gpu_compiler()  # the options name the CUDA toolkit's folder
    assert tuned.compiler_options["xla_gpu_per_fusion_autotune_cache_dir"] == str(cache)


def test_a_missing_description_file_is_named_as_a_file_without_a_suffix(tmp_path) -> None:
    """A path with a folder in it is meant as a file even without ``.txtpb``: the error says
    it does not exist, not that it is no known GPU's name."""
    missing = str(tmp_path / "descriptions" / "b300")
    with pytest.raises(ValueError, match=rf"target='{re.escape(missing)}' does not exist; "
                       "pass the path of a GpuTargetConfigProto"):
        targets.resolve_target(missing)


def test_a_device_kind_with_quotes_and_backslashes_reads_back_whole() -> None:
    spec = dataclasses.replace(targets.GPUS["h100"], device_kind='Lab "H100" \\ rev. 2')
    text = spec.target_config()
    assert 'device_description_str: "Lab \\"H100\\" \\\\ rev. 2"' in text
    assert targets.parse_target_config(text).device_kind == spec.device_kind


@pytest.mark.parametrize(("before", "after"), [
    (None, targets.PLUGIN_LOG_LEVEL),
    ("1", targets.PLUGIN_LOG_LEVEL),  # what `import jax` sets: JAX's default, not the user's
    ("0", "0"),  # the user asked for the compiler's log
    ("2", "2"),
])
def test_the_compilers_log_is_quieted_only_where_the_user_left_the_level(
        monkeypatch, before, after) -> None:
    if before is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", before)
    targets.quiet_compiler_log()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == after


def test_a_description_without_a_field_of_its_gpu_is_refused_naming_it(tmp_path):
    """XLA's GPU compiler reads every field of ``gpu_device_info``: without
    ``block_dim_limit_x`` the first compile killed the process (SIGFPE, no Python error), and
    without ``shared_memory_per_block_optin`` the same MLP planned 54x the peak. A description
    that lacks any field (or gives it 0) is refused, naming each one; every built-in GPU's
    description has them all."""
    h100 = targets.GPUS["h100"].target_config()
    for gpu in targets.GPUS.values():
        targets.parse_target_config(gpu.target_config())
    assert set(targets.DEVICE_INFO_FIELDS) == set(
        re.findall(r"^  (\w+): ", h100, re.MULTILINE))
    for dropped in (["block_dim_limit_x"], ["fpus_per_core", "clock_rate_ghz"]):
        text = "\n".join(line for line in h100.splitlines()
                         if line.strip().split(":")[0] not in dropped)
        path = tmp_path / f"no_{dropped[0]}.txtpb"
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"gives no positive {', '.join(dropped)}; "
                           r"describe the GPU's own .* with every field of gpu_device_info: "
                           r"threads_per_block_limit, "):
            targets.resolve_target(path)
    slow = tmp_path / "slow_clock.txtpb"
    slow.write_text(h100.replace(f"clock_rate_ghz: {targets.GPUS['h100'].clock_ghz}",
                                 "clock_rate_ghz: 0.5"))
    assert targets.resolve_target(slow).compute_capability == (9, 0)  # a float field read whole


def test_placing_a_plan_for_a_target_says_it_is_for_gpus_not_here() -> None:
    """A plan for a described GPU trains there, not here: `place_train_state` with its
    shardings says so in words, where JAX said "not available with compile-only client"."""
    needs_gpu_compiler()
    from scamp_jax.planning import default_optimizer, place_train_state

    model, sample = small_model()
    plan = plan_mesh(model, sample, devices=2, memory_per_device="64MiB", max_batch_size=64,
                     target="h100")
    with pytest.raises(ValueError, match=r"these shardings are a plan for 2 NVIDIA H100 80GB "
                       r"HBM3 device\(s\) \(target 'h100'\), which this process can only "
                       r"compile for, not place arrays on: train on such GPUs"):
        place_train_state(model, default_optimizer(), plan.step_shardings)
