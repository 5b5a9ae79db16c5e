"""Building blocks of the <16 x float> kernels (GEMM, attention, conv, pool).

`VecBuilder` holds a kernel function's IRBuilder and the helpers these
generators share: intrinsic declarations, masked vector loads and stores,
gathers and scatters, splats, signed min/max, counted loops (plain, with
loop-carried values, with a micro-kernel's accumulator grid), branches (a
one-armed if, the end of a reduction block) and 16 x 16 shuffles (transpose,
horizontal reduction). Each generator subclasses it with what is its own;
lane masks in particular stay there (i64 lanes, clamped i32 counts, or i32
first + i: they differ on purpose).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import llvmlite.ir as ir

from ..native.emit import F32, I1, I8, I32, I64, PTR, VOID, i32, i64, masked_load, masked_store
from ..native.target import host

W = 16  # lanes
VF = ir.VectorType(F32, W)
VM = ir.VectorType(I1, W)
VI8 = ir.VectorType(I8, W)
VI32 = ir.VectorType(I32, W)
VI64 = ir.VectorType(I64, W)
VPTR = ir.VectorType(PTR, W)

__all__ = ["W", "VF", "VM", "VI8", "VI32", "VI64", "VPTR", "declare", "abi_function",
           "Loop", "VecBuilder", "wide_registers", "ACC_BUDGET_AVX2"]

# <16 x float> accumulators a micro-kernel may keep in registers on an AVX2 target: each
# takes two of its 16 ymm registers, and the operand vectors and a broadcast need the rest
# (a 6 x 16 tile: 12 ymm accumulators, 2 loaded, 1 broadcast). Tiles sized for AVX-512's
# 32 zmm (8 x 32: 16 accumulators) spill on every k step there.
ACC_BUDGET_AVX2 = 6


def wide_registers() -> bool:
    """The target has AVX-512 (32 registers of 512 bits: a <16 x float> is one); else the
    micro-kernels are sized for AVX2's 16 ymm (see ACC_BUDGET_AVX2)."""
    return host().has("avx512f")


def declare(module: ir.Module, name: str, ret: ir.Type, args: Sequence[ir.Type]) -> ir.Function:
    """The function ``name`` of ``module``, declared on first use (intrinsics)."""
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(ret, list(args)), name)
    return fn


def abi_function(module: ir.Module, name: str) -> ir.Function:
    """``void name(ptr args, i64 tile_begin, i64 tile_end, ptr workspace)`` (ABI.md)."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, I64, PTR]), name=name)
    for a, n in zip(fn.args, ("args", "tile_begin", "tile_end", "workspace")):
        a.name = n
    fn.attributes.add("nounwind")
    return fn


def _i64(v: ir.Value | int) -> ir.Value:
    return i64(v) if isinstance(v, int) else v


class Loop(NamedTuple):
    """An open loop of `VecBuilder.begin_loop`."""
    hdr: ir.Block
    ext: ir.Block
    i: ir.Value
    phis: list[ir.Value]


class VecBuilder:
    """A kernel function's IRBuilder (``self.b``) plus <16 x float> helpers."""

    def __init__(self, module: ir.Module, fn: ir.Function) -> None:
        self.m = module
        self.fn = fn
        self.b = ir.IRBuilder(fn.append_basic_block("entry"))
        self._n = 0
        self.zero_v = ir.Constant(VF, None)
        self.zero_m = ir.Constant(VM, None)
        self.ones_m = ir.Constant(VM, [1] * W)

    def name(self, base: str) -> str:
        """``base`` made unique within the function (block names)."""
        self._n += 1
        return f"{base}{self._n}"

    # -- intrinsics ----------------------------------------------------------
    def intr(self, name: str, ret: ir.Type, args: Sequence[ir.Type]) -> ir.Function:
        return declare(self.m, name, ret, args)

    def fma(self, a: ir.Value, x: ir.Value, c: ir.Value) -> ir.Value:
        """a * x + c, fused, on <16 x float>."""
        return self.b.call(self.intr("llvm.fma.v16f32", VF, [VF, VF, VF]), [a, x, c])

    def mload(self, ptr: ir.Value, mask: ir.Value, passthru: ir.Value | None = None) -> ir.Value:
        return masked_load(self.b, ptr, mask, self.zero_v if passthru is None else passthru, 4)

    def mstore(self, val: ir.Value, ptr: ir.Value, mask: ir.Value) -> None:
        masked_store(self.b, val, ptr, mask, 4)

    def load_v(self, ptr: ir.Value, mask: ir.Value | None = None,
               passthru: ir.Value | None = None) -> ir.Value:
        """16 floats at ptr (align 4); masked-off lanes are not read (passthru, else 0)."""
        if mask is None:
            return self.b.load(ptr, typ=VF, align=4)
        return self.mload(ptr, mask, passthru)

    def store_v(self, val: ir.Value, ptr: ir.Value, mask: ir.Value | None = None) -> None:
        """Store 16 floats at ptr (align 4); masked-off lanes are not written."""
        if mask is None:
            self.b.store(val, ptr, align=4)
        else:
            self.mstore(val, ptr, mask)

    def gather(self, ptrs: ir.Value, mask: ir.Value, passthru: ir.Value | None = None) -> ir.Value:
        """Masked gather of the floats at the <16 x ptr> ``ptrs``."""
        f = self.intr("llvm.masked.gather.v16f32.v16p0", VF, [VPTR, I32, VM, VF])
        return self.b.call(f, [ptrs, i32(4), mask, self.zero_v if passthru is None else passthru])

    def scatter(self, val: ir.Value, ptrs: ir.Value, mask: ir.Value | None = None) -> None:
        """Masked scatter of val to the <16 x ptr> ``ptrs`` (every lane without a mask)."""
        f = self.intr("llvm.masked.scatter.v16f32.v16p0", VOID, [VF, VPTR, I32, VM])
        self.b.call(f, [val, ptrs, i32(4), self.ones_m if mask is None else mask])

    def prefetch_w(self, ptr: ir.Value) -> None:
        """Prefetch the line at ptr for writing, into all cache levels."""
        self.prefetch_r(ptr, write=True)

    def prefetch_r(self, ptr: ir.Value, locality: int = 3, write: bool = False) -> None:
        """Prefetch the line at ptr for reading (or writing) (locality 3: into L1, 2: into
        L2)."""
        f = self.intr("llvm.prefetch.p0", VOID, [PTR, I32, I32, I32])
        self.b.call(f, [ptr, i32(int(write)), i32(locality), i32(1)])

    # -- scalars and splats --------------------------------------------------
    def arg(self, args: ir.Value, i: int) -> ir.Value:
        """The i-th pointer of the kernel's argument array."""
        return self.b.load(self.b.gep(args, [i64(i)], source_etype=PTR), typ=PTR, align=8)

    def gep(self, ptr: ir.Value, idx: ir.Value | int, ty: ir.Type = F32) -> ir.Value:
        """&ptr[idx] for elements of type ty (ptr itself for a constant 0)."""
        if isinstance(idx, int):
            if idx == 0:
                return ptr
            idx = i64(idx)
        return self.b.gep(ptr, [idx], source_etype=ty)

    def splat(self, x: ir.Value | int | float, vt: ir.VectorType = VF) -> ir.Value:
        """x in every lane of a vector of type vt (a constant for a Python number)."""
        if isinstance(x, (int, float)):
            return ir.Constant(vt, [x] * vt.count)
        b = self.b
        v = b.insert_element(ir.Constant(vt, ir.Undefined), x, i32(0))
        return b.shuffle_vector(
            v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(I32, vt.count), None)
        )

    def splat_f(self, x: ir.Value | int | float) -> ir.Value:
        """A float (or a Python number, as float) in all 16 lanes."""
        return self.splat(float(x) if isinstance(x, (int, float)) else x, VF)

    def smin(self, a: ir.Value, c: ir.Value | int) -> ir.Value:
        c = _i64(c)
        return self.b.select(self.b.icmp_signed("<", a, c), a, c)

    def smax(self, a: ir.Value, c: ir.Value | int) -> ir.Value:
        c = _i64(c)
        return self.b.select(self.b.icmp_signed(">", a, c), a, c)

    # -- control flow --------------------------------------------------------
    def begin_loop(self, start: ir.Value | int, stop: ir.Value | int, name: str,
                   iv_name: str | None = None, init: Sequence[ir.Value] = (),
                   unique: bool = True) -> Loop:
        """Open ``for (i = start; i < stop; )`` (signed i64) with loop-carried
        values starting at ``init``; the builder is left in the body. Blocks are
        name.h / name.b / name.x, numbered unless ``unique`` is False. Close with
        `end_loop`; use this pair directly when the step is computed in the body."""
        b = self.b
        tag = self.name if unique else (lambda s: s)
        pre = b.block
        hdr = b.append_basic_block(tag(name + ".h"))
        body = b.append_basic_block(tag(name + ".b"))
        ext = b.append_basic_block(tag(name + ".x"))
        b.branch(hdr)
        b.position_at_end(hdr)
        i = b.phi(I64, name=iv_name or name)
        i.add_incoming(_i64(start), pre)
        phis = [b.phi(v.type) for v in init]
        for ph, v in zip(phis, init):
            ph.add_incoming(v, pre)
        b.cbranch(b.icmp_signed("<", i, _i64(stop)), body, ext)
        b.position_at_end(body)
        return Loop(hdr, ext, i, phis)

    def end_loop(self, loop: Loop, step: ir.Value | int, new: Sequence[ir.Value] = ()) -> None:
        """Close `begin_loop`'s loop: i += step, carried values become ``new``;
        the builder is left after the loop."""
        b = self.b
        loop.i.add_incoming(b.add(loop.i, _i64(step)), b.block)
        for ph, v in zip(loop.phis, new):
            ph.add_incoming(v, b.block)
        b.branch(loop.hdr)
        b.position_at_end(loop.ext)

    @contextlib.contextmanager
    def loop(self, start: ir.Value | int, stop: ir.Value | int, step: ir.Value | int = 1,
             name: str = "i") -> Iterator[ir.Value]:
        """``with loop(start, stop, step) as i:`` for (i = start; i < stop; i += step),
        signed i64; the body is emitted inside."""
        lp = self.begin_loop(start, stop, name)
        yield lp.i
        self.end_loop(lp, step)

    def carry_loop(self, start: ir.Value | int, stop: ir.Value | int, step: ir.Value | int,
                   init: Sequence[ir.Value],
                   body: Callable[[ir.Value, list[ir.Value]], Sequence[ir.Value]],
                   name: str, iv_name: str | None = None) -> tuple[ir.Value, list[ir.Value]]:
        """A loop like `loop` with loop-carried values: ``init`` is a flat list of
        values, ``body(i, vals)`` emits one iteration and returns the new values.
        Returns the final counter and values (valid after the loop)."""
        lp = self.begin_loop(start, stop, name, iv_name, init)
        self.end_loop(lp, step, body(lp.i, lp.phis))
        return lp.i, lp.phis

    def grid_loop(self, start: ir.Value | int, stop: ir.Value | int, step: ir.Value | int,
                  grid: Sequence[Sequence[ir.Value]], streams: Sequence[ir.Value],
                  body: Callable[[ir.Value, list[list[ir.Value]], list[ir.Value]],
                                 tuple[Sequence[Sequence[ir.Value]], Sequence[ir.Value]]],
                  name: str, iv_name: str | None = None,
                  ) -> tuple[ir.Value, list[list[ir.Value]], list[ir.Value]]:
        """`carry_loop` for a micro-kernel: a grid of accumulators (rows of equal
        length) and a list of other carried values (pointer streams);
        ``body(i, grid, streams) -> (grid, streams)``. Returns the final counter,
        grid and streams."""
        nrow, ncol = len(grid), len(grid[0])
        nacc = nrow * ncol

        def rows(vals):
            return [list(vals[r * ncol:(r + 1) * ncol]) for r in range(nrow)]

        def flat_body(i, vals):
            g, st = body(i, rows(vals), list(vals[nacc:]))
            return [x for row in g for x in row] + list(st)

        init = [x for row in grid for x in row] + list(streams)
        i, vals = self.carry_loop(start, stop, step, init, flat_body, name, iv_name)
        return i, rows(vals), list(vals[nacc:])

    def add_partials(self, accs: list[list[ir.Value]], first: ir.Value | bool,
                     rows: Sequence[ir.Value], masks: Sequence[Sequence[ir.Value]]
                     ) -> list[list[ir.Value]]:
        """A micro-tile's sums over one reduction block (begun at zero) plus the partial
        sums the earlier blocks kept: those of accumulator [r][j] are the 16 floats at
        ``rows[r] + 16*j`` under ``masks[r][j]``, not read (0) when the i1 ``first``
        holds; ``first`` True: the only block. Each block is summed in a chain of its own
        and the blocks' sums are then added (the order MLAS sums in): an fp32 dot product
        over K in blocks of KC rounds like chains of KC and K/KC terms, not one of K --
        2.7x less error at K = 2048 and KC = 256 than begun from the partial sums -- for
        one add per accumulator and block. (x + 0.0 is x for every sum begun at +0.0.)"""
        if first is True:
            return accs
        # (a branch around the loads, not loads under a mask cleared on the first block:
        # those cost as if they read -- most likely they wait for the C lines the write
        # prefetch has just requested. Sapphire Rapids guest, 1 core, a dynamic
        # 3136x96 @ 96x384 MatMul, one K block that the kernel learns of at run time:
        # 1.19 -> 1.12 ms; with a bias 1.37 -> 1.33; in models 1-1.5%)
        b = self.b
        entry = b.block
        load = b.append_basic_block(self.name("pa.ld"))
        done = b.append_basic_block(self.name("pa.done"))
        b.cbranch(first, done, load)
        b.position_at_end(load)
        summed = [[b.fadd(a, self.mload(self.gep(rows[r], 16 * j), masks[r][j]))
                   for j, a in enumerate(row)] for r, row in enumerate(accs)]
        load_end = b.block
        b.branch(done)
        b.position_at_end(done)
        out = []
        for row, srow in zip(accs, summed):
            out.append([])
            for a, x in zip(row, srow):
                phi = b.phi(a.type)
                phi.add_incoming(a, entry)
                phi.add_incoming(x, load_end)
                out[-1].append(phi)
        return out

    def finish_block(self, last: ir.Value | bool, final: Callable[[], None],
                     partial: Callable[[], None], name: str = "st") -> None:
        """The end of a micro-tile's reduction block: ``final()`` (the finished
        values) after the last block, ``partial()`` (keep the partial sums) after
        the others. ``last`` is an i1 value, or the Python True (final() alone)."""
        if last is True:
            final()
            return
        b = self.b
        fin = b.append_basic_block(self.name(name + ".fin"))
        raw = b.append_basic_block(self.name(name + ".raw"))
        done = b.append_basic_block(self.name(name + ".done"))
        b.cbranch(last, fin, raw)
        b.position_at_end(raw)
        partial()
        b.branch(done)
        b.position_at_end(fin)
        final()
        b.branch(done)
        b.position_at_end(done)

    @contextlib.contextmanager
    def if_then(self, cond: ir.Value) -> Iterator[None]:
        """``with if_then(cond):`` the body runs when the i1 cond holds."""
        b = self.b
        then = b.append_basic_block(self.name("if.t"))
        done = b.append_basic_block(self.name("if.x"))
        b.cbranch(cond, then, done)
        b.position_at_end(then)
        yield
        b.branch(done)
        b.position_at_end(done)

    # -- shuffles --------------------------------------------------------------
    def transpose16(self, rows: Sequence[ir.Value]) -> list[ir.Value]:
        """16 <16 x float> rows -> 16 columns (4 stages of 2-source shuffles)."""
        b = self.b
        R = list(rows)
        for st in range(4):
            bit = 1 << st
            lo = [j if not (j & bit) else 16 + j - bit for j in range(16)]
            hi = [16 + j if (j & bit) else j + bit for j in range(16)]
            lo_c = ir.Constant(VI32, lo)
            hi_c = ir.Constant(VI32, hi)
            for i in range(16):
                if i & bit:
                    continue
                a, c = R[i], R[i | bit]
                R[i] = b.shuffle_vector(a, c, lo_c)
                R[i | bit] = b.shuffle_vector(a, c, hi_c)
        return R

    def hreduce(self, vecs: Sequence[ir.Value],
                op: Callable[[ir.Value, ir.Value], ir.Value] | None = None) -> ir.Value:
        """Up to 16 <16 x float> -> one whose lane j is the ``op``-reduction
        (default fadd) of vecs[j] (lanes >= len(vecs): undefined). A shuffle
        tree: 4 stages of 2-source shuffles; 16 vectors take 30 shuffles, 15 ops."""
        b = self.b
        op = op or b.fadd
        n = len(vecs)
        vecs = list(vecs) + [self.zero_v] * ((1 << (n - 1).bit_length()) - n)  # pad to 2^i
        items = [(v, [j] * 16) for j, v in enumerate(vecs)]
        h = 8
        while h >= 1:
            new = []
            pairs = list(zip(items[0::2], items[1::2])) if len(items) > 1 else [(items[0],) * 2]
            for (x, xl), (y, yl) in pairs:
                lo, hi, lab = [0] * 16, [0] * 16, [0] * 16
                for s0 in range(0, 16, 2 * h):
                    for i in range(h):
                        lo[s0 + i], hi[s0 + i] = s0 + i, s0 + h + i
                        lo[s0 + h + i], hi[s0 + h + i] = 16 + s0 + i, 16 + s0 + h + i
                        assert xl[s0 + i] == xl[s0 + h + i] and yl[s0 + i] == yl[s0 + h + i]
                        lab[s0 + i], lab[s0 + h + i] = xl[s0 + i], yl[s0 + i]
                v = op(
                    b.shuffle_vector(x, y, ir.Constant(VI32, lo)),
                    b.shuffle_vector(x, y, ir.Constant(VI32, hi)),
                )
                new.append((v, lab))
            items = new
            h //= 2
        v, lab = items[0]
        perm = [lab.index(j) if j < n else 0 for j in range(16)]
        if perm == list(range(16)):
            return v
        return b.shuffle_vector(v, ir.Constant(VF, ir.Undefined), ir.Constant(VI32, perm))
