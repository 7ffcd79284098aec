"""On CPU devices, which split one host's cores, no more trials run at once than pays off."""

from __future__ import annotations

import jax
import pytest
from test_engine import SPACE, Regression, config, make_source, ok

from scamp_jax.hpo.engine import EngineConfig, SearchEngine
from scamp_jax.planning.budget import Budget
from scamp_jax.scheduling import SchedulingCore, TrialPlan, host
from scamp_jax.scheduling.host import (
    CPU_SPLIT_FLOPS,
    cpu_trial_devices,
    default_max_running,
    host_cores,
)
from scamp_jax.scheduling.placement import ScampPolicy


def test_the_default_is_one_trial_per_two_host_cores_on_cpu_and_none_on_accelerators():
    cpus = jax.devices()[:4]
    assert [default_max_running(cpus, cores) for cores in (1, 2, 3, 8)] == [1, 1, 1, 4]

    class Gpu:
        platform = "gpu"

    assert default_max_running([*cpus, Gpu()], 2) is None


def test_the_core_keeps_trials_beyond_the_cap_queued_until_one_ends():
    core = SchedulingCore(ScampPolicy(), 4, Budget(100, 0.0), max_running=2)
    for key in range(3):
        core.planned(0.0, TrialPlan(key, key, 1, 10, 5))
    started = [a.key for a in core.decide(0.0)]
    assert started == [0, 1] and list(core.queued) == [2]
    core.finished(1.0, 0)
    assert [a.key for a in core.decide(1.0)] == [2]
    with pytest.raises(ValueError, match="max_running"):
        SchedulingCore(ScampPolicy(), 4, Budget(100, 0.0), max_running=0)
    with pytest.raises(ValueError, match="max_running_trials"):
        EngineConfig(steps=1, budget=Budget(100), max_running_trials=0)


def test_a_capped_study_runs_one_trial_at_a_time_and_records_the_cap(tmp_path):
    study, source = make_source(tmp_path, [ok(16, 1e-2), ok(16, 2e-2), ok(32)])
    engine = SearchEngine(SPACE, Regression(), source, config(max_running_trials=1),
                          devices=jax.devices()[:4])
    result = engine.run()
    assert len(result.outcomes) == 3
    # a trial planned on several devices has the same span on each
    spans = sorted({(s, e) for device in result.intervals for _, s, e, _ in device})
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:], strict=False))  # never overlap
    assert result.scheduling["max_running"] == 1
    # and its planner threads, which the cluster simulator reads (`engine_figures`)
    assert result.scheduling["planner_threads"] == engine.config.planner_threads


def test_a_cpu_trial_is_planned_on_the_devices_its_share_of_the_host_cores_gives_it():
    cpus = jax.devices()[:8]
    # one running trial on 2 cores: 2 devices; on 8 cores: 8; 4 running on 8 cores: 2 each
    assert [cpu_trial_devices(cpus, 1, cores=c) for c in (1, 2, 3, 8, 16)] == [1, 2, 2, 8, 8]
    assert cpu_trial_devices(cpus, 4, cores=8) == 2
    assert cpu_trial_devices(cpus, None, cores=16) == 1  # no cap: a device per running trial
    assert cpu_trial_devices(cpus[:3], 1, cores=8) == 2  # a power of two within the pool
    assert cpu_trial_devices(cpus, 1, max_batch=3, cores=8) == 2  # a sample per device at least
    assert cpu_trial_devices(cpus, 1, max_batch=1, cores=8) == 1
    # a light step stays on one device; an unknown one counts as heavy
    assert cpu_trial_devices(cpus, 1, cores=8, flops_per_step=CPU_SPLIT_FLOPS / 2) == 1
    assert cpu_trial_devices(cpus, 1, cores=8, flops_per_step=CPU_SPLIT_FLOPS) == 8

    class Gpu:
        platform = "gpu"

    assert cpu_trial_devices([*cpus, Gpu()], 1, cores=16) == 1
    with pytest.raises(ValueError, match="max_running"):
        cpu_trial_devices(cpus, 0, cores=2)


def test_scamp_plans_a_capped_cpu_trial_on_its_core_share_only_if_its_step_is_heavy(
        tmp_path, monkeypatch):
    # the test MLP's step is far below CPU_SPLIT_FLOPS: one device, as before
    _, source = make_source(tmp_path, [ok(16, 1e-2)])
    pool = jax.devices()[:4]
    engine = SearchEngine(SPACE, Regression(), source, config(max_running_trials=1),
                          devices=pool)
    plan = engine.plan(ok(16))
    assert plan.data_parallel * plan.model_parallel == 1
    # with every step counted heavy, the trial gets the devices of its share of the cores
    monkeypatch.setattr(host, "CPU_SPLIT_FLOPS", 0.0)
    share = cpu_trial_devices(pool, 1, engine.config.max_batch_size, host_cores())
    engine = SearchEngine(SPACE, Regression(), source, config(max_running_trials=1),
                          devices=pool)
    plan = engine.plan(ok(16))
    assert plan.data_parallel * plan.model_parallel == share
