//! The CPU op handler: looks kernels up in a cache keyed by (op, attributes,
//! input dtypes, device) and runs them now (sync mode) or on a worker pool
//! once their inputs are ready (async mode).

use crate::context::{execution_mode, ExecutionMode};
use crate::handle::{MetadataState, TensorHandle};
use crate::op_handler::{Args, InputMetas, OpHandler, OpInvocation, ReadyArgs, Results};
use crate::runtime::{
    count_inline_run, count_kernel_launch, is_cancelled, report_error, CounterSlot,
    PerThreadCounter,
};
use smallvec::SmallVec;
use stagecraft_cpu::{settle_by_shape, AnyKernel, Inputs, Kernel, KernelContext, ValueInputs};
use stagecraft_ops::{Attrs, FrozenOpAttrs, OpAttrs, OpDef, OutputMetas, ShapeKind};
use stagecraft_tensor::{
    DType, DenseHostTensor, Error, ErrorKind, HostTensor, Location, Result, TensorMetadata,
    TensorValue,
};
use stagecraft_tensor::{FxBuild, FxHasher};
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

struct CacheEntry {
    op: usize,
    attrs: FrozenOpAttrs,
    dtypes: SmallVec<[DType; 4]>,
    kernel: &'static AnyKernel,
}

/// Instantiated kernels, keyed by (op, attributes, input dtypes) for one
/// device.
///
/// Entries are never evicted, so each kernel is allocated once for the
/// life of the process and lent out as `&'static`: running it takes no
/// reference count. Each thread also keeps its last lookups in a small
/// front table of its own ([`FRONT`]), so the common case (the same few
/// ops again and again) takes no lock and writes no memory that another
/// thread uses.
pub struct KernelCache {
    /// Tells this cache's entries apart in the threads' front tables (an
    /// address could be reused by a later cache).
    id: u64,
    /// The index of the CPU device this cache belongs to (`cpu:N`): the
    /// kernels of control-flow ops run their functions there.
    device_index: usize,
    buckets: RwLock<HashMap<u64, SmallVec<[CacheEntry; 1]>, FxBuild>>,
    hits: PerThreadCounter,
    misses: AtomicU64,
}

impl Default for KernelCache {
    fn default() -> KernelCache {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        KernelCache {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            device_index: 0,
            buckets: RwLock::default(),
            hits: PerThreadCounter::new(),
            misses: AtomicU64::new(0),
        }
    }
}

/// Slots of a thread's front table (a power of two).
const FRONT_SLOTS: usize = 64;

/// A kernel a thread looked up recently.
struct FrontEntry {
    cache: u64,
    key: u64,
    op: usize,
    dtypes: SmallVec<[DType; 4]>,
    attrs: FrozenOpAttrs,
    kernel: &'static AnyKernel,
    /// This thread's count of the cache's hits.
    hits: CounterSlot,
}

/// A thread's front table and its slots of the caches' hit counters.
struct Front {
    entries: Vec<Option<FrontEntry>>,
    hit_slots: Vec<(u64, CounterSlot)>,
}

thread_local! {
    /// This thread's recent lookups, direct-mapped by key.
    static FRONT: RefCell<Front> = RefCell::new(Front {
        entries: (0..FRONT_SLOTS).map(|_| None).collect(),
        hit_slots: Vec::new(),
    });
}

/// Hit and miss counts of a kernel cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCacheStats {
    /// Lookups that found an instantiated kernel.
    pub hits: u64,
    /// Lookups that instantiated one.
    pub misses: u64,
    /// Kernels held.
    pub entries: usize,
}

impl KernelCache {
    fn fingerprint(op: &OpDef, attrs: &OpAttrs, dtypes: &[DType]) -> u64 {
        let mut h = FxHasher::default();
        h.write_usize(op as *const OpDef as usize);
        if !attrs.is_empty() {
            attrs.hash(&mut h);
        }
        for d in dtypes {
            h.write_u8(*d as u8);
        }
        h.finish()
    }

    /// The kernel for `op` with these attributes and inputs, instantiating
    /// it on first use.
    pub fn get(
        &self,
        op: &'static OpDef,
        attrs: &OpAttrs,
        inputs: &[TensorMetadata],
    ) -> Result<AnyKernel> {
        self.lookup(op, attrs, inputs).cloned()
    }

    /// [`KernelCache::get`] without a reference count: cached kernels live
    /// as long as the process.
    pub fn lookup(
        &self,
        op: &'static OpDef,
        attrs: &OpAttrs,
        inputs: &[TensorMetadata],
    ) -> Result<&'static AnyKernel> {
        let dtypes: SmallVec<[DType; 4]> = inputs.iter().map(|m| m.dtype).collect();
        let key = Self::fingerprint(op, attrs, &dtypes);
        let op_id = op as *const OpDef as usize;
        let slot = key as usize % FRONT_SLOTS;
        let in_front = FRONT.try_with(|front| {
            // Borrowed only for the lookup: a kernel built below may run
            // ops (and look kernels up) itself.
            let front = front.try_borrow().ok()?;
            let entry = front.entries[slot].as_ref()?;
            let same = entry.cache == self.id
                && entry.key == key
                && entry.op == op_id
                && entry.dtypes == dtypes
                && *entry.attrs == *attrs;
            same.then(|| {
                entry.hits.add(1);
                entry.kernel
            })
        });
        if let Ok(Some(kernel)) = in_front {
            return Ok(kernel);
        }
        let matches = |e: &CacheEntry| e.op == op_id && e.dtypes == dtypes && *e.attrs == *attrs;
        let found = {
            let buckets = self.buckets.read().unwrap_or_else(|p| p.into_inner());
            buckets
                .get(&key)
                .and_then(|b| b.iter().find(|e| matches(e)))
                .map(|e| (e.kernel, e.attrs.clone()))
        };
        if let Some((kernel, frozen)) = found {
            self.remember(slot, key, op_id, dtypes, frozen, kernel, true);
            return Ok(kernel);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        use crate::kernels::{kernel_for, DeviceKernel};
        let kernel = match kernel_for(op, crate::DeviceKind::Cpu, &dtypes) {
            Some(DeviceKernel::Control) => {
                let device = crate::Device::parse(&format!("cpu:{}", self.device_index))?;
                AnyKernel::Value(crate::executor::control::control_kernel(op, attrs, device)?)
            }
            Some(DeviceKernel::Cpu(factory)) => {
                AnyKernel::Dense(factory(&Attrs::new(attrs, op), inputs)?)
            }
            Some(DeviceKernel::CpuValue(factory)) => {
                AnyKernel::Value(factory(&Attrs::new(attrs, op), inputs)?)
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::Device,
                    format!("the CPU has no kernel for {}", op.name),
                ))
            }
        };
        let frozen = attrs.freeze();
        let kernel = {
            let mut buckets = self.buckets.write().unwrap_or_else(|p| p.into_inner());
            let bucket = buckets.entry(key).or_default();
            match bucket.iter().find(|e| matches(e)) {
                // Another thread instantiated it meanwhile: keep one.
                Some(entry) => entry.kernel,
                None => {
                    let kernel: &'static AnyKernel = Box::leak(Box::new(kernel));
                    bucket.push(CacheEntry {
                        op: op_id,
                        attrs: frozen.clone(),
                        dtypes: dtypes.clone(),
                        kernel,
                    });
                    kernel
                }
            }
        };
        self.remember(slot, key, op_id, dtypes, frozen, kernel, false);
        Ok(kernel)
    }

    /// Puts a lookup in this thread's front table, counting it as a hit
    /// when it found an instantiated kernel.
    #[allow(clippy::too_many_arguments)]
    fn remember(
        &self,
        slot: usize,
        key: u64,
        op: usize,
        dtypes: SmallVec<[DType; 4]>,
        attrs: FrozenOpAttrs,
        kernel: &'static AnyKernel,
        hit: bool,
    ) {
        let remembered = FRONT.try_with(|front| {
            let mut front = front.try_borrow_mut().ok()?;
            let hits = match front.hit_slots.iter().find(|(id, _)| *id == self.id) {
                Some((_, hits)) => hits.clone(),
                None => {
                    let hits = self.hits.slot();
                    front.hit_slots.push((self.id, hits.clone()));
                    hits
                }
            };
            if hit {
                hits.add(1);
            }
            let entry = FrontEntry {
                cache: self.id,
                key,
                op,
                dtypes,
                attrs,
                kernel,
                hits,
            };
            Some(front.entries[slot].replace(entry))
        });
        if !matches!(remembered, Ok(Some(_))) && hit {
            // This thread's table is busy (a lookup from inside a kernel
            // being built) or gone (a thread-local destructor): count the
            // hit in a slot of its own.
            self.hits.slot().add(1);
        }
    }

    /// True when this thread has prepared `op` with these attributes for
    /// arguments of these dtypes and shapes: the next call on ready
    /// arguments skips the metadata function and the kernel lookup (see
    /// [`OpHandler::execute_ready`]).
    pub fn is_prepared(&self, op: &'static OpDef, attrs: &OpAttrs, args: &[TensorHandle]) -> bool {
        let key = prepared_key(op, attrs, args.iter());
        let op_id = op as *const OpDef as usize;
        PREPARED
            .try_with(|table| {
                let table = table.try_borrow().ok()?;
                let prepared = table[key as usize % PREPARED_SLOTS].as_ref()?;
                Some(
                    prepared.matches(self.id, key, op_id, attrs, args.iter())
                        && prepared.kernel.is_some(),
                )
            })
            .ok()
            .flatten()
            .unwrap_or(false)
    }

    /// This thread's slot of the cache's hit counter.
    fn hit_slot(&self) -> CounterSlot {
        let kept = FRONT.try_with(|front| {
            let mut front = front.try_borrow_mut().ok()?;
            if let Some((_, hits)) = front.hit_slots.iter().find(|(id, _)| *id == self.id) {
                return Some(hits.clone());
            }
            let hits = self.hits.slot();
            front.hit_slots.push((self.id, hits.clone()));
            Some(hits)
        });
        kept.ok().flatten().unwrap_or_else(|| self.hits.slot())
    }

    /// Hit and miss counts.
    pub fn stats(&self) -> KernelCacheStats {
        KernelCacheStats {
            hits: self.hits.sum(),
            misses: self.misses.load(Ordering::Relaxed),
            entries: self
                .buckets
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .map(|b| b.len())
                .sum(),
        }
    }
}

/// Slots of a thread's table of prepared ops (a power of two).
const PREPARED_SLOTS: usize = 64;

/// What a thread worked out for an op on inputs of given dtypes and
/// shapes: the metadata function's outputs and the kernel. An eager
/// program runs the same few ops on the same shapes again and again, so
/// the next such call skips the metadata function, the copies of the
/// input metadata and the invocation (the talk's "prepared op").
///
/// The metadata function of a pure op with static shapes depends on its
/// inputs' metadata and attributes alone, so its answer for equal ones
/// can be kept.
struct Prepared {
    cache: u64,
    key: u64,
    op: usize,
    /// `None` for an op without attributes (most elementwise ops).
    attrs: Option<FrozenOpAttrs>,
    inputs: InputMetas,
    outputs: OutputMetas,
    /// `None` when this call takes the full path anyway: a kernel that
    /// takes host values as they are, or outputs without elements (which
    /// [`settle_by_shape`] answers).
    kernel: Option<&'static Kernel>,
    /// This thread's count of the kernel cache's hits.
    hits: CounterSlot,
}

impl Prepared {
    fn matches<'h>(
        &self,
        cache: u64,
        key: u64,
        op: usize,
        attrs: &OpAttrs,
        mut args: impl Iterator<Item = &'h TensorHandle>,
    ) -> bool {
        self.key == key
            && self.op == op
            && self.cache == cache
            && self
                .inputs
                .iter()
                .all(|m| args.next().is_some_and(|a| *m == *a.metadata()))
            && args.next().is_none()
            && match &self.attrs {
                None => attrs.is_empty(),
                Some(kept) => **kept == *attrs,
            }
    }
}

thread_local! {
    /// This thread's prepared ops, direct-mapped by key.
    static PREPARED: RefCell<Vec<Option<Prepared>>> =
        RefCell::new((0..PREPARED_SLOTS).map(|_| None).collect());
}

/// The key of an op on these arguments: the op, its attributes, and each
/// argument's dtype and dims.
fn prepared_key<'h>(
    op: &OpDef,
    attrs: &OpAttrs,
    args: impl Iterator<Item = &'h TensorHandle>,
) -> u64 {
    let mut h = FxHasher::default();
    h.write_usize(op as *const OpDef as usize);
    if !attrs.is_empty() {
        attrs.hash(&mut h);
    }
    for arg in args {
        let meta = arg.metadata();
        let dims = meta.shape.dims();
        h.write_u64(meta.dtype as u64 | (dims.len() as u64) << 8);
        for &d in dims {
            h.write_usize(d);
        }
    }
    h.finish()
}

/// Where a thread's table sent a call.
enum Lookup<'a> {
    /// Ran on the fast path.
    Ran(Results),
    /// Prepared, but for the full path.
    Full(ReadyArgs<'a>),
    /// Not in the table.
    Missed(ReadyArgs<'a>),
}

/// A ready argument's value as a dense kernel input.
fn dense_input(value: HostTensor) -> Result<DenseHostTensor> {
    match value {
        HostTensor::Dense(t) => Ok(t),
        HostTensor::Scalar(t) => t.to_dense(),
        list @ HostTensor::List(_) => list.into_dense(),
    }
}

/// Runs a prepared dense kernel on arguments that are all available.
fn run_prepared(
    op: &'static OpDef,
    device: crate::Device,
    location: Location,
    args: ReadyArgs<'_>,
    attrs: &OpAttrs,
    kernel: &Kernel,
    outputs: &OutputMetas,
) -> Results {
    let raised = |e: Error| {
        let e = failure_error(Failure::Raised(e), op, location);
        outputs
            .iter()
            .map(|m| TensorHandle::error(device, m.clone(), e.clone()))
            .collect()
    };
    let missing = || Error::internal("a ready value went missing");
    let mut dense = Inputs::new();
    match args {
        ReadyArgs::Owned(args) => {
            for arg in args {
                let input = match arg.ready_host() {
                    Some(HostTensor::Dense(_)) => arg.into_ready_dense().ok_or_else(missing),
                    _ => arg.into_value().and_then(dense_input),
                };
                match input {
                    Ok(t) => dense.push(t),
                    Err(e) => return raised(e),
                }
            }
        }
        ReadyArgs::Borrowed(args) => {
            for arg in args {
                let input = match arg.ready_host() {
                    Some(HostTensor::Dense(t)) => Ok(t.clone()),
                    Some(other) => dense_input(other.clone()),
                    None => Err(missing()),
                };
                match input {
                    Ok(t) => dense.push(t),
                    Err(e) => return raised(e),
                }
            }
        }
    }
    count_kernel_launch();
    count_inline_run();
    let ctx = KernelContext {
        attrs: Attrs::new(attrs, op),
        outputs,
    };
    let produced = kernel(dense, &ctx).and_then(|produced| {
        check_produced(op, produced.iter().map(DenseHostTensor::metadata), outputs)?;
        Ok(produced)
    });
    match produced {
        Ok(produced) => produced
            .into_iter()
            .map(|t| TensorHandle::available_value(device, TensorValue::Host(HostTensor::Dense(t))))
            .collect(),
        Err(e) => raised(e),
    }
}

/// Executes ops with the CPU kernels of `stagecraft-cpu`.
pub struct CpuOpHandler {
    name: String,
    cache: Arc<KernelCache>,
}

impl CpuOpHandler {
    /// The handler of CPU device `cpu:index`.
    pub fn new(index: usize) -> CpuOpHandler {
        stagecraft_cpu::warn_if_unoptimized();
        CpuOpHandler {
            name: format!("cpu:{index}"),
            cache: Arc::new(KernelCache {
                device_index: index,
                ..KernelCache::default()
            }),
        }
    }

    /// The handler's kernel cache.
    pub fn kernel_cache(&self) -> &KernelCache {
        &self.cache
    }
}

/// Why a kernel did not produce outputs.
enum Failure {
    /// An input was an error: pass it on, unreported.
    Propagated(Error),
    /// This op failed: tag, report, pass on.
    Raised(Error),
}

fn run_kernel(
    cache: &KernelCache,
    op: &'static OpDef,
    attrs: &OpAttrs,
    args: Args,
    inputs: &InputMetas,
    outputs: &OutputMetas,
) -> std::result::Result<SmallVec<[HostTensor; 1]>, Failure> {
    if is_cancelled() {
        return Err(Failure::Raised(Error::cancelled()));
    }
    for arg in &args {
        if let Err(e) = arg.wait() {
            return Err(Failure::Propagated(e));
        }
    }
    let kernel = cache.lookup(op, attrs, inputs).map_err(Failure::Raised)?;
    let ctx = KernelContext {
        attrs: Attrs::new(attrs, op),
        outputs,
    };
    let kernel = match kernel {
        AnyKernel::Dense(kernel) => kernel,
        AnyKernel::Value(kernel) => {
            let mut values = ValueInputs::new();
            for arg in args {
                values.push(arg.into_value().map_err(Failure::Propagated)?);
            }
            count_kernel_launch();
            let produced = if crate::profile::is_enabled() {
                crate::profile::timed(crate::profile::OP, op.name, || kernel(values, &ctx))
            } else {
                kernel(values, &ctx)
            };
            let produced = produced.map_err(Failure::Raised)?;
            check_produced(op, produced.iter().map(HostTensor::metadata), outputs)
                .map_err(Failure::Raised)?;
            return Ok(produced);
        }
    };
    // A plain loop: collecting through `Result` costs several hundred
    // instructions per op, which matters for tiny tensors.
    let mut dense = Inputs::new();
    for arg in args {
        match arg.into_value() {
            Ok(HostTensor::Dense(t)) => dense.push(t),
            Ok(HostTensor::Scalar(t)) => dense.push(t.to_dense().map_err(Failure::Raised)?),
            Ok(list @ HostTensor::List(_)) => {
                dense.push(list.into_dense().map_err(Failure::Raised)?)
            }
            Err(e) => return Err(Failure::Propagated(e)),
        }
    }
    let inputs = dense;
    if let Some(settled) =
        settle_by_shape(op, inputs.iter().map(DenseHostTensor::metadata), outputs)
            .map_err(Failure::Raised)?
    {
        return Ok(settled.into_iter().map(HostTensor::Dense).collect());
    }
    count_kernel_launch();
    // The profiled call is out of line, so the hot path is one load.
    let produced = if crate::profile::is_enabled() {
        crate::profile::timed(crate::profile::OP, op.name, || kernel(inputs, &ctx))
    } else {
        kernel(inputs, &ctx)
    };
    let produced = produced.map_err(Failure::Raised)?;
    check_produced(op, produced.iter().map(DenseHostTensor::metadata), outputs)
        .map_err(Failure::Raised)?;
    Ok(produced.into_iter().map(HostTensor::Dense).collect())
}

/// Checks a kernel's outputs against what the metadata function promised.
fn check_produced<'a>(
    op: &OpDef,
    produced: impl ExactSizeIterator<Item = &'a TensorMetadata>,
    outputs: &OutputMetas,
) -> Result<()> {
    if produced.len() != outputs.len() {
        return Err(Error::internal(format!(
            "the kernel returned {} outputs, the op has {}",
            produced.len(),
            outputs.len()
        )));
    }
    if op.shape_kind == ShapeKind::Static {
        for (got, want) in produced.zip(outputs.iter()) {
            if got != want {
                return Err(Error::internal(format!(
                    "the kernel produced {got} where the metadata function promised {want}"
                )));
            }
        }
    }
    Ok(())
}

fn failure_error(failure: Failure, op: &OpDef, location: Location) -> Error {
    match failure {
        Failure::Propagated(e) => e,
        Failure::Raised(e) => {
            let e = e.with_op(op.name).at(location);
            report_error(&e);
            e
        }
    }
}

impl OpHandler for CpuOpHandler {
    fn name(&self) -> &str {
        &self.name
    }

    fn runs_inline(&self) -> bool {
        execution_mode() == ExecutionMode::Sync
    }

    fn execute_ready<'a>(
        &self,
        op: &'static OpDef,
        device: crate::Device,
        location: Location,
        args: ReadyArgs<'a>,
        attrs: &OpAttrs,
    ) -> std::result::Result<Results, ReadyArgs<'a>> {
        if op.shape_kind != ShapeKind::Static
            || crate::profile::is_enabled()
            || execution_mode() != ExecutionMode::Sync
            || args
                .iter()
                .any(|a| a.device() != device || a.ready_host().is_none())
        {
            return Err(args);
        }
        let cache = &self.cache;
        let key = prepared_key(op, attrs, args.iter());
        let op_id = op as *const OpDef as usize;
        let slot = key as usize % PREPARED_SLOTS;
        let mut args = Some(args);
        let looked = PREPARED.try_with(|table| {
            let args = args.take().expect("taken once");
            // A shared borrow while the kernel runs: a kernel that runs ops
            // itself still finds the table, and only skips adding to it.
            let Ok(table) = table.try_borrow() else {
                return Lookup::Missed(args);
            };
            match &table[slot] {
                Some(p) if p.matches(cache.id, key, op_id, attrs, args.iter()) => match p.kernel {
                    Some(kernel) => {
                        p.hits.add(1);
                        Lookup::Ran(run_prepared(
                            op, device, location, args, attrs, kernel, &p.outputs,
                        ))
                    }
                    None => Lookup::Full(args),
                },
                _ => Lookup::Missed(args),
            }
        });
        let args = match looked {
            Ok(Lookup::Ran(results)) => return Ok(results),
            Ok(Lookup::Full(args)) => return Err(args),
            Ok(Lookup::Missed(args)) => args,
            Err(_) => return Err(args.take().expect("the table was gone, so never taken")),
        };
        // A miss: what the full path would work out, kept for the next call.
        // A failing metadata function or lookup is the full path's to report.
        let inputs: InputMetas = args.iter().map(|a| a.metadata().clone()).collect();
        let Ok(outputs) = op.infer(&inputs, attrs) else {
            return Err(args);
        };
        let Ok(any) = cache.lookup(op, attrs, &inputs) else {
            return Err(args);
        };
        let all_empty = !outputs.is_empty() && outputs.iter().all(|m| m.shape.numel() == 0);
        let kernel = match any {
            AnyKernel::Dense(kernel) if !all_empty => Some(kernel),
            _ => None,
        };
        let prepared = Prepared {
            cache: cache.id,
            key,
            op: op_id,
            attrs: (!attrs.is_empty()).then(|| attrs.freeze()),
            inputs,
            outputs,
            kernel,
            hits: cache.hit_slot(),
        };
        let ran = match kernel {
            Some(kernel) => Ok(run_prepared(
                op,
                device,
                location,
                args,
                attrs,
                kernel,
                &prepared.outputs,
            )),
            None => Err(args),
        };
        let _ = PREPARED.try_with(|table| {
            if let Ok(mut table) = table.try_borrow_mut() {
                table[slot] = Some(prepared);
            }
        });
        ran
    }

    fn kernel_cache_stats(&self) -> Option<KernelCacheStats> {
        Some(self.cache.stats())
    }

    fn host_kernels(&self) -> Option<&KernelCache> {
        Some(&self.cache)
    }

    fn execute(&self, inv: OpInvocation<'_>) -> Results {
        match execution_mode() {
            ExecutionMode::Sync => execute_now(&self.cache, inv),
            ExecutionMode::Async => enqueue(self.cache.clone(), inv),
        }
    }
}

fn execute_now(cache: &KernelCache, inv: OpInvocation<'_>) -> Results {
    let OpInvocation {
        op,
        device,
        location,
        args,
        inputs,
        attrs,
        outputs,
        chain,
    } = inv;
    if let Some((after, _)) = &chain {
        let _ = after.wait();
    }
    let result = run_kernel(cache, op, &attrs, args, &inputs, &outputs);
    if let Some((_, done)) = chain {
        done.set(Ok(()));
    }
    match result {
        Ok(produced) => produced
            .into_iter()
            .map(|t| TensorHandle::available(device, t))
            .collect(),
        Err(failure) => {
            let e = failure_error(failure, op, location);
            outputs
                .into_iter()
                .map(|m| TensorHandle::error(device, m, e.clone()))
                .collect()
        }
    }
}

fn enqueue(cache: Arc<KernelCache>, inv: OpInvocation<'_>) -> Results {
    let OpInvocation {
        op,
        device,
        location,
        args,
        inputs,
        attrs,
        outputs,
        chain,
    } = inv;
    let meta_state = match op.shape_kind {
        ShapeKind::Static => MetadataState::Known,
        ShapeKind::DataDependent => MetadataState::Deferred,
    };
    let results: Results = outputs
        .iter()
        .map(|m| TensorHandle::pending(device, m.clone(), meta_state))
        .collect();
    let task = Task {
        cache,
        op,
        location,
        attrs: attrs.freeze(),
        args,
        inputs,
        outputs,
        results: results.clone(),
        done: chain.as_ref().map(|(_, done)| done.clone()),
    };
    let waits: SmallVec<[TensorHandle; 4]> = task
        .args
        .iter()
        .filter(|a| !a.is_resolved())
        .cloned()
        .collect();
    let after = chain.map(|(after, _)| after).filter(|c| !c.is_resolved());
    let remaining = waits.len() + after.is_some() as usize;
    if remaining == 0 {
        rayon::spawn(move || task.run());
        return results;
    }
    // The last input to resolve launches the kernel; nothing blocks.
    let countdown = Arc::new(AtomicUsize::new(remaining));
    let task = Arc::new(std::sync::Mutex::new(Some(task)));
    let arm = move || {
        let countdown = countdown.clone();
        let task = task.clone();
        move || {
            if countdown.fetch_sub(1, Ordering::AcqRel) == 1 {
                if let Some(task) = task.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    rayon::spawn(move || task.run());
                }
            }
        }
    };
    for handle in waits {
        handle.and_then(arm());
    }
    if let Some(after) = after {
        after.and_then(arm());
    }
    results
}

struct Task {
    cache: Arc<KernelCache>,
    op: &'static OpDef,
    location: Location,
    attrs: FrozenOpAttrs,
    args: Args,
    inputs: InputMetas,
    outputs: OutputMetas,
    results: Results,
    done: Option<crate::async_value::Chain>,
}

impl Task {
    fn run(self) {
        let Task {
            cache,
            op,
            location,
            attrs,
            args,
            inputs,
            outputs,
            results,
            done,
        } = self;
        match run_kernel(&cache, op, &attrs, args, &inputs, &outputs) {
            Ok(produced) => {
                for (handle, value) in results.iter().zip(produced) {
                    handle.resolve(Ok(value));
                }
            }
            Err(failure) => {
                let e = failure_error(failure, op, location);
                for handle in &results {
                    handle.resolve(Err(e.clone()));
                }
            }
        }
        if let Some(done) = done {
            done.set(Ok(()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_tensor::Shape;

    fn f32_vector() -> [TensorMetadata; 2] {
        let meta = TensorMetadata::new(DType::F32, Shape::from(vec![4]));
        [meta.clone(), meta]
    }

    #[test]
    fn lookups_from_every_thread_share_one_kernel_and_count_each_hit() {
        let cache = KernelCache::default();
        let attrs = OpAttrs::new();
        let inputs = f32_vector();
        let first = cache.lookup(&stagecraft_ops::ADD, &attrs, &inputs).unwrap();
        std::thread::scope(|scope| {
            for _ in 0..3 {
                scope.spawn(|| {
                    for _ in 0..10 {
                        let k = cache.lookup(&stagecraft_ops::ADD, &attrs, &inputs).unwrap();
                        assert!(std::ptr::eq(k, first));
                    }
                });
            }
        });
        let stats = cache.stats();
        assert_eq!((stats.misses, stats.hits, stats.entries), (1, 30, 1));
    }

    #[test]
    fn a_prepared_op_matches_only_its_cache_op_attributes_dtypes_and_shapes() {
        let handle = |dtype, dims: &[usize]| {
            let meta = TensorMetadata::new(dtype, Shape::from(dims.to_vec()));
            let value = HostTensor::Dense(DenseHostTensor::zeros(meta).unwrap());
            TensorHandle::available(crate::Device::cpu(), value)
        };
        let cache = KernelCache::default();
        let add = &stagecraft_ops::ADD as *const OpDef as usize;
        let none = OpAttrs::new();
        let mut axis = OpAttrs::new();
        axis.set_int("axis", 1);
        let args = [handle(DType::F32, &[4]), handle(DType::F32, &[4])];
        let key = prepared_key(&stagecraft_ops::ADD, &none, args.iter());
        let prepared = |attrs: Option<FrozenOpAttrs>| Prepared {
            cache: cache.id,
            key,
            op: add,
            attrs,
            inputs: args.iter().map(|a| a.metadata().clone()).collect(),
            outputs: smallvec::smallvec![args[0].metadata().clone()],
            kernel: None,
            hits: cache.hit_slot(),
        };
        let plain = prepared(None);
        assert!(plain.matches(cache.id, key, add, &none, args.iter()));
        // Each difference is a miss, even under the same key (a collision).
        let other_dims = [args[0].clone(), handle(DType::F32, &[2, 2])];
        let other_dtype = [args[0].clone(), handle(DType::I32, &[4])];
        let fewer = [args[0].clone()];
        let more = [args[0].clone(), args[1].clone(), args[1].clone()];
        for other in [&other_dims[..], &other_dtype, &fewer, &more] {
            assert!(!plain.matches(cache.id, key, add, &none, other.iter()));
        }
        assert!(!plain.matches(cache.id, key, add, &axis, args.iter()));
        assert!(!plain.matches(cache.id ^ 1, key, add, &none, args.iter()));
        assert!(!plain.matches(cache.id, key ^ 1, add, &none, args.iter()));
        let sub = &stagecraft_ops::SUB as *const OpDef as usize;
        assert!(!plain.matches(cache.id, key, sub, &none, args.iter()));
        let with_axis = prepared(Some(axis.freeze()));
        assert!(with_axis.matches(cache.id, key, add, &axis, args.iter()));
        assert!(!with_axis.matches(cache.id, key, add, &none, args.iter()));
    }

    #[test]
    fn a_front_entry_of_one_cache_is_never_another_caches_hit() {
        let (one, two) = (KernelCache::default(), KernelCache::default());
        let attrs = OpAttrs::new();
        let inputs = f32_vector();
        let a = one.lookup(&stagecraft_ops::ADD, &attrs, &inputs).unwrap();
        let b = two.lookup(&stagecraft_ops::ADD, &attrs, &inputs).unwrap();
        assert!(!std::ptr::eq(a, b));
        assert_eq!(two.stats().misses, 1);
        // Other dtypes are another kernel, even in the same front slot.
        let ints = [
            TensorMetadata::new(DType::I32, Shape::from(vec![4])),
            TensorMetadata::new(DType::I32, Shape::from(vec![4])),
        ];
        let c = one.lookup(&stagecraft_ops::ADD, &attrs, &ints).unwrap();
        assert!(!std::ptr::eq(a, c));
        assert_eq!(one.stats().misses, 2);
        assert!(std::ptr::eq(
            one.lookup(&stagecraft_ops::ADD, &attrs, &inputs).unwrap(),
            a
        ));
    }
}
