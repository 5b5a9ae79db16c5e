"""Generator of fused scaled-dot-product attention kernels (LLVM IR).

The emitted kernel follows the kernel ABI (``cannc/codegen/ABI.md``)::

    void @name(ptr %args, i64 %tile_begin, i64 %tile_end, ptr %workspace)

with ``args = [Q, K, V, (mask,) O]`` and computes, for every (b, h)::

    S = (Q @ K^T) * scale
    S += mask            (mask="add")      or  S = where(mask, S, fill)  (mask="where")
    S[i, j] = -inf  for j > i + (Sk - Sq)  (causal)
    O = softmax(S, axis=-1) @ V

without ever materialising the score matrix: flash-attention style tiling
with an online softmax.

Tiles are ``(b, h, block of MQ query rows)``; ``b`` and ``h`` run slowest, so
the two halves of the tile range hold whole heads whenever ``B*H`` is even.
With ``causal`` the query blocks of a head are visited in zigzag order
(0, n-1, 1, n-2, ...) so that a split of the range still balances the work
(later query rows see more keys). For one query block the kernel loops over
blocks of ``KB`` keys (64), keeping per row the running max ``m``, the
running sum ``l`` and an output accumulator ``Oacc[MQ][Dv]`` in the per-core
workspace (a few KiB, L1-resident):

1. scores: a register-blocked micro-kernel (``MR_s`` rows x ``16*NV_s`` keys,
   4 x 64 by default: 16 ``<16 x float>`` phi accumulators updated with
   ``llvm.fma.v16f32`` over D, Q elements broadcast) computes ``q . k`` for
   the block. It reads ``K^T`` rows contiguous along the keys: K itself when
   it is stored pre-transposed (``[B,H,D,S]``, key stride 1), else ``K^T``
   packed into the workspace with 16x16 in-register transposes (gathers for
   odd layouts) -- once per (b, h) and call (``scope='bh'``), or per key
   block when one head's ``K^T`` exceeds 512 KiB (``scope='block'``). Its
   epilogue applies scale, mask, causal limit and key padding (-inf) to the
   accumulators, stores the scores to ``S[MQ][KB]`` and the lane-wise
   maximum of each row to a ``[MQ][16]`` buffer;
2. online softmax, 16 rows at a time with the rows in vector lanes: the
   block maxima come from one 16x16 shuffle-tree reduction, then
   ``m_new = max(m, block max)``, ``alpha = exp(m - m_new)`` are single
   vector operations; each row's scores become ``p = exp(s - m_new)`` in
   place (a float32 exp without special cases, see :meth:`_Gen.exp_nonpos`)
   and the row sums are reduced like the maxima into ``l = alpha*l + sum p``;
3. ``P @ V``: a second micro-kernel (``MR_v`` rows x up to 6 vectors of Dv)
   starts from ``alpha * Oacc`` (0 on the first block), adds
   ``sum_j p[r, j] V[j, :]`` (p broadcast, rows of V as vectors) and stores
   ``Oacc`` -- or, on the last key block, ``O = acc / l`` directly into the
   output. V is read in place when its rows are contiguous along Dv, else
   packed like K.

Rows that are not contiguous (the merged-heads ``[B,S,H,D]`` tensors of every
Hugging Face export, rows H*D apart) are prefetched ahead of use, which the
hardware prefetchers do not do for them: the next tile's query rows, the tile's
output rows (for writing) and, a share per tile, the next head's key rows into
L2 (``AttnPlan.prefetch_q / prefetch_o / prefetch_k``).

Every shape is handled with masked vector loads and stores (no scalar edge
loops); rows of a partial query block are clamped (duplicates of the last
row) inside the micro-kernels, which rewrite identical values. With causal
masking the key loop of a query block stops at its last visible key.

Special values (numpy / onnxruntime semantics of the unfused graph):

* a row whose scores are all ``fill`` (finite, e.g. the float32 lowest of a
  ``where`` mask) gets uniform weights, as numpy computes it;
* -inf scores (additive ``-inf`` masks, ``fill=-inf``, causal) have weight 0;
  a row with *all* scores -inf gives NaN (0/0), as numpy and onnxruntime do;
  so does a row with no visible key at all (causal with Sq > Sk);
* NaN anywhere in a row's scores makes the row NaN; a +inf score makes the
  row NaN (inf - inf), as numpy;
* with ``zero_nan_rows`` (torch's export guards the probabilities with
  ``Where(IsNaN(p), 0, p)``) those rows are 0 @ V instead: 0, or NaN in a column of
  V holding NaN or inf, except after a NaN or +inf score, where the row is 0 (see
  ``row_out``), and rows that see no key at all (causal), which are 0.

The exponentials are ``exp(s - m)`` with ``m`` the running maximum (never
overflowing; a row max of -inf is replaced by 0 so that blocks entirely at
-inf contribute 0 instead of NaN). Results agree with a float64 numpy
reference to rtol 1e-4 / atol 1e-5 (``tests/codegen/test_attention.py``).

Speed (Zen 4, one core, BERT-base B=8 H=12 D=64, S=128..512): ~90-100
GFLOP/s (4*B*H*S*S*D flops), 80-85% of the fp32 FMA peak: both
micro-kernels run near peak, the softmax costs ~10%. About 1.3-1.5x
onnxruntime's unfused MatMul/Div/Add/Softmax/MatMul and ~2x numpy
(``benchmarks/attention_bench.py``).

Reduced precision (``AttnSpec.dtypes``, ``AttnSpec.precision``): Q, K, V, a float
mask and O may each be float32, bfloat16 or float16, converted on load and store
(bf16 widened by a shift, fp16 by vcvtph2ps; stores round to nearest even); the
softmax, its running max / sum and the output accumulator are always float32.
The multiply (``AttnPlan.dot``):

* ``'f32'``: narrow operands are widened while packing (K^T and V once per head,
  the query block's rows once per tile into ``ws_q``), then the float32
  micro-kernels above run unchanged: exact products of the stored values;
* ``'bf16'`` (precision "bf16", avx512bf16, float32/bf16 operands with unit d
  strides): ``llvm.x86.avx512bf16.dpbf16ps.512`` in both micro-kernels. Q K^T
  pairs along the head dim (K^T packed as bf16 pairs of d, the ws_q rows as pairs
  broadcast per row); P V pairs along the keys: P is rounded to bf16 after the exp
  (``ws_p``; the row sum l adds the rounded weights, so O stays a convex combination
  of V's rows) and V is packed as pairs of keys interleaved per Dv lane. The
  default only where vdpbf16ps is the faster multiply: not on CPUs with AMX, where
  it measured 0.5-0.65x the two-port fp32 FMA rate (see `_default_dot`);
* ``'amx'`` (precision "bf16", the default where `amx.amx_usable` says yes; the
  layouts of 'bf16'; static specs with at least 16 query rows, and forms): Q K^T and
  P V on AMX tiles (``tdpbf16ps``, fp32 accumulation in tiles), in internal noinline
  functions whose tiles are all 16 rows x 64 bytes (``tile_scores``, ``tile_pv``:
  2 x 2 C tiles fed by 2 A and 2 B tiles, the 8 tile registers). The VNNI B operands
  are the 'bf16' mode's packed layouts: K^T as pairs of d (its rows padded with zeros
  to whole tiles of 32 d, in panels of KB keys, also for a static spec), V as pairs of
  keys (zero padded to whole key blocks, Dv to 32); the A operands are Q's bf16 rows
  (ws_q, d padded) and P rounded to bf16 (ws_p, [MQ][KB]). Per key block: the score
  tiles go to the fp32 scratch ws_s, a vector pass applies scale, mask, causal limit
  and -inf past the keys and takes the row maxima, the online softmax above runs
  unchanged (P rounded to bf16, l summing the rounded weights), the P V tiles go to
  ws_t and a vector pass merges them into Oacc (alpha * Oacc + T) or, on the last
  block, stores O. Query blocks of 64 rows, key blocks of 128 (AMX_MQ, AMX_KB);
  tiles always compute whole 32-row / 32-key blocks (rows past Sq are never stored).
  Measured 1x12x128x64 / 1x12x512x64, one thread: 2.5x / 2.7x the fp32 kernel
  (~290 / ~340 GFLOP/s); the fp32 vector softmax is then ~40% of the time.

Shape-polymorphic kernels (``ABI.md`` "Runtime dimensions"): emitted for an
`AttnForm` (a spec without B, Sq, Sk, see :func:`attention_tiling`), the kernel
reads B, Sq, Sk and every per-head / per-row stride at run time, i64 values
after the tensor pointers; the inner-loop strides that do not depend on them
(unit d strides, K's key stride H*D...) stay constants. Its plan is the static
plan of long sequences (4 x 64 score micro-kernel, 16-row query blocks); the
last chunk of a key block runs a micro-kernel only as wide as the keys left and
the softmax skips the vectors past them, so short or odd lengths cost about
what a static kernel costs. Packing K^T for a whole head (scope 'bh') uses
panels of KB keys, so its row stride is KB whatever Sk is. Same results
(bit for bit) as the static kernel of the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from llvmlite import ir

from ..ir.attnspec import AttnSpec, check_dtypes
from ..native.emit import (
    BF16,
    F32,
    I8,
    I32,
    I64,
    PTR,
    VOID,
    X86_AMX,
    i32,
    i64,
    masked_load,
    masked_store,
)
from ..native.emit import mangle as _mangle
from . import vmath
from .vec import VF, VI8, VI32, VI64, VM, VPTR, VecBuilder, abi_function, declare, wide_registers

I16 = ir.IntType(16)
VI16 = ir.VectorType(I16, 16)
VH = ir.VectorType(ir.HalfType(), 16)
VBF32 = ir.VectorType(BF16, 32)
VI32x32 = ir.VectorType(I32, 32)
_ETY = {"float32": F32, "bfloat16": ir.IntType(16), "float16": ir.HalfType()}

__all__ = [
    "RT_DIMS",
    "AttnForm",
    "AttnPlan",
    "AttnTiling",
    "attention_form",
    "attention_num_tiles",
    "attention_plan",
    "attention_precision_note",
    "attention_typed_spec",
    "PRECISION_ATTR",
    "attention_tiling",
    "attention_workspace_bytes",
    "emit_attention",
]

NEG_INF = float("-inf")
# ---------------------------------------------------------------------------
# the shape-polymorphic form (runtime B, Sq, Sk; see codegen/ABI.md)
# ---------------------------------------------------------------------------

STRIDE_FIELDS = ("q_strides", "k_strides", "v_strides", "o_strides", "mask_strides")
# the kernel's runtime dims: B, Sq, Sk, then the 4 strides of Q, K, V, O and the mask
RT_DIMS = ("B", "Sq", "Sk") + tuple(f"{f[0]}{a}" for f in STRIDE_FIELDS for a in "bhsd")
PACK_BH_BYTES = 512 << 10  # K^T / V of one head packed once per call up to this size
# The strides a kernel reads in its inner loops (compile-time when they do not depend on
# B, Sq, Sk): Q's d, K's key and d, V's key and d, O's d, the mask's key stride. Every
# other stride (per head or per row) is always a runtime dim.
_INNER = {"q_strides": (3,), "k_strides": (2, 3), "v_strides": (2, 3), "o_strides": (3,),
          "mask_strides": (3,)}
# the runtime size of each logical axis (b, h, s, d) of an operand; None: static
_AXIS_DIMS = {"q_strides": ("B", None, "Sq", None), "k_strides": ("B", None, "Sk", None),
              "v_strides": ("B", None, "Sk", None), "o_strides": ("B", None, "Sq", None),
              "mask_strides": ("B", None, "Sq", "Sk")}


@dataclass(frozen=True)
class AttnForm:
    """What a shape-polymorphic attention kernel is compiled for: an `AttnSpec`
    without ``B``, ``Sq``, ``Sk``, which the kernel reads at run time (``RT_DIMS``,
    stored as i64 after the tensor pointers), like every stride given as None
    here. The strides kept as ints are the inner-loop strides that do not depend
    on B, Sq or Sk (a unit d stride, K's key stride H*D...); ``scope`` is a size
    bucket (K^T/V packed once per head, or per key block for long sequences).
    Build one with :func:`attention_form`."""

    H: int
    D: int
    Dv: int
    q_strides: tuple
    k_strides: tuple
    v_strides: tuple
    o_strides: tuple
    scale: float = 1.0
    mask: str = "none"
    mask_strides: tuple = (None, None, None, 0)
    mask_dtype: str = "float32"
    fill: float = -3.4028234663852886e38
    causal: bool = False
    score_bias_after_scale: bool = True
    zero_nan_rows: bool = False
    scope: str = "bh"
    dtypes: tuple = ("float32",) * 4
    precision: str = "fp32"

    def __post_init__(self):
        check_dtypes(self)
        for f in ("H", "D", "Dv"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"AttnForm.{f} must be >= 1, got {getattr(self, f)}")
        for f in STRIDE_FIELDS:
            st = tuple(None if x is None else int(x) for x in getattr(self, f))
            if len(st) != 4:
                raise ValueError(f"AttnForm.{f} needs 4 strides (b, h, s, d), got {st}")
            object.__setattr__(self, f, st)
        if self.scope not in ("bh", "block"):
            raise ValueError(f"AttnForm.scope must be 'bh' or 'block', got {self.scope!r}")


def _static_strides(sizes, strides, kinds) -> tuple[bool, ...]:
    """Per axis: does the stride depend on no runtime size? The operand is a
    permutation of a dense tensor (zero strides broadcast): its axes nest by
    increasing stride, each stride being the product of the sizes nested inside.
    Ties (an axis of size 1 between two others) put size-1 axes inside, then the
    usual order d, s, h, b, which is right for the layouts exporters make; an
    unlucky tie or a non-dense operand only makes a stride runtime (or another key)."""
    axes = sorted((a for a in range(4) if strides[a] != 0),
                  key=lambda a: (strides[a], sizes[a] != 1, 3 - a))
    out = [True] * 4
    acc, dyn = 1, False
    for a in axes:
        out[a] = not dyn and strides[a] == acc
        dyn = dyn or kinds[a] is not None or strides[a] != acc
        acc = strides[a] * sizes[a]
    return tuple(out)


def attention_form(spec: AttnSpec) -> tuple[AttnForm, tuple[int, ...]]:
    """The shape-polymorphic form of ``spec`` and the runtime dims (``RT_DIMS``) of
    its shapes: a kernel emitted for the form computes ``spec``'s attention, and
    that of every other spec with the same form, given its dims."""
    sizes = {"B": spec.B, "Sq": spec.Sq, "Sk": spec.Sk}
    forms = {}
    for f in STRIDE_FIELDS:
        st = getattr(spec, f)
        kinds = _AXIS_DIMS[f]
        if f == "mask_strides" and spec.mask == "none":
            forms[f] = (None, None, None, 0)
            continue
        if f == "mask_strides" and st[3] == 0 and spec.Sk == 1:
            st = st[:3] + (1,)        # one key: broadcast along keys or not is the same
        d = spec.D if f in ("q_strides", "k_strides") else spec.Dv
        n = tuple(sizes[k] if k else (spec.H if a == 1 else d) for a, k in enumerate(kinds))
        static = _static_strides(n, st, kinds)
        forms[f] = tuple(st[a] if a in _INNER[f] and static[a] else None for a in range(4))
    k_pack = forms["k_strides"][2] != 1
    v_pack = not (forms["v_strides"][3] == 1 or spec.Dv == 1)
    nvd = _cdiv(spec.Dv, 16)
    bh_bytes = 4 * _rup(spec.Sk, 64) * (spec.D * k_pack + 16 * nvd * v_pack)
    form = AttnForm(H=spec.H, D=spec.D, Dv=spec.Dv, scale=spec.scale, mask=spec.mask,
                    mask_dtype=spec.mask_dtype, fill=spec.fill, causal=spec.causal,
                    score_bias_after_scale=spec.score_bias_after_scale,
                    zero_nan_rows=spec.zero_nan_rows,
                    dtypes=spec.dtypes, precision=spec.precision,
                    scope="bh" if bh_bytes <= PACK_BH_BYTES else "block", **forms)
    dims = (spec.B, spec.Sq, spec.Sk) + tuple(x for f in STRIDE_FIELDS for x in getattr(spec, f))
    return form, dims


# ---------------------------------------------------------------------------
# planning
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnPlan:
    MQ: int  # query rows per tile
    KB: int  # keys per block
    MR_s: int  # score micro-kernel rows
    NV_s: int  # score micro-kernel key vectors (16 keys each)
    MR_v: int  # P@V micro-kernel rows
    v_chunks: tuple  # ((first Dv vector, vectors), ...) of the P@V micro-kernel
    nq: int  # query blocks per (b, h)
    k_mode: str  # 'direct' (K^T rows contiguous) | 'pack'
    v_mode: str  # 'direct' (V rows contiguous) | 'pack'
    scope: str  # packing per 'bh' (whole head, once per call) or per key 'block'
    ldk: int  # packed K^T row stride (elements)
    Dv_pad: int
    zigzag: bool
    prefetch_o: bool  # write-prefetch the tile's output rows
    prefetch_q: bool  # prefetch the next tile's query rows
    prefetch_k: bool  # prefetch the next head's key rows (into L2)
    unroll_d: int
    unroll_j: int
    dot: str  # 'f32' (FMA; narrow operands widened on load) | 'bf16' (vdpbf16ps) | 'amx'
    ws_q: int  # narrow Q or dot 'bf16': the query block's rows, float32 [MQ][D] or bf16 pairs
    #            [MQ][D2]
    ws_p: int  # dot 'bf16': P rounded to bf16 [MQ][KB]
    ws_k: int  # byte offsets in the workspace
    ws_v: int
    ws_s: int
    ws_o: int
    ws_m: int
    ws_l: int
    ws_a: int
    ws_x: int  # [MQp][16] row maxima of the block
    ws_y: int  # [16][16] row sums of one 16-row group
    ws_u: int  # [16] the maxima used for exp
    ws_bytes: int
    ws_t: int = 0  # dot 'amx': the block's P @ V tiles, float32 [MQ][Dv_pad]

    def num_tiles(self, spec: AttnSpec) -> int:
        return spec.B * spec.H * self.nq


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rup(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _chunks(nvec: int, max_nv: int) -> tuple:
    n = _cdiv(nvec, max_nv)
    per = _cdiv(nvec, n)
    out, v = [], 0
    while v < nvec:
        out.append((v, min(per, nvec - v)))
        v += per
    return tuple(out)


AMX_MQ = 64   # dot 'amx': query rows per tile (a multiple of 32)
AMX_KB = 128  # keys per block (a multiple of 32)


def _krows(D: int, dot: str) -> int:
    """Rows of packed K^T: D floats, D/2 bf16 pairs, or for AMX the pairs padded to whole
    tiles (16 pairs, zeros)."""
    return D if dot == "f32" else _rup(_cdiv(D, 2), 16) if dot == "amx" else _cdiv(D, 2)


def _has_bf16_dot() -> bool:
    from ..native.target import host
    return host().has("avx512bf16")


def _bf16_dot_ok(spec) -> bool:
    """Can Q K^T and P V run on vdpbf16ps (pairs along d, then along keys)?"""
    return (all(d in ("float32", "bfloat16") for d in spec.dtypes[:3])
            and spec.q_strides[3] == 1 and (spec.k_strides[3] == 1 or spec.k_strides[2] == 1)
            and (spec.v_strides[3] == 1 or spec.Dv == 1) and _has_bf16_dot())


def _amx_why_not(spec) -> str | None:
    """Why Q K^T and P V cannot run on AMX tiles (None: they can): the layouts of the
    'bf16' mode (Q, K, V float32 or bf16, unit d strides or K stored transposed), a CPU
    with avx512bf16 and usable AMX tiles (`amx.amx_usable`)."""
    if not all(d in ("float32", "bfloat16") for d in spec.dtypes[:3]):
        return "Q, K, V not float32/bfloat16"
    if not (spec.q_strides[3] == 1 and (spec.k_strides[3] == 1 or spec.k_strides[2] == 1)
            and (spec.v_strides[3] == 1 or spec.Dv == 1)):
        return "Q, K or V without a unit d stride (K: or key stride)"
    if not _has_bf16_dot():
        return "no avx512bf16"
    from .amx import amx_usable
    return amx_usable()


def _default_dot(spec) -> str:
    """With precision bf16: AMX tiles where they are usable (and the layouts allow:
    `_amx_why_not`; a static spec with at least 16 query rows, as a tile computes 32),
    else vdpbf16ps where it is the faster multiply: not on CPUs with AMX (Sapphire Rapids
    and later), where vdpbf16ps (one port) measured 0.5-0.65x the fp32 FMA rate (two
    ports), so bf16 operands are widened instead."""
    from ..native.target import host
    if spec.precision != "bf16":
        return "f32"
    if _amx_why_not(spec) is None and (isinstance(spec, AttnForm) or spec.Sq >= 16):
        return "amx"
    fast = not host().has("amx-bf16")
    return "bf16" if _bf16_dot_ok(spec) and fast else "f32"


PRECISION_ATTR = "cannc_precision"   # node attribute set by the mixed-precision pass
_NARROW_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}


def attention_typed_spec(spec: AttnSpec, in_types, out_types, precision: str | None = None
                         ) -> AttnSpec:
    """``spec`` with the element types of a node's operands (in_types: Q, K, V, (mask);
    out_types: O) and its multiply precision: ``precision`` (the node's cannc_precision
    attribute) if given, else the narrow type of Q, K or V (bf16 before fp16), else fp32."""
    import dataclasses

    def name(t):
        return np.dtype(t.dtype).name

    dts = tuple(name(t) for t in in_types[:3]) + (name(out_types[0]),)
    mdt = spec.mask_dtype
    if spec.mask != "none" and len(in_types) > 3 and in_types[3] is not None:
        mdt = name(in_types[3])
    if precision is None:
        narrow = [_NARROW_PRECISION[d] for d in dts[:3] if d in _NARROW_PRECISION]
        precision = "bf16" if "bf16" in narrow else narrow[0] if narrow else "fp32"
    return dataclasses.replace(spec, dtypes=dts, mask_dtype=mdt, precision=str(precision))


def attention_precision_note(spec, tuning: dict | None = None) -> str:
    """How a kernel of ``spec`` multiplies (``ctx.notes['precision']``)."""
    plan = attention_plan(spec, tuning)
    narrow = sorted({d for d in spec.dtypes if d != "float32"})
    store = f" ({'/'.join(narrow)} storage)" if narrow else ""
    if plan.dot == "amx":
        return "bf16 AMX (P rounded to bf16), fp32 softmax" + store
    if plan.dot == "bf16":
        return "bf16 avx512_bf16 (P rounded to bf16), fp32 softmax" + store
    if spec.precision == "bf16":
        from ..native.target import host
        why = " (no avx512_bf16)" if not _has_bf16_dot() else \
            " (AMX CPU: vdpbf16ps slower than fp32 FMA)" if host().has("amx-bf16") else ""
        return f"bf16 widened to fp32{why}, fp32 FMA" + store
    if spec.precision == "fp16":
        return "fp16 storage, fp32 FMA" if narrow == ["float16"] else "fp16, fp32 FMA" + store
    return "fp32" + store


@lru_cache(maxsize=256)
def _plan(spec: AttnSpec | AttnForm, tuning: tuple = (), wide: bool = True) -> AttnPlan:
    """The plan of a static spec, or of a form (runtime B, Sq, Sk: ``nq`` = 0, and
    with ``scope='bh'`` K^T is packed in panels of KB keys, ``ldk`` = KB, with V
    after it at a runtime offset; ``ws_bytes`` is then the fixed part), for AVX-512's
    32 registers (``wide``) or AVX2's 16 (a key of the cache: a process whose target
    changes, as the AVX2 tests make it, gets the plans of each)."""
    tun = dict(tuning)
    poly = isinstance(spec, AttnForm)
    Sq = 1 << 30 if poly else spec.Sq   # a form plans for long sequences
    nvd = _cdiv(spec.Dv, 16)
    v_chunks = tun.get("v_chunks")
    if v_chunks is None:
        v_chunks = _chunks(nvd, tun.get("NV_v", 6 if wide else 2))
    v_chunks = tuple(tuple(c) for c in v_chunks)
    max_nv = max(c[1] for c in v_chunks)
    if wide:
        # 16..24 accumulators (8 rows for Dv <= 32); rows dividing 16 keep MQ = 16
        # (no more rows than Sq: decoding with Sq = 1 must not compute 4 copies)
        MR_v = tun.get("MR_v", min(Sq, 8 if max_nv <= 2 else 4))
        NV_s = tun.get("NV_s", 4 if poly else min(4, _cdiv(spec.Sk, 16)))
        MR_s = tun.get("MR_s", min(Sq, 4 if NV_s >= 3 else 8))  # 8..16 accumulators
    else:
        # AVX2 (16 ymm): at most ACC_BUDGET_AVX2 <16 x float> accumulators; 4 rows keep
        # MQ = 16
        MR_v = tun.get("MR_v", min(Sq, 4 if max_nv <= 1 else 2))
        NV_s = tun.get("NV_s", 1)
        MR_s = tun.get("MR_s", min(Sq, 4))
    KB = tun.get("KB", 64)
    KB = _rup(KB if poly else min(KB, _rup(spec.Sk, 16 * NV_s)), 16 * NV_s)
    step = math.lcm(MR_s, MR_v)
    dot = tun.get("dot", _default_dot(spec))
    if dot not in ("f32", "bf16", "amx"):
        raise ValueError(f"dot must be 'f32', 'bf16' or 'amx', got {dot!r}")
    if dot == "bf16" and not _bf16_dot_ok(spec):
        raise ValueError("dot 'bf16' needs float32/bfloat16 Q, K, V with unit d strides "
                         "and a CPU with avx512bf16")
    amx = dot == "amx"
    if amx:
        why = _amx_why_not(spec)
        if why:
            raise ValueError(f"dot 'amx': {why}")
        # tiles of 16 rows x 32 bf16: the query block, the key block and Dv in pairs of
        # tiles (32), Q/K^T d padded to 32 (zeros)
        KB = _rup(tun.get("KB", AMX_KB), 32)
        if not poly:
            KB = min(KB, _rup(spec.Sk, 32))
        NV_s = KB // 16   # the softmax reads every vector of a block (no stale chunks)
        step = 32
    MQ = tun.get("MQ", max(16, step) if not amx else AMX_MQ)
    if not poly:
        MQ = max(1, min(MQ, _rup(spec.Sq, step)))
        if "MQ" not in tun:
            # at least 4 tiles (2 per core) when the rows allow it
            while (spec.B * spec.H * _cdiv(spec.Sq, MQ) < 4 and MQ > step
                   and MQ % (2 * step) == 0):
                MQ //= 2
    if (poly or amx) and MQ % step:
        raise ValueError(f"MQ {MQ} is not a multiple of the micro-kernel rows {step}")
    nq = 0 if poly else _cdiv(spec.Sq, MQ)

    qdt, kdt, vdt, _ = spec.dtypes
    pair = dot in ("bf16", "amx")
    # K^T / V packed in float32 (widened), or in bf16 pairs (dot 'bf16'); read in place
    # only when they are float32 already
    k_mode = "direct" if spec.k_strides[2] == 1 and kdt == "float32" and not pair else "pack"
    v_mode = "direct" if (spec.v_strides[3] == 1 or spec.Dv == 1) and vdt == "float32" \
        and not pair else "pack"
    k_mode = tun.get("k_mode", k_mode)
    v_mode = tun.get("v_mode", v_mode)
    if k_mode == "direct" and (spec.k_strides[2] != 1 or kdt != "float32" or pair):
        raise ValueError("k_mode 'direct' needs float32 K stored with key stride 1")
    if v_mode == "direct" and (not (spec.v_strides[3] == 1 or spec.Dv == 1)
                               or vdt != "float32" or pair):
        raise ValueError("v_mode 'direct' needs float32 V rows contiguous along Dv")
    # rows of packed K^T: D (floats) or D2 (bf16 pairs of d); V: one row per key, or per
    # pair of keys (16 lanes of Dv x 2 keys per vector)
    krows = _krows(spec.D, dot)
    vdiv = 2 if pair else 1
    Dv_pad = _rup(spec.Dv, 32) if amx else 16 * nvd
    if poly:
        scope = tun.get("scope", spec.scope)
        ldk = KB
    else:
        Sk_pad = _rup(spec.Sk, KB if amx else 16)
        bh_bytes = (krows * Sk_pad if k_mode == "pack" else 0) * 4 + (
            Sk_pad // vdiv * Dv_pad if v_mode == "pack" else 0
        ) * 4
        scope = tun.get("scope", "bh" if bh_bytes <= PACK_BH_BYTES else "block")
        # dot 'amx' packs K^T in panels of KB keys (a form's layout) also for a spec
        ldk = Sk_pad if scope == "bh" and not amx else KB

    off = 0

    def take(nbytes, phase=0):
        # buffers start at distinct offsets modulo 4 KiB (phase * 1088 bytes)
        # so that loads from one after stores to another do not 4K-alias
        nonlocal off
        at = off + (phase * 1088 - off) % 4096 if phase else off
        off = _rup(at + nbytes, 64)
        return at

    if not poly:
        rows_k = Sk_pad if scope == "bh" else KB
        ws_k = take(krows * rows_k * 4 if k_mode == "pack" else 0)
        ws_v = take(rows_k // vdiv * Dv_pad * 4 if v_mode == "pack" else 0)
    ws_s = take(MQ * KB * 4, 1)
    ws_q = take(MQ * krows * 4 if pair or qdt != "float32" else 0)
    ws_p = take(MQ * KB * 2 if pair else 0)
    ws_o = take(MQ * Dv_pad * 4, 2)
    ws_t = take(MQ * Dv_pad * 4 if amx else 0)
    MQp = _rup(MQ, 16)
    ws_m = take(MQp * 4, 3)
    ws_l = take(MQp * 4)
    ws_a = take(MQp * 4)
    ws_x = take(MQp * 16 * 4)
    ws_y = take(16 * 16 * 4)
    ws_u = take(16 * 4)
    if poly:
        # the packed K^T and V last: with scope 'bh' their size depends on Sk
        off = _rup(off, 4096)
        blk = scope == "block"
        ws_k = take(krows * KB * 4 if k_mode == "pack" and blk else 0)
        ws_v = take(KB // vdiv * Dv_pad * 4 if v_mode == "pack" and blk else 0)
    return AttnPlan(
        MQ=MQ,
        KB=KB,
        MR_s=MR_s,
        NV_s=NV_s,
        MR_v=MR_v,
        v_chunks=v_chunks,
        nq=nq,
        k_mode=k_mode,
        v_mode=v_mode,
        scope=scope,
        ldk=ldk,
        Dv_pad=Dv_pad,
        zigzag=tun.get("zigzag", spec.causal and (poly or nq > 2)),
        # rows that are not contiguous (merged heads [B,S,H,D], H*D apart) miss the
        # caches from one tile to the next, where the hardware prefetchers follow
        # contiguous ones: B=8 H=12 S=128 D=32 took 1.25x as long with Q, K, V and O
        # merged as in [B,H,S,D], 1.05x with these prefetches (Zen 4, one core); on
        # contiguous rows they cost 0-4%
        prefetch_o=tun.get("prefetch_o", spec.o_strides[2] != spec.Dv),
        prefetch_q=tun.get("prefetch_q", spec.q_strides[2] != spec.D),
        prefetch_k=tun.get("prefetch_k", spec.k_strides[3] == 1 and spec.k_strides[2] != spec.D
                           and scope == "bh"),
        unroll_d=tun.get("unroll_d", 4),
        unroll_j=tun.get("unroll_j", 4),
        dot=dot,
        ws_q=ws_q,
        ws_p=ws_p,
        ws_k=ws_k,
        ws_v=ws_v,
        ws_s=ws_s,
        ws_o=ws_o,
        ws_m=ws_m,
        ws_l=ws_l,
        ws_a=ws_a,
        ws_x=ws_x,
        ws_y=ws_y,
        ws_u=ws_u,
        ws_bytes=max(64, off),
        ws_t=ws_t,
    )


def _bh_pack_bytes(form: AttnForm, plan: AttnPlan, Sk: int) -> tuple[int, int]:
    """Bytes of one head's packed K^T panels and V rows (scope 'bh' of a form)."""
    if plan.scope != "bh":
        return 0, 0
    rows = _rup(Sk, plan.KB)
    pair = plan.dot in ("bf16", "amx")
    krows = _krows(form.D, plan.dot)
    kb = krows * rows * 4 if plan.k_mode == "pack" else 0
    vb = rows // (2 if pair else 1) * plan.Dv_pad * 4 if plan.v_mode == "pack" else 0
    return kb, vb


def _tuning_key(tuning):
    def freeze(v):
        if isinstance(v, (list, tuple)):
            return tuple(freeze(x) for x in v)
        return v

    return tuple(sorted((k, freeze(v)) for k, v in (tuning or {}).items()))


def attention_plan(spec: AttnSpec, tuning: dict | None = None) -> AttnPlan:
    """Blocking decisions for ``spec``; ``tuning`` overrides them (MQ, KB, MR_s,
    NV_s, MR_v, NV_v, v_chunks, k_mode, v_mode, scope, zigzag, unroll_d, unroll_j,
    prefetch_q, prefetch_o, prefetch_k)."""
    return _plan(spec, _tuning_key(tuning), wide_registers())


def attention_num_tiles(spec: AttnSpec, tuning: dict | None = None) -> int:
    return attention_plan(spec, tuning).num_tiles(spec)


def attention_workspace_bytes(spec: AttnSpec, tuning: dict | None = None) -> int:
    return attention_plan(spec, tuning).ws_bytes


@dataclass(frozen=True)
class AttnTiling:
    """The host tiling of ``spec``'s shapes for the shape-polymorphic kernel."""

    form: AttnForm
    dims: tuple[int, ...]  # RT_DIMS values
    num_tiles: int
    workspace_bytes: int


def attention_tiling(spec: AttnSpec, tuning: dict | None = None) -> AttnTiling:
    """Form, runtime dims, tiles and workspace of ``spec``'s shapes: the kernel of
    ``emit_attention(module, name, tiling.form)`` serves every spec whose form is
    the same, called with its own dims (CANN's tiling-function pattern)."""
    form, dims = attention_form(spec)
    plan = attention_plan(form, tuning)
    kb, vb = _bh_pack_bytes(form, plan, spec.Sk)
    return AttnTiling(form, dims, spec.B * spec.H * _cdiv(spec.Sq, plan.MQ),
                      plan.ws_bytes + kb + vb)


# ---------------------------------------------------------------------------
# code generation
# ---------------------------------------------------------------------------


class _Gen(VecBuilder):
    """Sizes and strides are Python ints for a static spec; for a form, B, Sq, Sk
    and the strides the form leaves open are i64 values read from the runtime dims
    (``self.Sq``, ``self.Sk``, ``self.st``): the integer helpers below fold ints
    and emit instructions for values, so both kernels come from one code path."""

    def __init__(self, module: ir.Module, fn: ir.Function, spec: AttnSpec | AttnForm,
                 plan: AttnPlan):
        super().__init__(module, fn)
        self.s = spec
        self.p = plan
        self.poly = isinstance(spec, AttnForm)
        # byte masks: a bool mask is read as i8
        self.gather8 = declare(
            module, "llvm.masked.gather.v16i8.v16p0", VI8, [VPTR, I32, VM, VI8]
        )
        self.iota32 = ir.Constant(VI32, list(range(16)))
        self.iota64 = ir.Constant(VI64, list(range(16)))
        # bf16 pairs (K^T pairs of d, V pairs of keys, Q pairs, P rounded to bf16): dot
        # 'bf16' (vdpbf16ps) and 'amx' (the same layouts are the tiles' VNNI layouts)
        self.pair = plan.dot in ("bf16", "amx")
        self.amx = plan.dot == "amx"
        self._tile_fns: dict = {}
        # element types of Q, K, V, O and a float mask (narrow ones converted on load/store)
        self.dt = dict(zip("qkvo", spec.dtypes))
        self.dt["m"] = spec.mask_dtype
        self.ety = {k: _ETY[d] for k, d in self.dt.items() if d != "bool"}
        self.ety["m"] = I8 if spec.mask_dtype == "bool" else self.ety["m"]
        self.krows = _krows(spec.D, plan.dot)
        if plan.dot == "bf16":
            self.dpbf16 = declare(module, "llvm.x86.avx512bf16.dpbf16ps.512", VF,
                                  [VF, VBF32, VBF32])

    # -- element types: narrow operands converted on load and store ----------------------
    def load_cvt(self, ptr, mask, dt: str):
        """16 elements of type dt at ptr (masked-off lanes 0) as <16 x float>."""
        b = self.b
        if dt == "float32":
            return self.load_v(ptr, mask)
        vt = VI16 if dt == "bfloat16" else VH
        if mask is None:
            x = b.load(ptr, typ=vt, align=2)
        else:
            x = masked_load(b, ptr, mask, ir.Constant(vt, None), 2)
        return self.widen(x, dt)

    def gather_cvt(self, ptrs, mask, dt: str):
        if dt == "float32":
            return self.gather(ptrs, mask)
        vt = VI16 if dt == "bfloat16" else VH
        f = self.intr(f"llvm.masked.gather.{_mangle(vt)}.v16p0", vt, [VPTR, I32, VM, vt])
        return self.widen(self.b.call(f, [ptrs, i32(2), mask, ir.Constant(vt, None)]), dt)

    def widen(self, x, dt: str):
        """<16 x i16> bf16 bits or <16 x half> -> <16 x float> (exact)."""
        b = self.b
        if dt == "float16":
            return b.fpext(x, VF)
        return b.bitcast(b.shl(b.zext(x, VI32), ir.Constant(VI32, [16] * 16)), VF)

    def load_s(self, ptr, dt: str):
        """One element of type dt at ptr as a float."""
        b = self.b
        if dt == "float32":
            return self.load_f(ptr)
        if dt == "float16":
            return b.fpext(b.load(ptr, typ=ir.HalfType(), align=2), F32)
        x = b.zext(b.load(ptr, typ=ir.IntType(16), align=2), I32)
        return b.bitcast(b.shl(x, ir.Constant(I32, 16)), F32)

    def narrow(self, val, dt: str):
        """<16 x float> -> <16 x i16> bf16 bits (round to nearest even, NaN kept quiet) or
        <16 x half> (fptrunc: vcvtps2ph)."""
        b = self.b
        if dt == "float16":
            return b.fptrunc(val, VH)
        if self.pair:
            # the CPU has avx512bf16: vcvtneps2bf16 (round to nearest even, NaN quiet)
            return b.bitcast(b.fptrunc(val, ir.VectorType(BF16, 16)), VI16)
        c = lambda x: ir.Constant(VI32, [x] * 16)
        bits = b.bitcast(val, VI32)
        lsb = b.and_(b.lshr(bits, c(16)), c(1))
        rnd = b.lshr(b.add(b.add(bits, c(0x7FFF)), lsb), c(16))
        nan = b.fcmp_unordered("uno", val, val)
        q = b.or_(b.lshr(bits, c(16)), c(0x40))
        # the low halves by a shuffle, not a trunc: LLVM 22 turns a trunc feeding a masked
        # store with one lane enabled into a 32-bit store (it writes the next element)
        x = b.bitcast(b.select(nan, q, rnd), ir.VectorType(ir.IntType(16), 32))
        return b.shuffle_vector(x, ir.Constant(x.type, None),
                                ir.Constant(VI32, list(range(0, 32, 2))))

    def store_cvt(self, val, ptr, mask, dt: str):
        """Store <16 x float> val as 16 elements of type dt at ptr (mask: lanes written)."""
        if dt == "float32":
            self.store_v(val, ptr, mask)
            return
        x = self.narrow(val, dt)
        if mask is None:
            self.b.store(x, ptr, align=2)
        else:
            masked_store(self.b, x, ptr, mask, 2)

    def scatter_cvt(self, val, ptrs, mask, dt: str):
        if dt == "float32":
            self.scatter(val, ptrs, mask)
            return
        x = self.narrow(val, dt)
        vt = x.type
        f = self.intr(f"llvm.masked.scatter.{_mangle(vt)}.v16p0", VOID, [vt, VPTR, I32, VM])
        self.b.call(f, [x, ptrs, i32(2), self.ones_m if mask is None else mask])

    def bf16_pairs(self, lo, hi):
        """Two <16 x float> (elements 0..15, 16..31) -> 16 pairs of bf16 in a <16 x float>
        container (lane i = elements 2i, 2i+1)."""
        x = self.b.shuffle_vector(self.narrow(lo, "bfloat16"), self.narrow(hi, "bfloat16"),
                                  ir.Constant(VI32x32, list(range(32))))
        return self.b.bitcast(x, VF)

    def interleave_bf16(self, a, c):
        """<16 x float> rows a, c -> <16 x float> container of pairs (a[i], c[i]) in bf16."""
        idx = [k // 2 + 16 * (k % 2) for k in range(32)]
        x = self.b.shuffle_vector(self.narrow(a, "bfloat16"), self.narrow(c, "bfloat16"),
                                  ir.Constant(VI32x32, idx))
        return self.b.bitcast(x, VF)

    def dot2(self, acc, x, y):
        """acc + pairwise bf16 dot products (vdpbf16ps), x and y <16 x float> containers."""
        b = self.b
        return b.call(self.dpbf16, [acc, b.bitcast(x, VBF32), b.bitcast(y, VBF32)])

    # -- small utilities ---------------------------------------------------
    @staticmethod
    def v(x):
        """An i64 value of an int or a value."""
        return i64(x) if isinstance(x, int) else x

    def mul(self, a, c):
        """a * c as an i64 value (a, c ints or values)."""
        return self.v(self.imul(a, c))

    def imul(self, a, c):
        """a * c: an int when both are ints (or one is 0), else an i64 value."""
        if isinstance(a, int) and isinstance(c, int):
            return a * c
        if isinstance(a, int) or isinstance(c, int):
            k, x = (a, c) if isinstance(a, int) else (c, a)
            return 0 if k == 0 else x if k == 1 else self.b.mul(x, i64(k))
        return self.b.mul(a, c)

    def iadd(self, a, c):
        """a + c: an int when both are ints, else an i64 value."""
        if isinstance(a, int) and isinstance(c, int):
            return a + c
        if isinstance(a, int) and a == 0 or isinstance(c, int) and c == 0:
            return c if isinstance(a, int) else a
        return self.b.add(self.v(a), self.v(c))

    def isub(self, a, c):
        return a - c if isinstance(a, int) and isinstance(c, int) else \
            self.b.sub(self.v(a), self.v(c))

    def lanes_times(self, first: int, st, nbytes: int):
        """<16 x i64> byte offsets (first + lane) * st * nbytes."""
        if isinstance(st, int):
            return ir.Constant(VI64, [(first + k) * st * nbytes for k in range(16)])
        lanes = ir.Constant(VI64, [(first + k) * nbytes for k in range(16)])
        return self.b.mul(lanes, self.splat(st, VI64))

    def lanes_lt(self, count, first: int = 0):
        """Lanes first + i < count (count an i64 value or int)."""
        if isinstance(count, int):
            return ir.Constant(VM, [1 if first + i < count else 0 for i in range(16)])
        c32 = self.b.trunc(self.smax(self.smin(count, 1 << 30), -(1 << 30)), I32)
        lanes = self.iota32 if first == 0 else ir.Constant(VI32, [first + i for i in range(16)])
        return self.b.icmp_signed("<", lanes, self.splat(c32, VI32))

    def load_f(self, ptr):
        return self.b.load(ptr, typ=F32, align=4)

    def fmax(self, a, c):
        # ordered: NaN in a is dropped (the NaN still reaches p = exp(NaN))
        return self.b.select(self.b.fcmp_ordered(">", a, c), a, c)

    def exp_nonpos(self, x):
        """e^x for x <= 0 or NaN (the softmax's s - max), <16 x float>.

        On AVX-512: x clamped at -104 (NaN kept), vmath's range reduction and
        degree-5 polynomial (rel. error 1.9e-7), and 2^k applied by vscalefps, which
        makes the denormal results (0 below 2^-150) at full speed: 11 instructions
        against 15 below. With D = 32 the exponentials were ~10% of the kernel.

        Elsewhere: vmath's range reduction (k = round(x / ln2), r = x - k ln2 in two
        parts) and polynomial (< 1 ulp), 2^k added into the exponent bits, and none
        of vmath.exp's overflow / denormal / NaN special cases. Results below 2^-126
        (x < -87.3) are flushed to 0 (numpy gives denormals there: an absolute
        difference < 1.2e-38 per weight); NaN propagates.
        """
        e = vmath._E(self.b, VF)
        if e.has_scalef():
            p, kf, _ = vmath._exp_reduced_f32(e, e.clamp_keep_nan(x, -104.0, None),
                                              coeffs=vmath._EXP_P5)
            return e.scalef(p, kf)
        b = self.b
        c = lambda v: self.splat(float(v))
        below = b.fcmp_ordered("<", x, c(-87.3))
        xc = b.select(below, c(-87.3), x)
        # t = magic + k; (bits(t) << 23) == k << 23 (the magic's bits shift out)
        t = self.fma(xc, c(vmath._LOG2E), c(vmath._MAGIC32))
        kf = b.fsub(t, c(vmath._MAGIC32))
        r = self.fma(kf, c(-vmath._LN2_HI), xc)
        r = self.fma(kf, c(-vmath._LN2_LO), r)
        P = (1.0, 1.0) + tuple(vmath._EXP_P)
        pp = c(P[-1])
        for cf in reversed(P[:-1]):
            pp = self.fma(pp, r, c(cf))
        # x >= -87.3 gives k >= -126 and p >= 1 when k == -126: always normal
        kbits = b.shl(b.bitcast(t, VI32), ir.Constant(VI32, [23] * 16))
        res = b.bitcast(b.add(b.bitcast(pp, VI32), kbits), VF)
        return b.select(below, self.zero_v, res)

    # -- kernel ------------------------------------------------------------
    def setup_dims(self, args):
        """self.Sq, self.Sk and self.st[field] (4 strides): ints of the spec, or for a
        form i64 values loaded from the runtime dims after the tensor pointers."""
        s, b = self.s, self.b
        if not self.poly:
            self.Sq, self.Sk = s.Sq, s.Sk
            self.st = {f: getattr(s, f) for f in STRIDE_FIELDS}
            self.diag = s.Sk - s.Sq
            return
        n_ptr = 5 if s.mask != "none" else 4

        def dim(name):
            slot = self.gep(args, n_ptr + RT_DIMS.index(name), PTR)
            return b.load(slot, typ=I64, name=name)

        self.Sq, self.Sk = dim("Sq"), dim("Sk")
        self.diag = b.sub(self.Sk, self.Sq, name="diag")  # causal: key j visible iff j <= i + diag
        self.st = {
            f: tuple(dim(f"{f[0]}{a}") if x is None else x for a, x in zip("bhsd", getattr(s, f)))
            for f in STRIDE_FIELDS
        }

    def emit(self):
        s, p, b = self.s, self.p, self.b
        args, tb, te, ws = self.fn.args
        self.setup_dims(args)
        qst, kst, vst, ost = (self.st[f] for f in STRIDE_FIELDS[:4])
        Q, K, V = self.arg(args, 0), self.arg(args, 1), self.arg(args, 2)
        Mk = self.arg(args, 3) if s.mask != "none" else None
        O = self.arg(args, 4 if s.mask != "none" else 3)
        self.ws_k = self.gep(ws, p.ws_k, I8)
        self.ws_v = self.gep(ws, p.ws_v, I8)
        # a form's K^T panels: key block kb0 starts at ws_k + kb0 * D, rows of KB keys
        # (dot 'amx': also a static spec's, so that a block's tiles have row stride KB)
        self.panels = (self.poly or self.amx) and p.scope == "bh"
        self.ws_t = self.gep(ws, p.ws_t, I8)
        if self.poly and self.panels and p.k_mode == "pack":
            nkb = b.sdiv(b.add(self.Sk, i64(p.KB - 1)), i64(p.KB))
            self.ws_v = self.gep(self.ws_v, b.mul(nkb, i64(p.KB * self.krows * 4)), I8)
        self.ws_s = self.gep(ws, p.ws_s, I8)
        self.ws_o = self.gep(ws, p.ws_o, I8)
        self.ws_m = self.gep(ws, p.ws_m, I8)
        self.ws_l = self.gep(ws, p.ws_l, I8)
        self.ws_a = self.gep(ws, p.ws_a, I8)
        self.ws_x = self.gep(ws, p.ws_x, I8)
        self.ws_y = self.gep(ws, p.ws_y, I8)
        self.ws_u = self.gep(ws, p.ws_u, I8)
        self.ws_q = self.gep(ws, p.ws_q, I8)
        self.ws_p = self.gep(ws, p.ws_p, I8)
        ety = self.ety
        if self.poly:
            nq = b.sdiv(b.add(self.Sq, i64(p.MQ - 1)), i64(p.MQ))
        else:
            nq = p.nq

        def coords(t):
            """(b, h, query block, its index in the head's visiting order) of tile t."""
            bh = b.sdiv(t, self.v(nq)) if nq != 1 else t
            u = b.srem(t, self.v(nq)) if nq != 1 else i64(0)
            if p.zigzag:
                half = b.ashr(u, i64(1))
                odd = b.icmp_signed("!=", b.and_(u, i64(1)), i64(0))
                qb = b.select(odd, b.sub(self.v(self.isub(nq, 1)), half), half)
            else:
                qb = u
            bi, hi = split(bh)
            return bi, hi, qb, u, bh

        def split(bh):
            bi = b.sdiv(bh, i64(s.H)) if s.H > 1 else bh
            hi = b.srem(bh, i64(s.H)) if s.H > 1 else i64(0)
            return bi, hi

        with self.loop(tb, te, 1, "tile") as t:
            bi, hi, qb, u, bh = coords(t)

            def base(ptr, st, ty=F32, bi=bi, hi=hi):
                off = b.add(self.mul(bi, st[0]), self.mul(hi, st[1]))
                return self.gep(ptr, off, ty)

            if p.prefetch_q:
                # the next tile's query rows: rows of a merged-heads Q are H*D apart, and
                # the hardware prefetchers do not follow them from one tile to the next
                tn = b.add(t, i64(1))
                with self.if_then(b.icmp_signed("<", tn, te)):
                    bn, hn, qbn, _, _ = coords(tn)
                    q0n = self.mul(qbn, p.MQ)
                    self.prefetch_rows("q", base(Q, qst, ety["q"], bn, hn), q0n,
                                       self.smin(b.sub(self.v(self.Sq), q0n), p.MQ),
                                       write=False)

            if p.prefetch_k:
                # the next head's key rows into L2, a share of them per tile of this head
                # (when this core runs the next head too): rows of a merged-heads K are
                # H*D apart, and packing K^T reads them at the head's first tile
                bh1 = b.add(bh, i64(1))
                with self.if_then(b.icmp_signed("<", self.mul(bh1, nq), te)):
                    bn, hn = split(bh1)
                    per = self.v(self.isub(self.iadd(self.Sk, nq), 1))
                    per = b.sdiv(per, self.v(nq)) if nq != 1 else per
                    r0 = b.mul(u, per)
                    nr = self.smin(b.sub(self.v(self.Sk), r0), per)
                    self.prefetch_rows("k", base(K, kst, ety["k"], bn, hn), r0, nr,
                                       write=False, locality=2)

            Q_bh = base(Q, qst, ety["q"])
            K_bh = base(K, kst, ety["k"])
            V_bh = base(V, vst, ety["v"])
            O_bh = base(O, ost, ety["o"])
            M_bh = base(Mk, self.st["mask_strides"], ety["m"]) if Mk is not None else None

            if p.scope == "bh" and (p.k_mode == "pack" or p.v_mode == "pack"):
                need = b.or_(b.icmp_signed("==", t, tb), b.icmp_signed("==", u, i64(0)))
                with self.if_then(need):
                    if p.k_mode == "pack":
                        self.pack_k(K_bh, self.v(self.Sk))
                    if p.v_mode == "pack":
                        self.pack_v(V_bh, self.v(self.Sk))

            q0 = self.mul(qb, p.MQ)
            mq = self.smin(b.sub(self.v(self.Sq), q0), p.MQ)
            self.init_state()
            if self.pair:
                self.pack_q(Q_bh, q0, mq)
            elif self.dt["q"] != "float32":
                self.pack_q_f32(Q_bh, q0, mq)
            if p.prefetch_o:
                self.prefetch_out(O_bh, q0, mq)
            if s.causal:
                kend = b.add(b.add(q0, mq), self.v(self.diag))
                kend = self.smax(self.smin(kend, self.v(self.Sk)), 0)
            else:
                kend = self.v(self.Sk)
            with self.loop(0, kend, p.KB, "kb") as kb0:
                kbl = self.smin(b.sub(kend, kb0), p.KB)
                if p.k_mode == "direct":
                    kt = self.gep(K_bh, kb0)  # key stride 1
                    ldk = kst[3]
                elif self.panels:
                    kt, ldk = self.gep(self.ws_k, self.mul(kb0, self.krows)), p.ldk
                elif p.scope == "bh":
                    kt, ldk = self.gep(self.ws_k, kb0), p.ldk
                else:
                    self.pack_k(self.gep(K_bh, self.mul(kb0, kst[2]), ety["k"]), kbl)
                    kt, ldk = self.ws_k, p.ldk
                if p.v_mode == "direct":
                    vb, ldv = self.gep(V_bh, self.mul(kb0, vst[2])), vst[2]
                elif p.scope == "bh":
                    # pairs of keys per packed row with dot 'bf16' (kb0 is even)
                    j0 = b.ashr(kb0, i64(1)) if self.pair else kb0
                    vb, ldv = self.gep(self.ws_v, self.mul(j0, p.Dv_pad)), p.Dv_pad
                else:
                    self.pack_v(self.gep(V_bh, self.mul(kb0, vst[2]), ety["v"]), kbl)
                    vb, ldv = self.ws_v, p.Dv_pad
                first = b.icmp_signed("==", kb0, i64(0))
                last = b.icmp_signed(">=", b.add(kb0, i64(p.KB)), kend)
                if self.amx:
                    b.call(self.tile_scores(), [self.ws_q, kt, self.ws_s])
                    self.amx_score_epilogue(M_bh, q0, mq, kb0, kbl)
                    self.softmax_rows(mq, kbl)
                    b.call(self.tile_pv(), [self.ws_p, vb, self.ws_t])
                    self.amx_merge(mq, first, last, O_bh, q0)
                else:
                    self.scores(Q_bh, M_bh, q0, mq, kt, ldk, kb0, kbl)
                    self.softmax_rows(mq, kbl)
                    self.pv(vb, ldv, mq, kbl, first, last, O_bh, q0)
            if s.causal and (self.poly or s.Sq > s.Sk):
                with self.if_then(b.icmp_signed("<=", kend, i64(0))):
                    self.store_nan_rows(O_bh, q0, mq)
        if self.amx:
            b.call(self.intr("llvm.x86.tilerelease", VOID, []), [])
        b.ret_void()

    # -- per-tile state ------------------------------------------------------
    def init_state(self):
        p = self.p
        MQp = _rup(p.MQ, 16)
        for r in range(0, MQp, 16):
            self.store_v(self.splat(NEG_INF), self.gep(self.ws_m, r))
            self.store_v(self.zero_v, self.gep(self.ws_l, r))

    def prefetch_out(self, O_bh, q0, mq):
        """Write-prefetch the tile's output rows: they are stored at the end of
        the tile, and miss the caches when they are not contiguous (merged heads)."""
        self.prefetch_rows("o", O_bh, q0, mq, write=True)

    def prefetch_rows(self, op: str, base, r0, nrows, write: bool, locality: int = 3):
        """Prefetch rows r0..r0+nrows of operand ``op`` ('q', 'k', 'o') from its (b, h)
        base into L1 (locality 3) or L2 (2); nothing unless its elements are contiguous
        (d stride 1)."""
        b, st, ety = self.b, self.st[f"{op}_strides"], self.ety[op]
        if st[3] != 1:
            return
        n = self.s.Dv if op == "o" else self.s.D
        per = 64 // (4 if self.dt[op] == "float32" else 2)
        lines = _cdiv(n, per) + 1  # rows need not be 64-byte aligned
        with self.loop(0, nrows, 1, "pfr") as r:
            row = self.gep(base, self.mul(b.add(r0, r), st[2]), ety)
            for k in range(lines):
                self.prefetch_r(self.gep(row, min(per * k, n - 1), ety), locality, write)

    # -- packing ---------------------------------------------------------------
    def pack_k(self, src, count):
        """ws_k[d * ldk + j] = K(j, d) for keys j < count (zero-padded to 16); a
        form's whole-head packing (``panels``) puts key j at ws_k[(j // KB) * D * KB
        + d * KB + j % KB]."""
        s, p = self.s, self.p
        kst = self.st["k_strides"]
        panel = (p.KB, p.KB * self.krows) if self.panels else None
        if self.pair:
            if kst[3] == 1:
                self.pack_k_pairs(src, count, kst[2], panel)
            else:
                self.pack_k_pairs_kt(src, count, kst[3], panel)
            return
        self.pack_t(src, count, kst[2], i64(s.D), kst[3], self.ws_k, p.ldk, panel,
                    self.dt["k"])

    def pack_v(self, src, count):
        """ws_v[j * Dv_pad + e] = V(j, e) for keys j < count (dot 'bf16': the bf16 pair
        (V(j, e), V(j + 1, e)) at 32-bit element (j / 2) * Dv_pad + e)."""
        s, p = self.s, self.p
        vst = self.st["v_strides"]
        if self.pair:
            self.pack_v_pairs(src, count, vst[2])
            return
        if vst[3] == 1 and self.dt["v"] != "float32":
            self.pack_v_rows(src, count, vst[2])
            return
        self.pack_t(src, i64(s.Dv), vst[3], count, vst[2], self.ws_v, p.Dv_pad, None,
                    self.dt["v"])

    # -- dot 'bf16': bf16 pairs -------------------------------------------------------
    def row_pairs(self, row, d0: int, n: int, ok, dt: str):
        """The bf16 pairs of elements d0..d0+31 of a row (unit stride, n elements; lanes
        past n, and all lanes when ok is false, are 0) in a <16 x float> container."""
        halves = []
        for h in range(2):
            e0 = d0 + 16 * h
            if e0 >= n:
                halves.append(self.zero_v)
                continue
            m = self.lanes_lt(n, e0)
            if ok is not None:
                m = self.b.select(ok, m, self.zero_m)
            elif all(c.constant for c in m.constant):
                m = None
            halves.append(self.load_cvt(self.gep(row, e0, _ETY[dt]), m, dt))
        return self.bf16_pairs(*halves)

    def pack_q(self, Q_bh, q0, mq):
        """ws_q[r * D2 + i] = the bf16 pair (Q(q0 + r, 2i), Q(q0 + r, 2i + 1)), r < mq."""
        s, b = self.s, self.b
        qi = self.st["q_strides"][2]
        D2 = self.krows
        with self.loop(0, mq, 1, "pq") as r:
            row = self.gep(Q_bh, self.mul(b.add(q0, r), qi), self.ety["q"])
            dst = self.gep(self.ws_q, self.mul(r, D2))
            for d0 in range(0, s.D, 32):
                x = self.row_pairs(row, d0, s.D, None, self.dt["q"])
                n = D2 - d0 // 2
                self.store_v(x, self.gep(dst, d0 // 2), None if n >= 16 else
                             ir.Constant(VM, [1 if i < n else 0 for i in range(16)]))

    def pack_q_f32(self, Q_bh, q0, mq):
        """ws_q[r * D + d] = Q(q0 + r, d) widened to float32, r < mq."""
        s, b = self.s, self.b
        qi, qd = self.st["q_strides"][2:]
        with self.loop(0, mq, 1, "pqf") as r:
            row = self.gep(Q_bh, self.mul(b.add(q0, r), qi), self.ety["q"])
            dst = self.gep(self.ws_q, self.mul(r, s.D))
            for d0 in range(0, s.D, 16):
                m = self.lanes_lt(s.D, d0)
                m = None if all(c.constant for c in m.constant) else m
                if qd == 1:
                    x = self.load_cvt(self.gep(row, d0, self.ety["q"]), m, self.dt["q"])
                else:
                    offs = self.lanes_times(d0, qd, 2 if self.dt["q"] != "float32" else 4)
                    ptrs = b.inttoptr(b.add(self.splat(b.ptrtoint(row, I64), VI64), offs),
                                      VPTR)
                    x = self.gather_cvt(ptrs, self.ones_m if m is None else m, self.dt["q"])
                self.store_v(x, self.gep(dst, d0), m)

    def pack_k_pairs(self, src, count, rs, panel):
        """ws_k[i * ldk + j] (32-bit elements) = the bf16 pair (K(j, 2i), K(j, 2i + 1)) for
        keys j < count, zero-padded to 16 keys (``panel``: as pack_t's)."""
        s, p, b = self.s, self.p, self.b
        D2, dst_ld = self.krows, p.ldk
        with self.loop(0, count, 16, "pka") as a0:
            rowok = [b.icmp_signed("<", b.add(a0, i64(k)), count) for k in range(16)]
            row0 = self.gep(src, self.mul(a0, rs), self.ety["k"])
            if panel is None:
                col = a0
            else:
                P, pst = panel
                col = b.add(b.mul(b.udiv(a0, i64(P)), i64(pst)), b.urem(a0, i64(P)))
            for d0 in range(0, s.D, 32):
                rows = [self.row_pairs(self.gep(row0, self.imul(k, rs), self.ety["k"]), d0,
                                       s.D, rowok[k], self.dt["k"]) for k in range(16)]
                cols = self.transpose16(rows)
                dbase = self.gep(self.ws_k, b.add(i64(d0 // 2 * dst_ld), col))
                for i in range(min(16, D2 - d0 // 2)):
                    self.store_v(cols[i], self.gep(dbase, i * dst_ld))

    def pack_k_pairs_kt(self, src, count, ds, panel):
        """pack_k_pairs for K stored transposed (key stride 1, d stride ds): the rows of
        d = 2i and 2i + 1 interleaved, 16 keys at a time."""
        s, p, b = self.s, self.p, self.b
        ety, dt = self.ety["k"], self.dt["k"]
        with self.loop(0, count, 16, "pkt") as a0:
            m = self.lanes_lt(b.sub(count, a0))
            if panel is None:
                col = a0
            else:
                P, pst = panel
                col = b.add(b.mul(b.udiv(a0, i64(P)), i64(pst)), b.urem(a0, i64(P)))
            base = self.gep(src, a0, ety)
            dst = self.gep(self.ws_k, col)
            for i in range(self.krows):
                if 2 * i >= s.D:   # dot 'amx': d padded to whole tiles with zeros
                    self.store_v(self.zero_v, self.gep(dst, i * p.ldk))
                    continue
                lo = self.load_cvt(self.gep(base, self.imul(2 * i, ds), ety), m, dt)
                hi = self.load_cvt(self.gep(base, self.imul(2 * i + 1, ds), ety), m, dt) \
                    if 2 * i + 1 < s.D else self.zero_v
                self.store_v(self.interleave_bf16(lo, hi), self.gep(dst, i * p.ldk))

    def pack_v_pairs(self, src, count, rs):
        """ws_v[(j / 2) * Dv_pad + e] (32-bit) = the bf16 pair (V(j, e), V(j + 1, e)), j
        even < count (V(count, e) = 0); lanes e >= Dv are 0."""
        s, p, b = self.s, self.p, self.b
        ety, dt = self.ety["v"], self.dt["v"]
        if self.amx:
            # whole key blocks (the tiles read KB keys): keys count.. zero, Dv_pad columns
            npairs = b.mul(b.sdiv(b.add(count, i64(p.KB - 1)), i64(p.KB)), i64(p.KB // 2))
        else:
            npairs = b.ashr(b.add(count, i64(1)), i64(1))
        with self.loop(0, npairs, 1, "pvp") as jp:
            j = b.shl(jp, i64(1))
            r0 = self.gep(src, self.mul(j, rs), ety)
            r1 = self.gep(r0, rs, ety)
            ok0 = b.icmp_signed("<", j, count) if self.amx else None
            ok1 = b.icmp_signed("<", b.add(j, i64(1)), count)
            dst = self.gep(self.ws_v, self.mul(jp, p.Dv_pad))
            for v in range(p.Dv_pad // 16 if self.amx else _cdiv(s.Dv, 16)):
                if 16 * v >= s.Dv:
                    self.store_v(self.zero_v, self.gep(dst, 16 * v))
                    continue
                m = self.lanes_lt(s.Dv, 16 * v)
                full = all(c.constant for c in m.constant)
                m0 = None if full else m
                if ok0 is not None:
                    m0 = b.select(ok0, m, self.zero_m)
                lo = self.load_cvt(self.gep(r0, 16 * v, ety), m0, dt)
                hi = self.load_cvt(self.gep(r1, 16 * v, ety), b.select(ok1, m, self.zero_m), dt)
                self.store_v(self.interleave_bf16(lo, hi), self.gep(dst, 16 * v))

    def pack_v_rows(self, src, count, rs):
        """ws_v[j * Dv_pad + e] = V(j, e) widened, V rows contiguous (a copy, no gather)."""
        s, p = self.s, self.p
        ety, dt = self.ety["v"], self.dt["v"]
        with self.loop(0, count, 1, "pvr") as j:
            row = self.gep(src, self.mul(j, rs), ety)
            dst = self.gep(self.ws_v, self.mul(j, p.Dv_pad))
            for v in range(_cdiv(s.Dv, 16)):
                m = self.lanes_lt(s.Dv, 16 * v)
                m = None if all(c.constant for c in m.constant) else m
                self.store_v(self.load_cvt(self.gep(row, 16 * v, ety), m, dt),
                             self.gep(dst, 16 * v))

    def pack_t(self, src, n_a, rs, n_c, cs, dst, dst_ld: int, panel=None, dt="float32"):
        """dst[c * dst_ld + a] = src[a * rs + c * cs] for a < n_a, c < n_c; lanes
        a in [n_a, roundup16(n_a)) are zero. 16x16 in-register transposes when
        cs == 1, else gathers. ``panel = (P, stride)``: a is stored at
        (a // P) * stride + a % P instead (P a multiple of 16)."""
        b = self.b
        ety = _ETY[dt]

        def col(a0):
            if panel is None:
                return a0
            P, pst = panel
            return b.add(b.mul(b.udiv(a0, i64(P)), i64(pst)), b.urem(a0, i64(P)))

        if cs == 1:
            with self.loop(0, n_a, 16, "pta") as a0:
                rowok = [b.icmp_signed("<", b.add(a0, i64(k)), n_a) for k in range(16)]
                row0 = self.gep(src, self.mul(a0, rs), ety)
                with self.loop(0, n_c, 16, "ptc") as c0:
                    cmask = self.lanes_lt(b.sub(n_c, c0))
                    base = self.gep(row0, c0, ety)
                    rows = [
                        self.load_cvt(self.gep(base, self.imul(k, rs), ety),
                                      b.select(rowok[k], cmask, self.zero_m), dt)
                        for k in range(16)
                    ]
                    cols = self.transpose16(rows)
                    dbase = self.gep(dst, b.add(b.mul(c0, i64(dst_ld)), col(a0)))
                    for i in range(16):
                        ok = b.icmp_signed("<", b.add(c0, i64(i)), n_c)
                        self.store_v(
                            cols[i],
                            self.gep(dbase, i * dst_ld),
                            b.select(ok, self.ones_m, self.zero_m),
                        )
        elif rs == 1:
            # lanes a contiguous (K^T stored as rows of keys): one vector per c
            with self.loop(0, n_a, 16, "pla") as a0:
                amask = self.lanes_lt(b.sub(n_a, a0))
                base = self.gep(src, a0, ety)
                with self.loop(0, n_c, 1, "plc") as c:
                    x = self.load_cvt(self.gep(base, self.mul(c, cs), ety), amask, dt)
                    self.store_v(x, self.gep(dst, b.add(b.mul(c, i64(dst_ld)), col(a0))))
        else:
            src_i = b.ptrtoint(src, I64)
            with self.loop(0, n_a, 16, "pga") as a0:
                amask = self.lanes_lt(b.sub(n_a, a0))
                esz = 4 if dt == "float32" else 2
                offs = b.mul(b.add(self.splat(a0, VI64), self.iota64),
                             self.splat(self.imul(esz, rs), VI64))
                row_i = b.add(self.splat(src_i, VI64), offs)
                with self.loop(0, n_c, 1, "pgc") as c:
                    cb = self.mul(c, self.imul(esz, cs))
                    ptrs = b.inttoptr(b.add(row_i, self.splat(cb, VI64)), VPTR)
                    g = self.gather_cvt(ptrs, amask, dt)
                    self.store_v(g, self.gep(dst, b.add(b.mul(c, i64(dst_ld)), col(a0))))

    # -- S = Q K^T for one key block, with scale/mask/causal and row maxima ----
    def scores(self, Q_bh, M_bh, q0, mq, kt, ldk, kb0, kbl):
        """Sbuf[r][j] = masked score of row q0 + r and key kb0 + j (-inf for keys
        past the block); rowmax[r][:] = lane-wise max over the block's vectors."""
        p, b = self.p, self.b
        MR, NV, KB = p.MR_s, p.NV_s, p.KB
        qi, qd = self.st["q_strides"][2:]
        # dot 'bf16': Q's rows are the bf16 pairs in ws_q, K^T rows pairs of d: D2 steps
        nd = self.krows
        if self.pair or self.dt["q"] != "float32":
            # Q's rows were packed into ws_q: float32 (widened), or bf16 pairs
            qi, qd, qety, Q_bh, qrow0 = nd, 1, F32, self.ws_q, i64(0)
            qload = self.load_f
            madd = self.dot2 if self.pair else (lambda acc, x, y: self.fma(x, y, acc))
        else:
            qety, dq, qrow0 = self.ety["q"], self.dt["q"], q0
            qload = lambda ptr: self.load_s(ptr, dq)
            madd = lambda acc, x, y: self.fma(x, y, acc)
        U = max(1, min(p.unroll_d, nd))
        Dmain = nd - nd % U
        with self.loop(0, mq, MR, "sr") as r0:
            rows = [
                self.smin(b.add(r0, i64(k)), b.sub(mq, i64(1))) if k else r0 for k in range(MR)
            ]
            q_ptrs = [self.gep(Q_bh, self.mul(b.add(qrow0, r), qi), qety) for r in rows]
            s_ptrs = [self.gep(self.ws_s, self.mul(r, KB)) for r in rows]
            x_ptrs = [self.gep(self.ws_x, self.mul(r, 16)) for r in rows]
            with self.loop(0, kbl, 16 * NV, "sc") as c0:
                left = b.sub(kbl, c0)
                masks = [self.lanes_lt(left, 16 * v) for v in range(NV)]
                k0 = self.gep(kt, c0)
                first = b.icmp_signed("==", c0, i64(0))
                kstart = b.add(kb0, c0)

                def chunk(nv, kmasks=masks):
                    """The micro-kernel on nv vectors of keys (-inf scores after them);
                    K^T rows loaded under kmasks (None: whole vectors)."""

                    def step(accs, kp, qps, u):
                        kv = [
                            self.load_v(self.gep(kp, self.iadd(self.imul(u, ldk), 16 * v)),
                                        kmasks[v] if kmasks else None)
                            for v in range(nv)
                        ]
                        new = []
                        for r in range(MR):
                            x = self.splat(qload(self.gep(qps[r], self.imul(u, qd), qety)))
                            new.append([madd(accs[r][v], x, kv[v]) for v in range(nv)])
                        return new

                    accs = [[self.zero_v] * nv for _ in range(MR)]
                    if Dmain:

                        def body(d, a, ptrs):
                            kp, qps = ptrs[0], ptrs[1:]
                            for u in range(U):
                                a = step(a, kp, qps, u)
                            return a, [self.gep(kp, self.imul(U, ldk))] + [
                                self.gep(q, self.imul(U, qd), qety) for q in qps
                            ]

                        _, accs, ptrs = self.grid_loop(0, Dmain, U, accs, [k0] + q_ptrs,
                                                       body, "sd")
                        kp, qps = ptrs[0], ptrs[1:]
                    else:
                        kp, qps = k0, q_ptrs
                    for u in range(nd - Dmain):
                        accs = step(accs, kp, qps, u)
                    # epilogue: scale, mask, causal limit, key padding; row maxima
                    for r in range(MR):
                        sv = self.score_epilogue(accs[r], M_bh, b.add(q0, rows[r]), kstart,
                                                 masks[:nv])
                        mx = sv[0]
                        for v in range(1, nv):
                            mx = self.fmax(mx, sv[v])
                        sv += [self.splat(NEG_INF)] * (NV - nv)
                        for v in range(NV):
                            self.store_v(sv[v], self.gep(s_ptrs[r], b.add(c0, i64(16 * v))))
                        if KB > 16 * NV:
                            old = self.load_v(x_ptrs[r])
                            mx = b.select(first, mx, self.fmax(mx, old))
                        self.store_v(mx, x_ptrs[r])

                if not wide_registers():
                    # AVX2 has no mask registers: a masked load is a vmaskmovps. Chunks of
                    # 16 * NV keys or more (all but a block's last) load whole vectors
                    whole = b.icmp_signed(">=", left, i64(16 * NV))
                    with b.if_else(whole, likely=True) as (then, otherwise):
                        with then:
                            chunk(NV, None)
                        with otherwise:
                            self.score_chunks(chunk, left, NV)
                else:
                    self.score_chunks(chunk, left, NV)

    def score_chunks(self, chunk, left, NV):
        """chunk(nv) on the vectors of keys a chunk needs: NV, or where a form's last chunk
        of keys (a short sequence) needs fewer, just those."""
        b = self.b
        if self.poly and NV > 1:
            # a form does not know Sk: the last chunk of keys (a short sequence)
            # runs the micro-kernel on just the vectors it needs
            nvt = self.smin(b.ashr(b.add(left, i64(15)), i64(4)), NV)
            blocks = {k: self.fn.append_basic_block(self.name(f"sc{k}"))
                      for k in range(1, NV + 1)}
            done = self.fn.append_basic_block(self.name("sc.done"))
            sw = b.switch(nvt, blocks[NV])
            for k in range(1, NV):
                sw.add_case(i64(k), blocks[k])
            for k, blk in blocks.items():
                b.position_at_end(blk)
                chunk(k)
                b.branch(done)
            b.position_at_end(done)
        else:
            chunk(NV)

    def score_epilogue(self, raw, M_bh, i, kstart, valid):
        """Scores of row i, keys kstart + 16v + lane, from the raw q.k vectors."""
        s, b = self.s, self.b
        NV = len(raw)
        scale = float(np.float32(s.scale))
        fill = float(np.float32(s.fill))
        mv = self.load_mask(M_bh, i, kstart, valid) if s.mask != "none" else None
        sv = []
        for v in range(NV):
            x = raw[v]
            if s.mask == "add":
                if s.score_bias_after_scale:
                    x = (
                        self.fma(x, self.splat(scale), mv[v])
                        if scale != 1.0
                        else b.fadd(x, mv[v])
                    )
                else:
                    x = b.fadd(x, mv[v])
                    if scale != 1.0:
                        x = b.fmul(x, self.splat(scale))
            elif s.mask == "where":
                if s.score_bias_after_scale:
                    if scale != 1.0:
                        x = b.fmul(x, self.splat(scale))
                    x = b.select(mv[v], x, self.splat(fill))
                else:
                    x = b.select(mv[v], x, self.splat(fill))
                    if scale != 1.0:
                        x = b.fmul(x, self.splat(scale))
            elif scale != 1.0:
                x = b.fmul(x, self.splat(scale))
            sv.append(x)
        ninf = self.splat(NEG_INF)
        if s.causal:
            # keys j = kstart + 16v + lane are visible while j <= i + Sk - Sq
            lim = b.sub(b.add(i, self.v(self.diag)), kstart)
            lim32 = self.splat(b.trunc(self.smax(self.smin(lim, 1 << 30), -1), I32), VI32)
            for v in range(NV):
                lanes = ir.Constant(VI32, [16 * v + k for k in range(16)])
                vis = b.icmp_signed("<=", lanes, lim32)
                sv[v] = b.select(b.and_(vis, valid[v]), sv[v], ninf)
        else:
            sv = [
                sv[v] if isinstance(valid[v], ir.Constant) else b.select(valid[v], sv[v], ninf)
                for v in range(NV)
            ]
        return sv

    def load_mask(self, M_bh, i, kstart, valid):
        """The mask of row i, keys kstart + 16v + lane (v < len(valid)): float
        vectors ('add') or <16 x i1> keep flags ('where')."""
        s, b = self.s, self.b
        NV = len(valid)
        mi, mj = self.st["mask_strides"][2:]
        is_bool = s.mask_dtype == "bool"
        ety, mdt = self.ety["m"], s.mask_dtype
        row = self.gep(M_bh, b.add(self.mul(i, mi), self.mul(kstart, mj)), ety)
        out = []
        if mj == 0:
            x = b.load(row, typ=ety, align=1) if is_bool else self.load_s(row, mdt)
            xs = self.splat(x, VI8 if is_bool else VF)
            out = [xs] * NV
        elif mj == 1:
            for v in range(NV):
                ptr = self.gep(row, 16 * v, ety)
                if is_bool:
                    out.append(
                        masked_load(b, ptr, valid[v], ir.Constant(VI8, None), 1)
                    )
                else:
                    out.append(self.load_cvt(ptr, valid[v], mdt))
        else:
            row_i = self.splat(b.ptrtoint(row, I64), VI64)
            esz = 1 if is_bool else 4 if mdt == "float32" else 2
            for v in range(NV):
                offs = self.lanes_times(16 * v, mj, esz)
                ptrs = b.inttoptr(b.add(row_i, offs), VPTR)
                if is_bool:
                    out.append(
                        b.call(self.gather8, [ptrs, i32(1), valid[v], ir.Constant(VI8, None)])
                    )
                else:
                    out.append(self.gather_cvt(ptrs, valid[v], mdt))
        if s.mask == "add":
            return out
        if is_bool:
            return [b.icmp_unsigned("!=", x, ir.Constant(VI8, None)) for x in out]
        return [b.fcmp_unordered("!=", x, self.zero_v) for x in out]

    # -- online softmax, 16 rows at a time ----------------------------------------
    def softmax_rows(self, mq, kbl):
        """m, l, alpha of rows g0..g0+15 as vectors (lane = row); p = exp(s - m)
        in place. Lanes of rows >= mq hold garbage that is never used."""
        p, b = self.p, self.b
        KB = p.KB
        NVk = KB // 16
        # a form's short blocks: skip the vectors past kbl (not with AMX: its P @ V tiles
        # read the whole block, whose weights past kbl must be 0)
        skip = self.poly and NVk > 1 and not self.amx
        nvec = b.sdiv(b.add(kbl, i64(15)), i64(16)) if NVk > p.NV_s or skip else None
        with self.loop(0, mq, 16, "sg") as g0:
            mblk = self.reduce16(self.gep(self.ws_x, self.mul(g0, 16)), self.fmax)
            m_ptr = self.gep(self.ws_m, g0)
            m_old = self.load_v(m_ptr)
            m_new = self.fmax(mblk, m_old)
            m_use = b.select(b.fcmp_ordered("==", m_new, self.splat(NEG_INF)), self.zero_v, m_new)
            alpha = self.exp_nonpos(b.fsub(m_old, m_use))
            self.store_v(m_new, m_ptr)
            self.store_v(alpha, self.gep(self.ws_a, g0))
            self.store_v(m_use, self.ws_u)
            g1 = self.smin(b.add(g0, i64(16)), mq)
            with self.loop(g0, g1, 1, "row") as r:
                mu = self.splat(self.load_f(self.gep(self.ws_u, b.sub(r, g0))))
                srow = self.gep(self.ws_s, self.mul(r, KB))
                acc = None
                if skip:
                    end = self.fn.append_basic_block(self.name("sm.end"))
                    exits = []
                for v in range(NVk):
                    if skip and v:
                        go = self.fn.append_basic_block(self.name("sm.v"))
                        exits.append((acc, b.block))
                        b.cbranch(b.icmp_signed(">", nvec, i64(v)), go, end)
                        b.position_at_end(go)
                    ptr = self.gep(srow, 16 * v)
                    pv = self.exp_nonpos(b.fsub(self.load_v(ptr), mu))
                    if v >= p.NV_s and not skip:
                        # vectors past the block's last chunk hold stale data: p = 0
                        ok = b.icmp_signed(">", nvec, i64(v))
                        pv = b.select(ok, pv, self.zero_v)
                    if self.pair:
                        # P @ V multiplies P rounded to bf16; l sums the rounded weights
                        pb = self.narrow(pv, "bfloat16")
                        prow = self.gep(self.ws_p, b.add(self.mul(r, KB), i64(16 * v)),
                                        ir.IntType(16))
                        b.store(pb, prow, align=2)
                        pv = self.widen(pb, "bfloat16")
                    else:
                        self.store_v(pv, ptr)
                    acc = pv if acc is None else b.fadd(acc, pv)
                if skip:
                    exits.append((acc, b.block))
                    b.branch(end)
                    b.position_at_end(end)
                    phi = b.phi(VF)
                    for val, blk in exits:
                        phi.add_incoming(val, blk)
                    acc = phi
                self.store_v(acc, self.gep(self.ws_y, self.mul(b.sub(r, g0), 16)))
            psum = self.reduce16(self.ws_y, b.fadd)
            l_ptr = self.gep(self.ws_l, g0)
            self.store_v(self.fma(self.load_v(l_ptr), alpha, psum), l_ptr)

    def reduce16(self, ptr, op):
        """16 vectors at ptr (row-major [16][16]) -> vector with lane j =
        op-reduction of vector j."""
        return self.hreduce([self.load_v(self.gep(ptr, 16 * j)) for j in range(16)], op)

    # -- Oacc = alpha * Oacc + P @ V -------------------------------------------
    def pv(self, vb, ldv, mq, kbl, first, last, O_bh, q0):
        """Oacc = alpha * Oacc + P @ V_block (Oacc = 0 on the first block); on
        the last block O = (alpha * Oacc + P @ V_block) / l is stored instead."""
        s, p, b = self.s, self.p, self.b
        MR, KB, Dvp = p.MR_v, p.KB, p.Dv_pad
        U = max(1, p.unroll_j)
        oi, od = self.st["o_strides"][2:]
        if self.pair:
            # pairs of keys: P's bf16 pairs (32-bit elements of ws_p), V's packed pair rows
            kbl = b.ashr(b.add(kbl, i64(1)), i64(1))
            pbuf, pld = self.ws_p, KB // 2
            madd = self.dot2
        else:
            pbuf, pld = self.ws_s, KB
            madd = lambda acc, x, y: self.fma(x, y, acc)
        for cv0, nv in p.v_chunks:
            omask = [self.lanes_lt(s.Dv, 16 * (cv0 + v)) for v in range(nv)]
            omask = [None if all(c.constant for c in m.constant) else m for m in omask]
            dmask = omask if p.v_mode == "direct" else [None] * nv
            with self.loop(0, mq, MR, "vr") as r0:
                rows = [
                    self.smin(b.add(r0, i64(k)), b.sub(mq, i64(1))) if k else r0
                    for k in range(MR)
                ]
                p_ptrs = [self.gep(pbuf, self.mul(r, pld)) for r in rows]
                o_ptrs = [
                    self.gep(self.ws_o, b.add(self.mul(r, Dvp), i64(16 * cv0))) for r in rows
                ]
                accs = []
                for k in range(MR):
                    al = self.splat(self.load_f(self.gep(self.ws_a, rows[k])))
                    accs.append(
                        [
                            b.select(
                                first,
                                self.zero_v,
                                b.fmul(self.load_v(self.gep(o_ptrs[k], 16 * v)), al),
                            )
                            for v in range(nv)
                        ]
                    )
                v0 = self.gep(vb, 16 * cv0)

                def step(a, vp, pps, u, nv=nv, dmask=dmask, madd=madd):
                    vv = [
                        self.load_v(self.gep(vp, self.iadd(self.imul(u, ldv), 16 * v)), dmask[v])
                        for v in range(nv)
                    ]
                    new = []
                    for k in range(MR):
                        x = self.splat(self.load_f(self.gep(pps[k], u)))
                        new.append([madd(a[k][v], x, vv[v]) for v in range(nv)])
                    return new

                def make_body(nstep, step=step):
                    def body(j, a, streams):
                        vp, pps = streams[0], streams[1:]
                        for u in range(nstep):
                            a = step(a, vp, pps, u)
                        return a, [self.gep(vp, self.imul(nstep, ldv))] + [
                            self.gep(q, nstep) for q in pps
                        ]

                    return body

                ptrs = [v0] + p_ptrs
                if U > 1:
                    jmain = b.sub(kbl, b.srem(kbl, i64(U)))
                    j, accs, ptrs = self.grid_loop(0, jmain, U, accs, ptrs, make_body(U), "vj")
                    _, accs, _ = self.grid_loop(j, kbl, 1, accs, ptrs, make_body(1), "vjr")
                else:
                    _, accs, _ = self.grid_loop(0, kbl, 1, accs, ptrs, make_body(1), "vj")

                # finish_block calls these at once; the defaults pin this chunk's values
                def partial(accs=accs, o_ptrs=o_ptrs, nv=nv):
                    for k in range(MR):
                        for v in range(nv):
                            self.store_v(accs[k][v], self.gep(o_ptrs[k], 16 * v))

                def final(accs=accs, rows=rows, cv0=cv0, nv=nv, omask=omask):
                    for k in range(MR):
                        out = self.row_out(self.load_f(self.gep(self.ws_l, rows[k])))
                        orow = self.gep(
                            O_bh, b.add(self.mul(b.add(q0, rows[k]), oi), self.mul(16 * cv0, od)),
                            self.ety["o"])
                        for v in range(nv):
                            self.store_out(out(accs[k][v]), orow, 16 * v, omask[v])

                self.finish_block(last, final, partial, "pv")

    # -- dot 'amx': Q K^T and P V on tiles (tdpbf16ps) ---------------------------------
    def tile_fn(self, key: str, body) -> ir.Function:
        """An internal noinline ``void f(ptr a, ptr b, ptr c)`` whose body ``body(b, a,
        bt, c)`` uses tiles: LLVM configures the tiles per function (ldtilecfg on entry,
        one shape per tile register); here every tile is 16 rows x 64 bytes."""
        if key in self._tile_fns:
            return self._tile_fns[key]
        f = ir.Function(self.m, ir.FunctionType(VOID, [PTR, PTR, PTR]),
                        name=self.m.get_unique_name(f"{self.fn.name}.{key}"))
        f.linkage = "internal"
        f.attributes.add("nounwind")
        f.attributes.add("noinline")
        bld = ir.IRBuilder(f.append_basic_block("entry"))
        body(bld, *f.args)
        bld.ret_void()
        self._tile_fns[key] = f
        return f

    def _tiles(self, bld):
        """Tile helpers (16 x 64-byte tiles) on the builder ``bld``."""
        r16, c64 = ir.Constant(ir.IntType(16), 16), ir.Constant(ir.IntType(16), 64)
        ld = self.intr("llvm.x86.tileloadd64.internal", X86_AMX, [I16, I16, PTR, I64])
        zero = self.intr("llvm.x86.tilezero.internal", X86_AMX, [I16, I16])
        dp = self.intr("llvm.x86.tdpbf16ps.internal", X86_AMX, [I16] * 3 + [X86_AMX] * 3)
        st = self.intr("llvm.x86.tilestored64.internal", VOID, [I16, I16, PTR, I64, X86_AMX])

        def at(ptr, off):
            return bld.gep(ptr, [i64(off)], source_etype=I8) if off else ptr

        return (lambda ptr, off, stride: bld.call(ld, [r16, c64, at(ptr, off), i64(stride)]),
                lambda: bld.call(zero, [r16, c64]),
                lambda c, a, bt: bld.call(dp, [r16, c64, c64, c, a, bt]),
                lambda ptr, off, stride, t: bld.call(st, [r16, c64, at(ptr, off), i64(stride),
                                                          t]))

    def _tile_grid(self, bld, a, bt, c, rows, cols, steps, a_ld, a_step, b_ld, b_step, b_col,
                   c_ld):
        """C[rows][cols] (bytes offsets of 16 x 16 fp32 tiles) = sum over ``steps`` of
        A tiles (16 rows x 32 bf16) times B tiles (16 pairs x 16 columns, VNNI), 32 x 32
        blocks of C at a time (4 C + 2 A + 2 B tiles: the 8 tile registers)."""
        load, zero, dp, store = self._tiles(bld)
        for r0 in range(0, rows, 32):
            for c0 in range(0, cols, 32):
                acc = [[zero(), zero()], [zero(), zero()]]
                for k in range(steps):
                    at = [load(a, (r0 + 16 * i) * a_ld + k * a_step, a_ld) for i in range(2)]
                    bt_ = [load(bt, k * b_step + (c0 + 16 * j) * b_col, b_ld)
                           for j in range(2)]
                    acc = [[dp(acc[i][j], at[i], bt_[j]) for j in range(2)] for i in range(2)]
                for i in range(2):
                    for j in range(2):
                        store(c, (r0 + 16 * i) * c_ld + (c0 + 16 * j) * 4, c_ld, acc[i][j])

    def tile_scores(self) -> ir.Function:
        """``(ws_q, K^T panel, ws_s)``: S[MQ][KB] (fp32, row stride KB) = Q K^T of the
        block, unscaled: A = Q's bf16 rows (stride 4 * D2p bytes, 32 d per tile), B = the
        K^T panel (rows of 16-bit pairs of d, KB keys: stride 4 * KB bytes)."""
        p = self.p

        def body(bld, q, kt, sc):
            self._tile_grid(bld, q, kt, sc, p.MQ, p.KB, self.krows // 16,
                            a_ld=4 * self.krows, a_step=64, b_ld=4 * p.KB,
                            b_step=16 * 4 * p.KB, b_col=4, c_ld=4 * p.KB)

        return self.tile_fn("amx_qk", body)

    def tile_pv(self) -> ir.Function:
        """``(ws_p, V pair rows, ws_t)``: T[MQ][Dv_pad] (fp32) = P V of the block: A = P
        in bf16 (row stride 2 * KB bytes, 32 keys per tile), B = V's rows of key pairs
        (stride 4 * Dv_pad bytes), over the whole block (weights past the keys are 0 and
        the rows of V past Sk are zero)."""
        p = self.p

        def body(bld, pp, vb, t):
            self._tile_grid(bld, pp, vb, t, p.MQ, p.Dv_pad, p.KB // 32,
                            a_ld=2 * p.KB, a_step=64, b_ld=4 * p.Dv_pad,
                            b_step=16 * 4 * p.Dv_pad, b_col=4, c_ld=4 * p.Dv_pad)

        return self.tile_fn("amx_pv", body)

    def amx_score_epilogue(self, M_bh, q0, mq, kb0, kbl):
        """Scale, mask, causal limit and key padding (-inf past kbl, over the whole block)
        applied to the raw scores in ws_s, in place; the row maxima to ws_x."""
        p, b = self.p, self.b
        NV, KB = p.KB // 16, p.KB
        valid = [self.lanes_lt(kbl, 16 * v) for v in range(NV)]
        with self.loop(0, mq, 1, "ae") as r:
            srow = self.gep(self.ws_s, self.mul(r, KB))
            raw = [self.load_v(self.gep(srow, 16 * v)) for v in range(NV)]
            sv = self.score_epilogue(raw, M_bh, b.add(q0, r), kb0, valid)
            mx = sv[0]
            for v in range(NV):
                self.store_v(sv[v], self.gep(srow, 16 * v))
                if v:
                    mx = self.fmax(mx, sv[v])
            self.store_v(mx, self.gep(self.ws_x, self.mul(r, 16)))

    def amx_merge(self, mq, first, last, O_bh, q0):
        """Oacc = alpha * Oacc + T (T alone on the first block); on the last block
        O = (alpha * Oacc + T) / l is stored instead."""
        s, p, b = self.s, self.p, self.b
        Dvp = p.Dv_pad
        oi, od = self.st["o_strides"][2:]
        nvd = _cdiv(s.Dv, 16)
        omask = [self.lanes_lt(s.Dv, 16 * v) for v in range(nvd)]
        omask = [None if all(c.constant for c in m.constant) else m for m in omask]
        with self.loop(0, mq, 1, "am") as r:
            al = self.splat(self.load_f(self.gep(self.ws_a, r)))
            trow = self.gep(self.ws_t, self.mul(r, Dvp))
            orow_acc = self.gep(self.ws_o, self.mul(r, Dvp))
            accs = []
            for v in range(nvd):
                t = self.load_v(self.gep(trow, 16 * v))
                old = self.load_v(self.gep(orow_acc, 16 * v))
                accs.append(b.select(first, t, self.fma(old, al, t)))

            def partial():
                for v in range(nvd):
                    self.store_v(accs[v], self.gep(orow_acc, 16 * v))

            def final():
                out = self.row_out(self.load_f(self.gep(self.ws_l, r)))
                orow = self.gep(O_bh, self.mul(b.add(q0, r), oi), self.ety["o"])
                for v in range(nvd):
                    self.store_out(out(accs[v]), orow, 16 * v, omask[v])

            self.finish_block(last, final, partial, "am")

    def row_out(self, l):
        """acc -> the output vector of a row whose softmax denominator is ``l``: acc / l.
        With ``zero_nan_rows`` the probabilities of a row that would be NaN are 0: where
        every score is -inf (l is 0, and acc the sum of 0 * V: 0, or NaN where V holds
        NaN or inf, as the guarded graph's 0 @ V) acc * 0; where a score is NaN or +inf
        (l is NaN) 0, which differs from the guarded graph only where V holds NaN or
        inf."""
        b = self.b
        inv = b.fdiv(ir.Constant(F32, 1.0), l)
        if not self.s.zero_nan_rows:
            invs = self.splat(inv)
            return lambda acc: b.fmul(acc, invs)
        zero = ir.Constant(F32, 0.0)
        invs = self.splat(b.select(b.fcmp_ordered(">", l, zero), inv, zero))
        nan = b.fcmp_unordered("uno", l, l)
        return lambda acc: b.select(nan, self.zero_v, b.fmul(acc, invs))

    def store_out(self, val, orow, e0: int, mask):
        """O elements e0 + lane of the row at orow (mask: lanes inside Dv)."""
        s, b = self.s, self.b
        od = self.st["o_strides"][3]
        dt = self.dt["o"]
        if od == 1 or s.Dv == 1:
            self.store_cvt(val, self.gep(orow, e0, self.ety["o"]), mask, dt)
        else:
            offs = self.lanes_times(e0, od, 4 if dt == "float32" else 2)
            ptrs = b.inttoptr(b.add(self.splat(b.ptrtoint(orow, I64), VI64), offs), VPTR)
            self.scatter_cvt(val, ptrs, mask, dt)

    def store_nan_rows(self, O_bh, q0, mq):
        """Rows that see no key at all (causal, Sq > Sk): softmax over nothing, 0/0 (0
        with ``zero_nan_rows``)."""
        s, b = self.s, self.b
        val = self.zero_v if s.zero_nan_rows else self.splat(float("nan"))
        with self.loop(0, mq, 1, "nanr") as r:
            orow = self.gep(O_bh, self.mul(b.add(q0, r), self.st["o_strides"][2]), self.ety["o"])
            for v in range(_cdiv(s.Dv, 16)):
                m = self.lanes_lt(s.Dv, 16 * v)
                full = all(c.constant for c in m.constant)
                self.store_out(val, orow, 16 * v, None if full else m)


def emit_attention(
    module: ir.Module, name: str, spec: AttnSpec | AttnForm, *, tuning: dict | None = None
) -> ir.Function:
    """Emit ``void name(ptr args, i64 tile_begin, i64 tile_end, ptr workspace)``
    with ``args = [Q, K, V, (mask if spec.mask != "none"), O]``; for an `AttnForm`
    the pointers are followed by the i64 runtime dims ``RT_DIMS`` (see
    :func:`attention_tiling`, which also gives the tiles and the workspace).

    ``tuning`` overrides planning decisions (see :func:`attention_plan`); pass
    the same ``tuning`` to :func:`attention_num_tiles` and
    :func:`attention_workspace_bytes`.
    """
    plan = attention_plan(spec, tuning)
    fn = abi_function(module, name)
    _Gen(module, fn, spec, plan).emit()
    return fn
