//! A logging op handler: wraps any handler and logs each op's inputs and
//! outputs, for debugging. It waits for values, so it serialises execution.

use crate::format::format_values;
use crate::handle::TensorHandle;
use crate::op_handler::{OpHandler, OpInvocation, Results};
use std::fmt::Write;
use std::sync::Arc;

/// Where log lines go.
pub type LogSink = Arc<dyn Fn(&str) + Send + Sync>;

/// Logs every op passing through to `inner`.
pub struct LoggingOpHandler {
    name: String,
    inner: &'static dyn OpHandler,
    sink: LogSink,
}

impl LoggingOpHandler {
    /// Wraps `inner`, sending one multi-line entry per op to `sink`.
    pub fn new(inner: &'static dyn OpHandler, sink: LogSink) -> LoggingOpHandler {
        LoggingOpHandler {
            name: format!("logging({})", inner.name()),
            inner,
            sink,
        }
    }

    /// Wraps `inner`, logging to standard error.
    pub fn to_stderr(inner: &'static dyn OpHandler) -> LoggingOpHandler {
        LoggingOpHandler::new(inner, Arc::new(|line: &str| eprintln!("{line}")))
    }
}

fn describe(out: &mut String, role: &str, i: usize, h: &TensorHandle) {
    let _ = write!(out, "\n  {role} {i}: {} = ", h.metadata());
    match h.wait() {
        Ok(v) => {
            let _ = write!(
                out,
                "{}",
                format_values(v, 3).unwrap_or_else(|e| e.to_string())
            );
        }
        Err(e) => {
            let _ = write!(out, "<error: {e}>");
        }
    }
}

impl OpHandler for LoggingOpHandler {
    fn name(&self) -> &str {
        &self.name
    }

    fn execute(&self, inv: OpInvocation<'_>) -> Results {
        let mut entry = format!("{} at {}", inv.op.name, inv.location);
        if !inv.attrs.is_empty() {
            let _ = write!(entry, " [{}]", *inv.attrs);
        }
        for (i, h) in inv.args.iter().enumerate() {
            describe(&mut entry, "input", i, h);
        }
        let results = self.inner.execute(inv);
        for (i, h) in results.iter().enumerate() {
            describe(&mut entry, "output", i, h);
        }
        (self.sink)(&entry);
        results
    }

    fn kernel_cache_stats(&self) -> Option<crate::cpu_handler::KernelCacheStats> {
        self.inner.kernel_cache_stats()
    }
}
