"""A Hub model's revision: a locate run records the one it loaded, and validate, evaluate, export and
capsense-masked load that one by default, where the model is the run's; a revision of a model with one version is
refused. Served offline from a Hugging Face cache with two revisions of the tiny model (different weights)."""

from __future__ import annotations

import json

import huggingface_hub.constants
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from capsense.cli import main
from capsense.core.heads import HeadsFile, located_revision, write_heads_file
from capsense.core.models import check_model, model_fingerprint
from capsense.errors import UnknownModelError
from conftest import save_tiny_folder
from _toy_task import TOY_CONTROL, TOY_TASK, write_toy_tasks

REPO = "capsense-test/tiny"
MAIN, V2 = "a" * 40, "b" * 40


@pytest.fixture
def hub(tmp_path_factory, monkeypatch):
    """A Hub cache holding ``REPO`` at ``main`` (seed 0) and branch ``v2`` (seed 1), served offline."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    for sha, seed, ref in ((MAIN, 0, "main"), (V2, 1, "v2")):
        save_tiny_folder("llama", repo / "snapshots" / sha, seed=seed)
        (repo / "refs" / ref).write_text(sha)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_a_revision_of_a_model_with_one_version_is_refused(tmp_path):
    folder = save_tiny_folder("llama", tmp_path / "m")
    for name, kind in ((str(folder), "a local folder"), ("smollm2-135m", "an embedded model")):
        with pytest.raises(UnknownModelError, match=f"is {kind}, which has one version: give no revision, or the Hub id"):
            check_model(name, "v2")
    r = CliRunner().invoke(main, ["evaluate", str(folder), "--revision", "v2", "--tasks", "capsense_arithmetic"])
    assert r.exit_code != 0 and "has one version" in r.output


def test_the_fingerprint_names_the_commit_the_cache_holds_offline(hub):
    assert model_fingerprint(REPO, "v2") == {"model": REPO, "revision": "v2", "revision_sha": V2}
    assert model_fingerprint(REPO)["revision_sha"] == MAIN


def test_located_revision(hub, tmp_path):
    f = write_heads_file(tmp_path / "heads.json", HeadsFile(REPO, [{"layer": 1, "head": 2}], {"revision": "v2"}))
    assert located_revision(f, REPO, None) == "v2"  # the run's
    assert located_revision(f, REPO, "main") == "main"  # given wins
    assert located_revision(f, "other/model", None) is None  # another model (a local copy): its own
    assert located_revision("L1H2", REPO, None) is None
    old = write_heads_file(tmp_path / "old.json", HeadsFile(REPO, [{"layer": 1, "head": 2}], {}))
    assert located_revision(old, REPO, None) is None  # a file from before round 52: the default branch, as before


def test_commands_load_the_revision_the_run_located_on(hub, tmp_path):
    """locate --revision v2 records it; evaluate, validate, export and capsense-masked given its heads file load v2, not main
    (the base scores and weights are v2's), unless told another revision."""
    tasks = write_toy_tasks(tmp_path / "tasks")
    run = tmp_path / "run"
    r = CliRunner().invoke(main, ["locate", REPO, "--revision", "v2", "--task", TOY_TASK, "--controls", TOY_CONTROL,
                                  "--include-path", str(tasks), "--limit", "6", "--method", "exhaustive", "--top-k", "2",
                                  "--no-progress", "--out", str(run)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    heads = run / "heads.json"
    assert json.loads(heads.read_text())["revision"] == "v2"
    assert json.loads((run / "manifest.json").read_text())["model"]["revision_sha"] == V2

    def base(*extra: str) -> str:
        r = CliRunner().invoke(main, ["evaluate", REPO, "--heads", str(heads), "--tasks", "capsense_prose", "--limit",
                                      "2", *extra], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        said = f"{REPO}: loading revision v2, the one the heads file's run located on" in r.output
        assert said == (not extra)  # said where the file chose it, not where the command line did
        return next(line for line in r.output.splitlines() if line.startswith("| capsense_prose | nats_per_token "))

    assert base() == base("--revision", "v2") != base("--revision", "main")

    val = tmp_path / "val"
    r = CliRunner().invoke(main, ["validate", REPO, "--heads", str(heads), "--top-k", "2", "--tasks", TOY_CONTROL,
                                  "--random", "0", "--limit", "2", "--include-path", str(tasks), "--no-progress",
                                  "--out", str(val)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads((val / "validation.json").read_text())["revision"] == "v2"
    assert f"- model: `{REPO}` at revision `v2`" in (val / "validation.md").read_text().splitlines()
    assert json.loads((val / "conditions.jsonl").read_text().splitlines()[0])["key"]["model"] == f"{REPO}@v2"

    out = tmp_path / "export"
    r = CliRunner().invoke(main, ["export", REPO, "--heads", str(heads), "--top-k", "2", "--format", "checkpoint", "--out", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    exported, v2 = _weights(out), _weights(hub / "snapshots" / V2)
    embed = "model.embed_tokens.weight"
    assert torch.equal(exported[embed], v2[embed]) and not torch.equal(exported[embed], _weights(hub / "snapshots" / MAIN)[embed])
    assert json.loads((out / "capsense.json").read_text())["base_model"]["revision_sha"] == V2
    adapter = tmp_path / "adapter"
    r = CliRunner().invoke(main, ["export", REPO, "--heads", str(heads), "--top-k", "2", "--format", "adapter", "--out",
                                  str(adapter)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads((adapter / "adapter_config.json").read_text())["revision"] == "v2"  # PEFT loads that base

    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    lm = CapsenseMaskedLM(pretrained=REPO, head_file=str(heads), top_k=2, batch_size=1)
    assert torch.equal(lm.model.model.embed_tokens.weight, v2[embed])


def test_measure_compress_and_distill_load_the_revision_given(hub, tmp_path):
    def measured(*extra: str) -> dict:
        out = tmp_path / f"m{len(list(tmp_path.iterdir()))}.json"
        r = CliRunner().invoke(main, ["measure", REPO, "--capabilities", "prose", "--probes", "2", *extra, "--out", str(out)],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return json.loads(out.read_text())

    v2 = measured("--revision", "v2")
    assert v2["revision"] == "v2" and "revision" not in measured()
    assert v2["capabilities"]["prose"]["nll"] != measured()["capabilities"]["prose"]["nll"]
    against = measured("--revision", "v2", "--reference", REPO, "--reference-revision", "main")  # one against the other
    prose = against["capabilities"]["prose"]
    assert against["reference_revision"] == "main" and prose["nll0"] == measured()["capabilities"]["prose"]["nll"]
    assert prose["dL"] == pytest.approx(v2["capabilities"]["prose"]["nll"] - prose["nll0"])
    r = CliRunner().invoke(main, ["measure", REPO, "--reference-revision", "main", "--out", str(tmp_path / "x.json")])
    assert r.exit_code == 1 and "--reference-revision is the revision of --reference: give both, or neither" in r.output

    out = tmp_path / "c"
    r = CliRunner().invoke(main, ["compress", REPO, "--revision", "v2", "--method", "magnitude", "--density", "0.5",
                                  "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads((out / "capsense.json").read_text())["base_model"]["revision_sha"] == V2
    embed = "model.embed_tokens.weight"  # not pruned: the revision's own (saved in bfloat16)
    saved = _weights(out)[embed]
    for sha, same in ((V2, True), (MAIN, False)):
        assert torch.equal(saved, _weights(hub / "snapshots" / sha)[embed].to(saved.dtype)) is same

    # distill's teacher: the revision the student was compressed from, unless told another
    args = ["distill", str(out), "--teacher", REPO, "--epochs", "1", "--texts", "2", "--gen-tokens", "2", "--seq-len", "16",
            "--capabilities", "addition", "--probes", "2"]
    for extra, expected in (((), "v2"), (("--teacher-revision", "main"), "main")):
        d = tmp_path / f"d{len(extra)}"
        r = CliRunner().invoke(main, [*args, *extra, "--out", str(d)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert json.loads((d / "capsense.json").read_text())["distill"]["config"]["teacher_revision"] == expected


def test_grid_loads_the_revision_given_and_resumes_only_its_own(hub, tmp_path):
    base = ["grid", REPO, "--methods", "magnitude", "--densities", "0.5", "--capabilities", "prose", "--probes", "2",
            "--no-progress"]
    out = tmp_path / "g.jsonl"
    r = CliRunner().invoke(main, [*base, "--revision", "v2", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    v2 = [json.loads(line) for line in out.read_text().splitlines()]
    assert {rec["grid"]["revision"] for rec in v2} == {"v2"}
    main_out = tmp_path / "m.jsonl"
    r = CliRunner().invoke(main, [*base, "--out", str(main_out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    dense = [json.loads(line)["nll"] for line in main_out.read_text().splitlines()][0]
    assert "revision" not in json.loads(main_out.read_text().splitlines()[0])["grid"] and dense != v2[0]["nll"]
    r = CliRunner().invoke(main, [*base, "--out", str(out)])  # the default branch on v2's file: another grid
    assert r.exit_code == 1 and "holds measurements of another grid" in r.output


def test_the_config_checks_before_a_load_read_the_revision_given(hub, tmp_path, monkeypatch):
    """A branch whose config is a mixture of experts: compress --revision refuses its MLP before any weights load (main's
    config, a dense Llama, said nothing), and the head layout read without torch is the branch's."""
    from capsense.core.model_config import config_head_layout

    save_tiny_folder("mixtral", hub / "snapshots" / ("c" * 40))
    (hub / "refs" / "moe").write_text("c" * 40)
    assert config_head_layout(REPO).family == "llama" and config_head_layout(REPO, "moe").family == "mixtral"

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_load)
    r = CliRunner().invoke(main, ["compress", REPO, "--revision", "moe", "--method", "rtn", "--bits", "4",
                                  "--out", str(tmp_path / "out")])
    assert r.exit_code != 0 and "mixture-of-experts model (mixtral)" in r.output, r.output
    assert not (tmp_path / "out").exists()
