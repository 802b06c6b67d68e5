"""Turning caller objects (bytes-likes, numpy arrays, CPU torch tensors) into byte views."""

from __future__ import annotations

import numpy as np

from kvstore.errors import InvalidArgument


def _is_torch(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "torch"


_U8 = np.dtype(np.uint8)


def _flat_u8(obj, writable: bool) -> bool:
    """Is `obj` already a 1-D contiguous uint8 array (writable, where asked)? The common
    case, checked in a third of the general path's time: a batch checks each buffer."""
    if type(obj) is np.ndarray and obj.dtype is _U8 and obj.ndim == 1:
        flags = obj.flags
        return flags.c_contiguous and (flags.writeable or not writable)
    return False


def as_u8(data) -> np.ndarray:
    """A flat uint8 view of `data` (no copy when it is already contiguous)."""
    if _flat_u8(data, writable=False):
        return data
    if _is_torch(data):
        if data.device.type != "cpu":
            raise InvalidArgument(f"tensor is on {data.device}; the host tier takes CPU tensors (move it with .cpu())")
        flat = data.detach().contiguous().reshape(-1)
        return flat.view(dtype=__import__("torch").uint8).numpy()
    if isinstance(data, np.ndarray):
        _refuse_references(data)
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    except TypeError:
        raise InvalidArgument(
            f"cannot store a {type(data).__name__}; pass bytes, a buffer, a numpy array or a CPU tensor"
        ) from None


def _refuse_references(array: np.ndarray) -> None:
    """An array of Python objects holds pointers, not state: numpy's own refusal to view it
    as bytes is a bare TypeError."""
    if array.dtype.hasobject:
        raise InvalidArgument(f"cannot store or fill a numpy array of dtype {array.dtype} (Python objects); "
                              "pass an array of numbers")


def as_writable_u8(out) -> np.ndarray:
    """A flat, writable uint8 view of a caller's output buffer."""
    if _flat_u8(out, writable=True):
        return out
    if _is_torch(out):
        if out.device.type != "cpu" or not out.is_contiguous():
            raise InvalidArgument("get_into needs a contiguous CPU tensor")
        return out.reshape(-1).view(dtype=__import__("torch").uint8).numpy()
    if isinstance(out, np.ndarray):
        _refuse_references(out)
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgument("get_into needs a contiguous, writable numpy array")
        return out.reshape(-1).view(np.uint8)
    try:
        view = memoryview(out).cast("B")
    except TypeError:
        raise InvalidArgument(f"cannot write into a {type(out).__name__}") from None
    if view.readonly:
        raise InvalidArgument("get_into needs a writable buffer (bytes is read-only; use bytearray)")
    return np.frombuffer(view, dtype=np.uint8)
