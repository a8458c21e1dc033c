//! The built-in default model: calla's demo model, trained by us with transformers on the
//! Python standard library (scripts/train_demo/README.md): this exact architecture (3 Gated
//! DeltaNet + 1 gated attention layers ×2, 16-expert MoE with a shared expert), width 320, a
//! 16 384-row compact vocabulary (`calla_vocab.json`), 8-bit MLX-layout weights (27 MB), the
//! real tokenizer and chat template. It is embedded in the binary and written to a cache folder
//! on first use, so `calla run` writes real (if naive) text on a fresh machine.

use std::path::PathBuf;

use anyhow::Result;
#[cfg(feature = "demo")]
use anyhow::Context;

/// One line on what the default model is.
pub const DESCRIPTION: &str = "calla's 26M-parameter demo model trained on Python's standard library; it writes Python-flavoured text, not answers";

/// Bump when the default model changes, so stale caches are not reused.
#[cfg(feature = "demo")]
const VERSION: &str = "demo-v1";

static TOKENIZER_JSON: &[u8] = include_bytes!("../../../assets/tokenizer/tokenizer.json");
static CHAT_TEMPLATE: &[u8] = include_bytes!("../../../assets/tokenizer/chat_template.jinja");
#[cfg(feature = "demo")]
static DEMO_CONFIG: &[u8] = include_bytes!("../../../assets/demo/config.json");
#[cfg(feature = "demo")]
static DEMO_GENERATION: &[u8] = include_bytes!("../../../assets/demo/generation_config.json");
#[cfg(feature = "demo")]
static DEMO_VOCAB: &[u8] = include_bytes!("../../../assets/demo/calla_vocab.json");
#[cfg(feature = "demo")]
static DEMO_WEIGHTS: &[u8] = include_bytes!("../../../assets/demo/model.safetensors");

/// Where the default model lives: `$CALLA_HOME`, else `$XDG_CACHE_HOME/calla`, else
/// `~/.cache/calla`, else the system temp folder.
#[cfg(feature = "demo")]
fn cache_root() -> PathBuf {
    if let Some(p) = std::env::var_os("CALLA_HOME") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("calla");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache/calla");
    }
    std::env::temp_dir().join("calla")
}

/// The default model's folder: this build has no built-in model (cargo feature `demo` off, as
/// in the GPU bundle, which must stay small enough to carry).
///
/// # Errors
/// Always, saying to pass `--model`.
#[cfg(not(feature = "demo"))]
pub fn ensure() -> Result<PathBuf> {
    anyhow::bail!("this calla was built without the built-in demo model (cargo feature `demo`); pass --model DIR")
}

/// The default model's folder, written on first use (atomically: built beside, then renamed).
#[cfg(feature = "demo")]
pub fn ensure() -> Result<PathBuf> {
    let dir = cache_root().join(format!("default-{VERSION}"));
    if dir.join("config.json").exists() {
        return Ok(dir);
    }
    let root = cache_root();
    std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let tmp = root.join(format!(".default-{VERSION}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    eprintln!("note: writing the built-in default model to {} (first run only)", dir.display());
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    for (name, bytes) in [
        ("config.json", DEMO_CONFIG),
        ("generation_config.json", DEMO_GENERATION),
        ("calla_vocab.json", DEMO_VOCAB),
        ("model.safetensors", DEMO_WEIGHTS),
        ("tokenizer.json", TOKENIZER_JSON),
        ("chat_template.jinja", CHAT_TEMPLATE),
    ] {
        std::fs::write(tmp.join(name), bytes).with_context(|| format!("cannot write {}", tmp.join(name).display()))?;
    }
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another process won the race: use its folder.
        Err(_) if dir.join("config.json").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(e).with_context(|| format!("cannot move the default model into {}", dir.display())),
    }
}

/// Writes the real tokenizer, chat template and the published generation config into `dir`.
pub fn write_side_files(dir: &std::path::Path) -> Result<()> {
    std::fs::write(dir.join("tokenizer.json"), TOKENIZER_JSON)?;
    std::fs::write(dir.join("chat_template.jinja"), CHAT_TEMPLATE)?;
    let gen = serde_json::json!({
        "bos_token_id": spec::tokens::ENDOFTEXT,
        "do_sample": true,
        "eos_token_id": [spec::tokens::IM_END, spec::tokens::ENDOFTEXT],
        "pad_token_id": spec::tokens::ENDOFTEXT,
        "temperature": 1.0, "top_k": 20, "top_p": 0.95
    });
    std::fs::write(dir.join("generation_config.json"), serde_json::to_string_pretty(&gen)?)?;
    Ok(())
}
