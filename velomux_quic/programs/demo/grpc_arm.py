"""The gRPC arm of ``--compare``: the same load on grpc.aio, from the package itself.

This process is the engine, a grpc.aio server (:class:`~.grpc_tokens.TokenServer`, the
same code ``perf/tokens.py --impl grpc`` runs) with TLS from the engine's certificates
and client certificates required; the two frontends (``python -m
velomux_quic.programs.demo.frontend --arm grpc``) open one server-streaming RPC per request on
one channel each. The passes, the token (the same MessagePack ``[stream, step, stamp]``
the QUIC arms send), the checks and the latency samples are the QUIC arms'. What it
cannot report is marked n/a: datagrams and records per write (gRPC runs over TCP and
says nothing of its writes), live mux slots. grpcio comes with the ``demo`` extra; the
arm is skipped, saying so, without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

from .engine import ArmResult, DemoFailure, Frontends, paced_passes
from .measure import CpuWindow, percentile_ms
from .progress import Display
from .protocol import ArmPlan, Latencies, read_latencies

__all__ = ["GRPC_MISSING", "grpc_unavailable", "run_grpc_arm"]

GRPC_MISSING = "grpc is not installed: pip install 'velomux_quic[demo]'"


def grpc_unavailable() -> str | None:
    """Why the gRPC arm cannot run here, or None when it can."""
    if importlib.util.find_spec("grpc") is None:
        return GRPC_MISSING
    return None


async def run_grpc_arm(
    plan: ArmPlan, nodes: dict[str, Path], workdir: Path, display: Display, timeout: float
) -> ArmResult:
    """One run of the gRPC arm, the frontends in fresh processes."""
    # gRPC's fork handlers (on by default) print a line at every process this one starts
    # while gRPC runs; nothing here forks into gRPC, so they are off unless asked for.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from .grpc_tokens import TokenServer

    server = TokenServer(plan.requests)
    port = await server.start(nodes["engine"])
    frontends = Frontends(workdir)
    delivered = [0] * plan.frontends
    outs = [workdir / f"grpc-latency-{f}.bin" for f in range(plan.frontends)]
    reports = [workdir / f"grpc-report-{f}.json" for f in range(plan.frontends)]
    streaming = timeout + 4 * plan.tokens * plan.pace_ms / 1e3
    try:
        for number in range(plan.frontends):

            def progress(tokens: int, number: int = number) -> None:
                delivered[number] = tokens

            arguments = [
                "--credentials", str(nodes[f"frontend-{number}"]),
                "--engine-host", "127.0.0.1", "--engine-port", str(port),
                "--index", str(number), "--arm", "grpc",
                "--requests", str(plan.requests), "--tokens", str(plan.tokens),
                "--pace-ms", str(plan.pace_ms), "--lanes", str(plan.lanes),
                "--flush", plan.flush, "--latency-out", str(outs[number]),
                "--report-out", str(reports[number]), "--timeout", str(timeout),
            ]  # fmt: skip
            await frontends.spawn(arguments, progress)
        open_s = await frontends.watch(server.wait_attached(timeout), "opening the RPCs", timeout)
        cpu = CpuWindow.open()
        emit = server.emitters()
        clock = time.perf_counter_ns

        async def one_pass(step: int) -> None:
            for index, put in enumerate(emit):
                await put([index, step, clock()])

        display.arm(plan.arm, plan.tokens, plan.requests * plan.tokens)
        first_send = time.perf_counter()
        late = await frontends.watch(
            paced_passes(plan, one_pass, lambda passes: display.update(passes, sum(delivered))),
            "the forward passes",
            streaming,
        )
        await frontends.watch(server.finish(timeout), "ending the RPCs", timeout)
        await frontends.finish(timeout)
        engine_cpu = cpu.seconds()
    finally:
        await frontends.reap()
        await server.stop()
    found = [json.loads(path.read_text()) for path in reports]
    latencies = Latencies.empty()
    for path in outs:
        latencies.extend(read_latencies(path))
    display.update(plan.tokens, sum(int(report["tokens"]) for report in found))
    return ArmResult(_row(plan, found, engine_cpu, first_send, late, open_s, latencies), latencies)


def _row(
    plan: ArmPlan, reports: list[dict[str, Any]], engine_cpu: float, first_send: float,
    late: int, open_s: float, latencies: Latencies,
) -> dict[str, Any]:  # fmt: skip
    """The arm's row, with the QUIC arms' keys (n/a where gRPC has no such figure)."""
    expected = plan.requests * plan.tokens
    delivered = sum(int(report["tokens"]) for report in reports)
    complete = sum(int(report["complete"]) for report in reports)
    if not reports or any(report.get("out_of_order") for report in reports):
        raise DemoFailure(f"the gRPC arm delivered tokens out of order: {reports}")
    elapsed = max(float(report["last_token_at"]) for report in reports) - first_send
    tokens = max(delivered, 1)
    first, later, gaps = (
        sorted(part) for part in (latencies.first, latencies.later, latencies.gaps)
    )
    return {
        "arm": "grpc",
        "transport": "grpc.aio (HTTP/2, TLS)",
        "requests": plan.requests,
        "tokens_per_request": plan.tokens,
        "pace_ms": plan.pace_ms,
        "lanes": None,
        "flush": None,
        "tokens_expected": expected,
        "tokens_delivered": delivered,
        "streams_complete_in_order": complete,
        "all_complete_in_order": complete == plan.requests and delivered == expected,
        "retired": ["ok"],
        "open_s": open_s,
        "elapsed_s": elapsed,
        "tokens_per_s": delivered / elapsed if elapsed > 0 else 0.0,
        "late_passes": late,
        "records_per_write": None,
        "mux_batches_sent": None,
        "engine_datagrams_out_per_token": None,
        "datagrams_per_token": None,
        "engine_cpu_us_per_token": 1e6 * engine_cpu / tokens,
        "frontends_cpu_us_per_token": 1e6 * sum(float(r["cpu_s"]) for r in reports) / tokens,
        "first_token_p50_ms": percentile_ms(first, 0.50),
        "first_token_p99_ms": percentile_ms(first, 0.99),
        "inter_token_p50_ms": percentile_ms(gaps, 0.50),
        "inter_token_p99_ms": percentile_ms(gaps, 0.99),
        "token_latency_p50_ms": percentile_ms(later, 0.50),
        "token_latency_p99_ms": percentile_ms(later, 0.99),
        "live_slots_end": None,
        "live_senders_end": None,
    }
