"""Scores under knockouts: probes (a task's requests tokenized once) and the per-mask scorers."""

#: Built-in per-mask scores: nats/token of the reference continuation, and exact-match / multiple-choice accuracy.
METRICS = ("nll", "acc")
