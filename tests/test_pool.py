"""The prompt-cache pool against its oracle: a generation that starts from a pooled
copy must give the same greedy tokens and logprobs as one from a fresh cache (the
single-sequence path), while prefilling only the tokens the pool did not have."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import mlxinfer
from mlxinfer.models.prompt_cache import PromptCache
from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.engine.generate import stream_generate
from mlxinfer.engine.pool import PromptCachePool, prefix_copy

PROMPT = [5, 17, 99, 250, 3, 42, 7, 300, 12, 8]
BIG = 1 << 30


def generate(model, tok, prompt, cache=None, n=5, **opts):
    """(tokens, logprobs, prefill_tokens) of a greedy generation."""
    chunks = list(stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=n, ignore_eos=True, **opts))
    out = [c for c in chunks if c.token is not None]
    return [c.token for c in out], np.array([c.logprob for c in out]), chunks[-1].stats.prefill_tokens


def assert_same_as_fresh(model, tok, prompt, pooled, n=5, **opts):
    """The pooled run equals a fresh run; returns how many tokens the pooled run prefilled."""
    tokens, logprobs, prefilled = generate(model, tok, prompt, pooled, n, **opts)
    fresh_tokens, fresh_logprobs, fresh_prefilled = generate(model, tok, prompt, None, n, **opts)
    assert fresh_prefilled == len(prompt)
    assert tokens == fresh_tokens
    np.testing.assert_allclose(logprobs, fresh_logprobs, atol=1e-5)
    return prefilled


def served(pool, model, tok, prompt, n=5, **opts):
    """One request through the pool: fetch, generate, store back; the cache's tokens."""
    cache = pool.fetch(model, prompt, **opts)
    generate(model, tok, prompt, cache, n, **opts)
    pool.store(cache, model, **opts)
    return list(cache.tokens)


def arrays(cache: PromptCache) -> list[np.ndarray]:
    """Every kept key and value of every layer, as numpy copies in token order."""
    return [np.array(p) for c in cache.caches for parts in c.state for p in parts]


@pytest.mark.parametrize("opts", [{}, {"kv_bits": 8}, {"max_kv_size": 64}], ids=["float", "kv8", "rotating"])
def test_extended_prompt_prefills_only_new_tokens_and_matches_fresh(loaded, opts):
    model, tok = loaded
    pool = PromptCachePool(BIG)
    held = served(pool, model, tok, PROMPT, **opts)
    assert pool.stats.misses == 1 and pool.stats.hits == 0 and pool.stats.entries == 1
    turn2 = held + [9, 10, 11]  # a client resending the conversation plus its new message
    cache = pool.fetch(model, turn2, **opts)
    assert cache.tokens == held
    assert pool.stats.hits == 1 and pool.stats.reused_tokens == len(held)
    assert assert_same_as_fresh(model, tok, turn2, cache, **opts) == 3


def test_prefix_means_same_tokens_at_same_positions(loaded):
    model, tok = loaded
    a, b, c, d, x, e = 5, 17, 99, 250, 400, 3
    pool = PromptCachePool(BIG)
    assert served(pool, model, tok, [a, b, c, d], n=1) == [a, b, c, d]  # the generated token is never fed
    diverging = [a, b, x, d, e]
    cache = pool.fetch(model, diverging)
    assert cache.tokens == [a, b]
    assert (pool.stats.hits, pool.stats.reused_tokens) == (1, 2)
    assert assert_same_as_fresh(model, tok, diverging, cache) == 3
    shifted = [x, a, b, c]  # the same ids one position later: nothing to reuse
    cache = pool.fetch(model, shifted)
    assert cache.tokens == [] and cache.offset == 0
    assert (pool.stats.hits, pool.stats.misses, pool.stats.reused_tokens) == (1, 2, 2)
    assert assert_same_as_fresh(model, tok, shifted, cache) == len(shifted)
    served(pool, model, tok, [a, b, x], n=1)  # a newer entry sharing less: the longest match still wins
    cache = pool.fetch(model, [a, b, c, x])
    assert cache.tokens == [a, b, c]
    assert assert_same_as_fresh(model, tok, [a, b, c, x], cache) == 1


def test_whole_prompt_cached_still_runs_its_last_token(loaded):
    model, tok = loaded
    pool = PromptCachePool(BIG)
    held = served(pool, model, tok, PROMPT)
    cache = pool.fetch(model, held)
    assert cache.tokens == held[:-1]
    assert assert_same_as_fresh(model, tok, held, cache) == 1


def test_rotating_cache_that_dropped_needed_tokens_is_not_reused(loaded):
    """max_kv_size=8 keeps 4 sinks and the newest 4 tokens: a prompt that leaves the
    entry after token 12 needs tokens 8..11, long overwritten."""
    model, tok = loaded
    opts = {"max_kv_size": 8}
    pool = PromptCachePool(BIG)
    long = PROMPT * 2
    held = served(pool, model, tok, long, n=3, **opts)
    branch = long[:12] + [1, 2, 3]
    cache = pool.fetch(model, branch, **opts)
    assert cache.tokens == [] and pool.stats.hits == 0 and pool.stats.misses == 2
    assert assert_same_as_fresh(model, tok, branch, cache, **opts) == len(branch)
    # continuing where the entry ends needs only what it kept
    extended = held + [33, 34]
    cache = pool.fetch(model, extended, **opts)
    assert cache.tokens == held and pool.stats.hits == 1
    assert assert_same_as_fresh(model, tok, extended, cache, **opts) == 2


def test_entries_are_matched_by_cache_options(loaded):
    model, tok = loaded
    pool = PromptCachePool(BIG)
    held = served(pool, model, tok, PROMPT)
    for opts in ({"kv_bits": 8}, {"max_kv_size": 64}):
        assert pool.fetch(model, held + [1], **opts).tokens == []
    assert pool.stats.hits == 0
    assert pool.fetch(model, held + [1]).tokens == held


def test_entries_belong_to_the_model_that_filled_them(tiny, loaded):
    model, tok = loaded
    other, _ = mlxinfer.load(tiny, dtype="float32")
    pool = PromptCachePool(BIG)
    held = served(pool, other, tok, PROMPT)
    assert pool.fetch(model, held + [1]).tokens == []
    assert pool.fetch(other, held + [1]).tokens == held
    del other
    gc.collect()
    served(pool, model, tok, [1, 2, 3])  # a store drops what no living model can fetch
    assert pool.stats.entries == 1


@pytest.mark.parametrize("opts", [{}, {"kv_bits": 8}, {"max_kv_size": 8}], ids=["float", "kv8", "rotating"])
def test_a_copy_never_changes_the_entry(loaded, opts):
    """A rotating copy with a full ring overwrites its slots in place (`a[...] = b`): it must
    write into its own arrays, not the entry's."""
    model, tok = loaded
    entry = PromptCache.for_model(model, **opts)
    generate(model, tok, PROMPT * 2, entry, n=3, **opts)
    before = arrays(entry)
    copy = prefix_copy(entry, len(entry.tokens))
    generate(model, tok, entry.tokens + [40, 41], copy, n=8, **opts)
    after = arrays(entry)
    assert len(before) == len(after) and all(np.array_equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("opts", [{}, {"kv_bits": 8}], ids=["float", "kv8"])
def test_a_second_fetch_after_generating_on_the_first_still_matches_fresh(loaded, opts):
    model, tok = loaded
    pool = PromptCachePool(BIG)
    held = served(pool, model, tok, PROMPT, **opts)
    first = pool.fetch(model, held + [60, 61], **opts)
    generate(model, tok, held + [60, 61], first, n=10, **opts)
    second = held + [70, 71, 72]
    cache = pool.fetch(model, second, **opts)
    assert cache.tokens == held
    assert assert_same_as_fresh(model, tok, second, cache, **opts) == 3


def held_bytes(cache: PromptCache) -> int:
    """Bytes of every array the cache holds (spare preallocated slots included), by numpy."""
    return sum(np.array(p).nbytes for c in cache.caches if c.keys is not None for p in (*c.keys, *c.values))


def filled(model, tok, prompt) -> PromptCache:
    cache = PromptCache.for_model(model)
    generate(model, tok, prompt, cache, n=2)
    return cache


def test_bytes_bound_evicts_least_recently_used_first(loaded):
    model, tok = loaded
    a, b, c = (filled(model, tok, [t] + PROMPT) for t in (1, 2, 3))
    size = held_bytes(a)
    assert size == held_bytes(b) == held_bytes(c) > 0
    pool = PromptCachePool(2 * size)
    pool.store(a, model)
    pool.store(b, model)
    assert (pool.stats.entries, pool.stats.nbytes) == (2, 2 * size)
    assert pool.fetch(model, a.tokens + [1]).tokens == a.tokens  # a is now the most recently used
    pool.store(c, model)
    assert (pool.stats.entries, pool.stats.nbytes) == (2, 2 * size)
    assert pool.fetch(model, b.tokens + [1]).tokens == []  # b went first
    assert pool.fetch(model, a.tokens + [1]).tokens == a.tokens
    assert pool.fetch(model, c.tokens + [1]).tokens == c.tokens


def test_an_entry_larger_than_the_bound_is_not_kept(loaded):
    model, tok = loaded
    cache = filled(model, tok, PROMPT)
    for bound in (held_bytes(cache) - 1, 0):
        pool = PromptCachePool(bound)
        pool.store(cache, model)
        assert (pool.stats.entries, pool.stats.nbytes) == (0, 0)
        assert pool.fetch(model, cache.tokens + [1]).tokens == []
    # an entry too large to keep does not push out the shorter one it would have covered
    opts = {"max_kv_size": 64}
    longer = PromptCache.for_model(model, **opts)
    generate(model, tok, PROMPT, longer, n=1, **opts)
    short = prefix_copy(longer, 4)  # a copy holds exactly its tokens' entries
    assert held_bytes(longer) > held_bytes(short)
    pool = PromptCachePool(held_bytes(short))
    pool.store(short, model, **opts)
    pool.store(longer, model, **opts)
    assert pool.stats.entries == 1 and pool.fetch(model, longer.tokens, **opts).tokens == short.tokens


def test_a_longer_entry_replaces_the_prefix_it_covers(loaded):
    model, tok = loaded
    pool = PromptCachePool(BIG)
    held = served(pool, model, tok, PROMPT)
    served(pool, model, tok, held + [9])
    assert pool.stats.entries == 1
    served(pool, model, tok, [1, 2, 3])
    assert pool.stats.entries == 2


def test_invalid_bounds_and_options_are_refused(loaded):
    model, tok = loaded
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidOptionError, match="max_bytes"):
            PromptCachePool(bad)
    pool = PromptCachePool(BIG)
    with pytest.raises(InvalidOptionError, match="unknown cache option 'kv_size'"):
        pool.fetch(model, PROMPT, kv_size=8)
    with pytest.raises(InvalidOptionError, match="max_kv_size"):
        pool.fetch(model, PROMPT, max_kv_size=1)
    cache = filled(model, tok, PROMPT)
    with pytest.raises(InvalidOptionError, match="not made with these cache options"):
        pool.store(cache, model, kv_bits=8)
    assert pool.stats.entries == 0
