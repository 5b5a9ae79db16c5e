"""Runtime control flow: a host program over compiled cannc programs.

A graph whose If conditions all fold becomes one specialisation (passes/control.py
inlines the branches). When a condition depends on runtime data, or the graph has a
Loop or a Scan, the graph is cut at those nodes into *segments* (the nodes between two
of them, in topological order) and the specialisation becomes a host program: each
segment and each subgraph is compiled as a cannc program of its own (a
sub-specialisation, compiled on first use for the shapes (and value-deciding values) it
meets, then cached); a run executes the segments in order on the device, and at a
control-flow node the host does what the op's `control` says: an If reads its condition
back (copied out after the kernels that produce it) and runs the branch it names; a
Loop runs its body while the trip count and the condition allow, feeding the carried
values back; a Scan runs its body once per slice of its scan inputs. Everything still
runs as native code; the host only moves values between programs (slices, stacking).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..artifact import MemoryPlan, Specialization
from ..config import check_budget, fmt_bytes
from ..errors import ShapeError, UnsupportedOpError
from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.ops.control import own_inputs, scan_layout
from ..ir.registry import Control
from ..ir.types import TensorType, dtype_key
from ..passes.control import has_subgraphs
from ..passes.fold import bind_input_shapes
from ..passes.manager import PassContext, PassManager
from ..runtime.device import Device
from ..runtime.program import Program, WeightPool, dispatcher_object
from .pipeline import CompileOptions, specialize
from .shapes import value_deciding_inputs

# sub-specialisations kept per segment or branch (one per input shapes and values)
MAX_SUB_PROGRAMS = 16


@dataclass
class Step:
    """A segment (`graph`: nodes between two runtime choices) or a runtime If (`node`)."""

    graph: Graph | None = None
    node: Node | None = None
    nodes: list[Node] = field(default_factory=list)             # a segment's, in order
    programs: dict[tuple, Any] = field(default_factory=dict)   # for a segment
    branches: dict[str, Graph] = field(default_factory=dict)   # for an If: attr -> graph


@dataclass
class ControlSpec:
    """A specialisation with runtime choices: the steps of its host program."""

    graph: Graph
    steps: list[Step]
    values: dict[str, np.ndarray] = field(default_factory=dict)
    kernels: list = field(default_factory=list)      # (its programs hold the kernels)


def runtime_choices(base: Graph, shapes: dict[str, tuple[int, ...]], options: CompileOptions,
                    values: dict[str, np.ndarray] | None = None) -> ControlSpec | None:
    """The host program of `base` at these shapes, or None when every choice folds (then
    `specialize` compiles it as one program)."""
    if not has_subgraphs(base):
        return None
    g = base.copy()
    bind_input_shapes(g, shapes)
    for name, value in (values or {}).items():
        g.inputs.remove(name)
        g.set_constant(name, np.asarray(value))
    ctx = PassContext(fusion=options.fusion,
                      pass_options={"inline_branches": {"runtime_choice": True}})
    PassManager(["inline_branches"], ctx).run(g)
    if not has_subgraphs(g):
        return None
    return ControlSpec(g, _steps(g), dict(values or {}))


def _steps(g: Graph) -> list[Step]:
    steps: list[Step] = []
    current: list[Node] = []
    for n in g.nodes():
        op = lookup(n.op_type, n.domain)
        if op is not None and op.control is not None:
            if n.opset < op.min_opset:
                raise UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset,
                                           f"opset {n.opset} is older than supported "
                                           f"({op.min_opset})")])
            if current:
                steps.append(Step(nodes=current))
            current = []
            steps.append(Step(node=n, branches={a: _branch_graph(n.attrs[a], g)
                                                 for a in op.subgraphs}))
        else:
            current.append(n)
    if current:
        steps.append(Step(nodes=current))
    # a segment's outputs: what later steps or the graph's outputs read
    for i, st in enumerate(steps):
        if st.node is not None:
            continue
        later: set[str] = set(g.outputs)
        for s2 in steps[i + 1:]:
            nodes = [s2.node] if s2.node is not None else s2.nodes
            later.update(v for m in nodes for v in m.inputs if v)
        st.graph = _segment_graph(g, st.nodes, later)
    return steps


def _segment_graph(g: Graph, nodes: list[Node], later: set[str]) -> Graph:
    seg = Graph(f"{g.name}.segment")
    seg.opsets = dict(g.opsets)
    defined = {o for n in nodes for o in n.outputs if o}
    for n in nodes:
        for v in n.inputs:
            if not v or v in defined or v in seg.values:
                continue
            if v in g.constants:
                seg.set_constant(v, g.constants[v])
            else:
                # (typed from the run's arrays when compiled)
                seg.values[v] = g.values.get(v, TensorType(np.dtype("float32"), ()))
                seg.inputs.append(v)
        for o in n.outputs:
            if o:
                seg.values[o] = g.values.get(o, TensorType(np.dtype("float32"), ()))
        seg.add_node(n)
    seg.outputs = [o for n in nodes for o in n.outputs if o and o in later]
    return seg


def _branch_graph(sub: Graph, outer: Graph) -> Graph:
    """A branch with the outer values it reads as its inputs (outer constants stay
    constants)."""
    b = sub.copy()
    for c in sub.meta.get("captures", []):
        if c in outer.constants:
            b.set_constant(c, outer.constants[c])
        else:
            b.values[c] = outer.values.get(c) or sub.values.get(c) or TensorType(
                np.dtype("float32"), ())       # (typed from the run's arrays when compiled)
            b.inputs.append(c)
    return b


class ControlProgram:
    """Runs a ControlSpec: segments and branches as compiled programs, chosen per run."""

    def __init__(self, spec: ControlSpec, options: CompileOptions, device: Device,
                 pool: WeightPool) -> None:
        self.spec = spec
        self.options, self.device, self.pool = options, device, pool
        self.input_names = list(spec.graph.inputs)
        self._lock = threading.Lock()
        self._vin: dict[int, tuple[str, ...]] = {}   # per segment/subgraph (they live on)

    def execute(self, feeds: dict[str, np.ndarray], times: Any = None) -> list[np.ndarray]:
        g = self.spec.graph
        env: dict[str, np.ndarray] = dict(g.constants)
        env.update(feeds)
        for st in self.spec.steps:
            if st.graph is not None:
                outs = self._run(st.graph, st.programs, env)
                env.update(zip(st.graph.outputs, outs))
                continue
            n = st.node
            op = lookup(n.op_type, n.domain)
            ins = list(own_inputs(n))
            run = {Control.BRANCH: self._branch, Control.LOOP: self._loop,
                   Control.SCAN: self._scan}[op.control]
            outs = run(n, op, st, ins, env)
            env.update((o, v) for o, v in zip(n.outputs, outs) if o)
        return [np.array(env[o], copy=True) for o in g.outputs]

    # -- the control-flow steps (by the op's `control`) ----------------------------------
    def _branch(self, n: Node, op: Any, st: Step, ins: list[str],
                env: dict[str, np.ndarray]) -> list[np.ndarray]:
        attr = op.branch(n, [env.get(v) if v else None for v in ins])
        if attr is None:
            raise ShapeError(f"{n.op_type} at node '{n.name}': its condition {ins[0]!r} "
                             "must have a single element")
        return self._run(st.branches[attr], st.programs.setdefault(attr, {}), env)

    def _loop(self, n: Node, op: Any, st: Step, ins: list[str],
              env: dict[str, np.ndarray]) -> list[np.ndarray]:
        """ONNX Loop: M (trip count) and cond optional; body(i, cond, carried..., captures)
        -> (cond, carried..., scan outputs...)."""
        body, cache = st.branches["body"], st.programs.setdefault("body", {})
        trip = int(env[ins[0]].reshape(-1)[0]) if ins and ins[0] else None
        use_cond = len(ins) > 1 and bool(ins[1])
        cond = bool(env[ins[1]].reshape(-1)[0]) if use_cond else True
        carried = [env[v] for v in ins[2:]]
        formal = body.inputs[:2 + len(carried)]
        k = len(body.outputs) - 1 - len(carried)
        scans: list[list[np.ndarray]] = [[] for _ in range(k)]
        i = 0
        while (trip is None or i < trip) and cond:
            local = dict(env)
            local.update(zip(formal, [np.array(i, np.int64), np.array(cond)] + carried))
            outs = self._run(body, cache, local)
            # (the body's condition ends the loop also without a cond input: what
            # onnxruntime and the ONNX reference do)
            cond = bool(np.asarray(outs[0]).reshape(-1)[0])
            carried = outs[1:1 + len(carried)]
            for j in range(k):
                scans[j].append(outs[1 + len(carried) + j])
            i += 1
        return carried + [self._stack(s, 0, n.outputs[len(carried) + j])
                          for j, s in enumerate(scans)]

    def _scan(self, n: Node, op: Any, st: Step, ins: list[str],
              env: dict[str, np.ndarray]) -> list[np.ndarray]:
        """ONNX Scan (opset 9+): body(states..., one slice of each scan input...)
        -> (states..., one slice of each scan output...). Scan-8: inputs
        (sequence_lens?, states..., scan inputs...) all with a leading batch axis; each
        batch entry b is scanned on its own along axis 1 for sequence_lens[b] steps (all
        when absent), its scan outputs zero beyond them, as onnxruntime."""
        if n.opset >= 9:
            return self._scan_one(n, st, ins, [env[v] for v in ins], None, env)
        seq, ins = ins[0], ins[1:]
        vals = [env[v] for v in ins]
        batch = {int(v.shape[0]) if v.ndim else -1 for v in vals}
        if len(batch) != 1 or -1 in batch:
            raise ShapeError(f"Scan at node '{n.name}': its inputs must share the leading "
                             f"batch axis (sizes {sorted(batch)})")
        B = batch.pop()
        lens = None
        if seq:
            lens = np.asarray(env[seq]).reshape(-1).astype(np.int64)
            if lens.shape != (B,):
                raise ShapeError(f"Scan at node '{n.name}': sequence_lens {seq!r} has "
                                 f"{lens.size} entries for a batch of {B}")
        per = [self._scan_one(n, st, ins, [v[b] for v in vals],
                              None if lens is None else int(lens[b]), env) for b in range(B)]
        outs = []
        for j, o in enumerate(n.outputs):
            parts = [p[j] for p in per]
            if parts:
                outs.append(_contiguous(np.stack(parts, axis=0)))
            else:
                t = self.spec.graph.values.get(o)
                outs.append(np.zeros(tuple(d if isinstance(d, int) else 0 for d in t.shape)
                                     if t is not None else (0,),
                                     t.dtype if t is not None else np.float32))
        return outs

    def _scan_one(self, n: Node, st: Step, ins: list[str], vals: list[np.ndarray],
                  seq_len: int | None, env: dict[str, np.ndarray]) -> list[np.ndarray]:
        """One scan: states and scan inputs `vals` (for the names `ins`); `seq_len` steps
        of the scan inputs' length (None: all), the scan outputs zero-padded to it."""
        body, cache = st.branches["body"], st.programs.setdefault("body", {})
        ns, in_axes, in_dirs, out_axes, out_dirs = scan_layout(n, len(ins))
        states = vals[:ns]
        xs = vals[ns:]
        axes = [a + x.ndim if a < 0 else a for a, x in zip(in_axes, xs)]
        steps = {x.shape[a] for x, a in zip(xs, axes)}
        if len(steps) != 1:
            raise ShapeError(f"Scan at node '{n.name}': its scan inputs have different "
                             f"lengths {sorted(steps)} along their scan axes")
        full = steps.pop()
        length = full
        if seq_len is not None:
            if not 0 <= seq_len <= full:
                raise ShapeError(f"Scan at node '{n.name}': a sequence length of {seq_len} "
                                 f"for scan inputs of length {full}")
            length = seq_len
        formal = body.inputs[:len(ins)]
        ys: list[list[np.ndarray]] = [[] for _ in range(len(n.outputs) - ns)]
        for t in range(length):
            slices = [np.take(x, length - 1 - t if d else t, axis=a)
                      for x, a, d in zip(xs, axes, in_dirs)]
            local = dict(env)
            local.update(zip(formal, states + slices))
            outs = self._run(body, cache, local)
            states = outs[:ns]
            for j, y in enumerate(outs[ns:]):
                ys[j].append(y)
        out = list(states)
        for j, y in enumerate(ys):
            if out_dirs[j]:
                y = y[::-1]
            rank = y[0].ndim + 1 if y else 1
            ax = out_axes[j] + rank if out_axes[j] < 0 else out_axes[j]
            if length < full and n.opset < 9:
                if y:
                    y = y + [np.zeros_like(y[0])] * (full - length)
                else:
                    raise ShapeError(f"Scan at node '{n.name}': a sequence length of 0 "
                                     "(the scan outputs' element shape is unknown)")
            out.append(self._stack(y, ax, n.outputs[ns + j]))
        return out

    def _stack(self, parts: list[np.ndarray], axis: int, name: str) -> np.ndarray:
        """Scan outputs of every iteration along a new axis (data movement on the host);
        no iteration: an empty tensor of the output's declared type."""
        if parts:
            return _contiguous(np.stack(parts, axis=axis))
        t = self.spec.graph.values.get(name)
        dtype = t.dtype if t is not None else np.float32
        rest = tuple(d if isinstance(d, int) else 0 for d in (t.shape[1:] if t else ()))
        return np.zeros((0,) + rest, dtype)

    def _run(self, graph: Graph, cache: dict[tuple, Any], env: dict[str, np.ndarray]
             ) -> list[np.ndarray]:
        """The outputs of `graph` (a segment or branch) on the values in `env`."""
        feeds = {v: _contiguous(env[v]) for v in graph.inputs}
        produced = [o for o in graph.outputs if o not in graph.constants and o not in feeds]
        if not produced:
            return [graph.constants[o] if o in graph.constants else feeds[o]
                    for o in graph.outputs]
        vin = self._vin.get(id(graph))
        if vin is None:
            vin = self._vin[id(graph)] = value_deciding_inputs(graph)
        key = tuple((v, dtype_key(feeds[v].dtype), feeds[v].shape) for v in graph.inputs) + tuple(
            feeds[v].tobytes() for v in vin)
        with self._lock:
            prog = cache.get(key)
            if prog is None:
                prog = self._compile(graph, feeds, vin, produced)
                if len(cache) >= MAX_SUB_PROGRAMS:
                    cache.pop(next(iter(cache)))
                cache[key] = prog
        got = dict(zip(produced, prog.execute(
            {v: a for v, a in feeds.items() if v in prog.input_names})))
        return [got[o] if o in got else graph.constants[o] if o in graph.constants
                else feeds[o] for o in graph.outputs]

    def _compile(self, graph: Graph, feeds: dict[str, np.ndarray], vin: Sequence[str],
                 produced: list[str]) -> Any:
        g = graph.copy()
        for v, a in feeds.items():
            g.values[v] = TensorType(a.dtype, tuple(a.shape))
        g.outputs = produced
        shapes = {v: tuple(a.shape) for v, a in feeds.items()}
        return compile_program(g, shapes, self.options, self.device, self.pool,
                               {v: feeds[v] for v in vin})

    @property
    def kernels(self) -> list:
        return []


def _contiguous(a: np.ndarray) -> np.ndarray:
    """C-contiguous, 0-d kept 0-d (np.ascontiguousarray makes it 1-d)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else a.copy(order="C")


def compile_program(graph: Graph, shapes: dict[str, tuple[int, ...]], options: CompileOptions,
                    device: Device, pool: WeightPool,
                    values: dict[str, np.ndarray] | None = None) -> Program | ControlProgram:
    """`graph` compiled for these input shapes (and values of value-deciding inputs): one
    program, or a host program over compiled ones when a runtime value picks a branch."""
    cspec = runtime_choices(graph, shapes, options, values)
    if cspec is not None:
        return ControlProgram(cspec, options, device, pool)
    def upload(g: Graph, kernels: list, constants: dict[str, np.ndarray],
               memory: MemoryPlan) -> None:
        # the weights the kernels read, copied to the device while LLVM compiles (the
        # program finds them in the pool): a cold BERT-base compile spent 0.3 s copying
        # its embeddings after LLVM was done. The budget is checked first.
        _check_budget(g, kernels, constants, memory.arena_bytes, device.cores)
        for c in dict.fromkeys(v for k in kernels for v in k.inputs if v in constants):
            pool.upload(constants[c])

    spec = specialize(graph, shapes, options, values=values, while_llvm=upload)
    return Program(spec, device, dispatcher_object(), pool=pool)


def check_memory_budget(spec: Specialization, cores: int) -> None:
    """Before a program allocates anything: its arena, weights and per-core workspace
    against the device memory budget (config.check_budget)."""
    _check_budget(spec.graph, spec.kernels, spec.constants, spec.memory.arena_bytes, cores)


def _check_budget(g: Graph, kernels: list, constants: dict[str, np.ndarray],
                  arena_bytes: int, cores: int) -> None:
    weights = sum(int(c.nbytes) for c in constants.values())
    ws = max((int(k.workspace_bytes) for k in kernels), default=0) * cores
    shapes = ", ".join(f"{n}{list(g.values[n].shape)}" for n in g.inputs)
    check_budget(f"the specialisation for {shapes or 'its inputs'} (arena "
                 f"{fmt_bytes(arena_bytes)}, weights {fmt_bytes(weights)}, "
                 f"workspace {fmt_bytes(ws)})", arena_bytes + weights + ws)
