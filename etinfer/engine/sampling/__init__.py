"""A step's sampling: every row's parameters as tensors, the batched sampler that measures the
entropy signal, and draft verification column by column."""
