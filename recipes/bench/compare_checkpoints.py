"""Two compressed checkpoints (``capsense compress`` folders): are they the same model and the same choice?

    python recipes/bench/compare_checkpoints.py DIR_A DIR_B [--out recipes/results/compress/X.jsonl]

Every tensor of every ``*.safetensors`` file compared with ``torch.equal`` (packed codes, scales and the
dense rest alike), and the parts of ``capsense.json`` that a run's choice determines: the allocation
(its per-matrix levels, estimated cost and, for a guided run, the selection: every candidate's dL and the
one shipped), the measured dL on the probes, the per-matrix accounts and the summary. Prints one JSON row
(appended to ``--out`` when given): what differs, or nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

COMPARED = ("allocation", "measured", "matrices", "summary", "budget", "size")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return out


def compare(a: Path, b: Path) -> dict:
    ta, tb = tensors(a), tensors(b)
    differ = sorted(k for k in ta.keys() & tb.keys() if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k]))
    ma, mb = (json.loads((d / "capsense.json").read_text()) for d in (a, b))
    sel = [(m.get("allocation") or {}).get("selection", {}).get("chosen") for m in (ma, mb)]
    return {"a": str(a), "b": str(b), "tensors": len(ta), "only_in_one": sorted(ta.keys() ^ tb.keys()),
            "tensors_differing": differ, "identical_tensors": not differ and ta.keys() == tb.keys(),
            "chosen": sel, "meta_differing": [k for k in COMPARED if ma.get(k) != mb.get(k)],
            "sequential": [ma.get("sequential"), mb.get("sequential")], "seconds": [ma.get("seconds"), mb.get("seconds")]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    row = compare(args.a, args.b)
    if args.out is not None:
        from capsense.core.files import append_jsonl

        append_jsonl(args.out, row)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
