//! The text form of a [`Function`]: [`print()`] writes it, [`parse`] reads it
//! back.
//!
//! ```text
//! @name(%0: f32[2,3], %1: bool[]) -> (f32[2,3], f32[]) {
//!   %2 = Const[dtype: f32, value: 2.0]() : f32[]  @ "src/main.rs":12:5
//!   %3 = Mul(%0, %2) : f32[2,3]  @ "src/main.rs":13:9
//!   %4 = If[then_branch: @then_3, else_branch: @else_4](%1, %3) : (f32[2,3], f32[])  @ "src/main.rs":14:9  device "cpu:1"
//!   return (%3, %4#1)
//! }
//! ```
//!
//! Parameters are `%0..%(p-1)` and node `i` is `%(p+i)`. A node with one
//! output is referred to as `%k`; output `j` of a node with any other number
//! of outputs as `%k#j`. Attributes use the [`OpAttrs`] display form; a
//! constant is a `Const` node whose attributes hold its dtype, shape and
//! values. Floats are printed with `{:?}`, the shortest form that reads back
//! to the same bits, so print → parse → print is the identity.
//!
//! The parser also reads hand-written text: value names may be any
//! identifier (`%x`, `%b#1`), and the output metadata, location and device of
//! a node may be left out (the location then points at the line of the text,
//! in the file `<text>`). It never trusts the printed output metadata: every
//! op node's metadata function runs again and must agree with it.

use crate::{Function, Node, NodeOp, Value};
use smallvec::SmallVec;
use stagecraft_ops::{func, AttrKind, AttrValue, OpAttrs, OpDef, OutputMetas};
use stagecraft_tensor::{
    bf16, f16, DType, DenseHostTensor, Element, Error, HostTensor, Location, Result, Scalar,
    ScalarHostTensor, Shape, TensorMetadata,
};
use std::collections::{HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::str::FromStr;
use std::sync::{LazyLock, Mutex};

/// The file name given to nodes whose line in the text has no location.
const TEXT_FILE: &str = "<text>";

// ---------------------------------------------------------------------------
// Printing

/// Prints a function in the text form described in the [module docs](self).
///
/// Printing never fails: values or metadata that do not exist in a
/// malformed function are printed as `?`, which [`parse`] rejects.
pub fn print(f: &Function) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_function(&mut out, f);
    out
}

fn write_function(out: &mut String, f: &Function) -> fmt::Result {
    out.push('@');
    write_func_name(out, &f.name)?;
    out.push('(');
    for (i, meta) in f.params.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write!(out, "%{i}: {meta}")?;
    }
    out.push_str(") -> (");
    for (i, v) in f.results.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        match f.try_meta(*v) {
            Ok(meta) => write!(out, "{meta}")?,
            Err(_) => out.push('?'),
        }
    }
    out.push_str(") {\n");
    for (i, node) in f.nodes.iter().enumerate() {
        write!(out, "  %{} = ", f.params.len() + i)?;
        write_node(out, f, node)?;
        out.push('\n');
    }
    out.push_str("  return (");
    write_values(out, f, &f.results)?;
    out.push_str(")\n}\n");
    Ok(())
}

fn write_node(out: &mut String, f: &Function, node: &Node) -> fmt::Result {
    match &node.op {
        NodeOp::Op(def, attrs) => {
            out.push_str(def.name);
            if !attrs.is_empty() {
                out.push('[');
                write_attrs(out, attrs)?;
                out.push(']');
            }
        }
        NodeOp::Const(tensor) => {
            out.push_str("Const[");
            write_const_attrs(out, tensor)?;
            out.push(']');
        }
    }
    out.push('(');
    write_values(out, f, &node.inputs)?;
    out.push_str(") : ");
    if node.outputs.len() == 1 {
        write!(out, "{}", node.outputs[0])?;
    } else {
        out.push('(');
        for (i, meta) in node.outputs.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            write!(out, "{meta}")?;
        }
        out.push(')');
    }
    let loc = node.location;
    write!(out, "  @ {:?}:{}:{}", loc.file(), loc.line(), loc.column())?;
    if let Some(device) = &node.device {
        write!(out, "  device {device:?}")?;
    }
    Ok(())
}

/// The `OpAttrs` display form, except that a function whose name would not
/// read back as a bare `@name` is quoted.
fn write_attrs(out: &mut String, attrs: &OpAttrs) -> fmt::Result {
    for (i, (name, value)) in attrs.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        match value {
            AttrValue::Func(id) => {
                write!(out, "{name}: @")?;
                write_func_name(out, &func::function_name(id))?;
            }
            other => write!(out, "{name}: {other}")?,
        }
    }
    Ok(())
}

fn write_const_attrs(out: &mut String, tensor: &HostTensor) -> fmt::Result {
    match tensor {
        // Only the empty list has a text form (the one a graph needs: the
        // start of a stack); a list with items prints its length and does
        // not parse back.
        HostTensor::List(list) if list.is_empty() => out.push_str("dtype: list"),
        HostTensor::List(list) => write!(out, "dtype: list, items: {}", list.len())?,
        HostTensor::Scalar(t) => {
            write!(out, "dtype: {}, value: {}", t.metadata().dtype, t.value())?;
            if t.metadata().shape.rank() > 0 {
                write!(out, ", shape: {}", t.metadata().shape)?;
            }
        }
        HostTensor::Dense(t) => {
            write!(out, "dtype: {}, shape: {}, values: [", t.dtype(), t.shape())?;
            // Every element's `Debug` is exact: bools and integers as such,
            // floats (f16 and bf16 through f32) in shortest round-trip form.
            match t.dtype() {
                DType::Bool => write_list::<bool>(out, t)?,
                DType::U8 => write_list::<u8>(out, t)?,
                DType::I8 => write_list::<i8>(out, t)?,
                DType::U16 => write_list::<u16>(out, t)?,
                DType::I16 => write_list::<i16>(out, t)?,
                DType::U32 => write_list::<u32>(out, t)?,
                DType::U64 => write_list::<u64>(out, t)?,
                DType::I32 => write_list::<i32>(out, t)?,
                DType::I64 => write_list::<i64>(out, t)?,
                DType::F16 => write_list::<f16>(out, t)?,
                DType::BF16 => write_list::<bf16>(out, t)?,
                DType::F32 => write_list::<f32>(out, t)?,
                DType::F64 => write_list::<f64>(out, t)?,
                DType::List => out.push('?'),
            }
            out.push(']');
        }
    }
    Ok(())
}

fn write_list<T: Element>(out: &mut String, t: &DenseHostTensor) -> fmt::Result {
    let Ok(values) = t.as_slice::<T>() else {
        out.push('?');
        return Ok(());
    };
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write!(out, "{v:?}")?;
    }
    Ok(())
}

fn write_values(out: &mut String, f: &Function, values: &[Value]) -> fmt::Result {
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&value_name(f, *v));
    }
    Ok(())
}

/// The printed name of a value: `%3`, or `%3#1` for an output of a node
/// that does not have exactly one output. Never panics, even for values
/// that do not exist in `f`.
pub fn value_name(f: &Function, value: Value) -> String {
    match value {
        Value::Param(i) => format!("%{i}"),
        Value::Output { node, output } => {
            let k = f.params.len() as u64 + u64::from(node);
            let single = f
                .nodes
                .get(node as usize)
                .is_some_and(|n| n.outputs.len() == 1);
            if single && output == 0 {
                format!("%{k}")
            } else {
                format!("%{k}#{output}")
            }
        }
    }
}

/// True for names that read back as a bare `@name`.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(is_name_char)
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '$' | '-')
}

fn write_func_name(out: &mut String, name: &str) -> fmt::Result {
    if is_plain_name(name) {
        out.push_str(name);
        Ok(())
    } else {
        write!(out, "{name:?}")
    }
}

// ---------------------------------------------------------------------------
// Parsing

/// Parses the text form back into a function.
///
/// Errors name the line (and column) and what was expected there. Op nodes
/// are checked with their op's metadata function, constants against their
/// printed metadata, and the results against the header's result types.
pub fn parse(text: &str) -> Result<Function> {
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, line)| (i + 1, line))
        .filter(|(_, line)| !line.trim().is_empty());
    let Some((n, header)) = lines.next() else {
        return Err(Error::invalid(
            "the text is empty: expected a function header `@name(...) -> (...) {`",
        ));
    };
    let mut parser = Parser {
        function: Function::new("", Vec::new()),
        names: HashMap::new(),
        declared_results: None,
    };
    parser.header(&mut Cursor::new(header, n))?;
    let mut last_line = n;
    loop {
        let Some((n, line)) = lines.next() else {
            return Err(Error::invalid(format!(
                "line {last_line}: the text ends inside the function: expected a node, \
                 `return (...)` and `}}`"
            )));
        };
        last_line = n;
        let mut c = Cursor::new(line, n);
        if c.eat_word("return") {
            parser.results(&mut c)?;
            break;
        }
        if c.eat("}") {
            return Err(c.error_at(
                0,
                "expected `return (...)` before the `}` closing the function",
            ));
        }
        parser.node(&mut c)?;
    }
    match lines.next() {
        Some((n, line)) => {
            let mut c = Cursor::new(line, n);
            c.expect("}", "`}` closing the function")?;
            c.expect_end()?;
        }
        None => {
            return Err(Error::invalid(format!(
                "line {last_line}: the text ends before the `}}` closing the function"
            )))
        }
    }
    if let Some((n, _)) = lines.next() {
        return Err(Error::invalid(format!(
            "line {n}: expected nothing after the `}}` closing the function"
        )));
    }
    Ok(parser.function)
}

/// What a value name in the text was bound to.
#[derive(Clone, Copy)]
enum Binding {
    Param(u32),
    Node(u32),
}

struct Parser {
    function: Function,
    names: HashMap<String, Binding>,
    /// The result types the header declares, checked against `return`.
    declared_results: Option<Vec<TensorMetadata>>,
}

impl Parser {
    fn bind(&mut self, c: &Cursor<'_>, at: usize, name: &str, binding: Binding) -> Result<()> {
        if self.names.contains_key(name) {
            return Err(c.error_at(at, format!("%{name} is defined twice")));
        }
        self.names.insert(name.to_owned(), binding);
        Ok(())
    }

    fn header(&mut self, c: &mut Cursor<'_>) -> Result<()> {
        c.expect("@", "a function header `@name(...) -> (...) {`")?;
        self.function.name = c.func_name()?;
        c.expect("(", "`(` opening the parameter list")?;
        if !c.eat(")") {
            loop {
                let at = c.skip_ws();
                let name = c.value_name()?;
                c.expect(":", "`:` and the parameter's type")?;
                let meta = c.meta()?;
                let index = u32::try_from(self.function.params.len())
                    .map_err(|_| c.error_at(at, "too many parameters"))?;
                self.bind(c, at, name, Binding::Param(index))?;
                self.function.params.push(meta);
                if c.eat(",") {
                    continue;
                }
                c.expect(")", "`,` or `)` in the parameter list")?;
                break;
            }
        }
        if c.eat("->") {
            self.declared_results = Some(c.meta_list()?);
        }
        c.expect("{", "`{` opening the function body")?;
        c.expect_end()
    }

    fn node(&mut self, c: &mut Cursor<'_>) -> Result<()> {
        let at = c.skip_ws();
        let name = c.value_name()?;
        c.expect("=", "`=` after the node's name")?;
        let op_at = c.skip_ws();
        let op_name = c.ident("an op name")?;
        let (op, inputs, printed) = if op_name == "Const" {
            let tensor = parse_const_attrs(c)?;
            c.expect("(", "`(` opening the input list")?;
            c.expect(")", "`)`: a constant has no inputs")?;
            let printed = if c.eat(":") { Some(c.outputs()?) } else { None };
            (NodeOp::Const(tensor), SmallVec::new(), printed)
        } else {
            let def = stagecraft_ops::find_op(op_name)
                .ok_or_else(|| c.error_at(op_at, format!("unknown op `{op_name}`")))?;
            let attrs = parse_op_attrs(c, def)?;
            let inputs = self.inputs(c)?;
            let printed = if c.eat(":") { Some(c.outputs()?) } else { None };
            (NodeOp::Op(def, attrs.freeze()), inputs, printed)
        };
        let location = if c.eat("@") {
            let file = c.string("a quoted file name")?;
            c.expect(":", "`:` and a line number")?;
            let line = c.uint::<u32>("a line number")?;
            c.expect(":", "`:` and a column number")?;
            let column = c.uint::<u32>("a column number")?;
            Location::new(intern_file(&file), line, column)
        } else {
            Location::new(TEXT_FILE, c.line as u32, 1)
        };
        let device = if c.eat_word("device") {
            Some(c.string("a quoted device name")?)
        } else {
            None
        };
        if !c.at_end() {
            return Err(c.expected(
                "` : ` and output types, `@ \"file\":line:column`, `device \"name\"` or the end of the line",
            ));
        }

        let outputs = self.node_outputs(c, op_at, &op, &inputs, printed)?;
        let index = u32::try_from(self.function.nodes.len())
            .map_err(|_| c.error_at(at, "too many nodes"))?;
        self.bind(c, at, name, Binding::Node(index))?;
        self.function.push(Node {
            op,
            inputs,
            outputs,
            device,
            location,
            // Origins index a lazy recording, which text does not carry.
            origin: None,
        });
        Ok(())
    }

    /// The node's output metadata: recomputed for an op, the constant's own
    /// for a constant; the printed metadata, when given, must agree.
    fn node_outputs(
        &self,
        c: &Cursor<'_>,
        op_at: usize,
        op: &NodeOp,
        inputs: &[Value],
        printed: Option<OutputMetas>,
    ) -> Result<OutputMetas> {
        let computed: OutputMetas = match op {
            NodeOp::Const(tensor) => smallvec::smallvec![tensor.metadata().clone()],
            NodeOp::Op(def, attrs) => {
                let metas: SmallVec<[TensorMetadata; 4]> = inputs
                    .iter()
                    .map(|v| self.function.meta(*v).clone())
                    .collect();
                infer(def, &metas, attrs).map_err(|e| {
                    Error::new(
                        e.kind(),
                        format!(
                            "line {}, column {}: {}: {}",
                            c.line,
                            c.column(op_at),
                            def.name,
                            e.message()
                        ),
                    )
                })?
            }
        };
        match printed {
            Some(printed) if printed != computed => Err(c.error_at(
                op_at,
                format!(
                    "{} is printed with outputs {} but computes {}",
                    op.name(),
                    meta_list(&printed),
                    meta_list(&computed)
                ),
            )),
            _ => Ok(computed),
        }
    }

    fn inputs(&self, c: &mut Cursor<'_>) -> Result<SmallVec<[Value; 4]>> {
        c.expect("(", "`(` opening the input list")?;
        let mut values = SmallVec::new();
        if c.eat(")") {
            return Ok(values);
        }
        loop {
            values.push(self.value_ref(c)?);
            if c.eat(",") {
                continue;
            }
            c.expect(")", "`,` or `)` in the input list")?;
            return Ok(values);
        }
    }

    fn results(&mut self, c: &mut Cursor<'_>) -> Result<()> {
        c.expect("(", "`(` opening the list of results")?;
        let at = c.pos;
        if !c.eat(")") {
            loop {
                let v = self.value_ref(c)?;
                self.function.results.push(v);
                if c.eat(",") {
                    continue;
                }
                c.expect(")", "`,` or `)` in the list of results")?;
                break;
            }
        }
        c.expect_end()?;
        if let Some(declared) = &self.declared_results {
            let actual = self.function.result_metas();
            if *declared != actual {
                return Err(c.error_at(
                    at,
                    format!(
                        "the header declares results {} but the function returns {}",
                        meta_list(declared),
                        meta_list(&actual)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `%name` or `%name#j`, resolved against the values defined so far.
    fn value_ref(&self, c: &mut Cursor<'_>) -> Result<Value> {
        let at = c.skip_ws();
        let name = c.value_name()?;
        let index = if c.peek() == Some('#') {
            c.pos += 1;
            Some(c.uint::<u32>("an output index after `#`")?)
        } else {
            None
        };
        let binding = self.names.get(name).copied().ok_or_else(|| {
            c.error_at(
                at,
                format!("unknown value %{name} (values must be defined before they are used)"),
            )
        })?;
        match (binding, index) {
            (Binding::Param(i), None | Some(0)) => Ok(Value::Param(i)),
            (Binding::Param(_), Some(j)) => {
                Err(c.error_at(at, format!("%{name} is a parameter, it has no output {j}")))
            }
            (Binding::Node(node), index) => {
                let n = self.function.nodes[node as usize].outputs.len();
                let output = match index {
                    Some(j) if (j as usize) < n => j,
                    Some(j) => {
                        return Err(c.error_at(
                            at,
                            format!("%{name} has {n} outputs, so it has no output #{j}"),
                        ))
                    }
                    None if n == 1 => 0,
                    None => {
                        return Err(c.error_at(
                            at,
                            format!("%{name} has {n} outputs: name one as %{name}#j"),
                        ))
                    }
                };
                Ok(Value::Output { node, output })
            }
        }
    }
}

/// Runs an op's metadata function. A panic in it (a bug in the op's shape
/// rule, reachable through strange text) becomes an error, so that parsing
/// and verifying never panic.
pub(crate) fn infer(
    def: &'static OpDef,
    inputs: &[TensorMetadata],
    attrs: &OpAttrs,
) -> Result<OutputMetas> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| def.infer(inputs, attrs)))
        .unwrap_or_else(|_| {
            Err(Error::internal(format!(
                "the metadata function of {} panicked",
                def.name
            )))
        })
}

fn parse_op_attrs(c: &mut Cursor<'_>, def: &'static OpDef) -> Result<OpAttrs> {
    let mut attrs = OpAttrs::new();
    if !c.eat("[") || c.eat("]") {
        return Ok(attrs);
    }
    loop {
        let at = c.skip_ws();
        let name = c.ident("an attribute name")?;
        let spec = def.attrs.iter().find(|s| s.name == name).ok_or_else(|| {
            let known: Vec<String> = def.attrs.iter().map(|s| format!("`{}`", s.name)).collect();
            let known = if known.is_empty() {
                "no attributes".to_owned()
            } else {
                known.join(", ")
            };
            c.error_at(
                at,
                format!("{} has no attribute `{name}`; it takes {known}", def.name),
            )
        })?;
        if attrs.get(spec.name).is_some() {
            return Err(c.error_at(at, format!("attribute `{name}` is given twice")));
        }
        c.expect(":", "`:` after the attribute name")?;
        parse_attr_value(c, &mut attrs, spec.name, spec.kind)?;
        if c.eat(",") {
            continue;
        }
        c.expect("]", "`,` or `]` in the attribute list")?;
        return Ok(attrs);
    }
}

fn parse_attr_value(
    c: &mut Cursor<'_>,
    attrs: &mut OpAttrs,
    name: &'static str,
    kind: AttrKind,
) -> Result<()> {
    match kind {
        AttrKind::Bool => {
            attrs.set_bool(name, c.bool()?);
        }
        AttrKind::Int => {
            attrs.set_int(name, c.number::<i64>("an integer")?);
        }
        AttrKind::Float => {
            attrs.set_float(name, c.number::<f64>("a float")?);
        }
        AttrKind::DType => {
            attrs.set_dtype(name, c.dtype()?);
        }
        AttrKind::Scalar => {
            let at = c.skip_ws();
            let token = c.token();
            c.expect(":", "`:` and the scalar's dtype (as in `2.0:f32`)")?;
            let dtype = c.dtype()?;
            let value = parse_scalar(token, dtype).ok_or_else(|| {
                c.error_at(at, format!("expected a {dtype} value, found {token:?}"))
            })?;
            attrs.set_scalar(name, value);
        }
        AttrKind::Ints => {
            let values = c.list(|c| c.number::<i64>("an integer"))?;
            attrs.set_ints(name, &values);
        }
        AttrKind::Floats => {
            let values = c.list(|c| c.number::<f64>("a float"))?;
            attrs.set_floats(name, &values);
        }
        AttrKind::Str => {
            let value = c.string("a quoted string")?;
            attrs.set_str(name, &value);
        }
        AttrKind::Func => {
            let at = c.skip_ws();
            c.expect("@", "a function name `@name`")?;
            let fname = c.func_name()?;
            let id = func::find_function(&fname).ok_or_else(|| {
                c.error_at(at, format!("no function named @{fname} in the library"))
            })?;
            attrs.set_func(name, id);
        }
    }
    Ok(())
}

/// A value of `dtype` from its printed token, `None` if it does not parse
/// or does not fit.
fn parse_scalar(token: &str, dtype: DType) -> Option<Scalar> {
    Some(match dtype {
        DType::Bool => Scalar::Bool(parse_bool(token)?),
        DType::U8 => Scalar::U8(token.parse().ok()?),
        DType::I8 => Scalar::I8(token.parse().ok()?),
        DType::U16 => Scalar::U16(token.parse().ok()?),
        DType::I16 => Scalar::I16(token.parse().ok()?),
        DType::U32 => Scalar::U32(token.parse().ok()?),
        DType::U64 => Scalar::U64(token.parse().ok()?),
        DType::I32 => Scalar::I32(token.parse().ok()?),
        DType::I64 => Scalar::I64(token.parse().ok()?),
        // Printed through f32, which holds every f16 and bf16 exactly.
        DType::F16 => Scalar::F16(f16::from_f32(token.parse().ok()?)),
        DType::BF16 => Scalar::BF16(bf16::from_f32(token.parse().ok()?)),
        // Parsed at the dtype's own precision: through f64 would round twice.
        DType::F32 => Scalar::F32(token.parse().ok()?),
        DType::F64 => Scalar::F64(token.parse().ok()?),
        DType::List => return None,
    })
}

fn parse_bool(token: &str) -> Option<bool> {
    match token {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// `Const[dtype: D, value: V]`, `Const[dtype: D, value: V, shape: S]` or
/// `Const[dtype: D, shape: S, values: [...]]`.
fn parse_const_attrs(c: &mut Cursor<'_>) -> Result<HostTensor> {
    c.expect("[", "`[` and the constant's attributes")?;
    c.skip_ws();
    if !c.eat_word("dtype") {
        return Err(c.expected("`dtype` as the first attribute of Const"));
    }
    c.expect(":", "`:` after `dtype`")?;
    let dtype = c.dtype()?;
    if dtype == DType::List {
        c.expect(
            "]",
            "`]`: a list constant is the empty list, `Const[dtype: list]`",
        )?;
        return Ok(HostTensor::List(stagecraft_tensor::TensorList::empty()));
    }
    let mut shape: Option<Shape> = None;
    let mut value: Option<Scalar> = None;
    let mut dense: Option<(usize, Vec<Scalar>)> = None;
    while c.eat(",") {
        let at = c.skip_ws();
        let key = c.ident("a Const attribute (`value`, `shape` or `values`)")?;
        c.expect(":", "`:` after the attribute name")?;
        let duplicate = match key {
            "shape" => shape.replace(c.dims()?).is_some(),
            "value" => {
                let token_at = c.skip_ws();
                let token = c.token();
                let v = parse_scalar(token, dtype).ok_or_else(|| {
                    c.error_at(token_at, format!("expected a {dtype} value, found {token:?}"))
                })?;
                value.replace(v).is_some()
            }
            "values" => {
                let values_at = c.skip_ws();
                let values = c.list(|c| {
                    let token_at = c.skip_ws();
                    let token = c.token();
                    parse_scalar(token, dtype).ok_or_else(|| {
                        c.error_at(token_at, format!("expected a {dtype} value, found {token:?}"))
                    })
                })?;
                dense.replace((values_at, values)).is_some()
            }
            other => {
                return Err(c.error_at(
                    at,
                    format!("Const has no attribute `{other}`; it takes `dtype`, `value`, `shape` and `values`"),
                ))
            }
        };
        if duplicate {
            return Err(c.error_at(at, format!("attribute `{key}` is given twice")));
        }
    }
    c.expect("]", "`,` or `]` in the attribute list")?;
    match (value, dense) {
        (Some(v), None) => Ok(ScalarHostTensor::new(v, shape.unwrap_or_default()).into()),
        (None, Some((at, values))) => {
            let shape = shape.unwrap_or_else(|| Shape::new(&[values.len()]));
            dense_tensor(dtype, &values, shape)
                .map(HostTensor::from)
                .map_err(|e| c.error_at(at, e.message().to_owned()))
        }
        (Some(_), Some(_)) => Err(c.error_at(
            c.pos,
            "Const takes either `value` (one repeated value) or `values`, not both",
        )),
        (None, None) => Err(c.error_at(c.pos, "Const needs a `value` or `values` attribute")),
    }
}

fn dense_tensor(dtype: DType, values: &[Scalar], shape: Shape) -> Result<DenseHostTensor> {
    fn build<T: Element>(values: &[Scalar], shape: Shape) -> Result<DenseHostTensor> {
        let typed: Vec<T> = values.iter().map(|v| T::from_scalar(*v)).collect();
        DenseHostTensor::from_slice(&typed, shape)
    }
    match dtype {
        DType::Bool => build::<bool>(values, shape),
        DType::U8 => build::<u8>(values, shape),
        DType::I8 => build::<i8>(values, shape),
        DType::U16 => build::<u16>(values, shape),
        DType::I16 => build::<i16>(values, shape),
        DType::U32 => build::<u32>(values, shape),
        DType::U64 => build::<u64>(values, shape),
        DType::I32 => build::<i32>(values, shape),
        DType::I64 => build::<i64>(values, shape),
        DType::F16 => build::<f16>(values, shape),
        DType::BF16 => build::<bf16>(values, shape),
        DType::F32 => build::<f32>(values, shape),
        DType::F64 => build::<f64>(values, shape),
        DType::List => Err(stagecraft_tensor::Error::dtype(
            "a list constant has no values",
        )),
    }
}

fn meta_list(metas: &[TensorMetadata]) -> String {
    let items: Vec<String> = metas.iter().map(|m| m.to_string()).collect();
    format!("({})", items.join(", "))
}

/// A `&'static str` for a file name read from text (a [`Location`] holds
/// only static names). Each distinct name is leaked once, so parsing the
/// same text again allocates nothing more.
fn intern_file(name: &str) -> &'static str {
    static FILES: LazyLock<Mutex<HashSet<&'static str>>> =
        LazyLock::new(|| Mutex::new(HashSet::new()));
    let mut files = FILES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&interned) = files.get(name) {
        return interned;
    }
    let interned: &'static str = Box::leak(name.to_owned().into_boxed_str());
    files.insert(interned);
    interned
}

/// A position in one line of the text.
struct Cursor<'a> {
    text: &'a str,
    /// Byte offset into `text`, always on a char boundary.
    pos: usize,
    /// 1-based line number, for messages.
    line: usize,
}

impl<'a> Cursor<'a> {
    fn new(text: &'a str, line: usize) -> Cursor<'a> {
        Cursor { text, pos: 0, line }
    }

    fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    /// Skips blanks; returns the new position (for error messages).
    fn skip_ws(&mut self) -> usize {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start().len();
        self.pos
    }

    fn at_end(&mut self) -> bool {
        self.skip_ws();
        self.pos == self.text.len()
    }

    fn column(&self, at: usize) -> usize {
        self.text[..at].chars().count() + 1
    }

    fn error_at(&self, at: usize, message: impl fmt::Display) -> Error {
        Error::invalid(format!(
            "line {}, column {}: {message}",
            self.line,
            self.column(at)
        ))
    }

    /// "expected X, found Y" at the current position.
    fn expected(&mut self, what: &str) -> Error {
        let at = self.skip_ws();
        let rest = self.rest();
        let found = if rest.is_empty() {
            "the end of the line".to_owned()
        } else {
            let snippet: String = rest.chars().take(24).collect();
            let more = if snippet.len() < rest.len() {
                "..."
            } else {
                ""
            };
            format!("{snippet:?}{more}")
        };
        self.error_at(at, format!("expected {what}, found {found}"))
    }

    fn eat(&mut self, s: &str) -> bool {
        self.skip_ws();
        if self.rest().starts_with(s) {
            self.pos += s.len();
            true
        } else {
            false
        }
    }

    /// Eats a keyword only when it is a whole word.
    fn eat_word(&mut self, word: &str) -> bool {
        self.skip_ws();
        let rest = self.rest();
        let whole = rest.starts_with(word)
            && !rest[word.len()..]
                .chars()
                .next()
                .is_some_and(|ch| ch.is_ascii_alphanumeric() || ch == '_');
        if whole {
            self.pos += word.len();
        }
        whole
    }

    fn expect(&mut self, s: &str, what: &str) -> Result<()> {
        if self.eat(s) {
            Ok(())
        } else {
            Err(self.expected(what))
        }
    }

    fn expect_end(&mut self) -> Result<()> {
        if self.at_end() {
            Ok(())
        } else {
            Err(self.expected("the end of the line"))
        }
    }

    fn take_while(&mut self, keep: impl Fn(char) -> bool) -> &'a str {
        let rest = self.rest();
        let len = rest.find(|ch: char| !keep(ch)).unwrap_or(rest.len());
        self.pos += len;
        &rest[..len]
    }

    fn ident(&mut self, what: &str) -> Result<&'a str> {
        self.skip_ws();
        if !self
            .peek()
            .is_some_and(|ch| ch.is_ascii_alphabetic() || ch == '_')
        {
            return Err(self.expected(what));
        }
        Ok(self.take_while(|ch| ch.is_ascii_alphanumeric() || ch == '_'))
    }

    /// The name after `%` (without it).
    fn value_name(&mut self) -> Result<&'a str> {
        self.skip_ws();
        if !self.rest().starts_with('%') {
            return Err(self.expected("a value such as `%3`"));
        }
        self.pos += 1;
        let name = self.take_while(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '.');
        if name.is_empty() {
            self.pos -= 1;
            return Err(self.expected("a value name after `%`"));
        }
        Ok(name)
    }

    /// A function name after `@`: bare or quoted.
    fn func_name(&mut self) -> Result<String> {
        if self.peek() == Some('"') {
            return self.string("a function name");
        }
        let name = self.take_while(is_name_char);
        if name.is_empty() {
            return Err(self.expected("a function name after `@`"));
        }
        Ok(name.to_owned())
    }

    /// A run of characters that can make up a number or a bool (`-1.5e-7`,
    /// `NaN`, `-inf`, `true`); may be empty.
    fn token(&mut self) -> &'a str {
        self.skip_ws();
        self.take_while(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '+' | '-'))
    }

    fn number<T: FromStr>(&mut self, what: &str) -> Result<T> {
        let at = self.skip_ws();
        let token = self.token();
        token.parse().map_err(|_| {
            self.pos = at;
            self.expected(what)
        })
    }

    fn uint<T: FromStr>(&mut self, what: &str) -> Result<T> {
        let at = self.skip_ws();
        let token = self.take_while(|ch| ch.is_ascii_digit());
        token.parse().map_err(|_| {
            self.pos = at;
            self.expected(what)
        })
    }

    fn bool(&mut self) -> Result<bool> {
        let at = self.skip_ws();
        let token = self.token();
        parse_bool(token).ok_or_else(|| {
            self.pos = at;
            self.expected("`true` or `false`")
        })
    }

    fn dtype(&mut self) -> Result<DType> {
        let at = self.skip_ws();
        let token = self.take_while(|ch| ch.is_ascii_alphanumeric());
        DType::parse(token).ok_or_else(|| {
            self.pos = at;
            self.expected("a dtype (bool, i32, i64, f16, bf16, f32 or f64)")
        })
    }

    /// `[item, item, ...]`.
    fn list<T>(&mut self, mut item: impl FnMut(&mut Self) -> Result<T>) -> Result<Vec<T>> {
        self.expect("[", "`[` opening a list")?;
        let mut items = Vec::new();
        if self.eat("]") {
            return Ok(items);
        }
        loop {
            items.push(item(self)?);
            if self.eat(",") {
                continue;
            }
            self.expect("]", "`,` or `]` in a list")?;
            return Ok(items);
        }
    }

    fn dims(&mut self) -> Result<Shape> {
        let at = self.skip_ws();
        let dims = self.list(|c| c.uint::<usize>("a dimension"))?;
        let shape = Shape::new(&dims);
        // A shape nothing can hold would only make later arithmetic overflow.
        if shape.checked_numel().is_err() {
            return Err(self.error_at(at, format!("the shape {shape} has too many elements")));
        }
        Ok(shape)
    }

    /// `f32[2,3]`.
    fn meta(&mut self) -> Result<TensorMetadata> {
        let dtype = self.dtype()?;
        let shape = self.dims()?;
        Ok(TensorMetadata::new(dtype, shape))
    }

    /// `(meta, meta, ...)`.
    fn meta_list(&mut self) -> Result<Vec<TensorMetadata>> {
        self.expect("(", "`(` opening a list of types")?;
        let mut metas = Vec::new();
        if self.eat(")") {
            return Ok(metas);
        }
        loop {
            metas.push(self.meta()?);
            if self.eat(",") {
                continue;
            }
            self.expect(")", "`,` or `)` in a list of types")?;
            return Ok(metas);
        }
    }

    /// One output type, or a parenthesized list of them.
    fn outputs(&mut self) -> Result<OutputMetas> {
        self.skip_ws();
        if self.peek() == Some('(') {
            Ok(self.meta_list()?.into_iter().collect())
        } else {
            Ok(smallvec::smallvec![self.meta()?])
        }
    }

    /// A double-quoted string with Rust's escapes (`{:?}` output).
    fn string(&mut self, what: &str) -> Result<String> {
        let start = self.skip_ws();
        if !self.rest().starts_with('"') {
            return Err(self.expected(what));
        }
        let mut chars = self.rest().char_indices().skip(1);
        let mut out = String::new();
        while let Some((i, ch)) = chars.next() {
            match ch {
                '"' => {
                    self.pos += i + 1;
                    return Ok(out);
                }
                '\\' => {
                    let escaped = match chars.next() {
                        Some((_, 'n')) => '\n',
                        Some((_, 'r')) => '\r',
                        Some((_, 't')) => '\t',
                        Some((_, '0')) => '\0',
                        Some((_, '\\')) => '\\',
                        Some((_, '"')) => '"',
                        Some((_, '\'')) => '\'',
                        Some((j, 'u')) => {
                            let code = self.rest().get(j + 1..).and_then(|s| {
                                let body = s.strip_prefix('{')?;
                                let end = body.find('}')?;
                                let c = u32::from_str_radix(&body[..end], 16).ok()?;
                                // `{`, the hex digits and `}`, all ASCII.
                                Some((char::from_u32(c)?, end + 2))
                            });
                            let Some((ch, len)) = code else {
                                return Err(self
                                    .error_at(start + j, "invalid `\\u{...}` escape in a string"));
                            };
                            for _ in 0..len {
                                chars.next();
                            }
                            ch
                        }
                        _ => {
                            return Err(self.error_at(start + i, "invalid escape in a string"));
                        }
                    };
                    out.push(escaped);
                }
                other => out.push(other),
            }
        }
        Err(self.error_at(start, "unterminated string"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use stagecraft_ops as ops;

    fn meta(dtype: DType, dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(dtype, dims)
    }

    fn loc(line: u32) -> Location {
        Location::new("src/main.rs", line, 5)
    }

    /// Asserts print → parse → print is the identity and the parsed
    /// function verifies; returns the printed text.
    fn assert_round_trip(f: &Function) -> String {
        let printed = print(f);
        let parsed = parse(&printed).unwrap_or_else(|e| panic!("{e}\n{printed}"));
        assert_eq!(print(&parsed), printed);
        crate::verify(&parsed).unwrap_or_else(|e| panic!("{e}\n{printed}"));
        assert_eq!(parsed.nodes.len(), f.nodes.len());
        for (a, b) in parsed.nodes.iter().zip(&f.nodes) {
            assert_eq!(a.location, b.location);
            assert_eq!(a.device, b.device);
            assert_eq!(a.outputs, b.outputs);
            assert_eq!(a.inputs, b.inputs);
        }
        assert_eq!(parsed.results, f.results);
        printed
    }

    #[test]
    fn prints_the_documented_form() {
        let mut f = Function::new(
            "name",
            vec![meta(DType::F32, &[2, 3]), meta(DType::F32, &[])],
        );
        let two = f.add_const(ScalarHostTensor::new(Scalar::F32(2.0), []).into(), loc(12));
        let prod = f
            .add_op(
                &ops::MUL,
                &OpAttrs::new(),
                &[Value::Param(0), Value::node(two)],
                loc(13),
            )
            .unwrap();
        f.nodes[prod].device = Some("cpu:1".into());
        f.results = vec![Value::node(prod), Value::Param(1)];
        let text = assert_round_trip(&f);
        assert_eq!(
            text,
            "@name(%0: f32[2,3], %1: f32[]) -> (f32[2,3], f32[]) {\n\
             \x20 %2 = Const[dtype: f32, value: 2.0]() : f32[]  @ \"src/main.rs\":12:5\n\
             \x20 %3 = Mul(%0, %2) : f32[2,3]  @ \"src/main.rs\":13:5  device \"cpu:1\"\n\
             \x20 return (%3, %1)\n\
             }\n"
        );
    }

    #[test]
    fn round_trips_unary_binary_reductions_and_casts() {
        let x = meta(DType::F32, &[2, 3]);
        let mut f = Function::new("ops", vec![x.clone(), meta(DType::F32, &[3])]);
        let none = OpAttrs::new();
        let e = f
            .add_op(&ops::EXP, &none, &[Value::Param(0)], loc(1))
            .unwrap();
        let s = f
            .add_op(&ops::ADD, &none, &[Value::node(e), Value::Param(1)], loc(2))
            .unwrap();
        let mut reduce = OpAttrs::new();
        reduce.set_ints("axes", &[1]).set_bool("keepdim", true);
        let r = f
            .add_op(&ops::SUM, &reduce, &[Value::node(s)], loc(3))
            .unwrap();
        let mut all = OpAttrs::new();
        all.set_ints("axes", &[]).set_bool("keepdim", false);
        let m = f
            .add_op(&ops::MEAN, &all, &[Value::node(s)], loc(4))
            .unwrap();
        let mut cast = OpAttrs::new();
        cast.set_dtype("dtype", DType::F64);
        let c = f
            .add_op(&ops::CAST, &cast, &[Value::node(r)], loc(5))
            .unwrap();
        let mut fill = OpAttrs::new();
        fill.set_ints("shape", &[2, 2])
            .set_scalar("value", Scalar::I32(-3));
        let fl = f.add_op(&ops::FILL, &fill, &[], loc(6)).unwrap();
        let mut arange = OpAttrs::new();
        arange
            .set_float("start", -0.5)
            .set_float("stop", 1e-3)
            .set_float("step", 0.1);
        let ar = f.add_op(&ops::ARANGE, &arange, &[], loc(7)).unwrap();
        let mut label = OpAttrs::new();
        label.set_str("label", "a \"quoted\"\\ label\n\té\u{7f}");
        let p = f
            .add_op(&ops::PRINT, &label, &[Value::node(m)], loc(8))
            .unwrap();
        f.results = [c, fl, ar, p].map(Value::node).to_vec();
        let text = assert_round_trip(&f);
        assert!(
            text.contains("%4 = Sum[axes: [1], keepdim: true](%3) : f32[2,1]"),
            "{text}"
        );
        assert!(text.contains("Cast[dtype: f64](%4) : f64[2,1]"), "{text}");
        assert!(
            text.contains("Fill[shape: [2, 2], value: -3:i32]() : i32[2,2]"),
            "{text}"
        );
    }

    #[test]
    fn round_trips_constants() {
        let mut f = Function::new("consts", vec![]);
        let tensors: Vec<HostTensor> = vec![
            DenseHostTensor::from_slice(&[1.0f32, -0.0, 0.1, 3.4e38, f32::INFINITY, 1e-45], [2, 3])
                .unwrap()
                .into(),
            DenseHostTensor::from_slice(&[0.1f64, std::f64::consts::PI, -1e300], [3])
                .unwrap()
                .into(),
            DenseHostTensor::from_slice(&[i64::MIN, 0, i64::MAX], [3, 1])
                .unwrap()
                .into(),
            DenseHostTensor::from_slice(&[-7i32], []).unwrap().into(),
            DenseHostTensor::from_slice(&[true, false, true, true], [2, 2])
                .unwrap()
                .into(),
            DenseHostTensor::from_slice(
                &[f16::from_f32(0.1), f16::MAX, f16::MIN_POSITIVE_SUBNORMAL],
                [3],
            )
            .unwrap()
            .into(),
            DenseHostTensor::from_slice(&[bf16::from_f32(0.3), bf16::from_f32(-2.5e30)], [2])
                .unwrap()
                .into(),
            DenseHostTensor::from_slice::<f32>(&[], [0, 4])
                .unwrap()
                .into(),
            ScalarHostTensor::new(Scalar::F32(0.1), []).into(),
            ScalarHostTensor::new(Scalar::F64(-2.5e-300), [2, 3]).into(),
            ScalarHostTensor::new(Scalar::I64(-9_007_199_254_740_993), [4]).into(),
            ScalarHostTensor::new(Scalar::Bool(true), [1, 1]).into(),
            ScalarHostTensor::new(Scalar::F16(f16::from_f32(65504.0)), []).into(),
            ScalarHostTensor::new(Scalar::F32(f32::NAN), [2]).into(),
        ];
        for (i, t) in tensors.iter().enumerate() {
            let k = f.add_const(t.clone(), loc(i as u32));
            f.results.push(Value::node(k));
        }
        let text = assert_round_trip(&f);
        assert!(
            text.contains("Const[dtype: f32, value: 0.1]() : f32[]"),
            "{text}"
        );
        assert!(
            text.contains("Const[dtype: f64, value: -2.5e-300, shape: [2,3]]"),
            "{text}"
        );
        assert!(
            text.contains("Const[dtype: bool, shape: [2,2], values: [true, false, true, true]]"),
            "{text}"
        );
        let parsed = parse(&text).unwrap();
        for (node, original) in parsed.nodes.iter().zip(&tensors) {
            let NodeOp::Const(t) = &node.op else {
                panic!("not a constant")
            };
            let (a, b) = (t.to_dense().unwrap(), original.to_dense().unwrap());
            assert_eq!(a.metadata(), b.metadata());
            // NaN is the only value whose bits the text does not keep.
            if !a.get_scalar(0).is_some_and(|v| v.to_f64().is_nan()) {
                assert_eq!(a.buffer().bytes(), b.buffer().bytes());
            }
            assert_eq!(
                matches!(t, HostTensor::Scalar(_)),
                matches!(original, HostTensor::Scalar(_))
            );
        }
    }

    fn branch(name: &str, unary: &'static OpDef, reduce: &'static OpDef) -> Function {
        let mut f = Function::new(name, vec![meta(DType::F32, &[2, 3])]);
        let a = f
            .add_op(unary, &OpAttrs::new(), &[Value::Param(0)], loc(40))
            .unwrap();
        let b = f
            .add_op(reduce, &OpAttrs::new(), &[Value::Param(0)], loc(41))
            .unwrap();
        f.results = vec![Value::node(a), Value::node(b)];
        f
    }

    #[test]
    fn round_trips_multi_output_nodes_devices_and_locations() {
        let then_id = branch("text_then_3", &ops::NEG, &ops::SUM).register();
        let else_id = branch("text_else_4", &ops::EXP, &ops::MEAN).register();
        let mut f = Function::new(
            "with_if",
            vec![meta(DType::Bool, &[]), meta(DType::F32, &[2, 3])],
        );
        let mut attrs = OpAttrs::new();
        attrs
            .set_func("then_branch", then_id)
            .set_func("else_branch", else_id);
        let node = f
            .add_op(
                &ops::IF,
                &attrs,
                &[Value::Param(0), Value::Param(1)],
                Location::new("dir with space/\"odd\" name.rs", 7, 21),
            )
            .unwrap();
        f.nodes[node].device = Some("cpu:1".into());
        let out1 = Value::Output {
            node: node as u32,
            output: 1,
        };
        let twice = f
            .add_op(&ops::ADD, &OpAttrs::new(), &[out1, out1], loc(9))
            .unwrap();
        f.results = vec![Value::node(node), out1, Value::node(twice)];
        let text = assert_round_trip(&f);
        assert!(
            text.contains(
                "%2 = If[then_branch: @text_then_3, else_branch: @text_else_4](%0, %1) : (f32[2,3], f32[])"
            ),
            "{text}"
        );
        assert!(text.contains("%3 = Add(%2#1, %2#1) : f32[]"), "{text}");
        assert!(text.contains("return (%2#0, %2#1, %3)"), "{text}");
        let parsed = parse(&text).unwrap();
        assert_eq!(
            parsed.nodes[0].location.file(),
            "dir with space/\"odd\" name.rs"
        );
        // Interned: a second parse reuses the same leaked file name.
        let again = parse(&text).unwrap();
        assert!(std::ptr::eq(
            parsed.nodes[0].location.file(),
            again.nodes[0].location.file()
        ));
    }

    #[test]
    fn quotes_function_names_that_are_not_plain() {
        let callee = branch("text callee \"q\"", &ops::ABS, &ops::MAX).register();
        let mut f = Function::new("odd name", vec![meta(DType::F32, &[2, 3])]);
        let mut attrs = OpAttrs::new();
        attrs.set_func("f", callee);
        let call = f
            .add_op(&ops::CALL, &attrs, &[Value::Param(0)], loc(1))
            .unwrap();
        f.results = vec![Value::Output {
            node: call as u32,
            output: 1,
        }];
        let text = assert_round_trip(&f);
        assert!(text.starts_with("@\"odd name\"("), "{text}");
        assert!(
            text.contains("Call[f: @\"text callee \\\"q\\\"\"]"),
            "{text}"
        );
    }

    #[test]
    fn parses_hand_written_text() {
        let text = "
            @hand(%x: f32[2,3], %b: bool[]) -> (f32[2,3]) {
              %two = Const[dtype: f32, value: 2.0]()
              %y = Mul(%x, %two)
              %z = Select(%b, %y, %x) : f32[2,3]   device \"cpu:0\"
              return (%z)
            }
        ";
        let f = parse(text).unwrap();
        crate::verify(&f).unwrap();
        assert_eq!(f.nodes.len(), 3);
        assert_eq!(f.nodes[1].outputs[0], meta(DType::F32, &[2, 3]));
        assert_eq!(f.nodes[2].location, Location::new("<text>", 5, 1));
        assert_eq!(f.nodes[2].device.as_deref(), Some("cpu:0"));
        assert_eq!(f.results, vec![Value::node(2)]);
        assert_round_trip(&f);
    }

    fn parse_err(text: &str) -> String {
        match parse(text) {
            Ok(f) => panic!("parsed:\n{}", print(&f)),
            Err(e) => e.to_string(),
        }
    }

    const GOOD: &str = "@f(%0: f32[2]) -> (f32[2]) {\n  %1 = Neg(%0) : f32[2]\n  return (%1)\n}\n";

    #[test]
    fn rejects_bad_text_with_the_line_and_what_was_expected() {
        parse(GOOD).unwrap();
        let e = parse_err(&GOOD.replace("Neg", "Negate"));
        assert!(
            e.contains("line 2") && e.contains("unknown op `Negate`"),
            "{e}"
        );
        let e = parse_err(&GOOD.replace("Neg(%0)", "Sum[axis: [0]](%0)"));
        assert!(e.contains("Sum has no attribute `axis`"), "{e}");
        assert!(e.contains("`axes`, `keepdim`"), "{e}");
        let e = parse_err(&GOOD.replace("Neg(%0)", "Sum[axes: 0](%0)"));
        assert!(e.contains("expected `[` opening a list"), "{e}");
        let e = parse_err(&GOOD.replace("Neg(%0)", "Neg(%7)"));
        assert!(e.contains("unknown value %7"), "{e}");
        let e = parse_err(&GOOD.replace("Neg(%0)", "Neg(%1)"));
        assert!(e.contains("unknown value %1"), "{e}");
        let e = parse_err(&GOOD.replace("return (%1)", "return (%1#2)"));
        assert!(e.contains("line 3") && e.contains("no output #2"), "{e}");
        let e = parse_err(&GOOD.replace(": f32[2]\n", ": f32[3]\n"));
        assert!(
            e.contains("printed with outputs (f32[3]) but computes (f32[2])"),
            "{e}"
        );
        let e = parse_err(&GOOD.replace("-> (f32[2])", "-> (f64[2])"));
        assert!(e.contains("declares results (f64[2])"), "{e}");
        let e = parse_err(&GOOD.replace("Neg(%0)", "Neg(%0, %0)"));
        assert!(e.contains("Neg") && e.contains("expects 1 inputs"), "{e}");
        let e = parse_err(&GOOD.replace("%1 = Neg", "%0 = Neg"));
        assert!(e.contains("%0 is defined twice"), "{e}");
        let e = parse_err(&GOOD.replace("f32[2]) ->", "f33[2]) ->"));
        assert!(
            e.contains("line 1") && e.contains("expected a dtype"),
            "{e}"
        );
        let e = parse_err(&format!("{GOOD}extra"));
        assert!(e.contains("after the `}`"), "{e}");
        let e = parse_err("");
        assert!(e.contains("empty"), "{e}");
        let e = parse_err(&GOOD.replace("  return (%1)\n", ""));
        assert!(
            e.contains("line 3") && e.contains("expected `return (...)`"),
            "{e}"
        );
        let e = parse_err(&GOOD.replace("Neg(%0) : f32[2]", "Const[dtype: i32, value: 1.5]()"));
        assert!(e.contains("expected a i32 value, found \"1.5\""), "{e}");
        let e = parse_err(&GOOD.replace(
            "Neg(%0) : f32[2]",
            "Const[dtype: f32, shape: [3], values: [1.0, 2.0]]()",
        ));
        assert!(e.contains("2 values cannot fill"), "{e}");
        let e = parse_err(&GOOD.replace("Neg(%0) : f32[2]", "Neg(%0) : f32[2]  @ \"a.rs:1:1"));
        assert!(e.contains("unterminated string"), "{e}");
        let e = parse_err(&GOOD.replace("Neg(%0) : f32[2]", "Neg(%0) : f32[2] trailing"));
        assert!(e.contains("found \"trailing\""), "{e}");
    }

    #[test]
    fn rejects_truncated_text() {
        for end in 0..GOOD.len() - 2 {
            let text = &GOOD[..end];
            assert!(parse(text).is_err(), "{text:?} parsed");
        }
    }

    #[test]
    fn rejects_references_to_multi_output_nodes_without_an_index() {
        branch("text_then_idx", &ops::NEG, &ops::SUM).register();
        let text = "@g(%0: bool[], %1: f32[2,3]) {\n\
                    \x20 %2 = If[then_branch: @text_then_idx, else_branch: @text_then_idx](%0, %1)\n\
                    \x20 return (%2)\n}";
        let e = parse_err(text);
        assert!(e.contains("%2 has 2 outputs: name one as %2#j"), "{e}");
        let e = parse_err(&text.replace("@text_then_idx,", "@no_such_function_anywhere,"));
        assert!(
            e.contains("no function named @no_such_function_anywhere"),
            "{e}"
        );
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        for text in [
            "\u{0}\u{1}\u{ff}\u{fffd}",
            "@",
            "@f(",
            "@f(%0: f32[18446744073709551615, 18446744073709551615]) {",
            "@f(%0: f32[99999999999999999999999]) {",
            "@f() {\n %1 = Const[dtype: f32, value: 1.0, shape: [1]]()\n return (%1#999999999999)\n}",
            "@f() {\n %1 = Const[dtype: f32, values: [1.0]](\n}",
            "@f() {\n %1 = Const[dtype: f32]()\n return ()\n}",
            "@\"\\u{110000}\"() {\n return ()\n}",
            "@\"\\u{d800}\"() {\n return ()\n}",
            "@\"\\u{",
            "@f() {\n %1 = Print[label: \"é\\\",\n}",
            "}}}}",
            "%%%%",
            "@f() -> ( {",
        ] {
            assert!(parse(text).is_err(), "{text:?} parsed");
        }
    }

    #[test]
    fn extreme_attributes_are_errors() {
        // Shape rules that overflow on these must not take the parser down.
        for op in [
            "Pad[pads: [9223372036854775807, 9223372036854775807]](%0)",
            "Reshape[shape: [-1, -1]](%0)",
            "Reshape[shape: [4294967296, 4294967296, 4294967296]](%0)",
            "BroadcastTo[shape: [18446744073709551615]](%0)",
            "Fill[shape: [9223372036854775807, 3], value: 1.0:f32]()",
            "Arange[stop: 1e300]()",
            "Transpose[perm: [-9223372036854775808]](%0)",
            "Slice[starts: [-9223372036854775808], ends: [9223372036854775807], steps: [-9223372036854775808]](%0)",
            "Sum[axes: [-9223372036854775808]](%0)",
            "OneHot[depth: 9223372036854775807](%0)",
        ] {
            let text = format!("@f(%0: f32[2]) {{\n  %1 = {op}\n  return (%1)\n}}");
            assert!(parse(&text).is_err(), "{text}");
        }
    }

    /// One step of a random elementwise chain: an op applied to earlier
    /// values (indices are reduced modulo the values available).
    #[derive(Clone, Debug)]
    enum Step {
        Unary(usize, usize),
        Binary(usize, usize, usize),
        Const(f32, bool),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0..6usize, any::<usize>()).prop_map(|(op, a)| Step::Unary(op, a)),
            (0..5usize, any::<usize>(), any::<usize>())
                .prop_map(|(op, a, b)| Step::Binary(op, a, b)),
            (any::<f32>(), any::<bool>()).prop_map(|(v, dense)| Step::Const(v, dense)),
        ]
    }

    proptest! {
        #[test]
        fn random_elementwise_chains_round_trip(
            params in 1usize..4,
            steps in proptest::collection::vec(step(), 0..12),
            devices in proptest::collection::vec(proptest::option::of("[a-z:0-9\"\\\\ ]{0,6}"), 12),
            results in proptest::collection::vec(any::<usize>(), 0..4),
        ) {
            const UNARY: [&OpDef; 6] = [&ops::NEG, &ops::EXP, &ops::TANH, &ops::ABS, &ops::SIGMOID, &ops::RELU];
            const BINARY: [&OpDef; 5] = [&ops::ADD, &ops::SUB, &ops::MUL, &ops::MAXIMUM, &ops::MINIMUM];
            let shapes: [&[usize]; 3] = [&[2, 3], &[3], &[]];
            let params: Vec<TensorMetadata> =
                (0..params).map(|i| meta(DType::F32, shapes[i % 3])).collect();
            let mut f = Function::new("chain", params);
            let mut values: Vec<Value> = (0..f.params.len() as u32).map(Value::Param).collect();
            for (i, s) in steps.iter().enumerate() {
                let none = OpAttrs::new();
                let l = Location::new("chain.rs", i as u32 + 1, 3);
                let node = match *s {
                    Step::Unary(op, a) => f.add_op(UNARY[op], &none, &[values[a % values.len()]], l).unwrap(),
                    Step::Binary(op, a, b) => {
                        let (a, b) = (values[a % values.len()], values[b % values.len()]);
                        f.add_op(BINARY[op], &none, &[a, b], l).unwrap()
                    }
                    Step::Const(v, false) => f.add_const(ScalarHostTensor::new(Scalar::F32(v), []).into(), l),
                    Step::Const(v, true) => f.add_const(
                        DenseHostTensor::from_slice(&[v, -v, v * 0.5], [3]).unwrap().into(),
                        l,
                    ),
                };
                f.nodes[node].device = devices[i].clone();
                values.push(Value::node(node));
            }
            f.results = results.iter().map(|r| values[r % values.len()]).collect();
            let printed = print(&f);
            let parsed = parse(&printed).map_err(|e| TestCaseError::fail(format!("{e}\n{printed}")))?;
            prop_assert_eq!(print(&parsed), printed);
            prop_assert!(crate::verify(&parsed).is_ok());
        }

        #[test]
        fn mutated_text_never_panics(
            cut in any::<usize>(),
            len in 0usize..8,
            insert in "[ -~]{0,6}|\\PC{0,3}",
        ) {
            let text = print_sample();
            let mut at = cut % (text.len() + 1);
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            let mut end = (at + len).min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let mutated = format!("{}{}{}", &text[..at], insert, &text[end..]);
            let _ = parse(&mutated);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse(&String::from_utf8_lossy(&bytes));
            let _ = parse(&format!("@f(%0: f32[2]) {{\n{}", String::from_utf8_lossy(&bytes)));
        }
    }

    /// A printed function using most of the syntax.
    fn print_sample() -> String {
        let mut f = Function::new(
            "sample",
            vec![meta(DType::F32, &[2, 3]), meta(DType::F32, &[3])],
        );
        let c = f.add_const(
            DenseHostTensor::from_slice(&[1.5f32, -2.0, 0.25], [3])
                .unwrap()
                .into(),
            loc(1),
        );
        let a = f
            .add_op(
                &ops::ADD,
                &OpAttrs::new(),
                &[Value::Param(0), Value::node(c)],
                loc(2),
            )
            .unwrap();
        let mut reduce = OpAttrs::new();
        reduce.set_ints("axes", &[0, 1]).set_bool("keepdim", true);
        let s = f
            .add_op(&ops::SUM, &reduce, &[Value::node(a)], loc(3))
            .unwrap();
        let mut pad = OpAttrs::new();
        pad.set_ints("pads", &[1, 1]).set_float("value", -0.5);
        let p = f
            .add_op(&ops::PAD, &pad, &[Value::Param(1)], loc(4))
            .unwrap();
        f.nodes[p].device = Some("cpu:0".into());
        f.results = vec![Value::node(s), Value::node(p)];
        print(&f)
    }
}
