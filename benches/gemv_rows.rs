//! Cost of the GEMV per activation row:
//! `cargo bench --bench gemv_rows [-- KERNEL [THREADS [M,M,.. [ROWSxCOLS [FORMAT,FORMAT,..]]]]]`.
//!
//! Times `PackedMatrix::matmul` at M = 1..8, 16, 32, 64, 86 (a prefill's rows; or the list given) on
//! THREADS threads (default 1), on a matrix of ROWSxCOLS (default 1536x576; Q6_K's, Q4_K's, Q5_K's,
//! IQ4_XS's and Q3_K's columns rounded up to the super-block of 256) that stays in the cache when small (the
//! kernel's compute alone),
//! and on a set of copies of it larger than the cache (streaming, as in a decode step), and prints
//! ns per (row, tile block of 16 x 32 weights, for every format), the cost relative to the first M,
//! and streaming: GB/s of the bytes a product reads (`weight_bytes`, Q6_K's 28 per 32 weights, not
//! the file's 26.25; Q4_K's 148 per 256, not the file's 144; Q5_K's 180, not 176; IQ4_XS's 138, not
//! 136; Q3_K's 114, not 110) and ns a product. Formats: q4_1, q8_0, q4_0, q6_k, q4_k, q5_k, q5_0, q5_1,
//! iq4_nl, iq4_xs, q3_k, or the list given.
use pagedrs::gemv::{Format, Kernel, PackedMatrix, QK};
use std::time::Instant;

fn random_gguf(format: Format, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let mut next = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 16) as u32
    };
    let f16 = |r: u32| (((r >> 31) as u16) << 15) | (((5 + (r >> 10) % 10) as u16) << 10) | (r & 0x3ff) as u16;
    let mut raw = Vec::new();
    if matches!(format, Format::Q6K | Format::Q3K) {
        // random codes and scales, then d (the super-block's last 2 bytes)
        for _ in 0..rows * cols / format.gguf_block_weights() {
            raw.extend((0..format.gguf_block_bytes() - 2).map(|_| next() as u8));
            raw.extend_from_slice(&f16(next()).to_le_bytes());
        }
        return raw;
    }
    if format == Format::IQ4XS {
        // d, then random scales and codes
        for _ in 0..rows * cols / format.gguf_block_weights() {
            raw.extend_from_slice(&f16(next()).to_le_bytes());
            raw.extend((0..format.gguf_block_bytes() - 2).map(|_| next() as u8));
        }
        return raw;
    }
    if matches!(format, Format::Q4K | Format::Q5K) {
        // d and dmin, then random scales, minima and codes
        for _ in 0..rows * cols / format.gguf_block_weights() {
            raw.extend_from_slice(&f16(next()).to_le_bytes());
            raw.extend_from_slice(&f16(next()).to_le_bytes());
            raw.extend((0..format.gguf_block_bytes() - 4).map(|_| next() as u8));
        }
        return raw;
    }
    for _ in 0..rows * cols / QK {
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
    let (rows, cols): (usize, usize) = std::env::args().nth(4).map(|s| {
        let (r, c) = s.split_once('x').expect("ROWSxCOLS");
        (r.parse().expect("ROWS"), c.parse().expect("COLS"))
    }).unwrap_or((1536, 576));
    let formats: Vec<Format> = std::env::args().nth(5)
        .map(|l| l.split(',').map(|f| Format::parse(f).expect("a format name")).collect())
        .unwrap_or_else(|| vec![Format::Q4_1, Format::Q8_0, Format::Q4_0, Format::Q6K, Format::Q4K, Format::Q5K,
                                Format::Q5_0, Format::Q5_1, Format::IQ4NL, Format::IQ4XS, Format::Q3K]);
    let mut seed = 0x9e3779b97f4a7c15u64;
    for format in formats {
        let cols = cols.next_multiple_of(format.gguf_block_weights());
        let raw = random_gguf(format, rows, cols, &mut seed);
        let hot = PackedMatrix::from_gguf("hot", &raw, rows, cols, format).unwrap();
        // ~200 MB of matrices (at least 2): each pass streams them from memory
        let cold: Vec<PackedMatrix> = (0..(200_000_000 / hot.weight_bytes()).max(2)).map(|_| hot.clone()).collect();
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
            println!("{} {} {rows}x{cols} {threads}t M={m}: hot {:.2} ns/(row, tile block) ({:.2}x M={}), streaming {:.1} GB/s, \
                      {:.0} ns a product ({:.2}x M={})",
                     kernel.name(), format.name(), hot_s / tile_blocks / m as f64 * 1e9, hot_s / base.0, ms[0],
                     hot.weight_bytes() as f64 / cold_s / 1e9, cold_s * 1e9, cold_s / base.1, ms[0]);
        }
    }
}
