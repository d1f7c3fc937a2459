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


def test_locate_searches_auto_under_autocast_on_one_cpu_with_native_bf16(monkeypatch):
    """``auto`` for a locate run: a float32 model searched under bfloat16 autocast on one CPU with native bf16 (a
    bfloat16 model before round 47), float32 without native bf16, a bfloat16 model on a GPU or under a device map;
    a folder an earlier release's ``auto`` wrote in bfloat16 resumes as it ran; explicit settings pass through."""
    from capsense.core.precision import search_precision

    read = provenance.cpu_info
    for text, expected in ((XEON, ("float32", None)), (SAPPHIRE, ("float32", "bfloat16")), (AMD, ("float32", "bfloat16"))):
        monkeypatch.setattr(models, "cpu_info", lambda text=None, t=text: read(t))
        assert search_precision("auto", None, "cpu") == expected, text
    assert search_precision("auto", None, "cuda:0") == ("bfloat16", None)
    assert search_precision("auto", None, "cpu", device_map="auto") == ("bfloat16", None)  # memory first
    assert search_precision("auto", None, "cpu", recorded=("bfloat16", None)) == ("bfloat16", None)
    assert search_precision("auto", None, "cpu", recorded=("float32", None)) == ("float32", "bfloat16")
    assert search_precision("bfloat16", None, "cpu") == ("bfloat16", None)
    assert search_precision("float32", None, "cpu") == ("float32", None)
    assert search_precision("float32", "bfloat16", "cpu") == ("float32", "bfloat16")
