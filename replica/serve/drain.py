"""Graceful drain of a replica: the order of steps when Serve scales it down or shuts it down.

Serve first stops routing to the replica and waits for its ongoing requests (up to the
deployment's graceful_shutdown_timeout_s), then calls the replica's __del__, which runs this:
refuse new work, hand off what still runs (each caller gets a retryable 503 chunk and the
gateway continues the request on another replica), retract the replica's blocks and heartbeat
from the index so no router sends prefix traffic here any more, and stop the engine.
A replica killed before this runs (SIGKILL, or the timeout spent) loses its heartbeat within
the heartbeat TTL; the gateway continues its requests the same way.
"""

from __future__ import annotations

import logging

log = logging.getLogger("prefixgate.replica")


async def drain_replica(replica) -> None:
    replica.draining = True
    handed = 0
    try:
        handed = await replica.backend.hand_off("replica is shutting down")
    except Exception as e:  # the engine already stopped: nothing left to hand off
        log.debug("hand-off skipped: %r", e)
    if replica.publisher is not None:
        await replica.publisher.stop(unregister=True)  # bounded even if Redis is away
    replica.backend.shutdown()
    log.info("replica %s drained: %d request(s) handed off, blocks retracted", replica.replica_id, handed)
