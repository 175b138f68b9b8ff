"""The validation pass: :func:`make_problem` turns q, k, v and the keyword options into a
:class:`Problem`, layout first, then the options.

Per-call cost. A call on NumPy or CuPy arrays whose options are plain values (no array
options) is validated once per signature: the arrays' shapes and dtypes and each option's
name, type and value. Later calls with the same signature reuse the validated fields with
their own arrays (:func:`known_problem`); anything else, and every invalid call, takes the
full path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from .layout import check_layout
from .model import Problem
from .options import ARRAY_OPTIONS, OPTION_DEFAULTS, check_backend, check_options, with_defaults


def make_problem(q: Any, k: Any, v: Any, options: dict[str, Any], xp: Any = np) -> Problem:
    """Validate ``q``, ``k``, ``v`` and the keyword ``options`` once.

    ``xp`` is the array module of q, k, v (NumPy or CuPy): array options are
    broadcast with it. Unknown option names raise TypeError.
    """
    o = with_defaults(options)
    backend = check_backend(o["backend"])
    lay = check_layout(q, k, v, o)
    fields = {f.name: getattr(lay, f.name) for f in dataclasses.fields(lay)}
    return Problem(dtype=np.dtype(q.dtype), backend=backend, **fields, **check_options(o, lay, xp))


#: Problem fields that a signature determines: all but the arrays q, k, v.
_SIGNED_FIELDS = tuple(f.name for f in dataclasses.fields(Problem) if f.name not in ("q", "k", "v"))
#: Option value types whose equal values of one type always validate alike.
_PLAIN_TYPES = frozenset({type(None), bool, int, float, str})
_ARRAY_OPTION_NAMES = frozenset(ARRAY_OPTIONS)
_NOT_AN_OPTION = object()


def _signature(q: Any, k: Any, v: Any, options: dict[str, Any]) -> tuple | None:
    """Everything :func:`make_problem` reads of NumPy or CuPy arrays ``q``, ``k``, ``v`` and
    ``options``: the arrays' shapes and dtypes, then :func:`option_signature`. None when an
    option is not plain data: such calls are validated in full."""
    signed = option_signature(options)
    return None if signed is None else (q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, *signed)


def option_signature(options: dict[str, Any]) -> tuple | None:
    """Everything :func:`make_problem` reads of keyword ``options``: each option's name,
    value and type (a float's sign too, as -0.0 == 0.0; a tuple's element types), or its bare
    name when it is None (nothing when it is the very object of its default). None when an
    option is not plain data (an array option given, a list, a NumPy scalar)."""
    key: list[Any] = []
    for name, value in options.items():
        if value is None:  # most options of most calls: the bare name
            key.append(name)
            continue
        if value is OPTION_DEFAULTS.get(name, _NOT_AN_OPTION):  # validates as if left out
            continue
        if name in _ARRAY_OPTION_NAMES:  # given as an array, a number or a tuple: validated in full
            return None
        kind = type(value)
        if kind is float:
            key.append((name, value, kind, math.copysign(1.0, value)))
        elif kind in _PLAIN_TYPES:
            key.append((name, value, kind))
        elif kind is tuple and all(type(x) in _PLAIN_TYPES for x in value):
            key.append((name, value, kind, tuple(type(x) for x in value)))
        else:
            return None
    return tuple(key)


@functools.lru_cache(maxsize=256)
def _validated(signature: tuple) -> dict[str, Any]:
    """The fields (all but q, k, v) of :func:`make_problem`'s problem for a :func:`_signature`,
    found once: by validating stand-in host arrays of its shapes and dtypes (zero-stride
    views: make_problem reads nothing else of q, k, v) and its options."""
    standins = [np.broadcast_to(np.zeros((), dtype), shape) for shape, dtype in zip(signature[0:6:2], signature[1:6:2])]
    options = dict((item, None) if type(item) is str else item[:2] for item in signature[6:])
    problem = make_problem(*standins, options)
    return {name: getattr(problem, name) for name in _SIGNED_FIELDS}


def known_problem(q: Any, k: Any, v: Any, options: dict[str, Any]) -> Problem | None:
    """The problem of NumPy or CuPy arrays ``q``, ``k``, ``v`` (on one device) and plain
    ``options``, validated once per signature; None when the options are not plain data or
    the call is invalid, for the full path to validate (and raise the caller's error)."""
    signature = _signature(q, k, v, options)
    if signature is None:
        return None
    try:
        fields = _validated(signature)
    except Exception:  # noqa: BLE001 - invalid: the full path raises the error naming the caller's arrays
        return None
    if fields["squeeze_head"]:
        q, k, v = q[None], k[None], v[None]
    # As Problem(q=q, k=k, v=v, **fields), which would set its 32 frozen fields one by one
    # through object.__setattr__: several times the cost of the rest of a cached call.
    problem = object.__new__(Problem)
    problem.__dict__.update(q=q, k=k, v=v, **fields)
    return problem

