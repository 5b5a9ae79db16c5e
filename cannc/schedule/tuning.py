"""The persistent tuning cache: measured winners of `cannc tune`, used by later compiles.

An entry maps (kernel kind, kernel signature, CPU, cannc version) to the planner
overrides (`tuning` dicts, e.g. ``{"KC": 128, "pack_a": False}`` for
``codegen.gemm.gemm_plan``) that beat the modelled default plan when measured
on this CPU. Lowerings ask ``lookup(kind, signature)`` (a GEMM's through
``codegen.plans.gemm_tuning``, which checks that the planner still accepts it);
without an entry they get ``None`` and plan exactly as they would without a
cache. The search that measures candidates is ``cannc.compiler.tune``.

The file is JSON (``config.tuning_cache_path()``: ``CANNC_TUNING_CACHE`` or
``<cache dir>/tuning.json``), written atomically (temp file + ``os.replace``,
under a lock file so concurrent tuners merge). A damaged file is ignored with a
warning (and replaced by the next store). ``CANNC_TUNING=0`` disables the
cache. Entries of other CPUs or cannc versions stay in the file but are never
used here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import config
from .._version import __version__
from ..native.target import host
from . import machine

FORMAT = "cannc-tuning"
FORMAT_VERSION = 1

__all__ = [
    "TuningCache",
    "cpu_identity",
    "entries",
    "entry_key",
    "fingerprint",
    "gemm_signature",
    "lookup",
    "store",
]


# ---------------------------------------------------------------------------
# what an entry is keyed on
# ---------------------------------------------------------------------------

@lru_cache(maxsize=1)
def cpu_identity() -> dict[str, str]:
    """This CPU as the cache keys it: LLVM's host CPU name, /proc/cpuinfo's model name and a
    hash of the host target's features (what the generated code is compiled for)."""
    h = host()
    feats = hashlib.sha256(f"{h.triple}|{h.features}".encode()).hexdigest()[:16]
    return {"llvm_cpu": h.cpu, "model": machine.model_name(), "features": feats}


def _version() -> str:
    return __version__


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_jsonable)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (tuple, set, frozenset)):
        return list(v)
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    raise TypeError(f"not JSON-serialisable: {type(v).__name__}")


def entry_key(kind: str, signature: dict[str, Any], cpu: dict[str, str] | None = None,
              version: str | None = None) -> str:
    """The key of an entry: kind + signature + CPU identity + cannc version, hashed."""
    cpu = cpu_identity() if cpu is None else cpu
    version = _version() if version is None else version
    text = _canon({"kind": kind, "signature": signature, "cpu": cpu, "cannc": version})
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------
# the file
# ---------------------------------------------------------------------------

class TuningCache:
    """One tuning file. Reads are memoised on the file's (mtime, size), so a compile
    sees entries another process stored meanwhile."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._entries: dict[str, dict[str, Any]] = {}
        self._warned: set[tuple[int, int]] = set()

    # -- reading -------------------------------------------------------------------------
    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _read(self) -> dict[str, dict[str, Any]]:
        """The entries in the file ({} if it is missing; {} with a warning if damaged)."""
        stamp = self._file_stamp()
        if stamp is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError("not a cannc tuning cache")
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('version')!r}, "
                                 f"expected {FORMAT_VERSION}")
            raw = data.get("entries")
            if not isinstance(raw, dict):
                raise ValueError("no 'entries' object")
        except (OSError, ValueError, UnicodeDecodeError) as e:
            if stamp not in self._warned:
                self._warned.add(stamp)
                warnings.warn(f"ignoring damaged tuning cache {self.path} ({e}); compiling "
                              "with default plans (the next `cannc tune` rewrites it)",
                              RuntimeWarning, stacklevel=4)
            return {}
        # a damaged entry costs only itself
        return {k: e for k, e in raw.items()
                if isinstance(k, str) and isinstance(e, dict)
                and isinstance(e.get("tuning"), dict) and isinstance(e.get("kind"), str)}

    def entries(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            stamp = self._file_stamp()
            if stamp != self._stamp or stamp is None:
                self._entries = self._read() if stamp is not None else {}
                self._stamp = stamp
            return self._entries

    def lookup(self, kind: str, signature: dict[str, Any]) -> dict[str, Any] | None:
        e = self.entries().get(entry_key(kind, signature))
        if e is None or e.get("kind") != kind:
            return None
        return dict(e["tuning"])

    def effective(self) -> dict[str, dict[str, Any]]:
        """The entries this process would use (this CPU, this cannc version)."""
        cpu, ver = cpu_identity(), _version()
        return {k: e for k, e in self.entries().items()
                if e.get("cpu") == cpu and e.get("cannc") == ver}

    # -- writing -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(self.path.name + ".lock")
        with open(lock, "a+") as f:
            try:
                import fcntl
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            except (ImportError, OSError):  # pragma: no cover - no flock: last writer wins
                pass
            yield

    def store(self, kind: str, signature: dict[str, Any], tuning: dict[str, Any],
              measured_us: float, **extra: Any) -> str:
        """Record that `tuning` runs the kernel in `measured_us` on this CPU; returns the key."""
        key = entry_key(kind, signature)
        entry = {"kind": kind, "signature": signature, "tuning": dict(tuning),
                 "measured_us": float(measured_us), "cpu": cpu_identity(),
                 "cannc": _version(), "stored": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra}
        json.loads(_canon(entry))  # refuse what would not read back
        with self._lock, self._file_lock():
            current = self._read()   # merge with what other tuners stored meanwhile
            current[key] = json.loads(_canon(entry))
            data = {"format": FORMAT, "version": FORMAT_VERSION, "entries": current}
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}."
                                      f"{threading.get_ident()}.tmp")
            try:
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
            self._entries, self._stamp = current, self._file_stamp()
        return key


_caches: dict[Path, TuningCache] = {}
_by_env: dict[tuple, TuningCache] = {}
_caches_lock = threading.Lock()


def cache(path: str | Path | None = None) -> TuningCache | None:
    """The cache at `path` (default: config.tuning_cache_path()); None without a path."""
    # (the default one is found by the environment that names it and the working
    # directory, not through pathlib: the GEMM tiling function asks at every node)
    env = None
    if path is None:
        env = (os.environ.get("CANNC_TUNING_CACHE"), os.environ.get("CANNC_CACHE_DIR"),
               os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"), os.getcwd())
        c = _by_env.get(env)
        if c is not None:
            return c
    p = Path(path) if path is not None else config.tuning_cache_path()
    if p is None:
        return None
    p = p.expanduser().absolute()
    with _caches_lock:
        c = _caches.get(p)
        if c is None:
            c = _caches[p] = TuningCache(p)
        if env is not None:
            _by_env[env] = c
        return c


# ---------------------------------------------------------------------------
# the API the compiler uses
# ---------------------------------------------------------------------------

def lookup(kind: str, signature: dict[str, Any]) -> dict[str, Any] | None:
    """The stored tuning of this kernel on this CPU, or None (also when CANNC_TUNING=0)."""
    if not config.tuning_enabled():
        return None
    c = cache()
    return c.lookup(kind, signature) if c is not None else None


def store(kind: str, signature: dict[str, Any], tuning: dict[str, Any], measured_us: float,
          path: str | Path | None = None, **extra: Any) -> str:
    """Store a measured tuning in the cache (`path`, default the configured one)."""
    c = cache(path)
    if c is None:
        raise OSError("no tuning cache path: set CANNC_TUNING_CACHE or CANNC_CACHE_DIR")
    return c.store(kind, signature, tuning, measured_us, **extra)


def entries(path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Every entry of the cache file (all CPUs and versions)."""
    c = cache(path)
    return dict(c.entries()) if c is not None else {}


def fingerprint() -> str:
    """A short hash of the entries in effect (for compile-cache keys): 'off' when the cache
    is disabled, 'none' when no entry applies to this CPU and version."""
    if not config.tuning_enabled():
        return "off"
    c = cache()
    eff = c.effective() if c is not None else {}
    if not eff:
        return "none"
    return hashlib.sha256(_canon(sorted((k, e["tuning"]) for k, e in eff.items()))
                          .encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------

_GEMM_PLAN_FREE = ("alpha", "beta")   # GemmSpec fields that do not affect the plan


def gemm_signature(spec: Any, epilogue: bool = False) -> dict[str, Any]:
    """What decides a GEMM's plan and speed: every GemmSpec field but alpha/beta (shape,
    batch strides, layouts, leading dims, bias, prepacked B) and whether an epilogue runs."""
    import dataclasses

    sig = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
           if f.name not in _GEMM_PLAN_FREE}
    sig["epilogue"] = bool(epilogue)
    return sig
