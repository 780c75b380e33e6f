"""`chatpipe cache info | retire VERSION`: the response cache's Redis (streams/response_cache.py).

The URL is ``--cache-url`` / ``CHATPIPE_CACHE_URL``, else the local stack's own Redis (the state folder's
``stack.json``, as ``chatpipe status`` finds it). ``retire`` stops a model version's entries from being
served (a ``chat.models`` follower will do it when a version leaves live; until then an operator does).
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings, console, print_error
from chatpipe.commands.stack import StateDir
from chatpipe.options import option
from streams.cache_settings import CacheSettings  # pydantic only: the flags are made from its fields

cache_app = typer.Typer(help="The response cache (Redis): its figures; retire a model version's entries.",
                        no_args_is_help=True)
CacheUrl = Annotated[Optional[str], option(CacheSettings, "url", "--cache-url")]


def local_cache(cache_url: str | None, state_dir=None) -> CacheSettings | None:
    """``--cache-url`` / ``CHATPIPE_CACHE_URL``, else the Redis of the local stack of ``state_dir`` when it runs
    and answers; None when there is neither."""
    settings = build_settings(CacheSettings, url=cache_url)
    if settings.url:
        return settings
    from infra import redis_server
    from infra.settings import StackSettings
    from infra.stack import LocalStack

    stack = LocalStack.open(build_settings(StackSettings, state_dir=state_dir)).settings
    if not stack.response_cache or redis_server.ping(stack.host, stack.redis_port) != "+PONG":
        return None
    return settings.model_copy(update={"url": redis_server.url(stack)})


def cache_settings(cache_url: str | None, state_dir) -> CacheSettings:
    """``local_cache``, or exit 1 saying why there is none."""
    settings = local_cache(cache_url, state_dir)
    if settings is None:
        print_error("no response cache: give --cache-url (or CHATPIPE_CACHE_URL), or start the local stack "
                    "(`chatpipe up`, which runs Redis unless --no-response-cache)")
        raise typer.Exit(1)
    return settings


@cache_app.command("info")
def info(cache_url: CacheUrl = None, state_dir: StateDir = None) -> None:
    """Memory used and its limit, keys, hits and misses of Redis itself, keys evicted (allkeys-lru)."""
    from streams.response_cache import CacheServer

    settings = cache_settings(cache_url, state_dir)
    server = CacheServer(settings.model_copy(update={"timeout_s": max(settings.timeout_s, 5.0)}))
    figures = server.info()
    if figures is None:
        print_error(f"Redis at {settings.url} does not answer")
        raise typer.Exit(1)
    keys = server.client.dbsize()
    retired = sorted(v.decode() for v in server.client.smembers(server.retired_key))
    server.close()
    limit = figures.get("maxmemory", 0)
    console.print(f"{settings.url}: {figures.get('used_memory_human', '?')} used of "
                  f"{figures.get('maxmemory_human', '?') if limit else 'no limit'} "
                  f"({figures.get('maxmemory_policy', '?')}), {keys} keys, {figures.get('evicted_keys', 0)} evicted, "
                  f"{figures.get('keyspace_hits', 0)} key hits / {figures.get('keyspace_misses', 0)} misses"
                  f"{'; retired versions: ' + ', '.join(retired) if retired else ''}", highlight=False)


@cache_app.command("retire")
def retire(version: Annotated[str, typer.Argument(help="The model version (today: the served model's name)")],
           cache_url: CacheUrl = None, state_dir: StateDir = None) -> None:
    """Stop serving the cached answers of a model version (they expire with their TTL or LRU)."""
    from streams.response_cache import CacheServer

    settings = cache_settings(cache_url, state_dir)
    server = CacheServer(settings.model_copy(update={"timeout_s": max(settings.timeout_s, 5.0)}))
    server.retire(version)
    server.close()
    console.print(f"entries of {version} are no longer served from {settings.url}")


def register(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")
