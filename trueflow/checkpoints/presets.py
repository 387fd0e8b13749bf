"""Phase-1 alias of the Qwen-Image presets' old home, kept while the tests, their conftest and the benchmarks
import them from here (G1 phase 2 moves them to the family's spec and deletes this file)."""

from ..models.qwen_image.presets import TRANSFORMER_CONFIGS, build_transformer, transformer_config
from .random_init import INIT_STD, NORM_SCALE_STD, init_weights_

__all__ = ["INIT_STD", "NORM_SCALE_STD", "TRANSFORMER_CONFIGS", "build_transformer", "init_weights_",
           "transformer_config"]
