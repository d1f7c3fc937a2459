"""Guided GPTQ/SparseGPT calibrate on the kept capability too: shares, the rule, and what the checkpoint records."""

import json

import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.errors import CapsenseError


def test_a_source_named_twice_takes_two_shares_of_distinct_texts(tmp_path):
    from conftest import make_char_tokenizer

    from capsense.compress.calibration import calibration_samples

    tok = make_char_tokenizer()
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n".join(f"text a{i}" for i in range(10)))
    b.write_text("\n".join(f"text b{i}" for i in range(10)))
    samples, info = calibration_samples(f"{a},{b},{a}", tok, 6)
    assert [r["source"] for r in info] == [str(a), str(b)] and [r["n"] for r in info] == [4, 2]
    texts = [tok.decode(s) for s in samples]
    assert len(texts) == 6 and len(set(texts)) == 6  # four distinct texts of a, not two repeated
    once, _ = calibration_samples(f"{a},{b}", tok, 6)
    assert sum(tok.decode(s).startswith("text a") for s in once) == 3  # named once: three shares of six


def test_kept_calibration_is_the_default_mix_plus_the_kept_capabilities():
    from capsense.compress.calibration import DEFAULT_CALIBRATION, kept_calibration

    assert kept_calibration(["math"]) == DEFAULT_CALIBRATION + ",math"
    assert kept_calibration(["code", "math", "code"]) == DEFAULT_CALIBRATION + ",code,math"
    assert kept_calibration(["qa"], "prose") == "prose,qa"
    with pytest.raises(CapsenseError, match="unknown capability 'mathh'"):
        kept_calibration(["mathh"])


@pytest.mark.parametrize("setting,kept", [
    ({"method": "gptq", "bits": 3}, True), ({"method": "sparsegpt", "density": 0.5}, True),
    ({"method": "rtn", "bits": 3}, False), ({"method": "wanda", "density": 0.5}, False),
    ({"method": "svd-llm", "ratio": 0.5}, False),
])
def test_only_compensating_methods_under_keep_calibrate_on_the_kept_capability(setting, kept):
    from capsense.compress.budget import uniform_budget
    from capsense.compress.calibration import DEFAULT_CALIBRATION
    from capsense.compress.guided import Guide
    from capsense.compress.request import default_calibration

    budget = uniform_budget(setting)
    assert default_calibration(budget, None) == DEFAULT_CALIBRATION
    want = DEFAULT_CALIBRATION + ",code" if kept else DEFAULT_CALIBRATION
    assert default_calibration(budget, Guide(["code"])) == want


def _calibrated_docs(out) -> dict[str, int]:
    meta = json.loads((out / "capsense.json").read_text())
    return {r["source"]: len(r["doc_ids"]) for r in meta["calibration"]}


def test_guided_gptq_checkpoint_calibrated_on_the_kept_capability_unless_told(tmp_path, tiny_model_dir):
    from capsense.compress.capabilities import task_of

    def compress(out, *extra):
        r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "gptq", "--bits", "4", "--group-size",
                                      "32", "--calibration-samples", "5", "--out", str(tmp_path / out), *extra])
        assert r.exit_code == 0, r.output
        return _calibrated_docs(tmp_path / out)

    guided = compress("g", "--keep", "math")
    assert guided[task_of("math")] == 2 and sum(guided.values()) == 5  # two shares of five: its last two documents
    assert {task_of(c) for c in ("prose", "code", "qa")} <= set(guided)
    uniform = compress("u")
    assert uniform[task_of("math")] == 1 and sum(uniform.values()) == 5  # unguided: the default mix, one share of four
    told = compress("t", "--keep", "math", "--calibration", "code")
    assert told == {task_of("code"): 5}
