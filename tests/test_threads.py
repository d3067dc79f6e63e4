"""Threads per rank: OMP_NUM_THREADS when set, else the rank's share of the usable cores."""
import os

import pytest

from gdpo_megatron.distributed.threads import rank_threads, ranks_on_this_host


def test_an_explicit_omp_num_threads_wins():
    assert rank_threads(1, {"OMP_NUM_THREADS": "3"}) == 3
    assert rank_threads(8, {"OMP_NUM_THREADS": " 2 "}) == 2


def test_otherwise_the_usable_cores_are_shared_by_the_ranks_of_the_host():
    cores = len(os.sched_getaffinity(0))
    assert rank_threads(1, {}) == cores
    assert rank_threads(2, {"OMP_NUM_THREADS": ""}) == max(1, cores // 2)
    assert rank_threads(cores + 1, {}) == 1  # never zero


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_omp_num_threads_is_named(value):
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS: expected a positive integer, got '{value}'"):
        rank_threads(1, {"OMP_NUM_THREADS": value})


def test_ranks_of_one_host_count_each_other(gloo_world_2):
    assert gloo_world_2.run(ranks_on_this_host) == [2, 2]
    assert ranks_on_this_host() == 1  # no process group in this process
