//! The Intel AMX kernel (`tdpbssd`): many activation rows (prefill, M >= 16) against one 16-row tile.
//!
//! Why: the VNNI kernel spends 8 `vpdpbusd` per (activation row, block) on the integer sums, and a
//! row's float steps are only 3 or 4 more; one `tdpbssd` computes a whole block's sums for 16
//! activation rows x 16 weight rows (the C tile), so what is left per row is the float work.
//!
//! Tiles (configured per thread's run of tiles, see `Tiles`; all 8 registers, see `RING`): A =
//! 16 activation rows x 32 bytes of one block, loaded straight from `acts.qs` with stride `k`;
//! B = the block's weights as 8 rows (4-byte groups of K) x 64 bytes (16 weight rows x 4 bytes),
//! which is the packed Q8_0 layout itself (`pack.rs`) and, for Q4, the nibbles unpacked into a
//! scratch block: B row `2v` = low nibbles (elements `8v + i`), row `2v + 1` = high nibbles
//! (`8v + 4 + i`), minus 8 for Q4_0, so every format is signed x signed with no correction after
//! (`sum (q - 8) a = sum q a - 8 sum a` exactly). C = 16 x 16 int32, zeroed per block (scales
//! differ per block, so integer sums cannot run across blocks), stored, and read back row by row:
//! C's row `r` is activation row `r` with weight row `j` in lane `j`, the VNNI kernel's layout, so
//! the float steps are `scalar.rs`'s, lane by lane, in block order (the same bits).
//!
//! The integer sums are exact (|sum| <= 32 * 128 * 127 < 2^31), so any kernel's bits are these.
//! Rows past the last group of 16 run on the AVX-512 kernel (every CPU with AMX has AVX-512).

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::avx512;
use super::format::{Format, QK};
use super::pack::TILE;
use super::quantize::QuantizedActs;

/// Whether this CPU and OS run the kernel: CPUID's AMX-TILE and AMX-INT8, AVX-512 for the float
/// steps, and Linux's permission to use the tile data (asked for once per process; never assumed).
pub fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| cpu_has_amx_int8() && avx512::supported() && request_tile_permission())
}

/// CPUID leaf 7, sub-leaf 0, EDX bit 24 (AMX-TILE) and bit 25 (AMX-INT8). (`is_x86_feature_detected!`
/// does not take the AMX names on stable Rust.)
fn cpu_has_amx_int8() -> bool {
    // SAFETY: CPUID exists on every x86-64 CPU (the `unsafe` is for compilers before 1.94, where
    // the intrinsics were unsafe functions).
    #[allow(unused_unsafe)]
    let (max_leaf, edx) = unsafe { (__cpuid(0).eax, __cpuid_count(7, 0).edx) };
    max_leaf >= 7 && edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

/// Linux's `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: until a process has asked, the
/// kernel does not save the 8 KB of tile data on a context switch, and the first tile instruction
/// faults (SIGILL). The permission is the process's (every thread's, the pool's included).
#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: the arch_prctl system call reads only its two integer arguments and writes only rax
    // (the result) and rcx / r11 (which `syscall` itself clobbers, declared here); it touches no
    // memory of this process and does not use the stack.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

/// Elsewhere: not supported (how another OS grants the tile state is not known here).
#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// The tile registers (all 8): a pass's A and B tiles (one pair per block of the pass), and two sets
/// of C tiles, alternating by pass, so one pass's products run while the last pass's are stored.
const A0: u8 = 0;
const B0: u8 = 1;
const A1: u8 = 3;
const B1: u8 = 6;
/// C tiles of even passes (first and second block), then of odd ones.
const CE0: u8 = 2;
const CE1: u8 = 4;
const CO0: u8 = 5;
const CO1: u8 = 7;

/// `ldtilecfg`'s 64-byte operand, palette 1: bytes 16.. hold each tile's bytes per row (u16), 48..
/// its rows.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1; // palette 1
        let mut set = |t: u8, rows: u8, colsb: u16| {
            c[16 + 2 * t as usize..18 + 2 * t as usize].copy_from_slice(&colsb.to_le_bytes());
            c[48 + t as usize] = rows;
        };
        for a in [A0, A1] {
            set(a, TILE as u8, QK as u16); // 16 activation rows x 32 int8 (one block)
        }
        for b in [B0, B1] {
            set(b, (QK / 4) as u8, 4 * TILE as u16); // 8 groups of 4 values x 16 weight rows x 4
        }
        for cc in [CE0, CE1, CO0, CO1] {
            set(cc, TILE as u8, 4 * TILE as u16); // 16 x 16 int32
        }
        TileConfig(c)
    }
}

/// Blocks per pass: two (A, B) pairs, with the two C sets all 8 tile registers.
const BLOCKS_PER_PASS: usize = 2;

/// Passes in flight in the scratch ring. Why this schedule (Intel Xeon, 4.1 GHz, 2026-12-04, in a
/// loop of tile instructions alone): one `tdpbssd` per ~18 cycles at best, but a tile load waits
/// until every older tile store has reached the cache, so "load, multiply, store" costs ~108 cycles
/// a round whatever it holds (1 or 3 blocks), and a load of C right after its store stalls too.
/// So pass `p` is: load its A / B tiles; store pass `p - 1`'s C tiles (multiplied a pass ago);
/// zero and multiply pass `p` into the other C set; the float steps of pass `p - 2` (stored a pass
/// ago); unpack pass `p + 1`'s Q4 quants (vector stores read by the next pass's tile loads). Alone,
/// the tile part then costs ~32 cycles a block instead of ~54. In the kernel the float steps
/// (~2.1 cycles a row and block alone) overlap the tile part little: 5-8 cycles a (row, block)
/// against AVX-512 VNNI's 9-10 (`cargo bench --bench gemv_rows`); the schedules tried (one block a
/// pass; float steps one pass behind, before or after the store) all measured within 10% of this.
const RING: usize = 2;

/// A 64-byte-aligned scratch ring by pass: the C tiles as stored (one row of 16 int32 per activation
/// row) and the unpacked Q4 B tiles, per block of the pass.
#[repr(C, align(64))]
struct Scratch {
    c: [[[i32; TILE * TILE]; BLOCKS_PER_PASS]; RING],
    b: [[[i8; QK * TILE]; BLOCKS_PER_PASS]; RING],
}

/// This thread's tile configuration, held while it lives (`tilerelease` on drop). Why a guard:
/// `ldtilecfg` + `tilerelease` cost ~50 ns, and configuring per 16-row tile of the product cost
/// ~15% at M = 16, so `matmul` holds one for each thread's run of tiles ([`super::Kernel`]).
pub(crate) struct Tiles(std::marker::PhantomData<*const ()>); // not Send: the tile state is the thread's

thread_local! {
    /// Whether a `Tiles` lives on this thread.
    static CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Tiles {
    /// Configures this thread's tiles, unless a `Tiles` already holds them (then `None`).
    ///
    /// # Safety
    /// The CPU and OS must run the kernel (`supported()`).
    pub(crate) unsafe fn configure() -> Option<Tiles> {
        if CONFIGURED.get() {
            return None;
        }
        let cfg = TileConfig::new();
        // SAFETY: `supported()` holds (AMX-TILE, and the OS's permission), and `cfg` is a valid
        // palette-1 configuration of 64 readable bytes; it only sets this thread's tile state.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly, preserves_flags)) };
        CONFIGURED.set(true);
        Some(Tiles(std::marker::PhantomData))
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        CONFIGURED.set(false);
        // SAFETY: this thread's tiles were configured by this guard (it is not Send); releasing them
        // returns the tile state to its initial one, and no tile instruction runs until the next guard.
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// Same contract as `scalar::tile`. Uses this thread's `Tiles` if one lives, else configures its own.
///
/// # Safety
/// The CPU and OS must run the kernel (`supported()`); slice lengths as in `avx2::tile`'s `# Safety`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn tile(format: Format, tile: &[u8], blocks: usize, acts: &QuantizedActs, out: &mut [f32]) {
    let full = acts.m / TILE * TILE;
    if full > 0 {
        // SAFETY: `supported()` is this function's contract.
        let _own = unsafe { Tiles::configure() };
        for m0 in (0..full).step_by(TILE) {
            // SAFETY: this function's contract, the tiles configured (by `_own` or the thread's
            // guard), and m0 + 16 <= acts.m.
            unsafe {
                match format {
                    Format::Q4_0 => group::<0>(tile, blocks, acts, m0, out),
                    Format::Q4_1 => group::<1>(tile, blocks, acts, m0, out),
                    Format::Q8_0 => group::<2>(tile, blocks, acts, m0, out),
                }
            }
        }
    }
    if full < acts.m {
        // SAFETY: AVX-512 F/BW/VNNI is part of `supported()`; the slices are this function's.
        unsafe { avx512::tile_from(format, tile, blocks, acts, full, out) };
    }
}

/// The format of `group`'s constant `F`.
const FORMATS: [Format; 3] = [Format::Q4_0, Format::Q4_1, Format::Q8_0];

/// Activation rows `m0 .. m0 + 16` of `tile`'s contract, for the format `FORMATS[F]`.
///
/// # Safety
/// As `tile`, `m0 + 16 <= acts.m`, and this thread's tiles configured as `TileConfig::new()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn group<const F: usize>(tile: &[u8], blocks: usize, acts: &QuantizedActs, m0: usize, out: &mut [f32]) {
    let format = FORMATS[F];
    let tbb = TILE * format.block_bytes();
    let qoff = if format.has_min() { 4 * TILE } else { 2 * TILE };
    let k = blocks * QK;
    // Not zeroed (6 KB a group): every C tile is stored, and every B tile unpacked, before it is read.
    let mut scratch = std::mem::MaybeUninit::<Scratch>::uninit();
    let sp = scratch.as_mut_ptr();
    // SAFETY: places inside `scratch` (no reference to its uninitialized bytes is made).
    let (cs, bs) = unsafe { (&raw mut (*sp).c as *mut i32, &raw mut (*sp).b as *mut i8) };
    // the C tile (slot, u) and the B tile (slot, u) of the ring
    let c_at = |slot: usize, u: usize| cs.wrapping_add((slot * BLOCKS_PER_PASS + u) * TILE * TILE);
    let b_at = |slot: usize, u: usize| bs.wrapping_add((slot * BLOCKS_PER_PASS + u) * QK * TILE);
    let mut acc = [_mm512_setzero_ps(); TILE];
    let passes = blocks.div_ceil(BLOCKS_PER_PASS);
    // (first block, blocks) of pass `p`
    let pass = |p: usize| (p * BLOCKS_PER_PASS, (blocks - p * BLOCKS_PER_PASS).min(BLOCKS_PER_PASS));
    // SAFETY (all blocks below): every pass p < passes has b0 + n <= blocks, so each block's tile
    // bytes (`tbb` from `b * tbb`) lie inside `tile`, and each A tile (16 rows of 32 bytes at
    // `(m0 + r) * k + b * 32`, r < 16, m0 + 16 <= m) inside `acts.qs` (`m * k` bytes); the scratch
    // is this frame's, 64-byte aligned, and indexed below its ring and pass sizes.
    if format != Format::Q8_0 {
        let (b0, n) = pass(0);
        // SAFETY: as above.
        unsafe { unpack_pass(tile.as_ptr().add(b0 * tbb + qoff), tbb, n, b_at(0, 0), format == Format::Q4_0) };
    }
    for p in 0..passes + 2 {
        if p < passes {
            let (b0, n) = pass(p);
            // SAFETY: as above.
            unsafe {
                let blk = tile.as_ptr().add(b0 * tbb);
                if m0 == 0 {
                    avx512::prefetch_ahead::<8>(blk, n * tbb); // the first group streams the weights
                }
                let bq: [*const i8; 2] = if format == Format::Q8_0 {
                    [blk.add(qoff) as *const i8, blk.add((tbb + qoff) * (n - 1)) as *const i8]
                } else {
                    [b_at(p % RING, 0) as *const i8, b_at(p % RING, n - 1) as *const i8]
                };
                load_pass(n, acts.qs.as_ptr().add(m0 * k + b0 * QK), k, bq);
            }
        }
        if (1..=passes).contains(&(p)) {
            let n = pass(p - 1).1;
            // SAFETY: as above; pass p - 1's C set was multiplied in the last iteration.
            unsafe { store_pass((p - 1) % 2, n, c_at((p - 1) % RING, 0)) };
        }
        if p < passes {
            // SAFETY: the tiles are configured and this pass's A / B tiles loaded.
            unsafe { multiply_pass(p % 2, pass(p).1) };
        }
        if (2..passes + 2).contains(&p) {
            let (b0, n) = pass(p - 2);
            for u in 0..n {
                // SAFETY: as above; the C tile of block b0 + u was stored in the last iteration.
                unsafe {
                    float_steps::<F>(&mut acc, tile.as_ptr().add((b0 + u) * tbb), c_at((p - 2) % RING, u), acts,
                                     m0, blocks, b0 + u)
                };
            }
        }
        if format != Format::Q8_0 && p + 1 < passes {
            let (b1, n1) = pass(p + 1);
            // SAFETY: as above; this ring slot's last reader (pass p - 1's tile loads) came before.
            unsafe { unpack_pass(tile.as_ptr().add(b1 * tbb + qoff), tbb, n1, b_at((p + 1) % RING, 0), format == Format::Q4_0) };
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let o = &mut out[(m0 + r) * TILE..(m0 + r + 1) * TILE];
        // SAFETY: `o` has exactly 16 f32, room for one unaligned 16-lane store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *acc) };
    }
}

/// A pass's A / B tiles: `n` (1 or 2) blocks, A from `a` (and `a + 32`) with stride `k`, B from
/// `b[u]` with stride 64.
///
/// # Safety
/// Tiles configured as `TileConfig::new()`; `a`'s 16 rows of 32 (64 if n = 2) bytes at stride `k`
/// readable, and each `b[u]` (u < n) for 512 bytes.
#[inline(always)]
unsafe fn load_pass(n: usize, a: *const i8, k: usize, b: [*const i8; 2]) {
    // SAFETY: the caller's contract; tile loads touch no flags and no stack.
    unsafe {
        asm!("tileloadd tmm{A0}, [{a} + {k}*1]", "tileloadd tmm{B0}, [{b0} + {s}*1]", A0 = const A0, B0 = const B0,
             a = in(reg) a, k = in(reg) k, b0 = in(reg) b[0], s = in(reg) 4 * TILE, options(nostack, readonly, preserves_flags));
        if n == 2 {
            asm!("tileloadd tmm{A1}, [{a} + {k}*1]", "tileloadd tmm{B1}, [{b1} + {s}*1]", A1 = const A1, B1 = const B1,
                 a = in(reg) a.add(QK), k = in(reg) k, b1 = in(reg) b[1], s = in(reg) 4 * TILE,
                 options(nostack, readonly, preserves_flags));
        }
    }
}

/// C set `set` (0: even passes, 1: odd) = A B for the pass's `n` blocks, zeroed first.
///
/// # Safety
/// Tiles configured as `TileConfig::new()`, the pass's A / B tiles loaded.
#[inline(always)]
unsafe fn multiply_pass(set: usize, n: usize) {
    macro_rules! multiply {
        ($c0:expr, $c1:expr) => {
            asm!("tilezero tmm{C}", "tdpbssd tmm{C}, tmm{A}, tmm{B}", C = const $c0, A = const A0, B = const B0,
                 options(nostack, nomem, preserves_flags));
            if n == 2 {
                asm!("tilezero tmm{C}", "tdpbssd tmm{C}, tmm{A}, tmm{B}", C = const $c1, A = const A1, B = const B1,
                     options(nostack, nomem, preserves_flags));
            }
        };
    }
    // SAFETY: the caller's contract; these touch tile registers only.
    unsafe {
        if set == 0 {
            multiply!(CE0, CE1);
        } else {
            multiply!(CO0, CO1);
        }
    }
}

/// C set `set`'s `n` tiles stored at `c` (and `c + 256` int32), rows 64 bytes apart.
///
/// # Safety
/// Tiles configured as `TileConfig::new()`; `c` writable for `n` KB.
#[inline(always)]
unsafe fn store_pass(set: usize, n: usize, c: *mut i32) {
    macro_rules! store {
        ($c0:expr, $c1:expr) => {
            asm!("tilestored [{c} + {s}*1], tmm{C}", C = const $c0, c = in(reg) c, s = in(reg) 4 * TILE,
                 options(nostack, preserves_flags));
            if n == 2 {
                asm!("tilestored [{c} + {s}*1], tmm{C}", C = const $c1, c = in(reg) c.add(TILE * TILE), s = in(reg) 4 * TILE,
                     options(nostack, preserves_flags));
            }
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        if set == 0 {
            store!(CE0, CE1);
        } else {
            store!(CO0, CO1);
        }
    }
}

/// Block `b`'s float steps for the group's 16 rows, as `scalar.rs` (lane `j` = weight row `j`):
/// `acc[r] = fma(d_w * d_a, isum, acc[r])`, then for Q4_1 `acc[r] = fma(m_w, dsum_a, acc[r])`.
///
/// # Safety
/// AVX-512 F; `blk` the block's tile bytes, `c` its stored C tile (64-byte aligned, 16 x 16
/// int32), `(m0 + 16) * blocks <= acts.d.len()` (and `dsum`'s), b < blocks.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn float_steps<const F: usize>(acc: &mut [__m512; TILE], blk: *const u8, c: *const i32, acts: &QuantizedActs,
                                      m0: usize, blocks: usize, b: usize) {
    let format = FORMATS[F];
    // SAFETY: the caller's contract: every read lies in `blk`'s scales, `c`'s 1 KB or `acts`' (row, block) values.
    unsafe {
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let mw = if format == Format::Q4_1 {
            _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * TILE) as *const __m256i))
        } else {
            _mm512_setzero_ps()
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            let ab = (m0 + r) * blocks + b;
            let isum = _mm512_load_si512(c.add(r * TILE) as *const __m512i);
            let s = _mm512_mul_ps(dw, _mm512_set1_ps(*acts.d.get_unchecked(ab)));
            *acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(isum), *acc);
            if format == Format::Q4_1 {
                *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*acts.dsum.get_unchecked(ab)), *acc);
            }
        }
    }
}

/// The `n` Q4 blocks of one pass (quants at `q`, `q + tbb`) unpacked by `unpack_q4` into `dst`
/// (and `dst + 512`).
///
/// # Safety
/// As `unpack_q4`, for each of the `n <= 2` blocks.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_pass(q: *const u8, tbb: usize, n: usize, dst: *mut i8, minus8: bool) {
    for u in 0..n {
        // SAFETY: the caller's contract.
        unsafe { unpack_q4(q.add(u * tbb), dst.add(u * QK * TILE), minus8) };
    }
}

/// A Q4 block's packed quants (4 x 64 bytes at `q`) as the B tile (8 x 64 bytes at `dst`): row
/// `2v` the low nibbles of vector `v`, row `2v + 1` the high ones, each minus 8 if `minus8` (Q4_0).
///
/// # Safety
/// AVX-512 F/BW; `q` readable for 256 bytes, `dst` writable for 512.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_q4(q: *const u8, dst: *mut i8, minus8: bool) {
    let low = _mm512_set1_epi8(0x0f);
    let eight = _mm512_set1_epi8(if minus8 { 8 } else { 0 });
    for v in 0..4 {
        // SAFETY: v < 4, so the reads lie in q's 256 bytes and the writes in dst's 512 (unaligned).
        unsafe {
            let raw = _mm512_loadu_si512(q.add(v * 64) as *const __m512i);
            let lo = _mm512_sub_epi8(_mm512_and_si512(raw, low), eight);
            let hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), eight);
            _mm512_storeu_si512(dst.add(128 * v) as *mut __m512i, lo);
            _mm512_storeu_si512(dst.add(128 * v + 64) as *mut __m512i, hi);
        }
    }
}
