"""`prefixgate bench goodput`: the fixed mix, objectives and capacity from a calibration, the
attainment and goodput arithmetic and the summary figures on hand-made results (pure), the
stream reader against a local HTTP server, and one short real run through the CLI on 2 sim
replicas."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from gateway.local_redis import free_port
from loadtest.bench.goodput import coverage
from loadtest.bench.goodput_mix import (
    BATCH_PROMPT_TOKENS,
    CLASSES,
    DOCUMENTS,
    SYSTEM_PROMPT_TOKENS,
    Mix,
    arrivals,
)
from loadtest.bench.goodput_score import (
    ClassCalibration,
    ClassResult,
    Outcome,
    StepResult,
    at_rate,
    capacity,
    crossing,
    objectives,
    score,
    summary,
)

ROOT = Path(__file__).resolve().parents[1]
PREFIXGATE = Path(sys.executable).parent / "prefixgate"


# ---- the mix ----------------------------------------------------------------------------------
def test_class_shares_over_many_draws():
    mix, rng = Mix(), random.Random(0)
    counts = Counter(mix.pick(rng).name for _ in range(20000))
    for c in CLASSES:
        assert abs(counts[c.name] / 20000 - c.share) < 0.015, counts


def test_lengths_outputs_and_tiers_are_the_issues():
    mix, rng = Mix(), random.Random(1)
    seen = {"chat": set(), "rag": set()}
    for _ in range(3000):
        r = mix.draw(rng)
        n = len(r.prompt)
        if r.cls == "chat":
            assert 200 + 16 <= n <= 600 + 64 and r.max_tokens == 64 and r.tier is None
            assert r.prompt[:len(mix.system_prompts[r.prefix])] == mix.system_prompts[r.prefix]
        elif r.cls == "rag":
            assert 2000 <= n <= 4000 and r.max_tokens == 128 and r.tier is None
            assert r.prompt[:len(mix.documents[r.prefix])] == mix.documents[r.prefix]
        else:
            assert n == BATCH_PROMPT_TOKENS and r.max_tokens == 256 and r.tier == "flex" and r.prefix == -1
        if r.cls in seen:
            seen[r.cls].add(r.prefix)
    assert seen == {"chat": set(range(len(SYSTEM_PROMPT_TOKENS))), "rag": set(range(DOCUMENTS))}
    assert sorted(len(p) for p in mix.system_prompts) == [200, 330, 470, 600]
    assert all(1900 < len(d) < 4000 for d in mix.documents)


def test_documents_are_shared_and_fixed_whatever_the_seed():
    """The shared prefixes are the same ids in every Mix (not drawn from the run's seed), all
    distinct; two requests over one document share it exactly, their questions differ."""
    a, b = Mix(), Mix()
    assert a.documents == b.documents and a.system_prompts == b.system_prompts
    assert len({d for d in a.documents}) == DOCUMENTS
    r1, r2 = a.request("rag", random.Random(5)), a.request("rag", random.Random(5))
    assert r1 == r2  # a request is its rng's
    rng = random.Random(7)
    same = [r for r in (a.request("rag", rng) for _ in range(200)) if r.prefix == 0]
    assert len(same) >= 2 and same[0].prompt != same[1].prompt
    assert {r.prompt[:len(a.documents[0])] for r in same} == {a.documents[0]}
    assert len(a.warmers()) == len(SYSTEM_PROMPT_TOKENS) + DOCUMENTS


def test_length_scale_shrinks_the_prompts_only():
    full, small = Mix(), Mix(0.125)
    assert [len(p) for p in small.system_prompts] == [25, 41, 59, 75]
    assert max(len(d) for d in small.documents) == round(max(len(d) for d in full.documents) * 0.125)
    assert small.longest() < full.longest() <= 8192
    r = small.request("batch", random.Random(0))
    assert len(r.prompt) == 125 and r.max_tokens == 256
    with pytest.raises(ValueError):
        Mix(0)


def test_arrivals_are_the_seeds():
    mix = Mix(0.125)
    one = arrivals(mix, 5.0, 10.0, 1, 3)
    assert one == arrivals(mix, 5.0, 10.0, 1, 3)  # every mode gets these
    assert one != arrivals(mix, 5.0, 10.0, 2, 3) and one != arrivals(mix, 5.0, 10.0, 1, 4)
    offsets = [t for t, _ in one]
    assert offsets == sorted(offsets) and all(0 <= t < 10.0 for t in offsets)
    many = arrivals(mix, 20.0, 500.0, 1, 1)
    assert abs(len(many) / 10000 - 1) < 0.05  # Poisson at the rate


# ---- calibration, scoring, summary ------------------------------------------------------------
CAL = {"chat": ClassCalibration(ttft_p50_ms=51.2, tpot_p50_ms=25.5, burst_rps=6.0, n=5),
       "rag": ClassCalibration(ttft_p50_ms=80.0, tpot_p50_ms=25.0, burst_rps=3.0, n=5),
       "batch": ClassCalibration(ttft_p50_ms=180.0, tpot_p50_ms=26.0, burst_rps=1.5, n=5)}


def test_objectives_are_multiples_of_the_unloaded_p50s():
    assert objectives(CAL) == {"chat": {"ttft_ms": 154, "tpot_ms": 51}, "rag": {"ttft_ms": 400, "tpot_ms": 75}}


def test_capacity_weights_each_class_burst_throughput_by_its_share():
    assert capacity(CAL) == pytest.approx(1 / (0.6 / 6.0 + 0.3 / 3.0 + 0.1 / 1.5))
    same = {k: ClassCalibration(1, 1, 4.0, 1) for k in CAL}
    assert capacity(same) == pytest.approx(4.0)


def test_attainment_and_goodput_of_a_window():
    objs = objectives(CAL)  # chat 154/51 ms, rag 400/75 ms
    outs = [
        Outcome("chat", ttft_s=0.100, tpot_s=0.040, tokens=64),  # both
        Outcome("chat", ttft_s=0.200, tpot_s=0.040, tokens=64),  # TTFT missed
        Outcome("chat", ttft_s=0.100, tpot_s=0.060, tokens=64),  # TPOT missed
        Outcome("chat", refused="slo_unattainable"),  # a 429 meets nothing
        Outcome("rag", ttft_s=0.400, tpot_s=0.075, tokens=128),  # both, at the objectives exactly
        Outcome("rag", failed="incomplete"),
        Outcome("batch", ttft_s=5.0, tpot_s=1.0, tokens=256),  # no objectives: not in the overall
        Outcome("batch", refused="server_overloaded"),
    ]
    s = score(outs, objs, rate=2.0, window_s=4.0)
    chat, rag, batch = s.classes["chat"], s.classes["rag"], s.classes["batch"]
    assert (chat.requests, chat.ttft_met, chat.tpot_met, chat.both_met, chat.refused) == (4, 2, 2, 1, 1)
    assert (rag.requests, rag.both_met, rag.failed, rag.attainment) == (2, 1, 1, 0.5)
    assert (batch.requests, batch.refused, batch.both_met, batch.attainment, batch.ttft_attainment) == (2, 1, 0, None, None)
    assert (s.overall.requests, s.overall.both_met, s.overall.refused, s.overall.failed) == (6, 2, 1, 1)
    assert s.attainment == pytest.approx(2 / 6) and s.overall.ttft_attainment == pytest.approx(3 / 6)
    assert s.overall.tpot_attainment == pytest.approx(3 / 6)
    assert s.goodput == pytest.approx(2 / 4.0) and s.sent == 8
    assert chat.ttft_p50_ms == pytest.approx(100) and s.overall.ttft_p99_ms == pytest.approx(200 + (400 - 200) * 0.97)
    d = s.as_dict()
    assert d["overall"]["attainment"] == pytest.approx(2 / 6) and d["classes"]["rag"]["attainment"] == 0.5
    assert score([], objs, 1.0, 1.0).attainment is None
    assert d["classes"]["chat"]["refusals"] == {"slo_unattainable": 1}
    assert d["classes"]["batch"]["refusals"] == {"server_overloaded": 1}


def test_coverage_of_a_step_is_the_difference_of_the_gateways_counters():
    before = {"ttft": (10.0, 9.0), "tpot": (10.0, 8.0)}
    after = {"ttft": (30.0, 27.0), "tpot": (10.0, 8.0), "new": (4.0, 1.0)}
    assert coverage(before, after) == {"ttft": pytest.approx(0.9), "tpot": None, "new": 0.25}


def test_crossings_interpolate_between_measured_rates():
    pts = [(1.0, 1.0), (2.0, 0.95), (3.0, 0.85), (4.0, 0.40)]
    c = crossing(pts, 0.90)
    assert c.how == "interpolated" and c.rate == pytest.approx(2.5)
    assert crossing(pts, 0.80).rate == pytest.approx(3 + 0.05 / 0.45)
    assert crossing(list(reversed(pts)), 0.90).rate == pytest.approx(2.5)  # any order
    assert crossing(pts, 0.30) == crossing(pts, 0.30).__class__(4.0, "not reached")
    assert crossing(pts, 1.01).how == "below at every rate" and crossing(pts, 1.01).rate is None
    assert crossing([(2.0, 0.95), (3.0, 0.99), (4.0, 0.5)], 0.9).rate == pytest.approx(3 + 0.09 / 0.49)
    # a dip at a lower rate (cold caches at the first step) does not end the hold: the last fall counts
    assert crossing([(1.0, 0.80), (2.0, 0.95), (3.0, 0.85), (4.0, 0.95), (5.0, 0.45)], 0.9).rate == pytest.approx(4.1)
    assert at_rate(pts, 2.5) == pytest.approx(0.90) and at_rate(pts, 0.5) == 1.0 and at_rate(pts, 5.0) is None


def _steps(attainments: list[float], step: float = 1.0) -> list[StepResult]:
    out = []
    for k, a in enumerate(attainments, 1):
        s = StepResult(rate=k * step, window_s=10.0, sent=100)
        s.overall = ClassResult(requests=100, ttft_met=round(a * 100), tpot_met=100, both_met=round(a * 100))
        out.append(s)
    return out


def test_summary_figures_on_hand_made_results():
    results = {"slo": _steps([1.0, 1.0, 0.98, 0.92, 0.60, 0.40]), "default": _steps([1.0, 0.95, 0.70, 0.45]),
               "least-loaded": _steps([0.85, 0.30])}
    sm = summary(results)
    # default: 90% crossed between 2 (95%) and 3 (70%): 2.2; slo between 4 (92%) and 5 (60%): 4.0625
    assert sm["held_90"]["default"] == {"rate": pytest.approx(2.2), "how": "interpolated"}
    assert sm["held_90"]["slo"]["rate"] == pytest.approx(4 + 0.02 / 0.32)
    assert sm["held_90"]["least-loaded"] == {"rate": None, "how": "below at every rate"}
    assert sm["held_90_ratio_slo_default"] == pytest.approx((4 + 0.02 / 0.32) / 2.2)
    # default falls through 80% at 2 + 0.15/0.25 = 2.6; slo there: 1.0 + (0.98 - 1.0) x 0.6
    assert sm["default_80"]["rate"] == pytest.approx(2.6) and sm["default_80"]["how"] == "interpolated"
    assert sm["default_80"]["slo_attainment"] == pytest.approx(0.988)
    assert "held_90_ratio_slo_default" not in summary({"slo": results["slo"], "default": _steps([0.5])})


# ---- the stream reader -------------------------------------------------------------------------
def test_send_times_a_stream_and_names_a_refusal():
    """send(): the request's objective headers and tier reach the server; TTFT and TPOT from
    the content events and usage; a 429 is `refused` with its code, a short stream `failed`."""
    from loadtest.bench.goodput import send, slo_headers

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((dict(request.headers), body))
        if body["max_tokens"] == 3:
            return httpx.Response(429, json={"error": {"code": "slo_unattainable", "message": "no"}})
        events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "bc"}]},
                  {"choices": [], "usage": {"completion_tokens": body["max_tokens"] - (body["max_tokens"] == 2)}}]
        return httpx.Response(200, text="".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")

    mix = Mix(0.125)
    chat, batch = mix.request("chat", random.Random(0)), mix.request("batch", random.Random(0))
    headers = slo_headers({"chat": {"ttft_ms": 154, "tpot_ms": 51}})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            url = "http://gw/v1/completions"
            ok = await send(http, url, "m", chat.__class__(chat.cls, chat.prompt, 3 + 1, None, 0), headers["chat"])
            no = await send(http, url, "m", chat.__class__(chat.cls, chat.prompt, 3, None, 0), headers["chat"])
            short = await send(http, url, "m", batch.__class__("batch", batch.prompt, 2, "flex", -1), {})
            return ok, no, short

    ok, no, short = asyncio.run(go())
    assert ok.ttft_s is not None and ok.tpot_s is not None and ok.tokens == 4 and not (ok.refused or ok.failed)
    assert (no.refused, no.ttft_s) == ("slo_unattainable", None)
    assert short.failed == "incomplete" and short.ttft_s is None
    assert seen[0][0]["x-slo-ttft-ms"] == "154" and seen[0][0]["x-slo-tpot-ms"] == "51"
    assert "x-slo-ttft-ms" not in seen[2][0] and seen[2][1]["service_tier"] == "flex" and "service_tier" not in seen[0][1]
    assert seen[0][1]["prompt"] == list(chat.prompt) and seen[0][1]["stream"] and seen[0][1]["ignore_eos"]


def test_options_as_parsed():
    from loadtest.bench.goodput import MODEL_LENGTH_SCALE, parse_args

    assert parse_args([]).length_scale == 1.0 and parse_args(["--engine", "model"]).length_scale == MODEL_LENGTH_SCALE
    a = parse_args([])
    assert (a.replicas, a.seed, a.modes, a.window) == (2, 1, ["slo", "default", "least-loaded"], 20.0)


# ---- one real run ------------------------------------------------------------------------------
@pytest.mark.serve  # `prefixgate bench goodput` starts its own stack (Ray, Redis, sim replicas) in a subprocess
def test_a_short_real_run_through_the_cli(tmp_path):
    out = tmp_path / "goodput.json"
    r = subprocess.run(
        [str(PREFIXGATE), "bench", "goodput", "--engine", "sim", "--replicas", "2", "--window", "2", "--max-steps", "2",
         "--seed", "3", "--modes", "slo", "default", "least-loaded", "--length-scale", "0.25",
         "--calibration-requests", "2", "--calibration-batch", "2", "--port", str(free_port()),
         "--config", "time_scale=4", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "prompt length scale: x0.25" in r.stdout and "CPU: " in r.stdout
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"slo", "default", "least-loaded"}
    assert data["settings"]["config"] == {"time_scale": 4} and data["settings"]["seed"] == 3
    for o in data["objectives"].values():
        assert o["ttft_ms"] > 0 and o["tpot_ms"] > 0
    assert set(data["objectives"]) == {"chat", "rag"} and data["capacity_rps"] > 0
    for mode, steps in data["modes"].items():
        rates = [s["rate"] for s in steps]
        assert rates and rates == sorted(rates) and len(set(rates)) == len(rates), (mode, rates)
        assert rates[0] == pytest.approx(data["step_rps"])
        for s in steps:
            for part in [s["overall"], *s["classes"].values()]:
                for key in ("ttft_attainment", "tpot_attainment", "attainment"):
                    assert part[key] is None or 0 <= part[key] <= 1, (mode, s)
            assert s["goodput"] >= 0
            for objective, share in s["coverage"].items():  # read from the gateway's /metrics
                assert objective in ("ttft", "tpot") and (share is None or 0 <= share <= 1), s["coverage"]
    assert set(data["summary"]["held_90"]) == {"slo", "default", "least-loaded"}
    for objective, c in data["summary"]["slo_coverage"].items():  # slo's coverage over all its steps
        assert objective in ("ttft", "tpot") and 0 <= c["covered"] <= c["judged"], c
        assert c["share"] is None or c["share"] == pytest.approx(c["covered"] / c["judged"])
    assert "slo's p90 covered" in r.stdout
