"""The model side of a step: the batch turned into tensors, the forward pass over the paged
cache (eager, or replayed from a CUDA graph), and what decode attention kept."""
