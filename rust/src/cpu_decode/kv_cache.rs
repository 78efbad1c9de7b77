//! The KV cache as the fused decode gets it: float32 values, bfloat16 codes ([`super::kv_bf16`]),
//! or fp8 codes with their scales ([`super::kv_fp8`]). One layer's part is its K plane then its V
//! plane, each `[num_blocks, block_size, kv_heads, head_dim]` elements ([`KvGeometry::plane`]).

use super::kv_bf16;
use super::kv_fp8::Fp8;
use super::step::KvGeometry;

/// An fp8 cache's format and its per-tensor scales (a value is stored as `x / scale`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Cache {
    pub format: Fp8,
    pub k_scale: f32,
    pub v_scale: f32,
}

/// The whole cache `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`.
pub enum KvCacheMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
    Fp8(&'a mut [u8], Fp8Cache),
}

/// The whole cache, shared: what attention's items read, on every thread at once.
#[derive(Clone, Copy)]
pub enum KvCache<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    Fp8(&'a [u8], Fp8Cache),
}

/// One layer's K and V planes, for attention to read.
#[derive(Clone, Copy)]
pub enum Planes<'a> {
    F32 { k: &'a [f32], v: &'a [f32] },
    Bf16 { k: &'a [u16], v: &'a [u16] },
    Fp8 { k: &'a [u8], v: &'a [u8], fp8: Fp8Cache },
}

/// One layer's K and V planes, for the step's new rows to be written.
pub enum PlanesMut<'a> {
    F32 { k: &'a mut [f32], v: &'a mut [f32] },
    Bf16 { k: &'a mut [u16], v: &'a mut [u16] },
    Fp8 { k: &'a mut [u8], v: &'a mut [u8], fp8: Fp8Cache },
}

impl<'a> KvCache<'a> {
    /// Layer `l`'s planes (the caller checked the cache's length against `kvg`).
    pub fn layer(self, l: usize, kvg: &KvGeometry) -> Planes<'a> {
        let p = kvg.plane();
        match self {
            KvCache::F32(v) => {
                let (k, v) = v[kvg.layer_span(l)].split_at(p);
                Planes::F32 { k, v }
            }
            KvCache::Bf16(c) => {
                let (k, v) = c[kvg.layer_span(l)].split_at(p);
                Planes::Bf16 { k, v }
            }
            KvCache::Fp8(c, fp8) => {
                let (k, v) = c[kvg.layer_span(l)].split_at(p);
                Planes::Fp8 { k, v, fp8 }
            }
        }
    }
}

impl<'a> KvCacheMut<'a> {
    /// Elements (floats or codes) of the whole cache.
    pub fn len(&self) -> usize {
        match self {
            KvCacheMut::F32(v) => v.len(),
            KvCacheMut::Bf16(c) => c.len(),
            KvCacheMut::Fp8(c, _) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cache to read (see [`KvCache::layer`]).
    pub fn shared(&self) -> KvCache<'_> {
        match self {
            KvCacheMut::F32(v) => KvCache::F32(v),
            KvCacheMut::Bf16(c) => KvCache::Bf16(c),
            KvCacheMut::Fp8(c, fp8) => KvCache::Fp8(c, *fp8),
        }
    }

    /// The same cache for a shorter borrow (to take one layer's planes and keep the cache).
    pub fn reborrow(&mut self) -> KvCacheMut<'_> {
        match self {
            KvCacheMut::F32(v) => KvCacheMut::F32(v),
            KvCacheMut::Bf16(c) => KvCacheMut::Bf16(c),
            KvCacheMut::Fp8(c, fp8) => KvCacheMut::Fp8(c, *fp8),
        }
    }

    /// Layer `l`'s planes to write.
    pub fn into_layer_mut(self, l: usize, kvg: &KvGeometry) -> PlanesMut<'a> {
        let p = kvg.plane();
        match self {
            KvCacheMut::F32(v) => {
                let (k, v) = v[kvg.layer_span(l)].split_at_mut(p);
                PlanesMut::F32 { k, v }
            }
            KvCacheMut::Bf16(c) => {
                let (k, v) = c[kvg.layer_span(l)].split_at_mut(p);
                PlanesMut::Bf16 { k, v }
            }
            KvCacheMut::Fp8(c, fp8) => {
                let (k, v) = c[kvg.layer_span(l)].split_at_mut(p);
                PlanesMut::Fp8 { k, v, fp8 }
            }
        }
    }
}

impl PlanesMut<'_> {
    /// One slot's `d` values of a KV head at `at` (`KvGeometry::slot_offset`): K and V, stored
    /// as they are, rounded to bfloat16 (nearest even), or encoded (`x / scale`, saturated,
    /// rounded to nearest even).
    pub fn put(&mut self, at: usize, key: &[f32], value: &[f32]) {
        let d = key.len();
        match self {
            PlanesMut::F32 { k, v } => {
                k[at..at + d].copy_from_slice(key);
                v[at..at + d].copy_from_slice(value);
            }
            PlanesMut::Bf16 { k, v } => {
                for (c, &x) in k[at..at + d].iter_mut().zip(key) {
                    *c = kv_bf16::encode(x);
                }
                for (c, &x) in v[at..at + d].iter_mut().zip(value) {
                    *c = kv_bf16::encode(x);
                }
            }
            PlanesMut::Fp8 { k, v, fp8 } => {
                for (c, &x) in k[at..at + d].iter_mut().zip(key) {
                    *c = fp8.format.encode(x / fp8.k_scale);
                }
                for (c, &x) in v[at..at + d].iter_mut().zip(value) {
                    *c = fp8.format.encode(x / fp8.v_scale);
                }
            }
        }
    }
}
