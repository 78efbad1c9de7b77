//! Memory that is streamed every step, placed in 2 MiB pages (Linux transparent huge pages).
//!
//! Why: a batch-1 decode step reads every weight once and each layer's K/V pages once, ~100 MB
//! on SmolLM2-135M, from memory. In 4 KiB pages that is ~25,000 pages a step, more than the
//! TLB holds, so every 4 KiB of a stream starts with a page walk and the hardware prefetchers,
//! which stop at a 4 KiB boundary, start over. Measured on an AMD EPYC (Zen 3, 2 cores,
//! 2026-12-06, `cargo bench --bench decode_stack -- 1024`): the GGUF products streamed their
//! weights at 13.3-14.1 GB/s from 4 KiB pages and at 17.2-19.2 GB/s from 2 MiB pages (the whole
//! process's heap put in huge pages by glibc's `glibc.malloc.hugetlb=1`, one run each, alternating);
//! attention over 1024 keys of 40 layers' pages took 281 against 195 us a layer.
//!
//! Two ways in: [`HugeBuf`] (the GEMV's packed weights: many matrices of 0.3-2 MB each,
//! which alone never cover a whole aligned 2 MiB page, carved one after another from 32 MiB
//! chunks that are), and [`advise`] (a buffer someone else allocated, such as the torch tensor
//! of the CPU's KV cache: its aligned interior, advised before its pages are first touched).
//!
//! Both are hints: where the kernel's THP setting is `never`, or on another OS, nothing
//! changes but the alignment, and no value read or written depends on which pages back it.

use std::alloc::{alloc, dealloc, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

/// The size and alignment of a huge page on x86-64 and arm64 Linux (the granule `advise` rounds to).
pub const HUGE_PAGE: usize = 2 << 20;
/// The chunks [`HugeBuf`]s are carved from; a buffer at least this large gets a chunk of its own.
const CHUNK: usize = 16 * HUGE_PAGE;
/// Each buffer starts on a cache line (the kernels' tiles are read as 64-byte vectors).
const ALIGN: usize = 64;

#[cfg(target_os = "linux")]
extern "C" {
    fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
}
#[cfg(target_os = "linux")]
const MADV_HUGEPAGE: i32 = 14;

/// Asks the kernel to back the whole 2 MiB pages inside `[ptr, ptr + len)` with huge pages
/// (pages touched after this; already-touched ones may be merged later by `khugepaged`).
/// Returns the bytes advised: 0 when the range holds no whole aligned huge page, on another OS,
/// or when the kernel refused (THP compiled out); never an error, since only speed depends on it.
pub fn advise(ptr: *const u8, len: usize) -> usize {
    let start = (ptr as usize).saturating_add(HUGE_PAGE - 1) & !(HUGE_PAGE - 1);
    let end = (ptr as usize).saturating_add(len) & !(HUGE_PAGE - 1);
    if end <= start {
        return 0;
    }
    advise_aligned(start, end - start)
}

#[cfg(target_os = "linux")]
fn advise_aligned(start: usize, len: usize) -> usize {
    // SAFETY: MADV_HUGEPAGE changes no byte of the range and no mapping's permissions or
    // contents: it only sets a flag on the mappings that cover it (EINVAL / ENOMEM for a range
    // that is not mapped, which we report as 0 advised). `start` is page-aligned (2 MiB).
    let r = unsafe { madvise(start as *mut std::ffi::c_void, len, MADV_HUGEPAGE) };
    if r == 0 { len } else { 0 }
}

#[cfg(not(target_os = "linux"))]
fn advise_aligned(_start: usize, _len: usize) -> usize {
    0
}

/// One 2 MiB-aligned allocation, advised whole, freed when its last [`HugeBuf`] drops.
#[derive(Debug)]
struct Chunk {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a chunk is plain bytes; each `HugeBuf` reaches only its own disjoint range of it, and
// the chunk itself is only freed (once, in `drop`).
unsafe impl Send for Chunk {}
// SAFETY: as above: `&Chunk` gives no access to the bytes.
unsafe impl Sync for Chunk {}

impl Chunk {
    fn new(size: usize) -> Chunk {
        let size = size.max(1).checked_next_multiple_of(HUGE_PAGE).expect("a buffer's size overflows usize");
        let layout = Layout::from_size_align(size, HUGE_PAGE).expect("a buffer's size fits isize");
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(ptr) else { std::alloc::handle_alloc_error(layout) };
        // advised before any byte is written, so the first touch of each 2 MiB faults in a huge page
        advise(ptr.as_ptr(), size);
        Chunk { ptr, layout }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once (the last `Arc` drops it).
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The chunk small buffers are carved from now, and how much of it is taken. Weak: a chunk
/// whose buffers all dropped is freed, not kept for the next buffer.
static CURRENT: Mutex<Option<(Weak<Chunk>, usize)>> = Mutex::new(None);

/// A zeroed byte buffer in 2 MiB pages: `Vec<u8>`'s role for data that is streamed every step.
/// Small buffers share a chunk (cache-line aligned, one after another), so a model's matrices
/// sit back to back in huge pages.
#[derive(Debug)]
pub struct HugeBuf {
    chunk: Arc<Chunk>,
    offset: usize,
    len: usize,
}

impl HugeBuf {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> HugeBuf {
        // (a size past usize panics here, as `vec![0u8; len]` would, instead of wrapping)
        let take = len.max(1).checked_next_multiple_of(ALIGN).expect("a buffer's size overflows usize");
        let (chunk, offset) = if take >= CHUNK {
            (Arc::new(Chunk::new(take)), 0)
        } else {
            let mut current = CURRENT.lock().unwrap_or_else(|p| p.into_inner());
            let open = current.as_ref().and_then(|(w, used)| w.upgrade().map(|c| (c, *used)))
                .filter(|(c, used)| used + take <= c.layout.size());
            let (chunk, offset) = open.unwrap_or_else(|| (Arc::new(Chunk::new(CHUNK)), 0));
            *current = Some((Arc::downgrade(&chunk), offset + take));
            (chunk, offset)
        };
        // SAFETY: `offset + len <= offset + take <= chunk size`: inside the allocation, and this
        // range is handed to no other buffer (the cursor moved past it under the lock).
        unsafe { std::ptr::write_bytes(chunk.ptr.as_ptr().add(offset), 0, len) };
        HugeBuf { chunk, offset, len }
    }
}

impl Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `offset..offset + len` lies inside the chunk (made in `zeroed`), initialized
        // (zeroed there), and only this buffer reaches it; the `Arc` keeps the chunk alive.
        unsafe { std::slice::from_raw_parts(self.chunk.ptr.as_ptr().add(self.offset), self.len) }
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `deref`; `&mut self` makes this the only borrow of this buffer's range, and no
        // other buffer's range overlaps it.
        unsafe { std::slice::from_raw_parts_mut(self.chunk.ptr.as_ptr().add(self.offset), self.len) }
    }
}

impl Clone for HugeBuf {
    fn clone(&self) -> HugeBuf {
        let mut copy = HugeBuf::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_aligned_and_disjoint() {
        let mut bufs: Vec<HugeBuf> = [0usize, 1, 63, 64, 65, 4096, 1 << 20, 3 << 20, CHUNK + 5].iter()
            .map(|&n| HugeBuf::zeroed(n)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            assert!(b.iter().all(|&x| x == 0), "buffer {i} zeroed");
            assert_eq!(b.as_ptr() as usize % ALIGN, 0, "buffer {i} on a cache line");
            b.fill(i as u8 + 1);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&x| x == i as u8 + 1), "buffer {i} kept its bytes: no other buffer overlaps it");
        }
        let copy = bufs[5].clone();
        assert_eq!(&copy[..], &bufs[5][..]);
        assert_ne!(copy.as_ptr(), bufs[5].as_ptr());
    }

    #[test]
    fn a_chunk_is_freed_with_its_last_buffer() {
        // (a small buffer's chunk is shared with buffers other tests make at the same time, so a
        // buffer of its own chunk shows the rule)
        let big = HugeBuf::zeroed(CHUNK);
        let small = HugeBuf::zeroed(1000);
        assert!(!Arc::ptr_eq(&small.chunk, &big.chunk), "a buffer of a chunk's size gets its own");
        let weak = Arc::downgrade(&big.chunk);
        drop(big);
        assert!(weak.upgrade().is_none());
    }

    #[test]
    #[should_panic(expected = "overflows usize")]
    fn a_size_past_usize_panics_instead_of_wrapping() {
        HugeBuf::zeroed(usize::MAX - 3);
    }

    #[test]
    fn advise_covers_only_whole_aligned_huge_pages() {
        assert_eq!(advise(std::ptr::null(), 0), 0);
        assert_eq!(advise((HUGE_PAGE + 1) as *const u8, HUGE_PAGE), 0, "no whole page inside");
        assert_eq!(advise(usize::MAX as *const u8, usize::MAX), 0, "no overflow");
        let chunk = Chunk::new(3 * HUGE_PAGE);
        let got = advise(chunk.ptr.as_ptr(), chunk.layout.size());
        assert!(got == 0 || got == 3 * HUGE_PAGE, "all of it or (THP compiled out / not Linux) none: {got}");
    }
}
