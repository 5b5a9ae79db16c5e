"""The ORT EP's native compute (cannc/ort/_shim.c) driven directly, without an ORT session:
a fake OrtApi (a table of 420 slots, ctypes callbacks at the ones cannc_compute uses), a
fake kernel context holding numpy inputs, real cannc programs behind the node."""

from __future__ import annotations

import ctypes
import subprocess
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cannc
from cannc.errors import CanncError
from cannc.ort import _native
from tests.helpers import ort_run

_vp, _i64, _sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
ORT_FAIL, ORT_INVALID_ARGUMENT = 1, 2


class FakeOrt:
    """The OrtApi slots cannc_compute calls, over Python objects named by handles."""

    def __init__(self) -> None:
        self.table = (_vp * 420)()
        self.statuses: dict[int, tuple[int, str]] = {}
        self.objs: dict[int, object] = {}
        self.released = 0
        self._next = 0x1000
        self._lock = threading.Lock()
        T = ctypes.CFUNCTYPE
        self._cbs = {
            0: T(_vp, ctypes.c_int, ctypes.c_char_p)(self.create_status),
            51: T(_vp, _vp, ctypes.POINTER(_vp))(self.get_data),
            61: T(_vp, _vp, ctypes.POINTER(_sz))(self.dims_count),
            62: T(_vp, _vp, ctypes.POINTER(_i64), _sz)(self.dims),
            65: T(_vp, _vp, ctypes.POINTER(_vp))(self.type_and_shape),
            90: T(_vp, _vp, _sz, ctypes.POINTER(_vp))(self.get_input),
            91: T(_vp, _vp, _sz, ctypes.POINTER(_i64), _sz, ctypes.POINTER(_vp))(self.get_output),
            99: T(None, _vp)(self.release_info),
        }
        for slot, cb in self._cbs.items():
            self.table[slot] = ctypes.cast(cb, _vp)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.table)

    def handle(self, obj: object) -> int:
        with self._lock:
            self._next += 16
            self.objs[self._next] = obj
            return self._next

    def create_status(self, code: int, msg: bytes) -> int:
        h = self.handle(None)
        self.statuses[h] = (code, msg.decode())
        return h

    def get_data(self, value: int, out: object) -> None:
        out[0] = self.objs[value].ctypes.data

    def type_and_shape(self, value: int, out: object) -> None:
        out[0] = self.handle(("info", self.objs[value].shape))

    def dims_count(self, info: int, out: object) -> None:
        out[0] = len(self.objs[info][1])

    def dims(self, info: int, dims: object, n: int) -> None:
        for i, d in enumerate(self.objs[info][1][:n]):
            dims[i] = d

    def release_info(self, info: int) -> None:
        with self._lock:
            del self.objs[info]
            self.released += 1

    def get_input(self, kctx: int, i: int, out: object) -> None:
        v = self.objs[kctx].inputs[i]
        out[0] = None if v is None else self.handle(v)

    def get_output(self, kctx: int, i: int, dims: object, n: int, out: object) -> None:
        k = self.objs[kctx]
        a = np.empty(tuple(dims[j] for j in range(n)), k.out_dtypes[i])
        k.outputs[i] = a
        out[0] = self.handle(a)

    def context(self, inputs: list, out_dtypes: list) -> int:
        return self.handle(KernelContext(inputs, out_dtypes))


class KernelContext:
    def __init__(self, inputs: list, out_dtypes: list) -> None:
        self.inputs = inputs
        self.out_dtypes = out_dtypes
        self.outputs: dict[int, np.ndarray] = {}


def run(fake: FakeOrt, node: _native.NativeNode, inputs: list, out_dtypes: list
        ) -> list[np.ndarray]:
    kctx = fake.context([np.ascontiguousarray(a) for a in inputs], out_dtypes)
    st = node.compute(kctx)
    if st:
        raise AssertionError(f"compute failed: {fake.statuses[st]}")
    k = fake.objs.pop(kctx)
    return [k.outputs[i] for i in range(len(out_dtypes))]


def status(fake: FakeOrt, node: _native.NativeNode, inputs: list, out_dtypes: list
           ) -> tuple[int, str]:
    st = node.compute(fake.context(inputs, out_dtypes))
    assert st, "compute succeeded where it must fail"
    return fake.statuses[st]


# -- models -------------------------------------------------------------------------------

def two_in_two_out() -> onnx.ModelProto:
    """a, b [n, 16] -> relu(a + b), (a + b) * b."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 16])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 16])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, ["n", 16])
    p = helper.make_tensor_value_info("p", TensorProto.FLOAT, ["n", 16])
    nodes = [helper.make_node("Add", ["a", "b"], ["t"]), helper.make_node("Relu", ["t"], ["s"]),
             helper.make_node("Mul", ["t", "b"], ["p"])]
    return helper.make_model(helper.make_graph(nodes, "g", [a, b], [s, p]),
                             opset_imports=[helper.make_opsetid("", 17)])


def mlp() -> onnx.ModelProto:
    """x [n, 64] -> MatMul(64x256) + Add, Relu -> MatMul(256x8): tiles for two cores."""
    rng = np.random.default_rng(0)
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [64, 256],
                            rng.standard_normal((64, 256)).astype(np.float32).ravel())
    b1 = helper.make_tensor("b1", TensorProto.FLOAT, [256],
                            rng.standard_normal(256).astype(np.float32))
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [256, 8],
                            rng.standard_normal((256, 8)).astype(np.float32).ravel())
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "mlp", [x], [y], [w1, b1, w2]),
                             opset_imports=[helper.make_opsetid("", 17)])


def make_node(sess: cannc.Session, fake: FakeOrt, *, cores: int = 1, profile: bool = False,
              specialize=None, **kw) -> _native.NativeNode:
    g = sess.graph
    in_ndim = [len(g.values[n].shape) for n in g.inputs]
    out_ndim = [len(g.values[n].shape) for n in g.outputs]

    def spec(shapes):
        prog = sess.specialize(dict(zip(g.inputs, shapes)))
        return _native.program_record(prog, prog.acquire(), profile=profile)

    return _native.NativeNode(fake.address, in_ndim, out_ndim, cores=cores,
                              specialize=specialize or spec, **kw)


@pytest.fixture(scope="module")
def mlp_sess():
    return cannc.compile(mlp(), cores=2, eager=False)


@pytest.fixture(scope="module")
def add_sess():
    return cannc.compile(two_in_two_out(), cores=2, eager=False)


# -- tests ----------------------------------------------------------------------------------

def test_library_builds_and_exports():
    path = _native.library_path()
    assert path == _native.library_path()
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True,
                         text=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if " T " in line}
    assert {"CreateEpFactories", "ReleaseEpFactory", "cannc_ep_set_callbacks",
            "cannc_node_new", "cannc_node_add_program", "cannc_node_free", "cannc_compute",
            "cannc_pool_reserve"} <= exported
    assert not any(s.startswith(("job_", "get_", "launch_", "worker_")) for s in exported)
    assert _native.load() is _native.load()


def test_entry_points_without_hooks_give_no_factories():
    lib = _native.load()
    n = ctypes.c_size_t(7)
    facs = (_vp * 4)()
    assert lib.CreateEpFactories(b"cannc", None, None, facs, 4, ctypes.byref(n)) is None
    assert n.value == 0
    assert lib.ReleaseEpFactory(None) is None


def test_entry_points_forward_to_hooks():
    lib = _native.load()
    seen = []

    @_native.CREATE_FACTORIES_FN
    def create(name, api_base, logger, facs, maxf, num):
        seen.append((name, api_base, maxf))
        facs[0] = 0x1234
        num[0] = 1
        return None

    @_native.RELEASE_FACTORY_FN
    def release(f):
        seen.append(("release", f))
        return None

    lib.cannc_ep_set_callbacks(create, release)
    try:
        n = ctypes.c_size_t(0)
        facs = (_vp * 4)()
        assert lib.CreateEpFactories(b"cannc", 0x77, None, facs, 4, ctypes.byref(n)) is None
        assert n.value == 1 and facs[0] == 0x1234
        lib.ReleaseEpFactory(0x1234)
    finally:
        lib.cannc_ep_set_callbacks(_native.CREATE_FACTORIES_FN(), _native.RELEASE_FACTORY_FN())
    assert seen == [(b"cannc", 0x77, 4), ("release", 0x1234)]
    n = ctypes.c_size_t(5)
    lib.CreateEpFactories(b"cannc", None, None, facs, 4, ctypes.byref(n))
    assert n.value == 0       # unhooked


@pytest.mark.parametrize("cores", [1, 2])
def test_outputs_equal_ort_and_new_shapes_specialise_once(add_sess, cores):
    fake = FakeOrt()
    node = make_node(add_sess, fake, cores=cores, name="fused_0", input_names=["a", "b"])
    rng = np.random.default_rng(cores)
    f32 = [np.float32, np.float32]
    try:
        for n in (3, 5, 3, 5, 1, 3):
            a = rng.standard_normal((n, 16)).astype(np.float32)
            b = rng.standard_normal((n, 16)).astype(np.float32)
            got = run(fake, node, [a, b], f32)
            want = ort_run(two_in_two_out(), {"a": a, "b": b})
            for g, w in zip(got, want):
                assert g.shape == w.shape
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        assert node.specialize_calls == 3          # n = 3, 5, 1: once each
        assert len(node.records) == 3
        assert fake.released > 0 and not [o for o in fake.objs.values()
                                          if isinstance(o, tuple)]  # every info released
    finally:
        node.free()


def test_program_added_up_front_needs_no_specialize(mlp_sess):
    fake = FakeOrt()
    node = make_node(mlp_sess, fake, cores=2)
    try:
        prog = mlp_sess.specialize({"x": (4, 64)})
        node.add_program(_native.program_record(prog, prog.acquire()))
        x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
        (y,) = run(fake, node, [x], [np.float32])
        np.testing.assert_allclose(y, ort_run(mlp(), {"x": x})[0], rtol=1e-4, atol=1e-4)
        assert node.specialize_calls == 0
        with pytest.raises(CanncError, match="have a program already"):
            prog2 = mlp_sess.specialize({"x": (4, 64)})
            node.add_program(_native.program_record(prog2, prog2.acquire()))
    finally:
        node.free()


def test_eight_threads_at_once_all_correct(mlp_sess):
    fake = FakeOrt()
    node = make_node(mlp_sess, fake, cores=2)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((n, 64)).astype(np.float32) for n in (2, 7)]
    want = [ort_run(mlp(), {"x": x})[0] for x in xs]
    bad: list[str] = []
    barrier = threading.Barrier(8)

    def worker(t: int) -> None:
        barrier.wait()
        for i in range(100):
            k = (t + i) % 2
            try:
                (y,) = run(fake, node, [xs[k]], [np.float32])
                if not np.allclose(y, want[k], rtol=1e-4, atol=1e-4):
                    bad.append(f"thread {t} call {i}: wrong result")
            except Exception as e:
                bad.append(f"thread {t} call {i}: {e}")

    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not bad, bad[:5]
        assert node.specialize_calls == 2                 # two shapes, racing threads
        assert len(node.records) == 2
        assert all(1 <= r.num_contexts <= 8 for r in node.records.values())
        assert any(r.num_contexts > 1 for r in node.records.values())   # grown under load
    finally:
        node.free()


def test_profiling_sums_grow(mlp_sess):
    fake = FakeOrt()
    node = make_node(mlp_sess, fake, cores=2, profile=True)
    x = np.ones((8, 64), np.float32)
    try:
        run(fake, node, [x], [np.float32])
        (rec,) = node.records.values()
        p1, n1 = rec.profile()
        for _ in range(4):
            run(fake, node, [x], [np.float32])
        p2, n2 = rec.profile()
        assert (n1, n2) == (1, 5)
        assert p1.shape == (rec.nk, 2) and rec.nk >= 1
        assert (p1 > 0).all() and (p2 > p1).all()
        assert (p2[:, 1] > 0).all()      # busy cycles summed over the cores
    finally:
        node.free()


def test_pool_workers_join_launches(mlp_sess):
    assert _native.load().cannc_pool_reserve(2) == 0
    workers, joined0 = _native.pool_stats()
    assert workers >= 1
    fake = FakeOrt()
    node = make_node(mlp_sess, fake, cores=2)
    x = np.ones((64, 64), np.float32)
    try:
        for _ in range(50):
            run(fake, node, [x], [np.float32])
    finally:
        node.free()
    assert _native.pool_stats()[1] > joined0
    assert _native.load().cannc_pool_reserve(0) == -1


def test_wrong_rank_and_missing_input_give_error_status(add_sess):
    fake = FakeOrt()
    node = make_node(add_sess, fake, name="fused_7", input_names=["a", "b"])
    a = np.ones((2, 16), np.float32)
    try:
        code, msg = status(fake, node, [a, np.ones((2, 16, 1), np.float32)],
                           [np.float32] * 2)
        assert code == ORT_INVALID_ARGUMENT
        assert "fused_7" in msg and "input 1 'b'" in msg and "rank 3" in msg
        assert "expected rank 2" in msg
        code, msg = status(fake, node, [a, None], [np.float32] * 2)
        assert code == ORT_INVALID_ARGUMENT and "'b' is missing" in msg
        assert node.specialize_calls == 0
        assert not [o for o in fake.objs.values() if isinstance(o, tuple)]
    finally:
        node.free()


def test_specialize_failure_is_an_error_status(add_sess):
    fake = FakeOrt()

    def boom(shapes):
        raise CanncError(f"cannot compile for {shapes}")

    node = make_node(add_sess, fake, specialize=boom)
    try:
        code, msg = status(fake, node, [np.ones((2, 16), np.float32)] * 2, [np.float32] * 2)
        assert code == ORT_FAIL and "cannot compile for ((2, 16), (2, 16))" in msg
        # a wrong record is refused with a message, not run
        node._specialize = lambda shapes: _native.program_record(
            *(lambda p: (p, p.acquire()))(add_sess.specialize({"a": (3, 16), "b": (3, 16)})))
        code, msg = status(fake, node, [np.ones((2, 16), np.float32)] * 2, [np.float32] * 2)
        assert "not ((2, 16), (2, 16))" in msg
    finally:
        node.free()


def test_node_free_waits_for_computes(add_sess):
    fake = FakeOrt()
    entered, go = threading.Event(), threading.Event()

    def slow(shapes):
        entered.set()
        go.wait(10)
        prog = add_sess.specialize(dict(zip(("a", "b"), shapes)))
        return _native.program_record(prog, prog.acquire())

    node = make_node(add_sess, fake, specialize=slow)
    a = np.full((4, 16), 2.0, np.float32)
    result: dict = {}
    computing = threading.Thread(
        target=lambda: result.setdefault("out", run(fake, node, [a, a], [np.float32] * 2)))
    computing.start()
    assert entered.wait(10)
    handle = node.handle
    freeing = threading.Thread(target=lambda: node.lib.cannc_node_free(handle))
    freeing.start()
    time.sleep(0.2)
    assert freeing.is_alive()                  # a compute is still inside
    code, msg = status(fake, node, [a, a], [np.float32] * 2)   # closing: refused
    assert "being released" in msg
    go.set()
    computing.join(10)
    freeing.join(10)
    assert not freeing.is_alive() and not computing.is_alive()
    node.handle = None                          # freed above
    np.testing.assert_array_equal(result["out"][0], np.full((4, 16), 4.0, np.float32))
    np.testing.assert_array_equal(result["out"][1], np.full((4, 16), 8.0, np.float32))


def test_bad_arguments_are_cannc_errors(add_sess):
    fake = FakeOrt()
    with pytest.raises(CanncError, match="cores"):
        _native.NativeNode(fake.address, [2], [2], cores=0)
    with pytest.raises(CanncError, match="refused"):
        _native.NativeNode(fake.address, [99], [2])
    with pytest.raises(CanncError, match="runtime Program"):
        _native.program_record(object(), None)
    prog = add_sess.specialize({"a": (2, 16), "b": (2, 16)})
    free_ctx = prog._new_context()
    with pytest.raises(CanncError, match="acquire"):
        _native.program_record(prog, free_ctx)
    node = make_node(add_sess, fake, cores=4)
    try:   # a program laid out for 2 cores on a 4-core node
        code, msg = status(fake, node, [np.ones((2, 16), np.float32)] * 2, [np.float32] * 2)
        assert "laid out for 2 cores" in msg
    finally:
        node.free()


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(CanncError, match="building cannc's ORT shim"):
        _native.build(tmp_path)
    monkeypatch.delenv("CC")
    monkeypatch.setattr(_native.shutil, "which", lambda name: None)
    with pytest.raises(CanncError, match="no C compiler"):
        _native.build(tmp_path)


def test_build_into_cache_is_keyed_by_source_hash(tmp_path):
    out = _native.build(tmp_path)
    assert out.name == f"_shim-{_native.source_hash()}.so"
    assert (_native.HASH_TAG + _native.source_hash().encode()) in out.read_bytes()
    assert _native.build(tmp_path) == out      # built once


# -- per-call overhead, native fake OrtApi (no Python inside a call) --------------------------

FAKE_C = r"""
#include <stdint.h>
#include <stddef.h>
typedef struct { int64_t n; float* in[2]; int64_t dims[2]; float* out[2]; } kctx;
typedef struct { kctx* k; int i; } val;
static val vals[8];
static void* create_status(int c, const char* m) { (void)c; (void)m; return (void*)1; }
static void* get_input(const void* k, size_t i, const void** out) {
  vals[i].k = (kctx*)k; vals[i].i = (int)i; *out = &vals[i]; return NULL; }
static void* type_shape(const void* v, void** out) { *out = (void*)v; return NULL; }
static void* dims_count(const void* info, size_t* out) { (void)info; *out = 2; return NULL; }
static void* dims(const void* info, int64_t* d, size_t n) {
  const val* v = info; (void)n; d[0] = v->k->dims[0]; d[1] = v->k->dims[1]; return NULL; }
static void release(void* info) { (void)info; }
static void* data(void* v, void** out) {
  val* x = v; *out = x->i >= 4 ? (void*)x->k->out[x->i - 4] : (void*)x->k->in[x->i];
  return NULL; }
static void* get_output(void* k, size_t i, const int64_t* d, size_t n, void** out) {
  (void)d; (void)n; vals[4 + i].k = k; vals[4 + i].i = 4 + (int)i; *out = &vals[4 + i];
  return NULL; }
void* table[420];
void* fake_api(void) {
  table[0] = create_status; table[51] = data; table[61] = dims_count; table[62] = dims;
  table[65] = type_shape; table[90] = get_input; table[91] = get_output; table[99] = release;
  return table; }
typedef void* (*compute_fn)(void*, void*, void*);
int64_t loop(compute_fn f, void* node, kctx* k, int64_t n) {
  for (int64_t i = 0; i < n; i++) if (f(NULL, node, k)) return i;
  return n; }
"""


class KCtx(ctypes.Structure):
    _fields_ = [("n", _i64), ("inp", _vp * 2), ("dims", _i64 * 2), ("out", _vp * 2)]


def test_per_call_overhead_vs_session_run(add_sess, tmp_path, capsys):
    src = tmp_path / "fake.c"
    src.write_text(FAKE_C)
    so = tmp_path / "fake.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    fk = ctypes.CDLL(str(so))
    fk.fake_api.restype = _vp
    fk.loop.restype = _i64
    fk.loop.argtypes = [_vp, _vp, ctypes.POINTER(KCtx), _i64]
    sess = cannc.compile(two_in_two_out(), cores=1, shapes={"a": (1, 16), "b": (1, 16)})
    prog = sess.specialize({"a": (1, 16), "b": (1, 16)})
    node = _native.NativeNode(fk.fake_api(), [2, 2], [2, 2], cores=1)
    try:
        node.add_program(_native.program_record(prog, prog.acquire()))
        a = np.arange(16, dtype=np.float32).reshape(1, 16)
        b = np.ones((1, 16), np.float32)
        s, p = np.empty_like(a), np.empty_like(a)
        k = KCtx(2, (_vp * 2)(a.ctypes.data, b.ctypes.data), (_i64 * 2)(1, 16),
                 (_vp * 2)(s.ctypes.data, p.ctypes.data))
        fn = _native.compute_address()
        assert fk.loop(fn, node.handle, ctypes.byref(k), 1) == 1
        np.testing.assert_array_equal(s, np.maximum(a + b, 0))
        np.testing.assert_array_equal(p, (a + b) * b)
        n = 20000
        t0 = time.perf_counter()
        assert fk.loop(fn, node.handle, ctypes.byref(k), n) == n
        native_us = (time.perf_counter() - t0) / n * 1e6
        feeds = {"a": a, "b": b}
        for _ in range(200):
            sess.run(None, feeds)
        m = 2000
        t0 = time.perf_counter()
        for _ in range(m):
            sess.run(None, feeds)
        run_us = (time.perf_counter() - t0) / m * 1e6
    finally:
        node.free()
    with capsys.disabled():
        print(f"\ncannc_compute (native loop, 1 core, 3 ops 1x16): {native_us:.2f} us/call; "
              f"Session.run: {run_us:.2f} us/call")
    assert native_us < run_us
