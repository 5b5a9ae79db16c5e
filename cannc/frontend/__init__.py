from .onnx_import import LoadedModel, import_model, load_model, load_model_proto

__all__ = ["LoadedModel", "import_model", "load_model", "load_model_proto"]
