"""The public surface of `scamp_jax` is explicit: every name is re-exported and listed once."""

from __future__ import annotations

import scamp_jax

EXPECTED = {
    "BudgetTooSmallError", "ChunkedEvalTask", "DeviceOption", "DevicePool", "DoesNotFitError",
    "EngineConfig",
    "FixedPolicy",
    "MemoryEstimate", "MemoryModel", "OptunaTrialSource", "Placement", "Plan", "PoolSnapshot",
    "ScampPolicy", "SearchEngine", "SearchResult", "SearchSettings", "SearchSpace",
    "StepShardings", "Task", "TrialOutcome", "TrialRequest", "TrialSource", "UsageRecorder",
    "abstract_state", "check_feasible", "configure_cpu_devices", "configure_for_search",
    "configure_device_memory",
    "default_loss", "default_optimizer", "estimate_memory", "fit_memory_model", "format_bytes",
    "jit_train_step", "make_mesh", "make_policy", "make_train_step", "min_devices",
    "min_devices_plan", "open_study", "param_partition_specs", "parse_bytes", "place_train_state",
    "plan_mesh", "run_search", "split_model",
    "FunctionTask", "run_study",
    # planning cost: plan cache, compile counting, the planner's compiled step
    "CompileCounter", "CompiledStep", "PlanCache",
    # horizontal fusion
    "FusionPlan", "GroupResult", "GroupSpec", "MemberSpec", "jit_fused_step", "make_fused_step",
    "plan_fusion", "run_fused_group",
    # fused groups in the engine: the signature trials group by and the grouping rule
    "architecture_signature", "form_groups",
    "StudySettingsError", "open_storage",
    # the trial source's "ask again later" (a dead job's trials may still need retries)
    "AskLater",
    # scheduling core (events in, actions out) and its replay of a finished study
    "SchedulingCore", "TrialPlan", "replay_study",
}


def test_all_lists_exactly_the_public_names() -> None:
    assert set(scamp_jax.__all__) == EXPECTED
    assert len(scamp_jax.__all__) == len(set(scamp_jax.__all__))


def test_every_public_name_resolves_and_is_documented() -> None:
    for name in scamp_jax.__all__:
        obj = getattr(scamp_jax, name)
        assert obj.__doc__, f"scamp_jax.{name} has no docstring"
