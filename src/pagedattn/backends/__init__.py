"""Attention backends, one module each; chosen by `pagedattn.selector`."""
