//! Rendering Graphviz DOT to SVG in-process with the `layout-rs` crate, so
//! `stagecraft trace` needs no system Graphviz.

use crate::error::{CliError, Result};
use layout::backends::svg::SVGWriter;
use layout::gv::{DotParser, GraphBuilder};

/// The SVG picture of a DOT graph.
///
/// `layout-rs` reports parse errors as values but may panic on inputs its
/// layout does not expect; such a panic becomes an error here instead of
/// ending the command.
pub fn render(dot: &str) -> Result<String> {
    let graph = DotParser::new(dot)
        .process()
        .map_err(|e| CliError::new(format!("cannot parse the trace's DOT: {e}")))?;
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let rendered = std::panic::catch_unwind(|| {
        let mut builder = GraphBuilder::new();
        builder.visit_graph(&graph);
        let mut visual = builder.get();
        let mut svg = SVGWriter::new();
        visual.do_it(false, false, false, &mut svg);
        svg.finalize()
    });
    std::panic::set_hook(previous);
    rendered.map_err(|_| CliError::new("the graph layout failed (layout-rs panicked)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_small_graph_with_multi_line_labels() {
        let svg = render(
            "digraph \"f\" {\n  graph [rankdir=TB, label=\"@f\"];\n  node [shape=box];\n  \
             p0 [shape=ellipse, label=\"%0\\nf32[2]\"];\n  n0 [label=\"%1 = Relu\\nf32[2]\"];\n  \
             p0 -> n0 [label=\"f32[2]\"];\n}\n",
        )
        .unwrap();
        assert!(svg.starts_with("<svg") || svg.contains("<svg"), "{svg}");
        assert!(svg.contains("Relu"), "{svg}");
    }

    #[test]
    fn bad_dot_is_an_error() {
        let e = render("digraph { a -> ; }").unwrap_err().to_string();
        assert!(e.contains("cannot parse"), "{e}");
    }
}
