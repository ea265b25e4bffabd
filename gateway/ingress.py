"""Which front takes the HTTP requests: Serve's Python proxy, or HAProxy straight to the gateways.

- `proxy` (Ray Serve's default): Serve's proxy actor parses HTTP and passes each request, and
  each streamed SSE event back, through a Ray call to a Gateway replica.
- `haproxy`: Ray's high-throughput mode (Ray >= 2.55): HAProxy listens on the port and forwards
  each connection to a Gateway replica's own HTTP server (Serve's direct ingress), and Serve's
  throughput settings are on (user code on the replica's own event loop, gRPC between
  deployments). The Python proxy leaves the path: `prefixgate bench serving --ingress proxy
  haproxy` measures both (docs/benchmarks.md, "The serving path").

Ray reads these switches from the environment when its processes import Serve, so they are set
in this process before Ray starts, and Ray's processes inherit them. A cluster joined with
`--ray-address` runs with what its nodes were started with (docs/deploy.md).
"""

from __future__ import annotations

import os
import sys

from gateway.http_guard import CALLBACK, CALLBACK_ENV
from gateway.local_redis import free_port

INGRESSES = ("proxy", "haproxy")
DEFAULT_INGRESS = "proxy"
_SERVE_CONSTANTS = "ray.serve._private.constants"


# How long a stopping gateway stays reachable before it closes its listener (then it drains its
# requests as any replica does, for up to drain_timeout_s). Ray's default, 30 s, gives an external
# load balancer time to deregister it; HAProxy here is Serve's own and reloads in well under a
# second, and a stack's whole stop must fit 30 s (with Ray's 30 s: a SIGTERM under load took 24 s
# to stop the stack, against 6 s behind Serve's proxy).
DEREGISTRATION_S = 2.0


def ray_env(ingress: str, stats_port: int = 0, metrics_port: int = 0) -> dict[str, str]:
    """The environment Ray's processes need for `ingress`. HAProxy's manager actor
    reports ready only once HAProxy runs, which took over 15 s on 2 busy cores: Serve's 5 s
    readiness timeout (three misses and the proxy is killed) is raised to a minute. HAProxy's
    stats page and Prometheus exporter take fixed ports by default (8404, 9101), which a second
    stack on the machine would also take: `apply` gives them free ones."""
    if ingress not in INGRESSES:
        raise ValueError(f"ingress must be one of {', '.join(INGRESSES)}, not {ingress!r}")
    on = ingress == "haproxy"
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1" if on else "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1" if on else "0",
           CALLBACK_ENV: CALLBACK}  # both fronts: header bytes Serve cannot decode get a 400 (gateway/http_guard.py)
    if on:
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = str(DEREGISTRATION_S)
        env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "60"
        if stats_port:
            env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(stats_port)
        if metrics_port:
            env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(metrics_port)
    return env


def apply(ingress: str) -> None:
    """Sets `ingress`'s environment for the Ray this process is about to start. Raises when
    Serve was already imported here with the other setting: its switches are read once."""
    env = ray_env(ingress, free_port(), free_port()) if ingress == "haproxy" else ray_env(ingress)
    constants = sys.modules.get(_SERVE_CONSTANTS)
    if constants is not None and bool(constants.RAY_SERVE_ENABLE_HA_PROXY) != (ingress == "haproxy"):
        raise RuntimeError(f"ingress {ingress!r} must be chosen before Ray Serve is imported in this process")
    os.environ.update(env)
