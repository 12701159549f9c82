"""The transport layer's old name for its endpoint still resolves, with a warning that says
what replaced it, so a program written against it keeps running for a release."""

from __future__ import annotations

import pytest

import velomux_quic.transport as transport

pytestmark = pytest.mark.timeout(10)


def test_the_old_endpoint_name_warns_and_is_the_endpoint() -> None:
    with pytest.warns(DeprecationWarning, match="QuicTransport is now QuicEndpoint") as seen:
        old = transport.QuicTransport
    assert old is transport.QuicEndpoint
    assert seen[0].filename == __file__  # the warning points at the line that used it


def test_a_misspelt_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="QuicEndpiont"):
        _ = transport.QuicEndpiont  # type: ignore[attr-defined]
