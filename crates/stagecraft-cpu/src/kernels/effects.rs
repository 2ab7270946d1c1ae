//! Side-effecting kernels: `Print`, which writes one line describing its
//! input to the process-wide print sink and passes the input through, and
//! `HostCall`, which runs a registered host closure on its input.

use super::take;
use crate::{Inputs, Kernel, KernelContext, KernelRegistry};
use smallvec::smallvec;
use stagecraft_ops::Attrs;
use stagecraft_tensor::{DenseHostTensor, Result, TensorMetadata};
use std::fmt::Write;
use std::sync::{Arc, PoisonError, RwLock};

/// Where `Print` sends its lines.
pub type PrintSink = Arc<dyn Fn(&str) + Send + Sync>;

static SINK: RwLock<Option<PrintSink>> = RwLock::new(None);

/// Values shown at each end of a long tensor; the middle is elided.
const EDGE_ITEMS: usize = 10;

/// Routes the lines of `Print` to `sink`, or back to standard output with
/// `None`. Affects every thread and every later `Print`.
pub fn set_print_sink(sink: Option<PrintSink>) {
    *SINK.write().unwrap_or_else(PoisonError::into_inner) = sink;
}

/// Sends one line to the current sink. The sink is cloned out of the lock
/// first, so a sink may itself call [`set_print_sink`].
fn emit(line: &str) {
    let sink = SINK.read().unwrap_or_else(PoisonError::into_inner).clone();
    match sink {
        Some(sink) => sink(line),
        None => println!("{line}"),
    }
}

/// `label: f32[2,2] [1.0, 2.0, 3.0, 4.0]`: the metadata, then the values as
/// one flat list, with `...` in place of all but the first and last
/// [`EDGE_ITEMS`] when there are more than twice that many. An empty label
/// drops the `label: ` prefix.
pub fn format_line(label: &str, x: &DenseHostTensor) -> String {
    let mut line = String::new();
    if !label.is_empty() {
        line.push_str(label);
        line.push_str(": ");
    }
    let _ = write!(line, "{} [", x.metadata());
    let n = x.numel();
    let elide = n > 2 * EDGE_ITEMS;
    let mut first = true;
    for i in 0..n {
        if elide && i >= EDGE_ITEMS && i < n - EDGE_ITEMS {
            if i == EDGE_ITEMS {
                line.push_str(", ...");
            }
            continue;
        }
        if !first {
            line.push_str(", ");
        }
        first = false;
        if let Some(v) = x.get_scalar(i) {
            let _ = write!(line, "{v}");
        }
    }
    line.push(']');
    line
}

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::PRINT, print_factory);
    registry.add(&stagecraft_ops::HOST_CALL, host_call_factory);
}

fn host_call_factory(attrs: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    // The closure is resolved once per kernel, not per run.
    let callback = stagecraft_ops::host_callback(attrs.int("callback")?)?;
    Ok(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let out = callback(x)?;
        // The graph promised this metadata to every consumer; a closure
        // returning something else is the user's error, reported as such.
        if Some(out.metadata()) != ctx.outputs.first() {
            return Err(stagecraft_tensor::Error::shape(format!(
                "the host closure returned {} where {} was declared",
                out.metadata(),
                ctx.outputs
                    .first()
                    .map_or_else(|| "nothing".to_string(), |m| m.to_string())
            )));
        }
        Ok(smallvec![out])
    }))
}

fn print_factory(attrs: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    let label = attrs.str("label")?.to_string();
    Ok(Arc::new(move |inputs: Inputs, _: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        emit(&format_line(&label, &x));
        Ok(smallvec![x])
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::elementwise::tests::run;
    use stagecraft_ops::OpAttrs;
    use std::sync::Mutex;

    #[test]
    fn formats_metadata_and_flat_values() {
        let x = DenseHostTensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2]).unwrap();
        assert_eq!(format_line("x", &x), "x: f32[2,2] [1.0, 2.0, 3.0, 4.0]");
        let s = DenseHostTensor::from_slice(&[true], []).unwrap();
        assert_eq!(format_line("", &s), "bool[] [true]");
        let e = DenseHostTensor::from_slice::<i32>(&[], [0, 3]).unwrap();
        assert_eq!(format_line("e", &e), "e: i32[0,3] []");
        let long: Vec<i64> = (0..25).collect();
        let l = DenseHostTensor::from_slice(&long, [25]).unwrap();
        assert_eq!(
            format_line("l", &l),
            "l: i64[25] [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ..., 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]"
        );
        let twenty: Vec<i32> = (0..20).collect();
        let t = DenseHostTensor::from_slice(&twenty, [4, 5]).unwrap();
        assert!(!format_line("t", &t).contains("..."));
    }

    #[test]
    fn print_sends_one_line_and_passes_the_input_through() {
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = lines.clone();
        set_print_sink(Some(Arc::new(move |l: &str| {
            sink.lock().unwrap().push(l.to_string())
        })));
        let x = DenseHostTensor::from_slice(&[1.5f64, -2.0], [2]).unwrap();
        let keep = x.clone();
        let mut attrs = OpAttrs::new();
        attrs.set_str("label", "weights");
        let y = run(&stagecraft_ops::PRINT, vec![x], &attrs).unwrap();
        set_print_sink(None);
        assert!(y.buffer().ptr_eq(keep.buffer()), "Print must not copy");
        assert_eq!(
            lines.lock().unwrap().as_slice(),
            &["weights: f64[2] [1.5, -2.0]".to_string()]
        );
    }
}
