"""Make `vllm.entrypoints.chat_utils` importable on vLLM 0.32 for Ray 2.60's KV-aware router.

Ray 2.60's pre-routing tokenizer (ray/llm/_internal/serve/routing_policies/kv_aware/vllm/
tokenizer.py, imported by the `LLMRouter` ingress replica when the deployment's router is
`KVAwareRouter`) does `from vllm.entrypoints.chat_utils import load_chat_template`. vLLM 0.32
moved that module to `vllm.renderers.chat_utils` and left nothing at the old path, so the
router replica fails to start and crash-loops while HAProxy balances by least connections.

`install()` puts a finder at the front of `sys.meta_path` that answers the old name with the
new module, only if the old module cannot be found otherwise. It is lazy: nothing of vLLM is
imported until something imports the old name, so it costs nothing in the Ray processes that
never do (controller, proxy). `loadtest/ray_llm_app.py --router kv` calls it in the driver and
names `loadtest.ray_kv_shim.install` as the job's `worker_process_setup_hook`, so every Ray
worker of the app (the router replica included) runs it before any task.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

OLD = "vllm.entrypoints.chat_utils"
NEW = "vllm.renderers.chat_utils"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds OLD (when nothing else does) and loads it as the already-imported NEW module."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.old:
            return None
        for finder in sys.meta_path:  # the real module wins where it exists
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                if finder.find_spec(fullname, path, target) is not None:
                    return None
            except (ImportError, ValueError):
                continue
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder, replaced below

    def exec_module(self, module) -> None:
        # the import system hands back whatever sys.modules holds for the name after this, so
        # the old name becomes the new module itself (its own __spec__ untouched)
        sys.modules[self.old] = importlib.import_module(self.new)


def installed() -> bool:
    return any(isinstance(f, _Alias) and f.old == OLD for f in sys.meta_path)


def install() -> None:
    """Idempotent; the worker_process_setup_hook entry point."""
    if not installed():
        sys.meta_path.insert(0, _Alias(OLD, NEW))
