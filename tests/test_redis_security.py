"""Redis with a password and over TLS, from the URL alone; secrets never shown in messages."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest
import redis

from gateway.local_redis import free_port
from router.index.redis_index import IndexUnavailable, RedisConfig, RedisIndex, redact
from tests.helpers.index import FakeReplica, _matched, eventually

pytestmark = pytest.mark.redis  # redis-servers of its own (password, TLS)


def _start(args: list[str], tmp_path, ready: redis.Redis) -> subprocess.Popen:
    proc = subprocess.Popen(
        [shutil.which("redis-server"), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:  # wait until our server (not whatever else had the port) answers
        try:
            if ready.ping():
                return proc
        except (redis.ConnectionError, redis.TimeoutError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def _index_roundtrip(url: str, prefix: str = "sec") -> None:
    async def scenario():
        replica = FakeReplica(url, prefix, "ra")
        replica.publisher.start()
        index = RedisIndex(RedisConfig(url, prefix, timeout_s=0.5))
        try:
            hashes = replica.run(list(range(12)))
            await eventually(lambda: _matched(index, hashes, "ra", 3), timeout=10)
        finally:
            await replica.publisher.stop()
            await index.close()

    asyncio.run(scenario())


def test_password_from_url(tmp_path):
    port = free_port()
    proc = _start(["--port", str(port), "--requirepass", "s3cret-pw"], tmp_path,
                  redis.Redis(port=port, password="s3cret-pw", socket_timeout=1))
    try:
        _index_roundtrip(f"redis://:s3cret-pw@127.0.0.1:{port}/0")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong").ping()

        async def wrong_password():
            index = RedisIndex(RedisConfig(f"redis://:wrong@127.0.0.1:{port}/0", "sec", timeout_s=0.5))
            with pytest.raises(IndexUnavailable) as err:
                await index.lookup([1], ["ra"], None)
            assert "wrong" not in str(err.value)
            await index.close()

        asyncio.run(wrong_password())
    finally:
        _stop(proc)


def test_redact_hides_the_password():
    assert redact("redis://:pw@host:6379/0") == "redis://:***@host:6379/0"
    assert redact("rediss://user:pw@host/1") == "rediss://user:***@host/1"
    assert redact("redis://host:6379") == "redis://host:6379"


def test_tls_from_url(tmp_path):
    key, cert = tmp_path / "server.key", tmp_path / "server.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    port = free_port()
    proc = _start(["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                   "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", "--requirepass", "tls-pw"], tmp_path,
                  redis.Redis(host="127.0.0.1", port=port, password="tls-pw", ssl=True, ssl_ca_certs=str(cert), socket_timeout=1,
                              socket_connect_timeout=1))
    try:
        _index_roundtrip(f"rediss://:tls-pw@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}")
        with pytest.raises(redis.ConnectionError):  # plaintext is refused on the TLS port
            redis.Redis(port=port, password="tls-pw", socket_timeout=2).ping()
    finally:
        _stop(proc)
