//! Aligned, reference-counted byte buffers that hold tensor values.

use crate::{DType, Element};
use std::alloc::{self, Layout};
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

struct RawBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: RawBuffer owns its allocation exclusively; shared access goes
// through `&Buffer` (read-only) and mutation needs a unique `Arc`, so moving
// or sharing it between threads is sound.
unsafe impl Send for RawBuffer {}
// SAFETY: see `Send`; `&RawBuffer` only gives read access.
unsafe impl Sync for RawBuffer {}

impl Drop for RawBuffer {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this
            // layout in `Buffer::zeroed` and is freed only here, once.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout(self.len)) }
        }
    }
}

fn layout(len: usize) -> Layout {
    let align = if len >= LARGE_BUFFER {
        BUFFER_ALIGN
    } else {
        SMALL_ALIGN
    };
    Layout::from_size_align(len, align).expect("buffer size overflows isize")
}

/// A zero-initialised, aligned byte buffer (64 bytes for large buffers, 16
/// for small ones) shared by reference counting. Cloning is cheap; writing
/// needs the only reference.
#[derive(Clone)]
pub struct Buffer(Arc<RawBuffer>);

impl Buffer {
    /// A buffer of `len` zero bytes.
    ///
    /// Zeroing is nearly free: small blocks are cleared in cache, and large
    /// ones come from the OS as zero pages.
    pub fn zeroed(len: usize) -> Buffer {
        let ptr = if len == 0 {
            // A dangling but aligned pointer: zero-length slices need no memory.
            NonNull::new(SMALL_ALIGN as *mut u8).expect("non-null constant")
        } else {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            ALLOCATED_BYTES.fetch_add(len as u64, Ordering::Relaxed);
            // SAFETY: the layout has a non-zero size.
            let raw = unsafe { alloc::alloc_zeroed(layout(len)) };
            NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout(len)))
        };
        Buffer(Arc::new(RawBuffer { ptr, len }))
    }

    /// A buffer holding a copy of `values`.
    pub fn from_slice<T: Element>(values: &[T]) -> Buffer {
        let mut buffer = Buffer::zeroed(std::mem::size_of_val(values));
        buffer
            .typed_mut::<T>()
            .expect("a fresh buffer is unique")
            .copy_from_slice(values);
        buffer
    }

    /// A new buffer holding a copy of `bytes` (keeps the 64-byte alignment
    /// that a `Vec<u8>` would not).
    pub fn copy_of(bytes: &[u8]) -> Buffer {
        let mut buffer = Buffer::zeroed(bytes.len());
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

    /// The values as a slice of `T`; the caller has checked the dtype.
    ///
    /// # Panics
    /// If the length is not a multiple of `size_of::<T>()` (a bug in the
    /// caller: tensors check their dtype first).
    pub fn typed<T: Element>(&self) -> &[T] {
        let size = std::mem::size_of::<T>();
        assert_eq!(
            self.0.len % size,
            0,
            "buffer length is not a multiple of the element size"
        );
        // SAFETY: the pointer is at least 16-byte aligned (enough for every Element),
        // valid for `len` initialised bytes, and `Element` types are plain
        // data valid for any bytes that an `Element` write or zeroing put
        // there.
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr() as *const T, self.0.len / size) }
    }

    /// The values as a mutable slice of `T`, if this is the only reference.
    pub fn typed_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        let size = std::mem::size_of::<T>();
        assert_eq!(
            self.0.len % size,
            0,
            "buffer length is not a multiple of the element size"
        );
        let raw = Arc::get_mut(&mut self.0)?;
        // SAFETY: unique access (`Arc::get_mut` succeeded and we hold
        // `&mut self`), alignment and validity as in `typed`.
        Some(unsafe { std::slice::from_raw_parts_mut(raw.ptr.as_ptr() as *mut T, raw.len / size) })
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

/// Bytes for `numel` elements of `dtype`.
pub(crate) fn bytes_for(dtype: DType, numel: usize) -> usize {
    numel * dtype.size_in_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_shared() {
        let big = Buffer::zeroed(LARGE_BUFFER);
        assert_eq!(big.bytes().as_ptr() as usize % BUFFER_ALIGN, 0);
        let b = Buffer::zeroed(100);
        assert_eq!(b.bytes().as_ptr() as usize % SMALL_ALIGN, 0);
        assert!(b.bytes().iter().all(|&x| x == 0));
        let mut c = b.clone();
        assert!(!c.is_unique());
        assert!(c.typed_mut::<u8_like>().is_none());
        drop(b);
        assert!(c.is_unique());
        c.typed_mut::<f32>().unwrap()[0] = 1.5;
        assert_eq!(c.typed::<f32>()[0], 1.5);
    }

    #[allow(non_camel_case_types)]
    type u8_like = bool;

    #[test]
    fn empty_buffers_need_no_memory() {
        let before = Buffer::allocation_count();
        let b = Buffer::zeroed(0);
        assert!(b.is_empty());
        assert_eq!(b.typed::<f64>().len(), 0);
        assert_eq!(Buffer::allocation_count(), before);
    }

    #[test]
    fn from_slice_copies() {
        let b = Buffer::from_slice(&[1i64, -2, 3]);
        assert_eq!(b.typed::<i64>(), &[1, -2, 3]);
        assert_eq!(b.len(), 24);
    }
}
