"""flashcupy.calls: which calls are planned, and what a planned call allocates and launches.

These run without a GPU through a stand-in array kind (NumPy arrays, launches recorded);
tests/test_host_path.py and tests/test_torch.py run planned calls on the GPU against the
full path.
"""

from __future__ import annotations

import numpy as np

from flashcupy import calls, cuda


class _Kind(calls.Kind):
    """NumPy arrays on a pretend device 0; records the streams asked for."""

    def __init__(self) -> None:
        self.device = 0

    def layout(self, x):
        if not isinstance(x, np.ndarray):
            return None
        return x.shape, x.strides, x.dtype, 0, x.__array_interface__["data"][0] % 16 == 0

    def current_device(self):
        return self.device

    def stream(self, device):
        return 1234

    def empty(self, shape, dtype, poisoned, device):
        return np.full(shape, np.nan, dtype) if poisoned else np.zeros(shape, dtype)

    def address(self, x):
        return x.__array_interface__["data"][0]

    def shape(self, x):
        return x.shape

    def strides(self, x):
        return tuple(s // x.itemsize for s in x.strides)

    def copy(self, x):
        return np.array(x, order="C", copy=True)


class _Launches:
    """A stand-in LaunchPlan: records each run's stream and pointers."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, tuple[int, ...]]] = []

    def run(self, stream, *pointers):
        self.runs.append((stream, pointers))


def _arrays(shape=(2, 3, 5, 8), n=3):
    return [np.random.default_rng(i).standard_normal(shape).astype(np.float32) for i in range(n)]


class _LengthPlan:
    """A stand-in LengthPlan: takes lengths up to 64, records runs."""

    head_dim_v, dtype, lse_dtype = 8, np.dtype(np.float32), np.dtype(np.float32)

    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def takes(self, q_shape, k_shape, v_shape, *strides):
        return k_shape[2] == v_shape[2] <= 64 and all(s[3] == 1 for s in strides)

    def run(self, stream, pointers, lq, lk, *strides):
        self.runs.append((stream, pointers, lq, lk, strides))


def _plans(monkeypatch, made: list) -> None:
    """cuda.forward_plan and length_plan as stand-ins recording the problems they plan."""
    plan = cuda.CallPlan(_Launches(), (((2, 3, 5, 8), np.dtype(np.float32), True),), 0, (), (False,) * 3,
                         (0, 1, 2, 3))
    monkeypatch.setattr(cuda, "forward_plan", lambda pb: made.append(("exact", pb)) or plan)
    monkeypatch.setattr(cuda, "length_plan", lambda pb: made.append(("lengths", pb)) or _LengthPlan())


def test_keys_leave_out_dropout_array_options_and_other_kinds() -> None:
    table = calls.Calls(_Kind())
    q, k, v = _arrays()
    assert table.find(q, k, v, {"causal": True})[0] is not None
    assert table.find(q, k, v, {"dropout_p": 0.1, "seed": 3}) == (None, None)
    assert table.find(q, k, v, {"mask": np.ones((5, 5), bool)}) == (None, None)
    assert table.find(q, k, v, {"scale": np.float64(0.5)}) == (None, None)  # not plain data: validated in full
    assert table.find(q.tolist(), k, v, {}) == (None, None)
    assert table.find(q, k, v, {"dropout_p": 0.0})[0] is not None
    assert table.find(q, k, v, {"sinks": 0.5}) == (None, None)  # an array option: never planned
    assert table.find(q, k, v, {"window": (2, 3)})[0][1] is None  # clamped to the lengths: exact keys only
    assert table.find(q[0], k[0], v[0], {})[0][1] is None  # 3-D: exact keys only


def test_keys_hold_layout_alignment_option_types_and_extras() -> None:
    table = calls.Calls(_Kind())
    q, k, v = _arrays()

    def keys(*arrays, options=None, extra=False):
        return table.find(*arrays, {"causal": True} if options is None else options, extra)[0]

    base = keys(q, k, v)
    assert base == keys(*_arrays())
    different = [
        keys(q, k, v, options={"causal": 1}),  # 1 == True, but only True validates
        keys(q, k, v, extra=True),
        keys(q, k, v, options={"scale": -0.0}),
        keys(q.astype(np.float64), k, v),
        keys(np.frombuffer(np.zeros(q.size * 4 + 4, np.uint8), np.float32, q.size, 4).reshape(q.shape), k, v),
    ]
    assert keys(q, k, v, options={"scale": 0.0}) != different[2]
    assert len({base, *different}) == len(different) + 1
    assert len({x[1] for x in [base, *different]}) == len(different) + 1  # the length-free keys too
    longer = keys(*_arrays((2, 3, 9, 8)))
    assert longer[0] != base[0] and longer[1] == base[1]  # another length: the same length-free key
    assert keys(np.asfortranarray(q), k, v)[1] == base[1]  # strides: not in the length-free key


def test_entries_are_kept_once_bounded_and_only_for_the_current_device(monkeypatch) -> None:
    made: list = []
    _plans(monkeypatch, made)
    kind = _Kind()
    table = calls.Calls(kind, size=2)
    q, k, v = _arrays()
    found = [table.find(q, k, v, {"scale": s}) for s in (1.0, 2.0, 3.0)]
    assert all(entry is None for _, entry in found)
    table.learn(found[0][0], 0, lambda: "pb0")
    table.learn(found[0][0], 0, lambda: "again")
    assert made == [("exact", "pb0"), ("lengths", "pb0")]
    entry = table.find(q, k, v, {"scale": 1.0})[1]
    assert isinstance(entry, calls.Planned) and entry.device == 0
    kind.device = 1
    assert table.find(q, k, v, {"scale": 1.0})[1] is None  # a plan launches on its own device only
    kind.device = 0
    table.learn(found[1][0], 0, lambda: None)  # another backend ran it: left to the full path
    assert table.find(q, k, v, {"scale": 2.0})[1] is None
    table.learn(found[2][0], 0, lambda: "pb2")
    assert table.find(q, k, v, {"scale": 1.0})[1] is None  # the oldest went
    table.learn(None, 0, lambda: made.append("never"))
    assert "never" not in made


def test_other_lengths_run_the_length_plan_where_it_takes_them(monkeypatch) -> None:
    _plans(monkeypatch, [])
    kind = _Kind()
    table = calls.Calls(kind)
    q, k, v = _arrays()
    table.learn(table.find(q, k, v, {"causal": True})[0], 0, lambda: "pb")
    (q2,), (k2, v2) = _arrays((2, 3, 1, 8), n=1), _arrays((2, 3, 40, 8), n=2)
    entry = table.find(q2, k2, v2, {"causal": True})[1]
    assert isinstance(entry, calls.LengthPlanned)
    out, lse = entry.forward(q2, k2, v2)
    assert out.shape == (2, 3, 1, 8) and lse.shape == (2, 3, 1)
    (stream, pointers, lq, lk, strides), = entry.plan.runs
    assert pointers == tuple(kind.address(x) for x in (q2, k2, v2, out, lse)) and (lq, lk) == (1, 40)
    assert strides == tuple(kind.strides(x) for x in (q2, k2, v2))
    assert entry.backward(entry.backward_key(q2, out, lse), q2, q2, k2, v2, out, lse) is None
    too_long = _arrays((2, 3, 65, 8), n=2)
    assert table.find(q2, *too_long, {"causal": True})[1] is None  # the plan does not take it: the full path
    monkeypatch.setattr(cuda, "forward_plan", lambda pb: None)  # this layout left to the full path
    keys, _ = table.find(q2, k2, v2, {"causal": True})
    table.learn((keys[0], None), 0, lambda: "pb")
    assert table.find(q2, k2, v2, {"causal": True}) == ((keys[0], None), None)  # the length table not asked


def test_a_planned_call_fills_pointers_in_plan_order_and_copies_what_it_must(monkeypatch) -> None:
    kind = _Kind()
    q, k, v = _arrays()
    k_strided = np.asfortranarray(k)
    launches = _Launches()
    results = (((2, 3, 5, 8), np.dtype(np.float32), True), ((2, 3, 5), np.dtype(np.float32), False))
    plan = cuda.CallPlan(launches, results, 0, (), (False, True, True), (4, 0, -1, 1, 2, 3))
    planned = calls.Planned(kind, 0, plan)
    monkeypatch.setattr(cuda, "poison_outputs", True)
    out, lse = planned.forward(q, k_strided, v)
    assert out.shape == (2, 3, 5, 8) and np.isnan(out).all()  # poisoned result
    assert lse.shape == (2, 3, 5) and not np.isnan(lse).any()
    (stream, pointers), = launches.runs
    assert stream == 1234
    assert pointers[0] == kind.address(lse) and pointers[1] == kind.address(q) and pointers[2] == 0
    assert pointers[3] not in (kind.address(k_strided), 0)  # k went as a contiguous copy
    assert pointers[4] not in (kind.address(v), 0)  # v too, though contiguous: copies are fresh allocations
    assert pointers[5] == kind.address(out)


def test_backward_plans_are_kept_by_dout_layout_with_one_scratch_block() -> None:
    kind = _Kind()
    q, k, v, dout = _arrays(n=4)
    out, lse = np.zeros_like(q), np.zeros(q.shape[:-1], np.float32)
    launches = _Launches()
    plan = cuda.CallPlan(launches, tuple((x.shape, np.dtype(np.float32), False) for x in (q, k, v)), 3 * 256,
                         (0, 256, 512), (False,) * 6, tuple(range(12)))
    planned = calls.Planned(kind, 0, plan)
    key = planned.backward_key(dout, out, lse, False)
    assert planned.backward(key, dout, q, k, v, out, lse) is None and not planned.knows_backward(key)
    planned.learn_backward(key, lambda: plan)
    dq, dk, dv = planned.backward(key, dout, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    pointers = launches.runs[-1][1]
    assert pointers[:9] == tuple(kind.address(x) for x in (q, k, v, dout, out, lse, dq, dk, dv))
    assert pointers[10] - pointers[9] == 256 and pointers[11] - pointers[9] == 512
    broadcast = np.broadcast_to(dout[:1, :1, :1, :1], dout.shape)
    assert planned.backward_key(broadcast, out, lse, False) != key
    assert planned.backward_key(dout, out, lse, True) != key
    assert planned.backward_key(dout.tolist(), out, lse, False) is None
