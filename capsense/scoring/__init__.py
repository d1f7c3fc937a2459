"""Scores under knockouts: probes (a task's requests tokenized once) and the per-mask scorers."""

#: Scores only a multiple-choice probe has: ``choice_nll``, nats per document of the gold choice under the
#: softmax over the document's choices (each choice's summed log-likelihood, as lm-eval's ``acc`` compares them).
CHOICE_METRICS = ("choice_nll",)

#: Built-in per-mask scores: nats/token of the reference continuation, exact-match / multiple-choice accuracy,
#: and the multiple-choice scores (:data:`CHOICE_METRICS`).
METRICS = ("nll", "acc", *CHOICE_METRICS)

#: The scores the gradient attribution differentiates (its estimates are of their change): nats/token of the
#: reference continuation, and a multiple-choice target's ``choice_nll``.
GRADIENT_METRICS = ("nll", "choice_nll")
