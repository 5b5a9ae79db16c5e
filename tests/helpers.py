"""Helpers shared by the tests (and benchmarks): compare cannc with onnxruntime
(and with the NumPy reference); aligned arrays for calling kernels directly."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.ir.types import NP_TO_ONNX
from cannc.runtime.memory import aligned_empty


def aligned(shape: int | Sequence[int], dtype: Any = np.float32,
            offset_elems: int = 0) -> np.ndarray:
    """A zero-filled C-contiguous array whose data starts 64-byte aligned, or
    ``offset_elems`` elements past that (to test misaligned data); an int
    ``shape`` gives a 1-D array."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    buf = aligned_empty((n + offset_elems) * dt.itemsize, 64).view(dt)
    return buf[offset_elems:offset_elems + n].reshape(shape)


def guarded(a: np.ndarray, before: bool = False) -> np.ndarray:
    """A C-contiguous copy of `a` that ends where a page no one may read begins (or,
    ``before``, starts where one ends): a kernel that reads a byte past the caller's
    array faults instead of reading a neighbour's bytes. Sessions read their inputs in
    place (runtime.program.HostIO); the op and model tests feed them arrays like this."""
    a = np.asarray(a)   # (np.ascontiguousarray makes a 0-d array 1-d)
    page = mmap.PAGESIZE
    pages = -(-max(a.nbytes, 1) // page) + 1
    m = mmap.mmap(-1, pages * page)
    raw = (ctypes.c_char * (pages * page)).from_buffer(m)
    guard = ctypes.addressof(raw) + (0 if before else (pages - 1) * page)
    assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(guard), page, 0) == 0
    start = page if before else (pages - 1) * page - a.nbytes
    out = np.frombuffer(m, np.uint8, a.nbytes, start).view(a.dtype).reshape(a.shape)
    out[...] = a
    return out      # (it holds the mapping)


def guarded_feeds(feeds: dict[str, np.ndarray], before: bool = False) -> dict[str, np.ndarray]:
    """`feeds` with every numeric array guarded (strings stay as they are)."""
    return {k: guarded(v, before) if isinstance(v, np.ndarray) and v.dtype.kind not in "OUS"
            else v for k, v in feeds.items()}


def tile_ranges(num_tiles: int, cores: int) -> list[tuple[int, int]]:
    """[0, num_tiles) split into ``cores`` contiguous ranges, as the runtime splits it."""
    return [(i * num_tiles // cores, (i + 1) * num_tiles // cores) for i in range(cores)]


def run_concurrently(kernel: Callable, argv: Any, ranges: Sequence[tuple[int, int]],
                     workspaces: Sequence[int]) -> None:
    """One call of the ABI ``kernel`` per tile range, each on a thread of its own
    with its own workspace pointer, as the runtime's cores make them (the JIT
    functions release the GIL); a single range runs on the calling thread."""
    if len(ranges) == 1:
        kernel(argv, ranges[0][0], ranges[0][1], workspaces[0])
        return
    threads = [threading.Thread(target=kernel, args=(argv, lo, hi, ws))
               for (lo, hi), ws in zip(ranges, workspaces)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def in_threads(fn: Callable[[int], None], n: int) -> None:
    """fn(0) .. fn(n-1), each on a thread of its own, all at once; the first exception any
    of them raised is raised here once all have finished."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:   # (raised below, on the caller's thread)
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


WS_GUARD = np.float32(-12345.5)  # the floats around a test's workspace


def run_splits(kernel: Callable, argv: Any, num_tiles: int, ws_bytes: int,
               splits: Sequence[int] | None = None, ws_fill: float = np.nan) -> None:
    """Call the ABI ``kernel`` over [0, num_tiles) in the consecutive ranges
    between ``splits`` (default: the halves two cores get), one after the other,
    with an empty range before and after. The workspace (``ws_bytes``, filled
    with ``ws_fill``) has 64 guard floats on either side that must stay intact."""
    g, n = 64, ws_bytes // 4
    ws = aligned(n + 2 * g)
    ws[:] = WS_GUARD
    ws[g:g + n] = ws_fill
    ws_ptr = ws.ctypes.data + 4 * g
    kernel(argv, 0, 0, ws_ptr)
    if splits is None:
        splits = [0, num_tiles // 2, num_tiles]
    for lo, hi in itertools.pairwise(splits):
        kernel(argv, lo, hi, ws_ptr)
    kernel(argv, num_tiles, num_tiles, ws_ptr)
    assert np.all(ws[:g] == WS_GUARD) and np.all(ws[g + n:] == WS_GUARD), (
        "kernel wrote outside its workspace"
    )


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], threads: int = 1) -> list:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def check_session(sess: Any, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list:
    """One run of a cannc session against onnxruntime on the same model and feeds: every
    output's shape and dtype equal, floats within rtol 1e-4 / atol 1e-5, the rest exact.
    cannc reads the inputs from arrays that end at a page no one may read (guarded)."""
    got = sess.run(None, guarded_feeds(feeds))
    want = ort_run(model, feeds)
    assert len(got) == len(want)
    for g, e in zip(got, want):
        assert g.shape == e.shape and g.dtype == e.dtype
        if e.dtype.kind == "f":
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
        else:
            np.testing.assert_array_equal(g, e)
    return got


def single_node_model(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
                      opset: int = 17, const_inputs: Sequence[int] = (), domain: str = "",
                      output_dtypes: Sequence[Any] | None = None, **attrs: Any
                      ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A model with one node. inputs[i] None means an absent optional input; indices in
    const_inputs become initializers, the others graph inputs (returned as feeds)."""
    names, graph_inputs, inits, feeds = [], [], [], {}
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        nm = f"in{i}"
        names.append(nm)
        a = np.asarray(a)
        if i in const_inputs:
            inits.append(numpy_helper.from_array(a, nm))
        else:
            graph_inputs.append(helper.make_tensor_value_info(nm, NP_TO_ONNX[a.dtype], a.shape))
            feeds[nm] = a
    outs = [f"out{j}" for j in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, domain=domain or None, **attrs)
    out_vi = []
    for j, o in enumerate(outs):
        et = (TensorProto.UNDEFINED if output_dtypes is None
              else NP_TO_ONNX[np.dtype(output_dtypes[j])])
        out_vi.append(helper.make_tensor_value_info(o, et, None))
    g = helper.make_graph([node], f"{op_type.lower()}_test", graph_inputs, out_vi,
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = min(m.ir_version, 9)
    # let ONNX fill in the output types so the checker is satisfied
    m = onnx.shape_inference.infer_shapes(m)
    for vi in m.graph.output:
        for v in m.graph.value_info:
            if v.name == vi.name:
                vi.CopyFrom(v)
    return m, feeds


def assert_matches_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                       rtol: float = 1e-4, atol: float = 1e-5, cores: int = 2,
                       **compile_opts: Any) -> list[np.ndarray]:
    """Compile with cannc, run, and compare every output with onnxruntime:
    same dtype, same shape, values within tolerance (exact for ints/bools)."""
    expected = ort_run(model, feeds)
    sess = cannc.compile(model, cores=cores, shapes={k: v.shape for k, v in feeds.items()},
                         **compile_opts)
    got = sess.run(None, guarded_feeds(feeds))
    assert len(got) == len(expected)
    for g, e, o in zip(got, expected, model.graph.output):
        e = np.asarray(e)
        assert g.dtype == e.dtype, f"{o.name}: dtype {g.dtype} != {e.dtype}"
        assert g.shape == e.shape, f"{o.name}: shape {g.shape} != {e.shape}"
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=o.name)
        else:
            np.testing.assert_array_equal(g, e, err_msg=o.name)
    return got


def check_op(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
             opset: int = 17, const_inputs: Sequence[int] = (), rtol: float = 1e-4,
             atol: float = 1e-5, cores: int = 2, **attrs: Any) -> list[np.ndarray]:
    """Single-node model: cannc vs onnxruntime."""
    m, feeds = single_node_model(op_type, inputs, n_outputs, opset, const_inputs, **attrs)
    return assert_matches_ort(m, feeds, rtol=rtol, atol=atol, cores=cores)


def model_of(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
             outputs: Sequence[onnx.ValueInfoProto], inits: Sequence[onnx.TensorProto] = (),
             name: str = "dyn", opset: int = 17) -> onnx.ModelProto:
    """A model of these nodes (IR version kept loadable by the installed onnxruntime)."""
    g = helper.make_graph(list(nodes), name, list(inputs), list(outputs), initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = min(m.ir_version, 9)
    return m


def with_dynamic_dims(model: onnx.ModelProto, dims: dict[str, dict[int, str]]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs have symbolic dims: ``{input: {axis: name}}``
    (e.g. ``{"x": {0: "batch", 1: "seq"}}``); output dims become unknown (rank kept)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for vi in m.graph.input:
        for axis, name in dims.get(vi.name, {}).items():
            d = vi.type.tensor_type.shape.dim[axis]
            d.Clear()
            d.dim_param = name
    for vi in m.graph.output:
        for d in vi.type.tensor_type.shape.dim:
            d.Clear()
    return m


def check_runtime_dims(model: onnx.ModelProto, feeds_list: Sequence[dict[str, np.ndarray]],
                       rtol: float = 1e-4, atol: float = 1e-5, cores: int = 2,
                       **compile_opts: Any) -> cannc.Session:
    """Shape-polymorphic kernels: compile ``model`` (symbolic input dims) once,
    run it at the first feeds (this generates the code), then at every other
    feeds with *no* lowering and no LLVM compile; every run matches onnxruntime."""
    from cannc.compiler import codegen_counts
    sess = cannc.compile(model, cores=cores, **compile_opts)
    seen: set[str] = set()
    for i, feeds in enumerate(feeds_list):
        before = codegen_counts()
        got = sess.run(None, feeds)
        after = codegen_counts()
        # every kernel's code and signature (its lowering-memo key) so far: checked
        # independently of warm caches, which would hide a shape-dependent key
        symbols = {s for spec in sess.specializations for k in spec.kernels
                   for s in (k.symbol, k.signature)}
        if i > 0:
            shapes = {k: v.shape for k, v in feeds.items()}
            assert symbols <= seen, (f"run {i} (shapes {shapes}) needed kernels not compiled "
                                     f"before: {sorted(symbols - seen)[:4]}")
            assert after == before, (f"run {i} (shapes {shapes}) generated code: "
                                     f"lowerings/LLVM compiles {before} -> {after}")
        seen |= symbols
        expected = ort_run(model, feeds)
        for g, e, o in zip(got, expected, model.graph.output):
            e = np.asarray(e)
            assert g.dtype == e.dtype and g.shape == e.shape, \
                f"{o.name}: {g.dtype}{g.shape} != {e.dtype}{e.shape}"
            if e.dtype.kind in "fc":
                np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"run {i}: {o.name}")
            else:
                np.testing.assert_array_equal(g, e, err_msg=f"run {i}: {o.name}")
    return sess


# ---------------------------------------------------------------------------------------
# one pass on a small graph: before / after
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphState:
    """What a pass test compares: the nodes' op types in order, every value's type
    (dtype name, shape) and the constants' values."""

    ops: list[str]
    values: dict[str, tuple[str, tuple[int, ...]]]
    constants: dict[str, np.ndarray]


@dataclass(frozen=True)
class PassRun:
    changed: bool
    before: GraphState
    after: GraphState
    graph: Any          # the graph after the pass (cannc.ir.graph.Graph)


def graph_state(g: Any) -> GraphState:
    return GraphState([n.op_type for n in g.nodes()],
                      {v: (np.dtype(t.dtype).name, tuple(t.shape)) for v, t in g.values.items()},
                      {k: np.array(a) for k, a in g.constants.items()})


def pass_graph(nodes: Sequence[onnx.NodeProto], inputs: dict[str, tuple[Any, Sequence[int]]],
               outputs: Sequence[str], inits: dict[str, np.ndarray] | None = None,
               opset: int = 17) -> Any:
    """An IR graph of these nodes with concrete types (inputs: name -> (dtype, shape)), as
    the passes after `infer_and_fold` see it, but nothing folded."""
    from cannc.frontend import import_model
    from cannc.passes.fold import bind_input_shapes, infer_node

    vis = [helper.make_tensor_value_info(n, NP_TO_ONNX[np.dtype(dt)], list(s))
           for n, (dt, s) in inputs.items()]
    outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs]
    inits_ = [numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()]
    m = onnx.shape_inference.infer_shapes(model_of(nodes, vis, outs, inits_, name="pass_test",
                                                   opset=opset))
    for vi in m.graph.output:       # the outputs' types as ONNX infers them (the checker)
        for v in m.graph.value_info:
            if v.name == vi.name:
                vi.CopyFrom(v)
    g, _ = import_model(m)
    bind_input_shapes(g, {n: tuple(s) for n, (_, s) in inputs.items()})
    for n in g.nodes():
        for v, t in zip(n.outputs, infer_node(g, n)):
            if v and t is not None:
                g.values[v] = t
    return g


def run_pass(name: str, g: Any, *, fusion: Any = True, **options: Any) -> PassRun:
    """Run the ONE pass `name` on graph g (verified before and after), with the fusion
    switches and the pass's own options given; returns the graph's state before and after."""
    from cannc.passes.manager import PassContext, PassManager

    ctx = PassContext(fusion=fusion, pass_options={name: options} if options else {})
    pm = PassManager([name], ctx, verify=True)
    before = graph_state(g)
    pm.run(g)
    return PassRun(pm.records[0].changed, before, graph_state(g), g)


def restrict_host_to_avx2(monkeypatch: Any) -> None:
    """Make the host target an AVX2 one (as ``CANNC_ISA=avx2`` does; the object cache is
    keyed by its features) for the test, or skip it where that cannot mean anything: an
    AVX2-only host (its kernels are the AVX2 ones already) or one without AVX2/FMA."""
    import dataclasses

    import pytest

    from cannc.native import target
    h = target.host()
    if not h.has("avx512f"):
        pytest.skip("the host is AVX2 only: the other tests run its AVX2 kernels")
    if not h.has("avx2") or not h.has("fma"):
        pytest.skip("the host lacks AVX2/FMA")
    monkeypatch.setattr(target, "_host", dataclasses.replace(
        h, features=target.restrict_isa(h.features, "avx2")))
    assert not target.host().has("avx512f")
