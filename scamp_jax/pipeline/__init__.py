"""Pipelined supernet training (NASPipe in JAX): CSP schedules, tick programs, the executor.

Decisions (`csp_schedule`, `gpipe_schedule`, `sequential_schedule`, `build_program`) are pure
host-side functions returning plain data; only `PipelineExecutor` touches devices. Any supernet
that implements `StageModel` (flat blocks, stem/layers/head functions, its loss) can be trained.
"""

from scamp_jax.pipeline.budget import BatchDoesNotFitError as BatchDoesNotFitError
from scamp_jax.pipeline.budget import ExecutorCache as ExecutorCache
from scamp_jax.pipeline.budget import SchedulePlan as SchedulePlan
from scamp_jax.pipeline.budget import plan_schedule as plan_schedule
from scamp_jax.pipeline.csp import SHARED as SHARED
from scamp_jax.pipeline.csp import check_causality as check_causality
from scamp_jax.pipeline.csp import csp_schedule as csp_schedule
from scamp_jax.pipeline.csp import ideal_schedule as ideal_schedule
from scamp_jax.pipeline.csp import split_layers as split_layers
from scamp_jax.pipeline.csp import stage_param_keys as stage_param_keys
from scamp_jax.pipeline.determinism import use_deterministic_gpu_ops as use_deterministic_gpu_ops
from scamp_jax.pipeline.executor import PipelineExecutor as PipelineExecutor
from scamp_jax.pipeline.executor_base import StageExecutor as StageExecutor
from scamp_jax.pipeline.model import StageModel as StageModel
from scamp_jax.pipeline.program import TickProgram as TickProgram
from scamp_jax.pipeline.program import build_program as build_program
from scamp_jax.pipeline.schedules import Op as Op
from scamp_jax.pipeline.schedules import Schedule as Schedule
from scamp_jax.pipeline.schedules import gpipe_schedule as gpipe_schedule
from scamp_jax.pipeline.schedules import sequential_schedule as sequential_schedule
from scamp_jax.pipeline.schedules import validate_schedule as validate_schedule
from scamp_jax.pipeline.stage import OptimizerSpec as OptimizerSpec
from scamp_jax.pipeline.stage import StageSpec as StageSpec
from scamp_jax.pipeline.stage import stage_tick as stage_tick
from scamp_jax.pipeline.trainer import SCHEDULES as SCHEDULES
from scamp_jax.pipeline.trainer import TrainResult as TrainResult
from scamp_jax.pipeline.trainer import build_executor as build_executor
from scamp_jax.pipeline.trainer import make_schedule as make_schedule
from scamp_jax.pipeline.trainer import params_sha256 as params_sha256
from scamp_jax.pipeline.trainer import split_microbatches as split_microbatches
from scamp_jax.pipeline.trainer import supernet_state_bytes as supernet_state_bytes
from scamp_jax.pipeline.trainer import train_supernet as train_supernet

__all__ = [
    "BatchDoesNotFitError",
    "ExecutorCache",
    "SCHEDULES",
    "SHARED",
    "Op",
    "OptimizerSpec",
    "PipelineExecutor",
    "Schedule",
    "SchedulePlan",
    "StageExecutor",
    "StageModel",
    "StageSpec",
    "TickProgram",
    "TrainResult",
    "build_executor",
    "build_program",
    "check_causality",
    "csp_schedule",
    "gpipe_schedule",
    "ideal_schedule",
    "make_schedule",
    "params_sha256",
    "plan_schedule",
    "sequential_schedule",
    "split_layers",
    "split_microbatches",
    "stage_param_keys",
    "stage_tick",
    "supernet_state_bytes",
    "train_supernet",
    "use_deterministic_gpu_ops",
    "validate_schedule",
]
