//! Random-weight checkpoints of this architecture, in the published on-disk layout.
//!
//! Used for the built-in default model and for speed and memory measurements on the real
//! shapes. Values follow the initialisation of the reference fixtures (tests/README and
//! docs/MODEL.md): projections normal(0, 0.02); zero-centred norms normal(0, 0.05); the gated
//! norm 1 + normal(0, 0.05); conv taps uniform(-0.5, 0.5); `A_log` = ln(uniform(1, 16));
//! `dt_bias` = softplus⁻¹(dt) with dt log-uniform in [1e-3, 1e-1].

use std::path::Path;

use half::bf16;
use rand::{Rng, SeedableRng};

use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;
use serde_json::{json, Value};
use spec::{LayerKind, TextConfig};

/// How a tensor is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// normal(0, std).
    Normal(f32),
    /// 1 + normal(0, std).
    OnePlusNormal(f32),
    /// uniform(lo, hi).
    Uniform(f32, f32),
    /// ln(uniform(1, 16)).
    ALog,
    /// softplus⁻¹ of log-uniform [1e-3, 1e-1].
    DtBias,
}

/// One tensor of a synthetic checkpoint.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    /// Stored name.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Initialisation.
    pub init: Init,
}

/// The tensors of a text model with config `cfg`, named as the published release names them
/// (`model.language_model.*` when `cfg.nested`, else `model.*`), routed experts fused
/// (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) when `fused_experts`.
pub fn tensor_specs(cfg: &TextConfig, fused_experts: bool) -> Vec<TensorSpec> {
    let p = cfg.tensor_prefix();
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);
    let mut out = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, init: Init| out.push(TensorSpec { name, shape, init });
    let w = Init::Normal(0.02);
    let zn = Init::Normal(0.05);
    add(format!("{p}embed_tokens.weight"), vec![v, d], w);
    for (l, kind) in cfg.layer_types.iter().enumerate() {
        let lp = format!("{p}layers.{l}.");
        add(format!("{lp}input_layernorm.weight"), vec![d], zn);
        add(format!("{lp}post_attention_layernorm.weight"), vec![d], zn);
        match kind {
            LayerKind::LinearAttention => {
                let a = format!("{lp}linear_attn.");
                let (nv, dv, kk) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim);
                add(format!("{a}in_proj_qkv.weight"), vec![cfg.gdn_conv_dim(), d], w);
                add(format!("{a}in_proj_z.weight"), vec![nv * dv, d], w);
                add(format!("{a}in_proj_b.weight"), vec![nv, d], w);
                add(format!("{a}in_proj_a.weight"), vec![nv, d], w);
                add(format!("{a}conv1d.weight"), vec![cfg.gdn_conv_dim(), 1, kk], Init::Uniform(-0.5, 0.5));
                add(format!("{a}A_log"), vec![nv], Init::ALog);
                add(format!("{a}dt_bias"), vec![nv], Init::DtBias);
                add(format!("{a}norm.weight"), vec![dv], Init::OnePlusNormal(0.05));
                add(format!("{a}out_proj.weight"), vec![d, nv * dv], w);
            }
            LayerKind::FullAttention => {
                let a = format!("{lp}self_attn.");
                let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
                add(format!("{a}q_proj.weight"), vec![nq * 2 * hd, d], w);
                add(format!("{a}k_proj.weight"), vec![nkv * hd, d], w);
                add(format!("{a}v_proj.weight"), vec![nkv * hd, d], w);
                add(format!("{a}o_proj.weight"), vec![d, nq * hd], w);
                add(format!("{a}q_norm.weight"), vec![hd], zn);
                add(format!("{a}k_norm.weight"), vec![hd], zn);
            }
        }
        let m = format!("{lp}mlp.");
        let (e, i, si) = (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size);
        add(format!("{m}gate.weight"), vec![e, d], w);
        if fused_experts {
            add(format!("{m}experts.gate_up_proj"), vec![e, 2 * i, d], w);
            add(format!("{m}experts.down_proj"), vec![e, d, i], w);
        } else {
            for x in 0..e {
                add(format!("{m}experts.{x}.gate_proj.weight"), vec![i, d], w);
                add(format!("{m}experts.{x}.up_proj.weight"), vec![i, d], w);
                add(format!("{m}experts.{x}.down_proj.weight"), vec![d, i], w);
            }
        }
        add(format!("{m}shared_expert.gate_proj.weight"), vec![si, d], w);
        add(format!("{m}shared_expert.up_proj.weight"), vec![si, d], w);
        add(format!("{m}shared_expert.down_proj.weight"), vec![d, si], w);
        add(format!("{m}shared_expert_gate.weight"), vec![1, d], w);
    }
    add(format!("{p}norm.weight"), vec![d], zn);
    if !cfg.tie_word_embeddings {
        add("lm_head.weight".into(), vec![v, d], w);
    }
    out
}

/// Elements per independently seeded stream, so any range of a tensor can be generated alone
/// and in parallel with the same result.
pub const INIT_CHUNK: usize = 1 << 16;

/// An approximately standard normal draw from one 64-bit word: the Irwin–Hall sum of four
/// 16-bit uniforms, centred and scaled to unit variance (bounded at ±3.46σ; cheap enough to
/// generate a 35-billion-parameter checkpoint in minutes).
#[inline]
fn normal_from(w: u64) -> f32 {
    let u = |k: u32| (((w >> k) & 0xffff) as f32 + 0.5) * (1.0 / 65536.0);
    ((u(0) + u(16) + u(32) + u(48)) - 2.0) * 3f32.sqrt()
}

fn tensor_seed(seed: u64, name: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(format!("{seed}/{name}").as_bytes());
    u64::from_le_bytes(h[..8].try_into().expect("8 bytes"))
}

/// Elements `[offset, offset + out.len())` of a tensor's initial values. Element i comes from
/// stream `i / INIT_CHUNK` of a ChaCha8 generator seeded by (seed, name), so the values do not
/// depend on how the tensor is split or in which order tensors are written.
pub fn fill_values(spec: &TensorSpec, seed: u64, offset: usize, out: &mut [f32]) {
    let base = tensor_seed(seed, &spec.name);
    let mut i = 0;
    while i < out.len() {
        let pos = offset + i;
        let chunk = pos / INIT_CHUNK;
        let within = pos % INIT_CHUNK;
        let n = (INIT_CHUNK - within).min(out.len() - i);
        let mut rng = ChaCha8Rng::seed_from_u64(base);
        rng.set_stream(chunk as u64);
        // Skip to `within`: one u64 per element.
        rng.set_word_pos(2 * within as u128);
        for o in &mut out[i..i + n] {
            let w: u64 = rng.random();
            *o = match spec.init {
                Init::Normal(s) => normal_from(w) * s,
                Init::OnePlusNormal(s) => 1.0 + normal_from(w) * s,
                Init::Uniform(lo, hi) => lo + (hi - lo) * ((w >> 40) as f32 * (1.0 / (1u64 << 24) as f32)),
                Init::ALog => (1.0 + 15.0 * ((w >> 40) as f32 * (1.0 / (1u64 << 24) as f32))).ln(),
                Init::DtBias => {
                    let u = (w >> 40) as f32 * (1.0 / (1u64 << 24) as f32);
                    let ln_dt = (1e-3f32).ln() + ((1e-1f32).ln() - (1e-3f32).ln()) * u;
                    // softplus⁻¹(dt) = ln(eᵈᵗ − 1)
                    ln_dt.exp().exp_m1().ln()
                }
            };
        }
        i += n;
    }
}

/// All initial values of one tensor.
pub fn init_values(spec: &TensorSpec, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; spec.shape.iter().product()];
    fill_values(spec, seed, 0, &mut v);
    v
}

/// Writes a bf16 checkpoint for the config JSON `config` into `dir`: `config.json`, the
/// weights (sharded at about `shard_bytes`, with `model.safetensors.index.json` when more than
/// one shard), and nothing else. Memory use is bounded by one shard.
///
/// # Errors
/// Config or I/O errors, as strings naming the file.
pub fn write_checkpoint(dir: &Path, config: &Value, seed: u64, fused_experts: bool, shard_bytes: usize) -> Result<(), String> {
    let cfg = TextConfig::from_json(config).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(config).expect("json"))
        .map_err(|e| format!("cannot write {}: {e}", cfg_path.display()))?;
    let specs = tensor_specs(&cfg, fused_experts);
    // Group tensors into shards by size.
    let mut shards: Vec<Vec<&TensorSpec>> = vec![vec![]];
    let mut size = 0usize;
    for s in &specs {
        let b = s.shape.iter().product::<usize>() * 2;
        if size > 0 && size + b > shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().expect("non-empty").push(s);
        size += b;
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n) };
        let bufs: Vec<(String, Vec<usize>, Vec<u8>)> = shard
            .iter()
            .map(|s| {
                let bytes: Vec<u8> = init_values(s, seed).iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()).collect();
                (s.name.clone(), s.shape.clone(), bytes)
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = bufs
            .iter()
            .map(|(name, shape, b)| (name.clone(), TensorView::new(safetensors::Dtype::BF16, shape.clone(), b).expect("consistent view")))
            .collect();
        let path = dir.join(&file);
        safetensors::serialize_to_file(views, None, &path).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        for (name, _, b) in &bufs {
            weight_map.insert(name.clone(), Value::String(file.clone()));
            total += b.len();
        }
    }
    if n > 1 {
        let idx = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let p = dir.join("model.safetensors.index.json");
        std::fs::write(&p, serde_json::to_string_pretty(&idx).expect("json")).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    Ok(())
}

/// The config of calla's built-in default model: this architecture at a few million
/// parameters per layer with the real 248 320-row vocabulary, in the published nested form.
pub fn default_model_config() -> Value {
    json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": false,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "vocab_size": spec::production::VOCAB,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "hidden_act": "silu", "attention_bias": false,
            "eos_token_id": spec::tokens::ENDOFTEXT,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1.0e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [1, 1, 2], "mrope_interleaved": true}
        }
    })
}
