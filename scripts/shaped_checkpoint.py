"""Write a random checkpoint of a published Qwen3.5 shape, for benchmarks on a machine without the weights.

Usage: python3 scripts/shaped_checkpoint.py SHAPE OUT_DIR [--dtype bfloat16]
SHAPE is a name from `hybridserve.sim.shapes.MODEL_SHAPES` (qwen3.5-0.8b, qwen3.5-4b, ...). The weights
follow the built-in model's initialisation (seeded per parameter name) and the tokenizer is the built-in
one, so the engine and transformers both load the directory.
"""

from __future__ import annotations

import argparse

import torch

from hybridserve.models.builtin import builtin_state_dict, builtin_tokenizer, save_checkpoint
from hybridserve.sim.shapes import MODEL_SHAPES


def main() -> None:
    """Parse the arguments and write the checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(MODEL_SHAPES))
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    config = MODEL_SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    weights = {name: tensor.to(dtype) for name, tensor in builtin_state_dict(config).items()}
    print(save_checkpoint(args.out_dir, config, weights, builtin_tokenizer()))


if __name__ == "__main__":
    main()
