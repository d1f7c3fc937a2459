"""What a manifest's model hash costs, read in full against recalled from the cache, side by side.

    HF_HUB_OFFLINE=1 python recipes/bench/bench_content_hash.py [--models smollm2-135m,gemma3-270m] [--repeats 3]

For each embedded model's converted folder (:func:`capsense.core.models.resolve_pretrained`): the seconds
of :func:`capsense.core.content_hash.folder_hash` with ``CAPSENSE_HASH_CACHE=0`` (every byte read, as
every ``locate``, ``export`` and ``compress`` did before the cache) and with the cache after one call
filled it, the best of ``--repeats`` each, the read rate in GB/s, what that rate means for an 8B (16 GB)
and a 70B (140 GB) bfloat16 folder, and that both give the same value. The page cache holds a small
model after its first read, so the uncached figure is a warm-disk rate: a cold disk or a network file
system reads slower. Writes ``recipes/results/content_hash.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def _best(fn, repeats: int) -> tuple[float, str]:
    best, value = float("inf"), ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t0)
    return best, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="recipes/results/content_hash.json")
    args = ap.parse_args()

    from capsense.core.content_hash import folder_hash, hashed_files
    from capsense.core.models import resolve_pretrained

    rows = []
    for name in args.models.split(","):
        folder = Path(resolve_pretrained(name))
        size = sum(p.stat().st_size for p in hashed_files(folder))
        os.environ["CAPSENSE_HASH_CACHE"] = "0"
        read_s, read_value = _best(lambda: folder_hash(folder), args.repeats)
        os.environ["CAPSENSE_HASH_CACHE"] = "1"
        folder_hash(folder)  # fills the cache
        cached_s, cached_value = _best(lambda: folder_hash(folder), args.repeats)
        rate = size / read_s / 1e9
        rows.append({"model": name, "bytes": size, "read_s": round(read_s, 4), "cached_s": round(cached_s, 6),
                     "ratio_cached_to_read": round(cached_s / read_s, 6), "read_gb_per_s": round(rate, 3),
                     "same_value": read_value == cached_value,
                     "read_s_at_this_rate": {"8B bf16 (16 GB)": round(16 / rate, 1), "70B bf16 (140 GB)": round(140 / rate, 1)}})
        r = rows[-1]
        print(f"{name}: {size / 1e9:.2f} GB, read {read_s:.3f} s ({rate:.2f} GB/s), cached {cached_s * 1e3:.2f} ms "
              f"(x{r['ratio_cached_to_read']:.5f}), same value: {r['same_value']}; at this rate an 8B folder reads in "
              f"{16 / rate:.0f} s, a 70B one in {140 / rate:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
