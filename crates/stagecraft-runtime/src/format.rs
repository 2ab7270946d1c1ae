//! Text forms of tensor values, shared by `Display`, printing and logging.

use stagecraft_tensor::{DenseHostTensor, HostTensor, Result, Scalar};
use std::fmt::Write;

/// Formats values as nested brackets following the shape, eliding the
/// middle of any axis longer than `edge_items * 2` with `...`.
pub fn format_values(tensor: &HostTensor, edge_items: usize) -> Result<String> {
    let dense = tensor.to_dense()?;
    let mut out = String::new();
    write_axis(&mut out, &dense, 0, 0, edge_items);
    Ok(out)
}

fn write_axis(out: &mut String, t: &DenseHostTensor, axis: usize, base: usize, edge: usize) {
    let dims = t.shape().dims();
    if axis == dims.len() {
        if let Some(v) = t.get_scalar(base) {
            write_scalar(out, v);
        }
        return;
    }
    let stride = stagecraft_tensor::element_count(&dims[axis + 1..]);
    let n = dims[axis];
    out.push('[');
    let elide = n > 2 * edge;
    for i in 0..n {
        if elide && i == edge {
            out.push_str("...");
            if i < n {
                out.push_str(if axis + 1 == dims.len() { ", " } else { ",\n" });
            }
        }
        if elide && i >= edge && i < n - edge {
            continue;
        }
        write_axis(out, t, axis + 1, base + i * stride, edge);
        if i + 1 < n {
            out.push_str(if axis + 1 == dims.len() { ", " } else { ",\n" });
        }
    }
    out.push(']');
}

fn write_scalar(out: &mut String, v: Scalar) {
    let _ = match v {
        Scalar::F32(x) => write!(out, "{x:?}"),
        Scalar::F64(x) => write!(out, "{x:?}"),
        other => write!(out, "{other}"),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_and_elided() {
        let t = DenseHostTensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2]).unwrap();
        assert_eq!(
            format_values(&t.into(), 3).unwrap(),
            "[[1.0, 2.0],\n[3.0, 4.0]]"
        );
        let long: Vec<i64> = (0..10).collect();
        let t = DenseHostTensor::from_slice(&long, [10]).unwrap();
        assert_eq!(format_values(&t.into(), 2).unwrap(), "[0, 1, ..., 8, 9]");
        let s = DenseHostTensor::from_slice(&[true], []).unwrap();
        assert_eq!(format_values(&s.into(), 2).unwrap(), "true");
        let e = DenseHostTensor::from_slice::<f32>(&[], [0, 3]).unwrap();
        assert_eq!(format_values(&e.into(), 2).unwrap(), "[]");
    }
}
