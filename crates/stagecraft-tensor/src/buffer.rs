//! Aligned, reference-counted byte buffers that hold tensor values.

use crate::{DType, Element, Error, Location, Result};
use std::alloc::{self, Layout};
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Buffers of at least [`LARGE_BUFFER`] bytes start on a 64-byte boundary: a
/// cache line, and the widest SIMD load (AVX-512).
pub const BUFFER_ALIGN: usize = 64;

/// Smaller buffers are aligned to 16 bytes (enough for every element type):
/// over-aligned allocation costs glibc several hundred instructions, which
/// dominated the dispatch of tiny ops, while SIMD loops over a few elements
/// gain nothing from it.
pub const LARGE_BUFFER: usize = 4096;

const SMALL_ALIGN: usize = 16;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED_BYTES: AtomicU64 = AtomicU64::new(0);
/// See `Buffer::set_memory_limit`; `u64::MAX` when unset.
static MEMORY_LIMIT: AtomicU64 = AtomicU64::new(u64::MAX);

/// One block of memory. Every byte of it is initialised, for the block's
/// whole life in a buffer, the pools and arenas: blocks come from
/// `alloc_zeroed`, and buffers are written only with whole element values
/// (no padding) or copies of initialised bytes. That is what lets
/// [`Buffer::for_overwrite`] hand out a reused block without clearing it.
struct RawBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// The arena this block came from and goes back to; `None` for blocks
    /// of the shared pool or the system.
    home: Option<Arc<Arena>>,
}

// SAFETY: RawBuffer owns its allocation exclusively; shared access goes
// through `&Buffer` (read-only) and mutation needs a unique `Arc`, so moving
// or sharing it between threads is sound.
unsafe impl Send for RawBuffer {}
// SAFETY: see `Send`; `&RawBuffer` only gives read access.
unsafe impl Sync for RawBuffer {}

impl Drop for RawBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        pool::LIVE_BYTES.fetch_sub(self.len as u64, Ordering::Relaxed);
        if let Some(home) = self.home.take() {
            if home.give_back(self.ptr, self.len) {
                return;
            }
        }
        if !pool::give_back(self.ptr, self.len) {
            // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this
            // layout (in `Buffer::zeroed` or the pool) and is freed only
            // here, once: the pool declined to keep it.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout(self.len)) }
        }
    }
}

/// A cache of freed large allocations, keyed by exact byte length.
///
/// A fresh multi-megabyte allocation comes from the OS as new pages, and
/// touching them costs page faults and zeroing that can exceed the cost of
/// the kernel writing them (a 64 MiB elementwise result: ~5 ms of faults for
/// ~3 ms of work). Training steps allocate the same sizes every step, so
/// handing freed blocks back to the next request of the same size removes
/// that cost.
mod pool {
    use super::layout;
    use std::collections::HashMap;
    use std::ptr::NonNull;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    /// Blocks of at least this many bytes go to the shared pool; smaller
    /// ones to a per-thread cache.
    pub(super) const MIN_POOLED: usize = super::SMALL_BLOCK;
    /// The pool holds at most this many bytes; beyond it freed blocks go
    /// back to the OS.
    pub(super) const MAX_CACHED: usize = 1 << 30;

    pub(super) struct Block(pub(super) NonNull<u8>);
    // SAFETY: a pooled block is owned by the pool alone; nothing else holds
    // its pointer, so it may move between threads.
    unsafe impl Send for Block {}

    #[derive(Default)]
    struct Pool {
        free: HashMap<usize, Vec<Block>>,
        cached: usize,
    }

    static POOL: Mutex<Option<Pool>> = Mutex::new(None);
    pub(super) static HITS: AtomicU64 = AtomicU64::new(0);
    pub(super) static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);
    pub(super) static PEAK_BYTES: AtomicU64 = AtomicU64::new(0);

    /// Takes a cached block of exactly `len` bytes (its contents are stale).
    pub(super) fn take(len: usize) -> Option<NonNull<u8>> {
        let local = if len < MIN_POOLED {
            local::take(len)
        } else {
            None
        };
        let found = local.or_else(|| {
            let mut guard = POOL.lock().unwrap_or_else(|p| p.into_inner());
            let pool = guard.get_or_insert_with(Pool::default);
            let block = pool.free.get_mut(&len).and_then(Vec::pop);
            if block.is_some() {
                pool.cached -= len;
            }
            block.map(|b| b.0)
        });
        if found.is_some() {
            HITS.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// Keeps the last reference to a buffer under `KEPT_WHOLE` bytes (of
    /// no arena) for the next request of its size on this thread; one the
    /// cache has no room for is dropped, which frees its block as usual.
    pub(super) fn stash(buffer: std::sync::Arc<super::RawBuffer>) {
        let len = buffer.len;
        if let Err(buffer) = local::stash(buffer) {
            drop(buffer);
            return;
        }
        LIVE_BYTES.fetch_sub(len as u64, Ordering::Relaxed);
    }

    /// A buffer this thread dropped, of exactly `len` bytes (under
    /// `KEPT_WHOLE`; stale contents), unique.
    pub(super) fn take_whole(len: usize) -> Option<std::sync::Arc<super::RawBuffer>> {
        let found = local::take_whole(len);
        if found.is_some() {
            HITS.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// Offers a freed block to the pool; false when the caller must free it.
    /// Small blocks go to this thread's cache first; what it cannot keep
    /// spills to the shared pool, so a block freed on one thread (the
    /// caller) reaches the thread that allocates that size (a worker).
    pub(super) fn give_back(ptr: NonNull<u8>, len: usize) -> bool {
        if len < MIN_POOLED && local::give_back(ptr, len) {
            return true;
        }
        let mut guard = POOL.lock().unwrap_or_else(|p| p.into_inner());
        let pool = guard.get_or_insert_with(Pool::default);
        if pool.cached + len > MAX_CACHED {
            return false;
        }
        pool.cached += len;
        pool.free.entry(len).or_default().push(Block(ptr));
        true
    }

    /// Small blocks are cached per thread, without a lock: a training step
    /// frees and requests the same small sizes (biases, scalars, per-row
    /// statistics) every time, and the global allocator's lock-free fast
    /// path is about as costly as this lookup.
    pub(super) mod local {
        use super::super::{layout, RawBuffer};
        use super::Block;
        use std::cell::RefCell;
        use std::collections::HashMap;
        use std::hash::{BuildHasherDefault, Hasher};
        use std::ptr::NonNull;
        use std::sync::Arc;

        /// At most this many bytes per thread, and this many blocks per size
        /// (few, so that blocks freed here keep flowing to other threads
        /// through the shared pool).
        const MAX_BYTES: usize = 16 << 20;
        const MAX_PER_SIZE: usize = 8;

        /// Block lengths are already well spread; hashing them is wasted work.
        #[derive(Default)]
        struct LenHasher(u64);

        impl Hasher for LenHasher {
            fn write(&mut self, bytes: &[u8]) {
                for b in bytes {
                    self.0 = (self.0 << 8) | *b as u64;
                }
            }
            fn write_usize(&mut self, v: usize) {
                self.0 = (v as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            }
            fn finish(&self) -> u64 {
                self.0
            }
        }

        #[derive(Default)]
        struct Cache {
            free: HashMap<usize, Vec<Block>, BuildHasherDefault<LenHasher>>,
            /// Small buffers kept whole (see `Buffer`'s `Drop`): each is
            /// the last reference to its block.
            whole: HashMap<usize, Vec<Arc<RawBuffer>>, BuildHasherDefault<LenHasher>>,
            bytes: usize,
        }

        impl Drop for Cache {
            fn drop(&mut self) {
                for (len, buffers) in self.whole.drain() {
                    for buffer in buffers {
                        // Freed here rather than by the block's own `Drop`,
                        // which would offer it to this cache again (and
                        // count it live bytes that a kept buffer no longer
                        // counts).
                        let Some(raw) = Arc::into_inner(buffer) else {
                            continue;
                        };
                        let raw = std::mem::ManuallyDrop::new(raw);
                        // SAFETY: a kept buffer is the last reference to a
                        // block allocated with `layout(len)` (kept blocks
                        // have no arena); the `RawBuffer` that owned it is
                        // forgotten, so the block is freed once, here.
                        unsafe { std::alloc::dealloc(raw.ptr.as_ptr(), layout(len)) }
                    }
                }
                for (len, blocks) in self.free.drain() {
                    for block in blocks {
                        // SAFETY: cached blocks were allocated with
                        // `layout(len)` and are owned by this cache alone.
                        unsafe { std::alloc::dealloc(block.0.as_ptr(), layout(len)) }
                    }
                }
            }
        }

        thread_local! {
            static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
        }

        pub(super) fn take(len: usize) -> Option<NonNull<u8>> {
            CACHE
                .try_with(|c| {
                    let mut c = c.borrow_mut();
                    let block = c.free.get_mut(&len).and_then(Vec::pop)?;
                    c.bytes -= len;
                    Some(block.0)
                })
                .ok()
                .flatten()
        }

        pub(super) fn give_back(ptr: NonNull<u8>, len: usize) -> bool {
            CACHE
                .try_with(|c| {
                    let mut c = c.borrow_mut();
                    if c.bytes + len > MAX_BYTES {
                        return false;
                    }
                    let slot = c.free.entry(len).or_default();
                    if slot.len() >= MAX_PER_SIZE {
                        return false;
                    }
                    slot.push(Block(ptr));
                    c.bytes += len;
                    true
                })
                .unwrap_or(false)
        }

        pub(super) fn stash(buffer: Arc<RawBuffer>) -> Result<(), Arc<RawBuffer>> {
            let len = buffer.len;
            let mut buffer = Some(buffer);
            let _ = CACHE.try_with(|c| {
                let Ok(mut c) = c.try_borrow_mut() else {
                    return;
                };
                if c.bytes + len > MAX_BYTES {
                    return;
                }
                let slot = c.whole.entry(len).or_default();
                if slot.len() >= MAX_PER_SIZE {
                    return;
                }
                slot.push(buffer.take().expect("kept once"));
                c.bytes += len;
            });
            match buffer {
                None => Ok(()),
                Some(buffer) => Err(buffer),
            }
        }

        pub(in crate::buffer) fn take_whole(len: usize) -> Option<Arc<RawBuffer>> {
            CACHE
                .try_with(|c| {
                    let mut c = c.try_borrow_mut().ok()?;
                    let buffer = c.whole.get_mut(&len).and_then(Vec::pop)?;
                    c.bytes -= len;
                    Some(buffer)
                })
                .ok()
                .flatten()
        }

        /// How many buffers of `len` bytes this thread keeps whole.
        #[cfg(test)]
        pub(in crate::buffer) fn kept_whole(len: usize) -> usize {
            CACHE.with(|c| c.borrow().whole.get(&len).map_or(0, Vec::len))
        }

        pub(in crate::buffer) fn cached_bytes() -> usize {
            CACHE.try_with(|c| c.borrow().bytes).unwrap_or(0)
        }

        pub(super) fn trim() {
            // Dropped outside the borrow: freeing may call back into the
            // cache.
            let old = CACHE.try_with(|c| std::mem::take(&mut *c.borrow_mut()));
            drop(old);
        }
    }

    /// Frees every cached block (the shared pool's and this thread's).
    pub(super) fn trim() {
        local::trim();
        let mut guard = POOL.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pool) = guard.as_mut() {
            for (len, blocks) in pool.free.drain() {
                for block in blocks {
                    // SAFETY: pooled blocks were allocated with `layout(len)`
                    // and are owned by the pool alone.
                    unsafe { std::alloc::dealloc(block.0.as_ptr(), layout(len)) }
                }
            }
            pool.cached = 0;
        }
    }

    /// Bytes cached in the shared pool plus this thread's small-block cache.
    pub(super) fn cached_bytes() -> usize {
        let guard = POOL.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().map_or(0, |p| p.cached) + local::cached_bytes()
    }

    pub(super) fn note_live(len: usize) {
        let live = LIVE_BYTES.fetch_add(len as u64, Ordering::Relaxed) + len as u64;
        // A load first: `fetch_max` is a compare-and-swap loop on x86-64,
        // and in a steady state the peak is rarely passed.
        if live > PEAK_BYTES.load(Ordering::Relaxed) {
            PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
        }
    }
}

/// Allocation statistics of host buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BufferStats {
    /// Fresh allocations from the system (pool hits excluded).
    pub allocations: u64,
    /// Bytes of those allocations.
    pub allocated_bytes: u64,
    /// Requests served from the pool of freed large blocks.
    pub pool_hits: u64,
    /// Bytes held by live buffers now.
    pub live_bytes: u64,
    /// The most bytes live at once so far.
    pub peak_bytes: u64,
    /// Bytes of freed blocks the pool keeps for reuse.
    pub cached_bytes: u64,
}

fn align_for(len: usize) -> usize {
    if len >= LARGE_BUFFER {
        BUFFER_ALIGN
    } else {
        SMALL_ALIGN
    }
}

/// The layout of a block that was allocated, so its size is valid.
fn layout(len: usize) -> Layout {
    Layout::from_size_align(len, align_for(len)).expect("an allocated block has a valid layout")
}

/// What the infallible constructors do when memory runs out: what `Vec`
/// does.
fn out_of_memory(len: usize) -> ! {
    match Layout::from_size_align(len, align_for(len)) {
        Ok(layout) => alloc::handle_alloc_error(layout),
        Err(_) => panic!("a buffer of {len} bytes exceeds isize::MAX"),
    }
}

/// A zero-initialised, aligned byte buffer (64 bytes for large buffers, 16
/// for small ones) shared by reference counting. Cloning is cheap; writing
/// needs the only reference.
///
/// A buffer of under [`KEPT_WHOLE`] bytes (and of no arena) whose last
/// reference is dropped waits whole, block and reference count together,
/// in a cache of the dropping thread, and the next request of its size on
/// that thread takes it back: an eager op on small tensors allocates no
/// memory for its output.
#[derive(Clone)]
pub struct Buffer(ManuallyDrop<Arc<RawBuffer>>);

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: the field is taken here, once, and never used again: the
        // buffer is being dropped.
        let raw = unsafe { ManuallyDrop::take(&mut self.0) };
        let kept = raw.len > 0 && raw.len < KEPT_WHOLE && raw.home.is_none();
        // The last reference: no other thread can be reading the block,
        // or take a new reference (buffers make no weak ones). A load, where
        // `Arc::get_mut` would cost a locked compare-and-swap per drop.
        if kept && Arc::strong_count(&raw) == 1 {
            // What other threads did with the block before dropping their
            // references happens before it is reused (as `Arc`'s own drop
            // orders it before freeing).
            std::sync::atomic::fence(Ordering::Acquire);
            pool::stash(raw);
        }
    }
}

/// Buffers of fewer bytes than this are small: a freed one waits in a
/// cache of the thread that freed it, taken back without a lock. The
/// buffer plan of a function whose steps run in order leaves them out of
/// its [`Arena`]: the arena's lock and lookups cost more than a small
/// kernel.
pub const SMALL_BLOCK: usize = 4096;

/// Buffers of fewer bytes than this, and of no arena, are kept whole by
/// the thread that drops the last reference, for its next request of the
/// same size (at most 8 per size, 16 MiB in all; the rest go to the
/// shared pool). Above [`SMALL_BLOCK`] too: from the shared pool, a 4 KiB
/// buffer cost 54 ns to take and give back (its lock, its map, a fresh
/// reference count), 17 from this cache (as from the allocator), and a
/// 4 KiB all-reduce takes three.
const KEPT_WHOLE: usize = 64 << 10;

impl Buffer {
    /// A buffer of `len` zero bytes.
    ///
    /// Zeroing is nearly free: small blocks are cleared in cache, and large
    /// ones come from the OS as zero pages. Aborts, like `Vec`, when the
    /// system has no memory for it; [`Buffer::try_zeroed`] reports that.
    pub fn zeroed(len: usize) -> Buffer {
        Buffer::try_zeroed(len).unwrap_or_else(|| out_of_memory(len))
    }

    /// [`Buffer::zeroed`], or `None` when the memory cannot be had (more
    /// than `isize::MAX` bytes, or more than the system will give).
    pub fn try_zeroed(len: usize) -> Option<Buffer> {
        let (mut buffer, reused) = Buffer::allocate(len)?;
        if reused {
            let raw = Arc::get_mut(&mut buffer.0).expect("a fresh buffer is unique");
            // SAFETY: unique, valid for `len` bytes; a pooled block holds
            // stale bytes, so clear it (fresh blocks are already zero).
            unsafe { std::ptr::write_bytes(raw.ptr.as_ptr(), 0, raw.len) };
        }
        Some(buffer)
    }

    /// A buffer of `len` initialised bytes whose values are unspecified
    /// (zero, or what a freed buffer of the same size held), for a kernel
    /// that overwrites every element.
    ///
    /// Safe for every element type: the bytes are initialised (see
    /// `RawBuffer`), every element type but `bool` is valid for any bytes,
    /// and [`Buffer::typed`] checks that bytes read as `bool` are 0 or 1.
    /// A bool result should still start from [`Buffer::zeroed`], which
    /// passes that check.
    pub fn for_overwrite(len: usize) -> Buffer {
        Buffer::try_for_overwrite(len).unwrap_or_else(|| out_of_memory(len))
    }

    /// [`Buffer::for_overwrite`], or `None` when the memory cannot be had.
    pub fn try_for_overwrite(len: usize) -> Option<Buffer> {
        Buffer::allocate(len).map(|(buffer, _)| buffer)
    }

    /// A buffer of `len` bytes, and whether it is a reused pooled block
    /// (stale contents) rather than fresh zeroed memory; `None` when the
    /// system has no memory for it.
    fn allocate(len: usize) -> Option<(Buffer, bool)> {
        if len > 0 {
            let live = pool::LIVE_BYTES.load(Ordering::Relaxed);
            if live.saturating_add(len as u64) > MEMORY_LIMIT.load(Ordering::Relaxed) {
                return None;
            }
            if let Some(arena) = Arena::current_for(len) {
                // Beyond its plan (a buffer the plan does not cover), the
                // arena's surplus blocks went to the pools when they came
                // home to a full arena: take them back from there.
                let (ptr, reused) = match arena.take(len).or_else(|| pool::take(len)) {
                    Some(ptr) => (ptr, true),
                    None => (Buffer::system_block(len)?, false),
                };
                pool::note_live(len);
                let raw = RawBuffer {
                    ptr,
                    len,
                    home: Some(arena),
                };
                return Some((Buffer(ManuallyDrop::new(Arc::new(raw))), reused));
            }
        }
        if len > 0 && len < KEPT_WHOLE {
            if let Some(whole) = pool::take_whole(len) {
                pool::note_live(len);
                return Some((Buffer(ManuallyDrop::new(whole)), true));
            }
        }
        let (ptr, reused) = if len == 0 {
            // A dangling but aligned pointer: zero-length slices need no
            // memory. Made without provenance rather than cast from an
            // integer, which would make Miri treat pointers permissively.
            let dangling = std::ptr::without_provenance_mut::<u8>(SMALL_ALIGN);
            (NonNull::new(dangling).expect("non-null constant"), false)
        } else if let Some(ptr) = pool::take(len) {
            (ptr, true)
        } else {
            (Buffer::system_block(len)?, false)
        };
        if len > 0 {
            pool::note_live(len);
        }
        let raw = RawBuffer {
            ptr,
            len,
            home: None,
        };
        Some((Buffer(ManuallyDrop::new(Arc::new(raw))), reused))
    }

    /// A fresh zeroed block of `len > 0` bytes from the system, counted in
    /// the statistics; `None` when the system refuses.
    fn system_block(len: usize) -> Option<NonNull<u8>> {
        if len as u64 > MEMORY_LIMIT.load(Ordering::Relaxed) {
            return None;
        }
        let layout = Layout::from_size_align(len, align_for(len)).ok()?;
        // SAFETY: the layout has a non-zero size.
        let block = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })?;
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        #[cfg(test)]
        tests::ALLOCATIONS_HERE.with(|n| n.set(n.get() + 1));
        ALLOCATED_BYTES.fetch_add(len as u64, Ordering::Relaxed);
        Some(block)
    }

    /// Allocation statistics so far.
    pub fn stats() -> BufferStats {
        BufferStats {
            allocations: ALLOCATIONS.load(Ordering::Relaxed),
            allocated_bytes: ALLOCATED_BYTES.load(Ordering::Relaxed),
            pool_hits: pool::HITS.load(Ordering::Relaxed),
            live_bytes: pool::LIVE_BYTES.load(Ordering::Relaxed),
            peak_bytes: pool::PEAK_BYTES.load(Ordering::Relaxed),
            cached_bytes: pool::cached_bytes() as u64,
        }
    }

    /// Returns every cached free block to the system.
    pub fn trim_pool() {
        pool::trim()
    }

    /// A buffer holding a copy of `values`.
    pub fn from_slice<T: Element>(values: &[T]) -> Buffer {
        let len = std::mem::size_of_val(values);
        let mut buffer = Buffer::for_overwrite(len);
        let raw = Arc::get_mut(&mut buffer.0).expect("a fresh buffer is unique");
        // SAFETY: the fresh allocation is valid for `len` bytes, unique, and
        // cannot overlap `values`; copying bytes (not creating a typed slice
        // over stale bytes first) keeps bool buffers valid.
        unsafe {
            std::ptr::copy_nonoverlapping(values.as_ptr() as *const u8, raw.ptr.as_ptr(), len)
        };
        buffer
    }

    /// A new buffer holding a copy of `bytes` (keeps the 64-byte alignment
    /// that a `Vec<u8>` would not).
    pub fn copy_of(bytes: &[u8]) -> Buffer {
        let mut buffer = Buffer::for_overwrite(bytes.len());
        let raw = Arc::get_mut(&mut buffer.0).expect("a fresh buffer is unique");
        // SAFETY: the fresh allocation is valid for `len` bytes, unique, and
        // cannot overlap `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), raw.ptr.as_ptr(), bytes.len()) };
        buffer
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// True when this is the only reference, so the buffer may be written in
    /// place.
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.0) == 1
    }

    /// True when both refer to the same memory.
    pub fn ptr_eq(&self, other: &Buffer) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised (zeroed or written)
        // bytes for as long as the `Arc` lives, and no `&mut` exists while
        // `&self` is borrowed (mutation needs a unique Arc and `&mut self`).
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr(), self.0.len) }
    }

    /// The values as a slice of `T`.
    ///
    /// Fails when the length is not a multiple of `size_of::<T>()`, or, for
    /// `bool`, when a byte is neither 0 nor 1 (bytes from
    /// [`Buffer::copy_of`], a reused [`Buffer::for_overwrite`] block or
    /// another type's values): reading such a byte as a `bool` would be
    /// undefined behaviour. Every other element type is valid for any
    /// bytes, so for them this is only the length check.
    #[track_caller]
    pub fn typed<T: Element>(&self) -> Result<&[T]> {
        let location = Location::caller();
        check_element_bytes::<T>(self.bytes()).map_err(|e| e.at(location))?;
        // SAFETY: just checked: whole elements, each a valid `T`.
        Ok(unsafe { self.typed_unchecked() })
    }

    /// [`Buffer::typed`] without the checks, for host tensors, whose
    /// constructors check their bytes once.
    ///
    /// # Safety
    /// The length is a multiple of `size_of::<T>()` and every element's
    /// bytes are a valid `T` (for `bool`: each byte is 0 or 1).
    pub(crate) unsafe fn typed_unchecked<T: Element>(&self) -> &[T] {
        let size = std::mem::size_of::<T>();
        debug_assert!(self.0.len.is_multiple_of(size), "a partial element");
        // SAFETY: the pointer is at least 16-byte aligned (enough for every
        // `Element`, see its contract), valid for `len` initialised bytes
        // while `&self` keeps the `Arc` alive, and never written while a
        // `&self` borrow exists (writes need `&mut self` and a unique `Arc`);
        // the caller promises whole, valid elements.
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr() as *const T, self.0.len / size) }
    }

    /// The values as a mutable slice of `T`, if this is the only reference;
    /// fails like [`Buffer::typed`] on bytes that are not valid `T`s (a
    /// `&mut [bool]` can be read too).
    #[track_caller]
    pub fn typed_mut<T: Element>(&mut self) -> Result<&mut [T]> {
        let location = Location::caller();
        check_element_bytes::<T>(self.bytes()).map_err(|e| e.at(location))?;
        // SAFETY: just checked: whole elements, each a valid `T`.
        unsafe { self.typed_mut_unchecked() }
            .ok_or_else(|| Error::internal("cannot write to a shared buffer").at(location))
    }

    /// [`Buffer::typed_mut`] without the byte checks (the uniqueness check
    /// stays: it is what makes the slice exclusive); `None` when shared.
    ///
    /// # Safety
    /// As for [`Buffer::typed_unchecked`].
    pub(crate) unsafe fn typed_mut_unchecked<T: Element>(&mut self) -> Option<&mut [T]> {
        let size = std::mem::size_of::<T>();
        debug_assert!(self.0.len.is_multiple_of(size), "a partial element");
        let raw = Arc::get_mut(&mut self.0)?;
        // SAFETY: unique access (`Arc::get_mut` succeeded and we hold
        // `&mut self`); alignment and initialisation as in
        // `typed_unchecked`; the caller promises whole, valid elements, and
        // every value written through the slice is a valid `T`.
        Some(unsafe { std::slice::from_raw_parts_mut(raw.ptr.as_ptr() as *mut T, raw.len / size) })
    }

    /// Caps the bytes of live host buffers (`None`: no cap but the
    /// system's). An allocation that would pass the cap fails as if the
    /// system had no memory: the op asking for it reports a tensor that
    /// does not fit. For sharing a machine, and for fuzzing, where a
    /// program may ask for tensors of tens of gigabytes. Checked at each
    /// allocation, so threads allocating at once may pass it by the sizes
    /// of their requests.
    pub fn set_memory_limit(bytes: Option<u64>) {
        MEMORY_LIMIT.store(bytes.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// The cap [`Buffer::set_memory_limit`] set, if any.
    pub fn memory_limit() -> Option<u64> {
        Some(MEMORY_LIMIT.load(Ordering::Relaxed)).filter(|&b| b != u64::MAX)
    }

    /// Buffers allocated by this process so far (zero-length ones excluded).
    pub fn allocation_count() -> u64 {
        ALLOCATIONS.load(Ordering::Relaxed)
    }

    /// Bytes allocated by this process so far.
    pub fn allocated_bytes() -> u64 {
        ALLOCATED_BYTES.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} bytes)", self.len())
    }
}

/// A private stock of blocks for one run of a graph executable, sized by
/// the executable's buffer plan.
///
/// The shared pool serves whichever request comes first, so how many blocks
/// of a size a run needs depends on the order its steps happened to run in;
/// under the parallel executor a rare order needs one block more than any
/// run before it, and that step allocates. An executable instead knows, from
/// its graph, an upper bound on the blocks of each size live at once in
/// *any* order (its buffer plan). A run enters an arena holding that many
/// blocks; every buffer of a planned size allocated on a thread inside
/// [`Arena::enter`] comes from it, and goes back to it when dropped, even
/// on another thread or long after the run (a result the caller kept). So
/// once the arena is filled, runs allocate nothing, whatever the order.
pub struct Arena {
    free: std::sync::Mutex<std::collections::HashMap<usize, Vec<pool::Block>>>,
    /// Planned blocks per size: the arena keeps at most this many of a size
    /// and serves only these sizes.
    planned: std::collections::HashMap<usize, usize>,
}

thread_local! {
    /// The arena of the run this thread works for, if any.
    static CURRENT_ARENA: std::cell::RefCell<Option<Arc<Arena>>> = const { std::cell::RefCell::new(None) };
}

impl Arena {
    /// An arena holding `count` blocks of `bytes` for each `(bytes, count)`
    /// of the plan, taken from the shared pool where it has them and from
    /// the system otherwise (a one-time cost, before the first run).
    pub fn new(plan: &[(usize, usize)]) -> Arc<Arena> {
        let mut planned = std::collections::HashMap::new();
        for &(bytes, count) in plan {
            if bytes > 0 && count > 0 {
                *planned.entry(bytes).or_insert(0) += count;
            }
        }
        let mut free = std::collections::HashMap::new();
        for (&bytes, &count) in &planned {
            // A block the system will not give now is left out: the run
            // asks again when a kernel needs it, and that kernel reports
            // the tensor that does not fit.
            let blocks: Vec<pool::Block> = (0..count)
                .map_while(|_| pool::take(bytes).or_else(|| Buffer::system_block(bytes)))
                .map(pool::Block)
                .collect();
            free.insert(bytes, blocks);
        }
        Arc::new(Arena {
            free: std::sync::Mutex::new(free),
            planned,
        })
    }

    /// Bytes this arena holds when every planned block is home.
    pub fn planned_bytes(&self) -> usize {
        self.planned.iter().fold(0, |sum, (bytes, count)| {
            sum.saturating_add(bytes.saturating_mul(*count))
        })
    }

    /// Runs `f` with buffers of planned sizes allocated on this thread
    /// coming from this arena. Arenas nest (a nested function's run enters
    /// its own and this one is back when it returns).
    pub fn enter<R>(self: &Arc<Arena>, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<Arc<Arena>>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0.take();
                let _ = CURRENT_ARENA.try_with(|c| *c.borrow_mut() = previous);
            }
        }
        let previous = CURRENT_ARENA
            .try_with(|c| c.borrow_mut().replace(self.clone()))
            .ok()
            .flatten();
        let _restore = Restore(previous);
        f()
    }

    /// Runs `f` with no arena current on this thread: its buffers come
    /// from the pools. For buffers a run makes that its buffer plan does
    /// not cover (a scalar input made dense for a kernel), which would
    /// otherwise take blocks the plan counted on for the kernels' outputs.
    pub fn outside<R>(f: impl FnOnce() -> R) -> R {
        struct Restore(Option<Arc<Arena>>);
        impl Drop for Restore {
            fn drop(&mut self) {
                if let Some(previous) = self.0.take() {
                    let _ = CURRENT_ARENA.try_with(|c| *c.borrow_mut() = Some(previous));
                }
            }
        }
        let previous = CURRENT_ARENA
            .try_with(|c| c.borrow_mut().take())
            .ok()
            .flatten();
        let _restore = Restore(previous);
        f()
    }

    /// The current arena, when it plans blocks of `len` bytes.
    fn current_for(len: usize) -> Option<Arc<Arena>> {
        CURRENT_ARENA
            .try_with(|c| {
                c.borrow()
                    .as_ref()
                    .filter(|a| a.planned.contains_key(&len))
                    .cloned()
            })
            .ok()
            .flatten()
    }

    fn take(&self, len: usize) -> Option<NonNull<u8>> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.get_mut(&len).and_then(Vec::pop).map(|b| b.0)
    }

    /// Keeps a block coming home; false when the arena already holds all it
    /// planned of that size (a block allocated while others were out), and
    /// the caller passes it on.
    fn give_back(&self, ptr: NonNull<u8>, len: usize) -> bool {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let keep = self.planned.get(&len).copied().unwrap_or(0);
        let blocks = free.entry(len).or_default();
        if blocks.len() >= keep {
            return false;
        }
        blocks.push(pool::Block(ptr));
        true
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let free = std::mem::take(self.free.get_mut().unwrap_or_else(|p| p.into_inner()));
        for (len, blocks) in free {
            for block in blocks {
                if !pool::give_back(block.0, len) {
                    // SAFETY: arena blocks were allocated with `layout(len)`
                    // and are owned by the arena alone; the pool declined it.
                    unsafe { alloc::dealloc(block.0.as_ptr(), layout(len)) }
                }
            }
        }
    }
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Arena({} planned bytes)", self.planned_bytes())
    }
}

/// Checks that `bytes` are whole elements of `T`, each a valid value:
/// every element type accepts any bytes but `bool`, whose bytes must each
/// be 0 or 1. The dtype test is a constant per `T`, so other types pay no
/// pass over their bytes.
pub(crate) fn check_element_bytes<T: Element>(bytes: &[u8]) -> Result<()> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) {
        return Err(Error::invalid(format!(
            "{} bytes are not a whole number of {} elements ({size} bytes each)",
            bytes.len(),
            T::DTYPE
        )));
    }
    if matches!(T::DTYPE, DType::Bool) {
        if let Some(at) = bytes.iter().position(|&b| b > 1) {
            return Err(Error::invalid(format!(
                "byte {at} holds {}, which is not a bool (bool bytes must be 0 or 1)",
                bytes[at]
            )));
        }
    }
    Ok(())
}

/// Bytes for `numel` elements of `dtype`.
pub(crate) fn bytes_for(dtype: DType, numel: usize) -> usize {
    numel * dtype.size_in_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// System allocations made by this thread: tests run in parallel,
        /// so the process-wide count moves under a test's feet.
        pub(super) static ALLOCATIONS_HERE: std::cell::Cell<u64> =
            const { std::cell::Cell::new(0) };
    }

    fn allocations_here() -> u64 {
        ALLOCATIONS_HERE.with(|n| n.get())
    }

    #[test]
    fn buffers_are_aligned_zeroed_and_shared() {
        let big = Buffer::zeroed(LARGE_BUFFER);
        assert_eq!(big.bytes().as_ptr() as usize % BUFFER_ALIGN, 0);
        let b = Buffer::zeroed(100);
        assert_eq!(b.bytes().as_ptr() as usize % SMALL_ALIGN, 0);
        assert!(b.bytes().iter().all(|&x| x == 0));
        let mut c = b.clone();
        assert!(!c.is_unique());
        assert!(c.typed_mut::<bool>().is_err());
        drop(b);
        assert!(c.is_unique());
        c.typed_mut::<f32>().unwrap()[0] = 1.5;
        assert_eq!(c.typed::<f32>().unwrap()[0], 1.5);
    }

    #[test]
    fn a_small_buffer_dropped_last_is_taken_back_whole_on_its_thread() {
        // Sizes no other test of this thread uses: small, and above
        // `SMALL_BLOCK` (which the shared pool served before).
        for len in [208, SMALL_BLOCK + 4096 + 48] {
            taken_back_whole(len);
        }
    }

    fn taken_back_whole(len: usize) {
        let a = Buffer::zeroed(len);
        let whole = Arc::as_ptr(&a.0);
        let shared = a.clone();
        drop(a);
        // Not the last reference: still readable, and not kept.
        assert!(shared.bytes().iter().all(|&b| b == 0));
        let other = Buffer::for_overwrite(len);
        assert_ne!(Arc::as_ptr(&other.0), whole);
        assert_eq!(pool::local::kept_whole(len), 0);
        drop(shared);
        // The last one: kept, and the next request of its size takes it,
        // block and reference count together, unique.
        assert_eq!(pool::local::kept_whole(len), 1);
        let mut again = Buffer::for_overwrite(len);
        assert_eq!(Arc::as_ptr(&again.0), whole);
        assert_eq!(pool::local::kept_whole(len), 0);
        assert!(again.is_unique());
        again.typed_mut::<f32>().unwrap().fill(2.0);
        // `zeroed` clears what a kept buffer held.
        drop(again);
        let cleared = Buffer::zeroed(len);
        assert_eq!(Arc::as_ptr(&cleared.0), whole);
        assert!(cleared.bytes().iter().all(|&b| b == 0));
        drop((cleared, other));
        assert!(pool::local::cached_bytes() >= 2 * len);
        // Trimming frees what the thread keeps.
        Buffer::trim_pool();
        assert_eq!(pool::local::cached_bytes(), 0);
        let fresh = Buffer::for_overwrite(len);
        assert!(fresh.is_unique());
    }

    #[test]
    fn large_buffers_are_not_kept_whole() {
        for len in [KEPT_WHOLE, KEPT_WHOLE + 64] {
            drop(Buffer::zeroed(len));
            assert_eq!(pool::local::kept_whole(len), 0, "{len}");
        }
    }

    #[test]
    fn empty_buffers_need_no_memory() {
        let before = allocations_here();
        let b = Buffer::zeroed(0);
        assert!(b.is_empty());
        assert_eq!(b.typed::<f64>().unwrap().len(), 0);
        assert_eq!(allocations_here(), before);
    }

    #[test]
    fn from_slice_copies() {
        let b = Buffer::from_slice(&[1i64, -2, 3]);
        assert_eq!(b.typed::<i64>().unwrap(), &[1, -2, 3]);
        assert_eq!(b.len(), 24);
    }

    #[test]
    fn freed_large_blocks_are_reused_and_zeroed_on_request() {
        let len = pool::MIN_POOLED + 4096 * 3 + 64;
        let mut a = Buffer::zeroed(len);
        a.typed_mut::<f32>().unwrap().fill(7.0);
        let addr = a.bytes().as_ptr() as usize;
        drop(a);
        let hits = Buffer::stats().pool_hits;
        // The same size again: served from the pool, and cleared by `zeroed`.
        let b = Buffer::zeroed(len);
        assert_eq!(Buffer::stats().pool_hits, hits + 1);
        assert_eq!(b.bytes().as_ptr() as usize, addr);
        assert!(b.bytes().iter().all(|&x| x == 0));
        assert!(Buffer::stats().live_bytes >= len as u64);
        drop(b);
        Buffer::trim_pool();
        assert_eq!(Buffer::stats().cached_bytes, 0);
    }

    #[test]
    fn small_blocks_come_back_from_the_thread_cache_and_are_zeroed_on_request() {
        let mut a = Buffer::zeroed(96);
        a.typed_mut::<f32>().unwrap().fill(3.0);
        let addr = a.bytes().as_ptr() as usize;
        drop(a);
        let b = Buffer::zeroed(96);
        assert_eq!(
            b.bytes().as_ptr() as usize,
            addr,
            "reused from this thread's cache"
        );
        assert!(b.bytes().iter().all(|&x| x == 0));
    }

    #[test]
    fn bytes_that_are_not_bools_are_refused_as_bools() {
        let bad = Buffer::copy_of(&[0, 1, 2]);
        let err = bad.typed::<bool>().unwrap_err();
        assert!(err.message().contains("byte 2 holds 2"), "{err}");
        assert!(err.location().unwrap().file().ends_with("buffer.rs"));
        let mut bad = bad;
        assert!(
            bad.typed_mut::<bool>().is_err(),
            "a &mut [bool] can be read"
        );
        let good = Buffer::copy_of(&[0, 1, 1]);
        assert_eq!(good.typed::<bool>().unwrap(), &[false, true, true]);
        assert!(Buffer::copy_of(&[0; 6]).typed::<f32>().is_err(), "1.5 f32s");
    }

    #[test]
    fn a_reused_block_holding_other_values_is_refused_as_bools() {
        let mut a = Buffer::zeroed(48);
        // 3.0f32 is 0x4040_0000: bytes 2 and 3 of each element are 0x40.
        a.typed_mut::<f32>().unwrap().fill(3.0);
        let addr = a.bytes().as_ptr() as usize;
        drop(a);
        let mut b = Buffer::for_overwrite(48);
        assert_eq!(b.bytes().as_ptr() as usize, addr, "from the thread cache");
        assert!(b.typed::<bool>().is_err());
        assert!(b.typed_mut::<bool>().is_err());
        // Overwriting through another type keeps working, as kernels do.
        b.typed_mut::<i32>().unwrap().fill(1);
        assert_eq!(b.typed::<i32>().unwrap(), &[1; 12]);
    }

    #[test]
    fn an_arena_serves_its_planned_sizes_and_takes_its_blocks_back() {
        let planned = pool::MIN_POOLED + 4096 * 5 + 128;
        let arena = Arena::new(&[(planned, 2), (48, 1)]);
        assert_eq!(arena.planned_bytes(), 2 * planned + 48);
        let (a, b, small, other) = arena.enter(|| {
            (
                Buffer::zeroed(planned),
                Buffer::for_overwrite(planned),
                Buffer::zeroed(48),
                Buffer::zeroed(200),
            )
        });
        assert!(a.bytes().iter().all(|&x| x == 0));
        assert!(a.0.home.is_some() && b.0.home.is_some() && small.0.home.is_some());
        assert!(other.0.home.is_none(), "an unplanned size uses the pools");
        let addresses = [a.bytes().as_ptr() as usize, b.bytes().as_ptr() as usize];
        // Dropped on another thread, long after the run: still goes home.
        std::thread::spawn(move || drop((a, b, small)))
            .join()
            .unwrap();
        let c = arena.enter(|| Buffer::for_overwrite(planned));
        assert!(addresses.contains(&(c.bytes().as_ptr() as usize)));
        // Outside `enter`, the same size comes from the pools.
        let outside = Buffer::zeroed(planned);
        assert!(outside.0.home.is_none());
    }

    #[test]
    fn an_arena_beyond_its_plan_allocates_and_keeps_only_what_it_planned() {
        let planned = 4096 * 7 + 64;
        let arena = Arena::new(&[(planned, 1)]);
        let (a, b) = arena.enter(|| (Buffer::zeroed(planned), Buffer::zeroed(planned)));
        assert!(b.bytes().iter().all(|&x| x == 0), "a fresh block is zero");
        drop((a, b));
        let free = arena.free.lock().unwrap().get(&planned).map_or(0, Vec::len);
        assert_eq!(free, 1, "the second block went to the shared pool");
    }

    #[test]
    fn beyond_its_plan_an_arena_takes_back_the_blocks_it_turned_away() {
        let planned = 4096 * 9 + 192;
        let arena = Arena::new(&[(planned, 1)]);
        let (a, b) = arena.enter(|| (Buffer::zeroed(planned), Buffer::zeroed(planned)));
        drop((a, b));
        let before = allocations_here();
        let (c, d) = arena.enter(|| (Buffer::zeroed(planned), Buffer::zeroed(planned)));
        assert_eq!(allocations_here(), before, "the surplus came from the pool");
        assert!(c.bytes().iter().chain(d.bytes()).all(|&x| x == 0));
    }

    #[test]
    fn outside_an_arena_buffers_come_from_the_pools() {
        let arena = Arena::new(&[(112, 1)]);
        arena.enter(|| {
            let outside = Arena::outside(|| Buffer::zeroed(112));
            assert!(outside.0.home.is_none());
            let inside = Buffer::zeroed(112);
            assert!(Arc::ptr_eq(inside.0.home.as_ref().unwrap(), &arena));
        });
        assert!(Arena::outside(|| Buffer::zeroed(112)).0.home.is_none());
    }

    #[test]
    fn arenas_nest_and_restore_the_outer_one() {
        let outer = Arena::new(&[(64, 1)]);
        let inner = Arena::new(&[(80, 1)]);
        outer.enter(|| {
            let in_inner = inner.enter(|| (Buffer::zeroed(64), Buffer::zeroed(80)));
            assert!(in_inner.0 .0.home.is_none(), "the inner arena plans no 64");
            assert!(Arc::ptr_eq(in_inner.1 .0.home.as_ref().unwrap(), &inner));
            let back = Buffer::zeroed(64);
            assert!(Arc::ptr_eq(back.0.home.as_ref().unwrap(), &outer));
        });
        // Dropping an arena while one of its blocks is out: the block keeps
        // it alive and frees it last.
        let kept = inner.enter(|| Buffer::zeroed(80));
        drop(inner);
        assert_eq!(kept.len(), 80);
    }
}
