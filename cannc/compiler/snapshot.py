"""Whole compiled programs kept across processes: a warm compile parses nothing.

A compile of a model file (or bytes) whose every choice is known up front — the
model's content, the compile options, the input shapes given, the core count and
everything global the generated code depends on (`codegen.memo.salt`: host,
cannc's sources, tuning cache, codegen switches) — is a pure function of those, so
its `Specialization` is stored under a digest of them in ``<cache>/programs/``:

    <key>/meta          the specialisation pickled without its large arrays, and the
                        model's inputs and outputs (checksummed, cannc.native.target)
    blobs/<digest>.w    those arrays (packed weights, folded constants), named by the
                        digest of their bytes: the programs of one model for other
                        shapes (and models sharing weights) store and read them once

A hit reads the blobs into page-aligned memory (the device's weights, adopted
without another copy: nothing is parsed, folded or packed), checks their digests,
and the session builds its program from the specialisation. The model itself is
parsed only when something needs its graph (another input shape,
inspect, save). A missing, damaged or foreign entry only costs the compile:
damaged entries are removed and written again.

Entries are large (a model's weights), so the directory is kept under a budget
(``CANNC_PROGRAM_CACHE``: bytes, with K/M/G suffixes; 0 or off disables it;
default 8G), least recently used first out.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import io
import json
import mmap
import os
import pickle
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .. import config
from .._version import __version__
from ..artifact import Specialization
from ..codegen.memo import salt
from ..frontend.wire import fields
from ..ir.graph import Graph
from ..ir.registry import registered_ops
from ..native.target import read_checksummed, write_checksummed
from ..runtime.memory import aligned_empty

_MAGIC = b"CNCPROG1\n"
EXTERNAL_MIN_BYTES = 4096      # arrays at least this large live in the weights file
DEFAULT_BUDGET = 8 << 30
BLOB_GRACE_S = 60.0             # an unnamed blob younger than this is kept (evict)


@dataclasses.dataclass
class Snapshot:
    spec: Specialization
    face: Graph                 # the model's inputs and outputs (no nodes)
    num_nodes: int              # of the model
    path: Path


@dataclasses.dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    stored: int = 0
    damaged: int = 0
    evicted: int = 0
    store_errors: int = 0           # stores that failed other than by a full disk
    last_store_error: str = ""


stats = Stats()
_lock = threading.Lock()


# ---------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------

def budget() -> int:
    """The program cache's size budget in bytes (0: disabled)."""
    v = os.environ.get("CANNC_PROGRAM_CACHE", "").strip().lower()
    if not v:
        return DEFAULT_BUDGET
    if v in ("0", "off", "no", "false"):
        return 0
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(v[-1], 1)
    try:
        n = int(float(v[:-1] if v[-1] in "kmg" else v) * scale)
    except ValueError:
        from ..errors import CanncError
        raise CanncError(f"CANNC_PROGRAM_CACHE={v!r}: expected a size in bytes (e.g. 8G), "
                         "or 0/off") from None
    return max(n, 0)


def root() -> Path | None:
    d = config.cache_dir()
    if d is None or budget() == 0:
        return None
    return Path(d) / "programs"


def _hash_file(path: Path, h: Any) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                h.update(m)


def model_digest(model: Any) -> str | None:
    """A digest of a model file's content (with the external data files it names) or of
    model bytes; None for anything else (a ModelProto is not hashed: serialising it costs
    what a compile saves) or a file that cannot be read (the compile reports that)."""
    h = xxhash.xxh3_128()
    try:
        if isinstance(model, (bytes, bytearray, memoryview)):
            h.update(b"bytes")
            h.update(model)
            return h.hexdigest()
        if not isinstance(model, (str, os.PathLike)):
            return None
        path = Path(model)
        h.update(b"file")
        _hash_file(path, h)
        with open(path, "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                locs = external_locations(m)
        if locs is None:
            locs = _external_locations_parsed(path)
        for loc in locs:
            h.update(loc.encode())
            _hash_file(path.parent / loc, h)
        return h.hexdigest()
    except (OSError, ValueError):
        return None


def external_locations(b: Any) -> list[str] | None:
    """The external data files the initializers of a serialised ModelProto name, read off
    the protobuf wire format without parsing the model (the weights are skipped, not
    read): ModelProto.graph (7) -> GraphProto.initializer (5) -> TensorProto
    .external_data (13) {key (1), value (2)}. None when the bytes do not parse so."""
    try:
        locs: set[str] = set()
        for f, w, v in fields(b, 0, len(b)):
            if f != 7 or w != 2:
                continue
            for gf, gw, gv in fields(b, *v):
                if gf != 5 or gw != 2:
                    continue
                for tf, tw, tv in fields(b, *gv):
                    if tf != 13 or tw != 2:
                        continue
                    entry = {ef: bytes(b[ev[0]:ev[1]]) for ef, ew, ev in fields(b, *tv)
                             if ew == 2}
                    if entry.get(1) == b"location" and 2 in entry:
                        locs.add(entry[2].decode())
        return sorted(locs)
    except (ValueError, UnicodeDecodeError):
        return None


def _external_locations_parsed(path: Path) -> list[str]:
    """external_locations by the onnx package (for what the wire reader refuses)."""
    import onnx
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:      # not a model: let the compile say so
        raise ValueError(str(e)) from e
    locs = set()
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    locs.add(e.value)
    return sorted(locs)


def program_key(digest: str, options: dict[str, Any]) -> str:
    """The entry for a model digest and everything else the program depends on: with the
    bodies of the custom ops registered in this process (OpDef.revision, as the lowering
    memo keys them), since a model's nodes may be any of them."""
    h = xxhash.xxh3_128()
    h.update(f"{__version__}|{salt()}|{digest}|".encode())
    custom = sorted(f"{o.domain}::{o.name}:{o.revision}" for o in registered_ops() if o.revision)
    h.update(";".join(custom).encode() + b"|")
    h.update(json.dumps(options, sort_keys=True, default=repr).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# store
# ---------------------------------------------------------------------------------------

def _blob_path(base: Path, name: str) -> Path:
    return base / "blobs" / f"{name}.w"


class _Pickler(pickle.Pickler):
    """Large arrays go to content-named blobs, each once (shared arrays stay shared)."""

    def __init__(self, f: Any, base: Path) -> None:
        super().__init__(f, protocol=5)
        self.base = base
        self.seen: dict[int, tuple] = {}
        self.keep: list[np.ndarray] = []          # ids stay unique while pickling
        self.blobs: dict[str, int] = {}           # name -> bytes

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not np.ndarray or obj.nbytes < EXTERNAL_MIN_BYTES \
                or obj.dtype.hasobject:
            return None
        pid = self.seen.get(id(obj))
        if pid is None:
            a = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            raw = memoryview(a.reshape(-1).view(np.uint8))
            name = xxhash.xxh3_128(raw).hexdigest()
            path = _blob_path(self.base, name)
            try:
                os.utime(path)              # in use again (see evict)
            except OSError:
                tmp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}")
                try:
                    with open(tmp, "wb") as f:
                        f.write(raw)
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)
            pid = ("b", name, a.dtype, tuple(a.shape))
            self.blobs[name] = a.nbytes
            self.seen[id(obj)] = pid
            self.keep.append(obj)
        return pid


def trimmed(spec: Specialization) -> Specialization:
    """The specialisation without the constants nothing reads at run time (a weight whose
    kernels read its packed copy): what a program needs, and what export reads."""
    used = {v for k in spec.kernels for v in k.inputs if v and v in spec.constants}
    for v in spec.graph.outputs:
        while True:
            used.add(v)
            if v in spec.aliases:
                v = spec.aliases[v]
                continue
            r = spec.memory.root(v)
            if r == v:
                break
            v = r
    consts = {c: a for c, a in spec.constants.items() if c in used}
    g = copy.copy(spec.graph)
    g.constants = {c: a for c, a in spec.graph.constants.items() if c in used}
    return dataclasses.replace(spec, graph=g, constants=consts, dumps={})


_last: tuple[weakref.ref, Path, bytes] | None = None     # the entry store wrote last


def store(key: str, spec: Specialization, face: Graph, num_nodes: int,
          base: Path | None = None, limit: int | None = None) -> bool:
    """Write the entry (its meta last, atomically, so a reader never sees half of it);
    False when it is not written (no cache, over the budget, a full or read-only disk).
    `base` and `limit` default to the cache directory and budget of the moment."""
    if base is None:
        base = root()
        if base is None:
            return False
    meta_path = base / key / "meta"
    if meta_path.exists():
        return False
    global _last
    try:
        last = _last
        if last is not None and last[0]() is spec and last[1] == base:
            data = last[2]      # one program under a second key (given and full shapes)
        else:
            (base / "blobs").mkdir(parents=True, exist_ok=True)
            meta = io.BytesIO()
            p = _Pickler(meta, base)
            p.dump({"spec": trimmed(spec), "face": face, "num_nodes": num_nodes})
            data = json.dumps({"blobs": p.blobs}).encode() + b"\n" + meta.getvalue()
            _last = (weakref.ref(spec), base, data)
        write_checksummed(meta_path, _MAGIC, data)
    except OSError:
        return False
    if not meta_path.exists():
        return False
    with _lock:
        stats.stored += 1
    evict(base, keep=meta_path.parent, limit=limit)
    return True


# -- stores in the background ------------------------------------------------------------
# Writing an entry is I/O over the model's weights (BERT-base: 440 MB, ~1 s here): the
# compile returns without waiting for it. One thread writes the entries in the order
# they were asked for (a program stored under a second key reuses the first's meta);
# a lookup in this process (`load`) and the end of the process wait for it, so a
# `cannc compile` leaves its entry behind and a session never misses its own store.

_cv = threading.Condition()
_queue: list[tuple] = []
_pending = 0
_inflight: dict[str, int] = {}        # key -> stores of it asked for, not yet written
_writer: threading.Thread | None = None


def _lower_priority() -> None:
    """The writer thread at the lowest priority (nice 19: on Linux, setpriority of a
    thread id is that thread's): it gives way to the AI cores' threads. Written after a
    cold compile, BERT-base's entry (2 s) made the runs meanwhile twice as slow (2 cores,
    batch 1: 180-200 ms against 100)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):       # (another OS: the writer as it is)
        pass


def store_later(key: str, spec: Specialization, face: Graph, num_nodes: int) -> None:
    """`store` on the background writer, with this moment's cache directory and budget."""
    global _pending, _writer
    base = root()
    if base is None:
        return
    with _cv:
        _queue.append((key, spec, face, num_nodes, base, budget()))
        _pending += 1
        _inflight[key] = _inflight.get(key, 0) + 1
        if _writer is None or not _writer.is_alive():
            _writer = threading.Thread(target=_write_loop, name="cannc-snapshot",
                                       daemon=True)
            _writer.start()
        _cv.notify_all()


def _write_loop() -> None:
    global _pending
    _lower_priority()
    while True:
        with _cv:
            while not _queue:
                _cv.wait()
            job = _queue.pop(0)
        try:
            store(*job)
        except Exception as e:          # a bug, not the disk: counted, the program runs
            with _lock:
                stats.store_errors += 1
                stats.last_store_error = f"{type(e).__name__}: {e}"
            if config.DEBUG:
                import sys
                print(f"[cannc] program cache: store failed: {e!r}", file=sys.stderr)
        finally:
            with _cv:
                _pending -= 1
                n = _inflight.pop(job[0]) - 1
                if n:
                    _inflight[job[0]] = n
                _cv.notify_all()
            del job


def wait_stores(timeout: float | None = None, key: str | None = None) -> bool:
    """Wait until every store asked for so far (of `key` only, if given) is written
    (False: timed out)."""
    with _cv:
        if key is not None:
            return _cv.wait_for(lambda: key not in _inflight, timeout)
        return _cv.wait_for(lambda: _pending == 0, timeout)


def _writer_forgotten_in_child() -> None:
    # a forked child has no writer thread; the parent writes what it asked for
    global _cv, _pending, _writer
    _cv = threading.Condition()
    _queue.clear()
    _inflight.clear()
    _pending = 0
    _writer = None


atexit.register(wait_stores)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_writer_forgotten_in_child)


def _header(meta: Path) -> dict[str, int] | None:
    data = read_checksummed(meta, _MAGIC)
    if not data:
        return None
    try:
        blobs = json.loads(data.split(b"\n", 1)[0])["blobs"]
    except (ValueError, KeyError, TypeError):
        return None
    return blobs if isinstance(blobs, dict) else None


def evict(base: Path, keep: Path | None = None, limit: int | None = None) -> None:
    """Least recently used entries out until the cache is within the budget (`limit`,
    default this moment's), then the blobs no entry names."""
    if limit is None:
        limit = budget()
    try:
        entries = []
        for d in base.iterdir():
            if d.name == "blobs" or d.name.startswith("."):
                continue
            meta = d / "meta"
            try:
                st = meta.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, d, _header(meta) or {}))
        entries.sort(key=lambda e: e[0])
        blob_sizes, blob_times = {}, {}
        for p in (base / "blobs").glob("*.w"):
            try:
                st = p.stat()
            except OSError:
                continue
            blob_sizes[p.stem], blob_times[p.stem] = st.st_size, st.st_mtime
    except OSError:
        return
    live = list(entries)

    def total() -> int:
        named = {b for e in live for b in e[3]}
        return sum(e[1] for e in live) + sum(s for b, s in blob_sizes.items() if b in named)

    while live and total() > limit:
        victim = next((e for e in live if e[2] != keep), None)
        if victim is None:
            break
        live.remove(victim)
        _remove(victim[2])
        with _lock:
            stats.evicted += 1
    named = {b for e in live for b in e[3]}
    now = time.time()
    for b in blob_sizes:
        # (a blob written or reused in the last minute may be another process's entry
        # whose meta is not written yet)
        if b not in named and now - blob_times[b] > BLOB_GRACE_S:
            try:
                _blob_path(base, b).unlink()
            except OSError:
                pass


def _remove(d: Path) -> None:
    """Out of the way first (so no reader finds half of it), then deleted."""
    gone = d.parent / f".gone-{d.name}-{os.getpid()}-{threading.get_ident()}"
    try:
        os.rename(d, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------

# blobs read by this process, by name: the programs of a session (and sessions of one
# model) share one copy, and one array object per view (WeightPool keys by identity)
_blobs: weakref.WeakValueDictionary[str, np.ndarray] = weakref.WeakValueDictionary()
_arrays: weakref.WeakValueDictionary[tuple, np.ndarray] = weakref.WeakValueDictionary()


def _read_blob(base: Path, name: str, size: int) -> np.ndarray:
    """The blob's bytes in page-aligned memory of this process's own, checked against
    their name. Read, not mapped: kernels that read weights from page-cache pages ran bert
    25-30% slower (152-161 ms against 120 ms a run, this Zen 4) than from a copy in
    anonymous memory, which the device's own buffers are (and the cost of the read,
    ~0.1 s a GiB, is small beside a compile)."""
    with _lock:
        buf = _blobs.get(name)
    if buf is not None:
        return buf
    path = _blob_path(base, name)
    buf = aligned_empty(max(size, 1), zero=False)[:size]
    with open(path, "rb") as f:
        ok = os.fstat(f.fileno()).st_size == size and size > 0 \
            and f.readinto(memoryview(buf)) == size
    if not ok or xxhash.xxh3_128(memoryview(buf)).hexdigest() != name:
        path.unlink(missing_ok=True)        # written again by the next store
        raise ValueError(f"blob {name} damaged or truncated")
    with _lock:
        return _blobs.setdefault(name, buf)


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: Any, base: Path, blobs: dict[str, int]) -> None:
        super().__init__(f)
        self.base = base
        self.blobs = blobs

    def persistent_load(self, pid: Any) -> Any:
        tag, name, dtype, shape = pid
        if tag != "b" or name not in self.blobs:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        k = (name, np.dtype(dtype).str, tuple(shape))
        with _lock:
            a = _arrays.get(k)
        if a is None:
            buf = _read_blob(self.base, name, int(self.blobs[name]))
            a = buf.view(dtype).reshape(shape)
            with _lock:
                a = _arrays.setdefault(k, a)
        return a


def load(key: str) -> Snapshot | None:
    """The entry for `key`, or None (missing; damaged entries are removed). A store of
    `key` in flight is waited for."""
    base = root()
    if base is None:
        return None
    wait_stores(key=key)
    d = base / key
    data = read_checksummed(d / "meta", _MAGIC)
    if data is None:
        with _lock:
            stats.misses += 1
        return None
    try:
        if not data:
            raise ValueError("meta checksum")
        header, payload = data.split(b"\n", 1)
        blobs = json.loads(header)["blobs"]
        got = _Unpickler(io.BytesIO(payload), base, blobs).load()
        spec, face, num_nodes = got["spec"], got["face"], int(got["num_nodes"])
        if not isinstance(spec, Specialization) or not isinstance(face, Graph):
            raise ValueError("not a program")
    except Exception:            # damaged, truncated or foreign: compiled again
        with _lock:
            stats.damaged += 1
            stats.misses += 1
        _remove(d)
        return None
    try:
        os.utime(d / "meta")     # recently used
    except OSError:
        pass
    with _lock:
        stats.hits += 1
    return Snapshot(spec, face, num_nodes, d)


def io_face(graph: Graph) -> Graph:
    """A graph of the model's inputs and outputs alone: what a session needs to check
    feeds and name outputs before (or without) the model's graph."""
    f = Graph(graph.name)
    f.inputs = list(graph.inputs)
    f.outputs = list(graph.outputs)
    f.opsets = dict(graph.opsets)
    for v in [*graph.inputs, *graph.outputs]:
        if v in graph.values:
            f.values[v] = graph.values[v]
    return f
