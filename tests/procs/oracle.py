"""Driving the oracle node processes (oracle_producer.py, oracle_consumer.py) from a test.

A :class:`NodeProcess` is one child node: commands go to its standard input as JSON lines,
and a pump task reads its standard output, where every line is either a stream's record
(it has a ``stream`` key: how that stream ended) or the answer to the last command. Tests
wait on those lines (an event per line read), never on a sleep. :class:`Cluster` owns the
processes of one test and the impairment proxy between them, and leaves none of them
behind: every child is killed (if it still runs) and reaped on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from velomux_quic import NodeCredentials
from velomux_quic.programs.demo.proxy import Impairment, ImpairmentProxy

ROOT = Path(__file__).resolve().parents[2]

Record = dict[str, Any]


class AttachRoundFailed(AssertionError):
    """Some attaches of one :meth:`Cluster.open_streams` failed; their producer records.
    The streams that did attach run on (their indices in ``attached``)."""

    def __init__(self, records: list[Record], attached: list[int]) -> None:
        super().__init__(f"{len(records)} attaches failed: {records[:3]}")
        self.records = records
        self.attached = attached
        self.refused = len(records)


class NodeProcess:
    """One node in a child process, and what it said."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self.process = process
        self.records: dict[int, list[Record]] = {}
        """Per stream index, every end record it wrote (more than one is a defect)."""
        self.replies: asyncio.Queue[Record] = asyncio.Queue()
        self.exited = asyncio.Event()
        self._changed = asyncio.Event()
        self._asking = asyncio.Lock()  # one command at a time: answers come back in order
        self._pump = asyncio.create_task(self._read())

    @classmethod
    async def spawn(
        cls, name: str, module: str, arguments: list[str], uvloop: bool, engine: str | None = None
    ) -> NodeProcess:
        env = dict(os.environ)
        if not uvloop:
            env["VELOMUX_NO_UVLOOP"] = "1"
        if engine is not None:
            env["VELOMUX_QUIC_ENGINE"] = engine
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            *arguments,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        return cls(name, process)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def _read(self) -> None:
        assert self.process.stdout is not None
        try:
            while line := await self.process.stdout.readline():
                message: Record = json.loads(line)
                if "stream" in message:
                    self.records.setdefault(int(message["stream"]), []).append(message)
                else:
                    self.replies.put_nowait(message)
                self._changed.set()
        finally:
            self.exited.set()
            self._changed.set()

    async def reply(self, timeout: float = 30.0) -> Record:
        """The next answer the process printed (its readiness line, or a command's answer)."""
        get = asyncio.ensure_future(self.replies.get())
        exited = asyncio.ensure_future(self.exited.wait())
        try:
            done, _ = await asyncio.wait(
                {get, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            exited.cancel()
        if get in done:
            return get.result()
        get.cancel()
        raise AssertionError(f"{self.name} exited or stayed silent for {timeout} s")

    async def ask(self, command: Record, timeout: float = 30.0) -> Record:
        assert self.process.stdin is not None
        async with self._asking:
            self.process.stdin.write(json.dumps(command).encode() + b"\n")
            await self.process.stdin.drain()
            return await self.reply(timeout)

    def records_of(self, streams: range | list[int]) -> list[Record]:
        """The first end record of each of ``streams`` that has one."""
        return [self.records[index][0] for index in streams if index in self.records]

    def ended(self, streams: range | list[int]) -> bool:
        return all(index in self.records for index in streams)

    async def wait_ended(self, streams: range | list[int], timeout: float) -> dict[int, Record]:
        """Wait until every stream in ``streams`` wrote its end record; their first records."""
        try:
            async with asyncio.timeout(timeout):
                while not self.ended(streams):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            missing = [index for index in streams if index not in self.records]
            raise AssertionError(
                f"{self.name}: {len(missing)} streams not ended after {timeout} s: {missing[:10]}"
            ) from None
        return {index: self.records[index][0] for index in streams}

    def send_signal(self, signum: int) -> float:
        """Signal the process; the instant (time.monotonic(), as the children stamp)."""
        self.process.send_signal(signum)
        return time.monotonic()

    def rss(self) -> int:
        """Resident memory of the process, in bytes (from /proc)."""
        with open(f"/proc/{self.pid}/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    async def stop(self, timeout: float = 15.0) -> int | None:
        """End of input (a clean close), then a kill if it did not exit in time; reaped."""
        if self.process.returncode is None:
            with contextlib.suppress(OSError):  # a stopped child gets SIGCONT first
                self.process.send_signal(signal.SIGCONT)
            if self.process.stdin is not None:
                with contextlib.suppress(OSError, RuntimeError):
                    self.process.stdin.close()
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                self.process.kill()
        await self.process.wait()
        self._pump.cancel()
        await asyncio.gather(self._pump, return_exceptions=True)
        return self.process.returncode


@dataclass
class Settings:
    """What every node of a cell runs with: short windows so a cell takes seconds."""

    heartbeat: float = 0.5
    idle_timeout: float = 2.0
    health_check: float = 1.0
    health_check_timeout: float | None = None
    """The mux health check's timeout (None: ``health_check``, its interval)."""
    lanes: int = 1
    staging_threshold: int = 256 * 1024
    """Payloads above it are staged and pulled (rendezvous) instead of sent inline."""
    mux: bool = True
    uvloop: bool = True
    engine: str | None = None
    """The QUIC engine of every node (``VELOMUX_QUIC_ENGINE`` in its environment); None: the
    test process's own choice."""
    impairment: Impairment = field(
        default_factory=lambda: Impairment(
            loss=0.02, delay=0.002, jitter=0.001, reorder=0.01, reorder_hold=0.003, seed=13
        )
    )


class Cluster:
    """A consumer process, the impairment proxy in front of it, and producer processes
    that dial the consumer through the proxy (so both of a pair's connections cross it)."""

    def __init__(
        self, directory: Path, make_credentials: Callable[..., NodeCredentials], settings: Settings
    ) -> None:
        self.directory = directory
        self.make_credentials = make_credentials
        self.settings = settings
        self.processes: list[NodeProcess] = []
        self.proxy: ImpairmentProxy | None = None
        self.consumer_address: tuple[str, int] | None = None
        self.consumer_instance = ""
        self._next_stream = 0

    def credentials(self, name: str) -> Path:
        path = self.directory / name
        if not path.exists():
            self.make_credentials(name).save(path)
        return path

    def common(self) -> list[str]:
        s = self.settings
        arguments = [
            "--idle-timeout",
            str(s.idle_timeout),
            "--lanes",
            str(s.lanes),
            "--staging-threshold",
            str(s.staging_threshold),
        ]
        return arguments + ([] if s.mux else ["--no-mux"])

    async def start_consumer(self, name: str = "consumer") -> NodeProcess:
        """The consumer (again with the same identity and port after a kill: a restart)."""
        arguments = [
            "--credentials",
            str(self.credentials(name)),
            "--heartbeat",
            str(self.settings.heartbeat),
            *self.common(),
        ]
        if self.consumer_address is not None:
            arguments += ["--port", str(self.consumer_address[1])]
        process = await self._spawn(name, "tests.procs.oracle_consumer", arguments)
        ready = await process.reply()
        self.consumer_address = (ready["host"], ready["port"])
        self.consumer_instance = ready["instance"]
        if self.proxy is None:
            self.proxy = await ImpairmentProxy(
                self.consumer_address, self.settings.impairment
            ).start()
        return process

    async def start_producer(self, name: str) -> NodeProcess:
        assert self.proxy is not None, "start the consumer first"
        host, port = self.proxy.address
        arguments = [
            "--credentials",
            str(self.credentials(name)),
            "--peer",
            f"{self.consumer_instance}@{host}:{port}",
            "--health-check",
            str(self.settings.health_check),
            *self.common(),
        ]
        if self.settings.health_check_timeout is not None:
            arguments += ["--health-check-timeout", str(self.settings.health_check_timeout)]
        process = await self._spawn(name, "tests.procs.oracle_producer", arguments)
        await process.reply()
        return process

    async def _spawn(self, name: str, module: str, arguments: list[str]) -> NodeProcess:
        process = await NodeProcess.spawn(
            name, module, arguments, self.settings.uvloop, self.settings.engine
        )
        self.processes.append(process)
        return process

    async def open_streams(
        self,
        consumer: NodeProcess,
        producer: NodeProcess,
        count: int,
        consumer_options: Record | None = None,
        **producer_options: Any,
    ) -> list[int]:
        """``count`` anchors on the consumer, a sender on each from the producer, each
        stream's first item sent; the streams' indices (unique within the cluster)."""
        first, self._next_stream = self._next_stream, self._next_stream + count
        command = {"op": "anchors", "first": first, "count": count, **(consumer_options or {})}
        handles = (await consumer.ask(command))["handles"]
        answer = await producer.ask({"op": "stream", "streams": handles, **producer_options}, 60)
        if answer["failed"]:
            raise AttachRoundFailed(producer.records_of(answer["failed"]), answer["attached"])
        return list(range(first, first + count))

    async def close(self) -> None:
        for process in reversed(self.processes):
            await process.stop()
        if self.proxy is not None:
            self.proxy.close()
