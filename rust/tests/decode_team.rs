//! The stack's layers on a team of threads (`cpu_decode::chain`, one team call a step) give the
//! one-thread loop's bits, in outputs and pages, for every size of step and cut of attention, and
//! its errors.

use std::sync::Arc;

use pagedrs::cpu_decode::kv_cache::KvCacheMut;
use pagedrs::cpu_decode::{DecodeError, DecodeStack, KvGeometry, LayerWeights, StackGeometry, StepMeta};
use pagedrs::gemv::{Format, FusedMatrix, Kernel, PackedMatrix};

/// Random blocks of `format` (Q4_0, Q4_1, Q8_0), row-major `[rows, cols / 32]` blocks.
fn raw_blocks(format: Format, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let mut next = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 16) as u32
    };
    // scales 2^-9 .. 2^-6: activations stay moderate through the layers
    let f16 = |r: u32| (((r >> 31) as u16) << 15) | (((6 + (r >> 10) % 4) as u16) << 10) | (r & 0x3ff) as u16;
    let mut raw = Vec::new();
    for _ in 0..rows * cols / 32 {
        raw.extend_from_slice(&f16(next()).to_le_bytes());
        if format.has_min() {
            raw.extend_from_slice(&f16(next()).to_le_bytes());
        }
        raw.extend((0..format.quant_bytes()).map(|_| next() as u8));
    }
    raw
}

fn packed(name: &str, format: Format, rows: usize, cols: usize, seed: &mut u64) -> PackedMatrix {
    PackedMatrix::from_gguf(name, &raw_blocks(format, rows, cols, seed), rows, cols, format).unwrap()
}

fn matrix(name: &str, format: Format, rows: usize, cols: usize, seed: &mut u64) -> Arc<FusedMatrix> {
    Arc::new(FusedMatrix::from(packed(name, format, rows, cols, seed)))
}

/// A fused product of parts in three formats (rows 40 + 56 + 32: parts that end inside a tile), as a
/// K-quant mix's q/k/v: the team's chunks of each part write their own columns.
fn mixed(name: &str, rows: [usize; 3], cols: usize, seed: &mut u64) -> Arc<FusedMatrix> {
    let parts = [Format::Q4_0, Format::Q8_0, Format::Q4_1].iter().zip(rows)
        .map(|(&f, r)| Arc::new(packed(&format!("{name}.{}", f.name()), f, r, cols, seed))).collect();
    Arc::new(FusedMatrix::new(name, parts).unwrap())
}

/// A 3-layer stack (hidden 64, 4 heads over 2 KV heads of 16, intermediate 96; Q4_1, Q8_0 and
/// Q4_0 products, the last layer's qkv and gate_up fused from parts of all three, a QKV bias, a
/// sliding window on the middle layer, the final norm) and a step of
/// `t` rows (2 to 36): two sequences on blocks of their own, the first with `t - 1` new tokens after
/// 21 cached, the second decoding its 6th token.
struct Case {
    stack: DecodeStack,
    kv: Vec<f32>,
    kvg: KvGeometry,
    h: Vec<f32>,
    cos_sin: Vec<f32>,
    slots: Vec<i64>,
    qsl: Vec<i32>,
    lens: Vec<i32>,
    tables: Vec<i32>,
}

fn case(t: usize) -> Case {
    case_with(t, false)
}

/// [`case`], with layer 0's qkv (Q4_1, 128 x 64) as a fused product of its own rows in three parts
/// (40, 56, 32: parts that end inside a tile) when `split_qkv0`: the same weights.
fn case_with(t: usize, split_qkv0: bool) -> Case {
    let geo = StackGeometry { hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, intermediate: 96, eps: 1e-5, scale: 0.25 };
    let mut seed = 0x2545f4914f6cdd1du64;
    let formats = [Format::Q4_1, Format::Q8_0, Format::Q4_0];
    let layers = (0..3).map(|l| {
        let f = formats[l];
        LayerWeights {
            input_norm: (0..64).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect(),
            post_norm: (0..64).map(|i| 1.2 - (i % 5) as f32 * 0.1).collect(),
            qkv: match l {
                2 => mixed("qkv", [40, 56, 32], 64, &mut seed),
                0 if split_qkv0 => {
                    let raw = raw_blocks(f, 128, 64, &mut seed);
                    let row_bytes = raw.len() / 128;
                    let parts = [(0, 40), (40, 96), (96, 128)].map(|(a, b)| {
                        let part = PackedMatrix::from_gguf("qkv", &raw[a * row_bytes..b * row_bytes], b - a, 64, f);
                        Arc::new(part.unwrap())
                    });
                    Arc::new(FusedMatrix::new("qkv", parts.to_vec()).unwrap())
                }
                _ => matrix("qkv", f, 128, 64, &mut seed),
            },
            qkv_bias: (l == 1).then(|| (0..128).map(|i| (i as f32 * 0.37).sin() * 0.1).collect()),
            o: matrix("o", f, 64, 64, &mut seed),
            gate_up: if l == 2 { mixed("gate_up", [96, 64, 32], 64, &mut seed) } else { matrix("gate_up", f, 192, 64, &mut seed) },
            down: matrix("down", f, 64, 96, &mut seed),
            sliding_window: (l == 1).then_some(5),
        }
    }).collect();
    let stack = DecodeStack::new(geo, layers).unwrap().with_final_norm(vec![0.9; 64]).unwrap();
    let kvg = KvGeometry { layers: 3, num_blocks: 24, block_size: 4, kv_heads: 2, head_dim: 16 };
    let kv: Vec<f32> = (0..kvg.len()).map(|i| ((i * 7919 % 1009) as f32 / 504.0) - 1.0).collect();
    // seq 0: 21 cached + t - 1 new on 14 scattered blocks; seq 1: decoding its 6th token on 2 others
    let (new0, cached0) = (t - 1, 21);
    let len0 = cached0 + new0;
    let mut tables = vec![23, 2, 17, 5, 11, 0, 20, 8, 14, 3, 19, 9, 12, 6, 0, 0];
    tables.extend([1, 21].into_iter().chain(std::iter::repeat(0)).take(16));
    assert!(len0 <= 56, "a case of at most 36 rows");
    let slot = |table: &[i32], p: usize| table[p / 4] as i64 * 4 + (p % 4) as i64;
    let mut slots: Vec<i64> = (cached0..len0).map(|p| slot(&tables[..16], p)).collect();
    slots.push(slot(&tables[16..], 5));
    let h: Vec<f32> = (0..t * 64).map(|i| ((i * 31) as f32 * 0.05).cos()).collect();
    let cos_sin: Vec<f32> = (0..t * 16).map(|i| ((i / 16) as f32 * 0.3 + (i % 8) as f32 * 0.1).cos()).collect();
    Case { stack, kv, kvg, h, cos_sin, slots, qsl: vec![0, new0 as i32, t as i32], lens: vec![len0 as i32, 6], tables }
}

fn run(c: &mut Case, threads: usize) -> Result<Vec<f32>, DecodeError> {
    let meta = StepMeta { slot_mapping: &c.slots, query_start_loc: &c.qsl, seq_lens: &c.lens, block_tables: &c.tables,
                          table_width: 16 };
    c.stack.forward(&c.h, &c.cos_sin, &mut c.kv, c.kvg, meta, threads, Kernel::best())
}

/// The case's step over a cache of codes starting as `start`, on one thread and on a team of 2 and 3
/// (`run` the step over given codes): the team's output and codes are the one thread's, which come back.
fn team_equals_one_thread<T: Clone + PartialEq + std::fmt::Debug>(
    t: usize, start: &[T], run: impl Fn(&Case, &mut Vec<T>, usize) -> Vec<f32>, label: &str,
) -> (Vec<f32>, Vec<T>) {
    let (one, mut codes_one) = (case(t), start.to_vec());
    let want = run(&one, &mut codes_one, 1);
    for threads in [2, 3] {
        let (c, mut codes) = (case(t), start.to_vec());
        assert_eq!(run(&c, &mut codes, threads), want, "{label} t {t} threads {threads}");
        assert_eq!(codes, codes_one, "{label} t {t} threads {threads}: the codes written");
    }
    (want, codes_one)
}

/// [`run`] over a cache of codes the caller holds (`kv`: bfloat16 or fp8) instead of the case's floats.
fn run_codes(c: &Case, kv: KvCacheMut<'_>, threads: usize) -> Vec<f32> {
    let meta = StepMeta { slot_mapping: &c.slots, query_start_loc: &c.qsl, seq_lens: &c.lens, block_tables: &c.tables,
                          table_width: 16 };
    c.stack.forward_cache(&c.h, &c.cos_sin, kv, c.kvg, meta, threads, Kernel::best()).unwrap()
}

/// The team's chain gives the one-thread loop's bits, in its output and in every page it
/// writes, at decode and prefill sizes (from 16 rows on AMX's groups, where the CPU has it), on 2
/// to 4 threads.
#[test]
fn a_team_gives_the_one_thread_bits() {
    for t in [2, 3, 9, 12, 20, 36] {
        let mut one = case(t);
        let want = run(&mut one, 1).unwrap();
        assert!(want.iter().all(|x| x.is_finite()) && want.iter().any(|&x| x != 0.0));
        for threads in [2, 3, 4] {
            let mut c = case(t);
            for round in 0..3 {
                let got = run(&mut c, threads).unwrap();
                assert_eq!(got, want, "t {t} threads {threads} round {round}");
                assert_eq!(c.kv, one.kv, "t {t} threads {threads}: the pages written");
            }
        }
    }
}

/// A fused product's parts write their own columns of its output: layer 0's qkv as three parts of
/// its own rows gives the whole matrix's bits, on one thread and on teams (decode and 20 rows).
#[test]
fn parts_of_one_matrix_give_its_bits() {
    for t in [2, 20] {
        let want = run(&mut case_with(t, false), 1).unwrap();
        for threads in [1, 2, 3] {
            assert_eq!(run(&mut case_with(t, true), threads).unwrap(), want, "t {t} threads {threads}");
        }
    }
}

/// A non-finite value is the one-thread loop's error, naming the tensor, on a team too: at the
/// first product (a NaN embedding) and mid-chain (an infinite rotary angle makes layer 0's
/// attention NaN, so its output product refuses), with the same pages written (layer 0's, not
/// the layers' after it); at 20 rows too, where the steps between phases run in rows on several
/// threads and two rows fail (the earlier one is named, as on one thread); the team serves the
/// next step.
#[test]
fn a_non_finite_input_is_the_same_error_on_a_team() {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    type Spoil = fn(&mut Case);
    let spoils: [(usize, Spoil, &str); 4] = [
        (3, |c| c.h[70] = f32::NAN, "tensor \"qkv\": input x[1, 0]"),
        (3, |c| c.cos_sin[20] = f32::INFINITY, "tensor \"o\": input x[1, "),
        (20, |c| c.h[64 * 17 + 3] = f32::NAN, "tensor \"qkv\": input x[17, 0]"),
        (20, |c| {
            c.cos_sin[16 * 17 + 2] = f32::INFINITY;
            c.cos_sin[16 * 6 + 5] = f32::INFINITY;
        }, "tensor \"o\": input x[6, "),
    ];
    for (t, spoil, want) in spoils {
        let mut one = case(t);
        spoil(&mut one);
        let e1 = run(&mut one, 1).unwrap_err().to_string();
        assert!(e1.contains(want), "{e1}");
        for threads in [2, 3, 4] {
            let mut c = case(t);
            spoil(&mut c);
            assert_eq!(run(&mut c, threads).unwrap_err().to_string(), e1, "{t} rows, threads {threads}");
            assert_eq!(bits(&c.kv), bits(&one.kv), "{t} rows, threads {threads}: the same pages written");
        }
        let plane = one.kvg.plane();
        assert_eq!(bits(&one.kv[2 * plane..]), bits(&case(t).kv[2 * plane..]), "no layer after the error written");
        let mut ok = case(t);
        assert_eq!(run(&mut ok, 2).unwrap(), run(&mut case(t), 1).unwrap());
    }
}

/// The same step over an fp8 cache (`kv_cache_dtype="fp8_e4m3"` / `"fp8_e5m2"`): a team gives the
/// one thread's bits; the first layer writes each new K/V value's code (its input is the float32
/// run's, so its values are too, from a float32 cache holding exactly the old codes' values); and
/// the output stays near the float32 one. Scales other than 1 divide on the way in and multiply on
/// the way out.
#[test]
fn an_fp8_cache_is_written_and_read_as_its_codes() {
    use pagedrs::cpu_decode::kv_cache::Fp8Cache;
    use pagedrs::cpu_decode::kv_fp8::{widen, Fp8};

    let plane = |c: &Case| c.kvg.plane();
    for (format, k_scale, v_scale) in [(Fp8::E4m3, 1.0f32, 1.0f32), (Fp8::E5m2, 1.0, 1.0), (Fp8::E4m3, 0.5, 0.37)] {
        for t in [2, 12] {
            let fp8 = Fp8Cache { format, k_scale, v_scale };
            let run_fp8 = |c: &Case, codes: &mut Vec<u8>, threads: usize| run_codes(c, KvCacheMut::Fp8(codes, fp8), threads);
            let mut reference = case(t);
            let p = plane(&reference);
            // old pages: the codes of the case's values; the float32 reference holds their widened values
            let start: Vec<u8> = reference.kv.iter().enumerate()
                .map(|(i, &x)| format.encode(x / if (i / p) % 2 == 0 { k_scale } else { v_scale })).collect();
            for (i, chunk) in start.chunks(p).enumerate() {
                widen(format, chunk, if i % 2 == 0 { k_scale } else { v_scale }, &mut reference.kv[i * p..(i + 1) * p]);
            }
            let want_f32 = run(&mut reference, 1).unwrap();
            let (want, codes_one) = team_equals_one_thread(t, &start, run_fp8, &format!("{format:?}"));
            // layer 0's planes: every code is the float32 run's value encoded (old ones unchanged)
            for (i, (&code, &x)) in codes_one[..2 * p].iter().zip(&reference.kv[..2 * p]).enumerate() {
                let s = if i < p { k_scale } else { v_scale };
                assert_eq!(code, format.encode(x / s), "{format:?} t {t}: layer 0 element {i}");
            }
            let err = want.iter().zip(&want_f32).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let scale = want_f32.iter().map(|x| x.abs()).fold(0f32, f32::max);
            // near: E4M3 within a quarter of the output's range on this random 3-layer model (measured
            // 8-12%); E5M2's 2 mantissa bits move it by up to 80% here, so only finite is asked of it
            assert!(want.iter().all(|x| x.is_finite()), "{format:?} t {t}");
            if format == Fp8::E4m3 {
                assert!(err <= 0.25 * scale, "{format:?} t {t}: {err} of {scale}");
            }
        }
    }
}

/// The same step over a bfloat16 cache (`kv_cache_dtype="bfloat16"`): a team gives the one thread's
/// bits and codes; every code layer 0 writes is the float32 run's value rounded to nearest even (its
/// input is the float32 run's: a float32 cache holding exactly the old codes' values). Later layers
/// differ from the float32 run by the new rows' rounding, amplified where an int8 activation block
/// rounds the other way (2.5-6.6% of the output's range on this random model: no bound is asked;
/// what the rounding costs a real model is `tests/test_fp8_kv.py`'s quality test).
#[test]
fn a_bfloat16_cache_is_written_and_read_as_its_codes() {
    use pagedrs::cpu_decode::kv_bf16;

    for t in [2, 12] {
        let run_bf16 = |c: &Case, codes: &mut Vec<u16>, threads: usize| run_codes(c, KvCacheMut::Bf16(codes), threads);
        let mut reference = case(t);
        let start: Vec<u16> = reference.kv.iter().map(|&x| kv_bf16::encode(x)).collect();
        for (x, &c) in reference.kv.iter_mut().zip(&start) {
            *x = kv_bf16::decode(c);
        }
        let want_f32 = run(&mut reference, 1).unwrap();
        let (want, codes_one) = team_equals_one_thread(t, &start, run_bf16, "bfloat16");
        let p = reference.kvg.plane();
        for (i, (&code, &x)) in codes_one[..2 * p].iter().zip(&reference.kv[..2 * p]).enumerate() {
            assert_eq!(code, kv_bf16::encode(x), "t {t}: layer 0 element {i}");
        }
        assert!(want.iter().all(|x| x.is_finite()) && want != want_f32, "t {t}");
    }
}

/// One row over a long context (300 keys, 3 KV heads): on 4 threads its attention is split into
/// score and sum phases (`cpu_decode::attention_split`; on 2 and 3 every thread has a KV head and
/// it is not), with the one-thread loop's bits in the output and the pages, a middle layer's
/// window wide enough to split too or so narrow that no layer is split; a NaN query (an infinite
/// rotary angle) is the same error on every thread count; an fp8 cache too.
#[test]
fn a_long_row_split_over_a_team_gives_the_one_thread_bits() {
    use pagedrs::cpu_decode::kv_cache::Fp8Cache;
    use pagedrs::cpu_decode::kv_fp8::Fp8;

    let geo = StackGeometry { hidden: 64, heads: 6, kv_heads: 3, head_dim: 16, intermediate: 96, eps: 1e-5, scale: 0.25 };
    let kvg = KvGeometry { layers: 3, num_blocks: 40, block_size: 16, kv_heads: 3, head_dim: 16 };
    let len = 300usize;
    let tables: Vec<i32> = (0..40).map(|b| (b * 23 + 7) % 40).collect();
    let slot = tables[(len - 1) / 16] as i64 * 16 + ((len - 1) % 16) as i64;
    let h: Vec<f32> = (0..64).map(|i| ((i * 31) as f32 * 0.05).cos()).collect();
    let good: Vec<f32> = (0..16).map(|i| (2.1 + (i % 8) as f32 * 0.1).cos()).collect();
    for window in [None, Some(200), Some(5)] {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let layers = (0..3).map(|l| LayerWeights {
            input_norm: (0..64).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect(),
            post_norm: (0..64).map(|i| 1.2 - (i % 5) as f32 * 0.1).collect(),
            qkv: matrix("qkv", Format::Q8_0, 192, 64, &mut seed),
            qkv_bias: None,
            o: matrix("o", Format::Q4_1, 64, 96, &mut seed),
            gate_up: matrix("gate_up", Format::Q4_0, 192, 64, &mut seed),
            down: matrix("down", Format::Q4_1, 64, 96, &mut seed),
            sliding_window: if l == 1 { window } else { None },
        }).collect();
        let stack = DecodeStack::new(geo, layers).unwrap().with_final_norm(vec![0.9; 64]).unwrap();
        let run = |cos_sin: &[f32], threads: usize| {
            let mut kv: Vec<f32> = (0..kvg.len()).map(|i| ((i * 7919 % 1009) as f32 / 504.0) - 1.0).collect();
            let seq_lens = [len as i32];
            let meta = StepMeta { slot_mapping: &[slot], query_start_loc: &[0, 1], seq_lens: &seq_lens, block_tables: &tables,
                                  table_width: 40 };
            let out = stack.forward(&h, cos_sin, &mut kv, kvg, meta, threads, Kernel::best()).map_err(|e| e.to_string());
            (out, kv)
        };
        let (want, want_kv) = run(&good, 1);
        let want = want.unwrap();
        assert!(want.iter().all(|x| x.is_finite()) && want.iter().any(|&x| x != 0.0));
        let mut bad = good.clone();
        bad[3] = f32::INFINITY;
        let (err, err_kv) = run(&bad, 1);
        let err = err.unwrap_err();
        assert!(err.contains("tensor \"o\""), "{err}");
        for threads in [2, 3, 4] {
            let (got, kv) = run(&good, threads);
            assert_eq!(got.unwrap(), want, "window {window:?}, {threads} threads");
            assert_eq!(kv, want_kv, "window {window:?}, {threads} threads: the pages written");
            let (got, kv) = run(&bad, threads);
            assert_eq!(got.unwrap_err(), err, "window {window:?}, {threads} threads");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&kv), bits(&err_kv), "window {window:?}, {threads} threads: the pages of a failed step");
        }
        // the same over an fp8 cache (split too: each item widens only the codes it reads)
        let fp8 = Fp8Cache { format: Fp8::E4m3, k_scale: 0.5, v_scale: 0.25 };
        let run_fp8 = |threads: usize| {
            let mut codes: Vec<u8> = (0..kvg.len()).map(|i| (i * 53 % 247) as u8 & 0xf7).collect();
            let seq_lens = [len as i32];
            let meta = StepMeta { slot_mapping: &[slot], query_start_loc: &[0, 1], seq_lens: &seq_lens, block_tables: &tables,
                                  table_width: 40 };
            let out = stack.forward_cache(&h, &good, KvCacheMut::Fp8(&mut codes, fp8), kvg, meta, threads, Kernel::best()).unwrap();
            (out, codes)
        };
        let want = run_fp8(1);
        assert!(want.0.iter().all(|x| x.is_finite()));
        for threads in [2, 3, 4] {
            assert_eq!(run_fp8(threads), want, "fp8, window {window:?}, {threads} threads");
        }
    }
}
