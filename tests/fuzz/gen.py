"""A generator of valid random ONNX graphs over the ops cannc supports.

`random_model(seed)` builds one graph from a seeded `numpy.random.Generator`: a pool of
float32 values (graph inputs and initializers first) grows node by node, each new node
reading values already in the pool, with shapes chosen so the node is valid (ONNX shape
inference gives every new value its shape). Ops with a restricted domain get inputs in
range by construction (Sqrt/Log of |x| + c, Pow of a positive base or an integer
exponent, Div by |x| + c), so the comparison keeps the strict float32 tolerances.

float16 and bool: `op_half` makes chains of float16 ops (from float16 graph inputs or
a Cast of a pool value) whose results stay float16 (graph outputs, compared with a
float16 tolerance, see run.py); `op_bool` makes bool values (comparisons of graph inputs
and constants, bool graph inputs, Not/And/Or/Xor) that end in a graph output, a Where
or a Cast back to float32 (exact, so the pool keeps the float32 tolerances).

Graph outputs are a random mix: the last values, intermediates that other nodes also
read (and so sit inside fused groups), views (Reshape/Transpose/Slice results), a graph
input itself, and a constant. The same seed always gives the same model and feeds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
BOOL = TensorProto.BOOL


@dataclass
class Builder:
    rng: np.random.Generator
    opset: int = OPSET
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    consts: set[str] = field(default_factory=set)   # float values known at compile time
    views: set[str] = field(default_factory=set)    # results of view-like ops
    readers: dict[str, int] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)   # op types, for reports
    init_names: set[str] = field(default_factory=set)
    dtypes: dict[str, int] = field(default_factory=dict)
    other: dict[str, tuple[int, ...]] = field(default_factory=dict)   # non-float values
    only: frozenset[str] | None = None     # op types the random choices may take
    _n: int = 0

    # -- naming and sources ---------------------------------------------------------------
    def name(self, p: str = "v") -> str:
        self._n += 1
        return f"{p}{self._n}"

    def input(self, shape: tuple[int, ...], scale: float = 1.0, dtype: int = F32) -> str:
        nm = self.name("x")
        self.inputs.append(helper.make_tensor_value_info(nm, dtype, list(shape)))
        self.dtypes[nm] = dtype
        if dtype == BOOL:
            self.feeds[nm] = np.asarray(self.rng.random(shape) < 0.5)
        else:
            self.feeds[nm] = np.asarray(self.rng.standard_normal(shape) * scale,
                                        np.float16 if dtype == F16 else np.float32)
        (self.shapes if dtype == F32 else self.other)[nm] = tuple(shape)
        return nm

    def const(self, a: np.ndarray, prefix: str = "c", pool: bool = False) -> str:
        nm = self.name(prefix)
        a = np.array(a)
        self.inits.append(numpy_helper.from_array(a, nm))
        self.init_names.add(nm)
        if pool and a.dtype == np.float32:
            self.shapes[nm] = tuple(a.shape)
            self.consts.add(nm)
        elif pool:
            self.other[nm] = tuple(a.shape)
            self.dtypes[nm] = helper.np_dtype_to_tensor_dtype(a.dtype)
        return nm

    def fconst(self, shape: tuple[int, ...], scale: float = 1.0) -> str:
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32),
                          pool=True)

    def i64(self, vals) -> str:
        return self.const(np.asarray(vals, np.int64), "i")

    # -- nodes ------------------------------------------------------------------------------
    def node(self, op: str, ins: list[str], n_out: int = 1, view: bool = False,
             **attrs) -> list[str]:
        outs = [self.name() for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, ins, outs, name=self.name(op.lower()), **attrs))
        for v in ins:
            if v:
                self.readers[v] = self.readers.get(v, 0) + 1
        self.tags.append(op)
        self._infer(outs)
        if view:
            self.views.update(outs)
        if all(v in self.consts or v in self.init_names or not v for v in ins):
            self.consts.update(outs)
        return outs

    def one(self, op: str, ins: list[str], **attrs) -> str:
        return self.node(op, ins, **attrs)[0]

    def _infer(self, outs: list[str]) -> None:
        m = self.model([])
        m = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
        known = {vi.name: vi for vi in m.graph.value_info}
        for o in outs:
            tt = known[o].type.tensor_type
            shape = tuple(d.dim_value for d in tt.shape.dim)
            self.dtypes[o] = tt.elem_type
            if tt.elem_type == F32:    # the pool holds float32 values only
                self.shapes[o] = shape
            else:
                self.other[o] = shape

    def model(self, outputs: list[str]) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, self.dtypes.get(o, F32),
                                              list(self.shapes.get(o, self.other.get(o))))
                for o in outputs]
        g = helper.make_graph(list(self.nodes), "fuzz", list(self.inputs), outs,
                              initializer=list(self.inits))
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = 8
        return m

    def choose(self, ops: list[str]) -> str | None:
        """One of `ops` (those allowed), or None."""
        ops = [o for o in ops if self.only is None or o in self.only]
        return str(ops[self.rng.integers(len(ops))]) if ops else None

    def allows(self, op: str) -> bool:
        return self.only is None or op in self.only

    def shape(self, v: str) -> tuple[int, ...]:
        return self.shapes[v] if v in self.shapes else self.other[v]

    # -- picking values ---------------------------------------------------------------------
    def pick(self, ok: Callable[[tuple[int, ...]], bool] = lambda s: True,
             fresh: bool = True, among: set[str] | None = None,
             dtype: int = F32) -> str | None:
        """A pool value (of `among`, of `dtype`) whose shape satisfies `ok`; recent values
        are likelier."""
        pool = self.shapes if dtype == F32 else {
            v: s for v, s in self.other.items() if self.dtypes.get(v) == dtype}
        cands = [v for v, s in pool.items() if ok(s) and np.prod(s) > 0
                 and (among is None or v in among)]
        if not cands:
            return None
        if fresh:
            w = np.arange(1, len(cands) + 1, dtype=np.float64) ** 2
            return cands[self.rng.choice(len(cands), p=w / w.sum())]
        return cands[self.rng.integers(len(cands))]


# ---------------------------------------------------------------------------------------
# the ops: each takes the builder and returns the new value (or None when no input fits)
# ---------------------------------------------------------------------------------------

def _rank(lo: int, hi: int) -> Callable[[tuple[int, ...]], bool]:
    return lambda s: lo <= len(s) <= hi


def _bshape(b: Builder, s: tuple[int, ...], grow: bool = True) -> tuple[int, ...]:
    """A shape that broadcasts with s (dims kept, set to 1, or dropped from the front,
    or, with `grow`, a new leading dim)."""
    r = b.rng
    out = [d if r.random() < 0.6 else 1 for d in s]
    k = int(r.integers(0, len(out) + 1)) if r.random() < 0.3 else 0
    out = out[k:]
    if grow and r.random() < 0.15 and len(s) < 4:
        out = [int(r.integers(1, 4))] + ([1] * (len(s) - len(out)) + out if len(out) < len(s)
                                          else out)
    return tuple(out)


def _positive(b: Builder, x: str, c: float = 0.5) -> str:
    return b.one("Add", [b.one("Abs", [x]), b.const(np.float32(c))])


STEPS = {"Floor", "Ceil", "Sign", "Round"}
UNARY = ["Abs", "Neg", "Relu", "Sigmoid", "Tanh", "HardSwish", "HardSigmoid", "LeakyRelu",
         "Elu", "Softplus", "Erf", "Floor", "Ceil", "Sign", "Selu", "Softsign", "Celu",
         "Sin", "Cos", "Round"]


def op_unary(b: Builder) -> str | None:
    x = b.pick()
    if x is None:
        return None
    op = b.choose(UNARY)
    if op is None:
        return None
    if op in STEPS:
        # a step function of a computed value is ill-conditioned where the value is
        # mathematically on a step (Ceil of a sum of softmax rows, Sign of x - x): it
        # reads a graph input, whose random values are never on one
        x = b.pick(lambda s: True, among=set(b.feeds))
        if x is None:
            return None
    attrs = {}
    if op == "LeakyRelu":
        attrs["alpha"] = float(b.rng.choice([0.01, 0.2, 1.5]))
    if op == "HardSigmoid" and b.rng.random() < 0.5:
        attrs.update(alpha=0.3, beta=0.4)
    return b.one(op, [x], **attrs)


def op_domain_unary(b: Builder) -> str | None:
    x = b.pick()
    if x is None:
        return None
    op = b.choose(["Sqrt", "Log", "Exp", "Reciprocal", "Clip"])
    if op is None:
        return None
    if op == "Exp":     # keep exp in a range where float32 relative error is small
        return b.one("Exp", [b.one("Tanh", [x])])
    if op == "Clip":
        lo, hi = sorted(b.rng.standard_normal(2).astype(np.float32))
        ins = [x, b.const(np.float32(lo)), b.const(np.float32(hi))]
        if b.rng.random() < 0.3:
            ins = [x, "", b.const(np.float32(hi))]
        return b.one("Clip", ins)
    return b.one(op, [_positive(b, x)])


BINARY = ["Add", "Sub", "Mul", "Max", "Min", "Div", "Pow", "Sum", "Mean", "PRelu"]


def op_binary(b: Builder) -> str | None:
    x = b.pick(_rank(0, 5))
    op = b.choose(BINARY)
    if x is None or op is None:
        return None
    s = b.shapes[x]
    ys = _bshape(b, s)
    pool = [v for v, t in b.shapes.items() if t == ys and v != x]
    if pool and b.rng.random() < 0.6:
        y = pool[b.rng.integers(len(pool))]
    elif b.rng.random() < 0.5:
        y = b.fconst(ys)
    else:
        y = b.input(ys)
    if b.rng.random() < 0.3:
        x, y = y, x
    if op == "Div":
        return b.one("Div", [x, _positive(b, y)])
    if op == "Pow":
        r = b.rng.random()
        if r < 0.4:    # positive base, any (moderate) exponent
            return b.one("Pow", [_positive(b, x), b.one("Tanh", [y])])
        if r < 0.6:    # any base, an integer-valued exponent computed at run time
            e = b.one("Round", [b.one("Mul", [b.one("Tanh", [y]), b.const(np.float32(3))])])
            return b.one("Pow", [x, e])
        # any base, an integer exponent (constant: a real-valued one would give NaN)
        e = b.rng.integers(-1, 4, size=_bshape(b, s) if b.rng.random() < 0.5 else ())
        e = np.where(e == -1, 2, e).astype(np.float32)
        return b.one("Pow", [x, b.const(e)])
    if op in ("Sum", "Mean", "Max", "Min") and b.rng.random() < 0.3:
        z = b.pick(lambda t: t == s)
        return b.one(op, [x, y, z])
    if op == "PRelu":    # slope broadcasts unidirectionally onto x
        t = b.shapes[x]
        sl = b.fconst(tuple(d if b.rng.random() < 0.5 else 1 for d in t[1:]) if t else ())
        return b.one("PRelu", [x, sl])
    return b.one(op, [x, y])


def op_matmul(b: Builder) -> str | None:
    x = b.pick(_rank(1, 4))
    if x is None or not b.allows("MatMul"):
        return None
    s = b.shapes[x]
    k = s[-1]
    n = int(b.rng.integers(1, 17))
    r = b.rng.random()
    if r < 0.5:
        ws = (k, n)
    elif r < 0.7 or len(s) < 2:
        ws = (k,) if b.rng.random() < 0.3 else (k, n)
    else:   # batched weight, broadcasting
        ws = _bshape(b, s[:-2]) + (k, n)
    w = b.fconst(ws, scale=1 / np.sqrt(k)) if b.rng.random() < 0.7 else b.input(ws)
    if b.rng.random() < 0.2 and len(ws) >= 2:     # the matrix on the left
        xs = ws[:-2] + (int(b.rng.integers(1, 9)), ws[-2])
        lhs = b.input(xs)
        return b.one("MatMul", [lhs, w])
    return b.one("MatMul", [x, w])


def op_gemm(b: Builder) -> str | None:
    x = b.pick(_rank(2, 2))
    if x is None or not b.allows("Gemm"):
        return None
    m, k = b.shapes[x]
    ta, tb = int(b.rng.integers(2)), int(b.rng.integers(2))
    if ta:     # A is stored transposed: Gemm reads (m, k) back
        x = b.node("Transpose", [x], view=True, perm=[1, 0])[0]
    n = int(b.rng.integers(1, 17))
    w = b.fconst((n, k) if tb else (k, n), scale=1 / np.sqrt(k))
    ins = [x, w]
    if b.rng.random() < 0.7:
        cs = [(n,), (1, n), (m, n), (m, 1), ()][b.rng.integers(5)]
        ins.append(b.fconst(cs))
    return b.one("Gemm", ins, transA=ta, transB=tb, alpha=float(b.rng.choice([1.0, 0.5])),
                 beta=float(b.rng.choice([1.0, 2.0])))


def op_softmax(b: Builder) -> str | None:
    x = b.pick(_rank(1, 4))
    if x is None:
        return None
    r = len(b.shapes[x])
    op = b.choose(["Softmax", "Softmax", "Softmax", "LogSoftmax"])
    if op is None:
        return None
    return b.one(op, [x], axis=int(b.rng.integers(-r, r)))


REDUCE = ["ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1",
          "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare"]


def op_reduce(b: Builder) -> str | None:
    x = b.pick(_rank(1, 5))
    if x is None:
        return None
    r = len(b.shapes[x])
    op = b.choose(REDUCE)
    if op is None:
        return None
    k = int(b.rng.integers(1, r + 1))
    axes = sorted(b.rng.choice(r, size=k, replace=False).tolist())
    axes = [a - r if b.rng.random() < 0.3 else a for a in axes]
    keep = int(b.rng.integers(2))
    if op == "ReduceProd":
        x = b.one("Tanh", [x])
    if op == "ReduceSum" or b.opset >= 18:
        ins = [x] if b.rng.random() < 0.1 else [x, b.i64(axes)]
        return b.one(op, ins, keepdims=keep)
    return b.one(op, [x], axes=axes, keepdims=keep)


def op_argmax_cast(b: Builder) -> str | None:
    x = b.pick(_rank(1, 4))
    if x is None:
        return None
    r = len(b.shapes[x])
    # an index result goes back to float so the pool stays float32 (ties are unlikely
    # with continuous inputs)
    i = b.one(str(b.rng.choice(["ArgMax", "ArgMin"])), [x], axis=int(b.rng.integers(-r, r)),
              keepdims=int(b.rng.integers(2)))
    return b.one("Cast", [i], to=F32)


def op_pad(b: Builder) -> str | None:
    x = b.pick(_rank(1, 4))
    if x is None:
        return None
    s = b.shapes[x]
    mode = str(b.rng.choice(["constant", "reflect", "edge"], p=[0.6, 0.2, 0.2]))
    pads = []
    for half in range(2):
        for d in s:
            lo = -(d - 1) // 2 if half == 0 else -(d - 1 - (d - 1) // 2)
            # negative (cropping) pads keep at least one element per axis
            v = int(b.rng.integers(max(lo, -2), 3))
            if mode != "constant":      # cropping with edge/reflect: ORT refuses some
                v = min(max(v, 0), d - 1 if mode == "reflect" else 2)
            pads.append(v)
    ins = [x, b.i64(pads)]
    if mode == "constant" and b.rng.random() < 0.5:
        ins.append(b.const(np.float32(b.rng.standard_normal())))
    return b.one("Pad", ins, mode=mode)


def op_slice(b: Builder) -> str | None:
    x = b.pick(_rank(1, 5))
    if x is None:
        return None
    s = b.shapes[x]
    r = len(s)
    k = int(b.rng.integers(1, r + 1))
    axes = sorted(b.rng.choice(r, size=k, replace=False).tolist())
    starts, ends, steps = [], [], []
    for a in axes:
        d = s[a]
        step = int(b.rng.choice([1, 1, 1, 2, -1, -2]))
        if step > 0:
            st = int(b.rng.integers(0, d))
            en = int(b.rng.integers(st + 1, d + 1))
            if b.rng.random() < 0.2:
                en = 2 ** 31   # "to the end"
            if b.rng.random() < 0.2:
                st = st - d    # negative start
        else:
            st = int(b.rng.integers(0, d))
            en = int(b.rng.integers(-1, st)) if st > 0 else -1
            if en == -1:
                en = -(2 ** 31)   # "to the beginning"
        starts.append(st)
        ends.append(en)
        steps.append(step)
    ins = [x, b.i64(starts), b.i64(ends), b.i64(axes)]
    if any(st != 1 for st in steps) or b.rng.random() < 0.5:
        ins.append(b.i64(steps))
    return b.node("Slice", ins, view=True)[0]


def op_concat(b: Builder) -> str | None:
    x = b.pick(_rank(1, 4))
    if x is None:
        return None
    s = b.shapes[x]
    r = len(s)
    ax = int(b.rng.integers(r))
    parts = [x]
    for _ in range(int(b.rng.integers(1, 4))):
        same = [v for v, t in b.shapes.items()
                if len(t) == r and all(t[i] == s[i] for i in range(r) if i != ax)
                and t[ax] > 0]
        if same and b.rng.random() < 0.7:
            parts.append(same[b.rng.integers(len(same))])
        else:
            t = list(s)
            t[ax] = int(b.rng.integers(1, 4))
            parts.append(b.fconst(tuple(t)) if b.rng.random() < 0.4 else b.input(tuple(t)))
    b.rng.shuffle(parts)
    return b.one("Concat", parts, axis=ax - r if b.rng.random() < 0.3 else ax)


def op_transpose(b: Builder) -> str | None:
    x = b.pick(_rank(2, 5))
    if x is None:
        return None
    perm = b.rng.permutation(len(b.shapes[x])).tolist()
    return b.node("Transpose", [x], view=True, perm=perm)[0]


def _factor(b: Builder, n: int) -> list[int]:
    dims = []
    while n > 1 and len(dims) < 4:
        ds = [d for d in range(2, n + 1) if n % d == 0]
        d = int(ds[b.rng.integers(len(ds))]) if b.rng.random() < 0.8 else n
        dims.append(d)
        n //= d
    if n > 1:
        dims[-1] *= n
    b.rng.shuffle(dims)
    if b.rng.random() < 0.3:
        dims.insert(int(b.rng.integers(len(dims) + 1)), 1)
    return dims or [1]


def op_reshape(b: Builder) -> str | None:
    x = b.pick(_rank(0, 5))
    if x is None:
        return None
    s = b.shapes[x]
    n = int(np.prod(s))
    r = b.rng.random()
    if r < 0.15:
        op = str(b.rng.choice(["Flatten", "Squeeze", "Unsqueeze"]))
        if op == "Flatten" and s:
            return b.node("Flatten", [x], view=True, axis=int(b.rng.integers(0, len(s) + 1)))[0]
        if op == "Squeeze" and 1 in s:
            ax = [i for i, d in enumerate(s) if d == 1]
            return b.node("Squeeze", [x, b.i64(ax[:1])], view=True)[0]
        return b.node("Unsqueeze", [x, b.i64([int(b.rng.integers(0, len(s) + 1))])],
                      view=True)[0]
    dims = _factor(b, n)
    if b.rng.random() < 0.4:
        dims[int(b.rng.integers(len(dims)))] = -1
    if b.rng.random() < 0.2 and len(s) >= 1 and len(dims) >= 1 and dims[0] == s[0]:
        dims[0] = 0   # "copy this dim"
    return b.node("Reshape", [x, b.i64(dims)], view=True)[0]


def op_expand_tile(b: Builder) -> str | None:
    x = b.pick(lambda s: 1 <= len(s) <= 3 and np.prod(s) <= 256)
    if x is None:
        return None
    s = b.shapes[x]
    if b.rng.random() < 0.5:
        tgt = [int(b.rng.integers(2, 4)) if d == 1 else d for d in s]
        if b.rng.random() < 0.3:
            tgt = [2] + tgt
        return b.one("Expand", [x, b.i64(tgt)])
    return b.one("Tile", [x, b.i64([int(b.rng.integers(1, 3)) for _ in s])])


def op_where(b: Builder) -> str | None:
    x = b.pick()
    if x is None:
        return None
    s = b.shapes[x]
    y = b.pick(lambda t: t == s) or x
    cond = b.one(str(b.rng.choice(["Greater", "Less", "GreaterOrEqual"])),
                 [x, b.const(np.float32(b.rng.standard_normal() * 0.5))])
    return b.one("Where", [cond, x, y])


INT_OPS = ["Add", "Sub", "Mul", "Max", "Min", "Abs", "Neg"]


def op_int_chain(b: Builder) -> str | None:
    """Integer arithmetic: Floor(4x) cast to int32/int64 (exact), a few integer ops with
    broadcasting constants, then back to float32 (or left as an integer graph output)."""
    x = b.pick(_rank(0, 4), among=set(b.feeds))     # (Floor: a step, see op_unary)
    if x is None or not b.allows("Cast"):
        return None
    to, dt = [(TensorProto.INT32, np.int32), (TensorProto.INT64, np.int64)][b.rng.integers(2)]
    q = b.one("Cast", [b.one("Floor", [b.one("Mul", [x, b.const(np.float32(4))])])], to=to)
    for _ in range(int(b.rng.integers(1, 4))):
        op = b.choose(INT_OPS) or "Add"
        if op in ("Abs", "Neg"):
            q = b.one(op, [q])
        else:
            sq = b.other[q]     # (a broadcasting constant may have grown it)
            q = b.one(op, [q, b.const(b.rng.integers(-5, 6, size=_bshape(b, sq)).astype(dt))])
    if b.rng.random() < 0.8:
        return b.one("Cast", [q], to=F32)
    return None


def _spatial(b: Builder) -> str:
    """A rank-4 (N, C, H, W) value: from the pool, or a new input."""
    x = b.pick(lambda s: len(s) == 4 and s[2] >= 3 and s[3] >= 3 and np.prod(s) <= 4096)
    if x is None or b.rng.random() < 0.3:
        x = b.input((int(b.rng.integers(1, 3)), int(b.rng.integers(1, 5)),
                     int(b.rng.integers(3, 10)), int(b.rng.integers(3, 10))))
    return x


def op_conv(b: Builder) -> str:
    x = _spatial(b)
    n, c, h, w = b.shapes[x]
    group = 1
    if c > 1 and b.rng.random() < 0.3:
        group = c
    m = int(b.rng.integers(1, 5)) * group
    if group == 1 and b.rng.random() < 0.3:
        # 16-40 output channels: several channel blocks and ragged micro-tile rows, with
        # fused epilogues (the orientation is the cost model's; on these few input channels
        # it is the normal one: tests/ops/test_conv.py forces the swapped one)
        m = int(b.rng.integers(16, 41))
    kh, kw = int(b.rng.integers(1, min(h, 3) + 1)), int(b.rng.integers(1, min(w, 3) + 1))
    wt = b.fconst((m, c // group, kh, kw), scale=1 / np.sqrt(c * kh * kw / group))
    ins = [x, wt] + ([b.fconst((m,))] if b.rng.random() < 0.7 else [])
    attrs = dict(kernel_shape=[kh, kw], group=group)
    if b.rng.random() < 0.5:
        attrs["pads"] = [int(b.rng.integers(0, k)) for k in (kh, kw, kh, kw)]
    if b.rng.random() < 0.3:
        attrs["strides"] = [int(b.rng.integers(1, 3)) for _ in range(2)]
    if b.rng.random() < 0.2:
        attrs["dilations"] = [1, 2] if w >= 2 * kw else [1, 1]
    return b.one("Conv", ins, **attrs)


def op_pool(b: Builder) -> str:
    x = _spatial(b)
    _, _, h, w = b.shapes[x]
    op = str(b.rng.choice(["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"]))
    if op.startswith("Global"):
        return b.one(op, [x])
    k = [int(b.rng.integers(1, min(h, 3) + 1)), int(b.rng.integers(1, min(w, 3) + 1))]
    attrs = dict(kernel_shape=k)
    if b.rng.random() < 0.5:
        attrs["strides"] = [int(b.rng.integers(1, 3)) for _ in range(2)]
    if b.rng.random() < 0.4:
        attrs["pads"] = [int(b.rng.integers(0, kk)) for kk in k + k]
        if op == "AveragePool":
            attrs["count_include_pad"] = int(b.rng.integers(2))
    return b.one(op, [x], **attrs)


def op_norm(b: Builder) -> str | None:
    x = b.pick(_rank(2, 4))
    if x is None:
        return None
    s = b.shapes[x]
    if b.rng.random() < 0.5:
        ax = int(b.rng.integers(-len(s), 0)) if b.rng.random() < 0.7 else -1
        ps = s[ax:]
        # a spread of values over the normalised axes (a nearly constant row makes the
        # normalisation amplify rounding: ill-conditioned, not wrong)
        x = b.one("Add", [x, b.fconst(ps)])
        return b.one("LayerNormalization", [x, b.fconst(ps), b.fconst(ps)], axis=ax,
                     epsilon=1e-5)
    if len(s) < 2:
        return None
    c = s[1]
    var = np.abs(b.rng.standard_normal(c)).astype(np.float32) + 0.5
    return b.one("BatchNormalization", [x, b.fconst((c,)), b.fconst((c,)), b.fconst((c,)),
                                        b.const(var)], epsilon=1e-5)


def op_const_chain(b: Builder) -> str:
    """Nodes over constants only (constant folding): a cropping Pad, a Slice, a Reshape,
    a Concat, ... of an initializer; the result is pooled for later nodes."""
    c = b.fconst(tuple(int(b.rng.integers(2, 6)) for _ in range(int(b.rng.integers(1, 4)))))
    f = [op_pad, op_slice, op_reshape, op_transpose, op_unary, op_softmax, op_reduce]
    saved = dict(b.shapes)
    b.shapes = {c: b.shapes[c]}        # the chain reads only the constant
    try:
        v = f[b.rng.integers(len(f))](b) or c
    finally:
        b.shapes = {**saved, **b.shapes}
    return v


HALF_UNARY = ["Abs", "Neg", "Relu", "Sigmoid", "Tanh", "HardSwish", "LeakyRelu", "Elu",
              "Softplus", "Erf", "Softsign", "Sin", "Cos", "HardSigmoid"]
HALF_OPS = HALF_UNARY + ["Sqrt", "Log", "Exp", "Add", "Sub", "Mul", "Max", "Min", "Div",
                         "MatMul", "Softmax", "ReduceSum", "ReduceMean", "ReduceMax",
                         "Transpose", "Reshape", "Where"]


def _half_operand(b: Builder, s: tuple[int, ...]) -> str:
    """A float16 value that broadcasts onto shape s: pooled, a constant or an input."""
    ys = _bshape(b, s, grow=False)
    pool = [v for v, t in b.other.items() if t == ys and b.dtypes.get(v) == F16]
    if pool and b.rng.random() < 0.4:
        return pool[b.rng.integers(len(pool))]
    if b.rng.random() < 0.5:
        return b.const(b.rng.standard_normal(ys).astype(np.float16), "h", pool=True)
    return b.input(ys, dtype=F16)


def _half_positive(b: Builder, x: str) -> str:
    return b.one("Add", [b.one("Abs", [x]), b.const(np.float16(0.5), "h")])


def op_half(b: Builder) -> str | None:
    """A chain of 1-4 float16 ops on a float16 input, a pooled float16 value or a Cast of
    a float32 pool value; the result stays float16 (not in the float32 pool)."""
    r = b.rng.random()
    x = b.pick(_rank(0, 4), dtype=F16) if r < 0.3 else None
    if x is None and r < 0.7:
        x = b.input(tuple(int(b.rng.integers(1, 6)) for _ in range(int(b.rng.integers(1, 4)))),
                    dtype=F16)
    if x is None:
        f = b.pick(_rank(0, 4))
        if f is None or not b.allows("Cast"):
            return None
        x = b.one("Cast", [b.one("Tanh", [f])], to=F16)
    for _ in range(int(b.rng.integers(1, 5))):
        op = b.choose(HALF_OPS)
        if op is None:
            break
        s = b.other[x]
        if op in HALF_UNARY:
            x = b.one(op, [x])
        elif op in ("Sqrt", "Log"):
            x = b.one(op, [_half_positive(b, x)])
        elif op == "Exp":
            x = b.one("Exp", [b.one("Tanh", [x])])
        elif op == "Div":
            x = b.one("Div", [x, _half_positive(b, _half_operand(b, s))])
        elif op in ("Add", "Sub", "Mul", "Max", "Min"):
            y = _half_operand(b, s)
            x = b.one(op, [y, x] if b.rng.random() < 0.3 else [x, y])
        elif op == "MatMul" and s:
            k, n = s[-1], int(b.rng.integers(1, 9))
            w = (b.rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
            x = b.one("MatMul", [x, b.const(w, "h")])
        elif op == "Softmax" and s:
            x = b.one("Softmax", [x], axis=int(b.rng.integers(-len(s), len(s))))
        elif op.startswith("Reduce") and s:
            ax = int(b.rng.integers(len(s)))
            keep = int(b.rng.integers(2))
            x = (b.one(op, [x, b.i64([ax])], keepdims=keep) if op == "ReduceSum"
                 else b.one(op, [x], axes=[ax], keepdims=keep))
        elif op == "Transpose" and len(s) >= 2:
            x = b.node("Transpose", [x], view=True, perm=b.rng.permutation(len(s)).tolist())[0]
        elif op == "Reshape":
            x = b.node("Reshape", [x, b.i64(_factor(b, int(np.prod(s))))], view=True)[0]
        elif op == "Where":
            y = _half_operand(b, s)
            x = b.one("Where", [_bool_source(b, s), x, y])
    return x


BOOL_LOGIC = ["Not", "And", "Or", "Xor"]
COMPARE = ["Greater", "Less", "GreaterOrEqual", "LessOrEqual"]


def _bool_source(b: Builder, s: tuple[int, ...]) -> str:
    """A bool value broadcasting onto shape s: a comparison of a graph input (float32 or
    float16: exact in both, unlike one of a computed value) with a constant, a pooled
    bool value or a bool graph input."""
    ys = _bshape(b, s, grow=False)
    r = b.rng.random()
    pool = [v for v, t in b.other.items() if t == ys and b.dtypes.get(v) == BOOL]
    if pool and r < 0.3:
        return pool[b.rng.integers(len(pool))]
    if r < 0.5:
        return b.input(ys, dtype=BOOL)
    dt = F16 if b.rng.random() < 0.3 else F32
    x = b.input(ys, dtype=dt)
    c = b.rng.standard_normal(_bshape(b, ys, grow=False)) * 0.5
    op = b.choose(COMPARE) or "Greater"
    c = b.const(c.astype(np.float16 if dt == F16 else np.float32))
    return b.one(op, [c, x] if b.rng.random() < 0.3 else [x, c])


def op_bool(b: Builder) -> str | None:
    """Bool values: comparisons, bool inputs, Not/And/Or/Xor; they end as a bool graph
    output, in a Where over float32 pool values, or Cast to float32 (0/1, exact)."""
    x = b.pick(_rank(0, 4))
    s = b.shapes[x] if x is not None else (int(b.rng.integers(1, 5)),
                                              int(b.rng.integers(1, 5)))
    c = _bool_source(b, s)
    for _ in range(int(b.rng.integers(0, 4))):
        op = b.choose(BOOL_LOGIC)
        if op is None:
            break
        c = b.one("Not", [c]) if op == "Not" else b.one(op, [c, _bool_source(b, b.other[c])])
    r = b.rng.random()
    if x is not None and r < 0.45 and b.allows("Where"):
        y = b.pick(lambda t: t == s) or x
        return b.one("Where", [c, x, y] if b.rng.random() < 0.5 else [c, y, x])
    if r < 0.75 and b.allows("Cast"):
        return b.one("Cast", [c], to=F32)
    return c


# (generator, weight, the op types it makes: `only=` keeps those that can make one)
OPS: list[tuple[Callable[[Builder], str | None], float, tuple[str, ...]]] = [
    (op_unary, 3, tuple(UNARY)), (op_domain_unary, 1.5, ("Sqrt", "Log", "Exp", "Reciprocal",
                                                         "Clip")),
    (op_binary, 4, tuple(BINARY)), (op_matmul, 2, ("MatMul",)), (op_gemm, 0.7, ("Gemm",)),
    (op_softmax, 1.5, ("Softmax", "LogSoftmax")), (op_reduce, 1.5, tuple(REDUCE)),
    (op_argmax_cast, 0.3, ("ArgMax", "ArgMin")), (op_pad, 1.2, ("Pad",)),
    (op_slice, 1.2, ("Slice",)), (op_concat, 1.2, ("Concat",)),
    (op_transpose, 1, ("Transpose",)),
    (op_reshape, 1.2, ("Reshape", "Flatten", "Squeeze", "Unsqueeze")),
    (op_expand_tile, 0.6, ("Expand", "Tile")), (op_where, 0.5, ("Where",)),
    (op_conv, 0.6, ("Conv",)), (op_pool, 0.5, ("MaxPool", "AveragePool", "GlobalAveragePool",
                                               "GlobalMaxPool")),
    (op_norm, 0.5, ("LayerNormalization", "BatchNormalization")),
    (op_const_chain, 0.4, ("Constant",)), (op_int_chain, 0.4, ("Cast",)),
    (op_half, 0.8, tuple(HALF_OPS)),
    (op_bool, 0.6, tuple(BOOL_LOGIC + COMPARE)),
]


@dataclass
class Case:
    seed: int
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    ops: list[str]


def random_model(seed: int, n_nodes: int | None = None,
                 only: frozenset[str] | set[str] | None = None, rng=None) -> Case:
    """The random graph of `seed` (with `only`: its random choices take these op types;
    helper nodes that keep inputs in range, Abs/Add/Tanh, may appear anyway). `rng`
    replaces the seeded numpy Generator as the source of every choice (the hypothesis
    front end, tests/fuzz/hypo.py, passes one that draws them)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    b = Builder(rng, only=frozenset(only) if only else None)
    ops = [o for o in OPS if not only or set(o[2]) & set(only)]
    fns, w, _ = zip(*ops)
    p = np.asarray(w, np.float64) / sum(w)
    # a drawing rng decides node by node whether another follows (so a shrinker can drop
    # one node's choices without shifting the meaning of the rest)
    more = getattr(rng, "another_node", None) if n_nodes is None else None
    n_nodes = n_nodes or (11 if more else int(rng.integers(2, 12)))
    # first inputs
    for _ in range(int(rng.integers(1, 3))):
        r = int(rng.integers(1, 5))
        b.input(tuple(int(rng.integers(1, 7)) for _ in range(r)))
    made: list[str] = []
    tries = 0
    while (len(made) < n_nodes if more is None else more(len(made), n_nodes)) \
            and tries < 4 * n_nodes:
        tries += 1
        fn = fns[rng.choice(len(fns), p=p)]
        v = fn(b)
        if v is not None and np.prod(b.shape(v)) <= 1 << 16:
            made.append(v)
    outputs = _choose_outputs(b, made)
    return Case(seed, b.model(outputs), b.feeds, b.tags)


def _choose_outputs(b: Builder, made: list[str]) -> list[str]:
    r = b.rng
    node_outs = [o for nd in b.nodes for o in nd.output]
    consumed = {v for nd in b.nodes for v in nd.input}
    outs = [v for v in node_outs if v not in consumed]      # the sinks
    extra = [v for v in node_outs if v in consumed]
    r.shuffle(extra)
    outs += extra[:int(r.integers(0, 3))]                   # intermediates read elsewhere
    views = [v for v in node_outs if v in b.views and v not in outs]
    if views and r.random() < 0.4:
        outs.append(views[r.integers(len(views))])
    if r.random() < 0.1:
        outs.append(b.inputs[r.integers(len(b.inputs))].name)   # an output that is an input
    cs = [v for v in node_outs if v in b.consts and v not in outs]
    if cs and r.random() < 0.3:
        outs.append(cs[r.integers(len(cs))])                    # a folded constant
    if not outs:              # no node was made (every try found no input that fits)
        outs.append(b.inputs[0].name)
    if r.random() < 0.05:     # the same value under a second name (Identity)
        outs.append(b.one("Identity", [outs[r.integers(len(outs))]]))
    seen: set[str] = set()
    return [o for o in outs if not (o in seen or seen.add(o))]
