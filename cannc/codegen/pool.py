"""Sliding-window kernels: pooling (max, average, Lp) and depthwise convolution.

One emitter covers every op whose output pixel reads a KD x KH x KW window of
ONE input plane: the pools, and the depthwise convolution (group == C, each
output channel ``co`` reading input channel ``co // multiplier``).

Shapes are normalised to 3 spatial dims. A tile is ``(image, channel, block of
output rows)``, rows being the flattened ``(od, oh)``. The kernel computes
``R`` output rows x ``V`` ``<16 x float>`` vectors along the output width at
once (``R*V`` independent accumulators), loading the input with masked vector
loads: stride 1 directly, stride 2 as two loads and an even-lane shuffle, other
strides as masked gathers. Stride-2 2-D windows load each input row of a step once
instead, split into its even and odd columns (s2_rows), and every tap of every output
row that reads the row takes a lane rotation of one of them; with AVX2 each tap takes its
phase within 128-bit lanes from the input loaded at its own offset (taps_in_lane), the
sums in a lane order of their own until the store. Padding and the window
parts outside the input are the load masks (the pass-through value is the reduction's
identity), so no border special cases are needed. Depthwise convs on small planes
(rows narrower than a vector, e.g. 7x7) take a tile per plane instead and compute it as
one flat row of pixels (FlatPlane), so their vectors are not mostly empty lanes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import llvmlite.ir as ir
import numpy as np

from ..native.emit import F32, i64, intrinsic
from . import vmath
from .conv import (
    VB,
    VI,
    Epilogue,
    Slots,
    cdiv,
    costly_epilogue,
    elem_type,
    epilogue_in_place,
    rup,
    sload_dt,
    vgather_dt,
    vload_dt,
    vstore_dt,
)
from .vec import ACC_BUDGET_AVX2, VF, VM, abi_function, wide_registers

KINDS = ("dw", "max", "avg", "lp")
INTERIOR_STEPS = True     # steps inside the image run without row tests (_WindowGen.interior)
PAD_ROWS = True           # tiles may read padded row copies (PaddedRows, pad_rows)
PAD_BYTES = 24 * 1024     # a tile's padded rows at most this (L1-resident): rows per tile cut
FLAT_PLANES = True        # small depthwise planes computed as one flat row (FlatPlane)
FLAT_MAX_VECTORS = 8      # ... of at most this many vectors of output pixels
# ... and with AVX2, windows of at most 3x3 taps on planes of up to 13 vectors (14x14),
# which by rows take one output row a step from a padded copy (narrow_rows, pad_rows).
# Their 13 accumulators do not fit 16 ymm registers, but the spills cost less than the
# copy and the per-row steps. Zen 4 under CANNC_ISA=avx2, depthwise alone, 1 core, flat
# against rows (in-process, alternating): 3x3 on 14x14 with 240 / 384 / 480 / 576
# channels 24.2 -> 21.3, 56.1 -> 43.4, 45.4 -> 43.8, 57.5 -> 49.3 us, on 12x12 (256)
# 36.2 -> 21.2; 5x5 on 14x14 (480) 144 -> 150 and 7x7 (384) 165 -> 180 keep their rows.
# With AVX-512 (rows of 14 in one vector) 3x3 on 14x14 measured level: 46.7 -> 45.7 us.
FLAT_MAX_VECTORS_AVX2_3X3 = 13
# rows of at most this many column chunks take one step per chunk at constant columns
# (constant masks: plain loads inside the row, masks folded at its edges), more in a
# runtime loop whose masks are computed every step. Zen 4, depthwise 3x3 alone, 1 core:
# 224x224 (32 channels, 2 chunks) 615-680 -> 471-488 us; under CANNC_ISA=avx2 (AVX2 has
# no mask registers: a runtime mask is ~6 instructions a load) 56x56 (144) 793 -> 419 us,
# 112x112 (64, 7 chunks) 320 -> 187 us
UNROLL_CHUNKS = 8
OVERLAP_LAST_CHUNK = True  # (AVX2) the last chunk of a row ends at its end (overlap_last_chunk)
S2_ROWS = True            # stride-2 2-D windows load each input row once, by phase (s2_rows)
S2_MIN_COLS = 8           # ... AVX-512 ones of 5x5 or more, one vector a row: rows wider


# AVX2 stride-2 steps (_WindowGen.taps_in_lane): phase q of the 32 input columns x0, x1
# taken within 128-bit lanes (one vshufps a ymm), whose lane l holds output column
# PHASE_ORDER[l] (an involution: the same shuffle puts the sums back in column order)
PHASE_LANES = [ir.Constant(VI, [h + q + o for h in (0, 16) for o in (0, 2, 8, 10, 4, 6, 12, 14)])
               for q in (0, 1)]
PHASE_ORDER = ir.Constant(VI, [h + o for h in (0, 8) for o in (0, 1, 4, 5, 2, 3, 6, 7)])


@dataclass(frozen=True)
class WindowSpec:
    kind: str          # 'dw' | 'max' | 'avg' | 'lp'
    N: int
    C: int             # input channels
    M: int             # output channels (planes per image)
    isz: tuple         # (D, H, W)
    osz: tuple         # (OD, OH, OW)
    k: tuple
    s: tuple = (1, 1, 1)
    d: tuple = (1, 1, 1)
    pb: tuple = (0, 0, 0)
    bias: bool = False
    # average pooling divisors, per output row (od, oh) and per output column
    count_rows: tuple = ()
    count_cols: tuple = ()
    p: int = 2         # LpPool exponent
    # element types (numpy names) of X, the weights, the bias and Y: float32, or bfloat16 /
    # float16 (widened to float32 on load, computed in float32, rounded on the store)
    dts: tuple = ("float32", "float32", "float32", "float32")

    @property
    def mult(self) -> int:
        return self.M // self.C

    @property
    def KK(self) -> int:
        return self.k[0] * self.k[1] * self.k[2]

    @property
    def rows(self) -> int:
        return self.osz[0] * self.osz[1]


@dataclass(frozen=True)
class PaddedRows:
    """The input rows of a tile copied into the workspace with the padding written out
    (the reduction's identity) and, for stride s > 1, split by column phase, so that
    every tap of every step is one plain vector load: buffer row ``rho*s + q`` holds
    input row ``r_lo*sh - ph + rho``, columns ``(c - L)*s + q`` for c < row_len. A tap
    kw reads phase ``q = a mod s`` at column ``ow + L + a // s``, a = kw*dw - pw.
    2-D windows (KD = 1, one output plane)."""

    L: int          # left margin (columns)
    rows: int       # buffer rows (rho) per tile
    row_len: int    # floats per buffer row (a multiple of 16)

    @staticmethod
    def of(spec: WindowSpec, RB: int, R: int, ncols: int) -> PaddedRows:
        sw, dw, pw = spec.s[2], spec.d[2], spec.pb[2]
        es = [(kw * dw - pw) // sw for kw in range(spec.k[2])]
        L = max(0, -min(es))
        rows = (rup(RB, R) - 1) * spec.s[1] + (spec.k[1] - 1) * spec.d[1] + 1
        return PaddedRows(L=L, rows=rows, row_len=rup(L + max(es) + ncols, 16))

    def nbytes(self, spec: WindowSpec) -> int:
        return rup(self.rows * spec.s[2] * self.row_len * 4, 64)


@dataclass(frozen=True)
class FlatPlane:
    """A small plane (at most FLAT_MAX_VECTORS vectors of output pixels, rows narrower
    than a vector) computed as one flat row: output pixel ``q = oh*OW + ow`` reads tap
    (kh, kw) at input index ``q + (kh*dh - ph)*W + kw*dw - pw`` (stride 1, OW = W), so a
    tap is one load a vector of 16 pixels, masked (a compile-time constant) where its
    lanes leave the plane or cross a row's edge. By rows, rows of 7 (7x7 planes) used 7
    of 16 lanes a vector; flat, 49 of 64. (A copy of the plane into a zeroed workspace,
    the taps then loaded unmasked, was slower than the rows: its loads overlap the
    copy's fresh stores, which the CPU cannot forward.)"""

    nv: int         # vectors of output pixels

    @staticmethod
    def of(spec: WindowSpec) -> FlatPlane:
        return FlatPlane(nv=cdiv(spec.osz[1] * spec.osz[2], 16))

    @staticmethod
    def tap_mask(spec: WindowSpec, kh: int, kw: int, j: int) -> list[int]:
        """Lanes of vector j (output pixels) whose tap (kh, kw) lies inside the input."""
        H, W = spec.isz[1], spec.isz[2]
        OH, OW = spec.osz[1], spec.osz[2]
        res = []
        for i in range(16):
            q = 16 * j + i
            ih = q // OW + kh * spec.d[1] - spec.pb[1]
            iw = q % OW + kw * spec.d[2] - spec.pb[2]
            res.append(1 if q < OH * OW and 0 <= ih < H and 0 <= iw < W else 0)
        return res


def flat_plane(spec: WindowSpec) -> bool:
    """Compute each plane flat (FlatPlane): depthwise float32 2-D windows of stride 1
    whose output rows are as wide as the input's and narrower than 16, on planes of at
    most FLAT_MAX_VECTORS vectors (7x7: MobileNet's, EfficientNet's and ConvNeXt's last
    stages; with AVX2 and up to 3x3 taps, FLAT_MAX_VECTORS_AVX2_3X3: 14x14)."""
    limit = FLAT_MAX_VECTORS_AVX2_3X3 if (not wide_registers() and spec.k[1] <= 3
                                         and spec.k[2] <= 3) else FLAT_MAX_VECTORS
    return (FLAT_PLANES and spec.kind == "dw" and spec.dts[0] == "float32"
            and spec.k[0] == 1 and spec.isz[0] == 1 and spec.osz[0] == 1
            and spec.s[1] == spec.s[2] == 1 and spec.osz[2] == spec.isz[2] < 16
            and spec.osz[1] > 1 and cdiv(spec.osz[1] * spec.osz[2], 16) <= limit)


@dataclass(frozen=True)
class WindowPlan:
    V: int        # vectors per row step
    chunks: int   # row chunks of 16*V columns
    R: int        # rows per step
    RB: int       # rows per tile
    nrb: int      # row blocks per plane
    num_tiles: int
    # the padded copy of a tile's rows (None: X is read in place) and the workspace it takes
    pad: PaddedRows | None = None
    ws_bytes: int = 0
    # the plane computed as one flat row (None: by rows)
    flat: FlatPlane | None = None
    # stride 2: input rows loaded once a step, split by column phase (s2_rows)
    s2: bool = False

    @property
    def padded(self) -> bool:
        return self.pad is not None


def plan_window(spec: WindowSpec, cores: int = 2) -> WindowPlan:
    if flat_plane(spec):
        fp = FlatPlane.of(spec)
        planes = spec.N * spec.M
        return WindowPlan(V=fp.nv, chunks=1, R=1, RB=spec.rows, nrb=1, num_tiles=planes,
                          flat=fp)
    OW = spec.osz[2]
    nvec = cdiv(OW, 16)
    # accumulators: 8 <16 x float> with AVX-512; with AVX2 (two ymm each) half the budget
    # of a GEMM tile, since a depthwise conv also keeps its KH*KW weight splats
    wide = wide_registers()
    acc = 8 if wide else ACC_BUDGET_AVX2 // 2
    if not wide:
        # AVX2: one vector a row (more chunks, unrolled up to UNROLL_CHUNKS), so the step
        # takes up to 3 rows, which share their input rows' loads and each weight's
        # broadcast (16 ymm hold neither 25 weights nor 2 vectors x 3 rows and their
        # inputs). Zen 4 under CANNC_ISA=avx2, depthwise alone, 1 core, two runs:
        # 5x5 stride 2 on 56x56 (144 channels) 266-387 -> 163-171 us, 5x5 on 28x28 (240)
        # 223-302 -> 174-184, 5x5 on 14x14 (672) 202 -> 142-159, 3x3 on 56x56 (144)
        # 143-168 -> 100-110. Stride-2 3x3 windows too, since their taps are taken within
        # lanes (_WindowGen.taps_in_lane; before, each step split its input rows into
        # both phases and rotated them, which more vectors a row amortised): 3x3 stride 2
        # on 112x112 (96) 150 -> 131 us, on 56x56 (144) 78 -> 55, 28x28 level
        V = min(acc, cdiv(nvec, UNROLL_CHUNKS))
        chunks = cdiv(nvec, V)
    elif nvec <= acc:
        V, chunks = nvec, 1
    else:
        V = min(range(max(1, acc // 2), acc + 1), key=lambda v: (rup(nvec, v) - nvec, -v))
        chunks = cdiv(nvec, V)
    rows = spec.rows
    # rows a step: as many as the accumulators allow, or a few fewer where that wastes
    # fewer rows past the plane's last (14 rows: 2 steps of 7, not 8 + 6 of 8)
    rmax = max(1, min(rows, acc // V))
    R = min(range(max(1, rmax // 2 + 1), rmax + 1), key=lambda r: (rup(rows, r), -r))
    # AVX2 depthwise over input rows narrower than a vector (14x14): one output row a
    # step, where every in-place load of the one-vector steps is a vmaskmovps (3x3 at
    # stride 1 from padded rows, pad_rows). Zen 4 under CANNC_ISA=avx2, depthwise alone,
    # 1 core, against two rows a step: 3x3 384 channels 40.0 -> 35.0 us, 576 59.5 -> 51.6
    # (two padded rows 38.0 / 56.4); stride 2 (7x7 out) 3x3 576 60.6 -> 43.7, 5x5 672
    # 114 -> 86 and 210 -> 125. 5x5 at stride 1 keeps two rows (480: 139 -> 150 with
    # one). Three rows were slower wherever they waste one
    if (narrow_rows(spec) and spec.osz[0] == 1 and spec.osz[1] > 1
            and (spec.s[2] == 2 or (spec.s[2] == 1 and spec.k[2] <= 3))):
        R = 1
    planes = spec.N * spec.M
    # enough tiles for the cores to balance, each at least ~2 KFLOP of work
    per_row = OW * spec.KK
    target = max(1, min(8 * cores, (planes * rows * per_row) // 4096))
    if planes >= target:
        RB = rows
    else:
        RB = rup(cdiv(rows, cdiv(target, planes)), R)
    nrb = cdiv(rows, RB)
    plan = WindowPlan(V=V, chunks=chunks, R=R, RB=RB, nrb=nrb, num_tiles=planes * nrb,
                      s2=s2_rows(spec, V))
    if not plan.s2 and pad_rows(spec, plan):
        # row blocks whose copy stays in L1 (PAD_BYTES), R rows at a time
        while RB > R and PaddedRows.of(spec, RB, R, chunks * V * 16).nbytes(spec) > PAD_BYTES:
            RB -= R
        nrb = cdiv(rows, RB)
        pr = PaddedRows.of(spec, RB, R, chunks * V * 16)
        plan = replace(plan, RB=RB, nrb=nrb, num_tiles=planes * nrb, pad=pr,
                       ws_bytes=pr.nbytes(spec))
    return plan


def late_epilogue(spec: WindowSpec, epilogue: Epilogue | None) -> bool:
    """Whether a depthwise kernel applies its epilogue to each row block after storing
    the block's sums (conv.epilogue_in_place, conv.costly_epilogue): planes computed by
    rows into a float32 Y (a flat plane's few vectors stay in registers: a pass of its
    own measured slower there). Zen 4 under CANNC_ISA=avx2, EfficientNet-B0 at 1 core:
    its twelve depthwise Conv+SiLU kernels by rows 2.50 -> 2.09 ms (each as fast as the
    conv and a SiLU kernel apart)."""
    return (spec.kind == "dw" and spec.dts[3] == "float32" and not flat_plane(spec)
            and costly_epilogue(epilogue))


def overlap_last_chunk(spec: WindowSpec, plan: WindowPlan) -> bool:
    """Whether the last of a row's unrolled chunks starts at OW - 16*V, overlapping the one
    before (whose columns it computes and stores again, to the same values), rather than
    past it with its columns beyond OW masked off: with AVX2, where the last chunk's
    columns end inside a ymm half (OW - its start not a multiple of 8). Such a half is
    loaded and stored with vmaskmovps, while a half wholly inside or outside the row takes
    a plain load or store, or none (the masks are constants). Zen 4 under CANNC_ISA=avx2,
    a depthwise 3x3 (+ Clip) alone, 1 core: 28x28 (192 channels) 68.4 -> 52.6 us, 20x20
    (128) 29.5 -> 25.7, 60x60 (64) 82.9 -> 65.7; 5x5 on 28x28 (240) 250 -> 235, 5x5
    stride 2 to 28x28 (144) 219 -> 192. Where the last chunk ends on a ymm boundary it
    measured slower (56x56, 40x40: 120 -> 139 and 28.6 -> 34.5 us: the old chunk's dead
    half costs nothing); with AVX-512 (masked ops at full speed) level."""
    if not OVERLAP_LAST_CHUNK or wide_registers() or plan.chunks < 2 or \
            plan.chunks > UNROLL_CHUNKS:
        return False
    return (spec.osz[2] - (plan.chunks - 1) * plan.V * 16) % 8 != 0


def narrow_rows(spec: WindowSpec) -> bool:
    """An AVX2 depthwise window of one 2-D plane whose input rows are narrower than a
    vector: its one-vector steps load every row under a mask (vmaskmovps)."""
    return (not wide_registers() and spec.kind == "dw" and spec.k[0] == 1
            and spec.isz[2] < 16)


def pad_rows(spec: WindowSpec, plan: WindowPlan) -> bool:
    """Copy the tile's rows padded (PaddedRows) rather than read X in place with masked
    loads: 2-D windows of more than one step per plane with 5 or more taps a row (stride
    1 or 2), or whose steps mostly touch the padding (fewer than half of a plane's steps
    lie inside it: small images, e.g. 14x14). There the masked, mostly line-splitting
    loads (stride 2: two loads and a shuffle a tap) cost more than the arithmetic; with
    3 taps a row and big images the copy does not pay. Zen 4, depthwise convs alone:
    7x7 on 28x28 (192 channels) 0.38-0.48 -> 0.175 ms, on 56x56 (96) 0.57 -> 0.35, 5x5 on
    14x14 (672) 0.18 -> 0.13, 3x3 on 14x14 (384) 0.050 -> 0.028, 5x5 stride 2 on 56x56
    (144) 0.24 -> 0.15; 3x3 on 28x28-112x112 and 3x3 stride 2 10-35% slower padded."""
    if not PAD_ROWS or spec.k[0] != 1 or spec.osz[0] != 1 or spec.s[2] > 2 \
            or spec.osz[1] <= plan.R:
        return False
    if spec.k[2] >= 5:
        return True
    if spec.s[2] == 2:
        return False
    if narrow_rows(spec) and spec.k[2] <= 3:
        return True     # (one row a step, see plan_window: no load of a step is masked)
    OH, sh, dh, ph, H = spec.osz[1], spec.s[1], spec.d[1], spec.pb[1], spec.isz[1]
    steps = cdiv(OH, plan.R)
    inner = sum(1 for r0 in range(0, OH, plan.R)
                if r0 * sh - ph >= 0 and (r0 + plan.R - 1) * sh - ph + (spec.k[1] - 1) * dh < H
                and r0 + plan.R <= OH)
    return 2 * inner < steps


def s2_rows(spec: WindowSpec, V: int) -> bool:
    """Stride-2 2-D windows of float32 X take _WindowGen.step_s2 (read in place, never
    padded): each input row loaded once a step and split into its even and odd columns,
    instead of two loads and a shuffle for every tap of every output row. Zen 4,
    depthwise alone, 1 core: 3x3 on 112x112 (96 channels) 142 -> 104 us, on 28x28 (240)
    38 -> 18; 5x5 on 56x56 (144) 146 -> 97 (it was padded). 5x5 and 7x7 windows of one
    vector a row only where it is more than half used (S2_MIN_COLS: the phase split reads
    32 input columns for 16 outputs): 5x5 to 7x7 outputs (576, 672 channels) 56 -> 64
    and 68 -> 81 us (32 registers of weights and accumulators at 7 rows a step, fewer
    rows slower still), to 8x8 (200) level, but to 9x9 (480) 98 -> 88, 10x10 (160) 35 ->
    29, 14x14 (240) 60-64 -> 49-56, 15x15 (96) 31 -> 26, 16x16 (120) 47 -> 31; 7x7 to
    14x14 (96) 43 -> 35 (in-process A/Bs against the padded rows). With AVX2 (taps taken
    within lanes, taps_in_lane) 5x5 windows of output rows wider than a vector: on 56x56
    (144) 192 -> 144 us; 28x28 (144) 54 -> 73 and 14x14 (672) 92 -> 113 stay padded."""
    return (S2_ROWS and spec.s[2] == 2 and spec.k[0] == 1 and spec.osz[0] == 1
            and spec.dts[0] == "float32"
            and (spec.k[2] < 5 or V >= 2
                 or spec.osz[2] > (S2_MIN_COLS if wide_registers() else 16)))


def _global_array(module: ir.Module, name: str, values: Sequence[float]) -> ir.GlobalVariable:
    ty = ir.ArrayType(F32, len(values))
    gv = ir.GlobalVariable(module, ty, name=name)
    gv.initializer = ir.Constant(ty, [float(np.float32(x)) for x in values])
    gv.global_constant = True
    gv.linkage = "internal"
    gv.align = 64
    return gv


class _WindowGen:
    def __init__(self, module, fn, spec: WindowSpec, plan: WindowPlan, slots: Slots,
                 epilogue: Epilogue | None):
        self.v = VB(module, fn)
        self.m = module
        self.s = spec
        self.p = plan
        self.slots = slots
        self.epilogue = epilogue
        self.late = late_epilogue(spec, epilogue)

    def identity(self):
        if self.s.kind == "max":
            return ir.Constant(VF, [float("-inf")] * 16)
        return self.v.zero_v

    def emit(self):
        v, s, p = self.v, self.s, self.p
        b = v.b
        args, tb, te, ws = v.fn.args
        self.ws = ws
        X = v.arg(args, self.slots.x)
        Y = self.Y = v.arg(args, self.slots.y)
        xdt, wdt, bdt, _ = s.dts
        self.xt, self.yt = elem_type(s.dts[0]), elem_type(s.dts[3])
        Wt = v.arg(args, self.slots.w) if s.kind == "dw" else None
        Bias = v.arg(args, self.slots.b) if (s.kind == "dw" and s.bias) else None
        D, H, W = s.isz
        OD, OH, OW = s.osz
        if s.kind == "avg":
            ncols = p.chunks * p.V * 16
            cols = list(s.count_cols) + [1.0] * (ncols - OW)
            rws = list(s.count_rows) + [1.0] * p.R
            self.cnt_cols = _global_array(self.m, "pool_count_cols", cols)
            self.cnt_rows = _global_array(self.m, "pool_count_rows", rws)
        with v.loop(tb, te, 1, "tile") as t:
            plane, rb = v.divmod_c(t, p.nrb)
            n, co = v.divmod_c(plane, s.M)
            ci = b.udiv(co, i64(s.mult)) if s.mult > 1 else co
            x_p = v.gep(X, b.mul(b.add(b.mul(n, i64(s.C)), ci), i64(s.isz[0] * H * W)), self.xt)
            y_p = v.gep(Y, b.mul(plane, i64(s.rows * OW)), self.yt)
            wts = None
            init = self.identity()
            if Wt is not None:
                wts = [v.splat(sload_dt(v, v.gep(Wt, b.add(b.mul(co, i64(s.KK)), i64(i)),
                                                 elem_type(wdt)), wdt), VF)
                       for i in range(s.KK)]
                if Bias is not None:
                    init = v.splat(sload_dt(v, v.gep(Bias, co, elem_type(bdt)), bdt), VF)
            if p.flat is not None:
                self.flat_tile(x_p, y_p, wts, init)
            else:
                self.row_blocks(x_p, y_p, rb, wts, init)
        b.ret_void()

    def row_blocks(self, x_p, y_p, rb, wts, init):
        """Row block rb of a plane, R rows a step."""
        v, s, p = self.v, self.s, self.p
        b = v.b
        r_lo = b.mul(rb, i64(p.RB))
        r_hi = v.smin(b.add(r_lo, i64(p.RB)), s.rows)
        self.r_lo = r_lo
        if p.padded:
            self.copy_padded(x_p, r_lo)
        with v.loop(r_lo, r_hi, p.R, "rows") as r0:
            inner = self.interior(r0, r_hi)
            if inner is None:
                self.steps(x_p, y_p, r0, r_hi, wts, init, False)
            else:
                with b.if_else(inner, likely=True) as (then, otherwise):
                    with then:
                        self.steps(x_p, y_p, r0, r_hi, wts, init, True)
                    with otherwise:
                        self.steps(x_p, y_p, r0, r_hi, wts, init, False)
        if self.late:     # (the row block's outputs are contiguous in Y)
            base = v.flat_index(y_p, self.Y)
            OW = s.osz[2]
            epilogue_in_place(v, self.Y, self.epilogue, b.add(base, b.mul(r_lo, i64(OW))),
                              b.add(base, b.mul(r_hi, i64(OW))))

    def flat_tile(self, x_p, y_p, wts, init):
        """One plane computed flat (FlatPlane): every tap one (masked) load and FMA a
        vector of output pixels; taps wholly outside the input skipped."""
        v, s, p = self.v, self.s, self.p
        fp = p.flat
        OH, OW = s.osz[1], s.osz[2]
        KH, KW = s.k[1], s.k[2]
        accs = [init] * fp.nv
        for kh in range(KH):
            for kw in range(KW):
                w = wts[kh * KW + kw]
                off = (kh * s.d[1] - s.pb[1]) * s.isz[2] + kw * s.d[2] - s.pb[2]
                for j in range(fp.nv):
                    m = fp.tap_mask(s, kh, kw, j)
                    if not any(m):
                        continue
                    x = v.load_v(v.gep(x_p, 16 * j + off),
                                 None if all(m) else ir.Constant(VM, m))
                    accs[j] = self.combine(accs[j], x, w)
        for j in range(fp.nv):
            self.store_out(accs[j], v.gep(y_p, 16 * j, self.yt), v.lanes_lt(16 * j, OH * OW))

    def store_out(self, val, ptr, m):
        """Store a vector of final values (the epilogue applied, unless late) under mask m."""
        v, s = self.v, self.s
        b = v.b
        if self.epilogue is not None and not self.late:
            flat = v.flat_index(ptr, self.Y, 4 if s.dts[3] == "float32" else 2)
            val = self.epilogue(b, val, flat, 1, m)
            if val.type != VF:
                val = b.fpext(val, VF)
        vstore_dt(v, val, ptr, s.dts[3], m)

    def interior(self, r0, r_hi):
        """i1: rows r0 .. r0+R-1 all lie in the tile and every tap row of theirs inside X
        (2-D windows: od is 0), so their step needs no row tests (None for 3-D windows)."""
        v, s, p = self.v, self.s, self.p
        b = v.b
        if s.k[0] != 1 or s.osz[0] != 1 or not INTERIOR_STEPS or p.padded:
            return None
        H, sh, dh, ph = s.isz[1], s.s[1], s.d[1], s.pb[1]
        top = b.sub(b.mul(r0, i64(sh)), i64(ph))                   # first tap row of r0
        last = b.add(top, i64((p.R - 1) * sh + (s.k[1] - 1) * dh))  # last tap row of r0+R-1
        return b.and_(b.and_(b.icmp_signed(">=", top, i64(0)), b.icmp_signed("<", last, i64(H))),
                      b.icmp_signed("<=", b.add(r0, i64(p.R)), r_hi))

    def copy_padded(self, x_p, r_lo):
        """The tile's input rows into the workspace (PaddedRows), the padding and the
        columns past the row the identity."""
        v, s, p = self.v, self.s, self.p
        b = v.b
        H, W = s.isz[1], s.isz[2]
        sh, ph, sw = s.s[1], s.pb[1], s.s[2]
        pr = p.pad
        ident = self.identity()
        top = b.sub(b.mul(r_lo, i64(sh)), i64(ph))
        with v.loop(0, pr.rows, 1, "prow") as rho:
            ih = b.add(top, rho)
            ok = b.icmp_unsigned("<", ih, i64(H))
            src = v.gep(x_p, b.mul(b.select(ok, ih, i64(0)), i64(W)), self.xt)
            for q in range(sw):
                dst = v.gep(self.ws, b.mul(b.add(b.mul(rho, i64(sw)), i64(q)), i64(pr.row_len)))
                for c0 in range(0, pr.row_len, 16):
                    info = self.col_masks(i64(c0), 0, q - pr.L * sw, sw, W, True)
                    v.store_v(self.load(src, info, ok, sw, ident), v.gep(dst, c0))

    def steps(self, x_p, y_p, r0, r_hi, wts, init, inner):
        v, p = self.v, self.p
        if p.chunks <= UNROLL_CHUNKS:
            for c in range(p.chunks):
                ow0 = c * p.V * 16
                if c == p.chunks - 1 and overlap_last_chunk(self.s, p):
                    ow0 = self.s.osz[2] - p.V * 16
                self.step(x_p, y_p, r0, r_hi, i64(ow0), wts, init, inner)
        else:
            with v.loop(0, p.chunks * p.V * 16, p.V * 16, "chunk") as ow0:
                self.step(x_p, y_p, r0, r_hi, ow0, wts, init, inner)

    def step(self, x_p, y_p, r0, r_hi, ow0, wts, init, inner=False):
        """R rows x V vectors of output starting at row r0, column ow0; ``inner``: the
        rows are whole and their taps inside X (see interior)."""
        if self.p.s2:
            return self.step_s2(x_p, y_p, r0, r_hi, ow0, wts, init, inner)
        v, s, p = self.v, self.s, self.p
        b = v.b
        D, H, W = s.isz
        OD, OH, OW = s.osz
        KD, KH, KW = s.k
        sd, sh, sw = s.s
        dd, dh, dw = s.d
        pd, ph, pw = s.pb
        R, V = p.R, p.V
        const_cols = isinstance(ow0, ir.Constant)
        pr = p.pad
        # per-row data
        rows = []
        for i in range(R):
            rr = b.add(r0, i64(i)) if i else r0
            act = b.icmp_signed("<", rr, r_hi) if i and not inner else None
            od, oh = (i64(0), rr) if inner else v.divmod_c(rr, OH)
            rows.append((rr, act, od, oh))
        # per-(kw, j) column masks / offsets
        colinfo = {}
        for kw in range(KW if not p.padded else 0):
            for j in range(V):
                colinfo[kw, j] = self.col_masks(ow0, j, kw * dw - pw, sw, W, const_cols)
        accs = [[init] * V for _ in range(R)]
        ident = self.identity()
        for kd in range(KD):
            for kh in range(KH):
                for i in range(R):
                    rr, act, od, oh = rows[i]
                    if p.padded:
                        rho = b.add(b.mul(b.sub(rr, self.r_lo), i64(sh)), i64(kh * dh))
                        for kw in range(KW):
                            tap = (kd * KH + kh) * KW + kw
                            a = kw * dw - pw
                            row = v.gep(self.ws, b.add(b.mul(b.add(b.mul(rho, i64(sw)),
                                                                 i64(a % sw)), i64(pr.row_len)),
                                                     b.add(ow0, i64(pr.L + a // sw))))
                            for j in range(V):
                                x = v.load_v(v.gep(row, 16 * j))
                                accs[i][j] = self.combine(accs[i][j], x,
                                                          wts[tap] if wts else None)
                        continue
                    idd = b.add(b.mul(od, i64(sd)), i64(kd * dd - pd))
                    ihh = b.add(b.mul(oh, i64(sh)), i64(kh * dh - ph))
                    if inner:
                        ok = None
                        rowidx = ihh
                    else:
                        ok = b.and_(b.icmp_unsigned("<", idd, i64(D)),
                                    b.icmp_unsigned("<", ihh, i64(H)))
                        if act is not None:
                            ok = b.and_(ok, act)
                        rowidx = b.select(ok, b.add(b.mul(idd, i64(H)), ihh), i64(0))
                    src = v.gep(x_p, b.mul(rowidx, i64(W)), self.xt)
                    for kw in range(KW):
                        tap = (kd * KH + kh) * KW + kw
                        for j in range(V):
                            x = self.load(src, colinfo[kw, j], ok, sw, ident)
                            accs[i][j] = self.combine(accs[i][j], x, wts[tap] if wts else None)
        self.finish(y_p, r0, r_hi, ow0, accs, inner)

    def finish(self, y_p, r0, r_hi, ow0, accs, inner):
        """The step's R x V accumulators finished (averages, norms) and stored."""
        v, s, p = self.v, self.s, self.p
        b = v.b
        OW = s.osz[2]
        const_cols = isinstance(ow0, ir.Constant)
        for i in range(p.R):
            rr = b.add(r0, i64(i)) if i else r0
            act = b.icmp_signed("<", rr, r_hi) if i and not inner else None
            y_row = v.gep(y_p, b.add(b.mul(rr, i64(OW)), ow0), self.yt)
            if s.kind == "avg":
                crow = b.load(v.gep(self.cnt_rows, rr), typ=F32, align=4)
                crow = v.splat(crow, VF)
            for j in range(p.V):
                val = accs[i][j]
                if s.kind == "avg":
                    ccol = b.load(v.gep(self.cnt_cols, b.add(ow0, i64(16 * j))), typ=VF, align=4)
                    val = b.fdiv(val, b.fmul(crow, ccol))
                elif s.kind == "lp" and s.p == 2:
                    val = intrinsic(b, "llvm.sqrt", [val])
                elif s.kind == "lp" and s.p != 1:
                    val = vmath.pow(b, val, ir.Constant(VF, [1.0 / s.p] * 16))
                if const_cols:
                    m = v.lanes_lt(int(ow0.constant) + 16 * j, OW)
                else:
                    m = v.lanes_lt(b.add(ow0, i64(16 * j)), OW)
                m = v.mask_and(m, act)
                self.store_out(val, v.gep(y_row, 16 * j, self.yt), m)

    def step_s2(self, x_p, y_p, r0, r_hi, ow0, wts, init, inner):
        """A step of a stride-2 2-D window (s2_rows): every input row the step's taps
        touch is loaded once, as pairs of vectors split into their even and odd columns
        (the two phases); a tap at column offset a = 2e + q reads phase q shifted by e
        lanes (a lane rotation across neighbouring phase vectors), and each input row
        serves every output row of the step whose window holds it."""
        v, s, p = self.v, self.s, self.p
        b = v.b
        H, W = s.isz[1], s.isz[2]
        KH, KW = s.k[1], s.k[2]
        sh, dh, dw, ph, pw = s.s[1], s.d[1], s.d[2], s.pb[1], s.pb[2]
        R, V = p.R, p.V
        const_cols = isinstance(ow0, ir.Constant)
        ident = self.identity()
        taps = [divmod(kw * dw - pw, 2) for kw in range(KW)]      # (e, q) of each kw
        # phase vectors jj cover output columns ow0 + 16 jj ..: the taps want jj from
        # j + e // 16 to j + e // 16 + 1 (a rotation) for j in 0 .. V-1
        jlo = min(e // 16 for e, _ in taps)
        jhi = V - 1 + max(e // 16 + (1 if e % 16 else 0) for e, _ in taps)
        even = ir.Constant(VI, list(range(0, 32, 2)))
        odd = ir.Constant(VI, list(range(1, 32, 2)))
        top = b.sub(b.mul(r0, i64(sh)), i64(ph))
        accs = [[init] * V for _ in range(R)]
        in_lane = not wide_registers()
        for u in range((R - 1) * sh + (KH - 1) * dh + 1):
            users = [(i, kh) for i in range(R) for kh in range(KH) if i * sh + kh * dh == u]
            if not users:
                continue
            ih = b.add(top, i64(u))
            ok = None if inner else b.icmp_unsigned("<", ih, i64(H))
            src = v.gep(x_p, b.mul(ih if inner else b.select(ok, ih, i64(0)), i64(W)),
                        self.xt)
            if in_lane:
                self.taps_in_lane(src, ok, ow0, taps, users, accs, wts, W, const_cols, ident)
                continue
            phase = {}
            for jj in range(jlo, jhi + 1):
                first, masks = self.col_masks(ow0, jj, 0, 2, W, const_cols)
                masks = [v.mask_and(m, ok) for m in masks]
                x0 = v.mload(v.gep(src, first), masks[0], ident)
                x1 = v.mload(v.gep(src, b.add(first, i64(16))), masks[1], ident)
                phase[0, jj] = b.shuffle_vector(x0, x1, even)
                phase[1, jj] = b.shuffle_vector(x0, x1, odd)
            for kw, (e, q) in enumerate(taps):
                for j in range(V):
                    lo, sft = j + e // 16, e % 16
                    x = phase[q, lo] if not sft else b.shuffle_vector(
                        phase[q, lo], phase[q, lo + 1],
                        ir.Constant(VI, list(range(sft, sft + 16))))
                    for i, kh in users:
                        accs[i][j] = self.combine(accs[i][j], x,
                                                  wts[kh * KW + kw] if wts else None)
        if in_lane:     # (the sums in PHASE_ORDER: back to column order)
            accs = [[b.shuffle_vector(a, a, PHASE_ORDER) for a in row] for row in accs]
        self.finish(y_p, r0, r_hi, ow0, accs, inner)

    def taps_in_lane(self, src, ok, ow0, taps, users, accs, wts, W, const_cols, ident):
        """step_s2 with AVX2 (no lane-crossing two-source shuffle in one instruction): the
        taps of one input row, each phase vector taken within 128-bit lanes (vshufps) from
        two vectors of input loaded at its own offset, so its lanes hold the output
        columns in PHASE_ORDER, as the step's sums do until finish. A tap at column offset
        a = 2e + q reads the pair loaded at input column 2*(ow + e) (one pair per e) and
        takes phase q of it: no rotation across vectors, no split into both phases."""
        v, s, p = self.v, self.s, self.p
        b = v.b
        KW = s.k[2]
        pairs = {}
        for e in sorted({e for e, _ in taps}):
            for j in range(p.V):
                first, masks = self.col_masks(ow0, j, 2 * e, 2, W, const_cols)
                masks = [v.mask_and(m, ok) for m in masks]
                pairs[e, j] = (v.mload(v.gep(src, first), masks[0], ident),
                               v.mload(v.gep(src, b.add(first, i64(16))), masks[1], ident))
        for kw, (e, q) in enumerate(taps):
            for j in range(p.V):
                x0, x1 = pairs[e, j]
                x = b.shuffle_vector(x0, x1, PHASE_LANES[q])
                for i, kh in users:
                    accs[i][j] = self.combine(accs[i][j], x, wts[kh * KW + kw] if wts else None)

    def col_masks(self, ow0, j, off, sw, W, const_cols):
        """(first input column, masks) of vector j for a tap at column offset `off`."""
        v = self.v
        b = v.b
        if const_cols:
            base = int(ow0.constant) + 16 * j
            first = base * sw + off
            if sw == 1:
                m = ir.Constant(VM, [1 if 0 <= first + i < W else 0 for i in range(16)])
                return i64(first), [m]
            if sw == 2:
                m0 = ir.Constant(VM, [1 if 0 <= first + i < W else 0 for i in range(16)])
                m1 = ir.Constant(VM, [1 if 0 <= first + 16 + i < W else 0 for i in range(16)])
                return i64(first), [m0, m1]
            idx = ir.Constant(VI, [first + i * sw for i in range(16)])
            m = ir.Constant(VM, [1 if 0 <= first + i * sw < W else 0 for i in range(16)])
            return idx, [m]
        first = b.add(b.mul(b.add(ow0, i64(16 * j)), i64(sw)), i64(off))
        if sw == 1:
            lanes = b.add(v.splat_i(first), v.iota)
            return first, [b.icmp_unsigned("<", lanes, v.splat_i(W))]
        if sw == 2:
            l0 = b.add(v.splat_i(first), v.iota)
            l1 = b.add(l0, v.splat_i(16))
            return first, [b.icmp_unsigned("<", l0, v.splat_i(W)),
                           b.icmp_unsigned("<", l1, v.splat_i(W))]
        idx = b.add(v.splat_i(first), ir.Constant(VI, [i * sw for i in range(16)]))
        return idx, [b.icmp_unsigned("<", idx, v.splat_i(W))]

    def load(self, src, info, ok, sw, ident):
        v = self.v
        b = v.b
        first, masks = info
        masks = [v.mask_and(m, ok) for m in masks]
        xdt = self.s.dts[0]
        if xdt != "float32":     # narrow X: widened; the masked-off lanes take the identity
            def ml(ptr, m):
                x = vload_dt(v, ptr, xdt, m)
                return x if self.s.kind != "max" else b.select(m, x, ident)
            if sw == 1:
                return ml(v.gep(src, first, self.xt), masks[0])
            if sw == 2:
                x0 = ml(v.gep(src, first, self.xt), masks[0])
                x1 = ml(v.gep(src, b.add(first, i64(16)), self.xt), masks[1])
                return b.shuffle_vector(x0, x1, ir.Constant(VI, list(range(0, 32, 2))))
            x = vgather_dt(v, src, first, masks[0], xdt)
            return x if self.s.kind != "max" else b.select(masks[0], x, ident)
        if sw == 1:
            return v.mload(v.gep(src, first), masks[0], ident)
        if sw == 2:
            x0 = v.mload(v.gep(src, first), masks[0], ident)
            x1 = v.mload(v.gep(src, b.add(first, i64(16))), masks[1], ident)
            return b.shuffle_vector(x0, x1, ir.Constant(VI, list(range(0, 32, 2))))
        return v.gather_idx(src, first, masks[0], ident)

    def combine(self, acc, x, w):
        v = self.v
        b = v.b
        k = self.s.kind
        if k == "dw":
            return v.fma(w, x, acc)
        if k == "max":       # NaN propagates (as ReduceMax, GlobalMaxPool and Max)
            # acc > x ? acc : x is one vmaxps (a NaN x wins); a NaN acc is kept. Cheaper
            # than llvm.maximum, which also orders -0 below +0 (a pool need not: MLAS's
            # vmaxps does not) and expands to ~7 instructions on AVX2
            m = b.select(b.fcmp_ordered(">", acc, x), acc, x)
            return b.select(b.fcmp_unordered("uno", acc, acc), acc, m)
        if k == "avg":
            return b.fadd(acc, x)
        if k == "lp":
            p = self.s.p
            if p == 2:
                return v.fma(x, x, acc)
            a = intrinsic(b, "llvm.fabs", [x])
            if p <= 8:
                y = a
                for _ in range(p - 1):
                    y = b.fmul(y, a)
            else:
                y = vmath.pow(b, a, ir.Constant(VF, [float(p)] * 16))
            return b.fadd(acc, y)
        raise ValueError(k)


_WINDOW_SLOTS = Slots(x=0, w=-1, b=-1, y=1)  # x and y; no weights, no bias


def emit_window(module: ir.Module, name: str, spec: WindowSpec, plan: WindowPlan,
                slots: Slots = _WINDOW_SLOTS,
                epilogue: Epilogue | None = None) -> ir.Function:
    """Emit the window kernel as an ABI function named ``name`` (tiles: plan.num_tiles).
    ``epilogue`` (see codegen.conv.Epilogue) maps the final values (e.g. a fused
    activation) before they are stored."""
    assert spec.kind in KINDS, spec.kind
    fn = abi_function(module, name)
    _WindowGen(module, fn, spec, plan, slots, epilogue).emit()
    return fn


# ---------------------------------------------------------------------------
# average-pool divisors (compile time)
# ---------------------------------------------------------------------------

def avg_counts_1d(size: int, out: int, k: int, s: int, d: int, pb: int, pe: int,
                  include_pad: bool) -> list[int]:
    """Per output index: the number of window taps that count for the average.

    Without count_include_pad: the taps inside the input. With it: the taps
    inside the padded input [-pb, size + pe) (taps beyond it, which ceil_mode
    can create, are not counted)."""
    res = []
    for o in range(out):
        start = o * s - pb
        taps = [start + j * d for j in range(k)]
        if include_pad:
            c = sum(1 for t in taps if -pb <= t < size + pe)
        else:
            c = sum(1 for t in taps if 0 <= t < size)
        res.append(max(c, 1))
    return res
