"""An onnx.backend implementation over cannc, so the official ONNX backend test
suite (onnx.backend.test.BackendTest) runs against cannc:

    import cannc.backend
    backend_test = onnx.backend.test.BackendTest(cannc.backend, __name__)
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from .session import Session


class CanncRep(BackendRep):
    def __init__(self, session: Session) -> None:
        self.session = session
        self._names = [i.name for i in session.get_inputs()]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = dict(zip(self._names, inputs))
        feeds = {k: np.asarray(v) for k, v in feeds.items()}
        return tuple(self.session.run(None, feeds))


class CanncBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> CanncRep:
        super().prepare(model, device, **kwargs)
        return CanncRep(Session(model, eager=False, **kwargs))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Sequence[np.ndarray], device: str = "CPU",
                 outputs_info: Any = None, **kwargs: Any) -> tuple[np.ndarray, ...]:
        from .ir.types import NP_TO_ONNX

        arrays = [np.asarray(x) for x in inputs]
        vis = [onnx.helper.make_tensor_value_info(n, NP_TO_ONNX[a.dtype], a.shape)
               for n, a in zip(node.input, arrays) if n]
        outs = [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
                for o in node.output]
        graph = onnx.helper.make_graph([node], "run_node", vis, outs)
        opset = kwargs.pop("opset_version", onnx.defs.onnx_opset_version())
        model = onnx.helper.make_model(
            graph, opset_imports=[onnx.helper.make_opsetid(node.domain or "", opset)])
        model = onnx.shape_inference.infer_shapes(model)
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
