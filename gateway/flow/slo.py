"""Latency objectives a request carries: time to first token and time per output token, in ms.

A client states them with llm-d's headers (`x-slo-ttft-ms`, `x-slo-tpot-ms`); an API key may set
defaults for its requests (`slo_ttft_ms`, `slo_tpot_ms` in the key file), and the app for each
service tier (`AppConfig.slo_ttft_ms` / `slo_tpot_ms`, tier -> ms). Each objective is resolved on
its own: the header's, else the key's, else the tier's. The gateway measures them
(gateway/slo_watch.py) and sends them with the request to the router, which routes by them
(router/slo_policy.py); the gateway's queue orders and sheds by the TTFT objective
(gateway/flow/slo_admission.py); no replica sizes its steps by them yet (docs/flow-control.md,
"Latency objectives"). The struct itself is router/protocol/slo.py's: it crosses processes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from router.protocol.slo import Objectives

__all__ = ["MAX_MS", "TPOT_HEADER", "TTFT_HEADER", "Objectives", "check_ms", "header_ms", "header_objectives",
           "resolve", "tier_defaults", "valid_ms"]

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
MAX_MS = 3_600_000  # one hour: anything longer is a client's mistake, not an objective
_DIGITS = re.compile(r"[0-9]{1,7}")  # at most 7 digits: never more than MAX_MS needs, never a huge int()


def valid_ms(value: object) -> bool:
    """A positive integer of milliseconds up to one hour (bools are not integers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_MS


def check_ms(where: str, value: object) -> int | None:
    """A key file's or a setting's objective: None or a valid ms value; ValueError naming `where`."""
    if value is not None and not valid_ms(value):
        raise ValueError(f"{where} must be a whole number of milliseconds in [1, {MAX_MS}], got {value!r}")
    return value  # type: ignore[return-value]


def header_ms(name: str, raw: str | None) -> int | None:
    """One header's objective; an OpenAI-style 400 naming the header for anything but a positive
    integer up to one hour (0, -1, 1.5, abc, 3600001, empty)."""
    if raw is None:
        return None
    # imported here, as in tiers.py: the key file's checks load no web framework
    from gateway.errors import APIError

    text = raw.strip()
    value = int(text) if _DIGITS.fullmatch(text) else None
    if value is None or not valid_ms(value):
        raise APIError(400, f"Invalid value for header '{name}': {raw[:32]!r}. Expected a positive integer "
                            f"number of milliseconds up to {MAX_MS} (one hour).", param=name, code="invalid_value")
    return value


def header_objectives(headers: Mapping[str, str]) -> Objectives:
    """The objectives a request's headers state (neither, when it states none)."""
    return Objectives(header_ms(TTFT_HEADER, headers.get(TTFT_HEADER)), header_ms(TPOT_HEADER, headers.get(TPOT_HEADER)))


def tier_defaults(ttft_ms: Mapping[str, int], tpot_ms: Mapping[str, int], tiers: tuple[str, ...]) -> dict[str, Objectives]:
    """Each tier's default objectives from the app's settings (tier -> ms, a tier left out: none)."""
    return {tier: Objectives(ttft_ms.get(tier), tpot_ms.get(tier)) for tier in tiers}


def resolve(asked: Objectives, key: Objectives | None, tier: Objectives | None) -> Objectives:
    """Header > key > tier, per objective: a request naming only its TTFT still gets its key's
    (or tier's) TPOT objective."""
    out = asked
    for defaults in (key, tier):
        if defaults is not None:
            out = out.over(defaults)
    return out
