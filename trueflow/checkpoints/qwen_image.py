"""Phase-1 alias of the Qwen-Image checkpoint writer's old home, kept while `trueflow/train/run.py`, the tests'
conftest and the scripts still import it from here (G1 phase 2 moves them to `trueflow.checkpoints` and the
family, and deletes this file)."""

from ..models.qwen_image.checkpoint import _build_text_encoder, build_pipeline, build_tokenizer, template_prefix
from . import init_checkpoint

__all__ = ["_build_text_encoder", "build_pipeline", "build_tokenizer", "init_checkpoint", "template_prefix"]
