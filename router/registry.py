"""Every routing policy by name, in one table: ours and Ray Serve's.

Ours are `router.policy.Policy` subclasses, run inside our `PrefixGateRouter` when served and
by the simulator as they are; each registers itself with `@register_policy` on its class, so a
new policy touches router/policy.py and its test, nothing else. Ray's are Serve request
routers, named `ray-*` so that one name means one algorithm everywhere (before issue 24,
served `pow2` meant Ray's default router while the simulator ran our `PowerOfTwoPolicy`).

The gateway's config and CLI, the load tests and the docs read names from here. Imports
neither torch nor ray: `gateway.config` validates against it in processes that have neither.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

Kind = Literal["ours", "ray"]
OURS: Kind = "ours"
RAY: Kind = "ray"
DEFAULT_POLICY = "affinity"
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


_register_ray("ray-pow2", None, "Ray Serve's default: power of two choices on queue length (served `pow2` before issue 24)",
              sim_as="pow2", aliases=("ray-default",))
_register_ray("ray-prefix", "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter",
              "Ray Serve LLM's prefix tree of routed prompt text: the best text match wins (queues ignored at its default threshold)",
              sim_as="prefix")
_register_ray("ray-session", "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
              "Ray Serve's consistent hashing on the session id", sim_as="session", aliases=("ray-consistent-hash",))


def _loaded() -> dict[str, PolicyEntry]:
    """The table with ours in it: importing router.policy runs their decorators (cheap: no torch)."""
    importlib.import_module("router.policy")
    return _ENTRIES


def entries(kind: Kind | None = None) -> tuple[PolicyEntry, ...]:
    """Ours first (in router/policy.py's order, the default first), then Ray's."""
    table = _loaded().values()
    ordered = [e for e in table if e.is_ours] + [e for e in table if not e.is_ours]
    return tuple(e for e in ordered if kind is None or e.kind == kind)


def policy_names(kind: Kind | None = None) -> tuple[str, ...]:
    return tuple(e.name for e in entries(kind))


def aliases() -> dict[str, str]:
    _loaded()
    return dict(_ALIASES)


def resolve(name: str) -> str:
    """Canonical name for a name or alias; unknown: ValueError listing the valid ones."""
    table = _loaded()
    if name in table:
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
    return _loaded()[resolve(name)]


def is_ours(name: str) -> bool:
    return get(name).is_ours


def sim_policy(name: str) -> str:
    """The policy of ours that the simulator runs for `name` (Ray's are approximated by ours)."""
    return get(name).sim_as


def help_text() -> str:
    """One paragraph for `--policy` / `--policies` help."""
    names = " | ".join(policy_names())
    return (f"{names} (default {DEFAULT_POLICY}; docs/policies.md). `pow2` is our power-of-two policy, "
            "served and simulated alike; before issue 24 a served `pow2` meant Ray's default router, now `ray-pow2`")


def markdown_table() -> str:
    """The table in docs/policies.md (a test keeps the two equal: `python -m router.registry`)."""
    lines = ["| policy | served by | what it does | simulated as | aliases |", "| --- | --- | --- | --- | --- |"]
    for e in entries():
        alias_text = ", ".join(f"`{a}`" for a in e.aliases)
        sim = "itself" if e.sim_as == e.name else f"`{e.sim_as}`"
        lines.append(f"| `{e.name}` | {e.implementation} | {e.summary} | {sim} | {alias_text} |")
    return "\n".join(lines)


if __name__ == "__main__":  # run as a script this file is __main__: print the table of the real module
    from router import registry

    print(registry.markdown_table())
