"""The gRPC arm of ``--compare``: the same load on grpc.aio, by the project's own benchmark.

``perf/tokens.py --impl grpc`` already runs this workload the way a Python user would
wire it on grpc.aio (an engine process serving one server-streaming RPC per request,
frontend processes reading them, mutual TLS with the same certificates, paced passes,
every token checked in order, CPU from ``getrusage``, latency from an emit stamp). The
package does not depend on ``perf/``, so the demo runs that script as a process from
the checkout ``make demo`` runs in, and skips the arm, saying why, when the script or
``grpc`` is missing. Its tokens are 48 bytes of MessagePack (the benchmark's), the
QUIC arms' about 15: the gRPC row is the same shape of load, not byte for byte.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from .engine import ArmResult, DemoFailure
from .impair import source_root
from .progress import Display
from .protocol import ArmPlan

__all__ = ["grpc_unavailable", "run_grpc_arm"]

SCRIPT = Path("perf") / "tokens.py"


def grpc_unavailable() -> str | None:
    """Why the gRPC arm cannot run here, or None when it can."""
    if importlib.util.find_spec("grpc") is None:
        return "grpc is not installed (pip install grpcio, or the perf extra)"
    if not (source_root() / SCRIPT).is_file():
        return f"{SCRIPT} is not in this checkout (the gRPC arm runs the project's benchmark)"
    return None


async def run_grpc_arm(plan: ArmPlan, display: Display, timeout: float) -> ArmResult:
    """One run of ``perf/tokens.py --impl grpc`` with the plan's load; its row."""
    root = source_root()
    display.note(f"grpc: running {SCRIPT} --impl grpc (its own processes)")
    with tempfile.TemporaryDirectory(prefix="velomux-demo-grpc-") as tmp:
        out = Path(tmp) / "grpc.json"
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(root / SCRIPT), "--impl", "grpc",
            "--streams", str(plan.requests), "--frontends", str(plan.frontends),
            "--mode", "paced", "--passes", str(plan.tokens), "--pace-ms", str(plan.pace_ms),
            "--runs", "1", "--skip-single-stream", "--timeout", str(timeout),
            "--json", str(out),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, cwd=root,
        )  # fmt: skip
        try:
            _, err = await asyncio.wait_for(
                process.communicate(), 3 * timeout + 4 * plan.tokens * plan.pace_ms / 1e3
            )
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        if process.returncode != 0 or not out.exists():
            tail = err.decode(errors="replace")[-1500:]
            raise DemoFailure(f"{SCRIPT} --impl grpc exited with {process.returncode}:\n{tail}")
        document = json.loads(out.read_text())
    run = document["scenarios"][0]["runs"]["grpc"][0]
    if "failed" in run:
        raise DemoFailure(f"the gRPC arm failed: {run['failed']}")
    return ArmResult(_row(plan, run), None)


def _row(plan: ArmPlan, run: dict[str, Any]) -> dict[str, Any]:
    expected = plan.requests * plan.tokens
    delivered = int(run["tokens"])
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
        # The benchmark fails the run unless every stream got its own tokens, in order.
        "streams_complete_in_order": plan.requests if delivered == expected else 0,
        "all_complete_in_order": delivered == expected,
        "retired": ["ok"],
        "open_s": run["attach_s"],
        "elapsed_s": run["e2e_s"],
        "tokens_per_s": run["tokens_per_s"],
        "late_passes": run["late_passes"],
        "records_per_write": None,
        "mux_batches_sent": None,
        "engine_datagrams_out_per_token": None,
        "datagrams_per_token": None,
        "engine_cpu_us_per_token": run["engine_cpu_us_per_token"],
        "frontends_cpu_us_per_token": run["frontends_cpu_us_per_token"],
        "first_token_p50_ms": run.get("first_token_p50_ms"),
        "first_token_p99_ms": run.get("first_token_p99_ms"),
        "inter_token_p50_ms": run.get("receive_gap_p50_ms"),
        "inter_token_p99_ms": run.get("receive_gap_p99_ms"),
        "token_latency_p50_ms": run.get("later_tokens_p50_ms"),
        "token_latency_p99_ms": run.get("later_tokens_p99_ms"),
        "live_slots_end": None,
        "live_senders_end": None,
        "note": "perf/tokens.py --impl grpc; 48-byte tokens",
    }
