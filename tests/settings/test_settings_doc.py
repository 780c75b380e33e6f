"""docs/settings.md is what the settings classes say (chatpipe/settings_doc.py writes it)."""

from __future__ import annotations

from chatpipe import settings_doc


def test_docs_settings_md_is_generated_from_the_settings_classes():
    expected = settings_doc.render()
    actual = settings_doc.DOC.read_text(encoding="utf-8") if settings_doc.DOC.is_file() else ""
    assert actual == expected, (f"docs/settings.md is not what the settings classes say: run "
                                f"`{settings_doc.REGENERATE}` (or `chatpipe settings docs --write`)")


def test_every_variable_is_documented_with_its_owner_and_help():
    rows = settings_doc.all_entries()
    assert {"CHATPIPE_BOOTSTRAP_SERVERS", "CHATPIPE_GATEWAY_PORT", "CHATPIPE_CLUSTER_BROKERS",
            "CHATPIPE_KAFKA_SECURITY_PROTOCOL"} <= {r.name for r in rows}
    assert not [f"{r.owner_name}.{r.field}" for r in rows if not r.help], "fields without a description"
    text = settings_doc.render()
    assert "| `CHATPIPE_GATEWAY_PORT` | `int` | `8000` | `GatewaySettings` (gateway.settings) | HTTP port |" in text
