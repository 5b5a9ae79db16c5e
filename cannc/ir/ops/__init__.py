"""Op families. Importing this package registers every op with the registry."""

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
