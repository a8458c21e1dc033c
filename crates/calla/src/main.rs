//! `calla`: command-line front end. Each subcommand is a thin layer over the crates.

#[cfg(feature = "cuda")]
mod cuda_cmd;
mod default_model;
mod serve_cmd;
mod tools_cmd;

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use engine::{Engine, GenerateParams};
use model::{Logits, Model};
use sampler::SamplingParams;
use text::{ChatRequest, ChatTemplate, Tokenizer};

#[derive(Parser)]
#[command(name = "calla", version, about = "A single-model inference appliance for Qwen3.6-35B-A3B", long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a random-weight checkpoint of the real shapes (bf16 published layout, or MLX 4/8-bit).
    Synth(tools_cmd::SynthArgs),
    /// Quantize a bf16 snapshot into MLX's affine layout (4 or 8 bits).
    Convert(tools_cmd::ConvertArgs),
    /// Write the float32 Hugging Face layout of a quantized model (for checks against transformers).
    Dequantize(tools_cmd::DequantizeArgs),
    /// Measure prefill and decode speed, TTFT, peak RSS and bandwidth use on a model.
    Bench(tools_cmd::BenchArgs),
    /// Measure the CUDA backend: TTFT, prefill and decode tok/s at several contexts, % of the copy roofline.
    #[cfg(feature = "cuda")]
    CudaBench(cuda_cmd::CudaBenchArgs),
    /// Check the CUDA decode path end to end against the CPU path on one checkpoint.
    #[cfg(feature = "cuda")]
    CudaCheck(cuda_cmd::CudaCheckArgs),
    /// Compile every CUDA kernel into the kernel cache with NVRTC (no GPU needed).
    #[cfg(feature = "cuda")]
    CudaCompile(cuda_cmd::CudaCompileArgs),
    /// OpenAI-compatible HTTP server with hybrid local/cloud routing (docs/SERVER.md).
    Serve(serve_cmd::ServeArgs),
    /// Host report and whether the model fits for local mode (exit 2 when it does not).
    Probe(serve_cmd::ProbeArgs),
    /// Chat-formatted generation streamed to stdout; a one-line summary on stderr.
    Run(RunArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize {
        #[command(flatten)]
        model: ModelArg,
        /// The text to encode (no special tokens are added; special-token strings in the text are matched).
        #[arg(long)]
        text: String,
    },
    /// Render an OpenAI chat-completions request body (JSON file) to the prompt text.
    Template {
        #[command(flatten)]
        model: ModelArg,
        /// Request body: messages, tools, chat_template_kwargs, add_generation_prompt.
        #[arg(long)]
        request: PathBuf,
    },
    /// Write the logits of one full-prompt forward pass to a safetensors file (`logits`, [T, vocab] f32).
    Logits {
        #[command(flatten)]
        model: ModelArg,
        /// Comma-separated token ids.
        #[arg(long)]
        ids: String,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
    },
    /// Generate from token ids with the cache (prefill, then decode steps); prints {"ids": [...]}.
    Generate {
        #[command(flatten)]
        model: ModelArg,
        /// Comma-separated prompt token ids.
        #[arg(long)]
        ids: String,
        /// Most new tokens.
        #[arg(long, default_value_t = 16)]
        max_tokens: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// Keep going past end-of-turn / end-of-text ids.
        #[arg(long)]
        ignore_eos: bool,
        #[command(flatten)]
        device: DeviceArg,
    },
}

#[derive(Args)]
struct ModelArg {
    /// Hugging Face snapshot folder (config.json, *.safetensors, tokenizer.json, chat template).
    /// Without it, calla uses its built-in default model.
    #[arg(long, env = "CALLA_MODEL")]
    model: Option<PathBuf>,
}

/// Where generations run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Device {
    /// The CPU path (every build).
    Cpu,
    /// An NVIDIA Hopper GPU (H100/H200; builds with `--features cuda`, see docs/CUDA.md).
    Cuda,
}

#[derive(Args, Clone)]
struct DeviceArg {
    /// Where generations run: `cpu`, or `cuda` (the GPU backend: batched prefill, decode-step
    /// graphs, sampling on the device).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// CUDA device ordinal (with `--device cuda`).
    #[arg(long, default_value_t = 0)]
    cuda_device: usize,
    /// Longest batched-prefill chunk in tokens (with `--device cuda`; its buffers take about
    /// 260 kB per token).
    #[arg(long, default_value_t = 8192)]
    prefill_chunk: usize,
}

impl DeviceArg {
    /// The accelerator factory for the engine thread (`None` on the CPU).
    ///
    /// # Errors
    /// `--device cuda` in a build without the `cuda` feature.
    fn factory(&self) -> Result<Option<engine::worker::AcceleratorFactory>> {
        match self.device {
            Device::Cpu => Ok(None),
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                let (ordinal, chunk) = (self.cuda_device, self.prefill_chunk);
                Ok(Some(Box::new(move |eng: &Engine| cuda_cmd::accelerator(eng, ordinal, chunk).map_err(|e| format!("{e:#}")))))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => bail!(
                "this calla was built without the CUDA backend: build it with `cargo build --release --features cuda` (docs/CUDA.md)"
            ),
        }
    }
}

#[derive(Args, Clone)]
struct SamplingArgs {
    /// Greedy decoding (argmax), overriding the other sampling settings.
    #[arg(long)]
    greedy: bool,
    /// Softmax temperature (0 = greedy). Default: generation_config.json.
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long)]
    top_k: Option<usize>,
    /// Drop tokens below min_p × the top probability.
    #[arg(long)]
    min_p: Option<f32>,
    /// Additive penalty on every token already generated (OpenAI presence_penalty).
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// Multiplicative penalty on tokens already generated (transformers repetition_penalty).
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Seed for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    fn apply(&self, mut p: SamplingParams) -> SamplingParams {
        if let Some(x) = self.temperature {
            p.temperature = x;
        }
        if let Some(x) = self.top_p {
            p.top_p = x;
        }
        if let Some(x) = self.top_k {
            p.top_k = x;
        }
        if let Some(x) = self.min_p {
            p.min_p = x;
        }
        if let Some(x) = self.presence_penalty {
            p.presence_penalty = x;
        }
        if let Some(x) = self.repetition_penalty {
            p.repetition_penalty = x;
        }
        if self.seed.is_some() {
            p.seed = self.seed;
        }
        if self.greedy {
            p.temperature = 0.0;
        }
        p
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArg,
    /// The user message.
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the user message from a UTF-8 file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// A system message.
    #[arg(long)]
    system: Option<String>,
    /// Most new tokens.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Context limit in tokens (prompt plus output); default: the model's maximum.
    #[arg(long)]
    max_context: Option<usize>,
    /// Disable thinking (`enable_thinking: false` in the chat template).
    #[arg(long)]
    no_think: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    device: DeviceArg,
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        telemetry::init_json_logs();
    }
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("CALLA_LOG").unwrap_or_else(|_| "warn".into()))
        .try_init();
    let cli = Cli::parse();
    if let Err(e) = dispatch(cli.cmd) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn dispatch(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Run(a) => run(a),
        Cmd::Synth(a) => tools_cmd::synth(a),
        Cmd::Convert(a) => tools_cmd::convert(a),
        Cmd::Bench(a) => tools_cmd::bench(a),
        #[cfg(feature = "cuda")]
        Cmd::CudaBench(a) => cuda_cmd::bench(a),
        #[cfg(feature = "cuda")]
        Cmd::CudaCheck(a) => cuda_cmd::check(a),
        #[cfg(feature = "cuda")]
        Cmd::CudaCompile(a) => cuda_cmd::compile(a),
        Cmd::Dequantize(a) => tools_cmd::dequantize(a),
        Cmd::Serve(a) => serve_cmd::serve_cmd(a),
        Cmd::Probe(a) => serve_cmd::probe_cmd(a),
        Cmd::Tokenize { model, text } => {
            let dir = model_dir(&model)?;
            let tok = Tokenizer::from_dir(&dir)?.with_context(|| format!("{} has no tokenizer.json", dir.display()))?;
            println!("{}", serde_json::to_string(&tok.encode(&text)?)?);
            Ok(())
        }
        Cmd::Template { model, request } => {
            let dir = model_dir(&model)?;
            let body = std::fs::read_to_string(&request).with_context(|| format!("cannot read {}", request.display()))?;
            let v: serde_json::Value =
                serde_json::from_str(&body).with_context(|| format!("{} is not valid JSON", request.display()))?;
            let req = ChatRequest::from_openai_json(&v)?;
            let t = ChatTemplate::from_dir(&dir)?.with_context(|| format!("{} has no chat template", dir.display()))?;
            let out = t.render(&req)?;
            let mut so = std::io::stdout().lock();
            so.write_all(out.as_bytes())?;
            so.flush()?;
            Ok(())
        }
        Cmd::Logits { model, ids, out } => {
            let dir = model_dir(&model)?;
            let ids = parse_ids(&ids)?;
            let m = Model::open(&dir)?;
            let mut st = m.new_state(ids.len());
            let logits = m.forward(&mut st, &ids, Logits::All)?;
            let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![ids.len(), m.cfg.vocab_size], &bytes)?;
            safetensors::serialize_to_file(vec![("logits", view)], None, &out)
                .with_context(|| format!("cannot write {}", out.display()))?;
            Ok(())
        }
        Cmd::Generate { model, ids, max_tokens, sampling, ignore_eos, device } => {
            let dir = model_dir(&model)?;
            let ids = parse_ids(&ids)?;
            let factory = device.factory()?;
            let mut eng = Engine::open(&dir, usize::MAX)?;
            if let Some(make) = factory {
                eng.set_accelerator(make(&eng).map_err(anyhow::Error::msg)?);
            }
            let params = GenerateParams {
                sampling: sampling.apply(eng.default_sampling()),
                max_tokens,
                stop_on_eos: !ignore_eos,
            };
            let mut out = Vec::new();
            let stats = eng.generate(&ids, &params, |id| {
                out.push(id);
                true
            })?;
            println!("{}", serde_json::json!({ "ids": out }));
            eprintln!("{} · {}", stats.summary(), eng.backend_name());
            Ok(())
        }
    }
}

fn run(a: RunArgs) -> Result<()> {
    let dir = model_dir(&a.model)?;
    let user = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => {
            let bytes = std::fs::read(f).with_context(|| format!("cannot read prompt file {}", f.display()))?;
            String::from_utf8(bytes).map_err(|e| {
                anyhow::anyhow!("prompt file {} is not valid UTF-8 (first bad byte at offset {})", f.display(), e.utf8_error().valid_up_to())
            })?
        }
        (None, None) => bail!("give a prompt with --prompt TEXT or --prompt-file FILE"),
    };
    if user.trim().is_empty() {
        bail!("the prompt is empty");
    }
    let t_load = Instant::now();
    let factory = a.device.factory()?;
    let mut eng = Engine::open(&dir, a.max_context.unwrap_or(usize::MAX))?;
    if let Some(make) = factory {
        let acc = make(&eng).map_err(anyhow::Error::msg)?;
        eng.set_accelerator(acc);
    }
    let load_s = t_load.elapsed().as_secs_f64();
    let mut messages = Vec::new();
    if let Some(s) = &a.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    messages.push(serde_json::json!({"role": "user", "content": user}));
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(!a.no_think));
    let req = ChatRequest { messages, tools: None, add_generation_prompt: true, kwargs };
    let prompt = eng.render(&req)?;
    let ids = eng.tokenizer()?.encode(&prompt)?;
    let params = GenerateParams { sampling: a.sampling.apply(eng.default_sampling()), max_tokens: a.max_tokens, stop_on_eos: true };
    let mut so = std::io::stdout().lock();
    let mut write_err = None;
    let (_, stats) = eng.generate_text(&ids, &params, |piece| match so.write_all(piece.as_bytes()).and_then(|_| so.flush()) {
        Ok(()) => true,
        Err(e) => {
            write_err = Some(e);
            false
        }
    })?;
    if let Some(e) = write_err {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
    }
    writeln!(so)?;
    eprintln!("{} · load {load_s:.2} s · {}", stats.summary(), eng.backend_name());
    Ok(())
}

/// The `--model` folder, or the built-in default model (created on first use).
fn model_dir(m: &ModelArg) -> Result<PathBuf> {
    match &m.model {
        Some(p) => {
            if !p.is_dir() {
                bail!("model folder {} does not exist (give a Hugging Face snapshot folder of Qwen3.6-35B-A3B)", p.display());
            }
            Ok(p.clone())
        }
        None => {
            let dir = default_model::ensure()?;
            eprintln!(
                "note: no --model given, using calla's built-in default model at {} ({}). To run Qwen3.6-35B-A3B, download its snapshot (e.g. `huggingface-cli download Qwen/Qwen3.6-35B-A3B --local-dir DIR`) and pass --model DIR.",
                dir.display(),
                default_model::DESCRIPTION
            );
            Ok(dir)
        }
    }
}

fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(|x| x.trim())
        .filter(|x| !x.is_empty())
        .map(|x| x.parse::<u32>().with_context(|| format!("`{x}` in --ids is not a token id")))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--ids is empty: give comma-separated token ids");
    }
    Ok(ids)
}
