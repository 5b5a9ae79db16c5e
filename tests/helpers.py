"""Helpers shared by the tests (and benchmarks): compare cannc with onnxruntime
(and with the NumPy reference); aligned arrays for calling kernels directly."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Sequence

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
        et = TensorProto.UNDEFINED if output_dtypes is None else NP_TO_ONNX[np.dtype(output_dtypes[j])]
        out_vi.append(helper.make_tensor_value_info(o, et, None))
    g = helper.make_graph([node], f"{op_type.lower()}_test", graph_inputs, out_vi, initializer=inits)
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
    got = sess.run(None, feeds)
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
