"""The rules that choose the model answering a request (transport/model_catalog.py): aliases, tenants,
canary shares by conversation, and a conversation keeping its version while that version is served."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemas.records import ModelState, ModelVersion
from transport.model_catalog import (ModelCatalog, ModelForbidden, ModelNotServed, canary_bucket, choose_model)

BASE = "smollm2-135m-instruct"
BASES = [BASE]


def version(name: str, number: int, state: ModelState, tenant: str | None = "acme", share: float = 0.0,
            updated_at: int = 1) -> ModelVersion:  # fmt: skip
    return ModelVersion(
        name=name, version=number, base_model=BASE, base_model_sha256="0" * 64, adapter_uri="/a", adapter_sha256="0",
        card_uri="/c", lineage_uri="/l", dataset_uri="/d", dataset_manifest_id="0", tenant=tenant, training_rows=1,
        state=state, canary_share=share, updated_at=updated_at,
    )  # fmt: skip


def test_an_exact_version_is_honoured_for_its_tenant_only_while_served():
    versions = [version("acme-lora", 1, ModelState.LIVE), version("acme-lora", 2, ModelState.RETIRED)]
    assert choose_model(versions, "acme-lora@1", "acme", "c1", BASES) == "acme-lora@1"
    with pytest.raises(ModelForbidden, match="another tenant's"):
        choose_model(versions, "acme-lora@1", "globex", "c1", BASES)
    with pytest.raises(ModelNotServed, match="is RETIRED"):
        choose_model(versions, "acme-lora@2", "acme", "c1", BASES)
    with pytest.raises(ModelNotServed, match="does not exist"):
        choose_model(versions, "acme-lora@9", "acme", "c1", BASES)


def test_the_base_name_means_the_tenants_live_version_and_a_name_is_an_alias():
    versions = [version("acme-lora", 1, ModelState.RETIRED), version("acme-lora", 2, ModelState.LIVE),
                version("shared-lora", 1, ModelState.LIVE, tenant=None)]
    assert choose_model(versions, BASE, "acme", "c1", BASES) == "acme-lora@2"
    assert choose_model(versions, "acme-lora", "acme", "c1", BASES) == "acme-lora@2"
    assert choose_model(versions, BASE, "globex", "c1", BASES) == "shared-lora@1"  # no own version: the shared one
    assert choose_model([], BASE, "acme", "c1", BASES) == BASE
    with pytest.raises(ModelForbidden):
        choose_model(versions, "acme-lora", "globex", "c1", BASES)
    with pytest.raises(ModelNotServed):
        choose_model(versions, "nothing", "acme", "c1", BASES)


def test_a_canary_takes_its_share_of_new_conversations_and_each_keeps_its_choice():
    live, canary = version("acme-lora", 1, ModelState.LIVE), version("acme-lora", 2, ModelState.CANARY, share=0.3)
    conversations = [f"acme/u/c{i}" for i in range(2000)]
    chosen = {c: choose_model([live, canary], BASE, "acme", c, BASES) for c in conversations}
    share = sum(m == "acme-lora@2" for m in chosen.values()) / len(chosen)
    assert 0.27 < share < 0.33
    assert all((m == "acme-lora@2") == (canary_bucket(c, "acme-lora@2") < 0.3) for c, m in chosen.items())
    # Raising the share moves no conversation that already chose: each passes its pin.
    wider = replace(canary, canary_share=0.9)
    assert all(choose_model([live, wider], BASE, "acme", c, BASES, pinned=m) == m for c, m in chosen.items())
    # Rolled back: its conversations choose again (the live version); the others keep theirs.
    rolled_back = replace(canary, state=ModelState.RETIRED)
    again = {c: choose_model([live, rolled_back], BASE, "acme", c, BASES, pinned=m) for c, m in chosen.items()}
    assert set(again.values()) == {"acme-lora@1"}
    # Promoted (v2 LIVE, v1 RETIRED): v1's conversations move to v2, v2's stay.
    promoted = [replace(live, state=ModelState.RETIRED), replace(canary, state=ModelState.LIVE)]
    assert {choose_model(promoted, BASE, "acme", c, BASES, pinned=m) for c, m in chosen.items()} == {"acme-lora@2"}


def test_a_conversation_begun_on_the_base_model_stays_there_when_a_version_goes_live():
    live = version("acme-lora", 1, ModelState.LIVE)
    assert choose_model([live], BASE, "acme", "c1", BASES, pinned=BASE) == BASE
    assert choose_model([live], BASE, "acme", "c2", BASES) == "acme-lora@1"


def test_a_conversation_that_asks_for_another_name_gets_it_and_keeps_it():
    acme, support = version("acme-lora", 1, ModelState.LIVE), version("acme-support", 1, ModelState.LIVE)
    assert choose_model([acme, support], "acme-support", "acme", "c1", BASES, pinned="acme-lora@1") == "acme-support@1"
    assert choose_model([acme, support], "acme-lora", "acme", "c1", BASES, pinned=BASE) == "acme-lora@1"
    assert choose_model([acme, support], "acme-lora", "acme", "c1", BASES, pinned="acme-lora@1") == "acme-lora@1"


def test_the_catalog_keeps_the_latest_record_and_lists_what_a_tenant_may_ask_for():
    catalog = ModelCatalog()
    catalog.apply(version("acme-lora", 1, ModelState.LIVE, updated_at=5))
    catalog.apply(version("acme-lora", 1, ModelState.CANARY, updated_at=3))  # older: the initial read again
    catalog.apply(version("acme-lora", 2, ModelState.CANARY, share=0.1, updated_at=6))
    catalog.apply(version("globex-lora", 1, ModelState.LIVE, tenant="globex"))
    listed = {m["id"]: m for m in catalog.listing("acme", BASES)}
    assert list(listed) == [BASE, "acme-lora@1", "acme-lora@2", "acme-lora"]
    assert listed["acme-lora@2"]["state"] == "CANARY" and listed["acme-lora@2"]["canary_share"] == 0.1
    assert listed["acme-lora"]["alias_of"] == "acme-lora@1" and listed["acme-lora"]["owned_by"] == "acme"
    assert catalog.check("acme-lora@2", "acme", BASES) == "acme-lora@2"  # its workers: those holding it
    assert catalog.check("acme-lora", "acme", BASES) == BASE
    with pytest.raises(ModelForbidden):
        catalog.check("globex-lora@1", "acme", BASES)


def test_state_changes_by_hand_are_whole_records_and_refuse_what_the_state_does_not_allow():
    from transport.model_registry import TransitionError, canary, promote, rollback

    versions = {"acme-lora@1": version("acme-lora", 1, ModelState.LIVE),
                "acme-lora@2": version("acme-lora", 2, ModelState.CANDIDATE),
                "globex-lora@1": version("globex-lora", 1, ModelState.LIVE, tenant="globex")}
    (started,) = canary(versions, "acme-lora@2", 0.25, "try it")
    assert (started.state, started.canary_share, started.state_reason) == (ModelState.CANARY, 0.25, "try it")
    versions["acme-lora@2"] = started
    new_live, retired = promote(versions, "acme-lora@2", "better")
    assert (new_live.state, new_live.canary_share) == (ModelState.LIVE, 0.0)
    assert (retired.name, retired.version, retired.state) == ("acme-lora", 1, ModelState.RETIRED)
    assert retired.state_reason == "replaced by acme-lora@2"
    (back,) = rollback({"acme-lora@2": started}, "acme-lora@2", "worse")
    assert back.state is ModelState.RETIRED
    with pytest.raises(TransitionError, match="cannot roll back acme-lora@1: it is LIVE"):
        rollback(versions, "acme-lora@1", "no")
    with pytest.raises(TransitionError, match=r"share must be in \(0, 1\]"):
        canary(versions, "acme-lora@2", 1.5, "no")
    with pytest.raises(TransitionError, match="no model version acme-lora@7"):
        promote(versions, "acme-lora@7", "no")
