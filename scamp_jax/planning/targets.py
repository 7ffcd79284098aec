"""GPU targets: compile a training step for a GPU this machine does not have.

XLA's GPU compiler compiles for any GPU it is given a description of: a ``GpuTargetConfigProto``
in text form (compute capability, SM count, memory size and bandwidth, caches, registers,
clock). JAX's CUDA plugin turns such a description into compile-only devices
(``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=TEXT,
topology="1x1xN")``); a step lowered on a mesh over them compiles with no GPU and no driver,
and ``memory_analysis()`` of the result holds the figures the planner books. `Target` wraps
one description: its compile-only devices (`Target.devices`), the options its compiles add
(`Target.compiler_options`, through `scamp_jax.planning.compile_options.device_options`), the
device's total memory in bytes and its device kind as JAX reports it on the real GPU, from
which `scamp_jax.planning.budget.Budget.of_devices` makes the budget of its devices.

Targets come by name (`TARGETS`: descriptions generated here from NVIDIA's published figures,
`GpuSpec`) or from a description file, such as the one JAX reports on a real GPU::

    from jax._src.lib import xla_client
    text = xla_client.get_topology_for_devices(jax.devices()).target_config

What differs from a compile on the GPU itself: there XLA's autotuner times candidate kernels
(Triton tilings, split-K, cuBLAS or cuDNN algorithms) and keeps the fastest; without a GPU
every fusion gets XLA's default configuration. The kernel choice changes the temporaries
(split-K partial sums and padded copies, workspaces), so a compiled peak can differ from the
GPU's own: by under 1% for the small SwinIR, 3% for the ViT, 10-31% for an MLP that is all
matrix products (``benchmarks/notes/targets.md``). An autotuning cache written on a GPU of the
same description (XLA's ``xla_gpu_per_fusion_autotune_cache_dir``) makes the compile take the
GPU's choices instead (``autotune_cache=``).

Requirements (the ``gpu-plan`` extra, ``pip install 'scamp-jax[gpu-plan]'``): JAX's CUDA plugin
(``jax[cuda13-local]``: ``jax-cuda13-plugin`` and ``jax-cuda13-pjrt``) and the CUDA 12.9
compiler wheel ``nvidia-cuda-nvcc-cu12``, whose ``ptxas`` (compute capability 5.0 to 12.0)
and ``libdevice`` the compile needs; no driver, CUDA runtime, cuBLAS or cuDNN. The plugin is
loaded on the first `Target.devices` call: importing this module, or planning on CPU devices,
touches nothing of it. Without a GPU the plugin's compiler logs an ERROR with a fusion's whole
HLO wherever a product has no default kernel (the compile then takes cuBLAS kernels:
`scamp_jax.planning.reuse.compile_lowered`); `quiet_compiler_log`, called before JAX starts
(``--plan-only --target`` does), keeps those lines off the terminal.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: How to install what a GPU target needs.
INSTALL_HINT = "pip install 'scamp-jax[gpu-plan]'"
#: cuDNN version the named targets describe (what ``jax[cuda13]`` installs: cuDNN 9.12 or
#: later): XLA picks convolution rewrites by it, and it is part of an autotuning cache's key.
DNN_VERSION = (9, 12, 0)
#: CUDA runtime version the named targets describe (the CUDA 13 plugin's).
RUNTIME_VERSION = (13, 0, 0)


class GpuCompilerMissingError(ImportError):
    """The GPU compiler a target needs (JAX's CUDA plugin, ptxas, libdevice) is not installed."""


@dataclass(frozen=True)
class GpuSpec:
    """Published figures of one NVIDIA GPU model, enough for XLA to compile for it.

    Attributes:
      device_kind: the device kind JAX reports on the real GPU (``jax.devices()[0]
        .device_kind``), e.g. ``"NVIDIA H100 80GB HBM3"``.
      compute_capability: (major, minor), e.g. (9, 0).
      sm_count: streaming multiprocessors.
      memory_bytes: total device memory as CUDA reports it (the ``device_memory_size`` of
        XLA's description of the real GPU, and the total XLA's pool fraction multiplies), bytes:
        ``nvidia-smi``'s total less what the driver and firmware reserve.
      memory_bandwidth: peak memory bandwidth, bytes per second.
      l2_cache_bytes: L2 cache, bytes.
      shared_memory_per_sm: shared memory per SM, bytes.
      shared_memory_per_block_optin: the most shared memory one block may opt in to, bytes.
      fp32_cores_per_sm: FP32 lanes per SM.
      clock_ghz: boost clock, GHz.
      registers_per_sm, registers_per_block: 32-bit registers.
      threads_per_sm: resident threads per SM.
    """

    device_kind: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    memory_bandwidth: int
    l2_cache_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    fp32_cores_per_sm: int
    clock_ghz: float
    registers_per_sm: int = 65536
    registers_per_block: int = 65536
    threads_per_sm: int = 2048

    def target_config(self) -> str:
        """This GPU as a ``GpuTargetConfigProto`` in text form (what the CUDA plugin takes)."""
        major, minor = self.compute_capability
        info = {
            "threads_per_block_limit": 1024,
            "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024,  # without opt-in, every CUDA GPU since sm_20
            "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
            "shared_memory_per_core": self.shared_memory_per_sm,
            "threads_per_core_limit": self.threads_per_sm,
            "core_count": self.sm_count,
            "fpus_per_core": self.fp32_cores_per_sm,
            "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535,
            "memory_bandwidth": self.memory_bandwidth,
            "l2_cache_size": self.l2_cache_bytes,
            "clock_rate_ghz": self.clock_ghz,
            "device_memory_size": self.memory_bytes,
            "registers_per_core_limit": self.registers_per_sm,
            "registers_per_block_limit": self.registers_per_block,
        }
        lines = ["gpu_device_info {",
                 f"  cuda_compute_capability {{ major: {major} minor: {minor} }}"]
        lines += [f"  {name}: {value}" for name, value in info.items()]
        lines += ["}", 'platform_name: "CUDA"',
                  "dnn_version_info {{ major: {} minor: {} patch: {} }}".format(*DNN_VERSION),
                  "runtime_version {{ major: {} minor: {} patch: {} }}".format(*RUNTIME_VERSION),
                  f"device_description_str: {_quote(self.device_kind)}"]
        return "\n".join(lines) + "\n"


#: The fields of ``gpu_device_info`` a description gives (as a GPU's own does, and
#: `GpuSpec.target_config`), each positive: XLA's GPU compiler reads them all.
DEVICE_INFO_FIELDS = (
    "threads_per_block_limit", "threads_per_warp", "shared_memory_per_block",
    "shared_memory_per_block_optin", "shared_memory_per_core", "threads_per_core_limit",
    "core_count", "fpus_per_core", "block_dim_limit_x", "block_dim_limit_y",
    "block_dim_limit_z", "memory_bandwidth", "l2_cache_size", "clock_rate_ghz",
    "device_memory_size", "registers_per_core_limit", "registers_per_block_limit")

_KIB, _MIB, _GB = 1024, 1024 * 1024, 10**9
#: GPUs by name, from NVIDIA's data sheets and CUDA programming guide (per compute capability:
#: shared memory, registers, threads per SM). ``memory_bytes`` is CUDA's total, which depends a
#: little on the driver (what it reserves): the smallest seen in descriptions recorded on real
#: GPUs (XLA and JAX projects' target configurations; 84,929,347,584 to 84,978,434,048 bytes for
#: the H100), for the H200 the one measured (``../shared/gpu/2026-11-27-h200/``: XLA's pool at
#: fraction 0.3 was 45,034,242,048 bytes of 150,114,140,160, where ``nvidia-smi`` gives
#: 150,754,820,096), for the A100 80GB the total a PyTorch process reported. Planning with
#: ``nvidia-smi``'s total instead booked a default pool 460 MiB above the H200's real one.
GPUS: dict[str, GpuSpec] = {
    "v100": GpuSpec("Tesla V100-SXM2-32GB", (7, 0), sm_count=80, memory_bytes=34_072_559_616,
                    memory_bandwidth=900 * _GB, l2_cache_bytes=6 * _MIB,
                    shared_memory_per_sm=96 * _KIB, shared_memory_per_block_optin=96 * _KIB,
                    fp32_cores_per_sm=64, clock_ghz=1.53),
    "a100-40gb": GpuSpec("NVIDIA A100-SXM4-40GB", (8, 0), sm_count=108,
                         memory_bytes=42_331_013_120, memory_bandwidth=1555 * _GB,
                         l2_cache_bytes=40 * _MIB, shared_memory_per_sm=164 * _KIB,
                         shared_memory_per_block_optin=163 * _KIB, fp32_cores_per_sm=64,
                         clock_ghz=1.41),
    "a100-80gb": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), sm_count=108,
                         memory_bytes=85_056_798_720, memory_bandwidth=2039 * _GB,
                         l2_cache_bytes=40 * _MIB, shared_memory_per_sm=164 * _KIB,
                         shared_memory_per_block_optin=163 * _KIB, fp32_cores_per_sm=64,
                         clock_ghz=1.41),
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), sm_count=132, memory_bytes=84_929_347_584,
                    memory_bandwidth=3352 * _GB, l2_cache_bytes=50 * _MIB,
                    shared_memory_per_sm=228 * _KIB, shared_memory_per_block_optin=227 * _KIB,
                    fp32_cores_per_sm=128, clock_ghz=1.98),
    "h200": GpuSpec("NVIDIA H200", (9, 0), sm_count=132, memory_bytes=150_114_140_160,
                    memory_bandwidth=4800 * _GB, l2_cache_bytes=50 * _MIB,
                    shared_memory_per_sm=228 * _KIB, shared_memory_per_block_optin=227 * _KIB,
                    fp32_cores_per_sm=128, clock_ghz=1.98),
}
#: The names `resolve_target` accepts.
TARGETS = tuple(sorted(GPUS))


#: XLA options of a target's compiles for code generation without optimisation (`Target`).
UNOPTIMISED_CODE: dict[str, Any] = {"xla_backend_optimization_level": 0,
                                    "xla_gpu_disable_gpuasm_optimizations": True}


@dataclass(frozen=True)
class Target:
    """A GPU described, not present: what plans for it compile with.

    Attributes:
      name: the target's name (a `TARGETS` key, or the description file's path).
      device_kind: the device kind JAX reports on such a GPU (the compile-only devices report
        it too), e.g. ``"NVIDIA H100 80GB HBM3"``.
      memory_bytes: the GPU's total memory, bytes.
      compute_capability: (major, minor).
      config: the description, a ``GpuTargetConfigProto`` in text form.
      autotune_cache: a directory of XLA's per-fusion autotuning results recorded on a GPU of
        this description (``xla_gpu_per_fusion_autotune_cache_dir`` of a compile there): the
        compile takes that GPU's kernel choices instead of XLA's defaults. None: defaults.
    """

    name: str
    device_kind: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    config: str = field(repr=False)
    autotune_cache: str | None = None

    @property
    def compiler_options(self) -> dict[str, Any]:
        """XLA options of every compile for this target (on top of a GPU's planning options).

        Autotuning off (level 0: a GPU machine would otherwise time kernels on its own GPU,
        which may be another kind; without a GPU XLA takes default kernels anyway, and level 0
        spares it compiling a default for every other fusion), ptxas and libdevice from the
        ``nvidia-cuda-nvcc-cu12`` wheel, and an error instead of the driver-compilation
        fallback when ptxas cannot compile for the target (with no driver that fallback
        crashes the process). With ``autotune_cache``: XLA's default level 4, so that every
        fusion's recorded choice is read from the cache as the GPU made it. Nothing compiled
        for a target runs, so its kernels' code is generated unoptimised (LLVM level 0, ptxas
        without optimisation): buffers are assigned before code generation, so the figures are
        an optimised compile's, for 5-15% less compile time (``benchmarks/notes/targets.md``).
        """
        return {
            "xla_gpu_cuda_data_dir": str(cuda_toolkit_dir()),
            "xla_gpu_unsafe_fallback_to_driver_on_ptxas_not_found": False,
            **UNOPTIMISED_CODE,
            **({"xla_gpu_autotune_level": 0} if self.autotune_cache is None else {
                "xla_gpu_autotune_level": 4,
                "xla_gpu_per_fusion_autotune_cache_dir": self.autotune_cache}),
        }

    def devices(self, count: int) -> tuple[Any, ...]:
        """``count`` compile-only devices of this GPU (``jax.Device``, platform ``gpu``); the
        same objects for the same description and count for the life of the process."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"devices={count!r} must be a positive int: how many "
                             f"{self.device_kind} GPUs the plan is for")
        if count > MAX_DEVICES:
            raise ValueError(
                f"devices={count:,} described GPUs are more than a plan describes at once "
                f"(at most {MAX_DEVICES:,}): XLA's compiler holds up to about 50 KB of "
                f"this machine's memory for each ({count * 50_000 / 2**30:,.0f} GiB for "
                f"{count:,}); a candidate's plan spans a few GPUs and is the same on any pool "
                f"that holds it, so plan for {MAX_DEVICES:,} or fewer")
        key = (self.config, self.autotune_cache, count)
        with _LOCK:
            if key not in _DEVICES:
                devices = tuple(_compile_only_devices(self.config, count, self.name))
                _DEVICES[key] = devices
                _BY_CLIENT[id(devices[0].client)] = (devices[0].client, self)
            return _DEVICES[key]


#: The most compile-only GPUs `Target.devices` describes in one call (each count's stay for
#: the process). From its first compile on, XLA's compiler holds host memory per described
#: GPU, whichever of them a plan uses: 48 KB for the main job's SwinIR (1.4 GiB for 30,000,
#: 4.2 GiB for 100,000; a million filled a 24 GiB machine and were killed), about 11 KB for a
#: trivial program: 65,536 take up to about 3 GiB.
MAX_DEVICES = 65_536

_LOCK = threading.Lock()
_DEVICES: dict[tuple[str, str | None, int], tuple[Any, ...]] = {}
#: the compile-only client of each target's devices (kept alive here) -> its Target
_BY_CLIENT: dict[int, tuple[Any, Target]] = {}


def resolve_target(target: str | os.PathLike[str] | Target,
                   autotune_cache: str | os.PathLike[str] | None = None) -> Target:
    """The `Target` for ``target``: a name from `TARGETS` (``"h100"``, ``"v100"``, ...), the
    path of a description file (``GpuTargetConfigProto`` text), or a `Target` (returned as is
    unless ``autotune_cache`` is given). ``autotune_cache``: see `Target`."""
    cache = None if autotune_cache is None else str(_existing_dir(autotune_cache))
    if isinstance(target, Target):
        if cache is None:
            return target
        return Target(target.name, target.device_kind, target.memory_bytes,
                      target.compute_capability, target.config, cache)
    if not isinstance(target, str | os.PathLike):
        raise TypeError(f"target must be a name, a description file or a Target, got "
                        f"{target!r}; e.g. target='h100'")
    text = os.fspath(target)
    spec = GPUS.get(text.lower())
    if spec is not None:
        return Target(text.lower(), spec.device_kind, spec.memory_bytes,
                      spec.compute_capability, spec.target_config(), cache)
    path = Path(text)
    if not path.is_file() and (path.suffix or os.sep in text):  # meant as a file
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ValueError(f"target={text!r} {what}; pass the path of a "
                         "GpuTargetConfigProto text file, or one of the known GPUs "
                         f"({', '.join(TARGETS)})")
    if not path.is_file():
        close = [name for name in TARGETS if text and name.startswith(text.lower())]
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ValueError(
            f"target={text!r} is neither a known GPU ({', '.join(TARGETS)}) nor a description "
            f"file; {hint}pass one of those names or the path of a GpuTargetConfigProto text "
            "file (on a GPU: jax._src.lib.xla_client.get_topology_for_devices(jax.devices())"
            ".target_config)")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"target={str(path)!r} is not a text file; a description file is a "
                         "GpuTargetConfigProto in text form (.txtpb)") from None
    return parse_target_config(text, name=str(path), autotune_cache=cache)


#: The oldest compute capability a target may have: what the CUDA 12 ``ptxas`` of the
#: ``gpu-plan`` extra compiles for (sm_50). For an older one XLA falls back to the driver,
#: and with no driver the process crashes (a described compute capability 3.7, checked).
OLDEST_COMPUTE_CAPABILITY = (5, 0)


def parse_target_config(text: str, *, name: str = "target",
                        autotune_cache: str | None = None) -> Target:
    """A `Target` from a ``GpuTargetConfigProto`` in text form (its device kind is
    ``device_description_str``, its memory ``device_memory_size``)."""
    if not text.strip():
        raise ValueError(f"{name}: the file is empty; a description file is a "
                         "GpuTargetConfigProto in text form (.txtpb)")
    if not re.search(r"\bgpu_device_info\s*:?\s*\{", text):  # "field {" or "field: {"
        raise ValueError(f"{name}: no gpu_device_info {{...}}, so this is no "
                         "GpuTargetConfigProto in text form (.txtpb), which a description "
                         "file is")
    capability = re.search(r"cuda_compute_capability\s*:?\s*\{([^}]*)\}", text)
    if capability is None:
        raise ValueError(f"{name}: no cuda_compute_capability in the description; a target "
                         "is a CUDA GPU described by a GpuTargetConfigProto")
    # proto3 text leaves out zeros: a GPU's own dump of compute capability 9.0 has no minor
    major = _field(capability.group(1), "major", name)
    minor = _field(capability.group(1), "minor", name, default=0)
    if (major, minor) < OLDEST_COMPUTE_CAPABILITY:
        raise ValueError(
            f"{name}: compute capability {major}.{minor} is older than the CUDA 12 compiler "
            "of the gpu-plan extra can compile for ({}.{} and newer); plan for a newer GPU"
            .format(*OLDEST_COMPUTE_CAPABILITY))
    memory = _field(text, "device_memory_size", name)
    # What XLA's GPU compiler sizes kernels and fusions by: a field of 0 (or none: proto3 text
    # leaves out zeros) plans nonsense (a peak 10x the real GPU's for core_count 0, 54x for no
    # shared_memory_per_block_optin), and without block_dim_limit_x XLA divides by zero and the
    # process dies (SIGFPE, no Python error). A GPU's own description has every field.
    missing = [field for field in DEVICE_INFO_FIELDS if not _positive(text, field)]
    if missing:
        raise ValueError(f"{name}: the description's gpu_device_info gives no positive "
                         f"{', '.join(missing)}; describe the GPU's own (e.g. as a GPU writes "
                         "it: jax's get_topology_for_devices(...).target_config), with every "
                         f"field of gpu_device_info: {', '.join(DEVICE_INFO_FIELDS)}")
    kind = re.search(r'device_description_str:\s*"((?:[^"\\]|\\.)*)"', text)
    device_kind = re.sub(r"\\(.)", r"\1", kind.group(1)) if kind else ""  # as `_quote` wrote it
    return Target(name, device_kind, memory, (major, minor), text, autotune_cache)


def target_of(devices: Sequence[Any]) -> Target | None:
    """The `Target` whose compile-only devices ``devices`` are (None: real devices).

    Raises ValueError when ``devices`` mixes real and compile-only devices, devices of two
    targets, or compile-only devices this module did not make."""
    clients = {id(getattr(d, "client", None)) for d in devices}
    if not any(_compile_only(d) for d in devices):
        return None
    (client,) = clients if len(clients) == 1 else (None,)
    if client not in _BY_CLIENT:
        raise ValueError(
            "devices mixes real and described GPUs, or GPUs of two targets, or holds "
            "compile-only devices not made by a Target; pass the devices of one "
            "Target.devices(n) call, or plan with target='...'")
    return _BY_CLIENT[client][1]


def _compile_only(device: Any) -> bool:
    client = getattr(device, "client", None)
    return getattr(client, "runtime_type", "") == "compile_only_runtime"


def cuda_toolkit_dir() -> Path:
    """The ``nvidia-cuda-nvcc-cu12`` wheel's directory (``bin/ptxas``,
    ``nvvm/libdevice``), what target compiles take as ``xla_gpu_cuda_data_dir``.

    Raises `GpuCompilerMissingError` when it is not installed."""
    spec = importlib.util.find_spec("nvidia.cuda_nvcc") if _has_nvidia() else None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in map(Path, roots):
        if (root / "bin" / "ptxas").is_file() and (
                root / "nvvm" / "libdevice" / "libdevice.10.bc").is_file():
            return root
    raise GpuCompilerMissingError(
        "compiling for a GPU target needs ptxas and libdevice from CUDA 12.9 (the "
        f"nvidia-cuda-nvcc-cu12 wheel), which are not installed; {INSTALL_HINT}")


def missing_gpu_compiler() -> str | None:
    """Why GPU targets cannot compile here (what is not installed, and the install command),
    or None when the ``gpu-plan`` extra is in place. Loads nothing."""
    try:
        _plugin_library()
        cuda_toolkit_dir()
    except GpuCompilerMissingError as err:
        return str(err)
    return None


def _has_nvidia() -> bool:
    return importlib.util.find_spec("nvidia") is not None


def _plugin_library() -> Path:
    """The CUDA plugin's shared library, or `GpuCompilerMissingError`."""
    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.origin:
            library = Path(spec.origin).parent / "xla_cuda_plugin.so"
            if library.is_file():
                return library
    raise GpuCompilerMissingError(
        "compiling for a GPU target needs JAX's CUDA plugin (jax-cuda13-plugin and "
        f"jax-cuda13-pjrt, the version of jax), which is not installed; {INSTALL_HINT}")


def _compile_only_devices(config: str, count: int, name: str = "target") -> list[Any]:
    """Compile-only CUDA devices of description ``config`` (of target ``name``, for errors),
    from JAX's CUDA plugin."""
    from jax._src.lib import xla_client
    from jax.experimental import topologies

    library = _plugin_library()
    cuda_toolkit_dir()  # fail here, before JAX registers anything, when it is missing
    options = {"target_config": config, "topology": f"1x1x{count}"}
    try:
        return list(topologies.get_topology_desc(platform="cuda", **options).devices)
    except NotImplementedError:
        # JAX did not register the plugin: its start-up check wants the CUDA libraries of a GPU
        # machine unless JAX_PLATFORMS leaves CUDA out. A topology needs none of them.
        pass
    except Exception as error:  # JaxRuntimeError: the plugin rejected the description
        raise _rejected(name, error) from error
    with _LOCK_PLUGIN:
        global _C_API
        if _C_API is None:
            before = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
            quiet_compiler_log()  # read as the plugin loads; the process's own level after
            try:
                _C_API = xla_client.load_pjrt_plugin_dynamically("cuda", str(library))
            finally:
                if before is None:
                    os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
                else:
                    os.environ["TF_CPP_MIN_LOG_LEVEL"] = before
    try:
        topology = xla_client.make_c_api_device_topology(_C_API, "", **options)
    except Exception as error:  # as above
        raise _rejected(name, error) from error
    return list(topology._make_compile_only_devices())  # type: ignore[attr-defined]


def _rejected(name: str, error: BaseException) -> ValueError:
    return ValueError(f"{name}: the CUDA plugin cannot use this target description: "
                      f"{(str(error).splitlines() or [type(error).__name__])[0]}; check it "
                      "against GpuTargetConfigProto "
                      "(TF_CPP_MIN_LOG_LEVEL=0 shows the line and column where parsing "
                      "failed)")


_LOCK_PLUGIN = threading.Lock()
_C_API: Any = None

#: The C++ log level (`TF_CPP_MIN_LOG_LEVEL`) for the CUDA plugin's compiles without a GPU:
#: FATAL only. There its compiler logs an ERROR, with the whole fusion's HLO, for every matrix
#: product that has no default Triton kernel, a condition the compile reports in its status
#: too and `scamp_jax.planning.reuse.compile_lowered` handles (about 150 lines for six SwinIRs
#: of the accelerator preset).
PLUGIN_LOG_LEVEL = "3"


def quiet_compiler_log() -> None:
    """Set `PLUGIN_LOG_LEVEL` where the level is unset or JAX's default, 1
    (``TF_CPP_MIN_LOG_LEVEL=0`` keeps the compiler's log). The plugin reads the level when it
    loads. Where JAX loads it as it starts its backends (``JAX_PLATFORMS=cpu``, which
    ``--plan-only --target`` sets), call this before JAX's first call; the level then stays
    set for the process and its children. Where JAX does not (it found no CUDA libraries),
    a target's first `Target.devices` loads the plugin here, with this level, and puts the
    variable back as it was."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL") in (None, "1"):  # "1": set by `import jax`
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = PLUGIN_LOG_LEVEL


def _positive(text: str, name: str) -> bool:
    """Whether ``text`` gives field ``name`` a positive number (an int or a float)."""
    match = re.search(rf"\b{name}:\s*([-+]?[0-9.]+(?:[eE][-+]?\d+)?)", text)
    try:
        return match is not None and float(match.group(1)) > 0
    except ValueError:  # "1.2.3"
        return False


def _field(text: str, name: str, where: str, default: int | None = None) -> int:
    match = re.search(rf"\b{name}:\s*(\d+)", text)
    if match is None and default is not None:
        return default
    if match is None:
        raise ValueError(f"{where}: the description has no {name}; a GpuTargetConfigProto "
                         "needs gpu_device_info with cuda_compute_capability and "
                         "device_memory_size")
    return int(match.group(1))


def _existing_dir(path: str | os.PathLike[str]) -> Path:
    result = Path(path)
    if not result.is_dir():
        raise ValueError(f"autotune_cache={os.fspath(path)!r} is not a directory; pass the "
                         "directory a GPU compile wrote (xla_gpu_per_fusion_autotune_cache_dir)")
    return result


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
