"""Arrays from any framework, without a copy: :func:`as_array`.

cuflash computes on two array types: ``numpy.ndarray`` (the CPU path) and ``cupy.ndarray``
(the CUDA kernels). Every public function passes each array argument through
:func:`as_array` once, at its top, so arrays of other frameworks are accepted as zero-copy
views of the same memory:

- ``numpy.ndarray`` and ``cupy.ndarray``: used as they are (a NumPy masked array is refused:
  its mask would be silently ignored).
- An object with ``__dlpack__`` (PyTorch, JAX, CuPy, NumPy, TensorFlow, ...): a GPU tensor
  becomes a ``cupy.ndarray`` (``cupy.from_dlpack``, CuPy >= 14 for bfloat16), a CPU tensor a
  ``numpy.ndarray`` (``numpy.from_dlpack``; bfloat16, which NumPy's DLPack importer does not
  know, is imported as uint16 and viewed as ``ml_dtypes.bfloat16``).
- An object with ``__cuda_array_interface__`` (Numba device arrays, ...): ``cupy.asarray``.
- An object with ``__array_interface__`` or ``__array_struct__``: ``numpy.asarray``.

Anything else (lists, scalars, objects with only ``__array__``, which may copy) is a
TypeError. Results are NumPy or CuPy arrays; the way back is one line (``torch.from_dlpack(o)``,
``jax.dlpack.from_dlpack(o)``), documented in docs/guide.md. Returning the caller's own array
type was considered and left out: it would need each framework's import and rules here, and
the one line above does it without a copy.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import ml_dtypes
import numpy

# DLPack device types (dlpack.h, DLDeviceType)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
# DLPack dtype codes (DLDataTypeCode)
_DL_UINT, _DL_BFLOAT = 1, 4


def _type_name(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _cupy_for(x: Any, name: str) -> Any:
    try:
        import cupy
    except ImportError as e:
        raise TypeError(f"{name} is a GPU array ({_type_name(x)}) but CuPy cannot be imported "
                        f"({e}); install cuflash[cuda13] or cuflash[cuda12]") from None
    return cupy


class _Bfloat16AsUint16:
    """A DLPack producer that re-labels a CPU bfloat16 tensor of ``x`` as uint16.

    ``numpy.from_dlpack`` refuses bfloat16 (NumPy has no such dtype); the bits are the same
    16-bit words, so the capsule's dtype field is rewritten to uint16 before NumPy reads it and
    the result is viewed as ``ml_dtypes.bfloat16``. NumPy then owns the capsule as usual (it
    calls the producer's deleter when the array dies): no copy, no leak.
    """

    def __init__(self, x: Any):
        self._x = x

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._x.__dlpack_device__()

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        # Ask the producer for what NumPy's importer asked for: a NumPy that reads DLPack 1.0
        # (versioned capsules, with the read-only flag, so writes are allowed) passes
        # max_version; an older one (< 2.1) passes nothing and could not read a versioned one.
        capsule = None
        for ask in (kwargs, {k: kwargs[k] for k in ("max_version",) if k in kwargs}, {}):
            try:
                capsule = self._x.__dlpack__(**ask)
                break
            except TypeError:      # an older producer without some of these keywords
                if not ask:
                    raise
        api = ctypes.pythonapi
        api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = \
            ctypes.c_char_p, [ctypes.py_object]
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        name = api.PyCapsule_GetName(capsule)
        # DLManagedTensor starts with its DLTensor; DLManagedTensorVersioned has a version
        # (2 x uint32), manager_ctx, deleter and uint64 flags (32 bytes) before it.
        offset = {b"dltensor": 0, b"dltensor_versioned": 32}.get(name)
        if offset is None:
            raise BufferError(f"unknown DLPack capsule {name!r}")
        tensor = api.PyCapsule_GetPointer(capsule, name) + offset
        # DLTensor: void* data (8 bytes), DLDevice (2 x int32), int32 ndim, then DLDataType
        # {uint8 code, uint8 bits, uint16 lanes} at byte 20.
        dtype = (ctypes.c_uint8 * 4).from_address(tensor + 20)
        if (dtype[0], dtype[1]) != (_DL_BFLOAT, 16):
            raise BufferError("not a bfloat16 tensor")
        dtype[0] = _DL_UINT
        return capsule


def _from_cpu_dlpack(x: Any, name: str) -> numpy.ndarray:
    a = _read_cpu_dlpack(x, name)
    if name == "out" and not a.flags.writeable:
        # NumPy < 2.2 imports every DLPack array read-only; a newer one only a read-only tensor
        old = numpy.lib.NumpyVersion(numpy.__version__) < "2.2.0"
        raise ValueError(f"out ({_type_name(x)}) came through DLPack read-only" + (
            f": NumPy {numpy.__version__} imports every DLPack array read-only (NumPy >= 2.2 "
            f"imports writeable ones); upgrade NumPy or pass a numpy.ndarray as out"
            if old else ""))
    return a


def _read_cpu_dlpack(x: Any, name: str) -> numpy.ndarray:
    try:
        return numpy.from_dlpack(x)
    except (BufferError, TypeError, ValueError, RuntimeError) as first:
        # bfloat16 is the one dtype cuflash supports that NumPy's importer does not know
        if "bfloat16" not in str(getattr(x, "dtype", "")):
            raise TypeError(f"{name} ({_type_name(x)}) cannot be read through DLPack: "
                            f"{first}") from None
    try:
        return numpy.from_dlpack(_Bfloat16AsUint16(x)).view(ml_dtypes.bfloat16)
    except (BufferError, TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name} ({_type_name(x)}) cannot be read through DLPack: {e}") from None


def as_array(x: Any, name: str) -> Any:
    """``x`` as a ``numpy.ndarray`` or ``cupy.ndarray`` sharing its memory (never a copy).

    See the module docstring for what is accepted. Raises TypeError, naming ``name`` and the
    type of ``x``, for anything else, for NumPy masked arrays, and for a DLPack tensor on a
    device other than the CPU or a CUDA GPU.
    """
    if isinstance(x, numpy.ndarray):
        if isinstance(x, numpy.ma.MaskedArray):
            raise TypeError(f"{name} is a numpy.ma.MaskedArray: cuflash would ignore its mask; "
                            f"pass {name}.filled(value) or {name}.data if that is meant "
                            f"(causal= covers causal masks)")
        return x
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, numpy.generic):  # a NumPy scalar has __array_interface__, but is no array
        pass
    elif hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        try:
            device_type = int(x.__dlpack_device__()[0])
        except Exception as e:
            raise TypeError(f"{name} ({_type_name(x)}) has __dlpack__ but its "
                            f"__dlpack_device__() failed: {e}") from None
        if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
            cupy = _cupy_for(x, name)
            try:
                return cupy.from_dlpack(x)  # on CuPy's current stream (DLPack's stream rule)
            except Exception as e:  # e.g. PyTorch: "Can't export tensors that require gradient"
                raise TypeError(f"{name} ({_type_name(x)}) cannot be read through DLPack: "
                                f"{e}") from None
        if device_type in (_DL_CPU, _DL_CUDA_HOST):
            return _from_cpu_dlpack(x, name)
        raise TypeError(f"{name} ({_type_name(x)}) is on DLPack device type {device_type}; "
                        f"cuflash computes on the CPU (1) or a CUDA GPU (2)")
    elif hasattr(x, "__cuda_array_interface__"):
        return _cupy_for(x, name).asarray(x)  # zero copy: CuPy wraps the pointer
    elif hasattr(x, "__array_interface__") or hasattr(x, "__array_struct__"):
        result = numpy.asarray(x)
        return as_array(result, name)  # a masked array can come back from asarray's subclasses
    raise TypeError(
        f"{name} must be a numpy.ndarray or cupy.ndarray, got {_type_name(x)} (arrays of "
        f"other frameworks are taken through __dlpack__, __cuda_array_interface__ or "
        f"__array_interface__; convert lists and scalars with numpy.asarray)"
    )


def _split_axis(x: Any, axis: int, parts: tuple[int, int]) -> Any:
    """A view of ``x`` with axis ``axis`` (negative) split into ``parts``; never a copy."""
    xp = numpy if isinstance(x, numpy.ndarray) else sys.modules["cupy"]
    stride = x.strides[axis]
    at = x.ndim + axis
    shape = x.shape[:at] + parts + x.shape[at + 1:]
    strides = x.strides[:at] + (parts[1] * stride, stride) + x.strides[at + 1:]
    return xp.lib.stride_tricks.as_strided(x, shape, strides)


class Call:
    """The array arguments of one public call, as NumPy or CuPy arrays in the 5-D layout.

    ``Call(q, k, v, enable_gqa, do=..., o=..., lse=..., out=...)`` passes every array through
    :func:`as_array` (zero-copy views of PyTorch, JAX, ... arrays). With ``enable_gqa=True`` it
    then views q ``(..., Hq, Lq, d)`` with k, v ``(..., Hkv, Lk, d)`` as the broadcast form
    q ``(..., Hkv, G, Lq, d)``, k, v ``(..., Hkv, 1, Lk, d)`` (``G = Hq // Hkv``; query head
    ``h`` uses key/value head ``h // G``, as PyTorch's ``enable_gqa``); do, o and out like q,
    lse ``(..., Hq, Lq)`` as ``(..., Hkv, G, Lq)``. :meth:`output`, :meth:`lse_out` and
    :meth:`gradients` map results back to the 4-D shapes (views). Other arguments (None
    included) pass through untouched.
    """

    def __init__(self, q: Any, k: Any, v: Any, enable_gqa: Any = False, **others: Any):
        if not isinstance(enable_gqa, (bool, numpy.bool_)):
            raise TypeError(f"enable_gqa must be a bool, got {enable_gqa!r}")
        arrays = {"q": as_array(q, "q"), "k": as_array(k, "k"), "v": as_array(v, "v")}
        for name, x in others.items():
            arrays[name] = None if x is None else as_array(x, name)
        self.given = dict(arrays)  # as NumPy/CuPy, before any GQA view
        self.gqa = bool(enable_gqa)
        if self.gqa:
            self._to_gqa(arrays)
        for name, x in arrays.items():
            setattr(self, name, x)

    def _to_gqa(self, arrays: dict) -> None:
        q, k, v = arrays["q"], arrays["k"], arrays["v"]
        for name in "qkv":
            if arrays[name].ndim < 3:
                raise ValueError(f"enable_gqa=True needs (..., heads, length, head_dim) "
                                 f"inputs, got {name}.shape={arrays[name].shape}")
        hq, hkv = q.shape[-3], k.shape[-3]
        if v.shape[-3] != hkv:
            raise ValueError(f"k and v must have the same number of heads under "
                             f"enable_gqa=True: {k.shape=} and {v.shape=}")
        if hkv == 0 or hq % hkv:
            raise ValueError(f"enable_gqa=True needs the query heads Hq={hq} to be a multiple "
                             f"of the key/value heads Hkv={hkv}: {q.shape=}, {k.shape=}")
        self.heads = (hkv, hq // hkv)
        arrays["q"] = _split_axis(q, -3, self.heads)
        arrays["k"], arrays["v"] = k[..., None, :, :], v[..., None, :, :]
        for name, x in arrays.items():
            if name in "qkv" or x is None:
                continue
            axis = -2 if name == "lse" else -3
            if x.ndim < -axis or x.shape[axis] != hq:
                raise ValueError(f"{name}.shape={x.shape} must have q's {hq} heads at axis "
                                 f"{axis} under enable_gqa=True ({q.shape=})")
            arrays[name] = _split_axis(x, axis, self.heads)

    def _merge(self, x: Any, axis: int) -> Any:
        """Undo ``_split_axis`` on a result (C-contiguous when new: a view)."""
        if not self.gqa:
            return x
        at = x.ndim + axis - 1
        return x.reshape(x.shape[:at] + (x.shape[at] * x.shape[at + 1],) + x.shape[at + 2:])

    def output(self, o: Any) -> Any:
        """The attention output in the caller's layout (``out`` itself when one was given)."""
        out = getattr(self, "out", None)
        if out is not None and o is out:
            return self.given["out"]
        return self._merge(o, -3)

    def lse_out(self, lse: Any) -> Any:
        return self._merge(lse, -2)

    def gradients(self, dq: Any, dk: Any, dv: Any) -> tuple[Any, Any, Any]:
        """dq, dk, dv in the shapes of q, k, v as given (views of the results)."""
        if not self.gqa:
            return dq, dk, dv
        return tuple(g.reshape(self.given[n].shape) for g, n in ((dq, "q"), (dk, "k"), (dv, "v")))
