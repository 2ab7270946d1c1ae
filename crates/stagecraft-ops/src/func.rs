//! The function library: graph functions that ops refer to by id (the
//! branches of `If`, the condition and body of `While`, the callee of
//! `Call`).
//!
//! The op registry only needs a function's signature, to check and infer the
//! metadata of the ops that use it; the body is stored type-erased and read
//! back by the layers that execute or transform functions (the graph IR
//! crate registers its `Function`s here).

use stagecraft_tensor::TensorMetadata;
use std::any::Any;
use std::sync::{Arc, RwLock};

/// The id of a function in the process-wide library. Ids are never reused,
/// so an id in an attribute always names the same function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FuncId(pub u32);

/// What a library function takes and returns.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FunctionSignature {
    /// Parameter metadata, in order.
    pub inputs: Vec<TensorMetadata>,
    /// Result metadata, in order.
    pub outputs: Vec<TensorMetadata>,
}

struct Entry {
    name: String,
    signature: FunctionSignature,
    body: Arc<dyn Any + Send + Sync>,
}

static LIBRARY: RwLock<Vec<Entry>> = RwLock::new(Vec::new());

/// Adds a function to the library and returns its id. The name is for
/// printing (`@name` in traces); it need not be unique.
pub fn register_function(
    name: String,
    signature: FunctionSignature,
    body: Arc<dyn Any + Send + Sync>,
) -> FuncId {
    let mut library = LIBRARY.write().unwrap_or_else(|p| p.into_inner());
    let id = FuncId(u32::try_from(library.len()).expect("more than 2^32 library functions"));
    library.push(Entry {
        name,
        signature,
        body,
    });
    id
}

/// The signature of a library function.
pub fn function_signature(id: FuncId) -> Option<FunctionSignature> {
    let library = LIBRARY.read().unwrap_or_else(|p| p.into_inner());
    library.get(id.0 as usize).map(|e| e.signature.clone())
}

/// The body of a library function, type-erased.
pub fn function_body(id: FuncId) -> Option<Arc<dyn Any + Send + Sync>> {
    let library = LIBRARY.read().unwrap_or_else(|p| p.into_inner());
    library.get(id.0 as usize).map(|e| e.body.clone())
}

/// The printed name of a library function (`f<id>` when unknown).
pub fn function_name(id: FuncId) -> String {
    let library = LIBRARY.read().unwrap_or_else(|p| p.into_inner());
    match library.get(id.0 as usize) {
        Some(e) => e.name.clone(),
        None => format!("f{}", id.0),
    }
}

/// Finds a library function by its printed name (the most recent one).
pub fn find_function(name: &str) -> Option<FuncId> {
    let library = LIBRARY.read().unwrap_or_else(|p| p.into_inner());
    library
        .iter()
        .rposition(|e| e.name == name)
        .map(|i| FuncId(i as u32))
}
