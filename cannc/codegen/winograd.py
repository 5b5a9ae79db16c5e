"""Winograd convolution F(m x m, 3 x 3) as LLVM IR (3x3, stride 1, dilation 1, group 1, fp32).

Per image the output is cut into ``m x m`` tiles; tile ``p`` (flattened over
``(tile row, tile column)`` of one image) reads an ``a x a`` input patch
(``a = m + 2``) and is computed as ``Y = A^T [U (.) V] A`` with

    U[xi][M, C] = (G w G^T)[xi]     transformed weights, at compile time
    V[xi][C, P] = (B^T d B)[xi]     transformed input patches, per tile block
    Z[xi][P, M] = V[xi]^T U[xi]^T   a batched GEMM, one per frequency xi < a*a

A kernel tile is ``(image, block of PT Winograd tiles of that image, block of CH
output channels)`` (channel block fastest, image slowest). The plan is made for ONE
image (``plan_winograd`` ignores N but for ``num_tiles``): a batch of N runs N times
one image's ``PB*MB`` tiles with the same code (the tile index carries the image, at
a fixed stride), so the kernel serves every batch size (codegen/lower/conv.py conv_tiling).
Per reduction block of ``CB`` input channels it

1. transforms the input, 16 Winograd tiles per vector, into ``V[xi][ci][q]`` in
   the per-core workspace: F(2,3) on images with >= 8 tile columns reads each
   patch row as masked contiguous loads split into even/odd lanes (segments of
   one tile row); otherwise masked gathers; masks are the zero padding;
2. runs one register-blocked GEMM per frequency: a micro-tile of ``MR``
   Winograd tiles x ``16*NV`` output channels (vectors along channels,
   ``U`` packed in ``16*NV``-channel panels, the tile operand broadcast,
   ``llvm.fma.v16f32``), as the swapped orientation of codegen/conv.py;
   partial sums ``Z[xi][q][ch]`` stay in the workspace between blocks;

and then applies the output transform: per Winograd tile and 16 channels the
``a*a`` vectors of ``Z`` give ``m*m`` output vectors (lanes = channels). F(2,3) takes
up to 8 tiles of a tile row at once, whose outputs are 16 consecutive pixels of each
output row, transposes them in registers and stores them along Y's channel planes,
applying the bias and the fused epilogue along pixels (stride 1); F(4,3) applies them
along channels (stride OD*OH*OW) and scatters each vector to Y.

Accuracy (fp32, He-init weights, N(0,1) or post-ReLU activations, C = 64..512,
max |d| / (1e-5 + 1e-4 |ort|), <= 1 passes the conv tests' tolerance): F(2,3) with
the points {0, 1, -1} reaches 0.1-0.25; F(4,3) reaches 1.2-3.2 with {0, +-1, +-2}
and 0.5-1.3 with the best set found, {0, 1, -1, 1/2, -2}. So the lowering uses
F(2,3); F(4,3) is kept for experiments (``tuning={"m": 4}``, gather input transform).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from functools import cache

import llvmlite.ir as ir
import numpy as np

from ..native.emit import F32, I8, i64, mark_vector_code
from ..schedule.machine import l2_bytes, peaks
from .conv import (
    MR_EFFICIENCY,
    MR_EFFICIENCY_AVX2,
    VB,
    VI,
    ConvGeom,
    Epilogue,
    Slots,
    cdiv,
    channel_biases,
    channel_lanes,
    conv_args,
    default_nv,
    dispatch_time,
    distinct_splits,
    rup,
    store_channel_columns,
    swap_kc_avx2,
)
from .plancache import persistent
from .vec import VF, VPTR, abi_function, wide_registers

# interpolation points of F(m, 3) (plus the point at infinity)
POINTS = {2: (0, 1, -1), 4: (0, 1, -1, Fraction(1, 2), -2)}


# ---------------------------------------------------------------------------
# transform matrices (exact, compile time)
# ---------------------------------------------------------------------------

def _solve(rows: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction]:
    """A solution of the consistent (possibly over-determined) system rows x = rhs."""
    n = len(rows[0])
    aug = [list(r) + [v] for r, v in zip(rows, rhs)]
    piv, r = [], 0
    for c in range(n):
        p = next((i for i in range(r, len(aug)) if aug[i][c] != 0), None)
        if p is None:
            continue
        aug[r], aug[p] = aug[p], aug[r]
        aug[r] = [x / aug[r][c] for x in aug[r]]
        for i in range(len(aug)):
            if i != r and aug[i][c] != 0:
                f = aug[i][c]
                aug[i] = [x - f * y for x, y in zip(aug[i], aug[r])]
        piv.append(c)
        r += 1
    assert all(row[-1] == 0 for row in aug[r:]), "inconsistent Winograd system"
    x = [Fraction(0)] * n
    for i, c in enumerate(piv):
        x[c] = aug[i][-1]
    return x


@cache
def matrices(m: int, r: int = 3) -> tuple[tuple, tuple, tuple]:
    """(A^T [m][a], G [a][r], B^T [a][a]) of F(m, r) as Fractions (Toom-Cook: A^T is the
    Vandermonde matrix of the points plus infinity, G is scaled by 1/prod(p_j - p_l), and
    B^T solves sum_j A^T[i][j] G[j][k] B^T[j][l] = [l == i + k])."""
    pts = [Fraction(p) for p in POINTS[m]]
    a = m + r - 1
    AT = [[p ** i for p in pts] + [Fraction(int(i == m - 1))] for i in range(m)]
    G = []
    for j, p in enumerate(pts):
        f = Fraction(1)
        for q in pts[:j] + pts[j + 1:]:
            f *= p - q
        G.append([p ** k / f for k in range(r)])
    G.append([Fraction(int(k == r - 1)) for k in range(r)])
    BT = [[Fraction(0)] * a for _ in range(a)]
    for col in range(a):
        rows = [[AT[i][j] * G[j][k] for j in range(a)] for i in range(m) for k in range(r)]
        rhs = [Fraction(int(col == i + k)) for i in range(m) for k in range(r)]
        for j, x in enumerate(_solve(rows, rhs)):
            BT[j][col] = x
    return (tuple(map(tuple, AT)), tuple(map(tuple, G)), tuple(map(tuple, BT)))


# ---------------------------------------------------------------------------
# geometry and plan
# ---------------------------------------------------------------------------

def eligible(geom: ConvGeom) -> bool:
    """3x3, stride 1, dilation 1, one group, 2-D, not transposed (any batch: the image
    offsets are i64, the lane offsets within one image i32)."""
    return (geom.k == (1, 3, 3) and geom.s == (1, 1, 1) and geom.d == (1, 1, 1) and geom.G == 1
            and not geom.transposed and geom.isz[0] == 1 and geom.osz[0] == 1
            and geom.C * geom.DHW < 2 ** 31 and geom.M * geom.OHW < 2 ** 31 and geom.OHW > 0)


@dataclass(frozen=True)
class WinoPlan:
    m: int           # output tile edge: F(m x m, 3 x 3)
    MR: int          # Winograd tiles per micro-tile (rows)
    NV: int          # <16 x float> channel vectors per micro-tile (NR = 16*NV)
    PT: int          # Winograd tiles per kernel tile
    PB: int          # tile blocks per image
    CH: int          # output channels per kernel tile (multiple of NR)
    MB: int          # channel blocks
    CB: int          # input channels per reduction block
    nkb: int         # reduction blocks
    ws_v: int        # byte offsets in the workspace: V[a*a][CB][PTP]
    ws_z: int        # Z[a*a][PTR][CH]
    ws_bytes: int
    num_tiles: int   # N x tiles_per_image
    cost: float      # modelled time of the slowest core for ONE image (flop units, ~1e11/s)

    @property
    def a(self) -> int:
        return self.m + 2

    @property
    def NR(self) -> int:
        return 16 * self.NV

    @property
    def tiles_per_image(self) -> int:
        """Kernel tiles of one image; tile t is tile t % tiles_per_image of image t // it."""
        return self.PB * self.MB

    @property
    def PTR(self) -> int:
        """rows of Z (and of the GEMM): PT rounded up to MR."""
        return rup(self.PT, self.MR)

    @property
    def PTP(self) -> int:
        """row stride of V: whole vectors, at least PTR."""
        return rup(self.PTR, 16)

    # frequency strides of V and Z (floats), off multiples of 4 KiB so that the a*a
    # vectors of one tile do not collide in the same L1 sets
    @property
    def VXS(self) -> int:
        return self.CB * self.PTP + 16

    @property
    def ZXS(self) -> int:
        return self.PTR * self.CH + 16


def tiles(geom: ConvGeom, m: int) -> tuple[int, int, int]:
    """(tile rows, tile columns, Winograd tiles of one image)."""
    TH, TW = cdiv(geom.osz[1], m), cdiv(geom.osz[2], m)
    return TH, TW, TH * TW


# cost model, flop units (~100 GFLOP/s core: 1 cycle ~ 30), measured roughly on Zen 4
# while the micro-tiles of a point's weight panel (C x NR) run, they prefetch the panel
# the loops visit next into L2, a line a k step (see _WinoGen.gemms). Each panel is read
# by the few micro-tiles of one tile block (ResNet-50 at 14x14: 49 Winograd tiles, 7
# micro-tiles), so without it the first of them waits on memory for every weight line
PREFETCH_U = True
GEMM_EFF = 0.9           # micro-kernel speed relative to conv.py's direct GEMM
GATHER_COST = 300.0      # one 16-lane masked gather (input transform)
SCATTER_COST = 400.0     # one 16-lane scatter (output)
# AVX2 has no scatter (16 extracts and scalar stores: conv.py measured it ~5x dearer on
# Zen 3) and its gathers are two ymm gathers
SCATTER_COST_AVX2 = 5 * SCATTER_COST
GATHER_COST_AVX2 = 2 * GATHER_COST
# F(2,3) writes its outputs by 16 x 16 transposes (output_transform_rows), not scatters:
# with AVX2 they took 1.8x AVX-512's time (Zen 4, 64->64 at 56x56, the output transform
# patched out: 146 against 82 us). Charged as 5 scatters, the 3x3 convs of 512 channels
# at 7x7 (ResNet-18's, -50's) took the implicit GEMM, which ran them 1.36x slower alone
# (Zen 4 under CANNC_ISA=avx2: 2.49 ms, Winograd 1.84)
OUT_ROWS_COST_AVX2 = 2 * SCATTER_COST
VOP_COST = 30.0          # one vector add / fma / load / store
TILE_COST = 3000.0       # per kernel tile
# workspace per core (V + Z) at most the core's L2 (Zen 4, 1 MiB: workspaces of 914-962
# KiB, over the 768 KiB this was, ran 7-15% faster: 256->256 at 14x14 in one channel block
# instead of two, 64->64 at 28x28 in two pixel blocks instead of five)
WS_L2_SHARE = 1.0
ROWS_MIN_TW = 8          # F(2,3) input transform from contiguous rows from this many tile
                         # columns (fewer: too many idle lanes, masked gathers are faster)

BATCH_REF = 8            # plan_winograd scores a plan at one image and at this batch
FORCE_TUNING: dict = {}  # overrides for plan_winograd (tests, experiments)


def plan_winograd(geom: ConvGeom, cores: int = 2, tuning: dict | None = None) -> WinoPlan:
    """Tile sizes and the kernel-tile grid of ONE image, by a cost model of the two-core
    split of that image (so the plan, but for ``num_tiles = N x tiles_per_image``, does not
    depend on the batch). ``tuning`` overrides: m, MR, NV, PT, CH, CB."""
    tun = dict(FORCE_TUNING if tuning is None else tuning)
    if not tun:     # a pure function of the geometry: kept across processes
        return _plan_winograd_default(geom, cores)
    return _plan_winograd(geom, cores, tun)


@persistent("plan_winograd")
def _plan_winograd_default(geom: ConvGeom, cores: int) -> WinoPlan:
    return _plan_winograd(geom, cores, {})


def _plan_winograd(geom: ConvGeom, cores: int, tun: dict) -> WinoPlan:
    m = tun.get("m", 2)
    a = m + 2
    M, C = geom.M, geom.C
    _, _, P = tiles(geom, m)
    wide = wide_registers()
    NV = tun.get("NV", default_nv(M, wide))
    NR = 16 * NV
    # reduction blocks: AVX2's point GEMMs broadcast from V as the swapped conv does from
    # X, and keep their blocks to half of L1 likewise (conv.swap_kc_avx2). Zen 4 under
    # CANNC_ISA=avx2, plans otherwise equal: 256->256 at 14x14 CB 256 -> 128 1165 -> 1110
    # us, 512->512 at 7x7 1557 -> 1527; ResNet-18 / -50 x0.99 (quiet guest)
    nkb = cdiv(C, tun.get("CB", 256 if wide else min(256, swap_kc_avx2(NR))))
    CB = cdiv(C, nkb)
    best = None
    mrs = [tun["MR"]] if "MR" in tun else ([8, 7, 6, 5] if wide else [6, 5, 4])
    gather = GATHER_COST if wide else GATHER_COST_AVX2
    scatter = SCATTER_COST if wide else OUT_ROWS_COST_AVX2 if m == 2 else SCATTER_COST_AVX2
    ws_max = int(WS_L2_SHARE * l2_bytes())
    for MR in mrs:
        # (fewer rows a micro-tile run slower, as in the conv planner's MR_EFFICIENCY)
        mr_eff = (MR_EFFICIENCY if wide else MR_EFFICIENCY_AVX2).get(MR, 1.0)
        # fixed block sizes, and the image's P tiles cut into k even blocks (49 tiles of a
        # 14x14 image: 25 + 24 rather than 24 + 24 + 1)
        pts = [tun["PT"]] if "PT" in tun else sorted(
            {16, 24, 32, 48, 64, 96, 128} | {rup(cdiv(P, k), MR) for k in range(1, 9)})
        for PT0 in pts:
            PT = min(PT0, rup(P, MR)) if "PT" not in tun else PT0
            PB = cdiv(P, PT)
            PTR = rup(PT, MR)
            PTP = rup(PTR, 16)
            splits = distinct_splits(cdiv(M, NR))
            if "CH" in tun:
                # (whole NR-channel panels: a forced CH below NR once made CH 0, a kernel
                # that wrote nothing)
                pan = max(1, cdiv(tun["CH"], NR))
                splits = [(cdiv(M, pan * NR), pan)]
            for MB, pan in splits:
                CH = pan * NR
                ws_v = 0
                ws_z = rup(a * a * (CB * PTP + 16) * 4, 64)
                ws = rup(ws_z + a * a * (PTR * CH + 16) * 4, 64)
                if ws > ws_max and not tun:
                    continue

                def tile_cost(ch: int, npix: int, MR: int = MR, mr_eff: float = mr_eff) -> float:
                    g = 2.0 * a * a * rup(ch, NR) * rup(npix, MR) * C / GEMM_EFF / mr_eff
                    nv = cdiv(npix, 16)
                    vin = C * nv * (a * a * gather + 3 * a * a * VOP_COST)
                    vout = npix * cdiv(ch, 16) * (m * m * scatter + 3 * a * a * VOP_COST)
                    zio = a * a * cdiv(npix, MR) * cdiv(ch, NR) * MR * NV * 2 * VOP_COST * nkb
                    return g + vin + vout + zio + 4.0 * a * a * ch * C + TILE_COST

                per = PB * MB
                pre = [0.0]
                for t in range(per):
                    mb, pb = t % MB, t // MB
                    ch = min(M, (mb + 1) * CH) - mb * CH
                    npix = min(P, (pb + 1) * PT) - pb * PT
                    pre.append(pre[-1] + tile_cost(ch, npix))
                T = per
                cost = dispatch_time(T, cores, lambda t0, t1, pre=pre: pre[t1] - pre[t0])

                def batch_cost(t0: int, t1: int, pre: list = pre, per: int = per) -> float:
                    return ((t1 // per - t0 // per) * pre[per] + pre[t1 % per]
                            - pre[t0 % per])
                # scored at one image and per image of a batch of BATCH_REF (a plan for
                # every batch: one image wants tiles for both cores, a batch fewer
                # repeated input transforms, i.e. fewer channel blocks)
                score = cost + dispatch_time(BATCH_REF * per, cores, batch_cost) / BATCH_REF
                if best is None or score < best[0] * 0.995:
                    best = (score, WinoPlan(m=m, MR=MR, NV=NV, PT=PT, PB=PB, CH=CH, MB=MB, CB=CB,
                                           nkb=nkb, ws_v=ws_v, ws_z=ws_z, ws_bytes=ws,
                                           num_tiles=geom.N * T, cost=cost))
    assert best is not None, "no Winograd plan fits the workspace"
    return best[1]


def winograd_gemm_flops(geom: ConvGeom, plan: WinoPlan) -> int:
    """Multiply-adds x 2 of the batched GEMMs (what the kernel really multiplies)."""
    _, _, P = tiles(geom, plan.m)
    return 2 * plan.a * plan.a * geom.N * P * geom.M * geom.C


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------

def pack_winograd_weights(geom: ConvGeom, plan: WinoPlan, w: np.ndarray) -> np.ndarray:
    """U = G w G^T (float64, then float32) packed as [a*a][ceil(M/NR)][C][NR], zero padded."""
    _, G, _ = matrices(plan.m)
    Gf = np.array(G, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64).reshape(geom.M, geom.C, 3, 3)
    # G w G^T for every (m, c) as two large products (a plain three-operand einsum took
    # 0.3 s of a warm ResNet-18 compile, batched 3x3 matmuls 0.25 s)
    t = np.tensordot(Gf, w.reshape(geom.M * geom.C, 3, 3), axes=([1], [1]))  # [a, MC, 3]
    u = np.tensordot(t, Gf, axes=([2], [1]))                                  # [a, MC, a]
    u = u.transpose(0, 2, 1).reshape(plan.a * plan.a, geom.M, geom.C)
    NR = plan.NR
    Mp = rup(geom.M, NR)
    out = np.zeros((plan.a * plan.a, Mp, geom.C), dtype=np.float32)
    out[:, :geom.M] = u
    out = out.reshape(plan.a * plan.a, Mp // NR, NR, geom.C).transpose(0, 1, 3, 2)
    return np.ascontiguousarray(out).reshape(-1)


# ---------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------

class _WinoGen:
    def __init__(self, module: ir.Module, fn: ir.Function, geom: ConvGeom, plan: WinoPlan,
                 slots: Slots, epilogue: Epilogue | None) -> None:
        self.v = VB(module, fn)
        self.g, self.p, self.slots, self.epilogue = geom, plan, slots, epilogue
        self.AT, _, self.BT = matrices(plan.m)
        self.TH, self.TW, self.P = tiles(geom, plan.m)

    # -- constant matrix x list of vectors -------------------------------------
    def combine(self, coefs, xs):
        """sum_c coefs[c] * xs[c] with adds/subs for +-1 and fmas otherwise."""
        v = self.v
        b = v.b
        acc = None
        for c, x in zip(coefs, xs):
            if c == 0:
                continue
            if acc is None:
                if c == 1:
                    acc = x
                elif c == -1:
                    acc = b.fneg(x)
                else:
                    acc = b.fmul(v.splat_f(float(c)), x)
            elif c == 1:
                acc = b.fadd(acc, x)
            elif c == -1:
                acc = b.fsub(acc, x)
            else:
                acc = v.fma(v.splat_f(float(c)), x, acc)
        return acc if acc is not None else v.zero_v

    def transform2d(self, T, d):
        """T d T^T for a square grid d of vectors (T: rows x len(d))."""
        n = len(d)
        rows = [[self.combine(T[k], [d[i][j] for i in range(n)]) for j in range(n)]
                for k in range(len(T))]
        return [[self.combine(T[l], rows[k]) for l in range(len(T))] for k in range(len(T))]

    # -- top level --------------------------------------------------------------
    def emit(self) -> None:
        v, g, p = self.v, self.g, self.p
        b = v.b
        args, tb, te, ws = v.fn.args
        self.X, self.U, self.Bias, self.Y = conv_args(v, args, self.slots, g.bias)
        self.V = b.gep(ws, [i64(p.ws_v)], source_etype=I8)
        self.Z = b.gep(ws, [i64(p.ws_z)], source_etype=I8)
        _, H, W = g.isz
        with v.loop(tb, te, 1, "tile") as t:
            img, t1 = v.divmod_c(t, p.tiles_per_image)
            pb, mb = v.divmod_c(t1, p.MB)
            # this image's input, and the flat offset of its output (i64: any batch)
            self.Xi = v.gep(self.X, b.mul(img, i64(g.C * H * W)))
            self.y_img = b.mul(img, i64(g.M * g.OHW))
            q0 = b.mul(pb, i64(p.PT))
            npix = b.sub(v.smin(b.add(q0, i64(p.PT)), self.P), q0)
            m_lo = b.mul(mb, i64(p.CH))
            m_hi = v.smin(b.add(m_lo, i64(p.CH)), g.M)

            def block(kb, first, last):
                c0 = b.mul(kb, i64(p.CB)) if p.nkb > 1 else i64(0)
                cb = v.smin(b.sub(i64(g.C), c0), p.CB) if p.nkb > 1 else i64(g.C)
                self.input_transform(q0, npix, c0, cb)
                self.gemms(npix, c0, cb, m_lo, m_hi, first)

            if p.nkb == 1:
                block(None, True, True)
            else:
                with v.loop(0, p.nkb, 1, "kb") as kb:
                    block(kb, b.icmp_signed("==", kb, i64(0)), None)
            if p.m == 2:
                self.output_transform_rows(q0, npix, m_lo, m_hi)
            else:
                self.output_transform(q0, npix, m_lo, m_hi)
        b.ret_void()

    # -- 1. input transform -----------------------------------------------------
    def input_transform(self, q0, npix, c0, cb):
        """V[xi][ci][q] = (B^T d B)[xi] of the patch of tile q0 + q, channel c0 + ci."""
        if self.p.m == 2 and self.TW >= ROWS_MIN_TW:
            return self.input_transform_rows(q0, npix, c0, cb)
        return self.input_transform_gather(q0, npix, c0, cb)

    def input_transform_rows(self, q0, npix, c0, cb):
        """F(2,3): per tile row of the block, segments of <= 16 tiles; patch column j of
        lane i is input column iw0 + 2*(i + j//2) + j%2, so each patch row is two pairs of
        masked contiguous loads and an even/odd lane shuffle (no gathers)."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        a = p.a
        _, H, W = g.isz
        HW = H * W
        TW = self.TW
        even = ir.Constant(VI, list(range(0, 32, 2)))
        odd = ir.Constant(VI, list(range(1, 32, 2)))
        t1 = b.add(q0, npix)
        with v.loop(b.udiv(q0, i64(TW)), b.add(b.udiv(b.sub(t1, i64(1)), i64(TW)), i64(1)), 1,
                    "trow") as r:
            th = r
            rs = b.mul(r, i64(TW))
            tw_lo = b.sub(v.smax(q0, rs), rs)
            tw_hi = b.sub(v.smin(t1, b.add(rs, i64(TW))), rs)
            ih0 = b.sub(b.mul(th, i64(2)), i64(g.pb[1]))
            x_n = v.gep(self.Xi, b.mul(c0, i64(HW)))
            with v.loop(tw_lo, tw_hi, 16, "tseg") as tw0:
                st_mask = v.lanes_lt(i64(0), b.sub(tw_hi, tw0))
                iw0 = b.sub(b.mul(tw0, i64(2)), i64(g.pb[2]))
                # masks[i][s][h]: lanes of the load at column iw0 + 2s + 16h of patch row i
                colm = [[b.icmp_unsigned("<", b.add(v.splat_i(b.add(iw0, i64(2 * s + 16 * h))),
                                                    v.iota), v.splat_i(W))
                         for h in range(2)] for s in range(2)]
                rows = []
                for i in range(a):
                    ih = b.add(ih0, i64(i))
                    ok = b.icmp_unsigned("<", ih, i64(H))
                    rows.append((b.mul(b.select(ok, ih, i64(0)), i64(W)),
                                 [[v.mask_and(colm[s][h], ok) for h in range(2)]
                                  for s in range(2)]))
                q_loc = b.sub(b.add(rs, tw0), q0)
                v_q = v.gep(self.V, q_loc)

                def channels(st_mask):
                    with v.loop(i64(0), cb, 1, "ci") as ci:
                        xc = v.gep(x_n, b.add(b.mul(ci, i64(HW)), iw0))
                        d = []
                        for roff, mk in rows:
                            xr = v.gep(xc, roff)
                            drow = []
                            for s in range(2):
                                lo = v.mload(v.gep(xr, 2 * s), mk[s][0])
                                hi = v.mload(v.gep(xr, 2 * s + 16), mk[s][1])
                                drow += [b.shuffle_vector(lo, hi, even),
                                         b.shuffle_vector(lo, hi, odd)]
                            d.append(drow)
                        t = self.transform2d(self.BT, d)
                        vc = v.gep(v_q, b.mul(ci, i64(p.PTP)))
                        for k in range(a):
                            for l in range(a):
                                v.store_v(t[k][l], v.gep(vc, (k * a + l) * p.VXS), st_mask)

                if wide_registers():
                    channels(st_mask)
                else:
                    # AVX2 has no cheap masked store (vmaskmovps): a segment shorter than
                    # 16 tiles writes whole vectors where they stay inside this channel's
                    # row of V (PTP). The lanes past the segment land on tiles whose
                    # values later segments write (these run in tile order, all channels
                    # each) or that the GEMM's rows past npix ignore. Zen 4 under
                    # CANNC_ISA=avx2, 64 -> 64 channels on 56x56 (28 tiles a row: 16 + 12):
                    # 1436 -> 1232-1350 us
                    inside = b.icmp_signed("<=", b.add(q_loc, i64(16)), i64(p.PTP))
                    with b.if_else(inside, likely=True) as (then, otherwise):
                        with then:
                            channels(None)
                        with otherwise:
                            channels(st_mask)

    def input_transform_gather(self, q0, npix, c0, cb):
        """Any m: 16 consecutive tiles per vector, the patch read with masked gathers."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        a, m = p.a, p.m
        _, H, W = g.isz
        HW = H * W
        with v.loop(i64(0), npix, 16, "vq") as q:
            lane_ok = v.lanes_lt(q, npix)
            tile = b.add(v.splat_i(b.add(q0, q)), v.iota)
            tw = b.urem(tile, v.splat_i(self.TW))
            th = b.udiv(tile, v.splat_i(self.TW))
            ih0 = b.sub(b.mul(th, v.splat_i(m)), v.splat_i(g.pb[1]))
            iw0 = b.sub(b.mul(tw, v.splat_i(m)), v.splat_i(g.pb[2]))
            rowok = [b.and_(lane_ok, b.icmp_unsigned("<", b.add(ih0, v.splat_i(i)), v.splat_i(H)))
                     for i in range(a)]
            colok = [b.icmp_unsigned("<", b.add(iw0, v.splat_i(j)), v.splat_i(W))
                     for j in range(a)]
            base = b.add(b.mul(ih0, v.splat_i(W)), iw0)
            x0 = v.gep(self.Xi, b.mul(c0, i64(HW)))
            v_q = v.gep(self.V, q)
            with v.loop(i64(0), cb, 1, "ci") as ci:
                xc = v.gep(x0, b.mul(ci, i64(HW)))
                d = [[v.gather_idx(xc, b.add(base, v.splat_i(i * W + j)),
                                   b.and_(rowok[i], colok[j]))
                      for j in range(a)] for i in range(a)]
                t = self.transform2d(self.BT, d)
                vc = v.gep(v_q, b.mul(ci, i64(p.PTP)))
                for k in range(a):
                    for l in range(a):
                        v.store_v(t[k][l], v.gep(vc, (k * a + l) * p.VXS))

    # -- 2. the batched GEMMs -----------------------------------------------------
    def gemms(self, npix, c0, cb, m_lo, m_hi, first):
        """Z[xi][q][ch - m_lo] (+)= sum_ci V[xi][ci][q] U[xi][ch][c0 + ci]."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        a2 = p.a * p.a
        npan = cdiv(g.M, p.NR)
        with v.loop(0, a2, 1, "xi") as xi:
            v_xi = v.gep(self.V, b.mul(xi, i64(p.VXS)))
            z_xi = v.gep(self.Z, b.mul(xi, i64(p.ZXS)))
            u_xi = v.gep(self.U, b.add(b.mul(xi, i64(npan * g.C * p.NR)), b.mul(c0, i64(p.NR))))
            with v.loop(m_lo, m_hi, p.NR, "jr") as jr:
                nch = v.smin(b.sub(m_hi, jr), p.NR)
                chmask = [v.lanes_lt(16 * j, nch) for j in range(p.NV)]
                u_pan = v.gep(u_xi, b.mul(b.udiv(jr, i64(p.NR)), i64(g.C * p.NR)))
                z_jr = v.gep(z_xi, b.sub(jr, m_lo))
                nxt = None
                if PREFETCH_U:
                    # the panel the loops visit next: this point's next channels, else
                    # the next point's first (past the last point's: prefetches do not
                    # fault)
                    nxt = b.select(b.icmp_signed("<", b.add(jr, i64(p.NR)), m_hi),
                                   v.gep(u_pan, g.C * p.NR),
                                   v.gep(u_xi, b.add(i64(npan * g.C * p.NR),
                                                     b.mul(b.udiv(m_lo, i64(p.NR)),
                                                           i64(g.C * p.NR)))))
                with v.loop(i64(0), npix, p.MR, "ir") as ir_:
                    npx = v.smin(b.sub(npix, ir_), p.MR)
                    rows = [True] + [b.icmp_signed("<", i64(r), npx) for r in range(1, p.MR)]
                    masks = [[v.mask_and(chmask[j], rows[r]) for j in range(p.NV)]
                             for r in range(p.MR)]
                    zrow = [v.gep(z_jr, b.mul(b.add(ir_, i64(r)), i64(p.CH))) for r in range(p.MR)]
                    # micro-tile i streams line (i / MR) % NV of each of its k rows
                    pf = None if nxt is None else v.gep(nxt, b.mul(
                        b.urem(b.udiv(ir_, i64(p.MR)), i64(p.NV)), i64(16)))
                    self.micro(v.gep(v_xi, ir_), u_pan, cb, zrow, masks, first, pf)

    def micro(self, a_ptr, b_ptr, kc, zrow, masks, first, pf=None):
        """acc[r][j] = sum_k a[k*PTP + r] * b[k*NR + 16j] + (first ? 0 : Z); stored to Z.
        ``pf``: a prefetch stream, one line into L2 a k step, NR floats apart."""
        v, p = self.v, self.p
        b = v.b
        MR, NV, a_ks, b_ks = p.MR, p.NV, p.PTP, p.NR
        accs = [[v.zero_v] * NV for _ in range(MR)]
        ptrs0 = [a_ptr, b_ptr] + ([pf] if pf is not None else [])

        def step(cur, ap, bp, u):
            bv = [v.load_v(v.gep(bp, u * b_ks + 16 * j)) for j in range(NV)]
            new = []
            for r in range(MR):
                xs = v.splat(b.load(v.gep(ap, u * a_ks + r), typ=F32, align=4), VF)
                new.append([v.fma(xs, bv[j], cur[r][j]) for j in range(NV)])
            return new

        def kloop(k0, kend, accs, ptrs, nstep, tag):
            def body(k, cur, ptrs):
                for u in range(nstep):
                    cur = step(cur, ptrs[0], ptrs[1], u)
                    if len(ptrs) > 2:
                        v.prefetch_r(v.gep(ptrs[2], u * b_ks), locality=2)
                return cur, [v.gep(q, nstep * ks) for q, ks in zip(ptrs, (a_ks, b_ks, b_ks))]
            return v.grid_loop(k0, kend, nstep, accs, ptrs, body, tag, iv_name="k")

        U = 2 if MR * NV > 8 else 4
        kmain = b.sub(kc, b.srem(kc, i64(U)))
        k, accs, ptrs = kloop(i64(0), kmain, accs, ptrs0, U, "ku")
        _, accs, _ = kloop(k, kc, accs, ptrs, 1, "kr")
        accs = v.add_partials(accs, first, zrow, masks)
        for r in range(MR):
            for j in range(NV):
                v.mstore(accs[r][j], v.gep(zrow[r], 16 * j), masks[r][j])

    # -- 3. output transform, bias, epilogue, store ---------------------------------
    def output_transform_rows(self, q0, npix, m_lo, m_hi):
        """F(2,3): per 16 channels and tile row of the block, segments of SEG = min(8, TW)
        tiles, whose outputs are, per output row, 2*SEG consecutive pixels. Their 16-channel
        vectors (lanes = channels) are transposed 16 x 16 in registers and stored along the
        pixels of each channel plane; bias and epilogue run along pixels (stride 1). (The
        per-tile 16-lane scatters this replaces cost ResNet-18 up to 5% at batch 8.)"""
        v, g, p = self.v, self.g, self.p
        b = v.b
        a, m = p.a, p.m
        _, OH, OW = g.osz
        OHW = OH * OW
        TW = self.TW
        SEG = min(8, TW)
        t1 = b.add(q0, npix)
        with v.loop(m_lo, m_hi, 16, "oc") as ch:
            chok = channel_lanes(v, ch, m_hi)
            biases = channel_biases(v, self.Bias, ch, chok)
            zc = v.gep(self.Z, b.sub(ch, m_lo))
            y_ch = b.add(self.y_img, b.mul(ch, i64(OHW)))
            with v.loop(b.udiv(q0, i64(TW)), b.add(b.udiv(b.sub(t1, i64(1)), i64(TW)), i64(1)),
                        1, "otrow") as r:
                rs = b.mul(r, i64(TW))
                tw_lo = b.sub(v.smax(q0, rs), rs)
                tw_hi = b.sub(v.smin(t1, b.add(rs, i64(TW))), rs)
                with v.loop(tw_lo, tw_hi, SEG, "otseg") as tw0:
                    nt = v.smin(b.sub(tw_hi, tw0), SEG)
                    q_loc = b.sub(b.add(rs, tw0), q0)    # the segment's first tile in Z
                    outs = []
                    for t in range(SEG):
                        # tiles past the segment's end read its first tile's sums (inside Z)
                        qt = b.select(b.icmp_signed("<", i64(t), nt), b.add(q_loc, i64(t)),
                                      q_loc) if t else q_loc
                        z_q = v.gep(zc, b.mul(qt, i64(p.CH)))
                        zv = [[v.load_v(v.gep(z_q, (k * a + l) * p.ZXS)) for l in range(a)]
                              for k in range(a)]
                        outs.append(self.transform2d(self.AT, zv))
                    ow0 = b.mul(tw0, i64(m))
                    pxmask = v.lanes_lt(0, v.smin(b.sub(i64(OW), ow0), b.mul(nt, i64(m))))
                    for i in range(m):
                        oh = b.add(b.mul(r, i64(m)), i64(i))
                        rmask = pxmask
                        if OH % m and i:
                            rmask = v.mask_and(pxmask, b.icmp_signed("<", oh, i64(OH)))
                        px = [outs[t][i][j] for t in range(SEG) for j in range(m)]
                        cols = v.transpose16(px + [v.zero_v] * (16 - len(px)))
                        off0 = b.add(y_ch, b.add(b.mul(oh, i64(OW)), ow0))
                        store_channel_columns(v, self.Y, cols, biases, off0, OHW, rmask,
                                              chok, self.epilogue)

    def output_transform(self, q0, npix, m_lo, m_hi):
        """Any m: per Winograd tile and 16 channels, its m*m output vectors (lanes =
        channels) scattered to Y."""
        v, g, p = self.v, self.g, self.p
        b = v.b
        a, m = p.a, p.m
        _, OH, OW = g.osz
        OHW = OH * OW
        lane_off = ir.Constant(VI, [i * OHW for i in range(16)])
        with v.loop(i64(0), npix, 1, "oq") as q:
            tile = b.add(q0, q)
            th, tw = v.divmod_c(tile, self.TW)
            oh0 = b.mul(th, i64(m))
            ow0 = b.mul(tw, i64(m))
            z_q = v.gep(self.Z, b.mul(q, i64(p.CH)))
            pix_ok = {}
            for i in range(m):
                for j in range(m):
                    conds = []
                    if OH % m and i:
                        conds.append(b.icmp_signed("<", b.add(oh0, i64(i)), i64(OH)))
                    if OW % m and j:
                        conds.append(b.icmp_signed("<", b.add(ow0, i64(j)), i64(OW)))
                    c = conds[0] if conds else True
                    if len(conds) == 2:
                        c = b.and_(conds[0], conds[1])
                    pix_ok[i, j] = c
            y_pix = b.add(b.mul(oh0, i64(OW)), ow0)
            with v.loop(m_lo, m_hi, 16, "oc") as ch:
                chmask = v.lanes_lt(ch, m_hi)
                zc = v.gep(z_q, b.sub(ch, m_lo))
                zv = [[v.load_v(v.gep(zc, (k * a + l) * p.ZXS)) for l in range(a)]
                      for k in range(a)]
                out = self.transform2d(self.AT, zv)
                bias = v.mload(v.gep(self.Bias, ch), chmask) if self.Bias is not None else None
                off0 = b.add(b.add(self.y_img, b.mul(ch, i64(OHW))), y_pix)
                for i in range(m):
                    for j in range(m):
                        val = out[i][j]
                        if bias is not None:
                            val = b.fadd(val, bias)
                        mask = v.mask_and(chmask, pix_ok[i, j])
                        off = b.add(off0, i64(i * OW + j))
                        if self.epilogue is not None:
                            val = self.epilogue(b, val, off, OHW, mask)
                        ptrs = b.gep(v.gep(self.Y, off), [lane_off], source_etype=F32)
                        ptrs.type = VPTR
                        v.scatter(val, ptrs, mask)


_DEFAULT_SLOTS = Slots()


def emit_winograd(module: ir.Module, name: str, geom: ConvGeom, plan: WinoPlan,
                  slots: Slots = _DEFAULT_SLOTS, epilogue: Epilogue | None = None) -> ir.Function:
    """Emit the Winograd convolution as an ABI kernel ``name``; the weight argument holds
    ``pack_winograd_weights(geom, plan, W)``. Tiles: ``plan.num_tiles``; workspace:
    ``plan.ws_bytes`` per core."""
    assert eligible(geom), geom
    fn = abi_function(module, name)
    _WinoGen(module, fn, geom, plan, slots, epilogue).emit()
    mark_vector_code(module)
    return fn


# ---------------------------------------------------------------------------
# path selection
# ---------------------------------------------------------------------------

DIRECT_EFF = 0.95        # conv.py's implicit GEMM runs at ~95 GFLOP/s on these layers
# the modelled speed-up that Winograd must show to be chosen, and the flops per image
# below which it is not tried. The model underrates Winograd where the images are small
# (Sapphire Rapids guest, each conv alone, 1 core, the implicit GEMM against Winograd:
# 512 channels at 7x7 1.40 -> 0.96 ms, modelled x1.06; 128->32 at 14x14 (DenseNet-121's
# 24 of block 3, 14.5 MFLOP) 0.090 -> 0.054 ms, modelled x1.36). In models, where the
# weights come from memory, the 7x7 512s ran x1.07 (ResNet-50, 1 and 2 cores) to x1.26
# (ResNet-18, 2 cores) faster; 128->32 at 7x7 (3.6 MFLOP) level. Zen 4 had set 1.1 and
# 20 MFLOP before either path prefetched its weights (PREFETCH_U, conv.SWAP_PREFETCH).
# From 4.7 MFLOP it wins (Zen 4 guest, the zoo ResNet at 64x64, whose 32->32 at 16x16 and
# 64->64 at 8x8 the model chooses: alone 0.045 -> 0.030 and 0.043 -> 0.039 ms, 1 core;
# whole model, benchmarks/ab.py against 10 MFLOP: batch 1 x0.94 / x0.88 on 1 / 2 cores,
# batch 8 x0.92 / x0.80)
MIN_GAIN = 1.03
MIN_FLOPS = 4_000_000
# the implicit GEMM's share of the measured FMA peak (Zen 4: ~95 of 117 GFLOP/s; Sapphire
# Rapids: ~190 of 200-230), to put its modelled time beside the weights' memory time
DIRECT_PEAK_SHARE = 0.81


def weight_stream_s(nbytes: int) -> float:
    """Seconds to stream a kernel's weights from memory, once a call (every image of a
    batch reuses them): weights beyond a core's L2 do not stay cached between calls in a
    model whose weights add up to more than the caches (ResNet-50: 100 MB); smaller
    ones are taken as cached."""
    if nbytes <= l2_bytes():
        return 0.0
    return nbytes / (peaks()["mem_gbps"] * 1e9)


def choose(geom: ConvGeom, mode: str = "auto", cores: int = 2,
           batch: int | None = None) -> WinoPlan | None:
    """The Winograd plan to use for ``geom`` (constant weights), or None for the implicit
    GEMM. ``mode``: 'off', 'force' (every eligible shape) or 'auto' (the cost model).
    Planned on ONE image (its plan, its direct-conv time), so every batch size runs the
    same code (codegen/lower/conv.py conv_tiling); decided for ``batch`` images (default
    ``geom.N``) since the weights stream once a call: Winograd's are (m+2)^2/9 times the
    direct ones (16/9 for F(2,3)), which costs more than its saved flops where a layer
    has few pixels and many channels. ResNet-18's and ResNet-50's 3x3 convs at 7x7 (512
    channels, 9.4 MB of weights) at batch 1, 1 core, Sapphire Rapids, in the models:
    Winograd 2.69-2.76 ms, the implicit GEMM 2.32-2.43; at 14x14 (256 channels) Winograd
    stays 1.4x faster."""
    if mode == "off" or not eligible(geom):
        return None
    plan = plan_winograd(geom, cores=cores)
    if mode == "force":
        return plan
    flops = replace(geom, N=1).flops
    if flops < MIN_FLOPS:
        return None
    direct = dispatch_time(2, cores, lambda t0, t1: (t1 - t0) * flops / 2 / DIRECT_EFF)
    n = geom.N if batch is None else batch
    # seconds: the modelled direct time at its share of the measured peak, Winograd's in
    # proportion, each plus its weights' memory time
    direct_s = flops / (peaks()["fp32_gflops_per_core"] * 1e9 * DIRECT_PEAK_SHARE * cores)
    wino_s = direct_s * plan.cost / direct
    a = plan.m + 2
    # each core streams the weights of its own channel blocks (both paths split a
    # single image's channels between the cores)
    wbytes = 4 * geom.M * geom.Cg / cores
    d_total = n * direct_s + weight_stream_s(wbytes * geom.KK)
    w_total = n * wino_s + weight_stream_s(wbytes * a * a)
    return plan if w_total * MIN_GAIN < d_total else None
