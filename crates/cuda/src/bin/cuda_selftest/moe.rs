//! Sparse MoE decode step (`CudaContext::moe_decode_step`): router + softmax + top-k, the chosen
//! experts' and the shared expert's SwiGLU, the weighted combine and the residual.
//!
//! Random MLX-layout weights at the real dimensions (256 experts; codes uniform, per-group
//! scales and biases that give weights of a chosen standard deviation, a few negative scales),
//! router scales giving logits of standard deviation ~2 as a trained router has. For each bit
//! layout, several random inputs (with outlier channels) checked against the CPU definition
//! (`quant::reference::gemv`, `model::reference::softmax_inplace`, `model::top_k_renorm`,
//! `model::reference::{silu, sigmoid}`, experts summed in ascending id order as `Model::moe`):
//! chosen ids exactly, routing weights, router logits, and `out` (guard words, NaN sentinel)
//! plus its MoE part `out - resid` on its own. One case has exact ties in the router logits.
//! Then the time of one layer's step from a graph replay of 40 layers with distinct weights
//! (device copies, so the L2 holds none of them) and inputs, with GB/s of weights read.
//!
//! Tolerance: `Tol::F32` (relative L2 1e-4, max error 1e-3·rms) everywhere. The GPU sums in
//! f32 in another order than the CPU (and its code·activation products are exact), so the
//! expected differences are ~1e-6 relative.

use cuda::moe::{DeviceMoe, ExpertRefs, MoeFlags, MoeRefs};
use half::bf16;
use model::reference as r;
use quant::{QMat, QMatRef, QuantSpec};
use spec::production as p;

use crate::common::{check, check_guarded, guarded, rand_f32s, rand_u32s, Cmp, Suite, Tol, GUARD};

const SEC: &str = "moe";
const LAYERS: usize = 40;

/// One layer's MoE weights on the host: routed experts stacked as MLX `switch_mlp` does.
struct HostMoe {
    router: QMat,
    shared_gate: QMat,
    /// `[N_EXPERTS * D_EXPERT, D_MODEL]`
    gate: QMat,
    /// `[N_EXPERTS * D_EXPERT, D_MODEL]`
    up: QMat,
    /// `[N_EXPERTS * D_MODEL, D_EXPERT]`
    down: QMat,
    sh_gate: QMat,
    sh_up: QMat,
    sh_down: QMat,
}

/// Random MLX affine weights: uniform codes, scales giving `w = s·q + b` a standard deviation
/// of about `sigma` (±40% per group, 1 in 20 negative), biases centring the codes (±20%).
pub(crate) fn rand_qmat(rows: usize, cols: usize, bits: u32, seed: u64, sigma: f32) -> QMat {
    let spec = QuantSpec::new(bits, cuda::QUANT_GROUP).unwrap();
    let packed = rand_u32s(rows * spec.words_per_row(cols), seed);
    let n = rows * spec.groups_per_row(cols);
    let levels = ((1u32 << bits) - 1) as f32;
    let s0 = sigma * 12f32.sqrt() / levels;
    let r1 = rand_f32s(n, seed ^ 0xA11CE, 1.0);
    let r2 = rand_f32s(n, seed ^ 0xB0B, 1.0);
    let scales: Vec<f32> = r1
        .iter()
        .zip(&r2)
        .map(|(a, b)| s0 * (1.0 + 0.4 * a) * if *b > 0.9 { -1.0 } else { 1.0 })
        .collect();
    let biases: Vec<bf16> = scales
        .iter()
        .zip(&r2)
        .map(|(s, b)| bf16::from_f32(-s * levels / 2.0 * (1.0 + 0.2 * b)))
        .collect();
    let scales = scales.into_iter().map(bf16::from_f32).collect();
    QMat { rows, cols, spec, packed, scales, biases }
}

impl HostMoe {
    /// bits: (router, shared gate, routed gate/up, routed down, shared gate/up, shared down)
    fn random(bits: [u32; 6], seed: u64) -> HostMoe {
        let (d, ne, de, ds) = (p::D_MODEL, p::N_EXPERTS, p::D_EXPERT, p::D_SHARED_EXPERT);
        HostMoe {
            router: rand_qmat(ne, d, bits[0], seed + 1, 0.05),
            shared_gate: rand_qmat(1, d, bits[1], seed + 2, 0.03),
            gate: rand_qmat(ne * de, d, bits[2], seed + 3, 0.025),
            up: rand_qmat(ne * de, d, bits[2], seed + 4, 0.025),
            down: rand_qmat(ne * d, de, bits[3], seed + 5, 0.03),
            sh_gate: rand_qmat(ds, d, bits[4], seed + 6, 0.025),
            sh_up: rand_qmat(ds, d, bits[4], seed + 7, 0.025),
            sh_down: rand_qmat(d, ds, bits[5], seed + 8, 0.03),
        }
    }

    fn expert(&self, e: usize) -> ExpertRefs<'_> {
        let (d, de) = (p::D_MODEL, p::D_EXPERT);
        ExpertRefs {
            gate: self.gate.as_ref().slice_rows(e * de, (e + 1) * de),
            up: self.up.as_ref().slice_rows(e * de, (e + 1) * de),
            down: self.down.as_ref().slice_rows(e * d, (e + 1) * d),
        }
    }

    fn shared(&self) -> ExpertRefs<'_> {
        ExpertRefs { gate: self.sh_gate.as_ref(), up: self.sh_up.as_ref(), down: self.sh_down.as_ref() }
    }

    fn refs<'a>(&'a self, router: &'a QMat) -> MoeRefs<'a> {
        MoeRefs {
            router: router.as_ref(),
            experts: (0..p::N_EXPERTS).map(|e| self.expert(e)).collect(),
            shared: self.shared(),
            shared_gate: self.shared_gate.as_ref(),
        }
    }
}

fn gemv(m: QMatRef<'_>, x: &[f32]) -> Vec<f32> {
    let mut o = vec![0f32; m.rows];
    quant::reference::gemv(&mut o, m, x);
    o
}

/// `model::expert_forward` with the reference GEMV.
fn expert_ref(x: ExpertRefs<'_>, u: &[f32]) -> Vec<f32> {
    let g = gemv(x.gate, u);
    let up = gemv(x.up, u);
    let h: Vec<f32> = g.iter().zip(&up).map(|(a, b)| r::silu(*a) * b).collect();
    gemv(x.down, &h)
}

struct Reference {
    logits: Vec<f32>,
    chosen: Vec<(usize, f32)>,
    gate_sig: f32,
    moe: Vec<f32>,
}

/// `Model::moe` for one token (MODEL.md §3.7), Backend::Reference arithmetic.
fn reference(w: &HostMoe, router: &QMat, u: &[f32]) -> Reference {
    let mut logits = gemv(router.as_ref(), u);
    let sg = gemv(w.shared_gate.as_ref(), u)[0];
    let mut pr = logits.clone();
    r::softmax_inplace(&mut pr);
    let chosen = model::top_k_renorm(&pr, p::TOP_K);
    let mut moe = vec![0f32; p::D_MODEL];
    let mut by_id = chosen.clone();
    by_id.sort_by_key(|&(e, _)| e);
    for (e, wt) in by_id {
        let y = expert_ref(w.expert(e), u);
        moe.iter_mut().zip(&y).for_each(|(o, v)| *o += wt * v);
    }
    let c = r::sigmoid(sg);
    let ys = expert_ref(w.shared(), u);
    moe.iter_mut().zip(&ys).for_each(|(o, v)| *o += c * v);
    logits.push(sg);
    Reference { logits, chosen, gate_sig: c, moe }
}

/// A post-norm-like input: uniform with standard deviation ~1 plus a few outlier channels.
fn input(seed: u64, offset: f32) -> Vec<f32> {
    let mut u = rand_f32s(p::D_MODEL, seed, 1.7);
    u.iter_mut().for_each(|v| *v += offset);
    u[7] = 11.0;
    u[p::D_MODEL / 2 + 3] = -8.5;
    u[p::D_MODEL - 5] = 6.0;
    u
}

/// Runs one step and checks everything against the CPU; returns whether all passed.
#[allow(clippy::too_many_arguments)]
fn check_step(
    s: &mut Suite,
    label: &str,
    w: &HostMoe,
    router: &QMat,
    dm: &DeviceMoe,
    scratch: &mut cuda::moe::MoeScratch,
    u: &[f32],
    resid: &[f32],
    expect_ids: Option<&[usize]>,
    flags: MoeFlags,
) {
    let cx = s.cx;
    let d = p::D_MODEL;
    let rf = reference(w, router, u);
    let ud = cx.upload_f32(u).unwrap();
    let rd = cx.upload_f32(resid).unwrap();
    let mut outd = guarded(cx, d);
    {
        let mut ov = outd.slice_mut(GUARD..GUARD + d);
        if flags == MoeFlags::DEFAULT {
            cx.moe_decode_step(dm, &ud.slice(..), &rd.slice(..), scratch, &mut ov).expect("moe_decode_step");
        } else {
            for part in 0..3 {
                cx.moe_decode_part(dm, &ud.slice(..), &rd.slice(..), scratch, &mut ov, part, flags, None).expect("moe part");
            }
        }
    }
    let got = cx.download_f32(&outd).unwrap();
    let ids: Vec<i32> = cx.stream().clone_dtoh(&scratch.sel_ids).unwrap();
    let wts: Vec<f32> = cx.download_f32(&scratch.sel_w).unwrap();
    let logits: Vec<f32> = cx.download_f32(&scratch.logits).unwrap();

    // chosen ids, exactly
    let want: Vec<i32> = rf.chosen.iter().map(|&(e, _)| e as i32).collect();
    let mut ids_ok = ids == want;
    if let Some(x) = expect_ids {
        let x: Vec<i32> = x.iter().map(|&e| e as i32).collect();
        ids_ok &= ids == x;
    }
    // gap between the k-th and (k+1)-th probability on the CPU, for the record
    let mut pr = rf.logits[..p::N_EXPERTS].to_vec();
    r::softmax_inplace(&mut pr);
    pr.sort_by(|a, b| b.total_cmp(a));
    let gap = pr[p::TOP_K - 1] - pr[p::TOP_K];
    let msg = format!("gpu {ids:?} cpu {want:?} (p_k - p_k+1 = {gap:.2e})");
    let c = Cmp { rel: 0.0, max_over_rms: 0.0, ok: ids_ok, msg: if ids_ok { String::new() } else { msg } };
    s.record(SEC, &format!("{label}: chosen ids"), &c, "");
    if ids_ok {
        println!("{SEC:<10}   ids {ids:?}, p_k - p_k+1 = {gap:.2e}");
    }

    // routing weights and the shared gate's sigmoid
    let mut wref: Vec<f64> = rf.chosen.iter().map(|&(_, x)| f64::from(x)).collect();
    wref.push(f64::from(rf.gate_sig));
    let cw = check(&wts, &wref, Tol::F32, String::new());
    s.record(SEC, &format!("{label}: routing weights + sigmoid(shared gate)"), &cw, "");
    // logits
    let lref: Vec<f64> = rf.logits.iter().map(|v| f64::from(*v)).collect();
    let cl = check(&logits, &lref, Tol::F32, String::new());
    s.record(SEC, &format!("{label}: router + shared-gate logits"), &cl, "");
    // out (guards, NaN sentinel) and the MoE part alone
    let oref: Vec<f64> = resid.iter().zip(&rf.moe).map(|(a, b)| f64::from(*a + *b)).collect();
    let co = check_guarded(&got, &oref, Tol::F32);
    s.record(SEC, &format!("{label}: out = resid + moe"), &co, "");
    let delta: Vec<f32> = got[GUARD..GUARD + d].iter().zip(resid).map(|(g, r)| g - r).collect();
    let mref: Vec<f64> = rf.moe.iter().map(|v| f64::from(*v)).collect();
    let cm = check(&delta, &mref, Tol::F32, String::new());
    s.record(SEC, &format!("{label}: moe part (out - resid)"), &cm, "");
}

/// Median seconds per replay of what `enqueue` queues, captured into a CUDA graph whose
/// kernel-to-kernel edges are programmatic when `pdl` (Hopper programmatic dependent launch, as
/// the decode step graph uses it: a kernel starts its prologue while its predecessor finishes).
fn time_graph_pdl(s: &Suite, pdl: bool, reps: usize, enqueue: impl FnOnce()) -> f64 {
    let graph = cuda::graph::StepGraph::capture(s.cx.stream(), pdl, || {
        enqueue();
        Ok(())
    })
    .expect("graph capture");
    graph.launch().expect("graph launch");
    s.median_timed(reps, 1, || graph.launch().unwrap())
}

/// One bit layout: correctness on several inputs (and the tie case), then timing.
fn run_case(s: &mut Suite, name: &str, bits: [u32; 6], seed: u64, ties: bool) {
    let cx = s.cx;
    let d = p::D_MODEL;
    let t0 = std::time::Instant::now();
    let w = HostMoe::random(bits, seed);
    let dm = cx.upload_moe_refs(&w.refs(&w.router)).expect("upload_moe_refs");
    println!(
        "{SEC:<10} {name}: bits {:?} (router, shared gate, gate/up, down, shared gate/up, shared down); host gen + upload {:.1} s",
        dm.bits(),
        t0.elapsed().as_secs_f64()
    );
    let mut scratch = cx.moe_scratch().expect("moe_scratch");
    for i in 0..3u64 {
        let u = input(seed ^ (0x100 + i), 0.0);
        let resid = rand_f32s(d, seed ^ (0x200 + i), 2.0);
        check_step(s, &format!("{name} input {i}"), &w, &w.router, &dm, &mut scratch, &u, &resid, None, MoeFlags::DEFAULT);
    }
    // post_attention_layernorm fused into the router: equal to rms_norm + the step, bit for bit
    for i in 0..2u64 {
        let h = rand_f32s(d, seed ^ (0x400 + i), 30.0);
        let nw = rand_f32s(d, seed ^ (0x500 + i), 0.6);
        fused_norm_step(s, &format!("{name} fused norm, input {i}"), &dm, &mut scratch, &h, &nw);
    }
    // the fused kernel equals the three kernels bit for bit, with and without the fused norm
    // it runs when the router and shared gate share a width and all expert matrices another
    let ready = cx.moe_fused_ready(&dm, &scratch);
    let uniform = bits[0] == bits[1] && bits[2..].iter().all(|b| *b == bits[2]);
    let c = Cmp { rel: 0.0, max_over_rms: 0.0, ok: ready == uniform, msg: format!("fused kernel ready {ready}, widths uniform {uniform}") };
    s.record(SEC, &format!("{name}: fused kernel used iff the widths are uniform"), &c, "");
    for i in 0..if ready { 2u64 } else { 0 } {
        let h = rand_f32s(d, seed ^ (0x600 + i), 30.0);
        let nw = rand_f32s(d, seed ^ (0x700 + i), 0.6);
        let resid = rand_f32s(d, seed ^ (0x800 + i), 2.0);
        for fl in [FUSED, FUSED_AFTER_ROUTER] {
            let v = vname(fl);
            fused_equals_three(s, &format!("{name} [{v}] = three kernels, input {i}"), fl, &dm, &mut scratch, &h, &resid, None);
            fused_equals_three(s, &format!("{name} [{v}] = three kernels, fused norm, input {i}"), fl, &dm, &mut scratch, &h, &h, Some(&nw));
        }
    }
    // the expert-per-cluster kernel equals the three kernels bit for bit; it runs when every
    // expert matrix is 4-bit
    let cl_ready = cx.moe_cluster_ready(&dm, &scratch);
    let all4 = bits[2..].iter().all(|b| *b == 4);
    let c = Cmp { rel: 0.0, max_over_rms: 0.0, ok: cl_ready == all4, msg: format!("cluster kernel ready {cl_ready}, experts all 4-bit {all4}") };
    s.record(SEC, &format!("{name}: cluster kernel used iff every expert matrix is 4-bit"), &c, "");
    for i in 0..if cl_ready { 3u64 } else { 0 } {
        let h = rand_f32s(d, seed ^ (0xA00 + i), 30.0);
        let nw = rand_f32s(d, seed ^ (0xB00 + i), 0.6);
        let resid = rand_f32s(d, seed ^ (0xC00 + i), 2.0);
        let v = vname(CLUSTER);
        fused_equals_three(s, &format!("{name} [{v}] = three kernels, input {i}"), CLUSTER, &dm, &mut scratch, &h, &resid, None);
        fused_equals_three(s, &format!("{name} [{v}] = three kernels, fused norm, input {i}"), CLUSTER, &dm, &mut scratch, &h, &h, Some(&nw));
    }
    // the router folded into the output projection, against the output projection then the
    // three kernels with the fused norm (4-bit output projection; 8-bit in the full run)
    for (i, ob) in [4u32, 8].into_iter().enumerate().take(if s.quick { 1 } else { 2 }) {
        router_fold_equals_three(s, &format!("{name} router fold, {ob}-bit out_proj"), &dm, &mut scratch, ob, seed ^ (0x900 + i as u64));
    }
    // the split output projection (gdn_step_out + moe_split_cluster) against the step, the
    // output projection with the fold and the cluster kernel (4-bit output projection)
    if cx.moe_cluster_ready(&dm, &scratch) {
        split_equals_fold(s, &format!("{name} split output projection"), &w, &dm, &mut scratch, seed ^ 0xD00);
    }
    // every variant on one more input
    for fl in VARIANTS {
        let u = input(seed ^ 0x180, 0.0);
        let resid = rand_f32s(d, seed ^ 0x280, 2.0);
        check_step(s, &format!("{name} input 3 [{}]", vname(fl)), &w, &w.router, &dm, &mut scratch, &u, &resid, None, fl);
    }

    if ties {
        // Router rows all zero except six winners whose logits are c_e * Σu (scale 0, bias
        // c_e): experts 77 and 78 identical, so they tie exactly; the other 250 tie at 0 and
        // the last two places go to the lowest ids, 0 and 1.
        let u = input(seed ^ 0x300, 0.3);
        let sum: f32 = u.iter().sum();
        let mut tr = w.router.clone();
        tr.scales.iter_mut().for_each(|v| *v = bf16::ZERO);
        tr.biases.iter_mut().for_each(|v| *v = bf16::ZERO);
        let gpr = d / cuda::QUANT_GROUP;
        let winners = [(3usize, 0.004f32), (77, 0.006), (78, 0.006), (140, 0.002), (200, 0.005), (255, 0.003)];
        for (e, c) in winners {
            for g in 0..gpr {
                tr.biases[e * gpr + g] = bf16::from_f32(c * sum.signum());
            }
        }
        let dt = cx.upload_moe_refs(&w.refs(&tr)).expect("upload (ties)");
        let resid = rand_f32s(d, seed ^ 0x301, 2.0);
        for fl in [VARIANTS[0], VARIANTS[2], FUSED, FUSED_AFTER_ROUTER, CLUSTER] {
            check_step(
                s,
                &format!("{name} exact router ties [{}]", vname(fl)),
                &w,
                &tr,
                &dt,
                &mut scratch,
                &u,
                &resid,
                Some(&[77, 78, 200, 3, 255, 140, 0, 1]),
                fl,
            );
        }
    }

    // timing: LAYERS distinct copies of the layer (device copies) and inputs
    let layers: Vec<DeviceMoe> = (0..LAYERS).map(|_| dm.clone()).collect();
    let us_host: Vec<Vec<f32>> = (0..LAYERS as u64).map(|l| input(seed ^ (0x400 + l), 0.0)).collect();
    let us: Vec<_> = us_host.iter().map(|u| cx.upload_f32(u).unwrap()).collect();
    let resid_host = rand_f32s(d, seed ^ 0x500, 2.0);
    let resid = cx.upload_f32(&resid_host).unwrap();
    let mut out = cx.stream().alloc_zeros::<f32>(d).unwrap();
    cx.synchronize().unwrap();
    let reps = if s.quick { 5 } else { 20 };
    let step_all = |part: Option<usize>, fl: MoeFlags, scratch: &mut cuda::moe::MoeScratch, out: &mut cuda::cudarc::driver::CudaSlice<f32>| {
        for (l, m) in layers.iter().enumerate() {
            let mut ov = out.slice_mut(..);
            let parts = match part {
                None => 0..3,
                Some(pt) => pt..pt + 1,
            };
            for pt in parts {
                cx.moe_decode_part(m, &us[l].slice(..), &resid.slice(..), scratch, &mut ov, pt, fl, None).expect("moe step");
            }
        }
    };
    let bytes = dm.bytes_per_step();
    let ebytes = dm.expert_bytes_per_step();
    let copy = s.copy_bw;
    let gb = |t: f64| bytes as f64 / t / 1e9;
    println!(
        "{SEC:<10} {name}: weights read {:.2} MB/layer ({:.2} MB experts); us per layer from a graph of {LAYERS} layers, plain / with PDL edges:",
        bytes as f64 / 1e6,
        ebytes as f64 / 1e6
    );
    let mut rows = Vec::new();
    for fl in VARIANTS {
        let t_plain = time_graph_pdl(s, false, reps, || step_all(None, fl, &mut scratch, &mut out)) / LAYERS as f64;
        let t_pdl = time_graph_pdl(s, true, reps, || step_all(None, fl, &mut scratch, &mut out)) / LAYERS as f64;
        // the graph's last layer wrote `out`: check it (PDL graph replays, counter reset)
        let got = cx.download_f32(&out).unwrap();
        let rf = reference(&w, &w.router, &us_host[LAYERS - 1]);
        let oref: Vec<f64> = resid_host.iter().zip(&rf.moe).map(|(a, b)| f64::from(*a + *b)).collect();
        let c = check(&got, &oref, Tol::F32, String::new());
        s.record(SEC, &format!("{name}: out after {reps}+1 PDL graph replays of {LAYERS} layers [{}]", vname(fl)), &c, "");
        // kernels alone (the fused kernel is part 0 only: parts 1 and 2 launch nothing)
        let mut t_part = [0f64; 3];
        let parts = if fl.fused && cx.moe_fused_ready(&dm, &scratch) {
            1 + usize::from(fl.fused_keep_router)
        } else if fl.cluster && !fl.fused && cx.moe_cluster_ready(&dm, &scratch) {
            2
        } else {
            3
        };
        for (pt, t) in t_part.iter_mut().enumerate().take(parts) {
            *t = time_graph_pdl(s, false, reps, || step_all(Some(pt), fl, &mut scratch, &mut out)) / LAYERS as f64;
        }
        println!(
            "{SEC:<10} {name} [{:<22}]{} {:6.2} us ({:4.0} GB/s, {:4.1}%) / PDL {:6.2} us ({:4.0} GB/s, {:4.1}%, experts {:4.0} GB/s); kernels alone: router {:.2}, gate/up {:.2}, down {:.2} us",
            vname(fl),
            if fl == MoeFlags::DEFAULT { "*" } else { " " },
            t_plain * 1e6,
            gb(t_plain),
            gb(t_plain) * 1e9 / copy * 100.0,
            t_pdl * 1e6,
            gb(t_pdl),
            gb(t_pdl) * 1e9 / copy * 100.0,
            ebytes as f64 / t_pdl / 1e9,
            t_part[0] * 1e6,
            t_part[1] * 1e6,
            t_part[2] * 1e6,
        );
        rows.push(format!(
            "{{\"variant\":{:?},\"default\":{},\"us_per_layer\":{:.3},\"us_per_layer_pdl\":{:.3},\"gbps\":{:.1},\"gbps_pdl\":{:.1},\"us_router\":{:.3},\"us_gate_up\":{:.3},\"us_down\":{:.3}}}",
            vname(fl),
            fl == MoeFlags::DEFAULT,
            t_plain * 1e6,
            t_pdl * 1e6,
            gb(t_plain),
            gb(t_pdl),
            t_part[0] * 1e6,
            t_part[1] * 1e6,
            t_part[2] * 1e6
        ));
    }
    s.json.push((
        SEC.into(),
        format!(
            "{{\"case\":{name:?},\"bits\":{:?},\"bytes\":{bytes},\"expert_bytes\":{ebytes},\"timings\":[{}]}}",
            dm.bits(),
            rows.join(",")
        ),
    ));
    if cx.moe_cluster_ready(&dm, &scratch) {
        cluster_phases(s, name, &layers, &us, &resid, &mut scratch, &mut out);
    }
}

/// Where the expert-per-cluster kernel's time goes: the router and the cluster kernel over
/// `layers` (distinct copies, so the last layer's weights come from DRAM), plain launches; the
/// last launch's phase probe (`MoeScratch::cl_probe`), five times. Per phase, over the blocks:
/// median and max of the time since the block's PDL release (clock64 at the SM clock), and the
/// spread of the blocks' releases and starts (%globaltimer).
fn cluster_phases(
    s: &mut Suite,
    name: &str,
    layers: &[DeviceMoe],
    us: &[cuda::cudarc::driver::CudaSlice<f32>],
    resid: &cuda::cudarc::driver::CudaSlice<f32>,
    scratch: &mut cuda::moe::MoeScratch,
    out: &mut cuda::cudarc::driver::CudaSlice<f32>,
) {
    use cuda::moe::{CL_BLOCKS, CL_MARKS};
    let cx = s.cx;
    let mut probe = cx.stream().alloc_zeros::<u64>(CL_BLOCKS * CL_MARKS).unwrap();
    scratch.cl_probe = {
        let (ptr, _g) = cuda::cudarc::driver::DevicePtr::device_ptr(&probe, cx.stream());
        ptr
    };
    // SM clock (kHz) for cycles -> us
    let khz = cx.raw().attribute(cuda::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE).unwrap_or(1_980_000) as f64;
    const PHASES: [&str; 9] = ["copies issued", "gate/up round 0 here", "gate/up round 1 here", "gate/up done", "down tiles here", "acts exchanged", "y written", "counted", "combined (last)"];
    let mut rows: Vec<Vec<(f64, f64)>> = vec![Vec::new(); PHASES.len()];
    let mut landing = Vec::new();
    for _ in 0..5 {
        cx.stream().memset_zeros(&mut probe).unwrap();
        for (l, m) in layers.iter().enumerate() {
            let mut ov = out.slice_mut(..);
            for pt in 0..3 {
                cx.moe_decode_part(m, &us[l].slice(..), &resid.slice(..), scratch, &mut ov, pt, MoeFlags { cluster: true, ..MoeFlags::DEFAULT }, None).expect("moe step");
            }
        }
        let v: Vec<u64> = cx.stream().clone_dtoh(&probe).unwrap();
        let rel_min = (0..CL_BLOCKS).map(|b| v[b * CL_MARKS + 1]).min().unwrap_or(0);
        let start_max = (0..CL_BLOCKS).map(|b| v[b * CL_MARKS]).max().unwrap_or(0);
        let rel_max = (0..CL_BLOCKS).map(|b| v[b * CL_MARKS + 1]).max().unwrap_or(0);
        landing.push(((rel_max - rel_min) as f64 / 1e3, start_max as f64 / 1e3 - rel_min as f64 / 1e3));
        for (i, row) in rows.iter_mut().enumerate() {
            let mut c: Vec<f64> = (0..CL_BLOCKS).map(|b| v[b * CL_MARKS + 2 + i]).filter(|x| *x > 0 && *x < 1 << 40).map(|x| x as f64 / khz * 1e3).collect();
            if c.is_empty() {
                continue;
            }
            c.sort_by(|a, b| a.total_cmp(b));
            row.push((c[c.len() / 2], c[c.len() - 1]));
        }
    }
    scratch.cl_probe = 0;
    println!("{SEC:<10} {name}: cluster kernel phases, us since each block's release (median / max over blocks; 5 runs, cold weights):");
    for (i, row) in rows.iter().enumerate() {
        let f = |v: Vec<f64>| v.iter().map(|x| format!("{x:5.2}")).collect::<Vec<_>>().join(" ");
        println!("{SEC:<10}   {:<22} median {}  max {}", PHASES[i], f(row.iter().map(|r| r.0).collect()), f(row.iter().map(|r| r.1).collect()));
    }
    let f = |v: Vec<f64>| v.iter().map(|x| format!("{x:5.2}")).collect::<Vec<_>>().join(" ");
    println!("{SEC:<10}   releases spread over (us) {}; last block start after the first release (us) {}", f(landing.iter().map(|l| l.0).collect()), f(landing.iter().map(|l| l.1).collect()));
}

/// The variants timed (the default is marked in the output).
const VARIANTS: [MoeFlags; 8] = [
    MoeFlags::DEFAULT,
    MoeFlags { prefetch_down: true, ..MoeFlags::DEFAULT },
    MoeFlags { topk_in_router: false, ..MoeFlags::DEFAULT },
    MoeFlags { topk_in_router: false, prefetch_down: true, ..MoeFlags::DEFAULT },
    MoeFlags { down_reg_cap: true, ..MoeFlags::DEFAULT },
    FUSED,
    FUSED_AFTER_ROUTER,
    CLUSTER,
];

/// The fused kernel (one launch, grid barriers).
const FUSED: MoeFlags = MoeFlags { fused: true, ..MoeFlags::DEFAULT };
/// The router kernel, then the fused kernel for gate/up and down (one barrier).
const FUSED_AFTER_ROUTER: MoeFlags = MoeFlags { fused: true, fused_keep_router: true, ..MoeFlags::DEFAULT };
/// The router kernel, then one thread-block cluster per expert for gate/up, down and combine.
const CLUSTER: MoeFlags = MoeFlags { cluster: true, ..MoeFlags::DEFAULT };

fn vname(f: MoeFlags) -> String {
    if f.fused {
        return if f.fused_keep_router { "router, then fused gate/up + down".into() } else { "fused, grid barriers".into() };
    }
    if f.cluster {
        return "router, then a cluster per expert".into();
    }
    format!(
        "top-k {}, {}{}",
        if f.topk_in_router { "in router" } else { "in gate/up" },
        if f.prefetch_down { "L2 prefetch" } else { "no prefetch" },
        if f.down_reg_cap { ", down at 48 registers" } else { "" }
    )
}

/// The synchronisation probes alone (section `sync`): a grid barrier with an arrival counter,
/// one without atomics, and the kernel boundary they would replace.
pub fn run_sync(s: &mut Suite) {
    barrier_probe(s);
}

/// Runs the MoE checks and timings.
pub fn run(s: &mut Suite) {
    barrier_probe(s);
    // mlx-community 4-bit: experts 4-bit, router and shared-expert gate 8-bit
    run_case(s, "q4 experts", [8, 8, 4, 4, 4, 4], 0x40E_0001, true);
    // 8-bit everywhere
    run_case(s, "q8 all", [8, 8, 8, 8, 8, 8], 0x40E_0002, false);
    // mixed widths: 4-bit router, 8-bit down and shared expert
    if !s.quick {
        run_case(s, "mixed", [4, 8, 4, 8, 8, 8], 0x40E_0003, true);
        // 4-bit router and shared gate: the fused kernel's other router width
        run_case(s, "q4 all", [4, 4, 4, 4, 4, 4], 0x40E_0004, false);
    }
}

/// `moe_decode_step_norm(h, w)` against `rms_norm(h, w)` then `moe_decode_step(u, h)`: the same
/// chosen experts and routing weights and the same output, bit for bit; guard words intact.
/// A fused variant (the fused kernel, or the cluster kernel) against [`MoeFlags::DEFAULT`] on the
/// same input (`norm`: u = rms_norm(u, norm)): output (with guards), chosen ids and routing
/// weights equal bit for bit. Fails when the variant's kernel does not run for this layer (the
/// check would compare the default with itself).
#[allow(clippy::too_many_arguments)]
fn fused_equals_three(
    s: &mut Suite,
    label: &str,
    fused: MoeFlags,
    dm: &DeviceMoe,
    scratch: &mut cuda::moe::MoeScratch,
    u: &[f32],
    resid: &[f32],
    norm: Option<&[f32]>,
) {
    let cx = s.cx;
    let d = p::D_MODEL;
    let ud = cx.upload_f32(u).unwrap();
    let rd = cx.upload_f32(resid).unwrap();
    let wd = norm.map(|w| cx.upload_f32(w).unwrap());
    let run = |fl: MoeFlags, scratch: &mut cuda::moe::MoeScratch| {
        let mut o = guarded(cx, d);
        {
            let mut ov = o.slice_mut(GUARD..GUARD + d);
            let nv = wd.as_ref().map(|w| w.slice(..));
            for part in 0..3 {
                cx.moe_decode_part(dm, &ud.slice(..), &rd.slice(..), scratch, &mut ov, part, fl, nv.as_ref()).expect("moe part");
            }
        }
        let ids: Vec<i32> = cx.stream().clone_dtoh(&scratch.sel_ids).unwrap();
        (cx.download_f32(&o).unwrap(), ids, cx.download_f32(&scratch.sel_w).unwrap())
    };
    let (a, ids_a, w_a) = run(MoeFlags::DEFAULT, scratch);
    let (b, ids_b, w_b) = run(fused, scratch);
    let reference: Vec<f64> = a[GUARD..GUARD + d].iter().map(|v| f64::from(*v)).collect();
    let mut c = check_guarded(&b, &reference, Tol::F32);
    let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    let runs = if fused.fused { cx.moe_fused_ready(dm, scratch) } else { fused.cluster && cx.moe_cluster_ready(dm, scratch) };
    if !runs {
        c.ok = false;
        c.msg.push_str("the variant's kernel does not run for this layer; ");
    }
    if differ > 0 || ids_a != ids_b || w_a.iter().zip(&w_b).any(|(x, y)| x.to_bits() != y.to_bits()) {
        c.ok = false;
        c.msg.push_str(&format!("{differ} words differ; ids {ids_b:?} vs {ids_a:?}; "));
    }
    s.record(SEC, label, &c, "");
}

/// The decode step's MoE with the router folded into the output projection
/// (`gemv_residual_router`, `moe_fold_gate_up`, `moe_fold_down`) against the output projection
/// (`gemv_residual`) followed by `moe_decode_step_norm` on the same random inputs (h of RMS ~2
/// with outlier channels, so the norm matters): the residual stream h equal bit for bit, the
/// same chosen experts, routing weights and output within `Tol::F32` (the fold's logits are the
/// router's up to f32 rounding); the accumulator set the down launch zeroes is zero afterwards,
/// and a second run on another set equal to the first bit for bit (no state left behind, no
/// order dependence).
fn router_fold_equals_three(s: &mut Suite, label: &str, dm: &DeviceMoe, scratch: &mut cuda::moe::MoeScratch, out_bits: u32, seed: u64) {
    let cx = s.cx;
    let d = p::D_MODEL;
    let k = p::N_V_HEADS * p::D_V;
    let wo = rand_qmat(d, k, out_bits, seed, 0.02);
    let wod = cx.upload_qmat(wo.as_ref()).expect("upload out_proj");
    let x = rand_f32s(k, seed ^ 0x11, 1.0);
    let resid: Vec<f32> = rand_f32s(d, seed ^ 0x22, 2.0).iter().enumerate().map(|(i, v)| if i % 97 == 0 { v * 20.0 } else { *v }).collect();
    let nw = rand_f32s(d, seed ^ 0x33, 0.6);
    let (xd, rd, wd) = (cx.upload_f32(&x).unwrap(), cx.upload_f32(&resid).unwrap(), cx.upload_f32(&nw).unwrap());
    // three kernels after the plain output projection
    let mut h3 = cx.upload_f32(&vec![0f32; d]).unwrap();
    cx.gemv_residual(&mut h3.slice_mut(..), &wod, &xd.slice(..), &rd.slice(..)).expect("gemv_residual");
    let mut o3 = guarded(cx, d);
    cx.moe_decode_step_norm(dm, &h3.slice(..), &wd.slice(..), scratch, &mut o3.slice_mut(GUARD..GUARD + d)).expect("moe");
    let ids3: Vec<i32> = cx.stream().clone_dtoh(&scratch.sel_ids).unwrap();
    let w3 = cx.download_f32(&scratch.sel_w).unwrap();
    // accumulator set `set`, zeroing `zero` (as the decode step does for the next layer)
    // the 4-bit output projection also as its staged twin (bulk copies): the same bits
    let staged = (out_bits == 4).then(|| {
        let mut m = cx.upload_qmat(wo.as_ref()).expect("upload out_proj");
        cx.stage_qmat(&mut m, &[wo.as_ref()]).expect("stage_qmat");
        m
    });
    let run_fold_with = |wod: &cuda::DeviceQMat, scratch: &mut cuda::moe::MoeScratch, set: usize, zero: usize| {
        let mut hf = cx.upload_f32(&vec![0f32; d]).unwrap();
        let mut of = guarded(cx, d);
        cx.gemv_residual_router(&mut hf.slice_mut(..), wod, &xd.slice(..), &rd.slice(..), dm, &wd.slice(..), scratch, set).expect("gemv_residual_router");
        cx.moe_fold_gate_up(dm, &hf.slice(..), &wd.slice(..), scratch, set).expect("moe_fold_gate_up");
        cx.moe_fold_down(dm, &hf.slice(..), scratch, &mut of.slice_mut(GUARD..GUARD + d), set, zero).expect("moe_fold_down");
        let ids: Vec<i32> = cx.stream().clone_dtoh(&scratch.sel_ids).unwrap();
        let racc: Vec<f64> = cx.stream().clone_dtoh(&scratch.fold_accumulators()).unwrap();
        (cx.download_f32(&hf).unwrap(), cx.download_f32(&of).unwrap(), ids, cx.download_f32(&scratch.sel_w).unwrap(), racc)
    };
    let run_fold = |scratch: &mut cuda::moe::MoeScratch, set: usize, zero: usize| run_fold_with(&wod, scratch, set, zero);
    // set 0 (zeroing set 1), then set 1 zeroing set 0, which the first run left full
    let (hf, of, idsf, wf, _) = run_fold(scratch, 0, 1);
    // (it leaves set 0 full and set 1 zero, as the first run did)
    let staged_run = staged.as_ref().map(|m| {
        cx.moe_fold_reset(scratch).expect("moe_fold_reset"); // set 0 from zero again
        run_fold_with(m, scratch, 0, 1)
    });
    // the other 4-bit output projections (cuda::OutProjVariant) than the default: the same bits
    let slim_runs: Vec<_> = if out_bits == 4 {
        let default = cx.out_proj_variant();
        [cuda::OutProjVariant::Wide, cuda::OutProjVariant::Cap88, cuda::OutProjVariant::Cap88Stages3]
            .into_iter()
            .filter(|v| *v != default)
            .map(|v| {
                cx.set_out_proj_variant(v);
                cx.moe_fold_reset(scratch).expect("moe_fold_reset");
                let r = run_fold(scratch, 0, 1);
                cx.set_out_proj_variant(default);
                (v, r)
            })
            .collect()
    } else {
        Vec::new()
    };
    // the expert-per-cluster kernel on the same sums (set 0 again, refilled by the output
    // projection; zeroing set 1): equal to the gate/up + down pair bit for bit
    let cluster = cx.moe_cluster_ready(dm, scratch).then(|| {
        let mut hf = cx.upload_f32(&vec![0f32; d]).unwrap();
        let mut of = guarded(cx, d);
        // both sets filled (set 1 only to see it zeroed), set 0 from zero
        cx.moe_fold_reset(scratch).expect("moe_fold_reset");
        for set in [1, 0] {
            cx.gemv_residual_router(&mut hf.slice_mut(..), &wod, &xd.slice(..), &rd.slice(..), dm, &wd.slice(..), scratch, set).expect("gemv_residual_router");
        }
        cx.moe_fold_cluster(dm, &hf.slice(..), &wd.slice(..), scratch, &mut of.slice_mut(GUARD..GUARD + d), 0, 1).expect("moe_fold_cluster");
        let ids: Vec<i32> = cx.stream().clone_dtoh(&scratch.sel_ids).unwrap();
        let racc: Vec<f64> = cx.stream().clone_dtoh(&scratch.fold_accumulators()).unwrap();
        let parts = cx.stream().clone_dtoh(&scratch.cluster_parts()).unwrap();
        (cx.download_f32(&of).unwrap(), ids, cx.download_f32(&scratch.sel_w).unwrap(), racc, parts, cx.download_f32(&hf).unwrap())
    });
    // the same with the combine by f64 atomics (MoeScratch::hsum_combine): set 1 first (its h sums into
    // set 0's), then set 0 (into set 1's, zeroing set 0's): out untouched, the sums those of
    // the counted run's expert outputs, twice the same
    let hsum = cluster.is_some().then(|| {
        let mut hf = cx.upload_f32(&vec![0f32; d]).unwrap();
        let mut of = guarded(cx, d);
        let before = cx.download_f32(&of).unwrap();
        cx.moe_fold_reset(scratch).expect("moe_fold_reset");
        scratch.hsum_combine = true;
        let mut sums = Vec::new();
        for (set, zero) in [(1, 0), (0, 1)] {
            cx.gemv_residual_router(&mut hf.slice_mut(..), &wod, &xd.slice(..), &rd.slice(..), dm, &wd.slice(..), scratch, set).expect("gemv_residual_router");
            cx.moe_fold_cluster(dm, &hf.slice(..), &wd.slice(..), scratch, &mut of.slice_mut(GUARD..GUARD + d), set, zero).expect("moe_fold_cluster (hsum)");
            sums.push(cx.stream().clone_dtoh(&scratch.hsum(zero).unwrap()).unwrap());
        }
        scratch.hsum_combine = false;
        let left = cx.stream().clone_dtoh(&scratch.hsum(0).unwrap()).unwrap();
        let untouched = cx.download_f32(&of).unwrap().iter().zip(&before).all(|(a, b)| a.to_bits() == b.to_bits());
        (sums, left, untouched)
    });
    let (hf2, of2, idsf2, wf2, racc) = run_fold(scratch, 1, 0);
    cx.moe_fold_reset(scratch).expect("moe_fold_reset");
    let set_len = racc.len() / cuda::moe::FOLD_SETS;
    let h3h = cx.download_f32(&h3).unwrap();
    let o3h = cx.download_f32(&o3).unwrap();
    let reference: Vec<f64> = o3h[GUARD..GUARD + d].iter().map(|v| f64::from(*v)).collect();
    let mut c = check_guarded(&of, &reference, Tol::F32);
    let fail = |c: &mut Cmp, m: String| {
        c.ok = false;
        c.msg.push_str(&m);
    };
    let hdiff = hf.iter().zip(&h3h).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    if hdiff > 0 {
        fail(&mut c, format!("{hdiff} words of h differ from gemv_residual's; "));
    }
    if idsf != ids3 {
        fail(&mut c, format!("ids {idsf:?} vs {ids3:?}; "));
    }
    let wref: Vec<f64> = w3.iter().map(|v| f64::from(*v)).collect();
    let cw = check(&wf, &wref, Tol::F32, String::new());
    if !cw.ok {
        fail(&mut c, format!("routing weights {wf:?} vs {w3:?} (rel {:.2e}); ", cw.rel));
    }
    let nz = racc[..set_len].iter().filter(|v| **v != 0.0).count();
    if nz > 0 {
        fail(&mut c, format!("{nz} accumulators of set 0 not zero after moe_fold_down zeroed it; "));
    }
    if racc[set_len..2 * set_len].iter().all(|v| *v == 0.0) {
        fail(&mut c, "set 1 holds no sums after its run; ".into());
    }
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    if !(same(&hf, &hf2) && same(&of, &of2) && same(&wf, &wf2) && idsf == idsf2) {
        fail(&mut c, "a second run differs from the first; ".into());
    }
    if let Some((hs, os, idss, ws, _)) = &staged_run {
        if !(same(hs, &hf) && same(os, &of) && same(ws, &wf) && *idss == idsf) {
            fail(&mut c, "the staged output projection (bulk copies) differs from the MLX-layout one; ".into());
        } else {
            c.msg.push_str("staged output projection equal bit for bit; ");
        }
    }
    for (v, (hs, os, idss, ws, _)) in &slim_runs {
        if !(same(hs, &hf) && same(os, &of) && same(ws, &wf) && *idss == idsf) {
            fail(&mut c, format!("the output projection's {v:?} entry point differs from the default's; "));
        } else {
            c.msg.push_str(&format!("{v:?} equal bit for bit; "));
        }
    }
    if let (Some((oc, _, wc, _, parts, hc)), Some((sums, left, untouched))) = (&cluster, &hsum) {
        // the exact sum of the same f32 terms (h, then f32(w_k · y_k)), rounded once
        let k = p::TOP_K + 1;
        let exact: Vec<f32> = (0..d)
            .map(|r| {
                let mut acc = f64::from(hc[r]);
                for slot in 0..k {
                    acc += f64::from(wc[slot] * parts[slot * d + r]);
                }
                acc as f32
            })
            .collect();
        let got: Vec<f32> = sums[1].iter().map(|v| *v as f32).collect();
        let wrong = got.iter().zip(&exact).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let ulps = got.iter().zip(&oc[GUARD..GUARD + d]).map(|(a, b)| (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs()).max().unwrap_or(0);
        let again = sums[0].iter().zip(&sums[1]).all(|(a, b)| a.to_bits() == b.to_bits());
        let nz = left.iter().filter(|v| **v != 0.0).count();
        if wrong > 0 || !again || nz > 0 || !untouched {
            fail(&mut c, format!("combine by atomics: {wrong} of {d} sums differ from the exact sum of the terms, second run equal {again}, {nz} of set 0's sums not zeroed, out untouched {untouched}; "));
        } else {
            c.msg.push_str(&format!("combine by atomics exact, ≤ {ulps} ulp from the counted combine; "));
        }
    }
    if let Some((oc, idsc, wc, raccc, _, _)) = cluster {
        let differ = oc.iter().zip(&of).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        if differ > 0 || idsc != idsf || !same(&wc, &wf) {
            fail(&mut c, format!("cluster kernel: {differ} words of out differ from gate/up + down's; ids {idsc:?} vs {idsf:?}; "));
        }
        let nz = raccc[set_len..2 * set_len].iter().filter(|v| **v != 0.0).count();
        if nz > 0 {
            fail(&mut c, format!("cluster kernel: {nz} accumulators of set 1 not zero after it zeroed them; "));
        }
        c.msg.push_str("cluster kernel equal bit for bit; ");
    }
    s.record(SEC, label, &c, "");
}

fn fused_norm_step(s: &mut Suite, label: &str, dm: &DeviceMoe, scratch: &mut cuda::moe::MoeScratch, h: &[f32], nw: &[f32]) {
    let cx = s.cx;
    let d = p::D_MODEL;
    let hd = cx.upload_f32(h).unwrap();
    let wd = cx.upload_f32(nw).unwrap();
    let mut ud = cx.upload_f32(&vec![0f32; d]).unwrap();
    let mut pair = guarded(cx, d);
    cx.rms_norm(&mut ud.slice_mut(..), &hd.slice(..), &wd.slice(..)).expect("rms_norm");
    cx.moe_decode_step(dm, &ud.slice(..), &hd.slice(..), scratch, &mut pair.slice_mut(GUARD..GUARD + d)).expect("moe");
    let ids_pair: Vec<i32> = cx.stream().clone_dtoh(&scratch.sel_ids).unwrap();
    let w_pair = cx.download_f32(&scratch.sel_w).unwrap();
    let mut fused = guarded(cx, d);
    cx.moe_decode_step_norm(dm, &hd.slice(..), &wd.slice(..), scratch, &mut fused.slice_mut(GUARD..GUARD + d)).expect("moe fused");
    let ids_fused: Vec<i32> = cx.stream().clone_dtoh(&scratch.sel_ids).unwrap();
    let w_fused = cx.download_f32(&scratch.sel_w).unwrap();
    let (a, b) = (cx.download_f32(&pair).unwrap(), cx.download_f32(&fused).unwrap());
    let reference: Vec<f64> = a[GUARD..GUARD + d].iter().map(|v| f64::from(*v)).collect();
    let mut c = check_guarded(&b, &reference, Tol::F32);
    let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    if differ > 0 || ids_pair != ids_fused || w_pair.iter().zip(&w_fused).any(|(x, y)| x.to_bits() != y.to_bits()) {
        c.ok = false;
        c.msg.push_str(&format!("{differ} words differ; ids {ids_fused:?} vs {ids_pair:?}; "));
    }
    s.record(SEC, label, &c, "");
}

/// The cost of one grid-wide barrier of the fused kernel (its grid and block shape): one launch
/// of 64 barriers against one of none, median of 20.
fn barrier_probe(s: &mut Suite) {
    let cx = s.cx;
    let mut scratch = cx.moe_scratch().expect("moe_scratch");
    let n = 64;
    let mut t = [0f64; 2];
    for (i, k) in [0, n].into_iter().enumerate() {
        cx.moe_grid_barrier_probe(&mut scratch, k).expect("barrier probe");
        t[i] = s.median_timed(20, 1, || cx.moe_grid_barrier_probe(&mut scratch, k).unwrap());
    }
    let per = (t[1] - t[0]) / f64::from(n);
    // the probe returns at all: every barrier released every block (the counter is back to 0)
    let bar: Vec<u32> = cx.stream().clone_dtoh(&scratch.bar_state()).unwrap();
    let ok = bar[0] == 0;
    let c = Cmp { rel: 0.0, max_over_rms: 0.0, ok, msg: format!("arrivals left {}", bar[0]) };
    s.record(SEC, "grid barrier probe: every block released, counter back to 0", &c, "");
    println!("{SEC:<10} grid barrier: {:.2} us each ({n} in one launch {:.2} us, empty launch {:.2} us)", per * 1e6, t[1] * 1e6, t[0] * 1e6);
    // the barrier without atomics: a word per block, every block polls them all
    let mut flags_d = cx.stream().alloc_zeros::<u32>(cx.sm_count() as usize).unwrap();
    let mut base = 0u32;
    let mut tf = [0f64; 2];
    for (i, k) in [0, n].into_iter().enumerate() {
        cx.moe_flag_barrier_probe(&scratch, &mut flags_d, k, base).expect("flag barrier probe");
        base += k as u32;
        tf[i] = s.median_timed(20, 1, || {
            cx.moe_flag_barrier_probe(&scratch, &mut flags_d, k, base).unwrap();
            base += k as u32;
        });
    }
    let per_flag = (tf[1] - tf[0]) / f64::from(n);
    // every block of the last launch reached its last epoch (the words after the grid stay 0)
    let flags: Vec<u32> = cx.stream().clone_dtoh(&flags_d).unwrap();
    let reached = flags.iter().filter(|&&f| f == base).count();
    let c = Cmp { rel: 0.0, max_over_rms: 0.0, ok: reached > 0 && flags.iter().all(|&f| f == base || f == 0), msg: format!("{reached} blocks at epoch {base}, words {flags:?}") };
    s.record(SEC, "flag barrier probe: every block reached the last epoch", &c, "");
    println!("{SEC:<10} flag barrier: {:.2} us each ({n} in one launch {:.2} us)", per_flag * 1e6, tf[1] * 1e6);
    // what a barrier would replace: the boundary between two dependent kernels of the same grid,
    // from a graph of 64 empty launches, with plain and with programmatic (PDL) edges
    let mut edge = [0f64; 2];
    for (i, pdl) in [false, true].into_iter().enumerate() {
        edge[i] = time_graph_pdl(s, pdl, 20, || {
            for _ in 0..n {
                cx.moe_grid_barrier_probe(&mut scratch, 0).expect("empty probe");
            }
        }) / f64::from(n);
    }
    println!("{SEC:<10} kernel boundary on the same grid: {:.2} us per launch in a graph ({:.2} us with PDL edges)", edge[0] * 1e6, edge[1] * 1e6);
    s.json.push((
        SEC.into(),
        format!(
            "{{\"grid_barrier_us\":{:.3},\"flag_barrier_us\":{:.3},\"launch_us\":{:.3},\"graph_kernel_us\":{:.3},\"graph_kernel_pdl_us\":{:.3}}}",
            per * 1e6,
            per_flag * 1e6,
            t[0] * 1e6,
            edge[0] * 1e6,
            edge[1] * 1e6
        ),
    ));
}

/// The GDN layer's step, output projection and router sums as one launch
/// (`gdn_step_out`) and its experts after it (`moe_split_cluster`), against `gdn_decode_step`,
/// `gemv_residual_router` and `moe_fold_cluster` on the same random inputs (a random GDN state
/// and `proj`, h of RMS ~2 with outlier channels, 4-bit `out_proj`): the step's output, `S` and
/// the conv state equal bit for bit; `x + (h − x)` against the output projection's h, the
/// router sums against the fold's (within `Tol::F32`: other order and `B = W_r·W_o` from the
/// host); the same experts, routing weights and output within `Tol::F32`; the next layer's set
/// (filled by an earlier split run) zero afterwards, `h − x` included.
fn split_equals_fold(s: &mut Suite, label: &str, w: &HostMoe, dm: &DeviceMoe, scratch: &mut cuda::moe::MoeScratch, seed: u64) {
    use cuda::gdn::{GDN_CONV_STATE_LEN, GDN_OUT, GDN_PROJ, GDN_STATE_LEN};
    let cx = s.cx;
    let d = p::D_MODEL;
    let t0 = std::time::Instant::now();
    let wo = rand_qmat(d, GDN_OUT, 4, seed, 0.02);
    let wod = cx.upload_qmat(wo.as_ref()).expect("upload out_proj");
    let nw = rand_f32s(d, seed ^ 0x33, 0.6);
    let b = cuda::gdn::router_out_product(w.router.as_ref(), w.shared_gate.as_ref(), &nw, wo.as_ref()).expect("router_out_product");
    let split = cx.upload_gdn_out_split(wo.as_ref(), &b).expect("upload_gdn_out_split");
    let host_s = t0.elapsed().as_secs_f64();
    let gw = crate::gdn::weights(seed ^ 0x44);
    let proj = rand_f32s(GDN_PROJ, seed ^ 0x55, 3f32.sqrt());
    let conv0 = rand_f32s(GDN_CONV_STATE_LEN, seed ^ 0x66, 3f32.sqrt());
    let s0 = rand_f32s(GDN_STATE_LEN, seed ^ 0x77, 0.5);
    let x: Vec<f32> = rand_f32s(d, seed ^ 0x22, 2.0).iter().enumerate().map(|(i, v)| if i % 97 == 0 { v * 20.0 } else { *v }).collect();
    let up = |v: &[f32]| cx.upload_f32(v).unwrap();
    let (projd, convw, ane, dtb, gnorm, nwd) = (up(&proj), up(&gw.conv_w), up(&gw.a_neg_exp), up(&gw.dt_bias), up(&gw.norm_w), up(&nw));
    let mut gscratch = cx.gdn_scratch().expect("gdn_scratch");
    let set_len = scratch.fold_accumulators().len() / cuda::moe::FOLD_SETS;
    let acc_h0 = (p::N_EXPERTS + 2) * 16;
    // the step's output, S, conv state, racc (all sets), out, ids, weights of one path
    type Run = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f64>, Vec<f32>, Vec<i32>, Vec<f32>);
    let run = |split_path: bool, scratch: &mut cuda::moe::MoeScratch, gscratch: &mut cuda::gdn::GdnScratch| -> (Run, Vec<f64>) {
        let (mut conv, mut st, mut mix, mut xd) = (up(&conv0), up(&s0), up(&vec![0f32; GDN_OUT]), up(&x));
        cx.moe_fold_reset(scratch).expect("moe_fold_reset");
        let racc_mid;
        if split_path {
            // fill set 1 first (another state copy), so that the MoE launch's zeroing shows
            let (mut c1, mut s1, mut m1) = (up(&conv0), up(&s0), up(&vec![0f32; GDN_OUT]));
            cx.gdn_step_out(&split, dm, &nwd.slice(..), &xd.slice(..), &projd.slice(..), &convw.slice(..), &ane.slice(..), &dtb.slice(..), &gnorm.slice(..), &mut c1.slice_mut(..), &mut s1.slice_mut(..), scratch, 1, &mut m1.slice_mut(..)).expect("gdn_step_out");
            cx.gdn_step_out(&split, dm, &nwd.slice(..), &xd.slice(..), &projd.slice(..), &convw.slice(..), &ane.slice(..), &dtb.slice(..), &gnorm.slice(..), &mut conv.slice_mut(..), &mut st.slice_mut(..), scratch, 0, &mut mix.slice_mut(..)).expect("gdn_step_out");
            racc_mid = cx.stream().clone_dtoh(&scratch.fold_accumulators()).unwrap();
            cx.moe_split_cluster(dm, &nwd.slice(..), scratch, &mut xd.slice_mut(..), 0, 1).expect("moe_split_cluster");
        } else {
            cx.gdn_decode_step(&projd.slice(..), &convw.slice(..), &ane.slice(..), &dtb.slice(..), &gnorm.slice(..), &mut conv.slice_mut(..), &mut st.slice_mut(..), gscratch, &mut mix.slice_mut(..)).expect("gdn_decode_step");
            let mut h = up(&vec![0f32; d]);
            cx.gemv_residual_router(&mut h.slice_mut(..), &wod, &mix.slice(..), &xd.slice(..), dm, &nwd.slice(..), scratch, 0).expect("gemv_residual_router");
            racc_mid = cx.stream().clone_dtoh(&scratch.fold_accumulators()).unwrap();
            // h itself where the split path keeps h − x, for the comparison (h against x + (h − x))
            let hh = cx.download_f32(&h).unwrap();
            let mut out = up(&vec![0f32; d]);
            cx.moe_fold_cluster(dm, &h.slice(..), &nwd.slice(..), scratch, &mut out.slice_mut(..), 0, 1).expect("moe_fold_cluster");
            xd = out;
            let mut racc_h = racc_mid.clone();
            for (i, v) in hh.iter().enumerate() {
                racc_h[acc_h0 + i] = f64::from(*v);
            }
            let ids: Vec<i32> = cx.stream().clone_dtoh(&scratch.sel_ids).unwrap();
            let after = cx.stream().clone_dtoh(&scratch.fold_accumulators()).unwrap();
            return ((cx.download_f32(&mix).unwrap(), cx.download_f32(&st).unwrap(), cx.download_f32(&conv).unwrap(), racc_h, cx.download_f32(&xd).unwrap(), ids, cx.download_f32(&scratch.sel_w).unwrap()), after);
        }
        let ids: Vec<i32> = cx.stream().clone_dtoh(&scratch.sel_ids).unwrap();
        let after = cx.stream().clone_dtoh(&scratch.fold_accumulators()).unwrap();
        ((cx.download_f32(&mix).unwrap(), cx.download_f32(&st).unwrap(), cx.download_f32(&conv).unwrap(), racc_mid, cx.download_f32(&xd).unwrap(), ids, cx.download_f32(&scratch.sel_w).unwrap()), after)
    };
    let ((mix_a, s_a, conv_a, racc_a, out_a, ids_a, w_a), _) = run(false, scratch, &mut gscratch);
    let ((mix_b, s_b, conv_b, racc_b, out_b, ids_b, w_b), after_b) = run(true, scratch, &mut gscratch);
    let ((_, _, _, _, out_b2, ids_b2, w_b2), _) = run(true, scratch, &mut gscratch);
    cx.moe_fold_reset(scratch).expect("moe_fold_reset");
    let f64s = |v: &[f32]| v.iter().map(|x| f64::from(*x)).collect::<Vec<f64>>();
    // the residual stream after the output projection: fold h against x + (h − x)
    let h_a: Vec<f64> = (0..d).map(|i| racc_a[acc_h0 + i]).collect();
    let h_b: Vec<f32> = (0..d).map(|i| x[i] + racc_b[acc_h0 + i] as f32).collect();
    let mut c = check(&h_b, &h_a, Tol::F32, String::new());
    let fail = |c: &mut Cmp, m: String| {
        c.ok = false;
        c.msg.push_str(&m);
    };
    let same = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    if !(same(&mix_a, &mix_b) && same(&s_a, &s_b) && same(&conv_a, &conv_b)) {
        fail(&mut c, "the step's output or state differs from gdn_decode_step's; ".into());
    }
    // the router sums (N_EXPERTS logits and the shared gate's), 16 f64 apart
    let sums = |r: &[f64]| (0..=p::N_EXPERTS).map(|e| r[e * 16]).collect::<Vec<f64>>();
    let (sa, sb) = (sums(&racc_a), sums(&racc_b));
    let sb32: Vec<f32> = sb.iter().map(|v| *v as f32).collect();
    let cs = check(&sb32, &sa, Tol::F32, String::new());
    if !cs.ok {
        fail(&mut c, format!("router sums rel {:.2e} max/rms {:.2e}; ", cs.rel, cs.max_over_rms));
    }
    let co = check(&out_b, &f64s(&out_a), Tol::F32, String::new());
    if !co.ok || ids_a != ids_b {
        fail(&mut c, format!("out rel {:.2e}; ids {ids_b:?} vs {ids_a:?}; ", co.rel));
    }
    let cw = check(&w_b, &f64s(&w_a), Tol::F32, String::new());
    if !cw.ok {
        fail(&mut c, format!("routing weights {w_b:?} vs {w_a:?}; "));
    }
    let nz = after_b[set_len..2 * set_len].iter().filter(|v| **v != 0.0).count();
    if nz > 0 {
        fail(&mut c, format!("{nz} accumulators of set 1 not zero after moe_split_cluster zeroed it; "));
    }
    if !(same(&out_b, &out_b2) && ids_b == ids_b2 && same(&w_b, &w_b2)) {
        fail(&mut c, "a second split run differs from the first; ".into());
    }
    c.msg.push_str(&format!("router sums rel {:.2e}; out rel {:.2e}; B on the host {host_s:.1} s; ", cs.rel, co.rel));
    s.record(SEC, label, &c, "");
}
