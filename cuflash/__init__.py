"""cuflash: FlashAttention for CuPy (and NumPy) users.

``cuflash.attention(q, k, v)`` computes exact softmax attention with NumPy-style semantics:
CUDA kernels compiled at run time for CuPy arrays, a blocked CPU implementation of the same
algorithm for NumPy arrays. ``cuflash.reference.attention`` is the float64 oracle with the
same signature.
``cuflash.attention_backward`` and ``cuflash.attention_vjp`` give the gradients (FlashAttention-2
backward, recomputing the probabilities from the stored log-sum-exp);
``cuflash.reference.attention_backward`` is their float64 oracle.
Arrays of other frameworks (PyTorch, JAX, Numba: anything with ``__dlpack__`` or
``__cuda_array_interface__``) are taken without a copy; results are CuPy (GPU) or NumPy (CPU)
arrays. ``enable_gqa=True`` accepts grouped-query attention in the 4-D layout.
``cuflash.explain(q, k, v, ...)`` says which kernel a call runs, with which tiles, and why.
Modifiers (``window``, ``softcap``, ``alibi_slopes``, ``sink``, ``bias``, ``mask``, ``score_mod``,
``mask_mod``, ``block_mask``) are keywords of all of these; ``cuflash.captured`` wraps an array a
``score_mod`` / ``mask_mod`` reads, ``cuflash.block_mask`` precomputes a mask_mod's tile map.
The user guide is docs/guide.md.
"""

from cuflash import reference
from cuflash._api import attention, attention_backward, attention_vjp, explain
from cuflash._block_mask import block_mask
from cuflash._captured import captured
from cuflash._inference import attention_with_kvcache, merge_states
from cuflash._varlen import attention_varlen, attention_varlen_vjp

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_vjp",
           "attention_vjp", "attention_with_kvcache", "block_mask", "captured", "explain",
           "merge_states", "reference"]
__version__ = "0.1.0"
