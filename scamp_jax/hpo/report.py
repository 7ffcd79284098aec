"""What a study leaves behind: results.json / results.csv, three plots, and a summary table.

Rows come from the study itself (its trials and their stored attributes), so a resumed study's
results list every finished trial of every run. The record only grows: every run (finished or
interrupted) appends its own entry (elapsed seconds, usage, timeline) to ``runs``, and the
timeline plots show all runs one after another. Checkpoint paths are relative to the study
directory, so a copied study folder still finds them.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from scamp_jax._files import write_whole
from scamp_jax._units import format_bytes, shortened
from scamp_jax.hpo.checkpoint import copy_checkpoint
from scamp_jax.hpo.failures import TRACEBACK
from scamp_jax.hpo.study import FAIL_REASON, INTERRUPTED
from scamp_jax.hpo.study.storage import earlier_attempts
from scamp_jax.hpo.study.trials import configuration

#: columns every results row has, in CSV order (task metrics follow).
BASE_COLUMNS = (
    "number", "params", "devices", "model_parallel", "batch_size", "predicted_peak_bytes",
    "state", "steps", "wall_seconds",
)
log = logging.getLogger(__name__)
_STATES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed"}


def trial_records(study: optuna.Study, metric_names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One row per finished trial of ``study`` (attempts that were stopped or whose process
    died, since run again, are left out).

    Each row has `BASE_COLUMNS` (a fused member's ``predicted_peak_bytes`` is its group's plan's
    peak for the ``fusion_width`` members it trained with, and ``booked_bytes`` what the ledger
    booked for the group, the allowance learnt included; ``wall_seconds`` its group's, each
    member's, so a sum over a group's rows counts it ``fusion_width`` times; ``steps``: the step
    its training reached; ``wall_seconds``: what its runs took, over every earlier attempt of
    it that a stop ended too, whether or not its checkpoints were resumed; an attempt whose
    process died counts up to its last checkpoint, the one its retry resumed from, and nothing
    where it wrote none or spanned MPI ranks), every name of ``metric_names`` (``None`` when a
    trial has no value for it), and ``rank``, ``replans``,
    ``resizes`` (restarts on more devices at the end of a study), ``retry_of`` (the trial this
    one ran again after a run stopped it, from that trial's checkpoints if it had any; None: a
    first attempt), ``resumed_from`` (the step its training resumed from; 0: none), ``reason``,
    ``checkpoint``, ``drawn`` (Optuna's parameters, where ``params``, the configuration
    ``suggest`` made and the trial trained with, differs from them: a draw it scaled or set
    over, constants it added; what `load_model`, ``initial_params`` and a grid take),
    ``booked_bytes`` (bytes per device the ledger booked for its last run) and
    ``measured_peak_bytes`` (the allocator's peak on its devices, bytes; None where nothing is
    reported, as on CPU devices), ``step_seconds`` (seconds a training step took over its last
    run, for a run that trained all its steps, `scamp_jax.hpo.trial.TrialStatus.step_seconds`),
    and its scheduling record, in seconds since its run began: ``asked_at``, ``planned_at``,
    ``started_at``, ``finished_at``, ``pace`` (``[seconds, step, seconds per step, training
    since]`` at 2, 4, 8, ... steps), ``placements``, ``plan`` and ``core_events`` (what the
    scheduling core was fed), and ``run_started`` (its run's start, Unix time, seconds); a
    trial that failed by raising also has ``traceback``, which ``results.csv`` leaves out. A
    trial that failed before it was placed has ``devices`` empty, and ``batch_size``,
    ``predicted_peak_bytes`` and ``wall_seconds`` 0: none.
    """
    rows = []
    trials = study.get_trials(deepcopy=False)
    by_number = {t.number: t for t in trials}
    for trial in trials:
        if trial.state not in _STATES:
            continue
        attrs = trial.user_attrs
        if trial.state == TrialState.FAIL and attrs.get(FAIL_REASON) in (None, "", INTERRUPTED):
            continue  # stopped or its process died: a retry with its parameters took its place
        metrics = dict(attrs.get("metrics") or {})
        row: dict[str, Any] = {
            "number": trial.number,
            "params": configuration(trial.params, attrs),
            "devices": list(attrs.get("devices", [])),
            "model_parallel": attrs.get("model_parallel"),
            "batch_size": attrs.get("batch_size"),
            "predicted_peak_bytes": attrs.get("predicted_peak_bytes"),
            "state": _STATES[trial.state],
            "steps": attrs.get("steps"),
            "wall_seconds": attrs.get("wall_seconds"),
        }
        earlier = earlier_attempts(trial)
        if earlier and row["wall_seconds"] is not None:  # stopped or dead attempts', too
            row["wall_seconds"] = round(row["wall_seconds"] + sum(
                by_number[n].user_attrs.get("wall_seconds") or 0.0
                for n in earlier if n in by_number), 3)
        for name in metric_names:
            row[name] = metrics.get(name)
        for name, value in metrics.items():
            row.setdefault(name, value)
        row["rank"] = attrs.get("rank", 0)
        row["replans"] = attrs.get("replans", 0)
        row["resizes"] = attrs.get("resizes", 0)
        row["retry_of"] = earlier[-1] if earlier else None
        row["resumed_from"] = attrs.get("resumed_from", 0)
        if row["params"] != dict(trial.params):  # suggest changed or added to what it drew
            row["drawn"] = dict(trial.params)  # what load_model derives the model from
        row["reason"] = attrs.get(FAIL_REASON, "")
        if attrs.get(TRACEBACK):  # a trial that raised: results.json only (not the CSV)
            row[TRACEBACK] = attrs[TRACEBACK]
        row["checkpoint"] = attrs.get("checkpoint")
        row["booked_bytes"] = attrs.get("booked_bytes")
        row["measured_peak_bytes"] = attrs.get("measured_peak_bytes")
        row["step_seconds"] = attrs.get("step_seconds")
        # Horizontal fusion: the fused group the trial trained in (None: alone) and its width.
        row["fused_group"] = attrs.get("fused_group")
        row["fusion_width"] = attrs.get("fusion_width", 1)
        # Scheduling record (seconds since the run's first start; see
        # `scamp_jax.hpo.record.TrialRecord.attrs`): what
        # `python -m benchmarks.simulate_cluster --replay` feeds the scheduling core.
        for name in ("asked_at", "planned_at", "started_at", "finished_at", "placements",
                     "pace", "plan", "core_events", "run_started"):
            row[name] = attrs.get(name)
        rows.append(row)
    return rows


def best_record(
    records: Sequence[Mapping[str, Any]], metric: str, direction: str
) -> Mapping[str, Any] | None:
    """The complete trial with the best ``metric`` (``direction``: maximize/minimize), or None."""
    done = [r for r in records if r["state"] == "complete" and r.get(metric) is not None]
    if not done:
        return None
    pick = max if direction == "maximize" else min
    return pick(done, key=lambda r: r[metric])


def write_results(
    study_dir: str | Path,
    records: Sequence[Mapping[str, Any]],
    *,
    metric: str,
    direction: str,
    run: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.csv``; returns both paths.

    ``results.json`` is ``{"metric", "direction", "best", "trials": [...], "runs": [...],
    "run": ...}``: ``run`` (this run's figures: policy, elapsed seconds, usage, timeline) is
    appended to the ``runs`` of earlier runs already in the file and repeated as ``run``. Where
    the model in ``best_model/`` was tested (`record_test`), ``"test"`` holds its trial's number
    and its test scores.
    """
    study_dir = Path(study_dir)
    study_dir.mkdir(parents=True, exist_ok=True)
    with _locked(study_dir / "results.lock"):  # processes sharing the study append in turn
        return _write_results(study_dir, records, metric, direction, run)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_results(study_dir: Path, records: Sequence[Mapping[str, Any]], metric: str,
                   direction: str, run: Mapping[str, Any] | None) -> tuple[Path, Path]:
    best = best_record(records, metric, direction)
    runs = read_runs(study_dir, keep_damaged=True)
    if run is not None:
        runs.append(dict(run))
    payload = {
        "metric": metric,
        "direction": direction,
        "best": None if best is None else best["number"],
        "trials": list(records),
        "runs": runs,
        "run": runs[-1] if runs else {},
    }
    tested = saved_test(study_dir)
    if tested is not None and best is not None and tested["trial"] == best["number"]:
        payload["test"] = tested  # the best trial's model's, not a model of earlier runs
    json_path = study_dir / "results.json"
    write_whole(json_path, _dumps(payload, indent=2))
    columns = list(BASE_COLUMNS)
    for row in records:
        columns += [k for k in row if k not in columns and k != TRACEBACK]
    csv_path = study_dir / "results.csv"
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    for row in records:
        writer.writerow({
            k: _dumps(v) if isinstance(v, dict | list) else v
            for k, v in row.items() if k != TRACEBACK
        })
    write_whole(csv_path, text.getvalue())
    return json_path, csv_path


def add_run_overhead(study_dir: str | Path, run_id: str, extra: Mapping[str, Any]) -> None:
    """Merge ``extra`` into the ``overhead`` of the run ``run_id`` in
    ``study_dir/results.json``: what is measured after the file was written (the report and
    its plots). By its id, not as the last run: another process on the study may have added
    its own run meanwhile."""
    update_run(study_dir, run_id, lambda run: run.setdefault("overhead", {}).update(extra))


def update_run(study_dir: str | Path, run_id: str,
               change: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``change`` to the entry of the run ``run_id`` in ``study_dir/results.json`` (found
    by its id: another process may have added its own run since), under the results' lock;
    nothing where the file or the entry is not there."""
    study_dir = Path(study_dir)
    path = study_dir / "results.json"
    with _locked(study_dir / "results.lock"):
        if not path.is_file():
            return
        payload = json.loads(path.read_text())
        runs = payload.get("runs") or []
        mine = [run for run in runs if run.get("run_id") == run_id]
        if not mine:
            return
        change(mine[0])
        payload["run"] = runs[-1]
        write_whole(path, _dumps(payload, indent=2))


def read_runs(study_dir: str | Path, *, keep_damaged: bool = False) -> list[dict[str, Any]]:
    """The ``runs`` recorded in ``<study_dir>/results.json`` (oldest first; [] if none).

    A file that is not such a record (edited, or damaged on disk: this module only ever
    replaces it whole) has no runs; with ``keep_damaged`` (before a new record is written over
    it) it is moved aside to ``results.damaged-<time>.json`` with a warning, so the earlier
    runs' figures are not lost unseen (the study itself still has every trial)."""
    path = Path(study_dir) / "results.json"
    if not path.is_file():
        return []
    try:
        payload = json.loads(path.read_text())
        if not isinstance(payload, dict):
            raise ValueError(f"a JSON {type(payload).__name__}, not an object")
    except ValueError as err:  # json.JSONDecodeError included
        if keep_damaged:
            aside = path.with_name(f"results.damaged-{time.strftime('%Y%m%d-%H%M%S')}.json")
            os.replace(path, aside)
            log.warning("%s is not a results record (%s): moved to %s; this run's record "
                        "starts a new file with the study's trials", path, err, aside.name)
        return []
    if "runs" in payload:
        return list(payload["runs"])
    return [payload["run"]] if payload.get("run") else []


def combined_timeline(
    runs: Sequence[Mapping[str, Any]],
) -> tuple[list[list[tuple[int, float, float, int]]], tuple[list[float], list[float]] | None,
           float]:
    """All runs' device intervals and memory series on one time axis (run after run).

    Returns ``(intervals per device, (times s, fractions) or None, total elapsed s)``.
    """
    intervals: list[list[tuple[int, float, float, int]]] = []
    times: list[float] = []
    fractions: list[float] = []
    for run, offset in zip(runs, run_starts(runs), strict=True):
        timeline = run.get("timeline") or {}
        for device, spans in enumerate(timeline.get("intervals") or []):
            while len(intervals) <= device:
                intervals.append([])
            intervals[device] += [(int(t), offset + s, offset + e, int(b)) for t, s, e, b in spans]
        series = timeline.get("memory_series")
        end = offset + float(run.get("elapsed_s") or 0.0)
        if series and series[0]:
            times += [offset + t for t in series[0]] + [end]
            fractions += list(series[1]) + [0.0]  # the pool is empty between runs
    total = sum(float(run.get("elapsed_s") or 0.0) for run in runs)
    return intervals, ((times, fractions) if times else None), total


def run_starts(runs: Sequence[Mapping[str, Any]]) -> list[float]:
    """Where each run begins on `combined_timeline`'s time axis (0.0 for the first)."""
    starts, offset = [], 0.0
    for run in runs:
        starts.append(offset)
        offset += float(run.get("elapsed_s") or 0.0)
    return starts


def _mark_runs(ax: Any, starts: Sequence[float]) -> None:
    """A dashed line where each later run of a resumed study begins, labelled ``run N``; the
    axis reaches the last (a run that trained nothing new starts past every bar: a label
    outside the axes is one no layout fits)."""
    if len(starts) > 1:
        low, high = ax.get_xlim()
        ax.set_xlim(low, max(high, 1.05 * max(starts[1:])))
    for n, start in enumerate(starts[1:], start=2):
        ax.axvline(start, ls="--", color="0.4", linewidth=0.8, zorder=3)
        ax.annotate(f" run {n}", (start, 1.0), xycoords=("data", "axes fraction"),
                    fontsize=7, va="top", color="0.3")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite (a score that diverged) as None: JSON
    has no NaN or infinity, and strict readers (``jq``, a browser's ``JSON.parse``) refuse a
    file that holds them."""
    if hasattr(value, "item") and not isinstance(value, dict | list | tuple):
        value = value.item()  # a NumPy or JAX scalar
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _dumps(value: Any, **kwargs: Any) -> str:
    """``value`` as strict JSON (`_finite`; other objects as `_jsonable` gives them)."""
    return json.dumps(_finite(value), allow_nan=False, default=_jsonable, **kwargs)


def save_best_model(
    study_dir: str | Path, records: Sequence[Mapping[str, Any]], metric: str, direction: str
) -> Path | None:
    """Copy the best trial's final checkpoint to ``<study_dir>/best_model``; its path or None.

    Processes sharing the study save in turn, and one whose records lack a better trial that
    another already saved (its records read before that trial finished) leaves that one in
    place, while that trial's checkpoint is still in the study (a ``best_model`` left by a study
    whose checkpoints were moved away is replaced). The best trial's model saved by an earlier
    run is kept, not copied again. The copy and its ``trial.json`` are made
    beside ``best_model`` and then put in its place, so ``best_model`` never holds parts of two
    trials; a save stopped between the two renames is undone by the next.
    """
    best = best_record(records, metric, direction)
    if best is None or not best.get("checkpoint"):
        return None
    study_dir = Path(study_dir)
    source = study_dir / best["checkpoint"]  # relative to the study (or absolute)
    if not source.is_dir():
        return None
    target = study_dir / "best_model"
    part, old = target.with_name(".best_model.part"), target.with_name(".best_model.old")
    with _locked(study_dir / "results.lock"):
        if old.is_dir() and not target.exists():
            old.rename(target)  # a save stopped between its renames: the model it replaced
        saved = _saved_best(target, study_dir, metric, records)
        same = saved is not None and (saved.get("number"), saved.get("checkpoint")) == (
            best["number"], best["checkpoint"]) and _same_save(source, target)
        if saved is not None and (same
                                  or best_record([best, saved], metric, direction) is saved):
            # this trial's, saved by an earlier run (its checkpoint is final: copied again it
            # could only be worse, where it was damaged since), or a better trial's, saved by
            # a process that saw it finish
            return target
        copy_checkpoint(source, part)
        (part / "trial.json").write_text(_dumps(
            {"number": best["number"], "params": best["params"],
             **({"drawn": best["drawn"]} if best.get("drawn") is not None else {}),
             metric: best[metric],
             "checkpoint": best["checkpoint"]},
            indent=2,
        ))
        if old.exists():
            shutil.rmtree(old)
        if target.exists():
            target.rename(old)
        part.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    return target


def _same_save(source: Path, copy: Path) -> bool:
    """Whether ``copy`` was copied from the checkpoint in ``source`` as it was saved: orbax's
    record of the save (``_CHECKPOINT_METADATA``, its times to the nanosecond) the same in
    both. A study of the same name made again after its outputs were moved away (but for
    ``best_model/``) writes the same trial numbers and checkpoint folders anew."""
    try:
        return ((source / _CHECKPOINT_RECORD).read_bytes()
                == (copy / _CHECKPOINT_RECORD).read_bytes())
    except OSError:
        return False


#: Orbax's record of a checkpoint's save in its step directory (copied with it).
_CHECKPOINT_RECORD = "_CHECKPOINT_METADATA"


def _saved_best(directory: Path, study_dir: Path, metric: str,
                records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The ``trial.json`` of the best model saved in ``directory`` as a complete record with
    ``metric``, while the checkpoint it was copied from is still in ``study_dir`` and the trial
    of its number in ``records`` (where they have it: another process may have finished it
    since, or it was running when they were read) has its parameters and score (None: none
    saved, without that metric or its
    checkpoint, or from another study: one whose outputs were moved away but for
    ``best_model/``, whose trial numbers and checkpoint folders a new study writes again)."""
    try:
        saved = json.loads((directory / "trial.json").read_text())
        value = float(saved[metric])
        checkpoint = study_dir / saved["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not checkpoint.is_dir():
        return None
    same = [r for r in records if r.get("number") == saved.get("number")]
    if same and (same[0].get("params") != saved.get("params")
                 or same[0].get(metric) not in (None, value)):  # None: running when read
        return None
    return {**saved, "state": "complete", metric: value}


def record_test(study_dir: str | Path, number: int,
                scores: Mapping[str, float] | None) -> dict[str, Any] | None:
    """Write the test ``scores`` of trial ``number``'s model into ``best_model/trial.json``
    and ``results.json`` (``"test"``, where trial ``number`` is its best), or with ``scores``
    None take that trial's test out of both (this run took none: no earlier run's stays).
    Returns ``{"trial": number, **scores}`` as written (a score that is no finite number as
    None); None, writing nothing, where ``best_model/`` holds another trial's model by now
    (another process saved a better one)."""
    study_dir = Path(study_dir)
    saved = study_dir / "best_model" / "trial.json"
    with _locked(study_dir / "results.lock"):
        try:
            record = json.loads(saved.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("number") != number:
            return None
        written = {"trial": number, **_finite(dict(scores or {}))}
        if scores is not None:
            record["test"] = dict(scores)
            write_whole(saved, _dumps(record, indent=2))
        elif record.pop("test", None) is not None:
            write_whole(saved, _dumps(record, indent=2))
        try:
            payload = json.loads((study_dir / "results.json").read_text())
        except (OSError, ValueError):  # none yet, or damaged: the next write reads trial.json
            return written
        if not isinstance(payload, dict):
            return written
        if scores is not None and payload.get("best") == number:
            payload["test"] = written
        elif scores is None and (payload.get("test") or {}).get("trial") == number:
            del payload["test"]
        else:
            return written
        write_whole(study_dir / "results.json", _dumps(payload, indent=2))
    return written


def saved_test(study_dir: str | Path) -> dict[str, Any] | None:
    """``{"trial": number, **scores}``: the test scores of the model in ``best_model/`` (None:
    none saved, or not tested)."""
    try:
        record = json.loads((Path(study_dir) / "best_model" / "trial.json").read_text())
        scores = dict(record["test"])
        return {"trial": int(record["number"]), **scores}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def plot_results(
    study_dir: str | Path,
    records: Sequence[Mapping[str, Any]],
    *,
    metric: str,
    baseline: str | None = None,
    intervals: Sequence[Sequence[tuple[int, float, float, int]]] = (),
    memory_series: tuple[Sequence[float], Sequence[float]] | None = None,
    elapsed_s: float | None = None,
    capacity_bytes: int | None = None,
    run_marks: Sequence[float] = (),
    device_labels: Sequence[str] | None = None,
) -> list[Path]:
    """Write the plots as PNG files in ``study_dir`` and return their paths.

    - ``<metric>_per_trial.png``: the metric of every complete trial (and ``baseline`` per trial,
      e.g. bicubic PSNR, as a dashed line);
    - ``device_timeline.png``: which trial held which device when (``intervals``: per device,
      ``(trial, start_s, end_s, bytes)``; a fused group's bar is its first member's number
      and its width, ``4 x2``, as the summary table's group column);
    - ``memory_utilization.png``: reserved fraction of the pool's memory over time.

    ``run_marks``: where each run of a resumed study begins on the time axis
    (`run_starts`); both time plots mark the later ones. ``device_labels``: the timeline's
    row names where its devices are several ranks' (`device_labels`), else rows are numbered.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study_dir = Path(study_dir)
    paths = []
    done = [r for r in records if r["state"] == "complete" and r.get(metric) is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    numbers = [r["number"] for r in done]
    ax.plot(numbers, [r[metric] for r in done], "o", label=metric)
    if baseline and any(r.get(baseline) is not None for r in done):
        ref = [r[baseline] for r in done if r.get(baseline) is not None]
        ax.axhline(sum(ref) / len(ref), ls="--", color="gray", label=baseline)
    # Trial numbers, no halves. The axis' locator is an AutoLocator, whose set_params takes
    # ``integer``; matplotlib's stub types it as a Locator, whose set_params takes nothing.
    ax.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]
    ax.set_xlabel("trial number")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} of each complete trial")
    ax.legend()
    fig.tight_layout()
    paths.append(study_dir / f"{metric}_per_trial.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 0.4 * max(len(intervals), 1) + 1.5))
    cmap = plt.get_cmap("tab20")
    widths = _group_widths(records)
    for device in range(len(intervals)):  # each device's row: its whole memory, outlined
        ax.axhspan(device - 0.4, device + 0.4, facecolor="0.96", edgecolor="0.75",
                   linewidth=0.5, zorder=0)
    for device, spans in enumerate(intervals):
        for i, (trial, start, end, nbytes) in enumerate(spans):
            # Trials sharing a device are stacked within its row in proportion to their memory
            # (a sliver at least, so that small trials stay visible).
            share = min(nbytes / capacity_bytes, 1.0) if capacity_bytes else 1.0
            below = sum(b for _, s0, e0, b in spans[:i] if s0 <= start < e0)
            offset = min(below / capacity_bytes, 0.9) if capacity_bytes else 0.0
            ax.broken_barh([(start, end - start)],
                           (device - 0.4 + 0.8 * offset, 0.8 * max(share, 0.1)),
                           color=cmap(trial % 20), edgecolor="black", linewidth=0.3)
            ax.text(start, device - 0.4 + 0.8 * offset, f" {trial}{widths.get(trial, '')}",
                    fontsize=7, va="bottom")
    ax.set_yticks(range(len(intervals)))
    labelled = device_labels is not None and len(device_labels) == len(intervals)
    if device_labels is not None and labelled:
        ax.set_yticklabels(device_labels, fontsize=7)
    # each device's row spans its whole memory, so a bar's height reads as its share (with one
    # device an axis fitted to the bars would stretch any of them to the full height)
    ax.set_ylim(-0.5, max(len(intervals), 1) - 0.5)
    ax.set_xlim(0, elapsed_s or None)  # the whole study: devices idle at its end too
    _mark_runs(ax, run_marks)
    ax.set_ylabel("rank:device" if labelled else "device")
    ax.set_xlabel("seconds")
    ax.set_title("device occupancy (bar height: share of the device's memory)")
    fig.tight_layout()
    paths.append(study_dir / "device_timeline.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    if memory_series is not None and memory_series[0]:
        times = list(memory_series[0]) + ([elapsed_s] if elapsed_s else [])
        fractions = list(memory_series[1]) + ([memory_series[1][-1]] if elapsed_s else [])
        ax.step(times, [100 * f for f in fractions], where="post")
    ax.set_ylim(0, _memory_axis_top(memory_series))
    _mark_runs(ax, run_marks)
    ax.set_xlabel("seconds")
    ax.set_ylabel("booked memory (% of pool)")
    ax.set_title("memory the running trials' plans book on the pool")
    fig.tight_layout()
    paths.append(study_dir / "memory_utilization.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def _memory_axis_top(memory_series: tuple[Sequence[float], Sequence[float]] | None) -> float:
    """The top of the memory plot's axis, % of the pool: the whole pool where a study books
    much of it, else a little above its peak (a small study's booking, e.g. 0.5% of the pool,
    would lie flat on a whole pool's axis)."""
    peak = 100 * max((memory_series[1] if memory_series else None) or [0.0])
    return 105.0 if peak > 40 else max(5.0, 1.3 * peak)


def _group_widths(records: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """``" xK"`` by fused group (its id, its first member's number, names the group's run in
    the device timeline), as the summary table's group column."""
    return {int(r["fused_group"]): f" x{r.get('fusion_width', '?')}" for r in records
            if r.get("fused_group") is not None}


def summary_table(
    records: Sequence[Mapping[str, Any]], metric: str, direction: str, *,
    baseline: str | None = None, top: int = 5, width: int | None = None,
) -> Any:
    """A rich ``Table`` of the ``top`` best complete trials, best first (its title says how
    many of how many where there are more); where it is wider than
    ``width`` columns (a narrow terminal, which would cut its cells to nothing), the same as
    lines of text that wrap: each trial's figures, then its parameters."""
    from rich.console import Console, Group
    from rich.text import Text

    ranked = _best(records, metric, direction)
    done = ranked[:top]
    title = (f"best {len(done)} of {len(ranked)} complete trials by {metric} (results.csv "
             "has every trial)" if len(ranked) > len(done) else f"best trials by {metric}")
    table = _summary_table(done, metric, baseline, title=title)
    # the table reads while its params column (which wraps) keeps room for a few of them
    others = Console(width=10_000).measure(_summary_table(done, metric, baseline, params=False))
    if width is None or others.maximum + _PARAMS_WIDTH <= width:
        return table
    lines = [Text(title, style="italic")]
    for r in done:
        score = f"{metric} {r[metric]:.5g}"
        if baseline and r.get(baseline) is not None:
            score += f" ({baseline} {r[baseline]:.5g})"
        peak = format_bytes(r["predicted_peak_bytes"] or 0).replace(" ", "\u00a0")  # one word
        group = "" if r.get("fused_group") is None else f" (fused group {_group(r)})"
        group_run = "" if r.get("fused_group") is None else " (its group's run)"
        lines.append(Text(
            f"trial {r['number']}{group}: {score}; {_devices(r, ' device(s)')}, mp "
            f"{r['model_parallel']}, batch {r['batch_size']}, {peak}/device"
            f"{'' if r.get('fused_group') is None else ' for its group'}, {r['steps']} "
            f"steps, {r['wall_seconds']:.1f} s{group_run}"))
        lines.append(Text("  " + _params(r), style="dim"))
    return Group(*lines)


def _best(records: Sequence[Mapping[str, Any]], metric: str,
          direction: str) -> list[Mapping[str, Any]]:
    done = [r for r in records if r["state"] == "complete" and r.get(metric) is not None]
    return sorted(done, key=lambda r: r[metric], reverse=direction == "maximize")


def _params(row: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={_short(v)}" for k, v in row["params"].items())


#: the narrowest params column the summary table is drawn with (else: lines of text)
_PARAMS_WIDTH = 32


def _devices(record: Mapping[str, Any], unit: str = "") -> str:
    """A trial's devices, counted (then ``unit``): a trial that spanned MPI ranks (its
    ``rank`` a list) held its ``devices`` on each of them, ``"2 (1 on each of 2 ranks)"``."""
    ranks = record.get("rank")
    count = len(record["devices"])
    if isinstance(ranks, list) and len(ranks) > 1:
        return f"{count * len(ranks)}{unit} ({count} on each of {len(ranks)} ranks)"
    return f"{count}{unit}"


def _summary_table(done: Sequence[Mapping[str, Any]], metric: str, baseline: str | None,
                   params: bool = True, title: str | None = None) -> Any:
    from rich.table import Table

    table = Table(title=title or f"best trials by {metric}")
    fused = any(r.get("fused_group") is not None for r in done)
    # a fused member's peak and seconds are its group's (what was booked for the group it
    # trained in, and the group's run)
    peak = "peak/device (of its group)" if fused else "peak/device"
    seconds = "seconds (of its group)" if fused else "seconds"
    for name in ("trial", *(["group"] if fused else []), "params", "devices", "mp", "batch",
                 peak, "steps", seconds, metric, *([baseline] if baseline else [])):
        table.add_column(name)
    for r in done:
        shown = _params(r) if params else ""
        cells = [str(r["number"]), *([_group(r)] if fused else []), shown,
                 _devices(r), str(r["model_parallel"]),
                 str(r["batch_size"]), format_bytes(r["predicted_peak_bytes"] or 0),
                 str(r["steps"]), f"{r['wall_seconds']:.1f}", f"{r[metric]:.5g}"]
        if baseline:
            cells.append("" if r.get(baseline) is None else f"{r[baseline]:.5g}")
        table.add_row(*cells)
    return table


def _group(row: Mapping[str, Any]) -> str:
    """A fused member's group (its id, the smallest member number) and width, e.g. ``0 x4``;
    ``-`` for a trial that trained alone."""
    group = row.get("fused_group")
    return "-" if group is None else f"{group} x{row.get('fusion_width', '?')}"


#: The most characters of a failed trial's reason the verdict shows (the whole reason is in
#: results.csv).
REASON_CHARS = 300


def verdict(records: Sequence[Mapping[str, Any]], metric: str, direction: str,
            baseline: str | None, test: Mapping[str, Any] | None = None) -> str:
    """The best trial's metric against its baseline (e.g. bicubic PSNR), and where its model
    was tested (``test``: `saved_test`'s record), a second line: the same on the test data;
    then, where trials failed, how many and why the first did."""
    best = best_record(records, metric, direction)
    failed = [r for r in records if r["state"] == "failed"]
    where = ("see the 'reason' column of results.csv (and the traceback of a trial that "
             "raised in results.json)")
    if best is None:
        return f"no trial completed ({len(failed)} failed{_why(failed)}); {where}"
    line = (f"best trial {best['number']}: {metric} {best[metric]:.5g}"
            + _against(best, metric, direction, baseline))
    if test is not None and test.get("trial") == best["number"] and metric in test:
        line += "\n  tested on data no trial was chosen by (the task's test): " + (
            f"{metric} {test[metric]:.5g}" + _against(test, metric, direction, baseline)
            if test[metric] is not None else f"{metric} no finite number")
    if failed:  # said with the best, not only in results.csv
        line += f"\n  {len(failed)} of {len(records)} trials failed{_why(failed)}; {where}"
    return line


def _why(failed: Sequence[Mapping[str, Any]]) -> str:
    """``"; trial N: REASON[; K other reason(s)]"``: why the first of ``failed`` failed (cut
    at a word where long), and how many other reasons there were ("" where none says)."""
    reasons = list(dict.fromkeys(r["reason"] for r in failed if r.get("reason")))
    if not reasons:
        return ""
    first = next(r for r in failed if r.get("reason") == reasons[0])
    return (f"; trial {first['number']}: {shortened(reasons[0], REASON_CHARS)}"
            + (f"; {len(reasons) - 1} other reason(s)" if len(reasons) > 1 else ""))


def _against(scores: Mapping[str, Any], metric: str, direction: str,
             baseline: str | None) -> str:
    """" vs BASELINE B (+D, beats the baseline)" for ``scores`` holding both (else "")."""
    if not baseline or scores.get(baseline) is None:
        return ""
    gain = scores[metric] - scores[baseline]
    better = gain > 0 if direction == "maximize" else gain < 0
    # the difference of the two figures as shown, so the line adds up as read (the scores'
    # own where the figures show none)
    shown = float(f"{scores[metric]:.5g}") - float(f"{scores[baseline]:.5g}")
    difference = f"{shown:+.4g}" if shown or not gain else f"{gain:+.2g}"
    return (f" vs {baseline} {scores[baseline]:.5g} ({difference}, "
            f"{'beats' if better else 'does not beat'} the baseline)")


def _short(value: Any) -> str:
    if isinstance(value, float) and value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e4):
        return f"{value:.2e}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def run_summary(result: Any, devices: int, memory_per_device: int) -> dict[str, Any]:
    """The ``run`` section of ``results.json`` for one engine run (a
    `scamp_jax.hpo.engine.SearchResult`) on ``devices`` devices."""
    return {
        # memory_per_device, safety_margin, the booked share, the active policy parts, ...
        **dict(result.scheduling),
        "policy": result.policy,
        "devices": devices,
        "memory_per_device": memory_per_device,
        "elapsed_s": result.elapsed_s,
        "usage": dict(result.usage),
        "step_cache": dict(result.step_cache),
        "trials_this_run": len(result.outcomes),
        "timeline": {
            "intervals": [[list(span) for span in spans] for spans in result.intervals],
            "memory_series": [list(result.memory_series[0]), list(result.memory_series[1])]
            if result.memory_series is not None else None,
        },
    }


def ranks_timeline(timelines: Sequence[Mapping[str, Any]],
                   devices: Sequence[int]) -> dict[str, Any]:
    """One pool's ``timeline`` (as `run_summary` writes it) from those of ranks that ran at once,
    rank ``r`` on ``devices[r]`` devices of one budget each: the devices of rank 0 first, then
    rank 1's, and so on, and at each time the reserved fraction of all their memory together.
    Times are each rank's seconds since its engine started (the ranks start after a barrier)."""
    import bisect

    intervals: list[list[list[Any]]] = []
    series = []
    for timeline, count in zip(timelines, devices, strict=True):
        spans = [list(map(list, device)) for device in timeline.get("intervals") or []]
        intervals += spans + [[] for _ in range(count - len(spans))]
        if timeline.get("memory_series"):
            series.append((*timeline["memory_series"], count))
    times = sorted({t for ts, _, _ in series for t in ts})
    total = sum(devices)
    fractions = []
    for t in times:  # each rank's step function holds its last value up to t
        held = 0.0
        for ts, fs, count in series:
            i = bisect.bisect_right(ts, t) - 1
            held += fs[i] * count if i >= 0 else 0.0
        fractions.append(held / total)
    return {"intervals": intervals, "memory_series": [times, fractions] if times else None,
            "devices_per_rank": list(devices)}


def device_labels(runs: Sequence[Mapping[str, Any]]) -> list[str] | None:
    """Names of `combined_timeline`'s device rows where the runs ran on several MPI ranks,
    each with the same devices (`ranks_timeline`'s ``devices_per_rank``): ``"rank R:D"`` for
    rank R's device D; None where a row is one process's device (or the runs' layouts differ,
    when a row is no one device throughout). A stopped run of several ranks recorded rank 0's
    devices alone (no ``devices_per_rank``): its rows are rank 0's first ones."""
    layouts, rank_0_only = set(), []
    for run in runs:
        timeline = run.get("timeline")
        if not timeline:
            continue
        if timeline.get("devices_per_rank"):
            layouts.add(tuple(timeline["devices_per_rank"]))
        elif int(run.get("ranks") or 1) > 1:
            rank_0_only.append(len(timeline.get("intervals") or ()))
        else:
            layouts.add(())
    if len(layouts) != 1:
        return None
    (layout,) = layouts
    if len(layout) < 2 or any(count > layout[0] for count in rank_0_only):
        return None
    return [f"rank {rank}:{device}" for rank, count in enumerate(layout)
            for device in range(count)]


__all__ = [
    "best_record",
    "device_labels",
    "plot_results",
    "record_test",
    "save_best_model",
    "saved_test",
    "summary_table",
    "trial_records",
    "verdict",
    "write_results",
    "read_runs",
    "combined_timeline",
    "run_starts",
    "run_summary",
    "ranks_timeline",
]
