"""On CPU devices, which split one host's cores, no more trials run at once than pays off."""

from __future__ import annotations

import jax
import pytest
from test_engine import SPACE, Regression, config, make_source, ok

from scamp_jax.hpo.engine import EngineConfig, SearchEngine
from scamp_jax.scheduling import SchedulingCore, TrialPlan
from scamp_jax.scheduling.host import default_max_running
from scamp_jax.scheduling.placement import ScampPolicy


def test_the_default_is_one_trial_per_two_host_cores_on_cpu_and_none_on_accelerators():
    cpus = jax.devices()[:4]
    assert [default_max_running(cpus, cores) for cores in (1, 2, 3, 8)] == [1, 1, 1, 4]

    class Gpu:
        platform = "gpu"

    assert default_max_running([*cpus, Gpu()], 2) is None


def test_the_core_keeps_trials_beyond_the_cap_queued_until_one_ends():
    core = SchedulingCore(ScampPolicy(), 4, 100, 0.0, max_running=2)
    for key in range(3):
        core.planned(0.0, TrialPlan(key, key, 1, 10, 5))
    started = [a.key for a in core.decide(0.0)]
    assert started == [0, 1] and list(core.queued) == [2]
    core.finished(1.0, 0)
    assert [a.key for a in core.decide(1.0)] == [2]
    with pytest.raises(ValueError, match="max_running"):
        SchedulingCore(ScampPolicy(), 4, 100, 0.0, max_running=0)
    with pytest.raises(ValueError, match="max_running_trials"):
        EngineConfig(steps=1, memory_per_device=100, max_running_trials=0)


def test_a_capped_study_runs_one_trial_at_a_time_and_records_the_cap(tmp_path):
    study, source = make_source(tmp_path, [ok(16, 1e-2), ok(16, 2e-2), ok(32)])
    engine = SearchEngine(SPACE, Regression(), source, config(max_running_trials=1),
                          devices=jax.devices()[:4])
    result = engine.run()
    assert len(result.outcomes) == 3
    spans = sorted((s, e) for device in result.intervals for _, s, e, _ in device)
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:], strict=False))  # never overlap
    assert result.scheduling["max_running"] == 1
