//! The stack's layers on a team of threads as one chain of phases ([`crate::gemv::phases`]):
//! five a layer (the QKV product, attention, the output product, gate/up, down), each shared
//! out as items (tile chunks; attention's (row, KV head) units, or whole rows when there are at
//! least two a thread: `attention::units_per_item`), and between two phases the
//! serial step that the next one reads (bias, rotary and the K/V writes; a residual add and a
//! norm; SwiGLU; each product's input quantized once). In a step of 16+ rows those steps are
//! phases of their own, shared out by rows (ten phases a layer: [`rows`]).
//!
//! Why: on 2 threads each of the ~150 team calls of a batch-1 token cost ~1 us beyond its work
//! (publishing the call, waking the helper, waiting for it to leave), and the serial steps ran
//! on the caller only. Here the helper joins once a step and follows the phases by a counter.
//!
//! The bits are those of [`super::DecodeStack`]'s one-thread loop: the same operations on the
//! same rows in the same order (tiles and attention items are independent of how they are
//! shared out, every serial step runs whole on one thread, and a rows step's work is each row's
//! alone).
//!
//! Sharing: the buffers are reached through raw pointers taken once, and the phases order every
//! access: an `after` step runs alone (no item runs), the items of a phase write disjoint parts
//! (their own tiles' columns, their own heads' outputs, their own rows) of a buffer no item of
//! the phase reads,
//! and read only what the `after` before them wrote. The phase counters' release/acquire pairs
//! order each `after` before the next phase's items and the items before the next `after`.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::attention::{attend_item, row_keys, units_per_item, LayerAttention, Simd};
use super::attention_split::KeySplit;
use super::error::DecodeError;
use super::kv_cache::KvCacheMut;
use super::ops::rms_norm;
use super::stack::{Buffers, DecodeStack, Spent};
use super::step::{KvGeometry, StepLayout};
use crate::gemv::phases::{run_phases, PhasePlan};
use crate::gemv::quantize::{ActsRows, QuantizedActs};
use crate::gemv::{pool, FusedMatrix, GemvError, Kernel};

mod kv_buf;
use kv_buf::KvBuf;
mod rows;

/// What a phase does: a product (attention counted among them: a phase of items whose output the
/// next product reads), or `Rows(p)`, the step after product `p` shared out by rows (steps of at
/// least [`rows::PARALLEL_ROWS`] rows; in smaller steps that work runs whole in `p`'s `after`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Product(Product),
    Rows(Product),
}

/// A layer's products in order. `Scores` is attention's first phase where one row's attention is
/// split ([`KeySplit`]); `Attention` is then its second (the sums).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Product {
    Qkv,
    Scores,
    Attention,
    O,
    GateUp,
    Down,
}

const LAYER: [Kind; 5] = [
    Kind::Product(Product::Qkv), Kind::Product(Product::Attention), Kind::Product(Product::O),
    Kind::Product(Product::GateUp), Kind::Product(Product::Down),
];
const LAYER_SPLIT: [Kind; 6] = [
    Kind::Product(Product::Qkv), Kind::Product(Product::Scores), Kind::Product(Product::Attention),
    Kind::Product(Product::O), Kind::Product(Product::GateUp), Kind::Product(Product::Down),
];
const LAYER_IN_ROWS: [Kind; 10] = [
    Kind::Product(Product::Qkv), Kind::Rows(Product::Qkv), Kind::Product(Product::Attention),
    Kind::Rows(Product::Attention), Kind::Product(Product::O), Kind::Rows(Product::O), Kind::Product(Product::GateUp),
    Kind::Rows(Product::GateUp), Kind::Product(Product::Down), Kind::Rows(Product::Down),
];

/// A buffer reached from several threads under the phases' order (see the module's docs).
#[derive(Clone, Copy)]
struct Buf<T = f32> {
    ptr: *mut T,
    len: usize,
}

impl<T> Buf<T> {
    fn of(v: &mut [T]) -> Buf<T> {
        Buf { ptr: v.as_mut_ptr(), len: v.len() }
    }

    /// # Safety
    /// No thread writes the buffer while the borrow lives.
    unsafe fn read(&self) -> &[T] {
        // SAFETY: `ptr` and `len` came from a live slice that outlives the chain (`of`); the
        // caller guarantees no concurrent write.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// # Safety
    /// No other thread reads or writes the buffer while the borrow lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn write(&self) -> &mut [T] {
        // SAFETY: as `read`, and the caller guarantees the access is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Buf<f32> {
    /// Rows `r` of a buffer of rows `width` floats wide.
    ///
    /// # Safety
    /// No thread writes these rows while the borrow lives; they lie inside the buffer.
    unsafe fn read_rows(&self, r: std::ops::Range<usize>, width: usize) -> &[f32] {
        debug_assert!(r.end * width <= self.len);
        // SAFETY: inside the buffer (the contract), which outlives the chain (`of`).
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start * width), r.len() * width) }
    }

    /// # Safety
    /// No other thread reads or writes these rows while the borrow lives; they lie inside the buffer.
    #[allow(clippy::mut_from_ref)]
    unsafe fn write_rows(&self, r: std::ops::Range<usize>, width: usize) -> &mut [f32] {
        debug_assert!(r.end * width <= self.len);
        // SAFETY: as `read_rows`, and the caller guarantees the access is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start * width), r.len() * width) }
    }
}

struct Chain<'a> {
    stack: &'a DecodeStack,
    cos_sin: &'a [f32],
    kvg: &'a KvGeometry,
    step: &'a StepLayout<'a>,
    kernel: Kernel,
    simd: Simd,
    threads: usize,
    /// Each distinct sliding window's row keys, and which of them each layer reads.
    keys: Vec<(Option<usize>, Vec<Vec<usize>>)>,
    layer_keys: Vec<usize>,
    /// (row, KV head) units an attention item holds (`attention::units_per_item`).
    attention_units: usize,
    /// Where a one-row step's attention is split in two phases: the split of each distinct window
    /// (as `keys`; empty where not split), the scores and the pieces (`KeySplit`'s buffers).
    splits: Vec<KeySplit>,
    scores: Buf,
    pieces: Buf,
    /// A layer's phases (`LAYER`, `LAYER_SPLIT` or `LAYER_IN_ROWS`), whether the row work has
    /// phases of its own (`LAYER_IN_ROWS`), and the rows of one item of a `Rows` phase.
    kinds: &'static [Kind],
    in_rows: bool,
    row_chunk: usize,
    /// The first non-finite input a `Rows` phase's items met, as (row, column): the earliest wins,
    /// so the error is the one-thread loop's.
    row_error: Mutex<Option<(usize, usize)>>,
    residual: Buf,
    x: Buf,
    qkv: Buf,
    o: Buf,
    out: Buf,
    gate_up: Buf,
    act: Buf,
    kv: KvBuf,
    /// The next product's input, quantized by the `after` before it (or, in rows, by a `Rows`
    /// phase's items through `acts_rows`); read by its items.
    acts: UnsafeCell<QuantizedActs>,
    acts_rows: UnsafeCell<Option<ActsRows>>,
    /// Set (before the next phase opens) when an input was not finite: later items and steps
    /// do nothing, and the error is returned.
    failed: AtomicBool,
    error: Mutex<Option<DecodeError>>,
    start: Instant,
    /// When the open phase opened (ns since `start`).
    opened: AtomicU64,
    products: AtomicU64,
    attention: AtomicU64,
    elementwise: AtomicU64,
}

// SAFETY: the raw buffers and `acts` are accessed under the phases' order (the module's docs):
// never a write concurrent with another access to the same floats.
unsafe impl Sync for Chain<'_> {}

impl Chain<'_> {
    fn rows(&self) -> usize {
        self.step.rows.len()
    }

    fn fail(&self, e: DecodeError) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
        self.failed.store(true, Ordering::Relaxed);
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }
}

impl PhasePlan for Chain<'_> {
    fn phases(&self) -> usize {
        self.stack.layers.len() * self.kinds.len()
    }

    fn items(&self, p: usize) -> usize {
        let (l, kind) = self.phase(p);
        match kind {
            Kind::Product(Product::Scores) => self.splits[self.layer_keys[l]].score_items(),
            Kind::Product(Product::Attention) if !self.splits.is_empty() => self.splits[self.layer_keys[l]].sum_items(),
            Kind::Product(Product::Attention) => self.rows() * self.kvg.kv_heads / self.attention_units,
            Kind::Rows(_) => self.rows().div_ceil(self.row_chunk),
            Kind::Product(p) => self.product(l, p).0.chunks(self.rows(), self.threads),
        }
    }

    fn item(&self, p: usize, i: usize) {
        // set before this phase opened, so seen here: `acts` may not fit this product then
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        let (l, kind) = self.phase(p);
        match kind {
            Kind::Product(Product::Scores) => self.scores_item(l, i),
            Kind::Product(Product::Attention) if !self.splits.is_empty() => self.sums_item(l, i),
            Kind::Product(Product::Attention) => self.attention_item(l, i),
            Kind::Rows(after) => self.rows_item(l, after, i),
            Kind::Product(p) => {
                let (m, dst) = self.product(l, p);
                // SAFETY: `dst` is this product's `[rows, m.rows()]` output (`Buffers`), chunk `i`'s
                // tiles are written by this item alone and read by no item of the phase; the kernel
                // was checked (`layers_on_team`), and `acts` holds this product's input, quantized by
                // the `after` before this phase (not failed, checked above), read-only until it ends.
                unsafe { m.chunk_into(self.kernel, &*self.acts.get(), self.threads, i, dst.ptr) };
            }
        }
    }

    fn after(&self, p: usize) {
        let (l, kind) = self.phase(p);
        let began = self.now();
        let phase = match kind {
            Kind::Product(Product::Attention | Product::Scores) => &self.attention,
            Kind::Rows(_) => &self.elementwise, // (quantizing included, at these sizes)
            _ => &self.products,
        };
        phase.fetch_add(began - self.opened.load(Ordering::Relaxed), Ordering::Relaxed);
        // a panic here would leave `acts` quantized for another product: fail the chain (later
        // items then do nothing) rather than let a product read activations of another width
        let quantizing = if self.failed.load(Ordering::Relaxed) {
            0
        } else {
            catch_unwind(AssertUnwindSafe(|| self.between(l, kind))).unwrap_or_else(|_| {
                self.fail(DecodeError::Gemv(GemvError::Threads { reason: format!("layer {l}: the step after {kind:?} panicked") }));
                0
            })
        };
        let end = self.now();
        self.products.fetch_add(quantizing, Ordering::Relaxed);
        self.elementwise.fetch_add(end - began - quantizing, Ordering::Relaxed);
        self.opened.store(end, Ordering::Relaxed);
    }
}

impl Chain<'_> {
    /// Phase `p`'s layer and kind.
    fn phase(&self, p: usize) -> (usize, Kind) {
        (p / self.kinds.len(), self.kinds[p % self.kinds.len()])
    }

    /// Item `i` of layer `l`'s attention: a (row, KV head) and that KV head's query heads.
    fn attention_item(&self, l: usize, i: usize) {
        // the last rows first: a prompt's rows see more keys the later they come, and the threads
        // claim items in order, so the longest go first and the short ones fill in at the end
        let i = self.rows() * self.kvg.kv_heads / self.attention_units - 1 - i;
        let g = &self.stack.geo;
        let size = self.attention_units * g.heads / g.kv_heads * g.head_dim;
        // SAFETY: attention items only read `qkv` and the cache (written by the `after` before
        // them), and item `i` alone writes its `size` outputs of `o` (`i` < the phase's items, so
        // they lie inside it), which no other item of the phase reads.
        let (qkv, planes, o) = unsafe {
            (self.qkv.read(), self.kv.read().layer(l, self.kvg), std::slice::from_raw_parts_mut(self.o.ptr.add(i * size), size))
        };
        let layer = LayerAttention { planes, heads: g.heads, scale: g.scale, sliding_window: self.stack.layers[l].sliding_window };
        attend_item(&layer, &self.keys[self.layer_keys[l]].1, qkv, self.kvg, i, self.attention_units, o, self.simd);
    }

    /// Score item `i` of layer `l`'s split attention ([`KeySplit::scores`]).
    fn scores_item(&self, l: usize, i: usize) {
        let (g, split) = (&self.stack.geo, &self.splits[self.layer_keys[l]]);
        let block = split.score_block(i);
        // SAFETY: score items only read `qkv` and the cache (written by the `after` before them),
        // and item `i` alone writes its block of `scores` (inside it: `scores` holds the largest
        // split's `scores_len`), which no item of the phase reads.
        let (qkv, planes, out) = unsafe {
            (self.qkv.read(), self.kv.read().layer(l, self.kvg),
             std::slice::from_raw_parts_mut(self.scores.ptr.add(block.start), block.len()))
        };
        split.scores(i, &qkv[..g.heads * g.head_dim], planes, &self.keys[self.layer_keys[l]].1[0], g.scale, out, self.simd);
    }

    /// Sum item `i` of layer `l`'s split attention ([`KeySplit::sums`]).
    fn sums_item(&self, l: usize, i: usize) {
        let split = &self.splits[self.layer_keys[l]];
        let block = split.piece_block(i);
        // SAFETY: sum items read `scores` (written by the phase before, read-only now) and the
        // cache, and item `i` alone writes its piece of `pieces`, which no item of the phase reads.
        let (scores, planes, out) = unsafe {
            (&self.scores.read()[..split.scores_len()], self.kv.read().layer(l, self.kvg),
             std::slice::from_raw_parts_mut(self.pieces.ptr.add(block.start), block.len()))
        };
        split.sums(i, scores, planes, &self.keys[self.layer_keys[l]].1[0], out, self.simd);
    }

    /// Product `p`'s matrix in layer `l`, and the buffer it writes (not attention's: its items
    /// are `attention_item`).
    fn product(&self, l: usize, p: Product) -> (&FusedMatrix, Buf) {
        let lw = &self.stack.layers[l];
        match p {
            Product::Qkv => (&lw.qkv, self.qkv),
            Product::O => (&lw.o, self.out),
            Product::GateUp => (&lw.gate_up, self.gate_up),
            Product::Down | Product::Attention | Product::Scores => (&lw.down, self.out),
        }
    }
}

impl Chain<'_> {
    /// The serial step after phase `kind` of layer `l`: what the next phase reads. Returns the
    /// nanoseconds spent quantizing the next product's input (counted with the products). In a
    /// step of few rows the row work runs here, whole, between the same serial steps a step in
    /// rows runs around its `Rows` phase: one definition of each step for both.
    fn between(&self, l: usize, kind: Kind) -> u64 {
        if kind == Kind::Product(Product::Attention) && !self.splits.is_empty() {
            let split = &self.splits[self.layer_keys[l]];
            // SAFETY: an `after` step runs alone; the one row's outputs lie inside `o`.
            unsafe { split.scatter(self.pieces.read(), self.o.write_rows(0..1, self.stack.geo.heads * self.stack.geo.head_dim)) };
        }
        self.between_phases(l, kind);
        let Kind::Product(after) = kind else { return 0 };
        if self.in_rows {
            return 0; // its `Rows` phase comes next
        }
        // SAFETY: an `after` step runs alone, so its row work owns every row.
        let quantizing = unsafe { self.row_work(l, after, 0..self.rows()) };
        self.between_phases(l, Kind::Rows(after));
        quantizing
    }
}

/// Every layer, the last residual add and the final norm on `threads` threads: the bits of
/// `DecodeStack::layers_on_this_thread`.
#[allow(clippy::too_many_arguments)]
pub(super) fn layers_on_team(stack: &DecodeStack, b: &mut Buffers, cos_sin: &[f32], kv: &mut KvCacheMut<'_>, kvg: &KvGeometry,
                             step: &StepLayout<'_>, threads: usize, kernel: Kernel) -> Result<Spent, DecodeError> {
    let first = &stack.layers[0];
    first.qkv.check_kernel(kernel)?;
    let team = pool::team(threads)?;
    let start = Instant::now();
    rms_norm(&b.residual, &first.input_norm, stack.geo.eps, &mut b.x);
    let normed = start.elapsed().as_nanos() as u64;
    let acts = first.qkv.quantize_input(&b.x, step.rows.len())?;
    let mut keys: Vec<(Option<usize>, Vec<Vec<usize>>)> = Vec::new();
    let mut layer_keys = Vec::with_capacity(stack.layers.len());
    for lw in &stack.layers {
        let at = match keys.iter().position(|(w, _)| *w == lw.sliding_window) {
            Some(at) => at,
            None => {
                keys.push((lw.sliding_window, row_keys(lw.sliding_window, step, kvg)));
                keys.len() - 1
            }
        };
        layer_keys.push(at);
    }
    let g = &stack.geo;
    let splits: Vec<KeySplit> = keys.iter()
        .map_while(|(_, rows)| KeySplit::plan(rows.len(), g.heads, g.kv_heads, g.head_dim, rows.first().map_or(0, Vec::len), team.threads()))
        .collect();
    let splits = if splits.len() == keys.len() { splits } else { Vec::new() }; // every layer's, or none
    let mut scores = vec![0f32; splits.iter().map(KeySplit::scores_len).max().unwrap_or(0)];
    let mut pieces = vec![0f32; splits.first().map_or(0, KeySplit::pieces_len)];
    let in_rows = step.rows.len() >= rows::PARALLEL_ROWS;
    let quantized = start.elapsed().as_nanos() as u64;
    let chain = Chain {
        stack, cos_sin, kvg, step, kernel, simd: Simd::best(), threads: team.threads(), keys, layer_keys,
        attention_units: units_per_item(step.rows.len(), kvg.kv_heads, team.threads()),
        kinds: if in_rows { &LAYER_IN_ROWS } else if splits.is_empty() { &LAYER } else { &LAYER_SPLIT },
        in_rows, scores: Buf::of(&mut scores), pieces: Buf::of(&mut pieces), splits,
        row_chunk: rows::chunk(step.rows.len(), team.threads()), row_error: Mutex::new(None),
        residual: Buf::of(&mut b.residual), x: Buf::of(&mut b.x), qkv: Buf::of(&mut b.qkv), o: Buf::of(&mut b.o),
        out: Buf::of(&mut b.out), gate_up: Buf::of(&mut b.gate_up), act: Buf::of(&mut b.act), kv: KvBuf::of(kv),
        acts: UnsafeCell::new(acts), acts_rows: UnsafeCell::new(None), failed: AtomicBool::new(false), error: Mutex::new(None), start,
        opened: AtomicU64::new(quantized), products: AtomicU64::new(quantized - normed), attention: AtomicU64::new(0),
        elementwise: AtomicU64::new(normed),
    };
    run_phases(&team, &chain).map_err(|e| match e {
        GemvError::Threads { reason } => DecodeError::Gemv(GemvError::Threads { reason: format!("decode layers: {reason}") }),
        e => DecodeError::Gemv(e),
    })?;
    if let Some(e) = chain.error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(Spent {
        products: chain.products.into_inner(),
        attention: chain.attention.into_inner(),
        elementwise: chain.elementwise.into_inner(),
    })
}
