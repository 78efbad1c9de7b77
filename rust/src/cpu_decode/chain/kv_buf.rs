//! The cache as the chain's threads reach it (see `Buf`).

use super::Buf;
use crate::cpu_decode::kv_cache::{Fp8Cache, KvCacheMut, Planes, PlanesMut};
use crate::cpu_decode::step::KvGeometry;

/// The cache, reached like the buffers: a layer's planes are written by the `after` of its QKV
/// rows and read by its attention items.
#[derive(Clone, Copy)]
pub(super) enum KvBuf {
    F32(Buf),
    Fp8(Buf<u8>, Fp8Cache),
}

impl KvBuf {
    pub(super) fn of(kv: &mut KvCacheMut<'_>) -> KvBuf {
        match kv {
            KvCacheMut::F32(v) => KvBuf::F32(Buf::of(v)),
            KvCacheMut::Fp8(c, fp8) => KvBuf::Fp8(Buf::of(c), *fp8),
        }
    }

    /// Layer `l`'s planes to read.
    ///
    /// # Safety
    /// As `Buf::read`; the cache holds `kvg`'s layers (checked by `forward_cache`).
    pub(super) unsafe fn layer(&self, l: usize, kvg: &KvGeometry) -> Planes<'_> {
        let p = kvg.plane();
        match self {
            KvBuf::F32(b) => {
                // SAFETY: the caller's contract.
                let (k, v) = unsafe { b.read() }[l * 2 * p..(l + 1) * 2 * p].split_at(p);
                Planes::F32 { k, v }
            }
            KvBuf::Fp8(b, fp8) => {
                // SAFETY: the caller's contract.
                let (k, v) = unsafe { b.read() }[l * 2 * p..(l + 1) * 2 * p].split_at(p);
                Planes::Fp8 { k, v, fp8: *fp8 }
            }
        }
    }

    /// Layer `l`'s planes to write.
    ///
    /// # Safety
    /// As `Buf::write`; the cache holds `kvg`'s layers.
    pub(super) unsafe fn layer_mut(&self, l: usize, kvg: &KvGeometry) -> PlanesMut<'_> {
        let p = kvg.plane();
        match self {
            KvBuf::F32(b) => {
                // SAFETY: the caller's contract.
                let (k, v) = unsafe { b.write() }[l * 2 * p..(l + 1) * 2 * p].split_at_mut(p);
                PlanesMut::F32 { k, v }
            }
            KvBuf::Fp8(b, fp8) => {
                // SAFETY: the caller's contract.
                let (k, v) = unsafe { b.write() }[l * 2 * p..(l + 1) * 2 * p].split_at_mut(p);
                PlanesMut::Fp8 { k, v, fp8: *fp8 }
            }
        }
    }
}
