//! `calla serve` (the OpenAI-compatible server) and `calla probe` (does the model fit here?).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use router::probe::{self, ProbeReport};
use router::Config;

/// `calla serve`.
#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: crate::ModelArg,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0: any free port; the bound address is printed as `listening on http://ADDR`).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// JSON config: hybridRouting, cloud, memoryAllocationGB, breaker, limits... (docs/SERVER.md).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Serve /admin/* (fault injection, breaker control). Loopback drills and tests only.
    #[arg(long)]
    admin: bool,
    #[command(flatten)]
    device: crate::DeviceArg,
}

/// `calla probe`.
#[derive(Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    model: crate::ModelArg,
    /// JSON config (its memoryAllocationGB, maxContextTokens and memoryMonitor paths are used).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Context for the KV-cache estimate, tokens (default: the config's maxContextTokens, else 32768).
    #[arg(long)]
    context: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn load_config(p: &Option<PathBuf>) -> Result<Config> {
    Ok(match p {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    })
}

fn report(dir: &std::path::Path, cfg: &Config, context: Option<usize>) -> Result<ProbeReport> {
    let mm = &cfg.memory_monitor;
    let mem = probe::read_memory(&mm.meminfo_path, &mm.psi_path);
    let ctx = context.or(cfg.max_context_tokens).unwrap_or(32_768);
    probe::probe(dir, cfg.memory_allocation_gb, ctx, mem).map_err(anyhow::Error::msg)
}

/// Runs `calla probe`: exit status 0 when local mode fits, 2 when it does not.
pub fn probe_cmd(a: ProbeArgs) -> Result<()> {
    let dir = crate::model_dir(&a.model)?;
    let cfg = load_config(&a.config)?;
    let r = report(&dir, &cfg, a.context)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        let gb = |b: Option<u64>| b.map_or("unknown".to_string(), |b| format!("{:.2} GB", b as f64 / 1e9));
        println!("memory      total {} · available {}", gb(r.memory.total_bytes), gb(r.memory.available_bytes));
        match (r.memory.psi_some_avg10, r.memory.psi_full_avg10) {
            (Some(s), Some(f)) => println!("pressure    PSI some avg10 {s:.2}% · full avg10 {f:.2}%"),
            _ => println!("pressure    PSI not available"),
        }
        if r.gpus.is_empty() {
            println!("gpu         none (nvidia-smi not found or no NVIDIA GPU)");
        }
        for g in &r.gpus {
            println!(
                "gpu         {} · {} MiB total · {} MiB free · compute capability {}",
                g.name, g.memory_total_mib, g.memory_free_mib, g.compute_capability
            );
        }
        println!("cpu         {} · {} threads", r.cpu_model.as_deref().unwrap_or("unknown"), r.cpu_threads);
        println!("cpu feature {}", r.cpu_features.join(" "));
        let fp = &r.fit.footprint;
        println!(
            "model       {} · weights {:.3} GB · KV at {} tokens {:.3} GB · GDN state {:.4} GB · headroom {:.2} GB",
            r.model_dir,
            fp.weights_bytes as f64 / 1e9,
            r.context_tokens,
            fp.kv_cache_bytes as f64 / 1e9,
            fp.gdn_state_bytes as f64 / 1e9,
            fp.headroom_bytes as f64 / 1e9
        );
        println!("local mode  {}", r.fit.verdict);
    }
    if !r.fit.fits {
        std::process::exit(2);
    }
    Ok(())
}

/// Runs `calla serve`.
pub fn serve_cmd(a: ServeArgs) -> Result<()> {
    let dir = crate::model_dir(&a.model)?;
    let cfg = load_config(&a.config)?;
    let r = report(&dir, &cfg, None)?;
    let (local, off_reason) = if r.fit.fits {
        (true, None)
    } else if cfg.cloud.is_some() {
        eprintln!("warning: local mode refused: {}; serving through the cloud upstream only", r.fit.verdict);
        (false, Some(format!("local mode refused by the probe: {}", r.fit.verdict)))
    } else {
        bail!(
            "refusing to start local mode: {} (set memoryAllocationGB, free memory, or configure a cloud upstream)",
            r.fit.verdict
        );
    };
    tracing::info!(target: "calla::probe", fits = r.fit.fits, verdict = %r.fit.verdict, "pre-flight probe");
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .or_else(|_| {
            use std::net::ToSocketAddrs;
            format!("{}:{}", a.host, a.port).to_socket_addrs().ok().and_then(|mut i| i.next()).ok_or(())
        })
        .map_err(|_| anyhow::anyhow!("cannot resolve --host {}", a.host))?;
    let rt =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the async runtime")?;
    rt.block_on(server::serve(
        server::ServeOptions {
            model_dir: dir,
            config: cfg,
            admin: a.admin,
            local,
            local_off_reason: off_reason,
            accelerator: a.device.factory()?,
        },
        addr,
    ))
}
