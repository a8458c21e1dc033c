//! Enables the AVX-512 kernels only on compilers that have the AVX-512 intrinsics stable
//! (Rust 1.89+). The workspace's rust-version is older; there the crate builds without them
//! and `fast::Level::Avx512` is simply never available.
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(quant_avx512)");
    println!("cargo::rerun-if-changed=build.rs");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let minor = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| {
            // "rustc 1.95.0 (...)"
            let ver = v.split_whitespace().nth(1)?.to_string();
            let mut it = ver.split('.');
            let major: u32 = it.next()?.parse().ok()?;
            let minor: u32 = it.next()?.parse().ok()?;
            Some(if major > 1 { u32::MAX } else { minor })
        })
        .unwrap_or(0);
    if minor >= 89 {
        println!("cargo::rustc-cfg=quant_avx512");
    }
}
