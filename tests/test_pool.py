"""The ThreadPool handle: sizes, validation, lifetime."""

import gc

import pytest
import shardstate


@pytest.mark.parametrize("n", [0, 1, 4])
def test_threads_reported(n):
    pool = shardstate.ThreadPool(n)
    assert pool.threads == n
    assert f"threads={n}" in repr(pool)


@pytest.mark.parametrize("bad", [-1, 100000])
def test_bad_size_is_value_error(bad):
    with pytest.raises(ValueError, match="threads must be in"):
        shardstate.ThreadPool(bad)


def test_many_pools_created_and_freed():
    # Each pool starts and joins real threads; doing it in a loop would leak
    # threads (and eventually fail to start them) if dealloc did not join.
    for _ in range(200):
        p = shardstate.ThreadPool(4)
        del p
    gc.collect()
    assert shardstate.ThreadPool(2).threads == 2
