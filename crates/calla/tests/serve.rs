//! `calla serve` and `calla probe` as processes on loopback, with the built-in default model:
//! a second `calla serve` is the cloud upstream; faults are injected through `/admin/faults`,
//! the memory monitor's files and by killing the upstream; the breaker is read from `/health`;
//! the upstream's audit log proves no routeLocal request ever reached it. The official
//! `openai` Python client and headless Chromium (installed by `.ci/run`) run against it too.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_calla");

/// The tests here start real servers that each use every core; run them one at a time so the
/// timing-based breaker checks see the engine's own speed, not the other tests' load.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn calla_home() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("calla-home")
}

fn tmpdir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A running `calla serve`, killed on drop.
struct Serve {
    child: Child,
    base: String,
}

impl Serve {
    fn start(config: Option<&Path>, name: &str) -> Serve {
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--port", "0", "--admin"]).env("CALLA_HOME", calla_home()).env("CALLA_LOG", "info");
        if let Some(c) = config {
            cmd.arg("--config").arg(c);
        }
        let mut child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
        let err = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.log"));
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(log).unwrap();
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                use std::io::Write;
                let _ = writeln!(f, "{line}");
                if let Some(a) = line.strip_prefix("listening on ") {
                    let _ = tx.send(a.to_string());
                }
            }
        });
        let base = rx.recv_timeout(Duration::from_secs(300)).expect("calla serve did not start (see its .log)");
        let s = Serve { child, base };
        s.wait_health(|h| h["state"] != "AllocatingWeights", "model loaded");
        s
    }

    fn wait_health(&self, pred: impl Fn(&Value) -> bool, what: &str) -> Value {
        let t0 = Instant::now();
        loop {
            let h = get_json(&format!("{}/health", self.base));
            if pred(&h) {
                return h;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "timed out waiting for {what}: {h}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn get_json(url: &str) -> Value {
    rt().block_on(async { reqwest::get(url).await.unwrap().json().await.unwrap() })
}

/// POST JSON; returns status, `x-calla-route` header and the body.
fn post(url: &str, body: &Value) -> (u16, String, Value) {
    rt().block_on(async {
        let r = reqwest::Client::new().post(url).json(body).send().await.unwrap();
        let st = r.status().as_u16();
        let route = r.headers().get("x-calla-route").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
        let t = r.text().await.unwrap();
        (st, route, serde_json::from_str(&t).unwrap_or(Value::String(t)))
    })
}

#[test]
fn probe_reports_and_refuses_local_mode_when_the_model_does_not_fit() {
    let _serial = serial();
    let out = Command::new(BIN).args(["probe", "--json"]).env("CALLA_HOME", calla_home()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["fit"]["fits"], true, "{r}");
    assert!(r["memory"]["total_bytes"].as_u64().unwrap() > 0);
    assert!(r["fit"]["footprint"]["weights_bytes"].as_u64().unwrap() > 0);
    assert!(r["cpu_threads"].as_u64().unwrap() >= 1);
    let human = Command::new(BIN).args(["probe"]).env("CALLA_HOME", calla_home()).output().unwrap();
    assert!(String::from_utf8_lossy(&human.stdout).contains("local mode  fits"));

    let d = tmpdir("probe");
    let cfg = d.join("tiny.json");
    std::fs::write(&cfg, r#"{"memoryAllocationGB": 0.01}"#).unwrap();
    let out = Command::new(BIN).args(["probe", "--config"]).arg(&cfg).env("CALLA_HOME", calla_home()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stdout).contains("does not fit"));
    let out = Command::new(BIN)
        .args(["serve", "--port", "0", "--config"])
        .arg(&cfg)
        .env("CALLA_HOME", calla_home())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refusing to start local mode"), "{err}");
}

#[test]
fn hybrid_routing_breaker_and_the_local_only_invariant() {
    let _serial = serial();
    let d = tmpdir("hybrid");
    let up_audit = d.join("upstream-audit.jsonl");
    let up_cfg = d.join("upstream.json");
    std::fs::write(&up_cfg, json!({"model": "upstream-model", "auditLog": up_audit}).to_string()).unwrap();
    let mut upstream = Serve::start(Some(&up_cfg), "upstream");

    let meminfo = d.join("meminfo");
    let psi = d.join("psi");
    let mem_ok = "MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n";
    let psi_ok = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
    std::fs::write(&meminfo, mem_ok).unwrap();
    std::fs::write(&psi, psi_ok).unwrap();
    let cfg = d.join("main.json");
    std::fs::write(
        &cfg,
        json!({
            "engine": "calla", "model": "Qwen3.6-35B-A3B",
            "hybridRouting": {"routeLocal": ["file_system", "user_credentials"], "routeCloud": ["web_search"],
                              "toolCategories": {"read_file": "file_system"}},
            "cloud": {"baseUrl": format!("{}/v1", upstream.base), "model": "upstream-model", "connectTimeoutSeconds": 1},
            "breaker": {"ttftP95Ms": 3000, "ttftMinSamples": 2, "ttftWindow": 4, "openSeconds": 1.5, "errorThreshold": 2,
                        "memAvailableMinMB": 1000, "psiSomeAvg10Max": 50},
            "memoryMonitor": {"meminfoPath": meminfo, "psiPath": psi, "intervalMs": 100},
            "auditLog": d.join("main-audit.jsonl"),
        })
        .to_string(),
    )
    .unwrap();
    let main = Serve::start(Some(&cfg), "main");
    let chat = format!("{}/v1/chat/completions", main.base);
    let faults = |v: Value| {
        let (st, _, b) = post(&format!("{}/admin/faults", main.base), &v);
        assert_eq!(st, 200, "{b}");
    };
    let mut n = 0;
    // A request touching routeLocal data: a declared read_file tool (-> file_system), the
    // explicit field, or both; marked so the upstream's log can be searched for it.
    let mut pinned = |want: u16| {
        n += 1;
        let body = json!({"messages": [{"role": "user", "content": format!("PINNED-{n} read ~/.ssh/id_rsa")}],
            "tools": [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}}],
            "data_categories": if n % 2 == 0 { json!(["user_credentials"]) } else { json!(null) },
            "max_tokens": 3, "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}});
        let (st, route, b) = post(&chat, &body);
        assert_eq!(st, want, "{b}");
        if st == 200 {
            assert_eq!(route, "local", "pinned request routed {route}");
        }
        b
    };
    let mut m = 0;
    let mut flex = || {
        m += 1;
        let body = json!({"messages": [{"role": "user", "content": format!("FLEX-{m} what is a haiku?")}],
            "max_tokens": 3, "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}});
        let (st, route, b) = post(&chat, &body);
        assert_eq!(st, 200, "{b}");
        route
    };
    let breaker = |h: &Value| h["breaker"]["state"].as_str().unwrap().to_string();

    // Normal: everything local, breaker closed.
    assert_eq!(flex(), "local");
    pinned(200);
    assert_eq!(breaker(&main.wait_health(|_| true, "")), "closed");

    // Fault 1: slow local engine (prefill delay) -> TTFT p95 over 3 s -> open -> cloud.
    faults(json!({"prefill_delay_ms": 4000}));
    flex();
    flex();
    let h = main.wait_health(|h| h["breaker"]["state"] == "open", "breaker open on TTFT");
    assert_eq!(h["breaker"]["reason"], "ttft");
    assert_eq!(h["state"], "Throttled");
    assert_eq!(flex(), "cloud");
    pinned(200);
    faults(json!({"prefill_delay_ms": 0}));
    std::thread::sleep(Duration::from_millis(1700));
    assert_eq!(flex(), "local", "half-open probe goes local");
    let h = main.wait_health(|h| h["breaker"]["state"] == "closed", "breaker closed after the probe");
    assert_eq!(h["state"], "Idle");

    // Fault 2: memory pressure through the monitor's files (MemAvailable, then PSI).
    std::fs::write(&meminfo, "MemTotal:       16000000 kB\nMemAvailable:      50000 kB\n").unwrap();
    let h = main.wait_health(|h| h["breaker"]["state"] == "open", "breaker open on memory");
    assert_eq!(h["breaker"]["reason"], "memory_pressure");
    assert_eq!(flex(), "cloud");
    pinned(200);
    std::fs::write(&meminfo, mem_ok).unwrap();
    std::fs::write(
        &psi,
        "some avg10=80.00 avg60=10.00 avg300=1.00 total=5\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=1\n",
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(1700));
    let h = main.wait_health(|_| true, "");
    assert_eq!(breaker(&h), "open", "PSI keeps it open: {h}");
    assert_eq!(flex(), "cloud");
    pinned(200);
    std::fs::write(&psi, psi_ok).unwrap();
    std::thread::sleep(Duration::from_millis(1700));
    assert_eq!(flex(), "local");
    main.wait_health(|h| h["breaker"]["state"] == "closed", "closed after memory recovers");

    // Fault 3: engine errors. A pinned request that fails gets a clear 503, never the cloud; a
    // flexible one falls back to the cloud; two errors open the breaker.
    faults(json!({"fail_next": 1}));
    let b = pinned(503);
    assert!(b["error"]["message"].as_str().unwrap().contains("never sent upstream"), "{b}");
    faults(json!({"fail_next": 1}));
    assert_eq!(flex(), "cloud");
    let h = main.wait_health(|h| h["breaker"]["state"] == "open", "breaker open on engine errors");
    assert_eq!(h["breaker"]["reason"], "engine_errors");
    pinned(200);
    std::thread::sleep(Duration::from_millis(1700));
    assert_eq!(flex(), "local");
    main.wait_health(|h| h["breaker"]["state"] == "closed", "closed after a good probe");

    // Fault 4: upstream down while the breaker is open: flexible requests fall back to local;
    // pinned ones are served locally as always.
    upstream_kill(&mut upstream);
    let (st, _, _) = post(&format!("{}/admin/breaker", main.base), &json!({"action": "open"}));
    assert_eq!(st, 200);
    assert_eq!(flex(), "local");
    let h = main.wait_health(|h| h["cloud"]["healthy"] == false, "upstream marked down");
    assert_eq!(breaker(&h), "open");
    pinned(200);
    // Every fault at once: slow, pressured, failing, upstream down. Pinned: 503, never cloud.
    faults(json!({"fail_all": true, "prefill_delay_ms": 100}));
    std::fs::write(&meminfo, "MemTotal:       16000000 kB\nMemAvailable:      50000 kB\n").unwrap();
    pinned(503);
    faults(json!({"fail_all": false, "prefill_delay_ms": 0}));
    std::fs::write(&meminfo, mem_ok).unwrap();
    let (st, _, _) = post(&format!("{}/admin/breaker", main.base), &json!({"action": "reset"}));
    assert_eq!(st, 200);
    assert_eq!(breaker(&main.wait_health(|_| true, "")), "closed");

    // The invariant: the upstream never received a pinned request, and did receive flexible ones.
    let log = std::fs::read_to_string(&up_audit).unwrap();
    assert!(!log.contains("PINNED-"), "a routeLocal request reached the upstream:\n{log}");
    assert!(log.contains("FLEX-"), "the upstream never served anything:\n{log}");
    for line in log.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["body"]["model"], "upstream-model", "model rewritten for the upstream");
        assert!(v["body"].get("data_categories").is_none(), "calla's fields are stripped");
    }
    // And the main server's own log agrees: no file_system / user_credentials request went to the cloud.
    let main_log = std::fs::read_to_string(d.join("main-audit.jsonl")).unwrap();
    for line in main_log.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let cats = v["categories"].to_string();
        if cats.contains("file_system") || cats.contains("user_credentials") {
            assert_ne!(v["route"], "cloud", "{line}");
        }
    }
    let metrics =
        rt().block_on(async { reqwest::get(format!("{}/metrics", main.base)).await.unwrap().text().await.unwrap() });
    assert!(metrics.contains("calla_router_breaker_trips_total"), "{metrics}");
    assert!(metrics.contains("target=\"cloud\""), "{metrics}");
}

/// Kills the upstream process (returns it for dropping).
fn upstream_kill(s: &mut Serve) -> &mut Serve {
    let _ = s.child.kill();
    let _ = s.child.wait();
    s
}

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("CALLA_PYTHON") {
        return PathBuf::from(p);
    }
    let p = repo_root().join(".venv-server/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run the install steps of .ci/run (python3 -m venv .venv-server && .venv-server/bin/pip install openai==1.109.1), or set CALLA_PYTHON",
        p.display()
    );
    p
}

#[test]
fn official_openai_python_client() {
    let _serial = serial();
    let py = python();
    let s = Serve::start(None, "openai-client");
    let out = Command::new(&py)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py"))
        .arg(format!("{}/v1", s.base))
        .output()
        .unwrap();
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && so.contains("OK"), "openai client failed:\n{so}\n{se}");
}

fn chromium() -> PathBuf {
    for c in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(o) = Command::new("sh").arg("-c").arg(format!("command -v {c}")).output() {
            if o.status.success() {
                return PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
            }
        }
    }
    panic!("chromium is missing: run the install steps of .ci/run (apt-get install -y chromium)");
}

#[test]
fn dashboard_in_headless_chromium_shows_live_data() {
    let _serial = serial();
    let chrome = chromium();
    let s = Serve::start(None, "dashboard");
    for i in 0..3 {
        let (st, _, b) = post(
            &format!("{}/v1/chat/completions", s.base),
            &json!({"messages": [{"role": "user", "content": format!("dashboard {i}")}], "max_tokens": 5, "temperature": 0}),
        );
        assert_eq!(st, 200, "{b}");
    }
    let profile = tmpdir("chromium-profile");
    let flags = |extra: &[&str]| {
        let mut c = Command::new(&chrome);
        c.args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1400,1000",
            "--virtual-time-budget=4000",
        ]);
        c.arg(format!("--user-data-dir={}", profile.display()));
        c.args(extra);
        c.arg(format!("{}/dashboard", s.base));
        c
    };
    let out = flags(&["--dump-dom"]).output().unwrap();
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    let updates = dom
        .split("data-updates=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|x| x.parse::<u32>().ok())
        .unwrap_or(0);
    assert!(updates >= 1, "the page never loaded /dashboard/data:\n{dom}");
    assert!(dom.contains("id=\"state\">Idle<") || dom.contains("id=\"state\">"), "{dom}");
    let samples = dom.split("id=\"samples\">").nth(1).and_then(|r| r.split('<').next()).unwrap_or("0");
    assert!(samples.parse::<u32>().unwrap_or(0) >= 3, "TTFT samples not shown: {samples}\n{dom}");
    assert!(dom.contains("class=\"uplot"), "charts not drawn:\n{dom}");
    let art = repo_root().join("target/test-artifacts");
    std::fs::create_dir_all(&art).unwrap();
    let png = art.join("dashboard.png");
    let _ = std::fs::remove_file(&png);
    let out = flags(&[&format!("--screenshot={}", png.display())]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta = std::fs::metadata(&png).expect("no screenshot written");
    assert!(meta.len() > 10_000, "screenshot suspiciously small");
}
