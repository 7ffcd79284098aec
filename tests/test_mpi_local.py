"""The MPI layer's single-process parts: batch split, one-device check, the gradient-reduce hook
of the training step, launch command and install hints (no MPI process is started here)."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _requirements import require_module, unavailable
from flax import nnx

from scamp_jax.distributed import mpi as mpi_module
from scamp_jax.distributed.data_parallel import check_one_device, local_batch, one_device_shardings
from scamp_jax.distributed.mpi import MPIUnavailableError, World, mpirun_command, world
from scamp_jax.planning.memory import default_step_shardings
from scamp_jax.planning.sharding import make_mesh
from scamp_jax.planning.train_step import (
    abstract_state,
    make_train_step,
    place_train_state,
    split_model,
)


def _model() -> nnx.Module:
    return nnx.Linear(3, 2, rngs=nnx.Rngs(0))


def _loss(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean(jnp.square(model(x) - y))


def test_local_batch_gives_each_rank_a_contiguous_equal_share():
    x = np.arange(12).reshape(6, 2)
    y = np.arange(6)
    parts = [local_batch((x, y), r, 3) for r in range(3)]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
    np.testing.assert_array_equal(parts[1][1], [2, 3])


def test_local_batch_rejects_a_batch_that_does_not_split_and_names_a_fix():
    with pytest.raises(ValueError, match=r"global batch 7 is not a multiple of the 2 ranks.*8"):
        local_batch(np.zeros((7, 1)), 0, 2)


def test_data_parallel_step_refuses_a_mesh_of_several_devices():
    model, tx = _model(), optax.sgd(0.1)
    mesh = make_mesh(jax.devices()[:2], 2, 1)
    params, opt_state, rest = abstract_state(model, tx)
    shardings = default_step_shardings(mesh, params, opt_state, rest, tx)
    with pytest.raises(ValueError, match="one device per rank, got a mesh of 2"):
        check_one_device(shardings)
    check_one_device(one_device_shardings(model, tx))


def test_grad_reduce_hook_changes_the_update_and_default_is_unchanged():
    model, tx = _model(), optax.sgd(0.5)
    shardings = one_device_shardings(model, tx)
    batch = (jnp.ones((4, 3)), jnp.zeros((4, 2)))
    graphdef = split_model(model)[0]
    results = {}
    for name, reduce in (("none", None), ("half", lambda t: jax.tree.map(lambda a: a / 2, t))):
        _, params, opt_state, rest = place_train_state(model, tx, shardings)
        before = jax.tree.map(np.asarray, params)
        step = jax.jit(make_train_step(graphdef, tx, _loss, grad_reduce=reduce))
        after, _, _, loss = step(params, opt_state, rest, batch)
        delta = jax.tree.map(lambda a, b: np.asarray(a) - b, after, before)
        results[name] = (float(loss), delta)
    # The hook sees (grads, loss): halving both halves the SGD step and the reported loss.
    assert results["half"][0] == pytest.approx(results["none"][0] / 2, rel=1e-6)
    for a, b in zip(jax.tree.leaves(results["half"][1]), jax.tree.leaves(results["none"][1]),
                    strict=True):
        np.testing.assert_allclose(a, b / 2, rtol=1e-6)
        assert np.abs(b).max() > 0


def test_the_reduction_of_a_narrow_float_is_booked_as_the_float32_it_runs_in():
    from scamp_jax.distributed.data_parallel import mpi_mean_bytes, reduced_dtype

    assert reduced_dtype(jnp.bfloat16) == reduced_dtype(jnp.float16) == jnp.float32
    assert reduced_dtype(jnp.float64) == jnp.float64 and reduced_dtype(jnp.int8) == jnp.int8
    tree = (jax.ShapeDtypeStruct((10,), jnp.bfloat16), jax.ShapeDtypeStruct((5,), jnp.float32))
    assert mpi_mean_bytes(tree) == 2 * (10 * 4 + 5 * 4)


def test_world_without_a_launcher_is_one_rank_and_imports_no_mpi(monkeypatch):
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert world() == World(rank=0, size=1, comm=None)
    code = ("import sys, scamp_jax.distributed as d; d.world(); "
            "assert 'mpi4py' not in sys.modules and 'mpi4jax' not in sys.modules")
    # An explicit environment: once mpi4py has initialised MPI in this process (another test
    # file may have), MPI's own variables sit in the C-level environment a child would inherit.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


def test_missing_mpi4jax_raises_an_install_hint(monkeypatch):
    real_import = builtins.__import__

    def no_mpi4jax(name, *args, **kwargs):
        if name == "mpi4jax":
            raise ImportError("No module named 'mpi4jax'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "mpi4jax", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_mpi4jax)
    with pytest.raises(MPIUnavailableError, match=r"pip install 'scamp-jax\[mpi\]'"):
        mpi_module.import_mpi4jax()


# Prints the warnings that mention mpi4jax while it is imported: "plain" (import mpi4jax),
# "library" (import_mpi4jax) or "untested" (import_mpi4jax with no JAX release tested here).
_IMPORT_WARNINGS = """
import json, sys, warnings
from scamp_jax.distributed import mpi
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    if sys.argv[1] == "plain":
        import mpi4jax
    else:
        if sys.argv[1] == "untested":
            mpi.MPI_TESTED_JAX = (-1, 0)
        mpi.import_mpi4jax()
import os
assert "MPI4JAX_NO_WARN_JAX_VERSION" not in os.environ  # mpi4jax's switch set for its import only
print(json.dumps([str(w.message) for w in seen if "mpi4jax" in str(w.message)]))
"""


def test_mpi4jax_warns_about_the_jax_release_only_past_the_ones_tested_here():
    require_module("mpi4py", "the mpi extra is not installed: pip install .[mpi]")
    try:
        mpi_module.import_mpi4jax()
    except MPIUnavailableError:
        unavailable("the mpi extra is not installed: pip install .[mpi]")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.pop("MPI4JAX_NO_WARN_JAX_VERSION", None)

    def warnings_of(mode: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", _IMPORT_WARNINGS, mode], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.splitlines()[-1])

    plain = warnings_of("plain")
    tested = tuple(jax.__version_info__[:2]) <= mpi_module.MPI_TESTED_JAX
    assert warnings_of("library") == ([] if tested else plain)
    # Past the tested releases the library hides nothing: what mpi4jax says, the user sees.
    assert warnings_of("untested") == plain


def test_mpirun_command_names_the_missing_launcher():
    with pytest.raises(MPIUnavailableError, match="'no-such-mpirun' is not on PATH"):
        mpirun_command(2, launcher="no-such-mpirun")
    with pytest.raises(ValueError, match="ranks=0"):
        mpirun_command(0)


def test_supernet_experiment_mpi_flag_without_a_launcher_says_how_to_launch():
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.supernet_nas", "--mpi", "--preset", "smoke"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode != 0
    assert "mpirun -n 4 python -m experiments.supernet_nas --mpi" in proc.stderr


def test_a_child_of_a_process_that_initialised_mpi_alone_is_not_a_launched_rank():
    # A process that imports mpi4py without a launcher is an MPI singleton, and leaves PMIx
    # variables (PMIX_RANK among them) in the environment its children inherit; a child that
    # read them as a launch would refuse single-process flags or wait for ranks that never come.
    pytest.importorskip("mpi4py")
    child = ("from scamp_jax.distributed.mpi import launcher_ranks, launched_under_mpi; "
             "print(launcher_ranks(), launched_under_mpi())")
    parent = ("import subprocess, sys; from mpi4py import MPI; assert MPI.COMM_WORLD.size == 1; "
              f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, "
              "text=True, check=True).stdout.strip())")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                         timeout=120, env=env, check=True).stdout
    assert out.strip().splitlines()[-1] == "None False"
