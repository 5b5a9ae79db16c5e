"""Every op family, loaded together: `lookup` and `all_ops` see all of them.

One module per family; each registers OpDefs (what the op is) and imports only
from `cannc.ir`. Lowerings are registered separately, by `cannc.codegen.lower`.
"""

from __future__ import annotations

from ..registry import OpDef, registered, registered_ops
from . import elementwise  # noqa: F401
from . import shape_ops  # noqa: F401
from . import movement  # noqa: F401
from . import reduce  # noqa: F401
from . import contraction  # noqa: F401
from . import conv  # noqa: F401
from . import fused  # noqa: F401
from . import quant  # noqa: F401
from . import misc  # noqa: F401
from . import rnn  # noqa: F401
from . import attention_op  # noqa: F401


def lookup(op_type: str, domain: str = "") -> OpDef | None:
    """The definition of an op, or None where cannc does not know it."""
    return registered(op_type, domain)


def all_ops() -> list[OpDef]:
    return registered_ops()
