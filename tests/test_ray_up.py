"""`ray up infra/cluster-onprem.yaml` for real, against this machine over SSH on loopback:
the file's own setup (prefixgate installed from the synced checkout, Redis with a generated
password), `serve deploy` of infra/serve-config.yaml, a chat answer through the cluster, then
`ray down`.

The "node" is a throwaway unprivileged account reached through a private sshd on 127.0.0.1:
the cluster file runs `ray stop`, which as root would stop every Ray on the machine (other
tests', other people's); as its own account it can only stop its own processes. The "laptop"
side (`ray up`) runs with its own HOME and Ray temp dir, so ~/.ray of this account stays
untouched. Only what must differ on one shared machine is set, in the node account's
~/.bashrc, through the variables the cluster file documents: free ports instead of Ray's
fixed defaults, loopback addresses, and PREFIXGATE_REUSE_VENV so the install reuses this
checkout's venv instead of downloading torch again.
"""

from __future__ import annotations

import copy
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import redis
import yaml

from gateway.local_redis import free_port, free_ports

pytestmark = pytest.mark.cluster  # `ray up` over SSH on loopback

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
APT_PACKAGES = {"/usr/sbin/sshd": "openssh-server", "/usr/bin/rsync": "rsync"}


def sh(cmd: list[str], timeout: float, env: dict | None = None, check: bool = True) -> str:
    """Run a command to completion (bounded), returning stdout+stderr; fail with its output."""
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{out[-6000:]}")
    return out


def ensure_packages() -> None:
    """openssh-server and rsync from Debian's packages (CI runs as root with apt reachable)."""
    missing = [pkg for path, pkg in APT_PACKAGES.items() if not Path(path).exists()]
    if missing:
        sh(["apt-get", "update", "-qq"], timeout=300)
        sh(["apt-get", "install", "-y", "-qq", *missing], timeout=300,
           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


class Node:
    """A throwaway account, its sshd on a loopback port, and everything they started."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.user = f"pgrayup{secrets.token_hex(3)}"
        self.home = workdir / "h"  # short: Ray's socket paths live under it
        self.ssh_port = free_port()
        self.sshd: subprocess.Popen | None = None
        self.uid: int | None = None

    def create(self, bashrc: str) -> None:
        # '*': no password, yet not a locked account (sshd without PAM refuses locked ones).
        sh(["useradd", "--no-create-home", "--home-dir", str(self.home), "--shell", "/bin/bash",
            "--password", "*", self.user], timeout=30)
        self.uid = pwd.getpwnam(self.user).pw_uid
        ssh_dir = self.home / ".ssh"
        ssh_dir.mkdir(parents=True)
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.workdir / "key")], timeout=30)
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.workdir / "hostkey")], timeout=30)
        (ssh_dir / "authorized_keys").write_text((self.workdir / "key.pub").read_text())
        (self.home / ".bashrc").write_text(bashrc)
        sh(["chown", "-R", f"{self.user}:{self.user}", str(self.home)], timeout=30)
        ssh_dir.chmod(0o700)
        (ssh_dir / "authorized_keys").chmod(0o600)

    def start_sshd(self, timeout_s: float = 30) -> None:
        config = self.workdir / "sshd_config"
        config.write_text(
            f"Port {self.ssh_port}\nListenAddress 127.0.0.1\nHostKey {self.workdir / 'hostkey'}\n"
            f"PidFile {self.workdir / 'sshd.pid'}\nAllowUsers {self.user}\nUsePAM no\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
            "AuthorizedKeysFile .ssh/authorized_keys\nMaxStartups 50\nMaxSessions 50\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        log = open(self.workdir / "sshd.log", "w")
        self.sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.sshd.poll() is None, (self.workdir / "sshd.log").read_text()
            try:
                import socket

                socket.create_connection(("127.0.0.1", self.ssh_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"sshd not listening on {self.ssh_port}")

    def proxy_command(self) -> str:
        """ssh's ProxyCommand to our sshd's port (Ray's cluster config has no SSH port)."""
        proxy = self.workdir / "ssh-proxy"
        proxy.write_text(f"#!/bin/bash\nexec 3<>/dev/tcp/127.0.0.1/{self.ssh_port}\ncat <&3 &\ncat >&3\n")
        proxy.chmod(0o755)
        return str(proxy)

    def processes(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["uids"]):
            try:
                if self.uid is not None and proc.info["uids"].real == self.uid:
                    found.append(proc)
            except (psutil.NoSuchProcess, AttributeError):
                pass
        return found

    def destroy(self) -> list[int]:
        """Every process of the account (all ours by construction), sshd, the account."""
        left = [p.pid for p in self.processes()]
        for proc in self.processes():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(self.processes(), timeout=10)
        if self.sshd is not None:
            self.sshd.terminate()
            try:
                self.sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait(timeout=10)
        if self.uid is not None:
            subprocess.run(["userdel", self.user], capture_output=True, timeout=30)
        return left


def node_python(workdir: Path) -> tuple[str, str]:
    """(interpreter, LD_LIBRARY_PATH) the node account may run, of this very Python build (C
    extensions and pure-Python version checks must agree with the reused venv): the venv's own
    when every directory above it lets others in, else a hard-linked copy of its installation
    (a pyenv under /root is closed to other accounts; its binary's RUNPATH points there)."""
    base = Path(os.path.realpath(sys.executable))
    if all(p.stat().st_mode & stat.S_IXOTH for p in (base, *base.parents)):
        return str(base), ""
    prefix, copy_ = Path(sys.base_prefix), workdir / "py"
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (copy_ / "bin").mkdir(parents=True)
    sh(["cp", "-al", str(prefix / "lib"), str(copy_ / "lib")], timeout=120)
    sh(["cp", "-al", str(prefix / "bin" / ver), str(copy_ / "bin" / ver)], timeout=60)
    return str(copy_ / "bin" / ver), str(copy_ / "lib")


def load_listeners():
    import importlib.util

    spec = importlib.util.spec_from_file_location("listeners", ROOT / "infra" / "scripts" / "listeners.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def redis_env(node: Node) -> dict[str, str]:
    path = node.home / ".prefixgate" / "redis.env"
    return dict(line.split("=", 1) for line in path.read_text().split())


def files_containing(root: Path, needle: bytes, skip: tuple[str, ...] = (".venv", ".git")) -> list[str]:
    hits = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            path = Path(dirpath) / name
            try:
                if path.is_file() and needle in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                pass
    return hits


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_up_onprem_cluster_serves_chat_with_locked_redis(default_model_dir):
    assert os.geteuid() == 0, "this test creates an account and an sshd: run it as root (CI does)"
    ensure_packages()
    workdir = Path(tempfile.mkdtemp(prefix="pgru-", dir="/tmp"))
    workdir.chmod(0o755)
    node = Node(workdir)
    laptop = workdir / "laptop"
    (laptop / ".ray").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(laptop), RAY_TMPDIR=str(workdir / "lt"), RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}")
    ray = str(BIN / "ray")
    cluster_file = workdir / "cluster.yaml"
    names = ("gcs", "redis", "http", "dashboard", "client", "node-manager", "object-manager",
             "agent-listen", "agent-grpc", "runtime-env", "metrics")
    ports = dict(zip(names, free_ports(len(names)), strict=True))  # distinct: Ray refuses a port given twice
    steps: list[str] = []
    t0 = time.monotonic()

    def step(name: str) -> None:
        steps.append(name)
        print(f"[ray-up test {time.monotonic() - t0:5.0f}s] {name}", flush=True)
    try:
        # The node account's settings, in the variables the cluster file reads (see its header).
        cache = node.home / "cache"
        python, ld_path = node_python(workdir)
        start_args = " ".join([
            "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=0",
            '--resources={"replica_node":1}',  # head-only cluster: replicas may run here
            f"--dashboard-port={ports['dashboard']}", f"--ray-client-server-port={ports['client']}",
            f"--node-manager-port={ports['node-manager']}", f"--object-manager-port={ports['object-manager']}",
            f"--dashboard-agent-listen-port={ports['agent-listen']}",
            f"--dashboard-agent-grpc-port={ports['agent-grpc']}",
            f"--runtime-env-agent-port={ports['runtime-env']}", f"--metrics-export-port={ports['metrics']}",
        ])
        bashrc = "\n".join([
            f"export PREFIXGATE_REUSE_VENV={sys.prefix}",
            f"export PREFIXGATE_PYTHON={python}",
            f"export LD_LIBRARY_PATH={ld_path}",
            f"export PREFIXGATE_CACHE={cache}",
            "export PREFIXGATE_REDIS_BIND=127.0.0.1",
            f"export PREFIXGATE_REDIS_PORT={ports['redis']}",
            f"export PREFIXGATE_RAY_PORT={ports['gcs']}",
            f"export PREFIXGATE_RAY_START_ARGS='{start_args}'",
            f"export RAY_TMPDIR={node.home}/t",
            "export RAY_USAGE_STATS_ENABLED=0 RAY_enable_worker_prestart=0",
            # A one-node cluster on one machine: Ray's single-machine switch keeps it on 127.0.0.1.
            "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0",
            "",
        ])
        node.create(bashrc)
        # The converted default model, copied (its weights are readable by their owner only):
        # no second conversion.
        cache.mkdir()
        sh(["cp", "-r", default_model_dir, str(cache / Path(default_model_dir).name)], timeout=120)
        sh(["chown", "-R", f"{node.user}:{node.user}", str(cache)], timeout=30)
        node.start_sshd()
        sh([ray, "get-auth-token", "--generate"], timeout=60, env=env)

        config = yaml.safe_load((ROOT / "infra" / "cluster-onprem.yaml").read_text())
        config["cluster_name"] = f"pg-{node.user}"
        config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
        config["max_workers"] = 0
        config["auth"] = {"ssh_user": node.user, "ssh_private_key": str(workdir / "key"),
                          "ssh_proxy_command": node.proxy_command()}
        cluster_file.write_text(yaml.safe_dump(config))

        step("ray up")
        up = sh([ray, "up", "-y", "--no-config-cache", str(cluster_file)], timeout=420, env=env)
        assert "prefixgate from" in up and str(node.home / "prefixgate") in up, up[-4000:]

        # Redis: password generated on the head into a file only the node account can read.
        secret = redis_env(node)
        password = secret["PREFIXGATE_REDIS_PASSWORD"]
        assert len(password) == 64
        assert secret["PREFIXGATE_REDIS_HOST"] == "127.0.0.1"
        for name in ("redis.env", "redis.conf"):
            mode = stat.S_IMODE((node.home / ".prefixgate" / name).stat().st_mode)
            assert mode == 0o600, (name, oct(mode))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=ports["redis"], socket_timeout=5).ping()
        authed = redis.Redis(host="127.0.0.1", port=ports["redis"], password=password, socket_timeout=5)
        assert authed.config_get("bind")["bind"] == "127.0.0.1"
        assert authed.config_get("protected-mode")["protected-mode"] == "yes"

        # The repo's Serve config, sized for this machine's CPU; redis_url stays as written.
        serve_cfg = yaml.safe_load((ROOT / "infra" / "serve-config.yaml").read_text())
        serve_cfg["http_options"] = {"host": "127.0.0.1", "port": ports["http"]}
        app = serve_cfg["applications"][0]
        args = copy.deepcopy(app["args"])
        args.update(device="cpu", replica_num_gpus=0, replica_num_cpus=0.5, replicas=1, torch_threads=1,
                    kv_cache_mb=64, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                    gateway_num_cpus=0.5, default_max_tokens=32)
        app["args"] = args
        assert "${PREFIXGATE_REDIS_PASSWORD}" in args["redis_url"]
        serve_file = workdir / "serve.yaml"
        serve_file.write_text(yaml.safe_dump(serve_cfg))
        serve_file.chmod(0o644)

        step("serve deploy")
        sh([ray, "exec", str(cluster_file),
            f"serve deploy -a http://127.0.0.1:{ports['dashboard']} {serve_file}"], timeout=180, env=env)
        base = f"http://127.0.0.1:{ports['http']}"
        deadline, last = time.monotonic() + 240, None
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{base}/health", timeout=10)
                if r.status_code == 200 and r.json()["checks"].get("redis") == "ok":  # serving and routing by the index
                    break
                last = r.text
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(2)
        else:
            status = sh([ray, "exec", str(cluster_file), f"serve status -a http://127.0.0.1:{ports['dashboard']}"],
                        timeout=120, env=env, check=False)
            pytest.fail(f"app not healthy: {last}\n{status[-4000:]}")

        step("chat")
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, headers={"x-session-id": "rayup"}, json={
            "model": args["model_name"], "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        })
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        # Serve's proxy on the node runs the header guard its `ray start` was given (gateway/http_guard.py)
        r = httpx.get(f"{base}/health", headers=[(b"x-session-id", b"a\xffb")], timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-id", r.text
        # The replica reached Redis with the password: its heartbeat and blocks are there.
        assert any(True for _ in authed.scan_iter(match=f"{args['key_prefix']}*", count=1000))

        # What listens where on the "cluster": Redis on its bind address, the dashboard (and
        # the REST API `serve deploy` uses) on loopback only.
        names = {}
        for proc in node.processes():
            try:
                names[proc.pid] = " ".join(proc.cmdline())[:60] or proc.name()
            except psutil.Error:
                pass
        rows = load_listeners().listening(names)
        for x in rows:
            print(f"[ray-up test] listening {x.address}:{x.port} {x.name}")
        by_port = {x.port: x for x in rows}
        assert by_port[ports["redis"]].address == "127.0.0.1"
        assert by_port[ports["dashboard"]].loopback, by_port[ports["dashboard"]]

        # The password is in no file of the repo or of the synced checkout, in no Serve config
        # file, and in no config Serve keeps (it stores redis_url unexpanded).
        needle = password.encode()
        assert files_containing(ROOT, needle) == []
        assert files_containing(node.home / "prefixgate", needle) == []
        assert needle not in serve_file.read_bytes()
        deployed = sh([ray, "exec", str(cluster_file), f"serve config -a http://127.0.0.1:{ports['dashboard']}"],
                      timeout=120, env=env)
        assert "${PREFIXGATE_REDIS_PASSWORD}" in deployed and password not in deployed

        step("ray down")
        sh([ray, "exec", str(cluster_file), "bash ~/prefixgate/infra/scripts/redis-stop.sh"], timeout=120, env=env)
        sh([ray, "down", "-y", str(cluster_file)], timeout=180, env=env)
        with pytest.raises(redis.ConnectionError):
            redis.Redis(host="127.0.0.1", port=ports["redis"], password=password, socket_timeout=5).ping()
        deadline = time.monotonic() + 60
        while node.processes() and time.monotonic() < deadline:
            time.sleep(1)
        alive = [(p.pid, " ".join(p.cmdline())[:120]) for p in node.processes()]
        assert alive == [], f"left running after ray down: {json.dumps(alive, indent=1)}"
        step("done")
    finally:
        if steps and steps[-1] != "done" and cluster_file.exists():
            subprocess.run([ray, "down", "-y", str(cluster_file)], env=env, capture_output=True, timeout=180)
        leftovers = node.destroy()
        if steps and steps[-1] == "done" and not leftovers:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"ray up test stopped at {steps[-1:]}; files kept in {workdir}; killed {leftovers}")
