"""Pieces shared by the multi-process benchmarks (``tokens.py``, ``quic_lanes.py``).

They run every node in a child process of its own, driven by a line protocol (one word,
optionally followed by a JSON object, per line on the child's stdin and stdout), measure
CPU with ``getrusage`` and read the nodes' own Prometheus counters over the same window.
Keeping the token, the counters, the window and the child protocol here means every arm
is measured the same way, so the figures stay comparable.

Nothing here is timed itself; the cost of a helper that runs per token (``token_item``,
``stamped_token``) is paid equally by every arm that uses it.
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import importlib.metadata
import json
import os
import pstats
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack
from _callgrind import ENV_DIR as CALLGRIND_DIR
from _callgrind import ClientRequests, read_window

from velomux_quic.mux.protocol import BATCH_HEADER_SIZE, RECORD_HEADER_SIZE
from velomux_quic.node import Node
from velomux_quic.programs.runtime import run
from velomux_quic.recordpath import IMPLEMENTATION as RECORD_PATH
from velomux_quic.streaming.frames import encode_item

T = TypeVar("T")

__all__ = [
    "COUNTERS",
    "STAMP_MIN",
    "TOKEN_BYTES",
    "UINT_LIMITS",
    "BenchFailure",
    "Child",
    "CountingTransport",
    "DatagramCount",
    "Window",
    "busy_before",
    "describe",
    "die_with_parent",
    "expect_line",
    "loop_environment",
    "median_of",
    "ok_runs",
    "other_cpu_busy",
    "package_version",
    "print_counters",
    "profile_report",
    "read_counters",
    "records_per_batch_clamp",
    "run_child",
    "say",
    "stamped_token",
    "stdin_reader",
    "token_item",
    "token_record_bytes",
    "watched",
]


class BenchFailure(Exception):
    """The run is invalid (lost, duplicated or reordered tokens or items, a hang, a dead
    child)."""


# -- the token ---------------------------------------------------------------------------

TOKEN_BYTES = 48
"""Size of one token item, MessagePack-encoded (the frame adds the ``Item`` tag)."""

UINT_LIMITS = (1 << 7, 1 << 8, 1 << 16, 1 << 32)
"""Where MessagePack's unsigned encodings change size (1, 2, 3 and 5 bytes)."""

STAMP_MIN = 1 << 32
"""The smallest emit stamp ``stamped_token`` sizes for: every stamp from here up to 2**64
encodes as a MessagePack uint64 (9 bytes), so the token stays 48 bytes. ``perf_counter_ns``
(CLOCK_MONOTONIC) passes it 4.3 s after boot."""


def _padding_for(fields: dict[str, int]) -> str:
    """The padding that makes ``{**fields, "x": padding}`` exactly ``TOKEN_BYTES`` long."""
    for length in range(TOKEN_BYTES, -1, -1):
        padding = "x" * length
        if len(msgpack.packb({**fields, "x": padding})) == TOKEN_BYTES:
            return padding
    raise ValueError(f"no padding makes {fields} {TOKEN_BYTES} bytes")


_PADDINGS = tuple(_padding_for({"t": limit - 1}) for limit in UINT_LIMITS)
_STAMPED_PADDINGS = tuple(_padding_for({"t": limit - 1, "s": STAMP_MIN}) for limit in UINT_LIMITS)


def _size_class(token: int) -> int:
    if token < 128:
        return 0
    if token < 256:
        return 1
    if token < 65536:
        return 2
    return 3


def token_item(token: int) -> dict[str, Any]:
    """``{"t": token, "x": padding}``, 48 bytes of MessagePack for any u32 ``token``."""
    return {"t": token, "x": _PADDINGS[_size_class(token)]}


def stamped_token(token: int, stamp_ns: int) -> dict[str, Any]:
    """``{"t": token, "s": stamp_ns, "x": padding}``, 48 bytes of MessagePack for any u32
    ``token`` and any ``stamp_ns`` from ``STAMP_MIN`` (the emit time, ``perf_counter_ns``,
    from which the receiver measures the token's latency)."""
    return {"t": token, "s": stamp_ns, "x": _STAMPED_PADDINGS[_size_class(token)]}


def token_record_bytes(*, stamped: bool = False) -> int:
    """The encoded size of a token item (``encode_item``), the body of its Data record."""
    if stamped:
        items = [stamped_token(limit - 1, STAMP_MIN) for limit in UINT_LIMITS]
        items += [stamped_token(limit - 1, (1 << 64) - 1) for limit in UINT_LIMITS]
    else:
        items = [token_item(limit - 1) for limit in UINT_LIMITS]
    sizes = {len(encode_item(item)) for item in items}
    if len(sizes) != 1:
        raise ValueError(f"token records vary in size: {sorted(sizes)}")
    return sizes.pop()


def records_per_batch_clamp(byte_cap: int, record_bytes: int) -> int:
    """The most records of ``record_bytes`` that fit one batch of at most ``byte_cap``."""
    return (byte_cap - BATCH_HEADER_SIZE) // (RECORD_HEADER_SIZE + record_bytes)


# -- measuring inside a child ------------------------------------------------------------

COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "frames_written": ("velo_streaming_frames_written_total", {}),
    "frames_received": ("velo_streaming_frames_received_total", {}),
    "send_waits": ("velo_streaming_producer_send_backpressure_total", {}),
    "heartbeats_sent": ("velo_streaming_heartbeats_sent_total", {}),
    "reader_backpressure": ("velo_streaming_reader_pump_backpressure_total", {}),
    "watchdog_firings": ("velo_streaming_heartbeat_watchdog_firings_total", {}),
    "datagrams_out": (
        "velo_transport_datagrams_total",
        {"transport": "quic", "direction": "outbound"},
    ),
    "datagrams_in": (
        "velo_transport_datagrams_total",
        {"transport": "quic", "direction": "inbound"},
    ),
    "mux_batches_sent": ("velo_streaming_mux_batches_total", {"direction": "sent"}),
    "mux_records_sent": ("velo_streaming_mux_records_total", {"direction": "sent"}),
    "mux_batches_received": ("velo_streaming_mux_batches_total", {"direction": "received"}),
    "mux_records_received": ("velo_streaming_mux_records_total", {"direction": "received"}),
    "mux_data_records_sent": ("velo_streaming_mux_records_sent_total", {"record_type": "data"}),
    "mux_close_records_sent": (
        "velo_streaming_mux_records_sent_total",
        {"record_type": "close_slot"},
    ),
    "mux_credit_records_sent": (
        "velo_streaming_mux_records_sent_total",
        {"record_type": "credit_update"},
    ),
}
"""The node counters a run reads, by short name: (series, labels)."""


def read_counters(node: Node) -> dict[str, float]:
    """Every series in ``COUNTERS`` from the node's registry; a missing one fails the run
    (a renamed metric must not silently read as zero)."""
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in node.registry.collect()
        for sample in family.samples
    }
    found: dict[str, float] = {}
    for key, (name, labels) in COUNTERS.items():
        value = samples.get((name, frozenset(labels.items())))
        if value is None:
            raise BenchFailure(f"the node exports no {name} {labels}")
        found[key] = value
    return found


class GcPauses:
    """The cyclic collector's pauses in this process, from ``gc.callbacks``: how many
    collections of each generation ran and how long the loop stood still for them. A pause
    delays every record in flight on that process, so it shows in a latency tail."""

    def __init__(self) -> None:
        self.started = 0.0
        self.counts = [0, 0, 0]
        self.total = 0.0
        self.longest = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        pause = time.perf_counter() - self.started
        self.counts[info["generation"]] += 1
        self.total += pause
        self.longest = max(self.longest, pause)

    def reset(self) -> None:
        self.counts = [0, 0, 0]
        self.total = self.longest = 0.0

    def figures(self) -> dict[str, Any]:
        return {
            "gc_collections": list(self.counts),
            "gc_pause_total_ms": 1000 * self.total,
            "gc_pause_max_ms": 1000 * self.longest,
        }


GC_PAUSES = GcPauses()
"""This process's collector pauses, counted from each window's ``open``."""


_COUNTING: list[ClientRequests] = []
"""The client requests of a child run under callgrind (made on its first window)."""


def _counting() -> ClientRequests | None:
    """Callgrind's client requests when this child runs under it (``tokens.py
    --instructions``), else None."""
    if CALLGRIND_DIR not in os.environ:
        return None
    if not _COUNTING:
        _COUNTING.append(ClientRequests())
        if not _COUNTING[0].on_valgrind():
            raise RuntimeError(f"{CALLGRIND_DIR} is set but this process is not on valgrind")
    return _COUNTING[0]


@dataclass
class Window:
    """CPU and counters at the start of a measured window; ``close`` gives the deltas.

    ``getrusage(RUSAGE_SELF)`` counts every thread of the process, so a library that works
    on threads of its own (gRPC's core does) is charged like one that works on the event
    loop. A child with no node (the gRPC arm) has no counters. Under callgrind
    (``perf/_callgrind.py``) the window also counts the instructions the process executes
    in it, the figure the machine's load does not move.
    """

    counters: dict[str, float]
    user: float
    system: float
    at: float
    counting: ClientRequests | None = None

    @classmethod
    def open(cls, node: Node | None) -> Window:
        counters = read_counters(node) if node is not None else {}
        usage = resource.getrusage(resource.RUSAGE_SELF)
        GC_PAUSES.reset()
        window = cls(counters, usage.ru_utime, usage.ru_stime, time.perf_counter(), _counting())
        if window.counting is not None:
            window.counting.start()
        return window

    def cpu(self) -> dict[str, float]:
        """User and system CPU seconds since ``open``, without the counters (for a child
        that reads counters of its own); under callgrind, the instructions too (the first
        call ends their count)."""
        counted: dict[str, float] = {}
        if self.counting is not None:
            self.counting.stop()
            self.counting = None
            counted["instructions"] = read_window(Path(os.environ[CALLGRIND_DIR]))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "cpu_user_s": usage.ru_utime - self.user,
            "cpu_sys_s": usage.ru_stime - self.system,
            **GC_PAUSES.figures(),
            **counted,
        }

    def close(self, node: Node | None) -> dict[str, Any]:
        cpu = self.cpu()
        counters = read_counters(node) if node is not None else {}
        return {
            **cpu,
            "counters": {key: counters[key] - self.counters[key] for key in counters},
        }


def print_counters(role: str, node: Node) -> None:
    """The node's counters since it started, on stderr (a failed run's diagnosis)."""
    print(f"{role} counters since start: {read_counters(node)}", file=sys.stderr, flush=True)


def say(word: str, payload: dict[str, Any] | None = None) -> None:
    """One line of the child protocol on stdout."""
    line = word if payload is None else f"{word} {json.dumps(payload)}"
    print(line, flush=True)


async def stdin_reader() -> asyncio.StreamReader:
    """The child's stdin as a stream, so waiting for the benchmark never blocks the loop."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def expect_line(reader: asyncio.StreamReader, word: str) -> dict[str, Any]:
    """The next line must be ``word``, optionally followed by a JSON object (returned; ``{}``
    when there is none); an empty line means the benchmark went away."""
    line = (await reader.readline()).decode().strip()
    said, _, payload = line.partition(" ")
    if said != word:
        raise BenchFailure(f"expected {word!r} from the benchmark, got {line[:200]!r}")
    result: dict[str, Any] = json.loads(payload) if payload else {}
    return result


def profile_report(profiler: cProfile.Profile | None, role: str, dump: Path | None = None) -> None:
    """The top functions of a cProfile'd window on stderr, and the raw stats to ``dump``."""
    if profiler is None:
        return
    if dump is not None:
        profiler.dump_stats(dump)
        print(f"cProfile stats of the {role} written to {dump}", file=sys.stderr)
    print(f"--- cProfile, {role}, measured window, by own time ---", file=sys.stderr)
    stats = pstats.Stats(profiler, stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(25)
    print(f"--- cProfile, {role}, measured window, by cumulative time ---", file=sys.stderr)
    stats.sort_stats("cumulative").print_stats(20)


def loop_environment() -> dict[str, Any]:
    """The running loop's class and the clock behind ``perf_counter``."""
    loop = asyncio.get_running_loop()
    return {
        "loop": f"{type(loop).__module__}.{type(loop).__qualname__}",
        "clock": time.get_clock_info("perf_counter").implementation,
        "record_path": RECORD_PATH,
    }


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this child when the benchmark that started it dies, so even a
    benchmark killed with SIGKILL leaves no node running; elsewhere a no-op (the child
    still exits at its next read of the closed stdin, or at its own timeout)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os
    import signal

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the benchmark died before the request took effect
        raise SystemExit(2)


def describe(exc: BaseException) -> str:
    """An exception and its notes on one line, for the benchmark's report."""
    notes = getattr(exc, "__notes__", None) or []
    return "; ".join([f"{type(exc).__name__}: {exc}", *notes])


def run_child(main: Coroutine[Any, Any, int]) -> int:
    """Run one child's ``main`` on the project's loop, dying with the benchmark that
    started it; a failure is also said on stdout (``failed``), so the report can show why."""
    die_with_parent()
    try:
        return run(main)
    except Exception as exc:
        say("failed", {"error": describe(exc)})
        raise


# -- the orchestrator's side -------------------------------------------------------------


class Child:
    """A child process: a line protocol on its stdin and stdout, stderr passed through."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self.process = process

    @classmethod
    async def spawn(
        cls,
        name: str,
        script: Path,
        arguments: list[str],
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> Child:
        """``script`` with ``arguments`` under this interpreter (``env``: variables set for
        the child on top of this process's environment; ``prefix``: a command that runs
        the interpreter, callgrind's)."""
        command = [*prefix, sys.executable, str(script), *arguments]
        return await cls.start(name, command, env=env)

    @classmethod
    async def start(
        cls,
        name: str,
        command: list[str],
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> Child:
        """Any command (``python -m`` a module, from ``cwd``)."""
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=None if env is None else {**os.environ, **env},
        )
        return cls(name, process)

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, word: str, payload: dict[str, Any] | None = None) -> None:
        """One line to the child: ``word``, and ``payload`` as JSON after it."""
        assert self.process.stdin is not None
        line = word if payload is None else f"{word} {json.dumps(payload)}"
        if self.process.returncode is None and not self.process.stdin.is_closing():
            self.process.stdin.write(line.encode() + b"\n")

    def close_stdin(self) -> None:
        """End the child's input (a child that runs until its stdin closes then stops)."""
        if self.process.stdin is not None and not self.process.stdin.is_closing():
            self.process.stdin.close()

    async def _line(self, what: str) -> str:
        assert self.process.stdout is not None
        line = (await self.process.stdout.readline()).decode().strip()
        if not line:
            code = await self.process.wait()
            raise BenchFailure(
                f"the {self.name} exited with code {code} before {what} (its stderr is above)"
            )
        return line

    async def expect(self, word: str) -> dict[str, Any]:
        """The child's next line must be ``word`` (with its payload); ``failed`` or an exit
        becomes a BenchFailure naming the child."""
        line = await self._line(repr(word))
        said, _, payload = line.partition(" ")
        if said == "failed" and word != "failed":
            error = json.loads(payload).get("error", "?") if payload else "?"
            raise BenchFailure(f"the {self.name} failed: {error}")
        if said != word:
            raise BenchFailure(f"the {self.name} said {line[:200]!r}, expected {word!r}")
        result: dict[str, Any] = json.loads(payload) if payload else {}
        return result

    async def expect_json(self, what: str) -> dict[str, Any]:
        """The child's next line must be one JSON object (a child that is not a benchmark
        child, such as the impairment proxy, speaks so)."""
        line = await self._line(what)
        try:
            result: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            raise BenchFailure(f"the {self.name} said {line[:200]!r}, expected {what}") from None
        return result

    async def finish(self, timeout: float) -> int:
        """Wait for a clean exit; kill it if it does not come."""
        try:
            return await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            self.kill()
            await self.process.wait()
            raise BenchFailure(f"the {self.name} did not exit within {timeout:g} s") from None

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def reap(self, timeout: float = 10.0) -> None:
        """Kill the child if it still runs and wait (bounded) until it is gone."""
        self.kill()
        try:
            await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:  # pragma: no cover - a SIGKILLed child always goes
            print(f"warning: the {self.name} survived SIGKILL", file=sys.stderr)

    async def last_words(self, timeout: float = 2.0) -> str | None:
        """After the child exited: the error of the ``failed`` line it left unread, if any.

        A child that fails says why on stdout before it exits; when the benchmark was
        waiting on another child at that moment, this recovers the reason."""
        stdout = self.process.stdout
        if stdout is None:
            return None
        try:
            async with asyncio.timeout(timeout):
                while line := (await stdout.readline()).decode().strip():
                    said, _, payload = line.partition(" ")
                    if said == "failed":
                        error: str = json.loads(payload).get("error", "?") if payload else "?"
                        return error
        except (TimeoutError, ValueError):
            return None
        return None


async def watched(awaitable: Awaitable[T], others: Sequence[Child], what: str, timeout: float) -> T:
    """Await ``awaitable``; fail if it takes ``timeout`` or another child dies meanwhile."""
    main = asyncio.ensure_future(awaitable)
    deaths = {asyncio.ensure_future(child.process.wait()): child for child in others}
    try:
        done, _ = await asyncio.wait(
            {main, *deaths}, timeout=timeout, return_when="FIRST_COMPLETED"
        )
        if main in done:
            return main.result()
        for death, child in deaths.items():
            if death in done:
                words = await child.last_words()
                why = f": {words}" if words else " (its stderr is above)"
                raise BenchFailure(
                    f"{what}: the {child.name} exited with code {child.process.returncode} "
                    f"meanwhile{why}"
                )
        raise BenchFailure(f"{what}: nothing after {timeout:g} s")
    finally:
        for task in (main, *deaths):
            task.cancel()
        await asyncio.gather(main, *deaths, return_exceptions=True)


async def other_cpu_busy(seconds: float = 0.5) -> float | None:
    """Share of all CPUs busy over ``seconds`` while no child runs (Linux), else None."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    try:
        busy_before, total_before = sample()
        await asyncio.sleep(seconds)
        busy_after, total_after = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total_after - total_before
    return (busy_after - busy_before) / total if total > 0 else None


async def busy_before(tag: str, threshold: float = 0.2) -> float | None:
    """Sample :func:`other_cpu_busy` before a run and warn on stderr when other work held
    more than ``threshold`` of the CPUs: that run's figures are disturbed."""
    busy = await other_cpu_busy()
    if busy is not None and busy > threshold:
        print(
            f"warning: {busy:.0%} of the CPUs were busy with other work just before {tag}; "
            "its figures are disturbed",
            file=sys.stderr,
        )
    return busy


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# -- summaries ---------------------------------------------------------------------------


def ok_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that did not fail."""
    return [run for run in runs if "failed" not in run]


def median_of(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of every numeric figure present in all successful runs."""
    done = ok_runs(runs)
    if not done:
        return {}
    return {
        key: statistics.median(float(run[key]) for run in done)
        for key in done[0]
        if all(
            isinstance(run.get(key), (int, float)) and not isinstance(run.get(key), bool)
            for run in done
        )
    }


# -- raw aioquic arms ----------------------------------------------------------------------


class DatagramCount:
    """Datagrams in and out of one raw aioquic endpoint: what a node's transport metrics
    count for the library's arms, kept by hand for the arms that bypass the library."""

    def __init__(self) -> None:
        self.out = 0
        self.into = 0

    def snapshot(self) -> dict[str, float]:
        return {"out": float(self.out), "in": float(self.into)}


class CountingTransport:
    """Passes ``sendto`` through to the real datagram transport, counting it."""

    def __init__(self, transport: asyncio.DatagramTransport, count: DatagramCount) -> None:
        self._transport = transport
        self._count = count

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self._count.out += 1
        self._transport.sendto(data, addr)

    def close(self) -> None:
        self._transport.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)
