"""One validated, normalised description of an attention call.

Every public function funnels its arguments through :func:`make_problem` (and
:func:`check_backward_arrays` for gradients). This is the single place where bad
input becomes a :class:`TypeError` or :class:`ValueError` that names the
argument, what was expected and what was received; the backends and the
reference trust a :class:`Problem` without checking again.

One module per concern, each readable at once:

- ``model``: :class:`Layout`, :class:`Problem` (a layout and its options), :class:`Segment`
  and the dtype rules;
- ``validate``: checks shared by every argument (array, dtype, broadcasting, ranges);
- ``layout``: shapes of q, k, v, batch, heads, head dims, the packed (varlen) frame;
- ``options``: every keyword option normalised (causal, window, masks, bias, ALiBi,
  lengths, block mask, dropout);
- ``build``: :func:`make_problem` and its per-signature cache;
- ``arrays``: host (CPU backend) and device (CUDA backend) arrays of a problem;
- ``backward``: the backward's dout, out and lse against the forward's problem.
"""

from .arrays import DEVICE_ARRAY_OPTIONS, device_array, make_device_problem, make_host_problem
from .backward import check_backward_arrays, check_device_backward_arrays, check_host_backward_arrays
from .build import _signature, _validated, known_problem, make_problem, option_signature
from .layout import check_cu_seqlens, check_layout
from .model import FLOAT_DTYPES, MAX_HEAD_DIM, Layout, Problem, Segment, accumulator_dtype, dtype_name, lse_dtype
from .options import (
    ARRAY_OPTIONS, BACKENDS, CAUSAL_MODES, INT32_LIST_OPTIONS, OPTION_DEFAULTS, check_causal, check_dropout,
    check_options, check_window,
)

__all__ = [
    "ARRAY_OPTIONS", "BACKENDS", "CAUSAL_MODES", "DEVICE_ARRAY_OPTIONS", "FLOAT_DTYPES", "INT32_LIST_OPTIONS",
    "Layout", "MAX_HEAD_DIM", "OPTION_DEFAULTS", "Problem", "Segment", "accumulator_dtype",
    "check_backward_arrays", "check_causal", "check_cu_seqlens", "check_device_backward_arrays", "check_dropout",
    "check_host_backward_arrays", "check_layout", "check_options", "check_window", "device_array", "dtype_name",
    "known_problem", "lse_dtype", "make_device_problem", "make_host_problem", "make_problem", "option_signature",
]
