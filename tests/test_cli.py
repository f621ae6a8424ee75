"""The `pagedattn` command: info's matrix comes from the declared capabilities and its
selection agrees with get_attn_backend, and it lists every environment variable; bench prints
a table, saves a PNG only when asked, and refuses bad arguments as argument errors; the demo
runs (tiny model), reads a shared prompt prefix from the cache, and its tokens equal
transformers' generate."""

from __future__ import annotations

import pytest
import torch

from pagedattn import envs, get_attn_backend, info
from pagedattn.cli import DESCRIPTION, main
from pagedattn.selector import current_device_type
from pagedattn.types import AttentionRequest


def test_info_prints_environment_matrix_and_selection(capsys):
    assert main(["info", "--head-size", "64", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    for name in info.capabilities():
        assert name in out
    for feature in ("sliding window", "alibi", "soft cap", "sinks", "cascade", "fp8 kv cache",
                    "encoder/cross", "cuda graphs", "head sizes", "dtypes"):
        assert feature in out
    chosen = get_attn_backend(64, torch.float32, "auto", 16).get_name()
    assert f"chosen: {chosen}" in out


def test_help_describes_every_command_in_whole_sentences(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert DESCRIPTION.endswith(".") and " ".join(DESCRIPTION.split()) in out
    for command in ("demo", "info", "bench"):
        assert f"'{command}'" in out
    assert "pagedattn COMMAND --help" in out


def test_info_lists_every_environment_variable_and_its_value(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", "HND")
    assert main(["info", "--head-size", "64", "--dtype", "fp32"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.strip()}
    for name in dir(envs):
        assert name in rows, f"{name} is read by pagedattn but info does not show it"
    assert rows["PAGEDATTN_KV_CACHE_LAYOUT"] == ["HND"]
    assert rows["PAGEDATTN_OPS_PROVIDER"] == ["auto", "(default)"]


def test_matrix_cells_follow_declared_capabilities():
    header, rows = info.capability_matrix()
    cells = {row[0]: dict(zip(header[1:], row[1:])) for row in rows}
    for name, caps in info.capabilities().items():
        assert cells["cascade"][name] == ("yes" if caps.cascade else "-")
        assert cells["sinks"][name] == ("yes" if caps.sinks else "-")
        assert cells["head sizes"][name] == ("any" if caps.head_sizes is None
                                             else cells["head sizes"][name])
        assert cells["cuda graphs"][name] == caps.cudagraph.name.lower()


@pytest.mark.parametrize("head_size,dtype,has_sink", [
    (64, torch.float32, False), (128, torch.bfloat16, True), (80, torch.float16, False)])
def test_selection_report_agrees_with_get_attn_backend(head_size, dtype, has_sink):
    request = AttentionRequest(head_size, dtype, "auto", 16, has_sink=has_sink,
                               device_type=current_device_type())
    selection = info.select(request)
    expected = get_attn_backend(head_size, dtype, "auto", 16, has_sink=has_sink).get_name()
    assert selection.chosen == expected
    lines = info.selection_lines(selection)
    assert sum(line.startswith("  not ") for line in lines) == len(selection.reasons) - 1


def test_selection_honours_the_forcing_env_var(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "TORCH_SDPA")
    request = AttentionRequest(64, torch.float16, device_type="cuda")
    assert info.select(request).chosen == "TORCH_SDPA"
    assert "forced by PAGEDATTN_ATTENTION_BACKEND" in info.selection_lines(
        info.select(request))[1]


def test_bench_prints_a_row_per_context_and_saves_a_png(tmp_path, capsys):
    png = tmp_path / "bench.png"
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra: matplotlib")
    assert main(["bench", "--context-lens", "16,48", "--batch-size", "2",
                 "--backends", "torch_sdpa", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:2] in ("16", "48")]
    assert [r[0] for r in rows] == ["16", "48"]
    assert all(float(r[1].replace(",", "")) > 0 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_writes_no_file_without_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--context-lens", "16", "--batch-size", "1",
                 "--backends", "torch_sdpa"]) == 0
    assert list(tmp_path.iterdir()) == []
    assert "plot" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--backends", "NOPE"], "argument --backends: unknown backend(s) ['NOPE']; known: "
                             "FLASH_ATTN, FLASH_ATTN_DIFFKV, TORCH_SDPA"),
    (["--backends", "block_sparse_flash_attn"], "cannot time BLOCK_SPARSE_FLASH_ATTN: "
                                                "block-sparse only"),
    (["--context-lens", "abc"], "argument --context-lens: expected comma-separated positive "
                                "integers such as 64,128,256; got 'abc'"),
    (["--context-lens", "64,0"], "got '64,0'"),
])
def test_bench_bad_arguments_are_argument_errors_not_tracebacks(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pagedattn bench" in err and message in err
    assert "Traceback" not in err


def test_bench_points_measure_what_they_ran():
    from pagedattn.bench import BenchConfig, time_forward

    cfg = BenchConfig(mode="prefill", batch_size=2, context_lens=[24]).resolved("cpu")
    point = time_forward("TORCH_SDPA", cfg, 24, "cpu", min_seconds=0.0)
    assert point.tokens == 2 * 24 and point.seconds > 0
    assert point.tokens_per_second == pytest.approx(48 / point.seconds)


def test_demo_with_the_tiny_model_matches_transformers_and_shares_the_prefix(capsys):
    pytest.importorskip("transformers", reason="the demo needs the hf extra")
    assert main(["demo", "--model", "tiny", "--requests", "6", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "tokens equal transformers' generate for 6/6 requests: OK" in out
    assert "all freed at the end: True" in out
    assert "mixing prefill and decode" in out
    # Requests 1, 3 and 5 share a 144-token system part; 5 arrives after 1 is prefilled and
    # reads its 9 full blocks from the cache.
    assert "(3 share a long system prompt)" in out
    assert "144 prompt tokens read from shared cached blocks instead of recomputed " \
           "(1 request)" in out


def test_demo_falls_back_to_a_tiny_llama_with_a_message(monkeypatch, capsys):
    pytest.importorskip("transformers", reason="the demo needs the hf extra")
    from pagedattn.integrations import hf_models

    monkeypatch.setattr(hf_models, "smollm2_dir", lambda: None)
    assert main(["demo", "--requests", "2", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2 weights not found" in out and "tiny random Llama" in out
    assert "2/2 requests: OK" in out


@pytest.mark.parametrize("missing", ["transformers", "gguf"])
def test_demo_without_the_hf_extra_says_how_to_install_it(monkeypatch, capsys, missing):
    import sys

    # A None entry in sys.modules makes `import <missing>` fail as if it were not installed.
    monkeypatch.setitem(sys.modules, missing, None)
    if missing != "transformers":  # found, but loading the weights needs the missing package
        from pagedattn import demo

        def load(cfg, say):
            import gguf  # noqa: F401

        monkeypatch.setattr(demo, "load", load)
    assert main(["demo", "--requests", "2", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert f"{missing!r} is not installed" in err
    assert 'pip install -e ".[hf]"' in err  # the README's command, from the checkout
