//! The desugaring of a `#[stage]` body.
//!
//! - Every `if c { .. } else { .. }` becomes a call of
//!   `StageIf::stage_if(cond, state, branches)`, where `state` is the
//!   tuple of outer variables either branch assigns and `branches` one
//!   closure `|then, state| if then { .. } else { .. }` that runs a branch
//!   and returns its value and the state (SSA renaming: a variable only one
//!   branch assigns passes through the other); the call site assigns the
//!   state back.
//! - Every `while c { .. }` becomes `StageWhile::stage_while(c0, state,
//!   cond, body)` over the variables the body assigns.
//! - `break`/`continue` of a lowered loop become flags (`bool` or
//!   `Tensor<bool>`, the loop condition's kind): the loop condition becomes
//!   `!break && cond`, and the statements after one that may exit run under
//!   `if !break && !continue`.
//! - An early `return` inside an `if` moves the rest of the block into the
//!   branches that do not return (continuation passing), so the `if`
//!   becomes the function's value.
//! - `for` loops stay Rust loops: over a host range they unroll into the
//!   trace.
//!
//! Whether a construct is staged is not decided here: the condition's type
//! picks the trait impl (`bool` or `Tensor<bool>`).

use crate::analysis::{self, assigned_in, exits_of_block, exits_of_stmt};
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{parse_quote, parse_quote_spanned, Block, Expr, Ident, Stmt};

/// The path of the runtime support module.
fn rt() -> TokenStream {
    quote!(::stagecraft::__stage)
}

#[derive(Clone)]
struct Flags {
    brk: Ident,
    cont: Option<Ident>,
}

impl Flags {
    /// `!break && !continue`: whether the rest of the body runs. Flag
    /// ops are spanned at the user's code (`span`), so that staged nodes
    /// name its line.
    fn go_on(&self, span: Span) -> Expr {
        let brk = &self.brk;
        let cont = self.cont.as_ref().unwrap_or(brk);
        parse_quote_spanned!(span=> ::stagecraft::__stage::Flag::neither(&#brk, &#cont))
    }
}

/// Where the code being lowered sits.
#[derive(Clone, Default)]
pub struct Ctx {
    /// Inside a closure the lowering made (a branch or a loop body), where
    /// a plain `return` or `?` would leave the closure, not the function.
    depth: usize,
    /// The flags of the innermost lowered loop.
    flags: Option<Flags>,
    /// Inside any loop.
    in_loop: bool,
}

impl Ctx {
    fn branch(&self) -> Ctx {
        Ctx {
            depth: self.depth + 1,
            ..self.clone()
        }
    }
}

pub struct Lowerer {
    next: usize,
    /// Variables declared without a value (`let x;`).
    uninit: Vec<Ident>,
}

fn err<T>(span: Span, message: impl std::fmt::Display) -> syn::Result<T> {
    Err(syn::Error::new(span, message))
}

fn is_staged_if(stmt: &Stmt) -> Option<&syn::ExprIf> {
    match stmt {
        Stmt::Expr(Expr::If(i), _) if !matches!(&*i.cond, Expr::Let(_)) => Some(i),
        _ => None,
    }
}

/// The statements of `block` as a block expression's statements with its
/// tail turned into a statement, so more statements can follow.
fn open_stmts(block: Block) -> Vec<Stmt> {
    let mut stmts = block.stmts;
    if let Some(Stmt::Expr(e, semi @ None)) = stmts.last_mut() {
        if !matches!(
            e,
            Expr::If(_) | Expr::While(_) | Expr::ForLoop(_) | Expr::Loop(_) | Expr::Block(_)
        ) {
            *semi = Some(Default::default());
        }
    }
    stmts
}

fn else_block(else_branch: Option<(syn::token::Else, Box<Expr>)>) -> Block {
    match else_branch {
        None => parse_quote!({}),
        Some((_, e)) => match *e {
            Expr::Block(b) => b.block,
            other => Block {
                brace_token: Default::default(),
                stmts: vec![Stmt::Expr(other, None)],
            },
        },
    }
}

impl Lowerer {
    pub fn new(uninit: Vec<Ident>) -> Lowerer {
        Lowerer { next: 0, uninit }
    }

    fn fresh(&mut self, what: &str) -> Ident {
        self.next += 1;
        // Mixed-site hygiene: user code can neither see nor clash with
        // these names.
        Ident::new(&format!("__stage_{what}_{}", self.next), Span::mixed_site())
    }

    /// Rejects a staged branch or loop assigning a variable that has no
    /// value before it.
    fn check_initialized(&self, assigned: &[Ident], construct: &str) -> syn::Result<()> {
        for a in assigned {
            if self.uninit.iter().any(|u| u == a) {
                return err(
                    a.span(),
                    format!(
                        "`{a}` is assigned inside {construct} but has no value before it; \
                         #[stage] passes every variable a branch or loop body assigns into it, \
                         so give `{a}` a value where it is declared (`let mut {a} = ...;`)"
                    ),
                );
            }
        }
        Ok(())
    }

    /// Rejects `?` in code that becomes a closure.
    fn check_no_try(&self, blocks: &[&Block]) -> syn::Result<()> {
        for b in blocks {
            for s in &b.stmts {
                let r = analysis::returns_of_stmt(s);
                if let (Some(span), true) = (r.first, r.is_try) {
                    return err(
                        span,
                        "`?` inside an `if`/`while` of #[stage] code would leave the generated \
                         branch closure, not the function; handle the error before the `if`/`while` \
                         or with `match` inside it",
                    );
                }
            }
        }
        Ok(())
    }

    /// Lowers a block.
    pub fn lower_block(&mut self, block: Block, ctx: &Ctx) -> syn::Result<Block> {
        let mut out: Vec<Stmt> = Vec::new();
        let mut stmts: std::collections::VecDeque<Stmt> = block.stmts.into();
        while let Some(stmt) = stmts.pop_front() {
            let returns = analysis::returns_of_stmt(&stmt);
            if let (Some(span), false) = (returns.first, returns.is_try) {
                if ctx.in_loop {
                    return err(
                        span,
                        "early `return` inside a loop is not supported by #[stage]; \
                         `break` out of the loop and return after it",
                    );
                }
                if let Stmt::Expr(Expr::Return(r), _) = &stmt {
                    let value: Expr = match &r.expr {
                        Some(e) => self.lower_expr((**e).clone(), ctx)?,
                        None => parse_quote!(()),
                    };
                    // Anything after a `return` is unreachable.
                    if ctx.depth == 0 {
                        out.push(Stmt::Expr(parse_quote!(return #value), None));
                    } else {
                        out.push(Stmt::Expr(value, None));
                    }
                    break;
                }
                if let Some(ifx) = is_staged_if(&stmt) {
                    // Continuation passing: the rest of this block runs in
                    // every branch that does not return, and the `if` is
                    // the block's value.
                    let mut ifx = ifx.clone();
                    let rest: Vec<Stmt> = stmts.drain(..).collect();
                    let then_block = ifx.then_branch.clone();
                    let else_b = else_block(ifx.else_branch.take());
                    let mut then_stmts = open_stmts(then_block);
                    then_stmts.extend(rest.iter().cloned());
                    let mut else_stmts = open_stmts(else_b);
                    else_stmts.extend(rest);
                    ifx.then_branch.stmts = then_stmts;
                    let else_expr = Expr::Block(syn::ExprBlock {
                        attrs: Vec::new(),
                        label: None,
                        block: Block {
                            brace_token: Default::default(),
                            stmts: else_stmts,
                        },
                    });
                    ifx.else_branch = Some((Default::default(), Box::new(else_expr)));
                    let (prefix, value) = self.lower_if(ifx, ctx, true)?;
                    out.extend(prefix);
                    out.push(Stmt::Expr(value, None));
                    break;
                }
                if ctx.depth > 0 {
                    return err(
                        span,
                        "this `return` is inside a staged `if` branch in a position #[stage] \
                         cannot lower; make it a statement of an `if` branch",
                    );
                }
                // At the function's own level a `return` outside `if`s is
                // an ordinary return.
            }
            if let Some(flags) = ctx.flags.clone() {
                match &stmt {
                    Stmt::Expr(Expr::Break(b), _) => {
                        check_break(b)?;
                        let brk = &flags.brk;
                        let span = b.break_token.span;
                        out.push(parse_quote_spanned!(span=>
                            #brk = ::stagecraft::__stage::Flag::raised(&#brk);
                        ));
                        break;
                    }
                    Stmt::Expr(Expr::Continue(c), _) => {
                        if let Some(label) = &c.label {
                            return err(
                                label.span(),
                                "labelled `continue` is not supported in #[stage] code",
                            );
                        }
                        let cont = flags.cont.as_ref().unwrap_or(&flags.brk);
                        let span = c.continue_token.span;
                        out.push(parse_quote_spanned!(span=>
                            #cont = ::stagecraft::__stage::Flag::raised(&#cont);
                        ));
                        break;
                    }
                    _ => {}
                }
                let exits = exits_of_stmt(&stmt);
                if !exits.breaks.is_empty() || !exits.continues.is_empty() {
                    let stmt_span = stmt.span();
                    let last = stmts.is_empty();
                    out.extend(self.lower_stmt(stmt, ctx, last)?);
                    if !stmts.is_empty() {
                        let rest = Block {
                            brace_token: Default::default(),
                            stmts: stmts.drain(..).collect(),
                        };
                        let cond = flags.go_on(stmt_span);
                        let guard: syn::ExprIf = parse_quote!(if #cond #rest);
                        let (prefix, _) = self.lower_if(guard, ctx, false)?;
                        out.extend(prefix);
                    }
                    break;
                }
            }
            let last = stmts.is_empty();
            out.extend(self.lower_stmt(stmt, ctx, last)?);
        }
        Ok(Block {
            brace_token: block.brace_token,
            stmts: out,
        })
    }

    fn lower_stmt(&mut self, stmt: Stmt, ctx: &Ctx, last: bool) -> syn::Result<Vec<Stmt>> {
        match stmt {
            Stmt::Local(mut local) => {
                let Some(init) = local.init.as_mut() else {
                    return Ok(vec![Stmt::Local(local)]);
                };
                match &*init.expr {
                    Expr::If(i) if !matches!(&*i.cond, Expr::Let(_)) => {
                        let (mut prefix, value) = self.lower_if(i.clone(), ctx, false)?;
                        *init.expr = value;
                        prefix.push(Stmt::Local(local));
                        Ok(prefix)
                    }
                    _ => {
                        let expr = self.lower_expr((*init.expr).clone(), ctx)?;
                        *init.expr = expr;
                        if let Some((_, diverge)) = init.diverge.as_mut() {
                            **diverge = self.lower_expr((**diverge).clone(), ctx)?;
                        }
                        Ok(vec![Stmt::Local(local)])
                    }
                }
            }
            Stmt::Expr(expr, semi) => match expr {
                Expr::If(i) if !matches!(&*i.cond, Expr::Let(_)) => {
                    let (mut prefix, value) = self.lower_if(i, ctx, false)?;
                    if last && semi.is_none() {
                        prefix.push(Stmt::Expr(value, None));
                    }
                    Ok(prefix)
                }
                Expr::If(i) => Ok(vec![Stmt::Expr(Expr::If(self.lower_if_let(i, ctx)?), semi)]),
                Expr::While(w) => self.lower_while(w, ctx),
                Expr::ForLoop(f) => self.lower_for(f, ctx),
                Expr::Loop(l) => self.lower_loop(l, ctx),
                Expr::Block(mut b) if b.label.is_none() => {
                    b.block = self.lower_block(b.block, ctx)?;
                    Ok(vec![Stmt::Expr(Expr::Block(b), semi)])
                }
                other => Ok(vec![Stmt::Expr(self.lower_expr(other, ctx)?, semi)]),
            },
            other => Ok(vec![other]),
        }
    }

    /// `if let` stays Rust; its blocks are lowered in place.
    fn lower_if_let(&mut self, mut i: syn::ExprIf, ctx: &Ctx) -> syn::Result<syn::ExprIf> {
        *i.cond = self.lower_expr((*i.cond).clone(), ctx)?;
        i.then_branch = self.lower_block(i.then_branch, ctx)?;
        if let Some((else_token, e)) = i.else_branch.take() {
            let block = else_block(Some((else_token, e)));
            let lowered = self.lower_block(block, ctx)?;
            i.else_branch = Some((
                else_token,
                Box::new(Expr::Block(syn::ExprBlock {
                    attrs: Vec::new(),
                    label: None,
                    block: lowered,
                })),
            ));
        }
        Ok(i)
    }

    /// An `if` on a condition: statements to emit, then the `if`'s value.
    /// With `cps`, its branches already end with the rest of the function
    /// and may `return`.
    fn lower_if(
        &mut self,
        ifx: syn::ExprIf,
        ctx: &Ctx,
        cps: bool,
    ) -> syn::Result<(Vec<Stmt>, Expr)> {
        let span = ifx.if_token.span;
        let cond = self.lower_expr(*ifx.cond, ctx)?;
        let then_block = ifx.then_branch;
        let else_b = else_block(ifx.else_branch);
        if !cps {
            for b in [&then_block, &else_b] {
                for s in &b.stmts {
                    let r = analysis::returns_of_stmt(s);
                    if let (Some(span), false) = (r.first, r.is_try) {
                        return err(
                            span,
                            "#[stage] lowers an early `return` only where its `if` is a statement \
                             of the function body (or of an enclosing `if` branch); move the `if` \
                             out of this expression or loop",
                        );
                    }
                }
            }
        }
        self.check_no_try(&[&then_block, &else_b])?;
        let mut assigned = assigned_in([&then_block, &else_b]);
        self.check_initialized(&assigned, "an `if` that #[stage] lowers")?;
        // A `break`/`continue` in a branch assigns its loop's flag.
        if let Some(flags) = &ctx.flags {
            let (mut breaks, mut continues) = (false, false);
            for b in [&then_block, &else_b] {
                let e = exits_of_block(b);
                breaks |= !e.breaks.is_empty();
                continues |= !e.continues.is_empty();
            }
            let cont = flags.cont.as_ref().unwrap_or(&flags.brk);
            for (used, flag) in [(breaks, &flags.brk), (continues, cont)] {
                if used && !assigned.iter().any(|a| a == flag) {
                    assigned.push(flag.clone());
                }
            }
        }
        let inner = ctx.branch();
        let then_l = self.lower_block(then_block, &inner)?;
        let else_l = self.lower_block(else_b, &inner)?;
        let (c, r, v) = (self.fresh("c"), self.fresh("r"), self.fresh("v"));
        let (mut state, f, sel) = (self.fresh("s"), self.fresh("f"), self.fresh("then"));
        if let Some(first) = assigned.first() {
            // A state that cannot be staged is reported at the assignment
            // that put the variable into it.
            state.set_span(Span::mixed_site().located_at(first.span()));
        }
        let rt = rt();
        let a = &assigned;
        let then_span = then_l.brace_token.span.join();
        let else_span = else_l.brace_token.span.join();
        let then_ret = quote_spanned!(then_span=> (#v, (#(#a,)*)));
        let else_ret = quote_spanned!(else_span=> (#v, (#(#a,)*)));
        // One closure for both branches, so a branch that consumes an
        // outer value does not conflict with the other borrowing it.
        // Spelled out (not `#rt`) so that trait-bound errors point at the
        // user's `if` and condition.
        let call = quote_spanned! {span=>
            ::stagecraft::__stage::StageIf::stage_if(#c, #state, #f)
        };
        let cond_call = cond_value(&cond);
        let mut stmts: Vec<Stmt> = vec![
            parse_quote!(let #c = #cond_call;),
            parse_quote!(let #state = (#(#a,)*);),
            parse_quote!(
                let #f = #rt::branches(&#state, |#sel: bool, (#(mut #a,)*)| {
                    if #sel {
                        let #v = #then_l;
                        #then_ret
                    } else {
                        let #v = #else_l;
                        #else_ret
                    }
                });
            ),
            parse_quote!(let #r = #call;),
        ];
        if !assigned.is_empty() {
            stmts.push(parse_quote!((#(#a,)*) = #r.1;));
        }
        Ok((stmts, parse_quote!(#r.0)))
    }

    fn lower_while(&mut self, w: syn::ExprWhile, ctx: &Ctx) -> syn::Result<Vec<Stmt>> {
        if let Some(label) = &w.label {
            return err(
                label.span(),
                "labelled loops are not supported in #[stage] code",
            );
        }
        if matches!(&*w.cond, Expr::Let(_)) {
            // `while let` matches host values: a Rust loop, like `for`.
            return self.lower_host_loop(Expr::While(w), ctx);
        }
        let span = w.while_token.span;
        let cond = self.lower_expr(*w.cond, ctx)?;
        let mut body = w.body;
        self.check_no_try(&[&body])?;
        let exits = exits_of_block(&body);
        for b in &exits.breaks {
            check_break(b)?;
        }
        let (c, r) = (self.fresh("c"), self.fresh("r"));
        // The condition runs once before the loop (its type picks the impl)
        // and then once per iteration inside the `cond` closure.
        let cond_call = cond_value(&cond);
        let mut stmts: Vec<Stmt> = vec![parse_quote!(let #c = #cond_call;)];
        // Variables the condition assigns are loop state too.
        let cond_block = Block {
            brace_token: Default::default(),
            stmts: vec![Stmt::Expr(cond.clone(), None)],
        };
        let flags = if exits.breaks.is_empty() && exits.continues.is_empty() {
            None
        } else {
            let brk = self.fresh("break");
            let cont = (!exits.continues.is_empty()).then(|| self.fresh("continue"));
            stmts.push(parse_quote_spanned!(span=>
                let mut #brk = ::stagecraft::__stage::Flag::lowered(&#c);
            ));
            if let Some(cont) = &cont {
                body.stmts.insert(
                    0,
                    parse_quote_spanned!(span=>
                        let mut #cont = ::stagecraft::__stage::Flag::lowered(&#brk);
                    ),
                );
            }
            Some(Flags { brk, cont })
        };
        let full_cond: Expr = match &flags {
            Some(f) => {
                let brk = &f.brk;
                let value = cond_value(&cond);
                parse_quote_spanned!(span=> ::stagecraft::__stage::Flag::unless(&#brk, || #value))
            }
            None => cond,
        };
        let mut carried = assigned_in([&cond_block, &body]);
        self.check_initialized(&carried, "a `while` loop that #[stage] lowers")?;
        if let Some(f) = &flags {
            carried.push(f.brk.clone());
        }
        let inner = Ctx {
            depth: ctx.depth + 1,
            flags,
            in_loop: true,
        };
        let body_l = self.lower_block(body, &inner)?;
        let a = &carried;
        let again = cond_value(&full_cond);
        let call = quote_spanned! {span=>
            ::stagecraft::__stage::StageWhile::stage_while(
                #c,
                (#(#a,)*),
                |(#(mut #a,)*)| (#again, (#(#a,)*)),
                |(#(mut #a,)*)| { #body_l; (#(#a,)*) },
            )
        };
        stmts.push(parse_quote!(let #r = #call;));
        if !carried.is_empty() {
            stmts.push(parse_quote!((#(#a,)*) = #r;));
        }
        Ok(stmts)
    }

    fn lower_loop(&mut self, l: syn::ExprLoop, ctx: &Ctx) -> syn::Result<Vec<Stmt>> {
        if let Some(label) = &l.label {
            return err(
                label.span(),
                "labelled loops are not supported in #[stage] code",
            );
        }
        // `loop` has no condition to stage on: it is `while true`, a host
        // loop (a staged loop needs a `Tensor<bool>` condition).
        let w = syn::ExprWhile {
            attrs: l.attrs,
            label: None,
            while_token: syn::Token![while](l.loop_token.span),
            cond: Box::new(parse_quote!(true)),
            body: l.body,
        };
        self.lower_while(w, ctx)
    }

    fn lower_for(&mut self, f: syn::ExprForLoop, ctx: &Ctx) -> syn::Result<Vec<Stmt>> {
        if let Some(label) = &f.label {
            return err(
                label.span(),
                "labelled loops are not supported in #[stage] code",
            );
        }
        self.lower_host_loop(Expr::ForLoop(f), ctx)
    }

    /// A loop that stays a Rust loop (`for`, `while let`): its body is
    /// lowered in place, with `bool` flags for `break`/`continue` that sit
    /// under a lowered `if`.
    fn lower_host_loop(&mut self, mut lp: Expr, ctx: &Ctx) -> syn::Result<Vec<Stmt>> {
        let body = match &mut lp {
            Expr::ForLoop(f) => {
                *f.expr = self.lower_expr((*f.expr).clone(), ctx)?;
                &mut f.body
            }
            Expr::While(w) => {
                *w.cond = self.lower_expr((*w.cond).clone(), ctx)?;
                &mut w.body
            }
            _ => return Ok(vec![Stmt::Expr(lp, None)]),
        };
        let exits = exits_of_block(body);
        for b in &exits.breaks {
            check_break(b)?;
        }
        let mut stmts = Vec::new();
        let flags = if exits.breaks.is_empty() && exits.continues.is_empty() {
            None
        } else {
            let brk = self.fresh("break");
            let cont = (!exits.continues.is_empty()).then(|| self.fresh("continue"));
            stmts.push(parse_quote!(let mut #brk = false;));
            if let Some(cont) = &cont {
                body.stmts.insert(0, parse_quote!(let mut #cont = false;));
            }
            Some(Flags { brk, cont })
        };
        let inner = Ctx {
            depth: ctx.depth,
            flags: flags.clone(),
            in_loop: true,
        };
        let taken = std::mem::replace(body, parse_quote!({}));
        let mut lowered = self.lower_block(taken, &inner)?;
        if let Some(f) = &flags {
            let brk = &f.brk;
            lowered.stmts.push(parse_quote!(if #brk { break; }));
        }
        *body = lowered;
        stmts.push(Stmt::Expr(lp, None));
        Ok(stmts)
    }

    /// Lowers `if`s nested inside an expression (closure bodies,
    /// arguments): they must not assign outer variables or leave a loop.
    fn lower_expr(&mut self, expr: Expr, ctx: &Ctx) -> syn::Result<Expr> {
        let mut v = ExprLowerer {
            lowerer: self,
            ctx: ctx.clone(),
            error: None,
        };
        let mut expr = expr;
        v.visit_expr_mut(&mut expr);
        match v.error {
            Some(e) => Err(e),
            None => Ok(expr),
        }
    }
}

/// `StageCond::stage_cond(&(cond))`, spanned at the condition so a
/// condition of the wrong type is reported there.
fn cond_value(cond: &Expr) -> TokenStream {
    let span = cond.span();
    quote_spanned!(span=> ::stagecraft::__stage::StageCond::stage_cond(&(#cond)))
}

fn check_break(b: &syn::ExprBreak) -> syn::Result<()> {
    if let Some(label) = &b.label {
        return err(
            label.span(),
            "labelled `break` is not supported in #[stage] code",
        );
    }
    if let Some(value) = &b.expr {
        return err(
            value.span(),
            "#[stage] cannot lower a `break` with a value (as in `loop { .. break x; }`): \
             assign the value to a variable declared before the loop, then `break`",
        );
    }
    Ok(())
}

struct ExprLowerer<'a> {
    lowerer: &'a mut Lowerer,
    ctx: Ctx,
    error: Option<syn::Error>,
}

impl VisitMut for ExprLowerer<'_> {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        if self.error.is_some() {
            return;
        }
        match expr {
            Expr::If(i) if !matches!(&*i.cond, Expr::Let(_)) => {
                let assigned = assigned_in([&i.then_branch]);
                if let Some(a) = assigned.first() {
                    self.error = Some(syn::Error::new(
                        a.span(),
                        format!(
                            "this `if` assigns `{a}` but sits inside an expression; #[stage] \
                             lowers such an `if` only as a statement or a `let` initializer"
                        ),
                    ));
                    return;
                }
                let ifx = i.clone();
                match self.lowerer.lower_if(ifx, &self.ctx, false) {
                    Ok((stmts, value)) => {
                        *expr = parse_quote!({ #(#stmts)* #value });
                    }
                    Err(e) => self.error = Some(e),
                }
            }
            Expr::Closure(c) => {
                // A closure body is its own function: its `return`s and
                // loops are its own.
                let body = (*c.body).clone();
                let block: Block = match body {
                    Expr::Block(b) if b.label.is_none() => b.block,
                    other => Block {
                        brace_token: Default::default(),
                        stmts: vec![Stmt::Expr(other, None)],
                    },
                };
                match self.lowerer.lower_block(block, &Ctx::default()) {
                    Ok(b) => {
                        *c.body = Expr::Block(syn::ExprBlock {
                            attrs: Vec::new(),
                            label: None,
                            block: b,
                        })
                    }
                    Err(e) => self.error = Some(e),
                }
            }
            Expr::Break(b) if self.ctx.flags.is_some() => {
                self.error = Some(syn::Error::new(
                    b.span(),
                    "#[stage] lowers `break` only as a statement (of the loop body or of an `if` \
                     branch in it); rewrite this expression with an `if`",
                ));
            }
            Expr::Continue(c) if self.ctx.flags.is_some() => {
                self.error = Some(syn::Error::new(
                    c.span(),
                    "#[stage] lowers `continue` only as a statement (of the loop body or of an \
                     `if` branch in it); rewrite this expression with an `if`",
                ));
            }
            Expr::Loop(l)
                if exits_of_block(&l.body)
                    .breaks
                    .iter()
                    .any(|b| b.expr.is_some()) =>
            {
                let b = exits_of_block(&l.body)
                    .breaks
                    .into_iter()
                    .find(|b| b.expr.is_some())
                    .cloned();
                if let Some(b) = b {
                    self.error = check_break(&b).err();
                }
            }
            Expr::While(_) | Expr::ForLoop(_) | Expr::Loop(_) => {
                // Loops inside expressions keep their own `break`s.
                let saved = self.ctx.flags.take();
                visit_mut::visit_expr_mut(self, expr);
                self.ctx.flags = saved;
            }
            _ => visit_mut::visit_expr_mut(self, expr),
        }
    }

    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}
