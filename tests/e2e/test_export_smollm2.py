"""End to end on SmolLM2-135M: export both formats, evaluate with stock ``lm_eval --model hf``.

Per-sample log-likelihoods must equal ``capsense-masked`` with the same heads on the base.
Slow (about 2 minutes on 2 idle CPU cores; lm_eval's start-up dominates): run with ``pytest -m slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
HEADS = "L3H1+L7H4+L12H0+L20H5"
TASK, LIMIT = "capsense_arithmetic", "20"


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _run_measured(code: str) -> int:
    """Run ``python -c code``; return its peak resident memory in bytes."""
    proc = subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    output = proc.stdout.read().decode(errors="replace")
    proc.stdout.close()
    assert os.waitstatus_to_exitcode(status) == 0, output[-3000:]
    return usage.ru_maxrss * 1024


def _lm_eval(model: str, model_args: str, out: Path) -> dict[int, list[float]]:
    cmd = [
        sys.executable, "-m", "lm_eval", "--model", model, "--model_args", f"{model_args},dtype=float32",
        "--include_path", str(REPO / "lm_eval_tasks"), "--tasks", TASK, "--limit", LIMIT,
        "--device", "cpu", "--batch_size", "8", "--log_samples", "--output_path", str(out),
    ]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    scores = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        scores[s["doc_id"]] = [float(r[0]) for request in s["resps"] for r in request]
    assert len(scores) == int(LIMIT)
    return scores


def test_smollm2_exports_match_capsense_masked(tmp_path):
    from safetensors import safe_open

    from capsense.core.models import resolve_pretrained

    base = resolve_pretrained("smollm2-135m")  # converts once (~45 s), then cached
    ckpt, adapter = tmp_path / "ckpt", tmp_path / "adapter"
    call = "from capsense.ship.export import export_{0} as f; f('smollm2-135m', {1!r}, {2!r})"
    rss_adapter = _run_measured(call.format("adapter", HEADS, str(adapter)))  # loads no weights
    rss_ckpt = _run_measured(call.format("checkpoint", HEADS, str(ckpt)))
    weights = (Path(base) / "model.safetensors").stat().st_size
    print(f"peak RSS: checkpoint export {rss_ckpt / 2**20:.0f} MiB, adapter export {rss_adapter / 2**20:.0f} MiB, "
          f"weights {weights / 2**20:.0f} MiB")
    # one copy of the weights on top of what the same process needs without them
    assert rss_ckpt - rss_adapter < 1.5 * weights, (rss_ckpt, rss_adapter, weights)

    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        assert sum(f.get_tensor(k).numel() * 4 for k in f.keys()) == 4 * 576 * 4  # 4 layers x 576 x fp32
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        w = f.get_tensor("model.layers.7.self_attn.o_proj.weight")
    assert (w[:, 4 * 64 : 5 * 64] == 0).all() and (w[:, : 4 * 64] != 0).any()

    masked = _lm_eval("capsense-masked", f"pretrained=smollm2-135m,heads={HEADS}", tmp_path / "masked")
    from_ckpt = _lm_eval("hf", f"pretrained={ckpt}", tmp_path / "hf-ckpt")
    from_peft = _lm_eval("hf", f"pretrained={base},peft={adapter}", tmp_path / "hf-peft")
    for got in (from_ckpt, from_peft):
        assert got.keys() == masked.keys()
        worst = max(abs(a - b) for d in masked for a, b in zip(masked[d], got[d]))
        assert worst <= 1e-5, worst
