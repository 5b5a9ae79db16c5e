"""A cost model of this CPU for tiling decisions and for predicting kernel times.

The machine is `machine.cpu_model()` (cannc.schedule.machine: vector width,
caches, cores, the measured fp32 peak and memory bandwidth if they are cached,
else estimates).

`predict(kernel, cores)` is a roofline with load imbalance::

    time = max(busiest core's compute / efficiency, bytes / bandwidth) + launch

where the compute of a GEMM is the planner's own per-core model
(`codegen.gemm._grid_cost`: padded micro-tiles, packing, per-block overhead,
the tile split over the cores) run with the plan the lowering chose (recorded
in ``kernel.notes["plan"]`` by codegen.plans), and that of other kernels is
their FLOPs spread over the tiles the busiest core gets from the runtime's
chunked dispatcher (schedule.split.claim_chunks).
The bandwidth is that of the smallest cache level holding the kernel's bytes.
`annotate(kernels, cores)` writes ``notes["predicted_us"]`` and
``notes["tiling"]`` (a short description of the tiling and the core split).

The figures are a model, not a measurement: they rank plans and point at the
kernels that matter; `cannc profile` shows them next to measured times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .machine import CpuModel, cpu_model
from .split import claim_chunks, gemm_groups, rup, split_even

__all__ = [
    "Prediction",
    "annotate",
    "describe",
    "predict",
    "predict_gemm_us",
]

# fixed costs (µs): the native dispatcher's per-kernel walk, and the cross-core
# completion wait of a kernel split over several cores (a few cache-line handoffs)
LAUNCH_US = 0.3
SYNC_US = 1.0
# fraction of peak reached by code that is not a register-blocked contraction
EFFICIENCY = {"gemm": 0.88, "gemm_dot": 0.45, "conv": 0.75, "attention": 0.55,
              "loop_nest": 0.25, "other": 0.15,
              # bf16 on AMX tiles: 700-980 GFLOP/s measured on a Xeon whose fp32 FMA peak
              # is ~240 (codegen/amx.py), i.e. ~3.5x the fp32 peak
              "amx": 3.5}

# ---------------------------------------------------------------------------
# plans as the lowerings record them (codegen.plans)
# ---------------------------------------------------------------------------

def describe(rec: dict[str, Any], cores: int | None = None, single_core: bool = False) -> str:
    """A short description of a recorded plan (and of its split over `cores`)."""
    kind = rec.get("kind")
    if kind == "gemm":
        if rec["b_mode"] == "dot":
            s = f"dot {rec['MR']}x{rec['NR']}"
        else:
            s = (f"{rec['MR']}x{rec['NR']} KC{rec['KC']} B:{rec['b_mode']}"
                 + (" A:packed" if rec["pack_a"] else ""))
        s += f" grid {rec['mt']}x{rec['nt']} of {rec['MB']}x{rec['NB']}"
        if rec.get("batch", 1) > 1:
            s += f" x{rec['batch']}"
    elif kind == "attention":
        s = (f"MQ{rec['MQ']} KB{rec['KB']} S{rec['MR_s']}x{16 * rec['NV_s']} "
             f"PV{rec['MR_v']} K:{rec['k_mode']} V:{rec['v_mode']}/{rec['scope']}")
    else:
        s = str(rec.get("path", ""))
    tiles = int(rec.get("tiles", 1))
    if cores is not None:
        c = 1 if single_core else max(1, min(cores, tiles))
        s += f"; {tiles} tile(s)/{c} core(s)"
    if rec.get("tuning"):
        s += " [tuned]"
    return s.strip()


# ---------------------------------------------------------------------------
# prediction
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    us: float
    compute_us: float
    memory_us: float
    launch_us: float
    cores: int             # cores the kernel runs on
    bound: str             # 'compute' | 'memory' | 'launch'
    tiling: str


def busiest_share(tiles: int, cores: int) -> float:
    """Fraction of a kernel's tiles the busiest core runs under the chunked dispatcher
    (cores claim the chunks of split.claim_chunks in turn)."""
    T = max(1, int(tiles))
    if cores <= 1:
        return 1.0
    load = [0] * cores
    for t0, t1 in claim_chunks(T, cores):
        c = load.index(min(load))
        load[c] += t1 - t0
    return max(load) / T


def _gemm_units(rec: dict[str, Any], cores: int) -> float:
    """The busiest core's work (flop units) for this plan, as the planner models it
    (codegen.gemm._grid_cost: the even split of the tiles, packing, per-block overhead)
    but with columns padded to one vector, not to the micro-tile: the micro-kernel skips
    vectors that are wholly past N."""
    M, N, K = rec["M"], rec["N"], rec["K"]
    MR, NR, MB, NB = rec["MR"], rec["NR"], rec["MB"], rec["NB"]
    mt, nt, batch = rec["mt"], rec["nt"], rec.get("batch", 1)
    worst = 0.0
    for t0, t1 in split_even(batch * mt * nt, cores):
        cost = 0.0
        for _b, it0, it1, jt0, jt1 in gemm_groups(batch, mt, nt, t0, t1):
            rows = rup(min(M, it1 * MB) - it0 * MB, MR)
            cols = min(N, jt1 * NB) - jt0 * NB
            cost += 2.0 * rows * rup(cols, 16) * K + 2000.0
            if rec["pack_b"]:
                cost += 24.0 * K * rup(cols, NR)
            if rec["pack_a"]:
                cost += 24.0 * K * rows
        worst = max(worst, cost)
    return worst


def _gemm_efficiency(rec: dict[str, Any]) -> float:
    if rec["b_mode"] == "dot":
        return EFFICIENCY["gemm_dot"]
    # fewer accumulators than the 6x32 tile (12 zmm) hide less FMA latency
    accs = rec["MR"] * rec["NV"]
    # bf16 products by vdpbf16ps: the measured peak over the fp32 FMA peak (plans.py)
    dp = float(rec.get("dp_speedup", 1.0)) if rec.get("dp") else 1.0
    return EFFICIENCY["gemm"] * min(1.0, math.sqrt(accs / 12)) * dp


def predict_gemm_us(rec: dict[str, Any], cores: int, cpu: CpuModel | None = None) -> float:
    """Modelled compute time (µs) of a recorded GEMM plan on `cores` cores."""
    cpu = cpu or cpu_model()
    c = max(1, min(cores, rec["tiles"]))
    units = _gemm_units(rec, c)
    return units / (cpu.peak_gflops_core * 1e3 * _gemm_efficiency(rec))


def _bandwidth_gbps(nbytes: int, cores: int, cpu: CpuModel) -> float:
    """Bandwidth of the smallest cache level that holds the kernel's bytes."""
    if nbytes <= cpu.l2_bytes * cores:
        return cpu.l2_gbps_core * cores
    if nbytes <= cpu.l3_bytes:
        return cpu.l3_gbps_core * cores
    return cpu.dram_gbps * min(1.0 + 0.5 * (cores - 1), 2.0)


def _kind(k: Any) -> str:
    rec = k.notes.get("plan")
    if isinstance(rec, dict) and rec.get("kind") in ("gemm", "attention", "amx"):
        return "gemm_dot" if rec["kind"] == "gemm" and rec["b_mode"] == "dot" else rec["kind"]
    if "gemm" in str(k.notes.get("path", "")) or "Conv" in k.op_types[:1]:
        return "conv"
    if k.notes.get("matmul") == "loop nest":
        return "loop_nest"
    return "other"


def predict(k: Any, cores: int | None = None, cpu: CpuModel | None = None) -> Prediction:
    """Predicted time of kernel `k` (an artifact.Kernel) on `cores` AI cores."""
    cpu = cpu or cpu_model()
    cores = cpu.cores if cores is None else max(1, int(cores))
    tiles = max(1, int(k.num_tiles))
    c = 1 if k.single_core else min(cores, tiles)
    kind = _kind(k)
    rec = k.notes.get("plan") if isinstance(k.notes.get("plan"), dict) else {}
    peak = cpu.peak_gflops_core * 1e3        # flops per µs per core
    if kind in ("gemm", "gemm_dot"):
        gemm_us = predict_gemm_us(rec, c, cpu)
        extra = max(0, k.flops - 2 * rec.get("batch", 1) * rec["M"] * rec["N"] * rec["K"])
        compute = gemm_us + extra * busiest_share(tiles, c) / (peak * EFFICIENCY["other"])
    else:
        compute = k.flops * busiest_share(tiles, c) / (peak * EFFICIENCY[kind])
    nbytes = int(k.bytes_read) + int(k.bytes_written)
    memory = nbytes / (_bandwidth_gbps(nbytes, c, cpu) * 1e3)
    launch = LAUNCH_US + (SYNC_US if c > 1 else 0.0)
    body = max(compute, memory)
    bound = "compute" if compute >= memory else "memory"
    if launch > body:
        bound = "launch"
    if rec:
        tiling = describe(rec, cores, k.single_core)
    else:
        path = k.notes.get("path")
        tiling = (f"{path}; " if path else "") + f"{tiles} tile(s)/{c} core(s)"
    return Prediction(us=body + launch, compute_us=compute, memory_us=memory, launch_us=launch,
                      cores=c, bound=bound, tiling=tiling)


def annotate(kernels: Iterable[Any], cores: int | None = None) -> float:
    """Write notes['predicted_us'] and notes['tiling'] on every kernel (for `cores` AI cores,
    default the usable CPU cores); returns the predicted total (µs)."""
    total = 0.0
    for k in kernels:
        p = predict(k, cores)
        k.notes["predicted_us"] = round(p.us, 3)
        k.notes["predicted_bound"] = p.bound
        k.notes["tiling"] = p.tiling
        total += p.us
    return total
