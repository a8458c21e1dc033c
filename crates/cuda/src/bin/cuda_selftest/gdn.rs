//! Gated DeltaNet decode step (`CudaContext::gdn_decode_step`, `kernels/gdn.cu`).
//!
//! Correctness: random realistic inputs at the real dimensions, 12 consecutive decode steps
//! from a zero state and 12 from a random nonzero state, each step with a fresh `proj`. The CPU
//! twin is the T = 1 GDN path of `model::Model` (crates/model/src/lib.rs), built from
//! `model::reference::{causal_conv_silu, l2norm_inplace, softplus, sigmoid, gdn_step,
//! gated_rms_norm}` in the same order. Every step checks `out`; steps 1, 3, 6, 9, 12 also check
//! the conv state and `S`. All three buffers sit between guard words of a NaN pattern.
//!
//! Tolerances:
//! * `out` and `S`: relative L2 error < 1e-5 and max error < 1e-4·rms. Both sides are f32; the
//!   kernel sums in a different order (tree reductions, FMA) and reads `o` out as
//!   `α·Sᵀq̂ + (k̂·q̂)·δ`, equal to `S_newᵀq̂` in real arithmetic. Rounding of that kind is
//!   ~1e-7 per op, ~1e-6 after the 128-term sums and 12 steps; 1e-5 leaves 10x.
//! * conv state: bit-exact (it is a shift of copies).
//!
//! Timing (graph replay, CUDA events): 64 calls on one layer's buffers (L2-resident state),
//! and 2 passes over 30 layers with distinct state and conv weights (≈ 67 MB per pass, beyond
//! the L2), the decode step's real access pattern; the 30-layer sequence also with
//! programmatic dependent launch (PDL) between the calls. GB/s counts the state traffic only:
//! 2 × 2 MiB (S read + written) per call. Empty kernels of the same grid give the launch floor.

use cuda::cudarc::driver::{sys, CudaSlice, DevicePtr};
use cuda::gdn::{GDN_CONV_DIM, GDN_CONV_STATE_LEN, GDN_OUT, GDN_PROJ, GDN_STATE_LEN};
use model::reference as r;
use spec::production as p;

use crate::common::{check_guarded, guarded, rand_f32s, Cmp, Suite, Tol, GUARD, SENTINEL};

const SEC: &str = "gdn";
const STEPS: usize = 12;
const STATE_CHECK_STEPS: [usize; 5] = [1, 3, 6, 9, 12];
const TOL: Tol = Tol {
    rel: 1e-5,
    max_over_rms: 1e-4,
};
/// Bit-exact: `rel < tiny` only passes at 0.
const EXACT: Tol = Tol {
    rel: f64::MIN_POSITIVE,
    max_over_rms: f64::MIN_POSITIVE,
};

/// One layer's GDN weights used by the step (host copies).
pub(crate) struct Weights {
    pub(crate) conv_w: Vec<f32>,    // [conv_dim, 4]
    pub(crate) a_neg_exp: Vec<f32>, // [n_v]
    pub(crate) dt_bias: Vec<f32>,   // [n_v]
    pub(crate) norm_w: Vec<f32>,    // [d_v]
}

pub(crate) fn weights(seed: u64) -> Weights {
    let nv = p::N_V_HEADS;
    Weights {
        // taps ~ ±0.5 uniform (std 0.29)
        conv_w: rand_f32s(GDN_CONV_DIM * p::CONV_KERNEL, seed ^ 1, 0.5),
        // -exp(A_log), A_log ~ U(-1, 1.5)
        a_neg_exp: rand_f32s(nv, seed ^ 2, 1.25)
            .into_iter()
            .map(|x| -(x + 0.25).exp())
            .collect(),
        dt_bias: rand_f32s(nv, seed ^ 3, 1.0),
        norm_w: rand_f32s(p::D_V, seed ^ 4, 0.1)
            .into_iter()
            .map(|x| 1.0 + x)
            .collect(),
    }
}

/// `proj` of one token: unit-variance uniform (q|k|v, z, b, a).
fn proj(seed: u64) -> Vec<f32> {
    rand_f32s(GDN_PROJ, seed, 3f32.sqrt())
}

/// The CPU twin: crates/model/src/lib.rs `Model::gdn` for t = 1, after the projections.
/// `conv`: [k-1, conv_dim]; `s`: [n_v, d_k, d_v]. Returns the gated-normed output [n_v·d_v].
pub(crate) fn cpu_step(w: &Weights, proj: &[f32], conv: &mut Vec<f32>, s: &mut [f32]) -> Vec<f32> {
    let (nk, nv, dk, dv, kk) = (p::N_K_HEADS, p::N_V_HEADS, p::D_K, p::D_V, p::CONV_KERNEL);
    let (key_dim, conv_dim) = (nk * dk, GDN_CONV_DIM);
    let qkv = &proj[..conv_dim];
    let z = &proj[conv_dim..conv_dim + nv * dv];
    let b = &proj[conv_dim + nv * dv..conv_dim + nv * dv + nv];
    let a = &proj[conv_dim + nv * dv + nv..];
    // causal conv over [cached k-1 rows ‖ new row]; the last k-1 rows become the cache
    let mut window = std::mem::take(conv);
    window.extend_from_slice(qkv);
    let mut mixed = vec![0.0f32; conv_dim];
    r::causal_conv_silu(&mut mixed, &window, &w.conv_w, conv_dim, kk);
    *conv = window[conv_dim..].to_vec();
    // split, L2-normalise q and k, scale q
    let mut q = mixed[..key_dim].to_vec();
    let mut k = mixed[key_dim..2 * key_dim].to_vec();
    let v = &mixed[2 * key_dim..];
    r::l2norm_inplace(&mut q, dk, 1e-6);
    r::l2norm_inplace(&mut k, dk, 1e-6);
    let q_scale = 1.0 / (dk as f32).sqrt();
    q.iter_mut().for_each(|x| *x *= q_scale);
    // gates
    let g: Vec<f32> = (0..nv)
        .map(|j| w.a_neg_exp[j] * r::softplus(a[j] + w.dt_bias[j]))
        .collect();
    let beta: Vec<f32> = b.iter().map(|&x| r::sigmoid(x)).collect();
    // recurrence, V-head j on QK head j / (n_v / n_k)
    let ratio = nv / nk;
    let mut o = vec![0.0f32; nv * dv];
    for (j, (sj, oj)) in s
        .chunks_exact_mut(dk * dv)
        .zip(o.chunks_exact_mut(dv))
        .enumerate()
    {
        let hk = j / ratio;
        r::gdn_step(
            sj,
            &q[hk * dk..(hk + 1) * dk],
            &k[hk * dk..(hk + 1) * dk],
            &v[j * dv..(j + 1) * dv],
            g[j].exp(),
            beta[j],
            oj,
        );
    }
    r::gated_rms_norm(&mut o, z, &w.norm_w, p::RMS_EPS);
    o
}

/// Device copy of `data` between `GUARD` sentinel words on each side.
pub(crate) fn upload_guarded(cx: &cuda::CudaContext, data: &[f32]) -> CudaSlice<f32> {
    let mut v = vec![f32::from_bits(SENTINEL); data.len() + 2 * GUARD];
    v[GUARD..GUARD + data.len()].copy_from_slice(data);
    cx.upload_f32(&v).expect("upload")
}

pub(crate) fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// Keeps the comparison with the largest relative error (failures first).
pub(crate) fn worst(acc: &mut Option<Cmp>, c: Cmp) {
    let replace = match acc {
        None => true,
        Some(a) => (a.ok && !c.ok) || (a.ok == c.ok && (c.rel > a.rel || c.rel.is_nan())),
    };
    if replace {
        *acc = Some(c);
    }
}

/// Device buffers of one call, in the kernel's argument order.
struct Args {
    out: u64,
    s: u64,
    conv_state: u64,
    proj: u64,
    conv_w: u64,
    a_neg_exp: u64,
    dt_bias: u64,
    norm_w: u64,
}

/// Launches entry point `name` (any `gdn.cu` entry: they share the arguments and grid) with
/// `cuLaunchKernelEx`, with the programmatic-stream-serialization attribute when `pdl`.
fn launch_raw(cx: &cuda::CudaContext, name: &str, pdl: bool, a: &Args) -> sys::CUresult {
    let f = cx.func(name).expect("entry point").cu_function();
    // SAFETY: a zeroed attribute is a valid value of the C struct; the id and value are set.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = sys::CUlaunchConfig {
        gridDimX: (p::N_V_HEADS * 4) as u32,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: 256,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: cx.stream().cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(pdl),
    };
    let vals = [
        a.out,
        a.s,
        a.conv_state,
        a.proj,
        a.conv_w,
        a.a_neg_exp,
        a.dt_bias,
        a.norm_w,
    ];
    let mut params: Vec<*mut std::ffi::c_void> = vals
        .iter()
        .map(|v| v as *const u64 as *mut std::ffi::c_void)
        .collect();
    // gdn_decode_step's ninth and tenth parameters: no L2 prefetch, no flags (its trigger after
    // the conv, as by default); the diagnostic kernels take eight
    let no_prefetch = cuda::L2Prefetch::default();
    let flags: i32 = 0;
    if name == "gdn_decode_step" {
        params.push(&no_prefetch as *const cuda::L2Prefetch as *mut std::ffi::c_void);
        params.push(&flags as *const i32 as *mut std::ffi::c_void);
    }
    cx.raw().bind_to_thread().expect("bind");
    // SAFETY: every gdn.cu entry takes these eight pointers (gdn_decode_step also the prefetch
    // list and its flags); `vals`, `no_prefetch` and `flags` outlive the call (the driver copies
    // the parameters at launch).
    unsafe { sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()) }
}

fn dptr<T: DevicePtr<f32>>(cx: &cuda::CudaContext, b: &T) -> u64 {
    b.device_ptr(cx.stream()).0
}

/// 12 steps from (`conv0`, `s0`) on GPU (`CudaContext::gdn_decode_step`) and CPU, comparing
/// after each step; even steps with L2 prefetch hints.
fn run_sequence(s: &mut Suite, label: &str, seed: u64, conv0: Vec<f32>, s0: Vec<f32>) {
    let cx = s.cx;
    let w = weights(seed);
    let conv_wd = cx.upload_f32(&w.conv_w).unwrap();
    let aned = cx.upload_f32(&w.a_neg_exp).unwrap();
    let dtbd = cx.upload_f32(&w.dt_bias).unwrap();
    let normd = cx.upload_f32(&w.norm_w).unwrap();
    let mut convd = upload_guarded(cx, &conv0);
    let mut sd = upload_guarded(cx, &s0);
    let mut scratch = cx.gdn_scratch().unwrap();
    let (mut conv_h, mut s_h) = (conv0, s0);
    let (mut w_out, mut w_conv, mut w_s) = (None, None, None);
    for step in 1..=STEPS {
        let x = proj(seed ^ (0x1000 + step as u64));
        let projd = cx.upload_f32(&x).unwrap();
        let mut outd = guarded(cx, GDN_OUT);
        // Even steps carry L2 prefetch hints (they must change nothing): a region whose size is
        // not a multiple of 16, one of 128 bytes (smaller than the grid's 256-byte shares: one
        // block fetches it), one under 16 bytes (dropped), and a whole buffer.
        scratch.l2_prefetch = cuda::L2Prefetch::default();
        if step % 2 == 0 {
            let pf = &mut scratch.l2_prefetch;
            pf.push(dptr(cx, &normd), 500);
            pf.push(dptr(cx, &aned), 128);
            pf.push(dptr(cx, &dtbd), 12);
            pf.push(dptr(cx, &conv_wd), w.conv_w.len() * 4);
        }
        {
            let mut ov = outd.slice_mut(GUARD..GUARD + GDN_OUT);
            let mut cv = convd.slice_mut(GUARD..GUARD + GDN_CONV_STATE_LEN);
            let mut sv = sd.slice_mut(GUARD..GUARD + GDN_STATE_LEN);
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
        let out_ref = cpu_step(&w, &x, &mut conv_h, &mut s_h);
        let c = check_guarded(&cx.download_f32(&outd).unwrap(), &f64s(&out_ref), TOL);
        let mut line = format!(
            "  {label} step {step:>2}: out rel {:.2e} max/rms {:.2e}",
            c.rel, c.max_over_rms
        );
        let mut ok = c.ok;
        worst(&mut w_out, c);
        if STATE_CHECK_STEPS.contains(&step) {
            let cc = check_guarded(&cx.download_f32(&convd).unwrap(), &f64s(&conv_h), EXACT);
            let sc = check_guarded(&cx.download_f32(&sd).unwrap(), &f64s(&s_h), TOL);
            line.push_str(&format!(
                "; conv {}; S rel {:.2e} max/rms {:.2e}",
                if cc.ok {
                    "exact".to_string()
                } else {
                    format!("rel {:.2e} {}", cc.rel, cc.msg)
                },
                sc.rel,
                sc.max_over_rms
            ));
            ok &= cc.ok && sc.ok;
            worst(&mut w_conv, cc);
            worst(&mut w_s, sc);
        }
        println!("{line} {}", if ok { "ok" } else { "FAIL" });
    }
    let tol_json = |t: Tol| {
        format!(
            "\"tol_rel\":{:e},\"tol_max_over_rms\":{:e},\"steps\":{STEPS}",
            t.rel, t.max_over_rms
        )
    };
    s.record(
        SEC,
        &format!("{label}: out, worst of {STEPS} steps"),
        &w_out.unwrap(),
        &tol_json(TOL),
    );
    s.record(
        SEC,
        &format!("{label}: conv state (bit-exact), worst"),
        &w_conv.unwrap(),
        &tol_json(EXACT),
    );
    s.record(
        SEC,
        &format!("{label}: S, worst"),
        &w_s.unwrap(),
        &tol_json(TOL),
    );
}

/// Runs the GDN decode checks and timings.
pub fn run(s: &mut Suite) {
    println!(
        "gdn_decode_step: proj {GDN_PROJ}, conv state {GDN_CONV_STATE_LEN}, S {GDN_STATE_LEN} f32 ({} MiB); tolerance rel {:e}, max/rms {:e}; conv state bit-exact",
        (GDN_STATE_LEN * 4) >> 20,
        TOL.rel,
        TOL.max_over_rms
    );
    run_sequence(
        s,
        "zero state",
        0x6D17,
        vec![0.0; GDN_CONV_STATE_LEN],
        vec![0.0; GDN_STATE_LEN],
    );
    run_sequence(
        s,
        "random state",
        0x6D18,
        rand_f32s(GDN_CONV_STATE_LEN, 0xC0, 3f32.sqrt()),
        rand_f32s(GDN_STATE_LEN, 0x5, 0.5),
    );
    timing(s);
}

/// Graph-replay timings: one layer hot in L2, and 30 layers with distinct buffers (plain and
/// PDL launches); for the kernel and for empty kernels with the same grid (with and without
/// the cluster shape: the launch floor).
fn timing(s: &mut Suite) {
    let cx = s.cx;
    let reps = if s.quick { 5 } else { 21 };
    let projd = cx.upload_f32(&proj(0x77)).unwrap();
    let mut outd = cx.stream().alloc_zeros::<f32>(GDN_OUT).unwrap();
    let mut scratch = cx.gdn_scratch().unwrap();
    let layers = p::N_LAYERS * 3 / 4; // the 30 GDN layers
    let ws: Vec<Weights> = (0..layers).map(|l| weights(0x900 + l as u64)).collect();
    let dev_w: Vec<[CudaSlice<f32>; 4]> = ws
        .iter()
        .map(|w| {
            [
                cx.upload_f32(&w.conv_w).unwrap(),
                cx.upload_f32(&w.a_neg_exp).unwrap(),
                cx.upload_f32(&w.dt_bias).unwrap(),
                cx.upload_f32(&w.norm_w).unwrap(),
            ]
        })
        .collect();
    let mut convs: Vec<CudaSlice<f32>> = (0..layers)
        .map(|l| {
            cx.upload_f32(&rand_f32s(GDN_CONV_STATE_LEN, 0xA00 + l as u64, 1.0))
                .unwrap()
        })
        .collect();
    let mut states: Vec<CudaSlice<f32>> = (0..layers)
        .map(|l| {
            cx.upload_f32(&rand_f32s(GDN_STATE_LEN, 0xB00 + l as u64, 0.3))
                .unwrap()
        })
        .collect();
    let bytes = 2.0 * (GDN_STATE_LEN * 4) as f64;
    let gbs = |t: f64| bytes / t / 1e9;
    // PDL launches outside a graph first: if the driver refuses them, skip the PDL timings
    let pdl_ok = {
        let [cw, ane, dtb, nw] = &dev_w[0];
        let a = Args {
            out: dptr(cx, &outd),
            s: dptr(cx, &states[0]),
            conv_state: dptr(cx, &convs[0]),
            proj: dptr(cx, &projd),
            conv_w: dptr(cx, cw),
            a_neg_exp: dptr(cx, ane),
            dt_bias: dptr(cx, dtb),
            norm_w: dptr(cx, nw),
        };
        let r = (0..2)
            .map(|_| launch_raw(cx, "gdn_decode_step", true, &a))
            .collect::<Vec<_>>();
        let synced = cx.synchronize();
        let ok = r.iter().all(|r| *r == sys::CUresult::CUDA_SUCCESS) && synced.is_ok();
        if !ok {
            println!("PDL launch refused ({r:?}, {synced:?}): PDL timings skipped");
        }
        ok
    };
    let variants = ["gdn_decode_step", "gdn_diag_null_cluster", "gdn_diag_null"];
    for name in variants {
        let api = name == "gdn_decode_step";
        // plain launches go through the API for the production kernel
        let mut call = |l: usize,
                        pdl: bool,
                        outd: &mut CudaSlice<f32>,
                        convs: &mut [CudaSlice<f32>],
                        states: &mut [CudaSlice<f32>]| {
            let [cw, ane, dtb, nw] = &dev_w[l];
            if api && !pdl {
                cx.gdn_decode_step(
                    &projd.slice(..),
                    &cw.slice(..),
                    &ane.slice(..),
                    &dtb.slice(..),
                    &nw.slice(..),
                    &mut convs[l].slice_mut(..),
                    &mut states[l].slice_mut(..),
                    &mut scratch,
                    &mut outd.slice_mut(..),
                )
                .expect("gdn_decode_step");
            } else {
                let a = Args {
                    out: dptr(cx, &*outd),
                    s: dptr(cx, &states[l]),
                    conv_state: dptr(cx, &convs[l]),
                    proj: dptr(cx, &projd),
                    conv_w: dptr(cx, cw),
                    a_neg_exp: dptr(cx, ane),
                    dt_bias: dptr(cx, dtb),
                    norm_w: dptr(cx, nw),
                };
                let r = launch_raw(cx, name, pdl, &a);
                assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "launch {name} (pdl {pdl})");
            }
        };
        let hot_calls = 64;
        let t_hot = s.time_graph(reps, || {
            for _ in 0..hot_calls {
                call(0, false, &mut outd, &mut convs, &mut states);
            }
        }) / hot_calls as f64;
        let passes = 2;
        let mut seq = |pdl: bool| {
            s.time_graph(reps, || {
                for _ in 0..passes {
                    for l in 0..layers {
                        call(l, pdl, &mut outd, &mut convs, &mut states);
                    }
                }
            }) / (passes * layers) as f64
        };
        let t_cold = seq(false);
        println!(
            "{name:<22} 1 layer x {hot_calls} (state in L2): {:>5.2} us/call {:>5.0} GB/s | {layers} layers: {:>5.2} us/call {:>5.0} GB/s ({:>4.1}% of copy)",
            t_hot * 1e6,
            gbs(t_hot),
            t_cold * 1e6,
            gbs(t_cold),
            gbs(t_cold) * 1e9 / s.copy_bw * 100.0,
        );
        let t_pdl = if pdl_ok { seq(true) } else { f64::NAN };
        println!(
            "{name:<22} {layers} layers, PDL launches: {:>5.2} us/call {:>5.0} GB/s",
            t_pdl * 1e6,
            gbs(t_pdl)
        );
        let mut sane = true;
        if api {
            // the state must still be finite after all the replays
            sane = cx
                .download_f32(&states[layers - 1])
                .unwrap()
                .iter()
                .all(|x| x.is_finite())
                && cx
                    .download_f32(&outd)
                    .unwrap()
                    .iter()
                    .all(|x| x.is_finite());
            if !sane {
                println!("  NON-FINITE STATE after replays: FAIL");
            }
            s.all_ok &= sane;
        }
        s.json.push((
            SEC.into(),
            format!(
                "{{\"timing\":{name:?},\"us_per_call_hot\":{:.3},\"us_per_call_30_layers\":{:.3},\"us_per_call_30_layers_pdl\":{:.3},\"state_gbps\":{:.1},\"state_gbps_pdl\":{:.1},\"finite_after_replays\":{sane}}}",
                t_hot * 1e6,
                t_cold * 1e6,
                t_pdl * 1e6,
                gbs(t_cold),
                gbs(t_pdl)
            ),
        ));
    }
}
