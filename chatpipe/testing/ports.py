"""Free loopback ports for the stacks the tests and benchmarks start: the one allocator.

``free_port()`` never hands out a port it handed out before in this process: the OS may give a
just-closed port again, and a caller asking for several (a stack's Kafka, controller and /metrics
ports) would then get the same one twice (``chatpipe up`` refused such flags once in CI).
``free_port_block(n)`` gives ``n`` consecutive ports below the ephemeral range.
"""

from __future__ import annotations

import random
import socket
import threading

_HANDED_OUT: set[int] = set()
_LOCK = threading.Lock()


def free_port() -> int:
    """A free port on 127.0.0.1, never one this process was handed before."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with _LOCK:
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive free ports (a stack gives its k-th worker ``base + k``), below
    Linux's ephemeral range (32768-60999): a port picked by binding 0 lies in that range, where
    any client connection made meanwhile (a Kafka client, another xdist worker's) may take
    ``base + 1`` before the second worker binds it, as happened once in CI."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 32700 - n)
        with _LOCK:
            if any(port in _HANDED_OUT for port in range(base, base + n)):
                continue
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        with _LOCK:
            _HANDED_OUT.update(range(base, base + n))
        return base
