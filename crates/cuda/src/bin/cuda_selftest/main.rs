//! GPU self-test and benchmark of the CUDA kernels at the model's real shapes.
//!
//! Each section (a module here) checks its kernels against the CPU reference on random inputs at
//! the real dimensions (guard words around outputs, NaN never passes) and times them. The
//! harness measures the roofline (device-to-device copy) first, prints one line per check, and
//! ends with one `JSON {...}` line and `SELFTEST OK` or `SELFTEST FAILED` (exit 1).
//!
//! Usage: `cuda_selftest [--quick] [--only SECTION[,SECTION...]]`; sections: see `SECTIONS`,
//! and `ON_REQUEST` (measurements without checks, run only when named).

mod attention;
mod attn_prefill;
mod chain;
mod common;
mod gdn;
mod gdn_in;
mod gdn_prefill;
mod gemm;
mod gemv;
mod sample;
mod step;
mod moe;
mod stream;

use std::time::Instant;

use cuda::CudaContext;

use common::Suite;

/// A section: name and entry point.
type Section = (&'static str, fn(&mut Suite));

/// Every section.
const SECTIONS: &[Section] = &[("gemv", gemv::run), ("gemm", gemm::run), ("router", gemm::router_checks), ("route", gemm::route_section), ("bulk", gemm::bulk_section), ("ws", gemm::ws_section), ("wide", gemm::wide_section), ("bf16w", gemm::bf16w_section), ("step", step::run), ("gdn", gdn::run), ("gdnin", gdn_in::run), ("attn", attention::run), ("attnpre", attn_prefill::run), ("moe", moe::run), ("sync", moe::run_sync), ("chain", chain::run), ("gdnpre", gdn_prefill::run), ("sample", sample::run), ("acts", run_acts)];
/// The norms that write the prefill GEMMs' activations, and the GDN state kernel that
/// normalizes its own output (`gdn_prefill::acts_check`).
fn run_acts(s: &mut Suite) {
    gemm::acts_checks(s);
    gdn_prefill::acts_check(s);
}

/// Sections that only measure (no check against a reference): run when `--only` names them.
const ON_REQUEST: &[Section] = &[("stream", stream::run)];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only: Option<Vec<String>> = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').map(str::to_string).collect());
    if let Some(o) = &only {
        for name in o {
            if !SECTIONS.iter().chain(ON_REQUEST).any(|(n, _)| n == name) {
                let names: Vec<&str> = SECTIONS.iter().chain(ON_REQUEST).map(|(n, _)| *n).collect();
                eprintln!("unknown section {name:?}; sections: {}", names.join(", "));
                std::process::exit(2);
            }
        }
    }
    let t0 = Instant::now();
    let cx = match CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("FAIL: cannot open the device: {e}");
            std::process::exit(1);
        }
    };
    let t_ctx = t0.elapsed().as_secs_f64();
    let (ma, mi) = cuda::nvrtc::ensure_loaded().expect("nvrtc");
    let name = cx.raw().name().unwrap_or_default();
    println!(
        "device: {name}, {} SMs; NVRTC {ma}.{mi}; context + kernels ready in {t_ctx:.2} s",
        cx.sm_count()
    );
    for k in cuda::KERNELS {
        println!("  {}: cache {:?}", k.name, cuda::nvrtc::cache_path(k).ok().flatten());
    }

    // roofline: device-to-device copy
    let stream = cx.stream().clone();
    let copy_bytes = 2usize << 30;
    let src = stream.alloc_zeros::<u8>(copy_bytes).expect("alloc");
    let mut dst = stream.alloc_zeros::<u8>(copy_bytes).expect("alloc");
    let mut suite = Suite { cx: &cx, quick, copy_bw: 0.0, all_ok: true, json: Vec::new() };
    for _ in 0..2 {
        stream.memcpy_dtod(&src, &mut dst).expect("dtod"); // warm-up
    }
    let copy_s = suite.median_timed(6, 1, || stream.memcpy_dtod(&src, &mut dst).expect("dtod"));
    drop((src, dst));
    suite.copy_bw = 2.0 * copy_bytes as f64 / copy_s;
    println!("device-to-device copy: {:.0} GB/s (read + write)", suite.copy_bw / 1e9);

    for (sec, run) in SECTIONS.iter().chain(ON_REQUEST) {
        let named = only.as_ref().is_some_and(|o| o.iter().any(|n| n == sec));
        let on_request = ON_REQUEST.iter().any(|(n, _)| n == sec);
        if (only.is_some() || on_request) && !named {
            continue;
        }
        println!("\n== {sec}");
        let ts = Instant::now();
        run(&mut suite);
        println!("== {sec}: {:.1} s", ts.elapsed().as_secs_f64());
    }

    let mut by_section: Vec<(String, Vec<String>)> = Vec::new();
    for (sec, j) in &suite.json {
        match by_section.iter_mut().find(|(s, _)| s == sec) {
            Some((_, v)) => v.push(j.clone()),
            None => by_section.push((sec.clone(), vec![j.clone()])),
        }
    }
    let sections: Vec<String> =
        by_section.iter().map(|(s, v)| format!("{s:?}:[{}]", v.join(","))).collect();
    println!(
        "JSON {{\"device\":{name:?},\"nvrtc\":\"{ma}.{mi}\",\"copy_gbps\":{:.1},{},\"all_ok\":{},\"wall_s\":{:.1}}}",
        suite.copy_bw / 1e9,
        sections.join(","),
        suite.all_ok,
        t0.elapsed().as_secs_f64()
    );
    if !suite.all_ok {
        println!("SELFTEST FAILED");
        std::process::exit(1);
    }
    println!("SELFTEST OK");
}
