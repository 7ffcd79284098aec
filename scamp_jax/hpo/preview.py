"""A study's plans without the study: what its first candidates would get on a device pool.

`plan_candidates` draws configurations as a new study would (the study's seeded sampler, its
warm-start configurations first) and plans each with the search's own planning service
(`scamp_jax.hpo.plan_service.PlanningService`: the fewest devices that hold it, the
model-parallel degree, the largest batch), then stops: nothing trains, no study is stored. On
a GPU target's compile-only devices (`scamp_jax.planning.targets`) this sizes a search for a
cluster from a machine without its GPUs (``python -m experiments.swinir_hpo --plan-only
--target v100 --devices 32``). With ``fuse`` set, each new architecture's fused group is sized
too, by the engine's own rule (`scamp_jax.hpo.fused_engine.FusionService.fusion_plan`): how
many members train as one step on the candidate's devices and what the group books per
device. (A study on accelerators fuses unless told otherwise, `SearchSettings.on_platform`;
sizing its groups costs the fused compiles a study would make, so it is asked for here.)
"""

from __future__ import annotations

import functools
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scamp_jax._units import counted, format_bytes, format_duration


@dataclass(frozen=True)
class CandidatePlan:
    """The plan of one sampled candidate (or why there is none).

    Attributes:
      number: the candidate's trial number in a new study.
      params: its configuration.
      devices: devices its plan trains on (0: it fits on no device count of the pool).
      data_parallel, model_parallel: the plan's mesh degrees.
      batch_size: the plan's global batch.
      bytes_per_device: the plan's predicted peak per device (training or evaluation, with the
        prefetched batch and the allowance), bytes.
      usable_bytes: what a plan may book per device (the budget less the margin), bytes.
      compiles: compiles the plan took (0: its architecture was planned before, for trial
        ``planned_with``), its fused group's included.
      cpu_seconds: CPU seconds the plan took, this process and its children (the compiler's
        ptxas runs) together.
      seconds: wall-clock seconds the plan took.
      error: why it has no plan (None: it has one).
      fusion_width: members of the widest fused group of its architecture on its plan (1: the
        study would not fuse it, or two members do not fit).
      group_bytes_per_device: what that group books per device, bytes (0: no group).
      steps: training steps the trial takes at its batch (the study's steps at its reference
        batch, scaled: `EngineConfig.steps_for`; 0: no plan).
      planned_with: the earlier trial whose plan of the same architecture this one reuses
        (None: planned here).
      step_seconds: the least time one training step can take on its devices
        (`compute_seconds`: its FLOPs at what a device of the pool's kind attains); None
        where the kind's FLOP/s are not known (CPU devices) or the plan has no FLOP count.
    """

    number: int
    params: Mapping[str, Any]
    devices: int
    data_parallel: int
    model_parallel: int
    batch_size: int
    bytes_per_device: int
    usable_bytes: int
    compiles: int
    cpu_seconds: float
    seconds: float
    error: str | None = None
    fusion_width: int = 1
    group_bytes_per_device: int = 0
    steps: int = 0
    planned_with: int | None = None
    step_seconds: float | None = None

    @property
    def device_hours(self) -> float | None:
        """``step_seconds`` times the trial's steps and devices, in device-hours (a lower
        bound of what the trial costs on its devices, as ``step_seconds`` is)."""
        if self.step_seconds is None or not self.devices:
            return None
        return self.step_seconds * self.steps * self.devices / 3600.0

    def describe(self) -> str:
        """One line: the plan, or why there is none."""
        if not self.devices:
            return f"trial {self.number}: no plan: {self.error}"
        group = (f", fused x{self.fusion_width}: {format_bytes(self.group_bytes_per_device)} "
                 "per device" if self.fusion_width > 1 else "")
        cost = (f"{counted(self.compiles, 'compile')}" if self.planned_with is None else
                f"the plan of trial {self.planned_with} (the same architecture)")
        return (f"trial {self.number}: {self.devices} device(s), model-parallel "
                f"{self.model_parallel}, batch {self.batch_size} x {self.steps} steps, "
                f"{format_bytes(self.bytes_per_device)} per device{group}, {cost}, "
                f"{self.cpu_seconds:.1f} CPU s")


#: What `format_rows`' estimate columns mean, for a line under the table.
ESTIMATE_NOTE = ("s/step at least: each step's FLOPs at the FLOP/s a device of this kind attains "
                 "(half its data sheet's float32 matrix peak: TF32 tensor cores from the "
                 "A100 on, which JAX's default precision uses, so an A100 counts 10x a V100; "
                 "the figure the scheduler paces trials by); memory traffic, kernel launches "
                 "and communication only add to it. "
                 "device-h: that times the trial's steps and devices")


def compute_seconds(flops_per_device: float | None, device_kind: str) -> float | None:
    """The least time one training step takes on a device of ``device_kind`` that runs
    ``flops_per_device`` of it (`scamp_jax.hpo.plan_service.PlanningService.step_flops`, the
    engine's figure): those FLOPs at what the kind attains
    (`scamp_jax.scheduling.costs.attainable_flops`, the figure the scheduling core paces
    trials by). None where either is unknown (CPU devices)."""
    from scamp_jax.scheduling.costs import attainable_flops

    attained = attainable_flops(device_kind)
    if not flops_per_device or attained is None:
        return None
    return flops_per_device / attained


#: Least estimated time left for which `progress_note` says it.
PROGRESS_NOTE_MIN_S = 60.0


def progress_note(done: int, count: int, elapsed: float) -> str:
    """What a progress line of a preview adds after ``done`` of ``count`` candidates planned in
    ``elapsed`` seconds: how many, and the time left at the pace so far (a candidate of an
    architecture planned before costs nothing, so it is a rough figure); empty when the rest
    would take less than `PROGRESS_NOTE_MIN_S` or nothing is left."""
    if done <= 0 or done >= count:
        return ""
    left = elapsed / done * (count - done)
    if left < PROGRESS_NOTE_MIN_S:
        return ""
    return f"; {done} of {count} planned, about {format_duration(left)} left"


def cpu_seconds() -> float:
    """CPU seconds this process and its finished children have used (user + system)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def plan_candidates(
    space: Any,
    task: Any,
    settings: Any,
    *,
    devices: Sequence[Any],
    memory_per_device: Any,
    count: int,
    plan_fn: Callable[..., Any] | None = None,
    on_plan: Callable[[CandidatePlan], None] | None = None,
    plan_cache: Any = None,
) -> list[CandidatePlan]:
    """Plan the first ``count`` candidates a new study of ``settings`` would draw.

    Args:
      space, task: the search space and the task (its sample batch, loss and evaluation).
      settings: the study's `scamp_jax.hpo.settings.SearchSettings` (sampler, seed, warm start,
        batch bounds, margin, policy).
      devices: the pool, real devices or a GPU target's compile-only ones.
      memory_per_device: the pool's `scamp_jax.planning.budget.Budget` (or bytes per device).
      count: how many candidates.
      plan_fn: the planner (default ``plan_mesh``, with ``plan_cache`` where given).
      on_plan: called with each `CandidatePlan` as it is made (a progress line).
      plan_cache: a `scamp_jax.PlanCache` (a study folder's ``plans.sqlite``): the plans
        and fused plans it holds are not compiled again, and those made here are kept there
        for the next preview and the study.

    Returns one `CandidatePlan` per candidate, in trial order; a candidate that fits on no
    device count of the pool has ``devices=0`` and its ``error``. With ``settings.fuse``, its
    architecture's widest fused group on its plan is sized as the engine sizes it
    (``fusion_width``, ``group_bytes_per_device``).
    """
    import optuna

    from scamp_jax.hpo.engine import engine_policy, grows_last_wave, max_running
    from scamp_jax.hpo.fused_engine import FusionService
    from scamp_jax.hpo.plan_service import PlanningService
    from scamp_jax.hpo.study.samplers import make_sampler
    from scamp_jax.hpo.study.source import check_grid, check_initial_params
    from scamp_jax.hpo.study.storage import quiet_study_creation
    from scamp_jax.hpo.trial import fusion_cap
    from scamp_jax.planning.compile_events import CompileCounter
    from scamp_jax.planning.planner import DoesNotFitError, plan_mesh

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{count=} must be a positive int: how many candidates to plan")
    devices = list(devices)
    config = settings.engine_config(memory_per_device)
    policy = engine_policy(config, len(devices), grows_last_wave(config, devices))
    if plan_fn is None:
        plan_fn = (plan_mesh if plan_cache is None
                   else functools.partial(plan_mesh, cache=plan_cache))
    service = PlanningService(space, task, config, devices, plan_fn,
                              getattr(policy, "batch_multiple", 1),
                              max_running=max_running(config, devices))
    cap = fusion_cap(config.fuse)
    fusion = None if cap is None else FusionService(space, task, cap, service,
                                                    plan_cache=plan_cache)
    with quiet_study_creation():
        study = optuna.create_study(sampler=make_sampler(settings.sampler, settings.seed,
                                                         space.grid))
    check_grid(space, settings.sampler, settings.seed)  # as the study checks them
    check_initial_params(space, settings.initial_params)
    for params in settings.initial_params:
        study.enqueue_trial(dict(params))
    # With fused groups a study holds siblings of each proposal (its architecture, the
    # sampler's training hyperparameters) and hands them out next
    # (`scamp_jax.hpo.study.OptunaTrialSource`'s ``siblings``): the same trials here.
    siblings = settings.source_kwargs() if fusion is not None else {}
    held: list[dict[str, Any]] = []
    rows: list[CandidatePlan] = []
    seen: dict[int, int] = {}  # plans made here -> the trial they were made for
    kind = str(devices[0].device_kind)

    def timed(params: Mapping[str, Any], plan: Any) -> float | None:
        if compute_seconds(1.0, kind) is None:  # no FLOP/s for this kind: lower nothing
            return None
        return compute_seconds(service.step_flops(params, plan), kind)

    waiting = len(settings.initial_params)  # asked first, as the study does, without siblings
    for _ in range(count):
        proposal = not held and not waiting
        if held and not waiting:
            study.enqueue_trial(held.pop(0), skip_if_exists=False)
        waiting = max(0, waiting - 1)
        trial = study.ask()
        params = space.suggest(trial)
        if proposal:
            keys = siblings.get("training_keys", ())
            held = [{k: v for k, v in params.items() if k not in keys}
                    for _ in range(siblings.get("siblings", 0))]
        cpu, wall = cpu_seconds(), time.perf_counter()
        try:
            # as the study plans it: where the planner's answer is the run's executable (CPU
            # devices), the study it previews loads that step from its compile cache; a trial
            # that will train fused is not run alone (its group's step is the run's)
            plan = service.plan(params, run_ready=fusion is None)
        except DoesNotFitError as err:
            row = CandidatePlan(trial.number, params, 0, 0, 0, 0, err.bytes_needed,
                                err.bytes_available, 0, cpu_seconds() - cpu,
                                time.perf_counter() - wall, str(err))
        else:
            # the service plans an architecture once: a later trial of it reuses that plan
            first = seen.setdefault(id(plan), trial.number)
            new = first == trial.number and not plan.cached
            group, group_compiles = None, 0
            if fusion is not None:  # its compiles counted whether or not a group fits
                with CompileCounter() as counted_compiles:
                    # a study's group holds its trials at most (as `family_width` in one)
                    group = fusion.fusion_plan(params, plan, fusion.signature(params),
                                               settings.trials)
                group_compiles = counted_compiles.total
            row = CandidatePlan(
                trial.number, params, service.devices_of(plan), plan.data_parallel,
                plan.model_parallel, plan.batch_size, plan.predicted_peak_bytes,
                plan.usable_bytes,
                (plan.compiles if new else 0) + group_compiles,
                cpu_seconds() - cpu, time.perf_counter() - wall,
                fusion_width=1 if group is None else group.width,
                group_bytes_per_device=0 if group is None else int(group.predicted_peak_bytes
                                                                   or 0),
                steps=config.steps_for(plan.batch_size),
                planned_with=None if first == trial.number else first,
                step_seconds=timed(params, plan))
        rows.append(row)
        if on_plan is not None:
            on_plan(row)
    return rows


#: `format_rows`'s columns: header and how a row shows it.
_COLUMNS: tuple[tuple[str, Callable[[CandidatePlan], str]], ...] = (
    ("trial", lambda r: str(r.number)),
    ("devices", lambda r: str(r.devices) if r.devices else "-"),
    ("mp", lambda r: str(r.model_parallel) if r.devices else "-"),
    ("batch", lambda r: str(r.batch_size) if r.devices else "-"),
    ("steps", lambda r: str(r.steps) if r.devices else "-"),
    ("bytes/device", lambda r: (format_bytes(r.bytes_per_device) if r.devices
                                else f"needs {format_bytes(r.bytes_per_device)}")),
    ("fused", lambda r: f"x{r.fusion_width}" if r.fusion_width > 1 else "-"),
    ("group bytes/device", lambda r: (format_bytes(r.group_bytes_per_device)
                                      if r.fusion_width > 1 else "-")),
    ("compiles", lambda r: str(r.compiles) if r.planned_with is None
     else f"0 (trial {r.planned_with})"),
    ("CPU-s", lambda r: f"{r.cpu_seconds:.1f}"),
    ("s/step at least", lambda r: _figure(r.step_seconds)),
    ("device-h", lambda r: _figure(r.device_hours)),
)


#: Columns shown where a row has a fused group.
_FUSED_COLUMNS = ("fused", "group bytes/device")
#: Columns shown where a row has a time estimate (`ESTIMATE_NOTE`).
_ESTIMATE_COLUMNS = ("s/step at least", "device-h")


def format_rows(rows: Sequence[CandidatePlan], params: Sequence[str] = ()) -> str:
    """A plain-text table of ``rows``, with the configuration keys ``params`` as columns (the
    fused group's columns where a row has one, the time estimate's where a row has one:
    `ESTIMATE_NOTE`)."""
    fused = any(r.fusion_width > 1 for r in rows)
    timed = any(r.step_seconds is not None for r in rows)
    columns = [(name, show) for name, show in _COLUMNS
               if (fused or name not in _FUSED_COLUMNS)
               and (timed or name not in _ESTIMATE_COLUMNS)]
    header = [name for name, _ in columns] + list(params)
    body = [[show(r) for _, show in columns] + [_value(r.params.get(k, "")) for k in params]
            for r in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *body, strict=True)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(line, widths, strict=True))
                     for line in [header, *body])


def _figure(value: float | None) -> str:
    """Three significant digits without an exponent where one is readable, '-' for none."""
    if value is None:
        return "-"
    return f"{value:.3g}" if value >= 1e-3 else f"{value:.1e}"


def _value(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
