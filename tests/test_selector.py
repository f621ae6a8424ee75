"""Backend selection: device ranking, the env override, reasons, and caching."""

from __future__ import annotations

import pytest
import torch

import pagedattn
from pagedattn import selector
from pagedattn.types import AttentionRequest


def test_device_default_backend():
    backend = pagedattn.get_attn_backend(128, torch.bfloat16, "auto", 16)
    assert backend.get_name() == ("FLASH_ATTN" if torch.cuda.is_available() else "TORCH_SDPA")


def test_unknown_forced_backend_lists_every_backend_with_its_reason(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "NO_SUCH_BACKEND")
    with pytest.raises(ValueError) as info:
        pagedattn.get_attn_backend(128, torch.bfloat16, "auto", 16)
    message = str(info.value)
    assert "'NO_SUCH_BACKEND' is not a known backend" in message
    for name in selector.BACKENDS:
        assert f"  {name}: " in message


def test_forced_backend_that_cannot_serve_says_why(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "TORCH_SDPA")
    with pytest.raises(ValueError, match="TORCH_SDPA: .*kv_cache_dtype 'int8'"):
        pagedattn.get_attn_backend(64, torch.float16, "int8", 16)


def test_env_change_is_never_answered_from_the_cache(monkeypatch):
    default = pagedattn.get_attn_backend(64, torch.float16, "auto", 16)
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "NOPE")
    with pytest.raises(ValueError):
        pagedattn.get_attn_backend(64, torch.float16, "auto", 16)
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "TORCH_SDPA")
    assert pagedattn.get_attn_backend(64, torch.float16, "auto", 16).get_name() == "TORCH_SDPA"
    monkeypatch.delenv("PAGEDATTN_ATTENTION_BACKEND")
    assert pagedattn.get_attn_backend(64, torch.float16, "auto", 16) is default


def test_nothing_fits_error_names_the_request():
    with pytest.raises(ValueError, match="no attention backend can serve this request"):
        pagedattn.get_attn_backend(64, torch.int8, "auto", 16)


def test_explain_gives_reasons_per_backend():
    request = AttentionRequest(head_size=64, dtype=torch.float16, kv_cache_dtype="auto",
                               device_type="cpu", use_mla=True)
    reasons = selector.explain(request)
    assert "MLA not supported" in reasons["TORCH_SDPA"]


def test_capabilities_reasons():
    caps = pagedattn.BackendCapabilities(
        devices=frozenset({"cuda"}), dtypes=frozenset({torch.bfloat16}),
        kv_cache_dtypes=frozenset({"auto"}), head_sizes=(64, 128), block_size_multiple=16,
        sinks=False)
    request = AttentionRequest(head_size=80, dtype=torch.float32, kv_cache_dtype="fp8",
                               block_size=8, has_sink=True, device_type="cpu", head_size_v=64)
    text = " | ".join(caps.why_not(request))
    for part in ("device 'cpu'", "dtype torch.float32", "kv_cache_dtype 'fp8'",
                 "head_size 80", "multiple of 16", "sinks", "different K and V head sizes"):
        assert part in text
    ok = AttentionRequest(head_size=64, dtype=torch.bfloat16, device_type="cuda", block_size=32)
    assert caps.why_not(ok) == []


def test_forcing_weighs_what_a_backend_cannot_do_not_the_wording_of_a_reason(monkeypatch):
    import dataclasses

    from pagedattn.backends.torch_sdpa import TorchSDPABackend

    request = AttentionRequest(64, torch.float32, use_sparse=False)
    name, reasons = selector.choose(request, "BLOCK_SPARSE_FLASH_ATTN")
    assert name == "BLOCK_SPARSE_FLASH_ATTN"  # never automatic for dense layers, forceable
    assert "never chosen automatically" in reasons[name][0]

    class Refuses(type(TorchSDPABackend.capabilities)):
        def why_not(self, request):  # a hard reason that happens to say "automatically"
            return ["cannot run automatically generated masks"]

    fields = {f.name: getattr(TorchSDPABackend.capabilities, f.name)
              for f in dataclasses.fields(TorchSDPABackend.capabilities)}
    monkeypatch.setattr(TorchSDPABackend, "capabilities", Refuses(**fields))
    assert selector.choose(request, "TORCH_SDPA")[0] is None
