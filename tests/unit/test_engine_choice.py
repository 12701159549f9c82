"""Choosing the QUIC engine: TransportConfig, the node's TOML, VELOMUX_QUIC_ENGINE, and a
clear error when qh3 is chosen but not installed."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from velomux_quic.config import NodeConfig
from velomux_quic.errors import ConfigurationError
from velomux_quic.programs.cli import main
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.engine_choice import (
    ENGINE_ENVIRONMENT,
    engine_features,
    resolve_engine,
)


def test_the_default_is_aioquic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_ENVIRONMENT, raising=False)
    assert resolve_engine(TransportConfig()) == "aioquic"


def test_the_environment_chooses_for_a_config_that_names_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENGINE_ENVIRONMENT, "QH3")
    assert resolve_engine(TransportConfig()) == "qh3"
    assert resolve_engine(TransportConfig(engine="aioquic")) == "aioquic"  # the config wins


def test_an_unknown_engine_is_refused_saying_which_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="engine must be 'aioquic' or 'qh3'"):
        TransportConfig(engine="quiche")
    monkeypatch.setenv(ENGINE_ENVIRONMENT, "quiche")
    with pytest.raises(ConfigurationError, match="VELOMUX_QUIC_ENGINE='quiche' names no QUIC"):
        resolve_engine(TransportConfig())


def test_the_node_toml_names_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('[transport]\nengine = "qh3"\n')
    assert NodeConfig.from_toml(path, environ={}).transport.engine == "qh3"
    path.write_text('[transport]\nengine = "nope"\n')
    with pytest.raises(ConfigurationError, match=r"transport.*engine must be"):
        NodeConfig.from_toml(path, environ={})


def test_qh3_chosen_but_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version

    def without_qh3(package: str) -> str:
        if package == "qh3":
            raise importlib.metadata.PackageNotFoundError(package)
        return real(package)

    monkeypatch.setattr(importlib.metadata, "version", without_qh3)
    with pytest.raises(ConfigurationError, match=r"pip install 'velomux_quic\[qh3\]'"):
        engine_features("qh3")


def test_version_names_the_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENGINE_ENVIRONMENT, "aioquic")
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("velomux_quic ")
    assert "QUIC engine: aioquic " in out and "engines installed: aioquic" in out
