//! Batch-1 quantized GEMV (4 and 8 bits, every K the model uses, the stacked projections, the
//! fused residual variant) and RMSNorm.
//!
//! For every GEMV shape at 4 and 8 bits: random MLX-layout weights (scales of both signs), three
//! fresh inputs — uniform in [-1, 1]; the same with 1% outliers ×30 (the digit split of x keeps a
//! relative precision per group of 64, so an outlier coarsens its group); and one with a group of
//! zeros and a group of values ~1e-37 (the exponent clamps) — the kernel against
//! `quant::reference::gemv` (guard words around the output, NaN never passes), then the time per
//! GEMV over enough copies of the matrix to defeat the 60 MB L2, launched from a captured CUDA
//! graph and timed with CUDA events (also with programmatic dependent launch between the GEMVs,
//! as the decode step runs them). Edge shapes (fewer rows than a 16-row tile, a partial last
//! tile) are checked for correctness only, with the host's launch and with every K split on 3
//! blocks and on one block per SM. RMSNorm against an f64 CPU reference. The GEMV with the
//! RMSNorm fused in front (`gemv_norm`, K = D_MODEL) against the two launches it replaces, bit
//! for bit, and against the CPU; then both timed in a PDL graph.
//!
//! Tolerance: `Tol::F32` (relative L2 error < 1e-4, max error < 1e-3·rms), the brief's bound.
//! Expected ~1e-6: the products are exact integers, x is split into three 8-bit digits per group
//! (error ≤ 2.4e-7 of the group's largest |x|), the rest is f32 accumulation in another order
//! than the reference's.

use cuda::cudarc::driver::{sys, CudaSlice};
use cuda::graph::StepGraph;
use half::bf16;
use quant::{QMatRef, QuantSpec};
use rayon::prelude::*;
use spec::production as p;

use crate::common::{check_guarded, guarded, rand_f32s, rand_u32s, Suite, Tol, GUARD};

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
    us_pdl: f64,
    us_stream: f64,
}

/// One GEMV case: label, rows, cols, residual variant, timed.
struct Case {
    label: &'static str,
    rows: usize,
    cols: usize,
    resid: bool,
    timed: bool,
}

/// Input `trial` of a case: see the module docs.
fn input(cols: usize, seed: u64, trial: u64) -> Vec<f32> {
    let mut x = rand_f32s(cols, seed ^ (0x100 + trial), 1.0);
    match trial {
        0 => {}
        1 => {
            let pick = rand_u32s(cols, seed ^ 0x5151);
            for (v, r) in x.iter_mut().zip(pick) {
                if r % 100 == 0 {
                    *v *= 30.0;
                }
            }
        }
        _ => {
            x[64..128].iter_mut().for_each(|v| *v = 0.0);
            x[128..192].iter_mut().for_each(|v| *v *= 1e-37);
        }
    }
    x
}

/// Runs the GEMV and RMSNorm checks and timings.
pub fn run(s: &mut Suite) {
    let cx = s.cx;
    let quick = s.quick;
    let copy_bw = s.copy_bw;
    let stream = cx.stream().clone();
    let mut all_ok = true;

    let attn_out = p::N_Q_HEADS * p::HEAD_DIM;
    // GDN in_proj: q|k (2·n_k·d_k) | v (n_v·d_v) | z (n_v·d_v) | b | a (n_v each)
    let gdn_in = 2 * p::N_K_HEADS * p::D_K + 2 * p::N_V_HEADS * p::D_V + 2 * p::N_V_HEADS;
    // attention: q|gate (2·n_q·head_dim) | k | v (n_kv·head_dim each)
    let attn_in = 2 * p::N_Q_HEADS * p::HEAD_DIM + 2 * p::N_KV_HEADS * p::HEAD_DIM;
    let case = |label, rows, cols, resid, timed| Case { label, rows, cols, resid, timed };
    let cases = [
        case("expert down [D_MODEL, D_EXPERT]", p::D_MODEL, p::D_EXPERT, false, true),
        case("expert gate/up [D_EXPERT, D_MODEL]", p::D_EXPERT, p::D_MODEL, false, true),
        case("gdn in_proj qkv|z|b|a [12352, D_MODEL]", gdn_in, p::D_MODEL, false, true),
        case("attn q|gate|k|v [9216, D_MODEL]", attn_in, p::D_MODEL, false, true),
        case("[8192, D_MODEL]", 8192, p::D_MODEL, false, true),
        case("[4096, D_MODEL]", 4096, p::D_MODEL, false, true),
        case("o_proj/out_proj [D_MODEL, 4096]", p::D_MODEL, attn_out, false, true),
        case("o_proj/out_proj + residual [D_MODEL, 4096]", p::D_MODEL, attn_out, true, true),
        case("lm_head [VOCAB, D_MODEL]", p::VOCAB, p::D_MODEL, false, true),
        case("edge: 8 rows (< one tile) [8, D_EXPERT]", 8, p::D_EXPERT, false, false),
        case("edge: partial tile [1000, D_MODEL]", 1000, p::D_MODEL, false, false),
        case("edge: partial tile + residual [1000, 4096]", 1000, attn_out, true, false),
    ];
    let mut rows_out: Vec<Row> = Vec::new();
    let mut seed = 0x5EED_u64;
    for bits in [4u32, 8] {
        for c in &cases {
            let (rows, cols) = (c.rows, c.cols);
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

            // correctness: three fresh inputs
            let dm = cx.upload_qmat(m).expect("upload");
            let mut max_rel_err = 0f64;
            let mut max_err = 0f64;
            let mut ok = true;
            for trial in 0..3 {
                let x = input(cols, seed, trial);
                let mut reference = vec![0f32; rows];
                let chunk = 1024;
                reference
                    .par_chunks_mut(chunk)
                    .enumerate()
                    .for_each(|(ci, o)| {
                        let r0 = ci * chunk;
                        quant::reference::gemv(o, m.slice_rows(r0, r0 + o.len()), &x);
                    });
                let rms = (reference.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / rows as f64).sqrt();
                let resid: Vec<f32> = rand_f32s(rows, seed ^ (0x200 + trial), rms as f32);
                let reference: Vec<f64> = reference
                    .iter()
                    .zip(&resid)
                    .map(|(v, r)| f64::from(*v) + if c.resid { f64::from(*r) } else { 0.0 })
                    .collect();
                let xd = cx.upload_f32(&x).unwrap();
                let rd = cx.upload_f32(&resid).unwrap();
                // the host's launch; edge shapes also every K split on 3 blocks (several
                // block-iterations) and on one block per SM
                let mut tunes: Vec<Option<(i32, u32)>> = vec![None];
                if !c.timed {
                    for ks in 0..=4 {
                        tunes.push(Some((ks, 3)));
                        tunes.push(Some((ks, cx.sm_count())));
                    }
                }
                for tune in tunes {
                    let mut outd = guarded(cx, rows);
                    {
                        let mut ov = outd.slice_mut(GUARD..GUARD + rows);
                        if c.resid {
                            cx.gemv_tuned(&mut ov, &dm, &xd.slice(..), Some(&rd.slice(..)), tune)
                                .expect("gemv_residual");
                        } else {
                            cx.gemv_tuned(&mut ov, &dm, &xd.slice(..), None, tune).expect("gemv");
                        }
                    }
                    let got = cx.download_f32(&outd).unwrap();
                    let cmp = check_guarded(&got, &reference, Tol::F32);
                    if !cmp.ok {
                        println!(
                            "FAIL q{bits} {} [{rows}x{cols}] trial {trial} launch {tune:?}: rel {:.2e} max {:.2e} {}",
                            c.label, cmp.rel, cmp.max_over_rms, cmp.msg
                        );
                    }
                    ok &= cmp.ok;
                    max_rel_err = max_rel_err.max(cmp.rel);
                    max_err = max_err.max(cmp.max_over_rms);
                }
            }
            all_ok &= ok;
            if !c.timed {
                println!(
                    "q{bits} {:<48} {rows:>7}x{cols:<5} rel {max_rel_err:.1e} max/rms {max_err:.1e} {}",
                    c.label,
                    if ok { "ok" } else { "FAIL" }
                );
                s.json.push((
                    "gemv".into(),
                    format!(
                        "{{\"bits\":{bits},\"shape\":\"{}\",\"rows\":{rows},\"cols\":{cols},\"rel_err\":{max_rel_err:e},\"max_err_over_rms\":{max_err:e},\"ok\":{ok}}}",
                        c.label
                    ),
                ));
                continue;
            }

            // timing: enough copies to exceed the L2 several times over
            let copies = (512usize << 20).div_ceil(bytes).clamp(1, 2048);
            let mut mats = vec![dm];
            for _ in 1..copies {
                mats.push(cx.upload_qmat(m).expect("upload"));
            }
            let x = rand_f32s(cols, seed ^ 0x77, 1.0);
            let xd = cx.upload_f32(&x).unwrap();
            let rd = cx.upload_f32(&vec![0.5f32; rows]).unwrap();
            let mut outd = stream.alloc_zeros::<f32>(rows).unwrap();
            let launches = copies.max(if quick { 64 } else { 256 }).div_ceil(copies) * copies;
            let run_all = |outd: &mut CudaSlice<f32>| {
                for i in 0..launches {
                    let mut ov = outd.slice_mut(..);
                    if c.resid {
                        cx.gemv_residual(&mut ov, &mats[i % copies], &xd.slice(..), &rd.slice(..))
                            .expect("gemv_residual");
                    } else {
                        cx.gemv(&mut ov, &mats[i % copies], &xd.slice(..)).expect("gemv");
                    }
                }
            };
            // plain stream launches
            run_all(&mut outd);
            let us_stream = s.median_timed(if quick { 3 } else { 5 }, launches, || run_all(&mut outd)) * 1e6;
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
            let us_graph = s.median_timed(if quick { 3 } else { 7 }, launches, || graph.launch().unwrap()) * 1e6;
            drop(graph);
            // graph replay with programmatic dependent launch between the GEMVs (as the decode
            // step runs them): the next GEMV's prologue overlaps this one's tail
            let graph = StepGraph::capture(&stream, true, || {
                run_all(&mut outd);
                Ok(())
            })
            .expect("PDL graph");
            graph.launch().unwrap();
            let us_pdl = s.median_timed(if quick { 3 } else { 7 }, launches, || graph.launch().unwrap()) * 1e6;
            drop(graph);
            drop(mats);
            let r = Row {
                name: c.label.to_string(),
                bits,
                rows,
                cols,
                bytes,
                rel_err: max_rel_err,
                max_err,
                ok,
                copies,
                us_graph,
                us_pdl,
                us_stream,
            };
            println!(
                "q{} {:<48} {:>7}x{:<5} {:>9.3} MB  {:>8.2} us graph {:>6.0} GB/s ({:>5.1}%)  {:>8.2} us PDL ({:>5.1}%)  {:>8.2} us stream  rel {:.1e} {}",
                bits,
                r.name,
                rows,
                cols,
                bytes as f64 / 1e6,
                us_graph,
                bytes as f64 / us_graph * 1e-3,
                bytes as f64 / (us_graph * 1e-6) / copy_bw * 100.0,
                us_pdl,
                bytes as f64 / (us_pdl * 1e-6) / copy_bw * 100.0,
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

    // --- RMSNorm fused in front of the GEMV (gemv_norm) against rms_norm + gemv
    all_ok &= fused_norm(s);

    // --- summary
    println!();
    println!("| bits | shape | rows x cols | MB | us (graph) | GB/s | % of copy | us (graph, PDL) | % of copy (PDL) | us (stream) | rel err | ok |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows_out {
        let gbs = r.bytes as f64 / (r.us_graph * 1e-6) / 1e9;
        println!(
            "| {} | {} | {}x{} | {:.3} | {:.2} | {:.0} | {:.1} | {:.2} | {:.1} | {:.2} | {:.1e} | {} |",
            r.bits,
            r.name,
            r.rows,
            r.cols,
            r.bytes as f64 / 1e6,
            r.us_graph,
            gbs,
            gbs * 1e9 / copy_bw * 100.0,
            r.us_pdl,
            r.bytes as f64 / (r.us_pdl * 1e-6) / copy_bw * 100.0,
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
                "{{\"bits\":{},\"shape\":\"{}\",\"rows\":{},\"cols\":{},\"bytes\":{},\"copies\":{},\"us_graph\":{:.3},\"us_pdl\":{:.3},\"us_stream\":{:.3},\"gbps\":{:.1},\"rel_err\":{:e},\"max_err_over_rms\":{:e},\"ok\":{}}}",
                r.bits, r.name, r.rows, r.cols, r.bytes, r.copies, r.us_graph, r.us_pdl, r.us_stream, gbs, r.rel_err, r.max_err, r.ok
            ),
        ));
    }
    for n in norm_results {
        s.json.push(("rms_norm".into(), n));
    }
    s.all_ok &= all_ok;
    if std::env::args().any(|a| a == "--gemv-sweep") {
        sweep(s);
    }
}

/// Diagnostic timing sweep (`--gemv-sweep`): for a few shapes, the launch configuration the
/// host picks (also replayed with programmatic dependent launch) against forced K splits and
/// grid sizes.
fn sweep(s: &mut Suite) {
    let suite = &*s;
    let cx = s.cx;
    let stream = cx.stream().clone();
    let sm = cx.sm_count();
    let copy_bw = s.copy_bw;
    let shapes: [(u32, usize, usize); 7] = [
        (4, 12352, p::D_MODEL),
        (8, 12352, p::D_MODEL),
        (4, 9216, p::D_MODEL),
        (4, 4096, p::D_MODEL),
        (4, p::D_MODEL, p::N_Q_HEADS * p::HEAD_DIM),
        (4, p::D_MODEL, p::D_EXPERT),
        (4, p::VOCAB, p::D_MODEL),
    ];
    println!("\n== gemv sweep (us per GEMV, graph replay over >= 512 MiB of copies)");
    for (si, &(bits, rows, cols)) in shapes.iter().enumerate() {
        let spec = QuantSpec::new(bits, cuda::QUANT_GROUP).unwrap();
        let packed = rand_u32s(rows * spec.words_per_row(cols), 0x5EE0 + si as u64);
        let gpr = spec.groups_per_row(cols);
        let scales: Vec<bf16> = rand_f32s(rows * gpr, 0xA0 + si as u64, 0.02).into_iter().map(bf16::from_f32).collect();
        let biases: Vec<bf16> = rand_f32s(rows * gpr, 0xB0 + si as u64, 0.1).into_iter().map(bf16::from_f32).collect();
        let m = QMatRef::new(rows, cols, spec, &packed, &scales, &biases).unwrap();
        let bytes = m.stored_bytes();
        let copies = (512usize << 20).div_ceil(bytes).clamp(1, 2048);
        let mats: Vec<_> = (0..copies).map(|_| cx.upload_qmat(m).expect("upload")).collect();
        let xd = cx.upload_f32(&rand_f32s(cols, 0x77, 1.0)).unwrap();
        let mut outd = stream.alloc_zeros::<f32>(rows).unwrap();
        let launches = copies.max(128).div_ceil(copies) * copies;
        let us_pdl = {
            let graph = StepGraph::capture(&stream, true, || {
                for i in 0..launches {
                    cx.gemv(&mut outd.slice_mut(..), &mats[i % copies], &xd.slice(..))?;
                }
                Ok(())
            })
            .expect("PDL graph");
            graph.launch().unwrap();
            suite.median_timed(5, launches, || graph.launch().unwrap()) * 1e6
        };
        let mut time = |tune: Option<(i32, u32)>| {
            let run_all = |outd: &mut CudaSlice<f32>| {
                for i in 0..launches {
                    cx.gemv_tuned(&mut outd.slice_mut(..), &mats[i % copies], &xd.slice(..), None, tune)
                        .expect("gemv_tuned");
                }
            };
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
            run_all(&mut outd);
            let graph = stream
                .end_capture(sys::CUgraphInstantiate_flags_enum::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
                .unwrap()
                .expect("graph");
            graph.launch().unwrap();
            suite.median_timed(5, launches, || graph.launch().unwrap()) * 1e6
        };
        let line = |what: String, us: f64| {
            println!(
                "sweep q{bits} [{rows}x{cols}] {what:<34} {us:>8.2} us {:>6.0} GB/s ({:>5.1}%)",
                bytes as f64 / us * 1e-3,
                bytes as f64 / (us * 1e-6) / copy_bw * 100.0
            );
        };
        line("auto".into(), time(None));
        line("auto, PDL graph".into(), us_pdl);
        let nstep = cols / 256;
        for ks in 0..=4i32 {
            if (1usize << ks) > nstep {
                break;
            }
            for blocks in [sm / 2, sm] {
                line(format!("ks_log2 {ks} blocks <= {blocks}"), time(Some((ks, blocks))));
            }
        }
        let (ks_auto, blocks_auto) = cuda::gemv_config(rows, cols, bits as usize, sm);
        line(format!("(auto = ks_log2 {ks_auto}, {blocks_auto} blocks)"), f64::NAN);
    }
}

/// `gemv_norm` (RMSNorm fused into the GEMV) at K = D_MODEL: bit-equal to `rms_norm` followed by
/// `gemv` (same arithmetic, same order), within `Tol::F32` of the CPU (f64 norm, then
/// `quant::reference::gemv`), guard words intact; then the fused launch and the pair it replaces
/// timed in a PDL graph over enough matrix copies to defeat the L2. Returns whether all passed.
fn fused_norm(s: &mut Suite) -> bool {
    let cx = s.cx;
    let d = p::D_MODEL;
    let gdn_in = 2 * p::N_K_HEADS * p::D_K + 2 * p::N_V_HEADS * p::D_V + 2 * p::N_V_HEADS;
    let mut ok_all = true;
    for bits in [4u32, 8] {
        for (rows, timed) in [(gdn_in, true), (1000, false), (8, false)] {
            let seed = 0xF05E_u64 + rows as u64 + u64::from(bits);
            let spec = QuantSpec::new(bits, cuda::QUANT_GROUP).unwrap();
            let packed = rand_u32s(rows * spec.words_per_row(d), seed);
            let scales: Vec<bf16> = rand_f32s(rows * spec.groups_per_row(d), seed ^ 0xA, 0.02).into_iter().map(bf16::from_f32).collect();
            let biases: Vec<bf16> = rand_f32s(rows * spec.groups_per_row(d), seed ^ 0xB, 0.1).into_iter().map(bf16::from_f32).collect();
            let m = QMatRef::new(rows, d, spec, &packed, &scales, &biases).unwrap();
            let dm = cx.upload_qmat(m).expect("upload");
            // the residual stream: a large scale (the norm must bring it back) and outliers
            let mut x = rand_f32s(d, seed ^ 0x3, 40.0);
            x[11] = 900.0;
            x[d - 3] = -650.0;
            let w = rand_f32s(d, seed ^ 0x4, 0.6);
            let ms: f64 = x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + f64::from(p::RMS_EPS)).sqrt();
            let u: Vec<f32> = x.iter().zip(&w).map(|(v, wi)| (f64::from(*v) * inv * (1.0 + f64::from(*wi))) as f32).collect();
            let mut reference = vec![0f32; rows];
            quant::reference::gemv(&mut reference, m, &u);
            let reference: Vec<f64> = reference.iter().map(|v| f64::from(*v)).collect();
            let xd = cx.upload_f32(&x).unwrap();
            let wd = cx.upload_f32(&w).unwrap();
            let mut ud = cx.upload_f32(&vec![0f32; d]).unwrap();
            let mut pair = cx.upload_f32(&vec![0f32; rows]).unwrap();
            let mut fused = guarded(cx, rows);
            cx.rms_norm(&mut ud.slice_mut(..), &xd.slice(..), &wd.slice(..)).expect("rms_norm");
            cx.gemv(&mut pair.slice_mut(..), &dm, &ud.slice(..)).expect("gemv");
            cx.gemv_norm(&mut fused.slice_mut(GUARD..GUARD + rows), &dm, &xd.slice(..), &wd.slice(..)).expect("gemv_norm");
            let pair_h = cx.download_f32(&pair).unwrap();
            let fused_h = cx.download_f32(&fused).unwrap();
            let mut c = check_guarded(&fused_h, &reference, Tol::F32);
            let differ = pair_h.iter().zip(&fused_h[GUARD..GUARD + rows]).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            if differ > 0 {
                c.ok = false;
                c.msg.push_str(&format!("{differ} of {rows} outputs differ from rms_norm + gemv; "));
            }
            // the other entry point gives the same bits: unbounded registers (cx.set_gemv_reg_cap;
            // 56 registers is the default)
            {
                let mut other = guarded(cx, rows);
                cx.set_gemv_reg_cap(false);
                cx.gemv_norm(&mut other.slice_mut(GUARD..GUARD + rows), &dm, &xd.slice(..), &wd.slice(..))
                    .unwrap_or_else(|e| panic!("gemv_norm (unbounded): {e}"));
                cx.set_gemv_reg_cap(true);
                let other_h = cx.download_f32(&other).unwrap();
                let differ = other_h.iter().zip(&fused_h).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                if differ > 0 {
                    c.ok = false;
                    c.msg.push_str(&format!("the unbounded entry point differs in {differ} words (guards included); "));
                }
            }
            // x as f64 sums (gemv_norm_xd, the MoE's combine by atomics): rounded to f32 as read,
            // so sums whose f32 rounding is x give the same bits, and block 0 stores that x.
            // Each x[c] + t[c] in f64 with |t| below half an f32 ulp of x[c] rounds back to x[c].
            for cap in [true, false] {
                let xs: Vec<f64> = x
                    .iter()
                    .enumerate()
                    .map(|(c, v)| f64::from(*v) + f64::from(*v) * 2f64.powi(-26) * if c % 2 == 0 { 1.0 } else { -1.0 })
                    .collect();
                let xsd = cx.stream().clone_htod(&xs).unwrap();
                let mut xout = cx.upload_f32(&vec![f32::NAN; d]).unwrap();
                let mut xo = guarded(cx, rows);
                cx.set_gemv_reg_cap(cap);
                cx.gemv_norm_xd(&mut xo.slice_mut(GUARD..GUARD + rows), &dm, &xsd.slice(..), &mut xout.slice_mut(..), &wd.slice(..))
                    .unwrap_or_else(|e| panic!("gemv_norm_xd: {e}"));
                cx.set_gemv_reg_cap(true);
                let xo_h = cx.download_f32(&xo).unwrap();
                let xout_h = cx.download_f32(&xout).unwrap();
                let differ = xo_h.iter().zip(&fused_h).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                let xdiff = xout_h.iter().zip(&x).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                if differ > 0 || xdiff > 0 {
                    c.ok = false;
                    c.msg.push_str(&format!("gemv_norm_xd ({} registers): {differ} words differ from gemv_norm's (guards included), {xdiff} of x stored wrong; ", if cap { "56" } else { "unbounded" }));
                }
            }
            // 4 bits: the staged twin (bulk copies of the staged layout) gives the same bits
            let mut dm = dm;
            if bits == 4 {
                cx.stage_qmat(&mut dm, &[m]).expect("stage_qmat");
                // per-stage copies, then one copy per warp's unit (set_gemv_staged_unit)
                for unit in [false, true] {
                    cx.set_gemv_staged_unit(unit);
                    let mut st = guarded(cx, rows);
                    cx.gemv_norm(&mut st.slice_mut(GUARD..GUARD + rows), &dm, &xd.slice(..), &wd.slice(..))
                        .unwrap_or_else(|e| panic!("gemv_norm (staged, unit copy {unit}): {e}"));
                    let st_h = cx.download_f32(&st).unwrap();
                    let differ = st_h.iter().zip(&fused_h).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                    if differ > 0 {
                        c.ok = false;
                        let how = if unit { "one copy per unit" } else { "a copy per stage" };
                        c.msg.push_str(&format!("the staged (bulk-copy, {how}) entry point differs in {differ} words (guards included); "));
                    }
                }
                cx.set_gemv_staged_unit(false);
            }
            let mut extra = String::new();
            if timed {
                let bytes = m.stored_bytes();
                let copies = (512usize << 20).div_ceil(bytes).clamp(1, 256);
                let mut mats = vec![dm];
                for _ in 1..copies {
                    let mut c = cx.upload_qmat(m).expect("upload");
                    if bits == 4 {
                        cx.stage_qmat(&mut c, &[m]).expect("stage_qmat");
                    }
                    mats.push(c);
                }
                let launches = copies.max(if s.quick { 64 } else { 256 }).div_ceil(copies) * copies;
                let mut time = |fuse: bool| -> f64 {
                    let stream = cx.stream().clone();
                    let graph = StepGraph::capture(&stream, true, || {
                        for i in 0..launches {
                            if fuse {
                                cx.gemv_norm(&mut pair.slice_mut(..), &mats[i % copies], &xd.slice(..), &wd.slice(..))?;
                            } else {
                                cx.rms_norm(&mut ud.slice_mut(..), &xd.slice(..), &wd.slice(..))?;
                                cx.gemv(&mut pair.slice_mut(..), &mats[i % copies], &ud.slice(..))?;
                            }
                        }
                        Ok(())
                    })
                    .expect("PDL graph");
                    graph.launch().unwrap();
                    s.median_timed(if s.quick { 3 } else { 7 }, launches, || graph.launch().unwrap()) * 1e6
                };
                cx.set_gemv_staged(false);
                let (us_pair, us_fused) = (time(false), time(true));
                cx.set_gemv_staged(true);
                let us_staged = time(true);
                // one bulk copy per warp's unit, all of it before the wait, against every stage
                // before the wait (the like-for-like baseline); 4 bits only (staged copies)
                let mut unit_txt = String::new();
                if bits == 4 {
                    cx.set_gemv_staged_all_early(true);
                    let us_all = time(true);
                    cx.set_gemv_staged_all_early(false);
                    cx.set_gemv_staged_unit(true);
                    let us_unit = time(true);
                    cx.set_gemv_staged_unit(false);
                    unit_txt = format!(", every stage before the wait {us_all:.2} us, one copy per unit {us_unit:.2} us");
                    extra = format!(",\"us_fused_staged_all_early\":{us_all:.3},\"us_fused_staged_unit\":{us_unit:.3}");
                }
                println!("gemv_norm q{bits} [{rows}x{d}]: rms_norm + gemv {us_pair:.2} us, fused {us_fused:.2} us, fused staged (bulk copies) {us_staged:.2} us{unit_txt} (PDL graph, {copies} copies)");
                extra = format!("\"us_pair\":{us_pair:.3},\"us_fused\":{us_fused:.3},\"us_fused_staged\":{us_staged:.3}{extra}");
            }
            ok_all &= c.ok;
            s.record("gemv_norm", &format!("q{bits} [{rows}x{d}] fused = rms_norm + gemv, vs CPU"), &c, &extra);
        }
    }
    ok_all
}
