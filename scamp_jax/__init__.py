"""scamp-jax: memory-aware parallel deep-learning search (HPO and NAS) in JAX.

The public surface. Planning and placement are pure decisions returning frozen dataclasses;
`scamp_jax.pipeline` holds the NASPipe-style supernet pipeline and `scamp_jax.distributed` the
multi-host (MPI) pieces.
"""

from scamp_jax._units import format_bytes as format_bytes
from scamp_jax._units import parse_bytes as parse_bytes
from scamp_jax.devices import configure_cpu_devices as configure_cpu_devices
from scamp_jax.devices import configure_for_search as configure_for_search
from scamp_jax.hpo.engine import BudgetTooSmallError as BudgetTooSmallError
from scamp_jax.hpo.engine import EngineConfig as EngineConfig
from scamp_jax.hpo.engine import SearchEngine as SearchEngine
from scamp_jax.hpo.engine import SearchResult as SearchResult
from scamp_jax.hpo.entry import run_study as run_study
from scamp_jax.hpo.fused_runner import GroupResult as GroupResult
from scamp_jax.hpo.fused_runner import GroupSpec as GroupSpec
from scamp_jax.hpo.fused_runner import MemberSpec as MemberSpec
from scamp_jax.hpo.fused_runner import architecture_signature as architecture_signature
from scamp_jax.hpo.fused_runner import run_fused_group as run_fused_group
from scamp_jax.hpo.search import SearchSettings as SearchSettings
from scamp_jax.hpo.search import run_search as run_search
from scamp_jax.hpo.study import AskLater as AskLater
from scamp_jax.hpo.study import OptunaTrialSource as OptunaTrialSource
from scamp_jax.hpo.study import StudySettingsError as StudySettingsError
from scamp_jax.hpo.study import TrialOutcome as TrialOutcome
from scamp_jax.hpo.study import TrialSource as TrialSource
from scamp_jax.hpo.study import open_storage as open_storage
from scamp_jax.hpo.study import open_study as open_study
from scamp_jax.planning.compile_events import CompileCounter as CompileCounter
from scamp_jax.planning.evaluation import ChunkedEvalTask as ChunkedEvalTask
from scamp_jax.planning.fusion import FusionPlan as FusionPlan
from scamp_jax.planning.fusion import jit_fused_step as jit_fused_step
from scamp_jax.planning.fusion import make_fused_step as make_fused_step
from scamp_jax.planning.fusion import plan_fusion as plan_fusion
from scamp_jax.planning.memory import MemoryEstimate as MemoryEstimate
from scamp_jax.planning.memory import MemoryModel as MemoryModel
from scamp_jax.planning.memory import estimate_memory as estimate_memory
from scamp_jax.planning.memory import fit_memory_model as fit_memory_model
from scamp_jax.planning.plan_cache import PlanCache as PlanCache
from scamp_jax.planning.planner import CompiledStep as CompiledStep
from scamp_jax.planning.planner import DoesNotFitError as DoesNotFitError
from scamp_jax.planning.planner import Plan as Plan
from scamp_jax.planning.planner import min_devices as min_devices
from scamp_jax.planning.planner import min_devices_plan as min_devices_plan
from scamp_jax.planning.planner import plan_mesh as plan_mesh
from scamp_jax.planning.sharding import make_mesh as make_mesh
from scamp_jax.planning.sharding import param_partition_specs as param_partition_specs
from scamp_jax.planning.train_step import StepShardings as StepShardings
from scamp_jax.planning.train_step import abstract_state as abstract_state
from scamp_jax.planning.train_step import default_loss as default_loss
from scamp_jax.planning.train_step import default_optimizer as default_optimizer
from scamp_jax.planning.train_step import jit_train_step as jit_train_step
from scamp_jax.planning.train_step import make_train_step as make_train_step
from scamp_jax.planning.train_step import place_train_state as place_train_state
from scamp_jax.planning.train_step import split_model as split_model
from scamp_jax.scheduling import SchedulingCore as SchedulingCore
from scamp_jax.scheduling import TrialPlan as TrialPlan
from scamp_jax.scheduling.grouping import form_groups as form_groups
from scamp_jax.scheduling.placement import DeviceOption as DeviceOption
from scamp_jax.scheduling.placement import FixedPolicy as FixedPolicy
from scamp_jax.scheduling.placement import Placement as Placement
from scamp_jax.scheduling.placement import PoolSnapshot as PoolSnapshot
from scamp_jax.scheduling.placement import ScampPolicy as ScampPolicy
from scamp_jax.scheduling.placement import TrialRequest as TrialRequest
from scamp_jax.scheduling.placement import check_feasible as check_feasible
from scamp_jax.scheduling.placement import make_policy as make_policy
from scamp_jax.scheduling.pool import DevicePool as DevicePool
from scamp_jax.scheduling.usage import UsageRecorder as UsageRecorder
from scamp_jax.sim.measured import replay_study as replay_study
from scamp_jax.space import FunctionTask as FunctionTask
from scamp_jax.space import SearchSpace as SearchSpace
from scamp_jax.space import Task as Task

__version__ = "0.1.0"

__all__ = [
    "BudgetTooSmallError",
    "ChunkedEvalTask",
    "CompileCounter",
    "CompiledStep",
    "DeviceOption",
    "DevicePool",
    "DoesNotFitError",
    "EngineConfig",
    "FixedPolicy",
    "FunctionTask",
    "FusionPlan",
    "GroupResult",
    "GroupSpec",
    "MemberSpec",
    "MemoryEstimate",
    "MemoryModel",
    "OptunaTrialSource",
    "AskLater",
    "PlanCache",
    "Placement",
    "Plan",
    "PoolSnapshot",
    "ScampPolicy",
    "SearchEngine",
    "SearchResult",
    "SearchSettings",
    "SchedulingCore",
    "SearchSpace",
    "StepShardings",
    "StudySettingsError",
    "Task",
    "TrialOutcome",
    "TrialPlan",
    "TrialRequest",
    "TrialSource",
    "UsageRecorder",
    "abstract_state",
    "check_feasible",
    "configure_cpu_devices",
    "configure_for_search",
    "default_loss",
    "default_optimizer",
    "estimate_memory",
    "fit_memory_model",
    "format_bytes",
    "jit_fused_step",
    "jit_train_step",
    "make_mesh",
    "make_fused_step",
    "make_policy",
    "make_train_step",
    "min_devices",
    "min_devices_plan",
    "open_storage",
    "open_study",
    "param_partition_specs",
    "parse_bytes",
    "place_train_state",
    "plan_fusion",
    "plan_mesh",
    "run_fused_group",
    "architecture_signature",
    "form_groups",
    "replay_study",
    "run_search",
    "run_study",
    "split_model",
]
