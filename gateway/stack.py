"""Brings the whole stack up on one machine: Redis (unless given), local Ray, the Serve app."""

from __future__ import annotations

import logging
import os
import time

import httpx
import psutil

from gateway.config import AppConfig
from gateway.health import serve_problems
from gateway.ingress import DEFAULT_INGRESS, apply
from gateway.local_redis import LocalRedis
from gateway.loopback import is_loopback, loopback_ray
from gateway.shutdown import keep_handlers
from gateway.startup import StackNotReady, not_ready_report

log = logging.getLogger("prefixgate.stack")
APP_NAME = "prefixgate"


def require_redis(url: str, timeout_s: float = 5.0) -> None:
    """A stack pointed at a Redis that does not answer would run without its index: every route
    `stale`, no heartbeats for flow control, nothing published. Say so before starting it."""
    import redis

    from router.index.redis_index import redact

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    except redis.RedisError as e:
        raise RuntimeError(f"no Redis answers at {redact(url)} ({e}): start one there, or set redis_url to "
                           "'auto' for one the stack starts itself") from None
    finally:
        client.close()


class LocalStack:
    def __init__(self, config: AppConfig, port: int = 8000, host: str = "127.0.0.1", ray_address: str | None = None,
                 metrics_port: int | None = None, ingress: str = DEFAULT_INGRESS) -> None:
        self.config = config
        self.ingress = ingress  # gateway/ingress.py: Serve's proxy or HAProxy, for a Ray this stack starts
        self.port, self.host = port, host
        self.ray_address = ray_address
        self.metrics_port = metrics_port  # the local Ray node's Prometheus export port (None: Ray picks)
        self.redis: LocalRedis | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> LocalStack:
        if not self.ray_address:
            apply(self.ingress)  # before Serve is imported here
        import ray
        from ray import serve


        if self.config.redis_url in (None, "", "auto"):
            self.redis = LocalRedis()  # kept before it starts: a stop during start-up stops it too
            self.redis.start()
            self.config.redis_url = self.redis.url
        else:
            require_redis(self.config.redis_url)
        if not ray.is_initialized():
            with keep_handlers():  # ray.init installs its own SIGTERM handler (gateway/shutdown.py)
                if self.ray_address:
                    ray.init(address=self.ray_address, log_to_driver=False)
                else:
                    extra = {"_metrics_export_port": self.metrics_port} if self.metrics_port else {}
                    # A loopback --host keeps Ray's node on 127.0.0.1 too (docs/deploy.md, "What listens
                    # where"). address="local": always a node of our own, never one a stale
                    # /tmp/ray/ray_current_cluster (left by some `ray start`) points at.
                    with loopback_ray(is_loopback(self.host)):
                        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                                 log_to_driver=False, **extra)
        serve.start(http_options={"host": self.host, "port": self.port})
        self.deploy(self.config, timeout_s)
        return self

    def deploy(self, config: AppConfig, timeout_s: float = 300.0, name: str = APP_NAME, route_prefix: str = "/") -> str:
        """(Re)deploy an app with new settings (e.g. another policy), or a second app beside it
        under another name and route prefix; waits until it answers and returns its base URL."""
        from ray import serve

        from gateway.app import build_app

        if config.redis_url in (None, "", "auto") and self.redis is not None:
            config.redis_url = self.redis.url
        if name == APP_NAME:
            self.config = config
        try:
            serve.run(build_app(config), name=name, route_prefix=route_prefix, blocking=False)
        except RuntimeError as e:  # DEPLOY_FAILED: say which deployment failed and why
            raise StackNotReady(not_ready_report(timeout_s, str(e), config, name)) from None
        base = self.url + route_prefix.rstrip("/")
        self.wait_ready(timeout_s, base, config, name)
        return base

    def wait_ready(self, timeout_s: float = 300.0, base: str | None = None, config: AppConfig | None = None,
                   name: str = APP_NAME) -> None:
        base = base or self.url
        config = config or self.config
        headers = {"authorization": f"Bearer {next(iter(config.api_keys))}"} if config.api_keys else {}
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{base}/v1/models", timeout=5, headers=headers)
                if r.status_code == 200:
                    r = httpx.get(f"{base}/health", timeout=10)
                    # ready: a replica answers, and Serve has every replica of every deployment
                    # up (one gateway of several answering is not the whole app)
                    try:
                        problems = serve_problems(name) if r.status_code == 200 else []
                    except Exception as e:  # the controller is busy: ask again
                        problems = [f"Serve status unavailable: {type(e).__name__}: {e}"]
                    if r.status_code == 200 and not problems:
                        return
                    last = f"{r.text}; Serve: {'; '.join(problems)}" if r.status_code == 200 else r.text
                else:
                    last = r.text
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(1.0)
        raise StackNotReady(not_ready_report(timeout_s, last, config, name))

    def stop(self) -> None:
        """Stop whatever start() got to: Serve's apps, Ray (the local node's processes with
        it), the local Redis. Safe at any point of start-up and more than once. Serve's part is
        bounded by the replicas' drain plus a margin, so the whole stop fits a 30 s grace period
        (Kubernetes' default) with the default drain_timeout_s."""
        import ray

        try:
            if ray.is_initialized():
                _shutdown_serve(self.config.drain_timeout_s + SERVE_STOP_MARGIN_S)
        finally:
            try:
                own = node_processes() if not self.ray_address else []
                ray.shutdown()  # also after a start-up stopped inside ray.init
                reap(own)
            finally:
                if self.redis is not None:
                    self.redis.cleanup()


# Serve's stop beyond the replicas' drain: the controller's own teardown. Past it (a controller
# that is gone or wedged, e.g. killed by a signal sent to every process of a cgroup) the stop
# goes on with Ray's.
SERVE_STOP_MARGIN_S = 4.0


def _shutdown_serve(timeout_s: float) -> None:
    """serve.shutdown(), waiting at most `timeout_s` for the controller (Ray's own wait is 30 s)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    try:
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception:  # no controller to reach: nothing of Serve's to stop in order
        client = None
    if client is not None:
        client.shutdown(timeout_s=timeout_s)
    serve.shutdown()  # forgets the client (its shutdown is done)


def node_processes() -> list[psutil.Process]:
    """Ray's processes among this process's descendants: the node this driver started (GCS,
    raylet, and what they start: agents, workers, replicas), found by what they run (Ray's own
    binaries or a `ray::` title), so a stop during ray.init, before Ray holds a handle on its
    node, finds them too."""
    import ray

    ray_dir = os.path.dirname(ray.__file__)
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if cmd and (cmd[0].startswith("ray::") or any(part.startswith(ray_dir) for part in cmd)):
            out.append(p)
    return out


def reap(procs: list[psutil.Process], grace_s: float = 5.0) -> None:
    """After ray.shutdown(): the node's agents notice their raylet is gone only on their own
    check (seen here: DashboardAgent and RuntimeEnvAgent still running a minute later on a
    loaded machine). Give each process grace_s to exit, then SIGTERM, then SIGKILL."""
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for sig in ("terminate", "kill"):
        for p in alive:
            try:
                getattr(p, sig)()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=5.0)
    if alive:
        log.warning("Ray processes still running after SIGKILL: %s", [p.pid for p in alive])

