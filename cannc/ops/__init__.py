"""Eager ops: ONNX operators called on NumPy arrays, compiled by cannc on first use.

    y = cannc.ops.matmul(x, w)
    z = cannc.ops.layer_norm(y, scale, bias, epsilon=1e-5)
    with cannc.ops.auto_mixed_precision(dtype="bf16"):
        y = cannc.ops.matmul(x, w, output_dtype="float32")

Every function takes arrays (NumPy; ml_dtypes.bfloat16 too) and returns new arrays
(a tuple when the op has several outputs). Attributes are keyword arguments with the ONNX
names in snake_case (``trans_a``, ``kernel_shape``, ``epsilon``...); left out, they take
ONNX's defaults. Inputs whose values decide shapes (a reshape's ``shape``, a slice's
``starts``...) and Python numbers are compile-time constants of the op; every other array
is a runtime input.

The first call at a signature (op, attributes, input dtypes and shapes, constants,
precision, output dtype) builds a one-node ONNX graph and compiles it with
`cannc.compile`: the same frontend, passes (fusion, mixed precision) and codegen as a
whole model, native code generated with llvmlite. Later calls find the compiled program in
an in-memory cache and run its kernels directly on the caller's buffers (no copy in, no
copy out; see cannc/ops/_fast.py); inputs are still checked (dtype and shape by the
cache key, contiguity by the launch), so nothing unchecked reaches native code.

Common keyword arguments of every op:

- ``output_dtype``: the dtype of the returned array(s) (a final Cast in the op's graph,
  fused into its kernel where cannc can). The computation follows the precision policy
  whatever the output dtype: under ``auto_mixed_precision("bf16")``,
  ``matmul(x, w, output_dtype="float32")`` still multiplies in bf16 and sums in float32,
  and returns the float32 sums unrounded.
- ``precision``: "fp32", "bf16" or "fp16" for this call, overriding the context.

`call(op_type, *inputs, domain="", **attrs)` runs any registered op (a custom op
too); `benchmark(fn, *args, warmup=100, runs=...)` times any callable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import CanncError
from ._eager import cache_info, clear_cache, invoke
from ._policy import auto_mixed_precision, current_precision
from .bench import Timing, benchmark

__all__ = ["call", "benchmark", "Timing", "auto_mixed_precision", "current_precision",
           "cache_info", "clear_cache"]


def call(op_type: str, *inputs: Any, domain: str = "", output_dtype: Any = None,
         precision: str | None = None, num_results: int | None = None, **attrs: Any) -> Any:
    """Run the op `op_type` of `domain` (default: ONNX) on `inputs`, with ONNX attributes
    as keyword arguments (snake_case or the ONNX spelling). `None` stands for an absent
    optional input. ``num_results``: how many outputs to return, for ops whose output
    count an attribute does not say (default: the op's required outputs). Returns one
    array, or a tuple of them."""
    if not isinstance(op_type, str) or not op_type:
        raise CanncError(f"cannc.ops.call: op_type must be an op name, got {op_type!r}")
    return invoke(op_type, domain or "", inputs, attrs, output_dtype=output_dtype,
                  precision=precision, num_results=num_results)


def _attrs(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def _unary(op_type: str, doc: str) -> Any:
    name = "".join("_" + c.lower() if c.isupper() and i else c.lower()
                   for i, c in enumerate(op_type))

    def f(x: Any, *, output_dtype: Any = None, precision: str | None = None,
          **attrs: Any) -> Any:
        return invoke(op_type, "", (x,), attrs, output_dtype=output_dtype,
                      precision=precision, name=name, arg_names=("x",))

    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"{doc} (ONNX {op_type}), elementwise; attributes as keyword arguments."
    __all__.append(name)
    return f


def _binary(op_type: str, name: str, doc: str) -> Any:
    def f(a: Any, b: Any, *, output_dtype: Any = None, precision: str | None = None) -> Any:
        return invoke(op_type, "", (a, b), {}, output_dtype=output_dtype,
                      precision=precision, name=name, arg_names=("a", "b"))

    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"{doc} (ONNX {op_type}), with NumPy broadcasting; a Python number is a " \
                "constant of the first array's dtype."
    __all__.append(name)
    return f


add = _binary("Add", "add", "a + b")
sub = _binary("Sub", "sub", "a - b")
mul = _binary("Mul", "mul", "a * b")
div = _binary("Div", "div", "a / b")
pow = _binary("Pow", "pow", "a ** b")
maximum = _binary("Max", "maximum", "The elementwise maximum")
minimum = _binary("Min", "minimum", "The elementwise minimum")
equal = _binary("Equal", "equal", "a == b")
less = _binary("Less", "less", "a < b")
greater = _binary("Greater", "greater", "a > b")

relu = _unary("Relu", "max(x, 0)")
sigmoid = _unary("Sigmoid", "1 / (1 + exp(-x))")
tanh = _unary("Tanh", "tanh(x)")
exp = _unary("Exp", "exp(x)")
log = _unary("Log", "log(x)")
sqrt = _unary("Sqrt", "sqrt(x)")
abs = _unary("Abs", "|x|")
neg = _unary("Neg", "-x")
erf = _unary("Erf", "erf(x)")
reciprocal = _unary("Reciprocal", "1 / x")
leaky_relu = _unary("LeakyRelu", "x if x >= 0 else alpha * x (alpha=0.01)")
elu = _unary("Elu", "x if x >= 0 else alpha * (exp(x) - 1)")
softplus = _unary("Softplus", "log(1 + exp(x))")
hard_swish = _unary("HardSwish", "x * relu6(x + 3) / 6")
swish = _unary("Swish", "x * sigmoid(alpha * x)")


def _run(op_type: str, name: str, names: tuple[str, ...], inputs: tuple, attrs: dict,
         output_dtype: Any, precision: str | None, extra: dict | None = None) -> Any:
    # (`extra`: keyword arguments a function does not name: ONNX attributes it leaves out,
    # checked against the op's schema, so a misspelt one is a CanncError naming the op)
    return invoke(op_type, "", inputs, {**attrs, **extra} if extra else attrs,
                  output_dtype=output_dtype, precision=precision, name=name, arg_names=names)


def gelu(x: Any, *, approximate: str | None = None, output_dtype: Any = None,
         precision: str | None = None, **extra: Any) -> Any:
    """GELU (ONNX Gelu-20): x * Phi(x); ``approximate="tanh"`` for the tanh form."""
    return _run("Gelu", "gelu", ("x",), (x,), _attrs(approximate=approximate),
                output_dtype, precision, extra)


def matmul(a: Any, b: Any, *, output_dtype: Any = None, precision: str | None = None,
           **extra: Any) -> Any:
    """a @ b with NumPy's matmul semantics (ONNX MatMul: batched, broadcasting)."""
    return _run("MatMul", "matmul", ("a", "b"), (a, b), {}, output_dtype, precision, extra)


def gemm(a: Any, b: Any, c: Any = None, *, alpha: float | None = None,
         beta: float | None = None, trans_a: int | None = None, trans_b: int | None = None,
         output_dtype: Any = None, precision: str | None = None, **extra: Any) -> Any:
    """alpha * op(a) @ op(b) + beta * c (ONNX Gemm; op = transpose when trans_a/trans_b)."""
    return _run("Gemm", "gemm", ("a", "b", "c"), (a, b, c),
                _attrs(alpha=alpha, beta=beta, transA=trans_a, transB=trans_b),
                output_dtype, precision, extra)


def conv(x: Any, w: Any, b: Any = None, *, strides: Sequence[int] | None = None,
         pads: Sequence[int] | None = None, dilations: Sequence[int] | None = None,
         group: int | None = None, auto_pad: str | None = None,
         kernel_shape: Sequence[int] | None = None, output_dtype: Any = None,
         precision: str | None = None, **extra: Any) -> Any:
    """N-d convolution (ONNX Conv): x [N, C, ...], w [M, C/group, k...], b [M]."""
    return _run("Conv", "conv", ("x", "w", "b"), (x, w, b),
                _attrs(strides=strides, pads=pads, dilations=dilations, group=group,
                       auto_pad=auto_pad, kernel_shape=kernel_shape), output_dtype, precision,
                extra)


def softmax(x: Any, *, axis: int = -1, output_dtype: Any = None,
            precision: str | None = None, **extra: Any) -> Any:
    """Softmax over `axis` (ONNX Softmax-13)."""
    return _run("Softmax", "softmax", ("x",), (x,), {"axis": axis}, output_dtype, precision, extra)


def log_softmax(x: Any, *, axis: int = -1, output_dtype: Any = None,
                precision: str | None = None, **extra: Any) -> Any:
    """log(softmax(x)) over `axis` (ONNX LogSoftmax-13)."""
    return _run("LogSoftmax", "log_softmax", ("x",), (x,), {"axis": axis}, output_dtype,
                precision, extra)


def layer_norm(x: Any, scale: Any, bias: Any = None, *, axis: int | None = None,
               epsilon: float | None = None, output_dtype: Any = None,
               precision: str | None = None, **extra: Any) -> Any:
    """(x - mean) / sqrt(var + epsilon) * scale + bias over the axes from `axis` (default
    -1) on (ONNX LayerNormalization-17); returns Y only."""
    return _run("LayerNormalization", "layer_norm", ("x", "scale", "bias"), (x, scale, bias),
                _attrs(axis=axis, epsilon=epsilon), output_dtype, precision, extra)


def rms_norm(x: Any, scale: Any, *, axis: int | None = None, epsilon: float | None = None,
             output_dtype: Any = None, precision: str | None = None, **extra: Any) -> Any:
    """x / sqrt(mean(x^2) + epsilon) * scale (ONNX RMSNormalization-23)."""
    return _run("RMSNormalization", "rms_norm", ("x", "scale"), (x, scale),
                _attrs(axis=axis, epsilon=epsilon), output_dtype, precision, extra)


def attention(q: Any, k: Any, v: Any, attn_mask: Any = None, *, is_causal: int | None = None,
              scale: float | None = None, q_num_heads: int | None = None,
              kv_num_heads: int | None = None, softcap: float | None = None,
              output_dtype: Any = None, precision: str | None = None, **extra: Any) -> Any:
    """softmax(q @ k^T * scale + mask) @ v (ONNX Attention-23): q [B, H, S, D], k and v
    [B, Hkv, L, D] (or 3-d with q_num_heads / kv_num_heads); returns Y."""
    return _run("Attention", "attention", ("q", "k", "v", "attn_mask"), (q, k, v, attn_mask),
                _attrs(is_causal=is_causal, scale=scale, q_num_heads=q_num_heads,
                       kv_num_heads=kv_num_heads, softcap=softcap), output_dtype, precision, extra)


def transpose(x: Any, perm: Sequence[int] | None = None, *, output_dtype: Any = None,
              precision: str | None = None, **extra: Any) -> Any:
    """Permute the axes (ONNX Transpose; default: reversed)."""
    return _run("Transpose", "transpose", ("x",), (x,), _attrs(perm=perm), output_dtype,
                precision, extra)


def reshape(x: Any, shape: Sequence[int], *, allowzero: int | None = None,
            output_dtype: Any = None, precision: str | None = None, **extra: Any) -> Any:
    """x with a new shape (ONNX Reshape: 0 copies a dimension, -1 is inferred); a copy."""
    return _run("Reshape", "reshape", ("x", "shape"), (x, np.asarray(shape, np.int64)),
                _attrs(allowzero=allowzero), output_dtype, precision, extra)


def flatten(x: Any, *, axis: int | None = None, output_dtype: Any = None,
            precision: str | None = None, **extra: Any) -> Any:
    """x as 2-d: [prod(shape[:axis]), prod(shape[axis:])] (ONNX Flatten, axis=1)."""
    return _run("Flatten", "flatten", ("x",), (x,), _attrs(axis=axis), output_dtype, precision,
                extra)


def concat(*xs: Any, axis: int, output_dtype: Any = None, precision: str | None = None,
           **extra: Any) -> Any:
    """The arrays joined along `axis` (ONNX Concat)."""
    if len(xs) == 1 and isinstance(xs[0], (list, tuple)):
        xs = tuple(xs[0])
    return _run("Concat", "concat", tuple(f"x{i}" for i in range(len(xs))), xs,
                {"axis": axis}, output_dtype, precision, extra)


def cast(x: Any, to: Any, *, precision: str | None = None, **extra: Any) -> Any:
    """x converted to dtype `to` (ONNX Cast)."""
    return _run("Cast", "cast", ("x",), (x,), {"to": to}, None, precision, extra)


def where(cond: Any, a: Any, b: Any, *, output_dtype: Any = None,
          precision: str | None = None, **extra: Any) -> Any:
    """a where cond else b (ONNX Where, broadcasting)."""
    return _run("Where", "where", ("cond", "a", "b"), (cond, a, b), {}, output_dtype, precision,
                extra)


def clip(x: Any, min: Any = None, max: Any = None, *, output_dtype: Any = None,
         precision: str | None = None, **extra: Any) -> Any:
    """x limited to [min, max] (ONNX Clip-13; either bound may be left out)."""
    return _run("Clip", "clip", ("x", "min", "max"), (x, min, max), {}, output_dtype,
                precision, extra)


def _reduce(op_type: str, name: str) -> Any:
    def f(x: Any, axes: Sequence[int] | None = None, *, keepdims: int | None = None,
          output_dtype: Any = None, precision: str | None = None) -> Any:
        ax = None if axes is None else np.asarray(
            [axes] if isinstance(axes, int) else list(axes), np.int64)
        return _run(op_type, name, ("x", "axes"), (x, ax), _attrs(keepdims=keepdims),
                    output_dtype, precision)

    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"ONNX {op_type}-18 over `axes` (default: all), keepdims=1 unless told."
    __all__.append(name)
    return f


reduce_sum = _reduce("ReduceSum", "reduce_sum")
reduce_mean = _reduce("ReduceMean", "reduce_mean")
reduce_max = _reduce("ReduceMax", "reduce_max")
reduce_min = _reduce("ReduceMin", "reduce_min")


def gather(data: Any, indices: Any, *, axis: int | None = None, output_dtype: Any = None,
           precision: str | None = None, **extra: Any) -> Any:
    """data indexed by `indices` along `axis` (ONNX Gather; negative indices count back)."""
    return _run("Gather", "gather", ("data", "indices"), (data, indices), _attrs(axis=axis),
                output_dtype, precision, extra)


def max_pool(x: Any, *, kernel_shape: Sequence[int], strides: Sequence[int] | None = None,
             pads: Sequence[int] | None = None, dilations: Sequence[int] | None = None,
             ceil_mode: int | None = None, auto_pad: str | None = None,
             output_dtype: Any = None, precision: str | None = None, **extra: Any) -> Any:
    """Max pooling (ONNX MaxPool); returns Y."""
    return _run("MaxPool", "max_pool", ("x",), (x,),
                _attrs(kernel_shape=kernel_shape, strides=strides, pads=pads,
                       dilations=dilations, ceil_mode=ceil_mode, auto_pad=auto_pad),
                output_dtype, precision, extra)


def average_pool(x: Any, *, kernel_shape: Sequence[int], strides: Sequence[int] | None = None,
                 pads: Sequence[int] | None = None, ceil_mode: int | None = None,
                 count_include_pad: int | None = None, auto_pad: str | None = None,
                 output_dtype: Any = None, precision: str | None = None, **extra: Any) -> Any:
    """Average pooling (ONNX AveragePool)."""
    return _run("AveragePool", "average_pool", ("x",), (x,),
                _attrs(kernel_shape=kernel_shape, strides=strides, pads=pads,
                       ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                       auto_pad=auto_pad), output_dtype, precision, extra)


__all__ += ["add", "sub", "mul", "div", "pow", "maximum", "minimum", "equal", "less",
            "greater", "gelu", "matmul", "gemm", "conv", "softmax", "log_softmax",
            "layer_norm", "rms_norm", "attention", "transpose", "reshape", "flatten",
            "concat", "cast", "where", "clip", "gather", "max_pool", "average_pool"]
__all__ = sorted(set(__all__))
