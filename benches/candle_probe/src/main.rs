//! Probe: candle-core 0.9.2's quantized vec_dot at M = 1 on SmolLM2-135M's shapes, 1 thread.
use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ4_1, BlockQ8_0, GgmlType};
use std::time::Instant;

fn bandwidth() -> f64 {
    let v: Vec<f32> = (0..(256usize << 20)).map(|i| (i % 7) as f32).collect();
    let mut best = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let mut acc = [0f32; 16];
        for c in v.chunks_exact(16) { for j in 0..16 { acc[j] += c[j]; } }
        std::hint::black_box(acc);
        best.push(t.elapsed().as_secs_f64());
    }
    best.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v.len() * 4) as f64 / best[2]
}

struct Mat<T: GgmlType> { n: usize, k: usize, w: Vec<T> }

fn mk<T: GgmlType>(n: usize, k: usize, seed: u32) -> Mat<T> {
    let xs: Vec<f32> = (0..n * k).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0) - 0.5).collect();
    let mut w = vec![T::zeros(); n * k / T::BLCK_SIZE];
    T::from_float(&xs, &mut w);
    Mat { n, k, w }
}

fn run<T: GgmlType>(name: &str, bw: f64) {
    // 30 layers: fused qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536 (N x K).
    let mut mats: Vec<Mat<T>> = Vec::new();
    for l in 0..30u32 {
        for (n, k) in [(960, 576), (576, 576), (3072, 576), (576, 1536)] { mats.push(mk::<T>(n, k, l)); }
    }
    let bytes: usize = mats.iter().map(|m| m.w.len() * std::mem::size_of::<T>()).sum();
    let x576: Vec<f32> = (0..576).map(|i| (i as f32 * 0.37).sin()).collect();
    let x1536: Vec<f32> = (0..1536).map(|i| (i as f32 * 0.21).cos()).collect();
    let mut q576 = vec![T::VecDotType::zeros(); 576 / 32];
    let mut q1536 = vec![T::VecDotType::zeros(); 1536 / 32];
    T::VecDotType::from_float(&x576, &mut q576);
    T::VecDotType::from_float(&x1536, &mut q1536);
    let mut out = vec![0f32; 3072];
    let mut samples = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        for m in &mats {
            let q = if m.k == 576 { &q576 } else { &q1536 };
            let bpr = m.k / T::BLCK_SIZE;
            for r in 0..m.n { out[r] = T::vec_dot(m.k, &m.w[r * bpr..(r + 1) * bpr], q); }
            std::hint::black_box(&out);
        }
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let s = samples[4];
    println!("candle {name}: {:.1} MB of layer weights, median {:.2} ms/pass, {:.1} GB/s = {:.0}% of read bandwidth",
             bytes as f64 / 1e6, s * 1e3, bytes as f64 / s / 1e9, bytes as f64 / s / bw * 100.0);
}

fn main() {
    let bw = bandwidth();
    println!("read bandwidth (f32 sum over 1 GiB, 1 thread, median of 5): {:.1} GB/s", bw / 1e9);
    println!("avx2 compiled in: {}", cfg!(target_feature = "avx2"));
    run::<BlockQ4_0>("Q4_0", bw);
    run::<BlockQ4_1>("Q4_1", bw);
    run::<BlockQ8_0>("Q8_0", bw);
}
