"""The persistent tuning cache: measured winners of `cannc tune`, used by later compiles.

An entry maps (kernel kind, kernel signature, CPU, cannc version) to the planner
overrides (`tuning` dicts, e.g. ``{"KC": 128, "pack_a": False}`` for
``codegen.gemm.gemm_plan``) that beat the modelled default plan when measured
on this CPU. Lowerings ask ``lookup(kind, signature)``; without an entry they
get ``None`` and plan exactly as they would without a cache.

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
import re
import threading
import time
import warnings
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import config

FORMAT = "cannc-tuning"
FORMAT_VERSION = 1

__all__ = [
    "TuningCache",
    "cpu_identity",
    "entries",
    "entry_key",
    "fingerprint",
    "gemm_signature",
    "gemm_tuning",
    "lookup",
    "store",
]


# ---------------------------------------------------------------------------
# what an entry is keyed on
# ---------------------------------------------------------------------------

def _cpuinfo_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""
    m = re.search(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)
    return m.group(1).strip() if m else ""


@lru_cache(maxsize=1)
def cpu_identity() -> dict[str, str]:
    """This CPU as the cache keys it: LLVM's host CPU name, /proc/cpuinfo's model name and a
    hash of the host target's features (what the generated code is compiled for)."""
    from ..native.target import host

    h = host()
    feats = hashlib.sha256(f"{h.triple}|{h.features}".encode()).hexdigest()[:16]
    return {"llvm_cpu": h.cpu, "model": _cpuinfo_model(), "features": feats}


def _version() -> str:
    from .._version import __version__

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
                raise ValueError("no 'entries' object")  # noqa: TRY004 - caught below
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
                self._entries = self._read()
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
_caches_lock = threading.Lock()


def cache(path: str | Path | None = None) -> TuningCache | None:
    """The cache at `path` (default: config.tuning_cache_path()); None without a path."""
    p = Path(path) if path is not None else config.tuning_cache_path()
    if p is None:
        return None
    p = p.expanduser().absolute()
    with _caches_lock:
        c = _caches.get(p)
        if c is None:
            c = _caches[p] = TuningCache(p)
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


def gemm_spec_of(signature: dict[str, Any]) -> Any:
    """The GemmSpec a gemm signature stands for (alpha = beta = 1)."""
    from ..codegen.gemm import GemmSpec

    return GemmSpec(**{k: v for k, v in signature.items() if k != "epilogue"})


def gemm_tuning(spec: Any, epilogue: bool = False) -> dict[str, Any] | None:
    """The cached tuning of this GEMM if there is one and the planner accepts it (a stale
    or edited entry that no longer plans is ignored with a warning)."""
    tun = lookup("gemm", gemm_signature(spec, epilogue))
    if tun is None:
        return None
    from ..codegen.gemm import gemm_plan

    try:
        gemm_plan(spec, tun)
    except Exception as e:  # noqa: BLE001 - any planner refusal: fall back to the default
        warnings.warn(f"ignoring tuning {tun} of GEMM {spec.M}x{spec.N}x{spec.K}: {e}",
                      RuntimeWarning, stacklevel=2)
        return None
    return tun


# ---------------------------------------------------------------------------
# measuring GEMM candidates (`cannc tune`)
# ---------------------------------------------------------------------------

def gemm_candidates(spec: Any, cores: int) -> list[dict[str, Any]]:
    """Legal planner overrides worth measuring for this GEMM, most promising first: the
    tile grid (ranked by the cost model for `cores` cores), K blocking, the micro-tile,
    A packing and the B access mode, interleaved so that a short budget tries each kind.
    Tunings that plan the same as the default (or as an earlier candidate) are dropped."""
    from ..codegen.gemm import _cdiv, _distinct_splits, _dot_able, gemm_plan
    from .costmodel import gemm_record, predict_gemm_us

    p0 = gemm_plan(spec)
    M, N, K = spec.M, spec.N, spec.K
    groups: dict[str, list[dict[str, Any]]] = {"grid": [], "KC": [], "micro": [], "A/B": []}
    # the tile grid: rows-only or columns-only splits, like the planner's own choice
    P, Q = _cdiv(M, p0.MR), _cdiv(N, p0.NR)
    grids = {(mt, 1) for mt, _ in _distinct_splits(P)} | {(1, nt) for nt, _ in _distinct_splits(Q)}
    groups["grid"] = [{"grid": [mt, nt]} for mt, nt in sorted(grids)
                      if spec.batch * mt * nt <= max(512, spec.batch)]
    if p0.b_mode == "dot":
        for mr in (1, 2, 4, 8):
            for nr in (4, 8, 16):
                if mr <= M:
                    groups["micro"].append({"MR": mr, "NR": nr})
    else:
        groups["KC"] = [{"KC": kc} for kc in (64, 96, 128, 192, 256, 384, 512, 1024) if kc < K]
        if K <= 4096:
            groups["KC"].append({"KC": K})
        for mr, nv in ((6, 2), (8, 2), (4, 2), (4, 4), (5, 2), (3, 4), (2, 6), (1, 8), (12, 2)):
            if mr <= M and 16 * nv <= 32 * _cdiv(N, 32):
                groups["micro"].append({"MR": mr, "NV": nv})
        groups["A/B"].append({"pack_a": not p0.pack_a})
        if not spec.b_prepacked:
            modes = ["pack"] + (["direct"] if not spec.trans_b else [])
            modes += ["dot"] if _dot_able(spec) else []
            groups["A/B"] += [{"b_mode": m} for m in modes if m != p0.b_mode]
    seen = {p0}
    ranked: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for g, tuns in groups.items():
        ranked[g] = []
        for t in tuns:
            try:
                plan = gemm_plan(spec, t)
                cost = predict_gemm_us(gemm_record(spec, t), cores)
            except (ValueError, AssertionError, ZeroDivisionError):
                continue
            if plan in seen:
                continue
            seen.add(plan)
            ranked[g].append((cost, t))
        ranked[g].sort(key=lambda ct: ct[0])
    out: list[dict[str, Any]] = []
    while any(ranked.values()):
        for lst in ranked.values():
            if lst:
                out.append(lst.pop(0)[1])
    return out


class GemmBench:
    """One GEMM on random data, run through the kernel ABI as `cores` cores would run it:
    the tile range split evenly, each core's range timed alone and the slowest taken
    (so that the other tenants of a shared machine do not decide the winner)."""

    def __init__(self, spec: Any, cores: int, seed: int = 0) -> None:
        import numpy as np

        from ..codegen.gemm import prepack_b
        from ..runtime.device import aligned_empty

        self.spec, self.cores = spec, max(1, int(cores))
        rng = np.random.default_rng(seed)
        s = spec

        def buf(n: int) -> Any:
            a = aligned_empty(4 * max(n, 1), 64).view(np.float32)
            a[:] = rng.standard_normal(a.size, dtype=np.float32)
            return a

        ra, ca = (s.K, s.M) if s.trans_a else (s.M, s.K)
        rb, cb = (s.N, s.K) if s.trans_b else (s.K, s.N)
        na = s.batch if s.a_batch_stride else 1
        nb = s.batch if s.b_batch_stride else 1
        self.A = buf((na - 1) * s.a_batch_stride + (ra - 1) * s.lda_ + ca)
        braw = buf((nb - 1) * s.b_batch_stride + (rb - 1) * s.ldb_ + cb)
        if s.b_prepacked:
            packed = prepack_b(s, braw)
            self.B = aligned_empty(4 * packed.size, 64).view(np.float32)
            self.B[:] = packed
        else:
            self.B = braw
        self.bias = None
        if s.bias:
            self.bias = buf((s.M - 1) * s.bias_row_stride + (s.N - 1) * s.bias_col_stride + 1)
        self.c_len = (s.batch - 1) * s.c_batch_stride_ + (s.M - 1) * s.ldc_ + s.N
        self.C = buf(self.c_len)

    def build(self, tuning: dict[str, Any] | None) -> Any:
        """(kernel, tiles, workspace) of the plan `tuning` (None: the default plan)."""
        import ctypes

        from ..codegen.gemm import emit_gemm, gemm_plan
        from ..native.target import jit_kernel, new_module
        from ..runtime.device import aligned_empty

        plan = gemm_plan(self.spec, tuning)
        m = new_module("tune")
        emit_gemm(m, "cannc_tune_gemm", self.spec, tuning=tuning)
        fn = jit_kernel(m, "cannc_tune_gemm", speed_level=2)   # as the compiler builds it
        ws = aligned_empty(max(plan.ws_bytes, 64), 64)
        ptrs = [self.A.ctypes.data, self.B.ctypes.data]
        if self.bias is not None:
            ptrs.append(self.bias.ctypes.data)
        ptrs.append(self.C.ctypes.data)
        args = (ctypes.c_void_p * len(ptrs))(*ptrs)
        return _Built(fn, args, plan.num_tiles(self.spec.batch), ws)

    def result(self, k: _Built) -> Any:
        self.C[:] = 0.0
        k.run(0, k.tiles)
        return self.C[:self.c_len].copy()

    def time_us(self, k: _Built, reps: int, blocks: int = 3) -> float:
        """µs of one call of the kernel on `cores` cores (the slowest core's range); each
        range runs `blocks` blocks of `reps` calls and the fastest block counts (other
        tenants of a shared machine only ever add time)."""
        T = k.tiles
        worst = 0.0
        for i in range(self.cores):
            lo, hi = i * T // self.cores, (i + 1) * T // self.cores
            if lo == hi:
                continue
            best = float("inf")
            for _ in range(blocks):
                t0 = time.perf_counter()
                for _ in range(reps):
                    k.run(lo, hi)
                best = min(best, (time.perf_counter() - t0) / reps)
            worst = max(worst, best)
        return worst * 1e6


class _Built:
    def __init__(self, fn: Any, args: Any, tiles: int, ws: Any) -> None:
        self.fn, self.args, self.tiles, self.ws = fn, args, tiles, ws
        self.ws_ptr = ws.ctypes.data

    def run(self, lo: int, hi: int) -> None:
        self.fn(self.args, lo, hi, self.ws_ptr)


def measure_pair(bench: GemmBench, base: _Built, cand: _Built, rounds: int = 5,
                 sample_us: float = 600.0) -> tuple[float, float]:
    """(base, cand) µs: the median of `rounds` samples of the base, and that divided by the
    median of the paired ratios base/cand (the rounds alternate which runs first, so the
    noise of a shared machine hits both sides of each pair alike)."""
    import statistics

    est = max(bench.time_us(base, 1, 1), bench.time_us(cand, 1, 1), 0.5)
    reps = max(1, min(10_000, int(sample_us / est)))
    tb, ratios = [], []
    for r in range(rounds):
        if r % 2 == 0:
            b, c = bench.time_us(base, reps), bench.time_us(cand, reps)
        else:
            c, b = bench.time_us(cand, reps), bench.time_us(base, reps)
        tb.append(b)
        ratios.append(b / c)
    base_us = statistics.median(tb)
    return base_us, base_us / statistics.median(ratios)
