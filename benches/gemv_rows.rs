//! Cost of the GEMV per activation row: `cargo bench --bench gemv_rows [-- KERNEL [THREADS [M,M,..]]]`.
//!
//! Times `PackedMatrix::matmul` at M = 1..8, 16, 32, 64, 86 (a prefill's rows; or the list given) on
//! THREADS threads (default 1), on a matrix that stays in the cache
//! (the kernel's compute alone) and on a set of matrices larger than the cache (streaming, as in
//! a decode step), and prints ns per (row, tile block) and the cost relative to M = 1.
use pagedrs::gemv::{Format, Kernel, PackedMatrix, QK};
use std::time::Instant;

fn random_gguf(format: Format, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let mut next = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 16) as u32
    };
    let mut raw = Vec::new();
    for _ in 0..rows * cols / QK {
        let f16 = |r: u32| (((r >> 31) as u16) << 15) | (((5 + (r >> 10) % 10) as u16) << 10) | (r & 0x3ff) as u16;
        raw.extend_from_slice(&f16(next()).to_le_bytes());
        if format.has_min() {
            raw.extend_from_slice(&f16(next()).to_le_bytes());
        }
        for _ in 0..format.quant_bytes() {
            raw.push(next() as u8);
        }
    }
    raw
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let kernel = std::env::args().nth(1).and_then(|k| Kernel::parse(&k)).unwrap_or_else(Kernel::best);
    let threads: usize = std::env::args().nth(2).and_then(|t| t.parse().ok()).unwrap_or(1);
    let ms: Vec<usize> = std::env::args().nth(3).map(|l| l.split(',').map(|m| m.parse().expect("M")).collect())
        .unwrap_or_else(|| vec![1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 86]);
    let mut seed = 0x9e3779b97f4a7c15u64;
    for format in [Format::Q4_1, Format::Q8_0, Format::Q4_0] {
        let (rows, cols) = (1536, 576);
        let raw = random_gguf(format, rows, cols, &mut seed);
        let hot = PackedMatrix::from_gguf("hot", &raw, rows, cols, format).unwrap();
        // ~200 MB of matrices: each pass streams them from memory
        let cold: Vec<PackedMatrix> = (0..200_000_000 / raw.len()).map(|_| hot.clone()).collect();
        let tile_blocks = (rows / 16 * cols / QK) as f64;
        let mut base = (0.0, 0.0);
        for &m in &ms {
            let reps = (400 / m).clamp(4, 50); // many rows: fewer calls, about the same time
            let x: Vec<f32> = (0..m * cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
            let mut out = vec![0f32; m * rows];
            let hot_s = median((0..21).map(|_| {
                let t = Instant::now();
                for _ in 0..reps {
                    hot.matmul(&x, m, &mut out, threads, kernel).unwrap();
                }
                t.elapsed().as_secs_f64() / reps as f64
            }).collect());
            let cold_s = median((0..5).map(|_| {
                let t = Instant::now();
                for w in &cold {
                    w.matmul(&x, m, &mut out, threads, kernel).unwrap();
                }
                t.elapsed().as_secs_f64() / cold.len() as f64
            }).collect());
            if m == ms[0] {
                base = (hot_s, cold_s);
            }
            println!("{} {} {threads}t M={m}: hot {:.2} ns/(row, tile block) ({:.2}x M={}), streaming {:.1} GB/s ({:.2}x M={})",
                     kernel.name(), format.name(), hot_s / tile_blocks / m as f64 * 1e9, hot_s / base.0, ms[0],
                     raw.len() as f64 / cold_s / 1e9, cold_s / base.1, ms[0]);
        }
    }
}
