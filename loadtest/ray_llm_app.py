"""Ray Serve LLM's own OpenAI app on vLLM's CPU engine: the baseline rows of
`prefixgate loadtest headtohead` (loadtest/headtohead.py).

Runs in the vLLM venv (`.venv-vllm/bin/python loadtest/ray_llm_app.py ...`; the main venv has
no vLLM). Starts a Ray node of its own (`ray.init(address="local")`, exporting every process's
metrics at --metrics-port), `serve.run`s `build_openai_app` with one `LLMConfig` (N replicas of
`LLMServer`, vLLM engine kwargs as given) on 127.0.0.1:--port, prints one line

    [ray-llm] ready http://127.0.0.1:PORT metrics http://127.0.0.1:MPORT/metrics startup 41.2s

once /v1/models answers, and serves until SIGTERM or SIGINT; then shuts down Serve and Ray and
reaps the node's processes, leaving nothing running, and exits 0.

--router prefix: Ray's `PrefixCacheAffinityRouter` is the deployment's request router;
--router pow2: Ray Serve's default (power of two choices on queue length);
--router kv: Ray's `KVAwareRouter` (alpha): an `LLMRouter` ingress replica tokenizes each
request and scores the replicas with NVIDIA Dynamo's selection service (`ai-dynamo-runtime`)
on their vLLM KV events; HAProxy then streams the request straight to the chosen replica's own
vLLM server. Ray runs it only on that direct-streaming path, so KV_ENV is set before Ray is
imported; Ray itself turns the engines' KV events on (`kv_events_config`, ZMQ publishers at
--kv-events-port-base + replica rank, replay sockets 1000 above) and pins PYTHONHASHSEED=0 so
every replica hashes blocks alike. Ray 2.60's tokenizer imports a vLLM name that vLLM 0.32
moved: loadtest/ray_kv_shim.py re-exports it, in this process and (as the job's
worker_process_setup_hook) in every Ray worker. The ready line then also names the Ray session
directory, whose logs hold the router's "Selected worker" lines (one per scored request).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

APP_NAME = "ray-llm"
PREFIX_ROUTER = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
KV_ROUTER = "ray.serve.llm.request_router:KVAwareRouter"
ROUTERS = ("prefix", "pow2", "kv")
# Ray 2.60 runs KVAwareRouter only on its direct-streaming path (HAProxy in front of each
# replica's own vLLM server, the request body forwarded to the ingress router); read at import.
KV_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
          "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}
KV_SHIM_HOOK = "loadtest.ray_kv_shim.install"

# vLLM's CPU backend: one thread per replica, not pinned (the cores are shared), 1 GiB of K/V
# space (the pool itself is num_gpu_blocks_override); without VLLM_CPU_KVCACHE_SPACE and
# gpu_memory_utilization < 1 it refuses to start on this machine.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "dtype": "float32", "enforce_eager": True, "block_size": args.block_size,
        "enable_prefix_caching": True, "num_gpu_blocks_override": args.num_blocks,
        "max_model_len": args.max_model_len, "gpu_memory_utilization": 0.5,
        "seed": 0,
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
    }


def llm_config(args: argparse.Namespace):
    from ray.serve.llm import LLMConfig

    deployment: dict = {"num_replicas": args.replicas}
    extra: dict = {}
    if args.router == "prefix":
        deployment["request_router_config"] = {"request_router_class": PREFIX_ROUTER}
    elif args.router == "kv":
        # Ray adds kv_events_config (enable_kv_cache_events, zmq publisher, endpoint and replay
        # endpoint, offset per replica) and PYTHONHASHSEED=0 when it sees this router; prefix
        # caching must stay on (it is) for the engines to emit block events.
        deployment["request_router_config"] = {"request_router_class": KV_ROUTER}
        extra["experimental_configs"] = {"KV_EVENTS_PORT_BASE": args.kv_events_port_base,
                                         "KV_TOKEN_PORT_BASE": args.kv_token_port_base}
    return LLMConfig(
        model_loading_config={"model_id": args.model_name, "model_source": args.model},
        accelerator_config={"kind": "cpu"},
        engine_kwargs=engine_kwargs(args),
        deployment_config=deployment,
        runtime_env={"env_vars": dict(ENGINE_ENV)},
        log_engine_metrics=True,
        **extra,
    )


def ports_free(ports: list[int]) -> bool:
    import socket

    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # the KV sockets bind every interface
            except OSError:
                return False
    return True


def kv_port_bases(replicas: int, start: int = 25557, step: int = 97, tries: int = 200) -> tuple[int, int]:
    """Free bases for the KV-event publishers (base + rank, replay at base + 1000 + rank) and
    the prompt-token channel (base + rank): Ray's defaults (5557, 7557) are fixed ports that a
    second Ray Serve LLM app on the machine would also take."""
    found: list[int] = []
    base = start
    for _ in range(tries):
        spans = [base, base + 1000] if not found else [base]
        if ports_free([b + r for b in spans for r in range(replicas)]):
            found.append(base)
            if len(found) == 2:
                return found[0], found[1]
        base += step
    raise RuntimeError("no free ports for the KV events and the token channel")


def build(args: argparse.Namespace):
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": [llm_config(args)]})


def session_dir() -> str:
    """This node's Ray session directory (its logs/ holds every worker's output)."""
    try:
        import ray

        return ray._private.worker._global_node.get_session_dir_path()
    except Exception:
        return "-"


def wait_ready(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/v1/models", timeout=5)
            if r.status_code == 200 and r.json().get("data"):
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except Exception as e:  # not listening yet
            last = repr(e)
        time.sleep(1.0)
    raise RuntimeError(f"not ready after {timeout_s:.0f}s: {last}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", choices=list(ROUTERS), default="prefix")
    p.add_argument("--model", default=None, help="model directory (default: the bundled converted SmolLM2)")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=192, help="K/V blocks per replica (num_gpu_blocks_override)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="vLLM's step budget (default: vLLM's own, 2048 on CPU)")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the Ray node (scheduling only)")
    p.add_argument("--timeout", type=float, default=900.0, help="start-up limit, seconds")
    p.add_argument("--kv-events-port-base", type=int, default=None, help="--router kv: default a free one")
    p.add_argument("--kv-token-port-base", type=int, default=None, help="--router kv: default a free one")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.router == "kv":
        # before anything imports Ray: Serve's and Serve LLM's constants read these at import
        os.environ.update(KV_ENV)
        if args.kv_events_port_base is None or args.kv_token_port_base is None:
            events, tokens = kv_port_bases(args.replicas)
            args.kv_events_port_base = args.kv_events_port_base or events
            args.kv_token_port_base = args.kv_token_port_base or tokens
        from loadtest import ray_kv_shim

        ray_kv_shim.install()

    from gateway import shutdown
    from gateway.loopback import loopback_ray
    from gateway.stack import reap

    shutdown.install()  # SIGTERM/SIGINT raise ShutdownRequested, start-up included
    t0 = time.monotonic()
    os.environ.update(ENGINE_ENV)  # Ray's processes inherit it (and the replicas get runtime_env)
    if args.model is None:
        from replica.default_model import default_model_dir

        args.model = str(default_model_dir())
    started = False
    code = 0
    try:
        import ray
        from ray import serve

        # --router kv: every Ray worker of this job (the LLMRouter replica too) installs the shim
        job_env = {"worker_process_setup_hook": KV_SHIM_HOOK} if args.router == "kv" else None
        with shutdown.keep_handlers(), loopback_ray(True):
            ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                     _metrics_export_port=args.metrics_port, runtime_env=job_env)
        started = True
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build(args), name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{args.port}"
        wait_ready(url, args.timeout)
        print(f"[ray-llm] ready {url} metrics http://127.0.0.1:{args.metrics_port}/metrics "
              f"startup {time.monotonic() - t0:.1f}s router {args.router} session {session_dir()}", flush=True)
        while True:  # until a signal raises ShutdownRequested here
            time.sleep(3600)
    except (shutdown.ShutdownRequested, KeyboardInterrupt) as e:
        print(f"[ray-llm] {e or 'interrupted'}: shutting down", flush=True)
    except Exception as e:
        print(f"[ray-llm] failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        shutdown.ignore()  # the stop is bounded: no signal cuts it short
        import psutil

        if started:
            from ray import serve

            try:
                serve.shutdown()
            except Exception as e:
                print(f"[ray-llm] serve.shutdown: {e!r}", file=sys.stderr, flush=True)
        # everything below this process is ours: Ray's node, its workers, vLLM's engine cores
        # (spawned by the replicas, titled VLLM::EngineCore, not Ray's)
        own = psutil.Process().children(recursive=True)
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()
        reap(own)
        print("[ray-llm] stopped", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
