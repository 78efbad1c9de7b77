//! The elementwise parts of a layer, each in one fixed float order.
//!
//! Sums run over 8 lanes (`acc[i] += a[8j + i] * b[8j + i]`), then the lanes in a fixed tree,
//! then the tail: the compiler vectorizes that at any SIMD width without reordering (Rust does
//! not contract or reassociate floats), so every build and CPU gives the same bits.

pub const LANES: usize = 8;

/// The lanes' sum in one fixed tree.
#[inline(always)]
pub fn reduce(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `sum(a[i] * b[i])`.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len() / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (ca, cb) in a[..n].chunks_exact(LANES).zip(b[..n].chunks_exact(LANES)) {
        for i in 0..LANES {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut s = reduce(acc);
    for (x, y) in a[n..].iter().zip(&b[n..]) {
        s += x * y;
    }
    s
}

/// `y += x`.
#[inline(always)]
pub fn add(y: &mut [f32], x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += *x;
    }
}

/// Llama's RMSNorm of each row of `x` into `out`: `w * (x * (1 / sqrt(mean(x^2) + eps)))`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let h = w.len();
    for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let r = 1.0 / (dot(xr, xr) / h as f32 + eps).sqrt();
        for ((o, x), w) in or.iter_mut().zip(xr).zip(w) {
            *o = w * (x * r);
        }
    }
}

/// Rotate-half RoPE in place on `heads` heads of `d` values (`x` = one row's heads, `cs` its
/// `[cos(d/2), sin(d/2)]`), in the float order of `pagedrs.models.rotary.apply_rotary_`:
/// first half `x1 * cos - x2 * sin`, second half `x2 * cos + x1 * sin`.
pub fn rotary(x: &mut [f32], heads: usize, d: usize, cs: &[f32]) {
    let half = d / 2;
    let (cos, sin) = cs.split_at(half);
    for head in x[..heads * d].chunks_exact_mut(d) {
        let (x1, x2) = head.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (x1[i], x2[i]);
            let (a_sin, b_sin) = (a * sin[i], b * sin[i]);
            x1[i] = a * cos[i] - b_sin;
            x2[i] = b * cos[i] + a_sin;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_float64_and_every_length() {
        for n in [0, 1, 7, 8, 9, 64, 67] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "n={n}");
        }
    }

    #[test]
    fn rms_norm_of_a_constant_row_is_the_weight() {
        let mut out = [0f32; 4];
        rms_norm(&[3.0; 4], &[1.0, 2.0, 3.0, 4.0], 0.0, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rotary_rotates_each_pair_by_its_angle() {
        let t = 0.3f32;
        let mut x = [1.0, 0.0, 0.0, 1.0]; // one head, d = 4: pairs (1, 0) and (0, 1)
        rotary(&mut x, 1, 4, &[t.cos(), 1.0, t.sin(), 0.0]);
        assert_eq!(x, [t.cos(), 0.0, t.sin(), 1.0]);
    }
}
