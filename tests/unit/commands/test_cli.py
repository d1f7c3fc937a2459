from click.testing import CliRunner

from capsense import __version__
from capsense.cli import main


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_evaluate_bad_input_is_one_clear_message(tiny_model_dir):
    runner = CliRunner()
    cases = [
        (["--heads", "L0H1+oops"], "malformed head 'oops'"),
        (["--heads", "L9H0"], "layer 9 out of range in L9H0: this model has 3 layers (0-2)"),
        (["--heads", "L0H1", "--tasks", "no_such_task"], "unknown task(s) no_such_task"),
    ]
    for args, message in cases:
        result = runner.invoke(main, ["evaluate", str(tiny_model_dir), "--limit", "2", *args])
        assert result.exit_code == 1, result.output
        assert "Error: " in result.output and message in result.output
        assert "Traceback" not in result.output


def test_evaluate_prints_table(tiny_model_dir, tmp_path):
    out = tmp_path / "table.json"
    result = CliRunner().invoke(
        main,
        ["evaluate", str(tiny_model_dir), "--heads", "L0H1+L2H3", "--tasks", "capsense_addition",
         "--limit", "3", "--batch-size", "3", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "| capsense_addition | nats_per_token |" in result.output
    import json

    rows = json.loads(out.read_text())
    values = {r["metric"]: r["values"] for r in rows}
    base, ablated = values["nats_per_token"]["base"], values["nats_per_token"]["ablated (L0H1+L2H3)"]
    assert base > 0 and ablated > 0 and base != ablated


def test_the_command_line_ends_through_distributed_finish_and_an_embedding_caller_does_not(monkeypatch):
    """Standalone (the ``capsense`` command, ``python -m capsense``), every exit status reaches
    ``distributed.finish`` (which ends a process of a multi-process launch with ``os._exit``);
    ``standalone_mode=False`` (a program embedding the group) keeps its process."""
    import capsense.core.distributed as distributed

    seen = []
    monkeypatch.setattr(distributed, "finish", seen.append)
    from capsense.cli import main as group

    assert CliRunner().invoke(group, ["--version"]).exit_code == 0
    assert CliRunner().invoke(group, ["locate", "--no-such-flag"]).exit_code == 2
    assert seen == [0, 2]
    assert group.main(["--version"], standalone_mode=False) == 0
    assert seen == [0, 2]
