"""A mutator of malformed models and wrong feeds: every case must end in a cannc error or a
correct result (compared with onnxruntime), never a crash, a hang or a raw exception.

Cases are numbered: case i of seed s is rebuilt from (s, i) alone, so a failure is
reproduced by `python -m tests.fuzz_malformed --seed s --case i`. The cases run in a
worker subprocess (a segfault or an abort in native code kills the worker, not the
campaign), each under a timeout the parent enforces; a dead or hung worker is restarted
at the next case. Failing cases are saved as reproducers (`--save DIR`: the mutated model
and a JSON description); reproducers kept under `regressions/` are replayed by
tests/test_malformed.py.

    python -m tests.fuzz_malformed --minutes 30            # a long campaign
    python -m tests.fuzz_malformed --seed 7 --case 123 -v  # one case, in this process

Mutations: truncation and bit flips of the serialised model; wrong, huge (2^40, 2^62),
negative and zero dims of inputs, outputs, value_info and initializers; huge or negative
values of the int64 constants that decide shapes (Reshape, Expand, Tile,
ConstantOfShape); dangling inputs, cycles, duplicate names; bad attributes (wrong
type, out-of-range, missing, unknown); bad opsets and unknown domains and ops; wrong
element types and damaged initializer data; and, on a valid model, wrong feeds (names,
dtypes, ranks, shapes, non-contiguous and misaligned arrays, object arrays, scalars,
huge strided views, None).
"""

from __future__ import annotations

import json
import os
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

HUGE = [1 << 40, 1 << 62, (1 << 63) - 1, 1 << 31, 1 << 20]
ODD_DIMS = HUGE + [-1, -7, 0, 3, 1]


# -- base models: small, valid, covering shape-computing chains ----------------------------

def _vi(name: str, et: int = T.FLOAT, shape: Any = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, et, shape)


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _c(name: str, a: Any, dtype: Any = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(a, dtype), name)


def base_models() -> list[tuple[str, onnx.ModelProto]]:
    rng = np.random.default_rng(0)
    out = []
    out.append(("linear", _model(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Add", ["h", "b"], ["h2"], name="add"),
         helper.make_node("Relu", ["h2"], ["y"], name="relu")],
        [_vi("x", shape=["batch", 8])], [_vi("y", shape=["batch", 4])],
        [_c("W", rng.standard_normal((8, 4))), _c("b", rng.standard_normal(4))])))
    out.append(("reshape_chain", _model(
        [helper.make_node("Shape", ["x"], ["s"], name="shape"),
         helper.make_node("Gather", ["s", "i0"], ["n"], name="gather", axis=0),
         helper.make_node("Concat", ["n", "m1"], ["t"], name="concat", axis=0),
         helper.make_node("Reshape", ["x", "t"], ["r"], name="reshape"),
         helper.make_node("Softmax", ["r"], ["y"], name="softmax", axis=-1)],
        [_vi("x", shape=["batch", 3, 4])], [_vi("y", shape=["batch", 12])],
        [_c("i0", [0], np.int64), _c("m1", [-1], np.int64)])))
    out.append(("expand_tile", _model(
        [helper.make_node("Expand", ["x", "es"], ["e"], name="expand"),
         helper.make_node("Tile", ["e", "reps"], ["t"], name="tile"),
         helper.make_node("ConstantOfShape", ["cs"], ["z"], name="cos",
                          value=helper.make_tensor("v", T.FLOAT, [1], [0.5])),
         helper.make_node("Add", ["t", "z"], ["y"], name="add")],
        [_vi("x", shape=[1, 4])], [_vi("y", shape=[6, 8])],
        [_c("es", [3, 4], np.int64), _c("reps", [2, 2], np.int64),
         _c("cs", [6, 8], np.int64)])))
    out.append(("conv_pool", _model(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1],
                          kernel_shape=[3, 3]),
         helper.make_node("MaxPool", ["c"], ["p"], name="pool", kernel_shape=[2, 2],
                          strides=[2, 2]),
         helper.make_node("ReduceMean", ["p"], ["y"], name="mean", axes=[2, 3],
                          keepdims=0)],
        [_vi("x", shape=["n", 2, 6, 6])], [_vi("y", shape=["n", 3])],
        [_c("w", rng.standard_normal((3, 2, 3, 3)))], opset=13)))
    out.append(("gather_cast", _model(
        [helper.make_node("Gather", ["E", "ids"], ["g"], name="gather", axis=0),
         helper.make_node("Transpose", ["g"], ["t"], name="transpose", perm=[1, 0]),
         helper.make_node("Cast", ["t"], ["y"], name="cast", to=T.FLOAT16)],
        [_vi("ids", T.INT64, ["k"])], [_vi("y", T.FLOAT16, [5, "k"])],
        [_c("E", rng.standard_normal((10, 5)))])))
    return out


# -- mutations -------------------------------------------------------------------------------

def _pick_dims(m: onnx.ModelProto, r: random.Random) -> list:
    dims = []
    for vi in list(m.graph.input) + list(m.graph.output) + list(m.graph.value_info):
        if vi.type.HasField("tensor_type"):
            dims.extend(vi.type.tensor_type.shape.dim)
    return dims


def mut_dim(m: onnx.ModelProto, r: random.Random) -> str:
    dims = _pick_dims(m, r)
    if not dims:
        return "no dims"
    d = r.choice(dims)
    v = r.choice(ODD_DIMS)
    d.Clear()
    d.dim_value = v
    return f"a declared dim set to {v}"


def mut_init_dims(m: onnx.ModelProto, r: random.Random) -> str:
    if not m.graph.initializer:
        return "no initializers"
    t = r.choice(m.graph.initializer)
    a = numpy_helper.to_array(t)
    how = r.choice(["huge-nodata", "extra-dim", "drop-dim", "zero", "negative"])
    if how == "huge-nodata":
        t.dims[:] = [r.choice(HUGE)] + list(t.dims[1:])
    elif how == "extra-dim":
        t.dims.append(r.choice([2, 1 << 30]))
    elif how == "drop-dim" and t.dims:
        del t.dims[-1]
    elif how == "zero":
        t.dims[:] = [0] + list(t.dims[1:])
    else:
        t.dims[:] = [-2] + list(t.dims[1:])
    return f"initializer {t.name} {list(a.shape)} -> dims {list(t.dims)} ({how})"


def mut_shape_values(m: onnx.ModelProto, r: random.Random) -> str:
    ints = [t for t in m.graph.initializer if t.data_type == T.INT64]
    if not ints:
        return mut_dim(m, r)
    t = r.choice(ints)
    a = numpy_helper.to_array(t).copy()
    if a.size == 0:
        return "empty"
    a.flat[r.randrange(a.size)] = r.choice(ODD_DIMS + [-(1 << 62), -2])
    t.CopyFrom(numpy_helper.from_array(a, t.name))
    return f"int64 constant {t.name} -> {a.tolist()}"


def mut_dangling(m: onnx.ModelProto, r: random.Random) -> str:
    n = r.choice(m.graph.node)
    if not n.input:
        return "no inputs"
    i = r.randrange(len(n.input))
    n.input[i] = "nowhere_" + str(r.randrange(100))
    return f"node {n.name} input {i} dangles"


def mut_cycle(m: onnx.ModelProto, r: random.Random) -> str:
    nodes = m.graph.node
    if len(nodes) < 2 or not nodes[0].input:
        n = nodes[0]
        n.input[0] = n.output[0]      # a self-loop
        return "self loop"
    nodes[0].input[0] = nodes[-1].output[0]
    return f"{nodes[0].name} reads {nodes[-1].output[0]}: a cycle"


def mut_duplicate(m: onnx.ModelProto, r: random.Random) -> str:
    g = m.graph
    how = r.choice(["output", "input", "init", "node-name", "graph-output"])
    if how == "output" and len(g.node) >= 2:
        g.node[1].output[0] = g.node[0].output[0]
    elif how == "input" and g.input:
        g.input.append(g.input[0])
    elif how == "init" and g.initializer:
        g.initializer.append(g.initializer[0])
    elif how == "graph-output":
        g.output.append(g.output[0])
    else:
        for n in g.node:
            n.name = "same"
    return f"duplicate {how}"


def _huge_tensor() -> onnx.TensorProto:
    t = onnx.TensorProto(name="v", data_type=T.FLOAT)
    t.dims.append(1 << 40)      # declares 2^40 elements, holds none
    return t


_BAD_ATTRS: list[Callable[[], onnx.AttributeProto]] = [
    lambda: helper.make_attribute("axis", 1 << 40),
    lambda: helper.make_attribute("axis", -99),
    lambda: helper.make_attribute("axes", [7, -9]),
    lambda: helper.make_attribute("perm", [0, 0]),
    lambda: helper.make_attribute("pads", [-5, 1 << 40, 0]),
    lambda: helper.make_attribute("kernel_shape", [0, 0]),
    lambda: helper.make_attribute("strides", [0, -1]),
    lambda: helper.make_attribute("to", 999),
    lambda: helper.make_attribute("keepdims", "yes"),
    lambda: helper.make_attribute("nonsense", 1.5),
    lambda: helper.make_attribute("value", _huge_tensor()),
]


def mut_attr(m: onnx.ModelProto, r: random.Random) -> str:
    n = r.choice(m.graph.node)
    if n.attribute and r.random() < 0.4:
        a = r.choice(n.attribute)
        n.attribute.remove(a)
        return f"node {n.name}: attribute {a.name} removed"
    a = r.choice(_BAD_ATTRS)()
    for old in list(n.attribute):
        if old.name == a.name:
            n.attribute.remove(old)
    n.attribute.append(a)
    return f"node {n.name}: attribute {a.name} = {helper.get_attribute_value(a)!r:.60}"


def mut_opset(m: onnx.ModelProto, r: random.Random) -> str:
    how = r.choice(["version", "none", "domain", "op", "ir"])
    if how == "version":
        v = r.choice([0, 1, 6, 8, 11, 99, 10000])
        m.opset_import[0].version = v
        return f"opset {v}"
    if how == "none":
        del m.opset_import[:]
        return "no opset_import"
    if how == "domain":
        n = r.choice(m.graph.node)
        n.domain = r.choice(["com.nonexistent", "ai.onnx.ml", "com.microsoft"])
        return f"node {n.name} in domain {n.domain}"
    if how == "op":
        n = r.choice(m.graph.node)
        n.op_type = r.choice(["NoSuchOp", "relu", "", "If", "Loop"])
        return f"node {n.name} op {n.op_type!r}"
    m.ir_version = r.choice([0, 1, 3, 99])
    return f"ir_version {m.ir_version}"


def mut_types(m: onnx.ModelProto, r: random.Random) -> str:
    how = r.choice(["input-type", "init-type", "init-data", "string-input", "no-type"])
    g = m.graph
    if how == "input-type" and g.input:
        g.input[0].type.tensor_type.elem_type = r.choice([0, 8, 99, T.COMPLEX64, T.BOOL])
        return f"input type {g.input[0].type.tensor_type.elem_type}"
    if how == "init-type" and g.initializer:
        t = r.choice(g.initializer)
        t.data_type = r.choice([0, 99, T.STRING, T.INT8, T.DOUBLE])
        return f"initializer {t.name} data_type {t.data_type}"
    if how == "init-data" and g.initializer:
        t = r.choice(g.initializer)
        a = numpy_helper.to_array(t)
        t.CopyFrom(numpy_helper.from_array(a, t.name))
        t.raw_data = t.raw_data[: r.randrange(max(len(t.raw_data), 1))]
        return f"initializer {t.name} raw data truncated to {len(t.raw_data)}"
    if how == "string-input" and g.input:
        g.input[0].type.tensor_type.elem_type = T.STRING
        return "string input"
    if g.input:
        g.input[0].type.Clear()
    return "input without a type"


MODEL_MUTATIONS: dict[str, Callable[[onnx.ModelProto, random.Random], str]] = {
    "dim": mut_dim, "init_dims": mut_init_dims, "shape_values": mut_shape_values,
    "dangling": mut_dangling, "cycle": mut_cycle, "duplicate": mut_duplicate,
    "attr": mut_attr, "opset": mut_opset, "types": mut_types,
}
BYTE_MUTATIONS = ["truncate", "bitflip"]
FEED_MUTATIONS = ["name", "missing", "dtype", "rank", "shape", "noncontig", "misaligned",
                  "object", "scalar", "huge_view", "none", "list", "fortran", "not_dict",
                  "inconsistent_dims", "big_endian", "bool"]
KINDS = ["model"] * 6 + ["bytes"] * 2 + ["feeds"] * 2


def _mutate(kind: str, m: onnx.ModelProto, r: random.Random) -> str:
    """Apply one mutation; one that does not apply to what earlier ones left (e.g. reading
    an initializer a previous mutation damaged) is skipped, deterministically."""
    try:
        return MODEL_MUTATIONS[kind](m, r)
    except Exception as e:
        return f"{kind}: not applicable ({type(e).__name__})"


@dataclass
class Case:
    seed: int
    index: int
    base: str
    kind: str
    what: str
    model: bytes
    feed_mutation: str | None = None

    def describe(self) -> str:
        return f"seed {self.seed} case {self.index}: {self.base}, {self.kind}: {self.what}"


def make_case(seed: int, index: int) -> Case:
    """Case `index` of `seed`, rebuilt deterministically."""
    r = random.Random(seed * 1_000_003 + index)
    bases = base_models()
    name, m = bases[r.randrange(len(bases))]
    kind = r.choice(KINDS)
    if kind == "model":
        muts = r.sample(sorted(MODEL_MUTATIONS), r.choice([1, 1, 1, 2]))
        what = "; ".join(_mutate(k, m, r) for k in muts)
        return Case(seed, index, name, kind, what, m.SerializeToString())
    data = m.SerializeToString()
    if kind == "bytes":
        how = r.choice(BYTE_MUTATIONS)
        if how == "truncate":
            cut = r.randrange(len(data))
            return Case(seed, index, name, kind, f"truncated at {cut}/{len(data)}", data[:cut])
        b = bytearray(data)
        flips = [r.randrange(len(b)) for _ in range(r.choice([1, 2, 8]))]
        for p in flips:
            b[p] ^= 1 << r.randrange(8)
        return Case(seed, index, name, kind, f"bits flipped at {flips}", bytes(b))
    fm = r.choice(FEED_MUTATIONS)
    return Case(seed, index, name, kind, f"feed: {fm}", data, feed_mutation=fm)


# -- running one case ------------------------------------------------------------------------

def _good_feeds(sess: Any, rng: np.random.Generator) -> dict[str, np.ndarray] | None:
    feeds = {}
    total = 0
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 2 for d in i.shape]
        n = int(np.prod(shape)) if shape else 1
        total += n
        if total > 1 << 22:
            return None          # a legal but big input: compiling it was the test
        dt = {"tensor(float)": np.float32, "tensor(int64)": np.int64,
              "tensor(float16)": np.float16, "tensor(int32)": np.int32,
              "tensor(double)": np.float64, "tensor(bool)": np.bool_}.get(i.type)
        if dt is None:
            return None
        if np.dtype(dt).kind in "iu":
            feeds[i.name] = rng.integers(0, 3, shape).astype(dt)
        elif dt is np.bool_:
            feeds[i.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(dt)
    return feeds


def _bad_feeds(how: str, good: dict[str, np.ndarray], r: random.Random) -> Any:
    name = next(iter(good))
    a = good[name]
    f = dict(good)
    if how == "name":
        f["not_" + name] = f.pop(name)
    elif how == "missing":
        f.pop(name)
    elif how == "dtype":
        f[name] = a.astype(np.float64 if a.dtype != np.float64 else np.float32)
    elif how == "rank":
        f[name] = a[None]
    elif how == "shape":
        f[name] = np.concatenate([a, a], axis=-1) if a.ndim else a
    elif how == "noncontig":
        big = np.repeat(a, 2, axis=-1) if a.ndim else a
        f[name] = big[..., ::2] if a.ndim else a            # the same values, strided
    elif how == "misaligned":
        if a.nbytes:
            raw = np.zeros(a.nbytes + 1, np.uint8)
            v = np.ndarray(a.shape, a.dtype, raw.data, 1)   # one byte off alignment
            v[...] = a
            f[name] = v
    elif how == "object":
        f[name] = a.astype(object)
    elif how == "scalar":
        f[name] = 1.0
    elif how == "huge_view":
        f[name] = np.lib.stride_tricks.as_strided(a, (1 << 40,) + a.shape[1:],
                                                  (0,) + a.strides[1:]) if a.ndim else a
    elif how == "none":
        f[name] = None
    elif how == "list":
        f[name] = a.tolist()
    elif how == "fortran":
        f[name] = np.asfortranarray(a)
    elif how == "not_dict":
        return list(good.values())
    elif how == "inconsistent_dims":
        f[name] = np.concatenate([a, a], axis=0) if a.ndim else a
    elif how == "big_endian":
        f[name] = a.astype(a.dtype.newbyteorder(">"))
    elif how == "bool":
        f[name] = a.astype(bool)
    return f


def _same(a: np.ndarray, b: np.ndarray, nonfinite_weights: bool = False) -> bool:
    """Equal within 1e-3. With non-finite weights (a bit flip made a NaN or inf), where NaN
    shows up is engine-defined (ONNX leaves it open; onnxruntime's MaxPool keeps or drops a
    NaN depending on its place in the window), so elements non-finite on either side are
    not compared."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f":
        x, y = a.astype(np.float64), b.astype(np.float64)
        if nonfinite_weights:
            keep = np.isfinite(x) & np.isfinite(y)
            x, y = x[keep], y[keep]
        return bool(np.allclose(x, y, rtol=1e-3, atol=1e-3, equal_nan=True))
    return bool(np.array_equal(a, b))


def _nonfinite_weights(model: bytes) -> bool:
    try:
        m = onnx.load_from_string(model)
        return any(not np.all(np.isfinite(a)) for a in
                   (onnx.numpy_helper.to_array(t) for t in m.graph.initializer)
                   if a.dtype.kind == "f")
    except Exception:
        return False


def _ort(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    """onnxruntime's outputs, or None when it refuses the model or the feeds."""
    try:
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.log_severity_level = 4
        s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        return s.run(None, feeds)
    except Exception:
        return None


def run_case(case: Case) -> tuple[str, str]:
    """(outcome, detail): 'ok', 'error' (a cannc error: fine), 'raw' (any other
    exception), 'mismatch' (a wrong answer)."""
    import cannc
    r = random.Random(case.index)
    rng = np.random.default_rng(case.index)
    stage = "compile"
    try:
        sess = cannc.compile(case.model, cores=1)
        stage = "run"
        good = _good_feeds(sess, rng)
        if good is None:
            return "ok", "compiled (inputs too big or untyped to run)"
        if case.feed_mutation is not None:
            bad = _bad_feeds(case.feed_mutation, good, r)
            outs = sess.run(None, bad)
            if isinstance(bad, dict):
                try:
                    std = {k: np.ascontiguousarray(np.asarray(v)) for k, v in bad.items()}
                except Exception:
                    std = None
                ref = _ort(case.model, std) if std is not None else None
                if ref is not None and not all(_same(a, b) for a, b in zip(outs, ref)):
                    return "mismatch", f"accepted feed {case.feed_mutation} gave a wrong answer"
            stage = "run_async"
            sess.run_async(None, bad).result(timeout=60)
            return "ok", f"feed {case.feed_mutation} accepted"
        outs = sess.run(None, good)
        ref = _ort(case.model, good)
        if ref is not None:
            tainted = _nonfinite_weights(case.model)
            for o, (a, b) in zip(sess.get_outputs(), zip(outs, ref)):
                if not _same(a, b, tainted):
                    return "mismatch", f"output {o.name}: cannc {a.shape} vs ort {b.shape}"
        return "ok", "compiled and ran"
    except cannc.CanncError as e:
        return "error", f"{stage}: {type(e).__name__}: {str(e)[:200]}"
    except Exception as e:
        tb = traceback.format_exc().splitlines()[-8:]
        return "raw", f"{stage}: {type(e).__name__}: {str(e)[:200]}\n" + "\n".join(tb)


def save_reproducer(case: Case, outcome: str, detail: str, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, f"s{case.seed}_c{case.index}_{outcome}")
    with open(stem + ".onnx", "wb") as f:
        f.write(case.model)
    with open(stem + ".json", "w") as f:
        json.dump({"seed": case.seed, "case": case.index, "base": case.base,
                   "kind": case.kind, "what": case.what,
                   "feed_mutation": case.feed_mutation,
                   "outcome": outcome, "detail": detail}, f, indent=1)
    return stem


def load_reproducer(stem: str) -> Case:
    with open(stem + ".json") as f:
        d = json.load(f)
    with open(stem + ".onnx", "rb") as f:
        model = f.read()
    return Case(d["seed"], d["case"], d["base"], d["kind"], d["what"], model,
                d.get("feed_mutation"))
