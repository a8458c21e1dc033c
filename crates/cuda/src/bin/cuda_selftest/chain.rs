//! The persistent GEMV chain (`CudaContext::gemv_chain_probe`, `gemv_chain_q4` in
//! `kernels/gemv.cu`) against the same GEMVs launched one by one.
//!
//! Random 4-bit `W_a` `[N_Q_HEADS·HEAD_DIM, D_MODEL]` and `W_b` `[D_MODEL, N_Q_HEADS·HEAD_DIM]`
//! (the output projection's shapes, 4.7 MB each), enough distinct matrices of each to defeat
//! the 60 MB L2 (distinct, so that a wrong per-copy offset changes the bits), and a chain
//! `xa = W_a·xb`, `xb = W_b·xa`, ... of `LAYERS` GEMVs:
//! * as one persistent launch, GEMVs separated by split flag barriers (the next GEMV's weights
//!   requested before the barrier; and, to see what that buys, after it);
//! * as `LAYERS` kernels in a graph with programmatic dependent launch, as the decode step runs.
//!
//! Both must end with the same bits in `xb` (the same arithmetic in the same order); then the
//! time per GEMV of each. This prices the persistent decode kernel of docs/CUDA.md: a phase
//! boundary as a flag barrier with the weights already requested, instead of a launch.

use cuda::graph::StepGraph;
use quant::{QMatRef, QuantSpec};
use spec::production as p;

use crate::common::{check_bits, rand_f32s, rand_u32s, Cmp, Suite};

const SEC: &str = "chain";
/// GEMVs per chain (even: one W_a and one W_b each round).
const LAYERS: usize = 80;

/// Random 4-bit `[rows, cols]` codes with small zero-mean scales and biases: no common offset
/// in the weights (a rank-one part that would grow the activations by orders of magnitude per
/// GEMV pair), so the values stay finite over the chain (simulated in f64 over 80 GEMVs: rms
/// between 0.5 and 5e4). A non-finite input would make every later output NaN.
fn host_matrix(rows: usize, cols: usize, seed: u64) -> (Vec<u32>, Vec<half::bf16>, Vec<half::bf16>) {
    let spec = QuantSpec::new(4, cuda::QUANT_GROUP).unwrap();
    let packed = rand_u32s(rows * spec.words_per_row(cols), seed);
    let groups = rows * spec.groups_per_row(cols);
    let scales = rand_f32s(groups, seed ^ 0x5C, 0.0036).into_iter().map(half::bf16::from_f32).collect();
    let biases = rand_f32s(groups, seed ^ 0xB1, 0.009).into_iter().map(half::bf16::from_f32).collect();
    (packed, scales, biases)
}

/// Runs the chain check and timing.
pub fn run(s: &mut Suite) {
    let cx = s.cx;
    let (d, e) = (p::D_MODEL, p::N_Q_HEADS * p::HEAD_DIM);
    let spec = QuantSpec::new(4, cuda::QUANT_GROUP).unwrap();
    let bytes = spec.stored_bytes(e, d);
    let copies = (256usize << 20).div_ceil(bytes).min(LAYERS / 2);
    let host_a: Vec<_> = (0..copies as u64).map(|c| host_matrix(e, d, 0xC4A1 ^ (c << 20))).collect();
    let host_b: Vec<_> = (0..copies as u64).map(|c| host_matrix(d, e, 0xC4A2 ^ (c << 20))).collect();
    let refs_a: Vec<QMatRef<'_>> = host_a.iter().map(|(p, s, b)| QMatRef::new(e, d, spec, p, s, b).unwrap()).collect();
    let refs_b: Vec<QMatRef<'_>> = host_b.iter().map(|(p, s, b)| QMatRef::new(d, e, spec, p, s, b).unwrap()).collect();
    let single_a: Vec<_> = refs_a.iter().map(|m| cx.upload_qmat(*m).expect("upload W_a")).collect();
    let single_b: Vec<_> = refs_b.iter().map(|m| cx.upload_qmat(*m).expect("upload W_b")).collect();
    let stacked_a = cx.upload_qmat_rows(&refs_a).expect("upload stacked W_a");
    let stacked_b = cx.upload_qmat_rows(&refs_b).expect("upload stacked W_b");
    let x0 = rand_f32s(d, 0xC4A3, 1.0);
    let stream = cx.stream().clone();

    // one by one (PDL graph): the reference bits and time
    let mut xa = cx.upload_f32(&vec![0f32; e]).unwrap();
    let mut xb = cx.upload_f32(&x0).unwrap();
    // the chain on the first `used` copies of each matrix
    let enqueue = |xa: &mut cuda::cudarc::driver::CudaSlice<f32>, xb: &mut cuda::cudarc::driver::CudaSlice<f32>, used: usize| -> Result<(), cuda::CudaError> {
        for l in 0..LAYERS {
            let c = (l / 2) % used;
            if l % 2 == 0 {
                cx.gemv(&mut xa.slice_mut(..), &single_a[c], &xb.slice(..))?;
            } else {
                cx.gemv(&mut xb.slice_mut(..), &single_b[c], &xa.slice(..))?;
            }
        }
        Ok(())
    };
    enqueue(&mut xa, &mut xb, copies).expect("gemv chain (launches)");
    let want = cx.download_f32(&xb).unwrap();
    // µs per GEMV of the chain as one PDL graph; two replays per timing, so the host's launch
    // overhead weighs less against 2 x LAYERS GEMVs. On all copies (every GEMV streams from
    // DRAM), then on ONE copy of each matrix (10.6 MB, L2-resident after the first pass: what
    // the GEMVs would gain from any prefetching into L2).
    let mut time_pdl = |used: usize| -> f64 {
        let graph = StepGraph::capture(&stream, true, || enqueue(&mut xa, &mut xb, used)).expect("PDL graph");
        graph.launch().unwrap();
        s.median_timed(7, 2 * LAYERS, || {
            graph.launch().unwrap();
            graph.launch().unwrap();
        }) * 1e6
    };
    let us_pdl = time_pdl(copies);
    let us_l2 = time_pdl(1);

    // one persistent launch: weights requested before each barrier (as designed), then after it
    let mut flags = stream.alloc_zeros::<u32>(cx.sm_count() as usize).unwrap();
    let mut base = 0u32;
    let mut us_chain = [0f64; 2];
    for (i, late) in [false, true].into_iter().enumerate() {
        let what = if late { "weights requested after each barrier" } else { "weights requested before each barrier" };
        let mut xa2 = cx.upload_f32(&vec![0f32; e]).unwrap();
        let mut xb2 = cx.upload_f32(&x0).unwrap();
        cx.gemv_chain_probe(&mut xa2, &mut xb2, &stacked_a, &stacked_b, copies, LAYERS, &mut flags, base, late).expect("gemv_chain_probe");
        base += LAYERS as u32;
        let got = cx.download_f32(&xb2).unwrap();
        let c = check_bits(&got, &want, "words (against the launches)");
        s.record(SEC, &format!("{LAYERS} GEMVs in one persistent launch ({what}) = {LAYERS} launches, bit for bit"), &c, "");
        // two launches per timing, as for the graph
        us_chain[i] = s.median_timed(7, 2 * LAYERS, || {
            for _ in 0..2 {
                cx.gemv_chain_probe(&mut xa2, &mut xb2, &stacked_a, &stacked_b, copies, LAYERS, &mut flags, base, late).unwrap();
                base += LAYERS as u32;
            }
        }) * 1e6;
    }
    let flags_now: Vec<u32> = stream.clone_dtoh(&flags).unwrap();
    let ok = flags_now.iter().all(|&f| f == base || f == 0) && flags_now.contains(&base);
    let cf = Cmp { rel: 0.0, max_over_rms: 0.0, ok, msg: format!("flags {flags_now:?}, last epoch {base}") };
    s.record(SEC, "every block reached the last barrier", &cf, "");
    let gbs = |us: f64| bytes as f64 / (us * 1e-6) / 1e9;
    println!(
        "{SEC:<10} 4-bit [{e}x{d}] / [{d}x{e}], {copies} copies, us per GEMV: {us_pdl:.2} as PDL launches ({:.0} GB/s; {us_l2:.2} on one L2-resident copy), {:.2} in one persistent launch ({:.0} GB/s), {:.2} with the weights requested after each barrier",
        gbs(us_pdl),
        us_chain[0],
        gbs(us_chain[0]),
        us_chain[1]
    );
    s.json.push((
        SEC.into(),
        format!(
            "{{\"layers\":{LAYERS},\"copies\":{copies},\"bytes_per_gemv\":{bytes},\"us_per_gemv_pdl\":{us_pdl:.3},\"us_per_gemv_pdl_l2_resident\":{us_l2:.3},\"us_per_gemv_chain\":{:.3},\"us_per_gemv_chain_late_weights\":{:.3}}}",
            us_chain[0], us_chain[1]
        ),
    ));
}
