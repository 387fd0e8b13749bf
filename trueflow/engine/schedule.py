"""Phase-1 alias of the Qwen-Image schedule's old home, kept while `trueflow/train/run.py` imports it from here
(G1 phase 2 switches the trainer to its family's `pipeline.schedule` and deletes this file)."""

from ..models.qwen_image.schedule import QWEN_IMAGE_SCHEDULER_CONFIG, qwen_image_schedule

__all__ = ["QWEN_IMAGE_SCHEDULER_CONFIG", "qwen_image_schedule"]
