"""Promises that only a GPU can check. Marked ``gpu``: the default run deselects them, and they
skip where JAX sees no GPU. Run on a GPU machine with::

    JAX_PLATFORMS=cuda python -m pytest -m gpu tests/test_gpu.py

(``tests/conftest.py`` defaults ``JAX_PLATFORMS`` to ``cpu``.) Memory figures come from fresh
processes (the allocator's peak counter cannot be reset), and the bitwise comparisons run in a
process that asked for deterministic XLA kernels before JAX started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from benchmarks import gpu_suite

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_a_gpu() -> None:
    # Asked when a test runs, not at collection: collecting must not start JAX's backend.
    if jax.devices()[0].platform != "gpu":
        pytest.skip("needs a CUDA GPU (run with JAX_PLATFORMS=cuda pytest -m gpu)")


#: Booked bytes may exceed the measured peak by at most this fraction of it (the ledger's
#: accuracy target: a booking far above what a trial holds wastes the device).
BOOKED_OVER_MEASURED = 0.02
#: The memory cases and the budgets the GPU suite measures them at (the allocator capped there).
MEMORY_CASES = [(c.name, c.gpu_budget) for c in gpu_suite.GPU.memory_cases
                if not c.fuse and not c.gpu_min_minutes]


def _python(code: str, timeout: float = 900) -> dict:
    """Run ``code`` in a fresh process (deterministic GPU kernels, the pool preallocated); the last
    line it prints is JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("JAX_PLATFORMS", None)
    prelude = ("from scamp_jax.pipeline.determinism import use_deterministic_gpu_ops\n"
               "use_deterministic_gpu_ops()\n"
               "import scamp_jax; scamp_jax.configure_device_memory()\n")
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _capped_row(name: str, budget: str) -> dict:
    """`measure_in_child` with the child's allocator capped at ``budget`` by the library's
    policy (the pool taken up front, `benchmarks.gpu_sections.preallocate_policy`), its
    planner's budget read from that allocator."""
    from benchmarks.gpu_sections import allocator_fraction, preallocate_policy
    from benchmarks.memory_accuracy import measure_in_child
    from scamp_jax import devices
    from scamp_jax._units import parse_bytes

    stats = devices.allocator_stats(jax.devices()[0])
    assert stats and "bytes_limit" in stats, stats
    device_bytes = int(stats["bytes_limit"] / allocator_fraction())
    return measure_in_child(name, 1, None,
                            allocator_env=preallocate_policy(parse_bytes(budget),
                                                             device_bytes))


@pytest.mark.parametrize(("name", "budget"), MEMORY_CASES)
def test_the_planned_batch_runs_with_the_allocator_capped_at_the_budget(name: str,
                                                                         budget: str) -> None:
    """The ledger's promise: the planner's budget is the allocator's limit, the planned batch
    runs under that cap, and what is booked covers the allocator's measured peak."""
    row = _capped_row(name, budget)
    assert not row["oom"], row
    assert row["budget"] == row["bytes_limit"], row
    assert row["booked"] >= row["peak_in_use"], row
    assert row["booked"] - row["peak_in_use"] <= BOOKED_OVER_MEASURED * row["peak_in_use"], row


def test_a_packed_study_on_one_gpu_runs_without_running_out_of_memory(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.swinir_hpo", "--preset", "smoke", "--devices", "1",
         "--trials", "6", "--steps", "20", "--no-live", "--study-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert len(trials) == 6
    for trial in trials:
        assert trial["state"] == "complete", trial
        assert "memory" not in (trial.get("reason") or "").lower(), trial


def test_fused_members_first_steps_equal_their_solo_runs() -> None:
    """Fused training is the same training: every member's first loss equals its solo run's
    within 1e-6 relative (later steps part ways as any two runs a last bit apart do:
    `benchmarks.fusion_precision`)."""
    report = _python("""
        import json
        from benchmarks import fusion
        r = fusion.run("swinir", 2, steps=3, batch=8, repeats=1, ray=False, concurrent=False,
                       wide=False)
        print(json.dumps([m["first_step_rel_diff"] for m in r["members"]]))
    """)
    assert max(report) <= 1e-6, report


def test_csp_equals_sequential_bitwise_with_deterministic_ops() -> None:
    got = _python("""
        import json, jax
        from benchmarks.supernet_pipeline import measure_schedules
        stages = min(4, len(jax.devices()))
        r = measure_schedules(4, stages, 16, schedules=("csp", "sequential"))["results"]
        print(json.dumps({k: v.params_sha256 for k, v in r.items()}))
    """)
    assert got["csp"] == got["sequential"]


@pytest.mark.parametrize("offload", [True, False])
def test_offload_keeps_the_supernet_off_the_device(offload: bool) -> None:
    """With offload the device's peak stays below the supernet's bytes; without, it holds them."""
    got = _python(f"""
        import json
        import numpy as np
        from scamp_jax.devices import peak_bytes_in_use
        from scamp_jax.pipeline import train_supernet
        from search_spaces.supernet import SupernetConfig, SupernetLayout, sample_subnets

        config = SupernetConfig(8, 24, 64, scale=2, window_size=4)
        chosen = [x.choices for x in sample_subnets(6, config, 0)]
        rng = np.random.default_rng(0)
        lr = rng.random((6, 4, 8, 8, 3), dtype=np.float32)
        hr = rng.random((6, 4, 16, 16, 3), dtype=np.float32)
        r = train_supernet(SupernetLayout(config), chosen, lr, hr, schedule="csp",
                           num_stages=1, offload={offload})
        print(json.dumps({{"peak": peak_bytes_in_use(), "supernet": r.supernet_param_bytes,
                          "device": r.device_param_bytes}}))
    """)
    if offload:
        assert got["device"] < got["supernet"]
        assert got["peak"] < got["supernet"], got
    else:
        assert got["peak"] >= got["supernet"], got
