"""`--overwrite` deletes an existing output folder once the new one is in place: an output folder that is, or holds,
what the run reads (the model, the student, a heads file) is refused, one error, nothing deleted. Until round 53
`capsense compress ./proj/model --out ./proj --overwrite` deleted the model it had just read, with the folder."""

from __future__ import annotations

import shutil

from click.testing import CliRunner

from capsense.cli import main


def _files(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_an_output_folder_holding_an_input_is_refused_with_overwrite(tmp_path, tiny_model_dir):
    proj = tmp_path / "proj"
    shutil.copytree(tiny_model_dir, proj / "model")
    (proj / "heads.json").write_text('{"model": "m", "task": "t", "heads": [{"layer": 0, "head": 1}]}')
    before = _files(proj)
    model = str(proj / "model")
    runs = {
        "compress into the model's parent": ["compress", model, "--method", "magnitude", "--density", "0.5"],
        "export into the model": ["export", model, "--heads", "L0H1", "--format", "checkpoint"],
        "export into the heads file's folder": ["export", str(tiny_model_dir), "--heads", str(proj / "heads.json"),
                                               "--format", "adapter"],
        "distill into the student": ["distill", model, "--teacher", str(tiny_model_dir)],
    }
    for (name, args), out in zip(runs.items(), (proj, proj / "model", proj, proj / "model")):
        r = CliRunner().invoke(main, [*args, "--out", str(out), "--overwrite"])
        assert r.exit_code == 1 and r.output.count("Error") == 1, (name, r.output)
        assert f"output folder {str(out)!r} holds" in r.output and "which this run reads" in r.output, (name, r.output)
        assert _files(proj) == before, name  # nothing deleted, nothing half-written beside it
    r = CliRunner().invoke(main, [*runs["export into the model"][:-2], "--format", "checkpoint", "--out",
                                  str(tmp_path / "elsewhere"), "--overwrite"])
    assert r.exit_code == 0, r.output  # another folder: as before


def test_an_output_file_that_is_an_input_is_refused(tmp_path, tiny_model_dir):
    """evaluate's table written over the heads file it read, measure's JSON over the model's config: refused."""
    tiny_model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")  # (a copy: a regression writes over it)
    heads = tmp_path / "heads.json"
    heads.write_text(f'{{"model": "{tiny_model_dir}", "task": "capsense_arithmetic", "heads": [{{"layer": 0, "head": 1}}]}}')
    kept = heads.read_text(), (tiny_model_dir / "config.json").read_text()
    for args, out in [(["evaluate", str(tiny_model_dir), "--heads", str(heads), "--tasks", "capsense_arithmetic"], heads),
                      (["measure", str(tiny_model_dir), "--capabilities", "arithmetic", "--probes", "2"],
                       tiny_model_dir / "config.json")]:
        r = CliRunner().invoke(main, [*args, "--out", str(out)])
        assert r.exit_code == 1 and r.output.count("Error") == 1, r.output
        assert f"--out {str(out)!r} is" in r.output and "which this run reads" in r.output, r.output
    assert (heads.read_text(), (tiny_model_dir / "config.json").read_text()) == kept
