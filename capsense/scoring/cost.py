"""Cost in forward-equivalents: what a localization run spends, comparable across methods.

One forward pass over the run's documents (every probe) = 1; a backward pass = 2 (so a
gradient attribution costs 3); a forward that starts at layer ``l`` from cached clean
activations (prefix reuse) = the fraction of layers it runs, ``(n_layers - l) / n_layers``.
Log-likelihood and multiple-choice probes alike reuse prefixes (round 11: a multiple-choice
knockout replays both of its shared-context passes from its first layer,
:mod:`capsense.scoring.shared_prefix`); a scorer that cannot (several masks per forward, an
architecture whose replay check fails) pays 1 per mask; with several probes the cost is their token-weighted mix. The clean
model's forward costs 1, less the share of it another pass already ran (``folded``: the gradient
attribution's forward is a clean forward, and its scores and block inputs serve as the clean
evaluation's where the batches are the same, log-likelihood and (round 12) multiple-choice probes alike; :meth:`capsense.localize.evaluator.MaskEvaluator.clean_sinks`).

The backward's 2 is the training rule of thumb (gradients of the inputs and of the weights). The
attribution freezes the weights, so its backward computes the activations' gradients only. Timed beside a
clean forward of the same probe (``recipes/bench/bench_attribution_cost.py``, round 35: float32, two CPU
threads, SmolLM2-135M and Gemma 3 270M on induction, antonyms and arithmetic, medians of 5), the whole
attribution cost 2.03-2.27 forwards, not 3 (1.92-2.23 in an earlier run). The charge stays 3: FE stay
comparable across rounds and methods and never undercount where a backward is dearer (a GPU's is not yet
measured; ``bench_gpu.py`` times it on the next lease). So on such a CPU a run's FE overstate its
attribution by about 1; at that price the recovery table's FE to 4/5 fall by about 1, which still leaves
SmolLM2 induction and antonyms and Gemma 3 induction above the issue's 8.
"""

from __future__ import annotations

from collections.abc import Sequence

FORWARD = 1.0
BACKWARD = 2.0
ATTRIBUTION = FORWARD + BACKWARD


def mask_cost(heads: Sequence[int], n_layers: int, n_heads: int, reuse_share: float = 1.0, folded: float = 0.0) -> float:
    """Forward-equivalents of evaluating one knockout mask (flat head indices).

    ``reuse_share``: the share of the run's tokens whose scorer reuses the clean prefix (0..1).
    The clean model (no heads) costs a full forward (it fills the prefix cache), less ``folded``:
    the share of the run's tokens whose clean forward an earlier pass already ran (0..1).
    """
    if not len(heads):
        return FORWARD * (1.0 - folded)
    first = min(int(h) for h in heads) // n_heads
    partial = (n_layers - first) / n_layers
    return (1.0 - reuse_share) * FORWARD + reuse_share * partial * FORWARD

