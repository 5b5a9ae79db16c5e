from .onnx_import import import_model, load_model_proto

__all__ = ["import_model", "load_model_proto"]
