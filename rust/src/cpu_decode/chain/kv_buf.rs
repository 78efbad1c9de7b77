//! The cache as the chain's threads reach it (see `Buf`): a layer's planes are written by the
//! `after` of its QKV rows (alone) and read by its attention items (all at once), through one
//! split of the cache into layers ([`KvCache::layer`], [`KvCacheMut::into_layer_mut`]).

use super::Buf;
use crate::cpu_decode::kv_cache::{Fp8Cache, KvCache, KvCacheMut};

#[derive(Clone, Copy)]
pub(super) enum KvBuf {
    F32(Buf),
    Bf16(Buf<u16>),
    Fp8(Buf<u8>, Fp8Cache),
}

impl KvBuf {
    pub(super) fn of(kv: &mut KvCacheMut<'_>) -> KvBuf {
        match kv {
            KvCacheMut::F32(v) => KvBuf::F32(Buf::of(v)),
            KvCacheMut::Bf16(c) => KvBuf::Bf16(Buf::of(c)),
            KvCacheMut::Fp8(c, fp8) => KvBuf::Fp8(Buf::of(c), *fp8),
        }
    }

    /// The cache to read.
    ///
    /// # Safety
    /// As `Buf::read`.
    pub(super) unsafe fn read(&self) -> KvCache<'_> {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                KvBuf::F32(b) => KvCache::F32(b.read()),
                KvBuf::Bf16(b) => KvCache::Bf16(b.read()),
                KvBuf::Fp8(b, fp8) => KvCache::Fp8(b.read(), *fp8),
            }
        }
    }

    /// The cache to write.
    ///
    /// # Safety
    /// As `Buf::write`.
    pub(super) unsafe fn write(&self) -> KvCacheMut<'_> {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                KvBuf::F32(b) => KvCacheMut::F32(b.write()),
                KvBuf::Bf16(b) => KvCacheMut::Bf16(b.write()),
                KvBuf::Fp8(b, fp8) => KvCacheMut::Fp8(b.write(), *fp8),
            }
        }
    }
}
