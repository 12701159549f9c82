"""``--impair loss=1%,delay=5ms``: the project's UDP impairment proxy in front of the engine.

The proxy (:mod:`velomux_quic.programs.demo.proxy`, which the test suite and the benchmarks use too)
runs as a process of its own, which keeps its CPU out of the engine's figures. The
frontends dial the proxy; the engine learns each frontend's return address from its
connection's source, the proxy's upstream socket, so both directions of both connections
cross it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from velomux_quic import ConfigurationError

__all__ = ["Impairment", "parse_impairment", "proxy_in_front_of"]

_ITEM = re.compile(r"^(loss|delay|jitter)=(\d+(?:\.\d+)?)(%|ms)?$")


@dataclass(frozen=True, slots=True)
class Impairment:
    """Each way: drop ``loss`` of the datagrams, delay the rest ``delay_ms`` (plus up to
    ``jitter_ms``)."""

    loss: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def describe(self) -> str:
        parts = [f"loss {self.loss:.1%}", f"delay {self.delay_ms:g} ms"]
        if self.jitter_ms:
            parts.append(f"jitter {self.jitter_ms:g} ms")
        return ", ".join(parts) + " each way"


def parse_impairment(text: str) -> Impairment:
    """``loss=1%,delay=5ms[,jitter=1ms]`` (loss also as a fraction: ``loss=0.01``).

    Raises :class:`~velomux_quic.errors.ConfigurationError` naming the part it could
    not read and the form it expects."""
    found: dict[str, float] = {}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        match = _ITEM.match(part)
        if match is None:
            raise ConfigurationError(
                f"--impair: cannot read {part!r}; write loss=1%,delay=5ms "
                "(loss in % or as a fraction, delay and jitter in ms)"
            )
        key, number, unit = match.group(1), float(match.group(2)), match.group(3)
        if key == "loss":
            if unit == "ms":
                raise ConfigurationError(f"--impair: loss is a rate (loss=1%), not {part!r}")
            value = number / 100 if unit == "%" else number
            if not 0 <= value < 1:
                raise ConfigurationError(f"--impair: loss must be below 100%, not {part!r}")
        else:
            if unit == "%":
                raise ConfigurationError(f"--impair: {key} is a time ({key}=5ms), not {part!r}")
            value = number
        found[key] = value
    if not found:
        raise ConfigurationError("--impair: give at least one of loss=, delay=, jitter=")
    return Impairment(
        loss=found.get("loss", 0.0),
        delay_ms=found.get("delay", 0.0),
        jitter_ms=found.get("jitter", 0.0),
    )


@contextlib.asynccontextmanager
async def proxy_in_front_of(
    target: tuple[str, int], impairment: Impairment, timeout: float
) -> AsyncIterator[tuple[tuple[str, int], dict[str, Any]]]:
    """Run the proxy forwarding to ``target``; yields (its address, its counters, filled
    in once it stopped)."""
    host, port = target
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "velomux_quic.programs.demo.proxy", "--target", f"{host}:{port}",
        "--loss", str(impairment.loss), "--delay-ms", str(impairment.delay_ms),
        "--jitter-ms", str(impairment.jitter_ms), "--seed", "1",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    counters: dict[str, Any] = {}
    try:
        assert process.stdout is not None and process.stdin is not None
        line = await asyncio.wait_for(process.stdout.readline(), timeout)
        if not line:
            raise ConfigurationError("the impairment proxy exited before it listened")
        where = json.loads(line)
        yield (str(where["host"]), int(where["port"])), counters
        process.stdin.close()  # end of input: it prints its counters and exits
        last = await asyncio.wait_for(process.stdout.read(), timeout)
        for text in last.decode().splitlines():
            if text.startswith("{") and "counters" in text:
                counters.update(json.loads(text)["counters"])
        await asyncio.wait_for(process.wait(), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
