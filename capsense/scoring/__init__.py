"""Scores under knockouts: probes (a task's requests tokenized once) and the per-mask scorers."""
