"""Peak RSS over one Fisher pass (``sensitivity.fisher_diagonal``, one text) against what the guided memory check
counts for it: the Fisher sums, one layer's gradients and ``sensitivity.backward_memory`` (saved activations,
log-softmax, logit gradients). The unit tests compare the saved tensors' bytes; this compares the process's
resident memory, transients and allocator included, on a random Llama or Gemma 3 of 4 layers x hidden 256 with
a real vocabulary (its logits parts dominate, as on 8B models at 256 tokens). A first pass warms up (one-time
allocations), ``malloc_trim`` returns what it freed, ``/proc/self/clear_refs`` resets the peak; Linux only::

    PYTHONPATH=. OMP_NUM_THREADS=1 python recipes/bench/fisher_pass_peak.py llama 128256 256

Round 19's output is in recipes/results/RESULTS-compress.md.
"""

import ctypes
import gc
import sys

import torch
import transformers as T

from capsense.compress.sensitivity import backward_memory, fisher_diagonal
from capsense.compress.targets import find_targets

SHAPES = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=1024)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def main(arch: str, vocab: int, tokens: int) -> None:
    torch.manual_seed(0)
    config = (T.LlamaConfig if arch == "llama" else T.Gemma3TextConfig)(vocab_size=vocab, **SHAPES)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    targets = find_targets(model)
    ids = torch.randint(3, vocab, (tokens,)).tolist()
    parts = {"Fisher sums": 4 * sum(t.n_params for t in targets),
             "one layer's gradients": max(sum(4 * t.n_params for t in targets if t.layer == i) for i in range(4)),
             **backward_memory(model, tokens)}
    fisher_diagonal(model, targets, [ids])  # warm-up
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    fisher_diagonal(model, targets, [ids])
    peak, counted = _status("VmHWM") - before, sum(parts.values())
    print(f"{arch} vocab {vocab}, {tokens} tokens, {model.config._attn_implementation}: peak RSS over the pass "
          f"{peak / 2**20:.1f} MiB, counted {counted / 2**20:.1f} MiB ("
          + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in parts.items()) + f"), measured/counted {peak / counted:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
