//! Device memory: GPU buffers behind [`DeviceStorage`], and a pool that
//! keeps freed buffers for the next tensor of the same size class, as the
//! host's buffer pool does, since creating a GPU buffer costs a driver
//! call and zeroing.

use crate::context::Gpu;
use stagecraft_tensor::{DeviceStorage, DeviceTensor, Error, ErrorKind, Result};
use std::any::Any;
use std::collections::HashMap;
use std::sync::Mutex;

/// Freed buffers kept for reuse, by capacity.
#[derive(Default)]
pub(crate) struct BufferPool {
    free: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    by_capacity: HashMap<u64, Vec<wgpu::Buffer>>,
    bytes: u64,
}

/// The most bytes of freed buffers the pool keeps.
const POOL_LIMIT_BYTES: u64 = 1 << 30;

/// The capacity a request of `bytes` gets: a power of two of at least
/// one 4-byte word (shaders read words), so sizes that differ a little
/// share buffers.
fn capacity_for(bytes: usize) -> u64 {
    (bytes.max(4) as u64).next_power_of_two()
}

/// GPU memory holding one tensor's elements. Dropping it returns the buffer
/// to its device's pool; work already submitted that reads it still runs
/// first, as the queue runs submissions in order.
pub struct GpuBuffer {
    gpu: &'static Gpu,
    buffer: Option<wgpu::Buffer>,
    len: usize,
}

impl GpuBuffer {
    /// Device memory for `bytes` bytes, from the pool when it has a buffer
    /// of the size class; out of device memory is an error, not an abort.
    pub(crate) fn new(gpu: &'static Gpu, bytes: usize) -> Result<GpuBuffer> {
        gpu.check_alive()?;
        let capacity = capacity_for(bytes);
        let reused = {
            let mut pool = gpu.pool.free.lock().unwrap_or_else(|p| p.into_inner());
            let found = pool.by_capacity.get_mut(&capacity).and_then(Vec::pop);
            if found.is_some() {
                pool.bytes -= capacity;
            }
            found
        };
        let buffer = match reused {
            Some(buffer) => buffer,
            None => {
                if capacity > gpu.max_binding_bytes {
                    return Err(Error::new(
                        ErrorKind::Device,
                        format!(
                            "{}: a tensor of {bytes} bytes is larger than the largest buffer \
                             the device binds ({} bytes)",
                            gpu.name(),
                            gpu.max_binding_bytes
                        ),
                    ));
                }
                let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
                let buffer = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: None,
                    size: capacity,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                if let Some(error) = pollster::block_on(scope.pop()) {
                    return Err(Error::new(
                        ErrorKind::Device,
                        format!(
                            "{} is out of memory for a tensor of {bytes} bytes: {error}",
                            gpu.name()
                        ),
                    ));
                }
                buffer
            }
        };
        Ok(GpuBuffer {
            gpu,
            buffer: Some(buffer),
            len: bytes,
        })
    }

    /// The GPU buffer of a device tensor of this crate.
    pub fn of(tensor: &DeviceTensor) -> Result<&GpuBuffer> {
        tensor.storage_as::<GpuBuffer>().ok_or_else(|| {
            Error::new(
                ErrorKind::Device,
                format!(
                    "a tensor in the memory of {} is not a GPU buffer of stagecraft-wgpu",
                    tensor.storage().device_name()
                ),
            )
        })
    }

    /// The wgpu buffer (its size is the capacity, at least the tensor's
    /// bytes rounded up to whole words).
    pub fn buffer(&self) -> &wgpu::Buffer {
        self.buffer
            .as_ref()
            .expect("a GpuBuffer holds its buffer until dropped")
    }
}

impl GpuBuffer {
    /// The wgpu buffer, no longer returned to the pool when this drops:
    /// the caller releases it.
    pub(crate) fn into_inner(mut self) -> wgpu::Buffer {
        self.buffer
            .take()
            .expect("a GpuBuffer holds its buffer until dropped")
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        let Some(buffer) = self.buffer.take() else {
            return;
        };
        if let Some(buffer) = self.gpu.defer_release(buffer) {
            self.gpu.pool.release(buffer);
        }
    }
}

impl BufferPool {
    /// Keeps a freed buffer for reuse, within the pool's limit.
    pub(crate) fn release(&self, buffer: wgpu::Buffer) {
        let capacity = buffer.size();
        let mut pool = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if pool.bytes + capacity <= POOL_LIMIT_BYTES {
            pool.bytes += capacity;
            pool.by_capacity.entry(capacity).or_default().push(buffer);
        }
    }
}

impl std::fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuffer({}, {} bytes)", self.gpu.name(), self.len)
    }
}

impl DeviceStorage for GpuBuffer {
    fn device_name(&self) -> &str {
        self.gpu.name()
    }

    fn size_in_bytes(&self) -> usize {
        self.len
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::capacity_for;

    #[test]
    fn capacities_are_whole_words_and_cover_the_request() {
        for bytes in [
            0,
            1,
            3,
            4,
            5,
            255,
            256,
            257,
            4095,
            4096,
            4097,
            1 << 20,
            (1 << 20) + 1,
        ] {
            let capacity = capacity_for(bytes);
            assert!(capacity >= bytes as u64 && capacity >= 4, "{bytes}");
            assert_eq!(capacity % 4, 0, "{bytes}");
        }
        // Nearby large sizes share a class.
        assert_eq!(capacity_for(5000), capacity_for(8000));
    }
}
