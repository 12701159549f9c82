"""The ``velomux`` command at first contact, as a pip user meets it: run as an installed
command or ``python -m velomux_quic``, every usage or configuration mistake exits 2 with a
hint to copy, nothing sends the user to a checkout, and the QUIC engine a node runs is
said wherever the node says what it is."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.test_node_command import http_get, velomux_node
from velomux_quic import (
    CredentialsError,
    InstanceId,
    Node,
    NodeConfig,
    NodeCredentials,
    open_node,
    runtime_info,
)
from velomux_quic.programs.cli import build_parser, parsers
from velomux_quic.programs.example_config import EXAMPLE_CONFIG

pytestmark = pytest.mark.timeout(60)

CHECKOUT = Path(__file__).resolve().parents[2]
MODULE = [sys.executable, "-m", "velomux_quic"]


def velomux(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m velomux_quic ARGS`` run in ``cwd``, as a user would type ``velomux``."""
    return subprocess.run(
        [*MODULE, *args], capture_output=True, text=True, timeout=40, check=False, cwd=cwd,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_python_dash_m_and_the_installed_command_run_the_cli(tmp_path: Path) -> None:
    result = velomux("--version", cwd=tmp_path)
    assert result.returncode == 0 and "QUIC engine:" in result.stdout, result.stderr
    installed = shutil.which("velomux", path=str(Path(sys.executable).parent))
    assert installed is not None
    same = subprocess.run(
        [installed, "--version"], capture_output=True, text=True, timeout=40, check=False
    )
    assert same.stdout == result.stdout


def test_certs_dev_defaults_its_directory_as_demo_does_and_each_ca_has_its_own_name(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    for where in (first, second):
        result = velomux("certs", "dev", cwd=where)
        assert result.returncode == 0, result.stderr
        assert (where / "certs" / "dev" / "node-a" / "node.pem").exists()
    subjects = {
        NodeCredentials.load(where / "certs" / "dev" / "node-a").certificate.issuer.rfc4514_string()
        for where in (first, second)
    }
    assert len(subjects) == 2 and all(s.startswith("CN=velomux dev CA ") for s in subjects)


def test_a_misspelt_variable_is_warned_about_naming_the_closest_one(tmp_path: Path) -> None:
    result = velomux(
        "certs", "dev", "--out", str(tmp_path / "c"), cwd=tmp_path,
        env={"VELOMUX_TRANSPRT_LANES": "4"},
    )  # fmt: skip
    assert result.returncode == 0
    assert result.stderr.count("VELOMUX_TRANSPRT_LANES") == 1, result.stderr
    assert "did you mean VELOMUX_TRANSPORT_LANES?" in result.stderr


def test_a_program_opening_a_node_is_warned_once_about_a_misspelt_variable(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    make_credentials("a").save(tmp_path / "a")
    program = textwrap.dedent(
        f"""
        import asyncio
        from velomux_quic import open_node

        async def main():
            for _ in range(2):
                async with open_node({str(tmp_path / "a")!r}):
                    pass

        asyncio.run(main())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=40,
        check=False, env={**os.environ, "VELOMUX_MUX_DISABLED": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("VELOMUX_MUX_DISABLED is not one velomux reads") == 1
    assert "did you mean VELOMUX_MUX_DISABLE?" in result.stderr


def test_a_malformed_ops_address_exits_2_showing_the_form(tmp_path: Path) -> None:
    result = velomux("node", "--config", "node.toml", "--ops", "127.0.0.1:notaport", cwd=tmp_path)
    assert result.returncode == 2
    assert "invalid literal" not in result.stderr
    assert "HOST:PORT" in result.stderr and "--ops 127.0.0.1:9100" in result.stderr


def test_node_example_config_prints_the_sample_which_loads(tmp_path: Path) -> None:
    result = velomux("node", "--example-config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXAMPLE_CONFIG
    assert result.stdout == (CHECKOUT / "examples" / "node.toml").read_text()
    written = tmp_path / "node.toml"
    written.write_text(result.stdout)
    # Every key at its default (credentials relative to the working directory).
    assert NodeConfig.from_toml(written, environ={}) == NodeConfig()


def test_node_without_a_configuration_and_its_help_point_at_example_config(
    tmp_path: Path,
) -> None:
    result = velomux("node", cwd=tmp_path)
    assert result.returncode == 2
    assert "velomux node --example-config > node.toml" in result.stderr
    help_text = velomux("node", "--help", cwd=tmp_path).stdout
    assert "--example-config" in help_text
    assert "repository" not in help_text and "examples/node.toml" not in help_text


def test_demo_with_an_unusable_engine_exits_2_with_a_quoted_install_hint(tmp_path: Path) -> None:
    unknown = velomux(
        "demo", "--requests", "2", "--tokens", "1", cwd=tmp_path,
        env={"VELOMUX_QUIC_ENGINE": "qh4"},
    )  # fmt: skip
    assert unknown.returncode == 2 and "VELOMUX_QUIC_ENGINE" in unknown.stderr
    # qh3 named but not installed: the package metadata says it is absent.
    program = textwrap.dedent(
        """
        import importlib.metadata as metadata, sys
        real = metadata.version
        def version(name):
            if name == "qh3":
                raise metadata.PackageNotFoundError(name)
            return real(name)
        metadata.version = version
        from velomux_quic.programs.cli import main
        sys.exit(main(["demo", "--requests", "2", "--tokens", "1"]))
        """
    )
    missing = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=40,
        check=False, cwd=tmp_path, env={**os.environ, "VELOMUX_QUIC_ENGINE": "qh3"},
    )  # fmt: skip
    assert missing.returncode == 2, missing.stderr
    assert "pip install 'velomux_quic[qh3]'" in missing.stderr


async def test_a_missing_credentials_file_names_commands_a_pip_user_has(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError) as raised:
        await Node.start(tmp_path / "absent")
    message = str(raised.value)
    assert "velomux certs dev" in message and "make " not in message


async def test_the_engine_and_record_path_show_in_the_start_event_metrics_and_readyz(
    make_credentials: Callable[..., NodeCredentials], caplog: pytest.LogCaptureFixture
) -> None:
    info = runtime_info()
    with caplog.at_level(logging.INFO, logger="velomux_quic.node"):
        async with open_node(make_credentials("a")) as node:
            engine = node.snapshot().transport.engine.name
            assert node.build_info == {
                "version": info.version,
                "engine": engine,
                "record_path": info.record_path,
            }
            line = (
                f'velomux_build_info{{engine="{engine}",record_path="{info.record_path}",'
                f'version="{info.version}"}} 1.0'
            )
            assert line in node.metrics_text()
            host, port = await node.serve_ops()
            status, body = await asyncio.to_thread(http_get, host, port, "/readyz")
            assert status == 200 and f'"engine": "{engine}"' in body
            assert f'"record_path": "{info.record_path}"' in body
    start = [r for r in caplog.records if getattr(r, "event", None) == "node_start"]
    assert start[0].fields["engine"] == engine  # type: ignore[attr-defined]
    assert start[0].fields["record_path"] == info.record_path  # type: ignore[attr-defined]


@pytest.mark.one_loop
async def test_velomux_node_names_its_engine_and_keeps_the_engines_info_lines_out(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    service_dir = make_credentials("sink").save(tmp_path / "sink")
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\ncredentials = "{service_dir}"\n')
    async with (
        open_node(make_credentials("caller")) as caller,
        velomux_node(config, "--ops", "off", "--log-level", "info") as service,
    ):
        listening = await service.next_event("listening")
        assert listening["engine"] == caller.snapshot().transport.engine.name
        assert listening["record_path"] == runtime_info().record_path
        host, _, port = listening["address"].rpartition(":")
        sink = InstanceId.parse(listening["instance"])
        caller.add_peer(sink, (host, int(port)))
        await caller.connect(sink)  # one handshake: aioquic logs several INFO lines for it
        service.process.send_signal(signal.SIGTERM)
        await service.next_event("stopped")
        assert service.process.stderr is not None
        stderr = (await service.process.stderr.read()).decode()
    assert "logger=velomux_quic" in stderr  # the library's INFO lines do show
    assert "logger=quic" not in stderr, stderr


def test_a_program_without_logging_gets_no_engine_line_for_a_refused_handshake(
    tmp_path: Path,
) -> None:
    program = textwrap.dedent(
        """
        import asyncio, dataclasses
        from velomux_quic import DialError, open_node
        from velomux_quic.ids import new_instance_id
        from velomux_quic.security.certs import CertificateAuthority, issue_node_certificate

        ours, theirs = CertificateAuthority.create("ours"), CertificateAuthority.create("x")

        async def main():
            b = issue_node_certificate(ours, new_instance_id(), name="b")
            a = issue_node_certificate(theirs, new_instance_id(), name="a")
            a = dataclasses.replace(a, trust_roots=[theirs.certificate, ours.certificate])
            async with open_node(b) as node_b, open_node(a) as node_a:
                node_a.add_peer(node_b.instance_id, node_b.address)
                try:
                    await node_a.connect(node_b.instance_id)
                except DialError as error:
                    print("refused:", error.reason)

        asyncio.run(main())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=40,
        check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "refused: refused_by_peer:untrusted_chain" in result.stdout
    assert "Error: 304" not in result.stderr and result.stderr == "", result.stderr


def test_a_certs_command_refusing_its_arguments_exits_2_saying_what_to_pass(
    tmp_path: Path,
) -> None:
    assert velomux("certs", "init-ca", "--out", "ca", cwd=tmp_path).returncode == 0
    again = velomux("certs", "init-ca", "--out", "ca", cwd=tmp_path)
    assert again.returncode == 2 and "--force" in again.stderr
    missing = velomux("certs", "issue", "--ca", "nope", "--name", "n", "--out", "n", cwd=tmp_path)
    assert missing.returncode == 2 and "velomux certs" in missing.stderr


def test_no_command_help_sends_a_pip_user_to_a_checkout_or_make() -> None:
    for parser in parsers(build_parser()):
        text = parser.format_help()
        for word in ("`make", "'make", "make certs", "make demo", "repository", "checkout"):
            assert word not in text, (parser.prog, word)
        assert "examples/" not in text, parser.prog
