"""Fused kernels: one node of domain 'cannc' stands for a group of ONNX nodes.

The group's nodes are kept in the node's `body` attribute (in order); the
node's inputs are the group's external inputs and its outputs the values the
group must write to memory. Each fused op lowers to ONE generated function
(codegen/lower/fused.py):

- FusedMap: a chain of elementwise/broadcast ops as one vectorised loop nest
  (the ops' own `expr` functions composed; scalar constants become immediates);
- FusedGemm: a MatMul/Gemm whose elementwise consumers (bias, activation,
  residual add...) run in the GEMM's epilogue, in registers, before the store;
- FusedConv: the same around a Conv; FusedAttention: scaled dot-product attention;
  FusedSoftmax: a Softmax/LogSoftmax computing its elementwise producers.

`operand_pattern` and `conv_operand_pattern` say how an epilogue operand is
indexed (the fusion pass asks them whether an operand can be read at all).
`AttnSpec` is FusedAttention's `spec` attribute: the sizes, strides, scale and mask
of the attention the fusion pass matched (codegen/attention.py generates its kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import Category, OpDef, register
from ..types import TensorType

DOMAIN = "cannc"


register(OpDef(name="FusedMap", domain=DOMAIN, category=Category.BROADCAST,
               doc="elementwise/broadcast chain in one loop nest"))


# -- GEMM + epilogue ---------------------------------------------------------------


def operand_pattern(t: TensorType, out_shape: tuple[int, ...], batched: bool) -> str | None:
    """How an epilogue operand is indexed from the GEMM's (m, n): 'scalar' (offset 0),
    'row' (n), 'col' (m), 'full' (m*N + n); None when it is none of these. An operand
    of the output's rank and extents is 'full' (and [.., 1] 'col') even when the rows are
    one (M = 1), so a kernel for any M indexes it the same way at every M."""
    shape = tuple(t.shape)
    r = len(out_shape)
    if not batched and len(shape) == r and r >= 2:
        if shape == tuple(out_shape):
            return "full"
        if shape[-1] == 1 and out_shape[-1] != 1 and shape[:-1] == tuple(out_shape[:-1]):
            return "col"
    shape = (1,) * (r - len(shape)) + shape
    if all(d == 1 for d in shape):
        return "scalar"
    if all(d == 1 for d in shape[:-1]) and shape[-1] == out_shape[-1]:
        return "row"
    if batched:
        return None
    if shape == tuple(out_shape):
        return "full"
    if shape[-1] == 1 and shape[:-1] == tuple(out_shape[:-1]):
        return "col"
    return None


register(OpDef(name="FusedGemm", domain=DOMAIN, category=Category.CONTRACTION,
               doc="GEMM with an elementwise epilogue"))


# -- Conv + epilogue -----------------------------------------------------------------


def conv_operand_pattern(t: TensorType, out_shape: tuple[int, ...]) -> str | None:
    """How an epilogue operand of a Conv output [N, M, *spatial] is indexed: 'scalar',
    'channel' (one value per output channel) or 'full'; None otherwise."""
    shape = tuple(t.shape)
    r = len(out_shape)
    shape = (1,) * (r - len(shape)) + shape
    if all(d == 1 for d in shape):
        return "scalar"
    if shape == tuple(out_shape):
        return "full"
    if r >= 2 and shape[1] == out_shape[1] and all(
            d == 1 for i, d in enumerate(shape) if i != 1):
        return "channel"
    return None


register(OpDef(name="FusedConv", domain=DOMAIN, category=Category.CONTRACTION,
               doc="convolution with an elementwise epilogue"))


# -- attention ------------------------------------------------------------------------

_MASK_MODES = ("none", "add", "where")


def dense_strides(d0: int, d1: int, d2: int, d3: int) -> tuple[int, int, int, int]:
    """Element strides of a C-contiguous 4-D array of shape (d0, d1, d2, d3)."""
    return (d1 * d2 * d3, d2 * d3, d3, 1)


@dataclass(frozen=True)
class AttnSpec:
    """Fused attention ``O = softmax(mask(Q K^T * scale)) V`` over (b, h).

    Strides are in elements over the logical axes (b, h, s, d) of each
    operand (Q ``[B,H,Sq,D]``, K ``[B,H,Sk,D]``, V ``[B,H,Sk,Dv]``, O
    ``[B,H,Sq,Dv]``), so any layout works: K stored as ``[B,H,D,Sk]`` has
    strides ``(H*D*Sk, D*Sk, 1, Sk)``; an output in merged-heads layout
    ``[B,Sq,H,Dv]`` has ``(Sq*H*Dv, Dv, H*Dv, 1)``. A stride 0 broadcasts
    (inputs only; the output must not overlap itself).

    Scores, in this order::

        S = (Q @ K^T) * scale
        S = S + mask                 mask="add"   (float32 mask[b, h, i, j])
        S = where(mask, S, fill)     mask="where" (bool, or float32: nonzero keeps)
        S[i, j] = -inf  where j > i + (Sk - Sq)     causal=True

    With ``score_bias_after_scale=False`` the mask comes first:
    ``(Q @ K^T + mask) * scale`` or ``where(mask, Q @ K^T, fill) * scale``.
    ``mask_strides`` are element strides over (b, h, i, j) of the mask tensor
    (0 = broadcast), e.g. ``(Sk, 0, 0, 1)`` for a ``[B,1,1,Sk]`` padding mask,
    or ``(0, 0, N, 1)`` (with the pointer at row ``Sk - Sq``) for a slice of a
    ``[1,1,N,N]`` causal buffer.
    """

    B: int
    H: int
    Sq: int
    Sk: int
    D: int
    Dv: int
    q_strides: tuple[int, int, int, int]
    k_strides: tuple[int, int, int, int]
    v_strides: tuple[int, int, int, int]
    o_strides: tuple[int, int, int, int]
    scale: float = 1.0
    mask: str = "none"
    mask_strides: tuple[int, int, int, int] = (0, 0, 0, 0)
    mask_dtype: str = "float32"
    fill: float = -3.4028234663852886e38
    causal: bool = False
    score_bias_after_scale: bool = True

    def __post_init__(self):
        for f in ("B", "H", "Sq", "Sk", "D", "Dv"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"AttnSpec.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("q_strides", "k_strides", "v_strides", "o_strides", "mask_strides"):
            st = tuple(int(x) for x in getattr(self, f))
            if len(st) != 4:
                raise ValueError(f"AttnSpec.{f} needs 4 strides (b, h, s, d), got {st}")
            if any(x < 0 for x in st):
                raise ValueError(f"AttnSpec.{f} must be >= 0, got {st}")
            object.__setattr__(self, f, st)
        if self.mask not in _MASK_MODES:
            raise ValueError(f"AttnSpec.mask must be one of {_MASK_MODES}, got {self.mask!r}")
        if self.mask == "add" and self.mask_dtype != "float32":
            raise ValueError("an additive mask must be float32")
        if self.mask_dtype not in ("float32", "bool"):
            raise ValueError(
                f"AttnSpec.mask_dtype must be 'float32' or 'bool', got {self.mask_dtype!r}"
            )
        o = self.o_strides
        if (
            self.B > 1
            and o[0] == 0
            or self.H > 1
            and o[1] == 0
            or self.Sq > 1
            and o[2] == 0
            or self.Dv > 1
            and o[3] == 0
        ):
            raise ValueError("AttnSpec.o_strides must not broadcast (tiles write disjoint rows)")
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "fill", float(self.fill))

    @classmethod
    def dense(
        cls,
        B: int,
        H: int,
        Sq: int,
        Sk: int,
        D: int,
        Dv: int | None = None,
        *,
        k_transposed: bool = False,
        merged_heads_out: bool = False,
        **kw,
    ) -> AttnSpec:
        """Contiguous Q [B,H,Sq,D], K [B,H,Sk,D] (or [B,H,D,Sk]), V [B,H,Sk,Dv]
        and O [B,H,Sq,Dv] (or [B,Sq,H,Dv])."""
        Dv = D if Dv is None else Dv
        ks = dense_strides(B, H, D, Sk) if k_transposed else dense_strides(B, H, Sk, D)
        if k_transposed:
            ks = (ks[0], ks[1], 1, Sk)
        if merged_heads_out:
            m = dense_strides(B, Sq, H, Dv)
            os_ = (m[0], m[2], m[1], 1)
        else:
            os_ = dense_strides(B, H, Sq, Dv)
        return cls(
            B,
            H,
            Sq,
            Sk,
            D,
            Dv,
            dense_strides(B, H, Sq, D),
            ks,
            dense_strides(B, H, Sk, Dv),
            os_,
            **kw,
        )


register(OpDef(name="FusedAttention", domain=DOMAIN, category=Category.OPAQUE,
               # the concrete AttnSpec (sizes, strides) is covered by the tiling key
               tiling_attrs=("spec",),
               doc="scaled dot-product attention, tiled with an online softmax"))


register(OpDef(name="FusedSoftmax", domain=DOMAIN, category=Category.REDUCTION,
               doc="Softmax/LogSoftmax reading an elementwise prologue (scale, mask...)"))
