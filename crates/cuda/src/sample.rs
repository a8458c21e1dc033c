//! On-device sampling for the decode step (`kernels/sample.cu`): the token
//! [`sampler::Sampler::sample`] picks, bit for bit, computed on the GPU so that a captured decode
//! graph can sample instead of taking the argmax ([`CudaContext::argmax_step`]).
//!
//! [`CudaContext::sample_step`] keeps the contract of `argmax_step` (the token goes to
//! `ids[pos[0] + 1]` past the prompt, `pos[0]` advances) and adds the sampler's state, all in
//! device memory ([`SampleState`]): the parameters and the ChaCha20 key (written by
//! [`CudaContext::sample_reset`]), the position in the random stream (advanced by the kernels: one
//! `next_u64` per non-greedy token), and the per-token counts of the picked tokens, which the
//! repetition, presence and frequency penalties read (the kernels count each token they write, as
//! `Sampler::accept` would be told). No launch argument changes between steps, so the four
//! launches of a step replay from one graph; [`CudaContext::sample_reset`] (a copy into the state,
//! outside the graph) starts a new sequence or changes the parameters without a new capture.
//!
//! What is exact, and the one corner that is not, is documented at the top of
//! `kernels/sample.cu`; in short: every token equals the CPU's except with top-p over more than
//! 64 top-k candidates, where the nucleus may differ when its mass lies within ~1e-16 (relative)
//! of `top_p`.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use sampler::{Sampler, SamplingParams};

use crate::{CudaContext, CudaError};

/// Threads per block of `sample_prep`, `sample_weights` and `sample_select`.
const THREADS: usize = 512;
/// Most blocks of those three launches (`MAX_BLOCKS` in `kernels/sample.cu`).
const MAX_BLOCKS: usize = 256;
/// Rows per block the three launches aim for (4 per thread: 122 blocks for 248,320 rows).
const ROWS_PER_BLOCK: usize = 4 * THREADS;
/// Threads per block of `sample_draw` (8 warps, one draw block each).
const DRAW_THREADS: usize = 256;
/// Ids per block of the dense inverse-CDF draw (`DRAW_BLOCK` in `crates/sampler`).
const DRAW_BLOCK: usize = 1024;

/// Largest `top_k` the device sampler takes (a `top_k` of the row length or more is "off" and
/// always taken): the candidates above the k-th largest logit are sorted in one block's shared
/// memory (`TOPK_CAP` in `kernels/sample.cu`).
pub const SAMPLE_MAX_TOP_K: usize = 1024;

/// Most logits per row of the device sampler (2^24): its bucket sums of weight significands
/// (24 bits each) stay exact in a double (`kernels/sample.cu`, "Bit-exactness"), and every
/// index fits an `i32` with room for the grid arithmetic. The vocabulary is 248,320.
pub const SAMPLE_MAX_ROWS: usize = 1 << 24;

/// Words of a state's control block (`CTL_WORDS` in `kernels/sample.cu`): parameters, key, RNG
/// position, the values passed between the launches, tickets, per-block partials, histograms.
pub const SAMPLE_CTL_WORDS: usize = 5952;

// Control-block words written by the host (`C_*` in kernels/sample.cu).
const C_TEMP: usize = 0;
const C_TOP_P: usize = 1;
const C_MIN_P: usize = 2;
const C_PRES: usize = 3;
const C_FREQ: usize = 4;
const C_REP: usize = 5;
const C_TOP_K: usize = 6;
const C_KEY: usize = 8;
/// u64 (two words, low first): `next_u64` calls made so far.
const C_CALLS: usize = 16;

/// The kernel entry points, in launch order.
pub const SAMPLE_ENTRIES: [&str; 4] = ["sample_prep", "sample_weights", "sample_select", "sample_draw"];

/// The ChaCha20 key of `seed` as the eight little-endian words ChaCha20 reads: the bytes of
/// [`sampler::expand_seed`] (SplitMix64, the CPU sampler's key).
pub fn chacha_key(seed: u64) -> [u32; 8] {
    let bytes = sampler::expand_seed(seed);
    std::array::from_fn(|i| u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]))
}

/// One ChaCha20 block (Bernstein 2008; the 64-bit counter / 64-bit stream layout of
/// `rand_chacha`): `"expand 32-byte k"`, the key, `counter` in words 12-13, stream 0 in 14-15,
/// ten double rounds, plus the input. The host twin of `chacha_u64` in `kernels/sample.cu`.
pub fn chacha20_block(key: &[u32; 8], counter: u64) -> [u32; 16] {
    let mut s = [0u32; 16];
    s[..4].copy_from_slice(&[0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574]);
    s[4..12].copy_from_slice(key);
    s[12] = counter as u32;
    s[13] = (counter >> 32) as u32;
    let mut x = s;
    fn qr(x: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize) {
        x[a] = x[a].wrapping_add(x[b]);
        x[d] = (x[d] ^ x[a]).rotate_left(16);
        x[c] = x[c].wrapping_add(x[d]);
        x[b] = (x[b] ^ x[c]).rotate_left(12);
        x[a] = x[a].wrapping_add(x[b]);
        x[d] = (x[d] ^ x[a]).rotate_left(8);
        x[c] = x[c].wrapping_add(x[d]);
        x[b] = (x[b] ^ x[c]).rotate_left(7);
    }
    for _ in 0..10 {
        qr(&mut x, 0, 4, 8, 12);
        qr(&mut x, 1, 5, 9, 13);
        qr(&mut x, 2, 6, 10, 14);
        qr(&mut x, 3, 7, 11, 15);
        qr(&mut x, 0, 5, 10, 15);
        qr(&mut x, 1, 6, 11, 12);
        qr(&mut x, 2, 7, 8, 13);
        qr(&mut x, 3, 4, 9, 14);
    }
    for (o, i) in x.iter_mut().zip(s) {
        *o = o.wrapping_add(i);
    }
    x
}

/// The `call`-th (0-based) `next_u64` of `ChaCha20Rng::from_seed` with this key: keystream words
/// `2·call` (low half) and `2·call + 1` (high half), i.e. block `call / 8`.
pub fn chacha_u64(key: &[u32; 8], call: u64) -> u64 {
    let b = chacha20_block(key, call >> 3);
    let w = 2 * (call & 7) as usize;
    (u64::from(b[w + 1]) << 32) | u64::from(b[w])
}

/// The sampler state of one generation stream in device memory, for
/// [`CudaContext::sample_step`]: built by [`CudaContext::sample_state`] for a row length and a
/// `vocab_limit`, restarted by [`CudaContext::sample_reset`].
///
/// Buffers: the control block ([`SAMPLE_CTL_WORDS`] u32: parameters, ChaCha20 key, RNG position,
/// per-step values and scratch), `counts` (`[rows]` u32: how often each id was sampled past the
/// prompt), and per-step scratch: weights (`[rows]` f32), two id lists (`[rows]` u32), the
/// dense draw's block sums (`[ceil(rows / 1024)]` f64). About 4 MB for the production vocabulary.
pub struct SampleState {
    params: SamplingParams,
    seed: u64,
    rows: usize,
    vocab_limit: usize,
    ctl: CudaSlice<u32>,
    counts: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    list: CudaSlice<u32>,
    cand: CudaSlice<u32>,
    bsum: CudaSlice<f64>,
}

impl SampleState {
    /// The parameters in use (as given to the last reset).
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed in use: `params.seed`, or the one drawn from OS entropy at the last reset (as
    /// [`Sampler::seed`]).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Logits per row (the LM head's rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Ids `>= vocab_limit` are never sampled.
    pub fn vocab_limit(&self) -> usize {
        self.vocab_limit
    }

    /// `[rows]`: how often each id was sampled past the prompt since the last reset.
    pub fn counts(&self) -> &CudaSlice<u32> {
        &self.counts
    }
}

fn i32_of(what: &str, n: usize) -> Result<i32, CudaError> {
    i32::try_from(n).map_err(|_| CudaError::Unsupported(format!("{what}: {n} does not fit an i32")))
}

/// Checks `params` for the device sampler: [`SamplingParams::validate`], and `top_k` either off
/// (0 or `>= vocab_limit`) or at most [`SAMPLE_MAX_TOP_K`]. Returns the effective seed.
pub(crate) fn check_params(params: &SamplingParams, vocab_limit: usize) -> Result<u64, CudaError> {
    // Sampler::new validates and draws the seed from OS entropy when `params.seed` is None.
    let seed = Sampler::new(params.clone())
        .map_err(|e| CudaError::Unsupported(format!("sampling parameters: {e}")))?
        .seed();
    let k = params.top_k;
    if k > SAMPLE_MAX_TOP_K && k < vocab_limit {
        return Err(CudaError::Unsupported(format!(
            "sampling parameter `top_k` = {k}: the device sampler takes at most {SAMPLE_MAX_TOP_K} \
             (or 0 / >= vocab_limit {vocab_limit}, which turn it off)"
        )));
    }
    Ok(seed)
}

/// The host-written words of the control block; every other word zero.
fn ctl_image(params: &SamplingParams, seed: u64) -> Vec<u32> {
    let mut v = vec![0u32; SAMPLE_CTL_WORDS];
    v[C_TEMP] = params.temperature.to_bits();
    v[C_TOP_P] = params.top_p.to_bits();
    v[C_MIN_P] = params.min_p.to_bits();
    v[C_PRES] = params.presence_penalty.to_bits();
    v[C_FREQ] = params.frequency_penalty.to_bits();
    v[C_REP] = params.repetition_penalty.to_bits();
    v[C_TOP_K] = u32::try_from(params.top_k).unwrap_or(u32::MAX);
    v[C_KEY..C_KEY + 8].copy_from_slice(&chacha_key(seed));
    v[C_CALLS] = 0;
    v[C_CALLS + 1] = 0;
    v
}

/// Blocks of `sample_prep`, `sample_weights` and `sample_select` for `rows` logits.
fn main_blocks(rows: usize) -> usize {
    rows.div_ceil(ROWS_PER_BLOCK).clamp(1, MAX_BLOCKS)
}

/// Blocks of `sample_draw` for `vocab_limit` ids: one draw block of 1,024 ids per warp.
fn draw_blocks(vocab_limit: usize) -> usize {
    vocab_limit.div_ceil(DRAW_BLOCK).div_ceil(DRAW_THREADS / 32).max(1)
}

impl CudaContext {
    /// A device sampler state for rows of `rows` logits of which ids `< vocab_limit` may be
    /// sampled (for Qwen3.6: `spec::production::VOCAB` and `VOCAB_REAL`), reset for `params`
    /// (see [`Self::sample_reset`]).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `rows` is 0 or above [`SAMPLE_MAX_ROWS`], `vocab_limit >
    /// rows`, or `params` is rejected (see [`Self::sample_reset`]); driver errors from the
    /// allocations.
    pub fn sample_state(&self, rows: usize, vocab_limit: usize, params: &SamplingParams) -> Result<SampleState, CudaError> {
        if rows == 0 || vocab_limit > rows {
            return Err(CudaError::Unsupported(format!(
                "sample_state: vocab_limit {vocab_limit} of {rows} rows"
            )));
        }
        if rows > SAMPLE_MAX_ROWS {
            return Err(CudaError::Unsupported(format!(
                "sample_state: {rows} rows; the device sampler's exact integer sums hold up to {SAMPLE_MAX_ROWS}"
            )));
        }
        i32_of("sample_state rows", rows)?;
        let seed = check_params(params, vocab_limit)?;
        let st = self.stream();
        let mut state = SampleState {
            params: params.clone(),
            seed,
            rows,
            vocab_limit,
            ctl: st.alloc_zeros::<u32>(SAMPLE_CTL_WORDS)?,
            counts: st.alloc_zeros::<u32>(rows)?,
            weights: st.alloc_zeros::<f32>(rows)?,
            list: st.alloc_zeros::<u32>(rows)?,
            cand: st.alloc_zeros::<u32>(rows)?,
            bsum: st.alloc_zeros::<f64>(rows.div_ceil(DRAW_BLOCK))?,
        };
        self.sample_reset(&mut state, params)?;
        Ok(state)
    }

    /// Starts a new sequence with `params`, as `Sampler::new(params)` does: the counts of the
    /// sampled tokens are zeroed and the ChaCha20 stream restarts from `params.seed` (or from a
    /// fresh OS-entropy seed when it is `None`, readable with [`SampleState::seed`]). Copies on
    /// [`Self::stream`] (ordered after the steps queued before it); call it outside a graph
    /// capture. Graphs captured with this state stay valid.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] naming the field when [`SamplingParams::validate`] fails, or
    /// when `top_k` lies in `(`[`SAMPLE_MAX_TOP_K`]`, vocab_limit)`; driver errors from the copies.
    pub fn sample_reset(&self, state: &mut SampleState, params: &SamplingParams) -> Result<(), CudaError> {
        let seed = check_params(params, state.vocab_limit)?;
        let st = self.stream();
        st.memcpy_htod(&ctl_image(params, seed), &mut state.ctl)?;
        st.memset_zeros(&mut state.counts)?;
        state.params = params.clone();
        state.seed = seed;
        Ok(())
    }

    /// The sampling pick at the end of a decode step, in place of [`Self::argmax_step`], with
    /// its contract: with `q = pos[0] + 1`, when `q >= n_fixed[0]` (past the prompt) and
    /// `q < ids.len()` (inside the history), the token `t` that
    /// `Sampler::sample(&mut row, state.vocab_limit())` returns is written to `ids[q]` and
    /// counted (`counts[t] += 1`, as `Sampler::accept(t)`); `pos[0] = q` in every case. At a
    /// prompt position nothing else happens: no penalty, no random number.
    ///
    /// `logits`: `[state.rows()]` f32, the LM head's row; like the CPU sampler, the step leaves
    /// the penalised logits in it (ids `>= vocab_limit` set to `-inf`). `n_fixed`, `pos`: `[1]`.
    /// Four launches on [`Self::stream`] (`kernels/sample.cu`), graph-capturable, PDL-safe; one
    /// step at a time per state (the state holds the step's scratch).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `logits` is not `state.rows()` long, `n_fixed` or `pos` is
    /// empty, or a length does not fit an `i32`; driver errors from the launches.
    pub fn sample_step(
        &self,
        logits: &mut CudaViewMut<'_, f32>,
        ids: &mut CudaViewMut<'_, i32>,
        n_fixed: &CudaView<'_, i32>,
        pos: &mut CudaViewMut<'_, i32>,
        state: &mut SampleState,
    ) -> Result<(), CudaError> {
        if logits.len() != state.rows || n_fixed.is_empty() || pos.is_empty() {
            return Err(CudaError::Unsupported(format!(
                "sample_step: {} logits for a state of {} rows, n_fixed {}, pos {}",
                logits.len(),
                state.rows,
                n_fixed.len(),
                pos.len()
            )));
        }
        let rows = i32_of("sample_step rows", state.rows)?;
        let n = i32_of("sample_step vocab_limit", state.vocab_limit)?;
        let max_ctx = i32_of("sample_step ids", ids.len())?;
        let st = self.stream();
        let (p_logits, _g0) = logits.device_ptr_mut(st);
        let (p_ids, _g1) = ids.device_ptr_mut(st);
        let (p_nfixed, _g2) = n_fixed.device_ptr(st);
        let (p_pos, _g3) = pos.device_ptr_mut(st);
        let (p_ctl, _g4) = state.ctl.device_ptr_mut(st);
        let (p_counts, _g5) = state.counts.device_ptr_mut(st);
        let (p_weights, _g6) = state.weights.device_ptr_mut(st);
        let (p_list, _g7) = state.list.device_ptr_mut(st);
        let (p_cand, _g8) = state.cand.device_ptr_mut(st);
        let (p_bsum, _g9) = state.bsum.device_ptr_mut(st);
        let blocks = main_blocks(state.rows) as u32;
        let draw = draw_blocks(state.vocab_limit) as u32;
        for (entry, grid, threads) in [
            (SAMPLE_ENTRIES[0], blocks, THREADS),
            (SAMPLE_ENTRIES[1], blocks, THREADS),
            (SAMPLE_ENTRIES[2], blocks, THREADS),
            (SAMPLE_ENTRIES[3], draw, DRAW_THREADS),
        ] {
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (threads as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = st.launch_builder(self.func(entry)?);
            b.arg(&p_logits)
                .arg(&rows)
                .arg(&n)
                .arg(&p_ids)
                .arg(&max_ctx)
                .arg(&p_nfixed)
                .arg(&p_pos)
                .arg(&p_ctl)
                .arg(&p_counts)
                .arg(&p_weights)
                .arg(&p_list)
                .arg(&p_cand)
                .arg(&p_bsum);
            // SAFETY: the arguments match CS_ARGS in kernels/sample.cu (device pointers as u64,
            // ints as i32); every buffer has the length documented there (checked above or
            // allocated by sample_state for `rows`); the first three launches use the same grid,
            // as the kernels' id partition requires; ids and pos are bounds-checked on the device.
            unsafe { b.launch(cfg) }?;
        }
        Ok(())
    }

    /// `next_u64` calls the state's ChaCha20 stream has made so far (one per non-greedy token
    /// sampled past the prompt). Waits for the stream.
    ///
    /// # Errors
    /// Driver errors from the copy.
    pub fn sample_rng_position(&self, state: &SampleState) -> Result<u64, CudaError> {
        let ctl: Vec<u32> = self.stream().clone_dtoh(&state.ctl.slice(C_CALLS..C_CALLS + 2))?;
        Ok(u64::from(ctl[0]) | (u64::from(ctl[1]) << 32))
    }
}

#[cfg(test)]
#[path = "sample_emu.rs"]
mod emu;

/// Test data shared by the unit tests here (against the host emulation) and the GPU self-test
/// section `sample`: seeded rows of logits of twelve kinds and the parameter sets they run with.
#[doc(hidden)]
pub mod testing {
    use sampler::SamplingParams;

    /// SplitMix64 stream (`sampler::splitmix64`) for the test rows.
    pub struct Rng(pub u64);
    impl Rng {
        /// The next 64 bits.
        pub fn next_u64(&mut self) -> u64 {
            sampler::splitmix64(&mut self.0)
        }
        /// Uniform in [0, 1) (24 bits).
        pub fn f(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
        }
        /// Roughly normal (sum of four uniforms), standard deviation ~`sd`.
        pub fn normal(&mut self, sd: f32) -> f32 {
            (self.f() + self.f() + self.f() + self.f() - 2.0) * 1.73 * sd
        }
        /// Uniform in `0..n` (`n > 0`).
        pub fn below(&mut self, n: usize) -> usize {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// A row of `kind` (the kinds of the match below; the self-test section `sample` lists
    /// them) for call `call`: `rows` logits, ids `< n` the sampled range.
    pub fn test_row(kind: usize, rows: usize, n: usize, call: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng(seed ^ (call as u64).wrapping_mul(0x1234_5678_9ABC_DEF1) ^ ((kind as u64) << 56));
        let mut row: Vec<f32> = (0..rows).map(|_| r.normal(2.0)).collect();
        let n = n.max(1);
        // a few likely tokens, the same ids in every call, so that the penalties see repeats
        for j in 0..8 {
            row[(j * 7919 + 3) % n] = 8.0 + r.f() * 2.0 + j as f32 * 0.1;
        }
        match kind % 12 {
            0 | 1 => {}
            2 => {
                for j in 0..15 {
                    row[(j * 131 + 17) % n] = 12.0 - j as f32 * 0.25;
                }
                for j in 0..30 {
                    row[(j * 577 + 5) % n] = 8.25;
                }
            }
            3 => {
                for j in 0..200 {
                    row[(j * 97 + 11) % n] = 14.0;
                }
            }
            4 => {
                for x in row.iter_mut().step_by(7) {
                    *x = f32::NAN;
                }
            }
            5 => {
                row[r.below(n)] = f32::INFINITY;
                row[r.below(n)] = f32::INFINITY;
            }
            6 => row.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
            7 => row.iter_mut().for_each(|x| *x = f32::NAN),
            8 => {
                row.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
                row[..5].iter_mut().for_each(|x| *x = f32::NAN);
            }
            9 => row.iter_mut().for_each(|x| *x = 0.5),
            10 => {
                for x in row[n.min(rows)..].iter_mut() {
                    *x = 1e30;
                }
                for x in row.iter_mut().take(n).step_by(3) {
                    *x *= 12.0;
                }
            }
            _ => {
                for x in row.iter_mut() {
                    *x = -1.0 - x.abs();
                }
                for j in 0..40 {
                    row[(j * 613 + 1) % n] = if j % 2 == 0 { 0.0 } else { -0.0 };
                }
                for j in 0..10 {
                    row[(j * 211 + 2) % n] = (j + 1) as f32 * 1e-3;
                }
            }
        }
        row
    }

    /// The parameter sets of the self-test and the emulation tests, with their labels.
    pub fn param_sets() -> Vec<(&'static str, SamplingParams)> {
        let d = SamplingParams::default;
        let t = |temperature| SamplingParams { temperature, ..d() };
        vec![
            ("greedy", SamplingParams::greedy()),
            (
                "greedy + penalties",
                SamplingParams { repetition_penalty: 1.3, presence_penalty: 0.5, frequency_penalty: 0.7, ..SamplingParams::greedy() },
            ),
            ("t 0.6", t(0.6)),
            ("t 1.0", t(1.0)),
            ("t 1.5", t(1.5)),
            ("t 1e-40", t(1e-40)),
            ("top_k 1", SamplingParams { top_k: 1, ..d() }),
            ("top_k 20", SamplingParams { top_k: 20, ..d() }),
            ("top_k 50", SamplingParams { top_k: 50, ..d() }),
            ("top_p 0.8", SamplingParams { top_p: 0.8, ..d() }),
            ("top_p 0.95", SamplingParams { top_p: 0.95, ..d() }),
            ("min_p 0.05", SamplingParams { min_p: 0.05, ..d() }),
            ("qwen t0.6 k20 p0.95", SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..d() }),
            ("qwen t0.7 k20 p0.8", SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.8, ..d() }),
            ("qwen t1.0 k20 p0.95", SamplingParams { temperature: 1.0, top_k: 20, top_p: 0.95, ..d() }),
            ("t0.7 p0.8 min_p 0.1", SamplingParams { temperature: 0.7, top_p: 0.8, min_p: 0.1, ..d() }),
            ("k50 p0.9 min_p 0.02", SamplingParams { top_k: 50, top_p: 0.9, min_p: 0.02, ..d() }),
            (
                "penalties t0.8 k40 p0.9",
                SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.9,
                    repetition_penalty: 1.2,
                    presence_penalty: 0.4,
                    frequency_penalty: 0.3,
                    ..d()
                },
            ),
            (
                "penalties t1 p0.9",
                SamplingParams { repetition_penalty: 0.8, presence_penalty: -0.5, frequency_penalty: 1.5, top_p: 0.9, ..d() },
            ),
            ("k200 t3 p0.9", SamplingParams { top_k: 200, top_p: 0.9, temperature: 3.0, ..d() }),
            ("k1024 t2", SamplingParams { top_k: 1024, temperature: 2.0, ..d() }),
            ("k60 t0.25 p0.999", SamplingParams { top_k: 60, temperature: 0.25, top_p: 0.999, ..d() }),
            ("k500 t0.3 p0.99", SamplingParams { top_k: 500, temperature: 0.3, top_p: 0.99, ..d() }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{param_sets, test_row};
    use super::*;
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    use rand_chacha::ChaCha20Rng;

    fn key_bytes(key: &[u32; 8]) -> [u8; 32] {
        let mut b = [0u8; 32];
        for (c, w) in b.chunks_exact_mut(4).zip(key) {
            c.copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    #[test]
    fn chacha_matches_rand_chacha() {
        for seed in [0u64, 1, 7, 0xDEAD_BEEF, u64::MAX] {
            let key = chacha_key(seed);
            let mut rng = ChaCha20Rng::from_seed(key_bytes(&key));
            // 300 calls cross rand_chacha's 4-block buffer several times
            for call in 0..300u64 {
                assert_eq!(chacha_u64(&key, call), rng.next_u64(), "seed {seed} call {call}");
            }
        }
        // far into the stream: a block counter above 2^32
        let key = chacha_key(42);
        let mut rng = ChaCha20Rng::from_seed(key_bytes(&key));
        let call = (5u64 << 32) * 8 + 3;
        rng.set_word_pos(u128::from(call) * 2);
        assert_eq!(chacha_u64(&key, call), rng.next_u64());
    }

    #[test]
    fn rfc8439_block_function() {
        // RFC 8439 appendix A.1, test vector #1: all-zero key and nonce, block counter 0 (its
        // 32-bit counter and 96-bit nonce coincide with the 64/64 layout when both are zero)
        let b = chacha20_block(&[0; 8], 0);
        assert_eq!(&b[..4], &[0xade0_b876, 0x903d_f1a0, 0xe56a_5d40, 0x28bd_8653]);
    }

    /// The device sampler's seed expansion, RNG position and `unit_f64` against the CPU sampler:
    /// on a row of 2^16 equal logits the draw is `floor(u · 2^16)` (every weight is 1, every sum
    /// exact), which exposes the top 16 bits of each `next_u64`.
    #[test]
    fn stream_matches_cpu_sampler() {
        let n = 1usize << 16;
        for seed in [3u64, 99] {
            let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..Default::default() }).unwrap();
            let key = chacha_key(seed);
            for call in 0..64u64 {
                let mut row = vec![0.5f32; n];
                let t = s.sample(&mut row, n);
                let u = (chacha_u64(&key, call) >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
                assert_eq!(t as usize, (u * n as f64) as usize, "seed {seed} call {call}");
            }
        }
    }

    /// The constants and layout that `kernels/sample.cu` spells itself.
    #[test]
    fn kernel_source_agrees() {
        let src = crate::KERNELS.iter().find(|k| k.name == "sample").expect("sample kernel").src;
        assert!(src.contains(&format!("static_assert(CTL_WORDS == {SAMPLE_CTL_WORDS}")));
        for (name, v) in [
            ("C_TEMP", C_TEMP),
            ("C_TOP_P", C_TOP_P),
            ("C_MIN_P", C_MIN_P),
            ("C_PRES", C_PRES),
            ("C_FREQ", C_FREQ),
            ("C_REP", C_REP),
            ("C_TOP_K", C_TOP_K),
        ] {
            assert!(src.contains(&format!("{name} = {v},")) || src.contains(&format!("{name} = {v};")), "{name}");
        }
        assert!(src.contains(&format!("C_KEY = {C_KEY};")));
        assert!(src.contains(&format!("C_CALLS = {C_CALLS};")));
        assert!(src.contains(&format!("THREADS = {THREADS};")));
        assert!(src.contains(&format!("DRAW_THREADS = {DRAW_THREADS};")));
        assert!(src.contains(&format!("MAX_BLOCKS = {MAX_BLOCKS};")));
        assert!(src.contains(&format!("DRAW_BLOCK = {DRAW_BLOCK};")));
        assert!(src.contains(&format!("TOPK_CAP = {SAMPLE_MAX_TOP_K};")));
        // sampler::math::exp_neg's constants, as bit patterns
        for (what, v) in [
            ("LOG2E", std::f32::consts::LOG2_E),
            ("LN2_HI", 355.0 / 512.0),
            ("LN2_LO", -2.121_944_4e-4),
            ("P0", 1.987_569_1e-4),
            ("P1", 1.398_199_9e-3),
            ("P2", 8.333_452e-3),
            ("P3", 4.166_579_6e-2),
            ("P4", 1.666_666_6e-1),
            ("P5", 0.5),
            ("ROUND", 12_582_912.0),
        ] {
            let line = format!("const float {what} = __uint_as_float(0x{:08x}u);", f32::to_bits(v));
            assert!(src.contains(&line), "{line}");
        }
        let k = crate::KERNELS.iter().find(|k| k.name == "sample").unwrap();
        assert_eq!(k.entries, &SAMPLE_ENTRIES[..]);
    }

    #[test]
    fn launch_geometry() {
        let rows = spec::production::VOCAB;
        let g = main_blocks(rows);
        assert_eq!(g, 122);
        // the kernels' partition (chunk_len) covers every row, each block a multiple of THREADS
        let per = rows.div_ceil(g).div_ceil(THREADS) * THREADS;
        assert!(per * g >= rows && per * (g - 1) < rows);
        assert_eq!(draw_blocks(spec::production::VOCAB_REAL), 31); // 243 draw blocks, 8 a block
        assert_eq!(main_blocks(1), 1);
        assert_eq!(draw_blocks(0), 1);
        assert_eq!(main_blocks(usize::MAX / 2), MAX_BLOCKS);
    }

    #[test]
    fn params_are_checked() {
        let bad = SamplingParams { top_p: 0.0, ..Default::default() };
        let e = check_params(&bad, 1000).unwrap_err().to_string();
        assert!(e.contains("top_p"), "{e}");
        let big_k = SamplingParams { top_k: 5000, ..Default::default() };
        assert!(check_params(&big_k, 248_077).is_err());
        assert!(check_params(&big_k, 5000).is_ok(), "top_k >= vocab_limit is off");
        let ok = SamplingParams { top_k: 1024, seed: Some(5), ..Default::default() };
        assert_eq!(check_params(&ok, 248_077).unwrap(), 5);
        let img = ctl_image(&ok, 5);
        assert_eq!(img.len(), SAMPLE_CTL_WORDS);
        assert_eq!(img[C_TOP_K], 1024);
        assert_eq!(f32::from_bits(img[C_TEMP]), 1.0);
        assert_eq!(&img[C_KEY..C_KEY + 8], &chacha_key(5));
    }

    /// The emulation of the kernels against `sampler::Sampler`: 64 consecutive calls per
    /// parameter set over every kind of row (the same seed; the CPU sampler told about the
    /// tokens it picked), tokens and penalised logits equal.
    #[test]
    fn emulation_matches_cpu_sampler() {
        let (rows, n) = (20_100usize, 20_000usize);
        let mut mismatches = Vec::new();
        for (si, (label, p)) in param_sets().into_iter().enumerate() {
            let p = SamplingParams { seed: Some(1000 + si as u64), ..p };
            let mut cpu = Sampler::new(p.clone()).unwrap();
            let mut dev = emu::Emu::new(p.clone(), rows);
            for call in 0..64usize {
                let row = test_row(call % 12 + 12 * (call / 48), rows, n, call, si as u64);
                let (mut a, mut b) = (row.clone(), row);
                let t_cpu = cpu.sample(&mut a, n);
                cpu.accept(t_cpu);
                let t_dev = dev.step(&mut b, n);
                let same_logits = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                if t_cpu != t_dev || !same_logits {
                    mismatches.push(format!("{label} call {call}: cpu {t_cpu} device {t_dev} logits equal {same_logits}"));
                }
            }
            let want_calls = if p.temperature == 0.0 { 0 } else { 64 };
            assert_eq!(dev.calls, want_calls, "{label}: RNG position");
        }
        assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    }

    /// The same at the production size (fewer calls: the CPU sampler takes ~1 ms a call).
    #[test]
    fn emulation_matches_cpu_sampler_production_size() {
        let (rows, n) = (spec::production::VOCAB, spec::production::VOCAB_REAL);
        for (si, (label, p)) in param_sets().into_iter().enumerate().step_by(2) {
            let p = SamplingParams { seed: Some(77 + si as u64), ..p };
            let mut cpu = Sampler::new(p.clone()).unwrap();
            let mut dev = emu::Emu::new(p.clone(), rows);
            for call in 0..12usize {
                let row = test_row(call, rows, n, call, 500 + si as u64);
                let (mut a, mut b) = (row.clone(), row);
                let t_cpu = cpu.sample(&mut a, n);
                cpu.accept(t_cpu);
                assert_eq!(t_cpu, dev.step(&mut b, n), "{label} call {call}");
            }
        }
    }
}
