"""What a later plan without the GPU needs to know about it, written next to the suite's results.

`record_environment(dir)` writes into ``dir``:

- ``environment.json``: Python and package versions, JAX's devices and their attributes, the
  XLA and JAX variables in force, and the names of the files below;
- ``nvidia-smi.txt``: ``nvidia-smi`` and a CSV of the GPU's name, memory (MiB), driver,
  compute capability and clocks (MHz), and one of its total and reserved memory (MiB);
- ``target_config.txtpb``: XLA's description of the GPU as a compile target
  (``xla_client.get_topology_for_devices(jax.devices()).target_config``, a
  ``GpuTargetConfigProto`` in text form), what ``--xla_gpu_target_config_filename`` and
  ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`` take to
  compile for this GPU on a machine without one;
- ``topology.pb``: the devices' serialized PJRT topology (``TopologyDescription.serialize``);
- ``jax_environment.txt``: ``jax.print_environment_info``.

CPU devices have no target description: the JSON says so.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

#: Distributions whose versions are recorded (those not installed are left out).
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint", "chex", "numpy",
            "optuna", "sqlalchemy", "scikit-image", "scikit-learn", "matplotlib", "rich",
            "pytest", "mpi4jax")
_SMI_QUERY = ("name,memory.total,driver_version,compute_cap,clocks.max.sm,clocks.max.mem,"
              "power.limit,pci.bus_id")


def package_versions() -> dict[str, str]:
    """``name -> version`` of the installed `PACKAGES`."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    parts = []
    # the reserve apart (a driver without the field refuses the whole query): with XLA's
    # description of the GPU it checks `scamp_jax.devices.gpu_memory_bytes`'s total
    for args in ([], [f"--query-gpu={_SMI_QUERY}", "--format=csv"],
                 ["--query-gpu=memory.total,memory.reserved", "--format=csv"]):
        try:
            proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                                  timeout=60)
            parts.append(proc.stdout + proc.stderr)
        except (OSError, subprocess.SubprocessError) as err:
            parts.append(f"nvidia-smi {' '.join(args)}: {err}\n")
    return "\n".join(parts)


def _device_attributes(device: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"id": device.id, "platform": device.platform,
                           "device_kind": str(device.device_kind)}
    for name in ("compute_capability", "core_count", "local_hardware_id"):
        try:
            value = getattr(device, name)
        except (AttributeError, RuntimeError):
            continue
        out[name] = value if isinstance(value, int | float | str) else str(value)
    return out


def target_description(directory: Path) -> dict[str, Any]:
    """Write the devices' XLA target description and topology into ``directory``; returns
    what was written (file names) or why not."""
    import jax
    from jax._src.lib import xla_client
    from jax.experimental import topologies

    out: dict[str, Any] = {}
    try:
        topology = xla_client.get_topology_for_devices(jax.devices())
    except Exception as err:  # noqa: BLE001 - recorded: a later plan needs to know it failed
        return {"error": f"get_topology_for_devices: {type(err).__name__}: {err}"}
    out["topology_platform"] = topology.platform
    out["topology_platform_version"] = topology.platform_version
    try:
        config = topology.target_config
    except AttributeError as err:
        out["target_config"] = None
        out["target_config_reason"] = (f"{jax.devices()[0].platform} devices describe no XLA "
                                       f"target ({err})")
    else:
        data = config.encode() if isinstance(config, str) else bytes(config)
        (directory / "target_config.txtpb").write_bytes(data)
        out["target_config"] = "target_config.txtpb"
        out["target_config_bytes"] = len(data)
    try:
        (directory / "topology.pb").write_bytes(topologies.get_attached_topology().serialize())
        out["topology"] = "topology.pb"
    except Exception as err:  # noqa: BLE001 - recorded
        out["topology_error"] = f"{type(err).__name__}: {err}"
    return out


def record_environment(directory: Path) -> dict[str, Any]:
    """Write the files of the module docstring into ``directory``; returns the JSON's content."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    devices = jax.devices()
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "machine": platform.machine(),
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "packages": package_versions(),
        "devices": [_device_attributes(d) for d in devices],
        "backend_platform_version": devices[0].client.platform_version,
        "variables": {k: v for k, v in sorted(os.environ.items())
                      if k.startswith(("XLA_", "JAX_", "CUDA_", "TF_CPP_", "NCCL_"))},
    }
    smi = _nvidia_smi()
    if smi is not None:
        (directory / "nvidia-smi.txt").write_text(smi)
        env["nvidia_smi"] = "nvidia-smi.txt"
    env.update(target_description(directory))
    info = jax.print_environment_info(return_string=True)
    (directory / "jax_environment.txt").write_text(info or "")
    (directory / "environment.json").write_text(json.dumps(env, indent=1, default=str))
    return env


if __name__ == "__main__":
    raise SystemExit("benchmarks.gpu_env is a part of the GPU suite, not a command: run "
                     "python -m benchmarks.gpu_suite --help")
