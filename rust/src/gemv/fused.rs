//! One product whose output columns come from parts in different block formats: a fused q/k/v or
//! gate/up whose siblings a GGUF file stores in different types.
//!
//! Why: llama.cpp's K-quant mixes give a layer's values more bits than its queries and keys
//! ("Q4_K_M": Q4_K q and k beside a Q6_K v in about half the layers; "Q5_K_M": Q5_K beside Q6_K; a
//! small model's fallbacks: Q5_0 beside Q8_0). A product has one [`PackedMatrix`] per format, so
//! such siblings were all converted to Q8_0 at load: 8.5 bits a weight streamed instead of 4.6-7,
//! a second rounding, and a first load that converts. Here each part keeps its format and writes
//! its own columns of the one output; the activations are quantized once for all of them (their
//! blocks of 32 do not depend on the weights' format), so the product is each part's product,
//! bit for bit.
//!
//! A product of one part is the part's own product (the same chunks, the same bits).

use std::sync::Arc;

use super::{pool, quantize, GemvError, Kernel, PackedMatrix, SendPtr};

/// A weight `[rows, cols]` whose rows are `parts` in order, each in its own block format.
#[derive(Debug, Clone)]
pub struct FusedMatrix {
    name: String,
    parts: Vec<Arc<PackedMatrix>>,
    /// The first output column of each part.
    offsets: Vec<usize>,
    rows: usize,
    cols: usize,
}

impl From<Arc<PackedMatrix>> for FusedMatrix {
    fn from(m: Arc<PackedMatrix>) -> Self {
        FusedMatrix { name: m.name().to_string(), rows: m.rows(), cols: m.cols(), offsets: vec![0], parts: vec![m] }
    }
}

impl From<PackedMatrix> for FusedMatrix {
    fn from(m: PackedMatrix) -> Self {
        FusedMatrix::from(Arc::new(m))
    }
}

impl FusedMatrix {
    /// The parts' rows stacked in order; every part must take the same input width. Errors name
    /// `name` and the part at fault.
    pub fn new(name: &str, parts: Vec<Arc<PackedMatrix>>) -> Result<Self, GemvError> {
        let first = parts.first().ok_or_else(|| GemvError::Input {
            tensor: name.to_string(),
            reason: "a fused product needs at least one part".to_string(),
        })?;
        let cols = first.cols();
        if let Some(bad) = parts.iter().find(|p| p.cols() != cols) {
            return Err(GemvError::Input {
                tensor: name.to_string(),
                reason: format!("part {:?} has {} columns (K); part {:?} has {cols}: fused parts share their input",
                                bad.name(), bad.cols(), first.name()),
            });
        }
        let mut offsets = Vec::with_capacity(parts.len());
        let mut rows = 0usize;
        for p in &parts {
            offsets.push(rows);
            rows += p.rows();
        }
        Ok(FusedMatrix { name: name.to_string(), parts, offsets, rows, cols })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn parts(&self) -> &[Arc<PackedMatrix>] {
        &self.parts
    }

    /// Bytes one product streams: the parts' together.
    pub fn weight_bytes(&self) -> usize {
        self.parts.iter().map(|p| p.weight_bytes()).sum()
    }

    /// Err naming the first part when this CPU does not run `kernel` (every format runs on every kernel).
    pub fn check_kernel(&self, kernel: Kernel) -> Result<(), GemvError> {
        self.parts[0].check_kernel(kernel)
    }

    /// `x` (`[m, cols]`) checked and quantized once for every part (see the module docs); an error names
    /// this product, not its first part.
    pub fn quantize_input(&self, x: &[f32], m: usize) -> Result<quantize::QuantizedActs, GemvError> {
        self.parts[0].quantize_input(x, m).map_err(|e| self.named(e))
    }

    /// `e` naming this product where it named its first part (a product of one part: the same name).
    fn named(&self, e: GemvError) -> GemvError {
        match e {
            GemvError::NonFiniteInput { row, col, .. } => GemvError::NonFiniteInput { tensor: self.name.clone(), row, col },
            GemvError::Input { reason, .. } => GemvError::Input { tensor: self.name.clone(), reason },
            other => other,
        }
    }

    /// How many chunks the product with `m` rows is claimed in on `threads` threads: each part's own.
    pub fn chunks(&self, m: usize, threads: usize) -> usize {
        self.parts.iter().map(|p| p.chunks(m, threads)).sum()
    }

    /// Chunk `c` of [`FusedMatrix::chunks`]`(acts.m, threads)`: one chunk of one part, written into that
    /// part's columns of `out` (row-major `[m, rows]`).
    ///
    /// # Safety
    /// `out` points at `m * rows` writable floats (`m = acts.m`), no other thread reads or writes
    /// this chunk's columns while this runs, `kernel.supported()`, and `acts` came from
    /// [`FusedMatrix::quantize_input`] of this product. A `c` past the chunks panics.
    pub unsafe fn chunk_into(&self, kernel: Kernel, acts: &quantize::QuantizedActs, threads: usize, c: usize,
                             out: *mut f32) {
        let mut c = c;
        for (p, &offset) in self.parts.iter().zip(&self.offsets) {
            let chunks = p.chunks(acts.m, threads);
            if c < chunks {
                // SAFETY: the part's columns `offset..offset + p.rows()` lie inside each of `out`'s `m`
                // rows of `self.rows` floats (offsets sum the rows before it), the chunk's tiles are
                // this call's alone (the contract), and `acts` fits every part (their `cols` agree).
                unsafe { p.tiles_into_rows(kernel, acts, p.chunk_tiles(c, chunks), out.add(offset), self.rows) };
                return;
            }
            c -= chunks;
        }
        panic!("tensor {:?}: chunk past the product's {} chunks", self.name, self.chunks(acts.m, threads));
    }

    /// `out[m, rows] = x[m, cols] @ W^T`, as [`PackedMatrix::matmul`] does for one format: the parts'
    /// chunks over one pool of `threads` workers, the input quantized once.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32], threads: usize, kernel: Kernel) -> Result<(), GemvError> {
        if let [one] = &self.parts[..] {
            return one.matmul(x, m, out, threads, kernel);
        }
        let acts = self.quantize_input(x, m)?;
        if out.len() != m * self.rows {
            return Err(GemvError::Input {
                tensor: self.name.clone(),
                reason: format!("out has {} values; [{m}, {}] needs {}", out.len(), self.rows, m * self.rows),
            });
        }
        pool::check_threads(threads)?;
        self.check_kernel(kernel).map_err(|e| self.named(e))?;
        let dst = SendPtr(out.as_mut_ptr());
        let chunks = self.chunks(m, threads);
        if threads == 1 {
            for c in 0..chunks {
                // SAFETY: `out` is `[m, rows]` (checked above) and this thread alone writes it; the
                // kernel is supported and `acts` was quantized for this product.
                unsafe { self.chunk_into(kernel, &acts, threads, c, dst.at(0)) };
            }
        } else {
            let team = pool::team(threads)?;
            team.run(chunks, &|c: usize| {
                // SAFETY: as above; chunks cover disjoint tiles of disjoint parts, so no two threads
                // write one column.
                unsafe { self.chunk_into(kernel, &acts, threads, c, dst.at(0)) };
            })?;
        }
        Ok(())
    }
}
