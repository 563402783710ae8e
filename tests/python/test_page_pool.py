"""kvpq.PagePool (kvpq_page_pool): caches made with pool= share its pages and budget; a refusal
raises kvpq.Error with status ERR_BUDGET and leaves the cache as it was; freed pages are reused;
a pooled cache attends bit for bit as an unpooled one."""
import gc

import numpy as np
import pytest

import kvpq

SHAPE = dict(n_layer=2, n_head=8, n_head_kv=2, head_dim=64, max_seq=1024, page_tokens=32)


def kv(n, seed):
    r = np.random.default_rng(seed)
    return (r.standard_normal((n, 2, 64), dtype=np.float32), r.standard_normal((n, 2, 64), dtype=np.float32))


def fill(c, n, seed):
    k, v = kv(n, seed)
    for layer in range(c.n_layer):
        c.append(layer, k, v)


@pytest.mark.parametrize("kind", ["fp16", "q8_0", "kivi2"])
def test_pool_shares_budget_reuses_pages_and_equals_unpooled(kind):
    pool = kvpq.PagePool()
    a = kvpq.Cache(kind, **SHAPE, pool=pool)
    fill(a, 200, 1)
    st = pool.stats()
    assert st["bytes_in_use"] > 0 and st["caches"] == 1 and st["budget_bytes"] == 0
    held = st["bytes_in_use"]
    del a
    gc.collect()
    st = pool.stats()
    assert st["bytes_in_use"] == 0 and st["bytes_free"] == held and st["caches"] == 0
    # refilled on the given-back pages: the pool does not grow, and attends as an unpooled cache
    b, ref = kvpq.Cache(kind, **SHAPE, pool=pool), kvpq.Cache(kind, **SHAPE)
    fill(b, 200, 2)
    fill(ref, 200, 2)
    st = pool.stats()
    assert st["bytes_in_use"] + st["bytes_free"] == held and st["reused"] > 0
    q = np.random.default_rng(3).standard_normal((1, 8, 64), dtype=np.float32)
    for layer in range(2):
        assert np.array_equal(b.attend(layer, q), ref.attend(layer, q))
        assert all(np.array_equal(x, y) for x, y in zip(b.read(layer), ref.read(layer)))

    # a budget: what b holds; a second cache is refused, unchanged, and carries on once b is gone
    pool.budget = held
    c = kvpq.Cache(kind, **SHAPE, pool=pool)
    n = 0
    with pytest.raises(kvpq.Error) as e:
        while n < 1000:
            c.reserve(n + 16)
            fill(c, 16, 10 + n)
            n += 16
    assert e.value.status == kvpq.ERR_BUDGET and "budget" in str(e.value)
    assert c.seq_len(0) == n and c.seq_len(1) == n
    assert pool.stats()["refused"] > 0
    assert pool.stats()["bytes_in_use"] <= held
    before = c.read(0)
    del b
    gc.collect()
    fill(c, 16, 10 + n)
    after = c.read(0, 0, n)
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    pool.trim()
    assert pool.stats()["bytes_free"] == 0


def test_pool_arguments():
    with pytest.raises(kvpq.ArgumentError, match="budget"):
        kvpq.PagePool(-1)
    with pytest.raises(kvpq.ArgumentError, match="pool"):
        kvpq.Cache("fp16", **SHAPE, pool="big")
    pool = kvpq.PagePool(1 << 20)
    assert pool.budget == 1 << 20
    c = kvpq.Cache("fp16", **SHAPE, pool=pool)
    del pool  # the cache keeps the pool
    gc.collect()
    fill(c, 10, 1)
    assert "PagePool(" in repr(c.pool)
