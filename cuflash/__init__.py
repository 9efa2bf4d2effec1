"""cuflash: FlashAttention for CuPy (and NumPy) users.

``cuflash.attention(q, k, v)`` computes exact softmax attention with NumPy-style semantics:
CUDA kernels compiled at run time for CuPy arrays, a blocked CPU implementation of the same
algorithm for NumPy arrays. ``cuflash.reference.attention`` is the float64 oracle with the
same signature.
"""

from cuflash import reference
from cuflash._api import attention

__all__ = ["attention", "reference"]
__version__ = "0.1.0"
