"""Lowering of cannc.te programs (custom ops written in Python, cannc/custom_op.py).

An elementwise program (a broadcasting map of the inputs) is emitted by the shared
map code (`emit_map`, shape-polymorphic through `map_tiling`), exactly as a built-in
elementwise op; it also fuses, through the op's `expr`.

An index program (``te.compute`` reading inputs at computed indices, reductions) gets
a loop nest of its own: tiles of output rows over the AI Cores; in each row the
innermost output axis walks in vectors plus a scalar remainder. A read whose index is
the innermost variable plus something invariant is one vector load; one that does not
depend on it is a scalar load, splat; any other is a gather (llvm.masked.gather). Every
expression that does not depend on the innermost variable is computed once per row.
Reductions are loops inside the element's computation.

Runtime dims (ABI.md): every input axis but the innermost is a runtime dim (unless
it is 1), so a new batch or sequence length reuses the code; the innermost extents
(a head dimension) are static and in the key with the program's fingerprint. The
tiling function proves every read in bounds for the concrete shapes first (an
out-of-range read is a CanncError naming the op, before any code runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ...artifact import Tiling
from ...ir.graph import Node
from ...ir.types import TensorType
from ...native import emit
from ...native.emit import I64, for_range, i64, llvm_type
from ...te import INDEX, Expr, Program
from ...te import analysis as A
from ..elementwise import TV, _from_storage, emit_map, map_tiling, store_tv, vector_lanes
from ..elementwise import Expr as Builder
from ..kernel import LowerCtx

# (node, input types) -> the program traced for lowering (runtime dims symbolic)
TraceFn = Callable[[Node, list[TensorType]], Program]
ROW_TILE_ELEMS = 4096


def te_lowering(trace: TraceFn, label: Callable[[Node], str]) -> tuple[Any, Any]:
    """(lower, tiling) for a custom op whose program `trace` gives."""

    def tiling(node: Node, in_types: list[TensorType | None],
               out_types: list[TensorType]) -> Tiling | None:
        types = [t for t in in_types if t is not None]
        prog = trace(node, types)
        if prog.elementwise:
            t = map_tiling(types, out_types, 1)
            if t is None:
                return None
            return Tiling(key=("te-map", prog.fingerprint) + t.key, dims=t.dims,
                          num_tiles=t.num_tiles, single_core=t.single_core, flops=t.flops)
        shapes = [tuple(int(d) for d in t.shape) for t in types]
        A.check_bounds(prog, shapes, label(node))
        rt = A.runtime_dims(prog)
        out_shape = tuple(int(d) for d in out_types[0].shape)
        n = out_shape[-1] if out_shape else 1
        rows = int(np.prod(out_shape[:-1])) if len(out_shape) > 1 else 1
        total = rows * n
        rpt = max(1, -(-ROW_TILE_ELEMS // max(n, 1)))
        pattern = tuple(tuple(d if isinstance(d, int) else "rt" for d in t.shape)
                        for t in prog.inputs)
        return Tiling(key=("te", prog.fingerprint, pattern),
                      dims=(rpt, rows) + tuple(shapes[i][a] for i, a in rt),
                      num_tiles=max(1, -(-rows // rpt)), single_core=total < 4096,
                      flops=total, notes={"te": "index loop nest"})

    def lower(ctx: LowerCtx) -> None:
        types = [t for t in ctx.in_types if t is not None]
        prog = trace(ctx.node, types)
        if prog.elementwise:
            emit_map(ctx, types, ctx.out_types, lambda E, vals: A.eval_map(prog, E, vals))
            ctx.flops = ctx.out_types[0].numel
            return
        assert ctx.tiling is not None, "te index kernels are shape-polymorphic"
        _Nest(ctx, prog).emit()

    return lower, tiling


class _Nest:
    """The loop nest of an index program."""

    def __init__(self, ctx: LowerCtx, prog: Program) -> None:
        self.ctx, self.prog = ctx, prog
        self.out = prog.outputs[0]
        self.inner: Expr | None = self.out.vars[-1] if self.out.vars else None
        self._deps: dict[int, frozenset] = {}
        dtypes = [t.dtype for t in prog.inputs] + [o.dtype for o in prog.outputs]
        self.lanes = vector_lanes(dtypes) if self.inner is not None else 1

    def dep_inner(self, e: Expr) -> bool:
        return self.inner is not None and self.inner.attr[0] in A.deps(e, self._deps)

    def emit(self) -> None:
        ctx, prog = self.ctx, self.prog
        for o in prog.outputs[1:]:
            if len(o.shape) != len(self.out.shape):
                raise ValueError("te outputs of an index body must have one shape")
        fn, b = ctx.begin()
        self.b = b
        self.entry = b.block
        self.ins = [ctx.in_ptr(b, i) for i in range(len(prog.inputs))]
        self.outs = [ctx.out_ptr(b, j) for j in range(len(prog.outputs))]
        rpt, rows = ctx.rt_dim(b, 0), ctx.rt_dim(b, 1)
        self.dims = {key: ctx.rt_dim(b, 2 + k) for k, key in enumerate(A.runtime_dims(prog))}
        self.scopes: list[dict[int, TV]] = [{}]
        self.vmemo: dict[int, TV] = {}
        ext = [self.scalar(d) if isinstance(d, Expr) else TV(i64(d), INDEX)
               for d in self.out.shape]
        self.strides = [self._strides(t) for t in prog.inputs]
        n = ext[-1].v if ext else i64(1)
        with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
            r0 = b.mul(t, rpt)
            r1 = b.add(r0, rpt)
            r1 = b.select(b.icmp_signed("<", r1, rows), r1, rows)
            with for_range(b, r0, r1, name="row") as row:
                self.scopes.append({})
                rem = row
                env: dict[int, TV] = {}
                for d in range(len(ext) - 2, -1, -1):
                    idx = b.urem(rem, ext[d].v) if d > 0 else rem
                    if d > 0:
                        rem = b.udiv(rem, ext[d].v)
                    env[self.out.vars[d].attr[0]] = TV(idx, INDEX)
                self.env = env
                base = b.mul(row, n)
                bodies = [o.body for o in prog.outputs]
                # row invariants, once per row
                for e in self._invariants(bodies):
                    self.scalar(e)
                if self.inner is None:
                    for j, o in enumerate(prog.outputs):
                        store_tv(b, self.outs[j], base, self.scalar(o.body), o.dtype)
                else:
                    lanes = self.lanes
                    nvec = i64(0)
                    if lanes > 1:
                        nvec = b.and_(n, i64(-lanes))
                        with for_range(b, 0, nvec, step=lanes, name="v") as jv:
                            self._element(jv, lanes, base)
                    with for_range(b, nvec, n, name="s") as js:
                        self._element(js, 1, base)
                self.scopes.pop()
        b.ret_void()
        ctx.notes["te"] = "index loop nest"

    # -- per element ---------------------------------------------------------
    def _element(self, j: ir.Value, w: int, base: ir.Value) -> None:
        b = self.b
        self.w = w
        self.j = j
        self.scopes.append({})
        self.vmemo: dict[int, TV] = {}
        for k, o in enumerate(self.prog.outputs):
            v = self.value(o.body, w)
            store_tv(b, self.outs[k], b.add(base, j), v, o.dtype)
        self.scopes.pop()

    def _invariants(self, roots: list[Expr]) -> list[Expr]:
        """Maximal subexpressions free of the innermost variable (and of reduction
        variables) that the element computation reads."""
        out, seen = [], set()
        stack = list(roots)
        while stack:
            e = stack.pop()
            if id(e) in seen:
                continue
            seen.add(id(e))
            d = A.deps(e, self._deps)
            free = all(v in self.env for v in d)
            if free and e.op != "const":
                out.append(e)
                continue
            if e.op != "reduce":
                stack.extend(e.args)
        return out

    def value(self, e: Expr, w: int) -> TV:
        """e's value over w lanes (the innermost variable varies across lanes)."""
        if w == 1 or not self.dep_inner(e):
            s = self.scalar(e)
            if w == 1:
                return s
            return TV(emit.splat(self.b, s.v, w), s.dtype)
        return _Eval(self, w)(e)

    def scalar(self, e: Expr) -> TV:
        return _Eval(self, 1)(e)

    def _leaf(self, e: Expr, w: int) -> TV:
        b = self.b
        if e.op == "dim":
            return TV(self.dims[e.attr[:2]], INDEX)
        if e.op == "var":
            uid = e.attr[0]
            if self.inner is not None and uid == self.inner.attr[0]:
                if w == 1:
                    return TV(self.j, INDEX)
                lanes = ir.Constant(ir.VectorType(I64, w), list(range(w)))
                return TV(b.add(emit.splat(b, self.j, w), lanes), INDEX)
            v = self.env.get(uid)
            if v is None:
                raise ValueError(f"te: variable {e!r} is not bound here (an index variable "
                                 "of another compute?)")
            return TV(emit.splat(b, v.v, w), INDEX) if w > 1 else v
        if e.op == "reduce":
            return self._reduce(e, w)
        return self._read(e, w)

    def _reduce(self, e: Expr, w: int) -> TV:
        b = self.b
        body, k = e.args
        ext = self.scalar(k.args[0]) if not self.dep_inner(k.args[0]) else None
        assert ext is not None
        E = Builder(b, w)
        ty = E.ty(e.dtype)
        eb = ir.IRBuilder(self.entry)
        eb.position_at_start(self.entry)
        acc = eb.alloca(ty, name="acc")
        kind = e.attr
        if kind == "sum":
            init = E.const(0, e.dtype)
        else:
            big = -np.inf if kind == "max" else np.inf
            if e.dtype.kind in "iu":
                info = np.iinfo(e.dtype)
                big = info.min if kind == "max" else info.max
            init = E.const(big, e.dtype)
        b.store(init.v, acc)
        with for_range(b, 0, ext.v, name="k") as kv:
            self.env[k.attr[0]] = TV(kv, INDEX)
            self.scopes.append({})
            saved = self.vmemo
            self.vmemo = {}
            x = self.value(body, w)
            self.vmemo = saved
            self.scopes.pop()
            cur = TV(b.load(acc, typ=ty), e.dtype)
            r = E.add(cur, x) if kind == "sum" else (E.max(cur, x) if kind == "max"
                                                      else E.min(cur, x))
            b.store(r.v, acc)
            del self.env[k.attr[0]]
        return TV(b.load(acc, typ=ty), e.dtype)

    def _strides(self, t: Any) -> list[ir.Value]:
        b = self.b
        st: list[ir.Value] = [i64(1)] * t.ndim
        acc: ir.Value = i64(1)
        for a in range(t.ndim - 1, -1, -1):
            st[a] = acc
            d = t.shape[a]
            dv = i64(d) if isinstance(d, int) else self.dims[d.attr[:2]]
            acc = b.mul(acc, dv) if a > 0 else acc
        return st

    def _offset(self, idx: list[TV], strides: list[ir.Value], w: int) -> ir.Value:
        b = self.b
        off = None
        for v, s in zip(idx, strides):
            sv = emit.splat(b, s, w) if w > 1 else s
            term = v.v if isinstance(s, ir.Constant) and s.constant == 1 else b.mul(v.v, sv)
            off = term if off is None else b.add(off, term)
        if off is None:
            off = i64(0) if w == 1 else ir.Constant(ir.VectorType(I64, w), [0] * w)
        return off

    def _read(self, e: Expr, w: int) -> TV:
        b = self.b
        i = e.attr
        t = self.prog.inputs[i]
        dt = t.dtype
        et = llvm_type(dt)
        strides = self.strides[i]
        if w == 1 or not self.dep_inner(e):
            off = self._offset([self.scalar(a) for a in e.args], strides, 1)
            v = b.load(emit.gep(b, self.ins[i], off, et), typ=et)
            return TV(_from_storage(b, v, dt), dt)
        inner = self.inner
        assert inner is not None
        coefs = [A.inner_coef(a, inner, self.dep_inner) for a in e.args]
        if t.ndim and coefs[-1] == 1 and all(c == 0 for c in coefs[:-1]):
            # contiguous: base at lane 0, one vector load
            from ...te import const, substitute
            last0 = substitute(e.args[-1], {inner: const(0)})
            idx = [self.scalar(a) for a in e.args[:-1]] + [self.scalar(last0)]
            off = b.add(self._offset(idx, strides, 1), self.j)
            vt = ir.VectorType(et, w)
            v = b.load(emit.gep(b, self.ins[i], off, et), typ=vt)
            v.align = dt.itemsize
            return TV(_from_storage(b, v, dt), dt)
        # a gather
        idx = [self.value(a, w) for a in e.args]
        off = self._offset(idx, strides, w)
        base = b.ptrtoint(self.ins[i], I64)
        vi = ir.VectorType(I64, w)
        addr = b.add(emit.splat(b, base, w), b.mul(off, ir.Constant(vi, [dt.itemsize] * w)))
        pv = b.inttoptr(addr, ir.VectorType(emit.PTR, w))
        vt = ir.VectorType(et, w)
        mt = ir.VectorType(ir.IntType(1), w)
        tname = _vec_name(et, w)
        fnty = ir.FunctionType(vt, [ir.VectorType(emit.PTR, w), emit.I32, mt, vt])
        name = f"llvm.masked.gather.{tname}.v{w}p0"
        mod = self.ctx.module
        f = mod.globals.get(name) or ir.Function(mod, fnty, name=name)
        v = b.call(f, [pv, emit.i32(dt.itemsize), ir.Constant(mt, [1] * w),
                       ir.Constant(vt, ir.Undefined)])
        return TV(_from_storage(b, v, dt), dt)


def _vec_name(et: ir.Type, w: int) -> str:
    if isinstance(et, ir.FloatType):
        return f"v{w}f32"
    if isinstance(et, ir.DoubleType):
        return f"v{w}f64"
    if isinstance(et, ir.HalfType):
        return f"v{w}f16"
    if isinstance(et, ir.IntType):
        return f"v{w}i{et.width}"
    return f"v{w}bf16"


class _Eval(A.Evaluator):
    """The Evaluator of a nest: w-lane values memoised per element, invariant ones
    splat from the scalar scopes (row, reduction loop, element)."""

    def __init__(self, nest: _Nest, w: int) -> None:
        super().__init__(Builder(nest.b, w), lambda x: nest._leaf(x, w))
        self.nest, self.w = nest, w

    def __call__(self, e: Expr) -> Any:
        nest = self.nest
        if self.w > 1:
            if not nest.dep_inner(e):
                return nest.value(e, self.w)
            got = nest.vmemo.get(id(e))
            if got is None:
                got = self._emit(e)
                nest.vmemo[id(e)] = got
            return got
        for sc in reversed(nest.scopes):
            got = sc.get(id(e))
            if got is not None:
                return got
        v = self._emit(e)
        nest.scopes[-1][id(e)] = v
        return v
