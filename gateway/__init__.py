"""The HTTP gateway: OpenAI's chat-completions API in front of the Kafka pipeline.

    settings.py     GatewaySettings (CHATPIPE_GATEWAY_*)
    keys.py         API keys -> tenants (the keys file)
    openai_api.py   request model, response/chunk objects and error bodies in OpenAI's shapes
    replies.py      the gateway's own reply topic: a reader thread, one queue per request
    service.py      one request's path: PromptRequest out, TokenChunks back, cancels, feedback, backlog
    app.py          FastAPI routes
    metrics.py      Prometheus metrics

Depends on ``schemas`` and ``transport`` only (never on streams or the worker's internals): the
contract between them is the topics.
"""
