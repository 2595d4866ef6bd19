"""Ranks other than 0 under torchrun: no bus, no Redis — each holds its FSDP2 shards and trains
its share of every step rank 0 leads, until rank 0 closes."""

from __future__ import annotations

import os
import signal

from policyloop.learner.settings import LearnerSettings
from policyloop.telemetry.logging import configure_logging, get_logger

log = get_logger(__name__)


def is_follower_rank() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0


def follow_rank(settings: LearnerSettings) -> int:
    from policyloop.models.resolve import resolve_model
    from policyloop.rl.trainer import PolicyTrainer

    # torchrun forwards SIGTERM to every rank; rank 0 stops gracefully and then releases the
    # others (close() broadcasts the end), which must still be there to take part.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(service="learner", run_id=settings.run_id,
                      instance=f"{settings.instance_id}-rank{os.environ['RANK']}", level=settings.log_level)
    # Each rank resolves the name itself (a Hugging Face id: from the node's cache, where
    # huggingface_hub's file locks let ranks that download at once share the work).
    trainer = PolicyTrainer(resolve_model(settings.model_path), settings.trainer_config(), version=0)
    log.info("follower_ready", rank=trainer.rank, world_size=trainer.world_size)
    steps = trainer.follow()
    trainer.close()
    log.info("follower_stopped", steps=steps)
    return 0
