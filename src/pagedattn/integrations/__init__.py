"""Optional integrations with other libraries; each module imports its library lazily.

- `pagedattn.integrations.transformers`: run Hugging Face transformers models' attention
  through pagedattn (`pip install -e ".[hf]"` in the pagedattn checkout).
- `pagedattn.integrations.hf_generator`: a small continuous-batching generator over a paged
  KV cache for those models.
- `pagedattn.integrations.hf_models`: tiny random-weight configs of the architectures whose
  attention features pagedattn serves (GQA, sliding window, soft cap, ALiBi, sinks).
"""
