"""The table of routing policies by name, ours and Ray Serve's: entries, aliases and lookups.

The bottom of the registry (router/registry.py is its public face): a policy of ours registers
itself here with `@register_policy` on its class (router/policy.py), Ray's are registered
below. Imports nothing of ours, so router/policy.py can both register into it and look names
up in it (`make_policy`) while router/registry.py imports router/policy.py to fill it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

Kind = Literal["ours", "ray"]
OURS: Kind = "ours"
RAY: Kind = "ray"
# The policy a router runs unless told otherwise: defined here only (router/router_options.py
# and router/registry.py import it). The best of ours on hit rate and TTFT p99 in the simulator
# on the shared Mooncake trace (docs/simulator.md, "After"); with replicas that cannot pull
# (vLLM) it decides as `affinity` does.
DEFAULT_POLICY = "affinity-pull"
OUR_ROUTER_CLASS = "router.ray_router.PrefixGateRouter"  # serves every policy of ours


@dataclass(frozen=True)
class PolicyEntry:
    name: str  # canonical: what metrics, results and `x-prefixgate-route` carry
    kind: Kind
    summary: str  # one line, for help texts and docs/policies.md
    aliases: tuple[str, ...] = ()
    policy_class: type | None = None  # ours: the Policy subclass
    ray_router: str | None = None  # Ray's: import path of the Serve RequestRouter; None: Serve's default
    sim_as: str = ""  # the policy of ours the simulator runs for it (ours: itself)

    @property
    def is_ours(self) -> bool:
        return self.kind == OURS

    @property
    def implementation(self) -> str:
        """What runs it when served, in words (docs table, help)."""
        if self.is_ours:
            return f"`{OUR_ROUTER_CLASS.rsplit('.', 1)[1]}` + `{self.policy_class.__name__}`"
        if self.ray_router is None:
            return "Ray Serve's default router"
        return f"Ray's `{self.ray_router.rsplit('.', 1)[1]}`"


_ENTRIES: dict[str, PolicyEntry] = {}
_ALIASES: dict[str, str] = {}  # alias -> canonical name

P = TypeVar("P", bound=type)


def _add(entry: PolicyEntry) -> None:
    taken = set(_ENTRIES) | set(_ALIASES)
    clash = [n for n in (entry.name, *entry.aliases) if n in taken]
    if clash:
        raise ValueError(f"policy name(s) {clash} registered twice")
    _ENTRIES[entry.name] = entry
    for alias in entry.aliases:
        _ALIASES[alias] = entry.name


def register_policy(*, summary: str, aliases: tuple[str, ...] = ()) -> Callable[[P], P]:
    """Class decorator for a policy of ours: registered under the class's `name`."""

    def register(cls: P) -> P:
        _add(PolicyEntry(cls.name, OURS, summary, tuple(aliases), policy_class=cls, sim_as=cls.name))
        return cls

    return register


def _register_ray(name: str, ray_router: str | None, summary: str, sim_as: str, aliases: tuple[str, ...] = ()) -> None:
    _add(PolicyEntry(name, RAY, summary, aliases, ray_router=ray_router, sim_as=sim_as))


_register_ray("ray-pow2", None, "Ray Serve's default: power of two choices on queue length (not our `pow2`)",
              sim_as="pow2", aliases=("ray-default",))
_register_ray("ray-prefix", "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter",
              "Ray Serve LLM's prefix tree of routed prompt text: the best text match wins (queues ignored at its default threshold)",
              sim_as="prefix")
_register_ray("ray-session", "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
              "Ray Serve's consistent hashing on the session id", sim_as="session", aliases=("ray-consistent-hash",))


def entries(kind: Kind | None = None) -> tuple[PolicyEntry, ...]:
    """Ours first (the default, then the rest in router/policy.py's order), then Ray's."""
    table = _ENTRIES.values()
    ours = sorted((e for e in table if e.is_ours), key=lambda e: e.name != DEFAULT_POLICY)  # stable
    ordered = ours + [e for e in table if not e.is_ours]
    return tuple(e for e in ordered if kind is None or e.kind == kind)


def policy_names(kind: Kind | None = None) -> tuple[str, ...]:
    return tuple(e.name for e in entries(kind))


def aliases() -> dict[str, str]:
    return dict(_ALIASES)


def resolve(name: str) -> str:
    """Canonical name for a name or alias; unknown: ValueError listing the valid ones."""
    if name in _ENTRIES:
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    valid = ", ".join(policy_names())
    alias_text = ", ".join(f"{a} = {c}" for a, c in _ALIASES.items())
    raise ValueError(f"unknown policy {name!r}; valid: {valid} (aliases: {alias_text})")


def resolve_list(text: str) -> list[str]:
    """Comma-separated names or aliases (a `--policies` flag) -> canonical names."""
    return [resolve(n.strip()) for n in text.split(",") if n.strip()]


def get(name: str) -> PolicyEntry:
    return _ENTRIES[resolve(name)]


def is_ours(name: str) -> bool:
    return get(name).is_ours


def sim_policy(name: str) -> str:
    """The policy of ours that the simulator runs for `name` (Ray's are approximated by ours)."""
    return get(name).sim_as
