//! GFLOP/s of `fast::gemm` (f32 activations) against `fast::gemm_q8act` (int8 activations).
//!
//! `cargo run --release -p quant --example q8act_speed [-- --threads N] [--t T] [--secs S]`
//!
//! FLOPs = 2·rows·cols·t per call; each figure is the best of ~2 ms batches (least disturbed
//! by other processes). The q8act time includes quantizing the activations.

use quant::fast;
use quant::{Bits, QuantSpec};

mod common;
use common::{random_qmat, time_it};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .and_then(|s| s.parse::<f64>().ok())
    };
    let threads = arg("--threads").map(|v| v as usize).unwrap_or(0);
    let t = arg("--t").map(|v| v as usize).unwrap_or(64);
    let secs = arg("--secs").unwrap_or(1.0);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    println!(
        "level {}, rayon threads {}, t = {t}, group 64",
        fast::Level::best().name(),
        pool.current_num_threads()
    );
    println!(
        "{:>13} {:>4} {:>12} {:>14} {:>7}",
        "rows x cols", "bits", "gemm GF/s", "q8act GF/s", "ratio"
    );
    let mut seed = 7u64;
    for (rows, cols) in [(2048, 8192), (512, 2048), (8192, 2048)] {
        for bits in [Bits::B4, Bits::B8] {
            let spec = QuantSpec {
                bits,
                group_size: 64,
            };
            let m = random_qmat(&mut seed, rows, cols, spec);
            let x: Vec<f32> = (0..t * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect();
            let mut out = vec![0f32; t * rows];
            let flop = 2.0 * (rows * cols * t) as f64;
            let a = pool.install(|| time_it(|| fast::gemm(&mut out, m.as_ref(), &x, t), secs));
            let b =
                pool.install(|| time_it(|| fast::gemm_q8act(&mut out, m.as_ref(), &x, t), secs));
            println!(
                "{:>13} {:>4} {:>12.1} {:>14.1} {:>7.2}",
                format!("{rows}x{cols}"),
                bits.bits(),
                flop / a / 1e9,
                flop / b / 1e9,
                a / b
            );
        }
    }
}
