"""Clients of a running pipeline: ``chatpipe tail`` (read any catalog topic as JSON lines) and
``chatpipe chat`` / ``chatpipe demo`` (talk to the OpenAI-compatible gateway over HTTP).

Depends on ``schemas`` and ``transport`` (tail) and on httpx (chat); never on the internals of
the gateway, the streams tier or the inference worker: a client sees only topics and HTTP.
"""
