//! Conversions between ONNX `TensorProto`s and stagecraft host tensors, and
//! between ONNX element types and [`DType`]s.

use crate::error::{OnnxError, Result};
use crate::proto::tensor_proto::DataType;
use crate::proto::TensorProto;
use stagecraft_tensor::{
    bf16, f16, Buffer, DType, DenseHostTensor, Element, Shape, TensorMetadata,
};

/// The stagecraft dtype of an ONNX element type (`TensorProto.DataType`), or
/// an unsupported error naming it.
pub fn dtype_of(onnx: i32) -> Result<DType> {
    let t = DataType::try_from(onnx)
        .map_err(|_| OnnxError::invalid(format!("unknown ONNX element type {onnx}")))?;
    Ok(match t {
        DataType::Float => DType::F32,
        DataType::Double => DType::F64,
        DataType::Float16 => DType::F16,
        DataType::Bfloat16 => DType::BF16,
        DataType::Int32 => DType::I32,
        DataType::Int64 => DType::I64,
        DataType::Int8 => DType::I8,
        DataType::Uint8 => DType::U8,
        DataType::Uint16 => DType::U16,
        DataType::Int16 => DType::I16,
        DataType::Uint32 => DType::U32,
        DataType::Uint64 => DType::U64,
        DataType::Bool => DType::Bool,
        other => {
            return Err(OnnxError::unsupported(format!(
                "element type {}",
                other.as_str_name()
            )))
        }
    })
}

/// The ONNX element type of a stagecraft dtype.
pub fn onnx_type_of(dtype: DType) -> Result<i32> {
    Ok(match dtype {
        DType::F32 => DataType::Float,
        DType::F64 => DataType::Double,
        DType::F16 => DataType::Float16,
        DType::BF16 => DataType::Bfloat16,
        DType::I32 => DataType::Int32,
        DType::I64 => DataType::Int64,
        DType::I8 => DataType::Int8,
        DType::U8 => DataType::Uint8,
        DType::U16 => DataType::Uint16,
        DType::I16 => DataType::Int16,
        DType::U32 => DataType::Uint32,
        DType::U64 => DataType::Uint64,
        DType::Bool => DataType::Bool,
        DType::List => return Err(OnnxError::unsupported("a tensor list has no ONNX type")),
    } as i32)
}

/// The dimensions of a tensor as a [`Shape`] (negative ones are invalid).
pub fn shape_of(dims: &[i64]) -> Result<Shape> {
    let dims = dims
        .iter()
        .map(|&d| {
            usize::try_from(d)
                .map_err(|_| OnnxError::invalid(format!("negative dimension {d} in {dims:?}")))
        })
        .collect::<Result<Vec<usize>>>()?;
    let shape = Shape::new(&dims);
    shape
        .checked_numel()
        .map_err(|e| OnnxError::invalid(e.message().to_string()))?;
    Ok(shape)
}

fn typed<T: Element>(values: &[T], shape: Shape, field: &str) -> Result<DenseHostTensor> {
    DenseHostTensor::from_slice(values, shape.clone()).map_err(|_| {
        OnnxError::invalid(format!(
            "{field} holds {} values, the shape {shape} needs {}",
            values.len(),
            shape.numel()
        ))
    })
}

/// Decodes a `TensorProto` into a dense host tensor. Data stored outside
/// the model file (`data_location = EXTERNAL`) is unsupported.
pub fn decode(t: &TensorProto) -> Result<DenseHostTensor> {
    let dtype = dtype_of(t.data_type())?;
    let shape = shape_of(&t.dims)?;
    if !t.external_data.is_empty() {
        return Err(OnnxError::unsupported(format!(
            "tensor '{}' keeps its data in an external file",
            t.name()
        )));
    }
    let numel = shape.numel();
    if let Some(raw) = &t.raw_data {
        let meta = TensorMetadata::new(dtype, shape);
        let want = meta.size_in_bytes();
        if raw.len() != want {
            return Err(OnnxError::invalid(format!(
                "tensor '{}': raw_data has {} bytes, {meta} needs {want}",
                t.name(),
                raw.len()
            )));
        }
        return DenseHostTensor::from_buffer(meta, Buffer::from_slice(raw.as_slice()))
            .map_err(|e| OnnxError::invalid(format!("tensor '{}': {}", t.name(), e.message())));
    }
    let i32s = &t.int32_data;
    let out = match dtype {
        DType::F32 => typed(&t.float_data, shape, "float_data")?,
        DType::F64 => typed(&t.double_data, shape, "double_data")?,
        DType::I64 => typed(&t.int64_data, shape, "int64_data")?,
        DType::I32 => typed(i32s, shape, "int32_data")?,
        DType::I8 => typed(
            &i32s.iter().map(|&v| v as i8).collect::<Vec<_>>(),
            shape,
            "int32_data",
        )?,
        DType::U8 => typed(
            &i32s.iter().map(|&v| v as u8).collect::<Vec<_>>(),
            shape,
            "int32_data",
        )?,
        DType::U16 => typed(
            &i32s.iter().map(|&v| v as u16).collect::<Vec<_>>(),
            shape,
            "int32_data",
        )?,
        DType::I16 => typed(
            &i32s.iter().map(|&v| v as i16).collect::<Vec<_>>(),
            shape,
            "int32_data",
        )?,
        DType::U32 => typed(
            &t.uint64_data.iter().map(|&v| v as u32).collect::<Vec<_>>(),
            shape,
            "uint64_data",
        )?,
        DType::U64 => typed(&t.uint64_data, shape, "uint64_data")?,
        DType::Bool => typed(
            &i32s.iter().map(|&v| v != 0).collect::<Vec<_>>(),
            shape,
            "int32_data",
        )?,
        DType::F16 => typed(
            &i32s
                .iter()
                .map(|&v| f16::from_bits(v as u16))
                .collect::<Vec<_>>(),
            shape,
            "int32_data",
        )?,
        DType::BF16 => typed(
            &i32s
                .iter()
                .map(|&v| bf16::from_bits(v as u16))
                .collect::<Vec<_>>(),
            shape,
            "int32_data",
        )?,
        DType::List => return Err(OnnxError::unsupported("tensor lists")),
    };
    debug_assert_eq!(out.numel(), numel);
    Ok(out)
}

/// Encodes a dense host tensor as a `TensorProto` named `name`, its data
/// in `raw_data` (little-endian, as ONNX stores it).
pub fn encode(name: &str, t: &DenseHostTensor) -> Result<TensorProto> {
    Ok(TensorProto {
        name: Some(name.to_string()),
        data_type: Some(onnx_type_of(t.dtype())?),
        dims: t.shape().dims().iter().map(|&d| d as i64).collect(),
        raw_data: Some(t.buffer().bytes().to_vec()),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_and_typed_fields_round_trip() {
        let t = DenseHostTensor::from_slice(&[1.5f32, -2.0, 3.25], [3]).unwrap();
        let p = encode("x", &t).unwrap();
        let back = decode(&p).unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), vec![1.5, -2.0, 3.25]);
        let typed = TensorProto {
            data_type: Some(DataType::Int64 as i32),
            dims: vec![2, 1],
            int64_data: vec![7, -8],
            ..Default::default()
        };
        let d = decode(&typed).unwrap();
        assert_eq!(d.shape().dims(), &[2, 1]);
        assert_eq!(d.to_vec::<i64>().unwrap(), vec![7, -8]);
    }

    #[test]
    fn bad_tensors_are_errors() {
        let short = TensorProto {
            data_type: Some(DataType::Float as i32),
            dims: vec![4],
            raw_data: Some(vec![0; 3]),
            ..Default::default()
        };
        assert!(decode(&short).unwrap_err().to_string().contains("3 bytes"));
        let strings = TensorProto {
            data_type: Some(DataType::String as i32),
            ..Default::default()
        };
        assert!(decode(&strings).unwrap_err().is_unsupported());
        let negative = TensorProto {
            data_type: Some(DataType::Float as i32),
            dims: vec![-1],
            ..Default::default()
        };
        assert!(decode(&negative).is_err());
    }
}
