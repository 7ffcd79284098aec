"""Which derivative the search spaces' attention softmax takes.

``jax.nn.softmax`` has two derivatives, chosen by JAX's ``jax_softmax_custom_jvp`` setting
(off by default in JAX up to at least 0.12): autodiff of ``exp(x - max) / sum``, which keeps
the exponentials *and* the output for the backward pass, and a rule that keeps only the output
(``y * (dy - sum(y * dy))``). The attention weights are the largest activations of a SwinIR or a
ViT, so the search spaces' attention uses the second (`softmax_derivative`): a step's memory per
sample falls by 20-27% for the small SwinIRs and 20% for the ViT on CPU, 20% and 12% for an
H100 (``benchmarks/notes/memory.md``). The forward values are the same.

A module with a ``save_softmax_output`` attribute picks its rule at trace time; ``False``
builds the program JAX's default makes:
``model.set_attributes(save_softmax_output=False, raise_if_not_found=False)``
(`benchmarks.memory_accuracy` builds its cases so: its recorded GPU figures are of that
program).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax


def softmax_derivative(save_output: bool) -> Any:
    """A context in which ``jax.nn.softmax`` keeps only its output for the backward pass
    (``save_output=True``) or differentiates its expression (``False``, JAX's default); a JAX
    without the setting has one rule, kept as it is."""
    toggle = getattr(jax, "softmax_custom_jvp", None)
    if toggle is None:
        return contextlib.nullcontext()
    return toggle(bool(save_output))
