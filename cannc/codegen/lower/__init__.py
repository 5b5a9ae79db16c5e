"""Lowerings: how each op becomes native code, registered onto the op by name.

An op is defined in `cannc.ir.ops.<family>` (what it is); its lowering lives in
`cannc.codegen.lower.<family>` (how it becomes code) and registers itself with
`base.register_lowering`. `lowering_for(op)` is how the compiler and the
support report find it: the lowering registered under the op's (domain, name),
else the shared map lowering for any elementwise op that defines an `expr`
(so a new elementwise op needs no lowering of its own).
"""

from __future__ import annotations

from ...ir.registry import OpDef

# every lowering module, one per op family (importing one registers its lowerings)
# (families move here from cannc/ir/ops one at a time: issue 10)
from . import (
    attention,  # noqa: F401
    contraction,  # noqa: F401
    conv,  # noqa: F401
    elementwise,  # noqa: F401
    fused,  # noqa: F401
    misc,  # noqa: F401
    movement,  # noqa: F401
    quant,  # noqa: F401
    reduce,  # noqa: F401
    rnn,  # noqa: F401
)
from .base import Lowering, register_lowering, registered_lowering


def lowering_for(op: OpDef) -> Lowering | None:
    """The native lowering of `op`, or None where cannc has none."""
    return registered_lowering(op)


__all__ = ["Lowering", "lowering_for", "register_lowering"]
