//! The GDN input projection fused in front of the step (`CudaContext::gdn_in_step`,
//! `kernels/gdn.cu` `in_step`).
//!
//! Correctness, at 4 and 8 bits: random MLX-layout `in_proj_qkv | z | b | a` at the real
//! shapes, a random residual stream `h` (unit variance with 1% outliers ×30) and
//! `input_layernorm` weight; 6 consecutive decode steps from a random nonzero state, each with a
//! fresh `h`. The CPU twin is `zrms_norm`, `quant::reference::gemv` of the four matrices, then
//! the GDN section's `cpu_step`; the plain GPU twin is the stacked fused-norm GEMV
//! (`gemv_norm`) followed by `gdn_decode_step` on its own copy of the state. Every step checks
//! `out` against both, the conv state and `S` after steps 1, 3 and 6; all buffers between guard
//! words.
//!
//! Tolerances: as the GDN section (relative L2 < 1e-5, max < 1e-4·rms), for the conv state
//! too: its new row is the projection, whose sums differ from the CPU's in order and rounding
//! (~1e-6 relative, as the GEMV's), so it is no longer a bit-exact copy.

use cuda::gdn::{GDN_CONV_DIM, GDN_CONV_STATE_LEN, GDN_OUT, GDN_PROJ, GDN_STATE_LEN};
use model::reference as r;
use quant::QMat;
use spec::production as p;

use crate::common::{check_guarded, guarded, rand_f32s, Cmp, Suite, Tol, GUARD};
use crate::gdn::{cpu_step, f64s, upload_guarded, weights, worst};
use crate::moe::rand_qmat;

const SEC: &str = "gdnin";
const STEPS: usize = 6;
const STATE_CHECK_STEPS: [usize; 3] = [1, 3, 6];
const TOL: Tol = Tol { rel: 1e-5, max_over_rms: 1e-4 };

/// `h`: unit-variance uniform with 1% of the values ×30.
fn residual(seed: u64) -> Vec<f32> {
    let mut h = rand_f32s(p::D_MODEL, seed, 3f32.sqrt());
    let pick = rand_f32s(p::D_MODEL, seed ^ 0x07, 1.0);
    for (x, u) in h.iter_mut().zip(pick) {
        if u > 0.98 {
            *x *= 30.0;
        }
    }
    h
}

fn run_bits(s: &mut Suite, bits: u32) {
    let cx = s.cx;
    let seed = 0x6E00 + u64::from(bits);
    let d = p::D_MODEL;
    let nvdv = p::N_V_HEADS * p::D_V;
    let mats: [QMat; 4] = [
        rand_qmat(GDN_CONV_DIM, d, bits, seed + 1, 0.025),
        rand_qmat(nvdv, d, bits, seed + 2, 0.025),
        rand_qmat(p::N_V_HEADS, d, bits, seed + 3, 0.025),
        rand_qmat(p::N_V_HEADS, d, bits, seed + 4, 0.025),
    ];
    let refs: Vec<_> = mats.iter().map(QMat::as_ref).collect();
    let stacked = cx.upload_qmat_rows(&refs).expect("upload stacked in_proj");
    let fused = cx.upload_gdn_in_proj(refs[0], refs[1]).expect("upload_gdn_in_proj");
    let w = weights(seed);
    let in_norm: Vec<f32> = rand_f32s(d, seed ^ 0x1A, 0.3);
    let (conv_wd, aned, dtbd, normd) = (
        cx.upload_f32(&w.conv_w).unwrap(),
        cx.upload_f32(&w.a_neg_exp).unwrap(),
        cx.upload_f32(&w.dt_bias).unwrap(),
        cx.upload_f32(&w.norm_w).unwrap(),
    );
    let in_normd = cx.upload_f32(&in_norm).unwrap();
    let conv0 = rand_f32s(GDN_CONV_STATE_LEN, seed ^ 0xC0, 3f32.sqrt());
    let s0 = rand_f32s(GDN_STATE_LEN, seed ^ 0x5, 0.5);
    // fused (a) and plain (b) GPU state, CPU state
    let (mut conv_a, mut s_a) = (upload_guarded(cx, &conv0), upload_guarded(cx, &s0));
    let (mut conv_b, mut s_b) = (upload_guarded(cx, &conv0), upload_guarded(cx, &s0));
    let (mut conv_h, mut s_h) = (conv0, s0);
    let mut projd = cx.upload_f32(&vec![0.0f32; GDN_PROJ]).unwrap();
    let mut scratch = cx.gdn_scratch().unwrap();
    let (mut w_out, mut w_twin, mut w_conv, mut w_s) = (None::<Cmp>, None::<Cmp>, None::<Cmp>, None::<Cmp>);
    let label = format!("q{bits}");
    for step in 1..=STEPS {
        let h = residual(seed ^ (0x100 + step as u64));
        let hd = cx.upload_f32(&h).unwrap();
        let (mut out_a, mut out_b) = (guarded(cx, GDN_OUT), guarded(cx, GDN_OUT));
        {
            let mut ov = out_a.slice_mut(GUARD..GUARD + GDN_OUT);
            let mut cv = conv_a.slice_mut(GUARD..GUARD + GDN_CONV_STATE_LEN);
            let mut sv = s_a.slice_mut(GUARD..GUARD + GDN_STATE_LEN);
            cx.gdn_in_step(
                &fused,
                &stacked,
                &hd.slice(..),
                &in_normd.slice(..),
                &conv_wd.slice(..),
                &aned.slice(..),
                &dtbd.slice(..),
                &normd.slice(..),
                &mut cv,
                &mut sv,
                &scratch,
                &mut ov,
            )
            .expect("gdn_in_step");
        }
        {
            let mut pv = projd.slice_mut(..);
            cx.gemv_norm(&mut pv, &stacked, &hd.slice(..), &in_normd.slice(..)).expect("gemv_norm");
            let mut ov = out_b.slice_mut(GUARD..GUARD + GDN_OUT);
            let mut cv = conv_b.slice_mut(GUARD..GUARD + GDN_CONV_STATE_LEN);
            let mut sv = s_b.slice_mut(GUARD..GUARD + GDN_STATE_LEN);
            cx.gdn_decode_step(
                &projd.slice(..),
                &conv_wd.slice(..),
                &aned.slice(..),
                &dtbd.slice(..),
                &normd.slice(..),
                &mut cv,
                &mut sv,
                &mut scratch,
                &mut ov,
            )
            .expect("gdn_decode_step");
        }
        // CPU: u = zrms_norm(h), proj = [W_qkv | W_z | W_b | W_a]·u, then the step
        let mut u = vec![0.0f32; d];
        r::zrms_norm(&mut u, &h, &in_norm, p::RMS_EPS);
        let mut proj = Vec::with_capacity(GDN_PROJ);
        for m in &refs {
            let mut o = vec![0.0f32; m.rows];
            quant::reference::gemv(&mut o, *m, &u);
            proj.extend_from_slice(&o);
        }
        let out_ref = cpu_step(&w, &proj, &mut conv_h, &mut s_h);
        let got_a = cx.download_f32(&out_a).unwrap();
        let c = check_guarded(&got_a, &f64s(&out_ref), TOL);
        // against the plain GPU path (its own output as the reference)
        let got_b = cx.download_f32(&out_b).unwrap();
        let twin = check_guarded(&got_a, &f64s(&got_b[GUARD..GUARD + GDN_OUT]), TOL);
        let mut line = format!(
            "  {label} step {step}: out vs CPU rel {:.2e} max/rms {:.2e}; vs gemv_norm + gdn_decode_step rel {:.2e}",
            c.rel, c.max_over_rms, twin.rel
        );
        let mut ok = c.ok && twin.ok;
        worst(&mut w_out, c);
        worst(&mut w_twin, twin);
        if STATE_CHECK_STEPS.contains(&step) {
            let cc = check_guarded(&cx.download_f32(&conv_a).unwrap(), &f64s(&conv_h), TOL);
            let sc = check_guarded(&cx.download_f32(&s_a).unwrap(), &f64s(&s_h), TOL);
            line.push_str(&format!("; conv rel {:.2e}; S rel {:.2e} max/rms {:.2e}", cc.rel, sc.rel, sc.max_over_rms));
            ok &= cc.ok && sc.ok;
            worst(&mut w_conv, cc);
            worst(&mut w_s, sc);
        }
        println!("{line} {}", if ok { "ok" } else { "FAIL" });
    }
    let tol = format!("\"tol_rel\":{:e},\"tol_max_over_rms\":{:e},\"steps\":{STEPS},\"bits\":{bits}", TOL.rel, TOL.max_over_rms);
    s.record(SEC, &format!("{label}: out vs CPU, worst of {STEPS} steps"), &w_out.unwrap(), &tol);
    s.record(SEC, &format!("{label}: out vs gemv_norm + gdn_decode_step, worst"), &w_twin.unwrap(), &tol);
    s.record(SEC, &format!("{label}: conv state, worst"), &w_conv.unwrap(), &tol);
    s.record(SEC, &format!("{label}: S, worst"), &w_s.unwrap(), &tol);
}

/// Runs the fused input projection + GDN step checks at 4 and 8 bits.
pub fn run(s: &mut Suite) {
    println!(
        "gdn_in_step: in_proj [{GDN_PROJ}, {}] (qkv|z restacked, b|a stacked), S {GDN_STATE_LEN} f32; tolerance rel {:e}, max/rms {:e}",
        p::D_MODEL,
        TOL.rel,
        TOL.max_over_rms
    );
    let cx = s.cx;
    let grid = (p::N_V_HEADS * 4) as u32;
    for (name, block, smem) in [
        ("gdn_in_step_q4", 256u32, 6 * 32 * (512 + 64)),
        ("gdn_in_step_q8", 256, 6 * 32 * (1024 + 64)),
        ("gdn_decode_step", 256, 0),
    ] {
        let n = cx.max_active_clusters(name, grid, block, smem).expect("cuOccupancyMaxActiveClusters");
        println!("  {name}: {n} clusters of 8 resident at once ({block} threads, {smem} B dynamic shared memory; the grid has {})", grid / 8);
    }
    for bits in [4, 8] {
        println!("  fits at {bits} bits: {}", cx.gdn_in_step_fits(quant::Bits::from_u32(bits).unwrap()).unwrap());
        run_bits(s, bits);
    }
    timing(s);
}

/// Graph replay with PDL over `LAYERS` layers with distinct weights and states (beyond the L2):
/// the fused kernel against the fused-norm GEMV + `gdn_decode_step`, µs per layer; then the
/// fused kernel's phases (its probe) in one launch after a sync, µs after the first block's
/// release.
fn timing(s: &mut Suite) {
    const LAYERS: usize = 8;
    let cx = s.cx;
    let d = p::D_MODEL;
    let nvdv = p::N_V_HEADS * p::D_V;
    struct Layer {
        stacked: cuda::DeviceQMat,
        fused: cuda::gdn::GdnInProj,
        conv_w: cuda::cudarc::driver::CudaSlice<f32>,
        ane: cuda::cudarc::driver::CudaSlice<f32>,
        dtb: cuda::cudarc::driver::CudaSlice<f32>,
        norm: cuda::cudarc::driver::CudaSlice<f32>,
        conv: cuda::cudarc::driver::CudaSlice<f32>,
        st: cuda::cudarc::driver::CudaSlice<f32>,
    }
    let layers: Vec<Layer> = (0..LAYERS as u64)
        .map(|l| {
            let seed = 0x7E00 + 16 * l;
            let mats = [
                rand_qmat(GDN_CONV_DIM, d, 4, seed + 1, 0.025),
                rand_qmat(nvdv, d, 4, seed + 2, 0.025),
                rand_qmat(p::N_V_HEADS, d, 4, seed + 3, 0.025),
                rand_qmat(p::N_V_HEADS, d, 4, seed + 4, 0.025),
            ];
            let refs: Vec<_> = mats.iter().map(QMat::as_ref).collect();
            let w = weights(seed);
            Layer {
                stacked: cx.upload_qmat_rows(&refs).unwrap(),
                fused: cx.upload_gdn_in_proj(refs[0], refs[1]).unwrap(),
                conv_w: cx.upload_f32(&w.conv_w).unwrap(),
                ane: cx.upload_f32(&w.a_neg_exp).unwrap(),
                dtb: cx.upload_f32(&w.dt_bias).unwrap(),
                norm: cx.upload_f32(&w.norm_w).unwrap(),
                conv: cx.upload_f32(&rand_f32s(GDN_CONV_STATE_LEN, seed ^ 0xC0, 1.0)).unwrap(),
                st: cx.upload_f32(&rand_f32s(GDN_STATE_LEN, seed ^ 0x5, 0.1)).unwrap(),
            }
        })
        .collect();
    let hd = cx.upload_f32(&residual(0x7EFF)).unwrap();
    let in_normd = cx.upload_f32(&rand_f32s(d, 0x7EFE, 0.3)).unwrap();
    let mut projd = cx.upload_f32(&vec![0.0f32; GDN_PROJ]).unwrap();
    let mut outd = cx.upload_f32(&vec![0.0f32; GDN_OUT]).unwrap();
    let mut layers = layers;
    let stream = cx.stream().clone();
    let reps = if s.quick { 3 } else { 7 };
    let launches = 4 * LAYERS;
    let mut row = |s: &mut Suite, name: &str, fused: bool, early: bool, l2: bool| {
        let mut scratch = cx.gdn_scratch().unwrap();
        scratch.in_early_trigger = early;
        scratch.in_l2_first = l2;
        let graph = cuda::graph::StepGraph::capture(&stream, true, || {
            for i in 0..launches {
                let l = &mut layers[i % LAYERS];
                let (mut cv, mut sv, mut ov) = (l.conv.slice_mut(..), l.st.slice_mut(..), outd.slice_mut(..));
                if fused {
                    cx.gdn_in_step(&l.fused, &l.stacked, &hd.slice(..), &in_normd.slice(..), &l.conv_w.slice(..), &l.ane.slice(..), &l.dtb.slice(..), &l.norm.slice(..), &mut cv, &mut sv, &scratch, &mut ov)?;
                } else {
                    cx.gemv_norm(&mut projd.slice_mut(..), &l.stacked, &hd.slice(..), &in_normd.slice(..))?;
                    cx.gdn_decode_step(&projd.slice(..), &l.conv_w.slice(..), &l.ane.slice(..), &l.dtb.slice(..), &l.norm.slice(..), &mut cv, &mut sv, &mut scratch, &mut ov)?;
                }
            }
            Ok(())
        })
        .expect("PDL graph");
        graph.launch().unwrap();
        let us = s.median_timed(reps, launches, || graph.launch().unwrap()) * 1e6;
        println!("  {name:<44} {us:>6.2} us per layer ({LAYERS} layers' weights and states, PDL graph)");
        s.json.push((SEC.to_string(), format!("{{\"timing\":\"{name}\",\"us_per_layer\":{us:.3}}}")));
    };
    row(s, "gemv_norm + gdn_decode_step", false, false, false);
    row(s, "gdn_in_step", true, false, false);
    row(s, "gdn_in_step, early trigger", true, true, false);
    row(s, "gdn_in_step, L2 first", true, false, true);
    row(s, "gdn_in_step, L2 first, early trigger", true, true, true);
    // phases of one launch after a sync (weights cold: another layer's ran last)
    let blocks = cuda::gdn::IN_BLOCKS;
    let marks = cuda::gdn::IN_MARKS;
    let mut scratch = cx.gdn_scratch().unwrap();
    scratch.in_probe = Some(stream.alloc_zeros::<u64>(blocks * marks).unwrap());
    let names = ["after the wait", "digits built", "rows summed", "q|k arrived", "end"];
    for l2 in [false, true] {
    scratch.in_l2_first = l2;
    let mut rows: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for rep in 0..5 {
        let l = &mut layers[rep % LAYERS];
        cx.synchronize().unwrap();
        let (mut cv, mut sv, mut ov) = (l.conv.slice_mut(..), l.st.slice_mut(..), outd.slice_mut(..));
        cx.gdn_in_step(&l.fused, &l.stacked, &hd.slice(..), &in_normd.slice(..), &l.conv_w.slice(..), &l.ane.slice(..), &l.dtb.slice(..), &l.norm.slice(..), &mut cv, &mut sv, &scratch, &mut ov).unwrap();
        let v = stream.clone_dtoh(scratch.in_probe.as_ref().unwrap()).unwrap();
        let rel0 = (0..blocks).map(|b| v[b * marks + 1]).min().unwrap();
        for (m, r) in rows.iter_mut().enumerate() {
            let mut t: Vec<f64> = (0..blocks).map(|b| (v[b * marks + 1 + m] as f64 - rel0 as f64) / 1e3).collect();
            t.sort_by(|a, b| a.partial_cmp(b).unwrap());
            r.push(t[t.len() / 2]);
            r.push(t[t.len() - 1]);
        }
    }
    println!("  gdn_in_step{} phases, us since the first release (median / max over blocks; 5 launches):", if l2 { ", L2 first" } else { "" });
    for (n, r) in names.iter().zip(&rows) {
        let med: Vec<String> = r.iter().step_by(2).map(|x| format!("{x:5.2}")).collect();
        let max: Vec<String> = r.iter().skip(1).step_by(2).map(|x| format!("{x:5.2}")).collect();
        println!("    {n:<16} median {}  max {}", med.join(" "), max.join(" "));
    }
    }
}
