"""The native side of cannc's ONNX Runtime execution provider: the C shim (`_shim.c`).

The shim is a plain shared library (not a Python module) loaded with ctypes. The
package's install builds it (setup.py, a setuptools extension); a source tree that was
never installed (or whose shim source changed since) builds it on first use with the
system C compiler into a per-user cache directory keyed by the source's hash.

What is here:
- `library_path()`, `load()`: the library (always one path, so ORT's dlopen and ctypes
  share one handle and one copy of its globals);
- ctypes mirrors of `cannc_ctx` / `cannc_prog` and the signatures of every export;
- `program_record(prog, ctx)`: a cannc runtime Program and one of its Contexts as the
  records the shim runs (a `ProgramRecord` keeps every buffer they point to alive);
- `NativeNode`: one ORT fused node's native compute (`cannc_node_*`), with the Python
  slow paths (`specialize` for new input shapes, more contexts) as ctypes callbacks that
  turn exceptions into the shim's error messages.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..config import cache_dir
from ..errors import CanncError
from ..native.target import JitLibrary
from ..runtime import dispatch
from ..runtime.program import MAX_CONTEXTS, Context, Program, dispatcher_object

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_shim.c"
LIBRARY_NAME = "_shim.so"     # what setup.py's build gives (no Python ABI tag)
HASH_TAG = b"cannc-shim-hash:"
MAX_PROGRAMS = 256            # _shim.c MAX_PROGS
MAX_CORES = 256

# -- the library ----------------------------------------------------------------------------


def source_hash(src: bytes | None = None) -> str:
    """The shim source's identity (setup.py compiles it into the library)."""
    data = SOURCE.read_bytes() if src is None else src
    return hashlib.sha256(data).hexdigest()[:16]


def _up_to_date(lib: Path, want: str | None) -> bool:
    if not lib.is_file():
        return False
    if want is None:           # an installed package without the source: trust the build
        return True
    try:
        return (HASH_TAG + want.encode()) in lib.read_bytes()
    except OSError:
        return False


def _cache_root() -> Path:
    d = cache_dir()
    if d is None:              # CANNC_CACHE_DIR=off: still per user
        d = Path(tempfile.gettempdir()) / f"cannc-{os.getuid()}"
    return d / "ort"


def _compiler() -> list[str]:
    cc = os.environ.get("CC")
    if cc:
        return cc.split()
    for name in ("cc", "gcc", "clang"):
        p = shutil.which(name)
        if p:
            return [p]
    raise CanncError(
        "cannc's ONNX Runtime shim (cannc/ort/_shim.c) is not built and no C compiler was "
        "found to build it: install one (e.g. `apt-get install gcc`) or set CC, or "
        "reinstall cannc (`pip install .`), whose install builds the shim")


def build(dest_dir: Path | None = None) -> Path:
    """Compile the shim into dest_dir (default: the per-user cache), keyed by its hash."""
    try:
        src = SOURCE.read_bytes()
    except OSError as e:
        raise CanncError(f"cannc's ONNX Runtime shim source is missing ({SOURCE}): "
                         "reinstall cannc") from e
    h = source_hash(src)
    d = _cache_root() if dest_dir is None else Path(dest_dir)
    out = d / f"_shim-{h}.so"
    if _up_to_date(out, h):
        return out
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CanncError(f"cannot create the directory for cannc's ORT shim ({d}): {e}; "
                         "set CANNC_CACHE_DIR to a writable directory") from e
    cmd = _compiler()
    fd, tmp = tempfile.mkstemp(prefix="_shim-", suffix=".so.tmp", dir=d)
    os.close(fd)
    try:
        r = subprocess.run([*cmd, "-O2", "-shared", "-fPIC", "-pthread",
                            f'-DCANNC_SHIM_HASH="{h}"', "-o", tmp, str(SOURCE)],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise CanncError(f"building cannc's ORT shim with {' '.join(cmd)} failed "
                             f"(exit {r.returncode}):\n{r.stderr.strip()}")
        os.replace(tmp, out)   # atomic: a concurrent build never sees half a library
    except OSError as e:
        raise CanncError(f"building cannc's ORT shim with {' '.join(cmd)} failed: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise CanncError("building cannc's ORT shim timed out") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_path: str | None = None
_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


def library_path() -> str:
    """The shim's path: the one the package's install built next to this file, else (a
    source tree never installed, or a shim source changed since) one built on demand in
    the per-user cache. Always the same path within a process."""
    global _path
    with _lock:
        if _path is None:
            want = source_hash() if SOURCE.is_file() else None
            packaged = HERE / LIBRARY_NAME
            _path = str(packaged if _up_to_date(packaged, want) else build())
        return _path


# -- the ABI's records (mirrors of _shim.c) -----------------------------------------------


class CtxStruct(ctypes.Structure):
    """cannc_ctx: one execution context of a program."""

    _fields_ = [("sched", ctypes.c_void_p), ("workspace", ctypes.c_void_p),
                ("in_ptrs", ctypes.POINTER(ctypes.c_void_p)),
                ("out_ptrs", ctypes.POINTER(ctypes.c_void_p)),
                ("busy", ctypes.c_int64)]


class ProgStruct(ctypes.Structure):
    """cannc_prog: one specialisation (one set of input shapes)."""

    _fields_ = [("nk", ctypes.c_int64), ("ws_stride", ctypes.c_int64),
                ("in_dims", ctypes.POINTER(ctypes.c_int64)),
                ("out_dims", ctypes.POINTER(ctypes.c_int64)),
                ("in_bytes", ctypes.POINTER(ctypes.c_int64)),
                ("out_bytes", ctypes.POINTER(ctypes.c_int64)),
                ("prof", ctypes.POINTER(ctypes.c_int64)),
                ("prof_runs", ctypes.c_int64),
                ("n_ctx", ctypes.c_int64),
                ("ctx", ctypes.POINTER(CtxStruct) * MAX_CONTEXTS)]


_i64, _vp, _sz = ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t
RUN_FN = dispatch.RUN_FUNC_TYPE
# (user, in_dims, err, errlen) -> cannc_prog* ; (user, prog, err, errlen) -> cannc_ctx*
SPECIALIZE_FN = ctypes.CFUNCTYPE(_vp, _vp, ctypes.POINTER(_i64), _vp, _sz)
GROW_FN = ctypes.CFUNCTYPE(_vp, _vp, ctypes.POINTER(ProgStruct), _vp, _sz)
CREATE_FACTORIES_FN = ctypes.CFUNCTYPE(_vp, ctypes.c_char_p, _vp, _vp,
                                       ctypes.POINTER(_vp), _sz, ctypes.POINTER(_sz))
RELEASE_FACTORY_FN = ctypes.CFUNCTYPE(_vp, _vp)
# OrtNodeComputeInfo.Compute: (this, state, kernel context) -> OrtStatus*
COMPUTE_FN = ctypes.CFUNCTYPE(_vp, _vp, _vp, _vp)

_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "CreateEpFactories": (_vp, [ctypes.c_char_p, _vp, _vp, ctypes.POINTER(_vp), _sz,
                                ctypes.POINTER(_sz)]),
    "ReleaseEpFactory": (_vp, [_vp]),
    "cannc_ep_set_callbacks": (None, [CREATE_FACTORIES_FN, RELEASE_FACTORY_FN]),
    "cannc_node_new": (_vp, [_vp, _i64, ctypes.POINTER(_i64), _i64, ctypes.POINTER(_i64),
                             _i64, _vp, SPECIALIZE_FN, GROW_FN, _vp]),
    "cannc_node_set_names": (ctypes.c_int, [_vp, ctypes.c_char_p,
                                            ctypes.POINTER(ctypes.c_char_p)]),
    "cannc_node_add_program": (ctypes.c_int, [_vp, ctypes.POINTER(ProgStruct)]),
    "cannc_node_free": (None, [_vp]),
    "cannc_compute": (_vp, [_vp, _vp, _vp]),
    "cannc_pool_reserve": (ctypes.c_int, [_i64]),
    "cannc_pool_stats": (None, [ctypes.POINTER(_i64)]),
}


def load() -> ctypes.CDLL:
    """The shim, loaded once (from library_path()), every export's signature declared."""
    global _lib
    path = library_path()
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise CanncError(f"cannot load cannc's ORT shim {path}: {e}") from e
            for name, (res, args) in _SIGNATURES.items():
                f = getattr(lib, name)
                f.restype, f.argtypes = res, args
            _lib = lib
        return _lib


def pool_stats() -> tuple[int, int]:
    """(native AI-core worker threads, launches a worker joined)."""
    out = (ctypes.c_int64 * 2)()
    load().cannc_pool_stats(out)
    return int(out[0]), int(out[1])


def compute_address() -> int:
    """cannc_compute's address: OrtNodeComputeInfo.Compute."""
    return ctypes.cast(load().cannc_compute, ctypes.c_void_p).value or 0


_dispatch_lib: Any = None


def dispatcher_address() -> int:
    """The native dispatcher (cannc_run) of a process-wide library that lives forever: the
    `run` of every node (each Program's library holds an identical copy)."""
    global _dispatch_lib
    with _lock:
        if _dispatch_lib is None:
            _dispatch_lib = JitLibrary([dispatcher_object()])
        return _dispatch_lib.address(dispatch.ENTRY)


# -- records of a cannc Program -------------------------------------------------------------


def _i64_array(vals: Sequence[int]) -> Any:
    return (ctypes.c_int64 * max(len(vals), 1))(*[int(v) for v in vals])


class ProgramRecord:
    """A cannc runtime Program as the shim's cannc_prog, and its contexts as cannc_ctx.
    Keeps the Program, its Contexts and every array the records point to alive: drop it
    only once the node holding it is freed."""

    def __init__(self, prog: Program, ctx: Context, *, profile: bool = False,
                 inputs: Sequence[str] | None = None,
                 outputs: Sequence[str] | None = None) -> None:
        if not isinstance(prog, Program):
            raise CanncError(f"native compute needs a cannc runtime Program, got "
                             f"{type(prog).__name__} (a model with runtime control flow "
                             "runs a host program)")
        g = prog.spec.graph
        self.program = prog
        # the node's order of inputs and outputs (an ORT fused node's), default the program's
        self.input_names = list(prog.input_names) if inputs is None else list(inputs)
        self.output_names = list(g.outputs) if outputs is None else list(outputs)
        for kind, names, known in (("input", self.input_names, prog.input_names),
                                   ("output", self.output_names, g.outputs)):
            bad = [n for n in names if n not in known]
            if bad or len(set(names)) != len(names):
                raise CanncError(f"program_record: {kind}s {names} are not distinct "
                                 f"{kind}s of the program ({list(known)})")
        self._out_index = [list(g.outputs).index(n) for n in self.output_names]
        in_dims: list[int] = []
        out_dims: list[int] = []
        for names, dims in ((self.input_names, in_dims), (self.output_names, out_dims)):
            for n in names:
                t = g.values[n]
                if not all(isinstance(d, (int, np.integer)) for d in t.shape):
                    raise CanncError(f"value '{n}' has a symbolic shape {t.shape} in a "
                                     "specialisation: not runnable natively")
                dims.extend(int(d) for d in t.shape)
        self.in_ndim = [len(g.values[n].shape) for n in self.input_names]
        self.out_ndim = [len(g.values[n].shape) for n in self.output_names]
        self.in_shapes = tuple(tuple(int(d) for d in g.values[n].shape)
                               for n in self.input_names)
        self.out_shapes = tuple(tuple(int(d) for d in g.values[n].shape)
                                for n in self.output_names)
        self.in_bytes = [int(g.values[n].nbytes) for n in self.input_names]
        self.out_bytes = [int(g.values[n].nbytes) for n in self.output_names]
        self.nk = len(prog.spec.kernels)
        self._in_dims = _i64_array(in_dims)
        self._out_dims = _i64_array(out_dims)
        self._in_bytes = _i64_array(self.in_bytes)
        self._out_bytes = _i64_array(self.out_bytes)
        self._prof = (ctypes.c_int64 * max(2 * self.nk, 2))() if profile else None
        self._contexts: list[tuple[Context, CtxStruct, Any, Any]] = []
        self._lock = threading.Lock()
        s = self.struct = ProgStruct()
        s.nk = self.nk
        s.ws_stride = int(prog.ws_stride)
        s.in_dims = self._in_dims
        s.out_dims = self._out_dims
        s.in_bytes = self._in_bytes
        s.out_bytes = self._out_bytes
        if self._prof is not None:
            s.prof = self._prof
        s.prof_runs = 0
        s.ctx[0] = ctypes.pointer(self._context(ctx))
        s.n_ctx = 1

    @property
    def address(self) -> int:
        return ctypes.addressof(self.struct)

    @property
    def cores(self) -> int:
        """The program's device cores: a node may launch it on at most this many."""
        return int(self.program.device.cores)

    def _context(self, ctx: Context) -> CtxStruct:
        prog = self.program
        if not ctx.busy or not any(c is ctx for c in prog._contexts):
            raise CanncError("program_record needs a Context of this Program taken with "
                             "prog.acquire() (from then on the shim owns it)")
        lo = ctx.arena.ctypes.data
        hi = lo + ctx.arena.nbytes
        ins = []
        for n, nb in zip(self.input_names, self.in_bytes):
            v = ctx.inputs[n]
            a = v.ctypes.data
            if nb and not (v.flags.c_contiguous and lo <= a and a + nb <= hi):
                raise CanncError(f"input '{n}' is not a runtime input of this specialisation "
                                 "(its value decides shapes, so it was made a constant): "
                                 "native compute cannot feed it")
            ins.append(a)
        outs = []
        for n, j in zip(self.output_names, self._out_index):
            v = ctx.outputs[j]
            if not v.flags.c_contiguous:
                raise CanncError(f"output '{n}' is not contiguous in device memory")
            outs.append(v.ctypes.data)
        in_ptrs = (ctypes.c_void_p * max(len(ins), 1))(*ins)
        out_ptrs = (ctypes.c_void_p * max(len(outs), 1))(*outs)
        c = CtxStruct()
        c.sched = ctx.sched.ctypes.data
        c.workspace = ctx.workspace.ctypes.data
        c.in_ptrs = ctypes.cast(in_ptrs, ctypes.POINTER(ctypes.c_void_p))
        c.out_ptrs = ctypes.cast(out_ptrs, ctypes.POINTER(ctypes.c_void_p))
        c.busy = 0
        with self._lock:
            self._contexts.append((ctx, c, in_ptrs, out_ptrs))
        return c

    def new_context(self) -> int:
        """Another execution context (the shim's `grow`): its cannc_ctx address, which the
        shim appends to the record itself. Blocks while the Program has none to give."""
        return ctypes.addressof(self._context(self.program.acquire()))

    @property
    def num_contexts(self) -> int:
        return int(self.struct.n_ctx)

    def release(self) -> None:
        """Give the contexts back to the Program (only once no node can run them)."""
        with self._lock:
            ctxs, self._contexts = self._contexts, []
        for ctx, *_ in ctxs:
            self.program.release(ctx)

    def profile(self) -> tuple[np.ndarray, int]:
        """([nk, 2] sums of wall and busy cycles per kernel, runs profiled)."""
        if self._prof is None:
            return np.zeros((self.nk, 2), np.int64), 0
        a = np.ctypeslib.as_array(self._prof)[:2 * self.nk].reshape(self.nk, 2).copy()
        return a, int(self.struct.prof_runs)


def program_record(prog: Program, ctx: Context, *, profile: bool = False,
                   inputs: Sequence[str] | None = None,
                   outputs: Sequence[str] | None = None) -> ProgramRecord:
    """The shim's records of `prog` and its context `ctx` (taken with prog.acquire() and
    left busy: the shim owns it from now on); `profile` gives the record per-kernel cycle
    sums the shim adds into; `inputs` / `outputs`: the node's order of the program's
    inputs and outputs (default: the program's)."""
    return ProgramRecord(prog, ctx, profile=profile, inputs=inputs, outputs=outputs)


# -- one fused node -------------------------------------------------------------------------


def _write_err(err: int, errlen: int, msg: str) -> None:
    b = msg.encode("utf-8", "replace")[:max(errlen - 1, 0)]
    if err and errlen:
        ctypes.memmove(err, b + b"\0", len(b) + 1)


class NativeNode:
    """One ORT fused node's native compute: `cannc_node_new` with the Python slow paths.

    `specialize(shapes)` gets the inputs' shapes (a tuple of tuples) of a call no program
    matches and returns the ProgramRecord for them (called at most once per shape set,
    from the computing thread, the GIL taken by ctypes); its exceptions become the error
    status the compute returns. `compute_state` is what OrtNodeComputeInfo.Compute
    (`compute_address()`) takes as its state.
    """

    def __init__(self, ort_api: int, in_ndim: Sequence[int], out_ndim: Sequence[int], *,
                 cores: int = 1,
                 specialize: Callable[[tuple[tuple[int, ...], ...]], ProgramRecord]
                 | None = None,
                 name: str | None = None, input_names: Sequence[str] | None = None) -> None:
        if not isinstance(cores, int) or not 1 <= cores <= MAX_CORES:
            raise CanncError(f"cores must be an integer in 1..{MAX_CORES}, got {cores!r}")
        if not ort_api:
            raise CanncError("NativeNode needs the OrtApi table's address")
        self.lib = load()
        self.in_ndim = [int(n) for n in in_ndim]
        self.out_ndim = [int(n) for n in out_ndim]
        self.cores = cores
        self.name = name
        self._specialize = specialize
        self.records: dict[int, ProgramRecord] = {}    # address -> record (alive)
        self._lock = threading.Lock()
        self.specialize_calls = 0
        self._spec_cb = SPECIALIZE_FN(self._on_specialize)
        self._grow_cb = GROW_FN(self._on_grow)
        self._in_arr = _i64_array(self.in_ndim)
        self._out_arr = _i64_array(self.out_ndim)
        handle = self.lib.cannc_node_new(ort_api, len(self.in_ndim), self._in_arr,
                                         len(self.out_ndim), self._out_arr, cores,
                                         dispatcher_address(), self._spec_cb, self._grow_cb,
                                         None)
        if not handle:
            raise CanncError(f"cannc_node_new refused the node (inputs' ranks {self.in_ndim}, "
                             f"outputs' {self.out_ndim}, cores {cores}): ranks must be "
                             "0..64 and the AI-core workers must start")
        self.handle: int | None = handle
        if name is not None or input_names is not None:
            names = None
            if input_names is not None:
                if len(input_names) != len(self.in_ndim):
                    raise CanncError(f"{len(input_names)} input names for "
                                     f"{len(self.in_ndim)} inputs")
                names = (ctypes.c_char_p * len(input_names))(
                    *[n.encode() for n in input_names])
            self.lib.cannc_node_set_names(handle, name.encode() if name else None, names)

    @property
    def compute_state(self) -> int:
        if self.handle is None:
            raise CanncError("the native node was freed")
        return self.handle

    def _check(self, rec: ProgramRecord) -> None:
        if not isinstance(rec, ProgramRecord):
            raise CanncError(f"specialize must return a ProgramRecord, got "
                             f"{type(rec).__name__}")
        if rec.in_ndim != self.in_ndim or rec.out_ndim != self.out_ndim:
            raise CanncError(f"the program's ranks (inputs {rec.in_ndim}, outputs "
                             f"{rec.out_ndim}) differ from the node's (inputs {self.in_ndim}, "
                             f"outputs {self.out_ndim})")
        if rec.cores < self.cores:
            raise CanncError(f"the program was laid out for {rec.cores} cores, the node "
                             f"launches on {self.cores}")

    def add_program(self, rec: ProgramRecord) -> None:
        """A program known up front (e.g. compiled in GetCapability)."""
        self._check(rec)
        with self._lock:
            self.records[rec.address] = rec
        rc = self.lib.cannc_node_add_program(self.compute_state, ctypes.byref(rec.struct))
        if rc != 0:
            with self._lock:
                self.records.pop(rec.address, None)
            why = {-2: f"the node has {MAX_PROGRAMS} programs already",
                   -3: f"these input shapes {rec.in_shapes} have a program already"}
            raise CanncError(f"cannc_node_add_program failed: {why.get(rc, 'bad record')}")

    def _on_specialize(self, user: int, dims: Any, err: int, errlen: int) -> int:
        try:
            flat = [int(dims[i]) for i in range(sum(self.in_ndim))]
            shapes, pos = [], 0
            for n in self.in_ndim:
                shapes.append(tuple(flat[pos:pos + n]))
                pos += n
            shapes_t = tuple(shapes)
            self.specialize_calls += 1
            if self._specialize is None:
                raise CanncError(f"no program for input shapes {shapes_t}")
            rec = self._specialize(shapes_t)
            self._check(rec)
            if rec.in_shapes != shapes_t:
                raise CanncError(f"specialize returned a program for input shapes "
                                 f"{rec.in_shapes}, not {shapes_t}")
            with self._lock:
                self.records[rec.address] = rec
            return rec.address
        except BaseException as e:   # ctypes would swallow it
            _write_err(err, errlen, f"{type(e).__name__}: {e}")
            return 0

    def _on_grow(self, user: int, prog: Any, err: int, errlen: int) -> int:
        try:
            addr = ctypes.cast(prog, ctypes.c_void_p).value
            with self._lock:
                rec = self.records.get(addr)
            if rec is None:
                raise CanncError("grow: unknown program record")
            return rec.new_context()
        except BaseException as e:
            _write_err(err, errlen, f"{type(e).__name__}: {e}")
            return 0

    def compute(self, kernel_context: int) -> int:
        """cannc_compute on this node (what ORT calls): the OrtStatus* (0: success)."""
        return self.lib.cannc_compute(None, self.compute_state, kernel_context) or 0

    def free(self) -> None:
        """cannc_node_free: waits until no compute and no launch is inside this node."""
        h, self.handle = self.handle, None
        if h is not None:
            self.lib.cannc_node_free(h)
            with self._lock:
                recs, self.records = list(self.records.values()), {}
            for r in recs:
                r.release()

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass
