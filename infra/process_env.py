"""Variables a process sets for itself when it re-executes, which the processes it starts must not inherit.

Two re-executions set them: ``chatpipe inference --engine vllm`` runs itself with the vLLM environment's
Python, its preloads and thread count (infra/vllm_env.py), and a process running our engine on CPU runs
itself with tcmalloc preloaded and torch's 2 MB pages on (infra/allocator.py). A process started from either (a bench's broker,
streams or gateway, a worker of the other engine, a JVM) gets those variables back as they were:
``with_changes`` records what it changed in ``CHATPIPE_SAVED_ENV`` and ``outside_env`` undoes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

SAVED_ENV = "CHATPIPE_SAVED_ENV"  # JSON: the variables changed on re-executing, as they were before (null: unset)


def with_changes(base: Mapping[str, str], changes: Mapping[str, str]) -> dict[str, str]:
    """``base`` with ``changes`` applied, and what they replaced recorded for ``outside_env`` (a variable
    changed twice keeps its first value: the one from before any re-execution)."""
    out = dict(base)
    saved = json.loads(out.get(SAVED_ENV) or "{}")
    for key, value in changes.items():
        saved.setdefault(key, base.get(key))
        out[key] = value
    out[SAVED_ENV] = json.dumps(saved)
    return out


def outside_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with what ``with_changes`` changed put back as it was (unchanged when nothing was): for
    a process that a re-executed process starts. (An allocator or an OpenMP runtime preloaded into one
    process is not something every process it starts should inherit.)"""
    out = dict(env)
    saved = out.pop(SAVED_ENV, None)
    for key, value in (json.loads(saved) if saved else {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out
