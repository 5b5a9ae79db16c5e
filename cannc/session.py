"""Session: the onnxruntime-compatible face of a compiled model."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import mmap
import struct
import threading
import time
import weakref
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ._version import __version__
from .accuracy import accuracy_guard
from .artifact import Specialization
from .compiler import PIPELINES, CompileOptions, snapshot
from .compiler.control import ControlProgram, check_memory_budget, compile_program
from .compiler.inspect import inspect_report
from .compiler.inspect import without_fusion as without_fusion_figures
from .compiler.shapes import (
    VALUE_SPECIALISATION_ELEMS,
    complete_input_shapes,
    fmt_dims,
    value_deciding_inputs,
)
from .config import check_size
from .errors import CacheError, CanncError, CompileError, InputError, ModelError, ShapeError
from .ir.graph import Graph
from .ir.registry import Amp
from .ir.types import onnx_type_string
from .native.target import ObjectCache, default_cache, elf_symbols, host
from .passes.fusion import RULES
from .passes.precision import LIST_KINDS, PRECISIONS, PrecisionOptions
from .runtime.device import shared_device
from .runtime.profiler import Profile, profile
from .runtime.program import Program, WeightPool, dispatcher_object
from .runtime.stream import Event, is_pinned

if TYPE_CHECKING:
    import onnx

    from .frontend import LoadedModel

# Compiled specialisations kept per session for models with value-deciding inputs (one per
# distinct value; the least recently used goes beyond this).
MAX_VALUE_PROGRAMS = 32
MAX_ACCEPTED_SHAPES = 64   # input shape sets whose full check _check_inputs remembers


@dataclass(frozen=True)
class NodeArg:
    """Like onnxruntime.NodeArg: name, shape (ints, or strings for symbolic dims), type."""

    name: str
    shape: list[int | str]
    type: str

    def __repr__(self) -> str:
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape})"


class Session:
    """A compiled model. `run` mirrors onnxruntime.InferenceSession.run."""

    def __init__(self, model: Any, *, cores: int | None = None,
                 shapes: dict[str, Sequence[int]] | None = None, pipeline: str = "O1",
                 dump_after: Iterable[str] = (), eager: bool = True,
                 cache: ObjectCache | None = None,
                 fusion: bool | dict[str, bool] | str = True, inflight: int = 2,
                 pass_options: dict[str, dict[str, Any]] | None = None,
                 precision: str = "fp32",
                 precision_lists: dict[str, Sequence[str]] | None = None,
                 keep_fp32: Iterable[str] = (),
                 accuracy: dict[str, Any] | None = None) -> None:
        if cores is not None and (not isinstance(cores, int) or cores < 1):
            raise CanncError(f"cores must be a positive integer, got {cores!r}")
        if not isinstance(inflight, int) or inflight < 1:
            raise CanncError(f"inflight must be a positive integer, got {inflight!r}")
        if pipeline not in PIPELINES:
            raise CanncError(f"unknown pipeline {pipeline!r}; choose one of "
                             f"{', '.join(PIPELINES)}")
        fusion = _fusion_switches(fusion)
        dump_after = set(dump_after)
        # the model's file (or the .cnc's, see load), named by reports
        self.source: str | None = str(model) if isinstance(model, (str, PathLike)) else None
        self._model_ref = (model if isinstance(model, (str, PathLike, bytes, memoryview))
                           else None)
        # where _model_ref's bytes can be read again instead of being kept (load: a .cnc)
        self._reread: Callable[[], bytes] | None = None
        self._graph_lock = threading.RLock()
        self._precision_args = (precision, precision_lists, keep_fp32)
        pass_options = dict(pass_options or {})
        # a whole compiled program kept from an earlier process (compiler.snapshot): on a
        # hit the model is not even parsed until something needs its graph
        self._snap_options: dict[str, Any] | None = None
        self._digest: str | None = None
        snap = None
        if cache is None and accuracy is None and not dump_after \
                and self._model_ref is not None and snapshot.root() is not None:
            self._digest = snapshot.model_digest(model)
            if self._digest is not None:
                self._snap_options = _snap_options(
                    shared_device(cores).cores, pipeline, fusion, pass_options, precision,
                    precision_lists, keep_fp32)
                if eager:
                    snap = snapshot.load(self._snapshot_key(
                        "given", {k: list(v) for k, v in given_shapes(shapes).items()}))
        self._proto: LoadedModel | None = None       # serialised only when saved
        self._graph: Graph | None = None
        if snap is None:
            from .frontend import import_model, load_model  # (imports onnx)

            loaded = load_model(model)
            self._proto = loaded
            self._graph, _ = import_model(loaded)
            amp = precision_pass_options(self._graph, precision, precision_lists, keep_fp32)
            if amp is not None:
                if "mixed_precision" in pass_options:
                    raise CanncError("give the precision options as precision=, "
                                     "precision_lists= and keep_fp32=, or as "
                                     "pass_options['mixed_precision'], not both")
                pass_options["mixed_precision"] = amp
            self._io = snapshot.io_face(self._graph)
            self._num_nodes = self._graph.num_nodes()
        else:
            self._io, self._num_nodes = snap.face, snap.num_nodes
        self.options = CompileOptions(pipeline=pipeline,
                                      dump_after=dump_after, cache=cache, fusion=fusion,
                                      pass_options=pass_options)
        self.options.pass_manager()   # a misspelt pass, option or dump name fails here
        self.device = shared_device(cores)
        # what the accuracy guard did (None: no guard ran), see cannc.accuracy
        self.accuracy_report: dict[str, Any] | None = None
        if accuracy is not None:
            guard = accuracy_guard(self, accuracy)
            self.accuracy_report = guard.report
            self.options.pass_options["mixed_precision"] = {
                **self.options.pass_options.get("mixed_precision", {}),
                "keep_fp32": tuple(guard.keep_fp32)}
        # compiled programs by input shapes (+ the values of the value-deciding inputs),
        # least recently used first
        self._programs: OrderedDict[tuple, Program] = OrderedDict()
        self._weights = WeightPool(self.device)
        # inputs whose *values* decide shapes or kernel parameters (a Reshape target, Resize
        # scales, Slice starts... fed at run time): their values are part of the program key
        # and they become constants of the specialisation; every other input stays a
        # runtime input of native code (cannc.compiler.shapes.value_deciding_inputs)
        self._value_inputs: tuple[str, ...] = (
            () if snap is not None else value_deciding_inputs(self.graph))
        # input shapes (tuples per input) a full check has accepted, and the dtypes
        self._accepted: set[tuple] = set()
        io = self._io
        self._in_dtypes = [np.dtype(io.values[n].dtype) for n in io.inputs]
        self._last_values: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._pipe: dict[str, Any] | None = None
        self._compute_log: list[tuple[float, float]] | None = None
        self.inflight = inflight
        self._inputs = [NodeArg(n, list(io.values[n].shape),
                                onnx_type_string(io.values[n].dtype))
                        for n in io.inputs]
        self._outputs = []
        for n in io.outputs:
            t = io.values.get(n)
            self._outputs.append(NodeArg(n, list(t.shape) if t else [],
                                         onnx_type_string(t.dtype) if t else "tensor(float)"))
        if snap is not None:
            shp = self._default_shapes(shapes or {})
            key = tuple(tuple(int(d) for d in shp[n]) for n in self._io.inputs)
            self._programs[key] = self._adopt(snap)
        elif eager and not self._value_inputs:
            # (with value-deciding inputs, each run's values pick the specialisation)
            prog = self.specialize(self._default_shapes(shapes or {}))
            if self._snap_options is not None and isinstance(prog, Program):
                snapshot.store_later(self._snapshot_key(
                    "given", {k: list(v) for k, v in given_shapes(shapes).items()}),
                    prog.spec, self._io, self._num_nodes)

    def _snapshot_key(self, kind: str, shapes: Any) -> str:
        assert self._digest is not None and self._snap_options is not None
        return snapshot.program_key(self._digest, {**self._snap_options, kind: shapes})

    def _store_for_artifact(self, model: bytes, manifest: dict[str, Any]) -> None:
        """Leave this session's programs in the program cache under the entries a load()
        of the artifact (`model`, `manifest`) looks up, so that even its first load runs
        no pass and parses nothing (`cannc compile -o x.cnc` then `cannc run x.cnc`). Only
        where that load compiles as this session did: its options are the manifest's, with
        the default fusion and pass options, on as many cores as this session has."""
        if self._snap_options is None or self._value_inputs \
                or self._snap_options["fusion"] is not True or self._snap_options["pass_options"]:
            return
        digest = snapshot.model_digest(model)
        kw = _artifact_options(json.loads(json.dumps(manifest)))   # as load() reads it
        options = _snap_options(self.device.cores, kw["pipeline"], True, {}, kw["precision"],
                                kw["precision_lists"], kw["keep_fp32"])
        first = _first_shapes(manifest)
        for i, (key, prog) in enumerate(self._programs.items()):
            if not isinstance(prog, Program):
                continue
            entries = [("shapes", [list(s) for s in key])]
            if i == 0 and first is not None:
                entries.append(("given", {k: list(v) for k, v in given_shapes(first).items()}))
            for kind, shapes in entries:
                snapshot.store_later(snapshot.program_key(digest, {**options, kind: shapes}),
                                     prog.spec, self._io, self._num_nodes)

    def _adopt(self, snap: snapshot.Snapshot) -> Program:
        """The program of a stored specialisation (its weights are the entry's mapped
        pages: WeightPool.adopt)."""
        spec = snap.spec
        check_memory_budget(spec, self.device.cores)
        return Program(spec, self.device, dispatcher_object(), pool=self._weights, adopt=True)

    @property
    def io(self) -> Graph:
        """The model's inputs and outputs with their types (a Graph without nodes): what
        running needs, known without parsing the model after a program-cache hit."""
        return self._io

    @property
    def graph(self) -> Graph:
        """The model's graph as imported (parsed on first use after a program-cache hit)."""
        if self._graph is None:
            self._load_graph()
        assert self._graph is not None
        return self._graph

    def _load_graph(self) -> None:
        with self._graph_lock:
            if self._graph is not None:
                return
            ref = self._reread() if self._reread is not None else self._model_ref
            if self._digest is not None and snapshot.model_digest(ref) != self._digest:
                raise ModelError(f"the model {self.source or '(bytes)'} changed after this "
                                 "session was created from its compiled program: it cannot "
                                 "be compiled for other shapes or inspected; create the "
                                 "session again")
            from .frontend import import_model, load_model

            loaded = load_model(ref)
            graph, _ = import_model(loaded)
            amp = precision_pass_options(graph, *self._precision_args)
            if amp is not None:
                self.options.pass_options.setdefault("mixed_precision", amp)
            self._proto = loaded
            self._graph = graph

    def _model_proto(self) -> onnx.ModelProto:
        """The whole model (its weights put back in, if they were viewed in the file's
        bytes: a copy, made for save and inspect's comparison without fusion)."""
        if self._proto is None:
            self._load_graph()
        assert self._proto is not None
        return self._proto.complete()

    # -- onnxruntime-compatible API ------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        return ["CanncExecutionProvider"]

    def run(self, output_names: Sequence[str] | None, input_feed: dict[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        feeds, key = self._check_inputs(input_feed)
        names = None if output_names is None else self._check_output_names(output_names)
        prog = self._program(key, feeds)
        outs = prog.execute(feeds if prog.input_names == self._io.inputs else
                            {k: v for k, v in feeds.items() if k in prog.input_names})
        if names is None:    # (execute returns them in the model's order)
            return outs
        by_name = dict(zip(self._io.outputs, outs))
        return [by_name[n] for n in names]

    def run_async(self, output_names: Sequence[str] | None, input_feed: dict[str, Any]
                  ) -> Future:
        """Submit a run and return a Future of its outputs. Requests flow through three
        streams (copy in -> compute -> copy out), each request in its own execution
        context, so the copies of one overlap the compute of another. Inputs in pinned
        memory (Device.malloc_host) are copied asynchronously; inputs in ordinary memory
        are staged before this call returns (the aclrtMemcpyAsync rule)."""
        feeds, key = self._check_inputs(input_feed)
        names = self._check_output_names(output_names)
        prog = self._program(key, feeds)
        if isinstance(prog, ControlProgram):
            return self._run_host_program_async(prog, feeds, names)
        staged = {}
        for k, a in feeds.items():
            if k not in prog.input_names:
                continue
            if not is_pinned(a):
                pinned = self.device.malloc_host(a.shape, a.dtype)
                np.copyto(pinned, a)
                a = pinned
            staged[k] = a
        pipe = self._pipeline()
        fut: Future = Future()
        box: dict[str, Any] = {}
        e_in, e_done = Event(), Event()
        engine = self.device.copy_engine

        def copy_in() -> None:
            pipe["slots"].acquire()
            try:
                box["ctx"] = ctx = prog.acquire()
                for f in [engine.submit("h2d", ctx.inputs[k], a) for k, a in staged.items()]:
                    f.result()
            except BaseException as e:
                box["error"] = e

        def compute() -> None:
            if "error" in box:
                return
            try:
                t0 = time.perf_counter()
                prog.launch(box["ctx"])
                log = self._compute_log
                if log is not None:
                    log.append((t0, time.perf_counter()))
            except BaseException as e:
                box["error"] = e

        def copy_out() -> None:
            ctx = box.get("ctx")
            try:
                if "error" in box:
                    raise box["error"]
                outs = []
                futs = []
                for v in ctx.outputs:
                    host = self.device.malloc_host(v.shape, v.dtype)
                    futs.append(engine.submit("d2h", host, v))
                    outs.append(host)
                for f in futs:
                    f.result()
                by_name = dict(zip(self._io.outputs, outs))
                fut.set_result([by_name[n] for n in names])
            except BaseException as e:
                fut.set_exception(e)
            finally:
                if ctx is not None:
                    prog.release(ctx)
                pipe["slots"].release()

        pipe["h2d"].enqueue(copy_in)
        e_in.record(pipe["h2d"])
        pipe["compute"].wait_event(e_in)
        pipe["compute"].enqueue(compute)
        e_done.record(pipe["compute"])
        pipe["d2h"].wait_event(e_done)
        pipe["d2h"].enqueue(copy_out)
        return fut

    def _run_host_program_async(self, prog: ControlProgram, feeds: dict[str, np.ndarray],
                                names: list[str]) -> Future:
        """Runtime control flow: the host program runs on the compute stream as a whole
        (its programs copy in and out themselves)."""
        fut: Future = Future()
        feeds = {k: np.array(v, copy=True) for k, v in feeds.items() if k in prog.input_names}

        def job() -> None:
            try:
                by_name = dict(zip(self._io.outputs, prog.execute(feeds)))
                fut.set_result([by_name[n] for n in names])
            except BaseException as e:
                fut.set_exception(e)

        self._pipeline()["compute"].enqueue(job)
        return fut

    def _pipeline(self) -> dict[str, Any]:
        with self._lock:
            if self._pipe is None:
                self._pipe = {"h2d": self.device.stream("h2d"),
                              "compute": self.device.stream("compute"),
                              "d2h": self.device.stream("d2h"),
                              "slots": threading.Semaphore(self.inflight)}
                # the streams' threads end with the session (they would outlive it)
                weakref.finalize(self, _close_streams,
                                 [self._pipe[k] for k in ("h2d", "compute", "d2h")])
            return self._pipe

    def profile(self, input_feed: dict[str, Any], runs: int = 20, warmup: int = 3,
                pipeline_requests: int = 0) -> Profile:
        """Per-kernel times, GFLOP/s and GB/s against this machine's peak, per-core busy
        time, copy and compute time, memory; `.write_chrome_trace(path)`."""
        feeds, key = self._check_inputs(input_feed)
        if isinstance(self._program(key, feeds), ControlProgram):
            raise CanncError("profile: this model's control flow is chosen at run time (an "
                             "If on runtime data, a Loop or a Scan): it runs as a host "
                             "program over several compiled programs, not one kernel list")
        return profile(self, input_feed, runs=runs, warmup=warmup,
                       pipeline_requests=pipeline_requests)

    def inspect(self, shapes: dict[str, Sequence[int]] | None = None, *,
                values: dict[str, Any] | None = None,
                without_fusion: bool = True) -> dict[str, Any]:
        """What `cannc inspect --json` prints: the kernels of the specialisation for
        `shapes` (compiled if need be; inputs not given take their symbolic dims from the
        given ones, else from the first specialisation, else 1) with their nodes, FLOPs,
        bytes, tiling, predicted time and runtime dims; totals, memory plan, passes, what
        did not fuse and why. `without_fusion`: also compile the model without fusion and
        report its kernel count and traffic (`["fusion"]["without_fusion"]`; skipped when
        this session does not fuse). A model whose shapes depend on input values is
        inspected for `values` ({input: array}), else for the values of the last run;
        `["value_specialisation"]` says which inputs these are and how many values are
        compiled."""
        given = given_shapes(shapes)
        full = complete_input_shapes(self.graph, given, list(self._programs))
        if values is None and self._value_inputs:
            values = self._last_values
            for n, v in values.items():
                if n not in given:
                    full[n] = tuple(v.shape)
        prog = self.specialize(full, values=values)
        if isinstance(prog, ControlProgram):
            raise CanncError("inspect: this model's control flow is chosen at run time (an "
                             "If on runtime data, a Loop or a Scan), so it has no single "
                             "kernel list; its segments and subgraphs are compiled on first "
                             "use")
        rep = inspect_report(prog, cores=self.cores, pipeline=self.options.pipeline,
                             input_shapes=full, onnx_nodes=self._num_nodes,
                             fusion=self.options.fusion)
        rep["model"] = self.source
        rep["precision"] = self._precision_of(prog)
        if self.accuracy_report is not None:
            rep["accuracy"] = self.accuracy_report
        if self._value_inputs:
            rep["value_specialisation"] = {
                "inputs": list(self._value_inputs),
                "values": {n: np.asarray(v).tolist() for n, v in prog.spec.values.items()},
                "programs": len(self._programs), "limit": MAX_VALUE_PROGRAMS,
                "note": "the values of these inputs decide shapes or kernel parameters: the "
                        "model is compiled once per distinct value (least recently used "
                        f"evicted beyond {MAX_VALUE_PROGRAMS}); every other input is a "
                        "runtime input"}
        if without_fusion and self.options.fusion is not False:
            base = Session(self._model_proto(), cores=self.cores, pipeline=self.options.pipeline,
                           eager=False, cache=self.options.cache, fusion=False)
            rep["fusion"]["without_fusion"] = without_fusion_figures(base.inspect(
                full, values=prog.spec.values or None, without_fusion=False))
        return rep

    def precision_map(self) -> dict[str, str]:
        """Every ONNX node's precision in the programs compiled so far: "fp32", "bf16",
        "fp16", or "folded" (computed at compile time, or removed: it does not run); a
        node that runs in one program and is folded in another counts as running."""
        out: dict[str, str] = {}
        for prog in list(self._programs.values()):
            for name, p in self._precision_of(prog).items():
                if out.get(name, "folded") == "folded":
                    out[name] = p
        return {n.name: out.get(n.name, "fp32") for n in self.graph.nodes()}

    def contraction_nodes(self) -> list[str]:
        """The ONNX nodes the precision policy treats as contractions (its ALLOW class)."""
        amp = self.options.pass_options.get("mixed_precision", {})
        lists = PrecisionOptions(**{k: v for k, v in amp.items() if k in LIST_KINDS})
        return [n.name for n in self.graph.nodes() if lists.class_of(n) is Amp.ALLOW]

    def _precision_of(self, prog: Any) -> dict[str, str]:
        spec = getattr(prog, "spec", None)
        decided = spec.graph.meta.get("precision") if spec is not None else None
        if decided is None:        # (a host program of runtime control flow)
            return {n.name: "fp32" for n in self.graph.nodes()}
        return {n.name: decided.get(n.name, "folded") for n in self.graph.nodes()}

    def mem_info(self) -> dict[str, int]:
        """Device memory in use (arena, weights, workspace), its total and peak."""
        return self.device.mem_info()

    # -- compilation ----------------------------------------------------------------
    @property
    def cores(self) -> int:
        return self.device.cores

    def specialize(self, shapes: dict[str, Sequence[int]],
                   values: dict[str, Any] | None = None) -> Program:
        """The program for these input shapes (compiled if need be). A model with
        value-deciding inputs (`value_inputs` of inspect's report) needs their `values`."""
        shapes = self._default_shapes(shapes)   # checked against the declared shapes
        key = tuple(tuple(int(d) for d in shapes[n]) for n in self._io.inputs)
        if self._value_inputs:
            missing = [n for n in self._value_inputs if n not in (values or {})]
            if missing:
                raise ShapeError(f"the values of inputs {missing} decide this model's shapes "
                                 "or kernel parameters: it is specialised on them at run "
                                 "time (or give values=)")
            vals = {}
            for n in self._value_inputs:
                t = self._io.values[n]
                vals[n] = np.asarray(values[n], dtype=t.dtype)
            return self._program(key, vals)
        return self._program(key)

    def _program(self, key: tuple, feeds: dict[str, np.ndarray] | None = None) -> Program:
        if not self._value_inputs:
            prog = self._programs.get(key)   # (a dict read needs no lock)
            if prog is not None:
                return prog
        values = {n: feeds[n] for n in self._value_inputs} if feeds is not None else {}
        full = key + self._value_key(values)
        with self._lock:
            prog = self._programs.get(full)
            if prog is not None:
                if values:
                    self._programs.move_to_end(full)
                    self._last_values = prog.spec.values
                return prog
            shapes = dict(zip(self._io.inputs, key))
            for n, v in values.items():
                if v.size > VALUE_SPECIALISATION_ELEMS:
                    raise ShapeError(
                        f"input '{n}' decides shapes by its values, but has {v.size} elements "
                        f"(at most {VALUE_SPECIALISATION_ELEMS} are specialised on)")
            # a program compiled by an earlier process for these shapes
            snap_key = (self._snapshot_key("shapes", [list(s) for s in key])
                        if self._snap_options is not None and not values else None)
            snap = snapshot.load(snap_key) if snap_key is not None else None
            if snap is not None:
                prog = self._programs[full] = self._adopt(snap)
                return prog
            # one program, or a host program over compiled ones (runtime control flow)
            prog = compile_program(self.graph, shapes, self.options, self.device,
                                   self._weights,
                                   {n: np.array(v, copy=True) for n, v in values.items()})
            if snap_key is not None and isinstance(prog, Program):
                snapshot.store_later(snap_key, prog.spec, self._io, self._num_nodes)
            spec = prog.spec
            if values:
                while len(self._programs) >= MAX_VALUE_PROGRAMS:
                    self._programs.popitem(last=False)   # least recently used
                self._last_values = spec.values
            self._programs[full] = prog
            return prog

    def _value_key(self, values: dict[str, np.ndarray]) -> tuple:
        return tuple(("value", n, values[n].tobytes()) for n in self._value_inputs
                     if n in values)

    @property
    def value_inputs(self) -> tuple[str, ...]:
        """Inputs whose values decide shapes or kernel parameters: a run compiles (once,
        cached) a specialisation per distinct value of these."""
        return self._value_inputs

    @property
    def specializations(self) -> list[Specialization]:
        return [p.spec for p in self._programs.values()]

    @property
    def programs(self) -> dict[tuple, Program]:
        return dict(self._programs)

    @property
    def settled(self) -> bool:
        """Whether every program that has run has chosen the cores its launches use (a
        program on several cores times its first launches on every core and on core 0
        alone: runtime/corechoice.py; one never run has nothing to choose from).
        Benchmarks time runs once this is true."""
        return all(getattr(p, "core_choice", None) is None or p.core_choice.decided
                   or p.core_choice.unlaunched for p in list(self._programs.values()))

    def _default_shapes(self, shapes: Any) -> dict[str, tuple[int, ...]]:
        given = given_shapes(shapes)
        unknown = set(given) - set(self._io.inputs)
        if unknown:
            raise InputError(f"shapes given for unknown inputs {sorted(unknown, key=str)}; "
                             f"model inputs: {self._io.inputs}")
        out = {}
        for n in self._io.inputs:
            if n in given:
                shape = given[n]
                decl = self._io.values[n].shape
                if len(shape) != len(decl) or any(d < 0 for d in shape) or any(
                        isinstance(e, int) and e != d for d, e in zip(shape, decl)):
                    raise InputError(f"shape {list(shape)} given for input '{n}' does not "
                                     f"fit its declared shape {fmt_dims(decl)}")
                out[n] = shape
            else:
                out[n] = tuple(d if isinstance(d, int) else 1 for d in self._io.values[n].shape)
        return out

    # -- input checking: nothing unchecked reaches native code -------------------------
    def _check_inputs(self, feed: dict[str, Any]) -> tuple[dict[str, np.ndarray], tuple]:
        # the common case first: ndarrays of the right dtypes, in shapes a run has
        # already accepted (the full check below has passed them once)
        if type(feed) is dict and len(feed) == len(self._in_dtypes):
            try:
                arrs = [feed[n] for n in self._io.inputs]
            except KeyError:
                arrs = None
            if arrs is not None and all(type(a) is np.ndarray and a.dtype == dt
                                        for a, dt in zip(arrs, self._in_dtypes)):
                key = tuple(a.shape for a in arrs)
                if key in self._accepted:
                    # (the caller's dict: exactly the model's inputs; nothing writes it)
                    return feed, key
        feeds, key = self._check_inputs_full(feed)
        if all(type(feeds[n]) is np.ndarray and feeds[n] is feed[n] for n in feeds):
            if len(self._accepted) >= MAX_ACCEPTED_SHAPES:
                self._accepted.clear()
            self._accepted.add(key)
        return feeds, key

    def _check_inputs_full(self, feed: dict[str, Any]) -> tuple[dict[str, np.ndarray], tuple]:
        if not isinstance(feed, dict):
            raise InputError(f"inputs must be a dict name -> array, got {type(feed).__name__}")
        expected = self._io.inputs
        unknown = [k for k in feed if k not in expected]
        missing = [k for k in expected if k not in feed]
        if unknown or missing:
            parts = []
            if unknown:
                parts.append(f"unknown input name(s) {unknown}")
            if missing:
                parts.append(f"missing input(s) {missing}")
            raise InputError("; ".join(parts) + f"; the model's inputs are {expected}")
        feeds, key, bound = {}, [], {}
        for name in expected:
            arr = feed[name]
            t = self._io.values[name]
            if not isinstance(arr, np.ndarray):
                try:
                    arr = np.asarray(arr)
                except Exception as e:
                    raise InputError(f"input '{name}' is not array-like: {e}") from e
            if arr.dtype != np.dtype(t.dtype):
                raise InputError(f"input '{name}' has dtype {arr.dtype}, expected "
                                 f"{np.dtype(t.dtype)} ({onnx_type_string(t.dtype)})")
            # multiplied out first: a strided view declaring 2^40 elements is refused
            # before anything reads it (the value key, the copy in)
            check_size(f"input '{name}'", arr.shape, arr.dtype.itemsize)
            if arr.ndim != len(t.shape):
                raise InputError(f"input '{name}' has rank {arr.ndim} (shape {arr.shape}), "
                                 f"expected rank {len(t.shape)} {fmt_dims(t.shape)}")
            for i, (d, e) in enumerate(zip(arr.shape, t.shape)):
                if isinstance(e, int) and d != e:
                    raise InputError(f"input '{name}' has shape {arr.shape}, expected "
                                     f"{fmt_dims(t.shape)} (dimension {i} must be {e})")
                if isinstance(e, str):
                    if e in bound and bound[e][0] != d:
                        raise InputError(
                            f"dimension '{e}' is {bound[e][0]} in input '{bound[e][1]}' but "
                            f"{d} in input '{name}'")
                    bound.setdefault(e, (d, name))
            feeds[name] = arr
            key.append(tuple(int(x) for x in arr.shape))
        return feeds, tuple(key)

    def _check_output_names(self, names: Sequence[str] | None) -> list[str]:
        if names is None:
            return list(self._io.outputs)
        if isinstance(names, str):
            names = [names]
        bad = [n for n in names if n not in self._io.outputs]
        if bad:
            raise InputError(f"unknown output name(s) {bad}; the model's outputs are "
                             f"{self._io.outputs}")
        return list(names)

    # -- save / load ------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write a .cnc artifact: the model, and the object code of every specialisation."""
        manifest = {
            "format": "cannc-artifact", "version": 2, "cannc": __version__,
            "host": host().fingerprint, "cpu": host().cpu, "pipeline": self.options.pipeline,
            # the precision policy (with the nodes an accuracy guard kept in float32)
            "precision": {k: list(v) if isinstance(v, tuple) else v for k, v in
                          self.options.pass_options.get("mixed_precision", {}).items()},
            "accuracy": self.accuracy_report,     # what the guard did (None: no guard)
            "specializations": [list(map(list, k)) for k in self._programs
                                if not self._value_inputs],
            "inputs": list(self._io.inputs),      # the specializations' order (version 2)
            "objects": [],
        }
        model = self._model_proto().SerializeToString()
        try:
            self._write_artifact(path, model, manifest)
        except OSError as e:
            raise CacheError(f"cannot write the artifact {path}: {e}") from e
        if snapshot.root() is not None:
            self._store_for_artifact(model, manifest)

    def _write_artifact(self, path: str | Path, model: bytes, manifest: dict[str, Any]) -> None:
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
            manifest["model_xxh3_128"] = _checksum(model)
            # stored, not deflated: float weights shrink by ~7% for ~2 s of inflating at
            # every load of a BERT-base-sized artifact (the objects compress well)
            z.writestr("model.onnx", model, compress_type=zipfile.ZIP_STORED)
            for prog in self._programs.values():
                for k in prog.spec.kernels:
                    for sym, key in ((k.symbol, k.object_key), *k.needs):
                        if key in manifest["objects"]:
                            continue
                        obj = prog.spec.objects[sym]
                        z.writestr(f"objects/{key}.o", obj)
                        manifest["objects"].append(key)
                        manifest.setdefault("xxh3_128", {})[key] = _checksum(obj)
            z.writestr("manifest.json", json.dumps(manifest, indent=1))


def _snap_options(cores: int, pipeline: str, fusion: Any, pass_options: dict[str, Any],
                  precision: Any, precision_lists: Any, keep_fp32: Any) -> dict[str, Any]:
    """What a program-cache entry is keyed by besides the model and the shapes: the
    session's options as given (pass_options copied: the session adds its precision
    policy to its own later)."""
    return {"cores": cores, "pipeline": pipeline, "fusion": fusion,
            "pass_options": dict(pass_options), "precision": precision,
            "precision_lists": precision_lists, "keep_fp32": keep_fp32}


def _artifact_options(manifest: dict[str, Any]) -> dict[str, Any]:
    """The compile options of a session loaded from an artifact with this (checked)
    manifest: load() compiles with them, save() keys the programs it leaves for it."""
    amp = manifest.get("precision", {})
    return {"pipeline": manifest.get("pipeline", "O1"),
            "precision": amp.get("precision", "fp32"),
            "precision_lists": {k: amp[k] for k in LIST_KINDS if amp.get(k)},
            "keep_fp32": amp.get("keep_fp32", ())}


def _first_shapes(manifest: dict[str, Any]) -> dict[str, list[int]] | None:
    """The artifact's first specialisation's shapes by input name (None before version
    2, whose manifest does not name the inputs): load() makes it with the session."""
    names, specs = manifest.get("inputs"), manifest.get("specializations", [])
    if specs and isinstance(names, list) and len(names) == len(specs[0]) \
            and all(isinstance(n, str) for n in names):
        return dict(zip(names, specs[0]))
    return None


def _reread_model(path: str | PathLike) -> bytes:
    """A loaded artifact's model, read again (Session._load_graph checks it is the same)."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.read("model.onnx")
    except Exception as e:  # zipfile, zlib, OSError, KeyError
        raise ModelError(f"the artifact {path} can no longer be read ({type(e).__name__}: "
                         f"{e}): this session cannot be compiled for other shapes or "
                         "inspected; load it again") from e


def _checksum(data: bytes) -> str:
    """An artifact member's checksum (it finds damage; sha256, which artifacts before
    version 2 carry and load still checks, took 0.25 s per 400 MB model)."""
    return xxhash.xxh3_128(data).hexdigest()


def _matches(data: bytes, xxh3: Any, sha256: Any) -> bool:
    """Whether `data` has the checksum the manifest gives it: xxh3_128 since version 2,
    sha256 before (no checksum: no match)."""
    if xxh3 is not None:
        return _checksum(data) == xxh3
    return sha256 is not None and hashlib.sha256(data).hexdigest() == sha256


def precision_pass_options(graph: Any, precision: Any, lists: Any,
                           keep_fp32: Any) -> dict[str, Any] | None:
    """The mixed-precision pass's options from `compile()`'s precision=, precision_lists=
    and keep_fp32= (None when all are defaults), checked: an unknown precision, list kind,
    op type or node name is a CanncError naming it."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise CanncError(f"unknown precision {precision!r}; choose one of "
                         f"{', '.join(PRECISIONS)}")
    if lists is None:
        lists = {}
    if not isinstance(lists, dict):
        raise CanncError(f"precision_lists must be a dict like {{'allow': [...], 'deny': "
                         f"[...], 'follow': [...]}}, got {type(lists).__name__}")
    bad = sorted(set(map(str, lists)) - set(LIST_KINDS))
    if bad:
        raise CanncError(f"unknown precision list(s) {', '.join(bad)}; the lists are "
                         f"{', '.join(LIST_KINDS)}")
    if isinstance(keep_fp32, str):
        keep_fp32 = [keep_fp32]
    try:
        keep = list(keep_fp32)
    except TypeError:
        raise CanncError(f"keep_fp32 must be a list of node names, got {keep_fp32!r}") from None
    names = {n.name for n in graph.nodes()}
    unknown = [k for k in keep if k not in names]
    if unknown:
        raise CanncError(f"keep_fp32: no node named {', '.join(map(repr, unknown))} in the "
                         "model")
    if precision == "fp32" and not lists and not keep:
        return None
    opts = {"precision": precision, "keep_fp32": tuple(keep)}
    for kind, ops in lists.items():
        if isinstance(ops, str):
            ops = [ops]
        opts[kind] = tuple(ops)
    PrecisionOptions(**opts)      # the op types are checked here
    return opts


def _fusion_switches(fusion: Any) -> bool | dict[str, bool]:
    """True/False, {rule: bool}, or the path of a JSON switch file (like CANN's
    fusion_switch_file): {"elementwise": true, "gemm_epilogue": false, ...}."""
    if isinstance(fusion, (str, Path)):
        try:
            fusion = json.loads(Path(fusion).read_text())
        except (OSError, ValueError) as e:
            raise CanncError(f"cannot read the fusion switch file {fusion}: {e}") from e
    if isinstance(fusion, bool):
        return fusion
    if not isinstance(fusion, dict):
        raise CanncError(f"fusion must be a bool, a dict or a switch file path, "
                         f"got {type(fusion).__name__}")
    unknown = sorted(set(fusion) - set(RULES))
    if unknown:
        raise CanncError(f"unknown fusion rule(s) {unknown}; rules: {', '.join(RULES)}")
    return {k: bool(v) for k, v in fusion.items()}


def given_shapes(shapes: Any) -> dict[str, tuple[int, ...]]:
    """`shapes=` as a caller gives it ({input: sequence of ints}), checked: anything else
    is an InputError saying what was expected."""
    if shapes is None:
        return {}
    if not isinstance(shapes, dict):
        raise InputError(f"shapes must be a dict input name -> shape, got "
                         f"{type(shapes).__name__}")
    out = {}
    for n, shp in shapes.items():
        if isinstance(shp, (str, bytes)) or not isinstance(shp, (Sequence, np.ndarray)):
            raise InputError(f"the shape given for input {n!r} must be a sequence of "
                             f"integers, got {shp!r}")
        dims = []
        for d in shp:
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
                raise InputError(f"the shape given for input {n!r} must be a sequence of "
                                 f"integers, got {list(shp)!r}")
            if d < 0:
                raise InputError(f"the shape given for input {n!r} has a negative "
                                 f"dimension: {list(shp)!r}")
            dims.append(int(d))
        out[n] = tuple(dims)
    return out


def _close_streams(streams: list[Any]) -> None:
    for s in streams:
        s.close()


def load(path: str | Path, *, cores: int | None = None) -> Session:
    """Load a .cnc artifact written by Session.save (or `cannc compile`) without recompiling."""
    # the artifact's file mapping and the model's view of it are closed on return
    # (nothing keeps the view: a miss parsed a copy)
    with contextlib.ExitStack() as mapped:
        return _load(path, cores, mapped)


def _stored_view(path: Any, z: zipfile.ZipFile, name: str, mapped: contextlib.ExitStack
                 ) -> memoryview | None:
    """Member `name` of the artifact file at `path`, if it is stored (not deflated), as a
    view of the file mapped into memory: nothing read or copied until it is hashed or
    parsed (a BERT-base model: 0.45 s of reading and CRC on every load). Its xxh3 checksum
    stands for the CRC. None for a compressed member, an artifact that is not a file, or a
    file that cannot be mapped."""
    if not isinstance(path, (str, PathLike)):
        return None
    info = z.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    try:
        with open(path, "rb") as f:
            m = mapped.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except (OSError, ValueError):       # a file that cannot be mapped: read it
        return None
    h = info.header_offset
    if m[h:h + 4] != b"PK\x03\x04":
        raise CacheError(f"{path}: damaged zip (no local header for {name})")
    name_len, extra_len = struct.unpack("<HH", m[h + 26:h + 30])
    start = h + 30 + name_len + extra_len
    if start + info.file_size > len(m):
        raise CacheError(f"{path}: damaged zip ({name} runs past the end of the file)")
    return mapped.enter_context(memoryview(m)[start:start + info.file_size])


def _load(path: str | Path, cores: int | None, mapped: contextlib.ExitStack) -> Session:
    try:
        with zipfile.ZipFile(path) as z:
            manifest = json.loads(z.read("manifest.json"))
            if not isinstance(manifest, dict) or manifest.get("format") != "cannc-artifact":
                raise CacheError(f"{path} is not a cannc artifact (bad manifest)")
            model: bytes | memoryview | None = None
            if manifest.get("model_xxh3_128") is not None:      # (checked just below)
                model = _stored_view(path, z, "model.onnx", mapped)
            if model is None:
                model = z.read("model.onnx")
            keys = manifest.get("objects", [])
            xsums, ssums = manifest.get("xxh3_128", {}), manifest.get("sha256", {})
            if not isinstance(keys, list) or not isinstance(xsums, dict) \
                    or not isinstance(ssums, dict):
                raise CacheError(f"{path}: damaged manifest")
            objs = {}
            model_sums = manifest.get("model_xxh3_128"), manifest.get("model_sha256")
            if model_sums != (None, None) and not _matches(model, *model_sums):
                raise CacheError(f"{path}: the embedded model is damaged (checksum mismatch)")
            for k in keys:
                data = z.read(f"objects/{k}.o")
                if not _matches(data, xsums.get(k), ssums.get(k)):
                    raise CacheError(f"{path}: object {k} is damaged (checksum mismatch)")
                try:
                    elf_symbols(data)     # a malformed object never reaches the JIT
                except CompileError as e:
                    raise CacheError(f"{path}: object {k} is damaged: {e}") from e
                objs[k] = data
            specs = manifest.get("specializations", [])
            if not isinstance(specs, list) or not all(
                    isinstance(s, list) and all(isinstance(d, list) and all(
                        isinstance(x, int) and x >= 0 for x in d) for d in s) for s in specs):
                raise CacheError(f"{path}: damaged manifest (specializations)")
            pipeline = manifest.get("pipeline", "O1")
            if pipeline not in PIPELINES:
                raise CacheError(f"{path}: damaged manifest (pipeline {pipeline!r})")
            amp = manifest.get("precision", {})
            if not isinstance(amp, dict) or not all(
                    k in ("precision", "keep_fp32", *LIST_KINDS) for k in amp):
                raise CacheError(f"{path}: damaged manifest (precision)")
    except CacheError:
        raise
    except Exception as e:  # zipfile, zlib, json, OSError, KeyError, ...
        raise CacheError(f"{path} is not a valid cannc artifact: {type(e).__name__}: {e}") from e
    # The session gets the model's bytes, so the programs an earlier load of the same
    # artifact (same options) left in the program cache are read back as on any hit:
    # nothing parsed, no pass run. Else the model is parsed, the passes run, and
    # lowering finds every object in the process's object cache, which the artifact's
    # join (keyed by content: they are what a compile here would make): no LLVM.
    default_cache().memory.update(objs)
    # The first specialisation is made with the session: a hit of its entry (which the
    # session that saved the artifact left, see Session._store_for_artifact, or an earlier
    # load) gives the session its inputs and outputs without the model.
    first = _first_shapes(manifest)
    try:
        sess = Session(model, cores=cores, eager=first is not None, shapes=first,
                       **_artifact_options(manifest))
    except ModelError as e:
        raise CacheError(f"{path}: the embedded model is damaged: {e}") from e
    except CanncError as e:
        raise CacheError(f"{path}: damaged manifest ({type(e).__name__}: {e})") from e
    sess.source = str(path)
    if isinstance(path, (str, PathLike)):
        # the model's bytes (as big as its weights) are read again from the artifact if
        # the session ever needs its graph, not kept (its programs hold their weights)
        sess._model_ref, sess._reread = None, functools.partial(_reread_model, path)
    acc = manifest.get("accuracy")
    sess.accuracy_report = acc if isinstance(acc, dict) else None
    for shp in specs:
        if len(shp) != len(sess.io.inputs):
            raise CacheError(f"{path}: damaged manifest (specialization {shp})")
        try:
            sess.specialize(dict(zip(sess.io.inputs, [tuple(s) for s in shp])))
        except InputError as e:
            raise CacheError(f"{path}: damaged manifest (specialization {shp}: {e})") from e
    return sess


