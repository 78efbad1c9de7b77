//! The decoder layers of one model, and their forward over one step.
//!
//! Per layer, in transformers' order (`pagedrs.models.llama.decoder_layer` is the same
//! sequence in torch ops):
//!
//! ```text
//!   residual += h              (layer 0: residual = the embeddings)
//!   x = rms_norm(residual)     -> qkv = x W_qkv^T (+ bias) -> rotary on q, k -> K/V to their slots
//!   o = attention(q, pages)    -> residual += o W_o^T
//!   x = rms_norm(residual)     -> h = (silu(gate) * up) W_down^T   with [gate | up] = x W_gate_up^T
//! ```
//!
//! and after the last layer `residual + h` is returned, or, when the stack holds the model's
//! final norm ([`DecodeStack::with_final_norm`]), `rms_norm(residual + h)`: what the head reads.
//! Why the final norm here: a torch op called right after the stack streamed the weights runs
//! cold (its code and data evicted): `torch.rms_norm` on one 576-wide row took 30-87 us there
//! against 4-9 us warm (Intel Xeon, 2 cores, 2026-12-05), a tenth of the Python side of a
//! batch-1 step.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::attention::{attend, LayerAttention, Simd};
use super::chain;
use super::error::DecodeError;
use super::kv_cache::{KvCacheMut, PlanesMut};
use super::lanes;
use super::ops::{add, rms_norm, rotary};
use super::step::{KvGeometry, StepLayout, StepMeta};
use crate::gemv::{pool, FusedMatrix, Kernel};

/// One decoder layer's weights: norms in float32, products as packed GGUF matrices (a fused product's
/// parts each in its own format: [`FusedMatrix`]).
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub qkv: Arc<FusedMatrix>,
    pub qkv_bias: Option<Vec<f32>>,
    pub o: Arc<FusedMatrix>,
    pub gate_up: Arc<FusedMatrix>,
    pub down: Arc<FusedMatrix>,
    pub sliding_window: Option<usize>,
}

/// The shapes every layer shares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StackGeometry {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub eps: f32,
    pub scale: f32,
}

impl StackGeometry {
    pub(super) fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// Where the stack's time went since the last reset, in nanoseconds (for `benches/profile_step.py`:
/// issue 30 asks that a batch-1 step be >= 80% linear-layer time, and inside one Rust call the
/// Python profiler cannot see the split). Two clock reads per phase: ~50 ns a layer.
#[derive(Debug, Default)]
pub struct Timings {
    /// The GEMV products (activation quantization included, except on a team in a step of 16+
    /// rows, where each row's quantization runs with its norm in the rows phases: `elementwise`).
    pub products: AtomicU64,
    /// Paged attention.
    pub attention: AtomicU64,
    /// Norms, rotary, bias, K/V writes, residual adds, SwiGLU.
    pub elementwise: AtomicU64,
    pub steps: AtomicU64,
}

impl Timings {
    /// (products, attention, elementwise, steps).
    pub fn read(&self) -> (u64, u64, u64, u64) {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        (r(&self.products), r(&self.attention), r(&self.elementwise), r(&self.steps))
    }

    pub fn reset(&self) {
        for a in [&self.products, &self.attention, &self.elementwise, &self.steps] {
            a.store(0, Ordering::Relaxed);
        }
    }
}

/// A step's working rows: the residual stream, a norm's output, and each product's output.
pub(super) struct Buffers {
    pub residual: Vec<f32>,
    pub x: Vec<f32>,
    pub qkv: Vec<f32>,
    pub o: Vec<f32>,
    pub out: Vec<f32>,
    pub gate_up: Vec<f32>,
    pub act: Vec<f32>,
}

impl Buffers {
    /// For the rows of `h` (`[T, hidden]`, the embeddings: the first residual).
    fn new(g: &StackGeometry, h: &[f32]) -> Buffers {
        let t = h.len() / g.hidden;
        Buffers {
            residual: h.to_vec(),
            x: vec![0f32; t * g.hidden],
            qkv: vec![0f32; t * g.qkv_width()],
            o: vec![0f32; t * g.heads * g.head_dim],
            out: vec![0f32; t * g.hidden],
            gate_up: vec![0f32; t * 2 * g.intermediate],
            act: vec![0f32; t * g.intermediate],
        }
    }
}

/// Nanoseconds a forward spent in each part (what [`Timings`] adds up).
#[derive(Debug, Default)]
pub(super) struct Spent {
    pub products: u64,
    pub attention: u64,
    pub elementwise: u64,
}

#[derive(Debug)]
pub struct DecodeStack {
    pub(super) geo: StackGeometry,
    pub(super) layers: Vec<LayerWeights>,
    /// The model's final norm, applied to the last layer's output when set.
    pub(super) final_norm: Option<Vec<f32>>,
    pub timings: Timings,
}

fn weights(field: String, reason: String) -> DecodeError {
    DecodeError::Weights { field, reason }
}

fn check_matrix(l: usize, name: &str, m: &FusedMatrix, rows: usize, cols: usize) -> Result<(), DecodeError> {
    if (m.rows(), m.cols()) != (rows, cols) {
        return Err(weights(
            format!("layers[{l}].{name}"),
            format!("tensor {:?} is [{}, {}]; the geometry needs [{rows}, {cols}]", m.name(), m.rows(), m.cols()),
        ));
    }
    Ok(())
}

fn check_vector(l: usize, name: &str, v: &[f32], len: usize) -> Result<(), DecodeError> {
    check_vector_named(&format!("layers[{l}].{name}"), v, len)
}

fn check_vector_named(field: &str, v: &[f32], len: usize) -> Result<(), DecodeError> {
    if v.len() != len {
        return Err(weights(field.to_string(), format!("has {} values; the geometry needs {len}", v.len())));
    }
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(weights(field.to_string(), format!("value {i} is {}; weights must be finite", v[i])));
    }
    Ok(())
}

impl DecodeStack {
    /// Checks every layer against `geo` (shapes, finite norms and biases, a positive window).
    pub fn new(geo: StackGeometry, layers: Vec<LayerWeights>) -> Result<Self, DecodeError> {
        let g = &geo;
        let positive = [("hidden", g.hidden), ("heads", g.heads), ("kv_heads", g.kv_heads), ("head_dim", g.head_dim),
                        ("intermediate", g.intermediate)];
        for (name, v) in positive {
            if v == 0 {
                return Err(weights(name.to_string(), "is 0; must be >= 1".to_string()));
            }
        }
        if g.heads % g.kv_heads != 0 || g.head_dim % 2 != 0 {
            return Err(weights("heads".to_string(), format!(
                "{} query heads, {} kv heads, head_dim {}: need heads a multiple of kv_heads and an even head_dim",
                g.heads, g.kv_heads, g.head_dim
            )));
        }
        if !(g.eps.is_finite() && g.eps >= 0.0 && g.scale.is_finite()) {
            return Err(weights("eps".to_string(), format!("eps {} and scale {} must be finite (eps >= 0)", g.eps, g.scale)));
        }
        if layers.is_empty() {
            return Err(weights("layers".to_string(), "is empty; a model has >= 1 layer".to_string()));
        }
        let (h, q) = (g.hidden, g.heads * g.head_dim);
        for (l, w) in layers.iter().enumerate() {
            check_vector(l, "input_norm", &w.input_norm, h)?;
            check_vector(l, "post_norm", &w.post_norm, h)?;
            check_matrix(l, "qkv", &w.qkv, g.qkv_width(), h)?;
            if let Some(b) = &w.qkv_bias {
                check_vector(l, "qkv_bias", b, g.qkv_width())?;
            }
            check_matrix(l, "o", &w.o, h, q)?;
            check_matrix(l, "gate_up", &w.gate_up, 2 * g.intermediate, h)?;
            check_matrix(l, "down", &w.down, h, g.intermediate)?;
            if w.sliding_window == Some(0) {
                return Err(weights(format!("layers[{l}].sliding_window"), "is 0; must be >= 1 or none".to_string()));
            }
        }
        Ok(DecodeStack { geo, layers, final_norm: None, timings: Timings::default() })
    }

    /// The stack with the model's final norm (`hidden` finite weights, the geometry's `eps`):
    /// `forward` then returns the normed rows.
    pub fn with_final_norm(mut self, norm: Vec<f32>) -> Result<Self, DecodeError> {
        check_vector_named("final_norm", &norm, self.geo.hidden)?;
        self.final_norm = Some(norm);
        Ok(self)
    }

    /// Whether `forward` applies the final norm.
    pub fn has_final_norm(&self) -> bool {
        self.final_norm.is_some()
    }

    pub fn geometry(&self) -> StackGeometry {
        self.geo
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layer `l`'s fused QKV output made what attention reads: the bias added, rotary applied to
    /// the queries and keys of each row, and each row's K and V copied to its slot in `layer_kv`
    /// (that layer's K plane then V plane).
    pub(super) fn place_qkv(&self, l: usize, qkv: &mut [f32], cos_sin: &[f32], layer_kv: PlanesMut<'_>, kvg: &KvGeometry,
                            step: &StepLayout<'_>) {
        self.rotate_qkv(l, qkv, cos_sin);
        self.write_kv(qkv, layer_kv, kvg, step);
    }

    /// The row-local part of [`DecodeStack::place_qkv`] for whole rows of `qkv` (`cos_sin` theirs):
    /// the bias, then rotary on the queries and keys.
    pub(super) fn rotate_qkv(&self, l: usize, qkv: &mut [f32], cos_sin: &[f32]) {
        let g = &self.geo;
        let d = g.head_dim;
        for (row, cs) in qkv.chunks_exact_mut(g.qkv_width()).zip(cos_sin.chunks_exact(d)) {
            if let Some(b) = &self.layers[l].qkv_bias {
                add(row, b);
            }
            rotary(row, g.heads + g.kv_heads, d, cs);
        }
    }

    /// Each row's K and V (of the rotated `qkv`) stored in its slot of `layer_kv` (as they are in
    /// a float32 cache, encoded in an fp8 one).
    pub(super) fn write_kv(&self, qkv: &[f32], mut layer_kv: PlanesMut<'_>, kvg: &KvGeometry, step: &StepLayout<'_>) {
        let g = &self.geo;
        let (d, kvh) = (g.head_dim, g.kv_heads);
        for (row, r) in qkv.chunks_exact(g.qkv_width()).zip(&step.rows) {
            for j in 0..kvh {
                layer_kv.put(kvg.slot_offset(r.slot, j), &row[(g.heads + j) * d..][..d], &row[(g.heads + kvh + j) * d..][..d]);
            }
        }
    }

    /// Runs every layer over the step's `T` rows: `h` `[T, hidden]` (the embeddings),
    /// `cos_sin` `[T, 2, head_dim / 2]` (each row's cos then sin), `kv` the whole cache of
    /// geometry `kvg`, which gets this step's K/V. Returns `residual + h` of the last layer
    /// `[T, hidden]`. Everything is checked before the first write to `kv`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        h: &[f32],
        cos_sin: &[f32],
        kv: &mut [f32],
        kvg: KvGeometry,
        meta: StepMeta<'_>,
        threads: usize,
        kernel: Kernel,
    ) -> Result<Vec<f32>, DecodeError> {
        self.forward_cache(h, cos_sin, KvCacheMut::F32(kv), kvg, meta, threads, kernel)
    }

    /// [`DecodeStack::forward`] over a cache of float32 values or fp8 codes ([`KvCacheMut`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_cache(
        &self,
        h: &[f32],
        cos_sin: &[f32],
        mut kv: KvCacheMut<'_>,
        kvg: KvGeometry,
        meta: StepMeta<'_>,
        threads: usize,
        kernel: Kernel,
    ) -> Result<Vec<f32>, DecodeError> {
        let g = &self.geo;
        let step_err = |field, reason| DecodeError::Step { field, reason };
        if h.is_empty() || h.len() % g.hidden != 0 {
            return Err(step_err("hidden", format!("has {} values; need [T >= 1, {}]", h.len(), g.hidden)));
        }
        let t = h.len() / g.hidden;
        if cos_sin.len() != t * g.head_dim {
            return Err(step_err("cos_sin", format!("has {} values; [{t}, 2, {}] needs {}", cos_sin.len(), g.head_dim / 2,
                                                     t * g.head_dim)));
        }
        let want = KvGeometry { layers: self.layers.len(), kv_heads: g.kv_heads, head_dim: g.head_dim, ..kvg };
        if kvg != want || kvg.block_size == 0 || kv.len() != kvg.len() {
            return Err(step_err("kv_cache", format!(
                "is {kvg:?} with {} values; this model needs {} layers, {} kv heads, head_dim {} and block_size >= 1",
                kv.len(), self.layers.len(), g.kv_heads, g.head_dim
            )));
        }
        pool::check_threads(threads)?;
        let step = StepLayout::new(meta, t, &kvg)?;
        let mut b = Buffers::new(g, h);
        if let KvCacheMut::Fp8(_, fp8) = &kv {
            for (name, s) in [("k_scale", fp8.k_scale), ("v_scale", fp8.v_scale)] {
                if !(s.is_finite() && s > 0.0) {
                    return Err(step_err("kv_cache", format!("{name} is {s}; an fp8 cache's scales must be finite and > 0")));
                }
            }
        }
        let spent = if threads == 1 {
            self.layers_on_this_thread(&mut b, cos_sin, &mut kv, &kvg, &step, kernel)?
        } else {
            chain::layers_on_team(self, &mut b, cos_sin, &mut kv, &kvg, &step, threads, kernel)?
        };
        let tm = &self.timings;
        tm.products.fetch_add(spent.products, Ordering::Relaxed);
        tm.attention.fetch_add(spent.attention, Ordering::Relaxed);
        tm.elementwise.fetch_add(spent.elementwise, Ordering::Relaxed);
        tm.steps.fetch_add(1, Ordering::Relaxed);
        Ok(if self.final_norm.is_some() { b.x } else { b.residual })
    }

    /// Every layer, then the last residual add and the final norm, on the calling thread alone.
    fn layers_on_this_thread(&self, b: &mut Buffers, cos_sin: &[f32], kv: &mut KvCacheMut<'_>, kvg: &KvGeometry,
                             step: &StepLayout<'_>, kernel: Kernel) -> Result<Spent, DecodeError> {
        let g = &self.geo;
        let t = step.rows.len();
        let mut spent = Spent::default();
        let mut clock = Instant::now();
        let mut lap = |acc: &mut u64| {
            let now = Instant::now();
            *acc += (now - clock).as_nanos() as u64;
            clock = now;
        };
        for (l, lw) in self.layers.iter().enumerate() {
            if l > 0 {
                add(&mut b.residual, &b.out);
            }
            rms_norm(&b.residual, &lw.input_norm, g.eps, &mut b.x);
            lap(&mut spent.elementwise);
            lw.qkv.matmul(&b.x, t, &mut b.qkv, 1, kernel)?;
            lap(&mut spent.products);
            self.place_qkv(l, &mut b.qkv, cos_sin, kv.reborrow().into_layer_mut(l, kvg), kvg, step);
            lap(&mut spent.elementwise);
            let layer = LayerAttention { planes: kv.shared().layer(l, kvg), heads: g.heads, scale: g.scale, sliding_window: lw.sliding_window };
            attend(&layer, &b.qkv, step, kvg, &mut b.o, 1, Simd::best())?;
            lap(&mut spent.attention);
            lw.o.matmul(&b.o, t, &mut b.out, 1, kernel)?;
            lap(&mut spent.products);
            add(&mut b.residual, &b.out);
            rms_norm(&b.residual, &lw.post_norm, g.eps, &mut b.x);
            lap(&mut spent.elementwise);
            lw.gate_up.matmul(&b.x, t, &mut b.gate_up, 1, kernel)?;
            lap(&mut spent.products);
            lanes::silu_mul(Simd::best(), &b.gate_up, g.intermediate, &mut b.act);
            lap(&mut spent.elementwise);
            lw.down.matmul(&b.act, t, &mut b.out, 1, kernel)?;
            lap(&mut spent.products);
        }
        add(&mut b.residual, &b.out);
        if let Some(norm) = &self.final_norm {
            rms_norm(&b.residual, norm, g.eps, &mut b.x);
        }
        Ok(spent)
    }
}
