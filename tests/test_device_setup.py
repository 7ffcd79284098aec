"""Every entry point sets the GPU allocator's policy (its pool preallocated as one region) before
JAX starts its backend.

Each entry point runs in its own process with a spy in place of JAX's backend factory
(``jax._src.xla_bridge.backends``, private: the only way to stop a CPU-only process at the moment a
GPU backend would be created). The spy records the memory variables JAX's GPU client would read
at that moment and ends the process, so nothing trains. The entry points run in parallel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scamp_jax import devices

ROOT = Path(__file__).resolve().parents[1]
_MARK = "BACKEND-ENV "

_SPY = textwrap.dedent(f"""
    import json, os, runpy, sys
    import jax._src.xla_bridge as xb

    def _spy(*args, **kwargs):
        names = {devices.PREALLOCATE_VAR!r}, {devices.MEM_FRACTION_VAR!r}
        print({_MARK!r} + json.dumps({{n: os.environ.get(n) for n in names}}), flush=True)
        os._exit(0)

    xb.backends = _spy
    module, *argv = sys.argv[1:]
    if module.endswith(".py"):
        sys.argv = [module, *argv]
        runpy.run_path(module, run_name="__main__")
    else:
        sys.argv = [module, *argv]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
""")

_RUN_STUDY = textwrap.dedent("""
    import sys
    import numpy as np
    import scamp_jax
    from search_spaces import swinir

    task = scamp_jax.FunctionTask(
        metric="loss", direction="minimize", loss_fn=lambda model, batch: 0.0,
        batches=lambda n, seed: iter(()), evaluate=lambda model: {"loss": 0.0})
    scamp_jax.run_study(swinir.space("small"), task, trials=1, steps=1, study_dir=sys.argv[1])
""")

# (name, argv after the spy, extra environment): argv[0] is a module or a script path.
ENTRY_POINTS = [
    ("swinir_hpo", ["experiments.swinir_hpo", "--preset", "smoke", "--no-live",
                    "--study-dir", "{tmp}/swinir"], {}),
    ("vit_synthetic", ["experiments.vit_synthetic", "--preset", "smoke", "--no-live",
                       "--study-dir", "{tmp}/vit"], {}),
    ("swinir_hpo_mpi_rank", ["experiments.swinir_hpo", "--preset", "smoke", "--no-live",
                             "--study-dir", "{tmp}/mpi"], {"OMPI_COMM_WORLD_SIZE": "2"}),
    ("supernet_nas", ["experiments.supernet_nas", "--preset", "smoke", "--quiet",
                      "--out-dir", "{tmp}/nas"], {}),
    ("run_study", ["{tmp}/run_study.py", "{tmp}/study"], {}),
    ("digits_example", ["examples/digits.py"], {}),
    ("plan_and_train_example", ["examples/plan_and_train.py"], {}),
    ("memory_accuracy", ["benchmarks.memory_accuracy", "--only", "mlp"], {}),
    ("hpo_makespan", ["benchmarks.hpo_makespan", "--out", "{tmp}/makespan"], {}),
    ("fusion", ["benchmarks.fusion"], {}),
    ("fusion_precision", ["benchmarks.fusion_precision", "--ops"], {}),
    ("fusion_profile", ["benchmarks.fusion_profile"], {}),
    ("compiles", ["benchmarks.compiles"], {}),
    ("supernet_pipeline", ["benchmarks.supernet_pipeline"], {}),
    ("eval_memory", ["benchmarks.eval_memory"], {}),
    # The suite's driver starts no backend: each section's process does (here the first one).
    ("gpu_suite", ["benchmarks.gpu_suite", "--section", "environment", "--config", "cpu-smoke",
                   "--deadline", "4e9", "--out", "{tmp}/suite"], {}),
    ("overhead", ["benchmarks.overhead", "--child", "scamp", "--study-dir", "{tmp}/overhead",
                  "--child-out", "{tmp}/overhead.json"], {}),
]


@pytest.fixture(scope="module")
def backend_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """What each entry point's process held when JAX created its backend (stdout, stderr)."""
    tmp = tmp_path_factory.mktemp("entry")
    (tmp / "run_study.py").write_text(_RUN_STUDY)
    env = {k: v for k, v in os.environ.items()
           if k not in (devices.PREALLOCATE_VAR, devices.MEM_FRACTION_VAR,
                        devices.OLD_MEM_FRACTION_VAR)}
    env["PYTHONPATH"] = str(ROOT)
    procs = {}
    for name, argv, extra in ENTRY_POINTS:
        args = [a.format(tmp=tmp) for a in argv]
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", _SPY, *args], cwd=ROOT, env={**env, **extra},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for name, proc in procs.items():
        try:
            results[name] = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            results[name] = proc.communicate()
    return results


@pytest.mark.parametrize("name", [name for name, _, _ in ENTRY_POINTS])
def test_entry_point_preallocates_its_pool(name: str,
                                           backend_env: dict[str, tuple[str, str]]) -> None:
    """XLA_PYTHON_CLIENT_PREALLOCATE is true when the backend starts; with no budget given and
    no GPU to read (no nvidia-smi here), no fraction is forced."""
    out, err = backend_env[name]
    lines = [line for line in out.splitlines() if line.startswith(_MARK)]
    assert lines, f"{name} never started a JAX backend:\n{out[-2000:]}\n{err[-3000:]}"
    seen = json.loads(lines[0][len(_MARK):])
    assert seen == {devices.PREALLOCATE_VAR: "true", devices.MEM_FRACTION_VAR: None}


def test_user_settings_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value in the environment wins; a fraction is set only when asked for and valid."""
    monkeypatch.setenv(devices.PREALLOCATE_VAR, "false")
    monkeypatch.delenv(devices.MEM_FRACTION_VAR, raising=False)
    monkeypatch.delenv(devices.OLD_MEM_FRACTION_VAR, raising=False)
    for name in devices._LOCAL_RANKS_VARS:
        monkeypatch.delenv(name, raising=False)
    assert devices.configure_device_memory() == {devices.PREALLOCATE_VAR: "false"}
    assert devices.configure_device_memory(0.5)[devices.MEM_FRACTION_VAR] == "0.5"
    monkeypatch.delenv(devices.MEM_FRACTION_VAR)
    monkeypatch.setenv(devices.OLD_MEM_FRACTION_VAR, "0.3")
    assert devices.MEM_FRACTION_VAR not in devices.configure_device_memory(0.9)
    with pytest.raises(ValueError, match="must be in"):
        devices.configure_device_memory(1.5)


def test_the_pool_fraction_makes_the_preallocated_pool_the_budget(monkeypatch) -> None:
    """``XLA_CLIENT_MEM_FRACTION`` is the pool over the device's memory (XLA's limit is total
    memory times the fraction): the given budget, or each process's share less what it holds
    outside its pool."""
    from scamp_jax.planning.budget import GPU_OUTSIDE_POOL_BYTES

    total = 143_771 * 2**20  # one H200
    assert devices.pool_fraction(None, 1, total) is None  # one process, no budget: XLA's own
    assert devices.pool_fraction(32 * 2**30, 1, total) == pytest.approx(32 * 2**30 / total)
    two = devices.pool_fraction(None, 2, total)
    assert two == pytest.approx((total // 2 - GPU_OUTSIDE_POOL_BYTES) / total)
    with pytest.raises(ValueError, match="memory_per_device"):
        devices.pool_fraction(80 * 2**30, 2, total)
    # Without a GPU to read, ranks split XLA's default share.
    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda: None)
    assert devices.pool_fraction(None, 4) == pytest.approx(devices.XLA_DEFAULT_FRACTION / 4)
    assert devices.pool_fraction(2**30, 1) is None


def test_ranks_on_one_host_share_its_gpus_unless_each_is_given_one(monkeypatch) -> None:
    for name in (*devices._LOCAL_RANKS_VARS, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.processes_per_gpu() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert devices.processes_per_gpu() == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert devices.processes_per_gpu() == 1


def test_a_process_no_launcher_started_has_the_gpus_of_its_batch_job_to_itself(
        monkeypatch) -> None:
    """``sbatch --ntasks-per-node=4`` sets SLURM_NTASKS_PER_NODE for every process of the
    job: a plain ``python -m experiments.swinir_hpo`` there is still one process per GPU,
    while ranks ``srun`` starts through PMI share them (Slurm's ``4(x2)`` form read too)."""
    for name in (*devices._LOCAL_RANKS_VARS, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                 "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    assert devices.processes_per_gpu() == 1
    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda: 80 * 2**30)
    assert devices.pool_fraction(None, devices.processes_per_gpu()) is None  # XLA's own pool
    monkeypatch.setenv("PMI_SIZE", "8")
    assert devices.processes_per_gpu() == 4
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert devices.processes_per_gpu() == 4


def test_a_training_process_preallocates_the_budget_as_its_pool(monkeypatch) -> None:
    for name in (devices.PREALLOCATE_VAR, devices.MEM_FRACTION_VAR, devices.OLD_MEM_FRACTION_VAR,
                 *devices._LOCAL_RANKS_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda: 80 * 2**30)
    got = devices.configure_device_memory(pool_bytes=20 * 2**30)
    assert got == {devices.PREALLOCATE_VAR: "true", devices.MEM_FRACTION_VAR: "0.25"}


def test_a_cuda_plugin_without_a_driver_stays_quietly_on_the_cpu() -> None:
    """The ``gpu-plan`` extra's CUDA plugin on a machine with no GPU driver: an entry point's
    set-up keeps JAX on the CPU without the plugin's failed start-up check (a traceback on
    stderr), and a ``JAX_PLATFORMS`` the user set is kept."""
    from tests._requirements import fresh_python, without_gpu_driver

    if not devices.cuda_plugin_installed():
        pytest.skip("no CUDA plugin installed (the gpu-plan extra)")
    without_gpu_driver()
    script = ("import os, scamp_jax; scamp_jax.configure_cpu_devices(2); import jax; "
              "print(os.environ.get('JAX_PLATFORMS'), jax.devices()[0].platform, "
              "jax.device_count())")
    proc = fresh_python(script, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cpu", "cpu", "2"]
    assert "plugin configuration error" not in proc.stderr, proc.stderr
    # without the set-up JAX prints the plugin's failed check, which is what it replaces
    bare = fresh_python("import jax; print(jax.devices()[0].platform)", timeout=120)
    assert bare.stdout.split() == ["cpu"]
    assert "plugin configuration error" in bare.stderr
    kept = fresh_python(script, timeout=120, JAX_PLATFORMS="cpu,cuda")
    assert kept.stdout.split()[:1] == ["cpu,cuda"]


def test_the_driver_is_asked_about_the_gpu_cuda_numbers_for_this_process(
        monkeypatch, tmp_path) -> None:
    """``CUDA_VISIBLE_DEVICES=3,1``: this process's GPU 0 is the driver's GPU 3 and its GPU 1
    the driver's 1. With no GPU here, a stand-in ``nvidia-smi`` on PATH records the GPU it is
    asked about and answers as the real one does (a mock: the driver cannot be run here)."""
    import os
    import sys

    asked = tmp_path / "asked"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"open({str(asked)!r}, 'a').write(sys.argv[sys.argv.index('-i') + 1] + '\\n')\n"
        "if any(a.startswith('--query-compute-apps') for a in sys.argv):\n"
        "    print(f'{os.getppid()}, 512')\n"
        "else:\n"
        "    print('81559, 551')\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert devices.gpu_memory_bytes() == (81559 - 551) << 20  # what CUDA counts
    assert devices.process_device_bytes(0) == 512 << 20
    assert devices.process_device_bytes(1) == 512 << 20
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    devices.process_device_bytes(1)
    assert asked.read_text().split() == ["3", "3", "1", "1"]


@pytest.mark.parametrize("reserved", ["unknown field", "[N/A]"])
def test_a_driver_that_does_not_report_its_reserve_gives_the_gpus_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reserved: str,
) -> None:
    """Drivers before ``memory.reserved`` refuse the field (exit status 2); others may answer
    "[N/A]": the GPU's memory is then ``nvidia-smi``'s total (a stand-in ``nvidia-smi``, as
    above)."""
    import os
    import sys

    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "if any(a == '--query-gpu=memory.total,memory.reserved' for a in sys.argv):\n"
        + ("    print('Field \"memory.reserved\" is not a valid field to query.')\n"
           "    sys.exit(2)\n" if reserved == "unknown field" else "    print('32510, [N/A]')\n")
        + "print('32510')\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert devices.gpu_memory_bytes() == 32510 << 20


def test_a_cpu_device_count_that_is_no_whole_number_is_refused_at_the_call(monkeypatch) -> None:
    """A float, bool or string count (read from a config file, argparse without ``type=int``)
    is refused where it is passed, naming the function called; before, it was written into
    ``XLA_FLAGS`` and XLA aborted at JAX's first use with its whole flag list."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    for count in (4.0, 2.5, True, "8"):
        with pytest.raises(TypeError, match=r"configure_for_search\(\) takes a whole number"):
            devices.configure_for_search(count)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"configure_cpu_devices\(\) takes a whole number"):
            devices.configure_cpu_devices(count)  # type: ignore[arg-type]
    assert "XLA_FLAGS" not in os.environ
    with pytest.raises(ValueError, match="at least 1"):
        devices.configure_cpu_devices(0)


def test_a_cpu_device_count_the_user_set_is_kept_and_said() -> None:
    """Before ``jax`` is imported, a count the user set in ``XLA_FLAGS`` is kept, as the
    docstring says, and a warning says it where the call asked for another."""
    from tests._requirements import fresh_python

    script = ("import numpy, scamp_jax; scamp_jax.configure_cpu_devices(numpy.int64(4)); "
              "import jax; print(jax.device_count())")
    proc = fresh_python(script, timeout=120, JAX_PLATFORMS="cpu",
                        XLA_FLAGS="--xla_force_host_platform_device_count=3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3"]
    assert "XLA_FLAGS already sets 3 CPU device(s)" in proc.stderr, proc.stderr
    assert "remove that flag from XLA_FLAGS to use 4" in proc.stderr
    same = fresh_python(script, timeout=120, JAX_PLATFORMS="cpu",
                        XLA_FLAGS="--xla_force_host_platform_device_count=04")
    assert same.stdout.split() == ["4"] and "already sets" not in same.stderr, same.stderr
