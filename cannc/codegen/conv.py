"""Convolution kernels as LLVM IR: implicit GEMMs with register-blocked micro-kernels.

Every convolution is normalised to three spatial dimensions (1-D and 2-D put
size-1 dims in front) and seen per image ``n`` and group ``g`` as

    Y[n, g][Mg, OD*OH*OW] = W[g][Mg, K] x col[K, OD*OH*OW],   K = Cg*KD*KH*KW

with ``k = ci*KK + tap`` -- the natural layout of a Conv weight, so ``W[g]``
is the weight tensor itself, row-major. ``col`` is never materialised whole.

A tile is ``(n, g, pixel block, output-channel block)`` (``plan_conv`` models
the two-core split and picks the grid); per tile and per block of ``CB``
input channels (``KC = CB*KK`` reduction rows) one of three schemes runs:

* direct (stride 1, output rows/planes as large as the input's, <= 9 taps:
  3x3 "same" convs, 1x1 convs): each tap reads X in place at a constant
  offset from the output pixel, so the micro-kernel's vector loads go straight
  to X; padding and row wrap-around are per-tap lane masks. No copies.
* im2col: the ``kc x P`` block of ``col`` is built in the per-core workspace,
  row segments copied with masked ``<16 x float>`` loads (stride 1), two loads
  and an even-lane shuffle (stride 2) or masked gathers (other strides,
  transposed convolutions); padding is the load masks (zeros).
* swapped (small images, e.g. 14x14 and 7x7 whose pixel count is no multiple
  of 32): im2col (a 1x1 conv reads X itself instead, ``swap_reads_x``, a plane's
  last short micro-tile reading its last pixel for the rows past it; and so does a KxK
  conv of few channels a group whose output rows are a multiple of MR: a segment per
  tap, the micro-tile's pixels at stride s in one input row, ``_ConvGen.swap_taps``;
  strided ones on images of any size), then a
  micro-tile of MR pixels x 16*NV output channels with the vectors along channels
  (weights packed in 16*NV-channel panels), so no lanes are wasted on ragged pixel
  counts; the sums live in the workspace ([P][CH], pixel-major) and, after the last
  reduction block, are transposed 16 x 16 in registers and written to Y's channel
  planes with whole-vector stores (a 16-lane scatter per pixel, as before, cost the
  96->576 1x1 conv of a 14x14 MobileNetV2 block 35% of its time at batch 8).

The micro-kernel (``_ConvGen.micro``) keeps ``MR x NV`` ``<16 x float>``
accumulators as phi values (``llvm.fma.v16f32``, one operand broadcast, the
k loop unrolled), following shared/PERFORMANCE_NOTES.md. Partial sums live in
Y (or the workspace) between reduction blocks; the bias and an optional
elementwise epilogue are applied on the last one.

Weights are packed at compile time (``pack_weights``) into
``[G][ceil(Mg/CU)][K][CU]`` panels (zero padded); runtime weights are packed
the same way per tile and reduction block into the workspace.

ConvTranspose is the same kernel over a virtually up-sampled input (the
fractionally strided convolution): input tap ``iv = o - pad' + k*d`` exists
when ``iv % stride == 0``, with the kernel flipped and in/out channels swapped
(done by ``pack_weights`` / the runtime packer).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import llvmlite.ir as ir
import numpy as np

from ..native.emit import (
    BF16,
    F32,
    I1,
    I8,
    I32,
    I64,
    PTR,
    i64,
    mark_vector_code,
    masked_load,
    masked_store,
)
from ..schedule.machine import fma_pipes, gemm_wide_tile, l1d_bytes, l1d_sets, l2_bytes
from ..schedule.split import claim_chunks, split_even
from .plancache import persistent
from .vec import VF, VI32, VM, VPTR, VecBuilder, abi_function, wide_registers

VI = VI32  # <16 x i32>: the lane indices and offsets of the window kernels

# epilogue(builder, value, offset, stride, mask) -> value: applied to each final
# <16 x float> of results (after the bias) before it is stored, e.g. a fused activation or
# residual add. Lane i is the output element Y.flat[offset + i*stride] (offset: i64 flat
# index into the whole output tensor; stride: a Python int, 1 or OD*OH*OW); lanes off in
# `mask` (<16 x i1>) are not stored and must not be read from other tensors.
Epilogue = Callable[[ir.IRBuilder, ir.Value, ir.Value, int, ir.Value], ir.Value]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rup(a: int, b: int) -> int:
    return cdiv(a, b) * b


# ---------------------------------------------------------------------------
# a small vector-kernel builder shared by the conv and pool emitters
# ---------------------------------------------------------------------------

class VB(VecBuilder):
    """VecBuilder plus the i32-lane helpers of the window and GEMM kernels."""

    def __init__(self, module: ir.Module, fn: ir.Function) -> None:
        super().__init__(module, fn)
        self.iota = ir.Constant(VI, list(range(16)))

    def gather_idx(self, base, idx, mask, passthru=None):
        """Masked gather of base[idx[i]] (idx a <16 x i32>)."""
        ptrs = self.b.gep(base, [idx], source_etype=F32)
        ptrs.type = VPTR  # llvmlite types a vector GEP as a scalar ptr
        return self.gather(ptrs, mask, passthru)

    def splat_i(self, x):
        if isinstance(x, int):
            return ir.Constant(VI, [int(x)] * 16)
        if x.type == I64:
            x = self.b.trunc(x, I32)
        return self.splat(x, VI)

    def lanes_lt(self, first: ir.Value | int, limit: ir.Value | int):
        """mask of lanes with first + i < limit (signed, i32 lanes)."""
        b = self.b
        if isinstance(first, int) and isinstance(limit, int):
            return ir.Constant(VM, [1 if first + i < limit else 0 for i in range(16)])
        lanes = b.add(self.splat_i(first), self.iota)
        return b.icmp_signed("<", lanes, self.splat_i(limit))

    def mask_and(self, m, cond):
        """m & splat(cond) for an i1 scalar cond."""
        if cond is True or cond is None:
            return m
        return self.b.select(cond, m, self.zero_m)

    def divmod_c(self, x, d: int):
        if d == 1:
            return x, i64(0)
        return self.b.udiv(x, i64(d)), self.b.urem(x, i64(d))

    def flat_index(self, ptr, base, esize: int = 4):
        """(ptr - base) / esize: the index of ptr in the tensor at base (of float32
        elements, or of 2-byte ones with ``esize`` 2)."""
        b = self.b
        return b.ashr(b.sub(b.ptrtoint(ptr, I64), b.ptrtoint(base, I64)),
                      i64(esize.bit_length() - 1))


WAKE_COST = 1.0e6    # a worker core starts late: ~10 us, in flop units (~100 GFLOP/s)


def dispatch_time(T: int, cores: int, range_cost) -> float:
    """Modelled finish time of a kernel of T tiles under the runtime's dispatcher:
    cores claim the chunks of split.claim_chunks in order, the first free core taking
    the next chunk; the other cores start WAKE_COST late.
    range_cost(t0, t1) is the cost of tiles [t0, t1)."""
    if cores <= 1:
        return range_cost(0, T)
    free = [0.0] + [WAKE_COST] * (cores - 1)
    for t0, t1 in claim_chunks(T, cores):
        c = free.index(min(free))
        free[c] += range_cost(t0, t1)
    return max(free)


def distinct_splits(P: int, limit: int | None = None):
    """(parts, units per part) for the distinct ways to cut P units."""
    out = {}
    for p in range(1, P + 1):
        if limit is not None and p > limit:
            break
        t = cdiv(P, p)
        if t not in out:
            out[t] = p
    return sorted(out.items())


# ---------------------------------------------------------------------------
# geometry and planning
# ---------------------------------------------------------------------------

class _GroupedGeom:
    """Sizes derived from the fields N, C, M, G, isz, osz, k that ConvGeom and
    ConvTGeom share."""

    C: int
    M: int
    G: int
    isz: tuple
    osz: tuple
    k: tuple

    @property
    def Cg(self) -> int:
        return self.C // self.G

    @property
    def Mg(self) -> int:
        return self.M // self.G

    @property
    def KK(self) -> int:
        return self.k[0] * self.k[1] * self.k[2]

    @property
    def OHW(self) -> int:
        return self.osz[0] * self.osz[1] * self.osz[2]

    @property
    def DHW(self) -> int:
        return self.isz[0] * self.isz[1] * self.isz[2]


@dataclass(frozen=True)
class ConvGeom(_GroupedGeom):
    """A convolution normalised to 3 spatial dims (D, H, W).

    ``u`` > 1 marks a transposed convolution seen as a stride-1 convolution over
    the input up-sampled by ``u`` (zeros between samples); then ``s`` is 1 and
    ``pb`` is the equivalent convolution's begin padding (may be negative).
    """

    N: int
    C: int           # input channels
    M: int           # output channels
    G: int
    isz: tuple       # (D, H, W)
    osz: tuple       # (OD, OH, OW)
    k: tuple         # (KD, KH, KW)
    s: tuple = (1, 1, 1)
    d: tuple = (1, 1, 1)
    pb: tuple = (0, 0, 0)
    u: tuple = (1, 1, 1)
    bias: bool = False

    @property
    def K(self) -> int:
        return self.Cg * self.KK

    @property
    def transposed(self) -> bool:
        return self.u != (1, 1, 1)

    @property
    def pointwise(self) -> bool:
        return (self.k == (1, 1, 1) and self.s == (1, 1, 1) and self.pb == (0, 0, 0)
                and not self.transposed and self.isz == self.osz)

    @property
    def direct_ok(self) -> bool:
        """Stride 1 with output rows as wide and planes as tall as the input's: each
        tap reads X at a constant offset from the output pixel (flattened), so the
        GEMM can read X in place, masking what falls into the padding."""
        return (self.s == (1, 1, 1) and not self.transposed
                and self.osz[1:] == self.isz[1:] and self.KK <= DIRECT_MAX_TAPS)

    def tap_offset(self, tap: int) -> int:
        kd, r = divmod(tap, self.k[1] * self.k[2])
        kh, kw = divmod(r, self.k[2])
        D, H, W = self.isz
        return (((kd * self.d[0] - self.pb[0]) * H + kh * self.d[1] - self.pb[1]) * W
                + kw * self.d[2] - self.pb[2])

    @property
    def flops(self) -> int:
        return 2 * self.N * self.M * self.OHW * self.K


@dataclass(frozen=True)
class ConvPlan:
    """Blocking of the implicit GEMM.

    Orientation: normally the micro-tile is MR output channels x 16*NV output
    pixels (vectors along pixels). With ``swap`` it is MR output pixels x
    16*NV output channels (vectors along channels, weights packed as
    16*NV-channel panels): no lanes are wasted on small images (7x7, 14x14)
    whose pixel count is not a multiple of 32; results reach Y through the workspace
    (see _ConvGen.swap_out).
    """

    swap: bool
    MR: int
    NV: int          # <16 x float> vectors per micro-tile row (NR = 16*NV)
    KC: int          # reduction rows per block
    nkb: int         # reduction blocks
    P: int           # output pixels per pixel block
    PB: int          # pixel blocks
    CH: int          # output channels per channel block
    MB: int          # channel blocks per group
    NCP: int         # row stride of the col buffer (floats)
    direct: bool     # read X in place per tap (no col buffer), see ConvGeom.direct_ok;
                     # swapped: X is the col matrix of a 1x1 conv (swap_reads_x)
    CB: int          # input channels per reduction block (KC = CB*KK)
    unroll: int
    ws_col: int      # byte offsets in the workspace
    ws_a: int
    ws_acc: int      # swap: the sums [rup(P, 16)][CH], written to Y after the last block
    ws_bytes: int
    num_tiles: int
    # normal orientation: a tile's micro-tiles walked MR-channel row by row (pixel columns
    # inner), not column by column (rows_outer_default)
    rows_outer: bool = False
    # a pointwise conv's col buffer in the normal orientation: NR-pixel panels
    # [P/NR][KC][NR], as a GEMM packs B, so that a micro-tile streams one contiguous panel
    # (_ConvGen.pack_panels); otherwise rows of NCP pixels a reduction row
    panels: bool = False

    @property
    def NR(self) -> int:
        return 16 * self.NV

    @property
    def CU(self) -> int:
        """channel unit: rows of a weight panel."""
        return self.NR if self.swap else self.MR


MR_EFFICIENCY = {8: 1.0, 7: 0.97, 6: 0.93, 5: 0.88, 4: 0.83}   # relative, measured roughly
# the normal orientation's micro-tile of MR x 16 (NV = 1) against MR x 32 (NV = 2) on
# images with no ragged vector: Zen 4, 1x1 and grouped 3x3 convs at 56x56 0-2% slower.
# Where a row of 32 wastes lanes it wins: 196 pixels (14x14) are 13 vectors of 16, 7
# pairs; grouped 3x3 convs on 14x14 ran 10% faster (RegNet-Y's 320 and 784 channels)
NV_EFFICIENCY = {1: 0.97, 2: 1.0}
# AVX2 (16 ymm): MR x 16 tiles, 2*MR ymm accumulators (at most 12)
MR_EFFICIENCY_AVX2 = {6: 1.0, 5: 0.93, 4: 0.85, 3: 0.72}


# the swapped orientation's 6 x 64 micro-tile (and 5 or 4 rows) against 8 x 32 on cores
# with two FMA pipes (machine.gemm_wide_tile: 10 loads per 24 FMAs, not per 16). Sapphire
# Rapids, ResNet-50's strided convs on 1 core (im2col, swapped), against MR 7 or 8 x 32:
# 3x3/2 128 at 56x56 1.831 ms (from 2.195), 256 at 28x28 1.941 (2.244), 512 at 14x14
# 2.165 (2.458), 1x1/2 512->1024 at 28x28 1.704 (2.052); 1x1/2 256->512 at 56x56 and
# 1024->2048 at 14x14 level (1.748 / 1.783, 1.819 / 1.794). Pointwise convs reading X
# (the planes' last tiles short, swap_x_tail), against the 7 x 32 tile: at 14x14
# 1024->256 0.752 ms (0.841), 256->1024 0.708 (0.868), 256->256 0.180 (0.208), 384->64
# 12% faster, 64->384 5% slower; at 7x7 2048->512 3% faster, 160->960 4% slower
WIDE_TILE_EFF = {6: 1.08, 5: 1.0, 4: 0.94}

# vector loads (and broadcasts) a core issues per cycle next to its FMAs: two on every
# AVX-512 core cannc has met (Zen 4, Zen 5, Sapphire Rapids)
LOADS_PER_CYCLE = 2


def load_balance(MR: int, NV: int, pipes: int) -> float:
    """Share of the FMA rate that an MR x 16*NV micro-tile's loads leave: per k step it
    issues MR + NV loads (broadcasts and vectors) for MR*NV FMAs. With one FMA pipe no
    tile of at least 8 accumulators is load-bound; with two, the MR x 16 tiles are: 9
    loads for 8 FMAs. Sapphire Rapids (two pipes), 1x1 convs swapped on 14x14 and 28x28
    images, MR x 16 against MR x 32: 576->96 0.85, 384->64 0.89, 512->128 0.89."""
    return min(1.0, (MR * NV / pipes) / ((MR + NV) / LOADS_PER_CYCLE))


def choose_mr(Mg: int, wide: bool = True) -> int:
    """Rows of the normal micro-tile: 8 with AVX-512 (16 accumulators, measured best on
    Zen 4), 6 with AVX2 (MR x 16: 12 ymm accumulators), unless a smaller tile wastes
    enough fewer padded rows to make up for its lower speed."""
    eff = MR_EFFICIENCY if wide else MR_EFFICIENCY_AVX2
    if Mg <= max(eff):
        return Mg
    return min(eff, key=lambda mr: rup(Mg, mr) / eff[mr])


def default_nv(n: int, wide: bool) -> int:
    """<16 x float> vectors per micro-tile row along a dimension of n: 2 (32 lanes) with
    AVX-512 where n > 16, else 1 (and always 1 with AVX2: 16 lanes are two ymm)."""
    return 2 if wide and n > 16 else 1


def planes_alias_in_l1(plane_bytes: int) -> bool:
    """Channel planes ``plane_bytes`` apart fall into at most a quarter of the L1 data
    cache's sets (the same few sets for every plane): 112x112 fp32 planes (49 KiB) into 4
    of Zen 4's 64, 56x56 into 16; 28x28 and 14x14 planes spread over all of them."""
    sets, line = l1d_sets()
    if plane_bytes % line:
        return False
    return sets // math.gcd(sets, (plane_bytes // line) % sets) <= sets // 4


# A 1x1 conv of at most this many input channels whose planes alias in L1 reads X through
# im2col (a contiguous copy per block) rather than in place: Zen 4, MobileNetV2's
# expansions 16->96 at 112x112 and 24->144 at 56x56 ran 5-20% faster in the model at batch
# 1 and 8, 1 and 2 cores; its 96->24 and 144->24 projections at 56x56 ran 17-18% slower,
# so wider reductions keep the direct path. 32 input channels were on the im2col side
# until the direct path prefetched X's next pixel panel (DIRECT_PREFETCH); since then the
# 32->16 at 112x112 of MobileNetV2 and EfficientNet and RegNet's 32->64 run faster in
# place: 1 core 147-151 -> 121-125 us and 558 -> 520, 2 cores 77-84 -> 64-66 and 296 ->
# 275, batch 8 1621 -> 1147 and 4889 -> 4440 (16->96 at batch 8 stays 5% faster copied).
IM2COL_ALIASED_MAX_C = 24

# tunables (measured on Zen 4, see benchmarks/conv_bench.py)
DIRECT_MAX_TAPS = 9         # the direct mode unrolls one k-loop per tap (code size, compile time)
IM2COL_CHANNEL_INNER = 8    # im2col loops over channels innermost from this many per block
# swapped orientation, constant weights: while the micro-tiles of a panel of NR channels
# run, the next panel's weights are prefetched into L2, one line per k step. The first
# micro-tile of a panel otherwise streams its weights from DRAM at the FMA rate (~9 bytes
# a cycle, all of the bandwidth) and the others not at all: Zen 4, chains of 1x1 convs
# whose weights leave L3 (784->784 at 7x7, 512->512 at 7x7, 320->320 at 14x14) ran
# 8-17% faster, as fast as with their weights in L3.
SWAP_PREFETCH = True
# swapped 1x1 convs reading X in place (swap_reads_x): a micro-tile's k step broadcasts MR
# pixels of one channel plane and the next k step those of the next plane, so the micro-
# tile that reaches a new cache line of the planes reads kc lines, one per plane, as many
# streams as channels. Each k step also prefetches (into L2) its plane's line this many
# pixels on. On two cores half of X was written by the other core (the depthwise or
# grouped conv before it splits by channels, the conv by pixels), and those lines came
# at the cross-core latency one at a time. Sapphire Rapids guest, 2 cores, cannc profile,
# the swapped 1x1 kernels of each model (two processes a side): MobileNetV2 x0.86,
# MobileNetV3 x0.91, EfficientNet-B0 x0.94-1.01, RegNet x0.96, ResNet-50 x0.90,
# DenseNet-121 x0.87, ShuffleNet x0.93, SqueezeNet x0.90; MobileNetV2 run 3.08-3.14 ->
# 2.79-2.90 ms. On 1 core level within the noise (x0.97-1.02). 8 pixels on were 9%
# slower than 16 on MobileNetV2, 24 2%
SWAP_X_PREFETCH = 16
# a K block's last weight panel prefetches the next block's first (the last block's, the
# next tile's): ResNet-50's 3x3 convs at 7x7 (18 K blocks), 1 core, x0.965
SWAP_PREFETCH_NEXT_BLOCK = True
SWAP_TAPS = True             # KxK convs may take the swapped orientation reading X (swap_reads_x)
# direct 1x1 convs: the next pixel panel of X's KC channel rows, likewise (more streams
# than the hardware prefetchers follow; at batch 8, where X comes from L3: 5-11% faster)
DIRECT_PREFETCH = True
KC_MAX = 256         # reduction rows per block (B micro-panel 32*KC*4 bytes)
KC_MAX_DIRECT = 512  # direct mode: the block of A (Mg x KC) should stay in L2
# AVX2, swapped orientation: a micro-tile's k loop reads its KC x 16 weight panel and KC
# lines of X or of the col buffer (MR pixels of a channel, broadcast one at a time: per FMA
# twice the AVX-512 tile's broadcasts), and the next micro-tile reads them all again; at
# KC 256 that is the whole of a 32 KiB L1 and the broadcasts wait on L2. The rows of a
# block are kept to half of L1 (KC 128 on 32 KiB). Zen 4 under CANNC_ISA=avx2, 1 core,
# 1x1 convs against KC 256 (or the whole reduction): 2048->512 at 7x7 75 -> 106 GF/s,
# 512->2048 74 -> 99, 1152->192 78 -> 94, 320->1280 60 -> 75, 1024->256 at 14x14 84 -> 90,
# 384->96 78 -> 89; 576->96 level. KC 192 gained a third as much; AVX-512 (twice the
# FMAs per broadcast) level or 1-2% slower at KC 128
SWAP_KC_L1_SHARE = 0.5
P_MAX = 256          # pixels per block
# output channel rows a tile of the normal orientation writes at a time where a fused
# epilogue reads a tensor of the output's shape (a residual Add): the micro-tiles walk
# the pixels of CH rows, so the output and each read tensor are CH streams, and more than
# the hardware prefetchers follow leaves the residual's loads waiting on L3. The tile's
# pixel block then grows while the X block it re-reads per channel block stays in half of
# L2. Sapphire Rapids guest, ResNet-50's 64->256 1x1 conv + Add + Relu at 56x56: CH 88 x
# P 256 1.06 ms, CH 16 x P 3136 0.80 ms (1 core), 0.51 -> 0.40 ms (2 cores); CH 32 0.97;
# 128->512 at 28x28 0.88 -> 0.82-0.84. Without the Add, CH 88 is within 3% of 16.
RESIDUAL_ROWS = 16
# a 1x1 conv reading X in place (either orientation) over planes of at least this many
# bytes, with a reduction of more than 2 * FAR_PLANES_KC channels, takes reduction blocks
# of FAR_PLANES_KC channels: a k step reads the next plane, and KC planes of 27x27 or more
# are KC streams, which at 256 or 512 run slower than the partial sums' extra trips
# through Y cost. Sapphire Rapids guest, 1 core, against KC 256/512, two runs each:
# 256->64 at 56x56 0.787-0.798 -> 0.754-0.773 ms, 256->128 at 56x56 1.50-1.67 ->
# 1.50-1.65, 512->128 at 28x28 0.77-0.83 -> 0.70-0.78, 512->256 at 28x28 1.43 -> 1.36-1.41,
# 144->24 + Add at 56x56 0.206 -> 0.181-0.191; 192 and 240 channels level; 96 and 128
# (two blocks) 2-3% slower, and so are 14x14 planes (1024->512 1.31 -> 1.37), so they
# keep whole blocks. KC 128 was slower than both 64 and 256 at 56x56 and 28x28.
# SqueezeNet's squeeze convs at 27x27 (2916-byte planes): 256->32 0.102 -> 0.092-0.096,
# 256->48 0.151 -> 0.130-0.137; at 13x13 (512->64, 384->48) level
FAR_PLANES_BYTES = 2048
FAR_PLANES_KC = 64
IM2COL_FEW_CH_P = 64  # pixels per block of an im2col conv of at most 2*MR output channels
IM2COL_FEW_CH_MIN_K = 64  # ... whose reduction is longer than this
SWAP_MAX_PIXELS = 1024
# swapped orientation: writing 16 results to Y (the sums' round trip through the workspace
# and their share of a 16 x 16 transpose). Zen 4, 1x1 convs at batch 1: 0.13 ns an output,
# ~15 flop units; at batch 8, when Y leaves L2, 0.33 ns. The value is the one measured for
# the 16-lane scatter this write-out replaced (40 made 1x1 stride-2 convs on 56x56 images
# pick the swapped orientation, 5-20% slower than the normal one); with it, the choice on
# MobileNetV2's and ResNet-50's 1x1 convs at 28x28, 14x14 and 7x7 (batch 1 and 8) is the
# faster orientation, measured, in all but one (64->384 at 14x14: 5% off).
SWAP_OUT_COST = 200.0
# the swapped orientation reading X itself (swap_reads_x) against the normal one reading X
# in place, beyond what the model counts: Zen 4, 1x1 convs at 28x28 whose channels fill
# both micro-tiles exactly ran 7-9% faster swapped (144->144, 144->320, 192->32, 128->512,
# 512->128, 256->128; at batch 8 2-9%), where the model had them 1-5% slower; with 0.92 the
# orientation picked is the faster one measured for all 16 1x1 convs at 28x28 and 14x14 of
# MobileNetV2, EfficientNet, RegNet and ResNet-50 (normal still for 32->192, 40->240,
# 240->40, 48->120: short reductions or channel counts that waste swapped lanes)
# Two FMA pipes (Sapphire Rapids): the gain holds where X's channel planes are not whole
# cache lines (14x14, 7x7: the normal orientation's X vectors split lines; 1x1 convs ran
# 12-28% faster swapped: 384->64, 576->96, 256->256, 1024->256), but at 28x28 the normal
# orientation was the faster one, by 6-21% (512->128, 128->512, 128->128, 144->32), so
# there two-pipe cores take no gain
SWAP_READS_X_GAIN = 0.92
# the swapped orientation reading a KxK conv's taps from X (swap_reads_x): with one vector
# of 16 channels a micro-tile row each k step loads a weight vector and broadcasts MR
# pixels for MR FMAs (the normal orientation's direct path: 2 X vectors and MR weights
# for 2*MR). Zen 4, 3x3 stride 1, 16 channels a group: 144 ch at 28x28 and 320 at 14x14
# 22-40% slower swapped than the normal direct path, 784 at 7x7 (49 pixels: a third of
# the normal tile's lanes idle) 32% faster; stride 2 (no normal direct path): 64 ch at
# 112x112 25% faster than im2col, 144 at 56x56 17%, MobileNetV3's 3->16 stem 23%. Dense
# stride-2 convs stay on im2col (SWAP_TAPS_MAX_MG): alone 512 at 14x14 ran 7% faster
# reading X, but in the models 7% slower (ResNet-50's layer4.0 conv2 2.14 -> 2.29 ms,
# ResNet-18's 256->512; ConvNeXt's 2x2 downsampling 384->768 3% slower); 256 at 28x28 7%
# slower alone, 128 at 56x56 5%
SWAP_TAPS_EFF = 0.85
SWAP_TAPS_MAX_MG = 32
# im2col, per reduction row and pixel (flop units): a plain copy at stride 1; at larger
# strides each vector is two loads and a shuffle (or a gather). Zen 4, 3x3 stride-2
# convs of 16 channels a group (the GEMM 32 units a K x pixel): im2col 0.697 ms at
# 112x112 (64 ch) where reading X swapped takes 0.520. Only the swapped path reading X
# is costed with the strided figure (a credit): the im2col paths' choices among
# themselves (dense strided convs) are those measured with IM2COL_COST
IM2COL_COST = 6.0
IM2COL_STRIDED_COST = 16.0
# AVX2: the transpose's 2-source shuffles of 16 lanes are split into ymm permutes and blends
# (the scatter it replaced was 16 extracts and scalar stores: Zen 3, the swapped
# orientation of ResNet's 7x7 stride-2 stem took 3.0 ms where the normal one takes 1.8)
SWAP_OUT_COST_AVX2 = 1000.0


def im2col_unit_cost(geom: ConvGeom) -> float:
    """IM2COL_COST at stride 1, IM2COL_STRIDED_COST otherwise."""
    return IM2COL_COST if geom.s == (1, 1, 1) else IM2COL_STRIDED_COST


# a cache line of Y that two cores write (each its own floats of it) moves between them
# while both run. Sapphire Rapids guest, 2 cores, 1x1 convs at 14x14 (784-byte planes):
# 96->576 with a pixel half of every plane per core (2 shared lines a plane) 0.114 ms,
# with half of the planes per core 0.084 (~26 ns a line where both cores write all
# their lines at once); in MobileNetV2 64->384 0.058 -> 0.042. Charged ~4 ns (flop
# units at one zmm FMA a cycle, x pipes): against SPLIT_READ_COST the figure that also
# keeps the pixel halves where those were measured faster (ShuffleNet's 116->116 at
# 14x14 0.031 vs 0.036 ms, MobileNetV2's 384->64 0.060 vs 0.069)
SHARED_LINE_COST = 400.0


def shared_lines(geom: ConvGeom, PB: int, P: int, MB: int, cores: int) -> int:
    """Cache lines of Y that more than one core writes under the dispatcher's regions
    (schedule/split.py split_even; tile = (n, g, pb, mb), mb fastest): a region
    boundary inside an (n, g) group of several pixel blocks splits each of its Mg
    channel planes between two cores, sharing the line at the pixel boundary unless
    planes and blocks are whole lines, and the line across the plane's end unless the
    planes are."""
    if cores <= 1 or PB <= 1:
        return 0
    plane_bytes = geom.OHW * 4
    per_plane = (plane_bytes % 64 != 0) + (plane_bytes % 64 != 0 or P * 4 % 64 != 0)
    if not per_plane:
        return 0
    return _region_cuts(geom, PB, MB, cores, PB * MB) * geom.Mg * per_plane


def _region_cuts(geom: ConvGeom, PB: int, MB: int, cores: int, unit: int) -> int:
    """Boundaries between the dispatcher's per-core regions of the N*G*PB*MB tiles
    (schedule/split.py split_even) that fall inside a run of `unit` tiles."""
    T = geom.N * geom.G * PB * MB
    return sum(1 for r0, _ in split_even(T, cores)[1:] if r0 % unit)


# a byte of X that a second core reads too (a pixel block whose channel blocks two
# cores share; in a model much of X was written by the other core) costs what a byte
# of weights does (weight_traffic): the split weighs the X both cores read against
# the weights each reads whole. 2 cores, ResNet-50's 64->256 + Add at 56x56 (X 784
# KiB, weights 64 KiB): 16-channel tiles of whole planes 0.44 ms, pixel halves 0.35;
# 1024->256 at 14x14 (X 784 KiB, weights 1 MiB) and EfficientNet-B0's 1152->192 at
# 7x7 keep channel halves (pixel halves 3% and 15% slower)
SPLIT_READ_COST = 1.0


def split_reads(geom: ConvGeom, PB: int, P: int, MB: int, cores: int) -> int:
    """Bytes of X read by more than one core under the dispatcher's regions: a region
    boundary between two channel blocks of one pixel block has both cores read that
    block's Cg x P inputs."""
    if cores <= 1 or MB <= 1:
        return 0
    return _region_cuts(geom, PB, MB, cores, MB) * geom.Cg * min(P, geom.OHW) * 4


def _grid(geom: ConvGeom, K: int, pu: int, cu: int, pmax: int, cores: int,
          tile_cost, chmax: int | None = None) -> tuple:
    """Best (PB, P, MB, CH) for pixel unit pu and channel unit cu; a split that makes
    cores share lines of Y (shared_lines) is charged SHARED_LINE_COST a line, one that
    has two cores read the same X (split_reads) SPLIT_READ_COST a byte."""
    OHW, Mg = geom.OHW, geom.Mg
    pipes = fma_pipes() if wide_registers() else 1
    best = None
    tmax = max(4096, geom.N * geom.G * cdiv(OHW, max(pu, (pmax // pu) * pu)))
    for PB, qb in distinct_splits(cdiv(OHW, pu)):
        P = qb * pu
        if P > max(pmax, pu):
            continue
        for MB, mbs in distinct_splits(cdiv(Mg, cu)):
            CH = mbs * cu
            if chmax is not None and CH > max(chmax, cu):
                continue
            T = geom.N * geom.G * PB * MB
            if T > tmax:
                continue
            # tile costs repeat with period PB*MB (tile = (n, g, pb, mb), mb fastest); only
            # the last channel block and the last pixel block are short, so a tile costs
            # one of four figures and the cost of tiles [0, t) has a closed form
            per = PB * MB
            ch_last, px_last = Mg - (MB - 1) * CH, OHW - (PB - 1) * P
            full, short_ch = tile_cost(CH, P), tile_cost(ch_last, P)
            last_full, last_short = tile_cost(CH, px_last), tile_cost(ch_last, px_last)
            row = (MB - 1) * full + short_ch                 # pixel blocks 0 .. PB-2
            last_row = (MB - 1) * last_full + last_short     # pixel block PB-1
            period = (PB - 1) * row + last_row

            def upto(t, per=per, MB=MB, PB=PB, row=row, period=period, full=full,
                     last_full=last_full):
                q, r = divmod(t, per)
                pb, mb = divmod(r, MB)     # rows pb complete, then mb tiles of row pb
                # (a row's first mb < MB tiles are full-width channel blocks)
                return q * period + pb * row + mb * (full if pb < PB - 1 else last_full)

            worst = dispatch_time(T, cores, lambda t0, t1: upto(t1) - upto(t0))
            worst += pipes * (SHARED_LINE_COST * shared_lines(geom, PB, P, MB, cores)
                              + SPLIT_READ_COST * split_reads(geom, PB, P, MB, cores))
            if (best is None or worst < best[0] * 0.995
                    or (worst <= best[0] * 1.005 and T < best[5])):
                best = (worst, PB, P, MB, CH, T)
    return best


def weight_traffic(ch: int, K: int) -> float:
    """Cost (flop units) of streaming a tile's ch x K weights into the core: every tile
    reads all of its weights at least once, mostly from L3 (~1 byte per flop)."""
    return 4.0 * ch * K


# plan overrides applied to every plan_conv call without explicit tuning (tests, experiments)
FORCE_TUNING: dict = {}


def plan_conv(geom: ConvGeom, const_weights: bool = True, cores: int = 2,
              tuning: dict | None = None, reads: int = 0) -> ConvPlan:
    """Choose orientation, blocking and the tile grid (modelled for `cores` cores).
    ``reads``: tensors of the output's shape that a fused epilogue reads (a residual
    Add), each a stream next to the output's (see RESIDUAL_ROWS).
    ``tuning`` overrides decisions: swap, direct, MR, NV, KC, P, CH, unroll, rows_outer."""
    tun = dict(FORCE_TUNING if tuning is None else tuning)
    if not tun:     # a pure function of the geometry: zoo nets repeat their convolutions
        return _plan_conv_default(geom, const_weights, cores, reads)
    return _plan_conv(geom, const_weights, cores, tun, reads)


@persistent("plan_conv")
def _plan_conv_default(geom: ConvGeom, const_weights: bool, cores: int,
                       reads: int = 0) -> ConvPlan:
    return _plan_conv(geom, const_weights, cores, {}, reads)


def swap_reads_x(geom: ConvGeom, MR: int) -> bool:
    """The swapped orientation's micro-kernel can broadcast its MR pixels a k step from X
    itself rather than from an im2col copy:

    - a 1x1 conv (stride 1, no padding: X is the col matrix, rows a plane apart). Zen 4,
      the copy was ~15% of a 1x1 conv on 7x7 or 14x14 images: 1152->192 at 7x7 0.2225
      -> 0.19 ms. Where MR does not divide the planes, the plane's last micro-tile reads
      its rows past the plane's end from its last pixel (no pixel past X's end);
    - a 2-D KxK conv of any stride whose output rows are a multiple of MR pixels: a
      micro-tile's pixels lie in one output row, so a tap reads them at a constant stride
      from one input row (_ConvGen.swap_taps; taps in the padding are skipped or read
      as zeros in the micro-tiles at the image's edges). This is the path of strided convs
      with few channels a group (at most SWAP_TAPS_MAX_MG), whose im2col copy cost as
      much as their GEMM.

    A 1x1 conv only where X's channel planes do not alias in L1 (a k step reads the next
    one). The KxK taps do not mind: 3x3 stride 2 over 112x112 planes (49 KiB apart, 4
    of Zen 4's 64 L1 sets), 16 channels a group, 0.695 ms im2col -> 0.522 swapped."""
    if geom.pointwise:
        return not planes_alias_in_l1(geom.DHW * 4)
    return (SWAP_TAPS and 1 < geom.KK <= DIRECT_MAX_TAPS and geom.k[0] == 1
            and geom.osz[0] == 1 and not geom.transposed and geom.osz[2] % MR == 0
            and geom.Mg <= SWAP_TAPS_MAX_MG)


def _plan_conv(geom: ConvGeom, const_weights: bool, cores: int, tun: dict,
               reads: int = 0) -> ConvPlan:
    Mg, K, OHW = geom.Mg, geom.K, geom.OHW
    pmax = tun.get("P", P_MAX)
    cands = []

    # normal orientation: MR channels x 16*NV pixels
    wide = wide_registers()
    # the costs are in flop units, the time of a flop at the FMA peak; the overheads
    # (copies, write-outs, weight streams, per tile) were measured on Zen 4, one zmm FMA
    # a cycle: with two pipes the same nanoseconds are twice the flops
    pipes = fma_pipes() if wide else 1
    MR = tun.get("MR", choose_mr(Mg, wide))
    direct = tun.get("direct", True) and geom.direct_ok
    if direct and "direct" not in tun and geom.KK == 1 and geom.Cg <= IM2COL_ALIASED_MAX_C \
            and planes_alias_in_l1(geom.DHW * 4):
        direct = False
    im2col_cost = 0.0 if direct else IM2COL_COST

    def cost_n_of(NR):
        eff = NV_EFFICIENCY.get(NR // 16, 1.0) * load_balance(MR, NR // 16, pipes) \
            if wide else 1.0

        def cost_n(ch, px):
            c = 2.0 * rup(ch, MR) * rup(px, NR) * K / eff
            c += pipes * (im2col_cost * K * px + 3000.0 + weight_traffic(ch, K))
            if not const_weights:
                c += pipes * 4.0 * rup(ch, MR) * K
            return c
        return cost_n

    want_swap = tun.get("swap")
    if want_swap is not True:
        # an im2col block that one or two MR-row passes read (few output channels, e.g.
        # RegNet's grouped convs of 16 channels a group) is read back from L1 only when
        # it is small: Zen 4, 3x3 stride-2 convs of 16-channel groups (K = 144; 64 channels
        # at 112x112, 144 at 56x56) 7-11% faster with 64 pixels a tile than with 256. Short
        # reductions keep the long tiles: MobileNetV3's 3x3 stride-2 stem (K = 27, 16
        # channels) was 10% slower with 64
        few = Mg <= 2 * MR and K > IM2COL_FEW_CH_MIN_K
        pmax_n = min(pmax, IM2COL_FEW_CH_P) if few and not direct and "P" not in tun else pmax
        chmax = tun.get("CH")
        if reads and direct and chmax is None:
            # a residual read next to the output: few channel rows a tile, long pixel runs
            chmax = max(MR, RESIDUAL_ROWS // MR * MR)
            if "P" not in tun:
                pmax_n = max(pmax_n, l2_bytes() // 2 // (4 * K) // 16 * 16)
        NV = tun.get("NV", default_nv(OHW, wide))
        g = _grid(geom, K, 16 * NV, MR, pmax_n, cores, cost_n_of(16 * NV), chmax)
        # vectors a micro-tile row: 2 (32 pixels) unless one wastes enough fewer lanes
        # past the image's last pixel to make up for its lower speed (NV_EFFICIENCY).
        # The orientation is chosen on the cost of NV = 2 (measured against the swapped
        # one): 1x1 expansions on 14x14 (80->480) stay swapped, 7% faster than NV = 1
        if "NV" not in tun and NV == 2:
            g1 = _grid(geom, K, 16, MR, pmax_n, cores, cost_n_of(16), chmax)
            if g1[0] < g[0]:
                NV, g = 1, (g[0], *g1[1:])
        cands.append((g[0], False, MR, NV, direct, g))

    # swapped: MR pixels x 16*NV channels (im2col, or X itself: swap_reads_x); on images
    # of more than SWAP_MAX_PIXELS pixels only reading X, for KxK convs the normal
    # orientation cannot read in place (strided)
    mrs = [tun["MR"]] if "MR" in tun else ([8, 7, 6, 5, 4] if wide else [6, 5, 4])
    big = OHW > SWAP_MAX_PIXELS
    taps_x = (not geom.pointwise and not direct and tun.get("direct", True)
              and any(swap_reads_x(geom, mr) for mr in mrs))
    if want_swap is True or (want_swap is None and Mg >= 16 and (not big or taps_x)):
        # NV = 1 where 32-channel panels waste lanes: measured as fast as NV = 2 when
        # neither wastes (Zen 4, 1x1 convs at 7x7 and 14x14), and 672->112 at 14x14 (3.5
        # panels of 32) 0.293 -> 0.256 ms
        nvs = [tun["NV"]] if "NV" in tun else sorted({default_nv(Mg, wide), 1}, reverse=True)
        # 6 x 64 tiles (WIDE_TILE_EFF) on two-pipe cores
        if "NV" not in tun and wide and gemm_wide_tile(pipes) and Mg > 32:
            nvs = [4, *nvs]
        mr_eff = MR_EFFICIENCY if wide else MR_EFFICIENCY_AVX2
        out_cost = SWAP_OUT_COST if wide else SWAP_OUT_COST_AVX2
        # X itself as the col matrix (1x1: a plane's last, short micro-tile clamps its
        # rows to the plane, swap_x_tail; KxK: where the micro-tiles never run past an
        # output row's last pixel); a KxK conv weighs the im2col copy too
        variants = []
        for NVs, MRs in itertools.product(nvs, mrs):
            if NVs == 4 and MRs not in WIDE_TILE_EFF:
                continue
            xa = swap_reads_x(geom, MRs) and tun.get("direct", True)
            if not big or xa or want_swap is True:
                variants.append((NVs, MRs, xa))
            if xa and not geom.pointwise and not big:
                variants.append((NVs, MRs, False))
        for NVs, MRs, xa in variants:
            NRs = 16 * NVs

            # (MR pixels a micro-tile: fewer rows run slower, as in the normal orientation:
            # Zen 4, 480->80 at 14x14 MR4 0.152 ms, MR7 0.132; 576->96 0.194, 0.188)
            eff_s = (WIDE_TILE_EFF[MRs] if NVs == 4 else mr_eff.get(MRs, 1.0)) * (
                load_balance(MRs, NVs, pipes) if wide else 1.0)

            # (KxK taps read from X: per k step a weight vector per 16 channels and MR
            # pixel broadcasts from scattered rows, SWAP_TAPS_EFF)
            if xa and not geom.pointwise:
                eff_s *= SWAP_TAPS_EFF

            # the im2col copy (reading X: none; a strided one costs more than the
            # IM2COL_COST charged to the paths that make it, so reading X is credited
            # the difference, which leaves their choices among themselves as they were)
            col = IM2COL_COST if not xa else \
                0.0 if geom.pointwise else IM2COL_COST - im2col_unit_cost(geom)

            def cost_s(ch, px, MRs=MRs, NRs=NRs, eff_s=eff_s, col=col):
                c = 2.0 * rup(ch, NRs) * rup(px, MRs) * K / eff_s
                c += pipes * (col * K * px + 3000.0 + out_cost * ch * px / 16
                              + weight_traffic(ch, K))
                if not const_weights:
                    c += pipes * 4.0 * rup(ch, NRs) * K
                return c
            pm = max(MRs, (pmax // MRs) * MRs)
            g = _grid(geom, K, MRs, NRs, pm, cores, cost_s, tun.get("CH"))
            # a small preference for the normal orientation (cheaper stores, maybe direct),
            # less where the swapped one reads X itself (SWAP_READS_X_GAIN)
            gain = SWAP_READS_X_GAIN if xa and geom.pointwise and (
                pipes == 1 or geom.DHW * 4 % 64) else 1.0
            cands.append((g[0] * 1.02 * gain, True, MRs, NVs, xa, g))
    cost, swap, MR, NV, direct, (_, PB, P, MB, CH, T) = min(cands, key=lambda c: c[0])
    if (not swap and direct and geom.pointwise and Mg >= PANELS_MIN_M
            and not {"direct", "swap", "MR", "NV"} & tun.keys()):
        # many output channels share each packed panel (ConvPlan.panels), in the GEMM's
        # own tile on two-pipe cores
        force = {"direct": False, "swap": False}
        if wide and gemm_wide_tile(pipes):
            force.update(MR=6, NV=4)     # (the 6 x 64 tile: WIDE_TILE_EFF)
        return _plan_conv(geom, const_weights, cores, {**tun, **force}, reads)
    # reduction blocks of whole input channels
    kcmax = tun.get("KC", KC_MAX_DIRECT if direct and not swap else KC_MAX)
    if swap and not wide and "KC" not in tun:
        kcmax = min(kcmax, swap_kc_avx2(16 * NV))
    if ("KC" not in tun and direct and geom.pointwise and 4 * geom.DHW >= FAR_PLANES_BYTES
            and K > 2 * FAR_PLANES_KC):
        kcmax = FAR_PLANES_KC
    nkb = cdiv(K, kcmax)
    CB = cdiv(geom.Cg, nkb)
    nkb = cdiv(geom.Cg, CB)
    KC = CB * geom.KK
    NCP = rup(P, 16) + 16
    plan = ConvPlan(swap=swap, MR=MR, NV=NV, KC=KC, nkb=nkb, P=P, PB=PB, CH=CH, MB=MB, NCP=NCP,
                    direct=direct, CB=CB, unroll=tun.get("unroll", 2 if MR * NV > 8 else 4),
                    panels=geom.pointwise and not swap and not direct,
                    ws_col=0, ws_a=0, ws_acc=0, ws_bytes=0, num_tiles=T,
                    rows_outer=not swap and bool(tun.get("rows_outer",
                                                         rows_outer_default(geom, nkb, KC, CH))))
    return plan_workspace(plan, const_weights)


# A tile of the normal orientation walked column by column writes, per 16*NV-pixel
# column, all CH channel planes of Y (CH store streams, besides the kc planes of X it
# reads); walked MR-channel row by row it writes MR planes at a time and reads its
# kc x P block of X again per row, from L1/L2. Sapphire Rapids guest, 1 core: 64->256
# 1x1 at 56x56 0.766 -> 0.660 ms, 16->96 at 112x112 0.286 -> 0.244, 24->144 at 56x56
# 0.140 -> 0.129; in models (1 and 2 cores) MobileNetV2's and EfficientNet-B0's
# expansions 5-17% faster, RegNet's 32->64 at 112x112 0.44 -> 0.36. Rows are slower
# where X's block is big (reductions of more than 64 rows: 256->64 at 56x56 0.705 ->
# 0.721) or the planes small (28x28: 96->576 0.539 -> 0.564, 144->144 0.208 -> 0.224)
ROWS_OUTER_MIN_CH = 64
ROWS_OUTER_MAX_KC = 64
ROWS_OUTER_MIN_PIXELS = 2048


# A pointwise conv that the cost model gives the normal orientation reading X in place
# packs its K x P block into NR-pixel panels instead where at least PANELS_MIN_M output
# channels share them (ConvPlan.panels; the 6 x 64 tile on two-pipe cores). Sapphire
# Rapids guest, 1 core, against reading X: 64->256 at 56x56 0.655 -> 0.567 ms, 256->128
# 1.382 -> 1.235, 64->64 0.166 -> 0.160, 256->64 0.676 -> 0.657, 128->512 at 28x28
# 0.655 -> 0.576, 144->320 0.448 -> 0.390, 32->192 0.063 -> 0.058; with few channels the
# copy is not paid back: 96->24 at 56x56 0.091 -> 0.096, 144->24 0.142 -> 0.189,
# 192->32 at 28x28 0.062 -> 0.072. The swapped orientation's choices (14x14, 7x7) beat
# panels everywhere they were measured (256->1024 at 14x14 0.591 vs 0.724)
PANELS_MIN_M = 64


def swap_kc_avx2(NR: int) -> int:
    """Reduction rows of a swapped AVX2 block whose weight panel (NR floats a row) and
    lines of X (one a row) fill SWAP_KC_L1_SHARE of L1, in multiples of 16."""
    line = l1d_sets()[1]
    return max(16, int(l1d_bytes() * SWAP_KC_L1_SHARE) // (4 * NR + line) // 16 * 16)


def rows_outer_default(geom: ConvGeom, nkb: int, KC: int, CH: int) -> bool:
    """Walk a normal-orientation tile row by row (ConvPlan.rows_outer)."""
    return (nkb == 1 and KC <= ROWS_OUTER_MAX_KC and CH >= ROWS_OUTER_MIN_CH
            and geom.OHW >= ROWS_OUTER_MIN_PIXELS)


def plan_workspace(plan: ConvPlan, const_weights: bool) -> ConvPlan:
    """``plan`` with the workspace laid out for prepacked (constant) weights or for
    runtime weights, which each tile packs into the workspace: [col | A panels | acc]."""
    col_bytes = 0 if plan.direct else plan.KC * (
        rup(plan.P, plan.NR) if plan.panels else plan.NCP) * 4
    ws_a = rup(col_bytes, 64)
    a_bytes = 0 if const_weights else rup(plan.CH, plan.CU) * plan.KC * 4
    ws_acc = rup(ws_a + a_bytes, 64)
    # (rows up to a multiple of 16: the write-out transposes whole 16 x 16 blocks)
    acc_bytes = rup(plan.P, 16) * plan.CH * 4 if plan.swap else 0
    return replace(plan, ws_col=0, ws_a=ws_a, ws_acc=ws_acc, ws_bytes=rup(ws_acc + acc_bytes, 64))


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------

def conv_weight_matrix(geom: ConvGeom, w: np.ndarray,
                       transposed_layout: bool = False) -> np.ndarray:
    """The weights as [G, Mg, K] (K in (ci, kd, kh, kw) order).

    ``transposed_layout``: ``w`` is a ConvTranspose weight [C, Mg, KD, KH, KW]
    (already reshaped to 3 spatial dims); it is flipped and channel-swapped.
    """
    G, Mg, Cg = geom.G, geom.Mg, geom.Cg
    w = np.asarray(w, dtype=np.float32)
    if transposed_layout:
        w = w.reshape(G, Cg, Mg, *geom.k)[..., ::-1, ::-1, ::-1]
        w = w.transpose(0, 2, 1, 3, 4, 5)          # [G, Mg, Cg, kd, kh, kw]
    return np.ascontiguousarray(w).reshape(G, Mg, geom.K)


def k_order(geom: ConvGeom, plan: ConvPlan) -> np.ndarray:
    """Natural reduction index (ci*KK + tap) of each position of the packed K axis.
    im2col: the natural order; direct: per block of CB channels, tap-major."""
    K, KK = geom.K, geom.KK
    if not plan.direct:
        return np.arange(K)
    order = []
    for c0 in range(0, geom.Cg, plan.CB):
        cb = min(plan.CB, geom.Cg - c0)
        for tap in range(KK):
            order.extend((c0 + ci) * KK + tap for ci in range(cb))
    return np.array(order, dtype=np.int64)


def pack_weights(geom: ConvGeom, plan: ConvPlan, w: np.ndarray,
                 transposed_layout: bool = False) -> np.ndarray:
    """Pack weights into [G][ceil(Mg/CU)][K][CU] panels, zero padded (flat float32);
    CU = MR channels (normal orientation) or 16*NV channels (swapped)."""
    a = conv_weight_matrix(geom, w, transposed_layout)
    a = a[:, :, k_order(geom, plan)]
    G, Mg, K, MR = geom.G, geom.Mg, geom.K, plan.CU
    Mp = cdiv(Mg, MR)
    out = np.zeros((G, Mp * MR, K), dtype=np.float32)
    out[:, :Mg] = a
    out = out.reshape(G, Mp, MR, K).transpose(0, 1, 3, 2)
    return np.ascontiguousarray(out).reshape(-1)


# ---------------------------------------------------------------------------
# the implicit-GEMM kernel
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Slots:
    """Positions in the kernel's argument array."""
    x: int = 0
    w: int = 1
    b: int = 2       # -1: no bias
    y: int = 3


def conv_args(v: VecBuilder, args: ir.Value, slots: Slots, bias: bool) -> tuple:
    """X, W, Bias (None without a bias) and Y from a conv kernel's argument array."""
    return (v.arg(args, slots.x), v.arg(args, slots.w),
            v.arg(args, slots.b) if bias else None, v.arg(args, slots.y))


class _ConvGen:
    def __init__(self, module, fn, geom: ConvGeom | ConvTGeom, plan: ConvPlan | ConvTPlan,
                 slots: Slots, a_prepacked: bool, transposed_layout: bool,
                 epilogue: Epilogue | None):
        self.v = VB(module, fn)
        self.g = geom
        self.p = plan
        self.slots = slots
        self.a_prepacked = a_prepacked
        self.tl = transposed_layout
        self.epilogue = epilogue
        # the epilogue applied to each tile after its sums (late_pass): emit_conv sets it;
        # never a ConvTranspose (_ConvTGen), whose GEMM stores raw sums for its col2im
        self.late = False

    def load_args(self, args):
        self.X, self.W, self.Bias, self.Y = conv_args(self.v, args, self.slots, self.g.bias)

    def emit(self):
        v, g, p = self.v, self.g, self.p
        b = v.b
        args, tb, te, ws = v.fn.args
        self.load_args(args)
        self.col = b.gep(ws, [i64(p.ws_col)], source_etype=I8)
        self.wsa = b.gep(ws, [i64(p.ws_a)], source_etype=I8)
        self.acc = b.gep(ws, [i64(p.ws_acc)], source_etype=I8)
        MB, PB, G = p.MB, p.PB, g.G
        with v.loop(tb, te, 1, "tile") as t:
            r, mb = v.divmod_c(t, MB)
            r, pb = v.divmod_c(r, PB)
            n, gi = v.divmod_c(r, G)
            p0 = b.mul(pb, i64(p.P))
            p1 = v.smin(b.add(p0, i64(p.P)), g.OHW)
            m_lo = b.mul(mb, i64(p.CH))
            m_hi = v.smin(b.add(m_lo, i64(p.CH)), g.Mg)
            x_ng = v.gep(self.X, b.mul(b.add(b.mul(n, i64(g.C)), b.mul(gi, i64(g.Cg))), i64(g.DHW)))
            ch0 = b.mul(gi, i64(g.Mg))   # first output channel of the group
            y_ng = v.gep(self.Y, b.mul(b.add(b.mul(n, i64(g.M)), ch0), i64(g.OHW)))
            self.tile(gi, ch0, x_ng, y_ng, p0, p1, m_lo, m_hi)
        b.ret_void()

    # -- one tile ----------------------------------------------------------
    def tile(self, gi, ch0, x_ng, y_ng, p0, p1, m_lo, m_hi):
        v, g, p = self.v, self.g, self.p
        b = v.b
        npix = b.sub(p1, p0)
        CU = p.CU

        def w_panel(m, k0, kc):
            """weight panel of channel m (multiple of CU) in the group, from row k0."""
            if self.a_prepacked:
                panel = b.add(b.mul(gi, i64(cdiv(g.Mg, CU))), b.udiv(m, i64(CU)))
                return v.gep(self.W, b.add(b.mul(panel, i64(g.K * CU)), b.mul(k0, i64(CU))))
            return v.gep(self.wsa, b.mul(b.udiv(b.sub(m, m_lo), i64(CU)), b.mul(kc, i64(CU))))

        def body(kb, first, last):
            if p.direct:
                c0 = b.mul(kb, i64(p.CB)) if p.nkb > 1 else i64(0)
                cb = v.smin(b.sub(i64(g.Cg), c0), p.CB) if p.nkb > 1 else i64(g.Cg)
                k0 = b.mul(c0, i64(g.KK))
                kc = b.mul(cb, i64(g.KK))
                x_blk = v.gep(x_ng, b.add(b.mul(c0, i64(g.DHW)), p0))
            else:
                c0 = b.mul(kb, i64(p.CB)) if p.nkb > 1 else i64(0)
                cb = v.smin(b.sub(i64(g.Cg), c0), p.CB) if p.nkb > 1 else i64(g.Cg)
                k0 = b.mul(c0, i64(g.KK))
                kc = b.mul(cb, i64(g.KK))
                if p.panels:
                    self.pack_panels(x_ng, c0, cb, p0, npix)
                else:
                    self.im2col(x_ng, c0, cb, p0, p1)
            if not self.a_prepacked:
                self.pack_a(gi, k0, kc, m_lo, m_hi)
            if p.swap:
                # jr: panels of NR channels (B = weights, from L1/L2);
                # ir: MR pixels (A = col, broadcast)
                with v.loop(m_lo, m_hi, p.NR, "jr") as jr:
                    nch = v.smin(b.sub(m_hi, jr), p.NR)
                    chmask = [v.lanes_lt(16 * j, nch) for j in range(p.NV)]
                    b_base = w_panel(jr, k0, kc)
                    # the next panel's weights (kc rows of NV lines) into L2 while this one
                    # is used: line (ir / MR) % NV of each row in the micro-tile of ir (the
                    # last tile's last "next" lies past the weights: prefetches do not fault)
                    nxt = None
                    if SWAP_PREFETCH and self.a_prepacked:
                        # next: this K block's next channels, else the next K block's
                        # first, else the next tile's (channels m_hi on: the next
                        # channel block, where one core runs both; weights left the
                        # caches since the last run, and a cold panel stalls the first
                        # micro-tiles of every block)
                        jn, kn = b.add(jr, i64(p.NR)), k0
                        if SWAP_PREFETCH_NEXT_BLOCK:
                            is_last = ir.Constant(I1, 1) if last is True else last
                            n_in = b.icmp_signed("<", jn, m_hi)
                            m_nx = b.select(is_last, m_hi, m_lo)
                            k_nx = b.select(is_last, i64(0), b.add(k0, kc))
                            jn, kn = b.select(n_in, jn, m_nx), b.select(n_in, k0, k_nx)
                        nxt = w_panel(jn, kn, kc)
                    with v.loop(i64(0), npix, p.MR, "ir") as ir_:
                        npx = v.smin(b.sub(npix, ir_), p.MR)
                        io = _SwapIO(self, jr, m_lo, ir_, npx, chmask)
                        pf = [] if nxt is None else [(self.pf_line(nxt, ir_), p.NR)]
                        if p.direct and g.KK > 1:       # KxK reading X (swap_reads_x)
                            # (a segment per tap: no next-panel prefetch)
                            self.swap_taps(x_ng, c0, cb, b_base, b.add(p0, ir_), io, first,
                                           last)
                        elif p.direct:    # X is the col matrix (swap_reads_x)
                            segs = [(v.gep(x_blk, ir_), g.DHW, b_base, p.NR, kc, None)]
                            if SWAP_X_PREFETCH:   # (past X's end: prefetches do not fault)
                                pf = pf + [(v.gep(x_blk, b.add(ir_, i64(SWAP_X_PREFETCH))),
                                            g.DHW)]
                            if g.OHW % p.MR == 0:
                                self.micro(segs, io, first, last, pf)
                            else:
                                self.swap_x_tail(segs, npx, io, first, last, pf)
                        else:
                            segs = [(v.gep(self.col, ir_), p.NCP, b_base, p.NR, kc, None)]
                            self.micro(segs, io, first, last, pf)
                return

            def col_setup(jr):
                """(lane masks, tap masks, X or col at pixel column jr) of column jr."""
                nr = v.smin(b.sub(npix, jr), p.NR)
                colmask = [v.lanes_lt(16 * j, nr) for j in range(p.NV)]
                tapmasks = None
                if p.direct:
                    self.x_extent = (x_ng, g.Cg * g.DHW)
                    tapmasks = self.tap_masks(b.add(p0, jr), colmask)
                    b_jr = v.gep(x_blk, jr)
                elif p.panels:      # (panel jr / NR starts at jr * KC)
                    b_jr = v.gep(self.col, b.mul(jr, i64(p.KC)))
                else:
                    b_jr = v.gep(self.col, jr)
                return colmask, tapmasks, b_jr

            def micro_tile(jr, ir_, colmask, tapmasks, b_jr):
                """The micro-tile of channel row ir_ and pixel column jr."""
                mr = v.smin(b.sub(m_hi, ir_), p.MR)
                a_base = w_panel(ir_, k0, kc)
                if p.direct:
                    segs = []
                    for tap in range(g.KK):
                        a_t = v.gep(a_base, b.mul(cb, i64(tap * p.MR))) if tap else a_base
                        segs.append((a_t, p.MR, v.gep(b_jr, g.tap_offset(tap)), g.DHW, cb,
                                     tapmasks[tap]))
                else:
                    segs = [(a_base, p.MR, b_jr, p.NR if p.panels else p.NCP, kc, None)]
                c_ptr = v.gep(y_ng, b.add(b.mul(ir_, i64(g.OHW)), b.add(p0, jr)))
                io = _NormalIO(self, c_ptr, mr, colmask, b.add(ch0, ir_),
                               full=b.icmp_signed(">=", b.sub(npix, jr), i64(p.NR)))
                pf = []
                if DIRECT_PREFETCH and p.direct and g.KK == 1:
                    # the next pixel panel of X's channel rows into L2: reading KC
                    # channel planes at once is more streams than the hardware
                    # prefetchers follow
                    pf = [(self.pf_line(v.gep(b_jr, p.NR), b.sub(ir_, m_lo)), g.DHW)]
                self.micro(segs, io, first, last, pf)

            if getattr(p, "rows_outer", False):
                with v.loop(m_lo, m_hi, p.MR, "ir") as ir_:
                    with v.loop(i64(0), npix, p.NR, "jr") as jr:
                        micro_tile(jr, ir_, *col_setup(jr))
            else:
                with v.loop(i64(0), npix, p.NR, "jr") as jr:
                    cs = col_setup(jr)
                    with v.loop(m_lo, m_hi, p.MR, "ir") as ir_:
                        micro_tile(jr, ir_, *cs)

        if p.nkb == 1:
            body(None, True, True)
        else:
            with v.loop(0, p.nkb, 1, "kb") as kb:
                first = b.icmp_signed("==", kb, i64(0))
                last = b.icmp_signed("==", kb, i64(p.nkb - 1))
                body(kb, first, last)
        if p.swap:
            self.swap_out(ch0, y_ng, p0, npix, m_lo, m_hi)
        elif self.late:
            self.late_pass(y_ng, p0, npix, m_lo, m_hi)

    def late_pass(self, y_ng, p0, npix, m_lo, m_hi):
        """The epilogue applied in place to a tile's stored values (see late_epilogue):
        pixels p0 .. p0+npix-1 of channels m_lo .. m_hi-1."""
        v = self.v
        b = v.b
        with v.loop(m_lo, m_hi, 1, "late.m") as m:
            lo = v.flat_index(v.gep(y_ng, b.add(b.mul(m, i64(self.g.OHW)), p0)), self.Y)
            epilogue_in_place(v, self.Y, self.epilogue, lo, b.add(lo, npix))

    def swap_taps(self, x_ng, c0, cb, b_base, q, io, first, last):
        """The swapped micro-tile of output pixels q .. q+MR-1 (one output row: OW is a
        multiple of MR) of a KxK conv, read from X: a segment per tap, the MR pixels at
        stride sw from one input row. Inside the image every tap reads plain addresses;
        a micro-tile whose window crosses the padding skips the taps whose input row is
        outside (no k steps) and reads the pixels whose column is outside as zeros (their
        address clamped into the row)."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        _, H, W = g.isz
        _, KH, KW = g.k
        _, sh, sw = g.s
        _, dh, dw = g.d
        _, ph, pw = g.pb
        MR = p.MR
        oh, ow0 = v.divmod_c(q, g.osz[2])
        x_c0 = v.gep(x_ng, b.mul(c0, i64(g.DHW))) if p.nkb > 1 else x_ng
        top = b.sub(b.mul(oh, i64(sh)), i64(ph))        # input row of tap row 0
        left = b.sub(b.mul(ow0, i64(sw)), i64(pw))      # input column of pixel 0, tap column 0
        inside = b.and_(
            b.and_(b.icmp_signed(">=", top, i64(0)),
                   b.icmp_signed("<", b.add(top, i64((KH - 1) * dh)), i64(H))),
            b.and_(b.icmp_signed(">=", left, i64(0)),
                   b.icmp_signed("<", b.add(left, i64((MR - 1) * sw + (KW - 1) * dw)), i64(W))))

        def segs(edge: bool) -> list:
            out = []
            for tap in range(KH * KW):
                kh, kw = divmod(tap, KW)
                ih = b.add(top, i64(kh * dh))
                bt = v.gep(b_base, b.mul(cb, i64(tap * p.NR))) if tap else b_base
                if not edge:
                    a = v.gep(x_c0, b.add(b.mul(ih, i64(W)), b.add(left, i64(kw * dw))))
                    out.append((a, g.DHW, bt, p.NR, cb, None, [r * sw for r in range(MR)], None))
                    continue
                row_ok = b.icmp_unsigned("<", ih, i64(H))
                a = v.gep(x_c0, b.mul(b.select(row_ok, ih, i64(0)), i64(W)))
                offs, oks = [], []
                for r in range(MR):
                    col = b.add(left, i64(r * sw + kw * dw))
                    ok = b.icmp_unsigned("<", col, i64(W))
                    oks.append(ok)
                    offs.append(v.smin(v.smax(col, i64(0)), W - 1))
                out.append((a, g.DHW, bt, p.NR, b.select(row_ok, cb, i64(0)), None, offs, oks))
            return out

        with b.if_else(inside, likely=True) as (then, otherwise):
            with then:
                self.micro(segs(False), io, first, last)
            with otherwise:
                self.micro(segs(True), io, first, last)

    def swap_out(self, ch0, y_ng, p0, npix, m_lo, m_hi):
        """Swapped orientation: the tile's sums acc[px][c - m_lo] (pixel-major) to
        Y[c][p0 + px], 16 channels x 16 pixels at a time: 16 rows loaded whole, transposed
        in registers, bias and epilogue applied along pixels (stride 1, as in the normal
        orientation), stored as channel-plane vectors masked to the tile."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        with v.loop(m_lo, m_hi, 16, "oc") as c:
            chok = channel_lanes(v, c, m_hi)
            biases = channel_biases(v, self.Bias, b.add(ch0, c), chok)
            src = v.gep(self.acc, b.sub(c, m_lo))
            y_c = v.flat_index(v.gep(y_ng, b.add(b.mul(c, i64(g.OHW)), p0)), self.Y)
            with v.loop(i64(0), npix, 16, "op") as px:
                row0 = v.gep(src, b.mul(px, i64(p.CH)))
                # rows past npix (up to the 16-multiple the workspace holds) are read but
                # never stored
                cols = v.transpose16([v.load_v(v.gep(row0, i * p.CH)) for i in range(16)])
                store_channel_columns(v, self.Y, cols, biases, b.add(y_c, px), g.OHW,
                                      v.lanes_lt(0, b.sub(npix, px)), chok, self.epilogue)

    def tap_masks(self, pix0, colmask):
        """Direct mode: per tap and vector, the lanes (output pixels pix0 + i) whose
        input pixel lies inside X (and inside the tile)."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        D, H, W = g.isz
        KD, KH, KW = g.k
        if g.pb == (0, 0, 0) and g.k == (1, 1, 1):
            return [colmask]
        res = [[None] * p.NV for _ in range(g.KK)]
        for j in range(p.NV):
            pix = b.add(v.splat_i(pix0), ir.Constant(VI, list(range(16 * j, 16 * j + 16))))
            ow = b.urem(pix, v.splat_i(W))
            rowi = b.udiv(pix, v.splat_i(W))
            oh = b.urem(rowi, v.splat_i(H)) if D > 1 or KD > 1 else rowi
            od = b.udiv(rowi, v.splat_i(H)) if D > 1 or KD > 1 else None
            okd = []
            for kd in range(KD):
                if od is None:
                    okd.append(None)
                else:
                    idd = b.add(od, v.splat_i(kd * g.d[0] - g.pb[0]))
                    okd.append(b.icmp_unsigned("<", idd, v.splat_i(D)))
            okh = []
            for kh in range(KH):
                off = kh * g.d[1] - g.pb[1]
                if off == 0:    # oh < OH == H for the lanes of the tile
                    okh.append(None)
                    continue
                ih = b.add(oh, v.splat_i(off))
                okh.append(b.icmp_unsigned("<", ih, v.splat_i(H)))
            okw = []
            for kw in range(KW):
                off = kw * g.d[2] - g.pb[2]
                if off == 0:
                    okw.append(None)
                    continue
                iw = b.add(ow, v.splat_i(off))
                okw.append(b.icmp_unsigned("<", iw, v.splat_i(W)))
            for kd in range(KD):
                for kh in range(KH):
                    for kw in range(KW):
                        m = colmask[j]
                        for c in (okd[kd], okh[kh], okw[kw]):
                            if c is not None:
                                m = b.and_(m, c)
                        res[(kd * KH + kh) * KW + kw][j] = m
        return res

    # -- im2col ------------------------------------------------------------
    def im2col(self, x_ng, c0, cb, p0, p1):
        """col[(ci*KK + tap)*NCP + p - p0] = X(c0 + ci, input pixel of output pixel p
        for the tap), 0 in the padding, for ci < cb and p0 <= p < p1.

        Loops: tap, output row, 16-column chunk (masks computed here), channel --
        the innermost loop is one or two masked loads and a store."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        D, H, W = g.isz
        OD, OH, OW = g.osz
        KD, KH, KW = g.k
        sd, sh, sw = g.s
        dd, dh, dw = g.d
        pd, ph, pw = g.pb
        ud, uh, uw = g.u
        Dv, Hv, Wv = (D - 1) * ud + 1, (H - 1) * uh + 1, (W - 1) * uw + 1
        x_c0 = v.gep(x_ng, b.mul(c0, i64(g.DHW)))
        row_first = b.udiv(p0, i64(OW))
        row_last = b.udiv(b.sub(p1, i64(1)), i64(OW))
        dst_cstride = g.KK * p.NCP
        with v.loop(0, g.KK, 1, "tap") as tap:
            rem, kw = v.divmod_c(tap, KW)
            kd, kh = v.divmod_c(rem, KH)
            dst_tap = v.gep(self.col, b.mul(tap, i64(p.NCP)))
            # input column of output column 0, in the (virtual) input row
            offw = b.sub(b.mul(kw, i64(dw)), i64(pw))
            with v.loop(row_first, b.add(row_last, i64(1)), 1, "row") as row:
                od, oh = v.divmod_c(row, OH)
                idv = b.add(b.mul(od, i64(sd)), b.sub(b.mul(kd, i64(dd)), i64(pd)))
                ihv = b.add(b.mul(oh, i64(sh)), b.sub(b.mul(kh, i64(dh)), i64(ph)))
                ok = b.and_(b.icmp_unsigned("<", idv, i64(Dv)), b.icmp_unsigned("<", ihv, i64(Hv)))
                if ud > 1:
                    ok = b.and_(ok, b.icmp_unsigned("==", b.urem(idv, i64(ud)), i64(0)))
                if uh > 1:
                    ok = b.and_(ok, b.icmp_unsigned("==", b.urem(ihv, i64(uh)), i64(0)))
                id_ = b.udiv(idv, i64(ud)) if ud > 1 else idv
                ih = b.udiv(ihv, i64(uh)) if uh > 1 else ihv
                # safe row index when invalid (the loads are all masked off then)
                rowidx = b.select(ok, b.add(b.mul(id_, i64(H)), ih), i64(0))
                src_row = v.gep(x_c0, b.mul(rowidx, i64(W)))
                rs = b.mul(row, i64(OW))
                a = b.sub(v.smax(p0, rs), rs)
                e = b.sub(v.smin(p1, b.add(rs, i64(OW))), rs)
                dst_row = v.gep(dst_tap, b.sub(b.add(rs, a), p0))
                if p.CB >= IM2COL_CHANNEL_INNER:
                    with v.loop(a, e, 16, "ow") as ow:
                        first, load = self.row_loader(ow, offw, ok, W, Wv, sw, uw)
                        src0 = v.gep(src_row, first) if first is not None else src_row
                        dst0 = v.gep(dst_row, b.sub(ow, a))
                        self.channel_copy(src0, dst0, cb, load, g.DHW, dst_cstride)
                else:
                    with v.loop(i64(0), cb, 1, "ci") as ci:
                        src_c = v.gep(src_row, b.mul(ci, i64(g.DHW)))
                        dst_c = v.gep(dst_row, b.mul(ci, i64(dst_cstride)))
                        with v.loop(a, e, 16, "ow") as ow:
                            first, load = self.row_loader(ow, offw, ok, W, Wv, sw, uw)
                            src0 = v.gep(src_c, first) if first is not None else src_c
                            v.store_v(load(src0), v.gep(dst_c, b.sub(ow, a)))

    def pack_panels(self, x_ng, c0, cb, p0, npix):
        """col[(q / NR)*KC*NR + ci*NR + q % NR] = X(c0 + ci, p0 + q) for ci < cb and
        q < npix, zeros past npix (ConvPlan.panels: a pointwise conv's pixels are X's
        own, so the block is a copy into the panels a GEMM packs B into)."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        x_c0 = v.gep(x_ng, b.add(b.mul(c0, i64(g.DHW)), p0))
        with v.loop(i64(0), npix, p.NR, "pp") as q:
            nr = v.smin(b.sub(npix, q), p.NR)
            masks = [v.lanes_lt(16 * j, nr) for j in range(p.NV)]
            src_q = v.gep(x_c0, q)
            dst_q = v.gep(self.col, b.mul(q, i64(p.KC)))
            with v.loop(i64(0), cb, 1, "pc") as ci:
                src = v.gep(src_q, b.mul(ci, i64(g.DHW)))
                dst = v.gep(dst_q, b.mul(ci, i64(p.NR)))
                for j in range(p.NV):
                    v.store_v(v.load_v(v.gep(src, 16 * j), masks[j]), v.gep(dst, 16 * j))

    def channel_copy(self, src0, dst0, cb, load, sstride, dstride):
        """for ci < cb: dst0[ci*dstride:+16] = load(src0 + ci*sstride), unrolled by 2."""
        v = self.v
        b = v.b
        pre = b.block
        hdr = b.append_basic_block(v.name("cc.h"))
        body = b.append_basic_block(v.name("cc.b"))
        tail = b.append_basic_block(v.name("cc.t"))
        ext = b.append_basic_block(v.name("cc.x"))
        npair = b.sub(cb, b.and_(cb, i64(1)))
        b.branch(hdr)
        b.position_at_end(hdr)
        ci = b.phi(I64)
        sp = b.phi(PTR)
        dp = b.phi(PTR)
        ci.add_incoming(i64(0), pre)
        sp.add_incoming(src0, pre)
        dp.add_incoming(dst0, pre)
        b.cbranch(b.icmp_signed("<", ci, npair), body, tail)
        b.position_at_end(body)
        x0 = load(sp)
        x1 = load(v.gep(sp, sstride))
        v.store_v(x0, dp)
        v.store_v(x1, v.gep(dp, dstride))
        ci.add_incoming(b.add(ci, i64(2)), body)
        sp.add_incoming(v.gep(sp, 2 * sstride), body)
        dp.add_incoming(v.gep(dp, 2 * dstride), body)
        b.branch(hdr)
        b.position_at_end(tail)
        with b.if_then(b.icmp_signed("<", ci, cb)):
            v.store_v(load(sp), dp)
        b.branch(ext)
        b.position_at_end(ext)

    def row_loader(self, ow, offw, ok, W, Wv, sw, uw):
        """(offset of lane 0 from the row start or None, load(src) -> 16 values) for output
        columns ow..ow+15 of an input row (zeros outside the input)."""
        v = self.v
        b = v.b
        base = b.add(b.mul(ow, i64(sw)), offw)     # input column of lane 0 (virtual if uw>1)
        if uw == 1 and sw == 1:
            lanes = b.add(v.splat_i(base), v.iota)
            m = v.mask_and(b.icmp_unsigned("<", lanes, v.splat_i(W)), ok)
            return base, lambda src: v.mload(src, m)
        if uw == 1 and sw == 2:
            l0 = b.add(v.splat_i(base), v.iota)
            l1 = b.add(l0, v.splat_i(16))
            m0 = v.mask_and(b.icmp_unsigned("<", l0, v.splat_i(W)), ok)
            m1 = v.mask_and(b.icmp_unsigned("<", l1, v.splat_i(W)), ok)
            even = ir.Constant(VI, list(range(0, 32, 2)))
            return base, lambda src: b.shuffle_vector(v.mload(src, m0), v.mload(v.gep(src, 16), m1),
                                                      even)
        lanes = b.add(v.splat_i(base), b.mul(v.iota, v.splat_i(sw)))
        m = b.icmp_unsigned("<", lanes, v.splat_i(Wv))
        if uw > 1:
            m = b.and_(m, b.icmp_unsigned("==", b.urem(lanes, v.splat_i(uw)), v.splat_i(0)))
            lanes = b.udiv(lanes, v.splat_i(uw))
        m = v.mask_and(m, ok)
        return None, lambda src: v.gather_idx(src, lanes, m)

    # -- runtime weight packing ------------------------------------------------
    def pack_a(self, gi, k0, kc, m_lo, m_hi):
        """wsa[panel][kk][MR] = A(g, m_lo + panel*MR + r, k0 + kk) (0 beyond Mg), with the
        packed reduction order of the plan (see k_order)."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        MR = p.CU
        with v.loop(m_lo, m_hi, MR, "pa") as ir_:
            dst0 = v.gep(self.wsa, b.mul(b.udiv(b.sub(ir_, m_lo), i64(MR)), b.mul(kc, i64(MR))))
            with v.loop(i64(0), kc, 1, "pak") as kk:
                dst = v.gep(dst0, b.mul(kk, i64(MR)))
                if p.direct:
                    # block of cb channels starting at c0 = k0/KK, tap-major
                    cb = b.udiv(kc, i64(g.KK))
                    tap = b.udiv(kk, cb)
                    ci = b.add(b.udiv(k0, i64(g.KK)), b.urem(kk, cb))
                else:
                    ci, tap = v.divmod_c(b.add(k0, kk), g.KK)
                k = b.add(b.mul(ci, i64(g.KK)), tap)
                if self.tl:
                    sp = b.sub(i64(g.KK - 1), tap)
                for r in range(MR):
                    m = b.add(ir_, i64(r))
                    okr = b.icmp_signed("<", m, m_hi)
                    m = b.select(okr, m, m_lo)
                    if self.tl:
                        # W_T[(g*Cg + ci)][m][KK-1-tap]
                        idx = b.add(b.mul(b.add(b.mul(b.add(b.mul(gi, i64(g.Cg)), ci),
                                                          i64(g.Mg)), m),
                                          i64(g.KK)), sp)
                    else:
                        idx = b.add(b.mul(b.add(b.mul(gi, i64(g.Mg)), m), i64(g.K)), k)
                    x = b.load(v.gep(self.W, idx), typ=F32, align=4)
                    x = b.select(okr, x, ir.Constant(F32, 0.0))
                    b.store(x, v.gep(dst, r), align=4)

    def swap_x_tail(self, segs, npx, io, first, last, pf):
        """The swapped micro-tile reading X itself where MR does not divide the planes:
        full tiles as they are; the plane's last, short one (npx < MR pixels) reads its
        rows from npx on at its last pixel (their sums are not stored), so no load
        passes the plane's end, nor X's."""
        v, p = self.v, self.p
        b = v.b
        with b.if_else(b.icmp_signed("==", npx, i64(p.MR)), likely=True) as (full, short):
            with full:
                self.micro(segs, io, first, last, pf)
            with short:
                last_px = b.sub(npx, i64(1))
                aoffs = [i64(0)] + [v.smin(i64(r), last_px) for r in range(1, p.MR)]
                self.micro([(*segs[0], aoffs, None)], io, first, last, pf)

    # -- micro-kernel ------------------------------------------------------------
    def pf_line(self, panel, i):
        """The prefetch stream of the micro-tile at offset i (a multiple of MR) of a loop
        whose micro-tiles share a panel of NV lines a k step (the next panel's weights,
        or X's next pixels): line (i / MR) % NV of each k row, so the first NV micro-tiles
        cover the panel."""
        v, p = self.v, self.p
        b = v.b
        line = b.urem(b.udiv(i, i64(p.MR)), i64(p.NV))
        return v.gep(panel, b.mul(line, i64(16)))

    def micro(self, segs, io, first, last, pf=None):
        """acc[MR][NV] += sum over segments (a, a_ks, b, b_ks, count, bmasks) of
        a[k*a_ks + r] * b[k*b_ks + 16j] (b loads masked by bmasks[j] when given);
        a segment may add (aoffs, amasks): row r reads a[k*a_ks + aoffs[r]], as zero
        where amasks[r] (when given) is false;
        the sums begin at zero; `io` reads the earlier blocks' partial sums, added at
        the end (VecBuilder.add_partials), and stores the accumulators.
        ``pf``: prefetch streams, (pointer, floats per k step) each: one line from each is
        prefetched into L2 per k step of the (single) segment."""
        v, p = self.v, self.p
        b = v.b
        MR, NV, U = p.MR, p.NV, p.unroll
        assert not pf or len(segs) == 1
        io.prefetch()
        accs = [[v.zero_v] * NV for _ in range(MR)]

        def step(accs, a_ptr, b_ptr, u, a_ks, b_ks, bmasks, aoffs=None, amasks=None):
            if isinstance(bmasks, _AndMasks):   # readable: plain loads, lanes cleared
                bv = [b.bitcast(b.and_(b.bitcast(v.load_v(v.gep(b_ptr, u * b_ks + 16 * j)), VI32),
                                       bmasks.bits[j]), VF)
                      for j in range(NV)]
            else:
                bv = [v.load_v(v.gep(b_ptr, u * b_ks + 16 * j), bmasks[j] if bmasks else None)
                      for j in range(NV)]
            new = []
            for r in range(MR):
                off = r if aoffs is None else aoffs[r]
                off = u * a_ks + off if isinstance(off, int) else (
                    b.add(off, i64(u * a_ks)) if u * a_ks else off)
                x = b.load(v.gep(a_ptr, off), typ=F32, align=4)
                if amasks is not None:
                    x = b.select(amasks[r], x, ir.Constant(F32, 0.0))
                xs = v.splat(x, VF)
                new.append([v.fma(xs, bv[j], accs[r][j]) for j in range(NV)])
            return new

        pfs = pf or []

        def kloop(k0, kend, accs, ptrs, nstep, a_ks, b_ks, bmasks, tag, aoffs, amasks):
            """k from k0 to kend, nstep per iteration; returns the final k,
            accumulators and A / B (and prefetch) pointers."""
            def body(k, cur, ptrs):
                for u in range(nstep):
                    cur = step(cur, ptrs[0], ptrs[1], u, a_ks, b_ks, bmasks, aoffs, amasks)
                    for q, (_, ks) in zip(ptrs[2:], pfs):
                        v.prefetch_r(v.gep(q, u * ks), locality=2)
                ks = [nstep * a_ks, nstep * b_ks] + [nstep * s[1] for s in pfs]
                return cur, [v.gep(q, n) for q, n in zip(ptrs, ks)]

            return v.grid_loop(k0, kend, nstep, accs, ptrs, body, tag, iv_name="k")

        def segment(accs, a_base, a_ks, b_base, b_ks, kc, bmasks, aoffs=None, amasks=None):
            ptrs = [a_base, b_base] + [q for q, _ in pfs]
            ka = (a_ks, b_ks, bmasks)
            if U > 1:
                kmain = b.sub(kc, b.srem(kc, i64(U)))
                k, accs, ptrs = kloop(i64(0), kmain, accs, ptrs, U, *ka, "ku", aoffs, amasks)
                _, accs, _ = kloop(k, kc, accs, ptrs, 1, *ka, "kr", aoffs, amasks)
            else:
                _, accs, _ = kloop(i64(0), kc, accs, ptrs, 1, *ka, "k", aoffs, amasks)
            return accs

        for a_base, a_ks, b_base, b_ks, kc, bmasks, *arows in segs:
            if bmasks and not wide_registers() and \
                    not all(isinstance(m, ir.Constant) for m in bmasks):
                accs = self.versioned_segment(segment, accs, a_base, a_ks, b_base, b_ks, kc,
                                              bmasks)
            else:   # (A's rows at offsets and masks of their own: swap_taps, no bmasks)
                accs = segment(accs, a_base, a_ks, b_base, b_ks, kc, bmasks, *arows)

        accs = v.add_partials(accs, first, io.partial, io.masks)
        v.finish_block(last, lambda: io.store_final(accs), lambda: io.store_partial(accs), "st")


    def versioned_segment(self, segment, accs, a_base, a_ks, b_base, b_ks, kc, bmasks):
        """AVX2: the k loop of a segment twice, with plain loads (ANDed with the masks)
        when all its addresses lie inside X's block, or when no extent is known, when every
        mask is all true; with masked loads otherwise. The masks do not change along k,
        so the test is made once; a
        vmaskmovps load halves the FMA rate of the loop on Zen 1 (two 128-bit halves)."""
        b = self.v.b
        extent = getattr(self, "x_extent", None)
        if extent is not None:
            # every address the segment's plain loads touch lies inside X's block (of
            # this image and group): read them all and clear the masked-off lanes (the
            # zeros a masked load gives), one vandps that no FMA pipe waits for
            x0, size = extent
            lo = b.ptrtoint(b_base, I64)
            first = b.ptrtoint(x0, I64)
            span = b.mul(b.add(b.mul(b.sub(kc, i64(1)), i64(b_ks)), i64(16 * self.p.NV)), i64(4))
            fast = b.and_(b.icmp_signed(">=", lo, first),
                          b.icmp_signed("<=", b.add(lo, span), b.add(first, i64(4 * size))))
            fast_masks = _AndMasks([b.sext(m, VI32) for m in bmasks])
        else:   # no extent known: plain loads only when every lane is wanted
            fast = None
            for m in bmasks:
                bits = b.bitcast(m, ir.IntType(16))
                t = b.icmp_unsigned("==", bits, ir.Constant(ir.IntType(16), 0xFFFF))
                fast = t if fast is None else b.and_(fast, t)
            fast_masks = None
        with b.if_else(fast, likely=True) as (then, otherwise):
            with then:
                acc_t = segment(accs, a_base, a_ks, b_base, b_ks, kc, fast_masks)
                blk_t = b.block
            with otherwise:
                acc_m = segment(accs, a_base, a_ks, b_base, b_ks, kc, bmasks)
                blk_m = b.block
        merged = []
        for row_t, row_m in zip(acc_t, acc_m):
            out = []
            for x_t, x_m in zip(row_t, row_m):
                ph = b.phi(VF)
                ph.add_incoming(x_t, blk_t)
                ph.add_incoming(x_m, blk_m)
                out.append(ph)
            merged.append(out)
        return merged


def channel_lanes(v: VB, c: ir.Value, c_hi: ir.Value) -> list:
    """Which of the 16 channels c .. c+15 lie below c_hi: True for the first, i1 values
    for the others."""
    n = v.smin(v.b.sub(c_hi, c), 16)
    return [True] + [v.b.icmp_signed("<", i64(i), n) for i in range(1, 16)]


def channel_biases(v: VB, bias: ir.Value | None, c: ir.Value, chok: list) -> list:
    """The biases of channels c .. c+15 splat to vectors (a channel past the end reads
    channel c's: its lanes are never stored); [] without a bias."""
    if bias is None:
        return []
    b = v.b
    out = []
    for i in range(16):
        ci = b.select(chok[i], b.add(c, i64(i)), c) if i else c
        out.append(v.splat(b.load(v.gep(bias, ci), typ=F32, align=4), VF))
    return out


def store_channel_columns(v: VB, Y: ir.Value, cols: list, biases: list, off0: ir.Value,
                          plane: int, pxmask: ir.Value, chok: list,
                          epilogue: Epilogue | None) -> None:
    """Store 16 vectors of 16 pixels, column i to channel i's plane at flat index
    off0 + i*plane of Y: bias added, epilogue applied along pixels (stride 1), lanes
    masked to pxmask and to the channels chok says exist (the write-outs of the swapped
    orientation and of Winograd F(2,3), after their 16 x 16 transposes)."""
    b = v.b
    for i in range(16):
        val = b.fadd(cols[i], biases[i]) if biases else cols[i]
        mask = v.mask_and(pxmask, chok[i])
        off = b.add(off0, i64(i * plane)) if i else off0
        if epilogue is not None:
            val = epilogue(b, val, off, 1, mask)
        v.mstore(val, v.gep(Y, off), mask)


@dataclass
class _AndMasks:
    """Masks of a segment whose loads are all inside readable memory: each B vector is
    loaded whole and ANDed with ``bits`` (the mask sign-extended to <16 x i32>)."""
    bits: list


class _MicroIO:
    """Where a micro-tile's MR x 16*NV accumulators live between K blocks: rows
    ``self.partial`` (one pointer per accumulator row) under ``self.masks``."""

    def store_partial(self, accs):
        for r in range(self.p.MR):
            for j in range(self.p.NV):
                self.v.mstore(accs[r][j], self.v.gep(self.partial[r], 16 * j), self.masks[r][j])


class _NormalIO(_MicroIO):
    """Micro-tile of MR output channels (rows) x 16*NV pixels, stored to Y in place."""

    def __init__(self, gen, c_ptr, mr, colmask, ch, ldc=None, raw=False, full=None):
        self.gen, self.v, self.p = gen, gen.v, gen.p
        self.full = full
        v, b = self.v, gen.v.b
        self.ch = ch
        self.mr = mr
        self.raw = raw      # final values without bias/epilogue (an intermediate result)
        ldc = gen.g.OHW if ldc is None else ldc
        rowok = [True] + [b.icmp_signed("<", i64(r), mr) for r in range(1, self.p.MR)]
        self.rowok = rowok
        self.masks = [[v.mask_and(colmask[j], rowok[r]) for j in range(self.p.NV)]
                      for r in range(self.p.MR)]
        self.rows = [c_ptr] + [v.gep(c_ptr, r * ldc) for r in range(1, self.p.MR)]
        self.partial = self.rows  # partial sums in Y itself

    def prefetch(self):
        for r in range(self.p.MR):
            for j in range(self.p.NV):
                self.v.prefetch_w(self.v.gep(self.rows[r], 16 * j))

    def store_final(self, accs):
        v = self.v
        if self.raw:
            return self.store_partial(accs)
        if not wide_registers() and self.full is not None:
            # AVX2: a tile of every row and column stores (and its epilogue reads) with
            # constant all-true masks -- plain stores and loads in one block, where
            # masked_store tests each vector's mask at run time and branches. Zen 3, one
            # core, kernels alternating in one process: EfficientNet-B0 x0.980 / x0.987,
            # MobileNetV2 x0.977, ResNet-18 x0.995, ResNet-50 x0.996
            b = v.b
            whole = self.full
            if not isinstance(self.mr, int):
                whole = b.and_(whole, b.icmp_signed("==", self.mr, i64(self.p.MR)))
            ones = [v.ones_m] * self.p.NV
            with b.if_else(whole, likely=True) as (fast, slow):
                with fast:
                    for r in range(self.p.MR):
                        self.store_row(accs, r, ones)
                with slow:
                    self.store_masked(accs)
            return
        self.store_masked(accs)

    def store_masked(self, accs):
        """store_final's stores under the tile's row and column masks."""
        v, gen = self.v, self.gen
        if wide_registers() or gen.epilogue is None or isinstance(self.mr, int):
            for r in range(self.p.MR):
                self.store_row(accs, r)
            return
        # AVX2: a tile of fewer rows than MR (the last of its channels) skips the rows
        # past them, their epilogue's masked loads (vmaskmovps with all-false masks, at
        # addresses past the tensor it reads) and their store; whole tiles take the
        # code without branches. Zen 4 under CANNC_ISA=avx2: MobileNetV3's 16 -> 16 1x1
        # conv + Add at 112x112 (tiles of 6 channels: 6 + 6 + 4) alone 418 -> 87 us
        b = v.b
        with b.if_else(b.icmp_signed("==", self.mr, i64(self.p.MR)), likely=True) as (
                whole, part):
            with whole:
                for r in range(self.p.MR):
                    self.store_row(accs, r)
            with part:
                self.store_row(accs, 0)
                for r in range(1, self.p.MR):
                    with v.if_then(self.rowok[r]):
                        self.store_row(accs, r)

    def store_row(self, accs, r, masks=None):
        v, b, gen = self.v, self.v.b, self.gen
        masks = self.masks[r] if masks is None else masks
        if gen.Bias is not None:
            m = b.add(self.ch, i64(r)) if r else self.ch
            mm = b.select(b.icmp_signed("<", i64(r), self.mr), m, self.ch) if r else m
            bias = v.splat(b.load(v.gep(gen.Bias, mm), typ=F32, align=4), VF)
        for j in range(self.p.NV):
            val = accs[r][j]
            if gen.Bias is not None:
                val = b.fadd(val, bias)
            ptr = v.gep(self.rows[r], 16 * j)
            if gen.epilogue is not None and not gen.late:
                val = gen.epilogue(b, val, v.flat_index(ptr, gen.Y), 1, masks[j])
            v.mstore(val, ptr, masks[j])


class _SwapIO(_MicroIO):
    """Micro-tile of MR output pixels (rows) x 16*NV channels: its sums live in the
    workspace ([P][CH], pixel-major) between reduction blocks and after the last one,
    from where _ConvGen.swap_out writes the tile to Y."""

    def __init__(self, gen, jr, m_lo, ir_, npx, chmask):
        self.gen, self.v, self.p = gen, gen.v, gen.p
        v, b, p = self.v, gen.v.b, gen.p
        pxok = [True] + [b.icmp_signed("<", i64(r), npx) for r in range(1, p.MR)]
        self.masks = [[v.mask_and(chmask[j], pxok[r]) for j in range(p.NV)] for r in range(p.MR)]
        # sums: acc[(ir + r) * CH + (jr - m_lo) + 16j]
        base = b.add(b.mul(ir_, i64(p.CH)), b.sub(jr, m_lo))
        self.partial = [v.gep(gen.acc, b.add(base, i64(r * p.CH))) for r in range(p.MR)]

    def prefetch(self):
        pass

    def store_final(self, accs):
        self.store_partial(accs)


# ---------------------------------------------------------------------------
# ConvTranspose: GEMM into the workspace + col2im (constant weights)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ConvTGeom(_GroupedGeom):
    """A ConvTranspose normalised to 3 spatial dims: y[o] += x[i] w[k] for
    o = i*s - pb + k*d. Weights [C, Mg, KD, KH, KW]."""

    N: int
    C: int
    M: int
    G: int
    isz: tuple
    osz: tuple
    k: tuple
    s: tuple
    d: tuple
    pb: tuple
    bias: bool = False

    @property
    def HW(self) -> int:
        """Input pixels per channel (DHW)."""
        return self.DHW

    @property
    def flops(self) -> int:
        return 2 * self.N * self.C * self.HW * self.Mg * self.KK


@dataclass(frozen=True)
class ConvTPlan:
    MR: int
    NV: int
    CHB: int        # output channels per tile
    MB: int         # channel blocks per group
    rows: int       # GEMM rows per tile, CHB*KK rounded up to MR
    CB: int         # input channels per reduction block
    nkb: int
    unroll: int
    ws_bytes: int
    num_tiles: int

    @property
    def NR(self) -> int:
        return 16 * self.NV

    @property
    def swap(self) -> bool:
        return False

    @property
    def direct(self) -> bool:
        return True


CT_Z_BYTES = 512 * 1024     # target size of a tile's GEMM result (stays in L2)


def plan_convtranspose(geom: ConvTGeom, cores: int = 2) -> ConvTPlan:
    KK, HW, Mg = geom.KK, geom.HW, geom.Mg
    MR = min(8, Mg * KK)
    zrow = rup(HW, 16) * 4
    best = None
    for MB, chb in distinct_splits(Mg):
        rows = rup(chb * KK, MR)
        if rows * zrow > CT_Z_BYTES and chb > 1:
            continue
        T = geom.N * geom.G * MB
        per = [0.0] * MB
        for mb in range(MB):
            ch = min(Mg, (mb + 1) * chb) - mb * chb
            per[mb] = (2.0 * rup(ch * KK, MR) * geom.Cg * rup(HW, 32)
                       + 4.0 * ch * geom.OHW * KK + 5000)
        worst = dispatch_time(
            T, cores, lambda t0, t1, per=per, MB=MB: sum(per[t % MB] for t in range(t0, t1)))
        if best is None or worst < best[0] * 0.995:
            best = (worst, MB, chb, rows, T)
    _, MB, CHB, rows, T = best
    nkb = cdiv(geom.Cg, KC_MAX_DIRECT)
    CB = cdiv(geom.Cg, nkb)
    nkb = cdiv(geom.Cg, CB)
    return ConvTPlan(MR=MR, NV=2, CHB=CHB, MB=MB, rows=rows, CB=CB, nkb=nkb, unroll=2,
                     ws_bytes=rup(rows * zrow, 64), num_tiles=T)


def pack_convtranspose_weights(geom: ConvTGeom, plan: ConvTPlan, w: np.ndarray) -> np.ndarray:
    """[G][MB][rows/MR][Cg][MR]: GEMM rows (m_local*KK + tap) of each channel block."""
    G, Cg, Mg, KK, MR = geom.G, geom.Cg, geom.Mg, geom.KK, plan.MR
    w = np.asarray(w, dtype=np.float32).reshape(G, Cg, Mg, KK)
    a = w.transpose(0, 2, 3, 1)                      # [G, Mg, KK, Cg]
    out = np.zeros((G, plan.MB, plan.rows, Cg), dtype=np.float32)
    for mb in range(plan.MB):
        m0, m1 = mb * plan.CHB, min(Mg, (mb + 1) * plan.CHB)
        out[:, mb, :(m1 - m0) * KK] = a[:, m0:m1].reshape(G, (m1 - m0) * KK, Cg)
    out = out.reshape(G, plan.MB, plan.rows // MR, MR, Cg).transpose(0, 1, 2, 4, 3)
    return np.ascontiguousarray(out).reshape(-1)


class _ConvTGen(_ConvGen):
    def __init__(self, module, fn, geom: ConvTGeom, plan: ConvTPlan, slots: Slots,
                 epilogue: Epilogue | None):
        # weights packed at compile time (pack_convtranspose_weights)
        super().__init__(module, fn, geom, plan, slots, a_prepacked=True,
                         transposed_layout=False, epilogue=epilogue)

    def emit(self):
        v, g, p = self.v, self.g, self.p
        b = v.b
        args, tb, te, ws = v.fn.args
        self.load_args(args)
        self.Z = ws
        with v.loop(tb, te, 1, "tile") as t:
            r, mb = v.divmod_c(t, p.MB)
            n, gi = v.divmod_c(r, g.G)
            m_lo = b.mul(mb, i64(p.CHB))
            nch = b.sub(v.smin(b.add(m_lo, i64(p.CHB)), g.Mg), m_lo)
            x_ng = v.gep(self.X, b.mul(b.add(b.mul(n, i64(g.C)), b.mul(gi, i64(g.Cg))), i64(g.HW)))
            ch0 = b.add(b.mul(gi, i64(g.Mg)), m_lo)
            y_t = v.gep(self.Y, b.mul(b.add(b.mul(n, i64(g.M)), ch0), i64(g.OHW)))
            w_t = v.gep(self.W, b.mul(b.add(b.mul(gi, i64(p.MB)), mb), i64(p.rows * g.Cg)))
            self.gemm(x_ng, w_t, b.mul(nch, i64(g.KK)))
            self.col2im(y_t, ch0, nch)
        b.ret_void()

    def gemm(self, x_ng, w_t, nrows):
        """Z[row][HW] = A[row][Cg] x X[Cg][HW] for the tile's rows (m_local*KK + tap)."""
        v, g, p = self.v, self.g, self.p
        b = v.b

        def body(kb, first, last):
            c0 = b.mul(kb, i64(p.CB)) if p.nkb > 1 else i64(0)
            cb = v.smin(b.sub(i64(g.Cg), c0), p.CB) if p.nkb > 1 else i64(g.Cg)
            x_blk = v.gep(x_ng, b.mul(c0, i64(g.HW)))
            with v.loop(i64(0), i64(g.HW), p.NR, "jr") as jr:
                nr = v.smin(b.sub(i64(g.HW), jr), p.NR)
                colmask = [v.lanes_lt(16 * j, nr) for j in range(p.NV)]
                b_jr = v.gep(x_blk, jr)
                with v.loop(i64(0), nrows, p.MR, "ir") as ir_:
                    mr = v.smin(b.sub(nrows, ir_), p.MR)
                    a = v.gep(w_t, b.add(b.mul(b.udiv(ir_, i64(p.MR)), i64(g.Cg * p.MR)),
                                         b.mul(c0, i64(p.MR))))
                    segs = [(a, p.MR, b_jr, g.HW, cb, colmask)]
                    c_ptr = v.gep(self.Z, b.add(b.mul(ir_, i64(g.HW)), jr))
                    io = _NormalIO(self, c_ptr, mr, colmask, ir_, ldc=g.HW, raw=True)
                    self.micro(segs, io, first, last)

        if p.nkb == 1:
            body(None, True, True)
        else:
            with v.loop(0, p.nkb, 1, "kb") as kb:
                body(kb, b.icmp_signed("==", kb, i64(0)), b.icmp_signed("==", kb, i64(p.nkb - 1)))

    def col2im(self, y_t, ch0, nch):
        """Y[m][o] = bias[m] + sum over taps of Z[(m*KK + tap)][i], o = i*s - pb + k*d."""
        v, g = self.v, self.g
        b = v.b
        D, H, W = g.isz
        OD, OH, OW = g.osz
        KD, KH, KW = g.k
        sd, sh, sw = g.s
        dd, dh, dw = g.d
        pd, ph, pw = g.pb
        with v.loop(i64(0), nch, 1, "m") as m:
            z_m = v.gep(self.Z, b.mul(m, i64(g.KK * g.HW)))
            y_m = v.gep(y_t, b.mul(m, i64(g.OHW)))
            if self.Bias is not None:
                init = v.splat(b.load(v.gep(self.Bias, b.add(ch0, m)), typ=F32, align=4), VF)
            else:
                init = v.zero_v
            with v.loop(0, OD * OH, 1, "orow") as orow:
                od, oh = v.divmod_c(orow, OH)
                rows = []
                for kd in range(KD):
                    for kh in range(KH):
                        idv = b.add(od, i64(pd - kd * dd))
                        ihv = b.add(oh, i64(ph - kh * dh))
                        ok = b.and_(b.icmp_unsigned("<", idv, i64((D - 1) * sd + 1)),
                                    b.icmp_unsigned("<", ihv, i64((H - 1) * sh + 1)))
                        if sd > 1:
                            ok = b.and_(ok, b.icmp_unsigned("==", b.urem(idv, i64(sd)), i64(0)))
                        if sh > 1:
                            ok = b.and_(ok, b.icmp_unsigned("==", b.urem(ihv, i64(sh)), i64(0)))
                        id_ = b.udiv(idv, i64(sd)) if sd > 1 else idv
                        ih = b.udiv(ihv, i64(sh)) if sh > 1 else ihv
                        rowidx = b.select(ok, b.add(b.mul(id_, i64(H)), ih), i64(0))
                        rows.append((kd, kh, ok, rowidx))
                y_row = v.gep(y_m, b.mul(orow, i64(OW)))
                with v.loop(0, OW, 16, "ow") as ow:
                    acc = init
                    for kw in range(KW):
                        off = pw - kw * dw
                        base = b.add(ow, i64(off))           # virtual input column of lane 0
                        if sw in (2, 4, 8, 16):
                            # ow is a multiple of 16, so the lanes that hit an input column
                            # (base + i divisible by sw) are known here: load the run of
                            # inputs they read and spread it with a constant permutation
                            r0 = off % sw
                            i0 = (sw - r0) % sw
                            idx = [(i - i0) // sw if i >= i0 and (i - i0) % sw == 0 else 0
                                   for i in range(16)]
                            par = ir.Constant(VM, [1 if i >= i0 and (i - i0) % sw == 0 else 0
                                                   for i in range(16)])
                            e0 = b.sdiv(b.add(base, i64(i0)), i64(sw))
                            nload = cdiv(16 - i0, sw)
                            lm = b.and_(b.icmp_unsigned("<", b.add(v.splat_i(e0), v.iota),
                                                        v.splat_i(W)),
                                        ir.Constant(VM, [1 if i < nload else 0 for i in range(16)]))
                            el = b.add(v.splat_i(e0), ir.Constant(VI, idx))
                            cm = b.and_(par, b.icmp_unsigned("<", el, v.splat_i(W)))
                            spread = ir.Constant(VI, idx)
                        else:
                            lanes = b.add(v.splat_i(base), v.iota)
                            cm = b.icmp_unsigned("<", lanes, v.splat_i((W - 1) * sw + 1))
                            if sw > 1:
                                cm = b.and_(cm, b.icmp_unsigned("==", b.urem(lanes, v.splat_i(sw)),
                                                                v.splat_i(0)))
                                gidx = b.udiv(lanes, v.splat_i(sw))
                        for kd, kh, ok, rowidx in rows:
                            tap = (kd * KH + kh) * KW + kw
                            src = v.gep(z_m, b.add(i64(tap * g.HW), b.mul(rowidx, i64(W))))
                            mk = v.mask_and(cm, ok)
                            if sw == 1:
                                x = v.mload(v.gep(src, base), mk)
                            elif sw in (2, 4, 8, 16):
                                z = v.mload(v.gep(src, e0), v.mask_and(lm, ok))
                                x = b.select(mk, b.shuffle_vector(z, ir.Constant(VF, ir.Undefined),
                                                                  spread), v.zero_v)
                            else:
                                x = v.gather_idx(src, gidx, mk)
                            acc = b.fadd(acc, x)
                    ptr = v.gep(y_row, ow)
                    om = v.lanes_lt(ow, OW)
                    if self.epilogue is not None:
                        acc = self.epilogue(b, acc, v.flat_index(ptr, self.Y), 1, om)
                    v.mstore(acc, ptr, om)


def emit_convtranspose(module: ir.Module, name: str, geom: ConvTGeom, plan: ConvTPlan,
                       slots: Slots = Slots(), epilogue: Epilogue | None = None) -> ir.Function:
    """ConvTranspose with packed constant weights (``pack_convtranspose_weights``):
    per tile (image, group, block of output channels) a GEMM Z = W^T X into the
    workspace, then Y = bias + col2im(Z) with masked loads/gathers."""
    fn = abi_function(module, name)
    _ConvTGen(module, fn, geom, plan, slots, epilogue).emit()
    return fn


def emit_conv(module: ir.Module, name: str, geom: ConvGeom, plan: ConvPlan,
              slots: Slots = Slots(), a_prepacked: bool = True,
              transposed_layout: bool = False,
              epilogue: Epilogue | None = None) -> ir.Function:
    """Emit the implicit-GEMM convolution as an ABI kernel named ``name``.

    ``a_prepacked``: the weight argument holds ``pack_weights(geom, plan, W)``;
    otherwise it holds the raw weight tensor (Conv layout, or ConvTranspose
    layout when ``transposed_layout``) and each tile packs what it needs.
    Tiles: ``plan.num_tiles``; workspace: ``plan.ws_bytes`` per core.
    """
    fn = abi_function(module, name)
    gen = _ConvGen(module, fn, geom, plan, slots, a_prepacked, transposed_layout, epilogue)
    gen.late = late_epilogue(plan, epilogue)
    gen.emit()
    mark_vector_code(module)
    return fn


LATE_EPILOGUES = True      # costly epilogues applied in a pass of their own (costly_epilogue)
# ... those of at least this many flops an element (a fused Sigmoid is 12, Relu 1)
LATE_EPILOGUE_FLOPS = 8


def costly_epilogue(epilogue: Epilogue | None) -> bool:
    """Whether, on an AVX2 target, a conv or depthwise kernel stores its sums first and
    applies ``epilogue`` in a pass of its own over each tile it wrote (still in L1 or L2),
    rather than to each vector of sums as it stores it: an epilogue of many operations
    (``epilogue.cost``, flops an element, which the fused lowering sets: a SiLU's
    sigmoid). Applied to the accumulators, its constants and temporaries compete for AVX2's
    16 ymm registers with the accumulators and the weights. Zen 4 under CANNC_ISA=avx2,
    EfficientNet-B0 at 1 core: with the SiLU applied to the sums, its Conv+SiLU kernels
    took longer than the conv and a SiLU kernel apart (depthwise 2.98 against 2.25 ms,
    1x1 expansions 1.74 against 1.51); with the late passes (late_epilogue,
    pool.late_epilogue) the model 12.19-12.21 -> 11.38-11.62 ms, at 2 cores 6.44-6.56 ->
    6.08-6.26 (alternating processes). With AVX-512's 32 registers the fused epilogue
    measured level with a pass of its own (depthwise 1.62-1.66 against 1.64-1.68 ms):
    not taken there."""
    return (LATE_EPILOGUES and epilogue is not None and not wide_registers()
            and getattr(epilogue, "cost", 0) >= LATE_EPILOGUE_FLOPS)


def epilogue_in_place(v: VB, Y: ir.Value, epilogue: Epilogue, lo: ir.Value,
                      hi: ir.Value) -> None:
    """``epilogue`` applied in place to the float32 elements lo .. hi-1 (flat offsets) of
    Y: whole vectors, then the last one under a mask (a late pass, costly_epilogue)."""
    b = v.b
    n = b.sub(hi, lo)
    whole = b.add(lo, b.sub(n, b.srem(n, i64(16))))

    def apply(off, m):
        ptr = v.gep(Y, off)
        val = epilogue(b, v.load_v(ptr, m), off, 1, v.ones_m if m is None else m)
        v.store_v(val if val.type == VF else b.fpext(val, VF), ptr, m)

    with v.loop(lo, whole, 16, "late") as off:
        apply(off, None)
    with v.if_then(b.icmp_signed("<", whole, hi)):
        apply(whole, v.lanes_lt(0, b.sub(hi, whole)))


def late_epilogue(plan: ConvPlan, epilogue: Epilogue | None) -> bool:
    """Whether an implicit-GEMM conv kernel with channels as rows applies its epilogue to
    each tile after the tile's last K block (_ConvGen.late_pass; costly_epilogue). Zen 4
    under CANNC_ISA=avx2, EfficientNet-B0 at 1 core: its 1x1 Conv+SiLU kernels of
    channels as rows, 1.69-1.70 -> 1.51 ms (panels by rows) and 2.04 -> 1.96 (panels).
    The swapped orientation applies it after its transposes, with no sums held in
    registers (a pass of its own measured 1-2% slower there)."""
    return not plan.swap and costly_epilogue(epilogue)


# ---------------------------------------------------------------------------
# reduced precision (bfloat16 / float16 operands, float32 accumulation)
# ---------------------------------------------------------------------------
#
# One implicit GEMM for every Conv with a narrow operand or a ``cannc_precision``:
# per tile (image, group, pixel block, channel block) the whole reduction is one block
# (the pixel block is sized so that its col buffer fits in L2), so the accumulators stay
# in registers and the bias / epilogue (float32) run once before the store, which
# converts to the output's dtype. The reduction runs tap-major over channel units:
# row ``u = tap*CU + cu`` of the col buffer holds, per output pixel, one 32-bit unit:
#
# * mode "dp" (bf16, where ``vdpbf16ps`` is the fastest multiply): the bf16 pair
#   (channel 2cu, 2cu+1) of the tap, multiplied with ``vdpbf16ps`` against the broadcast
#   weight pair;
# * mode "f32" (fp16, and bf16 elsewhere): one channel as float32 (the narrow values
#   widened exactly, once, into the col buffer), fp32 FMA.
#
# Which bf16 mode is faster is a property of the CPU (``lowp_mode``): on AMD Zen 4/5 one
# ``vdpbf16ps`` per cycle does twice the multiply-adds of the fp32 FMAs; on the Intel
# server cores with AMX (measured on a Sapphire-Rapids-class guest) it issues once per two
# cycles against two FMAs per cycle: half the fp32 rate, so there bf16 is widened.
#
# X (any of float32, bfloat16, float16) is converted while the col buffer is built
# (an fp32 X is rounded to the narrow type there); constant weights are rounded and
# packed at compile time (``pack_lowp_weights``), runtime weights per tile.

NARROW = {"bf16": "bfloat16", "fp16": "float16"}
LOWP_COL_BYTES = 512 * 1024     # col buffer of a pixel block (stays in L2 on Zen and Intel)
VI16 = ir.VectorType(ir.IntType(16), 16)
VH = ir.VectorType(ir.HalfType(), 16)
I16 = ir.IntType(16)


def elem_type(dt: str) -> ir.Type:
    return F32 if dt == "float32" else I16


def widen_v(b: ir.IRBuilder, raw: ir.Value, dt: str) -> ir.Value:
    """16 raw elements of dtype dt (float, or i16 bits) as <16 x float> (exact)."""
    if dt == "float32":
        return raw
    if dt == "bfloat16":
        return b.bitcast(b.shl(b.zext(raw, VI), ir.Constant(VI, [16] * 16)), VF)
    return b.fpext(b.bitcast(raw, VH), VF)


def widen_s(b: ir.IRBuilder, raw: ir.Value, dt: str) -> ir.Value:
    if dt == "float32":
        return raw
    if dt == "bfloat16":
        return b.bitcast(b.shl(b.zext(raw, I32), ir.Constant(I32, 16)), F32)
    return b.fpext(b.bitcast(raw, ir.HalfType()), F32)


def bf16_bits(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """<16 x float> -> <16 x i32> whose low 16 bits are the bfloat16 rounded to nearest
    even (NaN stays NaN), high bits zero."""
    def c(x):
        return ir.Constant(VI, [x] * 16)

    bits = b.bitcast(v, VI)
    hi = b.lshr(bits, c(16))
    r = b.lshr(b.add(b.add(bits, c(0x7FFF)), b.and_(hi, c(1))), c(16))
    return b.select(b.fcmp_unordered("uno", v, v), b.or_(hi, c(0x40)), r)


def narrow_v(b: ir.IRBuilder, v: ir.Value, dt: str) -> ir.Value:
    """<16 x float> -> 16 raw elements of dtype dt (rounded to nearest even)."""
    if dt == "float32":
        return v
    if dt == "bfloat16":
        return b.trunc(bf16_bits(b, v), VI16)
    return b.bitcast(b.fptrunc(v, VH), VI16)


def round_v(b: ir.IRBuilder, v: ir.Value, dt: str) -> ir.Value:
    """<16 x float> rounded to dtype dt, as float."""
    return widen_v(b, narrow_v(b, v, dt), dt) if dt != "float32" else v


def vload_dt(v: VB, ptr: ir.Value, dt: str, mask: ir.Value | None = None) -> ir.Value:
    """16 elements of dtype dt at ptr as <16 x float>; masked-off lanes are 0, unread."""
    if dt == "float32":
        return v.load_v(ptr, mask)
    if mask is None:
        raw = v.b.load(ptr, typ=VI16, align=2)
    else:
        raw = masked_load(v.b, ptr, mask, ir.Constant(VI16, None), 2)
    return widen_v(v.b, raw, dt)


def vstore_dt(v: VB, val: ir.Value, ptr: ir.Value, dt: str, mask: ir.Value) -> None:
    """Store <16 x float> to 16 elements of dtype dt (masked), converting."""
    if dt == "float32":
        return v.mstore(val, ptr, mask)
    masked_store(v.b, narrow_v(v.b, val, dt), ptr, mask, 2)


def vgather_dt(v: VB, base: ir.Value, idx: ir.Value, mask: ir.Value, dt: str) -> ir.Value:
    """Masked gather of base[idx[i]] (elements of dtype dt) as <16 x float>."""
    if dt == "float32":
        return v.gather_idx(base, idx, mask)
    ptrs = v.b.gep(base, [idx], source_etype=I16)
    ptrs.type = VPTR
    f = v.intr("llvm.masked.gather.v16i16.v16p0", VI16, [VPTR, I32, VM, VI16])
    raw = v.b.call(f, [ptrs, ir.Constant(I32, 2), mask, ir.Constant(VI16, None)])
    return widen_v(v.b, raw, dt)


def sload_dt(v: VB, ptr: ir.Value, dt: str) -> ir.Value:
    """One element of dtype dt at ptr, as float."""
    ty = elem_type(dt)
    return widen_s(v.b, v.b.load(ptr, typ=ty, align=4 if dt == "float32" else 2), dt)


@dataclass(frozen=True)
class LowpTypes:
    """The element types of a reduced-precision Conv: X, W, bias, Y (numpy dtype names)
    and the precision of the products ("bf16" | "fp16")."""
    x: str
    w: str
    b: str
    y: str
    prec: str

    @property
    def narrow(self) -> str:
        return NARROW[self.prec]


def lowp_types(node, ins, outs) -> LowpTypes | None:
    """The LowpTypes of a Conv node, or None for a float32 Conv (no narrow operand,
    no ``cannc_precision``)."""
    dts = [np.dtype(t.dtype).name for t in (ins[0], ins[1], outs[0])]
    bdt = np.dtype(ins[2].dtype).name if len(ins) > 2 and ins[2] is not None else "float32"
    prec = node.attrs.get("cannc_precision")
    if isinstance(prec, bytes):
        prec = prec.decode()
    if prec is None:
        narrow = [d for d in dts + [bdt] if d != "float32"]
        if not narrow:
            return None
        prec = "bf16" if narrow[0] == "bfloat16" else "fp16"
    if prec not in NARROW:
        raise ValueError(f"cannc_precision={prec!r} (bf16 or fp16)")
    return LowpTypes(x=dts[0], w=dts[1], b=bdt, y=dts[2], prec=prec)


@dataclass(frozen=True)
class LowpPlan:
    mode: str        # "dp" | "f32"
    MR: int
    NV: int
    CU: int          # reduction units per tap (channel pairs, or channels in mode f32)
    P: int           # pixels per pixel block
    PB: int
    CH: int          # output channels per channel block (multiple of MR unless == Mg)
    MB: int
    NCP: int         # col row stride (units)
    ws_a: int        # byte offset of the runtime weight panels in the workspace
    ws_bytes: int
    num_tiles: int

    @property
    def pairs(self) -> bool:
        return self.mode != "f32"

    @property
    def NR(self) -> int:
        return 16 * self.NV


def lowp_mode(prec: str, has_bf16_dot: bool, has_amx: bool) -> str:
    """The kernel mode of a reduced-precision conv on a CPU with / without avx512_bf16
    and AMX (see above: vdpbf16ps is a win on the CPUs that have it without AMX)."""
    if prec == "fp16":
        return "f32"
    return "dp" if has_bf16_dot and not has_amx else "f32"


def lowp_note(plan: LowpPlan, prec: str, has_bf16_dot: bool) -> str:
    if plan.mode == "dp":
        return "bf16 avx512_bf16 (vdpbf16ps)"
    if prec == "fp16":
        return "fp16 storage, fp32 FMA"
    why = ("vdpbf16ps slower than fp32 FMA here" if has_bf16_dot else "no avx512_bf16")
    return f"bf16 widened to fp32 ({why})"


def plan_lowp(geom: ConvGeom, mode: str, const_weights: bool = True,
              cores: int = 2) -> LowpPlan:
    Mg, OHW = geom.Mg, geom.OHW
    CU = cdiv(geom.Cg, 2) if mode != "f32" else geom.Cg
    KU = CU * geom.KK
    wide = wide_registers()
    MR = min(8 if wide else 6, Mg)
    NV = default_nv(OHW, wide)
    NR = 16 * NV
    P = max(NR, (LOWP_COL_BYTES // (4 * KU)) // NR * NR)
    P = min(P, rup(OHW, NR))
    # at least 2 tiles per core (the per-image grid; a batch multiplies it)
    want = 2 * cores
    if geom.N * geom.G * cdiv(OHW, P) < want:
        P = max(NR, min(P, rup(cdiv(OHW, cdiv(want, geom.N * geom.G)), NR)))
    PB = cdiv(OHW, P)
    MB = 1
    if geom.N * geom.G * PB < want and Mg >= 2 * MR:
        MB = min(cdiv(Mg, MR), cdiv(want, geom.N * geom.G * PB))
    CH = rup(cdiv(Mg, MB), MR)
    MB = cdiv(Mg, CH)
    NCP = rup(P, 16) + 16
    col = rup(KU * NCP * 4, 64)
    a_bytes = 0 if const_weights else rup(CH, MR) * KU * 4
    return LowpPlan(mode=mode, MR=MR, NV=NV, CU=CU, P=P, PB=PB, CH=CH, MB=MB, NCP=NCP,
                    ws_a=col, ws_bytes=rup(col + a_bytes, 64),
                    num_tiles=geom.N * geom.G * PB * MB)


def _round_np(a: np.ndarray, dt: str) -> np.ndarray:
    import ml_dtypes  # numpy side only: compile-time packing
    t = ml_dtypes.bfloat16 if dt == "bfloat16" else np.float16
    return np.asarray(a).astype(t)


def pack_lowp_weights(geom: ConvGeom, plan: LowpPlan, w: np.ndarray, narrow: str) -> np.ndarray:
    """Weights [M, Cg, k...] (any float dtype) as panels [G][ceil(Mg/MR)][KK*CU][MR] of
    32-bit units: bf16 pairs (channel 2cu low, 2cu+1 high) or float32 (mode f32), the
    values rounded to the narrow type; zero padded."""
    G, Mg, Cg, KK, MR, CU = geom.G, geom.Mg, geom.Cg, geom.KK, plan.MR, plan.CU
    a = _round_np(np.asarray(w).reshape(G, Mg, Cg, KK), narrow).astype(np.float32)
    Mp = cdiv(Mg, MR) * MR
    per = 2 if plan.pairs else 1
    full = np.zeros((G, Mp, CU * per, KK), dtype=np.float32)
    full[:, :Mg, :Cg] = a
    full = full.transpose(0, 1, 3, 2)                  # [G, Mp, KK, CU*per]
    if plan.pairs:
        bits = (_round_np(full, "bfloat16").view(np.uint16).astype(np.uint32)
                .reshape(G, Mp, KK, CU, 2))
        units = (bits[..., 0] | (bits[..., 1] << 16)).view(np.float32)
    else:
        units = full
    units = units.reshape(G, Mp // MR, MR, KK * CU).transpose(0, 1, 3, 2)
    return np.ascontiguousarray(units).reshape(-1)


class _LowpGen:
    def __init__(self, module, fn, geom: ConvGeom, plan: LowpPlan, types: LowpTypes,
                 slots: Slots, const_weights: bool, epilogue: Epilogue | None):
        self.v = VB(module, fn)
        self.g, self.p, self.t = geom, plan, types
        self.slots = slots
        self.const_w = const_weights
        self.epilogue = epilogue
        self.xt = elem_type(types.x)

    def emit(self):
        v, g, p = self.v, self.g, self.p
        b = v.b
        args, tb, te, ws = v.fn.args
        sl = self.slots
        self.X, self.W, self.Y = v.arg(args, sl.x), v.arg(args, sl.w), v.arg(args, sl.y)
        self.Bias = v.arg(args, sl.b) if g.bias else None
        self.col = ws
        self.wsa = b.gep(ws, [i64(p.ws_a)], source_etype=I8)
        with v.loop(tb, te, 1, "tile") as t:
            gi, p0, p1, m_lo, m_hi, x_ng, ch0, y_off = self.tile_origin(t, g.OHW)
            self.im2col(x_ng, p0, p1)
            if not self.const_w:
                self.pack_w(gi, m_lo, m_hi)
            self.gemm(gi, ch0, y_off, p0, b.sub(p1, p0), m_lo, m_hi)
        b.ret_void()

    def tile_origin(self, t, pixels):
        """Where tile t (image, group, pixel block, channel block; channel block
        fastest) starts: (group, pixels [p0, p1) of `pixels`, output channels
        [m_lo, m_hi) of the group, X of the image and group, the group's first output
        channel, the flat index of Y's first element of that channel)."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        r, mb = v.divmod_c(t, p.MB)
        r, pb = v.divmod_c(r, p.PB)
        n, gi = v.divmod_c(r, g.G)
        p0 = b.mul(pb, i64(p.P))
        p1 = v.smin(b.add(p0, i64(p.P)), pixels)
        m_lo = b.mul(mb, i64(p.CH))
        m_hi = v.smin(b.add(m_lo, i64(p.CH)), g.Mg)
        x_ng = v.gep(self.X, b.mul(b.add(b.mul(n, i64(g.C)), b.mul(gi, i64(g.Cg))),
                                   i64(g.DHW)), self.xt)
        ch0 = b.mul(gi, i64(g.Mg))
        y_off = b.mul(b.add(b.mul(n, i64(g.M)), ch0), i64(g.OHW))   # flat index of Y
        return gi, p0, p1, m_lo, m_hi, x_ng, ch0, y_off

    def row_span(self, row, kd, kh, p0, p1):
        """Output row `row` (of the pixels [p0, p1)) at tap (kd, kh): whether its input
        row is inside X, that row's index in the plane (0 outside), the row's first pixel
        and its columns [a, e) within [p0, p1)."""
        v, g = self.v, self.g
        b = v.b
        D, H, _ = g.isz
        _, OH, OW = g.osz
        sd, sh, _ = g.s
        dd, dh, _ = g.d
        pd, ph, _ = g.pb
        od, oh = v.divmod_c(row, OH)
        idv = b.add(b.mul(od, i64(sd)), b.sub(b.mul(kd, i64(dd)), i64(pd)))
        ihv = b.add(b.mul(oh, i64(sh)), b.sub(b.mul(kh, i64(dh)), i64(ph)))
        ok = b.and_(b.icmp_unsigned("<", idv, i64(D)), b.icmp_unsigned("<", ihv, i64(H)))
        rowidx = b.select(ok, b.add(b.mul(idv, i64(H)), ihv), i64(0))
        rs = b.mul(row, i64(OW))
        a = b.sub(v.smax(p0, rs), rs)
        e = b.sub(v.smin(p1, b.add(rs, i64(OW))), rs)
        return ok, rowidx, rs, a, e

    # -- col buffer: [tap*CU + cu][pixel] units ----------------------------------
    def im2col(self, x_ng, p0, p1):
        v, g, p = self.v, self.g, self.p
        b = v.b
        W = g.isz[2]
        OW = g.osz[2]
        KH, KW = g.k[1], g.k[2]
        sw, dw, pw = g.s[2], g.d[2], g.pb[2]
        row_first = b.udiv(p0, i64(OW))
        row_last = b.udiv(b.sub(p1, i64(1)), i64(OW))
        npair = g.Cg // 2 if p.pairs else g.Cg
        with v.loop(0, g.KK, 1, "tap") as tap:
            rem, kw = v.divmod_c(tap, KW)
            kd, kh = v.divmod_c(rem, KH)
            dst_tap = v.gep(self.col, b.mul(tap, i64(p.CU * p.NCP)))
            offw = b.sub(b.mul(kw, i64(dw)), i64(pw))
            with v.loop(row_first, b.add(row_last, i64(1)), 1, "row") as row:
                ok, rowidx, rs, a, e = self.row_span(row, kd, kh, p0, p1)
                src_row = v.gep(x_ng, b.mul(rowidx, i64(W)), self.xt)
                dst_row = v.gep(dst_tap, b.sub(b.add(rs, a), p0))
                with v.loop(a, e, 16, "ow") as ow:
                    load = self.loader(ow, offw, ok, W, sw)
                    dst0 = v.gep(dst_row, b.sub(ow, a))
                    step = 2 if p.pairs else 1
                    with v.loop(0, npair, 1, "cu") as cu:
                        src = v.gep(src_row, b.mul(cu, i64(step * g.DHW)), self.xt)
                        x0 = load(src)
                        x1 = load(v.gep(src, g.DHW, self.xt)) if p.pairs else None
                        v.store_v(self.unit(x0, x1), v.gep(dst0, b.mul(cu, i64(p.NCP))))
                    if p.pairs and g.Cg % 2:
                        src = v.gep(src_row, (g.Cg - 1) * g.DHW, self.xt)
                        v.store_v(self.unit(load(src), None), v.gep(dst0, npair * p.NCP))

    def unit(self, x0, x1):
        """The 32-bit units (as <16 x float>) of channel values x0 (and x1)."""
        b, p, nar = self.v.b, self.p, self.t.narrow
        if not p.pairs:
            return round_v(b, x0, nar) if self.t.x != nar else x0
        lo = bf16_bits(b, x0)
        if x1 is None:
            return b.bitcast(lo, VF)
        hi = b.shl(bf16_bits(b, x1), ir.Constant(VI, [16] * 16))
        return b.bitcast(b.or_(lo, hi), VF)

    def loader(self, ow, offw, ok, W, sw):
        v, xdt = self.v, self.t.x
        b = v.b
        base = b.add(b.mul(ow, i64(sw)), offw)
        if sw == 1:
            lanes = b.add(v.splat_i(base), v.iota)
            m = v.mask_and(b.icmp_unsigned("<", lanes, v.splat_i(W)), ok)
            return lambda src: vload_dt(v, v.gep(src, base, self.xt), xdt, m)
        if sw == 2:
            l0 = b.add(v.splat_i(base), v.iota)
            m0 = v.mask_and(b.icmp_unsigned("<", l0, v.splat_i(W)), ok)
            m1 = v.mask_and(b.icmp_unsigned("<", b.add(l0, v.splat_i(16)), v.splat_i(W)), ok)
            even = ir.Constant(VI, list(range(0, 32, 2)))

            def load2(src):
                s0 = v.gep(src, base, self.xt)
                return b.shuffle_vector(vload_dt(v, s0, xdt, m0),
                                        vload_dt(v, v.gep(s0, 16, self.xt), xdt, m1), even)
            return load2
        lanes = b.add(v.splat_i(base), b.mul(v.iota, v.splat_i(sw)))
        m = v.mask_and(b.icmp_unsigned("<", lanes, v.splat_i(W)), ok)
        return lambda src: vgather_dt(v, src, lanes, m, xdt)

    # -- runtime weights: panels [CH/MR][KK*CU][MR] into the workspace ------------------
    def pack_w(self, gi, m_lo, m_hi):
        v, g, p, wdt = self.v, self.g, self.p, self.t.w
        b = v.b
        wt = elem_type(wdt)
        per = 2 if p.pairs else 1
        zero = ir.Constant(F32, 0.0)
        with v.loop(m_lo, b.add(m_lo, i64(p.CH)), 1, "pm") as m:
            mrel = b.sub(m, m_lo)
            okm = b.icmp_signed("<", m, m_hi)
            msafe = b.select(okm, m, m_lo)
            dst_m = v.gep(self.wsa, b.add(b.mul(b.udiv(mrel, i64(p.MR)), i64(g.KK * p.CU * p.MR)),
                                          b.urem(mrel, i64(p.MR))))
            w_m = v.gep(self.W, b.mul(b.add(b.mul(gi, i64(g.Mg)), msafe), i64(g.K)), wt)
            with v.loop(0, g.KK * p.CU, 1, "pu") as u:
                tap, cu = v.divmod_c(u, p.CU)
                vals = []
                for h in range(per):
                    ci = b.add(b.mul(cu, i64(per)), i64(h)) if per > 1 else cu
                    okc = b.and_(okm, b.icmp_signed("<", ci, i64(g.Cg)))
                    idx = b.select(okc, b.add(b.mul(ci, i64(g.KK)), tap), i64(0))
                    x = sload_dt(v, v.gep(w_m, idx, wt), wdt)
                    vals.append(b.select(okc, x, zero))
                if p.pairs:
                    vec = [b.insert_element(ir.Constant(VF, None), x, ir.Constant(I32, 0))
                           for x in vals]
                    unit = b.extract_element(self.unit(vec[0], vec[1]), ir.Constant(I32, 0))
                else:
                    x = vals[0]
                    if wdt != self.t.narrow:
                        vx = b.insert_element(ir.Constant(VF, None), x, ir.Constant(I32, 0))
                        x = b.extract_element(round_v(b, vx, self.t.narrow), ir.Constant(I32, 0))
                    unit = x
                b.store(unit, v.gep(dst_m, b.mul(u, i64(p.MR))), align=4)

    # -- the GEMM over the col buffer ----------------------------------------------------
    def gemm(self, gi, ch0, y_off, p0, npix, m_lo, m_hi):
        v, g, p = self.v, self.g, self.p
        b = v.b
        KU = g.KK * p.CU
        with v.loop(i64(0), npix, p.NR, "jr") as jr:
            nr = v.smin(b.sub(npix, jr), p.NR)
            colmask = [v.lanes_lt(16 * j, nr) for j in range(p.NV)]
            b_jr = v.gep(self.col, jr)
            with v.loop(m_lo, m_hi, p.MR, "ir") as ir_:
                mr = v.smin(b.sub(m_hi, ir_), p.MR)
                if self.const_w:
                    panel = b.add(b.mul(gi, i64(cdiv(g.Mg, p.MR))), b.udiv(ir_, i64(p.MR)))
                    a_base = v.gep(self.W, b.mul(panel, i64(KU * p.MR)))
                else:
                    a_base = v.gep(self.wsa, b.mul(b.udiv(b.sub(ir_, m_lo), i64(p.MR)),
                                                   i64(KU * p.MR)))
                accs = self.micro(a_base, b_jr, KU)
                self.store(accs, b.add(y_off, b.add(b.mul(ir_, i64(g.OHW)), b.add(p0, jr))),
                           b.add(ch0, ir_), mr, colmask)

    def madd(self, acc, a_unit, bv):
        v, b, mode = self.v, self.v.b, self.p.mode
        if mode == "dp":
            vb = ir.VectorType(BF16, 32)
            f = v.intr("llvm.x86.avx512bf16.dpbf16ps.512", VF, [VF, vb, vb])
            return b.call(f, [acc, b.bitcast(v.splat(a_unit, VF), vb), b.bitcast(bv, vb)])
        return v.fma(v.splat(a_unit, VF), bv, acc)

    def micro(self, a_base, b_base, KU):
        v, p = self.v, self.p
        b = v.b
        MR, NV = p.MR, p.NV
        U = 2 if MR * NV > 8 else 4

        def body(k, cur, ptrs):
            a_ptr, b_ptr = ptrs
            for u in range(step):
                bv = [v.load_v(v.gep(b_ptr, u * p.NCP + 16 * j)) for j in range(NV)]
                new = []
                for r in range(MR):
                    au = b.load(v.gep(a_ptr, u * MR + r), typ=F32, align=4)
                    new.append([self.madd(cur[r][j], au, bv[j]) for j in range(NV)])
                cur = new
            return cur, [v.gep(a_ptr, step * MR), v.gep(b_ptr, step * p.NCP)]

        accs = [[v.zero_v] * NV for _ in range(MR)]
        ptrs = [a_base, b_base]
        kmain = (KU // U) * U
        k = i64(0)
        if kmain:
            step = U
            k, accs, ptrs = v.grid_loop(i64(0), i64(kmain), U, accs, ptrs, body, "lku",
                                        iv_name="k")
        if KU > kmain:
            step = 1
            _, accs, _ = v.grid_loop(k, i64(KU), 1, accs, ptrs, body, "lkr", iv_name="k")
        return accs

    def store(self, accs, y_idx, ch, mr, colmask):
        v, g, p, t = self.v, self.g, self.p, self.t
        b = v.b
        yt = elem_type(t.y)
        for r in range(p.MR):
            rowok = b.icmp_signed("<", i64(r), mr) if r else None
            chr_ = b.select(rowok, b.add(ch, i64(r)), ch) if r else ch
            if self.Bias is not None:
                bias = v.splat(sload_dt(v, v.gep(self.Bias, chr_, elem_type(t.b)), t.b), VF)
            for j in range(p.NV):
                m = v.mask_and(colmask[j], rowok)
                val = accs[r][j]
                if self.Bias is not None:
                    val = b.fadd(val, bias)
                idx = b.add(y_idx, i64(r * g.OHW + 16 * j))
                if self.epilogue is not None:
                    val = self.epilogue(b, val, idx, 1, m)
                    if val.type != VF:
                        val = b.fpext(val, VF)
                vstore_dt(v, val, v.gep(self.Y, idx, yt), t.y, m)


def emit_conv_lowp(module: ir.Module, name: str, geom: ConvGeom, plan: LowpPlan,
                   types: LowpTypes, slots: Slots = Slots(), const_weights: bool = True,
                   epilogue: Epilogue | None = None) -> ir.Function:
    """The reduced-precision implicit GEMM (see above) as an ABI kernel ``name``; with
    ``const_weights`` the weight argument holds ``pack_lowp_weights(geom, plan, W, ...)``,
    otherwise the raw weights (dtype ``types.w``), packed per tile."""
    fn = abi_function(module, name)
    _LowpGen(module, fn, geom, plan, types, slots, const_weights, epilogue).emit()
    return fn
