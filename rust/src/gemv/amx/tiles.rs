//! The tile registers: which of the 8 holds what, their `ldtilecfg` configuration, and the per-thread
//! guard that holds it ([`Tiles`]).
//!
//! Why separate: the register assignment is shared by the configuration and by every tile
//! instruction (`passes`), and the guard's lifetime (a thread's run of tiles) is the caller's,
//! not one product's.

use std::arch::asm;

use crate::gemv::format::QK;
use crate::gemv::pack::TILE;

/// The tile registers (all 8): a pass's A and B tiles (one pair per block of the pass), and two sets
/// of C tiles, alternating by pass, so one pass's products run while the last pass's are stored.
pub(super) const A0: u8 = 0;
pub(super) const B0: u8 = 1;
pub(super) const A1: u8 = 3;
pub(super) const B1: u8 = 6;
/// C tiles of even passes (first and second block), then of odd ones.
pub(super) const CE0: u8 = 2;
pub(super) const CE1: u8 = 4;
pub(super) const CO0: u8 = 5;
pub(super) const CO1: u8 = 7;

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

/// This thread's tile configuration, held while it lives (`tilerelease` on drop). Why a guard:
/// `ldtilecfg` + `tilerelease` cost ~50 ns, and configuring per 16-row tile of the product cost
/// ~15% at M = 16, so `matmul` holds one for each thread's run of tiles
/// ([`super::Kernel`](crate::gemv::Kernel)).
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
