"""`toy_dit`: a two-layer toy DiT declared as a `ModelFamily` outside trueflow, to show that a family is a folder.

tests/test_families.py puts `tests/families` on `trueflow.models.__path__`, so the registry finds this package as
`trueflow.models.toy_dit` exactly as it finds the families shipped in trueflow/models. Both sides are written here:
- the train side, diffusers-style: a `ModelMixin` whose attention goes through diffusers' `dispatch_attention_fn`
  (so `set_attention_backend` and PEFT's `add_adapter` work on it as on a diffusers transformer);
- the engine side, with trueflow's `Linear` (LoRA merged or unmerged) and two fast paths, LayerNorm + timestep
  add fused in fp32 and the timestep divided in fp32, that its `toy` patch group swaps for the train side's bf16
  arithmetic;
- the pipeline, as small as a rollout and `trueflow train` need: a seeded byte-embedding "text encoder", latent
  tokens drawn as they are used (no packing), a linear sigma schedule, a "VAE" that colours each token's 16x16
  pixels from three of its channels, and a pipeline class whose `save_lora_weights` writes the trainer's LoRA files.

Its record differs from Qwen-Image's where a video family's would, so the generic code is shown not to assume an
image family: the text stream is named `context` (mask `context_mask`), the token grid is (frames, rows, cols), and
the timestep is per token (`[T, S]` in the schedule, `[B, S]` into the model).

`tests/families/toy_moe` builds a second family from these pieces: two experts, batched CFG and a distilled guidance
input (the model takes a timestep `[B]` or `[B, S]`, and with `guidance_embeds` a guidance scale `[B]`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import diffusers
import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.loaders.lora_base import LoraBaseMixin
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn
from torch import nn

from trueflow.models.random_init import init_weights_
from trueflow.layers.linear import Linear
from trueflow.models import weight_map
from trueflow.models.cfg import rescaled_cfg
from trueflow.models.spec import EngineSide, Guidance, ModelFamily, PatchGroupSpec, PipelineSide, Presets, TrainSide
from trueflow.patches import Patch, PatchGroup, set_on

PIXELS_PER_TOKEN = 16
EPS = 1e-6
MAX_TEXT_TOKENS = 512  # the text window (as Qwen-Image's, so the trainer's default sampling settings fit)
SCHEDULER_CONFIG = {"_class_name": "ToyLinearSchedule", "num_train_timesteps": 1000}
SIZES = {"tiny": {"in_channels": 8, "text_dim": 12, "num_heads": 2, "head_dim": 8, "num_layers": 2}}
CONFIG_KEYS = (*SIZES["tiny"], "guidance_embeds")  # guidance_embeds: a distilled guidance input (toy_moe's)


# -- the train side (diffusers-style) ---------------------------------------------------------------------------
class ToyAttnProcessor:
    _attention_backend = None  # diffusers' `set_attention_backend` sets these two
    _parallel_config = None

    def __call__(self, attn: "ToyAttention", x: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(x).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        out = dispatch_attention_fn(q, k, v, backend=self._attention_backend, parallel_config=self._parallel_config)
        return attn.to_out(out.flatten(2, 3))


class ToyAttention(nn.Module, AttentionModuleMixin):
    _default_processor_cls = ToyAttnProcessor
    _available_processors = [ToyAttnProcessor]

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.processor = ToyAttnProcessor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.processor(self, x)


class ToyFeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj_in, self.proj_out = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x)))


class ToyBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn, self.ff = ToyAttention(dim, heads), ToyFeedForward(dim)

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(F.layer_norm(h, h.shape[-1:], eps=EPS) + temb)
        return h + self.ff(F.layer_norm(h, h.shape[-1:], eps=EPS))


class ToyDiT2DModel(ModelMixin, ConfigMixin, PeftAdapterMixin):
    @register_to_config
    def __init__(self, in_channels: int = 8, text_dim: int = 12, num_heads: int = 2, head_dim: int = 8,
                 num_layers: int = 2, guidance_embeds: bool = False):
        super().__init__()
        dim = num_heads * head_dim
        self.proj_in, self.txt_in = nn.Linear(in_channels, dim), nn.Linear(text_dim, dim)
        self.time_in = nn.Linear(1, dim)
        self.guidance_in = nn.Linear(1, dim) if guidance_embeds else None
        self.transformer_blocks = nn.ModuleList(ToyBlock(dim, num_heads) for _ in range(num_layers))
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, context, timestep, img_shapes=None, context_mask=None, guidance=None,
                return_dict=False):
        x, c = self.proj_in(hidden_states), self.txt_in(context)
        temb = joint_temb(self.time_in(timestep[..., None]), self.guidance_in, guidance, c.shape[1], x.shape[1])
        h = torch.cat([c, x], dim=1)
        for block in self.transformer_blocks:
            h = block(h, temb)
        return (self.proj_out(h[:, c.shape[1]:]),)


def joint_temb(temb: torch.Tensor, guidance_in: nn.Module | None, guidance: torch.Tensor | None, text_len: int,
               image_len: int) -> torch.Tensor:
    """The timestep embeddings of the image tokens (`[B, S, D]`, or `[B, D]` for one timestep per sample), plus the
    distilled guidance's (FluxPipeline's `guidance`, `[B]` fp32, taken in the model dtype) -> the joint sequence's
    `[B, L + S, D]`: each text token takes the first image token's."""
    if guidance_in is not None:
        g = guidance_in(guidance.to(temb.dtype)[:, None])
        temb = temb + (g[:, None] if temb.ndim == 3 else g)
    if temb.ndim == 2:
        temb = temb[:, None].expand(-1, image_len, -1)
    return torch.cat([temb[:, :1].expand(-1, text_len, -1), temb], dim=1)


def train_forward(model, hidden_states, timestep, grid, cond):
    return model(hidden_states, cond["context"], timestep, img_shapes=[grid] * hidden_states.shape[0],
                 context_mask=cond.get("context_mask"), guidance=cond.get("guidance"))[0]


# -- the engine side --------------------------------------------------------------------------------------------
class EngineAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (self.heads, -1)).permute(0, 2, 1, 3) for p in (self.to_q, self.to_k, self.to_v))
        return self.to_out(F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).flatten(2, 3))


class EngineFeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj_in, self.proj_out = Linear(dim, 2 * dim), Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x)))


class EngineBlock(nn.Module):
    exact_norm_add = False  # fast: LayerNorm and the timestep add in fp32, rounded once

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn, self.ff = EngineAttention(dim, heads), EngineFeedForward(dim)

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        if self.exact_norm_add:
            a = F.layer_norm(h, h.shape[-1:], eps=EPS) + temb
        else:
            a = (F.layer_norm(h.float(), h.shape[-1:], eps=EPS) + temb.float()).to(h.dtype)
        h = h + self.attn(a)
        return h + self.ff(F.layer_norm(h, h.shape[-1:], eps=EPS))


class ToyEngine(nn.Module):
    exact_timestep = False  # fast: t / 1000 in fp32, rounded once

    def __init__(self, config: dict):
        super().__init__()
        c = {k: config.get(k, False) for k in CONFIG_KEYS}
        self.config = c
        dim = c["num_heads"] * c["head_dim"]
        self.proj_in, self.txt_in = Linear(c["in_channels"], dim), Linear(c["text_dim"], dim)
        self.time_in = Linear(1, dim)
        self.guidance_in = Linear(1, dim) if c["guidance_embeds"] else None
        self.transformer_blocks = nn.ModuleList(EngineBlock(dim, c["num_heads"]) for _ in range(c["num_layers"]))
        self.proj_out = Linear(dim, c["in_channels"])
        self.lora_merge = True

    def forward(self, hidden_states, timestep, grid, context, context_mask=None, guidance=None):
        x, c = self.proj_in(hidden_states), self.txt_in(context)
        t = timestep.to(x.dtype) / 1000 if self.exact_timestep else (timestep / 1000).to(x.dtype)
        temb = joint_temb(self.time_in(t[..., None]), self.guidance_in, guidance, c.shape[1], x.shape[1])
        h = torch.cat([c, x], dim=1)
        for block in self.transformer_blocks:
            h = block(h, temb)
        return self.proj_out(h[:, c.shape[1]:])


def build_model(config: dict, device="cpu", dtype: torch.dtype = torch.bfloat16) -> ToyEngine:
    with torch.device("meta"):
        model = ToyEngine(config)
    return model.to(dtype).to_empty(device=device).eval().requires_grad_(False)


def make_group(train_backend: str = "native", name: str = "toy") -> PatchGroup:
    if train_backend != "native":
        raise ValueError(f"the toy engine reproduces only the `native` train backend, not {train_backend!r}")
    return PatchGroup(name, (
        Patch("layer_norm_add", "LayerNorm rounded to bf16 before the timestep is added, as the train side does",
              set_on(EngineBlock, "exact_norm_add", True)),
        Patch("timestep_dtype", "t.to(bf16) / 1000, as the train side receives it",
              set_on(ToyEngine, "exact_timestep", True)),
        Patch("lora_unmerged", "LoRA kept unmerged, in PEFT's order", set_on(ToyEngine, "lora_merge", False)),
    ))


# -- presets, checkpoint, probe inputs --------------------------------------------------------------------------
def transformer_config(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"unknown transformer size {size!r}; known sizes: {', '.join(SIZES)}")
    return dict(SIZES[size])


def build_transformer(size_or_config, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
                      cls: type = ToyDiT2DModel) -> ToyDiT2DModel:
    config = transformer_config(size_or_config) if isinstance(size_or_config, str) else dict(size_or_config)
    model = cls(**{k: config[k] for k in CONFIG_KEYS if k in config})
    return init_weights_(model.to(device), seed, device).to(dtype).eval()


def write_checkpoint(out: Path, size: str, seed: int, dtype: torch.dtype, device) -> None:
    build_transformer(size, seed, dtype, device).save_pretrained(out / "transformer", safe_serialization=True)
    (out / "scheduler").mkdir()
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG))
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "ToyDiTPipeline", "_diffusers_version": diffusers.__version__,
        "transformer": [__name__, "ToyDiT2DModel"]}))


def probe_inputs(config: dict, batch: int, text_len: int, resolution: int, dtype, seed: int, device) -> dict:
    g = torch.Generator().manual_seed(seed)
    side = resolution // PIXELS_PER_TOKEN
    hs = torch.randn(batch, side * side, config["in_channels"], generator=g)
    ehs = torch.randn(batch, text_len, config["text_dim"], generator=g)
    t = (torch.rand(1, generator=g) * 1000).expand(batch, side * side).contiguous()  # one per token
    return {"hidden_states": hs.to(device, dtype), "timestep": t.to(device), "grid": (1, side, side),
            "cond": {"context": ehs.to(device, dtype), "context_mask": None}}


# -- the pipeline -----------------------------------------------------------------------------------------------
class ToyDiTPipeline(LoraBaseMixin):
    """Only what the trainer's checkpoints call: diffusers' LoRA writer, under the `transformer.` prefix."""

    _lora_loadable_modules = ["transformer"]
    transformer_name = "transformer"

    @classmethod
    def save_lora_weights(cls, save_directory, transformer_lora_layers, weight_name=None,
                          transformer_lora_adapter_metadata=None):
        cls._save_lora_weights(save_directory, {cls.transformer_name: transformer_lora_layers},
                               {cls.transformer_name: transformer_lora_adapter_metadata}, weight_name=weight_name)


def load_text(root: Path, device, dtype: torch.dtype):
    """(no tokenizer, a byte embedding seeded from nothing but the text width)."""
    text_dim = json.loads((root / "transformer" / "config.json").read_text())["text_dim"]
    embed = init_weights_(nn.Embedding(256, text_dim), seed=0)
    return None, embed.to(device, dtype).eval()


def encode_prompts(_tokenizer, text_encoder: nn.Embedding, prompts: list[str], max_len: int) -> list[dict]:
    device = text_encoder.weight.device
    return [{"context": text_encoder(torch.tensor(list(p.encode()[:max_len]) or [0], device=device))}
            for p in prompts]


def latent_grid(height: int, width: int, num_frames: int) -> tuple[int, int, int]:
    if num_frames != 1:
        raise ValueError(f"the toy family makes one frame, got num_frames={num_frames}")
    return 1, height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN


def schedule(_config: dict, steps: int, tokens: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    sigmas = torch.linspace(1, 0, steps + 1, dtype=torch.float32, device=device)
    return sigmas, (sigmas[:-1] * 1000)[:, None].expand(steps, tokens).contiguous()  # [T, S]: one per token


class ToyDecoder:
    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int) -> torch.Tensor:
        _, rows, cols = latent_grid(height, width, num_frames)
        rgb = latents[..., :3].float().unflatten(1, (rows, cols)).tanh() * 0.5 + 0.5
        rgb = rgb.repeat_interleave(PIXELS_PER_TOKEN, 1).repeat_interleave(PIXELS_PER_TOKEN, 2)
        return (rgb.cpu() * 255).round().to(torch.uint8)


FAMILY = ModelFamily(
    name="toy_dit",
    pipeline_class="ToyDiTPipeline",
    pipeline_module=__name__,
    default=False,
    blocks=("transformer_blocks",),
    engine=EngineSide(
        # engine modules are named as diffusers' are: the generic checked loading with the identity name map
        build_model=build_model,
        load_weights=lambda model, state_dict: weight_map.load_weights(model, state_dict, weight_map.SAME_NAMES),
        parse_peft_state_dict=weight_map.parse_peft_state_dict,
        set_lora=lambda model, lora, scale, merge, check_only=False: weight_map.set_lora(
            model, lora, scale, merge, weight_map.SAME_NAMES, check_only),
        map_module_name=weight_map.SAME_NAMES.map_module_name,
        diffusers_module_name=weight_map.SAME_NAMES.diffusers_module_name,
        comparable_modules=(Linear, EngineAttention, EngineFeedForward, EngineBlock),
        attention_backend=lambda model: "sdpa",
    ),
    patch_groups={"toy": PatchGroupSpec(make_group(), make_group, {"native": "sdpa"})},
    pipeline=PipelineSide(
        folders=("scheduler",), pixels_per_token=PIXELS_PER_TOKEN, size_reason="toy VAE factor 8 x patch 2",
        max_text_tokens=MAX_TEXT_TOKENS, load_text=load_text, encode_prompts=encode_prompts, latent_grid=latent_grid,
        text_streams={"context": "context_mask"},
        noise_shape=lambda config, grid: (math.prod(grid), config["in_channels"]), pack_latents=lambda x: x,
        schedule=schedule, load_decoder=lambda root, device, dtype: ToyDecoder(), scheduler_config=SCHEDULER_CONFIG,
    ),
    probe_inputs=probe_inputs,
    train=TrainSide(
        transformer_class="ToyDiT2DModel", module=__name__,
        lora_targets=("to_q", "to_k", "to_v", "to_out", "ff.proj_in", "ff.proj_out"),
        shard_units=("transformer_blocks",), parity_backend="native", masked_backend="native",
        timestep=lambda t, dtype: t.to(dtype) / 1000, forward=train_forward,
    ),
    presets=Presets(transformer_config=transformer_config, build_transformer=build_transformer,
                    write_checkpoint=write_checkpoint),
    guidance=Guidance("separate", rescaled_cfg),
)
