"""The API-key file (`--api-keys FILE`, AppConfig.api_keys): each key names its tenant, and may
set the tenant's weight, the key's default and maximum service tier, and the tenant's limits.

    {"sk-a": "acme",                                  # the plain form: key -> tenant
     "sk-b": {"tenant": "bravo", "weight": 2, "service_tier": "flex",
              "max_service_tier": "default", "rpm": 600, "tpm": 200000,
              "slo_ttft_ms": 2000, "slo_tpot_ms": 100}}

A tenant is what the fair queue shares between and what the limits count: its weight, rpm and
tpm are the tenant's, so every key of one tenant must give the same ones (or leave them out).
The default and maximum tier, and the default latency objectives, belong to the key. Checked where the file is loaded
(AppConfig.__post_init__), so a bad file stops `prefixgate serve` before anything starts.
"""

from __future__ import annotations

import math

import msgspec

from gateway.flow.slo import Objectives, check_ms
from gateway.flow.tiers import ACCEPTED, RANK, check_tier


class KeySpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """One key of the file, in its object form (the plain form is {"tenant": ...} alone)."""

    tenant: str
    weight: float | None = None  # the tenant's fair-queue weight (1 when no key of it sets one)
    service_tier: str = "default"  # for this key's requests that name none
    max_service_tier: str = "priority"  # the highest tier this key's requests are served at
    rpm: int | None = None  # the tenant's requests per minute, all gateways together
    tpm: int | None = None  # the tenant's tokens per minute (prompt + n x max_tokens, at admission)
    admin: bool = False  # may load and unload LoRA adapters at run time (gateway/adapters.py)
    # latency objectives of this key's requests whose headers state none (gateway/flow/slo.py)
    slo_ttft_ms: int | None = None
    slo_tpot_ms: int | None = None

    @property
    def objectives(self) -> Objectives:
        return Objectives(self.slo_ttft_ms, self.slo_tpot_ms)


class TenantSpec(msgspec.Struct, frozen=True):
    """What the fair queue and the limits know of one tenant."""

    name: str
    weight: float = 1.0
    rpm: int | None = None
    tpm: int | None = None

    @property
    def limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None


class KeyTable(msgspec.Struct, frozen=True):
    keys: dict[str, KeySpec]
    tenants: dict[str, TenantSpec]


def parse_keys(raw: dict) -> KeyTable:
    """The key file's content -> KeyTable; ValueError naming the key and field that is wrong."""
    if not isinstance(raw, dict):
        raise ValueError("api_keys must be a JSON object of API key -> tenant name or key settings")
    keys: dict[str, KeySpec] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise ValueError("api_keys must map non-empty API key strings to tenant names or key settings")
        if isinstance(value, str):
            value = {"tenant": value}
        if not isinstance(value, dict):
            raise ValueError(f"api_keys[{_shown(key)}]: expected a tenant name or an object, got {type(value).__name__}")
        try:
            spec = msgspec.convert(value, KeySpec)
        except msgspec.ValidationError as e:
            raise ValueError(f"api_keys[{_shown(key)}]: {e} (fields: {', '.join(KeySpec.__struct_fields__)})") from None
        keys[key] = _checked(key, spec)
    return KeyTable(keys, _tenants(keys))


def _checked(key: str, spec: KeySpec) -> KeySpec:
    where = f"api_keys[{_shown(key)}]"
    if not spec.tenant:
        raise ValueError(f"{where}: tenant must be a non-empty name")
    if spec.weight is not None and not (math.isfinite(spec.weight) and spec.weight > 0):
        raise ValueError(f"{where}: weight must be a positive number, got {spec.weight}")
    for name in ("rpm", "tpm"):
        value = getattr(spec, name)
        if value is not None and value < 1:
            raise ValueError(f"{where}: {name} must be at least 1 (leave it out for no limit), got {value}")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        try:
            check_ms(name, getattr(spec, name))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    try:
        tier, most = check_tier(spec.service_tier), check_tier(spec.max_service_tier)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if RANK[tier] < RANK[most]:
        raise ValueError(f"{where}: service_tier {tier!r} is above max_service_tier {most!r} "
                         f"(tiers: {', '.join(t for t in ACCEPTED if t != 'auto')})")
    return msgspec.structs.replace(spec, service_tier=tier, max_service_tier=most)


def _tenants(keys: dict[str, KeySpec]) -> dict[str, TenantSpec]:
    seen: dict[str, dict[str, object]] = {}
    for key, spec in keys.items():
        mine = seen.setdefault(spec.tenant, {})
        for name in ("weight", "rpm", "tpm"):
            value = getattr(spec, name)
            if value is None:
                continue
            if mine.setdefault(name, value) != value:
                raise ValueError(f"api_keys[{_shown(key)}]: tenant {spec.tenant!r} has {name} {mine[name]} "
                                 f"on another key; a tenant's {name} must be the same on all its keys")
    return {t: TenantSpec(t, float(v.get("weight", 1.0)), v.get("rpm"), v.get("tpm")) for t, v in seen.items()}


def _shown(key: str) -> str:
    """A key as named in an error: enough to find it in the file, never the whole secret."""
    return repr(key[:4] + "…") if len(key) > 8 else repr(key[:2] + "…")
