"""Hugging Face transformers models with their attention run by pagedattn.

transformers dispatches every attention call of its modern models through
`AttentionInterface`, handing the function the module, q/k/v `[batch, heads, tokens, head_size]`
and the module's features as keyword arguments. We register `"pagedattn"` there: the function
finds the pagedattn `Attention` layer that `attach()` built for that module, and the layer
writes K/V into the paged cache and attends over it with the metadata of the current forward
context. Requests are packed into one row (`batch == 1`), as a paged engine runs them, so the
model's own mask is never needed (our mask function returns None).

Bloom (ALiBi) predates `AttentionInterface`; its attention module's forward is replaced.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from pagedattn.config import CacheConfig
from pagedattn.forward_context import model_scope, set_forward_context
from pagedattn.layer import Attention
from pagedattn.types import AttentionBackend, AttentionType

ATTN_IMPLEMENTATION = "pagedattn"
_LAYER_ATTR = "pagedattn_layer"  # kept in the module's __dict__: not a registered submodule


def register() -> None:
    """Register "pagedattn" in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # Masking is the metadata's job (causal / window / per-request boundaries).
    return None


@dataclass(frozen=True)
class LayerFeatures:
    """The attention features of one transformers attention module, as pagedattn needs them."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    alibi_slopes: Optional[tuple[float, ...]] = None
    has_sinks: bool = False
    attn_type: str = AttentionType.DECODER


def is_attention_module(module: nn.Module) -> bool:
    """Self-attention modules that call AttentionInterface (they carry `scaling`), or Bloom's."""
    name = type(module).__name__
    if name == "BloomAttention":
        return True
    return (name.endswith("Attention") and not name.endswith("CrossAttention")
            and hasattr(module, "scaling") and hasattr(module, "config"))


def layer_features(module: nn.Module, config: Any) -> LayerFeatures:
    """Read a module's attention features from its attributes and the model's config."""
    config = getattr(module, "config", config)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if type(module).__name__ == "BloomAttention":
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        # Bloom's own bias for a 2-token mask is slope * position; position 1 gives the slopes
        # (a public function in every version, unlike the slope helper newer versions have).
        slopes = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]
        return LayerFeatures(num_heads, num_heads, module.head_dim, module.inv_norm_factor,
                             alibi_slopes=tuple(slopes.tolist()))
    head_size = (getattr(module, "head_dim", None) or getattr(module, "attention_head_size", None)
                 or config.hidden_size // num_heads)
    # Modules with per-layer windows (Qwen2, Gemma-2, gpt-oss) carry `sliding_window`; Mistral
    # reads it from the config for every layer.
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(config, "sliding_window", None)
    soft_cap = getattr(module, "attn_logit_softcapping", None)
    is_causal = getattr(module, "is_causal", True)
    return LayerFeatures(
        num_heads, num_kv_heads, int(head_size), float(module.scaling), window or None,
        soft_cap, has_sinks=getattr(module, "sinks", None) is not None,
        attn_type=AttentionType.DECODER if is_causal else AttentionType.ENCODER_ONLY)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Attention takes its activation dtype from torch's default dtype (vLLM takes it from the
    # model config), so build the layers under the model's dtype.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def attach(model: nn.Module, cache_config: Optional[CacheConfig] = None,
           attn_backend: Optional[type[AttentionBackend]] = None) -> dict[str, Attention]:
    """Build a pagedattn `Attention` per attention module of `model` and switch the model to
    them; returns the layers by name (the module's name plus ".attn"), for KV-cache allocation.
    """
    register()
    modules = {name: m for name, m in model.named_modules() if is_attention_module(m)}
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention module pagedattn can serve "
                         "(expected modules calling transformers' AttentionInterface)")
    device = next(model.parameters()).device
    layers: dict[str, Attention] = {}
    with model_scope(), default_dtype(model.dtype):
        for name, module in modules.items():
            feats = layer_features(module, model.config)
            extra = {}
            if feats.has_sinks:
                extra["sinks"] = module.sinks.detach()
            layer = Attention(
                feats.num_heads, feats.head_size, feats.scale, feats.num_kv_heads,
                alibi_slopes=list(feats.alibi_slopes) if feats.alibi_slopes else None,
                cache_config=cache_config, logits_soft_cap=feats.logits_soft_cap,
                per_layer_sliding_window=feats.sliding_window, prefix=f"{name}.attn",
                attn_type=feats.attn_type, attn_backend=attn_backend, **extra).to(device)
            module.__dict__[_LAYER_ATTR] = layer
            module.__dict__["pagedattn_features"] = feats
            if type(module).__name__ == "BloomAttention":
                module.__dict__["pagedattn_model_config"] = model.config
                module.forward = types.MethodType(_bloom_forward, module)
            layers[layer.layer_name] = layer
    set_attn_implementation(model, ATTN_IMPLEMENTATION)
    return layers


def set_attn_implementation(model: nn.Module, name: str) -> None:
    """Switch between "pagedattn" and transformers' own implementations ("eager", "sdpa")."""
    if name == ATTN_IMPLEMENTATION:
        register()
    if model._can_set_attn_implementation():
        model.set_attn_implementation(name)
    else:  # Bloom: no AttentionInterface; its patched forward reads the config's choice
        model.config._attn_implementation = name


@contextlib.contextmanager
def attn_implementation_ctx(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """Temporarily run `model` with another attention implementation (e.g. the eager one)."""
    previous = model.config._attn_implementation
    set_attn_implementation(model, name)
    try:
        yield model
    finally:
        set_attn_implementation(model, previous)


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                            scaling: Optional[float] = None, dropout: float = 0.0,
                            sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over pagedattn: q/k/v `[1, heads, T, D]`
    (all requests' tokens packed in one row) -> (`[1, T, heads, D]`, None)."""
    layer: Optional[Attention] = module.__dict__.get(_LAYER_ATTR)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} has no pagedattn layer: call "
                           "pagedattn.integrations.transformers.attach(model) first")
    if query.shape[0] != 1:
        raise ValueError(f"pagedattn runs packed batches: query batch size must be 1, got "
                         f"{query.shape[0]}; concatenate the requests' tokens into one row")
    _check_call_matches(module.__dict__["pagedattn_features"], scaling, sliding_window, softcap,
                        s_aux)
    num_tokens = query.shape[2]
    q = query[0].transpose(0, 1).reshape(num_tokens, -1)
    k = key[0].transpose(0, 1).reshape(num_tokens, -1)
    v = value[0].transpose(0, 1).reshape(num_tokens, -1)
    out = layer(q, k, v)  # [T, heads * head_size]
    return out.view(1, num_tokens, layer.num_heads, -1), None


def _check_call_matches(feats: LayerFeatures, scaling: Optional[float],
                        sliding_window: Optional[int], softcap: Optional[float],
                        s_aux: Optional[torch.Tensor]) -> None:
    # The layer was built from the module's attributes; a model that passes something else at
    # call time would silently get other numerics, so refuse instead.
    seen = {"scaling": scaling, "sliding_window": sliding_window or None, "softcap": softcap,
            "sinks": s_aux is not None}
    built = {"scaling": feats.scale, "sliding_window": feats.sliding_window,
             "softcap": feats.logits_soft_cap, "sinks": feats.has_sinks}
    for name, value in seen.items():
        if name == "scaling" and value is None:
            continue
        if value != built[name]:
            raise ValueError(f"attention call passed {name}={value!r} but the pagedattn layer "
                             f"was built with {built[name]!r}")


def _bloom_forward(self: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor,
                   alibi: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   layer_past: Any = None, use_cache: bool = False,
                   output_attentions: bool = False, **kwargs: Any):
    """BloomAttention.forward with the attention (ALiBi included) done by pagedattn."""
    if self.__dict__["pagedattn_model_config"]._attn_implementation != ATTN_IMPLEMENTATION:
        return type(self).forward(self, hidden_states, residual, alibi, attention_mask,
                                  layer_past, use_cache, output_attentions, **kwargs)
    from transformers.models.bloom.modeling_bloom import dropout_add

    batch, num_tokens, _ = hidden_states.shape
    fused = self.query_key_value(hidden_states).view(batch * num_tokens, self.num_heads, 3, -1)
    q, k, v = (fused[:, :, i].reshape(batch * num_tokens, -1) for i in range(3))
    out = self.__dict__[_LAYER_ATTR](q, k, v).view(batch, num_tokens, -1)
    out = dropout_add(self.dense(out), residual, self.hidden_dropout, self.training)
    return out, None


@torch.inference_mode()
def hf_generate_greedy(model: nn.Module, prompts: list[list[int]], max_new_tokens: int,
                       attn_implementation: str = "eager", eos_token_id: Any = None,
                       ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' own greedy `generate`, one prompt at a time (no padding, so nothing but
    the attention implementation differs from a paged run): (new tokens, logits per step)."""
    device = next(model.parameters()).device
    if eos_token_id is None:  # passed explicitly: some generate() versions drop the default
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    tokens, logits = [], []
    with attn_implementation_ctx(model, attn_implementation):
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=0,
                                 eos_token_id=eos_token_id, output_logits=True,
                                 return_dict_in_generate=True, use_cache=True,
                                 pad_token_id=model.config.pad_token_id)
            new = out.sequences[0, len(prompt):].tolist()
            tokens.append(new)
            logits.append(torch.stack(out.logits)[:len(new), 0].float().cpu())
    return tokens, logits


@torch.inference_mode()
def paged_encode(model: nn.Module, token_lists: list[list[int]],
                 attn_backend: Optional[type[AttentionBackend]] = None) -> list[torch.Tensor]:
    """Run an encoder-only model (BERT) on sentences packed into one row, with pagedattn's
    ENCODER_ONLY attention (bidirectional within each sentence, no cache): returns each
    sentence's last hidden states [len, hidden]."""
    from pagedattn.metadata import AttentionSpec, CommonAttentionMetadata

    layers = attach(model, attn_backend=attn_backend)
    first = next(iter(layers.values()))
    device = next(model.parameters()).device
    lens = [len(t) for t in token_lists]
    # Encoder attention never touches the cache; the block table only feeds slot bookkeeping.
    block_table = torch.zeros(len(lens), max(lens) // first.block_size + 1, dtype=torch.int32)
    common = CommonAttentionMetadata.from_lengths(lens, lens, block_table, first.block_size,
                                                  device, causal=False)
    builder = first.attn_backend.get_builder_cls()(
        AttentionSpec(first.block_size, first.num_kv_heads, first.head_size, model.dtype),
        list(layers), None, device)
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
    input_ids = torch.tensor([[t for toks in token_lists for t in toks]], device=device)
    position_ids = torch.cat([torch.arange(n) for n in lens])[None].to(device)
    with set_forward_context(metadata):
        hidden = model(input_ids=input_ids, position_ids=position_ids,
                       token_type_ids=torch.zeros_like(input_ids)).last_hidden_state[0]
    return list(hidden.split(lens))
