//! GEMV / small GEMM (M = 1..8 rows) over GGUF block formats, with int8 activations.
//!
//! Why: batch-1 decode on a CPU streams every weight once per token, so it is bound by
//! memory bandwidth, and aten's int4/int8 kernels reach under 40% of it at M = 1. This
//! module reads the GGUF blocks as they are (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL (4-bit codes into an int8
//! table), Q6_K's 6-bit quants and scales, and Q4_K's and Q5_K's codes, 6-bit scales and minima,
//! IQ4_XS's codes and 6-bit scales, and Q3_K's 3-bit codes and 6-bit scales, a super-block of 256 at
//! a time), repacked once into
//! 16-row tiles ([`pack`]), quantizes the activations per block of 32 ([`quantize`]) and computes
//! integer dot products on the best kernel the CPU has, detected at run time ([`Kernel`]).
//!
//! Every kernel returns the same bits: integer sums inside a block, then the same f32 ops
//! in block order per row (see [`scalar`]). Bounds are checked here, at the boundary.
//!
//! Files: [`format`] (block formats), [`pack`] (tiles), [`quantize`] (activations),
//! [`scalar`] / [`avx2`] / [`avx512`] / [`amx`] (kernels; `prefetch`, the weight stream's
//! software prefetch they share), [`pool`] (threads), [`error`].

pub mod error;
pub mod format;
pub mod fused;
pub mod pack;
pub mod phases;
pub mod pool;
pub mod quantize;
pub mod rows;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
mod prefetch;
// AVX-512 intrinsics are stable since Rust 1.89 (see avx512/mod.rs).
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
pub mod avx512;
// Intel AMX through `asm!` (its intrinsics are unstable), AVX-512 for the float steps.
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
pub mod amx;

pub use error::GemvError;
pub use format::{Format, QK};
pub use fused::FusedMatrix;
pub use pack::{PackedMatrix, TILE};

/// An implementation of the tile kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    Avx2,
    Avx512Vnni,
    /// AMX for groups of 16 activation rows (prefill), the rest on AVX-512 VNNI.
    Amx,
}

impl Kernel {
    /// Every kernel, slowest first.
    pub const ALL: [Kernel; 4] = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512Vnni, Kernel::Amx];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512Vnni => "avx512_vnni",
            Kernel::Amx => "amx_int8",
        }
    }

    pub fn parse(name: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether this CPU can run it (detected at run time).
    pub fn supported(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::supported(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => avx512::supported(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => amx::supported(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every kernel this CPU runs, scalar first.
    pub fn available() -> Vec<Kernel> {
        Kernel::ALL.into_iter().filter(|k| k.supported()).collect()
    }

    /// The fastest kernel this CPU runs.
    pub fn best() -> Kernel {
        *Kernel::available().last().expect("scalar is always available")
    }

    /// Runs `f`, one thread's run of tiles of a product with `m` activation rows, with what the kernel
    /// keeps on the thread for them: AMX's tile configuration (set once per run, not per tile).
    fn on_thread<R>(self, m: usize, f: impl FnOnce() -> R) -> R {
        #[cfg(target_arch = "x86_64")]
        if self == Kernel::Amx && m >= TILE {
            // SAFETY: `matmul` checked `supported()` for this kernel.
            let _tiles = unsafe { amx::Tiles::configure() };
            return f();
        }
        let _ = m;
        f()
    }

    fn run(self, w: &PackedMatrix, t: usize, acts: &quantize::QuantizedActs, out: &mut [f32]) {
        let tile = w.tile(t);
        match self {
            Kernel::Scalar => scalar::tile(w.format, tile, w.blocks(), acts, out),
            // SAFETY: `matmul` checked `supported()` for this kernel; `tile` is one whole tile
            // of `tile_blocks()` blocks (`blocks` of 32 weights), `acts` holds `m * blocks` blocks
            // and `out` is `m * 16` long.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::tile(w.format, tile, w.blocks(), acts, out) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => unsafe { avx512::tile(w.format, tile, w.blocks(), acts, out) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => unsafe { amx::tile(w.format, tile, w.blocks(), acts, out) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("matmul checked supported()"),
        }
    }
}

/// The least work in one claimed chunk, in tile blocks (16 rows x 32 columns; ~5 ns each at M = 1;
/// counted so for every format, also Q4_K and Q5_K, whose kernel reads 8 of them at once: [`PackedMatrix::blocks`]):
/// claiming a chunk moves a cache line between cores, and chunks of 4 tiles of a 576-wide product
/// (0.4 us of work) left a hot 1536 x 576 Q4_1 product on 2 threads at 0.95x of 1 thread; with at
/// least 512 blocks a chunk it ran 1.25x (`cargo bench --bench gemv_rows -- avx512_vnni 2`, Intel
/// Xeon, 2026-12-04). 256 keeps more chunks to balance a late thread with.
const MIN_CHUNK_BLOCKS: usize = 256;

/// At M = 1 the least work in a chunk is this many tile blocks (divided by M up to M = 4, where
/// [`MIN_CHUNK_BLOCKS`] takes over): each chunk a thread claims starts a new stream of weights, and
/// SmolLM2's layer products at M = 1 on 2 threads, their weights in the L3 (30 layers' matrices in
/// turn), took 9.5 / 6.7 / 25.6 / 14.6 us (qkv, o, gate_up, down) with 4, 4, 12 and 4 chunks and
/// 9.4 / 6.7 / 23.9 / 14.0 with 2, 2, 4 and 2 (Intel Xeon, 2026-12-05; 2 threads against 1:
/// 1.48x -> 1.55x a layer). Larger M keeps today's chunks: its blocks are M times the work.
const MIN_CHUNK_BLOCKS_M1: usize = 1024;

/// Chunks a product of `tiles` tiles of `blocks` blocks with `m` activation rows is claimed in on
/// `threads` threads: about 16 per thread, each of at least `max(MIN_CHUNK_BLOCKS,
/// MIN_CHUNK_BLOCKS_M1 / m)` tile blocks, and a multiple of the threads where the tiles allow (a
/// 576-row product's 36 tiles made 3 chunks of 15, 15 and 6 tiles, so one of 2 threads did 21 of
/// them; then 4 chunks of 9).
fn chunk_count(tiles: usize, blocks: usize, m: usize, threads: usize) -> usize {
    let least = MIN_CHUNK_BLOCKS.max(MIN_CHUNK_BLOCKS_M1.div_ceil(m.max(1)));
    let per_chunk = tiles.div_ceil(16 * threads).max(least.div_ceil(blocks.max(1))).max(1);
    let chunks = tiles.div_ceil(per_chunk);
    (chunks.div_ceil(threads) * threads).min(tiles).max(1)
}

/// The tiles of chunk `c` of `chunks`: consecutive, within one tile of the same size, covering all.
fn chunk_range(c: usize, chunks: usize, tiles: usize) -> std::ops::Range<usize> {
    c * tiles / chunks..(c + 1) * tiles / chunks
}

/// `out`'s start, shared by the parts of one call (each writes only its own tiles' columns).
struct SendPtr(*mut f32);

// SAFETY: the parts of one call write disjoint ranges through it (see `matmul`).
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer `i` floats on (a method, so closures capture the `Sync` wrapper, not the field).
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

impl PackedMatrix {
    /// `out[m, N] = x[m, K] @ W^T` with `x` quantized per block of 32 to int8.
    ///
    /// Output rows are split over a persistent pool of `threads` workers (1: the calling
    /// thread alone). Errors name the tensor: a shape mismatch, a non-finite input, an
    /// unsupported kernel, `threads` outside 1 to [`pool::MAX_THREADS`].
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32], threads: usize, kernel: Kernel) -> Result<(), GemvError> {
        self.check_input(x, m)?;
        if out.len() != m * self.rows {
            return Err(self.input_error(format!("out has {} values; [{m}, {}] needs {}", out.len(), self.rows, m * self.rows)));
        }
        pool::check_threads(threads)?; // up front: also when one tile runs on the caller alone
        self.check_kernel(kernel)?;
        let acts = self.quantize_input(x, m)?;
        let tiles = self.tiles();
        let dst = SendPtr(out.as_mut_ptr());
        if threads == 1 || tiles == 1 {
            // SAFETY: `out` is `[m, rows]` (checked above) and this thread alone writes it;
            // the kernel is supported and `acts` was quantized for `m` rows of this matrix.
            unsafe { self.tiles_into(kernel, &acts, 0..tiles, dst.at(0)) };
        } else {
            let team = pool::team(threads)?;
            // chunks of whole tiles, about 16 per thread: small enough to balance (a thread
            // may be late), large enough that claiming one costs little next to it
            let chunks = self.chunks(m, team.threads());
            team.run(chunks, &|c: usize| {
                // SAFETY: as above; chunks cover disjoint tiles, so no two threads write one column.
                unsafe { self.tiles_into(kernel, &acts, chunk_range(c, chunks, tiles), dst.at(0)) };
            })?;
        }
        Ok(())
    }

    fn input_error(&self, reason: String) -> GemvError {
        GemvError::Input { tensor: self.name.clone(), reason }
    }

    /// Err naming the tensor when this CPU does not run `kernel`.
    pub fn check_kernel(&self, kernel: Kernel) -> Result<(), GemvError> {
        if !kernel.supported() {
            return Err(self.input_error(format!("kernel {:?} is not supported by this CPU", kernel.name())));
        }
        Ok(())
    }

    fn check_input(&self, x: &[f32], m: usize) -> Result<(), GemvError> {
        if m == 0 {
            return Err(self.input_error("x has 0 rows; need >= 1".to_string()));
        }
        if x.len() != m * self.cols {
            return Err(self.input_error(format!("x has {} values; [{m}, {}] needs {}", x.len(), self.cols, m * self.cols)));
        }
        Ok(())
    }

    /// `x` (`[m, cols]`) checked and quantized for this matrix's products: an error names the
    /// tensor when `m` is 0, the length is wrong or a value is not finite.
    pub fn quantize_input(&self, x: &[f32], m: usize) -> Result<quantize::QuantizedActs, GemvError> {
        self.check_input(x, m)?;
        quantize::quantize(x, m, self.cols)
            .map_err(|(row, col)| GemvError::NonFiniteInput { tensor: self.name.clone(), row, col })
    }

    /// How many chunks a product with `m` rows is claimed in on `threads` threads (see [`chunk_count`]).
    pub fn chunks(&self, m: usize, threads: usize) -> usize {
        chunk_count(self.tiles(), self.blocks(), m, threads)
    }

    /// The tiles of chunk `c` of `chunks` (consecutive, covering all once).
    pub fn chunk_tiles(&self, c: usize, chunks: usize) -> std::ops::Range<usize> {
        chunk_range(c, chunks, self.tiles())
    }

    /// Tiles `tiles` of the product: each computes its `m x 16` outputs into a buffer on this
    /// thread, then writes them where they go in `out` (row-major `[m, rows]`, starting at `out`),
    /// so no output crosses to another core to be copied (a whole-product buffer and a copy
    /// after cost ~3 us a call on 2 threads, measured on SmolLM2's shapes).
    ///
    /// # Safety
    /// `out` points at `m * rows` writable floats (`m = acts.m`), no other thread reads or writes
    /// the columns of these tiles while this runs, `kernel.supported()`, `acts` came from
    /// [`PackedMatrix::quantize_input`] of this matrix, and `tiles.end <= self.tiles()`.
    pub unsafe fn tiles_into(&self, kernel: Kernel, acts: &quantize::QuantizedActs, tiles: std::ops::Range<usize>,
                             out: *mut f32) {
        // SAFETY: the caller's contract, with this matrix's own rows as the stride.
        unsafe { self.tiles_into_rows(kernel, acts, tiles, out, self.rows) }
    }

    /// [`PackedMatrix::tiles_into`] into rows of `stride` floats: output row `mi`'s column `n` of this
    /// matrix goes to `out[mi * stride + n]` (this matrix as the columns `offset..offset + rows` of a
    /// wider output, `out` pointing at `offset`: one part of a [`fused::FusedMatrix`]).
    ///
    /// # Safety
    /// As [`PackedMatrix::tiles_into`], with `out` pointing at `(m - 1) * stride + rows` writable
    /// floats and `stride >= rows`.
    pub unsafe fn tiles_into_rows(&self, kernel: Kernel, acts: &quantize::QuantizedActs, tiles: std::ops::Range<usize>,
                                  out: *mut f32, stride: usize) {
        // a misuse is a panic here, never a kernel reading past the activations
        assert_eq!(acts.blocks, self.blocks(), "tensor {:?}: activations quantized for another width", self.name);
        assert!(tiles.end <= self.tiles(), "tensor {:?}: tiles {tiles:?} of {}", self.name, self.tiles());
        assert!(stride >= self.rows, "tensor {:?}: output rows of {stride} floats hold no {} columns", self.name, self.rows);
        let (m, rows) = (acts.m, self.rows);
        let chunk = m * TILE;
        let mut small = [0f32; 8 * TILE];
        let mut large = Vec::new();
        let buf: &mut [f32] = if chunk <= small.len() {
            &mut small[..chunk]
        } else {
            large.resize(chunk, 0f32);
            &mut large
        };
        kernel.on_thread(m, || {
            for t in tiles {
                kernel.run(self, t, acts, buf);
                let (n0, width) = (t * TILE, TILE.min(rows - t * TILE));
                for mi in 0..m {
                    // SAFETY: tile `t` lies inside the product (the contract), its columns
                    // `n0 .. n0 + width` of row `mi` lie inside `out`'s `(m - 1) * stride + rows`
                    // floats and no other thread touches them; `buf` holds `m * 16 >= (mi + 1) * 16` floats.
                    unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(mi * TILE), out.add(mi * stride + n0), width) };
                }
            }
        });
    }
}


#[cfg(test)]
mod chunk_tests {
    use super::*;

    #[test]
    fn chunks_cover_every_tile_once_and_share_out_evenly() {
        for (threads, m) in (1..=4).flat_map(|t| [1, 2, 4, 16].map(|m| (t, m))) {
            for tiles in 1..400 {
                for blocks in [1, 18, 48, 300] {
                    let chunks = chunk_count(tiles, blocks, m, threads);
                    let ranges: Vec<_> = (0..chunks).map(|c| chunk_range(c, chunks, tiles)).collect();
                    assert_eq!(ranges.first().unwrap().start, 0);
                    assert_eq!(ranges.last().unwrap().end, tiles);
                    assert!(ranges.windows(2).all(|w| w[0].end == w[1].start), "consecutive");
                    let sizes: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
                    let (lo, hi) = (*sizes.iter().min().unwrap(), *sizes.iter().max().unwrap());
                    assert!(lo >= 1 && hi - lo <= 1, "{tiles} tiles in {chunks}: {sizes:?}");
                    assert!(chunks % threads == 0 || chunks == tiles, "{tiles} tiles {blocks} blocks {threads} threads: {chunks}");
                }
            }
        }
        // SmolLM2's 576-row products on 2 threads at M >= 4 (at least 256 tile blocks a chunk): 4 chunks
        // of 9 tiles, not 15 + 15 + 6
        assert_eq!(chunk_count(36, 18, 4, 2), 4);
        assert_eq!(chunk_count(96, 18, 8, 2), 8);
        // M = 1: at least 1024 (SmolLM2's o, qkv, gate_up, down; its head keeps ~16 per thread)
        assert_eq!([(36, 18), (60, 18), (192, 18), (36, 48), (3072, 18)].map(|(t, b)| chunk_count(t, b, 1, 2)),
                   [2, 2, 4, 2, 32]);
    }
}
