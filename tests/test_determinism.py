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


def test_cpu_only_platforms_are_not_gpu(monkeypatch) -> None:
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not determinism.gpu_backend_installed()
