"""Real architectures from tiny configs, for the farm's architectures matrix
(tests/integration/test_architectures.py, scripts/architectures.py).

Each row is one model family as its library builds it (``transformers``'
classes from a config, torchvision's ResNet, diffusers' UNet2DModel), with
random weights and nothing downloaded, wrapped so that its forward returns
one tensor (logits or the last hidden state: a ``ModelOutput`` with a KV
cache is another program than the forward pass served here). The wrapper's
weights are the library model's, under ``model.``.

A factory is ``tests.models.archs:build`` with ``{"arch": NAME}``: one
entrypoint, the row's name in its kwargs (what the job spec records).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB = 256  # every text model's vocabulary: ids 0..255
SEQ = 16


@dataclass(frozen=True)
class Arch:
    """One row of the matrix."""

    name: str
    family: str  # decoder-only, encoder-only, encoder-decoder, vision, audio, diffusion
    traits: str  # what about it the row covers (tied embeddings, ALiBi, GQA, ...)
    inputs: tuple[str, ...]
    factory: Callable[[], nn.Module]
    library: str = "transformers"  # the package that must import
    ci: bool = False  # in the default CI rows (FARM_TEST_ARCHS=all runs every row)
    # Formats torch cannot build for this family, with torch's own error
    # (filled in from a run; the test marks them xfail(strict=True)).
    fails: dict[str, str] = field(default_factory=dict)


class Output(nn.Module):
    """``model(*inputs)`` reduced to one tensor: ``.logits`` or
    ``.last_hidden_state`` of a transformers output (the first of them the
    output has), or the tensor itself."""

    def __init__(
        self, model: nn.Module, *, names: tuple[str, ...] = (), key: str = "", **call: Any
    ) -> None:
        super().__init__()
        self.model = model
        self.names = names  # keyword names of the inputs, in order ("" positional)
        self.key = key
        self.call = call  # constant keyword arguments (use_cache=False, return_dict=True)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.names:
            out = self.model(**dict(zip(self.names, inputs, strict=True)), **self.call)
        else:
            out = self.model(*inputs, **self.call)
        if isinstance(out, torch.Tensor):
            return out
        if self.key:
            return getattr(out, self.key)
        for key in ("logits", "last_hidden_state", "sample", "pooler_output"):
            value = getattr(out, key, None)
            if isinstance(value, torch.Tensor):
                return value
        raise TypeError(f"no tensor output in {type(out).__name__}")


def _tf() -> Any:
    import transformers

    return transformers


def _cfg(name: str, **fields: Any) -> Any:
    """A transformers config with sdpa attention where the class has it."""
    cls = getattr(_tf(), name)
    return cls(**fields)


def _ids(name: str = "input_ids") -> str:
    return f"int64[1,{SEQ}]{{0..{VOCAB - 1}}}"


def _lm(config_cls: str, model_cls: str, **fields: Any) -> nn.Module:
    config = _cfg(config_cls, vocab_size=VOCAB, use_cache=False, **fields)
    model = getattr(_tf(), model_cls)(config)
    return Output(model, names=("input_ids",), key="logits", use_cache=False)


def gpt2() -> nn.Module:
    return _lm(
        "GPT2Config",
        "GPT2LMHeadModel",
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )


def llama() -> nn.Module:
    return _lm(
        "LlamaConfig",
        "LlamaForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )


def qwen2() -> nn.Module:
    return _lm(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def mistral() -> nn.Module:
    return _lm(
        "MistralConfig",
        "MistralForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
        sliding_window=8,
    )


def phi3() -> nn.Module:
    return _lm(
        "Phi3Config",
        "Phi3ForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def gemma() -> nn.Module:
    return _lm(
        "GemmaConfig",
        "GemmaForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=64,
    )


def falcon() -> nn.Module:
    return _lm(
        "FalconConfig",
        "FalconForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        alibi=True,
        multi_query=True,
        new_decoder_architecture=False,
        parallel_attn=True,
        bias=False,
    )


def bloom() -> nn.Module:
    return _lm("BloomConfig", "BloomForCausalLM", hidden_size=32, n_layer=2, n_head=4)


def mixtral() -> nn.Module:
    return _lm(
        "MixtralConfig",
        "MixtralForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def gpt_neox() -> nn.Module:
    return _lm(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        rotary_pct=0.5,
    )


def opt() -> nn.Module:
    return _lm(
        "OPTConfig",
        "OPTForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
    )


def _encoder(config_cls: str, model_cls: str, **fields: Any) -> nn.Module:
    config = _cfg(config_cls, vocab_size=VOCAB, **fields)
    return Output(getattr(_tf(), model_cls)(config), names=("input_ids",), key="last_hidden_state")


_BERTISH = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


def bert() -> nn.Module:
    return _encoder("BertConfig", "BertModel", **_BERTISH)


def roberta() -> nn.Module:
    return _encoder("RobertaConfig", "RobertaModel", **_BERTISH, pad_token_id=1)


def distilbert() -> nn.Module:
    return _encoder(
        "DistilBertConfig",
        "DistilBertModel",
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
        max_position_embeddings=64,
    )


def electra() -> nn.Module:
    return _encoder("ElectraConfig", "ElectraModel", embedding_size=16, **_BERTISH)


_T5 = {
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "decoder_start_token_id": 0,
}


def t5_encoder() -> nn.Module:
    config = _cfg("T5Config", vocab_size=VOCAB, **_T5)
    return Output(_tf().T5EncoderModel(config), names=("input_ids",), key="last_hidden_state")


def t5() -> nn.Module:
    config = _cfg("T5Config", vocab_size=VOCAB, use_cache=False, **_T5)
    return Output(
        _tf().T5ForConditionalGeneration(config),
        names=("input_ids", "decoder_input_ids"),
        key="logits",
        use_cache=False,
    )


def bart() -> nn.Module:
    config = _cfg(
        "BartConfig",
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        use_cache=False,
    )
    return Output(
        _tf().BartForConditionalGeneration(config),
        names=("input_ids", "decoder_input_ids"),
        key="logits",
        use_cache=False,
    )


_IMAGE = "float32[1,3,32,32]"


def vit() -> nn.Module:
    config = _cfg(
        "ViTConfig",
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    return Output(
        _tf().ViTModel(config, add_pooling_layer=False),
        names=("pixel_values",),
        key="last_hidden_state",
    )


def deit() -> nn.Module:
    config = _cfg(
        "DeiTConfig",
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    return Output(
        _tf().DeiTModel(config, add_pooling_layer=False),
        names=("pixel_values",),
        key="last_hidden_state",
    )


def convnext() -> nn.Module:
    config = _cfg(
        "ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32
    )
    return Output(_tf().ConvNextModel(config), names=("pixel_values",), key="last_hidden_state")


def resnet() -> nn.Module:
    config = _cfg(
        "ResNetConfig", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"
    )
    return Output(_tf().ResNetModel(config), names=("pixel_values",), key="last_hidden_state")


def wav2vec2() -> nn.Module:
    config = _cfg(
        "Wav2Vec2Config",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        vocab_size=32,
    )
    return Output(_tf().Wav2Vec2Model(config), names=("input_values",), key="last_hidden_state")


def whisper_encoder() -> nn.Module:
    config = _cfg(
        "WhisperConfig",
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=4,
        decoder_layers=1,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    encoder = _tf().WhisperModel(config).get_encoder()
    return Output(encoder, names=("input_features",), key="last_hidden_state")


def torchvision_resnet() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def diffusers_unet() -> nn.Module:
    from diffusers import UNet2DModel

    unet = UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(16, 32),
        norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    return Output(unet, key="sample")


# torch's own errors for the formats it cannot build (Arch.fails).
PARAMETRIZED_PICKLE = "Serialization of parametrized modules is only supported through state_dict()"
# Dynamo cannot trace an index by a Python list on meta tensors, which the
# farm's trace step runs the model on (torch 2.13: ``x[..., [-2], :]``, in
# Falcon's multi-query _split_heads, makes a real index tensor inside fake
# tensor mode). Past that, an AOTI package would still fail the farm's own
# check (farm.build.aoti_compile): torch.export lifts that index into a
# constant a package built without its weights cannot carry.
META_LIST_INDEX = "Please convert all Tensors to FakeTensors first"

_TEXT = (_ids(),)
_SEQ2SEQ = (_ids(), f"int64[1,8]{{0..{VOCAB - 1}}}")

ARCHS: tuple[Arch, ...] = (
    Arch(
        "gpt2",
        "decoder-only",
        "tied embeddings (lm_head = wte), learned positions",
        _TEXT,
        gpt2,
        ci=True,
    ),
    Arch("llama", "decoder-only", "RoPE, grouped-query attention, RMSNorm, SwiGLU", _TEXT, llama),
    Arch("qwen2", "decoder-only", "RoPE, GQA, qkv bias, tied embeddings", _TEXT, qwen2),
    Arch("mistral", "decoder-only", "RoPE, GQA (one KV head), sliding window", _TEXT, mistral),
    Arch("phi3", "decoder-only", "RoPE, fused qkv and gate_up projections", _TEXT, phi3),
    Arch(
        "gemma",
        "decoder-only",
        "RoPE, multi-query, tied embeddings, scaled embedding",
        _TEXT,
        gemma,
    ),
    Arch(
        "falcon",
        "decoder-only",
        "ALiBi, multi-query attention, parallel attention/MLP",
        _TEXT,
        falcon,
        fails={"aot_compile": META_LIST_INDEX, "aoti": META_LIST_INDEX},
    ),
    Arch("bloom", "decoder-only", "ALiBi, tied embeddings, embedding LayerNorm", _TEXT, bloom),
    Arch(
        "mixtral",
        "decoder-only",
        "mixture of experts (4 experts, top-2), RoPE, GQA",
        _TEXT,
        mixtral,
    ),
    Arch(
        "gpt_neox",
        "decoder-only",
        "partial rotary (half the head dims), parallel residual",
        _TEXT,
        gpt_neox,
    ),
    Arch("opt", "decoder-only", "learned positions with an offset, tied embeddings", _TEXT, opt),
    Arch(
        "bert",
        "encoder-only",
        "absolute positions (position_ids buffer), token types",
        _TEXT,
        bert,
        ci=True,
    ),
    Arch(
        "roberta", "encoder-only", "positions from the input ids (padding offset)", _TEXT, roberta
    ),
    Arch(
        "distilbert",
        "encoder-only",
        "no token types, sinusoidal-free learned positions",
        _TEXT,
        distilbert,
    ),
    Arch("electra", "encoder-only", "embedding projection (16 -> 32)", _TEXT, electra),
    Arch(
        "t5_encoder",
        "encoder-decoder (encoder)",
        "relative position buckets, embedding shared with the parent (encoder.embed_tokens)",
        _TEXT,
        t5_encoder,
        ci=True,
    ),
    Arch(
        "t5",
        "encoder-decoder",
        "whole model: encoder, decoder, tied shared embedding",
        _SEQ2SEQ,
        t5,
    ),
    Arch(
        "bart", "encoder-decoder", "whole model, learned positions, tied embeddings", _SEQ2SEQ, bart
    ),
    Arch("vit", "vision transformer", "patch embedding, CLS token", (_IMAGE,), vit),
    Arch("deit", "vision transformer", "CLS and distillation tokens", (_IMAGE,), deit),
    Arch(
        "convnext",
        "convolutional vision",
        "depthwise convs, LayerNorm, layer scale",
        (_IMAGE,),
        convnext,
    ),
    Arch(
        "resnet",
        "convolutional vision",
        "transformers' ResNet: BatchNorm, residuals",
        (_IMAGE,),
        resnet,
    ),
    Arch(
        "wav2vec2",
        "audio encoder",
        "conv feature encoder, weight_norm positional conv (a parametrization)",
        ("float32[1,1600]",),
        wav2vec2,
        fails={
            # Dynamo pickles the guards' state, and a parametrized module
            # refuses to be pickled (torch.nn.utils.parametrize). The AOTI
            # package (torch.export) builds and matches.
            "aot_compile": PARAMETRIZED_PICKLE,
        },
    ),
    Arch(
        "whisper_encoder",
        "audio encoder",
        "log-mel conv stem, sinusoidal positions",
        ("float32[1,8,32]",),
        whisper_encoder,
    ),
    Arch(
        "torchvision_resnet",
        "convolutional vision",
        "torchvision's resnet18",
        (_IMAGE,),
        torchvision_resnet,
        library="torchvision",
    ),
    Arch(
        "diffusers_unet",
        "diffusion",
        "diffusers' UNet2DModel with attention blocks, timestep embedding",
        ("float32[1,3,16,16]", "int64[1]{0..999}"),
        diffusers_unet,
        library="diffusers",
    ),
)

BY_NAME = {a.name: a for a in ARCHS}


def unavailable(arch: Arch) -> str | None:
    """Why this row cannot run here (its library does not import), or None."""
    if importlib.util.find_spec(arch.library) is None:
        return f"{arch.library} is not installed"
    if arch.library == "torchvision":
        try:
            import torchvision  # noqa: F401
        except Exception as exc:  # installed for another torch, say
            return f"torchvision does not import: {type(exc).__name__}: {exc}"
    return None


def build(arch: str) -> nn.Module:
    """The row's model (the job's entrypoint: ``tests.models.archs:build``)."""
    if arch not in BY_NAME:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[arch].factory()


class ParametrizedConv(nn.Module):
    """A conv under torch's weight_norm parametrization (wav2vec2's positional
    conv, in small): Dynamo cannot pickle it into an aot_compile artifact's
    guards, torch.export packages it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1), dim=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


def parametrized_conv() -> nn.Module:
    return ParametrizedConv()
