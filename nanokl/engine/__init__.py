"""The engine: the same numbers fast and at scale (attention kernels, the model, CUDA graphs, fused
kernels, micro-batching, processes and shards). An appendix to the course; it imports no lesson."""
