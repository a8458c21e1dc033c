//! Throughput of `fast::gemv` (and `fast::gemm`) at the model's shapes, per SIMD level.
//!
//! `cargo run --release -p quant --example gemv_speed [-- --quick] [--threads N] [--gemm]
//!  [--only NAME-SUBSTRING] [--level portable|avx2|avx512|neon]`
//!
//! GB/s = stored bytes of the quantized matrix (packed words + bf16 scales + biases) per second.
//! "cold": the call cycles through copies totalling ≥ 256 MiB, so weights stream from DRAM
//! as in real decode (each expert / layer is touched once per token); "hot": one matrix,
//! repeatedly (cache-resident when it fits). Each figure is the best of many ~2 ms batches,
//! which filters out most interference from other processes; still noisy on a shared machine.

use quant::fast::{self, Level};
use quant::{Bits, QMat, QuantSpec};

mod common;
use common::{random_qmat, time_it};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let do_gemm = args.iter().any(|a| a == "--gemm");
    let threads: Option<usize> = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok());
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let only = arg("--only");
    let level_filter = arg("--level");
    let levels: Vec<Level> = Level::available()
        .into_iter()
        .filter(|l| level_filter.as_deref().is_none_or(|f| f == l.name()))
        .collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.unwrap_or(0))
        .build()
        .unwrap();
    let min_secs = if quick { 0.2 } else { 1.0 };
    let shapes: &[(usize, usize, &str)] = &[
        (2048, 512, "expert down_proj"),
        (512, 2048, "expert gate/up_proj"),
        (4096, 2048, "in_proj_z"),
        (2048, 4096, "out_proj / o_proj"),
        (8192, 2048, "in_proj_qkv / q_proj"),
        (248_320, 2048, "lm_head"),
        (128, 2048, "l2-resident probe"),
    ];
    println!(
        "levels available: {:?}; rayon threads: {}; GB/s of stored weight bytes",
        Level::available()
            .iter()
            .map(|l| l.name())
            .collect::<Vec<_>>(),
        pool.current_num_threads()
    );
    println!(
        "{:<22} {:>13} {:>4} {:>9} {:>10} {:>9} {:>9}",
        "shape", "rows x cols", "bits", "level", "MiB", "cold GB/s", "hot GB/s"
    );
    let mut seed = 42u64;
    for bits in [Bits::B4, Bits::B8] {
        let spec = QuantSpec {
            bits,
            group_size: 64,
        };
        for &(rows, cols, name) in shapes {
            if only.as_deref().is_some_and(|o| !name.contains(o)) {
                continue;
            }
            let bytes = spec.stored_bytes(rows, cols);
            let copies = ((256usize << 20) / bytes).clamp(1, 64);
            let ms: Vec<QMat> = (0..copies)
                .map(|_| random_qmat(&mut seed, rows, cols, spec))
                .collect();
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect();
            let mut out = vec![0f32; rows];
            for &level in &levels {
                let mut i = 0;
                let cold = pool.install(|| {
                    time_it(
                        || {
                            fast::gemv_with(level, &mut out, ms[i % copies].as_ref(), &x);
                            i += 1;
                        },
                        min_secs,
                    )
                });
                let hot = pool.install(|| {
                    time_it(
                        || fast::gemv_with(level, &mut out, ms[0].as_ref(), &x),
                        min_secs,
                    )
                });
                println!(
                    "{:<22} {:>13} {:>4} {:>9} {:>10.2} {:>9.2} {:>9.2}",
                    name,
                    format!("{rows}x{cols}"),
                    bits.bits(),
                    level.name(),
                    bytes as f64 / (1 << 20) as f64,
                    bytes as f64 / cold / 1e9,
                    bytes as f64 / hot / 1e9
                );
            }
            // int8 activations, one token, quantized once (as the model shares them).
            let mut qa = fast::QAct::new();
            qa.quantize(&x, 1, cols, spec);
            let mut i = 0;
            let cold = pool.install(|| {
                time_it(
                    || {
                        fast::gemm_q8act_prepared(&mut out, ms[i % copies].as_ref(), &qa);
                        i += 1;
                    },
                    min_secs,
                )
            });
            let hot = pool.install(|| {
                time_it(
                    || fast::gemm_q8act_prepared(&mut out, ms[0].as_ref(), &qa),
                    min_secs,
                )
            });
            println!(
                "{:<22} {:>13} {:>4} {:>9} {:>10.2} {:>9.2} {:>9.2}",
                name,
                format!("{rows}x{cols}"),
                bits.bits(),
                "q8act",
                bytes as f64 / (1 << 20) as f64,
                bytes as f64 / cold / 1e9,
                bytes as f64 / hot / 1e9
            );
            if do_gemm && rows * cols <= 8192 * 2048 {
                for t in [4usize, 64] {
                    let xt: Vec<f32> = (0..t * cols)
                        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
                        .collect();
                    let mut ot = vec![0f32; t * rows];
                    for &level in &levels {
                        let s = pool.install(|| {
                            time_it(
                                || fast::gemm_with(level, &mut ot, ms[0].as_ref(), &xt, t),
                                min_secs,
                            )
                        });
                        println!(
                            "{:<22} {:>13} {:>4} {:>9}   gemm t={t:<3} {:>8.2} ms  {:>7.1} GFLOP/s",
                            name,
                            format!("{rows}x{cols}"),
                            bits.bits(),
                            level.name(),
                            s * 1e3,
                            2.0 * (rows * cols * t) as f64 / s / 1e9
                        );
                    }
                }
            }
        }
    }
}
