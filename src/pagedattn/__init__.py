"""pagedattn: paged attention for LLM inference, with vLLM's attention API."""
