"""The decode-engine token benchmark: one engine, Y frontends, seven implementations.

A decode engine emits one token per live request per forward pass; each request's tokens go
to the frontend that owns it. Here one engine process streams ``--streams`` X requests to
``--frontends`` Y frontend processes (request ``i`` belongs to frontend ``i mod Y``, so the
split is even and every pass interleaves the frontends), one 48-byte MessagePack token per
live stream per pass, and every frontend checks that each of its streams received exactly
its own tokens, in order, and ended cleanly. Any difference fails the run.

Implementations (``--impl``), interleaved run by run (run 1 of each, then run 2 of each...)
so a burst of other load on the machine hits every implementation alike, each run in fresh
processes; a failed run is reported as failed and the others go on:

* ``mux-auto``: every node with the default ``MuxConfig`` (``AutoFlush``); the attach
  negotiates ``messenger-mux-v2``, every stream to a frontend is batched into one message;
* ``mux-manual``: the engine with ``MuxConfig(flush_policy=Manual())`` and one
  ``node.flush_batch()`` per pass, which is the write; the frontends keep the default;
* ``mux-pass``: as ``mux-auto``, but the engine hands each whole pass over in one
  ``node.send_pass(pairs, wait=True)`` call instead of one ``await send`` per token;
* ``mux-auto-pure``, ``mux-pass-pure``: those two with every node (engine and frontends) on
  the pure-Python twin of the record path (``VELOMUX_PURE_PYTHON=1``), the other arms on the
  compiled one: the "before" of the compiled record path, measured in the same invocation;
* ``mux-auto-base``, ``mux-pass-base``, ``mux-auto-pure-base``: ``mux-auto``, ``mux-pass``
  and ``mux-auto-pure`` of another checkout of the repository (``--baseline-tree PATH``: its
  ``perf/tokens.py`` and its ``velomux_quic``), so code from before a change runs beside the
  code after it in one invocation, on either record path (never in the default set);
* ``per-stream``: the engine offers only ``quic-stream-v1``, so every stream is its own QUIC
  stream whatever else the nodes could negotiate;
* ``grpc``: grpc.aio, the engine a gRPC server, each frontend one channel and one
  server-streaming RPC per request (``velomux_quic/programs/demo/grpc_tokens.py``), with
  the same token bytes and the same checks. TLS with the same certificates, client
  certificates required, unless ``--grpc-insecure``;
* ``bare``: the floor, raw aioquic with no velomux streaming code in the data path
  (``perf/bare_tokens.py``): a bare prototype that only packs records into one QUIC stream
  per frontend. Each pass appends every token (a 6-byte header, stream index and length,
  then the same MessagePack body) to its frontend's buffer and writes each buffer once;
  the frontend cuts the stream into records and feeds per-stream inboxes that the same
  consumer code reads. Same mutual TLS, datagram size, socket buffers and windows as a
  node; ``--lanes`` does not apply. The mux should stay within 10% of a bare prototype
  that only packs records into one QUIC stream: the ``mux / bare`` ratios say how close;
* ``zmq``: pyzmq over TCP on loopback (``perf/zmq_tokens.py``), what a Python engineer
  might build by hand: the engine connects a PUSH socket to each frontend's PULL socket,
  CURVE both ways (each frontend a CURVE server admitting only the engine's key, written
  once per run in the run's temporary directory; the engine checks the frontend's key
  from its handoff), one two-frame message per pass per frontend carrying the bare arm's
  records, cut into the bare arm's inboxes. No datagram counts (TCP).

Each implementation is one class behind one interface (``ARMS``): how its children start
and what they hand over, the frontend's and the engine's side, and the figures it reads
from its counters.

The QUIC arms run every node over mutual TLS (certificates made on demand in a temporary
directory) with ``TransportConfig(lanes=--lanes)``; every sender's negotiated transport must
be the arm's, or the run fails. ``mux-auto`` and ``per-stream`` never call
``flush_batch()``: an engine relying on ``AutoFlush`` need not.

Modes (``--mode``): ``max-rate`` runs the passes back to back, awaiting each send (it
suspends only when the stream is full: the backpressure) and yielding to the loop once per
pass (``asyncio.sleep(0)``, as a real engine does while a forward pass runs); ``paced``
starts a pass every ``--pace-ms`` (10 ms) on an anchored schedule (a timer that wakes late
does not stretch the pace); a pass found due while the previous one still runs is counted
late and the schedule restarts from it, never bursting to catch up. The ``single-stream``
scenario is one stream to one frontend, paced: what each implementation adds to a lone
request's latency (``--single-stream`` runs it alone; a sweep that includes the paced mode
runs it last, unless ``--skip-single-stream``).

Consumer shapes (``--consumer``): ``task-per-stream``, one task per stream doing ``async
for`` over the anchor or the RPC (a real frontend); ``batches``, the same tasks taking every
token already buffered per wake-up (``anchor.batches()``, the bare arm's ``inbox.batches()``;
gRPC reads as task-per-stream); ``single-task``, one task taking each live stream's ready
tokens in turn (``anchor.take_ready()``, ``inbox.take_ready()``, ``call.read()``), which
works only because every stream receives one token per pass.

What a run reports:

* tokens/s: all tokens over the engine's first send to the last token received by any
  frontend, on ``perf_counter`` (CLOCK_MONOTONIC: one clock for every process on a host);
  attaching (or opening the RPCs) is timed apart;
* CPU µs per token on each side: user + system of ``getrusage(RUSAGE_SELF)`` (all threads,
  so gRPC's core threads count) over the engine's first send until every frontend has
  every token, and over each frontend's arming until its last stream ended, summed over
  the frontends;
* with ``--instructions``, instructions per token on each side: every child runs under
  valgrind's callgrind (``make valgrind``), instrumented only over the same windows as the
  CPU figures (``perf/_callgrind.py``), so the count, unlike CPU seconds, does not move
  with the machine's load and a ratio between arms holds from one run to the next. The
  children run tens of times slower in their windows: a few passes and a long
  ``--timeout``; the rates and latencies of such a run mean nothing. A ``--baseline-tree``
  from before this option reports none;
* from the nodes' counters (QUIC arms): UDP datagrams per token each way
  (``velo_transport_datagrams_total``) and, on the mux arms, records per wire write
  (``velo_streaming_mux_records_total / velo_streaming_mux_batches_total``, sent) against
  the most 54-byte token records one batch holds; n/a for gRPC and ZeroMQ. The bare arm
  counts its own datagrams, and its records per ``send_stream_data`` call (one per
  frontend per pass), the zmq arm its records per message (no datagrams: TCP);
* latency, emit to receive: the engine stamps ``perf_counter_ns()`` into each token as it
  emits it, each frontend subtracts it from its own ``perf_counter_ns()`` when the token
  reaches the consumer's code. *First token* is each stream's first token; *later tokens*
  is every token after the first (the inter-token latency as this benchmark defines it:
  emit to receive of the tokens after the first, not the gap between them); the *receive
  gap* is the time between consecutive tokens of one stream at the consumer. Reported in
  the tables for paced runs (at max rate it is queueing, in the JSON only).

    python perf/tokens.py --short                     # about a minute
    python perf/tokens.py                             # the sweep, 3 runs each (about 25 min)
    python perf/tokens.py --streams 1024 --frontends 1 --mode max-rate --runs 3
    python perf/tokens.py --single-stream --runs 5
    python perf/tokens.py --short --impl mux-auto grpc --profile engine   # py-spy flame graphs
    python perf/tokens.py --impl mux-auto bare zmq --engine aioquic qh3   # both QUIC engines
    python perf/tokens.py --short --json perf/results/tokens.json
    python perf/tokens.py --impl mux-auto bare --instructions --streams 64 --frontends 1 \
        --passes 10 --mode max-rate --runs 3 --timeout 120     # instructions per token

Exit status 0 when every run succeeded, 2 when any failed (the report is printed either
way). Children run on ``velomux_quic.programs.runtime.run`` (uvloop where installed;
``VELOMUX_NO_UVLOOP=1`` for plain asyncio), the gRPC ones too.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import math
import os
import platform
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgpack
from _callgrind import ENV_DIR as CALLGRIND_DIR
from _callgrind import command as callgrind_command
from _harness import (
    STAMP_MIN,
    TOKEN_BYTES,
    UINT_LIMITS,
    BenchFailure,
    Child,
    Window,
    busy_before,
    expect_line,
    loop_environment,
    median_of,
    ok_runs,
    package_version,
    print_counters,
    profile_report,
    records_per_batch_clamp,
    run_child,
    say,
    stamped_token,
    stdin_reader,
    token_record_bytes,
    watched,
)

from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.mux.config import Manual, MuxConfig
from velomux_quic.mux.protocol import COALESCE_THRESHOLD
from velomux_quic.node import Node
from velomux_quic.recordpath import PURE_PYTHON_ENV
from velomux_quic.security.certs import NodeCredentials, ensure_dev_cluster
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY
from velomux_quic.streaming.sender import Retired, StreamSender
from velomux_quic.transport import TransportConfig

SCRIPT = Path(__file__).resolve()
RESULTS = SCRIPT.parent / "results"

BASELINES = ("grpc", "per-stream", "bare", "zmq")
"""What the mux arms are compared against, in the ratio tables."""
MODES = ("max-rate", "paced")
CONSUMERS = ("task-per-stream", "batches", "single-task")

PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "streams": [256, 1024],
        "frontends": [1, 4],
        "mode": list(MODES),
        "passes": 100,
        "runs": 3,
        "single_stream_passes": 200,
    },
    "short": {
        "streams": [256],
        "frontends": [1],
        "mode": list(MODES),
        "passes": 30,
        "runs": 1,
        "single_stream_passes": 100,
    },
}
"""The sweep without flags (``full``) and with ``--short``; any flag given overrides."""


@dataclass(frozen=True)
class Scenario:
    """One cell of the sweep: every implementation runs it ``runs`` times."""

    streams: int
    frontends: int
    mode: str
    passes: int
    pace_ms: float
    single_stream: bool = False

    @property
    def name(self) -> str:
        if self.single_stream:
            return "single-stream"
        return f"{self.streams}x{self.frontends}-{self.mode}"

    @property
    def paced(self) -> bool:
        return self.mode == "paced"

    @property
    def pace_s(self) -> float:
        return self.pace_ms / 1000.0 if self.paced else 0.0

    def title(self) -> str:
        what = "one stream alone" if self.single_stream else f"{self.streams:,} streams"
        frontends = f"{self.frontends} frontend{'s' if self.frontends > 1 else ''}"
        how = f"paced every {self.pace_ms:g} ms" if self.paced else "max rate"
        return f"{what} to {frontends}, {how}, {self.passes} passes"

    def indices(self, frontend: int) -> range:
        """The streams frontend ``frontend`` owns (global indices)."""
        return range(frontend, self.streams, self.frontends)


def scenario_of(args: argparse.Namespace) -> Scenario:
    """A child's scenario, from the flags the benchmark gave it."""
    return Scenario(args.streams[0], args.frontends[0], args.mode[0], args.passes, args.pace_ms)


# -- the frontend (consumer node) --------------------------------------------------------


class Tally:
    """One frontend's record: per stream the count and first/last receive times, and the
    latencies of all its streams (ns)."""

    def __init__(self, indices: range, streams: int, passes: int) -> None:
        self.indices = indices
        self.streams = streams
        self.passes = passes
        self.later = array("q")
        self.gaps = array("q")
        self.last_pass = array("q")
        """The later tokens of the last pass, the one in which every stream ends (also in
        ``later``): what ending the streams adds shows apart from the other passes."""
        self.ended = 0
        self.checks = [StreamCheck(self, index, streams) for index in indices]

    def tokens(self) -> int:
        return sum(check.count for check in self.checks)

    def write(self, path: Path) -> None:
        """The four latency arrays, for the benchmark to merge across frontends."""
        first = array("q", (check.first_latency for check in self.checks if check.count))
        arrays = (first, self.later, self.gaps, self.last_pass)
        with path.open("wb") as out:
            out.write(struct.pack(LATENCY_HEADER, *(len(values) for values in arrays)))
            for values in arrays:
                out.write(values.tobytes())

    def stall_report(self, timeout: float) -> str:
        short = [check for check in self.checks if check.count != self.passes]
        sample = ", ".join(f"#{check.index}: {check.count}" for check in short[:8])
        return (
            f"no end after {timeout:g} s: {self.tokens()} of {len(self.checks) * self.passes} "
            f"tokens, {self.ended} of {len(self.checks)} streams ended; {len(short)} streams "
            f"short of {self.passes} tokens ({sample}{', ...' if len(short) > 8 else ''})"
        )


class StreamCheck:
    """One stream at the frontend: checks each token and records its latency.

    Stream ``i`` carries tokens ``i, i + X, i + 2X, ...`` (one per pass), so a lost,
    duplicated, reordered or misrouted token shows as the wrong number. The same method
    runs for every implementation, so its cost is the same on every arm."""

    __slots__ = (
        "count",
        "expected",
        "first_latency",
        "first_rx",
        "gaps",
        "index",
        "last_index",
        "last_pass",
        "last_rx",
        "later",
        "step",
    )

    def __init__(self, tally: Tally, index: int, streams: int) -> None:
        self.index = index
        self.step = streams
        self.expected = index
        self.count = 0
        self.first_latency = 0
        self.first_rx = 0
        self.last_rx = 0
        self.later = tally.later
        self.gaps = tally.gaps
        self.last_pass = tally.last_pass
        self.last_index = tally.passes - 1

    def take(self, item: Any, now: int) -> None:
        if item["t"] != self.expected:
            raise BenchFailure(
                f"stream {self.index}: token #{self.count} is t={item.get('t')!r}, expected "
                f"t={self.expected} (lost, duplicated, reordered or misrouted)"
            )
        if self.count:
            latency = now - item["s"]
            self.later.append(latency)
            self.gaps.append(now - self.last_rx)
            if self.count == self.last_index:
                self.last_pass.append(latency)
        else:
            self.first_latency = now - item["s"]
            self.first_rx = now
        self.last_rx = now
        self.count += 1
        self.expected += self.step

    def where(self, passes: int) -> str:
        """Where a failing stream was, for the traceback."""
        if self.count == 0:
            return f"stream {self.index} failed before its first token"
        quiet = (time.perf_counter_ns() - self.last_rx) / 1e9
        return (
            f"stream {self.index} failed after {self.count} of {passes} tokens, "
            f"{quiet:.2f} s after its last"
        )

    def end(self, tally: Tally) -> None:
        if self.count != tally.passes:
            raise BenchFailure(f"stream {self.index} ended after {self.count} of {tally.passes}")
        tally.ended += 1


class TokenSource(Protocol):
    """What the QUIC readers take from one stream: a ``StreamAnchor``, or the bare arm's
    ``Inbox``, so both run the same consumer code."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def batches(self) -> AsyncIterator[list[Any]]: ...

    async def take_ready(self) -> list[Any]: ...


async def read_anchor(anchor: TokenSource, check: StreamCheck, tally: Tally) -> None:
    """task-per-stream, QUIC: ``async for`` over the anchor (or the bare arm's inbox)."""
    clock = time.perf_counter_ns
    take = check.take
    try:
        async for item in anchor:
            take(item, clock())
    except Exception as exc:
        exc.add_note(check.where(tally.passes))
        raise
    check.end(tally)


async def read_anchor_batches(anchor: TokenSource, check: StreamCheck, tally: Tally) -> None:
    """batches, QUIC: a task per stream, ``async for items in anchor.batches()`` (every
    token already buffered per wake-up; the bare arm's inbox the same). gRPC has no such
    call: it reads as task-per-stream."""
    clock = time.perf_counter_ns
    take = check.take
    try:
        async for items in anchor.batches():
            now = clock()
            for item in items:
                take(item, now)
    except Exception as exc:
        exc.add_note(check.where(tally.passes))
        raise
    check.end(tally)


async def read_anchors_in_turn(anchors: Sequence[TokenSource], tally: Tally) -> None:
    """single-task, QUIC: ``take_ready()`` on each live anchor (or inbox) in turn."""
    clock = time.perf_counter_ns
    live = list(zip(anchors, tally.checks, strict=True))
    while live:
        still: list[tuple[TokenSource, StreamCheck]] = []
        for anchor, check in live:
            try:
                items = await anchor.take_ready()
            except StopAsyncIteration:
                check.end(tally)
                continue
            except Exception as exc:
                exc.add_note(check.where(tally.passes))
                raise
            now = clock()
            for item in items:
                check.take(item, now)
            still.append((anchor, check))
        live = still


async def read_call(call: Any, check: StreamCheck, tally: Tally) -> None:
    """task-per-stream, gRPC: ``async for`` over the RPC's responses (an error status
    raises; the loop ends on OK)."""
    clock = time.perf_counter_ns
    take = check.take
    unpack = msgpack.unpackb
    try:
        async for message in call:
            take(unpack(message), clock())
    except Exception as exc:
        exc.add_note(check.where(tally.passes))
        raise
    check.end(tally)


async def read_calls_in_turn(calls: Sequence[Any], tally: Tally, eof: object) -> None:
    """single-task, gRPC: ``call.read()`` on each live RPC in turn."""
    clock = time.perf_counter_ns
    unpack = msgpack.unpackb
    live = list(zip(calls, tally.checks, strict=True))
    while live:
        still: list[tuple[Any, StreamCheck]] = []
        for call, check in live:
            try:
                message = await call.read()
            except Exception as exc:
                exc.add_note(check.where(tally.passes))
                raise
            if message is eof:
                check.end(tally)
                continue
            check.take(unpack(message), clock())
            still.append((call, check))
        live = still


async def frontend_main(args: argparse.Namespace) -> int:
    stdin = await stdin_reader()
    scenario = scenario_of(args)
    tally = Tally(scenario.indices(args.index), scenario.streams, scenario.passes)
    await ARMS[args.impl].frontend(args, scenario, stdin, tally)
    return 0


def _start_readers(
    consumer: str, sources: Sequence[TokenSource], tally: Tally
) -> list[asyncio.Task[None]]:
    """The QUIC arms' consumer tasks, in the ``--consumer`` shape."""
    if consumer == "single-task":
        return [asyncio.create_task(read_anchors_in_turn(sources, tally))]
    reader = read_anchor if consumer == "task-per-stream" else read_anchor_batches
    return [
        asyncio.create_task(reader(source, check, tally))
        for source, check in zip(sources, tally.checks, strict=True)
    ]


def _hand_over(path: Path, handoff: dict[str, Any]) -> None:
    """Write the frontend's handoff for the engine, whole or not at all (renamed into
    place)."""
    staging = path.with_suffix(".partial")
    staging.write_text(json.dumps(handoff))
    staging.replace(path)


ReadCounts = Callable[[], dict[str, float]]
"""The bare arm's own counters (it has no node): read at the window's edges."""


def _counts_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


async def _frontend_window(
    args: argparse.Namespace,
    scenario: Scenario,
    stdin: asyncio.StreamReader,
    node: Node | None,
    readers: list[asyncio.Task[None]],
    tally: Tally,
    counts: ReadCounts | None = None,
) -> None:
    """The measured part of a frontend: from arming until its last stream ended.

    ``counts``: the counters of an arm without a node, whose deltas over the window are
    reported like a node's."""
    try:
        await expect_line(stdin, "go")
        window = Window.open(node)
        before = counts() if counts is not None else {}
        profiler = cProfile.Profile() if args.profile == "frontend" and args.index == 0 else None
        say("armed", {"at": window.at})
        if profiler is not None:
            profiler.enable()
        timeout = args.timeout + scenario.passes * scenario.pace_s
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*readers)
        except TimeoutError:
            raise BenchFailure(tally.stall_report(timeout)) from None
        except Exception:
            if node is not None:
                print_counters(f"frontend {args.index}", node)
            raise
        ended_at = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        deltas = window.close(node)
        if counts is not None:
            deltas["counters"] = _counts_since(before, counts())
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    profile_report(profiler, f"frontend {args.index}", args.profile_out)
    tally.write(args.latency_out)
    started = [check.first_rx for check in tally.checks if check.count]
    say(
        "result",
        {
            "tokens": tally.tokens(),
            "streams": len(tally.checks),
            "streams_ended": tally.ended,
            "armed_at": window.at,
            "first_token_at": min(started) / 1e9 if started else None,
            "last_token_at": max(check.last_rx for check in tally.checks) / 1e9,
            "ended_at": ended_at,
            **deltas,
            **loop_environment(),
        },
    )
    await expect_line(stdin, "exit")


# -- the engine (producer node) ----------------------------------------------------------

Emit = Callable[[Any], Awaitable[None]]
PassBody = Callable[[int], Awaitable[None]]
"""One forward pass, given its number: a stamped token to every stream, in index order."""


def emitting(emit: Sequence[Emit], after_pass: Callable[[], None] | None) -> PassBody:
    """The pass of the node and gRPC arms: ``await emit[i](token)`` for every stream
    ``i`` (``StreamSender.send``, or the gRPC arm's queue put), then ``after_pass``
    (``mux-manual``'s ``flush_batch``). The bare arm packs its pass itself
    (``BareEngine.pass_body``), with the same token and clock."""
    clock = time.perf_counter_ns
    streams = len(emit)

    async def one_pass(pass_: int) -> None:
        base = pass_ * streams
        for index, send in enumerate(emit):
            await send(stamped_token(base + index, clock()))
        if after_pass is not None:
            after_pass()

    return one_pass


def passing(node: Node, senders: Sequence[StreamSender]) -> PassBody:
    """The pass of ``mux-pass``: every stream's stamped token in one ``node.send_pass``
    (waiting for room, as the awaited sends of the other arms do)."""
    clock = time.perf_counter_ns
    streams = len(senders)
    send_pass = node.send_pass

    async def one_pass(pass_: int) -> None:
        base = pass_ * streams
        pairs = [(sender, stamped_token(base + i, clock())) for i, sender in enumerate(senders)]
        outcome = await send_pass(pairs, wait=True)
        if not outcome.complete:
            raise BenchFailure(f"pass {pass_} not taken whole: {outcome}")

    return one_pass


async def run_passes(one_pass: PassBody, scenario: Scenario, where: list[int]) -> dict[str, Any]:
    """The decode loop: ``scenario.passes`` passes of ``one_pass``, at max rate or paced.
    ``where[0]`` follows the pass for a failure's report.

    Paced, pass ``k`` is due ``k`` paces after the first while the engine keeps up: the
    schedule is anchored, so a sleep that wakes late (timer granularity, a busy machine)
    does not stretch the pace. A pass found due while the previous one still ran is *late*:
    it starts at once and the schedule restarts from it, so an engine that fell behind
    never bursts passes to catch up."""
    passes, pace = scenario.passes, scenario.pace_s
    late = 0
    worst_late = 0.0
    started = time.perf_counter()
    due = started
    last_start = started
    for pass_ in range(passes):
        where[0] = pass_
        if pace:
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
                due += pace
            else:
                if pass_:
                    late += 1
                    worst_late = max(worst_late, now - due)
                due = now + pace
                await asyncio.sleep(0)
            last_start = time.perf_counter()
        await one_pass(pass_)
        if not pace:
            await asyncio.sleep(0)
    return {
        "first_send_at": started,
        "passes_done_at": time.perf_counter(),
        "late_passes": late,
        "worst_late_ms": 1000 * worst_late,
        "mean_pass_interval_ms": 1000 * (last_start - started) / max(1, passes - 1),
    }


async def _engine_window(
    args: argparse.Namespace,
    scenario: Scenario,
    stdin: asyncio.StreamReader,
    node: Node | None,
    one_pass: PassBody,
    finish: Callable[[], Awaitable[None]],
    counts: ReadCounts | None = None,
) -> None:
    """The engine's measured part: the passes, the streams' ends, then until every
    frontend confirmed every token. ``counts`` as in ``_frontend_window``."""
    await expect_line(stdin, "go")
    window = Window.open(node)
    before = counts() if counts is not None else {}
    profiler = cProfile.Profile() if args.profile == "engine" else None
    if profiler is not None:
        profiler.enable()
    where = [0]
    timeout = args.timeout + scenario.passes * scenario.pace_s
    try:
        async with asyncio.timeout(timeout):
            passes = await run_passes(one_pass, scenario, where)
            where[0] = scenario.passes
            await finish()
            retired_at = time.perf_counter()
    except TimeoutError:
        raise BenchFailure(
            f"the engine did not finish within {timeout:g} s: it was at pass {where[0]} "
            f"of {scenario.passes} ({scenario.passes} = ending the streams)"
        ) from None
    except Exception as exc:
        exc.add_note(
            f"the engine was at pass {where[0]}, {time.perf_counter() - window.at:.2f} s "
            "after its first send"
        )
        if node is not None:
            print_counters("engine", node)
        raise
    await expect_line(stdin, "done")  # every frontend has every token
    if profiler is not None:
        profiler.disable()
    deltas = window.close(node)
    if counts is not None:
        deltas["counters"] = _counts_since(before, counts())
    profile_report(profiler, "engine", args.profile_out)
    say("result", {**passes, "retired_at": retired_at, **deltas, **loop_environment()})
    await expect_line(stdin, "exit")


def _check_clock() -> None:
    if time.perf_counter_ns() < STAMP_MIN:
        raise BenchFailure("perf_counter_ns() is below 2**32: the token would not be 48 bytes")


async def engine_main(args: argparse.Namespace) -> int:
    stdin = await stdin_reader()
    scenario = scenario_of(args)
    _check_clock()
    await ARMS[args.impl].engine(args, scenario, stdin)
    return 0


# -- the arms ----------------------------------------------------------------------------


def _datagram_figures(
    engine: dict[str, float], parts: Sequence[dict[str, float]], tokens: int
) -> dict[str, Any]:
    """UDP datagrams per token each way and the engine's send waits (the QUIC arms)."""
    return {
        "engine_datagrams_out_per_token": engine["datagrams_out"] / tokens,
        "engine_datagrams_in_per_token": engine["datagrams_in"] / tokens,
        "frontends_datagrams_out_per_token": sum(p["datagrams_out"] for p in parts) / tokens,
        "engine_send_waits": engine["send_waits"],
    }


def _write_figures(engine: dict[str, float], passes: int) -> dict[str, Any]:
    """Records per write of an arm that packs each pass itself (bare, zmq): one write per
    frontend per pass, carrying that frontend's streams."""
    writes, records = engine["writes"], engine["records"]
    return {
        "engine_writes": writes,
        "engine_records_sent": records,
        "engine_records_per_write": records / writes if writes else 0.0,
        "engine_writes_per_pass": writes / passes,
    }


@dataclass
class Launch:
    """What starting one run's children takes, handed to its arm: the flags, the scenario,
    each child's arguments, the handoff files, and the lists the run's cleanup empties
    (every child and proxy started goes into them at once)."""

    args: argparse.Namespace
    scenario: Scenario
    impl: str
    number: int
    tag: str
    workdir: Path
    handoffs: list[Path]
    frontend_extra: Callable[[int], dict[str, Any]]
    engine_extra: dict[str, Any]
    children: list[Child]
    proxies: list[asyncio.subprocess.Process]

    def _counting(self, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The prefix and variables of a child run under callgrind (``--instructions``):
        its window's instructions are counted (``perf/_callgrind.py``)."""
        if not self.args.instructions:
            return [], env
        out = self.workdir / f"callgrind-{self.tag}"
        out.mkdir(exist_ok=True)
        return callgrind_command(out), env | {CALLGRIND_DIR: str(out)}

    def _child(self) -> tuple[Path, str, dict[str, str]]:
        """The script the arm's children run, the ``--impl`` they are given, and the
        variables set for them: a baseline arm runs another tree's benchmark and library
        (``--baseline-tree``) under its own arm's name there."""
        name, engine = split_label(self.impl)  # the label may name a QUIC engine
        arm = ARMS[name]
        baseline = getattr(arm, "baseline_of", None)
        if baseline is None:
            return SCRIPT, self.impl, arm.environment()
        tree: Path | None = self.args.baseline_tree
        if tree is None:
            raise BenchFailure(f"{self.impl} runs another tree's code: give --baseline-tree")
        label = baseline if engine is None else f"{baseline}@{engine}"
        return tree / "perf" / "tokens.py", label, arm.environment() | {"PYTHONPATH": str(tree)}

    async def spawn_frontends(self, extra: Callable[[int], dict[str, Any]]) -> list[Child]:
        script, impl, env = self._child()
        prefix, env = self._counting(env)
        frontends = []
        for f in range(self.scenario.frontends):
            arguments = _child_arguments(
                self.args,
                self.scenario,
                impl,
                "frontend",
                **(self.frontend_extra(f) | extra(f)),
            )
            frontends.append(await Child.spawn(f"frontend {f}", script, arguments, env, prefix))
            self.children.append(frontends[-1])
        return frontends

    async def spawn_engine(self, **extra: Any) -> Child:
        script, impl, env = self._child()
        prefix, env = self._counting(env)
        arguments = _child_arguments(
            self.args, self.scenario, impl, "engine", **(self.engine_extra | extra)
        )
        engine = await Child.spawn("engine", script, arguments, env, prefix)
        self.children.append(engine)
        return engine


Started = tuple[Child, list[Child], dict[str, Any]]
"""A started run: the engine, the frontends, and the engine's ``attached`` report."""


class Arm(ABC):
    """One implementation of the workload, behind the interface the benchmark drives: how
    its frontend and engine children run (``frontend``, ``engine``), how the benchmark
    starts them and what they hand over (``start``), and which counters it reports and how
    the summary reads them (``figures``). Every arm runs the same Tally and StreamCheck.

    ``start`` here is the shape of every arm but gRPC: the frontends start first and each
    writes a handoff file (where it listens, who it is, its streams' indices); the engine
    reads them all and connects."""

    quic = True
    """Over QUIC, so it counts UDP datagrams and the impairment proxy applies; the TCP arms
    (gRPC, ZeroMQ) report datagrams as n/a."""

    def __init__(self, name: str) -> None:
        self.name = name

    def environment(self) -> dict[str, str]:
        """Variables set for this arm's children: the record path they run (compiled,
        unless the arm names the pure-Python twin), whatever the benchmark itself runs."""
        return {PURE_PYTHON_ENV: "0"}

    @abstractmethod
    async def frontend(
        self,
        args: argparse.Namespace,
        scenario: Scenario,
        stdin: asyncio.StreamReader,
        tally: Tally,
    ) -> None:
        """One frontend child: listen, hand over, say ``ready``, then the window."""

    @abstractmethod
    async def engine(
        self, args: argparse.Namespace, scenario: Scenario, stdin: asyncio.StreamReader
    ) -> None:
        """The engine child: connect, say ``attached``, then the window."""

    async def start(self, launch: Launch) -> Started:
        args, timeout = launch.args, launch.args.timeout
        frontends = await launch.spawn_frontends(lambda f: {"handoff": launch.handoffs[f]})
        await _all_of(frontends, "ready", [], "starting the frontends", timeout)
        if self.quic and (args.loss or args.delay_ms):
            for path in launch.handoffs:
                launch.proxies.append(await _impair(path, args, launch.number, timeout))
        engine = await launch.spawn_engine(handoff=launch.handoffs)
        attached = await watched(engine.expect("attached"), frontends, "attaching", timeout)
        return engine, frontends, attached

    def figures(
        self,
        scenario: Scenario,
        tokens: int,
        attached: dict[str, Any],
        engine: dict[str, float],
        frontends: list[dict[str, float]],
    ) -> dict[str, Any]:
        """The arm's own figures from the counters' deltas over the windows."""
        return {}


class NodeArm(Arm):
    """An arm of velomux_quic nodes: the frontends create anchors, the engine attaches to
    their handles; which transport must be negotiated, the engine's MuxConfig, and how a
    pass is handed over differ."""

    def __init__(
        self,
        name: str,
        transport_key: str,
        *,
        manual_flush: bool = False,
        whole_pass: bool = False,
        offer: list[str] | None = None,
        pure_python: bool = False,
        baseline_of: str | None = None,
    ) -> None:
        super().__init__(name)
        self.transport_key = transport_key
        self.manual_flush = manual_flush
        self.whole_pass = whole_pass
        self.offer = offer
        self.pure_python = pure_python
        self.baseline_of = baseline_of
        """The arm of that name in the ``--baseline-tree`` checkout, whose children this
        arm runs (the code before a change, measured in the same invocation)."""

    def environment(self) -> dict[str, str]:
        return {PURE_PYTHON_ENV: "1" if self.pure_python else "0"}

    @property
    def mux(self) -> bool:
        return self.transport_key == MESSENGER_MUX_KEY

    def engine_mux_config(self) -> MuxConfig:
        """The default, except where the engine flushes by hand (``Manual``)."""
        return MuxConfig(flush_policy=Manual()) if self.manual_flush else MuxConfig()

    async def frontend(
        self,
        args: argparse.Namespace,
        scenario: Scenario,
        stdin: asyncio.StreamReader,
        tally: Tally,
    ) -> None:
        credentials = NodeCredentials.load(args.credentials)
        transport = TransportConfig(
            lanes=args.lanes, max_datagram_size=args.datagram_size, engine=args.quic_engine
        )
        node = await Node.start(credentials, transport=transport)
        async with node:
            anchors = [node.create_anchor() for _ in tally.indices]
            readers = _start_readers(args.consumer, anchors, tally)
            handoff = {
                "instance_id": str(node.instance_id),
                "address": list(node.address),
                "indices": list(tally.indices),
                "handles": [anchor.handle.to_wire() for anchor in anchors],
            }
            _hand_over(args.handoff[0], handoff)
            say("ready")
            await _frontend_window(args, scenario, stdin, node, readers, tally)

    async def engine(
        self, args: argparse.Namespace, scenario: Scenario, stdin: asyncio.StreamReader
    ) -> None:
        mux = self.engine_mux_config()
        transport = TransportConfig(
            lanes=args.lanes, max_datagram_size=args.datagram_size, engine=args.quic_engine
        )
        credentials = NodeCredentials.load(args.credentials)
        node = await Node.start(credentials, transport=transport, mux=mux)
        async with node:
            handles: list[StreamAnchorHandle | None] = [None] * scenario.streams
            peers: list[InstanceId] = []
            for path in args.handoff:
                handoff = json.loads(path.read_text())
                peer = InstanceId.parse(handoff["instance_id"])
                host, port = handoff["address"]
                node.add_peer(peer, (host, int(port)))
                peers.append(peer)
                for index, wire in zip(handoff["indices"], handoff["handles"], strict=True):
                    handles[index] = StreamAnchorHandle.from_wire(wire)
            ordered = [handle for handle in handles if handle is not None]
            if len(ordered) != scenario.streams:
                raise BenchFailure("the frontends handed over fewer handles than streams")
            started = time.perf_counter()
            senders: list[StreamSender] = await asyncio.gather(
                *(node.anchors.attach_anchor(handle, offer=self.offer) for handle in ordered)
            )
            attach_s = time.perf_counter() - started
            transports = sorted({str(sender.negotiated_transport()) for sender in senders})
            if transports != [self.transport_key]:
                raise BenchFailure(f"attached over {transports}, not only {self.transport_key}")
            # The batcher's byte cap: the smallest of its three clamps, over the peers.
            byte_cap = min(
                min(mux.max_batch_bytes, COALESCE_THRESHOLD, node.messenger.eager_budget(peer))
                for peer in peers
            )
            say("attached", {"attach_s": attach_s, "transports": transports, "byte_cap": byte_cap})

            async def finish() -> None:
                retired = await asyncio.gather(*(sender.finalize() for sender in senders))
                outcomes = sorted({outcome.value for outcome in retired})
                if outcomes != [Retired.SENT.value]:
                    raise BenchFailure(f"streams retired as {outcomes}, expected only 'sent'")

            if self.whole_pass:
                one_pass = passing(node, senders)
            else:
                after_pass = node.flush_batch if self.manual_flush else None
                one_pass = emitting([sender.send for sender in senders], after_pass)
            await _engine_window(args, scenario, stdin, node, one_pass, finish)

    def figures(
        self,
        scenario: Scenario,
        tokens: int,
        attached: dict[str, Any],
        engine: dict[str, float],
        frontends: list[dict[str, float]],
    ) -> dict[str, Any]:
        result = _datagram_figures(engine, frontends, tokens) | {
            "engine_heartbeats_sent": engine["heartbeats_sent"],
            "engine_frames_written": engine["frames_written"],
            "frontends_watchdog_firings": sum(p["watchdog_firings"] for p in frontends),
        }
        if not self.mux:
            return result
        batches, records = engine["mux_batches_sent"], engine["mux_records_sent"]
        clamp = records_per_batch_clamp(attached["byte_cap"], token_record_bytes(stamped=True))
        per_write = records / batches if batches else 0.0
        return result | {
            "mux_byte_cap": attached["byte_cap"],
            "mux_records_clamp": clamp,
            "engine_mux_batches_sent": batches,
            "engine_mux_records_sent": records,
            "engine_mux_data_records_sent": engine["mux_data_records_sent"],
            "engine_mux_close_records_sent": engine["mux_close_records_sent"],
            "engine_records_per_write": per_write,
            "engine_records_per_write_of_clamp": per_write / clamp,
            "engine_writes_per_pass": batches / scenario.passes,
            "frontends_mux_credit_records_sent": sum(
                p["mux_credit_records_sent"] for p in frontends
            ),
        }


class GrpcArm(Arm):
    """grpc.aio (``velomux_quic/programs/demo/grpc_tokens.py``): the engine is the server and starts
    first; its port goes to every frontend, which opens one server-streaming RPC per stream."""

    quic = False

    async def frontend(
        self,
        args: argparse.Namespace,
        scenario: Scenario,
        stdin: asyncio.StreamReader,
        tally: Tally,
    ) -> None:
        from grpc import aio as grpc_aio

        from velomux_quic.programs.demo.grpc_tokens import TokenClient

        credentials = None if args.grpc_insecure else args.credentials
        client = await TokenClient.open(args.grpc_port, credentials, args.timeout)
        try:
            calls = [client.call(index) for index in tally.indices]
            if args.consumer != "single-task":
                readers = [
                    asyncio.create_task(read_call(call, check, tally))
                    for call, check in zip(calls, tally.checks, strict=True)
                ]
            else:
                readers = [asyncio.create_task(read_calls_in_turn(calls, tally, grpc_aio.EOF))]
            say("ready")
            await _frontend_window(args, scenario, stdin, None, readers, tally)
        finally:
            await client.close()

    async def engine(
        self, args: argparse.Namespace, scenario: Scenario, stdin: asyncio.StreamReader
    ) -> None:
        from velomux_quic.programs.demo.grpc_tokens import TokenServer

        server = TokenServer(scenario.streams, args.grpc_queue)
        try:
            port = await server.start(None if args.grpc_insecure else args.credentials)
            say("listening", {"port": port})
            attach_s = await server.wait_attached(args.timeout)
            say("attached", {"attach_s": attach_s, "transports": ["grpc"], "byte_cap": None})

            async def finish() -> None:
                await server.finish(args.timeout)

            one_pass = emitting(server.emitters(), None)
            await _engine_window(args, scenario, stdin, None, one_pass, finish)
        finally:
            await server.stop()

    async def start(self, launch: Launch) -> Started:
        timeout = launch.args.timeout
        engine = await launch.spawn_engine()
        listening = await watched(engine.expect("listening"), [], "starting", timeout)
        frontends = await launch.spawn_frontends(lambda f: {"grpc_port": listening["port"]})
        await _all_of(frontends, "ready", [engine], "opening the RPCs", timeout)
        attached = await watched(engine.expect("attached"), frontends, "attaching", timeout)
        return engine, frontends, attached


class BareArm(Arm):
    """Raw aioquic (``perf/bare_tokens.py``): one QUIC stream per frontend carrying every
    record of its streams; it counts its own datagrams and writes."""

    async def frontend(
        self,
        args: argparse.Namespace,
        scenario: Scenario,
        stdin: asyncio.StreamReader,
        tally: Tally,
    ) -> None:
        if args.quic_engine == "qh3":
            from bare_qh3_tokens import Qh3BareFrontend as BareFrontend
        else:
            from bare_tokens import BareFrontend

        credentials = NodeCredentials.load(args.credentials)
        bare = await BareFrontend.listen(
            credentials, tally.indices, scenario.streams, args.timeout, args.datagram_size
        )
        try:
            readers = _start_readers(args.consumer, bare.inboxes, tally)
            handoff = {
                "instance_id": str(credentials.instance_id),
                "address": list(bare.address),
                "indices": list(tally.indices),
            }
            _hand_over(args.handoff[0], handoff)
            say("ready")
            await _frontend_window(args, scenario, stdin, None, readers, tally, bare.counts)
        finally:
            await bare.close()

    async def engine(
        self, args: argparse.Namespace, scenario: Scenario, stdin: asyncio.StreamReader
    ) -> None:
        if args.quic_engine == "qh3":
            from bare_qh3_tokens import TRANSPORT
            from bare_qh3_tokens import Qh3BareEngine as BareEngine
        else:
            from bare_tokens import TRANSPORT, BareEngine

        handoffs = [json.loads(path.read_text()) for path in args.handoff]
        started = time.perf_counter()
        bare = await BareEngine.connect(
            args.credentials, handoffs, scenario.streams, args.timeout, args.datagram_size
        )
        try:
            attach_s = time.perf_counter() - started
            say("attached", {"attach_s": attach_s, "transports": [TRANSPORT], "byte_cap": None})
            await _engine_window(
                args, scenario, stdin, None, bare.pass_body(), bare.finish, bare.counts
            )
        finally:
            await bare.close()

    def figures(
        self,
        scenario: Scenario,
        tokens: int,
        attached: dict[str, Any],
        engine: dict[str, float],
        frontends: list[dict[str, float]],
    ) -> dict[str, Any]:
        # One send_stream_data per frontend per pass; send_waits counts the writes that
        # waited for acknowledgements (the bound on unacknowledged bytes).
        return _datagram_figures(engine, frontends, tokens) | _write_figures(
            engine, scenario.passes
        )


class ZmqArm(Arm):
    """pyzmq (``perf/zmq_tokens.py``): each frontend binds a PULL socket (a CURVE server
    admitting only the engine's key) and hands over its port and public key; the engine
    connects a PUSH socket (a CURVE client, its key pair written once per benchmark in the
    temporary directory) to each, one multipart message per pass per frontend. TCP: no
    datagram counts."""

    quic = False

    async def frontend(
        self,
        args: argparse.Namespace,
        scenario: Scenario,
        stdin: asyncio.StreamReader,
        tally: Tally,
    ) -> None:
        from zmq_tokens import ZmqFrontend

        frontend = await ZmqFrontend.listen(args.zmq_keys, tally.indices, scenario.streams)
        try:
            readers = _start_readers(args.consumer, frontend.inboxes, tally)
            handoff = {
                "port": frontend.port,
                "curve_public": frontend.curve_public,
                "indices": list(tally.indices),
            }
            _hand_over(args.handoff[0], handoff)
            say("ready")
            await _frontend_window(args, scenario, stdin, None, readers, tally, frontend.counts)
        finally:
            await frontend.close()

    async def engine(
        self, args: argparse.Namespace, scenario: Scenario, stdin: asyncio.StreamReader
    ) -> None:
        from zmq_tokens import TRANSPORT, ZmqEngine

        handoffs = [json.loads(path.read_text()) for path in args.handoff]
        started = time.perf_counter()
        engine = await ZmqEngine.connect(args.zmq_keys, handoffs, scenario.streams, args.timeout)
        try:
            attach_s = time.perf_counter() - started
            say("attached", {"attach_s": attach_s, "transports": [TRANSPORT], "byte_cap": None})
            await _engine_window(
                args, scenario, stdin, None, engine.pass_body(), engine.finish, engine.counts
            )
        finally:
            await engine.close()

    async def start(self, launch: Launch) -> Started:
        from zmq_tokens import write_engine_keys

        # The engine's key pair, once per run in the run's temporary directory: the
        # frontends admit the public half in it, the engine signs with the secret half.
        # --zmq-unknown-engine-key gives the engine a second pair no frontend admits.
        admitted = launch.workdir / f"zmq-keys-{launch.tag}"
        write_engine_keys(admitted)
        engine_keys = admitted
        if launch.args.zmq_unknown_engine_key:
            engine_keys = launch.workdir / f"zmq-keys-{launch.tag}-unknown"
            write_engine_keys(engine_keys)
        launch.engine_extra = launch.engine_extra | {"zmq_keys": engine_keys}
        launch.frontend_extra = _with(launch.frontend_extra, {"zmq_keys": admitted})
        return await super().start(launch)

    def figures(
        self,
        scenario: Scenario,
        tokens: int,
        attached: dict[str, Any],
        engine: dict[str, float],
        frontends: list[dict[str, float]],
    ) -> dict[str, Any]:
        # recv_again: reads that woke to no message and were retried (pyzmq's asyncio).
        again = sum(p["recv_again"] for p in frontends)
        figures = {"engine_send_waits": engine["send_waits"], "frontends_recv_again": again}
        return figures | _write_figures(engine, scenario.passes)


def _with(
    extra: Callable[[int], dict[str, Any]], more: dict[str, Any]
) -> Callable[[int], dict[str, Any]]:
    return lambda f: extra(f) | more


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        NodeArm("mux-auto", MESSENGER_MUX_KEY),
        NodeArm("mux-manual", MESSENGER_MUX_KEY, manual_flush=True),
        NodeArm("mux-pass", MESSENGER_MUX_KEY, whole_pass=True),
        NodeArm("mux-auto-pure", MESSENGER_MUX_KEY, pure_python=True),
        NodeArm("mux-pass-pure", MESSENGER_MUX_KEY, whole_pass=True, pure_python=True),
        NodeArm("mux-auto-base", MESSENGER_MUX_KEY, baseline_of="mux-auto"),
        NodeArm("mux-pass-base", MESSENGER_MUX_KEY, whole_pass=True, baseline_of="mux-pass"),
        NodeArm(
            "mux-auto-pure-base", MESSENGER_MUX_KEY, pure_python=True, baseline_of="mux-auto-pure"
        ),
        # per-stream offers only the per-stream path, so the attach settles on it whatever
        # else the nodes could negotiate; the mux arms offer the default set.
        NodeArm("per-stream", PER_STREAM_KEY, offer=[PER_STREAM_KEY]),
        GrpcArm("grpc"),
        BareArm("bare"),
        ZmqArm("zmq"),
    )
}
"""Every implementation by its ``--impl`` name, in the report's order."""
IMPLS = tuple(ARMS)
BASELINE_IMPLS = ("mux-auto-base", "mux-pass-base", "mux-auto-pure-base")
"""Arms that run another checkout's code (``--baseline-tree``); never in the default set."""
MUX_IMPLS = tuple(name for name, arm in ARMS.items() if isinstance(arm, NodeArm) and arm.mux)
QUIC_IMPLS = tuple(name for name, arm in ARMS.items() if isinstance(arm, NodeArm | BareArm))
"""The arms that run on a QUIC engine: each runs once per ``--engine``."""
ENGINES = ("aioquic", "qh3")


def split_label(label: str) -> tuple[str, str | None]:
    """``mux-auto@qh3`` -> (``mux-auto``, ``qh3``); an arm run on one engine only, or on
    none (grpc, zmq), is labelled by its name alone."""
    name, _, engine = label.partition("@")
    return name, engine or None


def labels_of(impls: Sequence[str], engines: Sequence[str]) -> list[str]:
    """Every (arm, engine) the run covers, in the report's order: a QUIC arm once per
    engine (labelled ``arm@engine`` when there are several, or the one is not aioquic)."""
    labels: list[str] = []
    for impl in impls:
        if impl in QUIC_IMPLS and list(engines) != ["aioquic"]:
            labels += [f"{impl}@{engine}" for engine in engines]
        else:
            labels.append(impl)
    return labels


# -- the orchestrator --------------------------------------------------------------------


class Spy:
    """``py-spy record`` attached to one child for the measured window (a flame graph by
    default). Run from outside, so the child runs unmodified; ``--nonblocking`` samples
    without pausing it, at the price of an occasional torn stack."""

    def __init__(self, process: asyncio.subprocess.Process, out: Path) -> None:
        self.process = process
        self.out = out

    SUFFIXES = {"flamegraph": ".svg", "raw": ".txt", "speedscope": ".json"}
    """py-spy's output formats: an SVG flame graph, collapsed stacks (one line per stack
    with its sample count, for grep and scripts), or a speedscope profile."""

    @classmethod
    async def attach(cls, pid: int, out: Path, format_: str) -> Spy:
        found = Path(sys.executable).with_name("py-spy")
        executable = str(found) if found.exists() else shutil.which("py-spy")
        if executable is None:
            raise BenchFailure("--profiler py-spy needs py-spy (pip install py-spy)")
        process = await asyncio.create_subprocess_exec(
            executable, "record", "--pid", str(pid), "--output", str(out),
            "--format", format_, "--rate", "250",
            # Native frames (the compiled record path, C extensions) need the process
            # paused per sample; without them py-spy samples without pausing it.
            *(["--native"] if os.environ.get("VELOMUX_PROFILE_NATIVE") else ["--nonblocking"]),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        spy = cls(process, out)
        # py-spy takes a moment to find the interpreter; sampling a child that has not
        # started its window yet costs nothing (it is idle), missing the window's start would.
        await asyncio.sleep(1.0)
        if process.returncode is not None:
            _, err = await process.communicate()
            raise BenchFailure(f"py-spy could not attach: {err.decode(errors='replace')[-300:]}")
        return spy

    async def stop(self, timeout: float = 20.0) -> str:
        """Stop sampling (SIGINT makes py-spy write the graph); what happened."""
        process = self.process
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
        try:
            _, err = await asyncio.wait_for(process.communicate(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            return f"py-spy did not stop within {timeout:g} s; no profile"
        if not self.out.exists():
            return f"py-spy wrote no profile: {err.decode(errors='replace')[-300:]}"
        return f"py-spy profile in {self.out}"

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


def _child_arguments(
    args: argparse.Namespace, scenario: Scenario, impl: str, role: str, **extra: Any
) -> list[str]:
    name, engine = split_label(impl)
    arguments = [
        "--role", role,
        "--impl", name,
        "--quic-engine", engine or "aioquic",
        "--streams", str(scenario.streams),
        "--frontends", str(scenario.frontends),
        "--mode", scenario.mode,
        "--passes", str(scenario.passes),
        "--pace-ms", str(scenario.pace_ms),
        "--consumer", args.consumer,
        "--lanes", str(args.lanes),
        "--timeout", str(args.timeout),
        "--grpc-queue", str(args.grpc_queue),
    ]  # fmt: skip
    if args.grpc_insecure:
        arguments.append("--grpc-insecure")
    if args.datagram_size is not None:
        arguments += ["--datagram-size", str(args.datagram_size)]
    if args.profile == role and args.profiler == "cprofile":
        arguments += ["--profile", role]
    for key, value in extra.items():
        for one in value if isinstance(value, list) else [value]:
            arguments += [f"--{key.replace('_', '-')}", str(one)]
    return arguments


async def _all_of(
    children: Sequence[Child], word: str, others: Sequence[Child], what: str, timeout: float
) -> list[dict[str, Any]]:
    """Every child's ``word``, read concurrently (so a failing one is heard at once), while
    watching ``others`` for deaths; the first failure fails the run."""

    async def gather() -> list[dict[str, Any]]:
        tasks = [asyncio.ensure_future(child.expect(word)) for child in children]
        try:
            for next_done in asyncio.as_completed(tasks):
                await next_done
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    return await watched(gather(), others, what, timeout)


async def one_run(
    args: argparse.Namespace,
    scenario: Scenario,
    impl: str,
    number: int,
    nodes: dict[str, Path],
    workdir: Path,
) -> dict[str, Any]:
    """One run of one implementation in fresh processes; its summary (or BenchFailure)."""
    tag = f"{scenario.name}-{impl}-{number}"
    timeout = args.timeout
    children: list[Child] = []
    spy: Spy | None = None
    profile_note = ""
    handoffs = [workdir / f"handoff-{tag}-{f}.json" for f in range(scenario.frontends)]
    latencies = [workdir / f"latency-{tag}-{f}.bin" for f in range(scenario.frontends)]
    profile_out = args.profile_dir / f"tokens-{tag}-{args.profile}"

    def frontend_extra(f: int) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "index": f,
            "credentials": nodes[f"frontend-{f}"],
            "latency_out": latencies[f],
        }
        if args.profile == "frontend" and args.profiler == "cprofile" and f == 0:
            extra["profile_out"] = profile_out.with_suffix(".prof")
        return extra

    engine_extra: dict[str, Any] = {"credentials": nodes["engine"]}
    proxies: list[asyncio.subprocess.Process] = []
    if args.profile == "engine" and args.profiler == "cprofile":
        engine_extra["profile_out"] = profile_out.with_suffix(".prof")
    try:
        launch = Launch(
            args, scenario, impl, number, tag, workdir, handoffs, frontend_extra,
            engine_extra, children, proxies,
        )  # fmt: skip
        engine, frontends, attached = await ARMS[split_label(impl)[0]].start(launch)
        if args.profile is not None and args.profiler == "py-spy":
            target = engine if args.profile == "engine" else frontends[0]
            out = profile_out.with_suffix(Spy.SUFFIXES[args.profile_format])
            spy = await Spy.attach(target.pid, out, args.profile_format)
        for frontend in frontends:
            frontend.send("go")
        armed = await _all_of(frontends, "armed", [engine], "arming the frontends", timeout)
        engine.send("go")
        # Generous: each child enforces its own timeout and explains what is stuck.
        streaming = 2 * timeout + scenario.passes * scenario.pace_s
        received = await _all_of(frontends, "result", [engine], "streaming", streaming)
        engine.send("done")
        sent = await watched(engine.expect("result"), frontends, "the engine's report", timeout)
        if spy is not None:
            profile_note = await spy.stop()
            spy = None
            print(f"{tag}: {profile_note}", file=sys.stderr, flush=True)
        for child in children:
            child.send("exit")
        for child in children:
            code = await child.finish(timeout)
            if code != 0:
                raise BenchFailure(f"the {child.name} exited with code {code} after its report")
        result = summarise(scenario, impl, attached, sent, armed, received, latencies)
    finally:
        if spy is not None:
            spy.kill()
            await spy.process.wait()
        for child in children:
            child.kill()
        for proxy in proxies:
            if proxy.returncode is None:
                proxy.kill()
        for child in children:
            await child.process.wait()
        for proxy in proxies:
            await proxy.wait()
        for path in (*handoffs, *latencies):
            path.unlink(missing_ok=True)
    if profile_note:
        result["profile"] = profile_note
    return result


async def _impair(
    handoff: Path, args: argparse.Namespace, seed: int, timeout: float
) -> asyncio.subprocess.Process:
    """Start the impairment proxy (velomux_quic/programs/demo/proxy.py, a process of its own so it
    takes no CPU from the arms) in front of one frontend, and point the engine at it. The
    frontend learns the engine's return address from the proxied connection, so both
    directions cross it."""
    data = json.loads(handoff.read_text())
    host, port = data["address"]
    proxy = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "velomux_quic.programs.demo.proxy", "--target", f"{host}:{port}",
        "--loss", str(args.loss), "--delay-ms", str(args.delay_ms), "--seed", str(seed),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, cwd=SCRIPT.parent.parent,
    )  # fmt: skip
    try:
        assert proxy.stdout is not None
        where = json.loads(await asyncio.wait_for(proxy.stdout.readline(), timeout))
    except BaseException:
        proxy.kill()
        await proxy.wait()
        raise
    data["address"] = [where["host"], where["port"]]
    handoff.write_text(json.dumps(data))
    return proxy


LATENCY_HEADER = "<4Q"
"""A frontend's latency file: the counts of its four arrays (see ``Tally.write``)."""

OLDER_LATENCY_HEADER = "<3Q"
"""The same without the last pass's array, as a ``--baseline-tree`` from before it writes."""


def _read_latencies(
    paths: Sequence[Path],
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The frontends' latency arrays, merged: first tokens, later tokens, receive gaps,
    the last pass's later tokens."""
    merged: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    for path in paths:
        data = path.read_bytes()
        header = LATENCY_HEADER
        older = struct.unpack_from(OLDER_LATENCY_HEADER, data)
        if struct.calcsize(OLDER_LATENCY_HEADER) + 8 * sum(older) == len(data):
            header = OLDER_LATENCY_HEADER
        counts = struct.unpack_from(header, data)
        offset = struct.calcsize(header)
        for target, count in zip(merged, counts, strict=False):
            values = array("q")
            values.frombytes(data[offset : offset + 8 * count])
            target.extend(values)
            offset += 8 * count
    return merged


def _percentile(ordered: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of sorted ``ordered`` (ns), in milliseconds."""
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1] / 1e6


def _latency_figures(name: str, values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        f"{name}_p50_ms": _percentile(ordered, 0.50),
        f"{name}_p99_ms": _percentile(ordered, 0.99),
        f"{name}_max_ms": ordered[-1] / 1e6,
    }


def summarise(
    scenario: Scenario,
    impl: str,
    attached: dict[str, Any],
    sent: dict[str, Any],
    armed: list[dict[str, Any]],
    received: list[dict[str, Any]],
    latencies: Sequence[Path],
) -> dict[str, Any]:
    """One run's figures from the children's reports; a short count fails it."""
    expected = scenario.streams * scenario.passes
    tokens = sum(int(part["tokens"]) for part in received)
    ended = sum(int(part["streams_ended"]) for part in received)
    if tokens != expected or ended != scenario.streams:
        raise BenchFailure(
            f"{tokens} tokens and {ended} ended streams delivered, expected {expected} and "
            f"{scenario.streams}"
        )
    name = split_label(impl)[0]
    wanted = "pure-python" if ARMS[name].environment()[PURE_PYTHON_ENV] == "1" else "compiled"
    paths = {sent.get("record_path"), *(part.get("record_path") for part in received)}
    if name in BASELINE_IMPLS and wanted == "compiled":
        # The other tree's default, whichever it is: none before the record path existed
        # (reported as "baseline"), compiled since; never a mix.
        wanted = "compiled" if paths == {"compiled"} else "baseline"
        paths = {"baseline"} if paths == {None} else paths
    if paths != {wanted}:
        raise BenchFailure(
            f"the children ran the record path {sorted(map(str, paths))}, not {wanted}"
        )
    clocks = [sent["clock"], *(part["clock"] for part in received)]
    shared = all("CLOCK_MONOTONIC" in clock for clock in clocks)
    start = sent["first_send_at"] if shared else min(part["at"] for part in armed)
    last = max(part["last_token_at"] for part in received)
    e2e = last - start
    cpu_engine = sent["cpu_user_s"] + sent["cpu_sys_s"]
    cpu_frontends = sum(part["cpu_user_s"] + part["cpu_sys_s"] for part in received)
    result: dict[str, Any] = {
        "impl": impl,
        "transport": attached["transports"][0],
        "tokens": tokens,
        "expected_tokens": expected,
        "attach_s": attached["attach_s"],
        "send_s": sent["passes_done_at"] - sent["first_send_at"],
        "retire_s": sent["retired_at"] - sent["first_send_at"],
        "e2e_s": e2e,
        "e2e_shared_clock": shared,
        "tokens_per_s": tokens / e2e,
        "engine_cpu_s": cpu_engine,
        "engine_cpu_sys_s": sent["cpu_sys_s"],
        "engine_cpu_us_per_token": 1e6 * cpu_engine / tokens,
        "frontends_cpu_s": cpu_frontends,
        "frontends_cpu_sys_s": sum(part["cpu_sys_s"] for part in received),
        "frontends_cpu_us_per_token": 1e6 * cpu_frontends / tokens,
        "total_cpu_us_per_token": 1e6 * (cpu_engine + cpu_frontends) / tokens,
        "late_passes": sent["late_passes"],
        "worst_late_ms": sent["worst_late_ms"],
        "mean_pass_interval_ms": sent["mean_pass_interval_ms"],
        "engine_loop": sent["loop"],
        "record_path": "baseline" if name in BASELINE_IMPLS else sent.get("record_path"),
        "engine_gc_pause_max_ms": sent.get("gc_pause_max_ms"),
        "engine_gc_pause_total_ms": sent.get("gc_pause_total_ms"),
        "engine_gc_collections": sent.get("gc_collections"),
        "frontends_gc_pause_max_ms": max(part.get("gc_pause_max_ms", 0.0) for part in received),
        "frontends_gc_pause_total_ms": sum(part.get("gc_pause_total_ms", 0.0) for part in received),
        "frontends_gc_collections": [
            sum(part.get("gc_collections", [0, 0, 0])[g] for part in received) for g in range(3)
        ],
        "frontend_loop": received[0]["loop"],
    }
    if "instructions" in sent and all("instructions" in part for part in received):
        engine_ir = sent["instructions"]
        frontends_ir = sum(part["instructions"] for part in received)
        result |= {
            "engine_instructions_per_token": engine_ir / tokens,
            "frontends_instructions_per_token": frontends_ir / tokens,
            "total_instructions_per_token": (engine_ir + frontends_ir) / tokens,
        }
    first, later, gaps, last = _read_latencies(latencies) if shared else ([], [], [], [])
    result |= _latency_figures("first_token", first)
    result |= _latency_figures("later_tokens", later)
    result |= _latency_figures("receive_gap", gaps)
    result |= _latency_figures("last_pass", last)
    before_last = list((Counter(later) - Counter(last)).elements())
    result |= _latency_figures("later_before_last_pass", before_last)
    engine = sent.get("counters", {})
    parts = [part.get("counters", {}) for part in received]
    return result | ARMS[split_label(impl)[0]].figures(scenario, tokens, attached, engine, parts)


# -- the report --------------------------------------------------------------------------

Runs = dict[str, list[dict[str, Any]]]


def _figure(median: dict[str, float], key: str, fmt: str) -> str:
    return format(median[key], fmt) if key in median else "n/a"


def _range(runs: list[dict[str, Any]], key: str, fmt: str) -> str:
    """The median of the successful runs, with [min-max] when there are several."""
    values = [run[key] for run in ok_runs(runs) if key in run]
    if not values:
        return "—"
    median = format(statistics.median(values), fmt)
    if len(values) == 1:
        return median
    return f"{median} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def _pair(median: dict[str, float], name: str) -> str:
    if f"{name}_p50_ms" not in median:
        return "n/a"
    return f"{median[f'{name}_p50_ms']:.2f} / {median[f'{name}_p99_ms']:.2f}"


def _last_pass(median: dict[str, float]) -> str:
    if "last_pass_p50_ms" not in median:
        return "n/a"
    return (
        f"{median['last_pass_p50_ms']:.2f} / {median['last_pass_max_ms']:.2f} "
        f"({_figure(median, 'later_before_last_pass_p99_ms', '.2f')})"
    )


def _late(median: dict[str, float]) -> str:
    return f"{median['late_passes']:.0f} ({median['mean_pass_interval_ms']:.1f})"


def scenario_table(scenario: Scenario, impls: Sequence[str], runs: Runs) -> str:
    """Per implementation: how many runs succeeded, then the medians."""
    header = [
        "impl",
        "ok runs",
        "tokens/s median [min-max]",
        "engine µs/token",
        "frontends µs/token",
        "records/write (of clamp)",
        "datagrams/token engine out, frontends out",
    ]
    if scenario.paced:
        header += [
            "first token p50 / p99 ms",
            "later tokens p50 / p99 ms",
            "last pass p50 / max ms (later p99 before it)",
            "receive gap p99 ms",
            "late passes (mean ms between starts)",
        ]
    counted = any("engine_instructions_per_token" in run for i in impls for run in runs[i])
    if counted:
        header.append("instructions/token engine, frontends")
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for impl in impls:
        impl_runs = runs[impl]
        median = median_of(impl_runs)
        records = "n/a"
        if "engine_records_per_write_of_clamp" in median:
            of_clamp = median["engine_records_per_write_of_clamp"]
            records = f"{median['engine_records_per_write']:.1f} ({of_clamp:.2f})"
        elif "engine_records_per_write" in median:  # bare: no batch clamp
            records = f"{median['engine_records_per_write']:.1f}"
        datagrams = "n/a"
        if "engine_datagrams_out_per_token" in median:
            datagrams = (
                f"{median['engine_datagrams_out_per_token']:.3f}, "
                f"{median['frontends_datagrams_out_per_token']:.3f}"
            )
        if not median:
            records = datagrams = "—"
        cells = [
            impl,
            f"{len(ok_runs(impl_runs))}/{len(impl_runs)}",
            _range(impl_runs, "tokens_per_s", ",.0f"),
            _figure(median, "engine_cpu_us_per_token", ".1f") if median else "—",
            _figure(median, "frontends_cpu_us_per_token", ".1f") if median else "—",
            records,
            datagrams,
        ]
        if scenario.paced:
            cells += [
                _pair(median, "first_token") if median else "—",
                _pair(median, "later_tokens") if median else "—",
                _last_pass(median) if median else "—",
                _figure(median, "receive_gap_p99_ms", ".2f") if median else "—",
                _late(median) if median else "—",
            ]
        if counted:
            cells.append(
                f"{_figure(median, 'engine_instructions_per_token', ',.0f')}, "
                f"{_figure(median, 'frontends_instructions_per_token', ',.0f')}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


RATIO_METRICS: list[tuple[str, str, bool]] = [
    ("tokens_per_s", "tokens/s", True),
    ("engine_cpu_us_per_token", "engine CPU per token", False),
    ("frontends_cpu_us_per_token", "frontends CPU per token", False),
    ("total_cpu_us_per_token", "total CPU per token", False),
    ("engine_instructions_per_token", "engine instructions per token", False),
    ("frontends_instructions_per_token", "frontends instructions per token", False),
    ("total_instructions_per_token", "total instructions per token", False),
]
"""Compared across implementations; True where higher is better (ratio mux / other),
False where lower is better (ratio other / mux): either way above 1 favours the mux."""


def ratio(
    metric: str, higher: bool, mux: dict[str, float], other: dict[str, float]
) -> float | None:
    """The mux arm against another, oriented so that above 1 favours the mux; None when
    either has no successful run."""
    if not mux.get(metric) or not other.get(metric):
        return None
    return mux[metric] / other[metric] if higher else other[metric] / mux[metric]


def ratios(impls: Sequence[str], runs: Runs) -> dict[str, dict[str, float | None]]:
    """``{"mux-auto / grpc": {"tokens_per_s": 2.1, ...}, ...}`` for the impls present."""
    medians = {impl: median_of(runs[impl]) for impl in impls}
    found: dict[str, dict[str, float | None]] = {}

    def add(mux: str, other: str) -> None:
        found[f"{mux} / {other}"] = {
            metric: ratio(metric, higher, medians[mux], medians[other])
            for metric, _, higher in RATIO_METRICS
        }

    for base in BASELINES:
        for mux in MUX_IMPLS:
            for mux_label in impls:
                for base_label in impls:
                    (mux_name, mux_engine), (base_name, base_engine) = (
                        split_label(mux_label),
                        split_label(base_label),
                    )
                    if (mux_name, base_name) != (mux, base):
                        continue
                    if base_engine is None or base_engine == mux_engine:
                        add(mux_label, base_label)
    # The same arm on qh3 against aioquic (above 1 favours qh3).
    for label in impls:
        name, engine = split_label(label)
        if engine == "qh3" and f"{name}@aioquic" in impls and name in (*MUX_IMPLS, "bare"):
            add(label, f"{name}@aioquic")
    return found


def ratio_table(found: dict[str, dict[str, float | None]]) -> str:
    if not found:
        return ""
    pairs = list(found)
    lines = [
        "| median ratio (above 1 favours the mux arm) | " + " | ".join(pairs) + " |",
        "|---|" + "---:|" * len(pairs),
    ]
    for metric, title, higher in RATIO_METRICS:
        if "instructions" in metric and all(found[pair][metric] is None for pair in pairs):
            continue  # not counted (no --instructions)
        cells = [f"{title} ({'mux / other' if higher else 'other / mux'})"]
        for pair in pairs:
            value = found[pair][metric]
            cells.append("n/a" if value is None else f"{value:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def overview_table(scenarios: Sequence[Scenario], impls: Sequence[str], results: Runs) -> str:
    """Tokens/s and total CPU per token, one row per scenario: the sweep at a glance."""
    header = ["scenario", *(f"{impl} tokens/s, µs/token" for impl in impls)]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(impls)]
    for scenario in scenarios:
        cells = [scenario.name]
        for impl in impls:
            median = median_of(results[f"{scenario.name}/{impl}"])
            if not median:
                cells.append("FAILED")
            else:
                cells.append(
                    f"{median['tokens_per_s']:,.0f}, {median['total_cpu_us_per_token']:.1f}"
                )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _progress_line(tag: str, result: dict[str, Any]) -> str:
    if "failed" in result:
        return f"{tag}: FAILED: {result['failed']}"
    line = (
        f"{tag}: {result['tokens']:,} tokens, {result['tokens_per_s']:,.0f} tokens/s, "
        f"CPU µs/token {result['engine_cpu_us_per_token']:.1f} engine, "
        f"{result['frontends_cpu_us_per_token']:.1f} frontends"
    )
    if "engine_instructions_per_token" in result:
        line += (
            f", instructions/token {result['engine_instructions_per_token']:,.0f} engine, "
            f"{result['frontends_instructions_per_token']:,.0f} frontends"
        )
    if "engine_records_per_write" in result:
        line += f", {result['engine_records_per_write']:.1f} records/write"
    if result.get("engine_gc_pause_max_ms") is not None:
        line += (
            f", GC pauses max {result['engine_gc_pause_max_ms']:.1f} engine / "
            f"{result['frontends_gc_pause_max_ms']:.1f} frontends ms"
        )
    if "later_tokens_p50_ms" in result:
        line += (
            f", later tokens p50/p99 {result['later_tokens_p50_ms']:.2f}/"
            f"{result['later_tokens_p99_ms']:.2f} ms"
        )
    return line


def scenarios_of(args: argparse.Namespace) -> list[Scenario]:
    sweep = [
        Scenario(streams, frontends, mode, args.passes, args.pace_ms)
        for streams in args.streams
        for frontends in args.frontends
        for mode in args.mode
        if frontends <= streams
    ]
    single = Scenario(1, 1, "paced", args.single_stream_passes, args.pace_ms, single_stream=True)
    if args.single_stream:
        return [single]
    if args.skip_single_stream or "paced" not in args.mode:
        return sweep
    return [*sweep, single]


def _environment(results: Runs) -> dict[str, Any]:
    loops = sorted({run["engine_loop"] for runs in results.values() for run in ok_runs(runs)})
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loop": ", ".join(loops) or "unknown",
        "aioquic": package_version("aioquic"),
        "qh3": package_version("qh3"),
        "grpcio": package_version("grpcio"),
        "uvloop": package_version("uvloop"),
        "msgpack": package_version("msgpack"),
        "velomux_quic": package_version("velomux_quic"),
    }


def _document(
    args: argparse.Namespace, scenarios: Sequence[Scenario], impls: Sequence[str], results: Runs
) -> dict[str, Any]:
    return {
        "benchmark": "tokens",
        "config": {
            "impls": list(impls),
            "runs": args.runs,
            "consumer": args.consumer,
            "lanes": args.lanes,
            "datagram_size": args.datagram_size or "per path",
            "pace_ms": args.pace_ms,
            "token_bytes": TOKEN_BYTES,
            "token_record_bytes": token_record_bytes(stamped=True),
            "grpc_tls": not args.grpc_insecure,
            "grpc_queue_tokens": args.grpc_queue,
            "profile": args.profile and f"{args.profile} ({args.profiler})",
        },
        "environment": _environment(results),
        "scenarios": [
            {
                "name": scenario.name,
                "streams": scenario.streams,
                "frontends": scenario.frontends,
                "mode": scenario.mode,
                "passes": scenario.passes,
                "pace_ms": scenario.pace_ms if scenario.paced else None,
                "runs": {impl: results[f"{scenario.name}/{impl}"] for impl in impls},
                "median": {impl: median_of(results[f"{scenario.name}/{impl}"]) for impl in impls},
                "ratios": ratios(
                    impls, {impl: results[f"{scenario.name}/{impl}"] for impl in impls}
                ),
            }
            for scenario in scenarios
            if all(f"{scenario.name}/{impl}" in results for impl in impls)
        ],
    }


async def orchestrate(args: argparse.Namespace) -> int:
    # SIGTERM cancels the benchmark like Ctrl-C does, so every run's cleanup kills its
    # children instead of leaving them to their own timeouts.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    impls: list[str] = labels_of(args.impl, args.engine)
    scenarios = scenarios_of(args)
    if args.profile is not None:
        try:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BenchFailure(f"--profile-dir {args.profile_dir}: {exc}") from None
    frontends = max(scenario.frontends for scenario in scenarios)
    results: Runs = {}
    print(
        f"tokens: {', '.join(impls)}; {len(scenarios)} scenario(s), {args.runs} run(s) per "
        f"implementation, interleaved; consumer {args.consumer}, lanes {args.lanes}, gRPC "
        f"{'plaintext' if args.grpc_insecure else 'TLS with client certificates'}",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="tokens-bench-") as tmp:
        workdir = Path(tmp)
        names = ("engine", *(f"frontend-{f}" for f in range(frontends)))
        nodes = ensure_dev_cluster(workdir / "certs", names)
        for scenario in scenarios:
            runs: Runs = {impl: [] for impl in impls}
            for impl in impls:
                results[f"{scenario.name}/{impl}"] = runs[impl]
            for number in range(args.runs):
                for impl in impls:
                    tag = f"{scenario.name} {impl} run {number + 1}/{args.runs}"
                    busy = await busy_before(tag)
                    try:
                        result = await one_run(args, scenario, impl, number + 1, nodes, workdir)
                    except BenchFailure as exc:
                        result = {"impl": impl, "failed": str(exc)}
                    result["run"] = number + 1
                    result["other_cpu_busy_before"] = busy
                    runs[impl].append(result)
                    print(_progress_line(tag, result), file=sys.stderr, flush=True)
            if args.json is not None:
                document = _document(args, scenarios, impls, results)
                args.json.write_text(json.dumps(document, indent=2) + "\n")
    environment = _environment(results)
    print(
        f"# tokens: {', '.join(impls)}, {args.runs} run{'s' if args.runs > 1 else ''} per "
        f"implementation{' (interleaved)' if len(impls) > 1 else ''}\n\n"
        f"One {TOKEN_BYTES}-byte token per stream per pass, consumer {args.consumer}, lanes "
        f"{args.lanes}, datagrams {args.datagram_size or 'per path'}"
        + (
            f", QUIC through the impairment proxy ({args.loss:.1%} loss, "
            f"{args.delay_ms:g} ms delay each way)"
            if args.loss or args.delay_ms
            else ""
        )
        + f"; gRPC {'plaintext' if args.grpc_insecure else 'TLS with client certificates'}, "
        f"the QUIC arms mutual TLS. {environment['loop']}, {environment['cpus']} CPUs, Python "
        f"{environment['python']}, aioquic {environment['aioquic']}, qh3 {environment['qh3']}, "
        f"grpcio {environment['grpcio']}"
        + (f"; {args.profile} under {args.profiler} (figures disturbed)" if args.profile else "")
    )
    failures: list[str] = []
    for scenario in scenarios:
        runs = {impl: results[f"{scenario.name}/{impl}"] for impl in impls}
        print(f"\n## {scenario.name}: {scenario.title()}\n")
        print(scenario_table(scenario, impls, runs))
        table = ratio_table(ratios(impls, runs))
        if table:
            print()
            print(table)
        for impl in impls:
            for run_ in runs[impl]:
                if "failed" in run_:
                    failures.append(f"{scenario.name} {impl} run {run_['run']}: {run_['failed']}")
    if len(scenarios) > 1:
        print("\n## overview (medians)\n")
        print(overview_table(scenarios, impls, results))
    if failures:
        print("\nFAILED runs:\n")
        print("\n".join(f"* {failure}" for failure in failures))
    if args.json is not None:
        args.json.write_text(
            json.dumps(_document(args, scenarios, impls, results), indent=2) + "\n"
        )
    return 2 if failures else 0


# -- the command line --------------------------------------------------------------------


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--impl",
        nargs="+",
        choices=IMPLS,
        default=[impl for impl in IMPLS if impl not in BASELINE_IMPLS],
        help="implementations (all but the baseline arms)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="a checkout of the code before a change (its perf/tokens.py and velomux_quic): "
        "the mux-auto-base, mux-pass-base and mux-auto-pure-base arms run their children from "
        "it, beside the other arms of the same invocation",
    )
    parser.add_argument(
        "--engine",
        nargs="+",
        choices=ENGINES,
        default=["aioquic"],
        help="QUIC engines: each QUIC arm (mux, per-stream, bare) runs on each, interleaved"
        " (aioquic)",
    )
    parser.add_argument(
        "--streams", nargs="+", type=int, help="streams X, a list sweeps (256 1024; short 256)"
    )
    parser.add_argument(
        "--frontends",
        nargs="+",
        type=int,
        help="frontend processes Y, a list sweeps (1 4; short 1)",
    )
    parser.add_argument("--mode", nargs="+", choices=MODES, help="max-rate and/or paced (both)")
    parser.add_argument("--passes", type=int, help="forward passes per run (100; short 30)")
    parser.add_argument(
        "--pace-ms", type=float, default=10.0, help="paced: ms between pass starts (10)"
    )
    parser.add_argument("--runs", type=int, help="runs per implementation (3; short 1)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="run every child under valgrind's callgrind, instrumented only in its measured "
        "window, and report the instructions per token (a figure the machine's load does "
        "not move; the children run tens of times slower: few passes, a long --timeout)",
    )
    parser.add_argument(
        "--consumer", choices=CONSUMERS, default="task-per-stream", help="frontend shape"
    )
    parser.add_argument(
        "--lanes", type=int, default=1, help="TransportConfig(lanes=N) on every QUIC node (1)"
    )
    parser.add_argument(
        "--datagram-size",
        type=int,
        help="QUIC arms: pin every node's (and the bare arm's) datagram size to N bytes "
        "(default: per path, 16384 on loopback)",
    )
    parser.add_argument(
        "--loss",
        type=float,
        default=0.0,
        help="QUIC arms: put the impairment proxy (its own process) in front of each "
        "frontend and drop this fraction of datagrams each way (0)",
    )
    parser.add_argument(
        "--delay-ms", type=float, default=0.0, help="QUIC arms: the proxy's one-way delay (0)"
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help="256 streams x 30 passes to 1 frontend, max-rate and paced, then single-stream, "
        "1 run each (about a minute)",
    )
    single = parser.add_mutually_exclusive_group()
    single.add_argument(
        "--single-stream", action="store_true", help="run only the single-stream scenario"
    )
    single.add_argument(
        "--skip-single-stream",
        action="store_true",
        help="run the sweep without it (a sweep without the paced mode never runs it)",
    )
    parser.add_argument(
        "--single-stream-passes", type=int, help="passes of the single stream (200; short 100)"
    )
    parser.add_argument("--json", type=Path, help="also write every run and summary here")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="longest wait for any one step (s, 120)"
    )
    parser.add_argument(
        "--profile",
        choices=("engine", "frontend"),
        help="profile that side (the first frontend) in every run",
    )
    parser.add_argument(
        "--profiler",
        choices=("py-spy", "cprofile"),
        default="py-spy",
        help="py-spy: a flame graph (.svg); cprofile: a .prof dump and the top functions on "
        "stderr; either in --profile-dir as tokens-<scenario>-<impl>-<run>-<side>",
    )
    parser.add_argument(
        "--profile-format",
        choices=tuple(Spy.SUFFIXES),
        default="flamegraph",
        help="py-spy's output: flamegraph (.svg, default), raw collapsed stacks (.txt), "
        "speedscope (.json)",
    )
    parser.add_argument("--profile-dir", type=Path, default=RESULTS, help="(perf/results)")
    parser.add_argument(
        "--grpc-insecure", action="store_true", help="plaintext gRPC instead of mutual TLS"
    )
    parser.add_argument("--grpc-queue", type=int, default=1024, help=argparse.SUPPRESS)
    # A check of the zmq arm's authentication: its engine signs with a key no frontend knows.
    parser.add_argument("--zmq-unknown-engine-key", action="store_true", help=argparse.SUPPRESS)
    # The children's own arguments (the benchmark starts them with these).
    parser.add_argument("--role", choices=("engine", "frontend"), help=argparse.SUPPRESS)
    parser.add_argument("--quic-engine", choices=ENGINES, default="aioquic", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--credentials", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--handoff", type=Path, action="append", help=argparse.SUPPRESS)
    parser.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--latency-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--zmq-keys", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is not None:
        if len(args.impl) != 1:
            parser.error("a child runs one implementation")
        args.impl = args.impl[0]
        return args
    preset = PRESETS["short" if args.short else "full"]
    for key in ("streams", "frontends", "mode", "passes", "runs", "single_stream_passes"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    args.impl = list(dict.fromkeys(args.impl))
    args.engine = list(dict.fromkeys(args.engine))
    if min(args.streams) < 1 or min(args.frontends) < 1:
        parser.error("--streams and --frontends must be at least 1")
    if args.passes < 1 or args.runs < 1 or args.single_stream_passes < 1:
        parser.error("--passes, --runs and --single-stream-passes must be at least 1")
    if max(args.streams) * args.passes > UINT_LIMITS[-1]:
        parser.error("streams x passes must fit a u32 token id")
    if args.pace_ms <= 0 or args.timeout <= 0:
        parser.error("--pace-ms and --timeout must be positive")
    if not 1 <= args.lanes <= 16:
        parser.error("--lanes must be 1 to 16")
    if args.datagram_size is not None and not 1200 <= args.datagram_size <= 65000:
        parser.error("--datagram-size must be 1200 to 65000")
    if not args.single_stream and not any(y <= x for x in args.streams for y in args.frontends):
        parser.error("every scenario has more frontends than streams")
    return args


def _child(args: argparse.Namespace) -> int:
    main_ = engine_main if args.role == "engine" else frontend_main
    return run_child(main_(args))


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        if args.role is not None:
            return _child(args)
        return asyncio.run(orchestrate(args))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("tokens: interrupted; every child was killed", file=sys.stderr)
        return 130
    except BenchFailure as exc:
        who = f"{args.role}: " if args.role else ""
        print(f"tokens FAILED: {who}{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
