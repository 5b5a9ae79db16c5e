"""The eager mixed-precision policy: `cannc.ops.auto_mixed_precision`."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import CanncError
from ..passes.precision import PRECISIONS

_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
            "half": "fp16", "fp32": "fp32", "float32": "fp32", "float": "fp32"}

# the precision eager ops compile their graph with in this context ("fp32": none)
_CURRENT: contextvars.ContextVar[str] = contextvars.ContextVar("cannc_eager_precision",
                                                               default="fp32")


def precision_name(p: object, what: str = "precision") -> str:
    """"bf16" / "fp16" / "fp32" from the names people write (bfloat16, float16, ...)."""
    name = _ALIASES.get(str(p).lower()) if isinstance(p, str) else None
    if name is None or name not in PRECISIONS:
        raise CanncError(f"unknown {what} {p!r}; choose one of bf16, fp16, fp32 "
                         "(or bfloat16, float16, float32)")
    return name


def current_precision() -> str:
    return _CURRENT.get()


@contextmanager
def auto_mixed_precision(dtype: str = "bf16", enabled: bool = True) -> Iterator[None]:
    """Inside this context eager ops follow cannc's mixed-precision policy (the one
    `cannc.compile(model, precision=dtype)` applies to a whole model, see
    cannc/passes/precision.py): each op's one-node graph is compiled with
    ``precision=dtype``. An op's class decides what happens to it:

    - ALLOW (matmul, gemm, conv, attention): multiplies in `dtype`, sums in float32, and
      returns a `dtype` array;
    - DENY (layer_norm, softmax, reductions, exp/log, ...): computes in float32 (narrow
      inputs are widened) and returns float32;
    - FOLLOW (other elementwise and movement ops): returns `dtype` when all its float
      array inputs are `dtype`, else computes and returns float32.

    A call's ``output_dtype=`` sets the dtype of the array it returns (the computation
    still follows the policy: ``matmul(x, w, output_dtype="float32")`` multiplies in bf16,
    sums in float32 and stores float32 without rounding to bf16); ``precision=`` overrides
    the context for that call ("fp32": no reduced precision at all).

    Contexts nest; the innermost wins; ``enabled=False`` turns the policy off inside. The
    setting is per thread (and per asyncio task)."""
    p = precision_name(dtype, "dtype") if enabled else "fp32"
    token = _CURRENT.set(p)
    try:
        yield
    finally:
        _CURRENT.reset(token)
