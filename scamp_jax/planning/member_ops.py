"""How a fused program runs the operations whose operands differ per member.

A fused group trains ``K`` members by ``jax.vmap`` of one member's training step over a leading
member axis (`scamp_jax.planning.fusion`). For most operations that is what an accelerator
wants: one ``K`` times larger kernel. A convolution is the exception worth a rule of its own:
with per-member weights (every convolution of the training step, forward and backward, has a
per-member operand) JAX's batching rule (``_conv_general_dilated_batch_rule`` in
``jax/_src/lax/convolution.py``) folds the member axis into the feature axis and makes one
*grouped* convolution (``feature_group_count = K``). That is one kernel on a GPU, but on
XLA:CPU a grouped convolution is a slow path, and it needs the activations transposed to put
the member axis beside the features and back. On 2 CPU cores a 3x3 convolution 24 -> 24
channels on 8 images of 24x24 per member, forward and backward, 4 members, took 2.7x the
wall-clock time (median) of the members' 4 convolutions one after another; in the fused SwinIR
step grouped convolutions held 64 of 177 ms of op time, where the 4 solo steps' convolutions
held 22 of 146 (``python -m benchmarks.fusion --conv``, ``python -m benchmarks.fusion_profile
--conv-form grouped``; ``benchmarks/notes/fusion.md``).

`member_program` rewrites a member's function so that, under ``jax.vmap`` over members, each
convolution with a per-member operand runs as:

- on CPU: ``K`` convolutions, one per member, each the solo run's convolution (same shapes,
  no grouping): a member's slice of a stacked array is contiguous, so nothing is transposed,
  and a member's convolutions agree with its solo run's to float rounding (XLA may still
  order a sum differently inside another program; ``tests/test_member_ops.py`` bounds it);
- on every other platform: JAX's grouped convolution, unchanged. A GPU runs the executables of
  a device on one compute stream, so ``K`` solo-sized kernels would take turns on it where one
  grouped kernel of ``K`` times the work fills it; ``lax.platform_dependent`` picks the form when
  the program is lowered, so one traced program serves both.

Everything else in the step is batched by ``jax.vmap`` as before. The rewrite works on the
step's jaxpr (``jax.make_jaxpr``), after differentiation, so the backward convolutions (input
and weight gradients) are rewritten like the forward ones and the model code is untouched.
Convolutions at the top level and inside nested ``jit`` calls are rewritten; one inside another
higher-order primitive (``scan``, ``cond``, ``remat``) keeps ``jax.vmap``'s rule.

The environment variable ``SCAMP_FUSED_CONVOLUTIONS`` (read when a program is traced) overrides
the choice, to measure both forms on one platform: ``per_member`` or ``grouped`` everywhere,
``auto`` (the default) as above.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxprs_in_params
from jax.extend.core.primitives import conv_general_dilated_p, jit_p

PyTree = Any
#: The environment variable that overrides where convolutions run member by member.
FORM_VARIABLE = "SCAMP_FUSED_CONVOLUTIONS"
FORMS = ("auto", "per_member", "grouped")


def convolution_form() -> str:
    """How fused programs traced now run per-member convolutions: ``auto`` (member by member
    on CPU, grouped elsewhere), ``per_member`` or ``grouped`` (everywhere); from
    ``SCAMP_FUSED_CONVOLUTIONS``."""
    form = os.environ.get(FORM_VARIABLE, "auto")
    if form not in FORMS:
        raise ValueError(f"{FORM_VARIABLE}={form!r} is not one of {FORMS}; unset it for 'auto'")
    return form


def form_on(platform: str) -> str:
    """The form fused programs traced now run on ``platform`` (``"per_member"`` or
    ``"grouped"``): `convolution_form`, with ``auto`` resolved."""
    form = convolution_form()
    if form != "auto":
        return form
    return "per_member" if platform == "cpu" else "grouped"


@contextlib.contextmanager
def forced_form(form: str) -> Iterator[None]:
    """Within the block, programs traced run fused convolutions in ``form`` (one of `FORMS`;
    ``SCAMP_FUSED_CONVOLUTIONS`` as it was afterwards): to measure both forms in one process."""
    if form not in FORMS:
        raise ValueError(f"form={form!r} is not one of {FORMS}")
    before = os.environ.get(FORM_VARIABLE)
    os.environ[FORM_VARIABLE] = form
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FORM_VARIABLE, None)
        else:
            os.environ[FORM_VARIABLE] = before


def _stack(outs: Sequence[PyTree]) -> PyTree:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _member_by_member(fn: Callable[..., Any], batched: Sequence[bool],
                      args: Sequence[jax.Array]) -> Any:
    """``fn`` on each member's slice of the batched ``args`` (leading axis), stacked."""
    width = next(a.shape[0] for a, b in zip(args, batched, strict=True) if b)
    return _stack([fn(*[a[i] if b else a for a, b in zip(args, batched, strict=True)])
                   for i in range(width)])


def per_member_on_cpu(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``fn`` whose batching rule runs it member by member on CPU, batched elsewhere.

    Under ``jax.vmap`` with some argument batched, the CPU lowering is one call of ``fn`` per
    member (slices of the leading axis, results stacked); other platforms get ``jax.vmap(fn)``
    (`convolution_form` can make either form run everywhere). Unbatched, it is ``fn``. ``fn``
    takes and returns arrays only.
    """
    wrapped = custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size: int, in_batched: Sequence[bool], *args: jax.Array):
        del axis_size
        axes = [0 if b else None for b in in_batched]

        def batched(*a: jax.Array) -> jax.Array:
            return jax.vmap(fn, in_axes=axes)(*a)

        def member_by_member(*a: jax.Array) -> jax.Array:
            return _member_by_member(fn, in_batched, a)

        form = convolution_form()
        if form == "auto":
            out = lax.platform_dependent(*args, cpu=member_by_member, default=batched)
        else:
            out = (member_by_member if form == "per_member" else batched)(*args)
        return out, True

    return wrapped


def _conv(params: dict[str, Any]) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The convolution of an equation's ``params``, run member by member on CPU."""
    def conv(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return conv_general_dilated_p.bind(lhs, rhs, **params)

    return per_member_on_cpu(conv)


def _has_conv(jaxpr: Jaxpr) -> bool:
    """Whether ``jaxpr`` or a jaxpr nested in it holds a convolution."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is conv_general_dilated_p:
            return True
        for sub in jaxprs_in_params(eqn.params):
            if _has_conv(sub):
                return True
    return False


def _evaluate(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """``jaxpr`` evaluated on ``args`` with every convolution run by `_conv` (nested ``jit``
    calls that hold one are inlined; everything else is bound as it was traced)."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with eqn.ctx.manager:
            if eqn.primitive is conv_general_dilated_p:
                outs = [_conv(dict(eqn.params))(*invals)]
            elif eqn.primitive is jit_p and _has_conv(eqn.params["jaxpr"].jaxpr):
                inner: ClosedJaxpr = eqn.params["jaxpr"]
                outs = _evaluate(inner.jaxpr, inner.consts, invals)
            else:
                ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                outs = list(ans) if eqn.primitive.multiple_results else [ans]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def member_program(fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
    """``fn`` (one member's computation) rewritten so that its convolutions run as the module
    docstring says when it is vmapped over members; the same values as ``fn`` otherwise.

    ``fn`` is traced to a jaxpr at each call (with the call's abstract arguments) and evaluated
    with every convolution replaced by `per_member_on_cpu` of it.
    """
    def program(*args: PyTree) -> PyTree:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if not _has_conv(closed.jaxpr):
            return fn(*args)
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return program
