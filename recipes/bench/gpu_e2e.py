"""The whole job on a GPU through the real commands: locate, validate, export, reload with plain transformers.

    python recipes/bench/gpu_e2e.py --tokenizer TOKDIR --out OUT [--shape llama-1b] [--device cuda]
    python recipes/bench/gpu_e2e.py --tokenizer TOKDIR --out OUT --cpu-smoke   # tiny shape on the CPU

``TOKDIR``: any folder with a tokenizer. Round 24 used the embedded SmolLM2's (``tokenizer.json``,
``tokenizer_config.json`` and ``chat_template.jinja`` copied from ``~/.cache/capsense/models/
smollm2-135m-instruct``, 3.4 MB, carried to a GPU machine that reaches no Hub beside lm-eval's wheels).

What the CPU tests cannot show: that ``capsense locate`` (gradient attribution, knockouts, the
collateral screen, measure-and-choose), ``capsense validate`` (lm-eval through ``capsense-masked``)
and ``capsense export`` run on a CUDA device, what they cost there, and that the exported
checkpoint, loaded on the GPU by plain ``transformers``, reproduces the heads ablated at run time.

The model is built from a config (``--shape``) with random bf16 weights and ``TOKDIR``'s tokenizer
(a real one, so the tasks' documents tokenize as they would): nothing is downloaded, so it runs on
a machine that reaches no Hub. With random weights the heads found mean nothing and every
capability is at chance; what is measured is that each step runs, its wall time, the
forward-equivalents spent, and the exactness of the export (logits of the exported model vs the
base model with the same heads knocked out by :class:`capsense.core.ablation.HeadAblator`, in bf16
and in float32 on the device). Each step runs as a subprocess of the CLI (``python -m capsense``),
so the thin commands are what is exercised (``--batch-size auto`` compares the sizes locate resolves there with
16, the default, by two runs); a failing step is recorded with the tail of its output
and the later steps that need it are skipped. Writes ``OUT/gpu_e2e.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from capsense.core.ablation import ABLATION_MODES

SHAPES = {
    # Llama-3.2-1B's published block shapes (16 layers x 32 heads, 8 KV heads), any vocabulary
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
}


def build_model(shape: str, tokenizer_dir: Path, folder: Path, device: str = "cpu", seed: int = 0) -> dict:
    """A random-weight Llama of ``shape`` with ``tokenizer_dir``'s tokenizer, saved in bf16 to ``folder``
    (initialised on ``device``: a 1B model's initialisation takes ~50 s on a CPU, a second on a GPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(**SHAPES[shape], vocab_size=len(tok), max_position_embeddings=4096, rms_norm_eps=1e-5,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {"shape": shape, "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
            "vocab": len(tok)}


def step(name: str, args: list[str], log: Path, timeout: float) -> dict:
    """Run ``python -m capsense ARGS``; its wall time, exit status and output tail."""
    t0 = time.perf_counter()
    with log.open("w") as fh:
        try:
            rc = subprocess.run([sys.executable, "-m", "capsense", *args], stdout=fh, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = {"step": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "command": ["capsense", *args]}
    if rc != 0:
        out["tail"] = log.read_text()[-3000:]
    print(f"gpu_e2e: {name}: rc {rc}, {out['seconds']} s", file=sys.stderr, flush=True)
    return out


@torch.no_grad()
def export_agreement(base: Path, exported: Path, heads: str, device: str, tokenizer_dir: Path,
                     ablation: str = "zero") -> dict:
    """Max |logit difference| of the exported model vs the base with ``heads`` ablated at run time under
    ``ablation`` (mean: each head replaced by its mean over capsense's neutral prose, computed on the base in
    each dtype, as the export computes them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from capsense.core.ablation import HeadAblator, reference_means

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = ["The cat sat on the mat because the mat was warm.", "def add(a, b):\n    return a + b\n",
             "Paris is the capital of France; Rome is the capital of"]
    batch = [torch.tensor([tok(t)["input_ids"]], device=device) for t in texts]
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device).eval()
        b = AutoModelForCausalLM.from_pretrained(exported, dtype=dtype).to(device).eval()
        ablator = HeadAblator(a, ablation, reference_means(a, tok, ablation))
        worst = unablated = 0.0
        for ids in batch:
            lb = b(ids).logits.float()
            with ablator.apply(heads):
                worst = max(worst, float((a(ids).logits.float() - lb).abs().max()))
            unablated = max(unablated, float((a(ids).logits.float() - lb).abs().max()))
        out[str(dtype).removeprefix("torch.")] = {"max_abs_dlogit": worst, "vs_unablated_base": unablated}
        del a, b
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="Folder holding a tokenizer (tokenizer.json ...).")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--limit", type=int, default=24, help="Documents per task for locate.")
    ap.add_argument("--controls", default="default")
    ap.add_argument("--step-timeout", type=float, default=600)
    ap.add_argument("--masks-per-forward", default="auto", help="locate's --masks-per-forward (auto, or a count).")
    ap.add_argument("--batch-size", default="16", help="locate's and validate's --batch-size (a count, or auto).")
    ap.add_argument("--ablation", choices=ABLATION_MODES, default="zero",
                    help="locate's --ablation; validate and export apply the run's (their default).")
    ap.add_argument("--locate-only", action="store_true", help="Stop after locate (no validate, export).")
    ap.add_argument("--cpu-smoke", action="store_true", help="Tiny shape on the CPU, few documents, no controls.")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.shape, args.device, args.limit, args.controls = "tiny", "cpu", 4, "none"
    elif args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_e2e: no GPU here (torch.cuda.is_available() is False): nothing run. "
              "Use --cpu-smoke to check the script on a tiny config.")
        return 0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_dir, run_dir = out / "model", out / "run"
    info: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}, "steps": []}
    import transformers

    info["transformers"] = transformers.__version__
    t0 = time.perf_counter()
    info["model"] = build_model(args.shape, args.tokenizer, model_dir, args.device)
    info["model"]["build_s"] = round(time.perf_counter() - t0, 1)
    common = ["--device", args.device, "--no-progress", "--batch-size", args.batch_size]
    steps = info["steps"]
    steps.append(step("locate", ["locate", str(model_dir), "--task", "capsense_induction", "--controls", args.controls,
                                 "--limit", str(args.limit), "--dtype", "auto", "--ablation", args.ablation, "--masks-per-forward",
                                 args.masks_per_forward, "--out", str(run_dir), *common],
                      out / "locate.log", args.step_timeout))
    heads_json = run_dir / "heads.json"
    if steps[-1]["rc"] == 0:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        heads = json.loads(heads_json.read_text())
        info["locate"] = {"forward_equivalents": manifest.get("forward_equivalents"), "timing": manifest.get("timing"),
                          "masks_per_forward": manifest["args"].get("masks_per_forward_resolved"),
                          "batch_size": manifest["args"].get("batch_size_resolved"),
                          "attribution_batch_size": manifest["args"].get("attribution_batch_size_resolved"),
                          "dtype": manifest["args"].get("dtype_resolved"),
                          "ablation": heads.get("ablation"),
                          "top5": [f"L{h['layer']}H{h['head']}" for h in heads["heads"][:5]]}
    if steps[-1]["rc"] == 0 and not args.locate_only:
        steps.append(step("validate", ["validate", str(model_dir), "--heads", str(heads_json), "--top-k", "5",
                                       "--tasks", "capsense_induction", "--random", "1", "--limit", str(args.limit),
                                       "--device", args.device, "--batch-size", args.batch_size,
                                       "--out", str(out / "validate")],
                          out / "validate.log", args.step_timeout))
        steps.append(step("export", ["export", str(model_dir), "--heads", str(heads_json), "--top-k", "5",
                                     "--format", "checkpoint", "--out", str(out / "export")], out / "export.log",
                          args.step_timeout))
        if steps[-1]["rc"] == 0:
            heads_spec = json.loads((out / "export" / "capsense.json").read_text())["heads_spec"]
            info["export_agreement"] = export_agreement(model_dir, out / "export", heads_spec, args.device,
                                                        args.tokenizer, args.ablation)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "gpu_e2e.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({k: info.get(k) for k in ("model", "locate", "export_agreement", "seconds")}, indent=1))
    print(f"wrote {out / 'gpu_e2e.json'}")
    return 0 if all(s["rc"] == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
