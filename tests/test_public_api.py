"""The public surface: `scamp_jax` exports the names a user calls (at most 25), every other
public name lives in a subpackage's ``__all__``, and ``import scamp_jax`` stays light."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import scamp_jax

EXPECTED = {
    # a whole study, and what it returns
    "run_study", "run_search", "SearchSettings", "SearchSpace", "Task", "FunctionTask",
    "ChunkedEvalTask", "open_study", "load_model", "replay_study", "BudgetTooSmallError",
    "StudySettingsError", "RepeatedFailureError",
    # planning one trial
    "plan_mesh", "Plan", "DoesNotFitError", "PlanCache", "estimate_memory", "MemoryEstimate",
    # devices and sizes
    "configure_for_search", "configure_cpu_devices", "configure_device_memory", "parse_bytes",
    "format_bytes",
    # neural architecture search
    "train_supernet",
}
SUBPACKAGES = ("planning", "scheduling", "hpo", "sim", "pipeline", "distributed")


def test_all_lists_exactly_the_names_a_user_calls() -> None:
    assert set(scamp_jax.__all__) == EXPECTED
    assert len(scamp_jax.__all__) == len(set(scamp_jax.__all__)) <= 25


@pytest.mark.parametrize("package", ["scamp_jax", *(f"scamp_jax.{p}" for p in SUBPACKAGES)])
def test_every_public_name_resolves_and_is_documented(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__all__ == sorted(set(module.__all__)), package
    for name in module.__all__:
        obj = getattr(module, name)
        assert obj.__doc__, f"{package}.{name} has no docstring"
        assert name in dir(module)
    with pytest.raises(AttributeError, match=f"module {package!r} has no attribute 'nope'"):
        module.nope  # noqa: B018


def test_subpackages_are_attributes_of_the_package() -> None:
    for name in SUBPACKAGES:
        assert getattr(scamp_jax, name).__name__ == f"scamp_jax.{name}"


def test_importing_the_package_imports_no_heavy_dependency() -> None:
    """``import scamp_jax`` reads no JAX, Optuna, orbax or matplotlib: names load on use."""
    code = ("import sys, scamp_jax; "
            "print(sorted(m for m in ('jax', 'flax', 'optuna', 'orbax', 'matplotlib', 'rich') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_warm_imports_a_later_module_in_the_background_and_leaves_failures_to_its_user(
        tmp_path, monkeypatch):
    import sys

    from scamp_jax._lazy import warm

    (tmp_path / "later_needed.py").write_text("VALUE = 7\n")
    (tmp_path / "broken_later.py").write_text("raise RuntimeError('broken on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    thread = warm(["broken_later", "later_needed"])
    assert thread is not None
    thread.join(timeout=30)
    assert sys.modules["later_needed"].VALUE == 7
    assert "broken_later" not in sys.modules
    assert warm(["later_needed"]) is None  # imported already: no thread
    with pytest.raises(RuntimeError, match="broken on import"):
        __import__("broken_later")
    sys.modules.pop("later_needed", None)
