//! `--profile FILE`: the runtime's profiling events as a Chrome trace-event
//! file (`{"traceEvents": [...]}` of complete `"X"` events and instant
//! `"i"` events), which Perfetto and chrome://tracing load.

use crate::error::{CliError, Result};
use serde_json::{json, Map, Value};
use stagecraft::layers::runtime::profile::{self, Event};
use std::path::Path;

/// Events the command itself records around training steps.
pub const STEP: &str = "step";
/// Events the command records around evaluation.
pub const EVALUATE: &str = "evaluate";

/// Starts recording runtime events.
pub fn start() {
    profile::set_enabled(true);
}

/// The events as a Chrome trace-event document.
pub fn chrome_trace(events: &[Event]) -> Value {
    let pid = std::process::id();
    let mut out: Vec<Value> = Vec::with_capacity(events.len() + 1);
    out.push(json!({
        "name": "process_name", "ph": "M", "pid": pid, "tid": 0,
        "args": {"name": "stagecraft"}
    }));
    for e in events {
        let args: Map<String, Value> = e
            .args
            .iter()
            .map(|(k, v)| (k.to_string(), Value::String(v.clone())))
            .collect();
        // Instants (cache lookups) have no duration.
        let mut event = if e.duration_us == 0.0 && e.category == profile::CACHE {
            json!({"ph": "i", "s": "t"})
        } else {
            json!({"ph": "X", "dur": e.duration_us})
        };
        let fields = event.as_object_mut().expect("built as an object");
        fields.insert("name".into(), Value::String(e.name.to_string()));
        fields.insert("cat".into(), Value::String(e.category.to_string()));
        fields.insert("ts".into(), json!(e.start_us));
        fields.insert("pid".into(), json!(pid));
        fields.insert("tid".into(), json!(e.thread));
        fields.insert("args".into(), Value::Object(args));
        out.push(event);
    }
    json!({ "traceEvents": out, "displayTimeUnit": "ms" })
}

/// Stops recording and writes everything recorded to `path`; returns the
/// number of events.
pub fn finish(path: &Path) -> Result<usize> {
    profile::set_enabled(false);
    let events = profile::take_events();
    let doc = chrome_trace(&events);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| CliError::new(format!("cannot create {}: {e}", dir.display())))?;
    }
    let text = serde_json::to_string(&doc)
        .map_err(|e| CliError::new(format!("cannot encode the profile: {e}")))?;
    std::fs::write(path, text)
        .map_err(|e| CliError::new(format!("cannot write {}: {e}", path.display())))?;
    Ok(events.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_become_complete_and_instant_trace_events() {
        let events = vec![
            Event {
                name: "MatMul".into(),
                category: profile::OP,
                start_us: 10.0,
                duration_us: 2.5,
                thread: 1,
                args: vec![],
            },
            Event {
                name: "cache hit".into(),
                category: profile::CACHE,
                start_us: 12.0,
                duration_us: 0.0,
                thread: 2,
                args: vec![("ops", "40".into())],
            },
        ];
        let doc = chrome_trace(&events);
        let list = doc["traceEvents"].as_array().unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(list[1]["ph"], "X");
        assert_eq!(list[1]["name"], "MatMul");
        assert_eq!(list[1]["dur"], 2.5);
        assert_eq!(list[2]["ph"], "i");
        assert_eq!(list[2]["args"]["ops"], "40");
        assert_eq!(list[2]["tid"], 2);
    }
}
