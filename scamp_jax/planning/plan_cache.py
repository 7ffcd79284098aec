"""A persistent cache of plans and compiled peaks, so an architecture is planned (compiled) once.

``plan_mesh(..., cache=PlanCache(path))`` looks a plan up before compiling anything and stores
the plan it finds; a resumed study, a repeated architecture or another process on the same study
directory then plans with zero compiles. Two kinds of records live in one SQLite file:

- **plans**, keyed by everything a plan depends on: the training step's program signature
  (`program_signature`: a hash of the traced loss and optimizer update, so the model's
  computation, its shapes and dtypes, the loss and the optimizer all count), the platform,
  device kind and device count, the budget (bytes per device, safety margin, batch cap), a
  forced model-parallel degree, the sharding threshold, the evaluation planned with it (its
  forward by `function_identity`, its input shapes), the JAX, jaxlib and scamp-jax versions
  and ``XLA_FLAGS``. A cached plan holds the decision (degrees, batch, compiled peaks); the mesh
  and shardings are rebuilt from the project's sharding rules, which are a function of the
  shapes and the model-parallel degree.
- **peaks**: every compiled ``(batch, memory)`` point of a program on a mesh shape (keyed by the
  signature, platform, device kind, mesh shape, sharding threshold and versions). A plan of the
  same architecture under another budget or batch cap starts its batch search from these points
  and compiles only what they do not decide.

- **allowances**, keyed by platform and device kind: bytes per device that a trial holds beyond
  what XLA's buffer assignment reports (the allocator's rounding, library workspaces), measured
  on that kind of device (a study's calibration, `scamp_jax.hpo.calibration`: the allocator's
  ``peak_bytes_in_use`` beyond what the ledger booked; ``benchmarks.gpu_suite``) and added to
  every plan on it (`resolve_allowance`). Devices whose allocator reports nothing (CPU devices)
  never learn one, so theirs stays 0.

A key that differs in any part is a different record: nothing is trusted across versions, budgets
or devices. Writes are single SQLite transactions (``INSERT OR REPLACE``), safe for several
threads and processes; the file sits in the study directory next to ``study.db``. A file that
cannot be written (read-only) is refused at its first use, before a plan compiles whose record
would be lost; copy it somewhere writable to plan from its records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sqlite3
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
import optax
from flax import nnx

from scamp_jax._sqlite import DISK_REFUSED, write_ahead
from scamp_jax.planning.memory import MemoryEstimate, with_batch_size
from scamp_jax.planning.targets import target_of
from scamp_jax.planning.train_step import LossFn, abstract_state, default_loss, split_model

PyTree = Any

#: Bumped when the stored record layout changes (old records are then ignored, not misread).
SCHEMA_VERSION = 2
#: SQLite busy timeout, seconds: how long a writer waits for another process's transaction.
_BUSY_TIMEOUT_S = 30.0


def program_signature(
    model: nnx.Module,
    sample_batch: PyTree,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn | None = None,
) -> str:
    """A hex SHA-256 of what a plan depends on in the program (traced, not compiled).

    Hashes the jaxpr of the loss (the model's forward computation on a batch of one, with every
    parameter, state and batch shape and dtype), the jaxpr of the optimizer update, and the
    parameter paths (the sharding rules read them). The backward pass is derived from the forward
    one by JAX, whose version is part of every key; hyperparameters injected with
    ``optax.inject_hyperparams`` are arguments, so trials differing only in those share a
    signature. Not seen: a change confined to a ``custom_vjp`` backward rule. Costs two traces
    (about 0.3 s of CPU for a small SwinIR), a fraction of tracing the whole training step.
    """
    graphdef, _, _ = split_model(model)
    params, opt_state, rest = abstract_state(model, optimizer)
    loss = loss_fn if loss_fn is not None else default_loss
    batch = with_batch_size(sample_batch, 1)

    def forward(p: PyTree, r: PyTree, x: PyTree) -> jax.Array:
        return loss(nnx.merge(graphdef, p, r, copy=True), x)

    paths = [
        f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}"
        for path, leaf in jax.tree_util.tree_leaves_with_path((params, opt_state, rest))
    ]
    digest = hashlib.sha256()
    traced = jax.make_jaxpr(forward)(params, rest, batch)
    # JAX prints a function in a jaxpr (a rematerialisation policy) without what it does; a
    # program without one keeps the signature it had before policies were described
    policies = _functions_in(traced)
    for text in (
        str(traced),
        *(["\n".join(policies)] if policies else []),
        str(jax.make_jaxpr(optimizer.update)(params, opt_state, params)),
        "\n".join(paths),
    ):
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _functions_in(jaxpr: Any) -> list[str]:
    """The rematerialisation policies of ``jaxpr``'s equations (``jax.checkpoint``'s
    ``policy``), inner jaxprs included, each as its qualified name and the values it closes
    over (``save_only_these_names("a")`` and ``("b")`` differ only there): a jaxpr's text shows
    a function as ``<function ... at 0xXXXXXXXXXXXX>`` whatever it does. Other functions in
    equations (JAX's own thunks) are left out: what they close over differs by process."""
    found: list[str] = []

    def describe(fn: Any) -> str:
        cells = []
        for cell in getattr(fn, "__closure__", None) or ():
            value = cell.cell_contents
            cells.append(repr(sorted(map(repr, value)) if isinstance(value, set | frozenset)
                              else value))
        name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
        return f"{name}({', '.join(cells)})"

    def visit(value: Any) -> None:
        inner = getattr(value, "jaxpr", value)  # a closed jaxpr's own jaxpr
        if hasattr(inner, "eqns"):
            for eqn in inner.eqns:
                for name, param in eqn.params.items():
                    if name == "policy" and callable(param):
                        found.append(describe(param))
                    else:
                        visit(param)
        elif isinstance(value, tuple | list):
            for item in value:
                visit(item)

    visit(jaxpr)
    return found


def function_identity(fn: Callable[..., Any], _depth: int = 0) -> str:
    """``fn`` as a plan key holds it (a task's ``eval_forward``): its module, qualified name and
    a digest of its code, with the values it closes over that have a stable description
    (`_value_key`: numbers, strings, NumPy scalars, functions, and tuples, lists, dicts and
    dataclasses of them), so that two lambdas, or two classes of one name in two modules, are
    told apart by what they compute; stable across processes (no addresses). A bound method is
    its function with such values of its instance that it, or a method of its class it calls,
    reads (a task's scale, its number of flipped copies: two tasks of one class that differ
    there evaluate other programs; a counter it does not read leaves the key alone); what else
    an instance holds (arrays, models) enters only through the shapes it hands the planner. A
    ``functools.partial`` is its function with the values it binds, a wrapper (``jax.jit``,
    ``functools.wraps``) the function it wraps, and an object with a ``__call__`` its class and
    that method bound to it."""
    if isinstance(fn, functools.partial):
        digest = hashlib.sha256()
        for part, values in (("args", list(enumerate(fn.args))),
                             ("keywords", sorted(fn.keywords.items()))):
            digest.update(f"{part}\0".encode())
            for label, bound in values:
                digest.update(f"{label}={_value_key(bound, _depth) or _type_key(bound)}\0"
                              .encode())
        inner = function_identity(fn.func, _depth + 1)
        return f"functools.partial({inner}):{digest.hexdigest()[:16]}"
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None and not isinstance(fn, type) and _depth < _KEY_DEPTH:
        wrapped = getattr(fn, "__wrapped__", None)  # jax.jit's, functools.wraps'
        if wrapped is not None and wrapped is not fn:
            return f"{_type_key(fn)}({function_identity(wrapped, _depth + 1)})"
        call = next((vars(c)["__call__"] for c in type(fn).__mro__ if "__call__" in vars(c)),
                    None)
        if isinstance(call, types.FunctionType):  # an object that is called
            return (f"{_type_key(fn)}/"
                    + function_identity(types.MethodType(call, fn), _depth + 1))
    name = (f"{getattr(func, '__module__', '')}."
            f"{getattr(func, '__qualname__', type(func).__qualname__)}")
    if code is None:  # a builtin: its name is all that is stable
        return name
    digest = hashlib.sha256()
    _digest_code(code, digest)
    for cell in getattr(func, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        key = _value_key(value, _depth + 1)
        if key is not None:
            digest.update(key.encode())
        digest.update(b"\0")
    instance = getattr(fn, "__self__", None)
    if instance is not None and not isinstance(instance, types.ModuleType):
        read = _names_read(code)
        for name_read in list(read):  # what the methods it calls read too
            method = getattr(type(instance), name_read, None)
            if isinstance(method, types.FunctionType):
                read |= _names_read(method.__code__)
        for attr, value in sorted(_attributes(instance).items()):
            if attr in read:  # what this function reads, not a counter elsewhere
                key = _value_key(value, _depth + 1)
                if key is not None:
                    digest.update(f"{attr}={key}\0".encode())
    return f"{name}:{digest.hexdigest()[:16]}"


#: How deep `function_identity` and `_value_key` follow values into values (functions that
#: close over functions, dicts of dicts): past it a value has no key, and cycles end.
_KEY_DEPTH = 4


def _attributes(instance: Any) -> dict[str, Any]:
    """``instance``'s own attributes: its ``__dict__`` and its slots."""
    found = dict(getattr(instance, "__dict__", None) or {})
    for cls in type(instance).__mro__:
        slots = vars(cls).get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in found and hasattr(instance, slot):
                found[slot] = getattr(instance, slot)
    return found


def _names_read(code: Any) -> set[str]:
    """The attribute and global names ``code`` and the functions defined in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_read(const)
    return names


def _type_key(value: Any) -> str:
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _value_key(value: Any, depth: int = 0) -> str | None:
    """A description of ``value`` that is the same in every process and differs where the
    value does, or None where it has none (arrays, models, objects: their shapes reach the
    planner otherwise). Numbers and strings as ``repr`` (NumPy scalars as their Python
    value); tuples, lists, dicts (in key order) and dataclasses of such values; functions,
    partials and callable objects by `function_identity`."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return repr(value)
    if isinstance(value, np.generic):
        return repr(value.item())
    if depth >= _KEY_DEPTH:
        return None
    if isinstance(value, tuple | list):
        if all(v is None or isinstance(v, bool | int | float | str | bytes) for v in value):
            return repr(value)  # as keys were written before dicts and functions had keys
        keys = [_value_key(v, depth + 1) for v in value]
        if any(k is None for k in keys):
            return None
        joined = ", ".join(k for k in keys if k is not None)
        return f"({joined},)" if isinstance(value, tuple) else f"[{joined}]"
    if isinstance(value, dict):
        items = [(_value_key(k, depth + 1), _value_key(v, depth + 1)) for k, v in value.items()]
        if any(k is None or v is None for k, v in items):
            return None
        return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(items)) + "}"  # type: ignore[type-var]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, _value_key(getattr(value, f.name), depth + 1))
                  for f in dataclasses.fields(value)]
        if any(k is None for _, k in fields):
            return None
        return f"{_type_key(value)}(" + ", ".join(f"{n}={k}" for n, k in fields) + ")"
    if callable(value) and not isinstance(value, type):
        return function_identity(value, depth + 1)
    return None


def _digest_code(code: Any, digest: Any) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:  # inner functions' code by content, not by address
        if hasattr(const, "co_code"):
            _digest_code(const, digest)
        elif isinstance(const, frozenset):  # ``x in {"a", "b"}``: its order is the hash seed's
            digest.update(repr(sorted(map(repr, const))).encode())
        else:
            digest.update(repr(const).encode())
        digest.update(b"\0")


def versions() -> dict[str, str]:
    """What a compiled figure depends on besides the program: JAX, jaxlib, ``XLA_FLAGS`` and the
    release number of the scamp-jax that planned it (``scamp_jax.__version__``: a new release's
    planner and programs start a cache of their own; a change to stored records between
    releases bumps `SCHEMA_VERSION`)."""
    import scamp_jax

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "scamp_jax": scamp_jax.__version__}


def device_identity(devices: Sequence[jax.Device]) -> dict[str, Any]:
    """Platform, device kind(s) and count of ``devices`` (not their ids: a plan moves); for a
    GPU target's compile-only devices also ``described`` (its compiles take XLA's default
    kernels, not the ones autotuning picks on the GPU: their figures are kept apart)."""
    identity: dict[str, Any] = {
        "platform": devices[0].platform,
        "device_kind": sorted({str(d.device_kind) for d in devices}),
        "count": len(devices),
    }
    target = target_of(devices)
    if target is not None:
        identity["described"] = {"autotune_cache": target.autotune_cache,
                                 "config": hashlib.sha256(target.config.encode()).hexdigest()}
    return identity


def cache_key(parts: Mapping[str, Any]) -> str:
    """A hex SHA-256 of ``parts`` (JSON, sorted keys) with the schema version and versions."""
    payload = {"schema": SCHEMA_VERSION, **versions(), **parts}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


#: The cache's tables and their columns.
_TABLES = {"plans": ("key", "record"), "peaks": ("key", "batch", "record"),
           "allowances": ("platform", "device_kind", "record")}


class _Foreign(Exception):
    """A table of the cache's name with other columns (another program's file)."""


class PlanCacheUnusable(ValueError):
    """A plan cache that cannot serve (damaged, another program's file, not writable): the
    message names the file and what to do. Not a plan that does not fit, which callers that
    try other sizes catch as a `ValueError`."""


#: `PlanCache._read`'s answer for text that is no JSON (``null`` is JSON: None).
_UNREADABLE = object()


def _peak_record(record: Any) -> bool:
    """Whether ``record`` is what `PlanCache.put_peaks` stores: a `MemoryEstimate`'s fields
    (``rough`` besides)."""
    if not isinstance(record, dict):
        return False
    fields = {f.name: f for f in dataclasses.fields(MemoryEstimate)}
    needed = {name for name, f in fields.items() if f.default is dataclasses.MISSING}
    return (needed <= record.keys() and record.keys() <= {*fields, "rough"}
            and all(isinstance(record[name], int) for name in needed))


def _damaged(err: sqlite3.DatabaseError) -> bool:
    """Whether ``err`` says the file is no sound SQLite database (damaged, or another kind
    of file): not a lock, a full disk or a read-only file."""
    return "not a database" in str(err) or "malformed" in str(err)


def _create_tables(db: sqlite3.Connection) -> None:
    """The cache's tables, made where missing; raises `_Foreign` where one of their names
    has other columns, and SQLite's error where the file cannot be written (a plan found
    compiled could not be kept: said before it is compiled)."""
    db.execute("CREATE TABLE IF NOT EXISTS plans (key TEXT PRIMARY KEY, record TEXT)")
    db.execute("CREATE TABLE IF NOT EXISTS peaks (key TEXT, batch INTEGER, record TEXT, "
               "PRIMARY KEY (key, batch))")
    db.execute("CREATE TABLE IF NOT EXISTS allowances (platform TEXT, device_kind TEXT, "
               "record TEXT, PRIMARY KEY (platform, device_kind))")
    for table, columns in _TABLES.items():
        found = tuple(row[1] for row in db.execute(f"PRAGMA table_info({table})"))
        if found != columns:
            raise _Foreign(f"its table {table!r} has the columns {', '.join(found)}, not a "
                           f"plan cache's {', '.join(columns)}")
    # writes nothing, but only where it could: SQLite says a file is read-only before it
    # waits for another connection's write lock, so a lock held (a busy study, a database
    # browser left open) says it can be written, and is not waited for
    db.execute("PRAGMA busy_timeout = 0")
    try:
        db.execute("DELETE FROM plans WHERE 0")
    except sqlite3.OperationalError as err:
        if "locked" not in str(err) and "busy" not in str(err):
            raise
    finally:
        db.execute(f"PRAGMA busy_timeout = {int(_BUSY_TIMEOUT_S * 1000)}")


class PlanCache:
    """Plans and compiled peaks in a SQLite file (see the module docstring).

    Args:
      path: the database file, e.g. ``<study_dir>/plans.sqlite``, created with its parent
        directory when the cache is first used (a study that fails to open leaves nothing),
        and again where it was deleted since (its plans are then compiled again).
      elsewhere: what the errors advise where the file cannot be used (a study's cache is
        its folder's: "pass another study_dir").

    Attributes:
      hits, misses: plan lookups answered and not answered by this object, in this process.
    """

    def __init__(self, path: str | Path, *, elsewhere: str = "pass another path") -> None:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"PlanCache takes the path of its SQLite file (a str or "
                            f"pathlib.Path), not {type(path).__name__} {path!r}")
        self.path = Path(path)
        self.elsewhere = elsewhere
        self._lock = threading.Lock()
        self._created = False
        self.hits = 0
        self.misses = 0
        self._full_said = False
        self._unreadable_said = False

    @contextlib.contextmanager
    def _kept_going(self) -> Iterator[None]:
        """A store into a full disk (or one that fails to write) is skipped with a warning,
        once: the cache saves compiles, and the plan (or allowance) it would have kept is used
        all the same (a plan's trial is not failed for it, nor a study for its allowance)."""
        try:
            yield
        except sqlite3.OperationalError as err:
            if not any(word in str(err) for word in DISK_REFUSED):
                raise
            if not self._full_said:
                self._full_said = True
                # stacklevel: this generator, contextlib's exit, the store, its caller
                warnings.warn(f"the plan cache {str(self.path)!r} could not store a plan "
                              f"({err}); planning goes on, and compiles again what it "
                              "did not store (free space there, or check its disk)",
                              RuntimeWarning, stacklevel=4)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # A connection per call: sqlite3 connections are not shared across threads, and a
        # short-lived one never holds a lock between calls. ``with db`` commits (or rolls back).
        # Every caller holds ``self._lock``, so the file and its tables are made once, and
        # again where the file was deleted since (SQLite would open an empty one in its place).
        if self._created and not self.path.exists():
            self._created = False
        if not self._created:
            self._make_folder()
        try:
            db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S)
        except sqlite3.DatabaseError as err:
            raise self._unusable(err) from None
        try:
            try:
                write_ahead(db)  # a plan's few commits do not each wait for the disk
                if not self._created:
                    with db:
                        _create_tables(db)
            except _Foreign as err:
                raise PlanCacheUnusable(f"the plan cache {str(self.path)!r} is another program's "
                                 f"SQLite file ({err}); {self.elsewhere}") from None
            except sqlite3.DatabaseError as err:
                if "locked" in str(err):
                    raise
                raise self._unusable(err) from None
            self._created = True
            try:
                with db:
                    yield db
            except sqlite3.DatabaseError as err:
                if not _damaged(err):
                    raise
                raise self._unusable(err) from None  # damaged past what opening it reads
        finally:
            db.close()

    def _make_folder(self) -> None:
        """The cache's folder, made where missing; `ValueError` naming the part of its path
        that is a file (or what else stopped it)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            blocking = next((p for p in (self.path.parent, *self.path.parent.parents)
                             if p.exists() and not p.is_dir()), None)
            why = (f"{str(blocking)!r} is a file" if blocking is not None
                   else f"{err.strerror}: {err.filename!r}")
            raise PlanCacheUnusable(f"the plan cache {str(self.path)!r} cannot be made: {why}; "
                             f"{self.elsewhere}") from None

    def _unusable(self, err: sqlite3.DatabaseError) -> PlanCacheUnusable:
        where = str(self.path)
        if self.path.is_dir():  # a folder may hold anything: never advise deleting it
            return PlanCacheUnusable(f"the plan cache {where!r} is a folder; pass a file "
                                     f"path, e.g. {str(self.path / 'plans.sqlite')!r}")
        if "readonly" in str(err):
            return PlanCacheUnusable(
                f"the plan cache {where!r} cannot be written here ({err}): the plans compiled "
                f"would be lost; make it writable, or {self.elsewhere}")
        if not os.access(self.path.parent, os.W_OK):  # SQLite writes its journal beside it
            return PlanCacheUnusable(
                f"the plan cache {where!r} cannot be used ({err}): its folder "
                f"{str(self.path.parent)!r} cannot be written here; make it writable, or "
                f"{self.elsewhere}")
        if _damaged(err):
            # a damaged cache, or a file of anything else: deleting loses only plans
            return PlanCacheUnusable(
                f"the plan cache {where!r} cannot be used ({err}); a plan cache holds plans "
                "and measured allowances only: if this file is one, delete it (they are "
                f"compiled and measured again), else {self.elsewhere}")
        return PlanCacheUnusable(f"the plan cache {where!r} cannot be used ({err}); "
                                 f"{self.elsewhere}")

    def _read(self, text: Any) -> Any:
        """A stored record's JSON, or `_UNREADABLE` (a row damaged in a sound file)."""
        try:
            return json.loads(text)
        except (TypeError, ValueError):
            return _UNREADABLE

    def drop(self, table: str, where: Mapping[str, Any], what: str) -> None:
        """Remove the row of ``table`` that ``where`` names (column: value), an unreadable
        ``what``: a miss from now on, whose figures are compiled (an allowance: measured)
        again and stored anew; said once per cache object."""
        with self._lock, self._connect() as db, contextlib.suppress(sqlite3.OperationalError):
            db.execute(f"DELETE FROM {table} WHERE "
                       + " AND ".join(f"{column} = ?" for column in where), tuple(where.values()))
        if not self._unreadable_said:
            self._unreadable_said = True
            warnings.warn(f"the plan cache {str(self.path)!r} held {what}, which is removed: "
                          "what it held is compiled (or measured) again and kept anew",
                          RuntimeWarning, stacklevel=3)

    def get_plan(self, key: str) -> dict[str, Any] | None:
        """The plan record stored under ``key``, or None (counted in ``hits``/``misses``); an
        unreadable one is dropped (`drop`), a miss."""
        with self._lock, self._connect() as db:
            row = db.execute("SELECT record FROM plans WHERE key = ?", (key,)).fetchone()
        record = None if row is None else self._read(row[0])
        if row is not None and not isinstance(record, dict):
            self.drop("plans", {"key": key}, f"an unreadable plan record ({row[0]!r:.40})")
            record = None
        if record is None:
            self.misses += 1
            return None
        self.hits += 1
        return record

    def put_plan(self, key: str, record: Mapping[str, Any]) -> None:
        """Store ``record`` (JSON-serialisable) under ``key``, replacing an older one."""
        text = json.dumps(record, sort_keys=True)
        with self._kept_going(), self._lock, self._connect() as db:
            db.execute("INSERT OR REPLACE INTO plans (key, record) VALUES (?, ?)", (key, text))

    def get_peaks(self, key: str) -> dict[int, dict[str, Any]]:
        """Compiled memory records stored under ``key``, by global batch size (unreadable
        ones dropped)."""
        with self._lock, self._connect() as db:
            rows = db.execute("SELECT batch, record FROM peaks WHERE key = ?", (key,)).fetchall()
        out = {}
        for batch, text in rows:
            record = self._read(text)
            if isinstance(record, dict):
                out[int(batch)] = record
            else:
                self.drop("peaks", {"key": key, "batch": batch},
                          f"an unreadable compiled peak record ({text!r:.40})")
        return out

    def get_estimates(self, key: str) -> dict[int, tuple[MemoryEstimate, bool]]:
        """The compiled points stored under ``key`` (`get_peaks`' records of a planner's
        `MemoryEstimate`, with whether each was a rough compile), by global batch size; a
        record without an estimate's fields is dropped (`drop`)."""
        out = {}
        for batch, record in self.get_peaks(key).items():
            if not _peak_record(record):
                self.drop("peaks", {"key": key, "batch": batch},
                          "a compiled peak record without a MemoryEstimate's fields")
                continue
            record = dict(record)
            rough = bool(record.pop("rough", False))
            out[batch] = (MemoryEstimate(**record), rough)
        return out

    def put_peaks(self, key: str, records: Mapping[int, Mapping[str, Any]]) -> None:
        """Store compiled memory records (by global batch size) under ``key``."""
        rows = [(key, int(b), json.dumps(r, sort_keys=True)) for b, r in records.items()]
        with self._kept_going(), self._lock, self._connect() as db:
            db.executemany(
                "INSERT OR REPLACE INTO peaks (key, batch, record) VALUES (?, ?, ?)", rows
            )

    def get_allowance(self, platform: str, device_kind: str) -> dict[str, Any] | None:
        """The allowance record measured on ``device_kind`` devices of ``platform``, or None
        (also where it was unreadable: dropped, it is measured again).

        ``record["bytes"]`` is the allowance per device in bytes; the rest says how it was
        measured (see `put_allowance`).
        """
        with self._lock, self._connect() as db:
            row = db.execute(
                "SELECT record FROM allowances WHERE platform = ? AND device_kind = ?",
                (platform, device_kind),
            ).fetchone()
        if row is None:
            return None
        record = self._read(row[0])
        if not (isinstance(record, dict) and isinstance(record.get("bytes"), int)
                and not isinstance(record["bytes"], bool)):
            self.drop("allowances", {"platform": platform, "device_kind": device_kind},
                      f"an allowance record without its bytes ({row[0]!r:.40}), 0 until "
                      "measured again,")
            return None
        return record

    def put_allowance(self, platform: str, device_kind: str, record: Mapping[str, Any]) -> None:
        """Store the allowance measured on ``device_kind`` devices, replacing an older one.

        ``record`` must hold ``bytes`` (a non-negative int, per device); other JSON fields
        (the measurements it came from, versions) are kept as they are.
        """
        allowance = record.get("bytes")
        if isinstance(allowance, bool) or not isinstance(allowance, int) or allowance < 0:
            raise ValueError(
                f"allowance record needs 'bytes' as a non-negative int (bytes per device), "
                f"got {allowance!r}"
            )
        text = json.dumps(dict(record), sort_keys=True)
        with self._kept_going(), self._lock, self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO allowances (platform, device_kind, record) "
                "VALUES (?, ?, ?)",
                (platform, device_kind, text),
            )

    def __len__(self) -> int:
        """Number of stored plans."""
        with self._lock, self._connect() as db:
            return int(db.execute("SELECT COUNT(*) FROM plans").fetchone()[0])


def resolve_allowance(
    allowance_bytes: int | None, devices: Sequence[jax.Device], cache: PlanCache | None
) -> int:
    """Bytes per device a plan on ``devices`` sets aside for memory XLA does not see.

    ``allowance_bytes`` when given; else the largest allowance stored in ``cache`` for the
    devices' kinds (0 when none has been measured, as on CPU devices, whose allocator reports
    nothing: the safety margin is then all that covers it).
    """
    if allowance_bytes is not None:
        if isinstance(allowance_bytes, bool) or not isinstance(allowance_bytes, int) or (
                allowance_bytes < 0):
            raise ValueError(f"{allowance_bytes=} must be a non-negative int (bytes per device)")
        return allowance_bytes
    platform = devices[0].platform
    if cache is None:
        return 0
    found = [cache.get_allowance(platform, str(d.device_kind)) for d in devices]
    return max((int(r["bytes"]) for r in found if r is not None), default=0)
