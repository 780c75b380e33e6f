"""OAUTHBEARER tokens for the asyncio clients (Faust/aiokafka), from an OIDC token endpoint.

librdkafka (``sasl.oauthbearer.method=oidc``) and the Java client (``OAuthBearerLoginCallbackHandler``)
fetch and refresh tokens themselves; aiokafka only asks a token provider. This one does the
client-credentials grant (RFC 6749 4.4) the other two do, with the same settings
(``sasl_username`` = client id, ``sasl_password`` = client secret, ``sasl_oauth_token_url``,
``sasl_oauth_scope``), and keeps the token until a minute before it expires.

Not here: other grants, token introspection; the secret is sent only to the token endpoint.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING

from aiokafka.abc import AbstractTokenProvider

if TYPE_CHECKING:
    from transport.settings import KafkaSettings

#: Ask again this long before the token's ``expires_in`` runs out.
REFRESH_MARGIN_S = 60.0


class OidcTokenProvider(AbstractTokenProvider):
    def __init__(self, kafka: KafkaSettings, timeout_s: float = 10.0) -> None:
        self._kafka, self._timeout_s = kafka, timeout_s
        self._token: str | None = None
        self._valid_until = 0.0

    def __repr__(self) -> str:  # Faust logs its credentials' repr: no secret in it
        return f"<OidcTokenProvider {self._kafka.sasl_oauth_token_url} client {self._kafka.sasl_username!r}>"

    async def token(self) -> str:
        if self._token is None or time.monotonic() >= self._valid_until:
            self._token, lifetime_s = await asyncio.get_running_loop().run_in_executor(None, self._fetch)
            self._valid_until = time.monotonic() + max(lifetime_s - REFRESH_MARGIN_S, 0.0)
        return self._token

    def _fetch(self) -> tuple[str, float]:
        k = self._kafka
        form = {"grant_type": "client_credentials"}
        if k.sasl_oauth_scope:
            form["scope"] = k.sasl_oauth_scope
        basic = base64.b64encode(f"{k.sasl_username}:{k.sasl_secret()}".encode()).decode()
        request = urllib.request.Request(
            k.sasl_oauth_token_url, data=urllib.parse.urlencode(form).encode(), method="POST",
            headers={"Authorization": f"Basic {basic}", "Content-Type": "application/x-www-form-urlencoded"})
        with urllib.request.urlopen(request, timeout=self._timeout_s) as response:  # a configured URL
            body = json.loads(response.read())
        return body["access_token"], float(body.get("expires_in", 300))
