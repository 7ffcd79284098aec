"""A run's initial state computed on the host with NumPy: no XLA compile for a new architecture.

Making a model's initial state is a pure function of its seed: random bits, a few elementwise
transforms (`jax.random`'s distributions), constants and zeros (the optimizer state). XLA
compiles that program like any other; for a SwinIR of the main job's space the compile cost
about half of its training step's, once per new architecture, and a GPU study paid it too (on
the host's CPU). This module evaluates the same program, traced once to a jaxpr, with NumPy
instead: nothing is compiled, and the result is copied onto the run's devices.

What it promises:

- the keys and random bits are JAX's, bit for bit: Threefry-2x32 in the partitionable
  counter layout (`jax_threefry_partitionable`, JAX's default), for ``random_seed``,
  ``random_fold_in``, ``random_split`` and ``random_bits``;
- every float operation is computed once and rounded once: ``+ - * /``, ``sqrt``,
  comparisons and bit casts as IEEE does them, integer arithmetic, conversions, ``max``/``min``
  of signed zeros, integer powers (by XLA's repeated squaring) and flushed subnormals as XLA's
  CPU does them (`RULES`; ``tests/test_host_init.py`` checks the edges), transcendental
  functions (``erf_inv`` of the normal initialisers, ``erf``, ``exp``, ...) in float64 and
  rounded to float32. XLA computes those functions with its own float32 approximations and
  contracts ``a * b + c`` into one fused multiply-add, so the values agree with a jitted
  ``build(nnx.Rngs(seed))`` to a few units in the last place, not bit for bit (as XLA's
  results at two optimisation levels do not);
- the same inputs give the same values on every machine and backend, and a fused group's
  member ``i`` is the solo state of its seed bit for bit (the group is made member by member).

`unsupported` tells why a jaxpr cannot be evaluated here (None: it can); a program with an
operation without a rule (e.g. a QR decomposition of an orthogonal initialiser, a matrix
product, ``argmax``) is compiled instead (`scamp_jax.planning.initial_state.InitialStates`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from scamp_jax.scheduling.host import host_cores

#: The string of a Threefry-2x32 key's dtype in a jaxpr (JAX's default key implementation).
THREEFRY_KEY = "key<fry>"
_KS_PARITY = np.uint32(0x1BD11BDA)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
#: Elements hashed at a time by `threefry2x32`, and the fewest blocks worth a thread.
_BLOCK = 1 << 16
_THREAD_BLOCKS = 8


def threefry2x32(k1: np.ndarray, k2: np.ndarray, x1: np.ndarray,
                 x2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Threefry-2x32 hash (20 rounds) of counters ``(x1, x2)`` under keys ``(k1, k2)``,
    broadcast together; uint32 arithmetic wraps as XLA's does. Computed in place, a block of
    `_BLOCK` elements at a time (the block stays in the CPU's cache through the 20 rounds), the
    blocks shared among the host's cores (NumPy releases the interpreter's lock)."""
    k1, k2, x1, x2 = (np.asarray(a, np.uint32) for a in (k1, k2, x1, x2))
    shape = np.broadcast_shapes(k1.shape, k2.shape, x1.shape, x2.shape)
    n = int(np.prod(shape, dtype=np.int64))

    def flat(a: np.ndarray) -> np.ndarray:
        return a.reshape(()) if a.size == 1 else np.broadcast_to(a, shape).reshape(-1)

    keys = [flat(k) for k in (k1, k2, k1 ^ k2 ^ _KS_PARITY)]
    c1, c2 = flat(x1), flat(x2)
    a, b = np.empty(n, np.uint32), np.empty(n, np.uint32)

    def blocks(first: int, last: int) -> None:
        spare = np.empty(_BLOCK, np.uint32)
        with np.errstate(over="ignore"):
            for lo in range(first, last, _BLOCK):
                hi = min(last, lo + _BLOCK)
                ks = [k if k.ndim == 0 else k[lo:hi] for k in keys]
                x, y, t = a[lo:hi], b[lo:hi], spare[:hi - lo]
                np.add(c1 if c1.ndim == 0 else c1[lo:hi], ks[0], out=x)
                np.add(c2 if c2.ndim == 0 else c2[lo:hi], ks[1], out=y)
                for group in range(5):
                    for r in _ROTATIONS[group % 2]:
                        x += y
                        np.left_shift(y, np.uint32(r), out=t)
                        y >>= np.uint32(32 - r)
                        y |= t
                        y ^= x
                    x += ks[(group + 1) % 3]
                    y += ks[(group + 2) % 3]
                    y += np.uint32(group + 1)

    workers = min(host_cores(), -(-n // (_THREAD_BLOCKS * _BLOCK)))
    if workers <= 1:
        blocks(0, n)
    else:
        share = -(-n // workers // _BLOCK) * _BLOCK
        with ThreadPoolExecutor(workers) as pool:
            for done in [pool.submit(blocks, lo, min(n, lo + share))
                         for lo in range(0, n, share)]:
                done.result()
    return a.reshape(shape), b.reshape(shape)


def _iota_2x32(shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The row-major index of every element of ``shape`` as (high, low) uint32 words."""
    index = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64).reshape(shape)
    return (index >> np.uint64(32)).astype(np.uint32), (index & np.uint64(0xFFFFFFFF)).astype(
        np.uint32)


def _keys(keys: np.ndarray, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """The two words of keys ``(*S, 2)``, shaped to broadcast against ``ndim`` more axes."""
    pad = (1,) * ndim
    return keys[..., 0].reshape(keys.shape[:-1] + pad), keys[..., 1].reshape(
        keys.shape[:-1] + pad)


def random_seed(seeds: np.ndarray) -> np.ndarray:
    """Keys ``(*S, 2)`` of integer seeds ``S`` (a 32-bit seed is the key's low word)."""
    seeds = np.asarray(seeds)
    if seeds.dtype.itemsize > 4:
        wide = seeds.astype(np.uint64)
        high = (wide >> np.uint64(32)).astype(np.uint32)
    else:
        high = np.zeros(seeds.shape, np.uint32)
    return np.stack([high, seeds.astype(np.uint32)], axis=-1)


def random_fold_in(keys: np.ndarray, msgs: np.ndarray) -> np.ndarray:
    """``jax.random.fold_in``: each key hashed with the counter ``(0, msg)``."""
    msgs = np.asarray(msgs).astype(np.uint32)
    shape = np.broadcast_shapes(keys.shape[:-1], msgs.shape)
    keys = np.broadcast_to(keys, shape + (2,))
    a, b = threefry2x32(keys[..., 0], keys[..., 1], np.zeros(shape, np.uint32),
                        np.broadcast_to(msgs, shape))
    return np.stack([a, b], axis=-1)


def random_split(keys: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``jax.random.split``: keys ``(*S, *shape, 2)``, one per index of ``shape``."""
    k1, k2 = _keys(keys, len(shape))
    a, b = threefry2x32(k1, k2, *_iota_2x32(shape))
    return np.stack([a, b], axis=-1)


def random_bits(keys: np.ndarray, bit_width: int, shape: Sequence[int]) -> np.ndarray:
    """``jax.random.bits``: unsigned words ``(*S, *shape)`` of ``bit_width`` bits per key."""
    k1, k2 = _keys(keys, len(shape))
    a, b = threefry2x32(k1, k2, *_iota_2x32(shape))
    if bit_width == 64:
        return (a.astype(np.uint64) << np.uint64(32)) | b.astype(np.uint64)
    bits = a ^ b
    return bits if bit_width == 32 else bits.astype(np.dtype(f"uint{bit_width}"))


# --- rules ----------------------------------------------------------------------------------

def _wide(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """A transcendental function computed in float64 (rounded once to the result's dtype)."""
    def rule(x: np.ndarray, **_: Any) -> np.ndarray:
        return fn(np.asarray(x, np.float64))
    return rule


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division rounding toward zero, ``x / 0`` giving -1 (all ones unsigned) and
    ``INT_MIN / -1`` wrapping, as XLA's CPU does."""
    a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
    safe = np.where(b == 0, 1, b).astype(b.dtype)
    quotient = a // safe  # floor; toward zero below
    remainder = a - quotient * safe
    if np.issubdtype(a.dtype, np.signedinteger):
        quotient = quotient + ((remainder != 0) & ((a < 0) != (safe < 0)))
    return np.where(b == 0, np.asarray(-1).astype(a.dtype), quotient).astype(a.dtype)


def _div(a: np.ndarray, b: np.ndarray, **_: Any) -> np.ndarray:
    if np.issubdtype(np.result_type(a, b), np.integer):
        return _int_div(a, b)
    return np.divide(a, b)


def _rem(a: np.ndarray, b: np.ndarray, **_: Any) -> np.ndarray:
    """C's remainder (the dividend's sign); ``x % 0`` is ``x`` for integers (XLA's)."""
    if np.issubdtype(np.result_type(a, b), np.integer):
        a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
        safe = np.where(b == 0, 1, b).astype(b.dtype)
        return np.where(b == 0, a, a - _int_div(a, safe) * safe).astype(a.dtype)
    return np.fmod(a, b)


def _max(a: np.ndarray, b: np.ndarray, **_: Any) -> np.ndarray:
    """XLA's maximum: NaN if either is NaN, and +0 above -0."""
    if not np.issubdtype(np.result_type(a, b), np.floating):
        return np.maximum(a, b)
    return np.where(a == b, np.where(np.signbit(a), b, a),
                    np.where(np.isnan(a) | (a > b), a, b))


def _min(a: np.ndarray, b: np.ndarray, **_: Any) -> np.ndarray:
    """XLA's minimum: NaN if either is NaN, and -0 below +0."""
    if not np.issubdtype(np.result_type(a, b), np.floating):
        return np.minimum(a, b)
    return np.where(a == b, np.where(np.signbit(a), a, b),
                    np.where(np.isnan(a) | (a < b), a, b))


def _convert(x: np.ndarray, *, new_dtype: Any, **_: Any) -> np.ndarray:
    """``convert_element_type``: floats to integers round toward zero and saturate at the
    type's limits, NaN gives 0 (XLA's); other conversions as NumPy casts."""
    x, new = np.asarray(x), np.dtype(new_dtype)
    if np.issubdtype(x.dtype, np.floating) and np.issubdtype(new, np.integer):
        info = np.iinfo(new)
        wide = np.nan_to_num(np.trunc(x.astype(np.float64)), nan=0.0, posinf=np.inf,
                             neginf=-np.inf)
        return np.clip(wide, info.min, info.max).astype(new)
    if new == np.bool_:
        return x != 0
    return x.astype(new)


def _integer_pow(x: np.ndarray, *, y: int, **_: Any) -> np.ndarray:
    """``x ** y`` by XLA's repeated squaring (the same products in the same order), the
    reciprocal for a negative ``y``."""
    x = np.asarray(x)
    power, result, base = abs(int(y)), None, x
    while power:
        if power & 1:
            result = base if result is None else result * base
        power >>= 1
        if power:
            base = base * base
    out = np.ones_like(x) if result is None else result
    return np.reciprocal(out) if y < 0 else out


def _sign(x: np.ndarray, **_: Any) -> np.ndarray:
    """The sign, keeping a zero's own sign (and NaN) for floats."""
    if np.issubdtype(np.asarray(x).dtype, np.floating):
        return np.where((x == 0) | np.isnan(x), x, np.sign(x))
    return np.sign(x)


def _shift(kind: str):
    """A shift (``left``, ``right`` logical, ``arithmetic`` right) whose amounts outside
    ``[0, width)`` give 0, or the sign for an arithmetic one (XLA's rule)."""
    def rule(x: np.ndarray, s: np.ndarray, **_: Any) -> np.ndarray:
        x = np.asarray(x)
        bits = x.dtype.itemsize * 8
        signed, unsigned = np.dtype(f"int{bits}"), np.dtype(f"uint{bits}")
        s = np.asarray(s).astype(np.int64)
        inside = (s >= 0) & (s < bits)
        amount = np.where(inside, s, 0)
        if kind == "arithmetic":
            v = x.astype(signed)
            past = np.where(v < 0, -1, 0).astype(signed)
            out = np.where(inside, np.right_shift(v, amount.astype(signed)), past)
        else:
            v = x.astype(unsigned)
            op = np.left_shift if kind == "left" else np.right_shift
            out = np.where(inside, op(v, amount.astype(unsigned)), np.zeros((), unsigned))
        return out.astype(x.dtype)
    return rule


def _broadcast_in_dim(x: np.ndarray, *, shape: Sequence[int],
                      broadcast_dimensions: Sequence[int], **_: Any) -> np.ndarray:
    x = np.asarray(x)
    expanded = [1] * len(shape)
    for axis, dim in zip(broadcast_dimensions, x.shape, strict=True):
        expanded[axis] = dim
    return np.broadcast_to(x.reshape(expanded), tuple(shape))


def _iota(*, dtype: Any, shape: Sequence[int], dimension: int, **_: Any) -> np.ndarray:
    line = np.arange(shape[dimension], dtype=np.dtype(dtype))
    expanded = [1] * len(shape)
    expanded[dimension] = shape[dimension]
    return np.broadcast_to(line.reshape(expanded), tuple(shape))


def _slice(x: np.ndarray, *, start_indices: Sequence[int], limit_indices: Sequence[int],
           strides: Sequence[int] | None, **_: Any) -> np.ndarray:
    steps = strides or (1,) * len(start_indices)
    return x[tuple(slice(a, b, s) for a, b, s in zip(start_indices, limit_indices, steps,
                                                      strict=True))]


def _select_n(which: np.ndarray, *cases: np.ndarray, **_: Any) -> np.ndarray:
    which = np.asarray(which)
    if which.dtype == np.bool_:
        return np.where(which, cases[1], cases[0]) if len(cases) == 2 else cases[0]
    return np.choose(which.astype(np.int64), np.broadcast_arrays(*cases))


def _bitcast(x: np.ndarray, *, new_dtype: Any, **_: Any) -> np.ndarray:
    """The same bits as another type of the same width (`unsupported` declines other widths)."""
    return np.asarray(x, order="C").view(np.dtype(new_dtype))


def _clamp(lo: np.ndarray, x: np.ndarray, hi: np.ndarray, **_: Any) -> np.ndarray:
    return np.minimum(np.maximum(x, lo), hi)


def _reduce(fn: Callable[..., np.ndarray]):
    def rule(x: np.ndarray, *, axes: Sequence[int], **_: Any) -> np.ndarray:
        return fn(x, axis=tuple(axes))
    return rule


def _identity(x: np.ndarray, **_: Any) -> np.ndarray:
    return x


def _threefry_rule(k1: np.ndarray, k2: np.ndarray, x1: np.ndarray, x2: np.ndarray,
                   **_: Any) -> tuple[np.ndarray, np.ndarray]:
    return threefry2x32(k1, k2, x1, x2)


def _special(name: str) -> Callable[[np.ndarray], np.ndarray]:
    def fn(x: np.ndarray) -> np.ndarray:
        from scipy import special

        return getattr(special, name)(x)
    return fn


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]):
    def rule(a: np.ndarray, b: np.ndarray, **_: Any) -> np.ndarray:
        return fn(a, b)
    return rule


def _unary(fn: Callable[[np.ndarray], np.ndarray]):
    def rule(x: np.ndarray, **_: Any) -> np.ndarray:
        return fn(x)
    return rule


#: NumPy rules of the operations an initialisation uses, by primitive name; each takes the
#: operands (keys as uint32 ``(..., 2)``) and the equation's parameters.
RULES: dict[str, Callable[..., Any]] = {
    "add": _binary(np.add), "sub": _binary(np.subtract), "mul": _binary(np.multiply),
    "div": _div, "rem": _rem, "max": _max, "min": _min,
    "nextafter": _binary(np.nextafter),
    "and": _binary(np.bitwise_and), "or": _binary(np.bitwise_or),
    "xor": _binary(np.bitwise_xor), "not": _unary(np.invert),
    "eq": _binary(np.equal), "ne": _binary(np.not_equal), "lt": _binary(np.less),
    "le": _binary(np.less_equal), "gt": _binary(np.greater), "ge": _binary(np.greater_equal),
    "neg": _unary(np.negative), "abs": _unary(np.abs), "sign": _sign,
    "floor": _unary(np.floor), "ceil": _unary(np.ceil), "sqrt": _unary(np.sqrt),
    "integer_pow": _integer_pow,
    "square": _unary(np.square),
    "rsqrt": _wide(lambda x: 1.0 / np.sqrt(x)), "exp": _wide(np.exp), "log": _wide(np.log),
    "log1p": _wide(np.log1p), "expm1": _wide(np.expm1), "tanh": _wide(np.tanh),
    "sin": _wide(np.sin), "cos": _wide(np.cos),
    "logistic": _wide(lambda x: 1.0 / (1.0 + np.exp(-x))),
    "erf": _wide(_special("erf")), "erfc": _wide(_special("erfc")),
    "erf_inv": _wide(_special("erfinv")),
    "shift_left": _shift("left"), "shift_right_logical": _shift("right"),
    "shift_right_arithmetic": _shift("arithmetic"),
    "convert_element_type": _convert,
    "bitcast_convert_type": _bitcast,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": lambda x, *, new_sizes, dimensions=None, **_: np.reshape(x, tuple(new_sizes)),
    "squeeze": lambda x, *, dimensions, **_: np.squeeze(x, axis=tuple(dimensions)),
    "transpose": lambda x, *, permutation, **_: np.transpose(x, tuple(permutation)),
    "concatenate": lambda *xs, dimension, **_: np.concatenate(xs, axis=dimension),
    "split": lambda x, *, sizes, axis, **_: np.split(
        x, np.cumsum([int(n) for n in sizes])[:-1], axis=axis),
    "unstack": lambda x, *, axis, **_: [np.take(x, i, axis=axis) for i in range(x.shape[axis])],
    "rev": lambda x, *, dimensions, **_: np.flip(x, axis=tuple(dimensions)),
    "slice": _slice, "iota": _iota, "select_n": _select_n, "clamp": _clamp,
    "reduce_sum": _reduce(np.sum), "reduce_max": _reduce(np.max),
    "reduce_min": _reduce(np.min), "reduce_or": _reduce(np.any), "reduce_and": _reduce(np.all),
    "stop_gradient": _identity, "copy": _identity,
    "sharding_constraint": _identity, "reshard": _identity, "mesh_cast": _identity,
    "pvary": _identity,
    "random_seed": lambda seeds, **_: random_seed(seeds),
    "random_fold_in": lambda keys, msgs, **_: random_fold_in(keys, msgs),
    "random_split": lambda keys, *, shape, **_: random_split(keys, shape),
    "random_bits": lambda keys, *, bit_width, shape, **_: random_bits(keys, bit_width, shape),
    "random_wrap": lambda data, **_: np.asarray(data, np.uint32),
    "random_unwrap": _identity,
    "threefry2x32": _threefry_rule,
    "iota_2x32_shape": lambda *, shape, **_: _iota_2x32(shape),
}
#: Call-like primitives whose body (a closed jaxpr in ``params[name]``) is evaluated in place.
CALLS: dict[str, str] = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
                         "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
                         "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr",
                         "checkpoint": "jaxpr"}
#: Float arithmetic whose subnormal results XLA's CPU gives as zero (flush to zero).
_FLUSHED = {"add", "sub", "mul", "div", "rem", "integer_pow", "square", "sqrt", "rsqrt", "exp",
            "log", "log1p", "expm1", "tanh", "sin", "cos", "logistic", "erf", "erfc", "erf_inv",
            "convert_element_type", "reduce_sum"}


def _is_key(aval: Any) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key)


def _sub_jaxpr(eqn: Any) -> Any:
    body = eqn.params[CALLS[eqn.primitive.name]]
    return body if isinstance(body, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(body, ())


def unsupported(closed: Any) -> str | None:
    """The first reason ``closed`` (a `jax.extend.core.ClosedJaxpr`) cannot be evaluated here
    (an operation without a rule, a key of another implementation, the non-partitionable
    Threefry layout, an effect), or None when it can."""
    if not jax.config.jax_threefry_partitionable:
        return "jax_threefry_partitionable is off"
    if closed.jaxpr.effects:
        return f"effects {closed.jaxpr.effects}"
    for eqn in closed.jaxpr.eqns:
        name = eqn.primitive.name
        if name in CALLS:
            reason = unsupported(_sub_jaxpr(eqn))
            if reason is not None:
                return reason
            continue
        if name not in RULES:
            return f"no rule for {name!r}"
        if name == "bitcast_convert_type" and (
                np.dtype(eqn.params["new_dtype"]).itemsize
                != np.dtype(eqn.invars[0].aval.dtype).itemsize):
            return "a bit cast between widths"
        for var in list(eqn.invars) + list(eqn.outvars):
            aval = getattr(var, "aval", None)
            if aval is not None and _is_key(aval) and str(aval.dtype) != THREEFRY_KEY:
                return f"{name} on keys of type {aval.dtype}"
    return None


def evaluate(closed: Any, *args: Any, checked: bool = False) -> list[np.ndarray]:
    """The outputs of ``closed`` on ``args`` (flat, as its inputs), computed with NumPy; keys
    are uint32 ``(..., 2)`` arrays. Raises ``NotImplementedError`` where `unsupported` would
    have said why; ``checked``: the caller has had `unsupported` answer None for ``closed``
    (a program traced once and evaluated for many seeds), so the walk is not repeated."""
    reason = None if checked else unsupported(closed)
    if reason is not None:
        raise NotImplementedError(reason)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        return _eval(closed.jaxpr, [_host(c) for c in closed.consts], [_host(a) for a in args])


def _host(value: Any) -> np.ndarray:
    """``value`` as a NumPy array; a JAX key array as its key data (uint32 ``(..., 2)``)."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(value))
    return np.asarray(value)


def _eval(jaxpr: Any, consts: list[np.ndarray], args: list[np.ndarray]) -> list[np.ndarray]:
    env: dict[Any, np.ndarray] = {}

    def read(var: Any) -> np.ndarray:
        if isinstance(var, jcore.Literal):
            # a literal's aval is a ShapedArray, which JAX annotates as its base AbstractValue
            dtype = var.aval.dtype  # type: ignore[attr-defined]
            return np.asarray(var.val, dtype=np.dtype(dtype))
        return env[var]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        operands = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in CALLS:
            body = _sub_jaxpr(eqn)
            outs = _eval(body.jaxpr, [_host(c) for c in body.consts], operands)
        else:
            result = RULES[name](*operands, **eqn.params)
            outs = list(result) if eqn.primitive.multiple_results else [result]
        for var, value in zip(eqn.outvars, outs, strict=True):
            if isinstance(var, jcore.DropVar):
                continue
            env[var] = _as_aval(np.asarray(value), var.aval, name)
    return [read(v) for v in jaxpr.outvars]


def _as_aval(value: np.ndarray, aval: Any, name: str) -> np.ndarray:
    """``value`` in ``aval``'s dtype, its shape checked (a rule's error is never silent), a
    float arithmetic result's subnormals flushed to zero (XLA's CPU runs with them off)."""
    if _is_key(aval):
        shape, value = tuple(aval.shape) + (2,), value.astype(np.uint32, copy=False)
    else:
        shape, value = tuple(aval.shape), value.astype(np.dtype(aval.dtype), copy=False)
        if name in _FLUSHED and np.issubdtype(value.dtype, np.floating) and value.size:
            tiny = np.finfo(value.dtype).tiny
            if np.any((value != 0) & (np.abs(value) < tiny)):
                value = np.where(np.abs(value) < tiny, np.copysign(0, value), value).astype(
                    value.dtype)
    if value.shape != shape:
        raise RuntimeError(f"the NumPy rule of {name} gave shape {value.shape}, "
                           f"the jaxpr says {shape}")
    return value
