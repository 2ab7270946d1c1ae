//! A [`Function`] as SVG pictures a person can read at a browser's zoom:
//! what `stagecraft trace` writes.
//!
//! Each op is one card: its value and op, what it reads (constants shown
//! by value rather than as boxes of their own), its attributes, its
//! output and the user's source line. A fused op is one card that names
//! the ops it fuses and spells out its program as an expression
//! (`relu(%33@%5ᵀ + %6)`), never as the integer attribute the kernel
//! reads. Cards sit in rows by dependency depth; rows too wide for a page
//! wrap, and a chain too long for a page's height continues in the next
//! column, then on the next page, so no page exceeds [`Limits`]. Arrows
//! join cards within a column; an input from another column or page is
//! found by its `%` name, which is the one the text form prints.

use crate::{Function, Node, NodeOp, Value};
use stagecraft_ops::{
    decode_fused, fused_reduce_op, AttrValue, BinaryOp, CompareOp, FusedInstr, UnaryOp,
};
use stagecraft_tensor::HostTensor;
use std::fmt::Write as _;

/// The largest picture [`pages`] draws; a function that does not fit
/// continues on further pages.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Page width in pixels.
    pub width: f64,
    /// Page height in pixels.
    pub height: f64,
}

impl Default for Limits {
    /// 2000 × 4000 px: a training step's column is read at 100 % zoom by
    /// scrolling down, a page at a time.
    fn default() -> Limits {
        Limits {
            width: 2000.0,
            height: 4000.0,
        }
    }
}

const FONT_PX: f64 = 12.0;
/// The advance of one monospace character at [`FONT_PX`] (0.6 em, with a
/// little to spare for fonts a browser substitutes).
const CHAR_PX: f64 = 7.4;
const LINE_PX: f64 = 16.0;
const CARD_W: f64 = 270.0;
const PAD: f64 = 8.0;
/// Characters a card line holds.
const CARD_CHARS: usize = ((CARD_W - 2.0 * PAD) / CHAR_PX) as usize;
/// A card shows at most this many lines; the rest is in the text form.
const MAX_CARD_LINES: usize = 12;
const GAP_X: f64 = 30.0;
const GAP_Y: f64 = 36.0;
const COLUMN_GAP: f64 = 70.0;
const MARGIN: f64 = 20.0;

/// The pages picturing `f` within `limits`, each a whole SVG document.
pub fn pages(f: &Function, limits: Limits) -> Vec<String> {
    let layout = Layout::new(f, limits);
    (0..layout.page_sizes.len())
        .map(|page| layout.draw(f, page))
        .collect()
}

/// One line of a card or header.
#[derive(Clone, Debug)]
struct Line {
    text: String,
    style: Style,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Style {
    Title,
    Plain,
    Dim,
}

/// One op's card, placed.
#[derive(Clone, Debug)]
struct Card {
    node: usize,
    lines: Vec<Line>,
    fill: &'static str,
    page: usize,
    column: usize,
    x: f64,
    y: f64,
}

impl Card {
    fn height(&self) -> f64 {
        card_height(self.lines.len())
    }
}

fn card_height(lines: usize) -> f64 {
    lines as f64 * LINE_PX + 2.0 * PAD
}

/// Where every card goes.
struct Layout {
    cards: Vec<Card>,
    /// The card of each node (`None` for constants, which have none).
    card_of: Vec<Option<usize>>,
    header: Vec<Line>,
    page_sizes: Vec<(f64, f64)>,
}

impl Layout {
    fn new(f: &Function, limits: Limits) -> Layout {
        let header_chars = ((limits.width - 2.0 * MARGIN) / CHAR_PX).max(20.0) as usize;
        let header = header_lines(f, header_chars);
        let top = MARGIN + header.len() as f64 * LINE_PX + GAP_Y;
        let usable_h = (limits.height - top - MARGIN).max(card_height(MAX_CARD_LINES));
        let per_row = (((limits.width - 2.0 * MARGIN + GAP_X) / (CARD_W + GAP_X)) as usize).max(1);

        // Depth: one more than the deepest op read (constants and
        // parameters are depth 0 and have no card).
        let mut depth = vec![0usize; f.nodes.len()];
        let mut card_of = vec![None; f.nodes.len()];
        let mut cards = Vec::new();
        for (i, node) in f.nodes.iter().enumerate() {
            if matches!(node.op, NodeOp::Const(_)) {
                continue;
            }
            depth[i] = producers(f, node).map(|p| depth[p] + 1).max().unwrap_or(0);
            card_of[i] = Some(cards.len());
            cards.push(Card {
                node: i,
                lines: card_lines(f, i),
                fill: fill(node),
                page: 0,
                column: 0,
                x: 0.0,
                y: 0.0,
            });
        }
        // An op that reads only arguments and constants (an optimizer's
        // `v * 0.9`) sits right above its first reader, not in the top
        // row with an arrow across the page.
        let mut first_reader = vec![usize::MAX; f.nodes.len()];
        for (i, node) in f.nodes.iter().enumerate() {
            for p in producers(f, node) {
                first_reader[p] = first_reader[p].min(depth[i]);
            }
        }
        for card in &cards {
            let node = &f.nodes[card.node];
            if producers(f, node).next().is_none() && first_reader[card.node] != usize::MAX {
                depth[card.node] = first_reader[card.node].saturating_sub(1);
            }
        }
        let deepest = cards.iter().map(|c| depth[c.node]).max().unwrap_or(0);
        let mut by_depth: Vec<Vec<usize>> = vec![Vec::new(); deepest + 1];
        for (c, card) in cards.iter().enumerate() {
            by_depth[depth[card.node]].push(c);
        }

        // Rows: each depth in order, its cards sorted under the cards they
        // read (the mean slot of their producers), wrapped at `per_row`.
        let mut slot = vec![0.5f64; cards.len()];
        let mut rows: Vec<Vec<usize>> = Vec::new();
        for mut level in by_depth {
            let key = |c: usize| {
                let node = &f.nodes[cards[c].node];
                let slots: Vec<f64> = producers(f, node)
                    .filter_map(|p| card_of[p].map(|pc| slot[pc]))
                    .collect();
                if slots.is_empty() {
                    0.5
                } else {
                    slots.iter().sum::<f64>() / slots.len() as f64
                }
            };
            let mut keyed: Vec<(f64, usize)> = level.iter().map(|&c| (key(c), c)).collect();
            keyed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            level = keyed.into_iter().map(|(_, c)| c).collect();
            for row in level.chunks(per_row) {
                for (i, &c) in row.iter().enumerate() {
                    slot[c] = (i as f64 + 0.5) / row.len() as f64;
                }
                rows.push(row.to_vec());
            }
        }

        // Columns: rows top to bottom until the page height is used.
        let mut columns: Vec<Vec<usize>> = Vec::new();
        let mut used = f64::INFINITY;
        for (r, row) in rows.iter().enumerate() {
            let h = row_height(&cards, row);
            if used + h > usable_h {
                columns.push(Vec::new());
                used = 0.0;
            }
            columns.last_mut().expect("a column was opened").push(r);
            used += h + GAP_Y;
        }

        // Pages: columns left to right until the page width is used.
        let column_w = |col: &[usize]| {
            let widest = col.iter().map(|&r| rows[r].len()).max().unwrap_or(1) as f64;
            widest * CARD_W + (widest - 1.0) * GAP_X
        };
        let mut page_sizes: Vec<(f64, f64)> = Vec::new();
        let mut x = f64::INFINITY;
        let mut page = 0;
        for (k, col) in columns.iter().enumerate() {
            let w = column_w(col);
            if x + w + MARGIN > limits.width {
                page_sizes.push((0.0, 0.0));
                page = page_sizes.len() - 1;
                x = MARGIN;
            }
            let mut y = top;
            for &r in col {
                let row = &rows[r];
                let row_w = row.len() as f64 * CARD_W + (row.len() as f64 - 1.0) * GAP_X;
                let mut cx = x + (w - row_w) / 2.0;
                for &c in row {
                    let card = &mut cards[c];
                    card.page = page;
                    card.column = k;
                    card.x = cx;
                    card.y = y;
                    cx += CARD_W + GAP_X;
                }
                y += row_height(&cards, row) + GAP_Y;
            }
            let size = &mut page_sizes[page];
            size.0 = size.0.max(x + w + MARGIN);
            size.1 = size.1.max(y - GAP_Y + MARGIN);
            x += w + COLUMN_GAP;
        }
        if page_sizes.is_empty() {
            page_sizes.push((0.0, 0.0));
        }
        let header_w = header
            .iter()
            .map(|l| l.text.chars().count() as f64 * CHAR_PX)
            .fold(0.0, f64::max)
            + 2.0 * MARGIN;
        for size in &mut page_sizes {
            size.0 = size.0.max(header_w).min(limits.width).ceil();
            size.1 = size.1.max(top + MARGIN).min(limits.height).ceil();
        }
        Layout {
            cards,
            card_of,
            header,
            page_sizes,
        }
    }

    fn draw(&self, f: &Function, page: usize) -> String {
        let (w, h) = self.page_sizes[page];
        let mut out = String::new();
        let _ = writeln!(
            out,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
             viewBox=\"0 0 {w} {h}\" font-family=\"DejaVu Sans Mono, Menlo, Consolas, monospace\" \
             font-size=\"{FONT_PX}\">"
        );
        out.push_str(
            "<defs><marker id=\"arrow\" markerWidth=\"8\" markerHeight=\"8\" refX=\"7\" refY=\"4\" \
             orient=\"auto\"><path d=\"M0,0 L8,4 L0,8 z\" fill=\"#555\"/></marker></defs>\n",
        );
        let _ = writeln!(out, "<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>");
        let mut title = self.header.clone();
        if self.page_sizes.len() > 1 {
            title[0].text = format!(
                "{} (page {} of {})",
                title[0].text,
                page + 1,
                self.page_sizes.len()
            );
        }
        let shown = if page == 0 { &title[..] } else { &title[..1] };
        for (i, line) in shown.iter().enumerate() {
            text(&mut out, MARGIN, MARGIN + (i as f64 + 0.8) * LINE_PX, line);
        }
        for card in self.cards.iter().filter(|c| c.page == page) {
            for p in producers(f, &f.nodes[card.node]) {
                let Some(from) = self.card_of[p].map(|c| &self.cards[c]) else {
                    continue;
                };
                if from.page != page || from.column != card.column {
                    continue;
                }
                let (x0, y0) = (from.x + CARD_W / 2.0, from.y + from.height());
                let (x1, y1) = (card.x + CARD_W / 2.0, card.y - 2.0);
                let near = y1 - y0 < GAP_Y + 4.0;
                let (stroke, width) = if near {
                    ("#555", 1.2)
                } else {
                    ("#b8b8b8", 0.9)
                };
                let bend = ((y1 - y0) / 2.0).max(GAP_Y / 2.0);
                let _ = writeln!(
                    out,
                    "<path d=\"M{x0:.1},{y0:.1} C{x0:.1},{:.1} {x1:.1},{:.1} {x1:.1},{y1:.1}\" \
                     fill=\"none\" stroke=\"{stroke}\" stroke-width=\"{width}\" marker-end=\"url(#arrow)\"/>",
                    y0 + bend,
                    y1 - bend
                );
            }
        }
        for card in self.cards.iter().filter(|c| c.page == page) {
            let _ = writeln!(
                out,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{CARD_W}\" height=\"{:.1}\" rx=\"5\" \
                 fill=\"{}\" stroke=\"#444\" stroke-width=\"1\"/>",
                card.x,
                card.y,
                card.height(),
                card.fill
            );
            for (i, line) in card.lines.iter().enumerate() {
                let y = card.y + PAD + (i as f64 + 0.78) * LINE_PX;
                text(&mut out, card.x + PAD, y, line);
            }
        }
        out.push_str("</svg>\n");
        out
    }
}

fn row_height(cards: &[Card], row: &[usize]) -> f64 {
    row.iter().map(|&c| cards[c].height()).fold(0.0, f64::max)
}

fn text(out: &mut String, x: f64, y: f64, line: &Line) {
    let style = match line.style {
        Style::Title => " font-weight=\"bold\"",
        Style::Plain => "",
        Style::Dim => " fill=\"#666\"",
    };
    let _ = writeln!(
        out,
        "<text x=\"{x:.1}\" y=\"{y:.1}\"{style} xml:space=\"preserve\">{}</text>",
        xml_escape(&line.text)
    );
}

fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            // Characters XML 1.0 does not allow.
            c if (c as u32) < 0x20 && c != '\t' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// The ops (not constants) a node reads, by node index.
fn producers<'a>(f: &'a Function, node: &'a Node) -> impl Iterator<Item = usize> + 'a {
    node.inputs.iter().filter_map(move |v| match v {
        Value::Output { node, .. } => f
            .nodes
            .get(*node as usize)
            .filter(|n| !matches!(n.op, NodeOp::Const(_)))
            .map(|_| *node as usize),
        Value::Param(_) => None,
    })
}

fn fill(node: &Node) -> &'static str {
    match node.op.name() {
        name if name.starts_with("Fused") => "#e4efff",
        name if name.ends_with("Grad") || name.contains("Backprop") => "#fff0e8",
        _ => "#ffffff",
    }
}

/// The function's name, arguments and results, wrapped at `chars`.
fn header_lines(f: &Function, chars: usize) -> Vec<Line> {
    let mut lines = vec![Line {
        text: format!("@{}: {} ops", f.name, f.nodes.len()),
        style: Style::Title,
    }];
    let args: Vec<String> = f
        .params
        .iter()
        .enumerate()
        .map(|(i, m)| format!("%{i} {m}"))
        .collect();
    let results: Vec<String> = f.results.iter().map(|v| value_name(f, *v)).collect();
    for (label, items) in [("arguments", args), ("returns", results)] {
        let listed = format!("{label} ({}): {}", items.len(), items.join(", "));
        lines.extend(wrap(&listed, chars).into_iter().map(|text| Line {
            text,
            style: Style::Dim,
        }));
    }
    lines
}

/// The `%` name the text form prints for a value.
fn value_name(f: &Function, v: Value) -> String {
    match v {
        Value::Param(i) => format!("%{i}"),
        Value::Output { node, output } => {
            let id = f.params.len() + node as usize;
            let single = f
                .nodes
                .get(node as usize)
                .is_some_and(|n| n.outputs.len() == 1);
            if single {
                format!("%{id}")
            } else {
                format!("%{id}#{output}")
            }
        }
    }
}

/// How an op's card names an input: a constant by its value, anything
/// else by its `%` name.
fn operand(f: &Function, v: Value) -> String {
    if let Value::Output { node, .. } = v {
        if let Some(NodeOp::Const(t)) = f.nodes.get(node as usize).map(|n| &n.op) {
            return const_text(t);
        }
    }
    value_name(f, v)
}

fn const_text(t: &HostTensor) -> String {
    match t {
        HostTensor::Scalar(s) if s.metadata().shape.rank() == 0 => s.value().to_string(),
        HostTensor::Scalar(s) => format!("{}×{}", s.value(), s.metadata()),
        HostTensor::List(list) => format!("list({})", list.len()),
        HostTensor::Dense(d) => {
            let shown: Vec<String> = (0..d.numel().min(3))
                .map(|i| d.get_scalar(i).map_or("?".into(), |v| v.to_string()))
                .collect();
            let more = if d.numel() > 3 { ", …" } else { "" };
            format!("[{}{more}]", shown.join(", "))
        }
    }
}

/// The lines of node `i`'s card.
fn card_lines(f: &Function, i: usize) -> Vec<Line> {
    let node = &f.nodes[i];
    let mut lines = vec![Line {
        text: format!("%{} = {}", f.params.len() + i, node.op.name()),
        style: Style::Title,
    }];
    let mut body = Vec::new();
    let operands: Vec<String> = node.inputs.iter().map(|v| operand(f, *v)).collect();
    match fused_text(node, &operands) {
        Some((members, expr)) => {
            body.push(format!("fuses {members}"));
            body.push(format!("= {expr}"));
        }
        None => {
            body.push(format!("({})", operands.join(", ")));
            if let NodeOp::Op(_, attrs) = &node.op {
                let listed: Vec<String> = attrs
                    .iter()
                    .map(|(name, value)| match value {
                        AttrValue::Func(id) => {
                            format!("{name}: @{}", stagecraft_ops::func::function_name(id))
                        }
                        other => format!("{name}: {other}"),
                    })
                    .collect();
                if !listed.is_empty() {
                    body.push(listed.join(", "));
                }
            }
        }
    }
    let outputs: Vec<String> = node.outputs.iter().map(|m| m.to_string()).collect();
    body.push(match outputs.len() {
        1 => format!("→ {}", outputs[0]),
        _ => format!("→ ({})", outputs.join(", ")),
    });
    if let Some(device) = &node.device {
        body.push(format!("on {device}"));
    }
    for text in body {
        lines.extend(wrap(&text, CARD_CHARS).into_iter().map(|text| Line {
            text,
            style: Style::Plain,
        }));
    }
    // The file and its folder: `optim/mod.rs`, not a bare `mod.rs`.
    let path = node.location.file();
    let file = match path.rmatch_indices(['/', '\\']).nth(1) {
        Some((at, _)) => &path[at + 1..],
        None => path,
    };
    lines.push(Line {
        text: format!("{file}:{}", node.location.line()),
        style: Style::Dim,
    });
    if lines.len() > MAX_CARD_LINES {
        let location = lines.pop().expect("lines were pushed");
        lines.truncate(MAX_CARD_LINES - 2);
        lines.push(Line {
            text: "… (see the text form)".into(),
            style: Style::Dim,
        });
        lines.push(location);
    }
    lines
}

/// For a fused op: the ops it fuses, and its program as an expression
/// over its operands' names.
fn fused_text(node: &Node, operands: &[String]) -> Option<(String, String)> {
    let NodeOp::Op(def, attrs) = &node.op else {
        return None;
    };
    let program = match attrs.get("program") {
        Some(AttrValue::Ints(p)) => p,
        _ => return None,
    };
    let flag = |name: &str| matches!(attrs.get(name), Some(AttrValue::Bool(true)));
    let mut registers: Vec<Expr> = Vec::new();
    let mut members = Vec::new();
    let mut rest = operands;
    if def.name == "FusedMatMul" {
        let [a, b, tail @ ..] = operands else {
            return None;
        };
        let t = |on: bool| if on { "ᵀ" } else { "" };
        registers.push(Expr {
            text: format!(
                "{a}{}@{b}{}",
                t(flag("transpose_a")),
                t(flag("transpose_b"))
            ),
            precedence: MUL,
        });
        members.push("MatMul".to_string());
        rest = tail;
    }
    registers.extend(rest.iter().map(|o| Expr {
        text: o.clone(),
        precedence: ATOM,
    }));
    let instrs = decode_fused(program, registers.len()).ok()?;
    for instr in instrs {
        let (name, expr) = match instr {
            FusedInstr::Unary(op, a) => (op.def().name, unary(op, &registers[a])),
            FusedInstr::Binary(op, a, b) => {
                (op.def().name, binary(op, &registers[a], &registers[b]))
            }
            FusedInstr::Compare(op, a, b) => {
                (compare_name(op), compare(op, &registers[a], &registers[b]))
            }
        };
        members.push(name.to_string());
        registers.push(expr);
    }
    let mut expr = registers.pop()?.text;
    if def.name == "FusedReduce" {
        let reduce = match attrs.get("reduce") {
            Some(AttrValue::Int(code)) => fused_reduce_op(code).ok()?,
            _ => return None,
        };
        let axes = match attrs.get("axes") {
            Some(AttrValue::Ints(axes)) => format!("{axes:?}"),
            _ => "all".into(),
        };
        let name = format!("{reduce:?}");
        members.push(name.clone());
        expr = format!("{} over {axes} of {expr}", name.to_lowercase());
    }
    members.dedup();
    Some((members.join(", "), expr))
}

const ADD: u8 = 1;
const MUL: u8 = 2;
const ATOM: u8 = 3;

/// A register of a fused program written out, with how tightly it binds.
struct Expr {
    text: String,
    precedence: u8,
}

fn unary(op: UnaryOp, x: &Expr) -> Expr {
    let text = match op {
        UnaryOp::Neg if x.precedence == ATOM => format!("-{}", x.text),
        UnaryOp::Neg => format!("-({})", x.text),
        other => format!("{}({})", other.def().name.to_lowercase(), x.text),
    };
    Expr {
        text,
        precedence: ATOM,
    }
}

fn binary(op: BinaryOp, a: &Expr, b: &Expr) -> Expr {
    let infix = |symbol: &str, precedence: u8| {
        // a - (b - c) and a / (b * c) keep their parentheses; a + (b + c)
        // and a * (b * c) need none.
        let associative = matches!(op, BinaryOp::Add | BinaryOp::Mul);
        let left = paren(a, a.precedence < precedence);
        let right = paren(
            b,
            b.precedence < precedence || (b.precedence == precedence && !associative),
        );
        Expr {
            text: format!("{left}{symbol}{right}"),
            precedence,
        }
    };
    match op {
        BinaryOp::Add => infix(" + ", ADD),
        BinaryOp::Sub => infix(" - ", ADD),
        BinaryOp::Mul => infix("*", MUL),
        BinaryOp::Div => infix("/", MUL),
        other => Expr {
            text: format!(
                "{}({}, {})",
                other.def().name.to_lowercase(),
                a.text,
                b.text
            ),
            precedence: ATOM,
        },
    }
}

fn paren(e: &Expr, needed: bool) -> String {
    if needed {
        format!("({})", e.text)
    } else {
        e.text.clone()
    }
}

fn compare_symbol(op: CompareOp) -> &'static str {
    match op {
        CompareOp::Eq => "==",
        CompareOp::Ne => "!=",
        CompareOp::Lt => "<",
        CompareOp::Le => "<=",
        CompareOp::Gt => ">",
        CompareOp::Ge => ">=",
    }
}

fn compare_name(op: CompareOp) -> &'static str {
    match op {
        CompareOp::Eq => "Equal",
        CompareOp::Ne => "NotEqual",
        CompareOp::Lt => "Less",
        CompareOp::Le => "LessEqual",
        CompareOp::Gt => "Greater",
        CompareOp::Ge => "GreaterEqual",
    }
}

/// A comparison as 1 or 0, written as an Iverson bracket.
fn compare(op: CompareOp, a: &Expr, b: &Expr) -> Expr {
    Expr {
        text: format!("[{} {} {}]", a.text, compare_symbol(op), b.text),
        precedence: ATOM,
    }
}

/// `text` broken into lines of at most `width` characters, at spaces
/// where it can be (a longer word is cut).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let width = width.max(8);
    let mut lines = Vec::new();
    let mut line: Vec<char> = Vec::new();
    for word in text.split(' ') {
        let word: Vec<char> = word.chars().collect();
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(line.drain(..).collect());
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.extend(word);
        while line.len() > width {
            let rest = line.split_off(width);
            lines.push(line.iter().collect());
            line = rest;
        }
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line.into_iter().collect());
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_ops::{self as ops, OpAttrs, FUSED_BINARY, FUSED_BINARY_BASE, FUSED_UNARY};
    use stagecraft_tensor::{DType, Location, Scalar, ScalarHostTensor, TensorMetadata};

    fn loc() -> Location {
        Location::new("crates/app/src/model.rs", 7, 1)
    }

    fn unary_code(op: UnaryOp) -> i64 {
        FUSED_UNARY.iter().position(|u| *u == op).unwrap() as i64
    }

    fn binary_code(op: BinaryOp) -> i64 {
        FUSED_BINARY_BASE + FUSED_BINARY.iter().position(|b| *b == op).unwrap() as i64
    }

    /// The `width` and `height` of an SVG document.
    fn size(svg: &str) -> (f64, f64) {
        let attr = |name: &str| -> f64 {
            let start = svg.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
            svg[start..][..svg[start..].find('"').unwrap()]
                .parse()
                .unwrap()
        };
        (attr("width"), attr("height"))
    }

    /// `n` ops in one chain, each also reading parameter 0.
    fn chain(n: usize) -> Function {
        let meta = TensorMetadata::new(DType::F32, [64, 128]);
        let mut f = Function::new("chain", vec![meta.clone(), meta]);
        let mut x = Value::Param(1);
        for _ in 0..n {
            let node = f
                .add_op(&ops::ADD, &OpAttrs::new(), &[x, Value::Param(0)], loc())
                .unwrap();
            x = Value::node(node);
        }
        f.results = vec![x];
        f
    }

    #[test]
    fn a_long_chain_wraps_into_columns_and_pages_within_the_limits() {
        let f = chain(400);
        let limits = Limits::default();
        let pages = pages(&f, limits);
        assert!(pages.len() > 1, "400 cards need more than one page");
        let mut titles = 0;
        for page in &pages {
            let (w, h) = size(page);
            assert!(w <= limits.width && h <= limits.height, "{w} × {h}");
            titles += page.matches(" = Add</text>").count();
        }
        assert_eq!(titles, 400, "every op drawn once");
        for i in [2, 200, 401] {
            let title = format!(">%{i} = Add<");
            assert_eq!(
                pages.iter().filter(|p| p.contains(&title)).count(),
                1,
                "{title}"
            );
        }
        // A chain's arrows: one per op but the first, less the breaks
        // between columns and pages.
        let arrows: usize = pages.iter().map(|p| p.matches("<path d=").count()).sum();
        assert!(arrows > 350 && arrows < 400, "{arrows}");
    }

    #[test]
    fn a_wide_level_wraps_into_rows_and_cards_never_overlap() {
        let meta = TensorMetadata::new(DType::F32, [8]);
        let mut f = Function::new("wide", vec![meta]);
        let two = f.add_const(ScalarHostTensor::new(Scalar::F32(2.0), []).into(), loc());
        let mut outs = Vec::new();
        for _ in 0..40 {
            let n = f
                .add_op(
                    &ops::MUL,
                    &OpAttrs::new(),
                    &[Value::Param(0), Value::node(two)],
                    loc(),
                )
                .unwrap();
            outs.push(Value::node(n));
        }
        f.results = outs;
        let limits = Limits {
            width: 1200.0,
            height: 3000.0,
        };
        let layout = Layout::new(&f, limits);
        assert_eq!(
            layout.cards.len(),
            40,
            "the constant has no card of its own"
        );
        for (i, a) in layout.cards.iter().enumerate() {
            let (w, h) = layout.page_sizes[a.page];
            assert!(a.x >= 0.0 && a.x + CARD_W <= w && a.y + a.height() <= h);
            for b in &layout.cards[i + 1..] {
                let apart = a.page != b.page
                    || a.x + CARD_W <= b.x
                    || b.x + CARD_W <= a.x
                    || a.y + a.height() <= b.y
                    || b.y + b.height() <= a.y;
                assert!(apart, "cards of %{} and %{} overlap", a.node, b.node);
            }
        }
        let svg = pages(&f, limits).concat();
        assert!(svg.contains(">(%0, 2.0)<"), "constants are shown by value");
    }

    #[test]
    fn fused_programs_read_as_expressions() {
        let meta = TensorMetadata::new(DType::F32, [4, 4]);
        let mut f = Function::new("fused", vec![meta.clone(), meta.clone(), meta]);
        let half = f.add_const(ScalarHostTensor::new(Scalar::F32(0.5), []).into(), loc());
        // relu(%0*0.5 + %1), then %2 - (%0 - %1) / %0, then [%0 > %1]*%2.
        let program = [
            binary_code(BinaryOp::Mul),
            0,
            3,
            binary_code(BinaryOp::Add),
            4,
            1,
            unary_code(UnaryOp::Relu),
            5,
            0,
        ];
        let mut attrs = OpAttrs::new();
        attrs.set_ints("program", &program);
        let inputs = [
            Value::Param(0),
            Value::Param(1),
            Value::Param(2),
            Value::node(half),
        ];
        f.add_op(&ops::FUSED_ELEMENTWISE, &attrs, &inputs, loc())
            .unwrap();
        let program = [
            binary_code(BinaryOp::Sub),
            0,
            1,
            binary_code(BinaryOp::Div),
            3,
            0,
            binary_code(BinaryOp::Sub),
            2,
            4,
        ];
        attrs.set_ints("program", &program);
        f.add_op(&ops::FUSED_ELEMENTWISE, &attrs, &inputs[..3], loc())
            .unwrap();
        let greater = stagecraft_ops::FUSED_COMPARE_BASE + 4;
        attrs.set_ints(
            "program",
            &[greater, 0, 1, binary_code(BinaryOp::Mul), 3, 2],
        );
        f.add_op(&ops::FUSED_ELEMENTWISE, &attrs, &inputs[..3], loc())
            .unwrap();
        let mut mm = OpAttrs::new();
        mm.set_bool("transpose_b", true);
        mm.set_ints("program", &[binary_code(BinaryOp::Add), 0, 1]);
        f.add_op(&ops::FUSED_MATMUL, &mm, &inputs[..3], loc())
            .unwrap();
        let svg = pages(&f, Limits::default()).concat();
        for expected in [
            "fuses Mul, Add, Relu",
            "= relu(%0*0.5 + %1)",
            "= %2 - (%0 - %1)/%0",
            "fuses Greater, Mul",
            "= [%0 &gt; %1]*%2",
            "fuses MatMul, Add",
            "= %0@%1ᵀ + %2",
            ">src/model.rs:7<",
        ] {
            assert!(svg.contains(expected), "{expected} missing:\n{svg}");
        }
        assert!(!svg.contains("program:"), "the raw attribute is not shown");
    }

    #[test]
    fn text_is_escaped_and_wrapped() {
        let mut f = Function::new("a<b & \"c\"", vec![TensorMetadata::new(DType::F32, [2])]);
        let mut attrs = OpAttrs::new();
        attrs.set_str(
            "label",
            "x < y && a very long label that goes on and on past a card",
        );
        let n = f
            .add_op(&ops::PRINT, &attrs, &[Value::Param(0)], loc())
            .unwrap();
        f.results = vec![Value::node(n)];
        let svg = pages(&f, Limits::default()).concat();
        assert!(svg.contains("@a&lt;b &amp; &quot;c&quot;"), "{svg}");
        assert!(!svg.contains("x < y"), "{svg}");
        for line in svg
            .lines()
            .filter(|l| l.starts_with("<text") && l.contains("label"))
        {
            let shown = line.split('>').nth(1).unwrap().split('<').next().unwrap();
            let shown = shown
                .replace("&lt;", "<")
                .replace("&amp;", "&")
                .replace("&quot;", "\"");
            assert!(shown.chars().count() <= CARD_CHARS, "{shown}");
        }
        assert_eq!(wrap("ab cd ef gh", 8), vec!["ab cd ef", "gh"]);
        assert_eq!(wrap("abcdefghijk", 8), vec!["abcdefgh", "ijk"]);
        assert_eq!(wrap("", 8), vec![""]);
    }
}
