"""The `pagedattn` command: info's matrix comes from the declared capabilities and its
selection agrees with get_attn_backend, and it lists every environment variable; bench prints
a table with each figure's spread, saves a plot only when asked, and times FLASH_ATTN_DIFFKV;
every bad value of every command, and every environment variable the library would refuse,
is a one-line argument error (exit status 2) before any work; every option has help text and
a default; the demo runs (tiny model), reads a shared prompt prefix from the cache, and its
tokens equal transformers' generate."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from pagedattn import envs, get_attn_backend, info
from pagedattn.cli import DESCRIPTION, build_parser, main
from pagedattn.config import get_kv_cache_layout
from pagedattn.ops.providers import provider_name
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


# --- bad values: one line, exit status 2, before any work (issue 43) -----------------------
def _no_cuda_device(text):
    if torch.cuda.is_available():
        return f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return f"{text!r}: this torch ({torch.__version__}) has no usable CUDA device; use cpu"


def _plot_extension_message():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return 'argument --plot: a plot needs matplotlib: pip install -e ".[bench]"'
    return "argument --plot: 'out.txt': the file's extension gives the image format; one of "


POSITIVE = "expected a positive integer; got"
BAD_VALUES = [
    (["bench", "--block-size", "0"], f"argument --block-size: {POSITIVE} '0'"),
    (["bench", "--num-heads", "3", "--num-kv-heads", "2"],
     "num_heads=3 is not a multiple of num_kv_heads=2"),
    (["bench", "--num-heads", "3"], "num_heads=3 is not a multiple of num_kv_heads="),
    (["bench", "--batch-size", "0"], f"argument --batch-size: {POSITIVE} '0'"),
    (["bench", "--head-size", "0"], f"argument --head-size: {POSITIVE} '0'"),
    (["bench", "--head-size-v", "-8"], f"argument --head-size-v: {POSITIVE} '-8'"),
    (["bench", "--num-kv-heads", "x"], f"argument --num-kv-heads: {POSITIVE} 'x'"),
    (["bench", "--plot", "/nonexistent/x.png"],
     "argument --plot: the folder '/nonexistent' of '/nonexistent/x.png' does not exist"),
    (["bench", "--plot", "out.txt"], _plot_extension_message()),
    (["bench", "--backends", "flash_attn", "--head-size-v", "32"],
     "cannot time FLASH_ATTN: different K and V head sizes not supported"),
    (["demo", "--requests", "0"], f"argument --requests: {POSITIVE} '0'"),
    (["demo", "--max-new-tokens", "-1"], f"argument --max-new-tokens: {POSITIVE} '-1'"),
    (["demo", "--block-size", "0"], f"argument --block-size: {POSITIVE} '0'"),
    (["demo", "--device", "cuda:99"], _no_cuda_device("cuda:99")),
    (["demo", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N; got 'tpu'"),
    (["info", "--head-size", "-3"], f"argument --head-size: {POSITIVE} '-3'"),
    (["info", "--block-size", "0"], f"argument --block-size: {POSITIVE} '0'"),
    (["info", "--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice: 'fp4'"),
]
if not torch.cuda.is_available():
    BAD_VALUES.append((["demo", "--device", "cuda"], _no_cuda_device("cuda")))


def _argument_error(argv, capsys) -> str:
    """Run the command; it must exit with status 2 and end stderr with one error line."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_a_bad_value_is_a_one_line_argument_error(argv, message, monkeypatch, capsys):
    from pagedattn import demo

    # Nothing may start before the values are checked: the demo would load its model first.
    monkeypatch.setattr(demo, "run", lambda *a, **k: pytest.fail("the demo ran"))
    line = _argument_error(argv, capsys)
    assert line.startswith(f"pagedattn {argv[0]}: error: ") and message in line, line


# Each variable the library refuses, with the library call that refuses it in those words.
BAD_ENVIRONMENT = [
    ("PAGEDATTN_ATTENTION_BACKEND", "FOO", "PAGEDATTN_ATTENTION_BACKEND='FOO' is not a known "
     "backend", lambda: get_attn_backend(64, torch.float32, "auto", 16)),
    ("PAGEDATTN_KV_CACHE_LAYOUT", "XYZ", "PAGEDATTN_KV_CACHE_LAYOUT='XYZ' is not supported; "
     "choose NHD or HND", get_kv_cache_layout),
    ("PAGEDATTN_OPS_PROVIDER", "cuda", "PAGEDATTN_OPS_PROVIDER='cuda' is not supported; choose "
     "one of ('auto', 'torch', 'triton')", lambda: provider_name(torch.device("cpu"))),
    ("Q_SCALE_CONSTANT", "abc", "could not convert string to float: 'abc'",
     lambda: envs.Q_SCALE_CONSTANT),
]


@pytest.mark.parametrize("command", ["info", "bench", "demo"])
@pytest.mark.parametrize("name, value, message, library_call", BAD_ENVIRONMENT,
                         ids=[name for name, *_ in BAD_ENVIRONMENT])
def test_an_environment_variable_the_library_refuses_is_refused_first(
        command, name, value, message, library_call, monkeypatch, capsys):
    from pagedattn import demo

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as refused:  # what the library says later, in a model
        library_call()
    assert message in str(refused.value).splitlines()[0]
    monkeypatch.setattr(demo, "run", lambda *a, **k: pytest.fail("the demo ran"))
    line = _argument_error([command], capsys)
    assert line.startswith("pagedattn: error: ") and message in line, line


def test_bad_values_print_no_traceback_from_the_installed_command():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for argv, extra, message in (
            (["demo", "--block-size", "0"], {}, "argument --block-size"),
            (["info"], {"PAGEDATTN_OPS_PROVIDER": "cuda"}, "PAGEDATTN_OPS_PROVIDER='cuda'")):
        done = subprocess.run([sys.executable, "-m", "pagedattn.cli", *argv], env={**env, **extra},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stdout == ""
        assert "Traceback" not in done.stderr and message in done.stderr.splitlines()[-1]


def _options(help_text: str) -> dict[str, str]:
    """--help's option entries: option -> its text (an entry starts on a line '  -...')."""
    entries, current = {}, None
    for line in help_text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (-\S+)", line)
        if match:
            current = match.group(1).rstrip(",")
            entries[current] = line
        elif current and line.strip():
            entries[current] += " " + line.strip()
    return entries


@pytest.mark.parametrize("command", ["demo", "info", "bench"])
def test_every_option_has_help_text_and_its_default(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    options = _options(capsys.readouterr().out)
    usage = build_parser().parse_args([command])  # every option's default
    for name in vars(usage):
        if name in ("func", "command", "error"):
            continue
        option = "--" + name.replace("_", "-")
        assert option in options, f"{command} {option} has no help entry"
        text = " ".join(options[option].split())
        assert re.search(r"\(default: [^)]*\)$", text), f"{command} {option}: {text}"
        assert len(text.split("(default:")[0].split()) > 2, f"{command} {option}: no help"


def test_help_explains_the_models_and_lists_the_cache_dtypes(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    demo_help = " ".join(capsys.readouterr().out.split())
    assert "random-smollm2: SmolLM2's architecture with random weights" in demo_help
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    info_help = " ".join(capsys.readouterr().out.split())
    from pagedattn.config import KV_CACHE_DTYPE_STRINGS

    assert "{" + ",".join(KV_CACHE_DTYPE_STRINGS) + "}" in info_help


def test_info_marks_devices_a_backend_serves_only_when_forced(capsys):
    from pagedattn.selector import PREFERENCE

    header, rows = info.capability_matrix()
    devices = dict(zip(header[1:], rows[0][1:]))
    assert rows[0][0] == "devices"
    for name, caps in info.capabilities().items():
        for device in caps.devices:
            forced = f"{device} (forced)" in devices[name].split(",")
            assert forced == (name not in PREFERENCE[device]), (name, devices[name])


def test_info_says_a_forced_backend_is_why_the_others_are_not_chosen(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "flashinfer")
    lines = info.selection_lines(info.select(AttentionRequest(80, torch.bfloat16,
                                                              device_type="cpu")))
    assert lines[1] == ("chosen: none -- PAGEDATTN_ATTENTION_BACKEND='flashinfer' cannot serve "
                        "this request")
    assert "  not TORCH_SDPA: could serve it, but PAGEDATTN_ATTENTION_BACKEND='flashinfer' " \
           "forces another" in lines
    assert "  not FLASHINFER: head_size 80 not supported" in lines


def test_bench_times_flash_attn_diffkv_with_its_v_head_size(capsys):
    from pagedattn.backends.flash_attn_diffkv import FlashAttentionDiffKVBackend

    before = FlashAttentionDiffKVBackend.head_size_v
    assert main(["bench", "--head-size-v", "32", "--context-lens", "16", "--batch-size",
                 "1"]) == 0
    out = capsys.readouterr().out
    assert "head size 64 (V 32)" in out and "backends ['FLASH_ATTN_DIFFKV']" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("16 "))
    assert float(row[1].replace(",", "")) > 0 and row[3].endswith("%")
    assert FlashAttentionDiffKVBackend.head_size_v == before  # set for the run only
    assert main(["bench", "--backends", "flash_attn_diffkv", "--context-lens", "16",
                 "--batch-size", "1"]) == 0  # equal head sizes, when asked by name


def test_bench_warns_about_figures_whose_samples_spread_over_20_percent():
    from pagedattn.bench import BenchPoint, spread_warnings

    points = [BenchPoint("TORCH_SDPA", 64, 1e-3, 4, 0.05),
              BenchPoint("TORCH_SDPA", 128, 1e-3, 4, 0.35)]
    assert spread_warnings(points) == [
        "warning: TORCH_SDPA at context 128: the samples spread 35% (over 20%): other work on "
        "this machine, or too short a timing; compare such figures with care"]
