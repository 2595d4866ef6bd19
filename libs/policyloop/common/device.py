"""Where torch computes: one rule for the learner and the embedded engine."""

from __future__ import annotations


class DeviceUnavailable(RuntimeError):
    """The configured device cannot be used by this process's torch."""


def resolve_device(requested: str) -> str:
    """`auto` is CUDA when this torch sees a GPU, else the CPU. `cuda` is a promise: a CPU-only
    torch build, or a node without a visible GPU, is an error rather than a silent CPU run."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {requested!r}")
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch ({torch.__version__}) is a CPU-only build"
        else:
            why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU (driver, device plugin or " \
                  f"CUDA_VISIBLE_DEVICES)"
        raise DeviceUnavailable(f"device=cuda was asked for but {why}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested
