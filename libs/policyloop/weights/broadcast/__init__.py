"""The colocated weight sync: the learner broadcasts each version to the engines on its node over
a torch.distributed group of its own (gloo on CPU, NCCL on GPUs) instead of the publisher's
copy, in SGLang's `flattened_bucket` format.

- `layout`: which tensors go in which bucket and where their bytes sit (pure).
- `group`: the weight-update group (its rendezvous, SGLang's store keys) and the receiving side
  of one broadcast, which an engine calls.
- `engine_control`: the protocol the sender drives an engine through (SGLang's weight-sync routes).
- `sender`: `DistributedWeightSender`, the learner's side.
"""
