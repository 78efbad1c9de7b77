//! One pass's tile instructions: load its A / B tiles, zero and multiply into a C set, store a C set.
//!
//! Why separate: these are the only `asm!` tile instructions of the kernel's loop, each a fixed
//! register choice (`tiles`); `group` only decides in which order the passes' steps run.

use std::arch::asm;

use crate::gemv::format::QK;
use crate::gemv::pack::TILE;
use super::tiles::{A0, A1, B0, B1, CE0, CE1, CO0, CO1};

/// A pass's A / B tiles: `n` (1 or 2) blocks, A from `a` (and `a + 32`) with stride `k`, B from
/// `b[u]` with stride 64.
///
/// # Safety
/// Tiles configured as `TileConfig::new()`; `a`'s 16 rows of 32 (64 if n = 2) bytes at stride `k`
/// readable, and each `b[u]` (u < n) for 512 bytes.
#[inline(always)]
pub(super) unsafe fn load_pass(n: usize, a: *const i8, k: usize, b: [*const i8; 2]) {
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
pub(super) unsafe fn multiply_pass(set: usize, n: usize) {
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
pub(super) unsafe fn store_pass(set: usize, n: usize, c: *mut i32) {
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
