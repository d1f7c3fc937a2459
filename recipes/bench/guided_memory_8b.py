"""What a guided run holds beside the model on Llama-3.1-8B's shapes: check_guided_memory's arithmetic, one
decoder layer at a time (``--sequential``) and in one pass (round 18).

The model is built on the meta device (no weights, no download: the config's shapes only), so the one
forward the Gram count needs cannot run: one layer's float64 Grams are given by hand (Llama's q/k/v share
an input, gate/up share one: 3 x 4096^2 + 14336^2 entries, 1.9 GiB; 32 layers' in one pass, 61.0 GiB).
GPTQ 4 bits g128, keep math, 64 calibration texts of 512 tokens::

    PYTHONPATH=. python recipes/bench/guided_memory_8b.py 1 4 8     # --fisher-groups values

Each run's output is in recipes/results/RESULTS-compress.md (round 19: the Fisher pass's activations counted,
2.9 GiB at these shapes, float32, 256 tokens per Fisher text); round 16's check (main 72a987d) printed
pricing 28.91 GiB, compressing 2.91 GiB + the two copies of the target weights it counts only for weights
in CPU memory (2 x 4 x 6.98e9 bytes = 52.0 GiB in float32).
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import capsense.compress.guided_sequential as gs
from capsense.compress.budget import uniform_budget
from capsense.compress.guided import Guide
from capsense.compress.sensitivity import backward_memory
from capsense.compress.targets import find_targets

GRAM = {"attn": 8 * 2 * 4096**2, "mlp": 8 * (4096**2 + 14336**2)}  # one layer's float64 Gram matrices


def main(groups: list[int]) -> None:
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    gs.gram_memory = lambda model, targets, ids, per_layer=False: {k: v * (1 if per_layer else 32) for k, v in GRAM.items()}
    samples, uni = [[1] * 512] * 64, uniform_budget({"method": "gptq", "bits": 4, "group_size": 128})
    n = sum(t.n_params for t in find_targets(model))
    print(f"target weights {n:,} (4 bytes each: {4 * n / 2**30:.2f} GiB)")
    print("a Fisher pass (all layers' weights needing gradients): "
          + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in backward_memory(model).items()))
    for sequential in (True, False):
        for g in groups:
            need = gs.check_guided_memory(model, uni, samples, Guide(["math"], samples=32, fisher_groups=g),
                                          available=1 << 60, sequential=sequential)
            print(f"{'sequential' if sequential else 'one pass'}, fisher_groups {g}: "
                  + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in need.items()))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1])
