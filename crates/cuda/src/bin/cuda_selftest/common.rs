//! Shared pieces of the GPU self-test: seeded random data, guarded output buffers, comparison
//! against a CPU reference, timing with CUDA events and graphs, and the report.

use cuda::cudarc::driver::{sys, CudaSlice};
use cuda::CudaContext;
use rayon::prelude::*;

/// Guard words on each side of every output buffer.
pub const GUARD: usize = 64;
/// A NaN bit pattern written around (and into) outputs: an unwritten output cannot pass.
pub const SENTINEL: u32 = 0x7FA5_A5A5;

/// SplitMix64 step as a function of the state (`sampler::splitmix64`).
pub fn splitmix(mut z: u64) -> u64 {
    sampler::splitmix64(&mut z)
}

/// `n` seeded random words (parallel, deterministic).
pub fn rand_u32s(n: usize, seed: u64) -> Vec<u32> {
    let mut v = vec![0u32; n];
    v.par_chunks_mut(1 << 16).enumerate().for_each(|(ci, c)| {
        let mut s = splitmix(seed ^ (ci as u64).wrapping_mul(0x1234_5678_9ABC_DEF1));
        for x in c.iter_mut() {
            s = splitmix(s);
            *x = s as u32;
        }
    });
    v
}

/// Uniform in [-a, a].
pub fn rand_f32s(n: usize, seed: u64, a: f32) -> Vec<f32> {
    rand_u32s(n, seed)
        .into_iter()
        .map(|u| ((u >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * a)
        .collect()
}

/// Median of a non-empty vector.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Tolerances of one comparison: relative L2 error `‖got − ref‖ / ‖ref‖` and the largest
/// absolute error over the reference's RMS.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rel: f64,
    pub max_over_rms: f64,
}

impl Tol {
    /// The default for f32 kernels against an f32/f64 CPU reference.
    pub const F32: Tol = Tol { rel: 1e-4, max_over_rms: 1e-3 };
}

/// Outcome of one comparison.
#[derive(Clone, Debug)]
pub struct Cmp {
    pub rel: f64,
    pub max_over_rms: f64,
    pub ok: bool,
    pub msg: String,
}

/// Compares a guarded download (`GUARD` sentinel words, the `reference.len()` outputs, `GUARD`
/// sentinel words) against `reference`: guards intact, every output finite, errors within `tol`.
pub fn check_guarded(got: &[f32], reference: &[f64], tol: Tol) -> Cmp {
    let n = reference.len();
    let mut msg = String::new();
    let guard_ok = got.len() == n + 2 * GUARD
        && got[..GUARD]
            .iter()
            .chain(&got[GUARD + n..])
            .all(|g| g.to_bits() == SENTINEL);
    if !guard_ok {
        msg.push_str("guard words overwritten; ");
        return Cmp { rel: f64::NAN, max_over_rms: f64::NAN, ok: false, msg };
    }
    check(&got[GUARD..GUARD + n], reference, tol, msg)
}

/// [`check`] of `got` against `want` at [`Tol::F32`] that also fails unless every value has
/// the same bits and is finite; the message counts the differing values ("N of M `what`
/// differ").
pub fn check_bits(got: &[f32], want: &[f32], what: &str) -> Cmp {
    let reference: Vec<f64> = want.iter().map(|v| f64::from(*v)).collect();
    let mut c = check(got, &reference, Tol::F32, String::new());
    let differ = got.iter().zip(want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    if differ > 0 || got.iter().any(|v| !v.is_finite()) {
        c.ok = false;
        c.msg.push_str(&format!("{differ} of {} {what} differ; ", want.len()));
    }
    c
}

/// Compares `got` (no guards) against `reference`.
pub fn check(got: &[f32], reference: &[f64], tol: Tol, mut msg: String) -> Cmp {
    let n = reference.len();
    if got.len() != n {
        msg.push_str(&format!("length {} vs {n}; ", got.len()));
        return Cmp { rel: f64::NAN, max_over_rms: f64::NAN, ok: false, msg };
    }
    let non_finite = got.iter().filter(|v| !v.is_finite()).count();
    if non_finite > 0 {
        msg.push_str(&format!("{non_finite} non-finite outputs; "));
    }
    let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
    for (g, r) in got.iter().zip(reference) {
        let d = f64::from(*g) - r;
        num += d * d;
        den += r * r;
        max_abs = max_abs.max(d.abs());
    }
    let rms = (den / n as f64).sqrt();
    let rel = (num / den).sqrt();
    let max_over_rms = max_abs / rms;
    let ok = non_finite == 0 && den > 0.0 && rel < tol.rel && max_over_rms < tol.max_over_rms;
    Cmp { rel, max_over_rms, ok, msg }
}

/// A device buffer of `n + 2·GUARD` f32 filled with [`SENTINEL`]; the output lives at
/// `GUARD..GUARD + n`.
pub fn guarded(cx: &CudaContext, n: usize) -> CudaSlice<f32> {
    cx.upload_f32(&vec![f32::from_bits(SENTINEL); n + 2 * GUARD]).expect("alloc guarded")
}

/// The self-test's shared state: the context, options, the roofline, and every result line.
pub struct Suite<'a> {
    pub cx: &'a CudaContext,
    /// Fewer repetitions.
    pub quick: bool,
    /// Device-to-device copy bandwidth in bytes/s (read + write), measured at start.
    pub copy_bw: f64,
    /// All checks so far passed.
    pub all_ok: bool,
    /// JSON objects, one per result, gathered into the final `JSON` line by section.
    pub json: Vec<(String, String)>,
}

impl Suite<'_> {
    /// Records one check: prints a line and keeps the JSON.
    pub fn record(&mut self, section: &str, label: &str, c: &Cmp, extra_json: &str) {
        println!(
            "{section:<10} {label:<60} rel {:.2e} max/rms {:.2e} {} {}",
            c.rel,
            c.max_over_rms,
            if c.ok { "ok" } else { "FAIL" },
            c.msg
        );
        self.all_ok &= c.ok;
        let sep = if extra_json.is_empty() { "" } else { "," };
        self.json.push((
            section.to_string(),
            format!(
                "{{\"label\":{:?},\"rel_err\":{:e},\"max_err_over_rms\":{:e},\"ok\":{}{sep}{extra_json}}}",
                label, c.rel, c.max_over_rms, c.ok
            ),
        ));
    }

    /// A new CUDA event.
    pub fn event(&self) -> cuda::cudarc::driver::CudaEvent {
        self.cx
            .raw()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event")
    }

    /// Median seconds per unit over `reps` timed calls of `launch` (CUDA events around each;
    /// every call does `per` units of work, e.g. one graph replay of `per` kernels).
    pub fn median_timed(&self, reps: usize, per: usize, mut launch: impl FnMut()) -> f64 {
        let stream = self.cx.stream();
        let mut ts = Vec::new();
        for _ in 0..reps.max(1) {
            let (a, b) = (self.event(), self.event());
            a.record(stream).unwrap();
            launch();
            b.record(stream).unwrap();
            b.synchronize().unwrap();
            ts.push(f64::from(a.elapsed_ms(&b).unwrap()) * 1e-3 / per.max(1) as f64);
        }
        median(ts)
    }

    /// Median seconds per call of `launch` (which queues `per_launch` kernels... or any work on
    /// the stream), replayed from a captured CUDA graph, `reps` times, after one warm-up.
    pub fn time_graph(&self, reps: usize, launch: impl FnOnce()) -> f64 {
        let graph = self.capture(launch);
        graph.launch().expect("graph launch");
        self.median_timed(reps, 1, || graph.launch().unwrap())
    }

    /// The work `launch` queues on the context's stream (and on streams it forks from it with
    /// events and joins back), captured as one CUDA graph, not run.
    pub fn capture(&self, launch: impl FnOnce()) -> cuda::cudarc::driver::CudaGraph {
        let stream = self.cx.stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .expect("begin capture");
        launch();
        stream
            .end_capture(
                sys::CUgraphInstantiate_flags_enum::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .expect("end capture")
            .expect("graph")
    }
}
