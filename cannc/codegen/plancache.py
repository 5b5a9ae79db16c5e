"""Planner results kept across processes: a warm compile does not plan again.

The conv and Winograd planners search their tile grids in Python (tens of ms per
distinct convolution); their default plans are pure functions of the geometry, the
core count and the host, so `persistent` keeps them in memory and, checksummed, in the
cache directory (``plans/``), keyed by the planner, its arguments, the host target, the
FMA pipes measured on this machine (the conv planner weighs its micro-tiles' loads
against them) and cannc's sources (`source_digest`: a changed planner never reuses old
plans). A missing, damaged or unreadable file only costs the planning.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .. import config
from ..native.target import host, read_checksummed, source_digest, write_checksummed
from ..schedule import machine

_MAGIC = b"CNCPLAN1\n"
F = TypeVar("F", bound=Callable[..., Any])

def persistent(name: str) -> Callable[[F], F]:
    """Memoise a pure planner of hashable, picklable arguments in memory and in the cache
    directory (``<cache>/plans/<digest>``)."""
    def wrap(fn: F) -> F:
        memory: dict[tuple, Any] = {}
        lock = threading.Lock()

        @functools.wraps(fn)
        def planned(*args: Any) -> Any:
            pipes = machine.fma_pipes()
            k = (host().fingerprint, pipes, *args)
            with lock:
                if k in memory:
                    return memory[k]
            root = config.cache_dir()
            path = None
            if root is not None:
                h = hashlib.sha256(
                    f"{name}|{host().fingerprint}|pipes={pipes}|{source_digest()}".encode())
                h.update(pickle.dumps(args, protocol=4))
                path = Path(root) / "plans" / h.hexdigest()[:32]
                data = read_checksummed(path, _MAGIC)
                if data:
                    try:
                        got = pickle.loads(data)
                    except Exception:          # a stale or foreign file: plan again
                        got = None
                    if got is not None:
                        with lock:
                            memory[k] = got
                        return got
            got = fn(*args)
            if path is not None:
                write_checksummed(path, _MAGIC, pickle.dumps(got, protocol=4))
            with lock:
                if len(memory) > 4096:
                    memory.clear()
                memory[k] = got
            return got

        planned.cache_clear = memory.clear  # type: ignore[attr-defined]
        return planned  # type: ignore[return-value]
    return wrap
