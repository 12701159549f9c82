"""``velomux demo``: a decode engine streaming tokens to two frontend processes, measured.

This process is the engine; two child processes are frontends
that register 1,024 requests between them (each request's anchor handle and zero-RTT
ticket inside the request, through the node's request path). The engine streams 256
tokens to each in paced forward passes (one token per live request every 10 ms, the
shape of LLM decoding) over one mutually authenticated QUIC connection per frontend,
batched by the messenger mux. Certificates are made on demand. A live progress display
runs on a terminal; then a summary: tokens/s, records per wire write, datagrams per
token, first-token and inter-token latency p50/p99, CPU per token on each side, every
stream complete and in order, live slots back to 0.

``--compare`` runs the same load over one QUIC stream per request and over grpc.aio and
prints the arms side by side with ratios; ``--impair loss=1%,delay=5ms`` puts the
project's UDP impairment proxy in front of the engine; ``--plot out.png`` draws each
arm's latency CDF; ``--json`` prints one JSON object and nothing else.

The modules: ``engine`` (this process's side and one QUIC arm's run), ``frontend`` (the
children), ``protocol`` (what they say to each other), ``measure`` (CPU, counters,
percentiles), ``report`` (text, table, plot), ``progress`` (the live display),
``impair`` (the ``--impair`` option), ``proxy`` (the impairment proxy itself, which the
tests and benchmarks use too), ``grpc_arm`` (the gRPC arm) and ``grpc_tokens`` (its server
and client, shared with ``perf/tokens.py``). Nothing here needs a checkout: ``pip install
'velomux_quic[demo]'`` brings grpcio, matplotlib and rich for ``--compare``, ``--plot`` and
the live display.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ... import ConfigurationError, ensure_dev_cluster, runtime_info
from ..runtime import run
from .engine import ArmResult, DemoFailure, run_quic_arm
from .grpc_arm import grpc_unavailable, run_grpc_arm
from .impair import Impairment, parse_impairment
from .progress import display_for
from .protocol import ArmPlan
from .report import arm_ok, arm_summary, compare_table, plot_cdf, ratios, require_matplotlib

__all__ = ["add_demo_commands"]

NODES = ("engine", "frontend-0", "frontend-1")

MAX_TOKENS = 1 << 22
"""Tokens per arm at most (16 times the default load): the frontends keep three 8-byte
latency samples per token, so this bounds the demo's memory to about 100 MB."""


def _plans(args: argparse.Namespace) -> list[ArmPlan]:
    arms = ["mux", "per-stream", "grpc"] if args.compare else ["mux"]
    return [
        ArmPlan(arm, args.requests, args.tokens, args.pace_ms, args.lanes, args.flush)
        for arm in arms
    ]


def _runtime() -> dict[str, str]:
    """The QUIC engine and record path every process of the demo runs (its children
    inherit the environment that chooses them), for its text and its JSON."""
    info = runtime_info()
    if info.quic_engine is None:
        raise ConfigurationError(info.quic_engine_problem or "no usable QUIC engine")
    return {
        "version": info.version,
        "engine": f"{info.quic_engine} {info.quic_engine_version}",
        "record_path": info.record_path,
    }


def _headline(
    args: argparse.Namespace, impairment: Impairment | None, runtime: dict[str, str]
) -> str:
    text = (
        f"velomux demo: {args.requests:,} requests x {args.tokens} tokens, one forward pass "
        f"every {args.pace_ms:g} ms, 2 frontend processes, {args.lanes} lane"
        f"{'s' if args.lanes > 1 else ''}, flush {args.flush}; mutual-TLS QUIC on loopback "
        f"(engine {runtime['engine']}, {runtime['record_path']} record path), "
        f"certificates in {args.certs}"
    )
    if impairment is not None:
        text += f"\n  through the impairment proxy: {impairment.describe()}"
    return text


async def _demo(args: argparse.Namespace, impairment: Impairment | None) -> dict[str, Any]:
    """Every arm in turn, in fresh processes; the document ``--json`` prints."""
    started = time.perf_counter()
    runtime = _runtime()
    nodes = ensure_dev_cluster(args.certs, NODES)
    results: list[ArmResult] = []
    skipped: dict[str, str] = {}
    if not args.json:
        print(_headline(args, impairment, runtime), flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="velomux-demo-") as tmp,
        display_for(not args.json) as display,
    ):
        for plan in _plans(args):
            if plan.arm == "grpc":
                reason = grpc_unavailable()
                if reason is None and impairment is not None:
                    reason = "the impairment proxy is in front of the QUIC arms only"
                if reason is not None:
                    skipped["grpc"] = reason
                    display.note(f"grpc: skipped, {reason}")
                    continue
                result = await run_grpc_arm(plan, nodes, Path(tmp), display, args.timeout)
            else:
                result = await run_quic_arm(
                    plan, nodes, Path(tmp), impairment, display, args.timeout
                )
            results.append(result)
            display.note("\n" + arm_summary(result.row))
    rows = [result.row for result in results]
    ok = all(arm_ok(row) for row in rows)
    if args.plot is not None:
        title = (
            f"{args.requests:,} requests x {args.tokens} tokens, a pass every {args.pace_ms:g} ms"
        )
        plot_cdf(results, args.plot, title + (f", {impairment.describe()}" if impairment else ""))
    document: dict[str, Any] = {
        "ok": ok,
        "runtime": runtime,
        "config": {
            "requests": args.requests,
            "tokens": args.tokens,
            "pace_ms": args.pace_ms,
            "lanes": args.lanes,
            "flush": args.flush,
            "frontends": 2,
            "impair": None
            if impairment is None
            else {
                "loss": impairment.loss,
                "delay_ms": impairment.delay_ms,
                "jitter_ms": impairment.jitter_ms,
            },
        },
        "arms": rows,
        "ratios": ratios(rows),
        "skipped": skipped,
        "plot": str(args.plot) if args.plot is not None else None,
        "duration_s": time.perf_counter() - started,
    }
    if not args.json:
        if len(rows) > 1:
            print()
            print(compare_table(rows))
        for arm, reason in skipped.items():
            print(f"\n  {arm}: skipped, {reason}")
        if args.plot is not None:
            print(f"\n  latency CDF drawn in {args.plot}")
        print(f"\ndemo {'OK' if ok else 'FAILED'} in {document['duration_s']:.1f} s")
    return document


def _checked(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Impairment | None:
    if args.requests < 2:
        parser.error("--requests must be at least 2 (one per frontend)")
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    if args.requests * args.tokens > MAX_TOKENS:
        parser.error(
            f"at most {MAX_TOKENS:,} tokens per arm (--requests x --tokens): every token's "
            "latency is kept for the percentiles; lower --requests or --tokens"
        )
    if args.pace_ms <= 0 or args.timeout <= 0:
        parser.error("--pace-ms and --timeout must be positive")
    if not 1 <= args.lanes <= 16:
        parser.error("--lanes must be 1 to 16")
    try:
        impairment = None if args.impair is None else parse_impairment(args.impair)
        if args.plot is not None:
            require_matplotlib()
    except ConfigurationError as exc:
        parser.error(str(exc))
    return impairment


def _main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Exit 0 when every arm delivered every token in order and left nothing live, 1
    when one did not or a run failed, 2 on a usage or configuration error (an option
    argparse refuses, an engine named but not installed, unusable certificates)."""
    impairment = _checked(args, parser)
    try:
        document = run(_demo(args, impairment))
    except (DemoFailure, ConfigurationError) as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        print(f"velomux demo FAILED: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigurationError) else 1
    if args.json:
        print(json.dumps(document))
    return 0 if document["ok"] else 1


def add_demo_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``velomux demo`` (its frontends run as ``python -m
    velomux_quic.programs.demo.frontend``)."""
    demo = commands.add_parser(
        "demo",
        help="an engine streams tokens to two frontend processes, measured",
        description=(__doc__ or "").split("\n\n")[0].replace("``", ""),
    )
    demo.add_argument("--certs", type=Path, default=Path("certs/dev"),
                      help="where dev certificates live, made on demand")  # fmt: skip
    demo.add_argument("--requests", type=int, default=1024, help="requests in flight")
    demo.add_argument("--tokens", type=int, default=256, help="tokens per request")
    demo.add_argument("--pace-ms", type=float, default=10.0,
                      help="milliseconds between two forward passes")  # fmt: skip
    demo.add_argument("--lanes", type=int, default=1, help="QUIC lanes per peer, 1 to 16")
    demo.add_argument("--flush", choices=("auto", "manual"), default="auto",
                      help="the engine's mux flush policy: AutoFlush, or Manual with one "
                      "flush_batch() per pass")  # fmt: skip
    demo.add_argument("--compare", action="store_true",
                      help="also run one QUIC stream per request, and grpc.aio (the demo "
                      "extra)")  # fmt: skip
    demo.add_argument("--impair", metavar="SPEC",
                      help="through the UDP impairment proxy, e.g. loss=1%%,delay=5ms")  # fmt: skip
    demo.add_argument("--plot", type=Path, metavar="PNG",
                      help="draw each arm's latency CDF here (needs the demo extra: "
                      "pip install 'velomux_quic[demo]')")  # fmt: skip
    demo.add_argument("--json", action="store_true",
                      help="print one JSON object on stdout and nothing else")  # fmt: skip
    demo.add_argument("--timeout", type=float, default=60.0,
                      help="longest wait for any one step, in seconds")  # fmt: skip
    demo.set_defaults(handler=lambda args: _main(args, demo))
