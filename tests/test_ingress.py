"""gateway/ingress.py: the environment each HTTP front needs from Ray, set before Serve reads it."""

from __future__ import annotations

import os
import sys
import types

import pytest

from gateway import ingress


def test_each_front_sets_rays_switches_both_ways():
    on = ingress.ray_env("haproxy")
    assert on["RAY_SERVE_ENABLE_HA_PROXY"] == on["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    # a stopping gateway is held reachable only briefly: the stack's stop fits 30 s
    assert float(on["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) == ingress.DEREGISTRATION_S < 30
    off = ingress.ray_env("proxy")  # explicit zeros: an exported 1 in the user's shell does not leak in
    assert off == {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0",
                   "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "gateway.http_guard.proxy_middlewares"}
    assert on["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == off["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]
    with pytest.raises(ValueError, match="proxy, haproxy"):
        ingress.ray_env("envoy")


def test_apply_sets_the_environment_and_refuses_after_serve_was_imported(monkeypatch):
    for key in ingress.ray_env("haproxy", 1, 2):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delitem(sys.modules, ingress._SERVE_CONSTANTS, raising=False)
    ingress.apply("haproxy")
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    # HAProxy's stats and Prometheus listeners on ports of their own, not Ray's fixed 8404 and 9101
    ports = {int(os.environ["RAY_SERVE_HAPROXY_STATS_PORT"]), int(os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"])}
    assert len(ports) == 2 and not ports & {8404, 9101}
    # Serve already imported with HAProxy off: its switches are read once, so this is an error
    monkeypatch.setitem(sys.modules, ingress._SERVE_CONSTANTS,
                        types.SimpleNamespace(RAY_SERVE_ENABLE_HA_PROXY=False))
    with pytest.raises(RuntimeError, match="before Ray Serve is imported"):
        ingress.apply("haproxy")
    ingress.apply("proxy")  # the same setting as imported: nothing to refuse
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
