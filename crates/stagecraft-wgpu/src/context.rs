//! One GPU: its wgpu adapter, device and queue, the buffer pool and the
//! compiled pipelines, opened once per process on first use.

use crate::buffer::{BufferPool, GpuBuffer};
use stagecraft_tensor::{
    Buffer, DenseHostTensor, DeviceTensor, Error, ErrorKind, FxBuild, Result, TensorMetadata,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A compiled compute shader and the layout of its one bind group.
pub(crate) struct Pipeline {
    pub(crate) pipeline: wgpu::ComputePipeline,
    pub(crate) layout: wgpu::BindGroupLayout,
}

/// An open GPU (`gpu:N`). Lives for the rest of the process.
pub struct Gpu {
    name: String,
    info: wgpu::AdapterInfo,
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) pool: BufferPool,
    /// Set by wgpu's device-lost callback: every later op is an error.
    lost: Arc<Mutex<Option<String>>>,
    /// Pipelines by their WGSL source: a shader is compiled once per
    /// process, whatever op or shape asked for it.
    /// (FxHash: a shader's source is kilobytes, hashed at every launch.)
    pipelines: Mutex<HashMap<String, Arc<Pipeline>, FxBuild>>,
    pub(crate) max_binding_bytes: u64,
    /// The alignment of a binding's offset into a buffer, which launch
    /// parameters in a shared chunk start at (read once: every launch
    /// needs it).
    params_align: usize,
    /// The open batch, if any: launches record into its encoder instead
    /// of submitting one command buffer each.
    batch: Mutex<Batch>,
    /// Command buffers submitted to the queue, for tests and reports.
    submissions: std::sync::atomic::AtomicU64,
    /// Bytes copied from host memory, for tests and reports.
    uploaded: std::sync::atomic::AtomicU64,
}

/// Work held back while a batch is open (see [`Gpu::begin_batch`]).
#[derive(Default)]
struct Batch {
    /// Nested [`Gpu::begin_batch`] calls not yet ended.
    depth: usize,
    /// The command buffer being recorded, created by the first launch.
    encoder: Option<wgpu::CommandEncoder>,
    /// The compute pass the batch's launches record into, open on
    /// `encoder` until the batch is submitted or the encoder is needed
    /// for other commands: one pass for the whole batch, not one per
    /// kernel (wgpu still orders the dispatches that share buffers).
    pass: Option<wgpu::ComputePass<'static>>,
    /// Kernels recorded since the last submission.
    launches: usize,
    /// Buffers freed while recorded work may still read them. They go to
    /// the pool only after that work is submitted: a later upload or
    /// launch parameter written into a reused buffer would otherwise land
    /// (queue writes run at the start of the next submission) before the
    /// recorded kernels that read the old contents.
    freed: Vec<wgpu::Buffer>,
    /// The launch parameters of the recorded kernels not yet written to
    /// the device: one queue write per chunk, not per launch (each queue
    /// write allocates a staging buffer).
    params: Option<ParamsChunk>,
}

/// A buffer of launch parameters being filled (see [`Gpu::record_launch`]).
struct ParamsChunk {
    buffer: wgpu::Buffer,
    bytes: Vec<u8>,
}

/// The size of a [`ParamsChunk`]: a few hundred launches' parameters (a
/// launch with more gets a chunk of its own size).
const PARAMS_CHUNK_BYTES: usize = 64 << 10;

/// Eager launches recorded before they are submitted together (any read
/// of a value, or `synchronize`, submits sooner).
const EAGER_LAUNCHES_PER_SUBMISSION: usize = 16;

/// What a machine without a usable adapter needs, for the error.
const DRIVER_HINT: &str = "wgpu found no Vulkan, Metal or DX12 adapter. On Linux without a GPU, \
     install Mesa's software Vulkan driver (Debian/Ubuntu: `apt-get install mesa-vulkan-drivers`; \
     Fedora: `dnf install mesa-vulkan-drivers`); with a GPU, install its vendor's Vulkan driver";

type Opened = Result<&'static Gpu>;

fn opened() -> &'static Mutex<HashMap<usize, Opened>> {
    static OPENED: OnceLock<Mutex<HashMap<usize, Opened>>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Adapters in the order `gpu:N` numbers them: discrete GPUs first, then
/// integrated, virtual, and software (CPU) ones.
fn adapters() -> Vec<wgpu::Adapter> {
    let mut descriptor = wgpu::InstanceDescriptor::new_without_display_handle();
    descriptor.backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
    let backends = descriptor.backends;
    let instance = wgpu::Instance::new(descriptor);
    let mut adapters = pollster::block_on(instance.enumerate_adapters(backends));
    let rank = |a: &wgpu::Adapter| match a.get_info().device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    adapters.sort_by_key(rank);
    adapters
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({}, {})", self.name, self.info.name)
    }
}

impl Gpu {
    /// `gpu:index`, opened on first use. The error names the driver to
    /// install when there is no adapter, and the adapters there are when
    /// `index` is past them.
    pub fn get(index: usize) -> Result<&'static Gpu> {
        let mut all = opened().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(result) = all.get(&index) {
            return result.clone();
        }
        let result = Gpu::open(index).map(|gpu| &*Box::leak(Box::new(gpu)));
        all.insert(index, result.clone());
        result
    }

    fn open(index: usize) -> Result<Gpu> {
        let mut adapters = adapters();
        if adapters.is_empty() {
            return Err(Error::new(
                ErrorKind::Device,
                format!("no GPU for gpu:{index}: {DRIVER_HINT}"),
            ));
        }
        if index >= adapters.len() {
            let names: Vec<String> = adapters
                .iter()
                .enumerate()
                .map(|(i, a)| format!("gpu:{i} = {}", a.get_info().name))
                .collect();
            return Err(Error::new(
                ErrorKind::Device,
                format!(
                    "no gpu:{index}: this machine has {} adapter(s): {}",
                    adapters.len(),
                    names.join(", ")
                ),
            ));
        }
        let adapter = adapters.swap_remove(index);
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("stagecraft"),
            // The adapter's own limits, not WebGPU's defaults: a tensor
            // binding may then be as large as the device allows.
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| {
            Error::new(
                ErrorKind::Device,
                format!("gpu:{index} ({}) refused to open: {e}", info.name),
            )
        })?;
        let lost = Arc::new(Mutex::new(None));
        let lost_flag = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            *lost_flag.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(format!("{reason:?}: {message}"));
        });
        // Errors are caught per op by error scopes; one that escapes them
        // (none should) is reported rather than aborting the process.
        device.on_uncaptured_error(Arc::new(|error: wgpu::Error| {
            eprintln!("stagecraft: uncaptured GPU error: {error}");
        }));
        Ok(Gpu {
            name: format!("gpu:{index}"),
            info,
            device,
            queue,
            pool: BufferPool::default(),
            lost,
            pipelines: Mutex::new(HashMap::default()),
            max_binding_bytes: limits
                .max_storage_buffer_binding_size
                .min(limits.max_buffer_size),
            params_align: limits.min_storage_buffer_offset_alignment as usize,
            batch: Mutex::new(Batch::default()),
            submissions: Default::default(),
            uploaded: Default::default(),
        })
    }

    /// The device's name, `gpu:N`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The adapter's name, e.g. `NVIDIA H200` or `llvmpipe (LLVM 15.0.6, 256 bits)`.
    pub fn adapter_name(&self) -> &str {
        &self.info.name
    }

    /// The adapter's backend and driver, for reports.
    pub fn driver(&self) -> String {
        format!(
            "{:?}, {} {}",
            self.info.backend, self.info.driver, self.info.driver_info
        )
    }

    /// True for a software adapter (Mesa's lavapipe): its times are no
    /// measure of a GPU.
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// An error if the device was lost (driver reset, removed GPU): every
    /// op after that fails with it.
    pub fn check_alive(&self) -> Result<()> {
        match &*self.lost.lock().unwrap_or_else(|p| p.into_inner()) {
            None => Ok(()),
            Some(reason) => Err(Error::new(
                ErrorKind::Device,
                format!("{} was lost ({reason}); its tensors are gone", self.name),
            )),
        }
    }

    /// Marks the device lost, as wgpu's callback does; for tests of what
    /// follows a lost device.
    #[doc(hidden)]
    pub fn simulate_loss(&self, reason: &str) {
        *self.lost.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_string());
    }

    /// A new tensor of `meta` in device memory, its bytes unspecified.
    pub fn alloc(&'static self, meta: TensorMetadata) -> Result<DeviceTensor> {
        let bytes = meta.checked_size_in_bytes()?;
        let storage = GpuBuffer::new(self, bytes)?;
        Ok(DeviceTensor::new(meta, Arc::new(storage)))
    }

    /// Copies a host tensor into device memory. The copy is queued: the
    /// device sees it before any work submitted after this call.
    pub fn upload(&'static self, host: &DenseHostTensor) -> Result<DeviceTensor> {
        self.check_alive()?;
        let tensor = self.alloc(host.metadata().clone())?;
        let bytes = host.buffer().bytes();
        self.uploaded
            .fetch_add(bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
        if !bytes.is_empty() {
            let target = GpuBuffer::of(&tensor)?;
            // The queue writes whole 4-byte words.
            if bytes.len().is_multiple_of(4) {
                self.queue.write_buffer(target.buffer(), 0, bytes);
            } else {
                let mut padded = bytes.to_vec();
                padded.resize(bytes.len().next_multiple_of(4), 0);
                self.queue.write_buffer(target.buffer(), 0, &padded);
            }
        }
        Ok(tensor)
    }

    /// Copies a device tensor to host memory, waiting for the work that
    /// computes it.
    pub fn download(&self, tensor: &DeviceTensor) -> Result<DenseHostTensor> {
        self.check_alive()?;
        let meta = tensor.metadata().clone();
        let bytes = meta.checked_size_in_bytes()?;
        if bytes == 0 {
            return DenseHostTensor::zeros(meta);
        }
        let source = GpuBuffer::of(tensor)?;
        let padded = bytes.next_multiple_of(4) as u64;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("stagecraft download"),
            size: padded,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        encoder.copy_buffer_to_buffer(source.buffer(), 0, &staging, 0, padded);
        {
            // The recorded work and the copy reach the queue under one
            // lock: another thread's flush must not slip its submission of
            // the kernels this copy reads in after the copy.
            let mut batch = self.batch.lock().unwrap_or_else(|p| p.into_inner());
            self.flush_locked(&mut batch)?;
            self.submit(encoder);
        }
        let (done, mapped) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |result| {
            let _ = done.send(result);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.device_error("waiting for the GPU", e))?;
        mapped
            .recv()
            .map_err(|e| self.device_error("reading a GPU buffer", e))?
            .map_err(|e| self.device_error("mapping a GPU buffer", e))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| self.device_error("mapping a GPU buffer", e))?;
        let host = DenseHostTensor::from_buffer(meta, Buffer::copy_of(&view[..bytes]));
        drop(view);
        staging.unmap();
        host
    }

    /// Waits until every submitted kernel has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.flush()?;
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| self.device_error("waiting for the GPU", e))
    }

    /// Opens a batch: until the matching [`Gpu::end_batch`], kernel
    /// launches (from any thread) are recorded into one command buffer,
    /// submitted when the outermost batch ends or when the host must wait
    /// (a download). The lazy device runs a trace this way, so a trace is
    /// one submission, as on a GPU it should be. Batches nest.
    pub fn begin_batch(&self) {
        self.batch.lock().unwrap_or_else(|p| p.into_inner()).depth += 1;
    }

    /// Ends a batch; the outermost end submits what it recorded. An error
    /// the driver reports for the recorded work as a whole (validation at
    /// submission) is returned here.
    pub fn end_batch(&self) -> Result<()> {
        let mut batch = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        batch.depth = batch.depth.saturating_sub(1);
        if batch.depth > 0 {
            return Ok(());
        }
        self.flush_locked(&mut batch)
    }

    /// True while a batch is open.
    pub fn in_batch(&self) -> bool {
        self.batch.lock().unwrap_or_else(|p| p.into_inner()).depth > 0
    }

    /// Submits the recorded work of the open batch (which stays open), and
    /// returns the buffers it freed to the pool.
    fn flush(&self) -> Result<()> {
        let mut batch = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        self.flush_locked(&mut batch)
    }

    /// Submits the batch's recorded work while its lock is held, then
    /// returns the buffers that work may have read to the pool. Taking the
    /// encoder and submitting it must be one step: a thread that found the
    /// encoder gone while another had yet to submit it could queue a read
    /// of its results ahead of the kernels computing them.
    fn flush_locked(&self, batch: &mut Batch) -> Result<()> {
        let mut result = Ok(());
        self.write_params(batch);
        batch.launches = 0;
        // The pass ends before its encoder is finished.
        batch.pass = None;
        if let Some(encoder) = batch.encoder.take() {
            let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
            self.submit(encoder);
            if let Some(error) = pollster::block_on(scope.pop()) {
                result = Err(self.device_error("submitting a batch of kernels", error));
            }
        }
        // Submitted or refused, the recorded work no longer reads them.
        for buffer in batch.freed.drain(..) {
            self.pool.release(buffer);
        }
        result
    }

    /// Writes the open chunk of launch parameters (the queue runs the
    /// write before the next submission's kernels) and retires its buffer
    /// with the batch's other freed buffers.
    fn write_params(&self, batch: &mut Batch) {
        if let Some(chunk) = batch.params.take() {
            self.queue.write_buffer(&chunk.buffer, 0, &chunk.bytes);
            batch.freed.push(chunk.buffer);
        }
    }

    /// Records a kernel launch: `params` are appended to the open chunk of
    /// launch parameters, and `record` gets the chunk's buffer and the
    /// parameters' offset in it (to bind), and the open compute pass.
    /// Inside a batch the launch is submitted with the batch; outside one
    /// (eager ops) with the launches recorded since the last submission,
    /// every [`EAGER_LAUNCHES_PER_SUBMISSION`] launches or when the host
    /// waits. All under the batch's lock, so that no flush between binding
    /// the chunk and recording the kernel can retire the chunk.
    pub(crate) fn record_launch(
        &'static self,
        params: &[u8],
        record: impl FnOnce(&wgpu::Buffer, u64, &mut wgpu::ComputePass<'static>) -> Result<()>,
    ) -> Result<()> {
        let mut batch = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        let align = self.params_align;
        let fits = batch.params.as_ref().is_some_and(|chunk| {
            (chunk.bytes.len().next_multiple_of(align) + params.len()) as u64 <= chunk.buffer.size()
        });
        if !fits {
            self.write_params(&mut batch);
            // Parameters larger than a chunk get a chunk of their own size.
            let bytes = PARAMS_CHUNK_BYTES.max(params.len());
            let buffer = crate::buffer::GpuBuffer::new(self, bytes)?.into_inner();
            batch.params = Some(ParamsChunk {
                buffer,
                bytes: Vec::with_capacity(bytes),
            });
        }
        if batch.pass.is_none() {
            let encoder = batch.encoder.get_or_insert_with(|| {
                self.device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor::default())
            });
            let pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            batch.pass = Some(pass.forget_lifetime());
        }
        let Batch {
            params: Some(chunk),
            pass: Some(pass),
            ..
        } = &mut *batch
        else {
            unreachable!("a chunk and a pass were opened above");
        };
        let offset = chunk.bytes.len().next_multiple_of(align);
        chunk.bytes.resize(offset, 0);
        chunk.bytes.extend_from_slice(params);
        record(&chunk.buffer, offset as u64, pass)?;
        // Outside a batch (eager ops), launches gather into submissions of
        // a few: a submission per kernel cost more than the kernel.
        batch.launches += 1;
        if batch.depth == 0 && batch.launches >= EAGER_LAUNCHES_PER_SUBMISSION {
            self.flush_locked(&mut batch)?;
        }
        Ok(())
    }

    fn submit(&self, encoder: wgpu::CommandEncoder) {
        self.submissions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.queue.submit([encoder.finish()]);
    }

    /// How many command buffers this device has submitted: one per
    /// batch, one per download, and outside batches one per
    /// [`EAGER_LAUNCHES_PER_SUBMISSION`] kernels or fewer (a read submits
    /// what is recorded).
    pub fn submissions(&self) -> u64 {
        self.submissions.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The most inputs a fused elementwise kernel binds: the device's
    /// storage buffers per shader, less the output and the parameters.
    pub fn max_fused_inputs(&self) -> usize {
        (self.device.limits().max_storage_buffers_per_shader_stage as usize).saturating_sub(2)
    }

    /// How many bytes [`Gpu::upload`] has copied from host memory.
    pub fn uploaded_bytes(&self) -> u64 {
        self.uploaded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Keeps a freed buffer from the pool while a batch's recorded work
    /// may read it; `Some(buffer)` back when no batch is open.
    pub(crate) fn defer_release(&self, buffer: wgpu::Buffer) -> Option<wgpu::Buffer> {
        let mut batch = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        if batch.depth > 0 || batch.encoder.is_some() {
            batch.freed.push(buffer);
            None
        } else {
            Some(buffer)
        }
    }

    pub(crate) fn device_error(&self, what: &str, error: impl std::fmt::Display) -> Error {
        if let Err(lost) = self.check_alive() {
            return lost;
        }
        Error::new(ErrorKind::Device, format!("{}: {what}: {error}", self.name))
    }

    /// The pipeline of a WGSL compute shader (entry point `main`), compiled
    /// on first use.
    pub(crate) fn pipeline(&self, source: &str) -> Result<Arc<Pipeline>> {
        if let Some(p) = self
            .pipelines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(source)
        {
            return Ok(p.clone());
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: None,
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: None,
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(error) = pollster::block_on(scope.pop()) {
            return Err(Error::internal(format!(
                "a generated GPU shader did not compile: {error}\n{source}"
            )));
        }
        let layout = pipeline.get_bind_group_layout(0);
        let compiled = Arc::new(Pipeline { pipeline, layout });
        self.pipelines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(source.to_string(), compiled.clone());
        Ok(compiled)
    }

    /// The number of compiled pipelines (each distinct shader once).
    pub fn pipeline_count(&self) -> usize {
        self.pipelines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }
}
