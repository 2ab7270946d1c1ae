//! Collective kernels: hand the input to the process group's
//! [`Communicator`](crate::collective::Communicator) and return what comes
//! back. The split pair `AllReduceStart`/`AllReduceDone` parks the started
//! reduction under a ticket in between.

use super::take;
use crate::collective::{self, Collective, PendingCollective};
use crate::{Inputs, Kernel, KernelContext, KernelRegistry};
use smallvec::smallvec;
use stagecraft_ops::{Attrs, Reduction};
use stagecraft_tensor::{DenseHostTensor, Error, Result, Scalar, Shape, TensorMetadata};
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::ALL_REDUCE, |attrs, _| {
        collective_kernel(Collective::AllReduce(Reduction::of(attrs)?), attrs)
    });
    registry.add(&stagecraft_ops::BROADCAST, |attrs, _| {
        let root = stagecraft_ops::root(attrs)?;
        collective_kernel(Collective::Broadcast { root }, attrs)
    });
    registry.add(&stagecraft_ops::REDUCE_TO_ROOT, |attrs, _| {
        let (reduction, root) = (Reduction::of(attrs)?, stagecraft_ops::root(attrs)?);
        collective_kernel(Collective::ReduceToRoot { reduction, root }, attrs)
    });
    registry.add(&stagecraft_ops::ALL_GATHER, |attrs, _| {
        collective_kernel(Collective::AllGather, attrs)
    });
    registry.add(&stagecraft_ops::REDUCE_SCATTER, |attrs, _| {
        collective_kernel(Collective::ReduceScatter(Reduction::of(attrs)?), attrs)
    });
    registry.add(&stagecraft_ops::ALL_REDUCE_START, start_factory);
    registry.add(&stagecraft_ops::ALL_REDUCE_DONE, done_factory);
}

/// Starts `op` in the installed group, if it has the size the op was
/// built for.
fn start_in_group(
    world_size: usize,
    op: Collective,
    x: DenseHostTensor,
    out: &TensorMetadata,
) -> Result<Box<dyn PendingCollective>> {
    collective::with_communicator(|comm| {
        if comm.size() != world_size {
            return Err(Error::invalid(format!(
                "the collective was built for a group of {world_size} processes, but this \
                 process runs in {} ({})",
                comm.size(),
                comm.describe()
            )));
        }
        comm.start(op, x, out)
    })
}

/// Starts `op` and waits for it.
fn collective_kernel(op: Collective, attrs: &Attrs<'_>) -> Result<Kernel> {
    let world_size = stagecraft_ops::world_size(attrs)?;
    Ok(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let out = super::out_meta(ctx)?;
        let result = start_in_group(world_size, op, x, out)?.wait()?;
        Ok(smallvec![result])
    }))
}

fn start_factory(attrs: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    let op = Collective::AllReduce(Reduction::of(attrs)?);
    let world_size = stagecraft_ops::world_size(attrs)?;
    Ok(Arc::new(move |inputs: Inputs, _: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let out = x.metadata().clone();
        let pending = start_in_group(world_size, op, x, &out)?;
        let ticket = collective::park(pending) as i64;
        let ticket = DenseHostTensor::from_slice(&[ticket], Shape::scalar())?;
        Ok(smallvec![ticket])
    }))
}

fn done_factory(_: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    Ok(Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let [ticket] = take(inputs)?;
        let ticket = match ticket.get_scalar(0) {
            Some(Scalar::I64(t)) if t > 0 => t as u64,
            other => {
                return Err(Error::invalid(format!(
                    "AllReduceDone needs the ticket AllReduceStart returned, got {other:?}"
                )))
            }
        };
        let result = collective::redeem(ticket)?.wait()?;
        let out = super::out_meta(ctx)?;
        if result.metadata() != out {
            return Err(Error::shape(format!(
                "the all-reduce under ticket {ticket} produced {}, but AllReduceDone \
                 declares {out}",
                result.metadata()
            )));
        }
        Ok(smallvec![result])
    }))
}

#[cfg(test)]
mod tests {
    use crate::registry;
    use smallvec::smallvec;
    use stagecraft_ops::{Attrs, OpAttrs};
    use stagecraft_tensor::{DType, DenseHostTensor, Shape};

    fn run(
        def: &'static stagecraft_ops::OpDef,
        attrs: &OpAttrs,
        x: DenseHostTensor,
    ) -> stagecraft_tensor::Result<DenseHostTensor> {
        let attrs = Attrs::new(attrs, def);
        let metas = [x.metadata().clone()];
        let out = (def.metadata)(&metas, &attrs)?;
        let kernel = registry().get(def).expect("a CPU kernel")(&attrs, &metas)?;
        let ctx = crate::KernelContext {
            attrs,
            outputs: &out,
        };
        Ok(kernel(smallvec![x], &ctx)?.remove(0))
    }

    #[test]
    fn a_single_process_gets_its_own_tensor_back() {
        let x = DenseHostTensor::from_slice(&[1.0f32, -2.0, 3.5], Shape::new(&[3])).unwrap();
        let mut attrs = OpAttrs::new();
        attrs.set_int("world_size", 1).set_str("reduction", "mean");
        for def in [
            &stagecraft_ops::ALL_REDUCE,
            &stagecraft_ops::BROADCAST,
            &stagecraft_ops::REDUCE_TO_ROOT,
            &stagecraft_ops::ALL_GATHER,
            &stagecraft_ops::REDUCE_SCATTER,
        ] {
            let y = run(def, &attrs, x.clone()).unwrap();
            assert_eq!(
                y.to_vec::<f32>().unwrap(),
                vec![1.0, -2.0, 3.5],
                "{}",
                def.name
            );
        }
    }

    #[test]
    fn start_and_done_redeem_a_ticket_once() {
        let x = DenseHostTensor::from_slice(&[4i64, 5], Shape::new(&[2])).unwrap();
        let mut attrs = OpAttrs::new();
        attrs.set_int("world_size", 1);
        let ticket = run(&stagecraft_ops::ALL_REDUCE_START, &attrs, x).unwrap();
        let mut done = OpAttrs::new();
        done.set_dtype("dtype", DType::I64).set_dims("shape", &[2]);
        let y = run(&stagecraft_ops::ALL_REDUCE_DONE, &done, ticket.clone()).unwrap();
        assert_eq!(y.to_vec::<i64>().unwrap(), vec![4, 5]);
        let err = run(&stagecraft_ops::ALL_REDUCE_DONE, &done, ticket).unwrap_err();
        assert!(
            err.to_string().contains("no all-reduce is in flight"),
            "{err}"
        );
    }

    #[test]
    fn a_collective_built_for_another_group_size_refuses_to_run() {
        let x = DenseHostTensor::from_slice(&[1.0f32], Shape::new(&[1])).unwrap();
        let mut attrs = OpAttrs::new();
        attrs.set_int("world_size", 4);
        let err = run(&stagecraft_ops::ALL_REDUCE, &attrs, x).unwrap_err();
        assert!(err.to_string().contains("group of 4 processes"), "{err}");
    }
}
