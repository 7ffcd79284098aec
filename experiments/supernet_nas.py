"""Pipelined supernet NAS for x2 super-resolution (NASPipe's CSP scheduling in JAX).

Run (4 pipeline stages on CPU devices on a CPU-only machine)::

    python -m experiments.supernet_nas                      # minutes on 2 CPU cores
    python -m experiments.supernet_nas --preset smoke       # about a minute
    python -m experiments.supernet_nas --schedule sequential --json runs/seq.json
    python -m experiments.supernet_nas --shared-warmup 0 --train-shared   # stem/head in the pipe
    mpirun -n 4 python -m experiments.supernet_nas --mpi    # one stage per MPI rank (host)

Expected: the supernet trains through the pipeline (identical ``losses`` and ``params_sha256``
for ``csp`` and ``sequential``), then a results table ranks the evaluated subnets by held-out PSNR
next to bicubic upscaling. ``results.json`` and ``results.png`` go to ``--out-dir`` (or next to
``--json``).

Stopping and resuming: training goes in segments of ``--checkpoint-every`` subnets (default 100, a
few minutes at most on the default preset; 0: one segment), each continuing from the previous one's
weights and optimizer state, and after each segment but the last the weights, optimizer state,
losses so far and the settings that must match (preset, sizes, schedule, stages, seed, learning
rate, warm-up, ...) are saved with orbax in ``<out-dir>/checkpoint`` (with ``--json PATH`` and no
``--out-dir``: ``PATH.checkpoint``, so runs with their own JSON files share none). After a Ctrl-C,
SIGTERM or kill, run the same command: it says ``resuming from subnet k of N`` and continues (the
warm-up is not redone: its result is in the saved weights); its ``losses`` and ``params_sha256``
equal those of a run that never stopped, and ``ticks``, ``wall_seconds`` and the rates in
``results.json`` sum every segment, those of the stopped process included (``segments`` lists them,
``resumed_at`` the subnets done at each resume). A checkpoint of other settings in the same
``--out-dir`` is refused in one line naming what differs (``--offload`` or ``--no-offload`` may
differ: it changes where the supernet lives, not a bit of it); pass another ``--out-dir``, or
``--fresh`` to discard it. A finished run deletes its checkpoint once the results are written, so
the same command run again trains from the start. Under ``--mpi`` rank 0 writes the checkpoint and
every rank reads it. Each segment drains the pipeline at its end: the default preset's CSP run
takes 1470 ticks in 4 segments instead of 1454 in one, and on 2 shared cores the whole process 92 s
instead of 87 s (three saves; later segments reuse the compiled tick), with the same
``params_sha256`` (the figures below are of one segment).

The default preset first trains the stem and head alone (``--shared-warmup 1000`` Adam steps on
one device, every block starting as the identity, a few seconds), then freezes them and trains
the blocks through the pipeline. Frozen shared weights leave CSP free to overlap subnets; trained
ones (``--train-shared``) make every pair of subnets dependent on the first and last stage. No
CSP rule can overlap subnets while the stem and head take one update per subnet and stay
bit-identical to sequential training: subnet b's first forward reads the stem as updated by
subnet b - 1's backward on stage 0, which comes after b - 1's forward and backward through
every stage, so stage 0 runs one subnet at a time.

Measured on small settings first (``--preset smoke --subnets 96 --schedule csp|sequential`` plus
the flags below; 4 stages, 4 layers x 4 candidates; held-out PSNR on Y of the best of 4 subnets,
bicubic 30.71 dB)::

    option (flags)                                      ticks csp / seq   best PSNR
    (a) frozen random stem/head, output added to          432 / 768        30.66
        bicubic upscaling (--shared-warmup 0)
    stem/head trained in the pipeline                     768 / 768        30.77
        (--shared-warmup 0 --train-shared)
    (b) warm-up, then frozen: the default                 432 / 768        31.11
        (--shared-warmup 1000)

Then the default preset (8 layers x 12 candidates, width 16, 400 subnets of batch 8, 4 stages,
Adam 2e-3, seed 0; best of 12 subnets on the held-out photographs, bicubic 33.06 dB), the
before and after runs started side by side under ``nice -n 5`` on 2 shared cores::

    python -m experiments.supernet_nas --json after.json         (this default)
    python -m experiments.supernet_nas --schedule sequential     (same weights hash)
    python -m experiments.supernet_nas   (before: the previous default, stem/head trained in
                                          the pipeline; now --shared-warmup 0 --train-shared)

    run                     ticks csp / seq / gpipe   best PSNR (all 12)     stem+head   wall
    before                  3200 / 3200 / 5600        33.38 (33.28-33.38)    -           316, 519 s
    warm-up 1000, frozen    1454 / 3200 / 5600        33.61 (33.48-33.61)    33.50       247, 429 s

CSP needs 1/2.20 of sequential's ticks (GPipe's ticks carry a quarter batch each), the best
subnet is 0.55 dB above bicubic and 0.11 dB above the warmed-up stem and head alone, and the whole
process took 0.78x and 0.83x the time in two side-by-side pairs (the warm-up itself 10-20 s).

"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

PRESETS = ("smoke", "default", "paper")
SCHEDULES = ("csp", "gpipe", "sequential")
#: Most CPU devices the CLI creates for stages (XLA's virtual host devices); beyond this a CPU
#: pipeline spends minutes building devices and compiling for no insight.
MAX_CPU_STAGES = 16


def cpu_devices(stages: int) -> int:
    """The CPU devices a run of ``stages`` pipeline stages makes in its process, and the size
    of XLA's CPU worker pool: at least 8, one per stage up to `MAX_CPU_STAGES`. One process
    and every MPI rank (which runs its stage on its first device) make the same, whatever
    cores each may use, because XLA's CPU convolutions split their work by the pool's size
    and round differently with another split
    (`scamp_jax.pipeline.determinism.use_fixed_cpu_threads`; on 2 cores, 1, 4, 8 and 16
    devices trained the default preset to four weight hashes after 8 subnets)."""
    return min(max(8, stages), MAX_CPU_STAGES)


def _same_bits_everywhere(stages: int) -> None:
    """Before JAX starts, so that CSP, sequential, a rerun and the MPI ranks compute the same
    bits: deterministic GPU kernels where JAX would run on a GPU; otherwise `cpu_devices` CPU
    devices and a CPU worker pool of as many threads (on GPUs the variable would also size
    the GPU client's own thread pools, and the CPU does not train). Where JAX has started
    already (a notebook, a test) its devices and pool are used as they are."""
    from scamp_jax.devices import configure_cpu_devices
    from scamp_jax.pipeline.determinism import (
        gpu_backend_installed,
        use_deterministic_gpu_ops,
        use_fixed_cpu_threads,
    )

    use_deterministic_gpu_ops()
    try:
        configure_cpu_devices(cpu_devices(stages))
    except RuntimeError:
        return  # JAX already started: its devices and pool are used as they are
    if not gpu_backend_installed():
        use_fixed_cpu_threads(cpu_devices(stages))


def get_config(preset: str = "default"):
    """The experiment's `NASConfig` for ``preset`` (``smoke``, ``default`` or ``paper``)."""
    from search_spaces.supernet_nas import NASConfig

    if preset == "smoke":
        return NASConfig(preset="smoke", stages=4, layers=4, choices=4, width=8, subnets=24,
                         batch_size=4, hr_patch=16, eval_subnets=4, eval_crop=96,
                         shared_warmup=0)
    if preset == "default":
        return NASConfig(preset="default")
    if preset == "paper":
        # GPU cluster sizes: a deep supernet with many candidates, 8 stages, long training.
        return NASConfig(preset="paper", stages=8, layers=24, choices=24, width=64,
                         subnets=20_000, batch_size=32, hr_patch=48, learning_rate=2e-4,
                         eval_subnets=64, eval_crop=100_000, shared_warmup=0)
    raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def _presets_text() -> str:
    """What each preset sets (``--help``'s epilog), from `get_config` itself."""
    parts = []
    for name in PRESETS:
        c = get_config(name)
        parts.append(
            f"{name}: {c.stages} stages, {c.layers} layers x {c.choices} choices, width "
            f"{c.width}, {c.subnets:,} subnets of batch {c.batch_size} ({c.hr_patch}-pixel HR "
            f"patches), Adam {c.learning_rate:g}, shared warm-up {c.shared_warmup}, "
            f"{c.eval_subnets} subnets ranked")
    every = get_config("default")
    return ("Presets (--preset; flags override them): " + "; ".join(parts) + ". Every preset: "
            f"--schedule csp, --offload, --no-train-shared, --seed 0, --microbatches "
            f"{every.microbatches} (gpipe), --checkpoint-every {every.checkpoint_every}.")


def parser() -> argparse.ArgumentParser:
    """The command-line flags (``--help`` lists them)."""
    from experiments._cli import Parser

    p = Parser(
        prog="python -m experiments.supernet_nas",
        description="Train a weight-sharing SR supernet with pipelined subnets, rank subnets.",
        epilog=_presets_text(),
    )
    p.add_argument("--preset", choices=PRESETS, default="default",
                   help="size preset: smoke (about a minute; no warm-up, so its subnets "
                        "need not beat bicubic), default (minutes), paper (GPUs, and 21 GiB "
                        "of host memory for its training patches); the epilog lists their "
                        "sizes")
    p.add_argument("--schedule", choices=SCHEDULES,
                   help="pipeline schedule: csp (several subnets in flight), gpipe "
                        "(microbatched, flush per subnet) or sequential (one subnet at a time)")
    p.add_argument("--stages", type=int, help="pipeline stages, one device each")
    p.add_argument("--layers", type=int, help="choice layers L (a multiple of --stages)")
    p.add_argument("--choices", type=int, help="candidate operations per layer C")
    p.add_argument("--width", type=int, help="feature channels of the supernet")
    p.add_argument("--subnets", type=int, help="subnets trained (one batch each)")
    p.add_argument("--batch-size", type=int, help="patches per subnet batch")
    p.add_argument("--microbatches", type=int,
                   help="microbatches per batch under --schedule gpipe (only there)")
    p.add_argument("--seed", type=int, help="seed of weights, subnets and patches")
    p.add_argument("--shared-warmup", type=int,
                   help="Adam steps training the stem and head alone before the pipeline "
                        "(default preset 1000, so subnets beat bicubic; smoke and paper: 0)")
    p.add_argument("--train-shared", action=argparse.BooleanOptionalAction, default=None,
                   help="also train the stem and head in the pipeline (default off: frozen "
                        "there, as in the NASPipe artifact; on serialises CSP on the first and "
                        "last stage)")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the supernet in host memory, chosen blocks on the devices "
                        "(default on)")
    p.add_argument("--eval-subnets", type=int, help="subnets ranked on held-out patches")
    p.add_argument("--out-dir", help="directory of results.json, results.png and the run's "
                                     "checkpoint (default runs/supernet_nas); with --json, "
                                     "of the checkpoint only")
    p.add_argument("--json", metavar="PATH.json", type=_json_name,
                   help="write the JSON summary here, a name ending in .json (the plot "
                        "PATH.png and, until the run ends, its checkpoint PATH.checkpoint go "
                        "next to it; the checkpoint goes to --out-dir where that is given)")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="train in segments of N subnets and save a checkpoint (orbax) in "
                        "<out-dir>/checkpoint (with --json PATH alone: PATH.checkpoint) after "
                        "each segment but the last (default 100; 0: none, though an "
                        "unfinished run's checkpoint is still resumed). Run the same command "
                        "again after a stop (Ctrl-C, kill) to resume from it, with the losses "
                        "and weights hash of a run that never stopped; a finished run deletes "
                        "it, so running it again trains from the start. A run of N subnets or "
                        "fewer saves none (the smoke preset's 24: pass e.g. --checkpoint-every "
                        "6 to try a resume there)")
    p.add_argument("--fresh", action="store_true",
                   help="discard the checkpoint of an unfinished run in --out-dir and train "
                        "from the start")
    p.add_argument("--quiet", action="store_true", help="no progress or tables")
    p.add_argument("--mpi", action="store_true",
                   help="one pipeline stage per MPI rank (launch with mpirun -n <stages>; "
                        "needs the mpi extra); same losses and weights hash as one process")
    return p


_AT_LEAST_ONE = (
    ("layers", "--layers", 8), ("stages", "--stages", 4), ("width", "--width", 16),
    ("choices", "--choices", 12), ("subnets", "--subnets", 400),
    ("batch_size", "--batch-size", 8), ("microbatches", "--microbatches", 4),
    ("eval_subnets", "--eval-subnets", 12),
)
_AT_LEAST_ZERO = (("shared_warmup", "--shared-warmup", 1000),
                  ("checkpoint_every", "--checkpoint-every", 100))


def check_config(config, p: argparse.ArgumentParser, preset=None, ranks: int | None = None
                 ) -> None:
    """Exit with a one-line error (``p.error``, exit status 2) naming the flag and the fix when
    the sizes of ``config`` cannot be trained; nothing is built or compiled before. The fix
    suggests ``preset``'s value of the flag (the preset the command runs), else the default
    preset's. ``ranks``: the stages are the MPI launcher's ranks (``--mpi``), which the fix
    names instead of ``--stages``."""
    for field, flag, example in _AT_LEAST_ONE:
        value = getattr(config, field)
        if value < 1:
            example = max(1, getattr(preset, field, example))
            p.error(f"{flag} {value} must be at least 1; pass e.g. {flag} {example}")
    for field, flag, example in _AT_LEAST_ZERO:
        value = getattr(config, field)
        example = max(0, getattr(preset, field, example))
        if value < 0:
            p.error(f"{flag} {value} must be at least 0 (0: none); pass e.g. {flag} {example}")
    if config.seed < 0:
        p.error(f"--seed {config.seed} must be at least 0; pass e.g. --seed "
                f"{max(0, getattr(preset, 'seed', 0))}")
    if config.layers % config.stages:
        fits = [s for s in range(1, config.layers + 1) if config.layers % s == 0]
        up = -(-config.layers // config.stages) * config.stages
        if ranks is not None:
            launch = [s for s in fits if s > 1]  # --mpi refuses one rank
            p.error(
                f"--layers {config.layers} is not a multiple of the {ranks} MPI ranks (one "
                f"pipeline stage each, every stage holds the same number of layers); pass "
                f"--layers {up}" + (f" or launch {' or '.join(map(str, launch))} ranks "
                                    f"(mpirun -n {launch[0]} ...)" if launch else "")
            )
        p.error(
            f"--layers {config.layers} is not a multiple of --stages {config.stages} (every "
            f"stage holds the same number of layers); pass --layers {up} or --stages one of "
            f"{', '.join(map(str, fits))}"
        )
    space = config.choices ** config.layers
    if config.eval_subnets > space:
        p.error(
            f"--eval-subnets {config.eval_subnets} is more than the {space} different subnets "
            f"of --choices {config.choices} in --layers {config.layers}; pass --eval-subnets "
            f"{space} or fewer"
        )
    _check_patches_fit_the_host(config, p)
    if config.schedule == "gpipe" and config.batch_size % config.microbatches:
        p.error(
            f"--batch-size {config.batch_size} is not a multiple of --microbatches "
            f"{config.microbatches}; pass --batch-size "
            f"{max(1, config.batch_size // config.microbatches) * config.microbatches}"
        )


#: The share of the host's memory the training patches may take (the supernet, its optimizer
#: state and the process take the rest).
PATCH_SHARE = 0.5


def _check_patches_fit_the_host(config, p: argparse.ArgumentParser) -> None:
    """Exit 2 where every subnet's batch of training patches, drawn before training, would
    take more than `PATCH_SHARE` of this host's memory (the paper preset's 20,000 subnets x
    32 patches: 20.6 GiB), naming the most ``--subnets`` that fit."""
    from scamp_jax._units import format_bytes
    from scamp_jax.devices import host_memory_bytes
    from search_spaces.supernet_nas import training_patch_bytes

    host = host_memory_bytes()
    need = training_patch_bytes(config)
    if host is None or need <= PATCH_SHARE * host:
        return
    most = int(PATCH_SHARE * host) // max(1, need // config.subnets)
    p.error(f"--subnets {config.subnets} x --batch-size {config.batch_size} draws "
            f"{format_bytes(need)} of training patches before training, more than "
            f"{PATCH_SHARE:.0%} of this host's {format_bytes(host)} of memory; pass --subnets "
            f"{most} or fewer (or run on a host with more memory)")


def check_outputs(config, args: argparse.Namespace) -> None:
    """Exit 2 before anything trains unless the results' folder (``--out-dir``) and the JSON
    summary's (``--json``) can be written; creates nothing."""
    from experiments._cli import check_study_dir, fail

    check_study_dir(config.out_dir, "--out-dir")
    if args.json is not None:
        if Path(args.json).is_dir():
            fail(f"--json {args.json!r} is a directory; pass a file name, e.g. "
                 f"{str(Path(args.json) / 'results.json')!r}")
        check_study_dir(Path(args.json).parent, "--json's folder")
        suffix = Path(args.json).suffix
        if suffix in (".png", ".checkpoint"):  # the plot's, or the checkpoint's, name
            fail(f"--json {args.json!r}: the {'plot' if suffix == '.png' else 'checkpoint'} "
                 f"beside it takes that name; pass a name ending in .json, e.g. "
                 f"{str(Path(args.json).with_suffix('.json'))!r}")
        if suffix != ".json":  # the plot and the checkpoint beside it take its stem (r.JSON: r)
            same = str(Path(args.json).with_suffix(".json"))
            fail(f"--json {args.json!r}: the plot and the checkpoint beside it take the name "
                 f"without its ending, which a run writing {same!r} would share; pass a name "
                 f"ending in .json, e.g. {same!r}")


def check_checkpoint(config, args: argparse.Namespace) -> None:
    """Exit 2 before anything trains when ``--out-dir`` holds the checkpoint of an unfinished
    run with other settings (unless ``--fresh`` discards it), naming what differs."""
    from experiments._cli import fail
    from search_spaces.supernet_nas import NASCheckpoint

    if args.fresh:
        return
    checkpoint = NASCheckpoint(config)
    try:
        checkpoint.check()
    except ValueError as err:
        fail(str(err))
    finally:
        checkpoint.close()


def check_devices(stages: int, p: argparse.ArgumentParser) -> None:
    """Exit with a one-line error unless JAX has at least ``stages`` devices (one per stage)."""
    import jax

    devices = jax.devices()
    if stages > len(devices):
        where = jax.default_backend()
        p.error(
            f"--stages {stages} needs one device per stage but there are {len(devices)} "
            f"{where} devices; pass --stages {len(devices)} or fewer (with --layers a multiple "
            "of it)"
        )


def main(argv: Sequence[str] | None = None) -> dict | None:
    """Parse flags, set up devices, run `search_spaces.supernet_nas.run_nas`; return it. Bad
    input and a stop end in one line (`experiments._cli.user_errors`)."""
    from experiments._cli import user_errors

    p = parser()
    args = p.parse_args(argv)
    with user_errors(stopped=_stopped_words(args)):
        return _main(p, args)


def checkpoint_dir(args: argparse.Namespace) -> str | None:
    """Where a run's checkpoint goes: beside ``--json PATH`` (``PATH.checkpoint``) when results
    go there and not to an ``--out-dir``, so runs with their own JSON files share none; else
    None (``<out-dir>/checkpoint``)."""
    if args.json is not None and args.out_dir is None:
        return str(Path(args.json).with_suffix(".checkpoint"))
    return None


def _json_name(text: str) -> str:
    """argparse type of ``--json``: a file name with a stem for the plot and the checkpoint
    beside it (``PATH.png``, ``PATH.checkpoint``); its suffix is checked with the outputs."""
    name = Path(text).name
    if not text.strip() or not name or (name.startswith(".") and not Path(text).suffix):
        raise argparse.ArgumentTypeError(
            f"{text!r} names no file (the plot and the checkpoint beside it take its stem); "
            "pass a name ending in .json, e.g. results.json")
    return text


def _stopped_words(args: argparse.Namespace) -> Callable[[], str]:
    """What a stop (Ctrl-C, SIGTERM) leaves, for ``interrupted: ...``: worded when the stop
    comes, by whether a checkpoint is there."""
    config = get_config(args.preset)
    where = Path(checkpoint_dir(args) or Path(args.out_dir or config.out_dir) / "checkpoint")
    results = Path(args.json) if args.json else Path(args.out_dir or config.out_dir,
                                                     "results.json")
    started = time.time()

    def words() -> str:
        saved = where.is_dir() and any(p.name.isdigit() for p in where.iterdir())
        if not saved and results.is_file() and results.stat().st_mtime >= started - 1:
            return (f"the run had finished: its results are in {results} and "
                    f"{results.with_suffix('.png')}")
        if not saved:
            return ("no checkpoint was saved yet (one is saved after each segment of "
                    "--checkpoint-every subnets but the last); run the same command to train "
                    "again")
        return f"the last checkpoint is in {where}; run the same command to resume from it"

    return words


def _main(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict | None:
    config = get_config(args.preset)
    overrides = {
        "schedule": args.schedule, "stages": args.stages, "layers": args.layers,
        "choices": args.choices, "width": args.width, "subnets": args.subnets,
        "batch_size": args.batch_size, "microbatches": args.microbatches, "seed": args.seed,
        "train_shared": args.train_shared, "shared_warmup": args.shared_warmup,
        "offload": args.offload,
        "eval_subnets": args.eval_subnets, "out_dir": args.out_dir,
        "checkpoint_every": args.checkpoint_every,
    }
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    config = dataclasses.replace(config, checkpoint_dir=checkpoint_dir(args))
    if args.microbatches is not None and config.schedule != "gpipe":
        p.error(f"--microbatches {args.microbatches} applies to --schedule gpipe only (--schedule "
                f"{config.schedule} trains each subnet's whole batch at once); leave it out, or "
                "pass --schedule gpipe")
    check_outputs(config, args)
    if args.mpi:
        return _main_mpi(config, args, p)
    from scamp_jax.distributed.mpi import launcher_ranks

    ranks = launcher_ranks()
    if ranks is not None and ranks > 1:  # each rank would train it all, in one folder
        p.error(f"launched by MPI as {ranks} ranks without --mpi: every rank would train the "
                "whole supernet into the same --out-dir; pass --mpi to run one pipeline stage "
                f"per rank (mpirun -n {config.stages} ...), or run it without mpirun")
    check_config(config, p, get_config(args.preset))
    _same_bits_everywhere(config.stages)
    check_devices(config.stages, p)
    check_checkpoint(config, args)
    from search_spaces.supernet_nas import run_nas

    return run_nas(config, json_path=args.json, show=not args.quiet, fresh=args.fresh)


def _main_mpi(config, args: argparse.Namespace, p: argparse.ArgumentParser) -> dict | None:
    """``--mpi``: one stage per rank (on its first device); rank 0 writes the results."""
    from scamp_jax.distributed.mpi import launched_under_mpi, launcher_ranks, world

    if launcher_ranks() == 1:  # a usage error: argparse's exit status 2 and format
        p.error("--mpi under an MPI launcher of one rank: the pipeline runs one stage per rank; "
                f"launch one per stage (mpirun -n {config.stages} ...) or drop --mpi to run "
                "every stage in this process")
    if not launched_under_mpi():
        p.error("--mpi needs an MPI launcher with one rank per pipeline stage, e.g. "
                f"mpirun -n {config.stages} python -m experiments.supernet_nas --mpi "
                "(install the extra first: pip install 'scamp-jax[mpi]')")

    w = world()  # MPI only: JAX has not started
    if not w.is_root:
        # the parser's errors below (``p.error``) follow from the flags and the rank count
        # alone, so they come out alike on every rank: rank 0 says why, the others exit with
        # the same status (`check_checkpoint`'s reads of the disk still speak on every rank)
        p.print_usage = lambda file=None: None  # type: ignore[method-assign]
        p.exit = lambda status=0, message=None: sys.exit(status)  # type: ignore[method-assign]
    if args.stages is None:
        config = dataclasses.replace(config, stages=w.size)
    elif args.stages != w.size:
        p.error(f"--stages {args.stages} but {w.size} MPI ranks: the pipeline runs one stage "
                f"per rank; launch with mpirun -n {args.stages} or pass --stages {w.size}")
    # the single process's CPU devices and pool, though a rank runs its stage on the first
    _same_bits_everywhere(config.stages)
    check_config(config, p, get_config(args.preset),
                 ranks=w.size if args.stages is None else None)
    check_checkpoint(config, args)
    from search_spaces.supernet_nas import run_nas_mpi

    return run_nas_mpi(config, json_path=args.json, show=not args.quiet, mpi_world=w,
                       fresh=args.fresh)


if __name__ == "__main__":
    main()
