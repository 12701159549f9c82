"""Run the fuzz targets for a given time each, and print what they did (``make fuzz``).

::

    python -m fuzz.run --seconds 60                 # every target, 60 s each
    python -m fuzz.run --seconds 300 mux_batch      # one target
    python -m fuzz.run --engine python envelope     # without atheris

Each target runs in a child process of its own, so one that blows up (or leaks) cannot
take the others with it. With atheris installed (the ``fuzz`` extra) the child is a
coverage-guided libFuzzer run over the seed corpus ``fuzz/corpus/<target>/`` (read, never
written) and a working corpus ``build/fuzz/<target>/corpus/`` that keeps what it learnt
between runs. Without it the child feeds the seed corpus and then the deterministic
mutations of :mod:`fuzz.mutate` for the same time: no coverage feedback, so it finds
less, but it runs anywhere Python does.

Per target the summary gives the executions, libFuzzer's coverage counters (``cov``: code
edges reached; ``ft``: features, edges with hit counts) and whether something other than
the typed refusal escaped. A finding leaves its input in ``build/fuzz/<target>/`` as
``crash-*``; reproduce it with ``python -m fuzz.run --reproduce <target> <file>``.
The exit status is 1 when any target found something.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import random
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["main"]

ROOT: Final = Path(__file__).resolve().parent.parent
SEED_DIR: Final = ROOT / "fuzz" / "corpus"
DICT_DIR: Final = ROOT / "fuzz" / "dicts"
"""libFuzzer dictionaries (tokens the mutator splices in), for the targets that have one."""
WORK_DIR: Final = ROOT / "build" / "fuzz"

_DONE: Final = re.compile(r"^#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)", re.MULTILINE)
_EXECUTED: Final = re.compile(r"stat::number_of_executed_units:\s*(\d+)")
_PY_EXECUTED: Final = re.compile(r"^python-driver executions: (\d+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one target's run did, parsed from its child's output."""

    target: str
    engine: str
    seconds: float
    executions: int | None
    coverage: int | None
    features: int | None
    corpus: int | None
    finding: bool

    def row(self) -> str:
        def show(value: int | None) -> str:
            return "-" if value is None else f"{value:,}"

        verdict = "FINDING" if self.finding else "clean"
        return (
            f"{self.target:<18} {self.engine:<8} {self.seconds:>6.0f} {show(self.executions):>12}"
            f" {show(self.coverage):>6} {show(self.features):>6} {show(self.corpus):>6}  {verdict}"
        )


def _has_atheris() -> bool:
    return importlib.util.find_spec("atheris") is not None


def _seeds(target: str, extra: Path | None = None) -> list[bytes]:
    inputs = []
    for directory in (SEED_DIR / target, extra):
        if directory is not None and directory.is_dir():
            inputs += [path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()]
    return inputs


# -- the child: one target, one engine --------------------------------------------------------


def _child_atheris(target: str, seconds: int, work: Path) -> None:
    import atheris  # the optional ``fuzz`` extra

    with atheris.instrument_imports(include=["velomux_quic", "fuzz"]):
        from fuzz.targets import TARGETS, check

    chosen = TARGETS[target]
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    args = [
        sys.argv[0],
        f"-max_total_time={seconds}",
        "-print_final_stats=1",
        "-max_len=4096",
        "-timeout=10",
        "-rss_limit_mb=1024",
        f"-artifact_prefix={work}/",
    ]
    dictionary = DICT_DIR / f"{target}.dict"
    if dictionary.is_file():
        args.append(f"-dict={dictionary}")
    args += [str(corpus), str(SEED_DIR / target)]

    def one_input(data: bytes) -> None:
        check(chosen, data)

    atheris.Setup(args, one_input)
    atheris.Fuzz()


def _child_python(target: str, seconds: int, work: Path, seed: int) -> None:
    from fuzz.mutate import mutations
    from fuzz.targets import TARGETS, check

    from .corpus import seeds as corpus_seeds

    chosen = TARGETS[target]
    seeds = _seeds(target) or list(corpus_seeds()[target].values())
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    executions = 0
    inputs = iter(seeds)
    mutants = mutations(seeds, rng)
    while time.monotonic() < deadline:
        data = next(inputs, None)
        if data is None:
            data = next(mutants)
        try:
            check(chosen, data)
        except Exception:
            work.mkdir(parents=True, exist_ok=True)
            artifact = work / f"crash-python-{executions}"
            artifact.write_bytes(data)
            traceback.print_exc()
            print(f"finding: input written to {artifact}", file=sys.stderr)
            print(f"python-driver executions: {executions + 1}", file=sys.stderr)
            sys.exit(1)
        executions += 1
    print(f"python-driver executions: {executions}", file=sys.stderr)


# -- the parent: every target, a summary -----------------------------------------------------------


def _run_target(target: str, seconds: int, engine: str, seed: int) -> Outcome:
    work = WORK_DIR / target
    work.mkdir(parents=True, exist_ok=True)
    log = work / "last-run.log"
    command = [
        sys.executable,
        "-m",
        "fuzz.run",
        "--child",
        target,
        "--seconds",
        str(seconds),
        "--engine",
        engine,
        "--seed",
        str(seed),
    ]
    started = time.monotonic()
    with log.open("w") as out:
        try:
            returncode = subprocess.run(
                command,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=seconds + 120,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            # libFuzzer ends a slow input itself (-timeout); a child that outlives its time
            # by two minutes hangs outside any input, which is a finding too.
            returncode = -1
    elapsed = time.monotonic() - started
    text = log.read_text(errors="replace")
    done = _DONE.findall(text)
    executed = _EXECUTED.search(text) or _PY_EXECUTED.search(text)
    cov = ft = corp = None
    if done:
        _, cov_s, ft_s, corp_s = done[-1]
        cov, ft, corp = int(cov_s), int(ft_s), int(corp_s)
    finding = returncode != 0
    if finding:
        sys.stderr.write(f"--- {target}: exit {returncode}, log {log}\n")
        sys.stderr.write(text[-4000:])
    return Outcome(
        target,
        engine,
        elapsed,
        int(executed.group(1)) if executed else None,
        cov,
        ft,
        corp,
        finding,
    )


def _reproduce(target: str, path: Path) -> int:
    from fuzz.targets import TARGETS, check

    data = path.read_bytes()
    decoded = check(TARGETS[target], data)
    print(f"{target}: {'decoded' if decoded else 'refused with the typed error'}: {data[:64]!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # Nothing of the library is imported before the child's engine starts: atheris
    # instruments only the modules imported after it, inside instrument_imports().
    parser = argparse.ArgumentParser(prog="python -m fuzz.run", description=__doc__)
    parser.add_argument("targets", nargs="*", help="default: every target")
    parser.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    parser.add_argument("--engine", choices=("auto", "atheris", "python"), default="auto")
    parser.add_argument("--seed", type=int, default=1, help="the python engine's seed")
    parser.add_argument("--child", metavar="TARGET", help=argparse.SUPPRESS)
    parser.add_argument("--reproduce", nargs=2, metavar=("TARGET", "FILE"))
    args = parser.parse_args(argv)

    engine = args.engine
    if engine == "auto":
        engine = "atheris" if _has_atheris() else "python"
    if args.child:
        work = WORK_DIR / args.child
        if engine == "atheris":
            _child_atheris(args.child, args.seconds, work)
        else:
            _child_python(args.child, args.seconds, work, args.seed)
        return 0
    if args.reproduce:
        return _reproduce(args.reproduce[0], Path(args.reproduce[1]))
    from fuzz.targets import TARGETS

    unknown = [name for name in args.targets if name not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {', '.join(TARGETS)}")
    if engine == "python" and args.engine == "auto":
        print("atheris is not installed (pip install '.[fuzz]'): using the python driver")
    print(
        f"{'target':<18} {'engine':<8} {'secs':>6} {'executions':>12} {'cov':>6} {'ft':>6}"
        f" {'corp':>6}  result"
    )
    outcomes = []
    for name in args.targets or list(TARGETS):
        outcome = _run_target(name, args.seconds, engine, args.seed)
        outcomes.append(outcome)
        print(outcome.row(), flush=True)
    return 1 if any(outcome.finding for outcome in outcomes) else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
