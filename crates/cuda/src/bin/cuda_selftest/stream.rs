//! Streaming rates from DRAM into shared memory (`CudaContext::stream_probe`,
//! `kernels/stream.cu`), the two ways the decode step fetches weights, alone and side by side.
//!
//! Session 19's kernel timeline found the step's MoE experts (bulk copies into 72 SMs, in
//! clusters of 8) and the next input projection's weights (per-thread `cp.async` into the SMs
//! the MoE leaves free) arriving at ~1.3-1.7 TB/s together, where the LM head streams at
//! 4.1 TB/s (docs/CUDA.md "Session 19"). Each case here launches blocks that each move a
//! block's worth of those bytes (216 KB like a MoE cluster block, 147 KB like an input
//! projection block) into shared memory; a case of two parts launches the second on a stream of
//! its own right after the first, so they run side by side as in the step. Consecutive launches
//! read other parts of a 1 GiB source, so nothing comes from L2.
//!
//! Per case, the 8 launches (and the second stream's fork and join, for two parts) are captured
//! in one CUDA graph, so the host's launch calls are not timed; the graph is replayed 7 times.
//! Printed: the time per launch (events, median over the replays) and the bytes over it, then,
//! from each replay's last launch's per-block timer stamps (medians over the replays), each
//! part's span (first block start to last block done), its GB/s over that span, a block's mean
//! duration and rate, and when the second part's first block started after the first part's.
//! The `spread:` cases read the same bytes per block from a 16 GiB source, one 4 MiB region per
//! block, as the decode step's experts lie across their ~15 GB of tensors: if address
//! translation (TLB misses) slows the step's streams, these cases are slower than their twins.
//!
//! **L2 retention** (session 35, after the L2 follower's prefetch of the next input projection
//! did not pay, docs/CUDA.md "L2 follower"): does an input projection's 14 MB stay in L2 while
//! the MoE's experts stream through it, and is it read faster from there? Each `retention:`
//! case launches, in stream order and 8 times (the first a warm-up): 97 blocks reading region A
//! by per-thread copies (A is then in L2, as the follower's prefetch would leave it), X MB of
//! other regions streamed by bulk copies (whole launches of the MoE's 72 blocks × 216 KB, 15.9
//! MB each, regions nothing read for a while), then the same 97 blocks reading A again; printed
//! is that last read (span, GB/s, a block's time), against the same read of a
//! region read by nothing before (`cold`). If the 14 MB survive X MB, the last read matches the
//! X = 0 row; if they do not, it matches `cold`. The `bulk` rows make the last read by bulk
//! copies (9 KB each) instead: whether a block reads faster from L2 that way.
//!
//! No correctness check: a measurement only, run when named (`--only stream`).

use cuda::cudarc::driver::CudaSlice;
use cuda::StreamProbe;

use crate::common::{median, Suite};

const SEC: &str = "stream";
/// A MoE cluster block's tiles: 144 KB of gate/up and 72 KB of down (16-row tiles + scales).
const MOE_BYTES: u32 = 216 * 1024;
/// An input projection block's share: 8 tiles of 16 rows × 2,048 columns at 4 bits (16,384 B)
/// plus their scales and biases (2,048 B): 147,456 B.
const GEMV_BYTES: u32 = 8 * (16 * 2048 / 2 + 16 * 32 * 4);
/// Bytes between consecutive blocks' sources (every block's bytes fit).
const STRIDE: usize = 256 * 1024;
/// The source: 4,096 block regions, ~18 times the L2.
const SOURCE: usize = 1 << 30;
/// The spread cases' source: 16 GiB (the 4-bit experts' tensors are ~15 GB), one block region
/// per 4 MiB, so every block of a launch reads its own 2 MiB pages far from the others'.
const SPREAD_SOURCE: usize = 16 << 30;
const SPREAD_STRIDE: usize = 4 << 20;
const LAUNCHES: usize = 8;

/// One part of a case: how, blocks, bytes per block, bulk-copy chunk.
type Part = (StreamProbe, u32, u32, u32);

/// Runs every case and prints the table.
pub fn run(s: &mut Suite) {
    let cx = s.cx;
    let sms = cx.sm_count();
    let src = cx.stream().alloc_zeros::<u8>(SOURCE).expect("alloc source");
    cx.stream_probe_prepare(MOE_BYTES.max(GEMV_BYTES)).expect("stream_probe_prepare");
    // a cluster of 8 needs 8 free SMs of one GPC: how many of the MoE's fit at once
    match cx.max_active_clusters("stream_bulk_cl8", 72, 512, MOE_BYTES) {
        Ok(n) => println!("{SEC:<10} clusters of 8 resident at once with {MOE_BYTES} B each: {n}"),
        Err(e) => println!("{SEC:<10} max_active_clusters: {e}"),
    }
    let side = cx.sibling().expect("second stream");
    let ev = || cx.raw().new_event(Some(cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).expect("event");
    let (forked, joined) = (ev(), ev());
    let moe_cl: Part = (StreamProbe::BulkClusters, 72, MOE_BYTES, MOE_BYTES / 16);
    let moe_flat: Part = (StreamProbe::Bulk, 72, MOE_BYTES, MOE_BYTES / 16);
    let free = sms.saturating_sub(72).max(1);
    let cases: Vec<(String, Vec<Part>, bool)> = vec![
        ("bulk, 9 clusters of 8, 216 KB (the MoE)".into(), vec![moe_cl], false),
        ("bulk, 72 blocks, 216 KB".into(), vec![moe_flat], false),
        (format!("bulk, {sms} blocks, 216 KB"), vec![(StreamProbe::Bulk, sms, MOE_BYTES, MOE_BYTES / 16)], false),
        (format!("bulk, {sms} blocks, 216 KB in 2.25 KB copies"), vec![(StreamProbe::Bulk, sms, MOE_BYTES, 2304)], false),
        ("threads, 97 blocks, 147 KB (the input projection)".into(), vec![(StreamProbe::Threads, 97, GEMV_BYTES, 0)], false),
        (format!("threads, {free} blocks, 147 KB"), vec![(StreamProbe::Threads, free, GEMV_BYTES, 0)], false),
        (format!("threads, {sms} blocks, 147 KB"), vec![(StreamProbe::Threads, sms, GEMV_BYTES, 0)], false),
        (format!("bulk, {sms} blocks, 147 KB"), vec![(StreamProbe::Bulk, sms, GEMV_BYTES, GEMV_BYTES / 16)], false),
        (format!("the MoE + threads, {free} blocks, 147 KB beside"), vec![moe_cl, (StreamProbe::Threads, free, GEMV_BYTES, 0)], false),
        (format!("the MoE + bulk, {free} blocks, 147 KB beside"), vec![moe_cl, (StreamProbe::Bulk, free, GEMV_BYTES, GEMV_BYTES / 16)], false),
        (format!("bulk 72 blocks + threads, {free} blocks beside"), vec![moe_flat, (StreamProbe::Threads, free, GEMV_BYTES, 0)], false),
        // the same reads spread over a source the size of the experts' tensors (one 4 MiB
        // region per block): a translation (TLB) miss per block shows here and not above
        ("spread: bulk, 9 clusters of 8, 216 KB".into(), vec![moe_cl], true),
        ("spread: threads, 97 blocks, 147 KB".into(), vec![(StreamProbe::Threads, 97, GEMV_BYTES, 0)], true),
        (format!("spread: the MoE + threads, {free} blocks beside"), vec![moe_cl, (StreamProbe::Threads, free, GEMV_BYTES, 0)], true),
    ];
    let max_blocks = cases.iter().flat_map(|(_, parts, _)| parts.iter().map(|p| p.1 as usize)).max().unwrap_or(1);
    let mut times: Vec<CudaSlice<u64>> = (0..2).map(|_| cx.stream().alloc_zeros::<u64>(2 * max_blocks).expect("alloc times")).collect();
    // the spread cases' source (skipped when the GPU has no room for it)
    let big = match cx.stream().alloc_zeros::<u8>(SPREAD_SOURCE) {
        Ok(b) => Some(b),
        Err(e) => {
            println!("{SEC:<10} no {SPREAD_SOURCE}-byte source for the spread cases: {e}");
            None
        }
    };
    retention(s, &src);
    let mut next = [0u32; 2]; // the next unread block region of each source
    println!("{SEC:<10} {:<52} {:>8} {:>9} | per part: span us, GB/s, block us, GB/s per block", "case", "us/launch", "GB/s");
    for (name, parts, spread) in &cases {
        let (src, stride, which) = match (spread, &big) {
            (false, _) => (&src, STRIDE, 0),
            (true, Some(b)) => (b, SPREAD_STRIDE, 1),
            (true, None) => continue,
        };
        let regions = (src.len() / stride) as u32;
        let total: u64 = parts.iter().map(|&(_, b, n, _)| b as u64 * n as u64).sum();
        // LAUNCHES launches, each on the next unread regions, captured in one graph
        let stream = cx.stream();
        let graph = s.capture(|| {
            for _ in 0..LAUNCHES {
                if parts.len() == 2 {
                    // the second part on the side stream, after everything queued so far
                    forked.record(stream).unwrap();
                    side.stream().wait(&forked).unwrap();
                }
                for (i, &(how, blocks, bytes, chunk)) in parts.iter().enumerate() {
                    if next[which] + blocks > regions {
                        next[which] = 0;
                    }
                    let on = if i == 0 { cx } else { &side };
                    on.stream_probe(how, src, stride, next[which], blocks, bytes, chunk, &mut times[i]).expect("stream_probe");
                    next[which] += blocks;
                }
                if parts.len() == 2 {
                    joined.record(side.stream()).unwrap();
                    stream.wait(&joined).unwrap();
                }
            }
        });
        graph.launch().expect("graph launch"); // warm-up
        // per replay: its time, and each part's figures from its last launch's stamps
        let (mut ts, mut figs, mut offsets) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..7 {
            ts.push(s.median_timed(1, LAUNCHES, || graph.launch().unwrap()));
            let mut starts = Vec::new();
            let mut per_part = Vec::new();
            for (i, &(_, blocks, bytes, _)) in parts.iter().enumerate() {
                let w = stream.clone_dtoh(&times[i].slice(..2 * blocks as usize)).expect("download times");
                let (t0, span_ns, block_ns) = block_stamps(&w);
                starts.push(t0);
                per_part.push([span_ns / 1e3, blocks as f64 * bytes as f64 / span_ns.max(1.0), block_ns / 1e3, bytes as f64 / block_ns.max(1.0)]);
            }
            if starts.len() == 2 {
                offsets.push((starts[1] as i64 - starts[0] as i64) as f64 / 1e3);
            }
            figs.push(per_part);
        }
        let t = median(ts);
        // medians over the replays, per part and figure
        let per_part: Vec<(f64, f64, f64, f64)> = (0..parts.len())
            .map(|i| {
                let m = |k: usize| median(figs.iter().map(|f| f[i][k]).collect());
                (m(0), m(1), m(2), m(3))
            })
            .collect();
        let offset_us = if offsets.is_empty() { 0.0 } else { median(offsets) };
        let parts_txt: Vec<String> =
            per_part.iter().map(|(sp, g, b, gb)| format!("{sp:.2} us {g:.0} GB/s, {b:.2} us {gb:.1} GB/s")).collect();
        println!(
            "{SEC:<10} {name:<52} {:>8.2} {:>9.0} | {}{}",
            t * 1e6,
            total as f64 / t / 1e9,
            parts_txt.join(" | "),
            if parts.len() == 2 { format!(" (second part started {offset_us:+.2} us after the first)") } else { String::new() }
        );
        let parts_json: Vec<String> = parts
            .iter()
            .zip(&per_part)
            .map(|(&(how, blocks, bytes, chunk), (sp, g, b, gb))| {
                format!("{{\"how\":\"{how:?}\",\"blocks\":{blocks},\"bytes\":{bytes},\"chunk\":{chunk},\"span_us\":{sp:.3},\"gbps\":{g:.1},\"block_us\":{b:.3},\"block_gbps\":{gb:.2}}}")
            })
            .collect();
        s.json.push((
            SEC.into(),
            format!(
                "{{\"case\":{name:?},\"us_per_launch\":{:.3},\"gbps\":{:.1},\"second_part_offset_us\":{offset_us:.3},\"parts\":[{}]}}",
                t * 1e6,
                total as f64 / t / 1e9,
                parts_json.join(",")
            ),
        ));
    }
}

/// From a launch's per-block stamps (`[start, done]` ns per block): the first start, the span
/// (first start to last done, ns) and a block's mean duration (ns).
fn block_stamps(w: &[u64]) -> (u64, f64, f64) {
    let t0 = w.chunks(2).map(|p| p[0]).min().unwrap_or(0);
    let t1 = w.chunks(2).map(|p| p[1]).max().unwrap_or(0);
    let blocks = (w.len() / 2).max(1);
    let block_ns = w.chunks(2).map(|p| p[1].saturating_sub(p[0]) as f64).sum::<f64>() / blocks as f64;
    (t0, t1.saturating_sub(t0) as f64, block_ns)
}

/// The `retention:` cases (module docs): per case and replay [A read] [X MB streamed] [A read
/// again], launched in stream order (not a graph: every replay streams regions read by nothing
/// for a while, cycling through the 1 GiB source, since a read that hits in L2 evicts nothing);
/// the last read timed from its blocks' stamps, medians over 7 replays after a warm-up.
fn retention(s: &mut Suite, src: &CudaSlice<u8>) {
    let cx = s.cx;
    let stream = cx.stream();
    let regions = (src.len() / STRIDE) as u32;
    const READER: u32 = 97; // the GDN input projection's blocks
    // A: regions [0, 97); the streamed and cold regions cycle through the ones after it
    let moe_launch = 72 * MOE_BYTES as u64;
    let mut t = stream.alloc_zeros::<u64>(2 * READER as usize).expect("alloc times");
    let mut scratch = stream.alloc_zeros::<u64>(2 * READER as usize).expect("alloc times");
    let mut next = READER;
    let mut take = |n: u32| {
        if next + n > regions {
            next = READER;
        }
        let b = next;
        next += n;
        b
    };
    // (name, MoE streams between, a cold region instead of A, the last read by bulk copies)
    for (name, stream_launches, cold, bulk) in [
        ("retention: A read again at once", 0u32, false, false),
        ("retention: A after 1 MoE stream (15.9 MB)", 1, false, false),
        ("retention: A after 2 MoE streams (31.9 MB)", 2, false, false),
        ("retention: A after 3 MoE streams (47.8 MB)", 3, false, false),
        ("retention: cold (a region nothing read)", 0, true, false),
        ("retention: bulk, A read again at once", 0, false, true),
        ("retention: bulk, A after 3 MoE streams", 3, false, true),
        ("retention: bulk, cold", 0, true, true),
    ] {
        let last = if bulk { (StreamProbe::Bulk, GEMV_BYTES / 16) } else { (StreamProbe::Threads, 0) };
        let mut figs = Vec::new();
        for rep in 0..8 {
            if !cold {
                cx.stream_probe(StreamProbe::Threads, src, STRIDE, 0, READER, GEMV_BYTES, 0, &mut scratch).expect("read A");
            }
            for _ in 0..stream_launches {
                let b = take(72);
                cx.stream_probe(StreamProbe::BulkClusters, src, STRIDE, b, 72, MOE_BYTES, MOE_BYTES / 16, &mut scratch).expect("stream");
            }
            let base = if cold { take(READER) } else { 0 };
            cx.stream_probe(last.0, src, STRIDE, base, READER, GEMV_BYTES, last.1, &mut t).expect("read A again");
            let w = stream.clone_dtoh(&t).expect("download times");
            if rep == 0 {
                continue; // warm-up
            }
            let (_, span_ns, block_ns) = block_stamps(&w);
            figs.push([span_ns / 1e3, block_ns / 1e3]);
        }
        let (span, block) = (median(figs.iter().map(|f| f[0]).collect()), median(figs.iter().map(|f| f[1]).collect()));
        let bytes = READER as f64 * GEMV_BYTES as f64;
        println!(
            "{SEC:<10} {name:<52} last read: span {span:.2} us, {:.0} GB/s, a block {block:.2} us ({} MB streamed between)",
            bytes / (span * 1e3).max(1.0),
            stream_launches as u64 * moe_launch / 1_000_000
        );
        s.json.push((
            SEC.into(),
            format!("{{\"case\":{name:?},\"streamed_bytes\":{},\"cold\":{cold},\"bulk\":{bulk},\"span_us\":{span:.3},\"block_us\":{block:.3}}}", stream_launches as u64 * moe_launch),
        ));
    }
}
