"""The one owner of LLVM state: initialisation, the host target, optimisation,
object emission, the on-disk object cache and JIT loading.

Lifecycle of a kernel module: build IR -> verify -> optimise -> verify ->
emit object -> cache -> load. A fresh TargetMachine is made per engine and per
emission (llvmlite's MCJIT takes ownership of the one it is given).

Code model: large, static relocation (CODE_MODEL). MCJIT's memory manager maps an
object's code and data sections separately, wherever the kernel finds room; in a
long-lived process with a fragmented address space they can end up more than 2 GiB
apart, and the 32-bit PC-relative relocations of the default (small, PIC) model
(code -> constant pool, .eh_frame -> code, calls through stubs) then fail
RuntimeDyldELF's `isInt<32>` assertion, which aborts the process. The large model
addresses everything with 64-bit absolute relocations, so any placement links
(benchmarks/jit_address_space.py reproduces the abort and measures the cost).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
import llvmlite.ir as ir
import xxhash

from .. import config
from ..errors import CompileError
from . import llvm_procs
from ._llvm_worker import configure, optimise

_init_lock = threading.Lock()
_initialised = False
CODEGEN_VERSION = "2"   # 2: without Loop Strength Reduction (_llvm_worker.CODEGEN_OPTIONS)
# (codemodel, reloc) of every TargetMachine: see the module docstring
CODE_MODEL = ("large", "static")


def init() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            configure(llvm)
            _initialised = True


@dataclass(frozen=True)
class HostTarget:
    triple: str
    cpu: str
    features: str

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(
            f"{self.triple}|{self.cpu}|{self.features}|llvmlite {llvmlite.__version__}|"
            f"cg {CODEGEN_VERSION}|{CODE_MODEL[0]}/{CODE_MODEL[1]}".encode()
        ).hexdigest()[:16]

    def has(self, feature: str) -> bool:
        return f"+{feature}" in self.features.split(",")

    @property
    def vector_bytes(self) -> int:
        return 64 if self.has("avx512f") else 32 if self.has("avx2") else 16

    def machine(self, opt: int = 3) -> llvm.TargetMachine:
        init()
        return llvm.Target.from_triple(self.triple).create_target_machine(
            cpu=self.cpu, features=self.features, opt=opt, reloc=CODE_MODEL[1],
            codemodel=CODE_MODEL[0])


_host: HostTarget | None = None


def host() -> HostTarget:
    global _host
    if _host is None:
        init()
        _host = HostTarget(
            llvm.get_process_triple(), llvm.get_host_cpu_name(),
            restrict_isa(llvm.get_host_cpu_features().flatten(), config.ISA),
        )
    return _host


def restrict_isa(features: str, isa: str | None) -> str:
    """The feature string without what ``isa`` ('avx2': every AVX-512 extension;
    'avx512-nobf16': avx512_bf16, avx512_fp16 and AMX) does not have, to generate and
    test the code of a smaller machine (CANNC_ISA)."""
    if isa not in ("avx2", "avx512-nobf16"):
        return features
    drop = ("+amx-", "+avx512bf16", "+avx512fp16", "+avx10")
    out = []
    for f in features.split(","):
        if f.startswith(drop) or (isa == "avx2" and (
                f.startswith("+avx512") or f == "+evex512")):
            f = "-" + f[1:]
        out.append(f)
    return ",".join(out)


# ---------------------------------------------------------------------------
# Intel AMX: Linux lets a process execute tile instructions only after it asks
# for the XTILEDATA state component (arch_prctl); until then the first tile
# instruction raises SIGILL. Asked once per process (the grant is process-wide).
# ---------------------------------------------------------------------------

ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64
_amx_lock = threading.Lock()
_amx_reason: list[str | None] = []  # [the answer] once asked


def amx_permission() -> str | None:
    """None when this process may execute AMX tile instructions, else why not (the
    host has no AMX, not Linux x86-64, the kernel refused). The first call asks the
    kernel for the permission (thread-safe, cached); it never raises."""
    with _amx_lock:
        if not _amx_reason:
            _amx_reason.append(_request_amx())
        return _amx_reason[0]


def _request_amx() -> str | None:
    import platform
    import sys

    tgt = host()
    for f in ("amx-tile", "amx-bf16"):
        if not tgt.has(f):
            return f"the host target has no {f}" + (f" (CANNC_ISA={config.ISA})"
                                                    if config.ISA else "")
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"AMX permission is requested only on Linux x86-64 ({sys.platform}, " \
               f"{platform.machine()})"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
        syscall.restype = ctypes.c_long
        syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_ulong]
        if syscall(_SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
            err = ctypes.get_errno()
            return (f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: "
                    f"{os.strerror(err)} (errno {err})")
        mask = ctypes.c_ulong(0)
        syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
        if syscall(_SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.addressof(mask)) != 0:
            err = ctypes.get_errno()
            return f"arch_prctl(ARCH_GET_XCOMP_PERM) failed: {os.strerror(err)} (errno {err})"
        if not mask.value >> XFEATURE_XTILEDATA & 1:
            return f"the kernel did not grant XTILEDATA (permitted xfeatures {mask.value:#x})"
    except (OSError, AttributeError) as e:
        return f"cannot call arch_prctl: {e}"
    return None


def new_module(name: str) -> ir.Module:
    m = ir.Module(name=name)
    m.triple = host().triple
    return m


_emitted = 0
_emitted_lock = threading.Lock()


def emitted_modules() -> int:
    """How many modules this process has compiled to objects."""
    return _emitted


def _count_emitted() -> None:
    global _emitted
    with _emitted_lock:
        _emitted += 1


def optimise_and_emit(module_ir: str, name: str, speed_level: int = 2) -> bytes:
    """Parse, verify, optimise, verify and emit an object file for host."""
    _count_emitted()
    mod, tm = _optimise(module_ir, name, speed_level)
    return tm.emit_object(mod)


# x86 intrinsic families and the target feature each needs: LLVM aborts the process
# ("Cannot select") on an intrinsic the target cannot run, so it is checked first
_ISA_INTRINSICS = (
    ("llvm.x86.avx512bf16.", "avx512bf16"),
    ("llvm.x86.avx512fp16.", "avx512fp16"),
    ("llvm.x86.avx512.", "avx512f"),
    ("llvm.x86.tdpbf16ps", "amx-bf16"),
    ("llvm.x86.tile", "amx-tile"),
    ("llvm.x86.ldtilecfg", "amx-tile"),
)
_X86_CALL = re.compile(r"@(llvm\.x86\.[A-Za-z0-9_.]+)")


def isa_missing(module_ir: str, tgt: HostTarget) -> tuple[str, str] | None:
    """(intrinsic, feature) of the first x86 intrinsic in ``module_ir`` that needs a CPU
    feature ``tgt`` lacks, else None."""
    if "llvm.x86." not in module_ir:
        return None
    for name in sorted(set(_X86_CALL.findall(module_ir))):
        for prefix, feature in _ISA_INTRINSICS:
            if name.startswith(prefix):
                if not tgt.has(feature):
                    return name, feature
                break
    return None


def _optimise(module_ir: str, name: str,
              speed_level: int) -> tuple[llvm.ModuleRef, llvm.TargetMachine]:
    """The optimisation half of optimise_and_emit: the optimised module and the
    TargetMachine that emits it."""
    tgt = host()
    missing = isa_missing(module_ir, tgt)
    if missing:
        raise CompileError(f"kernel {name} calls {missing[0]}, which needs the CPU feature "
                           f"{missing[1]}: this target has none" +
                           (f" (CANNC_ISA={config.ISA})" if config.ISA else ""))
    tm = tgt.machine()
    try:
        mod = optimise(module_ir, tm, tgt.triple, speed_level)
    except RuntimeError as e:
        if config.DUMP_DIR:
            _dump(name, module_ir)
        raise CompileError(f"invalid LLVM IR for kernel {name}: {e}") from e
    if config.DUMP_DIR:
        _dump(name, str(mod))
        _dump(name + ".s", tgt.machine().emit_assembly(mod), ext="")
    return mod, tm


def _dump(name: str, text: str, ext: str = ".ll") -> None:
    d = Path(config.DUMP_DIR)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}{ext}").write_text(text)


# ---------------------------------------------------------------------------
# library modules: code that many kernels call (codegen registers the builders)
#
# A kernel module may declare (not define) a function whose name begins with
# LIB_PREFIX: a library symbol. The module that defines it is made by the builder
# registered for its prefix from the name alone, so its IR is the same for every
# kernel that calls it: it is compiled once per program (and cached like any
# module), and loaded into the same engine as the kernels that call it. GEMM's
# remainder-row micro-kernels live there (codegen/gemm.py): inline, they were 80%
# of every dynamic GEMM module's LLVM time.
# ---------------------------------------------------------------------------

LIB_PREFIX = "cannc_lib_"
_libraries: dict[str, Callable[[str], ir.Module]] = {}
_LIB_DECL = re.compile(r'^declare [^@\n]*@"?(' + LIB_PREFIX + r'[A-Za-z0-9_]+)', re.M)


def register_library(prefix: str, build: Callable[[str], ir.Module]) -> None:
    """``build(symbol)`` makes the module that defines each library symbol beginning
    with ``prefix`` (itself beginning with LIB_PREFIX)."""
    assert prefix.startswith(LIB_PREFIX), prefix
    _libraries[prefix] = build


def library_needs(module_ir: str) -> list[str]:
    """The library symbols ``module_ir`` declares, sorted."""
    if LIB_PREFIX not in module_ir:
        return []
    return sorted(set(_LIB_DECL.findall(module_ir)))


_library_ir: dict[str, str] = {}
_library_lock = threading.Lock()


def library_ir(symbol: str) -> str:
    """The IR of the module that defines the library symbol ``symbol`` (built once per
    process and target)."""
    key = f"{host().fingerprint}|{symbol}"
    with _library_lock:
        text = _library_ir.get(key)
    if text is None:
        build = next((f for p, f in _libraries.items() if symbol.startswith(p)), None)
        if build is None:
            raise CompileError(f"no library defines {symbol}")
        text = str(build(symbol))
        with _library_lock:
            _library_ir[key] = text
    return text


_jit_library_objects: dict[str, bytes] = {}


def _library_objects(module_ir: str, speed_level: int) -> list[bytes]:
    """The objects of the library modules ``module_ir`` needs (jit_library: compiled
    once per process)."""
    out = []
    for sym in library_needs(module_ir):
        key = f"{host().fingerprint}|{sym}|{speed_level}"
        with _library_lock:
            obj = _jit_library_objects.get(key)
        if obj is None:
            obj = optimise_and_emit(library_ir(sym), sym, speed_level)
            with _library_lock:
                _jit_library_objects[key] = obj
        out.append(obj)
    return out


# ---------------------------------------------------------------------------
# object cache: content-addressed, checksummed, safe against damaged entries
# ---------------------------------------------------------------------------

_MAGIC = b"CNCOBJ1\n"


def read_checksummed(path: Path, magic: bytes) -> bytes | None:
    """The payload of a cache file written by `write_checksummed`; None when it is
    missing, and b"" marks a damaged one (wrong magic, truncated, checksum)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    n = len(magic)
    if len(data) < n + 32 or not data.startswith(magic):
        return b""
    digest, payload = data[n:n + 32], data[n + 32:]
    return payload if hashlib.sha256(payload).digest() == digest else b""


def write_checksummed(path: Path, magic: bytes, payload: bytes) -> None:
    """magic + sha256 + payload, written atomically (temp file + rename); a read-only
    or full cache only costs speed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(magic + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except OSError:
        pass


class ObjectCache:
    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root else None
        self.memory: dict[str, bytes] = {}
        self.hits = 0
        self.misses = 0
        self.rebuilt_damaged = 0
        self._damaged_keys: set[str] = set()

    def key(self, module_ir: str, speed_level: int) -> str:
        h = hashlib.sha256()
        h.update(host().fingerprint.encode())
        h.update(str(speed_level).encode())
        h.update(module_ir.encode())
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        assert self.root is not None
        return self.root / key[:2] / f"{key}.o"

    def get(self, key: str) -> bytes | None:
        if key in self.memory:
            return self.memory[key]
        if self.root is None:
            return None
        payload = read_checksummed(self._path(key), _MAGIC)
        if payload is None:
            return None
        if not payload:   # damaged: compiled again and overwritten
            self._damaged(key)
            return None
        self.memory[key] = payload
        return payload

    def _damaged(self, key: str) -> None:
        """Count a damaged entry once (it may be looked up again before it is rebuilt)."""
        if key not in self._damaged_keys:
            self._damaged_keys.add(key)
            self.rebuilt_damaged += 1

    def put(self, key: str, obj: bytes) -> None:
        self.memory[key] = obj
        if self.root is None:
            return
        write_checksummed(self._path(key), _MAGIC, obj)

    def compile(self, module_ir: str, name: str, speed_level: int = 2) -> bytes:
        key = self.key(module_ir, speed_level)
        obj = self.get(key)
        if obj is not None:
            self.hits += 1
            return obj
        self.misses += 1
        obj = optimise_and_emit(module_ir, name, speed_level)
        self.put(key, obj)
        return obj

    def compile_many(self, modules: Sequence[tuple[str, str]], speed_level: int = 2,
                     done: Callable[[], None] | None = None) -> dict[str, bytes]:
        """{name: object} of (name, module IR) pairs, the largest compiled first (see
        ObjectBatch); done() is called as each is ready."""
        batch = self.batch(speed_level)
        for name, module_ir in sorted(modules, key=lambda m: -len(m[1])):
            batch.submit(name, module_ir)
        out = batch.finish(done)
        return {name: out[name] for name, _ in modules}

    def compile_built(self, name: str, build: Callable[[], ir.Module],
                      speed_level: int = 2) -> bytes:
        """The object of a module that `build` makes from nothing but cannc's code and
        the host (the dispatcher, the AI-core pool): looked up by name, sources and host
        first, so a process that finds it builds no IR (a few ms per module)."""
        key = hashlib.sha256(f"built|{name}|{source_digest()}|{host().fingerprint}|"
                             f"{speed_level}".encode()).hexdigest()
        obj = self.get(key)
        if obj is not None:
            self.hits += 1
            return obj
        obj = self.compile(str(build()), name, speed_level)
        self.put(key, obj)
        return obj

    def batch(self, speed_level: int = 2) -> ObjectBatch:
        return ObjectBatch(self, speed_level)


class ObjectBatch:
    """Objects of modules submitted one by one (a specialisation's lowering submits each
    module as it is made): cached ones are read at once, the others are compiled on
    every core while the submitter goes on (cannc.native.llvm_procs: LLVM in worker
    processes, since llvmlite lets one thread at a time into LLVM). `finish` compiles
    the rest, waits, and returns {name: object}; `abandon` stops it."""

    def __init__(self, cache: ObjectCache, speed_level: int) -> None:
        self.cache, self.level = cache, speed_level
        self.out: dict[str, bytes] = {}
        self._keys: dict[str, str] = {}
        self._lock = threading.Lock()
        self._ready = 0
        self._tick: Callable[[], None] | None = None
        tgt = host()
        self.llvm = llvm_procs.Batch(
            (tgt.triple, tgt.cpu, tgt.features, 3, CODE_MODEL[1], CODE_MODEL[0]),
            self._here, self._finished)

    def submit(self, name: str, module_ir: str) -> None:
        if name in self._keys:
            return
        key = self._keys[name] = self.cache.key(module_ir, self.level)
        obj = self.cache.get(key)
        if obj is not None:
            self.cache.hits += 1
            self._done(name, obj)
            return
        if isa_missing(module_ir, host()):     # before any worker sees it (LLVM aborts)
            _optimise(module_ir, name, self.level)         # raises its CompileError
        self.llvm.submit((name, module_ir, self.level))

    def _here(self, job: tuple[str, str, int]) -> bytes:
        name, module_ir, level = job
        mod, tm = _optimise(module_ir, name, level)
        return tm.emit_object(mod)

    def _finished(self, i: int, obj: bytes) -> None:
        name = self.llvm.jobs[i][0]
        _count_emitted()
        with self._lock:
            self.cache.misses += 1
        self.cache.put(self._keys[name], obj)
        self._done(name, obj)

    def _done(self, name: str, obj: bytes) -> None:
        with self._lock:
            self.out[name] = obj
            self._ready += 1
            tick = self._tick
        if tick is not None:
            tick()

    def finish(self, done: Callable[[], None] | None = None) -> dict[str, bytes]:
        """Every object; done() once for each ready so far and each still to come."""
        if done is not None:
            with self._lock:
                self._tick, ready = done, self._ready
            for _ in range(ready):
                done()
        self.llvm.finish()
        return dict(self.out)

    def abandon(self) -> None:
        self.llvm.abandon()


_source_digest: str | None = None


def source_digest() -> str:
    """A digest of cannc's own sources (every .py under the package, by path and
    content): a changed emitter, planner or builder never reuses old cache entries."""
    global _source_digest
    if _source_digest is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            files += [os.path.join(d, n) for n in names if n.endswith(".py")]
        h = xxhash.xxh3_128()
        for f in sorted(files):
            h.update(f[len(root) + 1:].encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(fh.read())
        _source_digest = h.hexdigest()[:16]
    return _source_digest


_default_cache: ObjectCache | None = None


def default_cache() -> ObjectCache:
    global _default_cache
    if _default_cache is None:
        _default_cache = ObjectCache(config.cache_dir())
    return _default_cache


_process = None


def _resolvable(name: str) -> bool:
    """Whether MCJIT can bind `name`: a symbol given to LLVM or one in the process."""
    global _process
    if llvm.address_of_symbol(name):
        return True
    if _process is None:
        import ctypes
        _process = ctypes.CDLL(None)
    try:
        getattr(_process, name)
        return True
    except AttributeError:
        return False


class MalformedObject(CompileError):
    """An object file that is not a well-formed ELF64 object (damaged, or not ours)."""


def elf_symbols(obj: bytes) -> tuple[set[str], set[str]]:
    """(defined, undefined) global symbol names of an ELF64 little-endian object file;
    MalformedObject (a CompileError) when it is not one: a damaged object never reaches
    MCJIT, which would crash on it."""
    import struct

    if len(obj) < 64 or obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        raise MalformedObject(f"not an ELF64 little-endian object ({len(obj)} bytes)")
    try:
        return _elf_symbols(obj, struct)
    except (struct.error, IndexError, ValueError, OverflowError, UnicodeDecodeError) as e:
        raise MalformedObject(f"malformed ELF object ({len(obj)} bytes): "
                              f"{type(e).__name__}: {e}") from e


def _elf_symbols(obj: bytes, struct) -> tuple[set[str], set[str]]:
    if struct.unpack_from("<H", obj, 0x10)[0] != 1:      # ET_REL: a relocatable object
        raise ValueError("not a relocatable object")
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    if shentsize < 64 or shoff + shentsize * shnum > len(obj):
        raise ValueError(f"section headers ({shnum} x {shentsize} at {shoff}) out of range")
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize)
                for i in range(shnum)]
    defined, undefined = set(), set()
    for sh in sections:
        if sh[1] != 2:          # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        str_off = strtab[4]
        if sh[4] + sh[5] > len(obj) or str_off + strtab[5] > len(obj):
            raise ValueError("symbol or string table out of range")
        for off in range(sh[4], sh[4] + sh[5], max(sh[9], 24)):
            name_i, info, _, shndx, _, _ = struct.unpack_from("<IBBHQQ", obj, off)
            if info >> 4 == 0 or name_i == 0:   # local or unnamed
                continue
            end = obj.index(b"\0", str_off + name_i)
            name = obj[str_off + name_i:end].decode()
            (undefined if shndx == 0 else defined).add(name)
    return defined, undefined


class JitLibrary:
    """A set of object files loaded into one MCJIT engine."""

    def __init__(self, objects: list[bytes]) -> None:
        init()
        defined: set[str] = set()
        needed: set[str] = set()
        for obj in objects:
            d, u = elf_symbols(obj)
            defined |= d
            needed |= u
        # MCJIT aborts the process on a symbol it cannot resolve (e.g. a compiler-rt
        # helper LLVM chose for a conversion): refuse before loading instead
        missing = sorted(s for s in needed - defined if not _resolvable(s))
        if missing:
            raise CompileError(f"compiled code needs symbols this process does not provide: "
                               f"{', '.join(missing)}")
        if host().has("amx-tile"):
            amx_permission()   # code compiled for this host may use tiles (cached)
        self._engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), host().machine())
        for obj in objects:
            self._engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        self._engine.finalize_object()
        self._engine.run_static_constructors()

    def address(self, name: str) -> int:
        addr = self._engine.get_function_address(name)
        if not addr:
            raise CompileError(f"symbol {name} missing from compiled objects")
        return addr


# ---------------------------------------------------------------------------
# JIT of one module outside a compiled model (tests, benchmarks): the same
# optimise_and_emit + JitLibrary pipeline as the compiler, without the cache
# ---------------------------------------------------------------------------

# void kernel(ptr args, i64 tile_begin, i64 tile_end, ptr workspace) -- see ABI.md
KernelFunction = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p
)


def jit_library(module: ir.Module | str, name: str = "jit", speed_level: int = 2,
                keep_ir: bool = False) -> JitLibrary:
    """Optimise and emit ``module`` as the compiler does and load it into a
    JitLibrary of its own (look symbols up with ``lib.address(symbol)``). With
    ``keep_ir`` the optimised module text is kept as ``lib.optimised_ir``."""
    text = module if isinstance(module, str) else str(module)
    mod, tm = _optimise(text, name, speed_level)
    lib = JitLibrary([tm.emit_object(mod)] + _library_objects(text, speed_level))
    if keep_ir:
        lib.optimised_ir = str(mod)
    return lib


def jit_kernel(module: ir.Module | str, name: str, speed_level: int = 2):
    """Compile ``module`` and return its ABI kernel ``name`` as a ctypes function
    ``f(args, tile_begin, tile_end, workspace)``. The function holds its library
    (``f.library``), so the code lives as long as the function."""
    lib = jit_library(module, name, speed_level)
    fn = KernelFunction(lib.address(name))
    fn.library = lib
    return fn
