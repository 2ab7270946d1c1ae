//! Kernels of the list ops. They are value kernels: a list is not dense,
//! and its items are kept as they are (a broadcast scalar stays one).

use crate::kernel::{KernelContext, KernelRegistry, ValueInputs, ValueKernel, ValueOutputs};
use smallvec::smallvec;
use stagecraft_ops::{list_item_meta, Attrs, LIST_POP, LIST_PUSH};
use stagecraft_tensor::{Error, HostTensor, Result, Scalar, TensorList, TensorMetadata};
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add_value(&LIST_PUSH, push_factory);
    registry.add_value(&LIST_POP, pop_factory);
}

fn into_list(value: Option<HostTensor>) -> Result<TensorList> {
    match value {
        Some(HostTensor::List(list)) => Ok(list),
        Some(other) => Err(Error::dtype(format!(
            "expected a list, got {}",
            other.metadata()
        ))),
        None => Err(Error::internal("a list op without its list operand")),
    }
}

fn push_factory(_: &Attrs<'_>, _: &[TensorMetadata]) -> Result<ValueKernel> {
    Ok(Arc::new(
        |inputs: ValueInputs, _: &KernelContext<'_>| -> Result<ValueOutputs> {
            let mut inputs = inputs.into_iter();
            let list = into_list(inputs.next())?;
            let item = inputs
                .next()
                .ok_or_else(|| Error::internal("ListPush without an item"))?;
            Ok(smallvec![HostTensor::List(list.push(item))])
        },
    ))
}

fn pop_factory(attrs: &Attrs<'_>, _: &[TensorMetadata]) -> Result<ValueKernel> {
    let item_meta = list_item_meta(attrs)?;
    Ok(Arc::new(
        move |inputs: ValueInputs, _: &KernelContext<'_>| -> Result<ValueOutputs> {
            let (rest, item) = into_list(inputs.into_iter().next())?.pop();
            let item = match item {
                Some(item) if item.metadata() == &item_meta => item,
                Some(item) => {
                    return Err(Error::shape(format!(
                        "the list's top item is {} but ListPop expects {item_meta}",
                        item.metadata()
                    )))
                }
                None => HostTensor::filled(Scalar::F64(0.0), &item_meta),
            };
            Ok(smallvec![HostTensor::List(rest), item])
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_ops::OpAttrs;
    use stagecraft_tensor::{DType, DenseHostTensor};

    fn run(kernel: &ValueKernel, inputs: ValueInputs, attrs: &OpAttrs) -> Result<ValueOutputs> {
        let ctx = KernelContext {
            attrs: Attrs::new(attrs, &LIST_POP),
            outputs: &[],
        };
        kernel(inputs, &ctx)
    }

    #[test]
    fn push_then_pop_returns_items_last_in_first_out() {
        let mut attrs = OpAttrs::new();
        attrs
            .set_dtype("item_dtype", DType::F32)
            .set_dims("item_shape", &[2]);
        let push = push_factory(&Attrs::new(&attrs, &LIST_PUSH), &[]).unwrap();
        let pop = pop_factory(&Attrs::new(&attrs, &LIST_POP), &[]).unwrap();
        let mut list = HostTensor::List(TensorList::empty());
        for i in 0..3 {
            let item = DenseHostTensor::from_slice(&[i as f32, -(i as f32)], [2]).unwrap();
            list = run(&push, smallvec![list, item.into()], &attrs).unwrap()[0].clone();
        }
        for i in (0..3).rev() {
            let out = run(&pop, smallvec![list], &attrs).unwrap();
            let item = out[1].to_dense().unwrap().to_vec::<f32>().unwrap();
            assert_eq!(item, vec![i as f32, -(i as f32)]);
            list = out[0].clone();
        }
        // Empty: zeros of the item type (the zero gradient of a list).
        let out = run(&pop, smallvec![list], &attrs).unwrap();
        assert_eq!(
            out[1].to_dense().unwrap().to_vec::<f32>().unwrap(),
            vec![0.0, 0.0]
        );
    }

    #[test]
    fn pop_checks_the_item_type() {
        let mut attrs = OpAttrs::new();
        attrs
            .set_dtype("item_dtype", DType::F64)
            .set_dims("item_shape", &[2]);
        let pop = pop_factory(&Attrs::new(&attrs, &LIST_POP), &[]).unwrap();
        let item = DenseHostTensor::from_slice(&[1.0f32, 2.0], [2]).unwrap();
        let list = HostTensor::List(TensorList::empty().push(item.into()));
        let err = run(&pop, smallvec![list], &attrs).unwrap_err();
        assert!(err.message().contains("ListPop expects"), "{err}");
        let not_a_list = DenseHostTensor::from_slice(&[1.0f64], [1]).unwrap();
        assert!(run(&pop, smallvec![not_a_list.into()], &attrs).is_err());
    }
}
