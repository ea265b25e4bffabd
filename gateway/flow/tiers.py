"""Service tiers: OpenAI's `service_tier` and vLLM's integer `priority` as one rank.

Rank 0 is served first. `auto` is served as `default` and echoed as `default` (OpenAI answers
with the tier that processed the request). vLLM's `priority` is "lower is earlier", 0 being
the default: below 0 maps to `priority`, above 0 to `flex`.
"""

from __future__ import annotations

TIERS: tuple[str, ...] = ("priority", "default", "flex")  # by rank
RANK = {name: rank for rank, name in enumerate(TIERS)}
ACCEPTED = ("auto", "default", "flex", "priority")  # what a request may name


def replica_priority(tier: str, crowded: bool = False) -> int:
    """The request's vLLM integer priority for the replica's scheduler (lower first): its tier
    first (priority -2/-1, default 0/1, flex 2/3), then whether its tenant already held its
    share of the gateway's seats in flight when it was sent (`crowded`: saturation.py
    `Ledger.over_share`). A tenant within its share so goes ahead, in the replica's queue, of a
    flooding tenant's requests of the same tier, which the gateway alone cannot order once they
    have been sent."""
    return 2 * (RANK[tier] - RANK["default"]) + int(crowded)


def invalid_tier(value: object):
    """OpenAI's 400 for a service_tier it does not offer (an APIError)."""
    from gateway.errors import APIError

    return APIError(400, f"Invalid value: {value!r}. Supported values are: 'auto', 'default', 'flex' and 'priority'.",
                    param="service_tier", code="invalid_value")


def check_tier(value: str) -> str:
    """A tier name as written in a key file or a setting: one of ACCEPTED, `auto` as `default`."""
    if value not in ACCEPTED:
        raise ValueError(f"service_tier must be one of {', '.join(ACCEPTED)}, got {value!r}")
    return "default" if value == "auto" else value


def request_tier(service_tier: object, priority: object, key_default: str = "default",
                 key_max: str = "priority") -> str:
    """The tier a request is served at: its `service_tier`, else its vLLM `priority`, else its
    key's default; never above its key's maximum (a request above it is served at the maximum,
    and the response says so)."""
    if service_tier is not None:
        if not isinstance(service_tier, str) or service_tier not in ACCEPTED:
            raise invalid_tier(service_tier)
        tier = "default" if service_tier == "auto" else service_tier
    elif priority is not None:
        tier = "priority" if priority < 0 else "flex" if priority > 0 else "default"
    else:
        tier = key_default
    return TIERS[max(RANK[tier], RANK[key_max])]
