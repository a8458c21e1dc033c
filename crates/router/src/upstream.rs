//! The cloud upstream: any OpenAI-compatible server, reached with `reqwest`. Responses are
//! returned unread so the server can pass streams through byte for byte.

use std::time::Duration;

use serde_json::Value;

use crate::config::CloudConfig;
use crate::policy::CATEGORY_FIELD;

/// Why the upstream could not answer.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Bad `cloud` section.
    #[error("cloud config: {0}")]
    Config(String),
    /// Connection refused, timeout, TLS failure...
    #[error("cloud upstream {url} unreachable: {source}")]
    Unreachable {
        /// The URL tried.
        url: String,
        /// reqwest's error.
        source: reqwest::Error,
    },
}

/// A configured upstream.
#[derive(Debug, Clone)]
pub struct CloudUpstream {
    client: reqwest::Client,
    base: String,
    api_key: Option<String>,
    model: Option<String>,
}

impl CloudUpstream {
    /// A client for `cfg`; the API key is read from `cfg.apiKeyEnv` now.
    ///
    /// # Errors
    /// [`UpstreamError::Config`] for an empty URL or a missing key variable.
    pub fn new(cfg: &CloudConfig) -> Result<Self, UpstreamError> {
        let mut base = cfg.base_url.trim_end_matches('/').to_string();
        if base.is_empty() {
            return Err(UpstreamError::Config("cloud.baseUrl is empty".into()));
        }
        if !base.ends_with("/v1") {
            base.push_str("/v1");
        }
        let api_key = match &cfg.api_key_env {
            Some(var) => Some(std::env::var(var).map_err(|_| {
                UpstreamError::Config(format!("cloud.apiKeyEnv names `{var}`, which is not set in the environment"))
            })?),
            None => None,
        };
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(cfg.connect_timeout_seconds.unwrap_or(5)))
            .timeout(Duration::from_secs(cfg.timeout_seconds.unwrap_or(300)))
            .build()
            .map_err(|e| UpstreamError::Config(e.to_string()))?;
        Ok(CloudUpstream { client, base, api_key, model: cfg.model.clone() })
    }

    /// The base URL (with `/v1`).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The body as sent upstream: `model` replaced by the configured one, calla's own fields removed.
    pub fn rewrite(&self, mut body: Value) -> Value {
        if let Some(o) = body.as_object_mut() {
            o.remove(CATEGORY_FIELD);
            // vLLM's extension, honoured locally; OpenAI rejects unknown fields
            o.remove("ignore_eos");
            if let Some(m) = &self.model {
                o.insert("model".into(), Value::String(m.clone()));
            }
        }
        body
    }

    /// POSTs `body` (rewritten) to `{base}/{path}` (`chat/completions`, `completions`).
    ///
    /// # Errors
    /// [`UpstreamError::Unreachable`] when no HTTP response came back.
    pub async fn post(&self, path: &str, body: Value) -> Result<reqwest::Response, UpstreamError> {
        let url = format!("{}/{}", self.base, path);
        let mut req = self.client.post(&url).json(&self.rewrite(body));
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        req.send().await.map_err(|source| UpstreamError::Unreachable { url, source })
    }

    /// `GET {base}/models` answered 2xx within 2 s.
    pub async fn healthy(&self) -> bool {
        let mut req = self.client.get(format!("{}/models", self.base)).timeout(Duration::from_secs(2));
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        matches!(req.send().await, Ok(r) if r.status().is_success())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrite_drops_calla_and_vllm_fields_and_sets_the_model() {
        let cfg = CloudConfig {
            base_url: "http://127.0.0.1:9/".into(),
            api_key_env: None,
            model: Some("cloud-model".into()),
            timeout_seconds: None,
            connect_timeout_seconds: None,
        };
        let up = CloudUpstream::new(&cfg).unwrap();
        assert_eq!(up.base_url(), "http://127.0.0.1:9/v1");
        let body = serde_json::json!({"model": "calla", "messages": [], "ignore_eos": true, CATEGORY_FIELD: ["pii"], "top_k": 5});
        let out = up.rewrite(body);
        assert_eq!(out, serde_json::json!({"model": "cloud-model", "messages": [], "top_k": 5}));
    }
}
