"""lm-eval's log-likelihood requests with the LM head at the continuations' positions only (``capsense-masked``).

lm-eval's ``hf`` model computes the logits of every position of a batch and a log-softmax over the whole
vocabulary at each ([batch, length, vocabulary] in float32), then keeps the continuation's few positions.
On SmolLM2-135M (49k words, width 576) the LM head and that log-softmax took 19-31% of a 16-row batch's
forward at 48-160 tokens (an ad-hoc timing, float32, two threads); with Gemma 3's 262k words the head costs
about as much as all the blocks, and on a GPU the [batch, length, vocabulary] tensor is what limits the batch.

:func:`continuation_loglikelihoods` does ``hf``'s work in ``hf``'s order: lm-eval's own ``Collator`` sorts and
batches the requests (longest first; one run per context for one-token continuations, lm-eval's cache) and
its ``pad_and_concat`` pads them, the decoder runs on exactly ``hf``'s input tensor (no attention mask, the
context truncated from the left to ``max_length``), so its hidden states are ``hf``'s bit for bit. Only then
does it differ: the head runs at the positions a continuation token is predicted from, each once, and the
log-softmax over those rows. A request gets what ``hf`` returns, the float32 sum of its continuation's
log-probabilities and whether each token is the log-softmax's greedy choice, to float32 rounding: the head's
matrix product over fewer rows rounds its last bits differently, so a sum can move in its last bits: at most
9.5e-6 nats over the 858 requests of SmolLM2's 18-task validation suite, every greedy flag and every metric to 6
decimals the same, in 0.78x the time (``recipes/bench/bench_loglikelihood.py``; Gemma 3 270M: identical, 0.37x).
``full_logits=true`` (:class:`~capsense.evaluation.lm_eval_model.CapsenseMaskedLM`) keeps ``hf``'s own path.

Only for a model of an architecture capsense knows (:data:`~capsense.core.arch.ARCHITECTURES`: the unit tests check
every request against its full forward on all ten tiny ones) that computes in float32
(:func:`~capsense.core.precision.computes_in_float32`): capsense's
head (:func:`~capsense.scoring.logits.output_logits`) computes in float32, which is ``hf``'s precision there. A
bfloat16 or float16 model keeps ``hf``'s own path, whose log-softmax runs in the model's dtype: capsense's float32
head would score it more precisely than ``lm_eval --model hf`` does, by more than rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

from capsense.errors import CapsenseError


#: lm-eval's request triple for a log-likelihood: ((context, continuation) strings, context tokens, continuation tokens).
TokenRequest = tuple[tuple[str, str], Sequence[int], Sequence[int]]


def continuation_loglikelihoods(model, requests: Sequence[TokenRequest], max_length: int, batch_size: int, device,
                                forward: Callable[[], AbstractContextManager] = nullcontext, one_token_cache: bool = True,
                                done: Callable[[int], None] = lambda n: None,
                                record: Callable[[tuple[str, str], tuple[float, bool]], None] = lambda r, a: None,
                                ) -> list[tuple[float, bool]]:
    """Per request, in the given order: the summed log-probability of its continuation tokens and whether each is
    the greedy choice, batched as lm-eval's ``hf`` batches them (``batch_size`` requests; ``one_token_cache``: its
    ``logits_cache``), each forward inside ``forward()`` (the head ablation). ``done(n)`` after each batch, with
    the number of requests it completed; ``record(strings, answer)`` for each (lm-eval's cache hook)."""
    import torch
    from lm_eval.models.utils import Collator
    from lm_eval.models.utils_hf import pad_and_concat

    from capsense.scoring.logits import scored_hidden

    for _, context, continuation in requests:
        if not context or not continuation or len(continuation) > max_length:
            raise CapsenseError(f"a log-likelihood request needs a context and a continuation of 1 to {max_length} tokens "
                                f"(the model's length); got {len(context)} and {len(continuation)}")
    order = Collator(requests, sort_fn=lambda r: (-len(r[1]) - len(r[2]), tuple(r[1]) + tuple(r[2])),
                     group_by="contexts" if one_token_cache else None, group_fn=lambda r: r[-2] + r[-1][:-1])
    res: list[tuple[float, bool]] = []
    for chunk in order.get_batched(n=max(1, batch_size), batch_fn=None):
        inps = [torch.tensor((list(ctx) + list(cont))[-(max_length + 1):][:-1], dtype=torch.long, device=device)
                for _, ctx, cont in chunk]
        spans = [(len(x), len(cont)) for x, (_, _, cont) in zip(inps, chunk)]  # (before padding: it pads the list in place)
        with torch.no_grad(), forward():
            hidden = scored_hidden(model, pad_and_concat(max(n for n, _ in spans), inps, padding_side="right"), None)
            logp = _continuation_logprobs(model, hidden, spans)
        before = len(res)
        for (strings, ctx, cont), lp in zip(chunk, logp):
            # one request, or each of a one-token group sharing its row (lm-eval's cache), in the order it records
            for req, tokens, scores in order.get_cache(req_str=strings, cxt_toks=ctx, cont_toks=cont, logits=lp):
                tgt = torch.tensor(tokens, dtype=torch.long, device=scores.device).unsqueeze(0)
                greedy = (scores.argmax(dim=-1)[:, -tgt.shape[1]:] == tgt).all()
                answer = (float(torch.gather(scores, 2, tgt.unsqueeze(-1)).squeeze(-1).sum()), bool(greedy))
                res.append(answer)
                record(req, answer)
        done(len(res) - before)
    return order.get_original(res)


def _continuation_logprobs(model, hidden, spans: list[tuple[int, int]]) -> list:
    """Per row of ``hidden`` with (input length, continuation length): the log-softmax at the positions that predict
    the continuation, ``[1, continuation length, vocabulary]``, the head run once over all of them."""
    import torch

    from capsense.scoring.logits import output_logits

    rows = torch.tensor([j for j, (n, c) in enumerate(spans) for _ in range(c)], device=hidden.device)
    positions = torch.tensor([p for n, c in spans for p in range(n - c, n)], device=hidden.device)
    logp = torch.log_softmax(output_logits(model, hidden[rows, positions]), dim=-1, dtype=torch.float32)
    return [part.unsqueeze(0) for part in torch.split(logp, [c for _, c in spans])]
