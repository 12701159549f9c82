"""The oracle soak (tests/soak/oracle_soak.py) in the suite: 15 s by default, 5 minutes
under ``make test-slow``; ``make soak SOAK_SECONDS=...`` runs it for as long as wanted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.soak.oracle_soak import soak
from velomux_quic import NodeCredentials

pytestmark = pytest.mark.one_loop  # two node processes for seconds: uvloop alone by default


async def run_soak(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials], seconds: float
) -> None:
    uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    tally = await soak(
        tmp_path, make_credentials, seconds=seconds, uvloop=uvloop, progress=max(5.0, seconds / 10)
    )
    assert tally.violations == []
    assert tally.streams >= 50 and tally.cancelled >= 1, tally  # it really ran, cancels too


@pytest.mark.timeout(120)
async def test_a_short_oracle_soak_through_loss_delivers_everything_with_flat_memory(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    await run_soak(tmp_path, make_credentials, 15.0)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_five_minute_oracle_soak_through_loss(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    await run_soak(tmp_path, make_credentials, 300.0)
