//! Where attention reads a layer's keys and values: a float32 plane in place, or a bfloat16 or fp8
//! plane's codes widened run by run into a per-thread buffer the loops then read as a float32 plane. One
//! reader for both ways attention is shared out ([`super::attention`] by KV head,
//! [`super::attention_split`] by key part and column piece), so both read the same bits.

use std::cell::RefCell;

use super::kv_bf16;
use super::kv_cache::Planes;
use super::kv_fp8::{widen_rows, Fp8};

/// Where a unit's keys (or values) are read: a float32 plane, or a bfloat16 or fp8 one whose codes are
/// widened run by run ([`each_run`]) into a buffer the loops then read as a float32 plane.
/// Widened values are `code * scale` ([`widen_rows`]; a bfloat16's exact float32): the bits a
/// float32 page of those values holds, so the loops after compute the same bits either way.
#[derive(Clone, Copy)]
pub(super) enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    Fp8 { codes: &'a [u8], format: Fp8, scale: f32 },
}

impl<'a> Rows<'a> {
    /// A layer's K and V sources from `offset` on (a KV head's, or a column's, first value of
    /// each key at the key's start).
    pub(super) fn of(planes: Planes<'a>, offset: usize) -> (Rows<'a>, Rows<'a>) {
        match planes {
            Planes::F32 { k, v } => (Rows::F32(&k[offset..]), Rows::F32(&v[offset..])),
            Planes::Bf16 { k, v } => (Rows::Bf16(&k[offset..]), Rows::Bf16(&v[offset..])),
            Planes::Fp8 { k, v, fp8 } => (
                Rows::Fp8 { codes: &k[offset..], format: fp8.format, scale: fp8.k_scale },
                Rows::Fp8 { codes: &v[offset..], format: fp8.format, scale: fp8.v_scale },
            ),
        }
    }
}

impl Rows<'_> {
    /// Keys a pass takes at a time from this source: all `n` from a float32 plane (the loops read
    /// it in place and ask for what is ahead themselves), `RUN` from a bfloat16 or fp8 one.
    #[inline(always)]
    fn run_len(&self, n: usize) -> usize {
        match self {
            Rows::F32(_) => n.max(1),
            Rows::Bf16(_) | Rows::Fp8 { .. } => RUN,
        }
    }

    /// The plane and key offsets the loops read for `run` (offsets into this source, `width`
    /// floats from each): the source itself, or the run's rows widened into `wide` (`dense` holds
    /// `0, width, 2 width, ..`: one row after another).
    #[inline(always)]
    fn run<'s>(&'s self, run: &'s [usize], width: usize, wide: &'s mut [f32], dense: &'s [usize]) -> (&'s [f32], &'s [usize]) {
        match *self {
            Rows::F32(plane) => (plane, run),
            Rows::Bf16(codes) => {
                let wide = &mut wide[..run.len() * width];
                kv_bf16::widen_rows(codes, run, width, wide);
                (wide, &dense[..run.len()])
            }
            Rows::Fp8 { codes, format, scale } => {
                let wide = &mut wide[..run.len() * width];
                widen_rows(format, codes, run, width, scale, wide);
                (wide, &dense[..run.len()])
            }
        }
    }
}

/// Keys of a bfloat16 or fp8 run ([`Rows::run`]): each pass widens the next `RUN` keys' rows (every KV head
/// a pass reads) into a buffer that stays in the L1 while every head reads it, then goes on. Why:
/// widening a whole unit's keys first (the first fp8 build) wrote and read back megabytes through
/// the L2 at long contexts, which cost what the 4x fewer bytes from memory saved (SmolLM2 at 1,000
/// keys: fp8 pages 63-75 tok/s against float32's 70-79); measured after in the README.
const RUN: usize = 16;


thread_local! {
    /// Per thread: a bfloat16 or fp8 run's widened rows and their offsets (`0, width, 2 width, ..`).
    static WIDE: RefCell<(Vec<f32>, Vec<usize>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Calls `f(plane, run offsets, first key)` for each run of `keys` read from `src`, `width`
/// values a key (from each key's start in `src`): the whole of a float32 plane at once, a bfloat16 or fp8 one
/// [`RUN`] keys at a time, widened into the per-thread buffer (12 KiB a run of SmolLM2's 3 KV heads,
/// read again from the L1 by every head of the pass).
#[inline(always)]
pub(super) fn each_run(src: Rows<'_>, keys: &[usize], width: usize, mut f: impl FnMut(&[f32], &[usize], usize)) {
    let n = keys.len();
    let step = src.run_len(n);
    WIDE.with(|cell| {
        let mut cell = cell.borrow_mut();
        let (wide, dense) = &mut *cell;
        if !matches!(src, Rows::F32(_)) && dense.get(1) != Some(&width) {
            wide.resize(RUN * width, 0.0);
            dense.clear();
            dense.extend((0..RUN).map(|t| t * width));
        }
        for t0 in (0..n).step_by(step) {
            let (plane, run) = src.run(&keys[t0..(t0 + step).min(n)], width, wide, dense);
            f(plane, run, t0);
        }
    });
}
