"""The lowering memo: a kernel is generated once per *signature*, not per node.

Lowering a node (building its LLVM IR in Python) and compiling it cost far more
than everything else a compile does, and most kernels repeat: the twelve layers
of an encoder have the same four GEMMs, and a new sequence length of a
shape-polymorphic kernel (codegen/ABI.md "Runtime dimensions") is the same code.
So the compiler asks the memo before lowering. The key is what the generated
code may depend on:

- the op (name, domain, opset) and its attributes, with the value names of a
  fused body renamed canonically (layer 3's chain is layer 0's chain);
- the dtypes, and either the full shapes or, for a tiling op family, its
  ``Tiling.key`` (the runtime dimensions are left out: that is the point);
- the shapes of constant inputs, and the contents of those the lowering read
  without a recipe (a scalar folded into the code, a mask whose structure
  picks a variant): the first-level entry names them, their digests make the
  second-level key. Weights read through a pointer or transformed by a
  recorded recipe (packing) are not read, so every layer shares one kernel;
- the host target, the cannc sources, the tuning cache in effect.

An entry keeps the symbol, the object-cache key of its code, the inputs it
dropped, its constant recipes and its tiling results. It lives in memory and,
checksummed, in the cache directory (``lower/``), so a warm compile of an
unchanged model lowers nothing and compiles nothing.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import threading
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from .. import config
from ..ir.graph import Node
from ..ir.ops import lookup
from ..ir.types import TensorType, dtype_key
from ..native.target import host, read_checksummed, source_digest, write_checksummed
from ..schedule import machine, tuning

_MAGIC = b"CNCMEMO1\n"
# attributes that name where a node came from and never change its code
METADATA_ATTRS = frozenset({"fused_from"})


@dataclass
class MemoEntry:
    symbol: str
    object_key: str
    dropped: tuple[int, ...]
    recipes: dict[int, tuple[Any, tuple]]
    num_tiles: int
    workspace_bytes: int
    single_core: bool
    flops: int
    notes: dict[str, Any] = field(default_factory=dict)
    baked: tuple[int, ...] = ()        # constant inputs whose content is in the key
    # the library modules its code calls (native.target.library_needs): (symbol, object key)
    needs: tuple[tuple[str, str], ...] = ()


_array_digests: dict[int, tuple[Any, str]] = {}
_digest_lock = threading.Lock()


def array_digest(a: np.ndarray) -> str:
    """sha256 of an array's dtype, shape and bytes (memoised per array object:
    compile-time constants are not mutated)."""
    with _digest_lock:
        hit = _array_digests.get(id(a))
        if hit is not None and hit[0] is a:
            return hit[1]
    c = np.ascontiguousarray(a)
    h = hashlib.sha256(f"{dtype_key(c.dtype)}{c.shape}".encode())
    h.update(memoryview(c.reshape(-1).view(np.uint8)))
    d = h.hexdigest()
    with _digest_lock:
        if len(_array_digests) > 65536:
            _array_digests.clear()
        _array_digests[id(a)] = (a, d)
    return d


class _Canon:
    """Stable text for attribute values; value names renamed in order of appearance."""

    def __init__(self, node: Node, polymorphic: bool) -> None:
        self.names: dict[str, str] = {}
        for i, v in enumerate(node.inputs):
            if v:
                self.names.setdefault(v, f"i{i}")
        for j, v in enumerate(node.outputs):
            if v:
                self.names.setdefault(v, f"o{j}")
        self.polymorphic = polymorphic

    def name(self, v: str) -> str:
        if not v:
            return ""
        if v not in self.names:
            self.names[v] = f"t{len(self.names)}"
        return self.names[v]

    def type(self, t: TensorType) -> str:
        dt = dtype_key(t.dtype)
        if self.polymorphic:   # extents come from the tiling key (and the runtime)
            return f"T({dt},r{len(t.shape)})"
        return f"T({dt},{tuple(t.shape)})"

    def __call__(self, x: Any) -> str:
        if isinstance(x, Node):
            return (f"N({x.op_type},{x.domain},{x.opset},"
                    f"[{','.join(self.name(v) for v in x.inputs)}]->"
                    f"[{','.join(self.name(v) for v in x.outputs)}],{self.attrs(x.attrs)})")
        if isinstance(x, TensorType):
            return self.type(x)
        if isinstance(x, np.ndarray):
            return f"A({array_digest(x)})"
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                kk = self.name(k) if isinstance(k, str) and k in self.names else self(k)
                items.append((kk, self(v)))
            return "{" + ",".join(f"{k}:{v}" for k, v in sorted(items)) + "}"
        if isinstance(x, (list, tuple)):
            return "[" + ",".join(self(v) for v in x) + "]"
        if isinstance(x, Enum):
            return repr(x.value)
        if is_dataclass(x) and not isinstance(x, type):
            return type(x).__name__ + "(" + ",".join(self(getattr(x, f.name))
                                                     for f in fields(x)) + ")"
        if isinstance(x, (np.generic,)):
            return repr(x.item())
        if isinstance(x, float):
            return float.hex(x)
        if isinstance(x, bytes):
            return "b" + hashlib.sha256(x).hexdigest()
        return repr(x)

    def attrs(self, attrs: dict[str, Any]) -> str:
        # names inside a fused body (its "types" map) are renamed first, in body order
        body = attrs.get("body")
        if body:
            for n in body:
                for v in list(n.inputs) + list(n.outputs):
                    self.name(v)
        return "{" + ",".join(f"{k}:{self(attrs[k])}" for k in sorted(attrs)
                              if k not in METADATA_ATTRS) + "}"


def node_key(node: Node, in_types: list[TensorType | None], out_types: list[TensorType],
             consts: list[np.ndarray | None], tiling_key: tuple | None, salt: str,
             tiling_attrs: tuple[str, ...] = ()) -> str:
    """The first-level key (constants by shape only). For a tiling op family the
    extents are left out: shapes count by rank, constant inputs by dtype and rank
    (their contents join at the second level if the lowering reads them), and
    ``tiling_attrs`` (attributes that restate sizes, covered by the tiling key)
    are skipped."""
    poly = tiling_key is not None
    canon = _Canon(node, polymorphic=poly)
    attrs = {k: v for k, v in node.attrs.items() if not (poly and k in tiling_attrs)}
    parts = [salt, node.op_type, node.domain, str(node.opset), canon.attrs(attrs)]
    revs = [_revision(n) for n in [node, *(node.attrs.get("body") or ())]]
    if any(revs):
        parts.append("rev:" + ",".join(revs))
    parts.append(canon(list(in_types)) + "->" + canon(list(out_types)))
    if poly:
        parts.append("tiling:" + canon(tiling_key))
    for i, c in enumerate(consts):
        if c is not None:
            shape = f"r{c.ndim}" if poly else str(tuple(c.shape))
            parts.append(f"C{i}:{dtype_key(c.dtype)}{shape}")
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def _revision(n: Any) -> str:
    """A custom op's body digest (OpDef.revision): a changed body is new code."""
    op = lookup(getattr(n, "op_type", ""), getattr(n, "domain", ""))
    return op.revision if op is not None else ""


def baked_key(key: str, consts: list[np.ndarray | None], baked: tuple[int, ...]) -> str:
    h = hashlib.sha256(key.encode())
    for i in baked:
        c = consts[i]
        h.update(f"{i}:{array_digest(c) if c is not None else '-'}".encode())
    return h.hexdigest()


class LoweringMemo:
    def __init__(self, root: Path | None) -> None:
        self.root = root / "lower" if root is not None else None
        self.memory: dict[str, MemoEntry] = {}
        self.lock = threading.Lock()

    def _path(self, key: str) -> Path:
        assert self.root is not None
        return self.root / key[:2] / f"{key}.pkl"

    def get(self, key: str) -> MemoEntry | None:
        with self.lock:
            e = self.memory.get(key)
        if e is not None or self.root is None:
            return e
        payload = read_checksummed(self._path(key), _MAGIC)
        if not payload:
            return None     # missing, or damaged: lower again (and overwrite)
        try:
            e = pickle.loads(payload)
        except Exception:   # an entry written by another cannc, or damaged: lower again
            return None
        if not _well_formed(e):
            return None
        with self.lock:
            self.memory[key] = e
        return e

    def put(self, key: str, e: MemoEntry) -> None:
        with self.lock:
            self.memory[key] = e
        if self.root is None:
            return
        try:
            payload = pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            # an unpicklable note or recipe: keep it in memory only
            return
        write_checksummed(self._path(key), _MAGIC, payload)


def _well_formed(e: Any) -> bool:
    """Whether an entry read back has the types the lowering relies on (one that does not
    is treated as missing: lowered again and overwritten)."""
    if not isinstance(e, MemoEntry):
        return False
    try:
        return (isinstance(e.symbol, str) and isinstance(e.object_key, str)
                and isinstance(e.dropped, tuple) and all(isinstance(i, int) for i in e.dropped)
                and isinstance(e.recipes, dict) and isinstance(e.notes, dict)
                and isinstance(e.baked, tuple) and all(isinstance(i, int) for i in e.baked)
                and isinstance(e.needs, tuple) and all(
                    isinstance(n, tuple) and len(n) == 2 and all(isinstance(x, str) for x in n)
                    for n in e.needs)
                and all(isinstance(getattr(e, f), int) and getattr(e, f) >= 0
                        for f in ("num_tiles", "workspace_bytes", "flops"))
                and isinstance(e.single_core, bool))
    except AttributeError:      # (a MemoEntry pickled before a field was added)
        return False


_memos: dict[str, LoweringMemo] = {}


def default_memo() -> LoweringMemo:
    root = config.cache_dir()
    k = str(root)
    if k not in _memos:
        _memos[k] = LoweringMemo(root)
    return _memos[k]


# The codegen's module switches that tests and experiments set, with the values their
# modules start with. salt() reads them where their modules are imported and takes these
# values where not: a process that runs programs from the program cache never imports the
# code generators (tens of ms), and its key must be the one of the process that compiled
# them.
# (tests/test_program_cache.py checks the values against the modules.)
SWITCHES: tuple[tuple[str, str, Any], ...] = (
    ("conv", "FORCE_TUNING", {}),
    ("stemconv", "FORCE_TUNING", {}),
    ("winograd", "FORCE_TUNING", {}),
    ("lower.conv", "FORCE_LOWP_MODE", None),
    ("amx", "OVERLAP_STORES", True),
    ("amx_conv", "CB_CHUNK_MIN_P", 256),
    ("amx_conv", "CB_OUTER_MIN_NCB", 2),
)


def _switch(module: str, attr: str, default: Any) -> Any:
    m = sys.modules.get(f"{__package__}.{module}")
    return getattr(m, attr) if m is not None else default


def salt() -> str:
    """Everything global the generated code depends on: the host target, cannc's
    sources, the tuning cache in effect, the FMA pipes measured on this machine (they
    pick the GEMM's micro-kernel: a re-measurement that says otherwise must not find the
    other kernels) and the codegen switches (environment and the FORCE_TUNING overrides
    tests and experiments set)."""
    sw = {f"{m}.{a}": _switch(m, a, default) for m, a, default in SWITCHES}
    switches = (f"wino={config.WINOGRAD}|conv={sorted(sw['conv.FORCE_TUNING'].items())!r}|"
                f"stem={config.STEM_CONV},{sorted(sw['stemconv.FORCE_TUNING'].items())!r}|"
                f"wg={sorted(sw['winograd.FORCE_TUNING'].items())!r}|"
                f"lowp={sw['lower.conv.FORCE_LOWP_MODE']}|amx={sw['amx.OVERLAP_STORES']}|"
                f"amxconv={sw['amx_conv.CB_CHUNK_MIN_P']},{sw['amx_conv.CB_OUTER_MIN_NCB']}")
    return (f"{host().fingerprint}|{source_digest()}|{tuning.fingerprint()}|"
            f"pipes={machine.fma_pipes()}|{switches}")
