"""cannc and onnxruntime side by side: the reference session, output comparison, timing.

What `cannc run --check`, `cannc bench`, the benchmarks and the tests use to hold cannc
against onnxruntime: an ORT CPU session set up the same way every time, a comparison of
one output within the dtype's tolerance, and timing.

`bench` times each engine in its own process (`python -m cannc.benchproc`, one after the
other or -- rounds > 1 -- kept alive and taking turns batch by batch, the same feeds file
and thread count): ORT's spinning pool threads would otherwise
steal the cores of a neighbour in the same process. `bench_interleaved` is the older
in-process alternation of a cannc and an ORT session (spinning off), kept for the scans
that want both engines under the same machine noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .compiler.shapes import type_string
from .errors import CanncError


def ort_session_options(threads: int, spinning: bool = True) -> Any:
    """The ``ort.SessionOptions`` of every comparison: ORT_ENABLE_ALL, `threads` intra-op
    threads, sequential; `spinning=False` stops idle pool threads busy-waiting."""
    import onnxruntime as ort  # lazy: only the comparisons need it (CLI start-up time)

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if not spinning:
        # ORT's idle pool threads otherwise busy-wait after each run and take the cores
        # from the cannc run that follows in an interleaved benchmark.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def ort_session(source: str | bytes, threads: int, spinning: bool = True) -> Any:
    """An onnxruntime CPU session as cannc is compared with it (`ort_session_options`);
    `spinning=False` for interleaved timing."""
    import onnxruntime as ort

    so = ort_session_options(threads, spinning)
    try:
        return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise CanncError(f"onnxruntime cannot load the model: {e}") from e


def ort_run(ort_sess: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    try:
        return ort_sess.run(None, feeds)
    except Exception as e:
        raise CanncError(f"onnxruntime failed to run the model: {e}") from e


def tolerance(dtype: np.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    loose = np.dtype(dtype).itemsize <= 2  # float16 / bfloat16
    return (rtol if rtol is not None else (1e-3 if loose else 1e-4),
            atol if atol is not None else (1e-3 if loose else 1e-4))


def compare(name: str, got: np.ndarray, exp: np.ndarray, rtol: float | None = None,
            atol: float | None = None) -> dict[str, Any]:
    """One output against the reference: floats within rtol/atol (NaN matches NaN),
    everything else exactly. Max rel error is |got - exp| / max(|exp|, atol)."""
    exp = np.asarray(exp)
    res: dict[str, Any] = {"name": name, "shape": list(got.shape), "dtype": str(got.dtype),
                           "max_abs": 0.0, "max_rel": 0.0, "ok": True, "problem": None}
    if got.shape != exp.shape or got.dtype != exp.dtype:
        res.update(ok=False, problem=f"cannc gives {type_string(got.dtype, got.shape)}, "
                                     f"onnxruntime {type_string(exp.dtype, exp.shape)}")
        return res
    if got.size == 0:
        return res
    if got.dtype.kind in "fcV":
        rt, at = tolerance(got.dtype, rtol, atol)
        g, e = got.astype(np.float64), exp.astype(np.float64)
        diff = np.abs(g - e)
        diff[(g == e) | (np.isnan(g) & np.isnan(e))] = 0.0   # equal infinities, both NaN
        diff[np.isnan(diff)] = np.inf                         # NaN on one side only
        rel = diff / np.maximum(np.abs(np.nan_to_num(e)), at)
        res.update(max_abs=float(diff.max()), max_rel=float(rel.max()), rtol=rt, atol=at,
                   ok=bool(np.all(diff <= at + rt * np.abs(np.nan_to_num(e)))))
    else:
        diff = np.abs(got.astype(np.int64) - exp.astype(np.int64)) if got.dtype != np.uint64 \
            else (got != exp).astype(np.int64)
        res.update(max_abs=float(diff.max()), max_rel=0.0, ok=bool(np.array_equal(got, exp)))
    if not res["ok"]:
        res["problem"] = "values differ"
    return res



# ---------------------------------------------------------------------------------------
# a float64 referee for outputs that disagree in float32
# ---------------------------------------------------------------------------------------

def _graph_to_double(graph: Any) -> None:
    """Every float32 tensor of ``graph`` (and its subgraphs) made float64 in place:
    initializers, tensor attributes, declared types and Cast targets."""
    from onnx import AttributeProto, TensorProto, numpy_helper

    def double(t: Any) -> None:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64),
                                               t.name))
    for t in graph.initializer:
        double(t)
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in graph.node:
        for a in node.attribute:
            if a.type == AttributeProto.TENSOR:
                double(a.t)
            elif a.type == AttributeProto.GRAPH:
                _graph_to_double(a.g)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    _graph_to_double(g)
            elif a.name == "to" and node.op_type == "Cast" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE


def float64_referee(onnx_path: str, feeds: dict[str, np.ndarray],
                    outs: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """When float32 engines disagree beyond the tolerance, which is closer to the exact
    result? The model evaluated in float64 (onnx's reference evaluator, every float32
    tensor widened) is the referee: per engine, the largest error of its outputs against
    it, absolute and relative to the largest magnitude of that output. A deep network's
    float32 results differ from each other by rounding in the summation order; the
    elementwise tolerance fails on its near-zero values (ResNet-50's logits reach 276:
    an error of 1e-4 fails rtol 1e-4 on a logit of 0.5). The verdict says whether cannc
    is as close to the float64 result as onnxruntime (within 2x its error)."""
    try:
        import onnx
        from onnx.reference import ReferenceEvaluator

        m = onnx.load(onnx_path)
        _graph_to_double(m.graph)
        names = [o.name for o in m.graph.output]
        f64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v
               for k, v in feeds.items()}
        exact = dict(zip(names, ReferenceEvaluator(m).run(None, f64)))
    except Exception as e:   # (the reference evaluator lacks ops or double kernels)
        return {"available": False, "why": f"{type(e).__name__}: {e}"[:300]}
    res: dict[str, Any] = {"available": True, "engines": {}}
    for eng, got in outs.items():
        worst_abs = worst_scaled = 0.0
        for i, (name, ref) in enumerate(exact.items()):
            g = got.get(name, list(got.values())[i] if i < len(got) else None)
            ref = np.asarray(ref)
            if g is None or np.shape(g) != ref.shape or ref.dtype.kind != "f" or ref.size == 0:
                continue
            err = float(np.nanmax(np.abs(np.asarray(g, np.float64) - ref)))
            scale = float(np.nanmax(np.abs(ref))) or 1.0
            worst_abs, worst_scaled = max(worst_abs, err), max(worst_scaled, err / scale)
        res["engines"][eng] = {"max_abs": worst_abs, "max_abs_over_max": worst_scaled}
    if "cannc" in res["engines"] and "ort" in res["engines"]:
        c, o = res["engines"]["cannc"]["max_abs"], res["engines"]["ort"]["max_abs"]
        res["cannc_as_close_as_ort"] = bool(c <= 2.0 * o + 1e-12)
    return res


def referee_summary(ref: dict[str, Any], label: Callable[[str], str] = str) -> str:
    """One line of what `float64_referee` found: each engine's largest error against the
    float64 evaluation and the verdict (engine names through ``label``)."""
    if not ref.get("available"):
        return f"not available ({ref.get('why', 'not run')})"
    errs = ", ".join(f"{label(e)} {v['max_abs']:.3g} ({v['max_abs_over_max']:.2g} of the "
                     "largest value)" for e, v in ref["engines"].items())
    out = f"largest errors against the model evaluated in float64: {errs}"
    if "cannc_as_close_as_ort" in ref:
        out += ("; cannc is as close to it as onnxruntime: the difference is float32 rounding"
                if ref["cannc_as_close_as_ort"] else "; cannc is further from it than onnxruntime")
    return out


# ---------------------------------------------------------------------------------------
# timing each engine in its own process
# ---------------------------------------------------------------------------------------

# the engines `python -m cannc.benchproc` times; ORT's CPU provider is the reference
ENGINES = ("ort", "cannc", "ort+cannc", "openvino")
LABELS = {"ort": "ORT CPU", "cannc": "cannc alone", "ort+cannc": "ORT+cannc",
          "openvino": "OpenVINO"}
# float outputs of reduced-precision runs against ORT's float32 ones
LOOSE_TOLERANCE = (5e-2, 5e-2)
FP32_TOLERANCE = (1e-4, 1e-5)


class WorkerError(CanncError):
    """A benchmark worker failed: names the engine, with the tail of its stderr."""

    def __init__(self, engine: str, message: str, stderr: str = "") -> None:
        self.engine, self.stderr = engine, stderr
        tail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-6:]
                          if line.strip())
        super().__init__(f"benchmark worker '{engine}' ({LABELS.get(engine, engine)}) failed: "
                         f"{message}"
                         + (f" (stderr: {tail})" if tail else ""))


def save_arrays(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Named arrays to an .npz, names kept apart (any name works, order is kept)."""
    names = list(arrays)
    np.savez(str(path), __names__=np.array(names, dtype=str),
             **{f"a{i}": np.asarray(a) for i, a in enumerate(arrays.values())})


def load_arrays(path: str | Path) -> dict[str, np.ndarray]:
    try:
        with np.load(str(path), allow_pickle=False) as z:
            names = [str(n) for n in z["__names__"]]
            return {n: z[f"a{i}"] for i, n in enumerate(names)}
    except (OSError, KeyError, ValueError) as e:
        raise CanncError(f"cannot read the arrays file {path}: {e}") from e


def worker_command(engine: str, model: str, feeds: str, *, threads: int, warmup: int,
                   runs: int, precision: str = "fp32", options: dict[str, Any] | None = None,
                   outputs: str | None = None, spinning: bool = True,
                   python: str | None = None) -> list[str]:
    """The command line of one benchmark worker (`python -m cannc.benchproc ...`)."""
    cmd = [python or sys.executable, "-m", "cannc.benchproc", "--engine", engine,
           "--model", str(model), "--feeds", str(feeds), "--threads", str(threads),
           "--warmup", str(warmup), "--runs", str(runs), "--precision", precision]
    if options:
        cmd += ["--options", json.dumps(options)]
    if outputs:
        cmd += ["--outputs", str(outputs)]
    if not spinning:
        cmd.append("--no-spin")
    return cmd


def worker_env(threads: int) -> dict[str, str]:
    """The worker's environment: this cannc importable first, BLAS/OpenMP pools at
    `threads`."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    here = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def run_worker(engine: str, model: str, feeds: str, *, threads: int, warmup: int, runs: int,
               precision: str = "fp32", options: dict[str, Any] | None = None,
               outputs: str | None = None, spinning: bool = True,
               timeout: float | None = None, python: str | None = None) -> dict[str, Any]:
    """Time one engine in a fresh process; its JSON report (status "ok" or "skipped").
    A worker that fails, crashes or times out raises WorkerError naming the engine."""
    cmd = worker_command(engine, model, feeds, threads=threads, warmup=warmup, runs=runs,
                         precision=precision, options=options, outputs=outputs,
                         spinning=spinning, python=python)
    try:
        p = subprocess.run(cmd, env=worker_env(threads), capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (
            e.stderr or "")
        raise WorkerError(engine, f"timed out after {timeout:g} s", err) from None
    except OSError as e:
        raise WorkerError(engine, f"cannot start {cmd[0]}: {e}") from None
    rep = None
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            try:
                rep = json.loads(line)
            except ValueError:
                continue
            break
    if rep is None:
        raise WorkerError(engine, f"exit code {p.returncode}, no report", p.stderr)
    if rep.get("status") == "error":
        raise WorkerError(engine, rep.get("error", "unknown error"),
                          "" if rep.get("clean") else p.stderr)
    if p.returncode != 0:
        raise WorkerError(engine, f"exit code {p.returncode}", p.stderr)
    return rep


class ServedWorker:
    """One engine's worker kept alive (`benchproc --serve`) so that `bench` can time the
    engines in alternating rounds. Its stderr goes to a file (a full pipe would block
    it); every reply is awaited for at most `timeout` seconds."""

    def __init__(self, engine: str, model: str, feeds: str, *, threads: int, warmup: int,
                 precision: str = "fp32", options: dict[str, Any] | None = None,
                 outputs: str | None = None, spinning: bool = True,
                 timeout: float | None = None, python: str | None = None,
                 workdir: str | None = None) -> None:
        self.engine, self.timeout = engine, timeout
        cmd = worker_command(engine, model, feeds, threads=threads, warmup=warmup, runs=1,
                             precision=precision, options=options, outputs=outputs,
                             spinning=spinning, python=python) + ["--serve"]
        self._err = tempfile.TemporaryFile(mode="w+", dir=workdir)
        try:
            self.proc = subprocess.Popen(cmd, env=worker_env(threads), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._err, text=True,
                                         bufsize=1)
        except OSError as e:
            self._err.close()
            raise WorkerError(engine, f"cannot start {cmd[0]}: {e}") from None
        try:
            self.ready = self._reply()     # status "ready", "skipped" (then it has exited)
        except WorkerError:
            self.close()
            raise

    def _stderr(self) -> str:
        self._err.seek(0)
        return self._err.read()

    def _reply(self) -> dict[str, Any]:
        import selectors
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.timeout):
                err = self._stderr()
                self.close()
                raise WorkerError(self.engine, f"timed out after {self.timeout:g} s", err)
        line = self.proc.stdout.readline()
        rep = None
        if line.startswith("{"):
            try:
                rep = json.loads(line)
            except ValueError:
                rep = None
        if rep is None:
            rc = self.proc.wait()
            raise WorkerError(self.engine, f"exit code {rc}, no report", self._stderr())
        if rep.get("status") == "error":
            self.proc.wait()
            raise WorkerError(self.engine, rep.get("error", "unknown error"),
                              "" if rep.get("clean") else self._stderr())
        return rep

    def command(self, line: str) -> dict[str, Any]:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:
            rc = self.proc.wait()
            raise WorkerError(self.engine, f"exit code {rc} while serving",
                              self._stderr()) from None
        return self._reply()

    def run(self, n: int) -> list[float]:
        return self.command(f"run {n}")["times_ms"]

    def cpu_ns(self) -> int | None:
        """CPU time the worker's threads have used so far (ns; None: unknown here)."""
        try:
            tasks = Path(f"/proc/{self.proc.pid}/task")
            return sum(int((t / "schedstat").read_text().split()[0])
                       for t in tasks.iterdir())
        except (OSError, ValueError, IndexError):
            return None

    def quiesce(self, window: float = 0.01, limit: float = 1.0) -> float:
        """Wait (at most `limit` s) until the worker's threads have stopped running --
        onnxruntime's pool threads spin ~50 ms after a run, which would steal a core from
        the next engine's batch; seconds waited. Without /proc: sleeps `window` * 10."""
        t0 = time.perf_counter()
        prev = self.cpu_ns()
        if prev is None:
            time.sleep(window * 10)
            return time.perf_counter() - t0
        while time.perf_counter() - t0 < limit:
            time.sleep(window)
            cur = self.cpu_ns()
            if cur is None or cur - prev < window * 1e9 * 0.05:
                break
            prev = cur
        return time.perf_counter() - t0

    def finish(self) -> dict[str, Any]:
        rep = self.command("done")
        rc = self.proc.wait()
        if rc != 0:
            raise WorkerError(self.engine, f"exit code {rc}", self._stderr())
        self.close()
        return rep

    def close(self) -> None:
        """Kill the worker if it still runs and release its pipes (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f and not f.closed:
                f.close()
        self._err.close()


def round_sizes(runs: int, rounds: int) -> list[int]:
    """`runs` timed runs cut into `rounds` batches (nearly equal, none empty)."""
    rounds = max(1, min(rounds, runs))
    return [(i + 1) * runs // rounds - i * runs // rounds for i in range(rounds)]


def compare_all(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], precision: str,
                rtol: float | None = None, atol: float | None = None) -> dict[str, Any]:
    """Every reference output against an engine's: float32 within rtol 1e-4 / atol 1e-5,
    reduced precision (or 16-bit outputs) within 5e-2 / 5e-2, unless rtol/atol are given."""
    dflt = FP32_TOLERANCE if precision == "fp32" else LOOSE_TOLERANCE
    per = []
    for i, (name, exp) in enumerate(ref.items()):
        if name in got:
            g = got[name]
        elif i < len(got):   # engines may name outputs differently: by position
            g = list(got.values())[i]
        else:
            per.append({"name": name, "ok": False, "problem": "output missing"})
            continue
        loose = np.asarray(g).dtype.itemsize <= 2 and np.asarray(g).dtype.kind in "fV"
        rt = rtol if rtol is not None else (LOOSE_TOLERANCE[0] if loose else dflt[0])
        at = atol if atol is not None else (LOOSE_TOLERANCE[1] if loose else dflt[1])
        per.append(compare(name, np.asarray(g), exp, rt, at))
    return {"ok": all(r["ok"] for r in per), "outputs": per,
            "max_abs": max((r.get("max_abs", 0.0) for r in per), default=0.0),
            "max_rel": max((r.get("max_rel", 0.0) for r in per), default=0.0)}


def bench(model: str, feeds: dict[str, np.ndarray], *, threads: int, warmup: int = 5,
          runs: int = 50, engines: Sequence[str] = ("ort", "cannc"), precision: str = "fp32",
          options: dict[str, Any] | None = None, onnx_model: str | None = None,
          spinning: bool = True, rtol: float | None = None, atol: float | None = None,
          timeout: float | None = None, workdir: str | None = None,
          errors: str = "raise", rounds: int = 1) -> dict[str, Any]:
    """Time each engine in its own process on the same feeds and thread count; ORT CPU
    first (the reference of the ratios and the outputs). rounds = 1: one engine after
    the other; rounds > 1: every engine's process is built and warmed up (one at a
    time), then the `runs` are cut into `rounds` batches and the engines take turns,
    batch by batch (which goes first rotates; the next batch starts once the last
    engine's threads have stopped spinning), so that the drift of a shared machine
    falls on every engine alike. The reports say "rounds".

    `model` is what cannc opens (.onnx or .cnc), `onnx_model` what ORT opens (default
    `model`). `options` are cannc.compile options besides cores and precision (fusion,
    precision lists). Returns {"engines": {engine: figures}, engine: figures (the same),
    "ratios": {engine: median / ORT CPU median}, "ratio": cannc / ORT CPU,
    "outputs": {engine: comparison}, "outputs_agree", "skipped", "failed"}; times in ms.
    A failing worker raises WorkerError; with errors="record" a failing engine other than
    ORT CPU (the reference) is recorded in "failed" ({engine: message}) instead."""
    if errors not in ("raise", "record"):
        raise CanncError(f"errors must be 'raise' or 'record', got {errors!r}")
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise CanncError(f"unknown benchmark engine(s) {bad}; known: {', '.join(ENGINES)}")
    order = ["ort"] + [e for e in dict.fromkeys(engines) if e != "ort"]
    with tempfile.TemporaryDirectory(prefix="cannc_bench_", dir=workdir) as tmp:
        feeds_path = str(Path(tmp) / "feeds.npz")
        save_arrays(feeds_path, feeds)
        reps: dict[str, dict[str, Any]] = {}
        outs: dict[str, dict[str, np.ndarray]] = {}
        skipped: dict[str, str] = {}
        failed: dict[str, str] = {}
        def out_path(eng: str) -> str:
            return str(Path(tmp) / f"{eng.replace('+', '_')}.out.npz")

        def worker_args(eng: str) -> tuple[tuple, dict[str, Any]]:
            return ((eng, model if eng == "cannc" else (onnx_model or model), feeds_path),
                    dict(threads=threads, warmup=warmup,
                         precision=precision if eng != "ort" else "fp32",
                         options=options if eng == "cannc" else None,
                         outputs=out_path(eng), spinning=spinning, timeout=timeout))

        def failure(eng: str, e: WorkerError) -> None:
            if errors != "record" or eng == "ort":
                raise e
            failed[eng] = str(e)

        done: dict[str, dict[str, Any]] = {}
        if rounds <= 1:
            for eng in order:
                a, kw = worker_args(eng)
                try:
                    done[eng] = run_worker(*a, runs=runs, **kw)
                except WorkerError as e:
                    failure(eng, e)
        else:
            live: dict[str, ServedWorker] = {}
            try:
                for eng in order:
                    a, kw = worker_args(eng)
                    try:
                        w = ServedWorker(*a, workdir=tmp, **kw)
                    except WorkerError as e:
                        failure(eng, e)
                        continue
                    if w.ready.get("status") == "skipped":
                        done[eng] = w.ready
                        w.close()
                    else:
                        live[eng] = w
                for r, n in enumerate(round_sizes(runs, rounds)):
                    turn = list(live)
                    turn = turn[r % len(turn):] + turn[:r % len(turn)] if turn else turn
                    for eng in turn:
                        try:
                            live[eng].run(n)
                        except WorkerError as e:
                            live.pop(eng).close()
                            failure(eng, e)
                            continue
                        live[eng].quiesce()    # its spinning threads stop first
                for eng, w in list(live.items()):
                    try:
                        done[eng] = w.finish()
                    except WorkerError as e:
                        failure(eng, e)
                    live.pop(eng)
            finally:
                for w in live.values():
                    w.close()
        for eng in order:
            rep = done.get(eng)
            if rep is None:
                continue
            if rep.get("status") == "skipped":
                skipped[eng] = rep.get("note", "skipped")
                continue
            reps[eng] = {k: v for k, v in rep.items() if k != "status"}
            outs[eng] = load_arrays(out_path(eng))
    res: dict[str, Any] = {"engines": reps, **reps, "skipped": skipped, "failed": failed}
    ref_ms = reps["ort"]["median_ms"]
    res["ratios"] = {e: r["median_ms"] / ref_ms for e, r in reps.items()}
    if "cannc" in reps:
        res["ratio"] = res["ratios"]["cannc"]
    res["outputs"] = {e: compare_all(outs[e], outs["ort"], precision, rtol, atol)
                      for e in reps if e != "ort"}
    res["outputs_agree"] = all(c["ok"] for c in res["outputs"].values())
    src = onnx_model or model
    if not res["outputs_agree"] and precision == "fp32" and str(src).endswith(".onnx"):
        res["float64_referee"] = float64_referee(str(src), feeds, outs)
    return res


def bench_interleaved(sess: Any, ort_sess: Any, feeds: dict[str, np.ndarray], warmup: int,
                      runs: int) -> dict[str, Any]:
    """Time cannc and onnxruntime alternately in THIS process (which goes first alternates
    too), so both see the same machine noise; make `ort_sess` with spinning=False. Times in
    ms."""
    def cannc_run() -> None:
        sess.run(None, feeds)

    def ort_run() -> None:
        ort_sess.run(None, feeds)

    times: dict[str, list[float]] = {"cannc": [], "ort": []}
    pairs = [("cannc", cannc_run), ("ort", ort_run)]
    for i in range(warmup + runs):
        for name, fn in (pairs if i % 2 == 0 else pairs[::-1]):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt * 1e3)
    out: dict[str, Any] = {}
    for name, ts in times.items():
        p10, p50, p90 = np.percentile(ts, [10, 50, 90])
        out[name] = {"median_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90),
                     "min_ms": float(min(ts))}
    out["ratio"] = out["cannc"]["median_ms"] / out["ort"]["median_ms"]
    return out
