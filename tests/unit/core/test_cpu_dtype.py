"""The host CPU as results record it (with the library versions), and the dtype ``auto`` resolves to from it."""

from __future__ import annotations

import json
import socket

import capsense.core.models as models
import capsense.core.provenance as provenance

AMD = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx512f avx512_bf16\n\nprocessor\t: 1\n"
XEON = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse avx512f\n"
SAPPHIRE = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx512f amx_bf16 amx_tile\n"


def test_cpu_info_reads_the_model_name_and_bf16_flags():
    assert provenance.cpu_info(AMD) == {"model_name": "AMD EPYC", "avx512_bf16": True, "amx_bf16": False}
    assert provenance.cpu_info(XEON) == {"model_name": "Intel(R) Xeon(R) Processor", "avx512_bf16": False,
                                         "amx_bf16": False}
    assert provenance.cpu_info(SAPPHIRE)["amx_bf16"] is True
    assert provenance.cpu_info("") == {"model_name": None, "avx512_bf16": False, "amx_bf16": False}


def test_auto_dtype_follows_the_cpu_flags(monkeypatch):
    read = provenance.cpu_info
    for text, expected in ((AMD, "bfloat16"), (SAPPHIRE, "bfloat16"), (XEON, "float32")):
        monkeypatch.setattr(models, "cpu_info", lambda text=None, t=text: read(t))
        assert models.resolve_dtype("auto", "cpu") == expected, text
    assert models.resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert models.resolve_dtype("float32", "cuda:0") == "float32"


def test_provenance_records_versions_and_host_but_no_host_name(monkeypatch):
    import torch

    read = provenance.cpu_info
    monkeypatch.setattr(provenance, "cpu_info", lambda text=None: read(AMD))
    rec = provenance.provenance("cuda:1", processes=2)
    assert rec["versions"]["torch"] == torch.__version__
    assert {"python", "capsense", "transformers", "numpy"} <= set(rec["versions"])
    assert rec["host"] == {"platform": rec["host"]["platform"], "cpu": "AMD EPYC", "cpu_threads": torch.get_num_threads(),
                           "device": "cuda:1", "processes": 2}
    name = socket.gethostname()
    assert len(name) < 6 or name not in json.dumps(rec)  # (a very short name could occur by chance)
    assert provenance.library_versions(["no-such-distribution-x"]) == {"python": rec["versions"]["python"]}
