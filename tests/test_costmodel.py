"""The cost model (cannc/schedule/costmodel.py) and the machine description
(cannc/schedule/machine.py): deterministic sanity of its predictions (on a fixed
machine description, so that no test depends on this machine or on a measurement)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from cannc.codegen.gemm import GemmSpec
from cannc.codegen.plans import gemm_notes
from cannc.schedule import costmodel, machine

CPU = machine.CpuModel(
    llvm_cpu="znver4", model="test", vector_bits=512, f32_lanes=16, fma_units=1,
    freq_ghz=3.6, cores=2, l1d_bytes=32 << 10, l2_bytes=1 << 20, l3_bytes=32 << 20,
    peak_gflops_core=115.0, peak_source="estimated", dram_gbps=27.0, mem_source="estimated")


@dataclass
class K:
    """The fields of artifact.Kernel the cost model reads."""
    num_tiles: int
    single_core: bool
    flops: int
    bytes_read: int
    bytes_written: int
    op_types: list[str] = field(default_factory=lambda: ["MatMul"])
    notes: dict[str, Any] = field(default_factory=dict)


def gemm_kernel(M: int, N: int, K_: int, tuning: dict | None = None, **kw: Any) -> K:
    spec = GemmSpec(M, N, K_, b_prepacked=True, **kw)
    notes = gemm_notes(spec, tuning)
    return K(num_tiles=notes["plan"]["tiles"], single_core=False,
             flops=2 * spec.batch * M * N * K_, bytes_read=4 * (M * K_ + K_ * N),
             bytes_written=4 * M * N, notes=notes)


def test_cpu_model_of_this_machine():
    cpu = machine.cpu_model()
    assert cpu.vector_bits in (128, 256, 512) and cpu.f32_lanes == cpu.vector_bits // 32
    assert cpu.cores >= 1 and cpu.peak_gflops_core > 0 and cpu.dram_gbps > 0
    assert cpu.l1d_bytes < cpu.l2_bytes <= cpu.l3_bytes
    assert cpu.llvm_cpu in cpu.summary()


def test_fma_pipes_are_measured_not_named(monkeypatch):
    """Two full-width FMAs a cycle when full-width chains run twice as many flops as
    half-width ones; one when they run as many; the name's estimate until measured."""
    assert machine._pipes_from({"fp32_gflops_per_core": 137.9,
                                "fp32_gflops_per_core_half": 68.7}) == 2   # Sapphire Rapids
    assert machine._pipes_from({"fp32_gflops_per_core": 117.0,
                                "fp32_gflops_per_core_half": 115.0}) == 1  # Zen 4
    h = machine.host()
    assert machine._pipes_from({}) == machine._fma_units(h.cpu, h.vector_bytes * 8)
    p = machine.peaks()
    assert p["fp32_gflops_per_core"] > 0 and p["fp32_gflops_per_core_half"] > 0
    assert machine.fma_pipes() in (1, 2)
    assert machine.cpu_model().fma_units == machine.fma_pipes()


def test_cache_sizes_parse(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                             (2, "Unified", "2048K"), (3, "Unified", "36M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert machine.cache_sizes(str(tmp_path)) == {1: 48 << 10, 2: 2 << 20, 3: 36 << 20}
    assert machine.cache_sizes(str(tmp_path / "missing")) == {}


def test_time_grows_with_flops():
    prev = 0.0
    for n in (64, 128, 256, 512, 1024):
        t = costmodel.predict(gemm_kernel(n, n, n), 2, CPU).us
        assert t > prev
        prev = t
    small = K(num_tiles=4, single_core=False, flops=10_000, bytes_read=4096, bytes_written=4096,
              op_types=["Add"])
    big = K(num_tiles=4, single_core=False, flops=10_000_000, bytes_read=4096,
            bytes_written=4096, op_types=["Add"])
    assert costmodel.predict(big, 2, CPU).us > costmodel.predict(small, 2, CPU).us


def test_two_cores_beat_one_on_a_big_gemm():
    k = gemm_kernel(1024, 1024, 1024)
    one, two = costmodel.predict(k, 1, CPU), costmodel.predict(k, 2, CPU)
    assert two.us < one.us
    assert two.cores == 2 and one.cores == 1
    assert one.bound == "compute"
    # ~1.93x on 2 cores at most, not more than linear
    assert one.us / two.us <= 2.0


def test_single_core_and_launch_bound_kernels():
    k = K(num_tiles=16, single_core=True, flops=100, bytes_read=64, bytes_written=64,
          op_types=["Relu"])
    p = costmodel.predict(k, 2, CPU)
    assert p.cores == 1 and p.bound == "launch" and p.us >= costmodel.LAUNCH_US
    # memory-bound: a big copy
    k = K(num_tiles=64, single_core=False, flops=0, bytes_read=256 << 20,
          bytes_written=256 << 20, op_types=["Transpose"])
    assert costmodel.predict(k, 2, CPU).bound == "memory"


def test_load_imbalance():
    assert costmodel.busiest_share(1, 2) == 1.0
    assert costmodel.busiest_share(32, 2) == 0.5
    assert costmodel.busiest_share(7, 1) == 1.0
    assert 0.5 < costmodel.busiest_share(3, 2) < 1.0
    even = K(num_tiles=2, single_core=False, flops=10**8, bytes_read=0, bytes_written=0,
             op_types=["Add"])
    odd = K(num_tiles=3, single_core=False, flops=10**8, bytes_read=0, bytes_written=0,
            op_types=["Add"])
    assert costmodel.predict(odd, 2, CPU).us > costmodel.predict(even, 2, CPU).us


def test_tiling_description_and_annotate():
    k = gemm_kernel(256, 512, 384)
    plan = k.notes["plan"]
    assert f"{plan['MR']}x{plan['NR']}" in k.notes["tiling"]
    assert f"KC{plan['KC']}" in k.notes["tiling"]
    tuned = gemm_kernel(256, 512, 384, tuning={"KC": 64, "grid": [1, 4]})
    assert tuned.notes["plan"]["KC"] == 64 and tuned.notes["plan"]["nt"] == 4
    assert "[tuned]" in tuned.notes["tiling"] and "[tuned]" not in k.notes["tiling"]
    other = K(num_tiles=8, single_core=False, flops=1000, bytes_read=4096, bytes_written=4096,
              op_types=["Add"])
    total = costmodel.annotate([k, tuned, other], cores=2)
    for x in (k, tuned, other):
        assert x.notes["predicted_us"] > 0 and x.notes["tiling"]
    assert "tile(s)/2 core(s)" in other.notes["tiling"]
    assert total == pytest.approx(sum(x.notes["predicted_us"] for x in (k, tuned, other)),
                                  rel=1e-3)


def test_predictions_are_deterministic():
    k = gemm_kernel(300, 200, 100, batch=1)
    assert costmodel.predict(k, 2, CPU) == costmodel.predict(k, 2, CPU)


def test_measured_peaks_come_from_machine_json(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(machine, "_peaks", None)
    assert machine.measured_peaks() is None                        # never measures
    assert machine.cpu_model().peak_source == "estimated"
    (tmp_path / "machine.json").write_text(json.dumps(
        {"version": machine.PEAKS_VERSION, "cpu": machine._cpu_key(),
         "fp32_gflops_per_core": 123.0, "mem_gbps": 45.0}))
    cpu = machine.cpu_model()
    assert cpu.peak_source == "measured" and cpu.peak_gflops_core == 123.0
    assert cpu.mem_source == "measured" and cpu.dram_gbps == 45.0
    assert machine.peaks()["fp32_gflops_per_core"] == 123.0        # read, not measured
    (tmp_path / "machine.json").write_text(json.dumps({"version": -1}))
    monkeypatch.setattr(machine, "_peaks", None)
    assert machine.measured_peaks() is None                        # another format: ignored
    (tmp_path / "machine.json").write_text(json.dumps(
        {"version": machine.PEAKS_VERSION, "cpu": "znver4|AMD EPYC|+avx512f",
         "fp32_gflops_per_core": 123.0, "mem_gbps": 45.0}))
    assert machine.measured_peaks() is None      # measured on another CPU: ignored


def test_peaks_are_timed_in_cpu_time_not_wall_time():
    """machine.json keeps the peaks for good, so a measurement must not count the time the
    scheduler gives other processes: the measuring thread's CPU time, not the clock's.
    (Measured by the clock while two other processes held both cores of a Zen 4, the peak
    was cached as 52 GFLOP/s of 117, full/half as 1.55, and fma_pipes() as 2.)"""
    import time

    t0 = time.perf_counter()
    asleep = machine._cpu_timed(lambda: time.sleep(0.05))
    assert time.perf_counter() - t0 >= 0.05 and asleep < 0.02
    busy = machine._cpu_timed(lambda: sum(range(200_000)))
    assert busy > 0


def test_measured_fma_pipes_are_in_the_code_caches_salt(monkeypatch):
    """The FMA pipes pick the GEMM micro-kernel, so the lowering memo and the program cache
    (both keyed by codegen.memo.salt) must not serve one measurement's kernels to another."""
    from cannc.codegen import memo
    monkeypatch.setattr(machine, "fma_pipes", lambda: 1)
    one = memo.salt()
    monkeypatch.setattr(machine, "fma_pipes", lambda: 2)
    assert memo.salt() != one


def test_gather_reads_the_rows_it_takes():
    """A gather's (and a slice's) kernel reads as many elements of its data as it writes:
    the traffic the profiler divides by and the cost model predicts from is not the whole
    table (an embedding of 47 MB read 128 rows: 3800 GB/s, 13000% of the bandwidth)."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    import cannc
    table = nh.from_array(np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64), "table")
    g = h.make_graph(
        [h.make_node("Gather", ["table", "ids"], ["rows"]),
         h.make_node("Slice", ["x", "st", "en"], ["part"])], "g",
        [h.make_tensor_value_info("ids", T.INT64, [8]),
         h.make_tensor_value_info("x", T.FLOAT, [1024, 64])],
        [h.make_tensor_value_info("rows", T.FLOAT, [8, 64]),
         h.make_tensor_value_info("part", T.FLOAT, [4, 64])],
        [table, nh.from_array(np.int64([0]), "st"), nh.from_array(np.int64([4]), "en")])
    s = cannc.compile(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]).SerializeToString())
    ids = np.int64([5, 0, 4095, 7, 7, 1, 2, 3])
    x = np.ones((1024, 64), np.float32)
    rows, part = s.run(None, {"ids": ids, "x": x})
    np.testing.assert_array_equal(rows, nh.to_array(table)[ids])
    kernels = {k.op_types[0]: k for k in next(iter(s.programs.values())).kernels}
    assert kernels["Gather"].bytes_read == 8 * 64 * 4 + 8 * 8
    assert kernels["Slice"].bytes_read == 4 * 64 * 4 + 2 * 8
