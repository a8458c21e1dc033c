//! Kernel timeline of the decode step: when each kernel's blocks became resident, when the
//! programmatic-dependent-launch wait released them, and when they triggered their dependents
//! (`calla cuda-bench --timeline`).
//!
//! The ablation (`decode::ablate`) says what a kernel class costs in place; the timeline says
//! why: whether the next kernel's blocks were already on their SMs, prefetching weights, when
//! the previous kernel finished, and how long each kernel keeps the chain waiting after it is
//! released.
//!
//! How: [`enable`] before [`CudaContext::new`] compiles every kernel with `CALLA_TIMELINE`
//! defined (`kernels/prelude.cuh`): thread 0 of every block then reads `%globaltimer` on both
//! sides of `calla_pdl_wait()`, appends a [`Record`] to a device log (one atomic per block),
//! stamps `%globaltimer` when it calls `calla_pdl_launch_dependents()`, and, in the kernels that
//! call them, at a phase of the kernel's own (`calla_tl_mark`: the decode GEMVs' last weights of
//! warp 0 present, the MoE cluster kernel's expert tiles all present) and when the block's work
//! is done (`calla_tl_done`).
//! Times are `%globaltimer` (ns, one clock for the whole GPU). On the H200 its values are
//! multiples of 32 ns but it advances in steps of about 256 ns (the blocks of one launch read
//! the same few values), so a single launch's times are good to ±0.26 µs and the per-entry-point
//! averages over many launches to better. The SM clocks are not used: they start from
//! different origins, and on the H200 they drift from a straight line against `%globaltimer`
//! by up to 6 µs within a few steps (measured), as the clock frequency moves (the probe logged
//! them before session 19; those two words now hold the mark and done stamps). The host groups
//! the records by grid id (one per kernel node, numbered in launch order and reused by every
//! replay of the graph), splits each group into replays by time, and matches the grids to the
//! step graph's kernel nodes ([`crate::graph::StepGraph::kernel_launches`]).
//!
//! The probe adds one atomic and a few stores per block; the instrumented step ran ~14% slower
//! than the plain one on the H200, so read its spans relative to each other. The kernel cache
//! keys on the source, so instrumented and plain cubins are cached apart.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{CudaSlice, DevicePtr};

use crate::{CudaContext, CudaError};

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Records the device log holds (each [`WORDS`] u64): enough for several decode steps of ~250
/// kernels at up to a few hundred blocks each.
pub const CAPACITY: usize = 1 << 20;

/// u64 words per record (`CALLA_TL_WORDS` in `kernels/prelude.cuh`).
pub const WORDS: usize = 8;

/// Compiles the kernels of every [`CudaContext`] created afterwards with the timeline probe.
/// For measurement only (`calla cuda-bench --timeline`); it cannot be switched off again in the
/// process.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// Whether [`enable`] was called.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// One block's record, raw (see `calla_pdl_wait` in `kernels/prelude.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// `%gridid`. Measured on the H200 (driver 580): one per kernel node of a graph, the same
    /// in every replay, increasing in the graph's launch order.
    pub grid: u64,
    /// `%smid` of the block.
    pub sm: u32,
    /// Linear block index.
    pub block: u32,
    /// `%globaltimer` (ns) at the kernel's mark (`calla_tl_mark` in `kernels/prelude.cuh`: the
    /// decode GEMVs' last weights of warp 0 present, the MoE cluster kernel's expert tiles all
    /// present), 0 when the kernel does not mark.
    pub ns_mark: u64,
    /// `%globaltimer` (ns) when the block's work was done (`calla_tl_done`), 0 when the kernel
    /// does not stamp it.
    pub ns_done: u64,
    /// `%globaltimer` (ns) at `launch_dependents`, 0 when the block never called it after its
    /// wait.
    pub ns_trigger: u64,
    /// `%globaltimer` (ns) right before the wait: the block is resident and has issued its
    /// weight prefetches.
    pub ns_pre: u64,
    /// `%globaltimer` (ns) right after the wait: the previous kernel has completed.
    pub ns_post: u64,
    /// Blocks in the grid.
    pub blocks: u64,
}

impl Record {
    fn from_words(w: &[u64]) -> Record {
        Record {
            grid: w[0],
            sm: (w[1] >> 32) as u32,
            block: w[1] as u32,
            ns_mark: w[2],
            ns_done: w[3],
            ns_trigger: w[4],
            ns_pre: w[5],
            ns_post: w[6],
            blocks: w[7],
        }
    }
}

/// The device side of the probe: the log, its cursor, and the modules whose `calla_tl` points
/// at them.
pub(crate) struct DeviceLog {
    rec: CudaSlice<u64>,
    cursor: CudaSlice<u32>,
    modules: Vec<(&'static str, std::sync::Arc<cudarc::driver::CudaModule>)>,
    /// Bumped at every reset: a block's tag includes it (`calla_tl_tag_of`).
    epoch: u32,
}

impl DeviceLog {
    /// Allocates the log and points every module's `calla_tl` at it.
    pub(crate) fn new(
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        modules: &HashMap<&'static str, std::sync::Arc<cudarc::driver::CudaModule>>,
    ) -> Result<DeviceLog, CudaError> {
        let mut log = DeviceLog {
            rec: stream.alloc_zeros::<u64>(CAPACITY * WORDS)?,
            cursor: stream.alloc_zeros::<u32>(1)?,
            modules: modules.iter().map(|(n, m)| (*n, m.clone())).collect(),
            epoch: 0,
        };
        log.write_descriptor(stream)?;
        Ok(log)
    }

    /// Writes `struct CallaTimeline { unsigned long long* rec; unsigned* cursor; unsigned cap;
    /// unsigned epoch; }` (24 bytes) into every module.
    fn write_descriptor(&mut self, stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<(), CudaError> {
        let rp = self.rec.device_ptr(stream).0;
        let cp = self.cursor.device_ptr(stream).0;
        let mut bytes = Vec::with_capacity(24);
        bytes.extend_from_slice(&rp.to_le_bytes());
        bytes.extend_from_slice(&cp.to_le_bytes());
        bytes.extend_from_slice(&(CAPACITY as u32).to_le_bytes());
        bytes.extend_from_slice(&self.epoch.to_le_bytes());
        for (name, m) in &self.modules {
            let mut g = m.get_global("calla_tl", stream)?;
            if g.len() != bytes.len() {
                return Err(CudaError::Unsupported(format!(
                    "{name}.cu: calla_tl is {} bytes, the host writes {}",
                    g.len(),
                    bytes.len()
                )));
            }
            stream.memcpy_htod(&bytes, &mut g)?;
        }
        Ok(())
    }
}

impl CudaContext {
    /// Empties the timeline log and starts a new epoch (queued; launches after it are
    /// recorded).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when the context was created without [`enable`]; driver errors.
    pub fn timeline_reset(&self) -> Result<(), CudaError> {
        let mut log = self.timeline.as_ref().ok_or_else(not_enabled)?.lock().unwrap_or_else(|e| e.into_inner());
        self.stream.memset_zeros(&mut log.cursor)?;
        log.epoch = log.epoch.wrapping_add(1);
        log.write_descriptor(&self.stream)?;
        Ok(())
    }

    /// Waits for the queued work and returns the records logged since
    /// [`Self::timeline_reset`] (at most [`CAPACITY`]), and how many did not fit.
    ///
    /// # Errors
    /// As [`Self::timeline_reset`].
    pub fn timeline_records(&self) -> Result<(Vec<Record>, usize), CudaError> {
        let log = self.timeline.as_ref().ok_or_else(not_enabled)?.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.stream.clone_dtoh(&log.cursor)?[0] as usize;
        let kept = n.min(CAPACITY);
        let words = self.stream.clone_dtoh(&log.rec.slice(..kept * WORDS))?;
        Ok((words.chunks_exact(WORDS).map(Record::from_words).collect(), n - kept))
    }
}

fn not_enabled() -> CudaError {
    CudaError::Unsupported("the timeline probe is off: call cuda::timeline::enable() before CudaContext::new".into())
}

/// One kernel launch of a replayed step, times in ns from the step's first release.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// Entry point name.
    pub name: String,
    /// Blocks in the grid.
    pub blocks: u64,
    /// Blocks that logged a record in this replay (equal to `blocks`: [`layout`] refuses logs
    /// where it is not).
    pub recorded: usize,
    /// First block resident (its wait began).
    pub first_resident: f64,
    /// Last block resident.
    pub last_resident: f64,
    /// Release: the earliest return from the wait, i.e. when the previous kernel had completed.
    pub release: f64,
    /// Fraction of the blocks resident (waiting) at the release.
    pub resident_at_release: f64,
    /// When the last block triggered its dependents (`None` if some block never did after its
    /// wait).
    pub all_triggered: Option<f64>,
    /// Mean and latest [`Record::ns_mark`] after the release (ns) over the blocks that marked
    /// (`None`: the kernel does not mark).
    pub mark: Option<(f64, f64)>,
    /// Latest [`Record::ns_done`] after the release (ns): over all blocks, over the blocks
    /// resident at the release, over the others (`None` when there are none) (`None`: the
    /// kernel does not stamp it in every block).
    pub done: Option<(f64, f64, Option<f64>)>,
}

/// Lays the records of one or more replays of a step graph out as launches: grids in launch
/// order, matched to `kernels` (the graph's `(name, blocks)` in launch order, see
/// [`crate::graph::StepGraph::kernel_launches`]); each grid's records are split into replays by
/// time (every replay logs one record per block). Returns one `Vec<Launch>` per replay, times
/// relative to that replay's first release.
///
/// # Errors
/// [`CudaError::Unsupported`] when the grids do not match the graph's kernels one to one (count
/// or block counts), or the grids' record counts are not the same whole number of replays.
pub fn layout(records: &[Record], kernels: &[(String, u64)]) -> Result<Vec<Vec<Launch>>, CudaError> {
    if kernels.is_empty() {
        return Err(CudaError::Unsupported("a step graph without kernels".into()));
    }
    let mut grids: std::collections::BTreeMap<u64, Vec<&Record>> = std::collections::BTreeMap::new();
    for r in records {
        grids.entry(r.grid).or_default().push(r);
    }
    if grids.len() != kernels.len() {
        return Err(CudaError::Unsupported(format!("{} grids logged, the graph has {} kernels", grids.len(), kernels.len())));
    }
    let mut replays = None;
    let mut per_grid = Vec::with_capacity(kernels.len());
    for (i, (mut g, (name, blocks))) in grids.into_values().zip(kernels).enumerate() {
        let b = *blocks as usize;
        if g[0].blocks != *blocks || g.len() % b != 0 {
            return Err(CudaError::Unsupported(format!(
                "launch {i} ({name}) has {blocks} blocks in the graph; the log has {} records of a {}-block grid",
                g.len(),
                g[0].blocks
            )));
        }
        let n = g.len() / b;
        if *replays.get_or_insert(n) != n {
            return Err(CudaError::Unsupported(format!("launch {i} ({name}) logged {n} replays, launch 0 {}", replays.unwrap_or(0))));
        }
        g.sort_by_key(|r| r.ns_post);
        per_grid.push(g);
    }
    let replays = replays.unwrap_or(0);
    let mut steps = Vec::with_capacity(replays);
    for s in 0..replays {
        let mut launches = Vec::with_capacity(kernels.len());
        for (g, (name, blocks)) in per_grid.iter().zip(kernels) {
            let b = *blocks as usize;
            let recs = &g[s * b..(s + 1) * b];
            let pre: Vec<f64> = recs.iter().map(|r| r.ns_pre as f64).collect();
            let release = recs.iter().map(|r| r.ns_post as f64).fold(f64::INFINITY, f64::min);
            let trig: Option<Vec<f64>> = recs.iter().map(|r| (r.ns_trigger != 0).then_some(r.ns_trigger as f64)).collect();
            let marks: Vec<f64> = recs.iter().filter(|r| r.ns_mark != 0).map(|r| r.ns_mark as f64 - release).collect();
            let mark = (!marks.is_empty())
                .then(|| (marks.iter().sum::<f64>() / marks.len() as f64, marks.iter().copied().fold(f64::NEG_INFINITY, f64::max)));
            let latest = |early: bool| {
                recs.iter()
                    .filter(|r| (r.ns_pre as f64 <= release) == early)
                    .map(|r| r.ns_done as f64 - release)
                    .reduce(f64::max)
            };
            let done = recs.iter().all(|r| r.ns_done != 0).then(|| {
                let early = latest(true).unwrap_or(f64::NEG_INFINITY);
                let late = latest(false);
                (late.map_or(early, |l| l.max(early)), early, late)
            });
            launches.push(Launch {
                name: name.clone(),
                blocks: *blocks,
                recorded: recs.len(),
                first_resident: pre.iter().copied().fold(f64::INFINITY, f64::min),
                last_resident: pre.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                release,
                resident_at_release: pre.iter().filter(|&&t| t <= release).count() as f64 / b as f64,
                all_triggered: trig.map(|v| v.into_iter().fold(f64::NEG_INFINITY, f64::max)),
                mark,
                done,
            });
        }
        let t0 = launches[0].release;
        for l in &mut launches {
            l.first_resident -= t0;
            l.last_resident -= t0;
            l.release -= t0;
            if let Some(t) = &mut l.all_triggered {
                *t -= t0;
            }
        }
        steps.push(launches);
    }
    Ok(steps)
}

/// Per entry point and grid size (one entry point serves launches of different sizes: the
/// fused-norm GEMV is the GDN and attention input projections and the LM head), averaged over
/// its launches in the given replays (ns):
/// `span` = next kernel's release − this kernel's release (what it adds to the chain);
/// `lead` = release − first block resident; `late` = last block resident − release (0 when
/// every block was resident in time); `drain` = next release − last trigger (how long the
/// kernel ran on after every block had let its dependents launch); `launch` = first block
/// resident − the previous kernel's last trigger (median).
#[derive(Debug, Clone, PartialEq)]
pub struct KernelSummary {
    /// Entry point.
    pub name: String,
    /// Launches per replay.
    pub launches_per_step: f64,
    /// Mean blocks per launch.
    pub blocks: f64,
    /// Mean µs each launch adds to the step (see the struct docs).
    pub span_us: f64,
    /// Mean µs its first block was resident before its release.
    pub lead_us: f64,
    /// Mean fraction of its blocks resident at the release.
    pub resident_at_release: f64,
    /// Mean µs its last block arrived after the release.
    pub late_us: f64,
    /// Mean µs from its release to its last block's trigger (launches that triggered in every
    /// block).
    pub trigger_us: Option<f64>,
    /// Mean µs from its last trigger to the next release (launches that triggered in every block).
    pub drain_us: Option<f64>,
    /// Median µs from the previous kernel's last trigger to this kernel's first block resident:
    /// the dependent-launch latency (launches whose predecessor triggered in every block).
    pub launch_us: Option<f64>,
    /// Sum of `span_us` over a replay.
    pub total_us: f64,
    /// Mean µs from the release to the blocks' mark, and to the latest mark ([`Launch::mark`]).
    pub mark_us: Option<(f64, f64)>,
    /// Mean µs from the release to the last block done: of all, of the blocks resident at the
    /// release, of the others (launches that had late blocks) ([`Launch::done`]).
    pub done_us: Option<(f64, f64, Option<f64>)>,
}

/// [`KernelSummary`] of every entry point and grid size, in order of first launch in the step.
/// The last launch of a replay has no next release and no span.
pub fn summarize(steps: &[Vec<Launch>]) -> Vec<KernelSummary> {
    struct Acc {
        n: usize,
        blocks: f64,
        span: f64,
        span_n: usize,
        lead: f64,
        res: f64,
        late: f64,
        drain: f64,
        trig: f64,
        drain_n: usize,
        launch: Vec<f64>,
        mark: Vec<(f64, f64)>,
        done: Vec<(f64, f64)>,
        done_late: Vec<f64>,
    }
    let mut order: Vec<(String, u64)> = Vec::new();
    let mut acc: HashMap<(String, u64), Acc> = HashMap::new();
    for step in steps {
        for (i, l) in step.iter().enumerate() {
            let key = (l.name.clone(), l.blocks);
            let a = acc.entry(key.clone()).or_insert_with(|| {
                order.push(key);
                Acc {
                    n: 0,
                    blocks: 0.0,
                    span: 0.0,
                    span_n: 0,
                    lead: 0.0,
                    res: 0.0,
                    late: 0.0,
                    drain: 0.0,
                    trig: 0.0,
                    drain_n: 0,
                    launch: Vec::new(),
                    mark: Vec::new(),
                    done: Vec::new(),
                    done_late: Vec::new(),
                }
            });
            a.mark.extend(l.mark);
            if let Some((all, early, late)) = l.done {
                a.done.push((all, early));
                a.done_late.extend(late);
            }
            a.n += 1;
            a.blocks += l.blocks as f64;
            a.lead += l.release - l.first_resident;
            a.res += l.resident_at_release;
            a.late += (l.last_resident - l.release).max(0.0);
            if let Some(t) = i.checked_sub(1).and_then(|p| step[p].all_triggered) {
                a.launch.push(l.first_resident - t);
            }
            if let Some(next) = step.get(i + 1) {
                a.span += next.release - l.release;
                a.span_n += 1;
                if let Some(t) = l.all_triggered {
                    a.drain += next.release - t;
                    a.trig += t - l.release;
                    a.drain_n += 1;
                }
            }
        }
    }
    let steps_n = steps.len().max(1) as f64;
    order
        .into_iter()
        .map(|key| {
            let a = &acc[&key];
            let name = key.0;
            let n = a.n as f64;
            KernelSummary {
                launches_per_step: n / steps_n,
                blocks: a.blocks / n,
                span_us: a.span / a.span_n.max(1) as f64 / 1e3,
                lead_us: a.lead / n / 1e3,
                resident_at_release: a.res / n,
                late_us: a.late / n / 1e3,
                trigger_us: (a.drain_n > 0).then(|| a.trig / a.drain_n as f64 / 1e3),
                drain_us: (a.drain_n > 0).then(|| a.drain / a.drain_n as f64 / 1e3),
                launch_us: median(&a.launch).map(|m| m / 1e3),
                total_us: a.span / steps_n / 1e3,
                mark_us: mean2(&a.mark).map(|(m, x)| (m / 1e3, x / 1e3)),
                done_us: mean2(&a.done).map(|(all, early)| {
                    let late = (!a.done_late.is_empty()).then(|| a.done_late.iter().sum::<f64>() / a.done_late.len() as f64 / 1e3);
                    (all / 1e3, early / 1e3, late)
                }),
                name,
            }
        })
        .collect()
}

/// Component-wise mean of pairs (`None` for none).
fn mean2(v: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = v.len() as f64;
    (!v.is_empty()).then(|| (v.iter().map(|p| p.0).sum::<f64>() / n, v.iter().map(|p| p.1).sum::<f64>() / n))
}

fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block's record, without mark and done stamps.
    fn rec(grid: u64, sm: u32, block: u32, pre_ns: u64, post_ns: u64, trig_ns: Option<u64>) -> Record {
        Record {
            grid,
            sm,
            block,
            ns_mark: 0,
            ns_done: 0,
            ns_trigger: trig_ns.unwrap_or(0),
            ns_pre: pre_ns,
            ns_post: post_ns,
            blocks: 2,
        }
    }

    #[test]
    fn layout_orders_grids_and_splits_replays() {
        let mut records = Vec::new();
        // two replays 10 us apart, logged out of order
        for off in [10_000, 0] {
            records.extend([
                // kernel B (grid 11): block 1 arrives after the release
                rec(11, 0, 0, off + 1_500, off + 3_000, Some(off + 3_500)),
                rec(11, 1, 1, off + 3_200, off + 3_200, Some(off + 3_900)),
                // kernel A (grid 10)
                rec(10, 1, 0, off + 100, off + 1_000, Some(off + 2_000)),
                rec(10, 0, 1, off + 200, off + 1_010, Some(off + 2_100)),
                // kernel C: blocks that never trigger
                rec(12, 0, 0, off + 5_000, off + 5_100, None),
                rec(12, 1, 1, off + 5_050, off + 5_150, None),
            ]);
        }
        let kernels = vec![("a".to_string(), 2), ("b".to_string(), 2), ("c".to_string(), 2)];
        let steps = layout(&records, &kernels).unwrap();
        assert_eq!(steps.len(), 2);
        for s in &steps {
            assert_eq!(s[0].name, "a");
            assert!((s[0].release - 0.0).abs() < 1e-6);
            assert!((s[1].release - 2_000.0).abs() < 1e-6, "{}", s[1].release);
            assert!((s[1].resident_at_release - 0.5).abs() < 1e-9);
            assert!((s[1].last_resident - 2_200.0).abs() < 1e-6);
            assert!((s[0].all_triggered.unwrap() - 1_100.0).abs() < 1e-6);
            assert_eq!(s[2].all_triggered, None);
        }
        let sum = summarize(&steps);
        assert_eq!(sum.len(), 3);
        assert!((sum[0].launches_per_step - 1.0).abs() < 1e-9);
        assert!((sum[0].span_us - 2.0).abs() < 1e-9);
        assert!((sum[0].total_us - 2.0).abs() < 1e-9);
        assert!((sum[0].drain_us.unwrap() - 0.9).abs() < 1e-9);
        assert!((sum[0].trigger_us.unwrap() - 1.1).abs() < 1e-9);
        // b's first block is resident 0.6 us before a's last trigger; c's 2.9 us after b's
        assert_eq!(sum[0].launch_us, None);
        assert!((sum[1].launch_us.unwrap() - (-0.6)).abs() < 1e-9);
        assert!((sum[2].launch_us.unwrap() - 1.1).abs() < 1e-9);
        assert!((sum[1].late_us - 0.2).abs() < 1e-9);
        assert!((sum[1].lead_us - 1.5).abs() < 1e-9);
    }

    #[test]
    fn marks_and_done_stamps_are_measured_from_the_release() {
        // one replay of one kernel: block 0 resident early, block 1 after the release (at 1.5 us)
        let stamped = |mut r: Record, mark: u64, done: u64| {
            r.ns_mark = mark;
            r.ns_done = done;
            r
        };
        let records = vec![
            stamped(rec(10, 0, 0, 100, 1_000, Some(1_200)), 1_400, 3_000),
            stamped(rec(10, 1, 1, 1_500, 1_500, Some(1_700)), 2_600, 5_000),
        ];
        let steps = layout(&records, &[("a".into(), 2)]).unwrap();
        let l = &steps[0][0];
        // marks 0.4 and 1.6 us after the release at 1.0 us
        let (mean, max) = l.mark.unwrap();
        assert!((mean - 1_000.0).abs() < 1e-6 && (max - 1_600.0).abs() < 1e-6, "{:?}", l.mark);
        // done: the late block last (4.0 us), the early one at 2.0 us
        assert_eq!(l.done, Some((4_000.0, 2_000.0, Some(4_000.0))));
        let sum = summarize(&steps);
        assert_eq!(sum[0].done_us, Some((4.0, 2.0, Some(4.0))));
        assert_eq!(sum[0].mark_us, Some((1.0, 1.6)));
        // a block without a done stamp: no done figures; without marks: none either
        let partial = vec![records[0], rec(10, 1, 1, 1_500, 1_500, Some(1_700))];
        let steps = layout(&partial, &[("a".into(), 2)]).unwrap();
        assert_eq!(steps[0][0].done, None);
        assert_eq!(steps[0][0].mark, Some((400.0, 400.0)));
        let bare = vec![rec(10, 0, 0, 0, 10, None), rec(10, 0, 1, 0, 10, None)];
        assert_eq!(layout(&bare, &[("a".into(), 2)]).unwrap()[0][0].mark, None);
    }

    #[test]
    fn summary_splits_an_entry_point_by_grid_size() {
        // "g" launched on 2 blocks, then "k", then "g" again on 1 block (as the fused-norm GEMV
        // is both the input projections and the LM head)
        let one = |r: Record| Record { blocks: 1, ..r };
        let records = vec![
            rec(10, 0, 0, 0, 100, Some(200)),
            rec(10, 1, 1, 0, 100, Some(200)),
            one(rec(11, 0, 0, 150, 1_100, Some(1_200))),
            one(rec(12, 0, 0, 1_150, 2_100, Some(2_200))),
            one(rec(13, 0, 0, 2_150, 5_100, None)),
        ];
        let kernels = vec![("g".to_string(), 2), ("k".to_string(), 1), ("g".to_string(), 1), ("k".to_string(), 1)];
        let sum = summarize(&layout(&records, &kernels).unwrap());
        let rows: Vec<(&str, f64, f64)> = sum.iter().map(|k| (k.name.as_str(), k.blocks, k.span_us)).collect();
        assert_eq!(rows, vec![("g", 2.0, 1.0), ("k", 1.0, 1.0), ("g", 1.0, 3.0)]);
    }

    #[test]
    fn layout_refuses_foreign_records() {
        let records = vec![rec(10, 0, 0, 0, 10, None), rec(10, 0, 1, 0, 10, None)];
        // the log holds one grid, the graph two kernels
        assert!(layout(&records, &[("a".into(), 2), ("b".into(), 2)]).is_err());
        // block count differs
        assert!(layout(&records, &[("a".into(), 3)]).is_err());
        // one block logged twice: not a whole number of replays
        let mut three = records.clone();
        three.push(rec(10, 0, 0, 20, 30, None));
        assert!(layout(&three, &[("a".into(), 2)]).is_err());
    }
}
