"""LLVM in worker processes (cannc.native.llvm_procs): the same objects as in process,
every module compiled, and a worker that dies or cannot start is a CompileError or a
compile in process, never the caller's crash."""

from __future__ import annotations

import ctypes
import sys
import textwrap
import time

import pytest

from cannc.errors import CanncError, CompileError
from cannc.native import llvm_procs, target


def _module(i: int) -> str:
    # a small loop (something for the optimiser to do), distinct per i
    return textwrap.dedent(f"""
        define i64 @f{i}(i64 %n) {{
        entry:
          br label %loop
        loop:
          %k = phi i64 [0, %entry], [%k1, %loop]
          %s = phi i64 [{i}, %entry], [%s1, %loop]
          %t = mul i64 %k, %k
          %s1 = add i64 %s, %t
          %k1 = add i64 %k, 1
          %c = icmp slt i64 %k1, %n
          br i1 %c, label %loop, label %done
        done:
          ret i64 %s1
        }}
    """)


def _target() -> tuple:
    t = target.host()
    return (t.triple, t.cpu, t.features, 3, target.CODE_MODEL[1], target.CODE_MODEL[0])


def _in_process(job):
    mod, tm = target._optimise(job[1], job[0], job[2])
    return tm.emit_object(mod)


def _compile_jobs(jobs, target_, in_process, done):
    batch = llvm_procs.Batch(target_, in_process, done)
    for job in jobs:
        batch.submit(job)
    batch.finish()


@pytest.fixture
def procs(monkeypatch):
    monkeypatch.setenv("CANNC_LLVM_PROCS", "2")
    monkeypatch.setattr(llvm_procs, "_broken", False)
    monkeypatch.setattr(llvm_procs.config, "DUMP_DIR", None)     # (dumps compile in process)
    llvm_procs.shutdown()
    yield
    llvm_procs.shutdown()


def test_a_batch_compiles_while_its_submitter_works(procs):
    # modules submitted one by one are compiled by the workers before finish is called
    batch = llvm_procs.Batch(_target(), _in_process, lambda i, o: None)
    ready: list[int] = []
    batch.done = lambda i, o: ready.append(i)
    for i in range(3):
        batch.submit((f"k{i}", _module(50 + i), 2))
    t = time.monotonic()
    while len(ready) < 3 and time.monotonic() - t < 30:
        time.sleep(0.01)
    assert sorted(ready) == [0, 1, 2], "the workers did not compile during the submitter's work"
    batch.finish()


def test_an_abandoned_batch_stops_and_its_workers_are_idle_again(procs):
    batch = llvm_procs.Batch(_target(), _in_process, lambda i, o: None)
    for i in range(4):
        batch.submit((f"k{i}", _module(60 + i), 2))
    batch.abandon()
    assert all(not t.is_alive() for t in batch._threads)
    assert len(llvm_procs._idle) == llvm_procs._started


def test_workers_make_the_same_objects_as_the_process(procs):
    jobs = [(f"k{i}", _module(i), 2) for i in range(6)]
    got: dict[int, bytes] = {}
    _compile_jobs(jobs, _target(), _in_process, got.__setitem__)
    assert sorted(got) == list(range(6))
    for i, job in enumerate(jobs):
        assert got[i] == _in_process(job), f"module {i} differs from the in-process object"
    assert llvm_procs._started >= 1, "no worker process took part"
    lib = target.JitLibrary([got[3]])
    f = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(lib.address("f3"))
    assert f(4) == 3 + 0 + 1 + 4 + 9


def test_object_cache_compiles_many_and_counts_them(procs, tmp_path):
    cache = target.ObjectCache(tmp_path)
    before = target.emitted_modules()
    mods = [(f"k{i}", _module(10 + i)) for i in range(4)]
    seen: list[int] = []
    out = cache.compile_many(mods, done=lambda: seen.append(1))
    assert list(out) == [n for n, _ in mods] and len(seen) == len(mods)
    assert target.emitted_modules() - before == 4 and cache.misses == 4
    again = target.ObjectCache(tmp_path).compile_many(mods)
    assert again == out and target.emitted_modules() - before == 4


def test_invalid_ir_in_a_worker_is_a_compile_error(procs):
    jobs = [("good", _module(1), 2), ("bad", "define i64 @g() { ret i32 0 }", 2),
            ("good2", _module(2), 2)]
    with pytest.raises(CompileError, match="invalid LLVM IR for kernel bad"):
        _compile_jobs(jobs, _target(), _in_process, lambda i, o: None)


# LLVM aborts the process that emits this (report_fatal_error: the streamer has no asm
# parser): in a worker it is a CompileError, and this process lives on
_ABORTS_LLVM = """
define i32 @f(i32 %x) {
  call void asm sideeffect "bogus_insn %eax", ""()
  ret i32 %x
}
"""


def test_an_llvm_abort_is_a_compile_error_not_a_crash(procs, tmp_path):
    cache = target.ObjectCache(tmp_path)
    with pytest.raises(CompileError) as e:
        cache.compile_many([("fine", _module(70)), ("doomed", _ABORTS_LLVM)])
    msg = str(e.value)
    assert "kernel doomed" in msg and "LLVM ERROR" in msg and "signal 6" in msg
    # and the next compile goes on (a new worker)
    assert set(cache.compile_many([("k", _module(71))])) == {"k"}


def _fake_worker(monkeypatch, tmp_path, body: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(body))
    monkeypatch.setattr(llvm_procs, "WORKER", script)


def test_a_worker_that_dies_fails_its_module_not_the_process(procs, monkeypatch, tmp_path):
    # says ready, then dies on its first job as an LLVM assertion would
    _fake_worker(monkeypatch, tmp_path, """
        import os, pickle, struct, sys
        d = pickle.dumps(("ready", None))
        sys.stdout.buffer.write(struct.pack("<Q", len(d)) + d); sys.stdout.buffer.flush()
        sys.stdin.buffer.read(8)
        sys.stderr.write("LLVM ERROR: Cannot select: intrinsic\\n"); sys.stderr.flush()
        os._exit(134)
    """)
    def slow(job):                 # the process is busy long enough for the worker to start
        time.sleep(1.0)
        return _in_process(job)

    jobs = [(f"k{i}", _module(40 + i), 2) for i in range(3)]
    with pytest.raises(CompileError) as e:
        _compile_jobs(jobs, _target(), slow, lambda i, o: None)
    msg = str(e.value)
    assert "died (exit status 134)" in msg and "Cannot select" in msg
    assert "LLVM failed on kernel k" in msg
    # and the next compile starts new workers (the idle fake ones ended first)
    llvm_procs.shutdown()
    _fake_worker(monkeypatch, tmp_path, llvm_procs.Path(target.__file__).with_name(
        "_llvm_worker.py").read_text())
    got: dict[int, bytes] = {}
    _compile_jobs(jobs, _target(), slow, got.__setitem__)
    assert sorted(got) == [0, 1, 2]


def test_a_worker_that_cannot_start_leaves_the_compile_to_the_process(procs, monkeypatch,
                                                                     tmp_path):
    _fake_worker(monkeypatch, tmp_path, "import sys; sys.exit('no llvmlite here')\n")
    jobs = [(f"k{i}", _module(20 + i), 2) for i in range(3)]
    got: dict[int, bytes] = {}
    _compile_jobs(jobs, _target(), _in_process, got.__setitem__)
    assert sorted(got) == [0, 1, 2]
    assert llvm_procs._broken and llvm_procs._checkout(2) == []


def test_procs_setting(monkeypatch):
    monkeypatch.setenv("CANNC_LLVM_PROCS", "0")
    assert llvm_procs.max_workers() == 0
    monkeypatch.setenv("CANNC_LLVM_PROCS", "two")
    with pytest.raises(CanncError, match="CANNC_LLVM_PROCS"):
        llvm_procs.max_workers()
    monkeypatch.setenv("CANNC_LLVM_PROCS", "-1")
    with pytest.raises(CanncError, match="CANNC_LLVM_PROCS"):
        llvm_procs.max_workers()


def test_no_workers_without_a_python_interpreter_to_start(monkeypatch):
    monkeypatch.delenv("CANNC_LLVM_PROCS", raising=False)
    for exe in ("", "/usr/bin/my-onnx-server", sys.executable + "-missing"):
        monkeypatch.setattr(llvm_procs.sys, "executable", exe)
        assert llvm_procs.max_workers() == 0, exe


def test_no_workers_means_in_process(monkeypatch):
    monkeypatch.setenv("CANNC_LLVM_PROCS", "0")
    llvm_procs.shutdown()
    started = llvm_procs._started
    jobs = [(f"k{i}", _module(30 + i), 2) for i in range(3)]
    got: dict[int, bytes] = {}
    _compile_jobs(jobs, _target(), _in_process, got.__setitem__)
    assert sorted(got) == [0, 1, 2] and llvm_procs._started == started


def test_worker_runs_without_cannc_on_its_path():
    # the worker is a script: it must not import cannc (that would cost ~1 s a start)
    src = llvm_procs.WORKER.read_text()
    assert "import cannc" not in src and "from cannc" not in src
    assert sys.executable


_SUM_LOOP = """
define float @sum(ptr %x, i64 %n) {
entry:
  br label %loop
loop:
  %k = phi i64 [0, %entry], [%k1, %loop]
  %s = phi float [0.0, %entry], [%s1, %loop]
  %p = getelementptr float, ptr %x, i64 %k
  %v = load float, ptr %p
  %s1 = fadd fast float %s, %v
  %k1 = add i64 %k, 1
  %c = icmp slt i64 %k1, %n
  br i1 %c, label %loop, label %done
done:
  ret float %s1
}
"""


def test_vector_code_is_optimised_without_unroller_and_vectorisers():
    """A module marked as vector code (the GEMM's, the convolutions') is optimised at O1
    without LLVM's loop unroller and vectorisers; any other at the level asked for. The
    flags reach LLVM: the same scalar loop is vectorised unmarked, not marked."""
    import llvmlite.ir as ir

    from cannc.codegen.gemm import GemmSpec, emit_gemm
    from cannc.native._llvm_worker import pipeline
    from cannc.native.emit import mark_vector_code

    m = target.new_module("g")
    emit_gemm(m, "k", GemmSpec(64, 64, 64, b_prepacked=True))
    assert pipeline(str(m), 2) == (1, False, False)
    assert pipeline(str(m), 0) == (0, False, True)        # (asked for less: as asked)
    assert pipeline(_SUM_LOOP, 2) == (2, True, True)

    marked = ir.Module("s")
    mark_vector_code(marked)
    mark = next(ln for ln in str(marked).splitlines() if ln.startswith("!"))
    tgt = target.host()
    tm = tgt.machine()
    plain_asm = tm.emit_assembly(target.optimise(_SUM_LOOP, tm, tgt.triple, 2))
    marked_asm = tm.emit_assembly(target.optimise(_SUM_LOOP + mark + "\n", tm, tgt.triple, 2))
    if tgt.has("avx2"):
        assert "vaddps" in plain_asm          # vectorised
    assert "vaddps" not in marked_asm and "vaddss" in marked_asm
