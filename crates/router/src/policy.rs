//! Data categories of a request and the routing decision, as pure functions.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::breaker::Admission;
use crate::config::HybridRouting;

/// Request body field naming data categories explicitly (string or array of strings).
pub const CATEGORY_FIELD: &str = "data_categories";
/// Request header naming data categories explicitly (comma-separated).
pub const CATEGORY_HEADER: &str = "x-calla-data-category";

/// The data categories a request touches: its declared tools (`tools[].function.name`), the
/// tools called in its history (`messages[].tool_calls[].function.name`, `messages[].name` of
/// tool results), mapped through `toolCategories`; plus the explicit field and header values.
pub fn categories(cfg: &HybridRouting, body: &Value, header: Option<&str>) -> BTreeSet<String> {
    let mut tools: Vec<&str> = Vec::new();
    if let Some(list) = body.get("tools").and_then(Value::as_array) {
        for t in list {
            if let Some(n) = t.pointer("/function/name").and_then(Value::as_str) {
                tools.push(n);
            } else if let Some(n) = t.get("name").and_then(Value::as_str) {
                tools.push(n);
            }
        }
    }
    if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
        for m in msgs {
            if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
                for c in calls {
                    if let Some(n) = c.pointer("/function/name").and_then(Value::as_str) {
                        tools.push(n);
                    }
                }
            }
            if m.get("role").and_then(Value::as_str) == Some("tool") {
                if let Some(n) = m.get("name").and_then(Value::as_str) {
                    tools.push(n);
                }
            }
        }
    }
    if let Some(Value::String(n)) = body.pointer("/tool_choice/function/name") {
        tools.push(n);
    }
    let mut out = BTreeSet::new();
    for t in tools {
        if let Some(c) = cfg.tool_categories.get(t) {
            out.insert(c.clone());
        } else if cfg.route_local.iter().chain(&cfg.route_cloud).any(|c| c == t) {
            out.insert(t.to_string());
        } else if let Some(c) = &cfg.unmapped_tool_category {
            out.insert(c.clone());
        }
    }
    match body.get(CATEGORY_FIELD) {
        Some(Value::String(s)) => out.extend(split_list(s)),
        Some(Value::Array(a)) => out.extend(a.iter().filter_map(Value::as_str).flat_map(split_list)),
        _ => {}
    }
    if let Some(h) = header {
        out.extend(split_list(h));
    }
    out
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',').map(str::trim).filter(|x| !x.is_empty()).map(str::to_string).collect()
}

/// Whether any category is pinned local.
pub fn pinned_local(cfg: &HybridRouting, cats: &BTreeSet<String>) -> bool {
    cats.iter().any(|c| cfg.route_local.contains(c))
}

/// Whether any category asks for the cloud (and none is pinned local).
pub fn prefers_cloud(cfg: &HybridRouting, cats: &BTreeSet<String>) -> bool {
    !pinned_local(cfg, cats) && cats.iter().any(|c| cfg.route_cloud.contains(c))
}

/// Can the local engine take a request now?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalAvailability {
    /// Loaded and its queue has room.
    Ready,
    /// Loaded, but the queue is full.
    QueueFull,
    /// Still loading weights.
    Loading,
    /// Failed, or disabled (the model does not fit).
    Unavailable,
}

/// What routing looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteInput {
    /// A routeLocal category is touched.
    pub pinned_local: bool,
    /// A routeCloud category is touched (and none pinned local).
    pub prefers_cloud: bool,
    /// The local engine.
    pub local: LocalAvailability,
    /// The breaker's admission for an eligible request.
    pub admission: Admission,
    /// A cloud upstream is configured and not known to be down.
    pub cloud_usable: bool,
}

/// Where a request goes, and why (the reason is a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The local engine (`probe`: as the breaker's half-open probe).
    Local {
        /// The breaker's half-open probe.
        probe: bool,
        /// Why.
        reason: &'static str,
    },
    /// The cloud upstream.
    Cloud {
        /// Why.
        reason: &'static str,
    },
    /// Refused with an HTTP status.
    Refuse {
        /// 429 or 503.
        status: u16,
        /// Why.
        reason: &'static str,
    },
}

/// The routing decision. A pinned request is never sent upstream, whatever else is true.
pub fn route(i: &RouteInput) -> Route {
    use LocalAvailability as L;
    if i.pinned_local {
        return match i.local {
            L::Ready => Route::Local { probe: false, reason: "pinned_local" },
            L::QueueFull => Route::Refuse { status: 429, reason: "pinned_local_queue_full" },
            L::Loading | L::Unavailable => Route::Refuse { status: 503, reason: "pinned_local_unavailable" },
        };
    }
    if i.prefers_cloud && i.cloud_usable {
        return Route::Cloud { reason: "route_cloud_category" };
    }
    let cloud_or = |refuse: Route, reason| if i.cloud_usable { Route::Cloud { reason } } else { refuse };
    match (i.local, i.admission) {
        (L::Ready, Admission::Local) => Route::Local { probe: false, reason: "local" },
        (L::Ready, Admission::Probe) => Route::Local { probe: true, reason: "half_open_probe" },
        (L::Ready, Admission::Cloud) => {
            if i.cloud_usable {
                Route::Cloud { reason: "breaker_open" }
            } else {
                Route::Local { probe: false, reason: "breaker_open_no_cloud" }
            }
        }
        (L::QueueFull, _) => cloud_or(Route::Refuse { status: 429, reason: "queue_full" }, "queue_full_overflow"),
        (L::Loading, _) => cloud_or(Route::Refuse { status: 503, reason: "local_loading" }, "local_loading"),
        (L::Unavailable, _) => {
            cloud_or(Route::Refuse { status: 503, reason: "local_unavailable" }, "local_unavailable")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hr() -> HybridRouting {
        HybridRouting {
            route_local: vec!["file_system".into(), "user_credentials".into()],
            route_cloud: vec!["web_search".into()],
            tool_categories: [
                ("read_file".to_string(), "file_system".to_string()),
                ("search".into(), "web_search".into()),
            ]
            .into_iter()
            .collect(),
            unmapped_tool_category: None,
        }
    }

    #[test]
    fn categories_from_every_source() {
        let body = json!({
            "tools": [{"type": "function", "function": {"name": "read_file"}}, {"type": "function", "function": {"name": "calc"}}],
            "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "search", "arguments": "{}"}}]},
                         {"role": "tool", "name": "web_search", "content": "x"}],
            "data_categories": ["billing, user_credentials"]
        });
        let c = categories(&hr(), &body, Some("pii , "));
        let got: Vec<_> = c.iter().map(String::as_str).collect();
        assert_eq!(got, ["billing", "file_system", "pii", "user_credentials", "web_search"]);
        assert!(pinned_local(&hr(), &c));
        assert!(!prefers_cloud(&hr(), &c));
        let c = categories(&hr(), &json!({"messages": [], "data_categories": "web_search"}), None);
        assert!(prefers_cloud(&hr(), &c));
        let mut h = hr();
        h.unmapped_tool_category = Some("file_system".into());
        let c = categories(&h, &json!({"tools": [{"function": {"name": "calc"}}]}), None);
        assert!(pinned_local(&h, &c));
    }

    #[test]
    fn route_table() {
        use Admission as A;
        use LocalAvailability as L;
        let mut cases = Vec::new();
        // Pinned requests: never Cloud, for every combination of everything else.
        for local in [L::Ready, L::QueueFull, L::Loading, L::Unavailable] {
            for admission in [A::Local, A::Probe, A::Cloud] {
                for cloud_usable in [false, true] {
                    for prefers_cloud in [false, true] {
                        let r =
                            route(&RouteInput { pinned_local: true, prefers_cloud, local, admission, cloud_usable });
                        assert!(!matches!(r, Route::Cloud { .. }), "{local:?} {admission:?} {cloud_usable} -> {r:?}");
                        cases.push(r);
                    }
                }
            }
        }
        let r = |local, admission, cloud_usable, prefers_cloud| {
            route(&RouteInput { pinned_local: false, prefers_cloud, local, admission, cloud_usable })
        };
        assert_eq!(r(L::Ready, A::Local, true, false), Route::Local { probe: false, reason: "local" });
        assert_eq!(r(L::Ready, A::Cloud, true, false), Route::Cloud { reason: "breaker_open" });
        assert_eq!(r(L::Ready, A::Cloud, false, false), Route::Local { probe: false, reason: "breaker_open_no_cloud" });
        assert_eq!(r(L::Ready, A::Probe, true, false), Route::Local { probe: true, reason: "half_open_probe" });
        assert_eq!(r(L::Ready, A::Local, true, true), Route::Cloud { reason: "route_cloud_category" });
        assert_eq!(r(L::Ready, A::Local, false, true), Route::Local { probe: false, reason: "local" });
        assert_eq!(r(L::QueueFull, A::Local, false, false), Route::Refuse { status: 429, reason: "queue_full" });
        assert_eq!(r(L::QueueFull, A::Local, true, false), Route::Cloud { reason: "queue_full_overflow" });
        assert_eq!(
            r(L::Unavailable, A::Local, false, false),
            Route::Refuse { status: 503, reason: "local_unavailable" }
        );
        assert_eq!(
            route(&RouteInput {
                pinned_local: true,
                prefers_cloud: false,
                local: L::Unavailable,
                admission: A::Cloud,
                cloud_usable: true
            }),
            Route::Refuse { status: 503, reason: "pinned_local_unavailable" }
        );
    }
}
