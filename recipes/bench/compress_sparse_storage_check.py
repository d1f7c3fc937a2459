"""Can a pruned (SparseGPT/Wanda) checkpoint be stored sparse and loaded by stock transformers?

    HF_HUB_OFFLINE=1 python recipes/bench/compress_sparse_storage_check.py

Checks, with the installed compressed-tensors and transformers, on a tiny random Llama:

1. whether compressed-tensors has a compressor registered for ``sparse-bitmask`` or
   ``sparse-24-bitmask`` (the formats its config module still names);
2. what ``AutoModelForCausalLM.from_pretrained`` does with one ``down_proj`` stored in the
   legacy bitmask layout (``compressed`` values, packed ``bitmask``, ``shape``, ``row_offsets``)
   and a ``sparsity_config`` in ``quantization_config``: whether that weight comes back.

Prints one line per check; results in recipes/results/RESULTS-compress.md (shippable section).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch


def registered() -> None:
    from compressed_tensors.compressors import BaseCompressor

    for fmt in ("sparse-bitmask", "sparse-24-bitmask"):
        try:
            print(fmt, "compressor:", BaseCompressor.load_from_registry(fmt))
        except KeyError:
            print(fmt, "compressor: not registered")


def bitmask_reload() -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m"
        LlamaForCausalLM(cfg).save_pretrained(out)
        sd = load_file(out / "model.safetensors")
        key = "model.layers.0.mlp.down_proj.weight"
        w = sd.pop(key)
        w[w.abs() < w.abs().median()] = 0
        mask = w != 0
        prefix = key.removesuffix("weight")
        sd[prefix + "compressed"] = w[mask]
        sd[prefix + "bitmask"] = torch.from_numpy(np.packbits(mask.numpy(), axis=1, bitorder="little"))
        sd[prefix + "shape"] = torch.tensor(w.shape)
        sd[prefix + "row_offsets"] = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1)[:-1]]), 0)
        save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "sparse-bitmask", "config_groups": {},
            "sparsity_config": {"format": "sparse-bitmask", "global_sparsity": 0.5, "sparsity_structure": "unstructured",
                                "targets": ["Linear"], "ignore": ["lm_head"]},
        }
        (out / "config.json").write_text(json.dumps(config))
        model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        print("loading info:", {k: sorted(v) for k, v in info.items() if v})
        print("sparsity_config kept by transformers:", hasattr(model.config.quantization_config, "sparsity_config"))
        print("down_proj is the stored pruned weight:", torch.equal(model.model.layers[0].mlp.down_proj.weight.float(), w))


if __name__ == "__main__":
    import compressed_tensors
    import transformers

    print("compressed-tensors", compressed_tensors.__version__, "transformers", transformers.__version__)
    registered()
    bitmask_reload()
