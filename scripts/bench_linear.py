"""F.linear against replica/model/packed_linear.py's oneDNN-packed weights, on the default model's
linear shapes (fused q/k/v and gate/up included), interleaved, at the row counts a step has.

    flock /tmp/prefixgate-heavy.lock .venv/bin/python scripts/bench_linear.py [--dtype bfloat16]

Prints, per row count, the median time of one pass over every linear layer of one decoder
layer with each, and their ratio: the evidence for packing (replica/packed_linear.packable).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from replica.default_model import resolve_model


def layer_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of one fused decoder layer's products: qkv, o, gate_up, down."""
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    return [(h, (heads + 2 * kv) * d), (heads * d, h), (h, 2 * config.intermediate_size), (config.intermediate_size, h)]


def time_pass(fns, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,16,64,96,208,512")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(resolve_model(None))
    weights = [torch.randn(o, i, dtype=dtype) * 0.02 for i, o in layer_shapes(config)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    print(f"{config.model_type}: {config.num_hidden_layers} layers, shapes (in, out) {layer_shapes(config)}, "
          f"{args.dtype}, {args.threads} threads")
    print("rows | F.linear ms/layer | oneDNN packed ms/layer | packed speed-up")
    for rows in map(int, args.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in weights]
        plain = [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights, strict=True)]
        onednn = [lambda x=x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                  for x, w in zip(xs, packed, strict=True)]
        time_pass(plain + onednn, 3)  # warm both
        a, b = [], []
        for _ in range(3):  # interleaved
            a.append(time_pass(plain, args.repeats))
            b.append(time_pass(onednn, args.repeats))
        ta, tb = statistics.median(a), statistics.median(b)
        print(f"{rows:4d} | {ta * 1e3:8.3f} | {tb * 1e3:8.3f} | x{ta / tb:.2f}", flush=True)


if __name__ == "__main__":
    main()
