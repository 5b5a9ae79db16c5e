"""Lowerings: how each op becomes native code, registered onto the op by name.

An op is defined in `cannc.ir.ops.<family>` (what it is); its lowering lives in
`cannc.codegen.lower.<family>` and registers itself here::

    @register_lowering("Transpose", tiling=_transpose_tiling)
    def _lower_transpose(ctx: LowerCtx) -> None: ...

`cannc.codegen.lower.lowering_for(op)` (the package, which loads every family
first) is how the compiler and the support report find it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...artifact import Tiling
    from ...ir.graph import Node
    from ...ir.registry import OpDef
    from ...ir.types import TensorType
    from ..kernel import LowerCtx

LowerFn = Callable[["LowerCtx"], None]
# host tiling function of a shape-polymorphic lowering: (node, in_types, out_types) ->
# Tiling, or None where that shape is emitted statically (ABI.md "Runtime dimensions")
TilingFn = Callable[["Node", list["TensorType | None"], list["TensorType"]], "Tiling | None"]


@dataclass(frozen=True)
class Lowering:
    lower: LowerFn
    tiling: TilingFn | None = None
    # the tiling function also takes consts=(input i is a compile-time constant, ...): a
    # kernel whose form depends on it (an AMX GEMM needs its B prepacked) says so
    tiling_consts: bool = False
    # the tiling function also takes values=(input i's constant array or None, ...): an
    # op whose constant inputs say what it does (a Reduce's axes, a Slice's starts and
    # ends) is shape-polymorphic in the rest, rather than one static kernel per shape
    tiling_values: bool = False


_LOWERINGS: dict[tuple[str, str], Lowering] = {}
_MAP_LOWERING: list[Lowering] = []     # the shared lowering of ops with an `expr`


def register_lowering(name: str, domain: str = "", tiling: TilingFn | None = None,
                      tiling_consts: bool = False, tiling_values: bool = False
                      ) -> Callable[[LowerFn], LowerFn]:
    """Decorator: `fn` lowers op `name` (in `domain`); `tiling` is its host tiling function
    (`tiling_consts`, `tiling_values`: called with ``consts=`` or ``values=`` too, see
    `Lowering`)."""

    def deco(fn: LowerFn) -> LowerFn:
        key = (domain, name)
        if key in _LOWERINGS:
            raise ValueError(f"lowering of {domain + '::' if domain else ''}{name} "
                             "registered twice")
        _LOWERINGS[key] = Lowering(fn, tiling, tiling_consts, tiling_values)
        return fn

    return deco


def register_map_lowering(fn: LowerFn, tiling: TilingFn | None = None) -> None:
    """The lowering every op with an elementwise `expr` and no lowering of its own gets."""
    if _MAP_LOWERING:
        raise ValueError("the map lowering is registered twice")
    _MAP_LOWERING.append(Lowering(fn, tiling))


def registered_lowering(op: OpDef) -> Lowering | None:
    """As registered so far (use `cannc.codegen.lower.lowering_for`)."""
    found = _LOWERINGS.get((op.domain, op.name))
    if found is None and op.expr is not None and _MAP_LOWERING:
        found = _MAP_LOWERING[0]
    return found
