"""chatpipe's inference engine: continuous batching of token-id requests over a Hugging Face
causal LM in PyTorch. Depends on torch and transformers only (no Kafka); see docs/engine.md.

    settings.py         EngineSettings (one frozen object, built by the CLI)
    errors.py           EngineError (a ChatpipeError) and its named subclasses
    model_store.py      find / pull / convert / load the model
    request.py          Request, SamplingParams, Priority, Admission, FinishReason (pure Python)
    block_allocator.py  KV blocks per request, prefix cache (hash chain, LRU eviction) (pure Python)
    scheduler.py        who runs each step, lazy allocation, preemption (pure Python)
    kv_cache.py         paged K/V storage
    model_runner.py     one ragged forward of a Llama-family model over the cache
    sampling.py         greedy / temperature / top-k / top-p, seeded per request
    engine.py           the step loop
    streaming.py        asyncio facade: the loop in a thread, one async iterator per request
    text.py             the tokenizer edge: chat template, incremental text, stop strings (TextStream)
    grammar.py          structured outputs: a response_format compiled into a token constraint (xgrammar)

The chat prompt's tokenization (``formats.chat_tokens``) and the pure response-format check
(``formats.response_format``) are shared with the other tiers, in ``formats``.
"""
