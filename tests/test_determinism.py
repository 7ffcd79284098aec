"""The deterministic-ops flag is set for GPU backends only, and never over the user's value."""

from __future__ import annotations

from scamp_jax.pipeline import determinism


def test_flag_set_only_with_a_gpu_backend(monkeypatch) -> None:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(determinism, "gpu_backend_installed", lambda: False)
    assert not determinism.use_deterministic_gpu_ops()
    assert "XLA_FLAGS" not in __import__("os").environ
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.setattr(determinism, "gpu_backend_installed", lambda: True)
    assert determinism.use_deterministic_gpu_ops()
    assert __import__("os").environ["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=4 --xla_gpu_deterministic_ops=true"
    )


def test_the_users_value_is_kept(monkeypatch) -> None:
    monkeypatch.setattr(determinism, "gpu_backend_installed", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert not determinism.use_deterministic_gpu_ops()
    assert __import__("os").environ["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"


def test_the_users_value_is_read_as_xla_reads_it(monkeypatch) -> None:
    """A bare boolean flag is true in XLA, so are ``True`` and ``1``; the last one wins."""
    monkeypatch.setattr(determinism, "gpu_backend_installed", lambda: True)
    for flags, on in [("--xla_gpu_deterministic_ops", True),
                      ("--xla_gpu_deterministic_ops=True --xla_foo=1", True),
                      ("--xla_gpu_deterministic_ops=1", True),
                      ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false",
                       False)]:
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert determinism.use_deterministic_gpu_ops() is on, flags
        assert __import__("os").environ["XLA_FLAGS"] == flags  # kept as the user wrote it


def test_cpu_only_platforms_are_not_gpu(monkeypatch) -> None:
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not determinism.gpu_backend_installed()


# A small convolutional training step whose gradient XLA's CPU convolutions split by the size
# of the process's worker pool; prints the hash of its loss and gradients.
_CONV_STEP = """
import hashlib, sys
from scamp_jax.pipeline.determinism import use_fixed_cpu_threads
if sys.argv[1] != "none":
    use_fixed_cpu_threads(int(sys.argv[1]))
from scamp_jax.devices import configure_cpu_devices
configure_cpu_devices(int(sys.argv[2]))
import jax, jax.numpy as jnp, numpy as np

def loss(w, x):
    for _ in range(3):
        y = jax.nn.gelu(x, approximate=False)
        x = x + jax.lax.conv_general_dilated(y, w, (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.mean(jnp.abs(x))

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((2, 12, 12, 16), np.float32))
w = jnp.asarray(rng.standard_normal((5, 5, 16, 16), np.float32) * 0.05)
value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, x)
print(hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in (value, *grads))).hexdigest())
"""


def _conv_step_hash(cores: int, threads: str, devices: int) -> str:
    """The step's hash in a fresh process whose host XLA takes for ``cores`` CPUs (``NPROC``,
    the variable XLA reads before counting the CPUs), pool pinned to ``threads`` or not."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", determinism.CPU_THREADS_VARIABLE)}
    env.update(NPROC=str(cores), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", _CONV_STEP, threads, str(devices)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[-1]


def test_a_fixed_cpu_pool_trains_to_the_same_bits_on_any_cores_and_devices() -> None:
    """A host of 2 CPUs and one of 8 (as XLA counts them) round the convolutions' gradients
    differently; with the pool's size fixed, every host and device count (up to that size)
    computes the same bits."""
    import pytest

    two, eight = _conv_step_hash(2, "none", 1), _conv_step_hash(8, "none", 1)
    if two == eight:
        pytest.skip("this XLA's CPU convolutions round alike at pools of 2 and 8 threads")
    pinned = {_conv_step_hash(cores, "16", devices) for cores, devices in
              ((1, 1), (2, 8), (8, 1), (32, 16))}
    assert len(pinned) == 1, pinned


# Pins the pool to 8, then asks for 16, printing each answer and the variable after it; with
# "late", once JAX has created its backends (its pool sized already).
_POOL = """
import os, sys
from scamp_jax.pipeline.determinism import use_fixed_cpu_threads
if sys.argv[1] == "late":
    import jax
    jax.devices()
for threads in (8, 16):
    print(use_fixed_cpu_threads(threads), os.environ.get("PJRT_NPROC"))
"""


def _pool(when: str) -> list[str]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", determinism.CPU_THREADS_VARIABLE)}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", _POOL, when], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_a_users_cpu_pool_size_is_kept() -> None:
    assert _pool("early") == ["True 8", "False 8"]  # set already: kept


def test_a_cpu_pool_asked_for_once_jax_started_is_said_not_to_have_that_size() -> None:
    # the pool was sized when the backends were created: setting the variable then changes
    # nothing, and the call said True as if it had
    assert _pool("late") == ["False None", "False None"]
