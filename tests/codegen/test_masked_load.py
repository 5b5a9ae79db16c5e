"""cannc.native.emit.masked_load: the one way codegen emits a masked load.

LLVM 22 lowers a ``llvm.masked.load`` wider than a ymm register wrongly on an AVX2
target when one 256-bit half of its mask folds to all-false (an assertion in
llvmlite's LLVM; inside a kernel, a load that read masked-off lanes: Zen 3, a
depthwise Conv 9 wide). These tests build exactly those masks, on this host's
target, and check that every masked-off lane takes the pass-through value; the
last one runs the Conv that showed it with the AVX2 code on any host
(``CANNC_ISA=avx2``).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from llvmlite import ir

from cannc.native.emit import I32, I64, PTR, const_lanes, masked_load
from cannc.native.target import jit_library

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VM = ir.VectorType(ir.IntType(1), 16)

PATTERNS = [
    [1] * 8 + [0] * 8,          # upper ymm half all-false: the miscompiled case
    [1] * 4 + [0] * 12,
    [0] * 8 + [1] * 8,
    [1] * 12 + [0] * 4,
    [1] * 16,
    [0] * 16,
    [1, 0] * 8,
]
TYPES = [(ir.FloatType(), np.float32), (ir.IntType(32), np.int32),
         (ir.IntType(16), np.int16), (ir.IntType(8), np.int8)]


def _kernel(et: ir.Type, pattern: list[int], runtime_mask: bool) -> ir.Module:
    """void f(ptr src, ptr dst, i32 ok): dst[0:16] = masked_load(src + 1,
    select(ok, pattern, 0)) with pass-through 0 (or the pattern itself when
    ``runtime_mask``: a mask LLVM cannot see through)."""
    m = ir.Module(name="mload")
    vt = ir.VectorType(et, 16)
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [PTR, PTR, I32, PTR]), name="f")
    b = ir.IRBuilder(fn.append_basic_block())
    ok = b.icmp_signed("!=", fn.args[2], ir.Constant(I32, 0))
    if runtime_mask:   # the pattern read from memory as bytes
        raw = b.load(fn.args[3], typ=ir.VectorType(ir.IntType(8), 16), align=1)
        mask = b.icmp_unsigned("!=", raw, ir.Constant(raw.type, None))
    else:
        mask = ir.Constant(VM, pattern)
    mask = b.select(ok, mask, ir.Constant(VM, None))
    src = b.gep(fn.args[0], [ir.Constant(I64, 1)], source_etype=et)
    v = masked_load(b, src, mask, ir.Constant(vt, None))
    b.store(v, fn.args[1], align=1)
    b.ret_void()
    return m


@pytest.mark.parametrize("runtime_mask", [False, True], ids=["const", "runtime"])
@pytest.mark.parametrize("ty", TYPES, ids=[t[1].__name__ for t in TYPES])
def test_masked_lanes_take_the_pass_through(ty, runtime_mask):
    et, dt = ty
    for k, pat in enumerate(PATTERNS):
        lib = jit_library(_kernel(et, pat, runtime_mask), f"mload{k}")
        f = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                             ctypes.c_void_p)(lib.address("f"))
        src = np.arange(1, 40).astype(dt)
        pbytes = np.array(pat, np.uint8)
        for ok in (1, 0):
            dst = np.full(16, -7, dt)
            f(src.ctypes.data, dst.ctypes.data, ok, pbytes.ctypes.data)
            want = np.where(np.array(pat, bool) & bool(ok), src[1:17], 0).astype(dt)
            np.testing.assert_array_equal(dst, want, err_msg=f"mask {pat} ok={ok}")


def test_const_lanes_sees_through_what_codegen_builds():
    fn = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), [ir.IntType(1), I64]), "g")
    b = ir.IRBuilder(fn.append_basic_block())
    vi = ir.VectorType(I64, 4)
    vm = ir.VectorType(ir.IntType(1), 4)
    sel = b.select(fn.args[0], ir.Constant(vm, [1, 1, 0, 0]), ir.Constant(vm, None))
    assert const_lanes(sel) == [None, None, 0, 0]
    lanes = b.add(ir.Constant(vi, [-1] * 4), ir.Constant(vi, [0, 1, 2, 3]))
    assert const_lanes(b.icmp_signed("<", lanes, ir.Constant(vi, [2] * 4))) == [1, 1, 1, 0]
    assert const_lanes(b.icmp_unsigned("<", lanes, ir.Constant(vi, [2] * 4))) == [0, 1, 1, 0]
    ins = b.insert_element(ir.Constant(vi, None), fn.args[1], ir.Constant(I32, 0))
    splat = b.shuffle_vector(ins, ins, ir.Constant(ir.VectorType(I32, 4), [0] * 4))
    assert const_lanes(splat) == [None] * 4
    unknown = b.icmp_signed("<", splat, ir.Constant(vi, None))
    assert const_lanes(b.and_(sel, unknown)) == [None, None, 0, 0]
    assert const_lanes(b.or_(sel, ir.Constant(vm, [0, 1, 0, 1]))) == [None, 1, 0, 1]
    assert const_lanes(fn.args[1]) is None


def test_depthwise_conv_9_wide_with_avx2_code():
    """The case that showed it (Zen 3): a depthwise 3x3 Conv whose output row is 9 wide,
    compiled for AVX2 whatever the host, against onnxruntime."""
    script = textwrap.dedent("""
        import numpy as np, onnx, onnxruntime as ort
        from onnx import helper, TensorProto, numpy_helper
        import cannc
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 16, 10, 9)).astype(np.float32)
        w = rng.standard_normal((16, 1, 3, 3)).astype(np.float32)
        node = helper.make_node("Conv", ["x", "w"], ["y"], group=16, pads=[1, 1, 1, 1])
        g = helper.make_graph([node], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(w, "w")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        want = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
        got = cannc.compile(m, cores=1).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        print("ok")
    """)
    env = dict(os.environ, CANNC_ISA="avx2", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
