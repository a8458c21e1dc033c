//! Checkpoints into MLX's affine-quantized layout, exactly as `mlx_lm.convert` saves this model
//! (so MLX-LM loads our output unchanged and calla loads MLX's):
//!
//! - names as mlx-lm's `qwen3_5.Model.sanitize` leaves them: decoder tensors under
//!   `language_model.model.`, the head as `language_model.lm_head`; `model.visual.*` and
//!   `mtp.*` dropped;
//! - routed experts stacked per layer as `mlp.switch_mlp.{gate,up,down}_proj` [E, rows, cols]
//!   (the fused `gate_up_proj` [E, 2I, H] split on dim −2, gate first);
//! - zero-centred norms (`input_layernorm`, `post_attention_layernorm`, `model.norm`, `q_norm`,
//!   `k_norm`) stored as `1 + w` in their own dtype; `linear_attn.norm` unchanged;
//! - `conv1d.weight` [C, 1, K] stored as [C, K, 1] (same bytes);
//! - every linear layer and the embedding quantized (`.weight` U32, `.scales`/`.biases` BF16)
//!   with `bits`/`group_size`, except the router (`mlp.gate`) and `mlp.shared_expert_gate` at
//!   8 bits, group 64 (mlx-lm `qwen3_5.py` `quant_predicate`); config.json gains the
//!   `quantization` and `quantization_config` sections with those per-module overrides.
//!
//! Memory stays bounded: tensors are converted one (expert) slice at a time and written shard
//! by shard.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use quant::{Bits, QuantSpec};
use rayon::prelude::*;
use serde_json::{json, Value};
use weights::{DType, Snapshot};

/// Why a conversion failed.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// Reading the input failed.
    #[error(transparent)]
    Load(#[from] weights::LoadError),
    /// The input config is invalid.
    #[error(transparent)]
    Config(#[from] spec::ConfigError),
    /// Quantization refused a tensor.
    #[error("cannot quantize `{tensor}`: {source}")]
    Quant {
        /// The tensor.
        tensor: String,
        /// Why.
        source: quant::QuantError,
    },
    /// Writing the output failed.
    #[error("cannot write {path}: {reason}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The input already is in MLX's quantized layout.
    #[error("{0} is already quantized (config.json has a `quantization` section); convert from the bf16 snapshot")]
    AlreadyQuantized(PathBuf),
    /// Bad arguments.
    #[error("{0}")]
    Invalid(String),
}

/// A checkpoint to read from, in Hugging Face naming.
pub trait Source: Sync {
    /// Tensor names, sorted.
    fn names(&self) -> Vec<String>;
    /// Shape of a tensor.
    fn shape(&self, name: &str) -> Vec<usize>;
    /// Stored float dtype of a tensor.
    fn dtype(&self, name: &str) -> DType;
    /// Elements `[offset, offset + out.len())` as f32.
    fn read_f32(&self, name: &str, offset: usize, out: &mut [f32]);
    /// Total bytes, for progress.
    fn total_bytes(&self) -> u64;
}

/// A Hugging Face snapshot folder as a [`Source`].
pub struct SnapshotSource(pub Snapshot);

impl Source for SnapshotSource {
    fn names(&self) -> Vec<String> {
        self.0.names().into_iter().map(String::from).collect()
    }
    fn shape(&self, name: &str) -> Vec<usize> {
        self.0.get(name).map(|t| t.shape().to_vec()).unwrap_or_default()
    }
    fn dtype(&self, name: &str) -> DType {
        self.0.get(name).and_then(|t| t.dtype()).unwrap_or(DType::F32)
    }
    fn read_f32(&self, name: &str, offset: usize, out: &mut [f32]) {
        self.0.get(name).expect("listed tensor").read_f32(offset, out)
    }
    fn total_bytes(&self) -> u64 {
        self.0.total_bytes()
    }
}

/// A synthetic checkpoint ([`model::synth`]) as a [`Source`]: values are generated on demand,
/// so nothing but the output is ever held in memory.
pub struct SynthSource {
    specs: BTreeMap<String, model::synth::TensorSpec>,
    seed: u64,
}

impl SynthSource {
    /// The tensors of `cfg` in the published layout (fused experts), seeded.
    pub fn new(cfg: &spec::TextConfig, seed: u64) -> Self {
        let specs = model::synth::tensor_specs(cfg, true).into_iter().map(|s| (s.name.clone(), s)).collect();
        SynthSource { specs, seed }
    }
}

impl Source for SynthSource {
    fn names(&self) -> Vec<String> {
        self.specs.keys().cloned().collect()
    }
    fn shape(&self, name: &str) -> Vec<usize> {
        self.specs[name].shape.clone()
    }
    fn dtype(&self, _: &str) -> DType {
        DType::BF16
    }
    fn read_f32(&self, name: &str, offset: usize, out: &mut [f32]) {
        model::synth::fill_values(&self.specs[name], self.seed, offset, out);
        // The bf16 checkpoint stores these values rounded; convert from exactly those.
        out.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
    }
    fn total_bytes(&self) -> u64 {
        self.specs.values().map(|s| s.shape.iter().product::<usize>() as u64 * 2).sum()
    }
}

/// Writes tensors into safetensors shards of about `shard_bytes`, then names them
/// `model-0000i-of-0000n.safetensors` (or `model.safetensors`) with an index.
struct ShardWriter {
    dir: PathBuf,
    shard_bytes: usize,
    pending: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    pending_bytes: usize,
    written: Vec<(PathBuf, Vec<String>)>,
    total: u64,
}

impl ShardWriter {
    fn add(&mut self, name: String, dtype: safetensors::Dtype, shape: Vec<usize>, bytes: Vec<u8>) -> Result<(), ConvertError> {
        if self.pending_bytes > 0 && self.pending_bytes + bytes.len() > self.shard_bytes {
            self.flush()?;
        }
        self.pending_bytes += bytes.len();
        self.total += bytes.len() as u64;
        self.pending.push((name, dtype, shape, bytes));
        Ok(())
    }

    fn flush(&mut self) -> Result<(), ConvertError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let path = self.dir.join(format!(".shard-{}.tmp", self.written.len()));
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = self
            .pending
            .iter()
            .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("consistent view")))
            .collect();
        let meta: std::collections::HashMap<String, String> = [("format".to_string(), "mlx".to_string())].into();
        safetensors::serialize_to_file(views, Some(meta), &path)
            .map_err(|e| ConvertError::Write { path: path.clone(), reason: e.to_string() })?;
        let names = self.pending.drain(..).map(|p| p.0).collect();
        self.written.push((path, names));
        self.pending_bytes = 0;
        Ok(())
    }

    fn finish(mut self) -> Result<(), ConvertError> {
        self.flush()?;
        let n = self.written.len();
        let mut map = serde_json::Map::new();
        for (i, (tmp, names)) in self.written.iter().enumerate() {
            let file = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n) };
            let dst = self.dir.join(&file);
            std::fs::rename(tmp, &dst).map_err(|e| ConvertError::Write { path: dst.clone(), reason: e.to_string() })?;
            for name in names {
                map.insert(name.clone(), Value::String(file.clone()));
            }
        }
        if n > 1 {
            let p = self.dir.join("model.safetensors.index.json");
            let idx = json!({"metadata": {"total_size": self.total}, "weight_map": map});
            std::fs::write(&p, serde_json::to_string_pretty(&idx).expect("json")).map_err(|e| ConvertError::Write { path: p, reason: e.to_string() })?;
        }
        Ok(())
    }
}

/// What to do with one input tensor.
#[derive(Debug, Clone, PartialEq)]
enum Plan {
    /// Skip (vision tower, MTP head, or handled with another tensor).
    Skip,
    /// Quantize a 2-D matrix to `module`.
    Quant { module: String, spec: QuantSpec },
    /// Split a fused [E, 2I, H] gate_up into stacked gate and up.
    FusedGateUp { gate: String, up: String, spec: QuantSpec },
    /// A stacked [E, rows, cols] tensor (fused down_proj).
    Stacked { module: String, spec: QuantSpec },
    /// Stack per-expert tensors `{prefix}{e}.{proj}.weight`, e < n.
    PerExpert { module: String, prefix: String, proj: String, n: usize, spec: QuantSpec },
    /// Zero-centred norm stored as 1 + w.
    NormPlusOne { name: String },
    /// conv1d [C, 1, K] → [C, K, 1].
    Conv { name: String },
    /// Stored unchanged under a new name.
    Copy { name: String },
}

/// The MLX name of a Hugging Face decoder tensor name (`model.language_model.X` or `model.X`
/// → `language_model.model.X`; `lm_head.weight` → `language_model.lm_head.weight`).
pub fn mlx_name(hf: &str) -> Option<String> {
    if hf.starts_with("model.visual.") || hf.starts_with("mtp.") || hf.starts_with("model.mtp.") {
        return None;
    }
    if let Some(rest) = hf.strip_prefix("model.language_model.") {
        return Some(format!("language_model.model.{rest}"));
    }
    if hf == "lm_head.weight" {
        return Some("language_model.lm_head.weight".into());
    }
    if hf.starts_with("language_model.") {
        return Some(hf.to_string());
    }
    hf.strip_prefix("model.").map(|rest| format!("language_model.model.{rest}"))
}

const ZNORMS: [&str; 5] = [".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight", ".k_norm.weight"];

fn plan(src: &dyn Source, names: &std::collections::HashSet<String>, hf: &str, default: QuantSpec) -> Plan {
    let Some(name) = mlx_name(hf) else { return Plan::Skip };
    let gate8 = QuantSpec { bits: Bits::B8, group_size: 64 };
    let shape = src.shape(hf);
    let can_quant = |cols: usize, spec: QuantSpec| cols % spec.group_size == 0;
    if let Some(base) = name.strip_suffix("mlp.experts.gate_up_proj") {
        return Plan::FusedGateUp { gate: format!("{base}mlp.switch_mlp.gate_proj"), up: format!("{base}mlp.switch_mlp.up_proj"), spec: default };
    }
    if let Some(base) = name.strip_suffix("mlp.experts.down_proj") {
        return Plan::Stacked { module: format!("{base}mlp.switch_mlp.down_proj"), spec: default };
    }
    if let (Some(pos), Some(mpos)) = (hf.find("mlp.experts."), name.find("mlp.experts.")) {
        // Per-expert naming: handled once, at expert 0 of each projection.
        let prefix = &hf[..pos + "mlp.experts.".len()];
        let (e, tail) = hf[prefix.len()..].split_once('.').unwrap_or(("", ""));
        if e != "0" {
            return Plan::Skip;
        }
        let proj = tail.trim_end_matches(".weight").to_string();
        let n = (0..).take_while(|k| names.contains(&format!("{prefix}{k}.{proj}.weight"))).count();
        return Plan::PerExpert { module: format!("{}mlp.switch_mlp.{proj}", &name[..mpos]), prefix: prefix.to_string(), proj, n, spec: default };
    }
    if ZNORMS.iter().any(|s| name.ends_with(s)) && shape.len() == 1 {
        return Plan::NormPlusOne { name };
    }
    if name.ends_with("conv1d.weight") {
        return Plan::Conv { name };
    }
    if let Some(module) = name.strip_suffix(".weight") {
        if shape.len() == 2 {
            let spec = if module.ends_with("mlp.gate") || module.ends_with("shared_expert_gate") { gate8 } else { default };
            if can_quant(shape[1], spec) {
                return Plan::Quant { module: module.to_string(), spec };
            }
        }
    }
    Plan::Copy { name }
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::F32 => safetensors::Dtype::F32,
        DType::U32 => safetensors::Dtype::U32,
        DType::I32 => safetensors::Dtype::I32,
    }
}

fn encode(d: DType, v: &[f32]) -> Vec<u8> {
    match d {
        DType::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Quantizes `n_mats` consecutive [rows, cols] matrices of `hf` starting at element `offset`
/// (stride `stride` elements between matrices), in parallel over matrices, and returns the
/// concatenated packed words, scales and biases.
#[allow(clippy::too_many_arguments)]
fn quantize_stack(
    src: &dyn Source,
    hf: &str,
    offsets: &[usize],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
) -> Result<(Vec<u8>, Vec<u8>, Vec<u8>), ConvertError> {
    let parts: Vec<quant::QMat> = offsets
        .par_iter()
        .map(|&off| {
            let mut w = vec![0.0f32; rows * cols];
            src.read_f32(hf, off, &mut w);
            quant::quantize(&w, rows, cols, spec).map_err(|source| ConvertError::Quant { tensor: hf.to_string(), source })
        })
        .collect::<Result<_, _>>()?;
    let mut p = Vec::new();
    let mut s = Vec::new();
    let mut b = Vec::new();
    for q in &parts {
        let r = q.as_ref();
        p.extend(r.packed.iter().flat_map(|w| w.to_le_bytes()));
        s.extend(r.scales.iter().flat_map(|x| x.to_bits().to_le_bytes()));
        b.extend(r.biases.iter().flat_map(|x| x.to_bits().to_le_bytes()));
    }
    Ok((p, s, b))
}

fn add_quant(w: &mut ShardWriter, module: &str, lead: &[usize], rows: usize, cols: usize, spec: QuantSpec, q: (Vec<u8>, Vec<u8>, Vec<u8>)) -> Result<(), ConvertError> {
    let shape = |last: usize| -> Vec<usize> { lead.iter().copied().chain([rows, last]).collect() };
    w.add(format!("{module}.weight"), safetensors::Dtype::U32, shape(spec.words_per_row(cols)), q.0)?;
    w.add(format!("{module}.scales"), safetensors::Dtype::BF16, shape(spec.groups_per_row(cols)), q.1)?;
    w.add(format!("{module}.biases"), safetensors::Dtype::BF16, shape(spec.groups_per_row(cols)), q.2)?;
    Ok(())
}

/// Reads `n_mats` matrices of `rows × cols` elements at `offsets` and stores them stacked as a
/// float tensor `name` [n, rows, cols] in `dt` (mlx-lm leaves a layer unquantized when its input
/// width is not a multiple of the group size).
fn add_dense_stack(w: &mut ShardWriter, src: &dyn Source, hf: &str, name: String, offsets: &[usize], rows: usize, cols: usize, dt: DType) -> Result<(), ConvertError> {
    let mut v = vec![0.0f32; offsets.len() * rows * cols];
    for (i, &off) in offsets.iter().enumerate() {
        src.read_f32(hf, off, &mut v[i * rows * cols..(i + 1) * rows * cols]);
    }
    w.add(name, st_dtype(dt), vec![offsets.len(), rows, cols], encode(dt, &v))
}

/// Progress callback: (bytes of input done, bytes in total).
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Sync);

/// Converts `src` (Hugging Face naming, config `config`) into MLX's layout in `out`, quantized
/// at `bits` with `group_size`; writes `config.json` with the quantization sections.
///
/// # Errors
/// [`ConvertError`] naming the tensor or file.
pub fn convert_source(src: &dyn Source, config: &Value, out: &Path, bits: u32, group_size: usize, shard_bytes: usize, progress: Progress<'_>) -> Result<(), ConvertError> {
    spec::TextConfig::from_json(config)?;
    let spec = QuantSpec::new(bits, group_size).map_err(|e| ConvertError::Invalid(e.to_string()))?;
    std::fs::create_dir_all(out).map_err(|e| ConvertError::Write { path: out.to_path_buf(), reason: e.to_string() })?;
    let mut w = ShardWriter { dir: out.to_path_buf(), shard_bytes, pending: vec![], pending_bytes: 0, written: vec![], total: 0 };
    let total = src.total_bytes();
    let mut done = 0u64;
    let mut overrides = serde_json::Map::new();
    let names: std::collections::HashSet<String> = src.names().into_iter().collect();
    for hf in src.names() {
        let shape = src.shape(&hf);
        let dt = src.dtype(&hf);
        let numel: usize = shape.iter().product();
        match plan(src, &names, &hf, spec) {
            Plan::Skip => {}
            Plan::Quant { module, spec: s } => {
                let (rows, cols) = (shape[0], shape[1]);
                // Split big matrices (embedding, LM head) into row blocks for parallelism.
                let block = (1 << 22) / cols.max(1);
                let block = block.max(1).min(rows);
                let offsets: Vec<usize> = (0..rows).step_by(block).map(|r| r * cols).collect();
                let full = rows / block;
                let mut acc = quantize_stack(src, &hf, &offsets[..full], block, cols, s)?;
                if full * block < rows {
                    let q = quantize_stack(src, &hf, &[full * block * cols], rows - full * block, cols, s)?;
                    acc.0.extend(q.0);
                    acc.1.extend(q.1);
                    acc.2.extend(q.2);
                }
                if s != spec {
                    overrides.insert(module.clone(), json!({"group_size": s.group_size, "bits": s.bits.bits()}));
                }
                add_quant(&mut w, &module, &[], rows, cols, s, acc)?;
            }
            Plan::FusedGateUp { gate, up, spec: s } => {
                let (e, i2, h) = (shape[0], shape[1], shape[2]);
                let i = i2 / 2;
                let gate_offs: Vec<usize> = (0..e).map(|x| x * i2 * h).collect();
                let up_offs: Vec<usize> = (0..e).map(|x| x * i2 * h + i * h).collect();
                if h % s.group_size != 0 {
                    add_dense_stack(&mut w, src, &hf, format!("{gate}.weight"), &gate_offs, i, h, dt)?;
                    add_dense_stack(&mut w, src, &hf, format!("{up}.weight"), &up_offs, i, h, dt)?;
                } else {
                    let q = quantize_stack(src, &hf, &gate_offs, i, h, s)?;
                    add_quant(&mut w, &gate, &[e], i, h, s, q)?;
                    let q = quantize_stack(src, &hf, &up_offs, i, h, s)?;
                    add_quant(&mut w, &up, &[e], i, h, s, q)?;
                }
            }
            Plan::Stacked { module, spec: s } => {
                let (e, rows, cols) = (shape[0], shape[1], shape[2]);
                let offs: Vec<usize> = (0..e).map(|x| x * rows * cols).collect();
                if cols % s.group_size != 0 {
                    add_dense_stack(&mut w, src, &hf, format!("{module}.weight"), &offs, rows, cols, dt)?;
                } else {
                    let q = quantize_stack(src, &hf, &offs, rows, cols, s)?;
                    add_quant(&mut w, &module, &[e], rows, cols, s, q)?;
                }
            }
            Plan::PerExpert { module, prefix, proj, n, spec: s } => {
                let (rows, cols) = (shape[0], shape[1]);
                let names: Vec<String> = (0..n).map(|x| format!("{prefix}{x}.{proj}.weight")).collect();
                if cols % s.group_size != 0 {
                    let mut v = vec![0.0f32; n * rows * cols];
                    for (x, nm) in names.iter().enumerate() {
                        src.read_f32(nm, 0, &mut v[x * rows * cols..(x + 1) * rows * cols]);
                    }
                    w.add(format!("{module}.weight"), st_dtype(dt), vec![n, rows, cols], encode(dt, &v))?;
                    progress(done.min(total), total);
                    done += (numel * dt.size_bytes()) as u64;
                    continue;
                }
                let parts: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> =
                    names.par_iter().map(|nm| quantize_stack(src, nm, &[0], rows, cols, s)).collect::<Result<_, _>>()?;
                let mut acc = (Vec::new(), Vec::new(), Vec::new());
                for p in parts {
                    acc.0.extend(p.0);
                    acc.1.extend(p.1);
                    acc.2.extend(p.2);
                }
                add_quant(&mut w, &module, &[n], rows, cols, s, acc)?;
            }
            Plan::NormPlusOne { name } => {
                let mut v = vec![0.0f32; numel];
                src.read_f32(&hf, 0, &mut v);
                // mlx-lm adds 1 in the tensor's own dtype; encode() rounds once, as it does.
                v.iter_mut().for_each(|x| *x += 1.0);
                w.add(name, st_dtype(dt), shape.clone(), encode(dt, &v))?;
            }
            Plan::Conv { name } => {
                let mut v = vec![0.0f32; numel];
                src.read_f32(&hf, 0, &mut v);
                let new_shape = if shape.len() == 3 && shape[1] == 1 { vec![shape[0], shape[2], 1] } else { shape.clone() };
                w.add(name, st_dtype(dt), new_shape, encode(dt, &v))?;
            }
            Plan::Copy { name } => {
                let mut v = vec![0.0f32; numel];
                src.read_f32(&hf, 0, &mut v);
                w.add(name, st_dtype(dt), shape.clone(), encode(dt, &v))?;
            }
        }
        done += (numel * dt.size_bytes()) as u64;
        progress(done.min(total), total);
    }
    w.finish()?;
    // Per-layer 8-bit overrides for the router and shared-expert gate, keyed as mlx-lm keys them.
    let mut q = serde_json::Map::new();
    q.insert("group_size".into(), json!(group_size));
    q.insert("bits".into(), json!(bits));
    q.insert("mode".into(), json!("affine"));
    q.extend(overrides);
    let mut config = config.clone();
    let obj = config.as_object_mut().ok_or_else(|| ConvertError::Invalid("config.json is not an object".into()))?;
    obj.insert("quantization".into(), Value::Object(q.clone()));
    obj.insert("quantization_config".into(), Value::Object(q));
    let p = out.join("config.json");
    std::fs::write(&p, serde_json::to_string_pretty(&config).expect("json")).map_err(|e| ConvertError::Write { path: p, reason: e.to_string() })?;
    Ok(())
}

/// Files besides the weights that a snapshot folder carries and a conversion copies.
pub const SIDE_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "calla_vocab.json",
];

/// Converts a bf16/f16/f32 Hugging Face snapshot folder into MLX's quantized layout, copying
/// the tokenizer, template and generation config.
///
/// # Errors
/// [`ConvertError`] naming the tensor or file; an input that is already quantized is refused.
pub fn convert_dir(input: &Path, out: &Path, bits: u32, group_size: usize, shard_bytes: usize, progress: Progress<'_>) -> Result<(), ConvertError> {
    let cfg_path = input.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| ConvertError::Invalid(format!("cannot read {}: {e}", cfg_path.display())))?;
    let config: Value = serde_json::from_str(&text).map_err(|e| ConvertError::Invalid(format!("{} is not valid JSON: {e}", cfg_path.display())))?;
    if config.get("quantization").is_some() {
        return Err(ConvertError::AlreadyQuantized(input.to_path_buf()));
    }
    if input.canonicalize().ok() == out.canonicalize().ok() {
        return Err(ConvertError::Invalid("--in and --out must be different folders".into()));
    }
    let snap = Snapshot::open(input)?;
    let src = SnapshotSource(snap);
    convert_source(&src, &config, out, bits, group_size, shard_bytes, progress)?;
    for f in SIDE_FILES {
        let p = input.join(f);
        if p.exists() {
            std::fs::copy(&p, out.join(f)).map_err(|e| ConvertError::Write { path: out.join(f), reason: e.to_string() })?;
        }
    }
    Ok(())
}

/// The published Qwen3.6-35B-A3B config (nested form) at full width, with `layers` decoder
/// layers (a multiple of 4 keeps the 3:1 pattern; any count follows it) and `experts` routed
/// experts (top-k = min(8, experts)).
pub fn production_config(layers: usize, experts: usize) -> Value {
    use spec::production as p;
    let layer_types: Vec<&str> = (0..layers)
        .map(|i| if (i + 1) % p::FULL_ATTENTION_INTERVAL == 0 { "full_attention" } else { "linear_attention" })
        .collect();
    json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": false,
        "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "vocab_size": p::VOCAB, "hidden_size": p::D_MODEL, "num_hidden_layers": layers,
            "layer_types": layer_types, "full_attention_interval": p::FULL_ATTENTION_INTERVAL,
            "num_attention_heads": p::N_Q_HEADS, "num_key_value_heads": p::N_KV_HEADS, "head_dim": p::HEAD_DIM,
            "linear_num_key_heads": p::N_K_HEADS, "linear_num_value_heads": p::N_V_HEADS,
            "linear_key_head_dim": p::D_K, "linear_value_head_dim": p::D_V, "linear_conv_kernel_dim": p::CONV_KERNEL,
            "num_experts": experts, "num_experts_per_tok": p::TOP_K.min(experts),
            "moe_intermediate_size": p::D_EXPERT, "shared_expert_intermediate_size": p::D_SHARED_EXPERT,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "hidden_act": "silu", "attention_bias": false, "attn_output_gate": true,
            "partial_rotary_factor": 0.25,
            "rope_parameters": {"rope_type": "default", "rope_theta": p::ROPE_THETA, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": true},
            "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 0,
            "bos_token_id": spec::tokens::ENDOFTEXT, "eos_token_id": spec::tokens::ENDOFTEXT,
            "dtype": "bfloat16"
        }
    })
}

/// Writes a synthetic checkpoint: bits 16 → the published bf16 layout; 4 or 8 → MLX's
/// quantized layout of exactly those bf16 values (so `synth --bits 4` equals `convert` of
/// `synth --bits 16` with the same seed).
///
/// # Errors
/// [`ConvertError`].
pub fn synth(out: &Path, config: &Value, bits: u32, seed: u64, shard_bytes: usize, progress: Progress<'_>) -> Result<(), ConvertError> {
    let cfg = spec::TextConfig::from_json(config)?;
    match bits {
        16 => model::synth::write_checkpoint(out, config, seed, true, shard_bytes).map_err(ConvertError::Invalid),
        4 | 8 => {
            let src = SynthSource::new(&cfg, seed);
            convert_source(&src, config, out, bits, 64, shard_bytes, progress)
        }
        other => Err(ConvertError::Invalid(format!("--bits must be 4, 8 or 16, found {other}"))),
    }
}

/// Writes the float32 Hugging Face layout of a loaded model (`model.language_model.*` when the
/// config is nested, else `model.*`; experts fused as `gate_up_proj` [E, 2I, H] and
/// `down_proj` [E, H, I]; zero-centred norms as deltas from 1; conv1d [C, 1, K]) with every
/// quantized matrix dequantized. Running the reference model (or transformers) on the result
/// computes exactly what the quantized model computes, up to f32 summation order — the bridge
/// that lets a quantized checkpoint be checked against the reference implementation.
///
/// # Errors
/// [`ConvertError`] naming the file.
pub fn dequantize_to_hf(m: &model::Model, config: &Value, out: &Path) -> Result<(), ConvertError> {
    use model::load::Mixer;
    std::fs::create_dir_all(out).map_err(|e| ConvertError::Write { path: out.to_path_buf(), reason: e.to_string() })?;
    let cfg = &m.cfg;
    let p = cfg.tensor_prefix();
    let mut w = ShardWriter { dir: out.to_path_buf(), shard_bytes: usize::MAX, pending: vec![], pending_bytes: 0, written: vec![], total: 0 };
    let f32b = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let mat = |l: &model::linear::Linear| -> Vec<f32> {
        let mut v = vec![0.0f32; l.rows() * l.cols()];
        l.rows_f32(0, &mut v);
        v
    };
    let add = |w: &mut ShardWriter, name: String, shape: Vec<usize>, v: Vec<f32>| w.add(name, safetensors::Dtype::F32, shape, f32b(&v));
    let wt = &m.weights;
    add(&mut w, format!("{p}embed_tokens.weight"), vec![wt.embed.rows(), wt.embed.cols()], mat(&wt.embed))?;
    if !cfg.tie_word_embeddings {
        add(&mut w, "lm_head.weight".into(), vec![wt.lm_head.rows(), wt.lm_head.cols()], mat(&wt.lm_head))?;
    }
    add(&mut w, format!("{p}norm.weight"), vec![wt.final_norm.len()], wt.final_norm.clone())?;
    for (l, lw) in wt.layers.iter().enumerate() {
        let lp = format!("{p}layers.{l}.");
        add(&mut w, format!("{lp}input_layernorm.weight"), vec![lw.input_norm.len()], lw.input_norm.clone())?;
        add(&mut w, format!("{lp}post_attention_layernorm.weight"), vec![lw.post_norm.len()], lw.post_norm.clone())?;
        let lin = |w: &mut ShardWriter, name: String, x: &model::linear::Linear| w.add(name, safetensors::Dtype::F32, vec![x.rows(), x.cols()], f32b(&mat(x)));
        match &lw.mixer {
            Mixer::Gdn(g) => {
                let a = format!("{lp}linear_attn.");
                lin(&mut w, format!("{a}in_proj_qkv.weight"), &g.in_proj_qkv)?;
                lin(&mut w, format!("{a}in_proj_z.weight"), &g.in_proj_z)?;
                lin(&mut w, format!("{a}in_proj_b.weight"), &g.in_proj_b)?;
                lin(&mut w, format!("{a}in_proj_a.weight"), &g.in_proj_a)?;
                lin(&mut w, format!("{a}out_proj.weight"), &g.out_proj)?;
                let k = cfg.linear_conv_kernel_dim;
                add(&mut w, format!("{a}conv1d.weight"), vec![g.conv1d.len() / k, 1, k], g.conv1d.clone())?;
                add(&mut w, format!("{a}A_log"), vec![g.a_neg_exp.len()], g.a_neg_exp.iter().map(|x| (-x).ln()).collect())?;
                add(&mut w, format!("{a}dt_bias"), vec![g.dt_bias.len()], g.dt_bias.clone())?;
                add(&mut w, format!("{a}norm.weight"), vec![g.norm.len()], g.norm.clone())?;
            }
            Mixer::Attn(at) => {
                let a = format!("{lp}self_attn.");
                lin(&mut w, format!("{a}q_proj.weight"), &at.q_proj)?;
                lin(&mut w, format!("{a}k_proj.weight"), &at.k_proj)?;
                lin(&mut w, format!("{a}v_proj.weight"), &at.v_proj)?;
                lin(&mut w, format!("{a}o_proj.weight"), &at.o_proj)?;
                add(&mut w, format!("{a}q_norm.weight"), vec![at.q_norm.len()], at.q_norm.clone())?;
                add(&mut w, format!("{a}k_norm.weight"), vec![at.k_norm.len()], at.k_norm.clone())?;
            }
        }
        let mo = &lw.moe;
        let mp = format!("{lp}mlp.");
        lin(&mut w, format!("{mp}gate.weight"), &mo.router)?;
        let (e, i, d) = (mo.experts.len(), cfg.moe_intermediate_size, cfg.hidden_size);
        let mut gu = Vec::with_capacity(e * 2 * i * d);
        let mut dn = Vec::with_capacity(e * d * i);
        for x in &mo.experts {
            gu.extend(mat(&x.gate));
            gu.extend(mat(&x.up));
            dn.extend(mat(&x.down));
        }
        add(&mut w, format!("{mp}experts.gate_up_proj"), vec![e, 2 * i, d], gu)?;
        add(&mut w, format!("{mp}experts.down_proj"), vec![e, d, i], dn)?;
        lin(&mut w, format!("{mp}shared_expert.gate_proj.weight"), &mo.shared.gate)?;
        lin(&mut w, format!("{mp}shared_expert.up_proj.weight"), &mo.shared.up)?;
        lin(&mut w, format!("{mp}shared_expert.down_proj.weight"), &mo.shared.down)?;
        lin(&mut w, format!("{mp}shared_expert_gate.weight"), &mo.shared_gate)?;
    }
    w.finish()?;
    let mut config = config.clone();
    if let Some(o) = config.as_object_mut() {
        o.remove("quantization");
        o.remove("quantization_config");
    }
    let path = out.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config).expect("json")).map_err(|e| ConvertError::Write { path, reason: e.to_string() })?;
    Ok(())
}
