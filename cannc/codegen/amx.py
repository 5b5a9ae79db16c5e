"""bf16 GEMM kernels on Intel AMX tiles (``tdpbf16ps``), for CPUs that have them.

The emitted kernels follow the kernel ABI (``cannc/codegen/ABI.md``)::

    void @name(ptr %args, i64 %tile_begin, i64 %tile_end, ptr %workspace)

with ``args = [A, B_packed, (bias,) C]`` as `emit_gemm`'s, and compute, for every
batch item, ``C[M,N] = alpha * A[M,K] @ B[K,N] + beta * bias`` with bf16 products
and fp32 accumulation:

* B is a constant, prepacked at compile time (`amx_prepack_b`) into the VNNI
  layout ``tdpbf16ps`` reads, in 32-column panels whose two tiles of a K step are
  adjacent: ``[batch_b][ceil(N/32)][Kp/32][2][16][16][2]`` bf16 (Kp = K rounded up
  to 32, zero padded); each 16 (K pairs) x 16 (columns) tile is 1 KiB contiguous.
* A fp32 is converted to bf16 while it is packed into the workspace, one row
  block at a time, as ``[32-row panel][Kp/32][2][16][32]`` (1 KiB tiles, K zero
  padded; the 2 KiB a K step reads are contiguous, and A and B tiles do not
  alias in L1 as 32 KiB-apart panels would). A bf16 A is packed (copied) the
  same way by default: measured faster than tiles read in place with its row
  stride, which a ``tuning={"pack_a": False}`` kernel does when K is a
  multiple of 32.
* The micro-kernel is a 2 x 2 grid of 16 x 16 fp32 C tiles (4 tile registers)
  fed by 2 A and 2 B tiles per K step of 32: all 8 tile registers. It runs over
  the whole K with C in tiles, for every 32-row pair of the row block in turn,
  and stores the tiles to an MB x 32 fp32 scratch in the workspace; then
  vector code applies alpha, bias and the epilogue (fp32 registers) and stores
  C as fp32 or bf16, masked at the right edge.
* Edges: K is zero padded (A and B); the last rows (M mod 32) use tiles of that
  many rows (the ``rows`` shape operand); the last columns (N mod 32 <= 16) use
  one column tile, wider ones the zero padded B panel and masked stores. No
  scalar loops.
* Each micro-kernel variant (full, last rows, last columns, corner) is its own
  internal ``noinline`` function, so LLVM's tile configuration (one shape per
  tile register and function, ``ldtilecfg`` on entry) holds at most two shapes
  of each kind. The kernel ends with ``tilerelease``.

Tiles: ``tile = (batch item, column block, row block)``, row block fastest, as
`gemm.py`'s; the grid is chosen so that two cores get balanced work. Within a
tile the column pairs run outer, the row pairs inner: the packed A block
(<= ``A_BLOCK`` bytes) stays in L2, a 32-column strip of B in L1/L2.

Shape-polymorphic kernels (``GemmSpec.dyn``, `gemm.dynamic_spec`, ABI.md "Runtime
dimensions"): one kernel per N, K and layout serves every M and batch count. M,
the batch count and the tile grid are runtime dims (``AMX_DIMS``) that the host
tiling function `amx_dims` computes per call; the last rows' tile shapes come from
M at run time (LLVM writes them into the tile configuration); the workspace is
sized for the largest row block.

Numerics: products of bf16 (A and B rounded to nearest even), fp32 accumulation;
``tdpbf16ps`` treats denormal inputs as zero and flushes denormal results, and the
fp32 -> bf16 conversion of A (``vcvtne2ps2bf16``) flushes denormals as well.

Linux requires a per-process permission before the first tile instruction:
`amx_usable` asks for it (``cannc.native.target.amx_permission``), and so does
the JIT loader on an AMX host.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from llvmlite import ir

from .. import config
from ..native import target
from ..native.emit import BF16, F32, I32, I64, PTR, VOID, X86_AMX, i32, i64, masked_load
from ..schedule.split import cdiv, rup, split_even
from .elementwise import bf16_bits_to_f32, f32_to_bf16_bits
from .gemm import Epilogue, GemmSpec
from .vec import VF, VI32, VM, VecBuilder, abi_function

__all__ = [
    "AMX_DIMS",
    "AmxPlan",
    "amx_dims",
    "amx_plan",
    "amx_num_tiles",
    "amx_prepack_b",
    "amx_prepacked_b_size",
    "amx_supports",
    "amx_usable",
    "amx_workspace_bytes",
    "emit_amx_gemm",
]

TR = 16  # rows of a tile
TC = 16  # fp32 columns of a C tile (and B columns of a B tile)
TK = 32  # bf16 elements of K per A tile row
TILE = 1024  # bytes of a full tile
A_BLOCK = 1 << 20  # bytes of packed (or read-in-place) A a row block keeps in L2 (half of 2 MiB)
MB_MAX = 256  # rows of a row block (its C scratch: MB x 32 fp32)
I16 = ir.IntType(16)
CS_STRIDE = 2 * TC * 4  # bytes per row of the 32 x 32 fp32 C scratch


def amx_usable() -> str | None:
    """None when AMX bf16 kernels can run in this process, else why not: the host
    target (its features, ``CANNC_ISA``) has no amx-tile/amx-bf16, or the OS did
    not grant the tile state (asked once per process)."""
    tgt = target.host()
    for f in ("amx-tile", "amx-bf16", "avx512f"):
        if not tgt.has(f):
            return f"the host target has no {f}" + (
                f" (CANNC_ISA={config.ISA})" if config.ISA else "")
    return target.amx_permission()


def _dt(dtype) -> str:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name in ("float32", "bfloat16"):
        return name
    raise ValueError(f"AMX GEMM: unsupported dtype {name} (float32 or bfloat16)")


def amx_supports(spec: GemmSpec) -> str | None:
    """Why ``spec`` cannot run as an AMX kernel (None: it can). A dynamic spec
    (`gemm.dynamic_spec`) is a kernel for any M and batch count (`amx_dims`)."""
    if spec.trans_a:
        return "A stored transposed"
    if not spec.b_prepacked:
        return "B not a constant prepacked at compile time"
    if spec.bias and spec.bias_col_stride not in (0, 1):
        return f"a bias column stride of {spec.bias_col_stride}"
    return None


# ---------------------------------------------------------------------------
# planning (compile-time Python)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AmxPlan:
    Kp: int  # K rounded up to 32
    kb: int  # K steps of 32
    pack_a: bool  # A packed (and converted) into the workspace per row block
    max_mb: int  # the largest row block (the workspace holds its packed A and C scratch)
    mt: int  # row blocks per batch item (0 in a dynamic plan: amx_dims chooses)
    nt: int  # column blocks per batch item
    MB: int  # rows per row block (a multiple of 32)
    NB: int  # columns per column block (a multiple of 32)
    ws_a: int  # byte offset of the packed A block
    ws_c: int  # byte offset of the MB x 32 fp32 C scratch
    ws_bytes: int

    def num_tiles(self, batch: int) -> int:
        assert self.mt, "the grid of a dynamic AMX GEMM is chosen per call (amx_dims)"
        return batch * self.mt * self.nt


# the runtime dims of a dynamic kernel, in this order, from its ``dims_slot``
AMX_DIMS = ("M", "batch", "mt", "nt", "MB", "NB")
MAX_TILES = 64


def _tile_cost(rows: int, cols: int, Kp: int, pack_a: bool) -> float:
    """Crude time of one tile (ns): AMX products at ~1 TFLOP/s (whole tiles), A
    packed at ~4 elements/ns, B streamed at ~20 B/ns, a fixed overhead."""
    c = 2.0 * rup(rows, TR) * rup(cols, TC) * Kp / 1000.0
    if pack_a:
        c += rows * Kp / 4.0
    return c + cols * Kp / 10.0 + 300.0


def _max_mb(Kp: int, a_block: int) -> int:
    return min(MB_MAX, max(2 * TR, (a_block // (2 * Kp)) // 32 * 32))


def _grid(M: int, N: int, batch: int, Kp: int, pack_a: bool, max_mb: int,
          cores: int = 2) -> tuple[int, int, int, int]:
    """(mt, nt, MB, NB): the tile grid whose slowest core (tiles split evenly, as
    `split_even`) is modelled fastest, at most MAX_TILES tiles (unless the batch
    alone has more), row blocks of at most max_mb rows."""
    best = None
    mt0 = cdiv(M, min(max_mb, rup(M, 32)))
    for mt in range(mt0, min(mt0 + 8, cdiv(M, 32)) + 1):
        MB = rup(cdiv(M, mt), 32)
        mt_ = cdiv(M, MB)
        for nt in range(1, min(cdiv(N, 32), 16) + 1):
            NB = rup(cdiv(N, nt), 32)
            nt_ = cdiv(N, NB)
            T = batch * mt_ * nt_
            if T > MAX_TILES and best is not None:
                break
            # tile order: row block fastest, then column block, then batch item
            item = [_tile_cost(min(MB, M - i * MB), min(NB, N - j * NB), Kp, pack_a)
                    for j in range(nt_) for i in range(mt_)]
            if T <= 4 * MAX_TILES:
                costs = item * batch
                worst = max(sum(costs[t0:t1]) for t0, t1 in split_even(T, cores))
            else:
                worst = sum(item) * cdiv(batch, cores)
            key = (worst, T)
            if best is None or key < best[0]:
                best = (key, mt_, nt_, MB, NB)
    _, mt, nt, MB, NB = best
    return mt, nt, MB, NB


@lru_cache(maxsize=128)
def _plan(spec: GemmSpec, a_dtype: str, tuning: tuple = ()) -> AmxPlan:
    why = amx_supports(spec)
    if why:
        raise ValueError(f"AMX GEMM: unsupported: {why}")
    tun = dict(tuning)
    Kp = rup(spec.K, TK)
    # a bf16 A is packed too (a copy): tiles of rows a stride of K apart (2 KiB at
    # K = 1024) share few L1 sets; measured 1024^3 one core, best of 150: 448 read in
    # place, 679 packed (730 with fp32 A); 128x3072x768: 497 / 726 (loaded machine)
    pack_a = tun.get("pack_a", True) or a_dtype == "float32" or spec.K % TK != 0
    max_mb = _max_mb(Kp, tun.get("a_block", A_BLOCK))
    mt = nt = MB = NB = 0
    if not spec.dyn:
        if "grid" in tun:   # (row blocks, column blocks)
            MB = rup(cdiv(spec.M, tun["grid"][0]), 2 * TR)
            NB = rup(cdiv(spec.N, tun["grid"][1]), 2 * TC)
            mt, nt = cdiv(spec.M, MB), cdiv(spec.N, NB)
        else:
            mt, nt, MB, NB = _grid(spec.M, spec.N, spec.batch, Kp, pack_a, max_mb)
        max_mb = MB
    ws_a = 0
    a_bytes = max_mb * Kp * 2 if pack_a else 0
    ws_c = rup(a_bytes, 64)
    # + two 32-row C slots: the overlapped stores (see _Gen.pairs_overlapped)
    return AmxPlan(Kp=Kp, kb=Kp // TK, pack_a=pack_a, max_mb=max_mb, mt=mt, nt=nt, MB=MB,
                   NB=NB, ws_a=ws_a, ws_c=ws_c,
                   ws_bytes=ws_c + max_mb * CS_STRIDE + 2 * 2 * TR * CS_STRIDE)


def amx_plan(spec: GemmSpec, a_dtype="float32", tuning: dict | None = None) -> AmxPlan:
    """The blocking of ``spec``'s AMX kernel; ``tuning`` overrides ``pack_a`` (False:
    a bf16 A whose K is a multiple of 32 is read in place), ``a_block`` (bytes of
    A a row block holds) and, for a static spec, ``grid`` ((row blocks, column
    blocks) per batch item)."""
    tun = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                       for k, v in (tuning or {}).items()))
    return _plan(spec, _dt(a_dtype), tun)


def amx_num_tiles(spec: GemmSpec, a_dtype="float32", tuning: dict | None = None) -> int:
    return amx_plan(spec, a_dtype, tuning).num_tiles(spec.batch)


def amx_workspace_bytes(spec: GemmSpec, a_dtype="float32", tuning: dict | None = None
                        ) -> int:
    return amx_plan(spec, a_dtype, tuning).ws_bytes


def amx_dims(spec: GemmSpec, M: int, batch: int = 1, a_dtype="float32",
             tuning: dict | None = None) -> tuple[tuple[int, ...], int]:
    """The runtime dims (``AMX_DIMS``) and the number of tiles of the dynamic kernel
    ``spec`` (canonical, from `gemm.dynamic_spec`, B prepacked) for M rows and
    ``batch`` items: the host tiling function."""
    assert spec.dyn, "amx_dims is for dynamic specs"
    if M < 1 or batch < 1:
        raise ValueError(f"amx_dims: M and batch must be >= 1 (got {M}, {batch})")
    if spec.batch == 1 and batch != 1:
        raise ValueError("this dynamic GEMM is not batched")
    p = amx_plan(spec, a_dtype, tuning)
    mt, nt, MB, NB = _grid(M, spec.N, batch, p.Kp, p.pack_a, p.max_mb)
    return (M, batch, mt, nt, MB, NB), batch * mt * nt


# ---------------------------------------------------------------------------
# B prepacking (compile time)
# ---------------------------------------------------------------------------


def _b_batches(spec: GemmSpec) -> int:
    return spec.batch if spec.b_batch_stride else 1


def _b_batch_bytes(spec: GemmSpec) -> int:
    return cdiv(spec.N, 2 * TC) * (rup(spec.K, TK) // TK) * 2 * TILE


def amx_prepacked_b_size(spec: GemmSpec) -> int:
    """Number of bf16 elements of ``amx_prepack_b(spec, B)``."""
    return _b_batches(spec) * _b_batch_bytes(spec) // 2


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even, NaN kept a NaN."""
    if x.dtype.name == "bfloat16":
        return x.view(np.uint16)
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def amx_prepack_b(spec: GemmSpec, b: np.ndarray) -> np.ndarray:
    """A constant B (fp32 or bf16; ``[K,N]``, ``[N,K]`` when ``trans_b``, or with a
    leading batch axis when ``b_batch_stride``) in the VNNI tile layout the kernel
    reads: ``[batch_b][ceil(N/32)][Kp/32][2][16][16][2]``, zero padded; a flat
    bfloat16 array (uint16 bits without ml_dtypes) of `amx_prepacked_b_size`."""
    K, N = spec.K, spec.N
    nb = _b_batches(spec)
    b = np.asarray(b)
    if b.dtype.name != "bfloat16":
        b = b.astype(np.float32)
    rows, cols = (N, K) if spec.trans_b else (K, N)
    mats = b[None] if b.ndim == 2 else b
    if mats.ndim == 3 and mats.shape[0] == 1 and nb > 1:
        mats = np.broadcast_to(mats, (nb, rows, cols))
    if mats.shape != (nb, rows, cols):
        raise ValueError(f"amx_prepack_b: B shape {b.shape} does not match the spec "
                         f"(expected {(nb, rows, cols)} or {(rows, cols)})")
    if spec.trans_b:
        mats = mats.transpose(0, 2, 1)
    bits = _to_bf16_bits(np.ascontiguousarray(mats))
    Kp, nP = rup(K, TK), cdiv(N, 2 * TC)
    out = np.zeros((nb, Kp, nP * 2 * TC), np.uint16)
    out[:, :K, :N] = bits
    # (b, kk, pair, e, panel, tile, col) -> (b, panel, kk, tile, pair, col, e)
    out = out.reshape(nb, Kp // TK, TK // 2, 2, nP, 2, TC).transpose(0, 4, 1, 5, 2, 6, 3)
    out = np.ascontiguousarray(out).reshape(-1)
    try:
        import ml_dtypes
        return out.view(ml_dtypes.bfloat16)
    except ImportError:  # pragma: no cover
        return out


# ---------------------------------------------------------------------------
# code generation
# ---------------------------------------------------------------------------


# full row pairs store while the next pair's products run (_Gen.pairs_overlapped); False:
# each block's stores after all its products (the A/B reference of the measurements)
OVERLAP_STORES = True


def _i16(v: int) -> ir.Constant:
    return ir.Constant(I16, v)


class _Gen(VecBuilder):
    def __init__(self, module, fn, spec: GemmSpec, plan: AmxPlan, epilogue, a_dtype,
                 c_dtype, bias_dtype, dims_slot=None):
        super().__init__(module, fn)
        self.dims_slot = dims_slot
        self.s, self.p = spec, plan
        self.epilogue = epilogue
        self.a_bf16 = a_dtype == "bfloat16"
        self.c_bf16 = c_dtype == "bfloat16"
        self.bias_bf16 = bias_dtype == "bfloat16"
        # vcvtneps2bf16 (llvmlite has no bfloat type of its own: native.emit.BF16)
        self.cvt_native = target.host().has("avx512bf16")
        self.iota = ir.Constant(VI32, list(range(16)))
        self._micro: dict[tuple, ir.Function] = {}
        # A tile (i, kk) at a + i * a_rt + kk * a_ks, rows a_stride bytes apart
        if plan.pack_a:
            self.a_rt, self.a_ks, self.a_stride = TILE, 2 * TILE, TK * 2
        else:
            lda = spec.lda_ * 2
            self.a_rt, self.a_ks, self.a_stride = TR * lda, TK * 2, lda
        # bytes between row pairs (32 rows) of A
        self.a_pair = plan.kb * 2 * TILE if plan.pack_a else 2 * self.a_rt

    # -- tile intrinsics -------------------------------------------------------
    # (shapes: i16 values; a tile's rows and bytes per row)
    def t_load(self, b, rows, colbytes, ptr, stride):
        f = self.intr("llvm.x86.tileloadd64.internal", X86_AMX, [I16, I16, PTR, I64])
        return b.call(f, [rows, colbytes, ptr, i64(stride)])

    def t_zero(self, b, rows, colbytes):
        f = self.intr("llvm.x86.tilezero.internal", X86_AMX, [I16, I16])
        return b.call(f, [rows, colbytes])

    def t_dp(self, b, m, n, k, c, a, bt):
        """c += a @ bt: m rows, n bytes per row of c, k bytes per row of a."""
        f = self.intr("llvm.x86.tdpbf16ps.internal", X86_AMX, [I16] * 3 + [X86_AMX] * 3)
        return b.call(f, [m, n, k, c, a, bt])

    def t_store(self, b, rows, colbytes, ptr, stride, t):
        f = self.intr("llvm.x86.tilestored64.internal", VOID, [I16, I16, PTR, I64, X86_AMX])
        b.call(f, [rows, colbytes, ptr, i64(stride), t])

    def micro(self, kind: int | str, tn: int) -> ir.Function:
        """``void mk(ptr a, ptr b, ptr cs, i64 npairs, i64 rows)``: ``npairs``
        consecutive C blocks of ``tn`` (1, 2) column tiles, each over the whole K (C in
        tiles), stored to the scratch ``cs`` (32 rows apart). ``kind``: the rows of a
        block, an int (<= 32); or 'lo' / 'hi': ``rows`` (1..16 / 17..31) at run time,
        the tile shapes from it."""
        key = (kind, tn)
        if key in self._micro:
            return self._micro[key]
        p = self.p
        f = ir.Function(self.m, ir.FunctionType(VOID, [PTR, PTR, PTR, I64, I64]),
                        name=self.m.get_unique_name(f"{self.fn.name}.mk{kind}x{16 * tn}"))
        f.linkage = "internal"
        f.attributes.add("nounwind")
        f.attributes.add("noinline")
        a0, bp, cs0, npairs, nrows = f.args
        pre = f.append_basic_block("entry")
        phdr = f.append_basic_block("p.h")
        entry = f.append_basic_block("p.b")
        hdr = f.append_basic_block("k.h")
        body = f.append_basic_block("k.b")
        ext = f.append_basic_block("k.x")
        pext = f.append_basic_block("p.x")
        b = ir.IRBuilder(pre)
        if kind == "lo":
            rws = [b.trunc(nrows, I16)]
        elif kind == "hi":
            rws = [_i16(TR), b.trunc(b.sub(nrows, i64(TR)), I16)]
        else:
            rws = [_i16(TR), _i16(kind - TR)] if kind > TR else [_i16(kind)]
        b.branch(phdr)
        b.position_at_end(phdr)
        pi = b.phi(I64, "pair")
        pi.add_incoming(i64(0), pre)
        b.cbranch(b.icmp_signed("<", pi, npairs), entry, pext)
        b.position_at_end(entry)
        a = b.gep(a0, [b.mul(pi, i64(self.a_pair))], source_etype=ir.IntType(8))
        cs = b.gep(cs0, [b.mul(pi, i64(2 * TR * CS_STRIDE))], source_etype=ir.IntType(8))
        c64 = _i16(64)
        acc0 = [[self.t_zero(b, r, c64) for _ in range(tn)] for r in rws]
        b.branch(hdr)
        b.position_at_end(hdr)
        kk = b.phi(I64, "kk")
        kk.add_incoming(i64(0), entry)
        accs = []
        for i in range(len(rws)):
            row = []
            for j in range(tn):
                ph = b.phi(X86_AMX)
                ph.add_incoming(acc0[i][j], entry)
                row.append(ph)
            accs.append(row)
        b.cbranch(b.icmp_signed("<", kk, i64(p.kb)), body, ext)
        b.position_at_end(body)
        at = []
        for i, r in enumerate(rws):
            off = b.add(b.mul(kk, i64(self.a_ks)), i64(i * self.a_rt))
            at.append(self.t_load(b, r, c64, b.gep(a, [off], source_etype=ir.IntType(8)),
                                  self.a_stride))
        bt = []
        for j in range(tn):
            off = b.add(b.mul(kk, i64(2 * TILE)), i64(j * TILE))
            bt.append(self.t_load(b, _i16(TR), c64,
                                  b.gep(bp, [off], source_etype=ir.IntType(8)), 64))
        new = [[self.t_dp(b, r, c64, c64, accs[i][j], at[i], bt[j]) for j in range(tn)]
               for i, r in enumerate(rws)]
        kk.add_incoming(b.add(kk, i64(1)), body)
        for i in range(len(rws)):
            for j in range(tn):
                accs[i][j].add_incoming(new[i][j], body)
        b.branch(hdr)
        b.position_at_end(ext)
        for i, r in enumerate(rws):
            for j in range(tn):
                ptr = b.gep(cs, [i64(i * TR * CS_STRIDE + j * 64)], source_etype=ir.IntType(8))
                self.t_store(b, r, c64, ptr, CS_STRIDE, accs[i][j])
        pi.add_incoming(b.add(pi, i64(1)), ext)
        b.branch(phdr)
        b.position_at_end(pext)
        b.ret_void()
        self._micro[key] = f
        return f

    # -- vector helpers -----------------------------------------------------------
    def bytes_gep(self, ptr, off):
        return self.b.gep(ptr, [off if not isinstance(off, int) else i64(off)],
                          source_etype=ir.IntType(8))

    def lane_mask(self, n: ir.Value) -> ir.Value:
        """Lanes 0 .. n-1 (n an i64, any value)."""
        b = self.b
        n32 = b.trunc(self.smax(self.smin(n, 16), 0), I32)
        return b.icmp_signed("<", self.iota, self.splat(n32, VI32))

    def mload_i16(self, ptr, mask, n: int = 16):
        vt = ir.VectorType(I16, n)
        return masked_load(self.b, ptr, mask, ir.Constant(vt, None), 2)

    def mstore_i16(self, val, ptr, mask, n: int = 16):
        vt = ir.VectorType(I16, n)
        mt = ir.VectorType(ir.IntType(1), n)
        f = self.intr(f"llvm.masked.store.v{n}i16.p0", VOID, [vt, PTR, I32, mt])
        self.b.call(f, [val, ptr, i32(2), mask])

    def store_bf16(self, val, ptr, mask):
        """<16 x float> rounded to bf16 (nearest even) and stored where ``mask`` is set,
        by a masked truncating store (vpmovdw): LLVM 22 lowers a
        ``masked.store.v16i16`` of a ``trunc`` whose constant mask has one lane to a
        4-byte store, clobbering the next element."""
        b = self.b
        if self.cvt_native:       # vcvtneps2bf16 (NaN quiet, like f32_to_bf16_bits)
            h = b.bitcast(b.fptrunc(val, ir.VectorType(BF16, 16)), ir.VectorType(I16, 16))
        else:
            h = f32_to_bf16_bits(b, val)
        bits = b.zext(h, VI32)
        f = self.intr("llvm.x86.avx512.mask.pmov.dw.mem.512", VOID, [PTR, VI32, I16])
        b.call(f, [ptr, bits, b.bitcast(mask, I16)])

    def to_bf16_32(self, lo, hi):
        """Two <16 x float> -> <32 x i16> bf16 bits (round to nearest even)."""
        b = self.b
        if self.cvt_native:
            v = b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 32), list(range(32))))
            return b.bitcast(b.fptrunc(v, ir.VectorType(BF16, 32)), ir.VectorType(I16, 32))
        lo16, hi16 = f32_to_bf16_bits(b, lo), f32_to_bf16_bits(b, hi)
        return b.shuffle_vector(lo16, hi16, ir.Constant(ir.VectorType(I32, 32), list(range(32))))

    # -- A packing ------------------------------------------------------------------
    def pack_a(self, a_base, m0, nrows, dst):
        """Rows [m0, m0 + nrows) of A into ``dst`` as [32-row panel][kb][2][16][32]
        bf16, K zero padded."""
        s, p, b = self.s, self.p, self.b
        K = s.K
        esz = 2 if self.a_bf16 else 4
        full, tail = K // TK, K % TK
        with self.loop(0, nrows, 1, "pa") as r:
            src = self.bytes_gep(a_base, b.mul(b.add(m0, r), i64(s.lda_ * esz)))
            drow = self.bytes_gep(dst, b.add(b.mul(b.udiv(r, i64(2 * TR)),
                                                   i64(p.kb * 2 * TILE)),
                                             b.mul(b.urem(r, i64(2 * TR)), i64(64))))
            if full:
                with self.loop(0, full, 1, "pk") as kk:
                    sp = self.bytes_gep(src, b.mul(kk, i64(TK * esz)))
                    dp = self.bytes_gep(drow, b.mul(kk, i64(2 * TILE)))
                    if self.a_bf16:
                        v = b.load(sp, typ=ir.VectorType(I16, 32), align=2)
                    else:
                        v = self.to_bf16_32(b.load(sp, typ=VF, align=4),
                                            b.load(self.bytes_gep(sp, 64), typ=VF, align=4))
                    b.store(v, dp, align=64)
            if tail:
                sp = self.bytes_gep(src, full * TK * esz)
                dp = self.bytes_gep(drow, full * 2 * TILE)
                if self.a_bf16:
                    m = ir.Constant(ir.VectorType(ir.IntType(1), 32),
                                    [1] * tail + [0] * (32 - tail))
                    v = self.mload_i16(sp, m, 32)
                else:
                    m0_ = ir.Constant(VM, [1] * min(tail, 16) + [0] * (16 - min(tail, 16)))
                    lo = self.load_v(sp, m0_)
                    if tail > 16:
                        m1_ = ir.Constant(VM, [1] * (tail - 16) + [0] * (32 - tail))
                        hi = self.load_v(self.bytes_gep(sp, 64), m1_)
                    else:
                        hi = self.zero_v
                    v = self.to_bf16_32(lo, hi)
                b.store(v, dp, align=64)

    # -- the output of one 32 x 32 block ----------------------------------------------
    def store_block(self, cs, c_base, bias, m, rows, n, r0=0):
        """C[m+r0 .. m+rows-1, n .. n+31] (clipped to N) from the scratch ``cs`` (row r
        of the block at cs + r * CS_STRIDE): alpha, bias, epilogue in fp32, stored as
        c_dtype."""
        st = self.store_setup(bias, n)
        with self.loop(r0, rows, 1, "st") as r:
            self.store_row(st, cs, c_base, bias, m, r, n)

    def store_setup(self, bias, n):
        """What every row of the 32 columns at ``n`` shares: lane masks, a bias row."""
        s, b = self.s, self.b
        use_bias = s.bias and float(np.float32(s.beta)) != 0.0
        brs, bcs = s.bias_row_stride, s.bias_col_stride
        cols = b.sub(i64(s.N), n)
        masks = [self.lane_mask(cols), self.lane_mask(b.sub(cols, i64(16)))]
        besz = 2 if self.bias_bf16 else 4
        col_bias = None
        if use_bias and brs == 0 and bcs != 0:     # a bias row: loaded once per block
            bias_ptr = self.bytes_gep(bias, b.mul(n, i64(besz)))
            if self.bias_bf16:
                col_bias = [bf16_bits_to_f32(
                    b, self.mload_i16(self.bytes_gep(bias_ptr, 32 * v), masks[v]))
                    for v in range(2)]
            else:
                col_bias = [self.load_v(self.bytes_gep(bias_ptr, 64 * v), masks[v])
                            for v in range(2)]
        return masks, col_bias

    def store_row(self, st, cs, c_base, bias, m, r, n):
        """Row r of the block at (m, n) (see `store_block`); ``st`` from `store_setup`."""
        s, b = self.s, self.b
        masks, col_bias = st
        alpha = float(np.float32(s.alpha))
        beta = float(np.float32(s.beta))
        use_bias = s.bias and beta != 0.0
        brs, bcs = s.bias_row_stride, s.bias_col_stride
        esz = 2 if self.c_bf16 else 4
        besz = 2 if self.bias_bf16 else 4
        mm = b.add(m, r)
        crow = self.bytes_gep(c_base, b.mul(b.add(b.mul(mm, i64(s.ldc_)), n), i64(esz)))
        srow = self.bytes_gep(cs, b.mul(r, i64(CS_STRIDE)))
        if use_bias and col_bias is None:
            boff = b.mul(mm, i64(brs)) if brs else i64(0)
            if bcs == 0:
                bptr = self.bytes_gep(bias, b.mul(boff, i64(besz)))
                if self.bias_bf16:
                    x = bf16_bits_to_f32(b, b.load(bptr, typ=I16, align=2))
                else:
                    x = b.load(bptr, typ=F32, align=4)
                bias_row = self.splat_f(x)
            else:
                bias_ptr = self.bytes_gep(bias, b.mul(b.add(boff, n), i64(besz)))
        for v in range(2):
            val = b.load(self.bytes_gep(srow, 64 * v), typ=VF, align=64)
            if alpha != 1.0:
                val = b.fmul(val, self.splat_f(alpha))
            if use_bias:
                if col_bias is not None:
                    bv = col_bias[v]
                elif bcs == 0:
                    bv = bias_row
                elif self.bias_bf16:
                    bv = bf16_bits_to_f32(
                        b, self.mload_i16(self.bytes_gep(bias_ptr, 32 * v), masks[v]))
                else:
                    bv = self.load_v(self.bytes_gep(bias_ptr, 64 * v), masks[v])
                val = b.fadd(val, bv) if beta == 1.0 else self.fma(bv, self.splat_f(beta),
                                                                  val)
            nv = b.add(n, i64(16 * v)) if v else n
            if self.epilogue is not None:
                val = self.epilogue(b, val, mm, nv)
            dst = self.bytes_gep(crow, 16 * v * esz)
            if self.c_bf16:
                self.store_bf16(val, dst, masks[v])
            else:
                self.store_v(val, dst, masks[v])

    # -- full row pairs with their stores overlapped ------------------------------------
    def pairs_overlapped(self, a_blk, bp, nfull, c_b, bias, m0, n, st, slots):
        """The ``nfull`` full 32-row pairs of a block at the columns ``n`` (two column
        tiles), each over the whole K in this function, and the stores of the pair
        before: tdpbf16ps runs on the AMX unit while the vector units are idle, so the
        previous pair's epilogue (`store_row`, ``R`` rows per K step) is interleaved with
        the tile loads and products of the K loop (two C slots alternate). ``st``: i64
        [pending, slot, m, n] of the pair whose C waits in slot 1 - slot; flushed by
        `flush_pending`."""
        b, p = self.b, self.p
        c64, r16 = _i16(64), _i16(TR)
        R = -(-2 * TR // p.kb)
        slot_bytes = 2 * TR * CS_STRIDE

        def st_at(i):
            return b.gep(st, [i64(i)], source_etype=I64)

        with self.loop(0, nfull, 1, "pp") as pi:
            a = self.bytes_gep(a_blk, b.mul(pi, i64(self.a_pair)))
            valid = b.icmp_signed("!=", b.load(st_at(0), typ=I64), i64(0))
            slot = b.load(st_at(1), typ=I64)
            pm = b.load(st_at(2), typ=I64)
            pn = b.load(st_at(3), typ=I64)
            dst = self.bytes_gep(slots, b.mul(slot, i64(slot_bytes)))
            src = self.bytes_gep(slots, b.mul(b.sub(i64(1), slot), i64(slot_bytes)))
            stp = self.store_setup(bias, pn)
            init = [self.t_zero(b, r16, c64) for _ in range(4)]

            def body(kk, accs):
                at = [self.t_load(b, r16, c64, self.bytes_gep(
                    a, b.add(b.mul(kk, i64(self.a_ks)), i64(i * self.a_rt))), self.a_stride)
                    for i in range(2)]
                bt = [self.t_load(b, r16, c64, self.bytes_gep(
                    bp, b.add(b.mul(kk, i64(2 * TILE)), i64(j * TILE))), 64)
                    for j in range(2)]
                new = [self.t_dp(b, r16, c64, c64, accs[2 * i + j], at[i], bt[j])
                       for i in range(2) for j in range(2)]
                with self.if_then(valid):
                    for i in range(R):
                        r = b.add(b.mul(kk, i64(R)), i64(i))
                        if R * p.kb > 2 * TR:
                            with self.if_then(b.icmp_signed("<", r, i64(2 * TR))):
                                self.store_row(stp, src, c_b, bias, pm, r, pn)
                        else:
                            self.store_row(stp, src, c_b, bias, pm, r, pn)
                return new

            _, accs = self.carry_loop(0, p.kb, 1, init, body, "kq")
            for i in range(2):
                for j in range(2):
                    ptr = self.bytes_gep(dst, i * TR * CS_STRIDE + j * 64)
                    self.t_store(b, r16, c64, ptr, CS_STRIDE, accs[2 * i + j])
            b.store(i64(1), st_at(0))
            b.store(b.sub(i64(1), slot), st_at(1))
            b.store(b.add(m0, b.mul(pi, i64(2 * TR))), st_at(2))
            b.store(n, st_at(3))

    def flush_pending(self, c_b, bias, st, slots):
        """The stores of the last pair `pairs_overlapped` left pending."""
        b = self.b

        def st_at(i):
            return b.gep(st, [i64(i)], source_etype=I64)

        with self.if_then(b.icmp_signed("!=", b.load(st_at(0), typ=I64), i64(0))):
            slot = b.load(st_at(1), typ=I64)
            src = self.bytes_gep(slots, b.mul(b.sub(i64(1), slot), i64(2 * TR * CS_STRIDE)))
            pn = b.load(st_at(3), typ=I64)
            self.store_block(src, c_b, bias, b.load(st_at(2), typ=I64), i64(2 * TR), pn)
        b.store(i64(0), st_at(0))

    # -- the kernel -------------------------------------------------------------------
    def emit(self):
        s, p, b = self.s, self.p, self.b
        args = self.fn.args[0]
        A = self.arg(args, 0)
        B = self.arg(args, 1)
        bias = self.arg(args, 2) if s.bias else None
        C = self.arg(args, 3 if s.bias else 2)
        ws = self.fn.args[3]
        t0, t1 = self.fn.args[1], self.fn.args[2]
        cs = self.bytes_gep(ws, p.ws_c)
        wa = self.bytes_gep(ws, p.ws_a)
        aesz = 2 if self.a_bf16 else 4
        cesz = 2 if self.c_bf16 else 4
        if s.dyn:
            assert self.dims_slot is not None, "a dynamic AMX GEMM needs dims_slot"
            M, _batch, mt, nt, MB, NB = (
                b.load(b.gep(args, [i64(self.dims_slot + i)], source_etype=I64), typ=I64,
                       align=8) for i in range(len(AMX_DIMS)))
            a_bs = b.mul(M, i64(s.K)) if s.a_batch_stride else i64(0)
            c_bs = b.mul(M, i64(s.ldc_))
            Mrem = b.urem(M, i64(2 * TR))
        else:
            M, mt, nt, MB, NB = (i64(v) for v in (s.M, p.mt, p.nt, p.MB, p.NB))
            a_bs, c_bs = i64(s.a_batch_stride), i64(s.c_batch_stride_)
            Mrem = s.M % (2 * TR)
        per_b = b.mul(mt, nt)
        Nrem = s.N % 32
        Mfull = b.sub(M, Mrem if s.dyn else i64(Mrem))
        # the stores of each full pair overlap the next pair's K loop (pairs_overlapped)
        overlap = Nrem == 0 and p.kb >= 4 and OVERLAP_STORES
        if overlap:
            st = b.alloca(I64, size=i64(4), name="pending")
            slots = self.bytes_gep(cs, p.max_mb * CS_STRIDE)
        with self.loop(t0, t1, 1, "t") as t:
            bi = b.udiv(t, per_b)
            rr = b.urem(t, per_b)
            jt = b.udiv(rr, mt)
            it = b.urem(rr, mt)
            m0 = b.mul(it, MB)
            m1 = self.smin(b.add(m0, MB), M)
            n0 = b.mul(jt, NB)
            n1 = self.smin(b.add(n0, NB), s.N)
            a_b = self.bytes_gep(A, b.mul(b.mul(bi, a_bs), i64(aesz)))
            b_b = self.bytes_gep(B, b.mul(bi, i64(_b_batch_bytes(s) if s.b_batch_stride
                                                   else 0)))
            c_b = self.bytes_gep(C, b.mul(b.mul(bi, c_bs), i64(cesz)))
            if p.pack_a:
                self.pack_a(a_b, m0, b.sub(m1, m0), wa)
                a_blk = wa
            else:
                a_blk = self.bytes_gep(a_b, b.mul(m0, i64(s.lda_ * 2)))
            # the full 32-row pairs of the block, then the last rows of A (if here)
            nfull = b.udiv(b.sub(self.smin(m1, Mfull), m0), i64(2 * TR))
            if overlap:
                for i, v in enumerate((i64(0), i64(0), m0, n0)):
                    b.store(v, b.gep(st, [i64(i)], source_etype=I64))
            with self.loop(n0, n1, 32, "n") as n:
                bp = self.bytes_gep(b_b, b.mul(b.udiv(n, i64(2 * TC)), i64(p.kb * 2 * TILE)))
                if overlap:
                    self.pairs_overlapped(a_blk, bp, nfull, c_b, bias, m0, n, st, slots)
                else:
                    with self.if_then(b.icmp_signed(">", nfull, i64(0))):
                        self.call_micro(32, a_blk, bp, cs, nfull, i64(32), n, Nrem)
                if s.dyn or Mrem:
                    edge = b.icmp_signed("==", m1, M)
                    if s.dyn:
                        edge = b.and_(edge, b.icmp_signed("!=", Mrem, i64(0)))
                    with self.if_then(edge):
                        ap = self.bytes_gep(a_blk, b.mul(nfull, i64(self.a_pair)))
                        cp = self.bytes_gep(cs, b.mul(nfull, i64(2 * TR * CS_STRIDE)))
                        if not s.dyn:
                            self.call_micro(Mrem, ap, bp, cp, i64(1), i64(Mrem), n, Nrem)
                        else:
                            lo = b.icmp_signed("<=", Mrem, i64(TR))
                            with b.if_else(lo) as (then, other):
                                with then:
                                    self.call_micro("lo", ap, bp, cp, i64(1), Mrem, n, Nrem)
                                with other:
                                    self.call_micro("hi", ap, bp, cp, i64(1), Mrem, n, Nrem)
                if overlap:     # the last rows (an edge pair) at once
                    self.store_block(cs, c_b, bias, m0, b.sub(m1, m0), n,
                                     r0=b.mul(nfull, i64(2 * TR)))
                else:
                    self.store_block(cs, c_b, bias, m0, b.sub(m1, m0), n)
            if overlap:
                self.flush_pending(c_b, bias, st, slots)
        f = self.intr("llvm.x86.tilerelease", VOID, [])
        b.call(f, [])
        b.ret_void()

    def call_micro(self, kind, ap, bp, cs, npairs, rows, n, Nrem):
        """Call the micro-kernel ``kind`` (see `micro`) for the columns at ``n``: the
        last columns (<= 16 of them: one column tile) have their own."""
        b = self.b
        argv = [ap, bp, cs, npairs, rows]
        if 0 < Nrem <= 16:
            last_c = b.icmp_signed(">=", b.add(n, i64(16)), i64(self.s.N))
            with b.if_else(last_c) as (then, other):
                with then:
                    b.call(self.micro(kind, 1), argv)
                with other:
                    b.call(self.micro(kind, 2), argv)
        else:
            b.call(self.micro(kind, 2), argv)


def emit_amx_gemm(
    module: ir.Module,
    name: str,
    spec: GemmSpec,
    epilogue: Epilogue | None = None,
    *,
    a_dtype="float32",
    c_dtype="float32",
    bias_dtype="float32",
    tuning: dict | None = None,
    dims_slot: int | None = None,
) -> ir.Function:
    """Emit ``void name(ptr args, i64 tile_begin, i64 tile_end, ptr workspace)``: the
    AMX bf16 GEMM of ``spec`` (``b_prepacked``: B from `amx_prepack_b`; see
    `amx_supports`), args ``[A, B_packed, (bias,) C]``. ``a_dtype``: A float32
    (converted to bf16 while packed) or bfloat16; ``c_dtype``: C float32 or
    bfloat16 (rounded to nearest even on store, after the epilogue);
    ``bias_dtype`` likewise. ``epilogue(builder, <16 x float>, m, n)`` as in
    `emit_gemm` (after alpha and bias; may see masked-off lanes and rows < 32 of
    a block, whose results are discarded; no side effects on memory). The kernel
    has `amx_num_tiles` tiles and needs `amx_workspace_bytes` (pass them the same
    ``a_dtype`` and ``tuning``, see `amx_plan`); run it only where `amx_usable` is
    None. A dynamic ``spec`` (`gemm.dynamic_spec`, ``b_prepacked``) reads its runtime
    dims (``AMX_DIMS``, as `amx_dims` computes them) as i64 from
    ``args[dims_slot:]``; its workspace serves every M."""
    a_dt, c_dt, bias_dt = _dt(a_dtype), _dt(c_dtype), _dt(bias_dtype)
    plan = amx_plan(spec, a_dt, tuning)
    fn = abi_function(module, name)
    _Gen(module, fn, spec, plan, epilogue, a_dt, c_dt, bias_dt, dims_slot).emit()
    return fn
