"""The guided run's spill on disk, measured against what ``check_guided_disk`` counts (round 19).

Tiny random Llama and Gemma 3 (the unit tests' configs), GPTQ 3 bits g16, one pass and ``--sequential``, one, two and
three kept capabilities, the choice natural, forced to the allocation (no challenger clears) and forced to the first
challenger that clears (guided-rtn, which replaces the chosen weights on disk). The peak: the spills' files and folders,
each rounded up to the disk's block, looked at after every file written (``test_compress_spill.spill_peak``). Then
the counts at Llama-3.1-8B's shapes (meta device, float32 and bf16 weights; GPTQ 4b g128)::

    PYTHONPATH=. OMP_NUM_THREADS=1 python recipes/bench/guided_disk_peak.py

``--smollm2 [CLI options]`` instead: the embedded SmolLM2-135M through the CLI in-process (``capsense compress
smollm2-135m --method gptq --bits 4 --group-size 64 --keep math --calibration-samples 16`` plus the options given,
e.g. ``--sequential``), its spill's measured peak against the count and the files at the peak; round 19 ran it
under ``/usr/bin/time -f "%e s wall %M KB"`` for the peak memory too (about 15 min at two threads)::

    PYTHONPATH=. OMP_NUM_THREADS=2 /usr/bin/time -f "%e s wall %M KB" python recipes/bench/guided_disk_peak.py --smollm2 --sequential
"""

import sys
import tempfile

sys.path[:0] = ["tests", "tests/unit/compress"]

import torch  # noqa: E402
from conftest import make_tiny_model  # noqa: E402
from test_compress_spill import CALIBRATION, GEMMA, GPTQ, MODELS, N, _guided_one_pass, spill_peak  # noqa: E402
from _guided_run import run_guided_sequential  # noqa: E402

import capsense.compress.guided_sequential as gs  # noqa: E402
from capsense.compress import select  # noqa: E402
from capsense.compress.budget import uniform_budget  # noqa: E402
from capsense.compress.guided import Guide, fisher_sources  # noqa: E402
from capsense.compress.targets import find_targets  # noqa: E402


def round18(model, uni, guide) -> int:
    """Round 18's count: the Fishers and the two weight copies added, raw tensor bytes."""
    targets = find_targets(model, uni.targets)
    fishers, copies = len(fisher_sources(guide, gs.guided_setting(uni))), 2 if select.checks_uniform(guide) else 0
    return sum(t.n_params * (4 * fishers + copies * t.module.weight.element_size()) for t in targets)


def tiny() -> None:
    paired = select.paired_vs_allocation
    print("| model | mode | keep | choice | chosen | measured peak | phase | counted (new) | round 18 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch, overrides in [("llama", MODELS[0][1]), ("gemma3_text", GEMMA)]:
        for sequential in (False, True):
            for keep in (["math"], ["math", "code"], ["math", "code", "prose"]):
                for choice in ("natural", "allocation", "challenger"):
                    select.paired_vs_allocation = paired if choice == "natural" else (
                        lambda a, b, c=choice == "challenger": {**paired(a, b), "clears": c})
                    guide = Guide(keep, samples=2, protect_top_k=0)
                    run = ((lambda: run_guided_sequential(arch, overrides, GPTQ, guide, CALIBRATION, N).shipped[2])
                           if sequential else (lambda: _guided_one_pass(arch, overrides, guide)))  # noqa: B023
                    with tempfile.TemporaryDirectory() as root:
                        chosen, peak, at = spill_peak(run, root)
                        chosen = chosen if isinstance(chosen, str) else chosen.info["selection"]["chosen"]
                        model, uni = make_tiny_model(arch, **overrides), uniform_budget(GPTQ)
                        new = gs.check_guided_disk(model, uni, guide, root)
                    phase = "planning" if any("fisher" in f for f in at) else "choosing"
                    print(f"| {arch} | {'sequential' if sequential else 'one pass'} | {','.join(keep)} | {choice} | "
                          f"{chosen} | {peak:,} | {phase} | {new:,} | {round18(model, uni, guide):,} |", flush=True)
    select.paired_vs_allocation = paired


def eight_b() -> None:
    """The counts at 8B shapes, whatever this machine's disk has free."""
    import shutil
    from collections import namedtuple

    from transformers import LlamaConfig, LlamaForCausalLM

    shutil.disk_usage = lambda _p: namedtuple("usage", "total used free")(0, 0, 2**60)

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256)
    uni = uniform_budget({"method": "gptq", "bits": 4, "group_size": 128})
    for dtype in (torch.float32, torch.bfloat16):
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg).to(dtype)
        for keep in (["math"], ["math", "code"], ["math", "code", "prose"]):
            guide = Guide(keep)
            new = gs.check_guided_disk(model, uni, guide, tempfile.gettempdir())
            old = round18(model, uni, guide)
            print(f"8B {dtype} keep {','.join(keep)}: counted {new / 2**30:.2f} GiB, round 18 {old / 2**30:.2f} GiB")


def smollm2(extra: list[str]) -> None:
    """SmolLM2 through the CLI in-process: the spill's measured peak, the count and the files at the peak."""
    from click.testing import CliRunner

    from capsense.cli import main

    counted = {}
    check = gs.check_guided_disk

    def recorded(model, uniform, guide, folder=None):
        counted["bytes"] = check(model, uniform, guide, folder)
        return counted["bytes"]

    gs.check_guided_disk = recorded
    root = tempfile.mkdtemp()

    def run():
        r = CliRunner().invoke(main, ["compress", "smollm2-135m", "--method", "gptq", "--bits", "4", "--group-size", "64",
                                      "--keep", "math", "--calibration-samples", "16", "--out", root + "-out", *extra])
        assert r.exit_code == 0, r.output
        return r.output

    out, peak, at = spill_peak(run, root)
    print(out[-3000:])
    print(f"SmolLM2 {extra}: measured {peak:,} counted {counted['bytes']:,} diff {counted['bytes'] - peak:,}")
    for name in sorted(at):
        print("  ", name, at[name])
    gs.check_guided_disk = check


if __name__ == "__main__":
    if "--smollm2" in sys.argv:
        smollm2([a for a in sys.argv[1:] if a != "--smollm2"])
    else:
        if "--8b-only" not in sys.argv:
            tiny()
        eight_b()
