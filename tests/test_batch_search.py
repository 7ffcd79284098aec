"""The batch search (`scamp_jax.planning.batch_search`) against stand-in compilers whose peaks
are a function of the batch: every path of the search without XLA, in milliseconds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from scamp_jax.planning.batch_search import BatchSearch, _top, exact_largest
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
