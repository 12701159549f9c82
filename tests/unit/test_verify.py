"""SPIFFE identities and PeerVerifier: what it accepts, and each reason it refuses."""

from __future__ import annotations

import pickle
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509 import ObjectIdentifier
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import given
from hypothesis import strategies as st

from velomux_quic.ids import InstanceId, new_instance_id
from velomux_quic.security import testing
from velomux_quic.security.certs import (
    CertificateAuthority,
    NodeCredentials,
    generate_private_key,
    issue_node_certificate,
)
from velomux_quic.security.identity import (
    DEFAULT_TRUST_DOMAIN,
    instance_from_spiffe,
    parse_spiffe,
    spiffe_uri,
    validate_trust_domain,
)
from velomux_quic.security.verify import PeerRole, PeerVerificationError, PeerVerifier

# --- SPIFFE identity ----------------------------------------------------------------------

SAMPLE = InstanceId(uuid.UUID("0d4c6a1e-52b1-4c8e-9d41-8a3f0c2b7e55"))
SAMPLE_URI = "spiffe://velomux.local/instance/0d4c6a1e-52b1-4c8e-9d41-8a3f0c2b7e55"

trust_domains = st.from_regex(r"[a-z0-9_-]{1,12}(\.[a-z0-9_-]{1,12}){0,3}", fullmatch=True)
instances = st.uuids().map(InstanceId)


def test_spiffe_uri_format() -> None:
    assert DEFAULT_TRUST_DOMAIN == "velomux.local"
    assert spiffe_uri(SAMPLE, DEFAULT_TRUST_DOMAIN) == SAMPLE_URI
    assert instance_from_spiffe(SAMPLE_URI, DEFAULT_TRUST_DOMAIN) == SAMPLE


@given(instances, trust_domains)
def test_spiffe_round_trip(instance: InstanceId, trust_domain: str) -> None:
    uri = spiffe_uri(instance, trust_domain)
    assert instance_from_spiffe(uri, trust_domain) == instance
    assert parse_spiffe(uri) == (trust_domain, instance)


@given(st.text(max_size=120))
def test_anything_accepted_is_exactly_one_canonical_uri(text: str) -> None:
    try:
        instance = instance_from_spiffe(text, DEFAULT_TRUST_DOMAIN)
    except ValueError:
        return
    assert spiffe_uri(instance, DEFAULT_TRUST_DOMAIN) == text


@given(instances, trust_domains, trust_domains)
def test_another_trust_domain_is_refused(instance: InstanceId, ours: str, theirs: str) -> None:
    uri = spiffe_uri(instance, theirs)
    if theirs == ours:
        assert instance_from_spiffe(uri, ours) == instance
    else:
        with pytest.raises(ValueError, match="trust domain"):
            instance_from_spiffe(uri, ours)


_U = "0d4c6a1e-52b1-4c8e-9d41-8a3f0c2b7e55"


@pytest.mark.parametrize(
    "uri",
    [
        f"spiffe://other.example/instance/{_U}",
        f"spiffe://velomux.local/node/{_U}",
        f"spiffe://velomux.local/instance/{_U}/extra",
        f"spiffe://velomux.local/instance/{_U}/",
        f"spiffe://velomux.local//instance/{_U}",
        f"spiffe://velomux.local/instance/{_U.upper()}",
        f"spiffe://velomux.local/instance/{{{_U}}}",
        f"spiffe://velomux.local/instance/{_U.replace('-', '')}",
        f"spiffe://velomux.local/instance/urn:uuid:{_U}",
        f"spiffe://velomux.local/instance/{_U}?x=1",
        f"spiffe://velomux.local/instance/{_U}#frag",
        f"spiffe://velomux.local/instance/{_U}\n",
        f" spiffe://velomux.local/instance/{_U}",
        f"spiffe://velomux.local:443/instance/{_U}",
        f"spiffe://user@velomux.local/instance/{_U}",
        f"spiffe://VELOMUX.LOCAL/instance/{_U}",
        f"SPIFFE://velomux.local/instance/{_U}",
        f"https://velomux.local/instance/{_U}",
        f"urn:velomux:instance:{_U}",
        f"spiffe://velomux.local/instance/{_U[:-1]}",
        f"spiffe://velomux.local/instance/{_U[:-1]}g",
        "spiffe://velomux.local/instance/",
        "spiffe://velomux.local",
        "",
    ],
)
def test_malformed_identities_are_refused(uri: str) -> None:
    with pytest.raises(ValueError):
        instance_from_spiffe(uri, DEFAULT_TRUST_DOMAIN)


@pytest.mark.parametrize("bad", ["", "UPPER", "a b", "a/b", "a:1", "..", ".a", "a.", "é.example"])
def test_invalid_trust_domains_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="trust domain"):
        validate_trust_domain(bad)
    with pytest.raises(ValueError):
        spiffe_uri(SAMPLE, bad)


# --- PeerVerifier: acceptance -------------------------------------------------------------


@pytest.fixture
def verifier(ca: CertificateAuthority) -> PeerVerifier:
    return PeerVerifier([ca.certificate], ca.trust_domain)


@pytest.fixture
def node(ca: CertificateAuthority) -> NodeCredentials:
    return issue_node_certificate(ca, new_instance_id(), name="node-a")


@pytest.mark.parametrize("role", ["client", "server"])
def test_a_good_node_is_accepted_in_either_role(
    verifier: PeerVerifier, node: NodeCredentials, role: PeerRole
) -> None:
    assert verifier.verify(node.certificate, [], role=role) == node.instance_id
    assert verifier.verify(node.certificate, [], role=role, expected=node.instance_id) == (
        node.instance_id
    )


def test_every_root_in_the_list_is_trusted(
    ca: CertificateAuthority, other_ca: CertificateAuthority
) -> None:
    """A rotation keeps the old and the new CA side by side, in either order."""
    old = issue_node_certificate(ca, new_instance_id(), name="old")
    new = issue_node_certificate(other_ca, new_instance_id(), name="new")
    for roots in ([ca.certificate, other_ca.certificate], [other_ca.certificate, ca.certificate]):
        both = PeerVerifier(roots, ca.trust_domain)
        assert both.verify(old.certificate, [], role="client") == old.instance_id
        assert both.verify(new.certificate, [], role="server") == new.instance_id


def test_naive_and_aware_now_mean_the_same_instant(
    verifier: PeerVerifier, node: NodeCredentials
) -> None:
    later = node.certificate.not_valid_after_utc + timedelta(seconds=1)
    for now in (later, later.replace(tzinfo=None)):
        with pytest.raises(PeerVerificationError) as caught:
            verifier.verify(node.certificate, [], role="client", now=now)
        assert caught.value.reason == "expired"


def test_a_server_only_certificate_may_be_dialed(
    ca: CertificateAuthority, verifier: PeerVerifier
) -> None:
    creds = testing.issue_with_usages(
        ca, new_instance_id(), name="s", extended_key_usages=testing.SERVER_ONLY
    )
    assert verifier.verify(creds.certificate, [], role="server") == creds.instance_id


# --- PeerVerifier: each refusal -----------------------------------------------------------


def _refusal(
    verifier: PeerVerifier,
    creds: NodeCredentials,
    role: PeerRole = "client",
    *,
    expected: InstanceId | None = None,
    now: datetime | None = None,
) -> PeerVerificationError:
    with pytest.raises(PeerVerificationError) as caught:
        verifier.verify(creds.certificate, creds.chain, role=role, expected=expected, now=now)
    return caught.value


@pytest.mark.parametrize("role", ["client", "server"])
def test_no_certificate(verifier: PeerVerifier, role: PeerRole) -> None:
    with pytest.raises(PeerVerificationError) as caught:
        verifier.verify(None, [], role=role)
    assert caught.value.reason == "no_certificate"
    assert "no certificate" in str(caught.value)


@pytest.mark.parametrize("role", ["client", "server"])
def test_a_certificate_from_another_ca(
    verifier: PeerVerifier, other_ca: CertificateAuthority, role: PeerRole
) -> None:
    stranger = issue_node_certificate(other_ca, new_instance_id(), name="stranger")
    error = _refusal(verifier, stranger, role)
    assert error.reason == "untrusted_chain"
    assert "not issued by a CA this node trusts" in str(error)


def test_expired(ca: CertificateAuthority, verifier: PeerVerifier) -> None:
    error = _refusal(verifier, testing.issue_expired(ca, new_instance_id(), name="old"))
    assert error.reason == "expired"
    assert "expired at" in str(error)


def test_expired_relative_to_the_given_now(verifier: PeerVerifier, node: NodeCredentials) -> None:
    later = datetime.now(UTC) + timedelta(days=400)
    assert _refusal(verifier, node, now=later).reason == "expired"


def test_not_yet_valid(ca: CertificateAuthority, verifier: PeerVerifier) -> None:
    error = _refusal(verifier, testing.issue_not_yet_valid(ca, new_instance_id(), name="early"))
    assert error.reason == "not_yet_valid"
    assert "clocks" in str(error)


def test_an_expired_cluster_ca_is_reported_as_expired() -> None:
    short = CertificateAuthority.create(valid_for=timedelta(days=2))
    far = datetime.now(UTC) + timedelta(days=30)
    creds = issue_node_certificate(short, new_instance_id(), name="n", not_after=far)
    verifier = PeerVerifier([short.certificate], short.trust_domain)
    error = _refusal(verifier, creds, now=datetime.now(UTC) + timedelta(days=5))
    assert error.reason == "expired"
    assert "cluster CA" in str(error)


@pytest.mark.parametrize("mimic_issuer", [False, True])
@pytest.mark.parametrize("role", ["client", "server"])
def test_a_self_signed_copy_of_a_real_node(
    verifier: PeerVerifier, node: NodeCredentials, mimic_issuer: bool, role: PeerRole
) -> None:
    forged = testing.self_signed_copy(node, mimic_issuer=mimic_issuer)
    error = _refusal(verifier, forged, role)
    assert error.reason == "untrusted_chain"


def test_a_self_signed_copy_sent_with_the_real_ca_as_intermediate(
    ca: CertificateAuthority, verifier: PeerVerifier, node: NodeCredentials
) -> None:
    forged = testing.self_signed_copy(node, mimic_issuer=True)
    with pytest.raises(PeerVerificationError) as caught:
        verifier.verify(forged.certificate, [ca.certificate], role="client")
    assert caught.value.reason == "untrusted_chain"


def test_a_ca_certificate_is_not_a_node(ca: CertificateAuthority, verifier: PeerVerifier) -> None:
    with pytest.raises(PeerVerificationError) as caught:
        verifier.verify(ca.certificate, [], role="client")
    assert caught.value.reason == "untrusted_chain"


@pytest.mark.parametrize(
    ("usages", "role", "missing"),
    [
        (testing.SERVER_ONLY, "client", "clientAuth"),
        (testing.CLIENT_ONLY, "server", "serverAuth"),
        (None, "client", "extendedKeyUsage"),
        (None, "server", "extendedKeyUsage"),
    ],
)
def test_extended_key_usage_must_name_the_role(
    ca: CertificateAuthority,
    verifier: PeerVerifier,
    usages: tuple[ObjectIdentifier, ...] | None,
    role: PeerRole,
    missing: str,
) -> None:
    creds = testing.issue_with_usages(ca, new_instance_id(), name="u", extended_key_usages=usages)
    error = _refusal(verifier, creds, role)
    assert error.reason == "bad_key_usage"
    assert missing in str(error)


def test_key_usage_must_allow_digital_signature(
    ca: CertificateAuthority, verifier: PeerVerifier
) -> None:
    creds = testing.issue_with_usages(
        ca,
        new_instance_id(),
        name="u",
        extended_key_usages=testing.CLIENT_ONLY + testing.SERVER_ONLY,
        digital_signature=False,
    )
    error = _refusal(verifier, creds)
    assert error.reason == "bad_key_usage"
    assert "digitalSignature" in str(error)


def test_identity_mismatch(verifier: PeerVerifier, node: NodeCredentials) -> None:
    other = new_instance_id()
    error = _refusal(verifier, node, "server", expected=other)
    assert error.reason == "identity_mismatch"
    assert str(node.instance_id) in str(error) and str(other) in str(error)


def test_a_foreign_trust_domain_signed_by_our_ca(
    ca: CertificateAuthority, verifier: PeerVerifier
) -> None:
    creds = testing.issue_with_uris(ca, [spiffe_uri(new_instance_id(), "other.example")], name="f")
    error = _refusal(verifier, creds)
    assert error.reason == "bad_identity"
    assert "other.example" in str(error)


def test_a_verifier_for_another_trust_domain_refuses_our_nodes(
    ca: CertificateAuthority, node: NodeCredentials
) -> None:
    elsewhere = PeerVerifier([ca.certificate], "prod.example")
    assert _refusal(elsewhere, node).reason == "bad_identity"


@pytest.mark.parametrize(
    "uris",
    [
        pytest.param([], id="none"),
        pytest.param(
            [
                spiffe_uri(new_instance_id(), DEFAULT_TRUST_DOMAIN),
                spiffe_uri(new_instance_id(), DEFAULT_TRUST_DOMAIN),
            ],
            id="two",
        ),
        pytest.param(
            [
                spiffe_uri(new_instance_id(), DEFAULT_TRUST_DOMAIN),
                spiffe_uri(new_instance_id(), "other.example"),
            ],
            id="ours-and-foreign",
        ),
        pytest.param([f"spiffe://velomux.local/node/{new_instance_id()}"], id="other-path"),
        pytest.param([f"SPIFFE://velomux.local/instance/{new_instance_id()}"], id="upper-scheme"),
    ],
)
def test_the_certificate_must_name_exactly_one_node(
    ca: CertificateAuthority, verifier: PeerVerifier, uris: list[str]
) -> None:
    creds = testing.issue_with_uris(ca, uris, name="m")
    assert _refusal(verifier, creds).reason == "bad_identity"


def test_dates_are_checked_before_the_chain(
    other_ca: CertificateAuthority, verifier: PeerVerifier
) -> None:
    """An expired certificate from a stranger is reported as expired: the precise reason."""
    stale = testing.issue_expired(other_ca, new_instance_id(), name="stale")
    assert _refusal(verifier, stale).reason == "expired"


def _ca_restricted_to(usage: ObjectIdentifier) -> CertificateAuthority:
    """A CA whose own extendedKeyUsage limits what it may vouch for (made by hand)."""
    key = generate_private_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "restricted CA")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertificateAuthority(certificate, key, DEFAULT_TRUST_DOMAIN)


def test_a_ca_restricted_to_server_auth_vouches_only_for_servers() -> None:
    restricted = _ca_restricted_to(ExtendedKeyUsageOID.SERVER_AUTH)
    creds = issue_node_certificate(restricted, new_instance_id(), name="n")
    verifier = PeerVerifier([restricted.certificate], DEFAULT_TRUST_DOMAIN)
    assert verifier.verify(creds.certificate, [], role="server") == creds.instance_id
    error = _refusal(verifier, creds, "client")
    assert error.reason == "untrusted_chain"
    assert "may not vouch for a TLS client" in str(error)


# --- construction and the error type ------------------------------------------------------


def test_a_verifier_needs_a_root_and_a_valid_trust_domain(ca: CertificateAuthority) -> None:
    with pytest.raises(ValueError, match="trust root"):
        PeerVerifier([], DEFAULT_TRUST_DOMAIN)
    with pytest.raises(ValueError, match="trust domain"):
        PeerVerifier([ca.certificate], "Not A Domain")


def test_an_unknown_role_is_a_programming_error(
    verifier: PeerVerifier, node: NodeCredentials
) -> None:
    with pytest.raises(ValueError, match="role"):
        verifier.verify(node.certificate, [], role="peer")  # type: ignore[arg-type]


def test_the_error_keeps_its_reason_through_pickling() -> None:
    error = PeerVerificationError("expired", "it expired")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.reason == "expired" and str(copy) == "it expired"
    with pytest.raises(ValueError):
        PeerVerificationError("bogus", "x")  # type: ignore[arg-type]
