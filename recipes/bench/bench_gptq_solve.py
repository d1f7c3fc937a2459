"""GPTQ's and SparseGPT's solve of one matrix on a CPU copy and on a device, side by side (``solve_on`` cpu / layer).

    python recipes/bench/bench_gptq_solve.py --shapes llama-3.2-1b                # this CPU alone
    python recipes/bench/bench_gptq_solve.py --shapes llama-3.2-1b,llama-3.1-8b --devices cpu,cuda

For each shape (a published model's widest matrix, its MLP down projection, or ``OUTxIN``): a random ``[out, in]``
weight and the Gram matrix of ``--tokens`` correlated random inputs (what calibration collects, float64 on the CPU).
Per device: the seconds of :func:`~capsense.compress.gptq.gptq_quantize` (4 bits, group 128, activation order) and of
:func:`~capsense.compress.gptq.sparsegpt_prune` (density 0.5, row pattern), the weight moved there first and the
Gram moved by the solve itself, as ``solve_on: layer`` does; each result's output error relative to the weight's
(``dW G dW^T / W G W^T``); and, against the first device's result, the share of weights that differ. The ratio of
the devices' seconds comes from one run. Writes ``--out`` (default recipes/results/bench_gptq_solve.json).
Values do not matter for speed; they do for agreement, which is why the inputs are correlated and unevenly scaled.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

# The MLP down projection, [hidden, intermediate], of each published config (the widest Gram matrix of the model).
SHAPES = {"llama-3.2-1b": (2048, 8192), "llama-3.1-8b": (4096, 14336), "llama-3.1-70b": (8192, 28672)}


def parse_shape(text: str) -> tuple[str, tuple[int, int]]:
    if text in SHAPES:
        return text, SHAPES[text]
    try:
        out, inp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"bench_gptq_solve: shape {text!r} is neither OUTxIN nor one of {', '.join(SHAPES)}") from None
    return text, (out, inp)


def data(out: int, inp: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float32, Gram float64 on the CPU) of correlated, unevenly scaled inputs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) / inp**0.5
    scale = torch.linspace(0.2, 3.0, inp)[torch.randperm(inp, generator=g)]
    x = torch.randn(tokens, inp, generator=g)
    x = (x + 0.5 * torch.roll(x, 1, dims=1)) * scale  # neighbouring features correlated
    return w, (x.T @ x).double()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def solve(kind: str, w: torch.Tensor, gram: torch.Tensor, device: str) -> tuple[float, torch.Tensor]:
    """(seconds, the solved weight back on the CPU)."""
    from capsense.compress.gptq import gptq_quantize, sparsegpt_prune

    sync(device)
    t0 = time.perf_counter()
    wd = w.to(device)
    new = gptq_quantize(wd, gram, 4, 128)[0] if kind == "gptq" else sparsegpt_prune(wd, gram, 0.5)[0]
    new = new.cpu()
    sync(device)
    return time.perf_counter() - t0, new


def relative_error(w: torch.Tensor, new: torch.Tensor, gram: torch.Tensor) -> float:
    from capsense.compress.gptq import row_output_errors

    dw, w64 = w.double() - new.double(), w.double()
    return float(row_output_errors(dw, gram).sum() / row_output_errors(w64, gram).sum())


def run_shape(name: str, shape: tuple[int, int], devices: list[str], tokens: int) -> dict:
    w, gram = data(*shape, tokens)
    row: dict = {"shape": name, "out": shape[0], "in": shape[1], "tokens": tokens}
    for kind in ("gptq", "sparsegpt"):
        first = None
        for device in devices:
            seconds, new = solve(kind, w, gram, device)
            r = {"seconds": round(seconds, 2), "relative_output_error": relative_error(w, new, gram)}
            if first is None:
                first = new
            else:
                r["share_of_weights_differing_from_" + devices[0]] = float((new != first).double().mean())
                r["speedup_vs_" + devices[0]] = round(row[kind][devices[0]]["seconds"] / seconds, 1)
            row.setdefault(kind, {})[device] = r
            print(f"{name} {kind} on {device}: {r}", file=sys.stderr, flush=True)
            del new
        if devices[0].startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-1b", help=f"Comma-separated: {', '.join(SHAPES)} or OUTxIN.")
    ap.add_argument("--devices", default="cpu", help="Comma-separated devices; the first is the reference.")
    ap.add_argument("--tokens", type=int, default=4096, help="Calibration tokens behind the Gram matrix.")
    ap.add_argument("--out", default="recipes/results/bench_gptq_solve.json")
    args = ap.parse_args(argv)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if not devices or len(set(devices)) != len(devices):
        print(f"bench_gptq_solve: --devices {args.devices!r}: give distinct devices, the reference first (cpu,cuda)")
        return 2
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        print("bench_gptq_solve: no GPU here (torch.cuda.is_available() is False): give --devices cpu")
        return 2
    from capsense.core.files import atomic_write_json
    from capsense.core.provenance import provenance

    rows = [run_shape(*parse_shape(s.strip()), devices, args.tokens) for s in args.shapes.split(",") if s.strip()]
    gpu = {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}
    info = {**provenance(",".join(devices), **gpu), "results": rows}
    for r in rows:
        for kind in ("gptq", "sparsegpt"):
            print(f"{r['shape']} {kind}: " + ", ".join(f"{d} {v['seconds']} s" for d, v in r[kind].items()))
    print(f"wrote {atomic_write_json(args.out, info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
