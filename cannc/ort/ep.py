"""The control plane of cannc's ONNX Runtime execution provider (ORT_EP_NOTES.md).

ORT loads the shim library (cannc/ort/_shim.c); its CreateEpFactories calls into this
module through ctypes. Everything here runs once per session, never per run:

- the factory offers one CPU device (`CanncExecutionProvider`) and creates an EP per session
  from its options (`ep.canncexecutionprovider.<name>` session config entries; an unknown
  name or value fails session creation with a message naming it);
- GetCapability mirrors ORT's graph into an onnx model (graph.py), partitions it with cannc's
  support report (partition.py: allow / deny lists, convex groups) and *compiles each group
  right there*: a group that fails to compile stays with ORT's CPU provider and the reason is
  logged (a failure in GetCapability only falls back; a failure in Compile would fail the
  session). EPContext nodes that cannc wrote earlier are claimed and loaded, not compiled;
- Compile looks the compiled groups up and returns one OrtNodeComputeInfo each, whose
  Compute is the shim's native `cannc_compute`: it copies the inputs into a cannc execution
  context, runs the dispatcher on the native AI cores and copies the outputs out, with no
  Python and no GIL. A new input shape enters Python once (specialise: planning, lowering
  through the kernel memo and the object cache), then runs natively like the others.

Every callback catches every exception and returns it as an OrtStatus (ctypes would
otherwise swallow it and return 0, which ORT reads as success).
"""

from __future__ import annotations

import ctypes
import io
import logging
import threading
import traceback
from collections.abc import Callable
from ctypes import POINTER, addressof, byref, c_char_p, c_int64, c_size_t, c_void_p
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from .._version import __version__
from ..errors import CanncError
from ..ir.ops import all_ops, lookup
from ..ir.registry import Amp, amp_class
from ..passes.precision import PRECISIONS
from ..runtime.profiler import machine_peaks
from ..runtime.program import Program
from ..schedule.machine import usable_cores
from ..session import Session, load
from . import _abi, _native
from ._abi import (
    ORT_FAIL,
    ORT_INVALID_ARGUMENT,
    ORT_VERSION,
    FunctionTable,
    OrtApiSlots,
    OrtCallError,
    OrtEpApiSlots,
    strings,
)
from .graph import Mirror, io_names, mirror_graph, node_names
from .partition import Group, group_model, partition

EP_NAME = "CanncExecutionProvider"
VENDOR = "cannc"
OPTION_PREFIX = f"ep.{EP_NAME.lower()}."
EPCONTEXT = ("EPContext", "com.microsoft")

# name -> what it takes (the message of an unknown name lists them)
OPTIONS = {
    "op_type_allow_list": "comma-separated op types: only these run on cannc",
    "op_type_deny_list": "comma-separated op types: these never run on cannc",
    "precision_mode": f"one of {', '.join(PRECISIONS)} (the mixed-precision pass)",
    "op_select_impl_mode": "high_performance (default) or high_precision",
    "cores": "native AI cores per run (default: the usable CPU cores)",
    "enable_profiling": "0 or 1: cannc's per-kernel profile of each group",
    "strict": "0 or 1: a group that fails to compile fails the session",
    "min_group_size": "groups of fewer nodes stay with ORT (default 1)",
    "device_id": "0 (the CPU)",
}
IMPL_MODES = ("high_performance", "high_precision")

log = logging.getLogger("cannc.ort")


@dataclass(frozen=True)
class EpOptions:
    allow: frozenset[str] | None = None
    deny: frozenset[str] = frozenset()
    precision: str = "fp32"
    impl_mode: str = "high_performance"
    cores: int = 0
    profiling: bool = False
    strict: bool = False
    min_group_size: int = 1

    @classmethod
    def parse(cls, entries: dict[str, str]) -> EpOptions:
        """Options from their string values (as ORT passes them); an unknown name or a bad
        value raises CanncError naming it."""
        unknown = sorted(set(entries) - set(OPTIONS))
        if unknown:
            raise CanncError(
                f"unknown {EP_NAME} option(s) {', '.join(map(repr, unknown))}; the options are: "
                + "; ".join(f"{k} ({v})" for k, v in OPTIONS.items()))
        kw: dict[str, Any] = {}
        for key in ("op_type_allow_list", "op_type_deny_list"):
            if key in entries:
                ops = frozenset(o.strip() for o in entries[key].split(",") if o.strip())
                bad = sorted(o for o in ops if _op_def(o) is None)
                if bad:
                    raise CanncError(f"{EP_NAME} option {key}: unknown op type(s) "
                                     f"{', '.join(map(repr, bad))} (`cannc ops` lists them)")
                kw["allow" if key == "op_type_allow_list" else "deny"] = ops
        for key, attr, choices in (("precision_mode", "precision", PRECISIONS),
                                   ("op_select_impl_mode", "impl_mode", IMPL_MODES)):
            if key in entries:
                v = entries[key].strip().lower()
                if v not in choices:
                    raise CanncError(f"{EP_NAME} option {key}: unknown value {entries[key]!r}; "
                                     f"choose one of {', '.join(choices)}")
                kw[attr] = v
        for key, attr, lo in (("cores", "cores", 1), ("min_group_size", "min_group_size", 1)):
            if key in entries:
                v = entries[key].strip()
                if not v.isdigit() or int(v) < lo or int(v) > 4096:
                    raise CanncError(f"{EP_NAME} option {key}: expected a positive integer, "
                                     f"got {entries[key]!r}")
                kw[attr] = int(v)
        for key, attr in (("enable_profiling", "profiling"), ("strict", "strict")):
            if key in entries:
                kw[attr] = _flag(key, entries[key])
        if "device_id" in entries and entries["device_id"].strip() != "0":
            raise CanncError(f"{EP_NAME} option device_id: cannc runs on the CPU, device 0; "
                             f"got {entries['device_id']!r}")
        return cls(**kw)

    def session_kwargs(self, model: onnx.ModelProto) -> dict[str, Any]:
        """cannc.compile() options for one group."""
        kw: dict[str, Any] = {"cores": self.cores or usable_cores(), "precision": self.precision}
        if self.precision != "fp32" and self.impl_mode == "high_precision":
            # only contractions narrow; every op that would follow them stays float32
            present = {(n.op_type, n.domain) for n in model.graph.node}
            deny = sorted(op.name for op in all_ops()
                          if (op.name, op.domain) in present and not op.domain
                          and amp_class(op) == Amp.FOLLOW)
            if deny:
                kw["precision_lists"] = {"deny": deny}
        return kw


def _op_def(name: str) -> Any:
    domain, _, op = name.rpartition("::")
    return lookup(op, domain) or (lookup(op, "com.microsoft") if not domain else None)


def _flag(key: str, v: str) -> bool:
    s = v.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise CanncError(f"{EP_NAME} option {key}: expected 0 or 1, got {v!r}")


@dataclass(frozen=True)
class ContextOptions:
    """ORT's EPContext settings (session config: ep.context_enable & co.)."""

    enable: bool = False
    path: str = ""
    embed: bool = True


# -- keep-alive -----------------------------------------------------------------------------
class _Text:
    """A NUL-terminated string at a fixed address (for const char* returns)."""

    def __init__(self, s: str) -> None:
        self.buf = ctypes.create_string_buffer(s.encode())
        self.address = addressof(self.buf)


def _guarded(api_of: Callable[[], FunctionTable | None], what: str,
             default: Any = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a callback: an exception becomes an OrtStatus error (status returns) or is logged
    (void returns); it never reaches ctypes."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            try:
                return fn(*args)
            except BaseException as e:
                msg = f"{EP_NAME} {what}: {e}" if isinstance(e, CanncError) else (
                    f"{EP_NAME} {what}: internal error: {type(e).__name__}: {e}")
                log.error("%s\n%s", msg, traceback.format_exc())
                api = api_of()
                if default == "status":
                    if api is None:
                        return None
                    code = ORT_INVALID_ARGUMENT if isinstance(e, CanncError) else ORT_FAIL
                    return api.make_status(code, msg)
                return default
        return wrapper
    return deco


# -- the factory ----------------------------------------------------------------------------
class Factory:
    """The OrtEpFactory ORT got from CreateEpFactories."""

    def __init__(self, api: FunctionTable, registered_name: str) -> None:
        self.api = api
        self.ep_api = FunctionTable(api.GetEpApi(), OrtEpApiSlots, api=api)
        self.registered_name = registered_name
        self._texts = {k: _Text(v) for k, v in
                       (("name", EP_NAME), ("vendor", VENDOR), ("version", __version__))}
        self.providers: dict[int, Provider] = {}
        g = lambda what, d="status": _guarded(lambda: self.api, what, d)
        self._cbs = [
            _abi.F_GetName(g("GetName", None)(lambda this: self._texts["name"].address)),
            _abi.F_GetVendor(g("GetVendor", None)(lambda this: self._texts["vendor"].address)),
            _abi.F_GetSupportedDevices(g("GetSupportedDevices")(self._supported_devices)),
            _abi.F_CreateEp(g("CreateEp")(self._create_ep)),
            _abi.F_ReleaseEp(g("ReleaseEp", None)(self._release_ep)),
            _abi.F_GetVendorId(g("GetVendorId", 0)(lambda this: 0)),
            _abi.F_GetVersion(g("GetVersion", None)(lambda this: self._texts["version"].address)),
            _abi.F_ValidateCompat(g("ValidateCompiledModelCompatibilityInfo")(self._compat)),
            _abi.F_CreateAllocator(g("CreateAllocator")(self._null_out(3))),
            _abi.F_ReleaseAllocator(g("ReleaseAllocator", None)(lambda this, a: None)),
            _abi.F_CreateDataTransfer(g("CreateDataTransfer")(self._null_out(1))),
            _abi.F_IsStreamAware(g("IsStreamAware", False)(lambda this: False)),
            _abi.F_CreateSyncStream(g("CreateSyncStreamForDevice")(self._null_out(3))),
        ]
        self.struct = _abi.OrtEpFactory(ORT_VERSION, *self._cbs)

    @property
    def address(self) -> int:
        return addressof(self.struct)

    @staticmethod
    def _null_out(i: int) -> Callable[..., None]:
        def fn(*args: Any) -> None:
            args[i][0] = None
        return fn

    def _supported_devices(self, this: int, devices: Any, n: int, out: Any, max_out: int,
                           num: Any) -> None:
        k = 0
        for i in range(n):
            if k >= max_out:
                break
            if self.api.HardwareDevice_Type(devices[i]) != _abi.DEVICE_CPU:
                continue
            dev = c_void_p()
            self.ep_api.CreateEpDevice(this, devices[i], None, None, byref(dev))
            out[k] = dev.value
            k += 1
            break                    # one device: the CPU
        num[0] = k

    def _compat(self, this: int, devices: Any, n: int, info: bytes, out: Any) -> None:
        out[0] = 0                   # EP_NOT_APPLICABLE: cannc's artifacts carry their own checks

    def _create_ep(self, this: int, devices: Any, metadata: Any, n: int, session_options: int,
                   logger: int, ep_out: Any) -> None:
        entries = config_entries(self.api, session_options)
        opts = EpOptions.parse({k[len(OPTION_PREFIX):]: v for k, v in entries.items()
                                if k.startswith(OPTION_PREFIX)})
        ctx = ContextOptions(
            enable=entries.get("ep.context_enable", "0").strip() == "1",
            path=entries.get("ep.context_file_path", ""),
            embed=entries.get("ep.context_embed_mode", "1").strip() != "0")
        p = Provider(self, opts, ctx, logger)
        self.providers[p.address] = p
        ep_out[0] = p.address

    def _release_ep(self, this: int, ep: int) -> None:
        p = self.providers.pop(ep or 0, None)
        if p is not None:
            p.close()


def config_entries(api: FunctionTable, session_options: int) -> dict[str, str]:
    """Every session config entry (key -> value)."""
    kvps = c_void_p()
    api.GetSessionOptionsConfigEntries(session_options, byref(kvps))
    try:
        keys = POINTER(c_char_p)()
        vals = POINTER(c_char_p)()
        n = c_size_t(0)
        api.GetKeyValuePairs(kvps, byref(keys), byref(vals), byref(n))
        return {(keys[i] or b"").decode(): (vals[i] or b"").decode() for i in range(n.value)}
    finally:
        api.ReleaseKeyValuePairs(kvps)


# -- one group ------------------------------------------------------------------------------
@dataclass
class CompiledGroup:
    """A claimed group: its cannc session (compiled in GetCapability), or why it failed."""

    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    op_types: tuple[str, ...]
    session: Session | None = None
    error: str | None = None
    from_context: bool = False


@dataclass
class NodeCompute:
    """One fused node's compute: the OrtNodeComputeInfo, its native node, the programs."""

    group: CompiledGroup
    name: str
    inputs: list[str]             # in the fused node's order
    outputs: list[str]
    info: _abi.OrtNodeComputeInfo | None = None
    native: _native.NativeNode | None = None   # the shim's node (CreateState .. ReleaseState)
    records: list[_native.ProgramRecord] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Provider:
    """One OrtEp (per session)."""

    def __init__(self, factory: Factory, options: EpOptions, context: ContextOptions,
                 logger: int) -> None:
        self.factory = factory
        self.api = factory.api
        self.options = options
        self.context = context
        self.logger = logger
        self.groups: dict[frozenset[str], CompiledGroup] = {}
        self.computes: dict[int, NodeCompute] = {}
        self.model_path = ""
        self.messages: list[str] = []
        self._name = _Text(EP_NAME)
        g = lambda what, d="status": _guarded(lambda: self.api, what, d)
        self._cbs = [
            _abi.E_GetName(g("GetName", None)(lambda this: self._name.address)),
            _abi.E_GetCapability(g("GetCapability")(self._get_capability)),
            _abi.E_Compile(g("Compile")(self._compile)),
            _abi.E_ReleaseNodeComputeInfos(g("ReleaseNodeComputeInfos", None)(self._release_infos)),
        ]
        self._create_state = _abi.N_CreateState(g("CreateState")(self._create_state_cb))
        self._release_state = _abi.N_ReleaseState(g("ReleaseState", None)(self._release_state_cb))
        self.struct = _abi.OrtEp(ORT_VERSION, *self._cbs)
        self.fusion_options = _abi.OrtNodeFusionOptions(ORT_VERSION, True)

    @property
    def address(self) -> int:
        return addressof(self.struct)

    def close(self) -> None:
        self.groups.clear()

    # -- logging ----------------------------------------------------------------------------
    def say(self, level: int, msg: str) -> None:
        self.messages.append(msg)
        log.log({_abi.LOG_WARNING: logging.WARNING, _abi.LOG_ERROR: logging.ERROR,
                 _abi.LOG_INFO: logging.INFO}.get(level, logging.DEBUG), "%s", msg)
        if self.logger:
            try:
                self.api.Logger_LogMessage(self.logger, level, f"[{EP_NAME}] {msg}".encode(),
                                           b"cannc/ort/ep.py", 0, b"cannc")
            except Exception:
                pass

    # -- GetCapability ----------------------------------------------------------------------
    def _get_capability(self, this: int, graph: int, info: int) -> None:
        mirror = mirror_graph(self.api, graph)
        self.model_path = _model_path(self.api, graph)
        model = mirror.model
        total = len(model.graph.node)
        claimed = groups = 0
        ctx_nodes = [n for n in model.graph.node if (n.op_type, n.domain) == EPCONTEXT]
        for n in ctx_nodes:
            if _attr_str(n, "source") not in (EP_NAME, ""):
                continue
            group = self._load_context(n)
            self._claim(info, mirror, group.nodes)
            claimed += 1
            groups += 1
        if ctx_nodes:
            keep = [n for n in model.graph.node if (n.op_type, n.domain) != EPCONTEXT]
            del model.graph.node[:]
            model.graph.node.extend(keep)
            if not keep:
                return
        part = partition(model, allow=self.options.allow, deny=self.options.deny,
                         min_group_size=self.options.min_group_size)
        for g in part.groups:
            # one group holding every node: the mirror itself becomes its model (no copy)
            cg = self._compile_group(model, g, inplace=len(part.groups) == 1)
            if cg.error is not None and not self.options.strict:
                continue
            self._claim(info, mirror, g.nodes)
            claimed += len(g.nodes)
            groups += 1
        why: dict[str, list[str]] = {}
        for name, reason in part.rejected.items():
            why.setdefault(mirror.opaque.get(name, reason), []).append(name)
        summary = f"claimed {claimed} of {total} nodes in {groups} group(s)"
        if why:
            summary += "; left to ORT: " + "; ".join(
                f"{len(v)} node(s) ({', '.join(v[:3])}{', ...' if len(v) > 3 else ''}): {k}"
                for k, v in why.items())
        self.say(_abi.LOG_INFO, summary)

    def _claim(self, info: int, mirror: Mirror, nodes: tuple[str, ...]) -> None:
        arr = (c_void_p * len(nodes))(*[mirror.nodes[n] for n in nodes])
        self.factory.ep_api.EpGraphSupportInfo_AddNodesToFuse(
            info, arr, len(nodes), byref(self.fusion_options))

    def _compile_group(self, model: onnx.ModelProto, g: Group,
                       inplace: bool = False) -> CompiledGroup:
        key = frozenset(g.nodes)
        cg = self.groups.get(key)
        if cg is not None:
            return cg
        by_name = {n.name: n for n in model.graph.node}
        cg = CompiledGroup(g.nodes, g.inputs, g.outputs,
                           tuple(dict.fromkeys(by_name[n].op_type for n in g.nodes)))
        try:
            sub = group_model(model, g, inplace=inplace)
            sess = Session(sub, **self.options.session_kwargs(sub))
            for prog in sess._programs.values():
                if not isinstance(prog, Program):
                    raise CanncError("the group needs host control flow (If/Loop)")
            cg.session = sess
        except CanncError as e:
            cg.error = f"{type(e).__name__}: {e}"
        except Exception as e:
            cg.error = f"internal error: {type(e).__name__}: {e}"
        if cg.error is not None:
            self.say(_abi.LOG_WARNING,
                     f"a group of {len(g.nodes)} node(s) ({', '.join(cg.op_types)}; first "
                     f"'{g.nodes[0]}') does not compile and "
                     + ("fails the session (strict=1)" if self.options.strict
                        else "runs on ORT's CPU provider") + f": {cg.error}")
        self.groups[key] = cg
        return cg

    def _load_context(self, n: onnx.NodeProto) -> CompiledGroup:
        """A compiled group that an earlier session saved (an EPContext node)."""
        key = frozenset([n.name])
        cg = self.groups.get(key)
        if cg is not None:
            return cg
        cg = CompiledGroup((n.name,), tuple(i for i in n.input if i), tuple(n.output),
                           ("EPContext",), from_context=True)
        data = _attr_bytes(n, "ep_cache_context")
        embed = _attr_int(n, "embed_mode", 1)
        try:
            if embed:
                src: Any = io.BytesIO(data or b"")
            else:
                path = Path((data or b"").decode())
                if not path.is_absolute():
                    path = Path(self.model_path).parent / path
                src = path
            sess = load(src, cores=self.options.cores or None)
            cg.session = sess
        except Exception as e:
            cg.error = f"EPContext node '{n.name}': {type(e).__name__}: {e}"
            self.say(_abi.LOG_ERROR, cg.error)
        self.groups[key] = cg
        return cg

    # -- Compile ----------------------------------------------------------------------------
    def _compile(self, this: int, graphs: Any, fused: Any, count: int, infos: Any,
                 ctx_nodes: Any) -> None:
        made: list[NodeCompute] = []
        for i in range(count):
            names = frozenset(node_names(self.api, graphs[i]))
            cg = self.groups.get(names)
            if cg is None:
                raise CanncError(f"ORT asked to compile nodes it was not offered: "
                                 f"{sorted(names)[:5]}")
            if cg.error is not None:
                raise CanncError(cg.error)
            ins, outs = io_names(self.api, fused[i])
            fname = _cstr(self.api, "Node_GetName", fused[i])
            nc = NodeCompute(cg, fname, ins, outs)
            nc.info = _abi.OrtNodeComputeInfo(
                ORT_VERSION, self._create_state, _native.compute_address(), self._release_state)
            made.append(nc)
        for i, nc in enumerate(made):
            assert nc.info is not None
            self.computes[addressof(nc.info)] = nc
            infos[i] = addressof(nc.info)
        if self.context.enable and ctx_nodes:
            for i, nc in enumerate(made):
                ctx_nodes[i] = self._context_node(nc)

    def _context_node(self, nc: NodeCompute) -> int:
        """An EPContext node holding the group's compiled artifact (ORT owns the node)."""
        sess = nc.group.session
        assert sess is not None
        buf = io.BytesIO()
        sess.save(buf)
        data = buf.getvalue()
        embed = self.context.embed
        if not embed:
            base = Path(self.context.path or self.model_path or "model.onnx")
            fname = f"{base.stem}_{_safe(nc.name)}.cnc"
            (base.parent / fname).write_bytes(data)
            data = fname.encode()
        ed = _editor(self.api)
        attrs = [_op_attr(self.api, "embed_mode", _abi.ATTR_INT, 1 if embed else 0),
                 _op_attr(self.api, "main_context", _abi.ATTR_INT, 1),
                 _op_attr(self.api, "ep_cache_context", _abi.ATTR_STRING, data),
                 _op_attr(self.api, "source", _abi.ATTR_STRING, EP_NAME.encode()),
                 _op_attr(self.api, "ep_sdk_version", _abi.ATTR_STRING, __version__.encode())]
        arr = (c_void_p * len(attrs))(*attrs)
        ins, keep_i = strings([v for v in nc.inputs])
        outs, keep_o = strings(nc.outputs)
        node = c_void_p()
        try:
            ed.CreateNode(b"EPContext", b"com.microsoft", nc.name.encode(), ins, len(nc.inputs),
                          outs, len(nc.outputs), arr, len(attrs), byref(node))
        except BaseException:
            for a in attrs:
                self.api.ReleaseOpAttr(a)
            raise
        # the node owns the attributes now: releasing them too aborts in ORT 1.32 (a double
        # free, whatever the header's "OrtOpAttr instances are copied" says)
        del keep_i, keep_o
        return node.value or 0

    def _release_infos(self, this: int, infos: Any, n: int) -> None:
        """ORT is done with these OrtNodeComputeInfos (their states are released first):
        only now may their structures go."""
        for i in range(n):
            nc = self.computes.pop(infos[i] or 0, None)
            if nc is not None and nc.native is not None:    # a state ORT never released
                self._free_native(nc)

    # -- compute state (once per fused node, Python) ----------------------------------------
    def _create_state_cb(self, this: int, compute_context: int, state: Any) -> None:
        nc = self.computes[this]
        sess = nc.group.session
        assert sess is not None
        gin, gout = sess.graph.inputs, sess.graph.outputs
        missing = [v for v in nc.inputs if v not in gin]
        if missing or [v for v in nc.outputs if v not in gout]:
            raise CanncError(f"fused node '{nc.name}' has inputs {nc.inputs} and outputs "
                             f"{nc.outputs}; its cannc program reads {gin} and makes {gout}")
        ranks_in = [len(sess.graph.values[v].shape) for v in nc.inputs]
        ranks_out = [len(sess.graph.values[v].shape) for v in nc.outputs]

        def specialize(shapes: tuple[tuple[int, ...], ...]) -> _native.ProgramRecord:
            with nc.lock:
                prog = sess.specialize(dict(zip(nc.inputs, shapes)))
                if not isinstance(prog, Program):
                    raise CanncError(f"input shapes {list(shapes)} need host control flow")
                return self._record(nc, prog)

        node = _native.NativeNode(self.api.address, ranks_in, ranks_out, cores=sess.cores,
                                  specialize=specialize, name=nc.name, input_names=nc.inputs)
        nc.native = node
        for prog in list(sess._programs.values()):
            if isinstance(prog, Program):
                node.add_program(self._record(nc, prog))
        state[0] = node.compute_state

    def _record(self, nc: NodeCompute, prog: Program) -> _native.ProgramRecord:
        rec = _native.program_record(prog, prog.acquire(), profile=self.options.profiling,
                                     inputs=nc.inputs, outputs=nc.outputs)
        nc.records.append(rec)
        return rec

    def _release_state_cb(self, this: int, state: int) -> None:
        nc = self.computes.get(this)      # the info itself stays until ReleaseNodeComputeInfos
        if nc is not None and nc.native is not None:
            self._free_native(nc)

    def _free_native(self, nc: NodeCompute) -> None:
        assert nc.native is not None
        nc.native.free()          # waits until no compute of this node is running
        if self.options.profiling:
            _PROFILES.append(profile_of(nc))
        nc.native = None
        nc.records.clear()


# -- profiles ------------------------------------------------------------------------------
_PROFILES: list[dict[str, Any]] = []


def profile_of(nc: NodeCompute) -> dict[str, Any]:
    """The per-kernel profile of one fused node: per program (input shapes), the runs
    profiled and each kernel's mean wall and busy (summed over cores) microseconds."""
    out: dict[str, Any] = {"node": nc.name, "nodes": len(nc.group.nodes),
                           "op_types": list(nc.group.op_types), "programs": []}
    for rec in nc.records:
        sums, runs = rec.profile()
        rate = machine_peaks(rec.program)["cycles_per_second"]
        kernels = []
        for k, (wall, busy) in zip(rec.program.spec.kernels, sums):
            kernels.append({"kernel": k.symbol, "op_types": list(k.op_types),
                            "nodes": list(k.nodes),
                            "mean_us": float(wall) / max(runs, 1) / rate * 1e6,
                            "busy_us": float(busy) / max(runs, 1) / rate * 1e6})
        out["programs"].append({"input_shapes": [list(s) for s in rec.in_shapes],
                                "runs": runs, "kernels": kernels})
    return out


def profiles() -> list[dict[str, Any]]:
    """The profiles of the fused nodes of sessions that ran with enable_profiling=1 and have
    been released (newest last)."""
    return list(_PROFILES)


# -- small helpers ---------------------------------------------------------------------------
def _cstr(api: FunctionTable, fn: str, obj: int) -> str:
    s = c_char_p()
    getattr(api, fn)(obj, byref(s))
    return (s.value or b"").decode()


def _model_path(api: FunctionTable, graph: int) -> str:
    """The model's file ('' for a model given as bytes): EPContext files resolve against it."""
    try:
        return _cstr(api, "Graph_GetModelPath", graph)
    except OrtCallError:
        return ""


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80] or "node"


def _attr(n: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    for a in n.attribute:
        if a.name == name:
            return a
    return None


def _attr_str(n: onnx.NodeProto, name: str) -> str:
    a = _attr(n, name)
    return a.s.decode("utf-8", "replace") if a is not None else ""


def _attr_bytes(n: onnx.NodeProto, name: str) -> bytes | None:
    a = _attr(n, name)
    return a.s if a is not None else None


def _attr_int(n: onnx.NodeProto, name: str, default: int) -> int:
    a = _attr(n, name)
    return int(a.i) if a is not None else default


def _editor(api: FunctionTable) -> FunctionTable:
    return FunctionTable(api.GetModelEditorApi(), _abi.ModelEditorApiSlots, api=api)


def _op_attr(api: FunctionTable, name: str, kind: int, value: Any) -> int:
    out = c_void_p()
    if kind == _abi.ATTR_INT:
        v = c_int64(int(value))
        api.CreateOpAttr(name.encode(), byref(v), 1, kind, byref(out))
    else:
        data = bytes(value)
        buf = ctypes.create_string_buffer(data, len(data) + 1)
        api.CreateOpAttr(name.encode(), buf, len(data), kind, byref(out))
    return out.value or 0


# -- CreateEpFactories / ReleaseEpFactory (called by the shim) -----------------------------------
_factories: dict[int, Factory] = {}
_last_error: list[str] = []
_api_cache: dict[str, FunctionTable] = {}


def _create_factories(name: bytes | None, api_base: int, logger: int, out: Any, max_out: int,
                      num: Any) -> int | None:
    try:
        num[0] = 0
        if not api_base:
            _last_error.append("CreateEpFactories was called without an OrtApiBase")
            return None
        base = _abi.OrtApiBase.from_address(api_base)
        api_ptr = base.GetApi(ORT_VERSION)
        version = (base.GetVersionString() or b"?").decode()
        if not api_ptr:
            _last_error.append(f"onnxruntime {version} does not offer API version "
                               f"{ORT_VERSION}: {EP_NAME} needs onnxruntime >= 1.23")
            log.error("%s", _last_error[-1])
            return None
        api = FunctionTable(api_ptr, OrtApiSlots)
        _api_cache["api"] = api
        if max_out < 1:
            return None
        f = Factory(api, (name or b"").decode())
        _factories[f.address] = f
        out[0] = f.address
        num[0] = 1
        return None
    except BaseException as e:
        log.error("CreateEpFactories failed\n%s", traceback.format_exc())
        _last_error.append(f"{type(e).__name__}: {e}")
        api = _api_cache.get("api")
        return api.make_status(ORT_FAIL, f"{EP_NAME}: {e}") if api else None


def _release_factory(factory: int) -> int | None:
    try:
        _factories.pop(factory or 0, None)
    except BaseException:
        log.error("ReleaseEpFactory failed\n%s", traceback.format_exc())
    return None


def last_error() -> str | None:
    return _last_error[-1] if _last_error else None


_hooks: list[Any] = []
_hook_lock = threading.Lock()


def install_hooks() -> str:
    """Load the shim and point its exports at this module (once); returns its path."""
    with _hook_lock:
        lib = _native.load()
        if not _hooks:
            c = _native.CREATE_FACTORIES_FN(_create_factories)
            r = _native.RELEASE_FACTORY_FN(_release_factory)
            lib.cannc_ep_set_callbacks(c, r)
            _hooks.extend([c, r])
        return _native.library_path()


__all__ = ["EP_NAME", "OPTIONS", "EpOptions", "install_hooks", "last_error", "profiles"]
