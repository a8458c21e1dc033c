//! The L2 follower: a small kernel beside the decode step's chain of kernels that asks L2 for
//! weights the chain reads later (`l2_follow` in `kernels/step.cu`).
//!
//! Why: the decode step is a chain of dependent kernels; only the MoE's experts and the LM head
//! move bytes near the copy roofline. The next layer's input projection (14.2 MB at 4 bits for a
//! GDN layer) requests its weights while the MoE streams its experts (~15.9 MB), and the two
//! streams together arrive at ~1.4 TB/s; the projection's blocks that land only as the MoE's
//! SMs drain then pull their rows from DRAM at one block's rate (docs/CUDA.md, sessions 19 and
//! 34). Meanwhile the GDN step and the output projection before the MoE read ~9 MB in ~10 µs
//! and leave DRAM mostly idle. The follower fills that idle time: once layer `i`'s mixer kernel
//! signals that layer `i`'s input projection has completed, it can ask L2 for layer `i + 1`'s
//! input projection, so those bytes are on chip before the MoE starts. Measured, that did not
//! pay (docs/CUDA.md "L2 follower"); what did, a little, is asking at the same point for layer
//! `i`'s output projection, read ~4.5 µs later, and layer `i + 1`'s ([`FollowPlan::DEFAULT`]).
//!
//! How: the mixer kernels (GDN step, split attention) add 1 to a progress word once their PDL
//! wait returns ([`crate::L2Prefetch`]'s `progress`), and with [`parts::IN_LATE`] so does every
//! block of the MoE cluster kernel after the router fold once its expert tiles have landed
//! ([`FollowPlan::bumps_per_layer`]); the follower is a root node of the step
//! graph ([`crate::graph::StepGraph::capture_with_root`]) whose blocks poll that word and issue
//! `cp.async.bulk.prefetch.L2` for each region once its trigger is reached. Nothing in the chain
//! waits for the follower, and prefetches are hints: results are the same with or without it,
//! bit for bit. Earlier sessions issued such hints from the chain's own kernels, which then
//! could not retire until their prefetches drained (docs/CUDA.md, "L2 prefetch hints on").

use cudarc::driver::{CudaSlice, DevicePtr};

use crate::decode::{CudaModel, DeviceMixer};
use crate::moe::CL_BLOCKS;
use crate::graph::RootKernel;
use crate::{CudaContext, CudaError, DeviceQMat};

/// What the follower asks L2 for, as bits of [`FollowPlan::parts`].
pub mod parts {
    /// Layer `i + 1`'s stacked input projection, once layer `i`'s has completed.
    pub const IN_NEXT: u32 = 1;
    /// Layer `i`'s output projection, once layer `i`'s input projection has completed.
    pub const OUT_SAME: u32 = 2;
    /// Layer `i + 1`'s output projection, at the same point.
    pub const OUT_NEXT: u32 = 4;
    /// Layer `i`'s router and shared-expert gate rows (read by its output projection's router
    /// fold), at the same point.
    pub const ROUTER: u32 = 8;
    /// Layer `i`'s shared expert (read by its MoE cluster kernel before its PDL wait), at the
    /// same point.
    pub const SHARED: u32 = 16;
    /// The rows of layer `i + 1`'s stacked input projection that its late-landing blocks read
    /// (those past the SMs the MoE cluster kernel leaves free, `CudaContext::gemv_late_rows`),
    /// once [`FollowPlan::landed`] of layer `i`'s MoE cluster blocks have all their expert
    /// tiles in shared memory: after the experts' stream, so the hints do not compete with it,
    /// and before those blocks land. The MoE cluster kernel then bumps the progress word too
    /// (once per block); only where every layer's experts run as the cluster kernel after the
    /// router fold (elsewhere the part is left out).
    pub const IN_LATE: u32 = 32;
    /// Every part with its name (for `cuda-bench --l2-follow`).
    pub const ALL: [(u32, &str); 6] =
        [(IN_NEXT, "in"), (OUT_SAME, "out"), (OUT_NEXT, "out-next"), (ROUTER, "router"), (SHARED, "shared"), (IN_LATE, "in-late")];
}

/// How the follower runs: its blocks (one warp each, on as many SMs), which weights
/// ([`parts`]) and whether its prefetches carry an L2 evict_last policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FollowPlan {
    /// Blocks of 32 threads; each asks for its 1/`blocks` share of every region.
    pub blocks: u32,
    /// [`parts`] bits.
    pub parts: u32,
    /// Prefetch with an L2 evict_last policy (`createpolicy.fractional.L2::evict_last`).
    pub evict_last: bool,
    /// The MoE cluster kernels' routed-expert copies carry an L2 evict_first policy
    /// ([`crate::moe::MoeScratch::evict_first`]), so that they do not evict what the follower
    /// asked for.
    pub experts_evict_first: bool,
    /// For [`parts::IN_LATE`]: how many of a layer's [`crate::moe::CL_BLOCKS`] MoE cluster
    /// blocks must have their expert tiles before the follower asks (1..=`CL_BLOCKS`).
    pub landed: u32,
}

impl FollowPlan {
    /// The default of new sessions ([`default_plan`]): layer `i`'s and layer `i + 1`'s output
    /// projections once layer `i`'s input projection has completed, 16 blocks, no cache
    /// policies. Measured on the H200 (docs/CUDA.md "L2 follower"): 2.3-9.5 µs per token
    /// faster than no follower in six processes; asking for the next input projection too
    /// was slower.
    pub const DEFAULT: FollowPlan =
        FollowPlan { blocks: 16, parts: parts::OUT_SAME | parts::OUT_NEXT, evict_last: false, experts_evict_first: false, landed: CL_BLOCKS as u32 };

    /// Progress bumps per layer in a step that runs this plan: the mixer's, plus one per MoE
    /// cluster block with [`parts::IN_LATE`].
    pub fn bumps_per_layer(&self) -> usize {
        1 + if self.parts & parts::IN_LATE != 0 { CL_BLOCKS } else { 0 }
    }

    /// Checks the fields a caller may have set by hand.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] naming `blocks` when it is outside 1..=1024, `landed` when it
    /// is outside 1..=[`CL_BLOCKS`].
    pub fn check(&self) -> Result<(), CudaError> {
        if !(1..=1024).contains(&self.blocks) {
            Err(CudaError::Unsupported(format!("L2 follower blocks {}: 1..=1024", self.blocks)))
        } else if !(1..=CL_BLOCKS as u32).contains(&self.landed) {
            Err(CudaError::Unsupported(format!("L2 follower landed {}: 1..={CL_BLOCKS} MoE cluster blocks", self.landed)))
        } else {
            Ok(())
        }
    }

    /// Parses `cuda-bench --l2-follow`'s form: parts joined by `+` (`in`, `out`, `out-next`,
    /// `router`, `shared`, `in-late`: [`parts::ALL`]), then optionally `:BLOCKS` (default 16),
    /// `:last` (evict_last), `:ef` (the experts evict_first) and `:mN` ([`Self::landed`],
    /// default all [`CL_BLOCKS`]), e.g. `in+out:24:last` or `out+in-late:m64`.
    ///
    /// # Errors
    /// A message naming the part or number that is not understood.
    pub fn parse(s: &str) -> Result<FollowPlan, String> {
        let mut it = s.split(':');
        let mut plan = FollowPlan { parts: 0, ..FollowPlan::DEFAULT };
        for name in it.next().unwrap_or("").split('+') {
            let bit = parts::ALL.iter().find(|(_, n)| *n == name).map(|(b, _)| *b);
            plan.parts |= bit.ok_or_else(|| format!("unknown L2 follower part {name:?} (in, out, out-next, router, shared, in-late)"))?;
        }
        for opt in it {
            if opt == "last" {
                plan.evict_last = true;
            } else if opt == "ef" {
                plan.experts_evict_first = true;
            } else if let Some(n) = opt.strip_prefix('m') {
                plan.landed = n
                    .parse()
                    .ok()
                    .filter(|&b| (1..=CL_BLOCKS as u32).contains(&b))
                    .ok_or_else(|| format!("L2 follower landed {opt:?}: m1..=m{CL_BLOCKS} MoE cluster blocks"))?;
            } else {
                plan.blocks = opt.parse().ok().filter(|&b| (1..=1024).contains(&b)).ok_or_else(|| format!("L2 follower blocks {opt:?}: 1..=1024"))?;
            }
        }
        Ok(plan)
    }
}

/// The plan new sessions start with ([`set_default_plan`]), packed by [`pack`]; 0: none.
static DEFAULT_PLAN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(pack(Some(FollowPlan::DEFAULT)));

const fn pack(p: Option<FollowPlan>) -> u64 {
    match p {
        None => 0,
        Some(p) => {
            1 << 48
                | (p.experts_evict_first as u64) << 41
                | (p.evict_last as u64) << 40
                | (p.parts as u64 & 0xff) << 32
                | (p.landed as u64 & 0xff) << 16
                | p.blocks as u64 & 0xffff
        }
    }
}

/// Sets the L2 follower plan of every [`crate::decode::CudaSession`] created afterwards in
/// this process ([`FollowPlan::DEFAULT`] unless set; `None`: no follower), e.g. for `calla
/// cuda-check --l2-follow`, where the engine creates sessions of its own. `plan` should pass
/// [`FollowPlan::check`] (as [`FollowPlan::parse`]'s do): fields past their ranges are
/// stored masked (blocks to 16 bits, parts and landed to 8), and a session's follower checks
/// the plan again when it is built (its capture fails on a rejected one).
pub fn set_default_plan(plan: Option<FollowPlan>) {
    DEFAULT_PLAN.store(pack(plan), std::sync::atomic::Ordering::Relaxed);
}

/// [`set_default_plan`]'s plan.
pub fn default_plan() -> Option<FollowPlan> {
    let v = DEFAULT_PLAN.load(std::sync::atomic::Ordering::Relaxed);
    (v != 0).then_some(FollowPlan {
        blocks: v as u32 & 0xffff,
        parts: (v >> 32) as u32 & 0xff,
        evict_last: (v >> 40) & 1 == 1,
        experts_evict_first: (v >> 41) & 1 == 1,
        landed: (v >> 16) as u32 & 0xff,
    })
}

/// One region of [`Follower`]'s table (`calla_step::FollowEntry`: pointer, bytes, trigger).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    ptr: u64,
    bytes: u64,
    trigger: u64,
}

/// The follower's device memory: its table of regions and `[progress, base[blocks]]` u32 words.
pub(crate) struct Follower {
    plan: FollowPlan,
    entries: CudaSlice<u64>,
    n: usize,
    words: CudaSlice<u32>,
}

/// Adds a quantized matrix as the decode GEMVs read it: its staged copy where they read that
/// ([`CudaContext::set_gemv_staged`]), else its codes, scales and biases (the MLX layout).
fn push_qmat(out: &mut Vec<Entry>, cx: &CudaContext, m: &DeviceQMat, trigger: u64) {
    let st = cx.stream();
    if let Some(staged) = cx.staged_of(m) {
        out.push(Entry { ptr: staged.device_ptr(st).0, bytes: (staged.len() * 4) as u64, trigger });
        return;
    }
    for (ptr, bytes) in m.regions(st) {
        out.push(Entry { ptr, bytes: bytes as u64, trigger });
    }
}

/// A layer's output projection (GDN `out_proj`, attention `o_proj`).
fn out_of(l: &crate::decode::DeviceLayer) -> &DeviceQMat {
    match &l.mixer {
        DeviceMixer::Gdn { out_proj, .. } => out_proj,
        DeviceMixer::Attn { o_proj, .. } => o_proj,
    }
}

/// The regions of `plan` for `model`, in trigger order: layer `i`'s mixer bumps the progress
/// word to `i·b + 1` (`b` = [`FollowPlan::bumps_per_layer`]), so parts asked for at layer `i`
/// get trigger `i·b + 1`; with [`parts::IN_LATE`] layer `i`'s MoE cluster blocks then bring it
/// to `(i + 1)·b`, and the late rows of layer `i + 1`'s input projection get `i·b + 1 +
/// landed`.
fn plan_entries(cx: &CudaContext, m: &CudaModel, plan: &FollowPlan) -> Vec<Entry> {
    let mut e = Vec::new();
    let per_layer = plan.bumps_per_layer() as u64;
    for (i, l) in m.layers.iter().enumerate() {
        let trigger = i as u64 * per_layer + 1;
        if plan.parts & parts::OUT_SAME != 0 {
            push_qmat(&mut e, cx, out_of(l), trigger);
        }
        if plan.parts & parts::ROUTER != 0 {
            let st = cx.stream();
            let r = l.moe.router_refs();
            for s in [r.router_packed, r.router_sb, r.gate_packed, r.gate_sb] {
                e.push(Entry { ptr: s.device_ptr(st).0, bytes: (s.len() * 4) as u64, trigger });
            }
        }
        if plan.parts & parts::SHARED != 0 {
            for (ptr, bytes) in l.moe.shared_expert_regions(cx) {
                e.push(Entry { ptr, bytes: bytes as u64, trigger });
            }
        }
        if let Some(next) = m.layers.get(i + 1) {
            if plan.parts & parts::IN_NEXT != 0 {
                for (run, _) in &next.mixer.input_projection().runs {
                    push_qmat(&mut e, cx, run, trigger);
                }
            }
            if plan.parts & parts::OUT_NEXT != 0 {
                push_qmat(&mut e, cx, out_of(next), trigger);
            }
            if plan.parts & parts::IN_LATE != 0 {
                // the rows of the blocks past the SMs the MoE leaves free (MLX layout, one
                // run, not staged; `gemv_late_rows` gives none for a forced grid or a launch of
                // more than one round)
                if let [(first, _)] = next.mixer.input_projection().runs.as_slice() {
                    let free = (cx.sm_count() as usize).saturating_sub(CL_BLOCKS);
                    let rows = cx.gemv_late_rows(first, free).filter(|_| cx.staged_of(first).is_none());
                    for (ptr, bytes) in rows.and_then(|r| first.row_regions(cx.stream(), r)).into_iter().flatten() {
                        e.push(Entry { ptr, bytes: bytes as u64, trigger: trigger + plan.landed as u64 });
                    }
                }
            }
        }
    }
    e
}

impl Follower {
    /// Uploads `plan`'s table for `model`; the progress and base words start at zero. `None`
    /// when the plan asks for nothing in this model (e.g. only the next layer's weights in a
    /// one-layer model).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a plan that [`FollowPlan::check`] rejects, or a table
    /// the kernel could not walk (triggers out of order or past the replay's bumps); driver
    /// errors.
    pub(crate) fn new(cx: &CudaContext, m: &CudaModel, plan: FollowPlan) -> Result<Option<Follower>, CudaError> {
        plan.check()?;
        let e = plan_entries(cx, m, &plan);
        if e.is_empty() {
            return Ok(None);
        }
        // the kernel walks the table in order and then waits for the replay's bumps
        // (landed ≤ CL_BLOCKS keeps layer i + 1's late rows before its own entries)
        let total = (m.layers.len() * plan.bumps_per_layer()) as u64;
        if !e.windows(2).all(|w| w[0].trigger <= w[1].trigger) || e.iter().any(|x| x.trigger > total) {
            return Err(CudaError::Unsupported(format!("L2 follower table for {plan:?}: triggers out of order or past the {total} bumps of a replay")));
        }
        let flat: Vec<u64> = e.iter().flat_map(|x| [x.ptr, x.bytes, x.trigger]).collect();
        let st = cx.stream();
        Ok(Some(Follower { plan, entries: st.clone_htod(&flat)?, n: e.len(), words: st.alloc_zeros::<u32>(1 + plan.blocks as usize)? }))
    }

    /// The plan this follower was built for.
    pub(crate) fn plan(&self) -> FollowPlan {
        self.plan
    }

    /// Device address of the progress word (for [`crate::L2Prefetch`]'s `progress`).
    pub(crate) fn progress(&self, cx: &CudaContext) -> u64 {
        self.words.device_ptr(cx.stream()).0
    }

    /// Zeroes the progress and base words (between replays only: before a capture).
    ///
    /// # Errors
    /// Driver errors.
    pub(crate) fn reset(&mut self, cx: &CudaContext) -> Result<(), CudaError> {
        cx.stream().memset_zeros(&mut self.words)?;
        Ok(())
    }

    /// The root kernel for a step whose chain bumps the progress word `total` times.
    ///
    /// # Errors
    /// Driver errors (setting the kernel's carve-out).
    pub(crate) fn root_kernel(&self, cx: &CudaContext, total: u32) -> Result<RootKernel, CudaError> {
        let f = cx.func("l2_follow")?;
        // the follower's blocks stay on their SMs for the whole step: they must not hold an SM
        // at a carve-out too small for the GEMV and MoE blocks that land beside them
        f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)?;
        let st = cx.stream();
        let words = self.words.device_ptr(st).0;
        const TIMEOUT_NS: u64 = 20_000_000;
        Ok(RootKernel {
            func: f.cu_function(),
            grid: self.plan.blocks,
            block: 32,
            args: vec![
                self.entries.device_ptr(st).0,
                self.n as u64,
                words,
                words + 4,
                total as u64,
                TIMEOUT_NS,
                if self.plan.evict_last { 1 } else { 0 },
            ],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse() {
        assert_eq!(FollowPlan::parse("out+out-next").unwrap(), FollowPlan::DEFAULT);
        assert_eq!(FollowPlan::parse("in").unwrap(), FollowPlan { parts: parts::IN_NEXT, ..FollowPlan::DEFAULT });
        assert_eq!(
            FollowPlan::parse("in+out-next:24:last").unwrap(),
            FollowPlan { blocks: 24, parts: parts::IN_NEXT | parts::OUT_NEXT, evict_last: true, ..FollowPlan::DEFAULT }
        );
        assert!(FollowPlan::parse("in+up").unwrap_err().contains("\"up\""));
        assert!(FollowPlan::parse("in:0").is_err());
        assert!(FollowPlan::parse("").is_err());
        let late = FollowPlan::parse("out+in-late:m48").unwrap();
        assert_eq!(late, FollowPlan { parts: parts::OUT_SAME | parts::IN_LATE, landed: 48, ..FollowPlan::DEFAULT });
        assert_eq!(late.bumps_per_layer(), 1 + CL_BLOCKS);
        assert_eq!(FollowPlan::DEFAULT.bumps_per_layer(), 1);
        assert_eq!(FollowPlan::parse("in-late").unwrap().landed, CL_BLOCKS as u32);
        assert!(FollowPlan::parse("in-late:m0").is_err());
        assert!(FollowPlan::parse(&format!("in-late:m{}", CL_BLOCKS + 1)).is_err());
        assert!(FollowPlan { landed: 0, ..FollowPlan::DEFAULT }.check().is_err());
    }

    #[test]
    fn default_plan_round_trips() {
        let p = FollowPlan::parse("in+out:24:last:ef").unwrap();
        assert!(p.experts_evict_first);
        assert_eq!(default_plan(), Some(FollowPlan::DEFAULT));
        set_default_plan(Some(p));
        assert_eq!(default_plan(), Some(p));
        let q = FollowPlan::parse("out+in-late:1024:m5").unwrap();
        set_default_plan(Some(q));
        assert_eq!(default_plan(), Some(q));
        set_default_plan(None);
        assert_eq!(default_plan(), None);
        set_default_plan(Some(FollowPlan::DEFAULT));
    }
}
