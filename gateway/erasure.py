"""The gateway's erasure routes: ask the pipeline to forget a user or one conversation.

    DELETE /v1/users/{user}                                   every conversation of that end user
    DELETE /v1/users/{user}/conversations/{conversation_id}   one conversation of theirs
    DELETE /v1/conversations/{conversation_id}                one conversation of the key's own
                                                              requests that named no user

Each produces one ``Deletion`` to ``chat.deletions`` (key ``<tenant>/<user_id>``, the log kept
forever) and answers **202** with the deletion's event id once the broker has it: the erasure
itself happens downstream, in seconds for memory and state and the archive, at the next build for
datasets, by retention for topics (docs/privacy.md). ``chatpipe forget --verify`` shows what is
left, and ``chat.deletions.audit`` which store acknowledged.

Who may erase whom is who may act for whom: ``{user}`` is resolved exactly as a chat request's
``user`` field (``keys.resolve_user``): a key bound to a user erases that user only, a
multi-user key erases the users it names (under its namespace), a plain key names nobody (403)
and erases its own conversations through ``/v1/conversations/{id}``. The tenant is always the
key's. Errors are OpenAI-shaped.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import Depends, FastAPI

from gateway.keys import Principal, resolve_user
from gateway.openai_api import OpenAIError
from gateway.translate import checked_conversation_id
from schemas.records import Deletion, DeletionScope
from schemas.requests import LIMITS
from schemas.topics import DELETIONS, deletion_key
from transport.errors import DeliveryError


def add_erasure_routes(app: FastAPI, authenticate: Callable[..., Principal], service: Any) -> None:
    """Register the DELETE routes on ``app`` (``service``: the app's ``GatewayService``, whose producer
    sends the deletions; ``authenticate``: the app's API-key dependency)."""

    @app.delete("/v1/users/{user}", status_code=202)
    async def forget_user(user: str, principal: Principal = Depends(authenticate)) -> dict[str, Any]:
        return await _forget(service, principal, _named_user(user), None)

    @app.delete("/v1/users/{user}/conversations/{conversation_id}", status_code=202)
    async def forget_user_conversation(user: str, conversation_id: str,
                                       principal: Principal = Depends(authenticate)) -> dict[str, Any]:
        return await _forget(service, principal, _named_user(user), conversation_id)

    @app.delete("/v1/conversations/{conversation_id}", status_code=202)
    async def forget_conversation(conversation_id: str, principal: Principal = Depends(authenticate)) -> dict[str, Any]:
        # The requests of this key that named no user belong to its default user (bound keys: their user).
        return await _forget(service, principal, None, conversation_id)


def _named_user(user: str) -> str:
    if not user.strip():
        raise OpenAIError(400, "the user in the path is empty; DELETE /v1/users/<user>", param="user",
                          code="invalid_value")
    if len(user) > LIMITS.max_user_chars:
        raise OpenAIError(400, f"the user in the path has {len(user)} characters; at most {LIMITS.max_user_chars}",
                          param="user", code="invalid_value")
    return user


async def _forget(service: Any, principal: Principal, user: str | None, conversation_id: str | None) -> dict[str, Any]:
    """Produce the Deletion of ``user`` (as the key names it; None: the key's default user) or of one
    of their conversations."""
    user_id = resolve_user(principal, user).user_id
    if conversation_id is not None:
        conversation_id = checked_conversation_id(conversation_id, param="conversation_id")
    scope = DeletionScope.USER if conversation_id is None else DeletionScope.CONVERSATION
    deletion = Deletion(scope=scope, tenant=principal.tenant, user_id=user_id, conversation_id=conversation_id)
    try:
        await service.producer.send(service.kafka.topic(DELETIONS), deletion,
                                    key=deletion_key(principal.tenant, user_id))
    except DeliveryError as exc:
        raise OpenAIError(503, f"the deletion was not stored, nothing will be erased; retry: {exc}",
                          type="server_error", code="kafka_unavailable") from None
    # user_id: the id the pipeline stores (a multi-user key's users are namespaced), for `chatpipe forget --verify`
    return {"object": "deletion", "event_id": deletion.event_id, "scope": scope.value.lower(), "user_id": user_id,
            "conversation_id": conversation_id, "created_at": deletion.created_at, "status": "accepted"}
