//! `calla synth`, `calla convert` and `calla bench`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use model::{Backend, LayerState, Logits, Model};

/// Arguments of `calla synth`.
#[derive(Args)]
pub struct SynthArgs {
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
    /// Decoder layers (the 3:1 Gated DeltaNet / attention pattern is kept).
    #[arg(long, default_value_t = spec::production::N_LAYERS)]
    layers: usize,
    /// Routed experts per layer.
    #[arg(long, default_value_t = spec::production::N_EXPERTS)]
    experts: usize,
    /// 16: the published bf16 layout; 4 or 8: MLX's affine-quantized layout (group 64).
    #[arg(long, default_value_t = 4)]
    bits: u32,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Target shard size in GB.
    #[arg(long, default_value_t = 2.0)]
    shard_gb: f64,
}

/// Arguments of `calla convert`.
#[derive(Args)]
pub struct ConvertArgs {
    /// A bf16 (or f16/f32) Hugging Face snapshot folder.
    #[arg(long = "in")]
    input: PathBuf,
    /// Output folder (MLX affine-quantized layout).
    #[arg(long)]
    out: PathBuf,
    /// 4 or 8.
    #[arg(long)]
    bits: u32,
    /// Weights per scale/bias group: 32, 64 or 128.
    #[arg(long, default_value_t = 64)]
    group_size: usize,
    /// Target shard size in GB.
    #[arg(long, default_value_t = 2.0)]
    shard_gb: f64,
}

/// Arguments of `calla dequantize`.
#[derive(Args)]
pub struct DequantizeArgs {
    /// A quantized (MLX layout) snapshot folder.
    #[arg(long)]
    model: PathBuf,
    /// Output folder: float32 Hugging Face layout computing exactly what the quantized model does.
    #[arg(long)]
    out: PathBuf,
}

/// `calla dequantize`.
pub fn dequantize(a: DequantizeArgs) -> Result<()> {
    let m = Model::open(&a.model).with_context(|| format!("cannot load {}", a.model.display()))?;
    let text = std::fs::read_to_string(a.model.join("config.json"))?;
    let config: serde_json::Value = serde_json::from_str(&text)?;
    convert::dequantize_to_hf(&m, &config, &a.out)?;
    for f in convert::SIDE_FILES {
        let p = a.model.join(f);
        if p.exists() && f != "config.json" {
            std::fs::copy(&p, a.out.join(f))?;
        }
    }
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// Arguments of `calla bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Snapshot folder to measure.
    #[arg(long)]
    model: PathBuf,
    /// Prompt lengths to prefill, comma-separated.
    #[arg(long, default_value = "512,2048", value_delimiter = ',')]
    prompt_tokens: Vec<usize>,
    /// Tokens to decode after each prefill.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Kernels: fast-q8 (SIMD, activations quantized to int8 per quantization group for every
    /// quantized matrix, prefill and decode), fast (SIMD, f32 activations) or reference.
    #[arg(long, default_value = "fast-q8")]
    backend: String,
}

fn bar(total: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// `calla synth`.
pub fn synth(a: SynthArgs) -> Result<()> {
    if a.layers == 0 || a.experts == 0 {
        bail!("--layers and --experts must be at least 1");
    }
    let config = convert::production_config(a.layers, a.experts);
    let pb = bar(0, "synth");
    let progress = |done: u64, total: u64| {
        pb.set_length(total);
        pb.set_position(done);
    };
    let t0 = Instant::now();
    convert::synth(&a.out, &config, a.bits, a.seed, (a.shard_gb * 1e9) as usize, &progress)?;
    pb.finish_and_clear();
    crate::default_model::write_side_files(&a.out)?;
    let bytes: u64 = std::fs::read_dir(&a.out)?.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum();
    eprintln!("wrote {} ({:.2} GB, {} layers, {} experts, {}-bit) in {:.1} s", a.out.display(), bytes as f64 / 1e9, a.layers, a.experts, a.bits, t0.elapsed().as_secs_f64());
    Ok(())
}

/// `calla convert`.
pub fn convert(a: ConvertArgs) -> Result<()> {
    if !a.input.is_dir() {
        bail!("--in {} is not a folder", a.input.display());
    }
    let pb = bar(0, "convert");
    let progress = |done: u64, total: u64| {
        pb.set_length(total);
        pb.set_position(done);
    };
    let t0 = Instant::now();
    convert::convert_dir(&a.input, &a.out, a.bits, a.group_size, (a.shard_gb * 1e9) as usize, &progress)?;
    pb.finish_and_clear();
    eprintln!("wrote {} ({}-bit, group {}) in {:.1} s", a.out.display(), a.bits, a.group_size, t0.elapsed().as_secs_f64());
    Ok(())
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), when known.
fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Memory read bandwidth in bytes/s: all threads summing a 1 GiB buffer, best of 5 passes.
fn measure_bandwidth() -> f64 {
    use rayon::prelude::*;
    let n = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64).into_par_iter().map(|i| i.wrapping_mul(0x9e37_79b9)).collect();
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let s: u64 = buf.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b))).sum();
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((n * 8) as f64 / dt);
    }
    best
}

/// Weight and state bytes one decode step reads at context `ctx` (batch 1): every non-expert
/// matrix, the top-k routed experts of each layer (average expert size), one embedding row,
/// the LM head, the KV cache (read) and the GDN state (read and written).
fn bytes_per_token(m: &Model, ctx: usize) -> u64 {
    use model::load::Mixer;
    let w = &m.weights;
    let mut b = w.lm_head.stored_bytes() as u64 + (w.embed.stored_bytes() / w.embed.rows()) as u64;
    for lw in &w.layers {
        b += match &lw.mixer {
            Mixer::Gdn(g) => [&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a, &g.out_proj].iter().map(|l| l.stored_bytes() as u64).sum::<u64>(),
            Mixer::Attn(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj].iter().map(|l| l.stored_bytes() as u64).sum::<u64>(),
        };
        let mo = &lw.moe;
        b += (mo.router.stored_bytes() + mo.shared_gate.stored_bytes() + mo.shared.gate.stored_bytes() + mo.shared.up.stored_bytes() + mo.shared.down.stored_bytes()) as u64;
        let e = &mo.experts[0];
        b += (m.cfg.num_experts_per_tok * (e.gate.stored_bytes() + e.up.stored_bytes() + e.down.stored_bytes())) as u64;
    }
    // State traffic, f32 as this CPU path keeps it.
    let st = m.new_state(1);
    for l in &st.layers {
        b += match l {
            LayerState::Gdn { conv, s } => 2 * 4 * (conv.len() + s.len()) as u64,
            LayerState::Attn { .. } => (2 * ctx * m.cfg.num_key_value_heads * m.cfg.head_dim * 4) as u64,
        };
    }
    b
}

/// `calla bench`.
pub fn bench(a: BenchArgs) -> Result<()> {
    use rand::{Rng, SeedableRng};
    let t_load = Instant::now();
    let mut m = Model::open(&a.model).with_context(|| format!("cannot load {}", a.model.display()))?;
    m.backend = match a.backend.as_str() {
        "fast" => Backend::Fast,
        "fast-q8" => Backend::FastQ8,
        "reference" => Backend::Reference,
        other => bail!("--backend must be fast, fast-q8 or reference, found {other}"),
    };
    let load_s = t_load.elapsed().as_secs_f64();
    eprintln!("measuring memory bandwidth ...");
    let bw = measure_bandwidth();
    let threads = rayon::current_num_threads();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let vocab = m.cfg.vocab_size.min(spec::production::VOCAB_REAL) as u32;
    let mut rows = Vec::new();
    for &p in &a.prompt_tokens {
        if p == 0 {
            bail!("--prompt-tokens must be positive");
        }
        let prompt: Vec<u32> = (0..p).map(|_| rng.random_range(0..vocab)).collect();
        let mut st = m.new_state(p + a.gen_tokens + 1);
        // Warm the page cache / mapping so the prefill measures compute, as peers do.
        let t0 = Instant::now();
        let mut logits = m.forward(&mut st, &prompt, Logits::Last)?;
        let mut next = sampler::argmax(&logits);
        let ttft = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for _ in 1..a.gen_tokens {
            logits = m.forward(&mut st, &[next], Logits::Last)?;
            next = sampler::argmax(&logits);
        }
        let dec_s = t1.elapsed().as_secs_f64();
        let n_dec = a.gen_tokens.saturating_sub(1);
        let decode_tps = if n_dec > 0 { n_dec as f64 / dec_s } else { 0.0 };
        let bpt = bytes_per_token(&m, p + a.gen_tokens / 2);
        rows.push(serde_json::json!({
            "prompt_tokens": p,
            "gen_tokens": a.gen_tokens,
            "prefill_tok_s": p as f64 / ttft,
            "ttft_ms": ttft * 1e3,
            "decode_tok_s": decode_tps,
            "bytes_per_token": bpt,
            "bandwidth_pct": 100.0 * bpt as f64 * decode_tps / bw,
        }));
    }
    let peak = peak_rss_bytes();
    println!("calla bench · {} · {} layers · {} experts · backend {:?} · {threads} threads · memory bandwidth {:.1} GB/s · load {:.2} s", a.model.display(), m.cfg.num_hidden_layers, m.cfg.num_experts, m.backend, bw / 1e9, load_s);
    println!("{:>8} {:>14} {:>10} {:>13} {:>14} {:>10}", "prompt", "prefill tok/s", "TTFT ms", "decode tok/s", "bytes/token", "% of BW");
    for r in &rows {
        println!(
            "{:>8} {:>14.1} {:>10.1} {:>13.2} {:>14} {:>10.1}",
            r["prompt_tokens"], r["prefill_tok_s"].as_f64().unwrap_or(0.0), r["ttft_ms"].as_f64().unwrap_or(0.0),
            r["decode_tok_s"].as_f64().unwrap_or(0.0), r["bytes_per_token"], r["bandwidth_pct"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(pk) = peak {
        println!("peak RSS {:.2} GB", pk as f64 / 1e9);
    }
    let out = serde_json::json!({
        "engine": "calla",
        "model": a.model.display().to_string(),
        "layers": m.cfg.num_hidden_layers,
        "experts": m.cfg.num_experts,
        "quantization": m.cfg.quantization.as_ref().map(|q| serde_json::json!({"bits": q.bits, "group_size": q.group_size})),
        "backend": format!("{:?}", m.backend),
        "threads": threads,
        "memory_bandwidth_gb_s": bw / 1e9,
        "peak_rss_bytes": peak,
        "results": rows,
    });
    println!("{}", serde_json::to_string(&out)?);
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&out)?).with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}
