#!/usr/bin/env python3
"""Write a small random-weight Qwen3.5/3.6-MoE checkpoint in the published bf16 Hugging Face layout.

Test helper for bench/peers.sh: it lets the llama.cpp and MLX-LM halves of the peer benchmark be
exercised without `calla synth` (and checks that llama.cpp's converter accepts the published layout
with calla's tokenizer files). The layout mirrors Qwen/Qwen3.6-35B-A3B exactly (the same as
scripts/make_fixtures.py's "published" fixtures): nested config.json (`model_type: qwen3_5_moe`,
`text_config`), `model.language_model.*` names, fused 3-D experts `mlp.experts.gate_up_proj` /
`mlp.experts.down_proj` (no `.weight`), `lm_head.weight` at the top, bf16, plus tokenizer.json,
chat_template.jinja and generation_config.json from assets/tokenizer. No vision or MTP tensors.

    make_tiny_hf.py --out DIR [--hidden 256] [--layers 4] [--experts 16] [--top-k 4] [--vocab 248320]
    make_tiny_hf.py --out DIR --full-width --layers 4     # the real widths (about 8.6 GB)

Needs numpy, torch and safetensors (scripts/requirements-fixtures.txt; .venv-fixtures has them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def text_config(a) -> dict:
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(a.layers)]
    return {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": 248044,
        "full_attention_interval": 4, "head_dim": a.head_dim, "hidden_act": "silu",
        "hidden_size": a.hidden, "initializer_range": 0.02, "layer_types": layer_types,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": a.lin_head_dim,
        "linear_num_key_heads": a.lin_k_heads, "linear_num_value_heads": a.lin_v_heads,
        "linear_value_head_dim": a.lin_head_dim, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": a.moe_inter, "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": a.heads,
        "num_experts": a.experts, "num_experts_per_tok": a.top_k, "num_hidden_layers": a.layers,
        "num_key_value_heads": a.kv_heads, "output_router_logits": False, "pad_token_id": None,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                            "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": a.shared_inter,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": a.vocab,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--full-width", action="store_true", help="the real widths of Qwen3.6-35B-A3B")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--lin-k-heads", type=int, default=2)
    p.add_argument("--lin-v-heads", type=int, default=4)
    p.add_argument("--lin-head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=128)
    p.add_argument("--shared-inter", type=int, default=128)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-dir", default=os.path.join(REPO, "assets", "tokenizer"))
    a = p.parse_args()
    if a.full_width:
        a.hidden, a.heads, a.kv_heads, a.head_dim = 2048, 16, 2, 256
        a.lin_k_heads, a.lin_v_heads, a.lin_head_dim = 16, 32, 128
        a.experts, a.top_k, a.moe_inter, a.shared_inter, a.vocab = 256, 8, 512, 512, 248320

    os.makedirs(a.out, exist_ok=True)
    g = torch.Generator().manual_seed(a.seed)
    H = a.hidden

    def normal(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def write(tensors: dict, fname: str, index: dict):
        save_file(tensors, os.path.join(a.out, fname), metadata={"format": "pt"})
        for k in tensors:
            index[k] = fname

    index: dict[str, str] = {}
    total = 0
    pre = "model.language_model."
    glob = {
        pre + "embed_tokens.weight": normal(a.vocab, H),
        pre + "norm.weight": normal(H, std=0.05),
        "lm_head.weight": normal(a.vocab, H),
    }
    total += sum(t.numel() * 2 for t in glob.values())
    write(glob, "model-embed.safetensors", index)
    del glob
    qk = a.lin_k_heads * a.lin_head_dim
    vdim = a.lin_v_heads * a.lin_head_dim
    for L in range(a.layers):
        lp = f"{pre}layers.{L}."
        t = {
            lp + "input_layernorm.weight": normal(H, std=0.05),
            lp + "post_attention_layernorm.weight": normal(H, std=0.05),
            lp + "mlp.gate.weight": normal(a.experts, H),
            lp + "mlp.experts.gate_up_proj": normal(a.experts, 2 * a.moe_inter, H),
            lp + "mlp.experts.down_proj": normal(a.experts, H, a.moe_inter),
            lp + "mlp.shared_expert.gate_proj.weight": normal(a.shared_inter, H),
            lp + "mlp.shared_expert.up_proj.weight": normal(a.shared_inter, H),
            lp + "mlp.shared_expert.down_proj.weight": normal(H, a.shared_inter),
            lp + "mlp.shared_expert_gate.weight": normal(1, H),
        }
        if (L + 1) % 4 == 0:
            sp = lp + "self_attn."
            t.update({
                sp + "q_proj.weight": normal(a.heads * a.head_dim * 2, H),
                sp + "k_proj.weight": normal(a.kv_heads * a.head_dim, H),
                sp + "v_proj.weight": normal(a.kv_heads * a.head_dim, H),
                sp + "o_proj.weight": normal(H, a.heads * a.head_dim),
                sp + "q_norm.weight": normal(a.head_dim, std=0.05),
                sp + "k_norm.weight": normal(a.head_dim, std=0.05),
            })
        else:
            sp = lp + "linear_attn."
            rs = np.random.RandomState(a.seed * 1000 + L)
            dt = np.exp(rs.uniform(np.log(1e-3), np.log(1e-1), size=a.lin_v_heads))
            t.update({
                sp + "in_proj_qkv.weight": normal(2 * qk + vdim, H),
                sp + "in_proj_z.weight": normal(vdim, H),
                sp + "in_proj_b.weight": normal(a.lin_v_heads, H),
                sp + "in_proj_a.weight": normal(a.lin_v_heads, H),
                sp + "conv1d.weight": ((torch.rand(2 * qk + vdim, 1, 4, generator=g) - 0.5)).to(torch.bfloat16),
                sp + "A_log": torch.tensor(np.log(rs.uniform(1.0, 16.0, size=a.lin_v_heads)), dtype=torch.float32),
                sp + "dt_bias": torch.tensor(dt + np.log(-np.expm1(-dt)), dtype=torch.bfloat16),
                sp + "norm.weight": (1.0 + torch.randn(a.lin_head_dim, generator=g) * 0.05).to(torch.bfloat16),
                sp + "out_proj.weight": normal(H, vdim),
            })
        total += sum(x.numel() * x.element_size() for x in t.values())
        write(t, f"model-layer{L:03d}.safetensors", index)
        del t

    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, f, indent=2)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "dtype": "bfloat16", "image_token_id": 248056, "model_type": "qwen3_5_moe",
        "text_config": text_config(a), "tie_word_embeddings": False,
        "video_token_id": 248057, "vision_end_token_id": 248054, "vision_start_token_id": 248053,
        "vision_config": {"deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                          "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02,
                          "intermediate_size": 4304, "model_type": "qwen3_5_moe_vision", "num_heads": 16,
                          "num_position_embeddings": 2304, "out_hidden_size": H, "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2},
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 248044, "do_sample": True, "eos_token_id": [248046, 248044],
                   "pad_token_id": 248044, "temperature": 1.0, "top_k": 20, "top_p": 0.95}, f, indent=2)
    for fn in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(os.path.join(a.tokenizer_dir, fn), os.path.join(a.out, fn))
    print(f"wrote {a.out}: {total / 1e9:.3f} GB of tensors")


if __name__ == "__main__":
    main()
