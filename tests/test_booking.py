"""The one byte rule of a trial's booking (`scamp_jax.scheduling.booking`)."""

from __future__ import annotations

from types import SimpleNamespace

from scamp_jax.scheduling.booking import booked_bytes, solo_bytes


def test_solo_bytes_books_the_larger_of_training_and_evaluation():
    assert solo_bytes(100, 10, allowance=5) == 115
    assert solo_bytes(100, 10, eval_peak=50, opt_state=20, allowance=5) == 115  # training larger
    assert solo_bytes(100, 10, eval_peak=150, opt_state=20, allowance=5) == 185  # eval larger
    plan = SimpleNamespace(peak_bytes_per_device=100, prefetch_bytes=10, eval_chunk=4,
                           eval_peak_bytes=150, estimate=SimpleNamespace(opt_state=20),
                           allowance_bytes=5)
    assert booked_bytes(plan) == 185
    assert booked_bytes(SimpleNamespace(**{**vars(plan), "eval_chunk": 0})) == 115
