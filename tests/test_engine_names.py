"""Only replica/backends/ asks which engine it is: every rule that differs by engine lives in
that engine's spec (replica/backends/*_spec.py, found by name in engines.py), so no product module
elsewhere compares a value with an engine's name.

The check parses each module with `ast` and looks at comparisons only (`==`, `!=`, `is`,
`is not`, `in`, `not in`, and `match` cases), so an engine's name as a dict key, a default, a
keyword argument, a CLI choice or a docstring is not one.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from replica.backends.engine_protocol import ENGINE_NAMES

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("gateway", "router", "replica", "loadtest")
ALLOWED = REPO / "replica" / "backends"  # the one place that knows each engine
_COMPARISONS = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)


def _names_in(node: ast.expr) -> list[str]:
    """Engine names that `node` is, or (a tuple, list, set or dict literal) holds."""
    if isinstance(node, ast.Constant):
        return [node.value] if node.value in ENGINE_NAMES else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for elt in node.elts for name in _names_in(elt)]
    if isinstance(node, ast.Dict):  # `x in {"sim": ...}` compares with the keys
        return [name for key in node.keys if key is not None for name in _names_in(key)]
    return []


def engine_name_comparisons(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, code) of each comparison in `source` of a value with an engine's name."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                if isinstance(op, _COMPARISONS) and (_names_in(operands[i]) or _names_in(operands[i + 1])):
                    found.append((node.lineno, ast.unparse(node)))
                    break
        elif isinstance(node, ast.match_case):
            for pattern in ast.walk(node.pattern):
                if isinstance(pattern, ast.MatchValue) and _names_in(pattern.value):
                    found.append((pattern.lineno, f"case {ast.unparse(node.pattern)}"))
                    break
    return sorted(found)


def test_no_engine_name_comparison_outside_the_backends():
    modules = [p for package in PRODUCT for p in sorted((REPO / package).rglob("*.py"))
               if ALLOWED not in p.parents and "__pycache__" not in p.parts]
    assert len(modules) > 100  # the walk found the product, not an empty folder
    offences = [f"{p.relative_to(REPO)}:{line}: {code}" for p in modules
                for line, code in engine_name_comparisons(p.read_text(), str(p))]
    assert not offences, ("engine names compared outside replica/backends/ (put the rule in the engine's "
                          "spec, replica/backends/*_spec.py):\n" + "\n".join(offences))


def test_the_check_finds_a_planted_comparison_and_nothing_else():
    planted = textwrap.dedent("""
        def f(config, engine, args):
            if config.engine == "vllm":
                pass
            ok = "sim" != engine
            many = args.engine in ("model", "other")
            keyed = engine not in {"sim": 1}
            chained = 0 < len(engine) and engine is "model"
            match engine:
                case "sim" | "x":
                    pass
    """)
    assert [line for line, _ in engine_name_comparisons(planted)] == [3, 5, 6, 7, 8, 10]
    innocent = textwrap.dedent("""
        import argparse

        DEFAULTS = {"sim": 1024, "model": None}  # a dict keyed by name: a lookup, not a comparison
        p = argparse.ArgumentParser().add_subparsers()
        p.add_parser("sim", help="the model")  # a CLI subcommand named like an engine
        config = dict(engine="vllm", choices=("model", "sim", "vllm"))
        same = config["engine"] == "simulated"  # not a name
        match config:
            case {"engine": name}:
                pass
    """)
    assert engine_name_comparisons(innocent) == []
