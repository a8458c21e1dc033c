#!/usr/bin/env python3
"""Reference-fixture generator for calla (Qwen3.6-35B-A3B, transformers `qwen3_5_moe`).

Builds tiny, randomly initialised models with transformers' own classes
(`Qwen3_5MoeTextConfig` / `Qwen3_5MoeForCausalLM`, attn_implementation="eager",
float32 compute, the pure-torch Gated DeltaNet / causal-conv fallbacks) and writes, per
fixture folder: config.json, generation_config.json, the weights, references.safetensors
and references.json.

    python scripts/make_fixtures.py --out testdata/fixtures [--only NAME] [--list]

Fixtures (see FIXTURES below and scripts/README-fixtures.md):

  tiny-a-check  re-creates the handed-over fixture tiny-a from its recipe and compares the
                weights (sha256) and every reference array with --compare-to (default
                /work/shared/fixtures/tiny-a).  Not written by default; use --only.
  tiny-b        the PUBLISHED checkpoint layout: nested multimodal config.json,
                model.language_model.* names, fused 3-D experts, 3 shards + index, extra
                model.visual.* and mtp.* tensors.
  tiny-c        flat text-only layout, float16 + float32 tensors, per-expert names, tied
                embeddings, 4 layers, all experts routed (top-4 of 4).

Set up the environment with scripts/requirements-fixtures.txt (see README-fixtures.md).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import shutil
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import safetensors  # noqa: E402
from safetensors.torch import save_file, load_file  # noqa: E402
import transformers  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qmod  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

NUM_THREADS = 2
# transformers' plain per-expert loop (Qwen3_5MoeExperts.forward); the library default on CPU is "grouped_mm",
# which differs only by float32 summation order (~1e-6 on the logits).
EXPERTS_IMPL = "eager"
GENERATOR = "scripts/make_fixtures.py"

# --------------------------------------------------------------------------------------
# Fixture definitions
# --------------------------------------------------------------------------------------

TINY_A_TEXT = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                         mrope_section=[3, 3, 2], mrope_interleaved=True),
)

TINY_B_TEXT = dict(
    vocab_size=384, hidden_size=64, num_hidden_layers=8,              # layer_types from full_attention_interval 4
    # (hidden 64 rather than 96 and moe_intermediate 20 rather than 40 keep the folder near 3 MB)
    num_attention_heads=6, num_key_value_heads=1, head_dim=32,        # GQA group 6, q_proj out 6*32*2 = 384
    linear_num_key_heads=2, linear_num_value_heads=6,                 # v/k head ratio 3
    linear_key_head_dim=16, linear_value_head_dim=24,                 # dk != dv
    linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=24,
    max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.5,   # rotary dim 16
                         mrope_section=[3, 3, 2], mrope_interleaved=True),
)

TINY_B_VISION = dict(
    depth=1, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2,
    in_channels=3, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
    out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[],
)

TINY_C_TEXT = dict(
    vocab_size=320, hidden_size=80, num_hidden_layers=4,              # lin, lin, lin, full
    num_attention_heads=4, num_key_value_heads=2, head_dim=48,
    linear_num_key_heads=2, linear_num_value_heads=4,                 # ratio 2
    linear_key_head_dim=24, linear_value_head_dim=16,                 # dk > dv
    linear_conv_kernel_dim=4,
    num_experts=4, num_experts_per_tok=4, moe_intermediate_size=36, shared_expert_intermediate_size=28,
    max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,  # rotary dim 12
                         mrope_section=[2, 2, 2], mrope_interleaved=True),
)

FIXTURES = {
    "tiny-a-check": dict(
        description="re-creation of the handed-over fixture tiny-a from its recipe (for checking this script)",
        seed=1, text=TINY_A_TEXT, layout="flat", storage="bf16",
        prompt_lengths=[1, 5, 17, 64, 65, 130], split_at=[None, 2, 8, 32, 32, 67], new_tokens=24,
        debug_prompt=4, min_greedy_margin=0.0, default=False, compare_to="/work/shared/fixtures/tiny-a",
    ),
    "tiny-b": dict(
        description="published Qwen3.6-35B-A3B checkpoint layout: nested multimodal config, "
                    "model.language_model.* names, fused 3-D experts, 3 safetensors shards + index, "
                    "extra model.visual.* and mtp.* tensors; dimensions unlike tiny-a",
        seed=2, text=TINY_B_TEXT, vision=TINY_B_VISION, layout="published", storage="bf16",
        prompt_lengths=[1, 7, 63, 64, 65, 130], split_at=[None, 3, 32, 63, 64, 70], new_tokens=12,
        debug_prompt=None, min_greedy_margin=1e-3, default=True, num_shards=3,
    ),
    "tiny-c": dict(
        description="flat text-only layout, float16 + float32 tensors, per-expert names, tied embeddings "
                    "(no lm_head tensor), 4 layers, all 4 experts routed",
        seed=3, text=TINY_C_TEXT, layout="flat", storage="f16-f32",
        # with tied embeddings and std 0.02 everywhere the residual stream is dominated by the current token's
        # embedding and greedy decoding just repeats the last prompt token; std 0.06 for the matrices other than
        # embed_tokens makes the layers matter (decoding is then varied)
        matrix_std=0.06,
        prompt_lengths=[1, 7, 63, 64, 65, 130], split_at=[None, 4, 40, 31, 64, 66], new_tokens=16,
        debug_prompt=4, min_greedy_margin=1e-3, default=True,
    ),
}

# --------------------------------------------------------------------------------------
# Weight recipe
# --------------------------------------------------------------------------------------

INIT_DOC = {
    "rng": "numpy.random.RandomState (legacy, frozen stream) seeded per tensor with the first 4 bytes "
           "(big-endian) of sha256('<fixture seed>/<parameter name>'); the draw has the parameter's shape, "
           "in float64",
    "matrices": "normal(0, 0.02) for embed_tokens, lm_head, all *_proj / in_proj_* / out_proj weights, "
                "experts.gate_up_proj, experts.down_proj, mlp.gate.weight (router), shared_expert_gate.weight "
                "(and every extra model.visual.* / mtp.* tensor that is not a norm)",
    "zero_centred_rmsnorm": "weight ~ normal(0, 0.05) for input_layernorm, post_attention_layernorm, model.norm, "
                            "self_attn.q_norm, self_attn.k_norm (these norms multiply by 1 + weight); also mtp.* norms",
    "gated_rmsnorm": "linear_attn.norm.weight ~ 1 + normal(0, 0.05) (plain weight)",
    "conv1d": "linear_attn.conv1d.weight ~ uniform(-0.5, 0.5) (no bias)",
    "A_log": "log(uniform(1.0, 16.0)) per value head",
    "dt_bias": "inverse softplus of dt, dt = exp(uniform(log 0.001, log 0.1)) per value head: "
               "dt + log(-expm1(-dt)) (the FLA / Mamba initialisation)",
}


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "big")


def init_kind(name: str) -> str:
    if name.endswith("A_log"):
        return "A_log"
    if name.endswith("dt_bias"):
        return "dt_bias"
    if name.endswith("conv1d.weight"):
        return "conv"
    if name.endswith("linear_attn.norm.weight"):
        return "gated_norm"
    if ".visual." not in name and name.endswith("norm.weight") or name.endswith(("q_norm.weight", "k_norm.weight")):
        return "zc_norm"
    if ".visual." not in name and ("norm_embedding" in name or "norm_hidden" in name):
        return "zc_norm"
    return "normal"


def draw(seed: int, name: str, shape, matrix_std: float = 0.02) -> np.ndarray:
    """float64 draw for one tensor, by the recipe.  `matrix_std` replaces 0.02 for the matrices other than
    embed_tokens / lm_head (tiny-c only, see FIXTURES)."""
    rs = np.random.RandomState(tensor_seed(seed, name))
    kind = init_kind(name)
    shape = tuple(int(s) for s in shape)
    if kind == "normal":
        std = 0.02 if name.endswith(("embed_tokens.weight", "lm_head.weight")) else matrix_std
        return rs.normal(0.0, std, size=shape)
    if kind == "zc_norm":
        return rs.normal(0.0, 0.05, size=shape)
    if kind == "gated_norm":
        return 1.0 + rs.normal(0.0, 0.05, size=shape)
    if kind == "conv":
        return rs.uniform(-0.5, 0.5, size=shape)
    if kind == "A_log":
        return np.log(rs.uniform(1.0, 16.0, size=shape))
    if kind == "dt_bias":
        dt = np.exp(rs.uniform(np.log(1e-3), np.log(1e-1), size=shape))
        return dt + np.log(-np.expm1(-dt))
    raise AssertionError(kind)


def to_storage(x64: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Round a float64 draw to the storage dtype: via float32, then (bf16/f16) round-to-nearest-even."""
    t = torch.from_numpy(np.ascontiguousarray(x64.astype(np.float32)))
    return t.to(dtype).contiguous()


def tiny_c_dtype(name: str) -> torch.dtype:
    """tiny-c storage dtypes: float32 for all norms, A_log, dt_bias and the router; float16 otherwise."""
    if name.endswith(("norm.weight", "A_log", "dt_bias", "mlp.gate.weight")):
        return torch.float32
    return torch.float16


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

def save_tensors(tensors: dict, path: str):
    """safetensors with the metadata transformers writes ({"format": "pt"}); tensors are sorted by the library."""
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


DT_NAME = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32"}


def content_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """Layout-independent content hash: over tensors sorted by name, 'name\\0DTYPE\\0[shape]\\0' + raw LE bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{DT_NAME[t.dtype]}\0{list(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes())
    return h.hexdigest()


def build_text_config(text_kwargs: dict) -> Qwen3_5MoeTextConfig:
    cfg = Qwen3_5MoeTextConfig(**copy.deepcopy(text_kwargs))
    return cfg


def new_causal_lm(cfg: Qwen3_5MoeTextConfig) -> Qwen3_5MoeForCausalLM:
    cfg = copy.deepcopy(cfg)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    model.set_experts_implementation(EXPERTS_IMPL)
    model.eval()
    return model


def check_fallback_kernels() -> dict:
    """Make sure the GDN / conv paths are transformers' pure-torch fallbacks."""
    names = ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update"]
    out = {}
    for n in names:
        fn = getattr(qmod, n)
        out[n] = f"{fn.__module__}.{getattr(fn, '__qualname__', n)}"
    try:
        import fla  # noqa: F401
        fla_ok = True
    except Exception:
        fla_ok = False
    try:
        import causal_conv1d  # noqa: F401
        cc_ok = True
    except Exception:
        cc_ok = False
    try:
        import kernels  # noqa: F401
        kernels_ok = True
    except Exception:
        kernels_ok = False
    if fla_ok or cc_ok:
        raise SystemExit("flash-linear-attention / causal-conv1d are installed; uninstall them for the reference")
    out["fla_installed"] = fla_ok
    out["causal_conv1d_installed"] = cc_ok
    out["kernels_installed"] = kernels_ok
    return out


# --------------------------------------------------------------------------------------
# Weights: make, store
# --------------------------------------------------------------------------------------

def make_weights(spec: dict, model: Qwen3_5MoeForCausalLM):
    """Fill `model` (float32) by the recipe.  Returns {stored name: storage tensor} and the seed-name map.

    Seed names: tiny-a-check / tiny-c use the in-memory Qwen3_5MoeForCausalLM names (model.layers.*, fused
    experts).  tiny-b uses the names as stored in its checkpoint (= Qwen3_5MoeForConditionalGeneration's
    in-memory names, model.language_model.*, fused experts).
    """
    seed = spec["seed"]
    layout = spec["layout"]
    stored: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if layout == "published":
                seed_name = "lm_head.weight" if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1)
            else:
                seed_name = name
            dtype = tiny_c_dtype(name) if spec["storage"] == "f16-f32" else torch.bfloat16
            x = to_storage(draw(seed, seed_name, p.shape, spec.get("matrix_std", 0.02)), dtype)
            p.copy_(x.to(torch.float32))  # exact upcast
            if layout == "published":
                stored[seed_name] = x
            else:
                if ".mlp.experts.gate_up_proj" in name:
                    pre = name[: -len("gate_up_proj")]
                    inter = x.shape[1] // 2
                    for j in range(x.shape[0]):
                        stored[f"{pre}{j}.gate_proj.weight"] = x[j, :inter].clone()
                        stored[f"{pre}{j}.up_proj.weight"] = x[j, inter:].clone()
                elif ".mlp.experts.down_proj" in name:
                    pre = name[: -len("down_proj")]
                    for j in range(x.shape[0]):
                        stored[f"{pre}{j}.down_proj.weight"] = x[j].clone()
                else:
                    stored[name] = x
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert "lm_head.weight" not in stored
    return stored


def published_extras(spec: dict, text_cfg: Qwen3_5MoeTextConfig):
    """Extra tensors of the published checkpoint that a text engine must skip: the whole (tiny) vision tower,
    with Qwen3_5MoeForConditionalGeneration's names and shapes, and a few mtp.* tensors."""
    seed = spec["seed"]
    full_cfg = make_published_config_obj(spec)
    with torch.device("meta"):
        cg = Qwen3_5MoeForConditionalGeneration(full_cfg)
    extras = {}
    for name, p in cg.named_parameters():
        if name.startswith("model.visual."):
            extras[name] = to_storage(draw(seed, name, p.shape), torch.bfloat16)
    h = text_cfg.hidden_size
    e = text_cfg.num_experts
    hd = text_cfg.head_dim
    mtp_shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.mlp.gate.weight": (e, h),
        "mtp.layers.0.mlp.shared_expert_gate.weight": (1, h),
    }
    for name, shape in mtp_shapes.items():
        extras[name] = to_storage(draw(seed, name, shape), torch.bfloat16)
    return extras


def make_published_config_obj(spec: dict) -> Qwen3_5MoeConfig:
    text = copy.deepcopy(spec["text"])
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=copy.deepcopy(spec["vision"]),
                           tie_word_embeddings=text["tie_word_embeddings"])
    return cfg


def published_config_json(spec: dict, text_cfg: Qwen3_5MoeTextConfig) -> dict:
    """config.json in the published nested form (key set as in Qwen/Qwen3.6-35B-A3B's config.json)."""
    t = spec["text"]
    rope = t["rope_parameters"]
    text_config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "eos_token_id": None,
        "full_attention_interval": 4,
        "head_dim": t["head_dim"],
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "initializer_range": 0.02,
        "layer_types": list(text_cfg.layer_types),
        "linear_conv_kernel_dim": t["linear_conv_kernel_dim"],
        "linear_key_head_dim": t["linear_key_head_dim"],
        "linear_num_key_heads": t["linear_num_key_heads"],
        "linear_num_value_heads": t["linear_num_value_heads"],
        "linear_value_head_dim": t["linear_value_head_dim"],
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": t["max_position_embeddings"],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": t["moe_intermediate_size"],
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": t["num_attention_heads"],
        "num_experts": t["num_experts"],
        "num_experts_per_tok": t["num_experts_per_tok"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_key_value_heads": t["num_key_value_heads"],
        "output_router_logits": False,
        "pad_token_id": None,
        "partial_rotary_factor": rope["partial_rotary_factor"],
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_parameters": {
            "mrope_interleaved": rope["mrope_interleaved"],
            "mrope_section": list(rope["mrope_section"]),
            "partial_rotary_factor": rope["partial_rotary_factor"],
            "rope_theta": int(rope["rope_theta"]),
            "rope_type": rope["rope_type"],
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": t["shared_expert_intermediate_size"],
        "tie_word_embeddings": t["tie_word_embeddings"],
        "use_cache": True,
        "vocab_size": t["vocab_size"],
    }
    v = spec["vision"]
    vision_config = {
        "deepstack_visual_indexes": list(v["deepstack_visual_indexes"]),
        "depth": v["depth"],
        "dtype": "bfloat16",
        "hidden_act": v["hidden_act"],
        "hidden_size": v["hidden_size"],
        "in_channels": v["in_channels"],
        "initializer_range": 0.02,
        "intermediate_size": v["intermediate_size"],
        "model_type": "qwen3_5_moe_vision",
        "num_heads": v["num_heads"],
        "num_position_embeddings": v["num_position_embeddings"],
        "out_hidden_size": v["out_hidden_size"],
        "patch_size": v["patch_size"],
        "spatial_merge_size": v["spatial_merge_size"],
        "temporal_patch_size": v["temporal_patch_size"],
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "dtype": "bfloat16",
        "image_token_id": 248056,
        "model_type": "qwen3_5_moe",
        "text_config": text_config,
        "tie_word_embeddings": t["tie_word_embeddings"],
        "transformers_version": transformers.__version__,
        "video_token_id": 248057,
        "vision_config": vision_config,
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


def write_flat(spec, folder, cfg, stored):
    """Flat text-only layout (as Qwen3_5MoeForCausalLM.save_pretrained writes it): config.json,
    generation_config.json, model.safetensors."""
    c = copy.deepcopy(cfg)
    c.architectures = ["Qwen3_5MoeForCausalLM"]
    c.dtype = torch.bfloat16 if spec["storage"] == "bf16" else torch.float16
    c.save_pretrained(folder)
    GenerationConfig.from_model_config(c).save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    save_tensors(stored, path)
    with open(os.path.join(folder, "config.json")) as f:
        config_json = json.load(f)
    files = [{"file": "model.safetensors", "sha256": sha256_file(path), "bytes": os.path.getsize(path),
              "tensors": len(stored)}]
    return config_json, files


def write_published(spec, folder, cfg, stored, extras):
    """Published layout: nested config.json, 3 shards (in module order, split by size, so a layer may straddle
    two shards) + model.safetensors.index.json."""
    config_json = published_config_json(spec, cfg)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2, sort_keys=False)
        f.write("\n")
    gen = GenerationConfig.from_model_config(make_published_config_obj(spec).get_text_config())
    gen.save_pretrained(folder)
    # module order, like a state_dict: embed, layers (in order), norm, visual, lm_head, mtp
    names = list(stored) + list(extras)
    allt = {**stored, **extras}

    def order_key(n):
        if n.startswith("model.language_model.embed_tokens"):
            return (0, 0, n)
        if n.startswith("model.language_model.layers."):
            return (1, int(n.split(".")[3]), n)
        if n.startswith("model.language_model.norm"):
            return (2, 0, n)
        if n.startswith("model.visual."):
            return (3, 0, n)
        if n == "lm_head.weight":
            return (4, 0, n)
        return (5, 0, n)

    names.sort(key=order_key)
    total = sum(allt[n].numel() * allt[n].element_size() for n in names)
    k = spec["num_shards"]
    shards = [[] for _ in range(k)]
    acc = 0
    for n in names:
        idx = min(k - 1, int(acc * k // total))
        shards[idx].append(n)
        acc += allt[n].numel() * allt[n].element_size()
    weight_map = {}
    files = []
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{k:05d}.safetensors"
        path = os.path.join(folder, fname)
        save_tensors({n: allt[n] for n in sh}, path)
        for n in sh:
            weight_map[n] = fname
        files.append({"file": fname, "sha256": sha256_file(path), "bytes": os.path.getsize(path),
                      "tensors": len(sh)})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    ipath = os.path.join(folder, "model.safetensors.index.json")
    with open(ipath, "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    files.append({"file": "model.safetensors.index.json", "sha256": sha256_file(ipath),
                  "bytes": os.path.getsize(ipath)})
    return config_json, files


# --------------------------------------------------------------------------------------
# Oracle runs
# --------------------------------------------------------------------------------------

def argmax_first(row: np.ndarray) -> int:
    return int(np.argmax(row))  # numpy returns the first index on ties


def top2_margin(row: np.ndarray) -> float:
    s = np.sort(row.astype(np.float64))
    return float(s[-1] - s[-2])


@torch.no_grad()
def forward_nocache(model, ids, router=True):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False,
                output_router_logits=router)
    logits = out.logits[0].float().numpy().copy()
    rl = np.stack([r.float().numpy() for r in out.router_logits]) if router else None  # [layers, T, E]
    return logits, rl


@torch.no_grad()
def cached_greedy(model, ids, new_tokens):
    """Cached prefill then single-token cached decode steps.  Returns prefill logits [L,V], gen logits [G,V],
    gen ids [G], router logits of the decode steps [layers, G-1, E] and the prefill router logits."""
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True, output_router_logits=True)
    cache = out.cache
    prefill = out.logits[0].float().numpy().copy()
    prefill_rl = np.stack([r.float().numpy() for r in out.router_logits])
    rows = [prefill[-1]]
    gen = [argmax_first(rows[0])]
    step_rl = []
    for t in range(1, new_tokens):
        out = model(input_ids=torch.tensor([[gen[-1]]], dtype=torch.long), cache=cache, use_cache=True,
                    output_router_logits=True)
        cache = out.cache
        row = out.logits[0, -1].float().numpy().copy()
        rows.append(row)
        gen.append(argmax_first(row))
        step_rl.append(np.stack([r.float().numpy() for r in out.router_logits]))  # [layers, 1, E]
    step_rl = np.concatenate(step_rl, axis=1) if step_rl else None
    return prefill, np.stack(rows), gen, prefill_rl, step_rl


@torch.no_grad()
def two_piece(model, ids, split_at):
    a = model(input_ids=torch.tensor([ids[:split_at]], dtype=torch.long), use_cache=True, output_router_logits=True)
    b = model(input_ids=torch.tensor([ids[split_at:]], dtype=torch.long), cache=a.cache, use_cache=True,
              output_router_logits=True)
    logits = np.concatenate([a.logits[0].float().numpy(), b.logits[0].float().numpy()], axis=0)
    rl = np.concatenate([np.stack([r.float().numpy() for r in a.router_logits]),
                         np.stack([r.float().numpy() for r in b.router_logits])], axis=1)
    return logits, rl


@torch.no_grad()
def hf_generate(model, ids, new_tokens):
    # no pad_token_id: generate() would otherwise treat prompt tokens equal to it as padding
    gc = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, output_logits=True,
                          return_dict_in_generate=True)
    x = torch.tensor([ids], dtype=torch.long)
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
    seq = out.sequences[0, len(ids):].tolist()
    logits = np.stack([x[0].float().numpy() for x in out.logits])
    return seq, logits


def kth_gaps(rl: np.ndarray, k: int):
    """Gap between the k-th and (k+1)-th router logit for every (layer, position); None if k == E."""
    e = rl.shape[-1]
    if k >= e:
        return None
    s = -np.sort(-rl.astype(np.float64), axis=-1)
    return s[..., k - 1] - s[..., k]


def prompt_ids_for(seed, i, length, attempt, vocab):
    key = f"{seed}/prompt/{i}/{length}" + (f"/{attempt}" if attempt else "")
    rs = np.random.RandomState(int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big"))
    return [int(x) for x in rs.randint(0, vocab, size=length)]


def evaluate_prompt(model, cfg, ids, new_tokens, split_at, min_greedy_margin):
    L = len(ids)
    k = cfg.num_experts_per_tok
    prompt_logits, prompt_rl = forward_nocache(model, ids)
    prefill, gen_logits, gen_ids, prefill_rl, step_rl = cached_greedy(model, ids, new_tokens)
    seq_ids = list(ids) + gen_ids
    seq_logits, seq_rl = forward_nocache(model, seq_ids)
    g_ids, g_logits = hf_generate(model, ids, new_tokens)
    if split_at is not None:
        split_logits, split_rl = two_piece(model, ids, split_at)
        split_diff = float(np.abs(split_logits - prompt_logits).max())
        split_rdiff = float(np.abs(split_rl - prompt_rl).max())
    else:
        split_logits = prefill.copy()   # one piece; the array is still written
        split_diff, split_rdiff, split_rl = None, None, None
    seq_rows = seq_logits[L - 1: L - 1 + new_tokens]
    dec_vs_full = float(np.abs(gen_logits - seq_rows).max())
    dec_vs_full_steps = float(np.abs(gen_logits[1:] - seq_rows[1:]).max()) if new_tokens > 1 else 0.0
    prefill_vs_nocache = float(np.abs(prefill - prompt_logits).max())
    prompt_vs_seq_prefix = float(np.abs(prompt_logits - seq_logits[:L]).max())
    gen_vs_loop = float(np.abs(g_logits - gen_logits).max())
    # router: decode steps vs the one-shot forward over seq_ids (positions L .. L+G-2)
    r_noise = 0.0
    if step_rl is not None:
        r_noise = float(np.abs(step_rl - seq_rl[:, L: L + new_tokens - 1]).max())
    r_noise = max(r_noise, float(np.abs(prefill_rl - seq_rl[:, :L]).max()),
                  float(np.abs(prompt_rl - seq_rl[:, :L]).max()))
    if split_rdiff is not None:
        r_noise = max(r_noise, split_rdiff)
    logit_noise = max(dec_vs_full, prefill_vs_nocache, prompt_vs_seq_prefix, split_diff or 0.0)
    greedy_margins = [min(top2_margin(gen_logits[t]), top2_margin(seq_rows[t])) for t in range(new_tokens)]
    greedy_full = [argmax_first(seq_rows[t]) for t in range(new_tokens)]
    gaps = []
    for rl in (seq_rl, prefill_rl, step_rl, split_rl):
        if rl is not None:
            g = kth_gaps(rl, k)
            if g is not None:
                gaps.append(g.min())
    router_gap_min = float(min(gaps)) if gaps else None
    logits_abs_max = float(max(np.abs(seq_logits).max(), np.abs(gen_logits).max()))
    router_scale = float(np.abs(seq_rl).max())
    greedy_required = max(min_greedy_margin, 10 * logit_noise, 1e-6 * logits_abs_max)
    router_required = max(10 * r_noise, 1e-6 * router_scale)
    robust_greedy = min(greedy_margins) >= greedy_required
    robust_router = router_gap_min is None or router_gap_min >= router_required
    robust = bool(robust_greedy and robust_router and g_ids == gen_ids and greedy_full == gen_ids)
    score_terms = [min(greedy_margins) / greedy_required]
    if router_gap_min is not None:
        score_terms.append(router_gap_min / router_required)
    checks = {
        "prefill_with_cache_vs_no_cache_max_abs": prefill_vs_nocache,
        "decode_vs_full_forward_max_abs": dec_vs_full,
        "decode_vs_full_forward_max_abs_cached_steps_only": dec_vs_full_steps,
        "decode_vs_full_forward_max_abs_last_step": float(np.abs(gen_logits[-1] - seq_rows[-1]).max()),
        "generate_ids_equal_loop": g_ids == gen_ids,
        "generate_vs_loop_logits_max_abs": gen_vs_loop,
        "greedy_ids_equal_full_forward_argmax": greedy_full == gen_ids,
        "prompt_logits_vs_seq_logits_prefix_max_abs": prompt_vs_seq_prefix,
        "two_piece_prefill_split_at": split_at,
        "two_piece_prefill_vs_one_shot_max_abs": split_diff,
        "router_logits_decode_vs_full_forward_max_abs": r_noise,
        "logits_abs_max": logits_abs_max,
    }
    robustness = {
        "router_kth_gap_min": router_gap_min,
        "router_gap_note": None if router_gap_min is not None else
        "num_experts_per_tok == num_experts: every expert is selected, there is no routing decision",
        "router_logit_noise": r_noise,
        "greedy_top2_margin_min": float(min(greedy_margins)),
        "greedy_top2_margins": [float(m) for m in greedy_margins],
        "logit_noise": logit_noise,
        "router_gap_required": router_required if router_gap_min is not None else None,
        "greedy_margin_required": greedy_required,
        "robust": robust,
        "robust_score": float(min(score_terms)),
    }
    arrays = {
        "prompt_ids": np.asarray(ids, dtype=np.int32),
        "prompt_logits": prompt_logits.astype(np.float32),
        "gen_ids": np.asarray(gen_ids, dtype=np.int32),
        "gen_logits": gen_logits.astype(np.float32),
        "seq_ids": np.asarray(seq_ids, dtype=np.int32),
        "seq_logits": seq_logits.astype(np.float32),
        "split_logits": split_logits.astype(np.float32),
    }
    return arrays, checks, robustness, gen_ids, router_scale


@torch.no_grad()
def debug_arrays(model, cfg, ids):
    n = cfg.num_hidden_layers
    mixer, moe, rlog, rw, ridx = [None] * n, [None] * n, [None] * n, [None] * n, [None] * n
    last = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        mix_mod = layer.linear_attn if cfg.layer_types[i] == "linear_attention" else layer.self_attn

        def mix_hook(mod, inp, out, i=i):
            mixer[i] = (out[0] if isinstance(out, tuple) else out)[0].float().numpy().copy()

        def moe_hook(mod, inp, out, i=i):
            moe[i] = (out[0] if isinstance(out, tuple) else out)[0].float().numpy().copy()

        def gate_hook(mod, inp, out, i=i):
            logits, scores, idx = out
            rlog[i] = logits.float().numpy().copy()
            rw[i] = scores.float().numpy().copy()
            ridx[i] = idx.numpy().astype(np.int32).copy()

        hooks.append(mix_mod.register_forward_hook(mix_hook))
        hooks.append(layer.mlp.register_forward_hook(moe_hook))
        hooks.append(layer.mlp.gate.register_forward_hook(gate_hook))

    def norm_pre(mod, inp):
        last["x"] = inp[0][0].float().numpy().copy()

    hooks.append(model.model.norm.register_forward_pre_hook(norm_pre))
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False, output_hidden_states=True)
    for h in hooks:
        h.remove()
    hs = np.stack([h[0].float().numpy() for h in out.hidden_states])
    arrays = {
        "debug.hidden_states": hs.astype(np.float32),
        "debug.last_layer_out": last["x"].astype(np.float32),
        "debug.mixer_out": np.stack(mixer).astype(np.float32),
        "debug.moe_out": np.stack(moe).astype(np.float32),
        "debug.router_logits": np.stack(rlog).astype(np.float32),
        "debug.router_topk_ids": np.stack(ridx).astype(np.int32),
        "debug.router_topk_weights": np.stack(rw).astype(np.float32),
    }
    # consistency of hidden_states with the hooks
    hs_check = {
        "hidden_states_0_equal_embedding": float(np.abs(hs[0] - model.model.embed_tokens.weight[ids].numpy()).max()),
        "hidden_states_N_equal_final_norm_of_last_layer": float(np.abs(
            hs[n] - model.model.norm(torch.from_numpy(last["x"])).numpy()).max()),
    }
    # states after a cached prefill
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True)
    cache = out.cache
    state_layers = [i for i in range(n) if cfg.layer_types[i] == "linear_attention"]
    for j in state_layers:
        arrays[f"debug.gdn_state.layer{j}"] = cache.get_recurrent_state(j)[0].float().numpy().copy()
        arrays[f"debug.conv_state.layer{j}"] = cache.get_conv_state(j)[0].float().numpy().copy()
    return arrays, hs_check, state_layers


@torch.no_grad()
def gdn_decay_stats(model, cfg, ids):
    """exp(g) per token/head statistics, by layer, for the given prompt."""
    stats = {}
    captured = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if cfg.layer_types[i] != "linear_attention":
            continue

        def pre(mod, args, kwargs, i=i):
            captured[i] = (args[0] if args else kwargs["hidden_states"]).clone()

        hooks.append(layer.linear_attn.register_forward_pre_hook(pre, with_kwargs=True))
    model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    for h in hooks:
        h.remove()
    for i, x in captured.items():
        la = model.model.layers[i].linear_attn
        a = la.in_proj_a(x)
        g = -la.A_log.float().exp() * torch.nn.functional.softplus(a.float() + la.dt_bias)
        d = g.exp().flatten()
        stats[f"layer{i}"] = {"decay_min": float(d.min()), "decay_median": float(d.median()),
                              "decay_max": float(d.max())}
    return stats


# --------------------------------------------------------------------------------------
# Load-back checks: transformers itself reads the written folder
# --------------------------------------------------------------------------------------

@torch.no_grad()
def load_back_check(spec, folder, model, probe_ids):
    """Load the folder with transformers' from_pretrained (float32) and compare every text parameter (bitwise)
    and the logits on a probe prompt with the in-memory reference model."""
    ref_logits, _ = forward_nocache(model, probe_ids, router=False)
    if spec["layout"] == "published":
        m2 = Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation="eager",
                                                                experts_implementation=EXPERTS_IMPL)
        prefix_map = lambda n: n.replace("model.", "model.language_model.", 1) if n != "lm_head.weight" else n  # noqa: E731
        cls = "Qwen3_5MoeForConditionalGeneration"
    else:
        m2 = Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                   experts_implementation=EXPERTS_IMPL)
        prefix_map = lambda n: n  # noqa: E731
        cls = "Qwen3_5MoeForCausalLM"
    m2.eval()
    sd2 = dict(m2.named_parameters())
    mismatched = []
    for n, p in model.named_parameters():
        q = sd2[prefix_map(n)]
        if q.shape != p.shape or not torch.equal(q, p):
            mismatched.append(n)
    if model.config.tie_word_embeddings:
        tied_ok = bool(torch.equal(m2.lm_head.weight, model.lm_head.weight))
    else:
        tied_ok = None
    out = m2(input_ids=torch.tensor([probe_ids], dtype=torch.long), use_cache=False)
    logits2 = out.logits[0].float().numpy()
    res = {
        "class": cls,
        "text_parameters_bitwise_equal": not mismatched,
        "mismatched": mismatched[:5],
        "probe_prompt_length": len(probe_ids),
        "probe_logits_max_abs_diff": float(np.abs(logits2 - ref_logits).max()),
    }
    if tied_ok is not None:
        res["lm_head_is_embedding"] = tied_ok
    if spec["layout"] == "published":
        # the text-only CausalLM on the nested folder: transformers loads model.language_model.* names too
        m3 = Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                   experts_implementation=EXPERTS_IMPL)
        m3.eval()
        l3 = m3(input_ids=torch.tensor([probe_ids], dtype=torch.long), use_cache=False).logits[0].float().numpy()
        res["causal_lm_from_nested_folder_probe_logits_max_abs_diff"] = float(np.abs(l3 - ref_logits).max())
    if not res["text_parameters_bitwise_equal"] or res["probe_logits_max_abs_diff"] > 1e-5:
        raise SystemExit(f"load-back check failed: {res}")
    return res


# --------------------------------------------------------------------------------------
# Main per-fixture driver
# --------------------------------------------------------------------------------------

ARRAY_NOTES = {
    "p{i}.prompt_ids": "int32 [L] prompt token ids",
    "p{i}.prompt_logits": "float32 [L, vocab] one forward over the prompt, no cache",
    "p{i}.gen_ids": "int32 [new_tokens] greedy tokens",
    "p{i}.gen_logits": "float32 [new_tokens, vocab] see decode.rule",
    "p{i}.seq_ids": "int32 [L + new_tokens] prompt followed by gen_ids",
    "p{i}.seq_logits": "float32 [L + new_tokens, vocab] one forward over seq_ids, no cache; rows L-1 .. "
                       "L+new_tokens-2 reproduce gen_logits",
    "p{i}.split_logits": "float32 [L, vocab] the prompt prefilled with a cache in two pieces, ids[:split_at] then "
                         "ids[split_at:] (prompts[i].split_at), the two pieces' logits concatenated; for L = 1 "
                         "(split_at null) it is the one-piece cached prefill",
    "debug.hidden_states": "float32 [num_layers + 1, L, hidden] output_hidden_states for the debug prompt: [0] "
                           "token embeddings, [i] (1 <= i < num_layers) residual stream after decoder layer i-1, "
                           "[num_layers] final RMSNorm output (transformers replaces the last entry with the normed "
                           "last_hidden_state)",
    "debug.last_layer_out": "float32 [L, hidden] residual stream after the last decoder layer, before the final norm",
    "debug.mixer_out": "float32 [num_layers, L, hidden] token-mixer output (linear_attn or self_attn, after "
                       "out_proj / o_proj), before the residual add",
    "debug.moe_out": "float32 [num_layers, L, hidden] sparse-MoE block output (routed experts + sigmoid-gated "
                     "shared expert), before the residual add",
    "debug.router_logits": "float32 [num_layers, L, num_experts] router logits (before softmax)",
    "debug.router_topk_weights": "float32 [num_layers, L, top_k] renormalised top-k softmax weights, in "
                                 "descending order",
    "debug.router_topk_ids": "int32 [num_layers, L, top_k] selected experts, same order as the weights",
    "debug.gdn_state.layer{j}": "float32 [linear_num_value_heads, linear_key_head_dim, linear_value_head_dim] "
                                "Gated DeltaNet recurrent state after prefilling the debug prompt (S[h, k, v]; "
                                "output o[v] = sum_k q[k] S[k, v])",
    "debug.conv_state.layer{j}": "float32 [conv_dim, conv_kernel] the last conv_kernel pre-convolution in_proj_qkv "
                                 "outputs (channels in q, k, v order; oldest first, zero-padded on the left for "
                                 "prompts shorter than conv_kernel), as transformers caches them",
}


def versions():
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def run_fixture(name: str, spec: dict, out_root: str, log):
    t0 = time.time()
    folder = os.path.join(out_root, name)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    cfg = build_text_config(spec["text"])
    model = new_causal_lm(cfg)
    kernels = check_fallback_kernels()
    experts_impl = model.config._experts_implementation
    stored = make_weights(spec, model)
    num_params = sum(p.numel() for p in model.parameters())
    if spec["layout"] == "published":
        extras = published_extras(spec, cfg)
        config_json, files = write_published(spec, folder, cfg, stored, extras)
    else:
        extras = {}
        config_json, files = write_flat(spec, folder, cfg, stored)
    with open(os.path.join(folder, "generation_config.json")) as f:
        generation_json = json.load(f)
    log(f"[{name}] weights written: {num_params} parameters, {len(stored)} text tensors + {len(extras)} extra, "
        f"experts_implementation={experts_impl}")

    seed = spec["seed"]
    V = cfg.vocab_size
    G = spec["new_tokens"]
    prompts_json = []
    all_arrays = {}
    router_scales = []
    for i, (L, split_at) in enumerate(zip(spec["prompt_lengths"], spec["split_at"])):
        attempt = 0
        tried = 0
        while True:
            ids = prompt_ids_for(seed, i, L, attempt, V)
            arrays, checks, rob, gen_ids, rscale = evaluate_prompt(model, cfg, ids, G, split_at,
                                                                   spec["min_greedy_margin"])
            tried += 1
            if rob["robust"]:
                break
            attempt += 1
            if attempt > 200:
                raise SystemExit(f"[{name}] no robust prompt of length {L} found")
        rob["candidates_tried"] = tried
        router_scales.append(rscale)
        for k, v in arrays.items():
            all_arrays[f"p{i}.{k}"] = v
        prompts_json.append({
            "index": i, "length": L, "prompt_attempt": attempt, "split_at": split_at,
            "prompt_ids": ids, "generated_ids": gen_ids, "checks": checks, "decision_robustness": rob,
        })
        log(f"[{name}] p{i} L={L} attempt={attempt} split_at={split_at} "
            f"decode_vs_full={checks['decode_vs_full_forward_max_abs']:.2e} "
            f"split={checks['two_piece_prefill_vs_one_shot_max_abs']} "
            f"margin={rob['greedy_top2_margin_min']:.2e} router_gap={rob['router_kth_gap_min']}")

    diagnostics = {
        "implementations": kernels,
        "experts_implementation": experts_impl,
        "attn_implementation": model.config._attn_implementation,
        "gdn_chunk_size": 64,
        "num_threads": torch.get_num_threads(),
    }
    dbg = spec.get("debug_prompt")
    if dbg is not None:
        dids = prompts_json[dbg]["prompt_ids"]
        darr, hs_check, state_layers = debug_arrays(model, cfg, dids)
        all_arrays.update(darr)
        diagnostics["hidden_states_check"] = hs_check
        diagnostics["debug_prompt_index"] = dbg
        diagnostics["debug_state_layers"] = state_layers
        # the debug forward reproduces the prompt logits
        diagnostics["debug_router_topk_vs_prompt_path"] = "same no-cache forward as p{}.prompt_logits".format(dbg)
    long_ids = prompts_json[-1]["prompt_ids"]
    diagnostics["gdn_decay_stats"] = gdn_decay_stats(model, cfg, long_ids)
    diagnostics["gdn_decay_stats_prompt"] = f"p{len(prompts_json) - 1}"

    # load-back check with transformers' own loader
    diagnostics["load_back"] = load_back_check(spec, folder, model, prompts_json[-1]["prompt_ids"][:70])
    log(f"[{name}] load-back: {diagnostics['load_back']}")

    ref_path = os.path.join(folder, "references.safetensors")
    save_tensors({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sorted(all_arrays.items())}, ref_path)

    def agg(key, fn=max, src="checks"):
        vals = [p[src][key] for p in prompts_json if p[src][key] is not None]
        return fn(vals) if vals else None

    self_consistency = {
        "decode_vs_full_forward_max_abs": agg("decode_vs_full_forward_max_abs"),
        "prefill_with_cache_vs_no_cache_max_abs": agg("prefill_with_cache_vs_no_cache_max_abs"),
        "two_piece_prefill_vs_one_shot_max_abs": agg("two_piece_prefill_vs_one_shot_max_abs"),
        "generate_vs_loop_logits_max_abs": agg("generate_vs_loop_logits_max_abs"),
        "greedy_top2_margin_min": agg("greedy_top2_margin_min", min, "decision_robustness"),
        "router_kth_vs_next_logit_gap_min": agg("router_kth_gap_min", min, "decision_robustness"),
        "router_logits_decode_vs_full_forward_max_abs": agg("router_logits_decode_vs_full_forward_max_abs"),
        "all_prompts_decision_robust": all(p["decision_robustness"]["robust"] for p in prompts_json),
        "logits_abs_max": agg("logits_abs_max"),
        "all_greedy_ids_equal_full_forward_argmax": all(p["checks"]["greedy_ids_equal_full_forward_argmax"]
                                                        for p in prompts_json),
        "all_generate_ids_equal_loop": all(p["checks"]["generate_ids_equal_loop"] for p in prompts_json),
    }

    weights_info = {
        "files": files,
        "content_sha256": content_sha256({**stored, **extras}),
        "content_sha256_definition": "sha256 over all stored tensors sorted by name: 'name\\0DTYPE\\0[shape]\\0' "
                                     "then the raw little-endian bytes",
        "num_parameters": num_params,
        "num_text_tensors": len(stored),
        "num_extra_tensors": len(extras),
        "bytes": sum(f["bytes"] for f in files),
    }
    if len(files) == 1:
        weights_info["file"] = files[0]["file"]
        weights_info["sha256"] = files[0]["sha256"]

    layout_doc = layout_description(spec, cfg, stored, extras)
    refs = {
        "fixture": name,
        "description": spec["description"],
        "seed": seed,
        "generator": f"python {GENERATOR} --out DIR --only {name}",
        "oracle": {
            "library": "transformers",
            "classes": {"config": "Qwen3_5MoeTextConfig", "model": "Qwen3_5MoeForCausalLM"},
            "model_type": "qwen3_5_moe_text",
            "device": "cpu",
            "dtype": "float32 (weights upcast exactly from their stored dtype)",
            "attn_implementation": "eager",
            "experts_implementation": experts_impl,
            "versions": versions(),
        },
        "layout": layout_doc,
        "weights": weights_info,
        "init": init_doc(spec),
        "config": config_json,
        "text_config_effective": effective_text_config(cfg),
        "generation_config": generation_json,
        "decode": {
            "new_tokens": G,
            "rule": "greedy: gen_ids[t] = argmax(gen_logits[t]) (first index on ties); gen_logits[0] = prompt logits "
                    "at the last prompt position (from the cached prefill); gen_logits[t >= 1] = logits of a "
                    "single-token cached decode step that fed gen_ids[t-1] at position L + t - 1",
            "positions": "text-only: position ids 0..n-1, identical for the 3 mrope sections, so mrope reduces to "
                         "ordinary rope (rotate-half layout) on the first partial_rotary_factor * head_dim dims of "
                         "q and k",
            "eos": "none: no eos token is configured, decoding never stops early",
        },
        "prompt_selection": "prompt i of length L is drawn with numpy RandomState(seed).randint(0, vocab, L), seed = "
                            "first 4 bytes (big-endian) of sha256('<seed>/prompt/<i>/<L>[/<attempt>]') (no suffix "
                            "for attempt 0); candidates are rejected until every greedy choice (top-1 minus top-2 "
                            "logit, on both the cached-decode and the one-shot path) is at least "
                            f"max({spec['min_greedy_margin']}, 10 x the largest discrepancy between oracle paths) and "
                            "every routing decision (gap between the k-th and (k+1)-th router logit, all layers and "
                            "positions, one-shot / cached prefill / decode / two-piece paths) is at least 10 x the "
                            "router-logit discrepancy between paths (floored at 1e-6 of the value scale), and "
                            "generate() and the one-shot argmax give the same ids",
        "prompts": prompts_json,
        "self_consistency": self_consistency,
        "diagnostics": diagnostics,
        "tolerance": {
            "logits_abs": 1e-4,
            "token_ids": "exact",
            "router_topk_sets": "exact",
            "debug_arrays": "|delta| <= 1e-4 * max|reference array|",
            "note": "float32 compute path; the reference's own path discrepancy is in self_consistency",
        },
        "arrays": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in sorted(all_arrays.items())},
        "array_notes": {k: v for k, v in ARRAY_NOTES.items() if not k.startswith("debug.") or dbg is not None},
    }
    with open(os.path.join(folder, "references.json"), "w") as f:
        json.dump(refs, f, indent=1)
        f.write("\n")
    log(f"[{name}] done in {time.time() - t0:.1f}s")
    if spec.get("compare_to") and os.path.isdir(spec["compare_to"]):
        compare(folder, spec["compare_to"], log)
    return refs


def effective_text_config(cfg: Qwen3_5MoeTextConfig) -> dict:
    keys = ["vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters"]
    d = {k: copy.deepcopy(getattr(cfg, k)) for k in keys}
    rp = cfg.rope_parameters
    d["rotary_dim"] = int(cfg.head_dim * rp["partial_rotary_factor"])
    d["gdn_key_dim"] = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    d["gdn_value_dim"] = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    d["gdn_conv_dim"] = 2 * d["gdn_key_dim"] + d["gdn_value_dim"]
    return d


def init_doc(spec):
    d = dict(INIT_DOC, rounding=rounding_doc(spec), seed_names=seed_names_doc(spec))
    if spec.get("matrix_std", 0.02) != 0.02:
        d["matrices"] = (f"normal(0, 0.02) for embed_tokens (and lm_head when untied); normal(0, {spec['matrix_std']}) "
                         "(this fixture's override of the tiny-a recipe) for all other matrices: *_proj / in_proj_* / "
                         "out_proj weights, experts, mlp.gate.weight (router), shared_expert_gate.weight")
        d["matrix_std_reason"] = ("with tied embeddings and std 0.02 everywhere the residual stream is dominated by the "
                                  "current token's embedding and greedy decoding only repeats the last prompt token")
    return d


def rounding_doc(spec):
    if spec["storage"] == "bf16":
        return ("every value is cast float64 -> float32 -> bfloat16 (round-to-nearest-even) and stored in bfloat16; "
                "the references are computed from the stored values upcast exactly to float32")
    return ("every value is cast float64 -> float32, then stored either as float32 (all norm weights, A_log, "
            "dt_bias, the router mlp.gate.weight) or rounded to float16 (round-to-nearest-even; everything else, "
            "including subnormal float16 values for tiny normal(0, 0.02) draws); the references are computed from "
            "exactly the stored values upcast to float32")


def seed_names_doc(spec):
    if spec["layout"] == "published":
        return ("the stored names (model.language_model.*, lm_head.weight, fused mlp.experts.gate_up_proj / "
                "down_proj, model.visual.*, mtp.*); for text tensors they equal "
                "Qwen3_5MoeForConditionalGeneration's in-memory names")
    return ("the in-memory Qwen3_5MoeForCausalLM parameter names (model.*, fused experts mlp.experts.gate_up_proj "
            "[E, 2I, H] and mlp.experts.down_proj [E, H, I], split per expert when stored: gate_proj = "
            "gate_up_proj[j, :I], up_proj = gate_up_proj[j, I:], down_proj = down_proj[j])")


def layout_description(spec, cfg, stored, extras):
    dtypes = {}
    for n, t in {**stored, **extras}.items():
        dtypes.setdefault(DT_NAME[t.dtype], 0)
        dtypes[DT_NAME[t.dtype]] += 1
    d = {"storage_dtypes_tensor_counts": dtypes}
    if spec["layout"] == "published":
        d.update({
            "form": "published (Qwen/Qwen3.6-35B-A3B bf16 release)",
            "config": "nested: architectures [Qwen3_5MoeForConditionalGeneration], model_type qwen3_5_moe, decoder "
                      "settings under text_config (model_type qwen3_5_moe_text, partial_rotary_factor repeated at its "
                      "top level and inside rope_parameters), a small vision_config",
            "text_prefix": "model.language_model.",
            "lm_head": "lm_head.weight (top level, untied)",
            "experts": "fused 3-D, no .weight suffix: mlp.experts.gate_up_proj [E, 2I, H] (per expert rows 0..I-1 = "
                       "gate, I..2I-1 = up), mlp.experts.down_proj [E, H, I]",
            "shards": f"{spec['num_shards']} safetensors files + model.safetensors.index.json (weight_map); tensors "
                      "in module order, split by size, so a layer may straddle two shards",
            "skip": "model.visual.* (the whole tiny vision tower) and mtp.* (a partial MTP head) must be ignored by a "
                    "text engine",
            "extra_tensors": sorted(extras),
        })
    else:
        d.update({
            "form": "flat text-only (as Qwen3_5MoeForCausalLM.save_pretrained writes it)",
            "config": "flat: architectures [Qwen3_5MoeForCausalLM], model_type qwen3_5_moe_text",
            "text_prefix": "model.",
            "lm_head": "tied to model.embed_tokens.weight (no lm_head tensor)" if cfg.tie_word_embeddings
            else "lm_head.weight (untied)",
            "experts": "one tensor per expert: mlp.experts.{j}.gate_proj.weight [I, H], up_proj.weight [I, H], "
                       "down_proj.weight [H, I]",
            "shards": "one file, model.safetensors",
        })
    return d


def compare(folder, ref_folder, log):
    """Compare a regenerated fixture with a reference folder (weights sha256, arrays)."""
    rj = json.load(open(os.path.join(ref_folder, "references.json")))
    mj = json.load(open(os.path.join(folder, "references.json")))
    res = {}
    ref_sha = rj["weights"]["sha256"]
    my_sha = mj["weights"]["files"][0]["sha256"]
    res["weights_sha256_equal"] = ref_sha == my_sha
    res["weights_sha256"] = my_sha
    res["content_sha256_equal"] = rj["weights"].get("content_sha256") == mj["weights"]["content_sha256"]
    res["config_json_equal"] = open(os.path.join(folder, "config.json")).read() == \
        open(os.path.join(ref_folder, "config.json")).read()
    res["generation_config_json_equal"] = open(os.path.join(folder, "generation_config.json")).read() == \
        open(os.path.join(ref_folder, "generation_config.json")).read()
    a = load_file(os.path.join(ref_folder, "references.safetensors"))
    b = load_file(os.path.join(folder, "references.safetensors"))
    diffs = {}
    ids_equal = True
    for k, v in a.items():
        if k not in b:
            diffs[k] = "missing"
            continue
        w = b[k]
        if v.shape != w.shape:
            diffs[k] = f"shape {list(v.shape)} vs {list(w.shape)}"
            ids_equal = False
            continue
        if v.dtype == torch.int32:
            eq = bool(torch.equal(v, w))
            if not eq:
                diffs[k] = "ids differ"
                ids_equal = False
        else:
            diffs[k] = float((v - w).abs().max())
    res["all_int_arrays_equal"] = ids_equal
    float_d = {k: v for k, v in diffs.items() if isinstance(v, float)}
    res["max_abs_diff_logits"] = max(v for k, v in float_d.items() if k.startswith("p"))
    res["max_abs_diff_debug"] = max((v for k, v in float_d.items() if k.startswith("debug")), default=None)
    res["per_array_max_abs_diff"] = {k: v for k, v in sorted(diffs.items())}
    res["prompt_ids_equal"] = [p["prompt_ids"] == q["prompt_ids"] for p, q in zip(rj["prompts"], mj["prompts"])]
    res["generated_ids_equal"] = [p["generated_ids"] == q["generated_ids"] for p, q in zip(rj["prompts"],
                                                                                           mj["prompts"])]
    with open(os.path.join(folder, "comparison.json"), "w") as f:
        json.dump(res, f, indent=1)
    short = {k: v for k, v in res.items() if k != "per_array_max_abs_diff"}
    log(f"[compare] {json.dumps(short)}")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output root; each fixture goes to OUT/NAME")
    ap.add_argument("--only", action="append", help="fixture name (repeatable); default: all default fixtures")
    ap.add_argument("--compare-to", help="for tiny-a-check: the folder to compare with")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for k, v in FIXTURES.items():
            print(f"{k:14s} {'(default)' if v['default'] else '(--only)':10s} {v['description']}")
        return
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(False)
    names = args.only or [k for k, v in FIXTURES.items() if v["default"]]
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    for n in names:
        if n not in FIXTURES:
            raise SystemExit(f"unknown fixture {n}; known: {', '.join(FIXTURES)}")
        spec = copy.deepcopy(FIXTURES[n])
        if args.compare_to:
            spec["compare_to"] = args.compare_to
        run_fixture(n, spec, args.out, log)


if __name__ == "__main__":
    main()
