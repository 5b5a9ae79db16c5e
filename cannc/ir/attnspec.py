"""What a fused attention node computes: `AttnSpec`, the value of FusedAttention's `spec`
attribute (sizes, element strides of every operand, scale, mask). A pure value that the
attention pattern pass builds and the attention kernel generator (codegen/attention.py)
reads; constructing one checks that the kernel can take it.
"""

from __future__ import annotations

from dataclasses import dataclass

_MASK_MODES = ("none", "add", "where")


def dense_strides(d0: int, d1: int, d2: int, d3: int) -> tuple[int, int, int, int]:
    """Element strides of a C-contiguous 4-D array of shape (d0, d1, d2, d3)."""
    return (d1 * d2 * d3, d2 * d3, d3, 1)


FLOAT_DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("fp32", "bf16", "fp16")


def check_dtypes(s) -> None:
    """The element types of an AttnSpec (or a codegen AttnForm): ValueError if unusable."""
    if s.mask == "add" and s.mask_dtype not in FLOAT_DTYPES:
        raise ValueError(f"an additive mask must be one of {FLOAT_DTYPES}")
    if s.mask_dtype not in FLOAT_DTYPES + ("bool",):
        raise ValueError(f"AttnSpec.mask_dtype must be 'bool' or one of {FLOAT_DTYPES}, "
                         f"got {s.mask_dtype!r}")
    dts = tuple(str(d) for d in s.dtypes)
    if len(dts) != 4 or any(d not in FLOAT_DTYPES for d in dts):
        raise ValueError(f"AttnSpec.dtypes must be 4 of {FLOAT_DTYPES} (Q, K, V, O), got {dts}")
    object.__setattr__(s, "dtypes", dts)
    if s.precision not in PRECISIONS:
        raise ValueError(f"AttnSpec.precision must be one of {PRECISIONS}, got {s.precision!r}")


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

    then ``P = softmax(S)`` (NaN where ``zero_nan_rows``: 0) and ``O = P V``.

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
    # rows whose probabilities are NaN (every score -inf, a NaN or a +inf score, no
    # visible key) come out as 0, not NaN: torch's scaled_dot_product_attention export
    # guards its softmax with Where(IsNaN(p), 0, p)
    zero_nan_rows: bool = False
    # element types of Q, K, V, O ("float32", "bfloat16", "float16"): narrow operands are
    # converted on load / store; `precision` is the multiply precision ("fp32", "bf16",
    # "fp16"), always with float32 accumulation and a float32 softmax
    dtypes: tuple[str, str, str, str] = ("float32",) * 4
    precision: str = "fp32"

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
        check_dtypes(self)
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
