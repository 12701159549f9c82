"""The rate of new streams: short streams opened at rising rates, until each path fails.

The design chapter's other headline: a frontend opens a stream per request, and at about
2,500 new streams a second the per-stream path failed 80-92% of its requests while the mux
failed none. Here a frontend node opens short streams at each ``--rates`` rate for
``--seconds``: each request creates an anchor, asks the engine node for ``--tokens``
tokens, and reads them to the end. The engine answers every request with a stream:

* ``mux-ticket``: the request carries a zero-RTT ticket (``prebind_anchor``); the engine
  opens the stream with ``open_anchor_stream``, no attach round trip;
* ``mux-attach``: the request carries the anchor's handle; the engine attaches
  (``attach_anchor``), which negotiates the mux;
* ``per-stream``: as ``mux-attach``, offering only ``quic-stream-v1``, so every stream is a
  QUIC stream of its own;
* ``grpc``: grpc.aio, one server-streaming RPC per request (the engine the server), with
  the same certificates, client certificates required.

Per rate and path it reports the sustained open rate (streams opened per second over the
window, the last stream's end included), how many requests failed (an error, or a stream
not ended within ``--timeout``) and the first token's latency (from the request's start to
its first token at the frontend: p50 and p99 of the successful ones). A path whose errors
pass half its requests at a rate is not run at the higher rates ("up to where each fails").

``--tracing`` runs each node path once per tracing mode, in this order: ``no-provider``
(the ``otel`` extra installed and no tracer provider set, what a user gets when any
dependency pulls in opentelemetry-api; ``VELOMUX_TRACING`` unset), ``on`` (the same with
``VELOMUX_TRACING=on``: every open and call through OpenTelemetry's no-op spans, as every
node did before the tracing gate), ``off``
(``VELOMUX_TRACING=off``), ``sdk`` (OpenTelemetry's SDK set as the provider, every span
made and dropped by a processor that exports nothing: what tracing costs when asked for;
always last, as a process sets its provider once). Without it the nodes trace as the
environment says.

``--collector default raised frozen raised-frozen`` runs each path once per setting of the
cyclic collector in one invocation: CPython's thresholds, raised ones, either with what the
process made at start frozen out of every collection (``COLLECTOR``): what a frontend that
opens thousands of streams a second may set (docs/tuning.md).

``--instructions`` runs the script again under valgrind's callgrind (``make valgrind``),
instrumented only while a rate's streams run, and adds the instructions per stream: a
figure the machine's load does not move, to compare modes or paths by. The process runs
tens of times slower there, so no rate is sustained and the latencies mean nothing, and
the count includes what that slowness adds (timers that fire, acknowledgements that come
later): compare counts of one invocation, at one low rate.

By default both nodes (or the gRPC server and client) run in this one process on one event
loop (uvloop where installed), over real QUIC (or TLS over TCP) on loopback, so their CPU
is shared the way a frontend's and an engine's are not: compare the paths with each other
within one invocation, and the rate each sustains, not absolute figures. ``--processes 2``
runs the engine's side (its node and the handler that answers each request, or the gRPC
server) in a child process of its own, as deployed, with the same tracing mode and
collector setting: the frontend and the request driver stay here, and the CPU per stream
is reported per side (the child's read from its process CPU clock). ``--processes 1 2``
runs each path both ways in one invocation.

    python perf/stream_rate.py                                 # 250 .. 5,000 streams/s
    python perf/stream_rate.py --rates 500 2500 --paths mux-ticket per-stream
    python perf/stream_rate.py --rates 6000 --paths mux-ticket --tracing no-provider off
    python perf/stream_rate.py --rates 3000 6000 --paths mux-ticket --collector default raised
    python perf/stream_rate.py --rates 3000 6000 --paths mux-ticket --processes 1 2
    python perf/stream_rate.py --rates 50 --seconds 1 --paths mux-ticket \
        --tracing no-provider on off --instructions
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _callgrind import ENV_DIR as CALLGRIND_DIR
from _callgrind import ClientRequests, read_window
from _callgrind import command as callgrind_command

from velomux_quic import (
    Context,
    InstanceId,
    Node,
    PeerRecord,
    StreamAnchorHandle,
    StreamOpenTicket,
    open_node,
)
from velomux_quic.programs.runtime import run
from velomux_quic.security.certs import NodeCredentials, ensure_dev_cluster
from velomux_quic.streaming.control import PER_STREAM_KEY

PATHS = ("mux-ticket", "mux-attach", "per-stream", "grpc")
TRACING = ("no-provider", "on", "off", "sdk")
COLLECTOR = {
    "default": (gc.get_threshold(), False),
    "raised": ((20_000, 20, 20), False),
    "frozen": (gc.get_threshold(), True),
    "raised-frozen": ((20_000, 20, 20), True),
}
"""``gc.set_threshold`` and whether to ``gc.freeze()`` what the process holds before the
path's nodes start, per ``--collector`` setting. CPython's thresholds, and ones that let
young objects pile up 20,000 allocations before a young collection and make the older ones
rarer (every object of a stream in flight outlives two young collections, and their
promotion is what starts the full ones, which walk every live object). Frozen, the objects
the process made at start (its modules, classes and functions, about 40,000) move to a
generation no collection walks, so a full collection walks what the streams hold."""
TOKEN = {"t": 0, "text": "tok"}

Opener = Callable[[int], Awaitable[float]]
"""Open one stream (request ``n``), read it to its end; the first token's latency (s)."""


_COUNTING: list[ClientRequests] = []


def _counting() -> ClientRequests | None:
    """Callgrind's client requests when ``--instructions`` re-ran this script under it."""
    if CALLGRIND_DIR not in os.environ:
        return None
    if not _COUNTING:
        _COUNTING.append(ClientRequests())
    return _COUNTING[0]


def _under_callgrind(argv: list[str]) -> int:
    """Run this script again under callgrind (``--instructions``), instrumented only while
    a rate's streams run; its exit status."""
    with tempfile.TemporaryDirectory(prefix="stream-rate-callgrind-") as out:
        command = [*callgrind_command(Path(out)), sys.executable, __file__, *argv]
        env = {**os.environ, CALLGRIND_DIR: out}
        return subprocess.run(command, env=env, check=False).returncode


def _cpu_s() -> float:
    """This process's CPU time (user + system, every thread): both nodes' work."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


async def _drive(
    open_one: Opener,
    rate: int,
    seconds: float,
    timeout: float,
    engine_cpu: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Open ``rate`` streams a second for ``seconds`` (in 10 ms ticks, on an anchored
    schedule), each bounded by ``timeout``; the figures of the window. ``engine_cpu``
    reads the engine's process's CPU seconds where it runs in a process of its own."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    total = int(rate * seconds)
    tick = 0.01
    per_tick = rate * tick
    counting = _counting()
    if counting is not None:
        counting.start()
    started = time.perf_counter()
    cpu_started = _cpu_s()
    engine_started = engine_cpu() if engine_cpu is not None else 0.0
    # The requests in flight, each dropped when it ends: holding every finished task (with
    # its coroutine and context) to gather at the end kept tens of thousands of objects
    # alive, which every full collection walked, so the harness slowed what it measures.
    in_flight: set[asyncio.Task[None]] = set()

    async def one(n: int) -> None:
        try:
            async with asyncio.timeout(timeout):
                latencies.append(await open_one(n))
        except Exception as exc:  # every failure counts, by its kind (with its first words)
            kind = f"{type(exc).__name__}: {str(exc)[:80]}"
            errors[kind] = errors.get(kind, 0) + 1

    opened = 0
    step = 0
    while opened < total:
        step += 1
        due = min(total, int(step * per_tick))
        while opened < due:
            task = asyncio.create_task(one(opened))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            opened += 1
        delay = started + step * tick - time.perf_counter()
        await asyncio.sleep(max(0.0, delay))
    while in_flight:
        await asyncio.wait(in_flight)
    elapsed = time.perf_counter() - started
    cpu = _cpu_s() - cpu_started
    engine = engine_cpu() - engine_started if engine_cpu is not None else None
    instructions = None
    if counting is not None:
        counting.stop()
        instructions = read_window(Path(os.environ[CALLGRIND_DIR]))
    ok = len(latencies)
    result: dict[str, Any] = {
        "rate": rate,
        "requests": total,
        "ok": ok,
        "errors": total - ok,
        "error_kinds": errors,
        "sustained_per_s": ok / elapsed,
        "cpu_us_per_stream": 1e6 * (cpu + (engine or 0.0)) / total,
    }
    if engine is not None:
        result["frontend_cpu_us_per_stream"] = 1e6 * cpu / total
        result["engine_cpu_us_per_stream"] = 1e6 * engine / total
    if instructions is not None:
        result["instructions_per_stream"] = instructions / total
    if latencies:
        result["first_token_p50_ms"] = 1000 * statistics.median(latencies)
        result["first_token_p99_ms"] = 1000 * _percentile(latencies, 0.99)
    return result


def _serve_streams(engine: Node, path: str, tokens: int) -> None:
    """Register the engine's ``open`` handler: every request answered with a stream of
    ``tokens`` tokens to the anchor it names (by its ticket, or by an attach)."""
    offer = [PER_STREAM_KEY] if path == "per-stream" else None

    async def answer(ctx: Context) -> bytes:
        request = json.loads(bytes(ctx.payload))
        handle = StreamAnchorHandle(int(request["handle"]))
        if "ticket" in request:
            ticket = StreamOpenTicket.decode(bytes.fromhex(request["ticket"]))
            sender = await engine.open_anchor_stream(handle, ticket)
        else:
            sender = await engine.anchors.attach_anchor(handle, offer=offer)
        for i in range(tokens):
            await sender.send({**TOKEN, "t": i})
        sender.finalize()
        return b"ok"

    engine.register_handler("open", answer, dispatch="spawn")


def _node_opener(frontend: Node, engine: InstanceId, path: str, tokens: int) -> Opener:
    async def open_one(n: int) -> float:
        started = time.perf_counter()
        anchor = frontend.create_anchor()
        request: dict[str, Any] = {"handle": str(anchor.handle.value)}
        if path == "mux-ticket":
            request["ticket"] = frontend.prebind_anchor(anchor.handle).encode().hex()
        reply = asyncio.ensure_future(frontend.call(engine, "open", json.dumps(request).encode()))
        try:
            first = None
            count = 0
            async for _ in anchor:
                if first is None:
                    first = time.perf_counter() - started
                count += 1
            if count != tokens or first is None:
                raise RuntimeError(f"stream {n} ended after {count} tokens")
            await reply
            return first
        finally:
            if not reply.done():
                reply.cancel()
            anchor.cancel()

    return open_one


async def _node_path(
    path: str, args: argparse.Namespace, certs: dict[str, Path], label: str, placement: Placement
) -> list[Any]:
    frontend_credentials = NodeCredentials.load(certs["frontend"])
    if placement.processes == 1:
        async with (
            open_node(NodeCredentials.load(certs["engine"])) as engine,
            open_node(frontend_credentials, peers=[engine.record]) as frontend,
        ):
            _serve_streams(engine, path, args.tokens)
            opener = _node_opener(frontend, engine.instance_id, path, args.tokens)
            return await _rates(label, opener, args)
    async with _EngineProcess.start("node", path, args, certs, placement) as child:
        record = PeerRecord.from_json(child.hello["record"])
        async with open_node(frontend_credentials, peers=[record]) as frontend:
            opener = _node_opener(frontend, record.instance_id, path, args.tokens)
            return await _rates(label, opener, args, child.cpu_s)


def _grpc_handler(tokens: int) -> Any:
    import grpc

    async def stream(request: bytes, context: Any) -> Any:
        for i in range(tokens):
            yield json.dumps({**TOKEN, "t": i}).encode()

    return grpc.method_handlers_generic_handler(
        "bench.Streams", {"Open": grpc.unary_stream_rpc_method_handler(stream)}
    )


async def _grpc_server(tokens: int, engine_certs: Path) -> tuple[Any, int]:
    """A started grpc.aio server answering ``Open`` with ``tokens`` messages; its port."""
    from grpc import aio

    from velomux_quic.programs.demo.grpc_tokens import _HOST, server_credentials

    server = aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_grpc_handler(tokens),))
    port = server.add_secure_port(f"{_HOST}:0", server_credentials(engine_certs))
    await server.start()
    return server, port


async def _grpc_path(
    args: argparse.Namespace, certs: dict[str, Path], placement: Placement
) -> list[Any]:
    if placement.processes == 1:
        server, port = await _grpc_server(args.tokens, certs["engine"])
        try:
            return await _grpc_client(args, certs, port, None)
        finally:
            await server.stop(None)
    async with _EngineProcess.start("grpc", "grpc", args, certs, placement) as child:
        return await _grpc_client(args, certs, int(child.hello["port"]), child.cpu_s)


async def _grpc_client(
    args: argparse.Namespace,
    certs: dict[str, Path],
    port: int,
    engine_cpu: Callable[[], float] | None,
) -> list[Any]:
    from grpc import aio

    from velomux_quic.programs.demo.grpc_tokens import _HOST, channel_credentials

    channel = aio.secure_channel(f"{_HOST}:{port}", channel_credentials(certs["frontend"]))
    await channel.channel_ready()
    call = channel.unary_stream("/bench.Streams/Open")
    try:

        async def open_one(n: int) -> float:
            started = time.perf_counter()
            first = None
            count = 0
            async for _ in call(b""):
                if first is None:
                    first = time.perf_counter() - started
                count += 1
            if count != args.tokens or first is None:
                raise RuntimeError(f"stream {n} ended after {count} tokens")
            return first

        return await _rates("grpc", open_one, args, engine_cpu)
    finally:
        await channel.close()


@dataclass(frozen=True)
class Placement:
    """Where the nodes of a path run: ``processes`` 1, both in this process on one loop;
    2, the engine (or the gRPC server) in a child process of its own, as deployed."""

    processes: int
    tracing: str | None
    collector: str | None


class _EngineProcess:
    """The engine's side of a path in a child process (``--processes 2``): this script run
    with ``--serve``. It prints one JSON line (its node's record, or the gRPC server's
    port), serves until its standard input closes, and is killed if it does not end then."""

    def __init__(self, process: asyncio.subprocess.Process, hello: dict[str, Any]) -> None:
        self.process = process
        self.hello = hello
        self._clock = _process_cpu_clock(process.pid)

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls,
        kind: str,
        path: str,
        args: argparse.Namespace,
        certs: dict[str, Path],
        placement: Placement,
    ) -> AsyncIterator[_EngineProcess]:
        command = [
            sys.executable, __file__, "--serve", kind, "--serve-path", path,
            "--serve-certs", str(certs["engine"]), "--tokens", str(args.tokens),
        ]  # fmt: skip
        if placement.tracing is not None:
            command += ["--tracing", placement.tracing]
        if placement.collector is not None:
            command += ["--collector", placement.collector]
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert process.stdout is not None
            line = await asyncio.wait_for(process.stdout.readline(), 60)
            if not line:
                raise SystemExit(f"the {kind} engine process ended before it was ready")
            yield cls(process, json.loads(line))
        finally:
            if process.stdin is not None:
                process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 20)
            except TimeoutError:
                process.kill()
                await process.wait()

    def cpu_s(self) -> float:
        """The child's CPU seconds so far (user + system, every thread, those ended too),
        from its process CPU clock: to the nanosecond, where /proc's utime and stime count
        whole clock ticks, so that a low rate's window (a few milliseconds of the child's
        CPU) read as no CPU at all when it fell within one tick."""
        return time.clock_gettime(self._clock)


def _process_cpu_clock(pid: int) -> int:
    """The CPU-time clock of process ``pid`` (POSIX ``clock_getcpuclockid``, which Python's
    ``time`` does not wrap), for :func:`time.clock_gettime`."""
    libc = ctypes.CDLL(None, use_errno=True)
    clock = ctypes.c_int()
    failed = libc.clock_getcpuclockid(pid, ctypes.byref(clock))
    if failed:
        raise OSError(failed, f"clock_getcpuclockid({pid}): {os.strerror(failed)}")
    return clock.value


async def _serve(args: argparse.Namespace) -> int:
    """``--serve``: the engine's side of one path in this process, until stdin closes."""
    if args.tracing:
        _set_tracing(args.tracing[0])
    with _collector(args.collector[0] if args.collector else None):
        certs = Path(args.serve_certs)
        if args.serve == "grpc":
            server, port = await _grpc_server(args.tokens, certs)
            hello: dict[str, Any] = {"port": port}
        else:
            engine = await Node.start(NodeCredentials.load(certs))
            _serve_streams(engine, args.serve_path, args.tokens)
            hello = {"record": engine.record.to_json()}
        try:
            print(json.dumps(hello), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
        finally:
            if args.serve == "grpc":
                await server.stop(None)
            else:
                await engine.close()
    return 0


async def _rates(
    path: str,
    open_one: Opener,
    args: argparse.Namespace,
    engine_cpu: Callable[[], float] | None = None,
) -> list[Any]:
    results = []
    for rate in args.rates:
        result = await _drive(open_one, rate, args.seconds, args.timeout, engine_cpu)
        results.append(result)
        print(
            f"{path} at {rate:,}/s: {result['ok']:,} of {result['requests']:,} ok, "
            f"{result['sustained_per_s']:,.0f}/s sustained, first token p50/p99 "
            f"{result.get('first_token_p50_ms', float('nan')):.1f}/"
            f"{result.get('first_token_p99_ms', float('nan')):.1f} ms, "
            f"{result['cpu_us_per_stream']:,.0f} µs CPU per stream, "
            f"{result.get('instructions_per_stream', float('nan')):,.0f} instructions per "
            f"stream, errors "
            f"{result['error_kinds'] or 0}",
            file=sys.stderr,
            flush=True,
        )
        if result["errors"] * 2 > result["requests"]:
            break  # this path failed at this rate: the higher ones are not run
        await asyncio.sleep(1.0)  # let the last rate's streams retire before the next
    return results


def table(found: dict[str, list[dict[str, Any]]], rates: list[int]) -> str:
    lines = [
        "| path | " + " | ".join(f"{rate:,}/s" for rate in rates) + " |",
        "|---|" + "---:|" * len(rates),
    ]
    for path, results in found.items():
        by_rate = {result["rate"]: result for result in results}
        cells = [path]
        for rate in rates:
            result = by_rate.get(rate)
            if result is None:
                cells.append("not run (failed below)")
                continue
            p50 = result.get("first_token_p50_ms")
            p99 = result.get("first_token_p99_ms")
            latency = "n/a" if p50 is None else f"{p50:.1f} / {p99:.1f} ms"
            cell = (
                f"{result['sustained_per_s']:,.0f}/s, {result['errors']:,} errors, {latency}, "
                f"{result['cpu_us_per_stream']:,.0f} µs"
            )
            if "engine_cpu_us_per_stream" in result:
                cell += (
                    f" (frontend {result['frontend_cpu_us_per_stream']:,.0f}, engine "
                    f"{result['engine_cpu_us_per_stream']:,.0f})"
                )
            if "instructions_per_stream" in result:
                cell += f", {result['instructions_per_stream']:,.0f} instructions"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _set_tracing(mode: str) -> None:
    """Make the nodes opened next trace as ``mode`` says (see the module docstring)."""
    if mode in ("off", "on"):
        os.environ["VELOMUX_TRACING"] = mode
    else:
        os.environ.pop("VELOMUX_TRACING", None)
    if mode == "off":
        return
    from opentelemetry import trace  # the otel extra: required by these two modes

    if mode in ("no-provider", "on"):
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            raise SystemExit(f"--tracing {mode}: a tracer provider is already set")
        return
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    provider = TracerProvider()
    provider.add_span_processor(SpanProcessor())  # every span made, ended and dropped
    trace.set_tracer_provider(provider)


async def main_async(args: argparse.Namespace) -> int:
    modes = sorted(args.tracing or [], key=TRACING.index) or [None]
    collectors = args.collector or [None]
    with tempfile.TemporaryDirectory(prefix="stream-rate-") as tmp:
        certs = ensure_dev_cluster(Path(tmp) / "certs", ("engine", "frontend"))
        found: dict[str, list[dict[str, Any]]] = {}
        for mode in modes:
            if mode is not None:
                _set_tracing(mode)
            for collector in collectors:
                for processes in args.processes:
                    placement = Placement(processes, mode, collector)
                    for path in args.paths:
                        if path == "grpc" and mode not in (None, modes[0]):
                            continue  # not traced: once per collector setting
                        label = path
                        if mode is not None and path != "grpc":
                            label += f", tracing {mode}"
                        if collector is not None:
                            label += f", collector {collector}"
                        if len(args.processes) > 1:
                            label += f", {processes} process{'es' if processes > 1 else ''}"
                        with _collector(collector):
                            if path == "grpc":
                                found[label] = await _grpc_path(args, certs, placement)
                            else:
                                found[label] = await _node_path(path, args, certs, label, placement)
    print(
        f"# stream rate: {args.tokens} tokens per stream, {args.seconds:g} s per rate, "
        f"timeout {args.timeout:g} s (cell: sustained opens, errors, first token p50 / p99, "
        "CPU per stream, both sides)\n"
    )
    print(table(found, args.rates))
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=2) + "\n")
    return 0


@contextlib.contextmanager
def _collector(setting: str | None) -> Iterator[None]:
    """The cyclic collector's thresholds, and its frozen generation, while one path runs
    (None: as they are)."""
    before = gc.get_threshold()
    freeze = False
    if setting is not None:
        thresholds, freeze = COLLECTOR[setting]
        gc.set_threshold(*thresholds)
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        gc.set_threshold(*before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument(
        "--rates", nargs="+", type=int, default=[250, 500, 1000, 2500, 5000], help="streams/s"
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="window per rate (2)")
    parser.add_argument("--tokens", type=int, default=4, help="tokens per stream (4)")
    parser.add_argument("--timeout", type=float, default=10.0, help="per request (10 s)")
    parser.add_argument(
        "--tracing", nargs="+", choices=TRACING,
        help="run each node path once per tracing mode (default: as the environment says)",
    )  # fmt: skip
    parser.add_argument(
        "--instructions", action="store_true",
        help="run under valgrind's callgrind, counting the instructions per stream of each "
        "rate's window (a figure the machine's load does not move; the process runs tens "
        "of times slower there: low rates only)",
    )  # fmt: skip
    parser.add_argument(
        "--collector", nargs="+", choices=tuple(COLLECTOR),
        help="run each path once per setting of the cyclic collector: default (CPython's), "
        "raised (thresholds a frontend opening thousands of streams a second may set), "
        "frozen (gc.freeze() of what the process holds before the nodes start), "
        "raised-frozen (both); docs/tuning.md",
    )  # fmt: skip
    parser.add_argument(
        "--processes", nargs="+", type=int, choices=(1, 2), default=[1],
        help="run each path once per placement: 1, both nodes (or gRPC's server and client) "
        "in this process on one loop; 2, the engine's side in a process of its own, as "
        "deployed (default: 1)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--serve", choices=("node", "grpc"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-path", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--serve-certs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        return run(_serve(args))
    if args.instructions and args.processes != [1]:
        parser.error("--instructions counts this one process: run it with --processes 1")
    if args.instructions and CALLGRIND_DIR not in os.environ:
        return _under_callgrind(sys.argv[1:] if argv is None else argv)
    return run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
