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


def test_keys_leave_out_dropout_array_options_and_other_kinds() -> None:
    table = calls.Calls(_Kind())
    q, k, v = _arrays()
    assert table.key(q, k, v, {"causal": True}) is not None
    assert table.key(q, k, v, {"dropout_p": 0.1, "seed": 3}) is None
    assert table.key(q, k, v, {"mask": np.ones((5, 5), bool)}) is None
    assert table.key(q, k, v, {"scale": np.float64(0.5)}) is None  # not plain data: validated in full
    assert table.key(q.tolist(), k, v, {}) is None
    assert table.key(q, k, v, {"dropout_p": 0.0}) is not None


def test_keys_hold_layout_alignment_option_types_and_extras() -> None:
    table = calls.Calls(_Kind())
    q, k, v = _arrays()
    base = table.key(q, k, v, {"causal": True}, False)
    assert base == table.key(*_arrays(), {"causal": True}, False)
    different = [
        table.key(q, k, v, {"causal": 1}, False),  # 1 == True, but only True validates
        table.key(q, k, v, {"causal": True}, True),
        table.key(q, k, v, {"scale": -0.0}, False),
        table.key(np.asfortranarray(q), k, v, {"causal": True}, False),
        table.key(q.astype(np.float64), k, v, {"causal": True}, False),
        table.key(np.frombuffer(np.zeros(q.size * 4 + 4, np.uint8), np.float32, q.size, 4).reshape(q.shape), k, v,
                  {"causal": True}, False),  # 4-byte aligned address
    ]
    assert table.key(q, k, v, {"scale": 0.0}, False) != different[2]
    assert len({base, *different}) == len(different) + 1


def test_entries_are_kept_once_bounded_and_only_for_the_current_device() -> None:
    kind = _Kind()
    table = calls.Calls(kind, size=2)
    q, k, v = _arrays()
    keys = [table.key(q, k, v, {"scale": s}) for s in (1.0, 2.0, 3.0)]
    plan = cuda.CallPlan(_Launches(), (((2, 3, 5, 8), np.dtype(np.float32), True),), 0, (), (False,) * 3, (0, 1, 2, 3))
    made = []
    table.learn(keys[0], 0, lambda: made.append(0) or plan)
    table.learn(keys[0], 0, lambda: made.append(1) or plan)
    assert made == [0] and table.knows(keys[0]) and table.get(keys[0]).forward_plan is plan
    kind.device = 1
    assert table.get(keys[0]) is None  # a plan launches on its own device only
    kind.device = 0
    table.learn(keys[1], 0, lambda: None)  # not planned: stays on the full path
    assert table.knows(keys[1]) and table.get(keys[1]) is None
    table.learn(keys[2], 0, lambda: plan)
    assert not table.knows(keys[0]) and table.knows(keys[2])
    assert table.get(None) is None and table.knows(None)


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
