"""cannc inside ONNX Runtime: a plugin execution provider (ORT >= 1.23).

The way ORT documents plugin EPs::

    import onnxruntime as ort, cannc.ort
    ort.register_execution_provider_library("cannc", cannc.ort.library_path())
    devs = [d for d in ort.get_ep_devices() if d.ep_name == "CanncExecutionProvider"]
    so = ort.SessionOptions()
    so.add_provider_for_devices(devs, {"op_type_allow_list": "MatMul,Conv"})
    sess = ort.InferenceSession("model.onnx", so)

or in one call: ``cannc.ort.session("model.onnx", op_type_allow_list="MatMul,Conv")``.

The nodes cannc supports run as cannc programs (fused, planned, tiled native kernels on
cannc's native AI cores); ORT's CPU provider runs the rest. Options (`OPTIONS`): the allow
and deny lists, precision_mode, op_select_impl_mode, cores, enable_profiling, strict,
min_group_size. ORT's EPContext settings (ep.context_enable...) save the compiled groups.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import CanncError
from .ep import EP_NAME, OPTIONS, EpOptions, install_hooks, last_error, profiles

MIN_ORT = (1, 23)
_registered: dict[str, str] = {}
_lock = threading.Lock()


def _ort() -> Any:
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - onnxruntime is a dependency
        raise CanncError(f"cannc.ort needs onnxruntime: {e}") from e
    version = tuple(int(p) for p in ort.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_ORT or not hasattr(ort, "register_execution_provider_library"):
        raise CanncError(
            f"onnxruntime {ort.__version__} is too old for cannc's execution provider: plugin "
            f"EPs with GetCapability/Compile need onnxruntime >= "
            f"{'.'.join(map(str, MIN_ORT))} (pip install -U onnxruntime)")
    return ort


def library_path() -> str:
    """The path of the EP library to give to ``ort.register_execution_provider_library``
    (it is built with the package; its entry points are hooked to cannc here)."""
    _ort()
    return install_hooks()


def register(name: str = "cannc") -> str:
    """Register the EP library with ONNX Runtime under `name` (once per process; again is a
    no-op). Returns the name."""
    ort = _ort()
    with _lock:
        if name in _registered:
            return name
        path = library_path()
        if ep_devices():          # the user registered the library already, under some name
            _registered[name] = path
            return name
        try:
            ort.register_execution_provider_library(name, path)
        except Exception as e:
            if "already" not in str(e).lower():
                err = last_error()
                raise CanncError(f"registering cannc's execution provider failed: {e}"
                                 + (f" ({err})" if err else "")) from e
        _registered[name] = path
        if not ep_devices():
            err = last_error()
            raise CanncError("onnxruntime loaded cannc's execution provider but offers no "
                             f"{EP_NAME} device" + (f": {err}" if err else ""))
        return name


def ep_devices() -> list[Any]:
    """ORT's devices of cannc's EP (after `register`)."""
    return [d for d in _ort().get_ep_devices() if d.ep_name == EP_NAME]


def _option_strings(options: dict[str, Any] | None, kw: dict[str, Any]) -> dict[str, str]:
    opts = {**(options or {}), **kw}
    out = {}
    for k, v in opts.items():
        if isinstance(v, bool):
            v = int(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            v = ",".join(map(str, v))
        out[str(k)] = str(v)
    EpOptions.parse(out)    # an unknown name or a bad value fails here, naming it
    return out


def session_options(options: dict[str, Any] | None = None, *,
                    base: Any = None, **kw: Any) -> Any:
    """``ort.SessionOptions`` with cannc's EP added (registering it first). `options` and
    keywords are the EP's options; lists may be given as Python lists."""
    ort = _ort()
    register()
    so = base if base is not None else ort.SessionOptions()
    so.add_provider_for_devices(ep_devices(), _option_strings(options, kw))
    return so


def session(model: Any, options: dict[str, Any] | None = None, *,
            sess_options: Any = None, **kw: Any) -> Any:
    """An ``ort.InferenceSession`` of `model` (a path or serialised bytes) with cannc's EP
    and ORT's CPU provider for the rest."""
    ort = _ort()
    so = session_options(options, base=sess_options, **kw)
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    return ort.InferenceSession(model, so)


def assignment(sess: Any) -> dict[str, list[str]]:
    """Node names per execution provider, from ORT's record of the session's partitioning
    (needs ``session.record_ep_graph_assignment_info`` = "1" in the session options)."""
    out: dict[str, list[str]] = {}
    for sub in sess.get_provider_graph_assignment_info():
        out.setdefault(sub.ep_name, []).extend(n.name for n in sub.get_nodes())
    return out


__all__ = ["EP_NAME", "OPTIONS", "assignment", "ep_devices", "library_path", "profiles",
           "register", "session", "session_options"]
