"""The README's "From Python" block, run as written on the tiny model (its MODEL line swapped for the tiny model's
folder): a researcher copies it first, and a renamed parameter or function must fail here, not in their notebook."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[3] / "README.md"


def python_block() -> str:
    text = README.read_text()
    section = text.split("## From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_block_runs_and_makes_what_it_says(tmp_path, tiny_model_dir, monkeypatch):
    code = python_block()
    assert code.count('MODEL = "smollm2-135m"\n') == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace('MODEL = "smollm2-135m"', f"MODEL = {str(tiny_model_dir)!r}"), "README.md", "exec"), {})
    from transformers import AutoModelForCausalLM

    assert (tmp_path / "runs/py-induction/heads.json").is_file()
    assert {"validation.json", "validation.md"} <= {p.name for p in (tmp_path / "runs/py-induction/validate").iterdir()}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out/py-ckpt") is not None
    assert (tmp_path / "out/py-rtn4/config.json").is_file()
