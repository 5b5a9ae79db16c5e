"""bf16 convolution on Intel AMX tiles (``tdpbf16ps``): an implicit GEMM.

Activations are NCHW (normalised to 3 spatial dims, `conv.ConvGeom`), so per image
and group the convolution is

    Y[Mg, pixels] = W[Mg, K] @ col[K, pixels]

with the OUTPUT CHANNELS as the rows of the tile GEMM and the pixels as its columns:

* A = the weights, a constant prepacked at compile time (`pack_amx_conv_weights`) in
  the A-tile layout ``[G][Mp/32][kb][2][16][16]`` of 32-bit units (each a bf16 pair):
  per 32-channel panel and K step of 32 bf16 two 1 KiB tiles (16 channels x 64 bytes)
  side by side; Mp = Mg rounded up to 32 (zero rows), K zero padded.
* B: 32-bit units ``[K pair][pixel]`` in the workspace -- exactly the VNNI layout
  ``tdpbf16ps`` reads for B (a row of a B tile = one K pair, 16 pixels x 4 bytes), so B
  tiles are loaded in place with the buffer's row stride: no second packing pass. One
  of three modes builds it per tile (an fp32 X rounded to bf16, nearest even, on the
  way; a bf16 X copied):

  - direct (stride 1 or 2, no depth axis: 3x3 and 1x1 convs): a zero-padded copy of
    X's rows that the pixel block reads, as planes of channel pairs ``[CU][rows*Wp]``
    (CU rounded up to 16); the output pixels are counted over the padded row width
    Wp, so tap (kh, kw) is the constant offset ``kh*dh*Wp + kw*dw`` into every plane
    and each K step (16 channel pairs of one tap) is a B tile at that offset. The
    Wp - OW extra columns per row are computed and discarded. ~9x less copying than
    an im2col of a 3x3. Stride 2 (along H and/or W, dilation 1): the copy is split
    into phases (padded rows r*2 + a, columns w*2 + c); tap (kh, kw) reads phase
    (kh % 2, kw % 2) at offset ((kh // 2)*Wp + kw // 2), a stride-1 access.
  - im2col: the col buffer ``[tap*CU + cu][pixel]`` of the reduced-precision vector
    kernel's mode "dp" (channels 2cu low, 2cu+1 high), channel pairs outermost.
  - kw-pairs (stride 2 along W, where it pads K no more: the 7x7 stem on 3 channels,
    K 192 instead of 224): units pair the taps kw, kw+1 of one channel, which for 16
    output pixels are 32 consecutive X elements converted in order.

  The K padding rows (to a multiple of 16 units) are zeroed per tile (stale
  workspace bits may be NaN); so is an element past an odd last tap pair.
* C: a 32-channel x 32-pixel block is a 2 x 2 grid of 16 x 16 fp32 tiles (4 tile
  registers) fed by 2 A and 2 B tiles per K step (all 8 registers), over the whole K.
  Per 32-channel panel the micro-kernel (a ``noinline`` function: one tile shape,
  16 x 64 bytes, for every register) runs over all the 32-pixel columns of the pixel
  block, the weight panel staying in L1/L2 and the col buffer in L2, and stores the
  tiles to a 32 x P fp32 scratch; then vector code adds the bias, applies the fused
  epilogue (FusedConv: Relu, residual add, ...) in fp32 and stores each channel row
  of Y (contiguous pixels, masked at the end) as Y's dtype.

Why this orientation: Y rows (channels) are contiguous pixels, so the C tiles are
stored row by row with plain vector stores and the bias is one broadcast per row; the
pixels-as-rows formulation would need an X transpose into A tiles and a C transpose
back to NCHW. Costs: pixel columns are computed in 32s (7x7: 64 for 49) and channels
in 32s.

Tiles: ``(image, group, pixel block, channel block)``, channel block fastest, as the
other reduced-precision kernel's (so a tile index carries the image: any batch); the
pixel block is sized so that its col buffer stays in L2, the grid so that two cores
get balanced work (a crude cost model, `plan_amx_conv`, which also picks direct or
im2col). Runtime (non-constant) weights are not handled here: the lowering runs the
vector kernel for them.

Numerics: bf16 products (round to nearest even), fp32 accumulation; ``tdpbf16ps``
treats denormal inputs as zero and flushes denormal results.
"""

from __future__ import annotations

from dataclasses import dataclass

import llvmlite.ir as ir
import numpy as np

from ..native import target
from ..native.emit import BF16, I8, I32, I64, PTR, VOID, X86_AMX, i64
from ..schedule.split import split_even
from .conv import (
    VB,
    VI,
    ConvGeom,
    Epilogue,
    LowpTypes,
    Slots,
    _LowpGen,
    _round_np,
    bf16_bits,
    cdiv,
    elem_type,
    rup,
    sload_dt,
    vload_dt,
    vstore_dt,
)
from .vec import VF, VM, abi_function

I16 = ir.IntType(16)

__all__ = [
    "AmxConvPlan",
    "amx_conv_supports",
    "emit_amx_conv",
    "pack_amx_conv_weights",
    "plan_amx_conv",
]

TILE = 1024          # bytes of a full tile (16 rows x 64 bytes)
UNITS = 16           # 32-bit units (bf16 pairs) per tile row: one K step of 32 bf16
COL_BYTES = 768 * 1024   # col buffer of a pixel block (L2 is 2 MiB on the AMX cores)
P_MAX = 512          # pixels per block (the C scratch is 32 x P fp32)
# K steps (2 KiB of weights each) per K chunk (C tiles spilled to the scratch between
# chunks, the chunk's weights staying in L1 over the pixel columns): 12 and 20 measured
# slower than unchunked on ResNet-18's 3x3 convs at 28/14/7 (kernel time, one core,
# 0.28/0.20/0.38 ms unchunked vs 0.28-0.31/0.25-0.28/0.42-0.45), so unchunked
KSTEPS_L1 = 1 << 20
# Direct mode, K step order: (tap, channel block) -- all the X copy's planes per tap --
# or, from CB_OUTER_MIN_NCB channel blocks (of 32 channels) on, (channel block, tap): the
# 9 taps of a 3x3 read the same 16 planes back to back, in L1. Measured (one core,
# medians of 6 interleaved): 3x3 at 28x28 with 128 channels 0.235 vs 0.26 ms, 14x14 with
# 256 0.205 vs 0.222. With (channel block, tap) and more than one tap the K loop is also
# chunked per channel block (`AmxConvPlan.kchunks`): a chunk's weights (KK*2 KiB: 18 KiB
# for a 3x3) stay in L1 over the pixel columns and its B tiles read 16 planes, the C tiles
# carried through the scratch. That made 2 blocks pay too (ResNet-18's 3x3s, one core,
# kernel medians of 4 interleaved, loaded machine): 56x56 with 64 channels 0.244 vs 0.259
# ms, 28x28 with 128 0.203 vs 0.218, stride 2 56->28 (64 -> 128) 0.157 vs 0.177, 28->14
# 0.141 vs 0.155; 14x14 with 256 (P 224: 7 pixel columns to share a chunk's weights)
# equal, 7x7 with 512 (P 64, 2 columns) slower in the model, 0.35 vs 0.30: so chunked
# only from CB_CHUNK_MIN_P pixels per block.
# The direct mode's misaligned B tiles: an aligned variant (Wp rounded up to 16, KW copies
# of the X copy, copy kw = copy 0 read kw units on, so every tile row starts 64-byte
# aligned; 15-25 us of extra copying at 56x56) measured SLOWER, 0.28-0.29 vs 0.25-0.26 ms
# at 56x56 and 0.24-0.25 vs 0.22-0.23 at 28x28: the micro-kernel ran ~11 ns per
# tdpbf16ps either way (vs 5.1 aligned / 8 misaligned when the same tiles load from L1 in
# a loop): KW copies triple the B lines a pixel column reads, and the kw taps of the
# misaligned copy share lines (the L1 -> L2 traffic, not the split loads, bounds it)
CB_OUTER_MIN_NCB = 2
CB_CHUNK_MIN_P = 256


def amx_conv_supports(geom: ConvGeom, types: LowpTypes) -> str | None:
    """Why this reduced-precision Conv cannot run on the AMX kernel (None: it can)."""
    if types.prec != "bf16":
        return f"{types.prec} (AMX here multiplies bf16 only)"
    if geom.transposed:
        return "a transposed convolution"
    for dt in (types.x, types.w, types.b, types.y):
        if dt not in ("float32", "bfloat16"):
            return f"a {dt} operand"
    return None


@dataclass(frozen=True)
class AmxConvPlan:
    mode: str        # "amx" (the path note; the im2col reads ``pairs``)
    direct: bool     # B tiles read from a padded bf16-pair copy of X (no im2col)
    kwpairs: bool    # im2col units pair taps (kw, kw+1) of a channel, not channels
    CU: int          # channel pairs per tap (direct: rounded up to 16)
    KU: int          # reduction units (bf16 pairs): KK*CU
    KUp: int         # KU rounded up to 16
    Q: int           # output pixels computed (direct: OH*Wp, the padded row width)
    P: int           # pixels per pixel block (a multiple of 32)
    PB: int
    CH: int          # output channels per channel block (a multiple of 32)
    MB: int
    Mp: int          # Mg rounded up to 32
    NCP: int         # im2col: col row stride; direct: plane stride of the X copy (units)
    Hp: int          # direct: the padded input's height and width
    Wp: int
    CSS: int         # C scratch row stride (bytes)
    ws_cs: int       # byte offset of the 32 x P fp32 C scratch
    ws_bytes: int
    num_tiles: int
    cb_outer: bool = False   # direct: K steps (channel block, tap), see CB_OUTER_MIN_NCB

    pairs = True

    @property
    def kb(self) -> int:
        return self.KUp // UNITS

    @property
    def kchunks(self) -> int:
        """K chunks (see KSTEPS_L1); direct, K steps (channel block, tap) with more than
        one tap, over at least CB_CHUNK_MIN_P pixels: at least one per channel block (see
        CB_OUTER_MIN_NCB)."""
        n = cdiv(self.kb, KSTEPS_L1)
        if self.cb_outer and self.KU > self.CU and self.P >= CB_CHUNK_MIN_P:
            n = max(n, self.CU // UNITS)
        return n


# AMX time factor of the direct mode, whose B tile rows at taps kw > 0 are not 64-byte
# aligned (a split-line tileloadd from L1 measured ~3.5x an aligned one on this Xeon,
# mostly hidden behind tdpbf16ps): with it the model takes im2col for ResNet-18's 3x3
# convs at 7x7 (49 pixels: a small col buffer), 0.33 vs 0.36 ms (one core, medians)
MISALIGNED = 1.3
# col buffer units per ns of the im2col (measured ~1.9 on ResNet-18's 3x3 stride-2 convs:
# the direct mode's phases, 0.17 vs 0.19 ms at 56x56 -> 28x28, take them)
IM2COL_RATE = 2.0


def _tile_cost(P: int, CH: int, KUp: int, copy_units: int, amx: float = 1.0,
               rate: float = 4.0) -> float:
    """Crude time of one tile (ns): the X copy at ~4 units/ns (the col buffer at
    ``rate``: ~2 measured for 3x3 stride-2 im2cols), AMX at ~1 TFLOP/s on whole
    32 x 32 blocks (times ``amx``), weights streamed at ~20 B/ns, an overhead."""
    return (copy_units / rate + amx * 4.0 * rup(P, 32) * CH * KUp / 1000.0
            + CH * KUp * 4 / 20.0 + 500)


def direct_ok(geom: ConvGeom) -> bool:
    """No depth axis, each of H and W strided 1 or (dilation 1) 2: each tap is a
    constant offset into a zero-padded copy of X (output pixels counted over the padded
    row width Wp, the extra columns discarded); stride 2 splits the copy into phases
    (even/odd rows x even/odd columns of the padded X), tap (kh, kw) reading phase
    (kh % 2, kw % 2) at offset (kh // 2, kw // 2) with stride 1."""
    return (not geom.transposed and geom.isz[0] == 1 and geom.k[0] == 1
            and geom.pb[0] == 0 and geom.osz[0] == 1 and geom.s[0] == 1
            and all(s == 1 or (s == 2 and d == 1) for s, d in zip(geom.s[1:], geom.d[1:])))


def _phases(geom: ConvGeom) -> tuple[int, int]:
    """The direct mode's phases along H and W (1: stride 1)."""
    return min(geom.s[1], geom.k[1]), min(geom.s[2], geom.k[2])


def _direct_dims(geom: ConvGeom) -> tuple[int, int, int]:
    """(Hp, Wp, max tap offset) of a phase of the padded X copy."""
    _, OH, OW = geom.osz
    _, KH, KW = geom.k
    _, sh, sw = geom.s
    _, dh, dw = geom.d
    eh, ew = (KH - 1) * dh // sh, (KW - 1) * dw // sw
    Hp, Wp = OH + eh, OW + ew
    return Hp, Wp, eh * Wp + ew


def _rows_of(geom: ConvGeom, q0: int, npix: int) -> tuple[int, int]:
    """The padded X rows [r0, r1) a direct pixel block [q0, q0 + npix) reads."""
    Hp, Wp, off = _direct_dims(geom)
    r0 = q0 // Wp
    return r0, (q0 + rup(npix, 32) - 1 + off) // Wp + 1


def plan_amx_conv(geom: ConvGeom, cores: int = 2, direct: bool | None = None) -> AmxConvPlan:
    """The blocking of ``geom``'s AMX kernel; ``direct`` None: the modelled cheaper of
    direct (where `direct_ok`) and im2col."""
    if direct is None:
        if not direct_ok(geom):
            direct = False
        else:
            a, b = (plan_amx_conv(geom, cores, d) for d in (False, True))
            return a if _plan_cost(geom, a) < _plan_cost(geom, b) else b
    if direct and not direct_ok(geom):
        raise ValueError("AMX conv: the direct mode needs stride 1 and no depth axis")
    Mg = geom.Mg
    CU = cdiv(geom.Cg, 2)
    Hp = Wp = 0
    nph = _phases(geom)[0] * _phases(geom)[1] if direct else 1
    if direct:
        CU = rup(CU, UNITS)
        Hp, Wp, _ = _direct_dims(geom)
        Q = geom.osz[1] * Wp
    else:
        Q = geom.OHW
    KU = geom.KK * CU
    kwpairs = not direct and kwpairs_ok(geom) and \
        rup(kwpairs_units(geom), UNITS) <= rup(KU, UNITS)
    if kwpairs:
        KU = kwpairs_units(geom)
    KUp = rup(KU, UNITS)
    Mp = rup(Mg, 32)
    pmax = min(P_MAX, rup(Q, 32))
    if not direct:
        pmax = min(pmax, max(32, (COL_BYTES // (4 * KUp)) // 32 * 32))
    best = None
    pb0 = cdiv(Q, pmax)
    for pb in range(pb0, pb0 + 4):
        P = rup(cdiv(Q, pb), 32)
        PB = cdiv(Q, P)
        for mb in range(1, min(Mp // 32, 8) + 1):
            CH = rup(cdiv(Mp, mb), 32)
            MB = cdiv(Mp, CH)
            T = geom.G * PB * MB     # per image: a batch runs these N times
            costs = []
            for _ in range(geom.G):
                for i in range(PB):
                    npix = min(P, Q - i * P)
                    if direct:
                        r0, r1 = _rows_of(geom, i * P, npix)
                        copy = nph * CU * (min(r1, Hp) - r0) * Wp
                    else:
                        copy = npix * KU
                    costs += [_tile_cost(npix, min(CH, Mp - j * CH), KUp, copy,
                                         MISALIGNED if direct else 1.0,
                                         4.0 if direct else IM2COL_RATE) for j in range(MB)]
            worst = max(sum(costs[a:b]) for a, b in split_even(T, cores))
            key = (worst, T)
            if best is None or key < best[0]:
                best = (key, P, PB, CH, MB)
    (cost, _), P, PB, CH, MB = best
    if direct:
        rows = max(r1 - r0 for r0, r1 in (_rows_of(geom, i * P, min(P, Q - i * P))
                                          for i in range(PB)))
        NCP = rup(rows * Wp, 16)
        if (NCP // 16) % 2 == 0:
            # an odd number of cache lines apart: the 16 planes a B tile reads (and the
            # taps' overlapping rows) spread over all L1 sets, not two of them
            NCP += 16
    else:
        NCP = P + 16               # row stride not a multiple of 4 KiB apart
    CSS = P * 4 + 64
    col = rup(KUp * NCP * 4 if not direct else nph * CU * NCP * 4, 64)
    return AmxConvPlan(mode="amx", direct=direct, kwpairs=kwpairs, CU=CU, KU=KU, KUp=KUp,
                       Q=Q, P=P, PB=PB, CH=CH, MB=MB, Mp=Mp, NCP=NCP, Hp=Hp, Wp=Wp, CSS=CSS,
                       ws_cs=col, ws_bytes=col + 32 * CSS,
                       num_tiles=geom.N * geom.G * PB * MB,
                       cb_outer=direct and CU // UNITS >= CB_OUTER_MIN_NCB)


def kwpairs_ok(geom: ConvGeom) -> bool:
    """Stride 2 along W, dilation 1, no depth axis: the taps kw, kw+1 of 16 output
    pixels are 32 consecutive elements of an X row, which converted to bf16 in order ARE
    the 16 units (kw low, kw+1 high): no shuffles. Used where it multiplies no more
    (padded) K than channel pairs, e.g. a 7x7 stem on 3 channels (K 168 vs 196)."""
    return (geom.s[2] == 2 and geom.d[2] == 1 and geom.k[2] >= 2 and geom.isz[0] == 1
            and geom.k[0] == 1 and not geom.transposed)


def kwpairs_units(geom: ConvGeom) -> int:
    return geom.Cg * geom.k[1] * cdiv(geom.k[2], 2)


def _plan_cost(geom: ConvGeom, p: AmxConvPlan) -> float:
    """The modelled time of one image (both modes, for the choice)."""
    t = 0.0
    for i in range(p.PB):
        npix = min(p.P, p.Q - i * p.P)
        if p.direct:
            r0, r1 = _rows_of(geom, i * p.P, npix)
            copy = _phases(geom)[0] * _phases(geom)[1] * p.CU * (min(r1, p.Hp) - r0) * p.Wp
        else:
            copy = npix * p.KU
        t += sum(_tile_cost(npix, min(p.CH, p.Mp - j * p.CH), p.KUp, copy,
                            MISALIGNED if p.direct else 1.0,
                            4.0 if p.direct else IM2COL_RATE) for j in range(p.MB))
    return t * geom.G


def pack_amx_conv_weights(geom: ConvGeom, plan: AmxConvPlan, w: np.ndarray) -> np.ndarray:
    """Weights [M, Cg, k...] (any float dtype) rounded to bf16, as A tiles
    ``[G][Mp/32][kb][2][16][16]`` of 32-bit units (the bf16 of channel 2cu in the low
    half, 2cu+1 in the high half, unit ``u = tap*CU + cu``), zero padded; a float32
    array of the unit bits."""
    G, Mg, Cg, KK, CU = geom.G, geom.Mg, geom.Cg, geom.KK, plan.CU
    Mp, KUp, kb = plan.Mp, plan.KUp, plan.kb
    if plan.kwpairs:    # unit (c*KH + kh)*KWP + kwp: taps kw = 2kwp (low), 2kwp+1 (high)
        KH, KW = geom.k[1], geom.k[2]
        KWP = cdiv(KW, 2)
        a = _round_np(np.asarray(w).reshape(G, Mg, Cg * KH, KW), "bfloat16")
        full = np.zeros((G, Mp, Cg * KH, 2 * KWP), np.float32)
        full[:, :Mg, :, :KW] = a.astype(np.float32)
        bits = (_round_np(full, "bfloat16").view(np.uint16).astype(np.uint32)
                .reshape(G, Mp, Cg * KH * KWP, 2))
        units = np.zeros((G, Mp, KUp), np.uint32)
        units[:, :, :plan.KU] = bits[..., 0] | (bits[..., 1] << 16)
        units = units.reshape(G, Mp // 32, 2, 16, kb, UNITS).transpose(0, 1, 4, 2, 3, 5)
        return np.ascontiguousarray(units).reshape(-1).view(np.float32)
    a = _round_np(np.asarray(w).reshape(G, Mg, Cg, KK), "bfloat16").astype(np.float32)
    full = np.zeros((G, Mp, 2 * CU, KK), np.float32)
    full[:, :Mg, :Cg] = a
    bits = (_round_np(full.transpose(0, 1, 3, 2), "bfloat16").view(np.uint16)
            .astype(np.uint32).reshape(G, Mp, KK, CU, 2))
    units = np.zeros((G, Mp, KUp), np.uint32)
    u = (bits[..., 0] | (bits[..., 1] << 16))
    if plan.cb_outer:    # K steps (channel block, tap): see CB_OUTER_MIN_NCB
        u = u.reshape(G, Mp, KK, CU // UNITS, UNITS).transpose(0, 1, 3, 2, 4)
    units[:, :, :KK * CU] = u.reshape(G, Mp, KK * CU)
    # (g, panel, half, row, kk, unit) -> (g, panel, kk, half, row, unit)
    units = units.reshape(G, Mp // 32, 2, 16, kb, UNITS).transpose(0, 1, 4, 2, 3, 5)
    return np.ascontiguousarray(units).reshape(-1).view(np.float32)


def _i16(v: int) -> ir.Constant:
    return ir.Constant(I16, v)


class _AmxConvGen(_LowpGen):
    """The tile loop and im2col of the reduced-precision kernel (mode "dp" units), a
    tile GEMM over the col buffer."""

    def __init__(self, module, fn, geom: ConvGeom, plan: AmxConvPlan, types: LowpTypes,
                 slots: Slots, epilogue: Epilogue | None):
        super().__init__(module, fn, geom, plan, types, slots, True, epilogue)
        self._mk: dict[bool, ir.Function] = {}
        self.cvt_native = target.host().has("avx512bf16")

    def unit(self, x0, x1):
        """The bf16 pair units of channel values x0, x1: with avx512_bf16 one
        ``vcvtne2ps2bf16`` and an interleave (round to nearest even, as `bf16_bits`;
        denormals flushed, which ``tdpbf16ps`` does anyway)."""
        if x1 is None or not self.cvt_native:
            return super().unit(x0, x1)
        b = self.v.b
        inter = ir.Constant(ir.VectorType(I32, 32), [i // 2 + 16 * (i % 2) for i in range(32)])
        v = b.shuffle_vector(x0, x1, inter)
        return b.bitcast(b.fptrunc(v, ir.VectorType(BF16, 32)), VF)

    def emit(self):
        v, g, p = self.v, self.g, self.p
        b = v.b
        args, tb, te, ws = v.fn.args
        sl = self.slots
        self.X, self.W, self.Y = v.arg(args, sl.x), v.arg(args, sl.w), v.arg(args, sl.y)
        self.Bias = v.arg(args, sl.b) if g.bias else None
        self.col = ws
        self.cs = b.gep(ws, [i64(p.ws_cs)], source_etype=I8)
        with v.loop(tb, te, 1, "tile") as t:
            gi, p0, p1, m_lo, m_hi, x_ng, ch0, y_off = self.tile_origin(t, p.Q)
            if p.direct:
                bbase = self.pack_x(x_ng, p0, p1)
            else:
                if p.kwpairs:
                    self.im2col_kwpairs(x_ng, p0, p1)
                else:
                    self.im2col(x_ng, p0, p1)
                self.zero_pad_rows()
                bbase = self.col
            self.gemm(gi, ch0, y_off, p0, b.sub(p1, p0), m_lo, m_hi, bbase)
        f = v.intr("llvm.x86.tilerelease", VOID, [])
        b.call(f, [])
        b.ret_void()

    def im2col(self, x_ng, p0, p1):
        """The col buffer ``[tap*CU + cu][pixel]`` of the pixels [p0, p1), as the
        vector kernel's (mode "dp" units) but channel pairs outermost: the inner loops
        read two planes of X and write one col row, sequentially (the vector kernel's
        channel-innermost order touches 2*CU pages of X per 16 pixels: TLB misses)."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        W = g.isz[2]
        OW = g.osz[2]
        KH, KW = g.k[1], g.k[2]
        sw, dw, pw = g.s[2], g.d[2], g.pb[2]
        row_first = b.udiv(p0, i64(OW))
        row_last = b.udiv(b.sub(p1, i64(1)), i64(OW))
        with v.loop(0, p.CU, 1, "cu") as cu:
            c0 = b.mul(cu, i64(2))
            has1 = b.icmp_signed("<", b.add(c0, i64(1)), i64(g.Cg))
            x_c0 = v.gep(x_ng, b.mul(c0, i64(g.DHW)), self.xt)
            # channel 2cu+1, or (odd Cg, last pair) channel 2cu again, multiplied by 0
            x_c1 = v.gep(x_c0, b.select(has1, i64(g.DHW), i64(0)), self.xt)
            with v.loop(0, g.KK, 1, "tap") as tap:
                rem, kw = v.divmod_c(tap, KW)
                kd, kh = v.divmod_c(rem, KH)
                dst_u = v.gep(self.col, b.mul(b.add(b.mul(tap, i64(p.CU)), cu), i64(p.NCP)))
                offw = b.sub(b.mul(kw, i64(dw)), i64(pw))
                with v.loop(row_first, b.add(row_last, i64(1)), 1, "row") as row:
                    ok, rowidx, rs, a, e = self.row_span(row, kd, kh, p0, p1)
                    rowoff = b.mul(rowidx, i64(W))
                    dst_row = v.gep(dst_u, b.sub(rs, p0))
                    with v.loop(a, e, 16, "ow") as ow:
                        load = self.loader(ow, offw, ok, W, sw)
                        x0 = load(v.gep(x_c0, rowoff, self.xt))
                        x1 = load(v.gep(x_c1, rowoff, self.xt))
                        x1 = b.select(has1, x1, v.zero_v)
                        v.store_v(self.unit(x0, x1), v.gep(dst_row, ow))

    def im2col_kwpairs(self, x_ng, p0, p1):
        """The col buffer of `kwpairs_ok` convs: row ``(c*KH + kh)*KWP + kwp`` holds, per
        output pixel, the bf16 of X at taps kw = 2kwp (low) and 2kwp+1 (high): for 16
        pixels, 32 consecutive elements of an X row (stride 2) converted in order; the
        element past an odd KW is masked to 0 (its weight is 0, but it may be an Inf)."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        _, H, W = g.isz
        _, OH, OW = g.osz
        _, KH, KW = g.k
        _, sh, _ = g.s
        _, dh, _ = g.d
        _, ph, pw = g.pb
        KWP = cdiv(KW, 2)
        even = ir.Constant(VM, [1, 0] * 8)
        row_first = b.udiv(p0, i64(OW))
        row_last = b.udiv(b.sub(p1, i64(1)), i64(OW))
        with v.loop(0, g.Cg * KH, 1, "ck") as ck:
            c, kh = v.divmod_c(ck, KH)
            x_c = v.gep(x_ng, b.mul(c, i64(g.DHW)), self.xt)
            dst_ck = v.gep(self.col, b.mul(ck, i64(KWP * p.NCP)))
            with v.loop(row_first, b.add(row_last, i64(1)), 1, "row") as row:
                ih = b.add(b.mul(row, i64(sh)), b.sub(b.mul(kh, i64(dh)), i64(ph)))
                ok = b.icmp_unsigned("<", ih, i64(H))
                src = v.gep(x_c, b.mul(b.select(ok, ih, i64(0)), i64(W)), self.xt)
                rs = b.mul(row, i64(OW))
                a = b.sub(v.smax(p0, rs), rs)
                e = b.sub(v.smin(p1, b.add(rs, i64(OW))), rs)
                dst_row = v.gep(dst_ck, b.sub(rs, p0))
                with v.loop(a, e, 16, "ow") as ow:
                    # inside the row (most of a wide image): no bounds masks
                    lo = b.sub(b.mul(ow, i64(2)), i64(pw))
                    inside = b.and_(ok, b.and_(
                        b.icmp_signed(">=", lo, i64(0)),
                        b.icmp_signed("<=", lo, i64(W - 32 - 2 * (KWP - 1)))))
                    with b.if_else(inside) as (then, other):
                        with then:
                            self._kwpairs_units(src, dst_row, ow, KWP, KW, pw, W, None,
                                                even)
                        with other:
                            self._kwpairs_units(src, dst_row, ow, KWP, KW, pw, W, ok, even)

    def _kwpairs_units(self, src, dst_row, ow, KWP, KW, pw, W, ok, even):
        """The KWP col rows of 16 output pixels from ow: ``ok`` None: every element
        read is inside the row (no bounds masks)."""
        v, p = self.v, self.p
        b = v.b
        for kwp in range(KWP):
            base = b.add(b.mul(ow, i64(2)), i64(2 * kwp - pw))
            halves = []
            for h in range(2):
                m = None
                if ok is not None:
                    lanes = b.add(v.splat_i(b.add(base, i64(16 * h))), v.iota)
                    m = v.mask_and(b.icmp_unsigned("<", lanes, v.splat_i(W)), ok)
                if KW % 2 and kwp == KWP - 1:
                    m = even if m is None else b.and_(m, even)
                halves.append(vload_dt(v, v.gep(src, b.add(base, i64(16 * h)), self.xt),
                                       self.t.x, m))
            v.store_v(self.units_in_order(*halves),
                      v.gep(dst_row, b.add(ow, i64(kwp * p.NCP))))

    def units_in_order(self, lo, hi):
        """32 floats (lo, hi) as bf16 in order, read as 16 units."""
        b = self.v.b
        cat = ir.Constant(ir.VectorType(I32, 32), list(range(32)))
        if self.cvt_native:
            v = b.shuffle_vector(lo, hi, cat)
            return b.bitcast(b.fptrunc(v, ir.VectorType(BF16, 32)), VF)
        h = [b.trunc(bf16_bits(b, x), ir.VectorType(I16, 16)) for x in (lo, hi)]
        return b.bitcast(b.shuffle_vector(h[0], h[1], cat), VF)

    def zero_pad_rows(self):
        """Col rows KU .. KUp-1 (K padding; zero weights there) to 0: stale workspace
        bits could be NaN."""
        v, p = self.v, self.p
        if p.KUp == p.KU:
            return
        base = v.gep(self.col, p.KU * p.NCP)
        with v.loop(0, (p.KUp - p.KU) * p.NCP, 16, "zp") as i:
            v.store_v(v.zero_v, v.gep(base, i))

    def pack_x(self, x_ng, q0, q1):
        """Direct mode: the rows of the zero-padded input that the pixels [q0, q1)
        (over the padded width) read, as bf16 pair units, into planes
        ``[phase][CU][NCP]`` (channel pairs 2cu, 2cu+1; pairs past the channels zero;
        phase (a, c): the padded rows r*sh + a, columns w*sw + c); returns the address
        of pixel q0's unit in plane 0."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        _, H, W = g.isz
        _, sh, sw = g.s
        _, ph, pw = g.pb
        nh, nw = _phases(g)
        Wp = p.Wp
        r0 = b.udiv(q0, i64(Wp))
        npp32 = b.and_(b.add(b.sub(q1, q0), i64(31)), i64(-32))
        off = _direct_dims(g)[2]
        r1 = v.smin(b.add(b.udiv(b.add(b.add(q0, npp32), i64(off - 1)), i64(Wp)), i64(1)),
                    p.Hp)
        npair = g.Cg // 2
        even = ir.Constant(VI, list(range(0, 32, 2)))

        def plane(dst, srcs, a, c):
            """One plane [r0, r1) x Wp of phase (a, c) of units from the channel planes
            ``srcs`` (two, one: the high half 0, none: zeros), row by row: sequential
            streams."""
            with v.loop(r0, r1, 1, "xr") as r:
                ih = b.sub(b.mul(r, i64(sh)), i64(ph - a))
                ok = b.icmp_unsigned("<", ih, i64(H))
                rowoff = b.mul(b.select(ok, ih, i64(0)), i64(W))
                dst_row = v.gep(dst, b.mul(b.sub(r, r0), i64(Wp)))
                with v.loop(0, Wp, 16, "xw") as w:
                    sm = v.lanes_lt(w, Wp)
                    val = v.zero_v
                    if srcs:
                        iw = b.sub(b.mul(w, i64(sw)), i64(pw - c))
                        lanes = b.add(v.splat_i(iw), v.iota)
                        ms = [v.mask_and(b.icmp_unsigned(
                            "<", b.add(lanes, v.splat_i(16 * h)) if h else lanes,
                            v.splat_i(W)), ok) for h in range(sw)]

                        def load(src, iw=iw, ms=ms):
                            s0 = v.gep(src, b.add(rowoff, iw), self.xt)
                            if sw == 1:
                                return vload_dt(v, s0, self.t.x, ms[0])
                            return b.shuffle_vector(    # stride 2: the even elements
                                vload_dt(v, s0, self.t.x, ms[0]),
                                vload_dt(v, v.gep(s0, 16, self.xt), self.t.x, ms[1]), even)

                        xs = [load(src) for src in srcs]
                        val = self.unit(xs[0], xs[1] if len(xs) > 1 else None)
                    v.store_v(val, v.gep(dst_row, w), sm)

        for a in range(nh):
            for c in range(nw):
                base = v.gep(self.col, (a * nw + c) * p.CU * p.NCP)
                with v.loop(0, npair, 1, "xc") as cu:
                    src = v.gep(x_ng, b.mul(cu, i64(2 * g.DHW)), self.xt)
                    plane(v.gep(base, b.mul(cu, i64(p.NCP))),
                          [src, v.gep(src, g.DHW, self.xt)], a, c)
                if g.Cg % 2:
                    plane(v.gep(base, npair * p.NCP),
                          [v.gep(x_ng, (g.Cg - 1) * g.DHW, self.xt)], a, c)
                if cdiv(g.Cg, 2) < p.CU:
                    with v.loop(cdiv(g.Cg, 2), p.CU, 1, "xz") as cu:
                        plane(v.gep(base, b.mul(cu, i64(p.NCP))), [], a, c)
        return v.gep(self.col, b.sub(q0, b.mul(r0, i64(Wp))))

    # -- tiles ----------------------------------------------------------------------
    def micro(self, first: bool) -> ir.Function:
        """``void mk(ptr a, ptr col, ptr cs, i64 npp, i64 k0, i64 k1)``: C[32 channels,
        32 pixels] for ``npp`` consecutive 32-pixel columns of the col buffer against
        the weight panel ``a``, K steps [k0, k1), into the scratch ``cs`` (rows CSS bytes
        apart): from zero (``first``) or adding to what it holds (a later K chunk)."""
        if first in self._mk:
            return self._mk[first]
        p, g = self.p, self.g
        m = self.v.m
        f = ir.Function(m, ir.FunctionType(VOID, [PTR, PTR, PTR, I64, I64, I64]),
                        name=m.get_unique_name(f"{self.v.fn.name}.mk{int(first)}"))
        f.linkage = "internal"
        f.attributes.add("nounwind")
        f.attributes.add("noinline")
        a, col, cs, npp, k0, k1 = f.args
        u = VB(m, f)
        b = u.b
        r16, c64 = _i16(16), _i16(64)
        bstride = p.NCP * 4

        def tload(ptr, stride):
            fn = u.intr("llvm.x86.tileloadd64.internal", X86_AMX, [I16, I16, PTR, I64])
            return b.call(fn, [r16, c64, ptr, i64(stride)])

        def tdp(c, x, y):
            fn = u.intr("llvm.x86.tdpbf16ps.internal", X86_AMX, [I16] * 3 + [X86_AMX] * 3)
            return b.call(fn, [r16, c64, c64, c, x, y])

        def by(ptr, off):
            return b.gep(ptr, [off if not isinstance(off, int) else i64(off)],
                         source_etype=I8)

        with u.loop(0, npp, 1, "pp") as pp:
            bcol = by(col, b.mul(pp, i64(128)))
            cptr = [by(cs, b.add(b.mul(pp, i64(128)), i64(i * 16 * p.CSS + j * 64)))
                    for i in range(2) for j in range(2)]
            if first:
                zf = u.intr("llvm.x86.tilezero.internal", X86_AMX, [I16, I16])
                init = [b.call(zf, [r16, c64]) for _ in range(4)]
            else:
                init = [tload(c, p.CSS) for c in cptr]

            def body(kk, accs):
                ak = by(a, b.mul(kk, i64(2 * TILE)))
                if p.direct:     # K step kk: tap kk // ncb, channel pairs 16 (kk % ncb)..
                    ncb = p.CU // UNITS
                    if p.cb_outer:
                        cb, tap = b.udiv(kk, i64(g.KK)), b.urem(kk, i64(g.KK))
                    else:
                        tap, cb = b.udiv(kk, i64(ncb)), b.urem(kk, i64(ncb))
                    kh, kw = b.udiv(tap, i64(g.k[2])), b.urem(tap, i64(g.k[2]))
                    # stride 2: tap (kh, kw) reads phase (kh % 2, kw % 2) at (kh // 2, kw // 2)
                    (_, sh, sw), (_, dh, dw) = g.s, g.d
                    nw = _phases(g)[1]
                    phase = b.add(b.mul(b.urem(kh, i64(sh)), i64(nw)), b.urem(kw, i64(sw)))
                    off = b.add(b.mul(b.udiv(b.mul(kh, i64(dh)), i64(sh)), i64(p.Wp * 4)),
                                b.mul(b.udiv(b.mul(kw, i64(dw)), i64(sw)), i64(4)))
                    off = b.add(off, b.mul(phase, i64(p.CU * p.NCP * 4)))
                    bk = by(bcol, b.add(off, b.mul(cb, i64(UNITS * bstride))))
                else:
                    bk = by(bcol, b.mul(kk, i64(UNITS * bstride)))
                at = [tload(ak, 64), tload(by(ak, TILE), 64)]
                bt = [tload(bk, bstride), tload(by(bk, 64), bstride)]
                return [tdp(accs[2 * i + j], at[i], bt[j]) for i in range(2) for j in range(2)]

            _, accs = u.carry_loop(k0, k1, 1, init, body, "k")
            sf = u.intr("llvm.x86.tilestored64.internal", VOID, [I16, I16, PTR, I64, X86_AMX])
            for c, acc in zip(cptr, accs):
                b.call(sf, [r16, c64, c, i64(p.CSS), acc])
        b.ret_void()
        self._mk[first] = f
        return f

    def gemm(self, gi, ch0, y_off, p0, npix, m_lo, m_hi, bbase):
        v, g, p = self.v, self.g, self.p
        b = v.b
        npp = b.udiv(b.add(npix, i64(31)), i64(32))
        panel_bytes = p.kb * 2 * TILE
        with v.loop(m_lo, m_hi, 32, "mp") as mp:
            panel = b.add(b.mul(gi, i64(p.Mp // 32)), b.udiv(mp, i64(32)))
            a = b.gep(self.W, [b.mul(panel, i64(panel_bytes))], source_etype=I8)
            # K in chunks whose slice of the weight panel stays in L1 over the columns
            for c in range(p.kchunks):
                k0, k1 = c * p.kb // p.kchunks, (c + 1) * p.kb // p.kchunks
                b.call(self.micro(c == 0), [a, bbase, self.cs, npp, i64(k0), i64(k1)])
            rows = v.smin(b.sub(m_hi, mp), 32)
            with v.loop(0, rows, 1, "r") as r:
                ch = b.add(ch0, b.add(mp, r))
                bias = None
                if self.Bias is not None:
                    bias = v.splat(sload_dt(v, v.gep(self.Bias, ch, elem_type(self.t.b)),
                                            self.t.b), VF)
                srow = b.gep(self.cs, [b.mul(r, i64(p.CSS))], source_etype=I8)
                ybase = b.add(y_off, b.mul(b.add(mp, r), i64(g.OHW)))
                if not p.direct:
                    self.store_seg(srow, bias, b.add(ybase, p0), i64(0), npix, 64)
                else:
                    self.store_rows(srow, bias, ybase, p0, npix)

    def store_rows(self, srow, bias, ybase, p0, npix):
        """Direct mode: pixels [p0, p0 + npix) over the padded width Wp; per output row
        its OW columns: scratch pixel (oh*Wp + ow - p0) to Y pixel oh*OW + ow."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        Wp, OW = p.Wp, g.osz[2]
        p1 = b.add(p0, npix)
        with v.loop(b.udiv(p0, i64(Wp)),
                    b.add(b.udiv(b.sub(p1, i64(1)), i64(Wp)), i64(1)), 1, "oh") as oh:
            rs = b.mul(oh, i64(Wp))
            lo = b.sub(v.smax(p0, rs), rs)
            hi = v.smin(b.sub(p1, rs), OW)
            self.store_seg(v.gep(srow, b.sub(rs, p0)), bias,
                           b.add(ybase, b.mul(oh, i64(OW))), lo, hi, 4)

    def store_seg(self, srow, bias, yrow, lo, hi, align):
        """Y[yrow + j] for j in [lo, hi) from the scratch row ``srow[j]``: bias, the
        epilogue (fp32), the store as Y's dtype (masked at the end)."""
        v, t = self.v, self.t
        b = v.b
        yt = elem_type(t.y)
        with v.loop(lo, hi, 16, "px") as j:
            msk = v.lanes_lt(j, hi)
            val = b.load(v.gep(srow, j), typ=VF, align=align)
            if bias is not None:
                val = b.fadd(val, bias)
            idx = b.add(yrow, j)
            if self.epilogue is not None:
                val = self.epilogue(b, val, idx, 1, msk)
                if val.type != VF:
                    val = b.fpext(val, VF)
            dst = v.gep(self.Y, idx, yt)
            if t.y == "bfloat16":
                # a masked truncating store (vpmovdw): see amx.store_bf16 (LLVM 22)
                fn = v.intr("llvm.x86.avx512.mask.pmov.dw.mem.512", VOID, [PTR, VI, I16])
                b.call(fn, [dst, bf16_bits(b, val), b.bitcast(msk, I16)])
            else:
                vstore_dt(v, val, dst, t.y, msk)


def emit_amx_conv(module: ir.Module, name: str, geom: ConvGeom, plan: AmxConvPlan,
                  types: LowpTypes, slots: Slots | None = None,
                  epilogue: Epilogue | None = None) -> ir.Function:
    """The AMX implicit GEMM (see above) as an ABI kernel ``name`` of
    ``plan.num_tiles`` tiles and ``plan.ws_bytes`` of workspace; the weight argument
    holds ``pack_amx_conv_weights(geom, plan, W)``. Run it only where
    `amx.amx_usable` is None."""
    if amx_conv_supports(geom, types):
        raise ValueError(f"AMX conv: {amx_conv_supports(geom, types)}")
    fn = abi_function(module, name)
    _AmxConvGen(module, fn, geom, plan, types, slots or Slots(), epilogue).emit()
    return fn

