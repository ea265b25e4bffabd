"""Keep a local Ray node on loopback.

On Linux `ray.init()` replaces 127.0.0.1 with the machine's own address and its processes
advertise (and several listen on) every interface, so a laptop's `prefixgate serve` would be
reachable from the network it is on. Ray's own switch for single-machine use
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on macOS and Windows) makes the node's
address 127.0.0.1. It is read by the driver when ray.init resolves the node address, and by
every process Ray starts, which inherit the environment of the moment: we set it only around
ray.init, so other code in this process (e.g. a test starting its own cluster) is unaffected.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from contextlib import contextmanager

SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextmanager
def loopback_ray(enabled: bool = True) -> Iterator[None]:
    """Within the block, a Ray node started by ray.init() takes 127.0.0.1 as its address."""
    if not enabled:
        yield
        return
    from ray._private import ray_constants

    saved_env, saved_const = os.environ.get(SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_const
        if saved_env is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = saved_env
