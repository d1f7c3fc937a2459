"""Shared fixtures: tiny randomly initialised models of every supported architecture."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers as T

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt_neox", "gpt2")

_CONFIGS = {
    "llama": T.LlamaConfig,
    "mistral": T.MistralConfig,
    "qwen2": T.Qwen2Config,
    "qwen3": T.Qwen3Config,
    "gemma2": T.Gemma2Config,
    "gemma3_text": T.Gemma3TextConfig,
    "phi3": T.Phi3Config,
    "olmo2": T.Olmo2Config,
    "gpt_neox": T.GPTNeoXConfig,
    "gpt2": T.GPT2Config,
}

N_LAYERS, N_HEADS, HEAD_DIM, VOCAB = 3, 4, 16, 128

#: More supported families, built from ``AutoConfig.for_model``: kept out of ``ARCHS`` so that
#: the arch-parametrized suites do not grow; their own tests (exactness, layout, export,
#: compression refusal) parametrize over this list. MoE families get 4 experts, 2 per token.
EXTRA_ARCHS = (
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "glm4_moe", "phimoe",
    "ernie4_5_moe", "hunyuan_v1_moe", "gpt_oss", "gemma", "granite", "starcoder2", "olmo", "olmo3", "cohere", "cohere2",
    "phi", "glm", "glm4", "ministral", "smollm3", "helium", "exaone4", "seed_oss", "arcee", "ernie4_5",
    "internlm3", "stablelm", "nemotron", "hunyuan_v1_dense", "apertus",
)
MOE_ARCHS = EXTRA_ARCHS[:11]
_MOE = dict(
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, first_k_dense_replace=0,
)


def tiny_config(arch: str, attn_implementation: str = "eager"):
    """A tiny config: 3 layers x 4 heads of width 16, GQA with 2 KV heads where supported."""
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "gpt2":
        cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=N_LAYERS, n_head=N_HEADS, n_positions=128, **ids)
    elif arch == "gpt_neox":
        cfg = T.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS, max_position_embeddings=128, **ids,
        )
    else:
        make = _CONFIGS.get(arch) or (lambda **kw: T.AutoConfig.for_model(arch, **kw, **(_MOE if arch in MOE_ARCHS else {})))
        cfg = make(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
            max_position_embeddings=128, **ids,
        )
    cfg._attn_implementation = attn_implementation
    return cfg


def make_tiny_model(arch: str, attn_implementation: str = "eager", seed: int = 0, **overrides):
    """A tiny random fp32 causal LM of ``arch`` in eval mode (config attributes overridable)."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch, attn_implementation)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    # Random biases and norms, so that zeroing a slice is a visible, checkable change.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture
def kernel_calls(monkeypatch):
    """The (query, key, value dtypes, autocast on) of every call of the registered sdpa attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls, inner = [], ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, key, value, *args, **kwargs):
        calls.append((query.dtype, key.dtype, value.dtype, torch.is_autocast_enabled("cpu")))
        return inner(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spy)
    return calls


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(arch):
    return make_tiny_model(arch)


def tiny_inputs(batch: int = 3, seq: int = 11, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def make_char_tokenizer():
    """Character-level tokenizer: 4 special tokens, printable ASCII, padded to exactly VOCAB.

    ``len(tokenizer) == config.vocab_size`` matters: lm-eval's ``hf`` model resizes the
    embeddings of a model loaded with ``peft=`` when they differ.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"])}  # tiny_config's ids
    for c in [*range(32, 127), ord("\n"), ord("\t")]:
        vocab[chr(c)] = len(vocab)
    for i in range(len(vocab), VOCAB):
        vocab[f"<extra_{i}>"] = i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def load_bench_script(name: str):
    """``recipes/bench/<name>.py`` as a module (the bench scripts are scripts, not a package).

    Registered in ``sys.modules`` under ``name``: dataclasses look their module up there."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "recipes" / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def save_tiny_folder(arch: str, path, seed: int = 0, **overrides):
    """Save a tiny model of ``arch`` and the character tokenizer as a loadable model folder."""
    from pathlib import Path

    path = Path(path)
    make_tiny_model(arch, seed=seed, **overrides).save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_folder("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory):
    """A small calibration text file (one sentence per line) for compression tests."""
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text("\n".join(f"The quick brown fox {i} jumps over the lazy dog number {i * 7}." for i in range(12)))
    return p


def write_tiny_gguf(path, arch: str = "llama", n_layers: int = 2, seed: int = 0) -> dict:
    """Write a loadable tiny GGUF file (float32, a byte-level vocabulary of 64); return its tensors by name.

    ``N_HEADS`` query heads of width 8, 2 KV heads. ``arch`` other than ``llama`` writes the
    same tensors under that architecture name (for refusals: only the header is read).
    """
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    head_dim, vocab, ffn = 8, 64, 64
    hidden = N_HEADS * head_dim
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<{i}>" for i in range(3)] + [chr(97 + i % 26) * (1 + i // 26) for i in range(vocab - 3)])
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges(["a a"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(n_layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (2 * head_dim, hidden), f"blk.{i}.attn_v.weight": (2 * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        })
    tensors = {}
    for name, shape in shapes.items():
        t = 1 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.1 * rng.standard_normal(shape)
        tensors[name] = t.astype(np.float32)
        w.add_tensor(name, tensors[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def loglik_probe(n: int = 5, seed: int = 0):
    """A log-likelihood probe of ``n`` random documents (contexts of 4-11 tokens, 1-3 scored)."""
    import numpy as np

    from capsense.scoring.probe import Probe

    rng = np.random.default_rng(seed)
    ctx = [rng.integers(4, VOCAB, rng.integers(4, 12)).tolist() for _ in range(n)]
    cont = [rng.integers(4, VOCAB, rng.integers(1, 4)).tolist() for _ in range(n)]
    return Probe("toy", "loglikelihood", ctx, cont, np.arange(n), list(range(n)))


def choice_probe(n_docs: int = 3, seed: int = 1):
    """A 3-way multiple-choice probe: each document's choices share its context."""
    import numpy as np

    from capsense.scoring.probe import Probe

    rng = np.random.default_rng(seed)
    ctx, cont, doc_of, choice_of = [], [], [], []
    for d in range(n_docs):
        c = rng.integers(4, VOCAB, 6).tolist()
        for j in range(3):
            ctx.append(c)
            cont.append(rng.integers(4, VOCAB, rng.integers(1, 3)).tolist())
            doc_of.append(d)
            choice_of.append(j)
    return Probe("mc", "multiple_choice", ctx, cont, np.array(doc_of), list(range(n_docs)),
                 gold=rng.integers(0, 3, n_docs), choice_of=np.array(choice_of))
