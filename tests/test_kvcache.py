"""flash_attention_with_kvcache (contiguous and paged caches, the in-place append) and
merge_attention_states, against the float64 reference."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import flashcupy as fc

from support import BF16, F16, F32, F64, assert_rule, captured_replays


def _shared_prefix(k_cache: np.ndarray, v_cache: np.ndarray, lens: np.ndarray, block_size: int | None) -> list[int]:
    """The sequences whose first block is full before the call, all but the first made to hold
    the first's keys and values there (a shared prompt; call before the reference): a paged
    table maps them all to one physical block. Empty when fewer than two qualify."""
    if block_size is None:
        return []
    full = [s for s in range(len(lens)) if lens[s] >= block_size]
    if len(full) < 2:
        return []
    for cache in (k_cache, v_cache):
        cache[full[1:], :, :block_size] = cache[full[0], :, :block_size]
    return full


def _paged(k_cache: np.ndarray, v_cache: np.ndarray, block_size: int, rs: np.random.Generator,
           shared: list[int] = ()):
    """Contiguous (B, Hk, Lmax, D / Dv) caches as paged ones, (num_blocks, Hk, block_size, D / Dv)
    in one shuffled block order with spare blocks of noise, and their (B, max_blocks) table;
    the ``shared`` sequences' first blocks are one physical block (see _shared_prefix)."""
    b, hk, lmax, _ = k_cache.shape
    per_seq = -(-lmax // block_size)
    order = rs.permutation(b * per_seq + 3)
    table = order[: b * per_seq].reshape(b, per_seq).astype(np.int32)
    table[list(shared[1:]), 0] = table[shared[0], 0] if shared else 0
    paged = []
    for cache in (k_cache, v_cache):
        pages = rs.standard_normal((len(order), hk, block_size, cache.shape[-1])).astype(cache.dtype)
        padded = np.zeros((b, hk, per_seq * block_size, cache.shape[-1]), cache.dtype)
        padded[:, :, :lmax] = cache
        for s in range(b):
            for n in range(per_seq):
                pages[table[s, n]] = padded[s, :, n * block_size : (n + 1) * block_size]
        paged.append(pages)
    return paged[0], paged[1], table


@st.composite
def decode_calls(draw, dtypes=(F16, F32, F64), groups=(1, 2, 4), lmax=(8, 70), dims=((8, 40, 64), (8, 24)),
                 window_left=9):
    dtype = draw(st.sampled_from(dtypes))
    batch, hk = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    hq = hk * draw(st.sampled_from(groups))
    lq, new, lmax = draw(st.integers(1, 5)), draw(st.integers(0, 4)), draw(st.integers(*lmax))
    d, dv = draw(st.sampled_from(dims[0])), draw(st.sampled_from(dims[1]))
    rs = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lens = rs.integers(0, lmax - new + 1, batch)
    options = {}
    if draw(st.booleans()):
        options["causal"] = True
    if draw(st.booleans()):
        options["window"] = (draw(st.integers(0, window_left)), draw(st.integers(0, 3)))
    if draw(st.booleans()):
        options["alibi_slopes"] = rs.uniform(0, 0.5, hq)
    if draw(st.booleans()):
        options["softcap"] = 5.0
    if draw(st.booleans()):
        options["sinks"] = rs.standard_normal(hq)
    block_size = draw(st.sampled_from([None, 1, 8, 16, 64]))
    arrays = [rs.standard_normal(shape).astype(dtype) for shape in
              ((batch, hq, lq, d), (batch, hk, lmax, d), (batch, hk, lmax, dv), (batch, hk, new, d),
               (batch, hk, new, dv))]
    return arrays, lens, block_size, options, rs


def _reference(q, k_cache, v_cache, k, v, lens, options):
    """Per sequence: the reference over its valid keys, then the new ones."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        keys = np.concatenate([k_cache[b, :, : lens[b]], k[b]], axis=1)
        values = np.concatenate([v_cache[b, :, : lens[b]], v[b]], axis=1)
        out, lse = fc.attention_reference(q[b], keys, values, return_lse=True, **options)
        outs.append(out)
        lses.append(lse)
    return np.stack(outs), np.stack(lses)


@settings(max_examples=40, deadline=None)
@given(decode_calls())
def test_kvcache_matches_the_reference_and_appends_in_place(call):
    (q, k_cache, v_cache, k, v), lens, block_size, options, rs = call
    shared = _shared_prefix(k_cache, v_cache, lens, block_size)
    before = (k_cache.copy(), v_cache.copy())
    ref_out, ref_lse = _reference(q, k_cache, v_cache, k, v, lens, options)
    if block_size is None:
        caches, table = (k_cache, v_cache), None
    else:
        *caches, table = _paged(k_cache, v_cache, block_size, rs, shared)
    new = k.shape[2]
    out, lse = fc.flash_attention_with_kvcache(q, *caches, k if new else None, v if new else None, cache_seqlens=lens,
                                               block_table=table, return_lse=True, backend="cpu", **options)
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == q.dtype
    assert_rule("out", out, ref_out, ref_out, q.dtype, 1.0)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    if block_size is None and new:  # written where the sequence continues, nowhere else
        for b in range(q.shape[0]):
            s = lens[b]
            np.testing.assert_array_equal(k_cache[b, :, s : s + new], k[b])
            np.testing.assert_array_equal(v_cache[b, :, s : s + new], v[b])
            np.testing.assert_array_equal(k_cache[b, :, :s], before[0][b, :, :s])
            np.testing.assert_array_equal(k_cache[b, :, s + new :], before[0][b, :, s + new :])


def _cache(rs, batch=2, hk=2, lmax=16, d=8, dtype=F32):
    return [rs.standard_normal(s).astype(dtype) for s in ((batch, 4, 1, d), (batch, hk, lmax, d), (batch, hk, lmax, d),
                                                           (batch, hk, 3, d), (batch, hk, 3, d))]


def test_overflowing_append_is_refused_before_writing():
    q, kc, vc, k, v = _cache(np.random.default_rng(0))
    before = kc.copy()
    with pytest.raises(ValueError, match="exceed the cache's capacity of 16 keys"):
        fc.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=[10, 14], backend="cpu")
    np.testing.assert_array_equal(kc, before)


@pytest.mark.parametrize("read_only", ["k_cache", "v_cache"])
def test_a_read_only_cache_is_refused_before_writing(read_only):
    """An append into a host cache that cannot be written is a ValueError naming it, raised
    before either cache is touched (the layout alone cannot tell: its key holds no flags)."""
    q, kc, vc, k, v = _cache(np.random.default_rng(4))
    fc.flash_attention_with_kvcache(q, kc.copy(), vc.copy(), k, v, cache_seqlens=[1, 2], backend="cpu")  # layout kept
    caches = {"k_cache": kc, "v_cache": vc}
    caches[read_only].flags.writeable = False
    before = [kc.copy(), vc.copy()]
    with pytest.raises(ValueError, match=f"{read_only}: expected a writable array"):
        fc.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=[1, 2], backend="cpu")
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])
    fc.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=[1, 2], backend="cpu")  # no append: reading is fine


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "k": None}, ValueError, "k, v: expected both or neither"),
    (lambda a: {**a, "cache_seqlens": [1, 2, 3]}, ValueError, r"cache_seqlens: expected an int or a shape \(2,\)"),
    (lambda a: {**a, "cache_seqlens": [1, 17]}, ValueError, r"cache_seqlens: expected values in \[0, 16\]"),
    (lambda a: {**a, "cache_seqlens": [1.5, 2.0]}, TypeError, "cache_seqlens: expected integers"),
    (lambda a: {**a, "k_cache": a["k_cache"][:, :, :, :4]}, ValueError, "k_cache: expected shape"),
    (lambda a: {**a, "v_cache": a["v_cache"].astype(F64)}, TypeError, "v_cache: expected q's dtype float32"),
    (lambda a: {**a, "k_cache": a["k_cache"].tolist()}, TypeError, "k_cache: expected an array, received list"),
    (lambda a: {**a, "block_table": np.zeros((2, 2), F32)}, TypeError, "block_table: expected integers"),
    (lambda a: {**a, "block_table": np.zeros((3, 2), np.int32)}, ValueError, "block_table: expected shape"),
])
def test_bad_arguments_name_themselves(change, error, match):
    q, kc, vc, k, v = _cache(np.random.default_rng(1))
    args = change({"q": q, "k_cache": kc, "v_cache": vc, "k": k, "v": v, "cache_seqlens": [1, 2]})
    with pytest.raises(error, match=match):
        fc.flash_attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("k"),
                                        args.pop("v"), backend="cpu", **args)


def test_block_table_out_of_range():
    rs = np.random.default_rng(2)
    q = rs.standard_normal((1, 2, 1, 8)).astype(F32)
    pages = rs.standard_normal((4, 2, 8, 8)).astype(F32)
    with pytest.raises(ValueError, match=r"block_table: expected block numbers in \[0, 3\]"):
        fc.flash_attention_with_kvcache(q, pages, pages, block_table=[[0, 4]], backend="cpu")


@given(st.integers(0, 2**32 - 1), st.integers(0, 12), st.sampled_from([F16, F32, F64]))
@example(0, 0, F32)  # one part with no key at all
def test_merge_of_two_key_sets_is_attention_over_both(seed, split, dtype):
    rs = np.random.default_rng(seed)
    q = rs.standard_normal((2, 3, 5, 16)).astype(dtype)
    k, v = (rs.standard_normal((2, 3, 12, 16)).astype(dtype) for _ in range(2))
    parts = [fc.flash_attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True, backend="cpu")
             for a, b in ((0, split), (split, 12))]
    out, lse = fc.merge_attention_states(*parts[0], *parts[1])
    whole, whole_lse = fc.attention_reference(q, k, v, return_lse=True)
    assert out.dtype == dtype and lse.dtype == parts[0][1].dtype
    assert_rule("out", out, whole, whole, dtype, 1.0)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-5)


def test_merge_of_empty_parts_is_zero_never_nan():
    out = np.ones((1, 2, 3, 4), F32)
    empty = np.full((1, 2, 3), -np.inf, F32)
    merged, lse = fc.merge_attention_states(out, empty, out * 2, empty)
    assert np.all(merged == 0) and np.all(lse == -np.inf)
    merged, lse = fc.merge_attention_states(out, empty, out * 2, np.zeros((1, 2, 3), F32))
    assert np.all(merged == 2) and np.all(lse == 0)


def test_merge_checks_its_arguments():
    out, lse = np.ones((2, 3, 4), F32), np.zeros((2, 3), F32)
    with pytest.raises(ValueError, match="out_b: expected out_a's shape"):
        fc.merge_attention_states(out, lse, out[:1], lse)
    with pytest.raises(ValueError, match=r"lse_b: expected shape \(2, 3\)"):
        fc.merge_attention_states(out, lse, out, lse[:1])
    with pytest.raises(TypeError, match="lse_b: expected float32 or float64, received float16"):
        fc.merge_attention_states(out, lse, out, lse.astype(F16))
    with pytest.raises(TypeError, match="lse_b: expected lse_a's dtype float32, received float64"):
        fc.merge_attention_states(out, lse, out, lse.astype(F64))
    with pytest.raises(TypeError, match="out_a: expected a floating dtype"):  # no integer outputs
        fc.merge_attention_states(out.astype(np.int32), lse, out.astype(np.int32), lse)


def test_merge_reads_the_other_byte_order():
    """Big-endian parts merge as their native copies do, as every other entry point reads them."""
    rs = np.random.default_rng(3)
    out_a, out_b = (rs.standard_normal((2, 3, 4)) for _ in range(2))
    lse_a, lse_b = (rs.standard_normal((2, 3)) for _ in range(2))
    want = fc.merge_attention_states(out_a, lse_a, out_b, lse_b)
    swapped = [x.astype(x.dtype.newbyteorder("S")) for x in (out_a, lse_a, out_b, lse_b)]
    got = fc.merge_attention_states(*swapped)
    for g, w in zip(got, want):
        assert g.dtype.isnative
        np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_on_the_gpu_writes_the_device_cache(paged):
    import cupy

    rs = np.random.default_rng(3)
    q, kc, vc, k, v = _cache(rs, dtype=F16)
    lens = np.array([4, 9])
    options = {"causal": True, "sinks": np.array([0.5, -1.0, 0.2, 1.0])}  # host sinks beside device arrays
    ref_out, _ = _reference(q, kc, vc, k, v, lens, options)
    if paged:
        kp, vp, table = _paged(kc, vc, 4, rs)
        caches = (cupy.asarray(kp), cupy.asarray(vp))
    else:
        caches, table = (cupy.asarray(kc), cupy.asarray(vc)), None
    out = fc.flash_attention_with_kvcache(cupy.asarray(q), *caches, cupy.asarray(k), cupy.asarray(v),
                                          cache_seqlens=lens, block_table=table, **options)
    assert isinstance(out, cupy.ndarray)
    assert_rule("out", out.get(), ref_out, ref_out, F16, 1.0)
    if not paged:
        np.testing.assert_array_equal(caches[0].get()[1, :, 9:12], k[1])


GPU_EXAMPLES = int(os.environ.get("FLASHCUPY_GPU_EXAMPLES", "60"))


@pytest.mark.gpu
@settings(max_examples=GPU_EXAMPLES, deadline=None)
@given(decode_calls(dtypes=(F16, BF16, F32, F64), groups=(1, 2, 4, 8), lmax=(4, 3000),
                    dims=((8, 12, 32, 40, 64, 128, 256), (8, 64, 128)), window_left=3000),
       st.sampled_from([0, 1, 2, 7]))
@example(call=None, num_splits=0)  # a long cache split many ways: see _long_call
@example(call="window", num_splits=2)  # a window starting inside the first of two splits
def test_decode_kernels_match_the_reference(call, num_splits):
    """Every supported call runs the split-KV kernels (their entry is watched), contiguous and
    paged, appended or not, with each option, GQA groups up to 16 rows and forced splits."""
    import cupy

    from flashcupy.cuda import decode as cuda_decode

    if call is None:
        call = _long_call()
    elif call == "window":
        call = _window_call()
    (q, k_cache, v_cache, k, v), lens, block_size, options, rs = call
    shared = _shared_prefix(k_cache, v_cache, lens, block_size)
    ref_out, ref_lse = _reference(q, k_cache, v_cache, k, v, lens, options)
    if block_size is None:
        caches, table = (k_cache, v_cache), None
    else:
        *caches, table = _paged(k_cache, v_cache, block_size, rs, shared)
    new = k.shape[2]
    if table is not None and rs.random() < 0.5:  # a device table, -1 in the slots no sequence uses
        used = -(-(lens + new) // block_size)
        table = cupy.asarray(np.where(np.arange(table.shape[1]) < used[:, None], table, -1))
    dev = [cupy.asarray(x) for x in (q, *caches, k, v)]
    seqlens = cupy.asarray(lens) if rs.random() < 0.5 else lens  # device lengths: checked by the kernels
    supported = (q.shape[1] // k.shape[1]) * q.shape[2] <= cuda_decode.MAX_ROWS and all(
        (n * q.dtype.itemsize) % 16 == 0 for n in (q.shape[-1], v.shape[-1]))  # else the general forward
    with mock.patch.object(cuda_decode.DecodePlan, "launch", autospec=True,
                           side_effect=cuda_decode.DecodePlan.launch) as kernels:
        out, lse = fc.flash_attention_with_kvcache(
            dev[0], dev[1], dev[2], dev[3] if new else None, dev[4] if new else None, cache_seqlens=seqlens,
            block_table=table, return_lse=True, num_splits=num_splits, backend="cuda", **options)
    assert kernels.called == supported
    assert isinstance(out, cupy.ndarray) and out.dtype == q.dtype and out.shape == ref_out.shape
    assert_rule("out", out.get(), ref_out, ref_out, q.dtype, 1.0)
    tol = 1e-10 if q.dtype == F64 else 1e-4
    np.testing.assert_allclose(lse.get(), ref_lse, rtol=tol, atol=tol)
    if block_size is None and new:
        got = dev[1].get()
        for b in range(q.shape[0]):
            np.testing.assert_array_equal(got[b, :, lens[b] : lens[b] + new], k[b])


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_bad_device_lengths_and_tables_give_nan_and_write_nothing(paged):
    """Device cache_seqlens and block tables are not read back: the kernels check them. Of
    four sequences appending two keys, one is good, one has a length past the capacity, one a
    negative length and (paged) one a slot in use naming no block: the good one is written and
    matches the reference; the bad ones are not written and get NaN, out and lse."""
    import cupy

    from flashcupy.problem import validate

    rs = np.random.default_rng(21)
    q, kc, vc = (rs.standard_normal(s).astype(F16) for s in ((4, 8, 1, 64), (4, 2, 64, 64), (4, 2, 64, 64)))
    k, v = (rs.standard_normal((4, 2, 2, 64)).astype(F16) for _ in range(2))
    lens = np.array([10, 63, -1, 20], np.int32)
    bad = [1, 2] + ([3] if paged else [])
    ref_out, _ = _reference(q[:1], kc[:1], vc[:1], k[:1], v[:1], lens[:1], {})
    if paged:
        kp, vp, table = _paged(kc, vc, 16, rs)
        table[3, 1] = kp.shape[0]  # sequence 3's keys 16..31 lie in no block
        caches, table = [cupy.asarray(x) for x in (kp, vp)], cupy.asarray(table)
    else:
        caches, table = [cupy.asarray(x) for x in (kc, vc)], None
    before = [c.get() for c in caches]
    read_back = []

    def host_array(name, x):
        read_back.append(name)
        return validate.host_array(name, x)

    with mock.patch("flashcupy.kvcache.host_array", host_array):
        out, lse = fc.flash_attention_with_kvcache(
            cupy.asarray(q), *caches, cupy.asarray(k), cupy.asarray(v), cache_seqlens=cupy.asarray(lens),
            block_table=table, return_lse=True, backend="cuda")
    assert read_back == []
    out, lse = out.get(), lse.get()
    assert np.isnan(out[bad]).all() and np.isnan(lse[bad]).all()
    assert_rule("out", out[:1], ref_out, ref_out, F16, 1.0)
    assert not np.isnan(out[[b for b in range(4) if b not in bad]]).any()
    after = [c.get() for c in caches]
    if not paged:
        for b in range(4):
            written = slice(lens[b], lens[b] + 2) if b not in bad else slice(0, 0)
            untouched = np.ones(64, bool)
            untouched[written] = False
            np.testing.assert_array_equal(after[0][b][:, untouched], before[0][b][:, untouched])
        np.testing.assert_array_equal(after[0][0, :, 10:12], k[0])
    else:
        changed = {int(n) for n in np.nonzero((after[0] != before[0]).any(axis=(1, 2, 3)))[0]}
        assert changed == {int(table[0, 0])}  # sequence 0's keys 10, 11: its first block only


def _window_call():
    """A window whose start (key 504) is off the first split's 16-key grid: that split's last
    tile ran past the split's end (key 512) and counted the zero-filled keys after it."""
    rs = np.random.default_rng(13)
    arrays = [rs.standard_normal(s).astype(F16) for s in ((1, 1, 1, 64), (1, 1, 1000, 64), (1, 1, 1000, 64),
                                                          (1, 1, 0, 64), (1, 1, 0, 64))]
    return arrays, np.array([1000]), None, {"window": (495, 0)}, rs


def _long_call():
    """fp16 GQA 8/2, 20000 keys of cache (many splits, many tiles each), one new key, every
    elementwise option."""
    rs = np.random.default_rng(11)
    arrays = [rs.standard_normal(s).astype(F16) for s in ((2, 8, 1, 128), (2, 2, 20000, 128), (2, 2, 20000, 128),
                                                          (2, 2, 1, 128), (2, 2, 1, 128))]
    options = {"causal": True, "window": (15000, 0), "alibi_slopes": rs.uniform(0, 0.01, 8), "softcap": 30.0,
               "sinks": rs.standard_normal(8)}
    return arrays, np.array([19999, 12345]), 64, options, rs


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 8])
def test_a_nan_sink_reaches_its_rows_however_the_keys_split(num_splits):
    """A device sink that is NaN gives its head's rows NaN (out and lse) with one split, which
    writes out directly, and with several, which the last split merges (the merge's max() had
    dropped it: zeros and -inf); the other heads are as without it."""
    import cupy

    rs = np.random.default_rng(14)
    q, kc, vc = (cupy.asarray(rs.standard_normal(s).astype(F16)) for s in
                 ((2, 8, 1, 64), (2, 2, 4096, 64), (2, 2, 4096, 64)))
    sinks = rs.standard_normal(8)
    nan_sinks = sinks.copy()
    nan_sinks[3] = np.nan
    out, lse = fc.flash_attention_with_kvcache(q, kc, vc, sinks=cupy.asarray(nan_sinks), num_splits=num_splits,
                                               return_lse=True)
    want, want_lse = fc.flash_attention_with_kvcache(q, kc, vc, sinks=cupy.asarray(sinks), num_splits=num_splits,
                                                     return_lse=True)
    out, lse, want, want_lse = (x.get() for x in (out, lse, want, want_lse))
    assert np.isnan(out[:, 3]).all() and np.isnan(lse[:, 3]).all()
    others = [h for h in range(8) if h != 3]
    np.testing.assert_array_equal(out[:, others], want[:, others])
    np.testing.assert_array_equal(lse[:, others], want_lse[:, others])


@pytest.mark.gpu
def test_decode_splits_change_nothing_but_rounding():
    """The same call split 1, 3 and the chosen number of ways: equal within float32 rounding,
    and bitwise repeatable for a fixed count."""
    import cupy

    rs = np.random.default_rng(12)
    q, kc, vc = (cupy.asarray(rs.standard_normal(s).astype(F16)) for s in
                 ((1, 32, 1, 128), (1, 8, 8192, 128), (1, 8, 8192, 128)))
    outs = [fc.flash_attention_with_kvcache(q, kc, vc, num_splits=n, return_lse=True) for n in (1, 3, 0, 0)]
    for out, lse in outs[1:]:
        np.testing.assert_allclose(out.get().astype(F32), outs[0][0].get().astype(F32), atol=2e-3)
        np.testing.assert_allclose(lse.get(), outs[0][1].get(), rtol=1e-5)
    np.testing.assert_array_equal(outs[2][0].get(), outs[3][0].get())


@pytest.mark.gpu
def test_a_captured_decode_call_replays_beside_eager_calls():
    """The last split of each (sequence, KV head) merges, found by a count kept a stream: a
    call captured in a CUDA graph (its counts zeroed by the graph) replays on new query values
    between eager calls on the same stream, whose results, made after the capture, are held
    across the replay: the graph's partials and counts are its own memory, so a replay writes
    nothing CuPy's pool handed out since; every result equals its call made alone."""
    import cupy

    rs = np.random.default_rng(21)
    kc, vc = (cupy.asarray(rs.standard_normal((2, 2, 3000, 64)).astype(F16)) for _ in range(2))
    queries = [cupy.asarray(rs.standard_normal((2, 8, 1, 64)).astype(F16)) for _ in range(3)]

    def call(x):
        return fc.flash_attention_with_kvcache(x, kc, vc, num_splits=5, return_lse=True)

    for got, want in captured_replays(call, queries, held=4):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "paged16", "paged48", "paged8"])
@pytest.mark.parametrize("d, dv", [(128, 128), (80, 64), (256, 128)])
def test_tensor_copies_read_only_the_keys_in_use(layout, d, dv):
    """The decode kernel's tiles by tensor copies (sm_90; cp.async before, and for pages that
    are not whole 16-key tiles): keys past each sequence's length, and every spare block, hold
    NaN, yet outputs match the reference: a tail tile reads zeros past the length, a window's
    tiles that cross a page take the other copy. Lengths end mid-tile; D 80 leaves part of a
    64-column box outside the head; the transposed cache is a (B, Lmax, Hk, D) buffer seen
    as (B, Hk, Lmax, D)."""
    import cupy

    from flashcupy.cuda import decode as cuda_decode

    rs = np.random.default_rng(d + dv)
    batch, hq, hk, lmax = 3, 8, 2, 300
    lens = np.array([300, 157, 33])
    q = rs.standard_normal((batch, hq, 1, d)).astype(F16)
    kc, vc = (rs.standard_normal((batch, hk, lmax, n)).astype(F16) for n in (d, dv))
    options = {"window": (200, 0)} if layout != "contiguous" else {}
    ref_out, ref_lse = _reference(q, kc, vc, kc[:, :, :0], vc[:, :, :0], lens, options)
    for cache in (kc, vc):
        for b, n in enumerate(lens):
            cache[b, :, n:] = np.nan
    table = None
    if layout.startswith("paged"):
        block = int(layout[5:])
        kc, vc, table = _paged(kc, vc, block, rs)
        spare = np.setdiff1d(np.arange(len(kc)), table)
        kc[spare] = np.nan
        vc[spare] = np.nan
    caches = [cupy.asarray(c) for c in (kc, vc)]
    if layout == "transposed":
        caches = [cupy.ascontiguousarray(c.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for c in caches]
    with mock.patch.object(cuda_decode.DecodePlan, "launch", autospec=True,
                           side_effect=cuda_decode.DecodePlan.launch) as launch:
        out, lse = fc.flash_attention_with_kvcache(cupy.asarray(q), *caches, cache_seqlens=lens, block_table=table,
                                                   return_lse=True, num_splits=2, **options)
    hopper = int(cupy.cuda.Device().compute_capability) >= 90
    expect = "tma" if hopper and layout != "paged8" else "cp.async"
    assert launch.call_args.args[0].copies == expect
    assert_rule("out", out.get(), ref_out, ref_out, F16, 1.0)
    np.testing.assert_allclose(lse.get(), ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_threads_share_a_plan_without_sharing_arguments():
    """Decode calls of one layout from four threads at once (each thread fills its own copy of
    the plan's parameter block): every result equals the same call made alone."""
    import threading

    import cupy

    rs = np.random.default_rng(5)
    kc, vc = (cupy.asarray(rs.standard_normal((2, 2, 500, 64)).astype(F16)) for _ in range(2))
    qs = [cupy.asarray(rs.standard_normal((2, 8, 1, 64)).astype(F16)) for _ in range(4)]
    lens = [cupy.asarray(np.array([500 - 37 * t, 100 + t], np.int32)) for t in range(4)]
    alone = [fc.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=n).get() for q, n in zip(qs, lens)]
    got: dict[int, list] = {t: [] for t in range(4)}

    def work(t: int) -> None:
        with cupy.cuda.Stream():
            for _ in range(50):
                got[t].append(fc.flash_attention_with_kvcache(qs[t], kc, vc, cache_seqlens=lens[t]))
            cupy.cuda.get_current_stream().synchronize()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t in range(4):
        for out in got[t]:
            np.testing.assert_array_equal(out.get(), alone[t])


@pytest.mark.parametrize("num_splits, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_num_splits_is_refused(num_splits, error):
    q, kc, vc, k, v = _cache(np.random.default_rng(6))
    before = kc.copy()
    with pytest.raises(error, match="num_splits"):
        fc.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=[1, 2], num_splits=num_splits, backend="cpu")
    np.testing.assert_array_equal(kc, before)


@pytest.mark.parametrize("options, error", [({"causal": "bad"}, ValueError), ({"sinks": np.ones(3)}, ValueError),
                                            ({"backend": "gpu"}, ValueError), ({"window": (-1, 0)}, ValueError)])
def test_a_bad_option_writes_nothing(options, error):
    q, kc, vc, k, v = _cache(np.random.default_rng(4))
    before = (kc.copy(), vc.copy())
    with pytest.raises(error):
        fc.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=[1, 2], **options)
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])


def test_unused_block_table_slots_may_hold_minus_one():
    rs = np.random.default_rng(5)
    q, kc, vc, _, _ = _cache(rs, lmax=16)
    kp, vp, table = _paged(kc, vc, 4, rs)
    padded = table.copy()
    padded[0, 2:] = -1  # sequence 0 holds 6 keys: two blocks of 4
    got = fc.flash_attention_with_kvcache(q, kp, vp, cache_seqlens=[6, 16], block_table=padded, backend="cpu")
    want = fc.flash_attention_with_kvcache(q, kp, vp, cache_seqlens=[6, 16], block_table=table, backend="cpu")
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"block_table: expected block numbers .* in the slots the sequences use"):
        fc.flash_attention_with_kvcache(q, kp, vp, cache_seqlens=[9, 16], block_table=padded, backend="cpu")


def test_a_repeated_layout_still_checks_each_calls_values():
    """A call's layout is checked once, its values every time: after good calls of one layout,
    an overflowing append, lengths past the capacity and a table naming no block are refused
    with the cache untouched."""
    rs = np.random.default_rng(8)
    q, kc, vc, k, v = _cache(rs, lmax=16)
    kp, vp, table = _paged(kc, vc, 4, rs)
    for lens in (3, 5):
        fc.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, backend="cpu")
        fc.flash_attention_with_kvcache(q, kp, vp, k, v, cache_seqlens=lens, block_table=table, backend="cpu")
    before = [x.copy() for x in (kc, vc, kp, vp)]
    with pytest.raises(ValueError, match="exceed the cache's capacity of 16"):
        fc.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=16 - k.shape[2] + 1, backend="cpu")
    with pytest.raises(ValueError, match=r"cache_seqlens: expected values in \[0, 16\]"):
        fc.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=17, backend="cpu")
    bad = table.copy()
    bad[1, 0] = kp.shape[0]
    with pytest.raises(ValueError, match="block_table: expected block numbers"):
        fc.flash_attention_with_kvcache(q, kp, vp, k, v, cache_seqlens=5, block_table=bad, backend="cpu")
    for got, want in zip((kc, vc, kp, vp), before):
        np.testing.assert_array_equal(got, want)


def test_layout_key_covers_what_the_checks_read():
    """The layout cache's key changes with every array property and option the checks read,
    and calls it cannot key (option arrays, unhashable options) are checked in full each time."""
    from flashcupy.kvcache import _layout_key

    rs = np.random.default_rng(9)
    q, kc, vc, k, v = _cache(rs)
    opts = {"causal": False, "scale": None, "window": None, "alibi_slopes": None, "softcap": None, "sinks": None,
            "return_lse": False, "allow_tf32": False, "backend": "cpu"}
    base = _layout_key(q, kc, vc, k, v, 3, None, opts, 0)
    assert base is not None and base == _layout_key(q.copy(), kc.copy(), vc.copy(), k, v, 7, None, dict(opts), 0)
    changed = [
        _layout_key(q.astype(F64), kc, vc, k, v, 3, None, opts, 0),
        _layout_key(q, kc[:, :, :8], vc[:, :, :8], k, v, 3, None, opts, 0),
        _layout_key(q, np.asfortranarray(kc), vc, k, v, 3, None, opts, 0),
        _layout_key(q, kc, vc, None, None, 3, None, opts, 0),
        _layout_key(q, kc, vc, k, v, np.array([3, 4]), None, opts, 0),
        _layout_key(q, kc, vc, k, v, 3, None, {**opts, "causal": True}, 0),
        _layout_key(q, kc, vc, k, v, 3, None, opts, 2),
    ]
    assert all(key is not None and key != base for key in changed)
    assert len(set(changed)) == len(changed)
    for odd in ({"window": [1, 2]}, {"alibi_slopes": np.ones(4)}, {"sinks": np.zeros(4)}):
        assert _layout_key(q, kc, vc, k, v, 3, None, {**opts, **odd}, 0) is None
    assert _layout_key(q, kc, vc, k, v, [3, 4], None, opts, 0) is None  # a list: converted each call
    out = fc.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=[3, 4], window=[1, 2], backend="cpu")
    want = fc.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=[3, 4], window=(1, 2), backend="cpu")
    np.testing.assert_array_equal(out, want)


def test_a_kept_layout_holds_no_array():
    """The decode layout's problem keeps every field but the arrays: the layout cache must not
    keep a call's q and caches alive after the caller drops them."""
    import weakref

    from flashcupy.kvcache import _without_arrays
    from flashcupy.problem import make_host_problem

    q, kc, vc, _, _ = _cache(np.random.default_rng(10))
    pb = make_host_problem(q, kc, vc, {"causal": True, "softcap": 30.0, "return_lse": True})
    kept = _without_arrays(pb)
    assert type(kept) is type(pb) and kept.q is None and kept.k is None and kept.v is None
    fields = {n: v for n, v in vars(pb).items() if n not in ("q", "k", "v")}
    assert {n: v for n, v in vars(kept).items() if n not in ("q", "k", "v")} == fields
    assert kept.group_size == pb.group_size and kept.return_lse and kept.softcap == 30.0
    gone = weakref.ref(kc)
    del pb, kc
    assert gone() is None


@pytest.mark.gpu
def test_decoding_does_not_keep_a_dropped_cache_alive():
    """After a decode call, a cache the caller drops is freed (the layout and plan caches hold
    shapes, not arrays)."""
    import cupy

    pool = cupy.get_default_memory_pool()
    q = cupy.ones((1, 8, 1, 128), cupy.float16)
    cache = cupy.ones((1, 2, 65536, 128), cupy.float16)  # 32 MiB
    fc.flash_attention_with_kvcache(q, cache, cache, cache_seqlens=100)
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    del cache
    assert before - pool.used_bytes() >= 32 * 2**20


def test_decode_split_count_fills_waves_of_resident_blocks():
    """choose_splits: a grid short of one wave splits to fill it; one a little over a wave
    splits rather than run a second, mostly idle wave; splits keep MIN_SPLIT_KEYS keys but
    where SMs would stay idle, which short caches split down to SHORT_SPLIT_KEYS to fill."""
    from flashcupy.cuda.decode import MIN_SPLIT_KEYS, SHORT_SPLIT_KEYS, choose_splits

    assert choose_splits(8, 131072, 264, 132) == 33  # 8 blocks fill 264 slots 33 ways
    assert choose_splits(512, 16384, 396, 132) == 3  # 1.29 waves at 1 split, 3.88 at 3
    assert choose_splits(512, 16384, 264, 132) == 1  # 1.94 waves: a split more only adds waves
    assert choose_splits(8, 16384, 264, 132) == 16384 // MIN_SPLIT_KEYS  # 128 blocks: every SM has one
    assert choose_splits(8, 4096, 264, 132) == 16  # 32 blocks at 1024 keys: 128 at 256
    assert choose_splits(8, 1024, 264, 132) == 1024 // SHORT_SPLIT_KEYS
    assert choose_splits(32, 1024, 264, 132) == 4
    assert choose_splits(128, 1024, 264, 132) == 1  # a block an SM already
    assert choose_splits(8, 100, 264, 132) == 1


@pytest.mark.parametrize("num_splits", [0, 1, 7, 256, 257, 10**6])
def test_decode_splits_stay_within_the_merges_shared_memory(num_splits):
    """DecodePlan.splits: any num_splits gives at most DECODE_MAX_SPLITS splits (the last
    split's merge keeps a weight a split in shared memory, sized for that many), at most one
    a step of the key loop, no more than asked, and splits of whole steps covering every key
    (exactly the count asked where it divides the steps)."""
    from types import SimpleNamespace

    from flashcupy.cuda import decode
    from flashcupy.cuda.params import DECODE_MAX_SPLITS

    plan = SimpleNamespace(tile=64, blocks=8, slots=264, sms=132)
    for keys in (1, 64, 1000, 1 << 17, 1 << 20):
        splits, split_keys = decode.DecodePlan.splits(plan, keys, num_splits)
        assert 1 <= splits <= min(DECODE_MAX_SPLITS, -(-keys // plan.tile))
        assert split_keys % plan.tile == 0 and splits * split_keys >= keys > (splits - 1) * split_keys
        if num_splits:
            assert splits <= num_splits
            steps = -(-keys // plan.tile)
            if num_splits <= DECODE_MAX_SPLITS and steps % num_splits == 0:
                assert splits == num_splits


def test_decode_counts_are_kept_a_stream_and_a_thread_on_the_per_thread_stream(monkeypatch):
    """decode.counters: one array of split counts a stream (grown for a larger grid), one a
    thread on the per-thread default stream (one handle, another stream in each thread: a
    shared array let two threads' launches count into each other's), fresh and not kept
    while the stream is captured into a CUDA graph."""
    import contextlib
    import threading

    cupy = pytest.importorskip("cupy")
    from flashcupy.cuda import decode

    monkeypatch.setattr(cupy, "zeros", lambda n, dtype: np.zeros(n, dtype))
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(decode, "_COUNTERS", {})

    class Stream:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

    a, b = Stream(0x1230), Stream(0x4560)
    first = decode.counters(8, 0, a, False)
    assert decode.counters(4, 0, a, False) is first and decode.counters(8, 0, b, False) is not first
    grown = decode.counters(20, 0, a, False)
    assert grown.size >= 20 and decode.counters(20, 0, a, False) is grown
    captured = decode.counters(8, 0, a, True)
    assert captured is not grown and captured.size == 8 and decode.counters(8, 0, a, False) is grown
    per_thread = Stream(decode._PER_THREAD_STREAM)
    mine, theirs = decode.counters(8, 0, per_thread, False), []
    thread = threading.Thread(target=lambda: theirs.append(decode.counters(8, 0, per_thread, False)))
    thread.start()
    thread.join()
    assert theirs[0] is not mine and decode.counters(8, 0, per_thread, False) is mine


def test_decode_parameter_template_packs_like_pack():
    """The cached parameter block with its per-call fields filled is the block pack() builds."""
    from flashcupy.cuda import params as P
    from flashcupy.cuda.decode import _FILLED, _template

    fixed = dict(scale=0.125, softcap=30.0, batch=2, hq=32, hk=8, lq=1, d=128, dv=64, causal=1, page=16,
                 window_left=-1, window_right=5, q_sb=1, q_sh=2, q_sr=3, k_sb=4, k_sh=5, k_sr=6, v_sb=7, v_sh=8,
                 v_sr=9, bt_sb=40)
    filled = {name: 4096 + 16 * i for i, name in enumerate(_FILLED)}
    filled.update(splits=3, split_keys=64, keys_all=77)
    template = _template(tuple(fixed.items()))
    block = template.buffer()
    template.fill_into(block, *filled.values())
    assert bytes(block) == P.pack(P.DECODE_PARAMS_DTYPE, **fixed, **filled).tobytes()


def test_decode_kernels_say_which_calls_they_take(monkeypatch):
    """The kernels' admission rule from the arrays' description (no GPU: an H100's limits)."""
    from flashcupy.cuda import decode as cuda_decode

    monkeypatch.setattr(cuda_decode, "device_limits", lambda device: (90, 227 * 1024))
    cuda_decode.plan.cache_clear()
    cuda_decode._unsupported.cache_clear()
    try:
        def why(q, k, v=None, aligned=True, dtype=F16):
            v = k if v is None else v
            arrays = [(np.dtype(dtype), s, tuple(np.dtype(dtype).itemsize * int(np.prod(s[i + 1:])) for i in
                                                 range(len(s))), aligned) for s in (q, k, v)]
            return cuda_decode._unsupported(-7, *arrays)

        assert why((4, 32, 1, 128), (4, 8, 4096, 128)) is None
        assert why((4, 32, 4, 128), (4, 8, 4096, 128)) is None  # 16 rows
        assert "query rows" in why((4, 32, 5, 128), (4, 8, 4096, 128))
        assert "query heads" in why((4, 30, 1, 128), (4, 8, 4096, 128))
        assert "head dim" in why((4, 8, 1, 12), (4, 8, 64, 12))  # 24 bytes
        assert "head dim" in why((4, 8, 1, 512), (4, 8, 64, 512))
        assert "layout" in why((4, 8, 1, 64), (4, 8, 64, 64), aligned=False)
        assert why((4, 8, 1, 64), (4, 8, 64, 64), dtype=F64) is None
        assert why((4, 8, 1, 64), (4, 8, 64, 64), dtype=np.int32).startswith("dtype")
    finally:
        cuda_decode.plan.cache_clear()
        cuda_decode._unsupported.cache_clear()


@pytest.mark.parametrize("block_size", [None, 16, 4])
def test_an_append_at_one_position_for_every_sequence(block_size):
    """Equal cache_seqlens take one copy a cache (a slice, or one block a sequence when paged;
    with 4-key blocks the 3 new keys cross a block and take the indexed path): the same keys
    land where the indexed path puts them, and attention matches the reference."""
    rs = np.random.default_rng(8)
    q, kc, vc, k, v = _cache(rs, batch=3, lmax=32)
    lens = np.array([13, 13, 13])
    ref_out, _ = _reference(q, kc, vc, k, v, lens, {"causal": True})
    if block_size is None:
        caches, table = [kc, vc], None
    else:
        *caches, table = _paged(kc, vc, block_size, rs)
    out = fc.flash_attention_with_kvcache(q, *caches, k, v, cache_seqlens=13, block_table=table, causal=True,
                                          backend="cpu")
    assert_rule("out", out, ref_out, ref_out, q.dtype, 1.0)
    for b in range(3):
        for n in range(3):
            key = 13 + n
            got = caches[0][b, :, key] if table is None else caches[0][table[b, key // block_size], :, key % block_size]
            np.testing.assert_array_equal(got, k[b, :, n])


def test_a_paged_cache_of_empty_blocks_is_refused():
    q, kc, vc, _, _ = _cache(np.random.default_rng(9))
    with pytest.raises(ValueError, match="k_cache: expected blocks of at least one key"):
        fc.flash_attention_with_kvcache(q, kc[:, :, :0], vc[:, :, :0], block_table=np.zeros((2, 1), np.int32),
                                        backend="cpu")


def test_tensor_map_strides_of_single_dims_are_ones_the_driver_takes():
    """A dim of size 1 is only read at coordinate 0: its stride, which an array may give as
    anything (here 2 bytes), becomes a 16-byte multiple; the others are kept."""
    from flashcupy.cuda.tensor_map import strides_for

    assert strides_for((128, 4096, 8, 1), (256, 1048576, 2)) == (256, 1048576, 1048576)
    assert strides_for((128, 1, 8, 4), (2, 256, 2048)) == (2048, 256, 2048)
    assert strides_for((64, 16), (128,)) == (128,)
