"""The planner's batch search: the largest batch whose compiled training step fits one mesh.

`exact_largest` lets the memory model choose each compile and the compiles decide: it starts at
the batch the known points predict, or, for a new architecture, at the largest batch an estimate
from shapes alone predicts to fit (`BatchSearch.shape_guess`: the traced backward residuals per
sample), compiled exactly as the answer; it moves by the line through the compiled points nearest
the fit/no-fit boundary (one point: proportional to the bytes beyond the persistent state), and
stops when it holds a batch that fits and the next multiple of the search's unit does not (or the
cap), either compiled or put over the budget by a line (`_line_proves_largest`). Memory is only
piecewise affine in the batch (flat at small batches, jumps where XLA changes strategy), so a
prediction never decides a fit: the answer is always compiled, and when secant steps stall,
bisection takes over. The search for one mesh of `scamp_jax.planning.planner.plan_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import jax

from scamp_jax.planning import sharding as sh
from scamp_jax.planning.memory import (
    MemoryEstimate,
    MemoryModel,
    StepCompiler,
    affine_fit,
    with_batch_size,
)

#: Safety loop bound for the batch search (secant steps, then bisection, converge far sooner).
_MAX_SEARCH_COMPILES = 40
#: Safety bound on the search's rounds, each of which compiles a batch not compiled before.
_MAX_SEARCH_ROUNDS = 4 * _MAX_SEARCH_COMPILES
#: Secant steps before the batch search falls back to bisection.
_SECANT_STEPS = 8


def compile_step(
    step: jax.stages.Wrapped,
    compiler: StepCompiler,
    batch_size: int,
    options: dict[str, Any] | None,
) -> tuple[MemoryEstimate, jax.stages.Compiled, jax.stages.Lowered]:
    """Compile ``step`` (``compiler``'s training step) at global ``batch_size``; nothing runs.

    Returns the per-device memory (`MemoryEstimate`, bytes), the executable and its lowering.
    ``options`` are XLA compile options (None: defaults, what a training run compiles).
    """
    return compiler.compile(batch_size, options, step)


@dataclass
class BatchSearch:
    """Compiled peaks known so far for one mesh (mutable, private to one plan).

    ``seen`` may start with points from a `PlanCache` (compiled earlier, same program and mesh
    shape); ``compiles`` counts the compiles this search made. Exact points are compiled with
    the compiler's guidance options (`StepCompiler.compiler_options`), the predicted answer with
    its answer options when ``run_grade_answers``. Batches in ``rough`` were compiled
    with ``rough_options`` (cheaper, figures within ``tolerance`` bytes of exact ones): they guide
    the search and decide fit or no fit only when their need is more than ``tolerance`` away from
    ``usable``; otherwise, and for the answer, the batch is compiled exactly.
    """

    compiler: StepCompiler
    usable: int
    step: jax.stages.Wrapped
    seen: dict[int, MemoryEstimate] = field(default_factory=dict)
    #: executable, lowering and whether it was compiled with the run's XLA options (run grade)
    executables: dict[int, tuple[jax.stages.Compiled, jax.stages.Lowered, bool]] = field(
        default_factory=dict
    )
    compiles: int = 0
    #: per-device bytes of the prefetched next batch per global sample (exactly linear).
    prefetch_per_sample: float = 0.0
    #: compile the batches the memory model predicts to be the answer with the answer's XLA
    #: options (`StepCompiler.answer_options`: on CPU the run's), so that the answer's
    #: executable is the runner's; otherwise with the guidance options like every other point.
    run_grade_answers: bool = False
    rough_options: dict[str, Any] | None = None
    tolerance: int = 0
    rough: set[int] = field(default_factory=set)
    #: the batch step of the search: a multiple of the data-parallel degree (0: that degree).
    unit: int = 0

    def __post_init__(self) -> None:
        self.unit = self.unit or self.compiler.data_parallel

    def peak(self, batch: int, answer: bool = False) -> MemoryEstimate:
        """The compiled memory at ``batch`` (compiled now if not known); ``answer``: the memory
        model predicts ``batch`` to be the largest that fits (compiled exactly)."""
        if batch not in self.seen:
            if answer or self.rough_options is None:
                self._compile(batch, exact=True, answer=answer)
            else:
                self._compile(batch, exact=False, answer=False)
        return self.seen[batch]

    def make_exact(self, batch: int, answer: bool = False) -> None:
        """Compile a rough point again, exactly."""
        if batch in self.rough:
            self._compile(batch, exact=True, answer=answer)

    def _compile(self, batch: int, exact: bool, answer: bool) -> None:
        if not exact:
            options = self.rough_options
        elif answer and self.run_grade_answers:
            options = self.compiler.answer_options
        else:
            options = self.compiler.compiler_options
        run_grade = exact and options == self.compiler.run_options
        estimate, compiled, lowered = compile_step(self.step, self.compiler, batch, options)
        self.compiles += 1
        self.seen[batch] = estimate
        self.executables[batch] = (compiled, lowered, run_grade)
        if exact:
            self.rough.discard(batch)
        else:
            self.rough.add(batch)

    def run_grade(self, batch: int) -> tuple[MemoryEstimate, Any, Any, int]:
        """The step at ``batch`` compiled with the run's XLA options: ``(estimate, executable,
        lowering, compiles made)``; the search's own compile of it when that was run grade,
        else one more compile (counted in ``compiles`` too)."""
        if batch in self.executables and self.executables[batch][2]:
            executable, lowered, _ = self.executables[batch]
            return self.seen[batch], executable, lowered, 0
        estimate, executable, lowered = compile_step(self.step, self.compiler, batch,
                                                     self.compiler.run_options)
        self.compiles += 1
        return estimate, executable, lowered, 1

    def prefetch(self, batch: int) -> int:
        return round(self.prefetch_per_sample * batch)

    def shape_guess(self, cap: int) -> int:
        """The largest multiple of the unit up to ``cap`` that fits by an estimate from shapes
        alone (no compile; 0 if none): the persistent state, the gradients and one more
        parameter-sized update buffer, plus per sample the traced backward residuals and the
        batch (`StepCompiler.traced_bytes_per_sample`) and the prefetched batch. An estimate,
        not a bound: the batch it names is compiled before anything is decided.
        """
        line = self.shape_line()
        room = self.usable - line.fixed_bytes
        if room < 0:
            return 0
        per_sample = line.bytes_per_sample + self.prefetch_per_sample
        best = cap if per_sample <= 0 else min(cap, int(room // per_sample))
        return best // self.unit * self.unit

    def shape_line(self) -> MemoryModel:
        """The step's peak against the batch from shapes alone (what `shape_guess` assumes,
        without the prefetched batch): the persistent state, the gradients and one more
        parameter-sized buffer, plus the traced backward residuals and the batch per sample."""
        compiler = self.compiler
        return MemoryModel(
            fixed_bytes=float(compiler.state_bytes + 2 * compiler.params_bytes),
            bytes_per_sample=compiler.traced_bytes_per_sample(), probe_batches=(),
            probe_peaks=(), batch_multiple=compiler.data_parallel)

    def slope_below(self, batch: int) -> float:
        """Per-device bytes per global sample just above the compiled ``batch``, estimated
        from below: the smallest of the line through ``batch`` and the next smaller compiled
        batch, the one-point line (the bytes beyond the persistent state and the parameters
        taken as proportional to the batch) and the traced slope from shapes (computed only
        when the others leave it to decide). Memory grows faster, not slower, at larger
        batches where XLA changes strategy (flat at small batches, then jumps up), so the
        smallest of these tends to under-state the slope above ``batch``.
        """
        compiler = self.compiler
        peak = self.seen[batch].peak
        estimates = [(peak - compiler.state_bytes - compiler.params_bytes) / batch]
        below = [b for b in self.seen if b < batch]
        if below:
            b0 = max(below)
            estimates.append((peak - self.seen[b0].peak) / (batch - b0))
        return min(estimates)

    def need(self, batch: int) -> int:
        """Per-device bytes of training at ``batch``: compiled peak + prefetched batch."""
        return self.peak(batch).peak + self.prefetch(batch)

    def fits(self, batch: int) -> bool:
        """Whether ``batch`` fits (a rough point too close to call is compiled exactly)."""
        need = self.need(batch)
        if batch in self.rough and abs(need - self.usable) <= self.tolerance:
            self.make_exact(batch)
            need = self.need(batch)
        return need <= self.usable

    def affine(self, a: int, b: int) -> MemoryModel:
        return affine_fit(self.seen[a], self.seen[b], self.compiler.data_parallel)

    def bracket(self, cap: int) -> tuple[int | None, int]:
        """``(lo, hi)``: the smallest known batch that does not fit (``cap + unit`` if none)
        and the largest known multiple of ``unit`` below it that fits (None if none)."""
        dp = self.unit
        over = [b for b in list(self.seen) if b <= cap and not self.fits(b)]
        hi = min(over, default=cap + dp)
        under = [b for b in list(self.seen) if b < hi and b % dp == 0 and self.fits(b)]
        return max(under, default=None), hi


class _NoFit(Exception):
    """Even one sample per data-parallel group does not fit this mesh."""


def _largest_batch(search: BatchSearch, cap: int) -> int:
    """Largest multiple of the search's unit in ``[unit, cap]`` that fits, such that the next
    one does not.

    Each compile is chosen by the memory model through the known points (`_next_guess`); the
    answer ``lo`` is returned only when ``lo`` fits and ``lo + unit`` (or a smaller batch) was
    compiled and does not (or ``lo == cap``). Raises `_NoFit` when ``unit`` itself does not fit.
    """
    dp = search.unit
    secant_steps = 0
    for _ in range(_MAX_SEARCH_ROUNDS):
        # ``hi``, the smallest batch known not to fit, need not be a multiple of the unit (a
        # point compiled under another batch multiple, from the plan cache): the candidates
        # are the multiples strictly between ``lo`` and it
        lo, hi = search.bracket(cap)
        if lo is not None and (hi - lo <= dp or _line_proves_largest(search, lo, hi)):
            return lo
        if lo is None and hi <= dp:  # memory grows with the batch: the unit does not fit
            raise _NoFit
        if search.compiles >= _MAX_SEARCH_COMPILES:
            raise RuntimeError(
                f"batch search did not converge in {_MAX_SEARCH_COMPILES} compiles (fits at "
                f"{lo}, not at {hi}); pass max_batch_size to bound it"
            )
        guess = None
        answer = False
        if secant_steps < _SECANT_STEPS:
            secant_steps += len(search.seen) >= 2
            guess = _model_guess(search, lo, hi, cap)
            # A guess other than the step up from a fitting batch is the prediction of the
            # answer: the first from shapes, later ones from the known points. The step up
            # is one too where there is no cheaper rough setting: when it fits it is the
            # answer, and its compile is then the run's instead of a second one.
            answer = guess is not None and (guess == cap or not search.seen or lo is None
                                            or guess != lo + dp
                                            or search.rough_options is None)
        if guess is None:  # bisection
            low = lo if lo is not None else 0
            candidates = (_top(hi, dp) - low) // dp  # at least one: lo + dp < hi
            guess = low + (candidates + 1) // 2 * dp
        search.peak(guess, answer)
    raise RuntimeError(f"batch search made no progress in {_MAX_SEARCH_ROUNDS} rounds (fits at "
                       f"{lo}, not at {hi}); pass max_batch_size to bound it")


def _top(hi: int, unit: int) -> int:
    """The largest multiple of ``unit`` strictly below ``hi``."""
    return (hi - 1) // unit * unit


def _line_proves_largest(search: BatchSearch, lo: int, hi: int) -> bool:
    """Whether a line through compiled points puts the next batch up, ``lo + unit``, over the
    usable bytes; ``lo`` is exact and fits.

    With a compiled ``hi`` that does not fit, the line between the two; otherwise (``lo`` is
    the largest batch compiled) the figure at ``lo`` plus the slope estimated from below
    (`BatchSearch.slope_below`), and the traced slope from shapes too. The step up is then not
    compiled: the answer is compiled exactly (its figures are the plan's and it fits for
    certain), and only its being the largest rests on the line. Memory is piecewise affine in
    the batch, so a line errs where XLA changes strategy; the cost of such an error is a batch
    smaller than the largest (a step or two where memory is affine near the budget, more where
    it bends between the points, e.g. flat and then rising), never one that does not fit.
    """
    if lo in search.rough or lo not in search.seen:
        return False
    nxt = lo + search.unit
    if hi in search.seen:
        line = search.affine(lo, hi)
        predicted = line.fixed_bytes + line.bytes_per_sample * nxt + search.prefetch(nxt)
        return line.bytes_per_sample > 0 and predicted > search.usable
    peak = search.seen[lo].peak

    def over(slope: float) -> bool:
        return slope > 0 and peak + slope * search.unit + search.prefetch(nxt) > search.usable

    # the traced slope is the dearer estimate (a trace of the backward pass): only when the
    # others agree
    return over(search.slope_below(lo)) and over(search.compiler.traced_bytes_per_sample())


def exact_largest(search: BatchSearch, cap: int) -> int | None:
    """`_largest_batch` whose answer is compiled exactly (its figures are the plan's); None
    when not even the search's unit fits."""
    try:
        while True:
            batch = _largest_batch(search, cap)
            if batch not in search.rough:
                return batch
            # the answer's figures are the plan's: compile it exactly, then look again
            search.make_exact(batch, answer=True)
    except _NoFit:
        return None


def _model_guess(search: BatchSearch, lo: int | None, hi: int, cap: int) -> int | None:
    """The next batch to compile as the memory model through the known points predicts it,
    strictly inside ``(lo, hi)``, a multiple of the search's unit; None when the points say
    nothing useful (then bisect)."""
    dp = search.unit
    seen = search.seen
    low = lo if lo is not None else 0
    if not seen:
        # compiled exactly as the answer: one compile when it fits and the step up does not
        return max(dp, search.shape_guess(cap))
    if len(seen) == 1:
        # One point: the bytes beyond the persistent state and the gradients taken as
        # proportional to the batch (activations); exact when they dominate, as in
        # convolutional and attention models, an over-estimate of the slope otherwise.
        (b0, e0), = seen.items()
        base = search.compiler.state_bytes + search.compiler.params_bytes
        if e0.peak <= base:
            return None
        lines = [MemoryModel(
            fixed_bytes=float(base), bytes_per_sample=(e0.peak - base) / b0,
            probe_batches=(b0,), probe_peaks=(e0.peak,), batch_multiple=dp,
        )]
    else:
        lines = _candidate_lines(search, lo, hi)
    fallback = None
    for line in lines:
        if line.bytes_per_sample <= 0:
            continue
        # the prefetched batch adds its bytes per sample to the compiled slope
        line = replace(line, bytes_per_sample=line.bytes_per_sample + search.prefetch_per_sample)
        predicted = line.max_batch(search.usable, cap=cap) // dp * dp
        if low + dp <= predicted <= _top(hi, dp):
            return predicted
        if fallback is None:
            fallback = min(max(predicted, low + dp), _top(hi, dp))
    return fallback


def _candidate_lines(search: BatchSearch, lo: int | None, hi: int) -> list[MemoryModel]:
    """Pure lines (no floor), best first: through the two latest compiles (secant), the two
    largest batches that fit (the local slope below the boundary), and the bracket's ends."""
    order = list(search.seen)  # insertion order: cached points first, then compiles
    pairs = [(order[-2], order[-1])]
    fitting = sorted(b for b in search.seen if lo is not None and b <= lo)
    if len(fitting) >= 2:
        pairs.append((fitting[-2], fitting[-1]))
    if lo is not None and hi in search.seen:
        pairs.append((lo, hi))
    return [replace(search.affine(a, b), floor_bytes=0.0) for a, b in pairs]


def shape_figures(search: BatchSearch, batch: int) -> tuple[MemoryEstimate, MemoryModel]:
    """The step's memory at ``batch`` and its line from shapes alone (`BatchSearch.shape_line`).
    The compiled figures (``temp``, ``argument``, ``output``, ``alias``) are 0: nothing was
    compiled."""
    compiler, line = search.compiler, search.shape_line()
    peak = line.predict(batch)
    inputs = sh.bytes_per_device(with_batch_size(compiler.sample_batch, batch),
                                 compiler.shardings.batch)
    estimate = MemoryEstimate(
        batch_size=batch, params=compiler.params_bytes, grads=compiler.params_bytes,
        opt_state=compiler.opt_state_bytes, rest=compiler.rest_bytes, inputs=inputs,
        activations_and_temps=peak - compiler.state_bytes - inputs, peak=peak,
        temp=0, argument=0, output=0, alias=0,
    )
    return estimate, line


def local_fit(search: BatchSearch, lo: int, hi: int) -> MemoryModel:
    """Affine model of the compiled peaks up to the answer ``lo``: the secant from the
    smallest compiled batch below it whose peak is lower, so that a step in the peaks between
    two neighbouring batches (other kernels, or XLA rematerialising, at one batch and not the
    next) does not become the slope (a ViT planned for an H100 between 25,300 and 25,302
    samples: 398 MiB a sample, against 2.3 MiB over the search); through the bracket
    ``(lo, hi)`` where nothing lies below."""
    below = sorted(b for b in search.seen if b < lo
                   and search.seen[b].peak < search.seen[lo].peak)
    if below:
        return search.affine(below[0], lo)
    if hi in search.seen:
        return search.affine(lo, hi)
    below = sorted(b for b in search.seen if b <= lo)
    if len(below) >= 2:
        return search.affine(below[-2], below[-1])
    only = search.seen[lo]
    slope = max(0.0, search.slope_below(lo))  # one compile: the slope estimated from below
    return MemoryModel(
        fixed_bytes=only.peak - slope * lo,
        bytes_per_sample=slope,
        probe_batches=(lo,),
        probe_peaks=(only.peak,),
        batch_multiple=search.compiler.data_parallel,
    )
