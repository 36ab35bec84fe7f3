"""The CPU matmuls at a decode step's shapes, by batch size: the packed and skinny kernels and
oneDNN's matmul against ``F.linear``.

    python -m worker.bench.skinny_linear [--threads 2] [--rounds 7]

For each batch size, every weight matmul of one decode step of the small preset
(worker.bench.decode_step.weight_shapes) through each, rounds interleaved, best round each:
where the packed kernel stops beating oneDNN is where csrc/packed_linear.h's
``kPackedMaxRows`` belongs on this machine, and where skinny does, ``kSkinnyMaxRows``
(csrc/linear.h picks between them by these; skinny serves weights without a packed copy).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from worker.bench.decode_step import weight_shapes
from worker.host.cpu_kernels import cpu_kernels
from worker.modelgen.presets import PRESETS

BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)


def _seconds(fn, weights: list[torch.Tensor], x: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        fn(x[w.shape[1]], w)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    module = cpu_kernels()
    if module is None:
        print("the CPU kernels are unavailable (switched off or not built)")
        return 1
    torch.set_num_threads(args.threads)
    small = PRESETS["small"]
    config = SimpleNamespace(
        hidden_size=small.hidden_size, num_attention_heads=small.num_heads,
        num_key_value_heads=small.num_kv_heads, head_dim=small.head_dim,
        intermediate_size=small.intermediate_size, num_hidden_layers=small.num_layers,
        vocab_size=small.vocab_size)
    weights = [torch.randn(o, i) for o, i in weight_shapes(config)]
    copies = {id(w): module.pack_weight(w) for w in weights}
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    no_bias = torch.empty(0)
    print(f"{args.threads} threads, small preset ({weight_bytes / 1e6:.0f} MB of matmul "
          f"weights), best of {args.rounds} rounds; packed serves up to "
          f"{module.PACKED_MAX_ROWS} rows, skinny (no packed copy) up to "
          f"{module.SKINNY_MAX_ROWS}")
    for batch in BATCHES:
        x = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
        blas, skinny, onednn, packed = (float("inf"),) * 4
        with torch.inference_mode():
            for _ in range(args.rounds):
                blas = min(blas, _seconds(F.linear, weights, x))
                skinny = min(skinny, _seconds(
                    lambda a, w: module.skinny_linear(a, w, no_bias), weights, x))
                packed = min(packed, _seconds(
                    lambda a, w: module.packed_linear(a, copies[id(w)], w.shape[0], no_bias),
                    weights, x))
                if module.HAS_ONEDNN_LINEAR:
                    onednn = min(onednn, _seconds(
                        lambda a, w: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [],
                                                                        None), weights, x))
        print(f"  batch {batch:3}: F.linear {blas * 1e3:6.2f} ms, packed {packed * 1e3:6.2f} ms "
              f"({weight_bytes / packed / 1e9:5.1f} GB/s), skinny {skinny * 1e3:6.2f} ms, "
              f"oneDNN {onednn * 1e3:6.2f} ms; / F.linear: packed {packed / blas:.2f}, "
              f"skinny {skinny / blas:.2f}, oneDNN {onednn / blas:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
