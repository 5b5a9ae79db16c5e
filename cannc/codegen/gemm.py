"""Generator of fast fp32, bf16 and fp16 GEMM kernels as LLVM IR (llvmlite.ir).

The emitted kernels follow the kernel ABI (``cannc/codegen/ABI.md``)::

    void @name(ptr %args, i64 %tile_begin, i64 %tile_end, ptr %workspace)

with ``args = [A, B, (bias,) C]`` and compute, for every batch item ``b``::

    C_b[M,N] = alpha * op(A_b)[M,K] @ op(B_b)[K,N] + beta * bias

The code follows the Goto/BLIS recipe (see shared/PERFORMANCE_NOTES.md):

* a register-blocked micro-kernel of ``MR`` rows x ``16*NV`` columns (for M > 8:
  6x32 or 8x32 with one 512-bit FMA pipe, 6x64 with two, see `gemm_wide_tile`;
  1x128, 2x96, 3x64, 4..8x32 for small M) whose accumulators are
  ``<16 x float>`` phi values updated with ``llvm.fma.v16f32``, a write
  prefetch of the C tile on entry and masked loads/stores for edge tiles;
* B packed into 32-column zero-padded panels (``[panel][k][32]``), either at
  compile time (``b_prepacked``, see :func:`prepack_b`) or per ``KC x NC``
  block into the workspace (``[N,K]`` B: 16x16 in-register transposes); with
  few rows (M <= 12) a row-major B is read in place, ``KC`` rows at a time;
* A read in place (rows of a row-major A stream well), or packed into
  ``MR``-row panels per ``MC x KC`` block when it is stored transposed;
* ``KC`` blocking of the reduction (partial sums live in C between K blocks;
  alpha, bias and the epilogue are applied on the last block only). K blocks are
  large (up to ``KC_MAX``): reloading the partial sums of C costs more than B
  micro-panels read from L2; ``NC`` blocking keeps the KC x NC block of B in L2;
  with up to ``MID_ROWS`` rows and a prepacked B they are ``MID_ROWS_KC`` long
  (the wider N block reads A fewer times);
* 'dot' kernels when A rows and B columns are both contiguous in K and one
  side is tiny (GEMV with B ``[N,K]``, attention-like ``Q @ K^T`` with few
  rows, N <= 8): ``MR x NR`` dot products vectorised along K, reduced with
  a shuffle tree; a tiny row-major B is transposed into the workspace, a
  prepacked one is stored as ``B^T``.

Every shape, including edge tiles, is handled by masks: no scalar loops.
C must not overlap the inputs (partial sums are kept in C).

Shape-polymorphic kernels (``GemmSpec.dyn``, see `dynamic_spec`, ABI.md "Runtime
dimensions"): one kernel per N, K and layout serves every M and batch count.
M, the batch count, the tile grid, KC and NC (of a prepacked B) are runtime dims
(``GEMM_DIMS``) that the host tiling function `gemm_dims` computes per call, as
the static planner would. A block's full MR-row panels run the MR-row kernel,
its last ``M mod MR`` rows a strip of micro-kernels of exactly that many rows
(chosen at run time; wider for fewer rows), so few rows cost what they cost a
kernel made for them; with float32 operands those are functions of library modules
that every GEMM of a program calls (`strip_module`), compiled once. A B that is not
prepacked gets a second plan for at most ``SMALL_M`` rows (B read in place, or dot
products), chosen per call.

Reduced precision (``GemmSpec.compute`` "bf16" / "fp16", fp32 accumulation; A, B, bias
and C each float32 or the narrow type, a float32 operand rounded to it where it is
loaded or packed, C converted on store after the float32 epilogue):

* bf16 with vdpbf16ps (avx512_bf16, where it beats fp32 FMA: `use_dpbf16`, measured):
  B panels of k-pairs (each 32-bit lane B[k,n], B[k+1,n]; prepacked at compile time
  or packed per block), one broadcast 32-bit pair A[i,k], A[i,k+1] per row (a bf16
  row-major A read in place, else converted per block), the same MR x 2 zmm tile of
  accumulators; an odd K ends with a zero partner;
* otherwise (fp16 always: storage, fp32 FMA) the fp32 micro-kernel: with many rows on
  float32 panels (B packed, or the prepacked narrow B widened, per block; A rows
  converted per block), with few rows (memory-bound GEMV / dot kernels) on the narrow
  data widened in registers (bf16: a shift; fp16: vcvtph2ps): half the bytes;
* a narrow C gets one K block (partial sums need float32).

With AVX2 only (no AVX-512, or ``CANNC_ISA=avx2``) the plans fit 16 ymm
registers: a 6 x 16 micro-kernel (12 accumulators, each <16 x float> two ymm),
half-panel tiles, and no masks in the k loops.

Tiles: ``tile = (batch item, column block, row block)`` with the row block
index running fastest. A call handles its contiguous tile range in as few
blocks as possible (consecutive row blocks, or consecutive column blocks
when there is one row block, are merged), so B (or A) is packed once per
call rather than once per tile. The grid is chosen so that two cores get
balanced work (the model evaluates the ``[i*T//n, (i+1)*T//n)`` split).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from llvmlite import ir

from ..native.emit import (
    BF16,
    F32,
    I8,
    I16,
    I32,
    I64,
    PTR,
    VOID,
    i32,
    i64,
    mark_vector_code,
    masked_load,
    masked_store,
)
from ..native.target import LIB_PREFIX, host, new_module, register_library
from ..runtime.memory import device_ready_empty
from ..schedule.machine import (
    gemm_k_unroll,
    gemm_micro_rows,
    gemm_wide_tile,
    l2_b_block,
    l2_bytes,
)
from ..schedule.split import cdiv as _cdiv
from ..schedule.split import gemm_groups as _groups
from ..schedule.split import region_chunks as _region_chunks
from ..schedule.split import rup as _rup
from .elementwise import bf16_bits_to_f32, f32_to_bf16_bits
from .vec import VF, VI32, VI64, VM, VPTR, VecBuilder, abi_function, declare

__all__ = [
    "COMPUTE",
    "ELEM_TYPES",
    "GEMM_DIMS",
    "GemmSpec",
    "dynamic_able",
    "dynamic_spec",
    "emit_gemm",
    "gemm_dims",
    "gemm_num_tiles",
    "gemm_plan",
    "gemm_workspace_bytes",
    "dpbf16_speedup",
    "host_dpbf16",
    "host_isa",
    "precision_note",
    "prepack_b",
    "prepacked_b_size",
    "use_dpbf16",
    "variant_plan",
]

PANEL = 32  # columns of a packed B panel
# k steps summed in one chain of fp32 FMAs before its sums join the K block's (where the
# registers allow, _Gen.subchains): rounding error grows with the length of a chain, and
# a small-M GEMM (K block = K) summed 2048-4096 terms in one; MLAS's chains are 256 long
SUBCHAIN = 256
KC_MAX = 2048  # the K block of a (not packed) A
# the K block of a few rows (2..FEW_ROWS) read in place: they sit a row stride apart,
# at a multiple of 4 KiB (K = 1024, 2048...) in one L1 set, and a long K block streams
# much of B through that set. A precaution, not a measured win: 8x1024x1024 runs at
# 108-112 GFLOP/s with or without it (gemm_bench); the 3x slowdown first blamed on
# this came from where the packed weights lived (see runtime/program.py WeightPool)
FEW_ROWS_KC = 256
FEW_ROWS = 16  # rows up to which the dynamic kernel's tiles split only the columns
# the K block of a prepacked B with few row panels, up to MID_ROWS rows (the dynamic
# kernel's runtime dims: from FEW_ROWS + 1 rows, FEW_ROWS_KC below; a static plan: from
# two row panels, one row panel reads FEW_ROWS_KC rows at a time): C's
# partial sums are small, and the shorter K block buys an N block (_nc_for) 3-6x wider,
# so the row panels of A are re-read from L2 3-6x less. Measured (plan variants timed
# interleaved in one process, as gemm_bench.py --tuning '{"KC": 512}' does one at a time;
# Sapphire Rapids guest, 1 core, B cycled through 12 copies as a model's weights are),
# KC 512 against the KC_MAX default: 128x768x3072 +8.5%, 128x1024x4096 +12%, 128x1024x2048 +12%,
# 128x768x1536 +4%, 128x768x1024 +4.5%, 64x768x3072 +2.5%, 256x768x3072 +3.5%,
# 384x768x3072 +2%, 512x768x3072 +2%; 1024x768x3072 and 1024^3 level (-0.5, -1%);
# KC 256, 384 and 768 at 128x768x3072: +6, +7, +6.5%. Blocks are at least MID_ROWS_KC
# long: K = 768 in two blocks of 384 ran 1-2.5% slower than one (128x768x768,
# 128x3072x768), K = 1024 in two of 512 4.5% faster.
MID_ROWS = 512
MID_ROWS_KC = 512
SMALL_M = 12  # rows up to which a B that is not prepacked is read in place
# the rows up to which (from FEW_ROWS + 1, in whole 8-row panels: see gemm_dims) and the
# K from which a dynamic kernel of a prepacked float32 B whose tile is the wide
# WIDE_MR x 64 one runs the 8 x 32 tile instead (GemmPlan.alt, 'variant'
# VARIANT_MID_ROWS). Few row panels per B micro-panel: the weights come from memory, and
# at M = 128 the wide tile runs 132 rows. Measured on the Sapphire Rapids guest:
# - static kernels, 1 core, B cycled through 24-40 copies as a model's weights are,
#   8 x 32 against 6 x 64: 128 rows, K >= 768: +2 to +5% (128x768x768, 128x3072x768,
#   128x768x3072, 128x384x1536); K <= 512: -1.4 to -5% (128x384x384, 128x1536x384,
#   128x768x512); 192-384 rows level; from 512 rows -2 to -4%;
# - models, old and new code in alternating processes (cannc profile, s128):
#   BERT-base b1 1 core run 133.7 -> 130.2 ms, 2 cores 71.1 -> 68.4; DistilBERT b1
#   68.6 -> 65.9 / 36.4 -> 34.4; GPT-2 b1 135.9 -> 133.3 / 71.7 -> 69.8; T5-small's
#   encoder (its FFN's second GEMM, K = 2048) 32.2 -> 31.2; BERT-base b2 (256 rows)
#   2 cores 138.7 -> 131.7, 1 core 250.5 -> 255.7 (noise-level); MiniLM (K = 384 but
#   for its FFN's second GEMM) +4% on 1 core without the K bound, level with it
#   (17.7 -> 17.9 ms; 2 cores 10.2 -> 10.0).
MID_ROWS_8 = 256
MID_ROWS_8_K = 768
# the runtime dim 'variant' of a dynamic GEMM (gemm_dims): which plan runs
VARIANT_MAIN, VARIANT_FEW_ROWS, VARIANT_MID_ROWS = 0, 1, 2
STRIP_NC = 384  # a multiple of the widths of all strip micro-kernels (128, 96, 64, 32)


# the micro-tiles of the last K block prefetch what the epilogue reads from other tensors
# (GemmGen.prefetch_epilogue)
EPILOGUE_PREFETCH = True

# A prepacked fp32 B of at least PF_B_MIN_BYTES carries the next micro-panel's prefetch
# stream (GemmPlan.pf_b), not only one larger than L2: in a model every weight has left
# the caches by the next run (the weights together are larger than they are), whatever
# its own size. Sapphire Rapids guest, 1 core, B cycled through 40 copies (gemm_bench
# --b-copies 40), no stream against the stream: 128x512x512 136 -> 181 GFLOP/s,
# 128x384x384 143 -> 186, 32x512x512 122 -> 155, 8x384x384 107 -> 108 (memory-bound);
# with B in the caches (one copy) level within noise (-5 to +3%)
PF_B_MIN_BYTES = 256 << 10


def mid_rows_kc(K: int) -> int:
    """The K block of up to MID_ROWS rows with a prepacked B (see MID_ROWS_KC): K in
    blocks of at least MID_ROWS_KC, as even as they come."""
    return _cdiv(K, max(1, K // MID_ROWS_KC))


Epilogue = Callable[[ir.IRBuilder, ir.Value, ir.Value, ir.Value], ir.Value]

# element types of the operands (numpy dtype names) and the multiply precisions, with the
# type the packed panels of a compute precision hold
ELEM_TYPES = ("float32", "bfloat16", "float16")
COMPUTE = {"f32": "float32", "bf16": "bfloat16", "fp16": "float16"}
V16I16 = ir.VectorType(I16, 16)
V16H = ir.VectorType(ir.HalfType(), 16)
V16BF = ir.VectorType(BF16, 16)
V32BF = ir.VectorType(BF16, 32)


def _esize(t: str) -> int:
    return 4 if t == "float32" else 2


def _ety(t: str) -> ir.Type:
    """The LLVM storage type of one element (16-bit floats are stored as i16)."""
    return F32 if t == "float32" else I16


def np_elem(t: str) -> np.dtype:
    """The numpy dtype of an element type name."""
    if t == "bfloat16":
        import ml_dtypes  # here: its import costs ~0.6 s, and fp32 never needs it

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(t)


@dataclass(frozen=True)
class GemmSpec:
    """C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * bias (float32 accumulation;
    element types and compute precision: the last fields)."""

    M: int
    N: int
    K: int
    batch: int = 1
    a_batch_stride: int = 0  # elements; 0: same A for every batch item
    b_batch_stride: int = 0
    c_batch_stride: int = 0  # elements; 0 (with batch > 1) means M*ldc
    trans_a: bool = False  # A stored as [K,M]
    trans_b: bool = False  # B stored as [N,K]
    lda: int | None = None
    ldb: int | None = None
    ldc: int | None = None
    alpha: float = 1.0
    beta: float = 1.0
    bias: bool = False
    bias_row_stride: int = 0
    bias_col_stride: int = 0
    b_prepacked: bool = False
    # shape-polymorphic kernel (ABI.md "Runtime dimensions"): M and the batch count are
    # read at run time (``GEMM_DIMS``); the spec is the canonical one of `dynamic_spec`
    dyn: bool = False
    # element types (ELEM_TYPES) of A, B, bias and C, and the precision of the products
    # (COMPUTE; accumulation is float32): an operand of another type is rounded to it when
    # it is loaded or packed, C is converted on store after alpha, bias and the epilogue
    a_type: str = "float32"
    b_type: str = "float32"
    bias_type: str = "float32"
    c_type: str = "float32"
    compute: str = "f32"

    def __post_init__(self):
        for f in ("M", "N", "K", "batch"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"GemmSpec.{f} must be >= 1, got {getattr(self, f)}")
        for f in (
            "a_batch_stride",
            "b_batch_stride",
            "c_batch_stride",
            "bias_row_stride",
            "bias_col_stride",
        ):
            if int(getattr(self, f)) < 0:
                raise ValueError(f"GemmSpec.{f} must be >= 0")
        if self.lda is not None and self.lda < (self.M if self.trans_a else self.K):
            raise ValueError("lda too small")
        if self.ldb is not None and self.ldb < (self.K if self.trans_b else self.N):
            raise ValueError("ldb too small")
        if self.ldc is not None and self.ldc < self.N:
            raise ValueError("ldc too small")
        for f in ("a_type", "b_type", "bias_type", "c_type"):
            if getattr(self, f) not in ELEM_TYPES:
                raise ValueError(f"GemmSpec.{f} must be one of {ELEM_TYPES}, "
                                 f"got {getattr(self, f)!r}")
        if self.compute not in COMPUTE:
            raise ValueError(f"GemmSpec.compute must be one of {tuple(COMPUTE)}, "
                             f"got {self.compute!r}")
        if self.dyn and (self.trans_a or self.lda is not None or self.c_batch_stride
                         or self.batch > 2 or self.a_batch_stride not in (0, 1)):
            raise ValueError("a dynamic GemmSpec is canonical (see dynamic_spec) and has "
                             "a row-major A")

    # resolved leading dimensions / strides ---------------------------------
    @property
    def lda_(self) -> int:
        return self.lda if self.lda is not None else (self.M if self.trans_a else self.K)

    @property
    def ldb_(self) -> int:
        return self.ldb if self.ldb is not None else (self.K if self.trans_b else self.N)

    @property
    def ldc_(self) -> int:
        return self.ldc if self.ldc is not None else self.N

    @property
    def c_batch_stride_(self) -> int:
        if self.c_batch_stride or self.batch == 1:
            return self.c_batch_stride
        return self.M * self.ldc_


# ---------------------------------------------------------------------------
# planning (compile-time Python)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmPlan:
    MR: int  # micro-kernel rows
    NV: int  # micro-kernel <16 x float> vectors per row (NR = 16*NV)
    NR: int  # micro-kernel columns (16*NV; B rows per micro-tile in 'dot' mode)
    KC: int
    MC: int
    NC: int
    pack_a: bool
    b_mode: str  # 'prepacked' | 'pack' | 'direct' | 'dot'
    unroll: int
    prefetch_c: bool
    strips: bool  # the last (< MR) rows of a block by micro-kernels of that many rows
    isa: str  # 'avx512' | 'avx2': the register file the micro-kernels are sized for
    mt: int  # row blocks per batch item (0 in a dynamic plan: gemm_dims chooses)
    nt: int  # column blocks per batch item
    MB: int  # rows per row block
    NB: int  # columns per column block
    ws_a: int  # byte offset of the A packing buffer in the workspace
    ws_b: int  # byte offset of the B packing buffer
    ws_bytes: int
    # a dynamic kernel's variant, chosen per call by the runtime dim 'variant': for at
    # most SMALL_M rows (B not prepacked: read in place, or dot products; a narrow
    # prepacked B: its narrow panels), or (alt_mid) for FEW_ROWS + 1 to MID_ROWS_8 rows
    # in whole 8-row panels (a prepacked float32 B: the 8 x 32 tile where the plan's is
    # WIDE_MR x 64)
    alt: GemmPlan | None = None
    alt_mid: bool = False
    # bf16 products by vdpbf16ps (avx512_bf16): B panels of k-pairs (each 32-bit lane
    # B[k,n], B[k+1,n]); A read as bf16 pairs (in place, or converted per block: cvt_a)
    dp: bool = False
    cvt_a: bool = False
    # without vdpbf16ps, many rows: the panels of a narrow (or rounded) B and the rows of A
    # are float32 in the workspace (B packed, or the prepacked narrow B widened, per block;
    # A converted per block: cvt_a), so the fp32 micro-kernel runs at fp32 speed
    f32_panels: bool = False
    # KC and NC at run time (a dynamic kernel of a prepacked B, see gemm_dims)
    rt_block: bool = False
    # the row tiles of each B micro-panel prefetch the next one into L2 (a prepacked
    # fp32 B of at least PF_B_MIN_BYTES: weights come from memory, see _Gen.pf_next; on
    # an unrolled k loop only, as every big tile's is: gemm_k_unroll)
    pf_b: bool = False
    pf_div: int = 1  # ... advancing its stream every pf_div-th k-loop iteration

    def num_tiles(self, batch: int) -> int:
        assert self.mt, "the grid of a dynamic GEMM is chosen per call (gemm_dims)"
        return batch * self.mt * self.nt


def _nc_for(KC: int, NR: int) -> int:
    """The N block: the KC x NC block of B stays in L2 (a multiple of NR)."""
    return max(NR, (l2_b_block() // (4 * KC)) // NR * NR)


def _nv_for(rows: int, N: int, b_mode: str, isa: str = "avx512") -> int:
    """<16 x float> vectors per row of a micro-kernel of ``rows`` rows: >= 8
    accumulators (the FMA latency) and few loads of A per FMA, in the 32 vector
    registers of AVX-512; with AVX2 (16 ymm registers, a <16 x float> is two) at
    most 12 accumulator registers: 6 x 16, 3 x 32, 2 x 32, 1 x 64."""
    if isa == "avx2":
        nv = {1: 4, 2: 2, 3: 2}.get(rows, 1)
    else:
        nv = {1: 4 if b_mode == "direct" else 8, 2: 6, 3: 4}.get(rows, 2)
    return min(nv, 2 * _cdiv(N, 32))


def _small_tile_unroll(MR: int, NV: int, isa: str) -> int:
    """k steps per iteration of the k loop of a micro-tile of at most 8 <16 x float>
    accumulators: 4, a loop body long enough for its FMAs. But 2 for an AVX2 tile whose
    accumulators, B vectors (each used by every row) and a broadcast fill more than the
    16 ymm registers -- the 3 x 32 tile, 12 + 4 + 1: four unrolled k steps spilled
    accumulators in every iteration, two spill fewer (a Zen 3, alternating in one process:
    3 x 768 x 768 with B in cache x0.86-0.89, from memory x0.92-1.01; the remainder strip
    of M = 9 x0.91-0.96, M = 21 x0.97-0.98; static and dynamic kernels alike)."""
    if isa == "avx2" and MR > 1 and 2 * NV * (MR + 1) + 1 > 16:
        return 2
    return 4


def _strip_unroll(MR: int, NV: int, isa: str) -> int:
    """k steps per iteration of the k loop of an MR x 16*NV micro-tile that is not the
    plan's own (a strip's): _small_tile_unroll's, and none past 8 accumulators."""
    return _small_tile_unroll(MR, NV, isa) if MR * NV <= 8 else 1


def _rows_padding_least(M: int, many: int) -> int:
    """The rows of the AVX-512 micro-kernel for a product of M rows (M known when it is
    compiled): of the measured choice (gemm_micro_rows) and 8, the one that pads M to
    fewer rows, the measured one on a tie. An edge panel runs the whole micro-kernel
    with its extra rows masked: at M = 128 (every transformer at sequence 128) 6 rows
    ran 132 rows' work. 8 rows are no slower per row than 6 on a Zen 4 (one 512-bit FMA
    a cycle), though their 16 accumulators leave no registers for K subchains.
    Measured there (gemm_bench, 1 core, B prepacked, GFLOP/s, two alternating runs):
    128x768x768 111.4/111.7 -> 115.6/115.8, 128x3072x768 108.7/109.9 -> 113.6/113.9,
    128x768x3072 108.8/110.2 -> 113.1/113.1; 197 rows (ViT) stay at 6 (198 rows against
    200: 8 rows measured 1-2% slower), 1024 and 512 within noise either way."""
    if many == 8:
        return many
    return min((many, 8), key=lambda r: (_rup(M, r), r != many))


WIDE_MR = 6  # rows of the wide (x 64 columns) fp32 micro-tile, see gemm_wide_tile
WIDE_GAIN = 1.06  # its speed per FMA over the 8 x 32 tile's, measured (gemm_wide_tile)


def _wide_pays(M: int, N: int, MR: int, dyn: bool) -> bool:
    """Whether a product of M rows (any M for a dynamic kernel) and N columns takes the
    WIDE_MR x 64 micro-tile rather than MR x 32: on cores with two 512-bit FMA pipes
    (gemm_wide_tile), at least 64 columns, and a known M that WIDE_MR rows do not pad
    by more than the tile gains (M = 128: 132 rows against 128, 3% of 6%; there the
    static wide kernel measured 0.98-1.05 of 8 x 32, within the noise). Columns past the
    last multiple of 64 are run by a WIDE_MR x 32 tile (_Gen.col_tiles)."""
    if N < 64 or not gemm_wide_tile():
        return False
    if dyn:
        return True
    return _rup(M, WIDE_MR) < _rup(M, MR) * WIDE_GAIN * 0.97


def host_isa() -> str:
    """The vector ISA the kernels are planned for: 'avx512' or 'avx2' (the host target's
    features, see native.target.host and CANNC_ISA)."""
    return "avx512" if host().has("avx512f") else "avx2"


def host_dpbf16() -> bool:
    """The host has vdpbf16ps (avx512_bf16; not under CANNC_ISA=avx512-nobf16 / avx2)."""
    return host().has("avx512f") and host().has("avx512bf16")


DP_MIN_SPEEDUP = 1.25  # vdpbf16ps kernels where their peak beats the fp32 FMA peak by this


def use_dpbf16() -> bool:
    """bf16 GEMMs use vdpbf16ps: the host has it and it is faster than fp32 FMA here.
    (Zen 4/5: ~2x the FMA peak; some Intel cores run it at half the FMA rate, where
    widening bf16 to fp32 in registers is as fast: measured once per process.)"""
    return host_dpbf16() and dpbf16_speedup(host().features) >= DP_MIN_SPEEDUP


@lru_cache(maxsize=4)
def dpbf16_speedup(features: str) -> float:
    """Peak GFLOP/s of 12 independent vdpbf16ps chains over that of 12 fp32 FMA chains on
    this core (best of 5 short runs of each; the features key the host target)."""
    import ctypes
    import time

    from ..native.target import JitLibrary, default_cache, new_module

    m = new_module("dp_peak")
    for kind in ("fma", "dp"):
        fn = ir.Function(m, ir.FunctionType(F32, [I64]), name=f"cannc_{kind}_peak")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        entry, loop, done = b.block, fn.append_basic_block("loop"), fn.append_basic_block("x")
        b.branch(loop)
        b.position_at_end(loop)
        i = b.phi(I64)
        i.add_incoming(i64(0), entry)
        accs = []
        for c in range(12):
            p = b.phi(VF)
            p.add_incoming(ir.Constant(VF, [float(c)] * 16), entry)
            accs.append(p)
        if kind == "fma":
            f = ir.Function(m, ir.FunctionType(VF, [VF, VF, VF]), name="llvm.fma.v16f32")
            one = ir.Constant(VF, [1.0000001] * 16)
            new = [b.call(f, [a, one, one]) for a in accs]
        else:
            f = ir.Function(m, ir.FunctionType(VF, [VF, V32BF, V32BF]),
                            name="llvm.x86.avx512bf16.dpbf16ps.512")
            x = b.bitcast(ir.Constant(VI32, [0x3F803F80] * 16), V32BF)
            new = [b.call(f, [a, x, x]) for a in accs]
        for p, v in zip(accs, new):
            p.add_incoming(v, loop)
        nxt = b.add(i, i64(1))
        i.add_incoming(nxt, loop)
        b.cbranch(b.icmp_signed("<", nxt, fn.args[0]), loop, done)
        b.position_at_end(done)
        t = new[0]
        for v in new[1:]:
            t = b.fadd(t, v)
        b.ret(b.extract_element(t, i32(0)))
    lib = JitLibrary([default_cache().compile(str(m), "dp_peak", speed_level=0)])
    rate = {}
    iters = 200_000
    for kind, flops in (("fma", 32), ("dp", 64)):
        f = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int64)(lib.address(f"cannc_{kind}_peak"))
        f(iters // 10)
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            f(iters)
            best = min(best, time.perf_counter() - t0)
        rate[kind] = 12 * flops * iters / best
    return rate["dp"] / rate["fma"]


def _pair_layout(spec: GemmSpec, dp: bool | None = None) -> bool:
    """A prepacked B of ``spec`` is stored in k-pairs for vdpbf16ps (see prepack_b)."""
    if spec.compute != "bf16" or not spec.b_prepacked or _prepacked_dot(spec):
        return False
    return use_dpbf16() if dp is None else dp    # (measured once: only for bf16 GEMMs)


def precision_note(spec: GemmSpec, tuning: dict | None = None) -> str | None:
    """How a GEMM of narrow operands or products runs (kernel.notes['precision']), None
    for a float32 GEMM."""
    types = {spec.a_type, spec.b_type, spec.c_type, spec.bias_type if spec.bias else "float32"}
    if spec.compute == "f32" and types == {"float32"}:
        return None
    if spec.compute == "fp16":
        return "fp16 storage, fp32 FMA"
    if spec.compute == "bf16":
        p = gemm_plan(spec, tuning)
        if p.dp and (p.alt is None or p.alt.dp):
            return "bf16 avx512_bf16"
        if p.dp:
            return "bf16 avx512_bf16 (few rows: widened to fp32, fp32 FMA)"
        if use_dpbf16():
            return "bf16 widened to fp32 (few rows or columns: memory-bound)"
        if host_dpbf16():
            return "bf16 widened to fp32 (vdpbf16ps is not faster than fp32 FMA here)"
        return "bf16 widened to fp32 (no avx512_bf16)"
    return "narrow storage, fp32 FMA"


# flops that reading one float of B (or of an A block larger than half the L2) costs a
# block, from L3 or memory: on the Sapphire Rapids guest a 1-core 128 x 768 x 3072 GEMM
# in 6-row tiles took 6.1 ms in 5 chunks, each reading all of B, against 4.7 in one
# (~1.4 ms for 38 MB: ~16 flops a float)
REREAD_COST = 16.0


def _grid_cost(spec: GemmSpec, MR, NR, MB, NB, mt, nt, pack_a, pack_b, cores=2):
    """Crude model of the slowest core's time (units ~ flops), (without, with) the
    reads of operands: the blocks of the chunks it claims from its region
    (split.region_chunks), each block's products and packing, and its reads of B
    columns, again in every chunk (a rows-only grid reads all of B once per chunk; B, a
    model's weights, is not in cache), and of A rows where they do not stay in L2 (A,
    an activation the previous kernel wrote, mostly does)."""
    M, N, K = spec.M, spec.N, spec.K
    T = spec.batch * mt * nt
    a_l2 = l2_bytes() // 2 // (4 * K)   # rows of A that stay in L2
    worst = [0.0, 0.0]
    for chunks in _region_chunks(T, cores):
        cost = reread = 0.0
        for t0, t1 in chunks:
            for _b, it0, it1, jt0, jt1 in _groups(spec.batch, mt, nt, t0, t1):
                m0, m1 = it0 * MB, min(M, it1 * MB)
                n0, n1 = jt0 * NB, min(N, jt1 * NB)
                rows = _rup(m1 - m0, MR)
                cols = _rup(n1 - n0, NR)
                cost += 2.0 * rows * cols * K + 2000.0  # + per-block overhead
                reread += REREAD_COST * K * (cols + (rows if rows > a_l2 else 0))
                if pack_b:
                    cost += 24.0 * K * cols
                if pack_a:
                    cost += 24.0 * K * rows
        worst = [max(worst[0], cost), max(worst[1], cost + reread)]
    return tuple(worst)


def _distinct_splits(P):
    """(tiles, units per tile) for all distinct ways to cut P units."""
    out = {}
    for p in range(1, P + 1):
        t = _cdiv(P, p)
        if t not in out:
            out[t] = p
    return sorted(out.items())


def _a_k_contig(spec: GemmSpec) -> bool:
    """A(m, k) is contiguous along k."""
    return (not spec.trans_a) or spec.lda_ == 1


def _prepacked_dot(spec: GemmSpec) -> bool:
    """A prepacked B is stored as B^T ([N][K]) for dot-product kernels (tiny N)."""
    return spec.b_prepacked and spec.N <= 8 and _a_k_contig(spec)


def _dot_b_source(spec: GemmSpec) -> str | None:
    """How a dot-product kernel (A rows and B columns contiguous in K) gets B^T:
    'prepacked' (prepack_b stored it), 'rows' (B is [N,K] or a vector), 'pack'
    (a small B is transposed into the workspace), None (not possible)."""
    if not _a_k_contig(spec):
        return None
    if spec.b_prepacked:
        return "prepacked" if _prepacked_dot(spec) else None
    if spec.trans_b or (spec.N == 1 and spec.ldb_ == 1):
        return "rows"
    return "pack" if spec.N <= 16 else None


def _dot_able(spec: GemmSpec) -> bool:
    return _dot_b_source(spec) is not None


def _grid_nr(NR: int, b_mode: str) -> int:
    """The column granule of blocks: whole 32-column B panels (a 16-column tile is half
    of one)."""
    return NR if b_mode == "dot" else max(NR, PANEL)


def _choose_grid(spec: GemmSpec, MR: int, NR: int, pack_a: bool, pack_b: bool,
                 tun: dict) -> tuple[int, int, int, int]:
    """(mt, nt, MB, NB): the tile grid of the best modelled rows-only or columns-only
    split of ``spec``'s C for an MR x NR micro-kernel."""
    M, N = spec.M, spec.N
    P, Q = _cdiv(M, MR), _cdiv(N, NR)
    cands = []
    max_tiles = max(512, spec.batch)
    for mt, p in _distinct_splits(P):
        if spec.batch * mt <= max_tiles:
            cands.append((mt, 1, p * MR, _rup(N, NR)))
    for nt, q in _distinct_splits(Q):
        if nt > 1 and spec.batch * nt <= max_tiles:
            cands.append((1, nt, _rup(M, MR), q * NR))
    if spec.batch >= 32:  # batch items alone balance the cores
        cands = [(1, 1, _rup(M, MR), _rup(N, NR))]
    if "grid" in tun:
        mt_, nt_ = tun["grid"]
        cands = [(mt_, nt_, MR * _cdiv(P, mt_), NR * _cdiv(Q, nt_))]
    scored = []
    for mt, nt, MB, NB in cands:
        mt = _cdiv(M, MB)
        nt = _cdiv(N, NB)
        c = (
            _grid_cost(spec, MR, NR, MB, NB, mt, nt, pack_a, pack_b)
            if len(cands) > 1
            else (0.0, 0.0)
        )
        scored.append((c, mt, nt, MB, NB))
    # of the grids that balance the products within 1% and do not read the operands
    # again more than 10% beyond the fewest reads (chunks of 6-row blocks each reading
    # all of B), the one nearest 32 tiles: the cores' chunks shrink as the tiles run out
    best = min(s[0][0] for s in scored)
    best_total = min(s[0][1] for s in scored)
    ok = ([s for s in scored if s[0][0] <= best * 1.01 and s[0][1] <= best_total * 1.10]
          or [s for s in scored if s[0][1] <= best_total * 1.01])
    target = 32
    _, mt, nt, MB, NB = min(
        ok, key=lambda s: (abs(math.log2(spec.batch * s[1] * s[2] / target)), s[0][1])
    )
    return mt, nt, MB, NB


@lru_cache(maxsize=256)
def _plan(spec: GemmSpec, tuning: tuple = (), isa: str = "avx512", small: bool = False,
          dpbf16: bool = False, mid: bool = False) -> GemmPlan:
    """The plan of ``spec``; ``small``: of the few-rows variant of a dynamic kernel whose
    B is not prepacked (B read in place, see GemmPlan.alt); ``mid``: of the mid-rows
    variant of a dynamic kernel of a prepacked float32 B (the tile that is not wide)."""
    tun = dict(tuning)
    M, N, K = spec.M, spec.N, spec.K
    if small:
        M = SMALL_M

    # B access mode
    if _prepacked_dot(spec):
        b_mode = "dot"
    elif spec.b_prepacked:
        b_mode = "prepacked"
    elif _dot_able(spec) and (N <= 8 or (_dot_b_source(spec) == "rows"
                                         and (small or (M <= 8 and not spec.dyn)))):
        # few rows or columns: dot products along K
        b_mode = "dot"
    elif spec.trans_b:
        b_mode = "pack"
    else:
        # (a kernel for any M packs B, and has a variant for few rows: GemmPlan.alt)
        b_mode = "direct" if M <= SMALL_M and (small or not spec.dyn) else "pack"
    b_mode = tun.get("b_mode", b_mode) if not small else b_mode
    if b_mode == "direct" and spec.trans_b:
        raise ValueError("b_mode 'direct' needs trans_b=False")
    if b_mode == "dot" and not _dot_able(spec):
        raise ValueError("b_mode 'dot' needs A rows and B columns contiguous in K")
    if spec.b_prepacked and b_mode != ("dot" if _prepacked_dot(spec) else "prepacked"):
        raise ValueError("the B mode of a prepacked B is fixed by prepack_b's layout")

    # micro-kernel shape (an MR x NR grid of accumulators fits the vector registers)
    avx2 = isa == "avx2"
    if b_mode == "dot":
        if N <= 8 and (M > 8 or (spec.dyn and not small)):
            NR = N  # C columns (B rows) per micro-tile
            MR = max(1, 6 // NR) if avx2 else min(8, max(2, 16 // NR))
        elif avx2:
            MR = min(M, 3)
            NR = 6 // MR
        else:
            MR = min(M, 4)
            NR = {1: 16, 2: 8}.get(MR, 4)
        MR = tun.get("MR", MR)
        NR = tun.get("NR", NR)
        assert 1 <= NR <= 16 and 1 <= MR
        NV = 1
    else:
        many = 6 if avx2 else gemm_micro_rows()
        if not avx2 and not spec.dyn:
            many = _rows_padding_least(M, many)
        MR = many if M > (6 if avx2 else 8) or spec.dyn else M
        NV = _nv_for(MR, N, b_mode, isa)
        if (not avx2 and (M > 8 or spec.dyn) and b_mode in ("prepacked", "pack")
                and spec.compute == "f32" and not mid and _wide_pays(M, N, MR, spec.dyn)):
            MR, NV = WIDE_MR, 4
        MR = tun.get("MR", MR)
        NV = tun.get("NV", NV)
        # (a one-vector tile is half a 32-column B panel, see _Gen.b_panel)
        assert (NV % 2 == 0 or NV == 1) and 1 <= MR <= 12
        NR = 16 * NV
    row_panels = _cdiv(M, MR)

    # A packing: pays off when A is reused over many column panels
    # (measured: rows of a row-major A read in place are as fast as packed)
    pack_a = b_mode != "dot" and tun.get("pack_a", spec.trans_a and M > 8 and N > 256)
    # vdpbf16ps: bf16 products with B panels of k-pairs (packed or prepacked B; few rows
    # read in place or dot products widen to fp32: memory-bound, bf16 halves the bytes)
    dp = (dpbf16 and isa == "avx512" and spec.compute == "bf16"
          and b_mode in ("prepacked", "pack"))
    # (a dynamic kernel of a prepacked B: float32 panels for many rows, and a few-rows
    # variant that reads the narrow panels, chosen per call: GemmPlan.alt)
    f32p = (not dp and spec.compute != "f32" and b_mode != "dot" and
            (b_mode == "pack" or (b_mode == "prepacked" and (
                not small if spec.dyn else M > SMALL_M))))
    # (a float32 A that a narrow product reads is rounded once per block, not per load)
    cvt_a = ((dp and (pack_a or spec.trans_a or spec.a_type != "bfloat16"))
             or (not dp and not pack_a and b_mode in ("prepacked", "pack")
                 and (f32p or (spec.compute != "f32" and spec.a_type == "float32"))))
    if dp:
        pack_a = False
    # a kernel for any M: full MR-row panels, then the last rows by a strip of
    # micro-kernels of exactly that many rows (see _Gen.block)
    # (the mid-rows variant runs whole row panels only, see gemm_dims)
    strips = spec.dyn and b_mode != "dot" and not mid

    # K blocking. Each K block after the first reloads the partial sums of the C
    # tiles (from L3 or memory, a stall at every micro-kernel entry), which costs
    # more than B micro-panels streamed from L2 instead of L1: KC is large
    # (measured, 1024^3: KC 171 -> 1024 = +10%; 2048^3: +15%); the N blocking keeps
    # the KC x NC block of B in L2. With B read in place few rows at a time make
    # the reads of B row-sequential; a packed A block is kept small.
    if b_mode == "dot":
        KC = K
    else:
        if b_mode == "direct":
            # B streamed from memory: few rows at a time keep the reads sequential
            KC = 16 if 4 * K * N > (1 << 20) else 128
        elif row_panels <= 1 and not pack_a and b_mode != "pack" and not spec.dyn:
            KC = min(K, 4096 if M == 1 else FEW_ROWS_KC)
        elif pack_a:
            KC = 192
        elif b_mode == "prepacked" and not spec.dyn and M <= MID_ROWS:
            KC = mid_rows_kc(K)
        else:
            KC = KC_MAX // 2 if spec.dyn and b_mode == "pack" else KC_MAX
        KC = tun.get("KC", KC)
        if cvt_a and not dp:
            KC = min(KC, 1024)  # (the float32 A block stays in L2)
        if spec.c_type != "float32":
            KC = K  # the partial sums of K blocks live in C: only a float32 C holds them
        KC = _cdiv(K, _cdiv(K, KC))  # balanced K blocks
        if dp:
            KC = _rup(KC, 2)  # whole k-pairs
    mc0 = (48 if cvt_a and not dp else 96 if cvt_a else 144) // MR * MR or MR
    MC = tun.get("MC", mc0 if spec.dyn else min(_rup(M, MR), mc0))
    if MC % MR:
        MC = _rup(MC, MR)

    # the tile grid (of a dynamic kernel: per call, by gemm_dims)
    mt = nt = MB = NB = 0
    if not spec.dyn:
        mt, nt, MB, NB = _choose_grid(spec, MR, _grid_nr(NR, b_mode), pack_a,
                                      b_mode == "pack", tun)

    # N blocking: the KC x NC block of B stays in L2 next to the MC x KC block of A
    # while the row panels of A stream past it (1024^3: +10% over NC = N)
    # (in whole B panels that fit the block: AVX2's 16-column tile reads half panels, and
    # a block rounded up to the next panel overflowed it: 1024^3 NC 64 -> 32 x0.97-0.99,
    # as gemm_dims chooses for a dynamic kernel)
    NC = _nc_for(KC, _grid_nr(NR, b_mode)) if b_mode != "dot" else 4096
    if dp:
        NC *= 2  # (bf16 panels: half the bytes)
    if cvt_a:
        # A converted per block is converted once per N block: few, large N blocks
        # (1024^3 without vdpbf16ps: NC 32 -> 128: 101 -> 137 GFLOP/s, fp32 140)
        NC = max(NC, 128)
    if strips and (b_mode == "pack" or f32p):
        # a multiple of every strip's width (see _Gen.strips); the workspace holds it
        NC = STRIP_NC
    NC = tun.get("NC", min(_rup(N, NR), NC))
    NC = _rup(NC, _grid_nr(NR, b_mode))

    ws_a = 0
    wsz = 4 if f32p else _esize(COMPUTE[spec.compute])  # bytes of a packed element
    a_bytes = _rup(MC, MR) * KC * wsz if pack_a else 0
    if cvt_a:
        a_bytes = _rup(MC, MR) * _rup(KC, 2) * (2 if dp else 4)
    ws_b = _rup(a_bytes, 64)
    b_bytes = _rup(NC, PANEL) * _rup(KC, 2) * wsz if b_mode == "pack" or f32p else 0
    if b_mode == "dot" and _dot_b_source(spec) == "pack":
        b_bytes = N * K * wsz
    ws_bytes = _rup(ws_b + b_bytes, 64)
    alt, alt_mid = None, False
    if spec.dyn and not small and (b_mode == "pack" or f32p) and "b_mode" not in tun:
        # B packed per block costs as much as the product when the rows are few:
        # the kernel also holds the plan that reads B in place, chosen per call
        alt = _plan(spec, tuning, isa, small=True, dpbf16=dpbf16)
        ws_bytes = max(ws_bytes, alt.ws_bytes)
    elif (spec.dyn and not mid and b_mode == "prepacked" and spec.compute == "f32"
          and (MR, NV) == (WIDE_MR, 4) and K >= MID_ROWS_8_K
          and not {"MR", "NV"} & tun.keys()):
        alt, alt_mid = _plan(spec, tuning, isa, mid=True, dpbf16=dpbf16), True
        ws_bytes = max(ws_bytes, alt.ws_bytes)
    rt_block = (spec.dyn and b_mode == "prepacked" and not pack_a and not cvt_a
                and spec.c_type == "float32")
    # big tiles: 2-4 k steps an iteration, by the FMA pipes and accumulators
    # (gemm_k_unroll)
    unroll = tun.get("unroll", _small_tile_unroll(MR, NV, isa) if MR * NV <= 8 else
                     gemm_k_unroll(accumulators=MR * NV) if isa == "avx512" else 1)
    # (the stream rides on an unrolled k loop, see pf_next.)
    # AVX-512's full panels, and AVX2's half panels (NV 1, its 6 x 16 tile, unrolled 4x):
    # Zen 4 under CANNC_ISA=avx2, 1 core, B cycled through 12 copies, in-process A/B:
    # 128 x 3072 x 768 x0.92, 128 x 768 x 3072 x0.93, 128 x 2304 x 768 x0.93,
    # 128 x 768 x 768 x0.97, 128 x 384 x 1536 x0.98
    pf_b = unroll > 1 and tun.get(
        "pf_b", b_mode == "prepacked" and not dp and not f32p
        and (NV >= 2 if isa == "avx512" else NV == 1) and spec.compute == "f32"
        and _prepacked_batch(spec) * _cdiv(N, PANEL) * PANEL * K * 4 >= PF_B_MIN_BYTES)
    return GemmPlan(
        MR=MR,
        NV=NV,
        NR=NR,
        KC=KC,
        MC=MC,
        NC=NC,
        pack_a=pack_a,
        b_mode=b_mode,
        unroll=unroll,
        prefetch_c=tun.get("prefetch_c", True),
        strips=strips,
        isa=isa,
        mt=mt,
        nt=nt,
        MB=MB,
        NB=NB,
        ws_a=ws_a,
        ws_b=ws_b,
        ws_bytes=ws_bytes,
        alt=alt,
        alt_mid=alt_mid,
        dp=dp,
        cvt_a=cvt_a,
        f32_panels=f32p,
        rt_block=rt_block,
        pf_b=pf_b,
        pf_div=tun.get("pf_div", 2),
    )


def _tuning_key(tuning):
    return tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (tuning or {}).items())
    )


def gemm_plan(spec: GemmSpec, tuning: dict | None = None) -> GemmPlan:
    """The blocking/tiling decisions for ``spec`` (``tuning`` overrides them) on this
    host's vector ISA."""
    return _plan(spec, _tuning_key(tuning), host_isa(),
                 dpbf16=spec.compute == "bf16" and use_dpbf16())


def gemm_num_tiles(spec: GemmSpec, tuning: dict | None = None) -> int:
    return gemm_plan(spec, tuning).num_tiles(spec.batch)


def gemm_workspace_bytes(spec: GemmSpec, tuning: dict | None = None) -> int:
    return gemm_plan(spec, tuning).ws_bytes


# ---------------------------------------------------------------------------
# shape-polymorphic kernels: M and the batch count at run time
# ---------------------------------------------------------------------------

# the runtime dims of a dynamic kernel, in this order, from its ``dims_slot``
GEMM_DIMS = ("M", "batch", "mt", "nt", "MB", "NB", "KC", "NC", "variant")


def _alt_variant(p: GemmPlan) -> int:
    """The runtime 'variant' that runs p.alt."""
    return VARIANT_MID_ROWS if p.alt_mid else VARIANT_FEW_ROWS


def variant_plan(p: GemmPlan, variant: int) -> GemmPlan:
    """The plan a dynamic kernel of plan p runs at the runtime dim 'variant'."""
    return p.alt if p.alt is not None and variant == _alt_variant(p) else p


def _runtime_blocking(p: GemmPlan) -> bool:
    """A dynamic kernel of a prepacked B takes KC and NC at run time (they decide no
    workspace, and they differ between few rows and many: see gemm_dims); not with A
    converted per block (its workspace) or a narrow C (one K block)."""
    return p.rt_block


def dynamic_able(spec: GemmSpec) -> str | None:
    """Why ``spec`` cannot become a kernel for any M and batch count (None: it can)."""
    if spec.trans_a or spec.lda is not None:
        return "A stored transposed (its leading dimension is M)"
    if spec.ldc is not None or spec.ldb is not None:
        return "explicit leading dimensions"
    if spec.batch > 1 and spec.c_batch_stride not in (0, spec.M * spec.N):
        return "a C batch stride other than M*N"
    if spec.a_batch_stride not in (0, spec.M * spec.K):
        return "an A batch stride other than M*K"
    return None


def dynamic_spec(spec: GemmSpec, batched: bool | None = None) -> GemmSpec:
    """The canonical spec of the kernel that computes ``spec`` for any M and batch
    count (same N, K, layout of B, bias, alpha, beta): what its code depends on,
    so equal for every M. ``batched``: the kernel loops over batch items (default:
    ``spec.batch > 1``; a batch of one is then a valid call). A's batch stride is
    M*K when ``spec.a_batch_stride`` (read as a flag), C's M*N."""
    why = dynamic_able(spec)
    if why:
        raise ValueError(f"no dynamic GEMM for this spec: {why}")
    batched = spec.batch > 1 if batched is None else batched
    return dataclasses.replace(
        spec, M=1, batch=2 if batched else 1, c_batch_stride=0,
        a_batch_stride=1 if batched and spec.a_batch_stride else 0,
        b_batch_stride=spec.b_batch_stride if batched else 0, dyn=True)


def gemm_dims(spec: GemmSpec, M: int, batch: int = 1,
              tuning: dict | None = None) -> tuple[tuple[int, ...], int]:
    """The runtime dims (``GEMM_DIMS``) and the number of tiles of the dynamic kernel
    ``spec`` (from `dynamic_spec`) for M rows and ``batch`` items: the host tiling
    function. The grid is the one the static planner would choose for the micro-tile
    that runs. The dims are valid for the kernel of ``spec`` with B prepacked or not
    (a tiling function does not know whether B is a constant): column blocks of whole
    B panels, KC and NC (read by a kernel of a prepacked B only) chosen as its static
    plan would, and the variant (VARIANT_*: few rows, mid rows, or the main plan; a
    kernel without that variant runs its main plan)."""
    assert spec.dyn, "gemm_dims is for dynamic specs"
    if spec.batch == 1 and batch != 1:
        raise ValueError("this dynamic GEMM is not batched")
    # (its one caller in a compile, the GEMM tiling function, keeps its answers:
    # codegen.lower.contraction._gemm_tiling)
    tun = dict(_tuning_key(tuning))
    p0 = gemm_plan(spec, tun)
    # (the mid-rows variant has no strips for the last rows of a panel: their
    # micro-kernels, one per row count, cost more compile time than the variant itself,
    # BERT-base's cold compile 1.85 -> 2.55 s with them, 2.09 s without. So it runs
    # multiples of its rows only: sequence lengths such as 64, 128, 256)
    mid = p0.alt_mid and FEW_ROWS < M <= MID_ROWS_8 and M % p0.alt.MR == 0
    variant = (VARIANT_FEW_ROWS if M <= SMALL_M else VARIANT_MID_ROWS if mid else VARIANT_MAIN)
    p = variant_plan(p0, variant)
    full = dataclasses.replace(
        spec, M=M, batch=batch, dyn=False, c_batch_stride=0,
        a_batch_stride=M * spec.K if spec.a_batch_stride and batch > 1 else 0,
        b_batch_stride=spec.b_batch_stride if batch > 1 else 0)

    def strip_width(q: GemmPlan, b_mode: str) -> tuple[int, int]:
        rows = M % q.MR if M > q.MR else M     # of the strip kernel that runs (if any)
        return rows, (16 * _nv_for(rows, spec.N, b_mode, q.isa) if q.strips and rows
                      else q.NR)

    MR, NR = p.MR, p.NR
    rows, w = strip_width(p, p.b_mode)
    if p.strips and M < p.MR:  # only the strip kernel of M rows runs
        MR, NR = M, w
    elif p.strips and rows and M < 16 * p.MR:
        # few rows: column blocks of whole strip micro-tiles too
        NR = math.lcm(p.NR, w)
    NR = _grid_nr(NR, p0.b_mode)
    mt, nt, MB, NB = _choose_grid(full, MR, NR, p.pack_a, p.b_mode == "pack", tun)
    if mt > 1 and M <= FEW_ROWS and "grid" not in tun:
        # a few rows: split the columns, not the rows. A tile of the leftover rows
        # would stream all of B once more (an MLP at batch 8: 2 x 4 MiB of B per call)
        nt_ = min(_cdiv(spec.N, NR), 32)
        mt, nt, MB, NB = _choose_grid(full, MR, NR, p.pack_a, p.b_mode == "pack",
                                      {**tun, "grid": (1, nt_)})
    # KC and NC as the plan of a prepacked B chooses them
    K = spec.K
    KC = tun.get("KC", min(K, 4096) if M == 1 else
                 min(K, FEW_ROWS_KC) if M <= FEW_ROWS else
                 mid_rows_kc(K) if M <= MID_ROWS else KC_MAX)
    KC = _cdiv(K, _cdiv(K, KC))
    if spec.compute == "bf16":  # whole k-pairs (a vdpbf16ps kernel, B prepacked or not)
        KC = _rup(KC, 2)
    # (a multiple of the remainder rows' strip tile too, unless full row panels run and
    # that overflows the L2 block of B: 6 x 64 tiles at M = 128 leave 2 rows, whose
    # 96-wide tile made NC 192 at K = 3072, a 1.2 MiB block of B that with A's
    # overflowed a 2 MiB L2: 6% slower alone, 25% in a BERT layer)
    q = p if p0.alt_mid else p0    # (the plan that reads the prepacked B)
    _, wp = strip_width(q, "prepacked")
    gnr = _grid_nr(q.NR, q.b_mode)
    step = math.lcm(gnr, wp)
    NC = max(step, _rup(_nc_for(KC, wp), _grid_nr(wp, q.b_mode)) // step * step)
    budget = _nc_for(KC, gnr)
    if M >= q.MR and NC > budget:
        NC = budget // step * step if budget >= step else budget
    NC = tun.get("NC", NC)
    return (M, batch, mt, nt, MB, NB, KC, NC, variant), batch * mt * nt


# ---------------------------------------------------------------------------
# prepacking of a constant B
# ---------------------------------------------------------------------------


def _prepacked_batch(spec: GemmSpec) -> int:
    return spec.batch if spec.b_batch_stride else 1


def _prepacked_batch_stride(spec: GemmSpec, dp: bool | None = None) -> int:
    if _prepacked_dot(spec):
        return spec.N * spec.K
    if _pair_layout(spec, dp):
        return _cdiv(spec.N, PANEL) * _rup(spec.K, 2) * PANEL
    return _cdiv(spec.N, PANEL) * spec.K * PANEL


def prepacked_b_size(spec: GemmSpec) -> int:
    """Number of elements (of the compute precision's type, ``COMPUTE[spec.compute]``)
    of ``prepack_b(spec, B)``."""
    return _prepacked_batch(spec) * _prepacked_batch_stride(spec)


def prepack_b(spec: GemmSpec, b: np.ndarray) -> np.ndarray:
    """Pack a constant B into ``[batch_b][ceil(N/32)][K][32]`` (zero padded),
    or, when N <= 8 and A rows are contiguous in K (dot-product kernel), into
    ``[batch_b][N][K]`` (B transposed).

    ``b`` is B as the kernel would read it unpacked: an array of shape
    ``[K,N]`` (``[N,K]`` when ``trans_b``), or ``[batch,K,N]``/``[batch,N,K]``
    when ``spec.b_batch_stride != 0``, or a flat array addressed with
    ``ldb``/``b_batch_stride``. ``batch_b`` is 1 when ``b_batch_stride == 0``.
    Returns a flat array of ``prepacked_b_size(spec)`` elements of the compute
    precision's type (float32, or B rounded to bfloat16 / float16). With bf16 products
    on a CPU with vdpbf16ps the panels hold k-pairs: ``[batch_b][ceil(N/32)][ceil(K/2)]
    [32][2]`` (B[k,n], B[k+1,n] side by side; an odd K padded with a zero row).
    """
    K, N = spec.K, spec.N
    nb = _prepacked_batch(spec)
    out_t = np_elem(COMPUTE[spec.compute])
    b = np.asarray(b)
    if b.dtype != np.float32:
        b = b.astype(np.float32)
    rows, cols = (N, K) if spec.trans_b else (K, N)
    if b.ndim == 1:
        ld = spec.ldb_
        bs = spec.b_batch_stride
        mats = []
        for i in range(nb):
            base = i * bs
            idx = base + np.arange(rows)[:, None] * ld + np.arange(cols)[None, :]
            mats.append(b[idx])
        mats = np.stack(mats)
    elif b.ndim == 2:
        if nb != 1:
            mats = np.broadcast_to(b, (nb,) + b.shape)
        else:
            mats = b[None]
    elif b.ndim == 3:
        mats = b
    else:
        raise ValueError("prepack_b: B must be 1-D, 2-D or 3-D")
    if mats.shape != (nb, rows, cols):
        raise ValueError(
            f"prepack_b: B shape {b.shape} does not match spec "
            f"(expected {(nb, rows, cols)} or {(rows, cols)})"
        )
    # The panels are written once, straight into the memory the device will read
    # (device_ready_empty: the WeightPool adopts it rather than copying it), converted
    # to the compute type on the way: BERT-base packs 340 MB of B, and each extra
    # pass over it (a zeroed buffer, a contiguous copy, an astype) cost ~0.1 s.
    if _prepacked_dot(spec):
        bt = mats if spec.trans_b else mats.transpose(0, 2, 1)  # -> [nb, N, K]
        out = device_ready_empty(nb * N * K, out_t)
        out.reshape(nb, N, K)[...] = bt
        return out
    if spec.trans_b:
        mats = mats.transpose(0, 2, 1)  # -> [nb, K, N]
    npan = _cdiv(N, PANEL)
    full, tail = divmod(N, PANEL)
    if _pair_layout(spec):
        # [nb][npan][kp][PANEL][2]: B[2kk + t, p*PANEL + j] at [p][kk][j][t]
        kp, odd = divmod(K, 2)
        out = device_ready_empty(nb * npan * (kp + odd) * PANEL * 2, out_t)
        o = out.reshape(nb, npan, kp + odd, PANEL, 2)
        for p in range(npan):
            w = PANEL if p < full else tail
            cols = mats[:, :, p * PANEL:p * PANEL + w]
            o[:, p, :kp, :w, :] = cols[:, :2 * kp].reshape(nb, kp, 2, w).transpose(0, 1, 3, 2)
            if odd:
                o[:, p, kp, :w, 0] = cols[:, K - 1]
                o[:, p, kp, :w, 1] = 0
            o[:, p, :, w:, :] = 0
        return out
    # [nb][npan][K][PANEL]: B[k, p*PANEL + j] at [p][k][j]
    out = device_ready_empty(nb * npan * K * PANEL, out_t)
    o = out.reshape(nb, npan, K, PANEL)
    if full:
        o[:, :full] = mats[:, :, :full * PANEL].reshape(nb, K, full, PANEL).transpose(0, 2, 1, 3)
    if tail:
        o[:, full, :, :tail] = mats[:, :, full * PANEL:]
        o[:, full, :, tail:] = 0
    return out


# ---------------------------------------------------------------------------
# code generation
# ---------------------------------------------------------------------------


class _Gen(VecBuilder):
    def __init__(self, module, fn, spec: GemmSpec, plan: GemmPlan, epilogue,
                 dims_slot: int | None = None):
        super().__init__(module, fn)
        self.s = spec
        self.epilogue = epilogue
        self.dims_slot = dims_slot
        self.iota = ir.Constant(VI64, list(range(16)))
        # element types: storage of A, B, bias, C and of the packed panels (wt)
        self.wt = COMPUTE[spec.compute]
        self.ta, self.tb, self.tc = (_ety(t) for t in (spec.a_type, spec.b_type, spec.c_type))
        self.tw = _ety(self.wt)
        self.tbias = _ety(spec.bias_type)
        self.c_ld = spec.ldc_   # C's row stride (an i64 value in a shared strip kernel)
        self.use_plan(plan)
        self._n = 0

    def use_plan(self, plan: GemmPlan) -> None:
        """Generate the code of ``plan`` (the kernel's, or its few-rows variant)."""
        spec = self.s
        self.p = plan
        # 'dot' mode: elements between consecutive B columns (each contiguous in K)
        self.dot_src = _dot_b_source(spec) if plan.b_mode == "dot" else None
        if self.dot_src in ("prepacked", "pack"):
            self.dot_bns = spec.K
        elif spec.trans_b:
            self.dot_bns = spec.ldb_
        else:  # N == 1, ldb == 1
            self.dot_bns = 0
        # the type the micro-kernels read A and B in (packed panels: the compute type),
        # and whether a float32 operand read in place is rounded to the compute precision
        packed_b = plan.b_mode in ("prepacked", "pack") or self.dot_src in ("prepacked",
                                                                             "pack")
        # the packed panels' type; the type of the A block convert_a writes
        self.pw = "float32" if plan.f32_panels else self.wt
        self.tpw = _ety(self.pw)
        self.cvt_t = "bfloat16" if plan.dp else "float32"
        self.b_src = ("float32" if plan.f32_panels else self.wt if packed_b
                      else spec.b_type)
        self.a_src = (self.cvt_t if plan.cvt_a else self.pw if plan.pack_a
                      else spec.a_type)
        narrow = spec.compute != "f32"
        # a float32 operand read in place is rounded to the compute precision on load
        self.rnd_b = self.b_src == "float32" and narrow and not plan.f32_panels
        self.rnd_a = self.a_src == "float32" and narrow and not (plan.pack_a or plan.cvt_a)
        # ... and when it is packed into float32
        self.rnd_pack_a = spec.a_type == "float32" and narrow
        self.rnd_pack_b = spec.b_type == "float32" and narrow and self.pw == "float32"

    # -- element conversions -------------------------------------------------
    def widen(self, x, t):
        """i16 bits (or <16 x i16>) of type t -> float (exact)."""
        b = self.b
        if t == "bfloat16":
            return bf16_bits_to_f32(b, x)
        vec = isinstance(x.type, ir.VectorType)
        return b.fpext(b.bitcast(x, V16H if vec else ir.HalfType()), VF if vec else F32)

    def narrow(self, v, t):
        """float (or <16 x float>) -> the i16 bits of type t, rounding to nearest even."""
        b = self.b
        vec = isinstance(v.type, ir.VectorType)
        if t == "bfloat16":
            if vec and host_dpbf16():   # vcvtneps2bf16
                return b.bitcast(b.fptrunc(v, V16BF), V16I16)
            return f32_to_bf16_bits(b, v)
        return b.bitcast(b.fptrunc(v, V16H if vec else ir.HalfType()), V16I16 if vec else I16)

    def round_c(self, v):
        """v rounded to the compute precision (kept as float)."""
        return self.widen(self.narrow(v, self.wt), self.wt)

    def ld16(self, ptr, t, mask=None, rnd=False):
        """16 elements of type t at ptr as <16 x float> (masked-off lanes: 0); rnd: a
        float32 rounded to the compute precision."""
        b = self.b
        if t == "float32":
            v = self.load_v(ptr, mask)
            return self.round_c(v) if rnd else v
        if mask is None:
            x = b.load(ptr, typ=V16I16, align=2)
        else:
            x = masked_load(b, ptr, mask, ir.Constant(V16I16, None), 2)
        return self.widen(x, t)

    def st16(self, v, ptr, t, mask=None):
        """Store <16 x float> v as 16 elements of type t (converted on store)."""
        if t == "float32":
            return self.store_v(v, ptr, mask)
        x = self.narrow(v, t)
        if mask is None:
            self.b.store(x, ptr, align=2)
        else:
            masked_store(self.b, x, ptr, mask, 2)

    def ld1(self, ptr, t, rnd=False):
        """One element of type t at ptr as a float."""
        if t == "float32":
            x = self.b.load(ptr, typ=F32, align=4)
            return self.round_c(x) if rnd else x
        return self.widen(self.b.load(ptr, typ=I16, align=2), t)

    def st1(self, v, ptr, t):
        if t == "float32":
            self.b.store(v, ptr, align=4)
        else:
            self.b.store(self.narrow(v, t), ptr, align=2)

    def gather16(self, ptrs, t, mask):
        """Masked gather of 16 elements of type t as <16 x float>."""
        if t == "float32":
            return self.gather(ptrs, mask)
        f = self.intr("llvm.masked.gather.v16i16.v16p0", V16I16, [VPTR, I32, VM, V16I16])
        return self.widen(self.b.call(f, [ptrs, i32(2), mask, ir.Constant(V16I16, None)]), t)

    # -- small utilities ---------------------------------------------------
    def gep(self, ptr, idx, ty=F32):
        """&ptr[idx]; unlike VecBuilder.gep a GEP even for a constant 0: without
        the IR optimiser (speed level 0: these tests, gemm_bench's default) the
        micro-kernels' loads select better addressing from it."""
        return self.b.gep(ptr, [i64(idx) if isinstance(idx, int) else idx], source_etype=ty)

    def lane_mask(self, limit_splat, first_lane: int):
        """lanes with first_lane + i < limit (an i64 splat)."""
        lanes = ir.Constant(VI64, list(range(first_lane, first_lane + 16)))
        return self.b.icmp_signed("<", lanes, limit_splat)

    def dims(self, args):
        """M, batch, mt, nt, MB, NB, KC, NC, variant: i64 values read from the argument
        array (a dynamic kernel, see GEMM_DIMS) or constants of the spec and plan."""
        s, p, b = self.s, self.p, self.b
        if not s.dyn:
            return [i64(v) for v in (s.M, s.batch, p.mt, p.nt, p.MB, p.NB, p.KC, p.NC, 0)]
        assert self.dims_slot is not None, "a dynamic GEMM needs dims_slot"
        return [
            b.load(b.gep(args, [i64(self.dims_slot + i)], source_etype=I64), typ=I64, align=8)
            for i in range(len(GEMM_DIMS))
        ]

    # -- kernel ------------------------------------------------------------
    def emit(self):
        s, p, b = self.s, self.p, self.b
        args, tb, te, ws = self.fn.args
        self.A = self.arg(args, 0)
        self.B = self.arg(args, 1)
        self.bias = self.arg(args, 2) if s.bias else None
        self.C = self.arg(args, 3 if s.bias else 2)
        ws_ptrs = {id(q): (self.gep(ws, q.ws_a, I8), self.gep(ws, q.ws_b, I8))
                   for q in (p, p.alt) if q is not None}
        # (the batch count only bounds the tile range)
        self.M, _, mt, nt, MB, NB, kc_dim, nc_dim, variant = self.dims(args)

        def use(q):
            self.use_plan(q)
            self.ws_a, self.ws_b = ws_ptrs[id(q)]
            # KC, NC: the plan's, or (a dynamic kernel that can) the host's
            rt = s.dyn and _runtime_blocking(q)
            self.KC = kc_dim if rt else i64(q.KC)
            self.NC = nc_dim if rt else i64(q.NC)

        use(p)
        self.Mm1 = b.sub(self.M, i64(1))
        # batch strides of A and C: M*K and M*N in a dynamic kernel
        if s.dyn:
            self.a_bs = b.mul(self.M, i64(s.K)) if s.a_batch_stride else None
            self.c_bs = b.mul(self.M, i64(s.ldc_)) if s.batch > 1 else None
        else:
            self.a_bs = i64(s.a_batch_stride) if s.a_batch_stride else None
            self.c_bs = i64(s.c_batch_stride_) if s.c_batch_stride_ else None

        per_b = b.mul(mt, nt) if s.dyn else i64(p.mt * p.nt)
        # a tile loop whose step (the tiles one block covers) is computed in the body
        tiles = self.begin_loop(tb, te, "tiles", iv_name="t", unique=False)
        t = tiles.i
        bi = b.sdiv(t, per_b) if s.batch > 1 else i64(0)
        r = b.srem(t, per_b) if s.batch > 1 else t
        left = b.sub(te, t)
        N = i64(s.N)
        if s.dyn:
            # one row block: consecutive column blocks merge (as mt == 1 below);
            # else consecutive row blocks of one column block
            one_row = b.icmp_signed("==", mt, i64(1))
            jt = b.sdiv(r, mt)
            it0 = b.srem(r, mt)
            it1 = self.smin(b.add(it0, left), mt)
            jt1 = self.smin(b.add(jt, left), nt)
            count = b.select(one_row, b.sub(jt1, jt), b.sub(it1, it0))
            m_lo = b.mul(it0, MB)
            m_hi = self.smin(b.mul(it1, MB), self.M)
            n_lo = b.mul(jt, NB)
            n_end = b.select(one_row, b.mul(jt1, NB), b.add(n_lo, NB))
            n_hi = self.smin(n_end, N)
        elif p.mt == 1:
            jt0 = r
            jt1 = self.smin(b.add(jt0, left), i64(p.nt))
            count = b.sub(jt1, jt0)
            m_lo, m_hi = i64(0), i64(s.M)
            n_lo = b.mul(jt0, i64(p.NB))
            n_hi = self.smin(b.mul(jt1, i64(p.NB)), N)
        else:
            jt = b.sdiv(r, i64(p.mt)) if p.nt > 1 else i64(0)
            it0 = b.srem(r, i64(p.mt)) if p.nt > 1 else r
            it1 = self.smin(b.add(it0, left), i64(p.mt))
            count = b.sub(it1, it0)
            m_lo = b.mul(it0, i64(p.MB))
            m_hi = self.smin(b.mul(it1, i64(p.MB)), i64(s.M))
            if p.nt > 1:
                n_lo = b.mul(jt, i64(p.NB))
                n_hi = self.smin(b.add(n_lo, i64(p.NB)), N)
            else:
                n_lo, n_hi = i64(0), N
        if p.alt is None:
            self.block(bi, m_lo, m_hi, n_lo, n_hi)
        else:   # the variant gemm_dims chose for these shapes
            other = b.append_basic_block(self.name("mid_rows" if p.alt_mid else "few_rows"))
            main = b.append_basic_block(self.name("main_plan"))
            done = b.append_basic_block(self.name("variant.x"))
            b.cbranch(b.icmp_signed("==", variant, i64(_alt_variant(p))), other, main)
            for bb, q in ((other, p.alt), (main, p)):
                b.position_at_end(bb)
                use(q)
                self.block(bi, m_lo, m_hi, n_lo, n_hi)
                b.branch(done)
            b.position_at_end(done)
            use(p)
        self.end_loop(tiles, count)
        b.ret_void()

    def b_panel(self, B_b, jc, jr, pc, kc):
        """The B micro-panel of columns jc + jr..: (base pointer, stride between its
        32-column panels or None)."""
        s, p, b = self.s, self.p, self.b
        n0 = b.add(jc, jr)
        if p.dp:
            # k-pair panels: 64 bf16 per pair (32 columns x 2); a half panel is 32 on
            if p.b_mode == "prepacked":
                kp = _cdiv(s.K, 2)
                off = b.add(b.mul(b.sdiv(n0, i64(PANEL)), i64(kp * 2 * PANEL)),
                            b.mul(pc, i64(PANEL)))     # (pc even: pc/2 pairs of 64)
                pstride = i64(kp * 2 * PANEL)
                rem = b.srem(n0, i64(PANEL))
            else:
                kcp2 = b.mul(b.sdiv(b.add(kc, i64(1)), i64(2)), i64(2))
                rem = b.srem(jr, i64(PANEL))
                off = b.mul(b.sub(jr, rem), kcp2)
                pstride = b.mul(kcp2, i64(PANEL))
            if p.NV == 1:
                off = b.add(off, b.mul(rem, i64(2)))
            return self.gep(B_b if p.b_mode == "prepacked" else self.ws_b, off, I16), pstride
        if p.b_mode == "prepacked" and not p.f32_panels:
            # panel q = n0/32 of [np][K][32]; + pc rows (+ 16 for the second half of a
            # panel: one-vector tiles)
            off = b.add(b.mul(b.sdiv(n0, i64(PANEL)), i64(s.K * PANEL)), b.mul(pc, i64(PANEL)))
            if p.NV == 1:
                off = b.add(off, b.srem(n0, i64(PANEL)))
            return self.gep(B_b, off, self.tw), i64(s.K * PANEL)
        if p.b_mode == "pack" or p.f32_panels:
            # panel jr/32 of [q][kc][32] (jr: a multiple of 16)
            half = b.srem(jr, i64(PANEL))
            off = b.add(b.mul(b.sub(jr, half), kc), half) if p.NV == 1 else b.mul(jr, kc)
            return self.gep(self.ws_b, off, self.tpw), b.mul(kc, i64(PANEL))
        if p.b_mode == "dot":
            return self.gep(B_b, b.add(b.mul(n0, i64(self.dot_bns)), pc),
                            _ety(self.b_src)), None
        return self.gep(B_b, b.add(b.mul(pc, i64(s.ldb_)), n0), self.tb), None

    def a_rows(self, A_b, m0, mr, pc, rows):
        """Pointers to A(m0 + r, pc) for r < rows (rows past mr: the last row)."""
        s, b = self.s, self.b
        out = []
        for r in range(rows):
            if r == 0:
                row = m0
            elif isinstance(mr, int):
                row = b.add(m0, i64(min(r, mr - 1)))
            else:
                row = b.add(m0, self.smin(i64(r), b.sub(mr, i64(1))))
            if s.trans_a:
                off = b.add(b.mul(pc, i64(s.lda_)), row)
            else:
                off = b.add(b.mul(row, i64(s.lda_)), pc)
            out.append(self.gep(A_b, off, self.ta))
        return out

    def cvt_rows(self, ir_, mr, rows):
        """Pointers to the rows ir_ + r (r < rows; past mr: the last) of the bf16 A block
        that convert_a wrote (row stride: KC rounded up to even)."""
        b = self.b
        lda = _rup(self.p.KC, 2)
        out = []
        for r in range(rows):
            rr = i64(r) if isinstance(mr, int) and r < mr else (
                i64(mr - 1) if isinstance(mr, int) else self.smin(i64(r), b.sub(mr, i64(1))))
            out.append(self.gep(self.ws_a, b.mul(b.add(ir_, rr), i64(lda)), _ety(self.cvt_t)))
        return out

    def widen_panels(self, B_b, pc, kc, jc, nc):
        """The KC x NC block of a prepacked narrow B as float32 panels in the workspace
        ([q][kc][32], the layout of pack_b): widened once per block, not per load."""
        s, b = self.s, self.b
        nq = b.sdiv(b.add(nc, i64(PANEL - 1)), i64(PANEL))
        with self.loop(0, nq, 1, "wbq") as q:
            src = self.gep(B_b, b.add(b.mul(b.add(b.sdiv(jc, i64(PANEL)), q),
                                            i64(s.K * PANEL)), b.mul(pc, i64(PANEL))), self.tw)
            dst = self.gep(self.ws_b, b.mul(q, b.mul(kc, i64(PANEL))), F32)
            with self.loop(0, kc, 1, "wbk") as k:
                o = b.mul(k, i64(PANEL))
                for v in range(2):
                    x = self.ld16(self.gep(src, b.add(o, i64(16 * v)), self.tw), self.wt)
                    self.store_v(x, self.gep(dst, b.add(o, i64(16 * v)), F32))

    def block(self, bi, m_lo, m_hi, n_lo, n_hi):
        s, p, b = self.s, self.p, self.b
        A_b = (self.gep(self.A, b.mul(bi, self.a_bs), self.ta) if self.a_bs is not None
               else self.A)
        if s.b_prepacked:
            B_b = (
                self.gep(self.B, b.mul(bi, i64(_prepacked_batch_stride(s, p.dp))), self.tw)
                if s.b_batch_stride
                else self.B
            )
        else:
            B_b = (
                self.gep(self.B, b.mul(bi, i64(s.b_batch_stride)), self.tb)
                if s.b_batch_stride else self.B
            )
        C_b = (self.gep(self.C, b.mul(bi, self.c_bs), self.tc) if self.c_bs is not None
               else self.C)
        K = s.K
        if self.dot_src == "pack":
            self.pack_bt(B_b)
            B_b = self.ws_b
        single_k = p.KC >= K and not (s.dyn and _runtime_blocking(p))
        with self.loop(n_lo, n_hi, self.NC, "jc") as jc:
            nc = self.smin(b.sub(n_hi, jc), self.NC)
            with self.loop(0, K, self.KC, "pc") as pc:
                kc = self.smin(b.sub(i64(K), pc), self.KC)
                if single_k:
                    first = last = True
                else:
                    first = b.icmp_signed("==", pc, i64(0))
                    last = b.icmp_signed("==", b.add(pc, kc), i64(K))
                if p.b_mode == "pack":
                    (self.pack_b_pairs if p.dp else self.pack_b)(B_b, pc, kc, jc, nc)
                elif p.f32_panels:
                    self.widen_panels(B_b, pc, kc, jc, nc)
                with self.loop(m_lo, m_hi, p.MC, "ic") as ic:
                    mc = self.smin(b.sub(m_hi, ic), i64(p.MC))
                    pf_d = None
                    if p.pf_b and p.pf_div == 2:
                        # (see pf_next: too few row tiles to cover the next panel at a
                        # line every second iteration take a line every iteration)
                        tiles = b.udiv(b.add(mc, i64(p.MR - 1)), i64(p.MR))
                        pf_d = b.zext(b.icmp_signed(">=", tiles, i64(2 * p.unroll * p.NV)),
                                      I64)
                    if p.pack_a:
                        self.pack_a(A_b, ic, mc, pc, kc)
                    if p.cvt_a:
                        self.convert_a(A_b, ic, mc, pc, kc)

                    def tile(jr, ir_, mr, nr, MR, NV, strip=False, A_b=A_b, B_b=B_b, ic=ic,
                             jc=jc, pc=pc, kc=kc, first=first, last=last, pf_d=pf_d):
                        b_base, b_pstride = self.b_panel(B_b, jc, jr, pc, kc)
                        n0 = b.add(jc, jr)
                        m0 = b.add(ic, ir_)
                        if strip and shared_strips(s, p):
                            a0 = self.gep(A_b, b.add(b.mul(m0, i64(s.lda_)), pc), self.ta)
                            c_ptr = self.gep(C_b, b.add(b.mul(m0, i64(s.ldc_)), n0), self.tc)
                            self.call_strip(a0, b_base, b_pstride, kc, c_ptr, nr, first, last,
                                            m0, n0, MR, NV)
                            return
                        if p.pack_a:
                            a_ptrs = [self.gep(self.ws_a, b.mul(ir_, kc), self.tpw)]
                        elif p.cvt_a:
                            a_ptrs = self.cvt_rows(ir_, mr, MR)
                        else:
                            a_ptrs = self.a_rows(A_b, m0, mr, pc, MR)
                        c_ptr = self.gep(C_b, b.add(b.mul(m0, i64(s.ldc_)), n0), self.tc)
                        if p.b_mode == "dot":
                            self.micro_dot(a_ptrs, b_base, c_ptr, mr, nr, m0, n0)
                        elif p.dp:
                            self.micro_dp(a_ptrs, b_base, b_pstride, kc, c_ptr, mr, nr,
                                          first, last, m0, n0, MR, NV)
                        else:
                            # (the plan's own tile only: the others' k loops are not
                            # unrolled, see micro, and carry no prefetch stream)
                            pf = None
                            if p.pf_b and (MR, NV) == (p.MR, p.NV):
                                pf = self.pf_next(B_b, jc, jr, nc, pc, kc, ir_, pf_d)
                            self.micro(a_ptrs, b_base, b_pstride, kc, c_ptr, mr, nr, first,
                                       last, m0, n0, MR, NV, pf)

                    if p.strips:
                        self.strips(mc, nc, tile)
                    else:
                        def column(jr, nr, NV, mc=mc, tile=tile):
                            with self.loop(0, mc, p.MR, "ir") as ir_:
                                mr = self.smin(b.sub(mc, ir_), i64(p.MR))
                                tile(jr, ir_, mr, nr, p.MR, NV)

                        self.col_tiles(nc, column)

    def pf_next(self, B_b, jc, jr, nc, pc, kc, ir_, d=None):
        """The prefetch stream of the micro-tile at row offset ir_ of a prepacked B's
        micro-panel (columns jc + jr, 16*NV wide): the row tiles bring the micro-panel the
        block visits next into L2, one line every pf_div-th k-loop iteration (U k steps),
        row tile t (mod U*pf_div*NV) the line t % NV of every (U*pf_div)-th k row from
        t // NV. So the first U*pf_div*NV row tiles fetch each line of it once while this
        panel's run from L1 and L2; later ones repeat the stripes (lines in L2 by then: a
        lookup). Without it the first row tile of each micro-panel reads the panel from
        memory as fast as its FMAs use it (BERT-base's 340 MB of weights leave every cache
        between runs). A line every second iteration measured better than every one
        (Sapphire Rapids guest, 128 x 768 x 768 with B leaving the caches between calls:
        +4% against +0 and +1% for every fourth). Returns (pointer, floats per advance).
        """
        s, p, b = self.s, self.p, self.b
        U, NV = p.unroll, p.NV
        w = i64(16 * NV)
        # next: this K block's next columns, else this column block's next K block, else
        # the next column block (past the last one: prefetches do not fault)
        n_in = b.icmp_signed("<", b.add(jr, w), nc)
        k_in = b.icmp_signed("<", b.add(pc, kc), i64(s.K))
        n_next = b.select(n_in, b.add(jc, b.add(jr, w)), b.select(k_in, jc, b.add(jc, nc)))
        k_next = b.select(n_in, pc, b.select(k_in, b.add(pc, kc), i64(0)))
        # D: pf_div; pf_div 2 is 1 + d at run time (an i64 the block sets), d = 0 where
        # the block has too few row tiles to cover the next panel at a line every second
        # iteration
        if p.pf_div == 2:
            UDNV = b.mul(b.add(d, i64(1)), i64(U * NV))
        else:
            d, UDNV = None, i64(U * p.pf_div * NV)
        t = b.urem(b.udiv(ir_, i64(p.MR)), UDNV)
        line = b.urem(t, i64(NV))
        panel = b.add(b.sdiv(n_next, i64(PANEL)), b.udiv(line, i64(2)))
        # (NV 1, AVX2's half panels: the next micro-panel may be a panel's second half)
        half = b.mul(b.urem(line, i64(2)), i64(16)) if NV > 1 else b.srem(n_next, i64(PANEL))
        off = b.add(b.mul(panel, i64(s.K * PANEL)),
                    b.add(b.mul(b.add(k_next, b.udiv(t, i64(NV))), i64(PANEL)), half))
        return self.gep(B_b, off, self.tw), U * PANEL, d

    def col_tiles(self, nc, body):
        """body(jr, nr, NV) for the column tiles of an nc-column block: NR columns at a
        time; with a tile wider than a B panel, whole widths and then the rest one
        32-column panel at a time (NV = 2), not a wide tile with most columns masked."""
        p, b = self.p, self.b
        if p.NV <= 2 or p.b_mode not in ("prepacked", "pack"):
            with self.loop(0, nc, p.NR, "jr") as jr:
                body(jr, self.smin(b.sub(nc, jr), i64(p.NR)), p.NV)
            return
        nwide = b.sub(nc, b.srem(nc, i64(p.NR)))
        with self.loop(0, nwide, p.NR, "jr") as jr:
            body(jr, i64(p.NR), p.NV)
        with self.loop(nwide, nc, PANEL, "jn") as jr:
            body(jr, self.smin(b.sub(nc, jr), i64(PANEL)), 2)

    def strips(self, mc, nc, tile):
        """The micro-tiles of an mc x nc block: full MR-row panels, then the last
        (mc mod MR) rows by a strip of micro-kernels of exactly that many rows (wider
        when they are few, see _nv_for), chosen at run time. So a few rows cost what
        they cost a kernel made for them, for any M."""
        s, p, b = self.s, self.p, self.b
        rem = b.srem(mc, i64(p.MR))
        mfull = b.sub(mc, rem)

        def column(jr, nr, NV):
            with self.loop(0, mfull, p.MR, "ir") as ir_:
                tile(jr, ir_, p.MR, nr, p.MR, NV)

        self.col_tiles(nc, column)
        done = b.append_basic_block(self.name("strip.x"))
        sw = b.switch(rem, done)
        for rows in range(1, p.MR):
            bb = b.append_basic_block(self.name(f"strip{rows}."))
            sw.add_case(i64(rows), bb)
            b.position_at_end(bb)
            NV = _nv_for(rows, s.N, p.b_mode, p.isa)
            if NV <= 2:
                with self.loop(0, nc, 16 * NV, "jr") as jr:
                    nr = self.smin(b.sub(nc, jr), i64(16 * NV))
                    tile(jr, mfull, rows, nr, rows, NV, strip=True)
            else:
                # the wide micro-tile over whole widths, then 32 columns at a time: a
                # block narrower than the wide tile (the grid's column blocks are often
                # 32 wide) ran the wide one with most of its columns masked off
                wide = 16 * NV
                nwide = b.sub(nc, b.srem(nc, i64(wide)))
                with self.loop(0, nwide, wide, "jr") as jr:
                    tile(jr, mfull, rows, i64(wide), rows, NV, strip=True)
                with self.loop(nwide, nc, PANEL, "jn") as jr:
                    nr = self.smin(b.sub(nc, jr), i64(PANEL))
                    tile(jr, mfull, rows, nr, rows, 2, strip=True)
            b.branch(done)
        b.position_at_end(done)

    def call_strip(self, a0, b_base, b_pstride, kc, c_ptr, nr, first, last, m0, n0, rows,
                   NV):
        """A strip's rows x 16*NV micro-tile by a call of the shared strip kernel
        (`strip_module`), which leaves the block's sums in C; after the last K block
        they are finished here (alpha, bias, epilogue) in a pass over the tile, which is
        in L1."""
        s, p, b = self.s, self.p, self.b
        whole = isinstance(nr, ir.Constant) and nr.constant == 16 * NV
        sym = strip_symbol(p.isa, rows, NV, p.KC > SUBCHAIN, p.prefetch_c, whole)
        f = declare(self.m, sym, VOID, STRIP_ARGS)
        b.call(f, [a0, i64(s.lda_), b_base, b_pstride, kc, c_ptr, i64(s.ldc_), nr,
                   i64(1) if first is True else b.zext(first, I64)])
        if last is True:
            self.strip_final(c_ptr, m0, n0, rows, nr)
        else:
            with self.if_then(last):
                self.strip_final(c_ptr, m0, n0, rows, nr)

    def strip_final(self, c_ptr, m0, n0, rows, nr):
        """The final values of a rows x nr tile of C that holds its sums: a call of one
        internal function of the kernel's module (inline at every strip, these loops
        took a quarter of an AVX2 GEMM module's LLVM time)."""
        fin = getattr(self, "_fin_fn", None)
        if fin is None:
            fnty = ir.FunctionType(VOID, [PTR, PTR, I64, I64, I64, I64, I64])
            fin = ir.Function(self.m, fnty,
                              name=self.m.get_unique_name(f"{self.fn.name}.finish"))
            fin.linkage = "internal"
            fin.attributes.add("nounwind")
            fin.attributes.add("noinline")
            g = _Gen(self.m, fin, self.s, self.p, self.epilogue, self.dims_slot)
            args, c, m, n, rs, ns, M = fin.args
            g.bias = g.arg(args, 2) if self.s.bias else None
            g.Mm1 = g.b.sub(M, i64(1))
            g.final_rows(c, m, n, rs, ns)
            g.b.ret_void()
            self._fin_fn = fin
        self.b.call(fin, [self.fn.args[0], c_ptr, m0, n0, i64(rows), nr, self.M])

    def final_rows(self, c_ptr, m0, n0, rows, nr):
        s, b = self.s, self.b
        with self.loop(0, rows, 1, "sf") as r:
            crow = self.gep(c_ptr, b.mul(r, i64(s.ldc_)), self.tc)
            with self.loop(0, nr, 16, "sfn") as j:
                mask = self.lane_mask(self.splat(b.sub(nr, j), VI64), 0)
                ptr = self.gep(crow, j, self.tc)
                self.store_final([[self.load_v(ptr, mask)]], [ptr], [[mask]],
                                 b.add(m0, r), b.add(n0, j), inline=True)

    def emit_strip(self, whole: bool):
        """The body of a shared strip kernel (`strip_module`): the plan's MR x 16*NV
        micro-tile over kc, its sums (plus C's partial sums unless ``first``) stored;
        ``whole``: all 16*NV columns (no masks: nr is not read)."""
        p, b = self.p, self.b
        a0, lda, b0, bps, kc, c, ldc, nr, first = self.fn.args
        if whole:
            nr = i64(16 * p.NV)
        self.c_ld = ldc
        a_ptrs = [a0] + [self.gep(a0, b.mul(lda, i64(r)), self.ta) for r in range(1, p.MR)]
        colmask, masks, c_rows, accs = self.tile_setup(c, p.MR, nr, p.MR, p.NV)
        self.micro_k(a_ptrs, b0, bps, kc, c, p.MR, nr, b.icmp_unsigned("!=", first, i64(0)),
                     False, None, None, p.MR, p.NV, p.unroll, colmask, masks, c_rows, accs)
        b.ret_void()

    # -- packing -------------------------------------------------------------
    def pack_a(self, A_b, ic, mc, pc, kc):
        """Ap[panel][k][MR] = A(ic + min(panel*MR + r, mc-1), pc + k)."""
        s, p, b = self.s, self.p, self.b
        MR = p.MR
        npan = b.sdiv(b.add(mc, i64(MR - 1)), i64(MR))
        with self.loop(0, npan, 1, "pa") as q:
            r0 = b.mul(q, i64(MR))
            dst0 = self.gep(self.ws_a, b.mul(r0, kc), self.tpw)
            ta, tw, TW, rp = self.s.a_type, self.pw, self.tpw, self.rnd_pack_a
            rnd = ta != tw or rp
            if s.trans_a and MR <= 16:
                # the MR rows of a k are contiguous: one masked vector copy per k
                src0 = self.gep(A_b, b.add(b.mul(pc, i64(s.lda_)), b.add(ic, r0)), self.ta)
                lmask = b.icmp_signed("<", self.iota, self.splat(b.sub(mc, r0), VI64))
                smask = ir.Constant(VM, [1 if i < MR else 0 for i in range(16)])
                with self.loop(0, kc, 1, "pak") as k:
                    x = self.ld16(self.gep(src0, b.mul(k, i64(s.lda_)), self.ta), ta, lmask, rp)
                    self.st16(x, self.gep(dst0, b.mul(k, i64(MR)), TW), tw, smask)
            else:
                srcs = []
                for r in range(MR):
                    row = b.add(ic, self.smin(b.add(r0, i64(r)), b.sub(mc, i64(1))))
                    if s.trans_a:
                        srcs.append(self.gep(A_b, b.add(b.mul(pc, i64(s.lda_)), row), self.ta))
                    else:
                        srcs.append(self.gep(A_b, b.add(b.mul(row, i64(s.lda_)), pc), self.ta))
                a_ks = s.lda_ if s.trans_a else 1
                with self.loop(0, kc, 1, "pak") as k:
                    dst = self.gep(dst0, b.mul(k, i64(MR)), TW)
                    ko = b.mul(k, i64(a_ks)) if a_ks != 1 else k
                    for r in range(MR):
                        if not rnd:   # a copy of the bits
                            v = b.load(self.gep(srcs[r], ko, self.ta), typ=self.ta,
                                       align=_esize(ta))
                            b.store(v, self.gep(dst, r, TW), align=_esize(ta))
                        else:
                            v = self.ld1(self.gep(srcs[r], ko, self.ta), ta, rp)
                            self.st1(v, self.gep(dst, r, TW), tw)

    def pack_b(self, B_b, pc, kc, jc, nc):
        """Bp[q][k][32] = B(pc + k, jc + 32q + j), zero for columns >= nc."""
        s, b = self.s, self.b
        nq = b.sdiv(b.add(nc, i64(PANEL - 1)), i64(PANEL))
        nc_s = self.splat(nc, VI64)
        ldb = s.ldb_
        tb, tw, TB, TW, rp = s.b_type, self.pw, self.tb, self.tpw, self.rnd_pack_b
        if not s.trans_b:
            with self.loop(0, kc, 1, "pbk") as k:
                src = self.gep(B_b, b.add(b.mul(b.add(pc, k), i64(ldb)), jc), TB)
                dst = self.gep(self.ws_b, b.mul(k, i64(PANEL)), TW)
                with self.loop(0, nq, 1, "pbq") as q:
                    col = b.mul(q, i64(PANEL))
                    col_s = self.splat(col, VI64)
                    for v in range(2):
                        lanes = b.add(col_s, ir.Constant(VI64, list(range(16 * v, 16 * v + 16))))
                        mask = b.icmp_signed("<", lanes, nc_s)
                        x = self.ld16(self.gep(src, b.add(col, i64(16 * v)), TB), tb, mask, rp)
                        self.st16(
                            x, self.gep(dst, b.add(b.mul(q, b.mul(kc, i64(PANEL))), i64(16 * v)),
                                        TW), tw)
        else:
            # B stored [N,K]: 16x16 blocks loaded along K and transposed in registers
            base = self.gep(B_b, b.add(b.mul(jc, i64(ldb)), pc), TB)
            with self.loop(0, nq, 1, "pbq") as q:
                col = b.mul(q, i64(PANEL))
                qbase = self.gep(base, b.mul(col, i64(ldb)), TB)
                dstq = self.gep(self.ws_b, b.mul(q, b.mul(kc, i64(PANEL))), TW)
                rowok = [b.icmp_signed("<", b.add(col, i64(j)), nc) for j in range(PANEL)]
                with self.loop(0, kc, 16, "pbk") as kk:
                    kmask = b.icmp_signed("<", self.iota, self.splat(b.sub(kc, kk), VI64))
                    src = self.gep(qbase, kk, TB)
                    dst = self.gep(dstq, b.mul(kk, i64(PANEL)), TW)
                    full = b.icmp_signed("<=", b.add(kk, i64(16)), kc)
                    smask = [
                        b.select(
                            b.or_(full, b.icmp_signed("<", b.add(kk, i64(i)), kc)),
                            self.ones_m,
                            self.zero_m,
                        )
                        for i in range(16)
                    ]
                    for half in range(2):
                        rows = []
                        for j in range(16):
                            jj = 16 * half + j
                            mk = b.select(rowok[jj], kmask, self.zero_m)
                            rows.append(self.ld16(self.gep(src, jj * ldb, TB), tb, mk, rp))
                        cols = self.transpose16(rows)
                        for i in range(16):
                            self.st16(cols[i], self.gep(dst, i * PANEL + 16 * half, TW), tw,
                                      smask[i])

    def pack_bt(self, B_b):
        """ws_b[n][k] = B(k, n) for the whole (small-N) B: 16x16 register transposes."""
        s, b = self.s, self.b
        N, K, ldb = s.N, s.K, s.ldb_
        dst0 = self.ws_b
        nmask = ir.Constant(VM, [1 if i < N else 0 for i in range(16)]) if N < 16 else None
        with self.loop(0, K, 16, "pbt") as kk:
            left = b.sub(i64(K), kk)
            rows = []
            for i in range(16):
                ok = b.icmp_signed("<", i64(i), left)
                mk = b.select(
                    ok, nmask if nmask is not None else self.ones_m, self.zero_m
                )
                rows.append(self.ld16(
                    self.gep(B_b, b.add(b.mul(kk, i64(ldb)), i64(i * ldb)), self.tb),
                    s.b_type, mk))
            cols = self.transpose16(rows)
            kmask = b.icmp_signed("<", self.iota, self.splat(left, VI64))
            for n in range(N):
                self.st16(cols[n], self.gep(dst0, b.add(kk, i64(n * K)), self.tw), self.wt,
                          kmask)

    def micro_dot(self, a_ptrs, b_base, c_ptr, mr, nr, m0, n0):
        """C[m0:m0+MR, n0:n0+NR] from dot products of A rows and B rows (B [N,K])."""
        s, p, b = self.s, self.p, self.b
        MR, NJ, K = p.MR, p.NR, s.K
        lda, ldb = s.lda_, self.dot_bns
        kmain, rem = K - K % 16, K % 16
        rem_mask = ir.Constant(VM, [1 if i < rem else 0 for i in range(16)])
        full = b.and_(b.icmp_signed("==", nr, i64(NJ)), b.icmp_signed("==", mr, i64(MR)))
        full_bb = b.append_basic_block(self.name("dot.full"))
        edge_bb = b.append_basic_block(self.name("dot.edge"))
        join_bb = b.append_basic_block(self.name("dot.join"))
        b.cbranch(full, full_bb, edge_bb)
        outs = []
        for bb, edge in ((full_bb, False), (edge_bb, True)):
            b.position_at_end(bb)
            TA, TB = self.ta, _ety(self.b_src)
            if edge:
                a_rows = a_ptrs
                b_rows = [b_base] + [
                    self.gep(b_base, b.mul(self.smin(i64(j), b.sub(nr, i64(1))), i64(ldb)), TB)
                    for j in range(1, NJ)
                ]
            else:
                a_rows = [a_ptrs[0]] + [self.gep(a_ptrs[0], r * lda, TA) for r in range(1, MR)]
                b_rows = [b_base] + [self.gep(b_base, j * ldb, TB) for j in range(1, NJ)]

            def step(accs, k, mask, a_rows=a_rows, b_rows=b_rows, TA=TA, TB=TB):
                av = [self.ld16(self.gep(a_rows[r], k, TA), s.a_type, mask, self.rnd_a)
                      for r in range(MR)]
                bv = [self.ld16(self.gep(b_rows[j], k, TB), self.b_src, mask, self.rnd_b)
                      for j in range(NJ)]
                return [
                    [self.fma(av[r], bv[j], accs[r][j]) for j in range(NJ)]
                    for r in range(MR)
                ]

            accs = [[self.zero_v] * NJ for _ in range(MR)]
            if kmain:
                _, accs, _ = self.grid_loop(
                    0, kmain, 16, accs, [], lambda k, g, _, step=step: (step(g, k, None), []),
                    "dk", iv_name="k",
                )
            if rem:
                accs = step(accs, i64(kmain), rem_mask)
            outs.append((b.block, accs))
            b.branch(join_bb)
        b.position_at_end(join_bb)
        accs = []
        for r in range(MR):
            row = []
            for j in range(NJ):
                phv = b.phi(VF)
                for blk, a in outs:
                    phv.add_incoming(a[r][j], blk)
                row.append(phv)
            accs.append(row)
        red = [[self.hreduce(accs[r])] for r in range(MR)]
        colmask = self.lane_mask(self.splat(nr, VI64), 0)
        masks = [
            [colmask if r == 0 else b.select(b.icmp_signed("<", i64(r), mr), colmask, self.zero_m)]
            for r in range(MR)
        ]
        c_rows = [c_ptr] + [self.gep(c_ptr, r * s.ldc_, self.tc) for r in range(1, MR)]
        self.store_final(red, c_rows, masks, m0, n0)

    # -- micro-kernel ----------------------------------------------------------
    def k_unroll(self, MR, NV):
        """k steps per iteration of the k loop of an MR x 16*NV micro-tile: the plan's
        for its own tile; for another (a strip's) _strip_unroll's, as a shared strip
        kernel's plan has it (strip_module)."""
        p = self.p
        if (MR, NV) == (p.MR, p.NV):
            return p.unroll
        return _strip_unroll(MR, NV, p.isa)

    def micro(self, a_ptrs, b_base, b_pstride, kc, c_ptr, mr, nr, first, last, m0, n0,
              MR=None, NV=None, pf=None):
        """An MR x 16*NV micro-tile (default: the plan's) of which mr rows (an i64, or
        an int: all MR rows) and nr columns are stored; ``pf``: a prefetch stream
        (pointer, floats an advance, see pf_next)."""
        p = self.p
        MR, NV = MR or p.MR, NV or p.NV
        U = self.k_unroll(MR, NV)
        colmask, masks, c_rows, accs = self.tile_setup(c_ptr, mr, nr, MR, NV)
        self.prefetch_epilogue(last, m0, n0, MR, NV)
        self.micro_k(a_ptrs, b_base, b_pstride, kc, c_ptr, mr, nr, first, last, m0, n0,
                     MR, NV, U, colmask, masks, c_rows, accs, pf)

    def prefetch_epilogue(self, last, m0, n0, MR, NV):
        """The lines of the micro-tile that the epilogue reads from other tensors (a
        residual Add's operand, ``epilogue.prefetch``), into L1 before its k loop of the
        last K block: a model's activations have left the caches since they were
        written (BERT-base at batch 8, 1 core, Zen 4: the out-projection with its
        residual ran at 100 GFLOP/s against 110 for the same GEMM with a bias only)."""
        pf = getattr(self.epilogue, "prefetch", None)
        if pf is None or not EPILOGUE_PREFETCH or last is False:
            return
        for r in range(MR):
            m = self.b.add(m0, i64(r)) if r else m0
            for v in range(NV):
                pf(self.b, self.fn.args[0], m, self.b.add(n0, i64(16 * v)) if v else n0)

    def tile_setup(self, c_ptr, mr, nr, MR, NV):
        """A micro-tile's column masks, row x vector store masks, C row pointers (with a
        write prefetch) and initial accumulators (0)."""
        s, p, b = self.s, self.p, self.b
        ldc = self.c_ld
        nr_s = self.splat(nr, VI64)
        colmask = [self.lane_mask(nr_s, 16 * v) for v in range(NV)]
        if isinstance(mr, int):
            assert mr == MR
            masks = [colmask] * MR
        else:
            rowok = [None] + [b.icmp_signed("<", i64(r), mr) for r in range(1, MR)]
            masks = [
                [
                    colmask[v] if r == 0 else b.select(rowok[r], colmask[v], self.zero_m)
                    for v in range(NV)
                ]
                for r in range(MR)
            ]
        c_rows = [c_ptr] + [self.gep(c_ptr, r * ldc if isinstance(ldc, int) else
                                     b.mul(ldc, i64(r)), self.tc) for r in range(1, MR)]

        if p.prefetch_c:
            for r in range(MR):
                for line in range(NV * _esize(s.c_type) // 4):
                    self.prefetch_w(self.gep(c_rows[r], 16 * line))

        # every K block's sums begin at 0 (store_tile adds the earlier blocks' to them)
        accs = [[self.zero_v] * NV for _ in range(MR)]
        return colmask, masks, c_rows, accs

    def micro_k(self, a_ptrs, b_base, b_pstride, kc, c_ptr, mr, nr, first, last, m0, n0,
                MR, NV, U, colmask, masks, c_rows, accs, pf=None):
        """The k loop and the store of an fp32-FMA micro-tile (narrow operands widened in
        registers)."""
        s, p, b = self.s, self.p, self.b
        TA, TB = _ety(self.a_src), _ety(self.b_src)

        # B streams: packed -> one pointer per 32-column panel, stride 32/k;
        # direct -> one pointer, stride ldb/k.
        if p.b_mode == "direct":
            b_ptrs = [b_base]
            b_ks = s.ldb_
            b_off = [(0, 16 * v) for v in range(NV)]
            b_masked = True
        elif p.isa == "avx2" and NV > 2:
            # no masks in the k loop (AVX2 has no mask registers: they would take
            # vector registers, and be spilled): the panels past the last one of the
            # tile are read from the last one; those columns are not stored
            last_q = b.sdiv(b.sub(nr, i64(1)), i64(PANEL))
            b_ptrs = [b_base] + [
                self.gep(b_base, b.mul(b_pstride, self.smin(last_q, i64(q))), TB)
                for q in range(1, NV // 2)
            ]
            b_ks = PANEL
            b_off = [(v // 2, 16 * (v % 2)) for v in range(NV)]
            b_masked = False
        elif isinstance(b_pstride, ir.Constant) and NV > 2:
            # (a prepacked B: its panels a constant stride apart, read through one pointer
            # at constant offsets -- one general register in the k loop, not NV/2)
            b_ptrs = [b_base]
            b_ks = PANEL
            ps = int(b_pstride.constant)
            b_off = [(0, (v // 2) * ps + 16 * (v % 2)) for v in range(NV)]
            b_masked = True
        else:
            b_ptrs = [b_base] + [
                self.gep(b_base, b.mul(b_pstride, i64(q)), TB) for q in range(1, NV // 2)
            ]
            b_ks = PANEL
            b_off = [(v // 2, 16 * (v % 2)) for v in range(NV)]
            b_masked = NV > 2
        if p.pack_a:
            a_ks, a_off = p.MR, [(0, r) for r in range(MR)]
        elif p.cvt_a:
            a_ks, a_off = 1, [(r, 0) for r in range(MR)]
        else:
            a_ks = s.lda_ if s.trans_a else 1
            a_off = [(r, 0) for r in range(MR)]

        def step(accs, a_ps, b_ps, u):
            bv = []
            for v in range(NV):
                q, o = b_off[v]
                ptr = self.gep(b_ps[q], u * b_ks + o, TB)
                bv.append(self.ld16(ptr, self.b_src, colmask[v] if b_masked else None,
                                    self.rnd_b))
            new = []
            for r in range(MR):
                q, o = a_off[r]
                x = self.ld1(self.gep(a_ps[q], u * a_ks + o, TA), self.a_src, self.rnd_a)
                xs = self.splat(x)
                new.append([self.fma(xs, bv[v], accs[r][v]) for v in range(NV)])
            return new

        # the prefetch stream (pf_next): a line every pf_div-th iteration of the unrolled
        # k loop ("ku"; the remainder loop "kr" passes it through)
        f_ptrs = [pf[0]] if pf is not None else []

        def kloop(k0, kend, accs, a_ps, b_ps, f_ps, nstep, tag):
            """k from k0 to kend, nstep per iteration; returns the final k,
            accumulators and A / B (and prefetch) stream pointers."""
            na, nb = len(a_ps), len(b_ps)
            fetch = bool(f_ps)

            def body(k, cur, ptrs):
                a_phi, b_phi, f_phi = ptrs[:na], ptrs[na:na + nb], ptrs[na + nb:]
                if fetch:
                    self.prefetch_r(f_phi[0], locality=2)
                    # one line every pf_div-th iteration (k: a multiple of U): on the
                    # others the stream stays, so its next prefetch is the same line
                    adv = i64(pf[1] * 4)
                    if p.pf_div == 2:
                        # D = 1 + d (d = pf[2]: 0 where the row tiles are few, pf_next):
                        # the stream advances D lines' worth every D-th iteration. From
                        # one loop-invariant register, dU = d * U: due when k & dU == dU
                        # (k counts k steps, U an iteration), the advance adv + dU rows
                        assert nstep & (nstep - 1) == 0, nstep    # (U: a power of two)
                        dU = b.shl(pf[2], i64(nstep.bit_length() - 1))
                        due = b.icmp_unsigned("==", b.and_(k, dU), dU)
                        adv = b.select(due, b.add(adv, b.mul(dU, i64(PANEL * 4))), i64(0))
                    elif p.pf_div > 1:
                        it = b.udiv(k, i64(nstep))
                        due = b.icmp_unsigned("==", b.urem(it, i64(p.pf_div)),
                                              i64(p.pf_div - 1))
                        adv = b.mul(b.zext(due, I64), i64(pf[1] * 4 * p.pf_div))
                    f_phi = [self.gep(f_phi[0], adv, I8)]
                for u in range(nstep):
                    cur = step(cur, a_phi, b_phi, u)
                return cur, [self.gep(x, nstep * a_ks, TA) for x in a_phi] + [
                    self.gep(x, nstep * b_ks, TB) for x in b_phi
                ] + list(f_phi)

            ptrs = list(a_ps) + list(b_ps) + list(f_ps)
            k, accs, ptrs = self.grid_loop(k0, kend, nstep, accs, ptrs, body, tag, iv_name="k")
            return k, accs, ptrs[:na], ptrs[na:na + nb], ptrs[na + nb:]

        def chain(k0, kend, accs, a_ps, b_ps, f_ps=()):
            if U > 1:
                kmain = b.sub(kend, b.srem(b.sub(kend, k0), i64(U)))
                k, accs, a_ps, b_ps, f_ps = kloop(k0, kmain, accs, a_ps, b_ps, f_ps, U, "ku")
                _, accs, a_ps, b_ps, _ = kloop(k, kend, accs, a_ps, b_ps, (), 1, "kr")
            else:
                _, accs, a_ps, b_ps, _ = kloop(k0, kend, accs, a_ps, b_ps, (), 1, "k")
            return accs, a_ps, b_ps, f_ps

        if self.subchains(MR, NV):
            # the K block in chains of SUBCHAIN k (sums begun at zero, then added to the
            # block's): where the registers hold a second set of accumulators
            def chunk(k, tot, ptrs):
                n, nb = len(a_ptrs), len(b_ptrs)
                kend = self.smin(b.add(k, i64(SUBCHAIN)), kc)
                part, a_ps, b_ps, f_ps = chain(k, kend, [[self.zero_v] * NV for _ in range(MR)],
                                               ptrs[:n], ptrs[n:n + nb], ptrs[n + nb:])
                tot = [[b.fadd(t, q) for t, q in zip(trow, prow)] for trow, prow in zip(tot, part)]
                return tot, list(a_ps) + list(b_ps) + list(f_ps)

            _, accs, _ = self.grid_loop(i64(0), kc, SUBCHAIN, accs,
                                        list(a_ptrs) + list(b_ptrs) + f_ptrs,
                                        chunk, "kch", iv_name="kc0")
        elif self.mem_subchains(MR, NV):
            # no registers for a second set of accumulators (8 x 32 tiles): the chains
            # of SUBCHAIN k before the last are added up in C, where the K blocks'
            # partial sums live (a float32 C; the tile is still in L1 or L2), and the
            # last one is stored as the block's sums
            n, nb = len(a_ptrs), len(b_ptrs)
            kmain = b.mul(b.sdiv(b.sub(kc, i64(1)), i64(SUBCHAIN)), i64(SUBCHAIN))

            def chunk(k, ptrs):
                part, a_ps, b_ps, f_ps = chain(k, b.add(k, i64(SUBCHAIN)),
                                               [[self.zero_v] * NV for _ in range(MR)],
                                               ptrs[:n], ptrs[n:n + nb], ptrs[n + nb:])
                part = self.add_partials(part, self.first_and(first, k), c_rows, masks)
                for r in range(MR):
                    for v in range(NV):
                        self.store_v(part[r][v], self.gep(c_rows[r], 16 * v), masks[r][v])
                return list(a_ps) + list(b_ps) + list(f_ps)

            _, ptrs = self.carry_loop(i64(0), kmain, SUBCHAIN,
                                      list(a_ptrs) + list(b_ptrs) + f_ptrs,
                                      chunk, "kcm", iv_name="kc0")
            accs, _, _, _ = chain(kmain, kc, accs, ptrs[:n], ptrs[n:n + nb], ptrs[n + nb:])
            first = self.first_and(first, kmain)
        else:
            accs, _, _, _ = chain(i64(0), kc, accs, a_ptrs, b_ptrs, f_ptrs)

        self.store_tile(accs, c_rows, masks, first, last, m0, n0, MR, NV)

    def first_and(self, first, k):
        """The i1: this K block is the first one (``first``: an i1, or True) and k is 0."""
        at0 = self.b.icmp_signed("==", k, i64(0))
        return at0 if first is True else self.b.and_(first, at0)

    def subchains(self, MR, NV):
        """Whether an MR x 16*NV fp32 micro-tile sums its K blocks in chains of SUBCHAIN:
        blocks longer than that, and registers for the chain's accumulators besides the
        block's (and the B vectors and an A broadcast)."""
        per, regs = (2, 16) if self.p.isa == "avx2" else (1, 32)
        return self.p.KC > SUBCHAIN and (2 * MR * NV + NV + 1) * per <= regs

    def mem_subchains(self, MR, NV):
        """Whether an MR x 16*NV fp32 micro-tile that `subchains` cannot sum in chains of
        SUBCHAIN in registers adds them up in C instead: K blocks longer than that and
        a float32 C (the partial sums' home). One load, add and store per accumulator and
        SUBCHAIN k steps (16*SUBCHAIN FMAs for an 8 x 32 tile)."""
        return (self.p.KC > SUBCHAIN and self.s.c_type == "float32"
                and not self.subchains(MR, NV))

    def store_tile(self, accs, c_rows, masks, first, last, m0, n0, MR, NV):
        """The final values (last K block) or the partial sums (float32 C) of a tile: its
        sums over this K block plus the partial sums in C (K blocks after the first)."""
        if first is not True:
            assert self.s.c_type == "float32", "partial sums need a float32 C"
        accs = self.add_partials(accs, first, c_rows, masks)

        def partial():
            assert self.s.c_type == "float32", "partial sums need a float32 C"
            for r in range(MR):
                for v in range(NV):
                    self.store_v(accs[r][v], self.gep(c_rows[r], 16 * v), masks[r][v])

        if last is False:   # (a shared strip kernel: its caller finishes the sums)
            partial()
            return
        # (the plan's own tile inlines the epilogue: a call per vector spills its
        # accumulators, see apply_epilogue)
        own = (MR, NV) == (self.p.MR, self.p.NV)
        self.finish_block(
            last, lambda: self.store_final(accs, c_rows, masks, m0, n0, own), partial, "st"
        )

    def micro_dp(self, a_ptrs, b_base, b_pstride, kc, c_ptr, mr, nr, first, last, m0, n0,
                 MR, NV):
        """An MR x 16*NV micro-tile by vdpbf16ps: per k-pair, NV <16 x i32> loads of the
        k-pair B panel (each lane B[k,n], B[k+1,n]) and one broadcast 32-bit pair
        A[i,k], A[i,k+1] per row (bf16 A in place, or the block convert_a wrote); an odd
        kc ends with a pair A[i,k], 0 (B's pad row is zero)."""
        b = self.b
        U = self.k_unroll(MR, NV)
        colmask, masks, c_rows, accs = self.tile_setup(c_ptr, mr, nr, MR, NV)
        dp = self.intr("llvm.x86.avx512bf16.dpbf16ps.512", VF, [VF, V32BF, V32BF])
        b_ptrs = [b_base] + [self.gep(b_base, b.mul(b_pstride, i64(q)), I16)
                             for q in range(1, NV // 2)]
        b_off = [(v // 2, 32 * (v % 2)) for v in range(NV)]
        b_masked = NV > 2
        PAIR = 2 * PANEL  # bf16 per k-pair of a panel
        zero_i = ir.Constant(VI32, None)

        def step(accs, a_ps, b_ps, u, tail=False):
            bv = []
            for v in range(NV):
                q, o = b_off[v]
                ptr = self.gep(b_ps[q], u * PAIR + o, I16)
                if b_masked:
                    x = masked_load(b, ptr, colmask[v], zero_i, 4)
                else:
                    x = b.load(ptr, typ=VI32, align=4)
                bv.append(b.bitcast(x, V32BF))
            new = []
            for r in range(MR):
                ptr = self.gep(a_ps[r], 2 * u, I16)
                if tail:
                    x = b.zext(b.load(ptr, typ=I16, align=2), I32)
                else:
                    x = b.load(ptr, typ=I32, align=2)
                xs = b.bitcast(self.splat(x, VI32), V32BF)
                new.append([b.call(dp, [accs[r][v], xs, bv[v]]) for v in range(NV)])
            return new

        def kloop(k0, kend, accs, a_ps, b_ps, nstep, tag):
            na = len(a_ps)

            def body(k, cur, ptrs):
                a_phi, b_phi = ptrs[:na], ptrs[na:]
                for u in range(nstep):
                    cur = step(cur, a_phi, b_phi, u)
                return cur, [self.gep(x, 2 * nstep, I16) for x in a_phi] + [
                    self.gep(x, PAIR * nstep, I16) for x in b_phi]

            k, accs, ptrs = self.grid_loop(k0, kend, nstep, accs, list(a_ps) + list(b_ps),
                                           body, tag, iv_name="k")
            return k, accs, ptrs[:na], ptrs[na:]

        kp = b.ashr(kc, i64(1))  # whole pairs
        if U > 1:
            kmain = b.sub(kp, b.srem(kp, i64(U)))
            k, accs, a_ps, b_ps = kloop(i64(0), kmain, accs, a_ptrs, b_ptrs, U, "dku")
            _, accs, a_ps, b_ps = kloop(k, kp, accs, a_ps, b_ps, 1, "dkr")
        else:
            _, accs, a_ps, b_ps = kloop(i64(0), kp, accs, a_ptrs, b_ptrs, 1, "dk")
        # an odd kc: the last k with a zero partner
        odd = b.icmp_signed("!=", b.and_(kc, i64(1)), i64(0))
        pre = b.block
        tail_bb = b.append_basic_block(self.name("dp.tail"))
        join_bb = b.append_basic_block(self.name("dp.join"))
        b.cbranch(odd, tail_bb, join_bb)
        b.position_at_end(tail_bb)
        taccs = step(accs, a_ps, b_ps, 0, tail=True)
        tail_end = b.block
        b.branch(join_bb)
        b.position_at_end(join_bb)
        out = []
        for r in range(MR):
            row = []
            for v in range(NV):
                ph = b.phi(VF)
                ph.add_incoming(accs[r][v], pre)
                ph.add_incoming(taccs[r][v], tail_end)
                row.append(ph)
            out.append(row)
        self.store_tile(out, c_rows, masks, first, last, m0, n0, MR, NV)

    def convert_a(self, A_b, ic, mc, pc, kc):
        """The mc x kc block of A at (ic, pc) as row-major bf16 in the workspace (row
        stride KC rounded up to even; an odd kc padded with a zero column): A converted on
        load for vdpbf16ps."""
        s, p, b = self.s, self.p, self.b
        lda = _rup(p.KC, 2)
        kce = b.mul(b.ashr(b.add(kc, i64(1)), i64(1)), i64(2))
        stride = s.lda_ if s.trans_a else 1
        esz = _esize(s.a_type)
        with self.loop(0, mc, 1, "cva") as r:
            row = b.add(ic, r)
            if s.trans_a:
                src = self.gep(A_b, b.add(b.mul(pc, i64(s.lda_)), row), self.ta)
            else:
                src = self.gep(A_b, b.add(b.mul(row, i64(s.lda_)), pc), self.ta)
            dst = self.gep(self.ws_a, b.mul(r, i64(lda)), _ety(self.cvt_t))
            with self.loop(0, kce, 16, "cvk") as kk:
                lmask = b.icmp_signed("<", self.iota, self.splat(b.sub(kc, kk), VI64))
                smask = b.icmp_signed("<", self.iota, self.splat(b.sub(kce, kk), VI64))
                rp = self.rnd_pack_a and self.cvt_t == "float32"
                if stride == 1:
                    x = self.ld16(self.gep(src, kk, self.ta), s.a_type, lmask, rp)
                else:
                    base = b.ptrtoint(self.gep(src, b.mul(kk, i64(stride)), self.ta), I64)
                    offs = b.mul(self.iota, ir.Constant(VI64, [stride * esz] * 16))
                    ptrs = b.inttoptr(b.add(self.splat(base, VI64), offs), VPTR)
                    x = self.gather16(ptrs, s.a_type, lmask)
                    x = self.round_c(x) if rp else x
                self.st16(x, self.gep(dst, kk, _ety(self.cvt_t)), self.cvt_t, smask)

    def pack_b_pairs(self, B_b, pc, kc, jc, nc):
        """Bp[q][k/2][32][2] (bf16) = B(pc + k, jc + 32q + j), B(pc + k + 1, ..): the
        k-pair panels of vdpbf16ps, zero for columns >= nc and the row past an odd kc."""
        s, b = self.s, self.b
        nq = b.sdiv(b.add(nc, i64(PANEL - 1)), i64(PANEL))
        nc_s = self.splat(nc, VI64)
        kp = b.ashr(b.add(kc, i64(1)), i64(1))
        ldb, TB, esz = s.ldb_, self.tb, _esize(s.b_type)
        shuf = ir.Constant(ir.VectorType(I32, 32), [x for i in range(16) for x in (i, 16 + i)])
        with self.loop(0, kp, 1, "pbp") as k2:
            k = b.add(pc, b.mul(k2, i64(2)))
            has2 = b.icmp_signed("<", b.add(b.mul(k2, i64(2)), i64(1)), kc)
            dst = self.gep(self.ws_b, b.mul(k2, i64(2 * PANEL)), I16)
            with self.loop(0, nq, 1, "pbq") as q:
                col = b.mul(q, i64(PANEL))
                col_s = self.splat(col, VI64)
                for v in range(2):
                    lanes = b.add(col_s, ir.Constant(VI64, list(range(16 * v, 16 * v + 16))))
                    mask = b.icmp_signed("<", lanes, nc_s)
                    n = b.add(jc, b.add(col, i64(16 * v)))
                    rows = []
                    for dk in range(2):
                        kk = b.add(k, i64(dk))
                        mk = mask if dk == 0 else b.select(has2, mask, self.zero_m)
                        if not s.trans_b:
                            x = self.ld16(self.gep(B_b, b.add(b.mul(kk, i64(ldb)), n), TB),
                                          s.b_type, mk)
                        else:
                            base = b.ptrtoint(self.gep(B_b, b.add(b.mul(n, i64(ldb)), kk), TB),
                                              I64)
                            offs = b.mul(self.iota, ir.Constant(VI64, [ldb * esz] * 16))
                            ptrs = b.inttoptr(b.add(self.splat(base, VI64), offs), VPTR)
                            x = self.gather16(ptrs, s.b_type, mk)
                        rows.append(self.narrow(x, "bfloat16"))
                    pair = b.shuffle_vector(rows[0], rows[1], shuf)
                    off = b.add(b.mul(q, b.mul(kp, i64(2 * PANEL))), i64(32 * v))
                    b.store(pair, self.gep(dst, off, I16), align=2)

    def apply_epilogue(self, val, m, n, inline=False):
        """The epilogue of one output vector: inline in a static kernel, and in a dynamic
        one where ``inline`` (the plan's own micro-tile, the strips' finishing pass);
        the dynamic kernel's other micro-tiles, which are many and run rarely, call one
        internal function ``(ptr args, <16 x float>, i64 m, i64 n)`` that holds it (a
        call per vector spills the tile's accumulators around it)."""
        if not self.s.dyn or inline:
            return self.epilogue(self.b, val, m, n)
        if getattr(self, "_epi_fn", None) is None:
            fnty = ir.FunctionType(VF, [PTR, VF, I64, I64])
            f = ir.Function(self.m, fnty, name=self.m.get_unique_name(f"{self.fn.name}.epilogue"))
            f.linkage = "internal"
            f.attributes.add("nounwind")
            f.attributes.add("noinline")   # once, not in every micro-kernel variant
            eb = ir.IRBuilder(f.append_basic_block("entry"))
            r = self.epilogue(eb, *f.args[1:])
            eb.ret(r if r.type == VF else eb.fpext(r, VF))  # (an epilogue ending in half)
            self._epi_fn = f
        return self.b.call(self._epi_fn, [self.fn.args[0], val, m, n])

    def store_final(self, accs, c_rows, masks, m0, n0, inline=False):
        s, b = self.s, self.b
        alpha = float(np.float32(s.alpha))
        beta = float(np.float32(s.beta))
        use_bias = s.bias and beta != 0.0
        brs, bcs = s.bias_row_stride, s.bias_col_stride
        bsz = _esize(s.bias_type)
        if use_bias and bcs not in (0, 1):
            bias_i = b.ptrtoint(self.bias, I64)
            col_off = [
                b.mul(
                    b.add(
                        self.splat(n0, VI64), ir.Constant(VI64, list(range(16 * v, 16 * v + 16)))
                    ),
                    ir.Constant(VI64, [bsz * bcs] * 16),
                )
                for v in range(len(accs[0]))
            ]
        for r in range(len(accs)):
            m = b.add(m0, i64(r)) if r else m0
            bias_row = None
            if use_bias:
                if bcs == 0:
                    mm = self.smin(m, self.Mm1) if brs else i64(0)
                    x = self.ld1(self.gep(self.bias, b.mul(mm, i64(brs)), self.tbias),
                                 s.bias_type)
                    bias_row = self.splat_f(x)
                elif bcs == 1:
                    bias_row_ptr = self.gep(self.bias, b.add(b.mul(m, i64(brs)), n0),
                                            self.tbias)
                else:
                    row_i = self.splat(b.add(bias_i, b.mul(m, i64(bsz * brs))), VI64)
            for v in range(len(accs[0])):
                val = accs[r][v]
                if alpha != 1.0:
                    val = b.fmul(val, self.splat_f(alpha))
                if use_bias:
                    if bcs == 0:
                        bv = bias_row
                    elif bcs == 1:
                        bv = self.ld16(self.gep(bias_row_ptr, 16 * v, self.tbias), s.bias_type,
                                       masks[r][v])
                    else:
                        ptrs = b.inttoptr(b.add(row_i, col_off[v]), VPTR)
                        bv = self.gather16(ptrs, s.bias_type, masks[r][v])
                    if beta == 1.0:
                        val = b.fadd(val, bv)
                    else:
                        val = self.fma(bv, self.splat_f(beta), val)
                if self.epilogue is not None:
                    nv = b.add(n0, i64(16 * v)) if v else n0
                    val = self.apply_epilogue(val, m, nv, inline)
                    if val.type != VF:  # an epilogue that ends in half precision
                        val = b.fpext(val, VF)
                self.st16(val, self.gep(c_rows[r], 16 * v, self.tc), s.c_type, masks[r][v])


# ---------------------------------------------------------------------------
# strip micro-kernels shared between kernels
#
# The strips of a dynamic kernel (its last M mod MR rows, see _Gen.strips) are one
# micro-kernel per row count, and inline they were 80% of the LLVM time of each
# dynamic GEMM module (BERT-base, Zen 4: 0.3 of 0.36 s per module with AVX-512, 0.5 of
# 0.62 s under CANNC_ISA=avx2), the same code in every GEMM of a model. Where a plan's
# operands are float32 in the layouts below, they are functions of a library module
# (native.target.register_library) instead, compiled once for the whole program:
#
#   void strip(ptr a, i64 lda, ptr b, i64 b_panel_stride, i64 kc, ptr c, i64 ldc,
#              i64 nr, i64 first)
#
# a rows x 16*NV tile over kc: A row-major (rows lda apart), B in 32-column panels of
# kc rows (b_panel_stride floats apart), the sums (plus the partial sums in C unless
# ``first``) stored to nr columns of C. The caller finishes them after the last K
# block (_Gen.strip_final): a few rows of C, still in L1.
# ---------------------------------------------------------------------------

STRIP_LIB = LIB_PREFIX + "gstrip_"
SHARED_STRIPS = True     # (False: every kernel inlines its strips)
STRIP_ARGS = (PTR, I64, PTR, I64, I64, PTR, I64, I64, I64)
_STRIP_NAME = re.compile(STRIP_LIB + r"(avx2|avx512)_r(\d+)v(\d+)([ls])([pn])([wm])$")


def shared_strips(spec: GemmSpec, plan: GemmPlan) -> bool:
    """Whether the strips of ``plan`` call the shared strip kernels."""
    return (SHARED_STRIPS and plan.strips and spec.compute == "f32"
            and spec.a_type == spec.c_type == "float32" and not spec.trans_a
            and plan.b_mode in ("prepacked", "pack")
            and not (plan.pack_a or plan.cvt_a or plan.dp or plan.f32_panels))


def strip_symbol(isa: str, rows: int, NV: int, long_k: bool, prefetch_c: bool,
                 whole: bool) -> str:
    """The shared strip kernel of a rows x 16*NV tile; long_k: K blocks longer than
    SUBCHAIN (summed in chains, see _Gen.subchains); whole: of all its columns (the
    loads and stores of a masked one, whose mask registers a wide tile spills in its k
    loop, took 1.3x the time of a GEMV from memory)."""
    return (f"{STRIP_LIB}{isa}_r{rows}v{NV}{'l' if long_k else 's'}"
            f"{'p' if prefetch_c else 'n'}{'w' if whole else 'm'}")


def strip_module(symbol: str) -> ir.Module:
    """The module that defines the shared strip kernel ``symbol`` (see strip_symbol)."""
    m = _STRIP_NAME.match(symbol)
    if m is None:
        raise ValueError(f"not a strip kernel: {symbol}")
    isa, rows, NV = m[1], int(m[2]), int(m[3])
    module = new_module(symbol)
    fn = ir.Function(module, ir.FunctionType(VOID, list(STRIP_ARGS)), name=symbol)
    fn.attributes.add("nounwind")
    # (only its types and layout matter: M, N and K are the call's)
    spec = GemmSpec(rows, 16 * NV, SUBCHAIN + (m[4] == "l"))
    plan = GemmPlan(MR=rows, NV=NV, NR=16 * NV, KC=spec.K, MC=rows, NC=16 * NV,
                    pack_a=False, b_mode="pack", prefetch_c=m[5] == "p", strips=False,
                    unroll=_strip_unroll(rows, NV, isa),
                    isa=isa, mt=1, nt=1, MB=rows, NB=16 * NV, ws_a=0, ws_b=0, ws_bytes=0)
    _Gen(module, fn, spec, plan, None).emit_strip(m[6] == "w")
    mark_vector_code(module)
    return module


register_library(STRIP_LIB, strip_module)


def emit_gemm(
    module: ir.Module,
    name: str,
    spec: GemmSpec,
    epilogue: Epilogue | None = None,
    *,
    tuning: dict | None = None,
    dims_slot: int | None = None,
) -> ir.Function:
    """Emit ``void name(ptr args, i64 tile_begin, i64 tile_end, ptr workspace)``.

    A dynamic ``spec`` (`dynamic_spec`) reads its runtime dims (``GEMM_DIMS``, as
    `gemm_dims` computes them) as i64 from ``args[dims_slot:]``.

    ``epilogue(builder, value, m, n)`` (optional) maps each final
    ``<16 x float>`` output vector (after alpha and bias) of row ``m`` and
    columns ``n .. n+15`` (i64 values) to the vector that is stored. It is
    emitted inside the kernel function (``builder.function.args`` are the
    kernel's arguments) and may be called for masked-off rows/columns, whose
    results are discarded; it must not have side effects on memory.
    ``tuning`` overrides planning decisions (see :func:`gemm_plan`); pass the
    same ``tuning`` to :func:`gemm_num_tiles`/:func:`gemm_workspace_bytes`.
    """
    plan = gemm_plan(spec, tuning)
    fn = abi_function(module, name)
    _Gen(module, fn, spec, plan, epilogue, dims_slot).emit()
    mark_vector_code(module)
    return fn
