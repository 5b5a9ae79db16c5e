"""The profiler: where the time of a run goes.

Per kernel: time, FLOPs, bytes, achieved GFLOP/s and GB/s and their share of
this machine's measured peak (CANN reports these as Cube utilisation and
memory bandwidth; the peaks come from cannc.schedule.machine), per-core busy
time; per run: copy-in, compute and copy-out time, copy/compute overlap of
pipelined requests; device memory in use. It writes a Chrome trace
(chrome://tracing, Perfetto) with one track per AI Core and one for the copy
engine. Fused kernels are mapped back to the ONNX nodes
they contain, so a user finds their own layer.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..schedule import machine
from . import dispatch
from .program import Program, RunTimes

_peaks: dict[str, float] | None = None


def _stamp(prog: Any) -> tuple[int, float]:
    """(counter, the clock in the middle of the narrowest of a few brackets around it).
    A thread descheduled between reading the counter and reading the clock (a busy
    2-vCPU guest) would otherwise pair them milliseconds apart."""
    best = (0, 0.0, math.inf)
    for _ in range(8):
        a = time.perf_counter()
        c = prog.cycles()
        z = time.perf_counter()
        if z - a < best[2]:
            best = (c, (a + z) / 2, z - a)
        if z - a < 20e-6:
            break
    return best[0], best[1]


def _cycle_rate(prog: Any, interval: float = 0.02) -> float:
    """Cycles per second of the counter the dispatcher stamps (the TSC on x86), over
    ``interval`` seconds between two stamps bracketed by the clock. With the stamps
    taken unbracketed, one preemption between the counter and the clock read put the
    rate 30% high on the Zen 4 guest (kernels of a profile at 140 GFLOP/s against a
    117 GFLOP/s peak); the median of three measurements guards against the rest."""
    rates = []
    for _ in range(3):
        c0, t0 = _stamp(prog)
        time.sleep(interval)
        c1, t1 = _stamp(prog)
        rates.append((c1 - c0) / (t1 - t0))
    return float(np.median(rates))


def machine_peaks(prog: Program) -> dict[str, float]:
    """This machine's measured fp32 peak per core and copy bandwidth (measured once and
    cached by cannc.schedule.machine), and the cycle rate of the dispatcher's counter."""
    global _peaks
    if _peaks is None:
        _peaks = {**machine.peaks(), "cycles_per_second": _cycle_rate(prog)}
    return _peaks


@dataclass
class Profile:
    model: str
    cores: int
    runs: int
    run_ms: float                         # median wall time of Session.run
    h2d_ms: float
    compute_ms: float
    d2h_ms: float
    kernels: list[dict[str, Any]]
    core_busy_ms: list[float]
    memory: dict[str, int]
    peaks: dict[str, float]
    onnx_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    overlap: dict[str, float] = field(default_factory=dict)
    launch_cores: str = ""                # the program's core choice (runtime/corechoice.py)
    trace_events: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def kernel_ms(self) -> float:
        return sum(k["time_ms"] for k in self.kernels)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "trace_events"}
        d["kernel_ms"] = self.kernel_ms
        return d

    def write_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"traceEvents": self.trace_events,
                                          "displayTimeUnit": "ms"}))

    def table(self, top: int = 25) -> str:
        rows = sorted(self.kernels, key=lambda k: -k["time_ms"])[:top]
        w = max([len(_label(k)) for k in rows] + [10])
        w = min(w, 60)
        lines = [f"{'kernel':<{w}} {'ms':>8} {'%':>5} {'GFLOP/s':>8} {'%peak':>6} "
                 f"{'GB/s':>7} {'%bw':>5}"]
        total = max(self.kernel_ms, 1e-12)
        for k in rows:
            lines.append(f"{_label(k)[:w]:<{w}} {k['time_ms']:8.3f} "
                         f"{100 * k['time_ms'] / total:5.1f} {k['gflops']:8.1f} "
                         f"{k['flops_peak_pct']:6.1f} {k['gbps']:7.1f} {k['bw_peak_pct']:5.1f}")
        busy = ", ".join(f"core {i}: {b:.3f} ms ({100 * b / max(self.compute_ms, 1e-12):.0f}%)"
                         for i, b in enumerate(self.core_busy_ms))
        lines.append(f"run {self.run_ms:.3f} ms = copy-in {self.h2d_ms:.3f} + compute "
                     f"{self.compute_ms:.3f} + copy-out {self.d2h_ms:.3f}; kernels sum to "
                     f"{self.kernel_ms:.3f} ms "
                     f"({100 * self.kernel_ms / max(self.compute_ms, 1e-12):.0f}% "
                     "of compute)")
        lines.append(f"AI cores busy: {busy}")
        if self.launch_cores:
            lines.append(f"launches on {self.launch_cores}")
        m = self.memory
        lines.append("device memory: " + ", ".join(
            f"{k[:-6]} {v / 2**20:.2f} MiB" for k, v in m.items() if k.endswith("_bytes")))
        if self.overlap:
            o = self.overlap
            lines.append(f"pipelined ({o['requests']:.0f} requests in flight): "
                         f"{o['throughput_per_s']:.1f}/s vs {o['sequential_per_s']:.1f}/s one at a "
                         f"time; {100 * o['copy_overlap']:.0f}% of copy time overlapped compute")
        return "\n".join(lines)


def _label(k: dict[str, Any]) -> str:
    nodes = k["nodes"]
    name = nodes[0] if len(nodes) == 1 else f"{nodes[0]} (+{len(nodes) - 1})"
    return f"#{k['index']} {'+'.join(k['op_types'][:4])} {name}"


def profile(session: Any, feeds: dict[str, np.ndarray], runs: int = 20, warmup: int = 3,
            pipeline_requests: int = 0) -> Profile:
    """Profile `runs` synchronous runs (after `warmup`); medians per kernel."""
    checked, key = session._check_inputs(feeds)
    prog: Program = session._program(key, checked)
    feeds = {k: v for k, v in checked.items() if k in prog.input_names}
    peaks = machine_peaks(prog)
    rate = peaks["cycles_per_second"]
    for _ in range(warmup):
        prog.execute(feeds)
    # the launches profiled use the cores the program's runs use (core_choice): let it
    # finish its trial first (a few dozen launches at most)
    for _ in range(64):
        if prog.core_choice.decided:
            break
        prog.execute(feeds)
    records: list[RunTimes] = []
    for _ in range(max(1, runs)):
        rt = RunTimes()
        prog.execute(feeds, times=rt)
        records.append(rt)
    nk, ncores = len(prog.kernels), session.cores
    per_kernel = np.zeros((len(records), nk))
    busy = np.zeros((len(records), nk, ncores))
    for r, rt in enumerate(records):
        cyc = rt.cycles
        prev = rt.cycles0
        for k in range(nk):
            # core 0 (the caller) walks every kernel and leaves each one when it is
            # complete; a worker the OS woke late may stamp long after the fact
            done = int(cyc[k, 0, 3])
            per_kernel[r, k] = max(done - prev, 0) / rate
            prev = done
            # (a launch on fewer cores than the device's, core_choice: the others idle)
            busy[r, k, :cyc.shape[1]] = cyc[k, :, 2] / rate
    med = np.median(per_kernel, axis=0)
    kern = []
    cpeak = peaks["fp32_gflops_per_core"] * ncores
    for i, k in enumerate(prog.kernels):
        t = float(med[i])
        nbytes = k.bytes_read + k.bytes_written
        gf = k.flops / t / 1e9 if t > 0 else 0.0
        gb = nbytes / t / 1e9 if t > 0 else 0.0
        # GFLOP/s are the op's (what a direct computation would do: comparable across
        # kernels and engines); %peak counts what the kernel really multiplies and adds,
        # fewer for a Winograd conv (notes' gemm_flops), whose op GFLOP/s exceed the peak
        done = int(k.notes.get("gemm_flops", k.flops)) if k.notes else k.flops
        run_gf = done / t / 1e9 if t > 0 else 0.0
        kern.append({"index": i, "symbol": k.symbol, "nodes": list(k.nodes),
                     "op_types": list(k.op_types), "time_ms": t * 1e3, "flops": k.flops,
                     "executed_flops": done, "bytes": nbytes, "gflops": gf, "gbps": gb,
                     "flops_peak_pct": 100 * run_gf / cpeak if cpeak else 0.0,
                     "bw_peak_pct": 100 * gb / peaks["mem_gbps"] if peaks["mem_gbps"] else 0.0,
                     "core_busy_ms": [float(x) * 1e3 for x in np.median(busy[:, i], axis=0)],
                     "tiles": k.num_tiles})
    nodes: dict[str, dict[str, Any]] = {}
    for k in kern:
        for n in k["nodes"]:
            nodes[n] = {"kernel": k["index"], "kernel_ms": k["time_ms"],
                        "fused_with": len(k["nodes"]) - 1}
    med_of = lambda f: float(np.median([f(rt) for rt in records])) * 1e3
    prof = Profile(
        model=session.graph.name, cores=ncores, runs=len(records),
        run_ms=med_of(lambda rt: rt.t_end - rt.t_start),
        h2d_ms=med_of(lambda rt: rt.t_h2d_end - rt.t_start),
        compute_ms=med_of(lambda rt: rt.t_compute_end - rt.t_h2d_end),
        d2h_ms=med_of(lambda rt: rt.t_end - rt.t_compute_end),
        kernels=kern, core_busy_ms=[float(x) * 1e3 for x in np.median(busy.sum(axis=1), axis=0)],
        memory=session.device.mem_info(), peaks=peaks, onnx_nodes=nodes,
        launch_cores=prog.core_choice.describe())
    prof.trace_events = _trace(prog, records[-1], rate, ncores)
    if pipeline_requests:
        prof.overlap = pipelined_throughput(session, feeds, pipeline_requests, prof.trace_events)
    return prof


def _trace(prog: Program, rt: RunTimes, rate: float, ncores: int) -> list[dict[str, Any]]:
    pid = os.getpid()
    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "cannc device"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": ncores,
         "args": {"name": "copy engine"}},
    ]
    for c in range(ncores):
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": c,
                   "args": {"name": f"AI Core {c}"}})

    def us(cycles: int) -> float:
        return (rt.t0 + (cycles - rt.cycles0) / rate) * 1e6

    ev.append({"ph": "X", "name": "copy in (H2D)", "pid": pid, "tid": ncores,
               "ts": rt.t_start * 1e6, "dur": (rt.t_h2d_end - rt.t_start) * 1e6})
    ev.append({"ph": "X", "name": "copy out (D2H)", "pid": pid, "tid": ncores,
               "ts": rt.t_compute_end * 1e6, "dur": (rt.t_end - rt.t_compute_end) * 1e6})
    assert rt.cycles is not None
    for i, k in enumerate(prog.kernels):
        for c in range(rt.cycles.shape[1]):
            first, last, busy, _ = (int(x) for x in rt.cycles[i, c, :dispatch.PROFILE_WORDS])
            if first == 0:
                continue
            ev.append({"ph": "X", "name": "+".join(k.op_types[:3]) +
                       ("+..." if len(k.op_types) > 3 else ""), "pid": pid, "tid": c,
                       "ts": us(first), "dur": max((last - first) / rate * 1e6, 0.01),
                       "args": {"kernel": i, "onnx_nodes": k.nodes, "flops": k.flops,
                                "busy_us": busy / rate * 1e6}})
    return ev


def pipelined_throughput(session: Any, feeds: dict[str, np.ndarray], requests: int,
                         trace: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Throughput with `requests` submitted at once through run_async (copies of one
    request overlap the compute of another) against one request at a time."""
    n = max(4, requests * 3)
    session.run(None, feeds)
    t = time.perf_counter()
    for _ in range(n):
        session.run(None, feeds)
    seq = n / (time.perf_counter() - t)
    eng = session.device.copy_engine
    eng.log.clear()
    eng.keep_log = True
    spans: list[tuple[float, float]] = []
    session._compute_log = spans
    t = time.perf_counter()
    futs = [session.run_async(None, feeds) for _ in range(n)]
    for f in futs:
        f.result()
    par = n / (time.perf_counter() - t)
    eng.keep_log = False
    session._compute_log = None
    copy_total = sum(t1 - t0 for _, t0, t1, _ in eng.log)
    overl = 0.0
    for _, c0, c1, _ in eng.log:
        for s0, s1 in spans:
            overl += max(0.0, min(c1, s1) - max(c0, s0))
    return {"requests": float(requests), "throughput_per_s": par, "sequential_per_s": seq,
            "copy_overlap": overl / copy_total if copy_total > 0 else 0.0}
