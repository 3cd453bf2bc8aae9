"""Tensor parallelism over torch.distributed: the rank's place in its group and the collectives the sharded
model needs (parallel.py)."""
