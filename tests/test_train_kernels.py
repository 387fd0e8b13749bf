"""`--train-kernels fused` (trueflow/models/qwen_image/train_kernels.py): the engine's eager-exact kernels as autograd
Functions underneath diffusers' Qwen-Image model. Each forward is diffusers' op sequence bit for bit, each backward
the analytic gradient of that sequence, and the model they are swapped into keeps its bits, so parity stays 0.0.

Oracles: diffusers' own modules and functions (`RMSNorm`, `QwenImageTransformerBlock._modulate`,
`apply_rotary_emb_qwen`, the block's `h + gate * y`) for forwards and for autograd; the formulas in float64 for
gradcheck.

Where the kernels run: `triton_ops.py` is loaded afresh in this process with TRITON_INTERPRET=1 (triton reads it when
`@triton.jit` runs, so that copy's kernels are interpreted on the CPU) and the patch group's dispatch is pointed at
it (`kernels.ops`, `kernels.use_triton`), the CPU tensors standing in for CUDA ones as in tests/test_kernels.py's
interpreter child. Without it (`reference`), the CPU runs the Functions' fallback: diffusers' op sequence itself.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.func import functional_call

from conftest import BF16, EPS, assert_bitwise, assert_differs, randn
from trueflow import kernels
from trueflow.models.qwen_image import patches as P
from trueflow.models.qwen_image import train_kernels as T
from trueflow.models.qwen_image.family import FAMILY
from trueflow.models.qwen_image.presets import build_transformer, transformer_config
from trueflow.train.config import TrainConfig
from trueflow.train.model import LoraSpec, add_lora, train_forward

F64 = torch.float64
EAGER_KERNELS = ("rms_norm_eager_bf16", "scale_shift_eager_bf16", "mul_add_eager_bf16")


# -- the kernel paths -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def interpreted_ops():
    """`triton_ops.py` as a module of its own whose kernels the interpreter runs."""
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed (pip install -e .[kernels])")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        spec = importlib.util.spec_from_file_location("triton_ops_interpreted",
                                                      Path(kernels.__file__).with_name("triton_ops.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    assert type(module._mul_add_eager_kernel).__name__ == "InterpretedFunction"
    return module


def interpret(monkeypatch: pytest.MonkeyPatch, ops) -> Counter:
    """Point the eager-exact kernels' dispatch at the interpreted `ops`; returns the count of kernels launched."""
    launched: Counter = Counter()

    def counted(name: str):
        def launch(*args, **kwargs):
            launched[name] += 1
            return getattr(ops, name)(*args, **kwargs)
        return launch

    counting = SimpleNamespace(**{name: counted(name) for name in EAGER_KERNELS})
    monkeypatch.setattr(kernels, "ops", lambda: counting)
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    # The CPU's complex product rounds every product (test_kernels.py::test_qk_norm_rope_exact asserts
    # `complex_fma(cpu) is False`): given here, since its 786k-element probe takes ~9 s interpreted. A wrong variant
    # would show as a difference from diffusers.
    monkeypatch.setitem(P._COMPLEX_FMA, torch.device("cpu"), False)
    return launched


@pytest.fixture(params=["reference", "interpreter"])
def kernel_path(request, monkeypatch) -> Counter | None:
    """The Functions' forward path for one test: the count of interpreted kernels launched, or None (the reference)."""
    if request.param == "reference":
        return None
    return interpret(monkeypatch, request.getfixturevalue("interpreted_ops"))


# -- diffusers' sequences (the oracles) --------------------------------------------------------------------------------
def diffusers_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm.forward with weight `w` (gradients reach it)."""
    from diffusers.models.normalization import RMSNorm

    return functional_call(RMSNorm(w.shape[0], eps=EPS), {"weight": w}, (x,))


def diffusers_modulate(xn: torch.Tensor, mod: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' `QwenImageTransformerBlock._modulate` (it reads nothing of the block)."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    return QwenImageTransformerBlock._modulate(None, xn, mod)


def diffusers_gated(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """QwenImageTransformerBlock.forward's `hidden_states + img_gate1 * img_attn_output` (gate [B, D] unsqueezed, as
    `_modulate` returns it)."""
    return residual + gate.unsqueeze(1) * y


def diffusers_joint_qk(txt, img, w_txt, w_img, f_txt, f_img) -> torch.Tensor:
    """QwenDoubleStreamAttnProcessor2_0: each stream's norm, `apply_rotary_emb_qwen(use_real=False)`, `torch.cat`."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    return torch.cat([apply_rotary_emb_qwen(diffusers_rms(txt, w_txt), f_txt, use_real=False),
                      apply_rotary_emb_qwen(diffusers_rms(img, w_img), f_img, use_real=False)], dim=1)


def rope_tables(rows: int, cols: int, text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' QwenEmbedRope tables (complex64) of a rows x cols image and `text` tokens, the tiny model's axes."""
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    rope = QwenEmbedRope(theta=10000, axes_dim=[8, 12, 12], scale_rope=True)
    return rope([(1, rows, cols)], max_txt_seq_len=text, device=torch.device("cpu"))


# Double rounding by hand (as tests/test_kernels.py): p = (1 - 2^-8)(1 + 2^-7) = 1 + 2^-8 - 2^-15 rounds to 1.0 in
# bf16, and 256 + 1.0 = 257 ties to even, 256; rounded once, 256 + p = 257.0039 rounds to 258.
BELOW_ONE, ABOVE_ONE, BIG = 1 - 2**-8, 1 + 2**-7, 256.0


def once(sequence, *inputs: torch.Tensor) -> torch.Tensor:
    """`sequence` computed in fp32 and rounded to bf16 once at the end."""
    return sequence(*(t.detach().float() for t in inputs)).to(BF16)


def full(value: float, *shape: int) -> torch.Tensor:
    return torch.full(shape, value, dtype=BF16)


# -- forwards ---------------------------------------------------------------------------------------------------------
def test_each_forward_is_the_diffusers_sequence_bitwise(kernel_path):
    """Random inputs large enough that a once-rounded op differs (shown: diffusers' sequence in fp32, rounded once to
    bf16, as the engine's fast kernels compute), and crafted ones where one rounding instead of two moves the result;
    the Functions take gradient-requiring inputs, as in training."""
    B, S, D = 2, 4, 64  # small (the interpreter runs a program per row), yet every once-rounded control differs
    # RMSNorm (txt_norm's 3-d input)
    x, w = randn((B, S, D), 1, std=2.0), randn((D,), 2, std=0.1, mean=1.0)
    ref = diffusers_rms(x, w)
    assert_bitwise(T.RMSNormFunction.apply(x.requires_grad_(), w.requires_grad_(), EPS), ref, "RMSNorm")
    assert_differs(once(diffusers_rms, x, w), ref, "once-rounded RMSNorm")
    # `_modulate`: x * (1 + scale) + shift, and diffusers' gate
    xn, mod = randn((B, S, D), 3), randn((B, 3 * D), 4, std=0.5)
    (ref, ref_gate), (out, gate) = diffusers_modulate(xn, mod), T._modulate(None, xn.requires_grad_(), mod)
    assert_bitwise(out, ref, "_modulate")
    assert_bitwise(gate, ref_gate, "_modulate's gate")
    assert_differs(once(lambda *a: diffusers_modulate(*a)[0], xn, mod), ref, "once-rounded modulation")
    crafted = torch.cat([full(BIG, B, D), full(2**-7, B, D), full(0.0, B, D)], dim=-1)
    ref, _ = diffusers_modulate(full(BELOW_ONE, B, 3, D), crafted)
    assert (ref == BIG).all() and (once(lambda *a: diffusers_modulate(*a)[0], full(BELOW_ONE, B, 3, D), crafted)
                                   == BIG + 2).all()
    assert_bitwise(T._modulate(None, full(BELOW_ONE, B, 3, D), crafted)[0], ref, "_modulate, crafted")
    # the gated residual h + gate * y
    y, residual, g = randn((B, S, D), 5), randn((B, S, D), 6, std=3.0), randn((B, D), 7, std=0.5)
    ref = diffusers_gated(residual, g, y)
    assert_bitwise(T._gated_residual(residual, g.unsqueeze(1), y.requires_grad_()), ref, "gated residual")
    assert_differs(once(diffusers_gated, residual, g, y), ref, "once-rounded gated residual")
    crafted = (full(BIG, B, 3, D), full(ABOVE_ONE, B, D), full(BELOW_ONE, B, 3, D))
    ref = diffusers_gated(*crafted)
    assert (ref == BIG).all() and (once(diffusers_gated, *crafted) == BIG + 2).all()
    assert_bitwise(T._gated_residual(full(BIG, B, 3, D), full(ABOVE_ONE, B, 1, D), full(BELOW_ONE, B, 3, D)), ref,
                   "gated residual, crafted")
    # q/k: both streams' norm + RoPE + cat, the tiny model's heads (2 x 32) over a 2 x 2 image and 3 text tokens
    f_img, f_txt = rope_tables(2, 2, 3)
    txt, img = randn((B, 3, 2, 32), 8, std=2.0), randn((B, 4, 2, 32), 9, std=2.0)
    w_txt, w_img = randn((32,), 10, std=0.1, mean=1.0), randn((32,), 11, std=0.1, mean=1.0)
    ref = diffusers_joint_qk(txt, img, w_txt, w_img, f_txt, f_img)
    out = T.JointQKNormRopeFunction.apply(txt.requires_grad_(), img, w_txt, w_img, f_txt, f_img, EPS, EPS)
    assert_bitwise(out, ref, "joint q/k norm + RoPE")
    assert_differs(once(lambda *a: diffusers_joint_qk(*a, f_txt, f_img), txt, img, w_txt, w_img), ref,
                   "once-rounded q/k norm + RoPE")
    if kernel_path is not None:  # the interpreter: each call was a kernel
        assert kernel_path == Counter(rms_norm_eager_bf16=3, scale_shift_eager_bf16=2, mul_add_eager_bf16=2)


# -- backwards --------------------------------------------------------------------------------------------------------
def ulp(ref: torch.Tensor) -> torch.Tensor:
    """A bf16 ulp at |ref| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(torch.finfo(torch.float32).tiny))) - 7)


def grads(f, inputs, g) -> tuple[tuple[torch.Tensor, ...], int]:
    """The gradients of every input, and the bytes autograd saved for them (each saved tensor once)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    saved: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.data_ptr(), t.shape, t.dtype] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = f(*leaves)
    return torch.autograd.grad(out, leaves, g), sum(saved.values())


CASES = {  # name -> (the Function's call, diffusers' sequence, bf16 inputs, upstream gradient shape)
    "RMSNorm": (lambda x, w: T.RMSNormFunction.apply(x, w, EPS), diffusers_rms,
                lambda: (randn((2, 37, 64), 1, std=2.0), randn((64,), 2, std=0.1, mean=1.0)), (2, 37, 64)),
    "ScaleShift": (lambda xn, shift, scale: T.ScaleShiftFunction.apply(xn, shift, scale),
                   lambda xn, shift, scale: diffusers_modulate(xn, torch.cat([shift, scale, 0 * scale], -1))[0],
                   lambda: (randn((2, 37, 64), 3), randn((2, 64), 4, std=0.5), randn((2, 64), 5, std=0.5)),
                   (2, 37, 64)),
    "GatedResidual": (lambda y, gate, residual: T.GatedResidualFunction.apply(y, gate, residual),
                      lambda y, gate, residual: diffusers_gated(residual, gate, y),
                      lambda: (randn((2, 37, 64), 6), randn((2, 64), 7, std=0.5), randn((2, 37, 64), 8, std=3.0)),
                      (2, 37, 64)),
    "JointQKNormRope": (lambda t, i, wt, wi: T.JointQKNormRopeFunction.apply(t, i, wt, wi, *rope_tables(4, 8, 7)[::-1],
                                                                              EPS, EPS),
                        lambda t, i, wt, wi: diffusers_joint_qk(t, i, wt, wi, *rope_tables(4, 8, 7)[::-1]),
                        lambda: (randn((2, 7, 2, 32), 9, std=2.0), randn((2, 32, 2, 32), 10, std=2.0),
                                 randn((32,), 11, std=0.1, mean=1.0), randn((32,), 12, std=0.1, mean=1.0)),
                        (2, 39, 2, 32)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_backward_against_autograd_of_the_diffusers_sequence(case):
    """bf16 inputs and upstream gradient, every input's gradient (the weights' too, as full-parameter training needs).

    Against autograd of diffusers' sequence run in fp32 (the same inputs upcast): within half a bf16 ulp plus 1e-5 of
    the largest gradient. Both compute the same derivative in fp32 arithmetic, differing only in the order of fp32
    roundings; the Function then rounds once to bf16. Against diffusers' own bf16 autograd (the stock train side):
    within 2^-6 of the largest gradient. That chain rounds every op of the backward to bf16 (2^-9 relative each) and
    its reductions cancel, so a ulp bound per element means nothing there (measured: up to 0.7%, 280 ulps).

    What the backward keeps: no more than stock's autograd, and for the norms a third of it or less (their bf16
    inputs, weights and RoPE tables, where autograd also keeps fp32 copies of x and of the rotated pairs and the bf16
    normed x: 9.6 against 38.3 kB for RMSNorm here, 15.1 against 45.7 kB for q/k)."""
    fn, seq, make, g_shape = CASES[case]
    inputs, g = make(), randn(g_shape, 99)
    ours, ours_saved = grads(fn, inputs, g)
    fp32, _ = grads(seq, [t.float() for t in inputs], g.float())
    stock, stock_saved = grads(seq, inputs, g)
    assert ours_saved * (3 if case in ("RMSNorm", "JointQKNormRope") else 1) <= stock_saved, (ours_saved, stock_saved)
    for k, (o, r, s) in enumerate(zip(ours, fp32, stock)):
        what = f"{case} d(input {k})"
        assert o.dtype == inputs[k].dtype and o.shape == inputs[k].shape, what
        o, r, s = o.double(), r.double(), s.double()
        assert ((o - r).abs() <= 0.5 * ulp(r) + 1e-5 * r.abs().max()).all(), \
            f"{what}: {((o - r).abs() / ulp(r)).max():.2f} ulp from diffusers' fp32 autograd"
        assert ((o - s).abs() <= 2**-6 * s.abs().max()).all(), f"{what}: {(o - s).abs().max():.3e} from stock"


# The formulas in float64: the forwards gradcheck differentiates numerically (diffusers' own sequence computes its
# variance and rotation in fp32 whatever the input's dtype, too coarse for finite differences).
def rms64(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope64(y, f):
    z = torch.view_as_complex(y.reshape(*y.shape[:-1], -1, 2).contiguous()) * f.to(torch.complex128).unsqueeze(1)
    return torch.view_as_real(z).flatten(3)


class RMSNorm64(T.RMSNormFunction):
    forward = staticmethod(rms64)


class ScaleShift64(T.ScaleShiftFunction):
    forward = staticmethod(lambda xn, shift, scale: xn * (1 + scale[:, None]) + shift[:, None])


class GatedResidual64(T.GatedResidualFunction):
    forward = staticmethod(lambda y, gate, residual: residual + gate[:, None] * y)


class JointQKNormRope64(T.JointQKNormRopeFunction):
    forward = staticmethod(lambda t, i, wt, wi, ft, fi, et, ei: torch.cat([rope64(rms64(t, wt, et), ft),
                                                                           rope64(rms64(i, wi, ei), fi)], dim=1))


def test_gradcheck_float64():
    """Each Function's backward (its `setup_context` and `backward`, the forward replaced by the formula in float64)
    against finite differences."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, mean=0.0):
        return (torch.randn(shape, generator=g, dtype=F64) + mean).requires_grad_()

    f_txt, f_img = (torch.polar(torch.ones(n, 4), torch.randn(n, 4, generator=g)) for n in (2, 3))  # head dim 8
    checks = {
        "RMSNorm": (RMSNorm64, (r(2, 3, 8), r(8, mean=1.0), EPS)),
        "ScaleShift": (ScaleShift64, (r(2, 3, 8), r(2, 8), r(2, 8))),
        "GatedResidual": (GatedResidual64, (r(2, 3, 8), r(2, 8), r(2, 3, 8))),
        "JointQKNormRope": (JointQKNormRope64, (r(1, 2, 2, 8), r(1, 3, 2, 8), r(8, mean=1.0), r(8, mean=1.0), f_txt,
                                                f_img, EPS, 1e-5)),
    }
    for name, (fn, args) in checks.items():
        assert torch.autograd.gradcheck(fn.apply, args), name


# -- the model ---------------------------------------------------------------------------------------------------------
def tiny_model(lora: bool = True, **config) -> nn.Module:
    model = build_transformer({**transformer_config("tiny"), **config}, seed=0, dtype=BF16)
    if lora:
        add_lora(model, LoraSpec(rank=4, target_modules=FAMILY.train.lora_targets), b_init_std=0.02, seed=1)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


@pytest.fixture(scope="module")
def models() -> tuple[nn.Module, nn.Module, list[str]]:
    """The tiny Qwen-Image (2 blocks, 2 x 32 heads, joint 48) with a LoRA, stock and fused, and what was swapped."""
    stock, fused = tiny_model(), tiny_model()
    return stock, fused, T.install(fused)


def forward(model: nn.Module, batch: int, resolution: int, text: int, **kw) -> torch.Tensor:
    config = transformer_config("tiny")
    i = FAMILY.probe_inputs(config, batch, text, resolution, BF16, 0, "cpu")
    return train_forward(FAMILY, model, i["hidden_states"], FAMILY.train.timestep(i["timestep"], BF16), i["grid"],
                         i["cond"], **kw)


def test_the_install_reaches_every_op_it_names(models):
    _, _, swapped = models
    blocks = [f"transformer_blocks.{b}" for b in range(2)]
    norms = [f"{b}.attn.{n}.forward" for b in blocks for n in T.QK_NORMS]
    assert sorted(swapped) == sorted(["txt_norm.forward", *norms, *(f"{b}.{what}" for b in blocks for what in
                                                                    ("_modulate", "forward", "attn.processor"))])


def test_tiny_model_forward_is_stock_bits_and_gradients_close(models):
    """Forward and backward of the whole model with a LoRA (the CPU: each Function's reference forward, its analytic
    backward), with and without gradient checkpointing (the same gradients). The LoRA's gradients within 2^-5 of
    stock's in norm: the two backward chains round differently at each op of both blocks (stock in bf16 throughout,
    the Functions in fp32), each op at most 2^-6 of its largest gradient (the test above); they must differ
    somewhere, or the Functions' backward did not run."""
    stock, fused, _ = models
    outs, lora_grads = [], []
    for model, checkpointing in ((stock, False), (fused, False), (fused, True)):
        if checkpointing:  # diffusers' per-block recompute in backward runs the Functions' forwards again
            model.enable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        out = forward(model, 2, 64, 7)
        out.float().square().mean().backward()
        model.disable_gradient_checkpointing()
        outs.append(out.detach())
        lora_grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert_bitwise(outs[1], outs[0], "fused vs stock train forward")
    assert_bitwise(outs[2], outs[0], "fused with gradient checkpointing vs stock train forward")
    for name, g in lora_grads[1].items():
        assert_bitwise(lora_grads[2][name], g, f"{name}: gradient with checkpointing vs without")
    # 48 LoRA tensors less the last block's text-stream output layers (to_add_out, txt_mlp), which nothing reads
    assert sorted(lora_grads[0]) == sorted(lora_grads[1]) and len(lora_grads[0]) == 42
    differ = 0
    for name, g in lora_grads[0].items():
        d = (lora_grads[1][name].float() - g.float()).norm()
        assert d <= 2**-5 * g.float().norm(), f"{name}: {d / g.float().norm():.3e} of the stock gradient's norm"
        differ += not torch.equal(lora_grads[1][name], g)
    assert differ > 21, f"the analytic backward ran: {differ} of 42 gradients differ from stock's"


def test_tiny_model_on_the_interpreted_kernels_is_stock_bits(models, interpreted_ops, monkeypatch):
    """The whole tiny model (both blocks) with every Function on its interpreted kernel: 1 sample, a 2 x 2 latent grid,
    2 text tokens (the interpreter runs one program per row)."""
    stock, fused, _ = models
    with torch.no_grad():
        expect = forward(stock, 1, 32, 2)
        launched = interpret(monkeypatch, interpreted_ops)
        got = forward(fused, 1, 32, 2)
    assert_bitwise(got, expect, "fused (interpreted kernels) vs stock")
    # per block: 4 q/k norms (2 Functions x 2 streams), 4 modulations, 4 gated residuals; and txt_norm
    assert launched == Counter(rms_norm_eager_bf16=9, scale_shift_eager_bf16=8, mul_add_eager_bf16=8)


def test_the_tp_matched_and_the_batch_invariant_train_sides_take_them(models):
    """The TP-matched train side (`parallel.train_match.match_tp`, 2 ranks) wraps the fused processor as it wraps
    diffusers' (it swaps `dispatch_attention_fn` in the processor's module): fused then matched is stock matched, bit
    for bit; matched first is refused. The batch-invariant backend reaches the fused processors through diffusers'
    `set_attention_backend` and leaves the forward stock's bits."""
    from trueflow.kernels.batch_invariant import BACKEND
    from trueflow.parallel.engine import tp_plan
    from trueflow.parallel.train_match import match_tp

    plan = tp_plan(FAMILY, 2)
    stock, fused = tiny_model(lora=False), tiny_model(lora=False)
    T.install(fused)
    with torch.no_grad():
        unmatched = forward(stock, 2, 64, 7)
        for model in (stock, fused):
            match_tp(model, plan, 2)
        assert type(fused.transformer_blocks[0].attn.processor).__mro__[1] is T.FusedQwenDoubleStreamAttnProcessor
        expect = forward(stock, 2, 64, 7)
        assert_bitwise(forward(fused, 2, 64, 7), expect, "fused + TP-matched vs stock TP-matched")
        assert_differs(expect, unmatched, "TP-matched vs plain (the matching acts)")
    with pytest.raises(ValueError, match="before TP-matching"):
        T.install(stock)
    stock, fused, _ = models
    with torch.no_grad():
        expect = forward(stock, 2, 64, 7, backend=BACKEND)
        assert_bitwise(forward(fused, 2, 64, 7, backend=BACKEND), expect, "fused vs stock, batch-invariant")
    assert all(getattr(m, "processor", None) is None or m.processor._attention_backend == BACKEND
               for m in fused.modules() if hasattr(m, "set_processor"))


def test_zero_cond_t_keeps_diffusers_ops_where_its_modulation_is_per_token():
    """Qwen-Image-Edit-2511's `zero_cond_t` (which the engine refuses) picks one of two modulations per image token:
    there `_modulate` and the gated residual run diffusers' own ops; the text stream and q/k still take the
    Functions. The forward stays stock's bits."""
    stock, fused = tiny_model(lora=False, zero_cond_t=True), tiny_model(lora=False, zero_cond_t=True)
    T.install(fused)
    i = FAMILY.probe_inputs(transformer_config("tiny"), 2, 3, 64, BF16, 0, "cpu")
    # the Edit pipeline's image shapes: per sample the target's grid, then its condition images' (16 tokens)
    shapes = [[(1, 2, 2), (1, 2, 4), (1, 2, 2)]] * 2
    with torch.no_grad():
        out = [m(hidden_states=i["hidden_states"], encoder_hidden_states=i["cond"]["encoder_hidden_states"],
                 timestep=FAMILY.train.timestep(i["timestep"], BF16), img_shapes=shapes, return_dict=False)[0]
               for m in (stock, fused)]
    assert_bitwise(out[1], out[0], "zero_cond_t, fused vs stock")


def test_what_it_cannot_serve_is_refused_in_one_line(models, monkeypatch):
    _, fused, _ = models
    with pytest.raises(ValueError, match="installed on this model already"):
        T.install(fused)
    block = tiny_model(lora=False)
    from diffusers.models.attention_processor import AttnProcessor2_0

    block.transformer_blocks[1].attn.set_processor(AttnProcessor2_0())
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.attn: processor AttnProcessor2_0, not diffusers'"):
        T.install(block)
    assert not hasattr(block, "_trueflow_train_kernels") and "forward" not in vars(block.txt_norm), \
        "nothing swapped before the refusal"
    # diffusers' source of a copied method changed (here: the recorded hash of it)
    monkeypatch.setitem(T.SOURCES, "QwenImageTransformerBlock.forward",
                        (T.SOURCES["QwenImageTransformerBlock.forward"][0], "0" * 64))
    with pytest.raises(ValueError, match="changed QwenImageTransformerBlock.forward since trueflow's copy"):
        T.install(tiny_model(lora=False))
    for overrides, fix in (({"family": "sd3"}, "the sd3 family has no train kernels"),
                           ({"dtype": "fp32"}, "use --dtype bf16")):
        with pytest.raises(ValueError, match=fix):
            TrainConfig(train_kernels="fused", **overrides)


def test_the_copies_are_of_the_installed_diffusers_source():
    """Fails when the installed diffusers changes a method train_kernels.py copies or re-implements: read its new
    source, carry the change into the copy, then record the new hash in `SOURCES`."""
    assert T.changed_sources() == [], f"diffusers {__import__('diffusers').__version__}"


def test_a_train_run_on_them_is_bitwise_at_every_step(tiny_checkpoint, tmp_path):
    """`trueflow train` with `train_kernels: fused` (CPU: the reference forwards, the analytic backward): the
    train/rollout mismatch is 0.0 and the ratio 1 at both steps, the second after an update the Functions' gradients
    made, with no parity warning; the CPU is said once."""
    from trueflow.train.config import ParityConditionWarning
    from trueflow.train.metrics import read_metrics
    from trueflow.train.run import run_training

    cfg = TrainConfig(output_dir=str(tmp_path / "run"), checkpoint=str(tiny_checkpoint), train_kernels="fused",
                      num_rollouts=2, steps=2, num_sde_steps=1, rollout_batch_size=1, n_samples_per_prompt=2,
                      rollout_microgroup_size=2, micro_batch_size_sample=2, sample_every=0, save_every=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.simplefilter("error", ParityConditionWarning)
        run_training(cfg)
    notices = [w for w in seen if "--train-kernels fused" in str(w.message)]
    assert len(notices) == 1 and "this is cpu" in str(notices[0].message), [str(w.message) for w in notices]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["model_output_max_abs_diff"] == 0.0 and r["log_prob_max_abs_diff"] == 0.0, r
        assert r["ratio_mean"] == 1.0 and r["ratio_max_abs_dev_from_1"] == 0.0
        assert r["lora_update_norm"] > 0 and r["checksums_equal"]


# -- on a GPU (pytest -m gpu) ------------------------------------------------------------------------------------------
def cuda_kernels(fn) -> tuple[Counter, float]:
    """The CUDA kernels `fn()` launches, by name, and its time (ms, the median of 5 runs after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launched = Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return launched, sorted(times)[2]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.HAS_TRITON), reason="needs CUDA and triton")
def test_on_cuda_the_kernels_run_at_real_width_with_stock_bits(tiny_checkpoint, tmp_path):
    """One real-width block (24 x 128 heads, joint 3584) with a LoRA of rank 16, bf16, a microgroup of 2 at 512² with
    64 text tokens: the fused forward is stock's bitwise with the eager-exact kernels launched and fewer kernels in
    all, its LoRA gradients within 2^-5 of stock's in norm; the fused train side against the engine under the patch
    group is 0.0; and a tiny `trueflow train` run on CUDA is 0.0 at every step. Prints the kernel counts and times."""
    from trueflow.parity.probe import ParityProbe, ProbeSpec
    from trueflow.train.metrics import read_metrics
    from trueflow.train.run import run_training

    config = transformer_config("one_block")
    models = []
    for _ in range(2):
        model = build_transformer(config, seed=0, dtype=BF16, device="cuda")
        add_lora(model, LoraSpec(rank=16, target_modules=FAMILY.train.lora_targets), b_init_std=0.02, seed=1)
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_" in name)
        models.append(model)
    T.install(models[1])
    i = FAMILY.probe_inputs(config, 2, 64, 512, BF16, 0, "cuda")
    t = FAMILY.train.timestep(i["timestep"], BF16)

    def run(model, backward: bool):
        def step():
            out = train_forward(FAMILY, model, i["hidden_states"], t, i["grid"], i["cond"])
            if backward:
                model.zero_grad(set_to_none=True)
                out.float().square().mean().backward()
            return out
        return step

    outs = [run(m, True)().detach() for m in models]
    assert_bitwise(outs[1], outs[0], "fused vs stock, CUDA")
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in models]
    for name, g in grads[0].items():
        assert (grads[1][name].float() - g.float()).norm() <= 2**-5 * g.float().norm(), name
    report = {}
    for label, backward in (("forward", False), ("forward+backward", True)):
        (stock_k, stock_ms), (fused_k, fused_ms) = (cuda_kernels(run(m, backward)) for m in models)
        report[label] = (sum(stock_k.values()), stock_ms, sum(fused_k.values()), fused_ms)
        if not backward:
            eager = {k: n for k, n in fused_k.items() if "eager" in k or "_rms_tail" in k or "_square" in k}
            assert eager and sum(fused_k.values()) < sum(stock_k.values()), (eager, report)
            # txt_norm alone launches the tail kernel: the q/k chain's own launches (4 per block: both streams' q
            # and k) must be there too, which they are not when no complex-product variant matched (it then runs
            # the reference, with a warning, and the forward is still stock's bits).
            assert P.complex_fma(torch.device("cuda")) is not None, "the q/k kernels fell back to the reference"
            tail = sum(n for k, n in fused_k.items() if "_rms_tail" in k)
            assert tail >= 4 * len(models[1].transformer_blocks) + 1, (tail, fused_k)
    print("\n".join(f"{k}: stock {a} kernels {b:.2f} ms, fused {c} kernels {d:.2f} ms" for k, (a, b, c, d)
                    in report.items()))
    probe = ParityProbe(ProbeSpec(random_size="one_block", batch=2, text_len=64, resolution=512, lora_rank=16,
                                  device="cuda", layer_report="none"))
    T.install(probe.train)
    probe.set_inputs(probe.inputs)  # the train forward again, on the kernels
    assert probe.run("qwen_image")[0].bitwise_equal
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), checkpoint=str(tiny_checkpoint), train_kernels="fused",
                      device="cuda", num_rollouts=2, steps=2, num_sde_steps=1, rollout_batch_size=1,
                      n_samples_per_prompt=2, rollout_microgroup_size=2, micro_batch_size_sample=2, sample_every=0,
                      save_every=0)
    run_training(cfg)
    assert [r["model_output_max_abs_diff"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0.0, 0.0]
