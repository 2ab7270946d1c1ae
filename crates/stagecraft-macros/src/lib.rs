//! Procedural macros of stagecraft: `#[stage]`, graph program extraction
//! from ordinary Rust control flow, and `#[derive(TensorGroup)]` for
//! structs of tensors. Use them through the `stagecraft` crate
//! (`stagecraft::stage`, `stagecraft::TensorGroup`), whose `__stage`
//! module holds the traits the generated code calls.

mod analysis;
mod lower;

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{parse_macro_input, FnArg, Ident, ItemFn, Pat};

/// Stages a function: its body is traced into a graph function once per
/// input signature (tensor dtypes and shapes, plus the values of host
/// arguments such as `k: usize`), cached, and run as one `Call` op.
///
/// Inside, write ordinary Rust. An `if`/`while` whose condition is a
/// `Tensor<bool>` becomes one `If`/`While` op; one on a `bool` stays Rust.
/// The choice is made by the type checker (trait dispatch on the
/// condition), never at run time. Mutation becomes SSA renaming: a staged
/// branch takes and returns the variables it assigns; a staged loop
/// carries the variables its body assigns. `break`/`continue` become
/// loop-state flags, an early `return` inside an `if` moves the rest of
/// the function into the branches, and `for` loops over host ranges stay
/// host loops, unrolled into the trace.
///
/// ```text
/// use stagecraft::{Device, Tensor};
///
/// #[stagecraft::stage]
/// fn shrink(x: Tensor<f32>, limit: Tensor<f32>, rounds: usize) -> Tensor<f32> {
///     let mut x = x;
///     for _ in 0..rounds {                        // host loop: unrolled
///         while x.sum(&[0], false).gt(&limit) {   // Tensor<bool>: one While op
///             x = &x * 0.5;
///         }
///         if rounds > 2 {                         // bool: plain Rust
///             x = &x + 1.0;
///         }
///     }
///     x
/// }
/// ```
///
/// Diagnostics: a variable a lowered branch or loop assigns that has no
/// value before it, `loop` with a `break` value, labelled loops, early
/// `return` inside a loop and `?` inside a branch are `compile_error!`s at
/// the offending token; a host value assigned in a staged branch or
/// branches of different types fail type checking with a message saying
/// what to change.
#[proc_macro_attribute]
pub fn stage(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        let attr = TokenStream2::from(attr);
        return syn::Error::new(attr.span(), "#[stage] takes no arguments")
            .to_compile_error()
            .into();
    }
    let f = parse_macro_input!(item as ItemFn);
    match expand_stage(&f) {
        Ok(tokens) => tokens.into(),
        Err(e) => {
            // Keep the signature so callers type-check; the body never
            // compiles into a program because of the error beside it.
            let sig = &f.sig;
            let attrs = &f.attrs;
            let vis = &f.vis;
            let error = e.to_compile_error();
            quote! {
                #error
                #(#attrs)*
                #[allow(unused_variables)]
                #vis #sig {
                    ::core::unreachable!("#[stage] rejected this function")
                }
            }
            .into()
        }
    }
}

/// Nests more than eight items into tuples of at most eight (the arity the
/// support traits are implemented for).
fn nest(items: &[TokenStream2]) -> TokenStream2 {
    if items.len() <= 8 {
        quote!((#(#items,)*))
    } else {
        let head = &items[..7];
        let tail = nest(&items[7..]);
        quote!((#(#head,)* #tail,))
    }
}

fn expand_stage(f: &ItemFn) -> syn::Result<TokenStream2> {
    let sig = &f.sig;
    if let Some(a) = &sig.asyncness {
        return Err(syn::Error::new(
            a.span(),
            "#[stage] functions cannot be `async`",
        ));
    }
    if !sig.generics.params.is_empty() {
        return Err(syn::Error::new(
            sig.generics.span(),
            "#[stage] functions cannot be generic: each keeps one trace cache; \
             write a #[stage] function per element type and call it from a generic one",
        ));
    }
    let mut names: Vec<Ident> = Vec::new();
    let mut outer_inputs: Vec<TokenStream2> = Vec::new();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(r) => {
                return Err(syn::Error::new(
                    r.span(),
                    "#[stage] works on free functions: pass the tensors of `self` as arguments",
                ))
            }
            FnArg::Typed(t) => match &*t.pat {
                Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => {
                    let name = &p.ident;
                    let ty = &t.ty;
                    names.push(name.clone());
                    outer_inputs.push(quote!(#name: #ty));
                }
                other => {
                    return Err(syn::Error::new(
                        other.span(),
                        "#[stage] needs a plain name for each argument (`x: Tensor<f32>`); \
                         destructure inside the body",
                    ))
                }
            },
        }
    }
    let uninit = analysis::uninitialized(&f.block);
    let mut lowerer = lower::Lowerer::new(uninit);
    let body = lowerer.lower_block((*f.block).clone(), &lower::Ctx::default())?;

    let attrs = &f.attrs;
    let vis = &f.vis;
    let ident = &sig.ident;
    let output = &sig.output;
    let inputs = &sig.inputs;
    let inner = Ident::new("__stage_body", Span::mixed_site());
    let cache = Ident::new("__STAGE_CACHE", Span::mixed_site());
    let name = ident.to_string();
    let arg_items: Vec<TokenStream2> = names.iter().map(|n| quote!(#n)).collect();
    let args = nest(&arg_items);
    let span = sig.fn_token.span;
    let call = quote_spanned! {span=>
        #cache.call(#args, |#args| #inner(#(#names),*))
    };
    Ok(quote! {
        #(#attrs)*
        #[track_caller]
        #vis fn #ident(#(#outer_inputs),*) #output {
            // The user's body, desugared; traced once per signature.
            // SSA form assigns every carried variable back after its `if`/`while`,
            // also where the user's code reads it no more.
            #[allow(unused_mut, unused_assignments)]
            fn #inner(#inputs) #output #body
            static #cache: ::stagecraft::__stage::StageCache =
                ::stagecraft::__stage::StageCache::new(#name);
            #call
        }
    })
}

/// Implements `TensorGroup` (and makes the type a `#[stage]` argument and
/// result) for a struct whose fields are tensors or groups of tensors, in
/// field order. The struct must also be `Clone`.
#[proc_macro_derive(TensorGroup)]
pub fn derive_tensor_group(item: TokenStream) -> TokenStream {
    let input = parse_macro_input!(item as syn::DeriveInput);
    match expand_derive(&input) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn expand_derive(input: &syn::DeriveInput) -> syn::Result<TokenStream2> {
    let syn::Data::Struct(data) = &input.data else {
        return Err(syn::Error::new(
            input.ident.span(),
            "#[derive(TensorGroup)] works on structs (their fields in order)",
        ));
    };
    let name = &input.ident;
    let (impl_g, ty_g, where_g) = input.generics.split_for_impl();
    let rt = quote!(::stagecraft::__stage);
    let members: Vec<syn::Member> = data
        .fields
        .iter()
        .enumerate()
        .map(|(i, f)| match &f.ident {
            Some(id) => syn::Member::Named(id.clone()),
            None => syn::Member::Unnamed(syn::Index::from(i)),
        })
        .collect();
    let rebuild = match &data.fields {
        syn::Fields::Unit => quote!(#name),
        _ => quote!(#name { #(#members: #rt::TensorGroup::rebuild(&self.#members, handles)?,)* }),
    };
    Ok(quote! {
        impl #impl_g #rt::TensorGroup for #name #ty_g #where_g {
            fn handles(&self, out: &mut ::std::vec::Vec<#rt::TensorHandle>) {
                #(#rt::TensorGroup::handles(&self.#members, out);)*
            }
            fn rebuild(
                &self,
                handles: &mut dyn ::std::iter::Iterator<Item = #rt::TensorHandle>,
            ) -> ::stagecraft::Result<Self> {
                ::std::result::Result::Ok(#rebuild)
            }
        }
        impl #impl_g #rt::StageArg for #name #ty_g #where_g {
            fn stage_key(
                &self,
                tensors: &mut ::std::vec::Vec<#rt::TensorMetadata>,
                _: &mut ::std::string::String,
            ) {
                #rt::group_key(self, tensors)
            }
            fn stage_handles(&self, out: &mut ::std::vec::Vec<#rt::TensorHandle>) {
                #rt::TensorGroup::handles(self, out)
            }
            fn stage_rebuild(
                &self,
                handles: &mut dyn ::std::iter::Iterator<Item = #rt::TensorHandle>,
            ) -> ::stagecraft::Result<Self> {
                #rt::TensorGroup::rebuild(self, handles)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(src: &str) -> String {
        let f: ItemFn = syn::parse_str(src).unwrap();
        match expand_stage(&f) {
            Ok(t) => t.to_string(),
            Err(e) => format!("error: {e}"),
        }
    }

    #[test]
    fn branches_carry_what_they_assign_and_nothing_local() {
        let out = expand(
            "fn f(x: T) -> T { let mut y = x; let z = 1; \
             if c { let w = y; y = w; } else { z2(); } y }",
        );
        assert!(out.contains("StageIf :: stage_if"), "{out}");
        // `y` is the state; `w` is the branch's own.
        assert!(out.contains("(y ,) = __stage_r_"), "{out}");
        assert!(!out.contains("(w ,)"), "{out}");
    }

    #[test]
    fn loops_carry_assigned_variables_and_flags() {
        let out = expand(
            "fn f(x: T) -> T { let mut y = x; let mut i = 0; \
             while c(&i) { i = i + 1; if d { continue; } y = g(y); if e { break; } } y }",
        );
        assert!(out.contains("StageWhile :: stage_while"), "{out}");
        assert!(out.contains("Flag :: unless"), "{out}");
        assert!(out.contains("Flag :: neither"), "{out}");
        assert!(out.contains("(i , y , __stage_break_"), "{out}");
    }

    #[test]
    fn for_loops_stay_rust_loops() {
        let out =
            expand("fn f(x: T, k: usize) -> T { let mut y = x; for _ in 0..k { y = g(y); } y }");
        assert!(out.contains("for _ in 0 .. k"), "{out}");
        assert!(!out.contains("stage_while"), "{out}");
    }

    #[test]
    fn early_return_moves_the_rest_into_the_branches() {
        let out = expand("fn f(x: T) -> T { if c { return a(x); } let y = b(&x); y }");
        assert!(!out.contains("return"), "{out}");
        assert!(out.contains("let y = b (& x)"), "{out}");
    }

    #[test]
    fn unstageable_code_is_rejected_with_a_reason() {
        for (src, says) in [
            (
                "fn f(x: T) -> T { let y; if c { y = x; } else { y = x; } y }",
                "has no value before it",
            ),
            (
                "fn f(x: T) -> T { let v = loop { break x; }; v }",
                "`break` with a value",
            ),
            (
                "fn f(x: T) -> T { while c { if d { return x; } } x }",
                "inside a loop",
            ),
            (
                "fn f(x: T) -> T { 'a: while c { break 'a; } x }",
                "labelled",
            ),
            ("fn f(x: T) -> T { if c { g()?; } x }", "`?`"),
            ("fn f<U>(x: U) -> U { x }", "generic"),
            ("fn f((a, b): (T, T)) -> T { a }", "plain name"),
        ] {
            let out = expand(src);
            assert!(
                out.starts_with("error:") && out.contains(says),
                "{src}: {out}"
            );
        }
    }
}
