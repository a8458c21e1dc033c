//! Gated DeltaNet prefill, chunked (`CudaContext::gdn_prefill`, `kernels/gdn_prefill.cu`).
//!
//! Correctness: realistic random inputs at the real dimensions, T ∈ {1, 5, 63, 64, 65, 200,
//! 1000} from a zero state and from a random nonzero state (conv state and GDN state), plus a
//! sequence split as 100 + 37 tokens against one 137-token call and against the CPU. Every
//! product arithmetic ([`GdnPrefillMath`]) is checked, and in the cases of `run_case` the
//! wgmma state kernels' `out` and `S` must equal the mma.sync kernel's ([`GdnPrefillMath::Tf32`])
//! bit for bit.
//! The CPU twin is the prefill path of `model::Model`'s GDN mixer (crates/model/src/lib.rs)
//! after the projections, built in the same order from `model::reference::{causal_conv_silu,
//! l2norm_inplace, softplus, sigmoid, gdn_chunk (gdn_step for T = 1), gated_rms_norm}`.
//! `out`, the conv state and `S` sit between guard words of a NaN pattern. For one case the
//! scratch intermediates (q̂, k̂, g, β, γ, P, U, W) are compared too (printed, for diagnosis).
//!
//! Tolerances (relative L2 error, largest error over the reference's RMS):
//! * F32: 1e-5 and 1e-4 for `out` and `S`. Both sides are fp32 chunked computations that sum
//!   in different orders (FMA, tiles, the column-wise triangular solve): ~1e-7 per rounding,
//!   ~1e-6 after the 128-term sums and up to 16 chunks; 1e-5 leaves 10x.
//! * TF32: 5e-3 and 5e-2. The tensor-core operands carry 10 mantissa bits (unit roundoff
//!   u = 2^-11 ≈ 4.9e-4); the chunk chains three products (Tm·K̂, W·S, K̂ᵀV'), so ~2u-3u is
//!   expected and 10u is the budget. The state S still accumulates in fp32.
//! * conv state: bit-exact (a shift of copies).
//!
//! Timing: one layer at T = 512, 2048, 8192 (graph replay, CUDA events), both arithmetics, and
//! per stage at T = 8192.

use cuda::cudarc::driver::CudaSlice;
use cuda::gdn::{GDN_CONV_DIM, GDN_CONV_STATE_LEN, GDN_OUT, GDN_PROJ, GDN_STATE_LEN};
use cuda::gdn_prefill::{GdnPrefillMath, GdnPrefillScratch, GDN_PREFILL_CHUNK};
use cuda::CudaContext;
use model::reference as r;
use rayon::prelude::*;
use spec::production as p;

use crate::common::{check, check_guarded, guarded, rand_f32s, Cmp, Suite, Tol, GUARD, SENTINEL};

const SEC: &str = "gdnpre";
const TOL_F32: Tol = Tol { rel: 1e-5, max_over_rms: 1e-4 };
const TOL_TF32: Tol = Tol { rel: 5e-3, max_over_rms: 5e-2 };
/// Bit-exact: `rel < tiny` only passes at 0.
const EXACT: Tol = Tol { rel: f64::MIN_POSITIVE, max_over_rms: f64::MIN_POSITIVE };
const ALL_MATHS: [GdnPrefillMath; 5] =
    [GdnPrefillMath::F32, GdnPrefillMath::Tf32, GdnPrefillMath::Tf32Old, GdnPrefillMath::Tf32Wg, GdnPrefillMath::Tf32WgC];

fn tol(m: GdnPrefillMath) -> Tol {
    match m {
        GdnPrefillMath::F32 => TOL_F32,
        GdnPrefillMath::Tf32 | GdnPrefillMath::Tf32Old | GdnPrefillMath::Tf32Wg | GdnPrefillMath::Tf32WgC => TOL_TF32,
    }
}

fn mname(m: GdnPrefillMath) -> &'static str {
    match m {
        GdnPrefillMath::F32 => "f32",
        GdnPrefillMath::Tf32 => "tf32",
        GdnPrefillMath::Tf32Old => "tf32-old",
        GdnPrefillMath::Tf32Wg => "tf32-wg",
        GdnPrefillMath::Tf32WgC => "tf32-wgc",
    }
}

/// One layer's GDN weights used by the kernels (host copies).
struct Weights {
    conv_w: Vec<f32>,    // [conv_dim, 4]
    a_neg_exp: Vec<f32>, // [n_v]
    dt_bias: Vec<f32>,   // [n_v]
    norm_w: Vec<f32>,    // [d_v]
}

fn weights(seed: u64) -> Weights {
    let nv = p::N_V_HEADS;
    Weights {
        // taps ~ ±0.5 uniform
        conv_w: rand_f32s(GDN_CONV_DIM * p::CONV_KERNEL, seed ^ 1, 0.5),
        // -exp(A_log), A_log ~ U(-1, 1.5): per-token decays from ~0.95 to ~1e-5
        a_neg_exp: rand_f32s(nv, seed ^ 2, 1.25).into_iter().map(|x| -(x + 0.25).exp()).collect(),
        dt_bias: rand_f32s(nv, seed ^ 3, 1.0),
        norm_w: rand_f32s(p::D_V, seed ^ 4, 0.1).into_iter().map(|x| 1.0 + x).collect(),
    }
}

struct DevWeights {
    conv_w: CudaSlice<f32>,
    a_neg_exp: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    norm_w: CudaSlice<f32>,
}

fn upload_weights(cx: &CudaContext, w: &Weights) -> DevWeights {
    DevWeights {
        conv_w: cx.upload_f32(&w.conv_w).unwrap(),
        a_neg_exp: cx.upload_f32(&w.a_neg_exp).unwrap(),
        dt_bias: cx.upload_f32(&w.dt_bias).unwrap(),
        norm_w: cx.upload_f32(&w.norm_w).unwrap(),
    }
}

/// `proj` of `t` tokens: unit-variance uniform (q|k|v, z, b, a).
fn proj(t: usize, seed: u64) -> Vec<f32> {
    rand_f32s(t * GDN_PROJ, seed, 3f32.sqrt())
}

/// The CPU twin after the projections: crates/model/src/lib.rs `Model::gdn` from the conv on.
/// `conv`: [k-1, conv_dim]; `s`: [n_v, d_k, d_v]. Returns the gated-normed output [t, n_v·d_v].
fn cpu_prefill(w: &Weights, proj: &[f32], t: usize, conv: &mut Vec<f32>, s: &mut [f32]) -> Vec<f32> {
    let (nk, nv, dk, dv, kk) = (p::N_K_HEADS, p::N_V_HEADS, p::D_K, p::D_V, p::CONV_KERNEL);
    let (key_dim, conv_dim) = (nk * dk, GDN_CONV_DIM);
    let (zo, bo, ao) = (conv_dim, conv_dim + nv * dv, conv_dim + nv * dv + nv);
    let rows = || proj.chunks_exact(GDN_PROJ);
    let qkv: Vec<f32> = rows().flat_map(|r| r[..conv_dim].iter().copied()).collect();
    let z: Vec<f32> = rows().flat_map(|r| r[zo..bo].iter().copied()).collect();
    let b: Vec<f32> = rows().flat_map(|r| r[bo..ao].iter().copied()).collect();
    let a: Vec<f32> = rows().flat_map(|r| r[ao..].iter().copied()).collect();

    let mut window = std::mem::take(conv);
    window.extend_from_slice(&qkv);
    let mut mixed = vec![0.0f32; t * conv_dim];
    r::causal_conv_silu(&mut mixed, &window, &w.conv_w, conv_dim, kk);
    *conv = window[t * conv_dim..].to_vec();

    let mut q = Vec::with_capacity(t * key_dim);
    let mut k = Vec::with_capacity(t * key_dim);
    let mut v = Vec::with_capacity(t * nv * dv);
    for row in mixed.chunks_exact(conv_dim) {
        q.extend_from_slice(&row[..key_dim]);
        k.extend_from_slice(&row[key_dim..2 * key_dim]);
        v.extend_from_slice(&row[2 * key_dim..]);
    }
    r::l2norm_inplace(&mut q, dk, 1e-6);
    r::l2norm_inplace(&mut k, dk, 1e-6);
    let q_scale = 1.0 / (dk as f32).sqrt();
    q.iter_mut().for_each(|x| *x *= q_scale);
    let g: Vec<f32> = (0..t * nv).map(|i| w.a_neg_exp[i % nv] * r::softplus(a[i] + w.dt_bias[i % nv])).collect();
    let beta: Vec<f32> = b.iter().map(|&x| r::sigmoid(x)).collect();

    let ratio = nv / nk;
    let mut o = vec![0.0f32; t * nv * dv];
    let mut o_heads = vec![0.0f32; nv * t * dv];
    s.par_chunks_mut(dk * dv).zip(o_heads.par_chunks_mut(t * dv)).enumerate().for_each(|(j, (sj, oj))| {
        let hk = j / ratio;
        let gather = |src: &[f32], width: usize, heads: usize, h: usize, t0: usize, n: usize| -> Vec<f32> {
            (t0..t0 + n).flat_map(|tt| src[(tt * heads + h) * width..(tt * heads + h + 1) * width].iter().copied()).collect()
        };
        if t == 1 {
            r::gdn_step(sj, &q[hk * dk..(hk + 1) * dk], &k[hk * dk..(hk + 1) * dk], &v[j * dv..(j + 1) * dv], g[j].exp(), beta[j], oj);
        } else {
            let mut t0 = 0;
            while t0 < t {
                let n = GDN_PREFILL_CHUNK.min(t - t0);
                let qc = gather(&q, dk, nk, hk, t0, n);
                let kc = gather(&k, dk, nk, hk, t0, n);
                let vc = gather(&v, dv, nv, j, t0, n);
                let gc = gather(&g, 1, nv, j, t0, n);
                let bc = gather(&beta, 1, nv, j, t0, n);
                r::gdn_chunk(sj, &qc, &kc, &vc, &gc, &bc, dk, dv, &mut oj[t0 * dv..(t0 + n) * dv]);
                t0 += n;
            }
        }
    });
    for j in 0..nv {
        for tt in 0..t {
            o[(tt * nv + j) * dv..(tt * nv + j + 1) * dv].copy_from_slice(&o_heads[(j * t + tt) * dv..(j * t + tt + 1) * dv]);
        }
    }
    r::gated_rms_norm(&mut o, &z, &w.norm_w, p::RMS_EPS);
    o
}

/// Device copy of `data` between `GUARD` sentinel words on each side.
fn upload_guarded(cx: &CudaContext, data: &[f32]) -> CudaSlice<f32> {
    let mut v = vec![f32::from_bits(SENTINEL); data.len() + 2 * GUARD];
    v[GUARD..GUARD + data.len()].copy_from_slice(data);
    cx.upload_f32(&v).expect("upload")
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// One GPU call of `t` tokens on guarded state buffers, writing `out` at `out_off` floats.
#[allow(clippy::too_many_arguments)]
fn gpu_call(
    cx: &CudaContext,
    wd: &DevWeights,
    scratch: &mut GdnPrefillScratch,
    x: &[f32],
    t: usize,
    conv: &mut CudaSlice<f32>,
    st: &mut CudaSlice<f32>,
    outd: &mut CudaSlice<f32>,
    out_off: usize,
) {
    let projd = cx.upload_f32(x).unwrap();
    let mut ov = outd.slice_mut(GUARD + out_off..GUARD + out_off + t * GDN_OUT);
    let mut cv = conv.slice_mut(GUARD..GUARD + GDN_CONV_STATE_LEN);
    let mut sv = st.slice_mut(GUARD..GUARD + GDN_STATE_LEN);
    cx.gdn_prefill(
        &projd.slice(..),
        t,
        &wd.conv_w.slice(..),
        &wd.a_neg_exp.slice(..),
        &wd.dt_bias.slice(..),
        &wd.norm_w.slice(..),
        &mut cv,
        &mut sv,
        scratch,
        &mut ov,
    )
    .expect("gdn_prefill");
}

/// One block of `t` tokens from (`conv0`, `s0`) on GPU (both arithmetics) and CPU.
#[allow(clippy::too_many_arguments)]
fn run_case(
    s: &mut Suite,
    scratch: &mut GdnPrefillScratch,
    w: &Weights,
    wd: &DevWeights,
    label: &str,
    t: usize,
    seed: u64,
    conv0: &[f32],
    s0: &[f32],
    diagnose: bool,
) {
    let cx = s.cx;
    let x = proj(t, seed);
    let (mut conv_h, mut s_h) = (conv0.to_vec(), s0.to_vec());
    let out_ref = cpu_prefill(w, &x, t, &mut conv_h, &mut s_h);
    // (out, S) of the mma.sync TF32 state kernel, for the wgmma form's line below
    let mut tf32_mma: Option<(Vec<f32>, Vec<f32>)> = None;
    for m in ALL_MATHS {
        scratch.set_math(m);
        let mut convd = upload_guarded(cx, conv0);
        let mut sd = upload_guarded(cx, s0);
        let mut outd = guarded(cx, t * GDN_OUT);
        gpu_call(cx, wd, scratch, &x, t, &mut convd, &mut sd, &mut outd, 0);
        let co = check_guarded(&cx.download_f32(&outd).unwrap(), &f64s(&out_ref), tol(m));
        let cc = check_guarded(&cx.download_f32(&convd).unwrap(), &f64s(&conv_h), EXACT);
        let mut cs = check_guarded(&cx.download_f32(&sd).unwrap(), &f64s(&s_h), tol(m));
        if !cc.ok {
            cs.ok = false;
            cs.msg.push_str(&format!("conv state NOT bit-exact (rel {:.2e}) {}", cc.rel, cc.msg));
        } else {
            cs.msg.push_str("conv state exact");
        }
        let tj = |tl: Tol| format!("\"tol_rel\":{:e},\"tol_max_over_rms\":{:e},\"t\":{t}", tl.rel, tl.max_over_rms);
        s.record(SEC, &format!("T={t:<4} {label} {}: out", mname(m)), &co, &tj(tol(m)));
        s.record(SEC, &format!("T={t:<4} {label} {}: S", mname(m)), &cs, &tj(tol(m)));
        match m {
            GdnPrefillMath::Tf32 => {
                let (o_rs, s_rs) = (cx.download_f32(&outd).unwrap(), cx.download_f32(&sd).unwrap());
                // the prep's Tm operands rounded at every load (gdnp_prep_tf32lx) instead of
                // where they are stored: the same TF32 values reach the tensor cores, so the
                // outputs and the state must be the same words (guards included)
                scratch.set_prep_lean(false);
                let mut convd = upload_guarded(cx, conv0);
                let mut sd2 = upload_guarded(cx, s0);
                let mut outd2 = guarded(cx, t * GDN_OUT);
                gpu_call(cx, wd, scratch, &x, t, &mut convd, &mut sd2, &mut outd2, 0);
                scratch.set_prep_lean(true);
                let (o_ld, s_ld) = (cx.download_f32(&outd2).unwrap(), cx.download_f32(&sd2).unwrap());
                let c = same_words(&o_rs, &s_rs, &o_ld, &s_ld);
                s.record(SEC, &format!("T={t:<4} {label} tf32 prep rounding at store = at load, bit for bit"), &c, "");
                // the lean prep's Tm products balanced over the warps (gdnp_prep_tf32b) against
                // one row tile per warp (gdnp_prep_tf32), whichever is the default: each output
                // meets the same operands in the same k-step order, so the same words again
                let bal = scratch.prep_balanced();
                scratch.set_prep_balanced(!bal);
                let mut convd = upload_guarded(cx, conv0);
                let mut sd3 = upload_guarded(cx, s0);
                let mut outd3 = guarded(cx, t * GDN_OUT);
                gpu_call(cx, wd, scratch, &x, t, &mut convd, &mut sd3, &mut outd3, 0);
                scratch.set_prep_balanced(bal);
                let (o_ub, s_ub) = (cx.download_f32(&outd3).unwrap(), cx.download_f32(&sd3).unwrap());
                let c = same_words(&o_rs, &s_rs, &o_ub, &s_ub);
                s.record(SEC, &format!("T={t:<4} {label} tf32 prep products balanced = one row tile per warp, bit for bit"), &c, "");
                tf32_mma = Some((o_rs, s_rs));
            }
            GdnPrefillMath::Tf32Wg | GdnPrefillMath::Tf32WgC => {
                // the same products of the same TF32-rounded operands, on warpgroup MMAs: the
                // tensor cores sum a k-step as mma.sync does, so the outputs and the state must
                // equal the mma.sync kernel's bit for bit (guard words included)
                // (ALL_MATHS runs Tf32 before the wgmma forms)
                let Some((o_mma, s_mma)) = &tf32_mma else {
                    let c = Cmp { rel: f64::NAN, max_over_rms: f64::NAN, ok: false, msg: "no mma.sync result to compare with".into() };
                    s.record(SEC, &format!("T={t:<4} {label} {} = tf32 (mma.sync), bit for bit", mname(m)), &c, "");
                    continue;
                };
                let (o_wg, s_wg) = (cx.download_f32(&outd).unwrap(), cx.download_f32(&sd).unwrap());
                let c = same_words(&o_wg, &s_wg, o_mma, s_mma);
                s.record(SEC, &format!("T={t:<4} {label} {} = tf32 (mma.sync), bit for bit", mname(m)), &c, "");
            }
            _ => {}
        }
        if diagnose {
            diagnose_scratch(cx, scratch, w, &x, t, conv0, m);
        }
    }
}

/// Whether two runs' outputs and states (`out_a`, `s_a` against `out_b`, `s_b`, guard words
/// included) are the same words: ok only when none differs; `rel` is the fraction of differing
/// words.
fn same_words(out_a: &[f32], s_a: &[f32], out_b: &[f32], s_b: &[f32]) -> Cmp {
    let differ = |a: &[f32], b: &[f32]| a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    let (dout, ds) = (differ(out_a, out_b), differ(s_a, s_b));
    Cmp {
        rel: (dout + ds) as f64 / (out_a.len() + s_a.len()) as f64,
        max_over_rms: 0.0,
        ok: dout == 0 && ds == 0,
        msg: format!("{dout} of {} out words and {ds} of {} S words differ", out_a.len(), s_a.len()),
    }
}

/// Compares the scratch intermediates after a call with CPU values (printed only).
fn diagnose_scratch(cx: &CudaContext, scratch: &GdnPrefillScratch, w: &Weights, x: &[f32], t: usize, conv0: &[f32], m: GdnPrefillMath) {
    let (nk, nv, dk, dv, ch) = (p::N_K_HEADS, p::N_V_HEADS, p::D_K, p::D_V, GDN_PREFILL_CHUNK);
    let conv_dim = GDN_CONV_DIM;
    let nc = t.div_ceil(ch);
    let tp = nc * ch;
    // CPU q̂, k̂ [nk, tp, dk], v [nv, tp, dv], g, β [nv, tp]
    let mut window = conv0.to_vec();
    for row in x.chunks_exact(GDN_PROJ) {
        window.extend_from_slice(&row[..conv_dim]);
    }
    let mut mixed = vec![0.0f32; t * conv_dim];
    r::causal_conv_silu(&mut mixed, &window, &w.conv_w, conv_dim, p::CONV_KERNEL);
    let (mut q, mut k) = (vec![0f32; nk * tp * dk], vec![0f32; nk * tp * dk]);
    let mut v = vec![0f32; nv * tp * dv];
    let (mut g, mut beta) = (vec![0f32; nv * tp], vec![0f32; nv * tp]);
    let q_scale = 1.0 / (dk as f32).sqrt();
    for tt in 0..t {
        let row = &mixed[tt * conv_dim..(tt + 1) * conv_dim];
        for h in 0..nk {
            let mut qh = row[h * dk..(h + 1) * dk].to_vec();
            let mut kh = row[nk * dk + h * dk..nk * dk + (h + 1) * dk].to_vec();
            r::l2norm_inplace(&mut qh, dk, 1e-6);
            r::l2norm_inplace(&mut kh, dk, 1e-6);
            qh.iter_mut().for_each(|x| *x *= q_scale);
            q[(h * tp + tt) * dk..(h * tp + tt + 1) * dk].copy_from_slice(&qh);
            k[(h * tp + tt) * dk..(h * tp + tt + 1) * dk].copy_from_slice(&kh);
        }
        for j in 0..nv {
            v[(j * tp + tt) * dv..(j * tp + tt + 1) * dv].copy_from_slice(&row[2 * nk * dk + j * dv..2 * nk * dk + (j + 1) * dv]);
            let pr = &x[tt * GDN_PROJ..];
            let bo = conv_dim + nv * dv;
            g[j * tp + tt] = w.a_neg_exp[j] * r::softplus(pr[bo + nv + j] + w.dt_bias[j]);
            beta[j * tp + tt] = r::sigmoid(pr[bo + j]);
        }
    }
    // per V head and chunk: γ, P, U, W (f64)
    let mut gam = vec![0f32; nv * tp];
    let mut pm = vec![0f32; nv * nc * ch * ch];
    let mut u = vec![0f32; nv * tp * dv];
    let mut wm = vec![0f32; nv * tp * dk];
    for j in 0..nv {
        let hk = j / (nv / nk);
        for n in 0..nc {
            let r0 = n * ch;
            let kr = |r: usize| &k[(hk * tp + r0 + r) * dk..(hk * tp + r0 + r + 1) * dk];
            let qr = |r: usize| &q[(hk * tp + r0 + r) * dk..(hk * tp + r0 + r + 1) * dk];
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum::<f64>();
            let mut acc = 0f32;
            let mut gm = vec![0f64; ch];
            for rr in 0..ch {
                acc += g[j * tp + r0 + rr];
                gam[j * tp + r0 + rr] = acc;
                gm[rr] = f64::from(acc);
            }
            let bt = |rr: usize| f64::from(beta[j * tp + r0 + rr]);
            // A (strictly lower), then Tm = (I + A)^-1
            let mut am = vec![0f64; ch * ch];
            for rr in 0..ch {
                for mm in 0..rr {
                    am[rr * ch + mm] = bt(rr) * dot(kr(rr), kr(mm)) * (gm[rr] - gm[mm]).exp();
                }
            }
            let mut tm = vec![0f64; ch * ch];
            for col in 0..ch {
                tm[col * ch + col] = 1.0;
                for rr in col + 1..ch {
                    let sum: f64 = (col..rr).map(|mm| am[rr * ch + mm] * tm[mm * ch + col]).sum();
                    tm[rr * ch + col] = -sum;
                }
            }
            for rr in 0..ch {
                for ss in 0..=rr {
                    pm[((j * nc + n) * ch + rr) * ch + ss] = (dot(qr(rr), kr(ss)) * (gm[rr] - gm[ss]).exp()) as f32;
                }
                for c in 0..dv {
                    let (mut su, mut sw) = (0f64, 0f64);
                    for mm in 0..=rr {
                        let tb = tm[rr * ch + mm] * bt(mm);
                        su += tb * f64::from(v[(j * tp + r0 + mm) * dv + c]);
                        sw += tb * gm[mm].exp() * f64::from(k[(hk * tp + r0 + mm) * dk + c]);
                    }
                    u[(j * tp + r0 + rr) * dv + c] = su as f32;
                    wm[(j * tp + r0 + rr) * dk + c] = sw as f32;
                }
            }
        }
    }
    let bufs = scratch.buffers();
    let get = |name: &str, len: usize| -> Vec<f32> {
        let b = bufs.iter().find(|(n, _)| *n == name).unwrap().1;
        cx.stream().clone_dtoh(&b.slice(..len)).unwrap()
    };
    let mut line = format!("  diag T={t} {}:", mname(m));
    for (name, reference) in [("q", &q), ("k", &k), ("g", &g), ("beta", &beta), ("gam", &gam), ("p", &pm), ("vu", &u), ("w", &wm)] {
        let c = check(&get(name, reference.len()), &f64s(reference), TOL_F32, String::new());
        line.push_str(&format!(" {name} {:.1e}/{:.1e}", c.rel, c.max_over_rms));
    }
    println!("{line}  (rel / max-over-rms, informational)");
}

/// A 137-token sequence as 100 + 37 tokens, against one 137-token call and the CPU.
fn run_split(s: &mut Suite, scratch: &mut GdnPrefillScratch, w: &Weights, wd: &DevWeights) {
    let cx = s.cx;
    let (t1, t2) = (100usize, 37usize);
    let t = t1 + t2;
    let conv0 = rand_f32s(GDN_CONV_STATE_LEN, 0xC1, 3f32.sqrt());
    let s0 = rand_f32s(GDN_STATE_LEN, 0x51, 0.5);
    let x = proj(t, 0x5917);
    let (mut conv_h, mut s_h) = (conv0.clone(), s0.clone());
    let out_ref = cpu_prefill(w, &x, t, &mut conv_h, &mut s_h);
    for m in ALL_MATHS {
        scratch.set_math(m);
        // one call
        let mut convd = upload_guarded(cx, &conv0);
        let mut sd = upload_guarded(cx, &s0);
        let mut outd = guarded(cx, t * GDN_OUT);
        gpu_call(cx, wd, scratch, &x, t, &mut convd, &mut sd, &mut outd, 0);
        let one_out = cx.download_f32(&outd).unwrap();
        let one_s = cx.download_f32(&sd).unwrap();
        // two calls
        let mut convd2 = upload_guarded(cx, &conv0);
        let mut sd2 = upload_guarded(cx, &s0);
        let mut outd2 = guarded(cx, t * GDN_OUT);
        gpu_call(cx, wd, scratch, &x[..t1 * GDN_PROJ], t1, &mut convd2, &mut sd2, &mut outd2, 0);
        gpu_call(cx, wd, scratch, &x[t1 * GDN_PROJ..], t2, &mut convd2, &mut sd2, &mut outd2, t1 * GDN_OUT);
        let two_out = cx.download_f32(&outd2).unwrap();
        let two_s = cx.download_f32(&sd2).unwrap();
        let two_conv = cx.download_f32(&convd2).unwrap();
        let tl = tol(m);
        let tj = format!("\"tol_rel\":{:e},\"tol_max_over_rms\":{:e},\"t\":{t}", tl.rel, tl.max_over_rms);
        let c = check_guarded(&two_out, &f64s(&out_ref), tl);
        s.record(SEC, &format!("100+37 {} vs CPU 137: out", mname(m)), &c, &tj);
        let mut c = check_guarded(&two_s, &f64s(&s_h), tl);
        let cc = check_guarded(&two_conv, &f64s(&conv_h), EXACT);
        if !cc.ok {
            c.ok = false;
            c.msg.push_str("conv state NOT bit-exact");
        } else {
            c.msg.push_str("conv state exact");
        }
        s.record(SEC, &format!("100+37 {} vs CPU 137: S", mname(m)), &c, &tj);
        let one_out_ref: Vec<f64> = f64s(&one_out[GUARD..GUARD + t * GDN_OUT]);
        let one_s_ref: Vec<f64> = f64s(&one_s[GUARD..GUARD + GDN_STATE_LEN]);
        let c = check_guarded(&two_out, &one_out_ref, tl);
        s.record(SEC, &format!("100+37 {} vs GPU 137: out", mname(m)), &c, &tj);
        let c = check_guarded(&two_s, &one_s_ref, tl);
        s.record(SEC, &format!("100+37 {} vs GPU 137: S", mname(m)), &c, &tj);
    }
}

/// `gdn_prefill_acts` against `gdn_prefill` + `convert_acts` from the same state (TF32, the
/// default arithmetic), with the norm as its own kernel and inside the state kernel
/// (`GdnPrefillScratch::set_fused_norm`): the activations, the conv state and `S` bit for bit,
/// and an unwritten activation row (the scratch is first filled with a NaN pattern by
/// `convert_acts`) fails. T = 1, 65, 129 and 300: one chunk, and two to five chunks with the
/// last one partial (the fused form's partial sums alternate between two slots by chunk).
pub fn acts_check(s: &mut Suite) {
    let cx = s.cx;
    let w = weights(0x9D2);
    let wd = upload_weights(cx, &w);
    let mut scratch = cx.gdn_prefill_scratch(300).expect("scratch");
    let (fused_norm0, global0) = (scratch.fused_norm(), scratch.fused_norm_global());
    // the fused norm exists for this arithmetic only (the others would run the norm kernel)
    let math0 = scratch.math();
    scratch.set_math(GdnPrefillMath::Tf32WgC);
    println!(
        "gdn_prefill_acts: {} clusters of gdnp_state_tf32wgcn fit at once ({} needed for one wave)",
        cx.gdn_fused_norm_clusters().unwrap_or(0),
        p::N_V_HEADS
    );
    let mut gemm = cx.gemm_scratch(300).expect("gemm scratch");
    let rnd_conv = rand_f32s(GDN_CONV_STATE_LEN, 0xC1, 3f32.sqrt());
    let rnd_s = rand_f32s(GDN_STATE_LEN, 0x6, 0.5);
    let ts = [1usize, 65, 129, 300];
    for (ti, &t) in ts.iter().enumerate() {
        let x = proj(t, 0x7300 + ti as u64);
        let projd = cx.upload_f32(&x).unwrap();
        let mut runs = Vec::new();
        // gdn_prefill + convert_acts; gdn_prefill_acts with the norm kernel; with the norm
        // inside, its partials by cluster and through global memory
        for (fused, fnorm, global) in [(false, false, false), (true, false, false), (true, true, false), (true, true, true)] {
            scratch.set_fused_norm(fnorm);
            scratch.set_fused_norm_global(global);
            let mut convd = upload_guarded(cx, &rnd_conv);
            let mut sd = upload_guarded(cx, &rnd_s);
            let mut outd = guarded(cx, t * GDN_OUT);
            // NaN activations first, so that a row the fused norm leaves unwritten shows
            let nan = cx.upload_f32(&vec![f32::NAN; t * GDN_OUT]).unwrap();
            cx.convert_acts(&nan.slice(..), t, GDN_OUT, &mut gemm).unwrap();
            {
                let mut ov = outd.slice_mut(GUARD..GUARD + t * GDN_OUT);
                let mut cv = convd.slice_mut(GUARD..GUARD + GDN_CONV_STATE_LEN);
                let mut sv = sd.slice_mut(GUARD..GUARD + GDN_STATE_LEN);
                let (wc, wa, wdt, wn) = (wd.conv_w.slice(..), wd.a_neg_exp.slice(..), wd.dt_bias.slice(..), wd.norm_w.slice(..));
                if fused {
                    cx.gdn_prefill_acts(&projd.slice(..), t, &wc, &wa, &wdt, &wn, &mut cv, &mut sv, &mut scratch, &mut ov, &mut gemm)
                        .expect("gdn_prefill_acts");
                } else {
                    cx.gdn_prefill(&projd.slice(..), t, &wc, &wa, &wdt, &wn, &mut cv, &mut sv, &mut scratch, &mut ov).expect("gdn_prefill");
                }
            }
            if !fused {
                cx.convert_acts(&outd.slice(GUARD..GUARD + t * GDN_OUT), t, GDN_OUT, &mut gemm).unwrap();
            }
            let acts = gemm.download_acts(cx).unwrap();
            runs.push((acts, cx.download_f32(&convd).unwrap(), cx.download_f32(&sd).unwrap()));
        }
        let (a0, c0, s0) = &runs[0];
        for (i, what) in [
            (1, "gdn_prefill_acts"),
            (2, "gdn_prefill_acts, norm in the state kernel,"),
            (3, "gdn_prefill_acts, norm in the state kernel (global),"),
        ] {
            let (a1, c1, s1) = &runs[i];
            let nan_acts = a1.iter().filter(|&&b| (b & 0x7fff) > 0x7f80).count();
            let differ = a0.iter().zip(a1).filter(|(x, y)| x != y).count();
            // whole guarded buffers bit for bit (guards included), and the state finite
            let bits = |a: &[f32], b: &[f32]| a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits());
            let (s_differ, c_differ) = (bits(s1, s0), bits(c1, c0));
            let finite = s1[GUARD..s1.len() - GUARD].iter().all(|v| v.is_finite());
            let ok = a1.len() == t * GDN_OUT && differ == 0 && nan_acts == 0 && !s_differ && !c_differ && finite;
            let c = crate::common::Cmp {
                rel: if ok { 0.0 } else { f64::NAN },
                max_over_rms: if ok { 0.0 } else { f64::NAN },
                ok,
                msg: format!(
                    "acts: {differ} of {} differ, {nan_acts} NaN; S {}; conv state {}",
                    a1.len(),
                    if s_differ { "DIFFERS" } else { "equal" },
                    if c_differ { "DIFFERS" } else { "equal" }
                ),
            };
            s.record(SEC, &format!("T={t:<4} {what} = gdn_prefill + convert_acts, bit for bit"), &c, "");
        }
    }
    // one launch of the global form per T above: 128 tickets each, or the epochs went wrong
    let tickets = scratch.fused_norm_tickets(cx).expect("tickets");
    let want = (ts.len() * p::N_V_HEADS * 4) as u32;
    let ok = tickets == want;
    let c = crate::common::Cmp {
        rel: if ok { 0.0 } else { f64::NAN },
        max_over_rms: if ok { 0.0 } else { f64::NAN },
        ok,
        msg: format!("{tickets} tickets, {want} expected"),
    };
    s.record(SEC, "gdn_prefill_acts, norm in the state kernel (global): one ticket per block and launch", &c, "");
    scratch.set_fused_norm(fused_norm0);
    scratch.set_fused_norm_global(global0);
    scratch.set_math(math0);
}

/// Runs the GDN prefill checks and timings.
pub fn run(s: &mut Suite) {
    let cx = s.cx;
    println!(
        "gdn_prefill: chunk {GDN_PREFILL_CHUNK}, proj {GDN_PROJ}/token; tolerances f32 rel {:e} max/rms {:e}, tf32 rel {:e} max/rms {:e}; conv state bit-exact",
        TOL_F32.rel, TOL_F32.max_over_rms, TOL_TF32.rel, TOL_TF32.max_over_rms
    );
    let w = weights(0x9D1);
    let wd = upload_weights(cx, &w);
    let mut scratch = cx.gdn_prefill_scratch(1000).expect("scratch");
    let zero_conv = vec![0.0f32; GDN_CONV_STATE_LEN];
    let zero_s = vec![0.0f32; GDN_STATE_LEN];
    let rnd_conv = rand_f32s(GDN_CONV_STATE_LEN, 0xC0, 3f32.sqrt());
    let rnd_s = rand_f32s(GDN_STATE_LEN, 0x5, 0.5);
    for (ti, &t) in [1usize, 5, 63, 64, 65, 200, 1000].iter().enumerate() {
        run_case(s, &mut scratch, &w, &wd, "zero state  ", t, 0x7000 + ti as u64, &zero_conv, &zero_s, false);
        run_case(s, &mut scratch, &w, &wd, "random state", t, 0x7100 + ti as u64, &rnd_conv, &rnd_s, t == 200);
    }
    run_split(s, &mut scratch, &w, &wd);
    drop(scratch);
    timing(s, &wd);
}

/// Graph-replay timings of one layer at T = 512, 1024, 2048, 8192, and per stage (each stage
/// alone) at every T.
fn timing(s: &mut Suite, wd: &DevWeights) {
    let cx = s.cx;
    let reps = if s.quick { 3 } else { 11 };
    let tmax = 8192usize;
    let mut scratch = cx.gdn_prefill_scratch(tmax).expect("scratch");
    // the fused norm's clusters resident at once (0: the query failed), for its timing lines
    let clusters = cx.gdn_fused_norm_clusters().unwrap_or(0);
    let projd = cx.upload_f32(&proj(tmax, 0x77)).unwrap();
    let mut outd = cx.stream().alloc_zeros::<f32>(tmax * GDN_OUT).unwrap();
    let mut convd = cx.upload_f32(&rand_f32s(GDN_CONV_STATE_LEN, 0xA0, 1.0)).unwrap();
    let mut sd = cx.upload_f32(&rand_f32s(GDN_STATE_LEN, 0xB0, 0.3)).unwrap();
    let call = |t: usize, scratch: &mut GdnPrefillScratch, outd: &mut CudaSlice<f32>, convd: &mut CudaSlice<f32>, sd: &mut CudaSlice<f32>| {
        cx.gdn_prefill(
            &projd.slice(..t * GDN_PROJ),
            t,
            &wd.conv_w.slice(..),
            &wd.a_neg_exp.slice(..),
            &wd.dt_bias.slice(..),
            &wd.norm_w.slice(..),
            &mut convd.slice_mut(..),
            &mut sd.slice_mut(..),
            scratch,
            &mut outd.slice_mut(..t * GDN_OUT),
        )
        .expect("gdn_prefill");
    };
    // the layer as the prefill runs it: the norm writes out_proj's activations
    let mut gemm = cx.gemm_scratch(tmax).expect("gemm scratch");
    let call_acts = |t: usize,
                     scratch: &mut GdnPrefillScratch,
                     gemm: &mut cuda::gemm::GemmScratch,
                     outd: &mut CudaSlice<f32>,
                     convd: &mut CudaSlice<f32>,
                     sd: &mut CudaSlice<f32>| {
        cx.gdn_prefill_acts(
            &projd.slice(..t * GDN_PROJ),
            t,
            &wd.conv_w.slice(..),
            &wd.a_neg_exp.slice(..),
            &wd.dt_bias.slice(..),
            &wd.norm_w.slice(..),
            &mut convd.slice_mut(..),
            &mut sd.slice_mut(..),
            scratch,
            &mut outd.slice_mut(..t * GDN_OUT),
            gemm,
        )
        .expect("gdn_prefill_acts");
    };
    for m in ALL_MATHS {
        scratch.set_math(m);
        for t in [512usize, 1024, 2048, 8192] {
            // each stage alone, replayed on stale inputs (the numbers are meaningless); the
            // norm stage is gdnp_norm (the prefill's gdnp_norm_acts reads o once more and
            // writes half the bytes)
            let mut stages = Vec::new();
            for st in 0..4 {
                scratch.set_stage_mask(1 << st);
                stages.push(s.time_graph(reps, || call(t, &mut scratch, &mut outd, &mut convd, &mut sd)));
            }
            scratch.set_stage_mask(0b1111);
            convd = cx.upload_f32(&rand_f32s(GDN_CONV_STATE_LEN, 0xA0, 1.0)).unwrap();
            sd = cx.upload_f32(&rand_f32s(GDN_STATE_LEN, 0xB0, 0.3)).unwrap();
            let sec = s.time_graph(reps, || call(t, &mut scratch, &mut outd, &mut convd, &mut sd));
            let (sc, sp, ss, sn) = (stages[0] * 1e6, stages[1] * 1e6, stages[2] * 1e6, stages[3] * 1e6);
            println!(
                "gdn_prefill {} T={t:<5}: {:>8.1} us per layer, {:>6.2} M tok/s per layer, x30 layers {:.2} ms  [conv {sc:.0} us, prep {sp:.0} us, state {ss:.0} us, norm {sn:.0} us]",
                mname(m),
                sec * 1e6,
                t as f64 / sec / 1e6,
                sec * 30.0 * 1e3
            );
            let mut st_json = format!(",\"us_conv\":{sc:.1},\"us_prep\":{sp:.1},\"us_state\":{ss:.1},\"us_norm\":{sn:.1}");
            if m == GdnPrefillMath::Tf32WgC {
                // the prep alone in both forms (operands rounded where stored and A, P in one
                // pass: the default; rounded at each load: the twin), each also with each of
                // its parts left out (ablate bits; the outputs are then wrong)
                scratch.set_stage_mask(0b0010);
                let bal0 = scratch.prep_balanced();
                for (rx, bal) in [(true, true), (true, false), (false, false)] {
                    scratch.set_prep_lean(rx);
                    scratch.set_prep_balanced(bal);
                    let whole = s.time_graph(reps, || call(t, &mut scratch, &mut outd, &mut convd, &mut sd)) * 1e6;
                    let mut parts = Vec::new();
                    for (bit, what) in [(1, "solve"), (2, "Tm products"), (4, "A, P loops"), (8, "Gram products")] {
                        scratch.set_prep_ablate(bit);
                        let us = s.time_graph(reps, || call(t, &mut scratch, &mut outd, &mut convd, &mut sd)) * 1e6;
                        parts.push((what, bit, us));
                    }
                    scratch.set_prep_ablate(0);
                    let form = match (rx, bal) {
                        (true, true) => "rounded where stored, A and P in one pass, products balanced (session 54)",
                        (true, false) => "rounded where stored, A and P in one pass, one row tile per warp",
                        _ => "rounded at each load (twin)",
                    };
                    let list: Vec<String> = parts.iter().map(|(w, _, us)| format!("without {w} {us:.0} ({:+.0})", us - whole)).collect();
                    println!("gdn_prefill prep T={t:<5} {form}: {whole:.0} us; {}", list.join(", "));
                    let key = match (rx, bal) {
                        (true, true) => "rxb",
                        (true, false) => "rx",
                        _ => "lx",
                    };
                    st_json.push_str(&format!(",\"us_prep_{key}\":{whole:.1}"));
                    for (_, bit, us) in &parts {
                        st_json.push_str(&format!(",\"us_prep_{key}_ablate_{bit}\":{us:.1}"));
                    }
                }
                scratch.set_prep_lean(true);
                scratch.set_prep_balanced(bal0);
                scratch.set_stage_mask(0b1111);
                // the layer writing out_proj's activations, the gated norm as its own kernel
                // (gdnp_norm_acts) and inside the state kernel (gdnp_state_tf32wgcn, session 55)
                let (fn0, fg0) = (scratch.fused_norm(), scratch.fused_norm_global());
                let mut acts_us = [0f64; 3];
                for (i, (on, global)) in [(false, false), (true, false), (true, true)].into_iter().enumerate() {
                    scratch.set_fused_norm(on);
                    scratch.set_fused_norm_global(global);
                    acts_us[i] = s.time_graph(reps, || call_acts(t, &mut scratch, &mut gemm, &mut outd, &mut convd, &mut sd)) * 1e6;
                }
                scratch.set_fused_norm(fn0);
                scratch.set_fused_norm_global(fg0);
                println!(
                    "gdn_prefill acts T={t:<5}: norm kernel {:.1} us, norm in the state kernel {:.1} us ({:+.1}%; {} of {} clusters fit at once), partials through global memory {:.1} us ({:+.1}%)",
                    acts_us[0],
                    acts_us[1],
                    100.0 * (acts_us[1] / acts_us[0] - 1.0),
                    clusters,
                    p::N_V_HEADS,
                    acts_us[2],
                    100.0 * (acts_us[2] / acts_us[0] - 1.0)
                );
                st_json.push_str(&format!(
                    ",\"us_acts_norm_kernel\":{:.1},\"us_acts_fused_norm\":{:.1},\"us_acts_fused_norm_global\":{:.1}",
                    acts_us[0], acts_us[1], acts_us[2]
                ));
                convd = cx.upload_f32(&rand_f32s(GDN_CONV_STATE_LEN, 0xA0, 1.0)).unwrap();
                sd = cx.upload_f32(&rand_f32s(GDN_STATE_LEN, 0xB0, 0.3)).unwrap();
            }
            s.json.push((
                SEC.into(),
                format!("{{\"timing\":true,\"math\":\"{}\",\"t\":{t},\"us_per_layer\":{:.1}{st_json}}}", mname(m), sec * 1e6),
            ));
        }
    }
    let sane = cx.download_f32(&sd).unwrap().iter().all(|x| x.is_finite())
        && cx.download_f32(&outd).unwrap().iter().all(|x| x.is_finite());
    if !sane {
        println!("gdn_prefill: NON-FINITE state or output after the timing replays: FAIL");
    }
    s.all_ok &= sane;
}
