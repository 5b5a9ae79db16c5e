"""Reproducer: MCJIT relocations across sections placed > 2 GiB apart abort the process.

    python benchmarks/jit_address_space.py [craft] [--model small|large|both]
    python benchmarks/jit_address_space.py soak [--sessions 3000] [--model ...]

MCJIT's SectionMemoryManager maps an object's code and its read-only data (constant
pools, tables, .eh_frame) separately, each wherever the kernel finds room. With the
small code model (what cannc used before: codemodel="default", reloc="pic") code
reaches its constants, and .eh_frame its code, through 32-bit PC-relative relocations;
when a long-lived process has fragmented its address space, two sections of one
object can land more than 2 GiB apart and RuntimeDyldELF's `isInt<32>(RealOffset)`
assertion kills the process (SIGABRT). The large code model (CODE_MODEL =
("large", "static") in cannc/native/target.py) has only 64-bit relocations.

Every case runs in a child process (it may abort), with its own cache directory:

- craft: makes the situation deterministically. It maps a 3 GiB PROT_NONE region,
  fills every gap of the address space above it, then frees one page there: the next
  small mapping (the first section MCJIT maps) lands in that page and every later one
  below the 3 GiB region. A tiny model (Exp, Mul by a constant, Add) is compiled once
  before (so the second compile is all cache hits), then compiled again and run.
- soak: --sessions JIT sessions in one process, each between random mappings of
  1 page-3 GiB (PROT_NONE, so free) kept alive or released at random, the way a server
  holding big tensors of many models fragments its address space.

The child's exit status is printed: -6 is SIGABRT (the assertion), 0 a clean run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(r"""
    import ctypes, os, random, sys
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    mode, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import cannc
    from cannc.native import target
    target.CODE_MODEL = {"small": ("default", "pic"), "large": ("large", "static")}[model]

    def tiny(k):
        c = numpy_helper.from_array(np.full((4, 8), 1.0 + k, np.float32), "c")
        g = helper.make_graph(
            [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Mul", ["e", "c"], ["m"]),
             helper.make_node("Add", ["m", "x"], ["y"])], "tiny",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [c])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)

    def check(k):
        y = cannc.compile(tiny(k)).run(None, {"x": x})[0]
        np.testing.assert_allclose(y, np.exp(x) * (1.0 + k) + x, rtol=1e-5, atol=1e-6)

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    PROT_NONE, FLAGS = 0, 0x02 | 0x20 | 0x4000   # MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
    PAGE = os.sysconf("SC_PAGE_SIZE")

    def reserve(size):
        p = libc.mmap(None, size, PROT_NONE, FLAGS, -1, 0)
        assert p not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        return p

    if mode == "craft":
        check(0)                                   # everything compiled and cached
        big = reserve(3 << 30)
        fillers, size = [], 1 << 30
        while size >= PAGE:                        # fill every gap above `big`
            p = reserve(size)
            if p > big:
                fillers.append((p, size))
                continue
            libc.munmap(p, size)
            size //= 2
        page = next(p for p, s in reversed(fillers) if s == PAGE) if any(
            s == PAGE for _, s in fillers) else fillers[-1][0]
        libc.munmap(page, PAGE)                    # the one free page above `big`
        print(f"3 GiB hole at {big:#x}, {len(fillers)} fillers, free page {page:#x}",
              flush=True)
        check(0)
        print("ok: compiled and ran after fragmentation", flush=True)
    else:
        rng = random.Random(1)
        live = []
        for i in range(n):
            for _ in range(rng.randint(0, 3)):
                if live and rng.random() < 0.5:
                    p, s = live.pop(rng.randrange(len(live)))
                    libc.munmap(p, s)
                else:
                    s = rng.choice([PAGE, 2 * PAGE, 8 * PAGE, 64 << 20, 1 << 30, 3 << 30])
                    live.append((reserve(s), s))
            check(i % 8)
            if i % 500 == 0:
                print(f"session {i}", flush=True)
        print(f"ok: {n} sessions", flush=True)
""")


def run(mode: str, model: str, n: int, timeout: float) -> int:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CANNC_CACHE_DIR=cache,
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, mode, model, str(n)], env=env,
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{mode} {model}: timeout after {timeout:.0f} s")
            return -999
    tail = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()][-3:]
    print(f"{mode} {model}: exit {p.returncode}" + "".join(f"\n    {ln}" for ln in tail))
    return p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", default="craft", choices=["craft", "soak"])
    ap.add_argument("--model", default="both", choices=["small", "large", "both"])
    ap.add_argument("--sessions", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()
    models = ["small", "large"] if a.model == "both" else [a.model]
    for m in models:
        codes = [run(a.mode, m, a.sessions, a.timeout) for _ in range(a.repeat)]
        print(f"{a.mode} {m}: {sum(c == -6 for c in codes)} aborts in {len(codes)} runs, "
              f"{sum(c == 0 for c in codes)} clean")


if __name__ == "__main__":
    main()
