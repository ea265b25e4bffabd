"""The router's memory of prompts it just routed (blocks not yet published by any replica)."""

import time

from router.ray_router import InflightPrefixes


def test_leading_blocks_of_recent_routes():
    recent = InflightPrefixes(ttl_s=5.0)
    recent.add([1, 2, 3], "a")
    assert recent.match([1, 2, 3, 4]) == {"a": 3}
    assert recent.match([1, 2, 7]) == {"a": 2}
    assert recent.match([9, 1, 2]) == {}
    recent.add([1, 2, 8], "b")  # a shared prefix sent to a second replica: both hold it
    assert recent.match([1, 2, 3]) == {"a": 3, "b": 2}
    for rid in "cdef":  # at most MAX_OWNERS replicas per block, the oldest forgotten
        recent.add([1], rid)
    assert recent.match([1, 2]) == {"c": 1, "d": 1, "e": 1, "f": 1}


def test_entries_expire_and_stay_bounded():
    recent = InflightPrefixes(ttl_s=0.05, max_entries=10)
    recent.add(list(range(100)), "a")
    assert len(recent._entries) == 10
    time.sleep(0.1)
    assert recent.match(list(range(100))) == {}
    recent.add([1000], "b")
    assert list(recent._entries) == [1000]
