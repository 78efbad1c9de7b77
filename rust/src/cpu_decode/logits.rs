//! Each logits row's argmax and log-sum-exp, the two numbers a CPU step's sampling reads from
//! every row (the greedy token; the chosen token's log-probability `x[t] - logsumexp(x)`).
//!
//! Why: on the CPU these came from torch's `log_softmax` over the whole vocabulary, which writes
//! a `[rows, vocab]` result to read one entry per row: 38 ms a step at 256 x 49,152 on one
//! thread, and ~100 us at batch 1 where the op runs cold after the model (Intel Xeon,
//! 2026-12-05). Here a row is read twice (its maximum, then `sum(exp(x - max))`) and nothing is
//! written but two numbers. The GPU path already computes `x[t] - logsumexp(x)`.
//!
//! Numbers: the sum is [`Lanes::sum_exp`] (attention's softmax sum: `lanes::exp`, <= 2 ulp of
//! float64 in exactly specified IEEE steps, 8 lanes in index order, one fixed reduction), so the
//! portable and AVX2 builds give the same bits, whatever the thread count (a row is never split).
//! Special values follow `torch.logsumexp` and numpy's `argmax`: a row with a NaN has its
//! first NaN as argmax and NaN as log-sum-exp; a row whose maximum is +inf or -inf has that
//! maximum as log-sum-exp; ties go to the first maximal index.

#[cfg(target_arch = "x86_64")]
use super::lanes::Avx2;
use super::attention::Simd;
use super::lanes::{Lanes, Portable};
use super::ops::LANES;
use crate::gemv::{pool, GemvError};

/// One row's statistics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowStats {
    pub argmax: usize,
    pub logsumexp: f32,
}

/// `x`'s argmax and log-sum-exp (`x` not empty), the sum in the build `L`.
#[inline(always)]
fn row_stats<L: Lanes>(x: &[f32]) -> RowStats {
    let n = x.len() / LANES * LANES;
    // each lane's maximum and the first index holding it (strictly greater replaces), in one pass
    let mut lane_max = [f32::NEG_INFINITY; LANES];
    // u32 positions: lanes as wide as the values' (a row of 2^32 values or more is refused by the caller)
    let mut lane_at = [u32::MAX; LANES];
    let mut nan = false;
    let mut base = [0u32; LANES];
    for (i, b) in base.iter_mut().enumerate() {
        *b = i as u32;
    }
    for c in x[..n].chunks_exact(LANES) {
        for i in 0..LANES {
            nan |= c[i].is_nan();
            let greater = c[i] > lane_max[i];
            lane_max[i] = if greater { c[i] } else { lane_max[i] };
            lane_at[i] = if greater { base[i] } else { lane_at[i] };
            base[i] += LANES as u32;
        }
    }
    let mut max = f32::NEG_INFINITY;
    let mut argmax = usize::MAX;
    for (i, &v) in x[n..].iter().enumerate() {
        nan |= v.is_nan();
        if v > max {
            (max, argmax) = (v, n + i);
        }
    }
    if nan {
        let first = x.iter().position(|v| v.is_nan()).unwrap_or(0);
        return RowStats { argmax: first, logsumexp: f32::NAN };
    }
    // the first index holding the row's maximum: the smallest among the lanes (and the tail) that hold it
    for i in 0..LANES {
        let at = lane_at[i] as usize;
        if lane_at[i] != u32::MAX && (lane_max[i] > max || (lane_max[i] == max && at < argmax)) {
            (max, argmax) = (lane_max[i], at);
        }
    }
    let argmax = if argmax == usize::MAX { 0 } else { argmax }; // every value -inf: numpy's 0
    if max.is_infinite() {
        return RowStats { argmax, logsumexp: max };
    }
    let sum = L::sum_exp(x, max);
    // sum >= 1 (the maximum's own term), so the log is finite
    RowStats { argmax, logsumexp: max + sum.ln() }
}

/// `row_stats` compiled for AVX2 and FMA (the maximum's loop vectorized too; the sum is `Avx2::sum_exp`).
///
/// # Safety
/// The CPU runs AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_stats_avx2(x: &[f32]) -> RowStats {
    row_stats::<Avx2>(x)
}

/// `row_stats` in the build `simd` (attention's builds: `Simd::best()` where the CPU runs them).
fn stats_of(x: &[f32], simd: Simd) -> RowStats {
    match simd {
        Simd::Portable => row_stats::<Portable>(x),
        // SAFETY: `Simd::Avx2` is only chosen (by `best`) or passed (by callers that take `best`) on a
        // CPU that runs AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { row_stats_avx2(x) },
    }
}

/// The statistics of each of the `x.len() / cols` rows of `x` (row-major `[rows, cols]`), rows
/// shared over `threads` threads of the GEMV team (1: the caller alone), in the build `simd`
/// (`Simd::best()`; as for `attention::attend`, `Simd::Avx2` only where the CPU runs AVX2 and FMA).
/// Errors: `cols` 0, a length that is not whole rows, `threads` outside the team sizes.
pub fn row_stats_all(x: &[f32], cols: usize, threads: usize, simd: Simd) -> Result<Vec<RowStats>, GemvError> {
    let input = |reason: String| GemvError::Input { tensor: "logits".to_string(), reason };
    if cols == 0 || x.len() % cols != 0 {
        return Err(input(format!("has {} values; need whole rows of {cols} >= 1", x.len())));
    }
    if cols >= u32::MAX as usize {
        return Err(input(format!("rows of {cols} values; allowed: fewer than {}", u32::MAX)));
    }
    pool::check_threads(threads)?;
    let rows = x.len() / cols;
    let mut out = vec![RowStats { argmax: 0, logsumexp: 0.0 }; rows];
    if threads == 1 || rows < 2 {
        for (o, row) in out.iter_mut().zip(x.chunks_exact(cols)) {
            *o = stats_of(row, simd);
        }
        return Ok(out);
    }
    let slots: Vec<std::sync::Mutex<&mut RowStats>> = out.iter_mut().map(std::sync::Mutex::new).collect();
    pool::team(threads)?.run(rows, &|r: usize| {
        let stats = stats_of(&x[r * cols..(r + 1) * cols], simd);
        **slots[r].lock().unwrap_or_else(|e| e.into_inner()) = stats; // one row, one claim: never contended
    })?;
    drop(slots);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32]) -> (usize, f64) {
        if let Some(i) = x.iter().position(|v| v.is_nan()) {
            return (i, f64::NAN);
        }
        let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let first = x.iter().position(|&v| v == max).unwrap();
        if max.is_infinite() {
            return (first, max as f64);
        }
        let s: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
        (first, max as f64 + s.ln())
    }

    fn rows() -> Vec<Vec<f32>> {
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 40.0
        };
        let mut out = Vec::new();
        for len in [1usize, 7, 8, 9, 31, 257, 49_152] {
            out.push((0..len).map(|_| next()).collect::<Vec<f32>>());
        }
        let mut ties = vec![0.25f32; 100];
        ties[3] = 9.0;
        ties[77] = 9.0;
        out.push(ties);
        let mut neg: Vec<f32> = (0..50).map(|i| if i % 2 == 0 { f32::NEG_INFINITY } else { i as f32 }).collect();
        neg[49] = f32::NEG_INFINITY;
        out.push(neg);
        out.push(vec![f32::NEG_INFINITY; 20]);
        let mut pos = vec![1.0f32; 20];
        pos[11] = f32::INFINITY;
        out.push(pos);
        let mut nan = vec![1.0f32; 40];
        nan[30] = f32::NAN;
        nan[35] = f32::NAN;
        out.push(nan);
        out.push(vec![-1e30, 3e38, -3e38, 0.0, 1e-40]);
        out
    }

    #[test]
    fn stats_are_the_first_argmax_and_the_float64_logsumexp() {
        for row in rows() {
            let got = row_stats::<Portable>(&row);
            let (argmax, lse) = reference(&row);
            assert_eq!(got.argmax, argmax, "{:?}", &row[..row.len().min(8)]);
            if lse.is_nan() {
                assert!(got.logsumexp.is_nan());
            } else if lse.is_infinite() {
                assert_eq!(got.logsumexp as f64, lse);
            } else {
                let err = (got.logsumexp as f64 - lse).abs();
                assert!(err <= 4e-6 * lse.abs().max(1.0), "len {}: {} vs {lse}", row.len(), got.logsumexp);
            }
        }
    }

    #[test]
    fn every_build_and_thread_count_gives_the_same_bits() {
        let all: Vec<Vec<f32>> = rows().into_iter().filter(|r| r.len() == 257).collect();
        let flat: Vec<f32> = (0..6).flat_map(|k| all[0].iter().map(move |v| v * (1.0 + k as f32 * 0.1))).collect();
        let want = row_stats_all(&flat, 257, 1, Simd::Portable).unwrap();
        for (threads, simd) in [(1, Simd::best()), (2, Simd::Portable), (2, Simd::best()), (3, Simd::best())] {
            let got = row_stats_all(&flat, 257, threads, simd).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g.argmax, w.argmax);
                assert_eq!(g.logsumexp.to_bits(), w.logsumexp.to_bits(), "threads {threads} {simd:?}");
            }
        }
        for row in rows() {
            let (a, b) = (stats_of(&row, Simd::Portable), stats_of(&row, Simd::best()));
            assert_eq!(a.argmax, b.argmax);
            assert!(a.logsumexp.to_bits() == b.logsumexp.to_bits() || (a.logsumexp.is_nan() && b.logsumexp.is_nan()));
        }
    }

    #[test]
    fn bad_shapes_and_thread_counts_are_refused() {
        let err = row_stats_all(&[1.0; 10], 3, 1, Simd::best()).unwrap_err().to_string();
        assert!(err.contains("logits") && err.contains("has 10 values; need whole rows of 3"), "{err}");
        assert!(row_stats_all(&[], 0, 1, Simd::best()).is_err());
        assert!(row_stats_all(&[1.0; 4], 4, 0, Simd::best()).is_err());
        assert!(row_stats_all(&[], 5, 1, Simd::best()).unwrap().is_empty());
    }
}
