"""`Budget`: the one memory model of a device, and that every consumer takes its figures."""

from __future__ import annotations

import jax
import pytest

from scamp_jax.devices import XLA_DEFAULT_FRACTION
from scamp_jax.planning.budget import GPU_OUTSIDE_POOL_BYTES, Budget, pool_bytes

MIB = 2**20
GIB = 2**30


class _Gpu:
    """A device that reports an allocator limit (what a GPU's ``memory_stats()`` holds)."""

    platform = "gpu"
    device_kind = "NVIDIA H200"

    def __init__(self, limit: int) -> None:
        self._limit = limit

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": self._limit, "bytes_in_use": 0}


def test_usable_and_plan_bytes_follow_margin_and_allowance() -> None:
    budget = Budget(1000 * MIB, 0.1)
    assert budget.usable_bytes == int(1000 * MIB * 0.9)
    assert budget.plan_bytes == budget.usable_bytes
    booked = budget.with_allowance(50 * MIB)
    assert booked.usable_bytes == budget.usable_bytes  # the ledger's capacity stays
    assert booked.plan_bytes == budget.usable_bytes - 50 * MIB  # one plan's figures shrink


def test_a_text_budget_is_parsed_once_from_live_devices() -> None:
    cpu = jax.devices()[:2]
    budget = Budget.of_devices(cpu, "64MiB", safety_margin=0.2)
    assert (budget.memory_per_device, budget.platform, budget.device_kind) == (
        64 * MIB, "cpu", str(cpu[0].device_kind))
    assert budget.outside_pool_bytes == 0 and budget.device_bytes is None
    with pytest.raises(ValueError, match="memory_per_device is required on cpu"):
        Budget.of_devices(cpu)
    with pytest.raises(ValueError, match="cannot read memory size"):
        Budget.of_devices(cpu, "lots")


def test_a_memory_size_beyond_any_float_is_a_value_error() -> None:
    """What the command lines word in one line: ``--memory-per-device 1e999`` is a
    ValueError like any unreadable size, not an OverflowError's traceback."""
    from scamp_jax._units import parse_bytes

    assert parse_bytes("1e3KiB") == 1000 * 1024
    for value in (-5, "0", "-1GiB", "-0.5 MB", "0GiB"):  # a sign read as a sign, as in -5
        with pytest.raises(ValueError, match=f"memory size must be positive, got {value!r}"):
            parse_bytes(value)
    for value in ("1e999", "1e308TiB", float("inf"), float("nan")):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(value)


def test_the_default_pool_is_the_smallest_device_limit() -> None:
    budget = Budget.of_devices([_Gpu(80 * GIB), _Gpu(40 * GIB)])
    assert budget.memory_per_device == 40 * GIB
    assert (budget.platform, budget.device_kind) == ("gpu", "NVIDIA H200")
    assert budget.outside_pool_bytes == GPU_OUTSIDE_POOL_BYTES


def test_a_described_device_needs_no_live_device() -> None:
    """A target (kind and total memory) gives the pool each process may hold."""
    total = 143_771 * MIB
    one = Budget.for_device("NVIDIA H200", total)  # what one process alone holds there
    assert one.memory_per_device == int(total * XLA_DEFAULT_FRACTION)
    assert one.memory_fraction == pytest.approx(one.memory_per_device / total)
    two = Budget.for_device("NVIDIA H200", total, processes=2)
    assert two.memory_per_device == total // 2 - GPU_OUTSIDE_POOL_BYTES
    given = Budget.for_device("NVIDIA H200", total, memory_per_device="32GiB")
    assert given.memory_per_device == 32 * GIB
    with pytest.raises(ValueError, match="exceed the device"):
        Budget.for_device("NVIDIA H200", 10 * GIB, memory_per_device="10GiB")
    # a device smaller than what a process holds beside its pool: no size to advise
    with pytest.raises(ValueError, match=r"the device's 1.00 MiB are no more than the .* a "
                       r"process holds outside its pool .*; check the device's memory size"):
        Budget.for_device("NVIDIA H200", MIB)
    with pytest.raises(ValueError, match="leave no pool"):
        pool_bytes(GIB, 600 * MIB, processes=2)
    with pytest.raises(ValueError, match="leave no pool"):  # a pool of 0 bytes is none
        pool_bytes(GIB, GIB // 2, processes=2)
    with pytest.raises(ValueError, match="processes=0 must be at least 1"):
        pool_bytes(GIB, 600 * MIB, processes=0)


@pytest.mark.parametrize("bad", [dict(memory_per_device=0), dict(memory_per_device="1GiB"),
                                 dict(safety_margin=1.0), dict(safety_margin=-0.1),
                                 dict(allowance_bytes=-1), dict(memory_per_device=1)])
def test_invalid_budgets_name_the_value(bad: dict) -> None:
    kwargs = {"memory_per_device": GIB, **bad}
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        Budget(**kwargs)


def test_the_planner_the_core_and_the_simulator_book_the_same_usable_bytes() -> None:
    """One formula: the plan's, the scheduling core's and the simulator's usable bytes agree."""
    from flax import nnx

    from scamp_jax.planning.planner import plan_mesh
    from scamp_jax.scheduling.core import SchedulingCore
    from scamp_jax.scheduling.placement import ScampPolicy
    from scamp_jax.sim.simulator import ClusterModel

    class Tiny(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.fc = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.fc(x)

    model = nnx.eval_shape(lambda: Tiny(nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 8), jax.numpy.float32)
    budget = Budget(8 * MIB, 0.25)
    plan = plan_mesh(model, sample, devices=1, memory_per_device=budget, max_batch_size=8,
                     compile_for_run=False)
    core = SchedulingCore(ScampPolicy(), 1, budget)
    cluster = ClusterModel(name="t", devices=1, memory_per_device=8 * MIB, peak_flops=1e12,
                           mem_bandwidth=1e11, interconnect_bandwidth=1e10,
                           network_bandwidth=1e9, node_devices=1)
    assert plan.usable_bytes == core.capacity == cluster.budget(0.25).usable_bytes
    assert plan.safety_margin == 0.25 and plan.memory_per_device == 8 * MIB
    with pytest.raises(ValueError, match="differs from the budget"):
        plan_mesh(model, sample, devices=1, memory_per_device=budget, safety_margin=0.1)


def test_the_simulator_books_the_allowance_as_the_engine_does() -> None:
    """A cluster with an allowance fits each trial's figures within the usable bytes less it
    and books them plus it, the engine's rule for a plan made with that allowance."""
    from scamp_jax.scheduling.placement import ScampPolicy
    from scamp_jax.sim.simulator import ClusterModel, StepCostModel, plan_profiles

    cost = StepCostModel(model_parallel=1, flops_fixed=1e9, flops_per_sample=1e8,
                         bytes_fixed=1e6, bytes_per_sample=1e5, gradient_bytes=1e6,
                         mp_comm_fixed=0.0, mp_comm_per_sample=0.0, kernels_per_step=10,
                         memory_fixed=10 * MIB, memory_per_sample=MIB)
    base = dict(name="t", devices=2, memory_per_device=100 * MIB, peak_flops=1e12,
                mem_bandwidth=1e11, interconnect_bandwidth=1e10)
    plain = ClusterModel(**base)
    allowed = ClusterModel(**base, allowance_bytes=20 * MIB)
    (a,) = plan_profiles([cost], plain, ScampPolicy(), samples=64, max_devices=2)
    (b,) = plan_profiles([cost], allowed, ScampPolicy(), samples=64, max_devices=2)
    budget = allowed.budget(0.1)
    assert a.bytes_per_device <= budget.usable_bytes
    assert b.batch_size < a.batch_size  # 20 MiB less to fit the step into
    assert b.bytes_per_device == cost.peak_bytes(b.batch_size) + 20 * MIB <= budget.usable_bytes
    assert b.alternatives and all(
        alt.bytes_per_device == cost.peak_bytes(alt.batch_size // 2) + 20 * MIB
        for alt in b.alternatives)


def test_cpu_devices_holding_more_than_the_host_are_warned_of_once(caplog) -> None:
    """CPU devices report no limit, so a budget given for them is taken as it is; where the
    pool's devices together would hold more than the host's physical memory, the user is
    warned (once per budget) with the most each device can have."""
    from scamp_jax.devices import host_memory_bytes

    host = host_memory_bytes()
    devices = jax.devices()[:2]
    with caplog.at_level("WARNING", logger="scamp_jax.planning.budget"):
        Budget.of_devices(devices, host // 2 - MIB)  # fits the host together: nothing said
        assert not caplog.records
        too_much = host // 2 + 7 * MIB
        for _ in range(2):
            assert Budget.of_devices(devices, too_much).memory_per_device == too_much
            Budget.of_devices(devices[:1], too_much)  # a subset of the pool: not again
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "2 CPU device(s)" in message and "more than this host's memory" in message
    from scamp_jax._units import format_bytes

    assert message.endswith(f"of at most {format_bytes(host // 2)}")  # the host, shared


def test_cpu_devices_standing_in_for_a_gpu_are_not_warned_of(caplog) -> None:
    """The cluster simulator plans on CPU devices with a GPU's memory to cost that GPU's
    plans (`scamp_jax.sim.step_costs.plan_point`): nothing trains on the host, so the
    warning, whose advice would shrink the simulated GPU, is not given."""
    from scamp_jax.devices import host_memory_bytes
    from scamp_jax.planning.budget import standing_in_for_another_device

    host = host_memory_bytes()
    devices = jax.devices()[:2]
    gpu = host + 13 * MIB  # a budget no other test warned of
    with caplog.at_level("WARNING", logger="scamp_jax.planning.budget"):
        with standing_in_for_another_device():
            assert Budget.of_devices(devices, gpu).memory_per_device == gpu
        assert not caplog.records
        Budget.of_devices(devices, gpu)  # planning for this host again: said
    assert len(caplog.records) == 1


def test_a_containers_memory_limit_is_the_hosts_memory(tmp_path, monkeypatch) -> None:
    """In a container the host's memory is its cgroup's limit where that is less than the
    physical memory. The kernel's limit file is replaced by a file of the test's (a container
    limit cannot be set from inside this one); "max" and figures above the physical memory
    are no limit."""
    import os

    from scamp_jax import devices as device_setup

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(device_setup, "CGROUP_MEMORY_LIMITS",
                        (str(tmp_path / "absent"), str(limit)))
    for text, expected in (("max\n", physical), (f"{physical * 2}\n", physical),
                           (f"{physical // 3}\n", physical // 3)):
        limit.write_text(text)
        assert device_setup.host_memory_bytes() == expected
    from scamp_jax.hpo.session import CPU_MEMORY_SHARE, default_budget

    assert default_budget(None, jax.devices()[:2]) == int(CPU_MEMORY_SHARE * (physical // 3)) // 2
