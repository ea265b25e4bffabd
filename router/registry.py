"""Every routing policy by name, in one table: ours and Ray Serve's.

Ours are `router.policy.Policy` subclasses, run inside our `PrefixGateRouter` when served and
by the simulator as they are; each registers itself with `@register_policy` on its class, so a
new policy touches router/policy.py and its test, nothing else. Ray's are Serve request
routers, named `ray-*` so that one name means one algorithm everywhere.

The gateway's config and CLI, the load tests and the docs read names from here. Imports
neither torch nor ray: `gateway.config` validates against it in processes that have neither.

The table itself, with its lookups and Ray's entries, is router/policy_table.py, below
router/policy.py (whose decorators fill it); this module imports router/policy.py, so the table
read through it always holds ours, and renders it for help texts and docs/policies.md.
"""

from __future__ import annotations

import router.policy  # noqa: F401  (its classes' decorators register ours in the table)
from router.policy_table import (
    DEFAULT_POLICY,
    OUR_ROUTER_CLASS,
    OURS,
    RAY,
    Kind,
    PolicyEntry,
    aliases,
    entries,
    get,
    is_ours,
    policy_names,
    register_policy,
    resolve,
    resolve_list,
    sim_policy,
)

__all__ = [
    "DEFAULT_POLICY", "OUR_ROUTER_CLASS", "OURS", "RAY", "Kind", "PolicyEntry", "aliases", "entries", "get",
    "help_text", "is_ours", "markdown_table", "policy_names", "register_policy", "resolve", "resolve_list",
    "sim_policy",
]


def help_text() -> str:
    """One paragraph for `--policy` / `--policies` help."""
    names = " | ".join(policy_names())
    return (f"{names} (default {DEFAULT_POLICY}; docs/policies.md). `pow2` is our power-of-two policy, "
            "served and simulated alike; Ray's default router is `ray-pow2`")


def markdown_table() -> str:
    """The table in docs/policies.md (a test keeps the two equal: `python -m router.registry`)."""
    lines = ["| policy | served by | what it does | simulated as | aliases |", "| --- | --- | --- | --- | --- |"]
    for e in entries():
        alias_text = ", ".join(f"`{a}`" for a in e.aliases)
        sim = "itself" if e.sim_as == e.name else f"`{e.sim_as}`"
        lines.append(f"| `{e.name}` | {e.implementation} | {e.summary} | {sim} | {alias_text} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m router.registry: the table for docs/policies.md
    print(markdown_table())
