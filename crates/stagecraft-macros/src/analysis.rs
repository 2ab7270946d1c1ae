//! Syntactic questions the lowering asks about a piece of code: which
//! outer variables it assigns, and whether it leaves its loop (`break`,
//! `continue`) or its function (`return`, `?`).
//!
//! Everything here is syntax only: the types (tensor or host) are left to
//! the trait dispatch in the generated code.

use std::collections::HashSet;
use syn::visit::{self, Visit};
use syn::{Block, Expr, Ident, Pat};

/// Identifiers a pattern binds.
pub fn pattern_idents(pat: &Pat, out: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(p) => {
            out.push(p.ident.clone());
            if let Some((_, sub)) = &p.subpat {
                pattern_idents(sub, out);
            }
        }
        Pat::Tuple(t) => t.elems.iter().for_each(|p| pattern_idents(p, out)),
        Pat::TupleStruct(t) => t.elems.iter().for_each(|p| pattern_idents(p, out)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| pattern_idents(&f.pat, out)),
        Pat::Slice(s) => s.elems.iter().for_each(|p| pattern_idents(p, out)),
        Pat::Reference(r) => pattern_idents(&r.pat, out),
        Pat::Type(t) => pattern_idents(&t.pat, out),
        Pat::Or(o) => {
            if let Some(first) = o.cases.first() {
                pattern_idents(first, out)
            }
        }
        Pat::Paren(p) => pattern_idents(&p.pat, out),
        _ => {}
    }
}

/// The variable an assignment's left side writes: `x`, `x.f`, `x.0`,
/// `x[i]` all write `x`.
fn assigned_roots(lhs: &Expr, out: &mut Vec<Ident>) {
    match lhs {
        Expr::Path(p) if p.qself.is_none() && p.path.segments.len() == 1 => {
            out.push(p.path.segments[0].ident.clone())
        }
        Expr::Field(f) => assigned_roots(&f.base, out),
        Expr::Index(i) => assigned_roots(&i.expr, out),
        Expr::Paren(p) => assigned_roots(&p.expr, out),
        Expr::Tuple(t) => t.elems.iter().for_each(|e| assigned_roots(e, out)),
        _ => {}
    }
}

/// Collects assignments to variables declared outside the visited code,
/// in first-assignment order.
struct Assigned {
    scopes: Vec<HashSet<String>>,
    found: Vec<Ident>,
}

impl Assigned {
    fn is_local(&self, name: &str) -> bool {
        self.scopes.iter().any(|s| s.contains(name))
    }

    fn declare(&mut self, pat: &Pat) {
        let mut idents = Vec::new();
        pattern_idents(pat, &mut idents);
        if let Some(scope) = self.scopes.last_mut() {
            scope.extend(idents.iter().map(|i| i.to_string()));
        }
    }

    fn record(&mut self, lhs: &Expr) {
        let mut roots = Vec::new();
        assigned_roots(lhs, &mut roots);
        for root in roots {
            let name = root.to_string();
            if !self.is_local(&name) && !self.found.iter().any(|f| *f == name) {
                self.found.push(root);
            }
        }
    }

    fn scoped(&mut self, f: impl FnOnce(&mut Self)) {
        self.scopes.push(HashSet::new());
        f(self);
        self.scopes.pop();
    }
}

impl<'a> Visit<'a> for Assigned {
    fn visit_block(&mut self, b: &'a Block) {
        self.scoped(|s| visit::visit_block(s, b));
    }

    fn visit_local(&mut self, l: &'a syn::Local) {
        // The initializer sees the outer binding; the pattern shadows it
        // from here on.
        if let Some(init) = &l.init {
            self.visit_expr(&init.expr);
            if let Some((_, diverge)) = &init.diverge {
                self.visit_expr(diverge);
            }
        }
        self.declare(&l.pat);
    }

    fn visit_expr_closure(&mut self, c: &'a syn::ExprClosure) {
        self.scoped(|s| {
            c.inputs.iter().for_each(|p| s.declare(p));
            s.visit_expr(&c.body);
        });
    }

    fn visit_expr_for_loop(&mut self, f: &'a syn::ExprForLoop) {
        self.visit_expr(&f.expr);
        self.scoped(|s| {
            s.declare(&f.pat);
            s.visit_block(&f.body);
        });
    }

    fn visit_arm(&mut self, a: &'a syn::Arm) {
        self.scoped(|s| {
            s.declare(&a.pat);
            if let Some((_, guard)) = &a.guard {
                s.visit_expr(guard);
            }
            s.visit_expr(&a.body);
        });
    }

    fn visit_expr_let(&mut self, l: &'a syn::ExprLet) {
        self.visit_expr(&l.expr);
        self.declare(&l.pat);
    }

    fn visit_expr_assign(&mut self, a: &'a syn::ExprAssign) {
        self.record(&a.left);
        self.visit_expr(&a.right);
        // Indices on the left (`x[i] = ..`) are reads.
        if !matches!(&*a.left, Expr::Path(_)) {
            self.visit_expr(&a.left);
        }
    }

    fn visit_expr_binary(&mut self, b: &'a syn::ExprBinary) {
        use syn::BinOp::*;
        if matches!(
            b.op,
            AddAssign(_)
                | SubAssign(_)
                | MulAssign(_)
                | DivAssign(_)
                | RemAssign(_)
                | BitXorAssign(_)
                | BitAndAssign(_)
                | BitOrAssign(_)
                | ShlAssign(_)
                | ShrAssign(_)
        ) {
            self.record(&b.left);
        }
        visit::visit_expr_binary(self, b);
    }

    fn visit_item(&mut self, _: &'a syn::Item) {}
}

/// Variables declared outside `blocks` that they assign, each named by
/// its first assignment (so diagnostics point there).
pub fn assigned_in<'a>(blocks: impl IntoIterator<Item = &'a Block>) -> Vec<Ident> {
    let mut v = Assigned {
        scopes: Vec::new(),
        found: Vec::new(),
    };
    for b in blocks {
        v.visit_block(b);
    }
    v.found
}

/// Finds `break`/`continue` that leave the loop being lowered: not those
/// of nested loops, closures or items.
#[derive(Default)]
pub struct Exits<'a> {
    pub breaks: Vec<&'a syn::ExprBreak>,
    pub continues: Vec<&'a syn::ExprContinue>,
}

impl<'a> Visit<'a> for Exits<'a> {
    fn visit_expr_break(&mut self, b: &'a syn::ExprBreak) {
        self.breaks.push(b);
        visit::visit_expr_break(self, b);
    }
    fn visit_expr_continue(&mut self, c: &'a syn::ExprContinue) {
        self.continues.push(c);
    }
    fn visit_expr_while(&mut self, w: &'a syn::ExprWhile) {
        self.visit_expr(&w.cond);
    }
    fn visit_expr_for_loop(&mut self, f: &'a syn::ExprForLoop) {
        self.visit_expr(&f.expr);
    }
    fn visit_expr_loop(&mut self, _: &'a syn::ExprLoop) {}
    fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    fn visit_expr_async(&mut self, _: &'a syn::ExprAsync) {}
    fn visit_item(&mut self, _: &'a syn::Item) {}
}

/// The loop exits in a statement or block.
pub fn exits_of_stmt(stmt: &syn::Stmt) -> Exits<'_> {
    let mut e = Exits::default();
    e.visit_stmt(stmt);
    e
}

/// The loop exits in a block.
pub fn exits_of_block(block: &Block) -> Exits<'_> {
    let mut e = Exits::default();
    e.visit_block(block);
    e
}

/// The first `return` (or `?`) that would leave the enclosing function,
/// not counting closures and items.
#[derive(Default)]
pub struct Returns {
    pub first: Option<proc_macro2::Span>,
    pub is_try: bool,
}

impl<'a> Visit<'a> for Returns {
    fn visit_expr_return(&mut self, r: &'a syn::ExprReturn) {
        if self.first.is_none() {
            self.first = Some(syn::spanned::Spanned::span(r));
        }
    }
    fn visit_expr_try(&mut self, t: &'a syn::ExprTry) {
        if self.first.is_none() {
            self.first = Some(t.question_token.span);
            self.is_try = true;
        }
        visit::visit_expr_try(self, t);
    }
    fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    fn visit_expr_async(&mut self, _: &'a syn::ExprAsync) {}
    fn visit_item(&mut self, _: &'a syn::Item) {}
}

/// Where a statement returns from the function, if it does.
pub fn returns_of_stmt(stmt: &syn::Stmt) -> Returns {
    let mut r = Returns::default();
    r.visit_stmt(stmt);
    r
}

/// Variables declared without a value (`let x;`) anywhere in `block`: a
/// staged branch or loop assigning one has nothing to pass in for it.
pub fn uninitialized(block: &Block) -> Vec<Ident> {
    struct Uninit(Vec<Ident>);
    impl<'a> Visit<'a> for Uninit {
        fn visit_local(&mut self, l: &'a syn::Local) {
            if l.init.is_none() {
                pattern_idents(&l.pat, &mut self.0);
            }
            visit::visit_local(self, l);
        }
        fn visit_item(&mut self, _: &'a syn::Item) {}
    }
    let mut u = Uninit(Vec::new());
    u.visit_block(block);
    u.0
}
