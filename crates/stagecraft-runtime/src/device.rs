//! Devices: named places where tensors live, each bound to the op handler
//! that executes ops there.

use crate::cpu_handler::CpuOpHandler;
use crate::handle::TensorHandle;
use crate::op_handler::{OpHandler, OpInvocation, Results};
use stagecraft_tensor::{Error, ErrorKind, Result};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

/// The kind of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A host CPU device (`cpu:0` is the machine; `cpu:N` are virtual CPU
    /// devices sharing it).
    Cpu,
    /// A lazy device: ops are recorded and run as traces on a target device
    /// when values are needed.
    Lazy,
    /// The host program (`host`): where staged code runs Rust closures
    /// (`HostCall`). It runs CPU kernels on its own partition thread, so a
    /// host closure overlaps with the graph work that does not wait for it.
    Host,
    /// A GPU (`gpu:N`): tensors live in its own memory, and values move
    /// to and from the host only by explicit copies (or a read).
    Gpu,
    /// A device whose handler was registered by a library or the user (for
    /// example a logging wrapper).
    Custom,
}

/// A registered device. Devices live for the whole process.
pub struct DeviceInner {
    name: String,
    kind: DeviceKind,
    index: usize,
    /// The process rank a `/rank:R/...` name gives.
    rank: Option<usize>,
    handler: Arc<dyn OpHandler>,
}

/// A device: cheap to copy and compare (devices are interned, so equality
/// is identity).
#[derive(Clone, Copy)]
pub struct Device(&'static DeviceInner);

fn devices() -> &'static Mutex<Vec<&'static DeviceInner>> {
    static DEVICES: OnceLock<Mutex<Vec<&'static DeviceInner>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(Vec::new()))
}

fn intern(
    name: String,
    (kind, index, rank): (DeviceKind, usize, Option<usize>),
    make_handler: impl FnOnce() -> Arc<dyn OpHandler>,
    must_be_new: bool,
) -> Result<Device> {
    let mut all = devices().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(existing) = all.iter().find(|d| d.name == name) {
        if must_be_new {
            return Err(Error::new(
                ErrorKind::Device,
                format!("a device named `{name}` is already registered"),
            ));
        }
        return Ok(Device(existing));
    }
    // Devices are few and live as long as the process: leaking them gives
    // `Device` a `&'static` that is `Copy` and compares by address.
    let inner: &'static DeviceInner = Box::leak(Box::new(DeviceInner {
        name,
        kind,
        index,
        rank,
        handler: make_handler(),
    }));
    all.push(inner);
    Ok(Device(inner))
}

impl Device {
    /// The host CPU, `cpu:0`.
    pub fn cpu() -> Device {
        static CPU0: OnceLock<Device> = OnceLock::new();
        *CPU0.get_or_init(|| Device::cpu_n(0))
    }

    /// The host program's device, `host`. Staged code places `HostCall`
    /// nodes here; partitioning then joins them to the graph with
    /// Send/Recv pairs through the run's rendezvous.
    pub fn host() -> Device {
        static HOST: OnceLock<Device> = OnceLock::new();
        *HOST.get_or_init(|| {
            intern(
                "host".to_string(),
                (DeviceKind::Host, 0, None),
                || Arc::new(CpuOpHandler::new(0)),
                false,
            )
            .expect("interning the host device cannot fail")
        })
    }

    fn cpu_n(index: usize) -> Device {
        intern(
            format!("cpu:{index}"),
            (DeviceKind::Cpu, index, None),
            || Arc::new(CpuOpHandler::new(index)),
            false,
        )
        .expect("interning an existing or new cpu device cannot fail")
    }

    /// The GPU `gpu:index`: the index-th adapter wgpu finds, discrete GPUs
    /// first (on a machine without one, Mesa's software Vulkan driver).
    /// The GPU opens on the first op; if there is none, or stagecraft was
    /// built without the `wgpu` feature, every op on it is an error that
    /// says what to install or enable. [`Device::try_gpu`] checks first.
    pub fn gpu(index: usize) -> Device {
        intern(
            format!("gpu:{index}"),
            (DeviceKind::Gpu, index, None),
            || gpu_handler(index),
            false,
        )
        .expect("interning an existing or new gpu device cannot fail")
    }

    /// `gpu:index`, or the error that says why this machine or build has
    /// no such GPU (no adapter, no driver, no `wgpu` feature).
    pub fn try_gpu(index: usize) -> Result<Device> {
        gpu_available(index)?;
        Ok(Device::gpu(index))
    }

    /// A CPU device of the process of rank `rank` in the distributed
    /// group, `/rank:R/cpu:N`: nodes of a function placed there run in
    /// that process, joined to the others by Send/Recv pairs over the
    /// group's point-to-point transport. `/rank:R/cpu:N` of this process's
    /// own rank runs ops eagerly as `cpu:N` does.
    pub fn on_rank(rank: usize, index: usize) -> Device {
        intern(
            format!("/rank:{rank}/cpu:{index}"),
            (DeviceKind::Cpu, index, Some(rank)),
            || {
                Arc::new(RankedOpHandler {
                    rank,
                    name: format!("/rank:{rank}/cpu:{index}"),
                    local: CpuOpHandler::new(index),
                })
            },
            false,
        )
        .expect("interning an existing or new ranked device cannot fail")
    }

    /// Parses `cpu`, `cpu:0`, `cpu:1`, ... (`cpu:N` for N > 0 are virtual
    /// CPU devices), `/rank:R/cpu:N` (a CPU device of the process of rank
    /// R, see [`Device::on_rank`]; `/rank:R` alone is its `cpu:0`), or the
    /// name of a registered custom device.
    pub fn parse(name: &str) -> Result<Device> {
        let name = name.trim();
        if let Some(rest) = name.strip_prefix("/rank:") {
            let (rank, local) = rest.split_once('/').unwrap_or((rest, "cpu:0"));
            let bad = |why: &str| {
                Error::new(
                    ErrorKind::Device,
                    format!("bad device `{name}`: {why} (expected /rank:R/cpu:N)"),
                )
            };
            let rank = rank
                .parse::<usize>()
                .map_err(|_| bad("the rank is not a number"))?;
            if rank > 1 << 20 {
                return Err(bad("the rank is too large"));
            }
            let local = Device::parse(local)?;
            if local.kind() != DeviceKind::Cpu || local.rank().is_some() {
                return Err(bad("a rank has CPU devices only"));
            }
            return Ok(Device::on_rank(rank, local.index()));
        }
        let (kind, index) = match name.split_once(':') {
            Some((kind, index)) => (kind, Some(index)),
            None => (name, None),
        };
        if let Some(target) = name.strip_prefix("lazy:") {
            return Ok(Device::lazy(&Device::parse(target)?));
        }
        if name == "host" {
            return Ok(Device::host());
        }
        if kind == "gpu" || kind == "cpu" {
            let index = match index {
                None => 0,
                Some(text) => text.parse::<usize>().map_err(|_| {
                    Error::new(
                        ErrorKind::Device,
                        format!(
                            "bad device index in `{name}`: expected {kind}:N with N = 0, 1, ..."
                        ),
                    )
                })?,
            };
            if kind == "gpu" {
                return Device::try_gpu(index);
            }
            if index > 1024 {
                return Err(Error::new(
                    ErrorKind::Device,
                    format!("device index {index} in `{name}` is too large"),
                ));
            }
            return Ok(Device::cpu_n(index));
        }
        let all = devices().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(existing) = all.iter().find(|d| d.name == name) {
            return Ok(Device(existing));
        }
        Err(Error::new(
            ErrorKind::Device,
            format!(
                "unknown device `{name}`: known kinds are `cpu:N`, `gpu:N` and registered devices ({})",
                all.iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ))
    }

    /// The lazy device over `target`: ops on its tensors are recorded, not
    /// run, and materialized as one compiled trace on `target` when a value
    /// is needed or at [`crate::lazy::mark_step`].
    pub fn lazy(target: &Device) -> Device {
        let target = *target;
        intern(
            format!("lazy:{}", target.name()),
            (DeviceKind::Lazy, target.index(), None),
            || Arc::new(crate::lazy::LazyOpHandler::new(target)),
            false,
        )
        .expect("interning an existing or new lazy device cannot fail")
    }

    /// For a lazy device, the device its traces run on.
    pub fn lazy_target(&self) -> Option<Device> {
        if self.kind() != DeviceKind::Lazy {
            return None;
        }
        Device::parse(self.name().strip_prefix("lazy:")?).ok()
    }

    /// Registers a device with its own op handler under a new name.
    pub fn register(name: &str, handler: Arc<dyn OpHandler>) -> Result<Device> {
        if name.starts_with("cpu")
            || name.starts_with("gpu")
            || name.starts_with("/rank:")
            || name == "host"
        {
            return Err(Error::new(
                ErrorKind::Device,
                "`host` and device names starting with `cpu`, `gpu` or `/rank:` are reserved",
            ));
        }
        intern(
            name.to_string(),
            (DeviceKind::Custom, 0, None),
            || handler,
            true,
        )
    }

    /// The device's name, e.g. `cpu:0`.
    pub fn name(&self) -> &'static str {
        &self.0.name
    }

    /// The device's kind.
    pub fn kind(&self) -> DeviceKind {
        self.0.kind
    }

    /// The index within its kind (`cpu:1` has index 1).
    pub fn index(&self) -> usize {
        self.0.index
    }

    /// The rank of the process a `/rank:R/...` device belongs to; `None`
    /// for a device named without a rank (this process's own).
    pub fn rank(&self) -> Option<usize> {
        self.0.rank
    }

    /// True for a `/rank:R/...` device of another process than this one.
    pub fn is_remote(&self) -> bool {
        self.0
            .rank
            .is_some_and(|r| r != stagecraft_cpu::collective::communicator().rank())
    }

    /// An error unless this process can hold tensors and run ops on the
    /// device: another process's `/rank:R/...` device is reached only by
    /// placing nodes of a function there.
    pub fn ensure_in_this_process(&self) -> Result<()> {
        if self.is_remote() {
            return Err(remote_device_error(*self));
        }
        Ok(())
    }

    /// The same device named without a rank (`/rank:R/cpu:N` is `cpu:N`).
    pub fn without_rank(&self) -> Device {
        match self.0.rank {
            Some(_) => Device::cpu_n(self.0.index),
            None => *self,
        }
    }

    /// The op handler that executes ops on this device.
    pub fn handler(&self) -> &'static dyn OpHandler {
        &*self.0.handler
    }

    /// Waits until the work submitted to this device has finished, as
    /// `torch.cuda.synchronize()` does. A GPU value is ready when its
    /// kernels are recorded, so timing GPU work needs this (or a value read
    /// back);
    /// on the CPU a ready value is done and this returns at once. A lazy
    /// device waits for the device its traces run on; recorded ops that
    /// no step has run yet are not run.
    pub fn synchronize(&self) -> Result<()> {
        self.handler().synchronize()
    }
}

#[cfg(feature = "wgpu")]
fn gpu_handler(index: usize) -> Arc<dyn OpHandler> {
    Arc::new(crate::gpu_handler::GpuOpHandler::new(index))
}

#[cfg(feature = "wgpu")]
fn gpu_available(index: usize) -> Result<()> {
    stagecraft_wgpu::Gpu::get(index).map(|_| ())
}

#[cfg(not(feature = "wgpu"))]
fn gpu_handler(index: usize) -> Arc<dyn OpHandler> {
    Arc::new(NoGpuOpHandler {
        name: format!("gpu:{index}"),
    })
}

#[cfg(not(feature = "wgpu"))]
fn gpu_available(_index: usize) -> Result<()> {
    Err(no_gpu_feature())
}

#[cfg(not(feature = "wgpu"))]
fn no_gpu_feature() -> Error {
    Error::new(
        ErrorKind::Device,
        "this stagecraft was built without GPU support: enable the `wgpu` feature \
         (`stagecraft = { version = \"0.1\", features = [\"wgpu\"] }`, or \
         `cargo build --features stagecraft/wgpu`)",
    )
}

/// `gpu:N` in a build without the `wgpu` feature: every op is the error
/// that names the feature.
#[cfg(not(feature = "wgpu"))]
struct NoGpuOpHandler {
    name: String,
}

#[cfg(not(feature = "wgpu"))]
impl OpHandler for NoGpuOpHandler {
    fn name(&self) -> &str {
        &self.name
    }

    fn execute(&self, mut invocation: OpInvocation<'_>) -> Results {
        invocation.release_chain();
        let error = no_gpu_feature()
            .with_op(invocation.op.name)
            .at(invocation.location);
        invocation
            .outputs
            .iter()
            .map(|meta| TensorHandle::error(invocation.device, meta.clone(), error.clone()))
            .collect()
    }
}

/// The handler of `/rank:R/cpu:N`: this process runs its ops only when R
/// is its own rank; another process's device is reached by placing nodes
/// of a function there, never by eager ops.
struct RankedOpHandler {
    rank: usize,
    name: String,
    local: CpuOpHandler,
}

impl OpHandler for RankedOpHandler {
    fn name(&self) -> &str {
        &self.name
    }

    fn execute(&self, mut invocation: OpInvocation<'_>) -> Results {
        if stagecraft_cpu::collective::communicator().rank() == self.rank {
            return self.local.execute(invocation);
        }
        invocation.release_chain();
        let error = remote_device_error(invocation.device)
            .with_op(invocation.op.name)
            .at(invocation.location);
        invocation
            .outputs
            .iter()
            .map(|meta| TensorHandle::error(invocation.device, meta.clone(), error.clone()))
            .collect()
    }

    fn host_kernels(&self) -> Option<&crate::cpu_handler::KernelCache> {
        self.local.host_kernels()
    }

    fn kernel_cache_stats(&self) -> Option<crate::cpu_handler::KernelCacheStats> {
        self.local.kernel_cache_stats()
    }
}

/// The error of eager work on another process's device.
fn remote_device_error(device: Device) -> Error {
    let communicator = stagecraft_cpu::collective::communicator();
    Error::new(
        ErrorKind::Device,
        format!(
            "{device} is a device of another process (this is rank {} of {}): place nodes of a \
             `function` there (every process runs the function; Send/Recv pairs carry values \
             between them), do not run ops on it eagerly",
            communicator.rank(),
            communicator.size()
        ),
    )
}

impl PartialEq for Device {
    fn eq(&self, other: &Device) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for Device {}

impl std::hash::Hash for Device {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.0 as *const DeviceInner).hash(state)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.name)
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.0.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_interns_devices() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::cpu());
        assert_eq!(Device::parse("cpu:0").unwrap(), Device::cpu());
        let d1 = Device::parse("cpu:1").unwrap();
        assert_ne!(d1, Device::cpu());
        assert_eq!(d1, Device::parse(" cpu:1 ").unwrap());
        assert_eq!(d1.index(), 1);
        assert_eq!(d1.to_string(), "cpu:1");
        assert_eq!(Device::parse("host").unwrap(), Device::host());
        assert_eq!(Device::host().kind(), DeviceKind::Host);
        let r1 = Device::parse("/rank:1/cpu:2").unwrap();
        assert_eq!(
            (r1.rank(), r1.index(), r1.kind()),
            (Some(1), 2, DeviceKind::Cpu)
        );
        assert_eq!(r1.to_string(), "/rank:1/cpu:2");
        assert_eq!(r1, Device::on_rank(1, 2));
        assert_ne!(r1, Device::parse("cpu:2").unwrap());
        assert_eq!(r1.without_rank(), Device::parse("cpu:2").unwrap());
        assert_eq!(Device::parse("/rank:3").unwrap(), Device::on_rank(3, 0));
        // A single process is rank 0 of 1.
        assert!(r1.is_remote());
        assert!(!Device::on_rank(0, 0).is_remote());
        assert!(!Device::cpu().is_remote());
        #[cfg(not(feature = "wgpu"))]
        {
            let err = Device::parse("gpu:0").unwrap_err();
            assert!(err.to_string().contains("`wgpu` feature"), "{err}");
        }
        for bad in [
            "gpu:x",
            "tpu:0",
            "cpu:x",
            "cpu:-1",
            "",
            "cpu:99999999999999999999",
            "/rank:x/cpu:0",
            "/rank:1/host",
            "/rank:1/rank:2/cpu:0",
            "/rank:1/lazy:cpu:0",
        ] {
            let err = Device::parse(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Device, "{bad}: {err}");
        }
    }
}
