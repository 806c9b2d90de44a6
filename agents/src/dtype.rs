//! Element types and reduction operators over little-endian byte buffers.
//!
//! Buffers are bytes so that the transport moves them without conversion; reductions view
//! them as elements. `bf16` is the 16-bit type (the upper half of an f32, rounded to
//! nearest even), as training uses for gradients.

use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    Bf16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::Bf16 => "bfloat16",
        }
    }

    /// Writes `v` as element `i` of `buf`.
    pub fn put(self, buf: &mut [u8], i: usize, v: f32) {
        match self {
            DType::F32 => buf[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
            DType::Bf16 => buf[2 * i..2 * i + 2].copy_from_slice(&f32_to_bf16(v).to_le_bytes()),
        }
    }

    pub fn get(self, buf: &[u8], i: usize) -> f32 {
        match self {
            DType::F32 => f32::from_le_bytes(buf[4 * i..4 * i + 4].try_into().expect("4 bytes")),
            DType::Bf16 => bf16_to_f32(u16::from_le_bytes(
                buf[2 * i..2 * i + 2].try_into().expect("2 bytes"),
            )),
        }
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "float" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            _ => Err(format!("unknown type {s:?}: f32 or bf16")),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

pub fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    ((bits + round) >> 16) as u16
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    /// Sum, then divided by the number of ranks at the end.
    Avg,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }

    fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
        }
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sum" => Ok(ReduceOp::Sum),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            "avg" => Ok(ReduceOp::Avg),
            _ => Err(format!("unknown reduction {s:?}: sum, max, min or avg")),
        }
    }
}

/// `acc[i] = op(acc[i], inc[i])` over whole elements.
pub fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    debug_assert_eq!(acc.len(), inc.len());
    match dtype {
        DType::F32 => {
            for (a, b) in acc.chunks_exact_mut(4).zip(inc.chunks_exact(4)) {
                let x = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
                let y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                a.copy_from_slice(&op.apply(x, y).to_le_bytes());
            }
        }
        DType::Bf16 => {
            for (a, b) in acc.chunks_exact_mut(2).zip(inc.chunks_exact(2)) {
                let x = bf16_to_f32(u16::from_le_bytes([a[0], a[1]]));
                let y = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                a.copy_from_slice(&f32_to_bf16(op.apply(x, y)).to_le_bytes());
            }
        }
    }
}

/// Divides every element by `n` (the end of an `Avg`).
pub fn scale(dtype: DType, buf: &mut [u8], n: usize) {
    let count = buf.len() / dtype.size();
    for i in 0..count {
        let v = dtype.get(buf, i) / n as f32;
        dtype.put(buf, i, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trips_small_integers_and_rounds_to_even() {
        for i in -300..300 {
            let v = i as f32;
            if v.abs() <= 256.0 {
                assert_eq!(bf16_to_f32(f32_to_bf16(v)), v);
            }
        }
        // 257 is between 256 and 258 (bf16 spacing 2 there): ties go to even (256).
        assert_eq!(bf16_to_f32(f32_to_bf16(257.0)), 256.0);
        assert_eq!(bf16_to_f32(f32_to_bf16(259.0)), 260.0);
    }

    #[test]
    fn reduces_elementwise() {
        for dt in [DType::F32, DType::Bf16] {
            let mut a = vec![0; 3 * dt.size()];
            let mut b = vec![0; 3 * dt.size()];
            for (i, (x, y)) in [(1.0, 2.0), (5.0, -3.0), (-1.0, -1.0)]
                .into_iter()
                .enumerate()
            {
                dt.put(&mut a, i, x);
                dt.put(&mut b, i, y);
            }
            let mut s = a.clone();
            reduce_into(dt, ReduceOp::Sum, &mut s, &b);
            assert_eq!(
                (0..3).map(|i| dt.get(&s, i)).collect::<Vec<_>>(),
                [3.0, 2.0, -2.0]
            );
            let mut m = a.clone();
            reduce_into(dt, ReduceOp::Max, &mut m, &b);
            assert_eq!(
                (0..3).map(|i| dt.get(&m, i)).collect::<Vec<_>>(),
                [2.0, 5.0, -1.0]
            );
            let mut n = a.clone();
            reduce_into(dt, ReduceOp::Min, &mut n, &b);
            assert_eq!(
                (0..3).map(|i| dt.get(&n, i)).collect::<Vec<_>>(),
                [1.0, -3.0, -1.0]
            );
        }
    }
}
