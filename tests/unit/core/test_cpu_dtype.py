"""The host CPU as runs record it, and the dtype ``auto`` resolves to from it."""

from __future__ import annotations

import capsense.core.models as models

AMD = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx512f avx512_bf16\n\nprocessor\t: 1\n"
XEON = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse avx512f\n"
SAPPHIRE = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx512f amx_bf16 amx_tile\n"


def test_cpu_info_reads_the_model_name_and_bf16_flags():
    assert models.cpu_info(AMD) == {"model_name": "AMD EPYC", "avx512_bf16": True, "amx_bf16": False}
    assert models.cpu_info(XEON) == {"model_name": "Intel(R) Xeon(R) Processor", "avx512_bf16": False,
                                     "amx_bf16": False}
    assert models.cpu_info(SAPPHIRE)["amx_bf16"] is True
    assert models.cpu_info("") == {"model_name": None, "avx512_bf16": False, "amx_bf16": False}


def test_auto_dtype_follows_the_cpu_flags(monkeypatch):
    read = models.cpu_info
    for text, expected in ((AMD, "bfloat16"), (SAPPHIRE, "bfloat16"), (XEON, "float32")):
        monkeypatch.setattr(models, "cpu_info", lambda text=None, t=text: read(t))
        assert models.resolve_dtype("auto", "cpu") == expected, text
    assert models.resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert models.resolve_dtype("float32", "cuda:0") == "float32"
