//! The server configuration file (`calla serve --config FILE`), in the design's JSON shape.
//!
//! ```json
//! {"engine": "calla", "model": "Qwen3.6-35B-A3B",
//!  "hybridRouting": {"routeLocal": ["file_system", "user_credentials"],
//!                    "routeCloud": ["web_search", "citation_index"],
//!                    "toolCategories": {"read_file": "file_system"}},
//!  "memoryAllocationGB": 28.5,
//!  "cloud": {"baseUrl": "http://...", "apiKeyEnv": "CLOUD_API_KEY", "model": "..."}}
//! ```
//! Every section and field is optional; unknown fields are refused, naming the field.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::breaker::BreakerConfig;

/// Why a config file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid JSON or not the expected shape.
    #[error("config {path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// serde's message (names the field and line).
        message: String,
    },
}

/// The whole configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Config {
    /// Informational: the engine name (`calla`).
    pub engine: Option<String>,
    /// The model name reported by `/v1/models` (default `Qwen3.6-35B-A3B`).
    pub model: Option<String>,
    /// Data categories and where they may go.
    pub hybrid_routing: HybridRouting,
    /// Memory the local engine may use, GB (10^9 bytes); the probe checks the model fits in it.
    #[serde(rename = "memoryAllocationGB")]
    pub memory_allocation_gb: Option<f64>,
    /// The cloud upstream (any OpenAI-compatible server).
    pub cloud: Option<CloudConfig>,
    /// Circuit-breaker thresholds.
    pub breaker: BreakerConfig,
    /// Request limits.
    pub limits: Limits,
    /// Thinking default when a request does not set `chat_template_kwargs.enable_thinking`.
    pub enable_thinking: Option<bool>,
    /// Memory-pressure monitor.
    pub memory_monitor: MemoryMonitorConfig,
    /// Admin endpoints (`/admin/faults`): off unless enabled here or with `--admin`.
    pub admin: AdminConfig,
    /// Append one JSON line per received request (route, categories, body) to this file.
    pub audit_log: Option<String>,
    /// Prefix-cache snapshots kept by the engine (default 2; 0 disables reuse).
    pub prefix_cache: Option<usize>,
    /// Context limit of the local engine in tokens (default 32768).
    pub max_context_tokens: Option<usize>,
}

/// `hybridRouting`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct HybridRouting {
    /// Categories pinned to the local engine: never sent upstream.
    pub route_local: Vec<String>,
    /// Categories that go to the cloud upstream when it is configured and healthy.
    pub route_cloud: Vec<String>,
    /// Tool name → category. A tool whose name is itself a category name needs no entry.
    pub tool_categories: BTreeMap<String, String>,
    /// Category of a declared or called tool that has no entry (default: none).
    pub unmapped_tool_category: Option<String>,
}

/// `cloud`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct CloudConfig {
    /// Base URL including `/v1` (e.g. `https://api.example.com/v1`); a URL without `/v1` gets it appended.
    pub base_url: String,
    /// Environment variable holding the API key (sent as `Authorization: Bearer`).
    pub api_key_env: Option<String>,
    /// Model name sent upstream (default: the request's).
    pub model: Option<String>,
    /// Whole-request timeout, seconds (default 300).
    pub timeout_seconds: Option<u64>,
    /// Connect timeout, seconds (default 5).
    pub connect_timeout_seconds: Option<u64>,
}

/// `limits`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Limits {
    /// Largest request body, bytes (413 above).
    pub max_body_bytes: usize,
    /// Longest prompt, tokens (400 above).
    pub max_prompt_tokens: usize,
    /// Requests waiting for the engine thread (429 above).
    pub queue_depth: usize,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_body_bytes: 4 << 20, max_prompt_tokens: 32_000, queue_depth: 16, default_max_tokens: 4096 }
    }
}

/// `memoryMonitor`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct MemoryMonitorConfig {
    /// Source of MemTotal / MemAvailable.
    pub meminfo_path: String,
    /// Linux PSI memory file.
    pub psi_path: String,
    /// Sampling period, milliseconds.
    pub interval_ms: u64,
}

impl Default for MemoryMonitorConfig {
    fn default() -> Self {
        MemoryMonitorConfig {
            meminfo_path: "/proc/meminfo".into(),
            psi_path: "/proc/pressure/memory".into(),
            interval_ms: 1000,
        }
    }
}

/// `admin`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct AdminConfig {
    /// Serve `/admin/*` (fault injection, breaker reset). Loopback deployments and tests only.
    pub enabled: bool,
}

impl Config {
    /// Parses a config document.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the field.
    pub fn from_json_str(s: &str, path: &str) -> Result<Self, ConfigError> {
        serde_json::from_str(s).map_err(|e| ConfigError::Invalid { path: path.into(), message: e.to_string() })
    }

    /// Reads a config file.
    ///
    /// # Errors
    /// [`ConfigError`].
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let p = path.display().to_string();
        let s = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
        Self::from_json_str(&s, &p)
    }

    /// The model name served.
    pub fn model_name(&self) -> String {
        self.model.clone().unwrap_or_else(|| "Qwen3.6-35B-A3B".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn design_example_parses() {
        let c = Config::from_json_str(
            r#"{"engine": "calla", "model": "Qwen3.6-35B-A3B", "hybridRouting": {"routeLocal": ["file_system",
            "user_credentials"], "routeCloud": ["web_search", "citation_index"]}, "memoryAllocationGB": 28.5,
            "cloud": {"baseUrl": "http://127.0.0.1:9/v1", "apiKeyEnv": "CLOUD_API_KEY", "model": "m"}}"#,
            "x.json",
        )
        .unwrap();
        assert_eq!(c.hybrid_routing.route_local, ["file_system", "user_credentials"]);
        assert_eq!(c.memory_allocation_gb, Some(28.5));
        assert_eq!(c.cloud.unwrap().api_key_env.as_deref(), Some("CLOUD_API_KEY"));
        assert_eq!(c.breaker.ttft_p95_ms, 1500.0);
    }

    #[test]
    fn unknown_field_is_named() {
        let e = Config::from_json_str(r#"{"hybridRouting": {"routeLokal": []}}"#, "x.json").unwrap_err().to_string();
        assert!(e.contains("routeLokal"), "{e}");
    }
}
