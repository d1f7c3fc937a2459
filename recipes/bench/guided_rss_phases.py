"""Resident memory against live tensor bytes through a one-pass guided run, on a random Llama of SmolLM2-135M's
widths with few layers (no weights loaded, no heavy-job lock): the CLI's own run (``capsense compress MODEL --method
gptq --bits 4 --group-size 64 --keep math --calibration-samples 16``, SmolLM2's tokenizer and texts) in-process,
marked at calibration, the Fisher/plan, every matrix priced and the candidates: VmRSS, its anonymous and file
parts, VmHWM and (at phase edges) the bytes of every live torch storage. Round 20 found the pricing phase's growth
this way (recipes/results/RESULTS-compress.md)::

    PYTHONPATH=. OMP_NUM_THREADS=1 python recipes/bench/guided_rss_phases.py 3 [--stop-before-candidates]
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time

import torch
import transformers as T

import capsense.compress.allocate as allocate
import capsense.compress.engine as engine
import capsense.compress.guided as guided
import capsense.compress.select as select
import capsense.core.models as models
from capsense.core.models import resolve_pretrained

T0 = time.time()


def _status() -> dict[str, float]:
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) / 1024 for line in f
                if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile"))}


def _live_tensor_mib() -> float:
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            s = o.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values()) / 2**20


def mark(what: str, tensors: bool = False) -> None:
    s = _status()
    live = f", live tensors {_live_tensor_mib():.0f}" if tensors else ""
    print(f"[{time.time() - T0:7.1f}s] {what}: RSS {s['VmRSS']:.0f} (anon {s['RssAnon']:.0f}, file {s['RssFile']:.0f}), "
          f"HWM {s['VmHWM']:.0f} MiB{live}", flush=True)


def _marked(module, name: str) -> None:
    real = getattr(module, name)

    def run(*a, **k):
        mark(f"enter {name}", True)
        out = real(*a, **k)
        mark(f"leave {name}", True)
        return out

    setattr(module, name, run)


class _Stop(Exception):
    pass


def main(layers: int, stop: bool) -> None:
    def random_load(name, dtype="float32", **_k):
        path = resolve_pretrained("smollm2-135m")
        config = T.AutoConfig.from_pretrained(path)
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        return T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), T.AutoTokenizer.from_pretrained(path)

    models.load_model = random_load
    for module, name in ((engine, "calibrate"), (guided, "plan_guided"), (guided, "price_matrices")):
        _marked(module, name)
    priced = allocate.matrix_candidates

    def price(*a, **k):
        out = priced(*a, **k)
        mark(f"priced {a[0]}")
        return out

    guided.matrix_candidates = price
    if stop:
        def halt(*_a, **_k):
            mark("the candidates would start", True)
            raise _Stop
        select.compress_better = halt
    else:
        _marked(select, "compress_better")
    from capsense.cli import main as cli

    mark("start", True)
    with tempfile.TemporaryDirectory() as out:
        try:
            cli(["compress", "smollm2-135m", "--method", "gptq", "--bits", "4", "--group-size", "64", "--keep", "math",
                 "--calibration-samples", "16", "--out", f"{out}/ckpt"], standalone_mode=False)
        except _Stop:
            pass
    mark("end", True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, "--stop-before-candidates" in sys.argv)
