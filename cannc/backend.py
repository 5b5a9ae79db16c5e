"""An onnx.backend implementation over cannc, so the official ONNX backend test
suite (onnx.backend.test.BackendTest) runs against cannc:

    import cannc.backend
    backend_test = onnx.backend.test.BackendTest(cannc.backend, __name__)

Two things the backend does that a plain `cannc.compile` does not:

* Models older than the oldest opset the frontend reads (7) are converted with
  onnx.version_converter first (the frontend's own advice).
* Value specialisation by position. The backend test cases feed every tensor as
  a graph input, also those that real models carry as initializers and that
  decide an output shape or a kernel's parameters: Resize scales/sizes/roi,
  Range bounds, OneHot depth, Reshape/Expand/Tile shapes, Slice/Pad/Reduce axes,
  a CumSum axis, a TopK k... A graph input that feeds such a slot (the op's
  `value_inputs` in the registry) becomes an initializer holding the fed value, and the
  model is compiled once per distinct value (cached). Every other input stays a
  runtime input, so the computation itself still runs as native code. (The
  Session does the same for small integer inputs after a ShapeError; this
  covers float scales and parameters that are not shapes.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from .config import check_size
from .errors import InputError, ModelError
from .ir.ops import lookup
from .ir.types import NP_TO_ONNX
from .session import Session

MIN_FRONTEND_OPSET = 7
_MAX_SPECIALISATIONS = 16


def shape_deciding_inputs(model: onnx.ModelProto) -> list[str]:
    """Graph inputs that feed a value-deciding slot of some node (the op's `value_inputs`).
    Ops cannc does not define have none: such a model fails to compile anyway, naming
    the op (UnsupportedOpError), whatever the inputs are."""
    inputs = {i.name for i in model.graph.input}
    inits = {i.name for i in model.graph.initializer}
    out: list[str] = []
    for n in model.graph.node:
        op = lookup(n.op_type, n.domain)
        for pos in op.value_inputs if op is not None else ():
            if pos < len(n.input):
                v = n.input[pos]
                if v and v in inputs and v not in inits and v not in out:
                    out.append(v)
    return out


def _upgrade(model: onnx.ModelProto) -> onnx.ModelProto:
    """Convert models older than the frontend's oldest opset (e.g. opset 1 tests)."""
    ver = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if ver is None or ver >= MIN_FRONTEND_OPSET:
        return model
    try:
        from onnx import version_converter
        return version_converter.convert_version(model, MIN_FRONTEND_OPSET)
    except Exception:
        return model


class CanncRep(BackendRep):
    def __init__(self, model: onnx.ModelProto, **kwargs: Any) -> None:
        self.model = model
        self.kwargs = kwargs
        self._names = [i.name for i in model.graph.input
                       if i.name not in {t.name for t in model.graph.initializer}]
        self.value_inputs = shape_deciding_inputs(model)
        self._sessions: dict[tuple, Session] = {}
        self.session: Session | None = None
        if not self.value_inputs:
            self.session = Session(model, **kwargs)
            self._names = [i.name for i in self.session.get_inputs()]

    def _session_for(self, feeds: dict[str, np.ndarray]) -> Session:
        if self.session is not None:
            return self.session
        missing = [n for n in self.value_inputs if n not in feeds]
        if missing:
            raise InputError(f"missing input(s) {missing}; the model's inputs are "
                             f"{self._names}")
        for n in self.value_inputs:   # multiplied out before anything reads the values
            check_size(f"input '{n}'", feeds[n].shape, feeds[n].dtype.itemsize)
        key = tuple((n, feeds[n].dtype.str, feeds[n].shape, feeds[n].tobytes())
                    for n in self.value_inputs)
        s = self._sessions.get(key)
        if s is None:
            m = onnx.ModelProto()
            m.CopyFrom(self.model)
            keep = [i for i in m.graph.input if i.name not in self.value_inputs]
            del m.graph.input[:]
            m.graph.input.extend(keep)
            for n in self.value_inputs:
                m.graph.initializer.append(numpy_helper.from_array(feeds[n], n))
            s = Session(m, **self.kwargs)
            if len(self._sessions) >= _MAX_SPECIALISATIONS:
                self._sessions.pop(next(iter(self._sessions)))
            self._sessions[key] = s
        return s

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = dict(zip(self._names, inputs))
        feeds = {k: np.asarray(v) for k, v in feeds.items()}
        s = self._session_for(feeds)
        names = {i.name for i in s.get_inputs()}
        return tuple(s.run(None, {k: v for k, v in feeds.items() if k in names}))


class CanncBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> CanncRep:
        super().prepare(model, device, **kwargs)
        kwargs.setdefault("eager", False)
        return CanncRep(_upgrade(model), **kwargs)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Sequence[np.ndarray], device: str = "CPU",
                 outputs_info: Any = None, **kwargs: Any) -> tuple[np.ndarray, ...]:
        arrays = [np.asarray(x) for x in inputs]
        bad = [f"{n}: {a.dtype}" for n, a in zip(node.input, arrays) if a.dtype not in NP_TO_ONNX]
        if bad:
            raise InputError(f"inputs of node '{node.name}' ({node.op_type}) have dtypes "
                             f"ONNX has no tensor type for: {', '.join(bad)}")
        vis = [onnx.helper.make_tensor_value_info(n, NP_TO_ONNX[a.dtype], a.shape)
               for n, a in zip(node.input, arrays) if n]
        outs = [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
                for o in node.output]
        graph = onnx.helper.make_graph([node], "run_node", vis, outs)
        opset = kwargs.pop("opset_version", onnx.defs.onnx_opset_version())
        model = onnx.helper.make_model(
            graph, opset_imports=[onnx.helper.make_opsetid(node.domain or "", opset)])
        try:
            model = onnx.shape_inference.infer_shapes(model)
        except Exception as e:
            raise ModelError(f"node '{node.name}' ({node.op_type}) fails ONNX shape "
                             f"inference: {e}") from e
        for vi in model.graph.output:
            for v in model.graph.value_info:
                if v.name == vi.name:
                    vi.CopyFrom(v)
        return cls.run_model(model, [a for n, a in zip(node.input, arrays) if n], device,
                             **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return Device(device).type == DeviceType.CPU


prepare = CanncBackend.prepare
run_model = CanncBackend.run_model
run_node = CanncBackend.run_node
supports_device = CanncBackend.supports_device
is_compatible = CanncBackend.is_compatible
