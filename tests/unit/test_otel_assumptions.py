"""The one private part of OpenTelemetry's API the tracing gate reads, pinned.

``velomux_quic/tracing/otel.py`` (its ``Gate``) reads ``opentelemetry.trace._TRACER_PROVIDER``
to learn cheaply whether the application has set a tracer provider. Each test here pins
what it relies on, in a process of its own (the API lets a process set its provider only
once), so an API upgrade that changes it fails here, by name, first. This is the only test
module that reads OpenTelemetry's private names.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("opentelemetry.sdk")


def run(code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_the_module_global_is_none_until_a_provider_is_set_and_then_that_provider() -> None:
    run(
        """
        import os
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from velomux_quic.tracing.otel import Gate

        assert "OTEL_PYTHON_TRACER_PROVIDER" not in os.environ
        assert trace._TRACER_PROVIDER is None
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        gate = Gate()
        assert not gate()
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
        assert trace._TRACER_PROVIDER is provider
        assert trace.get_tracer_provider() is provider
        assert gate()
        trace.set_tracer_provider(TracerProvider())  # refused: the first one stays
        assert trace._TRACER_PROVIDER is provider
        """
    )


@pytest.mark.timeout(60)
def test_an_explicit_no_op_provider_keeps_the_gate_shut() -> None:
    run(
        """
        from opentelemetry import trace
        from velomux_quic.tracing.otel import Gate

        trace.set_tracer_provider(trace.NoOpTracerProvider())
        assert trace._TRACER_PROVIDER is not None
        gate = Gate()
        assert not gate() and not gate()
        assert Gate(forced=True)()
        """
    )


@pytest.mark.timeout(60)
def test_a_provider_named_by_the_environment_is_set_when_the_gate_is_made() -> None:
    run(
        """
        import os
        os.environ["OTEL_PYTHON_TRACER_PROVIDER"] = "sdk_tracer_provider"
        from opentelemetry import trace
        from velomux_quic.tracing.otel import Gate

        assert trace._TRACER_PROVIDER is None
        gate = Gate()
        assert trace._TRACER_PROVIDER is not None
        assert gate()
        """
    )
