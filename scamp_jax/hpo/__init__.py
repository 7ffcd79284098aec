"""The HPO study: the session (`run_study`, `run_search`) and its settings, the engine loop and
its planning, the trial runners, the Optuna study, checkpoints, and the live view and reports.
"""

from scamp_jax._lazy import exports as _exports

_NAMES = {
    **dict.fromkeys(("StudySession", "run_search", "run_study", "default_budget"),
                    "scamp_jax.hpo.session"),
    **dict.fromkeys(("EngineConfig", "SearchSettings"), "scamp_jax.hpo.settings"),
    **dict.fromkeys(("CandidatePlan", "plan_candidates"), "scamp_jax.hpo.preview"),
    **dict.fromkeys(("BudgetTooSmallError", "SearchEngine", "SearchResult"),
                    "scamp_jax.hpo.engine"),
    "RepeatedFailureError": "scamp_jax.hpo.failures",
    **dict.fromkeys(("load_model", "run_trial", "RunSpec", "RunResult"), "scamp_jax.hpo.runner"),
    **dict.fromkeys(("GroupResult", "GroupSpec", "MemberSpec", "architecture_signature",
                     "run_fused_group"), "scamp_jax.hpo.fused_runner"),
    **dict.fromkeys(("AskLater", "AskedTrial", "OptunaTrialSource", "StudyHandle",
                     "StudySettingsError", "TrialOutcome", "TrialSource", "open_storage",
                     "open_study"), "scamp_jax.hpo.study"),
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = _exports(__name__, _NAMES)
