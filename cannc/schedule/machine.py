"""This machine: its CPU, caches, usable cores and measured peaks, in one place.

`cpu_model()` describes the machine, detected at run time: vector width (from
the host target's features), cache sizes (/sys/devices/system/cpu/cpu0/cache),
usable cores, the fp32 peak per core (measured if it has been measured and
cached, else FMA units x lanes x 2 x clock) and the memory bandwidth (the
measured copy bandwidth if cached, else an estimate).

`peaks()` measures the fp32 FMA peak of one core (`measure_fma_peak`, at the full
and at half the vector width: `fma_pipes()` derives the FMA pipes from them) and the
memory copy bandwidth once and caches them in ``<cache dir>/machine.json``;
`measured_peaks()` returns them only if already measured (in this process or
in the file), never measuring. The cost model and the profiler read them here.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import llvmlite.ir as ir
import numpy as np

from .. import config
from ..native import emit
from ..native.target import JitLibrary, default_cache, host, new_module

# 5: timed in the measuring thread's CPU time (4 took wall time: measured while other
# processes held both cores, the Zen 4 peak was cached as 52 GFLOP/s of 117 and full/half
# as 1.55, so fma_pipes() said 2 and every later GEMM took the 8-row micro-kernel)
PEAKS_VERSION = 5
_peaks: dict[str, float] | None = None     # measured (or read) in this process


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover
        return max(1, os.cpu_count() or 1)


def _cpuinfo_field(name: str) -> str:
    """The first value of field `name` in /proc/cpuinfo ('' if there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""
    m = re.search(rf"^{re.escape(name)}\s*:\s*(.*)$", text, re.MULTILINE)
    return m.group(1).strip() if m else ""


def model_name() -> str:
    """/proc/cpuinfo's model name ('' if there is none)."""
    return _cpuinfo_field("model name")


def family_model() -> str:
    """'family F model M' of /proc/cpuinfo ('' if it has none): a guest may name its
    CPU only generically ('Intel(R) Xeon(R) Processor')."""
    fam, mod = _cpuinfo_field("cpu family"), _cpuinfo_field("model")
    return f"family {fam} model {mod}" if fam and mod else ""


# ---------------------------------------------------------------------------
# the CPU
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


def _data_caches(root: str, fields: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    """(level, the text of `fields`) of each of cpu0's data or unified caches in sysfs (a
    cache whose files cannot be read is passed over)."""
    for d in sorted(Path(root).glob("index*")):
        try:
            level = int((d / "level").read_text())
            if (d / "type").read_text().strip() not in ("Data", "Unified"):
                continue
            yield level, [(d / f).read_text() for f in fields]
        except (OSError, ValueError):
            continue


def cache_sizes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> dict[int, int]:
    """{level: bytes} of the data/unified caches of cpu0 (empty if sysfs is not there)."""
    out: dict[int, int] = {}
    for level, (text,) in _data_caches(root, ("size",)):
        if size := _parse_size(text):
            out[level] = size
    return out


@lru_cache(maxsize=1)
def l1d_sets(root: str = "/sys/devices/system/cpu/cpu0/cache") -> tuple[int, int]:
    """(sets, line bytes) of cpu0's L1 data cache, from sysfs; (64, 64) where it does not
    say (Zen 4 and 5, and Intel's recent cores, all have 64 sets of 64-byte lines)."""
    for level, texts in _data_caches(root, ("number_of_sets", "coherency_line_size")):
        try:
            sets, line = (int(t) for t in texts)
        except ValueError:
            continue
        if level == 1 and sets > 0 and line > 0:
            return sets, line
    return 64, 64


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


# vector FMA issue per cycle at the full vector width, by name: the estimate before the
# peaks are measured (fma_pipes() measures it). Intel's AVX-512 server cores: two
# 512-bit FMA ports, two 512-bit loads a cycle
_INTEL_AVX512_SERVER = ("skylake-avx512", "cascadelake", "cooperlake", "icelake-server",
                        "sapphirerapids", "emeraldrapids", "graniterapids")
_FMA_512_TWO = _INTEL_AVX512_SERVER + ("znver5",)


# AVX2 cores whose FMA pipes are 128 bits wide (Zen 1, family 23 models 0x00-0x2f:
# a ymm FMA is cracked into two halves)
_FMA_128_TWO = ("znver1",)


def fma_pipes() -> int:
    """Full-width vector FMAs one core issues per cycle, measured (see peaks()): twice the
    FMA rate of full-width chains over that of half-width chains, since every x86 core
    with FMA issues two half-width FMAs a cycle. 1 on Zen 4 and on Intel's client cores
    with AVX-512 (a zmm FMA takes both 256-bit pipes) and on Zen 1 (a ymm FMA takes both
    128-bit pipes); 2 on Intel's AVX-512 server cores, Zen 5 and the AVX2 cores since
    Haswell. Measured, not looked up by name: a guest's CPU can be named as another
    (a Sapphire Rapids guest that KVM presents as family 6 model 167, which LLVM calls
    'rocketlake', a client core with one 512-bit FMA port)."""
    return _pipes_from(peaks())


def _pipes_from(p: dict[str, Any]) -> int:
    full, half = p.get("fp32_gflops_per_core"), p.get("fp32_gflops_per_core_half")
    if not full or not half:
        return _fma_units(host().cpu, host().vector_bytes * 8)
    return 2 if full > 1.5 * half else 1


def gemm_micro_rows(pipes: int | None = None) -> int:
    """Rows of the AVX-512 fp32 GEMM micro-kernel (x 32 columns) of a product of many
    rows, from the measured FMA pipes (fma_pipes()). 6 (12 accumulators) measured best
    with one 512-bit FMA a cycle (Zen 4); with two, 8 (16 accumulators, 10 loads per
    16 FMAs instead of 8 per 12; Emerald Rapids, gemm_bench medians against ORT's in
    the same process: 128x3072x768 x0.80-0.89 -> x0.89-0.98, 512x768x768 x0.83 ->
    x0.94-0.98, 1024^3 level)."""
    pipes = fma_pipes() if pipes is None else pipes
    return 8 if pipes >= 2 else 6


def gemm_k_unroll(pipes: int | None = None, accumulators: int = 16) -> int:
    """k steps per iteration of the k loop of an AVX-512 GEMM micro-kernel of more than 8
    accumulators, from the measured FMA pipes (fma_pipes()). With two 512-bit FMAs a
    cycle the loop body runs 6-8 cycles and its loads, pointer steps and branch compete
    with the FMAs: 4 (a Sapphire Rapids guest, 1 core, both kernels timed alternately in
    one process, two runs, static / dynamic-M kernel: 128x768x3072 +9%, +9% / +5%, +7%;
    128x3072x768 +7%, +8% / +8%, +8%; 512x768x768 +5%, +4% / +8%, +8%; 1024^3 +2%, +2% /
    +7%, +7%; 8 is level with 4, 2 is 5-7% short of it). More than 16 accumulators (the 24
    of the 6 x 64 tile, gemm_wide_tile): 2 (kernel for any M, 1 core, against 2: 4 is
    8-20% slower at 1024^3, 512 x 768 x 768 and 128 x 3072 x 768; 1 within -5..+2%).

    With one (Zen 4) the 6 x 32 and 8 x 32 loop bodies run 12-16 cycles, and the kernels
    alone with B in cache are level at 1 and 2 (1024^3, 512 x 768 x 768 within 1%). In a
    model, where B comes from memory (2 also turns on the B prefetch stream,
    GemmPlan.pf_b), 2 is faster: Zen 4, 1 core, gemm_k_unroll patched to 1 or 2 before
    each compile, sessions alternating in one process in the order 1, 2, 1, 2 (medians,
    ms): ELECTRA 28.06 / 27.78 -> 27.13 / 27.04, MiniLM 28.45 / 28.37 -> 27.70 / 27.71,
    BERT-base 222.6 / 223.8 -> 218.7 / 214.4, DeBERTa 27.73 / 27.98 -> 27.53 / 27.45,
    ConvNeXt-T 93.2 / 92.8 -> 91.6 / 91.2, Swin 94.4 / 94.5 -> 94.2 / 92.8. The dynamic
    kernels alone with B cycled through 200 copies (from memory): 128 x 256 x 256 and
    128 x 1024 x 256 +2-4%. Advancing the stream every iteration (pf_div 1) measured
    level with every other."""
    pipes = fma_pipes() if pipes is None else pipes
    return 4 if pipes >= 2 and accumulators <= 16 else 2


def gemm_wide_tile(pipes: int | None = None) -> bool:
    """Whether an AVX-512 fp32 GEMM of many rows takes 6 x 64 micro-tiles (24
    accumulators; 4 B vectors and 6 broadcasts, 10 loads, per 24 FMAs) instead of 8 x 32
    (10 loads per 16 FMAs), from the measured FMA pipes (fma_pipes()). With two 512-bit
    FMAs a cycle the loads per FMA limit the 8 x 32 tile (a Sapphire Rapids guest, an L1
    resident micro-benchmark: 8 x 32 at 83% of the FMA peak, 6 x 64 at 88%); the kernels
    of a model (M at run time), 1 core, alternating in one process: 1024^3 +6%, 512 x 768
    x 768 +3% (gemm_k_unroll: 2 for these tiles). With one (Zen 4), 6 x 32 and 8 x 32
    are what was measured; the wide tile was not."""
    pipes = fma_pipes() if pipes is None else pipes
    return pipes >= 2


@lru_cache(maxsize=1)
def l1d_bytes() -> int:
    """This core's L1 data cache (32 KiB where sysfs does not say)."""
    return cache_sizes().get(1, 32 << 10)


@lru_cache(maxsize=1)
def l2_bytes() -> int:
    """This core's L2 (1 MiB where sysfs does not say): read once, planners ask often."""
    return cache_sizes().get(2, 1 << 20)


@lru_cache(maxsize=1)
def l2_b_block() -> int:
    """Bytes of B the GEMM's K x N block keeps in L2: 3/16 of this core's L2 and at least
    192 KiB (measured on 1 MiB L2s: Zen 4; on Emerald Rapids' 2 MiB, NC 64 -> 128 at
    K = 768 gains 5-10%)."""
    return max(192 << 10, l2_bytes() * 3 // 16)


def _fma_units(cpu: str, vector_bits: int) -> int:
    if vector_bits >= 512:
        return 2 if cpu.startswith(_FMA_512_TWO) else 1   # Zen 4: 2x256-bit = 1 zmm
    if cpu in _FMA_128_TWO:
        return 1          # two 128-bit FMA pipes: one 256-bit FMA a cycle
    return 2


def cpu_model() -> CpuModel:
    """This machine (re-read once its peaks have been measured)."""
    peaks = measured_peaks() or {}
    return _cpu_model(peaks.get("fp32_gflops_per_core"), peaks.get("mem_gbps"),
                      _pipes_from(peaks))


@lru_cache(maxsize=4)
def _cpu_model(peak: float | None, mem: float | None, units: int) -> CpuModel:
    h = host()
    vbits = h.vector_bytes * 8
    lanes = vbits // 32
    freq = _freq_ghz()
    caches = cache_sizes()
    if peak:  # the clock the FMA units ran at (the OS often reports the base clock)
        freq = float(peak) / (units * lanes * 2)
    return CpuModel(
        llvm_cpu=h.cpu, model=model_name(), vector_bits=vbits, f32_lanes=lanes,
        fma_units=units, freq_ghz=freq, cores=usable_cores(),
        l1d_bytes=caches.get(1, 32 << 10), l2_bytes=caches.get(2, 1 << 20),
        l3_bytes=caches.get(3, 32 << 20),
        peak_gflops_core=float(peak) if peak else units * lanes * 2 * freq,
        peak_source="measured" if peak else "estimated",
        dram_gbps=float(mem) if mem else 8.0 * freq,
        mem_source="measured" if mem else "estimated")


# ---------------------------------------------------------------------------
# the measured peaks
# ---------------------------------------------------------------------------

def _peaks_path() -> Path | None:
    d = config.cache_dir()
    return d / "machine.json" if d is not None else None


def measured_peaks() -> dict[str, float] | None:
    """The measured peaks, if measured in this process or cached on disk (never measures)."""
    if _peaks is not None:
        return _peaks
    path = _peaks_path()
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != PEAKS_VERSION \
            or data.get("cpu") != _cpu_key():
        return None      # another version, or measured on another CPU (a moved cache)
    return data


def _cpu_key() -> str:
    """What the peaks depend on: the LLVM CPU name, /proc/cpuinfo's model name and the
    target features the code is generated for."""
    h = host()
    return f"{h.cpu}|{model_name()}|{h.features}"


def peaks() -> dict[str, float]:
    """fp32 peak per core (``fp32_gflops_per_core``: one core's independent FMA chains,
    see measure_fma_peak; ``fp32_gflops_per_core_half``: the same at half the vector
    width, which fma_pipes() compares it with) and the measured copy bandwidth
    (``mem_gbps``) of this machine; measured once (~0.1 s) and cached in the cannc cache
    directory (machine.json)."""
    global _peaks
    if _peaks is not None:
        return _peaks
    cached = measured_peaks()
    if cached is not None:
        _peaks = cached
        return _peaks
    full, half = _measure_fma_peaks()
    _peaks = {"version": PEAKS_VERSION, "cpu": _cpu_key(),
              "fp32_gflops_per_core": full,
              "fp32_gflops_per_core_half": half,
              "mem_gbps": measure_copy_bandwidth()}
    path = _peaks_path()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(_peaks))
        except OSError:
            pass
    return _peaks


def measure_copy_bandwidth() -> float:
    """GB/s (read + write) of a 32 MiB memory copy (best of 5)."""
    a = np.ones(32 << 20, np.uint8)
    b = np.empty_like(a)
    best = min(_cpu_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best / 1e9


def _measure_fma_peaks() -> tuple[float, float]:
    """(full, half): the FMA peaks of the target's full vector width and of half of it,
    measured in turns (best of 3 rounds each), so that a burst of load from elsewhere
    slows both alike."""
    full = max(4, host().vector_bytes // 4)
    f, h = _fma_peak_fn(full), _fma_peak_fn(full // 2)
    rf = rh = 0.0
    for _ in range(3):
        rf, rh = max(rf, f()), max(rh, h())
    return rf, rh


def measure_fma_peak(iters: int = 2_000_000, lanes: int | None = None) -> float:
    """GFLOP/s of one core running 12 independent FMA chains of ``lanes`` float32 (by
    default the target's full vector width: zmm with AVX-512, ymm with AVX2; 12
    accumulators and the constant fit either register file, and 12 in flight cover two
    pipes of up to 6 cycles' latency): the machine's fp32 peak as generated code can
    reach it (best of 5)."""
    f = _fma_peak_fn(max(4, host().vector_bytes // 4) if lanes is None else lanes, iters)
    return max(f() for _ in range(5))


def _fma_peak_fn(lanes: int, iters: int = 2_000_000):
    """A function measuring (once per call) the GFLOP/s of 12 FMA chains of ``lanes``."""
    m = new_module("fma_peak")
    vt = ir.VectorType(emit.F32, lanes)
    fn = ir.Function(m, ir.FunctionType(emit.F32, [emit.I64]), name="cannc_fma_peak")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    one = emit.const_like(1.0000001, vt)
    chains = 12
    entry = b.block
    loop = fn.append_basic_block("loop")
    done = fn.append_basic_block("done")
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(emit.I64)
    i.add_incoming(emit.i64(0), entry)
    accs = []
    for c in range(chains):
        p = b.phi(vt)
        p.add_incoming(emit.const_like(float(c), vt), entry)
        accs.append(p)
    new = [emit.intrinsic(b, "llvm.fma", [a, one, one]) for a in accs]
    for p, v in zip(accs, new):
        p.add_incoming(v, loop)
    nxt = b.add(i, emit.i64(1))
    i.add_incoming(nxt, loop)
    b.cbranch(b.icmp_signed("<", nxt, fn.args[0]), loop, done)
    b.position_at_end(done)
    total = new[0]
    for v in new[1:]:
        total = b.fadd(total, v)
    b.ret(b.extract_element(total, ir.Constant(emit.I32, 0)))
    lib = JitLibrary([default_cache().compile(str(m), f"fma_peak{lanes}", speed_level=0)])
    f = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int64)(lib.address("cannc_fma_peak"))
    f(iters // 10)

    def run() -> float:
        return chains * lanes * 2 * iters / _cpu_timed(lambda: f(iters)) / 1e9
    run.lib = lib      # (the code lives as long as the function)
    return run


def _cpu_timed(fn: Any) -> float:
    """Seconds of this thread's CPU time that fn() took. The peaks are cached for good, so
    they must not depend on what else runs at the time: time the scheduler gives other
    processes meanwhile does not count here, as it would in wall time."""
    t = time.thread_time()
    fn()
    return max(time.thread_time() - t, 1e-9)
