//! What a [`super::BlockManager`]'s own bookkeeping costs in host memory, checked before any of it is
//! allocated.
//!
//! Why: every tier keeps per-block arrays (each block's cached tokens, hash, parent, reference count,
//! free-list entry), allocated up front. Sizes that pass the per-field range checks could still ask
//! for more memory than the machine has (400 million blocks of 16 tokens: ~45 GB; one block of 2^36
//! tokens: 256 GiB of cached-token slots), and a failed allocation in Rust aborts the process: the
//! Python interpreter died with SIGABRT instead of raising. Refusing a size larger than the host's
//! physical memory turns that into an error naming the fields; sizes below it that still fail would
//! need an overcommitted host, where the kernel, not this check, has the last word.

use crate::error::{invalid, CoreError};

/// Bytes each block of a tier costs beyond its cached-token slots, at least: its hash (16, an
/// `Option<u64>`), parent hash (8), reference count and free-list entry (4 each), and the eviction
/// policy's links (8 or more). A lower bound: the check refuses only what cannot fit.
const BYTES_PER_BLOCK: u128 = 40;
/// Bytes per cached token of a block (a `u32` token id).
const BYTES_PER_TOKEN: u128 = 4;

/// The least bytes a block of `block_size` tokens costs the bookkeeping of its tier.
fn per_block(block_size: usize) -> u128 {
    BYTES_PER_BLOCK + BYTES_PER_TOKEN * block_size as u128
}

/// The least bytes the bookkeeping of tiers of `blocks` blocks of `block_size` tokens needs (u128:
/// no product of two `usize`s overflows it).
pub(super) fn bookkeeping_bytes(blocks: [usize; 3], block_size: usize) -> u128 {
    blocks.iter().map(|&n| n as u128 * per_block(block_size)).sum()
}

/// Refuses tiers whose bookkeeping alone is larger than this host's physical memory, naming the
/// sizes that set it (`blocks`: device, host and disk blocks).
pub(super) fn check(blocks: [usize; 3], block_size: usize) -> Result<(), CoreError> {
    let need = bookkeeping_bytes(blocks, block_size);
    let Some(have) = physical_memory() else { return Ok(()) };
    if need > have as u128 {
        return Err(invalid!(
            "the block tables' bookkeeping would need at least {:.1} GiB of host memory (num_gpu_blocks {} + \
             num_cpu_blocks {} + num_disk_blocks {} blocks of block_size {} tokens, {} bytes a block), more than \
             this host's {:.1} GiB: use fewer or smaller blocks",
            need as f64 / (1u64 << 30) as f64, blocks[0], blocks[1], blocks[2], block_size, per_block(block_size),
            have as f64 / (1u64 << 30) as f64
        ));
    }
    Ok(())
}

#[cfg(target_os = "linux")]
extern "C" {
    fn sysconf(name: i32) -> i64;
}

/// The host's physical memory in bytes (`sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE)`), or None
/// where it cannot be read (another OS: no check).
fn physical_memory() -> Option<usize> {
    #[cfg(target_os = "linux")]
    {
        const SC_PAGESIZE: i32 = 30;
        const SC_PHYS_PAGES: i32 = 85;
        // SAFETY: sysconf reads a system constant; it takes no pointer and changes no state.
        let (pages, size) = unsafe { (sysconf(SC_PHYS_PAGES), sysconf(SC_PAGESIZE)) };
        if pages > 0 && size > 0 {
            return (pages as usize).checked_mul(size as usize);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes set from this host's memory, so the test means the same on a 24 GiB and a 2 TiB machine.
    #[cfg(target_os = "linux")]
    #[test]
    fn sizes_past_the_hosts_memory_are_refused_naming_the_fields() {
        let have = physical_memory().expect("linux") as u128;
        let past = (have / per_block(16) + 1) as usize;
        let e = check([past, 0, 0], 16).unwrap_err().to_string();
        assert!(e.contains(&format!("num_gpu_blocks {past}")) && e.contains("block_size 16"), "{e}");
        let e = check([0, 1, 0], (have / 4) as usize + 1).unwrap_err().to_string();  // one block, too many tokens
        assert!(e.contains("num_cpu_blocks 1") && e.contains("GiB"), "{e}");
        assert!(check([past / 4, past / 4, 0], 16).is_ok());  // half the host: allowed
        // no overflow at the extremes
        assert!(bookkeeping_bytes([usize::MAX; 3], usize::MAX) > u64::MAX as u128);
    }
}
