"""cuflash: FlashAttention for CuPy (and NumPy) users.

``cuflash.attention(q, k, v)`` computes exact softmax attention with NumPy-style semantics:
CUDA kernels compiled at run time for CuPy arrays, a blocked CPU implementation of the same
algorithm for NumPy arrays. ``cuflash.reference.attention`` is the float64 oracle with the
same signature.
``cuflash.attention_backward`` and ``cuflash.attention_vjp`` give the gradients (FlashAttention-2
backward, recomputing the probabilities from the stored log-sum-exp);
``cuflash.reference.attention_backward`` is their float64 oracle.
Modifiers (``window``, ``softcap``, ``alibi_slopes``, ``sink``, ``bias``, ``mask``, ``score_mod``,
``mask_mod``, ``block_mask``) are keywords of all of them; ``cuflash.captured`` wraps an array a
``score_mod`` / ``mask_mod`` reads, ``cuflash.block_mask`` precomputes a mask_mod's tile map.
"""

from cuflash import reference
from cuflash._api import attention, attention_backward, attention_vjp
from cuflash._block_mask import block_mask
from cuflash._captured import captured

__all__ = ["attention", "attention_backward", "attention_vjp", "block_mask", "captured",
           "reference"]
__version__ = "0.1.0"
