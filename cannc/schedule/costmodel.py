"""A cost model of this CPU for tiling decisions and for predicting kernel times.

`cpu_model()` describes the machine, detected at run time: vector width (from
the host target's features), cache sizes (/sys/devices/system/cpu/cpu0/cache),
usable cores, the fp32 peak per core (measured by the profiler if it has been
measured and cached, else FMA units x lanes x 2 x clock) and the memory
bandwidth (the profiler's measured copy bandwidth if cached, else an estimate).

`predict(kernel, cores)` is a roofline with load imbalance::

    time = max(busiest core's compute / efficiency, bytes / bandwidth) + launch

where the compute of a GEMM is the planner's own per-core model
(`codegen.gemm._grid_cost`: padded micro-tiles, packing, per-block overhead,
the tile split over the cores) run with the plan the lowering chose (recorded
in ``kernel.notes["plan"]``), and that of other kernels is their FLOPs spread
over the tiles the busiest core gets from the runtime's chunked dispatcher.
The bandwidth is that of the smallest cache level holding the kernel's bytes.
`annotate(kernels, cores)` writes ``notes["predicted_us"]`` and
``notes["tiling"]`` (a short description of the tiling and the core split).

The figures are a model, not a measurement: they rank plans and point at the
kernels that matter; `cannc profile` shows them next to measured times.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "CpuModel",
    "Prediction",
    "annotate",
    "cpu_model",
    "describe",
    "gemm_notes",
    "gemm_record",
    "predict",
    "predict_gemm_us",
]

# fixed costs (µs): the native dispatcher's per-kernel walk, and the cross-core
# completion wait of a kernel split over several cores (a few cache-line handoffs)
LAUNCH_US = 0.3
SYNC_US = 1.0
# fraction of peak reached by code that is not a register-blocked contraction
EFFICIENCY = {"gemm": 0.88, "gemm_dot": 0.45, "conv": 0.75, "attention": 0.55,
              "loop_nest": 0.25, "other": 0.15}
CHUNKS_PER_CORE = 2    # runtime/dispatch.py: cores claim chunks of ceil(T / (cores * 2))


# ---------------------------------------------------------------------------
# the machine
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CpuModel:
    llvm_cpu: str
    model: str               # /proc/cpuinfo model name
    vector_bits: int
    f32_lanes: int
    fma_units: int           # vector FMAs issued per cycle at vector_bits
    freq_ghz: float
    cores: int
    l1d_bytes: int           # per core
    l2_bytes: int            # per core
    l3_bytes: int            # shared
    peak_gflops_core: float  # fp32
    peak_source: str         # 'measured' | 'estimated'
    dram_gbps: float         # whole chip
    mem_source: str

    @property
    def l1_gbps_core(self) -> float:
        return 2 * self.vector_bits / 8 * self.freq_ghz     # two vector loads per cycle

    @property
    def l2_gbps_core(self) -> float:
        return 32 * self.freq_ghz

    @property
    def l3_gbps_core(self) -> float:
        return 16 * self.freq_ghz

    def summary(self) -> str:
        return (f"{self.llvm_cpu} ({self.model or 'unknown model'}), {self.cores} core(s), "
                f"{self.vector_bits}-bit vectors x {self.fma_units} FMA/cycle, "
                f"~{self.freq_ghz:.2f} GHz, L1d {self.l1d_bytes >> 10} KiB, "
                f"L2 {self.l2_bytes >> 10} KiB, L3 {self.l3_bytes >> 20} MiB; fp32 peak "
                f"{self.peak_gflops_core:.0f} GFLOP/s/core ({self.peak_source}), memory "
                f"{self.dram_gbps:.0f} GB/s ({self.mem_source})")


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*B?\s*", text, re.IGNORECASE)
    if not m:
        return 0
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def cache_sizes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> dict[int, int]:
    """{level: bytes} of the data/unified caches of cpu0 (empty if sysfs is not there)."""
    out: dict[int, int] = {}
    for d in sorted(Path(root).glob("index*")):
        try:
            level = int((d / "level").read_text())
            kind = (d / "type").read_text().strip()
            size = _parse_size((d / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and size:
            out[level] = size
    return out


def _freq_ghz() -> float:
    """The highest clock the OS reports (cpufreq's max, else /proc/cpuinfo's MHz)."""
    best = 0.0
    try:
        khz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text())
        best = khz / 1e6
    except (OSError, ValueError):
        pass
    try:
        mhz = [float(x) for x in re.findall(r"^cpu MHz\s*:\s*([\d.]+)",
                                           Path("/proc/cpuinfo").read_text(), re.MULTILINE)]
        if mhz:
            best = max(best, max(mhz) / 1e3)
    except (OSError, ValueError):
        pass
    return best or 3.0


# vector FMA issue per cycle at the full vector width
_FMA_512_TWO = ("skylake-avx512", "cascadelake", "cooperlake", "icelake-server",
                "sapphirerapids", "emeraldrapids", "graniterapids", "znver5")


def _fma_units(cpu: str, vector_bits: int) -> int:
    if vector_bits >= 512:
        return 2 if cpu.startswith(_FMA_512_TWO) else 1   # Zen 4: 2x256-bit = 1 zmm
    return 2


def _measured_peaks() -> dict[str, float] | None:
    """The profiler's measured peaks, if it measured them in this process or cached them."""
    try:
        from ..runtime import profiler
    except Exception:  # noqa: BLE001  # pragma: no cover - the model works without it
        return None
    if profiler._peaks is not None:
        return profiler._peaks
    from .. import config

    d = config.cache_dir()
    if d is None:
        return None
    try:
        data = json.loads((d / "machine.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != profiler.PEAKS_VERSION:
        return None
    return data


def cpu_model() -> CpuModel:
    """This machine (re-read once the profiler has measured its peaks)."""
    peaks = _measured_peaks() or {}
    return _cpu_model(peaks.get("fp32_gflops_per_core"), peaks.get("mem_gbps"))


@lru_cache(maxsize=4)
def _cpu_model(peak: float | None, mem: float | None) -> CpuModel:
    from ..native.target import host
    from ..runtime.device import usable_cores
    from .tuning import cpu_identity

    h = host()
    vbits = h.vector_bytes * 8
    lanes = vbits // 32
    units = _fma_units(h.cpu, vbits)
    freq = _freq_ghz()
    caches = cache_sizes()
    if peak:  # the clock the FMA units ran at (the OS often reports the base clock)
        freq = float(peak) / (units * lanes * 2)
    return CpuModel(
        llvm_cpu=h.cpu, model=cpu_identity()["model"], vector_bits=vbits, f32_lanes=lanes,
        fma_units=units, freq_ghz=freq, cores=usable_cores(),
        l1d_bytes=caches.get(1, 32 << 10), l2_bytes=caches.get(2, 1 << 20),
        l3_bytes=caches.get(3, 32 << 20),
        peak_gflops_core=float(peak) if peak else units * lanes * 2 * freq,
        peak_source="measured" if peak else "estimated",
        dram_gbps=float(mem) if mem else 8.0 * freq,
        mem_source="measured" if mem else "estimated")


# ---------------------------------------------------------------------------
# plans as the lowerings record them
# ---------------------------------------------------------------------------

def gemm_record(spec: Any, tuning: dict[str, Any] | None = None,
                epilogue: bool = False) -> dict[str, Any]:
    """The plan of a GEMM as a plain dict (kernel.notes['plan'])."""
    from ..codegen.gemm import gemm_plan
    from .tuning import gemm_signature

    p = gemm_plan(spec, tuning)
    return {"kind": "gemm", "M": spec.M, "N": spec.N, "K": spec.K, "batch": spec.batch,
            "MR": p.MR, "NR": p.NR, "NV": p.NV, "KC": p.KC, "MC": p.MC, "NC": p.NC,
            "MB": p.MB, "NB": p.NB, "mt": p.mt, "nt": p.nt, "b_mode": p.b_mode,
            "pack_a": p.pack_a, "pack_b": p.b_mode == "pack", "tiles": p.num_tiles(spec.batch),
            "workspace_bytes": p.ws_bytes, "tuning": dict(tuning) if tuning else None,
            "signature": gemm_signature(spec, epilogue)}


def gemm_notes(spec: Any, tuning: dict[str, Any] | None = None,
               epilogue: bool = False) -> dict[str, Any]:
    """What a GEMM lowering records: notes['plan'] (the plan) and notes['tiling']."""
    rec = gemm_record(spec, tuning, epilogue)
    return {"plan": rec, "tiling": describe(rec)}


def attention_record(spec: Any, plan: Any, tuning: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    return {"kind": "attention", "B": spec.B, "H": spec.H, "Sq": spec.Sq, "Sk": spec.Sk,
            "D": spec.D, "Dv": spec.Dv, "MQ": plan.MQ, "KB": plan.KB, "MR_s": plan.MR_s,
            "NV_s": plan.NV_s, "MR_v": plan.MR_v, "k_mode": plan.k_mode, "v_mode": plan.v_mode,
            "scope": plan.scope, "tiles": plan.num_tiles(spec),
            "tuning": dict(tuning) if tuning else None}


def attention_notes(spec: Any, tuning: dict[str, Any] | None = None) -> dict[str, Any]:
    from ..codegen.attention import attention_plan

    rec = attention_record(spec, attention_plan(spec, tuning), tuning)
    return {"plan": rec, "tiling": describe(rec)}


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
    (cores claim chunks of ceil(T / (cores * CHUNKS_PER_CORE)) tiles in turn)."""
    T = max(1, int(tiles))
    if cores <= 1:
        return 1.0
    chunk = max(1, math.ceil(T / (cores * CHUNKS_PER_CORE)))
    nchunks = math.ceil(T / chunk)
    most = min(T, math.ceil(nchunks / cores) * chunk)
    return most / T


def _gemm_units(rec: dict[str, Any], cores: int) -> float:
    """The busiest core's work (flop units) for this plan, as the planner models it
    (codegen.gemm._grid_cost: the even split of the tiles, packing, per-block overhead)
    but with columns padded to one vector, not to the micro-tile: the micro-kernel skips
    vectors that are wholly past N."""
    from ..codegen.gemm import _groups, _rup, _split_even

    M, N, K = rec["M"], rec["N"], rec["K"]
    MR, NR, MB, NB = rec["MR"], rec["NR"], rec["MB"], rec["NB"]
    mt, nt, batch = rec["mt"], rec["nt"], rec.get("batch", 1)
    worst = 0.0
    for t0, t1 in _split_even(batch * mt * nt, cores):
        cost = 0.0
        for _b, it0, it1, jt0, jt1 in _groups(batch, mt, nt, t0, t1):
            rows = _rup(min(M, it1 * MB) - it0 * MB, MR)
            cols = min(N, jt1 * NB) - jt0 * NB
            cost += 2.0 * rows * _rup(cols, 16) * K + 2000.0
            if rec["pack_b"]:
                cost += 24.0 * K * _rup(cols, NR)
            if rec["pack_a"]:
                cost += 24.0 * K * rows
        worst = max(worst, cost)
    return worst


def _gemm_efficiency(rec: dict[str, Any]) -> float:
    if rec["b_mode"] == "dot":
        return EFFICIENCY["gemm_dot"]
    # fewer accumulators than the 6x32 tile (12 zmm) hide less FMA latency
    accs = rec["MR"] * rec["NV"]
    return EFFICIENCY["gemm"] * min(1.0, math.sqrt(accs / 12))


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
    if isinstance(rec, dict) and rec.get("kind") in ("gemm", "attention"):
        return "gemm_dot" if rec["kind"] == "gemm" and rec["b_mode"] == "dot" else rec["kind"]
    if "gemm" in str(k.notes.get("path", "")) or "Conv" in k.op_types[:1]:
        return "conv"
    if k.notes.get("matmul") == "loop nest":
        return "loop_nest"
    return "other"


def predict(k: Any, cores: int | None = None, cpu: CpuModel | None = None) -> Prediction:
    """Predicted time of kernel `k` (a codegen.kernel.Kernel) on `cores` AI cores."""
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
