"""Every ``python -m MODULE ARGS`` command the documents show gets past its flag checks.

The documents are the Markdown pages (README, BUILD, BENCHMARKS, benchmarks/notes/, docs/) and
the module docstrings of ``experiments`` and ``benchmarks``. A command is found in a code block
(one line, or lines joined by a trailing backslash) or in an inline code span, which may break
across lines. Placeholders (``F``, ``C``, ``DIR``, ``[--flag]``) are given the values the text
says they stand for (`PLACEHOLDERS`, `CONTEXT_VALUES`); a command cut short by ``...`` is
checked up to there.

Each command runs its module's own ``main(argv)`` up to the first thing that would start the
job: the functions in `TRIPWIRES` (setting up CPU devices, the device memory, the measurement
itself) raise `Reached` instead, so the parser and the checks that ``main`` makes of the flags
before it (``p.error``, ``experiments._cli.fail``) run as written and nothing is compiled or
trained. Checks a ``main`` makes only after its costly part (an unknown ``--case``) are not
run. The whole check takes seconds.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import os
import re
import shlex
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Markdown pages whose commands are checked.
DOC_GLOBS = ("README.md", "BUILD.md", "BENCHMARKS.md", "benchmarks/notes/*.md", "docs/**/*.md")
#: Packages whose modules' docstrings are checked.
DOCSTRING_PACKAGES = ("experiments", "benchmarks")

#: Modules a ``python -m`` names that are not this project's command lines.
FOREIGN = {"pytest", "pip", "pdoc", "venv", "ensurepip", "http.server", "cProfile", "timeit"}

#: Where placeholder paths (``DIR``, ``OUT/...``, ``$SCRATCH``) point; created for the check,
#: as a user's own folder would exist.
PLACEHOLDER_DIR = str(Path(tempfile.gettempdir()) / "scamp_doc_check")

#: Placeholder tokens and the values they stand for (each value gives one command).
PLACEHOLDERS: dict[str, list[str]] = {
    "F": ["swinir", "vit"],           # "--family F ... for F = swinir and vit"
    "C": ["swinir_small", "vit"],      # a case of benchmarks.memory_accuracy
    "CASE": ["swinir"],
    "BUDGET": ["1GiB"],
    "P": ["scamp", "fixed"],
    "WAY": ["scamp", "plain"],
    "K": ["4"],
    "N": ["2"],
    "T": ["h100"],
    "LO,HI": ["32,64"],
    "FILE": [PLACEHOLDER_DIR + "/file.json"],
}
#: "for F = swinir and vit", "(... C for swinir, vit, transformer ...)": a placeholder's values
#: said in the text near the command override `PLACEHOLDERS`.
CONTEXT_VALUES = re.compile(r"(?:\bfor |# )(?P<name>[A-Z]) (?:=|in) "
                            r"(?P<values>[\w]+(?:(?:, | and | or |,)[\w]+)*)")

#: Functions that start the job, per module (``module:attribute``): `Reached` replaces them.
#: ``*`` applies to every module; a name here that the module imported at its top is replaced
#: in the module too.
TRIPWIRES: dict[str, tuple[str, ...]] = {
    "*": ("scamp_jax.devices:configure_cpu_devices", "scamp_jax.devices:configure_device_memory"),
    "benchmarks.gpu_markdown": ("benchmarks.gpu_markdown:read_report",),
    "benchmarks.gpu_suite": ("benchmarks.gpu_suite:run_suite", "benchmarks.gpu_suite:run_section"),
    "benchmarks.member_data": ("benchmarks.member_data:measure",),
    "benchmarks.mpi_comm": ("scamp_jax.distributed.mpi:launched_under_mpi",),
    "benchmarks.scheduler_overhead": ("benchmarks.scheduler_overhead:measure",),
    "benchmarks.simulate_cluster": ("scamp_jax.sim.measured:replay_study",),
    "benchmarks.simulate_scale": ("benchmarks.simulate_scale:cluster_preset",),
    "benchmarks.softmax_derivative": ("benchmarks.softmax_derivative:memory",),
    "benchmarks.supernet_pipeline": ("benchmarks.supernet_pipeline:raise_cpu_collective_timeout",),
    "benchmarks.target_accuracy": ("benchmarks.target_accuracy:reference_point",),
    "experiments.supernet_nas": ("experiments.supernet_nas:_same_bits_everywhere",
                                 "experiments.supernet_nas:check_checkpoint"),
}


class Reached(BaseException):
    """The command got past its flag checks to the job itself (a BaseException, so that no
    ``except Exception`` of an entry point turns it into an error)."""


@dataclass
class Command:
    """One documented ``python -m`` command."""

    where: str            # "README.md:116"
    module: str
    argv: list[str]
    text: str             # as the document shows it
    mpi_ranks: int | None = None   # "mpirun -n 4 python -m ..."
    partial: bool = False          # cut short by "..." in the text
    notes: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.where} {self.module} {' '.join(self.argv)}"[:150]


# --------------------------------------------------------------------------- extraction

def doc_pages() -> list[Path]:
    pages: list[Path] = []
    for pattern in DOC_GLOBS:
        pages += sorted(p for p in ROOT.glob(pattern) if p.is_file())
    return pages


def _code_and_spans(text: str, first_line: int = 1, markdown: bool = True
                    ) -> Iterator[tuple[int, str, bool]]:
    """(line, fragment, is_code) of ``text``: code lines (backslash continuations joined) and
    inline code spans (``...`` or `...`, which may break across lines within a paragraph)."""
    lines = text.split("\n")
    fenced = in_code = False
    para: list[tuple[int, str]] = []

    def flush() -> Iterator[tuple[int, str, bool]]:
        if not para:
            return
        joined = "\n".join(t for _, t in para)
        starts = []
        pos = 0
        for n, t in para:
            starts.append((pos, n))
            pos += len(t) + 1
        for m in re.finditer(r"(`+)(.+?)\1", joined, re.S):
            line = max(n for p, n in starts if p <= m.start())
            yield line, m.group(2).replace("\n", " "), False
        para.clear()

    i = 0
    while i < len(lines):
        raw = lines[i]
        n = first_line + i
        if markdown and raw.lstrip().startswith("```"):
            yield from flush()
            fenced = not fenced
            i += 1
            continue
        prev_blank_or_code = i == 0 or not lines[i - 1].strip() or in_code
        is_code = fenced or (raw.startswith("    ") and (not markdown or prev_blank_or_code))
        in_code = is_code and not fenced
        if is_code:
            yield from flush()
            joined, start = raw.strip(), n
            while joined.endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined[:-1].rstrip() + " " + lines[i].strip()
            yield start, joined, True
            i += 1
            continue
        if not raw.strip():
            yield from flush()
        else:
            para.append((n, raw))
        i += 1
    yield from flush()


_COMMAND = re.compile(r"(?:^|[\s`(;&|])(?:mpirun[^`]*?\s|srun[^`]*?\s)?"
                      r"(?:\S*/)?python3?\s+-m\s+([A-Za-z_][\w.]*)")
_STOP_TOKENS = {";", "&&", "||", "|", ">", ">>", "<", "(", ")", "&", "2>", "done", "then"}


def _split(rest: str) -> tuple[list[str], bool]:
    """The arguments of a command's text after its module: up to a shell separator, a comment
    or the end; (tokens, cut short by "...")."""
    rest = rest.replace("\u2026", "...")
    try:
        lex = shlex.shlex(rest, posix=True, punctuation_chars=";&|<>()")
        lex.whitespace_split = True
        lex.commenters = "#"
        tokens = list(lex)
    except ValueError:
        tokens = rest.split()
    out: list[str] = []
    for tok in tokens:
        if tok in _STOP_TOKENS or tok.startswith("#") or set(tok) <= set(";&|<>()"):
            if tok == ">" and out and out[-1] == "2":
                out.pop()
            break
        if tok in ("...", "[...]") or tok.endswith("..."):
            return out, True
        out.append(tok)
    return out, False


def _mpi_ranks(prefix: str) -> int | None:
    m = re.search(r"\bmpirun\b.*?\s-(?:n|np)\s+(\d+)", prefix)
    return int(m.group(1)) if m else None


def commands_in(text: str, where_file: str, first_line: int = 1, markdown: bool = True
                ) -> list[Command]:
    """Every ``python -m`` command of ``text``, placeholders expanded."""
    found: list[Command] = []
    all_lines = text.split("\n")
    for line, frag, _ in _code_and_spans(text, first_line, markdown):
        for m in _COMMAND.finditer(frag):
            module = m.group(1).rstrip(".")
            if frag[m.end():m.end() + 1] == "<":  # "python -m benchmarks.<name>": any module
                continue
            if module in FOREIGN or module.split(".")[0] in FOREIGN:
                continue
            argv, partial = _split(frag[m.end():])
            near = " ".join(all_lines[max(0, line - first_line - 3): line - first_line + 4])
            for variant in _expand(argv, near):
                found.append(Command(f"{where_file}:{line}", module, variant, frag.strip(),
                                     _mpi_ranks(frag[:m.start(1)]), partial))
    return found


#: Placeholder paths that stand for a user's existing folder or file (``OUT/autotune``).
_EXISTING: set[str] = set()


def _expand(argv: list[str], near: str) -> list[list[str]]:
    """``argv`` with its optional ``[--flag value]`` parts left out and put in, and each
    placeholder replaced by each of its values."""
    variants = [[]]
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("["):
            group = [tok]
            while not group[-1].endswith("]") and i + 1 < len(argv):
                i += 1
                group.append(argv[i])
            inner = " ".join(group)[1:-1].split()
            i += 1
            if inner in (["flags"], ["options"], ["..."]):
                continue
            variants = [v + extra for v in variants for extra in ([], inner)]
            continue
        variants = [v + [tok] for v in variants]
        i += 1
    said = {m["name"]: re.split(r", | and | or |,", m["values"])
            for m in CONTEXT_VALUES.finditer(near)}
    out: list[list[str]] = []
    for v in variants:
        expanded = [[]]
        for tok in v:
            values = said.get(tok) or PLACEHOLDERS.get(tok)
            if values is None and re.fullmatch(r"<[^>]+>", tok):
                values = ["2"] if "stage" in tok or "n" == tok[1:-1] else ["x"]
            if values is None and re.fullmatch(r"[A-Z][A-Z_]*(/[\w./]+)?", tok) and len(tok) > 1:
                # DIR, STUDY_DIR, OUT/environment/target_config.txtpb: a path
                values = [PLACEHOLDER_DIR + (tok[tok.find("/"):] if "/" in tok else "")]
                _EXISTING.add(values[0])
            if values is None and "$" in tok:  # $SCRATCH/x, ${HOME}: the user's folder
                values = [re.sub(r"\$\{?(?!PWD\b)[A-Z_]+\}?", PLACEHOLDER_DIR, tok)
                          .replace("$PWD", str(ROOT))]
            if values is None and tok.startswith("{"):  # a placeholder inside JSON
                names = [n for n in re.findall(r"\b[A-Z]\b", tok) if n in said or n in PLACEHOLDERS]
                if names:
                    values = [re.sub(rf"\b{names[0]}\b", val, tok)
                              for val in said.get(names[0]) or PLACEHOLDERS[names[0]]]
            expanded = [e + [val] for e in expanded for val in (values or [tok])]
        out += expanded
    unique: list[list[str]] = []
    for v in out:
        if v not in unique:
            unique.append(v)
    return unique


def documented_commands() -> list[Command]:
    """The commands of every document and module docstring."""
    found: list[Command] = []
    for page in doc_pages():
        found += commands_in(page.read_text(), str(page.relative_to(ROOT)))
    for package in DOCSTRING_PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            tree = ast.parse(path.read_text())
            if not (tree.body and isinstance(tree.body[0], ast.Expr)
                    and isinstance(tree.body[0].value, ast.Constant)
                    and isinstance(tree.body[0].value.value, str)):
                continue
            doc = tree.body[0].value.value
            found += commands_in(doc, str(path.relative_to(ROOT)), tree.body[0].lineno,
                                 markdown=False)
    return found


# --------------------------------------------------------------------------- checking

@contextlib.contextmanager
def _patched(pairs: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in pairs]
    try:
        for obj, name, value in pairs:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def _trip(what: str) -> Callable[..., Any]:
    def raiser(*args: Any, **kwargs: Any) -> Any:
        raise Reached(what)
    return raiser


class _World:
    def __init__(self, size: int) -> None:
        self.size, self.rank, self.is_root = size, 0, True


@contextlib.contextmanager
def _isolated() -> Iterator[None]:
    """Environment, signal handlers, logging handlers and working directory as they were."""
    import logging

    env = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    root_handlers = list(logging.getLogger().handlers)
    cwd = os.getcwd()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        for s, h in handlers.items():
            signal.signal(s, h)
        logging.getLogger().handlers[:] = root_handlers
        os.chdir(cwd)


@dataclass
class Outcome:
    ok: bool
    stage: str  # "import", "no main", "help", "parser" (argparse or p.error), "checks" (other
                # checks before the job), "reached" (the job's start)
    message: str = ""


def check(command: Command) -> Outcome:
    """Run ``command``'s ``main`` up to its job (`TRIPWIRES`); its verdict."""
    try:
        module = importlib.import_module(command.module)
    except Exception as err:  # noqa: BLE001 - the verdict names it
        return Outcome(False, "import", f"{type(err).__name__}: {err}")
    main = getattr(module, "main", None)
    if main is None:
        return Outcome(False, "no main", f"{command.module} has no main(argv)")
    pairs: list[tuple[Any, str, Any]] = []
    for spec in TRIPWIRES["*"] + TRIPWIRES.get(command.module, ()):
        mod_name, attr = spec.split(":")
        target = importlib.import_module(mod_name)
        pairs.append((target, attr, _trip(spec)))
        if hasattr(module, attr) and module is not target:
            pairs.append((module, attr, _trip(spec)))
    if command.mpi_ranks is not None:
        from scamp_jax.distributed import mpi
        ranks = command.mpi_ranks
        pairs += [(mpi, "launcher_ranks", lambda: ranks), (mpi, "world", lambda: _World(ranks))]
        if command.module != "benchmarks.mpi_comm":
            pairs.append((mpi, "launched_under_mpi", lambda: True))
    Path(PLACEHOLDER_DIR).mkdir(exist_ok=True)  # $SCRATCH, a user's folder: it exists
    for tok in command.argv:  # so do the folders that DIR, OUT/autotune stand for
        if tok in _EXISTING:
            folder = Path(tok)
            (folder.parent if folder.suffix else folder).mkdir(parents=True, exist_ok=True)
    out, err = io.StringIO(), io.StringIO()
    with _isolated(), _patched(pairs), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            main(list(command.argv))
        except Reached:
            pass
        except SystemExit as stop:
            if stop.code in (0, None) and ("--help" in command.argv or "-h" in command.argv):
                return Outcome(True, "help")
            text = (err.getvalue().strip().splitlines() or [str(stop.code)])[-1]
            return Outcome(False, "parser" if "usage:" in err.getvalue() else "checks",
                           f"exit {stop.code}: {text}")
        except Exception as exc:  # noqa: BLE001
            return Outcome(False, "checks", f"{type(exc).__name__}: {exc}")
        else:
            return Outcome(False, "reached", "main returned without reaching a tripwire "
                           "(it ran the job; add its first costly call to TRIPWIRES)")
    return Outcome(True, "reached")


def failures() -> list[str]:
    """What fails: each documented command that does not reach its job, and each module the
    documents run whose ``--help`` does not exit 0."""
    commands = documented_commands()
    found = []
    for command in commands:
        outcome = check(command)
        if not outcome.ok:
            found.append(f"{command.where}: `python -m {command.module} "
                         f"{' '.join(command.argv)}`: {outcome.stage}: {outcome.message}")
    for module in sorted({c.module for c in commands}):
        outcome = check(Command("help", module, ["--help"], "--help"))
        if not outcome.ok:
            found.append(f"`python -m {module} --help`: {outcome.stage}: {outcome.message}")
    return found


if __name__ == "__main__":  # one process, so that no command's imports or settings stay behind
    import json
    import sys

    problems = failures()
    print(json.dumps({"commands": len(documented_commands()), "failures": problems}))
    sys.exit(1 if problems else 0)
