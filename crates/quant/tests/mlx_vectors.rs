//! Bit-exact agreement with vectors produced by MLX itself (`scripts/gen_mlx_vectors.py`,
//! mlx 0.32.4, CPU backend): `quantize` against `mx.quantize`, `dequantize_mlx_bf16` against
//! `mx.dequantize`.

use half::bf16;
use quant::{dequantize_mlx_bf16, quantize, Bits, QuantSpec};

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u32(&mut self) -> u32 {
        let (h, t) = self.0.split_at(4);
        self.0 = t;
        u32::from_le_bytes(h.try_into().unwrap())
    }
    fn u16(&mut self) -> u16 {
        let (h, t) = self.0.split_at(2);
        self.0 = t;
        u16::from_le_bytes(h.try_into().unwrap())
    }
    fn u32s(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.u32()).collect()
    }
    fn u16s(&mut self, n: usize) -> Vec<u16> {
        (0..n).map(|_| self.u16()).collect()
    }
}

#[test]
fn quantize_matches_mlx_bit_for_bit() {
    let data = include_bytes!("../testdata/mlx_affine_v1.bin");
    let mut r = Reader(&data[..]);
    assert_eq!(&r.0[..4], b"MLXQ");
    r.0 = &r.0[4..];
    assert_eq!(r.u32(), 1, "version");
    let n = r.u32();
    assert!(n >= 48, "expected the full case set, got {n}");
    let mut seen_bits = [0; 2];
    for case in 0..n {
        let (bits, gs, rows, cols, kind, has_deq) = (
            r.u32(),
            r.u32() as usize,
            r.u32() as usize,
            r.u32() as usize,
            r.u32(),
            r.u32(),
        );
        let spec = QuantSpec::new(bits, gs).unwrap();
        seen_bits[(spec.bits == Bits::B8) as usize] += 1;
        let w: Vec<f32> = if kind == 0 {
            r.u16s(rows * cols)
                .into_iter()
                .map(|b| bf16::from_bits(b).to_f32())
                .collect()
        } else {
            r.u32s(rows * cols)
                .into_iter()
                .map(f32::from_bits)
                .collect()
        };
        let packed = r.u32s(rows * spec.words_per_row(cols));
        let scales = r.u16s(rows * cols / gs);
        let biases = r.u16s(rows * cols / gs);
        let what = format!("case {case}: bits {bits} group {gs} kind {kind}");
        let m = quantize(&w, rows, cols, spec).unwrap();
        assert_eq!(m.packed, packed, "{what}: packed codes");
        assert_eq!(
            m.scales.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
            scales,
            "{what}: scales"
        );
        assert_eq!(
            m.biases.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
            biases,
            "{what}: biases"
        );
        if has_deq == 1 {
            let want = r.u16s(rows * cols);
            let mut got = vec![bf16::ZERO; rows * cols];
            dequantize_mlx_bf16(m.as_ref(), &mut got);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want,
                "{what}: dequantize"
            );
        }
    }
    assert!(r.0.is_empty(), "trailing bytes");
    assert!(seen_bits[0] > 0 && seen_bits[1] > 0);
}
