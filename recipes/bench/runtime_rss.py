"""Runtime without the model: resident memory of python after importing torch, transformers and capsense's CLI
and building a guided SmolLM2 run's calibration texts and probes with its tokenizer, no weights loaded. What the
guided memory check does not count because it is already resident when the check runs (round 19: 0.44 GiB)::

    PYTHONPATH=. python recipes/bench/runtime_rss.py
"""



def cur():
    """VmRSS and VmHWM of this process, GiB."""
    with open('/proc/self/status') as f:
        return {l.split(':')[0]: int(l.split()[1]) / 2**20 for l in f if l.startswith(('VmRSS', 'VmHWM'))}
print("bare python", cur())
import torch, transformers  # noqa
import capsense.cli  # noqa
print("after imports", cur())
from transformers import AutoTokenizer
from capsense.core.models import resolve_pretrained
from capsense.compress.calibration import calibration_samples
from capsense.compress.capability_loss import capability_probe
tok = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2-135m"))
calibration_samples("prose,math,code,qa,math", tok, 16)
capability_probe("math", tok, 32)
print("after tokenizer, calibration texts and probes", cur())
