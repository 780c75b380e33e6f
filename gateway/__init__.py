"""The HTTP gateway: OpenAI's chat-completions API in front of the Kafka pipeline.

    settings.py     GatewaySettings (CHATPIPE_GATEWAY_*)
    keys.py         API keys -> tenants, the users a key may name, request ids that say whose they are
    openai_api.py   the request bodies (chat, completions, embeddings) and their own rules; OpenAI's error
    tools.py        a request's tools -> the prompt's text and the tool-call constraint
    translate.py    the one way a request body becomes a record (PromptRequest, EmbeddingRequest)
    responses.py    the way back: OpenAI's answer objects, the answer's tool calls
    replies.py      the gateway's own reply topic: a reader thread, one queue per request
    service.py      one request's path: the record out, TokenChunks back, cancels, feedback, backlog
    app.py          FastAPI routes (completions.py, embeddings.py, erasure.py: their routes)
    metrics.py      Prometheus metrics

Depends on ``schemas``, ``formats`` and ``transport`` only (never on streams or the worker's internals): the
contract between them is the topics.
"""
