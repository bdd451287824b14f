"""The hand-over's wire form (runtime/handover.py): what a draining decode writes, a router reads
back as the same typed outcome; what is not a hand-over, or a move whose offer is not
well-formed, reads as such."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.handover import Handover, KVOffer
from runtime.messages import FinishKind, FinishReason

OFFER = KVOffer("10.0.0.7", 8999, 2**63 - 1, "decode-1")


@pytest.mark.parametrize("handover", [Handover("moved", OFFER), Handover("drained")])
def test_the_wire_form_reads_back_as_itself(handover: Handover) -> None:
    wire = handover.to_wire()
    assert wire["kind"] == handover.kind and wire["message"]
    assert Handover.from_wire(wire) == handover


def test_the_offer_names_the_fields_a_router_sends_on() -> None:
    assert OFFER.to_wire() == {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8999,
                               "bootstrap_room": 2**63 - 1, "instance_id": "decode-1"}
    assert Handover("moved", OFFER).without_offer() == Handover("moved")


@pytest.mark.parametrize("spoil", [{"bootstrap_port": 70000}, {"bootstrap_port": True},
                                   {"bootstrap_room": -1}, {"bootstrap_room": 2**63},
                                   {"bootstrap_host": ""}, {"instance_id": None}])
def test_a_move_whose_offer_is_spoiled_has_none(spoil: dict[str, Any]) -> None:
    wire = Handover("moved", OFFER).to_wire()
    wire["kv_offer"] = {**wire["kv_offer"], **spoil}
    assert Handover.from_wire(wire) == Handover("moved")


@pytest.mark.parametrize("wire", [None, "moved", {}, {"kind": "abort"}, {"kind": "error"}])
def test_anything_else_is_no_hand_over(wire: Any) -> None:
    assert Handover.from_wire(wire) is None


def test_only_the_two_finish_kinds_are_hand_overs() -> None:
    assert FinishReason("moved", offer=OFFER).handover() == Handover("moved", OFFER)
    assert FinishReason("drained", message="bye").handover() == Handover("drained")
    ends: tuple[FinishKind, ...] = ("stop", "length", "abort")
    assert all(FinishReason(kind).handover() is None for kind in ends)
