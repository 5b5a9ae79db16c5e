"""The stem convolution: few input channels, strided, read in place from phase rows.

A network's first convolution (ResNet's 7x7 stride 2 and MobileNet's 3x3 stride 2
over 3 colour channels, ConvNeXt's 4x4 stride-4 patches) has a short reduction
(K = 27-147) over an image of many pixels. The implicit GEMM (codegen/conv.py) pays
an im2col copy per tile there that costs about as much as its FMAs, and its K is too
short to hide it. This kernel never builds the col matrix.

Per tile (an image's block of ``R`` output rows) the input rows the block reads are
split into ``sw`` column phases, zero padded (the "slab", in the workspace):

    slab[ci][sr][p][j] = X[ci][oy0*sh - ph + sr][j*sw + p - pw]    (0 outside X)

so that tap ``(ky, kx)`` of output pixel ``(oy, ox)`` is ``slab[ci][(oy - oy0)*sh +
ky][kx % sw][ox + kx // sw]``: for 16 consecutive ``ox`` one contiguous vector load.
The micro-kernel keeps ``MR`` output channels x ``NV`` vectors of 16 pixels of one
output row in registers; per tap it loads the ``NV`` input vectors and broadcasts
``MR`` weights straight from the weight tensor's natural layout ``[M][C][KH][KW]``
(no packing: runtime weights work alike), a loop over the input channels around the
unrolled taps. The bias starts the sums, the fused epilogue sees every final vector,
and rows are stored whole (a masked last vector where OW is no multiple of 16).

Building the slab costs ``sw`` masked loads and ``sw`` shuffles per ``sw`` vectors of
it, about 1% of the FMAs of a 3-channel 3x3 stem.
"""

from __future__ import annotations

from dataclasses import dataclass

import llvmlite.ir as ir

from ..native.emit import F32, I32, i64, mark_vector_code
from .conv import VB, ConvGeom, Epilogue, Slots, cdiv, conv_args, rup
from .vec import VF, abi_function, wide_registers

STEM_MAX_C = 4           # input channels a group at most (colour images)
STEM_STRIDES = (2, 4)    # column strides whose phases the slab builder shuffles apart
STEM_MIN_OW = 16         # output rows of at least one whole vector
STEM_MIN_M = 8           # output channels at least
# KH*KW at most: the taps are unrolled inside the input-channel loop. AlexNet's 11x11
# stride-4 3 -> 64 (121 taps), 1 core of a Zen 4 guest: 2.21 ms as an implicit GEMM,
# 1.49 here (onnxruntime 1.35)
STEM_MAX_TAPS = 121
STEM_ROW_TILES = 14      # an image's output rows are cut in about this many tiles
STEM_MAX_R = 8           # output rows a tile at most
STEM_MR, STEM_NV = 4, 4  # micro-tile: output channels x vectors of 16 pixels (plan_stem)
# AVX2 (16 ymm registers, a <16 x float> taking two): 2 x 3, 12 ymm accumulators. Zen 4
# under CANNC_ISA=avx2, 1 core, against 2 x 2: 7x7/2 3->64 2680-2747 -> 2483-2569 us,
# 3x3/2 3->32 244.6 -> 232.1 (4 x 1 230.7, but 2681 on the 7x7; 3 x 2 and 2 x 4 spill,
# 10-25% slower)
STEM_MR_AVX2, STEM_NV_AVX2 = 2, 3

STEM_PREFETCH_NEXT_ROW = True
STEM_PREFETCH_X = True

# plan overrides for every plan_stem call (tests, experiments): MR, NV, R
FORCE_TUNING: dict = {}


def eligible(geom: ConvGeom) -> bool:
    """2-D (or 1-D), one group of at most STEM_MAX_C input channels, not dilated nor
    transposed, a column stride in STEM_STRIDES no larger than the kernel, at least
    STEM_MIN_M output channels and STEM_MIN_OW output columns."""
    KD, KH, KW = geom.k
    return (geom.G == 1 and not geom.transposed and geom.d == (1, 1, 1)
            and geom.isz[0] == 1 and geom.osz[0] == 1 and KD == 1
            and geom.C <= STEM_MAX_C and geom.s[2] in STEM_STRIDES and KW >= geom.s[2]
            and KH * KW <= STEM_MAX_TAPS and geom.M >= STEM_MIN_M
            and geom.osz[2] >= STEM_MIN_OW and geom.OHW > 0
            and geom.N * geom.C * geom.DHW < 2 ** 40 and geom.N * geom.M * geom.OHW < 2 ** 40)


@dataclass(frozen=True)
class StemPlan:
    MR: int          # output channels a micro-tile
    NV: int          # <16 x float> vectors of one output row a micro-tile
    R: int           # output rows a tile
    RB: int          # row blocks (tiles) of one image
    SR: int          # slab rows an input channel: (R - 1)*sh + KH
    LP: int          # floats a slab phase row (whole vectors)
    ws_bytes: int
    num_tiles: int   # N x RB


def plan_stem(geom: ConvGeom, tuning: dict | None = None) -> StemPlan:
    """Micro-tile and row blocking of an eligible stem conv (see the module doc)."""
    tun = dict(FORCE_TUNING if tuning is None else tuning)
    _, KH, KW = geom.k
    _, sh, sw = geom.s
    _, OH, OW = geom.osz
    nvec = cdiv(OW, 16)
    # a micro-tile of MR x NV vectors, its MR weight broadcasts and an input vector in
    # registers. Zen 4, 1 core, 7x7/2 3->64 (2.01 ms at the FMA peak): 4 x 4 2.09-2.12 ms,
    # 3 x 7 2.15, 4 x 7 2.25 (spills), 5 x 4 and 6 x 4 2.2-2.5, 8 x 2 3.0; 3x3/2 3->32
    # (0.185): 4 x 4 0.205-0.229, 3 x 7 0.211-0.234, 6 x 4 0.215-0.248. An output row of
    # more vectors is cut in column blocks as even as they go (112 pixels: 4 + 3)
    nv_max = STEM_NV if wide_registers() else STEM_NV_AVX2
    NV = tun.get("NV", cdiv(nvec, cdiv(nvec, nv_max)))
    MR = tun.get("MR", min(STEM_MR if wide_registers() else STEM_MR_AVX2, geom.M))
    R = tun.get("R", max(1, min(STEM_MAX_R, cdiv(OH, STEM_ROW_TILES))))
    RB = cdiv(OH, R)
    SR = (R - 1) * sh + KH
    LP = rup(rup(OW, 16) + (KW - 1) // sw, 16)
    ws = rup(4 * geom.C * SR * sw * LP, 64)
    return StemPlan(MR=MR, NV=NV, R=R, RB=RB, SR=SR, LP=LP, ws_bytes=ws,
                    num_tiles=geom.N * RB)


def stem_path(plan: StemPlan) -> str:
    return f"stem-direct MR{plan.MR} NV{plan.NV} R{plan.R}x{plan.RB}"


class _StemGen:
    def __init__(self, module: ir.Module, fn: ir.Function, geom: ConvGeom, plan: StemPlan,
                 slots: Slots, epilogue: Epilogue | None) -> None:
        self.v = VB(module, fn)
        self.g, self.p, self.slots, self.epilogue = geom, plan, slots, epilogue

    def emit(self) -> None:
        v, g, p = self.v, self.g, self.p
        b = v.b
        args, tb, te, ws = v.fn.args
        self.X, self.W, self.Bias, self.Y = conv_args(v, args, self.slots, g.bias)
        self.slab = ws
        _, OH, _ = g.osz
        with v.loop(tb, te, 1, "tile") as t:
            img, rb = v.divmod_c(t, p.RB)
            oy0 = b.mul(rb, i64(p.R))
            oy1 = v.smin(b.add(oy0, i64(p.R)), OH)
            x_img = v.gep(self.X, b.mul(img, i64(g.C * g.DHW)))
            self.build_slab(x_img, oy0)
            self.rows(img, x_img, oy0, oy1)
        b.ret_void()

    # -- the slab: the tile's input rows split into column phases ----------------
    def build_slab(self, x_img, oy0) -> None:
        v, g, p = self.v, self.g, self.p
        b = v.b
        _, H, W = g.isz
        _, sh, sw = g.s
        _, ph, pw = g.pb
        iy_base = b.sub(b.mul(oy0, i64(sh)), i64(ph))
        with v.loop(0, g.C * p.SR, 1, "slabrow") as q:
            ci, sr = v.divmod_c(q, p.SR)
            iy = b.add(iy_base, sr)
            ok = b.and_(b.icmp_signed(">=", iy, i64(0)), b.icmp_signed("<", iy, i64(H)))
            # a row in the padding reads nothing (all lanes off) from row 0
            src = v.gep(x_img, b.add(b.mul(ci, i64(H * W)),
                                     b.mul(b.select(ok, iy, i64(0)), i64(W))))
            dst = v.gep(self.slab, b.mul(q, i64(sw * p.LP)))
            for j0 in range(0, p.LP, 16):
                col0 = j0 * sw - pw
                parts = []
                for k in range(sw):
                    c = col0 + 16 * k
                    lanes = [0 <= c + i < W for i in range(16)]
                    if not any(lanes):
                        parts.append(v.zero_v)
                        continue
                    mask = ir.Constant(v.zero_m.type, [int(x) for x in lanes])
                    mask = v.mask_and(mask, ok)
                    parts.append(v.load_v(v.gep(src, c), mask))
                for ph_ in range(sw):
                    b.store(self.phase(parts, ph_), v.gep(dst, ph_ * p.LP + j0), align=4)

    def phase(self, parts, ph_):
        """Lanes ph_, ph_ + sw, ... of the concatenated ``parts`` (sw vectors of 16)."""
        b = self.v.b
        sw = len(parts)
        idx = ir.Constant(ir.VectorType(I32, 16), [ph_ + sw * i for i in range(16)])
        if sw == 2:
            return b.shuffle_vector(parts[0], parts[1], idx)
        # sw == 4: 8 lanes from each pair, then the two halves
        sel = ir.Constant(ir.VectorType(I32, 8), [ph_ + 4 * i for i in range(8)])
        lo = b.shuffle_vector(parts[0], parts[1], sel)
        hi = b.shuffle_vector(parts[2], parts[3], sel)
        return b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 16), list(range(16))))

    # -- the output rows of a tile -----------------------------------------------
    def rows(self, img, x_img, oy0, oy1) -> None:
        v, g, p = self.v, self.g, self.p
        b = v.b
        M = g.M
        full = M // p.MR * p.MR
        _, H, W = g.isz
        _, sh, _ = g.s
        with v.loop(oy0, oy1, 1, "oy") as oy:
            srow = b.mul(b.sub(oy, oy0), i64(sh))   # the row's first slab row
            if STEM_PREFETCH_X:
                # the input rows the next tile's slab takes in place of this row's: X
                # comes from memory or another core's cache (the host copy)
                iy = b.sub(b.mul(b.add(oy, i64(p.R)), i64(sh)), i64(g.pb[1] - g.k[1] + sh))
                for ci in range(g.C):
                    for dy in range(sh):
                        row = v.gep(x_img, b.add(b.mul(v.smin(v.smax(b.add(iy, i64(dy)), 0),
                                                              H - 1), i64(W)), i64(ci * H * W)))
                        for line in range(0, W, 16):
                            v.prefetch_r(v.gep(row, line), locality=2)
            if full:
                with v.loop(0, full, p.MR, "m") as m:
                    self.columns(img, oy, srow, m, p.MR)
            if M - full:
                self.columns(img, oy, srow, i64(full), M - full)

    def columns(self, img, oy, srow, m, mr: int) -> None:
        p = self.p
        OW = self.g.osz[2]
        nvec = cdiv(OW, 16)
        for v0 in range(0, nvec, p.NV):
            self.micro(img, oy, srow, m, mr, v0, min(p.NV, nvec - v0))

    def micro(self, img, oy, srow, m, mr: int, v0: int, nv: int) -> None:
        """Output channels [m, m+mr) x vectors [v0, v0+nv) of row oy."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        _, KH, KW = g.k
        _, _, sw = g.s
        _, OH, OW = g.osz
        K, KK = g.K, KH * KW
        init = []
        for r in range(mr):
            if self.Bias is not None:
                bias = b.load(v.gep(self.Bias, b.add(m, i64(r))), typ=F32, align=4)
                init.append([v.splat_f(bias)] * nv)
            else:
                init.append([v.zero_v] * nv)
        y_img = b.mul(img, i64(g.M * OH * OW))
        if STEM_PREFETCH_NEXT_ROW:
            # the next output row's lines of these channels, for writing: the output
            # has left the caches since the last run (a model's activations), and the
            # read-for-ownership of its cold lines stalls the stores
            nxt = b.add(y_img, b.mul(b.add(b.mul(m, i64(OH)), b.add(oy, i64(1))), i64(OW)))
            for r in range(mr):
                for j in range(nv):
                    v.prefetch_w(v.gep(self.Y, b.add(nxt, i64(r * OH * OW + 16 * (v0 + j)))))
        w_m = v.gep(self.W, b.mul(m, i64(K)))
        # slab rows a channel apart: SR * sw * LP floats
        cstride = p.SR * sw * p.LP
        s_row = v.gep(self.slab, b.add(b.mul(srow, i64(sw * p.LP)), i64(16 * v0)))

        def body(ci, acc, streams):
            xs, ws_ = streams
            acc = [list(row) for row in acc]
            for ky in range(KH):
                for kx in range(KW):
                    off = (ky * sw + kx % sw) * p.LP + kx // sw
                    tap = ky * KW + kx
                    wv = [v.splat_f(b.load(v.gep(ws_, r * K + tap), typ=F32, align=4))
                          for r in range(mr)]
                    for j in range(nv):
                        xv = b.load(v.gep(xs, off + 16 * j), typ=VF, align=4)
                        for r in range(mr):
                            acc[r][j] = v.fma(wv[r], xv, acc[r][j])
            return acc, [v.gep(xs, cstride), v.gep(ws_, KK)]

        _, acc, _ = v.grid_loop(0, g.C, 1, init, [s_row, w_m], body, "ci")
        # store: channel m + r, row oy, columns 16*(v0 + j) on
        for r in range(mr):
            row_off = b.add(y_img, b.mul(b.add(b.mul(b.add(m, i64(r)), i64(OH)), oy), i64(OW)))
            for j in range(nv):
                c = 16 * (v0 + j)
                mask = None if c + 16 <= OW else ir.Constant(
                    v.zero_m.type, [int(c + i < OW) for i in range(16)])
                off = b.add(row_off, i64(c))
                val = acc[r][j]
                if self.epilogue is not None:
                    val = self.epilogue(b, val, off, 1,
                                        v.ones_m if mask is None else mask)
                v.store_v(val, v.gep(self.Y, off), mask)


_DEFAULT_SLOTS = Slots()


def emit_stem(module: ir.Module, name: str, geom: ConvGeom, plan: StemPlan,
              slots: Slots = _DEFAULT_SLOTS, epilogue: Epilogue | None = None) -> ir.Function:
    """Emit the stem convolution as an ABI kernel ``name``; W is the weight tensor as
    is ([M][C][KH][KW], float32). Tiles: ``plan.num_tiles``; workspace ``plan.ws_bytes``
    per core."""
    assert eligible(geom), geom
    fn = abi_function(module, name)
    _StemGen(module, fn, geom, plan, slots, epilogue).emit()
    mark_vector_code(module)
    return fn


# ---------------------------------------------------------------------------
# path selection
# ---------------------------------------------------------------------------

STEM_MIN_FLOPS = 2_000_000


def choose(geom: ConvGeom, mode: str = "auto") -> StemPlan | None:
    """The stem plan for ``geom`` or None for the implicit GEMM. ``mode``: 'off',
    'force' (every eligible shape) or 'auto'."""
    if mode == "off" or not eligible(geom):
        return None
    plan = plan_stem(geom)
    if mode == "force":
        return plan
    if geom.flops // max(1, geom.N) < STEM_MIN_FLOPS:
        return None
    return plan


