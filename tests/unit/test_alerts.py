"""The refusals' TLS alerts, kept as plain codes, are the alerts both engines name so."""

from __future__ import annotations

import importlib.util

import pytest
from aioquic import tls

from velomux_quic.security.alerts import alert_code_of, parse_refusal_reason

REFUSALS = [
    ("no_certificate", "certificate_required"),
    ("expired", "certificate_expired"),
    ("not_yet_valid", "certificate_expired"),
    ("untrusted_chain", "unknown_ca"),
    ("bad_key_usage", "unsupported_certificate"),
    ("bad_identity", "bad_certificate"),
    ("identity_mismatch", "bad_certificate"),
    ("bad_signature", "decrypt_error"),
]


@pytest.mark.parametrize(("reason", "alert"), REFUSALS)
def test_each_refusal_is_sent_as_its_alert(reason: str, alert: str) -> None:
    assert alert_code_of(reason) == tls.AlertDescription[alert]
    if importlib.util.find_spec("qh3") is not None:
        from qh3 import tls as qtls

        assert alert_code_of(reason) == qtls.AlertDescription[alert]
    assert parse_refusal_reason(reason) == reason
    assert parse_refusal_reason(f"{reason}: the details an older node sent") == reason


def test_an_unknown_reason_is_a_bad_certificate_and_no_refusal_code() -> None:
    assert alert_code_of("something else") == tls.AlertDescription.bad_certificate
    assert parse_refusal_reason("idle timeout") is None
