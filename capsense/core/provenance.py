"""What made a result: the library versions and the host its numbers depend on.

Every result a command writes (a locate manifest, ``validation.json``, a compressed checkpoint's
``capsense.json``, ``capsense measure``'s document) records :func:`provenance`, because its numbers move
with both: the same GPTQ command, code and library versions gave Gemma 3's uniform 3-bit math dL +0.254 on
an Intel Xeon and +0.218 on an AMD EPYC (round 23), and a kept-vs-bar comparison holds only between two
results made on one kind of machine. What is recorded is shareable: versions, the CPU's model name, the OS
platform string, thread count and device, never a host name or a path of the machine.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def cpu_info(text: str | None = None) -> dict:
    """This host's CPU: its model name and whether it has native bf16 (AVX-512 BF16, AMX-BF16), from
    ``/proc/cpuinfo`` (``text``: that file's contents; empty fields where it does not exist).

    :func:`capsense.core.models.resolve_dtype` reads the flags; :func:`host_info` records the name (the AMD
    figure in this module's docstring reproduced to the last digit at one and two threads)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    lines = text.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return {"model_name": name, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}


#: The distributions whose versions a result records (those not installed are left out).
PACKAGES = ("capsense", "torch", "transformers", "lm_eval", "compressed-tensors", "peft", "safetensors",
            "scikit-learn", "numpy")


def library_versions(packages: Sequence[str] = PACKAGES) -> dict[str, str]:
    """Python's version and each installed distribution of ``packages``'s."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def host_info(device: Any = "cpu", **extra: Any) -> dict[str, Any]:
    """The machine a result ran on: OS platform, CPU model name, torch's threads, ``device`` (and ``extra``)."""
    import torch

    return {"platform": platform.platform(), "cpu": cpu_info()["model_name"], "cpu_threads": torch.get_num_threads(),
            "device": str(device), **extra}


def provenance(device: Any = "cpu", **extra: Any) -> dict[str, Any]:
    """``{"versions": library_versions(), "host": host_info(device, **extra)}``: what a result records."""
    return {"versions": library_versions(), "host": host_info(device, **extra)}
