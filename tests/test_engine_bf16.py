"""bf16 end to end on CPU: greedy tokens equal transformers' own bf16 generation for the tiny
model families, with prefix hits, chunked prefill and decodes of mixed lengths in one batch.
The check itself lives in loadtest/device/parity.py, which scripts/gpu_check.sh runs on CUDA.

Tiny models at the default init (std 0.02) have nearly flat logits, so bf16 rounding produces
exact ties (seen: two logits both 0.373046875, where fp32 picks our token); these use std 0.1.
"""

from __future__ import annotations

import os

import pytest

from loadtest.device import parity

pytestmark = pytest.mark.engine  # tiny models of its own (loadtest/device/parity.py)

DEVICE = os.environ.get("PREFIXGATE_TEST_DEVICE", "cpu")


@pytest.mark.parametrize("family", parity.FAMILIES)
def test_bf16_matches_transformers_bf16(family, tmp_path):
    path = parity.save_tiny(family, tmp_path)
    result = parity.check_family(family, path, device=DEVICE, dtype="bfloat16")
    assert result.agreed == result.prompts, result  # every divergence is a bf16 tie
    assert result.exact >= result.prompts - 1, result  # ties are the exception
    assert all(c >= 12 for c in result.cached_tokens)  # the shared prefix was hit

