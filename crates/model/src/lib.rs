//! The Qwen3.6-35B-A3B text model: weights bound from a Hugging Face snapshot, per-sequence
//! state, and the forward pass written once, in the order of the reference
//! (transformers `Qwen3_5MoeForCausalLM`; docs/MODEL.md §3).
//!
//! f32 compute over weights upcast exactly from BF16/F16/F32 (or MLX-quantized), loops from
//! [`reference`]; with [`Backend::Fast`] / [`Backend::FastQ8`] the matrix products run the SIMD
//! kernels of `quant::fast` (products that read the same input in one batch,
//! [`linear::forward_batch`]) and the Gated DeltaNet and attention loops their bit-exact fast
//! twins (`fast.rs`). Prefill runs the chunked Gated DeltaNet (chunk 64) and decode the
//! recurrent step, as the reference does; both give the same numbers to f32 round-off.

mod fast;
pub mod linear;
pub mod load;
pub mod reference;
mod state;
pub mod synth;

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use spec::TextConfig;

pub use linear::Backend;
use linear::{forward_batch, LinJob};
pub use load::{open_dir, Layout, Weights};
pub use state::{LayerState, State};

use load::{AttnWeights, Expert, GdnWeights, Mixer, MoeWeights};
use reference as r;

/// Chunk length of the chunked Gated DeltaNet prefill (as in transformers and FLA).
pub const GDN_CHUNK: usize = spec::production::GDN_CHUNK;

/// Why a model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model path is not a folder.
    #[error("model path {0} is not a folder (expected a Hugging Face snapshot folder with config.json and *.safetensors)")]
    NotADir(PathBuf),
    /// `config.json` is invalid.
    #[error(transparent)]
    Config(#[from] spec::ConfigError),
    /// A weight file or tensor is unusable.
    #[error(transparent)]
    Load(#[from] weights::LoadError),
    /// The checkpoint disagrees with a config field.
    #[error("config field `{field}` does not match the checkpoint: {reason}")]
    Mismatch {
        /// The config field (JSON path).
        field: String,
        /// What disagrees.
        reason: String,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    BadToken {
        /// The id.
        id: u32,
        /// Vocabulary rows.
        vocab: usize,
    },
    /// The sequence would exceed the context limit.
    #[error("sequence of {needed} tokens exceeds the context limit of {limit} tokens")]
    ContextFull {
        /// Tokens the call needs in total.
        needed: usize,
        /// The limit.
        limit: usize,
    },
    /// An empty token list was given to a forward pass.
    #[error("no tokens to process")]
    Empty,
}

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// One row per input position: [T, vocab].
    All,
    /// Only the last position: [vocab].
    Last,
    /// None (prefill of a prefix whose continuation follows).
    None,
}

/// Receives named intermediates (`blk.{l}.mixer_out`, ...), [T, width] row-major, when tracing.
pub type Tracer<'a> = &'a mut dyn FnMut(&str, &[f32]);

/// A loaded model.
pub struct Model {
    /// The validated config.
    pub cfg: TextConfig,
    /// Bound weights (views into the memory-mapped checkpoint).
    pub weights: Weights,
    /// Which kernels run the matrix products.
    pub backend: Backend,
    /// Compact vocabulary (`calla_vocab.json`), when the snapshot has one: logit rows that
    /// stand for no token are returned as −∞.
    pub vocab_map: Option<spec::VocabMap>,
    inv_freq: Vec<f32>,
}

impl Model {
    /// Loads a Hugging Face snapshot folder.
    ///
    /// # Errors
    /// [`ModelError`] naming the file, tensor or config field at fault.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let (cfg, weights) = open_dir(dir)?;
        let mut m = Self::new(cfg, weights);
        m.vocab_map = spec::VocabMap::from_dir(dir)?;
        if let Some(map) = &m.vocab_map {
            if map.rows() != m.cfg.vocab_size {
                return Err(ModelError::Mismatch {
                    field: "vocab_size".into(),
                    reason: format!("config says {} rows but {} lists {}", m.cfg.vocab_size, spec::VOCAB_MAP_FILE, map.rows()),
                });
            }
        }
        Ok(m)
    }

    /// A model from bound weights.
    pub fn new(cfg: TextConfig, weights: Weights) -> Self {
        let inv_freq = r::rope_inv_freq(cfg.rope_theta, cfg.rotary_dim());
        Model { cfg, weights, backend: Backend::default(), vocab_map: None, inv_freq }
    }

    /// A fresh per-sequence state (empty KV cache, zero GDN state) with a context limit in
    /// tokens (clamped to the config's `max_position_embeddings`).
    pub fn new_state(&self, max_ctx_tokens: usize) -> State {
        State::new(&self.cfg, max_ctx_tokens.min(self.cfg.max_position_embeddings))
    }

    /// Runs `tokens` on top of `state` (prefill when several, decode when one) and returns the
    /// requested logits in f32: [T, vocab] for [`Logits::All`], [vocab] for [`Logits::Last`].
    ///
    /// # Errors
    /// [`ModelError::Empty`], [`ModelError::BadToken`], [`ModelError::ContextFull`]; the state
    /// is unchanged on error.
    pub fn forward(&self, state: &mut State, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, ModelError> {
        self.forward_traced(state, tokens, logits, None)
    }

    /// [`Model::forward`] with an optional tracer for named intermediates.
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn forward_traced(
        &self,
        state: &mut State,
        tokens: &[u32],
        logits: Logits,
        mut trace: Option<Tracer<'_>>,
    ) -> Result<Vec<f32>, ModelError> {
        let cfg = &self.cfg;
        let (t, d) = (tokens.len(), cfg.hidden_size);
        if t == 0 {
            return Err(ModelError::Empty);
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= cfg.vocab_size) {
            return Err(ModelError::BadToken { id, vocab: cfg.vocab_size });
        }
        if state.pos + t > state.max_ctx {
            return Err(ModelError::ContextFull { needed: state.pos + t, limit: state.max_ctx });
        }
        let mut emit = |name: String, x: &[f32]| {
            if let Some(tr) = trace.as_mut() {
                tr(&name, x)
            }
        };
        // x: [T, d] residual stream.
        let mut x = vec![0.0f32; t * d];
        for (row, &id) in x.chunks_exact_mut(d).zip(tokens) {
            self.weights.embed.row_f32(id as usize, row);
        }
        emit("embed".into(), &x);
        let mut u = vec![0.0f32; t * d];
        for (l, lw) in self.weights.layers.iter().enumerate() {
            par_rows(&mut u, &x, d, |o, i| r::zrms_norm(o, i, &lw.input_norm, cfg.rms_norm_eps));
            let m = match (&lw.mixer, &mut state.layers[l]) {
                (Mixer::Gdn(w), LayerState::Gdn { conv, s }) => self.gdn(w, conv, s, &u, t),
                (Mixer::Attn(w), LayerState::Attn { k, v }) => self.attention(w, k, v, &u, t, state.pos),
                _ => unreachable!("state built from the same config"),
            };
            emit(format!("blk.{l}.mixer_out"), &m);
            par_rows(&mut x, &m, d, |a, b| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
            par_rows(&mut u, &x, d, |o, i| r::zrms_norm(o, i, &lw.post_norm, cfg.rms_norm_eps));
            let moe = self.moe(&lw.moe, &u, t, l, &mut emit);
            emit(format!("blk.{l}.moe_out"), &moe);
            par_rows(&mut x, &moe, d, |a, b| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
            emit(format!("blk.{l}.out"), &x);
        }
        state.pos += t;
        let rows: &[f32] = match logits {
            Logits::None => return Ok(Vec::new()),
            Logits::All => &x,
            Logits::Last => &x[(t - 1) * d..],
        };
        let n = rows.len() / d;
        let mut h = vec![0.0f32; n * d];
        r::zrms_norm(&mut h, rows, &self.weights.final_norm, cfg.rms_norm_eps);
        emit("final_norm".into(), &h);
        let mut out = vec![0.0f32; n * cfg.vocab_size];
        self.weights.lm_head.forward(&mut out, &h, n, self.backend);
        if let Some(map) = &self.vocab_map {
            for row in out.chunks_exact_mut(cfg.vocab_size) {
                for (r, x) in row.iter_mut().enumerate() {
                    if map.id(r as u32).is_none() {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Ok(out)
    }

    /// Gated DeltaNet mixer over `t` tokens (MODEL.md §3.5). `conv`: [k-1, conv_dim] cached
    /// pre-conv inputs, oldest first; `s`: [n_v, d_k, d_v] recurrent state. Returns [t, d].
    fn gdn(&self, w: &GdnWeights, conv: &mut Vec<f32>, s: &mut [f32], u: &[f32], t: usize) -> Vec<f32> {
        let cfg = &self.cfg;
        let (nk, nv, dk, dv, kk) = (
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
        );
        let (key_dim, conv_dim) = (nk * dk, cfg.gdn_conv_dim());
        let mut qkv = vec![0.0f32; t * conv_dim];
        let mut z = vec![0.0f32; t * nv * dv];
        let mut b = vec![0.0f32; t * nv];
        let mut a = vec![0.0f32; t * nv];
        forward_batch(
            &mut [
                LinJob { w: &w.in_proj_qkv, x: u, t, out: &mut qkv },
                LinJob { w: &w.in_proj_z, x: u, t, out: &mut z },
                LinJob { w: &w.in_proj_b, x: u, t, out: &mut b },
                LinJob { w: &w.in_proj_a, x: u, t, out: &mut a },
            ],
            self.backend,
        );

        // Causal conv over [cached k-1 rows ‖ new rows]; the last k-1 rows become the cache.
        let mut window = std::mem::take(conv);
        window.extend_from_slice(&qkv);
        let mut mixed = vec![0.0f32; t * conv_dim];
        // Tokens [a, b) read window rows [a, b + k - 1): chunks of tokens run in parallel.
        let rows_per = PAR_ROWS;
        let conv_rows = |(ci, out): (usize, &mut [f32])| {
            let a = ci * rows_per;
            let n = out.len() / conv_dim;
            r::causal_conv_silu(out, &window[a * conv_dim..(a + n + kk - 1) * conv_dim], &w.conv1d, conv_dim, kk);
        };
        if t > rows_per {
            mixed.par_chunks_mut(rows_per * conv_dim).enumerate().for_each(conv_rows);
        } else {
            conv_rows((0, &mut mixed));
        }
        *conv = window[t * conv_dim..].to_vec();

        // Split into q [t, nk, dk], k [t, nk, dk], v [t, nv, dv]; L2-normalise q, k; scale q.
        let mut q = Vec::with_capacity(t * key_dim);
        let mut k = Vec::with_capacity(t * key_dim);
        let mut v = Vec::with_capacity(t * nv * dv);
        for row in mixed.chunks_exact(conv_dim) {
            q.extend_from_slice(&row[..key_dim]);
            k.extend_from_slice(&row[key_dim..2 * key_dim]);
            v.extend_from_slice(&row[2 * key_dim..]);
        }
        let q_scale = 1.0 / (dk as f32).sqrt();
        par_rows(&mut q, &[], dk, |x, _| {
            r::l2norm_inplace(x, dk, 1e-6);
            x.iter_mut().for_each(|x| *x *= q_scale);
        });
        par_rows(&mut k, &[], dk, |x, _| r::l2norm_inplace(x, dk, 1e-6));
        // Gates per token and value head: g = -exp(A_log)·softplus(a + dt_bias), β = σ(b).
        let g: Vec<f32> = (0..t * nv).map(|i| w.a_neg_exp[i % nv] * r::softplus(a[i] + w.dt_bias[i % nv])).collect();
        let beta: Vec<f32> = b.iter().map(|&x| r::sigmoid(x)).collect();

        // Value head j reads key head j / (nv / nk) (consecutive grouping).
        let ratio = nv / nk;
        let mut o = vec![0.0f32; t * nv * dv];
        let mut o_heads = vec![0.0f32; nv * t * dv]; // [nv, t, dv]
        s.par_chunks_mut(dk * dv).zip(o_heads.par_chunks_mut(t * dv)).enumerate().for_each(|(j, (sj, oj))| {
            let hk = j / ratio;
            let gather = |src: &[f32], width: usize, heads: usize, h: usize, t0: usize, n: usize| -> Vec<f32> {
                (t0..t0 + n).flat_map(|tt| src[(tt * heads + h) * width..(tt * heads + h + 1) * width].iter().copied()).collect()
            };
            if t == 1 {
                let step = if self.backend == Backend::Reference { r::gdn_step } else { fast::gdn_step };
                step(sj, &q[hk * dk..(hk + 1) * dk], &k[hk * dk..(hk + 1) * dk], &v[j * dv..(j + 1) * dv], g[j].exp(), beta[j], oj);
            } else {
                let mut t0 = 0;
                while t0 < t {
                    let n = GDN_CHUNK.min(t - t0);
                    let qc = gather(&q, dk, nk, hk, t0, n);
                    let kc = gather(&k, dk, nk, hk, t0, n);
                    let vc = gather(&v, dv, nv, j, t0, n);
                    let gc = gather(&g, 1, nv, j, t0, n);
                    let bc = gather(&beta, 1, nv, j, t0, n);
                    let oc = &mut oj[t0 * dv..(t0 + n) * dv];
                    if self.backend == Backend::Reference {
                        r::gdn_chunk(sj, &qc, &kc, &vc, &gc, &bc, dk, dv, oc);
                    } else {
                        fast::gdn_chunk(sj, &qc, &kc, &vc, &gc, &bc, dk, dv, oc);
                    }
                    t0 += n;
                }
            }
        });
        for j in 0..nv {
            for tt in 0..t {
                o[(tt * nv + j) * dv..(tt * nv + j + 1) * dv].copy_from_slice(&o_heads[(j * t + tt) * dv..(j * t + tt + 1) * dv]);
            }
        }
        par_rows(&mut o, &z, dv, |o, z| r::gated_rms_norm(o, z, &w.norm, cfg.rms_norm_eps));
        let mut out = vec![0.0f32; t * cfg.hidden_size];
        w.out_proj.forward(&mut out, &o, t, self.backend);
        out
    }

    /// Gated full attention over `t` tokens at positions `pos..pos+t` (MODEL.md §3.6).
    /// `kc`, `vc`: [pos, n_kv, head_dim] caches, extended here. Returns [t, d].
    fn attention(&self, w: &AttnWeights, kc: &mut Vec<f32>, vc: &mut Vec<f32>, u: &[f32], t: usize, pos: usize) -> Vec<f32> {
        let cfg = &self.cfg;
        let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let mut qg = vec![0.0f32; t * nq * 2 * hd];
        let mut k = vec![0.0f32; t * nkv * hd];
        let mut v = vec![0.0f32; t * nkv * hd];
        forward_batch(
            &mut [
                LinJob { w: &w.q_proj, x: u, t, out: &mut qg },
                LinJob { w: &w.k_proj, x: u, t, out: &mut k },
                LinJob { w: &w.v_proj, x: u, t, out: &mut v },
            ],
            self.backend,
        );
        // q_proj rows are per head [query | gate].
        let mut q = vec![0.0f32; t * nq * hd];
        let mut gate = vec![0.0f32; t * nq * hd];
        for i in 0..t * nq {
            q[i * hd..(i + 1) * hd].copy_from_slice(&qg[i * 2 * hd..i * 2 * hd + hd]);
            gate[i * hd..(i + 1) * hd].copy_from_slice(&qg[i * 2 * hd + hd..(i + 1) * 2 * hd]);
        }
        r::zrms_norm_inplace(&mut q, &w.q_norm, cfg.rms_norm_eps);
        r::zrms_norm_inplace(&mut k, &w.k_norm, cfg.rms_norm_eps);
        for tt in 0..t {
            r::rope_inplace(&mut q[tt * nq * hd..(tt + 1) * nq * hd], hd, &self.inv_freq, pos + tt);
            r::rope_inplace(&mut k[tt * nkv * hd..(tt + 1) * nkv * hd], hd, &self.inv_freq, pos + tt);
        }
        kc.extend_from_slice(&k);
        vc.extend_from_slice(&v);
        let group = nq / nkv;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut att = vec![0.0f32; t * nq * hd];
        let (kc, vc) = (&*kc, &*vc);
        let backend = self.backend;
        att.par_chunks_mut(hd).enumerate().for_each(|(i, out)| {
            let (tt, h) = (i / nq, i % nq);
            let m = h / group;
            let stride = nkv * hd;
            let attend = if backend == Backend::Reference { r::attend } else { fast::attend };
            attend(out, &q[i * hd..(i + 1) * hd], &kc[m * hd..], &vc[m * hd..], pos + tt + 1, stride, scale);
        });
        att.iter_mut().zip(&gate).for_each(|(a, g)| *a *= r::sigmoid(*g));
        let mut out = vec![0.0f32; t * cfg.hidden_size];
        w.o_proj.forward(&mut out, &att, t, self.backend);
        out
    }

    /// Sparse MoE over `t` tokens (MODEL.md §3.7): softmax router, top-k, renormalise, SiLU
    /// experts summed in ascending expert order, plus the sigmoid-gated shared expert.
    ///
    /// The products run in three batches ([`forward_batch`]): everything that reads `u`
    /// (router, shared gate, shared expert gate/up); the routed experts' gate/up; all downs.
    fn moe(&self, w: &MoeWeights, u: &[f32], t: usize, l: usize, emit: &mut impl FnMut(String, &[f32])) -> Vec<f32> {
        let cfg = &self.cfg;
        let (d, ne, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
        let si = w.shared.gate.rows();
        let mut logits = vec![0.0f32; t * ne];
        let mut sg = vec![0.0f32; t];
        let mut sh_g = vec![0.0f32; t * si];
        let mut sh_u = vec![0.0f32; t * si];
        forward_batch(
            &mut [
                LinJob { w: &w.router, x: u, t, out: &mut logits },
                LinJob { w: &w.shared_gate, x: u, t, out: &mut sg },
                LinJob { w: &w.shared.gate, x: u, t, out: &mut sh_g },
                LinJob { w: &w.shared.up, x: u, t, out: &mut sh_u },
            ],
            self.backend,
        );
        emit(format!("blk.{l}.moe.router_logits"), &logits);
        // Per token: chosen experts (descending weight) and renormalised weights.
        let mut chosen: Vec<Vec<(usize, f32)>> = Vec::with_capacity(t);
        for row in logits.chunks_exact(ne) {
            let mut p = row.to_vec();
            r::softmax_inplace(&mut p);
            chosen.push(top_k_renorm(&p, k));
        }
        let ids: Vec<f32> = chosen.iter().flat_map(|c| c.iter().map(|&(e, _)| e as f32)).collect();
        emit(format!("blk.{l}.moe.topk_idx"), &ids);
        let wts: Vec<f32> = chosen.iter().flat_map(|c| c.iter().map(|&(_, w)| w)).collect();
        emit(format!("blk.{l}.moe.topk_w"), &wts);

        // Active experts in ascending id, each with its (token, weight) rows and, when it does
        // not take every token, its gathered input rows [n, d].
        struct Routed {
            e: usize,
            rows: Vec<(usize, f32)>,
            xs: Option<Vec<f32>>,
            h: Vec<f32>,
            up: Vec<f32>,
            y: Vec<f32>,
        }
        let mut per_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); ne];
        for (tt, c) in chosen.iter().enumerate() {
            for &(e, wt) in c {
                per_expert[e].push((tt, wt));
            }
        }
        let active: Vec<(usize, Vec<(usize, f32)>)> = per_expert.into_iter().enumerate().filter(|(_, rows)| !rows.is_empty()).collect();
        let mut routed: Vec<Routed> = active
            .into_par_iter()
            .map(|(e, rows)| {
                let n = rows.len();
                let xs = (n != t).then(|| rows.iter().flat_map(|&(tt, _)| u[tt * d..(tt + 1) * d].iter().copied()).collect());
                let i = w.experts[e].gate.rows();
                Routed { e, rows, xs, h: vec![0.0; n * i], up: vec![0.0; n * i], y: vec![0.0; n * d] }
            })
            .collect();
        let mut jobs: Vec<LinJob<'_>> = Vec::with_capacity(2 * routed.len());
        for ro in routed.iter_mut() {
            let ex = &w.experts[ro.e];
            let n = ro.rows.len();
            let x: &[f32] = ro.xs.as_deref().unwrap_or(u);
            jobs.push(LinJob { w: &ex.gate, x, t: n, out: &mut ro.h });
            jobs.push(LinJob { w: &ex.up, x, t: n, out: &mut ro.up });
        }
        forward_batch(&mut jobs, self.backend);
        drop(jobs);
        // h = silu(gate(x)) * up(x)
        routed.par_iter_mut().for_each(|ro| ro.h.iter_mut().zip(&ro.up).for_each(|(a, b)| *a = r::silu(*a) * b));
        par_rows(&mut sh_g, &sh_u, si, |a, b| a.iter_mut().zip(b).for_each(|(a, b)| *a = r::silu(*a) * b));
        let mut shared = vec![0.0f32; t * d];
        let mut jobs: Vec<LinJob<'_>> = Vec::with_capacity(routed.len() + 1);
        for ro in routed.iter_mut() {
            jobs.push(LinJob { w: &w.experts[ro.e].down, x: &ro.h, t: ro.rows.len(), out: &mut ro.y });
        }
        jobs.push(LinJob { w: &w.shared.down, x: &sh_g, t, out: &mut shared });
        forward_batch(&mut jobs, self.backend);
        drop(jobs);

        // Per token: the routed experts' outputs in ascending expert id, then the shared
        // expert's; tokens in parallel.
        let mut contrib: Vec<Vec<(usize, usize, f32)>> = vec![Vec::with_capacity(k); t];
        for (x, ro) in routed.iter().enumerate() {
            for (i, &(tt, wt)) in ro.rows.iter().enumerate() {
                contrib[tt].push((x, i, wt));
            }
        }
        let mut out = vec![0.0f32; t * d];
        let routed = &routed;
        let combine = |(tt, o): (usize, &mut [f32])| {
            for &(x, i, wt) in &contrib[tt] {
                for (a, &y) in o.iter_mut().zip(&routed[x].y[i * d..(i + 1) * d]) {
                    *a += wt * y;
                }
            }
            let c = r::sigmoid(sg[tt]);
            for (a, &y) in o.iter_mut().zip(&shared[tt * d..(tt + 1) * d]) {
                *a += c * y;
            }
        };
        if t > 1 {
            out.par_chunks_mut(d).enumerate().for_each(combine);
        } else {
            combine((0, &mut out));
        }
        out
    }
}

/// Rows per parallel task of the row-wise element operations ([`par_rows`]).
const PAR_ROWS: usize = 16;

/// `f(a_rows, b_rows)` over matching chunks of whole rows of `a` and `b` (`width` values per row;
/// `b` may be empty), chunks of [`PAR_ROWS`] rows in parallel when there are several. For
/// row-wise operations the result is the same as one call on everything.
fn par_rows(a: &mut [f32], b: &[f32], width: usize, f: impl Fn(&mut [f32], &[f32]) + Sync + Send) {
    let n = PAR_ROWS * width;
    if a.len() <= n {
        return f(a, b);
    }
    if b.is_empty() {
        a.par_chunks_mut(n).for_each(|x| f(x, &[]));
    } else {
        a.par_chunks_mut(n).zip(b.par_chunks(n)).for_each(|(x, y)| f(x, y));
    }
}

/// Top-k of a probability row, descending (ties: lower id first), renormalised to sum 1.
pub fn top_k_renorm(p: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(k);
    let sum: f32 = idx.iter().map(|&i| p[i]).sum();
    idx.into_iter().map(|i| (i, p[i] / sum)).collect()
}

/// `down(silu(gate(x)) * up(x))` for `t` rows of `x` ([t, d_model]). Returns [t, d_model].
pub fn expert_forward(e: &Expert, x: &[f32], t: usize, backend: Backend) -> Vec<f32> {
    let i = e.gate.rows();
    let mut g = vec![0.0f32; t * i];
    e.gate.forward(&mut g, x, t, backend);
    let mut up = vec![0.0f32; t * i];
    e.up.forward(&mut up, x, t, backend);
    g.iter_mut().zip(&up).for_each(|(a, b)| *a = r::silu(*a) * b);
    let mut y = vec![0.0f32; t * e.down.rows()];
    e.down.forward(&mut y, &g, t, backend);
    y
}
