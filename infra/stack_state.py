"""What a state folder remembers of the stack it runs: ``<state_dir>/stack.json``.

``chatpipe up`` writes the settings the stack listens with (ports, host, topic prefix: the
``PERSISTED_FIELDS`` of ``StackSettings``) and which services it started; ``status``, ``down`` and
the next ``up`` on the same folder read them back, so ``CHATPIPE_STATE_DIR=x chatpipe status``
finds a broker on a non-default port. A flag or ``CHATPIPE_*`` variable wins over the saved value
while the stack is stopped (the next ``up`` saves it) and is an error while it runs.

Not here: starting or probing anything (``infra.stack``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from infra.instances import kind_of
from infra.services import write_atomically
from infra.settings import PERSISTED_FIELDS, StackSettings
from schemas.errors import ChatpipeError

STATE_FILE = "stack.json"


class StackStateError(ChatpipeError):
    """The saved stack settings cannot be read, or the flags contradict the running stack."""


def load(state_dir: Path) -> dict | None:
    """The saved ``{"settings": {...}, "services": [...]}`` of ``state_dir``, or None."""
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        return {"settings": dict(saved["settings"]), "services": list(saved.get("services", []))}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StackStateError(f"{path} cannot be read ({exc}); delete it (the stack's ports then come "
                              "from flags and CHATPIPE_* variables again)") from None


def save(settings: StackSettings, services: list[str]) -> None:
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(settings.state_dir / STATE_FILE,
                     json.dumps({"settings": {name: getattr(settings, name) for name in PERSISTED_FIELDS},
                                 "services": services}, indent=2) + "\n")


def resolve(settings: StackSettings, running: set[str]) -> tuple[StackSettings, list[str] | None]:
    """``settings`` with the saved values of its state folder where no flag or variable set them.

    Returns the merged settings and the saved list of services (None when nothing is saved).
    ``running``: the services of this state folder that run (instance names: ``streams-2`` is a
    streams worker); a value one of them uses that differs from the saved one is an error (the
    service would be looked for in the wrong place).
    """
    saved = load(settings.state_dir)
    if saved is None:
        return settings, None
    values = {k: v for k, v in saved["settings"].items() if k in PERSISTED_FIELDS}
    try:
        StackSettings(state_dir=settings.state_dir, **values)  # validates what the file says
    except ValidationError as exc:
        raise StackStateError(f"{settings.state_dir / STATE_FILE} holds invalid settings ({exc.errors()[0]['msg']}); "
                              "delete it") from None
    explicit = {k for k in settings.model_fields_set if k in PERSISTED_FIELDS}
    running = {kind_of(name) for name in running}
    clashes = [f"{k}={getattr(settings, k)!r} (the stack runs with {values[k]!r})"
               for k in sorted(explicit) if k in values and getattr(settings, k) != values[k]
               and running.intersection(PERSISTED_FIELDS[k])]
    if clashes:
        raise StackStateError(
            f"the stack in {settings.state_dir} is running with other settings than given: {'; '.join(clashes)}. "
            "Drop those flags / CHATPIPE_* variables, or `chatpipe down` first to change them")
    merged = settings.model_copy(update={k: v for k, v in values.items() if k not in explicit})
    return merged, saved["services"]
