"""Tensor maps for Hopper's tensor copies (kernels_cu/tma.cuh), encoded by the CUDA driver.

A tensor map is 128 opaque bytes describing a global tensor (address, sizes, byte strides) and
the box one copy moves; kernels take it as a by-value parameter. CuPy does not wrap the
driver's encoder, so it is called through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Sequence

#: CUtensorMapDataType: 16-bit elements are copied as raw 16-bit words.
UINT16 = 1
#: CUtensorMapSwizzle.
SWIZZLE_128B = 3
#: CUtensorMapL2promotion: L2 fetches 128-byte lines.
L2_PROMOTION_128B = 2
#: Bytes of one encoded map.
MAP_BYTES = 128


class TensorMapError(RuntimeError):
    """The driver refused a tensor map (sizes, strides or alignment it does not support)."""


@functools.cache
def _encoder() -> ctypes._CFuncPtr:
    library = ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")
    encode = library.cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    return encode


class TiledLayout:
    """Tensor maps of one shape: sizes ``dims`` (elements, innermost first), ``strides`` (bytes,
    of dims 1 onwards: len(dims) - 1 of them) and copies of ``box`` elements (innermost
    first); outside the tensor a copy reads zeros. The driver's arguments are built once;
    :meth:`encode` makes the map of a tensor at one address."""

    def __init__(self, dims: Sequence[int], strides: Sequence[int], box: Sequence[int], data_type: int = UINT16,
                 swizzle: int = SWIZZLE_128B) -> None:
        rank = len(dims)
        if len(strides) != rank - 1 or len(box) != rank:
            raise ValueError(f"a rank-{rank} tensor map takes {rank - 1} strides and {rank} box sizes, "
                             f"got {len(strides)} and {len(box)}")
        self.described = f"dims {tuple(dims)}, byte strides {tuple(strides)}, box {tuple(box)}"
        self._fixed = ((ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
                       (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)))
        self._head = (ctypes.c_int(data_type), ctypes.c_uint32(rank))
        self._tail = (ctypes.c_int(0), ctypes.c_int(swizzle), ctypes.c_int(L2_PROMOTION_128B), ctypes.c_int(0))

    def encode(self, address: int) -> ctypes.Array:
        """The 128-byte map (a ctypes array) of the tensor at ``address``; raises
        :class:`TensorMapError` with the driver's code where it refuses."""
        room = (ctypes.c_uint8 * (MAP_BYTES + 64))()  # the driver writes a map to a 64-byte boundary
        at = -ctypes.addressof(room) % 64
        code = _encoder()(ctypes.c_void_p(ctypes.addressof(room) + at), *self._head, ctypes.c_void_p(address),
                          *self._fixed, *self._tail)
        if code != 0:
            raise TensorMapError(f"cuTensorMapEncodeTiled refused {self.described} at 0x{address:x} "
                                 f"(CUresult {code})")
        return (ctypes.c_uint8 * MAP_BYTES).from_buffer_copy(room, at)


def strides_for(dims: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Byte strides of dims 1 onwards that the driver accepts for the same addresses: a dim of
    size 1 is only ever at coordinate 0, so its stride (which an array may give as anything)
    becomes the largest stride rounded up to 16 bytes."""
    spare = max(16, -(-max(strides, default=16) // 16) * 16)
    return tuple(stride if size > 1 else spare for size, stride in zip(dims[1:], strides))
