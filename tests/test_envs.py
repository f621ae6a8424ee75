"""Environment variables: read when accessed, so a change is seen at the next read."""

from __future__ import annotations

import os

import pytest
import torch

from pagedattn import envs
from pagedattn.ops.providers import provider_name


def test_a_set_changed_or_deleted_variable_is_seen_at_the_next_read(monkeypatch):
    monkeypatch.delenv("PAGEDATTN_OPS_PROVIDER", raising=False)
    assert envs.PAGEDATTN_OPS_PROVIDER == envs.get("PAGEDATTN_OPS_PROVIDER") == "auto"
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "Triton")
    assert envs.get("PAGEDATTN_OPS_PROVIDER") == "triton"
    assert provider_name(torch.device("cpu")) == "triton"
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "torch")
    assert envs.PAGEDATTN_OPS_PROVIDER == "torch"
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "torch")  # the same value set again
    assert provider_name(torch.device("cpu")) == "torch"
    monkeypatch.delenv("PAGEDATTN_OPS_PROVIDER")
    assert provider_name(torch.device("cpu")) == "torch"  # auto: PyTorch on a CPU
    assert envs.get("PAGEDATTN_OPS_PROVIDER") == "auto"


def test_every_variable_reads_as_its_reader_parses_it(monkeypatch):
    monkeypatch.setenv("Q_SCALE_CONSTANT", "12.5")
    monkeypatch.setenv("PAGEDATTN_CHECK_INDICES", "1")
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", "hnd")
    for name in dir(envs):
        assert envs.get(name) == getattr(envs, name) == envs._READERS[name](), name
    assert envs.Q_SCALE_CONSTANT == 12.5 and envs.PAGEDATTN_CHECK_INDICES is True
    assert envs.PAGEDATTN_KV_CACHE_LAYOUT == "HND"
    monkeypatch.setenv("Q_SCALE_CONSTANT", "not a number")
    with pytest.raises(ValueError, match="not a number"):
        envs.get("Q_SCALE_CONSTANT")


def test_os_environ_replaced_by_another_mapping_is_still_read(monkeypatch):
    monkeypatch.setattr(os, "environ", {"PAGEDATTN_OPS_PROVIDER": "TORCH"})
    assert envs.get("PAGEDATTN_OPS_PROVIDER") == "torch"
    os.environ["PAGEDATTN_OPS_PROVIDER"] = "triton"
    assert envs.PAGEDATTN_OPS_PROVIDER == "triton"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NOT_A_VARIABLE'"):
        envs.NOT_A_VARIABLE  # noqa: B018
