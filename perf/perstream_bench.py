"""Token streaming in the decode-engine shape, two processes, per transport.

A frontend (the consumer node) creates ``--streams`` anchors and hands their handles, its
instance id and its address to an engine (the producer node) in another process, through a
JSON file. The engine attaches a sender to each (concurrently), then runs ``--passes``
forward passes: each pass sends one 48-byte token to every stream, awaiting each send, and
calls ``Node.flush_batch()``; the engine finalizes every stream after the last pass. The two
nodes verify each other over mutual TLS with certificates made on demand in a temporary
directory. Every run uses fresh processes.

The arms (``--transport``):

* ``per-stream``: the engine offers only ``quic-stream-v1``, so the attach settles on the
  per-stream QUIC path whatever else the nodes support (the baseline);
* ``mux-auto``: both nodes with the default ``MuxConfig`` (``AutoFlush``); the attach
  negotiates ``messenger-mux-v2``;
* ``mux-manual``: the engine with ``MuxConfig(flush_policy=Manual())``, so its one
  ``flush_batch()`` per pass is the write; the frontend keeps the default;
* ``all`` (the default): the three, interleaved (run 1 of each arm, then run 2 of each,
  ...), so a burst of other load on the machine hits every arm alike. A failed run is
  reported as failed for its arm and the others go on.

Every sender's ``negotiated_transport()`` must be the arm's key, or the run fails.

    python perf/perstream_bench.py                       # 3 arms, 1,024 x 100, 3 runs each
    python perf/perstream_bench.py --short               # 3 arms, 256 x 30, 1 run each
    python perf/perstream_bench.py --transport mux-manual --runs 5
    python perf/perstream_bench.py --consumer single-task --json perstream.json
    python perf/perstream_bench.py --short --transport per-stream --profile consumer

Both children run on ``velomux_quic.runtime.run`` (uvloop when installed; set
``VELOMUX_NO_UVLOOP=1`` to measure plain asyncio).

What a run reports:

* tokens delivered, which must equal streams x passes: the consumer checks that every
  stream received exactly its own tokens, in order, and ended with ``Finalized``; any
  difference fails the run, and the benchmark exits non-zero if any run failed;
* windows on ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every process
  on the host): *send*, the producer's first send to its last pass; *retire*, its first
  send to every stream's terminal being admitted; *read*, the consumer's first token to its
  last; *e2e*, the producer's first send to the consumer's last token. Tokens/s is over
  e2e. Attaching (every sender concurrently) is timed apart and is in no window;
* CPU seconds (user + sys, ``getrusage(RUSAGE_SELF)`` deltas) on each side, and per token.
  The producer's CPU window runs from its first send until the consumer has confirmed every
  token, so it includes handling the consumer's acknowledgements; the consumer's from just
  before the first send until its last stream ended. Waiting costs no CPU;
* each node's own counters over the same windows: per-stream frames written
  (``velo_streaming_frames_written_total``, heartbeats and terminals included), UDP
  datagrams out and in (``velo_transport_datagrams_total``), sends that had to wait, and
  receivers whose reader fell behind (the last two only in the JSON);
* on the mux arms, records per wire write on the producer:
  ``velo_streaming_mux_records_total{direction="sent"}`` over
  ``velo_streaming_mux_batches_total{direction="sent"}``, against the most records of this
  token that fit one batch under the byte cap, ``floor((cap - 16) / (13 + record))`` with
  ``cap = min(max_batch_bytes, 64 KiB, the messenger's eager budget)``. Every record
  counts: tokens, heartbeats (ordinary data records under the mux), and each stream's
  terminal with its ``CloseSlot``.

The consumer shapes (``--consumer``): ``task-per-stream`` runs ``async for item in anchor``
in one task per anchor, as a frontend with a task per request does. ``single-task`` has
one task await ``anchor.take_ready()`` on each live anchor in turn. ``take_ready`` always
waits for at least one item and no call waits on several anchors at once, so this shape
works here only because every stream receives one token per pass: the task blocks on
the next anchor in the rotation whatever the others hold.

With ``--pass-delay-ms 0`` the engine still yields to the event loop once per pass
(``asyncio.sleep(0)``), as a real engine does while a forward pass runs: a send the
transport admits does not suspend, so without that yield nothing would be transmitted
before the last pass. ``Node.flush_batch()`` is called after every pass, as an engine does.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _harness import (
    TOKEN_BYTES,
    UINT_LIMITS,
    BenchFailure,
    Child,
    Window,
    busy_before,
    describe,
    expect_line,
    loop_environment,
    median_of,
    ok_runs,
    package_version,
    print_counters,
    profile_report,
    records_per_batch_clamp,
    say,
    stdin_reader,
    token_item,
    token_record_bytes,
    watched,
)

from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.mux.config import Manual, MuxConfig
from velomux_quic.mux.protocol import BATCH_HEADER_SIZE, COALESCE_THRESHOLD, RECORD_HEADER_SIZE
from velomux_quic.node import Node
from velomux_quic.runtime import run
from velomux_quic.security.certs import NodeCredentials, ensure_dev_cluster
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY
from velomux_quic.streaming.sender import Retired, StreamSender

SCRIPT = Path(__file__).resolve()
"""This file: the orchestrator starts each child as ``python SCRIPT --role ...``."""

SHORT = {"streams": 256, "passes": 30, "runs": 1}

ARMS = ("per-stream", "mux-auto", "mux-manual")
ARM_KEYS = {
    "per-stream": PER_STREAM_KEY,
    "mux-auto": MESSENGER_MUX_KEY,
    "mux-manual": MESSENGER_MUX_KEY,
}
"""The transport key every sender of an arm must have negotiated."""


def arm_mux_config(arm: str, role: str) -> MuxConfig:
    """The node's MuxConfig: the default, except the engine of ``mux-manual``."""
    if arm == "mux-manual" and role == "producer":
        return MuxConfig(flush_policy=Manual())
    return MuxConfig()


# -- the consumer (frontend) -------------------------------------------------------------


class Progress:
    """Per-stream counts and first/last token times, shared by the consumer's tasks."""

    __slots__ = ("counts", "ended", "first", "last")

    def __init__(self, streams: int) -> None:
        self.counts = [0] * streams
        self.first = [0.0] * streams
        self.last = [0.0] * streams
        self.ended = 0


def _wrong_token(index: int, position: int, item: Any, expected: int) -> BenchFailure:
    return BenchFailure(
        f"stream {index}: token #{position} is {item!r}, expected t={expected} "
        "(lost, duplicated, reordered or misrouted)"
    )


async def read_stream(
    anchor: StreamAnchor, index: int, streams: int, passes: int, progress: Progress
) -> None:
    """One task per anchor: ``async for``, checking every token."""
    clock = time.perf_counter
    last = progress.last
    expected = index
    count = 0
    try:
        async for item in anchor:
            if item["t"] != expected:
                raise _wrong_token(index, count, item, expected)
            last[index] = clock()
            if count == 0:
                progress.first[index] = last[index]
            count += 1
            expected += streams
    except Exception as exc:
        exc.add_note(_where(progress, index, count, passes))
        raise
    finally:
        progress.counts[index] = count
    if count != passes:
        raise BenchFailure(f"stream {index} ended after {count} of {passes} tokens")
    progress.ended += 1


async def read_round_robin(
    anchors: Sequence[StreamAnchor], streams: int, passes: int, progress: Progress
) -> None:
    """One task for every anchor: ``take_ready()`` on each live anchor in turn."""
    clock = time.perf_counter
    counts = progress.counts
    live = list(range(len(anchors)))
    while live:
        still: list[int] = []
        for index in live:
            count = counts[index]
            try:
                items = await anchors[index].take_ready()
            except StopAsyncIteration:
                if count != passes:
                    raise BenchFailure(
                        f"stream {index} ended after {count} of {passes} tokens"
                    ) from None
                progress.ended += 1
                continue
            except Exception as exc:
                exc.add_note(_where(progress, index, count, passes))
                raise
            expected = index + count * streams
            for position, item in enumerate(items, count):
                if item["t"] != expected:
                    raise _wrong_token(index, position, item, expected)
                expected += streams
            progress.last[index] = clock()
            if count == 0:
                progress.first[index] = progress.last[index]
            count += len(items)
            counts[index] = count
            if count > passes:
                raise BenchFailure(f"stream {index} received {count} of {passes} tokens")
            still.append(index)
        live = still


def _where(progress: Progress, index: int, count: int, passes: int) -> str:
    """Where a failing stream was, for the traceback."""
    if count == 0:
        return f"stream {index} failed before its first token"
    quiet = time.perf_counter() - progress.last[index]
    return f"stream {index} failed after {count} of {passes} tokens, {quiet:.2f} s after its last"


def _stall_report(progress: Progress, passes: int, timeout: float) -> str:
    counts = progress.counts
    short = [(index, count) for index, count in enumerate(counts) if count != passes]
    sample = ", ".join(f"#{index}: {count}" for index, count in short[:8])
    return (
        f"no end after {timeout:g} s: {sum(counts)} of {len(counts) * passes} tokens, "
        f"{progress.ended} of {len(counts)} streams ended; {len(short)} streams short "
        f"of {passes} tokens ({sample}{', ...' if len(short) > 8 else ''})"
    )


async def consumer_main(args: argparse.Namespace) -> int:
    stdin = await stdin_reader()
    credentials = NodeCredentials.load(args.credentials)
    streams, passes = args.streams, args.passes
    mux = arm_mux_config(args.transport, "consumer")
    async with await Node.start(credentials, mux=mux) as node:
        anchors = [node.create_anchor() for _ in range(streams)]
        progress = Progress(streams)
        if args.consumer == "task-per-stream":
            readers = [
                asyncio.create_task(read_stream(anchor, index, streams, passes, progress))
                for index, anchor in enumerate(anchors)
            ]
        else:
            readers = [asyncio.create_task(read_round_robin(anchors, streams, passes, progress))]
        handoff = {
            "instance_id": str(node.instance_id),
            "address": list(node.address),
            "handles": [anchor.handle.to_wire() for anchor in anchors],
        }
        staging = Path(args.handoff).with_suffix(".partial")
        staging.write_text(json.dumps(handoff))
        staging.replace(args.handoff)
        say("ready")

        await expect_line(stdin, "go")
        window = Window.open(node)
        profiler = cProfile.Profile() if args.profile == args.role else None
        say("armed", {"at": window.at})
        if profiler is not None:
            profiler.enable()
        try:
            async with asyncio.timeout(args.timeout):
                await asyncio.gather(*readers)
        except TimeoutError:
            raise BenchFailure(_stall_report(progress, passes, args.timeout)) from None
        except Exception:
            print_counters("consumer", node)
            raise
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        ended_at = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        deltas = window.close(node)
        profile_report(profiler, "consumer")
        say(
            "result",
            {
                "tokens": sum(progress.counts),
                "streams_ended": progress.ended,
                "armed_at": window.at,
                "first_token_at": min(progress.first),
                "last_token_at": max(progress.last),
                "ended_at": ended_at,
                **deltas,
                **loop_environment(),
            },
        )
        await expect_line(stdin, "exit")
    return 0


# -- the producer (engine) ---------------------------------------------------------------


async def producer_main(args: argparse.Namespace) -> int:
    stdin = await stdin_reader()
    credentials = NodeCredentials.load(args.credentials)
    handoff = json.loads(Path(args.handoff).read_text())
    streams, passes = args.streams, args.passes
    delay = args.pass_delay_ms / 1000.0
    arm = args.transport
    mux = arm_mux_config(arm, "producer")
    async with await Node.start(credentials, mux=mux) as node:
        host, port = handoff["address"]
        peer = InstanceId.parse(handoff["instance_id"])
        node.add_peer(peer, (host, int(port)))
        handles = [StreamAnchorHandle.from_wire(wire) for wire in handoff["handles"]]
        if len(handles) != streams:
            raise BenchFailure(f"the consumer handed over {len(handles)} handles, not {streams}")
        # The per-stream arm offers only the per-stream path, so the attach settles on it
        # whatever else the two nodes could negotiate; the mux arms offer the default set.
        offer = [PER_STREAM_KEY] if arm == "per-stream" else None
        started = time.perf_counter()
        senders: list[StreamSender] = await asyncio.gather(
            *(node.anchors.attach_anchor(handle, offer=offer) for handle in handles)
        )
        attach_s = time.perf_counter() - started
        transports = sorted({str(sender.negotiated_transport()) for sender in senders})
        if transports != [ARM_KEYS[arm]]:
            raise BenchFailure(f"attached over {transports}, not only {ARM_KEYS[arm]}")
        # The batcher's byte cap: the smallest of the three clamps (design: the batch size cap).
        byte_cap = min(mux.max_batch_bytes, COALESCE_THRESHOLD, node.messenger.eager_budget(peer))
        say("attached", {"attach_s": attach_s, "transports": transports, "byte_cap": byte_cap})

        await expect_line(stdin, "go")
        window = Window.open(node)
        profiler = cProfile.Profile() if args.profile == args.role else None
        if profiler is not None:
            profiler.enable()
        step = (0, 0)
        try:
            async with asyncio.timeout(args.timeout):
                for pass_ in range(passes):
                    base = pass_ * streams
                    for index, sender in enumerate(senders):
                        step = (pass_, index)
                        await sender.send(token_item(base + index))
                    node.flush_batch()
                    await asyncio.sleep(delay)
                passes_done_at = time.perf_counter()
                retired = await asyncio.gather(*(sender.finalize() for sender in senders))
                retired_at = time.perf_counter()
        except TimeoutError:
            raise BenchFailure(
                f"the producer did not finish within {args.timeout:g} s: it was at pass "
                f"{step[0]}, stream {step[1]} (or past the last pass, awaiting retirements)"
            ) from None
        except Exception as exc:
            exc.add_note(
                f"the producer was at pass {step[0]}, stream {step[1]}, "
                f"{time.perf_counter() - window.at:.2f} s after its first send"
            )
            print_counters("producer", node)
            raise
        outcomes = sorted({outcome.value for outcome in retired})
        if outcomes != [Retired.SENT.value]:
            raise BenchFailure(f"streams retired as {outcomes}, expected only 'sent'")
        await expect_line(stdin, "done")  # the consumer has every token
        if profiler is not None:
            profiler.disable()
        deltas = window.close(node)
        profile_report(profiler, "producer")
        say(
            "result",
            {
                "attach_s": attach_s,
                "first_send_at": window.at,
                "passes_done_at": passes_done_at,
                "retired_at": retired_at,
                **deltas,
                **loop_environment(),
            },
        )
        await expect_line(stdin, "exit")
    return 0


# -- the orchestrator --------------------------------------------------------------------


def _child_arguments(
    args: argparse.Namespace, arm: str, role: str, credentials: Path, handoff: Path
) -> list[str]:
    arguments = [
        "--role", role,
        "--transport", arm,
        "--credentials", str(credentials),
        "--handoff", str(handoff),
        "--streams", str(args.streams),
        "--passes", str(args.passes),
        "--consumer", args.consumer,
        "--pass-delay-ms", str(args.pass_delay_ms),
        "--timeout", str(args.timeout),
    ]  # fmt: skip
    if args.profile == role:
        arguments += ["--profile", role]
    return arguments


async def one_run(
    args: argparse.Namespace, arm: str, nodes: dict[str, Path], workdir: Path, number: int
) -> dict[str, Any]:
    handoff = workdir / f"handoff-{arm}-{number}.json"
    timeout = args.timeout
    children: list[Child] = []
    try:
        consumer = await Child.spawn(
            "consumer", SCRIPT, _child_arguments(args, arm, "consumer", nodes["frontend"], handoff)
        )
        children.append(consumer)
        await watched(consumer.expect("ready"), [], "starting the consumer", timeout)
        producer = await Child.spawn(
            "producer", SCRIPT, _child_arguments(args, arm, "producer", nodes["engine"], handoff)
        )
        children.append(producer)
        attached = await watched(producer.expect("attached"), [consumer], "attaching", timeout)
        consumer.send("go")
        await watched(consumer.expect("armed"), [producer], "arming the consumer", timeout)
        producer.send("go")
        # Generous: each child enforces ``timeout`` itself and explains what is stuck.
        received = await watched(consumer.expect("result"), [producer], "streaming", 2 * timeout)
        producer.send("done")
        sent = await watched(producer.expect("result"), [consumer], "producer report", timeout)
        for child in (producer, consumer):
            child.send("exit")
            code = await child.finish(timeout)
            if code != 0:
                raise BenchFailure(f"the {child.name} exited with code {code} after its report")
    finally:
        for child in children:
            child.kill()
        for child in children:
            await child.process.wait()
        handoff.unlink(missing_ok=True)
    return _summarise(args, arm, attached, sent, received)


def _summarise(
    args: argparse.Namespace,
    arm: str,
    attached: dict[str, Any],
    sent: dict[str, Any],
    received: dict[str, Any],
) -> dict[str, Any]:
    expected = args.streams * args.passes
    tokens = int(received["tokens"])
    if tokens != expected or received["streams_ended"] != args.streams:
        raise BenchFailure(f"{tokens} tokens delivered, expected {expected}")
    shared_clock = "CLOCK_MONOTONIC" in sent["clock"] and "CLOCK_MONOTONIC" in received["clock"]
    start = sent["first_send_at"] if shared_clock else received["armed_at"]
    e2e = received["last_token_at"] - start
    produced, consumed = sent["counters"], received["counters"]
    cpu_p = sent["cpu_user_s"] + sent["cpu_sys_s"]
    cpu_c = received["cpu_user_s"] + received["cpu_sys_s"]
    result: dict[str, Any] = {
        "arm": arm,
        "transport": attached["transports"][0],
        "tokens": tokens,
        "attach_s": attached["attach_s"],
        "send_s": sent["passes_done_at"] - sent["first_send_at"],
        "retire_s": sent["retired_at"] - sent["first_send_at"],
        "read_s": received["last_token_at"] - received["first_token_at"],
        "e2e_s": e2e,
        "e2e_shared_clock": shared_clock,
        "tokens_per_s": tokens / e2e,
        "producer_cpu_s": cpu_p,
        "producer_cpu_user_s": sent["cpu_user_s"],
        "producer_cpu_sys_s": sent["cpu_sys_s"],
        "producer_cpu_us_per_token": 1e6 * cpu_p / tokens,
        "consumer_cpu_s": cpu_c,
        "consumer_cpu_user_s": received["cpu_user_s"],
        "consumer_cpu_sys_s": received["cpu_sys_s"],
        "consumer_cpu_us_per_token": 1e6 * cpu_c / tokens,
        "producer_frames_written": produced["frames_written"],
        "producer_frames_per_token": produced["frames_written"] / tokens,
        "producer_heartbeats_sent": produced["heartbeats_sent"],
        "producer_send_waits": produced["send_waits"],
        "producer_datagrams_out": produced["datagrams_out"],
        "producer_datagrams_in": produced["datagrams_in"],
        "producer_datagrams_out_per_token": produced["datagrams_out"] / tokens,
        "producer_datagrams_in_per_token": produced["datagrams_in"] / tokens,
        "consumer_frames_received": consumed["frames_received"],
        "consumer_reader_backpressure": consumed["reader_backpressure"],
        "consumer_watchdog_firings": consumed["watchdog_firings"],
        "consumer_datagrams_in": consumed["datagrams_in"],
        "consumer_datagrams_out": consumed["datagrams_out"],
        "producer_loop": sent["loop"],
        "consumer_loop": received["loop"],
    }
    if ARM_KEYS[arm] == MESSENGER_MUX_KEY:
        batches = produced["mux_batches_sent"]
        records = produced["mux_records_sent"]
        clamp = records_per_batch_clamp(attached["byte_cap"], token_record_bytes())
        per_write = records / batches if batches else 0.0
        result.update(
            {
                "mux_byte_cap": attached["byte_cap"],
                "mux_records_clamp": clamp,
                "producer_mux_batches_sent": batches,
                "producer_mux_records_sent": records,
                "producer_mux_data_records_sent": produced["mux_data_records_sent"],
                "producer_mux_close_records_sent": produced["mux_close_records_sent"],
                "producer_mux_credit_records_sent": produced["mux_credit_records_sent"],
                "producer_records_per_write": per_write,
                "producer_records_per_write_of_clamp": per_write / clamp,
                "producer_writes_per_pass": batches / args.passes,
                "consumer_mux_batches_received": consumed["mux_batches_received"],
                "consumer_mux_records_received": consumed["mux_records_received"],
                "consumer_mux_batches_sent": consumed["mux_batches_sent"],
                "consumer_mux_credit_records_sent": consumed["mux_credit_records_sent"],
            }
        )
    return result


Column = tuple[str, str, Callable[[float], str]]

COLUMNS: list[Column] = [
    ("attach_s", "attach s", "{:.2f}".format),
    ("send_s", "send s", "{:.2f}".format),
    ("retire_s", "retire s", "{:.2f}".format),
    ("read_s", "read s", "{:.2f}".format),
    ("e2e_s", "e2e s", "{:.2f}".format),
    ("tokens_per_s", "tokens/s", "{:,.0f}".format),
    ("producer_cpu_s", "prod CPU s", "{:.2f}".format),
    ("producer_cpu_us_per_token", "prod µs/tok", "{:.1f}".format),
    ("consumer_cpu_s", "cons CPU s", "{:.2f}".format),
    ("consumer_cpu_us_per_token", "cons µs/tok", "{:.1f}".format),
    ("producer_datagrams_out_per_token", "prod dgram out/tok", "{:.3f}".format),
    ("producer_datagrams_in_per_token", "prod dgram in/tok", "{:.3f}".format),
]
PER_STREAM_COLUMNS: list[Column] = [
    ("producer_frames_per_token", "frames/tok", "{:.3f}".format),
]
MUX_COLUMNS: list[Column] = [
    ("producer_writes_per_pass", "writes/pass", "{:.2f}".format),
    ("producer_records_per_write", "records/write", "{:.1f}".format),
]

COMPARED: list[tuple[str, str, Callable[[float], str], bool]] = [
    ("tokens_per_s", "tokens/s", "{:,.0f}".format, True),
    ("producer_cpu_us_per_token", "producer CPU µs per token", "{:.1f}".format, False),
    ("consumer_cpu_us_per_token", "consumer CPU µs per token", "{:.1f}".format, False),
]
"""The metrics compared across arms; True where higher is better (ratio arm / per-stream),
False where lower is better (ratio per-stream / arm). Either way a ratio above 1 favours
the mux arm."""


Medians = dict[str, dict[str, float]]
"""Per arm, the median of every numeric figure over its successful runs."""


def _columns(arm: str) -> list[Column]:
    return COLUMNS + (MUX_COLUMNS if ARM_KEYS[arm] == MESSENGER_MUX_KEY else PER_STREAM_COLUMNS)


def _table(arm: str, runs: list[dict[str, Any]], median: dict[str, float]) -> str:
    """Every figure of one arm's runs (a failed run as a row of dashes, its error below)."""
    columns = _columns(arm)
    header = ["run", "tokens", *(title for _, title, _ in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    failures: list[str] = []
    for number, result in enumerate(runs, 1):
        if "failed" in result:
            cells = [str(number), "FAILED", *("—" for _ in columns)]
            failures.append(f"run {number} FAILED: {result['failed']}")
        else:
            cells = [
                str(number),
                f"{int(result['tokens']):,}",
                *(fmt(result[key]) for key, _, fmt in columns),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    if len(ok_runs(runs)) > 1:
        cells = ["median", f"{int(median['tokens']):,}"]
        cells += [fmt(median[key]) for key, _, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, *("\n" + failure for failure in failures)])


def _ratio(
    metric: str, higher_is_better: bool, arm: dict[str, float], base: dict[str, float]
) -> float | None:
    """The arm against per-stream, oriented so that above 1 favours the arm; None if either
    has no successful run."""
    if metric not in arm or metric not in base or not arm[metric] or not base[metric]:
        return None
    return arm[metric] / base[metric] if higher_is_better else base[metric] / arm[metric]


def _spread(values: list[float]) -> str:
    """(max - min) / median of the successful runs, in percent."""
    if len(values) < 2:
        return "—"
    return f"{100 * (max(values) - min(values)) / statistics.median(values):.0f}%"


def _comparison(
    arms: Sequence[str], by_arm: dict[str, list[dict[str, Any]]], medians: Medians
) -> str:
    """One table per compared metric (every run, the median, the spread, the ratio), then
    the medians and ratios of every metric side by side."""
    baseline = "per-stream" in arms and len(arms) > 1
    runs = max(len(by_arm[arm]) for arm in arms)
    blocks: list[str] = []
    for metric, title, fmt, higher in COMPARED:
        ratio_title = "arm / per-stream" if higher else "per-stream / arm"
        header = ["arm", *(f"run {i + 1}" for i in range(runs)), "median", "spread"]
        if baseline:
            header.append(ratio_title)
        lines = [
            f"**{title}** ({'higher' if higher else 'lower'} is better)",
            "",
            "| " + " | ".join(header) + " |",
            "|---|" + "---:|" * (len(header) - 1),
        ]
        for arm in arms:
            arm_runs = by_arm[arm]
            cells = [arm]
            cells += ["FAILED" if "failed" in run else fmt(run[metric]) for run in arm_runs]
            cells += [""] * (runs - len(arm_runs))
            median = medians[arm]
            cells.append(fmt(median[metric]) if metric in median else "—")
            cells.append(_spread([run[metric] for run in ok_runs(arm_runs)]))
            if baseline:
                if arm == "per-stream":
                    cells.append("1")
                else:
                    ratio = _ratio(metric, higher, median, medians["per-stream"])
                    cells.append("n/a" if ratio is None else f"{ratio:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    if baseline:
        others = [arm for arm in arms if arm != "per-stream"]
        header = ["median", *arms, "ratio", *(f"{arm} ratio" for arm in others)]
        lines = [
            "**medians and ratios** (a ratio above 1 favours the mux arm)",
            "",
            "| " + " | ".join(header) + " |",
            "|---|" + "---:|" * len(arms) + "---|" + "---:|" * len(others),
        ]
        for metric, title, fmt, higher in COMPARED:
            cells = [title]
            cells += [fmt(medians[arm][metric]) if metric in medians[arm] else "—" for arm in arms]
            cells.append("mux / per-stream" if higher else "per-stream / mux")
            for arm in others:
                ratio = _ratio(metric, higher, medians[arm], medians["per-stream"])
                cells.append("n/a" if ratio is None else f"{ratio:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _records_per_write(
    arms: Sequence[str], by_arm: dict[str, list[dict[str, Any]]], medians: Medians
) -> str:
    """Records per wire write on the producer against the batch clamp, per mux arm."""
    mux_arms = [arm for arm in arms if ARM_KEYS[arm] == MESSENGER_MUX_KEY]
    if not mux_arms:
        return ""
    record = token_record_bytes()
    runs = max(len(by_arm[arm]) for arm in mux_arms)
    header = ["arm", *(f"run {i + 1}" for i in range(runs)), "median", "clamp", "of clamp"]
    lines = [
        f"**records per wire write** (producer: velo_streaming_mux_records_total / "
        f'velo_streaming_mux_batches_total, direction="sent"); clamp = floor((byte cap - '
        f"{BATCH_HEADER_SIZE}) / ({RECORD_HEADER_SIZE} + {record})), a token record being "
        f"{record} bytes (encode_item)",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    breakdown = [
        "| arm | byte cap | writes/pass | records | data records | of which heartbeats "
        "| CloseSlot records | other records |",
        "|---|" + "---:|" * 7,
    ]
    for arm in mux_arms:
        arm_runs, median = by_arm[arm], medians[arm]
        cells = [arm]
        cells += [
            "FAILED" if "failed" in run else f"{run['producer_records_per_write']:.1f}"
            for run in arm_runs
        ]
        cells += [""] * (runs - len(arm_runs))
        if "producer_records_per_write" in median:
            clamp = int(median["mux_records_clamp"])
            per_write = median["producer_records_per_write"]
            cells += [f"{per_write:.1f}", str(clamp), f"{per_write / clamp:.2f}"]
            data = median["producer_mux_data_records_sent"]
            close = median["producer_mux_close_records_sent"]
            records = median["producer_mux_records_sent"]
            breakdown.append(
                f"| {arm} | {int(median['mux_byte_cap']):,} | "
                f"{median['producer_writes_per_pass']:.2f} | {records:,.0f} | {data:,.0f} | "
                f"{median['producer_heartbeats_sent']:,.0f} | {close:,.0f} | "
                f"{records - data - close:,.0f} |"
            )
        else:
            cells += ["—", "—", "—"]
        lines.append("| " + " | ".join(cells) + " |")
    note = (
        "Every record counts, not only tokens: heartbeats are ordinary data records under "
        "the mux, and each stream ends with its terminal (a data record) and a CloseSlot. "
        "The breakdown shows medians over the successful runs (each column on its own)."
    )
    return "\n".join([*lines, "", *breakdown, "", note])


def _progress_line(arm: str, number: int, runs: int, result: dict[str, Any]) -> str:
    where = f"{arm} run {number + 1}/{runs}"
    if "failed" in result:
        return f"{where}: FAILED: {result['failed']}"
    line = (
        f"{where}: {result['tokens']:,} tokens, {result['tokens_per_s']:,.0f} tokens/s, "
        f"CPU µs/token {result['producer_cpu_us_per_token']:.1f} producer, "
        f"{result['consumer_cpu_us_per_token']:.1f} consumer"
    )
    if "producer_records_per_write" in result:
        line += f", {result['producer_records_per_write']:.1f} records/write"
    return line


async def orchestrate(args: argparse.Namespace) -> int:
    arms = list(ARMS) if args.transport == "all" else [args.transport]
    by_arm: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="perstream-bench-") as tmp:
        workdir = Path(tmp)
        nodes = ensure_dev_cluster(workdir, ("engine", "frontend"))
        # Interleaved: run 1 of every arm, then run 2 of every arm, ...
        for number in range(args.runs):
            for arm in arms:
                busy = await busy_before(f"{arm} run {number + 1}")
                try:
                    result = await one_run(args, arm, nodes, workdir, number)
                except BenchFailure as exc:
                    result = {"arm": arm, "failed": str(exc)}
                result["run"] = number + 1
                result["other_cpu_busy_before"] = busy
                by_arm[arm].append(result)
                print(_progress_line(arm, number, args.runs, result), file=sys.stderr, flush=True)
    medians = {arm: median_of(runs) for arm, runs in by_arm.items()}
    failed = {arm: sum("failed" in run for run in runs) for arm, runs in by_arm.items()}
    config = {
        "streams": args.streams,
        "passes": args.passes,
        "consumer": args.consumer,
        "pass_delay_ms": args.pass_delay_ms,
        "runs": args.runs,
        "arms": arms,
        "interleaved": len(arms) > 1,
        "token_bytes": TOKEN_BYTES,
        "token_record_bytes": token_record_bytes(),
        "profiled": args.profile,
    }
    loops = sorted({run["producer_loop"] for runs in by_arm.values() for run in ok_runs(runs)})
    environment = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loop": ", ".join(loops) or "unknown",
        "aioquic": package_version("aioquic"),
        "uvloop": package_version("uvloop"),
        "velomux_quic": package_version("velomux_quic"),
    }
    print(
        f"{', '.join(arms)}: {args.streams:,} streams x {args.passes} passes of one "
        f"{TOKEN_BYTES}-byte token, {args.runs} run{'s' if args.runs > 1 else ''} per arm"
        + (" (interleaved)" if len(arms) > 1 else "")
        + f", consumer {args.consumer}, pass delay {args.pass_delay_ms:g} ms, "
        f"{environment['loop']}, {environment['cpus']} CPUs, Python {environment['python']}, "
        f"aioquic {environment['aioquic']}"
        + (f"; {args.profile} under cProfile" if args.profile else "")
    )
    for arm in arms:
        print(f"\n### {arm} ({ARM_KEYS[arm]})\n")
        print(_table(arm, by_arm[arm], medians[arm]))
    print()
    print(_comparison(arms, by_arm, medians))
    records = _records_per_write(arms, by_arm, medians)
    if records:
        print()
        print(records)
    done = [run for runs in by_arm.values() for run in ok_runs(runs)]
    if not all(run["e2e_shared_clock"] for run in done):
        print("\ne2e measured from the consumer's arming: perf_counter is not shared here")
    if any(failed.values()):
        counts = ", ".join(f"{arm} {n} of {args.runs}" for arm, n in failed.items() if n)
        print(f"\nFAILED runs: {counts}")
    if args.json is not None:
        document = {
            "benchmark": "perstream",
            "config": config,
            "environment": environment,
            "runs": by_arm,
            "median": medians,
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 2 if any(failed.values()) else 0


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--transport",
        choices=(*ARMS, "all"),
        default="all",
        help="the arm to run; all (default) runs the three, interleaved",
    )
    parser.add_argument("--streams", type=int, default=1024, help="anchors (default 1,024)")
    parser.add_argument("--passes", type=int, default=100, help="forward passes (default 100)")
    parser.add_argument(
        "--consumer",
        choices=("task-per-stream", "single-task"),
        default="task-per-stream",
        help="how the frontend reads its anchors (default task-per-stream)",
    )
    parser.add_argument(
        "--pass-delay-ms",
        type=float,
        default=0.0,
        help="pause between passes; 0 (default) runs at full rate, yielding once per pass",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="runs per arm, each in fresh processes (default 3)"
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help=f"{SHORT['streams']} streams, {SHORT['passes']} passes, {SHORT['runs']} run per arm",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="longest wait for any one step (s)"
    )
    parser.add_argument(
        "--profile",
        choices=("producer", "consumer"),
        help="run that side's measured window under cProfile, top functions on stderr",
    )
    # The children's own arguments (the benchmark starts them with these).
    parser.add_argument("--role", choices=("consumer", "producer"), help=argparse.SUPPRESS)
    parser.add_argument("--credentials", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--handoff", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is not None:
        if args.transport not in ARMS:
            parser.error("a child runs one arm")
        return args
    if args.short:
        args.streams, args.passes, args.runs = SHORT["streams"], SHORT["passes"], SHORT["runs"]
    if args.streams < 1 or args.passes < 1 or args.runs < 1:
        parser.error("--streams, --passes and --runs must be at least 1")
    if args.streams * args.passes > UINT_LIMITS[-1]:
        parser.error("streams x passes must fit a u32 token id")
    if args.pass_delay_ms < 0 or args.timeout <= 0:
        parser.error("--pass-delay-ms must be >= 0 and --timeout > 0")
    return args


def _child(args: argparse.Namespace) -> int:
    """Run one child; a failure is also said on stdout, so the report can show why."""
    main_ = consumer_main if args.role == "consumer" else producer_main
    try:
        return run(main_(args))
    except Exception as exc:
        say("failed", {"error": describe(exc)})
        raise


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        if args.role is not None:
            return _child(args)
        return asyncio.run(orchestrate(args))
    except BenchFailure as exc:
        who = f"{args.role}: " if args.role else ""
        print(f"perstream_bench FAILED: {who}{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
