//! Batch-1 quantized GEMV (4 and 8 bits, every K the model uses) and RMSNorm.
//!
//! For every GEMV shape at 4 and 8 bits: random MLX-layout weights (scales of both signs), two
//! fresh inputs, the kernel against `quant::reference::gemv` (guard words around the output,
//! NaN never passes), then the time per GEMV over enough copies of the matrix to defeat the
//! 60 MB L2, launched from a captured CUDA graph and timed with CUDA events. RMSNorm against an
//! f64 CPU reference.

use cuda::cudarc::driver::sys;
use half::bf16;
use quant::{QMatRef, QuantSpec};
use rayon::prelude::*;
use spec::production as p;

use crate::common::{check_guarded, guarded, median, rand_f32s, rand_u32s, Suite, Tol, GUARD};

struct Row {
    name: String,
    bits: u32,
    rows: usize,
    cols: usize,
    bytes: usize,
    rel_err: f64,
    max_err: f64,
    ok: bool,
    copies: usize,
    us_graph: f64,
    us_stream: f64,
}

/// Runs the GEMV and RMSNorm checks and timings.
pub fn run(s: &mut Suite) {
    let cx = s.cx;
    let quick = s.quick;
    let copy_bw = s.copy_bw;
    let stream = cx.stream().clone();
    let ev = || s.event();
    let mut all_ok = true;

    // --- GEMV shapes
    let attn_out = p::N_Q_HEADS * p::HEAD_DIM;
    let shapes: Vec<(&str, usize, usize)> = vec![
        ("expert down [D_MODEL, D_EXPERT]", p::D_MODEL, p::D_EXPERT),
        (
            "expert gate/up [D_EXPERT, D_MODEL]",
            p::D_EXPERT,
            p::D_MODEL,
        ),
        ("gdn in_proj_qkvz-size [8192, D_MODEL]", 8192, p::D_MODEL),
        (
            "attn q|gate [4096, D_MODEL]",
            2 * p::N_Q_HEADS * p::HEAD_DIM / 2,
            p::D_MODEL,
        ),
        ("o_proj/out_proj [D_MODEL, 4096]", p::D_MODEL, attn_out),
        ("lm_head [VOCAB, D_MODEL]", p::VOCAB, p::D_MODEL),
    ];
    let mut rows_out: Vec<Row> = Vec::new();
    let mut seed = 0x5EED_u64;
    for bits in [4u32, 8] {
        for (label, rows, cols) in &shapes {
            let (rows, cols) = (*rows, *cols);
            seed += 1;
            let spec = QuantSpec::new(bits, cuda::QUANT_GROUP).unwrap();
            let wpr = spec.words_per_row(cols);
            let gpr = spec.groups_per_row(cols);
            let packed = rand_u32s(rows * wpr, seed);
            // scales of both signs (MLX allows negative scales), biases around zero
            let scales: Vec<bf16> = rand_f32s(rows * gpr, seed ^ 0xA, 0.02)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let biases: Vec<bf16> = rand_f32s(rows * gpr, seed ^ 0xB, 0.1)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let m = QMatRef::new(rows, cols, spec, &packed, &scales, &biases).unwrap();
            let bytes = m.stored_bytes();

            // correctness: two fresh inputs
            let dm = cx.upload_qmat(m).expect("upload");
            let mut max_rel_err = 0f64;
            let mut max_err = 0f64;
            let mut ok = true;
            for trial in 0..2 {
                let x = rand_f32s(cols, seed ^ (0x100 + trial), 1.0);
                let mut reference = vec![0f32; rows];
                let chunk = 1024;
                reference
                    .par_chunks_mut(chunk)
                    .enumerate()
                    .for_each(|(ci, o)| {
                        let r0 = ci * chunk;
                        quant::reference::gemv(o, m.slice_rows(r0, r0 + o.len()), &x);
                    });
                let reference: Vec<f64> = reference.into_iter().map(f64::from).collect();
                let xd = cx.upload_f32(&x).unwrap();
                let mut outd = guarded(cx, rows);
                {
                    let mut ov = outd.slice_mut(GUARD..GUARD + rows);
                    cx.gemv(&mut ov, &dm, &xd.slice(..)).expect("gemv");
                }
                let got = cx.download_f32(&outd).unwrap();
                let c = check_guarded(&got, &reference, Tol::F32);
                let (rel, mrel, good, msg) = (c.rel, c.max_over_rms, c.ok, c.msg);
                if !good {
                    println!("FAIL q{bits} {label} [{rows}x{cols}] trial {trial}: rel {rel:.2e} max {mrel:.2e} {msg}");
                }
                ok &= good;
                max_rel_err = max_rel_err.max(rel);
                max_err = max_err.max(mrel);
            }
            all_ok &= ok;

            // timing: enough copies to exceed the L2 several times over
            let copies = (512usize << 20).div_ceil(bytes).clamp(1, 2048);
            let mut mats = vec![dm];
            for _ in 1..copies {
                mats.push(cx.upload_qmat(m).expect("upload"));
            }
            let x = rand_f32s(cols, seed ^ 0x77, 1.0);
            let xd = cx.upload_f32(&x).unwrap();
            let mut outd = stream.alloc_zeros::<f32>(rows).unwrap();
            let launches = copies.max(if quick { 64 } else { 256 }).div_ceil(copies) * copies;
            let run_all = |outd: &mut cuda::cudarc::driver::CudaSlice<f32>| {
                for i in 0..launches {
                    let mut ov = outd.slice_mut(..);
                    cx.gemv(&mut ov, &mats[i % copies], &xd.slice(..))
                        .expect("gemv");
                }
            };
            // plain stream launches
            run_all(&mut outd);
            let mut ts = Vec::new();
            for _ in 0..(if quick { 3 } else { 5 }) {
                let (a, b) = (ev(), ev());
                a.record(&stream).unwrap();
                run_all(&mut outd);
                b.record(&stream).unwrap();
                b.synchronize().unwrap();
                ts.push(f64::from(a.elapsed_ms(&b).unwrap()) * 1e-3 / launches as f64);
            }
            let us_stream = median(ts) * 1e6;
            // graph replay
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
            run_all(&mut outd);
            let graph = stream
                .end_capture(sys::CUgraphInstantiate_flags_enum::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
                .unwrap()
                .expect("graph");
            graph.launch().unwrap();
            let mut ts = Vec::new();
            for _ in 0..(if quick { 3 } else { 7 }) {
                let (a, b) = (ev(), ev());
                a.record(&stream).unwrap();
                graph.launch().unwrap();
                b.record(&stream).unwrap();
                b.synchronize().unwrap();
                ts.push(f64::from(a.elapsed_ms(&b).unwrap()) * 1e-3 / launches as f64);
            }
            let us_graph = median(ts) * 1e6;
            drop(graph);
            drop(mats);
            let r = Row {
                name: label.to_string(),
                bits,
                rows,
                cols,
                bytes,
                rel_err: max_rel_err,
                max_err,
                ok,
                copies,
                us_graph,
                us_stream,
            };
            println!(
                "q{} {:<40} {:>7}x{:<5} {:>9.3} MB  {:>8.2} us graph {:>6.0} GB/s ({:>5.1}%)  {:>8.2} us stream  rel {:.1e} {}",
                bits,
                r.name,
                rows,
                cols,
                bytes as f64 / 1e6,
                us_graph,
                bytes as f64 / us_graph * 1e-3,
                bytes as f64 / (us_graph * 1e-6) / copy_bw * 100.0,
                us_stream,
                max_rel_err,
                if ok { "ok" } else { "FAIL" }
            );
            rows_out.push(r);
        }
    }

    // --- RMSNorm
    let mut norm_results = Vec::new();
    for (trial, n_rows) in [1usize, 3, 64].into_iter().enumerate() {
        let d = p::D_MODEL;
        let x: Vec<f32> = rand_f32s(n_rows * d, 0xBEEF + trial as u64, 3.0);
        let w: Vec<f32> = rand_f32s(d, 0xF00D + trial as u64, 0.5);
        let mut reference = Vec::with_capacity(n_rows * d);
        for r in 0..n_rows {
            let row = &x[r * d..(r + 1) * d];
            let ms: f64 = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + f64::from(p::RMS_EPS)).sqrt();
            reference.extend(
                row.iter()
                    .zip(&w)
                    .map(|(v, wi)| f64::from(*v) * inv * (1.0 + f64::from(*wi))),
            );
        }
        let xd = cx.upload_f32(&x).unwrap();
        let wd = cx.upload_f32(&w).unwrap();
        let mut yd = guarded(cx, n_rows * d);
        {
            let mut yv = yd.slice_mut(GUARD..GUARD + n_rows * d);
            cx.rms_norm(&mut yv, &xd.slice(..), &wd.slice(..))
                .expect("rms_norm");
        }
        let got = cx.download_f32(&yd).unwrap();
        let c = check_guarded(&got, &reference, Tol::F32);
        let (rel, mrel, ok, msg) = (c.rel, c.max_over_rms, c.ok, c.msg);
        let ok = ok && rel < 1e-6;
        println!(
            "rms_norm [{n_rows}x{d}]: rel {rel:.2e} max {mrel:.2e} {} {msg}",
            if ok { "ok" } else { "FAIL" }
        );
        all_ok &= ok;
        norm_results.push(format!(
            "{{\"rows\":{n_rows},\"rel_err\":{rel:e},\"ok\":{ok}}}"
        ));
    }

    // --- summary
    println!();
    println!("| bits | shape | rows x cols | MB | us (graph) | GB/s | % of copy | us (stream) | rel err | ok |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows_out {
        let gbs = r.bytes as f64 / (r.us_graph * 1e-6) / 1e9;
        println!(
            "| {} | {} | {}x{} | {:.3} | {:.2} | {:.0} | {:.1} | {:.2} | {:.1e} | {} |",
            r.bits,
            r.name,
            r.rows,
            r.cols,
            r.bytes as f64 / 1e6,
            r.us_graph,
            gbs,
            gbs * 1e9 / copy_bw * 100.0,
            r.us_stream,
            r.rel_err,
            if r.ok { "ok" } else { "FAIL" }
        );
    }
    for r in &rows_out {
        let gbs = r.bytes as f64 / (r.us_graph * 1e-6) / 1e9;
        s.json.push((
            "gemv".into(),
            format!(
                "{{\"bits\":{},\"shape\":\"{}\",\"rows\":{},\"cols\":{},\"bytes\":{},\"copies\":{},\"us_graph\":{:.3},\"us_stream\":{:.3},\"gbps\":{:.1},\"rel_err\":{:e},\"max_err_over_rms\":{:e},\"ok\":{}}}",
                r.bits, r.name, r.rows, r.cols, r.bytes, r.copies, r.us_graph, r.us_stream, gbs, r.rel_err, r.max_err, r.ok
            ),
        ));
    }
    for n in norm_results {
        s.json.push(("rms_norm".into(), n));
    }
    s.all_ok &= all_ok;
}
