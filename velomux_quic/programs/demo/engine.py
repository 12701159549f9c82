"""The demo's decode engine (this process) and one run of a QUIC arm against two frontends.

The engine starts its node, then two frontend processes (``python -m
velomux_quic.programs.demo.frontend``), each owning every other request. They register their
requests with ``GENERATE`` calls; once all have arrived the engine opens every stream
(from its zero-RTT ticket on the mux arm, by attaching on the per-stream arm) and runs
paced forward passes: every ``pace_ms`` one token per live request, each stamped with
``perf_counter_ns`` as it is sent, the shape of an LLM decode loop. The schedule is
anchored (a timer that wakes late does not stretch it); a pass that falls due while the
previous one still runs starts at once and is counted late, never bursting to catch up.
Then it ends every stream, waits for both frontends' reports and adds up what the run
showed.

The engine's CPU includes the live display's (rich redraws on a thread of this process
a few times a second, on a terminal only): a cost of the demo, not of the library,
and small against the streams'.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ... import (
    Context,
    Manual,
    MuxConfig,
    Node,
    Retired,
    StreamAnchorHandle,
    StreamOpenTicket,
    StreamSender,
    TransportConfig,
    open_node,
)
from .impair import Impairment, proxy_in_front_of
from .measure import CpuWindow, counters_since, live_slots, percentile_ms, read_counters
from .progress import Display
from .protocol import GENERATE, PROGRESS, REPORT, ArmPlan, Latencies, Request, read_latencies

__all__ = ["ArmResult", "DemoFailure", "Frontends", "paced_passes", "run_quic_arm"]

T = TypeVar("T")


class DemoFailure(Exception):
    """A run that could not finish; the message says where it stopped."""


@dataclass(slots=True)
class ArmResult:
    """One arm's figures (``row``, what the summary and ``--json`` show) and its latency
    samples (``latencies``, for the plot; None when the arm gave only percentiles)."""

    row: dict[str, Any]
    latencies: Latencies | None = None


@dataclass(slots=True)
class _Inbox:
    """What the engine's handlers received from the frontends."""

    expected: int
    frontends: int
    requests: list[tuple[Request, Any]] = field(default_factory=list)
    """(the request, the frontend's InstanceId) per GENERATE call."""
    all_requests: asyncio.Event = field(default_factory=asyncio.Event)
    delivered: dict[Any, int] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)
    all_reports: asyncio.Event = field(default_factory=asyncio.Event)

    def generate(self, ctx: Context) -> None:
        """A request: inline, it only notes it for the engine to open once all arrived."""
        self.requests.append((Request.decode(bytes(ctx.payload)), ctx.sender))
        if len(self.requests) == self.expected:
            self.all_requests.set()

    def progress(self, ctx: Context) -> None:
        self.delivered[ctx.sender] = int(bytes(ctx.payload))

    def report(self, ctx: Context) -> None:
        report = json.loads(bytes(ctx.payload))
        self.reports.append(report)
        self.delivered[ctx.sender] = int(report["tokens"])
        if len(self.reports) == self.frontends:
            self.all_reports.set()


class Frontends:
    """The frontend processes (``python -m velomux_quic.programs.demo.frontend``): started, watched
    (one that dies fails the run at once, with the end of its stderr), and gone when the
    run ends however it ends."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[asyncio.subprocess.Process] = []
        self.logs: list[Path] = []
        self._readers: list[asyncio.Task[None]] = []

    async def spawn(
        self, arguments: list[str], progress: Callable[[int], None] | None = None
    ) -> None:
        """Start one frontend; ``progress``, when given, is called with each number the
        frontend prints on its standard output (tokens read so far)."""
        log = self.workdir / f"frontend-{len(self.processes)}.log"
        stdout = asyncio.subprocess.DEVNULL if progress is None else asyncio.subprocess.PIPE
        with log.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "velomux_quic.programs.demo.frontend", *arguments,
                stdin=asyncio.subprocess.DEVNULL, stdout=stdout,
                stderr=stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        self.processes.append(process)
        self.logs.append(log)
        if progress is not None:
            assert process.stdout is not None
            self._readers.append(asyncio.create_task(_read_progress(process.stdout, progress)))

    def _died(self, number: int) -> DemoFailure:
        process = self.processes[number]
        tail = self.logs[number].read_text(errors="replace")[-1500:]
        return DemoFailure(f"frontend {number} exited with code {process.returncode}:\n{tail}")

    async def watch(self, awaitable: Awaitable[T], what: str, timeout: float) -> T:
        """``awaitable``'s result, unless a frontend exits first or ``timeout`` passes."""
        task = asyncio.ensure_future(awaitable)
        deaths = [asyncio.ensure_future(process.wait()) for process in self.processes]
        try:
            done, _ = await asyncio.wait(
                [task, *deaths], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if task in done:
                return task.result()
            for number, death in enumerate(deaths):
                if death in done:
                    raise self._died(number)
            raise DemoFailure(f"{what}: nothing happened for {timeout:g} s")
        finally:
            for pending in (task, *deaths):
                pending.cancel()
            await asyncio.gather(task, *deaths, return_exceptions=True)

    async def finish(self, timeout: float) -> None:
        for number, process in enumerate(self.processes):
            try:
                code = await asyncio.wait_for(process.wait(), timeout)
            except TimeoutError:
                raise DemoFailure(f"frontend {number} did not exit within {timeout:g} s") from None
            if code != 0:
                raise self._died(number)

    def kill(self) -> None:
        for process in self.processes:
            if process.returncode is None:
                process.kill()

    async def reap(self) -> None:
        self.kill()
        for process in self.processes:
            await process.wait()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)


async def _read_progress(stream: asyncio.StreamReader, progress: Callable[[int], None]) -> None:
    while line := await stream.readline():
        with contextlib.suppress(ValueError):
            progress(int(line))


@contextlib.asynccontextmanager
async def _route(
    engine: Node, impairment: Impairment | None, timeout: float, proxy: dict[str, Any]
) -> AsyncIterator[tuple[str, int]]:
    """Where the frontends dial the engine: its own address, or the proxy's in front."""
    if impairment is None:
        yield engine.address
        return
    async with proxy_in_front_of(engine.address, impairment, timeout) as (address, counters):
        yield address
    proxy.update(counters)


def _engine_mux(plan: ArmPlan) -> MuxConfig:
    if plan.arm == "per-stream":
        return MuxConfig(enabled=False)  # every stream a QUIC stream of its own
    return MuxConfig(flush_policy=Manual()) if plan.flush == "manual" else MuxConfig()


async def _open(engine: Node, request: Request) -> StreamSender:
    handle = StreamAnchorHandle(request.handle)
    if request.ticket is None:
        return await engine.attach_anchor(handle)
    return await engine.open_anchor_stream(handle, StreamOpenTicket.decode(request.ticket))


async def paced_passes(
    plan: ArmPlan,
    one_pass: Callable[[int], Awaitable[None]],
    after_pass: Callable[[int], None],
) -> int:
    """The decode loop, the same on every arm: ``plan.tokens`` passes, one every
    ``plan.pace_ms`` on an anchored schedule, ``one_pass(step)`` emitting one token per
    live request and ``after_pass(passes run)`` after each; returns how many passes
    started late."""
    pace = plan.pace_ms / 1e3
    late = 0
    due = time.perf_counter()
    for step in range(plan.tokens):
        now = time.perf_counter()
        if due > now:
            await asyncio.sleep(due - now)
            due += pace
        else:
            late += step > 0
            due = now + pace
            await asyncio.sleep(0)
        await one_pass(step)
        after_pass(step + 1)
    return late


def _quic_pass(
    engine: Node, plan: ArmPlan, order: list[tuple[int, StreamSender]]
) -> Callable[[int], Awaitable[None]]:
    """One forward pass of a QUIC arm: a stamped token per stream, one ``send`` each."""
    manual = plan.arm == "mux" and plan.flush == "manual"
    clock = time.perf_counter_ns

    async def one_pass(step: int) -> None:
        for index, sender in order:
            await sender.send([index, step, clock()])
        if manual:
            engine.flush_batch()  # the pass's one write per peer

    return one_pass


def _frontend_arguments(
    plan: ArmPlan, number: int, credentials: Path, engine: Node, route: tuple[str, int],
    latency_out: Path, timeout: float,
) -> list[str]:  # fmt: skip
    return [
        "--credentials", str(credentials), "--engine-instance", str(engine.instance_id),
        "--engine-host", route[0], "--engine-port", str(route[1]), "--index", str(number),
        "--arm", plan.arm, "--requests", str(plan.requests), "--tokens", str(plan.tokens),
        "--pace-ms", str(plan.pace_ms), "--lanes", str(plan.lanes), "--flush", plan.flush,
        "--latency-out", str(latency_out), "--timeout", str(timeout),
    ]  # fmt: skip


async def run_quic_arm(
    plan: ArmPlan,
    nodes: dict[str, Path],
    workdir: Path,
    impairment: Impairment | None,
    display: Display,
    timeout: float,
) -> ArmResult:
    """One run of the ``mux`` or ``per-stream`` arm, in fresh processes."""
    transport = TransportConfig(lanes=plan.lanes)
    inbox = _Inbox(plan.requests, plan.frontends)
    frontends = Frontends(workdir)
    outs = [workdir / f"{plan.arm}-latency-{f}.bin" for f in range(plan.frontends)]
    proxy: dict[str, Any] = {}
    engine_mux = _engine_mux(plan)
    async with open_node(nodes["engine"], transport=transport, mux=engine_mux) as engine:
        engine.register_handler(GENERATE, inbox.generate)
        engine.register_handler(PROGRESS, inbox.progress)
        engine.register_handler(REPORT, inbox.report)
        try:
            async with _route(engine, impairment, timeout, proxy) as route:
                for number in range(plan.frontends):
                    credentials = nodes[f"frontend-{number}"]
                    arguments = _frontend_arguments(
                        plan, number, credentials, engine, route, outs[number], timeout
                    )
                    await frontends.spawn(arguments)
                await frontends.watch(inbox.all_requests.wait(), "registering requests", timeout)
                registered = time.perf_counter()
                requests = sorted(inbox.requests, key=lambda pair: pair[0].index)
                # CPU and counters from here: opening the streams is the engine's work too,
                # as registering them is the frontends' (their window starts before).
                cpu = CpuWindow.open()
                before = read_counters(engine)
                senders = await frontends.watch(
                    asyncio.gather(*(_open(engine, request) for request, _ in requests)),
                    "opening the streams",
                    timeout,
                )
                open_s = time.perf_counter() - registered
                with_tickets = sum(request.ticket is not None for request, _ in requests)
                transports = sorted({str(sender.negotiated_transport()) for sender in senders})
                display.arm(plan.arm, plan.tokens, plan.requests * plan.tokens)
                first_send = time.perf_counter()
                order = [
                    (request.index, s) for (request, _), s in zip(requests, senders, strict=True)
                ]
                streaming = timeout + 4 * plan.tokens * plan.pace_ms / 1e3
                late = await frontends.watch(
                    paced_passes(
                        plan,
                        _quic_pass(engine, plan, order),
                        lambda passes: display.update(passes, sum(inbox.delivered.values())),
                    ),
                    "the forward passes",
                    streaming,
                )
                retired = await frontends.watch(
                    asyncio.gather(*(sender.finalize() for sender in senders)),
                    "ending the streams",
                    timeout,
                )
                await frontends.watch(inbox.all_reports.wait(), "the frontends' reports", timeout)
                engine_cpu = cpu.seconds()
                counters = counters_since(before, read_counters(engine))
                display.update(plan.tokens, sum(inbox.delivered.values()))
                # Before the frontends leave: their going would tear any slot down anyway.
                engine_live = live_slots(engine)
                live_senders = len(engine.snapshot().streaming.senders)
                await frontends.finish(timeout)
        finally:
            await frontends.reap()
    latencies = Latencies.empty()
    for path in outs:
        latencies.extend(read_latencies(path))
    row = _summarise(
        plan, inbox.reports, counters, engine_cpu, first_send, late, open_s, transports,
        retired, engine_live, live_senders, latencies, proxy,
    )  # fmt: skip
    row["opened_with_tickets"] = with_tickets
    return ArmResult(row, latencies)


def _summarise(
    plan: ArmPlan, reports: list[dict[str, Any]], counters: dict[str, float], engine_cpu: float,
    first_send: float, late: int, open_s: float, transports: list[str], retired: list[Retired],
    engine_live: int, live_senders: int, latencies: Latencies, proxy: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The arm's row: every figure the summary prints and ``--json`` gives."""
    expected = plan.requests * plan.tokens
    delivered = sum(int(report["tokens"]) for report in reports)
    complete = sum(int(report["complete"]) for report in reports)
    elapsed = max(float(report["last_token_at"]) for report in reports) - first_send
    frontends_cpu = sum(float(report["cpu_s"]) for report in reports)
    frontends_out = sum(float(report["counters"]["datagrams_out"]) for report in reports)
    batches, records = counters["mux_batches_sent"], counters["mux_records_sent"]
    first, later, gaps = (
        sorted(part) for part in (latencies.first, latencies.later, latencies.gaps)
    )
    tokens = max(delivered, 1)
    row: dict[str, Any] = {
        "arm": plan.arm,
        "transport": ",".join(transports),
        "requests": plan.requests,
        "tokens_per_request": plan.tokens,
        "pace_ms": plan.pace_ms,
        "lanes": plan.lanes,
        "flush": plan.flush if plan.arm == "mux" else None,
        "tokens_expected": expected,
        "tokens_delivered": delivered,
        "streams_complete_in_order": complete,
        "all_complete_in_order": complete == plan.requests and delivered == expected,
        "retired": sorted({outcome.value for outcome in retired}),
        "open_s": open_s,
        "elapsed_s": elapsed,
        "tokens_per_s": delivered / elapsed if elapsed > 0 else 0.0,
        "late_passes": late,
        "records_per_write": records / batches if batches else None,
        "mux_batches_sent": batches,
        "engine_datagrams_out_per_token": counters["datagrams_out"] / tokens,
        "datagrams_per_token": (counters["datagrams_out"] + frontends_out) / tokens,
        "engine_cpu_us_per_token": 1e6 * engine_cpu / tokens,
        "frontends_cpu_us_per_token": 1e6 * frontends_cpu / tokens,
        "first_token_p50_ms": percentile_ms(first, 0.50),
        "first_token_p99_ms": percentile_ms(first, 0.99),
        "inter_token_p50_ms": percentile_ms(gaps, 0.50),
        "inter_token_p99_ms": percentile_ms(gaps, 0.99),
        "token_latency_p50_ms": percentile_ms(later, 0.50),
        "token_latency_p99_ms": percentile_ms(later, 0.99),
        "live_slots_end": engine_live + sum(int(report["live_slots"]) for report in reports),
        "live_senders_end": live_senders,
    }
    if proxy:
        row["proxy"] = proxy
    return row
