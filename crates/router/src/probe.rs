//! Pre-flight probe (`calla probe`) and the runtime memory monitor.
//!
//! The probe reports the host (RAM, GPUs through `nvidia-smi` when present, CPU features) and
//! whether the model fits: weights as stored + KV cache for the context + Gated DeltaNet state +
//! headroom, against `memoryAllocationGB` when set, else MemAvailable (or free GPU memory when a
//! GPU is present). The monitor re-reads MemAvailable and Linux PSI periodically; its samples
//! feed the breaker.

use std::path::Path;

use serde::Serialize;
use spec::{LayerKind, TextConfig};

/// One memory reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct MemorySample {
    /// MemTotal, bytes.
    pub total_bytes: Option<u64>,
    /// MemAvailable, bytes.
    pub available_bytes: Option<u64>,
    /// PSI memory `some avg10`, percent.
    pub psi_some_avg10: Option<f64>,
    /// PSI memory `full avg10`, percent.
    pub psi_full_avg10: Option<f64>,
}

/// `MemTotal` and `MemAvailable` of a `/proc/meminfo` text, bytes.
pub fn parse_meminfo(s: &str) -> (Option<u64>, Option<u64>) {
    let field = |name: &str| {
        s.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let mut it = rest.split_whitespace();
            let n: u64 = it.next()?.parse().ok()?;
            Some(match it.next() {
                Some("kB") | Some("KB") => n * 1024,
                _ => n,
            })
        })
    };
    (field("MemTotal"), field("MemAvailable"))
}

/// `some avg10` and `full avg10` of a `/proc/pressure/memory` text.
pub fn parse_psi(s: &str) -> (Option<f64>, Option<f64>) {
    let avg10 = |kind: &str| {
        s.lines().find_map(|l| {
            let rest = l.strip_prefix(kind)?;
            rest.split_whitespace().find_map(|kv| kv.strip_prefix("avg10=")?.parse::<f64>().ok())
        })
    };
    (avg10("some "), avg10("full "))
}

/// Reads both files (a missing file gives `None`s: PSI is absent on older kernels and in some containers).
pub fn read_memory(meminfo_path: &str, psi_path: &str) -> MemorySample {
    let (total_bytes, available_bytes) =
        std::fs::read_to_string(meminfo_path).map(|s| parse_meminfo(&s)).unwrap_or((None, None));
    let (psi_some_avg10, psi_full_avg10) =
        std::fs::read_to_string(psi_path).map(|s| parse_psi(&s)).unwrap_or((None, None));
    MemorySample { total_bytes, available_bytes, psi_some_avg10, psi_full_avg10 }
}

/// A GPU as `nvidia-smi` reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuInfo {
    /// Product name.
    pub name: String,
    /// Total memory, MiB.
    pub memory_total_mib: u64,
    /// Free memory, MiB.
    pub memory_free_mib: u64,
    /// Compute capability (`9.0`).
    pub compute_capability: String,
}

/// Parses `nvidia-smi --query-gpu=name,memory.total,memory.free,compute_cap --format=csv,noheader,nounits`.
pub fn parse_nvidia_smi(s: &str) -> Vec<GpuInfo> {
    s.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            if f.len() < 4 {
                return None;
            }
            Some(GpuInfo {
                name: f[0].to_string(),
                memory_total_mib: f[1].parse().ok()?,
                memory_free_mib: f[2].parse().ok()?,
                compute_capability: f[3].to_string(),
            })
        })
        .collect()
}

/// GPUs on this host (empty when `nvidia-smi` is absent or fails).
pub fn gpus() -> Vec<GpuInfo> {
    std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name,memory.total,memory.free,compute_cap", "--format=csv,noheader,nounits"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| parse_nvidia_smi(&String::from_utf8_lossy(&o.stdout)))
        .unwrap_or_default()
}

/// SIMD features the CPU kernels can use.
pub fn cpu_features() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! f {
            ($($name:tt),*) => { $( if std::arch::is_x86_feature_detected!($name) { v.push($name); } )* };
        }
        f!("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512bf16", "avx512vnni");
    }
    #[cfg(target_arch = "aarch64")]
    {
        macro_rules! f {
            ($($name:tt),*) => { $( if std::arch::is_aarch64_feature_detected!($name) { v.push($name); } )* };
        }
        f!("neon", "fp16", "bf16", "dotprod", "i8mm", "sve");
    }
    v
}

/// The CPU model name from `/proc/cpuinfo`.
pub fn cpu_model() -> Option<String> {
    let s = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string()))
}

/// Memory the model needs, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Footprint {
    /// Weights as stored (the safetensors files: their dtype or quantization).
    pub weights_bytes: u64,
    /// KV cache of the attention layers at the context limit.
    pub kv_cache_bytes: u64,
    /// Gated DeltaNet conv + recurrent state.
    pub gdn_state_bytes: u64,
    /// Activations, allocator slack and the OS: max(1 GiB, 10% of the rest).
    pub headroom_bytes: u64,
    /// The sum.
    pub total_bytes: u64,
}

/// The footprint of `cfg` with `weights_bytes` of weights at `ctx_tokens` of context, cache
/// elements of `state_elem_bytes` bytes (4: the reference path keeps f32 state).
pub fn footprint(cfg: &TextConfig, weights_bytes: u64, ctx_tokens: usize, state_elem_bytes: usize) -> Footprint {
    let n_attn = cfg.layer_types.iter().filter(|k| **k == LayerKind::FullAttention).count();
    let n_gdn = cfg.layer_types.len() - n_attn;
    // K and V: [ctx, n_kv_heads, head_dim] each, per attention layer.
    let kv = (n_attn * 2 * ctx_tokens * cfg.num_key_value_heads * cfg.head_dim * state_elem_bytes) as u64;
    // conv: [kernel-1, conv_dim]; S: [n_v, d_k, d_v]; per GDN layer (always f32).
    let gdn = (n_gdn
        * ((cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim()
            + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim)
        * 4) as u64;
    let rest = weights_bytes + kv + gdn;
    let headroom = (1u64 << 30).max(rest / 10);
    Footprint {
        weights_bytes,
        kv_cache_bytes: kv,
        gdn_state_bytes: gdn,
        headroom_bytes: headroom,
        total_bytes: rest + headroom,
    }
}

/// Bytes of `*.safetensors` files in a snapshot folder.
pub fn weights_bytes(dir: &Path) -> std::io::Result<u64> {
    let mut n = 0;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.path().extension().is_some_and(|x| x == "safetensors") {
            n += e.metadata()?.len();
        }
    }
    Ok(n)
}

/// Memory the model may use, and where the number came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Budget {
    /// Bytes.
    pub bytes: u64,
    /// `memoryAllocationGB`, `MemAvailable` or `gpu_free_memory`.
    pub source: &'static str,
}

/// The budget: `memoryAllocationGB` when set (capped by what is physically there), else free GPU
/// memory of the largest GPU when present, else MemAvailable.
pub fn budget(allocation_gb: Option<f64>, mem: &MemorySample, gpus: &[GpuInfo]) -> Option<Budget> {
    let gpu_free = gpus.iter().map(|g| g.memory_free_mib * (1 << 20)).max();
    let physical = gpu_free.or(mem.available_bytes);
    match allocation_gb {
        Some(gb) => {
            let want = (gb * 1e9) as u64;
            Some(Budget { bytes: physical.map_or(want, |p| want.min(p)), source: "memoryAllocationGB" })
        }
        None => match gpu_free {
            Some(b) => Some(Budget { bytes: b, source: "gpu_free_memory" }),
            None => mem.available_bytes.map(|b| Budget { bytes: b, source: "MemAvailable" }),
        },
    }
}

/// Whether local mode fits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fit {
    /// It fits.
    pub fits: bool,
    /// The footprint.
    pub footprint: Footprint,
    /// The budget (None: unknown, treated as fitting).
    pub budget: Option<Budget>,
    /// One line for people.
    pub verdict: String,
}

/// Compares a footprint with a budget.
pub fn fit(fp: Footprint, budget: Option<Budget>) -> Fit {
    let gb = |b: u64| b as f64 / 1e9;
    let (fits, verdict) = match &budget {
        None => (true, format!("needs {:.2} GB; available memory unknown: assuming it fits", gb(fp.total_bytes))),
        Some(b) if fp.total_bytes <= b.bytes => {
            (true, format!("fits: needs {:.2} GB of {:.2} GB ({})", gb(fp.total_bytes), gb(b.bytes), b.source))
        }
        Some(b) => (
            false,
            format!(
                "does not fit: needs {:.2} GB (weights {:.2} + KV {:.2} + GDN state {:.3} + headroom {:.2}) but {} allows {:.2} GB",
                gb(fp.total_bytes),
                gb(fp.weights_bytes),
                gb(fp.kv_cache_bytes),
                gb(fp.gdn_state_bytes),
                gb(fp.headroom_bytes),
                b.source,
                gb(b.bytes)
            ),
        ),
    };
    Fit { fits, footprint: fp, budget, verdict }
}

/// Everything `calla probe` prints.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// RAM and PSI.
    pub memory: MemorySample,
    /// GPUs.
    pub gpus: Vec<GpuInfo>,
    /// CPU model name.
    pub cpu_model: Option<String>,
    /// Logical CPUs.
    pub cpu_threads: usize,
    /// SIMD features.
    pub cpu_features: Vec<&'static str>,
    /// The model folder probed.
    pub model_dir: String,
    /// Context used for the KV estimate, tokens.
    pub context_tokens: usize,
    /// The verdict.
    pub fit: Fit,
}

/// Probes this host for the model in `dir`.
///
/// # Errors
/// The model's config cannot be read.
pub fn probe(
    dir: &Path,
    allocation_gb: Option<f64>,
    ctx_tokens: usize,
    mem: MemorySample,
) -> Result<ProbeReport, String> {
    let cfg = TextConfig::from_dir(dir).map_err(|e| e.to_string())?;
    let wb = weights_bytes(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let gpus = gpus();
    let fp = footprint(&cfg, wb, ctx_tokens.min(cfg.max_position_embeddings), 4);
    let b = budget(allocation_gb, &mem, &gpus);
    Ok(ProbeReport {
        memory: mem,
        cpu_model: cpu_model(),
        cpu_threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        cpu_features: cpu_features(),
        model_dir: dir.display().to_string(),
        context_tokens: ctx_tokens,
        fit: fit(fp, b),
        gpus,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_psi() {
        let m = "MemTotal:       24598512 kB\nMemFree:  1 kB\nMemAvailable:   23000000 kB\n";
        assert_eq!(parse_meminfo(m), (Some(24598512 * 1024), Some(23000000 * 1024)));
        assert_eq!(parse_meminfo("garbage"), (None, None));
        let p = "some avg10=1.50 avg60=0.20 avg300=0.00 total=123\nfull avg10=0.25 avg60=0.00 avg300=0.00 total=9\n";
        assert_eq!(parse_psi(p), (Some(1.5), Some(0.25)));
        assert_eq!(read_memory("/nonexistent/a", "/nonexistent/b"), MemorySample::default());
    }

    #[test]
    fn nvidia_smi_lines() {
        let g = parse_nvidia_smi("NVIDIA H200, 143771, 140000, 9.0\nbad line\n");
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].compute_capability, "9.0");
        assert_eq!(g[0].memory_free_mib, 140000);
    }

    #[test]
    fn production_footprint_and_fit_table() {
        let cfg = TextConfig::from_json(&serde_json::json!({
            "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144, "full_attention_interval": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1.0e7, "partial_rotary_factor": 0.25}
        }));
        let cfg = cfg.expect("production config parses");
        let fp = footprint(&cfg, 19_000_000_000, 32768, 2);
        // 10 attention layers x K,V x 32768 x 2 heads x 256 x 2 bytes = 640 MiB.
        assert_eq!(fp.kv_cache_bytes, 10 * 2 * 32768 * 2 * 256 * 2);
        // 30 GDN layers x (3 x 8192 conv + 32 x 128 x 128) x 4 bytes.
        assert_eq!(fp.gdn_state_bytes, 30 * (3 * 8192 + 32 * 128 * 128) * 4);
        let m = MemorySample { available_bytes: Some(64_000_000_000), ..Default::default() };
        let cases = [(Some(28.5), true), (Some(16.0), false), (None, true)];
        for (gb, want) in cases {
            let f = fit(fp, budget(gb, &m, &[]));
            assert_eq!(f.fits, want, "{gb:?}: {}", f.verdict);
        }
        let small = MemorySample { available_bytes: Some(8_000_000_000), ..Default::default() };
        assert!(!fit(fp, budget(Some(28.5), &small, &[])).fits, "allocation capped by what exists");
        let gpu = [GpuInfo {
            name: "g".into(),
            memory_total_mib: 143771,
            memory_free_mib: 140000,
            compute_capability: "9.0".into(),
        }];
        assert_eq!(budget(None, &small, &gpu).unwrap().source, "gpu_free_memory");
    }
}
