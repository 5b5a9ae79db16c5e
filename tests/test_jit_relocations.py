"""MCJIT maps an object's code and data sections separately; 32-bit PC-relative
relocations between them abort the process (RuntimeDyldELF `isInt<32>(RealOffset)`) when
a fragmented address space puts them > 2 GiB apart. cannc emits the large code model
(cannc/native/target.py CODE_MODEL): only 64-bit relocations, any placement links."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cannc.native import target

ROOT = Path(__file__).resolve().parents[1]
# x86-64 relocation types with a 32-bit field relative to the place (or to the GOT)
PC32_LIKE = {2: "PC32", 4: "PLT32", 9: "GOTPCREL", 26: "GOTPC32", 41: "GOTPCRELX",
             42: "REX_GOTPCRELX"}


def _relocation_types(obj: bytes) -> set[int]:
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    types = set()
    for i in range(shnum):
        sh = struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize)
        if sh[1] == 4:       # SHT_RELA
            for off in range(sh[4], sh[4] + sh[5], sh[9]):
                info, = struct.unpack_from("<Q", obj, off + 8)
                types.add(info & 0xFFFFFFFF)
    return types


IR = """
@tab = internal constant [4 x float] [float 1.0, float 2.0, float 3.0, float 4.0]
declare float @expf(float)
define float @probe(i64 %i, float %x) {
  %p = getelementptr [4 x float], ptr @tab, i64 0, i64 %i
  %v = load float, ptr %p
  %e = call float @expf(float %x)
  %r = fadd float %v, %e
  %w = fmul float %r, 3.5
  ret float %w
}
"""


@pytest.mark.skipif(not target.host().triple.startswith("x86_64"), reason="x86-64 ELF")
def test_objects_have_no_32bit_pc_relative_relocations():
    """A table, a constant-pool literal, an external call and .eh_frame: all 64-bit."""
    found = _relocation_types(target.optimise_and_emit(IR, "probe"))
    assert found and not found & set(PC32_LIKE), sorted(PC32_LIKE[t] for t in found
                                                          if t in PC32_LIKE)
    import ctypes
    lib = target.jit_library(IR, "probe")
    f = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int64, ctypes.c_float)(lib.address("probe"))
    assert f(2, 0.0) == 14.0


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or not target.host().triple.startswith("x86_64"), reason="Linux x86-64")
def test_sections_placed_far_apart_still_link(tmp_path):
    """benchmarks/jit_address_space.py craft: one free page above a 3 GiB hole, so the
    first section MCJIT maps lands > 3 GiB from the others (the small code model aborts
    there, 3 of 3 runs); the compiled model runs and is right."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from jit_address_space import CHILD
    finally:
        sys.path.pop(0)
    env = dict(os.environ, CANNC_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", CHILD, "craft", "large", "1"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "ok: compiled and ran" in p.stdout, p.stdout + p.stderr


def test_an_intrinsic_the_target_lacks_is_a_compile_error():
    """LLVM aborts the process on an x86 intrinsic the target cannot select; cannc checks
    the module's intrinsics against the target's features first."""
    from cannc.errors import CompileError
    from cannc.native.target import HostTarget, host, isa_missing

    ir_text = ('declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512'
               '(<16 x float>, <32 x bfloat>, <32 x bfloat>)\n'
               'define void @f() {\n  ret void\n}\n')
    h = host()
    no_bf16 = HostTarget(h.triple, h.cpu, ",".join(
        f for f in h.features.split(",") if f != "+avx512bf16"))
    assert isa_missing(ir_text, no_bf16) == ("llvm.x86.avx512bf16.dpbf16ps.512", "avx512bf16")
    assert isa_missing("define void @g() {\n  ret void\n}\n", no_bf16) is None
    if not h.has("avx512bf16"):
        from cannc.native.target import optimise_and_emit
        with pytest.raises(CompileError, match="avx512bf16"):
            optimise_and_emit(ir_text, "f")
