"""Every op family, loaded together: `lookup` and `all_ops` see all of them.

One module per family; each registers OpDefs (what the op is) and imports only
from `cannc.ir`. Lowerings are registered separately, by `cannc.codegen.lower`.
"""

from __future__ import annotations

from ..registry import OpDef, registered, registered_ops
from . import (
    attention_op,  # noqa: F401
    contraction,  # noqa: F401
    control,  # noqa: F401
    conv,  # noqa: F401
    elementwise,  # noqa: F401
    fused,  # noqa: F401
    misc,  # noqa: F401
    movement,  # noqa: F401
    quant,  # noqa: F401
    reduce,  # noqa: F401
    rnn,  # noqa: F401
    shape_ops,  # noqa: F401
)


def lookup(op_type: str, domain: str = "") -> OpDef | None:
    """The definition of an op, or None where cannc does not know it."""
    return registered(op_type, domain)


def all_ops() -> list[OpDef]:
    return registered_ops()
