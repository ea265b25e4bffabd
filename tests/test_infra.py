"""infra/: the cluster files pass Ray's own cluster-config checks, the Serve configs pass Serve's
schema and build the app, and a real two-node Ray cluster on this machine serves a session
with replicas on the worker node and the gateway on the head."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from gateway import http_guard

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
CLUSTER_FILES = ["cluster.yaml", "cluster-onprem.yaml"]
SERVE_FILES = ["serve-config.yaml", "serve-local.yaml", "serve-vllm.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((INFRA / name).read_text())


def all_commands(config: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands",
            "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
    cmds = [c for k in keys for c in config.get(k, [])]
    for node in config.get("available_node_types", {}).values():
        cmds += [c for k in keys for c in node.get(k, [])]
    return cmds


# ---- (1) ray up cluster files -----------------------------------------------------------------
@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_file_passes_rays_validation(name):
    """What `ray up` runs before it contacts a provider: defaults merged, then Ray's schema
    (ray/autoscaler/ray-schema.json) and its cross-field checks."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(load(name)))
    validate_config(prepared)
    assert prepared["max_workers"] >= 1


def test_onprem_file_bootstraps_like_ray_up():
    """The local provider needs no cloud: run `ray up`'s whole config bootstrap."""
    from ray.autoscaler._private.commands import _bootstrap_config

    config = _bootstrap_config(load("cluster-onprem.yaml"), no_config_cache=True)
    (node_type,) = config["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(config["provider"]["worker_ips"])


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_commands(name):
    config = load(name)
    text = (INFRA / name).read_text()
    for cmd in all_commands(config):
        check = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
        assert check.returncode == 0, f"{cmd!r}: {check.stderr}"
    head = " ".join(config["head_start_ray_commands"])
    workers = " ".join(config["worker_start_ray_commands"])
    port = re.search(r"ray start --head --port=(\$\{PREFIXGATE_RAY_PORT:-(\d+)\})", head)
    assert port.group(2) != "6379", "Ray's GCS must leave 6379 to Redis on the head"
    assert f"$RAY_HEAD_IP:{port.group(1)}" in workers
    # Serve's HTTP servers on every node get the header guard (gateway/http_guard.py)
    guard = f"{http_guard.CALLBACK_ENV}={http_guard.CALLBACK} ray start"
    assert guard in head and guard in workers
    # Ray 2.60 enables token auth on a head: every node needs the mode and the same token.
    assert "export RAY_AUTH_MODE=token" in " ".join(config["setup_commands"])
    assert "~/.ray/auth_token" in config["file_mounts"]
    # Nothing to edit: the synced checkout is what gets installed, on every node.
    assert "CHANGE-ME" not in text and "git+" not in text
    assert config["file_mounts"]["~/prefixgate"] == "."
    assert ".gitignore" in config["rsync_filter"]
    assert "infra/scripts/node-install.sh" in " ".join(config["setup_commands"])
    # Redis locked down by the head's own script; Ray starts with its password in the env.
    assert config["head_setup_commands"] == ["bash ~/prefixgate/infra/scripts/redis-start.sh"]
    assert ". ~/.prefixgate/redis.env" in head
    # Nothing listens on every interface but Serve's HTTP port (infra/serve-config.yaml).
    assert "0.0.0.0" not in " ".join(all_commands(config)) and "--dashboard-host=127.0.0.1" in head
    assert "systemctl" not in " ".join(all_commands(config))  # the script decides, with a fallback
    for script in ("node-install.sh", "redis-start.sh", "redis-stop.sh"):
        check = subprocess.run(["bash", "-n", str(INFRA / "scripts" / script)], capture_output=True, text=True)
        assert check.returncode == 0, f"{script}: {check.stderr}"


@pytest.mark.redis  # the script starts a redis-server
def test_redis_start_script_locks_redis_down(tmp_path):
    """infra/scripts/redis-start.sh as a head runs it (here without systemd: the daemonized
    fallback): a generated password in mode-600 files, the given address only, protected mode;
    a second run keeps the password; redis-stop.sh stops it."""
    import redis

    from gateway.local_redis import free_port

    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path), "PREFIXGATE_REDIS_BIND": "127.0.0.1",
           "PREFIXGATE_REDIS_PORT": str(port)}
    start, stop = (str(INFRA / "scripts" / s) for s in ("redis-start.sh", "redis-stop.sh"))
    try:
        passwords, pids, outputs = [], [], []
        for _ in range(2):
            run = subprocess.run(["bash", start], env=env, capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, run.stderr
            secret = dict(ln.split("=", 1) for ln in (tmp_path / ".prefixgate" / "redis.env").read_text().split())
            passwords.append(secret["PREFIXGATE_REDIS_PASSWORD"])
            pids.append(int((tmp_path / ".prefixgate" / "redis.pid").read_text()))
            outputs.append(run.stderr)
        first = passwords[0]
        assert passwords == [first, first] and len(first) == 64
        # The second run (`ray up --no-restart`) keeps the running server, and so the index.
        assert pids[0] == pids[1] and "already running" in outputs[1] and secret == {"PREFIXGATE_REDIS_PASSWORD": first,
                                               "PREFIXGATE_REDIS_HOST": "127.0.0.1",
                                               "PREFIXGATE_REDIS_PORT": str(port)}
        assert first not in run.stdout + run.stderr
        for name in ("redis.env", "redis.conf"):
            assert (tmp_path / ".prefixgate" / name).stat().st_mode & 0o077 == 0, name
        assert (tmp_path / ".prefixgate").stat().st_mode & 0o077 == 0
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong", socket_timeout=5).ping()
        client = redis.Redis(port=port, password=first, socket_timeout=5)
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        pid = int((tmp_path / ".prefixgate" / "redis.pid").read_text())
        assert first not in " ".join(psutil_cmdline(pid))  # the password is in no command line
    finally:
        subprocess.run(["bash", stop], env=env, capture_output=True, timeout=60)
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, password=first, socket_timeout=5).ping()


def psutil_cmdline(pid: int) -> list[str]:
    import psutil

    return psutil.Process(pid).cmdline()


def test_replicas_fit_gpu_workers_only():
    """infra/serve-config.yaml's replica request fits every GPU worker type of cluster.yaml and
    never the head: the two files must agree on the custom resource."""
    cluster, args = load("cluster.yaml"), load("serve-config.yaml")["applications"][0]["args"]
    need = {"CPU": args["replica_num_cpus"], "GPU": args["replica_num_gpus"], **args["replica_resources"]}
    types = cluster["available_node_types"]
    head = types.pop(cluster["head_node_type"])
    assert any(head["resources"].get(k, 0) < v for k, v in need.items())
    assert types
    for name, node in types.items():
        assert all(node["resources"].get(k, 0) >= v for k, v in need.items()), name
    onprem = " ".join(load("cluster-onprem.yaml")["worker_start_ray_commands"])
    assert all(k in onprem for k in args["replica_resources"])


# ---- (2) Serve config files -------------------------------------------------------------------
def autoscaling_example() -> list[dict]:
    """The `deployments:` block that serve-config.yaml documents commented out."""
    lines = (INFRA / "serve-config.yaml").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "# deployments:")
    block = []
    for ln in lines[start:]:
        if not ln.lstrip().startswith("#"):
            break
        block.append(ln.replace("# ", "", 1))
    return yaml.safe_load("\n".join(block))["deployments"]


@pytest.mark.parametrize("name", SERVE_FILES)
def test_serve_config_builds(name, monkeypatch):
    # What the head's Ray has in its environment (infra/scripts/redis-start.sh writes it).
    monkeypatch.setenv("PREFIXGATE_REDIS_PASSWORD", "f00d" * 16)
    monkeypatch.setenv("PREFIXGATE_REDIS_HOST", "10.0.0.10")
    monkeypatch.setenv("PREFIXGATE_REDIS_PORT", "6379")
    import ray
    from ray.serve._private.build_app import build_app
    from ray.serve.schema import ServeDeploySchema

    from gateway.app import app_builder
    from gateway.config import AppConfig

    schema = ServeDeploySchema.model_validate(load(name))
    (app_config,) = schema.applications
    assert app_config.import_path == "gateway.app:app_builder"
    AppConfig.from_dict(app_config.args)  # every arg is a setting (unknown names raise)

    # Building the Application must not need a cluster: `serve deploy` builds it in a task.
    def no_ray(*_, **__):
        raise AssertionError("building the app started Ray")

    if not ray.is_initialized():
        monkeypatch.setattr(ray, "init", no_ray)
    built = build_app(app_builder(app_config.args), name=app_config.name)
    built.validate_single_fastapi_ingress()
    deployments = {d.name: d for d in built.deployments}
    assert set(deployments) == {"Gateway", "PrefixCacheReplica"}
    assert built.ingress_deployment_name == "Gateway"
    replica = deployments["PrefixCacheReplica"]
    args = app_config.args
    assert replica.num_replicas == args["replicas"]
    assert replica.ray_actor_options["num_gpus"] == args["replica_num_gpus"]
    assert replica.ray_actor_options.get("resources", {}) == args.get("replica_resources", {})
    if args.get("engine") == "vllm":  # vLLM replicas run in the vLLM venv's interpreter
        assert replica.ray_actor_options["runtime_env"]["py_executable"].endswith(".venv-vllm/bin/python")
    if name == "serve-config.yaml":  # the password reaches the app only through the environment
        assert "${PREFIXGATE_REDIS_PASSWORD}" in args["redis_url"]
        assert AppConfig.from_dict(args).redis_url == f"redis://:{'f00d' * 16}@10.0.0.10:6379/0"
        monkeypatch.delenv("PREFIXGATE_REDIS_PASSWORD")
        with pytest.raises(ValueError, match="PREFIXGATE_REDIS_PASSWORD"):
            AppConfig.from_dict(args)

    overrides = [d.model_dump(exclude_unset=True) for d in app_config.deployments]
    if name == "serve-config.yaml":
        overrides += autoscaling_example()
    for override in overrides:  # Serve applies these by deployment name, over the code's options
        options = dict(override)
        target = deployments[options.pop("name")]
        target.options(**options)


def test_serve_local_matches_cli_defaults():
    """serve-local.yaml is `prefixgate serve` with its defaults, written down."""
    from gateway.config import AppConfig

    args, defaults = load("serve-local.yaml")["applications"][0]["args"], AppConfig()
    for key in ("replicas", "policy", "block_size", "kv_cache_mb", "max_model_len", "device", "publish_depth"):
        assert args[key] == getattr(defaults, key), key


# ---- (3) two Ray nodes on this machine --------------------------------------------------------
@pytest.mark.cluster  # two Ray nodes (tests/multinode_driver.py)
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_multinode_cluster_routes_session_back_to_worker_replica():
    """tests/multinode_driver.py runs the cluster in its own process (the in-process Ray of
    other tests would clash with a second driver connection) and reports what it saw."""
    workdir = Path(tempfile.mkdtemp(prefix="pgmn-", dir="/tmp"))  # short: Ray's socket paths
    out = workdir / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, str(ROOT / "tests" / "multinode_driver.py"), "--out", str(out), "--workdir", str(workdir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the driver tears its cluster down on SIGTERM
        try:
            output, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        leftovers = kill_leftovers(workdir)
        pytest.fail(f"multi-node driver timed out; killed leftovers {leftovers}; logs in {workdir}\n{output[-4000:]}")
    leftovers = kill_leftovers(workdir)
    assert out.exists(), f"no report (exit {proc.returncode}); logs in {workdir}\n{output[-4000:]}"
    report = json.loads(out.read_text())
    assert report["ok"], f"{report.get('error')}\nlogs in {workdir}\n{output[-4000:]}"
    assert report["left_alive"] == [] and leftovers == [], "processes left after teardown"

    worker, head = report["worker_node"], report["head_node"]
    assert worker != head
    assert len(report["replicas"]) == 2 and set(report["replicas"].values()) == {worker}
    assert report["gateway_nodes"] == [head]

    turn1, turn2 = report["turns"]
    assert turn1["replica"] in report["replicas"]
    assert turn1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Turn 1's replica (worker node) published its blocks to Redis; the router (head node)
    # found them there and sent turn 2 back to it, where the prefix was cached.
    assert report["published_blocks"][turn1["replica"]] > 0
    assert turn2["replica"] == turn1["replica"]
    assert turn2["route"] == "prefix"
    assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert any('reason="prefix"' in ln for ln in report["route_metrics"])
    shutil.rmtree(workdir, ignore_errors=True)


def kill_leftovers(workdir: Path) -> list[int]:
    """Processes the driver recorded (pid + start time, so a reused pid is never hit), or whose
    command line names our private Ray temp dir, that are still running."""
    import psutil

    pids_file = workdir / "pids.json"
    recorded = json.loads(pids_file.read_text()) if pids_file.exists() else {}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        try:
            ours = recorded.get(str(proc.pid)) == proc.info["create_time"]
            ours = ours or str(workdir) in " ".join(proc.info["cmdline"] or [])
            if ours and proc.pid != os.getpid() and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                found.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return found


# ---- (4) a local stack keeps to loopback ------------------------------------------------------
def test_loopback_ray_switch_is_scoped(monkeypatch):
    """Within loopback_ray() a Ray node started here takes 127.0.0.1 as its address; outside,
    Ray's own resolution (the machine's address) and the environment are as they were."""
    import ray
    from ray._private import services

    from gateway.loopback import SWITCH, is_loopback, loopback_ray

    if ray.is_initialized():  # the session's stack answers for its own node: ask Ray's resolver
        monkeypatch.setattr(ray._private.worker, "_global_node", None)
    monkeypatch.delenv(SWITCH, raising=False)
    with loopback_ray():
        assert services.get_node_ip_address() == "127.0.0.1"
        assert os.environ[SWITCH] == "0"  # inherited by the processes ray.init starts
    assert SWITCH not in os.environ
    outside = services.get_node_ip_address()  # this machine's address (ENVIRONMENT: not loopback)
    with loopback_ray(enabled=False):
        assert services.get_node_ip_address() == outside
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.10") and not is_loopback("example")


def load_listeners():
    import importlib.util

    spec = importlib.util.spec_from_file_location("listeners", INFRA / "scripts" / "listeners.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_local_stack_listens_on_loopback_only(stack):
    """The session's stack (LocalStack, host 127.0.0.1, as `prefixgate serve`): Ray's node is
    127.0.0.1 and every socket its processes listen on (GCS, raylet, agents, workers, Serve's
    controller and proxy) is on loopback, as `ss -ltnp` reports them, but one per Serve replica:
    Serve's inter-deployment gRPC server, which Ray 2.60 binds to "[::]:0" with no setting
    (ray/serve/_private/replica.py)."""
    import collections

    import ray

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    rows = load_listeners().listeners(os.getpid())
    assert any(x.port == stack.port and x.loopback for x in rows), rows  # Serve's HTTP proxy
    assert len(rows) >= 5, rows
    beyond = [x for x in rows if not x.loopback]
    assert all(x.name.startswith("ray::ServeReplica:") for x in beyond), beyond
    assert max(collections.Counter(x.pid for x in beyond).values(), default=0) <= 1, beyond
