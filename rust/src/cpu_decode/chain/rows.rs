//! The steps between phases, as row work: each row's bias and rotary, residual add, norm, SwiGLU
//! and quantization depend on that row alone. A step of few rows runs it whole in the `after`
//! step of the phase before; a step of many rows (a prompt's chunk, a large batch) shares it out
//! as a phase of its own, and items of consecutive rows give the one-thread loop's bits. The serial
//! steps around it (room for the next input; the K/V writes; the error met) are one piece for
//! both ([`Chain::between_phases`]). Only the K/V writes stay serial (two rows never write one slot in a well-formed step, but a padded step's
//! rows may share a scratch slot, and there the last row must win, as it does on one thread).
//!
//! Why: `benches/profile_step.py --weight-dtype gguf --batch 8 --threads 2` (960 prompt tokens)
//! spent 11% of its time in these steps on one thread while the other waited.

use std::ops::Range;

use super::{Chain, Product};
use crate::cpu_decode::error::DecodeError;
use crate::cpu_decode::lanes;
use crate::cpu_decode::ops::{add, rms_norm};
use crate::gemv::quantize::QuantizedActs;
use crate::gemv::{FusedMatrix, GemvError};

/// From this many rows a step's serial steps are shared out (below, one is a few microseconds
/// and a phase costs ~0.5 us more).
pub(super) const PARALLEL_ROWS: usize = 16;

/// Rows an item of a `Rows` phase holds: about four items a thread, at least 4 rows.
pub(super) fn chunk(rows: usize, threads: usize) -> usize {
    rows.div_ceil(4 * threads).max(4)
}

impl Chain<'_> {
    /// Item `i` of the rows step after `after` in layer `l`: rows `i * row_chunk ..`.
    pub(super) fn rows_item(&self, l: usize, after: Product, i: usize) {
        let r = i * self.row_chunk..((i + 1) * self.row_chunk).min(self.rows());
        // SAFETY: the items of a `Rows` phase own disjoint rows `r`, and no other item runs.
        unsafe { self.row_work(l, after, r) };
    }

    /// The row-local step after `after` in layer `l` for rows `r`; returns the nanoseconds spent
    /// quantizing the next product's input. The K/V writes and the error check follow in
    /// [`Chain::between_phases`].
    ///
    /// # Safety
    /// No other thread reads or writes rows `r` of the buffers this writes, nor writes rows `r` of
    /// those it reads (a `Rows` phase's item, or an `after` step, which runs alone).
    pub(super) unsafe fn row_work(&self, l: usize, after: Product, r: Range<usize>) -> u64 {
        let (g, layers) = (&self.stack.geo, &self.stack.layers);
        let (h, d) = (g.hidden, g.head_dim);
        // SAFETY (every row borrow below): the function's contract.
        match after {
            Product::Qkv => {
                let qkv = unsafe { self.qkv.write_rows(r.clone(), g.qkv_width()) };
                self.stack.rotate_qkv(l, qkv, &self.cos_sin[r.start * d..r.end * d]);
                0
            }
            Product::Scores => 0, // the sums come next: nothing to do between
            Product::Attention => self.quantize_rows(unsafe { self.o.read_rows(r.clone(), g.heads * d) }, r.start),
            Product::O => {
                let (residual, x) = unsafe { (self.residual.write_rows(r.clone(), h), self.x.write_rows(r.clone(), h)) };
                add(residual, unsafe { self.out.read_rows(r.clone(), h) });
                rms_norm(residual, &layers[l].post_norm, g.eps, x);
                self.quantize_rows(x, r.start)
            }
            Product::GateUp => {
                let act = unsafe { self.act.write_rows(r.clone(), g.intermediate) };
                lanes::silu_mul(self.simd, unsafe { self.gate_up.read_rows(r.clone(), 2 * g.intermediate) }, g.intermediate,
                                act);
                self.quantize_rows(act, r.start)
            }
            Product::Down => {
                let (residual, x) = unsafe { (self.residual.write_rows(r.clone(), h), self.x.write_rows(r.clone(), h)) };
                add(residual, unsafe { self.out.read_rows(r.clone(), h) });
                if let Some(next) = layers.get(l + 1) {
                    rms_norm(residual, &next.input_norm, g.eps, x);
                    return self.quantize_rows(x, r.start);
                }
                if let Some(norm) = &self.stack.final_norm {
                    rms_norm(residual, norm, g.eps, x);
                }
                0
            }
        }
    }

    /// Whole rows `first ..` of the next product's input into `acts`; the earliest non-finite
    /// value met is kept for the `after` step. Returns the nanoseconds it took.
    fn quantize_rows(&self, x: &[f32], first: usize) -> u64 {
        let began = self.now();
        // SAFETY: `acts_rows` was set by the `after` before this work and is only read now.
        let Some(rows) = (unsafe { *self.acts_rows.get() }) else { return 0 };
        // SAFETY: `rows` points into `acts`, which no product item reads while this runs (a
        // `Rows` phase or an `after` step), and only this work writes these rows of it.
        if let Err(at) = unsafe { rows.quantize(x, first) } {
            let mut kept = self.row_error.lock().unwrap_or_else(|p| p.into_inner());
            if kept.is_none_or(|k| at < k) {
                *kept = Some(at);
            }
        }
        self.now() - began
    }

    /// The serial steps around the row work: after a product (or attention), room for the next
    /// product's input; after the row work (a `Rows` phase's items, or `row_work` on all rows),
    /// the K/V writes or the error it met.
    pub(super) fn between_phases(&self, l: usize, kind: super::Kind) {
        use super::Kind;
        let layers = &self.stack.layers;
        let lw = &layers[l];
        let next_input = |kind| -> Option<&FusedMatrix> {
            match kind {
                Product::Qkv | Product::Scores => None,
                Product::Attention => Some(&lw.o),
                Product::O => Some(&lw.gate_up),
                Product::GateUp => Some(&lw.down),
                Product::Down => layers.get(l + 1).map(|n| &*n.qkv),
            }
        };
        match kind {
            Kind::Rows(Product::Qkv) => {
                // SAFETY: an `after` step runs alone, so these borrows are the only ones.
                let (qkv, planes) = unsafe { (self.qkv.read(), self.kv.write().into_layer_mut(l, self.kvg)) };
                self.stack.write_kv(qkv, planes, self.kvg, self.step);
            }
            Kind::Rows(after) => {
                let met = self.row_error.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let (Some((row, col)), Some(m)) = (met, next_input(after)) {
                    self.fail(DecodeError::Gemv(GemvError::NonFiniteInput { tensor: m.name().to_string(), row, col }));
                }
            }
            Kind::Product(after) => {
                // SAFETY: an `after` step runs alone: no item reads `acts` or `acts_rows` now.
                unsafe {
                    *self.acts_rows.get() = next_input(after).map(|m| {
                        let acts = &mut *self.acts.get();
                        *acts = QuantizedActs::zeroed(self.rows(), m.cols());
                        acts.rows_mut()
                    });
                }
            }
        }
    }
}
