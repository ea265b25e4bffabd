"""Latency objectives (issue 52, first slice): the x-slo-ttft-ms / x-slo-tpot-ms headers and their
400s, defaults per API key and per service tier (header > key > tier), the verdict from the
gateway's timings, and the prefixgate_slo_* metrics: pure pieces here, then one live app of sim
replicas beside the session stack, a request that certainly meets its objectives and one that
certainly misses its TTFT (the sim's prefill takes 200 ms; the objective is 1 ms).

No wall-clock thresholds: verdicts in the pure tests come from given timestamps, and the live
test waits on its events (the gateway's /metrics, Ray's export) with hang guards only."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY

from gateway.cli import _serve_args, config_from_args
from gateway.config import AppConfig
from gateway.errors import APIError
from gateway.flow.keys import parse_keys
from gateway.flow.slo import (
    MAX_MS,
    TPOT_HEADER,
    TTFT_HEADER,
    Objectives,
    header_objectives,
    resolve,
    tier_defaults,
)
from gateway.flow.tiers import TIERS
from gateway.slo_watch import SloWatch, judge, tpot_s
from replica.default_model import DEFAULT_MODEL_NAME
from tests.helpers.metrics import scrape
from tests.helpers.slo import ask, metric_sum, samples
from tests.helpers.stack import side_app, wait_until


# ---- the headers ------------------------------------------------------------------------------
@pytest.mark.parametrize("header", [TTFT_HEADER, TPOT_HEADER])
@pytest.mark.parametrize("raw", ["0", "-1", "1.5", "abc", str(MAX_MS + 1), "", "1e3", "+5", "99999999999999999999"])
def test_a_bad_objective_is_a_400_naming_the_header(header, raw):
    with pytest.raises(APIError) as e:
        header_objectives({header: raw})
    body = e.value.body()["error"]
    assert e.value.status == 400 and body["param"] == header and body["code"] == "invalid_value", body
    assert header in body["message"] and body["type"] == "invalid_request_error", body


def test_good_objectives_are_read_from_the_headers():
    assert header_objectives({}) == Objectives() and not Objectives().any
    assert header_objectives({TTFT_HEADER: "1", TPOT_HEADER: str(MAX_MS)}) == Objectives(1, MAX_MS)
    assert header_objectives({TTFT_HEADER: " 250 "}) == Objectives(ttft_ms=250)  # as HTTP trims it
    assert header_objectives({TPOT_HEADER: "40"}).any


# ---- header > key > tier ----------------------------------------------------------------------
def test_each_objective_comes_from_the_header_else_the_key_else_the_tier():
    header, key, tier = Objectives(100, None), Objectives(2000, 50), Objectives(9000, 90)
    assert resolve(header, key, tier) == Objectives(100, 50)  # the key fills what the header left out
    assert resolve(Objectives(), key, tier) == Objectives(2000, 50)
    assert resolve(Objectives(), Objectives(None, 60), tier) == Objectives(9000, 60)
    assert resolve(Objectives(), None, tier) == Objectives(9000, 90)  # no API keys: the tier's
    assert resolve(Objectives(None, 7), None, None) == Objectives(None, 7)
    assert not resolve(Objectives(), Objectives(), Objectives()).any  # nothing anywhere: none


def test_key_file_objectives_are_checked_where_the_file_is_loaded():
    table = parse_keys({"sk-a": "acme", "sk-b": {"tenant": "bravo", "slo_ttft_ms": 800, "slo_tpot_ms": 40}})
    assert table.keys["sk-b"].objectives == Objectives(800, 40)
    assert not table.keys["sk-a"].objectives.any
    for bad, says in (({"slo_ttft_ms": 0}, "slo_ttft_ms must be"), ({"slo_tpot_ms": MAX_MS + 1}, "slo_tpot_ms must be"),
                      ({"slo_ttft_ms": 1.5}, "Expected `int"), ({"slo_ttfb_ms": 5}, "unknown field")):
        with pytest.raises(ValueError, match=says):
            parse_keys({"sk-c": {"tenant": "c", **bad}})


def _serve(*argv: str) -> AppConfig:
    """The AppConfig `prefixgate serve ARGV` builds."""
    import argparse

    p = argparse.ArgumentParser()
    _serve_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_tier_objectives_from_the_command_line_and_a_serve_config(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-q": {"tenant": "q", "slo_tpot_ms": 70}}))
    config = _serve("--slo-ttft-ms", "priority=300", "--slo-ttft-ms", "default=2000", "--slo-tpot-ms", '{"flex": 500}',
                    "--api-keys", str(keys))
    assert config.slo_ttft_ms == {"priority": 300, "default": 2000} and config.slo_tpot_ms == {"flex": 500}
    tiers = tier_defaults(config.slo_ttft_ms, config.slo_tpot_ms, TIERS)
    assert tiers == {"priority": Objectives(300), "default": Objectives(2000), "flex": Objectives(None, 500)}
    key = parse_keys(config.api_keys).keys["sk-q"].objectives
    assert resolve(Objectives(), key, tiers["default"]) == Objectives(2000, 70)
    # a Serve config file's args
    serve_yaml = tmp_path / "serve.yaml"
    serve_yaml.write_text(yaml.safe_dump({"applications": [{"name": "prefixgate", "import_path": "gateway.app:app_builder",
                                                            "args": {"engine": "sim", "slo_ttft_ms": {"flex": 60000},
                                                                     "slo_tpot_ms": {"priority": 25}}}]}))
    args = yaml.safe_load(serve_yaml.read_text())["applications"][0]["args"]
    served = AppConfig.from_dict(args)
    assert (served.slo_ttft_ms, served.slo_tpot_ms) == ({"flex": 60000}, {"priority": 25})
    for bad, says in (({"slo_ttft_ms": {"gold": 5}}, "unknown service tier 'gold'"),
                      ({"slo_ttft_ms": {"auto": 5}}, "unknown service tier 'auto'"),
                      ({"slo_tpot_ms": {"flex": 0}}, r"slo_tpot_ms\[flex\] must be"),
                      ({"slo_tpot_ms": {"flex": 2.5}}, r"slo_tpot_ms\[flex\] must be"),
                      ({"slo_ttft_ms": {"default": MAX_MS + 1}}, r"slo_ttft_ms\[default\] must be")):
        with pytest.raises(ValueError, match=says):
            AppConfig.from_dict(bad)
    with pytest.raises(ValueError, match=r"slo_ttft_ms\[priority\] must be"):
        _serve("--slo-ttft-ms", "priority=fast")


# ---- the verdict --------------------------------------------------------------------------------
def test_verdicts_from_timings():
    assert tpot_s(10.0, 11.0, 11) == pytest.approx(0.1) and tpot_s(10.0, 11.0, 1) is None
    v = judge(Objectives(500, 100), ttft_s=0.4, tpot_s=0.1)
    assert (v.ttft_met, v.tpot_met, v.good) == (True, True, True)  # exactly on the objective is met
    v = judge(Objectives(500, 100), ttft_s=0.6, tpot_s=0.05)
    assert (v.ttft_met, v.tpot_met, v.good) == (False, True, False)
    v = judge(Objectives(None, 100), ttft_s=9.0, tpot_s=None)  # one token: no interval to miss
    assert (v.ttft_met, v.tpot_met, v.good) == (None, True, True)


def _local(name: str, **labels: str) -> float:
    """A sample of this process's registry (the metrics are local=True), 0 when absent."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_watch_judges_the_latest_choice_and_records_once():
    """A non-streamed request and a streamed one are timed alike: first token and end per choice,
    as the gateway receives them; with n = 2 the later choice decides."""
    model, tenant = f"m-{uuid.uuid4().hex[:6]}", "t"
    labels = {"model_name": model, "tenant": tenant, "tier": "default"}
    w = SloWatch(Objectives(300, 50), model, tenant, "default", arrival=100.0, choices=2)
    w.first_token(0, 100.1)
    w.first_token(1, 100.25)
    w.ended(0, 100.6, 11)  # 50 ms per token
    w.ended(1, 101.25, 11)  # 100 ms per token: misses TPOT
    w.ended(1, 105.0, 11)  # a later report of the same end is ignored
    w.close()
    w.close()
    assert w.verdict is not None and w.verdict.ttft_s == pytest.approx(0.25) and w.verdict.tpot_s == pytest.approx(0.1)
    assert _local("prefixgate_slo_requests_total", **labels) == 1
    assert _local("prefixgate_slo_met_total", **labels, objective="ttft") == 1
    assert _local("prefixgate_slo_met_total", **labels, objective="tpot") == 0
    assert _local("prefixgate_slo_met_total", **labels, objective="both") == 0
    assert _local("prefixgate_slo_objectives_total", **labels, objective="both") == 1
    assert _local("prefixgate_slo_goodput_requests_total", **labels) == 0
    ratio = {"model_name": model, "tier": "default"}
    assert _local("prefixgate_slo_observed_ratio_count", **ratio, objective="tpot") == 1
    assert _local("prefixgate_slo_observed_ratio_sum", **ratio, objective="tpot") == pytest.approx(2.0)
    # refused by the queue: had its objective, met nothing, no ratio; a client that left: no verdict
    shed = SloWatch(Objectives(300), model, tenant, "flex", arrival=0.0, choices=1)
    shed.failed(429)
    shed.close()
    left = SloWatch(Objectives(300), model, tenant, "flex", arrival=0.0, choices=1)
    left.first_token(0, 0.1)
    left.close()
    flex = {**labels, "tier": "flex"}
    assert _local("prefixgate_slo_requests_total", **flex) == 1
    assert _local("prefixgate_slo_objectives_total", **flex, objective="ttft") == 1
    assert _local("prefixgate_slo_met_total", **flex, objective="ttft") == 0
    assert _local("prefixgate_slo_observed_ratio_count", model_name=model, tier="flex", objective="ttft") == 0


# ---- a live app ----------------------------------------------------------------------------------
APP = "slo"
KEYS = {"sk-slo": {"tenant": "latency"}, "sk-plain": "plain"}
# the sim's service model: every prefill takes at least 200 ms, so a 1 ms TTFT is certainly missed
SIM_SERVICE = {"prefill_overhead_s": 0.2, "decode_step_s": 0.01}


@pytest.fixture(scope="module")
def slo_app(stack):
    """Sim replicas behind a gateway configured as a Serve config's args (a flex default TTFT
    objective, the key file); yields its URL and its /metrics before any request."""
    args = {"redis_url": stack.config.redis_url, "key_prefix": f"slo-{uuid.uuid4().hex[:6]}", "engine": "sim",
            "replicas": 1, "num_blocks": 256, "block_size": 16, "max_model_len": 4096, "redis_timeout_s": 1.0,
            "api_keys": KEYS, "sim_service": SIM_SERVICE, "slo_ttft_ms": {"flex": MAX_MS}}
    with side_app(stack, APP, AppConfig.from_dict(args)) as url:
        yield url, httpx.get(f"{url}/metrics", timeout=30).text


def _judged(url: str, n: int) -> str:
    """The gateway's /metrics once `n` requests with objectives were judged (a stream is judged as
    its generator closes, after [DONE] went out)."""
    def check() -> str | None:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return text if metric_sum(text, "prefixgate_slo_requests_total") >= n else None

    return wait_until(f"{n} requests judged", check, timeout_s=120)


def test_slo_series_are_exported_at_zero_from_start_up(slo_app, stack):
    _, before = slo_app
    for name in ("prefixgate_slo_requests_total", "prefixgate_slo_goodput_requests_total"):
        seen = {(lb["tenant"], lb["tier"]): v for lb, v in samples(before, name) if lb["model_name"] == DEFAULT_MODEL_NAME}
        assert seen == {(t, tier): 0.0 for t in ("latency", "plain") for tier in TIERS}, (name, seen)
    for name in ("prefixgate_slo_met_total", "prefixgate_slo_objectives_total"):
        objectives = {lb["objective"] for lb, v in samples(before, name) if v == 0}
        assert objectives == {"ttft", "tpot", "both"}, (name, objectives)
    # and through Ray's export, which the dashboard reads (Ray exports on an interval)
    wait_until("the zeroed SLO counters in Ray's export", lambda: any(
        labels.get("application") == APP and labels.get("tenant") == "plain"
        for labels, _ in scrape(stack.metrics_port).get("ray_prefixgate_slo_goodput_requests_total", [])),
        timeout_s=120)


def test_objectives_met_and_missed_are_counted(slo_app):
    url, _ = slo_app
    bad = ask(url, "sk-slo", {TTFT_HEADER: "1.5"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == TTFT_HEADER, bad.text
    plain = ask(url, "sk-plain")  # no objective anywhere: not counted
    assert plain.status_code == 200, plain.text
    met = ask(url, "sk-slo", {TTFT_HEADER: str(MAX_MS), TPOT_HEADER: str(MAX_MS)})  # not streamed: TPOT still counts
    assert met.status_code == 200 and met.json()["usage"]["completion_tokens"] == 8, met.text
    missed = ask(url, "sk-slo", {TTFT_HEADER: "1", TPOT_HEADER: str(MAX_MS)}, stream=True)
    assert missed.status_code == 200 and "[DONE]" in missed.text, missed.text

    text = _judged(url, 2)
    mine = {"model_name": DEFAULT_MODEL_NAME, "tenant": "latency", "tier": "default"}
    assert metric_sum(text, "prefixgate_slo_requests_total") == 2 == metric_sum(text, "prefixgate_slo_requests_total", **mine)
    assert metric_sum(text, "prefixgate_slo_met_total", **mine, objective="ttft") == 1
    assert metric_sum(text, "prefixgate_slo_met_total", **mine, objective="tpot") == 2
    assert metric_sum(text, "prefixgate_slo_met_total", **mine, objective="both") == 1
    assert metric_sum(text, "prefixgate_slo_objectives_total", **mine, objective="both") == 2
    assert metric_sum(text, "prefixgate_slo_goodput_requests_total") == 1
    ratios = {lb["objective"]: v for lb, v in samples(text, "prefixgate_slo_observed_ratio_count")}
    assert ratios == {"ttft": 2, "tpot": 2}, ratios
    # the met one lies within 100x its objective, the missed one beyond (its 200 ms prefill against 1 ms)
    assert metric_sum(text, "prefixgate_slo_observed_ratio_bucket", objective="ttft", le="100.0") == 1

    # the tier's default from the Serve config: a flex request of a key without objectives
    flex = ask(url, "sk-plain", service_tier="flex")
    assert flex.status_code == 200 and flex.json()["service_tier"] == "flex", flex.text
    text = _judged(url, 3)
    assert metric_sum(text, "prefixgate_slo_requests_total", tenant="plain", tier="flex") == 1
    assert metric_sum(text, "prefixgate_slo_met_total", tenant="plain", tier="flex", objective="ttft") == 1
    assert metric_sum(text, "prefixgate_slo_objectives_total", tenant="plain", tier="flex", objective="tpot") == 0
