//! The built-in default model: this architecture at a small size with the real tokenizer and
//! chat template, written to a cache folder on first use so that `calla run` works on a fresh
//! machine with nothing downloaded. Its weights are random (seeded), so it writes noise; it
//! exists to exercise every part of the pipeline, not to answer questions.

use std::path::PathBuf;

use anyhow::{Context, Result};

/// One line on what the default model is.
pub const DESCRIPTION: &str = "random weights of this architecture at 4 layers and width 64, real tokenizer: expect noise";

/// Bump when the default model's recipe changes, so stale caches are not reused.
const VERSION: &str = "random-v2";
const SEED: u64 = 20261129;

static TOKENIZER_JSON: &[u8] = include_bytes!("../../../assets/tokenizer/tokenizer.json");
static CHAT_TEMPLATE: &[u8] = include_bytes!("../../../assets/tokenizer/chat_template.jinja");

/// Where the default model lives: `$CALLA_HOME`, else `$XDG_CACHE_HOME/calla`, else
/// `~/.cache/calla`, else the system temp folder.
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

/// The default model's folder, written on first use (atomically: built beside, then renamed).
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
    model::synth::write_checkpoint(&tmp, &model::synth::default_model_config(), SEED, true, usize::MAX)
        .map_err(anyhow::Error::msg)?;
    write_side_files(&tmp)?;
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
