"""The batch search (`scamp_jax.planning.batch_search`) against stand-in compilers whose peaks
are a function of the batch: every path of the search without XLA, in milliseconds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import pytest

from scamp_jax.planning.batch_search import BatchSearch, _top, exact_largest, local_fit
from scamp_jax.planning.memory import MemoryEstimate


class _Compiler:
    """A stand-in for `StepCompiler`: ``peak_of(batch)`` is the compiled peak; ``compiled``
    lists the batches compiled, in order."""

    compiler_options = {"xla_backend_optimization_level": "0"}
    answer_options = run_options = rough_options = None

    def __init__(self, peak_of: Callable[[int], int], data_parallel: int = 1,
                 state_bytes: int = 1000, params_bytes: int = 100,
                 traced_per_sample: float = 10.0) -> None:
        self.peak_of, self.data_parallel = peak_of, data_parallel
        self.state_bytes, self.params_bytes = state_bytes, params_bytes
        self.opt_state_bytes, self.rest_bytes = state_bytes - params_bytes, 0
        self.traced = traced_per_sample
        self.compiled: list[int] = []

    def traced_bytes_per_sample(self) -> float:
        return self.traced

    def compile(self, batch: int, options: object, step: object) -> tuple[MemoryEstimate, None,
                                                                           None]:
        self.compiled.append(batch)
        peak = int(self.peak_of(batch))
        return MemoryEstimate(batch_size=batch, params=self.params_bytes, grads=self.params_bytes,
                              opt_state=self.opt_state_bytes, rest=0, inputs=0,
                              activations_and_temps=peak - self.state_bytes, peak=peak,
                              temp=peak, argument=0, output=0, alias=0), None, None


def _search(compiler: _Compiler, usable: int, prefetch: float = 0.0) -> BatchSearch:
    # the stand-in has what the search reads of a StepCompiler; nothing calls the step
    return BatchSearch(cast(Any, compiler), usable, step=cast(Any, None),
                       prefetch_per_sample=prefetch)


def test_top_is_the_largest_multiple_strictly_below() -> None:
    assert _top(16, 4) == 12  # 16 itself is known not to fit
    assert _top(17, 4) == 16
    assert _top(13, 4) == 12
    assert _top(1, 1) == 0


def test_a_step_in_memory_above_the_answer_leaves_the_largest_batch_found() -> None:
    """Memory affine in the batch with a step of 3,000 bytes at 320 samples (XLA changing
    strategy): with 8 data-parallel groups the largest batch that fits is 312, the multiple
    just below the step, and the search compiles it rather than stopping at 304 on a line
    through the step."""
    compiler = _Compiler(lambda b: 1300 + 27 * b + (3000 if b >= 320 else 0), data_parallel=8,
                         traced_per_sample=27.0)
    search = _search(compiler, 10881)
    assert exact_largest(search, 1760) == 312
    assert 312 in compiler.compiled and 320 in compiler.compiled


def _affine_cases(seeds: int = 10, each: int = 200
                  ) -> list[tuple[int, int, int, float, float, int, int]]:
    """``(data_parallel, fixed, slope, traced, prefetch, usable, cap)`` of memory affine in the
    batch: the trace over- or under-states the slope, a prefetched batch or none."""
    import random

    cases = []
    for seed in range(seeds):
        rng = random.Random(seed)
        for _ in range(each):
            dp = rng.choice([1, 2, 4, 8])
            slope = rng.randint(5, 50)
            cases.append((dp, 1300, slope, rng.choice([0.1, 0.5, 1.0, 2.0]) * slope,
                          rng.choice([0.0, 2.0]), rng.randint(1500, 12000),
                          rng.randint(1, 400) * dp))
    return cases


def test_on_affine_memory_the_answer_fits_and_misses_the_largest_by_a_unit_at_most() -> None:
    """Memory exactly affine in the batch (what the planner's lines assume), 2,000 cases: the
    answer always fits, is the largest multiple of the unit up to the cap that fits wherever
    the trace does not over-state the slope, and at most one unit below it where it does (a
    fixed part beyond the state and the parameters makes the one-point slope over-state too
    at a batch of one or two units, and the two agree that the next unit is over: the
    documented cost of the lines, `_line_proves_largest`), in at most three compiles (the
    first guess, a secant step, its neighbour)."""
    below = 0
    for dp, fixed, slope, traced, prefetch, usable, cap in _affine_cases():
        def affine(b: int, f: int = fixed, s: int = slope) -> int:
            return f + s * b

        compiler = _Compiler(affine, data_parallel=dp, traced_per_sample=traced)
        answer = exact_largest(_search(compiler, usable, prefetch), cap)
        fitting = [b for b in range(dp, cap + 1, dp)
                   if fixed + slope * b + round(prefetch * b) <= usable]
        largest = max(fitting, default=None)
        case = dict(dp=dp, slope=slope, traced=traced, prefetch=prefetch, usable=usable, cap=cap,
                    compiled=compiler.compiled)
        if largest is None or traced <= slope:
            assert answer == largest, case
        else:
            assert answer is not None and largest - dp <= answer <= largest, case
            below += answer < largest
        assert len(compiler.compiled) <= 3, case
    assert 0 < below < 20  # the over-stating trace costs a unit in a few cases, not in many


def test_a_batch_whose_need_is_the_usable_bytes_to_the_byte_fits() -> None:
    # 1300 + 10 * 140 = 2700: the usable bytes exactly
    compiler = _Compiler(lambda b: 1300 + 10 * b, traced_per_sample=20.0)
    assert exact_largest(_search(compiler, 2700), 275) == 140


def test_the_shape_line_books_the_state_the_gradients_and_one_more_update_buffer() -> None:
    compiler = _Compiler(lambda b: 1300 + 12 * b, state_bytes=1000, params_bytes=100,
                         traced_per_sample=24.0)
    search = _search(compiler, 1524)
    line = search.shape_line()
    assert (line.fixed_bytes, line.bytes_per_sample) == (1200.0, 24.0)
    assert search.shape_guess(97) == 13  # (1524 - 1200) // 24
    # the trace over-states the slope twice: the search still reaches the largest batch, 18
    assert exact_largest(search, 97) == 18


def test_a_cap_that_does_not_fit_is_an_upper_bracket() -> None:
    """The cap compiled and over the budget bounds the search like any batch that does not
    fit: a unit that does not fit at a cap of one unit is no fit (None), not a search that
    makes no progress; a step in memory at the cap leaves the batch below it."""
    one_unit = _Compiler(lambda b: 1300 + 50 * b, data_parallel=2, traced_per_sample=5.0)
    assert exact_largest(_search(one_unit, 1350), 2) is None
    step = _Compiler(lambda b: 1300 + 5 * b + (300 if b >= 193 else 0), traced_per_sample=0.5)
    assert exact_largest(_search(step, 2441), 193) == 192


def test_the_slope_from_below_is_the_smaller_of_the_one_point_and_the_secant_estimates() -> None:
    """Memory affine with a fixed part beyond the state and the parameters (1,300 bytes against
    1,100): the one-point estimate over-states the slope, the secant through the two largest
    compiled batches does not, and the smaller one decides that the step up from 24 samples
    may still fit (it does: 32 is the largest)."""
    compiler = _Compiler(lambda b: 1300 + 34 * b, data_parallel=8, traced_per_sample=68.0)
    search = _search(compiler, 2495, prefetch=2.0)
    search.peak(16)
    search.peak(24)
    assert search.slope_below(24) == 34.0  # not (2116 - 1100) / 24 = 42.3
    assert exact_largest(_search(_Compiler(compiler.peak_of, data_parallel=8,
                                           traced_per_sample=68.0), 2495, prefetch=2.0),
                         760) == 32


#: The stand-in's rough setting (the search's ``rough_options``): figures off by an offset.
_ROUGH = {"xla_cpu_use_fusion_emitters": False}


class _RoughCompiler(_Compiler):
    """A stand-in with a rough setting: a batch compiled with ``_ROUGH`` reports
    ``peak_of(batch) + rough_offset``; ``kinds`` lists ``(batch, "rough" or "exact")`` of every
    compile, in order (a runaway search fails at 60)."""

    def __init__(self, peak_of: Callable[[int], int], rough_offset: int, **kwargs: Any) -> None:
        super().__init__(peak_of, **kwargs)
        self.rough_offset = rough_offset
        self.kinds: list[tuple[int, str]] = []

    def compile(self, batch: int, options: object, step: object) -> tuple[MemoryEstimate, None,
                                                                           None]:
        estimate, _, _ = super().compile(batch, options, step)
        rough = options == _ROUGH
        self.kinds.append((batch, "rough" if rough else "exact"))
        assert len(self.kinds) <= 60, f"the search does not stop: {self.kinds}"
        if rough:
            estimate = replace(estimate, peak=estimate.peak + self.rough_offset)
        return estimate, None, None


def _rough_search(compiler: _RoughCompiler, usable: int, tolerance: int) -> BatchSearch:
    return BatchSearch(cast(Any, compiler), usable, step=cast(Any, None),
                       rough_options=_ROUGH, tolerance=tolerance)


def test_rough_figures_near_the_budget_are_compiled_exactly_and_the_answer_is_exact() -> None:
    """With a rough setting (cheaper compiles whose figures are within ``tolerance`` of exact
    ones), the first guess, the predicted answer, is compiled exactly; the step up from a
    fitting batch is compiled rough, and a rough need within the tolerance of the usable bytes,
    at the tolerance to the byte included, decides nothing: that batch is compiled exactly
    (here it fits, though its rough figure is over the budget). The answer returned is
    exact: its figure is the exact compile's and no longer marked rough (the line through
    the compiled points puts 344 over the budget without compiling it). A step up that is the
    cap is the predicted answer too: compiled exactly at once."""
    usable = 10902
    tolerance = int(0.005 * usable)  # ROUGH_TOLERANCE of the budget: 54 bytes

    def affine(b: int) -> int:
        return 1300 + 28 * b

    # rough at 336 is 10,708 + 248 bytes: the usable bytes plus the tolerance
    compiler = _RoughCompiler(affine, rough_offset=248, data_parallel=8,
                              traced_per_sample=56.0)
    search = _rough_search(compiler, usable, tolerance)
    assert exact_largest(search, 376) == 336  # 344 needs 10,932: the largest that fits
    assert compiler.kinds == [(168, "exact"), (328, "exact"), (336, "rough"), (336, "exact")]
    assert not search.rough and search.seen[336].peak == affine(336)
    # rough figures 5 bytes over: 336 fits by its rough compile, far from the budget, so it
    # is compiled exactly once it is the answer, as the last compile
    compiler = _RoughCompiler(affine, rough_offset=5, data_parallel=8, traced_per_sample=56.0)
    search = _rough_search(compiler, usable, tolerance)
    assert exact_largest(search, 376) == 336
    assert (336, "rough") in compiler.kinds and compiler.kinds[-1] == (336, "exact")
    assert not search.rough and search.seen[336].peak == affine(336)
    # the step up that is the cap is the answer when it fits: compiled exactly at once
    compiler = _RoughCompiler(lambda b: 1300 + 10 * b, rough_offset=3, traced_per_sample=20.25)
    search = _rough_search(compiler, 2000, 10)
    assert exact_largest(search, 40) == 40
    assert compiler.kinds == [(39, "exact"), (40, "exact")]


def test_the_runs_step_is_a_compile_with_the_runs_options_and_is_counted() -> None:
    """`BatchSearch.run_grade` hands the run the search's own executable only where the
    search compiled that batch with the run's options; a batch compiled with the guidance
    options (a bisection step, say) is compiled once more with the run's, and that compile
    counts."""
    compiler = _Compiler(lambda b: 1300 + 10 * b)
    compiler.run_options = {"xla_backend_optimization_level": "2"}  # the run's own options
    search = _search(compiler, 2700)
    search.peak(64)  # a guidance compile
    assert (search.compiles, compiler.compiled) == (1, [64])
    estimate, _, _, made = search.run_grade(64)
    assert (made, search.compiles, compiler.compiled) == (1, 2, [64, 64])
    assert estimate.peak == 1300 + 10 * 64
    search.run_grade_answers = True
    compiler.answer_options = compiler.run_options  # as on CPU: the answer is the run's
    search.peak(72, answer=True)
    assert search.run_grade(72)[3] == 0 and search.compiles == 3  # that compile is the run's


def test_where_the_lines_stall_bisection_finds_the_largest_batch() -> None:
    """Memory flat up to 100 samples and then steep (3,000 bytes a sample), a trace that sees
    no growth: the lines through the flat points step one sample at a time, so after the
    secant steps the search bisects, and finds 101 (5,000 bytes, the usable bytes), well
    within the compile bound."""
    compiler = _Compiler(lambda b: 2000 if b <= 100 else 2000 + 3000 * (b - 100),
                         traced_per_sample=0.0)
    assert exact_largest(_search(compiler, 5000), 1 << 16) == 101
    assert len(compiler.compiled) < 30


def test_a_search_that_does_not_converge_stops_at_the_compile_bound() -> None:
    """A cap of 2**60 samples and memory that is flat and then a wall (the lines through the
    first points say nothing, and bisection halves from the cap): the search gives up at 40
    compiles and says how to bound it, rather than compiling on."""
    compiler = _Compiler(lambda b: 1050 if b <= 1000 else 10**7, traced_per_sample=0.0)
    with pytest.raises(RuntimeError, match=r"did not converge in 40 compiles .* pass "
                       r"max_batch_size to bound it"):
        exact_largest(_search(compiler, 5000), 1 << 60)
    assert len(compiler.compiled) == 40


def test_the_slope_from_below_takes_the_secant_from_the_nearest_smaller_batch() -> None:
    """Memory flat up to 16 samples and then rising by 50 bytes a sample: the secant from the
    nearest compiled batch below (16) is the local slope, 50, not the flatter one from the
    farthest (8)."""
    compiler = _Compiler(lambda b: 2000 + 50 * max(0, b - 16))
    search = _search(compiler, 10**6)
    for batch in (8, 16, 24):
        search.peak(batch)
    assert search.slope_below(24) == 50.0  # one point: (2400 - 1100) / 24 = 54.2


def test_points_known_beyond_the_cap_bound_nothing_below_it() -> None:
    """A search seeded with compiled points from another plan (a plan cache), one far above
    this plan's cap and over the budget: the answer is still at most the cap, and a multiple
    of the search's unit even where a known point that fits is not one."""
    compiler = _Compiler(lambda b: 1300 + 10 * b)
    search = _search(compiler, 2700)  # the largest that fits: 140
    search.peak(200)  # known, over the budget
    assert exact_largest(search, 16) == 16 and max(compiler.compiled) == 200
    compiler = _Compiler(lambda b: 1300 + 10 * b)
    search = _search(compiler, 2700)
    search.unit = 4  # e.g. a batch multiple of 4
    search.peak(138)  # known from a search in steps of 2: fits
    search.peak(142)  # over
    assert exact_largest(search, 400) == 140


def test_a_line_that_puts_the_next_batch_at_the_usable_bytes_to_the_byte_leaves_it_in() -> None:
    """The line through the bracket's compiled ends predicts the step up at exactly the usable
    bytes: it may fit, so it is compiled (and it does: 1300 + 10 * 140 = 2700)."""
    compiler = _Compiler(lambda b: 1300 + 10 * b)
    search = _search(compiler, 2700)
    search.peak(139)
    search.peak(141)
    assert exact_largest(search, 400) == 140 and compiler.compiled == [139, 141, 140]


def test_the_step_up_is_put_over_only_when_the_traced_slope_agrees() -> None:
    """One compiled point, a fixed part beyond the state and the parameters (1,300 bytes
    against 1,100): the one-point slope (12 a sample) puts 101 over the usable bytes, the
    traced slope (5) does not, so 101 is compiled, and fits (10 a sample)."""
    compiler = _Compiler(lambda b: 1300 + 10 * b, traced_per_sample=5.0)
    search = _search(compiler, 2311)
    search.peak(100)
    assert exact_largest(search, 400) == 101


def test_one_point_takes_the_bytes_beyond_the_state_and_the_gradients_as_per_sample() -> None:
    """A first guess over the budget (the trace under-states the slope): the line through it
    and the persistent state plus the gradients (1,100 bytes), exact for memory that is those
    and activations, names the largest batch at the next compile."""
    compiler = _Compiler(lambda b: 1100 + 10 * b, traced_per_sample=5.0)
    assert exact_largest(_search(compiler, 2100), 400) == 100
    assert compiler.compiled == [180, 100]


def test_the_plans_line_skips_compiled_batches_below_as_high_as_the_answer() -> None:
    """`local_fit`: memory flat up to the answer (8 and 16 samples hold the same) and rising
    after it: the plan's line is the bracket's (16 to 24), not a flat line through the two
    equal points."""
    compiler = _Compiler(lambda b: 2000 + 50 * max(0, b - 16))
    search = _search(compiler, 2300)
    for batch in (8, 16, 24):
        search.peak(batch)
    line = local_fit(search, 16, 24)
    assert (line.bytes_per_sample, line.probe_batches) == (50.0, (16, 24))
    # one compiled point holding less than the state and the gradients (XLA fused the
    # gradients into the update): the line is flat at it, not falling with the batch
    compiler = _Compiler(lambda b: 1050)
    search = _search(compiler, 2300)
    search.peak(16)
    line = local_fit(search, 16, 17)
    assert (line.bytes_per_sample, line.predict(64)) == (0.0, 1050)


def test_known_points_around_the_answer_name_it_in_one_compile() -> None:
    """Memory growing a little faster than affine, and points known before the search (a
    plan cache's: 261 over the budget, 200 and 72 within it): the line through the bracket's
    ends, 200 and 261, names the largest batch, 251, at the first compile, where the secant
    through the latest two points (72 and 200) would overshoot to the bracket's top."""
    compiler = _Compiler(lambda b: int(1100 + 26 * b + 0.05 * b * b), traced_per_sample=50.0)
    search = _search(compiler, 10821)
    for batch in (261, 200, 72):
        search.peak(batch)
    assert exact_largest(search, 400) == 251
    assert compiler.compiled == [261, 200, 72, 251]
