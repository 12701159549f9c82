"""The Initial admission rule, sans-IO: address validation first, then the per-source and
overall budgets, counted apart for validated and unvalidated handshakes."""

from __future__ import annotations

from velomux_quic.transport.handshakes import HandshakeBudget, Verdict


def _budget() -> HandshakeBudget:
    return HandshakeBudget(retry_threshold=4, max_half_open=6, max_per_source=2)


def test_unvalidated_initials_get_slots_until_their_source_is_full_then_a_retry() -> None:
    budget = _budget()
    for number in range(2):
        assert budget.verdict("10.0.0.1", validated=False).verdict is Verdict.ACCEPT
        budget.opened(number, "10.0.0.1", validated=False)
    decision = budget.verdict("10.0.0.1", validated=False)
    assert (decision.verdict, decision.reason) == (Verdict.RETRY, "handshake_per_source")
    assert budget.verdict("10.0.0.2", validated=False).verdict is Verdict.ACCEPT


def test_past_the_retry_threshold_every_unvalidated_initial_is_retried() -> None:
    budget = _budget()
    for number, source in enumerate(["a", "a", "b", "b"]):
        budget.opened(number, source, validated=False)
    decision = budget.verdict("c", validated=False)
    assert (decision.verdict, decision.reason) == (Verdict.RETRY, "handshake_retry")


def test_a_validated_initial_is_never_refused_for_slots_unvalidated_ones_fill() -> None:
    budget = _budget()
    for number in range(2):  # the flood: the peer's own address, unvalidated
        budget.opened(number, "10.0.0.1", validated=False)
    decision = budget.verdict("10.0.0.1", validated=True)
    assert (decision.verdict, decision.reason) == (Verdict.ACCEPT, None)
    budget.opened("peer", "10.0.0.1", validated=True)
    assert budget.in_progress == 3 and budget.validated_in_progress == 1


def test_validated_initials_have_their_own_per_source_and_overall_bounds() -> None:
    budget = _budget()
    budget.opened(1, "a", validated=True)
    budget.opened(2, "a", validated=True)
    decision = budget.verdict("a", validated=True)
    assert (decision.verdict, decision.reason) == (Verdict.DROP, "handshake_per_source")
    for number, source in enumerate(["b", "b", "c", "c"], start=3):
        budget.opened(number, source, validated=True)
    decision = budget.verdict("d", validated=True)
    assert (decision.verdict, decision.reason) == (Verdict.DROP, "handshake_overload")


def test_an_ended_handshake_frees_its_slot_once() -> None:
    budget = _budget()
    budget.opened("x", "a", validated=False)
    budget.opened("y", "a", validated=False)
    assert budget.verdict("a", validated=False).verdict is Verdict.RETRY
    assert budget.ended("x") is True
    assert budget.ended("x") is False
    assert budget.verdict("a", validated=False).verdict is Verdict.ACCEPT
    assert budget.ended("y") and budget.in_progress == 0
