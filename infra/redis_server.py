"""Redis as a service of the local stack: the streams workers' response cache (issue 43).

``chatpipe up`` (``response_cache`` on, the default; ``--no-response-cache`` leaves it out) runs one
``redis-server`` (Debian's package; ``make prerequisites`` installs it with apt as it installs Java) under
the same supervisor as every other service (started after Kafka and before the streams workers, stopped
after them, restarted with backoff; ``infra.stack``), and hands each streams worker
``--cache-url redis://<host>:<redis_port>/0``. Its folder is ``<state>/redis`` (its working folder; nothing
is written there, persistence is off); its output goes to ``<state>/logs/redis.log``.

It is a cache and nothing more: ``maxmemory`` with ``allkeys-lru`` (from ``StackSettings``: any key may be
evicted, the least recently used first, when the memory is full), no RDB snapshots, no AOF. A restart starts
empty, which costs GPU time, never an answer (a miss goes to a worker). Healthy when a ``PING`` over a
plain socket is answered ``+PONG`` (no client library: ``infra`` does not import the tiers' packages, and
the probe must not depend on redis-py's own retries).

A deployment points ``CHATPIPE_CACHE_URL`` at any Redis or Valkey instead (``rediss://`` for TLS, a
password in the URL or ``CHATPIPE_CACHE_PASSWORD``; docs/deploy.md). Plain logic; no process is started
here. Not here: starting it (``infra.stack``), the cache itself (``streams/response_cache.py``).
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from infra.local_kafka import StackError
from infra.settings import StackSettings

REDIS = "redis"  # the service's name, and its kind for `--only`
PING = b"*1\r\n$4\r\nPING\r\n"  # RESP: an array of one bulk string
PONG = b"+PONG\r\n"


def folder(settings: StackSettings) -> Path:
    return settings.state_dir.resolve() / REDIS


def url(settings: StackSettings) -> str:
    """What each streams worker gets as ``--cache-url`` (database 0 of the stack's Redis)."""
    return f"redis://{settings.host}:{settings.redis_port}/0"


def ports(settings: StackSettings) -> dict[int, str]:
    """The port Redis listens on -> the flag that chooses it (named when it is taken)."""
    # A Redis of the system (Debian's package starts redis-server.service on 6379 where systemd runs) is
    # the likeliest holder of the default port: the message says so.
    return {settings.redis_port: "--redis-port" + (" (a system Redis, e.g. Debian's redis-server.service, "
                                                   "listens on 6379 by default)" if settings.redis_port == 6379
                                                   else "")}


def executable(settings: StackSettings) -> str:
    """The path of ``settings.redis_server``; a missing one is one line saying what to install."""
    found = shutil.which(settings.redis_server)
    if found is None:
        raise StackError(f"{settings.redis_server!r} not found (the response cache's Redis; CHATPIPE_REDIS_SERVER "
                         "names another): install it (apt-get install redis-server; `make prerequisites` does as "
                         "root), or run the stack without the cache: chatpipe up --no-response-cache")
    return found


def command(settings: StackSettings, program: str) -> tuple[list[str], Path]:
    """(argv, working folder) of the stack's Redis: ``program`` (``executable``) on the stack's host and
    ``redis_port``, a cache only (maxmemory with its policy, no snapshots, no append-only file)."""
    s, home = settings, folder(settings)
    return [program, "--bind", s.host, "--port", str(s.redis_port),
            "--maxmemory", s.redis_maxmemory, "--maxmemory-policy", s.redis_maxmemory_policy,
            "--save", "", "--appendonly", "no", "--dir", str(home),
            # Protected mode (no password set: only loopback clients are let in) changes nothing on the
            # default loopback host. Off it, the stack's own streams workers connect from that very
            # address and would be refused; a non-loopback `host` is the user's choice to open every
            # service of the stack there (Kafka plaintext, the gateway, /metrics) and Redis is no different.
            "--protected-mode", "no"], home  # its log: stdout (the default), <state>/logs/redis.log


def ping(host: str, port: int, timeout_s: float = 1.0) -> str:
    """What a ``PING`` on a fresh connection is answered ("+PONG" from a ready server; "" when nothing
    answers; an error line such as "-LOADING ..." otherwise)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(PING)
            reply = b""
            while not reply.endswith(b"\r\n") and len(reply) < 512:
                chunk = sock.recv(512)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return ""
    return reply.decode(errors="replace").strip()


def not_ready(settings: StackSettings) -> str:
    """Why the running Redis is not healthy yet ("" when a PING is answered +PONG)."""
    reply = ping(settings.host, settings.redis_port)
    return "" if reply == PONG.decode().strip() else f"PING answers {reply or 'nothing'}"


def address(settings: StackSettings) -> str:
    s = settings
    return f"{url(s)} (maxmemory {s.redis_maxmemory}, {s.redis_maxmemory_policy}, no persistence)"
