"""Attention over the paged KV cache: the layer, the backends it runs (by name), and the layers
that narrow what it reads (decode pruning, sparse prefill)."""
