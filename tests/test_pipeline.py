"""Pipelined supernet training: CSP equals sequential bit for bit, offload, baselines."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from scamp_jax.pipeline.executor import PipelineExecutor
from scamp_jax.pipeline.stage import OptimizerSpec
from scamp_jax.pipeline.trainer import train_supernet
from search_spaces.supernet import SupernetConfig, SupernetLayout, sample_subnets
from search_spaces.supernet_reference import train_reference

CONFIG = SupernetConfig(num_layers=4, num_choices=3, width=8, scale=2, window_size=4)
N, BATCH, SIDE = 6, 2, 4


@functools.cache
def _layout() -> SupernetLayout:
    return SupernetLayout(CONFIG)


@functools.cache
def _executor(stages: int, offload: bool, shared: bool, microbatches: int = 1):
    # Generous buffers so that every schedule below runs on the same compiled tick.
    slots = 2 * stages + 2
    return PipelineExecutor(
        _layout(), num_stages=stages, microbatch_size=BATCH // microbatches, lr_side=SIDE,
        window_slots=slots, act_slots=slots, grad_slots=slots, num_microbatches=microbatches,
        train_shared=shared, offload=offload,
    )


def _data(seed: int) -> tuple[list[tuple[int, ...]], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    lr = rng.random((N, BATCH, SIDE, SIDE, 3), dtype=np.float32)
    hr = rng.random((N, BATCH, 2 * SIDE, 2 * SIDE, 3), dtype=np.float32)
    return [s.choices for s in sample_subnets(N, CONFIG, seed)], lr, hr


@functools.cache
def _train(schedule: str, stages: int, offload: bool, shared: bool, seed: int):
    subnets, lr, hr = _data(seed)
    m = 2 if schedule == "gpipe" else 1
    return train_supernet(
        _layout(), subnets, lr, hr, schedule=schedule, num_stages=stages, seed=seed,
        offload=offload, train_shared=shared, num_microbatches=m,
        executor=_executor(stages, offload, shared, m),
    )


def _assert_identical(a, b):
    np.testing.assert_array_equal(a.losses, b.losses)
    np.testing.assert_array_equal(a.blocks, b.blocks)
    np.testing.assert_array_equal(a.shared, b.shared)
    assert a.params_sha256 == b.params_sha256


FAST = [(2, False, False), (2, True, False), (4, True, False), (2, False, True)]


@pytest.mark.parametrize(("stages", "offload", "shared"), FAST)
@pytest.mark.parametrize("seed", [0, 1])
def test_csp_bit_identical_to_sequential(stages, offload, shared, seed):
    csp, seq = _train("csp", stages, offload, shared, seed), _train("sequential", stages,
                                                                   offload, shared, seed)
    _assert_identical(csp, seq)
    if shared and stages == 2:
        # Every stage holds the stem or the head: trained shared weights serialise everything.
        assert csp.ticks == seq.ticks
    else:
        assert csp.ticks < seq.ticks
    assert np.all(np.isfinite(csp.losses))
    # Training moved the chosen blocks (and only those).
    subnets, _, _ = _data(seed)
    blocks0, shared0 = _layout().init(seed)
    used = {(layer, c) for s in subnets for layer, c in enumerate(s)}
    for layer in range(CONFIG.num_layers):
        for c in range(CONFIG.num_choices):
            moved = not np.array_equal(csp.blocks[layer, c], blocks0[layer, c])
            assert moved == ((layer, c) in used)
    assert np.array_equal(csp.shared, shared0) != shared


def test_initial_weights_start_the_run_and_csp_stays_bit_identical():
    """A run from given weights (e.g. a warmed-up stem and head, then frozen) starts from them:
    CSP equals sequential bit for bit, the frozen shared weights come back unchanged, and the
    blocks differ from a run from ``layout.init``."""
    subnets, lr, hr = _data(0)
    blocks0, shared0 = _layout().init(0)
    shared1 = (shared0 * np.float32(1.5)).astype(np.float32)
    runs = {
        name: train_supernet(
            _layout(), subnets, lr, hr, schedule=name, num_stages=4, seed=0, offload=True,
            initial_weights=(blocks0, shared1), executor=_executor(4, True, False),
        )
        for name in ("csp", "sequential")
    }
    _assert_identical(runs["csp"], runs["sequential"])
    assert runs["csp"].ticks < runs["sequential"].ticks
    np.testing.assert_array_equal(runs["csp"].shared, shared1)
    assert not np.array_equal(runs["csp"].blocks, _train("csp", 4, True, False, 0).blocks)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_csp_bit_identical_to_sequential_matrix(stages, offload, shared, seed):
    _assert_identical(
        _train("csp", stages, offload, shared, seed),
        _train("sequential", stages, offload, shared, seed),
    )


def test_offload_is_bit_identical_and_moves_the_store_to_host():
    on, off = _train("csp", 2, True, False, 0), _train("csp", 2, False, False, 0)
    _assert_identical(on, off)
    assert on.host_param_bytes > 0 and off.host_param_bytes == 0
    assert on.device_param_bytes < off.device_param_bytes


@functools.cache
def _reference(seed: int):
    subnets, lr, hr = _data(seed)
    # Stem and head trained too, so gradients crossing every stage boundary are checked.
    return train_reference(_layout(), subnets, lr, hr, seed=seed, train_shared=True)


#: Largest weight difference between the pipeline and the reference over seeds 0-2 and splits
#: into 2 and 4 stages (4.47e-7, seed 1, either split), rounded up.
REFERENCE_ATOL = 5e-7


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2))])
def test_pipeline_matches_independent_optax_reference(seed, stages):
    """Independent check of the math: a plain single-device loop on the Flax modules with
    per-block ``optax.adam`` (no code of the stage executor) trains the same subnets.

    The losses agree bit for bit. The weights do not, and the difference has one source: the
    pipeline runs a candidate block inside a ``lax.switch`` branch (a separate XLA computation,
    since the choice is run-time data), which XLA fuses and orders differently from the
    reference's straight-line code, so a few float sums in the backward of the MLP and
    attention blocks are associated differently. Measured on this supernet: one MLP block's
    weight gradient differs in the last bits of 14 of its entries between a jitted
    straight-line call and a run-time ``lax.switch`` branch, its input gradient in 1, an
    attention block's input gradient in 1; a convolution block's match bitwise, and with a
    constant index (the branch folded away) all three match bitwise. The operation: both
    blocks start with ``nnx.LayerNorm``, whose input gradient (sums over the channels in its
    backward) differs alone, in 95 of 256 entries for a (2, 4, 4, 8) input (up to 7e-8 of its
    largest entry), while a Linear layer, GELU + Linear and a plain sum match bitwise.
    `test_reference_difference_is_the_switch_branch_alone` pins the parts that do not differ.
    Adam divides each step by the root of the gradient's running square, so a gradient
    differing in its last bits gives a step differing in its last bits, and later subnets
    train on weights that differ: after 6 subnets the weights differ by at most 4.47e-7 (seed
    1, an attention qkv kernel), a 4.5e-4 fraction of one Adam step (1e-3); `REFERENCE_ATOL`.
    """
    losses, blocks, shared_w = _reference(seed)
    piped = _train("sequential", stages, False, True, seed)
    np.testing.assert_array_equal(piped.losses, losses)
    np.testing.assert_allclose(piped.blocks, blocks, rtol=0, atol=REFERENCE_ATOL)
    np.testing.assert_allclose(piped.shared, shared_w, rtol=0, atol=REFERENCE_ATOL)
    # The comparison is not vacuous: training moved the weights by far more than that.
    blocks0, shared0 = _layout().init(seed)
    assert np.abs(shared_w - shared0).max() > 1e-4 and np.abs(blocks - blocks0).max() > 1e-4


def test_reference_difference_is_the_switch_branch_alone():
    """What makes the pipeline differ from the reference in the last bits, and what does not.

    Not the flat weight layout and not the optimizer: a candidate block applied through
    ``lax.switch`` with a constant index (folded away) from its flat vector gives the same
    output and gradients, bit for bit, as the module called directly, and the pipeline's
    vmapped Adam over flat blocks (`OptimizerSpec.update`) equals ``optax.adam`` per block bit
    for bit. Both halves of the reference comparison therefore compute the same float
    operations except where XLA compiles a block inside a run-time ``lax.switch`` branch.
    """
    import jax.numpy as jnp
    import optax

    lay = _layout()
    blocks, _ = lay.init(0)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, SIDE, SIDE, CONFIG.width), np.float32))
    gy = jnp.asarray(rng.standard_normal((BATCH, SIDE, SIDE, CONFIG.width), np.float32))
    for c, cand in enumerate(lay.candidates):
        vec = jnp.asarray(blocks[0, c])

        def direct(v, h, cand=cand):
            return cand.module(v)(h)

        def switched(v, h, c=c):
            return lay.apply_block(c, v, h)

        outs = [
            jax.jit(lambda v, h, f=f: (f(v, h), *jax.vjp(f, v, h)[1](gy)))(vec, x)
            for f in (direct, switched)
        ]
        for a, b in zip(*outs, strict=True):
            np.testing.assert_array_equal(a, b)
    spec = OptimizerSpec("adam", 1e-3)
    tx = spec.transformation()
    p = jnp.asarray(rng.standard_normal((2, 3, 50), np.float32) * 0.1)
    fields = {"p": p, "m": jnp.zeros_like(p), "v": jnp.zeros_like(p)}
    steps = jnp.zeros((2, 3), jnp.int32)
    per_block = [[(p[i, j], tx.init(p[i, j])) for j in range(3)] for i in range(2)]
    one = jax.jit(lambda w, st, g: (lambda u, st: (optax.apply_updates(w, u), st))(
        *tx.update(g, st, w)))
    for _ in range(4):
        # Gradients from rounding noise to order one, as in training.
        g = jnp.asarray(rng.standard_normal((2, 3, 50), np.float32)
                        * 10.0 ** rng.integers(-10, 1, (2, 3, 50)))
        fields, steps = jax.jit(spec.update)(fields, steps, g)
        per_block = [[one(w, st, g[i, j]) for j, (w, st) in enumerate(row)]
                     for i, row in enumerate(per_block)]
        np.testing.assert_array_equal(
            fields["p"], np.stack([np.stack([w for w, _ in row]) for row in per_block]))


def test_gpipe_runs_on_the_same_executor_and_agrees_numerically():
    gp, seq = _train("gpipe", 2, False, False, 0), _train("sequential", 2, False, False, 0)
    # Microbatches change the summation order only: equal up to float rounding.
    np.testing.assert_allclose(gp.losses, seq.losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gp.blocks, seq.blocks, rtol=1e-4, atol=1e-6)
    assert gp.ticks == N * 2 * (2 + 2 - 1)


def test_device_bytes_bounded_with_offload_as_choices_grow():
    device_on, device_off, host_on = [], [], []
    # From 10 candidates on the largest op (conv7) is present, so the padded block size is fixed.
    for choices in (10, 20, 40):
        layout = SupernetLayout(
            SupernetConfig(num_layers=4, num_choices=choices, width=8, window_size=4)
        )
        for offload, out in ((True, device_on), (False, device_off)):
            ex = PipelineExecutor(
                layout, num_stages=2, microbatch_size=2, lr_side=4, window_slots=3,
                act_slots=3, grad_slots=3, offload=offload,
            )
            planned = ex.planned_bytes()
            out.append(planned["device_param_bytes"])
            if offload:
                host_on.append(planned["host_param_bytes"])
    assert device_on[0] == device_on[1] == device_on[2]
    assert device_off[0] < device_off[1] < device_off[2]
    assert host_on[0] < host_on[1] < host_on[2]
    assert device_on[2] < host_on[2] / 10


def test_reports_ticks_utilisation_and_bytes():
    res = _train("csp", 4, True, False, 0)
    assert 0 < res.stage_utilization <= res.ideal_utilization <= 1
    assert res.ideal_ticks <= res.ticks
    assert res.supernet_param_bytes > 0 and res.wall_seconds > 0
    assert len(res.params_sha256) == 64


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of num_stages=3"):
        PipelineExecutor(_layout(), num_stages=3, microbatch_size=2, lr_side=4,
                         window_slots=1, act_slots=1, grad_slots=1)
    with pytest.raises(ValueError, match="window_size=4"):
        PipelineExecutor(_layout(), num_stages=2, microbatch_size=2, lr_side=6,
                         window_slots=1, act_slots=1, grad_slots=1)
    with pytest.raises(ValueError, match="'rmsprop' is not supported"):
        OptimizerSpec("rmsprop")
    subnets, lr, hr = _data(0)
    small = PipelineExecutor(_layout(), num_stages=2, microbatch_size=2, lr_side=4,
                             window_slots=1, act_slots=1, grad_slots=1)
    with pytest.raises(ValueError, match="slots"):
        train_supernet(_layout(), subnets, lr, hr, schedule="csp", num_stages=2, offload=False,
                       executor=small)
    assert jax.device_count() >= 4
    # A choice out of range would train a clamped candidate and lose its update; a negative
    # one would be scheduled as a block of its own: both are refused before anything compiles.
    layers, choices = _layout().num_layers, _layout().num_choices
    for bad, says in (((choices,) * layers, f"picks {choices}; .* from 0 to {choices - 1}"),
                      ((-1,) * layers, "picks -1"), ((0,) * (layers + 1), "choices for")):
        with pytest.raises(ValueError, match=says):
            train_supernet(_layout(), [subnets[0], bad, *subnets[2:]], lr, hr, schedule="csp",
                           num_stages=2, offload=False)


def test_arguments_that_look_valid_but_are_not_are_refused():
    subnets, lr, hr = _data(0)
    # not a StageModel: the TypeError that lists what it lacks, not an AttributeError of the
    # first attribute the batches' check reads
    with pytest.raises(TypeError, match=r"object is not a StageModel: it lacks num_layers"):
        train_supernet(object(), subnets, lr, hr, num_stages=2)
    # True would count as candidate 1
    layers = _layout().num_layers
    with pytest.raises(ValueError, match=r"picks True; a layer's choice is a candidate index"):
        train_supernet(_layout(), [subnets[0], (True,) * layers, *subnets[2:]], lr, hr,
                       num_stages=2, offload=False)
    # NaN passes `<= 0` and turns every weight into NaN
    with pytest.raises(ValueError, match=r"learning_rate=nan must be a positive number"):
        OptimizerSpec("adam", float("nan"))
    # an executor of 2 stages under the default num_stages=4: the fix is num_stages=2 (the
    # caller built no program to split otherwise)
    with pytest.raises(ValueError, match=r"the executor passed runs 2 stages but num_stages=4; "
                       r"pass num_stages=2, or an ExecutorFactory to build one of 4 stages"):
        train_supernet(_layout(), subnets, lr, hr, offload=False,
                       executor=_executor(2, False, False))
    # optax's Adam where the stage programs take their own rule's spec; weights as a state
    import optax

    with pytest.raises(TypeError, match=r"optimizer takes an OptimizerSpec .*not "
                       r"GradientTransformationExtraArgs"):
        train_supernet(_layout(), subnets, lr, hr, num_stages=2, optimizer=optax.adam(1e-3))
    with pytest.raises(TypeError, match=r"initial_state takes a SupernetState \(a "
                       r"TrainResult's .state\), not tuple; for weights alone pass "
                       r"initial_weights=\(blocks, shared\)"):
        train_supernet(_layout(), subnets, lr, hr, num_stages=2,
                       initial_state=_layout().init(0))  # type: ignore[arg-type]


def test_an_executor_of_no_stages_or_of_one_device_twice_is_refused_in_words():
    sizes = dict(microbatch_size=BATCH, lr_side=SIDE, window_slots=2, act_slots=2, grad_slots=2)
    with pytest.raises(ValueError, match=r"num_stages=0 must be a positive int: one stage per "
                       r"device"):
        PipelineExecutor(_layout(), num_stages=0, **sizes)
    assert PipelineExecutor(_layout(), num_stages=np.int64(2), **sizes).spec.num_stages == 2
    one = jax.devices()[0]
    with pytest.raises(ValueError, match=r"name one device twice; each stage runs on a device "
                       r"of its own"):
        PipelineExecutor(_layout(), num_stages=2, devices=[one, one], **sizes)


def test_batches_given_as_lists_train_as_their_arrays():
    subnets, lr, hr = _data(0)
    as_arrays = train_supernet(_layout(), subnets, lr, hr, num_stages=2, offload=False)
    as_lists = train_supernet(_layout(), subnets, list(lr), list(hr), num_stages=2,
                              offload=False)
    assert as_lists.params_sha256 == as_arrays.params_sha256
    # subnets as a generator (a TypeError of len() before) or one array
    for given in ((tuple(s) for s in subnets), np.asarray(subnets)):
        again = train_supernet(_layout(), given, lr, hr, num_stages=2, offload=False)
        assert again.params_sha256 == as_arrays.params_sha256


def test_experiment_presets_and_flags():
    from experiments import supernet_nas

    smoke = supernet_nas.get_config("smoke")
    assert smoke.layers % smoke.stages == 0 and smoke.schedule == "csp" and smoke.offload
    assert supernet_nas.get_config("paper").stages == 8
    # The default run warms up the stem and head before the pipeline and keeps them frozen in
    # it (subnets beat bicubic and CSP overlaps subnets); blocks start as the identity.
    default = supernet_nas.get_config("default")
    assert default.shared_warmup > 0 and not default.train_shared and default.zero_init_residual
    assert not smoke.train_shared
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        supernet_nas.get_config("huge")
    args = supernet_nas.parser().parse_args(
        ["--schedule", "gpipe", "--no-offload", "--stages", "2", "--json", "x.json"]
    )
    assert (args.schedule, args.offload, args.stages, args.json) == ("gpipe", False, 2, "x.json")


@pytest.mark.slow
def test_experiment_smoke_run_writes_results(tmp_path, monkeypatch):
    import json

    from experiments import supernet_nas

    monkeypatch.chdir(tmp_path)  # where the default --out-dir (runs/supernet_nas) would go
    out = tmp_path / "json" / "run.json"
    summary = supernet_nas.main(
        ["--preset", "smoke", "--subnets", "8", "--eval-subnets", "2", "--json", str(out),
         "--quiet"]
    )
    written = json.loads(out.read_text())
    for key in ("losses", "params_sha256", "ticks", "stage_utilization", "device_param_bytes",
                "supernet_param_bytes", "wall_seconds", "bicubic_psnr", "stem_head_psnr",
                "warmup_steps", "warmup_seconds", "warmup_losses", "test"):
        assert key in written
    assert len(written["losses"]) == 8 and written == json.loads(json.dumps(summary))
    assert out.with_suffix(".png").exists()
    assert written["best"]["psnr"] > 20.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["json"]  # no empty --out-dir made


def test_an_executor_built_for_other_training_is_refused():
    """The update rule is the executor's and the schedule the arguments': an executor that
    trains the stem and head under a CSP schedule that overlaps subnets on them would no
    longer train as sequential training does, so the mismatch is an error."""
    subnets, lr, hr = _data(0)
    with pytest.raises(ValueError, match=r"built for other training: train_shared=False \(the "
                       r"executor's: True\)"):
        train_supernet(_layout(), subnets, lr, hr, schedule="csp", num_stages=2, offload=False,
                       executor=_executor(2, False, True))
    with pytest.raises(ValueError, match=r"offload=True \(the executor's: False\)"):
        train_supernet(_layout(), subnets, lr, hr, schedule="csp", num_stages=2,
                       executor=_executor(2, False, False))


def test_an_executor_built_for_another_model_is_refused():
    """An executor compiled its model's blocks, head and loss: given another layout (here one of
    the same sizes, so nothing else would notice) it trained its own and returned that."""
    subnets, lr, hr = _data(0)
    with pytest.raises(ValueError, match=r"the executor passed was built for another model \(a "
                       r"SupernetLayout other than the SupernetLayout passed\) and would train "
                       r"that one; pass the layout it was built with, or an ExecutorFactory"):
        train_supernet(SupernetLayout(CONFIG), subnets, lr, hr, schedule="csp", num_stages=2,
                       offload=False, executor=_executor(2, False, False))


def test_train_supernet_closes_the_executor_it_built_and_not_one_it_was_passed():
    """What a run builds from a factory it releases (an MPI executor's communicator); an
    executor passed in stays open for the caller's next run."""
    closes = []

    class Recorded(PipelineExecutor):
        def close(self) -> None:
            closes.append(self)
            super().close()

    subnets, lr, hr = _data(0)
    built = train_supernet(_layout(), subnets, lr, hr, schedule="csp", num_stages=2, seed=0,
                           offload=False, executor=Recorded)
    assert len(closes) == 1 and isinstance(closes[0], Recorded)
    _assert_identical(built, _train("csp", 2, False, False, 0))
    passed = Recorded(_layout(), num_stages=2, microbatch_size=BATCH, lr_side=SIDE,
                      window_slots=6, act_slots=6, grad_slots=6)
    train_supernet(_layout(), subnets, lr, hr, schedule="csp", num_stages=2, seed=0,
                   offload=False, executor=passed)
    assert closes == [closes[0]]
    # A cache of executors keeps what it builds: two runs on one executor, closed by the
    # cache's own close (an MPI executor would otherwise refuse the second run).
    from scamp_jax.pipeline.budget import ExecutorCache

    cache = ExecutorCache(Recorded)
    for _ in range(2):
        again = train_supernet(_layout(), subnets, lr, hr, schedule="csp", num_stages=2,
                               seed=0, offload=False, executor=cache)
        _assert_identical(again, built)
    assert (cache.built, cache.hits, len(closes)) == (1, 1, 1)
    cache.close()
    assert len(closes) == 2 and closes[1] is not closes[0]


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_ticks_in_flight_bound_changes_nothing_but_the_wait():
    # The default bound (4 ticks ahead of the host) against an unbounded queue and a bound of 1:
    # the same ops in the same order, so the same bits.
    subnets, lr, hr = _data(0)
    results = []
    for bound in (0, 1):
        executor = PipelineExecutor(
            _layout(), num_stages=2, microbatch_size=BATCH, lr_side=SIDE, window_slots=6,
            act_slots=6, grad_slots=6, max_in_flight=bound)
        assert executor.max_in_flight == bound
        results.append(train_supernet(_layout(), subnets, lr, hr, schedule="csp", num_stages=2,
                                      seed=0, offload=False, executor=executor))
    assert _executor(2, False, False).max_in_flight == 4
    for result in results:
        _assert_identical(result, _train("csp", 2, False, False, 0))
    with pytest.raises(ValueError, match="max_in_flight=-1 must be >= 0"):
        PipelineExecutor(_layout(), num_stages=2, microbatch_size=BATCH, lr_side=SIDE,
                         window_slots=6, act_slots=6, grad_slots=6, max_in_flight=-1)


def test_idle_tick_guard_changes_nothing_but_the_work():
    """Without the guard every tick fetches and writes back (masked); same bits either way."""
    subnets, lr, hr = _data(0)
    unguarded = PipelineExecutor(
        _layout(), num_stages=2, microbatch_size=BATCH, lr_side=SIDE, window_slots=6,
        act_slots=6, grad_slots=6, offload=True, guard_idle=False)
    assert not unguarded.spec.guard_idle and _executor(2, True, False).spec.guard_idle
    result = train_supernet(_layout(), subnets, lr, hr, schedule="csp", num_stages=2, seed=0,
                            offload=True, executor=unguarded)
    _assert_identical(result, _train("csp", 2, True, False, 0))


def _entry_instructions(hlo: str) -> list[tuple[str, str, list[str]]]:
    """``(name, opcode, operand names)`` of every instruction of a compiled HLO module's entry
    computation, in order."""
    entry = hlo[hlo.index("\nENTRY"):].split("\n")[1:]
    out = []
    for line in entry:
        match = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)$", line)
        if not match:
            continue
        name, rest = match.groups()
        if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
            depth = 0
            for i, ch in enumerate(rest):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    rest = rest[i + 1 :]
                    break
        else:
            rest = rest.split(" ", 1)[1]
        opcode, _, args = rest.strip().partition("(")
        operands = re.findall(r"%([\w.\-]+)", args.split("), ")[0])
        out.append((name, opcode, operands))
    return out


def _store_readers(hlo: str) -> set[str]:
    """Opcodes of the entry-computation instructions that take the store (the supernet in host
    memory: parameters named ``...['store'][...]``) as an operand, following it through
    bitcasts, tuples and tuple elements (which move nothing); empty when the store only passes
    through to the output (donated, so aliased)."""
    params = set(re.findall(r"%(\S+) = \S+ parameter\(\d+\).*op_name=\"\w+\[\\'store", hlo))
    assert params, "no store parameter found in the compiled program"
    tracked, readers = set(params), set()
    for name, opcode, operands in _entry_instructions(hlo):
        if tracked & set(operands):
            if opcode in ("bitcast", "tuple", "get-tuple-element"):
                tracked.add(name)
            else:
                readers.add(opcode)
    return readers


def _stage_tick_hlo(spec, stage: int, row: np.ndarray, executor: PipelineExecutor) -> str:
    """Optimised HLO of one stage's tick compiled for the constant instruction ``row`` (XLA folds
    the row's conditionals), the store in host memory and donated, as in the executor."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from scamp_jax.pipeline.stage import stage_tick

    mesh = jax.make_mesh((1,), ("stage",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:1])
    on = functools.partial(NamedSharding, mesh, P("stage"))
    shapes = executor.state_shapes()
    shard = jax.tree.map(lambda _: on(memory_kind="device"), shapes)
    shard["store"] = jax.tree.map(lambda _: on(memory_kind="pinned_host"), shapes["store"])
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype,
                                                            sharding=sh), shapes, shard)

    def body(st, lr, hr):
        st = jax.tree.map(lambda a: a[0], st)
        st, act, grad, loss = stage_tick(_layout(), spec, jax.numpy.int32(stage), st,
                                         jax.numpy.asarray(row), lr[0], hr[0])
        return jax.tree.map(lambda a: a[None], st), act[None], grad[None], loss[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("stage"),) * 3,
                           out_specs=(P("stage"),) * 4, check_vma=False)
    data = on()
    tick = jax.jit(mapped, donate_argnums=0, out_shardings=(shard, data, data, data))
    return tick.lower(
        state, jax.ShapeDtypeStruct((1, BATCH, SIDE, SIDE, 3), np.float32, sharding=data),
        jax.ShapeDtypeStruct((1, BATCH, 2 * SIDE, 2 * SIDE, 3), np.float32, sharding=data),
    ).compile().as_text()


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_idle_tick_moves_nothing_between_host_store_and_device():
    """With the supernet in host memory, a stage-tick that fetches no block and applies no
    update compiles to a program that never reads or writes the store: from the compiled HLO,
    not from equal results.

    Each stage-tick of a real CSP program is compiled with its instruction row as a constant
    (XLA folds the guards): rows that fetch nothing and apply nothing leave the store as a
    pass-through to the (aliased) output, rows that fetch or apply read it, and without the
    guard even an idle row writes it. The executor's real tick, whose rows are run-time data,
    touches the store only through the guards' conditionals, so an idle row takes a branch.
    (What every tick does move, idle or not, is its instruction rows and input microbatches.)
    """
    from scamp_jax.pipeline.csp import split_layers
    from scamp_jax.pipeline.program import BWD, COL, build_program
    from scamp_jax.pipeline.trainer import make_schedule

    subnets, _, _ = _data(0)
    bounds = split_layers(CONFIG.num_layers, 2)
    program = build_program(make_schedule("csp", subnets, bounds), subnets, bounds)
    executor = _executor(2, True, False)
    classes: dict[tuple[bool, int], tuple[int, np.ndarray]] = {}
    for t in range(program.ticks):
        for stage in range(2):
            row = program.table[t, stage]
            moves = row[COL["prefetch_slot"]] >= 0 or (row[COL["kind"]] == BWD
                                                       and row[COL["apply"]] == 1)
            classes.setdefault((bool(moves), int(row[COL["kind"]])), (stage, row))
    assert {k for k, _ in classes} == {False, True}
    for (moves, _), (stage, row) in classes.items():
        readers = _store_readers(_stage_tick_hlo(executor.spec, stage, row, executor))
        assert bool(readers) == moves, (row, readers)
    idle = next(row for (moves, kind), (_, row) in classes.items() if not moves and kind == 0)
    unguarded = dataclasses.replace(executor.spec, guard_idle=False)
    assert _store_readers(_stage_tick_hlo(unguarded, 0, idle, executor))
    # The real tick: the store reaches nothing but the guards' conditionals and the output.
    sh = executor._sharding()
    width = program.table.shape[2]
    real = executor._tick.lower(
        executor._abstract_state(), jax.ShapeDtypeStruct((2, width), np.int32, sharding=sh),
        jax.ShapeDtypeStruct((2, BATCH, SIDE, SIDE, 3), np.float32, sharding=sh),
        jax.ShapeDtypeStruct((2, BATCH, 2 * SIDE, 2 * SIDE, 3), np.float32, sharding=sh),
    ).compile().as_text()
    assert _store_readers(real) == {"conditional"}


@pytest.mark.parametrize("schedule", ["csp", "sequential"])
@pytest.mark.parametrize(("stages", "offload", "shared"), [
    *FAST[1:], pytest.param(4, True, True, marks=pytest.mark.slow)])
def test_training_in_segments_equals_one_run(schedule, stages, offload, shared):
    """Subnets [0, k) and then [k, N) from the first call's weights and optimizer state
    (`TrainResult.state`) train exactly as [0, N) in one call: the same losses and weights bit
    for bit, the stem and head's optimizer state included when they train."""
    from scamp_jax.pipeline import SupernetState

    subnets, lr, hr = _data(0)
    whole = _train(schedule, stages, offload, shared, 0)
    run = functools.partial(
        train_supernet, _layout(), schedule=schedule, num_stages=stages, offload=offload,
        train_shared=shared, executor=_executor(stages, offload, shared))
    k = 2
    first = run(subnets[:k], lr[:k], hr[:k], seed=0)
    assert isinstance(first.state, SupernetState)
    assert int(first.optimizer["shared_step"]) == (k if shared else 0)
    assert first.optimizer["block_steps"].sum() == k * CONFIG.num_layers
    second = run(subnets[k:], lr[k:], hr[k:], seed=99, initial_state=first.state)
    np.testing.assert_array_equal(np.concatenate([first.losses, second.losses]), whole.losses)
    np.testing.assert_array_equal(second.blocks, whole.blocks)
    np.testing.assert_array_equal(second.shared, whole.shared)
    assert second.params_sha256 == whole.params_sha256
    assert second.optimizer.keys() == whole.optimizer.keys()
    for key, value in whole.optimizer.items():
        np.testing.assert_array_equal(second.optimizer[key], value, err_msg=key)
    # Without the optimizer state the second part trains otherwise.
    cold = run(subnets[k:], lr[k:], hr[k:], initial_weights=(first.blocks, first.shared))
    assert cold.params_sha256 != whole.params_sha256


def test_an_optimizer_state_that_does_not_fit_is_refused():
    subnets, lr, hr = _data(0)
    state = _train("csp", 2, True, False, 0).state
    executor = _executor(2, True, False)
    blocks, shared = state.blocks, state.shared
    with pytest.raises(ValueError, match="missing shared_step"):
        executor.init_state(blocks, shared, {k: v for k, v in state.optimizer.items()
                                             if k != "shared_step"})
    with pytest.raises(ValueError, match="'block_steps' of shape"):
        executor.init_state(blocks, shared, {**state.optimizer, "block_steps": np.zeros(3)})
    sgd = PipelineExecutor(_layout(), num_stages=2, microbatch_size=BATCH, lr_side=SIDE,
                           window_slots=2, act_slots=2, grad_slots=2,
                           optimizer=OptimizerSpec("sgd"))
    with pytest.raises(ValueError, match="unexpected blocks_m, blocks_v, shared_m, shared_v"):
        sgd.init_state(blocks, shared, state.optimizer)
    with pytest.raises(ValueError, match="not both"):
        train_supernet(_layout(), subnets, lr, hr, num_stages=2, initial_state=state,
                       initial_weights=(blocks, shared), executor=executor)


def test_segments_share_one_executor_until_a_program_needs_more_slots():
    """The experiment's segments reuse the compiled executor while their programs fit it and
    build one with the larger slots (closing the old) only when a program needs more."""
    from search_spaces.supernet_nas import _GrowingExecutor

    class Built:
        def __init__(self, model, **sizes):
            self.sizes, self.closed = sizes, False

        def close(self):
            self.closed = True

    factory = _GrowingExecutor(Built)
    base = {"num_stages": 2, "window_slots": 3, "act_slots": 2, "grad_slots": 2}
    first = factory(None, **base)
    assert factory(None, **{**base, "window_slots": 2}) is first
    grown = factory(None, **{**base, "act_slots": 4})
    assert grown is not first and first.closed and factory.built == 2
    assert grown.sizes == {**base, "act_slots": 4}
    other = factory(None, **{**base, "num_stages": 4, "window_slots": 1})
    assert other.sizes["window_slots"] == 1 and grown.closed  # other sizes: built as asked
    factory.close()
    assert other.closed and factory.executor is None


def _slice_hr(lr, hr):
    return lr, hr[:-1]


def _wrong_scale(lr, hr):
    return lr, np.zeros((*hr.shape[:2], 3 * SIDE, 3 * SIDE, 3), np.float32)


def _no_samples(lr, hr):
    return lr[:, :0], hr[:, :0]


def _one_channel(lr, hr):
    return lr[..., :1], hr[..., :1]


def _not_square(lr, hr):
    return lr[:, :, :, :3], hr[:, :, :, :6]


@pytest.mark.parametrize(("malform", "says"), [
    (_slice_hr, rf"hr_batches holds {N - 1} batches but lr_batches {N}; pass one HR batch per "
                r"LR batch"),
    (_wrong_scale, r"hr_batches' images are \(12, 12, 3\) but the supernet turns LR images of "
                   r"\(4, 4, 3\) into \(8, 8, 3\); pass HR targets of that shape"),
    (_no_samples, r"lr_batches' batches hold 0 samples; pass at least one sample per batch"),
    (_one_channel, r"lr_batches' images of \(4, 4, 1\) do not fit the supernet's input "
                   r"\(.*\); pass images with the channels it takes"),
    (_not_square, r"lr_batches' images are 4 x 3 pixels; the supernet takes square images: pass "
                  r"LR patches as high as they are wide"),
], ids=["hr_short", "hr_wrong_scale", "no_samples", "one_channel", "not_square"])
def test_malformed_batches_are_refused_before_anything_compiles(malform, says):
    from scamp_jax.planning.compile_events import CompileCounter

    layout, (subnets, lr, hr) = _layout(), _data(0)
    lr, hr = malform(lr, hr)
    with CompileCounter() as compiles, pytest.raises(ValueError, match=says):
        train_supernet(layout, subnets, lr, hr, schedule="csp", num_stages=2, offload=False)
    assert compiles.total == 0, compiles.compiles



def test_the_best_subnet_is_tested_on_photographs_no_subnet_was_chosen_by():
    """The NAS run's best subnet, chosen by its held-out PSNR, is scored once more on the test
    photographs (cropped as the held-out ones): the chosen subnet's weights on other images,
    beside the stem and head alone and bicubic there."""
    from search_spaces.sr_data import bundled_test_images
    from search_spaces.supernet_nas import (
        NASConfig,
        evaluate_subnets,
        held_out_images,
        stem_head_psnr,
        test_best,
    )

    config = NASConfig(layers=4, choices=3, width=8, eval_crop=32, zero_init_residual=False)
    assert config.supernet == CONFIG
    result = _train("sequential", 1, False, True, 0)
    subnets = _data(0)[0]
    tested = test_best(config, _layout(), result, {"index": 4, "choices": list(subnets[4])})
    lr, hr = held_out_images(config, bundled_test_images())
    assert [x.shape for x in hr] == [(32, 32, 3)] * 2 and np.array_equal(hr[0][..., 0],
                                                                         hr[0][..., 2])
    [psnr] = evaluate_subnets(_layout(), result.blocks, result.shared, [subnets[4]], lr, hr)
    assert tested["index"] == 4 and tested["psnr"] == psnr
    assert tested["stem_head_psnr"] == stem_head_psnr(_layout(), result.shared, lr, hr)
    held = held_out_images(config)  # the images the subnet was chosen by score it otherwise
    assert abs(tested["psnr"] - evaluate_subnets(_layout(), result.blocks, result.shared,
                                                 [subnets[4]], *held)[0]) > 0.1
