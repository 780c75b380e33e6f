"""Which adapters the engine knows, which are in memory, and loading them beside the step loop.

An adapter is *registered* (a name and its folder on disk: any number) and, while requests use it,
*resident* (its factors in the step's ``LoraBank``: at most ``max_loras``). A request for a registered
adapter that is not resident starts its load on a loader thread and waits in the queue (the
scheduler's ``adapter_ready`` check, ``ensure``); the step loop goes on with everyone else. At the
start of each step ``poll`` installs finished loads: into a free slot, or the slot of the least
recently used adapter no unfinished request names; and for the adapter the queue's head waits for,
also the slot of one that only waiting requests name (none running). With every slot in use, a load
waits for one to free. Why the head's exception: were waiting requests always to hold their
adapter's slot, a head waiting for a slot that a request queued behind it holds would wait forever;
and were they never to, two loads would evict each other's adapter before its request ran. An
adapter evicted under a waiting request is loaded again when that request reaches the head. A load
that fails ends the requests waiting for it with the reason, and the next request tries again.

Each registration gets a key (``name#generation``) that joins the prefix cache's block hashes, so KV
blocks are never shared between the base model and an adapter, two adapters, or two registrations
of one name (an adapter folder replaced under the same name).

Thread safety: ``register``, ``retire``, ``acquire`` and ``release`` may be called from any thread
(under a lock); ``poll``, ``ensure`` and ``bank`` belong to the step thread.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from inference.engine.errors import InvalidRequestError
from inference.engine.lora import AdapterError, LoraAdapter, read_adapter_config
from inference.engine.lora_bank import LoraBank


@dataclass
class Registration:
    name: str
    folder: Path
    key: str  # name#generation: joins the prefix-cache hash
    retired: bool = False
    users: int = 0  # unfinished requests naming it
    load: Future | None = None
    load_started: float = 0.0
    last_used: float = 0.0


@dataclass(frozen=True)
class AdapterStats:
    registered: tuple[str, ...]
    resident: tuple[str, ...]
    loads: int
    load_failures: int
    evictions: int
    last_load_s: float  # seconds the last finished load took (read + check + copy), 0 before any


@dataclass
class AdapterSlots:
    loader: Callable[[str, Path], LoraAdapter]  # (name, folder) -> adapter (lora.load_adapter for the model)
    num_layers: int
    max_loras: int
    bank: LoraBank = field(default_factory=LoraBank)
    _by_name: dict[str, Registration] = field(default_factory=dict)
    _resident: "collections.OrderedDict[str, tuple[Registration, LoraAdapter]]" = field(
        default_factory=collections.OrderedDict)  # key -> (registration, adapter), bank slot order
    _generation: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loading: list[Registration] = field(default_factory=list)  # loads started, oldest first
    _pool: ThreadPoolExecutor | None = None
    _loads: int = 0
    _load_failures: int = 0
    _evictions: int = 0
    _last_load_s: float = 0.0

    # -- any thread -------------------------------------------------------------------------------

    def register(self, name: str, folder: Path | str) -> str:
        """Know ``name`` as the adapter in ``folder`` (its config is checked now, its weights at
        load). Returns its key. A name registered again with another folder is a new registration:
        requests already queued keep the old one until they finish."""
        if not name or "#" in name:
            raise InvalidRequestError(f"adapter name {name!r} must be non-empty and free of '#'")
        folder = Path(folder)
        read_adapter_config(folder)
        with self._lock:
            old = self._by_name.get(name)
            if old is not None and old.folder == folder and not old.retired:
                return old.key
            if old is not None:
                old.retired = True
            self._generation += 1
            reg = Registration(name, folder, f"{name}#{self._generation}")
            self._by_name[name] = reg
            return reg.key

    def retire(self, name: str) -> bool:
        """No new request may name ``name``; it leaves memory once its last request finishes."""
        with self._lock:
            reg = self._by_name.pop(name, None)
            if reg is None:
                return False
            reg.retired = True
            return True

    def acquire(self, name: str) -> Registration:
        """A new request names ``name``: count it and start the load if it is not in memory."""
        with self._lock:
            reg = self._by_name.get(name)
            if reg is None:
                known = ", ".join(sorted(self._by_name)) or "none"
                raise InvalidRequestError(f"adapter {name!r} is not registered with this engine (registered: {known})")
            reg.users += 1
            reg.last_used = time.monotonic()
            if reg.key not in self._resident and reg.load is None:
                self._start_load(reg)
            return reg

    def release(self, reg: Registration) -> None:
        with self._lock:
            reg.users -= 1

    @property
    def unused(self) -> bool:
        """No adapter registered, in memory or loading: the step loop has nothing to ask (its hot path)."""
        return not (self._by_name or self._resident or self._loading)

    def ensure(self, reg: Registration) -> bool:
        """Whether ``reg`` is in memory; if not, its load is started (once) and False."""
        if reg.key in self.bank.slots:
            return True
        with self._lock:
            if reg.key not in self._resident and reg.load is None:
                self._start_load(reg)
        return False

    def stats(self) -> AdapterStats:
        with self._lock:
            return AdapterStats(
                registered=tuple(sorted(self._by_name)),
                resident=tuple(reg.name for reg, _ in self._resident.values()),
                loads=self._loads, load_failures=self._load_failures, evictions=self._evictions,
                last_load_s=self._last_load_s,
            )  # fmt: skip

    def wait_for_load(self, timeout: float) -> None:
        """Block until a load in progress finishes (or ``timeout``): for a step loop with nothing to
        compute, which would otherwise spin and starve the loader thread of the GIL (a 20 ms load
        took 1.6 s beside an idle loop calling ``step``)."""
        with self._lock:
            pending = [reg.load for reg in self._loading if reg.load is not None and not reg.load.done()]
        if pending:
            futures_wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    # -- the step thread --------------------------------------------------------------------------

    def poll(self, running: set[str], head: str | None = None) -> list[tuple[str, str]]:
        """Install finished loads and drop retired adapters nobody uses; ``running``: the adapter keys
        of the running requests (their slots are kept); ``head``: the adapter key the queue's head waits
        for. Returns (key, reason) of each load that failed: the engine ends the requests waiting for it."""
        failed: list[tuple[str, str]] = []
        with self._lock:
            changed = self._drop_retired(running)
            for reg in list(self._loading):
                if not reg.load.done():
                    continue
                try:
                    adapter = reg.load.result()
                except AdapterError as exc:
                    failed.append((reg.key, str(exc)))
                    self._load_failures += 1
                    self._loading.remove(reg)
                    reg.load = None
                    continue
                if len(self._resident) >= self.max_loras and not self._evict_one(running, reg.key == head):
                    continue  # every slot is in use: it stays loaded until one frees
                self._resident[reg.key] = (reg, adapter)
                self._last_load_s = time.monotonic() - reg.load_started
                self._loads += 1
                self._loading.remove(reg)
                reg.load = None
                changed = True
            if changed:
                self.bank = LoraBank.build([(key, ad) for key, (_, ad) in self._resident.items()], self.num_layers)
        return failed

    def _evict_one(self, running: set[str], for_head: bool) -> bool:
        idle = [(reg.last_used, key) for key, (reg, _) in self._resident.items()
                if key not in running and (reg.users == 0 or for_head)]
        if not idle:
            return False
        del self._resident[min(idle)[1]]
        self._evictions += 1
        return True

    def _drop_retired(self, running: set[str]) -> bool:
        gone = [key for key, (reg, _) in self._resident.items() if reg.retired and key not in running
                and reg.users == 0]
        for key in gone:
            del self._resident[key]
        return bool(gone)

    def _start_load(self, reg: Registration) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        reg.load_started = time.monotonic()
        reg.load = self._pool.submit(self._load, reg.name, reg.folder)
        self._loading.append(reg)

    def _load(self, name: str, folder: Path) -> LoraAdapter:
        try:
            return self.loader(name, folder)
        except AdapterError:
            raise
        except Exception as exc:  # any failure of a load is the adapter's, reported with its requests
            raise AdapterError(f"adapter {name} ({folder}) could not be loaded: {type(exc).__name__}: {exc}") from exc
